/* Host state tiles: allocation (2 MiB-aligned, one block per kind per tile, pinned with a GPU), StarPU
 * registration (whole-tile handles for compute, planned chunk partitions for AdamW),
 * initialisation. */
#include "runtime/state.h"

#include <math.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <pthread.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cpu/adamw.h"
#include "backends/cpu/master_planes.h"
#include "backends/cpu/ops.h"

#define TILE_ALIGN_BYTES 4096

static size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

/* Host state allocations: pageable memory, 2 MiB-aligned and advised to transparent huge pages
 * (where the kernel offers them), then zeroed and, with a GPU, pinned by starpu_memory_pin
 * (cudaHostRegister) tile by tile on one thread per core (zero_and_pin, for_each_tile). Not
 * starpu_malloc_flags(STARPU_MALLOC_PINNED): that is cudaHostAlloc, which zeroes and pins 4 KiB
 * pages one allocation at a time on one thread, where this spreads the zeroing and pinning of
 * tens of GB over every core. Sizes round up to 4 KiB. */
#define STATE_ALIGN_BYTES ((size_t)2 << 20)

static bool gpu_present(void) { return starpu_cuda_worker_get_count() > 0; }

static void *alloc_state(size_t bytes)
{
    void *p = NULL;
    bytes = round_up(bytes, TILE_ALIGN_BYTES);
    if (posix_memalign(&p, STATE_ALIGN_BYTES, bytes) != 0) return NULL;
#ifdef MADV_HUGEPAGE
    (void)madvise(p, bytes, MADV_HUGEPAGE); /* advice: without THP the pages stay small */
#endif
    return p;
}

/* mt_tile.pinned_kinds */
enum { PIN_WEIGHTS = 1, PIN_MASTER = 2, PIN_GRAD = 4, PIN_M = 8, PIN_V = 16, PIN_GRAD_ALT = 32, PIN_GRAD_ACC = 64 };

/* Frees an allocation of tile t's kind `kind` (a PIN_* bit), unpinning it if it was pinned. */
static void free_state(mt_tile *t, unsigned kind, void *p, size_t bytes)
{
    if (!p) return;
    if (t->pinned_kinds & kind) (void)starpu_memory_unpin(p, round_up(bytes, TILE_ALIGN_BYTES));
    t->pinned_kinds &= ~kind;
    free(p);
}

/* Runs fn(st, tile index, arg) for every tile on one thread per core: filling tens of GB of
 * state one core at a time takes minutes. Tiles are independent, so results do not depend on
 * the thread count. StarPU's workers are paused meanwhile (starpu_pause: they block instead of
 * polling for tasks in a tight loop on the cores these threads need; on the 2-core development
 * machine the polling took 39% of the CPU time of bench's set-up). fn must not wait for tasks. */
typedef void (*tile_fn)(mt_host_state *st, int tile, void *arg);
typedef struct tile_job { mt_host_state *st; tile_fn fn; void *arg; int next; pthread_mutex_t lock; } tile_job;

static void *tile_worker(void *p)
{
    tile_job *j = p;
    for (;;) {
        pthread_mutex_lock(&j->lock);
        int i = j->next++;
        pthread_mutex_unlock(&j->lock);
        if (i >= j->st->ntiles) return NULL;
        j->fn(j->st, i, j->arg);
    }
}

static void for_each_tile(mt_host_state *st, tile_fn fn, void *arg)
{
    starpu_pause();
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    if (n < 1) n = 1;
    if (n > 64) n = 64;
    if (n > st->ntiles) n = st->ntiles;
    tile_job j = { .st = st, .fn = fn, .arg = arg };
    pthread_mutex_init(&j.lock, NULL);
    pthread_t th[64];
    for (long t = 1; t < n; t++) pthread_create(&th[t], NULL, tile_worker, &j);
    tile_worker(&j);
    for (long t = 1; t < n; t++) pthread_join(th[t], NULL);
    pthread_mutex_destroy(&j.lock);
    starpu_resume();
}

/* Zeroes tile t's allocation of kind `kind` (a PIN_* bit), which also faults its pages in on the
 * calling thread, and pins it when a GPU will copy from it, setting the bit; 1 when the pin
 * failed (the memory is then used unpinned), else 0. */
static int zero_and_pin(mt_tile *t, unsigned kind, void *p, size_t bytes)
{
    if (!p) return 0; /* a kind a sharded state does not hold */
    bytes = round_up(bytes, TILE_ALIGN_BYTES);
    memset(p, 0, bytes);
    if (!gpu_present()) return 0;
    if (starpu_memory_pin(p, bytes) != 0) return 1;
    t->pinned_kinds |= kind;
    return 0;
}

