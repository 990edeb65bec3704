/* The step graph's buffers and life (runtime/step/graph.h): the configuration's checks, the
 * activation, scratch and I/O handles, the model description the tasks see, and the accessors of
 * runtime/step.h. */
#include "runtime/step/graph.h"

#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cpu/table_sumsq.h"
#include "runtime/dist.h"
#include "runtime/plan.h"
#include "runtime/policy.h"

mt_step_config mt_step_defaults(void)
{
    mt_step_config c = {
        .B = 8, .T = 128, .accum = 1, .K = 4, .clip = 1.0, .head_chunk = 1024,
        .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.0, .adamw_split = -1,
        .clip_speculate = -1, .clip_range_check = -1, .adamw_defer = -1, .ranged_bounds = MT_RANGED_BOUNDS_DEFAULT,
        .offload_checkpoints = -1, .mlp_chunk = MT_MLP_CHUNK_AUTO,
    };
    return c;
}

/* The layers' saved activations and the scratch buffers are bytes to the codelets, which read only
 * their pointers: they are vectors of 64-byte units, so that one may hold more than the 16 GiB of
 * 2^32 floats (a vector's length is 32-bit), which a layer's saved activations pass at a quarter
 * of a million tokens. */
#define BYTE_UNIT MT_PLAN_BYTE_UNIT
#define BYTE_BUFFER_MAX ((size_t)UINT32_MAX * BYTE_UNIT)

static uint32_t byte_units(size_t bytes) { return (uint32_t)(mt_plan_byte_buffer(bytes) / BYTE_UNIT); }

/* A byte buffer with no home: StarPU allocates it where the task runs. */
static starpu_data_handle_t new_bytes(size_t bytes)
{
    starpu_data_handle_t h;
    starpu_vector_data_register(&h, -1, 0, byte_units(bytes), BYTE_UNIT);
    return h;
}

static starpu_data_handle_t host_vector(void *p, int64_t n, size_t esz)
{
    starpu_data_handle_t h;
    starpu_vector_data_register(&h, STARPU_MAIN_RAM, (uintptr_t)p, (uint32_t)n, esz);
    return h;
}

