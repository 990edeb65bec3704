/* The vector bounds of the ranged passes: ranged_simd.inc instantiated in 8 lanes (AVX2 and FMA)
 * and 16 (AVX-512 F, VL, DQ and BW). Intrinsics, because C has no spelling of the reciprocal and
 * square-root estimates (rcpps, rsqrtps) short of -ffast-math, which would also reorder the
 * moments half the deferred loop must compute bit for bit. Each width finishes the elements past
 * its last whole vector with the narrower loop: 16 lanes with 8, 8 with the exact bounds. */
#include "backends/cpu/ranged_kernels.h"

#ifdef MT_RANGED_VECTOR
#include <float.h>
#include <immintrin.h>

/* The remainder of a deferred loop in plain C: the moments half, then the exact bounds. */
static void deferred_exact_tail(int64_t n, float *master, const float *old, const float *grad, float *m, float *v,
                                const mt_ranged_consts *o, const mt_adamw_params *po, const mt_ranged_consts *k,
                                mt_bf16 *w, uint8_t *flagb)
{
    (void)o;
    mt_cpu_adamw_f32(n, master, old, m, v, po);
    mt_cpu_ranged_exact_tail(n, master, grad, m, v, k, w, flagb);
}

/* 8 lanes. */
#define V_LANES 8
#define VF __m256
#define VI __m256i
#define V_NAME(x) x##_avx2
#define V_TARGET __attribute__((target("avx2,fma")))
#define V_SET1 _mm256_set1_ps
#define V_LOAD _mm256_loadu_ps
#define V_STORE _mm256_storeu_ps
#define V_ADD _mm256_add_ps
#define V_SUB _mm256_sub_ps
#define V_MUL _mm256_mul_ps
#define V_DIV _mm256_div_ps
#define V_SQRT _mm256_sqrt_ps
#define V_MIN _mm256_min_ps
#define V_MAX _mm256_max_ps
#define V_FMADD _mm256_fmadd_ps
#define V_FNMADD _mm256_fnmadd_ps
#define V_ABS(c, x) _mm256_and_ps((x), (c)->absmask)
#define V_RSQRT _mm256_rsqrt_ps
#define V_RCP _mm256_rcp_ps
#define V_ZERO_BELOW_MIN(x, v) _mm256_andnot_ps(_mm256_cmp_ps((x), _mm256_set1_ps(FLT_MIN), _CMP_LT_OQ), (v))
#define V_CAST_F _mm256_castsi256_ps
#define VI_SET1 _mm256_set1_epi32
#define VI_CAST _mm256_castps_si256
#define VI_ADD _mm256_add_epi32
#define VI_MIN_U _mm256_min_epu32
#define VI_MAX_U _mm256_max_epu32
#define VI_SRLI16(x) _mm256_srli_epi32((x), 16)
#define V_STORE_BF16(p, d)                                                                          \
    _mm_storeu_si128((__m128i *)(p), _mm_packus_epi32(_mm256_castsi256_si128(d), _mm256_extracti128_si256((d), 1)))
#define V_FLAGS(d, big, dn, up)                                                                     \
    ((unsigned)(uint8_t)~_mm256_movemask_ps(_mm256_castsi256_ps(                                    \
        _mm256_and_si256(_mm256_cmpeq_epi32((dn), (up)), _mm256_castps_si256(_mm256_cmp_ps((d), (big), _CMP_LE_OQ))))))
#define V_PASS_TAIL mt_cpu_ranged_exact_tail
#define V_DEFERRED_TAIL deferred_exact_tail
#include "backends/cpu/ranged_simd.inc"
#undef V_LANES
#undef VF
#undef VI
#undef V_NAME
#undef V_TARGET
#undef V_SET1
#undef V_LOAD
#undef V_STORE
#undef V_ADD
#undef V_SUB
#undef V_MUL
#undef V_DIV
#undef V_SQRT
#undef V_MIN
#undef V_MAX
#undef V_FMADD
#undef V_FNMADD
#undef V_ABS
#undef V_RSQRT
#undef V_RCP
#undef V_ZERO_BELOW_MIN
#undef V_CAST_F
#undef VI_SET1
#undef VI_CAST
#undef VI_ADD
#undef VI_MIN_U
#undef VI_MAX_U
#undef VI_SRLI16
#undef V_STORE_BF16
#undef V_FLAGS
#undef V_PASS_TAIL
#undef V_DEFERRED_TAIL

/* 16 lanes: masks and absolute values are single instructions, and 32 registers hold the
 * constants that spill from AVX2's 16. */
#define V_LANES 16
#define VF __m512
#define VI __m512i
#define V_NAME(x) x##_avx512
#define V_TARGET __attribute__((target("avx2,fma,avx512f,avx512vl,avx512dq,avx512bw")))
#define V_SET1 _mm512_set1_ps
#define V_LOAD _mm512_loadu_ps
#define V_STORE _mm512_storeu_ps
#define V_ADD _mm512_add_ps
#define V_SUB _mm512_sub_ps
#define V_MUL _mm512_mul_ps
#define V_DIV _mm512_div_ps
#define V_SQRT _mm512_sqrt_ps
#define V_MIN _mm512_min_ps
#define V_MAX _mm512_max_ps
#define V_FMADD _mm512_fmadd_ps
#define V_FNMADD _mm512_fnmadd_ps
#define V_ABS(c, x) _mm512_abs_ps(x)
#define V_RSQRT _mm512_rsqrt14_ps
#define V_RCP _mm512_rcp14_ps
#define V_ZERO_BELOW_MIN(x, v) _mm512_maskz_mov_ps(_mm512_cmp_ps_mask((x), _mm512_set1_ps(FLT_MIN), _CMP_NLT_UQ), (v))
#define V_CAST_F _mm512_castsi512_ps
#define VI_SET1 _mm512_set1_epi32
#define VI_CAST _mm512_castps_si512
#define VI_ADD _mm512_add_epi32
#define VI_MIN_U _mm512_min_epu32
#define VI_MAX_U _mm512_max_epu32
#define VI_SRLI16(x) _mm512_srli_epi32((x), 16)
#define V_STORE_BF16(p, d) _mm256_storeu_si256((__m256i *)(p), _mm512_cvtepi32_epi16(d))
#define V_FLAGS(d, big, dn, up)                                                                     \
    ((unsigned)(uint16_t)~_mm512_mask_cmpeq_epi32_mask(_mm512_cmp_ps_mask((d), (big), _CMP_LE_OQ), (dn), (up)))
#define V_PASS_TAIL mt_cpu_ranged_pass_avx2
#define V_DEFERRED_TAIL mt_cpu_ranged_deferred_avx2
#include "backends/cpu/ranged_simd.inc"
#endif
