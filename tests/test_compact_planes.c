/* The compact host layout's planes (docs/design.md, section 1.1) on the CPU: the master's two
 * planes round-trip every float and stream its round to nearest (ties away); AdamW on the planes
 * gives the fp32 kernel's bits; a gradient's bf16 home and its sum of squares. */
#include <check.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cpu/grad_home.h"
#include "backends/cpu/master_planes.h"
#include "backends/cpu/ops.h"
#include "models/dtype.h"
#include "tests/compact_util.h"
#include "tests/testutil.h"

static bool is_nan_bits(uint32_t b) { return (b & 0x7FFFFFFFu) > 0x7F800000u; }
static bool is_nan_bf16(mt_bf16 h) { return (h & 0x7FFFu) > 0x7F80u; }

/* ---- the planes ------------------------------------------------------------------------- */

/* Every float bit pattern through the array functions: finite values and infinities decode to
 * their own bits; the high plane is the round to nearest even of the value except at an exact tie
 * (low half 0x8000), where it is rounded away from zero; a NaN keeps a NaN high plane of its sign
 * and decodes to a NaN of its sign. */
START_TEST(test_planes_every_float)
{
    enum { N = 1 << 16 };
    float *x = malloc(sizeof *x * N), *back = malloc(sizeof *back * N);
    mt_bf16 *hi = malloc(sizeof *hi * N), *rne = malloc(sizeof *rne * N);
    uint16_t *lo = malloc(sizeof *lo * N);
    uint64_t bad_trip = 0, bad_hi = 0, bad_nan = 0, first_bad = 0;
    for (uint64_t base = 0; base < ((uint64_t)1 << 32); base += N) {
        for (uint32_t i = 0; i < N; i++) x[i] = float_of((uint32_t)(base + i));
        mt_cpu_master_encode(N, x, hi, lo);
        mt_cpu_master_decode(N, hi, lo, back);
        mt_f32_to_bf16(N, x, rne);
        for (uint32_t i = 0; i < N; i++) {
            const uint32_t b = (uint32_t)(base + i), r = bits_of(back[i]);
            if (is_nan_bits(b)) {
                const bool ok = is_nan_bits(r) && is_nan_bf16(hi[i]) && (r >> 31) == (b >> 31) && (hi[i] >> 15) == (b >> 31);
                if (!ok && !bad_nan++ && !bad_trip && !bad_hi) first_bad = b;
                continue;
            }
            if (r != b && !bad_trip++ && !bad_hi && !bad_nan) first_bad = b;
            const mt_bf16 want = lo[i] == 0x8000 ? (mt_bf16)((b >> 16) + 1) : rne[i];
            if (hi[i] != want && !bad_hi++ && !bad_trip && !bad_nan) first_bad = b;
        }
    }
    ck_assert_msg(bad_trip == 0 && bad_hi == 0 && bad_nan == 0,
                  "%llu round trips, %llu high planes, %llu NaNs wrong; the first at bits 0x%08x",
                  (unsigned long long)bad_trip, (unsigned long long)bad_hi, (unsigned long long)bad_nan,
                  (unsigned)first_bad);
    free(x); free(back); free(hi); free(rne); free(lo);
}
END_TEST

/* The edges, one by one, through the scalar functions: zeros, denormals, the extremes, the values
 * whose rounding carries into the exponent (and into an infinity), ties, infinities, and the NaNs
 * that b + 0x8000 would wrap to zero or round to an infinity or -0. */