/* The configuration against the model; 0 or -1 with err set. */
static int check_config(const mt_host_state *st, const mt_step_config *sc, bool gpu, char *err, size_t errlen)
{
    const int64_t L = st->cfg.layers;
    if (sc->B < 1 || sc->T < 1 || sc->accum < 1 || sc->K < 1 || sc->K > L || sc->head_chunk < 1 || sc->clip < 0) {
        snprintf(err, errlen, "invalid step configuration: B=%lld T=%lld accum=%d K=%d (1..%lld) head_chunk=%lld clip=%g",
                 (long long)sc->B, (long long)sc->T, sc->accum, sc->K, (long long)L, (long long)sc->head_chunk, sc->clip);
        return -1;
    }
    if (sc->ranged_side_room != 0 &&
        (sc->ranged_side_room < MT_RANGED_SIDE_ROOM_MIN || sc->ranged_side_room > MT_RANGED_SIDE_ROOM_MAX)) {
        snprintf(err, errlen, "invalid step configuration: ranged_side_room=%d (room for 1/R of a chunk's elements: "
                 "%d..%d, or 0 for the default %d)", sc->ranged_side_room, MT_RANGED_SIDE_ROOM_MIN,
                 MT_RANGED_SIDE_ROOM_MAX, MT_RANGED_SIDE_ROOM_DEFAULT);
        return -1;
    }
    if (st->layout == MT_LAYOUT_COMPACT && (sc->clip_speculate == 1 || sc->clip_speculate == 2)) {
        snprintf(err, errlen, "clip speculation (--clip-speculate %s) needs the full host layout: it writes the streamed "
                 "weights before the norm is known and redoes them from the master after it, and in the compact layout "
                 "the streamed weights are the master's high half; use --clip-speculate auto or off (the update then "
                 "waits for the norm and overlaps the next step's forward), or --host-layout full",
                 sc->clip_speculate == 1 ? "unit" : "ranged");
        return -1;
    }
    if (st->layout == MT_LAYOUT_COMPACT && sc->adamw_defer > 0) {
        snprintf(err, errlen, "--adamw-defer on needs the full host layout: deferral keeps a second fp32 gradient and "
                 "runs with ranged clip speculation, neither of which the compact layout has; use --adamw-defer auto or "
                 "off, or --host-layout full");
        return -1;
    }
    if ((unsigned)sc->ranged_bounds > MT_RANGED_BOUNDS_EXACT) {
        snprintf(err, errlen, "invalid step configuration: ranged_bounds=%d (avx2 %d, avx512 %d, exact %d)",
                 (int)sc->ranged_bounds, MT_RANGED_BOUNDS_AVX2, MT_RANGED_BOUNDS_AVX512, MT_RANGED_BOUNDS_EXACT);
        return -1;
    }
    if (sc->offload_checkpoints < -1 || sc->offload_checkpoints > 1) {
        snprintf(err, errlen, "invalid step configuration: offload_checkpoints=%d (auto -1, off 0, on 1)",
                 sc->offload_checkpoints);
        return -1;
    }
    if (mt_config_check_seq_len(&st->cfg, sc->T, err, errlen)) return -1;
    /* A StarPU vector is at most 2^32 elements: 16 GiB of floats for a hidden state, 256 GiB of
     * 64-byte units for a byte buffer. */
    const size_t biggest[3] = {
        mt_codelet_layer_saved_bytes(&st->cfg, st->compute_dtype, gpu, sc->B, sc->T),
        mt_codelet_layer_scratch_bytes(&st->cfg, st->compute_dtype, gpu, sc->B, sc->T),
        (size_t)(sc->B * sc->T) * (size_t)st->cfg.hidden * sizeof(float),
    };
    const size_t limit[3] = { BYTE_BUFFER_MAX, BYTE_BUFFER_MAX, (size_t)UINT32_MAX * sizeof(float) };
    for (int i = 0; i < 3; i++)
        if (biggest[i] > limit[i]) {
            snprintf(err, errlen, "a micro-batch of %lld x %lld tokens needs a %zu-byte activation buffer, over the %s a "
                     "StarPU vector holds: use a smaller micro-batch (gradient accumulation keeps the step's tokens)",
                     (long long)sc->B, (long long)sc->T, biggest[i], i < 2 ? "256 GiB" : "16 GiB");
            return -1;
        }
    return 0;
}

/* What StarPU still allocates itself in its RAM node for the step must fit there (every other
 * buffer has a host home: alloc_homes): on CPU workers, the layer and head scratch (`per` bytes,
 * as registered) of each worker that runs them, which keeps them from then on. That node's
 * size is hwloc's reading of the machine's memory, or less with STARPU_LIMIT_CPU_MEM, and a
 * buffer that does not fit it waits for room for ever: refused here, before anything is
 * allocated. 0, or -1 with err set. */
static int check_ram_node(size_t per, bool gpu, char *err, size_t errlen)
{
    const starpu_ssize_t total = starpu_memory_get_total(STARPU_MAIN_RAM);
    const unsigned n = starpu_cpu_worker_get_count();
    if (gpu || total <= 0 || n == 0) return 0;
    const starpu_ssize_t avail = starpu_memory_get_available(STARPU_MAIN_RAM);
    if ((double)per * n <= (double)avail) return 0;
    char a[32], b[32], c[32], d[32];
    snprintf(err, errlen, "the step's scratch buffers need %s on each of the %u CPU workers (%s in all) in StarPU's RAM "
             "node, which holds %s with %s free (StarPU sizes it from hwloc's reading of this machine's memory, or from "
             "STARPU_LIMIT_CPU_MEM): use fewer CPU workers (--ncpu), a smaller micro-batch or sequence, or a larger "
             "STARPU_LIMIT_CPU_MEM", mt_format_bytes(per, a, sizeof a), n, mt_format_bytes((uint64_t)per * n, b, sizeof b),
             mt_format_bytes((uint64_t)total, c, sizeof c), mt_format_bytes(avail > 0 ? (uint64_t)avail : 0, d, sizeof d));
    return -1;
}

