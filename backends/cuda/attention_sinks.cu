// Attention sinks after the attention kernels (attention_sinks.cuh).
#include <math.h>

#include "backends/cuda/attention_sinks.cuh"

namespace {

__device__ __forceinline__ float to_float(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ void store(bf16 *p, float x) { *p = __float2bfloat16(x); }
__device__ __forceinline__ void store(float *p, float x) { *p = x; }

// One warp per (b, t, h) row: l' = logaddexp(l, s), the row scaled by exp(l - l').
template <class E>
__global__ void sinks_apply_kernel(int64_t rows, int T, int H, int D, const E *__restrict__ sinks, E *__restrict__ out,
                                   float *__restrict__ lse)
{
    const int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const int h = (int)(row % H);
    const int64_t bt = row / H, b = bt / T, t = bt % T;
    float *l = lse + (b * H + h) * T + t;
    const float s = to_float(sinks[h]), l0 = *l, mx = fmaxf(l0, s);
    const float l1 = mx + logf(expf(l0 - mx) + expf(s - mx));
    const float f = expf(l0 - l1);
    E *o = out + row * D;
    for (int i = lane; i < D; i += 32) store(o + i, to_float(o[i]) * f);
    __syncwarp();
    if (lane == 0) *l = l1;
}

// One block of 256 threads per head: thread i sums rows i, i + 256, ... in order, then a fixed
// tree over the threads.
template <class E>
__global__ void sinks_grad_kernel(int64_t BT, int T, int H, const E *__restrict__ sinks, const float *__restrict__ lse,
                                  const float *__restrict__ delta, float *__restrict__ dsinks)
{
    __shared__ float part[256];
    const int h = blockIdx.x;
    const float s = to_float(sinks[h]);
    float acc = 0.f;
    for (int64_t r = threadIdx.x; r < BT; r += blockDim.x) {
        const int64_t i = (r / T * H + h) * T + r % T; // (b, h, t)
        acc = fmaf(expf(s - lse[i]), delta[i], acc);
    }
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) dsinks[h] -= part[0];
}

template <class E>
void apply(int64_t B, int64_t T, int64_t H, int64_t D, const E *sinks, E *out, float *lse, cudaStream_t stream)
{
    const int64_t rows = B * T * H;
    if (rows == 0) return;
    const int warps = 8;
    sinks_apply_kernel<E><<<(unsigned)((rows + warps - 1) / warps), warps * 32, 0, stream>>>(rows, (int)T, (int)H,
                                                                                              (int)D, sinks, out, lse);
    CUDA_CHECK_LAUNCH();
}

template <class E>
void grad(int64_t B, int64_t T, int64_t H, const E *sinks, const float *lse, const float *delta, float *dsinks,
          cudaStream_t stream)
{
    if (B * T == 0) return;
    sinks_grad_kernel<E><<<(unsigned)H, 256, 0, stream>>>(B * T, (int)T, (int)H, sinks, lse, delta, dsinks);
    CUDA_CHECK_LAUNCH();
}

} // namespace

void mt_attention_sinks_apply_bf16(int64_t B, int64_t T, int64_t H, int64_t D, const bf16 *sinks, bf16 *out,
                                   float *lse, cudaStream_t stream)
{
    apply(B, T, H, D, sinks, out, lse, stream);
}

void mt_attention_sinks_apply_f32(int64_t B, int64_t T, int64_t H, int64_t D, const float *sinks, float *out,
                                  float *lse, cudaStream_t stream)
{
    apply(B, T, H, D, sinks, out, lse, stream);
}

void mt_attention_sinks_grad_bf16(int64_t B, int64_t T, int64_t H, const bf16 *sinks, const float *lse,
                                  const float *delta, float *dsinks, cudaStream_t stream)
{
    grad(B, T, H, sinks, lse, delta, dsinks, stream);
}

void mt_attention_sinks_grad_f32(int64_t B, int64_t T, int64_t H, const float *sinks, const float *lse,
                                 const float *delta, float *dsinks, cudaStream_t stream)
{
    grad(B, T, H, sinks, lse, delta, dsinks, stream);
}
