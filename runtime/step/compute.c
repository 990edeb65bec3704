/* The compute of a step and of an evaluation (runtime/step/graph.h): the streaming forward with
 * a checkpoint every K layers, the loss anchor, and the block-wise backward (recompute a block
 * from its checkpoint, then backward layer by layer, gradients home), each tile's partial sum of
 * squares left by its last backward task when clipping; the forward alone for the logits of
 * chosen positions (generation). */
#include "runtime/step/graph.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "codelets/embedding.h"
#include "codelets/grad_home.h"
#include "codelets/head.h"
#include "codelets/head_logits.h"
#include "codelets/layer.h"
#include "codelets/reduce.h"
#include "runtime/dist.h"
#include "runtime/policy.h"

void *mt_step_hint(mt_graph *g, int tile, uint32_t ahead)
{
    if (tile < 0) return NULL;
    return mt_policy_hint(tile, g->updates_submitted[tile] + ahead);
}

/* Input handle of layer i (0-based) in the forward pass of micro-batch u. */
static starpu_data_handle_t forward_input(mt_graph *g, int i, int u)
{
    return i % g->sc.K == 0 ? mt_step_ckpt(g, i / g->sc.K, u) : g->act[u][i % 2];
}

/* Output handle of layer i: the next block's checkpoint, or the ping-pong buffer. */
static starpu_data_handle_t forward_output(mt_graph *g, int i, int u)
{
    int L = (int)g->st->cfg.layers;
    if ((i + 1) % g->sc.K == 0 && i + 1 < L) return mt_step_ckpt(g, (i + 1) / g->sc.K, u);
    return g->act[u][(i + 1) % 2];
}

/* The router statistics a layer's tasks use for micro-batch u: the micro-batch's buffer for a
 * sparse layer with the load-balancing loss on, else NULL. */
static starpu_data_handle_t router_stats(const mt_graph *g, const mt_step_slot *sl, int i, int u)
{
    if (!sl || !sl->h_router_stats || !mt_config_layer_is_sparse(&g->st->cfg, i)) return NULL;
    return sl->h_router_stats[u];
}

/* The worker micro-batch u's compute tasks run on over several devices (device u mod ndev's),
 * else -1: wherever the policy puts them. */
static int worker_of(const mt_graph *g, int u) { return g->ndev > 1 ? g->dev_worker[u % g->ndev] : -1; }

/* Whether micro-batch u is its device's first of the step (it writes the device's gradient copy
 * with W) or its last: the tasks that bring in a device's weights and point past them, so each
 * carries the policy's prefetch hint, which prefetches to the memory node of the device it runs
 * on. With one device, micro-batch 0 and M-1. */
static bool first_of_copy(const mt_graph *g, int u) { return u < g->ndev; }
static bool last_of_copy(const mt_graph *g, int u) { return u + g->ndev >= g->sc.accum; }

/* Layer j's saved activations of a block's recompute for micro-batch u: its device's. */
static starpu_data_handle_t saved_of(const mt_graph *g, int u, int j) { return g->saved[(u % g->ndev) * g->sc.K + j]; }

/* A checkpoint has served its last reader of the step (the forward's, or its recompute): dropped,
 * or when offloaded marked as not used soon instead. Its host copy is current (written through),
 * so StarPU reclaims the GPU copy with no transfer, before other buffers; and it keeps a value,
 * which the prefetch ahead of its recompute needs (StarPU refuses to prefetch a handle whose last
 * submitted access was an invalidation, and the main thread submits a step's drops long before
 * its tasks run). The next step's forward overwrites it (W: nothing is fetched for that). */
static void release_checkpoint(mt_graph *g, int b, starpu_data_handle_t h)
{
    if (mt_step_ckpt_offloaded(g, b)) starpu_data_wont_use(h);
    else mt_step_drop(h);
}

/* Task callback: prefetches an offloaded checkpoint to the memory node of the worker that ran the
 * task, where the recompute that reads it runs (the GPU's; on a CPU worker its home, where it is
 * already). A prefetch is not ordered with the tasks, but it only ever copies the handle's current
 * value, and an offloaded checkpoint is never invalidated (release_checkpoint), so it
 * always has one: issued at the wrong time it costs a transfer, never a wrong value. */
static void fetch_checkpoint(void *handle)
{
    starpu_data_prefetch_on_node((starpu_data_handle_t)handle, starpu_worker_get_local_memory_node(), 1);
}

