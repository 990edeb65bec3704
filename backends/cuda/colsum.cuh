// Deterministic column sums out[j] (=/+=) sum_r f(r, j) of an implicit (R, C) matrix: the weight
// gradients of biases and norms. Two stages (row chunks -> partials, then a fixed-order sum of the
// partials), no float atomics, so repeated runs agree bitwise. A template (header-only) because
// each user supplies its own element functor f; the launcher is the only entry point.
#ifndef MT_BACKENDS_CUDA_COLSUM_CUH
#define MT_BACKENDS_CUDA_COLSUM_CUH

#include "backends/cuda/common.cuh"

#define MT_COLSUM_MAX_CHUNKS 64 // row chunks of stage 1: partials are (chunks, C) fp32

// Bytes of the partials buffer a column sum over C columns needs.
static inline size_t mt_colsum_partials_bytes(int64_t C) { return (size_t)MT_COLSUM_MAX_CHUNKS * (size_t)C * sizeof(float); }

// Stage 1: block (32 x 8 threads) sums columns [32 bx, 32 bx + 32) over row chunk by -> partials.
template <class F> __global__ void mt_colsum_partial_kernel(F f, int64_t R, int64_t C, int64_t rows_per_chunk, float *partials)
{
    __shared__ float tile[8][33];
    const int64_t j = blockIdx.x * 32 + threadIdx.x;
    const int64_t r0 = blockIdx.y * rows_per_chunk;
    const int64_t r1 = r0 + rows_per_chunk < R ? r0 + rows_per_chunk : R;
    float acc = 0.f;
    if (j < C)
        for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) acc += f(r, j);
    tile[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && j < C) {
        float s = tile[0][threadIdx.x];
        for (int y = 1; y < 8; y++) s += tile[y][threadIdx.x];
        partials[blockIdx.y * C + j] = s;
    }
}

// Stage 2: out[j] = (Accumulate ? out[j] : 0) + sum over chunks in order.
template <bool Accumulate> __global__ void mt_colsum_final_kernel(const float *partials, int64_t C, int nchunks, float *out)
{
    const int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (j >= C) return;
    float s = 0.f;
    for (int k = 0; k < nchunks; k++) s += partials[k * C + j];
    out[j] = Accumulate ? out[j] + s : s;
}

// out (C) fp32 =/+= sum over R rows of f(r, j). partials: mt_colsum_partials_bytes(C) of scratch.
template <class F>
static void mt_colsum(F f, int64_t R, int64_t C, float *out, bool accumulate, float *partials, cudaStream_t stream)
{
    if (C <= 0) return;
    // Chunks depend on R only, so the summation order is a pure function of the shape.
    int64_t nchunks = (R + 255) / 256;
    if (nchunks < 1) nchunks = 1;
    if (nchunks > MT_COLSUM_MAX_CHUNKS) nchunks = MT_COLSUM_MAX_CHUNKS;
    const int64_t rows_per_chunk = R > 0 ? (R + nchunks - 1) / nchunks : 0;
    dim3 grid((unsigned)((C + 31) / 32), (unsigned)nchunks);
    mt_colsum_partial_kernel<<<grid, dim3(32, 8), 0, stream>>>(f, R, C, rows_per_chunk, partials);
    CUDA_CHECK_LAUNCH();
    const unsigned blocks = (unsigned)((C + 255) / 256);
    if (accumulate) mt_colsum_final_kernel<true><<<blocks, 256, 0, stream>>>(partials, C, (int)nchunks, out);
    else mt_colsum_final_kernel<false><<<blocks, 256, 0, stream>>>(partials, C, (int)nchunks, out);
    CUDA_CHECK_LAUNCH();
}

#endif
