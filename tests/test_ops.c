/* Check suite of the CPU layer ops (backends/cpu/ops.h): every backward against central finite
 * differences of the double (_f64) forward, forwards against naive references, the = / +=
 * output contracts, float/double agreement. The AdamW kernels and bf16 are suite adamw's, the
 * ranged speculation's kernels suite ranged's. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cpu/ops.h"
#include "tests/testutil.h"

/* Sizes deliberately not multiples of 8, so vector tails and odd strides are exercised. */
enum { B = 2, T = 7, H = 6, KV = 2, D = 10, DM = 13, I = 19, V = 11, NTOK = B * T };

#define FD_STEP 1e-6     /* central differences in double: truncation ~h^2, rounding ~1e-16/h */
#define FD_TOL 1e-6      /* ||analytic - fd|| / ||fd|| per tensor */
#define MIXED_TOL 1e-5   /* f32 forward vs f64 forward on the same inputs */

/* ---------- helpers ---------- */

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
    double *p = mt_test_alloc_f64(n);
    for (int64_t i = 0; i < n; i++) p[i] = a[i] - b[i];
    return p;
}

/* The scalar objective L(x) whose gradient is checked, evaluated with the _f64 forward. */
typedef double (*objective_fn)(void *ctx);

/* Central finite-difference gradient of f with respect to x (n), perturbing x in place, compared
 * with `analytic`; reports and asserts the relative error. */
