/* Clip speculation (docs/design.md): with clipping, every AdamW task of a step would wait for the
 * global norm, so the update would sit between the backward and the next forward. Speculating,
 * each tile's weights half runs as its gradient lands and is confirmed once the norm is known:
 *   unit    as if the scale were 1 (the last one was); the confirm does nothing when it is 1
 *           (exact: the clipped kernel multiplies by 1.0), else the weights half again;
 *   ranged  (bf16 streamed weights) for the range of scales the gradients already in and the last
 *           norm allow (history.h); the confirm redoes only the elements whose bf16 weight could
 *           differ within it (all when the scale fell outside).
 * Exact either way. Ranged runs may also take over the moments half the last update left pending
 * (deferral: adamw_defer), reading master, m and v once instead of twice; the gradients are then
 * double-buffered, the step writing one while the pending moments read the other.
 *
 * This module owns the speculation's state: the mode choice, the pending moments, the norm
 * history (StarPU data the clip task writes and the ranged runs read), the ranged runs' flags and
 * known buffers. The step graph (runtime/step/) calls it where an update branches. */
#ifndef MT_RUNTIME_SPECULATE_SPECULATE_H
#define MT_RUNTIME_SPECULATE_SPECULATE_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "codelets/adamw.h"
#include "runtime/speculate/history.h"
#include "runtime/state.h"
#include "runtime/step.h"
#include "runtime/step/tasks.h"

typedef enum mt_speculation_mode {
    MT_SPECULATION_NONE,
    MT_SPECULATION_UNIT,
    MT_SPECULATION_RANGED,
} mt_speculation_mode;

/* How one step's update speculates. Each ranged chunk's range is decided when its weights half
 * runs (mt_ranged_args); [lo, hi] is the fallback without a last norm: the last scale read back,
 * times or over 1.25. */
typedef struct mt_speculation_choice {
    mt_speculation_mode mode;
    double lo, hi;
} mt_speculation_choice;

/* An update whose moments halves wait for the next step's ranged runs (the table's for its early
 * path): its step and learning rate, its clip buffer (the slot's copy of the norm), and where its
 * gradient is now: each tile's current gradient, or after mt_speculation_begin_step swapped them,
 * the second one. That gradient stays partitioned into chunks until those moments are submitted. */
typedef struct mt_pending_update {
    bool active, swapped;
    int64_t step;
    double lr;
    starpu_data_handle_t clip;
} mt_pending_update;

typedef struct mt_speculation {
    /* settings */
    double clip;                  /* the step's clip bound; 0: no clipping, nothing speculates */
    int option;                   /* mt_step_config.clip_speculate (changes between steps) */
    int defer_option;             /* mt_step_config.adamw_defer */
    double max_ratio;
    bool check;
    mt_norm_settings settings;    /* of the norm history's records */
    int side_room;
    mt_ranged_bounds bounds;
    bool ranged;                  /* the flags exist: ranged updates are possible */
    bool defer;                   /* ranged updates defer their moments halves */
    /* the ranged runs' buffers: flags (tile, chunk), the known sums per tile, the table's head
     * part (tied), the norm history's two records, the log of the norms' records */
    starpu_data_handle_t **flags;
    void ***flags_mem;            /* their homes (tile, chunk), NULL where StarPU allocates the chunk's */
    starpu_data_handle_t *known;
    double (*known_mem)[2];
    starpu_data_handle_t head_table;
    double head_table_mem;
    starpu_data_handle_t record[2];
    void *record_mem[2];
    starpu_data_handle_t log;
    void *log_mem;
    int64_t log_from, log_cap;
    /* the state between steps */
    int64_t norm_seq;             /* norms submitted */
    double last_scale;            /* clip scale of the last step read back; 0 before */
    int64_t speculated, held;     /* mt_graph_speculation_counts */
    mt_pending_update pend;
} mt_speculation;

/* Sets up the speculation of a graph: which modes its settings allow, and the host state they
 * need (the second gradient of deferral, when allowed). Returns -1 with err set when memory
 * cannot be had. Then mt_speculation_register registers its buffers. */
int mt_speculation_init(mt_speculation *s, mt_host_state *st, const mt_step_config *sc, bool gpu, char *err,
                        size_t errlen);
void mt_speculation_register(mt_speculation *s, const mt_host_state *st);
void mt_speculation_destroy(mt_speculation *s, const mt_host_state *st);