/* The model as the compute tasks see it, the table's chunks as boundaries (they tile the
 * table: a partition must). */
static void describe_model(mt_graph *g)
{
    const mt_host_state *st = g->st;
    const mt_tile *t = &st->tiles[0];
    int64_t *chunks = malloc(sizeof *chunks * (size_t)(t->nchunks + 1));
    for (int c = 0; c < t->nchunks; c++) {
        chunks[c] = t->chunks[c].offset;
        assert(c == 0 || chunks[c] == t->chunks[c - 1].offset + t->chunks[c - 1].numel);
    }
    chunks[t->nchunks] = t->chunks[t->nchunks - 1].offset + t->chunks[t->nchunks - 1].numel;
    g->model = (mt_codelet_model){ .cfg = st->cfg, .dtype = st->compute_dtype, .layout_embed = st->layout_embed,
                                   .layout_layer = st->layout_layer, .layout_head = st->layout_head,
                                   .layout_dense_layer = st->layout_dense_layer,
                                   .table_nchunks = t->nchunks, .table_chunks = chunks };
}

/* offload_checkpoints as the graph runs it: auto is on where a GPU computes and the memory plan
 * with every checkpoint on the GPU does not fit the device (the rule of train's and bench's plan,
 * mt_plan_choose_run, at this K). */
static bool resolve_offload(const mt_host_state *st, const mt_step_config *sc, bool gpu, int ndev)
{
    if (sc->offload_checkpoints >= 0) return sc->offload_checkpoints == 1;
    if (!gpu) return false;
    const mt_plan_params p = { .micro_batch = sc->B, .seq_len = sc->T, .grad_accum = sc->accum,
                               .checkpoint_interval = sc->K, .compute = st->compute_dtype, .use_gpu = true,
                               .head_chunk = sc->head_chunk, .layout = st->layout, .devices = ndev };
    return mt_plan_offload_needed(&st->cfg, &p, mt_gpu_memory_total());
}

/* Every activation buffer of the graph (checkpoints, ping-pong activations and gradients, the
 * saved activations of a block) has a host home, so that StarPU never allocates one in its RAM
 * node: that node's size is hwloc's reading of the machine's memory, which some machines (a
 * container whose sysfs shows one small NUMA node) give as a few GiB whatever the host has, and
 * a buffer evicted from the GPU or fetched for a CPU task that does not fit it waits there for
 * ever. A home the GPU copies to every step is pinned: the offloaded checkpoints and, where a GPU
 * computes, each micro-batch's dh0, which the table's CPU backward reads. The others are plain
 * memory that costs RAM only where a page of it is written: an eviction from the GPU, or a CPU
 * worker computing in it. */
static void *alloc_home(mt_graph *g, size_t bytes, bool pinned)
{
    void *p = NULL;
    if (pinned ? starpu_malloc_flags(&p, bytes, STARPU_MALLOC_PINNED) != 0
               : posix_memalign(&p, 4096, bytes) != 0)
        return NULL;
    g->homes[g->nhomes++] = (mt_home){ .p = p, .bytes = bytes, .pinned = pinned };
    return p;
}

static void free_homes(mt_graph *g)
{
    for (int i = 0; i < g->nhomes; i++) {
        if (g->homes[i].pinned) starpu_free_flags(g->homes[i].p, g->homes[i].bytes, STARPU_MALLOC_PINNED);
        else free(g->homes[i].p);
    }
    free(g->homes);
    g->homes = NULL;
    g->nhomes = 0;
}

/* A hidden state of `bytes` at its home, in floats. */
static starpu_data_handle_t homed_floats(void *home, size_t bytes)
{
    return host_vector(home, (int64_t)(bytes / sizeof(float)), sizeof(float));
}

