/* The memory plan: byte counts per kind of buffer, host and GPU, from the config and the run's
 * shape, before anything is allocated. The host side mirrors how state.c allocates tiles (one
 * 4 KiB-rounded allocation per kind per tile); the GPU side mirrors what the scheduling policy lets
 * be resident at once (double-buffered weights and gradients, one block of activations). */
#include "runtime/plan.h"

#include <dirent.h>
#include <errno.h>
#include <hwloc.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backends/cpu/ranged_flags.h"
#include "codelets/common.h"
#include "models/layout.h"
#include "mt_build_config.h"
#include "runtime/dist.h"
#include "runtime/state.h"
#if MT_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

static int plan_fail(mt_plan *plan, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(plan->error, sizeof plan->error, fmt, ap);
    va_end(ap);
    return -1;
}

static uint64_t round_up_u64(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

/* a * b, or sets *overflow; the inputs come from user-chosen B and T, which are not bounded by
 * the config's validation. */
static uint64_t mul(uint64_t a, uint64_t b, bool *overflow)
{
    uint64_t r;
    if (__builtin_mul_overflow(a, b, &r)) *overflow = true;
    return r;
}

static uint64_t add(uint64_t a, uint64_t b, bool *overflow)
{
    uint64_t r;
    if (__builtin_add_overflow(a, b, &r)) *overflow = true;
    return r;
}

/* Bytes of one kind of host state over all tiles: each tile its own allocation, 4 KiB-rounded. */
/* One host tile of numel elements of elem bytes, as state.c allocates it. */
static uint64_t tile_bytes(int64_t numel, uint64_t elem)
{
    return round_up_u64((uint64_t)numel * elem, MT_PLAN_TILE_BYTES_ALIGN);
}

static uint64_t host_state_bytes(const mt_plan *plan, uint64_t elem)
{
    uint64_t embed = tile_bytes(plan->tile_numel[MT_TILE_EMBED], elem), layer = tile_bytes(plan->tile_numel[MT_TILE_LAYER], elem);
    uint64_t dense = tile_bytes(plan->dense_layer_numel, elem), head = tile_bytes(plan->tile_numel[MT_TILE_HEAD], elem);
    return embed + (uint64_t)(plan->num_tiles - 2 - plan->dense_layers) * layer + (uint64_t)plan->dense_layers * dense + head;
}

/* The bytes of the streamed copy of a tile of layout `lay` (its fp32 norms too with norms_f32: the
 * layout is given them), counted into the plan's largest. */
static uint64_t note_stream_bytes(mt_plan *plan, mt_tile_layout *lay, bool norms_f32)
{
    if (norms_f32) mt_layout_keep_norms_f32(lay);
    const uint64_t bytes = mt_layout_stream_bytes(lay, (size_t)plan->weight_elem_bytes);
    if (bytes > plan->max_stream_bytes) plan->max_stream_bytes = bytes;
    return bytes;
}

/* Bytes of the streamed copies of every tile (every rank holds all of them), as state.c allocates them. */
static uint64_t host_stream_bytes(const mt_plan *plan)
{
    const uint64_t a = MT_PLAN_TILE_BYTES_ALIGN;
    const uint64_t sparse = (uint64_t)(plan->num_tiles - 2 - plan->dense_layers);
    return round_up_u64(plan->stream_bytes[MT_TILE_EMBED], a) + sparse * round_up_u64(plan->stream_bytes[MT_TILE_LAYER], a) +
           (uint64_t)plan->dense_layers * round_up_u64(plan->dense_stream_bytes, a) +
           round_up_u64(plan->stream_bytes[MT_TILE_HEAD], a);
}

/* The bytes of the tiles rank r of `ranks` owns (tile t: rank t mod ranks; runtime/state.h), at
 * elem bytes per element, for the largest rank's (only < 0) or rank `only`'s: what one rank of a
 * sharded state holds of the master and moments. ranks 1: every tile's (host_state_bytes). */
/* Bytes of layer tile i (1..L) at elem bytes per element: a sparse or a dense layer's. */
static uint64_t layer_tile_bytes(const mt_plan *plan, const mt_model_config *cfg, int64_t i, uint64_t elem)
{
    const bool sparse = plan->dense_layers == 0 || mt_config_layer_is_sparse(cfg, (int)(i - 1));
    return tile_bytes(sparse ? plan->tile_numel[MT_TILE_LAYER] : plan->dense_layer_numel, elem);
}

static uint64_t held_state_bytes(const mt_plan *plan, const mt_model_config *cfg, uint64_t elem, int64_t ranks,
                                 int64_t only)
{
    if (ranks <= 1) return host_state_bytes(plan, elem);
    const uint64_t embed = tile_bytes(plan->tile_numel[MT_TILE_EMBED], elem), layer = tile_bytes(plan->tile_numel[MT_TILE_LAYER], elem);
    const uint64_t head = tile_bytes(plan->tile_numel[MT_TILE_HEAD], elem);
    const int64_t L = plan->num_tiles - 2;
    uint64_t most = 0;
    for (int64_t r = only < 0 ? 0 : only; r < (only < 0 ? ranks : only + 1) && r < plan->num_tiles; r++) {
        uint64_t bytes = r == 0 ? embed : 0;
        if ((L + 1) % ranks == r) bytes += head;
        if (plan->dense_layers == 0) {
            /* layers 1..L whose index is r mod ranks */
            const int64_t first = r >= 1 ? r : ranks;
            if (first <= L) bytes += (uint64_t)((L - first) / ranks + 1) * layer;
        } else {
            for (int64_t i = r >= 1 ? r : ranks; i <= L; i += ranks) bytes += layer_tile_bytes(plan, cfg, i, elem);
        }
        if (bytes > most) most = bytes;
    }
    return most;
}

/* The largest fp32 master of a tile rank 0 does not own (tile t is rank t mod ranks'): what rank 0
 * holds at a time of the other ranks' masters while it saves the model (mt_dist_masters_open). */
static uint64_t largest_remote_master(const mt_plan *plan, const mt_model_config *cfg, int64_t ranks)
{
    const int64_t L = plan->num_tiles - 2;
    uint64_t most = (L + 1) % ranks ? tile_bytes(plan->tile_numel[MT_TILE_HEAD], 4) : 0;
    for (int64_t i = 1; i <= L; i++)
        if (i % ranks && layer_tile_bytes(plan, cfg, i, 4) > most) most = layer_tile_bytes(plan, cfg, i, 4);
    return most;
}

/* The process's costs beyond the state and the graph's buffers, from the peak resident set
 * (VmHWM) of `megatrain train` runs on the CPU workers of an x86-64 Debian 12 host (StarPU
 * 1.4.10, OpenBLAS 0.3.21, glibc 2.36, the CUDA 13 libraries linked), resident set read between
 * the stages of a run: docs/design.md, section 5.1, has the method and the figures. */
/* starpu_init: its tables, the main and helper threads, hwloc's topology; measured 4.5-4.9 MiB
 * with 1 and 2 CPU workers, the rest per worker (thread stack as touched, StarPU's per-worker
 * state and OpenBLAS's per-thread bookkeeping). */
#define STARPU_START_BYTES ((uint64_t)9 << 19)
#define STARPU_PER_CPU_WORKER_BYTES ((uint64_t)1 << 18)
/* A run over several ranks: MPI_Init_thread (Open MPI 4.1.4, shared-memory transport) measured
 * 10.9 MiB, starpu_mpi_init_conf 2.3 MiB past it, with 2 and 4 ranks on one host. */
#define MPI_START_BYTES ((uint64_t)27 << 19)
/* A CPU run's working set costs more than its buffers: the workers' OpenBLAS packing buffers
 * (one per thread, touched as far as the GEMMs' panels reach) and the allocator's pages around
 * the buffers StarPU allocates from the worker threads (train fixes glibc's mmap threshold, so
 * this part does not depend on thread timing). Measured from 3% (one worker, a small model) to
 * 46% (two workers, a head of 16384 rows) of the working set on top of it; a quarter keeps the
 * plan within 6% of every measured peak. */
#define CPU_ALLOCATOR_SLACK_PERCENT 25
/* With a GPU: the CUDA context's host side (the driver's allocations, the kernels of libcudart,
 * cuBLASLt and cuDNN loaded on first use) and StarPU's CUDA worker and its pinned staging; once per
 * device (an estimate there: measured with one).
 * Measured as `megatrain train`'s peak line less this plan's other rows, on an H200 host (driver
 * 580.159, Debian 12 userland): 264 MiB for the built-in byte-level model (16 x 128 tokens), 450
 * MiB for a Qwen2.5-0.5B at 4 x 2048 (where the plan's other rows are within 1% of the peak).
 * 288 MiB keeps both plans within 5% of their peaks (+4.6% and -1.4%). */
#define CUDA_CONTEXT_BYTES ((uint64_t)288 << 20)

/* Fills the process's rows (host only) of a plan whose state and working set are counted. */
static int count_process(mt_plan *plan, const uint64_t *work, uint64_t ntok)
{
    const mt_plan_params *p = &plan->params;
    const mt_plan_process *pr = &p->process;
    if (pr->ncpu < 1) return plan_fail(plan, "the process's plan needs at least one CPU worker, got %d", pr->ncpu);
    if (pr->eval_sequences < 0)
        return plan_fail(plan, "validation sequences must not be negative, got %" PRId64, pr->eval_sequences);
    bool of = false;
    plan->host[MT_PLAN_PROGRAM] = pr->program_bytes;
    plan->host[MT_PLAN_RUNTIME] = add(STARPU_START_BYTES, mul((uint64_t)pr->ncpu, STARPU_PER_CPU_WORKER_BYTES, &of), &of);
    if (p->ranks > 1) plan->host[MT_PLAN_RUNTIME] = add(plan->host[MT_PLAN_RUNTIME], MPI_START_BYTES, &of);
    if (!p->use_gpu) {
        /* every CPU worker may run a layer or the head, and keeps its scratch copies from then on */
        const uint64_t copies = mul((uint64_t)(pr->ncpu - 1), work[MT_PLAN_WORKSPACE], &of);
        uint64_t working = copies;
        for (int k = MT_PLAN_CHECKPOINTS; k <= MT_PLAN_GRAD_ACC; k++) working = add(working, work[k], &of);
        plan->host[MT_PLAN_CPU_SCRATCH] = add(copies, mul(working / 100, CPU_ALLOCATOR_SLACK_PERCENT, &of), &of);
    } else {
        /* a context and a CUDA worker per device */
        plan->host[MT_PLAN_CUDA] = mul(CUDA_CONTEXT_BYTES, (uint64_t)(p->devices > 1 ? p->devices : 1), &of);
    }
    /* the loop's step batch (tokens and targets, int32, accumulation x B x T) and its validation
     * windows (eval_sequences + B of them) beside the data itself */
    const uint64_t T = (uint64_t)p->seq_len;
    const uint64_t batch = mul(mul((uint64_t)p->grad_accum, ntok, &of), 8, &of);
    const uint64_t eval = mul(mul(add((uint64_t)pr->eval_sequences, (uint64_t)p->micro_batch, &of), T, &of), 8, &of);
    plan->host[MT_PLAN_DATA] = add(pr->data_bytes, add(batch, eval, &of), &of);
    if (of) return plan_fail(plan, "the process's byte counts overflow");
    return 0;
}

int mt_plan_compute(const mt_model_config *cfg, const mt_plan_params *params, mt_plan *plan)
{
    memset(plan, 0, sizeof *plan);
    plan->params = *params;
    mt_plan_params *p = &plan->params;
    char cfg_err[256];
    if (mt_config_validate(cfg, "config", cfg_err, sizeof cfg_err))
        return plan_fail(plan, "invalid model config: %s", cfg_err);
    if (p->micro_batch <= 0) return plan_fail(plan, "micro batch size must be positive, got %" PRId64, p->micro_batch);
    if (p->seq_len <= 0) return plan_fail(plan, "sequence length must be positive, got %" PRId64, p->seq_len);
    if (p->grad_accum <= 0)
        return plan_fail(plan, "gradient accumulation count must be positive, got %" PRId64, p->grad_accum);
    if (p->checkpoint_interval <= 0)
        return plan_fail(plan, "checkpoint interval K must be positive, got %" PRId64, p->checkpoint_interval);
    if (p->compute != MT_DTYPE_BF16 && p->compute != MT_DTYPE_F32)
        return plan_fail(plan, "unknown compute dtype %d", (int)p->compute);
    if (p->checkpoint_interval > cfg->layers) p->checkpoint_interval = cfg->layers;
    if (p->offload_checkpoints == MT_PLAN_OFFLOAD_AUTO) p->offload_checkpoints = MT_PLAN_OFFLOAD_OFF;
    if (p->offload_checkpoints != MT_PLAN_OFFLOAD_OFF && p->offload_checkpoints != MT_PLAN_OFFLOAD_ON)
        return plan_fail(plan, "checkpoint offload %d is not on (1), off (0) or auto (-1)", p->offload_checkpoints);
    if (p->layout != MT_LAYOUT_FULL && p->layout != MT_LAYOUT_COMPACT)
        return plan_fail(plan, "host layout %d is not full or compact (mt_plan_choose resolves auto)", (int)p->layout);
    const bool compact = p->layout == MT_LAYOUT_COMPACT;
    if (compact && p->compute != MT_DTYPE_BF16)
        return plan_fail(plan, "the compact host layout holds bf16 streamed weights only (its master's high half is "
                               "the bf16 weight); with fp32 weights use the full layout");

    bool of = false;
    const uint64_t L = (uint64_t)cfg->layers, K = (uint64_t)p->checkpoint_interval, d = (uint64_t)cfg->hidden;
    const uint64_t ntok = mul((uint64_t)p->micro_batch, (uint64_t)p->seq_len, &of);
    uint64_t step_tokens = mul(ntok, (uint64_t)p->grad_accum, &of);
    if (of || ntok > (uint64_t)1 << 40 || step_tokens > INT64_MAX)
        return plan_fail(plan, "%" PRId64 " x %" PRId64 " tokens per micro-batch is absurdly large",
                         p->micro_batch, p->seq_len);
    if (p->head_chunk < 0) return plan_fail(plan, "head chunk must be positive, got %" PRId64, p->head_chunk);
    if (p->head_chunk == 0)
        p->head_chunk = ntok < MT_PLAN_DEFAULT_HEAD_CHUNK ? (int64_t)ntok : MT_PLAN_DEFAULT_HEAD_CHUNK;
    if ((uint64_t)p->head_chunk > ntok) p->head_chunk = (int64_t)ntok;

    plan->tokens_per_step = (int64_t)step_tokens;
    plan->param_count = mt_config_param_count(cfg);
    plan->active_param_count = mt_config_active_param_count(cfg);
    plan->flops_params = mt_config_flops_params(cfg);
    plan->weight_elem_bytes = p->compute == MT_DTYPE_BF16 ? 2 : 4;
    /* bf16 weights stream their norms in fp32 too (runtime/state.c) */
    const bool norms_f32 = p->compute == MT_DTYPE_BF16;
    mt_tile_layout lay;
    for (int k = MT_TILE_EMBED; k <= MT_TILE_HEAD; k++) {
        mt_layout_build(cfg, (mt_tile_kind)k, &lay);
        plan->tile_numel[k] = lay.numel;
        if (lay.numel > plan->max_tile_numel) plan->max_tile_numel = lay.numel;
        plan->stream_bytes[k] = note_stream_bytes(plan, &lay, norms_f32);
    }
    plan->num_tiles = cfg->layers + 2;
    /* A model mixing dense and sparse layers: each host tile has its own layer's size (state.c),
     * the GPU buffers that of the larger. */
    plan->dense_layers = 0;
    plan->dense_layer_numel = 0;
    if (mt_layout_build_dense_layer(cfg, &lay)) {
        plan->dense_layers = cfg->layers - mt_config_sparse_layers(cfg);
        plan->dense_layer_numel = lay.numel;
        if (lay.numel > plan->max_tile_numel) plan->max_tile_numel = lay.numel;
        plan->dense_stream_bytes = note_stream_bytes(plan, &lay, norms_f32);
    }
    plan->num_checkpoints = (int64_t)((L + K - 1) / K);

    /* Host state: always on the host, pinned when a GPU will copy from it (without a GPU,
     * starpu_malloc returns ordinary memory anyway). The config's validation bounds the
     * parameter count far enough that these products cannot overflow. */
    plan->host[MT_PLAN_WEIGHTS] = host_stream_bytes(plan);
    /* over several ranks the state is sharded: the master and moments of a rank's own tiles */
    const int64_t ranks = p->ranks > 1 ? p->ranks : 1;
    plan->host[MT_PLAN_MASTER] = held_state_bytes(plan, cfg, compact ? 2 : 4, ranks, -1);
    plan->host[MT_PLAN_GRADS] = host_state_bytes(plan, compact ? 2 : 4);
    plan->host[MT_PLAN_ADAM_M] = held_state_bytes(plan, cfg, 4, ranks, -1);
    plan->host[MT_PLAN_ADAM_V] = held_state_bytes(plan, cfg, 4, ranks, -1);
    /* compact pins only what a GPU copies (state.c): the weights and the gradient */
    for (int k = MT_PLAN_WEIGHTS; k <= MT_PLAN_ADAM_V; k++)
        plan->host_pinned[k] = p->use_gpu && (!compact || k == MT_PLAN_WEIGHTS || k == MT_PLAN_GRADS);
    /* the ranged flags buffers (runtime/speculate: mt_ranged_flags_bytes, a bit per element and
     * room for the inputs of 1/16 of them), counted per tile, not per AdamW chunk: each chunk
     * past a tile's first has its own header and 16 more entries, a few hundred bytes, left out */
    plan->host_clip_flags = 0;
    for (int t = MT_TILE_EMBED; t <= MT_TILE_HEAD; t++) {
        const uint64_t bytes = mt_ranged_flags_bytes(plan->tile_numel[t], MT_RANGED_SIDE_ROOM_DEFAULT);
        plan->host_clip_flags += t == MT_TILE_LAYER ? (uint64_t)(plan->num_tiles - 2 - plan->dense_layers) * bytes : bytes;
    }
    if (plan->dense_layers)
        plan->host_clip_flags += (uint64_t)plan->dense_layers *
                                 mt_ranged_flags_bytes(plan->dense_layer_numel, MT_RANGED_SIDE_ROOM_DEFAULT);
    /* state.c's mt_state_enable_grad_alt: every tile (the table's moments are deferred too) */
    plan->host_grad_alt = compact ? 0 : host_state_bytes(plan, 4);

    /* Working set: where the layers compute, one entry per buffer the step graph registers
     * (runtime/step/graph.c), sized by the same functions for the kind of worker that computes.
     * A CPU-only run reads and writes the host tiles in place, so it needs no weight or gradient
     * buffers. */
    uint64_t work[MT_PLAN_KIND_COUNT] = {0};
    if (p->use_gpu) {
        /* Double buffering: the tile computing and the next one streaming in, neither larger
         * than the largest tile. The decoder layers' weight handles share one allocsize, so
         * StarPU recycles an evicted layer's buffer for the next (runtime/state.c); embedding
         * and head are registered at their own sizes. */
        work[MT_PLAN_WEIGHTS] = mul(2, plan->max_stream_bytes, &of);
        /* The gradient being written and the one draining to the host: fp32, or in the compact
         * layout bf16 (the accumulators are apart). */
        work[MT_PLAN_GRADS] = compact ? mul(2, plan->max_stream_bytes, &of) /* registered at the weights' size */
                                      : mul(2 * (uint64_t)plan->max_tile_numel, 4, &of);
    }
    /* Over several GPUs, devices 1..n-1's fp32 copies of the gradients live as the compact
     * layout's accumulators do, from a tile's first contribution to its sum (runtime/step/graph.c,
     * alloc_device_grads): counted alike, per device, in either layout. */
    const bool device_copies = p->use_gpu && p->devices > 1;
    if (compact || device_copies) {
        /* The fp32 accumulators alive at once (runtime/step/compute.c): a tile's lives from its
         * first contribution in the step to its grad_home. The table's, when tied, through the
         * whole backward (the head writes it first); in the loss anchor, the head's; in the
         * backward, with several micro-batches on the device, a block's K layers together (one
         * layer otherwise) and one more being converted; at the end, the table's with layer 0's
         * being converted. Without a GPU, StarPU allocates them in host memory. */
        const uint64_t E = (uint64_t)plan->tile_numel[MT_TILE_EMBED], Ly = (uint64_t)mt_layout_largest_layer_numel(cfg);
        const uint64_t H = (uint64_t)plan->tile_numel[MT_TILE_HEAD], n = mt_plan_device_micro_batches(p) > 1 ? K : 1;
        const uint64_t anchor = (cfg->tied ? E : 0) + H, backward = (cfg->tied ? E : 0) + (n + 1) * Ly, table = E + Ly;
        uint64_t most = anchor > backward ? anchor : backward;
        if (table > most) most = table;
        work[MT_PLAN_GRAD_ACC] = mul(most, 4, &of);
        /* with a GPU the table's has its own host home too, pinned: the CPU embedding backward
         * writes it (runtime/state.c) */
        if (compact && p->use_gpu) {
            plan->host[MT_PLAN_GRAD_ACC] = mul(E, 4, &of);
            plan->host_pinned[MT_PLAN_GRAD_ACC] = true;
        }
    }
    /* The per-layer sizes below multiply B*T by the widest activation row; refuse sizes whose
     * products would not fit before computing them. */
    const double row = (double)(2 * d + 2 * (uint64_t)cfg->heads * (uint64_t)cfg->head_dim +
                                2 * (uint64_t)cfg->kv_heads * (uint64_t)cfg->head_dim + 3 * (uint64_t)cfg->intermediate +
                                (uint64_t)cfg->vocab + (uint64_t)cfg->heads + 8);
    if ((double)ntok * row * 16.0 > 0x1p62)
        return plan_fail(plan, "%" PRId64 " x %" PRId64 " tokens per micro-batch is absurdly large", p->micro_batch,
                         p->seq_len);
    /* Every micro-batch keeps its own checkpoints, ping-pong activations and inputs: the graph
     * passes all micro-batches through a layer while its weights are resident (runtime/step/). The
     * residual stream (checkpoints, activations, their gradients) is fp32 on every worker. Over
     * several GPUs a GPU holds its own micro-batches' (u mod devices), the host every one's. */
    const uint64_t mb = (uint64_t)p->grad_accum, hidden = mul(mul(ntok, d, &of), 4, &of);
    const uint64_t mb_here = p->use_gpu ? (uint64_t)mt_plan_device_micro_batches(p) : mb;
    work[MT_PLAN_CHECKPOINTS] = mul(mb_here, mul((uint64_t)plan->num_checkpoints, hidden, &of), &of);
    work[MT_PLAN_BLOCK_SAVED] =
        mul(K, mt_plan_byte_buffer(mt_codelet_layer_saved_bytes(cfg, p->compute, p->use_gpu, p->micro_batch, p->seq_len)), &of);
    work[MT_PLAN_ACT_GRADS] = mul(mb_here, mul(4, hidden, &of), &of);
    work[MT_PLAN_WORKSPACE] =
        add(mt_plan_byte_buffer(mt_codelet_layer_scratch_bytes(cfg, p->compute, p->use_gpu, p->micro_batch, p->seq_len)),
            mt_plan_byte_buffer(mt_codelet_head_scratch_bytes(cfg, p->compute, p->use_gpu, p->head_chunk)), &of);
    /* Two slots (step s+1 is filled while step s runs) of tokens and targets per micro-batch,
     * and one micro-batch for evaluation. */
    work[MT_PLAN_INPUTS] = mul(add(mul(2, mb, &of), 1, &of), mul(2 * 4, ntok, &of), &of);
    if (of) return plan_fail(plan, "B=%" PRId64 " x T=%" PRId64 " makes the activation byte counts overflow",
                             p->micro_batch, p->seq_len);

    for (int k = MT_PLAN_CHECKPOINTS; k < MT_PLAN_KIND_COUNT; k++) {
        if (p->use_gpu) plan->gpu[k] = work[k];
        else plan->host[k] = work[k];
    }
    plan->gpu[MT_PLAN_WEIGHTS] = work[MT_PLAN_WEIGHTS];
    plan->gpu[MT_PLAN_GRADS] = work[MT_PLAN_GRADS];
    /* Offloaded, every checkpoint but the last block's has a pinned host home, and the GPU holds
     * those in flight only. Without a GPU they are in host memory either way, as counted. */
    if (p->use_gpu) {
        plan->gpu_checkpoints = plan->num_checkpoints * (int64_t)mb_here;
        if (p->offload_checkpoints == MT_PLAN_OFFLOAD_ON) {
            plan->gpu_checkpoints = mt_plan_offload_in_flight(plan->num_checkpoints, (int64_t)mb_here);
            plan->host_checkpoints = (plan->num_checkpoints - 1) * p->grad_accum;
            plan->host[MT_PLAN_CHECKPOINTS] = mul((uint64_t)plan->host_checkpoints, hidden, &of);
            plan->host_pinned[MT_PLAN_CHECKPOINTS] = true;
        }
        plan->gpu[MT_PLAN_CHECKPOINTS] = mul((uint64_t)plan->gpu_checkpoints, hidden, &of);
        /* each micro-batch's dh0 has a pinned host home too, which the table's CPU backward reads;
         * the other activations' homes are plain memory that only an eviction from the GPU writes
         * (runtime/step/graph.c, alloc_homes), not counted */
        plan->host[MT_PLAN_ACT_GRADS] = mul(mb, hidden, &of);
        plan->host_pinned[MT_PLAN_ACT_GRADS] = true;
    }
    /* Tokens and targets start on the host in every run; with a GPU they are pinned staging
     * buffers copied over each micro-batch. */
    plan->host[MT_PLAN_INPUTS] = work[MT_PLAN_INPUTS];
    plan->host_pinned[MT_PLAN_INPUTS] = p->use_gpu;
    /* The flags buffers: plain host memory, only CPU tasks touch them (runtime/speculate); a run
     * over several ranks does not speculate */
    plan->host[MT_PLAN_CLIP_FLAGS] =
        !compact && ranks == 1 && p->devices <= 1 && p->use_gpu && p->compute == MT_DTYPE_BF16 ? plan->host_clip_flags : 0;
    if (ranks > 1) {
        /* runtime/step/dist.c's pools: MT_DIST_POOL_SLOTS fp32 buffers per other rank for each
         * distinct size of the AdamW chunks (train's chunk size) of every kind of tile */
        int64_t sizes[512];
        int nsizes = 0;
        mt_tile_layout kinds[4];
        int nkinds = 0;
        for (int k = MT_TILE_EMBED; k <= MT_TILE_HEAD; k++) mt_layout_build(cfg, (mt_tile_kind)k, &kinds[nkinds++]);
        if (mt_layout_build_dense_layer(cfg, &kinds[nkinds])) nkinds++;
        uint64_t per_rank = 0;
        for (int k = 0; k < nkinds; k++) {
            mt_chunk *chunks;
            const int n = mt_state_build_chunks(&kinds[k], MT_STATE_CHUNK_NUMEL_DEFAULT, &chunks);
            for (int c = 0; c < n; c++) {
                int i = 0;
                while (i < nsizes && sizes[i] != chunks[c].numel) i++;
                if (i < nsizes || nsizes == (int)(sizeof sizes / sizeof sizes[0])) continue;
                sizes[nsizes++] = chunks[c].numel;
                per_rank = add(per_rank, (uint64_t)chunks[c].numel, &of);
            }
            free(chunks);
        }
        plan->host[MT_PLAN_RANK_RECV] = mul(mul(per_rank, (uint64_t)(ranks - 1) * MT_DIST_POOL_SLOTS, &of), 4, &of);
        plan->host_pinned[MT_PLAN_RANK_RECV] = p->use_gpu;
        plan->host[MT_PLAN_GATHERED] = p->gather_masters ? host_state_bytes(plan, 4) - held_state_bytes(plan, cfg, 4, ranks, 0)
                                                         : largest_remote_master(plan, cfg, ranks);
    }

    /* Devices 1..n-1's fp32 copies of the gradients (runtime/step/graph.c, alloc_device_grads): on
     * CPU workers a home of host memory for every tile's; on GPUs no home, each device's living
     * among its gradient buffers above, and a device that sums receiving one copy of a tile at a
     * time (runtime/step/compute.c, gradient_done; two tiles' summing at once, as two gradients
     * are in flight). */
    if (p->devices > 1 && p->use_gpu) plan->gpu[MT_PLAN_DEVICE_GRADS] = mul(2 * (uint64_t)plan->max_tile_numel, 4, &of);
    else if (p->devices > 1) plan->host[MT_PLAN_DEVICE_GRADS] = mul(host_state_bytes(plan, 4), (uint64_t)(p->devices - 1), &of);

    if (p->process.counted && count_process(plan, work, ntok)) return -1;

    for (int k = 0; k < MT_PLAN_KIND_COUNT; k++) {
        plan->host_total = add(plan->host_total, plan->host[k], &of);
        if (plan->host_pinned[k]) plan->host_pinned_total = add(plan->host_pinned_total, plan->host[k], &of);
        plan->gpu_total = add(plan->gpu_total, plan->gpu[k], &of);
    }
    if (p->use_gpu) {
        /* floor(gpu_total * percent / 100) without the product's overflow */
        plan->gpu_margin = add(plan->gpu_total / 100 * MT_PLAN_GPU_MARGIN_PERCENT +
                                   plan->gpu_total % 100 * MT_PLAN_GPU_MARGIN_PERCENT / 100,
                               MT_PLAN_GPU_MARGIN_BYTES, &of);
        plan->gpu_context = MT_PLAN_GPU_CONTEXT_BYTES;
        plan->gpu_need = add(add(plan->gpu_total, plan->gpu_margin, &of), plan->gpu_context, &of);
    }
    if (of) return plan_fail(plan, "the totals overflow 64-bit byte counts");
    return 0;
}

const char *mt_format_bytes(uint64_t bytes, char *buf, size_t len)
{
    static const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    double v = (double)bytes;
    int u = 0;
    while (v >= 1024.0 && u < 6) {
        v /= 1024.0;
        u++;
    }
    if (u == 0) snprintf(buf, len, "%" PRIu64 " B", bytes);
    else snprintf(buf, len, "%.2f %s", v, units[u]);
    return buf;
}

/* Bytes per parameter of a host total. */
static double per_parameter(uint64_t bytes, const mt_plan *plan)
{
    return plan->param_count ? (double)bytes / (double)plan->param_count : 0.0;
}

static const char *kind_name(int k, const mt_plan *plan)
{
    if (plan->params.layout == MT_LAYOUT_COMPACT) switch (k) {
    case MT_PLAN_WEIGHTS: return "master high half (streamed)";
    case MT_PLAN_MASTER: return "master low half (16 bits)";
    case MT_PLAN_GRADS: return "gradients (bf16)";
    }
    switch (k) {
    case MT_PLAN_WEIGHTS: return plan->weight_elem_bytes == 2 ? "weights (bf16, streamed)" : "weights (fp32, streamed)";
    case MT_PLAN_MASTER: return "master weights (fp32)";
    case MT_PLAN_GRADS: return "gradients (fp32)";
    case MT_PLAN_ADAM_M: return "Adam m (fp32)";
    case MT_PLAN_ADAM_V: return "Adam v (fp32)";
    case MT_PLAN_CHECKPOINTS: return "checkpoints";
    case MT_PLAN_BLOCK_SAVED: return "block activations";
    case MT_PLAN_ACT_GRADS: return "activations + gradients";
    case MT_PLAN_WORKSPACE: return "workspace (layer+head)";
    case MT_PLAN_INPUTS: return "tokens and targets";
    case MT_PLAN_CLIP_FLAGS: return "clip speculation flags";
    case MT_PLAN_GRAD_ACC: return "gradient accumulators (fp32)";
    case MT_PLAN_RANK_RECV: return "other ranks' gradient chunks (fp32)";
    case MT_PLAN_DEVICE_GRADS: return "other devices' gradients (fp32)";
    case MT_PLAN_GATHERED: return plan->params.gather_masters ? "gathered masters (rank 0)"
                                                               : "a remote tile's master (rank 0)";
    case MT_PLAN_PROGRAM: return "program and libraries";
    case MT_PLAN_RUNTIME: return plan->params.ranks > 1 ? "runtime (StarPU, BLAS, MPI)" : "runtime (StarPU, BLAS)";
    case MT_PLAN_CPU_SCRATCH: return "CPU activations (workers)";
    case MT_PLAN_CUDA: return "CUDA context (estimate)";
    case MT_PLAN_DATA: return "data";
    }
    return "?";
}

void mt_plan_print(const mt_plan *plan, FILE *out)
{
    const mt_plan_params *p = &plan->params;
    char a[32], b[32];
    fprintf(out, "memory plan: %" PRId64 " parameters (%" PRId64 " for FLOPs), %" PRId64 " tiles, %s host layout\n",
            plan->param_count, plan->flops_params, plan->num_tiles, mt_host_layout_name(p->layout));
    if (plan->active_param_count != plan->param_count)
        fprintf(out, "  mixture of experts: %.3gB parameters in total, %.3gB active per token (%" PRId64 ")\n",
                (double)plan->param_count / 1e9, (double)plan->active_param_count / 1e9, plan->active_param_count);
    fprintf(out, "  B=%" PRId64 " x T=%" PRId64 " x accumulation %" PRId64 " = %" PRId64
            " tokens/step, K=%" PRId64 " (%" PRId64 " checkpoints per micro-batch), weights %s, %s\n",
            p->micro_batch, p->seq_len, p->grad_accum, plan->tokens_per_step, p->checkpoint_interval,
            plan->num_checkpoints, p->compute == MT_DTYPE_BF16 ? "bf16" : "fp32",
            p->use_gpu ? "GPU (sized for the CUDA kernels)" : "CPU only");
    if (p->use_gpu && p->offload_checkpoints == MT_PLAN_OFFLOAD_ON)
        fprintf(out, "  checkpoints offloaded: %" PRId64 " in pinned host memory, %" PRId64
                " on the GPU at once (a block boundary's, one more, one fetched ahead)\n",
                plan->host_checkpoints, plan->gpu_checkpoints);
    /* a CPU-only run has no GPU columns: nothing of it is there, and nothing pinned */
    const bool gpu = p->use_gpu;
    if (gpu) fprintf(out, "  %-30s %17s %11s %-6s %17s %11s\n", "kind", "host bytes", "host", "pinned", "GPU bytes", "GPU");
    else fprintf(out, "  %-30s %17s %11s\n", "kind", "host bytes", "host");
    for (int k = 0; k <= MT_PLAN_KIND_COUNT; k++) {
        const bool total = k == MT_PLAN_KIND_COUNT;
        const uint64_t host = total ? plan->host_total : plan->host[k], dev = total ? plan->gpu_total : plan->gpu[k];
        if (!host && !dev) continue;
        fprintf(out, "  %-30s %17" PRIu64 " %11s", total ? "total" : kind_name(k, plan), host,
                mt_format_bytes(host, a, sizeof a));
        if (gpu)
            fprintf(out, " %-6s %17" PRIu64 " %11s", !total && host ? (plan->host_pinned[k] ? "yes" : "no") : "", dev,
                    mt_format_bytes(dev, b, sizeof b));
        fprintf(out, "\n");
    }
    uint64_t state = 0;
    for (int k = MT_PLAN_WEIGHTS; k <= MT_PLAN_ADAM_V; k++) state += plan->host[k];
    fprintf(out, "  host: %s pinned; training state %.2f bytes per parameter; all in %.2f bytes per parameter\n",
            mt_format_bytes(plan->host_pinned_total, a, sizeof a),
            plan->param_count ? (double)state / (double)plan->param_count : 0.0, per_parameter(plan->host_total, plan));
    if (p->ranks > 1)
        fprintf(out, "  over %" PRId64 " ranks: each holds every tile's streamed weights and gradient and the master and "
                     "moments of the tiles it owns (tile t: rank t mod %" PRId64 "; the largest rank's shown), trains its "
                     "share of the global batch (%" PRId64 " tokens a step in all), sums its tiles' gradients chunk by chunk, "
                     "updates them and sends the weights to the others; no clip speculation\n",
                p->ranks, p->ranks, plan->tokens_per_step * p->ranks);
    else if (p->devices > 1)
        fprintf(out, "  over %" PRId64 " devices: micro-batch u on device u mod %" PRId64 ", each writing its own copy of "
                     "the gradients, summed on the GPUs into device 0's before the norm and AdamW; no clip speculation\n",
                p->devices, p->devices);
    else if (p->layout == MT_LAYOUT_COMPACT)
        fprintf(out, "  compact layout: no clip speculation and no second gradient (the update waits for the norm and "
                     "overlaps the next forward)\n");
    else if (p->use_gpu && plan->weight_elem_bytes == 2)
        fprintf(out, "  with ranged speculation and --adamw-defer auto (the default; when it fits in 80%% of the memory "
                     "available) or on: + %s of a second gradient (%s)\n",
                mt_format_bytes(plan->host_grad_alt, a, sizeof a), plan->params.use_gpu ? "pinned" : "not pinned");
}

int mt_plan_check_host(const mt_plan *plan, uint64_t available_bytes, char *err, size_t errlen)
{
    uint64_t usable = available_bytes / 100 * MT_PLAN_HOST_USABLE_PERCENT;
    if (plan->host_total <= usable) return 0;
    char need[32], have[32], use[32];
    uint64_t state = 0;
    for (int k = MT_PLAN_WEIGHTS; k <= MT_PLAN_ADAM_V; k++) state += plan->host[k];
    double per_param = plan->param_count ? (double)state / (double)plan->param_count : 0;
    /* The largest model that would fit at the same bytes per parameter, to make the advice concrete. */
    double max_params = per_param > 0 ? (double)usable / per_param : 0;
    snprintf(err, errlen,
             "not enough host memory: the plan needs %" PRIu64 " bytes (%s) for %" PRId64
             " parameters at %.1f bytes/parameter, but %" PRIu64 " bytes (%s) are available and at most %d%% "
             "(%s) may be used; choose a smaller model shape (at most ~%.2f billion parameters fit here) "
             "or run on a machine with more RAM",
             plan->host_total, mt_format_bytes(plan->host_total, need, sizeof need), plan->param_count, per_param,
             available_bytes, mt_format_bytes(available_bytes, have, sizeof have), MT_PLAN_HOST_USABLE_PERCENT,
             mt_format_bytes(usable, use, sizeof use), max_params / 1e9);
    return -1;
}

int mt_plan_check_gpu(const mt_plan *plan, uint64_t device_bytes, char *err, size_t errlen)
{
    if (!plan->params.use_gpu || plan->gpu_need <= device_bytes) return 0;
    const uint64_t *g = plan->gpu;
    const uint64_t in_flight = g[MT_PLAN_WEIGHTS] + g[MT_PLAN_GRADS] + g[MT_PLAN_GRAD_ACC];
    const uint64_t block = g[MT_PLAN_BLOCK_SAVED] + g[MT_PLAN_ACT_GRADS];
    const uint64_t work = g[MT_PLAN_WORKSPACE] + g[MT_PLAN_INPUTS];
    char need[32], have[32], a[32], b[32], c[32], d[32], e[32], f[32];
    const mt_plan_params *p = &plan->params;
    const bool offloaded = p->offload_checkpoints == MT_PLAN_OFFLOAD_ON;
    char where[96];
    if (offloaded) snprintf(where, sizeof where, "offloaded: %" PRId64 " in flight on the GPU", plan->gpu_checkpoints);
    else snprintf(where, sizeof where, "all on the GPU");
    snprintf(err, errlen,
             "not enough GPU memory: the plan needs %" PRIu64 " bytes (%s), the GPU has %" PRIu64 " bytes (%s): "
             "weights and gradients in flight %s, checkpoints %s (%" PRId64 " per micro-batch at K=%" PRId64
             ", %" PRId64 " micro-batch%s, %s), block activations and their gradients %s, workspaces and inputs %s, "
             "StarPU's margin %s, CUDA context %s (estimate); lower the micro batch size (more micro-batches with "
             "--accum) or the sequence length, or try another --checkpoint-every (auto takes the largest K that "
             "fits)%s",
             plan->gpu_need, mt_format_bytes(plan->gpu_need, need, sizeof need), device_bytes,
             mt_format_bytes(device_bytes, have, sizeof have), mt_format_bytes(in_flight, a, sizeof a),
             mt_format_bytes(g[MT_PLAN_CHECKPOINTS], b, sizeof b), plan->num_checkpoints, p->checkpoint_interval,
             p->grad_accum, p->grad_accum == 1 ? "" : "es", where, mt_format_bytes(block, c, sizeof c),
             mt_format_bytes(work, d, sizeof d), mt_format_bytes(plan->gpu_margin, e, sizeof e),
             mt_format_bytes(plan->gpu_context, f, sizeof f),
             offloaded ? "" : ", or keep the checkpoints in host memory (--offload-checkpoints on)");
    return -1;
}

int64_t mt_plan_device_micro_batches(const mt_plan_params *params)
{
    const int64_t n = params->devices > 1 ? params->devices : 1;
    return (params->grad_accum + n - 1) / n;
}

int64_t mt_plan_offload_in_flight(int64_t nblocks, int64_t accum)
{
    const int64_t all = nblocks * accum;
    return accum + 2 < all ? accum + 2 : all;
}

bool mt_plan_offload_needed(const mt_model_config *cfg, const mt_plan_params *params, uint64_t gpu_memory)
{
    if (!params->use_gpu || gpu_memory == 0) return false;
    mt_plan_params p = *params;
    mt_plan off, on;
    p.offload_checkpoints = MT_PLAN_OFFLOAD_OFF;
    if (mt_plan_compute(cfg, &p, &off) || off.gpu_need <= gpu_memory) return false;
    p.offload_checkpoints = MT_PLAN_OFFLOAD_ON;
    return mt_plan_compute(cfg, &p, &on) == 0 && on.gpu_need < off.gpu_need;
}

uint64_t mt_plan_gpu_limit_mib(const mt_plan *plan) { return (plan->gpu_total + plan->gpu_margin) >> 20; }

uint64_t mt_gpu_memory_total(void)
{
#if MT_HAVE_CUDA
    int devices = 0;
    struct cudaDeviceProp prop;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 1 || cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return (uint64_t)prop.totalGlobalMem;
#else
    return 0;
#endif
}

uint64_t mt_plan_gpu_memory(uint64_t given, int ncuda, const char **source)
{
    uint64_t bytes = 0;
    *source = "none";
    if (ncuda < 1) return 0;
    if (given) {
        *source = "--gpu-memory";
        return given;
    }
    if ((bytes = mt_gpu_memory_total())) *source = "device 0";
    return bytes;
}

uint64_t mt_host_memory_available(void)
{
    FILE *f = fopen("/proc/meminfo", "r");
    if (f) {
        char line[256];
        unsigned long long kib;
        while (fgets(line, sizeof line, f)) {
            if (sscanf(line, "MemAvailable: %llu kB", &kib) == 1) {
                fclose(f);
                return (uint64_t)kib * 1024;
            }
        }
        fclose(f);
    }
    /* Older kernels lack MemAvailable: free pages understate it (page cache is reclaimable),
     * which errs on the side of refusing. */
    long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages > 0 && page > 0) return (uint64_t)pages * (uint64_t)page;
    return 0;
}

