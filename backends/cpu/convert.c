/* The copy past the cache: stores that do not read the target lines first. */
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "backends/cpu/ops.h"

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
