/* A gradient's bf16 home and its sum of squares (grad_home.h), block by block so that the sum reads
 * the bf16 values while they are in cache. */
#include "backends/cpu/grad_home.h"

#include "backends/cpu/adamw.h"

double mt_cpu_grad_home(int64_t n, const float *acc, mt_bf16 *out)
{
    double s = 0;
    for (int64_t o = 0; o < n; o += MT_CPU_ADAMW_BLOCK) {
        const int64_t len = n - o < MT_CPU_ADAMW_BLOCK ? n - o : MT_CPU_ADAMW_BLOCK;
        mt_f32_to_bf16(len, acc + o, out + o);
        for (int64_t i = o; i < o + len; i++) {
            const double x = (double)mt_float_from_bf16(out[i]);
            s += x * x;
        }
    }
    return s;
}