/* observe: report start/end of this forward (the streaming pass of a training step). stats: the
 * router statistics it adds to (RW), or NULL (a recompute, an evaluation, a dense layer). fetch:
 * a checkpoint the task's end prefetches (fetch_checkpoint; never with observe), or NULL. */
static void insert_layer_forward(mt_graph *g, int i, int u, starpu_data_handle_t x, starpu_data_handle_t y,
                                 starpu_data_handle_t saved, starpu_data_handle_t stats, int64_t step, bool observe,
                                 void *hint, starpu_data_handle_t fetch)
{
    STARPU_ASSERT_MSG(!fetch || !observe, "layer %d: a forward task has one end callback, the observer's or a prefetch", i);
    mt_tile *t = mt_state_layer(g->st, i);
    const bool observed = MT_OBSERVED(&g->observer, observe);
    void (*done)(void *) = observed ? mt_step_notify : fetch ? fetch_checkpoint : NULL;
    void *done_arg = observed ? mt_step_note(&g->observer, MT_EV_FORWARD, step, t->index) : (void *)fetch;
    mt_compute_args a = { .model = &g->model, .B = g->sc.B, .T = g->sc.T, .save = saved != NULL, .layer = i,
                          .router_stats = stats != NULL };
    struct starpu_data_descr d[6] = {
        { t->h_weights, STARPU_R }, { x, STARPU_R }, { y, STARPU_W }, { g->scratch_layer, STARPU_SCRATCH },
    };
    int nd = 4;
    if (saved) d[nd++] = (struct starpu_data_descr){ saved, STARPU_W };
    if (stats) d[nd++] = (struct starpu_data_descr){ stats, STARPU_RW };
    mt_step_check_insert(starpu_task_insert(&mt_cl_layer_forward, STARPU_DATA_MODE_ARRAY, d, nd,
                                    STARPU_VALUE, &a, sizeof a, STARPU_NAME, "layer_forward",
                                    STARPU_EXECUTE_WHERE, g->where, STARPU_EXECUTE_ON_WORKER, worker_of(g, u),
                                    STARPU_TASK_SCHED_DATA, hint, STARPU_CALLBACK_WITH_ARG_NFREE, done, done_arg,
                                    MT_OBSERVE_START(&g->observer, observe, MT_EV_FORWARD_START, step, t->index), 0),
                 "layer_forward");
}

/* The forward pass of micro-batches 0..n-1 up to x_L (act[u][L % 2]), layer by layer: each
 * layer's weights serve every micro-batch in turn. Each device's first micro-batch's task carries
 * the prefetch hint for the next tile. sl: the step's slot, whose router statistics the sparse layers
 * add to; NULL for an evaluation. */
static void submit_forward(mt_graph *g, const starpu_data_handle_t *tokens, int n, const mt_step_slot *sl,
                           int64_t step, bool observe)
{
    const int L = (int)g->st->cfg.layers;
    mt_compute_args a = { .model = &g->model, .B = g->sc.B, .T = g->sc.T };
    for (int u = 0; u < n; u++)
        mt_step_check_insert(starpu_task_insert(&mt_cl_embedding_forward, STARPU_R, mt_state_embed(g->st)->h_weights,
                                        STARPU_R, tokens[u], STARPU_W, mt_step_ckpt(g, 0, u), STARPU_VALUE, &a, sizeof a,
                                        STARPU_EXECUTE_WHERE, g->where, STARPU_EXECUTE_ON_WORKER, worker_of(g, u),
                                        STARPU_TASK_SCHED_DATA, first_of_copy(g, u) ? mt_step_hint(g, 1, 0) : NULL,
                                        MT_OBSERVE_START(&g->observer, observe && u == 0, MT_EV_FORWARD_START, step, 0), 0),
                     "embedding_forward");
    for (int i = 0; i < L; i++) {
        int next = i + 1 < L ? i + 2 : g->st->ntiles - 1; /* the next layer, or the head */
        for (int u = 0; u < n; u++) {
            insert_layer_forward(g, i, u, forward_input(g, i, u), forward_output(g, i, u), NULL, router_stats(g, sl, i, u),
                                 step, observe && u == 0, first_of_copy(g, u) ? mt_step_hint(g, next, 0) : NULL, NULL);
            /* An offloaded checkpoint has served the forward: its GPU copy, clean once written
             * through, goes first when StarPU needs room. (wont_use waits for the writer, not
             * for this reader; should StarPU reclaim the copy before the reader runs, the reader
             * fetches it back from home: a transfer, never a wrong value.) */
            if (i % g->sc.K == 0 && mt_step_ckpt_offloaded(g, i / g->sc.K))
                release_checkpoint(g, i / g->sc.K, forward_input(g, i, u));
        }
    }
}

