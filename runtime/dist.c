/* The process group (runtime/dist.h): MPI and StarPU-MPI started together, and collectives of a
 * few values through MPI itself. */
#include "runtime/dist.h"

#include <mpi.h>
#include <starpu_mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/util.h"

static bool running;
static int rank, size = 1;
/* MPI_COMM_WORLD's duplicate for the messages outside the step graph (mt_dist_share_weights,
 * mt_dist_gather_masters): StarPU-MPI's own traffic is on MPI_COMM_WORLD. */
static MPI_Comm side = MPI_COMM_NULL;

/* The first of the launchers' variables that is set, as a positive integer; else `fallback`. */
static int env_int(const char *const *names, int fallback)
{
    for (int i = 0; names[i]; i++) {
        const char *v = getenv(names[i]);
        char *end;
        long n = v ? strtol(v, &end, 10) : -1;
        if (v && *v && !*end && n >= 0 && n < (1 << 20)) return (int)n;
    }
    return fallback;
}

static const char *const size_vars[] = { "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE", NULL };
static const char *const local_size_vars[] = { "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE",
                                               NULL };
static const char *const local_rank_vars[] = { "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", NULL };

bool mt_dist_launched(void) { return env_int(size_vars, 1) > 1; }
int mt_dist_launched_size(void) { return mt_dist_launched() ? env_int(size_vars, 1) : 1; }
int mt_dist_local_size(void) { return mt_dist_launched() ? env_int(local_size_vars, 1) : 1; }
int mt_dist_local_rank(void) { return mt_dist_launched() ? env_int(local_rank_vars, 0) : 0; }

