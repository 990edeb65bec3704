/* A tile's gradient summed over the ranks of a distributed run (runtime/dist.h) and its update
 * shared, inside the step graph, chunk by chunk (the tile's AdamW chunks), through StarPU-MPI's
 * detached sends and receives (ordered with the tasks by the data they access, like tasks). The
 * host state is sharded (ZeRO-1, runtime/state.h): tile t's owner, rank t mod N, alone holds its
 * master and moments. It receives every other rank's gradient of each chunk and sums them in rank
 * order (codelets/reduce.h); with clipping it takes the tile's sum of squares and sends it to
 * every rank, so that each computes the same norm from the same partials; it applies AdamW and
 * sends each chunk's updated streamed weights to every other rank, which receives them in place
 * of an update. The result is the bits one process would compute over the whole batch with the
 * same reduction order, on every rank.
 *
 * The owner receives into pools: for each distinct chunk size, MT_DIST_POOL_SLOTS buffers per other
 * rank, used in turn; StarPU orders a slot's next receive (W) after the last sum that read it, so
 * at most that many chunks of a size are in flight per rank, and the receive buffers take
 * (N - 1) x MT_DIST_POOL_SLOTS x 4 bytes x the sum of the distinct chunk sizes, whatever the model's
 * size (runtime/plan.c counts the same). No cycle: a receive waits only for sums of earlier
 * chunks, whose sends every rank submitted before this chunk's. */
#include "runtime/step/graph.h"

#include <starpu_mpi.h>
#include <stdio.h>
#include <stdlib.h>

#include "codelets/reduce.h"
#include "runtime/dist.h"

/* Tags of chunk c of tile t: its gradients up to the owner, its updated weights down; the tile's
 * sum of squares is chunk DIST_TAG_CHUNKS - 1's down. Between two ranks one tag's messages arrive
 * in the order sent (MPI), which is step order. */
#define DIST_TAG_CHUNKS ((starpu_mpi_tag_t)1 << 20)
static starpu_mpi_tag_t tag_of(int t, int c, int down) { return ((starpu_mpi_tag_t)t * DIST_TAG_CHUNKS + c) * 2 + down; }
static starpu_mpi_tag_t sumsq_tag(int t) { return tag_of(t, (int)DIST_TAG_CHUNKS - 1, 1); }

/* Owner rank of tile t. */
static int owner(const mt_graph *g, int t) { return mt_state_owner(g->st, t); }

/* A pool of receive buffers of one chunk size: MT_DIST_POOL_SLOTS slots of dist_size handles (the
 * owner's own entry unused), registered on first use. */
struct mt_dist_pool {
    int64_t numel;
    int next;
    starpu_data_handle_t *h; /* (MT_DIST_POOL_SLOTS * dist_size) */
    float **mem;
};

/* The next slot of the pool of `numel`-element chunks: its handles by rank. */
static starpu_data_handle_t *next_slot(mt_graph *g, int64_t numel)
{
    struct mt_dist_pool *p = NULL;
    for (int i = 0; i < g->dist_npools && !p; i++)
        if (g->dist_pools[i].numel == numel) p = &g->dist_pools[i];
    if (!p) {
        g->dist_pools = realloc(g->dist_pools, sizeof *g->dist_pools * (size_t)(g->dist_npools + 1));
        p = &g->dist_pools[g->dist_npools++];
        *p = (struct mt_dist_pool){ .numel = numel,
                                    .h = calloc((size_t)MT_DIST_POOL_SLOTS * g->dist_size, sizeof *p->h),
                                    .mem = calloc((size_t)MT_DIST_POOL_SLOTS * g->dist_size, sizeof *p->mem) };
    }
    const int k = p->next;
    p->next = (p->next + 1) % MT_DIST_POOL_SLOTS;
    starpu_data_handle_t *slot = &p->h[k * g->dist_size];
    float **mem = &p->mem[k * g->dist_size];
    for (int r = 0; r < g->dist_size; r++) {
        if (r == g->dist_rank || slot[r]) continue;
        /* pinned where StarPU pins (a GPU is there): MPI reads and writes it as host memory */
        if (starpu_malloc((void **)&mem[r], sizeof(float) * (size_t)numel)) {
            fprintf(stderr, "megatrain: out of host memory for a gradient chunk from rank %d (%lld floats)\n", r,
                    (long long)numel);
            abort();
        }
        starpu_vector_data_register(&slot[r], STARPU_MAIN_RAM, (uintptr_t)mem[r], (uint32_t)numel, sizeof(float));
    }
    return slot;
}

