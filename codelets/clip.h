/* Global gradient-norm clipping as StarPU codelets: the last backward task of each tile leaves the
 * sum of squares of its gradient; sum_partials adds the table's per chunk when its backward runs
 * in chunks; clip turns the tiles' sums into the norm and the scale every clipped AdamW task of
 * the step reads, and records them for ranged speculation; known keeps, as each tile's backward
 * ends, the sums in so far (what a ranged run's range is decided from, codelets/adamw.h). */
#ifndef MT_CODELETS_CLIP_H
#define MT_CODELETS_CLIP_H

#include <stdbool.h>
#include <stdint.h>

#include "codelets/common.h"

/* torch.nn.utils.clip_grad_norm_'s scale for a norm: max_norm / (norm + 1e-6), applied when
 * below 1. */
static inline double mt_clip_scale(double max_norm, double norm)
{
    const double s = max_norm / (norm + 1e-6);
    return s < 1.0 ? s : 1.0;
}

/* How the clip task records a norm for ranged speculation (runtime/speculate): from the record
 * of the last norm (`last`, R) into this norm's (`record`, W), the tiles' sums of squares and the
 * table's head part (0 without one), and into the log (NULL without one). */
typedef void (*mt_norm_record_fn)(const void *last, void *record, int64_t seq, double clip, const double *sums,
                                  int ntiles, double head_table, void *log);

/* The clip task's arguments (by value). */
typedef struct mt_clip_args {
    double max_norm;
    int ntiles;                /* the partials */
    bool head_table;           /* a buffer after the output: the table's head part, recorded only */
    mt_norm_record_fn record;  /* NULL: nothing recorded */
    int64_t seq;               /* the norm's number, from 1 */
    bool log;                  /* a log buffer last (RW) */
} mt_clip_args;

/* clip: [0..n-1] partials R, [n] clip (2 doubles: global norm, scale) W, then the table's
 *   head-part sum of squares R (head_table); with record, the last norm's record R and this
 *   norm's W, then the log RW (log). */
extern struct starpu_codelet mt_cl_clip;
/* known (ranged speculation, mt_ranged_args), when a tile's backward ends: [0] its partial R, then
 *   the known buffer of the tile whose backward came just before R (arg int from_head = 0), or
 *   for the first tile (from_head = 1) optionally the table's head-part sum of squares R; last
 *   the tile's known buffer W (2 doubles: the sums of squares of this tile and of those whose
 *   backward came before it; the table's head part) */
extern struct starpu_codelet mt_cl_known;
/* sum_partials: [0..n-1] one double each R, [n] one double W: their sum, in order. */
extern struct starpu_codelet mt_cl_sum_partials;

#endif
