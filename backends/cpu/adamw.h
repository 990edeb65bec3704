/* AdamW on one chunk with its streamed copy: the fp32 master, m and v of a tile's chunk and the
 * copy of the weights the next forward reads (bf16 or fp32). The per-element kernels are
 * mt_cpu_adamw_f32 and mt_cpu_adamw_params_f32 (ops.h); these loops add the streamed copy,
 * block by block, so that it is written while the block is still in cache (AdamW is bound by
 * memory traffic, and a second pass would read all of master again). */
#ifndef MT_BACKENDS_CPU_ADAMW_H
#define MT_BACKENDS_CPU_ADAMW_H

#include <stdint.h>

#include "backends/cpu/ops.h"
#include "models/dtype.h"

/* Elements per block of the loops below (and of the ranged passes, ranged.h). */
#define MT_CPU_ADAMW_BLOCK 4096

/* The streamed copy of src[0, n) into w (bf16 rounded to nearest even, or fp32 copied). */
void mt_cpu_streamed_copy(int64_t n, const float *src, void *w, mt_dtype dtype);

/* The fused update of a chunk of n elements: master, m and v in place from grad, then the
 * streamed copy of master into weights. */
void mt_cpu_adamw_streamed(int64_t n, float *master, const float *grad, float *m, float *v, void *weights,
                           mt_dtype dtype, const mt_adamw_params *p);

/* The weights half of the update over elements [o, o + n) of a chunk (every pointer at the
 * chunk's start): the streamed weights of those elements, bit for bit the master the fused
 * update would write there; master, grad, m and v are only read. */
void mt_cpu_adamw_weights(int64_t o, int64_t n, const float *master, const float *grad, const float *m,
                          const float *v, void *weights, mt_dtype dtype, const mt_adamw_params *p);

#endif
