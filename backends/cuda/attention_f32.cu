// attention_f32: causal grouped-query attention in fp32 on CUDA cores (no tensor cores), for the
// --dtype fp32 path; FlashAttention-2 in structure, so the T x T scores only exist as 32-column
// tiles. Math as the CPU reference: expf, IEEE division, log in double for the lse.
// Hand-written because no library does it: cuDNN's fused attention and torch's flash kernels
// take fp16/bf16 (or fp8) operands only, and an unfused fp32 path would hold the T x T matrix.
//
// Every kernel is a 256-thread block over a tile of RB rows (queries, or keys for dK dV) that
// streams 32-column tiles (keys, or queries) through shared memory. Thread (rg, cg) = (tid / 16,
// tid % 16) owns RT consecutive rows of the block (RT = 4, or 2 when D > 128 to fit shared memory
// and registers), score columns cg and cg + 16 of a tile, and output dimension pairs cg + 16 i.
// A row's 16 threads are one half-warp, so row max and sum are xor-shuffles within it. Products
// are register-blocked: RT x 2 scores per float4 step over D, RT x 2 NP outputs per column.
// Backward: Delta = rowwise dout . out; one kernel owns a key block and writes dK, dV once, one
// owns a query block and writes dQ once; fixed summation order, no atomics: bitwise repeatable.
#include <math.h>
#include <stdint.h>

#include "backends/cuda/attention_f32.h"
#include "backends/cuda/attention_sinks.cuh"
#include "backends/cuda/common.cuh"

