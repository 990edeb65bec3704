/* The training step graph. With several micro-batches, every micro-batch passes through a layer
 * while its weights (and, in the backward, its gradient) are on the GPU: the micro-batch loop
 * is inside the layer loop, so weights and gradients move once per step, not once per
 * micro-batch. Handles, per micro-batch u:
 *   ckpt[b][u]  input of block b (layers bK .. bK+K-1), kept from forward to backward
 *   act[u][2]   forward ping-pong between checkpoints; grad[u][2] backward ping-pong
 * and shared:
 *   saved[j]    what layer j of the block being recomputed keeps for its backward (the
 *               micro-batches recompute and walk back a block one after the other)
 *   slot data   tokens, targets and loss of each micro-batch, two slots so step s+1 can be
 *               filled while step s still runs
 * Activations have no home (-1): StarPU allocates them where the task runs. */
#include "runtime/step.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "codelets/codelets.h"
#include "runtime/plan.h"
#include "runtime/policy.h"

#define NSLOTS 2
#define READY_RING 4

typedef struct slot {
    int32_t *tokens, *targets;               /* (accum, B*T) host arrays */
    starpu_data_handle_t *h_tokens, *h_targets, *h_loss;
    double *loss;                            /* (accum, 2): sum, count */
    double clip_result[2];
    starpu_data_handle_t h_clip_copy;
    bool updated, speculated;                /* an update of this slot's step was submitted; speculatively */
} slot;

/* An update whose moments halves wait for the next step's ranged runs (the table's for its early
 * path's)
 * (adamw_defer): its step and learning rate, its clip buffer (the slot's copy), and where its
 * gradient is now: each tile's current gradient, or after begin_step swapped them, the second
 * one. That gradient stays partitioned into chunks until those moments are submitted. */
typedef struct pending_update {
    bool active, swapped;
    int64_t step;
    double lr;
    starpu_data_handle_t clip;
} pending_update;

struct mt_graph {
    mt_host_state *st;
    mt_step_config sc;
    int64_t ntok;                             /* B * T */
    int nblocks;
    starpu_data_handle_t *ckpt;               /* (nblocks * accum), ckpt_of() */
    starpu_data_handle_t (*act)[2], (*grad)[2]; /* (accum) ping-pong pairs */
    starpu_data_handle_t *saved;
    starpu_data_handle_t scratch_layer, scratch_head;
    starpu_data_handle_t *partial;            /* (ntiles) one double each */
    double *partial_mem;
    starpu_data_handle_t *embed_partial;      /* (tile 0's nchunks) one double each: the early path */
    double *embed_partial_mem;
    starpu_data_handle_t *embed_rows;         /* (tile 0's nchunks) row sums of squares per chunk */
    double **embed_rows_mem;
    starpu_data_handle_t clip;                /* 2 doubles: norm, scale */
    double clip_mem[2];
    slot slots[NSLOTS];
    int next_slot;
    /* evaluation I/O (one micro-batch) */
    int32_t *eval_tokens, *eval_targets;
    starpu_data_handle_t h_eval_tokens, h_eval_targets, h_eval_loss;
    double eval_loss[2];
    mt_observer_fn observer;
    void *observer_user;
    uint32_t where;                           /* STARPU_CUDA when a GPU runs compute, else STARPU_CPU */
    uint32_t *updates_submitted;              /* (ntiles) AdamW rounds submitted per tile */
    struct ready_note { mt_graph *g; int tile; int64_t step; } *ready_notes; /* (READY_RING * ntiles) */
    double last_scale;                        /* clip scale of the last step read back; 0 before */
    starpu_data_handle_t **flags;             /* (ntiles)(nchunks) bitmaps of ranged speculation, or NULL */
    mt_norm_history hist;                     /* per-tile sums of squares of the last norms */
    starpu_data_handle_t head_table;          /* tied, ranged: the table gradient's head part, sum of squares */
    double head_table_mem;
    starpu_data_handle_t *known;              /* ranged: (ntiles) mt_cl_known's buffers, or NULL */
    double (*known_mem)[2];
    int64_t norm_seq;                         /* norms submitted */
    int64_t speculated, speculation_held;     /* mt_graph_speculation_counts */
    bool defer;                               /* ranged updates defer their moments (adamw_defer) */
    pending_update pend;
};

mt_step_config mt_step_defaults(void)
{
    mt_step_config c = {
        .B = 8, .T = 128, .accum = 1, .K = 4, .clip = 1.0, .head_chunk = 1024,
        .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.0, .adamw_split = -1,
        .clip_speculate = -1, .clip_range_check = -1, .adamw_defer = -1,
    };
    return c;
}

static starpu_data_handle_t new_floats(int64_t n)
{
    starpu_data_handle_t h;
    starpu_vector_data_register(&h, -1, 0, (uint32_t)n, sizeof(float));
    return h;
}

/* A buffer of at least `bytes`, counted in floats (a vector's length is 32-bit). */
static starpu_data_handle_t new_bytes(size_t bytes)
{
    return new_floats((int64_t)((bytes + sizeof(float) - 1) / sizeof(float)));
}

static starpu_data_handle_t host_vector(void *p, int64_t n, size_t esz)
{
    starpu_data_handle_t h;
    starpu_vector_data_register(&h, STARPU_MAIN_RAM, (uintptr_t)p, (uint32_t)n, esz);
    return h;
}

/* Whether the extra host state an auto option (adamw_defer) adds may be had: at most 80% of the
 * host memory available now. */
static bool fits_host(uint64_t bytes) { return bytes <= mt_host_memory_available() / 10 * 8; }

