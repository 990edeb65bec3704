// The router of a sparse layer on the GPU, as backends/cpu/moe.inc and moe.c compute it: the
// softmax over the experts, the top k in rank order, the assignments grouped by expert (a stable
// counting sort: bitwise mt_moe_group's result), the load-balancing loss's statistics, and the
// router's backward with that loss's gradient. No float atomics anywhere, so every result repeats
// bitwise. Declared in moe.cuh; C entry points in kernels.h.
#include "backends/cuda/moe.cuh"

#define ROUTER_SLOTS (MT_MAX_EXPERTS / 32) // experts a lane holds: lane + 32 q, q < ROUTER_SLOTS
enum { ROUTER_WARPS = 4 };                 // rows per block of the warp-per-row kernels
enum { GROUP_CHUNK = 256 };                // assignments per block of the grouping, >= MT_MAX_EXPERTS
static_assert(GROUP_CHUNK >= MT_MAX_EXPERTS, "a grouping block counts one expert per thread");

// Blocks of ROUTER_WARPS rows for n rows.
static unsigned router_blocks(int64_t n) { return (unsigned)((n + ROUTER_WARPS - 1) / ROUTER_WARPS); }

// ---- softmax: one warp per row, its logits in registers ----

__global__ static void router_softmax_kernel(int64_t n, int E, const float *logits, float *probs)
{
    const int64_t row = blockIdx.x * (int64_t)ROUTER_WARPS + (threadIdx.x >> 5); // uniform over a warp
    const int lane = threadIdx.x & 31;
    if (row >= n) return;
    float v[ROUTER_SLOTS], m = -INFINITY;
#pragma unroll
    for (int q = 0; q < ROUTER_SLOTS; q++) {
        const int e = lane + 32 * q;
        v[q] = e < E ? logits[row * E + e] : -INFINITY;
        m = fmaxf(m, v[q]);
    }
    m = mt_warp_max(m);
    float sum = 0.f;
#pragma unroll
    for (int q = 0; q < ROUTER_SLOTS; q++)
        if (lane + 32 * q < E) {
            v[q] = expf(v[q] - m); // expf, as the CPU's float path
            sum += v[q];
        }
    const float inv = 1.f / mt_warp_sum(sum);
#pragma unroll
    for (int q = 0; q < ROUTER_SLOTS; q++) // each lane rewrote only what it read: in place is safe
        if (lane + 32 * q < E) probs[row * E + lane + 32 * q] = v[q] * inv;
}

void mt_moe_router_softmax(int64_t n, int64_t E, const float *logits, float *probs, cudaStream_t stream)
{
    MT_CUDA_REQUIRE(E >= 1 && E <= MT_MAX_EXPERTS, "%lld experts: 1..%d", (long long)E, MT_MAX_EXPERTS);
    if (n <= 0) return;
    router_softmax_kernel<<<router_blocks(n), ROUTER_WARPS * 32, 0, stream>>>(n, (int)E, logits, probs);
    CUDA_CHECK_LAUNCH();
}

// ---- top k: one warp per row, k rounds of a warp argmax under a total order ----

// Whether (pa, a) ranks above (pb, b) by mt_cpu_router_topk's rule: NaN above every number, then
// the larger probability, then the lower expert index. An index < 0 is "no candidate". A total
// order, so a butterfly reduction leaves every lane with the same winner.
static __device__ __forceinline__ bool ranks_above(float pa, int a, float pb, int b)
{
    if (b < 0) return a >= 0;
    if (a < 0) return false;
    if (isnan(pa) || isnan(pb)) return isnan(pa) && (!isnan(pb) || a < b);
    return pa > pb || (pa == pb && a < b);
}

__global__ static void router_topk_kernel(int64_t n, int E, int k, bool renormalise, const float *probs,
                                          int32_t *experts, float *weights)
{
    const int64_t row = blockIdx.x * (int64_t)ROUTER_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= n) return;
    float v[ROUTER_SLOTS];
#pragma unroll
    for (int q = 0; q < ROUTER_SLOTS; q++) v[q] = lane + 32 * q < E ? probs[row * E + lane + 32 * q] : 0.f;
    unsigned taken = 0; // bit q: expert lane + 32 q is already chosen
    float sum = 0.f;    // the chosen probabilities in rank order, as the CPU adds them
    for (int j = 0; j < k; j++) {
        float bp = 0.f;
        int be = -1;
#pragma unroll
        for (int q = 0; q < ROUTER_SLOTS; q++) {
            const int e = lane + 32 * q;
            if (e < E && !((taken >> q) & 1u) && ranks_above(v[q], e, bp, be)) {
                bp = v[q];
                be = e;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float op = __shfl_xor_sync(0xffffffffu, bp, o);
            const int oe = __shfl_xor_sync(0xffffffffu, be, o);
            if (ranks_above(op, oe, bp, be)) {
                bp = op;
                be = oe;
            }
        }
        if ((be & 31) == lane) taken |= 1u << (be >> 5); // k <= E: be >= 0
        if (lane == 0) {
            experts[row * k + j] = be;
            weights[row * k + j] = bp;
        }
        sum += bp;
    }
    if (renormalise && lane == 0) // lane 0 wrote them: its own reads see them
        for (int j = 0; j < k; j++) weights[row * k + j] /= sum;
}

