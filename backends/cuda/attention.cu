// attention: causal grouped-query attention on tensor cores, FlashAttention-2 style. The T x T
// score matrix only ever exists as tiles of 64 keys in registers; forward keeps a running max and
// sum per query row (online softmax) and saves the log-sum-exp for backward, which recomputes
// the probabilities. Backward is deterministic (no float atomics): one kernel owns a key block
// and writes dK, dV once; a second owns a query block and writes dQ once.
//
// Tiles: 64 keys per step; matrix products use mma.sync m16n8k16 (bf16 in, fp32 accumulate) fed
// by ldmatrix from shared memory; global -> shared copies are cp.async, double buffered, so the
// next tile streams in while the current one is multiplied. Every grid launches its longest
// blocks first (the block index in the slowest grid dimension): the causal blocks' lengths vary
// 32x at T = 2048, and launched shortest-interleaved the dK/dV pass left SMs idle ~30% of its
// time in its tail (Nsight Compute, docs/gpu-logs/19-ncu_attention.log).
//
// Query-block forms (MT_ATTENTION_QBLOCK, attention_qblock()): the forward runs 128-row blocks of
// 4 warps x 32 rows by default ("128w": each K/V fragment a warp reads feeds four MMAs); "64" is
// 4 warps x 16 rows, "128" 8 warps x 16 rows (also for dQ). On an H200 at B=8 T=2048 H=16 KV=2
// D=128 the forward ran 0.744 / 0.707 / 0.517 ms in those three forms, the backward 1.92 ms
// (docs/benchmarks.md). The dK/dV kernel keeps 16 keys per warp (32 would need 256 accumulator
// registers). Not done yet (the next steps for speed): more warps per scheduler (all three
// kernels run 2 and stall on fixed-latency dependencies); Hopper wgmma/TMA instead of mma.sync;
// a dQ pass that does not recompute S and dP (the backward does 7 tile products where FA2 with
// atomics does 5); staging outputs through shared memory for 16-byte stores.
//
// cuDNN (MT_ATTENTION=auto, the default, or cudnn; MT_ATTENTION=own runs these kernels always):
// the two entry points below first try cuDNN 9's fused flash attention (attention_cudnn.cu:
// libcudnn.so.9 loaded with dlopen, head dims 64 and 128), and on any failure print one line on
// stderr per direction and run these kernels. On the H200 with cuDNN 9.14, B=8 T=2048 H=16 KV=2
// D=128, cuDNN's forward took 0.259 ms and its backward 1.004 ms, these kernels about 0.52 and
// 1.92 ms, PyTorch's flash 0.31-0.40 and 1.24 ms (docs/benchmarks.md, tenth session). Its
// backward is not bitwise reproducible (float atomics on dQ): MT_ATTENTION=own for runs that must
// be. The workspace size covers both paths whenever cuDNN headers were found at build time.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>

#include "backends/cuda/attention_cudnn.h"
#include "backends/cuda/common.cuh"

namespace {

constexpr int BLOCK = 64;         // rows of every tile: query block = key block, so only the
                                  // diagonal block needs the causal mask
constexpr int WARPS = 4;          // each warp owns 16 rows of a 64-row tile
constexpr int THREADS = WARPS * 32;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

// A 64 x D bf16 tile in shared memory, rows padded by 8 elements (16 bytes): the row stride is
// then an odd multiple of 16 bytes, so the 8 row addresses of one ldmatrix 8x8 matrix fall in 8
// different 16-byte bank groups (no bank conflicts) and rows stay 16-byte aligned for cp.async.
template <int D>
struct Tile {
    static constexpr int LD = D + 8;           // row stride in elements
    static constexpr int ELEMS = BLOCK * LD;   // elements per tile
};

// ---------------------------------------------------------------- PTX wrappers

// 16-byte asynchronous copy global -> shared; valid false writes 16 zero bytes (the source is
// not read), which is how tile rows past T become zeros.
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, bool valid)
{
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// Four 8x8 bf16 matrices; lane l gives the address of row l%8 of matrix l/8; register i holds
// matrix i, this lane's row lane/4, columns 2*(lane%4) and +1 (.trans: the transposed matrix).
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const bf16 *p)
{
    unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s)
                 : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const bf16 *p)
{
    unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s)
                 : "memory");
}

