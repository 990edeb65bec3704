/* Check suite of the CPU AdamW kernels (backends/cpu/ops.h): the f32 and f64 updates against
 * torch.optim.AdamW written as a scalar double loop, the f32 kernels the step runs bit for bit
 * against the same float operations as a plain loop, and the bf16 conversions the weights half
 * writes (rounding, NaNs, every pattern's round trip, the array versions). */
#include <check.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cpu/ops.h"
#include "tests/testutil.h"

/* ---------- AdamW ---------- */

enum { ADAM_N = 1003, ADAM_STEPS = 5 };

static const mt_adamw_params adam_base = {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
                                          .weight_decay = 0.1, .grad_scale = 0.37};

/* The torch.optim.AdamW update written out as a scalar double loop, the reference. */
static void adamw_reference(int64_t n, double *p, const double *grad, double *m, double *v,
                            int64_t step, const mt_adamw_params *a)
{
    for (int64_t i = 0; i < n; i++) {
        double g = grad[i] * a->grad_scale;
        p[i] *= 1 - a->lr * a->weight_decay;
        m[i] = a->beta1 * m[i] + (1 - a->beta1) * g;
        v[i] = a->beta2 * v[i] + (1 - a->beta2) * g * g;
        double bc1 = 1 - pow(a->beta1, (double)step), bc2 = 1 - pow(a->beta2, (double)step);
        p[i] -= a->lr / bc1 * m[i] / (sqrt(v[i]) / sqrt(bc2) + a->eps);
    }
}

static void check_adamw(bool single)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 18);
    double *p = mt_test_random_f64(&rng, ADAM_N, 1.0), *m = mt_test_alloc_f64(ADAM_N), *v = mt_test_alloc_f64(ADAM_N);
    double *grads = mt_test_random_f64(&rng, ADAM_N * ADAM_STEPS, 1.0);
    for (int s = 0; s < ADAM_STEPS; s++) grads[s * ADAM_N] = 0; /* element 0 only decays */
    float *p32 = NULL, *m32 = NULL, *v32 = NULL, *g32 = NULL;
    double *pk = NULL, *mk = NULL, *vk = NULL;
    if (single) {
        p32 = mt_test_to_f32(p, ADAM_N), m32 = mt_test_alloc_f32(ADAM_N), v32 = mt_test_alloc_f32(ADAM_N);
        g32 = mt_test_to_f32(grads, ADAM_N * ADAM_STEPS);
        /* the reference starts from exactly the float values the kernel sees */
        free(p), p = mt_test_to_f64(p32, ADAM_N);
        free(grads), grads = mt_test_to_f64(g32, ADAM_N * ADAM_STEPS);
    } else {
        pk = mt_test_copy_f64(p, ADAM_N), mk = mt_test_alloc_f64(ADAM_N), vk = mt_test_alloc_f64(ADAM_N);
    }
    double *p0 = mt_test_copy_f64(p, ADAM_N);
    for (int64_t s = 1; s <= ADAM_STEPS; s++) {
        mt_adamw_params a = adam_base;
        a.step = s;
        a.lr = adam_base.lr * (1.0 - 0.1 * (double)s); /* a schedule: lr changes per step */
        const double *gs = grads + (s - 1) * ADAM_N;
        adamw_reference(ADAM_N, p, gs, m, v, s, &a);
        if (single)
            mt_cpu_adamw_f32(ADAM_N, p32, g32 + (s - 1) * ADAM_N, m32, v32, &a);
        else
            mt_cpu_adamw_f64(ADAM_N, pk, gs, mk, vk, &a);
    }
    /* the test is meaningful only if the parameters actually moved */
    ck_assert(mt_test_rel_err_f64(p, p0, ADAM_N) > 1e-3);
    const double tol = single ? 1e-6 : 1e-12;
    if (single) {
        mt_test_report("adamw f32 master vs reference", mt_test_rel_err_mixed(p32, p, ADAM_N), tol);
        mt_test_report("adamw f32 m vs reference", mt_test_rel_err_mixed(m32, m, ADAM_N), tol);
        mt_test_report("adamw f32 v vs reference", mt_test_rel_err_mixed(v32, v, ADAM_N), tol);
        /* zero gradient: only the decay, (1 - lr_s wd) over the five steps */
        double decay = 1;
        for (int s = 1; s <= ADAM_STEPS; s++) decay *= 1 - adam_base.lr * (1 - 0.1 * s) * 0.1;
        ck_assert_double_eq_tol(p32[0], p[0], 1e-6 * fabs(p[0]));
        ck_assert_double_eq_tol(p[0], p0[0] * decay, 1e-14);
    } else {
        mt_test_report("adamw f64 master vs reference", mt_test_rel_err_f64(pk, p, ADAM_N), tol);
        mt_test_report("adamw f64 m vs reference", mt_test_rel_err_f64(mk, m, ADAM_N), tol);
        mt_test_report("adamw f64 v vs reference", mt_test_rel_err_f64(vk, v, ADAM_N), tol);
    }
    free(p), free(m), free(v), free(grads), free(p0);
    free(p32), free(m32), free(v32), free(g32), free(pk), free(mk), free(vk);
}

