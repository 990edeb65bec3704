/* The StarPU codelets of a training step: what each task reads and writes (buffer order and
 * access modes) and the arguments it takes. Every codelet has a CPU implementation, so a run
 * without a GPU executes the same graph. Kernel contracts are in backends/cpu/ops.h. */
#ifndef MT_CODELETS_CODELETS_H
#define MT_CODELETS_CODELETS_H

#include <stdbool.h>
#include <stdint.h>

#include "codelets/mt_starpu.h"

#include "backends/cpu/ops.h"
#include "runtime/state.h"

#include "mt_build_config.h"
#if MT_HAVE_CUDA
#include "backends/cuda/kernels.h"

/* The CUDA backend's precision for a dtype of the streamed weights: bf16 weights compute on the
 * tensor cores, fp32 weights compute in fp32 throughout. */
static inline mt_cuda_prec mt_codelet_cuda_prec(mt_dtype weights)
{
    return weights == MT_DTYPE_F32 ? MT_CUDA_F32 : MT_CUDA_BF16;
}
#endif

/* Arguments shared by the compute codelets (passed by value). The state pointer is used only
 * for the config, the layouts and the dtype, never for tile memory. */
typedef struct mt_compute_args {
    const mt_host_state *st;
    int64_t B, T;            /* sequences and tokens per sequence of this micro-batch */
    bool save;               /* layer forward: also write the saved activations */
    bool accumulate;         /* backward: add into the gradient (RW) instead of overwriting (W) */
    double loss_scale;       /* head: d(step loss)/d(per-token loss), 1 / counted tokens of the step */
    int64_t head_chunk;      /* head: rows per chunk */
    bool sumsq;              /* backward/head: a last buffer (1 double, W) receives the sum of
                              * squares of the gradient tile just written (for clipping) */
    bool table_sumsq;        /* head, tied, with sumsq: one more buffer after it (1 double, W)
                              * receives that of the table's gradient as the head leaves it (a
                              * predictor for ranged speculation: mt_ranged_args) */
} mt_compute_args;

/* Bytes of the buffers a codelet needs on the kind of worker that runs it (gpu: the CUDA op's,
 * which keeps activations of the weights' dtype; else the CPU op's own fp32 scratch plus, for
 * bf16 weights, an fp32 copy of the tile). A graph's compute runs on one kind only (step.c), so its buffers are
 * sized for that kind; the memory plan (runtime/plan.c) counts the same numbers. Without CUDA
 * in the build, gpu is ignored. */
size_t mt_codelet_layer_scratch_bytes(const mt_model_config *cfg, mt_dtype weights, bool gpu, int64_t B, int64_t T);
size_t mt_codelet_head_scratch_bytes(const mt_model_config *cfg, mt_dtype weights, bool gpu, int64_t chunk);
size_t mt_codelet_layer_saved_bytes(const mt_model_config *cfg, mt_dtype weights, bool gpu, int64_t B, int64_t T);

/* Writes the sum of squares of a gradient tile into the task's sumsq buffer (CPU). */
void mt_codelet_sumsq_cpu(void *grad_buffer, void *sumsq_buffer);

/* fp32 view of a tile's streamed weights inside a CPU task: the buffer itself for fp32, or
 * its conversion into tmp (numel floats) for bf16. */
const float *mt_codelet_weights_f32(const mt_host_state *st, void *buffer, float *tmp);

/* The gradient's sum of squares per tile over the last norms, written by the clip task (when
 * given one) and read by ranged runs to predict the norm of the step they belong to. Two
 * slots, by norm sequence number: the clip task of norm s writes slot s % 2 while ranged runs
 * of norm s read slot (s - 1) % 2. */