// c (16x8 fp32) += a (16x16 bf16, row) * b (16x8 bf16, col). Fragment layout, g = lane/4,
// q = lane%4: a = {(g, 2q..2q+1), (g+8, 2q..), (g, 2q+8..), (g+8, 2q+8..)}; b = {(k 2q..2q+1,
// n g), (k 2q+8.., n g)}; c = {(g, 2q), (g, 2q+1), (g+8, 2q), (g+8, 2q+1)}.
__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x in one MUFU instruction, subnormal results flushed to zero (exp2f also handles subnormal
// results, which costs extra instructions per element; a probability under 2^-126 adds nothing to
// a bf16 product). exp2(-inf) = 0, which the causal mask relies on.
__device__ __forceinline__ float fast_exp2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Two floats -> one register of two bf16 (lo in the low half, as the fragments expect).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

// ---------------------------------------------------------------- fragment loaders
// All take a row-major tile with row stride LD (elements).

// A operand (16x16) = tile[row0 .. row0+15][k0 .. k0+15].
template <int LD>
__device__ __forceinline__ void load_a(uint32_t a[4], const bf16 *tile, int row0, int k0)
{
    int lane = threadIdx.x & 31;
    ldmatrix_x4(a, tile + (row0 + (lane & 15)) * LD + k0 + (lane >> 4) * 8);
}

// B operands of two 8-wide n tiles where B[k][n] = tile[n][k] (a product with a transposed
// operand, e.g. K in Q K^T): b[0..1] for n0 .. n0+7, b[2..3] for n0+8 .. n0+15; k0 .. k0+15.
template <int LD>
__device__ __forceinline__ void load_b_rows(uint32_t b[4], const bf16 *tile, int n0, int k0)
{
    int lane = threadIdx.x & 31, m = lane >> 3, r = lane & 7;
    ldmatrix_x4(b, tile + (n0 + (m >> 1) * 8 + r) * LD + k0 + (m & 1) * 8);
}

// B operands where B[k][n] = tile[k][n] (a plain product, e.g. V in P V): transposing ldmatrix.
template <int LD>
__device__ __forceinline__ void load_b_cols(uint32_t b[4], const bf16 *tile, int k0, int n0)
{
    int lane = threadIdx.x & 31, m = lane >> 3, r = lane & 7;
    ldmatrix_x4_trans(b, tile + (k0 + (m & 1) * 8 + r) * LD + n0 + (m >> 1) * 8);
}

// The A operand for k step kk (columns 16kk .. 16kk+15) taken from a 16x64 fp32 accumulator
// s[8][4]: the accumulator layout of n tiles 2kk and 2kk+1 is exactly the A fragment layout.
__device__ __forceinline__ void acc_to_a(uint32_t a[4], const float s[8][4], int kk)
{
    a[0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
    a[1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
    a[2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    a[3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// ---------------------------------------------------------------- tile loads

// Asynchronously copies rows t0 .. t0+ROWS-1 of a (T, ., D) tensor into a tile, with NT threads;
// g points at row 0 of this (batch, head), rows are row_stride elements apart; rows >= T become
// zeros.
template <int D, int ROWS, int NT>
__device__ __forceinline__ void load_rows(bf16 *tile, const bf16 *g, int64_t row_stride, int t0, int T)
{
    constexpr int CHUNKS = D / 8; // 16-byte chunks per row
    for (int c = threadIdx.x; c < ROWS * CHUNKS; c += NT) {
        int r = c / CHUNKS, ch = c % CHUNKS, t = t0 + r;
        bool valid = t < T;
        const bf16 *src = valid ? g + (int64_t)t * row_stride + ch * 8 : g;
        cp_async16(tile + r * Tile<D>::LD + ch * 8, src, valid);
    }
}

// A 64-row tile, by the THREADS threads of a backward CTA.
template <int D>
__device__ __forceinline__ void load_tile(bf16 *tile, const bf16 *g, int64_t row_stride, int t0, int T)
{
    load_rows<D, BLOCK, THREADS>(tile, g, row_stride, t0, T);
}

// s[8][4] (16 rows x 64 columns, this warp's rows) = A rows row0.. of `a_tile` times the rows
// of `b_tile` transposed, over D: S = A B^T, e.g. Q K^T.
template <int D>
__device__ __forceinline__ void gemm_abt(float s[8][4], const bf16 *a_tile, int row0, const bf16 *b_tile)
{
    constexpr int LD = Tile<D>::LD;
#pragma unroll
    for (int i = 0; i < 8; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) s[i][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        uint32_t a[4];
        load_a<LD>(a, a_tile, row0, kk * 16);
#pragma unroll
        for (int nn = 0; nn < 4; nn++) {
            uint32_t b[4];
            load_b_rows<LD>(b, b_tile, nn * 16, kk * 16);
            mma_bf16(s[2 * nn], a, b[0], b[1]);
            mma_bf16(s[2 * nn + 1], a, b[2], b[3]);
        }
    }
}

// acc[D/8][4] (16 x D) += p (16 x 64, fp32 accumulator rounded to bf16) times tile (64 x D).
template <int D>
__device__ __forceinline__ void gemm_acc_pv(float acc[D / 8][4], const float p[8][4], const bf16 *tile)
{
    constexpr int LD = Tile<D>::LD;
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        uint32_t a[4];
        acc_to_a(a, p, kk);
#pragma unroll
        for (int dn = 0; dn < D / 16; dn++) {
            uint32_t b[4];
            load_b_cols<LD>(b, tile, kk * 16, dn * 16);
            mma_bf16(acc[2 * dn], a, b[0], b[1]);
            mma_bf16(acc[2 * dn + 1], a, b[2], b[3]);
        }
    }
}

// ---------------------------------------------------------------- forward

// One CTA per (query block of 16 QW RPW rows, head, batch), QW warps of 16 RPW query rows each;
// key blocks of 64. Key blocks are visited from the last one the block's rows reach down to 0,
// so each warp's first block is the one holding its diagonal: every row then has a finite
// running max from the start (a warp's 16 RPW rows, RPW <= 2, never straddle a key block). A
// warp skips the blocks entirely after its rows (QW RPW > 4: the top of the diagonal) but still
// loads and synchronises with the CTA.
// Forms: QW = 4, RPW = 1 (64-row query blocks, the only form until 2026-11-29); QW = 8, RPW = 1
// (128 rows, 8 warps: each K/V tile in shared memory feeds twice the rows, but each warp still
// reads one K/V fragment per two MMAs); QW = 4, RPW = 2 (128 rows, 4 warps of 32 rows: each
// K/V fragment a warp reads from shared memory feeds four MMAs, as FlashAttention-2's forward
// does; Q is read from shared memory per k step instead of held in registers, which would not
// fit next to the two 16-row output accumulators).
template <int D, int QW, int RPW>
__global__ void __launch_bounds__(QW * 32) attention_forward_kernel(int T, int H, int KV, const bf16 *__restrict__ q,
                                                                    const bf16 *__restrict__ k,
                                                                    const bf16 *__restrict__ v, bf16 *__restrict__ out,
                                                                    float *__restrict__ lse, float scale_log2)
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

    for (int it = 0; it <= jmax; it++) {
        const int j = jmax - it, buf = it & 1, k0 = j * BLOCK;
        if (j > 0) { // prefetch the next key block into the other buffer
            load_rows<D, BLOCK, NT>(k_tiles + (buf ^ 1) * TE, kg, (int64_t)KV * D, (j - 1) * BLOCK, T);
            load_rows<D, BLOCK, NT>(v_tiles + (buf ^ 1) * TE, vg, (int64_t)KV * D, (j - 1) * BLOCK, T);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const bf16 *kt = k_tiles + buf * TE, *vt = v_tiles + buf * TE;
        if constexpr (Q_IN_REGS) {
            if (it == 0) {
#pragma unroll
                for (int kk = 0; kk < D / 16; kk++) load_a<LD>(qf[kk], q_tile, warp * 16, kk * 16);
            }
        }
        if (k0 > wrow0 + WR - 1) { // every key of this block is after every row of this warp
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
            const int rrow0 = wrow0 + 16 * r;           // this row tile's first row
            const bool masked = k0 + BLOCK - 1 > rrow0; // some key after some row: the causal mask
            // causal mask, on the unscaled scores
            if (masked) {
#pragma unroll
                for (int nt = 0; nt < 8; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        int qrow = rrow0 + g + 8 * (e >> 1), kcol = k0 + 8 * nt + 2 * quad + (e & 1);
                        if (kcol > qrow) s[r][nt][e] = -INFINITY;
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

// ---------------------------------------------------------------- backward

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
    float *__restrict__ dv, float scale_log2, float scale)
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
    // (with key blocks fastest, ~30% of the SM time idled in the tail of the launch).
    const int kblock = blockIdx.z, kvh = blockIdx.x, b = blockIdx.y;
    const int group = H / KV, nblocks = (T + BLOCK - 1) / BLOCK, nq = nblocks - kblock;
    const int total = group * nq; // (query head, query block) steps, in a fixed order
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, quad = lane & 3;
    const int n0 = kblock * BLOCK;

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

        // P^T (16 keys x 64 queries), from S^T = K Q^T
        float p[8][4];
        gemm_abt<D>(p, k_tile, warp * 16, qt);
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int krow = warp * 16 + g + 8 * (e >> 1), qcol = 8 * nt + 2 * quad + (e & 1);
                const float pe = fast_exp2(fmaf(p[nt][e], scale_log2, -lse_b[qcol]));
                p[nt][e] = diagonal && krow > qcol ? 0.f : pe; // select: a masked exp2 may be inf
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
template <int D, int QW>
__global__ void __launch_bounds__(QW * 32) attention_backward_dq_kernel(
    int T, int H, int KV, const bf16 *__restrict__ q, const bf16 *__restrict__ k, const bf16 *__restrict__ v,
    const bf16 *__restrict__ dout, const float *__restrict__ lse, const float *__restrict__ delta, float *__restrict__ dq,
    float scale_log2, float scale)
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
        row_delta[half] = t < T ? delta[row] : 0.f;
    }
    float dq_acc[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) dq_acc[i][e] = 0.f;

    for (int it = 0; it <= jmax; it++) {
        const int j = jmax - it, buf = it & 1, k0 = j * BLOCK;
        if (j > 0) {
            load_rows<D, BLOCK, NT>(k_tiles + (buf ^ 1) * TE, kg, (int64_t)KV * D, (j - 1) * BLOCK, T);
            load_rows<D, BLOCK, NT>(v_tiles + (buf ^ 1) * TE, vg, (int64_t)KV * D, (j - 1) * BLOCK, T);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (k0 > wrow0 + 15) { // every key of this block is after every row of this warp
            __syncthreads();
            continue;
        }
        const bool masked = k0 + BLOCK - 1 > wrow0;
        const bf16 *kt = k_tiles + buf * TE, *vt = v_tiles + buf * TE;

        float p[8][4]; // P (16 queries x 64 keys)
        gemm_abt<D>(p, q_tile, warp * 16, kt);
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int qrow = wrow0 + g + 8 * (e >> 1), kcol = k0 + 8 * nt + 2 * quad + (e & 1);
                const float pe = fast_exp2(fmaf(p[nt][e], scale_log2, -row_lse[e >> 1]));
                p[nt][e] = masked && kcol > qrow ? 0.f : pe;
            }

        float ds[8][4]; // dP = dO V^T, then dS = P (dP - Delta)
        gemm_abt<D>(ds, do_tile, warp * 16, vt);
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) ds[nt][e] = p[nt][e] * (ds[nt][e] - row_delta[e >> 1]);

        gemm_acc_pv<D>(dq_acc, ds, kt); // dQ += dS K
        __syncthreads();
    }

#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int t = wrow0 + g + 8 * half;
        if (t >= T) continue;
        float *row = dq + (((int64_t)b * T + t) * H + h) * D;
#pragma unroll
        for (int dt = 0; dt < D / 8; dt++)
            *reinterpret_cast<float2 *>(row + dt * 8 + 2 * quad) =
                make_float2(dq_acc[dt][2 * half] * scale, dq_acc[dt][2 * half + 1] * scale);
    }
}

// ---------------------------------------------------------------- launchers

constexpr size_t tile_bytes(int64_t D) { return (size_t)BLOCK * (size_t)(D + 8) * sizeof(bf16); }

void check_shapes(const char *what, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D, const void *const *ptrs,
                  int nptrs)
{
    if (B < 0 || T < 0 || H <= 0 || KV <= 0 || H % KV != 0 || (D != 32 && D != 64 && D != 96 && D != 128) ||
        T > 65535LL * BLOCK || H > 65535 || KV > 65535 || B > 65535) {
        fprintf(stderr,
                "%s: unsupported shape B=%lld T=%lld H=%lld KV=%lld D=%lld (need H %% KV == 0, head dim "
                "32, 64, 96 or 128, B, H <= 65535, T <= %lld: the grid's z dimension counts 64-row blocks)\n",
                what, (long long)B, (long long)T, (long long)H, (long long)KV, (long long)D, 65535LL * BLOCK);
        abort();
    }
    for (int i = 0; i < nptrs; i++)
        if ((uintptr_t)ptrs[i] % 16 != 0) {
            fprintf(stderr, "%s: tensor %d is not 16-byte aligned (cp.async loads need it)\n", what, i);
            abort();
        }
}

template <int D, int QW, int RPW>
void forward_qw(int64_t B, int64_t T, int64_t H, int64_t KV, const bf16 *q, const bf16 *k, const bf16 *v, bf16 *out,
                float *lse, cudaStream_t stream)
{
    constexpr int QB = 16 * QW * RPW;
    const size_t smem = (size_t)(QB + 4 * BLOCK) * (size_t)(D + 8) * sizeof(bf16);
    CUDA_CHECK(cudaFuncSetAttribute(attention_forward_kernel<D, QW, RPW>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    dim3 grid((unsigned)H, (unsigned)B, (unsigned)((T + QB - 1) / QB));
    const float scale_log2 = (float)(1.0 / sqrt((double)D)) * LOG2E;
    attention_forward_kernel<D, QW, RPW><<<grid, QW * 32, smem, stream>>>((int)T, (int)H, (int)KV, q, k, v, out, lse,
                                                                          scale_log2);
    CUDA_CHECK_LAUNCH();
}

// The forward's and the dQ pass's query blocks, from MT_ATTENTION_QBLOCK (read at each call, so
// a test can run every form): "128w" (the default) 4 warps of 32 rows in the forward, the dQ
// pass as "64"; "64" 4 warps of 16 rows; "128" 8 warps of 16 rows (forward and dQ).
enum qblock_form { QBLOCK_64, QBLOCK_128, QBLOCK_128W };
qblock_form attention_qblock()
{
    const char *env = getenv("MT_ATTENTION_QBLOCK");
    if (env && strcmp(env, "64") == 0) return QBLOCK_64;
    if (env && strcmp(env, "128") == 0) return QBLOCK_128;
    return QBLOCK_128W;
}

template <int D>
void forward(int64_t B, int64_t T, int64_t H, int64_t KV, const bf16 *q, const bf16 *k, const bf16 *v, bf16 *out,
             float *lse, cudaStream_t stream)
{
    switch (attention_qblock()) {
    case QBLOCK_128: forward_qw<D, 8, 1>(B, T, H, KV, q, k, v, out, lse, stream); break;
    case QBLOCK_128W: forward_qw<D, 4, 2>(B, T, H, KV, q, k, v, out, lse, stream); break;
    default: forward_qw<D, 4, 1>(B, T, H, KV, q, k, v, out, lse, stream); break;
    }
}

template <int D, int QW>
void dq_qw(int64_t B, int64_t T, int64_t H, int64_t KV, const bf16 *q, const bf16 *k, const bf16 *v, const bf16 *dout,
           const float *lse, const float *delta, float *dq, float scale_log2, float scale, cudaStream_t stream)
{
    constexpr int QB = 16 * QW;
    const size_t smem = (size_t)(2 * QB + 4 * BLOCK) * (size_t)(D + 8) * sizeof(bf16);
    CUDA_CHECK(cudaFuncSetAttribute(attention_backward_dq_kernel<D, QW>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)smem));
    attention_backward_dq_kernel<D, QW><<<dim3((unsigned)H, (unsigned)B, (unsigned)((T + QB - 1) / QB)), QW * 32, smem,
                                          stream>>>((int)T, (int)H, (int)KV, q, k, v, dout, lse, delta, dq, scale_log2,
                                                    scale);
    CUDA_CHECK_LAUNCH();
}

template <int D>
void backward(int64_t B, int64_t T, int64_t H, int64_t KV, const bf16 *q, const bf16 *k, const bf16 *v,
              const bf16 *out, const float *lse, const bf16 *dout, float *dq, float *dk, float *dv, float *delta,
              cudaStream_t stream)
{
    const float scale = (float)(1.0 / sqrt((double)D)), scale_log2 = scale * LOG2E;
    const int64_t rows = B * T * H;
    const int warps_per_block = 8;
    attention_delta_kernel<<<(unsigned)((rows + warps_per_block - 1) / warps_per_block), warps_per_block * 32, 0,
                             stream>>>(rows, (int)T, (int)H, D, out, dout, delta);
    CUDA_CHECK_LAUNCH();

    const unsigned nblocks = (unsigned)((T + BLOCK - 1) / BLOCK);
    const size_t smem_kv = 6 * tile_bytes(D) + 4 * BLOCK * sizeof(float);
    CUDA_CHECK(cudaFuncSetAttribute(attention_backward_dkdv_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)smem_kv));
    attention_backward_dkdv_kernel<D><<<dim3((unsigned)KV, (unsigned)B, nblocks), THREADS, smem_kv, stream>>>(
        (int)T, (int)H, (int)KV, q, k, v, dout, lse, delta, dk, dv, scale_log2, scale);
    CUDA_CHECK_LAUNCH();

    if (attention_qblock() == QBLOCK_128) dq_qw<D, 8>(B, T, H, KV, q, k, v, dout, lse, delta, dq, scale_log2, scale, stream);
    else dq_qw<D, 4>(B, T, H, KV, q, k, v, dout, lse, delta, dq, scale_log2, scale, stream);
}

// MT_ATTENTION (read at each call, as MT_ATTENTION_QBLOCK): unset, "auto" or "cudnn" try the
// cuDNN path for the shapes it takes (head dims 64 and 128; the others run the own kernels
// silently); "own" runs the own kernels always. Another value is named once on stderr and
// treated as auto.
bool attention_use_cudnn()
{
    const char *env = getenv("MT_ATTENTION");
    if (!env || !*env || strcmp(env, "auto") == 0 || strcmp(env, "cudnn") == 0) return true;
    if (strcmp(env, "own") == 0) return false;
    static std::atomic<bool> said;
    if (!said.exchange(true))
        fprintf(stderr, "megatrain: MT_ATTENTION=%s is not one of auto, cudnn, own; using auto\n", env);
    return true;
}

// Whether the entry points try cuDNN for this shape first.
bool cudnn_first(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D)
{
    return attention_use_cudnn() && mt_cuda_attention_cudnn_supports(B, T, H, KV, D);
}

// The cuDNN path failed: say so once per direction (forward, backward), then the own kernel runs.
void cudnn_fallback_note(bool forward, const char *why)
{
    static std::atomic<bool> said[2];
    if (!said[forward ? 0 : 1].exchange(true))
        fprintf(stderr, "megatrain: cuDNN attention unavailable (%s: %s), using the own kernel\n",
                forward ? "forward" : "backward", why);
}

} // namespace

extern "C" int mt_cuda_attention_reproducible(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D)
{
    return !(cudnn_first(B, T, H, KV, D) && mt_cuda_attention_cudnn_backward_takes_T(T));
}

extern "C" void mt_cuda_attention_forward(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                                          const mt_cuda_bf16 *q, const mt_cuda_bf16 *k, const mt_cuda_bf16 *v,
                                          mt_cuda_bf16 *out, float *lse, mt_cuda_stream stream)
{
    const void *ptrs[] = {q, k, v, out};
    check_shapes("mt_cuda_attention_forward", B, T, H, KV, D, ptrs, 4);
    if (B == 0 || T == 0) return;
    if (cudnn_first(B, T, H, KV, D)) {
        char why[384];
        if (mt_cuda_attention_cudnn_forward(B, T, H, KV, D, q, k, v, out, lse, stream, why, sizeof why) == 0) return;
        cudnn_fallback_note(true, why);
    }
    const bf16 *bq = (const bf16 *)q, *bk = (const bf16 *)k, *bv = (const bf16 *)v;
    bf16 *bo = (bf16 *)out;
    cudaStream_t s = (cudaStream_t)stream;
    switch (D) {
    case 32: forward<32>(B, T, H, KV, bq, bk, bv, bo, lse, s); break;
    case 64: forward<64>(B, T, H, KV, bq, bk, bv, bo, lse, s); break;
    case 96: forward<96>(B, T, H, KV, bq, bk, bv, bo, lse, s); break;
    default: forward<128>(B, T, H, KV, bq, bk, bv, bo, lse, s); break;
    }
}

// The own backward needs Delta (B, H, T) fp32; the cuDNN one its bf16 gradients, fp32 accumulators
// and the plan's own workspace (mt_cuda_attention_cudnn_workspace_bytes: 0 for shapes it does not
// take, and when built without cudnn.h). The larger of the two, whatever MT_ATTENTION says: the
// memory plan sizes this without a GPU and the variable is read at each call.
extern "C" size_t mt_cuda_attention_workspace_bytes(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D)
{
    const size_t own = (size_t)(B * H * T) * sizeof(float);
    const size_t cudnn = mt_cuda_attention_cudnn_workspace_bytes(B, T, H, KV, D);
    return own > cudnn ? own : cudnn;
}

extern "C" void mt_cuda_attention_backward(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                                           const mt_cuda_bf16 *q, const mt_cuda_bf16 *k, const mt_cuda_bf16 *v,
                                           const mt_cuda_bf16 *out, const float *lse, const mt_cuda_bf16 *dout,
                                           float *dq, float *dk, float *dv, void *workspace, mt_cuda_stream stream)
{
    const void *ptrs[] = {q, k, v, out, dout, dq, dk, dv};
    check_shapes("mt_cuda_attention_backward", B, T, H, KV, D, ptrs, 8);
    if (B == 0 || T == 0) return;
    if (cudnn_first(B, T, H, KV, D)) {
        char why[384];
        if (mt_cuda_attention_cudnn_backward(B, T, H, KV, D, q, k, v, out, lse, dout, dq, dk, dv, workspace,
                                             mt_cuda_attention_workspace_bytes(B, T, H, KV, D), stream, why,
                                             sizeof why) == 0)
            return;
        cudnn_fallback_note(false, why);
    }
    const bf16 *bq = (const bf16 *)q, *bk = (const bf16 *)k, *bv = (const bf16 *)v;
    const bf16 *bo = (const bf16 *)out, *bdo = (const bf16 *)dout;
    float *delta = (float *)workspace;
    cudaStream_t s = (cudaStream_t)stream;
    switch (D) {
    case 32: backward<32>(B, T, H, KV, bq, bk, bv, bo, lse, bdo, dq, dk, dv, delta, s); break;
    case 64: backward<64>(B, T, H, KV, bq, bk, bv, bo, lse, bdo, dq, dk, dv, delta, s); break;
    case 96: backward<96>(B, T, H, KV, bq, bk, bv, bo, lse, bdo, dq, dk, dv, delta, s); break;
    default: backward<128>(B, T, H, KV, bq, bk, bv, bo, lse, bdo, dq, dk, dv, delta, s); break;
    }
}