/* A byte buffer at its home (its allocation rounded up to whole units: alloc_homes). */
static starpu_data_handle_t homed_bytes(void *home, size_t bytes) { return host_vector(home, byte_units(bytes), BYTE_UNIT); }

/* The homes, allocated before anything is registered so that a refusal leaves nothing behind, in
 * the order mt_graph_create registers them: the checkpoints (nblocks x accum, the first
 * nckpt_pinned pinned), then per micro-batch act[u][0..1] and grad[u][0..1], then the nsaved
 * saved buffers (K per device). 0, or -1 with err set. */
static int alloc_homes(mt_graph *g, const mt_step_config *sc, int nblocks, int nckpt_pinned, size_t hidden_bytes,
                       size_t saved_bytes, int nsaved, bool gpu, char *err, size_t errlen)
{
    const int n = nblocks * sc->accum + 4 * sc->accum + nsaved;
    g->homes = calloc(n, sizeof *g->homes);
    bool ok = g->homes != NULL, pin = false;
    size_t bytes = hidden_bytes;
    for (int b = 0; ok && b < nblocks * sc->accum; b++) ok = alloc_home(g, bytes, pin = b < nckpt_pinned) != NULL;
    for (int u = 0; ok && u < sc->accum; u++)
        for (int k = 0; ok && k < 4; k++) ok = alloc_home(g, bytes, pin = gpu && k == 2) != NULL; /* k 2: grad[u][0] */
    bytes = mt_plan_byte_buffer(saved_bytes);
    for (int j = 0; ok && j < nsaved; j++) ok = alloc_home(g, bytes, pin = false) != NULL;
    if (ok) return 0;
    const int got = g->nhomes;
    free_homes(g);
    snprintf(err, errlen, "cannot allocate %shost memory for the activation buffers: buffer %d of %d (%zu bytes) "
             "failed; free host memory, or use a smaller micro-batch or sequence%s", pin ? "pinned " : "", got + 1, n,
             bytes, nckpt_pinned ? " (or --offload-checkpoints off: the offloaded checkpoints are pinned)" : "");
    return -1;
}

/* The devices' copies of every tile's gradient, fp32 (graph.h: mt_step_first_copy). They are summed after
 * the tile's last backward, where the compute runs (compute.c, gradient_done), and dropped. Where
 * a GPU computes, a copy has no home: StarPU allocates it on the GPU that writes it and moves it
 * to device 0's for the sum, and no host memory holds it. On CPU workers (the research setting
 * that makes devices of them) it has a home of plain host memory, where the CPU workers write it:
 * StarPU's RAM node, which can be far smaller than the host (alloc_homes), need not hold it. */
static int alloc_device_grads(mt_graph *g, char *err, size_t errlen)
{
    const mt_host_state *st = g->st;
    /* device d: the d-th CUDA worker, or without them the d-th CPU worker */
    const enum starpu_worker_archtype arch = g->where == STARPU_CUDA ? STARPU_CUDA_WORKER : STARPU_CPU_WORKER;
    g->dev_worker = calloc((size_t)g->ndev, sizeof *g->dev_worker);
    if ((int)starpu_worker_get_ids_by_type(arch, g->dev_worker, (unsigned)g->ndev) < g->ndev) {
        snprintf(err, errlen, "%d devices asked for, and only %d %s workers", g->ndev, (int)starpu_worker_get_count_by_type(arch),
                 arch == STARPU_CUDA_WORKER ? "CUDA" : "CPU");
        return -1;
    }
    const int first = mt_step_first_copy(g);
    const int n = (g->ndev - first) * st->ntiles;
    const bool homed = g->where != STARPU_CUDA;
    g->dev_grad = calloc((size_t)n, sizeof *g->dev_grad);
    g->dev_grad_mem = calloc((size_t)n, sizeof *g->dev_grad_mem);
    for (int k = 0; k < n; k++) {
        const mt_tile *t = &st->tiles[k % st->ntiles];
        if (!homed) {
            starpu_vector_data_register(&g->dev_grad[k], -1, 0, (uint32_t)t->numel, sizeof(float));
            continue;
        }
        if (posix_memalign(&g->dev_grad_mem[k], 64, (size_t)t->numel * sizeof(float))) {
            g->dev_grad_mem[k] = NULL;
            snprintf(err, errlen, "out of host memory for device %d's gradient of tile %d (%lld floats)",
                     first + k / st->ntiles, k % st->ntiles, (long long)t->numel);
            return -1;
        }
        starpu_vector_data_register(&g->dev_grad[k], STARPU_MAIN_RAM, (uintptr_t)g->dev_grad_mem[k], (uint32_t)t->numel,
                                    sizeof(float));
    }
    return 0;
}

