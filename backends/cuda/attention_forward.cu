// The own attention forward (attention_own.cuh): one CTA per (query block, head, batch) keeps
// a running max and sum per query row (online softmax) over key blocks of 64 held in registers
// as tiles, never a T x T matrix, and saves the log-sum-exp for the backward.
#include <math.h>

#include "backends/cuda/attention_own.cuh"
#include "backends/cuda/attention_tiles.cuh"

using namespace mt_attention;

namespace {

// One CTA per (query block of 16 QW RPW rows, head, batch), QW warps of 16 RPW query rows each;
// key blocks of 64. Key blocks are visited from the last one the block's rows reach down to 0,
// so each warp's first block is the one holding its diagonal: every row then has a finite
// running max from the start (a warp's 16 RPW rows, RPW <= 2, never straddle a key block). A
// warp skips the blocks entirely after its rows (QW RPW > 4: the top of the diagonal) but still
// loads and synchronises with the CTA.
// Forms (mt_cuda_qblock): QW = 4, RPW = 1 (64-row query blocks); QW = 8, RPW = 1
// (128 rows, 8 warps: each K/V tile in shared memory feeds twice the rows, but each warp still
// reads one K/V fragment per two MMAs); QW = 4, RPW = 2 (128 rows, 4 warps of 32 rows: each
// K/V fragment a warp reads from shared memory feeds four MMAs, as FlashAttention-2's forward
// does; Q is read from shared memory per k step instead of held in registers, which would not
// fit next to the two 16-row output accumulators).
template <int D, int QW, int RPW>
__global__ void __launch_bounds__(QW * 32) attention_forward_kernel(int T, int H, int KV, const bf16 *__restrict__ q,
                                                                    const bf16 *__restrict__ k,
                                                                    const bf16 *__restrict__ v, bf16 *__restrict__ out,
                                                                    float *__restrict__ lse, float scale_log2,
                                                                    int window)
{
    static_assert(RPW == 1 || RPW == 2, "a warp owns 16 or 32 query rows");
    constexpr int NT = QW * 32, WR = 16 * RPW, QB = WR * QW;
    constexpr int LD = Tile<D>::LD;
    constexpr int TE = Tile<D>::ELEMS;        // one 64-row K or V tile
    constexpr int QE = QB * LD;               // the query tile
    constexpr bool Q_IN_REGS = RPW == 1;      // this warp's Q fragments loaded once into registers
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16 *q_tile = reinterpret_cast<bf16 *>(smem_raw);  // (QB, D)
    bf16 *k_tiles = q_tile + QE;                          // 2 x (64, D), double buffered
    bf16 *v_tiles = k_tiles + 2 * TE;                     // 2 x (64, D)

    // Blocks launch in order x fastest, z slowest: the query blocks with the most key blocks (the
    // last ones) start first across all heads, so short blocks fill the end of the launch.
    const int qblock = gridDim.z - 1 - blockIdx.z;
    const int h = blockIdx.x, b = blockIdx.y, kvh = h / (H / KV);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, quad = lane & 3;
    const int m0 = qblock * QB, wrow0 = m0 + warp * WR; // the block's and this warp's first row
    const int nkb = (T + BLOCK - 1) / BLOCK;
    const int jmax = min((m0 + QB - 1) / BLOCK, nkb - 1);
    // a sliding window: query t sees keys t - window + 1 .. t, so no row of the block reaches
    // below the block of its first row's first key
    const int jmin = window > 0 ? max(0, m0 - window + 1) / BLOCK : 0;
    const bf16 *qg = q + ((int64_t)b * T * H + h) * D; // row t at qg + t * H * D
    const bf16 *kg = k + ((int64_t)b * T * KV + kvh) * D;
    const bf16 *vg = v + ((int64_t)b * T * KV + kvh) * D;

    load_rows<D, QB, NT>(q_tile, qg, (int64_t)H * D, m0, T);
    load_rows<D, BLOCK, NT>(k_tiles, kg, (int64_t)KV * D, jmax * BLOCK, T);
    load_rows<D, BLOCK, NT>(v_tiles, vg, (int64_t)KV * D, jmax * BLOCK, T);
    cp_async_commit();

    uint32_t qf[Q_IN_REGS ? D / 16 : 1][4]; // RPW 1: this warp's 16 query rows as A fragments
    float o[RPW][D / 8][4];                 // unnormalised output, rows g and g+8 of each 16
#pragma unroll
    for (int r = 0; r < RPW; r++)
#pragma unroll
        for (int i = 0; i < D / 8; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) o[r][i][e] = 0.f;
    float row_max[RPW][2], row_sum[RPW][2]; // max in units of log2, of the scaled scores; sums
                                            // are this thread's partial (its 16 of 64 columns)
#pragma unroll
    for (int r = 0; r < RPW; r++) row_max[r][0] = row_max[r][1] = -INFINITY, row_sum[r][0] = row_sum[r][1] = 0.f;

    for (int it = 0; it <= jmax - jmin; it++) {
        const int j = jmax - it, buf = it & 1, k0 = j * BLOCK;
        kv_pipeline_step<D, NT>(k_tiles, v_tiles, kg, vg, (int64_t)KV * D, j, buf, T, jmin);
        __syncthreads();
        const bf16 *kt = k_tiles + buf * TE, *vt = v_tiles + buf * TE;
        if constexpr (Q_IN_REGS) {
            if (it == 0) {
#pragma unroll
                for (int kk = 0; kk < D / 16; kk++) load_a<LD>(qf[kk], q_tile, warp * 16, kk * 16);
            }
        }
        // every key of this block after every row of this warp, or (window) before every row's
        // window; the warp's first block holds its diagonal, so its running max is finite after it
        if (k0 > wrow0 + WR - 1 || (window > 0 && k0 + BLOCK - 1 <= wrow0 - window)) {
            __syncthreads();
            continue;
        }

        // S = Q K^T for this warp's 16 RPW rows x 64 keys; each K fragment feeds all RPW row tiles
        float s[RPW][8][4];
#pragma unroll
        for (int r = 0; r < RPW; r++)
#pragma unroll
            for (int i = 0; i < 8; i++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[r][i][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            uint32_t a[RPW][4];
            if constexpr (Q_IN_REGS) {
#pragma unroll
                for (int e = 0; e < 4; e++) a[0][e] = qf[kk][e];
            } else {
#pragma unroll
                for (int r = 0; r < RPW; r++) load_a<LD>(a[r], q_tile, warp * WR + 16 * r, kk * 16);
            }
#pragma unroll
            for (int nn = 0; nn < 4; nn++) {
                uint32_t bfr[4];
                load_b_rows<LD>(bfr, kt, nn * 16, kk * 16);
#pragma unroll
                for (int r = 0; r < RPW; r++) {
                    mma_bf16(s[r][2 * nn], a[r], bfr[0], bfr[1]);
                    mma_bf16(s[r][2 * nn + 1], a[r], bfr[2], bfr[3]);
                }
            }
        }

#pragma unroll
        for (int r = 0; r < RPW; r++) {
            const int rrow0 = wrow0 + 16 * r; // this row tile's first row
            // some key after some row (the causal mask), or before some row's window
            const bool masked = k0 + BLOCK - 1 > rrow0 || (window > 0 && k0 <= rrow0 + 15 - window);
            // the mask, on the unscaled scores
            if (masked) {
#pragma unroll
                for (int nt = 0; nt < 8; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        int qrow = rrow0 + g + 8 * (e >> 1), kcol = k0 + 8 * nt + 2 * quad + (e & 1);
                        if (kcol > qrow || (window > 0 && kcol <= qrow - window)) s[r][nt][e] = -INFINITY;
                    }
            }

            // online softmax in log2 units: rescale what was accumulated by exp2(old max - new
            // max). The max is taken before scaling (scale_log2 > 0 and rounding is monotonic, so
            // max(s) scale_log2 is exactly the max of the scaled scores); the scale then folds
            // into one fma per score.
#pragma unroll
            for (int half = 0; half < 2; half++) {
                float mx = -INFINITY;
#pragma unroll
                for (int nt = 0; nt < 8; nt++) mx = fmaxf(mx, fmaxf(s[r][nt][2 * half], s[r][nt][2 * half + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1)); // the 4 lanes of a quad share a row
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                mx = fmaxf(row_max[r][half], mx * scale_log2);
                const float base = mx == -INFINITY ? 0.f : mx; // a fully masked row stays all zero
                const float alpha = fast_exp2(row_max[r][half] - base);
                row_max[r][half] = mx;
                row_sum[r][half] *= alpha;
#pragma unroll
                for (int dt = 0; dt < D / 8; dt++) {
                    o[r][dt][2 * half] *= alpha;
                    o[r][dt][2 * half + 1] *= alpha;
                }
#pragma unroll
                for (int nt = 0; nt < 8; nt++) {
                    float p0 = fast_exp2(fmaf(s[r][nt][2 * half], scale_log2, -base));
                    float p1 = fast_exp2(fmaf(s[r][nt][2 * half + 1], scale_log2, -base));
                    s[r][nt][2 * half] = p0;
                    s[r][nt][2 * half + 1] = p1;
                    row_sum[r][half] += p0 + p1;
                }
            }
        }

        // O += P V; each V fragment feeds all RPW row tiles
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            uint32_t a[RPW][4];
#pragma unroll
            for (int r = 0; r < RPW; r++) acc_to_a(a[r], s[r], kk);
#pragma unroll
            for (int dn = 0; dn < D / 16; dn++) {
                uint32_t bfr[4];
                load_b_cols<LD>(bfr, vt, kk * 16, dn * 16);
#pragma unroll
                for (int r = 0; r < RPW; r++) {
                    mma_bf16(o[r][2 * dn], a[r], bfr[0], bfr[1]);
                    mma_bf16(o[r][2 * dn + 1], a[r], bfr[2], bfr[3]);
                }
            }
        }
        __syncthreads(); // all warps done with buf before it is refilled
    }

    // finish: full row sums across the quad, normalise, write bf16 rows and the lse
#pragma unroll
    for (int r = 0; r < RPW; r++)
#pragma unroll
        for (int half = 0; half < 2; half++) {
            float l = row_sum[r][half];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const int t = wrow0 + 16 * r + g + 8 * half;
            if (t >= T) continue;
            const float inv = 1.f / l;
            bf16 *orow = out + (((int64_t)b * T + t) * H + h) * D;
#pragma unroll
            for (int dt = 0; dt < D / 8; dt++)
                *reinterpret_cast<uint32_t *>(orow + dt * 8 + 2 * quad) =
                    pack_bf16(o[r][dt][2 * half] * inv, o[r][dt][2 * half + 1] * inv);
            if (quad == 0) lse[((int64_t)b * H + h) * T + t] = (row_max[r][half] + log2f(l)) * LN2;
        }
}

template <int D, int QW, int RPW>
void forward_qw(int64_t B, int64_t T, int64_t H, int64_t KV, const bf16 *q, const bf16 *k, const bf16 *v, bf16 *out,
                float *lse, int window, cudaStream_t stream)
{
    constexpr int QB = 16 * QW * RPW;
    const size_t smem = (size_t)(QB + 4 * BLOCK) * (size_t)(D + 8) * sizeof(bf16);
    CUDA_CHECK(cudaFuncSetAttribute(attention_forward_kernel<D, QW, RPW>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    dim3 grid((unsigned)H, (unsigned)B, (unsigned)((T + QB - 1) / QB));
    const float scale_log2 = (float)(1.0 / sqrt((double)D)) * LOG2E;
    attention_forward_kernel<D, QW, RPW><<<grid, QW * 32, smem, stream>>>((int)T, (int)H, (int)KV, q, k, v, out, lse,
                                                                          scale_log2, window);
    CUDA_CHECK_LAUNCH();
}

template <int D>
void forward(mt_cuda_qblock qblock, int64_t B, int64_t T, int64_t H, int64_t KV, const bf16 *q, const bf16 *k,
             const bf16 *v, bf16 *out, float *lse, int window, cudaStream_t stream)
{
    switch (qblock) {
    case MT_CUDA_QBLOCK_128: forward_qw<D, 8, 1>(B, T, H, KV, q, k, v, out, lse, window, stream); break;
    case MT_CUDA_QBLOCK_128W: forward_qw<D, 4, 2>(B, T, H, KV, q, k, v, out, lse, window, stream); break;
    default: forward_qw<D, 4, 1>(B, T, H, KV, q, k, v, out, lse, window, stream); break;
    }
}

} // namespace

void mt_attention_own_forward(mt_cuda_qblock qblock, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                              int64_t window, const bf16 *q, const bf16 *k, const bf16 *v, bf16 *out, float *lse,
                              cudaStream_t stream)
{
    const int w = mt_attention_window(window, T);
    switch (D) {
    case 32: forward<32>(qblock, B, T, H, KV, q, k, v, out, lse, w, stream); break;
    case 64: forward<64>(qblock, B, T, H, KV, q, k, v, out, lse, w, stream); break;
    case 96: forward<96>(qblock, B, T, H, KV, q, k, v, out, lse, w, stream); break;
    default: forward<128>(qblock, B, T, H, KV, q, k, v, out, lse, w, stream); break;
    }
}
