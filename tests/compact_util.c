/* The compact layout suites' shared helpers (tests/compact_util.h). */
#include "tests/compact_util.h"

#include <string.h>

uint32_t bits_of(float x)
{
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    return b;
}

float float_of(uint32_t b)
{
    float x;
    memcpy(&x, &b, sizeof x);
    return x;
}

int64_t first_diff(const float *a, const float *b, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        if (bits_of(a[i]) != bits_of(b[i])) return i;
    return -1;
}
