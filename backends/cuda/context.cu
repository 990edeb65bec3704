// The per-thread GPU context (options, cuBLASLt and cuBLAS handles, GEMM workspace, reduction partials) and the small
// whole-buffer kernels: fp32 <-> bf16 conversion and the deterministic sum of squares that the
// gradient-norm task uses.
#include "backends/cuda/common.cuh"

// Created on first use by the calling thread (or by mt_cuda_ctx_configure, without its device
// resources); never freed (it lives as long as the worker thread, and freeing at thread exit
// would synchronise the device at an arbitrary moment).
static thread_local mt_cuda_ctx *tls_ctx = nullptr;

// The calling thread's context, its device resources not necessarily created.
static mt_cuda_ctx *thread_ctx()
{
    if (tls_ctx) return tls_ctx;
    mt_cuda_ctx *ctx = (mt_cuda_ctx *)calloc(1, sizeof *ctx);
    MT_CUDA_REQUIRE(ctx != nullptr, "out of host memory for the CUDA context");
    tls_ctx = ctx;
    return ctx;
}

extern "C" void mt_cuda_ctx_configure(const mt_cuda_options *options) { thread_ctx()->options = *options; }

extern "C" mt_cuda_ctx *mt_cuda_ctx_get(void)
{
    mt_cuda_ctx *ctx = thread_ctx();
    if (ctx->ready) return ctx;
    CUDA_CHECK(cudaGetDevice(&ctx->device));
    CUBLAS_CHECK(cublasLtCreate(&ctx->lt));
    CUBLAS_CHECK(cublasCreate(&ctx->blas));
    // fp32 accumulation in every GEMM: no reduced-precision split-K reductions for bf16 outputs
    // (fp32 operands never use TF32 under CUBLAS_COMPUTE_32F).
    CUBLAS_CHECK(cublasSetMathMode(ctx->blas, (cublasMath_t)(CUBLAS_DEFAULT_MATH |
                                                              CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
    // The only allocations of the backend: once per thread, here, never inside a launcher.
    ctx->gemm_workspace_bytes = MT_CUDA_GEMM_WORKSPACE;
    CUDA_CHECK(cudaMalloc(&ctx->gemm_workspace, ctx->gemm_workspace_bytes));
    CUDA_CHECK(cudaMalloc((void **)&ctx->reduce_partials, MT_CUDA_REDUCE_BLOCKS * sizeof(double)));
    CUDA_CHECK(cudaHostAlloc((void **)&ctx->host_offsets, (MT_MAX_EXPERTS + 1) * sizeof(int32_t), cudaHostAllocMapped));
    ctx->gemm_cache = nullptr;
    ctx->ready = true;
    return ctx;
}

// ---- conversions ----

__global__ static void f32_to_bf16_kernel(const float *in, bf16 *out, int64_t n)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        out[i] = f2bf(in[i]);
}

__global__ static void bf16_to_f32_kernel(const bf16 *in, float *out, int64_t n)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        out[i] = bf2f(in[i]);
}

// in (n) fp32 -> out (n) bf16, round to nearest even (as mt_f32_to_bf16)
extern "C" void mt_cuda_f32_to_bf16(const float *in, mt_cuda_bf16 *out, int64_t n, mt_cuda_stream stream)
{
    if (n <= 0) return;
    f32_to_bf16_kernel<<<mt_grid_for(n, 256), 256, 0, as_stream(stream)>>>(in, as_bf16(out), n);
    CUDA_CHECK_LAUNCH();
}

// in (n) bf16 -> out (n) fp32, exact
extern "C" void mt_cuda_bf16_to_f32(const mt_cuda_bf16 *in, float *out, int64_t n, mt_cuda_stream stream)
{
    if (n <= 0) return;
    bf16_to_f32_kernel<<<mt_grid_for(n, 256), 256, 0, as_stream(stream)>>>(as_bf16(in), out, n);
    CUDA_CHECK_LAUNCH();
}

template <> void mt_cuda_from_f32<bf16>(const float *in, bf16 *out, int64_t n, cudaStream_t stream)
{
    mt_cuda_f32_to_bf16(in, reinterpret_cast<mt_cuda_bf16 *>(out), n, stream);
}

template <> void mt_cuda_from_f32<float>(const float *in, float *out, int64_t n, cudaStream_t stream)
{
    if (n > 0 && in != out)
        CUDA_CHECK(cudaMemcpyAsync(out, in, (size_t)n * sizeof(float), cudaMemcpyDeviceToDevice, stream));
}

// ---- sum of squares: two stages, no atomics, so the result is bitwise repeatable ----

enum { SUMSQ_THREADS = 256 };

// Stage 1: block b sums x^2 over its grid-stride share in double -> partials[b].
__global__ static void sumsq_partial_kernel(const float *x, int64_t n, double *partials)
{
    __shared__ double shared[32];
    double acc = 0;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const double v = (double)x[i];
        acc += v * v;
    }
    acc = mt_block_sum(acc, shared);
    if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// Stage 2: one block sums the partials in a fixed order -> out[0] (=).
__global__ static void sumsq_final_kernel(const double *partials, int nparts, double *out)
{
    __shared__ double shared[32];
    double acc = 0;
    for (int i = threadIdx.x; i < nparts; i += blockDim.x) acc += partials[i];
    acc = mt_block_sum(acc, shared);
    if (threadIdx.x == 0) out[0] = acc;
}

void mt_cuda_sum_partials(const double *partials, int nparts, double *out, cudaStream_t stream)
{
    sumsq_final_kernel<<<1, SUMSQ_THREADS, 0, stream>>>(partials, nparts, out);
    CUDA_CHECK_LAUNCH();
}

// out[0] (device double) = sum of x (n)^2. Uses the calling thread's context partials.
extern "C" void mt_cuda_sumsq_f32(const float *x, int64_t n, double *out, mt_cuda_stream stream)
{
    mt_cuda_ctx *ctx = mt_cuda_ctx_get();
    int64_t blocks = (n + SUMSQ_THREADS * 8 - 1) / (SUMSQ_THREADS * 8); // >= 8 elements a thread
    if (blocks < 1) blocks = 1;
    if (blocks > MT_CUDA_REDUCE_BLOCKS) blocks = MT_CUDA_REDUCE_BLOCKS;
    sumsq_partial_kernel<<<(unsigned)blocks, SUMSQ_THREADS, 0, as_stream(stream)>>>(x, n > 0 ? n : 0,
                                                                                     ctx->reduce_partials);
    CUDA_CHECK_LAUNCH();
    mt_cuda_sum_partials(ctx->reduce_partials, (int)blocks, out, as_stream(stream));
}