int mt_plan_data_bytes(const char *path, uint64_t *bytes, char *err, size_t errlen)
{
    *bytes = 0;
    struct stat sb;
    if (stat(path, &sb) != 0) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return -1;
    }
    if (!S_ISDIR(sb.st_mode)) {
        *bytes = (uint64_t)sb.st_size;
        return 0;
    }
    DIR *d = opendir(path);
    if (!d) {
        snprintf(err, errlen, "%s: cannot list directory: %s", path, strerror(errno));
        return -1;
    }
    struct dirent *e;
    while ((e = readdir(d))) {
        const size_t n = strlen(e->d_name);
        if (e->d_name[0] == '.' || (n > 4 && strcmp(e->d_name + n - 4, ".dat") == 0) || strcmp(e->d_name, "meta.json") == 0)
            continue;
        char full[4352];
        snprintf(full, sizeof full, "%s/%s", path, e->d_name);
        struct stat fs;
        if (lstat(full, &fs) == 0 && S_ISREG(fs.st_mode)) *bytes += (uint64_t)fs.st_size;
    }
    closedir(d);
    return 0;
}

void mt_plan_workers(int ncpu_request, int ncuda_request, int *ncpu, int *ncuda)
{
    int devices = 0;
#if MT_HAVE_CUDA
    if (ncuda_request != 0 && cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
#endif
    *ncuda = ncuda_request >= 0 ? ncuda_request : devices;
    if (ncpu_request >= 1) {
        *ncpu = ncpu_request;
        return;
    }
    int cores = 0;
    hwloc_topology_t topo;
    if (hwloc_topology_init(&topo) == 0) {
        if (hwloc_topology_load(topo) == 0) cores = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE);
        hwloc_topology_destroy(topo);
    }
    if (cores <= 0) cores = (int)sysconf(_SC_NPROCESSORS_ONLN);
    *ncpu = cores - *ncuda >= 1 ? cores - *ncuda : 1;
}

