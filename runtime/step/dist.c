/* A tile's gradient summed over the ranks of a distributed run (runtime/dist.h), inside the step
 * graph, through StarPU-MPI's detached sends and receives (ordered with the tasks by the data
 * they access, like tasks): tile t's owner, rank t mod N, receives every other rank's gradient,
 * sums them in rank order (codelets/reduce.h) and sends the sum back; every rank then holds the
 * same bits, takes the same sum of squares for the norm and applies the same update. The owner
 * keeps one receive buffer per other rank for each tile it owns: (N - 1) / N x 4 bytes per
 * parameter on average. */
#include "runtime/step/graph.h"

#include <starpu_mpi.h>
#include <stdio.h>
#include <stdlib.h>

#include "codelets/reduce.h"
#include "runtime/dist.h"

/* Tags of tile t's messages: its gradients up to the owner, the sum back down. Each pair of
 * ranks exchanges them in step order (MPI keeps the order of one tag between two ranks). */
static starpu_mpi_tag_t tag_up(int t) { return (starpu_mpi_tag_t)2 * t; }
static starpu_mpi_tag_t tag_down(int t) { return (starpu_mpi_tag_t)2 * t + 1; }

/* Owner rank of tile t. */
static int owner(const mt_graph *g, int t) { return t % g->dist_size; }

/* The owner's receive buffer of tile t for rank r, registered on first use. */
static starpu_data_handle_t recv_buffer(mt_graph *g, const mt_tile *t, int r)
{
    const size_t k = (size_t)t->index * g->dist_size + r;
    if (!g->dist_recv[k]) {
        /* pinned where StarPU pins (a GPU is there): MPI reads and writes it as host memory */
        if (starpu_malloc((void **)&g->dist_recv_mem[k], sizeof(float) * (size_t)t->numel)) {
            fprintf(stderr, "megatrain: out of host memory for tile %d's gradient from rank %d (%lld floats)\n",
                    t->index, r, (long long)t->numel);
            abort();
        }
        starpu_vector_data_register(&g->dist_recv[k], STARPU_MAIN_RAM, (uintptr_t)g->dist_recv_mem[k],
                                    (uint32_t)t->numel, sizeof(float));
    }
    return g->dist_recv[k];
}

void mt_step_dist_reduce(mt_graph *g, mt_tile *t)
{
    const int n = g->dist_size, me = g->dist_rank, o = owner(g, t->index);
    starpu_data_handle_t grad = t->h_grad;
    if (me != o) {
        mt_step_check_insert(starpu_mpi_isend_detached(grad, o, tag_up(t->index), MPI_COMM_WORLD, NULL, NULL),
                             "gradient send");
        mt_step_check_insert(starpu_mpi_irecv_detached(grad, o, tag_down(t->index), MPI_COMM_WORLD, NULL, NULL),
                             "gradient sum receive");
    } else {
        struct starpu_data_descr *d = calloc((size_t)n, sizeof *d);
        for (int r = 0; r < n; r++) {
            if (r == me) {
                d[r] = (struct starpu_data_descr){ grad, STARPU_RW };
                continue;
            }
            starpu_data_handle_t b = recv_buffer(g, t, r);
            mt_step_check_insert(starpu_mpi_irecv_detached(b, r, tag_up(t->index), MPI_COMM_WORLD, NULL, NULL),
                                 "gradient receive");
            d[r] = (struct starpu_data_descr){ b, STARPU_R };
        }
        const mt_grad_sum_args a = { .own = me };
        mt_step_check_insert(starpu_task_insert(&mt_cl_grad_sum, STARPU_DATA_MODE_ARRAY, d, n, STARPU_VALUE, &a, sizeof a,
                                                STARPU_EXECUTE_WHERE, STARPU_CPU, STARPU_PRIORITY, STARPU_MAX_PRIO,
                                                STARPU_NAME, "grad_sum", 0),
                             "grad_sum");
        free(d);
        for (int r = 0; r < n; r++)
            if (r != me)
                mt_step_check_insert(starpu_mpi_isend_detached(grad, r, tag_down(t->index), MPI_COMM_WORLD, NULL, NULL),
                                     "gradient sum send");
    }
    if (g->sc.clip > 0)
        mt_step_check_insert(starpu_task_insert(&mt_cl_grad_sumsq, STARPU_R, grad, STARPU_W, g->partial[t->index],
                                                STARPU_EXECUTE_WHERE, STARPU_CPU, STARPU_PRIORITY, STARPU_MAX_PRIO,
                                                STARPU_NAME, "grad_sumsq", 0),
                             "grad_sumsq");
}

void mt_step_dist_free(mt_graph *g)
{
    if (!g->dist_recv) return;
    for (size_t k = 0; k < (size_t)g->st->ntiles * g->dist_size; k++)
        if (g->dist_recv[k]) {
            starpu_data_unregister(g->dist_recv[k]);
            starpu_free_noflag(g->dist_recv_mem[k], sizeof(float) * (size_t)g->st->tiles[k / g->dist_size].numel);
        }
    free(g->dist_recv);
    free(g->dist_recv_mem);
}