/* Drops the contents of an activation buffer once its last reader is submitted (ordered after
 * it, like a task). A valid copy StarPU evicts to make room is written back to the activation's
 * host home first: without the drop, stale checkpoints and saved activations would be copied
 * back to the host whenever the GPU needs room. Dropped, the buffer is free to recycle with no
 * copy. */
void mt_step_drop(starpu_data_handle_t h) { starpu_data_invalidate_submit(h); }

/* The checkpoint the end of unit (b, u)'s first recompute task prefetches: the next unit's in its
 * device's backward order ((b, u + ndev), else (b - 1, u mod ndev); with one device (b, u + 1),
 * else (b - 1, 0)) when offloaded, else NULL. Its writer, the
 * forward, has ended by then, whatever the scheduler, so the transfer is never wasted: past the
 * last block, that task waits through saved[0] for the backward of every unit before it, so for
 * every micro-batch's head and whole forward; the last block's last unit, the only one of that
 * block whose next is offloaded, waits for its own checkpoint (micro-batch M-1's forward up to
 * the last block) and, through saved[0] and the gradients accumulated in micro-batch order, for
 * micro-batch 0's head. The transfer overlaps the rest of the unit: its other recompute tasks
 * and its backward. */
static starpu_data_handle_t fetch_after_recompute(const mt_graph *g, int b, int u)
{
    const int M = g->sc.accum, D = g->ndev;
    const int nb = u + D < M ? b : b - 1, nu = u + D < M ? u + D : u % D;
    return nb >= 0 && mt_step_ckpt_offloaded(g, nb) ? mt_step_ckpt(g, nb, nu) : NULL;
}

/* Prefetch hint for the weights the GPU needs after layer i's backward (block-wise order): the
 * previous layer, or the first layer of the previous block's recompute; after layer 0, the
 * embedding backward reads no weights, so the next step's embedding forward, once this step's
 * update of tile 0 has landed. Not tile 0 at its current version: its AdamW partition may be
 * active by then (its last reader, the tied head, ran at the start of the backward), and StarPU
 * aborts on a prefetch of a partitioned handle. */
static void *hint_after_backward(mt_graph *g, int i)
{
    const int K = g->sc.K;
    if (i % K != 0) return mt_step_hint(g, i, 0);                      /* layer i-1 is tile i */
    if (i == 0) return mt_step_hint(g, 0, 1);                          /* next step's embedding */
    return mt_step_hint(g, (i / K - 1) * K + 1, 0);                    /* first layer of block i/K - 1 */
}

/* What the compute tasks write a tile's gradient into: its handle, or in the compact layout its
 * fp32 accumulator (the bf16 home is grad_home's). */
static starpu_data_handle_t grad_target(const mt_graph *g, const mt_tile *t)
{
    return g->st->layout == MT_LAYOUT_COMPACT ? t->h_grad_acc : t->h_grad;
}

/* What micro-batch u's compute tasks write a tile's gradient into: over several devices, device
 * u mod ndev's copy (in the compact layout device 0's is the tile's accumulator: graph.h,
 * mt_step_first_copy); and how: = by the first micro-batch of that copy (`first` of a copy another task
 * wrote first this step is false), += by the later ones, in micro-batch order. */
static starpu_data_handle_t grad_of(const mt_graph *g, const mt_tile *t, int u)
{
    const int d = u % g->ndev;
    const int first = mt_step_first_copy(g);
    if (g->ndev == 1 || d < first) return grad_target(g, t);
    return g->dev_grad[(d - first) * g->st->ntiles + t->index];
}

/* Compact layout: the tile's accumulator, whole after the last contribution of the step (over
 * several devices, device 0's after the sum), rounded to its bf16 home (with, clipping, the sum of
 * squares of those values) where the compute runs, on device 0; then dropped, so that its buffer
 * serves the next tile and is never copied anywhere. */
static void insert_grad_home(mt_graph *g, const mt_tile *t)
{
    struct starpu_data_descr d[3] = {
        { t->h_grad_acc, STARPU_R }, { t->h_grad, STARPU_W }, { g->partial[t->index], STARPU_W },
    };
    mt_step_check_insert(starpu_task_insert(&mt_cl_grad_home, STARPU_DATA_MODE_ARRAY, d, g->sc.clip > 0 ? 3 : 2,
                                            STARPU_NAME, "grad_home", STARPU_EXECUTE_WHERE, g->where,
                                            STARPU_EXECUTE_ON_WORKER, worker_of(g, 0), 0),
                         "grad_home");
    mt_step_drop(t->h_grad_acc);
}

