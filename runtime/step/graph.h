/* The training step graph's state, shared by the files that submit its tasks: graph.c (the
 * buffers and the graph's life), compute.c (forward, loss anchor, backward, evaluation),
 * update.c (the norm and the update) and table.c (the table's early update). Internal to the
 * runtime; runtime/step.h is the interface.
 *
 * With several micro-batches, every micro-batch passes through a layer while its weights (and,
 * in the backward, its gradient) are on the GPU: the micro-batch loop is inside the layer loop,
 * so weights and gradients move once per step, not once per micro-batch. Handles, per
 * micro-batch u:
 *   ckpt[b][u]  input of block b (layers bK .. bK+K-1), kept from forward to backward
 *   act[u][2]   forward ping-pong between checkpoints; grad[u][2] backward ping-pong
 * and shared:
 *   saved[j]    what layer j of the block being recomputed keeps for its backward (the
 *               micro-batches recompute and walk back a block one after the other); over
 *               several devices, K per device: saved[d * K + j]
 *   slot data   tokens, targets and loss of each micro-batch, two slots so step s+1 can be
 *               filled while step s still runs; with the router's load-balancing loss also
 *               each micro-batch's router statistics (2E doubles, mt_moe_aux_loss): zeroed
 *               when the micro-batch is submitted, added to by each sparse layer's forward
 *               (RW), read by each sparse layer's backward; the recompute adds nothing
 * Activations have host homes (graph.c, alloc_homes: StarPU allocates nothing of them in its RAM
 * node), plain memory where only an eviction or a CPU worker writes, pinned where a GPU copies
 * every step: each micro-batch's dh0 (read by the table's CPU backward) and, with
 * offload_checkpoints, the checkpoints of every block but the last: their home is pinned host
 * memory with a write-through mask to it, so each goes home as the forward writes it
 * and its GPU copy is clean; once the forward's reader is submitted, starpu_data_wont_use puts
 * that copy first in line when StarPU needs room (its buffer, the size of every hidden state, is
 * reused as is); the end of the first recompute task of each (block, micro-batch) prefetches the
 * next one's checkpoint to the GPU, overlapping that unit's remaining recompute and backward;
 * after its recompute it is marked again instead of dropped (it keeps a value: compute.c,
 * release_checkpoint). The last block's checkpoints are read first by the backward, right after
 * the forward: they stay where they are written. */
#ifndef MT_RUNTIME_STEP_GRAPH_H
#define MT_RUNTIME_STEP_GRAPH_H

#include <stdbool.h>
#include <stdint.h>

#include "codelets/adamw.h"
#include "codelets/common.h"
#include "runtime/speculate/speculate.h"
#include "runtime/state.h"
#include "runtime/step.h"
#include "runtime/step/tasks.h"

#define MT_STEP_SLOTS 2
#define MT_STEP_READY_RING 4

/* A host buffer the graph allocated as a handle's home. */
typedef struct mt_home {
    void *p;
    size_t bytes;
    bool pinned;                             /* starpu_malloc_flags(STARPU_MALLOC_PINNED), else posix_memalign */
} mt_home;

typedef struct mt_step_slot {
    int32_t *tokens, *targets;               /* (accum, B*T) host arrays */
    starpu_data_handle_t *h_tokens, *h_targets, *h_loss;
    double *loss;                            /* (accum, 2): sum, count */
    double *router_stats;                    /* (accum, 2E) with the load-balancing loss, else NULL */
    starpu_data_handle_t *h_router_stats;    /* (accum) over router_stats */
    double clip_result[2];
    starpu_data_handle_t h_clip_copy;
    bool updated, speculated;                /* an update of this slot's step was submitted; speculatively */
} mt_step_slot;

/* What the unpartition callback of a tile's update reports (its tile's weights are current). */
typedef struct mt_ready_note {
    struct mt_graph *g;
    int tile;
    int64_t step;
} mt_ready_note;