namespace {

constexpr int THREADS = 256; // 16 row groups x 16 column groups
constexpr int COLS = 32;     // columns of a score tile: keys (forward, dQ) or queries (dK dV)

// Tile geometry for head dims up to 32 NP (NP = ceil(D / 32) pairs of dimensions per thread).
template <int NP>
struct Geom {
    static constexpr int RT = NP > 4 ? 2 : 4; // rows per thread
    static constexpr int RB = 16 * RT;        // rows per block
    // Shared row stride in floats: covers every pair a thread reads (32 NP, zero past D), and
    // DP / 4 odd puts the float4 rows a quarter-warp reads in distinct 16-byte bank groups.
    static constexpr int DP = 32 * NP + 4;
    static constexpr int PP = RB + 4; // stride of the transposed probability tile, same reason
};

// dst (rows x DP) = rows t0 .. t0 + rows - 1 of src (row t at src + t * stride, D floats), zeros
// past T and past D (the padded products then add zeros). Called by the whole block.
template <int DP>
__device__ void stage(float *dst, int rows, const float *__restrict__ src, int64_t stride, int t0, int T, int D)
{
    constexpr int PAIRS = DP / 2;
    for (int e = threadIdx.x; e < rows * PAIRS; e += THREADS) {
        const int r = e / PAIRS, p = e % PAIRS, t = t0 + r;
        float2 x = make_float2(0.f, 0.f);
        if (t < T && 2 * p < D) x = __ldg(reinterpret_cast<const float2 *>(src + (int64_t)t * stride + 2 * p));
        *reinterpret_cast<float2 *>(dst + r * DP + 2 * p) = x;
    }
}

// s[r][c] = A row (rg RT + r) . B row (cg + 16 c), both (.. x DP) in shared memory; D4 = D
// rounded up to 4 (the pad is zero).
template <int NP>
__device__ __forceinline__ void tile_dot(const float *A, const float *Bm, int rg, int cg, int D4,
                                         float s[Geom<NP>::RT][2])
{
    constexpr int RT = Geom<NP>::RT, DP = Geom<NP>::DP;
#pragma unroll
    for (int r = 0; r < RT; r++) s[r][0] = s[r][1] = 0.f;
    const float *b0 = Bm + cg * DP, *b1 = Bm + (cg + 16) * DP, *a = A + rg * RT * DP;
#pragma unroll 2
    for (int d = 0; d < D4; d += 4) {
        const float4 x0 = *reinterpret_cast<const float4 *>(b0 + d), x1 = *reinterpret_cast<const float4 *>(b1 + d);
#pragma unroll
        for (int r = 0; r < RT; r++) {
            const float4 y = *reinterpret_cast<const float4 *>(a + r * DP + d);
            s[r][0] = fmaf(y.x, x0.x, s[r][0]);
            s[r][0] = fmaf(y.y, x0.y, s[r][0]);
            s[r][0] = fmaf(y.z, x0.z, s[r][0]);
            s[r][0] = fmaf(y.w, x0.w, s[r][0]);
            s[r][1] = fmaf(y.x, x1.x, s[r][1]);
            s[r][1] = fmaf(y.y, x1.y, s[r][1]);
            s[r][1] = fmaf(y.z, x1.z, s[r][1]);
            s[r][1] = fmaf(y.w, x1.w, s[r][1]);
        }
    }
}

// acc[r][i] += sum over the tile's columns j of P[j][rg RT + r] * V[j][pair cg + 16 i]: P is the
// transposed (COLS x PP) probability tile, V a (COLS x DP) tile.
template <int NP>
__device__ __forceinline__ void tile_pv(const float *P, const float *V, int rg, int cg, float2 acc[Geom<NP>::RT][NP])
{
    constexpr int RT = Geom<NP>::RT, DP = Geom<NP>::DP, PP = Geom<NP>::PP;
#pragma unroll 4
    for (int j = 0; j < COLS; j++) {
        float p[RT];
        if constexpr (RT == 4) {
            const float4 x = *reinterpret_cast<const float4 *>(P + j * PP + rg * RT);
            p[0] = x.x, p[1] = x.y, p[2] = x.z, p[3] = x.w;
        } else {
            const float2 x = *reinterpret_cast<const float2 *>(P + j * PP + rg * RT);
            p[0] = x.x, p[1] = x.y;
        }
#pragma unroll
        for (int i = 0; i < NP; i++) {
            const float2 x = *reinterpret_cast<const float2 *>(V + j * DP + 2 * (cg + 16 * i));
#pragma unroll
            for (int r = 0; r < RT; r++) {
                acc[r][i].x = fmaf(p[r], x.x, acc[r][i].x);
                acc[r][i].y = fmaf(p[r], x.y, acc[r][i].y);
            }
        }
    }
}

// P[(cg + 16 c) * PP + rg RT + r] = x[r][c]: the thread's RT x 2 values into the transposed tile.
template <int NP>
__device__ __forceinline__ void store_transposed(float *P, int rg, int cg, const float x[Geom<NP>::RT][2])
{
    constexpr int RT = Geom<NP>::RT, PP = Geom<NP>::PP;
#pragma unroll
    for (int c = 0; c < 2; c++) {
        float *dst = P + (cg + 16 * c) * PP + rg * RT;
        if constexpr (RT == 4) *reinterpret_cast<float4 *>(dst) = make_float4(x[0][c], x[1][c], x[2][c], x[3][c]);
        else *reinterpret_cast<float2 *>(dst) = make_float2(x[0][c], x[1][c]);
    }
}

// Reductions over a row's 16 threads (one half-warp); every lane takes part.
__device__ __forceinline__ float half_warp_max(float x)
{
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
__device__ __forceinline__ float half_warp_sum(float x)
{
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// Writes the thread's RT rows (scaled by mul[r]) of a (rows, D) slab at dst + row * stride,
// rows first .. first + RT - 1 of which only those < T exist.
template <int NP>
__device__ __forceinline__ void store_rows(float *__restrict__ dst, int64_t stride, int first, int T, int D, int cg,
                                           const float2 acc[Geom<NP>::RT][NP], const float mul[Geom<NP>::RT])
{
#pragma unroll
    for (int r = 0; r < Geom<NP>::RT; r++) {
        if (first + r >= T) continue;
        float *row = dst + (int64_t)(first + r) * stride;
#pragma unroll
        for (int i = 0; i < NP; i++) {
            const int p = cg + 16 * i;
            if (2 * p < D)
                *reinterpret_cast<float2 *>(row + 2 * p) = make_float2(acc[r][i].x * mul[r], acc[r][i].y * mul[r]);
        }
    }
}

// Forward: one block per (query block, b, h), query blocks longest (last) first; online softmax
// over key tiles 0 .. the one holding the block's last query.
template <int NP>
__global__ void __launch_bounds__(THREADS, 2) forward_kernel(int T, int H, int KV, int D, int64_t BH,
                                                          const float *__restrict__ q, const float *__restrict__ k,
                                                          const float *__restrict__ v, float *__restrict__ out,
                                                          float *__restrict__ lse, float scale, int window)
{
    constexpr int RT = Geom<NP>::RT, RB = Geom<NP>::RB, DP = Geom<NP>::DP;
    extern __shared__ float4 smem4[];
    float *Qs = reinterpret_cast<float *>(smem4); // RB x DP
    float *Ks = Qs + RB * DP;                      // COLS x DP
    float *Vs = Ks + COLS * DP;                    // COLS x DP
    float *Ps = Vs + COLS * DP;                    // COLS x PP: P transposed

    const int nqb = (T + RB - 1) / RB;
    const int64_t bh = blockIdx.x % BH;
    const int qb = nqb - 1 - (int)(blockIdx.x / BH);
    const int b = (int)(bh / H), h = (int)(bh % H), kvh = h / (H / KV);
    const int t0 = qb * RB, rg = threadIdx.x >> 4, cg = threadIdx.x & 15, D4 = (D + 3) & ~3;
    const int64_t qstride = (int64_t)H * D, kstride = (int64_t)KV * D;
    const float *kb = k + ((int64_t)b * T * KV + kvh) * D, *vb = v + ((int64_t)b * T * KV + kvh) * D;
    stage<DP>(Qs, RB, q + ((int64_t)b * T * H + h) * D, qstride, t0, T, D);

    float m[RT], l[RT];
    float2 acc[RT][NP];
#pragma unroll
    for (int r = 0; r < RT; r++) {
        m[r] = -INFINITY, l[r] = 0.f;
#pragma unroll
        for (int i = 0; i < NP; i++) acc[r][i] = make_float2(0.f, 0.f);
    }
    const int ntiles = (min(t0 + RB, T) - 1) / COLS + 1;
    // a sliding window (query t sees keys t - window + 1 .. t): from the tile of the block's
    // first row's first key
    const int kt0 = window > 0 ? max(0, t0 - window + 1) / COLS : 0;
    for (int kt = kt0; kt < ntiles; kt++) {
        __syncthreads(); // the previous tile's K, V, P are no longer read
        stage<DP>(Ks, COLS, kb, kstride, kt * COLS, T, D);
        stage<DP>(Vs, COLS, vb, kstride, kt * COLS, T, D);
        __syncthreads();
        float s[RT][2];
        tile_dot<NP>(Qs, Ks, rg, cg, D4, s);
#pragma unroll
        for (int r = 0; r < RT; r++) {
            const int t = t0 + rg * RT + r;
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const int j = kt * COLS + cg + 16 * c;
                s[r][c] = j <= t && j < T && (window <= 0 || j > t - window) ? scale * s[r][c] : -INFINITY;
            }
            // without a window key 0 is in tile 0 and seen by every row (pad rows past T too); with
            // one a row's first tiles may be all masked: base 0 then keeps -inf - -inf out
            const float mnew = fmaxf(m[r], half_warp_max(fmaxf(s[r][0], s[r][1])));
            const float base = mnew == -INFINITY ? 0.f : mnew;
            const float corr = expf(m[r] - base); // 0 on a row's first tile with a key
            s[r][0] = expf(s[r][0] - base), s[r][1] = expf(s[r][1] - base);
            l[r] = l[r] * corr + half_warp_sum(s[r][0] + s[r][1]);
            m[r] = mnew;
#pragma unroll
            for (int i = 0; i < NP; i++) acc[r][i].x *= corr, acc[r][i].y *= corr;
        }
        store_transposed<NP>(Ps, rg, cg, s);
        __syncthreads();
        tile_pv<NP>(Ps, Vs, rg, cg, acc);
    }

    const int first = t0 + rg * RT;
    float inv[RT];
#pragma unroll
    for (int r = 0; r < RT; r++) {
        inv[r] = 1.f / l[r];
        if (cg == 0 && first + r < T) lse[bh * T + first + r] = m[r] + (float)log((double)l[r]);
    }
    store_rows<NP>(out + ((int64_t)b * T * H + h) * D, qstride, first, T, D, cg, acc, inv);
}

// delta (B,H,T) = rowwise dout . out: one warp per (b, t, h) row.
__global__ void delta_kernel(int64_t rows, int T, int H, int D, const float *__restrict__ out,
                             const float *__restrict__ dout, float *__restrict__ delta)
{
    const int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return; // whole warps leave: the shuffles below see full warps
    const float *o = out + row * D, *d = dout + row * D;
    float sum = 0.f;
    for (int i = lane; i < D; i += 32) sum = fmaf(o[i], d[i], sum);
    sum = mt_warp_sum(sum);
    if (lane == 0) {
        const int h = (int)(row % H);
        const int64_t bt = row / H, b = bt / T, t = bt % T;
        delta[(b * H + h) * T + t] = sum;
    }
}

// dQ: one block per (query block, b, h), longest first. Per key tile: S = Q K^T, dP = dO V^T,
// dS = P (dP - Delta) with P = exp(scale S - lse), dQ += dS K; times scale at the end.
template <int NP>
__global__ void __launch_bounds__(THREADS, 2) dq_kernel(int T, int H, int KV, int D, int64_t BH,
                                                     const float *__restrict__ q, const float *__restrict__ k,
                                                     const float *__restrict__ v, const float *__restrict__ dout,
                                                     const float *__restrict__ lse, const float *__restrict__ delta,
                                                     float *__restrict__ dq, float scale, int window)
{
    constexpr int RT = Geom<NP>::RT, RB = Geom<NP>::RB, DP = Geom<NP>::DP;
    extern __shared__ float4 smem4[];
    float *Qs = reinterpret_cast<float *>(smem4); // RB x DP
    float *dOs = Qs + RB * DP;                     // RB x DP
    float *Ks = dOs + RB * DP;                     // COLS x DP
    float *Vs = Ks + COLS * DP;                    // COLS x DP
    float *Ps = Vs + COLS * DP;                    // COLS x PP: dS transposed

    const int nqb = (T + RB - 1) / RB;
    const int64_t bh = blockIdx.x % BH;
    const int qb = nqb - 1 - (int)(blockIdx.x / BH);
    const int b = (int)(bh / H), h = (int)(bh % H), kvh = h / (H / KV);
    const int t0 = qb * RB, rg = threadIdx.x >> 4, cg = threadIdx.x & 15, D4 = (D + 3) & ~3;
    const int64_t qstride = (int64_t)H * D, kstride = (int64_t)KV * D, qoff = ((int64_t)b * T * H + h) * D;
    const float *kb = k + ((int64_t)b * T * KV + kvh) * D, *vb = v + ((int64_t)b * T * KV + kvh) * D;
    stage<DP>(Qs, RB, q + qoff, qstride, t0, T, D);
    stage<DP>(dOs, RB, dout + qoff, qstride, t0, T, D);

    const int first = t0 + rg * RT;
    float row_lse[RT], row_delta[RT];
    float2 acc[RT][NP];
#pragma unroll
    for (int r = 0; r < RT; r++) {
        const bool ok = first + r < T;
        row_lse[r] = ok ? lse[bh * T + first + r] : 0.f;
        row_delta[r] = ok ? delta[bh * T + first + r] : 0.f;
#pragma unroll
        for (int i = 0; i < NP; i++) acc[r][i] = make_float2(0.f, 0.f);
    }
    const int ntiles = (min(t0 + RB, T) - 1) / COLS + 1;
    const int kt0 = window > 0 ? max(0, t0 - window + 1) / COLS : 0; // as in the forward
    for (int kt = kt0; kt < ntiles; kt++) {
        __syncthreads();
        stage<DP>(Ks, COLS, kb, kstride, kt * COLS, T, D);
        stage<DP>(Vs, COLS, vb, kstride, kt * COLS, T, D);
        __syncthreads();
        float s[RT][2], dp[RT][2];
        tile_dot<NP>(Qs, Ks, rg, cg, D4, s);
        tile_dot<NP>(dOs, Vs, rg, cg, D4, dp);
#pragma unroll
        for (int r = 0; r < RT; r++) {
            const int t = first + r;
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const int j = kt * COLS + cg + 16 * c;
                const bool in = j <= t && t < T && (window <= 0 || j > t - window);
                const float p = in ? expf(scale * s[r][c] - row_lse[r]) : 0.f;
                s[r][c] = p * (dp[r][c] - row_delta[r]);
            }
        }
        store_transposed<NP>(Ps, rg, cg, s);
        __syncthreads();
        tile_pv<NP>(Ps, Ks, rg, cg, acc);
    }
    float mul[RT];
#pragma unroll
    for (int r = 0; r < RT; r++) mul[r] = scale;
    store_rows<NP>(dq + qoff, qstride, first, T, D, cg, acc, mul);
}

// dK, dV: one block per (key block, b, kv head), longest (first) first, looping over the group's
// query heads and, for each, the query tiles from the block's first key on. Rows are keys here:
// S^T = K Q^T, P^T = exp(scale S^T - lse), dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - Delta),
// dK += dS^T Q; times scale at the end.
template <int NP>
__global__ void __launch_bounds__(THREADS, 2) dkdv_kernel(int T, int H, int KV, int D, int64_t BKV,
                                                       const float *__restrict__ q, const float *__restrict__ k,
                                                       const float *__restrict__ v, const float *__restrict__ dout,
                                                       const float *__restrict__ lse,
                                                       const float *__restrict__ delta, float *__restrict__ dk,
                                                       float *__restrict__ dv, float scale, int window)
{
    constexpr int RT = Geom<NP>::RT, RB = Geom<NP>::RB, DP = Geom<NP>::DP, PP = Geom<NP>::PP;
    extern __shared__ float4 smem4[];
    float *Ks = reinterpret_cast<float *>(smem4); // RB x DP
    float *Vs = Ks + RB * DP;                      // RB x DP
    float *Qs = Vs + RB * DP;                      // COLS x DP
    float *dOs = Qs + COLS * DP;                   // COLS x DP
    float *Ps = dOs + COLS * DP;                   // COLS x PP: P transposed
    float *dSs = Ps + COLS * PP;                   // COLS x PP: dS transposed

    const int64_t bkv = blockIdx.x % BKV;
    const int kblock = (int)(blockIdx.x / BKV);
    const int b = (int)(bkv / KV), kvh = (int)(bkv % KV), group = H / KV;
    const int j0 = kblock * RB, rg = threadIdx.x >> 4, cg = threadIdx.x & 15, D4 = (D + 3) & ~3;
    const int64_t qstride = (int64_t)H * D, kstride = (int64_t)KV * D, koff = ((int64_t)b * T * KV + kvh) * D;
    stage<DP>(Ks, RB, k + koff, kstride, j0, T, D);
    stage<DP>(Vs, RB, v + koff, kstride, j0, T, D);

    const int first = j0 + rg * RT;
    float2 dk_acc[RT][NP], dv_acc[RT][NP];
#pragma unroll
    for (int r = 0; r < RT; r++)
#pragma unroll
        for (int i = 0; i < NP; i++) dk_acc[r][i] = dv_acc[r][i] = make_float2(0.f, 0.f);

    for (int g = 0; g < group; g++) {
        const int h = kvh * group + g;
        const int64_t qoff = ((int64_t)b * T * H + h) * D, lrow = ((int64_t)b * H + h) * T;
        // j0 is a multiple of COLS (RB is), so the first tile starts at the block's first key
        // the queries that see the block's keys: to the end, or (window) to its last key's last
        const int iend = window > 0 ? min(T, j0 + RB - 1 + window) : T;
        for (int i0 = j0; i0 < iend; i0 += COLS) {
            __syncthreads(); // the previous tile's Q, dO, P, dS are no longer read
            stage<DP>(Qs, COLS, q + qoff, qstride, i0, T, D);
            stage<DP>(dOs, COLS, dout + qoff, qstride, i0, T, D);
            float col_lse[2], col_delta[2];
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const int i = i0 + cg + 16 * c;
                col_lse[c] = i < T ? lse[lrow + i] : 0.f;
                col_delta[c] = i < T ? delta[lrow + i] : 0.f;
            }
            __syncthreads();
            float s[RT][2], dp[RT][2];
            tile_dot<NP>(Ks, Qs, rg, cg, D4, s);
            tile_dot<NP>(Vs, dOs, rg, cg, D4, dp);
#pragma unroll
            for (int r = 0; r < RT; r++) {
                const int j = first + r;
#pragma unroll
                for (int c = 0; c < 2; c++) {
                    const int i = i0 + cg + 16 * c;
                    const bool in = i >= j && i < T && j < T && (window <= 0 || i < j + window);
                    const float p = in ? expf(scale * s[r][c] - col_lse[c]) : 0.f;
                    s[r][c] = p;
                    dp[r][c] = p * (dp[r][c] - col_delta[c]);
                }
            }
            store_transposed<NP>(Ps, rg, cg, s);
            store_transposed<NP>(dSs, rg, cg, dp);
            __syncthreads();
            tile_pv<NP>(Ps, dOs, rg, cg, dv_acc);
            tile_pv<NP>(dSs, Qs, rg, cg, dk_acc);
        }
    }
    float one[RT], mul[RT];
#pragma unroll
    for (int r = 0; r < RT; r++) one[r] = 1.f, mul[r] = scale;
    store_rows<NP>(dv + koff, kstride, first, T, D, cg, dv_acc, one);
    store_rows<NP>(dk + koff, kstride, first, T, D, cg, dk_acc, mul);
}

