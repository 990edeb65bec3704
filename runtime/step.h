/* The MegaTrain training step as a StarPU task graph over the host state's handles:
 * streaming forward with a checkpoint every K layers, the loss anchor, block-wise backward
 * (recompute a block from its checkpoint, then backward layer by layer, gradients home), exact
 * global-norm clipping, and AdamW per chunk on CPU workers. Dependencies are data only: no
 * barrier inside a step or between steps. */
#ifndef MT_RUNTIME_STEP_H
#define MT_RUNTIME_STEP_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "backends/cpu/ranged.h"
#include "runtime/state.h"

typedef struct mt_step_config {
    int64_t B, T;          /* micro-batch: B sequences of T tokens */
    int accum;             /* micro-batches per step (gradient accumulation), >= 1 */
    int K;                 /* checkpoint interval in layers, 1..L (need not divide L) */
    double clip;           /* max global gradient norm; 0 = no clipping */
    int64_t head_chunk;    /* rows per LM-head chunk */
    double beta1, beta2, eps, weight_decay;
    int adamw_split;       /* AdamW in two tasks per chunk, weights first (on the critical path),
                            * moments after (off it); -1: every tile when clipping, else the
                            * embedding and layer 0 (the step boundary); 0 never, 1 always.
                            * Bitwise the same result either way. */
    int clip_speculate;    /* With clipping: run each tile's weights half as its gradient lands
                            * and confirm it after the norm (runtime/speculate/speculate.h), so
                            * that the update overlaps the backward as without clipping; exact
                            * either way. 0 never; 1 (unit) always, as if the scale were 1, the
                            * confirm redoing the update when it was not; 2 (ranged): unit when
                            * the last scale read (mt_graph_wait_loss) was 1, else, with bf16
                            * streamed weights, for the range of scales the gradients already in
                            * and the last norm allow (mt_ranged_args, codelets/adamw.h), the
                            * confirm redoing only the elements whose bf16 weight could differ
                            * within it; -1 (auto, the default): as 2 where a GPU runs the
                            * compute, else unit when the last scale was 1 and none otherwise. */
    double clip_range;     /* ranged: the rest of the norm's square is taken to lie within
                            * [predicted / clip_range, predicted * clip_range]; > 1
                            * (0: MT_CLIP_SPREAD_DEFAULT) */
    double clip_range_max; /* ranged: a chunk whose range of scales is wider than this ratio
                            * (times the growth of clip_range below) is not speculated (too many
                            * flagged to pay); > 1 (0: MT_CLIP_RANGE_MAX_DEFAULT) */
    double clip_range_grow; /* ranged: after a norm whose rest the prediction missed by a factor
                            * x, the next ranges take clip_range times x, up to this (a wider
                            * range flags more elements for the redo, a missed one redoes all);
                            * 1: fixed at clip_range; 0: MT_CLIP_RANGE_GROW_DEFAULT */
    int clip_range_memory; /* ranged: x is the largest such factor over the last this many norms
                            * (1..MT_CLIP_RANGE_MEMORY_MAX; 0: MT_CLIP_RANGE_MEMORY_DEFAULT) */
    int clip_range_check;  /* ranged: a tile's chunks are not speculated when the range predicted
                            * for it at the last norm missed: the norm is then moving in ways the
                            * prediction does not follow, and a miss costs the ranged pass and a
                            * whole redo. Nonzero (the default, -1): on; 0: off. Only the work
                            * changes, never the result. */
    int adamw_defer;       /* Ranged speculation: each tile's moments half is not run after the
                            * norm but in the next step, fused with that step's ranged run on the
                            * same chunk (the table's: its early path's), which reads master, m
                            * and v anyway: 34 bytes per parameter a step instead of 46. The
                            * gradient is then double-buffered (a second one, 4 bytes per
                            * parameter, pinned host memory). Bitwise the same results; the last
                            * update's moments are run by mt_graph_flush. 1: with ranged
                            * speculation; -1 (the default): with ranged speculation, when the
                            * second gradient takes at most 80% of the host memory available
                            * when the graph is created; 0 never. */
    mt_ranged_bounds ranged_bounds; /* ranged: how the passes bound each weight
                            * (backends/cpu/ranged.h; MT_RANGED_BOUNDS_DEFAULT; the CPU's
                            * fallback when it lacks the instructions). Only the work changes. */
    int ranged_side_room;  /* ranged: the flags buffers hold the inputs of 1/this of their chunk's
                            * elements for the redo (MT_RANGED_SIDE_ROOM_MIN.._MAX; 0: the default,
                            * MT_RANGED_SIDE_ROOM_DEFAULT). Only the work and the memory change. */
    int offload_checkpoints; /* The activation checkpoints of every block but the last live in
                            * pinned host memory: written home as the forward writes them, their
                            * GPU copies first to be reclaimed, fetched back ahead of their
                            * block's recompute (runtime/step/graph.h). 1 on; 0 off (every
                            * checkpoint stays where it was written, from the forward to the
                            * backward); -1 (auto, the default): on where a GPU computes and the
                            * memory plan with them off needs more than the device holds
                            * (mt_plan_offload_needed). Bitwise the same results either way. */
    int64_t mlp_chunk;     /* The dense MLP's tokens at a time, its gate and up recomputed in the
                            * backward (the model config's mlp_chunk, models/config.h; the commands
                            * copy it there before the state is made): 0 all of a layer call's at
                            * once; MT_MLP_CHUNK_AUTO (the default) as the run's memory plan picks.
                            * CPU workers only for now. */
    int devices;           /* Data parallelism over the compute devices of one process: with more
                            * than one CUDA worker (0, the default) each is a device; > 1 here
                            * makes that many devices of the CPU workers (research and tests:
                            * the same graph on CPU workers). Micro-batch u is device u mod
                            * devices's, which writes its own copy of every gradient (=, then +=
                            * in micro-batch order); the copies are summed in device order into
                            * the tile's gradient (codelets/reduce.h) before the norm and AdamW
                            * read it: the same bits every run. Clip speculation and the
                            * deferred moments are off then, and the full host layout is needed. */
} mt_step_config;

