/* The memory plan: every byte a training run will hold, on the host and on the GPU, computed from
 * the config and the run's shape before anything is allocated, so that a run that cannot fit is
 * refused up front with a message instead of dying in the middle of a step. */
#ifndef MT_RUNTIME_PLAN_H
#define MT_RUNTIME_PLAN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "models/config.h"
#include "models/dtype.h"

/* Host tiles are allocated one per kind per tile (embedding, each layer, head), each rounded up
 * to this many bytes (page size: what pinning and StarPU registration work in). */
#define MT_PLAN_TILE_BYTES_ALIGN 4096
/* Rows of the LM head processed at a time when the caller leaves head_chunk at 0. */
#define MT_PLAN_DEFAULT_HEAD_CHUNK 1024
/* Share of the available host memory a plan may use; the rest stays free for the OS, the page
 * cache, StarPU's own buffers and the data loader. */
#define MT_PLAN_HOST_USABLE_PERCENT 90
/* With a GPU, the device holds besides the graph's buffers (gpu_total) StarPU's own small
 * allocations, granted as bench's STARPU_LIMIT_CUDA_MEM grants them: this share of the buffers
 * and this many bytes on top. */
/* The step graph's byte buffers (a layer's saved activations, the scratch) are vectors of whole
 * units of this many bytes (runtime/step/graph.c): one may hold more than 16 GiB. */
#define MT_PLAN_BYTE_UNIT 64
/* A byte buffer of `bytes` as the step graph registers it: rounded up to whole units. */
static inline uint64_t mt_plan_byte_buffer(uint64_t bytes)
{
    return (bytes + MT_PLAN_BYTE_UNIT - 1) / MT_PLAN_BYTE_UNIT * MT_PLAN_BYTE_UNIT;
}
#define MT_PLAN_GPU_MARGIN_PERCENT 2
#define MT_PLAN_GPU_MARGIN_BYTES ((uint64_t)256 << 20)
/* ... and the CUDA context's device side: the context itself, the kernels of libcudart, cuBLASLt
 * and cuDNN loaded on first use, cuBLAS's workspace. An estimate, as the host side's
 * (MT_PLAN_CUDA) is: bench's note "whole device in use at the end" less its peak GPU, on a GPU
 * host, gives the figure to put here. */
#define MT_PLAN_GPU_CONTEXT_BYTES ((uint64_t)1 << 30)
/* mt_plan_params.checkpoint_interval asked as "auto" (--checkpoint-every auto): mt_plan_choose_run
 * takes the largest K whose plan fits the host and the GPU. mt_plan_compute refuses it. */
#define MT_PLAN_K_AUTO 0
/* mt_plan_params.offload_checkpoints (mt_step_config.offload_checkpoints, --offload-checkpoints):
 * off, the zero value, keeps every checkpoint where the compute runs from the forward to the
 * backward; on keeps those of every block but the last in pinned host memory, the GPU holding
 * only the ones in flight (mt_plan_offload_in_flight); auto is mt_plan_choose_run's to resolve
 * (mt_plan_compute plans it as off). */
#define MT_PLAN_OFFLOAD_AUTO (-1)
#define MT_PLAN_OFFLOAD_OFF 0
#define MT_PLAN_OFFLOAD_ON 1

/* How a run's host state holds the training state (runtime/state.h allocates it so; the plan
 * counts it; docs/design.md, section 1.1). */
typedef enum mt_host_layout {
    MT_LAYOUT_AUTO = -1,    /* a request only: mt_plan_choose picks one of the two */
    MT_LAYOUT_FULL = 0,     /* per tile the streamed copy (bf16 or fp32), the fp32 master, an fp32
                             * gradient, m and v: 18 bytes per parameter with bf16 weights, plus clip
                             * speculation's flags and deferral's second gradient when they run */
    MT_LAYOUT_COMPACT = 1,  /* bf16 weights only: the fp32 master as two 16-bit planes whose high one
                             * is the streamed weight, a bf16 gradient (accumulated in fp32 where the
                             * compute runs), m and v: 14 bytes per parameter; no clip speculation */
} mt_host_layout;

