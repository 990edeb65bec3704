/* AdamW on one chunk of one tile, on a CPU worker: fp32 master and moments updated in place,
 * the streamed copy rewritten for the next forward. With clipping, the global-norm task's
 * scale multiplies the gradient first. Also split in two (adamw_params, then adamw_moments) for
 * the graph to put only the first on the critical path (step.c). */
#include "codelets/codelets.h"

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The streamed copy of master[o, o+len), in the compute precision. */
static void write_streamed(int64_t len, const float *master, void *w, mt_dtype dtype)
{
    if (dtype == MT_DTYPE_BF16) mt_f32_to_bf16(len, master, (mt_bf16 *)w);
    else memcpy(w, master, (size_t)len * sizeof(float));
}

/* Block by block, so the streamed copy is written from master while it is still in cache:
 * AdamW is bound by memory traffic, and a second pass would re-read all of master. */
enum { BLOCK = 4096 };

/* The fused update (fused: master, m and v in place, then the streamed copy, block by block) or
 * the first half of a split one (mt_codelet_adamw_params_range over the chunk: master, m and v
 * read). The two take the same buffers and arguments, unpacked by the caller. */
static void adamw_streamed(void *buffers[], mt_adamw_params p, mt_dtype dtype, int clipped, bool fused)
{
    int64_t n = (int64_t)STARPU_VECTOR_GET_NX(buffers[0]);
    float *master = (float *)STARPU_VECTOR_GET_PTR(buffers[0]);
    if (clipped) {
        double scale = ((const double *)STARPU_VECTOR_GET_PTR(buffers[5]))[1];
        /* the kernel multiplies by (float)(grad_scale * scale): 1.0f is the speculative run's */
        if (clipped == MT_ADAMW_CONFIRM && (float)(p.grad_scale * scale) == 1.0f) return;
        p.grad_scale *= scale;
    }
    const float *grad = (const float *)STARPU_VECTOR_GET_PTR(buffers[3]);
    float *m = (float *)STARPU_VECTOR_GET_PTR(buffers[1]), *v = (float *)STARPU_VECTOR_GET_PTR(buffers[2]);
    char *w = (char *)STARPU_VECTOR_GET_PTR(buffers[4]);
    if (!fused) {
        mt_codelet_adamw_params_range(0, n, master, grad, m, v, w, dtype, &p);
        return;
    }
    const size_t wsz = dtype == MT_DTYPE_BF16 ? sizeof(mt_bf16) : sizeof(float);
    for (int64_t o = 0; o < n; o += BLOCK) {
        int64_t len = n - o < BLOCK ? n - o : BLOCK;
        mt_cpu_adamw_f32(len, master + o, grad + o, m + o, v + o, &p);
        write_streamed(len, master + o, w + (size_t)o * wsz, dtype);
    }
}

void mt_codelet_adamw_params_range(int64_t o, int64_t n, const float *master, const float *grad, const float *m,
                                   const float *v, void *weights, mt_dtype dtype, const mt_adamw_params *p)
{
    const size_t wsz = dtype == MT_DTYPE_BF16 ? sizeof(mt_bf16) : sizeof(float);
    float updated[BLOCK];
    for (int64_t e = o; e < o + n; e += BLOCK) {
        int64_t len = o + n - e < BLOCK ? o + n - e : BLOCK;
        mt_cpu_adamw_params_f32(len, master + e, grad + e, m + e, v + e, updated, p);
        write_streamed(len, updated, (char *)weights + (size_t)e * wsz, dtype);
    }
}

/* Ranged speculation. The streamed bf16 weight of an element depends on the clip scale c only
 * through one rounding of the fp32 result to bf16. Over c in [cl, ch] the real-valued update
 * (the fp32 kernel's operations, unrounded, on its fp32 constants) is bounded:
 *   m' = b1 m + (1-b1) g c and v' = b2 v + (1-b2) g^2 c^2 are monotone in c (c > 0), so is
 *   den = sqrt(v') / sqrt(bc2) + eps > 0, and q = m' / den lies within the quotients of the
 *   box's corners; the weight is p decay - (lr / bc1) q.
 * The kernel's own rounding and that of evaluating these bounds in float (a few dozen operations,
 * each within 2^-24 of the magnitudes involved) are covered by a margin of 2^-16 of those
 * magnitudes. When both ends of the widened interval round to the same bf16 value, so does the
 * kernel's result for every c in the range (the rounding is monotone). Written branch-free
 * (min/max as comparisons: fminf's NaN rules kept GCC from vectorising it, 15 ns an element
 * against 3.7 vectorised on the development machine). */
typedef struct ranged_consts {
    float b1, one_b1, b2, one_b2, step_size, sqrt_bc2, eps, decay, cl, ch;
} ranged_consts;

static ranged_consts ranged_consts_of(const mt_adamw_params *p)
{
    const double bc1 = 1.0 - pow(p->beta1, (double)p->step), bc2 = 1.0 - pow(p->beta2, (double)p->step);
    /* the float values the kernel computes with (backends/cpu/adamw.inc, adamw_consts_of) */
    return (ranged_consts){
        .b1 = (float)p->beta1, .one_b1 = (float)(1.0 - p->beta1), .b2 = (float)p->beta2,
        .one_b2 = (float)(1.0 - p->beta2), .step_size = (float)(p->lr / bc1), .sqrt_bc2 = (float)sqrt(bc2),
        .eps = (float)p->eps, .decay = (float)(1.0 - p->lr * p->weight_decay),
        .cl = (float)p->grad_scale_lo, .ch = (float)p->grad_scale,
    };
}

static inline float min_f(float a, float b) { return a < b ? a : b; }
static inline float max_f(float a, float b) { return a > b ? a : b; }

/* mt_bf16_from_float's rounding for finite x, inline so that the loop below vectorises. */
static inline uint32_t bf16_bits(float x)
{
    union { float f; uint32_t u; } c = { x };
    return (c.u + 0x7FFFu + ((c.u >> 16) & 1u)) >> 16;
}

/* One loop: out[i], the weights half at the range's top scale, bit for bit the kernel's result
 * there (backends/cpu/adamw.inc: the same operations, in the same order, on the same float
 * constants), and may[i] = 1 when element i's bf16 weight could differ within the range. The top
 * scale's corners of the bounds are the kernel's own moment and denominator; the bottom scale's
 * denominator multiplies by the reciprocal of sqrt_bc2 instead of dividing. Their roundings are
 * inside the margin, as the bounds' evaluation is. On the development machine (one thread) this
 * took 2.23-2.30 s per 1e9 elements, against 2.77-2.87 as the weights half followed by a loop
 * of the bounds alone (tools/adamw_bw). An AVX-512 build of it was 5% faster alone on an H200
 * box's CPU but not inside the step (1.880 and 1.888 s against 1.879 and 1.868 at clip 1,
 * docs/benchmarks.md, ninth session), so it has the AVX2 and baseline builds of the others. */
MT_CPU_CLONES static void ranged_fused(int64_t n, const float *restrict master, const float *restrict grad,
                                       const float *restrict m, const float *restrict v, const ranged_consts *k,
                                       float *restrict out, int32_t *restrict may)
{
    const float b1 = k->b1, ob1 = k->one_b1, b2 = k->b2, ob2 = k->one_b2, ss = k->step_size, sb = k->sqrt_bc2;
    const float eps = k->eps, decay = k->decay, cl = k->cl, ch = k->ch, cl2 = cl * cl, isb = 1.0f / sb;
    for (int64_t i = 0; i < n; i++) {
        /* the kernel at the top scale (adamw_moments_of, adamw_param_of) */
        const float gk = grad[i] * ch;
        const float m2 = b1 * m[i] + ob1 * gk, v2 = b2 * v[i] + ob2 * gk * gk;
        const float d2 = sqrtf(v2) / sb + eps;
        const float pd = master[i] * decay;
        out[i] = pd - ss * (m2 / d2);
        /* the bottom scale, and the bounds over the box of the two moments and denominators */
        const float g = grad[i], bm = b1 * m[i], t = ob1 * g;
        const float m1 = bm + t * cl, mn = min_f(m1, m2), mx = max_f(m1, m2);
        const float d1 = sqrtf(b2 * v[i] + ob2 * g * g * cl2) * isb + eps;
        const float r1 = 1.0f / d1, r2 = 1.0f / d2;
        const float q_lo = min_f(mn * r1, mn * r2), q_hi = max_f(mx * r1, mx * r2);
        const float mag = fabsf(pd) + ss * (max_f(fabsf(q_lo), fabsf(q_hi)) + (fabsf(bm) + fabsf(t * ch)) * r1);
        const float margin = mag * 0x1p-16f + 1e-37f;
        const float lo = pd - ss * q_hi - margin, hi = pd - ss * q_lo + margin;
        const int finite = (fabsf(lo) <= FLT_MAX) & (fabsf(hi) <= FLT_MAX);
        may[i] = 1 ^ (finite & (bf16_bits(lo) == bf16_bits(hi)));
    }
}