START_TEST(test_planes_edges)
{
    static const struct { uint32_t b; mt_bf16 hi; } cases[] = {
        { 0x00000000u, 0x0000 },  /* +0 */
        { 0x80000000u, 0x8000 },  /* -0 */
        { 0x00000001u, 0x0000 },  /* smallest denormal: rounds to 0 */
        { 0x00008000u, 0x0001 },  /* a denormal tie: away from zero */
        { 0x007FFFFFu, 0x0080 },  /* largest denormal: carries into the smallest normal */
        { 0x00800000u, 0x0080 },  /* FLT_MIN */
        { 0x3F7FFFFFu, 0x3F80 },  /* just under 1: carries into the exponent, to 1 */
        { 0x3F7F8000u, 0x3F80 },  /* a tie below 1: away from zero, carrying into the exponent */
        { 0x3F808000u, 0x3F81 },  /* a tie whose even neighbour is below: RNE would keep 0x3F80 */
        { 0xBF808000u, 0xBF81 },  /* the same, negative: away from zero too */
        { 0x7F7FFFFFu, 0x7F80 },  /* FLT_MAX: beyond bf16's largest, rounds to +inf */
        { 0xFF7FFFFFu, 0xFF80 },  /* -FLT_MAX */
        { 0x7F7F7FFFu, 0x7F7F },  /* bf16's largest finite, just below the rounding edge */
        { 0x7F800000u, 0x7F80 },  /* +inf */
        { 0xFF800000u, 0xFF80 },  /* -inf */
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        mt_bf16 hi;
        uint16_t lo;
        mt_master_encode(float_of(cases[k].b), &hi, &lo);
        ck_assert_msg(hi == cases[k].hi, "0x%08x: high plane 0x%04x, want 0x%04x", cases[k].b, hi, cases[k].hi);
        ck_assert_msg(bits_of(mt_master_decode(hi, lo)) == cases[k].b, "0x%08x decodes to 0x%08x", cases[k].b,
                      bits_of(mt_master_decode(hi, lo)));
    }
    ck_assert(bits_of(FLT_MAX) == 0x7F7FFFFFu && isinf(mt_float_from_bf16(0x7F80)));
    /* NaNs: +0x8000 would carry 0x7FFFxxxx into the sign (-0), round 0x7F80xxxx down to +inf and
     * wrap 0xFFFF8000 and above to +0; each keeps a NaN of its sign */
    static const uint32_t nans[] = { 0x7F800001u, 0x7F807FFFu, 0x7FC00000u, 0x7FFF8000u, 0x7FFFFFFFu,
                                     0xFF800001u, 0xFFC00000u, 0xFFFF7FFFu, 0xFFFF8000u, 0xFFFFFFFFu };
    for (size_t k = 0; k < sizeof nans / sizeof nans[0]; k++) {
        mt_bf16 hi;
        uint16_t lo;
        mt_master_encode(float_of(nans[k]), &hi, &lo);
        const uint32_t back = bits_of(mt_master_decode(hi, lo));
        ck_assert_msg(is_nan_bf16(hi) && (hi >> 15) == (nans[k] >> 31), "NaN 0x%08x streams as 0x%04x", nans[k], hi);
        ck_assert_msg(is_nan_bits(back) && (back >> 31) == (nans[k] >> 31), "NaN 0x%08x decodes to 0x%08x", nans[k], back);
    }
}
END_TEST

/* ---- AdamW on the planes ------------------------------------------------------------------- */

/* Masters over many magnitudes (some exact ties, zeros, denormals), a bf16 gradient, moments. */
static void adamw_inputs(mt_test_rng *r, int64_t n, float *master, mt_bf16 *grad, float *m, float *v)
{
    for (int64_t i = 0; i < n; i++) {
        const double scale = pow(10.0, -6.0 + 7.0 * mt_test_uniform(r));
        master[i] = (float)(scale * mt_test_normal(r));
        if (i % 97 == 0) master[i] = float_of((bits_of(master[i]) & 0xFFFF0000u) | 0x8000u); /* a tie */
        if (i % 389 == 0) master[i] = 0.0f;
        if (i % 401 == 0) master[i] = float_of(0x00000123u);
        grad[i] = mt_bf16_from_float((float)(1e-3 * mt_test_normal(r)));
        m[i] = (float)(1e-4 * mt_test_normal(r));
        v[i] = (float)(1e-8 * mt_test_uniform(r));
    }
}


/* The fused update and its two halves on the planes against mt_cpu_adamw_f32 on the same fp32
 * values: master, m and v bit for bit, over a length that is no multiple of the block. */