START_TEST(test_adamw_f32) { check_adamw(true); }
END_TEST

/* The f32 kernels the step runs (whichever build of them this machine picks: MT_CPU_CLONES in
 * ops.h) against the same float operations written as a plain scalar loop, bit for bit: the
 * in-place update, the out-of-place one, the weights half and the bf16 conversion. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("no-tree-vectorize")))
#endif
static void adamw_scalar_f32(int64_t n, const float *p, const float *grad, const float *m, const float *v, float *p_out,
                             float *m_out, float *v_out, const mt_adamw_params *a)
{
    const double bc1 = 1.0 - pow(a->beta1, (double)a->step), bc2 = 1.0 - pow(a->beta2, (double)a->step);
    const float gs = (float)a->grad_scale, decay = (float)(1.0 - a->lr * a->weight_decay), b1 = (float)a->beta1,
                one_b1 = (float)(1.0 - a->beta1), b2 = (float)a->beta2, one_b2 = (float)(1.0 - a->beta2),
                step_size = (float)(a->lr / bc1), sqrt_bc2 = (float)sqrt(bc2), eps = (float)a->eps;
    for (int64_t i = 0; i < n; i++) {
        const float g = grad[i] * gs;
        const float mi = b1 * m[i] + one_b1 * g, vi = b2 * v[i] + one_b2 * g * g;
        m_out[i] = mi;
        v_out[i] = vi;
        p_out[i] = p[i] * decay - step_size * (mi / (sqrtf(vi) / sqrt_bc2 + eps));
    }
}

START_TEST(test_adamw_f32_bitwise_scalar)
{
    enum { N = 1003 };
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 23);
    float p[N], g[N], m[N], v[N], rp[N], rm[N], rv[N], kp[N], km[N], kv[N], half[N];
    mt_test_fill_f32(&rng, p, N, 0.05f);
    mt_test_fill_f32(&rng, g, N, 1e-2f);
    mt_test_fill_f32(&rng, m, N, 1e-3f);
    mt_test_fill_f32(&rng, v, N, 1e-5f);
    for (int i = 0; i < N; i++) v[i] = fabsf(v[i]);
    g[0] = 0, m[1] = 0, v[1] = 0; /* a zero gradient; a fresh element */
    mt_adamw_params a = adam_base;
    a.step = 7;
    adamw_scalar_f32(N, p, g, m, v, rp, rm, rv, &a);
    memcpy(kp, p, sizeof p), memcpy(km, m, sizeof m), memcpy(kv, v, sizeof v);
    mt_cpu_adamw_f32(N, kp, g, km, kv, &a);
    mt_cpu_adamw_params_f32(N, p, g, m, v, half, &a);
    ck_assert_msg(!memcmp(kp, rp, sizeof rp) && !memcmp(km, rm, sizeof rm) && !memcmp(kv, rv, sizeof rv),
                  "mt_cpu_adamw_f32 differs from the scalar loop");
    ck_assert_msg(!memcmp(half, rp, sizeof rp), "mt_cpu_adamw_params_f32 differs from the scalar loop");
    mt_bf16 wb[N];
    mt_f32_to_bf16(N, rp, wb);
    for (int i = 0; i < N; i++) ck_assert_uint_eq(wb[i], mt_bf16_from_float(rp[i]));
}
END_TEST

START_TEST(test_adamw_f64) { check_adamw(false); }
END_TEST

/* ---------- bf16 ---------- */