static void check_grad(const char *what, objective_fn f, void *ctx, double *x, int64_t n,
                       const double *analytic)
{
    double *fd = mt_test_alloc_f64(n);
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
    mt_test_report(what, mt_test_rel_err_f64(analytic, fd, n), FD_TOL);
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
    embed_ctx c = {mt_test_random_f64(&rng, V * DM, 1.0), mt_test_random_f64(&rng, NTOK * DM, 1.0),
                   mt_test_alloc_f64(NTOK * DM), tokens};

    mt_cpu_embedding_forward_f64(NTOK, DM, c.table, tokens, c.out);
    for (int r = 0; r < NTOK; r++)
        ck_assert_int_eq(memcmp(c.out + r * DM, c.table + tokens[r] * DM, DM * sizeof(double)), 0);

    double *prefill = mt_test_random_f64(&rng, V * DM, 1.0), *dtable = mt_test_copy_f64(prefill, V * DM);
    mt_cpu_embedding_backward_f64(NTOK, DM, tokens, c.w, dtable);
    double *added = diff(dtable, prefill, V * DM);
    check_grad("embedding d table (+=)", embed_objective, &c, c.table, V * DM, added);

    float *table32 = mt_test_to_f32(c.table, V * DM), *out32 = mt_test_alloc_f32(NTOK * DM);
    mt_cpu_embedding_forward_f32(NTOK, DM, table32, tokens, out32);
    mt_cpu_embedding_forward_f64(NTOK, DM, c.table, tokens, c.out);
    mt_test_report("embedding f32 vs f64 forward", mt_test_rel_err_mixed(out32, c.out, NTOK * DM), MIXED_TOL);
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
    rms_ctx c = {mt_test_random_f64(&rng, NTOK * DM, 1.0), mt_test_random_f64(&rng, DM, 1.0),
                 mt_test_random_f64(&rng, NTOK * DM, 1.0), mt_test_alloc_f64(NTOK * DM)};
    double *y = mt_test_alloc_f64(NTOK * DM), *inv = mt_test_alloc_f64(NTOK), *ref = mt_test_alloc_f64(NTOK * DM);
    double inv_ref[NTOK];
    for (int r = 0; r < NTOK; r++) {
        long double ss = 0;
        for (int j = 0; j < DM; j++) ss += (long double)c.x[r * DM + j] * c.x[r * DM + j];
        inv_ref[r] = (double)(1.0L / sqrtl(ss / DM + RMS_EPS));
        for (int j = 0; j < DM; j++) ref[r * DM + j] = c.x[r * DM + j] * inv_ref[r] * c.g[j];
    }
    mt_cpu_rmsnorm_forward_f64(NTOK, DM, c.x, c.g, RMS_EPS, y, inv);
    mt_test_report("rmsnorm forward vs naive", mt_test_rel_err_f64(y, ref, NTOK * DM), 1e-14);
    mt_test_report("rmsnorm inv_rms vs naive", mt_test_rel_err_f64(inv, inv_ref, NTOK), 1e-14);
    mt_cpu_rmsnorm_forward_f64(NTOK, DM, c.x, c.g, RMS_EPS, c.y, NULL); /* inv_rms optional */
    ck_assert_int_eq(memcmp(c.y, y, NTOK * DM * sizeof(double)), 0);

    double *dx0 = mt_test_random_f64(&rng, NTOK * DM, 1.0), *dw0 = mt_test_random_f64(&rng, DM, 1.0);
    double *dx = mt_test_copy_f64(dx0, NTOK * DM), *dw = mt_test_copy_f64(dw0, DM);
    mt_cpu_rmsnorm_backward_f64(NTOK, DM, c.x, c.g, inv, c.wts, dx, dw);
    double *ax = diff(dx, dx0, NTOK * DM), *aw = diff(dw, dw0, DM);
    check_grad("rmsnorm dx (+=)", rms_objective, &c, c.x, NTOK * DM, ax);
    check_grad("rmsnorm dw (+=)", rms_objective, &c, c.g, DM, aw);

    float *x32 = mt_test_to_f32(c.x, NTOK * DM), *g32 = mt_test_to_f32(c.g, DM), *y32 = mt_test_alloc_f32(NTOK * DM);
    float *inv32 = mt_test_alloc_f32(NTOK);
    mt_cpu_rmsnorm_forward_f32(NTOK, DM, x32, g32, RMS_EPS, y32, inv32);
    mt_test_report("rmsnorm f32 vs f64 forward", mt_test_rel_err_mixed(y32, y, NTOK * DM), MIXED_TOL);
    mt_test_report("rmsnorm f32 vs f64 inv_rms", mt_test_rel_err_mixed(inv32, inv, NTOK), MIXED_TOL);
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
    linear_ctx c = {mt_test_random_f64(&rng, NTOK * DM, 1.0), mt_test_random_f64(&rng, I * DM, 0.5),
                    mt_test_random_f64(&rng, I, 1.0), mt_test_random_f64(&rng, NTOK * I, 1.0),
                    mt_test_alloc_f64(NTOK * I)};
    double *y = mt_test_alloc_f64(NTOK * I), *ref = mt_test_alloc_f64(NTOK * I);
    double *ref_nob = mt_test_alloc_f64(NTOK * I);
    for (int r = 0; r < NTOK; r++)
        for (int o = 0; o < I; o++) {
            double s = 0;
            for (int i = 0; i < DM; i++) s += c.x[r * DM + i] * c.W[o * DM + i];
            ref_nob[r * I + o] = s;
            ref[r * I + o] = s + c.b[o];
        }
    fill_nan(y, NTOK * I); /* y is an = output: stale contents, NaN included, must not leak */
    mt_cpu_linear_forward_f64(NTOK, DM, I, c.x, c.W, c.b, y);
    mt_test_report("linear forward vs naive", mt_test_rel_err_f64(y, ref, NTOK * I), 1e-14);
    fill_nan(y, NTOK * I);
    mt_cpu_linear_forward_f64(NTOK, DM, I, c.x, c.W, NULL, y);
    mt_test_report("linear forward (no bias) vs naive", mt_test_rel_err_f64(y, ref_nob, NTOK * I), 1e-14);

    /* accumulate_dx = false: dx overwritten (NaN prefill); dW, db accumulate */
    double *dW0 = mt_test_random_f64(&rng, I * DM, 1.0), *db0 = mt_test_random_f64(&rng, I, 1.0);
    double *dx = mt_test_alloc_f64(NTOK * DM), *dW = mt_test_copy_f64(dW0, I * DM), *db = mt_test_copy_f64(db0, I);
    fill_nan(dx, NTOK * DM);
    mt_cpu_linear_backward_f64(NTOK, DM, I, c.x, c.W, c.wts, dx, false, dW, db);
    double *aW = diff(dW, dW0, I * DM), *ab = diff(db, db0, I);
    check_grad("linear dx (=)", linear_objective, &c, c.x, NTOK * DM, dx);
    check_grad("linear dW (+=)", linear_objective, &c, c.W, I * DM, aW);
    check_grad("linear db (+=)", linear_objective, &c, c.b, I, ab);

    /* accumulate_dx = true adds the same gradient onto the prefill; db NULL leaves it out */
    double *dx0 = mt_test_random_f64(&rng, NTOK * DM, 1.0), *dxa = mt_test_copy_f64(dx0, NTOK * DM);
    double *dW2 = mt_test_copy_f64(dW0, I * DM);
    mt_cpu_linear_backward_f64(NTOK, DM, I, c.x, c.W, c.wts, dxa, true, dW2, NULL);
    double *ax = diff(dxa, dx0, NTOK * DM);
    mt_test_report("linear dx (+=) vs dx (=)", mt_test_rel_err_f64(ax, dx, NTOK * DM), 1e-14);
    mt_test_report("linear dW with db NULL", mt_test_rel_err_f64(dW2, dW, I * DM), 1e-14);

    float *x32 = mt_test_to_f32(c.x, NTOK * DM), *W32 = mt_test_to_f32(c.W, I * DM), *b32 = mt_test_to_f32(c.b, I);
    float *y32 = mt_test_alloc_f32(NTOK * I);
    mt_cpu_linear_forward_f32(NTOK, DM, I, x32, W32, b32, y32);
    mt_cpu_linear_forward_f64(NTOK, DM, I, c.x, c.W, c.b, y);
    mt_test_report("linear f32 vs f64 forward", mt_test_rel_err_mixed(y32, y, NTOK * I), MIXED_TOL);
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
    rope_ctx c = {mt_test_random_f64(&rng, n, 1.0), mt_test_random_f64(&rng, n, 1.0), mt_test_alloc_f64(n), inv_freq,
                  nh};

    /* direct formula, element by element, rows r = b*T + t */
    double *ref = mt_test_alloc_f64(n), *y = mt_test_copy_f64(c.x, n);
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
    mt_test_report(what, mt_test_rel_err_f64(y, ref, n), 1e-14);
    /* position 0 is the identity in every sequence */
    for (int b = 0; b < B; b++)
        ck_assert_int_eq(memcmp(y + b * T * nh * D, c.x + b * T * nh * D, nh * D * sizeof(double)), 0);

    double *back = mt_test_copy_f64(y, n);
    mt_cpu_rope_backward_f64(B, T, nh, D, inv_freq, 1.0, back);
    snprintf(what, sizeof what, "rope%s backward(forward(x)) vs x", label);
    mt_test_report(what, mt_test_rel_err_f64(back, c.x, n), 1e-14);

    double *g = mt_test_copy_f64(c.wts, n);
    mt_cpu_rope_backward_f64(B, T, nh, D, inv_freq, 1.0, g);
    snprintf(what, sizeof what, "rope%s dx", label);
    check_grad(what, rope_objective, &c, c.x, n, g);

    float *x32 = mt_test_to_f32(c.x, n);
    mt_cpu_rope_forward_f32(B, T, nh, D, inv_freq, 1.0, x32);
    snprintf(what, sizeof what, "rope%s f32 vs f64 forward", label);
    mt_test_report(what, mt_test_rel_err_mixed(x32, y, n), MIXED_TOL);
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
    mt_test_report("rope inv_freq theta^(-2j/D)", worst, 1e-14);
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
    int64_t h, kv, window;
    double *sinks; /* (h) or NULL */
    double *q, *k, *v, *wts, *out, *lse;
} attn_ctx;