enum { MT_NORM_MEMORY_MAX = 16 };
typedef struct mt_norm_history {
    int ntiles;
    int64_t seq[2];        /* the norm each slot holds; 0: none */
    double *sumsq[2];      /* (ntiles + 1) each: the tiles', then (tied, ranged) that of the table's
                            * gradient as the head left it (mt_compute_args.table_sumsq), else 0 */
    uint8_t *held[2];      /* ntiles each: held[s % 2][f], whether the range of a ranged run of
                            * tile f for norm s, predicted from norm s - 1, held (its scale was
                            * inside); all 1 when norm s - 1 was not recorded */
    double spread;         /* the ranged runs' spread at least (the rest of the norm's square is
                            * taken to lie within spread times of its prediction either way) */
    double grow;           /* > spread: the runs of norm s + 1 take spread times the largest error
                            * of the predictions of norms s - memory + 1 .. s (actual rest over the
                            * predicted one, or the inverse, over the tiles), up to grow: a norm
                            * that moves more than the prediction follows widens the next ranges.
                            * <= spread: fixed */
    int memory;            /* the largest error over the last `memory` norms (1..MT_NORM_MEMORY_MAX;
                            * 0: 1) sets the spread of the next ranges: errors come in runs of
                            * several norms, so one norm that the prediction followed does not
                            * narrow the ranges back at once */
    double worst[MT_NORM_MEMORY_MAX]; /* worst[s % MT_NORM_MEMORY_MAX]: norm s's prediction's
                            * largest error over the tiles (>= 1), when worst_seq there is s */
    int64_t worst_seq[MT_NORM_MEMORY_MAX];
    double next_spread[2]; /* next_spread[s % 2]: the spread of the ranged runs of norm s + 1, set
                            * with slot s (0: spread) */
    bool check;            /* ranged runs of norm s + 1 skip tile f when held[s % 2][f] is 0: they
                            * would most likely be redone whole (the norm moves in ways the
                            * prediction does not follow, as when a model memorises its batch) */
    double *log;           /* NULL, or room for log_cap norms: norm s's slot copied to row
                            * s - 1 - log_from (norms log_from + 1 .. log_from + log_cap) */
    int64_t log_from, log_cap;
} mt_norm_history;
/* Called by the clip task once it wrote norm seq's sums into slot seq % 2: sets the slot's seq,
 * its held (from the slot of norm seq - 1, for the clipping bound `clip`) and next_spread, and
 * copies it into the log. */
void mt_codelet_norm_recorded(mt_norm_history *h, int64_t seq, double clip);
/* The extra argument of a MT_ADAMW_RANGED run, after `clipped`. Its range comes from the sums
 * of squares already in when it runs: [6] is the known buffer (mt_cl_known) of its tile,
 * first_tile: S_known, the sum of those of tiles first_tile..ntiles-1 (the backward's order puts
 * them all before this chunk's tile, or is this tile), then with head_table that of the table's
 * gradient as the head left it, H. S_known bounds the norm from below, so the scale from above.
 * The rest of the norm is predicted from norm seq - 1 (hist): its other tiles, times the ratio
 * of (S_known + H) to the same sums then; the range covers a rest between rest / spread and
 * rest * spread (the history's next_spread). Without that history the range is [lo, hi]
 * (given), capped by the bound. A range wider than max_ratio (hi / lo; times the growth of the
 * spread over its floor) would flag too much to pay: the run then writes nothing and its confirm
 * does the whole chunk. The range only decides the work: the confirm checks the
 * scale against it. */
typedef struct mt_ranged_args {
    mt_norm_history *hist;
    int64_t seq;           /* this step's norm (>= 1) */
    int first_tile;
    bool head_table;
    double clip, max_ratio;
    double lo, hi;
} mt_ranged_args;

/* embedding_forward: [0] embed weights R, [1] tokens (int32, ntok) R, [2] h0 (ntok, d) W */
extern struct starpu_codelet mt_cl_embedding_forward;
/* embedding_backward: [0] tokens R, [1] dh0 (ntok, d) R, [2] embed grad W|RW (accumulate),
 *   [3] scratch SCRATCH, then the sumsq buffer when args.sumsq */
