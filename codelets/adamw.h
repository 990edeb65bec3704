/* AdamW as StarPU codelets, one task per chunk of a tile, on CPU workers: the fused update, its
 * two halves (the weights the next forward needs, then master, m and v), and the speculative
 * forms clipping uses (docs/design.md): a run as if the clip scale were 1 and its confirm, a
 * ranged run for a range of scales and its confirm, and a ranged run that first finishes the
 * last update's moments half. The kernels are in backends/cpu (adamw.h, ranged.h); how a
 * ranged run's range is decided is the runtime's (runtime/speculate), given to the task as a
 * function. */
#ifndef MT_CODELETS_ADAMW_H
#define MT_CODELETS_ADAMW_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "codelets/common.h"

#include "backends/cpu/ranged.h"

/* The `clipped` argument of the AdamW codelets. */
enum mt_adamw_clip {
    MT_ADAMW_UNCLIPPED = 0,  /* no clip buffer */
    MT_ADAMW_CLIPPED = 1,    /* the gradient times the clip task's scale */
    /* adamw_params only: confirms a speculative unclipped run on the same inputs (which wrote
     * the weights, so [4] is RW): does nothing when the scale is 1 (that run was exact: the
     * clipped kernel multiplies by 1.0), else writes the clipped result over it. */
    MT_ADAMW_CONFIRM = 2,
    /* adamw_params only, bf16 streamed weights: a speculative run for a range of scales
     * [cl, ch] decided when it runs (mt_ranged_args); [5] is then the flags buffer (W,
     * backends/cpu/ranged_flags.h), [6] the known buffer of its tile (R, mt_cl_known), [7] the
     * norm history's record of the last norm (R, runtime/speculate). */
    MT_ADAMW_RANGED = 3,
    /* adamw_params only: confirms a ranged run: [4] weights RW, [5] clip R, [6] the flags R.
     * Scale inside the range: redoes the flagged elements with it; outside: the whole chunk. */
    MT_ADAMW_CONFIRM_RANGED = 4,
    /* adamw_params only: MT_ADAMW_RANGED after the last step's moments half of the same chunk,
     * block by block, in place: [0..2] master, m and v RW, then as MT_ADAMW_RANGED ([3] this
     * step's gradient, [4] weights W, [5] flags W, [6] known R, [7] the last norm's record R),
     * [8] the last step's gradient R, [9] its clip buffer R; mt_adamw_args.last: the last step's
     * parameters. The range too wide: the moments half only. */
    MT_ADAMW_RANGED_DEFERRED = 5,
};

/* Where the AdamW tasks' CPU time goes, by kind of task. */
typedef enum mt_adamw_kind {
    MT_AK_FUSED,            /* adamw: the whole update */
    MT_AK_WEIGHTS,          /* adamw_params: the weights half, plain or speculated as if scale 1 */
    MT_AK_CONFIRM,          /* adamw_params, MT_ADAMW_CONFIRM: the redo of a unit speculation */
    MT_AK_RANGED,           /* adamw_params, MT_ADAMW_RANGED: the ranged pass */
    MT_AK_RANGED_DEFERRED,  /* adamw_params, MT_ADAMW_RANGED_DEFERRED: last moments + ranged pass */
    MT_AK_CONFIRM_RANGED,   /* adamw_params, MT_ADAMW_CONFIRM_RANGED: the redo of flagged elements */
    MT_AK_MOMENTS,          /* adamw_moments: the moments half */
    MT_AK_TABLE_EARLY,      /* embedding_update_early: the table's weights half before its backward */
    MT_AK_COUNT
} mt_adamw_kind;
extern const char *const mt_adamw_kind_names[MT_AK_COUNT];

/* What the AdamW tasks of a graph did: CPU time by kind, and elements by what ranged runs made of
 * them. Owned by the graph, handed to its tasks by pointer; tasks only add to it (atomically),
 * never read it, so it orders nothing and is not StarPU data. Zero-initialised. */
typedef struct mt_adamw_stats {
    atomic_llong ns[MT_AK_COUNT];
    atomic_llong checked, flagged, skipped, outside, below, unheld;
    atomic_llong table_checked, table_flagged, table_touched, redo_side, redo_arrays;
} mt_adamw_stats;

/* A snapshot of the ranged counts: elements ranged runs have checked, and of those flagged;
 * ranged runs skipped (range too wide); confirms redid whole because the scale was outside the
 * range, and of those, below it (the rest of the norm came out larger than predicted). */