static double attn_objective(void *p)
{
    attn_ctx *c = p;
    mt_cpu_attention_forward_f64(B, T, c->h, c->kv, D, c->window, c->sinks, c->q, c->k, c->v, c->out, c->lse);
    return weighted_sum(c->wts, c->out, NTOK * c->h * D);
}

/* Naive reference, in long double: the row of scores of the keys query t sees (the last `window`
 * of 0..t when window > 0), with the head's sink logit beside them in the softmax (as transformers'
 * gpt-oss eager attention concatenates it), max-subtracted, the sink's probability dropped. */
static void attention_naive(int64_t nh, int64_t nkv, int64_t window, const double *sinks, const double *q,
                            const double *k, const double *v, double *out, double *lse)
{
    const int64_t group = nh / nkv;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < nh; h++)
            for (int64_t t = 0; t < T; t++) {
                long double sc[T], mx = -INFINITY, z = 0;
                const int64_t s0 = window > 0 && t - window + 1 > 0 ? t - window + 1 : 0;
                const double *qr = q + ((b * T + t) * nh + h) * D;
                for (int64_t s = s0; s <= t; s++) {
                    const double *ks = k + ((b * T + s) * nkv + h / group) * D;
                    long double dot = 0;
                    for (int d = 0; d < D; d++) dot += (long double)qr[d] * ks[d];
                    sc[s] = dot / sqrtl(D);
                    if (sc[s] > mx) mx = sc[s];
                }
                if (sinks && sinks[h] > mx) mx = sinks[h];
                for (int64_t s = s0; s <= t; s++) z += expl(sc[s] - mx);
                if (sinks) z += expl(sinks[h] - mx);
                for (int d = 0; d < D; d++) {
                    long double acc = 0;
                    for (int64_t s = s0; s <= t; s++)
                        acc += expl(sc[s] - mx) / z * v[((b * T + s) * nkv + h / group) * D + d];
                    out[((b * T + t) * nh + h) * D + d] = (double)acc;
                }
                lse[(b * nh + h) * T + t] = (double)(mx + logl(z));
            }
}

