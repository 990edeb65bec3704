// The timing harness behind mt_cuda_bench_memory_kernels (bench.cu): the files that own static
// kernels (layer.cu, head.cu) time them through it, launched by the same helpers their own code
// uses. For benchmarks only: it allocates, and synchronises after every run. Internal to
// backends/cuda.
#ifndef MT_BACKENDS_CUDA_BENCH_CUH
#define MT_BACKENDS_CUDA_BENCH_CUH

#include "backends/cuda/common.cuh"

#define MT_KERNEL_BENCH_MAX_BUFFERS 64

// One bench call's state: its stream and events, the L2 flush buffer, the device buffers it
// frees at the end, and the table being filled.
struct mt_kernel_bench {
    cudaStream_t stream;
    cudaEvent_t start, stop;
    int reps;
    float *ms; // (reps) this kernel's times
    void *flush;
    size_t flush_bytes; // a few times the L2: rewritten before each run
    void *buffers[MT_KERNEL_BENCH_MAX_BUFFERS];
    int nbuffers;
    mt_cuda_kernel_timing *out;
    int count, max;
};

// Device buffer of `bytes`, contents undefined, freed when the bench call returns.
void *mt_kernel_bench_alloc(mt_kernel_bench *b, size_t bytes);
// Device buffers of n elements uniform in [-1, 1) (a different stream of numbers per call).
float *mt_kernel_bench_random_f32(mt_kernel_bench *b, int64_t n);
bf16 *mt_kernel_bench_random_bf16(mt_kernel_bench *b, int64_t n);
// Appends {name, shape, median of b->ms, bytes} to the table.
void mt_kernel_bench_record(mt_kernel_bench *b, const char *name, const char *shape, int64_t bytes);

// Times launch() (enqueues on b->stream): one warm-up run, then b->reps timed runs between two
// cudaEvents. The flush buffer is rewritten before every run, outside the events, so inputs come
// from HBM as they do inside a step (a (4096, 2048) fp32 tensor would otherwise sit in L2).
template <class F>
static void mt_kernel_bench_time(mt_kernel_bench *b, const char *name, const char *shape, int64_t bytes, F launch)
{
    MT_CUDA_REQUIRE(b->count < b->max, "more kernels than the %d table entries given: pass MT_CUDA_BENCH_MAX_KERNELS",
                    b->max);
    for (int r = -1; r < b->reps; r++) { // r = -1: the warm-up, not recorded
        CUDA_CHECK(cudaMemsetAsync(b->flush, 0, b->flush_bytes, b->stream));
        if (r >= 0) CUDA_CHECK(cudaEventRecord(b->start, b->stream));
        launch();
        if (r < 0) continue;
        CUDA_CHECK(cudaEventRecord(b->stop, b->stream));
        CUDA_CHECK(cudaEventSynchronize(b->stop));
        CUDA_CHECK(cudaEventElapsedTime(&b->ms[r], b->start, b->stop));
    }
    mt_kernel_bench_record(b, name, shape, bytes);
}

// The sections that time static kernels, called by mt_cuda_bench_memory_kernels in table order.
// layer.cu: RMSNorm, RoPE, q/k-norm, SwiGLU and the bias/norm weight gradients of one layer call
// at (B, T); `layout` is cfg's layer tile layout.
void mt_kernel_bench_layer(mt_kernel_bench *b, const mt_model_config *cfg, const mt_tile_layout *layout, int64_t B,
                           int64_t T);
// head.cu: cross-entropy over `rows` rows of logits, targets (rows) in [0, V).
void mt_kernel_bench_head(mt_kernel_bench *b, const mt_model_config *cfg, int64_t rows, const int32_t *targets);

#endif