mt_graph *mt_graph_create(mt_host_state *st, const mt_step_config *sc, char *err, size_t errlen)
{
    const int64_t L = st->cfg.layers;
    if (sc->B < 1 || sc->T < 1 || sc->accum < 1 || sc->K < 1 || sc->K > L || sc->head_chunk < 1 || sc->clip < 0) {
        snprintf(err, errlen, "invalid step configuration: B=%lld T=%lld accum=%d K=%d (1..%lld) head_chunk=%lld clip=%g",
                 (long long)sc->B, (long long)sc->T, sc->accum, sc->K, (long long)L, (long long)sc->head_chunk, sc->clip);
        return NULL;
    }
    if (sc->T > st->cfg.max_positions) {
        snprintf(err, errlen, "sequence length %lld exceeds the model's max_position_embeddings %lld",
                 (long long)sc->T, (long long)st->cfg.max_positions);
        return NULL;
    }
    if (st->cfg.sliding_window > 0 && sc->T > st->cfg.sliding_window) {
        snprintf(err, errlen, "sequence length %lld exceeds the model's sliding_window %lld: sliding-window attention is "
                 "not implemented (full causal attention, which is the same up to that length)",
                 (long long)sc->T, (long long)st->cfg.sliding_window);
        return NULL;
    }
    /* A StarPU vector is at most 2^32 elements: 16 GiB of floats per buffer. */
    const size_t limit = (size_t)UINT32_MAX * sizeof(float);
    const bool gpu = starpu_cuda_worker_get_count() > 0;
    const size_t saved_bytes = mt_codelet_layer_saved_bytes(&st->cfg, st->compute_dtype, gpu, sc->B, sc->T);
    const size_t scratch_bytes = mt_codelet_layer_scratch_bytes(&st->cfg, st->compute_dtype, gpu, sc->B, sc->T);
    const size_t biggest[3] = { saved_bytes, scratch_bytes, (size_t)(sc->B * sc->T) * (size_t)st->cfg.hidden * sizeof(float) };
    for (int i = 0; i < 3; i++)
        if (biggest[i] > limit) {
            snprintf(err, errlen, "a micro-batch of %lld x %lld tokens needs a %zu-byte activation buffer, over the 16 GiB a "
                     "StarPU vector holds: use a smaller micro-batch (gradient accumulation keeps the step's tokens)",
                     (long long)sc->B, (long long)sc->T, biggest[i]);
            return NULL;
        }
    /* Deferred moments halves (ranged speculation): a second gradient for every tile, the table's
     * included (its moments half goes into its early path). Auto: when it takes at most 80% of
     * the host memory available now. */
    const bool ranged = sc->clip > 0 && st->compute_dtype == MT_DTYPE_BF16 &&
                        (sc->clip_speculate == 2 || (sc->clip_speculate < 0 && gpu));
    const bool defer = ranged && (sc->adamw_defer > 0 || (sc->adamw_defer < 0 && fits_host(mt_state_grad_alt_bytes(st, 0))));
    if (defer && mt_state_enable_grad_alt(st, 0, err, errlen)) return NULL;
    mt_graph *g = calloc(1, sizeof *g);
    g->st = st;
    g->defer = defer;
    g->where = gpu ? STARPU_CUDA : STARPU_CPU; /* every compute task runs there: buffers are sized for it */
    g->updates_submitted = calloc(st->ntiles, sizeof *g->updates_submitted);
    g->ready_notes = calloc((size_t)READY_RING * st->ntiles, sizeof *g->ready_notes);
    g->sc = *sc;
    g->ntok = sc->B * sc->T;
    g->nblocks = (int)((L + sc->K - 1) / sc->K);
    const int64_t d = st->cfg.hidden;

    g->ckpt = calloc((size_t)g->nblocks * sc->accum, sizeof *g->ckpt);
    for (int b = 0; b < g->nblocks * sc->accum; b++) g->ckpt[b] = new_floats(g->ntok * d);
    g->act = calloc(sc->accum, sizeof *g->act);
    g->grad = calloc(sc->accum, sizeof *g->grad);
    for (int u = 0; u < sc->accum; u++)
        for (int i = 0; i < 2; i++) {
            g->act[u][i] = new_floats(g->ntok * d);
            g->grad[u][i] = new_floats(g->ntok * d);
        }
    g->saved = calloc(sc->K, sizeof *g->saved);
    for (int j = 0; j < sc->K; j++) g->saved[j] = new_bytes(saved_bytes);
    g->scratch_layer = new_bytes(scratch_bytes);
    int64_t chunk = sc->head_chunk < g->ntok ? sc->head_chunk : g->ntok;
    g->sc.head_chunk = chunk;
    g->scratch_head = new_bytes(mt_codelet_head_scratch_bytes(&st->cfg, st->compute_dtype, gpu, chunk));

    g->partial_mem = calloc(st->ntiles, sizeof(double));
    g->partial = calloc(st->ntiles, sizeof *g->partial);
    for (int i = 0; i < st->ntiles; i++) g->partial[i] = host_vector(&g->partial_mem[i], 1, sizeof(double));
    const int nc0 = mt_state_embed(st)->nchunks;
    g->embed_partial_mem = calloc(nc0, sizeof(double));
    g->embed_partial = calloc(nc0, sizeof *g->embed_partial);
    for (int c = 0; c < nc0; c++) g->embed_partial[c] = host_vector(&g->embed_partial_mem[c], 1, sizeof(double));
    if (ranged) {
        /* Ranged speculation's bitmaps, one bit per parameter. */
        g->flags = calloc(st->ntiles, sizeof *g->flags);
        for (int i = 0; i < st->ntiles; i++) {
            mt_tile *t = &st->tiles[i];
            g->flags[i] = calloc(t->nchunks, sizeof **g->flags);
            for (int c = 0; c < t->nchunks; c++) g->flags[i][c] = new_bytes(mt_codelet_ranged_bitmap_bytes(t->chunks[c].numel));
        }
    }
    g->hist.ntiles = st->ntiles;
    for (int k = 0; k < 2; k++) g->hist.sumsq[k] = calloc(st->ntiles + 1, sizeof(double));
    for (int k = 0; k < 2; k++) g->hist.held[k] = calloc(st->ntiles, 1);
    g->hist.spread = g->sc.clip_range > 1 ? g->sc.clip_range : MT_CLIP_SPREAD_DEFAULT;
    g->hist.grow = g->sc.clip_range_grow > 0 ? g->sc.clip_range_grow : MT_CLIP_RANGE_GROW_DEFAULT;
    _Static_assert(MT_CLIP_RANGE_MEMORY_MAX == MT_NORM_MEMORY_MAX, "step.h and codelets.h disagree");
    g->hist.memory = g->sc.clip_range_memory > 0 ? g->sc.clip_range_memory : MT_CLIP_RANGE_MEMORY_DEFAULT;
    g->hist.check = g->sc.clip_range_check != 0;
    if (g->flags && st->cfg.tied) g->head_table = host_vector(&g->head_table_mem, 1, sizeof(double));
    if (g->flags) {
        g->known_mem = calloc(st->ntiles, sizeof *g->known_mem);
        g->known = calloc(st->ntiles, sizeof *g->known);
        for (int i = 0; i < st->ntiles; i++) g->known[i] = host_vector(g->known_mem[i], 2, sizeof(double));
    }
    g->embed_rows = calloc(nc0, sizeof *g->embed_rows);
    g->embed_rows_mem = calloc(nc0, sizeof *g->embed_rows_mem);
    for (int c = 0; c < nc0; c++) {
        const mt_chunk *ch = &mt_state_embed(st)->chunks[c];
        const int64_t nrows = mt_codelet_chunk_rows(ch->offset, ch->numel, st->cfg.hidden);
        g->embed_rows_mem[c] = calloc(nrows, sizeof(double));
        g->embed_rows[c] = host_vector(g->embed_rows_mem[c], nrows, sizeof(double));
    }
    g->clip = host_vector(g->clip_mem, 2, sizeof(double));

    for (int s = 0; s < NSLOTS; s++) {
        slot *sl = &g->slots[s];
        sl->tokens = calloc((size_t)sc->accum * g->ntok, sizeof(int32_t));
        sl->targets = calloc((size_t)sc->accum * g->ntok, sizeof(int32_t));
        sl->loss = calloc((size_t)sc->accum * 2, sizeof(double));
        sl->h_tokens = calloc(sc->accum, sizeof(starpu_data_handle_t));
        sl->h_targets = calloc(sc->accum, sizeof(starpu_data_handle_t));
        sl->h_loss = calloc(sc->accum, sizeof(starpu_data_handle_t));
        for (int u = 0; u < sc->accum; u++) {
            sl->h_tokens[u] = host_vector(sl->tokens + u * g->ntok, g->ntok, sizeof(int32_t));
            sl->h_targets[u] = host_vector(sl->targets + u * g->ntok, g->ntok, sizeof(int32_t));
            sl->h_loss[u] = host_vector(sl->loss + 2 * u, 2, sizeof(double));
        }
        sl->h_clip_copy = host_vector(sl->clip_result, 2, sizeof(double));
    }
    g->eval_tokens = calloc(g->ntok, sizeof(int32_t));
    g->eval_targets = calloc(g->ntok, sizeof(int32_t));
    g->h_eval_tokens = host_vector(g->eval_tokens, g->ntok, sizeof(int32_t));
    g->h_eval_targets = host_vector(g->eval_targets, g->ntok, sizeof(int32_t));
    g->h_eval_loss = host_vector(g->eval_loss, 2, sizeof(double));
    mt_policy_attach(st);
    return g;
}

uint64_t mt_graph_working_bytes(const mt_graph *g)
{
    uint64_t n = starpu_data_get_size(g->scratch_layer) + starpu_data_get_size(g->scratch_head);
    for (int b = 0; b < g->nblocks * g->sc.accum; b++) n += starpu_data_get_size(g->ckpt[b]);
    for (int u = 0; u < g->sc.accum; u++)
        for (int i = 0; i < 2; i++) n += starpu_data_get_size(g->act[u][i]) + starpu_data_get_size(g->grad[u][i]);
    for (int j = 0; j < g->sc.K; j++) n += starpu_data_get_size(g->saved[j]);
    return n;
}