/* ranged_fused in AVX2 intrinsics, with fewer instructions an element: the pass is bound by
 * them, not by memory (18 bytes an element; on an H200 box's CPU it ran at 3.4 ns an element
 * per worker inside the step, and the fused update, 30 bytes, at 3.1 alone). The changes:
 * - no kernel: the weight an unflagged element streams is the bf16 value both ends of its bounds
 *   round to, which is the kernel's at every scale in the range (that is what unflagged means),
 *   so the kernel's two divisions and square root at the top scale are not needed; a flagged
 *   element's weight is the redo's to write (adamw_confirm_ranged redoes every flagged element,
 *   or the whole chunk). The weights are written as bf16 straight from same_bf16, with no fp32
 *   block and no conversion loop. Both ends of the range are now corners from approximate
 *   reciprocals (recip_den), as the bottom one was before;
 * - those reciprocals and square roots come from the approximate instructions (rsqrtps,
 *   rcpps: within 1.5 x 2^-12 relative, per Intel's and AMD's manuals) and one Newton step each,
 *   which leaves them within about 5 x 2^-24 (the step squares the error), instead of divider
 *   instructions. Why the margin still covers this: every corner of the bounds is a moment times
 *   one of these reciprocals, so their errors move each corner by at most ~2^-21 of the largest
 *   corner, which mag bounds; the kernel's own result at a scale (its roundings, and its moment
 *   against the corner's fused multiply-add) differs from the exact value by at most a few 2^-24
 *   of the same magnitudes; the few dozen roundings of the bounds' evaluation take at most ~2^-18;
 *   so 2^-16 covers all three. A square below FLT_MIN, which rsqrtps takes as zero, has its root
 *   taken as 0: the denominator is then at most 2^-63 / sqrt_bc2 low, within the same accounting
 *   when eps > 0 (at eps = 0 the reciprocal comes out infinite or NaN, which flags); infinite
 *   inputs give NaN bounds, which flag;
 * - the bf16 comparison of lo and hi is same_bf16's, 7 instructions instead of 11, and their
 *   finiteness one subtraction and one comparison instead of 5 instructions;
 * - the margin's magnitude is |pd| + 2 ss side r1: every corner is a moment no larger than side =
 *   |b1 m| + |(1-b1) g ch| (to a rounding) times r1 or r2 <= r1 (to the reciprocals' error);
 * - the flags come out as bytes (movemask) that or_bytes ORs into the bitmap, not as an int per
 *   element.
 * Written with intrinsics because C has no spelling of rcpps short of -ffast-math. On the
 * development machine (Zen 4, one thread, 0.5M elements: tools/adamw_bw --params 500000
 * --threads 1) the pass took 1.59-1.69 ns an element with the kernel at the top scale and a
 * separate conversion, 1.41-1.44 without; ranged_fused's (exact bounds) 2.25-2.39.
 * tests/test_ops.c's test_ranged_flags_sound checks every kind of bounds; it fails with the
 * margin set to 0 or the Newton steps removed. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define MT_RANGED_APPROX 1

__attribute__((target("avx2,fma"))) static inline __m256 rcp_newton(__m256 d)
{
    const __m256 r = _mm256_rcp_ps(d);
    return _mm256_fmadd_ps(r, _mm256_fnmadd_ps(d, r, _mm256_set1_ps(1.0f)), r);
}

/* All-ones where finite lo and hi round to the same bf16 value, for sure, and that value in the
 * low 16 bits of *bf16 there: the rounding of bit pattern u is (u + 0x7FFF + odd) >> 16, odd
 * being 0 or 1, and is monotone in u among values of one sign; so when the smaller pattern
 * rounded down and the larger rounded up agree, every value between rounds to it, ties included
 * (a sign change never agrees). */
__attribute__((target("avx2,fma"))) static inline __m256i same_bf16(__m256 lo, __m256 hi, __m256i *bf16)
{
    const __m256i a = _mm256_castps_si256(lo), b = _mm256_castps_si256(hi);
    const __m256i down = _mm256_srli_epi32(_mm256_add_epi32(_mm256_min_epu32(a, b), _mm256_set1_epi32(0x7FFF)), 16);
    const __m256i up = _mm256_srli_epi32(_mm256_add_epi32(_mm256_max_epu32(a, b), _mm256_set1_epi32(0x8000)), 16);
    *bf16 = down;
    return _mm256_cmpeq_epi32(down, up);
}

/* The tail of a vector loop (n < 16 elements): ranged_fused, its weights rounded to bf16, its
 * flags as bytes (bit j of byte j / 8 for element j). */
static void ranged_tail_bf16(int64_t n, const float *master, const float *grad, const float *m, const float *v,
                             const ranged_consts *k, mt_bf16 *w, uint8_t *flagb)
{
    float out[16];
    int32_t may[16];
    ranged_fused(n, master, grad, m, v, k, out, may);
    mt_f32_to_bf16(n, out, w);
    for (int64_t j = 0; j < n; j += 8) flagb[j / 8] = 0;
    for (int64_t j = 0; j < n; j++) flagb[j / 8] |= (uint8_t)((may[j] & 1) << (j % 8));
}

/* sqrt(x) from rsqrtps and one Newton step (0 where x < FLT_MIN), then 1 / (that / sqrt_bc2 +
 * eps) from rcpps and one Newton step: a corner's reciprocal denominator. */
__attribute__((target("avx2,fma"))) static inline __m256 recip_den(__m256 x, __m256 isb, __m256 eps)
{
    const __m256 y = _mm256_rsqrt_ps(x);
    const __m256 s0 = _mm256_mul_ps(x, y);
    __m256 s1 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), y), _mm256_fnmadd_ps(s0, s0, x), s0);
    s1 = _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(FLT_MIN), _CMP_LT_OQ), s1);
    return rcp_newton(_mm256_fmadd_ps(s1, isb, eps));
}

/* The ranged pass's constants in 8 lanes. */
typedef struct ranged_v8 {
    __m256 b1, ob1, b2, ob2, ss, eps, decay, cl, ch, cl2, ch2, isb, big, rel, floor_, absmask, ss2;
} ranged_v8;

__attribute__((target("avx2,fma"))) static inline ranged_v8 ranged_v8_of(const ranged_consts *k)
{
    return (ranged_v8){
        .b1 = _mm256_set1_ps(k->b1), .ob1 = _mm256_set1_ps(k->one_b1), .b2 = _mm256_set1_ps(k->b2),
        .ob2 = _mm256_set1_ps(k->one_b2), .ss = _mm256_set1_ps(k->step_size), .eps = _mm256_set1_ps(k->eps),
        .decay = _mm256_set1_ps(k->decay), .cl = _mm256_set1_ps(k->cl), .ch = _mm256_set1_ps(k->ch),
        .cl2 = _mm256_set1_ps(k->cl * k->cl), .ch2 = _mm256_set1_ps(k->ch * k->ch),
        .isb = _mm256_set1_ps(1.0f / k->sqrt_bc2), .big = _mm256_set1_ps(FLT_MAX), .rel = _mm256_set1_ps(0x1p-16f),
        .floor_ = _mm256_set1_ps(1e-37f), .absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)),
        .ss2 = _mm256_set1_ps(2.0f * k->step_size),
    };
}

/* ranged_fused_approx's body for 8 elements (master, grad, m, v in lanes): their bf16 weights,
 * packed, in *wb (the unflagged ones' are final) and their flags as a byte. */
