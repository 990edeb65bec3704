/* Check suite of the CPU primitive kernels (backends/cpu/ops.h): every backward against central
 * finite differences of the double (_f64) forward, forwards against naive references, the = / +=
 * output contracts, float/double agreement, AdamW against a scalar torch-order reference, bf16. */
#include <check.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cpu/ops.h"
#include "backends/cpu/ranged.h"
#include "codelets/adamw.h"
#include "runtime/speculate/history.h"
#include "tests/testutil.h"

/* Sizes deliberately not multiples of 8, so vector tails and odd strides are exercised. */
enum { B = 2, T = 7, H = 6, KV = 2, D = 10, DM = 13, I = 19, V = 11, NTOK = B * T };

#define FD_STEP 1e-6     /* central differences in double: truncation ~h^2, rounding ~1e-16/h */
#define FD_TOL 1e-6      /* ||analytic - fd|| / ||fd|| per tensor */
#define MIXED_TOL 1e-5   /* f32 forward vs f64 forward on the same inputs */

/* ---------- helpers ---------- */

static double *dalloc(int64_t n)
{
    double *p = calloc((size_t)(n > 0 ? n : 1), sizeof(double));
    ck_assert_ptr_nonnull(p);
    return p;
}

static float *falloc(int64_t n)
{
    float *p = calloc((size_t)(n > 0 ? n : 1), sizeof(float));
    ck_assert_ptr_nonnull(p);
    return p;
}

static double *drandom(mt_test_rng *rng, int64_t n, double scale)
{
    double *p = dalloc(n);
    mt_test_fill_f64(rng, p, n, scale);
    return p;
}

static double *dcopy(const double *x, int64_t n)
{
    double *p = dalloc(n);
    memcpy(p, x, (size_t)n * sizeof(double));
    return p;
}

static float *to_f32(const double *x, int64_t n)
{
    float *p = falloc(n);
    for (int64_t i = 0; i < n; i++) p[i] = (float)x[i];
    return p;
}

/* double copy of the float values (so a double reference sees exactly the f32 inputs) */
static double *to_f64(const float *x, int64_t n)
{
    double *p = dalloc(n);
    for (int64_t i = 0; i < n; i++) p[i] = (double)x[i];
    return p;
}

static void fill_nan(double *x, int64_t n)
{
    for (int64_t i = 0; i < n; i++) x[i] = NAN;
}

static double weighted_sum(const double *w, const double *y, int64_t n)
{
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += w[i] * y[i];
    return s;
}

/* a - b elementwise into a new array: what a += output added */
static double *diff(const double *a, const double *b, int64_t n)
{
    double *p = dalloc(n);
    for (int64_t i = 0; i < n; i++) p[i] = a[i] - b[i];
    return p;
}

/* ||f32 result - f64 result|| / ||f64 result|| */
static double mixed_err(const float *a, const double *b, int64_t n)
{
    double *a64 = to_f64(a, n);
    double e = mt_test_rel_err_f64(a64, b, n);
    free(a64);
    return e;
}

static void report(const char *what, double err, double tol)
{
    printf("[ops] %-40s rel err %.3e (tol %.0e)\n", what, err, tol);
    fflush(stdout);
    ck_assert_msg(err <= tol, "%s: relative error %.3e exceeds %.1e", what, err, tol);
}

/* The scalar objective L(x) whose gradient is checked, evaluated with the _f64 forward. */
typedef double (*objective_fn)(void *ctx);

/* Central finite-difference gradient of f with respect to x (n), perturbing x in place, compared
 * with `analytic`; reports and asserts the relative error. */
static void check_grad(const char *what, objective_fn f, void *ctx, double *x, int64_t n,
                       const double *analytic)
{
    double *fd = dalloc(n);
    for (int64_t i = 0; i < n; i++) {
        double saved = x[i];
        x[i] = saved + FD_STEP;
        double fp = f(ctx);
        x[i] = saved - FD_STEP;
        double fm = f(ctx);
        x[i] = saved;
        fd[i] = (fp - fm) / (2 * FD_STEP);
    }
    double norm = 0;
    for (int64_t i = 0; i < n; i++) norm += fd[i] * fd[i];
    ck_assert_msg(norm > 0, "%s: finite-difference gradient is zero, the check would be vacuous", what);
    report(what, mt_test_rel_err_f64(analytic, fd, n), FD_TOL);
    free(fd);
}

/* ---------- embedding ---------- */

typedef struct { double *table, *w, *out; int32_t *tokens; } embed_ctx;

static double embed_objective(void *p)
{
    embed_ctx *c = p;
    mt_cpu_embedding_forward_f64(NTOK, DM, c->table, c->tokens, c->out);
    return weighted_sum(c->w, c->out, NTOK * DM);
}

START_TEST(test_embedding)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 11);
    int32_t tokens[NTOK];
    for (int i = 0; i < NTOK; i++) tokens[i] = (int32_t)(mt_test_uniform(&rng) * V);
    tokens[5] = tokens[0]; /* a repeated token: its gradient rows must add up */
    tokens[9] = V - 1;
    embed_ctx c = {drandom(&rng, V * DM, 1.0), drandom(&rng, NTOK * DM, 1.0), dalloc(NTOK * DM),
                   tokens};

    mt_cpu_embedding_forward_f64(NTOK, DM, c.table, tokens, c.out);
    for (int r = 0; r < NTOK; r++)
        ck_assert_int_eq(memcmp(c.out + r * DM, c.table + tokens[r] * DM, DM * sizeof(double)), 0);

    double *prefill = drandom(&rng, V * DM, 1.0), *dtable = dcopy(prefill, V * DM);
    mt_cpu_embedding_backward_f64(NTOK, DM, tokens, c.w, dtable);
    double *added = diff(dtable, prefill, V * DM);
    check_grad("embedding d table (+=)", embed_objective, &c, c.table, V * DM, added);

    float *table32 = to_f32(c.table, V * DM), *out32 = falloc(NTOK * DM);
    mt_cpu_embedding_forward_f32(NTOK, DM, table32, tokens, out32);
    mt_cpu_embedding_forward_f64(NTOK, DM, c.table, tokens, c.out);
    report("embedding f32 vs f64 forward", mixed_err(out32, c.out, NTOK * DM), MIXED_TOL);
    free(table32), free(out32), free(prefill), free(dtable), free(added);
    free(c.table), free(c.w), free(c.out);
}
END_TEST

/* ---------- rmsnorm ---------- */

#define RMS_EPS 1e-5

typedef struct { double *x, *g, *wts, *y; } rms_ctx;

static double rms_objective(void *p)
{
    rms_ctx *c = p;
    mt_cpu_rmsnorm_forward_f64(NTOK, DM, c->x, c->g, RMS_EPS, c->y, NULL);
    return weighted_sum(c->wts, c->y, NTOK * DM);
}