/* dst += src on device d's worker, where dst is (StarPU brings src there: from another GPU, peer
 * to peer where the GPUs allow it), then src dropped: its contents are spent, and nothing of it
 * goes home. */
static void add_copy(mt_graph *g, int d, starpu_data_handle_t dst, starpu_data_handle_t src)
{
    const mt_grad_sum_args a = { .own = 0 };
    mt_step_check_insert(starpu_task_insert(&mt_cl_grad_sum, STARPU_RW, dst, STARPU_R, src, STARPU_VALUE, &a, sizeof a,
                                            STARPU_EXECUTE_WHERE, g->where, STARPU_EXECUTE_ON_WORKER, g->dev_worker[d],
                                            STARPU_PRIORITY, STARPU_MAX_PRIO, STARPU_NAME, "grad_sum", 0),
                         "grad_sum");
    mt_step_drop(src);
}

/* After a tile's last gradient task of the step: over several devices, devices 1..n-1's copies
 * summed pairwise in a tree rooted at device 1 (at stride s = 1, 2, 4, ..., device d = 1 + 2ks
 * adds device d + s's, on d), then device 1's added into device 0's, on device 0: with 8,
 * g_0 + (((g_1 + g_2) + (g_3 + g_4)) + ((g_5 + g_6) + g_7)), the same bits every run. No device
 * receives more than log2(n) copies (one chain would bring all n - 1 over device 0's link). In
 * the full layout device 0's copy, the sum, is then copied into the tile's gradient, which is
 * written through to its host home on every write: written once, one transfer home a step
 * whatever the devices and micro-batches. Then in the compact layout the sum's rounding to its
 * bf16 home (with, clipping, its sum of squares); across ranks the sum over the ranks (dist.c),
 * which takes the tile's sum of squares for the norm, else, clipping over several devices, that
 * sum of squares here (on one device the compute tasks take it). */
static void gradient_done(mt_graph *g, mt_tile *t)
{
    const int n = g->ndev < g->sc.accum ? g->ndev : g->sc.accum; /* copies written this step */
    for (int s = 1; s < n - 1; s *= 2)
        for (int d = 1; d + s < n; d += 2 * s) add_copy(g, d, grad_of(g, t, d), grad_of(g, t, d + s));
    if (n > 1) add_copy(g, 0, grad_of(g, t, 0), grad_of(g, t, 1));
    if (g->ndev > 1 && mt_step_first_copy(g) == 0) {
        mt_step_check_insert(starpu_task_insert(&mt_cl_grad_copy, STARPU_R, grad_of(g, t, 0), STARPU_W, t->h_grad,
                                                STARPU_EXECUTE_WHERE, g->where, STARPU_EXECUTE_ON_WORKER,
                                                g->dev_worker[0], STARPU_PRIORITY, STARPU_MAX_PRIO,
                                                STARPU_NAME, "grad_copy", 0),
                             "grad_copy");
        mt_step_drop(grad_of(g, t, 0));
    }
    if (g->st->layout == MT_LAYOUT_COMPACT) insert_grad_home(g, t);
    else if (g->dist_size > 1) mt_step_dist_reduce(g, t);
    else if (g->ndev > 1 && g->sc.clip > 0) mt_step_insert_sumsq(g, t);
}

void mt_step_insert_sumsq(mt_graph *g, mt_tile *t)
{
    mt_step_check_insert(starpu_task_insert(&mt_cl_grad_sumsq, STARPU_R, t->h_grad, STARPU_W, g->partial[t->index],
                                            STARPU_EXECUTE_WHERE, STARPU_CPU, STARPU_PRIORITY, STARPU_MAX_PRIO,
                                            STARPU_NAME, "grad_sumsq", 0),
                         "grad_sumsq");
}

/* Forward, loss anchor and block-wise backward of every micro-batch of a step. Gradients of a
 * tile are written (=) by micro-batch 0 and accumulated (+=) by the others, in micro-batch
 * order; the last writer of each tile also leaves its sum of squares when clipping, or in the
 * compact layout its grad_home does, after it. */