__attribute__((target("avx2,fma"))) static inline uint8_t ranged8(const ranged_v8 *c, __m256 master, __m256 g,
                                                                  __m256 mi, __m256 vi, __m128i *wb)
{
    const __m256 pd = _mm256_mul_ps(master, c->decay); /* the kernel's own */
    /* the moments at both ends of the range, and the reciprocal denominators */
    const __m256 bm = _mm256_mul_ps(c->b1, mi), t = _mm256_mul_ps(c->ob1, g);
    const __m256 m1 = _mm256_fmadd_ps(t, c->cl, bm), m2 = _mm256_fmadd_ps(t, c->ch, bm);
    const __m256 mn = _mm256_min_ps(m1, m2), mx = _mm256_max_ps(m1, m2);
    const __m256 bv = _mm256_mul_ps(c->b2, vi), gg = _mm256_mul_ps(_mm256_mul_ps(c->ob2, g), g);
    const __m256 r1 = recip_den(_mm256_fmadd_ps(gg, c->cl2, bv), c->isb, c->eps);
    const __m256 r2 = recip_den(_mm256_fmadd_ps(gg, c->ch2, bv), c->isb, c->eps);
    /* the bounds over the box of the two moments and denominators */
    const __m256 q_lo = _mm256_min_ps(_mm256_mul_ps(mn, r1), _mm256_mul_ps(mn, r2));
    const __m256 q_hi = _mm256_max_ps(_mm256_mul_ps(mx, r1), _mm256_mul_ps(mx, r2));
    const __m256 side = _mm256_add_ps(_mm256_and_ps(bm, c->absmask), _mm256_and_ps(_mm256_mul_ps(t, c->ch), c->absmask));
    const __m256 mag = _mm256_fmadd_ps(c->ss2, _mm256_mul_ps(side, r1), _mm256_and_ps(pd, c->absmask));
    const __m256 margin = _mm256_fmadd_ps(mag, c->rel, c->floor_);
    const __m256 lo = _mm256_sub_ps(_mm256_fnmadd_ps(c->ss, q_hi, pd), margin);
    const __m256 hi = _mm256_add_ps(_mm256_fnmadd_ps(c->ss, q_lo, pd), margin);
    /* lo and hi finite: hi - lo is then finite or (a span past FLT_MAX) flags anyway; a NaN
     * or an infinite end makes it NaN or infinite */
    const __m256 finite = _mm256_cmp_ps(_mm256_sub_ps(hi, lo), c->big, _CMP_LE_OQ);
    __m256i down;
    const __m256i same = _mm256_and_si256(same_bf16(lo, hi, &down), _mm256_castps_si256(finite));
    *wb = _mm_packus_epi32(_mm256_castsi256_si128(down), _mm256_extracti128_si256(down, 1));
    return (uint8_t)~_mm256_movemask_ps(_mm256_castsi256_ps(same));
}

__attribute__((target("avx2,fma"))) static void ranged_fused_approx(int64_t n, const float *restrict master,
                                                                    const float *restrict grad, const float *restrict m,
                                                                    const float *restrict v, const ranged_consts *k,
                                                                    mt_bf16 *restrict w, uint8_t *restrict flagb)
{
    const ranged_v8 c = ranged_v8_of(k);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i wb;
        flagb[i / 8] = ranged8(&c, _mm256_loadu_ps(master + i), _mm256_loadu_ps(grad + i), _mm256_loadu_ps(m + i),
                               _mm256_loadu_ps(v + i), &wb);
        _mm_storeu_si128((__m128i *)(w + i), wb);
    }
    if (i < n) ranged_tail_bf16(n - i, master + i, grad + i, m + i, v + i, k, w + i, flagb + i / 8);
}

/* A deferred update's pass in one loop: per 8 elements, the last step's moments half (master, m
 * and v in place from its gradient `old`: the kernel's operations in its order, no fused
 * multiply-adds, so the same bits as mt_cpu_adamw_f32, which is compiled without contraction),
 * then this step's ranged8 on the new values while they are in registers. The loop it replaces,
 * the moments half over a block and then ranged_fused_approx over it, ran in two phases: one
 * streamed seven arrays with little arithmetic, the other two arrays with much, so memory and the
 * arithmetic units took turns. The tail past the last 8 goes the block way. */
__attribute__((target("avx2,fma"))) static void deferred_fused_approx(int64_t n, float *restrict master,
                                                                      const float *restrict old,
                                                                      const float *restrict grad, float *restrict m,
                                                                      float *restrict v, const ranged_consts *o,
                                                                      const mt_adamw_params *po,
                                                                      const ranged_consts *k, mt_bf16 *restrict w,
                                                                      uint8_t *restrict flagb)
{
    const ranged_v8 c = ranged_v8_of(k);
    const __m256 gs = _mm256_set1_ps(o->ch), odecay = _mm256_set1_ps(o->decay), ob1 = _mm256_set1_ps(o->b1);
    const __m256 oob1 = _mm256_set1_ps(o->one_b1), ob2 = _mm256_set1_ps(o->b2), oob2 = _mm256_set1_ps(o->one_b2);
    const __m256 oss = _mm256_set1_ps(o->step_size), osb = _mm256_set1_ps(o->sqrt_bc2), oeps = _mm256_set1_ps(o->eps);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 g0 = _mm256_mul_ps(_mm256_loadu_ps(old + i), gs);
        const __m256 mi = _mm256_add_ps(_mm256_mul_ps(ob1, _mm256_loadu_ps(m + i)), _mm256_mul_ps(oob1, g0));
        const __m256 vi = _mm256_add_ps(_mm256_mul_ps(ob2, _mm256_loadu_ps(v + i)), _mm256_mul_ps(_mm256_mul_ps(oob2, g0), g0));
        const __m256 den = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), osb), oeps);
        const __m256 p = _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(master + i), odecay),
                                       _mm256_mul_ps(oss, _mm256_div_ps(mi, den)));
        _mm256_storeu_ps(m + i, mi);
        _mm256_storeu_ps(v + i, vi);
        _mm256_storeu_ps(master + i, p);
        __m128i wb;
        flagb[i / 8] = ranged8(&c, p, _mm256_loadu_ps(grad + i), mi, vi, &wb);
        _mm_storeu_si128((__m128i *)(w + i), wb);
    }
    if (i < n) {
        mt_cpu_adamw_f32(n - i, master + i, old + i, m + i, v + i, po);
        ranged_tail_bf16(n - i, master + i, grad + i, m + i, v + i, k, w + i, flagb + i / 8);
    }
}

/* recip_den in 16 lanes, from rsqrt14 and rcp14 (within 2^-14) and the same Newton steps */
__attribute__((target("avx2,fma,avx512f,avx512vl,avx512dq,avx512bw"))) static inline __m512
recip_den512(__m512 x, __m512 isb, __m512 eps)
{
    const __m512 y = _mm512_rsqrt14_ps(x);
    const __m512 s0 = _mm512_mul_ps(x, y);
    const __m512 s1 = _mm512_maskz_fmadd_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(FLT_MIN), _CMP_NLT_UQ),
                                            _mm512_mul_ps(_mm512_set1_ps(0.5f), y), _mm512_fnmadd_ps(s0, s0, x), s0);
    const __m512 e = _mm512_fmadd_ps(s1, isb, eps), r = _mm512_rcp14_ps(e);
    return _mm512_fmadd_ps(r, _mm512_fnmadd_ps(e, r, _mm512_set1_ps(1.0f)), r);
}

/* ranged_fused_approx in 16 lanes with AVX-512's masks, its reciprocal and square-root
 * estimates within 2^-14 (rcp14, rsqrt14) and the same Newton steps, which leave them within
 * about 2^-24; the same operations otherwise, the same margin (MT_RANGED_BOUNDS_AVX512). On the
 * development machine (Zen 4, whose 512-bit operations take two 256-bit halves; one thread,
 * adamw_bw --params 500000 --threads 1) it takes 1.01-1.13 ns an element against the AVX2
 * loop's 1.41-1.44: masks and absolute values are single instructions here, and 32 registers
 * hold the constants that spill from AVX2's 16. The default where the CPU has AVX-512 since the
 * deferred pass runs in one loop (deferred_fused_approx512): in the 3B step at clip 1 on an H200
 * box (Intel), two runs each in one call, the fused pass took 10.9-11.3 CPU-s a step against
 * AVX2's 12.5-13.1, and AdamW in the step 0.347-0.362 s per 1e9 against 0.395-0.409
 * (docs/benchmarks.md, fourteenth session). Before, as a block of the moments half followed by
 * this loop, single runs had it slower than AVX2 (twelfth and thirteenth sessions). The
 * remainder past the last 16 goes to the AVX2 loop, and its own past 8 to ranged_tail_bf16. */
#define MT_AVX512 __attribute__((target("avx2,fma,avx512f,avx512vl,avx512dq,avx512bw")))

/* The ranged pass's constants in 16 lanes. */
typedef struct ranged_v16 {
    __m512 b1, ob1, b2, ob2, ss, eps, decay, cl, ch, cl2, ch2, isb, big, rel, floor_, ss2;
    __m512i r_down, r_up;
} ranged_v16;

