/* Shared by the compact layout suites (test_compact_planes.c, test_compact.c): a float's bits. */
#ifndef MT_TESTS_COMPACT_UTIL_H
#define MT_TESTS_COMPACT_UTIL_H

#include <stdint.h>

/* The bits of x, and the float of bits b. */
uint32_t bits_of(float x);
float float_of(uint32_t b);

/* The first index where a and b (n floats) differ in their bits; -1 when none does. */
int64_t first_diff(const float *a, const float *b, int64_t n);

#endif