START_TEST(test_rmsnorm)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 12);
    rms_ctx c = {drandom(&rng, NTOK * DM, 1.0), drandom(&rng, DM, 1.0),
                 drandom(&rng, NTOK * DM, 1.0), dalloc(NTOK * DM)};
    double *y = dalloc(NTOK * DM), *inv = dalloc(NTOK), *ref = dalloc(NTOK * DM);
    double inv_ref[NTOK];
    for (int r = 0; r < NTOK; r++) {
        long double ss = 0;
        for (int j = 0; j < DM; j++) ss += (long double)c.x[r * DM + j] * c.x[r * DM + j];
        inv_ref[r] = (double)(1.0L / sqrtl(ss / DM + RMS_EPS));
        for (int j = 0; j < DM; j++) ref[r * DM + j] = c.x[r * DM + j] * inv_ref[r] * c.g[j];
    }
    mt_cpu_rmsnorm_forward_f64(NTOK, DM, c.x, c.g, RMS_EPS, y, inv);
    report("rmsnorm forward vs naive", mt_test_rel_err_f64(y, ref, NTOK * DM), 1e-14);
    report("rmsnorm inv_rms vs naive", mt_test_rel_err_f64(inv, inv_ref, NTOK), 1e-14);
    mt_cpu_rmsnorm_forward_f64(NTOK, DM, c.x, c.g, RMS_EPS, c.y, NULL); /* inv_rms optional */
    ck_assert_int_eq(memcmp(c.y, y, NTOK * DM * sizeof(double)), 0);

    double *dx0 = drandom(&rng, NTOK * DM, 1.0), *dw0 = drandom(&rng, DM, 1.0);
    double *dx = dcopy(dx0, NTOK * DM), *dw = dcopy(dw0, DM);
    mt_cpu_rmsnorm_backward_f64(NTOK, DM, c.x, c.g, inv, c.wts, dx, dw);
    double *ax = diff(dx, dx0, NTOK * DM), *aw = diff(dw, dw0, DM);
    check_grad("rmsnorm dx (+=)", rms_objective, &c, c.x, NTOK * DM, ax);
    check_grad("rmsnorm dw (+=)", rms_objective, &c, c.g, DM, aw);

    float *x32 = to_f32(c.x, NTOK * DM), *g32 = to_f32(c.g, DM), *y32 = falloc(NTOK * DM);
    float *inv32 = falloc(NTOK);
    mt_cpu_rmsnorm_forward_f32(NTOK, DM, x32, g32, RMS_EPS, y32, inv32);
    report("rmsnorm f32 vs f64 forward", mixed_err(y32, y, NTOK * DM), MIXED_TOL);
    report("rmsnorm f32 vs f64 inv_rms", mixed_err(inv32, inv, NTOK), MIXED_TOL);
    free(x32), free(g32), free(y32), free(inv32);
    free(dx0), free(dw0), free(dx), free(dw), free(ax), free(aw), free(y), free(inv), free(ref);
    free(c.x), free(c.g), free(c.wts), free(c.y);
}
END_TEST

/* ---------- linear ---------- */

typedef struct { double *x, *W, *b, *wts, *y; } linear_ctx;

static double linear_objective(void *p)
{
    linear_ctx *c = p;
    mt_cpu_linear_forward_f64(NTOK, DM, I, c->x, c->W, c->b, c->y);
    return weighted_sum(c->wts, c->y, NTOK * I);
}

START_TEST(test_linear)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 13);
    linear_ctx c = {drandom(&rng, NTOK * DM, 1.0), drandom(&rng, I * DM, 0.5),
                    drandom(&rng, I, 1.0), drandom(&rng, NTOK * I, 1.0), dalloc(NTOK * I)};
    double *y = dalloc(NTOK * I), *ref = dalloc(NTOK * I), *ref_nob = dalloc(NTOK * I);
    for (int r = 0; r < NTOK; r++)
        for (int o = 0; o < I; o++) {
            double s = 0;
            for (int i = 0; i < DM; i++) s += c.x[r * DM + i] * c.W[o * DM + i];
            ref_nob[r * I + o] = s;
            ref[r * I + o] = s + c.b[o];
        }
    fill_nan(y, NTOK * I); /* y is an = output: stale contents, NaN included, must not leak */
    mt_cpu_linear_forward_f64(NTOK, DM, I, c.x, c.W, c.b, y);
    report("linear forward vs naive", mt_test_rel_err_f64(y, ref, NTOK * I), 1e-14);
    fill_nan(y, NTOK * I);
    mt_cpu_linear_forward_f64(NTOK, DM, I, c.x, c.W, NULL, y);
    report("linear forward (no bias) vs naive", mt_test_rel_err_f64(y, ref_nob, NTOK * I), 1e-14);

    /* accumulate_dx = false: dx overwritten (NaN prefill); dW, db accumulate */
    double *dW0 = drandom(&rng, I * DM, 1.0), *db0 = drandom(&rng, I, 1.0);
    double *dx = dalloc(NTOK * DM), *dW = dcopy(dW0, I * DM), *db = dcopy(db0, I);
    fill_nan(dx, NTOK * DM);
    mt_cpu_linear_backward_f64(NTOK, DM, I, c.x, c.W, c.wts, dx, false, dW, db);
    double *aW = diff(dW, dW0, I * DM), *ab = diff(db, db0, I);
    check_grad("linear dx (=)", linear_objective, &c, c.x, NTOK * DM, dx);
    check_grad("linear dW (+=)", linear_objective, &c, c.W, I * DM, aW);
    check_grad("linear db (+=)", linear_objective, &c, c.b, I, ab);

    /* accumulate_dx = true adds the same gradient onto the prefill; db NULL leaves it out */
    double *dx0 = drandom(&rng, NTOK * DM, 1.0), *dxa = dcopy(dx0, NTOK * DM);
    double *dW2 = dcopy(dW0, I * DM);
    mt_cpu_linear_backward_f64(NTOK, DM, I, c.x, c.W, c.wts, dxa, true, dW2, NULL);
    double *ax = diff(dxa, dx0, NTOK * DM);
    report("linear dx (+=) vs dx (=)", mt_test_rel_err_f64(ax, dx, NTOK * DM), 1e-14);
    report("linear dW with db NULL", mt_test_rel_err_f64(dW2, dW, I * DM), 1e-14);

    float *x32 = to_f32(c.x, NTOK * DM), *W32 = to_f32(c.W, I * DM), *b32 = to_f32(c.b, I);
    float *y32 = falloc(NTOK * I);
    mt_cpu_linear_forward_f32(NTOK, DM, I, x32, W32, b32, y32);
    mt_cpu_linear_forward_f64(NTOK, DM, I, c.x, c.W, c.b, y);
    report("linear f32 vs f64 forward", mixed_err(y32, y, NTOK * I), MIXED_TOL);
    free(x32), free(W32), free(b32), free(y32);
    free(dW0), free(db0), free(dx), free(dW), free(db), free(aW), free(ab);
    free(dx0), free(dxa), free(dW2), free(ax), free(y), free(ref), free(ref_nob);
    free(c.x), free(c.W), free(c.b), free(c.wts), free(c.y);
}
END_TEST

/* ---------- rope ---------- */

typedef struct { double *x, *wts, *y; const double *inv_freq; int64_t nh; } rope_ctx;

static double rope_objective(void *p)
{
    rope_ctx *c = p;
    int64_t n = NTOK * c->nh * D;
    memcpy(c->y, c->x, (size_t)n * sizeof(double));
    mt_cpu_rope_forward_f64(B, T, c->nh, D, c->inv_freq, 1.0, c->y);
    return weighted_sum(c->wts, c->y, n);
}

static void check_rope(const mt_model_config *cfg, const char *label)
{
    char what[96];
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 14);
    double inv_freq[D / 2];
    mt_rope_inv_freq(cfg, T, inv_freq);
    const int64_t nh = H, n = NTOK * nh * D;
    rope_ctx c = {drandom(&rng, n, 1.0), drandom(&rng, n, 1.0), dalloc(n), inv_freq, nh};

    /* direct formula, element by element, rows r = b*T + t */
    double *ref = dalloc(n), *y = dcopy(c.x, n);
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int h = 0; h < nh; h++)
                for (int j = 0; j < D; j++) {
                    const double *xr = c.x + ((b * T + t) * nh + h) * D;
                    int pair = j % (D / 2);
                    double ang = t * inv_freq[pair];
                    ref[((b * T + t) * nh + h) * D + j] =
                        j < D / 2 ? xr[j] * cos(ang) - xr[j + D / 2] * sin(ang)
                                  : xr[j] * cos(ang) + xr[j - D / 2] * sin(ang);
                }
    mt_cpu_rope_forward_f64(B, T, nh, D, inv_freq, 1.0, y);
    snprintf(what, sizeof what, "rope%s forward vs formula", label);
    report(what, mt_test_rel_err_f64(y, ref, n), 1e-14);
    /* position 0 is the identity in every sequence */
    for (int b = 0; b < B; b++)
        ck_assert_int_eq(memcmp(y + b * T * nh * D, c.x + b * T * nh * D, nh * D * sizeof(double)), 0);

    double *back = dcopy(y, n);
    mt_cpu_rope_backward_f64(B, T, nh, D, inv_freq, 1.0, back);
    snprintf(what, sizeof what, "rope%s backward(forward(x)) vs x", label);
    report(what, mt_test_rel_err_f64(back, c.x, n), 1e-14);

    double *g = dcopy(c.wts, n);
    mt_cpu_rope_backward_f64(B, T, nh, D, inv_freq, 1.0, g);
    snprintf(what, sizeof what, "rope%s dx", label);
    check_grad(what, rope_objective, &c, c.x, n, g);

    float *x32 = to_f32(c.x, n);
    mt_cpu_rope_forward_f32(B, T, nh, D, inv_freq, 1.0, x32);
    snprintf(what, sizeof what, "rope%s f32 vs f64 forward", label);
    report(what, mixed_err(x32, y, n), MIXED_TOL);
    free(x32), free(g), free(back), free(ref), free(y), free(c.x), free(c.wts), free(c.y);
}

