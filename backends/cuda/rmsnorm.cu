// RMSNorm forward and backward on the GPU, mirroring backends/cpu/rmsnorm.inc operation by
// operation (double sums, the same float products) so the two differ only by summation order
// and, on the bf16 path, the rounding of the outputs the GEMMs consume.
#include "backends/cuda/colsum.cuh"
#include "backends/cuda/rmsnorm.cuh"

enum { NORM_THREADS = 256 };

// One block per row: sum of squares in double, then y = (x s) w.
template <class T>
__global__ static void rmsnorm_forward_kernel(int64_t d, const float *x, const float *w, double eps, T *y,
                                              float *inv_rms)
{
    __shared__ double shared[32];
    const int64_t r = blockIdx.x;
    const float *xr = x + r * d;
    double ss = 0;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) ss += (double)xr[j] * (double)xr[j];
    ss = mt_block_sum(ss, shared);
    const float s = (float)(1.0 / sqrt(ss / (double)d + eps));
    T *yr = y + r * d;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) yr[j] = from_f<T>(xr[j] * s * w[j]);
    if (inv_rms && threadIdx.x == 0) inv_rms[r] = s;
}

template <class T>
__global__ static void rmsnorm_apply_kernel(int64_t n, int64_t d, const float *x, const float *w, const float *inv_rms,
                                            T *y)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n * d; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = from_f<T>(x[i] * inv_rms[i / d] * w[i % d]);
}

// One block per row: dot = sum (w dy) x in double; dx = resid + s (w dy - x c), c = dot/d s^2.
template <class T>
__global__ static void rmsnorm_backward_kernel(int64_t d, const float *x, const float *w, const float *inv_rms,
                                               const float *dy, const float *resid, float *dx, T *dx_low)
{
    __shared__ double shared[32];
    const int64_t r = blockIdx.x;
    const float *xr = x + r * d, *dyr = dy + r * d;
    const float s = inv_rms[r];
    double dot = 0;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) dot += (double)(w[j] * dyr[j]) * (double)xr[j];
    dot = mt_block_sum(dot, shared);
    const float c = (float)(dot / (double)d) * s * s;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
        const float g = s * (w[j] * dyr[j] - xr[j] * c);
        const float v = resid ? resid[r * d + j] + g : g;
        dx[r * d + j] = v;
        if (dx_low) dx_low[r * d + j] = from_f<T>(v);
    }
}

template <class T>
void mt_rmsnorm_forward(int64_t n, int64_t d, const float *x, const float *w, double eps, T *y, float *inv_rms,
                        cudaStream_t stream)
{
    if (n <= 0) return;
    MT_CUDA_REQUIRE(n < (1ll << 31), "rows %lld exceed the grid", (long long)n);
    rmsnorm_forward_kernel<<<(unsigned)n, NORM_THREADS, 0, stream>>>(d, x, w, eps, y, inv_rms);
    CUDA_CHECK_LAUNCH();
}

template <class T>
void mt_rmsnorm_apply(int64_t n, int64_t d, const float *x, const float *w, const float *inv_rms, T *y,
                      cudaStream_t stream)
{
    if (n <= 0) return;
    rmsnorm_apply_kernel<<<mt_grid_for(n * d, 256), 256, 0, stream>>>(n, d, x, w, inv_rms, y);
    CUDA_CHECK_LAUNCH();
}

template <class T>
void mt_rmsnorm_backward(int64_t n, int64_t d, const float *x, const float *w, const float *inv_rms, const float *dy,
                         const float *resid, float *dx, mt_same<T> *dx_low, cudaStream_t stream)
{
    if (n <= 0) return;
    MT_CUDA_REQUIRE(n < (1ll << 31), "rows %lld exceed the grid", (long long)n);
    rmsnorm_backward_kernel<T><<<(unsigned)n, NORM_THREADS, 0, stream>>>(d, x, w, inv_rms, dy, resid, dx, dx_low);
    CUDA_CHECK_LAUNCH();
}

// The two operand types the backend builds.
#define RMSNORM_INSTANTIATE(T)                                                                                         \
    template void mt_rmsnorm_forward<T>(int64_t, int64_t, const float *, const float *, double, T *, float *,          \
                                        cudaStream_t);                                                                 \
    template void mt_rmsnorm_apply<T>(int64_t, int64_t, const float *, const float *, const float *, T *,              \
                                      cudaStream_t);                                                                   \
    template void mt_rmsnorm_backward<T>(int64_t, int64_t, const float *, const float *, const float *, const float *, \
                                         const float *, float *, mt_same<T> *, cudaStream_t);
RMSNORM_INSTANTIATE(bf16)
RMSNORM_INSTANTIATE(float)

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
