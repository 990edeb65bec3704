// Token embedding on the GPU: a row gather forward; a deterministic scatter-add backward. The
// backward sorts the unique keys (token << 32 | position) with a bitonic network (unique keys:
// any correct sort gives the same order, so no stability or atomics are needed, and the
// workspace size depends on ntok only, not on the device). Then one block per distinct token adds
// its rows in position order onto dtable: the same additions, in the same order, as the CPU
// loop, so the result is bitwise repeatable and equal to mt_cpu_embedding_backward_f32.
#include "backends/cuda/common.cuh"

enum {
    SCATTER_THREADS = 128,
    SORT_TILE = 2048,        // keys a block sorts in shared memory (16 KiB)
    SORT_THREADS = SORT_TILE / 2, // one compare-exchange pair per thread
};

// h0 (ntok, d) fp32 = table (V, d) T [tokens]
template <class T>
__global__ static void embedding_gather_kernel(int64_t ntok, int64_t d, const T *table, const int32_t *tokens,
                                               float *h0)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < ntok * d; i += (int64_t)gridDim.x * blockDim.x)
        h0[i] = to_f(table[(int64_t)tokens[i / d] * d + i % d]);
}

// keys (N) = token << 32 | position for the ntok tokens, then UINT64_MAX padding (sorts last).
__global__ static void sort_keys_kernel(int64_t ntok, int64_t N, const int32_t *tokens, uint64_t *keys)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < N; i += (int64_t)gridDim.x * blockDim.x)
        keys[i] = i < ntok ? ((uint64_t)(uint32_t)tokens[i] << 32) | (uint64_t)i : ~(uint64_t)0;
}

// The compare-exchange of bitonic step (k, j) on the pair (i, i + j): ascending where i & k == 0.
static __device__ __forceinline__ void bitonic_exchange(uint64_t *a, uint64_t *b, bool ascending)
{
    const uint64_t x = *a, y = *b;
    if ((x > y) == ascending) {
        *a = y;
        *b = x;
    }
}

// Steps (k, j) with j < SORT_TILE stay inside one tile: run them all in shared memory, for k from
// k_from to k_to (j starting at j_first for k_from, at k/2 after).
__global__ static void bitonic_shared_kernel(uint64_t *keys, int64_t k_from, int64_t k_to, int64_t j_first)
{
    __shared__ uint64_t tile[SORT_TILE];
    const int64_t base = (int64_t)blockIdx.x * SORT_TILE;
    tile[threadIdx.x] = keys[base + threadIdx.x];
    tile[threadIdx.x + SORT_THREADS] = keys[base + threadIdx.x + SORT_THREADS];
    __syncthreads();
    for (int64_t k = k_from; k <= k_to; k <<= 1)
        for (int64_t j = k == k_from ? j_first : k / 2; j > 0; j >>= 1) {
            const int64_t p = threadIdx.x, i = (p / j) * 2 * j + p % j; // pair p -> (i, i + j)
            bitonic_exchange(&tile[i], &tile[i + j], ((base + i) & k) == 0);
            __syncthreads();
        }
    keys[base + threadIdx.x] = tile[threadIdx.x];
    keys[base + threadIdx.x + SORT_THREADS] = tile[threadIdx.x + SORT_THREADS];
}

// One step (k, j) with j >= SORT_TILE over the whole array: N / 2 pairs.
__global__ static void bitonic_global_kernel(uint64_t *keys, int64_t N, int64_t k, int64_t j)
{
    for (int64_t p = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; p < N / 2; p += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = (p / j) * 2 * j + p % j;
        bitonic_exchange(&keys[i], &keys[i + j], (i & k) == 0);
    }
}