/* Zeroes and pins every kind of state of one tile; *arg (an atomic_int) counts the failed pins.
 * Compact pins only what a GPU copies: the weights (to it) and the gradient (from it); the low
 * half of the master, m and v are for the CPU workers alone. */
static void zero_tile(mt_host_state *st, int i, void *arg)
{
    atomic_int *unpinned = arg;
    mt_tile *t = &st->tiles[i];
    size_t fbytes = (size_t)t->numel * sizeof(float);
    int bad = zero_and_pin(t, PIN_WEIGHTS, t->weights, t->weight_bytes);
    if (st->layout == MT_LAYOUT_COMPACT) {
        const size_t half = (size_t)t->numel * sizeof(uint16_t);
        bad += zero_and_pin(t, PIN_GRAD, t->grad_bf16, half);
        if (t->grad_acc) bad += zero_and_pin(t, PIN_GRAD_ACC, t->grad_acc, fbytes);
        memset(t->master_lo, 0, round_up(half, TILE_ALIGN_BYTES));
        memset(t->adam_m, 0, round_up(fbytes, TILE_ALIGN_BYTES));
        memset(t->adam_v, 0, round_up(fbytes, TILE_ALIGN_BYTES));
        atomic_fetch_add(unpinned, bad);
        return;
    }
    bad += zero_and_pin(t, PIN_MASTER, t->master, fbytes);
    bad += zero_and_pin(t, PIN_GRAD, t->grad, fbytes);
    bad += zero_and_pin(t, PIN_M, t->adam_m, fbytes);
    bad += zero_and_pin(t, PIN_V, t->adam_v, fbytes);
    atomic_fetch_add(unpinned, bad);
}

/* After zero_and_pin over the tiles: a pin that failed leaves that memory pageable (the copies from it
 * then go through CUDA's staging buffers, slower but correct); said once, on stderr. */
static void note_unpinned(mt_host_state *st, int unpinned, const char *what)
{
    if (!unpinned) return;
    st->pinned = false;
    fprintf(stderr, "megatrain: warning: %d %s allocation(s) could not be pinned (cudaHostRegister failed); "
                    "host-GPU copies from them will be slower\n", unpinned, what);
}

/* mt_state_build_chunks (runtime/state.h). */
int mt_state_build_chunks(const mt_tile_layout *lay, int64_t chunk_numel, mt_chunk **out)
{
    int cap = 16, n = 0;
    mt_chunk *c = malloc(sizeof *c * cap);
    int64_t step = chunk_numel / MT_TILE_ALIGN * MT_TILE_ALIGN;
    if (step < MT_TILE_ALIGN) step = MT_TILE_ALIGN;
    for (int t = 0; t < lay->ntensors; t++) {
        const mt_tensor_desc *d = &lay->tensors[t];
        if (d->numel == 0) continue;
        int64_t end = lay->numel;
        for (int u = t + 1; u < lay->ntensors; u++)
            if (lay->tensors[u].numel > 0) { end = lay->tensors[u].offset; break; }
        for (int64_t o = d->offset; o < end; o += step) {
            if (n == cap) c = realloc(c, sizeof *c * (cap *= 2));
            int64_t len = end - o < step ? end - o : step;
            /* Avoid a sliver of pure padding as its own chunk. */
            if (end - (o + len) > 0 && end - (o + len) < MT_TILE_ALIGN) len = end - o;
            c[n++] = (mt_chunk){ .offset = o, .numel = len, .decay = d->decay };
            if (o + len >= end) break;
        }
    }
    *out = c;
    return n;
}

/* One handle per AdamW chunk over each of three state arrays (master or its low half, m, v) of
 * elements of esz[k] bytes: the handle arrays are allocated into *chunks[k]. */
static void register_state_chunks(const mt_tile *t, void *const state[3], const size_t esz[3],
                                  starpu_data_handle_t **chunks[3])
{
    for (int k = 0; k < 3; k++) {
        *chunks[k] = calloc(t->nchunks, sizeof(starpu_data_handle_t));
        for (int c = 0; c < t->nchunks; c++)
            starpu_vector_data_register(&(*chunks[k])[c], STARPU_MAIN_RAM,
                                        (uintptr_t)((char *)state[k] + (size_t)t->chunks[c].offset * esz[k]),
                                        (uint32_t)t->chunks[c].numel, esz[k]);
    }
}