mt_graph *mt_graph_create(mt_host_state *st, const mt_step_config *sc_in, char *err, size_t errlen)
{
    const bool gpu = starpu_cuda_worker_get_count() > 0;
    /* Across ranks each tile's update waits for its gradient's sum (runtime/step/dist.c):
     * nothing to speculate on before it, and the sum is taken over the whole gradient. */
    mt_step_config dist_sc = *sc_in;
    const int ranks = mt_dist_size();
    /* several devices: each adds into its own copy of a gradient, summed before anything reads
     * it whole; as across ranks nothing is updated ahead of that */
    const int ncuda = (int)starpu_cuda_worker_get_count();
    const int ndev = sc_in->devices > 1 ? sc_in->devices : ncuda > 1 ? ncuda : 1;
    if (ranks > 1 || ndev > 1) {
        dist_sc.clip_speculate = 0;
        dist_sc.adamw_defer = 0;
    }
    const mt_step_config *sc = &dist_sc;
    if (check_config(st, sc, gpu, err, errlen)) return NULL;
    const int64_t head_chunk = sc->head_chunk < sc->B * sc->T ? sc->head_chunk : sc->B * sc->T;
    const size_t layer_scratch = mt_codelet_layer_scratch_bytes(&st->cfg, st->compute_dtype, gpu, sc->B, sc->T),
                 head_scratch = mt_codelet_head_scratch_bytes(&st->cfg, st->compute_dtype, gpu, head_chunk);
    if (check_ram_node(mt_plan_byte_buffer(layer_scratch) + mt_plan_byte_buffer(head_scratch), gpu, err, errlen))
        return NULL;
    if (ranks > 1 && st->layout == MT_LAYOUT_COMPACT) {
        snprintf(err, errlen, "a run over %d ranks needs the full host layout (--host-layout full): the gradients are "
                 "summed over the ranks in fp32, and the compact layout keeps them in bf16", ranks);
        return NULL;
    }
    mt_graph *g = calloc(1, sizeof *g);
    g->offload = resolve_offload(st, sc, gpu, ndev);
    const int nblocks = (int)((st->cfg.layers + sc->K - 1) / sc->K);
    const int npinned = g->offload ? (nblocks - 1) * sc->accum : 0;
    const size_t hidden_bytes = (size_t)(sc->B * sc->T * st->cfg.hidden) * sizeof(float);
    const size_t saved_bytes = mt_codelet_layer_saved_bytes(&st->cfg, st->compute_dtype, gpu, sc->B, sc->T);
    if (alloc_homes(g, sc, nblocks, npinned, hidden_bytes, saved_bytes, ndev * sc->K, gpu, err, errlen)) {
        free(g);
        return NULL;
    }
    if (mt_speculation_init(&g->speculation, st, sc, gpu, err, errlen)) {
        free_homes(g);
        free(g);
        return NULL;
    }
    g->st = st;
    g->where = gpu ? STARPU_CUDA : STARPU_CPU; /* every compute task runs there: buffers are sized for it */
    g->updates_submitted = calloc(st->ntiles, sizeof *g->updates_submitted);
    g->ready_notes = calloc((size_t)MT_STEP_READY_RING * st->ntiles, sizeof *g->ready_notes);
    g->sc = *sc;
    g->dist_rank = mt_dist_rank();
    g->dist_size = ranks;
    g->ndev = ndev;

    g->ntok = sc->B * sc->T;
    g->nblocks = (int)((st->cfg.layers + sc->K - 1) / sc->K);
    describe_model(g);
    g->aux_coef = mt_config_router_aux_coef(&st->cfg);
    g->aux_rows = g->ntok * mt_config_sparse_layers(&st->cfg);
    const int64_t nstats = 2 * st->cfg.experts;

    g->ckpt = calloc((size_t)g->nblocks * sc->accum, sizeof *g->ckpt);
    const mt_home *home = g->homes; /* in alloc_homes' order */
    for (int b = 0; b < g->nblocks * sc->accum; b++) {
        g->ckpt[b] = homed_floats((home++)->p, hidden_bytes);
        /* offloaded: written through to its home as the forward writes it, so that the GPU copy
         * is clean and StarPU reclaims it with no copy */
        if (b < npinned) starpu_data_set_wt_mask(g->ckpt[b], 1u << STARPU_MAIN_RAM);
    }
    g->act = calloc(sc->accum, sizeof *g->act);
    g->grad = calloc(sc->accum, sizeof *g->grad);
    for (int u = 0; u < sc->accum; u++) {
        for (int i = 0; i < 2; i++) g->act[u][i] = homed_floats((home++)->p, hidden_bytes);
        for (int i = 0; i < 2; i++) g->grad[u][i] = homed_floats((home++)->p, hidden_bytes);
    }
    g->saved = calloc((size_t)ndev * sc->K, sizeof *g->saved);
    for (int j = 0; j < ndev * sc->K; j++) g->saved[j] = homed_bytes((home++)->p, saved_bytes);
    assert(home == g->homes + g->nhomes);
    g->scratch_layer = new_bytes(layer_scratch);
    g->sc.head_chunk = head_chunk;
    g->scratch_head = new_bytes(head_scratch);

    g->partial_mem = calloc(st->ntiles, sizeof(double));
    g->partial = calloc(st->ntiles, sizeof *g->partial);
    for (int i = 0; i < st->ntiles; i++) g->partial[i] = host_vector(&g->partial_mem[i], 1, sizeof(double));
    const int nc0 = mt_state_embed(st)->nchunks;
    g->embed_partial_mem = calloc(nc0, sizeof(double));
    g->embed_partial = calloc(nc0, sizeof *g->embed_partial);
    for (int c = 0; c < nc0; c++) g->embed_partial[c] = host_vector(&g->embed_partial_mem[c], 1, sizeof(double));
    mt_speculation_register(&g->speculation, st);
    g->embed_rows = calloc(nc0, sizeof *g->embed_rows);
    g->embed_rows_mem = calloc(nc0, sizeof *g->embed_rows_mem);
    for (int c = 0; c < nc0; c++) {
        const mt_chunk *ch = &mt_state_embed(st)->chunks[c];
        const int64_t nrows = mt_cpu_chunk_rows(ch->offset, ch->numel, st->cfg.hidden);
        g->embed_rows_mem[c] = calloc(nrows, sizeof(double));
        g->embed_rows[c] = host_vector(g->embed_rows_mem[c], nrows, sizeof(double));
    }
    g->clip = host_vector(g->clip_mem, 2, sizeof(double));

    for (int s = 0; s < MT_STEP_SLOTS; s++) {
        mt_step_slot *sl = &g->slots[s];
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
        if (g->aux_coef > 0) {
            sl->router_stats = calloc((size_t)(sc->accum * nstats), sizeof(double));
            sl->h_router_stats = calloc(sc->accum, sizeof(starpu_data_handle_t));
            for (int u = 0; u < sc->accum; u++)
                sl->h_router_stats[u] = host_vector(sl->router_stats + u * nstats, nstats, sizeof(double));
        }
        sl->h_clip_copy = host_vector(sl->clip_result, 2, sizeof(double));
    }
    g->eval_tokens = calloc(g->ntok, sizeof(int32_t));
    g->eval_targets = calloc(g->ntok, sizeof(int32_t));
    g->h_eval_tokens = host_vector(g->eval_tokens, g->ntok, sizeof(int32_t));
    g->h_eval_targets = host_vector(g->eval_targets, g->ntok, sizeof(int32_t));
    g->h_eval_loss = host_vector(g->eval_loss, 2, sizeof(double));
    g->update = (mt_update_ctx){ .st = st, .sc = &g->sc, .clip = g->clip, .stats = &g->stats, .observer = &g->observer };
    mt_policy_attach(MT_SCHED_CTX_INITIAL, st);
    if (ndev > 1 && alloc_device_grads(g, err, errlen)) {
        mt_graph_destroy(g);
        return NULL;
    }
    return g;
}