void mt_moe_router_topk(int64_t n, int64_t E, int64_t k, bool renormalise, const float *probs, int32_t *experts,
                        float *weights, cudaStream_t stream)
{
    MT_CUDA_REQUIRE(E >= 1 && E <= MT_MAX_EXPERTS && k >= 1 && k <= E, "top %lld of %lld experts (at most %d)",
                    (long long)k, (long long)E, MT_MAX_EXPERTS);
    if (n <= 0) return;
    router_topk_kernel<<<router_blocks(n), ROUTER_WARPS * 32, 0, stream>>>(n, (int)E, (int)k, renormalise, probs,
                                                                          experts, weights);
    CUDA_CHECK_LAUNCH();
}

// ---- grouping by expert: a stable counting sort in four small kernels ----
// Assignments are cut into chunks of GROUP_CHUNK. count: each assignment's rank among the earlier
// ones of its chunk with the same expert, and each chunk's count per expert. scan: per expert,
// the counts' exclusive prefix over the chunks, and the expert's total. offsets: the totals'
// exclusive prefix. place: row = offsets[e] + the chunk's prefix + the rank. Within an expert the
// rows follow the assignment index, so tokens ascend (a token's experts are distinct), as the CPU
// counting sort leaves them.

// Inclusive prefix sum of one int per thread over the block (blockDim.x a multiple of 32, at most
// 1024); *total receives the block's sum. shared: 32 ints.
static __device__ int block_inclusive_scan(int v, int *shared, int *total)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (int o = 1; o < 32; o <<= 1) {
        const int t = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += t;
    }
    __syncthreads(); // shared may still be read by a previous call
    if (lane == 31) shared[warp] = v;
    __syncthreads();
    if (warp == 0) {
        int w = lane < nwarps ? shared[lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            const int t = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += t;
        }
        if (lane < nwarps) shared[lane] = w; // warp sums, inclusive prefix
    }
    __syncthreads();
    *total = shared[nwarps - 1];
    return v + (warp > 0 ? shared[warp - 1] : 0);
}

// One block of GROUP_CHUNK threads per chunk: rank (into pos) and counts[chunk * E + e].
__global__ static void group_count_kernel(int64_t nk, int E, const int32_t *experts, int32_t *counts, int32_t *pos)
{
    __shared__ int32_t chunk[GROUP_CHUNK];
    const int t = threadIdx.x;
    const int64_t a = blockIdx.x * (int64_t)GROUP_CHUNK + t;
    chunk[t] = a < nk ? experts[a] : -1;
    __syncthreads();
    if (a < nk) {
        int rank = 0;
        for (int i = 0; i < t; i++) rank += chunk[i] == chunk[t];
        pos[a] = rank;
    }
    if (t < E) {
        int count = 0;
        for (int i = 0; i < GROUP_CHUNK; i++) count += chunk[i] == t;
        counts[blockIdx.x * (int64_t)E + t] = count;
    }
}

// One block per expert e: counts[c * E + e] over the chunks c becomes its exclusive prefix;
// totals[e] its sum.
__global__ static void group_scan_kernel(int64_t nchunks, int E, int32_t *counts, int32_t *totals)
{
    __shared__ int shared[32];
    const int e = blockIdx.x;
    int carry = 0;
    for (int64_t base = 0; base < nchunks; base += blockDim.x) { // uniform over the block
        const int64_t c = base + threadIdx.x;
        const int v = c < nchunks ? counts[c * E + e] : 0;
        int total;
        const int incl = block_inclusive_scan(v, shared, &total);
        if (c < nchunks) counts[c * E + e] = carry + incl - v;
        carry += total;
    }
    if (threadIdx.x == 0) totals[e] = carry;
}

// One block of GROUP_CHUNK threads: offsets (E + 1) = exclusive prefix of totals (E).
__global__ static void group_offsets_kernel(int E, const int32_t *totals, int32_t *offsets)
{
    __shared__ int shared[32];
    const int t = threadIdx.x;
    int total;
    const int incl = block_inclusive_scan(t < E ? totals[t] : 0, shared, &total);
    if (t < E) offsets[t + 1] = incl;
    if (t == 0) offsets[0] = 0;
}