/* This step's mode, from the settings and the last scale read back. */
mt_speculation_choice mt_speculation_choose(const mt_speculation *s);
/* The table's update starts before its embedding backward when its weights half can run as
 * soon as a gradient is in: speculating (clipping; else the plain update decides). */
bool mt_speculation_early_table(mt_speculation_choice sp);
/* A step's norm read back (mt_graph_wait_loss): its scale, and whether its update speculated. */
void mt_speculation_scale_read(mt_speculation *s, double scale, bool speculated);

/* The arguments of the ranged runs of tile first_tile's chunks for norm seq. */
mt_ranged_args mt_speculation_ranged_args(const mt_speculation *s, int first_tile, mt_speculation_choice sp,
                                          int64_t seq);
/* The record of the norm before norm seq (what its ranged runs read). */
starpu_data_handle_t mt_speculation_last_record(const mt_speculation *s, int64_t seq);

/* Submitted when a tile's backward ends (ranged): its known buffer, from its partial sum of
 * squares and the known buffer of the tile before it in the backward (mt_cl_known). */
void mt_speculation_insert_known(const mt_speculation *s, const mt_host_state *st, const starpu_data_handle_t *partials,
                                 int tile);
/* The global-norm task of the next norm: the norm and scale into `clip` from the tiles' partial
 * sums, and its record in the norm history. Returns the norm's number. */
int64_t mt_speculation_insert_norm(mt_speculation *s, const mt_host_state *st, const starpu_data_handle_t *partials,
                                   starpu_data_handle_t clip);

/* Before a step's compute: with moments pending, either this step's update will take them over
 * (ranged, deferring: the gradients swap, the step writing the free ones) or they run now. */
void mt_speculation_begin_step(mt_speculation *s, const mt_update_ctx *u);
/* Whether this update's ranged runs take over the moments pending from the last one (the
 * gradients swapped by mt_speculation_begin_step); if not, those run now, before anything reads
 * the state. Asked by the table's early path first, then by the update, with the same answer. */
bool mt_speculation_take_over(mt_speculation *s, const mt_update_ctx *u, mt_speculation_choice sp);
/* Whether this update's own moments halves wait for the next step's ranged runs. */
bool mt_speculation_defers(const mt_speculation *s, mt_speculation_choice sp);
/* After an update's tasks were submitted: its moments pending (deferring, clip: the slot's copy
 * of its norm) or, taken over, none left. */
void mt_speculation_update_submitted(mt_speculation *s, mt_speculation_choice sp, bool took_over, int64_t step,
                                     double lr, starpu_data_handle_t clip);
/* Submits the pending moments halves of every tile (nothing when none). */
void mt_speculation_flush(mt_speculation *s, const mt_update_ctx *u);
/* The parameters of the pending update's chunk c of tile t. */
mt_adamw_params mt_speculation_pending_params(const mt_speculation *s, const mt_update_ctx *u, const mt_tile *t, int c);

/* The speculative tasks of chunk c of tile t in this step's update (sp: unit or ranged): the
 * weights half as its gradient lands, then its confirm after the norm (which reports MT_EV_ADAMW
 * of `step`); take_over: the ranged run also runs the pending moments half of the chunk. */
void mt_speculation_insert_chunk(const mt_speculation *s, const mt_update_ctx *u, mt_tile *t, int c,
                                 mt_speculation_choice sp, bool take_over, int prio, const mt_adamw_params *p,
                                 int64_t step);
/* The confirm of chunk c of the table, whose weights half the early path ran (clipping). */
void mt_speculation_insert_table_confirm(const mt_speculation *s, const mt_update_ctx *u, mt_tile *t, int c,
                                         mt_speculation_choice sp, int prio, const mt_adamw_params *p, int64_t step);

/* Keeps the records of the next max_norms norms (mt_graph_keep_norms); waits for every task. */
int mt_speculation_keep_norms(mt_speculation *s, const mt_host_state *st, int64_t max_norms);
const double *mt_speculation_kept_norms(const mt_speculation *s, const mt_host_state *st, int64_t *count, int *width);

/* What mt_graph_log_defer says. */
void mt_speculation_log_defer(const mt_speculation *s, const mt_host_state *st, FILE *log, const char *prefix);

#endif