uint64_t mt_graph_working_bytes(const mt_graph *g)
{
    uint64_t n = starpu_data_get_size(g->scratch_layer) + starpu_data_get_size(g->scratch_head);
    /* where a GPU computes, device 0's: its micro-batches' (u mod ndev == 0) and, offloaded, their
     * checkpoints in flight there; all of one size */
    const bool gpu = g->where == STARPU_CUDA;
    const int step = gpu ? g->ndev : 1;
    const int mb = (int)mt_plan_device_micro_batches(&(mt_plan_params){ .grad_accum = g->sc.accum, .devices = step });
    const int all = g->nblocks * mb;
    const int there = g->offload && gpu ? (int)mt_plan_offload_in_flight(g->nblocks, mb) : all;
    for (int b = 0; b < there; b++) n += starpu_data_get_size(g->ckpt[b]);
    for (int u = 0; u < g->sc.accum; u += step)
        for (int i = 0; i < 2; i++) n += starpu_data_get_size(g->act[u][i]) + starpu_data_get_size(g->grad[u][i]);
    for (int j = 0; j < g->sc.K; j++) n += starpu_data_get_size(g->saved[j]);
    return n;
}

void mt_graph_destroy(mt_graph *g)
{
    if (!g) return;
    mt_graph_flush(g);
    starpu_task_wait_for_all();
    mt_policy_detach(MT_SCHED_CTX_INITIAL);
    /* an activation's value is not wanted past the graph: no copy home */
    for (int b = 0; b < g->nblocks * g->sc.accum; b++) starpu_data_unregister_no_coherency(g->ckpt[b]);
    for (int u = 0; u < g->sc.accum; u++)
        for (int i = 0; i < 2; i++) {
            starpu_data_unregister_no_coherency(g->act[u][i]);
            starpu_data_unregister_no_coherency(g->grad[u][i]);
        }
    free(g->act);
    free(g->grad);
    for (int j = 0; j < g->ndev * g->sc.K; j++) starpu_data_unregister_no_coherency(g->saved[j]);
    starpu_data_unregister(g->scratch_layer);
    starpu_data_unregister(g->scratch_head);
    for (int i = 0; i < g->st->ntiles; i++) starpu_data_unregister(g->partial[i]);
    mt_step_dist_free(g);
    for (int k = 0; g->dev_grad && k < (g->ndev - mt_step_first_copy(g)) * g->st->ntiles; k++) {
        if (g->dev_grad[k]) starpu_data_unregister_no_coherency(g->dev_grad[k]); /* no value past the step */
        free(g->dev_grad_mem[k]);
    }
    free(g->dev_grad);
    free(g->dev_grad_mem);
    free(g->dev_worker);
    mt_speculation_destroy(&g->speculation, g->st);
    for (int c = 0; c < mt_state_embed(g->st)->nchunks; c++) {
        starpu_data_unregister(g->embed_partial[c]);
        starpu_data_unregister(g->embed_rows[c]);
        free(g->embed_rows_mem[c]);
    }
    starpu_data_unregister(g->clip);
    for (int s = 0; s < MT_STEP_SLOTS; s++) {
        mt_step_slot *sl = &g->slots[s];
        for (int u = 0; u < g->sc.accum; u++) {
            starpu_data_unregister(sl->h_tokens[u]);
            starpu_data_unregister(sl->h_targets[u]);
            starpu_data_unregister(sl->h_loss[u]);
            if (sl->h_router_stats) starpu_data_unregister(sl->h_router_stats[u]);
        }
        free(sl->router_stats);
        free(sl->h_router_stats);
        starpu_data_unregister(sl->h_clip_copy);
        free(sl->tokens); free(sl->targets); free(sl->loss);
        free(sl->h_tokens); free(sl->h_targets); free(sl->h_loss);
    }
    starpu_data_unregister(g->h_eval_tokens);
    starpu_data_unregister(g->h_eval_targets);
    starpu_data_unregister(g->h_eval_loss);
    free(g->eval_tokens); free(g->eval_targets);
    free_homes(g);
    free(g->ckpt); free(g->saved); free(g->partial); free(g->partial_mem);
    free(g->embed_partial); free(g->embed_partial_mem);
    free(g->embed_rows); free(g->embed_rows_mem);
    free(g->updates_submitted);
    free(g->ready_notes);
    free((void *)g->model.table_chunks);
    free(g);
}