/* "auto", "full", "compact". */
const char *mt_host_layout_name(mt_host_layout layout);

/* The process around the training state: what a run of `megatrain train` holds besides the
 * buffers of the state and the step graph (runtime/plan.c models each part and says where its
 * constants come from). */
typedef struct mt_plan_process {
    bool counted;             /* false (the zero value): the plan counts the state and the graph's
                               * buffers alone, as the GPU cap of bench and the unit tests want */
    int ncpu;                 /* StarPU CPU workers (>= 1 when counted) */
    uint64_t program_bytes;   /* the program and its libraries as loaded (CUDA's among them in a
                               * CUDA build, whether a GPU is used or not): the caller's resident
                               * set before it loads or starts anything, mt_host_rss() */
    uint64_t data_bytes;      /* the training data as the run loads it (mt_plan_data_bytes) */
    int64_t eval_sequences;   /* validation windows held at once (mt_train_options.eval_sequences) */
} mt_plan_process;

typedef struct mt_plan_params {
    int64_t micro_batch;         /* B: sequences per micro-batch */
    int64_t seq_len;             /* T: tokens per sequence */
    int64_t grad_accum;          /* micro-batches per optimizer step (>= 1): each keeps its
                                  * checkpoints, activation gradients and inputs */
    int64_t checkpoint_interval; /* K: layers per recompute block (clamped to L) */
    mt_dtype compute;
    bool use_gpu;                /* false: activations live on the host, nothing is pinned */
    int64_t head_chunk;          /* LM-head rows at a time; 0: min(B*T, MT_PLAN_DEFAULT_HEAD_CHUNK) */
    mt_host_layout layout;       /* FULL (0, the default) or COMPACT; AUTO is mt_plan_choose's */
    int64_t ranks;               /* processes of a distributed run (runtime/dist.h); 0 or 1: one.
                                  * Each rank holds every tile's weights and gradient, the master
                                  * and moments of its own tiles (the largest rank's counted), and
                                  * the buffers it receives the other ranks' gradients into
                                  * (MT_PLAN_RANK_RECV); full layout, no clip speculation. */
    int64_t devices;             /* compute devices of the process (CUDA workers; the step graph's
                                  * mt_step_config.devices); 0 or 1: one. Each one past the first
                                  * has its own copy of the gradients, summed on device 0
                                  * (MT_PLAN_DEVICE_GRADS) */
    int offload_checkpoints;     /* MT_PLAN_OFFLOAD_OFF (0, the default), _ON or _AUTO (above) */
    bool gather_masters;         /* over several ranks: rank 0 gathers every master it does not own
                                  * after the last step (train's byte-level sample), not one tile at
                                  * a time (MT_PLAN_GATHERED) */
    bool k_default;              /* checkpoint_interval is a default, not asked for: where its plan
                                  * does not fit, mt_plan_choose_run takes the smallest larger K
                                  * that fits, if one does */
    mt_plan_process process;     /* the fixed costs: counted by train and plan */
} mt_plan_params;

/* What the memory holds. Host state kinds exist on the host only; the working kinds live where
 * the compute runs (GPU, or host for a CPU-only run). */