/* What 0 means for the ranged settings above. */
#define MT_CLIP_SPREAD_DEFAULT 1.25
#define MT_CLIP_RANGE_MAX_DEFAULT 1.4
#define MT_CLIP_RANGE_GROW_DEFAULT 3.0
#define MT_CLIP_RANGE_MEMORY_DEFAULT 4
#define MT_CLIP_RANGE_MEMORY_MAX 16 /* MT_NORM_MEMORY_MAX (runtime/speculate/history.h) */

/* Defaults: accum 1, K 4, clip 1.0, head_chunk 1024, betas (0.9, 0.999), eps 1e-8, wd 0,
 * adamw_split -1, clip_speculate -1, clip_range_check -1, adamw_defer -1, ranged_bounds
 * MT_RANGED_BOUNDS_DEFAULT, offload_checkpoints -1, mlp_chunk MT_MLP_CHUNK_AUTO, the rest 0
 * (their defaults). */
mt_step_config mt_step_defaults(void);

/* What an observer hears: a compute task of a training step ended. */
typedef enum mt_event_kind {
    MT_EV_FORWARD_START,   /* a worker took a forward task of the streaming pass */
    MT_EV_FORWARD,         /* it ended */
    MT_EV_BACKWARD,
    MT_EV_ADAMW,
    MT_EV_TILE_READY,      /* a tile's update landed: its streamed weights are whole in host memory */
    MT_EV_COUNT            /* how many kinds there are (observers may size tables by it) */
} mt_event_kind;
typedef void (*mt_observer_fn)(void *user, mt_event_kind kind, int64_t step, int tile);

typedef struct mt_graph mt_graph;

/* Builds the graph's activation, scratch and I/O handles. Returns NULL with err set. */
mt_graph *mt_graph_create(mt_host_state *st, const mt_step_config *sc, char *err, size_t errlen);
/* Runs mt_graph_flush, waits for every task, then frees. */
void mt_graph_destroy(mt_graph *g);
/* Submits what the last update left for later (adamw_defer: the moments halves of ranged
 * updates), so that the host state's master, m and v are those of the last update once the
 * tasks end (starpu_task_wait_for_all): call it before reading them or saving a checkpoint.
 * Nothing when nothing is pending; the next step needs no call. */
void mt_graph_flush(mt_graph *g);
/* Whether the graph defers moments halves (adamw_defer with ranged speculation). */
bool mt_graph_defers(const mt_graph *g);
/* Says on log, each line after prefix, whether the graph defers and what it costs, why auto
 * declined, or that on has no effect (bench and train print it). */
void mt_graph_log_defer(const mt_graph *g, FILE *log, const char *prefix);
/* Over several devices says so on log, each line after prefix, with a warning when the step's
 * micro-batches leave devices idle or unevenly loaded (--accum not a multiple of the devices);
 * nothing over one. */
void mt_graph_log_devices(const mt_graph *g, FILE *log, const char *prefix);

/* Bytes of the working buffers the graph registered where its compute runs (over several GPUs,
 * those of one, device 0: its micro-batches' checkpoints, hidden states and gradients, its saved
 * activations): checkpoints (with offload_checkpoints where a GPU computes, those in flight there:
 * mt_plan_offload_in_flight), ping-pong hidden states and gradients, saved activations, layer and
 * head scratch. The memory plan predicts this number (mt_plan_activation_bytes less the inputs);
 * tests hold them equal. */