extern struct starpu_codelet mt_cl_embedding_backward;
/* The early path of the table's update (step.c, submit_embedding_early), per AdamW chunk, on CPU
 * workers. Args of both: mt_embed_chunk_args.
 * embedding_update_early: the weights half of AdamW on the chunk, as adamw_params, on the
 *   gradient as the head left it (the whole gradient of every row no token touches), and the
 *   chunk's row sums of squares of it: [0] master R, [1] m R, [2] v R, [3] gradient R, [4]
 *   streamed weights W, [5] row sums W (one double per row overlapping the chunk; mt_codelet_
 *   chunk_row_sumsq); ranged, [6] flags W and [7] the head tile's known buffer R; deferred,
 *   master, m and v RW, [8] the last update's gradient chunk R and [9] its clip buffer R.
 * embedding_backward_chunk: the embedding backward on the chunk, after it: [0] gradient RW, then
 *   per micro-batch tokens R and dh0 (ntok, d) R, then master, m, v R and the streamed weights RW;
 *   the rows the step's tokens touch get the weights half again, now on the whole gradient. With
 *   `sumsq`, then the row sums RW (the touched rows' redone) and the chunk's sum of squares W. */
typedef struct mt_embed_chunk_args {
    int64_t offset;          /* the chunk's first element in the table */
    int64_t d, ntok;         /* hidden size; tokens per micro-batch */
    int micro_batches;
    bool sumsq;
    mt_adamw_params p;       /* unclipped: the weights half as if the clip scale were 1 */
    mt_dtype dtype;          /* of the streamed weights */
    bool ranged;             /* ranged speculation instead (bf16): embedding_update_early runs
                              * it with `ra` (its flags buffer W and the head tile's known buffer
                              * R after [5]: mt_cl_known); embedding_backward_chunk flags the rows the
                              * tokens touch instead of redoing them (the flags buffer RW last) */
    mt_ranged_args ra;
    bool deferred;           /* ranged: embedding_update_early runs the last update's moments
                              * half too (its master, m and v RW; the last gradient and clip
                              * buffer R after the known buffer) */
    mt_adamw_params po;      /* deferred: the last update's parameters (unclipped) */
} mt_embed_chunk_args;
extern struct starpu_codelet mt_cl_embedding_update_early;
extern struct starpu_codelet mt_cl_embedding_backward_chunk;
/* sum_partials: [0..n-1] one double each R, [n] one double W: their sum, in order. */
extern struct starpu_codelet mt_cl_sum_partials;
/* layer_forward: [0] layer weights R, [1] x R, [2] y W, [3] scratch SCRATCH,
 *                [4] saved W (only when args.save) */
extern struct starpu_codelet mt_cl_layer_forward;
/* layer_backward: [0] weights R, [1] saved R, [2] dy R, [3] dx W, [4] layer grad W|RW,
 *                 [5] scratch SCRATCH, then the sumsq buffer when args.sumsq */
extern struct starpu_codelet mt_cl_layer_backward;
/* head (loss anchor, forward + backward): [0] head weights R, [1] h_L R, [2] targets R,
 *   [3] dh_L W, [4] head grad W|RW, [5] loss (2 doubles: sum, count) W, [6] scratch SCRATCH,
 *   and when tied: [7] embed weights R, [8] embed grad (same W|RW as [4]); then the sumsq
 *   buffer of the head tile when args.sumsq, then the table's when args.table_sumsq */
extern struct starpu_codelet mt_cl_head;
/* head_eval (loss only): [0] head weights R, [1] h_L R, [2] targets R, [3] loss W,
 *   [4] scratch SCRATCH, [5] embed weights R when tied */