// ---------------------------------------------------------------- launchers

template <int NP>
constexpr size_t forward_smem() { return ((size_t)(Geom<NP>::RB + 2 * COLS) * Geom<NP>::DP + COLS * Geom<NP>::PP) * 4; }
template <int NP>
constexpr size_t dq_smem() { return ((size_t)(2 * Geom<NP>::RB + 2 * COLS) * Geom<NP>::DP + COLS * Geom<NP>::PP) * 4; }
template <int NP>
constexpr size_t dkdv_smem()
{
    return ((size_t)(2 * Geom<NP>::RB + 2 * COLS) * Geom<NP>::DP + 2 * COLS * Geom<NP>::PP) * 4;
}

void check_shapes(const char *what, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D, const void *const *ptrs,
                  int nptrs)
{
    MT_CUDA_REQUIRE(B >= 0 && T >= 0 && H > 0 && KV > 0 && H % KV == 0 && D >= 2 && D <= 256 && D % 2 == 0,
                    "%s: unsupported shape B=%lld T=%lld H=%lld KV=%lld D=%lld (need H %% KV == 0 and an even "
                    "head dim 2..256)",
                    what, (long long)B, (long long)T, (long long)H, (long long)KV, (long long)D);
    // grids put (row blocks x B x heads) in x: 32 rows per block at least
    MT_CUDA_REQUIRE(T < (1LL << 31) && (T + 31) / 32 * B * H < (1LL << 31),
                    "%s: shape too large for one launch (B=%lld T=%lld H=%lld)", what, (long long)B, (long long)T,
                    (long long)H);
    for (int i = 0; i < nptrs; i++)
        MT_CUDA_REQUIRE((uintptr_t)ptrs[i] % 8 == 0, "%s: tensor %d is not 8-byte aligned (float2 accesses)", what,
                        i);
}