void mt_graph_destroy(mt_graph *g)
{
    if (!g) return;
    mt_graph_flush(g);
    starpu_task_wait_for_all();
    mt_policy_detach();
    for (int b = 0; b < g->nblocks * g->sc.accum; b++) starpu_data_unregister(g->ckpt[b]);
    for (int u = 0; u < g->sc.accum; u++)
        for (int i = 0; i < 2; i++) {
            starpu_data_unregister(g->act[u][i]);
            starpu_data_unregister(g->grad[u][i]);
        }
    free(g->act);
    free(g->grad);
    for (int j = 0; j < g->sc.K; j++) starpu_data_unregister(g->saved[j]);
    starpu_data_unregister(g->scratch_layer);
    starpu_data_unregister(g->scratch_head);
    for (int i = 0; i < g->st->ntiles; i++) starpu_data_unregister(g->partial[i]);
    for (int i = 0; g->flags && i < g->st->ntiles; i++) {
        for (int c = 0; c < g->st->tiles[i].nchunks; c++) starpu_data_unregister(g->flags[i][c]);
        free(g->flags[i]);
    }
    free(g->flags);
    if (g->head_table) starpu_data_unregister(g->head_table);
    for (int i = 0; g->known && i < g->st->ntiles; i++) starpu_data_unregister(g->known[i]);
    free(g->known);
    free(g->known_mem);
    free(g->hist.sumsq[0]);
    free(g->hist.sumsq[1]);
    free(g->hist.held[0]);
    free(g->hist.held[1]);
    free(g->hist.log);
    for (int c = 0; c < mt_state_embed(g->st)->nchunks; c++) {
        starpu_data_unregister(g->embed_partial[c]);
        starpu_data_unregister(g->embed_rows[c]);
        free(g->embed_rows_mem[c]);
    }
    starpu_data_unregister(g->clip);
    for (int s = 0; s < NSLOTS; s++) {
        slot *sl = &g->slots[s];
        for (int u = 0; u < g->sc.accum; u++) {
            starpu_data_unregister(sl->h_tokens[u]);
            starpu_data_unregister(sl->h_targets[u]);
            starpu_data_unregister(sl->h_loss[u]);
        }
        starpu_data_unregister(sl->h_clip_copy);
        free(sl->tokens); free(sl->targets); free(sl->loss);
        free(sl->h_tokens); free(sl->h_targets); free(sl->h_loss);
    }
    starpu_data_unregister(g->h_eval_tokens);
    starpu_data_unregister(g->h_eval_targets);
    starpu_data_unregister(g->h_eval_loss);
    free(g->eval_tokens); free(g->eval_targets);
    free(g->ckpt); free(g->saved); free(g->partial); free(g->partial_mem);
    free(g->embed_partial); free(g->embed_partial_mem);
    free(g->embed_rows); free(g->embed_rows_mem);
    free(g->updates_submitted);
    free(g->ready_notes);
    free(g);
}

void mt_graph_set_observer(mt_graph *g, mt_observer_fn fn, void *user)
{
    g->observer = fn;
    g->observer_user = user;
}

/* What a task's end callback reports to the observer. Freed by the callback. */
typedef struct event_note {
    mt_graph *g;
    mt_event_kind kind;
    int64_t step;
    int tile;
} event_note;

static void notify_observer(void *arg)
{
    event_note *n = arg;
    n->g->observer(n->g->observer_user, n->kind, n->step, n->tile);
    free(n);
}

/* The note a task's callback hands to the observer; notify_observer frees it (so the callback
 * arguments are given to StarPU as NFREE). */
static event_note *note_new(mt_graph *g, mt_event_kind kind, int64_t step, int tile)
{
    event_note *n = malloc(sizeof *n);
    *n = (event_note){ g, kind, step, tile };
    return n;
}

static void check_insert(int ret, const char *what)
{
    if (ret != 0) {
        fprintf(stderr, "megatrain: submitting %s failed (%d)\n", what, ret);
        abort();
    }
}

/* Checkpoint of block b for micro-batch u. */
static starpu_data_handle_t ckpt_of(mt_graph *g, int b, int u) { return g->ckpt[b * g->sc.accum + u]; }

/* Input handle of layer i (0-based) in the forward pass of micro-batch u. */
static starpu_data_handle_t forward_input(mt_graph *g, int i, int u)
{
    return i % g->sc.K == 0 ? ckpt_of(g, i / g->sc.K, u) : g->act[u][i % 2];
}

/* Output handle of layer i: the next block's checkpoint, or the ping-pong buffer. */
static starpu_data_handle_t forward_output(mt_graph *g, int i, int u)
{
    int L = (int)g->st->cfg.layers;
    if ((i + 1) % g->sc.K == 0 && i + 1 < L) return ckpt_of(g, (i + 1) / g->sc.K, u);
    return g->act[u][(i + 1) % 2];
}

/* Prefetch hint for a task: the weights of the next tile the GPU will need, current once the
 * updates submitted so far (plus `ahead`, for the next step's first layer) have landed. */
static void *hint_for(mt_graph *g, int tile, uint32_t ahead)
{
    if (tile < 0) return NULL;
    return mt_policy_hint(tile, g->updates_submitted[tile] + ahead);
}

/* Observer callbacks of a task: none without an observer, or when `on` is false. */
#define OBSERVED(g, on) ((on) && (g)->observer)
#define OBSERVE_END(g, on, kind_, step_, tile_)                                                   \
    STARPU_CALLBACK_WITH_ARG_NFREE, OBSERVED(g, on) ? notify_observer : NULL,                     \
        OBSERVED(g, on) ? note_new((g), (kind_), (step_), (tile_)) : NULL
#define OBSERVE_START(g, on, kind_, step_, tile_)                                                 \
    STARPU_PROLOGUE_CALLBACK_POP, OBSERVED(g, on) ? notify_observer : NULL,                       \
        STARPU_PROLOGUE_CALLBACK_POP_ARG_NFREE, OBSERVED(g, on) ? note_new((g), (kind_), (step_), (tile_)) : NULL

/* observe: report start/end of this forward (the streaming pass of a training step). */
static void insert_layer_forward(mt_graph *g, int i, starpu_data_handle_t x, starpu_data_handle_t y,
                                 starpu_data_handle_t saved, int64_t step, bool observe, void *hint)
{
    mt_tile *t = mt_state_layer(g->st, i);
    mt_compute_args a = { .st = g->st, .B = g->sc.B, .T = g->sc.T, .save = saved != NULL };
    struct starpu_data_descr d[5] = {
        { t->h_weights, STARPU_R }, { x, STARPU_R }, { y, STARPU_W }, { g->scratch_layer, STARPU_SCRATCH },
        { saved, STARPU_W },
    };
    check_insert(starpu_task_insert(&mt_cl_layer_forward, STARPU_DATA_MODE_ARRAY, d, saved ? 5 : 4,
                                    STARPU_VALUE, &a, sizeof a, STARPU_NAME, "layer_forward",
                                    STARPU_EXECUTE_WHERE, g->where, STARPU_TASK_SCHED_DATA, hint,
                                    OBSERVE_END(g, observe, MT_EV_FORWARD, step, t->index),
                                    OBSERVE_START(g, observe, MT_EV_FORWARD_START, step, t->index), 0),
                 "layer_forward");
}

/* The forward pass of micro-batches 0..n-1 up to x_L (act[u][L % 2]), layer by layer: each
 * layer's weights serve every micro-batch in turn. The first micro-batch's task carries the
 * prefetch hint for the next tile. */
static void submit_forward(mt_graph *g, const starpu_data_handle_t *tokens, int n, int64_t step, bool observe)
{
    const int L = (int)g->st->cfg.layers;
    mt_compute_args a = { .st = g->st, .B = g->sc.B, .T = g->sc.T };
    for (int u = 0; u < n; u++)
        check_insert(starpu_task_insert(&mt_cl_embedding_forward, STARPU_R, mt_state_embed(g->st)->h_weights,
                                        STARPU_R, tokens[u], STARPU_W, ckpt_of(g, 0, u), STARPU_VALUE, &a, sizeof a,
                                        STARPU_EXECUTE_WHERE, g->where,
                                        STARPU_TASK_SCHED_DATA, u == 0 ? hint_for(g, 1, 0) : NULL,
                                        OBSERVE_START(g, observe && u == 0, MT_EV_FORWARD_START, step, 0), 0),
                     "embedding_forward");
    for (int i = 0; i < L; i++) {
        int next = i + 1 < L ? i + 2 : g->st->ntiles - 1; /* the next layer, or the head */
        for (int u = 0; u < n; u++)
            insert_layer_forward(g, i, forward_input(g, i, u), forward_output(g, i, u), NULL, step, observe && u == 0,
                                 u == 0 ? hint_for(g, next, 0) : NULL);
    }
}

/* Drops the contents of an activation buffer once its last reader is submitted (ordered after
 * it, like a task). An activation has no home node, so a valid copy StarPU evicts to make room
 * is written back to host memory first: the H200 spent ~0.1 s per step copying stale
 * checkpoints and saved activations back when the head's buffers arrived. Dropped, the buffer
 * is free to recycle with no copy. */
static void drop(starpu_data_handle_t h)
{
    starpu_data_invalidate_submit(h);
}