START_TEST(test_rope)
{
    mt_model_config cfg = {.head_dim = D, .rope_theta = 10000.0};
    check_rope(&cfg, "");
    /* Llama-3 scaled frequencies: the rotation code must not care where they came from */
    mt_model_config l3 = {.head_dim = D, .rope_theta = 500000.0, .rope_type = MT_ROPE_LLAMA3,
                          .rope_scaling_factor = 8.0, .rope_low_freq_factor = 1.0,
                          .rope_high_freq_factor = 4.0, .rope_original_max_positions = 8192};
    check_rope(&l3, " (llama3 freqs)");
}
END_TEST

START_TEST(test_rope_inv_freq)
{
    /* Llama-3.1-8B: theta 5e5, D 128, factor 8, low 1, high 4, original context 8192: pairs
     * 0..28 have wavelength < 2048 (kept), 29..34 lie in the smoothed band, 35..63 > 8192. */
    mt_model_config plain = {.head_dim = 128, .rope_theta = 500000.0};
    mt_model_config l3 = plain;
    l3.rope_type = MT_ROPE_LLAMA3, l3.rope_scaling_factor = 8.0, l3.rope_low_freq_factor = 1.0;
    l3.rope_high_freq_factor = 4.0;
    l3.rope_original_max_positions = 8192;
    double base[64], scaled[64];
    mt_rope_inv_freq(&plain, 1, base);
    mt_rope_inv_freq(&l3, 1, scaled);
    double worst = 0;
    for (int j = 0; j < 64; j++) {
        double expect = exp(-(2.0 * j / 128.0) * log(500000.0));
        worst = fmax(worst, fabs(base[j] - expect) / expect);
    }
    report("rope inv_freq theta^(-2j/D)", worst, 1e-14);
    ck_assert_double_eq(base[0], 1.0);
    int kept = 0, band = 0, stretched = 0;
    for (int j = 0; j < 64; j++) {
        double wavelen = 2 * M_PI / base[j];
        if (wavelen < 2048) {
            ck_assert_double_eq(scaled[j], base[j]);
            kept++;
        } else if (wavelen > 8192) {
            ck_assert_double_eq_tol(scaled[j], base[j] / 8, 1e-15 * base[j]);
            stretched++;
        } else {
            double smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0);
            ck_assert(smooth >= 0 && smooth <= 1);
            double expect = (1 - smooth) * base[j] / 8 + smooth * base[j];
            ck_assert_double_eq_tol(scaled[j], expect, 1e-14 * base[j]);
            ck_assert(scaled[j] < base[j] && scaled[j] > base[j] / 8);
            band++;
        }
        if (j > 0) ck_assert(scaled[j] < scaled[j - 1]); /* still monotone after scaling */
    }
    ck_assert_int_eq(kept, 29);
    ck_assert_int_eq(band, 6);
    ck_assert_int_eq(stretched, 29);
}
END_TEST

/* ---------- attention ---------- */

typedef struct {
    int64_t h, kv;
    double *q, *k, *v, *wts, *out, *lse;
} attn_ctx;

static double attn_objective(void *p)
{
    attn_ctx *c = p;
    mt_cpu_attention_forward_f64(B, T, c->h, c->kv, D, c->q, c->k, c->v, c->out, c->lse);
    return weighted_sum(c->wts, c->out, NTOK * c->h * D);
}

/* Naive reference: the full row of scores, max-subtracted softmax, in long double. */
static void attention_naive(int64_t nh, int64_t nkv, const double *q, const double *k,
                            const double *v, double *out, double *lse)
{
    const int64_t group = nh / nkv;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < nh; h++)
            for (int64_t t = 0; t < T; t++) {
                long double sc[T], mx = -INFINITY, z = 0;
                const double *qr = q + ((b * T + t) * nh + h) * D;
                for (int64_t s = 0; s <= t; s++) {
                    const double *ks = k + ((b * T + s) * nkv + h / group) * D;
                    long double dot = 0;
                    for (int d = 0; d < D; d++) dot += (long double)qr[d] * ks[d];
                    sc[s] = dot / sqrtl(D);
                    if (sc[s] > mx) mx = sc[s];
                }
                for (int64_t s = 0; s <= t; s++) z += expl(sc[s] - mx);
                for (int d = 0; d < D; d++) {
                    long double acc = 0;
                    for (int64_t s = 0; s <= t; s++)
                        acc += expl(sc[s] - mx) / z * v[((b * T + s) * nkv + h / group) * D + d];
                    out[((b * T + t) * nh + h) * D + d] = (double)acc;
                }
                lse[(b * nh + h) * T + t] = (double)(mx + logl(z));
            }
}

static void check_attention(int64_t nh, int64_t nkv, double qscale)
{
    char what[96];
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 15 + (uint64_t)nkv);
    const int64_t nq = NTOK * nh * D, nk = NTOK * nkv * D, nl = B * nh * T;
    attn_ctx c = {nh, nkv, drandom(&rng, nq, qscale), drandom(&rng, nk, 1.0),
                  drandom(&rng, nk, 1.0), drandom(&rng, nq, 1.0), dalloc(nq), dalloc(nl)};
    double *out = dalloc(nq), *lse = dalloc(nl), *ref = dalloc(nq), *lse_ref = dalloc(nl);
    fill_nan(out, nq);
    fill_nan(lse, nl);
    mt_cpu_attention_forward_f64(B, T, nh, nkv, D, c.q, c.k, c.v, out, lse);
    attention_naive(nh, nkv, c.q, c.k, c.v, ref, lse_ref);
    snprintf(what, sizeof what, "attention H%d KV%d q*%g forward vs naive", (int)nh, (int)nkv, qscale);
    report(what, mt_test_rel_err_f64(out, ref, nq), 1e-13);
    snprintf(what, sizeof what, "attention H%d KV%d q*%g lse vs naive", (int)nh, (int)nkv, qscale);
    report(what, mt_test_rel_err_f64(lse, lse_ref, nl), 1e-13);

    float *q32 = to_f32(c.q, nq), *k32 = to_f32(c.k, nk), *v32 = to_f32(c.v, nk);
    float *o32 = falloc(nq), *l32 = falloc(nl);
    mt_cpu_attention_forward_f32(B, T, nh, nkv, D, q32, k32, v32, o32, l32);
    snprintf(what, sizeof what, "attention H%d KV%d q*%g f32 vs f64 out", (int)nh, (int)nkv, qscale);
    report(what, mixed_err(o32, out, nq), MIXED_TOL);
    snprintf(what, sizeof what, "attention H%d KV%d q*%g f32 vs f64 lse", (int)nh, (int)nkv, qscale);
    report(what, mixed_err(l32, lse, nl), MIXED_TOL);
    free(q32), free(k32), free(v32), free(o32), free(l32);

    if (qscale <= 1.0) { /* gradients where finite differences are well conditioned */
        double *dq = dalloc(nq), *dk = dalloc(nk), *dv = dalloc(nk);
        fill_nan(dq, nq), fill_nan(dk, nk), fill_nan(dv, nk); /* all three are = outputs */
        mt_cpu_attention_backward_f64(B, T, nh, nkv, D, c.q, c.k, c.v, out, lse, c.wts, dq, dk, dv);
        snprintf(what, sizeof what, "attention H%d KV%d dq (=)", (int)nh, (int)nkv);
        check_grad(what, attn_objective, &c, c.q, nq, dq);
        snprintf(what, sizeof what, "attention H%d KV%d dk (=)", (int)nh, (int)nkv);
        check_grad(what, attn_objective, &c, c.k, nk, dk);
        snprintf(what, sizeof what, "attention H%d KV%d dv (=)", (int)nh, (int)nkv);
        check_grad(what, attn_objective, &c, c.v, nk, dv);
        free(dq), free(dk), free(dv);
    }
    free(out), free(lse), free(ref), free(lse_ref);
    free(c.q), free(c.k), free(c.v), free(c.wts), free(c.out), free(c.lse);
}