struct mt_graph {
    mt_host_state *st;
    mt_step_config sc;
    mt_codelet_model model;                   /* what the compute tasks see of the model */
    int64_t ntok;                             /* B * T */
    int nblocks;
    starpu_data_handle_t *ckpt;               /* (nblocks * accum), mt_step_ckpt() */
    bool offload;                             /* offload_checkpoints, auto resolved */
    mt_home *homes;                           /* the activations' host homes (graph.c, alloc_homes) */
    int nhomes;
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
    mt_step_slot slots[MT_STEP_SLOTS];
    int next_slot;
    /* evaluation I/O (one micro-batch) */
    int32_t *eval_tokens, *eval_targets;
    starpu_data_handle_t h_eval_tokens, h_eval_targets, h_eval_loss;
    double eval_loss[2];
    mt_observer observer;
    uint32_t where;                           /* STARPU_CUDA when a GPU runs compute, else STARPU_CPU */
    double aux_coef;                          /* the load-balancing loss's coefficient; 0: off */
    int64_t aux_rows;                         /* router rows of a micro-batch: tokens x sparse layers */
    uint32_t *updates_submitted;              /* (ntiles) AdamW updates submitted per tile */
    mt_ready_note *ready_notes;               /* (MT_STEP_READY_RING * ntiles) */
    mt_adamw_stats stats;                     /* the AdamW tasks' counters and timers */
    mt_update_ctx update;                     /* what the AdamW tasks share */
    mt_speculation speculation;
    /* A distributed run's ranks (runtime/dist.h; size 1: one process) and the pools of receive
     * buffers of the other ranks' gradient chunks, one per chunk size (dist.c). */
    int dist_rank, dist_size;
    /* The compute devices of this process (mt_step_config.devices) and, above 1, the devices'
     * copies of every tile's gradient: dev_grad[(d - mt_step_first_copy(g)) * ntiles + tile] for
     * device d >= mt_step_first_copy(g), on CPU workers with homes dev_grad_mem, on GPUs with none
     * (graph.c, alloc_device_grads; compute.c sums them). */
    int ndev;
    starpu_data_handle_t *dev_grad;
    void **dev_grad_mem;
    int *dev_worker;                          /* (ndev) the worker of each device, when ndev > 1 */
    struct mt_dist_pool *dist_pools;
    int dist_npools;
};

/* The first device with a gradient copy of its own: 1 in the compact layout (device 0 writes the
 * tile's accumulator, which has no home either), 0 in the full one (device 0's copy too, so that
 * the tile's gradient, written through to its host home, is written once, from the sum). */
static inline int mt_step_first_copy(const mt_graph *g) { return g->st->layout == MT_LAYOUT_COMPACT ? 1 : 0; }

/* Checkpoint of block b for micro-batch u. */
static inline starpu_data_handle_t mt_step_ckpt(const mt_graph *g, int b, int u) { return g->ckpt[b * g->sc.accum + u]; }
/* Whether block b's checkpoints have their home in host memory (offload, every block but the last). */
static inline bool mt_step_ckpt_offloaded(const mt_graph *g, int b) { return g->offload && b < g->nblocks - 1; }

/* compute.c: the forward, loss anchor and block-wise backward of every micro-batch of a step
 * (early_table: the table's embedding backward runs in its early update path instead), into a
 * slot; returns the slot. */
int mt_step_submit_compute(mt_graph *g, int64_t step, const int32_t *tokens, const int32_t *targets, bool early_table);
/* compute.c: prefetch hint for a task: the weights of the next tile the GPU will need, current
 * once the updates submitted so far (plus `ahead`, for the next step's first layer) landed. */
void *mt_step_hint(mt_graph *g, int tile, uint32_t ahead);
/* compute.c: tile t's gradient's sum of squares into partial[t], on a CPU worker: where the
 * compute tasks do not take it (across ranks or devices). */
void mt_step_insert_sumsq(mt_graph *g, mt_tile *t);
/* compute.c: drops an activation buffer's contents once its last reader is submitted. */
void mt_step_drop(starpu_data_handle_t h);

/* update.c: whether tile i's update is split in two (adamw_split; without clipping by default
 * only the embedding and layer 0). */
bool mt_step_split_update(const mt_graph *g, int tile);

/* table.c: the table's update started before its embedding backward (clipping: sp says how it
 * speculates). */
void mt_step_submit_table_early(mt_graph *g, int slot, int64_t step, double lr, mt_speculation_choice sp);

/* dist.c, only when dist_size > 1: tile t's gradient, whole on this rank, summed over the ranks
 * into its owner's (after the tile's last gradient task is submitted), then with clipping its sum
 * of squares into partial[t] on every rank. The owner's update of chunk c sends the updated
 * streamed weights of the chunk to the other ranks (after its AdamW task is submitted, the tile's
 * weights partitioned); the others receive all of a tile's chunks in place of its update. */
void mt_step_dist_reduce(mt_graph *g, mt_tile *t);
void mt_step_dist_send_weights(mt_graph *g, mt_tile *t, int c);
void mt_step_dist_receive_weights(mt_graph *g, mt_tile *t);
void mt_step_dist_free(mt_graph *g);

#endif