/* Undoes register_state_chunks (nothing for arrays never registered). */
static void unregister_state_chunks(const mt_tile *t, starpu_data_handle_t **chunks[3])
{
    for (int k = 0; k < 3; k++) {
        for (int c = 0; *chunks[k] && c < t->nchunks; c++) starpu_data_unregister((*chunks[k])[c]);
        free(*chunks[k]);
        *chunks[k] = NULL;
    }
}

/* Where a chunk's child lies in its tile's vector: byte offset, elements and their size. */
typedef struct chunk_place {
    size_t at;
    uint32_t nx;
    size_t elemsize;
} chunk_place;

/* A vector filter over a list of places. StarPU's list filters give every child the parent's
 * element size; a streamed copy with an fp32 side has children of two sizes (its norms' chunks
 * are fp32 in the side, the others bf16), which this one can place. */
static void filter_places(void *parent_interface, void *child_interface, struct starpu_data_filter *f, unsigned id,
                          unsigned nchildren)
{
    (void)nchildren;
    const struct starpu_vector_interface *parent = parent_interface;
    struct starpu_vector_interface *child = child_interface;
    const chunk_place *pl = &((const chunk_place *)f->filter_arg_ptr)[id];
    child->id = parent->id;
    child->nx = pl->nx;
    child->elemsize = pl->elemsize;
    child->allocsize = (size_t)pl->nx * pl->elemsize;
    if (parent->dev_handle) {
        if (parent->ptr) child->ptr = parent->ptr + pl->at;
        child->dev_handle = parent->dev_handle;
        child->offset = parent->offset + pl->at;
    }
}

/* The planned partition of a whole-tile handle of esz-byte elements into the tile's AdamW chunks;
 * with `side`, the chunks of a tensor that has an fp32 copy in the streamed copy's side
 * (mt_layout_keep_norms_f32) are that copy. */
static starpu_data_handle_t *plan_chunks_of(const mt_tile *t, starpu_data_handle_t whole, size_t esz, bool side)
{
    chunk_place *pl = malloc(sizeof *pl * t->nchunks);
    const mt_tile_layout *lay = t->layout;
    for (int c = 0; c < t->nchunks; c++)
        pl[c] = (chunk_place){ (size_t)t->chunks[c].offset * esz, (uint32_t)t->chunks[c].numel, esz };
    /* then the few tensors with an fp32 copy: their chunks move into the side */
    for (int k = 0; side && k < lay->ntensors; k++) {
        const mt_tensor_desc *d = &lay->tensors[k];
        for (int c = 0; d->f32_at && c < t->nchunks; c++) {
            const mt_chunk *ch = &t->chunks[c];
            if (ch->offset < d->offset || ch->offset >= d->offset + d->numel) continue;
            pl[c].at = (size_t)(d->f32_at + ch->offset - d->offset) * sizeof(float);
            pl[c].elemsize = sizeof(float);
        }
    }
    struct starpu_data_filter f = {
        .filter_func = filter_places,
        .nchildren = (unsigned)t->nchunks,
        .filter_arg_ptr = pl,
    };
    starpu_data_handle_t *chunks = calloc(t->nchunks, sizeof(starpu_data_handle_t));
    starpu_data_partition_plan(whole, &f, chunks);
    free(pl);
    return chunks;
}

static starpu_data_handle_t *plan_chunks(const mt_tile *t, starpu_data_handle_t whole)
{
    return plan_chunks_of(t, whole, starpu_vector_get_elemsize(whole), false);
}

/* A gradient buffer (the tile's or its second one) of esz-byte elements: the whole handle,
 * written through to host memory, and its chunk partition. */
static void register_grad(mt_tile *t, void *grad, size_t esz, starpu_data_handle_t *whole, starpu_data_handle_t **chunks)
{
    starpu_vector_data_register_allocsize(whole, STARPU_MAIN_RAM, (uintptr_t)grad, (uint32_t)t->numel, esz,
                                          t->grad_allocsize);
    /* Gradients go home as soon as the task that wrote them ends. */
    starpu_data_set_wt_mask(*whole, 1u << STARPU_MAIN_RAM);
    *chunks = plan_chunks(t, *whole);
}

static void unregister_grad(mt_tile *t, starpu_data_handle_t whole, starpu_data_handle_t *chunks)
{
    starpu_data_partition_clean(whole, t->nchunks, chunks);
    starpu_data_unregister(whole);
    free(chunks);
}