START_TEST(test_attention_gqa) { check_attention(H, KV, 1.0); }
END_TEST

START_TEST(test_attention_mha_mqa)
{
    check_attention(H, H, 1.0); /* one kv head per query head */
    check_attention(H, 1, 1.0); /* all query heads share one kv head */
}
END_TEST

/* Scores of magnitude ~100: the running max must keep exp from overflowing. */
START_TEST(test_attention_large_scores) { check_attention(H, KV, 30.0); }
END_TEST

/* ---------- swiglu ---------- */

typedef struct { double *gate, *up, *wts, *out; } swiglu_ctx;

static double swiglu_objective(void *p)
{
    swiglu_ctx *c = p;
    mt_cpu_swiglu_forward_f64(NTOK, I, c->gate, c->up, c->out);
    return weighted_sum(c->wts, c->out, NTOK * I);
}

START_TEST(test_swiglu)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 16);
    const int64_t n = NTOK * I;
    swiglu_ctx c = {drandom(&rng, n, 2.0), drandom(&rng, n, 1.0), drandom(&rng, n, 1.0), dalloc(n)};
    double *out = dalloc(n), *ref = dalloc(n);
    for (int64_t i = 0; i < n; i++) ref[i] = c.gate[i] / (1 + exp(-c.gate[i])) * c.up[i];
    mt_cpu_swiglu_forward_f64(NTOK, I, c.gate, c.up, out);
    report("swiglu forward vs formula", mt_test_rel_err_f64(out, ref, n), 1e-14);

    double *dg = dalloc(n), *du = dalloc(n);
    fill_nan(dg, n), fill_nan(du, n);
    mt_cpu_swiglu_backward_f64(NTOK, I, c.gate, c.up, c.wts, dg, du);
    check_grad("swiglu dgate (=)", swiglu_objective, &c, c.gate, n, dg);
    check_grad("swiglu dup (=)", swiglu_objective, &c, c.up, n, du);

    float *g32 = to_f32(c.gate, n), *u32 = to_f32(c.up, n), *o32 = falloc(n);
    mt_cpu_swiglu_forward_f32(NTOK, I, g32, u32, o32);
    report("swiglu f32 vs f64 forward", mixed_err(o32, out, n), MIXED_TOL);

    /* saturated gates: silu(-100) ~ 0, silu(100) = 100, gradients finite (no inf * 0) */
    float gx[4] = {-100.f, 100.f, -1000.f, 1000.f}, ux[4] = {2.f, 2.f, 2.f, 2.f}, ox[4];
    float dox[4] = {1.f, 1.f, 1.f, 1.f}, dgx[4], dux[4];
    mt_cpu_swiglu_forward_f32(1, 4, gx, ux, ox);
    mt_cpu_swiglu_backward_f32(1, 4, gx, ux, dox, dgx, dux);
    ck_assert_float_eq_tol(ox[0], 0.f, 1e-30f);
    ck_assert_float_eq_tol(ox[1], 200.f, 1e-4f);
    ck_assert_float_eq_tol(ox[3], 2000.f, 1e-3f);
    for (int i = 0; i < 4; i++) ck_assert(isfinite(ox[i]) && isfinite(dgx[i]) && isfinite(dux[i]));
    ck_assert_float_eq_tol(dgx[1], 2.f, 1e-5f); /* d silu/dg -> 1 for large g, times up = 2 */
    ck_assert_float_eq_tol(dgx[2], 0.f, 1e-30f);
    free(g32), free(u32), free(o32), free(dg), free(du), free(out), free(ref);
    free(c.gate), free(c.up), free(c.wts), free(c.out);
}
END_TEST

/* ---------- elementwise ---------- */