int mt_dist_start(struct starpu_conf *conf, char *err, size_t errlen)
{
    int inited = 0, finalized = 0;
    MPI_Initialized(&inited);
    MPI_Finalized(&finalized);
    if (finalized) {
        snprintf(err, errlen, "MPI was already finalized in this process: a distributed run starts once");
        return -1;
    }
    int provided = 0;
    if (!inited && MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) {
        snprintf(err, errlen, "MPI_Init_thread failed");
        return -1;
    }
    if (inited) MPI_Query_thread(&provided);
    if (provided < MPI_THREAD_MULTIPLE) {
        snprintf(err, errlen, "the MPI library gives thread level %d, not MPI_THREAD_MULTIPLE (%d): the training loop's "
                 "collectives run beside StarPU-MPI's progress thread", provided, MPI_THREAD_MULTIPLE);
        return -1;
    }
    int ret = starpu_mpi_init_conf(NULL, NULL, 0, MPI_COMM_WORLD, conf);
    if (ret != 0) {
        snprintf(err, errlen, "starpu_mpi_init_conf failed (%d)", ret);
        return -1;
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Comm_dup(MPI_COMM_WORLD, &side);
    running = true;
    return 0;
}

void mt_dist_shutdown(void)
{
    if (!running) return;
    starpu_mpi_shutdown();
    if (side != MPI_COMM_NULL) MPI_Comm_free(&side);
    MPI_Finalize();
    running = false;
    rank = 0;
    size = 1;
}

bool mt_dist_running(void) { return running; }
int mt_dist_rank(void) { return rank; }
int mt_dist_size(void) { return size; }

int64_t mt_dist_sum_i64(int64_t mine)
{
    if (!running) return mine;
    long long in = mine, out = 0;
    MPI_Allreduce(&in, &out, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
    return out;
}

int64_t mt_dist_max_i64(int64_t mine)
{
    if (!running) return mine;
    long long in = mine, out = 0;
    MPI_Allreduce(&in, &out, 1, MPI_LONG_LONG, MPI_MAX, MPI_COMM_WORLD);
    return out;
}

void mt_dist_sum_f64(const double *mine, double *sum, int n)
{
    if (!running) {
        memcpy(sum, mine, sizeof *sum * (size_t)n);
        return;
    }
    /* Gathered, then summed here in rank order: MPI_Allreduce may sum in another order per rank. */
    double *all = malloc(sizeof *all * (size_t)n * (size_t)size);
    MPI_Allgather(mine, n, MPI_DOUBLE, all, n, MPI_DOUBLE, MPI_COMM_WORLD);
    for (int i = 0; i < n; i++) {
        double s = all[i];
        for (int r = 1; r < size; r++) s += all[(size_t)r * n + i];
        sum[i] = s;
    }
    free(all);
}

int mt_dist_check_same(const char *what, const void *bytes, size_t n, char *err, size_t errlen)
{
    if (!running) return 0;
    unsigned long long mine = mt_fnv1a64(MT_FNV1A64_START, bytes, n), *all = malloc(sizeof *all * (size_t)size);
    MPI_Allgather(&mine, 1, MPI_UNSIGNED_LONG_LONG, all, 1, MPI_UNSIGNED_LONG_LONG, MPI_COMM_WORLD);
    int differs = -1;
    for (int r = 1; r < size && differs < 0; r++)
        if (all[r] != all[0]) differs = r;
    free(all);
    if (differs < 0) return 0;
    snprintf(err, errlen, "rank %d of %d was started with other %s than rank 0: every rank must run the same command",
             differs, size, what);
    return -1;
}

/* MPI counts are ints: large buffers go in pieces of at most this many bytes. */
#define PIECE_BYTES ((size_t)1 << 30)

int mt_dist_share_weights(mt_host_state *st, char *err, size_t errlen)
{
    if (!running || st->shard_ranks <= 1) return 0;
    const size_t esz = mt_dtype_size(st->compute_dtype);
    for (int i = 0; i < st->ntiles; i++) {
        mt_tile *t = &st->tiles[i];
        const size_t bytes = mt_layout_stream_bytes(t->layout, esz); /* the fp32 side included */
        for (size_t o = 0; o < bytes; o += PIECE_BYTES) {
            const size_t n = bytes - o < PIECE_BYTES ? bytes - o : PIECE_BYTES;
            if (MPI_Bcast((char *)t->weights + o, (int)n, MPI_BYTE, mt_state_owner(st, i), side) != MPI_SUCCESS) {
                snprintf(err, errlen, "sending tile %d's weights from rank %d failed", i, mt_state_owner(st, i));
                return -1;
            }
        }
    }
    return 0;
}

/* Tile `tile`'s fp32 master between its owner and rank 0 over the side communicator, in pieces
 * (MPI counts are ints). 0, or -1 with err set. */
static int move_master(const mt_host_state *st, int tile, float *master, char *err, size_t errlen)
{
    const int o = mt_state_owner(st, tile);
    const size_t bytes = (size_t)st->tiles[tile].numel * sizeof(float);
    for (size_t off = 0; off < bytes; off += PIECE_BYTES) {
        const int n = (int)(bytes - off < PIECE_BYTES ? bytes - off : PIECE_BYTES);
        const int rc = rank == o ? MPI_Send((char *)master + off, n, MPI_BYTE, 0, tile, side)
                                 : MPI_Recv((char *)master + off, n, MPI_BYTE, o, tile, side, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) {
            snprintf(err, errlen, "sending tile %d's master weights from rank %d to rank 0 failed", tile, o);
            return -1;
        }
    }
    return 0;
}

int mt_dist_gather_masters(mt_host_state *st, char *err, size_t errlen)
{
    if (!running || st->shard_ranks <= 1) return 0;
    /* rank 0 allocates every missing master first: a refusal then stops every rank before any send */
    int failed = 0;
    for (int i = 0; rank == 0 && i < st->ntiles && !failed; i++) {
        mt_tile *t = &st->tiles[i];
        if (!t->master && posix_memalign((void **)&t->master, 64, (size_t)t->numel * sizeof(float))) {
            t->master = NULL;
            failed = 1;
        }
    }
    if (mt_dist_max_i64(failed)) {
        snprintf(err, errlen, "out of host memory on rank 0 gathering the other ranks' master weights (4 bytes per "
                              "parameter of their tiles) for the model");
        return -1;
    }
    for (int i = 0; i < st->ntiles; i++) {
        const int o = mt_state_owner(st, i);
        if (o == 0 || (rank != 0 && rank != o)) continue;
        if (move_master(st, i, st->tiles[i].master, err, errlen)) return -1;
    }
    return 0;
}

/* Rank 0's st->remote_master: the tile's number to every rank, then its master from the owner. */
static int fetch_master(const mt_host_state *st, int tile, float *dst)
{
    char err[256];
    int32_t ask = tile;
    if (MPI_Bcast(&ask, 1, MPI_INT32_T, 0, side) != MPI_SUCCESS) {
        fprintf(stderr, "megatrain: asking for tile %d's master weights failed\n", tile);
        return -1;
    }
    if (move_master(st, tile, dst, err, sizeof err)) {
        fprintf(stderr, "megatrain: %s\n", err);
        return -1;
    }
    return 0;
}

int mt_dist_masters_open(mt_host_state *st, char *err, size_t errlen)
{
    if (!running || st->shard_ranks <= 1) return 0;
    if (rank == 0) {
        st->remote_master = fetch_master;
        return 0;
    }
    for (;;) {
        int32_t ask;
        if (MPI_Bcast(&ask, 1, MPI_INT32_T, 0, side) != MPI_SUCCESS) {
            snprintf(err, errlen, "rank %d: waiting for rank 0's requests of master weights failed", rank);
            return -1;
        }
        if (ask < 0) return 0;
        if (ask >= st->ntiles) {
            snprintf(err, errlen, "rank %d: rank 0 asked for tile %d's master weights, of %d tiles", rank, (int)ask,
                     st->ntiles);
            return -1;
        }
        if (mt_state_owner(st, ask) == rank && move_master(st, ask, st->tiles[ask].master, err, errlen)) return -1;
    }
}

void mt_dist_masters_close(mt_host_state *st)
{
    if (!st || !st->remote_master) return;
    st->remote_master = NULL;
    int32_t done = -1;
    MPI_Bcast(&done, 1, MPI_INT32_T, 0, side);
}