/* Prefetch hint for the weights the GPU needs after layer i's backward (block-wise order): the
 * previous layer, or the first layer of the previous block's recompute; after layer 0, the
 * embedding backward reads no weights, so the next step's embedding forward, once this step's
 * update of tile 0 has landed. (Hinting tile 0 at its current version instead let the policy
 * prefetch it while its AdamW partition could already be active: its last reader, the tied
 * head, ran at the start of the backward; StarPU aborts on such a prefetch.) */
static void *hint_after_backward(mt_graph *g, int i)
{
    const int K = g->sc.K;
    if (i % K != 0) return hint_for(g, i, 0);                      /* layer i-1 is tile i */
    if (i == 0) return hint_for(g, 0, 1);                          /* next step's embedding */
    return hint_for(g, (i / K - 1) * K + 1, 0);                    /* first layer of block i/K - 1 */
}

/* Ranged speculation: tile i's known buffer, once its gradient is whole (mt_cl_known). */
static void submit_known(mt_graph *g, int i)
{
    if (!g->known) return;
    const int head_tile = g->st->ntiles - 1;
    int from_head = i == head_tile, n = 0;
    struct starpu_data_descr d[3];
    d[n++] = (struct starpu_data_descr){ g->partial[i], STARPU_R };
    if (!from_head) d[n++] = (struct starpu_data_descr){ g->known[i + 1], STARPU_R };
    else if (g->head_table) d[n++] = (struct starpu_data_descr){ g->head_table, STARPU_R };
    d[n++] = (struct starpu_data_descr){ g->known[i], STARPU_W };
    check_insert(starpu_task_insert(&mt_cl_known, STARPU_DATA_MODE_ARRAY, d, n, STARPU_VALUE, &from_head, sizeof from_head,
                                    STARPU_EXECUTE_WHERE, STARPU_CPU, STARPU_PRIORITY, STARPU_MAX_PRIO,
                                    STARPU_NAME, "known", 0),
                 "known");
}

/* Forward, loss anchor and block-wise backward of every micro-batch of a step. Gradients of a
 * tile are written (=) by micro-batch 0 and accumulated (+=) by the others, in micro-batch
 * order; the last writer of each tile also leaves its sum of squares when clipping. */
static void submit_micro_batches(mt_graph *g, slot *sl, int64_t step, double loss_scale, bool early_embed)
{
    mt_host_state *st = g->st;
    const int L = (int)st->cfg.layers, K = g->sc.K, M = g->sc.accum;
    mt_tile *embed = mt_state_embed(st), *head = mt_state_head(st);
    const int head_tile = st->ntiles - 1, last_block = g->nblocks - 1;

    submit_forward(g, sl->h_tokens, M, step, true);

    /* Loss anchor: dh_L goes to grad[u][L % 2], the input of layer L-1's backward. */
    for (int u = 0; u < M; u++) {
        const bool first = u == 0, sumsq = u == M - 1 && g->sc.clip > 0;
        const enum starpu_data_access_mode gmode = first ? STARPU_W : STARPU_RW;
        mt_compute_args a = { .st = st, .B = g->sc.B, .T = g->sc.T, .accumulate = !first,
                              .loss_scale = loss_scale, .head_chunk = g->sc.head_chunk, .sumsq = sumsq,
                              .table_sumsq = sumsq && g->head_table };
        struct starpu_data_descr hd[11] = {
            { head->h_weights, STARPU_R }, { g->act[u][L % 2], STARPU_R }, { sl->h_targets[u], STARPU_R },
            { g->grad[u][L % 2], STARPU_W }, { head->h_grad, gmode }, { sl->h_loss[u], STARPU_W },
            { g->scratch_head, STARPU_SCRATCH }, { embed->h_weights, STARPU_R }, { embed->h_grad, gmode },
        };
        int nhd = st->cfg.tied ? 9 : 7;
        if (sumsq) hd[nhd++] = (struct starpu_data_descr){ g->partial[head_tile], STARPU_W };
        if (a.table_sumsq) hd[nhd++] = (struct starpu_data_descr){ g->head_table, STARPU_W };
        check_insert(starpu_task_insert(&mt_cl_head, STARPU_DATA_MODE_ARRAY, hd, nhd, STARPU_VALUE, &a, sizeof a,
                                        STARPU_NAME, "head", STARPU_EXECUTE_WHERE, g->where,
                                        STARPU_TASK_SCHED_DATA, first ? hint_for(g, last_block * K + 1, 0) : NULL, 0),
                     "head");
        if (sumsq) submit_known(g, head_tile);
        /* The forward's hidden states are dead now (the recompute rewrites them): dropped, so
         * that making room on the GPU never copies them back to the host. */
        drop(g->act[u][0]);
        drop(g->act[u][1]);
    }

    /* Block-wise backward: for each block, each micro-batch recomputes it from its checkpoint and
     * walks it back, while the block's weights and gradients stay on the GPU. Hints: the first
     * micro-batch brings the block in; the last one points past the block. */
    for (int b = last_block; b >= 0; b--) {
        int lo = b * K, hi = lo + K < L ? lo + K : L;
        for (int u = 0; u < M; u++) {
            const bool first = u == 0, last = u == M - 1;
            const bool sumsq = last && g->sc.clip > 0;
            const enum starpu_data_access_mode gmode = first ? STARPU_W : STARPU_RW;
            for (int i = lo; i < hi; i++) {
                starpu_data_handle_t x = i == lo ? ckpt_of(g, b, u) : g->act[u][i % 2];
                /* after the last recompute comes its own backward, then layer hi-2's */
                void *hint = !first ? NULL
                             : i + 1 < hi ? hint_for(g, i + 2, 0)
                             : hi - 2 >= lo ? hint_for(g, hi - 1, 0) : hint_after_backward(g, lo);
                insert_layer_forward(g, i, x, g->act[u][(i + 1) % 2], g->saved[i - lo], step, false, hint);
                if (i == lo) drop(x); /* the block's checkpoint has served */
            }
            for (int i = hi - 1; i >= lo; i--) {
                mt_tile *t = mt_state_layer(st, i);
                mt_compute_args ba = { .st = st, .B = g->sc.B, .T = g->sc.T, .accumulate = !first, .sumsq = sumsq };
                struct starpu_data_descr bd[7] = {
                    { t->h_weights, STARPU_R }, { g->saved[i - lo], STARPU_R }, { g->grad[u][(i + 1) % 2], STARPU_R },
                    { g->grad[u][i % 2], STARPU_W }, { t->h_grad, gmode }, { g->scratch_layer, STARPU_SCRATCH },
                    { g->partial[t->index], STARPU_W },
                };
                bool leaves_block = i % K == 0;
                void *hint = (leaves_block ? last : first) ? hint_after_backward(g, i) : NULL;
                check_insert(starpu_task_insert(&mt_cl_layer_backward, STARPU_DATA_MODE_ARRAY, bd, sumsq ? 7 : 6,
                                                STARPU_VALUE, &ba, sizeof ba, STARPU_NAME, "layer_backward",
                                                STARPU_EXECUTE_WHERE, g->where, STARPU_TASK_SCHED_DATA, hint,
                                                OBSERVE_END(g, last, MT_EV_BACKWARD, step, t->index), 0),
                             "layer_backward");
                if (sumsq) submit_known(g, t->index);
                drop(g->saved[i - lo]);
            }
            drop(g->act[u][0]);
            drop(g->act[u][1]);
        }
    }
    /* With the table's update started early, the embedding backward runs on its chunks in
     * submit_embedding_early, which reads dh0 (grad[u][0]). */
    if (early_embed) {
        for (int u = 0; u < M; u++) drop(g->grad[u][1]);
        return;
    }
    /* With a tied head the head tasks already wrote the embedding gradient this step. The last
     * one points at the next step's first layer (after its update). */
    for (int u = 0; u < M; u++) {
        const bool last = u == M - 1;
        mt_compute_args ea = { .st = st, .B = g->sc.B, .T = g->sc.T, .accumulate = u > 0 || st->cfg.tied,
                               .sumsq = last && g->sc.clip > 0 };
        struct starpu_data_descr ed[5] = {
            { sl->h_tokens[u], STARPU_R }, { g->grad[u][0], STARPU_R }, { embed->h_grad, ea.accumulate ? STARPU_RW : STARPU_W },
            { g->scratch_layer, STARPU_SCRATCH }, { g->partial[0], STARPU_W },
        };
        check_insert(starpu_task_insert(&mt_cl_embedding_backward, STARPU_DATA_MODE_ARRAY, ed, ea.sumsq ? 5 : 4,
                                        STARPU_VALUE, &ea, sizeof ea, STARPU_NAME, "embedding_backward",
                                        STARPU_EXECUTE_WHERE, g->where,
                                        STARPU_TASK_SCHED_DATA, last ? hint_for(g, 1, 1) : NULL, 0),
                     "embedding_backward");
        drop(g->grad[u][0]);
        drop(g->grad[u][1]);
    }
}