START_TEST(test_elementwise)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 17);
    const int64_t n = 1003;
    double *x = drandom(&rng, n, 1.0), *y0 = drandom(&rng, n, 1.0), *y = dcopy(y0, n);
    mt_cpu_add_f64(n, x, y);
    for (int64_t i = 0; i < n; i++) ck_assert_double_eq(y[i], y0[i] + x[i]);
    float *x32 = to_f32(x, n), *y32 = to_f32(y0, n);
    mt_cpu_add_f32(n, x32, y32);
    for (int64_t i = 0; i < n; i++) ck_assert_float_eq(y32[i], (float)y0[i] + x32[i]);

    /* 1e6 values of 1.1 in float: a float accumulator drifts by ~1e-3 relative (its ulp at 1e6
     * is 0.06), a double one stays within n * 2^-53 of the exact sum */
    const int64_t big = 1000003;
    float *ones = falloc(big);
    for (int64_t i = 0; i < big; i++) ones[i] = 1.1f;
    double exact = (double)big * ((double)1.1f * (double)1.1f);
    double got = mt_cpu_sumsq_f32(big, ones);
    report("sumsq f32 (double accumulation)", fabs(got - exact) / exact, 1e-9);
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += x[i] * x[i];
    report("sumsq f64", fabs(mt_cpu_sumsq_f64(n, x) - s) / s, 1e-14);
    free(ones), free(x), free(y0), free(y), free(x32), free(y32);
}
END_TEST

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
    double *p = drandom(&rng, ADAM_N, 1.0), *m = dalloc(ADAM_N), *v = dalloc(ADAM_N);
    double *grads = drandom(&rng, ADAM_N * ADAM_STEPS, 1.0);
    for (int s = 0; s < ADAM_STEPS; s++) grads[s * ADAM_N] = 0; /* element 0 only decays */
    float *p32 = NULL, *m32 = NULL, *v32 = NULL, *g32 = NULL;
    double *pk = NULL, *mk = NULL, *vk = NULL;
    if (single) {
        p32 = to_f32(p, ADAM_N), m32 = falloc(ADAM_N), v32 = falloc(ADAM_N);
        g32 = to_f32(grads, ADAM_N * ADAM_STEPS);
        /* the reference starts from exactly the float values the kernel sees */
        free(p), p = to_f64(p32, ADAM_N);
        free(grads), grads = to_f64(g32, ADAM_N * ADAM_STEPS);
    } else {
        pk = dcopy(p, ADAM_N), mk = dalloc(ADAM_N), vk = dalloc(ADAM_N);
    }
    double *p0 = dcopy(p, ADAM_N);
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
        report("adamw f32 master vs reference", mixed_err(p32, p, ADAM_N), tol);
        report("adamw f32 m vs reference", mixed_err(m32, m, ADAM_N), tol);
        report("adamw f32 v vs reference", mixed_err(v32, v, ADAM_N), tol);
        /* zero gradient: only the decay, (1 - lr_s wd) over the five steps */
        double decay = 1;
        for (int s = 1; s <= ADAM_STEPS; s++) decay *= 1 - adam_base.lr * (1 - 0.1 * s) * 0.1;
        ck_assert_double_eq_tol(p32[0], p[0], 1e-6 * fabs(p[0]));
        ck_assert_double_eq_tol(p[0], p0[0] * decay, 1e-14);
    } else {
        report("adamw f64 master vs reference", mt_test_rel_err_f64(pk, p, ADAM_N), tol);
        report("adamw f64 m vs reference", mt_test_rel_err_f64(mk, m, ADAM_N), tol);
        report("adamw f64 v vs reference", mt_test_rel_err_f64(vk, v, ADAM_N), tol);
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

/* The confirm's redo (mt_cpu_ranged_redo) after a ranged pass gives, for a scale inside the
 * range, every element's weight bit for bit as the kernel at that scale: the flagged ones from
 * the side entries the pass kept (and, past their room, from the arrays), the rest as the pass
 * left them. Then as the table's embedding backward does: a range of elements gets a changed
 * gradient and mt_ranged_flags_mark; their side entries must not be used. Flag rates of ~2%
 * (entries for all) and ~20% (room for some only), flags buffers with room for 1/side_room of
 * the chunk. */
static void ranged_redo_check(int side_room)
{
    enum { N = 100003 };
    const int64_t room = N / side_room + 16; /* backends/cpu/ranged_flags.h, mt_ranged_side_capacity */
    const size_t fb = sizeof(float) * N;
    float *p = malloc(fb), *g = malloc(fb), *m = malloc(fb), *v = malloc(fb), *out = malloc(fb);
    mt_bf16 *w = malloc(sizeof(mt_bf16) * N), *wk = malloc(sizeof(mt_bf16) * N);
    void *flags = malloc(mt_ranged_flags_bytes(N, side_room));
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 43);
    const double lrs[2] = { 3e-4, 1e-2 };
    for (int l = 0; l < 2; l++) {
        for (int i = 0; i < N; i++) {
            p[i] = (float)(0.01 * (mt_test_uniform(&rng) - 0.5));
            g[i] = (float)(2e-3 * (mt_test_uniform(&rng) - 0.5));
            m[i] = (float)(1e-3 * (mt_test_uniform(&rng) - 0.5));
            v[i] = (float)(1e-6 * (0.1 + mt_test_uniform(&rng)));
        }
        mt_adamw_params a = adam_base;
        a.lr = lrs[l];
        a.step = 10;
        a.grad_scale = 0.26;
        a.grad_scale_lo = 0.24;
        mt_ranged_flags_reset(flags, N, side_room);
        int64_t flagged = 0;
        for (int64_t o = 0; o < N; o += 5000) /* in pieces, as the table's rows are */
            flagged += mt_cpu_ranged_pass(o, N - o < 5000 ? N - o : 5000, p, g, m, v, w, MT_DTYPE_BF16, &a,
                                          MT_RANGED_BOUNDS_DEFAULT, flags);
        for (int pass = 0; pass < 2; pass++) {
            if (pass == 1) {
                /* the table's touched rows: a new gradient, flagged whole, entries stale */
                for (int i = 30011; i < 30011 + 4099; i++) g[i] += (float)(1e-3 * (mt_test_uniform(&rng) - 0.5));
                mt_ranged_flags_mark(flags, 30011, 4099);
                /* and single flagged elements (their words stay sparse, so their entries would be
                 * read if not stale) */
                const uint64_t *bits = mt_ranged_bits_of(flags);
                int changed = 0;
                for (int i = 40000; i < N && changed < 300; i++)
                    if ((bits[i / 64] >> (i % 64)) & 1 && __builtin_popcountll(bits[i / 64]) < 8) {
                        g[i] = -2.0f * g[i] + 1e-4f;
                        mt_ranged_flags_mark(flags, i, 1);
                        changed++;
                    }
                ck_assert_int_gt(changed, 0);
            }
            mt_adamw_params at = a;
            at.grad_scale = 0.2537;
            at.grad_scale_lo = 0;
            mt_bf16 *wr = malloc(sizeof(mt_bf16) * N);
            memcpy(wr, w, sizeof(mt_bf16) * N);
            mt_ranged_redo_counts rc = { 0 };
            mt_cpu_ranged_redo(N, flags, p, g, m, v, wr, &at, &rc);
            if (pass == 0) {
                /* as passed: every flagged element from its side entry while they have room (at
                 * 1/16: all at lr 3e-4, 2% flagged; at lr 1e-2, 27%, the rest from the arrays) */
                ck_assert_int_eq(rc.side + rc.arrays, flagged);
                if (flagged <= room) ck_assert_int_eq(rc.arrays, 0);
                else ck_assert_int_gt(rc.arrays, 0);
                if (side_room == 16) ck_assert(l == 0 ? flagged <= room : flagged > room);
            }
            mt_cpu_adamw_params_f32(N, p, g, m, v, out, &at);
            mt_f32_to_bf16(N, out, wk);
            int bad = -1;
            for (int i = 0; i < N && bad < 0; i++)
                if (wr[i] != wk[i]) bad = i;
            free(wr);
            ck_assert_msg(bad < 0, "lr %g, %s: element %d after the redo differs from the kernel at the scale", lrs[l],
                          pass ? "rows changed" : "as passed", bad);
        }
        printf("ranged redo, lr %g: %.2f%% flagged\n", lrs[l], 100.0 * (double)flagged / N);
        ck_assert(flagged > 0 && flagged < N);
    }
    free(p); free(g); free(m); free(v); free(out); free(w); free(wk); free(flags);
}

START_TEST(test_ranged_redo_exact) { ranged_redo_check(MT_RANGED_SIDE_ROOM_DEFAULT); }
END_TEST

/* A side room of 3 (mt_step_config.ranged_side_room): flags buffers sized for 1/3 of a chunk,
 * and the redo at 27% flagged then takes every input from the side entries, bit for bit as
 * before. */
START_TEST(test_ranged_side_room)
{
    const int64_t n = 100003, words = (n + 63) / 64;
    ck_assert_uint_eq(mt_ranged_flags_bytes(n, 3), 24 + 8 * words + 20 * (n / 3 + 16));
    ranged_redo_check(3);
}
END_TEST

/* The deferred pass (mt_cpu_ranged_pass_deferred: the last step's moments half and this step's
 * ranged run, fused into one loop where the bounds are AVX2's or AVX-512's) against the two
 * apart (mt_cpu_adamw_f32, then mt_cpu_ranged_pass), for each kind of bounds: master, m
 * and v bit for bit, the same flags, the same weights for the unflagged elements. A length that
 * is not a multiple of 16, so the loops' tails run too. */
