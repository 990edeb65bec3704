/* The mixture-of-experts suites' shared helpers (tests/moe_util.h). */
#include "tests/moe_util.h"

#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <unistd.h>

#include "backends/cpu/ops.h"
#include "models/safetensors.h"
#include "models/util.h"
#include "runtime/hf.h"
#include "runtime/runtime.h"
#include "runtime/state.h"

/* Five-point central differences in double: truncation ~h^4, rounding ~1e-16 |L| / h, small
 * enough for the experts that few tokens reach, whose gradients are small against the loss. */
#define FD_STEP 1e-5
#define FD_TOL 1e-6 /* ||analytic - fd|| / ||fd|| per tensor */

double weighted_sum(const double *w, const double *y, int64_t n)
{
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += w[i] * y[i];
    return s;
}

/* The finite-difference gradient of f over x (n), perturbing x in place, against analytic.
 * A zero gradient must be exactly zero on both sides (an expert no token chose). */
void check_grad(const char *what, double (*f)(void *), void *ctx, double *x, int64_t n, const double *analytic)
{
    double *fd = mt_test_alloc_f64(n);
    for (int64_t i = 0; i < n; i++) {
        const double keep = x[i];
        double at[4];
        const double steps[4] = { -2, -1, 1, 2 };
        for (int j = 0; j < 4; j++) {
            x[i] = keep + steps[j] * FD_STEP;
            at[j] = f(ctx);
        }
        x[i] = keep;
        /* differences first: a parameter f does not read gives exactly 0 */
        fd[i] = (8 * (at[2] - at[1]) - (at[3] - at[0])) / (12 * FD_STEP);
    }
    double norm = 0, anorm = 0;
    for (int64_t i = 0; i < n; i++) {
        norm += fd[i] * fd[i];
        anorm += analytic[i] * analytic[i];
    }
    if (norm == 0) {
        fprintf(stderr, "  %-52s zero gradient, analytic norm %.3e\n", what, sqrt(anorm));
        ck_assert_msg(anorm == 0, "%s: finite differences are zero, the analytic gradient is not", what);
    } else {
        fprintf(stderr, "  %-52s |grad| %.3e\n", what, sqrt(norm));
        mt_test_report(what, mt_test_rel_err_f64(analytic, fd, n), FD_TOL);
    }
    free(fd);
}

/* Random tile: norm weights near 1, everything else N(0, scale). */
void fill_tile(mt_test_rng *rng, const mt_tile_layout *lay, double *tile, double scale)
{
    memset(tile, 0, (size_t)lay->numel * sizeof(double));
    for (int s = 0; s < lay->ntensors; s++) {
        const mt_tensor_desc *t = &lay->tensors[s];
        if (t->numel == 0) continue;
        const bool is_norm = t->ndim == 1 && strstr(t->name, "norm") != NULL;
        mt_test_fill_f64(rng, tile + t->offset, t->numel, is_norm ? 0.2 : scale);
        if (is_norm)
            for (int64_t i = 0; i < t->numel; i++) tile[t->offset + i] += 1.0;
    }
}

/* Checks every present tensor of a tile against finite differences. */
void check_tile_grads(const char *what, double (*f)(void *), void *ctx, const mt_tile_layout *lay, double *tile,
                      const double *dtile)
{
    for (int s = 0; s < lay->ntensors; s++) {
        const mt_tensor_desc *t = &lay->tensors[s];
        if (t->numel == 0) continue;
        char label[128];
        snprintf(label, sizeof label, "%s %s", what, t->name);
        check_grad(label, f, ctx, tile + t->offset, t->numel, dtile + t->offset);
    }
}

mt_model_config parse_ok(const char *json, const char *name)
{
    mt_model_config cfg;
    char err[512] = "";
    ck_assert_msg(mt_config_parse(json, name, &cfg, err, sizeof err) == 0, "%s: %s", name, err);
    return cfg;
}

/* The message of a config that must be refused contains every one of the fragments. */
void parse_fails(const char *json, const char *name, const char *want1, const char *want2)
{
    mt_model_config cfg;
    char err[512] = "";
    ck_assert_msg(mt_config_parse(json, name, &cfg, err, sizeof err) != 0, "%s: accepted", name);
    fprintf(stderr, "  refused: %s\n", err);
    ck_assert_msg(strstr(err, name) && strstr(err, want1) && (!want2 || strstr(err, want2)),
                  "%s: message '%s' lacks '%s' / '%s'", name, err, want1, want2 ? want2 : "");
}



mt_model_config moe_config(const char *base, const char *extra)
{
    char json[2048];
    snprintf(json, sizeof json, "%s%s}", base, extra);
    return parse_ok(json, "test-config");
}

mt_model_config gpt_oss_clamping(const char *extra)
{
    mt_model_config c = moe_config(GPT_OSS_TINY_BASE, extra);
    c.swiglu_limit = GPT_OSS_TEST_LIMIT;
    return c;
}

double topk_gap(const double *probs, int64_t n, int64_t E, int64_t k)
{
    if (k == E) return INFINITY;
    double gap = INFINITY;
    int32_t *sel = mt_xmalloc((size_t)(k + 1) * sizeof(int32_t));
    double *w = mt_test_alloc_f64(k + 1);
    for (int64_t r = 0; r < n; r++) {
        mt_cpu_router_topk_f64(1, E, k + 1, false, probs + r * E, sel, w);
        if (w[k - 1] - w[k] < gap) gap = w[k - 1] - w[k];
    }
    free(sel);
    free(w);
    return gap;
}