/* The value of a "Key:   N kB" line of /proc/self/status, in bytes; 0 when absent. */
static uint64_t status_kib(const char *key)
{
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return 0;
    char line[256];
    unsigned long long kib = 0;
    const size_t n = strlen(key);
    while (fgets(line, sizeof line, f))
        if (strncmp(line, key, n) == 0 && line[n] == ':' && sscanf(line + n + 1, "%llu", &kib) == 1) break;
    fclose(f);
    return (uint64_t)kib * 1024;
}

uint64_t mt_host_peak_rss(void) { return status_kib("VmHWM"); }
uint64_t mt_host_rss(void) { return status_kib("VmRSS"); }

uint64_t mt_plan_activation_bytes(const mt_plan *plan)
{
    const uint64_t *where = plan->params.use_gpu ? plan->gpu : plan->host;
    return where[MT_PLAN_CHECKPOINTS] + where[MT_PLAN_BLOCK_SAVED] + where[MT_PLAN_ACT_GRADS] +
           where[MT_PLAN_WORKSPACE] + where[MT_PLAN_INPUTS];
}

int mt_plan_micro_batch(const mt_model_config *cfg, const mt_plan_params *base, int64_t tokens_per_step,
                        uint64_t budget, int64_t *micro_batch, int64_t *grad_accum, char *err, size_t errlen)
{
    const int64_t T = base->seq_len;
    if (T <= 0 || tokens_per_step <= 0 || tokens_per_step % T) {
        snprintf(err, errlen, "tokens per step (%" PRId64 ") must be a positive multiple of the sequence length (%" PRId64 ")",
                 tokens_per_step, T);
        return -1;
    }
    const int64_t sequences = tokens_per_step / T;
    uint64_t smallest = 0;
    /* The largest micro-batch that divides the step and fits: fewest passes over the weights. */
    for (int64_t B = sequences; B >= 1; B--) {
        if (sequences % B) continue;
        mt_plan_params p = *base;
        p.micro_batch = B;
        p.grad_accum = sequences / B;
        /* auto: the K that needs least, each K from 1 to the layers tried */
        const int64_t k_first = base->checkpoint_interval == MT_PLAN_K_AUTO ? 1 : base->checkpoint_interval;
        const int64_t k_last = base->checkpoint_interval == MT_PLAN_K_AUTO ? cfg->layers : k_first;
        uint64_t need = UINT64_MAX;
        for (int64_t K = k_first; K <= k_last; K++) {
            p.checkpoint_interval = K;
            mt_plan plan;
            if (mt_plan_compute(cfg, &p, &plan)) {
                snprintf(err, errlen, "%s", plan.error);
                return -1;
            }
            const uint64_t at_k = mt_plan_activation_bytes(&plan);
            if (at_k < need) need = at_k;
        }
        smallest = need;
        if (need <= budget) {
            *micro_batch = B;
            *grad_accum = sequences / B;
            return 0;
        }
    }
    char a[32], b[32];
    snprintf(err, errlen, "one sequence of %" PRId64 " tokens needs %s of activations, more than the budget of %s: "
             "raise the activation budget, shorten the sequences or raise K", T,
             mt_format_bytes(smallest, a, sizeof a), mt_format_bytes(budget, b, sizeof b));
    return -1;
}

