/* reduce: the sum of a tile's gradient copies, over the ranks of a distributed run
 * (runtime/step/dist.c: in host memory, where StarPU-MPI sends and receives them) or over the
 * devices of one process (runtime/step/compute.c: on the devices, GPUs or CPU workers), a copy of
 * one, and the sum of squares of a gradient (CPU). */
#ifndef MT_CODELETS_REDUCE_H
#define MT_CODELETS_REDUCE_H

#include "codelets/common.h"

/* grad_sum: buffers [0..n-1] the n ranks' (or devices') fp32 gradients in order, the one at
 * position args.own RW (receiving the sum), the others R; every element becomes
 * ((g_0 + g_1) + g_2) + ... in that order, so the owner's position does not change the bits, nor
 * does the worker: CPU, or CUDA with own 0. */
typedef struct mt_grad_sum_args {
    int own;
} mt_grad_sum_args;
extern struct starpu_codelet mt_cl_grad_sum;

/* grad_copy: [0] fp32 gradient R, [1] fp32 gradient W of the same length: a copy (CPU or CUDA). */
extern struct starpu_codelet mt_cl_grad_copy;

/* grad_sumsq: [0] fp32 gradient R, [1] one double W: its sum of squares (mt_cpu_sumsq_f32). */
extern struct starpu_codelet mt_cl_grad_sumsq;

#endif