/* Every field of the two configs is the same (the run's override is not the model's). */
void assert_same_config(const mt_model_config *a, const mt_model_config *b)
{
    ck_assert_int_eq(a->family, b->family);
    ck_assert_str_eq(a->model_type, b->model_type);
    ck_assert(a->hidden == b->hidden && a->intermediate == b->intermediate && a->layers == b->layers);
    ck_assert(a->heads == b->heads && a->kv_heads == b->kv_heads && a->head_dim == b->head_dim);
    ck_assert(a->vocab == b->vocab && a->max_positions == b->max_positions && a->tied == b->tied);
    ck_assert(a->rope_theta == b->rope_theta && a->rms_eps == b->rms_eps && a->sliding_window == b->sliding_window);
    ck_assert(a->qkv_bias == b->qkv_bias && a->qk_norm == b->qk_norm);
    ck_assert_int_eq(a->experts, b->experts);
    ck_assert_int_eq(a->experts_per_token, b->experts_per_token);
    ck_assert_int_eq(a->expert_intermediate, b->expert_intermediate);
    ck_assert_int_eq(a->norm_topk_prob, b->norm_topk_prob);
    ck_assert_int_eq(a->decoder_sparse_step, b->decoder_sparse_step);
    ck_assert_int_eq(a->mlp_only_layers_count, b->mlp_only_layers_count);
    for (int64_t i = 0; i < a->mlp_only_layers_count; i++)
        ck_assert_int_eq(a->mlp_only_layers[i], b->mlp_only_layers[i]);
    ck_assert(a->router_aux_loss_coef == b->router_aux_loss_coef);
    ck_assert_int_eq(a->output_router_logits, b->output_router_logits);
    ck_assert(a->o_bias == b->o_bias && a->attn_sinks == b->attn_sinks);
    ck_assert(a->router_bias == b->router_bias && a->expert_bias == b->expert_bias);
    ck_assert(a->swiglu_alpha == b->swiglu_alpha && a->swiglu_limit == b->swiglu_limit);
    for (int64_t i = 0; i < a->layers; i++)
        ck_assert_int_eq(mt_config_layer_sliding(a, i), mt_config_layer_sliding(b, i));
    ck_assert_int_eq(a->rope_type, b->rope_type);
    ck_assert(a->rope_scaling_factor == b->rope_scaling_factor);
    ck_assert_int_eq(a->rope_original_max_positions, b->rope_original_max_positions);
    ck_assert_int_eq(a->rope_truncate, b->rope_truncate);
}

void moe_runtime_up(void)
{
    mt_runtime_options ro = { .sched = "eager", .ncpu = 2, .ncuda = 0 };
    char err[512] = "";
    ck_assert_msg(mt_runtime_init(&ro, err, sizeof err) == 0, "mt_runtime_init: %s", err);
}

void moe_runtime_down(void) { mt_runtime_shutdown(); }

void check_hf_roundtrip(const mt_model_config *cfg, uint64_t seed, const hf_tensor *want)
{
    char err[1024] = "";
    mt_host_state *a = mt_state_create(cfg, MT_DTYPE_F32, 0, err, sizeof err);
    ck_assert_msg(a != NULL, "%s", err);
    mt_state_init_random(a, seed, 1.0);
    char dir[] = "/tmp/mt-moe-hf.XXXXXX";
    ck_assert(mkdtemp(dir) != NULL);
    ck_assert_msg(mt_hf_save(dir, a, MT_DTYPE_F32, 0, err, sizeof err) == 0, "%s", err);

    char path[4200];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    mt_st_file *f = mt_st_open(path, err, sizeof err);
    ck_assert_msg(f != NULL, "%s", err);
    for (const hf_tensor *w = want; w->name; w++) {
        const mt_st_tensor *t = mt_st_find(f, w->name);
        if (w->rows == 0) {
            ck_assert_msg(t == NULL, "%s: holds '%s'", path, w->name);
            continue;
        }
        ck_assert_msg(t != NULL, "%s: no tensor '%s'", path, w->name);
        ck_assert_msg(t->ndim == 2 && t->shape[0] == w->rows && t->shape[1] == w->cols, "%s: shape", w->name);
    }
    int64_t expected = 0;
    for (int i = 0; i < a->ntiles; i++)
        for (int s = 0; s < a->tiles[i].layout->ntensors; s++) expected += a->tiles[i].layout->tensors[s].numel > 0;
    ck_assert_int_eq(f->ntensors, expected);
    mt_st_close(f);

    mt_model_config back;
    ck_assert_msg(mt_config_load(dir, &back, err, sizeof err) == 0, "%s", err);
    assert_same_config(cfg, &back);
    mt_host_state *b = mt_state_create(&back, MT_DTYPE_F32, 0, err, sizeof err);
    ck_assert_msg(b != NULL, "%s", err);
    ck_assert_msg(mt_hf_load(dir, b, err, sizeof err) == 0, "%s", err);
    for (int i = 0; i < a->ntiles; i++) {
        ck_assert_int_eq(a->tiles[i].numel, b->tiles[i].numel);
        ck_assert(memcmp(a->tiles[i].master, b->tiles[i].master, sizeof(float) * (size_t)a->tiles[i].numel) == 0);
    }
    mt_state_destroy(a);
    mt_state_destroy(b);
    mt_test_remove_dir(dir);
}