static int register_tile(mt_host_state *st, mt_tile *t, size_t weight_allocsize, size_t grad_allocsize)
{
    size_t esz = mt_dtype_size(st->compute_dtype);
    /* the whole streamed copy, its fp32 side included: what a compute task reads */
    starpu_vector_data_register_allocsize(&t->h_weights, STARPU_MAIN_RAM, (uintptr_t)t->weights,
                                          (uint32_t)(mt_layout_stream_bytes(t->layout, esz) / esz), esz,
                                          weight_allocsize);
    t->nchunks = mt_state_build_chunks(t->layout, st->chunk_numel, &t->chunks);
    t->h_weights_chunk = plan_chunks_of(t, t->h_weights, esz, t->layout->f32_numel > 0);
    if (st->layout == MT_LAYOUT_COMPACT) {
        /* the bf16 gradient shares the weights' allocation size. Its fp32 accumulator: the
         * table's has a host home (alloc_tile), the others none (every layer's is the same size,
         * so StarPU recycles their buffers where the compute runs) */
        t->grad_allocsize = weight_allocsize;
        register_grad(t, t->grad_bf16, sizeof(mt_bf16), &t->h_grad, &t->h_grad_chunk);
        if (t->grad_acc)
            starpu_vector_data_register(&t->h_grad_acc, STARPU_MAIN_RAM, (uintptr_t)t->grad_acc, (uint32_t)t->numel,
                                        sizeof(float));
        else
            starpu_vector_data_register(&t->h_grad_acc, -1, 0, (uint32_t)t->numel, sizeof(float));
        register_state_chunks(t, (void *const[3]){ t->master_lo, t->adam_m, t->adam_v },
                              (const size_t[3]){ sizeof(uint16_t), sizeof(float), sizeof(float) },
                              (starpu_data_handle_t **[3]){ &t->h_master_lo_chunk, &t->h_m_chunk, &t->h_v_chunk });
        return 0;
    }
    t->grad_allocsize = grad_allocsize;
    register_grad(t, t->grad, sizeof(float), &t->h_grad, &t->h_grad_chunk);
    if (!t->master) return 0; /* sharded: no master or moments here */
    register_state_chunks(t, (void *const[3]){ t->master, t->adam_m, t->adam_v },
                          (const size_t[3]){ sizeof(float), sizeof(float), sizeof(float) },
                          (starpu_data_handle_t **[3]){ &t->h_master_chunk, &t->h_m_chunk, &t->h_v_chunk });
    return 0;
}

mt_host_state *mt_state_create(const mt_model_config *cfg, mt_dtype compute_dtype,
                               int64_t chunk_numel, char *err, size_t errlen)
{
    const mt_state_args a = { .cfg = cfg, .compute_dtype = compute_dtype, .chunk_numel = chunk_numel,
                              .layout = MT_LAYOUT_FULL };
    return mt_state_create_with(&a, err, errlen);
}

/* Allocates tile t's kinds of state in st's layout; false when one could not be had. */
static bool alloc_tile(const mt_host_state *st, mt_tile *t)
{
    const size_t fbytes = (size_t)t->numel * sizeof(float), half = (size_t)t->numel * sizeof(uint16_t);
    t->weights = alloc_state(t->weight_bytes);
    if (!mt_state_holds(st, t->index)) { /* sharded: another rank's master and moments */
        t->grad = alloc_state(fbytes);
        return t->weights && t->grad;
    }
    t->adam_m = alloc_state(fbytes);
    t->adam_v = alloc_state(fbytes);
    if (st->layout == MT_LAYOUT_COMPACT) {
        t->master_lo = alloc_state(half);
        t->grad_bf16 = alloc_state(half);
        /* The table's fp32 accumulator is written on the host by the CPU embedding backward, and it
         * is the size of the table (5 GB at a 72B shape's): a home of its own, so that StarPU's RAM
         * node, which can be far smaller than the host's memory (runtime/step/graph.c,
         * alloc_homes), need not hold it. Pinned with the rest when a GPU copies it. */
        if (t->index == 0) t->grad_acc = alloc_state(fbytes);
        return t->weights && t->adam_m && t->adam_v && t->master_lo && t->grad_bf16 && (t->index != 0 || t->grad_acc);
    }
    t->master = alloc_state(fbytes);
    t->grad = alloc_state(fbytes);
    return t->weights && t->adam_m && t->adam_v && t->master && t->grad;
}