typedef struct mt_ranged_counts {
    int64_t checked, flagged, skipped, outside, below;
    int64_t unheld;        /* of skipped: the last norm's prediction for the tile missed */
    /* of those, the table's on its early path: checked, flagged, and the elements of the rows
     * the step's tokens touch, flagged whole by its embedding backward (their gradient changed
     * after the ranged run) */
    int64_t table_checked, table_flagged, table_touched;
    /* redone: flagged elements whose inputs came from the side entries, and the others, read
     * from master, grad, m and v */
    int64_t redo_side, redo_arrays;
} mt_ranged_counts;

mt_ranged_counts mt_adamw_stats_ranged(const mt_adamw_stats *s);
/* Seconds in AdamW tasks: all kinds, and by kind. */
double mt_adamw_stats_seconds(const mt_adamw_stats *s);
void mt_adamw_stats_seconds_by_kind(const mt_adamw_stats *s, double out[MT_AK_COUNT]);
void mt_adamw_stats_time(mt_adamw_stats *s, mt_adamw_kind kind, int64_t ns);

typedef struct mt_ranged_args mt_ranged_args;
/* Why a ranged run does or does not speculate. */
enum { MT_RANGE_NARROW, MT_RANGE_WIDE, MT_RANGE_UNHELD };
/* The range of a ranged run, decided when it runs: from the sums of squares of the tiles in
 * (known: S_known; head_table: H, mt_cl_known), the record of the last norm (`last`, the task's
 * buffer) and a, the range of gradient multipliers [*lo, *hi] for a run whose gradient multiplier
 * is grad_scale at scale 1; returns MT_RANGE_NARROW (speculate), _WIDE or _UNHELD. */
typedef int (*mt_range_fn)(const mt_ranged_args *a, const void *last, double known, double head_table,
                           double grad_scale, double *lo, double *hi);

/* The arguments of a ranged run. Its range comes from the sums of squares already in when it
 * runs: S_known, those of tiles first_tile..ntiles-1 (the backward's order puts them all before
 * this chunk's tile, or is this tile), then with head_table that of the table's gradient as the
 * head left it, H. S_known bounds the norm from below, so the scale from above; the rest of the
 * norm is predicted from the last norm (`range`). Without a last norm the range is [lo, hi],
 * capped by the bound. A range wider than max_ratio would flag too much to pay: the run then
 * writes nothing and its confirm does the whole chunk. The range only decides the work: the
 * confirm checks the scale against it. */
struct mt_ranged_args {
    mt_range_fn range;
    int64_t seq;           /* this step's norm (>= 1) */
    int first_tile;
    bool head_table;
    bool check;            /* a tile whose range for the last norm missed is not speculated */
    double clip, max_ratio;
    double lo, hi;
    int side_room;         /* of the flags buffers (backends/cpu/ranged_flags.h) */
    mt_ranged_bounds bounds;
};

/* The arguments of the AdamW codelets (by value). */
typedef struct mt_adamw_args {
    mt_adamw_params p;     /* this update's, unclipped */
    mt_dtype dtype;        /* of the streamed weights */
    int clipped;           /* mt_adamw_clip */
    mt_adamw_stats *stats;
    mt_ranged_args ranged; /* MT_ADAMW_RANGED and _RANGED_DEFERRED */
    mt_adamw_params last;  /* MT_ADAMW_RANGED_DEFERRED: the last update's parameters, unclipped */
} mt_adamw_args;

/* adamw: [0] master RW, [1] m RW, [2] v RW, [3] grad R, [4] streamed weights W,
 *   [5] clip R (when clipped). */
extern struct starpu_codelet mt_cl_adamw;
/* The same update split in two (equal to adamw bit for bit when both run on the same inputs):
 * adamw_params: [0] master R, [1] m R, [2] v R, [3] grad R, [4] streamed weights W, [5] clip R
 *   (optional), and the buffers of its mt_adamw_clip. Writes the weights the next forward needs,
 *   and only those.
 * adamw_moments: [0] master RW, [1] m RW, [2] v RW, [3] grad R, [4] clip R (optional). Must run
 *   after adamw_params of the same chunk (it overwrites what that reads). */
extern struct starpu_codelet mt_cl_adamw_params;
extern struct starpu_codelet mt_cl_adamw_moments;

/* The start of a ranged run over a chunk of n elements (MT_ADAMW_RANGED, and the table's early
 * path): decides the range (a->range, from known = {S_known, H} and the last norm's record) and
 * begins the flags buffer with it; when narrow enough, sets p's grad_scale and grad_scale_lo to
 * the range and returns true; else marks the chunk for its confirm to do whole. Counts into
 * stats. */
bool mt_codelet_ranged_begin(void *flags, int64_t n, const double known[2], const void *last, const mt_ranged_args *a,
                             mt_adamw_params *p, mt_adamw_stats *stats);

#endif