START_TEST(test_ranged_deferred_fused)
{
    enum { N = 50021 };
    const size_t fb = sizeof(float) * N;
    float *p0 = malloc(fb), *g = malloc(fb), *old = malloc(fb), *m0 = malloc(fb), *v0 = malloc(fb);
    float *p = malloc(fb), *m = malloc(fb), *v = malloc(fb), *pr = malloc(fb), *mr = malloc(fb), *vr = malloc(fb);
    mt_bf16 *w = malloc(sizeof(mt_bf16) * N), *wr = malloc(sizeof(mt_bf16) * N);
    const size_t flag_bytes = mt_ranged_flags_bytes(N, MT_RANGED_SIDE_ROOM_DEFAULT);
    void *flags = malloc(flag_bytes), *fref = malloc(flag_bytes);
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 47);
    for (int i = 0; i < N; i++) {
        p0[i] = (float)(0.01 * (mt_test_uniform(&rng) - 0.5));
        g[i] = (float)(2e-3 * (mt_test_uniform(&rng) - 0.5));
        old[i] = (float)(2e-3 * (mt_test_uniform(&rng) - 0.5));
        m0[i] = (float)(1e-3 * (mt_test_uniform(&rng) - 0.5));
        v0[i] = (float)(1e-6 * (0.1 + mt_test_uniform(&rng)));
    }
    old[17] = 0.0f; /* a zero gradient and a zero moment: sqrt(0) in the moments half */
    v0[17] = 0.0f;
    mt_adamw_params a = adam_base, po = adam_base;
    a.lr = 1e-3;
    a.step = 11;
    a.grad_scale = 0.26;
    a.grad_scale_lo = 0.24;
    po.lr = 1e-3;
    po.step = 10;
    po.grad_scale = 0.2513;
    for (int k = 0; k < 3; k++) {
        const mt_ranged_bounds bounds = (mt_ranged_bounds)k;
        memcpy(pr, p0, fb); memcpy(mr, m0, fb); memcpy(vr, v0, fb);
        mt_cpu_adamw_f32(N, pr, old, mr, vr, &po);
        mt_ranged_flags_reset(fref, N, MT_RANGED_SIDE_ROOM_DEFAULT);
        const int64_t nref = mt_cpu_ranged_pass(0, N, pr, g, mr, vr, wr, MT_DTYPE_BF16, &a, bounds, fref);
        memcpy(p, p0, fb); memcpy(m, m0, fb); memcpy(v, v0, fb);
        mt_ranged_flags_reset(flags, N, MT_RANGED_SIDE_ROOM_DEFAULT);
        mt_cpu_ranged_pass_deferred(0, N, p, old, g, m, v, w, MT_DTYPE_BF16, &po, &a, bounds, flags);
        ck_assert_msg(!memcmp(p, pr, fb) && !memcmp(m, mr, fb) && !memcmp(v, vr, fb),
                      "bounds %s: the deferred pass's master, m or v differ from the moments half's",
                      mt_ranged_bounds_option(bounds));
        const uint64_t *bits = mt_ranged_bits_of(flags), *rbits = mt_ranged_bits_of(fref);
        ck_assert_msg(!memcmp(bits, rbits, (N + 63) / 64 * sizeof(uint64_t)), "bounds %s: flags differ",
                      mt_ranged_bounds_option(bounds));
        int bad = -1;
        for (int i = 0; i < N && bad < 0; i++)
            if (!((bits[i / 64] >> (i % 64)) & 1) && w[i] != wr[i]) bad = i;
        ck_assert_msg(bad < 0, "bounds %s: weight %d differs", mt_ranged_bounds_option(bounds), bad);
        ck_assert(nref > 0 && nref < N);
        /* In pieces, as the table's early path runs it row by row: rows of 2048 (the vector
         * loops, the same flags) and of 997 (pieces off the 8-element grid take the exact
         * bounds, which flag fewer); the same master, m and v, and what it returns is what it
         * flagged. */
        const int pieces[2] = { 2048, 997 };
        for (int q = 0; q < 2; q++) {
            memcpy(p, p0, fb); memcpy(m, m0, fb); memcpy(v, v0, fb);
            mt_ranged_flags_reset(flags, N, MT_RANGED_SIDE_ROOM_DEFAULT);
            int64_t nret = 0;
            for (int64_t o = 0; o < N; o += pieces[q])
                nret += mt_cpu_ranged_pass_deferred(o, N - o < pieces[q] ? N - o : pieces[q], p, old, g, m, v, w,
                                                    MT_DTYPE_BF16, &po, &a, bounds, flags);
            ck_assert_msg(!memcmp(p, pr, fb) && !memcmp(m, mr, fb) && !memcmp(v, vr, fb),
                          "bounds %s, pieces of %d: master, m or v differ", mt_ranged_bounds_option(bounds), pieces[q]);
            int64_t set = 0;
            for (int64_t wi = 0; wi < (N + 63) / 64; wi++) set += __builtin_popcountll(bits[wi]);
            ck_assert_int_eq(nret, set);
            if (pieces[q] == 2048) ck_assert(!memcmp(bits, rbits, (N + 63) / 64 * sizeof(uint64_t)));
            for (int i = 0; i < N && bad < 0; i++)
                if (!((bits[i / 64] >> (i % 64)) & 1) && !((rbits[i / 64] >> (i % 64)) & 1) && w[i] != wr[i]) bad = i;
            ck_assert_msg(bad < 0, "bounds %s, pieces of %d: weight %d differs",
                          mt_ranged_bounds_option(bounds), pieces[q], bad);
        }
        /* without flags: the moments half only, on [o, o + n) */
        memcpy(p, p0, fb); memcpy(m, m0, fb); memcpy(v, v0, fb);
        ck_assert_int_eq(mt_cpu_ranged_pass_deferred(0, 1000, p, old, g, m, v, w, MT_DTYPE_BF16, &po, &a, bounds, NULL), 0);
        ck_assert_int_eq(mt_cpu_ranged_pass_deferred(1000, N - 1000, p, old, g, m, v, w, MT_DTYPE_BF16, &po, &a, bounds, NULL),
                         0);
        ck_assert(!memcmp(p, pr, fb) && !memcmp(m, mr, fb) && !memcmp(v, vr, fb));
    }
    free(p0); free(g); free(old); free(m0); free(v0); free(p); free(m); free(v); free(pr); free(mr); free(vr);
    free(w); free(wr); free(flags); free(fref);
}
END_TEST

/* The norm history's two records (runtime/speculate/history.h) for T tiles, holding no norm. */
static void records_open(void *rec[2], int T, double spread, double grow, int memory)
{
    const mt_norm_settings ns = { .spread = spread, .grow = grow, .memory = memory };
    for (int k = 0; k < 2; k++) {
        rec[k] = malloc(mt_norm_record_bytes(T));
        mt_norm_record_init(rec[k], T, &ns);
    }
}

/* Norm s recorded as the clip task does: from record (s - 1) % 2 into record s % 2, sums (T
 * tiles, then the table's head part), clip 1. */
static void record_norm(void *rec[2], int64_t s, const double *sums, int T)
{
    mt_norm_record(rec[(s - 1) % 2], rec[s % 2], s, 1.0, sums, T, sums[T], NULL);
}

/* A ranged run's arguments as the graph gives them, clip 1. */
static mt_ranged_args ranged_run(int64_t seq, int first_tile, bool check, double max_ratio)
{
    return (mt_ranged_args){ .range = mt_norm_range, .seq = seq, .first_tile = first_tile, .check = check,
                             .clip = 1.0, .max_ratio = max_ratio, .side_room = MT_RANGED_SIDE_ROOM_DEFAULT,
                             .bounds = MT_RANGED_BOUNDS_DEFAULT };
}

/* Ranged speculation's check of its last prediction (mt_norm_record's held, mt_ranged_args.
 * check): a tile whose range, predicted for the last norm from the one before, missed that norm
 * is not speculated at the next (counted as unheld); one whose range held is; with the check
 * off, both are. Four tiles; norm 2 scales every tile alike (every prediction exact), norm 3
 * doubles tile 0 and triples tile 1 (the prediction holds for tiles 0 and 1 only: for tile 1
 * the known tiles doubled, as tile 0 did). */
START_TEST(test_ranged_held)
{
    enum { T = 4, N = 1000 };
    double s1[T + 1] = { 4, 3, 2, 1, 0 }, s2[T + 1], s3[T + 1] = { 12, 13.5, 3, 1.5, 0 };
    for (int j = 0; j <= T; j++) s2[j] = 1.5 * s1[j];
    void *rec[2];
    records_open(rec, T, 1.1, 0, 0);
    const double *norms[3] = { s1, s2, s3 };
    for (int s = 1; s <= 3; s++) {
        record_norm(rec, s, norms[s - 1], T);
        ck_assert_int_eq(mt_norm_record_seq(rec[s % 2]), s);
        const uint8_t *held = mt_norm_record_held(rec[s % 2]);
        for (int f = 0; f < T; f++) {
            const int expect = s < 3 || f <= 1;
            ck_assert_msg(held[f] == expect, "norm %d, tile %d: held %d", s, f, held[f]);
        }
    }
    /* the ranged runs of norm 4: tiles 3 and 1, as when their gradients are in (norm 4 as 3) */
    void *flags = malloc(mt_ranged_flags_bytes(N, MT_RANGED_SIDE_ROOM_DEFAULT));
    mt_adamw_stats stats = { 0 };
    for (int check = 1; check >= 0; check--) {
        for (int f = 3; f >= 1; f -= 2) {
            double known = 0;
            for (int j = f; j < T; j++) known += s3[j];
            const mt_ranged_args a = ranged_run(4, f, check, 1.25);
            mt_adamw_params p = adam_base;
            p.grad_scale = 1;
            const mt_ranged_counts c0 = mt_adamw_stats_ranged(&stats);
            const bool spec = mt_codelet_ranged_begin(flags, N, (const double[2]){ known, 0 }, rec[1], &a, &p, &stats);
            const mt_ranged_counts c1 = mt_adamw_stats_ranged(&stats);
            const bool expect = !check || f == 1;
            ck_assert_msg(spec == expect, "check %d, tile %d: speculated %d", check, f, spec);
            ck_assert_int_eq(c1.unheld - c0.unheld, expect ? 0 : N);
            ck_assert_int_eq(c1.skipped - c0.skipped, expect ? 0 : N);
            ck_assert_int_eq(c1.checked - c0.checked, expect ? N : 0);
        }
    }
    free(flags);
    free(rec[0]);
    free(rec[1]);
}
END_TEST