/* window 0: full causal attention; sinks: random per-head sink logits (scaled by sink_scale). */
static void check_attention_with(int64_t nh, int64_t nkv, double qscale, int64_t window, bool sinks, double sink_scale)
{
    char what[128], tag[64];
    char win[24] = "";
    if (window) snprintf(win, sizeof win, " window %d", (int)window);
    snprintf(tag, sizeof tag, "attention H%d KV%d q*%g%s%s", (int)nh, (int)nkv, qscale, win, sinks ? " sinks" : "");
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 15 + (uint64_t)nkv + 7 * (uint64_t)window + (sinks ? 100 : 0));
    const int64_t nq = NTOK * nh * D, nk = NTOK * nkv * D, nl = B * nh * T;
    attn_ctx c = {nh, nkv, window, sinks ? mt_test_random_f64(&rng, nh, sink_scale) : NULL,
                  mt_test_random_f64(&rng, nq, qscale), mt_test_random_f64(&rng, nk, 1.0),
                  mt_test_random_f64(&rng, nk, 1.0), mt_test_random_f64(&rng, nq, 1.0), mt_test_alloc_f64(nq),
                  mt_test_alloc_f64(nl)};
    double *out = mt_test_alloc_f64(nq), *lse = mt_test_alloc_f64(nl);
    double *ref = mt_test_alloc_f64(nq), *lse_ref = mt_test_alloc_f64(nl);
    fill_nan(out, nq);
    fill_nan(lse, nl);
    mt_cpu_attention_forward_f64(B, T, nh, nkv, D, window, c.sinks, c.q, c.k, c.v, out, lse);
    attention_naive(nh, nkv, window, c.sinks, c.q, c.k, c.v, ref, lse_ref);
    snprintf(what, sizeof what, "%s forward vs naive", tag);
    mt_test_report(what, mt_test_rel_err_f64(out, ref, nq), 1e-13);
    snprintf(what, sizeof what, "%s lse vs naive", tag);
    mt_test_report(what, mt_test_rel_err_f64(lse, lse_ref, nl), 1e-13);

    float *q32 = mt_test_to_f32(c.q, nq), *k32 = mt_test_to_f32(c.k, nk), *v32 = mt_test_to_f32(c.v, nk);
    float *s32 = sinks ? mt_test_to_f32(c.sinks, nh) : NULL;
    float *o32 = mt_test_alloc_f32(nq), *l32 = mt_test_alloc_f32(nl);
    mt_cpu_attention_forward_f32(B, T, nh, nkv, D, window, s32, q32, k32, v32, o32, l32);
    snprintf(what, sizeof what, "%s f32 vs f64 out", tag);
    mt_test_report(what, mt_test_rel_err_mixed(o32, out, nq), MIXED_TOL);
    snprintf(what, sizeof what, "%s f32 vs f64 lse", tag);
    mt_test_report(what, mt_test_rel_err_mixed(l32, lse, nl), MIXED_TOL);
    free(q32), free(k32), free(v32), free(s32), free(o32), free(l32);

    if (qscale <= 1.0) { /* gradients where finite differences are well conditioned */
        double *dq = mt_test_alloc_f64(nq), *dk = mt_test_alloc_f64(nk), *dv = mt_test_alloc_f64(nk);
        double *ds = sinks ? mt_test_alloc_f64(nh) : NULL;
        fill_nan(dq, nq), fill_nan(dk, nk), fill_nan(dv, nk); /* all three are = outputs */
        if (ds) for (int64_t h = 0; h < nh; h++) ds[h] = 0.25; /* += output: starts from a known value */
        mt_cpu_attention_backward_f64(B, T, nh, nkv, D, window, c.sinks, c.q, c.k, c.v, out, lse, c.wts, dq, dk, dv,
                                      ds);
        snprintf(what, sizeof what, "%s dq (=)", tag);
        check_grad(what, attn_objective, &c, c.q, nq, dq);
        snprintf(what, sizeof what, "%s dk (=)", tag);
        check_grad(what, attn_objective, &c, c.k, nk, dk);
        snprintf(what, sizeof what, "%s dv (=)", tag);
        check_grad(what, attn_objective, &c, c.v, nk, dv);
        if (ds) {
            for (int64_t h = 0; h < nh; h++) ds[h] -= 0.25;
            snprintf(what, sizeof what, "%s dsinks (+=)", tag);
            check_grad(what, attn_objective, &c, c.sinks, nh, ds);
        }
        free(dq), free(dk), free(dv), free(ds);
    }
    free(out), free(lse), free(ref), free(lse_ref);
    free(c.sinks), free(c.q), free(c.k), free(c.v), free(c.wts), free(c.out), free(c.lse);
}

