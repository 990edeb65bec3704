/* One decoder layer as StarPU codelets: forward (optionally keeping what backward needs) and
 * backward (dx, and the layer's weight gradient written or accumulated). Arguments:
 * mt_compute_args (codelets/common.h). The buffer count and the gradient's mode depend on the
 * task (save or not, W or RW): both are given at insertion. */
#ifndef MT_CODELETS_LAYER_H
#define MT_CODELETS_LAYER_H

#include "codelets/common.h"

/* layer_forward: [0] layer weights R, [1] x R, [2] y W, [3] scratch SCRATCH,
 *                [4] saved W (only when args.save), then the router statistics RW when
 *                args.router_stats (never in a recompute: a micro-batch counts once) */
extern struct starpu_codelet mt_cl_layer_forward;
/* layer_backward: [0] weights R, [1] saved R, [2] dy R, [3] dx W, [4] layer grad W|RW,
 *                 [5] scratch SCRATCH, then the sumsq buffer when args.sumsq, then the router
 *                 statistics R when args.router_stats */
extern struct starpu_codelet mt_cl_layer_backward;

#endif