/* Copies host data into a registered host handle once its earlier readers are done. */
static void fill_handle(starpu_data_handle_t h, void *dst, const void *src, size_t bytes)
{
    starpu_data_acquire(h, STARPU_W);
    memcpy(dst, src, bytes);
    starpu_data_release(h);
}

static void begin_step(mt_graph *g);

static int submit_compute(mt_graph *g, int64_t step, const int32_t *tokens, const int32_t *targets, bool early_embed)
{
    begin_step(g);
    int s = g->next_slot;
    g->next_slot = (g->next_slot + 1) % NSLOTS;
    slot *sl = &g->slots[s];
    sl->updated = sl->speculated = false;
    const int accum = g->sc.accum;
    int64_t counted = 0;
    for (int64_t e = 0; e < accum * g->ntok; e++) counted += targets[e] >= 0;
    for (int u = 0; u < accum; u++) {
        fill_handle(sl->h_tokens[u], sl->tokens + u * g->ntok, tokens + u * g->ntok, g->ntok * sizeof(int32_t));
        fill_handle(sl->h_targets[u], sl->targets + u * g->ntok, targets + u * g->ntok, g->ntok * sizeof(int32_t));
    }
    /* The step's loss is the mean over every counted target of every micro-batch. */
    double loss_scale = counted > 0 ? 1.0 / (double)counted : 0.0;
    submit_micro_batches(g, sl, step, loss_scale, early_embed);

    return s;
}

int mt_graph_submit_compute(mt_graph *g, int64_t step, const int32_t *tokens, const int32_t *targets)
{
    return submit_compute(g, step, tokens, targets, false);
}

void mt_graph_submit_norm(mt_graph *g)
{
    if (g->sc.clip <= 0) return;
    mt_host_state *st = g->st;
    /* The partial sums were left by each tile's last backward task of the step. */
    struct starpu_data_descr *cd = calloc(st->ntiles + 2, sizeof *cd);
    for (int i = 0; i < st->ntiles; i++) cd[i] = (struct starpu_data_descr){ g->partial[i], STARPU_R };
    cd[st->ntiles] = (struct starpu_data_descr){ g->clip, STARPU_W };
    /* recorded for the next step's ranged runs */
    if (g->head_table) cd[st->ntiles + 1] = (struct starpu_data_descr){ g->head_table, STARPU_R };
    double max_norm = g->sc.clip;
    mt_norm_history *hist = &g->hist;
    int64_t seq = ++g->norm_seq;
    check_insert(starpu_task_insert(&mt_cl_clip, STARPU_DATA_MODE_ARRAY, cd, st->ntiles + 1 + (g->head_table != NULL),
                                    STARPU_VALUE, &max_norm, sizeof max_norm, STARPU_VALUE, &hist, sizeof hist,
                                    STARPU_VALUE, &seq, sizeof seq, STARPU_NAME, "clip",
                                    STARPU_EXECUTE_WHERE, STARPU_CPU, STARPU_PRIORITY, STARPU_MAX_PRIO, 0), "clip");
    free(cd);
}

/* Unpartition callback: the tile's streamed weights are whole and current in host memory. */
static void tile_updated(void *arg)
{
    struct ready_note *n = arg;
    mt_policy_tile_updated(n->tile);
    if (n->g->observer) n->g->observer(n->g->observer_user, MT_EV_TILE_READY, n->step, n->tile);
}

/* Priority of tile i's moments half of a split update: below every weights half, and the tiles
 * whose gradient the next backward overwrites first (head, and the embedding when tied, then
 * the last layer) ahead of the rest. */
static int moments_priority(const mt_host_state *st, int i)
{
    int rank = i == 0 ? (st->cfg.tied ? st->ntiles : 0) : i; /* tiles: 0 embed, 1..L layers, L+1 head */
    int prio = STARPU_MIN_PRIO + 1 + rank;
    return prio > 0 ? 0 : prio;
}

/* With clipping every AdamW task waits for the global norm, so the update sits between the
 * backward and the next forward. Split, the weights half (18 of the fused update's 30 bytes per
 * parameter: master, m, v, grad read; the bf16 streamed copy written) is all the next forward
 * waits for; the second half (the fused kernel without the streamed copy: master, m, v updated
 * in place) runs in the CPU's idle time before the next backward overwrites the gradient
 * (StarPU orders it by the data). Without clipping only the embedding and layer 0 are split:
 * their updates come last (their gradients are the backward's last) and are needed first, at
 * the step boundary. */
static bool split_update(const mt_graph *g, int tile)
{
    if (g->sc.adamw_split >= 0) return g->sc.adamw_split > 0;
    return g->sc.clip > 0 || tile < 2;
}

void mt_graph_set_adamw_split(mt_graph *g, int split) { g->sc.adamw_split = split; }

void mt_graph_set_clip_speculate(mt_graph *g, int speculate) { g->sc.clip_speculate = speculate; }

int mt_graph_keep_norms(mt_graph *g, int64_t max_norms)
{
    starpu_task_wait_for_all(); /* no clip task writes the log while it moves */
    free(g->hist.log);
    g->hist.log = NULL;
    g->hist.log_cap = 0;
    g->hist.log_from = g->norm_seq;
    if (max_norms <= 0) return 0;
    g->hist.log = calloc((size_t)max_norms * (size_t)(g->st->ntiles + 1), sizeof(double));
    if (!g->hist.log) return -1;
    g->hist.log_cap = max_norms;
    return 0;
}

const double *mt_graph_kept_norms(const mt_graph *g, int64_t *count, int *width)
{
    *width = g->st->ntiles + 1;
    const int64_t n = g->norm_seq - g->hist.log_from;
    *count = g->hist.log ? (n < g->hist.log_cap ? n : g->hist.log_cap) : 0;
    return g->hist.log;
}

void mt_graph_speculation_counts(const mt_graph *g, int64_t *speculated, int64_t *held)
{
    *speculated = g->speculated;
    *held = g->speculation_held;
}

/* How this step's update speculates (clip_speculate): not at all, as if the scale were 1 (the
 * last one was), or, when asked (2), for a range of scales (bf16 streamed weights, whose rounding
 * hides the scale from most elements: MT_ADAMW_RANGED). Each chunk's range is decided when its
 * weights half runs (mt_ranged_args); [lo, hi] here is its fallback without a last norm: the
 * last scale read back, times or over 1.25. */
typedef struct speculation {
    enum { SPEC_NONE, SPEC_UNIT, SPEC_RANGED } mode;
    double lo, hi;
} speculation;

static speculation speculate_update(const mt_graph *g)
{
    if (g->sc.clip <= 0 || g->sc.clip_speculate == 0) return (speculation){ SPEC_NONE, 0, 0 };
    if (g->sc.clip_speculate == 1 || g->last_scale == 1.0) return (speculation){ SPEC_UNIT, 1.0, 1.0 };
    if ((g->sc.clip_speculate == 2 || g->sc.clip_speculate < 0) && g->flags) {
        if (g->last_scale <= 0) return (speculation){ SPEC_RANGED, 0, 1.0 };
        return (speculation){ SPEC_RANGED, g->last_scale / 1.25, fmin(1.0, g->last_scale * 1.25) };
    }
    return (speculation){ SPEC_NONE, 0, 0 };
}

/* The ranged run of a chunk of tile `first_tile`, of the step whose norm is number `seq`, knowing
 * the sums of squares of tiles first_tile..ntiles-1. */
static mt_ranged_args ranged_args_of(const mt_graph *g, int first_tile, speculation sp, int64_t seq)
{
    return (mt_ranged_args){
        .hist = (mt_norm_history *)&g->hist, .seq = seq, .first_tile = first_tile, .clip = g->sc.clip,
        .head_table = g->head_table != NULL,
        .max_ratio = g->sc.clip_range_max > 1 ? g->sc.clip_range_max : MT_CLIP_RANGE_MAX_DEFAULT,
        .lo = sp.lo, .hi = sp.hi,
    };
}

/* The moments half of chunk c of tile t (mt_cl_adamw_moments): master, m and v in place from the
 * gradient chunk `grad`, times the scale in the clip buffer `clip` (NULL: unclipped). */
