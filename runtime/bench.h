/* `megatrain bench`: one named shape, random weights, the real training step on the GPU (or CPU
 * workers), measured over several steps after warm-up: step time, tokens/s, model TFLOP/s, bus
 * traffic, GPU busy fraction, AdamW standalone and in the step, the step-boundary gap, memory, and
 * where the GPU sat idle (from the megatrain policy's trace). */
#ifndef MT_RUNTIME_BENCH_H
#define MT_RUNTIME_BENCH_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "runtime/policy.h"
#include "runtime/runtime.h"
#include "runtime/step.h"

#define MT_BENCH_MAX_SWEEP 8
#define MT_GPU_MAX_NAMES 12      /* task names told apart; more fold into the last, "other" */
#define MT_GPU_LONGEST 5         /* longest single gaps kept */
#define MT_BENCH_HEARTBEAT_S 5.0 /* the log's silence at most, in a long phase */

/* GPU idle before the tasks of one name. */
typedef struct mt_gpu_idle {
    const char *name;
    int tasks, gaps;             /* tasks of this name; those that had the GPU idle before them */
    double idle_s, inputs_s;     /* summed idle; of which the task was popped, its inputs on the way */
} mt_gpu_idle;

/* One gap: no task on a CUDA worker from at_s (the last end) to the start of `name`. */
typedef struct mt_gpu_gap {
    const char *name;
    int tile;                    /* the next task's tile (mt_policy_trace_record), -1 unknown */
    double at_s, idle_s, inputs_s;
    int step;                    /* filled by the bench: the step whose embedding started last before at_s, 0 unknown */
    double since_step_s;         /* at_s after that start */
} mt_gpu_gap;

typedef enum mt_gpu_trace_status { MT_GPU_TRACE_OK, MT_GPU_TRACE_OTHER_POLICY, MT_GPU_TRACE_NO_CUDA } mt_gpu_trace_status;

/* Where the CUDA workers' time went over a window: busy while at least one task is between its
 * start and end, idle otherwise, each gap charged to the task that ends it. */
typedef struct mt_gpu_breakdown {
    mt_gpu_trace_status status;
    int tasks, dropped;          /* records; trace events that did not fit */
    double span_s;               /* first start to last end */
    double busy_s, idle_s, inputs_s;
    int nnames;
    mt_gpu_idle names[MT_GPU_MAX_NAMES];    /* most idle first */
    int nlongest;
    mt_gpu_gap longest[MT_GPU_LONGEST];     /* longest first */
} mt_gpu_breakdown;

/* Pure: the breakdown of trace records (any order; sorted here by start in place). The idle
 * before task i is max(0, start_i - the latest end among tasks that started before it); of it,
 * "inputs" is the part after the task was popped (start_i - max(pop_i, that end)), the rest
 * waited for the task to become ready. Status MT_GPU_TRACE_OK, dropped 0. */
void mt_bench_gpu_breakdown(mt_policy_trace_record *records, int n, mt_gpu_breakdown *out);
/* Sorts trace records by start (then end) in place. */
void mt_bench_sort_records(mt_policy_trace_record *records, int n);

/* One CUDA worker's time over the window (mt_bench_gpu_breakdowns). */
typedef struct mt_gpu_share {
    int worker, tasks;
    double span_s, busy_s, idle_s, inputs_s;
} mt_gpu_share;
#define MT_BENCH_MAX_GPUS 64     /* CUDA workers whose shares a result keeps */

/* Pure: each worker's records apart (a task on one GPU does not keep another busy): the breakdown
 * of each worker's, its share into each[0, min(count, max)), and into *out the breakdown of the
 * least busy one (busy_s / span_s; the first in worker order of equals). Sorts the records by
 * worker, then start, in place. Returns the number of workers (0: *out as of no record). */
int mt_bench_gpu_breakdowns(mt_policy_trace_record *records, int n, mt_gpu_share *each, int max, mt_gpu_breakdown *out);

typedef struct mt_bench_options {
    const char *shape;            /* mt_config_from_shape name, unless config_path is set */
    const char *config_path;      /* NULL, or an HF config.json whose model is timed instead */
    mt_step_config step;          /* B, T, accum, K, clip */
    int warmup, steps;            /* steps not measured, then measured */
    bool resident;                /* no GPU memory limit: no weight is ever evicted */
    bool prefetch;                /* the megatrain policy's next-layer prefetch (default on) */
    uint64_t gpu_limit_mib;       /* 0: from the run's buffer sizes (ignored when resident) */
    double gpu_limit_margin;      /* > 0: the limit is the plan plus this many percent; 0: plus 2%
                                   * and 256 MiB for StarPU's own small allocations */
    int64_t layers;               /* > 0: override the shape's layer count (memory-bound tests) */
    const char *norm_log;         /* NULL, or a CSV file: every norm's sums of squares per tile */
    const char *task_log;         /* NULL, or a CSV file: every task of the measured steps, every worker's */
    const char *rope_scaling;     /* NULL, or a --rope-scaling value (mt_config_set_rope_scaling) */
    const char *data;             /* NULL: one batch of random tokens, the same every step (what the
                                   * PyTorch script feeds); else a text file or directory (bytes
                                   * as tokens) or a prepared directory: a fresh batch each step */
    mt_dtype dtype;               /* weights and compute: bf16 (default) or fp32 (exact, slower) */
    mt_host_layout host_layout;   /* the host state's (runtime/plan.h): AUTO (default), FULL or COMPACT */
    uint64_t gpu_memory;          /* the GPU plan is checked against this many bytes before StarPU
                                   * starts; 0: the device's (mt_plan_gpu_memory). step.K (and the
                                   * sweep's one K) may be MT_PLAN_K_AUTO: the largest K that fits */
    bool k_default;               /* step.K is a default, not asked for: where its plan does not
                                   * fit, the smallest larger K that fits (mt_plan_params.k_default) */
    double heartbeat_s;           /* > 0: a phase (the host state's set-up, a step) longer than this is
                                   * named on the log again every heartbeat_s; 0: MT_BENCH_HEARTBEAT_S */
    mt_runtime_options runtime;
    /* Sweeps: every (K, clip) pair is measured on the same host state, one graph after the
     * other, so the costly state set-up happens once. 0 entries: step.K and step.clip only. The
     * GPU limit is the largest plan's; peaks after the first pair may include buffers StarPU
     * still caches from the earlier graphs. */
    int nsweep_K, nsweep_clip;
    int sweep_K[MT_BENCH_MAX_SWEEP];
    double sweep_clip[MT_BENCH_MAX_SWEEP];
    /* Also swept on the same host state, inside the pairs: step.adamw_defer's values (deferral
     * on and off compared on one machine state), then step.ranged_bounds'. 0 entries: the one value.
     * A value may repeat (runs of one setting, for their spread). Each run trains on from the
     * state the last one left (and, with data, on the next batches), so later runs see a model
     * further on: alternate the settings to compare them. */
    int nsweep_defer, nsweep_bounds;
    int sweep_defer[MT_BENCH_MAX_SWEEP];
    int sweep_bounds[MT_BENCH_MAX_SWEEP];
} mt_bench_options;