const char *mt_host_layout_name(mt_host_layout layout)
{
    return layout == MT_LAYOUT_AUTO ? "auto" : layout == MT_LAYOUT_COMPACT ? "compact" : "full";
}

static uint64_t usable_share(uint64_t available) { return available / 100 * MT_PLAN_HOST_USABLE_PERCENT; }

/* "X GiB (Y bytes per parameter)" into buf. */
static const char *bytes_and_rate(uint64_t bytes, int64_t params, char *buf, size_t len)
{
    char b[32];
    snprintf(buf, len, "%s (%.2f bytes per parameter)", mt_format_bytes(bytes, b, sizeof b),
             params ? (double)bytes / (double)params : 0.0);
    return buf;
}

/* c->why for the choice made; c's totals, request, layout and fits set. */
static void explain_choice(mt_layout_choice *c)
{
    char full[64], plain[64], compact[64], use[32], have[32];
    bytes_and_rate(c->full_speculation, c->param_count, full, sizeof full);
    bytes_and_rate(c->full_plain, c->param_count, plain, sizeof plain);
    bytes_and_rate(c->compact, c->param_count, compact, sizeof compact);
    mt_format_bytes(c->usable, use, sizeof use);
    mt_format_bytes(c->available, have, sizeof have);
    if (c->request == MT_LAYOUT_COMPACT)
        snprintf(c->why, sizeof c->why, "compact as asked: %s, %s %s usable (%d%% of %s)", compact,
                 c->fits ? "within the" : "over the", use, MT_PLAN_HOST_USABLE_PERCENT, have);
    else if (c->request == MT_LAYOUT_FULL)
        snprintf(c->why, sizeof c->why, "full as asked: %s, %s %s usable (%d%% of %s)%s", c->speculation ? full : plain,
                 c->fits ? "within the" : "over the", use, MT_PLAN_HOST_USABLE_PERCENT, have,
                 c->fits && !c->speculation && c->full_speculation > c->full_plain
                     ? "; without deferral's second gradient, which does not fit (--adamw-defer auto declines it)" : "");
    else if (c->layout == MT_LAYOUT_FULL && c->fits)
        snprintf(c->why, sizeof c->why, "the full layout%s needs %s, within the %s usable (%d%% of %s)",
                 c->speculation ? " with clip speculation" : "", full, use, MT_PLAN_HOST_USABLE_PERCENT, have);
    else if (c->layout == MT_LAYOUT_COMPACT && c->fits)
        snprintf(c->why, sizeof c->why, "the full layout with clip speculation would need %s, over the %s usable "
                 "(%d%% of %s); compact needs %s", full, use, MT_PLAN_HOST_USABLE_PERCENT, have, compact);
    else if (c->layout == MT_LAYOUT_COMPACT)
        snprintf(c->why, sizeof c->why, "not even the compact layout fits: it needs %s, over the %s usable (%d%% "
                 "of %s)", compact, use, MT_PLAN_HOST_USABLE_PERCENT, have);
    else
        snprintf(c->why, sizeof c->why, "the full layout needs %s, over the %s usable (%d%% of %s); fp32 weights "
                 "have no compact layout", plain, use, MT_PLAN_HOST_USABLE_PERCENT, have);
}