static void submit_micro_batches(mt_graph *g, mt_step_slot *sl, int64_t step, double loss_scale, bool early_table)
{
    mt_host_state *st = g->st;
    const int L = (int)st->cfg.layers, K = g->sc.K, M = g->sc.accum;
    mt_tile *embed = mt_state_embed(st), *head = mt_state_head(st);
    const int head_tile = st->ntiles - 1, last_block = g->nblocks - 1;
    const bool compact = st->layout == MT_LAYOUT_COMPACT;
    /* the compute tasks take the sums of squares; across ranks or devices the sum's task does
     * (gradient_done) */
    const bool clipped = g->sc.clip > 0 && !compact && g->dist_size == 1 && g->ndev == 1;
    const bool summed = g->dist_size > 1 || g->ndev > 1;

    submit_forward(g, sl->h_tokens, M, sl, step, true);
    /* The load-balancing loss's gradient scale: coef x E / R^2 for a micro-batch's R router rows,
     * each micro-batch's loss weighing 1 / M in the step's objective (mt_graph_wait_loss). */
    const double aux_scale = mt_moe_aux_grad_scale(st->cfg.experts, g->aux_rows, g->aux_coef, 1.0 / (M * g->dist_size));

    /* Loss anchor: dh_L goes to grad[u][L % 2], the input of layer L-1's backward. */
    for (int u = 0; u < M; u++) {
        const bool first = first_of_copy(g, u), sumsq = u == M - 1 && clipped;
        const enum starpu_data_access_mode gmode = first ? STARPU_W : STARPU_RW;
        mt_compute_args a = { .model = &g->model, .B = g->sc.B, .T = g->sc.T, .accumulate = !first,
                              .loss_scale = loss_scale, .head_chunk = g->sc.head_chunk, .sumsq = sumsq,
                              .table_sumsq = sumsq && g->speculation.head_table };
        struct starpu_data_descr hd[11] = {
            { head->h_weights, STARPU_R }, { g->act[u][L % 2], STARPU_R }, { sl->h_targets[u], STARPU_R },
            { g->grad[u][L % 2], STARPU_W }, { grad_of(g, head, u), gmode }, { sl->h_loss[u], STARPU_W },
            { g->scratch_head, STARPU_SCRATCH }, { embed->h_weights, STARPU_R }, { grad_of(g, embed, u), gmode },
        };
        int nhd = st->cfg.tied ? 9 : 7;
        if (sumsq) hd[nhd++] = (struct starpu_data_descr){ g->partial[head_tile], STARPU_W };
        if (a.table_sumsq) hd[nhd++] = (struct starpu_data_descr){ g->speculation.head_table, STARPU_W };
        mt_step_check_insert(starpu_task_insert(&mt_cl_head, STARPU_DATA_MODE_ARRAY, hd, nhd, STARPU_VALUE, &a, sizeof a,
                                        STARPU_NAME, "head", STARPU_EXECUTE_WHERE, g->where,
                                        STARPU_EXECUTE_ON_WORKER, worker_of(g, u),
                                        STARPU_TASK_SCHED_DATA, first ? mt_step_hint(g, last_block * K + 1, 0) : NULL, 0),
                     "head");
        if (u == M - 1 && (compact || summed)) gradient_done(g, head);
        if (sumsq) mt_speculation_insert_known(&g->speculation, st, g->partial, head_tile);
        /* The forward's hidden states are dead now (the recompute rewrites them): dropped, so
         * that making room on the GPU never copies them back to the host. */
        mt_step_drop(g->act[u][0]);
        mt_step_drop(g->act[u][1]);
    }

    /* Block-wise backward: for each block, each micro-batch recomputes it from its checkpoint and
     * walks it back, while the block's weights and gradients stay on the GPU. Hints: the first
     * micro-batch of each device brings the block in; its last one points past the block. */
    for (int b = last_block; b >= 0; b--) {
        int lo = b * K, hi = lo + K < L ? lo + K : L;
        for (int u = 0; u < M; u++) {
            const bool first = first_of_copy(g, u), last = u == M - 1, last_here = last_of_copy(g, u);
            const bool sumsq = last && clipped;
            const enum starpu_data_access_mode gmode = first ? STARPU_W : STARPU_RW;
            for (int i = lo; i < hi; i++) {
                starpu_data_handle_t x = i == lo ? mt_step_ckpt(g, b, u) : g->act[u][i % 2];
                /* after the last recompute comes its own backward, then layer hi-2's */
                void *hint = !first ? NULL
                             : i + 1 < hi ? mt_step_hint(g, i + 2, 0)
                             : hi - 2 >= lo ? mt_step_hint(g, hi - 1, 0) : hint_after_backward(g, lo);
                insert_layer_forward(g, i, u, x, g->act[u][(i + 1) % 2], saved_of(g, u, i - lo), NULL, step, false, hint,
                                     i == lo ? fetch_after_recompute(g, b, u) : NULL);
                if (i == lo) release_checkpoint(g, b, x); /* the block's checkpoint has served */
            }
            for (int i = hi - 1; i >= lo; i--) {
                mt_tile *t = mt_state_layer(st, i);
                starpu_data_handle_t stats = router_stats(g, sl, i, u);
                mt_compute_args ba = { .model = &g->model, .B = g->sc.B, .T = g->sc.T, .accumulate = !first, .sumsq = sumsq,
                                       .layer = i, .router_stats = stats != NULL, .aux_scale = aux_scale };
                struct starpu_data_descr bd[8] = {
                    { t->h_weights, STARPU_R }, { saved_of(g, u, i - lo), STARPU_R }, { g->grad[u][(i + 1) % 2], STARPU_R },
                    { g->grad[u][i % 2], STARPU_W }, { grad_of(g, t, u), gmode }, { g->scratch_layer, STARPU_SCRATCH },
                };
                int nbd = 6;
                if (sumsq) bd[nbd++] = (struct starpu_data_descr){ g->partial[t->index], STARPU_W };
                if (stats) bd[nbd++] = (struct starpu_data_descr){ stats, STARPU_R };
                bool leaves_block = i % K == 0;
                void *hint = (leaves_block ? last_here : first) ? hint_after_backward(g, i) : NULL;
                mt_step_check_insert(starpu_task_insert(&mt_cl_layer_backward, STARPU_DATA_MODE_ARRAY, bd, nbd,
                                                STARPU_VALUE, &ba, sizeof ba, STARPU_NAME, "layer_backward",
                                                STARPU_EXECUTE_WHERE, g->where, STARPU_EXECUTE_ON_WORKER, worker_of(g, u),
                                                STARPU_TASK_SCHED_DATA, hint,
                                                MT_OBSERVE_END(&g->observer, last, MT_EV_BACKWARD, step, t->index), 0),
                             "layer_backward");
                if (last && (compact || summed)) gradient_done(g, t);
                if (sumsq) mt_speculation_insert_known(&g->speculation, st, g->partial, t->index);
                mt_step_drop(saved_of(g, u, i - lo));
            }
            mt_step_drop(g->act[u][0]);
            mt_step_drop(g->act[u][1]);
        }
    }
    /* With the table's update started early, the embedding backward runs on its chunks in its
     * early path (table.c), which reads dh0 (grad[u][0]). */
    if (early_table) {
        for (int u = 0; u < M; u++) mt_step_drop(g->grad[u][1]);
        return;
    }
    /* With a tied head the head tasks already wrote the embedding gradient this step. The last
     * one points at the next step's first layer (after its update). */
    for (int u = 0; u < M; u++) {
        const bool last = u == M - 1;
        /* with a tied head the head tasks already wrote the table's gradient copies this step */
        const bool first = first_of_copy(g, u) && !st->cfg.tied;
        mt_compute_args ea = { .model = &g->model, .B = g->sc.B, .T = g->sc.T, .accumulate = !first,
                               .sumsq = last && clipped };
        struct starpu_data_descr ed[5] = {
            { sl->h_tokens[u], STARPU_R }, { g->grad[u][0], STARPU_R },
            { grad_of(g, embed, u), first ? STARPU_W : STARPU_RW },
            { g->scratch_layer, STARPU_SCRATCH }, { g->partial[0], STARPU_W },
        };
        mt_step_check_insert(starpu_task_insert(&mt_cl_embedding_backward, STARPU_DATA_MODE_ARRAY, ed, ea.sumsq ? 5 : 4,
                                        STARPU_VALUE, &ea, sizeof ea, STARPU_NAME, "embedding_backward",
                                        STARPU_EXECUTE_WHERE, g->where, STARPU_EXECUTE_ON_WORKER, worker_of(g, u),
                                        STARPU_TASK_SCHED_DATA, last_of_copy(g, u) ? mt_step_hint(g, 1, 1) : NULL, 0),
                     "embedding_backward");
        if (last && (compact || summed)) gradient_done(g, embed);
        mt_step_drop(g->grad[u][0]);
        mt_step_drop(g->grad[u][1]);
    }
}

