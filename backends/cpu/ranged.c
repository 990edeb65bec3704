/* The ranged passes (ranged.h): the exact bounds in plain C, and the dispatch of a chunk's blocks
 * to the bounds asked for (the vector ones are in ranged_simd.c).
 *
 * The bound. Over c in [cl, ch] the real-valued update (the fp32 kernel's operations, unrounded,
 * on its fp32 constants) is bounded:
 *   m' = b1 m + (1-b1) g c and v' = b2 v + (1-b2) g^2 c^2 are monotone in c (c > 0), so is
 *   den = sqrt(v') / sqrt(bc2) + eps > 0, and q = m' / den lies within the quotients of the
 *   box's corners; the weight is p decay - (lr / bc1) q.
 * The kernel's own rounding and that of evaluating these bounds in float (a few dozen operations,
 * each within 2^-24 of the magnitudes involved) are covered by a margin of 2^-16 of those
 * magnitudes. When both ends of the widened interval round to the same bf16 value, so does the
 * kernel's result for every c in the range (the rounding is monotone). */
#include "backends/cpu/ranged.h"

#include <float.h>
#include <math.h>

#include "backends/cpu/ranged_kernels.h"

mt_ranged_consts mt_ranged_consts_of(const mt_adamw_params *p)
{
    const double bc1 = 1.0 - pow(p->beta1, (double)p->step), bc2 = 1.0 - pow(p->beta2, (double)p->step);
    return (mt_ranged_consts){
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

/* The exact bounds. One loop: out[i], the weights half at the range's top scale, bit for bit the
 * kernel's result there (adamw.inc: the same operations, in the same order, on the same float
 * constants), and may[i] = 1 when element i's bf16 weight could differ within the range. The top
 * scale's corners of the bounds are the kernel's own moment and denominator; the bottom scale's
 * denominator multiplies by the reciprocal of sqrt_bc2 instead of dividing. Their roundings are
 * inside the margin, as the bounds' evaluation is. Written branch-free (min and max as
 * comparisons: fminf's NaN rules keep GCC from vectorising it).
 * This is not the vector bodies' loop at one lane: it also yields the kernel's fp32 result at
 * the top scale (the weights of fp32 streaming, and of the unflagged elements), which needs the
 * kernel's operations in the kernel's order, true divisions and no fused multiply-adds, where the
 * vector bodies read the bf16 weight off the bounds and use estimated reciprocals. */
MT_CPU_CLONES static void ranged_exact(int64_t n, const float *restrict master, const float *restrict grad,
                                       const float *restrict m, const float *restrict v, const mt_ranged_consts *k,
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

void mt_cpu_ranged_exact_tail(int64_t n, const float *master, const float *grad, const float *m, const float *v,
                              const mt_ranged_consts *k, mt_bf16 *w, uint8_t *flagb)
{
    float out[16];
    int32_t may[16];
    ranged_exact(n, master, grad, m, v, k, out, may);
    mt_f32_to_bf16(n, out, w);
    for (int64_t j = 0; j < n; j += 8) flagb[j / 8] = 0;
    for (int64_t j = 0; j < n; j++) flagb[j / 8] |= (uint8_t)((may[j] & 1) << (j % 8));
}

mt_ranged_bounds mt_ranged_bounds_used(mt_ranged_bounds b)
{
#ifdef MT_RANGED_VECTOR
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

const char *mt_ranged_bounds_option(mt_ranged_bounds b)
{
    static const char *const names[] = { "avx2", "avx512", "exact" };
    return names[b];
}

const char *mt_ranged_bounds_name(mt_ranged_bounds b)
{
    static const char *const names[] = { "AVX2 approximate-reciprocal", "AVX-512 approximate-reciprocal", "exact" };
    return names[mt_ranged_bounds_used(b)];
}

/* One block of a pass: the flags, and the weights of the unflagged elements (the exact bounds' C
 * loop: all of them, at the range's top scale); returns how many were flagged. Deferred (old not
 * NULL): the last step's moments half of the block first (po: its parameters, o: their float
 * constants with po's scale as ch), fused into the loop where the bounds are vector ones. */
static int64_t ranged_block(int64_t e, int64_t len, float *master, const float *old, const float *grad, float *m,
                            float *v, void *weights, mt_dtype dtype, const mt_ranged_consts *k,
                            const mt_ranged_consts *o, const mt_adamw_params *po, mt_ranged_bounds bounds,
                            mt_ranged_header *hd)
{
    int64_t nflagged;
#ifdef MT_RANGED_VECTOR
    const mt_ranged_bounds b = mt_ranged_bounds_used(bounds);
    if (e % 8 == 0 && b != MT_RANGED_BOUNDS_EXACT && dtype == MT_DTYPE_BF16) {
        /* flags as bytes, element e + 8j + b at bit b of byte j: on this little-endian target,
         * the bitmap's own layout from byte e / 8 on */
        uint8_t flagb[MT_CPU_ADAMW_BLOCK / 8];
        mt_bf16 *w = (mt_bf16 *)weights + e;
        if (b == MT_RANGED_BOUNDS_AVX512) {
            if (old) mt_cpu_ranged_deferred_avx512(len, master + e, old + e, grad + e, m + e, v + e, o, po, k, w, flagb);
            else mt_cpu_ranged_pass_avx512(len, master + e, grad + e, m + e, v + e, k, w, flagb);
        } else if (old) {
            mt_cpu_ranged_deferred_avx2(len, master + e, old + e, grad + e, m + e, v + e, o, po, k, w, flagb);
        } else {
            mt_cpu_ranged_pass_avx2(len, master + e, grad + e, m + e, v + e, k, w, flagb);
        }
        nflagged = mt_ranged_or_bytes(e / 8, (len + 7) / 8, flagb, mt_ranged_bits(hd));
    } else
#endif
    {
        (void)o;
        (void)bounds;
        if (old) mt_cpu_adamw_f32(len, master + e, old + e, m + e, v + e, po);
        float updated[MT_CPU_ADAMW_BLOCK];
        int32_t may[MT_CPU_ADAMW_BLOCK];
        ranged_exact(len, master + e, grad + e, m + e, v + e, k, updated, may);
        nflagged = mt_ranged_or_ints(e, len, may, mt_ranged_bits(hd));
        const size_t wsz = dtype == MT_DTYPE_BF16 ? sizeof(mt_bf16) : sizeof(float);
        mt_cpu_streamed_copy(len, updated, (char *)weights + (size_t)e * wsz, dtype);
    }
    if (nflagged) mt_ranged_flags_append(hd, e, len, nflagged, master, grad, m, v);
    return nflagged;
}

int64_t mt_cpu_ranged_pass(int64_t o, int64_t n, const float *master, const float *grad, const float *m,
                           const float *v, void *weights, mt_dtype dtype, const mt_adamw_params *p,
                           mt_ranged_bounds bounds, void *flags)
{
    const mt_ranged_consts k = mt_ranged_consts_of(p);
    int64_t nflagged = 0;
    /* block by block, each block's inputs still in cache for the bounds; master, m and v are not
     * written without `old` */
    for (int64_t e = o; e < o + n; e += MT_CPU_ADAMW_BLOCK) {
        const int64_t len = o + n - e < MT_CPU_ADAMW_BLOCK ? o + n - e : MT_CPU_ADAMW_BLOCK;
        nflagged += ranged_block(e, len, (float *)master, NULL, grad, (float *)m, (float *)v, weights, dtype, &k, NULL,
                                 NULL, bounds, (mt_ranged_header *)flags);
    }
    return nflagged;
}

int64_t mt_cpu_ranged_pass_deferred(int64_t o, int64_t n, float *master, const float *old, const float *grad,
                                    float *m, float *v, void *weights, mt_dtype dtype, const mt_adamw_params *po,
                                    const mt_adamw_params *p, mt_ranged_bounds bounds, void *flags)
{
    if (!flags) {
        mt_cpu_adamw_f32(n, master + o, old + o, m + o, v + o, po);
        return 0;
    }
    const mt_ranged_consts k = mt_ranged_consts_of(p);
    const mt_ranged_consts oc = mt_ranged_consts_of(po); /* the moments half's: its ch is po's scale */
    int64_t nflagged = 0;
    for (int64_t e = o; e < o + n; e += MT_CPU_ADAMW_BLOCK) {
        const int64_t len = o + n - e < MT_CPU_ADAMW_BLOCK ? o + n - e : MT_CPU_ADAMW_BLOCK;
        nflagged += ranged_block(e, len, master, old, grad, m, v, weights, dtype, &k, &oc, po, bounds,
                                 (mt_ranged_header *)flags);
    }
    return nflagged;
}