int mt_plan_choose(const mt_model_config *cfg, const mt_plan_params *params, mt_host_layout request,
                   uint64_t available, mt_plan *plan, mt_layout_choice *c)
{
    memset(c, 0, sizeof *c);
    c->request = request;
    c->available = available;
    c->usable = usable_share(available);
    if (request != MT_LAYOUT_AUTO && request != MT_LAYOUT_FULL && request != MT_LAYOUT_COMPACT) {
        memset(plan, 0, sizeof *plan);
        return plan_fail(plan, "host layout %d is not auto, full or compact", (int)request);
    }
    if (params->ranks > 1 && request == MT_LAYOUT_COMPACT) {
        memset(plan, 0, sizeof *plan);
        return plan_fail(plan, "--host-layout compact: a run over %" PRId64 " ranks sums the gradients in fp32, which "
                         "the compact layout does not keep; use --host-layout full (or auto)", params->ranks);
    }
    /* the choice explained as the user asked it */
    if (params->ranks > 1) request = MT_LAYOUT_FULL;
    mt_plan_params p = *params;
    p.layout = MT_LAYOUT_FULL;
    if (mt_plan_compute(cfg, &p, plan)) return -1;
    /* clip speculation's flags are in the full plan's total where it runs by default; deferral's
     * second gradient comes with it */
    const bool ranged = plan->host[MT_PLAN_CLIP_FLAGS] > 0;
    c->param_count = plan->param_count;
    c->full_plain = plan->host_total - plan->host[MT_PLAN_CLIP_FLAGS];
    c->full_speculation = ranged ? plan->host_total + plan->host_grad_alt : c->full_plain;
    const uint64_t full_total = plan->host_total;
    mt_plan compact;
    const bool can_compact = p.compute == MT_DTYPE_BF16;
    if (can_compact) {
        p.layout = MT_LAYOUT_COMPACT;
        if (mt_plan_compute(cfg, &p, &compact)) {
            *plan = compact;
            return -1;
        }
        c->compact = compact.host_total;
    } else if (request == MT_LAYOUT_COMPACT) {
        p.layout = MT_LAYOUT_COMPACT;
        return mt_plan_compute(cfg, &p, plan); /* fails, saying why */
    }
    if (request == MT_LAYOUT_FULL || (request == MT_LAYOUT_AUTO && (c->full_speculation <= c->usable || !can_compact))) {
        c->layout = MT_LAYOUT_FULL;
        c->fits = full_total <= c->usable;
        c->speculation = ranged && c->full_speculation <= c->usable;
        c->host_total = c->speculation ? c->full_speculation : full_total;
    } else {
        c->layout = MT_LAYOUT_COMPACT;
        c->fits = c->compact <= c->usable;
        c->host_total = c->compact;
        *plan = compact;
    }
    explain_choice(c);
    return 0;
}

