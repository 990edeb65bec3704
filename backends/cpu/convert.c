/* fp32 <-> bf16 conversion: what the optimizer writes for the GPU to stream (fp32 master ->
 * bf16 compute copy) and how bf16 data is read back. Round to nearest even, NaN kept quiet.
 * And the copy past the cache the optimizer's out-of-place update stores with. */
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "ops.h"

mt_bf16 mt_bf16_from_float(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) /* NaN: truncating could leave a zero mantissa (inf) */
        return (mt_bf16)((u >> 16) | 0x0040u);
    /* add just under half an ulp, plus one when the kept part is odd: ties go to even. A carry
     * into the exponent is the correct rounding, up to inf for values beyond bf16's max. */
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (mt_bf16)(u >> 16);
}

void mt_cpu_copy_past_cache_f32(int64_t n, const float *src, float *dst)
{
    int64_t i = 0;
#if defined(__SSE2__)
    while (i < n && ((uintptr_t)(dst + i) & 15u)) {
        dst[i] = src[i];
        i++;
    }
    for (; i + 4 <= n; i += 4) _mm_stream_ps(dst + i, _mm_loadu_ps(src + i));
#endif
    for (; i < n; i++) dst[i] = src[i];
}

void mt_cpu_copy_past_cache_done(void)
{
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

float mt_float_from_bf16(mt_bf16 x)
{
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* mt_bf16_from_float over an array, written branch-free (the NaN case a select) so that the
 * compiler vectorises it: called on every streamed weight of every AdamW update, the scalar
 * form cost ~1.4 ns an element, as much as the update's own arithmetic. */
MT_CPU_CLONES void mt_cpu_f32_to_bf16(int64_t n, const float *restrict in, mt_bf16 *restrict out)
{
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &in[i], sizeof u);
        const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x0040u;
        out[i] = (mt_bf16)((u & 0x7FFFFFFFu) > 0x7F800000u ? quiet : rounded);
    }
}

void mt_cpu_bf16_to_f32(int64_t n, const mt_bf16 *in, float *out)
{
    for (int64_t i = 0; i < n; i++) out[i] = mt_float_from_bf16(in[i]);
}