mt_host_state *mt_state_create_with(const mt_state_args *args, char *err, size_t errlen)
{
    const mt_model_config *cfg = args->cfg;
    const mt_dtype compute_dtype = args->compute_dtype;
    if (args->layout != MT_LAYOUT_FULL && args->layout != MT_LAYOUT_COMPACT) {
        snprintf(err, errlen, "host layout %d is not full or compact (auto is the plan's to resolve: mt_plan_choose)",
                 (int)args->layout);
        return NULL;
    }
    if (args->layout == MT_LAYOUT_COMPACT && compute_dtype != MT_DTYPE_BF16) {
        snprintf(err, errlen, "the compact host layout holds bf16 streamed weights only (the master's high half is the "
                              "bf16 weight); with %s weights use the full layout", mt_dtype_name(compute_dtype));
        return NULL;
    }
    const bool sharded = args->shard_ranks > 1;
    if (sharded && (args->layout != MT_LAYOUT_FULL || args->shard_rank < 0 || args->shard_rank >= args->shard_ranks)) {
        snprintf(err, errlen, "a state sharded over %d ranks is in the full layout, with a rank from 0 to %d (got %d)",
                 args->shard_ranks, args->shard_ranks - 1, args->shard_rank);
        return NULL;
    }
    mt_host_state *st = calloc(1, sizeof *st);
    st->cfg = *cfg;
    st->compute_dtype = compute_dtype;
    st->layout = args->layout;
    st->shard_ranks = sharded ? args->shard_ranks : 1;
    st->shard_rank = sharded ? args->shard_rank : 0;
    st->chunk_numel = args->chunk_numel > 0 ? args->chunk_numel : MT_STATE_CHUNK_NUMEL_DEFAULT;
    st->pinned = gpu_present();
    mt_layout_build(cfg, MT_TILE_EMBED, &st->layout_embed);
    mt_layout_build(cfg, MT_TILE_LAYER, &st->layout_layer);
    mt_layout_build(cfg, MT_TILE_HEAD, &st->layout_head);
    const bool mixed = mt_layout_build_dense_layer(cfg, &st->layout_dense_layer);
    /* bf16 weights: the norms stream in fp32 (in the compact layout that copy is their master) */
    if (compute_dtype == MT_DTYPE_BF16) {
        mt_layout_keep_norms_f32(&st->layout_layer);
        mt_layout_keep_norms_f32(&st->layout_head);
        if (mixed) mt_layout_keep_norms_f32(&st->layout_dense_layer);
    }
    st->ntiles = (int)cfg->layers + 2;
    st->tiles = calloc(st->ntiles, sizeof *st->tiles);

    size_t esz = mt_dtype_size(compute_dtype);
    for (int i = 0; i < st->ntiles; i++) {
        mt_tile *t = &st->tiles[i];
        t->index = i;
        t->layout = i == 0 ? &st->layout_embed : i == st->ntiles - 1 ? &st->layout_head
                    : mixed && !mt_config_layer_is_sparse(cfg, i - 1) ? &st->layout_dense_layer : &st->layout_layer;
        t->numel = t->layout->numel;
        t->weight_bytes = round_up(mt_layout_stream_bytes(t->layout, esz), TILE_ALIGN_BYTES);
        size_t fbytes = (size_t)t->numel * sizeof(float);
        if (!alloc_tile(st, t)) {
            snprintf(err, errlen, "out of host memory allocating tile %d (%zu bytes per kind)", i, fbytes);
            st->ntiles = i + 1;
            mt_state_destroy(st);
            return NULL;
        }
    }
    atomic_int unpinned = 0;
    for_each_tile(st, zero_tile, &unpinned);
    note_unpinned(st, atomic_load(&unpinned), "host state");
    /* Every decoder layer's streamed copy shares one allocation size, that of the largest layer
     * tile when dense and sparse layers differ, so a GPU buffer freed by one layer is reused as
     * is by the next (StarPU recycles same-size buffers). */
    size_t layer_stream = mt_layout_stream_bytes(&st->layout_layer, esz);
    if (mixed && mt_layout_stream_bytes(&st->layout_dense_layer, esz) > layer_stream)
        layer_stream = mt_layout_stream_bytes(&st->layout_dense_layer, esz);
    const size_t layer_allocsize = round_up(layer_stream, TILE_ALIGN_BYTES);
    const size_t layer_grad_allocsize =
        round_up((size_t)mt_layout_largest_layer_numel(cfg) * esz, TILE_ALIGN_BYTES) / esz * sizeof(float);
    for (int i = 0; i < st->ntiles; i++) {
        mt_tile *t = &st->tiles[i];
        const bool outer = i == 0 || i == st->ntiles - 1;
        const size_t grad_allocsize = outer ? round_up((size_t)t->numel * esz, TILE_ALIGN_BYTES) / esz * sizeof(float)
                                            : layer_grad_allocsize;
        register_tile(st, t, outer ? t->weight_bytes : layer_allocsize, grad_allocsize);
    }
    return st;
}