void mt_step_dist_reduce(mt_graph *g, mt_tile *t)
{
    const int n = g->dist_size, me = g->dist_rank, o = owner(g, t->index);
    STARPU_ASSERT_MSG(t->nchunks < DIST_TAG_CHUNKS - 1, "tile %d has %d chunks: more than the tags hold", t->index,
                      t->nchunks);
    starpu_data_partition_submit(t->h_grad, t->nchunks, t->h_grad_chunk);
    struct starpu_data_descr *d = calloc((size_t)n, sizeof *d);
    for (int c = 0; c < t->nchunks; c++) {
        starpu_data_handle_t chunk = t->h_grad_chunk[c];
        const starpu_mpi_tag_t up = tag_of(t->index, c, 0);
        if (me != o) {
            mt_step_check_insert(starpu_mpi_isend_detached(chunk, o, up, MPI_COMM_WORLD, NULL, NULL), "gradient send");
            continue;
        }
        starpu_data_handle_t *slot = next_slot(g, t->chunks[c].numel);
        for (int r = 0; r < n; r++) {
            if (r == me) {
                d[r] = (struct starpu_data_descr){ chunk, STARPU_RW };
                continue;
            }
            mt_step_check_insert(starpu_mpi_irecv_detached(slot[r], r, up, MPI_COMM_WORLD, NULL, NULL),
                                 "gradient receive");
            d[r] = (struct starpu_data_descr){ slot[r], STARPU_R };
        }
        const mt_grad_sum_args a = { .own = me };
        mt_step_check_insert(starpu_task_insert(&mt_cl_grad_sum, STARPU_DATA_MODE_ARRAY, d, n, STARPU_VALUE, &a, sizeof a,
                                                STARPU_EXECUTE_WHERE, STARPU_CPU, STARPU_PRIORITY, STARPU_MAX_PRIO,
                                                STARPU_NAME, "grad_sum", 0),
                             "grad_sum");
    }
    free(d);
    starpu_data_unpartition_submit(t->h_grad, t->nchunks, t->h_grad_chunk, STARPU_MAIN_RAM);
    if (g->sc.clip <= 0) return;
    if (me == o) {
        mt_step_insert_sumsq(g, t);
        for (int r = 0; r < n; r++)
            if (r != me)
                mt_step_check_insert(starpu_mpi_isend_detached(g->partial[t->index], r, sumsq_tag(t->index),
                                                               MPI_COMM_WORLD, NULL, NULL),
                                     "sum of squares send");
    } else {
        mt_step_check_insert(starpu_mpi_irecv_detached(g->partial[t->index], o, sumsq_tag(t->index), MPI_COMM_WORLD,
                                                       NULL, NULL),
                             "sum of squares receive");
    }
}

void mt_step_dist_send_weights(mt_graph *g, mt_tile *t, int c)
{
    for (int r = 0; r < g->dist_size; r++)
        if (r != g->dist_rank)
            mt_step_check_insert(starpu_mpi_isend_detached(t->h_weights_chunk[c], r, tag_of(t->index, c, 1),
                                                           MPI_COMM_WORLD, NULL, NULL),
                                 "updated weights send");
}

void mt_step_dist_receive_weights(mt_graph *g, mt_tile *t)
{
    const int o = owner(g, t->index);
    for (int c = 0; c < t->nchunks; c++)
        mt_step_check_insert(starpu_mpi_irecv_detached(t->h_weights_chunk[c], o, tag_of(t->index, c, 1), MPI_COMM_WORLD,
                                                       NULL, NULL),
                             "updated weights receive");
}

void mt_step_dist_free(mt_graph *g)
{
    for (int i = 0; i < g->dist_npools; i++) {
        struct mt_dist_pool *p = &g->dist_pools[i];
        for (int k = 0; k < MT_DIST_POOL_SLOTS * g->dist_size; k++)
            if (p->h[k]) {
                starpu_data_unregister(p->h[k]);
                starpu_free_noflag(p->mem[k], sizeof(float) * (size_t)p->numel);
            }
        free(p->h);
        free(p->mem);
    }
    free(g->dist_pools);
    g->dist_pools = NULL;
    g->dist_npools = 0;
}
