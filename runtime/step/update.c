/* The norm and the update of a step (runtime/step/graph.h): exact global-norm clipping, then
 * AdamW per chunk on CPU workers, each tile's weights and gradient partitioned into its chunks
 * for the update and gathered back in host memory after it. How an update speculates with
 * clipping is runtime/speculate's; this file submits the plain update and asks it where the
 * update branches. Dependencies are data only: no barrier inside a step or between steps. */
#include "runtime/step/graph.h"

#include "runtime/policy.h"

/* Unpartition callback: the tile's streamed weights are whole and current in host memory. */
static void tile_updated(void *arg)
{
    mt_ready_note *n = arg;
    mt_policy_tile_updated(MT_SCHED_CTX_INITIAL, n->tile);
    if (n->g->observer.fn) n->g->observer.fn(n->g->observer.user, MT_EV_TILE_READY, n->step, n->tile);
}

/* With clipping every AdamW task waits for the global norm, so the update sits between the
 * backward and the next forward. Split, the weights half (18 of the fused update's 30 bytes per
 * parameter: master, m, v, grad read; the bf16 streamed copy written) is all the next forward
 * waits for; the second half (the fused kernel without the streamed copy: master, m, v updated
 * in place) runs in the CPU's idle time before the next backward overwrites the gradient
 * (StarPU orders it by the data). Without clipping only the embedding and layer 0 are split:
 * their updates come last (their gradients are the backward's last) and are needed first, at
 * the step boundary. */
bool mt_step_split_update(const mt_graph *g, int tile)
{
    if (g->sc.adamw_split >= 0) return g->sc.adamw_split > 0;
    return g->sc.clip > 0 || tile < 2;
}

/* Whether this step's update of the table starts before its embedding backward
 * (runtime/step/table.c): when the weights half of that update runs as soon as a gradient is
 * in, i.e. split, and without clipping or speculatively. */
static bool early_table(const mt_graph *g, mt_speculation_choice sp)
{
    /* compact: the table's gradient is whole only once its grad_home has run, after the embedding
     * backward, and its weights half writes the master itself (no redo of touched rows) */
    if (g->st->layout == MT_LAYOUT_COMPACT) return false;
    /* across ranks the table's gradient is summed whole before its update (dist.c) */
    if (g->dist_size > 1 || g->ndev > 1) return false;
    return g->sc.clip > 0 ? mt_speculation_early_table(sp) : mt_step_split_update(g, 0);
}

void mt_graph_submit_norm(mt_graph *g)
{
    if (g->sc.clip <= 0) return;
    mt_speculation_insert_norm(&g->speculation, g->st, g->partial, g->clip);
}

/* The plain AdamW task of chunk c of tile t: the fused update or the weights half, clipped or
 * not. */
static void insert_plain(mt_graph *g, mt_tile *t, int c, bool split, int clipped, int prio, const mt_adamw_params *p,
                         int64_t step)
{
    struct starpu_codelet *cl = split ? &mt_cl_adamw_params : &mt_cl_adamw;
    const mt_adamw_args a = { .p = *p, .dtype = g->st->compute_dtype, .clipped = clipped, .stats = &g->stats };
    const struct starpu_data_descr after[1] = { { g->clip, STARPU_R } };
    mt_step_insert_adamw(&g->update, t, c, cl, &a, split ? STARPU_R : STARPU_RW, after, clipped ? 1 : 0, prio,
                         cl->name, step, true);
}

/* The update of every tile; `table_started`: the table's early path did tile 0's partition and
 * weights half. */
