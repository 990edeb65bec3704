/* A gradient's home in the compact host layout (docs/design.md, section 1.1): the compute tasks
 * accumulate a tile's gradient in fp32 across micro-batches, then it is rounded once to bf16 for
 * the host, which AdamW reads, and clipping takes the norm of those bf16 values. */
#ifndef MT_BACKENDS_CPU_GRAD_HOME_H
#define MT_BACKENDS_CPU_GRAD_HOME_H

#include <stdint.h>

#include "models/dtype.h"

/* out (n) = acc (n) rounded to bf16 (nearest even, mt_f32_to_bf16); returns the sum of squares of
 * those bf16 values, in double, added in element order. */
double mt_cpu_grad_home(int64_t n, const float *acc, mt_bf16 *out);

#endif