static void check_attention(int64_t nh, int64_t nkv, double qscale)
{
    check_attention_with(nh, nkv, qscale, 0, false, 0);
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

/* A sliding window (gpt-oss's sliding layers, Mistral's sliding_window): 2 keys (itself and the one
 * before: with 1 the output is v and no gradient reaches q or k), 3 keys, and a window as long as
 * the sequence (full causal attention again); with and without sinks. */
START_TEST(test_attention_window)
{
    check_attention_with(H, KV, 1.0, 2, false, 0);
    check_attention_with(H, KV, 1.0, 3, false, 0);
    check_attention_with(H, KV, 1.0, T, false, 0);
    check_attention_with(H, 1, 1.0, 3, true, 1.0);
}
END_TEST

/* Attention sinks (gpt-oss): per-head logits near the scores, and large ones (a sink above every
 * score: the running max starts from the keys and moves to the sink, most of each row's mass is
 * the sink's), with scores of magnitude ~100 too. */
START_TEST(test_attention_sinks)
{
    check_attention_with(H, KV, 1.0, 0, true, 1.0);
    check_attention_with(H, H, 1.0, 0, true, 4.0);
    check_attention_with(H, KV, 30.0, 0, true, 60.0);
}
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
    swiglu_ctx c = {mt_test_random_f64(&rng, n, 2.0), mt_test_random_f64(&rng, n, 1.0),
                    mt_test_random_f64(&rng, n, 1.0), mt_test_alloc_f64(n)};
    double *out = mt_test_alloc_f64(n), *ref = mt_test_alloc_f64(n);
    for (int64_t i = 0; i < n; i++) ref[i] = c.gate[i] / (1 + exp(-c.gate[i])) * c.up[i];
    mt_cpu_swiglu_forward_f64(NTOK, I, c.gate, c.up, out);
    mt_test_report("swiglu forward vs formula", mt_test_rel_err_f64(out, ref, n), 1e-14);

    double *dg = mt_test_alloc_f64(n), *du = mt_test_alloc_f64(n);
    fill_nan(dg, n), fill_nan(du, n);
    mt_cpu_swiglu_backward_f64(NTOK, I, c.gate, c.up, c.wts, dg, du);
    check_grad("swiglu dgate (=)", swiglu_objective, &c, c.gate, n, dg);
    check_grad("swiglu dup (=)", swiglu_objective, &c, c.up, n, du);

    float *g32 = mt_test_to_f32(c.gate, n), *u32 = mt_test_to_f32(c.up, n), *o32 = mt_test_alloc_f32(n);
    mt_cpu_swiglu_forward_f32(NTOK, I, g32, u32, o32);
    mt_test_report("swiglu f32 vs f64 forward", mt_test_rel_err_mixed(o32, out, n), MIXED_TOL);

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
    double *x = mt_test_random_f64(&rng, n, 1.0), *y0 = mt_test_random_f64(&rng, n, 1.0), *y = mt_test_copy_f64(y0, n);
    mt_cpu_add_f64(n, x, y);
    for (int64_t i = 0; i < n; i++) ck_assert_double_eq(y[i], y0[i] + x[i]);
    float *x32 = mt_test_to_f32(x, n), *y32 = mt_test_to_f32(y0, n);
    mt_cpu_add_f32(n, x32, y32);
    for (int64_t i = 0; i < n; i++) ck_assert_float_eq(y32[i], (float)y0[i] + x32[i]);

    /* 1e6 values of 1.1 in float: a float accumulator drifts by ~1e-3 relative (its ulp at 1e6
     * is 0.06), a double one stays within n * 2^-53 of the exact sum */
    const int64_t big = 1000003;
    float *ones = mt_test_alloc_f32(big);
    for (int64_t i = 0; i < big; i++) ones[i] = 1.1f;
    double exact = (double)big * ((double)1.1f * (double)1.1f);
    double got = mt_cpu_sumsq_f32(big, ones);
    mt_test_report("sumsq f32 (double accumulation)", fabs(got - exact) / exact, 1e-9);
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += x[i] * x[i];
    mt_test_report("sumsq f64", fabs(mt_cpu_sumsq_f64(n, x) - s) / s, 1e-14);
    free(ones), free(x), free(y0), free(y), free(x32), free(y32);
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
    tcase_add_test(tc, test_attention_window);
    tcase_add_test(tc, test_attention_sinks);
    tcase_add_test(tc, test_swiglu);
    tcase_add_test(tc, test_elementwise);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return mt_test_run(ops_suite(), false);
}
