/* The compact host layout's gradient home as a StarPU codelet (docs/design.md, section 1.1): after
 * the last micro-batch's contribution to a tile, its fp32 accumulator (which has no host home) is
 * rounded to bf16 into the tile's gradient, which streams home through its write-through mask,
 * with the sum of squares of the bf16 values for clipping. It runs where the compute ran. */
#ifndef MT_CODELETS_GRAD_HOME_H
#define MT_CODELETS_GRAD_HOME_H

#include "codelets/common.h"

/* grad_home: [0] accumulator (fp32, numel) R, [1] gradient (bf16, numel) W, then, with clipping,
 *   [2] the tile's sum of squares (1 double) W. No arguments. */
extern struct starpu_codelet mt_cl_grad_home;

#endif
