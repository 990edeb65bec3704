/* Rope scaling's math on the CPU: the inverse frequencies and attention factor of each rope type
 * against transformers' formulas evaluated in double (tools/rope_reference.py prints the expected
 * numbers), and the rotation with scaled frequencies and an attention factor against a direct
 * formula and central finite differences. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cpu/ops.h"
#include "tests/testutil.h"

/* Double arithmetic in a different order (pow, log of the same arguments): a few ulps. */
#define REF_TOL 1e-13

typedef struct {
    int j;
    double inv_freq;
} pair_value;

typedef struct {
    const char *name;
    const char *rope_json; /* the config's rope keys, the rest of the model around them */
    int64_t head_dim, max_positions, seq_len;
    double attention_factor;
    pair_value expect[8];
    int count;
} freq_case;

/* Each case's config is the one tools/rope_reference.py names; its output is pasted here. */
static const freq_case freq_cases[] = {
    /* Vicuna-7B-v1.5-16k: Llama 2 base, linear factor 4 over 4096 */
    {"linear", "\"rope_theta\": 10000.0, \"rope_scaling\": {\"type\": \"linear\", \"factor\": 4.0}", 128, 4096,
     16384, 1.0, {{0, 0.25}, {1, 0.21649108084001634}, {17, 0.021649108084001636}, {63, 2.8869549617236455e-05}}, 4},
    /* Qwen2.5-3B's base with dynamic factor 4: 131072 and 65536 tokens grow the base; 16384, within
     * max_position_embeddings, keeps the model's own (pair 32: 1e6^-0.5) */
    {"dynamic 131072", "\"rope_theta\": 1000000.0, \"rope_scaling\": {\"rope_type\": \"dynamic\", \"factor\": 4.0}",
     128, 32768, 131072, 1.0,
     {{0, 1.0}, {1, 0.7736924511187071}, {32, 0.0002717612325612543}, {63, 9.545675082705537e-08}}, 4},
    {"dynamic 65536", "\"rope_theta\": 1000000.0, \"rope_scaling\": {\"rope_type\": \"dynamic\", \"factor\": 4.0}",
     128, 32768, 65536, 1.0,
     {{0, 1.0}, {1, 0.7855163662888833}, {32, 0.0004415375228938882}, {63, 2.481875521503439e-07}}, 4},
    {"dynamic 16384", "\"rope_theta\": 1000000.0, \"rope_scaling\": {\"rope_type\": \"dynamic\", \"factor\": 4.0}",
     128, 32768, 16384, 1.0, {{0, 1.0}, {1, 0.8058421877614819}, {32, 0.001}, {63, 1.2409377607517195e-06}}, 4},
    /* Qwen2.5-3B with Qwen's long-context block: the ramp spans dims [23, 40]; attention factor
     * 0.1 ln 4 + 1 */
    {"yarn qwen2.5",
     "\"rope_theta\": 1000000.0, \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4.0, "
     "\"original_max_position_embeddings\": 32768}",
     128, 32768, 131072, 1.138629436111989,
     {{0, 1.0}, {22, 0.008659643233600653}, {23, 0.006978305848598663}, {24, 0.005375321490790102},
      {30, 0.0010643609812470017}, {39, 6.490394320837028e-05}, {40, 4.445698525097307e-05},
      {63, 3.102344401879299e-07}}, 8},
    /* gpt-oss-20b (transformers 5 spelling): truncate false leaves the ramp's ends fractional,
     * [8.09, 17.40] */
    {"yarn gpt-oss",
     "\"rope_parameters\": {\"rope_type\": \"yarn\", \"rope_theta\": 150000.0, \"factor\": 32.0, \"beta_fast\": 32.0, "
     "\"beta_slow\": 1.0, \"original_max_position_embeddings\": 4096, \"truncate\": false}",
     64, 131072, 131072, 1.3465735902799727,
     {{0, 1.0}, {8, 0.050813274815461475}, {9, 0.03170569618466377}, {12, 0.006794959489732219},
      {17, 0.00012931870124506317}, {18, 3.8308812373753384e-05}, {31, 3.0235114281192144e-07}}, 7},
    /* DeepSeek-V2-style mscales: attention factor get_mscale(40, 1) / get_mscale(40, 0.707) */
    {"yarn mscale",
     "\"rope_theta\": 10000.0, \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 40.0, \"mscale\": 1.0, "
     "\"mscale_all_dim\": 0.707, \"original_max_position_embeddings\": 4096}",
     64, 163840, 163840, 1.0857263992561355,
     {{0, 1.0}, {10, 0.056234132519034905}, {11, 0.03900692656714386}, {20, 0.0007905694150420945},
      {23, 3.33380358040831e-05}, {24, 2.5e-05}, {31, 3.33380358040831e-06}}, 7},
    /* an explicit attention_factor and betas: ramp [11, 19] */
    {"yarn attention_factor",
     "\"rope_theta\": 500000.0, \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 8.0, \"beta_fast\": 16.0, "
     "\"beta_slow\": 2.0, \"attention_factor\": 0.875, \"original_max_position_embeddings\": 2048}",
     96, 16384, 16384, 0.875,
     {{0, 1.0}, {10, 0.06497025666213976}, {11, 0.049429479884200656}, {12, 0.03349287129780069},
      {16, 0.005709017257336145}, {19, 0.0006935339404710853}, {20, 0.0005276417813430396},
      {47, 3.286007500703366e-07}}, 8},
};