// Block (i, column block): if sorted entry i starts a run of one token, adds the run's rows of
// dh0 (in position order: the low key bits) onto that token's row of dtable.
__global__ static void embedding_scatter_kernel(int64_t ntok, int64_t d, const uint64_t *keys, const float *dh0,
                                                float *dtable)
{
    const int64_t i = blockIdx.x;
    const uint64_t token = keys[i] >> 32;
    if (i > 0 && keys[i - 1] >> 32 == token) return;
    const int64_t j = blockIdx.y * (int64_t)blockDim.x + threadIdx.x;
    if (j >= d) return;
    float acc = dtable[(int64_t)token * d + j];
    for (int64_t r = i; r < ntok && keys[r] >> 32 == token; r++) acc += dh0[(int64_t)(keys[r] & 0xffffffffu) * d + j];
    dtable[(int64_t)token * d + j] = acc;
}

// Keys sorted: a power of two, at least one tile.
static int64_t sort_length(int64_t ntok)
{
    int64_t N = SORT_TILE;
    while (N < ntok) N <<= 1;
    return N;
}

extern "C" size_t mt_cuda_embedding_workspace_bytes(int64_t ntok, int64_t V)
{
    (void)V;
    return (size_t)sort_length(ntok) * sizeof(uint64_t); // keys (N) u64
}

extern "C" void mt_cuda_embedding_forward(int64_t ntok, int64_t d, mt_cuda_prec prec, const void *table,
                                          const int32_t *tokens, float *h0, mt_cuda_stream stream)
{
    if (ntok <= 0 || d <= 0) return;
    const unsigned blocks = mt_grid_for(ntok * d, 256);
    if (prec == MT_CUDA_F32)
        embedding_gather_kernel<<<blocks, 256, 0, as_stream(stream)>>>(ntok, d, (const float *)table, tokens, h0);
    else
        embedding_gather_kernel<<<blocks, 256, 0, as_stream(stream)>>>(ntok, d, (const bf16 *)table, tokens, h0);
    CUDA_CHECK_LAUNCH();
}

extern "C" void mt_cuda_embedding_backward(int64_t ntok, int64_t d, int64_t V, const int32_t *tokens, const float *dh0,
                                           float *dtable, void *workspace, mt_cuda_stream stream_)
{
    const cudaStream_t stream = as_stream(stream_);
    if (ntok <= 0 || d <= 0) return;
    MT_CUDA_REQUIRE(ntok < INT32_MAX && V <= UINT32_MAX, "ntok %lld / V %lld too large for the token sort",
                    (long long)ntok, (long long)V);
    const int64_t N = sort_length(ntok);
    uint64_t *keys = (uint64_t *)workspace; // (N)
    sort_keys_kernel<<<mt_grid_for(N, 256), 256, 0, stream>>>(ntok, N, tokens, keys);
    CUDA_CHECK_LAUNCH();
    // Bitonic sort: every tile fully in shared memory, then for each larger k the long-stride
    // steps globally and the short-stride ones (j < SORT_TILE) back in shared memory.
    const unsigned tiles = (unsigned)(N / SORT_TILE);
    bitonic_shared_kernel<<<tiles, SORT_THREADS, 0, stream>>>(keys, 2, SORT_TILE, 1);
    CUDA_CHECK_LAUNCH();
    for (int64_t k = 2 * SORT_TILE; k <= N; k <<= 1) {
        for (int64_t j = k / 2; j >= SORT_TILE; j >>= 1) {
            bitonic_global_kernel<<<mt_grid_for(N / 2, 256), 256, 0, stream>>>(keys, N, k, j);
            CUDA_CHECK_LAUNCH();
        }
        bitonic_shared_kernel<<<tiles, SORT_THREADS, 0, stream>>>(keys, k, k, SORT_TILE / 2);
        CUDA_CHECK_LAUNCH();
    }
    const dim3 grid((unsigned)ntok, (unsigned)((d + SCATTER_THREADS - 1) / SCATTER_THREADS));
    embedding_scatter_kernel<<<grid, SCATTER_THREADS, 0, stream>>>(ntok, d, keys, dh0, dtable);
    CUDA_CHECK_LAUNCH();
}
