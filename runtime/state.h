/* The host state of a model: per tile (embedding, each decoder layer, head) one contiguous,
 * 2 MiB-aligned allocation, pinned with a GPU, per kind of state (streamed weights, fp32 master, gradient,
 * AdamW m and v), and the StarPU handles over them. Host memory is the home of all of it. */
#ifndef MT_RUNTIME_STATE_H
#define MT_RUNTIME_STATE_H

#include <stdbool.h>
#include <stdint.h>

#include "codelets/mt_starpu.h"

#include "models/config.h"
#include "models/dtype.h"
#include "models/layout.h"
#include "runtime/plan.h"


/* One AdamW unit of work: a contiguous range inside one tensor of a tile (plus the padding
 * that follows the tensor, which stays zero). */
typedef struct mt_chunk {
    int64_t offset, numel;   /* elements, inside the tile */
    bool decay;              /* weight decay applies */
} mt_chunk;

/* The AdamW chunks of a tile of layout `lay`: boundaries at every tensor start, pieces of at most
 * chunk_numel elements aligned to MT_TILE_ALIGN, a tensor's trailing padding in its last piece, so
 * that they tile the whole vector. *out is malloc'd; returns their count. */
int mt_state_build_chunks(const mt_tile_layout *lay, int64_t chunk_numel, mt_chunk **out);
/* The largest AdamW chunk when mt_state_args.chunk_numel is 0. */
#define MT_STATE_CHUNK_NUMEL_DEFAULT ((int64_t)1 << 20)

typedef struct mt_tile {
    const mt_tile_layout *layout;
    int index;               /* 0 = embedding, 1..L = layers, L+1 = head */
    int64_t numel;           /* elements, padding included */
    size_t weight_bytes;     /* bytes of the streamed copy, 4 KiB-rounded */
    void *weights;           /* streamed compute copy, state->compute_dtype, (numel) */
    float *master;           /* fp32 master weights (numel) */
    float *grad;             /* fp32 gradient (numel) */
    float *adam_m, *adam_v;  /* AdamW moments (numel) */
    starpu_data_handle_t h_weights, h_grad;   /* the whole tile: what compute tasks use */
    int nchunks;
    mt_chunk *chunks;
    starpu_data_handle_t *h_weights_chunk, *h_grad_chunk;  /* planned partitions of the above */
    starpu_data_handle_t *h_master_chunk, *h_m_chunk, *h_v_chunk;
    /* A second gradient (mt_state_enable_grad_alt), pinned and registered as the first: a step
     * writes one while the deferred AdamW moments of the last step read the other;
     * mt_tile_swap_grad swaps them. NULL when not enabled. */
    float *grad_alt;
    starpu_data_handle_t h_grad_alt, *h_grad_alt_chunk;
    bool grad_alt_current;   /* swapped an odd number of times */
    size_t grad_allocsize;   /* the allocation size both gradient handles are registered with */
    unsigned pinned_kinds;   /* state.c's PIN_* bits: the allocations of this tile that are pinned
                              * (each kind's own, as when no swap is outstanding) */
    /* The compact layout (mt_host_state.layout; docs/design.md, section 1.1), where master and
     * grad are NULL: `weights` is the master's high half (bf16, streamed), master_lo its low 16
     * bits (backends/cpu/master_planes.h), grad_bf16 the gradient's home (what h_grad covers, bf16),
     * written once a step from h_grad_acc, the fp32 accumulator the compute tasks write (the
     * table's has its host home grad_acc, written by the CPU embedding backward; the others have
     * none: StarPU allocates them where the tasks run). h_master_lo_chunk: master_lo's AdamW
     * chunks. All NULL in the full layout. */
    uint16_t *master_lo;
    mt_bf16 *grad_bf16;
    float *grad_acc;
    starpu_data_handle_t h_grad_acc, *h_master_lo_chunk;
} mt_tile;

typedef struct mt_host_state {
    mt_model_config cfg;
    mt_dtype compute_dtype;
    /* layout_layer: every decoder layer's, or in a model with dense and sparse layers the sparse
     * layers' (mt_layout_build); layout_dense_layer: the dense layers' of such a model, else
     * unused (numel 0). Each tile's `layout` points at its own (mt_config_layer_is_sparse). */
    mt_tile_layout layout_embed, layout_layer, layout_head, layout_dense_layer;
    int ntiles;              /* L + 2 */
    mt_tile *tiles;
    int64_t chunk_numel;     /* largest AdamW chunk */
    bool pinned;             /* every tile allocation is pinned (false without a GPU, or when
                              * pinning one failed: state.c warns on stderr then) */
    mt_host_layout layout;   /* FULL or COMPACT; compact pins only the allocations a GPU copies
                              * (weights and gradient), and `pinned` says so of those */
    /* Sharded over the ranks of a distributed run (ZeRO-1; full layout only): this process holds
     * the streamed weights and the gradient of every tile, and the master and AdamW moments only
     * of the tiles it owns, tile t's owner being rank t mod shard_ranks (mt_state_owner); the
     * other tiles' master, adam_m, adam_v and their chunk handles are NULL. shard_ranks 1: every
     * tile is held. */
    int shard_ranks, shard_rank;
    /* Where mt_state_master_f32 reads a master this rank does not hold: into dst (the tile's
     * numel floats), 0 or -1. Set on rank 0 while it saves or hashes the model after the last step
     * (mt_dist_masters_open: the tile's owner sends it, one tile at a time); NULL otherwise. */
    int (*remote_master)(const struct mt_host_state *st, int tile, float *dst);
} mt_host_state;

