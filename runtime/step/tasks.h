/* What every part of the step graph submits tasks with: the observer's callbacks, the abort on a
 * failed submission, and the AdamW tasks of an update over a tile's chunk handles, from which the
 * plain update (update.c), the table's early path (table.c) and the clip speculation
 * (runtime/speculate) build theirs. Internal to the runtime. */
#ifndef MT_RUNTIME_STEP_TASKS_H
#define MT_RUNTIME_STEP_TASKS_H

#include <stdbool.h>
#include <stdint.h>

#include "codelets/adamw.h"
#include "runtime/state.h"
#include "runtime/step.h"

/* Aborts with a message naming the task when a submission failed: the graph cannot go on with
 * a task missing. */
void mt_step_check_insert(int ret, const char *what);

/* The graph's observer (mt_graph_set_observer), read when a task's callback runs. */
typedef struct mt_observer {
    mt_observer_fn fn;
    void *user;
} mt_observer;

/* What a task's callback hands to the observer: created at submission, freed by the callback
 * (mt_step_notify; the callback arguments are given to StarPU as NFREE). */
void *mt_step_note(const mt_observer *o, mt_event_kind kind, int64_t step, int tile);
void mt_step_notify(void *note);

/* Observer callbacks of a task: none without an observer, or when `on` is false. */
#define MT_OBSERVED(o, on) ((on) && (o)->fn)
#define MT_OBSERVE_END(o, on, kind_, step_, tile_)                                                 \
    STARPU_CALLBACK_WITH_ARG_NFREE, MT_OBSERVED(o, on) ? mt_step_notify : NULL,                    \
        MT_OBSERVED(o, on) ? mt_step_note((o), (kind_), (step_), (tile_)) : NULL
#define MT_OBSERVE_START(o, on, kind_, step_, tile_)                                               \
    STARPU_PROLOGUE_CALLBACK_POP, MT_OBSERVED(o, on) ? mt_step_notify : NULL,                      \
        STARPU_PROLOGUE_CALLBACK_POP_ARG_NFREE, MT_OBSERVED(o, on) ? mt_step_note((o), (kind_), (step_), (tile_)) : NULL

/* What the AdamW tasks of one graph share. */
typedef struct mt_update_ctx {
    const mt_host_state *st;
    const mt_step_config *sc;
    starpu_data_handle_t clip;     /* the clip task's output (2 doubles: norm, scale) */
    mt_adamw_stats *stats;
    const mt_observer *observer;
} mt_update_ctx;

/* The AdamW parameters of a chunk for the update of `step` at learning rate lr, unclipped. */
mt_adamw_params mt_step_adamw_params(const mt_step_config *sc, const mt_chunk *c, int64_t step, double lr);

/* One AdamW task on chunk c of tile t (mt_cl_adamw or mt_cl_adamw_params, args a): [0..2] master,
 * m and v with mode `state`, [3] the gradient chunk R, [4] the streamed weights chunk (RW for a
 * confirm, else W), then the `nafter` buffers of a's mode; on a CPU worker at priority prio,
 * named `name`, reporting MT_EV_ADAMW of `step` to the observer when `observe`. */
void mt_step_insert_adamw(const mt_update_ctx *u, mt_tile *t, int c, struct starpu_codelet *cl, const mt_adamw_args *a,
                          enum starpu_data_access_mode state, const struct starpu_data_descr *after, int nafter,
                          int prio, const char *name, int64_t step, bool observe);

/* The moments half of chunk c of tile t (mt_cl_adamw_moments): master, m and v in place from the
 * gradient chunk `grad`, times the scale in the clip buffer `clip` (NULL: unclipped), below every
 * weights half in priority. */
void mt_step_insert_moments(const mt_update_ctx *u, mt_tile *t, int c, starpu_data_handle_t grad,
                            starpu_data_handle_t clip, const mt_adamw_params *p);

/* The compact layout's AdamW of chunk c of tile t (codelets/adamw_compact.h), clipped by the clip
 * buffer `clip` (NULL: unclipped): fused, or split in its weights half at priority prio and its
 * moments half below every weights half (as mt_step_insert_moments). The fused task or the
 * weights half reports MT_EV_ADAMW of `step` to the observer. */
void mt_step_insert_compact(const mt_update_ctx *u, mt_tile *t, int c, bool split, starpu_data_handle_t clip, int prio,
                            const mt_adamw_params *p, int64_t step);

#endif