START_TEST(test_adamw_planes_bitwise)
{
    const int64_t n = 3 * 4096 + 77;
    mt_test_rng r;
    mt_test_rng_seed(&r, 5);
    float *master = malloc(sizeof(float) * n), *m = malloc(sizeof(float) * n), *v = malloc(sizeof(float) * n);
    float *g32 = malloc(sizeof(float) * n), *ref = malloc(sizeof(float) * n), *got = malloc(sizeof(float) * n);
    float *m2 = malloc(sizeof(float) * n), *v2 = malloc(sizeof(float) * n);
    float *m3 = malloc(sizeof(float) * n), *v3 = malloc(sizeof(float) * n);
    mt_bf16 *grad = malloc(sizeof(mt_bf16) * n), *hi = malloc(sizeof(mt_bf16) * n), *hi2 = malloc(sizeof(mt_bf16) * n);
    uint16_t *lo = malloc(sizeof(uint16_t) * n), *lo2 = malloc(sizeof(uint16_t) * n);
    adamw_inputs(&r, n, master, grad, m, v);
    const mt_adamw_params p = { .lr = 3e-3, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = 0.1, .step = 7,
                                .grad_scale = 0.37 };
    mt_cpu_master_encode(n, master, hi, lo);
    memcpy(hi2, hi, sizeof(mt_bf16) * n);
    memcpy(lo2, lo, sizeof(uint16_t) * n);
    memcpy(m2, m, sizeof(float) * n);
    memcpy(v2, v, sizeof(float) * n);
    memcpy(m3, m, sizeof(float) * n);
    memcpy(v3, v, sizeof(float) * n);
    /* the reference: the fp32 kernel on the decoded master and the widened gradient */
    mt_cpu_master_decode(n, hi, lo, ref);
    ck_assert_int_eq(first_diff(ref, master, n), -1);
    mt_bf16_to_f32(n, grad, g32);
    mt_cpu_adamw_f32(n, ref, g32, m, v, &p);

    mt_cpu_adamw_planes(n, hi, lo, grad, m2, v2, &p);
    mt_cpu_master_decode(n, hi, lo, got);
    ck_assert_msg(first_diff(got, ref, n) < 0, "fused master differs at %lld", (long long)first_diff(got, ref, n));
    ck_assert_msg(first_diff(m2, m, n) < 0 && first_diff(v2, v, n) < 0, "fused m or v differs");

    mt_cpu_adamw_planes_weights(n, hi2, lo2, grad, m3, v3, &p);
    mt_cpu_adamw_planes_moments(n, grad, m3, v3, &p);
    mt_cpu_master_decode(n, hi2, lo2, got);
    ck_assert_msg(first_diff(got, ref, n) < 0, "split master differs at %lld", (long long)first_diff(got, ref, n));
    ck_assert_msg(first_diff(m3, m, n) < 0 && first_diff(v3, v, n) < 0, "split m or v differs");
    /* and the update did something */
    ck_assert(first_diff(ref, master, n) >= 0);
    free(master); free(m); free(v); free(g32); free(ref); free(got); free(m2); free(v2); free(m3); free(v3);
    free(grad); free(hi); free(hi2); free(lo); free(lo2);
}
END_TEST

/* The gradient home: every element mt_bf16_from_float's rounding (ties to even among them), the
 * sum of squares of the bf16 values in double, in element order, to the bit. */
START_TEST(test_grad_home_reference)
{
    const int64_t n = 2 * 4096 + 999;
    mt_test_rng r;
    mt_test_rng_seed(&r, 17);
    float *acc = malloc(sizeof(float) * n);
    mt_bf16 *out = malloc(sizeof(mt_bf16) * n);
    mt_test_fill_f32(&r, acc, n, 1e-2f);
    for (int64_t i = 0; i < n; i += 50) acc[i] = float_of((bits_of(acc[i]) & 0xFFFF0000u) | 0x8000u); /* ties */
    const double got = mt_cpu_grad_home(n, acc, out);
    double want = 0;
    int64_t bad = -1, ties_up = 0, ties = 0;
    for (int64_t i = 0; i < n; i++) {
        if (out[i] != mt_bf16_from_float(acc[i]) && bad < 0) bad = i;
        if ((bits_of(acc[i]) & 0xFFFF) == 0x8000) {
            ties++;
            ties_up += out[i] != (mt_bf16)(bits_of(acc[i]) >> 16);
        }
        const double x = (double)mt_float_from_bf16(out[i]);
        want += x * x;
    }
    ck_assert_msg(bad < 0, "element %lld: bf16 0x%04x, want 0x%04x", (long long)bad, bad < 0 ? 0 : out[bad],
                  bad < 0 ? 0 : mt_bf16_from_float(acc[bad]));
    ck_assert_msg(memcmp(&got, &want, sizeof got) == 0, "sum of squares %.17g, want %.17g", got, want);
    /* nearest even: about half the ties round up, not all (the compact master's rounding is not the gradient's) */
    ck_assert(ties > 100 && ties_up > ties / 4 && ties_up < 3 * ties / 4);
    /* the norm is that of the bf16 values, not of the fp32 accumulator */
    ck_assert(got != mt_cpu_sumsq_f32(n, acc));
    free(acc);
    free(out);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("compact_planes");
    TCase *planes = tcase_create("planes");
    tcase_add_test(planes, test_planes_every_float);
    tcase_add_test(planes, test_planes_edges);
    tcase_add_test(planes, test_adamw_planes_bitwise);
    tcase_add_test(planes, test_grad_home_reference);
    suite_add_tcase(s, planes);
    return mt_test_run(s, false);
}