static void insert_moments(mt_graph *g, mt_tile *t, int c, starpu_data_handle_t grad, starpu_data_handle_t clip,
                           const mt_adamw_params *p)
{
    const int clipped = clip ? MT_ADAMW_CLIPPED : MT_ADAMW_UNCLIPPED;
    struct starpu_data_descr d[5] = {
        { t->h_master_chunk[c], STARPU_RW }, { t->h_m_chunk[c], STARPU_RW }, { t->h_v_chunk[c], STARPU_RW },
        { grad, STARPU_R }, { clip, STARPU_R },
    };
    check_insert(starpu_task_insert(&mt_cl_adamw_moments, STARPU_DATA_MODE_ARRAY, d, clip ? 5 : 4, STARPU_VALUE, p,
                                    sizeof *p, STARPU_VALUE, &clipped, sizeof clipped,
                                    STARPU_PRIORITY, moments_priority(g->st, t->index), STARPU_EXECUTE_WHERE, STARPU_CPU,
                                    STARPU_NAME, "adamw_moments", 0),
                 "adamw_moments");
}

/* One AdamW task on chunk c of tile t: the fused update or the weights half (clip:
 * mt_adamw_clip). A ranged run (`sp`: the fallback range) also reads its tile's known buffer
 * (mt_cl_known, mt_ranged_args). */
static void insert_adamw(mt_graph *g, mt_tile *t, int c, struct starpu_codelet *cl, int clip, int prio,
                         const mt_adamw_params *p, int64_t step, bool observe, const speculation *sp)
{
    const enum starpu_data_access_mode state = cl == &mt_cl_adamw ? STARPU_RW : STARPU_R;
    const bool confirm = clip == MT_ADAMW_CONFIRM || clip == MT_ADAMW_CONFIRM_RANGED;
    const enum starpu_data_access_mode weights = confirm ? STARPU_RW : STARPU_W;
    struct starpu_data_descr d[9];
    d[0] = (struct starpu_data_descr){ t->h_master_chunk[c], state };
    d[1] = (struct starpu_data_descr){ t->h_m_chunk[c], state };
    d[2] = (struct starpu_data_descr){ t->h_v_chunk[c], state };
    d[3] = (struct starpu_data_descr){ t->h_grad_chunk[c], STARPU_R };
    d[4] = (struct starpu_data_descr){ t->h_weights_chunk[c], weights };
    d[5] = (struct starpu_data_descr){ g->clip, STARPU_R };
    int nbuf = clip ? 6 : 5;
    mt_ranged_args ra = { 0 };
    if (clip == MT_ADAMW_RANGED) {
        d[5] = (struct starpu_data_descr){ g->flags[t->index][c], STARPU_W };
        /* tile 0's update is ranged on the early path only (submit_embedding_early) */
        d[nbuf++] = (struct starpu_data_descr){ g->known[t->index], STARPU_R };
        ra = ranged_args_of(g, t->index, *sp, g->norm_seq); /* after the step's norm was submitted */
    }
    if (clip == MT_ADAMW_CONFIRM_RANGED) d[nbuf++] = (struct starpu_data_descr){ g->flags[t->index][c], STARPU_R };
    mt_dtype dtype = g->st->compute_dtype;
    /* the last argument, the last step's parameters, is read by MT_ADAMW_RANGED_DEFERRED only
     * (insert_ranged_deferred) */
    int ret = starpu_task_insert(cl, STARPU_DATA_MODE_ARRAY, d, nbuf, STARPU_VALUE, p, sizeof *p,
                                 STARPU_VALUE, &dtype, sizeof dtype, STARPU_VALUE, &clip, sizeof clip,
                                 STARPU_VALUE, &ra, sizeof ra, STARPU_VALUE, p, sizeof *p,
                                 STARPU_PRIORITY, prio, STARPU_EXECUTE_WHERE, STARPU_CPU,
                                 STARPU_NAME, confirm ? "adamw_confirm" : clip == MT_ADAMW_RANGED ? "adamw_ranged" : cl->name,
                                 OBSERVE_END(g, observe, MT_EV_ADAMW, step, t->index), 0);
    check_insert(ret, cl->name);
}

static mt_adamw_params adamw_params_of(const mt_graph *g, const mt_chunk *c, int64_t step, double lr)
{
    return (mt_adamw_params){
        .lr = lr, .beta1 = g->sc.beta1, .beta2 = g->sc.beta2, .eps = g->sc.eps,
        .weight_decay = c->decay ? g->sc.weight_decay : 0.0, .step = step, .grad_scale = 1.0,
    };
}

/* This step's ranged run of chunk c of tile t after the pending update's moments half of it
 * (MT_ADAMW_RANGED_DEFERRED), `old`: that update's gradient chunk. */
static void insert_ranged_deferred(mt_graph *g, mt_tile *t, int c, starpu_data_handle_t old, int prio,
                                   const mt_adamw_params *p, speculation sp)
{
    const mt_adamw_params po = adamw_params_of(g, &t->chunks[c], g->pend.step, g->pend.lr);
    const mt_ranged_args ra = ranged_args_of(g, t->index, sp, g->norm_seq);
    const mt_dtype dtype = g->st->compute_dtype;
    const int clip = MT_ADAMW_RANGED_DEFERRED;
    struct starpu_data_descr d[9] = {
        { t->h_master_chunk[c], STARPU_RW }, { t->h_m_chunk[c], STARPU_RW }, { t->h_v_chunk[c], STARPU_RW },
        { t->h_grad_chunk[c], STARPU_R }, { t->h_weights_chunk[c], STARPU_W }, { g->flags[t->index][c], STARPU_W },
        { g->known[t->index], STARPU_R }, { old, STARPU_R }, { g->pend.clip, STARPU_R },
    };
    check_insert(starpu_task_insert(&mt_cl_adamw_params, STARPU_DATA_MODE_ARRAY, d, 9, STARPU_VALUE, p, sizeof *p,
                                    STARPU_VALUE, &dtype, sizeof dtype, STARPU_VALUE, &clip, sizeof clip,
                                    STARPU_VALUE, &ra, sizeof ra, STARPU_VALUE, &po, sizeof po,
                                    STARPU_PRIORITY, prio, STARPU_EXECUTE_WHERE, STARPU_CPU,
                                    STARPU_NAME, "adamw_ranged_deferred", 0),
                 "adamw_ranged_deferred");
}

/* The pending moments halves of tile t (g->pend), then its gradient's partition given back. */
static void submit_pending_tile(mt_graph *g, mt_tile *t)
{
    starpu_data_handle_t whole = g->pend.swapped ? t->h_grad_alt : t->h_grad;
    starpu_data_handle_t *chunks = g->pend.swapped ? t->h_grad_alt_chunk : t->h_grad_chunk;
    for (int c = 0; c < t->nchunks; c++) {
        const mt_adamw_params p = adamw_params_of(g, &t->chunks[c], g->pend.step, g->pend.lr);
        insert_moments(g, t, c, chunks[c], g->pend.clip, &p);
    }
    starpu_data_unpartition_submit(whole, t->nchunks, chunks, STARPU_MAIN_RAM);
}

bool mt_graph_defers(const mt_graph *g) { return g->defer; }
void mt_graph_log_defer(const mt_graph *g, FILE *log, const char *prefix)
{
    const double gb = (double)mt_state_grad_alt_bytes(g->st, 0) / 1e9;
    if (g->sc.adamw_defer > 0 && !g->defer)
        fprintf(log, "%s: --adamw-defer on has no effect here: it needs ranged clip speculation (bf16 weights, clipping, "
                     "and --clip-speculate ranged, or auto with a GPU)\n", prefix);
    if (g->sc.adamw_defer < 0 && g->flags && !g->defer) /* ranged, but auto declined (fits_host) */
        fprintf(log, "%s: AdamW moments halves not deferred (--adamw-defer auto): a second gradient (%.2f GB) would "
                     "take over 80%% of the host memory available\n", prefix, gb);
    if (g->defer)
        fprintf(log, "%s: AdamW moments halves deferred to the next step's ranged runs (--adamw-defer): %.2f GB more "
                     "%shost memory for a second gradient\n", prefix, gb, g->st->pinned ? "pinned " : "");
}

void mt_graph_flush(mt_graph *g)
{
    if (!g->pend.active) return;
    for (int i = 0; i < g->st->ntiles; i++) submit_pending_tile(g, &g->st->tiles[i]);
    g->pend.active = false;
}