typedef enum mt_plan_kind {
    MT_PLAN_WEIGHTS,        /* host: streamed copy of all tiles; GPU: 2 weight buffers */
    MT_PLAN_MASTER,         /* host: fp32 master weights */
    MT_PLAN_GRADS,          /* host: fp32 gradients; GPU: 2 fp32 gradient buffers */
    MT_PLAN_ADAM_M,         /* host: fp32 Adam first moment */
    MT_PLAN_ADAM_V,         /* host: fp32 Adam second moment */
    MT_PLAN_CHECKPOINTS,    /* ceil(L/K) fp32 hidden states (B*T*d) per micro-batch, forward to backward;
                             * offloaded: all but the last block's in pinned host memory, on the GPU
                             * those in flight */
    MT_PLAN_BLOCK_SAVED,    /* one block's saved activations: K * mt_codelet_layer_saved_bytes */
    MT_PLAN_ACT_GRADS,      /* per micro-batch, fp32 ping-pong pairs of hidden states and their gradients: 4 * B*T*d */
    MT_PLAN_WORKSPACE,      /* layer scratch + head scratch (chunked LM head), mt_codelet_*_scratch_bytes */
    MT_PLAN_INPUTS,         /* token ids and targets: (2 slots * accumulation + 1 eval) * 2 * B*T int32 */
    MT_PLAN_CLIP_FLAGS,     /* host, with a GPU and bf16 weights: ranged clip speculation's flags
                             * (the default with clipping, --clip-speculate auto): host_clip_flags */
    MT_PLAN_GRAD_ACC,       /* compact: the fp32 gradient accumulators alive at once where the
                             * compute runs (no host home: GPU, or host for a CPU-only run); over
                             * several GPUs, either layout, also a device's copies of the
                             * gradients, which live alike */
    MT_PLAN_RANK_RECV,      /* host, over several ranks: the buffers a tile's owner (tile t's is
                             * rank t mod ranks) receives the other ranks' gradient chunks into,
                             * to sum them (runtime/step/dist.c): MT_DIST_POOL_SLOTS per other rank
                             * and distinct chunk size, whatever the number of layers */
    MT_PLAN_DEVICE_GRADS,   /* with several devices in the process, devices 1..n-1's fp32 copies
                             * of the gradients, summed into device 0's (runtime/step/graph.c,
                             * alloc_device_grads): on CPU workers, host homes of every tile's;
                             * on GPUs, a summing device's room for the copies it receives */
    MT_PLAN_GATHERED,       /* host, over several ranks: the fp32 masters of tiles rank 0 does not
                             * own, read there after the last step for the model's save and the
                             * weights' hash one tile at a time (mt_dist_masters_open: the
                             * largest such tile), or all of them where gather_masters says
                             * (mt_dist_gather_masters); counted whether or not the run reads them */
    /* The process (mt_plan_process.counted), host only: */
    MT_PLAN_PROGRAM,        /* the program and its libraries as loaded: mt_plan_process.program_bytes */
    MT_PLAN_RUNTIME,        /* StarPU started: a base, and per CPU worker its thread and state */
    MT_PLAN_CPU_SCRATCH,    /* CPU-only run: the layer and head scratch of every CPU worker but
                             * the one WORKSPACE counts (StarPU gives each worker its own copy of
                             * a STARPU_SCRATCH buffer), and what the working set costs beyond
                             * its buffers (the workers' OpenBLAS packing buffers, the allocator) */
    MT_PLAN_CUDA,           /* with a GPU: the CUDA context and the loaded CUDA libraries (an
                             * estimate: runtime/plan.c) */
    MT_PLAN_DATA,           /* the training data as loaded, and the loop's batch and validation
                             * buffers (runtime/train.c) */
    MT_PLAN_KIND_COUNT
} mt_plan_kind;