void mt_graph_set_observer(mt_graph *g, mt_observer_fn fn, void *user)
{
    g->observer.fn = fn;
    g->observer.user = user;
}

bool mt_graph_offloads_checkpoints(const mt_graph *g) { return g->offload; }

void mt_graph_set_adamw_split(mt_graph *g, int split) { g->sc.adamw_split = split; }

void mt_graph_set_clip_speculate(mt_graph *g, int speculate)
{
    /* the user's choice was checked against the layout when the graph was made */
    STARPU_ASSERT_MSG(g->st->layout != MT_LAYOUT_COMPACT || speculate <= 0,
                      "clip speculation %d asked of a compact host state (it needs the full layout)", speculate);
    if (g->st->layout == MT_LAYOUT_COMPACT) speculate = 0;
    g->sc.clip_speculate = speculate;
    g->speculation.option = speculate;
}

void mt_graph_speculation_counts(const mt_graph *g, int64_t *speculated, int64_t *held)
{
    *speculated = g->speculation.speculated;
    *held = g->speculation.held;
}

const struct mt_adamw_stats *mt_graph_adamw_stats(const mt_graph *g) { return &g->stats; }

int mt_graph_keep_norms(mt_graph *g, int64_t max_norms)
{
    return mt_speculation_keep_norms(&g->speculation, g->st, max_norms);
}