/* Before a step's compute: with moments pending, either the step's update takes them over
 * (ranged, deferring: the gradients swap, the step writing the free ones) or they run now. */
static void begin_step(mt_graph *g)
{
    if (!g->pend.active || g->pend.swapped) return;
    if (g->defer && speculate_update(g).mode == SPEC_RANGED) {
        for (int i = 0; i < g->st->ntiles; i++) mt_tile_swap_grad(&g->st->tiles[i]);
        g->pend.swapped = true;
    } else {
        mt_graph_flush(g);
    }
}

/* Whether this update's ranged runs take over the moments pending from the last one (deferred,
 * the gradients swapped by begin_step); if not, those run now, before anything reads the state.
 * Asked by the table's early path first, then by submit_update, with the same answer. */
static bool take_over_pending(mt_graph *g, speculation sp)
{
    const bool take = g->pend.active && g->pend.swapped && sp.mode == SPEC_RANGED;
    if (g->pend.active && !take) mt_graph_flush(g);
    return take;
}

/* Whether this step's update of the table starts before its embedding backward
 * (submit_embedding_early): when the weights half of that update runs as soon as a gradient is
 * in, i.e. split, and without clipping or speculatively. */
static bool early_embedding(const mt_graph *g, speculation sp)
{
    return g->sc.clip > 0 ? sp.mode != SPEC_NONE : split_update(g, 0);
}

/* The table's update, started before its embedding backward. The tied head wrote the table's
 * gradient at the start of the backward (untied: it is zero before the embedding backward), and
 * that is the whole gradient of every row no token of the step touches: so the weights half
 * runs on each chunk then, during the backward, and the embedding backward, on the CPU per chunk
 * once dh0 is in, adds the tokens' rows and redoes the weights half of those rows only. The next
 * forward then waits for the touched rows instead of the whole table (3B on the H200: the
 * embedding forward started 0.04-0.07 s after layer 0's backward instead of 0.14 s). Bitwise the
 * same weights and gradient as the plain path; the sum of squares for clipping too (per row,
 * as mt_codelet_tile_sumsq: the head's rows summed during the backward, only the touched ones
 * again at its end). */
static void submit_embedding_early(mt_graph *g, int slot_id, int64_t step, double lr, speculation sp)
{
    mt_host_state *st = g->st;
    mt_tile *t = mt_state_embed(st);
    slot *sl = &g->slots[slot_id];
    const int M = g->sc.accum, clipped = g->sc.clip > 0;
    /* Moments pending from the last update (deferred): the table's go into its early ranged
     * runs, as submit_update's do for the other tiles. */
    const bool take_over = take_over_pending(g, sp);
    mt_policy_tile_submitting(0, true);
    starpu_data_partition_submit(t->h_weights, t->nchunks, t->h_weights_chunk);
    starpu_data_partition_submit(t->h_grad, t->nchunks, t->h_grad_chunk);
    const int nbuf = 1 + 2 * M + 4 + 2 * clipped + 1;
    struct starpu_data_descr *d = calloc(nbuf, sizeof *d);
    for (int c = 0; c < t->nchunks; c++) {
        mt_adamw_params p = adamw_params_of(g, &t->chunks[c], step, lr);
        if (!st->cfg.tied) {
            float zero = 0.0f;
            check_insert(starpu_task_insert(&mt_cl_fill, STARPU_W, t->h_grad_chunk[c], STARPU_VALUE, &zero, sizeof zero,
                                            STARPU_EXECUTE_WHERE, STARPU_CPU, STARPU_PRIORITY, STARPU_MAX_PRIO, 0),
                         "fill");
        }
        mt_embed_chunk_args a = { .offset = t->chunks[c].offset, .d = st->cfg.hidden, .ntok = g->ntok,
                                  .micro_batches = M, .sumsq = clipped, .p = p, .dtype = st->compute_dtype,
                                  .ranged = sp.mode == SPEC_RANGED };
        /* ranged: its range from the head tile's known buffer, in by then (before the step's
         * norm is submitted) */
        if (a.ranged) a.ra = ranged_args_of(g, st->ntiles - 1, sp, g->norm_seq + 1);
        a.deferred = take_over;
        if (take_over) a.po = adamw_params_of(g, &t->chunks[c], g->pend.step, g->pend.lr);
        const enum starpu_data_access_mode state = take_over ? STARPU_RW : STARPU_R;
        struct starpu_data_descr ud[10] = {
            { t->h_master_chunk[c], state }, { t->h_m_chunk[c], state }, { t->h_v_chunk[c], state },
            { t->h_grad_chunk[c], STARPU_R }, { t->h_weights_chunk[c], STARPU_W }, { g->embed_rows[c], STARPU_W },
            { a.ranged ? g->flags[0][c] : NULL, STARPU_W }, { a.ranged ? g->known[st->ntiles - 1] : NULL, STARPU_R },
            { take_over ? t->h_grad_alt_chunk[c] : NULL, STARPU_R }, { g->pend.clip, STARPU_R },
        };
        check_insert(starpu_task_insert(&mt_cl_embedding_update_early, STARPU_DATA_MODE_ARRAY, ud,
                                        take_over ? 10 : a.ranged ? 8 : 6,
                                        STARPU_VALUE, &a, sizeof a, STARPU_EXECUTE_WHERE, STARPU_CPU,
                                        STARPU_PRIORITY, STARPU_MAX_PRIO, 0),
                     "embedding_update_early");
        int k = 0;
        d[k++] = (struct starpu_data_descr){ t->h_grad_chunk[c], STARPU_RW };
        for (int u = 0; u < M; u++) {
            d[k++] = (struct starpu_data_descr){ sl->h_tokens[u], STARPU_R };
            d[k++] = (struct starpu_data_descr){ g->grad[u][0], STARPU_R };
        }
        d[k++] = (struct starpu_data_descr){ t->h_master_chunk[c], STARPU_R };
        d[k++] = (struct starpu_data_descr){ t->h_m_chunk[c], STARPU_R };
        d[k++] = (struct starpu_data_descr){ t->h_v_chunk[c], STARPU_R };
        d[k++] = (struct starpu_data_descr){ t->h_weights_chunk[c], STARPU_RW };
        if (clipped) {
            d[k++] = (struct starpu_data_descr){ g->embed_rows[c], STARPU_RW };
            d[k++] = (struct starpu_data_descr){ g->embed_partial[c], STARPU_W };
        }
        if (a.ranged) d[k++] = (struct starpu_data_descr){ g->flags[0][c], STARPU_RW };
        check_insert(starpu_task_insert(&mt_cl_embedding_backward_chunk, STARPU_DATA_MODE_ARRAY, d, k,
                                        STARPU_VALUE, &a, sizeof a, STARPU_EXECUTE_WHERE, STARPU_CPU,
                                        STARPU_PRIORITY, STARPU_MAX_PRIO, STARPU_NAME, "embedding_backward_chunk",
                                        OBSERVE_END(g, !clipped, MT_EV_ADAMW, step, 0), 0),
                     "embedding_backward_chunk");
    }
    free(d);
    if (take_over) starpu_data_unpartition_submit(t->h_grad_alt, t->nchunks, t->h_grad_alt_chunk, STARPU_MAIN_RAM);
    if (clipped) {
        struct starpu_data_descr *pd = calloc(t->nchunks + 1, sizeof *pd);
        for (int c = 0; c < t->nchunks; c++) pd[c] = (struct starpu_data_descr){ g->embed_partial[c], STARPU_R };
        pd[t->nchunks] = (struct starpu_data_descr){ g->partial[0], STARPU_W };
        check_insert(starpu_task_insert(&mt_cl_sum_partials, STARPU_DATA_MODE_ARRAY, pd, t->nchunks + 1,
                                        STARPU_EXECUTE_WHERE, STARPU_CPU, STARPU_PRIORITY, STARPU_MAX_PRIO,
                                        STARPU_NAME, "sum_partials", 0),
                     "sum_partials");
        free(pd);
    }
    for (int u = 0; u < M; u++) drop(g->grad[u][0]);
}

/* The update of every tile; `embed_started`: submit_embedding_early did tile 0's partition and
 * weights half. */