typedef struct mt_plan {
    mt_plan_params params;     /* as given, with the defaults filled in and K clamped */
    int64_t tokens_per_step;   /* B * T * grad_accum */
    int64_t param_count;       /* mt_config_param_count */
    int64_t active_param_count; /* mt_config_active_param_count: what one token uses (a mixture of
                                 * experts' routed experts only; param_count for a dense model) */
    int64_t flops_params;      /* mt_config_flops_params */
    int64_t tile_numel[3];     /* elements of the embedding, one layer and the head tile (padded) */
    int64_t dense_layers;      /* layers of a model mixing dense and sparse layers that are dense (0 otherwise) */
    int64_t dense_layer_numel; /* elements of such a dense layer's tile (tile_numel's layer is the sparse one) */
    int64_t num_tiles;         /* L + 2 */
    int64_t max_tile_numel;    /* the largest tile: every GPU weight buffer is this size */
    uint64_t stream_bytes[3];  /* bytes of the streamed copy of the embedding, one layer and the head
                                * tile, the fp32 norms of bf16 weights included
                                * (mt_layout_keep_norms_f32), before the 4 KiB rounding */
    uint64_t dense_stream_bytes; /* that of a dense layer of a model that mixes them, else 0 */
    uint64_t max_stream_bytes; /* the largest of them */
    int64_t num_checkpoints;   /* ceil(L / K), per micro-batch */
    int64_t gpu_checkpoints;   /* checkpoints on the GPU at once, over all micro-batches: every one
                                * (num_checkpoints x accumulation), or offloaded those in flight;
                                * 0 without a GPU */
    int64_t host_checkpoints;  /* offloaded with a GPU: the checkpoints whose home is host memory,
                                * (num_checkpoints - 1) x accumulation; else 0 */
    int weight_elem_bytes;     /* 2 (bf16) or 4 */
    uint64_t host[MT_PLAN_KIND_COUNT];
    uint64_t gpu[MT_PLAN_KIND_COUNT];
    bool host_pinned[MT_PLAN_KIND_COUNT];
    uint64_t host_total, host_pinned_total, gpu_total;
    /* With a GPU (0 without): StarPU's margin (MT_PLAN_GPU_MARGIN_*) and the CUDA context
     * (MT_PLAN_GPU_CONTEXT_BYTES), apart from gpu_total, which counts the graph's buffers alone
     * (what bench compares StarPU's peak with); gpu_need = gpu_total + both, what the device must
     * hold. */
    uint64_t gpu_margin, gpu_context, gpu_need;
    /* Not in the totals: the second gradient of every tile (pinned with a GPU) that
     * deferred moments halves add (mt_step_config.adamw_defer, --adamw-defer on); 0 in the
     * compact layout, which does not defer. */
    uint64_t host_grad_alt;
    /* Ranged clip speculation's flags (one bit per parameter and room for the inputs of 1/16 of
     * them: backends/cpu/ranged_flags.h), host memory a run with a GPU, bf16 weights and
     * clipping allocates by default (--clip-speculate auto): about 1.4 bytes per parameter. In
     * the totals (MT_PLAN_CLIP_FLAGS) when the plan has a GPU, bf16 weights and the full layout,
     * clipping taken as on. */
    uint64_t host_clip_flags;
    char error[256];           /* why mt_plan_compute failed */
} mt_plan;

/* Fills plan from a validated config and the run's shape. Returns 0, or -1 with plan->error set
 * (non-positive B, T, K or accumulation, or sizes whose byte counts would overflow). */
int mt_plan_compute(const mt_model_config *cfg, const mt_plan_params *params, mt_plan *plan);

/* A readable table: kind, host bytes and units, pinned or not, GPU bytes and units, totals, and
 * the host total per parameter (all in). */
void mt_plan_print(const mt_plan *plan, FILE *out);

/* The host bytes of each way to hold a run's state, and the choice among them. */
typedef struct mt_layout_choice {
    mt_host_layout request;     /* as asked */
    mt_host_layout layout;      /* chosen: FULL or COMPACT */
    bool speculation;           /* full: with clip speculation's flags and deferral's second gradient */
    bool fits;                  /* the chosen plan needs at most the usable share of `available` */
    uint64_t available, usable; /* bytes given, and MT_PLAN_HOST_USABLE_PERCENT of them */
    int64_t param_count;
    /* Host totals: full with the flags and the second gradient (ranged speculation and its
     * deferral run only where a GPU computes in bf16: elsewhere equal to full_plain); full
     * without them; compact (0: impossible, fp32 weights). */
    uint64_t full_speculation, full_plain, compact;
    uint64_t host_total;        /* the chosen one's: the plan's host total, and with speculation the
                                 * second gradient */
    char why[512];              /* the choice in one sentence */
} mt_layout_choice;