MT_AVX512 static inline ranged_v16 ranged_v16_of(const ranged_consts *k)
{
    return (ranged_v16){
        .b1 = _mm512_set1_ps(k->b1), .ob1 = _mm512_set1_ps(k->one_b1), .b2 = _mm512_set1_ps(k->b2),
        .ob2 = _mm512_set1_ps(k->one_b2), .ss = _mm512_set1_ps(k->step_size), .eps = _mm512_set1_ps(k->eps),
        .decay = _mm512_set1_ps(k->decay), .cl = _mm512_set1_ps(k->cl), .ch = _mm512_set1_ps(k->ch),
        .cl2 = _mm512_set1_ps(k->cl * k->cl), .ch2 = _mm512_set1_ps(k->ch * k->ch),
        .isb = _mm512_set1_ps(1.0f / k->sqrt_bc2), .big = _mm512_set1_ps(FLT_MAX), .rel = _mm512_set1_ps(0x1p-16f),
        .floor_ = _mm512_set1_ps(1e-37f), .ss2 = _mm512_set1_ps(2.0f * k->step_size),
        .r_down = _mm512_set1_epi32(0x7FFF), .r_up = _mm512_set1_epi32(0x8000),
    };
}

/* ranged8 in 16 lanes: the bf16 weights in *wb, the flags as 16 bits. */
MT_AVX512 static inline unsigned ranged16(const ranged_v16 *c, __m512 master, __m512 g, __m512 mi, __m512 vi,
                                          __m256i *wb)
{
    const __m512 pd = _mm512_mul_ps(master, c->decay);
    const __m512 bm = _mm512_mul_ps(c->b1, mi), t = _mm512_mul_ps(c->ob1, g);
    const __m512 m1 = _mm512_fmadd_ps(t, c->cl, bm), m2 = _mm512_fmadd_ps(t, c->ch, bm);
    const __m512 mn = _mm512_min_ps(m1, m2), mx = _mm512_max_ps(m1, m2);
    const __m512 bv = _mm512_mul_ps(c->b2, vi), gg = _mm512_mul_ps(_mm512_mul_ps(c->ob2, g), g);
    const __m512 r1 = recip_den512(_mm512_fmadd_ps(gg, c->cl2, bv), c->isb, c->eps);
    const __m512 r2 = recip_den512(_mm512_fmadd_ps(gg, c->ch2, bv), c->isb, c->eps);
    const __m512 q_lo = _mm512_min_ps(_mm512_mul_ps(mn, r1), _mm512_mul_ps(mn, r2));
    const __m512 q_hi = _mm512_max_ps(_mm512_mul_ps(mx, r1), _mm512_mul_ps(mx, r2));
    const __m512 side = _mm512_add_ps(_mm512_abs_ps(bm), _mm512_abs_ps(_mm512_mul_ps(t, c->ch)));
    const __m512 mag = _mm512_fmadd_ps(c->ss2, _mm512_mul_ps(side, r1), _mm512_abs_ps(pd));
    const __m512 margin = _mm512_fmadd_ps(mag, c->rel, c->floor_);
    const __m512 lo = _mm512_sub_ps(_mm512_fnmadd_ps(c->ss, q_hi, pd), margin);
    const __m512 hi = _mm512_add_ps(_mm512_fnmadd_ps(c->ss, q_lo, pd), margin);
    const __mmask16 finite = _mm512_cmp_ps_mask(_mm512_sub_ps(hi, lo), c->big, _CMP_LE_OQ);
    const __m512i a = _mm512_castps_si512(lo), b = _mm512_castps_si512(hi);
    const __m512i down = _mm512_srli_epi32(_mm512_add_epi32(_mm512_min_epu32(a, b), c->r_down), 16);
    const __m512i up = _mm512_srli_epi32(_mm512_add_epi32(_mm512_max_epu32(a, b), c->r_up), 16);
    *wb = _mm512_cvtepi32_epi16(down);
    return (unsigned)(uint16_t)~_mm512_mask_cmpeq_epi32_mask(finite, down, up);
}

MT_AVX512 static void ranged_fused_approx512(int64_t n, const float *restrict master, const float *restrict grad,
                                             const float *restrict m, const float *restrict v, const ranged_consts *k,
                                             mt_bf16 *restrict w, uint8_t *restrict flagb)
{
    const ranged_v16 c = ranged_v16_of(k);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i wb;
        const unsigned flags = ranged16(&c, _mm512_loadu_ps(master + i), _mm512_loadu_ps(grad + i),
                                        _mm512_loadu_ps(m + i), _mm512_loadu_ps(v + i), &wb);
        _mm256_storeu_si256((__m256i *)(w + i), wb);
        flagb[i / 8] = (uint8_t)flags;
        flagb[i / 8 + 1] = (uint8_t)(flags >> 8);
    }
    if (i < n) ranged_fused_approx(n - i, master + i, grad + i, m + i, v + i, k, w + i, flagb + i / 8);
}

/* deferred_fused_approx in 16 lanes (MT_RANGED_BOUNDS_AVX512): the same moments half, then
 * ranged16; the remainder past the last 16 goes to deferred_fused_approx. */
MT_AVX512 static void deferred_fused_approx512(int64_t n, float *restrict master, const float *restrict old,
                                               const float *restrict grad, float *restrict m, float *restrict v,
                                               const ranged_consts *o, const mt_adamw_params *po,
                                               const ranged_consts *k, mt_bf16 *restrict w, uint8_t *restrict flagb)
{
    const ranged_v16 c = ranged_v16_of(k);
    const __m512 gs = _mm512_set1_ps(o->ch), odecay = _mm512_set1_ps(o->decay), ob1 = _mm512_set1_ps(o->b1);
    const __m512 oob1 = _mm512_set1_ps(o->one_b1), ob2 = _mm512_set1_ps(o->b2), oob2 = _mm512_set1_ps(o->one_b2);
    const __m512 oss = _mm512_set1_ps(o->step_size), osb = _mm512_set1_ps(o->sqrt_bc2), oeps = _mm512_set1_ps(o->eps);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 g0 = _mm512_mul_ps(_mm512_loadu_ps(old + i), gs);
        const __m512 mi = _mm512_add_ps(_mm512_mul_ps(ob1, _mm512_loadu_ps(m + i)), _mm512_mul_ps(oob1, g0));
        const __m512 vi = _mm512_add_ps(_mm512_mul_ps(ob2, _mm512_loadu_ps(v + i)), _mm512_mul_ps(_mm512_mul_ps(oob2, g0), g0));
        const __m512 den = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), osb), oeps);
        const __m512 p = _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(master + i), odecay),
                                       _mm512_mul_ps(oss, _mm512_div_ps(mi, den)));
        _mm512_storeu_ps(m + i, mi);
        _mm512_storeu_ps(v + i, vi);
        _mm512_storeu_ps(master + i, p);
        __m256i wb;
        const unsigned flags = ranged16(&c, p, _mm512_loadu_ps(grad + i), mi, vi, &wb);
        _mm256_storeu_si256((__m256i *)(w + i), wb);
        flagb[i / 8] = (uint8_t)flags;
        flagb[i / 8 + 1] = (uint8_t)(flags >> 8);
    }
    if (i < n) deferred_fused_approx(n - i, master + i, old + i, grad + i, m + i, v + i, o, po, k, w + i, flagb + i / 8);
}
#endif

static atomic_int ranged_bounds = MT_RANGED_BOUNDS_DEFAULT; /* mt_codelet_ranged_set_bounds */

void mt_codelet_ranged_set_bounds(mt_ranged_bounds b) { atomic_store(&ranged_bounds, (int)b); }

