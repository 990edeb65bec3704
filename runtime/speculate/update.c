/* The speculative branches of an update and the deferral of its moments halves (speculate.h):
 * which tasks a speculated chunk gets, and the pending moments' state machine. The pending
 * moments are taken over by the next update only when it is ranged and deferring, its gradients
 * swapped before its compute; any other next step, a change of mode between compute and update
 * included, runs them first, before anything reads the state. */
#include "runtime/speculate/speculate.h"

mt_adamw_params mt_speculation_pending_params(const mt_speculation *s, const mt_update_ctx *u, const mt_tile *t, int c)
{
    return mt_step_adamw_params(u->sc, &t->chunks[c], s->pend.step, s->pend.lr);
}

/* The pending moments halves of tile t, then its gradient's partition given back. */
static void submit_pending_tile(const mt_speculation *s, const mt_update_ctx *u, mt_tile *t)
{
    starpu_data_handle_t whole = s->pend.swapped ? t->h_grad_alt : t->h_grad;
    starpu_data_handle_t *chunks = s->pend.swapped ? t->h_grad_alt_chunk : t->h_grad_chunk;
    for (int c = 0; c < t->nchunks; c++) {
        const mt_adamw_params p = mt_speculation_pending_params(s, u, t, c);
        mt_step_insert_moments(u, t, c, chunks[c], s->pend.clip, &p);
    }
    starpu_data_unpartition_submit(whole, t->nchunks, chunks, STARPU_MAIN_RAM);
}

void mt_speculation_flush(mt_speculation *s, const mt_update_ctx *u)
{
    if (!s->pend.active) return;
    for (int i = 0; i < u->st->ntiles; i++) submit_pending_tile(s, u, &u->st->tiles[i]);
    s->pend.active = false;
}

void mt_speculation_begin_step(mt_speculation *s, const mt_update_ctx *u)
{
    if (!s->pend.active || s->pend.swapped) return;
    if (s->defer && mt_speculation_choose(s).mode == MT_SPECULATION_RANGED) {
        for (int i = 0; i < u->st->ntiles; i++) mt_tile_swap_grad(&u->st->tiles[i]);
        s->pend.swapped = true;
    } else {
        mt_speculation_flush(s, u);
    }
}

bool mt_speculation_take_over(mt_speculation *s, const mt_update_ctx *u, mt_speculation_choice sp)
{
    const bool take = s->pend.active && s->pend.swapped && sp.mode == MT_SPECULATION_RANGED;
    if (s->pend.active && !take) mt_speculation_flush(s, u);
    return take;
}

bool mt_speculation_defers(const mt_speculation *s, mt_speculation_choice sp)
{
    return s->defer && sp.mode == MT_SPECULATION_RANGED;
}

void mt_speculation_update_submitted(mt_speculation *s, mt_speculation_choice sp, bool took_over, int64_t step,
                                     double lr, starpu_data_handle_t clip)
{
    if (mt_speculation_defers(s, sp))
        s->pend = (mt_pending_update){ .active = true, .swapped = false, .step = step, .lr = lr, .clip = clip };
    else if (took_over)
        s->pend.active = false;
}

/* The arguments of an AdamW task of this update on chunks of t. */
static mt_adamw_args args_of(const mt_update_ctx *u, int clipped, const mt_adamw_params *p)
{
    return (mt_adamw_args){ .p = *p, .dtype = u->st->compute_dtype, .clipped = clipped, .stats = u->stats };
}

/* The confirm of a unit run: the scale from the clip buffer. */
static void insert_confirm(const mt_update_ctx *u, mt_tile *t, int c, int prio, const mt_adamw_params *p,
                           int64_t step)
{
    const mt_adamw_args a = args_of(u, MT_ADAMW_CONFIRM, p);
    const struct starpu_data_descr after[1] = { { u->clip, STARPU_R } };
    mt_step_insert_adamw(u, t, c, &mt_cl_adamw_params, &a, STARPU_R, after, 1, prio, "adamw_confirm", step, true);
}

/* The confirm of a ranged run: the scale and its run's flags. */
static void insert_confirm_ranged(const mt_speculation *s, const mt_update_ctx *u, mt_tile *t, int c, int prio,
                                  const mt_adamw_params *p, int64_t step)
{
    const mt_adamw_args a = args_of(u, MT_ADAMW_CONFIRM_RANGED, p);
    const struct starpu_data_descr after[2] = { { u->clip, STARPU_R }, { s->flags[t->index][c], STARPU_R } };
    mt_step_insert_adamw(u, t, c, &mt_cl_adamw_params, &a, STARPU_R, after, 2, prio, "adamw_confirm", step, true);
}

/* A ranged run of chunk c of tile t, after this step's norm was submitted (its number is
 * norm_seq); take_over: after the pending update's moments half of the chunk, from the
 * gradient that update left in the second buffer. */
static void insert_ranged(const mt_speculation *s, const mt_update_ctx *u, mt_tile *t, int c, mt_speculation_choice sp,
                          bool take_over, int prio, const mt_adamw_params *p, int64_t step)
{
    mt_adamw_args a = args_of(u, take_over ? MT_ADAMW_RANGED_DEFERRED : MT_ADAMW_RANGED, p);
    a.ranged = mt_speculation_ranged_args(s, t->index, sp, s->norm_seq);
    /* tile 0's update is ranged on the early path only (runtime/step/table.c) */
    struct starpu_data_descr after[5] = {
        { s->flags[t->index][c], STARPU_W }, { s->known[t->index], STARPU_R },
        { mt_speculation_last_record(s, s->norm_seq), STARPU_R },
    };
    if (!take_over) {
        mt_step_insert_adamw(u, t, c, &mt_cl_adamw_params, &a, STARPU_R, after, 3, prio, "adamw_ranged", step, false);
        return;
    }
    a.last = mt_speculation_pending_params(s, u, t, c);
    after[3] = (struct starpu_data_descr){ t->h_grad_alt_chunk[c], STARPU_R };
    after[4] = (struct starpu_data_descr){ s->pend.clip, STARPU_R };
    mt_step_insert_adamw(u, t, c, &mt_cl_adamw_params, &a, STARPU_RW, after, 5, prio, "adamw_ranged_deferred", step,
                         false);
}

void mt_speculation_insert_chunk(const mt_speculation *s, const mt_update_ctx *u, mt_tile *t, int c,
                                 mt_speculation_choice sp, bool take_over, int prio, const mt_adamw_params *p,
                                 int64_t step)
{
    if (sp.mode == MT_SPECULATION_UNIT) {
        /* as the gradient lands (no wait for the norm), then confirmed after it */
        const mt_adamw_args a = args_of(u, MT_ADAMW_UNCLIPPED, p);
        mt_step_insert_adamw(u, t, c, &mt_cl_adamw_params, &a, STARPU_R, NULL, 0, prio, "adamw_params", step, false);
        insert_confirm(u, t, c, prio, p, step);
    } else {
        insert_ranged(s, u, t, c, sp, take_over, prio, p, step);
        insert_confirm_ranged(s, u, t, c, prio, p, step);
    }
}

void mt_speculation_insert_table_confirm(const mt_speculation *s, const mt_update_ctx *u, mt_tile *t, int c,
                                         mt_speculation_choice sp, int prio, const mt_adamw_params *p, int64_t step)
{
    if (sp.mode == MT_SPECULATION_RANGED) insert_confirm_ranged(s, u, t, c, prio, p, step);
    else insert_confirm(u, t, c, prio, p, step);
}
