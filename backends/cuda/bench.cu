// mt_cuda_bench_memory_kernels: the memory-bound kernels timed against the device's own copy
// bandwidth (test_cuda's MT_CUDA_BENCH=1 table). Here: the harness of bench.cuh, the copy
// baseline, and the kernels behind public launchers; layer.cu and head.cu time their own.
extern "C" { // C header without its own linkage guard: mt_layout_build
#include "models/layout.h"
}

#include <algorithm>

#include "backends/cuda/bench.cuh"

// splitmix64: a counter-based hash, so every random value is a pure function of (seed, index).
static __host__ __device__ __forceinline__ uint64_t splitmix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static __device__ __forceinline__ void store(float *p, float v) { *p = v; }
static __device__ __forceinline__ void store(bf16 *p, float v) { *p = f2bf(v); }

// x (n) = uniform in [-1, 1): 24 bits of the hash of (seed, i).
template <class T> __global__ static void random_fill_kernel(T *x, int64_t n, uint64_t seed)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        store(&x[i], (float)(splitmix64((seed << 40) ^ (uint64_t)i) >> 40) * 0x1p-23f - 1.0f);
}

void *mt_kernel_bench_alloc(mt_kernel_bench *b, size_t bytes)
{
    MT_CUDA_REQUIRE(b->nbuffers < MT_KERNEL_BENCH_MAX_BUFFERS, "bench buffers: raise MT_KERNEL_BENCH_MAX_BUFFERS");
    void *p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, bytes > 0 ? bytes : MT_CUDA_SCRATCH_ALIGN));
    b->buffers[b->nbuffers++] = p;
    return p;
}

// The buffer's index seeds its values, so no two buffers hold the same numbers.
template <class T> static T *random_buffer(mt_kernel_bench *b, int64_t n)
{
    T *p = (T *)mt_kernel_bench_alloc(b, (size_t)(n > 0 ? n : 0) * sizeof(T));
    random_fill_kernel<<<mt_grid_for(n, 256), 256, 0, b->stream>>>(p, n, (uint64_t)b->nbuffers);
    CUDA_CHECK_LAUNCH();
    return p;
}

float *mt_kernel_bench_random_f32(mt_kernel_bench *b, int64_t n) { return random_buffer<float>(b, n); }
bf16 *mt_kernel_bench_random_bf16(mt_kernel_bench *b, int64_t n) { return random_buffer<bf16>(b, n); }

// The median as test_cuda's BENCH takes it: element reps / 2 of the sorted times.
void mt_kernel_bench_record(mt_kernel_bench *b, const char *name, const char *shape, int64_t bytes)
{
    std::sort(b->ms, b->ms + b->reps);
    mt_cuda_kernel_timing *t = &b->out[b->count++];
    snprintf(t->name, sizeof t->name, "%s", name);
    snprintf(t->shape, sizeof t->shape, "%s", shape);
    t->ms = b->ms[b->reps / 2];
    t->bytes = bytes;
}

// tokens (n) uniform in [0, V) on the device; returns how many distinct values they hold (the
// table rows the embedding must touch).
static int64_t random_tokens(mt_kernel_bench *b, int64_t n, int64_t V, int32_t **tokens)
{
    int32_t *host = (int32_t *)malloc((size_t)n * sizeof(int32_t));
    MT_CUDA_REQUIRE(host != nullptr, "out of host memory for %lld bench tokens", (long long)n);
    for (int64_t i = 0; i < n; i++) host[i] = (int32_t)(splitmix64((uint64_t)i) % (uint64_t)V);
    *tokens = (int32_t *)mt_kernel_bench_alloc(b, (size_t)n * sizeof(int32_t));
    CUDA_CHECK(cudaMemcpyAsync(*tokens, host, (size_t)n * sizeof(int32_t), cudaMemcpyHostToDevice, b->stream));
    CUDA_CHECK(cudaStreamSynchronize(b->stream)); // host is freed below
    std::sort(host, host + n);
    const int64_t distinct = std::unique(host, host + n) - host;
    free(host);
    return distinct;
}

