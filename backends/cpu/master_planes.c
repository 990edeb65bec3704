/* The master as two 16-bit planes and AdamW over them (master_planes.h). The AdamW loops work
 * block by block through fp32 buffers on the stack, so the update itself is the fp32 kernel's
 * (the same operations, the same bits) and each block is still in cache when it is encoded. */
#include "backends/cpu/master_planes.h"

#include "backends/cpu/adamw.h"

#include <string.h>

/* Written branch-free (the NaN case a select), as mt_f32_to_bf16, so that they vectorise: they run
 * over every parameter of every update. */
MT_CPU_CLONES void mt_cpu_master_encode(int64_t n, const float *restrict master, mt_bf16 *restrict hi,
                                        uint16_t *restrict lo)
{
    for (int64_t i = 0; i < n; i++) mt_master_encode(master[i], &hi[i], &lo[i]);
}

MT_CPU_CLONES void mt_cpu_master_decode(int64_t n, const mt_bf16 *restrict hi, const uint16_t *restrict lo,
                                        float *restrict master)
{
    for (int64_t i = 0; i < n; i++) master[i] = mt_master_decode(hi[i], lo[i]);
}

/* out (n) = the bf16 gradient in (n) as fp32, exactly. */
MT_CPU_CLONES static void widen(int64_t n, const mt_bf16 *restrict in, float *restrict out)
{
    for (int64_t i = 0; i < n; i++) {
        const uint32_t b = (uint32_t)in[i] << 16;
        memcpy(&out[i], &b, sizeof b);
    }
}

static int64_t block_len(int64_t n, int64_t o) { return n - o < MT_CPU_ADAMW_BLOCK ? n - o : MT_CPU_ADAMW_BLOCK; }

/* The fused update (m and v written) or its weights half (m and v read) over the master as planes
 * hi, lo or, where hi is NULL, as the floats f32. */
static void update(int64_t n, mt_bf16 *hi, uint16_t *lo, float *f32, const mt_bf16 *grad, float *m, float *v,
                   bool fused, const mt_adamw_params *p)
{
    float master[MT_CPU_ADAMW_BLOCK], g[MT_CPU_ADAMW_BLOCK], updated[MT_CPU_ADAMW_BLOCK];
    for (int64_t o = 0; o < n; o += MT_CPU_ADAMW_BLOCK) {
        const int64_t len = block_len(n, o);
        float *w = hi ? master : f32 + o;
        if (hi) mt_cpu_master_decode(len, hi + o, lo + o, master);
        widen(len, grad + o, g);
        if (fused) {
            mt_cpu_adamw_f32(len, w, g, m + o, v + o, p);
        } else {
            mt_cpu_adamw_params_f32(len, w, g, m + o, v + o, updated, p);
            if (!hi) memcpy(w, updated, (size_t)len * sizeof(float));
        }
        if (hi) mt_cpu_master_encode(len, fused ? master : updated, hi + o, lo + o);
    }
}

void mt_cpu_adamw_planes(int64_t n, mt_bf16 *hi, uint16_t *lo, const mt_bf16 *grad, float *m, float *v,
                         const mt_adamw_params *p)
{
    update(n, hi, lo, NULL, grad, m, v, true, p);
}

void mt_cpu_adamw_planes_weights(int64_t n, mt_bf16 *hi, uint16_t *lo, const mt_bf16 *grad, const float *m,
                                 const float *v, const mt_adamw_params *p)
{
    update(n, hi, lo, NULL, grad, (float *)m, (float *)v, false, p);
}

void mt_cpu_adamw_f32_master(int64_t n, float *master, const mt_bf16 *grad, float *m, float *v, const mt_adamw_params *p)
{
    update(n, NULL, NULL, master, grad, m, v, true, p);
}

void mt_cpu_adamw_f32_master_weights(int64_t n, float *master, const mt_bf16 *grad, const float *m, const float *v,
                                     const mt_adamw_params *p)
{
    update(n, NULL, NULL, master, grad, (float *)m, (float *)v, false, p);
}

void mt_cpu_adamw_planes_moments(int64_t n, const mt_bf16 *grad, float *m, float *v, const mt_adamw_params *p)
{
    float g[MT_CPU_ADAMW_BLOCK];
    for (int64_t o = 0; o < n; o += MT_CPU_ADAMW_BLOCK) {
        const int64_t len = block_len(n, o);
        widen(len, grad + o, g);
        mt_cpu_adamw_moments_f32(len, g, m + o, v + o, p);
    }
}