typedef struct mt_bench_result {
    double step_s, tokens_per_s, tflops;          /* medians; TFLOP/s = (6N + 6LdT) tokens / time */
    double h2d_gb, d2h_gb, h2d_gbs, d2h_gbs;      /* per step; rates over the measured window */
    double gpu_busy;                              /* executing / total of the CUDA workers, their mean */
    double gpu_busy_min;                          /* the least busy CUDA worker's */
    int ncuda;                                    /* CUDA workers */
    double p2p_gb;                                /* per step: bytes between GPUs (peer to peer) */
    double gpu_idle_s;                            /* per step, the CUDA workers' mean; NAN when not traced */
    mt_gpu_breakdown gpu;                         /* the measured window's GPU time: the least busy
                                                   * CUDA worker's (the only one's with one) */
    int ngpu_shares;                              /* CUDA workers traced (gpu_each: the first
                                                   * MT_BENCH_MAX_GPUS of them) */
    mt_gpu_share gpu_each[MT_BENCH_MAX_GPUS];
    double adamw_standalone_s, adamw_s_per_gparam;
    double adamw_step_cpu_s;                      /* per step: CPU workers' seconds in AdamW tasks */
    double adamw_step_s_per_gparam;               /* the same over the CPU workers and 1e9 parameters:
                                                   * AdamW's rate inside the step, next to the standalone one */
    double adamw_span_s, adamw_tail_s;            /* first to last AdamW end; last AdamW end after the backward */
    double boundary_gap_s;                        /* layer 0's backward end to next forward start */
    double peak_gpu_gib, peak_host_gib;           /* peak GPU: StarPU's buffers, sampled at task ends */
    double plan_gpu_gib;                          /* the memory plan's GPU total for the same run */
    double device_used_gib;                       /* whole device in use at the end (context, libraries, cache) */
    double loss_first, loss_last;
    bool cuda;                                    /* a CUDA worker ran: the table has its GPU columns */
    int ncpu;                                     /* CPU workers */
    uint64_t gpu_limit_mib;
    double checkpoint_gib;                        /* one checkpoint: B*T*d fp32 */
    int64_t checkpoints;                          /* ceil(L / K) */
    int64_t layers;
    int K;                                        /* the pair this result measured */
    double clip;
    int defer, bounds;                            /* its adamw_defer and ranged_bounds (mt_ranged_bounds) as asked */
    bool deferred;                                /* its graph deferred the moments halves */
    int bounds_used;                              /* mt_ranged_bounds the passes ran (the CPU's fallback) */
    int64_t speculated, speculation_held;         /* steps with a speculative clipped update; of those, held */
    double ranged_spec, ranged_in, ranged_flagged; /* ranged speculation, measured steps: the share of the
                                                    * parameter updates speculated, the share of those
                                                    * whose scale was in range, of those flagged */
} mt_bench_result;

mt_bench_options mt_bench_defaults(void);
/* Measures every (K, clip) pair, for each adamw_defer and then ranged_bounds value; results[]
 * holds mt_bench_count entries, each printed to `table` (when not NULL) as soon as it is
 * measured. */
int mt_bench_run(const mt_bench_options *o, mt_bench_result *results, FILE *log, FILE *table, char *err, size_t errlen);
/* Number of results mt_bench_run fills. */
int mt_bench_count(const mt_bench_options *o);
/* What the logs and the table call the model: the config file's path, else the shape's name. */
const char *mt_bench_model_name(const mt_bench_options *o);
/* One row of the table (and its header). With a CUDA worker, the GPU table (its columns are
 * what tools/gpu_check.sh reads); without one, the CPU table: step time, tokens/s, model GFLOP/s,
 * AdamW, the step boundary, peak host memory. */
void mt_bench_print(const mt_bench_options *o, const mt_bench_result *r, bool header, FILE *out);
void mt_bench_print_notes(const mt_bench_options *o, const mt_bench_result *r, int count, FILE *out);
/* The GPU time of one pair (mt_bench_run writes it to the log after the pair's row). */
void mt_bench_print_gpu(const mt_bench_options *o, const mt_bench_result *r, FILE *out);

#endif