// One block per chunk: each assignment's grouped row into pos, and order at that row.
__global__ static void group_place_kernel(int64_t nk, int E, const int32_t *experts, const int32_t *counts,
                                          const int32_t *offsets, int32_t *order, int32_t *pos)
{
    const int64_t a = blockIdx.x * (int64_t)GROUP_CHUNK + threadIdx.x;
    if (a >= nk) return;
    const int e = experts[a];
    const int32_t row = offsets[e] + counts[blockIdx.x * (int64_t)E + e] + pos[a];
    pos[a] = row;
    order[row] = (int32_t)a;
}

// counts (chunks x E) and totals (E), int32, each carved at the scratch alignment.
size_t mt_moe_group_workspace_bytes(int64_t n, int64_t E, int64_t k)
{
    const int64_t nchunks = (n * k + GROUP_CHUNK - 1) / GROUP_CHUNK;
    mt_carve c = {nullptr, 0};
    mt_take<int32_t>(&c, nchunks * E);
    mt_take<int32_t>(&c, E);
    return mt_carve_size(&c);
}

void mt_moe_group(int64_t n, int64_t E, int64_t k, const int32_t *experts, int32_t *offsets, int32_t *order,
                  int32_t *pos, void *workspace, cudaStream_t stream)
{
    MT_CUDA_REQUIRE(E >= 1 && E <= MT_MAX_EXPERTS && k >= 1 && k <= E, "top %lld of %lld experts (at most %d)",
                    (long long)k, (long long)E, MT_MAX_EXPERTS);
    const int64_t nk = n * k;
    MT_CUDA_REQUIRE(n >= 0 && nk < INT32_MAX, "%lld assignments: the grouping indexes them in int32", (long long)nk);
    const int64_t nchunks = (nk + GROUP_CHUNK - 1) / GROUP_CHUNK;
    mt_carve c = {(char *)workspace, 0};
    int32_t *counts = mt_take<int32_t>(&c, nchunks * E), *totals = mt_take<int32_t>(&c, E);
    if (nk > 0) {
        group_count_kernel<<<(unsigned)nchunks, GROUP_CHUNK, 0, stream>>>(nk, (int)E, experts, counts, pos);
        CUDA_CHECK_LAUNCH();
        group_scan_kernel<<<(unsigned)E, 256, 0, stream>>>(nchunks, (int)E, counts, totals);
        CUDA_CHECK_LAUNCH();
    } else {
        CUDA_CHECK(cudaMemsetAsync(totals, 0, (size_t)E * sizeof(int32_t), stream));
    }
    group_offsets_kernel<<<1, GROUP_CHUNK, 0, stream>>>((int)E, totals, offsets);
    CUDA_CHECK_LAUNCH();
    if (nk > 0) {
        group_place_kernel<<<(unsigned)nchunks, GROUP_CHUNK, 0, stream>>>(nk, (int)E, experts, counts, offsets, order,
                                                                          pos);
        CUDA_CHECK_LAUNCH();
    }
}

// ---- the load-balancing loss's statistics ----

enum { STATS_ROWS = 32 }; // row lanes of a statistics block: blocks of (32 experts, STATS_ROWS rows)

// stats[e] += the assignments to expert e (offsets[e + 1] - offsets[e], over all k slots) and
// stats[E + e] += the sum of column e of probs (n, E) fp32, in double as the CPU adds them. Each
// block owns 32 experts (threadIdx.x, so a warp reads a row's contiguous probabilities); its rows
// are split over threadIdx.y and the partial sums added in a fixed order: no atomics, the same
// bits every run.
__global__ static void router_stats_kernel(int64_t n, int E, const float *probs, const int32_t *offsets,
                                           double *stats)
{
    __shared__ double partial[STATS_ROWS][32];
    const int e = blockIdx.x * 32 + threadIdx.x;
    double acc = 0.0;
    if (e < E)
        for (int64_t r = threadIdx.y; r < n; r += STATS_ROWS) acc += (double)probs[r * E + e];
    partial[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && e < E) {
        double sum = 0.0;
        for (int i = 0; i < STATS_ROWS; i++) sum += partial[i][threadIdx.x];
        stats[e] += (double)(offsets[e + 1] - offsets[e]);
        stats[E + e] += sum;
    }
}

void mt_moe_router_stats(int64_t n, int64_t E, const float *probs, const int32_t *offsets, double *stats,
                         cudaStream_t stream)
{
    MT_CUDA_REQUIRE(E >= 1 && E <= MT_MAX_EXPERTS, "%lld experts: 1..%d", (long long)E, MT_MAX_EXPERTS);
    router_stats_kernel<<<(unsigned)((E + 31) / 32), dim3(32, STATS_ROWS), 0, stream>>>(n, (int)E, probs, offsets,
                                                                                        stats);
    CUDA_CHECK_LAUNCH();
}

// ---- the router's backward: one warp per row, the row staged in shared memory ----

