// The own attention backward (attention_own.cuh), deterministic (no float atomics): Delta =
// rowsum(dO * O) (or, exact, rowsum(P dP) by the dQ kernel's loop) first, then one kernel owns a
// key block and writes dK, dV once, and a second owns a query block and writes dQ once, both
// recomputing the probabilities from the saved log-sum-exp. The dK/dV kernel keeps 16 keys per
// warp: 32 would need 256 accumulator registers.
#include <math.h>

#include "backends/cuda/attention_own.cuh"
#include "backends/cuda/attention_tiles.cuh"

using namespace mt_attention;

namespace {

// delta (B,H,T) = rowsum(dout * out), one warp per (b, t, h) row, fixed reduction order.
__global__ void attention_delta_kernel(int64_t rows, int T, int H, int D, const bf16 *__restrict__ out,
                                       const bf16 *__restrict__ dout, float *__restrict__ delta)
{
    const int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const bf16 *o = out + row * D, *d = dout + row * D;
    float sum = 0.f;
    for (int i = lane; i < D; i += 32) sum += __bfloat162float(o[i]) * __bfloat162float(d[i]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (lane == 0) {
        const int h = (int)(row % H);
        const int64_t bt = row / H, b = bt / T, t = bt % T;
        delta[(b * H + h) * T + t] = sum;
    }
}

// dK, dV for one key block of one kv head: one CTA per (key block, kv head, batch), looping over
// the group's query heads and, for each, the query blocks from the diagonal to the end. Each warp
// owns 16 keys, so every product below stays inside the warp:
//   S^T = K Q^T, P^T = exp2(S^T scale log2e - lse log2e), dV += P^T dO,
//   dP^T = V dO^T, dS^T = P^T (dP^T - Delta), dK += dS^T Q (times scale at the end).
template <int D>
__global__ void __launch_bounds__(THREADS) attention_backward_dkdv_kernel(
    int T, int H, int KV, const bf16 *__restrict__ q, const bf16 *__restrict__ k, const bf16 *__restrict__ v,
    const bf16 *__restrict__ dout, const float *__restrict__ lse, const float *__restrict__ delta, float *__restrict__ dk,
    float *__restrict__ dv, float scale_log2, float scale, int window)
{
    constexpr int TE = Tile<D>::ELEMS;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16 *k_tile = reinterpret_cast<bf16 *>(smem_raw); // (64, D)
    bf16 *v_tile = k_tile + TE;                         // (64, D)
    bf16 *q_tiles = v_tile + TE;                        // 2 x (64, D)
    bf16 *do_tiles = q_tiles + 2 * TE;                  // 2 x (64, D)
    float *lse_s = reinterpret_cast<float *>(do_tiles + 2 * TE); // 2 x 64, log2 units, +inf past T
    float *delta_s = lse_s + 2 * BLOCK;                          // 2 x 64, 0 past T

    // z slowest: every head's key block 0 (the most query blocks) launches first, then block 1, ...
    // (with key blocks fastest, the long blocks would come last and idle SMs in the tail).
    const int kblock = blockIdx.z, kvh = blockIdx.x, b = blockIdx.y;
    const int group = H / KV, nblocks = (T + BLOCK - 1) / BLOCK, n0 = kblock * BLOCK;
    // the query blocks that see these keys: from the diagonal to the end, or (window) to the
    // block of the last key's last query, n0 + BLOCK - 1 + window - 1
    const int qlast = window > 0 ? min(nblocks - 1, (n0 + BLOCK + window - 2) / BLOCK) : nblocks - 1;
    const int nq = qlast - kblock + 1;
    const int total = group * nq; // (query head, query block) steps, in a fixed order
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, quad = lane & 3;

    load_tile<D>(k_tile, k + ((int64_t)b * T * KV + kvh) * D, (int64_t)KV * D, n0, T);
    load_tile<D>(v_tile, v + ((int64_t)b * T * KV + kvh) * D, (int64_t)KV * D, n0, T);

    // Starts loading step `step` into stage `stage` (the caller commits).
    auto issue = [&](int step, int stage) {
        const int hq = kvh * group + step / nq, t0 = (kblock + step % nq) * BLOCK;
        load_tile<D>(q_tiles + stage * TE, q + ((int64_t)b * T * H + hq) * D, (int64_t)H * D, t0, T);
        load_tile<D>(do_tiles + stage * TE, dout + ((int64_t)b * T * H + hq) * D, (int64_t)H * D, t0, T);
        if (threadIdx.x < BLOCK) {
            const int t = t0 + threadIdx.x;
            const int64_t row = ((int64_t)b * H + hq) * T + t;
            lse_s[stage * BLOCK + threadIdx.x] = t < T ? lse[row] * LOG2E : INFINITY; // P = 0 past T
            delta_s[stage * BLOCK + threadIdx.x] = t < T ? delta[row] : 0.f;
        }
    };
    issue(0, 0);
    cp_async_commit();

    float dk_acc[D / 8][4], dv_acc[D / 8][4]; // this warp's 16 keys x D
#pragma unroll
    for (int i = 0; i < D / 8; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) dk_acc[i][e] = dv_acc[i][e] = 0.f;

    for (int step = 0; step < total; step++) {
        const int buf = step & 1;
        if (step + 1 < total) {
            issue(step + 1, buf ^ 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const bf16 *qt = q_tiles + buf * TE, *dot = do_tiles + buf * TE;
        const float *lse_b = lse_s + buf * BLOCK, *delta_b = delta_s + buf * BLOCK;
        const bool diagonal = step % nq == 0;
        const int qoff = (step % nq) * BLOCK; // this query block's first row, less n0

        // P^T (16 keys x 64 queries), from S^T = K Q^T
        float p[8][4];
        gemm_abt<D>(p, k_tile, warp * 16, qt);
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int krow = warp * 16 + g + 8 * (e >> 1), qcol = 8 * nt + 2 * quad + (e & 1);
                const float pe = fast_exp2(fmaf(p[nt][e], scale_log2, -lse_b[qcol]));
                const bool out = (diagonal && krow > qcol) || (window > 0 && qoff + qcol - krow >= window);
                p[nt][e] = out ? 0.f : pe; // select: a masked exp2 may be inf
            }

        gemm_acc_pv<D>(dv_acc, p, dot); // dV += P^T dO

        // dS^T = P^T (dP^T - Delta), dP^T = V dO^T
        float ds[8][4];
        gemm_abt<D>(ds, v_tile, warp * 16, dot);
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int qcol = 8 * nt + 2 * quad + (e & 1);
                ds[nt][e] = p[nt][e] * (ds[nt][e] - delta_b[qcol]);
            }

        gemm_acc_pv<D>(dk_acc, ds, qt); // dK += dS^T Q
        __syncthreads();                // all warps done with buf before it is refilled
    }

#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int t = n0 + warp * 16 + g + 8 * half;
        if (t >= T) continue;
        const int64_t off = (((int64_t)b * T + t) * KV + kvh) * D;
#pragma unroll
        for (int dt = 0; dt < D / 8; dt++) {
            const int d = dt * 8 + 2 * quad;
            *reinterpret_cast<float2 *>(dk + off + d) =
                make_float2(dk_acc[dt][2 * half] * scale, dk_acc[dt][2 * half + 1] * scale);
            *reinterpret_cast<float2 *>(dv + off + d) = make_float2(dv_acc[dt][2 * half], dv_acc[dt][2 * half + 1]);
        }
    }
}

// dQ for one query block of one head: one CTA per (query block, head, batch), looping over key
// blocks from the diagonal down and recomputing P (the price of writing dQ once, without atomics):
//   S = Q K^T, P = exp2(S scale log2e - lse log2e), dP = dO V^T, dS = P (dP - Delta), dQ += dS K.
// DELTA: the same loop writes Delta = rowsum(P dP) instead (exact_delta below), dq untouched.
template <int D, int QW, bool DELTA>
__global__ void __launch_bounds__(QW * 32) attention_backward_dq_kernel(
    int T, int H, int KV, const bf16 *__restrict__ q, const bf16 *__restrict__ k, const bf16 *__restrict__ v,
    const bf16 *__restrict__ dout, const float *__restrict__ lse, float *__restrict__ delta, float *__restrict__ dq,
    float scale_log2, float scale, int window)
{
    constexpr int NT = QW * 32, QB = 16 * QW;
    constexpr int TE = Tile<D>::ELEMS;        // one 64-row K or V tile
    constexpr int QE = QB * Tile<D>::LD;      // a query-rows tile
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16 *q_tile = reinterpret_cast<bf16 *>(smem_raw); // (QB, D)
    bf16 *do_tile = q_tile + QE;                        // (QB, D)
    bf16 *k_tiles = do_tile + QE;                       // 2 x (64, D)
    bf16 *v_tiles = k_tiles + 2 * TE;                   // 2 x (64, D)

    const int qblock = gridDim.z - 1 - blockIdx.z; // longest first, as in the forward
    const int h = blockIdx.x, b = blockIdx.y, kvh = h / (H / KV);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, quad = lane & 3;
    const int m0 = qblock * QB, wrow0 = m0 + warp * 16;
    const int nkb = (T + BLOCK - 1) / BLOCK;
    const int jmax = min((m0 + QB - 1) / BLOCK, nkb - 1);
    const int jmin = window > 0 ? max(0, m0 - window + 1) / BLOCK : 0; // as in the forward
    const bf16 *kg = k + ((int64_t)b * T * KV + kvh) * D;
    const bf16 *vg = v + ((int64_t)b * T * KV + kvh) * D;

    load_rows<D, QB, NT>(q_tile, q + ((int64_t)b * T * H + h) * D, (int64_t)H * D, m0, T);
    load_rows<D, QB, NT>(do_tile, dout + ((int64_t)b * T * H + h) * D, (int64_t)H * D, m0, T);
    load_rows<D, BLOCK, NT>(k_tiles, kg, (int64_t)KV * D, jmax * BLOCK, T);
    load_rows<D, BLOCK, NT>(v_tiles, vg, (int64_t)KV * D, jmax * BLOCK, T);
    cp_async_commit();

    float row_lse[2], row_delta[2]; // rows g and g+8 of this warp
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int t = wrow0 + g + 8 * half;
        const int64_t row = ((int64_t)b * H + h) * T + t;
        row_lse[half] = t < T ? lse[row] * LOG2E : INFINITY;
        row_delta[half] = t < T && !DELTA ? delta[row] : 0.f; // DELTA: this thread's share of the sum
    }
    float dq_acc[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) dq_acc[i][e] = 0.f;

