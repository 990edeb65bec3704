/* Element types: sizes, names, parsing; fp32 <-> bf16 rounding (nearest even, NaN kept quiet). */
#include "models/dtype.h"

#include <string.h>

size_t mt_dtype_size(mt_dtype t) { return t == MT_DTYPE_BF16 ? 2 : 4; }
const char *mt_dtype_name(mt_dtype t) { return t == MT_DTYPE_BF16 ? "bf16" : "fp32"; }

int mt_dtype_parse(const char *s, mt_dtype *out)
{
    if (!strcmp(s, "fp32") || !strcmp(s, "f32") || !strcmp(s, "float32")) *out = MT_DTYPE_F32;
    else if (!strcmp(s, "bf16") || !strcmp(s, "bfloat16")) *out = MT_DTYPE_BF16;
    else return -1;
    return 0;
}

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

float mt_float_from_bf16(mt_bf16 x)
{
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* mt_bf16_from_float over an array, written branch-free (the NaN case a select) so that the
 * compiler vectorises it: it runs on every streamed weight of every AdamW update, where a
 * scalar loop would cost as much as the update's own arithmetic. */
MT_CPU_CLONES void mt_f32_to_bf16(int64_t n, const float *restrict in, mt_bf16 *restrict out)
{
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &in[i], sizeof u);
        const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x0040u;
        out[i] = (mt_bf16)((u & 0x7FFFFFFFu) > 0x7F800000u ? quiet : rounded);
    }
}

void mt_bf16_to_f32(int64_t n, const mt_bf16 *in, float *out)
{
    for (int64_t i = 0; i < n; i++) out[i] = mt_float_from_bf16(in[i]);
}
