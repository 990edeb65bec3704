/* The observer plumbing and the AdamW tasks of an update (runtime/step/tasks.h). */
#include "runtime/step/tasks.h"

#include "codelets/adamw_compact.h"

#include <stdio.h>
#include <stdlib.h>

void mt_step_check_insert(int ret, const char *what)
{
    if (ret != 0) {
        fprintf(stderr, "megatrain: submitting %s failed (%d)\n", what, ret);
        abort();
    }
}

typedef struct event_note {
    const mt_observer *observer;
    mt_event_kind kind;
    int64_t step;
    int tile;
} event_note;

void *mt_step_note(const mt_observer *o, mt_event_kind kind, int64_t step, int tile)
{
    event_note *n = malloc(sizeof *n);
    *n = (event_note){ o, kind, step, tile };
    return n;
}

void mt_step_notify(void *arg)
{
    event_note *n = arg;
    n->observer->fn(n->observer->user, n->kind, n->step, n->tile);
    free(n);
}

mt_adamw_params mt_step_adamw_params(const mt_step_config *sc, const mt_chunk *c, int64_t step, double lr)
{
    return (mt_adamw_params){
        .lr = lr, .beta1 = sc->beta1, .beta2 = sc->beta2, .eps = sc->eps,
        .weight_decay = c->decay ? sc->weight_decay : 0.0, .step = step, .grad_scale = 1.0,
    };
}

void mt_step_insert_adamw(const mt_update_ctx *u, mt_tile *t, int c, struct starpu_codelet *cl, const mt_adamw_args *a,
                          enum starpu_data_access_mode state, const struct starpu_data_descr *after, int nafter,
                          int prio, const char *name, int64_t step, bool observe)
{
    const bool confirm = a->clipped == MT_ADAMW_CONFIRM || a->clipped == MT_ADAMW_CONFIRM_RANGED;
    struct starpu_data_descr d[16] = {
        { t->h_master_chunk[c], state }, { t->h_m_chunk[c], state }, { t->h_v_chunk[c], state },
        { t->h_grad_chunk[c], STARPU_R }, { t->h_weights_chunk[c], confirm ? STARPU_RW : STARPU_W },
    };
    for (int i = 0; i < nafter; i++) d[5 + i] = after[i];
    mt_step_check_insert(starpu_task_insert(cl, STARPU_DATA_MODE_ARRAY, d, 5 + nafter, STARPU_VALUE, a, sizeof *a,
                                            STARPU_PRIORITY, prio, STARPU_EXECUTE_WHERE, STARPU_CPU, STARPU_NAME, name,
                                            MT_OBSERVE_END(u->observer, observe, MT_EV_ADAMW, step, t->index), 0),
                         name);
}

/* Below every weights half, and the tiles whose gradient the next backward overwrites first
 * (head, and the embedding when tied, then the last layer) ahead of the rest. */
static int moments_priority(const mt_host_state *st, int i)
{
    int rank = i == 0 ? (st->cfg.tied ? st->ntiles : 0) : i; /* tiles: 0 embed, 1..L layers, L+1 head */
    int prio = STARPU_MIN_PRIO + 1 + rank;
    return prio > 0 ? 0 : prio;
}

void mt_step_insert_moments(const mt_update_ctx *u, mt_tile *t, int c, starpu_data_handle_t grad,
                            starpu_data_handle_t clip, const mt_adamw_params *p)
{
    const mt_adamw_args a = { .p = *p, .dtype = u->st->compute_dtype,
                              .clipped = clip ? MT_ADAMW_CLIPPED : MT_ADAMW_UNCLIPPED, .stats = u->stats };
    struct starpu_data_descr d[5] = {
        { t->h_master_chunk[c], STARPU_RW }, { t->h_m_chunk[c], STARPU_RW }, { t->h_v_chunk[c], STARPU_RW },
        { grad, STARPU_R }, { clip, STARPU_R },
    };
    mt_step_check_insert(starpu_task_insert(&mt_cl_adamw_moments, STARPU_DATA_MODE_ARRAY, d, clip ? 5 : 4,
                                            STARPU_VALUE, &a, sizeof a,
                                            STARPU_PRIORITY, moments_priority(u->st, t->index),
                                            STARPU_EXECUTE_WHERE, STARPU_CPU, STARPU_NAME, "adamw_moments", 0),
                         "adamw_moments");
}

void mt_step_insert_compact(const mt_update_ctx *u, mt_tile *t, int c, bool split, starpu_data_handle_t clip, int prio,
                            const mt_adamw_params *p, int64_t step)
{
    const mt_adamw_args a = { .p = *p, .dtype = u->st->compute_dtype,
                              .clipped = clip ? MT_ADAMW_CLIPPED : MT_ADAMW_UNCLIPPED, .stats = u->stats };
    const int nclip = clip ? 1 : 0;
    struct starpu_codelet *cl = split ? &mt_cl_adamw_compact_weights : &mt_cl_adamw_compact;
    const enum starpu_data_access_mode moments = split ? STARPU_R : STARPU_RW;
    struct starpu_data_descr d[6] = {
        { t->h_weights_chunk[c], STARPU_RW }, { t->h_master_lo_chunk[c], STARPU_RW }, { t->h_m_chunk[c], moments },
        { t->h_v_chunk[c], moments }, { t->h_grad_chunk[c], STARPU_R }, { clip, STARPU_R },
    };
    mt_step_check_insert(starpu_task_insert(cl, STARPU_DATA_MODE_ARRAY, d, 5 + nclip, STARPU_VALUE, &a, sizeof a,
                                            STARPU_PRIORITY, prio, STARPU_EXECUTE_WHERE, STARPU_CPU, STARPU_NAME,
                                            cl->name, MT_OBSERVE_END(u->observer, true, MT_EV_ADAMW, step, t->index), 0),
                         cl->name);
    if (!split) return;
    struct starpu_data_descr md[4] = {
        { t->h_m_chunk[c], STARPU_RW }, { t->h_v_chunk[c], STARPU_RW }, { t->h_grad_chunk[c], STARPU_R }, { clip, STARPU_R },
    };
    mt_step_check_insert(starpu_task_insert(&mt_cl_adamw_compact_moments, STARPU_DATA_MODE_ARRAY, md, 3 + nclip,
                                            STARPU_VALUE, &a, sizeof a, STARPU_PRIORITY, moments_priority(u->st, t->index),
                                            STARPU_EXECUTE_WHERE, STARPU_CPU, STARPU_NAME, "adamw_compact_moments", 0),
                         "adamw_compact_moments");
}
