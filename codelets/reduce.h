/* reduce: the sum over the ranks of a distributed run of a tile's gradient, and the sum of
 * squares of a gradient (runtime/step/dist.c). CPU only: the gradients meet in host memory,
 * where StarPU-MPI sends and receives them. */
#ifndef MT_CODELETS_REDUCE_H
#define MT_CODELETS_REDUCE_H

#include "codelets/common.h"

/* grad_sum: buffers [0..n-1] the n ranks' fp32 gradients in rank order, the one at position
 * args.own RW (this rank's, receiving the sum), the others R; every element becomes
 * ((g_0 + g_1) + g_2) + ... in rank order, so the owner's position does not change the bits. */
typedef struct mt_grad_sum_args {
    int own;
} mt_grad_sum_args;
extern struct starpu_codelet mt_cl_grad_sum;

/* grad_sumsq: [0] fp32 gradient R, [1] one double W: its sum of squares (mt_cpu_sumsq_f32). */
extern struct starpu_codelet mt_cl_grad_sumsq;

#endif