/* What a host state is created from. */
typedef struct mt_state_args {
    const mt_model_config *cfg;
    mt_dtype compute_dtype;  /* of the streamed weights */
    int64_t chunk_numel;     /* largest AdamW chunk; 0: MT_STATE_CHUNK_NUMEL_DEFAULT */
    mt_host_layout layout;   /* FULL (0) or COMPACT (bf16 weights only) */
    int shard_ranks, shard_rank; /* sharded over shard_ranks > 1 ranks (full layout); 0 or 1: not */
} mt_state_args;

/* Allocates and registers the host state (StarPU must be running). Weights are initialised by
 * mt_state_init_random or loaded afterwards; gradients and moments start at zero.
 * Returns NULL with err set when memory cannot be had. */
mt_host_state *mt_state_create(const mt_model_config *cfg, mt_dtype compute_dtype,
                               int64_t chunk_numel, char *err, size_t errlen);
/* The same from args, in either layout (mt_state_create: the full one). NULL with err set also
 * for a layout that is not FULL or COMPACT, or COMPACT with fp32 weights. */
mt_host_state *mt_state_create_with(const mt_state_args *args, char *err, size_t errlen);
void mt_state_destroy(mt_host_state *st);

/* Allocates (pinned, zeroed) and registers a second gradient for tiles first..ntiles-1
 * (4 more bytes per parameter of those tiles). Returns -1 with err set when memory cannot be had
 * (the state is then as before). */
int mt_state_enable_grad_alt(mt_host_state *st, int first, char *err, size_t errlen);
/* Bytes mt_state_enable_grad_alt(st, first) allocates. */
uint64_t mt_state_grad_alt_bytes(const mt_host_state *st, int first);
/* Swaps a tile's gradient with its second one: pointer, whole handle and chunk handles. Compute
 * tasks submitted afterwards write the other buffer. */
void mt_tile_swap_grad(mt_tile *t);

/* HF-style initialisation: matrices N(0, std), norms 1, biases 0; std 0.02 by default.
 * Deterministic for a seed. Writes master and the streamed copy. */
void mt_state_init_random(mt_host_state *st, uint64_t seed, double std);

/* Copies master into the streamed copy (converting to the compute dtype). Host-side, no tasks
 * in flight. Nothing to do in the compact layout, where the streamed copy is the master's high
 * half. */
void mt_state_sync_weights(mt_host_state *st);

/* The master and the gradient as fp32, whatever the layout: what everything outside the step
 * graph reads and writes them with (no task may be writing what they touch: the caller orders
 * them, by starpu_task_wait_for_all after mt_graph_flush or by acquiring the tile's handles).
 * Elements [offset, offset + n) of tile `tile`'s master into out. */
void mt_state_read_master(const mt_host_state *st, int tile, int64_t offset, int64_t n, float *out);
/* Sets them from in, and their streamed copy (full: in the compute dtype, nearest even; compact:
 * the planes, whose high half is the streamed weight); of a tile a sharded state does not hold,
 * the streamed copy alone. Reading the master of such a tile is a programming error (abort). */
void mt_state_write_master(mt_host_state *st, int tile, int64_t offset, int64_t n, const float *in);
/* Elements [offset, offset + n) of the tile's gradient as fp32 (compact: its bf16 home widened). */
void mt_state_read_grad(const mt_host_state *st, int tile, int64_t offset, int64_t n, float *out);
/* A whole tile's master as fp32, for readers of whole tiles: the tile's own array in the full
 * layout, else decoded into *buf (grown to the tile by realloc; the caller frees it); a tile a
 * sharded state does not hold, read through remote_master into *buf. NULL when that memory cannot
 * be had, or the tile is not held and cannot be read. */
const float *mt_state_master_f32(const mt_host_state *st, int tile, float **buf);

/* The rank that owns tile `tile` (its master and moments), and whether this process holds them. */
static inline int mt_state_owner(const mt_host_state *st, int tile) { return st->shard_ranks > 1 ? tile % st->shard_ranks : 0; }
static inline bool mt_state_holds(const mt_host_state *st, int tile) { return mt_state_owner(st, tile) == st->shard_rank; }

static inline mt_tile *mt_state_embed(mt_host_state *st) { return &st->tiles[0]; }
static inline mt_tile *mt_state_layer(mt_host_state *st, int i) { return &st->tiles[1 + i]; }
static inline mt_tile *mt_state_head(mt_host_state *st) { return &st->tiles[st->ntiles - 1]; }

#endif