#define SWAP(a, b) do { __typeof__(a) tmp_ = (a); (a) = (b); (b) = tmp_; } while (0)

static void drop_grad_alt(mt_tile *t)
{
    if (!t->grad_alt) return;
    if (t->h_grad_alt) unregister_grad(t, t->h_grad_alt, t->h_grad_alt_chunk);
    free_state(t, PIN_GRAD_ALT, t->grad_alt, (size_t)t->numel * sizeof(float));
    t->grad_alt = NULL;
    t->h_grad_alt = NULL;
    t->h_grad_alt_chunk = NULL;
}

uint64_t mt_state_grad_alt_bytes(const mt_host_state *st, int first)
{
    uint64_t b = 0;
    for (int i = first; i < st->ntiles; i++) b += round_up((size_t)st->tiles[i].numel * sizeof(float), TILE_ALIGN_BYTES);
    return b;
}

typedef struct fresh_tiles { const bool *fresh; atomic_int unpinned; } fresh_tiles;

static void zero_grad_alt(mt_host_state *st, int i, void *arg)
{
    fresh_tiles *f = arg;
    mt_tile *t = &st->tiles[i];
    if (f->fresh[i]) atomic_fetch_add(&f->unpinned, zero_and_pin(t, PIN_GRAD_ALT, t->grad_alt, (size_t)t->numel * sizeof(float)));
}

int mt_state_enable_grad_alt(mt_host_state *st, int first, char *err, size_t errlen)
{
    if (st->layout == MT_LAYOUT_COMPACT) {
        snprintf(err, errlen, "the compact host layout has no second gradient (deferral needs the full layout)");
        return -1;
    }
    bool *fresh = calloc(st->ntiles, sizeof *fresh);
    for (int i = first; i < st->ntiles; i++) {
        mt_tile *t = &st->tiles[i];
        if (t->grad_alt) continue;
        t->grad_alt = alloc_state((size_t)t->numel * sizeof(float));
        if (!t->grad_alt) {
            snprintf(err, errlen, "out of host memory allocating the second gradient of tile %d (%zu bytes)", i,
                     (size_t)t->numel * sizeof(float));
            for (int j = first; j < i; j++)
                if (fresh[j]) drop_grad_alt(&st->tiles[j]);
            free(fresh);
            return -1;
        }
        fresh[i] = true;
    }
    /* zeroed and pinned before StarPU knows the memory */
    fresh_tiles f = { .fresh = fresh };
    for_each_tile(st, zero_grad_alt, &f);
    note_unpinned(st, atomic_load(&f.unpinned), "second gradient");
    for (int i = first; i < st->ntiles; i++)
        if (fresh[i])
            register_grad(&st->tiles[i], st->tiles[i].grad_alt, sizeof(float), &st->tiles[i].h_grad_alt,
                          &st->tiles[i].h_grad_alt_chunk);
    free(fresh);
    return 0;
}

void mt_tile_swap_grad(mt_tile *t)
{
    SWAP(t->grad, t->grad_alt);
    SWAP(t->h_grad, t->h_grad_alt);
    SWAP(t->h_grad_chunk, t->h_grad_alt_chunk);
    t->grad_alt_current = !t->grad_alt_current;
}

void mt_state_destroy(mt_host_state *st)
{
    if (!st) return;
    for (int i = 0; i < st->ntiles; i++) {
        mt_tile *t = &st->tiles[i];
        if (t->grad_alt_current) mt_tile_swap_grad(t);
        drop_grad_alt(t);
        unregister_state_chunks(t, (starpu_data_handle_t **[3]){ &t->h_master_chunk, &t->h_m_chunk, &t->h_v_chunk });
        for (int c = 0; t->h_master_lo_chunk && c < t->nchunks; c++) starpu_data_unregister(t->h_master_lo_chunk[c]);
        free(t->h_master_lo_chunk);
        if (t->h_grad_acc) starpu_data_unregister_no_coherency(t->h_grad_acc); /* dropped each step: no value */
        if (t->h_weights) {
            starpu_data_partition_clean(t->h_weights, t->nchunks, t->h_weights_chunk);
            starpu_data_unregister(t->h_weights);
            unregister_grad(t, t->h_grad, t->h_grad_chunk);
            t->h_grad_chunk = NULL;
        }
        size_t fbytes = (size_t)t->numel * sizeof(float), half = (size_t)t->numel * sizeof(uint16_t);
        free_state(t, PIN_WEIGHTS, t->weights, t->weight_bytes);
        free_state(t, PIN_MASTER, t->master, fbytes);
        free_state(t, PIN_GRAD, t->grad, fbytes);
        free_state(t, PIN_MASTER, t->master_lo, half);
        free_state(t, PIN_GRAD, t->grad_bf16, half);
        free_state(t, PIN_GRAD_ACC, t->grad_acc, fbytes);
        free_state(t, PIN_M, t->adam_m, fbytes);
        free_state(t, PIN_V, t->adam_v, fbytes);
        free(t->chunks);
        free(t->h_weights_chunk);
    }
    free(st->tiles);
    free(st);
}

