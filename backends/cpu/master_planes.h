/* The fp32 master weights kept as two 16-bit planes, the compact host layout (docs/design.md,
 * section 1.1): the high plane is the bf16 weight that streams to the GPU, the master rounded to
 * nearest with ties away from zero; the low plane holds the master's low 16 bits, which make it
 * exact. And AdamW over the planes, whole or in its two halves, with a bf16 gradient.
 *
 * The encoding of a float's bits b: hi = (b + 0x8000) >> 16, lo = b & 0xFFFF; the decoding:
 * b = ((hi - (lo >> 15)) << 16) | lo (hi was rounded up exactly when lo's top bit is set).
 * Every finite float and both infinities round-trip bit for bit; a rounding that carries into the
 * exponent is undone by the decoding like any other. A NaN's hi is its quiet bf16 NaN, sign kept,
 * as mt_bf16_from_float makes it: b + 0x8000 would wrap the negative NaNs above 0xFFFF8000 to +0
 * and round positive ones to -0 or to an infinity. Such a pair decodes to a NaN of the same sign;
 * its payload is not kept. */
#ifndef MT_BACKENDS_CPU_MASTER_PLANES_H
#define MT_BACKENDS_CPU_MASTER_PLANES_H

#include <stdint.h>
#include <string.h>

#include "backends/cpu/ops.h"
#include "models/dtype.h"

/* The planes of one float. */
static inline void mt_master_encode(float x, mt_bf16 *hi, uint16_t *lo)
{
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    const uint32_t nearest = (b + 0x8000u) >> 16, quiet = (b >> 16) | 0x0040u;
    *hi = (mt_bf16)((b & 0x7FFFFFFFu) > 0x7F800000u ? quiet : nearest);
    *lo = (uint16_t)b;
}

/* The float of a pair of planes. */
static inline float mt_master_decode(mt_bf16 hi, uint16_t lo)
{
    const uint32_t b = (uint32_t)(uint16_t)(hi - (lo >> 15)) << 16 | lo;
    float x;
    memcpy(&x, &b, sizeof x);
    return x;
}

/* hi, lo (n) = the planes of master (n). */
void mt_cpu_master_encode(int64_t n, const float *master, mt_bf16 *hi, uint16_t *lo);
/* master (n) = the floats of the planes hi, lo (n). */
void mt_cpu_master_decode(int64_t n, const mt_bf16 *hi, const uint16_t *lo, float *master);

/* AdamW on n elements whose master is the planes hi, lo (both in place) and whose gradient is
 * bf16: block by block, the planes decoded and the gradient widened to fp32, then
 * mt_cpu_adamw_f32 on them, then the master encoded back. So master, m and v are bit for bit
 * those of mt_cpu_adamw_f32 on the same fp32 values. */
void mt_cpu_adamw_planes(int64_t n, mt_bf16 *hi, uint16_t *lo, const mt_bf16 *grad, float *m, float *v,
                         const mt_adamw_params *p);
/* The weights half of the same update: the new master into hi and lo (mt_cpu_adamw_params_f32's,
 * the same bits), m and v only read. The moments half must come after it (it writes m and v). */
void mt_cpu_adamw_planes_weights(int64_t n, mt_bf16 *hi, uint16_t *lo, const mt_bf16 *grad, const float *m,
                                 const float *v, const mt_adamw_params *p);
/* The same two updates over an fp32 master (in place), the gradient bf16: a compact tile's norms,
 * whose master is their fp32 streamed copy (models/layout.h, mt_layout_keep_norms_f32). */
void mt_cpu_adamw_f32_master(int64_t n, float *master, const mt_bf16 *grad, float *m, float *v, const mt_adamw_params *p);
void mt_cpu_adamw_f32_master_weights(int64_t n, float *master, const mt_bf16 *grad, const float *m, const float *v,
                                     const mt_adamw_params *p);
/* The moments half: m and v in place (mt_cpu_adamw_moments_f32 on the widened gradient); it needs
 * no master. */
void mt_cpu_adamw_planes_moments(int64_t n, const mt_bf16 *grad, float *m, float *v, const mt_adamw_params *p);

#endif
