/* fill: sets an fp32 vector to a value, on a CPU or a CUDA worker. */
#ifndef MT_CODELETS_FILL_H
#define MT_CODELETS_FILL_H

#include "codelets/common.h"

/* fill: [0] fp32 vector W; arg: float value */
extern struct starpu_codelet mt_cl_fill;

#endif