static float f_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static uint32_t bits_f(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static bool bf16_is_nan(mt_bf16 b) { return (b & 0x7F80) == 0x7F80 && (b & 0x007F) != 0; }

START_TEST(test_bf16)
{
    static const struct { uint32_t in; mt_bf16 out; } cases[] = {
        {0x3F800000u, 0x3F80}, /* 1.0 exact */
        {0x3F808000u, 0x3F80}, /* tie between 0x3F80 and 0x3F81: to even (down) */
        {0x3F818000u, 0x3F82}, /* tie between 0x3F81 and 0x3F82: to even (up) */
        {0xBF818000u, 0xBF82}, /* negative tie: magnitude to even */
        {0x3F807FFFu, 0x3F80}, /* just below half: down */
        {0x3F808001u, 0x3F81}, /* just above half: up */
        {0x3FFF8000u, 0x4000}, /* tie whose rounding carries into the exponent */
        {0x7F800000u, 0x7F80}, /* +inf */
        {0xFF800000u, 0xFF80}, /* -inf */
        {0x7F7FFFFFu, 0x7F80}, /* FLT_MAX rounds past bf16's max: inf */
        {0x7F7F0000u, 0x7F7F}, /* bf16's max stays */
        {0x00000000u, 0x0000}, /* +0 */
        {0x80000000u, 0x8000}, /* -0 */
        {0x00018000u, 0x0002}, /* subnormal tie: to even (up) */
        {0x00008000u, 0x0000}, /* smallest subnormal tie: to even (zero) */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        mt_bf16 got = mt_bf16_from_float(f_bits(cases[i].in));
        ck_assert_msg(got == cases[i].out, "bf16(0x%08x) = 0x%04x, expected 0x%04x", cases[i].in,
                      got, cases[i].out);
    }
    /* NaNs stay NaN, quiet, sign kept, even those whose payload lives only in the low 16 bits
     * (plain rounding would turn 0x7F800001 into inf) */
    static const uint32_t nans[] = {0x7FC00000u, 0x7F800001u, 0xFF800001u, 0x7FFFFFFFu, 0x7FBFFFFFu};
    for (size_t i = 0; i < sizeof nans / sizeof nans[0]; i++) {
        mt_bf16 got = mt_bf16_from_float(f_bits(nans[i]));
        ck_assert_msg(bf16_is_nan(got) && (got & 0x0040), "NaN 0x%08x -> 0x%04x", nans[i], got);
        ck_assert_int_eq(got & 0x8000, (nans[i] >> 16) & 0x8000);
        ck_assert(isnan(mt_float_from_bf16(got)));
    }
    /* every bf16 pattern: widening is exact (bits << 16) and narrowing back is the identity */
    int checked = 0;
    for (uint32_t b = 0; b < 0x10000u; b++) {
        float f = mt_float_from_bf16((mt_bf16)b);
        ck_assert_uint_eq(bits_f(f), b << 16);
        mt_bf16 back = mt_bf16_from_float(f);
        if (bf16_is_nan((mt_bf16)b)) {
            ck_assert(bf16_is_nan(back));
        } else {
            ck_assert_msg(back == b, "round trip 0x%04x -> 0x%04x", b, back);
            checked++;
        }
    }
    ck_assert_int_eq(checked, 65536 - 2 * 127);
    /* the array version (vectorised, branch-free) on the special cases and NaNs: the scalar's bits */
    enum { NS = sizeof cases / sizeof cases[0], NN = sizeof nans / sizeof nans[0] };
    float special[NS + NN];
    mt_bf16 special_out[NS + NN];
    for (size_t i = 0; i < NS; i++) special[i] = f_bits(cases[i].in);
    for (size_t i = 0; i < NN; i++) special[NS + i] = f_bits(nans[i]);
    mt_f32_to_bf16(NS + NN, special, special_out);
    for (size_t i = 0; i < NS + NN; i++)
        ck_assert_msg(special_out[i] == mt_bf16_from_float(special[i]), "array bf16(0x%08x) = 0x%04x, scalar 0x%04x",
                      bits_f(special[i]), special_out[i], mt_bf16_from_float(special[i]));
    /* the array versions agree with the scalar ones; rounding error within half a bf16 ulp */
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 19);
    enum { NB = 1003 };
    float in[NB], back[NB];
    mt_bf16 out[NB];
    mt_test_fill_f32(&rng, in, NB, 3.0f);
    mt_f32_to_bf16(NB, in, out);
    mt_bf16_to_f32(NB, out, back);
    for (int i = 0; i < NB; i++) {
        ck_assert_uint_eq(out[i], mt_bf16_from_float(in[i]));
        ck_assert(fabsf(back[i] - in[i]) <= ldexpf(fabsf(in[i]), -8) + FLT_MIN);
    }
}
END_TEST

static Suite *adamw_suite(void)
{
    Suite *s = suite_create("adamw");
    TCase *tc = tcase_create("cpu");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_adamw_f32);
    tcase_add_test(tc, test_adamw_f64);
    tcase_add_test(tc, test_bf16);
    tcase_add_test(tc, test_adamw_f32_bitwise_scalar);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return mt_test_run(adamw_suite(), false);
}