static void submit_update(mt_graph *g, int64_t step, double lr, mt_speculation_choice sp, bool table_started)
{
    mt_host_state *st = g->st;
    const int clipped = g->sc.clip > 0 ? MT_ADAMW_CLIPPED : MT_ADAMW_UNCLIPPED;
    const bool speculate = sp.mode != MT_SPECULATION_NONE;
    const int slot_id = (g->next_slot + MT_STEP_SLOTS - 1) % MT_STEP_SLOTS;
    g->slots[slot_id].updated = true;
    g->slots[slot_id].speculated = speculate;
    if (clipped) {
        /* Keep this step's norm for mt_graph_wait_loss before the next step overwrites it (and
         * for deferred moments halves). */
        mt_step_check_insert(starpu_data_cpy(g->slots[slot_id].h_clip_copy, g->clip, 1, NULL, NULL), "clip copy");
    }
    /* Moments pending from the last update: taken over by this one's ranged runs; or, when this
     * update is not ranged (the mode changed between compute and update), run first. */
    const bool take_over = mt_speculation_take_over(&g->speculation, &g->update, sp);
    /* This update's own moments halves wait for the next step's ranged runs (the table's for its
     * next early path). */
    const bool defer = mt_speculation_defers(&g->speculation, sp);
    const bool compact = st->layout == MT_LAYOUT_COMPACT;
    for (int i = 0; i < st->ntiles; i++) {
        mt_tile *t = &st->tiles[i];
        const bool started = table_started && i == 0;
        const bool split = speculate || mt_step_split_update(g, i);
        /* The next forward needs tile 0 first: earlier tiles get higher priority. */
        int prio = STARPU_MAX_PRIO - i;
        if (prio < STARPU_MIN_PRIO) prio = STARPU_MIN_PRIO;
        /* sharded over ranks: another rank's tile, whose owner sends its updated weights */
        const bool remote = !mt_state_holds(st, i);
        if (!started) {
            mt_policy_tile_submitting(MT_SCHED_CTX_INITIAL, i, true);
            starpu_data_partition_submit(t->h_weights, t->nchunks, t->h_weights_chunk);
            if (!remote) starpu_data_partition_submit(t->h_grad, t->nchunks, t->h_grad_chunk);
        }
        if (remote) mt_step_dist_receive_weights(g, t);
        for (int c = 0; c < t->nchunks && !remote; c++) {
            const mt_adamw_params p = mt_step_adamw_params(&g->sc, &t->chunks[c], step, lr);
            if (started) {
                if (clipped) mt_speculation_insert_table_confirm(&g->speculation, &g->update, t, c, sp, prio, &p, step);
            } else if (speculate) {
                mt_speculation_insert_chunk(&g->speculation, &g->update, t, c, sp, take_over, prio, &p, step);
            } else if (compact) {
                mt_step_insert_compact(&g->update, t, c, split, clipped ? g->clip : NULL, prio, &p, step);
            } else {
                insert_plain(g, t, c, split, clipped, prio, &p, step);
            }
            if (g->dist_size > 1) mt_step_dist_send_weights(g, t, c);
            if (split && !defer && !compact)
                mt_step_insert_moments(&g->update, t, c, t->h_grad_chunk[c], clipped ? g->clip : NULL, &p);
        }
        /* Gather back in host memory, where the next forward's transfer starts; then tell the
         * policy, which may be waiting to prefetch this tile. Notes are reused READY_RING steps
         * later: by then this update has landed (submitting step s follows the loss of step
         * s-2, whose forward needed the update of step s-3). */
        mt_ready_note *note = &g->ready_notes[(step % MT_STEP_READY_RING) * st->ntiles + i];
        *note = (mt_ready_note){ g, i, step };
        starpu_data_unpartition_submit_sequential_consistency_cb(t->h_weights, t->nchunks, t->h_weights_chunk,
                                                                 STARPU_MAIN_RAM, 1, tile_updated, note);
        /* deferred: the gradient stays partitioned for the next step's ranged runs, the last
         * one's is given back once those were submitted */
        if (!defer && !remote) starpu_data_unpartition_submit(t->h_grad, t->nchunks, t->h_grad_chunk, STARPU_MAIN_RAM);
        /* the table's early path took its pending moments over, and gave the last gradient back */
        if (take_over && !started)
            starpu_data_unpartition_submit(t->h_grad_alt, t->nchunks, t->h_grad_alt_chunk, STARPU_MAIN_RAM);
        mt_policy_tile_submitting(MT_SCHED_CTX_INITIAL, i, false);
        g->updates_submitted[i]++;
    }
    mt_speculation_update_submitted(&g->speculation, sp, take_over, step, lr, g->slots[slot_id].h_clip_copy);
}

void mt_graph_submit_update(mt_graph *g, int64_t step, double lr)
{
    submit_update(g, step, lr, mt_speculation_choose(&g->speculation), false);
}

int mt_graph_submit_step(mt_graph *g, int64_t step, const int32_t *tokens, const int32_t *targets, double lr)
{
    const mt_speculation_choice sp = mt_speculation_choose(&g->speculation);
    const bool early = early_table(g, sp);
    int s = mt_step_submit_compute(g, step, tokens, targets, early);
    if (early) mt_step_submit_table_early(g, s, step, lr, sp);
    mt_graph_submit_norm(g);
    submit_update(g, step, lr, sp, early);
    return s;
}