/* The spread grows after a norm the prediction missed (mt_norm_settings.grow): norm 2's embedding
 * doubled while the layers stayed, so its rest came 2 times off for tile 1 (1.57 and 1.44 for
 * tiles 2 and 3); the runs of norm 3 then take 1.1 x 2 (grow 3), 2 (grow 2, the cap), or 1.1
 * (grow 1: fixed). With 2.2, norm 3 (its embedding 1.8 times norm 2's) holds for tile 1, which
 * it does not with 1.1; a run's range is the prediction's rest over and times 2.2, and is still
 * speculated though 2.07 times wide (max_ratio 1.25 grows with the spread, to 2.5). */
START_TEST(test_ranged_spread_grows)
{
    enum { T = 4, N = 256 };
    const double s1[T + 1] = { 4, 3, 2, 1, 0 }, s2[T + 1] = { 8, 3, 2, 1, 0 }, s3[T + 1] = { 14.4, 3, 2, 1, 0 };
    const double grows[3] = { 3, 2, 1 }, expect_spread[3] = { 2.2, 2, 1.1 };
    void *flags = malloc(mt_ranged_flags_bytes(N, MT_RANGED_SIDE_ROOM_DEFAULT));
    mt_adamw_stats stats = { 0 };
    for (int k = 0; k < 3; k++) {
        void *rec[2];
        records_open(rec, T, 1.1, grows[k], 0);
        record_norm(rec, 1, s1, T);
        ck_assert_double_eq_tol(mt_norm_record_next_spread(rec[1]), 1.1, 1e-12); /* no prediction to judge yet */
        record_norm(rec, 2, s2, T);
        ck_assert_double_eq_tol(mt_norm_record_next_spread(rec[0]), expect_spread[k], 1e-12);
        /* the run of tile 3 for norm 3, its own sum in (its range for norm 2 missed: unchecked) */
        const mt_ranged_args a = ranged_run(3, 3, false, 1.25);
        mt_adamw_params p = adam_base;
        p.grad_scale = 1;
        ck_assert(mt_codelet_ranged_begin(flags, N, (const double[2]){ s3[3], 0 }, rec[0], &a, &p, &stats));
        const double rest = (s2[0] + s2[1] + s2[2]) * (s3[3] / s2[3]), F = expect_spread[k];
        ck_assert_double_eq_tol(p.grad_scale, 1 / (sqrt(s3[3] + rest / F) + 1e-6) * (1 + 1e-6), 1e-12);
        ck_assert_double_eq_tol(p.grad_scale_lo, 1 / (sqrt(s3[3] + rest * F) + 1e-6) * (1 - 1e-6), 1e-12);
        record_norm(rec, 3, s3, T);
        const uint8_t *held = mt_norm_record_held(rec[1]);
        ck_assert_msg(held[1] == (k < 2), "grow %g: tile 1 held %d", grows[k], held[1]);
        free(rec[0]);
        free(rec[1]);
    }
    free(flags);
}
END_TEST

/* The spread remembers the largest error of the last `memory` norms (mt_norm_settings.memory):
 * norm 2's embedding doubled (tile 1's rest 2 times off, as in test_ranged_spread_grows), norms
 * 3, 4 and 5 repeat norm 2 (each prediction exact). The spread after norm 3 is 1.1 x 2 with a
 * memory of 2 or more, back to 1.1 with a memory of 1; after norm 4 still 2.2 with a memory of
 * 3; after norm 5 back to 1.1 with every memory below 4. */
START_TEST(test_ranged_spread_remembers)
{
    enum { T = 4 };
    const double s1[T + 1] = { 4, 3, 2, 1, 0 }, s2[T + 1] = { 8, 3, 2, 1, 0 };
    const int memories[4] = { 1, 2, 3, 0 }; /* 0: as 1 */
    const double after[4][3] = { { 1.1, 1.1, 1.1 }, { 2.2, 1.1, 1.1 }, { 2.2, 2.2, 1.1 }, { 1.1, 1.1, 1.1 } };
    for (int k = 0; k < 4; k++) {
        void *rec[2];
        records_open(rec, T, 1.1, 3, memories[k]);
        record_norm(rec, 1, s1, T);
        record_norm(rec, 2, s2, T);
        ck_assert_double_eq_tol(mt_norm_record_next_spread(rec[0]), 2.2, 1e-12);
        for (int s = 3; s <= 5; s++) {
            record_norm(rec, s, s2, T);
            const double spread = mt_norm_record_next_spread(rec[s % 2]);
            ck_assert_msg(fabs(spread - after[k][s - 3]) < 1e-12, "memory %d, after norm %d: spread %g, not %g",
                          memories[k], s, spread, after[k][s - 3]);
            const uint8_t *held = mt_norm_record_held(rec[s % 2]);
            for (int f = 0; f < T; f++) ck_assert(held[f]); /* exact predictions hold at any spread */
        }
        free(rec[0]);
        free(rec[1]);
    }
}
END_TEST

/* The soundness of ranged speculation's flags (backends/cpu/ranged.h, mt_cpu_ranged_pass), which
 * the exactness of `--clip-speculate ranged` rests on: for every element it leaves unflagged,
 * the weights half's bf16 result is the same for every clip scale in the range. Checked against
 * the kernel itself at 33 scales across the range (both ends, evenly spaced, and random ones), on
 * 2^18 elements of random magnitudes (weights 1e-4..1, gradients 1e-7..1e-1, moments to match,
 * some zero), at three learning rates (few, some and most weights moving across a bf16 step),
 * early and late steps, two ranges. Also that a useful share is left unflagged. */
/* test_ranged_flags_sound's loop 0 checks the AVX2 bounds (approximate reciprocals where the CPU
 * has them), loop 1 the AVX-512 ones (the default where it has them), loop 2 the exact ones
 * (each loop prints which ran). */
