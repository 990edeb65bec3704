/* The memory-bound kernels of a layer call, the head and the conversions, timed against the
 * device's own copy bandwidth: test_cuda's MT_CUDA_BENCH=1 table (cuda_kernel_bench.cu). */
#ifndef MT_TESTS_CUDA_KERNEL_BENCH_H
#define MT_TESTS_CUDA_KERNEL_BENCH_H

#include <stdint.h>

#include "models/config.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mt_test_kernel_timing {
    char name[48];  /* e.g. "rmsnorm forward" */
    char shape[48]; /* e.g. "4096x2048" */
    double ms;      /* median over the runs, cudaEvent */
    int64_t bytes;  /* the least traffic: every input read once, every output written once */
} mt_test_kernel_timing;
#define MT_TEST_BENCH_MAX_KERNELS 32

/* Times the memory-bound kernels of a layer call at (B, T), the conversions and sum of squares
 * on a layer tile's worth of elements, the embedding over B*T tokens and the head's
 * cross-entropy over B*T rows: each launched as the model code does, on its own random buffers
 * (about 10 GiB at a 3B shape), one warm-up then `reps` runs with L2 flushed before each. out[0]
 * is the baseline: a cudaMemcpyAsync of 1 GiB device to device, bytes = 2 GiB (read + write).
 * Returns the entries filled (aborts if max is too small). Allocates and synchronises the
 * device, unlike the launchers it times. */
int mt_test_bench_memory_kernels(const mt_model_config *cfg, int64_t B, int64_t T, int reps,
                                 mt_test_kernel_timing *out, int max);

#ifdef __cplusplus
}
#endif

#endif
