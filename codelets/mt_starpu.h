/* Includes starpu.h. With CUDA 13, StarPU 1.4's headers pull cusparse.h, whose deprecated types
 * warn on every include; the warning is silenced for this include only. */
#ifndef MT_CODELETS_MT_STARPU_H
#define MT_CODELETS_MT_STARPU_H

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#include <starpu.h>
#pragma GCC diagnostic pop

#endif