/* A Llama config of two heads of head_dim around the given rope keys. */
static void parse_case(const freq_case *fc, mt_model_config *cfg)
{
    char json[1024], err[512] = "";
    snprintf(json, sizeof json,
             "{\"model_type\": \"llama\", \"hidden_size\": %lld, \"intermediate_size\": 64, \"num_hidden_layers\": 1,"
             " \"num_attention_heads\": 2, \"head_dim\": %lld, \"vocab_size\": 32,"
             " \"max_position_embeddings\": %lld, %s}",
             (long long)(2 * fc->head_dim), (long long)fc->head_dim, (long long)fc->max_positions, fc->rope_json);
    ck_assert_msg(mt_config_parse(json, fc->name, cfg, err, sizeof err) == 0, "%s", err);
}

START_TEST(test_inv_freq_reference)
{
    const freq_case *fc = &freq_cases[_i];
    mt_model_config cfg;
    parse_case(fc, &cfg);
    double f[512];
    const double attention = mt_rope_inv_freq(&cfg, fc->seq_len, f);
    double worst = fabs(attention - fc->attention_factor) / fc->attention_factor;
    for (int k = 0; k < fc->count; k++) {
        const pair_value *e = &fc->expect[k];
        worst = fmax(worst, fabs(f[e->j] - e->inv_freq) / e->inv_freq);
    }
    printf("[rope] %-24s attention %.17g, worst rel err %.2e (tol %.0e)\n", fc->name, attention, worst, REF_TOL);
    ck_assert_msg(worst <= REF_TOL, "%s: rel err %.3e against transformers' formula", fc->name, worst);
    /* every type keeps the frequencies decreasing */
    for (int64_t j = 1; j < cfg.head_dim / 2; j++) ck_assert_msg(f[j] < f[j - 1], "%s: pair %lld", fc->name, (long long)j);
}
END_TEST

/* Dynamic's frequencies depend on the length run, only past max_position_embeddings; the other
 * types' never do. */
START_TEST(test_length_dependence)
{
    double a[64], b[64];
    for (size_t k = 0; k < sizeof freq_cases / sizeof freq_cases[0]; k++) {
        mt_model_config cfg;
        parse_case(&freq_cases[k], &cfg);
        const int64_t half = cfg.head_dim / 2;
        mt_rope_inv_freq(&cfg, 1, a);
        mt_rope_inv_freq(&cfg, cfg.max_positions, b);
        ck_assert_int_eq(memcmp(a, b, (size_t)half * sizeof(double)), 0);
        mt_rope_inv_freq(&cfg, 2 * cfg.max_positions, b);
        if (cfg.rope_type == MT_ROPE_DYNAMIC)
            for (int64_t j = 1; j < half; j++) ck_assert(b[j] < a[j]);
        else
            ck_assert_int_eq(memcmp(a, b, (size_t)half * sizeof(double)), 0);
    }
}
END_TEST

/* ---- the rotation with scaled frequencies and an attention factor ---- */

enum { B = 2, T = 7, NH = 3, D = 10, N = B * T * NH * D };

/* The objective is linear in x, so central differences have no truncation error: a wide step
 * keeps their rounding (~1e-16 |L| / step) far below the bound. */
#define FD_STEP 1e-3
#define FD_TOL 1e-10
#define F32_TOL 1e-6  /* f32 rotation against f64 on the same inputs */

typedef struct {
    const double *inv_freq, *x, *w;
    double attention;
    double y[N];
} rope_objective_ctx;

/* L(x) = sum(w * rope(x)), through the f64 forward. */
static double rope_objective(rope_objective_ctx *c, const double *x)
{
    memcpy(c->y, x, sizeof c->y);
    mt_cpu_rope_forward_f64(B, T, NH, D, c->inv_freq, c->attention, c->y);
    double s = 0;
    for (int i = 0; i < N; i++) s += c->w[i] * c->y[i];
    return s;
}

/* The forward against a * (x1 cos - x2 sin, x2 cos + x1 sin), written out per element; the
 * backward against central differences of L; backward(forward(x)) = a^2 x; f32 against f64. */