static void submit_update(mt_graph *g, int64_t step, double lr, speculation sp, bool embed_started)
{
    mt_host_state *st = g->st;
    const int clipped = g->sc.clip > 0 ? MT_ADAMW_CLIPPED : MT_ADAMW_UNCLIPPED;
    const bool speculate = sp.mode != SPEC_NONE;
    int slot_id = (g->next_slot + NSLOTS - 1) % NSLOTS;
    g->slots[slot_id].updated = true;
    g->slots[slot_id].speculated = speculate;
    if (clipped) {
        /* Keep this step's norm for mt_graph_wait_loss before the next step overwrites it (and
         * for deferred moments halves). */
        check_insert(starpu_data_cpy(g->slots[slot_id].h_clip_copy, g->clip, 1, NULL, NULL), "clip copy");
    }
    /* Moments pending from the last update: taken over by this one's ranged runs; or, when this
     * update is not ranged (the mode changed between compute and update), run first. */
    const bool take_over = take_over_pending(g, sp);
    /* This update's own moments halves wait for the next step's ranged runs (the table's for its
     * next early path). */
    const bool defer = g->defer && sp.mode == SPEC_RANGED;
    for (int i = 0; i < st->ntiles; i++) {
        mt_tile *t = &st->tiles[i];
        const bool started = embed_started && i == 0;
        const bool split = speculate || split_update(g, i);
        /* The next forward needs tile 0 first: earlier tiles get higher priority. */
        int prio = STARPU_MAX_PRIO - i;
        if (prio < STARPU_MIN_PRIO) prio = STARPU_MIN_PRIO;
        if (!started) {
            mt_policy_tile_submitting(i, true);
            starpu_data_partition_submit(t->h_weights, t->nchunks, t->h_weights_chunk);
            starpu_data_partition_submit(t->h_grad, t->nchunks, t->h_grad_chunk);
        }
        for (int c = 0; c < t->nchunks; c++) {
            mt_adamw_params p = adamw_params_of(g, &t->chunks[c], step, lr);
            if (started) {
                if (clipped)
                    insert_adamw(g, t, c, &mt_cl_adamw_params,
                                 sp.mode == SPEC_RANGED ? MT_ADAMW_CONFIRM_RANGED : MT_ADAMW_CONFIRM, prio, &p, step,
                                 true, NULL);
            } else if (sp.mode == SPEC_UNIT) {
                /* As the gradient lands (no wait for the norm), then confirmed after it. */
                insert_adamw(g, t, c, &mt_cl_adamw_params, MT_ADAMW_UNCLIPPED, prio, &p, step, false, NULL);
                insert_adamw(g, t, c, &mt_cl_adamw_params, MT_ADAMW_CONFIRM, prio, &p, step, true, NULL);
            } else if (sp.mode == SPEC_RANGED) {
                if (take_over) insert_ranged_deferred(g, t, c, t->h_grad_alt_chunk[c], prio, &p, sp);
                else insert_adamw(g, t, c, &mt_cl_adamw_params, MT_ADAMW_RANGED, prio, &p, step, false, &sp);
                insert_adamw(g, t, c, &mt_cl_adamw_params, MT_ADAMW_CONFIRM_RANGED, prio, &p, step, true, NULL);
            } else {
                insert_adamw(g, t, c, split ? &mt_cl_adamw_params : &mt_cl_adamw, clipped, prio, &p, step, true, NULL);
            }
            if (split && !defer) insert_moments(g, t, c, t->h_grad_chunk[c], clipped ? g->clip : NULL, &p);
        }
        /* Gather back in host memory, where the next forward's transfer starts; then tell the
         * policy, which may be waiting to prefetch this tile. */
        /* Notes are reused READY_RING steps later: by then this update has landed (submitting
         * step s follows the loss of step s-2, whose forward needed the update of step s-3). */
        struct ready_note *note = &g->ready_notes[(step % READY_RING) * st->ntiles + i];
        *note = (struct ready_note){ g, i, step };
        starpu_data_unpartition_submit_sequential_consistency_cb(t->h_weights, t->nchunks, t->h_weights_chunk,
                                                                 STARPU_MAIN_RAM, 1, tile_updated, note);
        /* deferred: the gradient stays partitioned for the next step's ranged runs, the last
         * one's is given back once those were submitted */
        if (!defer) starpu_data_unpartition_submit(t->h_grad, t->nchunks, t->h_grad_chunk, STARPU_MAIN_RAM);
        /* the table's early path took its pending moments over, and gave the last gradient back */
        if (take_over && !started)
            starpu_data_unpartition_submit(t->h_grad_alt, t->nchunks, t->h_grad_alt_chunk, STARPU_MAIN_RAM);
        mt_policy_tile_submitting(i, false);
        g->updates_submitted[i]++;
    }
    if (defer)
        g->pend = (pending_update){ .active = true, .swapped = false, .step = step, .lr = lr,
                                     .clip = g->slots[slot_id].h_clip_copy };
    else if (take_over)
        g->pend.active = false;
}

void mt_graph_submit_update(mt_graph *g, int64_t step, double lr)
{
    submit_update(g, step, lr, speculate_update(g), false);
}

int mt_graph_submit_step(mt_graph *g, int64_t step, const int32_t *tokens, const int32_t *targets, double lr)
{
    const speculation sp = speculate_update(g);
    const bool early = early_embedding(g, sp);
    int s = submit_compute(g, step, tokens, targets, early);
    if (early) submit_embedding_early(g, s, step, lr, sp);
    mt_graph_submit_norm(g);
    submit_update(g, step, lr, sp, early);
    return s;
}

starpu_data_handle_t mt_graph_clip_handle(mt_graph *g) { return g->clip; }

double mt_graph_wait_loss(mt_graph *g, int slot_id, double *grad_norm)
{
    slot *sl = &g->slots[slot_id];
    double sum = 0, count = 0;
    for (int u = 0; u < g->sc.accum; u++) {
        starpu_data_acquire(sl->h_loss[u], STARPU_R);
        sum += sl->loss[2 * u];
        count += sl->loss[2 * u + 1];
        starpu_data_release(sl->h_loss[u]);
    }
    double norm = NAN;
    if (g->sc.clip > 0 && sl->updated) {
        starpu_data_acquire(sl->h_clip_copy, STARPU_R);
        norm = sl->clip_result[0];
        g->last_scale = sl->clip_result[1];
        starpu_data_release(sl->h_clip_copy);
        if (sl->speculated) {
            /* held: the scale was 1, what a unit speculation assumed (a ranged one's chunks count
             * their own: mt_codelet_ranged_counts) */
            g->speculated++;
            g->speculation_held += (float)g->last_scale == 1.0f;
        }
        sl->updated = false;
    }
    if (grad_norm) *grad_norm = norm;
    return count > 0 ? sum / count : NAN;
}

double mt_graph_eval(mt_graph *g, int64_t n_seq, const int32_t *tokens, const int32_t *targets, int64_t *counted)
{
    mt_host_state *st = g->st;
    double sum = 0, count = 0;
    for (int64_t s0 = 0; s0 + g->sc.B <= n_seq; s0 += g->sc.B) {
        fill_handle(g->h_eval_tokens, g->eval_tokens, tokens + s0 * g->sc.T, g->ntok * sizeof(int32_t));
        fill_handle(g->h_eval_targets, g->eval_targets, targets + s0 * g->sc.T, g->ntok * sizeof(int32_t));
        submit_forward(g, &g->h_eval_tokens, 1, 0, false);
        starpu_data_handle_t xL = g->act[0][st->cfg.layers % 2];
        mt_compute_args a = { .st = st, .B = g->sc.B, .T = g->sc.T, .head_chunk = g->sc.head_chunk };
        struct starpu_data_descr hd[6] = {
            { mt_state_head(st)->h_weights, STARPU_R }, { xL, STARPU_R }, { g->h_eval_targets, STARPU_R },
            { g->h_eval_loss, STARPU_W }, { g->scratch_head, STARPU_SCRATCH }, { mt_state_embed(st)->h_weights, STARPU_R },
        };
        check_insert(starpu_task_insert(&mt_cl_head_eval, STARPU_DATA_MODE_ARRAY, hd, st->cfg.tied ? 6 : 5,
                                        STARPU_VALUE, &a, sizeof a, STARPU_EXECUTE_WHERE, g->where, 0), "head_eval");
        starpu_data_acquire(g->h_eval_loss, STARPU_R);
        sum += g->eval_loss[0];
        count += g->eval_loss[1];
        starpu_data_release(g->h_eval_loss);
    }
    if (counted) *counted = (int64_t)count;
    return count > 0 ? sum / count : NAN;
}