template <class T>
__global__ static void router_backward_kernel(int64_t n, int E, int k, bool renormalise, const float *probs,
                                              const int32_t *experts, const int32_t *pos, const float *dgrouped,
                                              const double *aux_counts, double aux_scale, T *dlogits)
{
    __shared__ float shared_p[ROUTER_WARPS][MT_MAX_EXPERTS], shared_dp[ROUTER_WARPS][MT_MAX_EXPERTS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t row = blockIdx.x * (int64_t)ROUTER_WARPS + warp;
    if (row >= n) return;
    float *p = shared_p[warp], *dp = shared_dp[warp]; // dp: the gradient at the probabilities
    for (int e = lane; e < E; e += 32) { // the load-balancing loss's share first, as the CPU's
        p[e] = probs[row * E + e];
        dp[e] = aux_counts ? (float)(aux_scale * aux_counts[e]) : 0.f;
    }
    __syncwarp();
    if (lane == 0) { // k choices in rank order, as mt_cpu_router_backward sums them
        const int32_t *sel = experts + row * k, *rows = pos + row * k;
        if (renormalise) {
            // w_j = p_j / S with S the sum of the k chosen: dp_i = (dw_i - sum_j dw_j w_j) / S.
            float S = 0.f, dot = 0.f;
            for (int j = 0; j < k; j++) S += p[sel[j]];
            for (int j = 0; j < k; j++) dot += dgrouped[rows[j]] * (p[sel[j]] / S);
            for (int j = 0; j < k; j++) dp[sel[j]] += (dgrouped[rows[j]] - dot) / S;
        } else {
            for (int j = 0; j < k; j++) dp[sel[j]] += dgrouped[rows[j]];
        }
    }
    __syncwarp();
    // Softmax: dlogit_e = p_e (dp_e - sum_f p_f dp_f).
    float dot = 0.f;
    for (int e = lane; e < E; e += 32) dot += p[e] * dp[e];
    dot = mt_warp_sum(dot);
    for (int e = lane; e < E; e += 32) dlogits[row * E + e] = from_f<T>(p[e] * (dp[e] - dot));
}

template <class T>
void mt_moe_router_backward(int64_t n, int64_t E, int64_t k, bool renormalise, const float *probs,
                            const int32_t *experts, const int32_t *pos, const float *dgrouped,
                            const double *aux_counts, double aux_scale, T *dlogits, cudaStream_t stream)
{
    MT_CUDA_REQUIRE(E >= 1 && E <= MT_MAX_EXPERTS && k >= 1 && k <= E, "top %lld of %lld experts (at most %d)",
                    (long long)k, (long long)E, MT_MAX_EXPERTS);
    if (n <= 0) return;
    router_backward_kernel<T><<<router_blocks(n), ROUTER_WARPS * 32, 0, stream>>>(n, (int)E, (int)k, renormalise,
                                                                                 probs, experts, pos, dgrouped,
                                                                                 aux_counts, aux_scale, dlogits);
    CUDA_CHECK_LAUNCH();
}

template void mt_moe_router_backward<bf16>(int64_t, int64_t, int64_t, bool, const float *, const int32_t *,
                                           const int32_t *, const float *, const double *, double, bf16 *,
                                           cudaStream_t);
template void mt_moe_router_backward<float>(int64_t, int64_t, int64_t, bool, const float *, const int32_t *,
                                            const int32_t *, const float *, const double *, double, float *,
                                            cudaStream_t);

// ---- C entry points (kernels.h) ----

extern "C" void mt_cuda_router_softmax(int64_t n, int64_t E, const float *logits, float *probs, mt_cuda_stream stream)
{
    mt_moe_router_softmax(n, E, logits, probs, as_stream(stream));
}

extern "C" void mt_cuda_router_topk(int64_t n, int64_t E, int64_t k, bool renormalise, const float *probs,
                                    int32_t *experts, float *weights, mt_cuda_stream stream)
{
    mt_moe_router_topk(n, E, k, renormalise, probs, experts, weights, as_stream(stream));
}

extern "C" void mt_cuda_router_stats(int64_t n, int64_t E, const float *probs, const int32_t *offsets, double *stats,
                                     mt_cuda_stream stream)
{
    mt_moe_router_stats(n, E, probs, offsets, stats, as_stream(stream));
}

extern "C" size_t mt_cuda_moe_group_workspace_bytes(int64_t n, int64_t E, int64_t k)
{
    return mt_moe_group_workspace_bytes(n, E, k);
}

extern "C" void mt_cuda_moe_group(int64_t n, int64_t E, int64_t k, const int32_t *experts, int32_t *offsets,
                                  int32_t *order, int32_t *pos, void *workspace, mt_cuda_stream stream)
{
    mt_moe_group(n, E, k, experts, offsets, order, pos, workspace, as_stream(stream));
}