/* Plans params (their layout ignored) under `request`, against `available` host bytes. AUTO takes
 * the full layout with clip speculation (its flags and the second gradient) where that fits, else
 * compact where that fits, else refuses (fits false; the layout compact, or full with fp32
 * weights). FULL and COMPACT are taken as asked (COMPACT with fp32 weights is an error): FULL
 * with speculation when its second gradient fits too, as --adamw-defer auto decides. *plan is the
 * chosen layout's. Returns 0 whether it fits or not, or -1 with plan->error set. */
int mt_plan_choose(const mt_model_config *cfg, const mt_plan_params *params, mt_host_layout request,
                   uint64_t available, mt_plan *plan, mt_layout_choice *choice);
/* The three totals with their bytes per parameter, the choice and why, on out. */
void mt_plan_print_choice(const mt_layout_choice *c, FILE *out);

/* The published shapes mt_config_from_shape knows (tiny aside), for the table below. */
#define MT_PLAN_NSHAPES 5
extern const char *const mt_plan_shapes[MT_PLAN_NSHAPES];

/* One row of "what fits here": a published shape, its choice as published, and the deepest model
 * of its width that fits (its layer count when it fits as published). */
typedef struct mt_plan_fit {
    const char *shape;
    int64_t layers, params;
    mt_layout_choice choice;
    uint64_t host_bytes;        /* the chosen layout's host total */
    int64_t max_layers;         /* 0: not one layer fits */
    int64_t max_params;
    mt_host_layout max_layout;  /* the layout chosen at max_layers */
} mt_plan_fit;

/* The most of cfg's first layers (mt_config_set_layers: what --layers keeps) whose host plan fits
 * `available` under `request`, by bisection (bytes grow with the layers): *max_layers (0: not one
 * layer fits; cfg->layers when the whole model fits), and at that count its parameters and
 * layout. 0, or -1 with err set (a plan failed). */
int mt_plan_max_layers(const mt_model_config *cfg, const mt_plan_params *params, mt_host_layout request,
                       uint64_t available, int64_t *max_layers, int64_t *max_params, mt_host_layout *max_layout,
                       char *err, size_t errlen);

/* The rows of every published shape, with params' batch, dtype and GPU and the layout request.
 * Returns MT_PLAN_NSHAPES, or -1 with err set (the batch does not plan). */
int mt_plan_fit_shapes(const mt_plan_params *params, mt_host_layout request, uint64_t available,
                       mt_plan_fit rows[MT_PLAN_NSHAPES], char *err, size_t errlen);
/* The rows as a table: shape, parameters, layout, host bytes and per parameter, fits or refused
 * (and then the layers of that width that fit). */
void mt_plan_print_fits(const mt_plan_fit *rows, int n, FILE *out);

/* Checks the host side against `available_bytes`. The rule: the plan fits when it needs at most
 * MT_PLAN_HOST_USABLE_PERCENT of what is available. Returns 0, or -1 with a message saying what
 * the plan needs, what there is, and what to change. */
int mt_plan_check_host(const mt_plan *plan, uint64_t available_bytes, char *err, size_t errlen);

/* Checks the GPU side against a device of `device_bytes`: the plan fits when its gpu_need (the
 * buffers, StarPU's margin and the CUDA context) is at most that. A plan without a GPU always
 * fits. Returns 0, or -1 with a message giving the need by kind (weights and gradients in flight,
 * checkpoints, block activations, workspaces and inputs, margin, context), the device's size, and
 * what to change. */
int mt_plan_check_gpu(const mt_plan *plan, uint64_t device_bytes, char *err, size_t errlen);

/* The checkpoints on the GPU at once when they are offloaded, over `accum` micro-batches of
 * `nblocks` blocks each: those of a block boundary (accum: written there in the forward, and the
 * last block's, which keep no host home and are read first by the backward), one more (with K = 1
 * a layer reads one boundary's while it writes the next's; else one still draining home), and
 * one fetched back ahead of the next recompute: accum + 2, at most nblocks x accum. The step
 * graph and the plan both count this (runtime/step/graph.c, mt_graph_working_bytes). */
