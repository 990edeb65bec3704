// RMSNorm forward and backward on the GPU, mirroring backends/cpu/rmsnorm.inc operation by
// operation (double sums, the same float products) so the two differ only by summation order
// and the bf16 rounding of the outputs the GEMMs consume.
#include "colsum.cuh"
#include "rmsnorm.cuh"

enum { NORM_THREADS = 256 };

// One block per row: sum of squares in double, then y = (x s) w.
__global__ static void rmsnorm_forward_kernel(int64_t d, const float *x, const bf16 *w, double eps, bf16 *y,
                                              float *inv_rms)
{
    __shared__ double shared[32];
    const int64_t r = blockIdx.x;
    const float *xr = x + r * d;
    double ss = 0;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) ss += (double)xr[j] * (double)xr[j];
    ss = mt_block_sum(ss, shared);
    const float s = (float)(1.0 / sqrt(ss / (double)d + eps));
    bf16 *yr = y + r * d;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) yr[j] = f2bf(xr[j] * s * bf2f(w[j]));
    if (inv_rms && threadIdx.x == 0) inv_rms[r] = s;
}

__global__ static void rmsnorm_apply_kernel(int64_t n, int64_t d, const float *x, const bf16 *w,
                                            const float *inv_rms, bf16 *y)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n * d; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = f2bf(x[i] * inv_rms[i / d] * bf2f(w[i % d]));
}

// One block per row: dot = sum (w dy) x in double; dx = resid + s (w dy - x c), c = dot/d s^2.
__global__ static void rmsnorm_backward_kernel(int64_t d, const float *x, const bf16 *w, const float *inv_rms,
                                               const float *dy, const float *resid, float *dx, bf16 *dx_bf16)
{
    __shared__ double shared[32];
    const int64_t r = blockIdx.x;
    const float *xr = x + r * d, *dyr = dy + r * d;
    const float s = inv_rms[r];
    double dot = 0;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) dot += (double)(bf2f(w[j]) * dyr[j]) * (double)xr[j];
    dot = mt_block_sum(dot, shared);
    const float c = (float)(dot / (double)d) * s * s;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
        const float g = s * (bf2f(w[j]) * dyr[j] - xr[j] * c);
        const float v = resid ? resid[r * d + j] + g : g;
        dx[r * d + j] = v;
        if (dx_bf16) dx_bf16[r * d + j] = f2bf(v);
    }
}

void mt_rmsnorm_forward(int64_t n, int64_t d, const float *x, const bf16 *w, double eps, bf16 *y,
                        float *inv_rms, cudaStream_t stream)
{
    if (n <= 0) return;
    MT_CUDA_REQUIRE(n < (1ll << 31), "rows %lld exceed the grid", (long long)n);
    rmsnorm_forward_kernel<<<(unsigned)n, NORM_THREADS, 0, stream>>>(d, x, w, eps, y, inv_rms);
    CUDA_CHECK_LAUNCH();
}

void mt_rmsnorm_apply(int64_t n, int64_t d, const float *x, const bf16 *w, const float *inv_rms, bf16 *y,
                      cudaStream_t stream)
{
    if (n <= 0) return;
    rmsnorm_apply_kernel<<<mt_grid_for(n * d, 256), 256, 0, stream>>>(n, d, x, w, inv_rms, y);
    CUDA_CHECK_LAUNCH();
}

void mt_rmsnorm_backward(int64_t n, int64_t d, const float *x, const bf16 *w, const float *inv_rms,
                         const float *dy, const float *resid, float *dx, bf16 *dx_bf16, cudaStream_t stream)
{
    if (n <= 0) return;
    MT_CUDA_REQUIRE(n < (1ll << 31), "rows %lld exceed the grid", (long long)n);
    rmsnorm_backward_kernel<<<(unsigned)n, NORM_THREADS, 0, stream>>>(d, x, w, inv_rms, dy, resid, dx, dx_bf16);
    CUDA_CHECK_LAUNCH();
}

// The weight gradient's summand dy * x * s (the CPU's float order).
struct rmsnorm_dw_element {
    const float *x, *dy, *inv_rms;
    int64_t d;
    __device__ float operator()(int64_t r, int64_t j) const { return dy[r * d + j] * x[r * d + j] * inv_rms[r]; }
};

void mt_rmsnorm_backward_weight(int64_t n, int64_t d, const float *x, const float *inv_rms, const float *dy,
                                float *dw, bool accumulate, float *partials, cudaStream_t stream)
{
    mt_colsum(rmsnorm_dw_element{x, dy, inv_rms, d}, n, d, dw, accumulate, partials, stream);
}