void mt_plan_print_choice(const mt_layout_choice *c, FILE *out)
{
    char b[32];
    const double n = c->param_count ? (double)c->param_count : 1.0;
    fprintf(out, "host layouts (all in: host total / parameters):\n");
    fprintf(out, "  %-50s %17" PRIu64 " %11s %6.2f bytes per parameter\n", "full, with clip speculation's flags and second gradient",
            c->full_speculation, mt_format_bytes(c->full_speculation, b, sizeof b), (double)c->full_speculation / n);
    fprintf(out, "  %-50s %17" PRIu64 " %11s %6.2f bytes per parameter\n", "full, without them", c->full_plain,
            mt_format_bytes(c->full_plain, b, sizeof b), (double)c->full_plain / n);
    if (c->compact)
        fprintf(out, "  %-50s %17" PRIu64 " %11s %6.2f bytes per parameter\n", "compact", c->compact,
                mt_format_bytes(c->compact, b, sizeof b), (double)c->compact / n);
    else
        fprintf(out, "  %-50s %17s\n", "compact", "- (fp32 weights)");
    fprintf(out, "host layout: %s (--host-layout %s): %s\n", mt_host_layout_name(c->layout), mt_host_layout_name(c->request),
            c->why);
}

const char *const mt_plan_shapes[MT_PLAN_NSHAPES] = { "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b",
                                                      "qwen2.5-14b" };