const double *mt_graph_kept_norms(const mt_graph *g, int64_t *count, int *width)
{
    return mt_speculation_kept_norms(&g->speculation, g->st, count, width);
}

void mt_graph_flush(mt_graph *g) { mt_speculation_flush(&g->speculation, &g->update); }

bool mt_graph_defers(const mt_graph *g) { return g->speculation.defer; }

void mt_graph_log_defer(const mt_graph *g, FILE *log, const char *prefix)
{
    mt_speculation_log_defer(&g->speculation, g->st, log, prefix);
}

void mt_graph_log_devices(const mt_graph *g, FILE *log, const char *prefix)
{
    const int M = g->sc.accum, N = g->ndev;
    if (!log || N < 2) return;
    fprintf(log, "%s: %d devices: micro-batch u on device u mod %d, the gradients summed on the devices into device "
                 "0's\n", prefix, N, N);
    if (M < N)
        fprintf(log, "%s: warning: %d micro-batch%s a step for %d devices: %d of them compute nothing (--accum %d, or a "
                     "multiple of it, uses them all)\n", prefix, M, M == 1 ? "" : "es", N, N - M, N);
    else if (M % N)
        fprintf(log, "%s: warning: %d micro-batches a step over %d devices: %d of them compute one more than the others "
                     "(--accum a multiple of %d balances them)\n", prefix, M, N, M % N, N);
}

starpu_data_handle_t mt_graph_clip_handle(mt_graph *g) { return g->clip; }
