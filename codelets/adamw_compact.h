/* AdamW as StarPU codelets for the compact host layout (docs/design.md, section 1.1), one task per
 * chunk of a tile on CPU workers: the master is two 16-bit planes, the high one the streamed bf16
 * weights, and the gradient is bf16 (backends/cpu/master_planes.h). The fused update and its two
 * halves: the weights half writes the new master (so the next forward's weights) without storing
 * m and v, the moments half writes m and v and needs no master. Both together give the fused
 * result bit for bit. With clipping, the clip task's scale multiplies the gradient first, as in
 * codelets/adamw.h. No speculation: the streamed weights are the master. Arguments of all three:
 * mt_adamw_args (codelets/adamw.h; ranged and last unused). */
#ifndef MT_CODELETS_ADAMW_COMPACT_H
#define MT_CODELETS_ADAMW_COMPACT_H

#include "codelets/adamw.h"

/* adamw_compact: [0] hi (the streamed weights) RW, [1] lo RW, [2] m RW, [3] v RW, [4] grad (bf16)
 *   R, [5] clip R when clipped. */
extern struct starpu_codelet mt_cl_adamw_compact;
/* adamw_compact_weights: [0] hi RW, [1] lo RW, [2] m R, [3] v R, [4] grad R, [5] clip R when
 *   clipped. Must run before the moments half of the same chunk (which overwrites m and v). */
extern struct starpu_codelet mt_cl_adamw_compact_weights;
/* adamw_compact_moments: [0] m RW, [1] v RW, [2] grad R, [3] clip R when clipped. */
extern struct starpu_codelet mt_cl_adamw_compact_moments;

#endif