/* The choice for cfg's first `layers` layers; -1 with plan->error set. */
static int choose_at(const mt_model_config *cfg, int64_t layers, const mt_plan_params *params, mt_host_layout request,
                     uint64_t available, mt_plan *plan, mt_layout_choice *c)
{
    mt_model_config at = *cfg;
    if (mt_config_set_layers(&at, layers, plan->error, sizeof plan->error)) return -1;
    return mt_plan_choose(&at, params, request, available, plan, c);
}

/* mt_plan_max_layers' bisection between 0 layers (fits, vacuously) and hi (known not to fit),
 * probing `first` first. */
static int max_layers_below(const mt_model_config *cfg, const mt_plan_params *params, mt_host_layout request,
                            uint64_t available, int64_t first, int64_t hi, int64_t *max_layers, int64_t *max_params,
                            mt_host_layout *max_layout, char *err, size_t errlen)
{
    mt_plan plan;
    mt_layout_choice c;
    *max_params = 0;
    *max_layout = MT_LAYOUT_FULL;
    int64_t lo = 0; /* lo fits, hi does not */
    for (int64_t at = first; hi - lo > 1; at = lo + (hi - lo) / 2) {
        if (choose_at(cfg, at, params, request, available, &plan, &c)) {
            snprintf(err, errlen, "at %lld layers: %s", (long long)at, plan.error);
            return -1;
        }
        if (c.fits) {
            lo = at;
            *max_params = plan.param_count; /* lo only grows: the last fit is the answer's */
            *max_layout = c.layout;
        } else {
            hi = at;
        }
    }
    *max_layers = lo;
    return 0;
}

int mt_plan_max_layers(const mt_model_config *cfg, const mt_plan_params *params, mt_host_layout request,
                       uint64_t available, int64_t *max_layers, int64_t *max_params, mt_host_layout *max_layout,
                       char *err, size_t errlen)
{
    /* the whole model first: one plan when it fits */
    return max_layers_below(cfg, params, request, available, cfg->layers, cfg->layers + 1, max_layers, max_params,
                            max_layout, err, errlen);
}

int mt_plan_fit_shapes(const mt_plan_params *params, mt_host_layout request, uint64_t available,
                       mt_plan_fit rows[MT_PLAN_NSHAPES], char *err, size_t errlen)
{
    mt_plan plan;
    for (int i = 0; i < MT_PLAN_NSHAPES; i++) {
        mt_plan_fit *r = &rows[i];
        mt_model_config cfg;
        if (mt_config_from_shape(mt_plan_shapes[i], &cfg)) {
            snprintf(err, errlen, "%s: not a known shape", mt_plan_shapes[i]);
            return -1;
        }
        *r = (mt_plan_fit){ .shape = mt_plan_shapes[i], .layers = cfg.layers };
        if (mt_plan_choose(&cfg, params, request, available, &plan, &r->choice)) {
            snprintf(err, errlen, "%s: %s", r->shape, plan.error);
            return -1;
        }
        r->params = plan.param_count;
        r->host_bytes = r->choice.host_total;
        if (r->choice.fits) { /* the whole model: what mt_plan_max_layers would plan again */
            r->max_layers = cfg.layers;
            r->max_params = r->params;
            r->max_layout = r->choice.layout;
            continue;
        }
        char why[512];
        if (max_layers_below(&cfg, params, request, available, cfg.layers / 2, cfg.layers, &r->max_layers,
                             &r->max_params, &r->max_layout, why, sizeof why)) {
            snprintf(err, errlen, "%s %s", r->shape, why);
            return -1;
        }
    }
    return MT_PLAN_NSHAPES;
}

void mt_plan_print_fits(const mt_plan_fit *rows, int n, FILE *out)
{
    fprintf(out, "| shape | parameters | host layout | host bytes | bytes per parameter | verdict |\n"
                 "|---|---|---|---|---|---|\n");
    for (int i = 0; i < n; i++) {
        const mt_plan_fit *r = &rows[i];
        char b[32], verdict[160];
        if (r->choice.fits)
            snprintf(verdict, sizeof verdict, "fits");
        else if (r->max_layers > 0)
            snprintf(verdict, sizeof verdict, "refused; at this width %lld of its %lld layers fit (%.3fB parameters, %s)",
                     (long long)r->max_layers, (long long)r->layers, r->max_params / 1e9, mt_host_layout_name(r->max_layout));
        else
            snprintf(verdict, sizeof verdict, "refused; not one layer of this width fits");
        fprintf(out, "| %s | %.3fB | %s%s | %s | %.2f | %s |\n", r->shape, r->params / 1e9,
                mt_host_layout_name(r->choice.layout), r->choice.speculation ? " + clip speculation" : "",
                mt_format_bytes(r->host_bytes, b, sizeof b), r->params ? (double)r->host_bytes / (double)r->params : 0.0,
                verdict);
    }
}

/* How far the choice at one K is from fitting: the larger of its two sides' need over what that
 * side has (the host's usable share, the GPU's memory); at most 1 when it fits. */
static double overshoot(const mt_plan *plan, const mt_run_choice *run)
{
    double host = run->layout.usable ? (double)run->layout.host_total / (double)run->layout.usable : INFINITY;
    double gpu = run->gpu_checked ? (double)plan->gpu_need / (double)run->gpu_memory : 0;
    return host > gpu ? host : gpu;
}

/* run's host and GPU verdicts for params at checkpoint interval K. */
static int choose_at_k(const mt_model_config *cfg, const mt_plan_params *params, int64_t K, mt_host_layout request,
                       uint64_t host_available, mt_plan *plan, mt_run_choice *run)
{
    mt_plan_params p = *params;
    p.checkpoint_interval = K;
    if (mt_plan_choose(cfg, &p, request, host_available, plan, &run->layout)) return -1;
    run->K = plan->params.checkpoint_interval;
    run->gpu_checked = plan->params.use_gpu && run->gpu_memory > 0;
    run->gpu_fits = !run->gpu_checked || plan->gpu_need <= run->gpu_memory;
    run->fits = run->layout.fits && run->gpu_fits;
    return 0;
}