int64_t mt_plan_offload_in_flight(int64_t nblocks, int64_t accum);
/* The micro-batches of a step that one device computes: micro-batch u runs on device u mod
 * devices, so ceil(grad_accum / devices); grad_accum with one device. */
int64_t mt_plan_device_micro_batches(const mt_plan_params *params);

/* Whether --offload-checkpoints auto turns it on for params (its offload_checkpoints ignored)
 * on a device of gpu_memory bytes: a GPU plan whose need with the checkpoints kept on the GPU is
 * over gpu_memory, where offloading them lowers it. False without a GPU or a device size (0). */
bool mt_plan_offload_needed(const mt_model_config *cfg, const mt_plan_params *params, uint64_t gpu_memory);

/* What StarPU may allocate on the GPU for the plan's buffers (its STARPU_LIMIT_CUDA_MEM, bench's
 * cap): gpu_total and the margin, in MiB rounded down. */
uint64_t mt_plan_gpu_limit_mib(const mt_plan *plan);

/* The memory of the first CUDA device (cudaGetDeviceProperties' total, without creating a
 * context); 0 in a build without CUDA or without a device. Memory other processes hold on it is
 * not taken off. */
uint64_t mt_gpu_memory_total(void);

/* The GPU memory a run with `ncuda` CUDA workers is checked against: `given` (--gpu-memory) when
 * not 0, else mt_gpu_memory_total(); 0 (no check) without CUDA workers. *source says which
 * ("--gpu-memory", "device 0", "none"). */
uint64_t mt_plan_gpu_memory(uint64_t given, int ncuda, const char **source);

/* A run's plan chosen on both sides: the host layout (mt_plan_choose) and, with K asked as
 * MT_PLAN_K_AUTO, the checkpoint interval. */
typedef struct mt_run_choice {
    mt_layout_choice layout;   /* the host side, at the chosen K */
    bool k_auto;               /* K was asked as auto */
    int64_t K;                 /* the plan's K: chosen, or as given clamped to the layers */
    uint64_t gpu_memory;       /* the device's bytes the GPU side is checked against; 0: not checked */
    bool gpu_checked;          /* a GPU plan and a known device size */
    bool gpu_fits;             /* true also when not checked */
    bool fits;                 /* layout.fits && gpu_fits */
    char why_k[320];           /* with auto: the choice of K in one sentence */
    bool offload_auto;         /* offload_checkpoints was asked as auto */
    bool offload;              /* the plan's: checkpoints offloaded to host memory */
    char why_offload[320];     /* the choice of offload in one sentence */
    bool mlp_chunk_auto;       /* cfg's mlp_chunk was MT_PLAN_MLP_CHUNK_AUTO */
    int64_t mlp_chunk;         /* the plan's dense MLP chunk (0: all tokens at once) */
    char why_mlp_chunk[320];   /* with auto, when it chose chunks: why, in one sentence */
} mt_run_choice;

/* cfg->mlp_chunk asked as "auto" (--mlp-chunk auto, the default): mt_plan_choose_run runs the
 * dense MLP over all tokens at once where that plan fits, else in the largest of
 * MT_PLAN_MLP_CHUNKS that fits. Without a plan (grads, eval) auto is 0. */
#define MT_PLAN_MLP_CHUNK_AUTO MT_MLP_CHUNK_AUTO

/* Plans params under the host layout `request` against `host_available` bytes and, for a GPU
 * plan, `gpu_memory` device bytes (0: the GPU side is not checked). With checkpoint_interval
 * MT_PLAN_K_AUTO: the largest K from the layer count down whose plan fits both sides; when none
 * does, the K whose plan needs least where it does not fit (the GPU's need when that side fails,
 * else the host's), refused. With offload_checkpoints MT_PLAN_OFFLOAD_AUTO: off when that plan
 * (with auto's K) fits, else on when that one fits (its own K); when neither fits, the one nearer
 * to fitting, refused. With k_default, a K whose plan does not fit gives way to the smallest
 * larger K whose plan fits, if one does (run->k_auto then set, why_k saying so). Offloading
 * moves two copies of each checkpoint a step over the bus and pins host memory for them, so auto
 * takes it only where the GPU needs it. *plan is the chosen one's. Returns 0 whether it fits or
 * not, or -1 with plan->error set. */