/* What a ranged pass runs now on this CPU. */
static mt_ranged_bounds bounds_used(void)
{
    const int b = atomic_load_explicit(&ranged_bounds, memory_order_relaxed);
#ifdef MT_RANGED_APPROX
    if (b == MT_RANGED_BOUNDS_EXACT || !__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma"))
        return MT_RANGED_BOUNDS_EXACT;
    if (b == MT_RANGED_BOUNDS_AVX512 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw"))
        return MT_RANGED_BOUNDS_AVX512;
    return MT_RANGED_BOUNDS_AVX2;
#else
    (void)b;
    return MT_RANGED_BOUNDS_EXACT;
#endif
}

mt_ranged_bounds mt_codelet_ranged_bounds_used(void) { return bounds_used(); }

const char *mt_codelet_ranged_bounds_option(mt_ranged_bounds b)
{
    static const char *const names[] = { "avx2", "avx512", "exact" };
    return names[b];
}

const char *mt_codelet_ranged_bounds_name(void)
{
    static const char *const names[] = { "AVX2 approximate-reciprocal", "AVX-512 approximate-reciprocal", "exact" };
    return names[bounds_used()];
}

/* bits |= may[0..n) at bit positions pos.. (may[i] 0 or 1), a 64-bit word at a time; returns
 * how many were set in may. */
MT_CPU_CLONES static int64_t or_bits(int64_t pos, int64_t n, const int32_t *restrict may, uint64_t *restrict bits)
{
    int64_t count = 0;
    for (int64_t i = 0; i < n;) {
        const int64_t b0 = pos % 64, take = 64 - b0 < n - i ? 64 - b0 : n - i;
        uint64_t word = 0;
        for (int64_t k = 0; k < take; k++) word |= (uint64_t)(may[i + k] & 1) << (b0 + k);
        bits[pos / 64] |= word;
        count += __builtin_popcountll(word);
        i += take;
        pos += take;
    }
    return count;
}

#ifdef MT_RANGED_APPROX
/* The bitmap's bytes from byte b on |= flagb[0..nb), eight at a time where aligned; returns how
 * many bits flagb had set. The bits past a chunk's last element are 0 in flagb (the tail's byte
 * is built from its elements only). */
static int64_t or_bytes(int64_t b, int64_t nb, const uint8_t *flagb, uint64_t *bits)
{
    uint8_t *bytes = (uint8_t *)bits;
    int64_t count = 0, j = 0;
    for (; j < nb && (b + j) % 8; j++) {
        bytes[b + j] |= flagb[j];
        count += __builtin_popcount(flagb[j]);
    }
    for (; j + 8 <= nb; j += 8) {
        uint64_t word;
        memcpy(&word, flagb + j, sizeof word);
        if (!word) continue;
        bits[(b + j) / 8] |= word;
        count += __builtin_popcountll(word);
    }
    for (; j < nb; j++) {
        bytes[b + j] |= flagb[j];
        count += __builtin_popcount(flagb[j]);
    }
    return count;
}
#endif

/* A ranged run's flags buffer: the range it used (decided when it ran), the bitmap, then the
 * side entries: the inputs of the first flagged elements, in element order, copied while the
 * ranged pass had them in cache. The redo after the norm then reads those few bytes instead of
 * gathering each flagged element from master, m, v and the gradient (at 2% flagged, the gathers
 * touch a third of their cache lines: on the development machine the redo took 0.9 s per 1e9
 * parameters, 40% of the ranged pass). An entry whose element's gradient changed afterwards
 * (mt_codelet_ranged_flag: the table's touched rows) is marked stale and not used. */
typedef struct ranged_header {
    float cl, ch;          /* the scales (gradient multipliers, as the kernel forms them) checked */
    int16_t skipped;       /* the range was too wide: nothing written, the confirm does all */
    int8_t full;           /* every flagged element got a side entry */
    int8_t stale;          /* mt_codelet_ranged_flag ran: some entries may be stale */
    int32_t nside;         /* side entries written */
    int64_t n;             /* the chunk's elements (24 bytes in all, as tests/test_plan.c counts) */
} ranged_header;

typedef struct side_entry {
    uint32_t idx;          /* the element; SIDE_STALE set: not to be used */
    float master, grad, m, v;
} side_entry;

#define SIDE_STALE 0x80000000u

static int64_t words_of(int64_t n) { return (n + 63) / 64; }
/* Room for 1/16 of the chunk (6.25%) by default: more flagged elements are gathered as before. It was 1/32
 * until the 3B step at clip 1 on real text flagged 5.7-6.0% (the wider ranges of the spread
 * rule, docs/benchmarks.md): half its flagged elements were then gathered, 4 cache misses each.
 * adamw_bw --lr 1e-3 (4.88% flagged), development machine, 2 threads: the redo took 0.247-0.261
 * s per 1e9 parameters with 1/32, 0.157-0.174 with 1/16. 1.25 bytes a parameter, pinned. */
static int side_room_once = 16;
static pthread_once_t side_room_init = PTHREAD_ONCE_INIT;
static void read_side_room(void)
{
    /* MT_RANGED_SIDE_ROOM=R: room for 1/R of the chunk (2..64), to measure other sizes with
     * (docs/benchmarks.md, fifteenth session); read once per process, before the first flags
     * buffer is sized, since a buffer's room must not change after it is allocated. */
    const char *e = getenv("MT_RANGED_SIDE_ROOM");
    if (!e || !*e) return;
    char *end;
    const long r = strtol(e, &end, 10);
    if (*end || r < 2 || r > 64) {
        fprintf(stderr, "megatrain: MT_RANGED_SIDE_ROOM=%s ignored: expected a whole number from 2 to 64 (room for "
                        "1/R of a chunk's elements); using 16\n", e);
        return;
    }
    side_room_once = (int)r;
}
int mt_codelet_ranged_side_room(void)
{
    pthread_once(&side_room_init, read_side_room);
    return side_room_once;
}
static int64_t side_capacity(int64_t n) { return n / mt_codelet_ranged_side_room() + 16; }
static uint64_t *bits_of(const ranged_header *hd) { return (uint64_t *)(hd + 1); }
static side_entry *side_of(const ranged_header *hd) { return (side_entry *)(bits_of(hd) + words_of(hd->n)); }

size_t mt_codelet_ranged_bitmap_bytes(int64_t n)
{
    return sizeof(ranged_header) + (size_t)words_of(n) * sizeof(uint64_t) + (size_t)side_capacity(n) * sizeof(side_entry);
}

const uint64_t *mt_codelet_ranged_bits(const void *flags) { return bits_of((const ranged_header *)flags); }

void mt_codelet_ranged_reset(void *flags, int64_t n)
{
    ranged_header *hd = (ranged_header *)flags;
    *hd = (ranged_header){ .full = 1, .n = n };
    memset(bits_of(hd), 0, (size_t)words_of(n) * sizeof(uint64_t));
}

/* Side entries for the bits set in [e, e + len) (called in element order), while there is room;
 * `flagged` of them: when some get none, the header is no longer full. */
static void side_append(ranged_header *hd, int64_t e, int64_t len, int64_t flagged, const float *master,
                        const float *grad, const float *m, const float *v)
{
    const int64_t cap = side_capacity(hd->n);
    int64_t k = hd->nside;
    if (cap - k < flagged) hd->full = 0;
    if (hd->n <= 0 || k >= cap || len <= 0) return;
    const uint64_t *bits = bits_of(hd);
    side_entry *se = side_of(hd);
    for (int64_t wi = e / 64; wi <= (e + len - 1) / 64 && k < cap; wi++) {
        const int64_t base = wi * 64;
        uint64_t word = bits[wi];
        if (base < e) word &= ~(uint64_t)0 << (e - base);
        if (e + len - base < 64) word &= ((uint64_t)1 << (e + len - base)) - 1;
        for (; word && k < cap; word &= word - 1) {
            const int64_t i = base + __builtin_ctzll(word);
            se[k++] = (side_entry){ (uint32_t)i, master[i], grad[i], m[i], v[i] };
        }
    }
    hd->nside = (int32_t)k;
}

/* Over the process (mt_codelet_ranged_counts). */
static atomic_llong ranged_checked, ranged_flagged, ranged_skipped, ranged_outside, ranged_below, ranged_unheld;
static atomic_llong table_checked, table_flagged, table_touched, redo_side, redo_arrays;

void mt_codelet_ranged_table_add(int64_t checked, int64_t flagged, int64_t touched)
{
    atomic_fetch_add(&table_checked, (long long)checked);
    atomic_fetch_add(&table_flagged, (long long)flagged);
    atomic_fetch_add(&table_touched, (long long)touched);
}

mt_ranged_counts mt_codelet_ranged_counts(void)
{
    const long long below = atomic_load(&ranged_below);
    return (mt_ranged_counts){ .checked = atomic_load(&ranged_checked), .flagged = atomic_load(&ranged_flagged),
                               .skipped = atomic_load(&ranged_skipped), .outside = atomic_load(&ranged_outside) + below,
                               .below = below, .unheld = atomic_load(&ranged_unheld),
                               .table_checked = atomic_load(&table_checked), .table_flagged = atomic_load(&table_flagged),
                               .table_touched = atomic_load(&table_touched), .redo_side = atomic_load(&redo_side),
                               .redo_arrays = atomic_load(&redo_arrays) };
}

/* The clip task's scale for a norm (clip.c: torch's max_norm / (norm + 1e-6), at most 1). */
static double scale_of(double clip, double norm)
{
    const double s = clip / (norm + 1e-6);
    return s < 1.0 ? s : 1.0;
}

/* The rest of norm prev + 1's square a ranged run of tile first_tile predicts from slot prev % 2
 * (norm prev), knowing S_known = `known` and the table's head part `head_table` (mt_ranged_args):
 * the tiles before first_tile then, times the ratio of what is known now to the same sums then. */
static double predicted_rest(const mt_norm_history *h, int64_t prev, int first_tile, bool with_head, double known,
                             double head_table)
{
    const double *hs = h->sumsq[prev % 2];
    double same = with_head ? hs[h->ntiles] : 0, other = 0;
    for (int j = 0; j < h->ntiles; j++) {
        if (j >= first_tile) same += hs[j];
        else other += hs[j];
    }
    const double seen = known + (with_head ? head_table : 0);
    return same > 0 ? other * (seen / same) : other;
}

/* The range of clip scales [*c_lo, *c_hi] for a rest of the norm's square predicted as `rest`,
 * within `spread` times either way, the tiles in adding `known`. */
static void scale_range(double clip, double known, double rest, double spread, double *c_lo, double *c_hi)
{
    *c_hi = scale_of(clip, sqrt(known + rest / spread));
    *c_lo = scale_of(clip, sqrt(known + rest * spread));
}

/* The spread of the ranged runs of norm prev + 1, norm prev recorded. */
static double spread_after(const mt_norm_history *h, int64_t prev)
{
    const double s = h->next_spread[prev % 2];
    return s > 1 ? s : h->spread;
}

/* Why a ranged run does not speculate (mt_codelet_ranged_begin). */
enum { RANGE_NARROW, RANGE_WIDE, RANGE_UNHELD };

/* The range of a ranged run (mt_ranged_args), as gradient multipliers [*lo, *hi], and whether it
 * is to be used: RANGE_WIDE when it is wider than max_ratio, RANGE_UNHELD when the last norm's
 * prediction for this tile missed (mt_norm_history.check). `known`: the sums of squares of the
 * tiles in. */
static int ranged_range(double known, double head_table, const mt_ranged_args *a, double grad_scale, double *lo,
                        double *hi)
{
    /* every tile's sum adds to the norm: it is at least sqrt(known), the scale at most this */
    double c_hi = scale_of(a->clip, sqrt(known)), c_lo;
    const int64_t prev = a->seq - 1;
    const mt_norm_history *h = a->hist;
    const bool history = h && prev >= 1 && h->seq[prev % 2] == prev;
    double max_ratio = a->max_ratio;
    if (history) {
        const double rest = predicted_rest(h, prev, a->first_tile, a->head_table, known, head_table);
        const double spread = spread_after(h, prev);
        scale_range(a->clip, known, rest, spread, &c_lo, &c_hi);
        max_ratio *= spread / h->spread;
    } else {
        c_hi = fmin(c_hi, a->hi);
        c_lo = fmin(a->lo, c_hi);
    }
    /* Widened past the float rounding of (float)(grad_scale * scale) and the order of the sums:
     * inside the range whenever the prediction held. */
    *lo = grad_scale * c_lo * (1 - 1e-6);
    *hi = grad_scale * c_hi * (1 + 1e-6);
    if (c_hi > c_lo * max_ratio) return RANGE_WIDE;
    if (history && h->check && h->held[prev % 2] && !h->held[prev % 2][a->first_tile]) return RANGE_UNHELD;
    return RANGE_NARROW;
}

void mt_codelet_norm_recorded(mt_norm_history *h, int64_t seq, double clip)
{
    const double *now = h->sumsq[seq % 2];
    const int64_t prev = seq - 1;
    const bool history = prev >= 1 && h->seq[prev % 2] == prev;
    uint8_t *held = h->held[seq % 2];
    double total = 0;
    for (int j = 0; j < h->ntiles; j++) total += now[j];
    const double scale = scale_of(clip, sqrt(total));
    const bool with_head = now[h->ntiles] != 0;
    const double spread = history ? spread_after(h, prev) : h->spread;
    double known = 0; /* tiles f..ntiles-1, as a run of tile f knows them */
    double worst = 1; /* the prediction's largest error over the tiles */
    for (int f = h->ntiles - 1; f >= 0; f--) {
        known += now[f];
        if (held) held[f] = 1;
        if (!history) continue;
        const double rest = predicted_rest(h, prev, f, with_head, known, now[h->ntiles]);
        double actual = 0; /* the rest as it came: tiles 0..f-1 */
        for (int j = 0; j < f; j++) actual += now[j];
        if (held) {
            /* ranged_range's range for this tile, without the roundings' widening */
            double c_lo, c_hi;
            scale_range(clip, known, rest, spread, &c_lo, &c_hi);
            held[f] = scale >= c_lo * (1 - 1e-6) && scale <= c_hi * (1 + 1e-6);
        }
        if (f > 0) worst = fmax(worst, rest > 0 && actual > 0 ? fmax(actual / rest, rest / actual)
                                       : rest == actual ? 1 : INFINITY);
    }
    if (history) {
        h->worst[seq % MT_NORM_MEMORY_MAX] = worst;
        h->worst_seq[seq % MT_NORM_MEMORY_MAX] = seq;
    }
    /* the largest error over the last `memory` norms judged (norms without one count 1) */
    const int memory = h->memory < 1 ? 1 : h->memory > MT_NORM_MEMORY_MAX ? MT_NORM_MEMORY_MAX : h->memory;
    double recent = 1;
    for (int64_t s = seq; s > seq - memory && s >= 1; s--)
        if (h->worst_seq[s % MT_NORM_MEMORY_MAX] == s) recent = fmax(recent, h->worst[s % MT_NORM_MEMORY_MAX]);
    h->next_spread[seq % 2] = h->grow > h->spread ? fmin(h->spread * recent, h->grow) : h->spread;
    h->seq[seq % 2] = seq;
    const int64_t row = seq - 1 - h->log_from;
    if (h->log && row >= 0 && row < h->log_cap)
        memcpy(h->log + row * (h->ntiles + 1), now, sizeof(double) * (size_t)(h->ntiles + 1));
}

bool mt_codelet_ranged_begin(void *flags, int64_t n, double known, double head_table, const mt_ranged_args *a,
                             mt_adamw_params *p)
{
    ranged_header *hd = (ranged_header *)flags;
    double lo, hi;
    const int why = ranged_range(known, head_table, a, p->grad_scale, &lo, &hi);
    *hd = (ranged_header){ .cl = (float)lo, .ch = (float)hi, .skipped = why != RANGE_NARROW, .nside = 0, .full = 1,
                           .n = n };
    if (why != RANGE_NARROW) {
        atomic_fetch_add(&ranged_skipped, (long long)n);
        if (why == RANGE_UNHELD) atomic_fetch_add(&ranged_unheld, (long long)n);
        return false;
    }
    memset(bits_of(hd), 0, (size_t)words_of(n) * sizeof(uint64_t));
    p->grad_scale = hi;
    p->grad_scale_lo = lo;
    atomic_fetch_add(&ranged_checked, (long long)n);
    return true;
}

/* One block of a ranged pass: the flags, and the weights of the unflagged elements (the exact
 * bounds' C loop: all of them at the range's top scale); returns how many were flagged.
 * Deferred (old not NULL): the last step's moments half of the block first (po: its parameters,
 * o: ranged_consts_of(po), the kernel's float constants with po's scale as ch), fused into the
 * loop where the bounds are vector ones. */
static int64_t ranged_block(int64_t e, int64_t len, float *master, const float *old, const float *grad, float *m,
                            float *v, void *weights, mt_dtype dtype, const ranged_consts *k, const ranged_consts *o,
                            const mt_adamw_params *po, ranged_header *hd)
{
    int64_t nflagged;
#ifdef MT_RANGED_APPROX
    const mt_ranged_bounds b = bounds_used();
    if (e % 8 == 0 && b != MT_RANGED_BOUNDS_EXACT && dtype == MT_DTYPE_BF16) {
        /* flags as bytes, element e + 8j + b at bit b of byte j: on this little-endian target,
         * the bitmap's own layout from byte e / 8 on */
        uint8_t flagb[BLOCK / 8];
        mt_bf16 *w = (mt_bf16 *)weights + e;
        if (b == MT_RANGED_BOUNDS_AVX512) {
            if (old) deferred_fused_approx512(len, master + e, old + e, grad + e, m + e, v + e, o, po, k, w, flagb);
            else ranged_fused_approx512(len, master + e, grad + e, m + e, v + e, k, w, flagb);
        } else if (old) {
            deferred_fused_approx(len, master + e, old + e, grad + e, m + e, v + e, o, po, k, w, flagb);
        } else {
            ranged_fused_approx(len, master + e, grad + e, m + e, v + e, k, w, flagb);
        }
        nflagged = or_bytes(e / 8, (len + 7) / 8, flagb, bits_of(hd));
    } else
#endif
    {
        (void)o;
        if (old) mt_cpu_adamw_f32(len, master + e, old + e, m + e, v + e, po);
        float updated[BLOCK];
        int32_t may[BLOCK];
        ranged_fused(len, master + e, grad + e, m + e, v + e, k, updated, may);
        nflagged = or_bits(e, len, may, bits_of(hd));
        const size_t wsz = dtype == MT_DTYPE_BF16 ? sizeof(mt_bf16) : sizeof(float);
        write_streamed(len, updated, (char *)weights + (size_t)e * wsz, dtype);
    }
    if (nflagged) side_append(hd, e, len, nflagged, master, grad, m, v);
    return nflagged;
}

int64_t mt_codelet_ranged_pass(int64_t o, int64_t n, const float *master, const float *grad, const float *m,
                               const float *v, void *weights, mt_dtype dtype, const mt_adamw_params *p, void *flags)
{
    ranged_header *hd = (ranged_header *)flags;
    const ranged_consts k = ranged_consts_of(p);
    long long nflagged = 0;
    /* block by block, as adamw_streamed, each block's inputs still in cache for the bounds */
    for (int64_t e = o; e < o + n; e += BLOCK) {
        int64_t len = o + n - e < BLOCK ? o + n - e : BLOCK;
        /* not written without `old` */
        nflagged += ranged_block(e, len, (float *)master, NULL, grad, (float *)m, (float *)v, weights, dtype, &k, NULL,
                                 NULL, hd);
    }
    atomic_fetch_add(&ranged_flagged, nflagged);
    return nflagged;
}

void mt_codelet_ranged_flag(int64_t o, int64_t n, void *flags)
{
    ranged_header *hd = (ranged_header *)flags;
    hd->stale = 1;
    /* the side entries of [o, o + n) go stale: the first at or after o by bisection, then on */
    side_entry *se = side_of(hd);
    int64_t a = 0, b = hd->nside;
    while (a < b) {
        const int64_t mid = (a + b) / 2;
        if ((int64_t)(se[mid].idx & ~SIDE_STALE) < o) a = mid + 1;
        else b = mid;
    }
    for (; a < hd->nside && (int64_t)(se[a].idx & ~SIDE_STALE) < o + n; a++) se[a].idx |= SIDE_STALE;
    uint64_t *bits = bits_of(hd);
    for (int64_t i = o; i < o + n;) {
        if (i % 64 == 0 && o + n - i >= 64) {
            bits[i / 64] = ~(uint64_t)0;
            i += 64;
        } else {
            bits[i / 64] |= (uint64_t)1 << (i % 64);
            i++;
        }
    }
}

/* adamw_params, MT_ADAMW_RANGED: the flags, and the weights of the unflagged elements. */
static void adamw_params_ranged(void *buffers[], mt_adamw_params p, mt_dtype dtype, const mt_ranged_args *a)
{
    int64_t n = (int64_t)STARPU_VECTOR_GET_NX(buffers[0]);
    const float *master = (const float *)STARPU_VECTOR_GET_PTR(buffers[0]);
    const float *m = (const float *)STARPU_VECTOR_GET_PTR(buffers[1]), *v = (const float *)STARPU_VECTOR_GET_PTR(buffers[2]);
    const float *grad = (const float *)STARPU_VECTOR_GET_PTR(buffers[3]);
    void *w = (void *)STARPU_VECTOR_GET_PTR(buffers[4]);
    void *flags = (void *)STARPU_VECTOR_GET_PTR(buffers[5]);
    const double *known = (const double *)STARPU_VECTOR_GET_PTR(buffers[6]);
    if (mt_codelet_ranged_begin(flags, n, known[0], known[1], a, &p)) mt_codelet_ranged_pass(0, n, master, grad, m, v, w, dtype, &p, flags);
}

int64_t mt_codelet_ranged_pass_deferred(int64_t o, int64_t n, float *master, const float *old, const float *grad,
                                        float *m, float *v, void *weights, mt_dtype dtype, const mt_adamw_params *po,
                                        const mt_adamw_params *p, void *flags)
{
    if (!flags) {
        mt_cpu_adamw_f32(n, master + o, old + o, m + o, v + o, po);
        return 0;
    }
    const ranged_consts k = ranged_consts_of(p);
    const ranged_consts oc = ranged_consts_of(po); /* the moments half's: its ch is po's scale */
    long long nflagged = 0;
    for (int64_t e = o; e < o + n; e += BLOCK) {
        int64_t len = o + n - e < BLOCK ? o + n - e : BLOCK;
        nflagged += ranged_block(e, len, master, old, grad, m, v, weights, dtype, &k, &oc, po, (ranged_header *)flags);
    }
    atomic_fetch_add(&ranged_flagged, nflagged);
    return nflagged;
}

/* adamw_params, MT_ADAMW_RANGED_DEFERRED: the last step's moments half and this step's ranged
 * run in one pass (mt_codelet_ranged_pass_deferred). */
static void adamw_params_ranged_deferred(void *buffers[], mt_adamw_params p, mt_dtype dtype,
                                         const mt_ranged_args *a, mt_adamw_params po)
{
    int64_t n = (int64_t)STARPU_VECTOR_GET_NX(buffers[0]);
    float *master = (float *)STARPU_VECTOR_GET_PTR(buffers[0]);
    float *m = (float *)STARPU_VECTOR_GET_PTR(buffers[1]), *v = (float *)STARPU_VECTOR_GET_PTR(buffers[2]);
    const float *grad = (const float *)STARPU_VECTOR_GET_PTR(buffers[3]);
    void *w = (void *)STARPU_VECTOR_GET_PTR(buffers[4]);
    void *flags = (void *)STARPU_VECTOR_GET_PTR(buffers[5]);
    const double *known = (const double *)STARPU_VECTOR_GET_PTR(buffers[6]);
    const float *old = (const float *)STARPU_VECTOR_GET_PTR(buffers[7]);
    po.grad_scale *= ((const double *)STARPU_VECTOR_GET_PTR(buffers[8]))[1]; /* as adamw_moments_cpu */
    const bool ranged = mt_codelet_ranged_begin(flags, n, known[0], known[1], a, &p);
    mt_codelet_ranged_pass_deferred(0, n, master, old, grad, m, v, w, dtype, &po, &p, ranged ? flags : NULL);
}

enum { GATHER = 1024 };

/* The weights half of k elements whose inputs were gathered into gp, gg, gm and gv, scattered
 * back to w at idx (bf16 streamed weights). */
static void redo_gathered(int k, const int64_t *idx, const float *gp, const float *gg, const float *gm,
                          const float *gv, mt_bf16 *w, const mt_adamw_params *p)
{
    float out[GATHER];
    mt_bf16 ob[GATHER];
    mt_cpu_adamw_params_f32(k, gp, gg, gm, gv, out, p);
    mt_f32_to_bf16(k, out, ob);
    for (int j = 0; j < k; j++) w[idx[j]] = ob[j];
}

/* The weights half of the elements whose bit is set. Words with many set bits are redone whole
 * (contiguous, vectorised); the few bits of the others go through the same kernel on contiguous
 * arrays (each element's result depends on its own inputs only, so it gives the same bits),
 * their inputs taken from the side entries where one is (ranged_header), else gathered from the
 * arrays, the results scattered back. */
MT_CPU_CLONES static void redo_flagged(int64_t n, const ranged_header *hd, const float *master, const float *grad,
                                       const float *m, const float *v, mt_bf16 *w, const mt_adamw_params *p)
{
    enum { DENSE = 16 };
    const uint64_t *bits = bits_of(hd);
    const side_entry *se = side_of(hd);
    const int64_t ns = hd->nside;
    int64_t idx[GATHER], j = 0;
    float gp[GATHER], gg[GATHER], gm[GATHER], gv[GATHER];
    int k = 0;
    int64_t start = 0; /* the bitmap walk's first element */
    if (!hd->stale) {
        /* The side entries first, in element order: they hold every flagged element up to the
         * last one's (side_append fills them in order until they run out), so no walk of the
         * bitmap there, no search for each element's entry, no dense words. On the development
         * machine (adamw_bw --lr 1e-3, 4.9% flagged, 2 threads) the redo took 0.124-0.132 s per
         * 1e9 parameters this way, 0.150-0.194 with the walk over the whole bitmap. */
        for (int64_t a = 0; a < ns; a += GATHER) {
            const int kk = ns - a < GATHER ? (int)(ns - a) : GATHER;
            for (int q = 0; q < kk; q++) {
                const side_entry *e = &se[a + q];
                idx[q] = e->idx;
                __builtin_prefetch(&w[e->idx], 1); /* as below */
                gp[q] = e->master; gg[q] = e->grad; gm[q] = e->m; gv[q] = e->v;
            }
            redo_gathered(kk, idx, gp, gg, gm, gv, w, p);
        }
        atomic_fetch_add(&redo_side, (long long)ns);
        if (hd->full) return;
        /* the rest, past the last entry, from the arrays */
        start = ns ? (int64_t)se[ns - 1].idx + 1 : 0;
        j = ns;
    }
    long long from_side = 0, from_arrays = 0;
    for (int64_t o = start / 64 * 64; o < n; o += 64) {
        uint64_t word = bits[o / 64];
        if (o < start) word &= ~(uint64_t)0 << (start - o);
        if (!word) continue;
        if (__builtin_popcountll(word) >= DENSE) {
            mt_codelet_adamw_params_range(o, n - o < 64 ? n - o : 64, master, grad, m, v, w, MT_DTYPE_BF16, p);
            from_arrays += __builtin_popcountll(word);
            continue;
        }
        for (; word; word &= word - 1) {
            const int64_t i = o + __builtin_ctzll(word);
            while (j < ns && (int64_t)(se[j].idx & ~SIDE_STALE) < i) j++;
            if (j < ns && se[j].idx == (uint32_t)i) {
                gp[k] = se[j].master; gg[k] = se[j].grad; gm[k] = se[j].m; gv[k] = se[j].v;
                from_side++;
            } else {
                gp[k] = master[i]; gg[k] = grad[i]; gm[k] = m[i]; gv[k] = v[i];
                from_arrays++;
            }
            /* the line the scatter will write, so that its read overlaps the batch's listing: the
             * flagged elements' lines are apart, and waiting for each in turn cost 17-25% of the
             * redo on the development machine (adamw_bw --lr 3e-4 and 1e-3, 2 threads: 0.162-0.167
             * and 0.335-0.361 s per 1e9 parameters before, 0.124-0.129 and 0.268-0.281 after,
             * with this function's AVX2 clone, whose popcnt is an instruction). Prefetching the
             * gathered elements' master, grad, m and v as well was no faster. */
            __builtin_prefetch(&w[i], 1);
            idx[k++] = i;
            if (k == GATHER) {
                redo_gathered(k, idx, gp, gg, gm, gv, w, p);
                k = 0;
            }
        }
    }
    if (k) redo_gathered(k, idx, gp, gg, gm, gv, w, p);
    atomic_fetch_add(&redo_side, from_side);
    atomic_fetch_add(&redo_arrays, from_arrays);
}

/* adamw_params, MT_ADAMW_CONFIRM_RANGED. */
static void adamw_confirm_ranged(void *buffers[], mt_adamw_params p, mt_dtype dtype)
{
    int64_t n = (int64_t)STARPU_VECTOR_GET_NX(buffers[0]);
    const float *master = (const float *)STARPU_VECTOR_GET_PTR(buffers[0]);
    const float *m = (const float *)STARPU_VECTOR_GET_PTR(buffers[1]), *v = (const float *)STARPU_VECTOR_GET_PTR(buffers[2]);
    const float *grad = (const float *)STARPU_VECTOR_GET_PTR(buffers[3]);
    void *w = (void *)STARPU_VECTOR_GET_PTR(buffers[4]);
    const double scale = ((const double *)STARPU_VECTOR_GET_PTR(buffers[5]))[1];
    const ranged_header *hd = (const ranged_header *)STARPU_VECTOR_GET_PTR(buffers[6]);
    p.grad_scale *= scale; /* as adamw_streamed forms it */
    p.grad_scale_lo = 0;
    const float c = (float)p.grad_scale;
    if (hd->skipped || !(c >= hd->cl && c <= hd->ch)) {
        if (!hd->skipped) atomic_fetch_add(c < hd->cl ? &ranged_below : &ranged_outside, (long long)n);
        mt_codelet_adamw_params_range(0, n, master, grad, m, v, w, dtype, &p);
        return;
    }
    mt_codelet_ranged_redo(n, hd, master, grad, m, v, (mt_bf16 *)w, &p);
}

void mt_codelet_ranged_redo(int64_t n, const void *flags, const float *master, const float *grad, const float *m,
                            const float *v, mt_bf16 *w, const mt_adamw_params *p)
{
    redo_flagged(n, (const ranged_header *)flags, master, grad, m, v, w, p);
}

/* Wall time the CPU workers spent in AdamW tasks, over the process (mt_codelet_adamw_seconds):
 * what bench divides by the workers and the parameters for AdamW's rate inside the step. */
static atomic_llong adamw_ns, adamw_kind_ns[MT_AK_COUNT];

const char *const mt_adamw_kind_names[MT_AK_COUNT] = {
    "fused", "weights half", "confirm", "ranged pass", "ranged pass with last moments", "ranged redo",
    "moments half", "table early",
};

int64_t mt_codelet_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

void mt_codelet_adamw_time_add(mt_adamw_kind kind, int64_t ns)
{
    atomic_fetch_add(&adamw_ns, (long long)ns);
    atomic_fetch_add(&adamw_kind_ns[kind], (long long)ns);
}

double mt_codelet_adamw_seconds(void) { return (double)atomic_load(&adamw_ns) * 1e-9; }

void mt_codelet_adamw_seconds_by_kind(double out[MT_AK_COUNT])
{
    for (int k = 0; k < MT_AK_COUNT; k++) out[k] = (double)atomic_load(&adamw_kind_ns[k]) * 1e-9;
}

static void adamw_cpu(void *buffers[], void *cl_arg)
{
    const int64_t t0 = mt_codelet_now_ns();
    mt_adamw_params p;
    mt_dtype dtype;
    int clipped;
    starpu_codelet_unpack_args(cl_arg, &p, &dtype, &clipped);
    adamw_streamed(buffers, p, dtype, clipped, true);
    mt_codelet_adamw_time_add(MT_AK_FUSED, mt_codelet_now_ns() - t0);
}

static void adamw_params_cpu(void *buffers[], void *cl_arg)
{
    const int64_t t0 = mt_codelet_now_ns();
    mt_adamw_params p;
    mt_dtype dtype;
    int clipped;
    mt_ranged_args a; /* step.c packs one with every update task, and the last step's parameters */
    mt_adamw_params po;
    starpu_codelet_unpack_args(cl_arg, &p, &dtype, &clipped, &a, &po);
    if (clipped == MT_ADAMW_RANGED) adamw_params_ranged(buffers, p, dtype, &a);
    else if (clipped == MT_ADAMW_RANGED_DEFERRED) adamw_params_ranged_deferred(buffers, p, dtype, &a, po);
    else if (clipped == MT_ADAMW_CONFIRM_RANGED) adamw_confirm_ranged(buffers, p, dtype);
    else adamw_streamed(buffers, p, dtype, clipped, false);
    const mt_adamw_kind kind = clipped == MT_ADAMW_RANGED ? MT_AK_RANGED
                             : clipped == MT_ADAMW_RANGED_DEFERRED ? MT_AK_RANGED_DEFERRED
                             : clipped == MT_ADAMW_CONFIRM_RANGED ? MT_AK_CONFIRM_RANGED
                             : clipped == MT_ADAMW_CONFIRM ? MT_AK_CONFIRM : MT_AK_WEIGHTS;
    mt_codelet_adamw_time_add(kind, mt_codelet_now_ns() - t0);
}

/* The second half: master, m and v in place (the fused kernel, without the streamed copy the
 * first half wrote from the same values). */
static void adamw_moments_cpu(void *buffers[], void *cl_arg)
{
    const int64_t t0 = mt_codelet_now_ns();
    mt_adamw_params p;
    int clipped;
    starpu_codelet_unpack_args(cl_arg, &p, &clipped);
    int64_t n = (int64_t)STARPU_VECTOR_GET_NX(buffers[0]);
    if (clipped) p.grad_scale *= ((const double *)STARPU_VECTOR_GET_PTR(buffers[4]))[1];
    mt_cpu_adamw_f32(n, (float *)STARPU_VECTOR_GET_PTR(buffers[0]), (const float *)STARPU_VECTOR_GET_PTR(buffers[3]),
                     (float *)STARPU_VECTOR_GET_PTR(buffers[1]), (float *)STARPU_VECTOR_GET_PTR(buffers[2]), &p);
    mt_codelet_adamw_time_add(MT_AK_MOMENTS, mt_codelet_now_ns() - t0);
}

struct starpu_codelet mt_cl_adamw = {
    .name = "adamw",
    .cpu_funcs = { adamw_cpu },
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};

struct starpu_codelet mt_cl_adamw_params = {
    .name = "adamw_params",
    .cpu_funcs = { adamw_params_cpu },
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};

struct starpu_codelet mt_cl_adamw_moments = {
    .name = "adamw_moments",
    .cpu_funcs = { adamw_moments_cpu },
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};