static void check_scaled_rotation(const mt_model_config *cfg, const char *label)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 28);
    double inv_freq[D / 2];
    const double a = mt_rope_inv_freq(cfg, T, inv_freq);
    static double x[N], w[N], ref[N], y[N], g[N], fd[N], back[N];
    mt_test_fill_f64(&rng, x, N, 1.0);
    mt_test_fill_f64(&rng, w, N, 1.0);
    for (int r = 0; r < B * T; r++)
        for (int h = 0; h < NH; h++)
            for (int j = 0; j < D; j++) {
                const double *xr = x + (r * NH + h) * D;
                const int pair = j % (D / 2);
                const double angle = (r % T) * inv_freq[pair];
                ref[(r * NH + h) * D + j] = j < D / 2 ? a * (xr[j] * cos(angle) - xr[j + D / 2] * sin(angle))
                                                      : a * (xr[j] * cos(angle) + xr[j - D / 2] * sin(angle));
            }
    memcpy(y, x, sizeof y);
    mt_cpu_rope_forward_f64(B, T, NH, D, inv_freq, a, y);
    const double e_fwd = mt_test_rel_err_f64(y, ref, N);

    memcpy(back, y, sizeof back);
    mt_cpu_rope_backward_f64(B, T, NH, D, inv_freq, a, back);
    for (int i = 0; i < N; i++) back[i] /= a * a;
    const double e_inv = mt_test_rel_err_f64(back, x, N);

    rope_objective_ctx c = {inv_freq, x, w, a, {0}};
    static double xp[N];
    memcpy(xp, x, sizeof xp);
    for (int i = 0; i < N; i++) {
        const double keep = xp[i];
        xp[i] = keep + FD_STEP;
        const double lp = rope_objective(&c, xp);
        xp[i] = keep - FD_STEP;
        const double lm = rope_objective(&c, xp);
        xp[i] = keep;
        fd[i] = (lp - lm) / (2 * FD_STEP);
    }
    memcpy(g, w, sizeof g);
    mt_cpu_rope_backward_f64(B, T, NH, D, inv_freq, a, g);
    const double e_grad = mt_test_rel_err_f64(g, fd, N);

    static float x32[N];
    double y32[N];
    for (int i = 0; i < N; i++) x32[i] = (float)x[i];
    mt_cpu_rope_forward_f32(B, T, NH, D, inv_freq, a, x32);
    for (int i = 0; i < N; i++) y32[i] = x32[i];
    const double e_f32 = mt_test_rel_err_f64(y32, y, N);

    printf("[rope] %-16s a %.6f: forward %.1e, inverse %.1e, dx vs fd %.1e, f32 %.1e\n", label, a, e_fwd, e_inv,
           e_grad, e_f32);
    ck_assert_msg(e_fwd <= 1e-14, "%s forward vs formula: %.3e", label, e_fwd);
    ck_assert_msg(e_inv <= 1e-14, "%s backward(forward(x)) / a^2 vs x: %.3e", label, e_inv);
    ck_assert_msg(e_grad <= FD_TOL, "%s dx vs finite differences: %.3e", label, e_grad);
    ck_assert_msg(e_f32 <= F32_TOL, "%s f32 vs f64 forward: %.3e", label, e_f32);
}

/* A small Qwen2 of head_dim D, extended by --rope-scaling spec. */
static mt_model_config small_extended(int64_t max_positions, const char *spec)
{
    mt_model_config cfg;
    ck_assert_int_eq(mt_config_from_shape("tiny", &cfg), 0);
    cfg.heads = 4, cfg.kv_heads = 2, cfg.head_dim = D, cfg.hidden = 4 * D;
    cfg.max_positions = max_positions;
    char err[512] = "";
    ck_assert_msg(mt_config_set_rope_scaling(&cfg, spec, err, sizeof err) == 0, "%s", err);
    ck_assert_msg(mt_config_validate(&cfg, spec, err, sizeof err) == 0, "%s", err);
    return cfg;
}

START_TEST(test_scaled_rotation)
{
    /* yarn over 4 positions at factor 3: T = 7 runs past the original, the ramp covers pairs
     * between the ends, the attention factor is 0.1 ln 3 + 1 */
    const mt_model_config yarn = small_extended(4, "yarn:3");
    double f[D / 2];
    ck_assert(fabs(mt_rope_inv_freq(&yarn, T, f) - (0.1 * log(3.0) + 1.0)) <= 1e-15);
    check_scaled_rotation(&yarn, "yarn:3");
    /* dynamic: T = 7 > 4 positions grows the base */
    const mt_model_config dynamic = small_extended(4, "dynamic:2"), linear = small_extended(4, "linear:2.5");
    check_scaled_rotation(&dynamic, "dynamic:2");
    check_scaled_rotation(&linear, "linear:2.5");
    /* an attention factor away from 1 both ways, on the same frequencies */
    mt_model_config explicit_factor = yarn;
    explicit_factor.rope_attention_factor = 0.6;
    check_scaled_rotation(&explicit_factor, "yarn a=0.6");
}
END_TEST

int main(void)
{
    Suite *s = suite_create("rope");
    TCase *tc = tcase_create("rope");
    tcase_add_loop_test(tc, test_inv_freq_reference, 0, (int)(sizeof freq_cases / sizeof freq_cases[0]));
    tcase_add_test(tc, test_length_dependence);
    tcase_add_test(tc, test_scaled_rotation);
    suite_add_tcase(s, tc);
    return mt_test_run(s, false);
}