/* Copies host data into a registered host handle once its earlier readers are done. */
static void fill_handle(starpu_data_handle_t h, void *dst, const void *src, size_t bytes)
{
    starpu_data_acquire(h, STARPU_W);
    memcpy(dst, src, bytes);
    starpu_data_release(h);
}

/* Zeroes a registered host handle once its earlier readers are done. */
static void zero_handle(starpu_data_handle_t h, void *dst, size_t bytes)
{
    starpu_data_acquire(h, STARPU_W);
    memset(dst, 0, bytes);
    starpu_data_release(h);
}

int mt_step_submit_compute(mt_graph *g, int64_t step, const int32_t *tokens, const int32_t *targets, bool early_table)
{
    mt_speculation_begin_step(&g->speculation, &g->update);
    int s = g->next_slot;
    g->next_slot = (g->next_slot + 1) % MT_STEP_SLOTS;
    mt_step_slot *sl = &g->slots[s];
    sl->updated = sl->speculated = false;
    const int accum = g->sc.accum;
    int64_t counted = 0;
    for (int64_t e = 0; e < accum * g->ntok; e++) counted += targets[e] >= 0;
    /* across ranks the objective is the mean over every rank's targets (collective: every rank
     * submits its steps in the same order) */
    if (g->dist_size > 1) counted = mt_dist_sum_i64(counted);
    for (int u = 0; u < accum; u++) {
        fill_handle(sl->h_tokens[u], sl->tokens + u * g->ntok, tokens + u * g->ntok, g->ntok * sizeof(int32_t));
        fill_handle(sl->h_targets[u], sl->targets + u * g->ntok, targets + u * g->ntok, g->ntok * sizeof(int32_t));
        if (sl->h_router_stats) zero_handle(sl->h_router_stats[u], sl->router_stats + u * 2 * g->st->cfg.experts,
                                            2 * (size_t)g->st->cfg.experts * sizeof(double));
    }
    /* The step's loss is the mean over every counted target of every micro-batch (of every
     * rank), plus, with the load-balancing loss, coef x the mean over the micro-batches of each
     * one's aux loss. */
    double loss_scale = counted > 0 ? 1.0 / (double)counted : 0.0;
    submit_micro_batches(g, sl, step, loss_scale, early_table);

    return s;
}

