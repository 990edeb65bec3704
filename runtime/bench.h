/* `megatrain bench`: one named shape, random weights, the real training step on the GPU (or CPU
 * workers), measured over several steps after warm-up: step time, tokens/s, model TFLOP/s, bus
 * traffic, GPU busy fraction, AdamW standalone and in the step, the step-boundary gap, memory. */
#ifndef MT_RUNTIME_BENCH_H
#define MT_RUNTIME_BENCH_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "runtime.h"
#include "step.h"

#define MT_BENCH_MAX_SWEEP 8

typedef struct mt_bench_options {
    const char *shape;            /* mt_config_from_shape name */
    mt_step_config step;          /* B, T, accum, K, clip */
    int warmup, steps;            /* steps not measured, then measured */
    bool resident;                /* no GPU memory limit: no weight is ever evicted */
    bool prefetch;                /* the megatrain policy's next-layer prefetch */
    uint64_t gpu_limit_mib;       /* 0: from the run's buffer sizes (ignored when resident) */
    int64_t layers;               /* > 0: override the shape's layer count (memory-bound tests) */
    mt_runtime_options runtime;
    /* Sweeps: every (K, clip) pair is measured on the same host state, one graph after the
     * other, so the costly state set-up happens once. 0 entries: step.K and step.clip only. The
     * GPU limit is the largest plan's; peaks after the first pair may include buffers StarPU
     * still caches from the earlier graphs. */
    int nsweep_K, nsweep_clip;
    int sweep_K[MT_BENCH_MAX_SWEEP];
    double sweep_clip[MT_BENCH_MAX_SWEEP];
} mt_bench_options;

typedef struct mt_bench_result {
    double step_s, tokens_per_s, tflops;          /* medians; TFLOP/s = (6N + 6LdT) tokens / time */
    double h2d_gb, d2h_gb, h2d_gbs, d2h_gbs;      /* per step; rates over the measured window */
    double gpu_busy;                              /* executing / total of the CUDA worker */
    double adamw_standalone_s, adamw_s_per_gparam;
    double adamw_span_s, adamw_tail_s;            /* first to last AdamW end; last AdamW end after the backward */
    double boundary_gap_s;                        /* layer 0's backward end to next forward start */
    double peak_gpu_gib, peak_host_gib;           /* peak GPU: StarPU's buffers, sampled at task ends */
    double plan_gpu_gib;                          /* the memory plan's GPU total for the same run */
    double device_used_gib;                       /* whole device in use at the end (context, libraries, cache) */
    double loss_first, loss_last;
    uint64_t gpu_limit_mib;
    double checkpoint_gib;                        /* one checkpoint: B*T*d fp32 */
    int64_t checkpoints;                          /* ceil(L / K) */
    int64_t layers;
    int K;                                        /* the pair this result measured */
    double clip;
} mt_bench_result;

mt_bench_options mt_bench_defaults(void);
/* Measures every (K, clip) pair; results[] holds nsweep_K * nsweep_clip entries (at least 1),
 * each printed to `table` (when not NULL) as soon as it is measured. */
int mt_bench_run(const mt_bench_options *o, mt_bench_result *results, FILE *log, FILE *table, char *err, size_t errlen);
/* Number of results mt_bench_run fills. */
int mt_bench_count(const mt_bench_options *o);
void mt_bench_print(const mt_bench_options *o, const mt_bench_result *r, bool header, FILE *out);
void mt_bench_print_notes(const mt_bench_options *o, const mt_bench_result *r, int count, FILE *out);

#endif