/* mt_plan_choose_run at params' offload_checkpoints, on or off. */
static int choose_run_at(const mt_model_config *cfg, const mt_plan_params *params, mt_host_layout request,
                         uint64_t host_available, uint64_t gpu_memory, mt_plan *plan, mt_run_choice *run)
{
    memset(run, 0, sizeof *run);
    run->gpu_memory = gpu_memory;
    run->k_auto = params->checkpoint_interval == MT_PLAN_K_AUTO;
    if (!run->k_auto) {
        if (choose_at_k(cfg, params, params->checkpoint_interval, request, host_available, plan, run)) return -1;
        if (run->fits || !params->k_default) return 0;
        /* The default K does not fit: the nearest larger K whose plan fits (fewer checkpoints,
         * a longer block to recompute; the default is the command's choice for speed), else
         * the default's refusal. */
        const int64_t k_given = run->K;
        const char *missed = run->gpu_fits ? "host" : run->layout.fits ? "GPU" : "host and the GPU";
        for (int64_t K = k_given + 1; K <= cfg->layers; K++) {
            mt_plan at_plan;
            mt_run_choice at = *run;
            if (choose_at_k(cfg, params, K, request, host_available, &at_plan, &at)) return -1;
            if (!at.fits) continue;
            *plan = at_plan;
            *run = at;
            run->k_auto = true;
            snprintf(run->why_k, sizeof run->why_k,
                     "K=%" PRId64 ", the smallest K above the default whose plan fits the host and the GPU "
                     "(the default K=%" PRId64 " does not fit the %s)", K, k_given, missed);
            return 0;
        }
        return 0; /* *plan and *run are still the default's */
    }
    /* Larger K: fewer checkpoints, one larger block of saved activations; the need is not
     * monotone in K, so every K is tried from the top. */
    const int64_t L = cfg->layers;
    int64_t least_k = L;
    double least = INFINITY;
    const char *missed = "host";
    mt_run_choice at = *run;
    for (int64_t K = L; K >= 1; K--) {
        if (choose_at_k(cfg, params, K, request, host_available, plan, &at)) return -1;
        if (at.fits) {
            *run = at;
            run->k_auto = true;
            snprintf(run->why_k, sizeof run->why_k, "K=%" PRId64 " (--checkpoint-every auto): %s", K,
                     K == L ? "every layer in one block fits" : "the largest K whose plan fits the host and the GPU");
            if (K < L) {
                mt_run_choice above = at;
                mt_plan next;
                if (choose_at_k(cfg, params, K + 1, request, host_available, &next, &above) == 0) {
                    char b[32], have[32];
                    const bool gpu = !above.gpu_fits;
                    size_t n = strlen(run->why_k);
                    snprintf(run->why_k + n, sizeof run->why_k - n, "; K=%" PRId64 " needs %s of %s on the %s",
                             K + 1, mt_format_bytes(gpu ? next.gpu_need : above.layout.host_total, b, sizeof b),
                             mt_format_bytes(gpu ? gpu_memory : above.layout.usable, have, sizeof have),
                             gpu ? "GPU" : "host (its usable share)");
                }
            }
            return 0;
        }
        const double m = overshoot(plan, &at);
        if (m < least) {
            least = m;
            least_k = K;
            missed = at.gpu_fits ? "host" : at.layout.fits ? "GPU" : "host and the GPU";
        }
    }
    if (choose_at_k(cfg, params, least_k, request, host_available, plan, run)) return -1;
    run->k_auto = true;
    snprintf(run->why_k, sizeof run->why_k,
             "--checkpoint-every auto: no K from 1 to %" PRId64 " fits; K=%" PRId64 " comes nearest (the %s over)", L,
             least_k, missed);
    return 0;
}

static int choose_run_offload(const mt_model_config *cfg, const mt_plan_params *params, mt_host_layout request,
                              uint64_t host_available, uint64_t gpu_memory, mt_plan *plan, mt_run_choice *run);

int mt_plan_choose_run(const mt_model_config *cfg, const mt_plan_params *params, mt_host_layout request,
                       uint64_t host_available, uint64_t gpu_memory, mt_plan *plan, mt_run_choice *run)
{
    if (cfg->mlp_chunk != MT_PLAN_MLP_CHUNK_AUTO) {
        if (choose_run_offload(cfg, params, request, host_available, gpu_memory, plan, run)) return -1;
        run->mlp_chunk = mt_config_mlp_chunked(cfg) ? cfg->mlp_chunk : 0;
        return 0;
    }
    static const int64_t chunks[] = { 0, 65536, 32768, 16384, 8192, 4096, 2048, 1024 };
    const int64_t tokens = params->micro_batch * params->seq_len;
    mt_model_config c = *cfg;
    int64_t last = 0;
    for (size_t i = 0; i < sizeof chunks / sizeof chunks[0]; i++) {
        if (i > 0 && chunks[i] >= tokens) continue; /* one chunk of all the tokens: no less memory */
        c.mlp_chunk = chunks[i];
        if (choose_run_offload(&c, params, request, host_available, gpu_memory, plan, run)) return -1;
        last = chunks[i];
        if (run->fits) break;
    }
    run->mlp_chunk_auto = true;
    run->mlp_chunk = last;
    if (last > 0)
        snprintf(run->why_mlp_chunk, sizeof run->why_mlp_chunk,
                 "the dense MLP %" PRId64 " tokens at a time (--mlp-chunk auto: %s)", last,
                 run->fits ? "the largest chunk whose plan fits; unchunked it does not"
                           : "no chunk fits; the smallest comes nearest");
    return 0;
}

static int choose_run_offload(const mt_model_config *cfg, const mt_plan_params *params, mt_host_layout request,
                              uint64_t host_available, uint64_t gpu_memory, mt_plan *plan, mt_run_choice *run)
{
    mt_plan_params p = *params;
    const bool automatic = p.offload_checkpoints == MT_PLAN_OFFLOAD_AUTO;
    if (!automatic) {
        if (choose_run_at(cfg, &p, request, host_available, gpu_memory, plan, run)) return -1;
        run->offload = plan->params.offload_checkpoints == MT_PLAN_OFFLOAD_ON;
        snprintf(run->why_offload, sizeof run->why_offload, "%s (--offload-checkpoints %s)",
                 !run->offload ? "kept where they are written" : p.use_gpu ? "offloaded to pinned host memory"
                                                                           : "in host memory (no GPU)",
                 run->offload ? "on" : "off");
        return 0;
    }
    /* auto: off where that fits (nothing crosses the bus for the checkpoints), else on where it
     * fits, else the nearer of the two */
    p.offload_checkpoints = MT_PLAN_OFFLOAD_OFF;
    if (choose_run_at(cfg, &p, request, host_available, gpu_memory, plan, run)) return -1;
    const char *why = !p.use_gpu ? "no GPU: they are in host memory either way"
                      : !run->gpu_checked ? "the GPU is not checked (no device here and no --gpu-memory)"
                                          : "the plan with every checkpoint on the GPU fits";
    if (p.use_gpu && run->gpu_checked && !run->fits) {
        mt_plan on;
        mt_run_choice at;
        p.offload_checkpoints = MT_PLAN_OFFLOAD_ON;
        if (choose_run_at(cfg, &p, request, host_available, gpu_memory, &on, &at)) return -1;
        if (at.fits || overshoot(&on, &at) < overshoot(plan, run)) {
            *plan = on;
            *run = at;
            run->offload = true;
            why = at.fits ? "the plan with every checkpoint on the GPU does not fit, with them offloaded it does"
                          : "neither fits; offloaded comes nearer";
        } else {
            why = "neither fits; every checkpoint on the GPU comes nearer";
        }
    }
    run->offload_auto = true;
    char b[32], h[32];
    if (run->offload)
        snprintf(run->why_offload, sizeof run->why_offload,
                 "offloaded to pinned host memory (--offload-checkpoints auto: %s): %s there, %" PRId64
                 " in flight on the GPU (%s)", why, mt_format_bytes(plan->host[MT_PLAN_CHECKPOINTS], h, sizeof h),
                 plan->gpu_checkpoints, mt_format_bytes(plan->gpu[MT_PLAN_CHECKPOINTS], b, sizeof b));
    else
        snprintf(run->why_offload, sizeof run->why_offload, "kept where they are written (--offload-checkpoints auto: %s)",
                 why);
    return 0;
}

int mt_plan_run_refusal(const mt_plan *plan, const mt_run_choice *run, char *err, size_t errlen)
{
    if (run->fits) return 0;
    char why[1536];
    if (!run->layout.fits) {
        if (mt_plan_check_host(plan, run->layout.available, why, sizeof why) == 0)
            snprintf(why, sizeof why, "%s", run->layout.why);
    } else {
        mt_plan_check_gpu(plan, run->gpu_memory, why, sizeof why);
    }
    if (run->k_auto) snprintf(err, errlen, "%s: %s", run->why_k, why);
    else snprintf(err, errlen, "%s", why);
    return -1;
}

void mt_plan_print_run(const mt_plan *plan, const mt_run_choice *run, const char *gpu_source, FILE *out)
{
    char need[32], have[32];
    if (run->mlp_chunk > 0 && run->mlp_chunk_auto) fprintf(out, "MLP: %s\n", run->why_mlp_chunk);
    else if (run->mlp_chunk > 0)
        fprintf(out, "MLP: the dense MLP %" PRId64 " tokens at a time (--mlp-chunk)\n", run->mlp_chunk);
    if (run->k_auto) fprintf(out, "checkpoint interval: %s\n", run->why_k);
    if (!plan->params.use_gpu) return;
    fprintf(out, "checkpoints: %s\n", run->why_offload);
    mt_format_bytes(plan->gpu_need, need, sizeof need);
    if (!run->gpu_checked) {
        fprintf(out, "GPU: needs %" PRIu64 " bytes (%s: the buffers, StarPU's margin and the CUDA context); not "
                     "checked: no CUDA device here (--gpu-memory BYTES checks against a device's size)\n",
                plan->gpu_need, need);
        return;
    }
    fprintf(out, "GPU: needs %" PRIu64 " bytes (%s: the buffers, StarPU's margin and the CUDA context), %s the %s "
                 "of the GPU (%s)\n",
            plan->gpu_need, need, run->gpu_fits ? "within" : "over",
            mt_format_bytes(run->gpu_memory, have, sizeof have), gpu_source);
}