int mt_graph_submit_compute(mt_graph *g, int64_t step, const int32_t *tokens, const int32_t *targets)
{
    return mt_step_submit_compute(g, step, tokens, targets, false);
}

double mt_graph_wait_loss(mt_graph *g, int slot_id, double *grad_norm)
{
    mt_step_slot *sl = &g->slots[slot_id];
    double sum = 0, count = 0;
    for (int u = 0; u < g->sc.accum; u++) {
        starpu_data_acquire(sl->h_loss[u], STARPU_R);
        sum += sl->loss[2 * u];
        count += sl->loss[2 * u + 1];
        starpu_data_release(sl->h_loss[u]);
    }
    /* transformers adds coef x aux per forward call: here per micro-batch, averaged over them. */
    double aux = 0;
    for (int u = 0; sl->h_router_stats && u < g->sc.accum; u++) {
        starpu_data_acquire(sl->h_router_stats[u], STARPU_R);
        aux += mt_moe_aux_loss(g->st->cfg.experts, g->aux_rows, sl->router_stats + u * 2 * g->st->cfg.experts);
        starpu_data_release(sl->h_router_stats[u]);
    }
    if (g->dist_size > 1) {
        /* the global batch's: every rank's sums, added in rank order (the same bits everywhere) */
        const double mine[3] = { sum, count, aux };
        double all[3];
        mt_dist_sum_f64(mine, all, 3);
        sum = all[0], count = all[1], aux = all[2] / g->dist_size;
    }
    aux *= g->aux_coef / g->sc.accum;
    double norm = NAN;
    if (g->sc.clip > 0 && sl->updated) {
        starpu_data_acquire(sl->h_clip_copy, STARPU_R);
        norm = sl->clip_result[0];
        const double scale = sl->clip_result[1];
        starpu_data_release(sl->h_clip_copy);
        mt_speculation_scale_read(&g->speculation, scale, sl->speculated);
        sl->updated = false;
    }
    if (grad_norm) *grad_norm = norm;
    return count > 0 ? sum / count + aux : NAN;
}