/* splitmix64: a seedable generator whose stream does not depend on the platform. */
static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double gaussian(uint64_t *s)
{
    double u1 = ((splitmix(s) >> 11) + 1) * (1.0 / 9007199254740993.0);
    double u2 = (splitmix(s) >> 11) * (1.0 / 9007199254740992.0);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

typedef struct init_args { uint64_t seed; double std; } init_args;

/* What tensor d starts as: matrices N(0, std), norms 1, biases 0. */
typedef enum init_kind { INIT_NORMAL, INIT_ONE, INIT_ZERO } init_kind;

/* The fp32 side of a tile's streamed copy (mt_layout_keep_norms_f32) over elements [offset,
 * offset + n): the norms among them from src (write) or into out (read). The side is a norm's
 * streamed copy in the full layout and its master in the compact one. */
static void side_range(const mt_tile *t, int64_t offset, int64_t n, const float *src, float *out)
{
    const mt_tile_layout *lay = t->layout;
    for (int k = 0; lay->f32_numel && k < lay->ntensors; k++) {
        const mt_tensor_desc *d = &lay->tensors[k];
        const int64_t b = offset > d->offset ? offset : d->offset;
        const int64_t e = offset + n < d->offset + d->numel ? offset + n : d->offset + d->numel;
        if (!d->f32_at || b >= e) continue;
        float *side = (float *)t->weights + d->f32_at + (b - d->offset);
        if (src) memcpy(side, src + (b - offset), (size_t)(e - b) * sizeof(float));
        else memcpy(out + (b - offset), side, (size_t)(e - b) * sizeof(float));
    }
}

/* The master of elements [offset, offset + n) of a compact tile from src: the planes, and the
 * norms among them in the side. */
static void encode_range(mt_tile *t, int64_t offset, int64_t n, const float *src)
{
    mt_cpu_master_encode(n, src, (mt_bf16 *)t->weights + offset, t->master_lo + offset);
    side_range(t, offset, n, src, NULL);
}

/* The streamed copy of elements [offset, offset + n) of a full-layout tile from their fp32 values
 * src: in the compute dtype, and the norms among them in the side. */
static void stream_range(const mt_host_state *st, mt_tile *t, int64_t offset, int64_t n, const float *src)
{
    mt_cpu_streamed_copy(n, src, (char *)t->weights + (size_t)offset * mt_dtype_size(st->compute_dtype),
                         st->compute_dtype);
    side_range(t, offset, n, src, NULL);
}

static init_kind init_kind_of(const mt_tensor_desc *d)
{
    return d->ndim == 2 ? INIT_NORMAL : strstr(d->name, "norm") ? INIT_ONE : INIT_ZERO;
}

/* The next n values of a tensor of kind k into out, drawing from the tile's generator s. */
static void init_values(init_kind k, uint64_t *s, double std, int64_t n, float *out)
{
    for (int64_t e = 0; e < n; e++) out[e] = k == INIT_NORMAL ? (float)(std * gaussian(s)) : k == INIT_ONE ? 1.0f : 0.0f;
}

/* The compact layout's: the same values, encoded into the planes a block at a time (a whole
 * tile's fp32 master on every thread at once would take 4 bytes per parameter more). */
static void init_tile_compact(mt_tile *t, uint64_t *s, double std)
{
    enum { BLOCK = 4096 };
    const mt_tile_layout *lay = t->layout;
    memset(t->weights, 0, t->weight_bytes);
    memset(t->master_lo, 0, (size_t)t->numel * sizeof(uint16_t));
    float block[BLOCK];
    for (int k = 0; k < lay->ntensors; k++) {
        const mt_tensor_desc *d = &lay->tensors[k];
        const init_kind kind = init_kind_of(d);
        if (d->numel == 0 || kind == INIT_ZERO) continue;
        for (int64_t o = 0; o < d->numel; o += BLOCK) {
            const int64_t len = d->numel - o < BLOCK ? d->numel - o : BLOCK;
            init_values(kind, s, std, len, block);
            encode_range(t, d->offset + o, len, block);
        }
    }
}

static void init_tile(mt_host_state *st, int i, void *arg)
{
    const init_args *a = arg;
    uint64_t seed = a->seed;
    double std = a->std;
    {
        mt_tile *t = &st->tiles[i];
        const mt_tile_layout *lay = t->layout;
        uint64_t s = seed ^ (0xA5A5A5A5ull * (uint64_t)(i + 1));
        if (st->layout == MT_LAYOUT_COMPACT) {
            init_tile_compact(t, &s, std);
            return;
        }
        /* a tile another rank holds: the same values, for its streamed copy alone (every rank
         * draws them, so every rank starts from the same weights) */
        float *master = t->master ? t->master : malloc((size_t)t->numel * sizeof(float));
        if (!master) {
            fprintf(stderr, "megatrain: out of host memory initialising tile %d (%lld floats)\n", i, (long long)t->numel);
            abort();
        }
        memset(master, 0, (size_t)t->numel * sizeof(float));
        for (int k = 0; k < lay->ntensors; k++) {
            const mt_tensor_desc *d = &lay->tensors[k];
            const init_kind kind = init_kind_of(d);
            if (d->numel == 0 || kind == INIT_ZERO) continue; /* biases stay 0 */
            init_values(kind, &s, std, d->numel, master + d->offset);
        }
        stream_range(st, t, 0, t->numel, master);
        if (master != t->master) free(master);
    }
}

void mt_state_init_random(mt_host_state *st, uint64_t seed, double std)
{
    init_args a = { seed, std };
    for_each_tile(st, init_tile, &a);
}

void mt_state_sync_weights(mt_host_state *st)
{
    if (st->layout == MT_LAYOUT_COMPACT) return; /* the streamed copy is the master's high half */
    for (int i = 0; i < st->ntiles; i++) {
        mt_tile *t = &st->tiles[i];
        if (!t->master) continue; /* sharded: the owner's update or mt_dist_share_weights sets it */
        stream_range(st, t, 0, t->numel, t->master);
    }
}

void mt_state_read_master(const mt_host_state *st, int tile, int64_t offset, int64_t n, float *out)
{
    const mt_tile *t = &st->tiles[tile];
    if (st->layout == MT_LAYOUT_COMPACT) {
        mt_cpu_master_decode(n, (const mt_bf16 *)t->weights + offset, t->master_lo + offset, out);
        side_range(t, offset, n, NULL, out);
        return;
    }
    if (!t->master) {
        fprintf(stderr, "megatrain: tile %d's master is rank %d's, not this rank's (%d of %d): gather it first\n", tile,
                mt_state_owner(st, tile), st->shard_rank, st->shard_ranks);
        abort();
    }
    memcpy(out, t->master + offset, (size_t)n * sizeof(float));
}

void mt_state_write_master(mt_host_state *st, int tile, int64_t offset, int64_t n, const float *in)
{
    mt_tile *t = &st->tiles[tile];
    if (st->layout == MT_LAYOUT_COMPACT) {
        encode_range(t, offset, n, in);
        return;
    }
    if (t->master) memmove(t->master + offset, in, (size_t)n * sizeof(float));
    stream_range(st, t, offset, n, t->master ? t->master + offset : in);
}

void mt_state_read_grad(const mt_host_state *st, int tile, int64_t offset, int64_t n, float *out)
{
    const mt_tile *t = &st->tiles[tile];
    if (st->layout == MT_LAYOUT_COMPACT) mt_bf16_to_f32(n, t->grad_bf16 + offset, out);
    else memcpy(out, t->grad + offset, (size_t)n * sizeof(float));
}

const float *mt_state_master_f32(const mt_host_state *st, int tile, float **buf)
{
    const mt_tile *t = &st->tiles[tile];
    if (st->layout == MT_LAYOUT_FULL && (t->master || !st->remote_master)) return t->master;
    float *b = realloc(*buf, (size_t)t->numel * sizeof(float));
    if (!b) return NULL;
    *buf = b;
    if (st->layout == MT_LAYOUT_FULL) return st->remote_master(st, tile, b) ? NULL : b;
    mt_state_read_master(st, tile, 0, t->numel, b);
    return b;
}