int mt_plan_choose_run(const mt_model_config *cfg, const mt_plan_params *params, mt_host_layout request,
                       uint64_t host_available, uint64_t gpu_memory, mt_plan *plan, mt_run_choice *run);
/* With cfg->mlp_chunk MT_PLAN_MLP_CHUNK_AUTO, mt_plan_choose_run tries the MLP unchunked first,
 * then chunks of these many tokens, largest first (those below the tokens of a micro-batch),
 * each with the K and offload the rules above pick; the first run that fits is chosen, else the
 * smallest chunk's, refused. Chunks recompute the MLP's gate and up in the backward (two of its
 * three GEMMs again), so auto takes them only where memory needs them. */
/* Why a run that does not fit is refused, host first (mt_plan_check_host, else the layout's why),
 * then the GPU (mt_plan_check_gpu), with auto's choice of K in front; returns -1, or 0 when it
 * fits. */
int mt_plan_run_refusal(const mt_plan *plan, const mt_run_choice *run, char *err, size_t errlen);
/* The GPU side's lines: the need against the device (or that it is not checked, and why), with
 * auto the choice of K, and where the checkpoints live and why. Nothing for a plan without a GPU
 * but the K line. */
void mt_plan_print_run(const mt_plan *plan, const mt_run_choice *run, const char *gpu_source, FILE *out);

/* Host memory available to a new run now: MemAvailable from /proc/meminfo, else the free
 * physical pages from sysconf; 0 when neither can be read. */
uint64_t mt_host_memory_available(void);

/* The bytes the training data at `path` holds once loaded (runtime/data.c, runtime/dataset.c):
 * the sizes of the regular files it names (a file, or a directory's files but hidden ones,
 * fortune indexes *.dat and a prepared directory's meta.json). Returns 0, or -1 with err naming
 * the path when it cannot be read. */
int mt_plan_data_bytes(const char *path, uint64_t *bytes, char *err, size_t errlen);

/* The StarPU workers mt_runtime_init starts for the requests (-1: its default) on this machine,
 * found without starting StarPU: CUDA workers, every CUDA device unless told (none in a build
 * without CUDA; a count asked for is kept whatever the build, so that a plan can be made for a
 * GPU run elsewhere); CPU workers, one per core (hwloc) less one per CUDA worker, which drives its
 * device from a core of its own, and at least one. */
void mt_plan_workers(int ncpu_request, int ncuda_request, int *ncpu, int *ncuda);

/* This process's peak resident set (VmHWM of /proc/self/status) and its resident set now (VmRSS),
 * in bytes; 0 when they cannot be read. */
uint64_t mt_host_peak_rss(void);
uint64_t mt_host_rss(void);

/* Bytes of activations, workspaces and inputs (where the compute runs) of a plan. */
uint64_t mt_plan_activation_bytes(const mt_plan *plan);

/* Gradient accumulation: splits tokens_per_step (a multiple of base->seq_len) into the largest
 * micro-batch whose activations fit in `budget` bytes and the number of micro-batches; with K
 * MT_PLAN_K_AUTO, a micro-batch's activations are the least over every K (auto then picks K on
 * both sides' memory). Returns 0, or -1 with err set (not a multiple, or one sequence alone does
 * not fit). */
int mt_plan_micro_batch(const mt_model_config *cfg, const mt_plan_params *base, int64_t tokens_per_step,
                        uint64_t budget, int64_t *micro_batch, int64_t *grad_accum, char *err, size_t errlen);

/* Writes `bytes` in binary units ("1.50 GiB") into buf; returns buf. */
const char *mt_format_bytes(uint64_t bytes, char *buf, size_t len);

#endif