extern "C" int mt_cuda_bench_memory_kernels(const mt_model_config *cfg, int64_t B, int64_t T, int reps,
                                            mt_cuda_kernel_timing *out, int max)
{
    MT_CUDA_REQUIRE(B > 0 && T > 0 && reps > 0, "bench B=%lld T=%lld reps=%d: all must be positive", (long long)B,
                    (long long)T, reps);
    MT_CUDA_REQUIRE(cfg->vocab > 0 && cfg->vocab <= INT32_MAX, "vocab %lld outside the int32 tokens",
                    (long long)cfg->vocab);
    mt_kernel_bench b;
    memset(&b, 0, sizeof b);
    b.reps = reps;
    b.out = out;
    b.max = max;
    b.ms = (float *)calloc((size_t)reps, sizeof(float));
    MT_CUDA_REQUIRE(b.ms != nullptr, "out of host memory for %d bench times", reps);
    CUDA_CHECK(cudaStreamCreateWithFlags(&b.stream, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreate(&b.start));
    CUDA_CHECK(cudaEventCreate(&b.stop));
    int device = 0, l2 = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
    b.flush_bytes = (size_t)4 * (size_t)(l2 > 0 ? l2 : 64 << 20);
    b.flush = mt_kernel_bench_alloc(&b, b.flush_bytes);
    const mt_cuda_stream s = (mt_cuda_stream)b.stream;

    // The baseline: copy bytes read + copy bytes written.
    const int64_t copy = (int64_t)1 << 30;
    const float *src = mt_kernel_bench_random_f32(&b, copy / (int64_t)sizeof(float));
    void *dst = mt_kernel_bench_alloc(&b, (size_t)copy);
    mt_kernel_bench_time(&b, "device copy (cudaMemcpyAsync)", "1 GiB", 2 * copy, [&] {
        CUDA_CHECK(cudaMemcpyAsync(dst, src, (size_t)copy, cudaMemcpyDeviceToDevice, b.stream));
    });

    mt_tile_layout layout;
    mt_layout_build(cfg, MT_TILE_LAYER, &layout);
    mt_kernel_bench_layer(&b, cfg, &layout, B, T);

    // A layer tile's worth of elements N: the conversions move 4 N + 2 N bytes either way, the
    // sum of squares reads 4 N and writes one double.
    const int64_t N = layout.numel;
    char shape[48];
    snprintf(shape, sizeof shape, "%lld", (long long)N);
    const float *f32 = mt_kernel_bench_random_f32(&b, N);
    mt_cuda_bf16 *bf = (mt_cuda_bf16 *)mt_kernel_bench_random_bf16(&b, N);
    float *f32_out = (float *)mt_kernel_bench_alloc(&b, (size_t)N * sizeof(float));
    double *sum = (double *)mt_kernel_bench_alloc(&b, sizeof(double));
    mt_kernel_bench_time(&b, "f32 -> bf16", shape, 6 * N, [&] { mt_cuda_f32_to_bf16(f32, bf, N, s); });
    mt_kernel_bench_time(&b, "bf16 -> f32", shape, 6 * N, [&] { mt_cuda_bf16_to_f32(bf, f32_out, N, s); });
    mt_kernel_bench_time(&b, "sum of squares", shape, 4 * N + (int64_t)sizeof(double),
                         [&] { mt_cuda_sumsq_f32(f32, N, sum, s); });

    // The embedding over n = B*T tokens of a (V, d) table, `distinct` of its rows touched.
    // forward: tokens 4 n + the touched rows 2 d distinct read, h0 4 n d written;
    // backward: tokens 4 n + dh0 4 n d read, the touched rows of dtable 4 d distinct read and
    // written (its key sort's traffic is overhead, not counted).
    const int64_t n = B * T, d = cfg->hidden, V = cfg->vocab;
    int32_t *tokens = nullptr;
    const int64_t distinct = random_tokens(&b, n, V, &tokens);
    const mt_cuda_bf16 *table = (const mt_cuda_bf16 *)mt_kernel_bench_random_bf16(&b, V * d); // (V, d)
    float *dtable = mt_kernel_bench_random_f32(&b, V * d);                                    // (V, d)
    float *h0 = (float *)mt_kernel_bench_alloc(&b, (size_t)(n * d) * sizeof(float));          // (n, d)
    const float *dh0 = mt_kernel_bench_random_f32(&b, n * d);                                 // (n, d)
    void *workspace = mt_kernel_bench_alloc(&b, mt_cuda_embedding_workspace_bytes(n, V));
    snprintf(shape, sizeof shape, "%lldx%lld of V %lld", (long long)n, (long long)d, (long long)V);
    mt_kernel_bench_time(&b, "embedding forward (gather)", shape, 4 * n + 2 * d * distinct + 4 * n * d,
                         [&] { mt_cuda_embedding_forward(n, d, MT_CUDA_BF16, table, tokens, h0, s); });
    mt_kernel_bench_time(&b, "embedding backward (scatter-add)", shape, 4 * n + 4 * n * d + 8 * d * distinct,
                         [&] { mt_cuda_embedding_backward(n, d, V, tokens, dh0, dtable, workspace, s); });

    mt_kernel_bench_head(&b, cfg, n, tokens);

    CUDA_CHECK(cudaStreamSynchronize(b.stream));
    for (int i = 0; i < b.nbuffers; i++) CUDA_CHECK(cudaFree(b.buffers[i]));
    CUDA_CHECK(cudaEventDestroy(b.start));
    CUDA_CHECK(cudaEventDestroy(b.stop));
    CUDA_CHECK(cudaStreamDestroy(b.stream));
    free(b.ms);
    return b.count;
}