    for (int it = 0; it <= jmax - jmin; it++) {
        const int j = jmax - it, buf = it & 1, k0 = j * BLOCK;
        kv_pipeline_step<D, NT>(k_tiles, v_tiles, kg, vg, (int64_t)KV * D, j, buf, T, jmin);
        __syncthreads();
        // every key of this block after every row of this warp, or before every row's window
        if (k0 > wrow0 + 15 || (window > 0 && k0 + BLOCK - 1 <= wrow0 - window)) {
            __syncthreads();
            continue;
        }
        const bool masked = k0 + BLOCK - 1 > wrow0 || (window > 0 && k0 <= wrow0 + 15 - window);
        const bf16 *kt = k_tiles + buf * TE, *vt = v_tiles + buf * TE;

        float p[8][4]; // P (16 queries x 64 keys)
        gemm_abt<D>(p, q_tile, warp * 16, kt);
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int qrow = wrow0 + g + 8 * (e >> 1), kcol = k0 + 8 * nt + 2 * quad + (e & 1);
                const float pe = fast_exp2(fmaf(p[nt][e], scale_log2, -row_lse[e >> 1]));
                p[nt][e] = masked && (kcol > qrow || (window > 0 && kcol <= qrow - window)) ? 0.f : pe;
            }

        float ds[8][4]; // dP = dO V^T, then dS = P (dP - Delta)
        gemm_abt<D>(ds, do_tile, warp * 16, vt);
        if constexpr (DELTA) {
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) row_delta[e >> 1] = fmaf(p[nt][e], ds[nt][e], row_delta[e >> 1]);
        } else {
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) ds[nt][e] = p[nt][e] * (ds[nt][e] - row_delta[e >> 1]);
            gemm_acc_pv<D>(dq_acc, ds, kt); // dQ += dS K
        }
        __syncthreads();
    }

