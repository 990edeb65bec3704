// The building blocks of the own flash-attention kernels (attention_forward.cu,
// attention_backward.cu): tiles of 64 rows in shared memory, mma.sync m16n8k16 (bf16 in, fp32
// accumulate) fed by ldmatrix, global -> shared copies with cp.async (double buffered by the
// kernels, so the next tile streams in while the current one is multiplied). Every grid of the
// kernels launches its longest blocks first (the block index in the slowest grid dimension): the
// causal blocks' lengths grow with their position, and short blocks launched between the long
// ones leave SMs idle in the grid's tail. Internal to backends/cuda; everything here is inline
// device code or a compile-time constant.
#ifndef MT_BACKENDS_CUDA_ATTENTION_TILES_CUH
#define MT_BACKENDS_CUDA_ATTENTION_TILES_CUH

#include <stdint.h>

#include "backends/cuda/common.cuh"

namespace mt_attention {

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

// One step of the key/value pipeline of a query block's loop over key blocks jmax .. jlo, where
// step it works on block j = jmax - it held in buffer buf = it & 1 of k_tiles and v_tiles (two
// tiles each, block jmax's copies issued before the loop): streams block j - 1 into the other
// buffer, then waits until block j's copies have landed (each thread its own; the caller's
// __syncthreads makes them everyone's). jlo > 0: a sliding window's first block.
template <int D, int NT>
__device__ __forceinline__ void kv_pipeline_step(bf16 *k_tiles, bf16 *v_tiles, const bf16 *kg, const bf16 *vg,
                                                 int64_t row_stride, int j, int buf, int T, int jlo = 0)
{
    constexpr int TE = Tile<D>::ELEMS;
    if (j > jlo) {
        load_rows<D, BLOCK, NT>(k_tiles + (buf ^ 1) * TE, kg, row_stride, (j - 1) * BLOCK, T);
        load_rows<D, BLOCK, NT>(v_tiles + (buf ^ 1) * TE, vg, row_stride, (j - 1) * BLOCK, T);
        cp_async_commit();
        cp_async_wait<1>();
    } else {
        cp_async_wait<0>();
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

} // namespace mt_attention

#endif