uint64_t mt_graph_working_bytes(const mt_graph *g);

/* Whether the graph keeps its checkpoints in host memory (offload_checkpoints, auto resolved). */
bool mt_graph_offloads_checkpoints(const mt_graph *g);

/* Changes adamw_split (mt_step_config) for the updates submitted from now on. */
void mt_graph_set_adamw_split(mt_graph *g, int split);
/* Changes clip_speculate (mt_step_config) for the updates submitted from now on. */
void mt_graph_set_clip_speculate(mt_graph *g, int speculate);
/* Of the steps whose loss mt_graph_wait_loss has returned: how many were submitted with a
 * speculative update, and in how many of those the scale was 1 (a unit speculation held; how
 * ranged ones fared, chunk by chunk: mt_graph_adamw_stats). */
void mt_graph_speculation_counts(const mt_graph *g, int64_t *speculated, int64_t *held);
/* What the graph's AdamW tasks have done since it was created: their CPU time by kind and the
 * ranged runs' counts (codelets/adamw.h: mt_adamw_stats_seconds, mt_adamw_stats_ranged).
 * Updated by the tasks as they end. */
const struct mt_adamw_stats *mt_graph_adamw_stats(const mt_graph *g);
/* Keeps each gradient norm's sums of squares per tile, for the first max_norms norms the graph
 * computes from now on (those of earlier norms are not kept): what ranged speculation predicts
 * from (bench --norm-log). Waits for every submitted task first. 0 on success, -1 when out of
 * memory. Clipping only (no norm without). */
int mt_graph_keep_norms(mt_graph *g, int64_t max_norms);
/* The kept sums once the norms' tasks have ended: *count rows (norms 1..*count) of *width
 * doubles, the tiles' (0 the embedding, 1..L the layers, L+1 the head when untied) then that of
 * the table's gradient as the head left it (tied with ranged speculation, else 0). NULL when
 * none are kept. */
const double *mt_graph_kept_norms(const mt_graph *g, int64_t *count, int *width);

/* Called from StarPU callbacks at the end of each forward/backward/AdamW task (for tests and
 * tracing); keep it short and thread-safe. */
void mt_graph_set_observer(mt_graph *g, mt_observer_fn fn, void *user);

/* A step is submitted in three parts, kept apart only so tests can put gates between them;
 * mt_graph_submit_step does all three.
 * compute: for each micro-batch the forward, the head and the block-wise backward. tokens and
 *   targets are (accum, B, T); targets < 0 do not count. They are copied, so the caller may
 *   reuse its arrays at once. Returns a slot id for mt_graph_wait_loss.
 * norm: the per-tile sums of squares and the global-norm task (nothing when clipping is off).
 * update: the AdamW tasks, learning rate lr. */
int mt_graph_submit_compute(mt_graph *g, int64_t step, const int32_t *tokens, const int32_t *targets);
void mt_graph_submit_norm(mt_graph *g);
void mt_graph_submit_update(mt_graph *g, int64_t step, double lr);
int mt_graph_submit_step(mt_graph *g, int64_t step, const int32_t *tokens, const int32_t *targets, double lr);

/* The handle the global-norm task writes (2 doubles: norm, scale): for tests that gate it. */
starpu_data_handle_t mt_graph_clip_handle(mt_graph *g);

/* Blocks until the step submitted in `slot` has its loss: mean over counted targets, plus, with
 * a mixture-of-experts model's load-balancing loss on, coef x the mean over the micro-batches of
 * each one's aux loss (docs/moe.md). Also the global gradient norm before clipping (NAN when
 * clipping is off). */
double mt_graph_wait_loss(mt_graph *g, int slot, double *grad_norm);

/* Forward-only loss over n_seq sequences (n_seq a multiple of B) with the current weights,
 * ordered after every submitted update. Returns the mean loss; *counted gets the token count. */
double mt_graph_eval(mt_graph *g, int64_t n_seq, const int32_t *tokens, const int32_t *targets,
                     int64_t *counted);

/* Forward only, as mt_graph_eval, then the logits of one position per sequence: tokens (B, T),
 * positions (B) each in [0, T), logits (B, V) fp32 = the LM head's output at token positions[b] of
 * sequence b. Ordered after every submitted update; returns once the logits are in host memory.
 * A position's logits depend on the tokens up to it only (causal attention), so the tokens after
 * it may be anything. */
void mt_graph_logits(mt_graph *g, const int32_t *tokens, const int32_t *positions, float *logits);

#endif