extern struct starpu_codelet mt_cl_head_eval;
/* clip: [0..n-1] partials R, [n] clip (2 doubles: global norm, scale) W, then optionally the
 *   table's head-part sum of squares R (recorded, not summed); args: double max_norm,
 *   mt_norm_history * (or NULL), int64_t seq (the slot it records the partials in) */
extern struct starpu_codelet mt_cl_clip;
/* known (ranged speculation, mt_ranged_args), when a tile's backward ends: [0] its partial R, then
 *   the known buffer of the tile whose backward came just before R (arg int from_head = 0), or
 *   for the first tile (from_head = 1) optionally the table's head-part sum of squares R; last
 *   the tile's known buffer W (2 doubles: the sums of squares of this tile and of those whose
 *   backward came before it; the table's head part) */
extern struct starpu_codelet mt_cl_known;
/* adamw: [0] master RW, [1] m RW, [2] v RW, [3] grad R, [4] streamed weights W,
 *   [5] clip R (when clipped); args: mt_adamw_params, mt_dtype, int clipped (mt_adamw_clip). */
extern struct starpu_codelet mt_cl_adamw;
/* The `clipped` argument of the AdamW codelets. */
enum mt_adamw_clip {
    MT_ADAMW_UNCLIPPED = 0,  /* no clip buffer */
    MT_ADAMW_CLIPPED = 1,    /* the gradient times the clip task's scale */
    /* adamw_params only: confirms a speculative unclipped run on the same inputs (which wrote
     * the weights, so [4] is RW): does nothing when the scale is 1 (that run was exact: the
     * clipped kernel multiplies by 1.0), else writes the clipped result over it. */
    MT_ADAMW_CONFIRM = 2,
    /* adamw_params only, bf16 streamed weights: a speculative run for a range of scales
     * [cl, ch] decided when it runs (mt_ranged_args); [5] is then the flags buffer (W): the
     * range used and a bitmap (one bit per element) of the elements whose bf16 weight could
     * differ within it (the rest round to the same bf16 value for any of those scales: the fp32
     * result is bounded over the range, with a margin for its rounding, and both bounds round
     * alike); [6..] the sums of squares of the tiles mt_ranged_args names (R). */
    MT_ADAMW_RANGED = 3,
    /* adamw_params only: confirms a ranged run: [4] weights RW, [5] clip R, [6] the flags R.
     * Scale inside the range: redoes the flagged elements with it; outside: the whole chunk. */
    MT_ADAMW_CONFIRM_RANGED = 4,
    /* adamw_params only: MT_ADAMW_RANGED after the last step's moments half of the same chunk
     * (mt_step_config.adamw_defer), block by block, in place: [0..2] master, m and v RW, then as
     * MT_ADAMW_RANGED ([3] this step's gradient, [4] weights W, [5] flags W, [6] known R), [7]
     * the last step's gradient R, [8] its clip buffer R; one more argument after the
     * mt_ranged_args: the last step's mt_adamw_params. The range too wide: the moments half only. */
    MT_ADAMW_RANGED_DEFERRED = 5,
};
/* Bytes of a ranged run's flags buffer for a chunk of n elements (the range, whole 64-bit
 * words of bitmap, then room for the inputs of up to n/16 flagged elements: codelets/adamw.c,
 * ranged_header), and where its bitmap starts. */
size_t mt_codelet_ranged_bitmap_bytes(int64_t n);
/* The side entries' room in a flags buffer: 1/R of its chunk's elements (16 unless
 * MT_RANGED_SIDE_ROOM says otherwise; fixed for the process). */
int mt_codelet_ranged_side_room(void);
const uint64_t *mt_codelet_ranged_bits(const void *flags);
/* A flags buffer for a chunk of n elements made empty, for callers of mt_codelet_ranged_pass that
 * set the range in p themselves (ranged_begin does this itself). */