START_TEST(test_ranged_flags_sound)
{
    static const mt_ranged_bounds modes[3] = { MT_RANGED_BOUNDS_AVX2, MT_RANGED_BOUNDS_AVX512, MT_RANGED_BOUNDS_EXACT };
    enum { N = 1 << 18, NP = N - 5, SCALES = 33 };
    const mt_ranged_bounds bounds = modes[_i];
    const char *used = mt_ranged_bounds_name(bounds);
    const size_t fb = sizeof(float) * N;
    float *p = malloc(fb), *g = malloc(fb), *m = malloc(fb), *v = malloc(fb), *out = malloc(fb);
    mt_bf16 *w = malloc(sizeof(mt_bf16) * N), *wk = malloc(sizeof(mt_bf16) * N);
    const size_t flag_bytes = mt_ranged_flags_bytes(N, MT_RANGED_SIDE_ROOM_DEFAULT), words = (N + 63) / 64;
    void *flags = malloc(flag_bytes);
    const uint64_t *bits = mt_ranged_bits_of(flags);
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 41);
    for (int i = 0; i < N; i++) {
        p[i] = (float)(mt_test_normal(&rng) * pow(10.0, -4.0 * mt_test_uniform(&rng)));
        const double gs = pow(10.0, -7.0 + 6.0 * mt_test_uniform(&rng));
        g[i] = (float)(mt_test_normal(&rng) * gs);
        m[i] = (float)(mt_test_normal(&rng) * gs * 0.5);
        v[i] = (float)(gs * gs * (0.1 + mt_test_uniform(&rng)));
        if (i % 97 == 0) g[i] = 0;
        if (i % 101 == 0) m[i] = v[i] = 0;
    }
    const double lrs[3] = { 1e-5, 1e-3, 3e-2 }, ranges[3][2] = { { 0.24, 0.26 }, { 0.9, 1.0 }, { 0.2, 0.28 } };
    const int64_t steps[2] = { 1, 40 };
    for (int l = 0; l < 3; l++)
        for (int r = 0; r < 3; r++)
            for (int st = 0; st < 2; st++) {
                mt_adamw_params a = adam_base;
                a.lr = lrs[l];
                a.step = steps[st];
                a.grad_scale = ranges[r][1];
                a.grad_scale_lo = ranges[r][0];
                /* NP elements: the last block ends in 11 past the 16-lane loop (8 of them in 8
                 * lanes, 3 in C), 3 past the 8-lane one */
                mt_ranged_flags_reset(flags, NP, MT_RANGED_SIDE_ROOM_DEFAULT);
                mt_cpu_ranged_pass(0, NP, p, g, m, v, w, MT_DTYPE_BF16, &a, bounds, flags);
                int64_t flagged = 0;
                for (size_t k = 0; k < words; k++) flagged += __builtin_popcountll(bits[k]);
                for (int k = 0; k < SCALES; k++) {
                    const float cl = (float)ranges[r][0], ch = (float)ranges[r][1];
                    float c = k == 0 ? cl : k == 1 ? ch : k < 17 ? cl + (ch - cl) * (float)(k - 1) / 16.0f
                                                              : cl + (ch - cl) * (float)mt_test_uniform(&rng);
                    if (c > ch) c = ch;
                    mt_adamw_params ak = a;
                    ak.grad_scale = c;
                    ak.grad_scale_lo = 0;
                    mt_cpu_adamw_params_f32(N, p, g, m, v, out, &ak);
                    mt_f32_to_bf16(N, out, wk);
                    /* the flagged elements' weights are the redo's to write: nothing is checked of
                     * them here (the vector loops leave whatever their bounds rounded to) */
                    for (int i = 0; i < NP; i++) {
                        if (((bits[i / 64] >> (i % 64)) & 1) || wk[i] == w[i]) continue; /* ck_assert per element is a syscall */
                        ck_assert_msg(false,
                                      "lr %g, range [%g, %g], step %lld: element %d unflagged but its bf16 weight "
                                      "at scale %.9g is 0x%04x, not 0x%04x (p %.9g g %.9g m %.9g v %.9g)",
                                      lrs[l], cl, ch, (long long)a.step, i, (double)c, wk[i], w[i], (double)p[i],
                                      (double)g[i], (double)m[i], (double)v[i]);
                    }
                }
                /* the bound is not trivially "flag everything": at the smallest rate most stay */
                if (l == 0) ck_assert_msg(flagged < N / 4, "lr %g: %lld of %d flagged", lrs[l], (long long)flagged, N);
                printf("ranged flags (%s bounds), lr %g, range [%g, %g], step %lld: %.2f%% flagged\n", used,
                       lrs[l], ranges[r][0], ranges[r][1], (long long)a.step, 100.0 * (double)flagged / N);
            }
    free(p); free(g); free(m); free(v); free(out); free(w); free(wk); free(flags);
}
END_TEST

/* A ranged pass over pieces of a chunk sets the same bits as one pass over all of it, for each
 * kind of bounds: pieces that start on a byte of the bitmap but not a word (the byte path's
 * partial words), off a byte (the int path), and end mid-byte. Each element's flag depends on
 * its own inputs only, so any split must agree; so must the weights of the unflagged ones (the
 * flagged ones' are the redo's to write). */
START_TEST(test_ranged_pieces)
{
    enum { N = 3 * 4096 + 77 };
    static const mt_ranged_bounds modes[3] = { MT_RANGED_BOUNDS_AVX2, MT_RANGED_BOUNDS_AVX512, MT_RANGED_BOUNDS_EXACT };
    static const int64_t cuts[][4] = { { 0, 8, 4104, N }, { 0, 5, 4101, N }, { 0, 24, 8211, N }, { 0, 4096, 8192, N } };
    float *p = malloc(sizeof(float) * N), *g = malloc(sizeof(float) * N), *m = malloc(sizeof(float) * N),
          *v = malloc(sizeof(float) * N);
    mt_bf16 *w = malloc(sizeof(mt_bf16) * N), *w1 = malloc(sizeof(mt_bf16) * N);
    const size_t flag_bytes = mt_ranged_flags_bytes(N, MT_RANGED_SIDE_ROOM_DEFAULT);
    void *whole = malloc(flag_bytes), *pieces = malloc(flag_bytes);
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 43);
    for (int i = 0; i < N; i++) {
        p[i] = (float)(0.02 * mt_test_normal(&rng));
        g[i] = (float)(1e-3 * mt_test_normal(&rng));
        m[i] = (float)(5e-4 * mt_test_normal(&rng));
        v[i] = (float)(1e-6 * (0.1 + mt_test_uniform(&rng)));
    }
    mt_adamw_params a = adam_base;
    a.lr = 1e-3;
    a.step = 7;
    a.grad_scale = 0.3;
    a.grad_scale_lo = 0.24;
    for (int b = 0; b < 3; b++) {
        const char *name = mt_ranged_bounds_name(modes[b]);
        mt_ranged_flags_reset(whole, N, MT_RANGED_SIDE_ROOM_DEFAULT);
        const int64_t nwhole = mt_cpu_ranged_pass(0, N, p, g, m, v, w, MT_DTYPE_BF16, &a, modes[b], whole);
        ck_assert_int_gt(nwhole, 0);
        ck_assert_int_lt(nwhole, N);
        for (size_t c = 0; c < sizeof cuts / sizeof cuts[0]; c++) {
            mt_ranged_flags_reset(pieces, N, MT_RANGED_SIDE_ROOM_DEFAULT);
            int64_t npieces = 0;
            for (int k = 0; k < 3; k++)
                npieces += mt_cpu_ranged_pass(cuts[c][k], cuts[c][k + 1] - cuts[c][k], p, g, m, v, w1, MT_DTYPE_BF16,
                                              &a, modes[b], pieces);
            ck_assert_msg(npieces == nwhole, "%s bounds, cut %zu: %lld flagged in pieces, %lld whole", name, c,
                          (long long)npieces, (long long)nwhole);
            const uint64_t *bw = mt_ranged_bits_of(whole), *bp = mt_ranged_bits_of(pieces);
            for (int i = 0; i < N; i++) {
                if (((bw[i / 64] ^ bp[i / 64]) >> (i % 64)) & 1)
                    ck_assert_msg(false, "%s bounds, cut %zu: element %d's flag differs", name, c, i);
                if (!((bw[i / 64] >> (i % 64)) & 1) && w[i] != w1[i])
                    ck_assert_msg(false, "%s bounds, cut %zu: unflagged element %d's weight differs", name, c, i);
            }
        }
    }
    free(p); free(g); free(m); free(v); free(w); free(w1); free(whole); free(pieces);
}
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

static Suite *ops_suite(void)
{
    Suite *s = suite_create("ops");
    TCase *tc = tcase_create("cpu");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_embedding);
    tcase_add_test(tc, test_rmsnorm);
    tcase_add_test(tc, test_linear);
    tcase_add_test(tc, test_rope);
    tcase_add_test(tc, test_rope_inv_freq);
    tcase_add_test(tc, test_attention_gqa);
    tcase_add_test(tc, test_attention_mha_mqa);
    tcase_add_test(tc, test_attention_large_scores);
    tcase_add_test(tc, test_swiglu);
    tcase_add_test(tc, test_elementwise);
    tcase_add_test(tc, test_adamw_f32);
    tcase_add_test(tc, test_adamw_f64);
    tcase_add_test(tc, test_bf16);
    tcase_add_test(tc, test_adamw_f32_bitwise_scalar);
    tcase_add_loop_test(tc, test_ranged_flags_sound, 0, 3);
    tcase_add_test(tc, test_ranged_redo_exact);
    tcase_add_test(tc, test_ranged_side_room);
    tcase_add_test(tc, test_ranged_deferred_fused);
    tcase_add_test(tc, test_ranged_pieces);
    tcase_add_test(tc, test_ranged_held);
    tcase_add_test(tc, test_ranged_spread_grows);
    tcase_add_test(tc, test_ranged_spread_remembers);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return mt_test_run(ops_suite(), false);
}