template <int NP>
void forward(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D, const float *q, const float *k, const float *v,
             float *out, float *lse, int window, cudaStream_t stream)
{
    constexpr size_t smem = forward_smem<NP>();
    CUDA_CHECK(cudaFuncSetAttribute(forward_kernel<NP>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    const int64_t nqb = (T + Geom<NP>::RB - 1) / Geom<NP>::RB;
    forward_kernel<NP><<<(unsigned)(nqb * B * H), THREADS, smem, stream>>>(
        (int)T, (int)H, (int)KV, (int)D, B * H, q, k, v, out, lse, (float)(1.0 / sqrt((double)D)), window);
    CUDA_CHECK_LAUNCH();
}

template <int NP>
void backward(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D, const float *q, const float *k,
              const float *v, const float *lse, const float *dout, const float *delta, float *dq, float *dk,
              float *dv, int window, cudaStream_t stream)
{
    constexpr int RB = Geom<NP>::RB;
    const float scale = (float)(1.0 / sqrt((double)D));
    const int64_t nblocks = (T + RB - 1) / RB;
    constexpr size_t smem_kv = dkdv_smem<NP>(), smem_q = dq_smem<NP>();
    CUDA_CHECK(cudaFuncSetAttribute(dkdv_kernel<NP>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_kv));
    dkdv_kernel<NP><<<(unsigned)(nblocks * B * KV), THREADS, smem_kv, stream>>>(
        (int)T, (int)H, (int)KV, (int)D, B * KV, q, k, v, dout, lse, delta, dk, dv, scale, window);
    CUDA_CHECK_LAUNCH();
    CUDA_CHECK(cudaFuncSetAttribute(dq_kernel<NP>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_q));
    dq_kernel<NP><<<(unsigned)(nblocks * B * H), THREADS, smem_q, stream>>>((int)T, (int)H, (int)KV, (int)D, B * H,
                                                                          q, k, v, dout, lse, delta, dq, scale,
                                                                          window);
    CUDA_CHECK_LAUNCH();
}

} // namespace

extern "C" void mt_cuda_attention_forward_f32_ex(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                                                 int64_t window, const float *sinks, const float *q, const float *k,
                                                 const float *v, float *out, float *lse, mt_cuda_stream stream)
{
    const void *ptrs[] = {q, k, v, out};
    check_shapes("mt_cuda_attention_forward_f32", B, T, H, KV, D, ptrs, 4);
    if (B == 0 || T == 0) return;
    cudaStream_t s = as_stream(stream);
    const int w = mt_attention_window(window, T);
    switch ((D + 31) / 32) {
    case 1: forward<1>(B, T, H, KV, D, q, k, v, out, lse, w, s); break;
    case 2: forward<2>(B, T, H, KV, D, q, k, v, out, lse, w, s); break;
    case 3: forward<3>(B, T, H, KV, D, q, k, v, out, lse, w, s); break;
    case 4: forward<4>(B, T, H, KV, D, q, k, v, out, lse, w, s); break;
    case 5: forward<5>(B, T, H, KV, D, q, k, v, out, lse, w, s); break;
    case 6: forward<6>(B, T, H, KV, D, q, k, v, out, lse, w, s); break;
    case 7: forward<7>(B, T, H, KV, D, q, k, v, out, lse, w, s); break;
    default: forward<8>(B, T, H, KV, D, q, k, v, out, lse, w, s); break;
    }
    if (sinks) mt_attention_sinks_apply_f32(B, T, H, D, sinks, out, lse, s);
}

extern "C" void mt_cuda_attention_forward_f32(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D, const float *q,
                                              const float *k, const float *v, float *out, float *lse,
                                              mt_cuda_stream stream)
{
    mt_cuda_attention_forward_f32_ex(B, T, H, KV, D, 0, nullptr, q, k, v, out, lse, stream);
}

extern "C" size_t mt_cuda_attention_f32_workspace_bytes(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D)
{
    (void)KV, (void)D;
    return (size_t)(B * H * T) * sizeof(float); // Delta (B, H, T)
}

extern "C" void mt_cuda_attention_backward_f32_ex(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                                                  int64_t window, const float *sinks, const float *q, const float *k,
                                                  const float *v, const float *out, const float *lse,
                                                  const float *dout, float *dq, float *dk, float *dv, float *dsinks,
                                                  void *workspace, mt_cuda_stream stream)
{
    const void *ptrs[] = {q, k, v, out, dout, dq, dk, dv};
    check_shapes("mt_cuda_attention_backward_f32", B, T, H, KV, D, ptrs, 8);
    if (B == 0 || T == 0) return;
    cudaStream_t s = as_stream(stream);
    float *delta = (float *)workspace;
    const int64_t rows = B * T * H;
    const int warps_per_block = 8;
    delta_kernel<<<(unsigned)((rows + warps_per_block - 1) / warps_per_block), warps_per_block * 32, 0, s>>>(
        rows, (int)T, (int)H, (int)D, out, dout, delta);
    CUDA_CHECK_LAUNCH();
    const int w = mt_attention_window(window, T);
    switch ((D + 31) / 32) {
    case 1: backward<1>(B, T, H, KV, D, q, k, v, lse, dout, delta, dq, dk, dv, w, s); break;
    case 2: backward<2>(B, T, H, KV, D, q, k, v, lse, dout, delta, dq, dk, dv, w, s); break;
    case 3: backward<3>(B, T, H, KV, D, q, k, v, lse, dout, delta, dq, dk, dv, w, s); break;
    case 4: backward<4>(B, T, H, KV, D, q, k, v, lse, dout, delta, dq, dk, dv, w, s); break;
    case 5: backward<5>(B, T, H, KV, D, q, k, v, lse, dout, delta, dq, dk, dv, w, s); break;
    case 6: backward<6>(B, T, H, KV, D, q, k, v, lse, dout, delta, dq, dk, dv, w, s); break;
    case 7: backward<7>(B, T, H, KV, D, q, k, v, lse, dout, delta, dq, dk, dv, w, s); break;
    default: backward<8>(B, T, H, KV, D, q, k, v, lse, dout, delta, dq, dk, dv, w, s); break;
    }
    if (sinks && dsinks) mt_attention_sinks_grad_f32(B, T, H, sinks, lse, delta, dsinks, s);
}

extern "C" void mt_cuda_attention_backward_f32(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                                               const float *q, const float *k, const float *v, const float *out,
                                               const float *lse, const float *dout, float *dq, float *dk, float *dv,
                                               void *workspace, mt_cuda_stream stream)
{
    mt_cuda_attention_backward_f32_ex(B, T, H, KV, D, 0, nullptr, q, k, v, out, lse, dout, dq, dk, dv, nullptr,
                                      workspace, stream);
}
