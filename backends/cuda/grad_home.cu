// A gradient on its way home. The copies of several devices added, element by element, and the
// sum copied into the tile's gradient (codelets/reduce.h); then, in the compact host layout (backends/cpu/grad_home.h), the
// fp32 accumulator rounded to bf16 (nearest even, as the host), and the sum of squares of those
// bf16 values in double, in two stages without atomics so that it repeats bit for bit (as
// mt_cuda_sumsq_f32).
#include "backends/cuda/common.cuh"

// One correctly rounded fp32 add per element, the CPU's sum exactly. By hand: cuBLAS's saxpy would
// do the same add through a cuBLAS handle per worker, which the backend's context does not keep
// (it holds cuBLASLt's).
__global__ static void add_kernel(float *y, const float *x, int64_t n)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = __fadd_rn(y[i], x[i]);
}

extern "C" void mt_cuda_add_f32(float *y, const float *x, int64_t n, mt_cuda_stream stream)
{
    if (n <= 0) return;
    add_kernel<<<mt_grid_for(n, 256), 256, 0, as_stream(stream)>>>(y, x, n);
    CUDA_CHECK_LAUNCH();
}

extern "C" void mt_cuda_copy_f32(float *y, const float *x, int64_t n, mt_cuda_stream stream)
{
    if (n <= 0) return;
    CUDA_CHECK(cudaMemcpyAsync(y, x, (size_t)n * sizeof(float), cudaMemcpyDeviceToDevice, as_stream(stream)));
}

enum { GRAD_HOME_THREADS = 256 };

// Stage 1: block b converts its grid-stride share and sums the squares of the bf16 values ->
// partials[b]; stage 2 is mt_cuda_sum_partials.
__global__ static void grad_home_kernel(const float *acc, bf16 *out, int64_t n, double *partials)
{
    __shared__ double shared[32];
    double s = 0;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const bf16 b = f2bf(acc[i]);
        out[i] = b;
        const double x = (double)bf2f(b);
        s += x * x;
    }
    s = mt_block_sum(s, shared);
    if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

extern "C" void mt_cuda_grad_home(const float *acc, mt_cuda_bf16 *out, int64_t n, double *sumsq, mt_cuda_stream stream)
{
    if (n <= 0 && !sumsq) return;
    mt_cuda_ctx *ctx = mt_cuda_ctx_get();
    int64_t blocks = (n + GRAD_HOME_THREADS * 8 - 1) / (GRAD_HOME_THREADS * 8); // >= 8 elements a thread
    if (blocks < 1) blocks = 1;
    if (blocks > MT_CUDA_REDUCE_BLOCKS) blocks = MT_CUDA_REDUCE_BLOCKS;
    grad_home_kernel<<<(unsigned)blocks, GRAD_HOME_THREADS, 0, as_stream(stream)>>>(acc, as_bf16(out), n > 0 ? n : 0,
                                                                                    ctx->reduce_partials);
    CUDA_CHECK_LAUNCH();
    if (sumsq) mt_cuda_sum_partials(ctx->reduce_partials, (int)blocks, sumsq, as_stream(stream)); // stage 2
}