void mt_codelet_ranged_reset(void *flags, int64_t n);
/* The pieces of a ranged run, for the table's early path (embedding.c) too. ranged_begin: decides
 * the range of a chunk of n elements from `known` (mt_ranged_args) and writes it at the head of
 * its flags buffer (head_table: mt_ranged_args); when narrow enough, clears the bitmap, sets p's
 * grad_scale and grad_scale_lo to the range and returns true; else marks the chunk for its
 * confirm to do whole. ranged_pass: over elements [o, o + n) of the chunk, their flags and the
 * weights of the unflagged ones (the same for every scale in the range; the flagged ones' are
 * left to the redo); returns how many it flagged. ranged_flag: flags elements [o, o + n) (their
 * gradient is still to change: the confirm redoes them). */
bool mt_codelet_ranged_begin(void *flags, int64_t n, double known, double head_table, const mt_ranged_args *a,
                             mt_adamw_params *p);
int64_t mt_codelet_ranged_pass(int64_t o, int64_t n, const float *master, const float *grad, const float *m,
                               const float *v, void *weights, mt_dtype dtype, const mt_adamw_params *p, void *flags);
void mt_codelet_ranged_flag(int64_t o, int64_t n, void *flags);
/* A deferred update's pass over elements [o, o + n) of a chunk (MT_ADAMW_RANGED_DEFERRED, and
 * the table's early path row by row, in element order as ranged_pass): the last
 * step's moments half (master, m and v in place from its gradient `old`, po with its scale: the
 * kernel's operations on the same values as adamw_moments, so the same bits), then this step's
 * ranged run on the new values (grad, p with the range set by mt_codelet_ranged_begin) into
 * weights and flags; flags NULL: the moments half only. With the vector bounds both run in one
 * loop, 8 or 16 elements at a time; with the exact ones block by block, each block still in
 * cache for the second. One pass over master, m and v instead of two: 34 bytes per parameter
 * against 46. Returns how many it flagged (0 without flags). */
int64_t mt_codelet_ranged_pass_deferred(int64_t o, int64_t n, float *master, const float *old, const float *grad,
                                        float *m, float *v, void *weights, mt_dtype dtype, const mt_adamw_params *po,
                                        const mt_adamw_params *p, void *flags);
/* How ranged passes bound their weights (codelets/adamw.c): AVX2 on x86-64 CPUs with AVX2 and
 * FMA in 8 lanes with approximate reciprocals refined by a Newton step; AVX512, the default, the
 * same in 16 lanes where the CPU has AVX-512 F, VL, DQ and BW (else as AVX2); EXACT divides, in
 * plain C, as on other CPUs (where the others fall back to it). All flag soundly, not quite
 * alike (tests and tools/adamw_bw compare them). set_bounds applies to the passes that start
 * after it; bounds_name says what they run on this CPU. */
typedef enum mt_ranged_bounds { MT_RANGED_BOUNDS_AVX2, MT_RANGED_BOUNDS_AVX512, MT_RANGED_BOUNDS_EXACT } mt_ranged_bounds;
#define MT_RANGED_BOUNDS_DEFAULT MT_RANGED_BOUNDS_AVX512
void mt_codelet_ranged_set_bounds(mt_ranged_bounds b);
const char *mt_codelet_ranged_bounds_name(void);
/* The bounds the passes run now on this CPU (set_bounds, less what the CPU lacks), and b's
 * name as options spell it: avx2, avx512, exact. */
mt_ranged_bounds mt_codelet_ranged_bounds_used(void);
const char *mt_codelet_ranged_bounds_option(mt_ranged_bounds b);
/* The confirm's redo of a chunk of n elements whose scale fell inside its range: the weights
 * half (p: with the scale) of the flagged elements, bf16 streamed weights w. */
void mt_codelet_ranged_redo(int64_t n, const void *flags, const float *master, const float *grad, const float *m,
                            const float *v, mt_bf16 *w, const mt_adamw_params *p);
