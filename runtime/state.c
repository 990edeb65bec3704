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
enum { PIN_WEIGHTS = 1, PIN_MASTER = 2, PIN_GRAD = 4, PIN_M = 8, PIN_V = 16, PIN_GRAD_ALT = 32 };

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
    bytes = round_up(bytes, TILE_ALIGN_BYTES);
    memset(p, 0, bytes);
    if (!gpu_present()) return 0;
    if (starpu_memory_pin(p, bytes) != 0) return 1;
    t->pinned_kinds |= kind;
    return 0;
}

/* Zeroes and pins every kind of state of one tile; *arg (an atomic_int) counts the failed pins. */
static void zero_tile(mt_host_state *st, int i, void *arg)
{
    atomic_int *unpinned = arg;
    mt_tile *t = &st->tiles[i];
    size_t fbytes = (size_t)t->numel * sizeof(float);
    int bad = zero_and_pin(t, PIN_WEIGHTS, t->weights, t->weight_bytes);
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

/* Splits a tile into AdamW chunks: boundaries at every tensor start, pieces of at most
 * chunk_numel elements aligned to MT_TILE_ALIGN; a tensor's trailing padding joins its last
 * piece so the chunks tile the whole vector (a partition must). */
static int build_chunks(const mt_tile_layout *lay, int64_t chunk_numel, mt_chunk **out)
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

/* One handle per AdamW chunk over each of three state arrays (master, m, v):
 * the handle arrays are allocated into *chunks[k]. */
static void register_state_chunks(const mt_tile *t, float *const state[3], starpu_data_handle_t **chunks[3])
{
    for (int k = 0; k < 3; k++) {
        *chunks[k] = calloc(t->nchunks, sizeof(starpu_data_handle_t));
        for (int c = 0; c < t->nchunks; c++)
            starpu_vector_data_register(&(*chunks[k])[c], STARPU_MAIN_RAM, (uintptr_t)(state[k] + t->chunks[c].offset),
                                        (uint32_t)t->chunks[c].numel, sizeof(float));
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

/* The planned partition of a whole-tile handle into the tile's AdamW chunks. */
static starpu_data_handle_t *plan_chunks(const mt_tile *t, starpu_data_handle_t whole)
{
    long *lens = malloc(sizeof *lens * t->nchunks);
    for (int c = 0; c < t->nchunks; c++) lens[c] = (long)t->chunks[c].numel;
    struct starpu_data_filter f = {
        .filter_func = starpu_vector_filter_list_long,
        .nchildren = (unsigned)t->nchunks,
        .filter_arg_ptr = lens,
    };
    starpu_data_handle_t *chunks = calloc(t->nchunks, sizeof(starpu_data_handle_t));
    starpu_data_partition_plan(whole, &f, chunks);
    free(lens);
    return chunks;
}

/* A gradient buffer (the tile's or its second one): the whole handle, written through to host
 * memory, and its chunk partition. */
static void register_grad(mt_tile *t, float *grad, starpu_data_handle_t *whole, starpu_data_handle_t **chunks)
{
    starpu_vector_data_register_allocsize(whole, STARPU_MAIN_RAM, (uintptr_t)grad, (uint32_t)t->numel, sizeof(float),
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

static int register_tile(mt_host_state *st, mt_tile *t, size_t weight_allocsize)
{
    size_t esz = mt_dtype_size(st->compute_dtype);
    starpu_vector_data_register_allocsize(&t->h_weights, STARPU_MAIN_RAM, (uintptr_t)t->weights,
                                          (uint32_t)t->numel, esz, weight_allocsize);
    t->nchunks = build_chunks(t->layout, st->chunk_numel, &t->chunks);
    t->grad_allocsize = weight_allocsize / esz * sizeof(float);
    t->h_weights_chunk = plan_chunks(t, t->h_weights);
    register_grad(t, t->grad, &t->h_grad, &t->h_grad_chunk);
    register_state_chunks(t, (float *const[3]){ t->master, t->adam_m, t->adam_v },
                          (starpu_data_handle_t **[3]){ &t->h_master_chunk, &t->h_m_chunk, &t->h_v_chunk });
    return 0;
}

mt_host_state *mt_state_create(const mt_model_config *cfg, mt_dtype compute_dtype,
                               int64_t chunk_numel, char *err, size_t errlen)
{
    mt_host_state *st = calloc(1, sizeof *st);
    st->cfg = *cfg;
    st->compute_dtype = compute_dtype;
    st->chunk_numel = chunk_numel > 0 ? chunk_numel : (int64_t)1 << 20;
    st->pinned = gpu_present();
    mt_layout_build(cfg, MT_TILE_EMBED, &st->layout_embed);
    mt_layout_build(cfg, MT_TILE_LAYER, &st->layout_layer);
    mt_layout_build(cfg, MT_TILE_HEAD, &st->layout_head);
    st->ntiles = (int)cfg->layers + 2;
    st->tiles = calloc(st->ntiles, sizeof *st->tiles);

    size_t esz = mt_dtype_size(compute_dtype);
    for (int i = 0; i < st->ntiles; i++) {
        mt_tile *t = &st->tiles[i];
        t->index = i;
        t->layout = i == 0 ? &st->layout_embed : i == st->ntiles - 1 ? &st->layout_head : &st->layout_layer;
        t->numel = t->layout->numel;
        t->weight_bytes = round_up((size_t)t->numel * esz, TILE_ALIGN_BYTES);
        size_t fbytes = (size_t)t->numel * sizeof(float);
        t->weights = alloc_state(t->weight_bytes);
        t->master = alloc_state(fbytes);
        t->grad = alloc_state(fbytes);
        t->adam_m = alloc_state(fbytes);
        t->adam_v = alloc_state(fbytes);
        if (!t->weights || !t->master || !t->grad || !t->adam_m || !t->adam_v) {
            snprintf(err, errlen, "out of host memory allocating tile %d (%zu bytes per kind)", i, fbytes);
            st->ntiles = i + 1;
            mt_state_destroy(st);
            return NULL;
        }
    }
    atomic_int unpinned = 0;
    for_each_tile(st, zero_tile, &unpinned);
    note_unpinned(st, atomic_load(&unpinned), "host state");
    /* Every decoder layer's streamed copy shares one allocation size, so a GPU buffer freed by
     * one layer is reused as is by the next (StarPU recycles same-size buffers). */
    for (int i = 0; i < st->ntiles; i++) {
        mt_tile *t = &st->tiles[i];
        size_t allocsize = (i == 0 || i == st->ntiles - 1) ? t->weight_bytes
                                                             : round_up((size_t)st->layout_layer.numel * esz, TILE_ALIGN_BYTES);
        register_tile(st, t, allocsize);
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
        if (fresh[i]) register_grad(&st->tiles[i], st->tiles[i].grad_alt, &st->tiles[i].h_grad_alt, &st->tiles[i].h_grad_alt_chunk);
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
        if (t->h_weights) {
            starpu_data_partition_clean(t->h_weights, t->nchunks, t->h_weights_chunk);
            starpu_data_unregister(t->h_weights);
            unregister_grad(t, t->h_grad, t->h_grad_chunk);
            t->h_grad_chunk = NULL;
        }
        size_t fbytes = (size_t)t->numel * sizeof(float);
        free_state(t, PIN_WEIGHTS, t->weights, t->weight_bytes);
        free_state(t, PIN_MASTER, t->master, fbytes);
        free_state(t, PIN_GRAD, t->grad, fbytes);
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

static void init_tile(mt_host_state *st, int i, void *arg)
{
    const init_args *a = arg;
    uint64_t seed = a->seed;
    double std = a->std;
    {
        mt_tile *t = &st->tiles[i];
        const mt_tile_layout *lay = t->layout;
        uint64_t s = seed ^ (0xA5A5A5A5ull * (uint64_t)(i + 1));
        memset(t->master, 0, (size_t)t->numel * sizeof(float));
        for (int k = 0; k < lay->ntensors; k++) {
            const mt_tensor_desc *d = &lay->tensors[k];
            float *p = t->master + d->offset;
            if (d->numel == 0) continue;
            if (d->ndim == 2)
                for (int64_t e = 0; e < d->numel; e++) p[e] = (float)(std * gaussian(&s));
            else if (strstr(d->name, "norm"))
                for (int64_t e = 0; e < d->numel; e++) p[e] = 1.0f;
            /* biases stay 0 */
        }
        if (st->compute_dtype == MT_DTYPE_BF16) mt_f32_to_bf16(t->numel, t->master, (mt_bf16 *)t->weights);
        else memcpy(t->weights, t->master, (size_t)t->numel * sizeof(float));
    }
}

void mt_state_init_random(mt_host_state *st, uint64_t seed, double std)
{
    init_args a = { seed, std };
    for_each_tile(st, init_tile, &a);
}

void mt_state_sync_weights(mt_host_state *st)
{
    for (int i = 0; i < st->ntiles; i++) {
        mt_tile *t = &st->tiles[i];
        if (st->compute_dtype == MT_DTYPE_BF16)
            mt_f32_to_bf16(t->numel, t->master, (mt_bf16 *)t->weights);
        else
            memcpy(t->weights, t->master, (size_t)t->numel * sizeof(float));
    }
}
