/* AdamW with the streamed copy, block by block (adamw.h). */
#include "backends/cpu/adamw.h"

#include <string.h>

static size_t streamed_size(mt_dtype dtype) { return dtype == MT_DTYPE_BF16 ? sizeof(mt_bf16) : sizeof(float); }

void mt_cpu_streamed_copy(int64_t n, const float *src, void *w, mt_dtype dtype)
{
    if (dtype == MT_DTYPE_BF16) mt_f32_to_bf16(n, src, (mt_bf16 *)w);
    else memcpy(w, src, (size_t)n * sizeof(float));
}

void mt_cpu_adamw_streamed(int64_t n, float *master, const float *grad, float *m, float *v, void *weights,
                           mt_dtype dtype, const mt_adamw_params *p)
{
    const size_t wsz = streamed_size(dtype);
    for (int64_t o = 0; o < n; o += MT_CPU_ADAMW_BLOCK) {
        const int64_t len = n - o < MT_CPU_ADAMW_BLOCK ? n - o : MT_CPU_ADAMW_BLOCK;
        mt_cpu_adamw_f32(len, master + o, grad + o, m + o, v + o, p);
        mt_cpu_streamed_copy(len, master + o, (char *)weights + (size_t)o * wsz, dtype);
    }
}

void mt_cpu_adamw_weights(int64_t o, int64_t n, const float *master, const float *grad, const float *m,
                          const float *v, void *weights, mt_dtype dtype, const mt_adamw_params *p)
{
    const size_t wsz = streamed_size(dtype);
    float updated[MT_CPU_ADAMW_BLOCK];
    for (int64_t e = o; e < o + n; e += MT_CPU_ADAMW_BLOCK) {
        const int64_t len = o + n - e < MT_CPU_ADAMW_BLOCK ? o + n - e : MT_CPU_ADAMW_BLOCK;
        mt_cpu_adamw_params_f32(len, master + e, grad + e, m + e, v + e, updated, p);
        mt_cpu_streamed_copy(len, updated, (char *)weights + (size_t)e * wsz, dtype);
    }
}