/* Elements, since the process began: ranged runs have checked, and of those flagged; ranged
 * runs skipped (range too wide); confirms redid whole because the scale was outside the range,
 * and of those, below it (the rest of the norm came out larger than predicted). */
typedef struct mt_ranged_counts {
    int64_t checked, flagged, skipped, outside, below;
    int64_t unheld;        /* of skipped: the last norm's prediction for the tile missed */
    /* of those, the table's on its early path (mt_codelet_ranged_table_add): checked, flagged,
     * and the elements of the rows the step's tokens touch, flagged whole by its embedding
     * backward (their gradient changed after the ranged run) */
    int64_t table_checked, table_flagged, table_touched;
    /* redone (mt_codelet_ranged_redo): flagged elements whose inputs came from the side entries,
     * and the others, read from master, grad, m and v (past a chunk's room for entries, stale
     * entries, words redone whole) */
    int64_t redo_side, redo_arrays;
} mt_ranged_counts;
void mt_codelet_ranged_table_add(int64_t checked, int64_t flagged, int64_t touched);
mt_ranged_counts mt_codelet_ranged_counts(void);
/* Seconds CPU workers spent in AdamW tasks (adamw, adamw_params, adamw_moments,
 * embedding_update_early) since the process started; mt_codelet_adamw_time_add adds to it,
 * mt_codelet_now_ns is its clock (CLOCK_MONOTONIC). */
double mt_codelet_adamw_seconds(void);
/* The same time by kind of task, for bench to say where AdamW's CPU time goes. */
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
void mt_codelet_adamw_seconds_by_kind(double out[MT_AK_COUNT]);
void mt_codelet_adamw_time_add(mt_adamw_kind kind, int64_t ns);
int64_t mt_codelet_now_ns(void);
/* The same update split in two (equal to adamw bit for bit when both run on the same inputs):
 * adamw_params: [0] master R, [1] m R, [2] v R, [3] grad R, [4] streamed weights W, [5] clip R
 *   (optional); args as adamw, then an mt_ranged_args (read by MT_ADAMW_RANGED runs). Writes
 *   the weights the next forward needs, and only those.
 * adamw_moments: [0] master RW, [1] m RW, [2] v RW, [3] grad R, [4] clip R (optional); args:
 *   mt_adamw_params, int clipped. Must run after adamw_params of the same chunk (it overwrites
 *   what that reads). */
extern struct starpu_codelet mt_cl_adamw_params;
extern struct starpu_codelet mt_cl_adamw_moments;
/* The weights half of AdamW over elements [o, o + n) of a chunk (pointers at the chunk's start):
 * the streamed weights of those elements, bit for bit what adamw_params writes there. */
void mt_codelet_adamw_params_range(int64_t o, int64_t n, const float *master, const float *grad, const float *m,
                                   const float *v, void *weights, mt_dtype dtype, const mt_adamw_params *p);
/* The sum of squares of the table's gradient (rows of d elements) as every CPU path forms it, so
 * that they give the same bits: per AdamW chunk, per row part in double (mt_codelet_chunk_row_sumsq),
 * the rows added in order, then the chunks in order. */
double mt_codelet_tile_sumsq(const mt_tile *t, const float *grad, int64_t d);
/* Rows of d elements that overlap the chunk [off, off + n). */
static inline int64_t mt_codelet_chunk_rows(int64_t off, int64_t n, int64_t d) { return (off + n - 1) / d - off / d + 1; }
/* rows[i] = sum of squares of row (off / d + i)'s part of the chunk g = [off, off + n). */
void mt_codelet_chunk_row_sumsq(const float *g, int64_t off, int64_t n, int64_t d, double *rows);
/* The chunk's sum of squares from its nrows row sums, in row order. */
double mt_codelet_sum_rows(const double *rows, int64_t nrows);
/* fill: [0] fp32 vector W; arg: float value */
extern struct starpu_codelet mt_cl_fill;

#endif