double mt_graph_eval(mt_graph *g, int64_t n_seq, const int32_t *tokens, const int32_t *targets, int64_t *counted)
{
    mt_host_state *st = g->st;
    double sum = 0, count = 0;
    for (int64_t s0 = 0; s0 + g->sc.B <= n_seq; s0 += g->sc.B) {
        fill_handle(g->h_eval_tokens, g->eval_tokens, tokens + s0 * g->sc.T, g->ntok * sizeof(int32_t));
        fill_handle(g->h_eval_targets, g->eval_targets, targets + s0 * g->sc.T, g->ntok * sizeof(int32_t));
        submit_forward(g, &g->h_eval_tokens, 1, NULL, 0, false);
        starpu_data_handle_t xL = g->act[0][st->cfg.layers % 2];
        mt_compute_args a = { .model = &g->model, .B = g->sc.B, .T = g->sc.T, .head_chunk = g->sc.head_chunk };
        struct starpu_data_descr hd[6] = {
            { mt_state_head(st)->h_weights, STARPU_R }, { xL, STARPU_R }, { g->h_eval_targets, STARPU_R },
            { g->h_eval_loss, STARPU_W }, { g->scratch_head, STARPU_SCRATCH }, { mt_state_embed(st)->h_weights, STARPU_R },
        };
        mt_step_check_insert(starpu_task_insert(&mt_cl_head_eval, STARPU_DATA_MODE_ARRAY, hd, st->cfg.tied ? 6 : 5,
                                        STARPU_VALUE, &a, sizeof a, STARPU_EXECUTE_WHERE, g->where, 0), "head_eval");
        starpu_data_acquire(g->h_eval_loss, STARPU_R);
        sum += g->eval_loss[0];
        count += g->eval_loss[1];
        starpu_data_release(g->h_eval_loss);
    }
    if (counted) *counted = (int64_t)count;
    return count > 0 ? sum / count : NAN;
}

void mt_graph_logits(mt_graph *g, const int32_t *tokens, const int32_t *positions, float *logits)
{
    mt_host_state *st = g->st;
    const int64_t B = g->sc.B, T = g->sc.T, V = st->cfg.vocab;
    int32_t *rows = malloc(sizeof *rows * (size_t)B);
    if (!rows) {
        fprintf(stderr, "megatrain: out of memory for the %lld logits rows of a forward\n", (long long)B);
        abort();
    }
    for (int64_t b = 0; b < B; b++) {
        if (positions[b] < 0 || positions[b] >= T) {
            fprintf(stderr, "megatrain: mt_graph_logits: position %d of sequence %lld outside [0, %lld)\n",
                    positions[b], (long long)b, (long long)T);
            abort();
        }
        rows[b] = (int32_t)(b * T + positions[b]);
    }
    /* The row indices and the logits are the caller's memory, registered for this call only;
     * the scratch has no home (-1): StarPU allocates it where the task runs. */
    starpu_data_handle_t h_rows, h_logits, h_scratch;
    starpu_vector_data_register(&h_rows, STARPU_MAIN_RAM, (uintptr_t)rows, (uint32_t)B, sizeof *rows);
    starpu_vector_data_register(&h_logits, STARPU_MAIN_RAM, (uintptr_t)logits, (uint32_t)(B * V), sizeof *logits);
    const size_t scratch = mt_codelet_head_logits_scratch_bytes(&st->cfg, st->compute_dtype, g->where == STARPU_CUDA, B);
    starpu_vector_data_register(&h_scratch, -1, 0, (uint32_t)((scratch + sizeof(float) - 1) / sizeof(float)), sizeof(float));
    fill_handle(g->h_eval_tokens, g->eval_tokens, tokens, g->ntok * sizeof(int32_t));
    submit_forward(g, &g->h_eval_tokens, 1, NULL, 0, false);
    mt_compute_args a = { .model = &g->model, .B = B, .T = T };
    struct starpu_data_descr hd[6] = {
        { mt_state_head(st)->h_weights, STARPU_R }, { g->act[0][st->cfg.layers % 2], STARPU_R }, { h_rows, STARPU_R },
        { h_logits, STARPU_W }, { h_scratch, STARPU_SCRATCH }, { mt_state_embed(st)->h_weights, STARPU_R },
    };
    mt_step_check_insert(starpu_task_insert(&mt_cl_head_logits, STARPU_DATA_MODE_ARRAY, hd, st->cfg.tied ? 6 : 5,
                                            STARPU_VALUE, &a, sizeof a, STARPU_NAME, "head_logits",
                                            STARPU_EXECUTE_WHERE, g->where, 0), "head_logits");
    /* Unregistering waits for the task and brings the logits home. */
    starpu_data_unregister(h_logits);
    starpu_data_unregister(h_rows);
    starpu_data_unregister(h_scratch);
    free(rows);
}