#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int t = wrow0 + g + 8 * half;
        if constexpr (DELTA) { // the 4 lanes of a quad share a row, each summed 16 of every 64 keys
            float sum = row_delta[half];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            if (t < T && quad == 0) delta[((int64_t)b * H + h) * T + t] = sum;
            continue;
        }
        if (t >= T) continue;
        float *row = dq + (((int64_t)b * T + t) * H + h) * D;
#pragma unroll
        for (int dt = 0; dt < D / 8; dt++)
            *reinterpret_cast<float2 *>(row + dt * 8 + 2 * quad) =
                make_float2(dq_acc[dt][2 * half] * scale, dq_acc[dt][2 * half + 1] * scale);
    }
}

constexpr size_t tile_bytes(int64_t D) { return (size_t)BLOCK * (size_t)(D + 8) * sizeof(bf16); }

template <int D, int QW, bool DELTA = false>
void dq_qw(int64_t B, int64_t T, int64_t H, int64_t KV, const bf16 *q, const bf16 *k, const bf16 *v, const bf16 *dout,
           const float *lse, float *delta, float *dq, float scale_log2, float scale, int window, cudaStream_t stream)
{
    constexpr int QB = 16 * QW;
    const size_t smem = (size_t)(2 * QB + 4 * BLOCK) * (size_t)(D + 8) * sizeof(bf16);
    CUDA_CHECK(cudaFuncSetAttribute(attention_backward_dq_kernel<D, QW, DELTA>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    attention_backward_dq_kernel<D, QW, DELTA><<<dim3((unsigned)H, (unsigned)B, (unsigned)((T + QB - 1) / QB)), QW * 32,
                                                 smem, stream>>>((int)T, (int)H, (int)KV, q, k, v, dout, lse, delta, dq,
                                                                 scale_log2, scale, window);
    CUDA_CHECK_LAUNCH();
}

template <int D>
void backward(mt_cuda_qblock qblock, int64_t B, int64_t T, int64_t H, int64_t KV, const bf16 *q, const bf16 *k,
              const bf16 *v, const bf16 *out, const float *lse, const bf16 *dout, float *dq, float *dk, float *dv,
              float *delta, int window, bool exact_delta, cudaStream_t stream)
{
    const float scale = (float)(1.0 / sqrt((double)D)), scale_log2 = scale * LOG2E;
    if (exact_delta) {
        dq_qw<D, 4, true>(B, T, H, KV, q, k, v, dout, lse, delta, nullptr, scale_log2, scale, window, stream);
    } else {
        const int64_t rows = B * T * H;
        const int warps_per_block = 8;
        attention_delta_kernel<<<(unsigned)((rows + warps_per_block - 1) / warps_per_block), warps_per_block * 32, 0,
                                 stream>>>(rows, (int)T, (int)H, D, out, dout, delta);
        CUDA_CHECK_LAUNCH();
    }

    const unsigned nblocks = (unsigned)((T + BLOCK - 1) / BLOCK);
    const size_t smem_kv = 6 * tile_bytes(D) + 4 * BLOCK * sizeof(float);
    CUDA_CHECK(cudaFuncSetAttribute(attention_backward_dkdv_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)smem_kv));
    attention_backward_dkdv_kernel<D><<<dim3((unsigned)KV, (unsigned)B, nblocks), THREADS, smem_kv, stream>>>(
        (int)T, (int)H, (int)KV, q, k, v, dout, lse, delta, dk, dv, scale_log2, scale, window);
    CUDA_CHECK_LAUNCH();

    if (qblock == MT_CUDA_QBLOCK_128)
        dq_qw<D, 8>(B, T, H, KV, q, k, v, dout, lse, delta, dq, scale_log2, scale, window, stream);
    else
        dq_qw<D, 4>(B, T, H, KV, q, k, v, dout, lse, delta, dq, scale_log2, scale, window, stream);
}

} // namespace

size_t mt_attention_own_workspace_bytes(int64_t B, int64_t T, int64_t H) { return (size_t)(B * H * T) * sizeof(float); }

void mt_attention_own_backward(mt_cuda_qblock qblock, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                               int64_t window, const bf16 *q, const bf16 *k, const bf16 *v, const bf16 *out,
                               const float *lse, const bf16 *dout, float *dq, float *dk, float *dv, float *delta,
                               bool exact_delta, cudaStream_t stream)
{
    const int w = mt_attention_window(window, T);
    switch (D) {
    case 32:
        backward<32>(qblock, B, T, H, KV, q, k, v, out, lse, dout, dq, dk, dv, delta, w, exact_delta, stream);
        break;
    case 64:
        backward<64>(qblock, B, T, H, KV, q, k, v, out, lse, dout, dq, dk, dv, delta, w, exact_delta, stream);
        break;
    case 96:
        backward<96>(qblock, B, T, H, KV, q, k, v, out, lse, dout, dq, dk, dv, delta, w, exact_delta, stream);
        break;
    default:
        backward<128>(qblock, B, T, H, KV, q, k, v, out, lse, dout, dq, dk, dv, delta, w, exact_delta, stream);
        break;
    }
}
