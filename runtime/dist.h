/* Data parallelism across processes: the process group a run was launched in by mpirun (or any
 * launcher that sets the usual MPI environment), MPI and StarPU-MPI started together, and the
 * few collective values the training loop needs. Every rank holds every tile's streamed weights
 * and gradient, and the master and AdamW moments of the tiles it owns (a sharded host state,
 * runtime/state.h); each tile's gradient is summed over the ranks into its owner, which updates
 * the tile and sends the new weights to every rank, inside the step graph (runtime/step/dist.c). */
#ifndef MT_RUNTIME_DIST_H
#define MT_RUNTIME_DIST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <starpu.h>

#include "runtime/state.h"

/* The owner of a tile receives each other rank's gradient chunk by chunk into pools of this many
 * buffers per chunk size and rank, used in turn (runtime/step/dist.c; runtime/plan.c counts them). */
#define MT_DIST_POOL_SLOTS 4

/* Whether this process was launched as one of several ranks (read from the launcher's
 * environment: OMPI_COMM_WORLD_SIZE, PMI_SIZE, ...), before anything starts. */
bool mt_dist_launched(void);
/* The launcher's count of ranks (1 when not launched), before anything starts. */
int mt_dist_launched_size(void);
/* The launcher's count of ranks on this node and this rank's place among them (1 and 0 when not
 * launched), before anything starts: for the CPU workers' share of the cores and the GPU. */
int mt_dist_local_size(void);
int mt_dist_local_rank(void);

/* Every tile's streamed weights from its owner to every rank (MPI_Bcast): after a sharded state
 * (runtime/state.h) was loaded from the ranks' checkpoints, where each rank read only its own
 * tiles. Collective; no task may be in flight. 0, or -1 with err set. */
int mt_dist_share_weights(mt_host_state *st, char *err, size_t errlen);
/* The fp32 master of every tile into rank 0, which allocates it for the tiles it does not hold
 * (4 bytes per parameter of those, until the state is destroyed): for what reads every master
 * many times there (the byte-level model's sample). Collective; no task may be in flight. */
int mt_dist_gather_masters(mt_host_state *st, char *err, size_t errlen);
/* Rank 0 reads the masters it does not hold one tile at a time, each sent by its owner when rank
 * 0's mt_state_master_f32 asks for it (for the model's save and the weights' hash, which read a
 * tile through before the next): on rank 0 this sets st->remote_master and returns; on every
 * other rank it serves rank 0's requests and returns once rank 0 calls mt_dist_masters_close.
 * Rank 0 then holds one tile's master at a time, not every other rank's. Collective; no task
 * may be in flight, and rank 0 must make no other collective call until it closes. 0, or -1
 * with err set. */
int mt_dist_masters_open(mt_host_state *st, char *err, size_t errlen);
/* Rank 0: ends what mt_dist_masters_open started (the other ranks return from it); nothing when
 * it is not open, or on the other ranks. */
void mt_dist_masters_close(mt_host_state *st);

/* Starts MPI (MPI_THREAD_MULTIPLE: the submitting thread's collectives below run beside
 * StarPU-MPI's progress thread) and StarPU-MPI with `conf` in place of starpu_init. 0, or -1
 * with err set. mt_dist_shutdown stops both; MPI cannot start twice in one process. */
int mt_dist_start(struct starpu_conf *conf, char *err, size_t errlen);
void mt_dist_shutdown(void);
/* Whether mt_dist_start ran (and mt_dist_shutdown not yet). */
bool mt_dist_running(void);

/* This rank and the number of ranks: 0 and 1 unless running. */
int mt_dist_rank(void);
int mt_dist_size(void);

/* The sum over the ranks of `mine` (exact). Collective: every rank calls it in the same order. */
int64_t mt_dist_sum_i64(int64_t mine);
/* The largest over the ranks of `mine`. Collective. */
int64_t mt_dist_max_i64(int64_t mine);
/* sum[i] = the sum over ranks 0, 1, ... in that order of each rank's mine[i]: the same bits on
 * every rank. Collective. */
void mt_dist_sum_f64(const double *mine, double *sum, int n);
/* Whether every rank passed the same bytes (the settings a run must share); when not, -1 with
 * err naming `what` and the first rank that differs from rank 0. Collective. */
int mt_dist_check_same(const char *what, const void *bytes, size_t n, char *err, size_t errlen);

#endif
