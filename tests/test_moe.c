/* Check suite of the mixture-of-experts models (docs/moe.md): the qwen3_moe and mixtral configs
 * (Qwen3-30B-A3B's and Mixtral-8x7B's published values and parameter counts, defaults, round trips,
 * named errors), the sparse layer tile's layout, the HF round trip of its tensors by name, and the
 * CPU ops in double against central differences: the router, one expert, the MoE block, the
 * decoder layer and a whole tiny model, with and without the load-balancing loss; the routing's
 * edge cases (experts no token chooses, every token to one expert, k equal to the number of
 * experts, ties), the = / += contracts, the buffer sizes, and the fp32 layer against the double
 * one. Sizes are deliberately not multiples of 8. */
#include <check.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backends/cpu/ops.h"
#include "models/config.h"
#include "models/layout.h"
#include "models/safetensors.h"
#include "models/util.h"
#include "runtime/hf.h"
#include "runtime/runtime.h"
#include "runtime/state.h"
#include "runtime/step.h"
#include "tests/testutil.h"

/* Five-point central differences in double: truncation ~h^4, rounding ~1e-16 |L| / h, small
 * enough for the experts that few tokens reach, whose gradients are small against the loss. */
#define FD_STEP 1e-5
#define FD_TOL 1e-6 /* ||analytic - fd|| / ||fd|| per tensor */

/* ------------------------------------------------------------------------------------------ */
/* Helpers                                                                                     */

static double *dalloc(int64_t n)
{
    double *p = calloc((size_t)(n > 0 ? n : 1), sizeof(double));
    ck_assert_ptr_nonnull(p);
    return p;
}

static double *drandom(mt_test_rng *rng, int64_t n, double scale)
{
    double *p = dalloc(n);
    mt_test_fill_f64(rng, p, n, scale);
    return p;
}

static float *to_f32(const double *x, int64_t n)
{
    float *p = mt_xmalloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    for (int64_t i = 0; i < n; i++) p[i] = (float)x[i];
    return p;
}

static double f32_rel_err(const float *a, const double *b, int64_t n)
{
    double *a64 = dalloc(n);
    for (int64_t i = 0; i < n; i++) a64[i] = a[i];
    const double e = mt_test_rel_err_f64(a64, b, n);
    free(a64);
    return e;
}

static double weighted_sum(const double *w, const double *y, int64_t n)
{
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += w[i] * y[i];
    return s;
}

static void report(const char *what, double err, double tol)
{
    fprintf(stderr, "  %-52s rel err %.3e (tol %.0e)\n", what, err, tol);
    ck_assert_msg(err <= tol, "%s: relative error %.3e exceeds %.1e", what, err, tol);
}

/* The finite-difference gradient of f over x (n), perturbing x in place, against analytic.
 * A zero gradient must be exactly zero on both sides (an expert no token chose). */
static void check_grad(const char *what, double (*f)(void *), void *ctx, double *x, int64_t n,
                       const double *analytic)
{
    double *fd = dalloc(n);
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
        report(what, mt_test_rel_err_f64(analytic, fd, n), FD_TOL);
    }
    free(fd);
}

/* Random tile: norm weights near 1, everything else N(0, scale). */
static void fill_tile(mt_test_rng *rng, const mt_tile_layout *lay, double *tile, double scale)
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
static void check_tile_grads(const char *what, double (*f)(void *), void *ctx, const mt_tile_layout *lay,
                             double *tile, const double *dtile)
{
    for (int s = 0; s < lay->ntensors; s++) {
        const mt_tensor_desc *t = &lay->tensors[s];
        if (t->numel == 0) continue;
        char label[128];
        snprintf(label, sizeof label, "%s %s", what, t->name);
        check_grad(label, f, ctx, tile + t->offset, t->numel, dtile + t->offset);
    }
}

static mt_model_config parse_ok(const char *json, const char *name)
{
    mt_model_config cfg;
    char err[512] = "";
    ck_assert_msg(mt_config_parse(json, name, &cfg, err, sizeof err) == 0, "%s: %s", name, err);
    return cfg;
}

/* The message of a config that must be refused contains every one of the fragments. */
static void parse_fails(const char *json, const char *name, const char *want1, const char *want2)
{
    mt_model_config cfg;
    char err[512] = "";
    ck_assert_msg(mt_config_parse(json, name, &cfg, err, sizeof err) != 0, "%s: accepted", name);
    fprintf(stderr, "  refused: %s\n", err);
    ck_assert_msg(strstr(err, name) && strstr(err, want1) && (!want2 || strstr(err, want2)),
                  "%s: message '%s' lacks '%s' / '%s'", name, err, want1, want2 ? want2 : "");
}

/* ------------------------------------------------------------------------------------------ */
/* 1) Configs                                                                                  */

/* Qwen/Qwen3-30B-A3B's config.json as published on the Hub. */
static const char qwen3_30b_a3b_json[] =
    "{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"attention_bias\": false, \"attention_dropout\": 0.0,"
    " \"bos_token_id\": 151643, \"decoder_sparse_step\": 1, \"eos_token_id\": 151645, \"head_dim\": 128,"
    " \"hidden_act\": \"silu\", \"hidden_size\": 2048, \"initializer_range\": 0.02, \"intermediate_size\": 6144,"
    " \"max_position_embeddings\": 40960, \"max_window_layers\": 48, \"mlp_only_layers\": [],"
    " \"model_type\": \"qwen3_moe\", \"moe_intermediate_size\": 768, \"norm_topk_prob\": true,"
    " \"num_attention_heads\": 32, \"num_experts\": 128, \"num_experts_per_tok\": 8, \"num_hidden_layers\": 48,"
    " \"num_key_value_heads\": 4, \"output_router_logits\": false, \"rms_norm_eps\": 1e-06,"
    " \"rope_scaling\": null, \"rope_theta\": 1000000.0, \"router_aux_loss_coef\": 0.001,"
    " \"sliding_window\": null, \"tie_word_embeddings\": false, \"torch_dtype\": \"bfloat16\","
    " \"transformers_version\": \"4.51.0\", \"use_cache\": true, \"use_sliding_window\": false,"
    " \"vocab_size\": 151936}";

/* mistralai/Mixtral-8x7B-v0.1's config.json. */
static const char mixtral_8x7b_json[] =
    "{\"architectures\": [\"MixtralForCausalLM\"], \"attention_dropout\": 0.0, \"bos_token_id\": 1,"
    " \"eos_token_id\": 2, \"hidden_act\": \"silu\", \"hidden_size\": 4096, \"initializer_range\": 0.02,"
    " \"intermediate_size\": 14336, \"max_position_embeddings\": 32768, \"model_type\": \"mixtral\","
    " \"num_attention_heads\": 32, \"num_experts_per_tok\": 2, \"num_hidden_layers\": 32,"
    " \"num_key_value_heads\": 8, \"num_local_experts\": 8, \"output_router_logits\": false,"
    " \"rms_norm_eps\": 1e-05, \"rope_theta\": 1000000.0, \"router_aux_loss_coef\": 0.02,"
    " \"sliding_window\": null, \"tie_word_embeddings\": false, \"torch_dtype\": \"bfloat16\","
    " \"transformers_version\": \"4.36.0.dev0\", \"use_cache\": true, \"vocab_size\": 32000}";

/* The published totals: Qwen3-30B-A3B "30.5B in total and 3.3B activated" (the model card's
 * figures: 3.35B written down to 3.3), Mixtral-8x7B 46.7B and 12.9B. Counted here by hand from
 * the shapes: per layer q, k, v, o, two norms, q/k norms; router E*d; 3 * Ie * d per expert. */
START_TEST(test_published_counts)
{
    mt_model_config q = parse_ok(qwen3_30b_a3b_json, "Qwen3-30B-A3B/config.json");
    ck_assert_int_eq(q.family, MT_FAMILY_QWEN3_MOE);
    ck_assert_str_eq(q.model_type, "qwen3_moe");
    ck_assert_int_eq(q.experts, 128);
    ck_assert_int_eq(q.experts_per_token, 8);
    ck_assert_int_eq(q.expert_intermediate, 768);
    ck_assert_int_eq(q.intermediate, 6144);
    ck_assert(q.norm_topk_prob && q.qk_norm && !q.qkv_bias && !q.tied && !q.output_router_logits);
    ck_assert_int_eq(q.decoder_sparse_step, 1);
    ck_assert_int_eq(q.mlp_only_layers_count, 0);
    ck_assert_int_eq(q.head_dim, 128);
    ck_assert_int_eq(q.sliding_window, 0);
    ck_assert(q.router_aux_loss_coef == 0.001 && q.rope_theta == 1e6);
    ck_assert_int_eq(mt_config_sparse_layers(&q), 48);
    ck_assert(!mt_config_has_dense_layers(&q));
    const int64_t attn = 2 * 4096 * 2048 + 2 * 512 * 2048 + 2 * 2048 + 2 * 128;
    const int64_t table = 151936LL * 2048;
    const int64_t total = 48 * (attn + 128 * 2048 + 128LL * 3 * 768 * 2048) + 2 * table + 2048;
    const int64_t active = 48 * (attn + 128 * 2048 + 8LL * 3 * 768 * 2048) + 2 * table + 2048;
    fprintf(stderr, "Qwen3-30B-A3B: %lld parameters (%.2fB), %lld active (%.2fB)\n",
            (long long)mt_config_param_count(&q), mt_config_param_count(&q) / 1e9,
            (long long)mt_config_active_param_count(&q), mt_config_active_param_count(&q) / 1e9);
    ck_assert_int_eq(mt_config_param_count(&q), total);
    ck_assert_int_eq(total, 30532122624LL);
    ck_assert_int_eq(mt_config_active_param_count(&q), active);
    ck_assert_int_eq(active, 3353032704LL);
    /* The FLOPs convention's N: active, without the embedding table. */
    ck_assert_int_eq(mt_config_flops_params(&q), active - table);

    mt_model_config m = parse_ok(mixtral_8x7b_json, "Mixtral-8x7B/config.json");
    ck_assert_int_eq(m.family, MT_FAMILY_MIXTRAL);
    ck_assert_int_eq(m.experts, 8);
    ck_assert_int_eq(m.experts_per_token, 2);
    ck_assert_int_eq(m.expert_intermediate, 14336);
    ck_assert(m.norm_topk_prob && !m.qk_norm);
    ck_assert(m.router_aux_loss_coef == 0.02 && m.rms_eps == 1e-5);
    fprintf(stderr, "Mixtral-8x7B: %.3fB parameters, %.3fB active\n", mt_config_param_count(&m) / 1e9,
            mt_config_active_param_count(&m) / 1e9);
    ck_assert(fabs(mt_config_param_count(&m) / 1e9 - 46.7) < 0.05);
    ck_assert(fabs(mt_config_active_param_count(&m) / 1e9 - 12.9) < 0.05);
}
END_TEST

/* transformers' defaults when the keys are absent (Qwen3MoeConfig, MixtralConfig). */
START_TEST(test_defaults)
{
    mt_model_config q = parse_ok("{\"model_type\": \"qwen3_moe\", \"hidden_size\": 64, \"intermediate_size\": 96,"
                                 " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"vocab_size\": 50}",
                                 "qwen3_moe-defaults");
    ck_assert_int_eq(q.experts, 128);
    ck_assert_int_eq(q.experts_per_token, 8);
    ck_assert_int_eq(q.expert_intermediate, 768);
    ck_assert(!q.norm_topk_prob && !q.output_router_logits && q.router_aux_loss_coef == 0.001);
    ck_assert_int_eq(q.decoder_sparse_step, 1);
    ck_assert_int_eq(q.head_dim, 16); /* hidden / heads: Qwen3MoeAttention's fallback, not Qwen3's 128 */
    ck_assert_int_eq(q.max_positions, 32768);
    ck_assert(q.rms_eps == 1e-6 && q.rope_theta == 10000.0);

    mt_model_config m = parse_ok("{\"model_type\": \"mixtral\", \"hidden_size\": 64, \"intermediate_size\": 96,"
                                 " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"vocab_size\": 50}",
                                 "mixtral-defaults");
    ck_assert_int_eq(m.experts, 8);
    ck_assert_int_eq(m.experts_per_token, 2);
    ck_assert_int_eq(m.expert_intermediate, 96);
    ck_assert(m.norm_topk_prob);
    ck_assert_int_eq(m.sliding_window, 0); /* MixtralConfig's null, unlike Mistral's 4096 */
    ck_assert_int_eq(m.max_positions, 131072);
    ck_assert(m.rms_eps == 1e-5 && m.rope_theta == 1e6);

    /* Each family also reads the other's spelling of the expert count. */
    mt_model_config a = parse_ok("{\"model_type\": \"qwen3_moe\", \"hidden_size\": 64, \"intermediate_size\": 96,"
                                 " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"vocab_size\": 50,"
                                 " \"num_local_experts\": 6, \"num_experts_per_tok\": 2}", "qwen3_moe-alias");
    ck_assert_int_eq(a.experts, 6);
    mt_model_config b = parse_ok("{\"model_type\": \"mixtral\", \"hidden_size\": 64, \"intermediate_size\": 96,"
                                 " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"vocab_size\": 50,"
                                 " \"num_experts\": 4, \"sliding_window\": 4096}", "mixtral-alias");
    ck_assert_int_eq(b.experts, 4);
    ck_assert_int_eq(b.sliding_window, 4096);
}
END_TEST

/* A base tiny qwen3_moe config followed by extra keys. */
#define QWEN3_MOE_BASE                                                                                  \
    "{\"model_type\": \"qwen3_moe\", \"hidden_size\": 20, \"intermediate_size\": 27, \"num_hidden_layers\": 6," \
    " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 6, \"vocab_size\": 29,"    \
    " \"num_experts\": 5, \"num_experts_per_tok\": 2, \"moe_intermediate_size\": 7"
#define MIXTRAL_BASE                                                                                    \
    "{\"model_type\": \"mixtral\", \"hidden_size\": 20, \"intermediate_size\": 9, \"num_hidden_layers\": 2," \
    " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 6, \"vocab_size\": 29,"    \
    " \"num_local_experts\": 4"

/* Which layers are sparse, as Qwen3MoeDecoderLayer decides, and the counts that follow. */
START_TEST(test_sparse_layers)
{
    mt_model_config c = parse_ok(QWEN3_MOE_BASE ", \"decoder_sparse_step\": 2, \"mlp_only_layers\": [3, 0, 3]}",
                                 "mixed");
    ck_assert_int_eq(c.mlp_only_layers_count, 2); /* sorted, the repeat dropped */
    ck_assert_int_eq(c.mlp_only_layers[0], 0);
    ck_assert_int_eq(c.mlp_only_layers[1], 3);
    const bool want[6] = { false, true, false, false, false, true }; /* (i+1) % 2 == 0, not 3 */
    for (int i = 0; i < 6; i++) ck_assert_int_eq(mt_config_layer_is_sparse(&c, i), want[i]);
    ck_assert_int_eq(mt_config_sparse_layers(&c), 2);
    ck_assert(mt_config_has_dense_layers(&c));

    /* The total count is what the tiles hold (padding aside), layer by layer. */
    mt_tile_layout lay;
    int64_t held = 0;
    for (int i = 0; i < 6; i++) {
        mt_layout_build_layer(&c, i, &lay);
        ck_assert_int_eq(mt_layout_is_sparse(&lay), want[i]);
        for (int s = 0; s < lay.ntensors; s++) held += lay.tensors[s].numel;
    }
    mt_layout_build(&c, MT_TILE_EMBED, &lay);
    held += lay.tensors[MT_E_EMBED].numel;
    mt_layout_build(&c, MT_TILE_HEAD, &lay);
    held += lay.tensors[MT_H_NORM].numel + lay.tensors[MT_H_LM_HEAD].numel;
    ck_assert_int_eq(mt_config_param_count(&c), held);
    /* Active: each sparse layer uses 2 of its 5 experts. */
    ck_assert_int_eq(mt_config_param_count(&c) - mt_config_active_param_count(&c), 2 * 3 * (3 * 7 * 20));

    /* No experts: every layer dense, the counts a dense model's. */
    mt_model_config z = parse_ok("{\"model_type\": \"qwen3_moe\", \"hidden_size\": 20, \"intermediate_size\": 27,"
                                 " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"head_dim\": 6, \"vocab_size\": 29,"
                                 " \"num_experts\": 0}", "qwen3_moe-no-experts");
    ck_assert_int_eq(mt_config_sparse_layers(&z), 0);
    mt_layout_build(&z, MT_TILE_LAYER, &lay);
    ck_assert(!mt_layout_is_sparse(&lay));
    ck_assert_int_eq(lay.ntensors, MT_L_COUNT);
    ck_assert_int_eq(mt_config_active_param_count(&z), mt_config_param_count(&z));
}
END_TEST

/* Every field of the two configs is the same (the run's override is not the model's). */
static void assert_same_config(const mt_model_config *a, const mt_model_config *b)
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
}

/* Saved configs load back as the same model, under each family's own key names. */
START_TEST(test_config_roundtrip)
{
    const char *const jsons[] = {
        qwen3_30b_a3b_json,
        mixtral_8x7b_json,
        QWEN3_MOE_BASE ", \"decoder_sparse_step\": 2, \"mlp_only_layers\": [4, 1], \"norm_topk_prob\": true,"
                       " \"router_aux_loss_coef\": 0.0125, \"output_router_logits\": true}",
        MIXTRAL_BASE ", \"sliding_window\": 777, \"output_router_logits\": true, \"num_experts_per_tok\": 3}",
    };
    for (size_t i = 0; i < sizeof jsons / sizeof jsons[0]; i++) {
        mt_model_config a = parse_ok(jsons[i], "roundtrip");
        a.router_aux = MT_ROUTER_AUX_OFF; /* a run option: not saved */
        char path[] = "/tmp/mt-moe-config.XXXXXX";
        int fd = mkstemp(path);
        ck_assert(fd >= 0);
        close(fd);
        char err[512] = "";
        ck_assert_msg(mt_config_save(&a, path, err, sizeof err) == 0, "%s", err);
        mt_model_config b;
        ck_assert_msg(mt_config_load(path, &b, err, sizeof err) == 0, "%s", err);
        ck_assert_int_eq(b.router_aux, MT_ROUTER_AUX_FROM_CONFIG);
        assert_same_config(&a, &b);
        FILE *f = fopen(path, "r");
        char text[8192] = "";
        ck_assert(fread(text, 1, sizeof text - 1, f) > 0);
        fclose(f);
        unlink(path);
        const bool mixtral = a.family == MT_FAMILY_MIXTRAL;
        ck_assert(strstr(text, mixtral ? "\"num_local_experts\"" : "\"num_experts\"") != NULL);
        ck_assert(strstr(text, mixtral ? "\"MixtralForCausalLM\"" : "\"Qwen3MoeForCausalLM\"") != NULL);
        ck_assert(strstr(text, "\"moe_intermediate_size\"") == NULL || !mixtral);
    }
}
END_TEST

/* Bad MoE keys are refused with the file and the key named. */
START_TEST(test_config_errors)
{
    parse_fails(QWEN3_MOE_BASE ", \"num_experts_per_tok\": 6}", "k-over-E", "num_experts_per_tok", "between 1 and");
    parse_fails(QWEN3_MOE_BASE ", \"num_experts_per_tok\": 0}", "k-zero", "num_experts_per_tok", NULL);
    parse_fails("{\"model_type\": \"qwen3_moe\", \"hidden_size\": 20, \"intermediate_size\": 27,"
                " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"head_dim\": 6, \"vocab_size\": 29,"
                " \"num_experts\": 300}",
                "too-many", "num_experts", "between 0 and 256");
    parse_fails(QWEN3_MOE_BASE ", \"num_local_experts\": 4}", "two-counts", "num_local_experts", "disagrees");
    parse_fails(QWEN3_MOE_BASE ", \"moe_intermediate_size\": 0}", "no-width", "moe_intermediate_size", "positive");
    parse_fails(QWEN3_MOE_BASE ", \"decoder_sparse_step\": 0}", "step-zero", "decoder_sparse_step", NULL);
    parse_fails(QWEN3_MOE_BASE ", \"mlp_only_layers\": [2, 6]}", "dense-out-of-range", "mlp_only_layers",
                "layer 6 does not exist");
    parse_fails(QWEN3_MOE_BASE ", \"mlp_only_layers\": [-1]}", "dense-negative", "mlp_only_layers[0]", NULL);
    parse_fails(QWEN3_MOE_BASE ", \"mlp_only_layers\": 3}", "dense-not-array", "mlp_only_layers", "array");
    parse_fails(QWEN3_MOE_BASE ", \"router_aux_loss_coef\": -1}", "negative-coef", "router_aux_loss_coef", NULL);
    parse_fails(QWEN3_MOE_BASE ", \"output_router_logits\": 1}", "logits-not-bool", "output_router_logits", NULL);
    parse_fails(QWEN3_MOE_BASE ", \"use_sliding_window\": true}", "qwen3-moe-window", "use_sliding_window", NULL);
    parse_fails(QWEN3_MOE_BASE ", \"attention_bias\": true}", "qwen3-moe-bias", "attention_bias", NULL);
    parse_fails(MIXTRAL_BASE ", \"router_jitter_noise\": 0.1}", "jitter", "router_jitter_noise", "not implemented");
    parse_fails("{\"model_type\": \"mixtral\", \"hidden_size\": 20, \"intermediate_size\": 9,"
                " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"head_dim\": 6, \"vocab_size\": 29,"
                " \"num_local_experts\": 0}",
                "mixtral-no-experts", "num_local_experts", NULL);
    parse_fails(MIXTRAL_BASE ", \"sliding_window\": \"4096\"}", "mixtral-window", "sliding_window", NULL);
    parse_fails(MIXTRAL_BASE ", \"hidden_act\": \"gelu\"}", "mixtral-act", "hidden_act", NULL);
    parse_fails("{\"model_type\": \"qwen2_moe\"}", "qwen2-moe", "model_type", "qwen3_moe, mixtral");
}
END_TEST

/* The aux loss's coefficient in effect: the config's switch, the run's override, sparse layers. */
START_TEST(test_router_aux_coef)
{
    mt_model_config c = parse_ok(QWEN3_MOE_BASE ", \"router_aux_loss_coef\": 0.25}", "aux");
    ck_assert(mt_config_router_aux_coef(&c) == 0.0); /* output_router_logits false */
    c.router_aux = MT_ROUTER_AUX_ON;
    ck_assert(mt_config_router_aux_coef(&c) == 0.25);
    c = parse_ok(QWEN3_MOE_BASE ", \"router_aux_loss_coef\": 0.25, \"output_router_logits\": true}", "aux-on");
    ck_assert(mt_config_router_aux_coef(&c) == 0.25);
    c.router_aux = MT_ROUTER_AUX_OFF;
    ck_assert(mt_config_router_aux_coef(&c) == 0.0);
    c.router_aux = (mt_router_aux_mode)7;
    char err[256] = "";
    ck_assert(mt_config_validate(&c, "override", err, sizeof err) != 0);
    mt_model_config d = parse_ok("{\"model_type\": \"qwen3\", \"hidden_size\": 64, \"intermediate_size\": 96,"
                                 " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"vocab_size\": 50}", "dense");
    d.router_aux = MT_ROUTER_AUX_ON;
    ck_assert(mt_config_router_aux_coef(&d) == 0.0); /* no router, no loss */
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* 2) The sparse layer's tile                                                                  */

/* Offsets grow with the slot, aligned, each tensor inside the tile and after the previous one. */
static void assert_layout_sane(const mt_tile_layout *lay)
{
    int64_t end = 0;
    for (int s = 0; s < lay->ntensors; s++) {
        const mt_tensor_desc *t = &lay->tensors[s];
        ck_assert_int_eq(t->offset % MT_TILE_ALIGN, 0);
        ck_assert_int_ge(t->offset, end);
        if (t->numel) end = t->offset + t->numel;
        ck_assert_int_eq(t->numel, t->numel ? (t->ndim == 2 ? t->shape[0] * t->shape[1] : t->shape[0]) : 0);
    }
    ck_assert_int_le(end, lay->numel);
    ck_assert_int_eq(lay->numel % MT_TILE_ALIGN, 0);
}

START_TEST(test_layout_qwen3_moe)
{
    mt_model_config c = parse_ok(QWEN3_MOE_BASE "}", "layout");
    mt_tile_layout lay;
    mt_layout_build(&c, MT_TILE_LAYER, &lay);
    assert_layout_sane(&lay);
    ck_assert(mt_layout_is_sparse(&lay));
    ck_assert_int_eq(lay.ntensors, MT_L_EXPERT_BASE + 3 * 5);
    for (int s = MT_L_GATE_W; s <= MT_L_DOWN_W; s++) ck_assert_int_eq(lay.tensors[s].numel, 0);
    ck_assert_str_eq(lay.tensors[MT_L_ROUTER_W].name, "mlp.gate.weight");
    ck_assert_int_eq(lay.tensors[MT_L_ROUTER_W].shape[0], 5);
    ck_assert_int_eq(lay.tensors[MT_L_ROUTER_W].shape[1], 20);
    ck_assert(lay.tensors[MT_L_ROUTER_W].decay);
    const mt_tensor_desc *g = &lay.tensors[mt_layout_expert_slot(3, MT_X_GATE)];
    const mt_tensor_desc *u = &lay.tensors[mt_layout_expert_slot(3, MT_X_UP)];
    const mt_tensor_desc *dn = &lay.tensors[mt_layout_expert_slot(3, MT_X_DOWN)];
    ck_assert_str_eq(g->name, "mlp.experts.3.gate_proj.weight");
    ck_assert_str_eq(u->name, "mlp.experts.3.up_proj.weight");
    ck_assert_str_eq(dn->name, "mlp.experts.3.down_proj.weight");
    ck_assert(g->shape[0] == 7 && g->shape[1] == 20 && dn->shape[0] == 20 && dn->shape[1] == 7 && dn->decay);
    /* One stride between experts, for every matrix. */
    const int64_t stride = mt_layout_expert_stride(&lay);
    ck_assert_int_gt(stride, 0);
    for (int e = 0; e < 5; e++)
        for (int x = 0; x < MT_X_COUNT; x++)
            ck_assert_int_eq(lay.tensors[mt_layout_expert_slot(e, x)].offset,
                             lay.tensors[mt_layout_expert_slot(0, x)].offset + e * stride);
    char name[256];
    mt_layout_full_name(&lay, 2, mt_layout_expert_slot(4, MT_X_UP), name, sizeof name);
    ck_assert_str_eq(name, "model.layers.2.mlp.experts.4.up_proj.weight");
    mt_layout_full_name(&lay, 0, MT_L_ROUTER_W, name, sizeof name);
    ck_assert_str_eq(name, "model.layers.0.mlp.gate.weight");

    /* A dense layer of the same model: the usual MLP, no router. */
    mt_model_config mixed = parse_ok(QWEN3_MOE_BASE ", \"mlp_only_layers\": [1]}", "layout-mixed");
    mt_layout_build_layer(&mixed, 1, &lay);
    assert_layout_sane(&lay);
    ck_assert(!mt_layout_is_sparse(&lay));
    ck_assert_int_eq(lay.ntensors, MT_L_COUNT);
    ck_assert_int_eq(lay.tensors[MT_L_GATE_W].numel, 27 * 20);
    ck_assert_str_eq(lay.tensors[MT_L_DOWN_W].name, "mlp.down_proj.weight");
    mt_layout_build_layer(&mixed, 0, &lay);
    ck_assert(mt_layout_is_sparse(&lay));
}
END_TEST

START_TEST(test_layout_mixtral)
{
    mt_model_config c = parse_ok(MIXTRAL_BASE "}", "layout-mixtral");
    mt_tile_layout lay;
    mt_layout_build(&c, MT_TILE_LAYER, &lay);
    assert_layout_sane(&lay);
    ck_assert_str_eq(lay.tensors[MT_L_ROUTER_W].name, "block_sparse_moe.gate.weight");
    /* w1 the gate, w3 the up, w2 the down projection (d, Ie). */
    ck_assert_str_eq(lay.tensors[mt_layout_expert_slot(0, MT_X_GATE)].name, "block_sparse_moe.experts.0.w1.weight");
    ck_assert_str_eq(lay.tensors[mt_layout_expert_slot(2, MT_X_UP)].name, "block_sparse_moe.experts.2.w3.weight");
    const mt_tensor_desc *w2 = &lay.tensors[mt_layout_expert_slot(3, MT_X_DOWN)];
    ck_assert_str_eq(w2->name, "block_sparse_moe.experts.3.w2.weight");
    ck_assert(w2->shape[0] == 20 && w2->shape[1] == 9);
    ck_assert_int_eq(lay.ntensors, MT_L_EXPERT_BASE + 3 * 4);
    /* The longest name a layout can hold fits. */
    mt_model_config big = parse_ok("{\"model_type\": \"mixtral\", \"hidden_size\": 8, \"intermediate_size\": 3,"
                                   " \"num_hidden_layers\": 1, \"num_attention_heads\": 2, \"vocab_size\": 11,"
                                   " \"num_local_experts\": 256}", "layout-256");
    mt_layout_build(&big, MT_TILE_LAYER, &lay);
    ck_assert_int_eq(lay.ntensors, MT_MAX_TILE_TENSORS);
    ck_assert_str_eq(lay.tensors[mt_layout_expert_slot(255, MT_X_GATE)].name,
                     "block_sparse_moe.experts.255.w1.weight");
}
END_TEST

static void runtime_up(void)
{
    mt_runtime_options ro = { .sched = "eager", .ncpu = 2, .ncuda = 0 };
    char err[512] = "";
    ck_assert_msg(mt_runtime_init(&ro, err, sizeof err) == 0, "mt_runtime_init: %s", err);
}

static void runtime_down(void) { mt_runtime_shutdown(); }

static void remove_dir(const char *dir)
{
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *de;
        char p[4096];
        while ((de = readdir(d)))
            if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..")) {
                snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
                unlink(p);
            }
        closedir(d);
    }
    rmdir(dir);
}

/* A sparse model saved as an HF directory holds every expert under its HF name and shape, and
 * loads back into a fresh state bit for bit, through the generic code of runtime/hf.c. */
static void run_hf_roundtrip(const char *json, const char *probe, int64_t rows, int64_t cols)
{
    mt_model_config cfg = parse_ok(json, "hf");
    char err[1024] = "";
    mt_host_state *a = mt_state_create(&cfg, MT_DTYPE_F32, 0, err, sizeof err);
    ck_assert_msg(a != NULL, "%s", err);
    mt_state_init_random(a, 7, 1.0);
    char dir[] = "/tmp/mt-moe-hf.XXXXXX";
    ck_assert(mkdtemp(dir) != NULL);
    ck_assert_msg(mt_hf_save(dir, a, MT_DTYPE_F32, 0, err, sizeof err) == 0, "%s", err);

    char path[4200];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    mt_st_file *f = mt_st_open(path, err, sizeof err);
    ck_assert_msg(f != NULL, "%s", err);
    const mt_st_tensor *t = mt_st_find(f, probe);
    ck_assert_msg(t != NULL, "%s: no tensor '%s'", path, probe);
    ck_assert(t->ndim == 2 && t->shape[0] == rows && t->shape[1] == cols);
    int64_t expected = 0;
    for (int i = 0; i < a->ntiles; i++)
        for (int s = 0; s < a->tiles[i].layout->ntensors; s++) expected += a->tiles[i].layout->tensors[s].numel > 0;
    ck_assert_int_eq(f->ntensors, expected);
    mt_st_close(f);

    mt_model_config back;
    ck_assert_msg(mt_config_load(dir, &back, err, sizeof err) == 0, "%s", err);
    assert_same_config(&cfg, &back);
    mt_host_state *b = mt_state_create(&back, MT_DTYPE_F32, 0, err, sizeof err);
    ck_assert_msg(b != NULL, "%s", err);
    ck_assert_msg(mt_hf_load(dir, b, err, sizeof err) == 0, "%s", err);
    for (int i = 0; i < a->ntiles; i++) {
        ck_assert_int_eq(a->tiles[i].numel, b->tiles[i].numel);
        ck_assert(memcmp(a->tiles[i].master, b->tiles[i].master, sizeof(float) * (size_t)a->tiles[i].numel) == 0);
    }
    mt_state_destroy(a);
    mt_state_destroy(b);
    remove_dir(dir);
}

START_TEST(test_hf_roundtrip)
{
    run_hf_roundtrip(QWEN3_MOE_BASE "}", "model.layers.5.mlp.experts.4.down_proj.weight", 20, 7);
    run_hf_roundtrip(MIXTRAL_BASE "}", "model.layers.0.block_sparse_moe.experts.3.w3.weight", 9, 20);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* 3) The router                                                                               */

enum { RN = 11 }; /* router rows */

/* The smallest gap, over rows, between the k-th and the (k+1)-th probability: finite differences
 * are only meaningful while no perturbation can change the choice. */
static double topk_gap(const double *probs, int64_t n, int64_t E, int64_t k)
{
    if (k == E) return INFINITY;
    double gap = INFINITY;
    int32_t *sel = mt_xmalloc((size_t)(k + 1) * sizeof(int32_t));
    double *w = dalloc(k + 1);
    for (int64_t r = 0; r < n; r++) {
        mt_cpu_router_topk_f64(1, E, k + 1, false, probs + r * E, sel, w);
        if (w[k - 1] - w[k] < gap) gap = w[k - 1] - w[k];
    }
    free(sel);
    free(w);
    return gap;
}

typedef struct router_case {
    int64_t E, k;
    bool renorm;
    double *logits, *R, *counts, aux_scale;
    double *probs, *w;
    int32_t *sel;
} router_case;

/* L = sum R * weights(logits) + aux_scale * sum_e counts_e * sum_r p_re (counts held fixed). */
static double router_objective(void *p)
{
    router_case *c = p;
    mt_cpu_router_softmax_f64(RN, c->E, c->logits, c->probs);
    mt_cpu_router_topk_f64(RN, c->E, c->k, c->renorm, c->probs, c->sel, c->w);
    double L = weighted_sum(c->R, c->w, RN * c->k);
    for (int64_t r = 0; r < RN; r++)
        for (int64_t e = 0; e < c->E; e++) L += c->aux_scale * c->counts[e] * c->probs[r * c->E + e];
    return L;
}

static void run_router_check(int64_t E, int64_t k, bool renorm, double aux_scale, uint64_t seed)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, seed);
    router_case c = { .E = E, .k = k, .renorm = renorm, .aux_scale = aux_scale };
    c.logits = drandom(&rng, RN * E, 1.5);
    c.R = drandom(&rng, RN * k, 1.0);
    c.counts = dalloc(E);
    c.probs = dalloc(RN * E);
    c.w = dalloc(RN * k);
    c.sel = mt_xmalloc((size_t)(RN * k) * sizeof(int32_t));
    router_objective(&c);
    for (int64_t a = 0; a < RN * k; a++) c.counts[c.sel[a]] += 1;
    const double gap = topk_gap(c.probs, RN, E, k);
    ck_assert_msg(gap > 1e-4, "top-k gap %.3e: pick another seed", gap);
    double *dlogits = dalloc(RN * E);
    for (int64_t i = 0; i < RN * E; i++) dlogits[i] = NAN; /* = */
    mt_cpu_router_backward_f64(RN, E, k, renorm, c.probs, c.sel, c.R, aux_scale ? c.counts : NULL, aux_scale, dlogits);
    char what[96];
    snprintf(what, sizeof what, "router E=%lld k=%lld renorm=%d aux=%g", (long long)E, (long long)k, renorm, aux_scale);
    check_grad(what, router_objective, &c, c.logits, RN * E, dlogits);
    free(dlogits); free(c.logits); free(c.R); free(c.counts); free(c.probs); free(c.w); free(c.sel);
}

START_TEST(test_router_grad)
{
    run_router_check(6, 3, false, 0.0, 101);
    run_router_check(6, 3, true, 0.0, 102);
    run_router_check(6, 3, true, 0.37, 103);
    run_router_check(7, 1, false, 0.2, 104);
    run_router_check(5, 5, false, 0.0, 105); /* k == E: the weights are the probabilities */
    run_router_check(5, 5, true, 0.3, 106);  /* ... which renormalisation leaves as they are */
    run_router_check(4, 1, true, 0.5, 107);  /* weights all 1: the router learns from the aux loss only */
}
END_TEST

/* Softmax against exp / sum, top k in rank order, ties to the lower index, NaN first. */
START_TEST(test_router_topk_rules)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 111);
    double *l = drandom(&rng, 3 * 9, 2.0), p[27];
    mt_cpu_router_softmax_f64(3, 9, l, p);
    for (int r = 0; r < 3; r++) {
        double sum = 0;
        for (int e = 0; e < 9; e++) sum += exp(l[r * 9 + e]);
        for (int e = 0; e < 9; e++) ck_assert(fabs(p[r * 9 + e] - exp(l[r * 9 + e]) / sum) <= 1e-15);
    }
    /* The float softmax in float agrees with the double one to float rounding. */
    float lf[27], pf[27];
    for (int i = 0; i < 27; i++) lf[i] = (float)l[i];
    mt_cpu_router_softmax_f32(3, 9, lf, pf);
    ck_assert(f32_rel_err(pf, p, 27) < 1e-6);
    int32_t sel[9];
    double w[9];
    mt_cpu_router_topk_f64(1, 9, 9, false, p, sel, w);
    for (int j = 1; j < 9; j++) ck_assert(w[j - 1] >= w[j]);
    free(l);

    const double ties[6] = { 0.1, 0.25, 0.05, 0.25, 0.1, 0.25 };
    mt_cpu_router_topk_f64(1, 6, 2, false, ties, sel, w);
    ck_assert(sel[0] == 1 && sel[1] == 3); /* three equal at the top: the two lowest indices */
    mt_cpu_router_topk_f64(1, 6, 4, false, ties, sel, w);
    ck_assert(sel[0] == 1 && sel[1] == 3 && sel[2] == 5 && sel[3] == 0);
    mt_cpu_router_topk_f64(1, 6, 4, true, ties, sel, w);
    ck_assert(fabs(w[0] - 0.25 / 0.85) < 1e-15 && fabs(w[3] - 0.1 / 0.85) < 1e-15);
    const double with_nan[4] = { 0.3, NAN, 0.6, 0.1 };
    mt_cpu_router_topk_f64(1, 4, 2, false, with_nan, sel, w);
    ck_assert(sel[0] == 1 && sel[1] == 2);
    const double equal[5] = { 0.2, 0.2, 0.2, 0.2, 0.2 };
    mt_cpu_router_topk_f64(1, 5, 3, false, equal, sel, w);
    ck_assert(sel[0] == 0 && sel[1] == 1 && sel[2] == 2);
}
END_TEST

/* Grouping: every assignment once, in its expert's group, tokens ascending; empty groups. */
START_TEST(test_group)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 121);
    enum { N = 37, E = 9, K = 3 };
    int32_t experts[N * K], offsets[E + 1], order[N * K];
    for (int r = 0; r < N; r++) {
        /* three distinct experts of 0..7: expert 8 gets none */
        int32_t a = (int32_t)(mt_test_uniform(&rng) * 8), b = (a + 1 + (int32_t)(mt_test_uniform(&rng) * 6)) % 8;
        int32_t c = a;
        while (c == a || c == b) c = (c + 1) % 8;
        experts[r * K] = a;
        experts[r * K + 1] = b;
        experts[r * K + 2] = c;
    }
    mt_moe_group(N, E, K, experts, offsets, order);
    ck_assert_int_eq(offsets[0], 0);
    ck_assert_int_eq(offsets[E], N * K);
    ck_assert_int_eq(offsets[8], offsets[9]); /* the expert no token chose */
    int seen[N * K] = { 0 };
    for (int e = 0; e < E; e++)
        for (int i = offsets[e]; i < offsets[e + 1]; i++) {
            ck_assert_int_eq(experts[order[i]], e);
            if (i > offsets[e]) ck_assert_int_lt(order[i - 1] / K, order[i] / K);
            seen[order[i]]++;
        }
    for (int a = 0; a < N * K; a++) ck_assert_int_eq(seen[a], 1);

    /* Gather and combine against plain loops. */
    enum { DG = 5 };
    double x[N * DG], o[N * K * DG], y[N * DG], want[N * DG], wts[N * K], rows[N * K * DG];
    mt_test_fill_f64(&rng, x, N * DG, 1.0);
    mt_test_fill_f64(&rng, o, N * K * DG, 1.0);
    mt_test_fill_f64(&rng, wts, N * K, 1.0);
    mt_test_fill_f64(&rng, y, N * DG, 1.0);
    memcpy(want, y, sizeof want);
    mt_cpu_moe_gather_f64(N * K, DG, K, order, x, rows);
    for (int i = 0; i < N * K; i++)
        for (int j = 0; j < DG; j++) {
            ck_assert(rows[i * DG + j] == x[(order[i] / K) * DG + j]);
            want[(order[i] / K) * DG + j] += wts[order[i]] * o[i * DG + j];
        }
    mt_cpu_moe_combine_f64(N * K, DG, K, order, wts, o, y);
    ck_assert(mt_test_rel_err_f64(y, want, N * DG) <= 1e-15);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* 4) One expert: L = sum R * (w * expert(X)) over X, its three matrices and w.                */

enum { XR = 9, XD = 10, XI = 7 };

typedef struct expert_case {
    double *X, *Wg, *Wu, *Wd, *w, *R, *g, *u, *s, *o;
} expert_case;

static double expert_objective(void *p)
{
    expert_case *c = p;
    mt_cpu_expert_forward_f64(XR, XD, XI, c->X, c->Wg, c->Wu, c->Wd, c->g, c->u, c->s, c->o);
    double L = 0;
    for (int64_t i = 0; i < XR; i++)
        for (int64_t j = 0; j < XD; j++) L += c->R[i * XD + j] * c->w[i] * c->o[i * XD + j];
    return L;
}

START_TEST(test_expert_grad)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 131);
    expert_case c;
    c.X = drandom(&rng, XR * XD, 1.0);
    c.Wg = drandom(&rng, XI * XD, 0.4);
    c.Wu = drandom(&rng, XI * XD, 0.4);
    c.Wd = drandom(&rng, XD * XI, 0.4);
    c.w = drandom(&rng, XR, 1.0);
    c.R = drandom(&rng, XR * XD, 1.0);
    c.g = dalloc(XR * XI); c.u = dalloc(XR * XI); c.s = dalloc(XR * XI); c.o = dalloc(XR * XD);
    expert_objective(&c);
    double *dX = dalloc(XR * XD), *dw = dalloc(XR), *dWg = dalloc(XI * XD), *dWu = dalloc(XI * XD);
    double *dWd = dalloc(XD * XI), *s = dalloc(XR * XI), *dz = dalloc(XR * XI), *du = dalloc(XR * XI);
    for (int i = 0; i < XR * XD; i++) dX[i] = NAN; /* = */
    for (int i = 0; i < XR; i++) dw[i] = NAN;      /* = */
    mt_cpu_expert_backward_f64(XR, XD, XI, c.X, c.Wg, c.Wu, c.Wd, c.g, c.u, c.w, c.R, dX, dw, dWg, dWu, dWd, s, dz, du);
    check_grad("expert dX", expert_objective, &c, c.X, XR * XD, dX);
    check_grad("expert dw", expert_objective, &c, c.w, XR, dw);
    check_grad("expert dWg", expert_objective, &c, c.Wg, XI * XD, dWg);
    check_grad("expert dWu", expert_objective, &c, c.Wu, XI * XD, dWu);
    check_grad("expert dWd", expert_objective, &c, c.Wd, XD * XI, dWd);
    /* the weight gradients are += */
    double *again = dalloc(XD * XI);
    memcpy(again, dWd, sizeof(double) * XD * XI);
    mt_cpu_expert_backward_f64(XR, XD, XI, c.X, c.Wg, c.Wu, c.Wd, c.g, c.u, c.w, c.R, dX, dw, dWg, dWu, again, s, dz, du);
    for (int i = 0; i < XD * XI; i++) ck_assert(fabs(again[i] - 2 * dWd[i]) <= 1e-12 * (1 + fabs(dWd[i])));
    free(again); free(dX); free(dw); free(dWg); free(dWu); free(dWd); free(s); free(dz); free(du);
    free(c.X); free(c.Wg); free(c.Wu); free(c.Wd); free(c.w); free(c.R); free(c.g); free(c.u); free(c.s); free(c.o);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* 5) The MoE block over given inputs x (n, d):                                                 */
/*    L = sum R * out + coef * load_balancing_loss(router rows of this call).                  */

enum { BN = 10 }; /* block rows */

static mt_model_config moe_config(const char *base, const char *extra)
{
    char json[2048];
    snprintf(json, sizeof json, "%s%s}", base, extra);
    return parse_ok(json, "test-config");
}

typedef struct block_case {
    mt_model_config cfg;
    mt_tile_layout lay;
    double *tile, *x, *R, *out, *probs, *scratch, coef;
    double stats[2 * MT_MAX_EXPERTS];
} block_case;

static double block_objective(void *p)
{
    block_case *c = p;
    memset(c->stats, 0, sizeof c->stats);
    mt_cpu_moe_forward_f64(&c->cfg, &c->lay, c->tile, BN, c->x, c->probs, c->out, NULL, NULL, c->stats, c->scratch);
    return weighted_sum(c->R, c->out, BN * c->cfg.hidden) + c->coef * mt_moe_aux_loss(c->cfg.experts, BN, c->stats);
}

typedef enum { ROUTE_RANDOM, ROUTE_STARVE_LAST, ROUTE_ALL_TO_ONE } route_kind;
#define ROUTE_PUSH 1.5 /* the router's weight on feature 0 that starves or favours an expert */

static void run_block_check(const char *what, mt_model_config cfg, route_kind route, double coef, uint64_t seed)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, seed);
    block_case c;
    memset(&c, 0, sizeof c);
    c.cfg = cfg;
    c.coef = coef;
    mt_layout_build(&c.cfg, MT_TILE_LAYER, &c.lay);
    const int64_t d = cfg.hidden, E = cfg.experts, k = cfg.experts_per_token, Ie = cfg.expert_intermediate;
    c.tile = dalloc(c.lay.numel);
    fill_tile(&rng, &c.lay, c.tile, 0.4);
    c.x = drandom(&rng, BN * d, 1.0);
    c.R = drandom(&rng, BN * d, 1.0);
    double *router = c.tile + c.lay.tensors[MT_L_ROUTER_W].offset;
    if (route != ROUTE_RANDOM) {
        /* Feature 0 of every token is large and positive; the router's column 0 pushes the last
         * expert out of every top k, or expert 2 into every one. */
        for (int64_t r = 0; r < BN; r++) c.x[r * d] = 2.0 + mt_test_uniform(&rng);
        for (int64_t i = 0; i < E * d; i++) router[i] *= 0.5;
        for (int64_t e = 0; e < E; e++) router[e * d] = 0;
        if (route == ROUTE_STARVE_LAST) router[(E - 1) * d] = -ROUTE_PUSH;
        else router[2 * d] = ROUTE_PUSH;
    }
    c.out = dalloc(BN * d);
    c.probs = dalloc(BN * E);
    const int64_t fs = mt_moe_forward_scratch_numel(&c.cfg, BN, false), bs = mt_moe_backward_scratch_numel(&c.cfg, BN);
    c.scratch = dalloc(fs > bs ? fs : bs);

    /* The forward keeping g and u gives the same output as the one that does not. */
    double *g = dalloc(BN * k * Ie), *u = dalloc(BN * k * Ie), *out2 = dalloc(BN * d);
    block_objective(&c);
    double stats[2 * MT_MAX_EXPERTS] = { 0 };
    mt_cpu_moe_forward_f64(&c.cfg, &c.lay, c.tile, BN, c.x, c.probs, out2, g, u, stats, c.scratch);
    ck_assert(memcmp(out2, c.out, sizeof(double) * (size_t)(BN * d)) == 0);
    ck_assert(memcmp(stats, c.stats, sizeof stats) == 0);
    double assigned = 0;
    for (int64_t e = 0; e < E; e++) assigned += stats[e];
    ck_assert(assigned == BN * k);
    if (route == ROUTE_STARVE_LAST) ck_assert_msg(stats[E - 1] == 0, "%s: the last expert got tokens", what);
    if (route == ROUTE_ALL_TO_ONE) ck_assert_msg(stats[2] == BN, "%s: expert 2 got %g of %d tokens", what, stats[2], BN);
    const double gap = topk_gap(c.probs, BN, E, k);
    ck_assert_msg(gap > 1e-4, "%s: top-k gap %.3e: pick another seed", what, gap);

    double *dx = dalloc(BN * d), *dtile = dalloc(c.lay.numel);
    for (int64_t i = 0; i < BN * d; i++) dx[i] = NAN; /* = */
    mt_cpu_moe_backward_f64(&c.cfg, &c.lay, c.tile, BN, c.x, c.probs, g, u, c.R, coef ? stats : NULL,
                            mt_moe_aux_grad_scale(E, BN, coef, 1.0), dx, dtile, c.scratch);
    fprintf(stderr, "MoE block %s: E=%lld k=%lld renorm=%d coef=%g\n", what, (long long)E, (long long)k,
            cfg.norm_topk_prob, coef);
    check_grad("block dx", block_objective, &c, c.x, BN * d, dx);
    check_tile_grads("block", block_objective, &c, &c.lay, c.tile, dtile);
    if (route == ROUTE_STARVE_LAST)
        for (int x = 0; x < MT_X_COUNT; x++) {
            const mt_tensor_desc *t = &c.lay.tensors[mt_layout_expert_slot((int)E - 1, x)];
            for (int64_t i = 0; i < t->numel; i++) ck_assert(dtile[t->offset + i] == 0.0);
        }
    free(dx); free(dtile); free(g); free(u); free(out2);
    free(c.tile); free(c.x); free(c.R); free(c.out); free(c.probs); free(c.scratch);
}

START_TEST(test_block_grad)
{
    run_block_check("qwen3_moe", moe_config(QWEN3_MOE_BASE, ""), ROUTE_RANDOM, 0.0, 141);
    run_block_check("qwen3_moe renormalised, aux", moe_config(QWEN3_MOE_BASE, ", \"norm_topk_prob\": true"),
                    ROUTE_RANDOM, 0.3, 142);
    run_block_check("mixtral top 3, aux", moe_config(MIXTRAL_BASE, ", \"num_experts_per_tok\": 3"), ROUTE_RANDOM,
                    0.05, 143);
}
END_TEST

/* An expert no token chose: no output, its gradients exactly zero (and the differences too). */
START_TEST(test_block_starved_expert)
{
    run_block_check("last expert starved", moe_config(QWEN3_MOE_BASE, ""), ROUTE_STARVE_LAST, 0.2, 151);
    run_block_check("last expert starved, top 1", moe_config(QWEN3_MOE_BASE, ", \"num_experts_per_tok\": 1"),
                    ROUTE_STARVE_LAST, 0.0, 152);
}
END_TEST

/* Every token to one expert: top 1 (the others starve; renormalised weights are all 1, so the
 * router learns from the aux loss alone) and top 2. */
START_TEST(test_block_all_to_one)
{
    run_block_check("all to expert 2, top 1", moe_config(QWEN3_MOE_BASE, ", \"num_experts_per_tok\": 1"),
                    ROUTE_ALL_TO_ONE, 0.0, 161);
    run_block_check("all to expert 2, top 1, renormalised, aux",
                    moe_config(QWEN3_MOE_BASE, ", \"num_experts_per_tok\": 1, \"norm_topk_prob\": true"),
                    ROUTE_ALL_TO_ONE, 0.4, 162);
    run_block_check("all to expert 2, top 2", moe_config(QWEN3_MOE_BASE, ""), ROUTE_ALL_TO_ONE, 0.1, 163);
}
END_TEST

/* k equal to the number of experts: every expert sees every token. */
START_TEST(test_block_all_experts)
{
    run_block_check("top 5 of 5", moe_config(QWEN3_MOE_BASE, ", \"num_experts_per_tok\": 5"), ROUTE_RANDOM, 0.2, 171);
    run_block_check("top 4 of 4, mixtral", moe_config(MIXTRAL_BASE, ", \"num_experts_per_tok\": 4"), ROUTE_RANDOM,
                    0.0, 172);
}
END_TEST

/* The load-balancing loss from the statistics two sparse layers' forwards gather equals
 * transformers' load_balancing_loss_func written out over their concatenated router rows: the
 * top k by repeated argmax, one-hot (rows, k, E), its mean over rows times the mean probability. */
START_TEST(test_aux_loss_value)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 175);
    const mt_model_config cfg = moe_config(QWEN3_MOE_BASE, ", \"num_experts_per_tok\": 3");
    mt_tile_layout lay;
    mt_layout_build(&cfg, MT_TILE_LAYER, &lay);
    enum { E = 5, K = 3, ROWS = 2 * BN };
    const int64_t d = cfg.hidden;
    double probs[ROWS * E], stats[2 * E] = { 0 };
    double *x = drandom(&rng, BN * d, 1.0), *out = dalloc(BN * d), *tile = dalloc(lay.numel);
    double *scratch = dalloc(mt_moe_forward_scratch_numel(&cfg, BN, false));
    for (int layer = 0; layer < 2; layer++) {
        fill_tile(&rng, &lay, tile, 0.5);
        mt_cpu_moe_forward_f64(&cfg, &lay, tile, BN, x, probs + layer * BN * E, out, NULL, NULL, stats, scratch);
    }
    double tokens_per_expert[K][E] = { { 0 } }, router_prob[E] = { 0 };
    for (int r = 0; r < ROWS; r++) {
        bool taken[E] = { false };
        for (int j = 0; j < K; j++) {
            int best = -1;
            for (int e = 0; e < E; e++)
                if (!taken[e] && (best < 0 || probs[r * E + e] > probs[r * E + best])) best = e;
            taken[best] = true;
            tokens_per_expert[j][best] += 1.0 / ROWS;
        }
        for (int e = 0; e < E; e++) router_prob[e] += probs[r * E + e] / ROWS;
    }
    double want = 0;
    for (int j = 0; j < K; j++)
        for (int e = 0; e < E; e++) want += tokens_per_expert[j][e] * router_prob[e];
    want *= E;
    const double got = mt_moe_aux_loss(E, ROWS, stats);
    fprintf(stderr, "load-balancing loss %.15f, written out %.15f\n", got, want);
    ck_assert_msg(fabs(got - want) <= 1e-14 * want, "aux loss %.17g, want %.17g", got, want);
    ck_assert(want > 0.1); /* k = 3 at perfect balance */
    free(x); free(out); free(tile); free(scratch);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* 6) The decoder layer with a sparse MLP: L = sum R * y + coef * aux(this layer's rows).      */

enum { LB = 2, LT = 5, LN = LB * LT };

typedef struct layer_case {
    mt_model_config cfg;
    mt_tile_layout lay;
    double *tile, *x, *R, *y, *scratch, coef;
    double stats[2 * MT_MAX_EXPERTS];
} layer_case;

static double layer_objective(void *p)
{
    layer_case *c = p;
    memset(c->stats, 0, sizeof c->stats);
    mt_cpu_layer_forward_aux_f64(&c->cfg, &c->lay, c->tile, LB, LT, c->x, c->y, NULL, c->scratch, c->stats);
    return weighted_sum(c->R, c->y, LN * c->cfg.hidden) + c->coef * mt_moe_aux_loss(c->cfg.experts, LN, c->stats);
}

static void run_layer_check(const char *what, mt_model_config cfg, double coef, uint64_t seed)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, seed);
    layer_case c;
    memset(&c, 0, sizeof c);
    c.cfg = cfg;
    c.coef = coef;
    mt_layout_build(&c.cfg, MT_TILE_LAYER, &c.lay);
    ck_assert(mt_layout_is_sparse(&c.lay));
    const int64_t nd = LN * cfg.hidden, E = cfg.experts;
    c.tile = dalloc(c.lay.numel);
    fill_tile(&rng, &c.lay, c.tile, 0.3);
    c.x = drandom(&rng, nd, 1.0);
    c.R = drandom(&rng, nd, 1.0);
    c.y = dalloc(nd);
    c.scratch = dalloc(mt_layer_scratch_numel(&c.cfg, LB, LT));
    double *saved = dalloc(mt_layer_saved_numel(&c.cfg, LB, LT)), *dx = dalloc(nd), *dtile = dalloc(c.lay.numel);
    double stats[2 * MT_MAX_EXPERTS] = { 0 };
    mt_cpu_layer_forward_aux_f64(&c.cfg, &c.lay, c.tile, LB, LT, c.x, c.y, saved, c.scratch, stats);
    /* the probabilities are saved after rms2: x rms1 q k v a lse h rms2 probs ... */
    const int64_t qd = cfg.heads * cfg.head_dim, kvd = cfg.kv_heads * cfg.head_dim;
    const double *probs = saved + 2 * nd + 2 * LN + 2 * LN * qd + 2 * LN * kvd + LN * cfg.heads;
    const double gap = topk_gap(probs, LN, E, cfg.experts_per_token);
    ck_assert_msg(gap > 1e-4, "%s: top-k gap %.3e: pick another seed", what, gap);
    for (int64_t i = 0; i < nd; i++) dx[i] = NAN; /* = */
    mt_cpu_layer_backward_aux_f64(&c.cfg, &c.lay, c.tile, LB, LT, saved, c.R, dx, dtile, c.scratch,
                                  coef ? stats : NULL, mt_moe_aux_grad_scale(E, LN, coef, 1.0));
    fprintf(stderr, "sparse layer %s: %s E=%lld k=%lld coef=%g\n", what, cfg.model_type, (long long)E,
            (long long)cfg.experts_per_token, coef);
    check_grad("layer dx", layer_objective, &c, c.x, nd, dx);
    check_tile_grads("layer", layer_objective, &c, &c.lay, c.tile, dtile);

    /* dtile is +=: a second backward doubles it. */
    double *dtile2 = dalloc(c.lay.numel);
    memcpy(dtile2, dtile, sizeof(double) * (size_t)c.lay.numel);
    mt_cpu_layer_backward_aux_f64(&c.cfg, &c.lay, c.tile, LB, LT, saved, c.R, dx, dtile2, c.scratch,
                                  coef ? stats : NULL, mt_moe_aux_grad_scale(E, LN, coef, 1.0));
    for (int64_t i = 0; i < c.lay.numel; i++) ck_assert(fabs(dtile2[i] - 2 * dtile[i]) <= 1e-12 * (1 + fabs(dtile[i])));
    free(dtile2); free(saved); free(dx); free(dtile);
    free(c.tile); free(c.x); free(c.R); free(c.y); free(c.scratch);
}

START_TEST(test_layer_grad)
{
    run_layer_check("qwen3_moe", moe_config(QWEN3_MOE_BASE, ", \"norm_topk_prob\": true"), 0.0, 181);
    run_layer_check("qwen3_moe with aux", moe_config(QWEN3_MOE_BASE, ""), 0.25, 182);
    run_layer_check("mixtral with aux", moe_config(MIXTRAL_BASE, ""), 0.1, 183);
}
END_TEST

/* Forward without `saved` gives the same y; every element of saved is written, nothing past
 * saved or scratch is touched, in forward and backward; a mixed model's sizes fit both kinds. */
static void run_sizes(mt_model_config cfg, int64_t layer, uint64_t seed)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, seed);
    mt_tile_layout lay;
    mt_layout_build_layer(&cfg, layer, &lay);
    const int64_t nd = LN * cfg.hidden, guard = 64;
    const int64_t saved_n = mt_layer_saved_numel(&cfg, LB, LT), scratch_n = mt_layer_scratch_numel(&cfg, LB, LT);
    double *tile = dalloc(lay.numel), *x = drandom(&rng, nd, 1.0), *y1 = dalloc(nd), *y2 = dalloc(nd);
    double *saved = dalloc(saved_n + guard), *scratch = dalloc(scratch_n + guard);
    fill_tile(&rng, &lay, tile, 0.3);
    for (int64_t i = 0; i < saved_n + guard; i++) saved[i] = NAN;
    for (int64_t i = 0; i < scratch_n + guard; i++) scratch[i] = NAN;
    const double sentinel = 12345.678;
    for (int64_t i = 0; i < guard; i++) saved[saved_n + i] = scratch[scratch_n + i] = sentinel;
    mt_cpu_layer_forward_f64(&cfg, &lay, tile, LB, LT, x, y1, saved, scratch);
    /* The kind of layer that sets the size writes all of it. */
    int64_t written = 0;
    while (written < saved_n && !isnan(saved[written])) written++;
    const bool sparse = mt_layout_is_sparse(&lay);
    const int64_t dense_part = 2 * LN * cfg.intermediate;
    const int64_t sparse_part = LN * cfg.experts + 2 * LN * cfg.experts_per_token * cfg.expert_intermediate;
    const int64_t other = sparse ? (mt_config_has_dense_layers(&cfg) ? dense_part : 0)
                                 : (mt_config_sparse_layers(&cfg) > 0 ? sparse_part : 0);
    const bool sets_size = (sparse ? sparse_part : dense_part) >= other;
    if (sets_size) ck_assert_msg(written == saved_n, "saved[%lld] of %lld never written", (long long)written,
                                 (long long)saved_n);
    mt_cpu_layer_forward_f64(&cfg, &lay, tile, LB, LT, x, y2, NULL, scratch);
    const double e = mt_test_rel_err_f64(y2, y1, nd);
    fprintf(stderr, "saved-free forward %s layer %lld (%s): rel diff %.3e\n", cfg.model_type, (long long)layer,
            mt_layout_is_sparse(&lay) ? "sparse" : "dense", e);
    ck_assert_msg(e <= 1e-14, "y without saved differs: rel %.3e", e);
    double *dx = dalloc(nd), *dtile = dalloc(lay.numel);
    mt_cpu_layer_backward_f64(&cfg, &lay, tile, LB, LT, saved, y1, dx, dtile, scratch);
    for (int64_t i = 0; i < nd; i++) ck_assert(isfinite(dx[i]));
    for (int64_t i = 0; i < guard; i++) {
        ck_assert_msg(saved[saved_n + i] == sentinel, "write past mt_layer_saved_numel");
        ck_assert_msg(scratch[scratch_n + i] == sentinel, "write past mt_layer_scratch_numel");
    }
    free(tile); free(x); free(y1); free(y2); free(saved); free(scratch); free(dx); free(dtile);
}

START_TEST(test_layer_sizes)
{
    run_sizes(moe_config(QWEN3_MOE_BASE, ""), 0, 191);
    run_sizes(moe_config(MIXTRAL_BASE, ", \"num_experts_per_tok\": 4"), 1, 192);
    /* mixed: dense layers wider (I = 27) than k experts (2 * 7), and the other way round */
    run_sizes(moe_config(QWEN3_MOE_BASE, ", \"mlp_only_layers\": [2]"), 2, 193);
    run_sizes(moe_config(QWEN3_MOE_BASE, ", \"mlp_only_layers\": [2]"), 3, 194);
    run_sizes(moe_config(QWEN3_MOE_BASE, ", \"mlp_only_layers\": [2], \"moe_intermediate_size\": 30"), 2, 195);
    run_sizes(moe_config(QWEN3_MOE_BASE, ", \"mlp_only_layers\": [2], \"moe_intermediate_size\": 30"), 4, 196);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* 7) A whole tiny model: embedding -> layers (sparse and dense) -> head;                      */
/*    loss = mean cross-entropy + coef * load_balancing_loss over every sparse layer's rows.   */

typedef struct tiny_model {
    mt_model_config cfg;
    mt_tile_layout elay, hlay, *llay;
    double *embed, **layer, *head, *dembed, **dlayer, *dhead;
    int32_t tokens[LN], targets[LN];
    int64_t counted;
    double *acts, *saved, *dacts, *scratch, coef;
    int64_t saved_n;
    double stats[2 * MT_MAX_EXPERTS];
} tiny_model;

static void tiny_init(tiny_model *m, mt_model_config cfg, double coef, uint64_t seed)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, seed);
    m->cfg = cfg;
    m->coef = coef;
    const int64_t L = cfg.layers, nd = LN * cfg.hidden;
    mt_layout_build(&cfg, MT_TILE_EMBED, &m->elay);
    mt_layout_build(&cfg, MT_TILE_HEAD, &m->hlay);
    m->llay = mt_xmalloc((size_t)L * sizeof *m->llay);
    m->layer = mt_xmalloc((size_t)L * sizeof(double *));
    m->dlayer = mt_xmalloc((size_t)L * sizeof(double *));
    m->embed = dalloc(m->elay.numel);
    m->dembed = dalloc(m->elay.numel);
    fill_tile(&rng, &m->elay, m->embed, 1.0);
    for (int64_t l = 0; l < L; l++) {
        mt_layout_build_layer(&cfg, l, &m->llay[l]);
        m->layer[l] = dalloc(m->llay[l].numel);
        m->dlayer[l] = dalloc(m->llay[l].numel);
        fill_tile(&rng, &m->llay[l], m->layer[l], 0.3);
    }
    m->head = dalloc(m->hlay.numel);
    m->dhead = dalloc(m->hlay.numel);
    fill_tile(&rng, &m->hlay, m->head, 0.5);
    m->counted = 0;
    for (int64_t r = 0; r < LN; r++) {
        m->tokens[r] = (int32_t)(mt_test_uniform(&rng) * cfg.vocab);
        m->targets[r] = (int32_t)(mt_test_uniform(&rng) * cfg.vocab);
    }
    m->targets[LT - 1] = m->targets[2 * LT - 1] = -1;
    for (int64_t r = 0; r < LN; r++) m->counted += m->targets[r] >= 0;
    m->acts = dalloc((L + 1) * nd);
    m->saved_n = mt_layer_saved_numel(&cfg, LB, LT);
    m->saved = dalloc(L * m->saved_n);
    m->dacts = dalloc(2 * nd);
    int64_t sn = mt_layer_scratch_numel(&cfg, LB, LT);
    if (mt_head_scratch_numel(&cfg, 4) > sn) sn = mt_head_scratch_numel(&cfg, 4);
    m->scratch = dalloc(sn);
}

static void tiny_free(tiny_model *m)
{
    for (int64_t l = 0; l < m->cfg.layers; l++) {
        free(m->layer[l]);
        free(m->dlayer[l]);
    }
    free(m->llay); free(m->layer); free(m->dlayer);
    free(m->embed); free(m->dembed); free(m->head); free(m->dhead);
    free(m->acts); free(m->saved); free(m->dacts); free(m->scratch);
}

/* The router rows of one forward call: every token of every sparse layer. */
static int64_t tiny_router_rows(const tiny_model *m) { return LN * mt_config_sparse_layers(&m->cfg); }

static double tiny_forward(tiny_model *m, bool keep)
{
    const int64_t nd = LN * m->cfg.hidden;
    memset(m->stats, 0, sizeof m->stats);
    mt_cpu_embedding_forward_f64(LN, m->cfg.hidden, m->embed + m->elay.tensors[MT_E_EMBED].offset, m->tokens, m->acts);
    for (int64_t l = 0; l < m->cfg.layers; l++)
        mt_cpu_layer_forward_aux_f64(&m->cfg, &m->llay[l], m->layer[l], LB, LT, m->acts + l * nd,
                                     m->acts + (l + 1) * nd, keep ? m->saved + l * m->saved_n : NULL, m->scratch,
                                     m->stats);
    int64_t counted;
    const double sum = mt_cpu_head_f64(&m->cfg, &m->hlay, m->head, m->embed, LN, m->acts + m->cfg.layers * nd,
                                       m->targets, 1.0, 4, NULL, NULL, NULL, m->scratch, &counted);
    ck_assert_int_eq(counted, m->counted);
    return sum / (double)counted + m->coef * mt_moe_aux_loss(m->cfg.experts, tiny_router_rows(m), m->stats);
}

static double tiny_objective(void *ctx) { return tiny_forward(ctx, false); }

static void tiny_backward(tiny_model *m)
{
    const int64_t L = m->cfg.layers, nd = LN * m->cfg.hidden;
    memset(m->dembed, 0, sizeof(double) * (size_t)m->elay.numel);
    memset(m->dhead, 0, sizeof(double) * (size_t)m->hlay.numel);
    for (int64_t l = 0; l < L; l++) memset(m->dlayer[l], 0, sizeof(double) * (size_t)m->llay[l].numel);
    tiny_forward(m, true);
    /* The counts over every sparse layer, known once the forward has run them all. */
    const double aux_scale = mt_moe_aux_grad_scale(m->cfg.experts, tiny_router_rows(m), m->coef, 1.0);
    double *dy = m->dacts, *dx = m->dacts + nd;
    int64_t counted;
    mt_cpu_head_f64(&m->cfg, &m->hlay, m->head, m->embed, LN, m->acts + L * nd, m->targets, 1.0 / (double)m->counted,
                    4, dy, m->dhead, m->dembed, m->scratch, &counted);
    for (int64_t l = L - 1; l >= 0; l--) {
        mt_cpu_layer_backward_aux_f64(&m->cfg, &m->llay[l], m->layer[l], LB, LT, m->saved + l * m->saved_n, dy, dx,
                                      m->dlayer[l], m->scratch, m->coef ? m->stats : NULL, aux_scale);
        double *t = dy; dy = dx; dx = t;
    }
    mt_cpu_embedding_backward_f64(LN, m->cfg.hidden, m->tokens, dy, m->dembed + m->elay.tensors[MT_E_EMBED].offset);
}

static void run_tiny_check(const char *what, mt_model_config cfg, double coef, uint64_t seed)
{
    tiny_model m;
    tiny_init(&m, cfg, coef, seed);
    tiny_backward(&m);
    fprintf(stderr, "tiny model %s: %s, %lld layers (%lld sparse), coef %g, loss %.6f\n", what, cfg.model_type,
            (long long)cfg.layers, (long long)mt_config_sparse_layers(&cfg), coef, tiny_forward(&m, false));
    check_tile_grads("embed", tiny_objective, &m, &m.elay, m.embed, m.dembed);
    for (int64_t l = 0; l < cfg.layers; l++) {
        char label[32];
        snprintf(label, sizeof label, "layer %lld", (long long)l);
        check_tile_grads(label, tiny_objective, &m, &m.llay[l], m.layer[l], m.dlayer[l]);
    }
    check_tile_grads("head", tiny_objective, &m, &m.hlay, m.head, m.dhead);
    tiny_free(&m);
}

START_TEST(test_tiny_model_qwen3_moe)
{
    /* layers 0 and 2 sparse, 1 dense; the aux loss spans both sparse layers' rows */
    run_tiny_check("qwen3_moe mixed", moe_config(QWEN3_MOE_BASE, ", \"num_hidden_layers\": 3, \"mlp_only_layers\": [1],"
                                                                 " \"norm_topk_prob\": true"), 0.3, 201);
}
END_TEST

START_TEST(test_tiny_model_mixtral)
{
    run_tiny_check("mixtral tied", moe_config(MIXTRAL_BASE, ", \"tie_word_embeddings\": true"), 0.0, 202);
    run_tiny_check("mixtral with aux", moe_config(MIXTRAL_BASE, ""), 0.2, 203);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* 8) The fp32 sparse layer computes what the double one does, forward and backward.           */

static void run_f32_vs_f64(mt_model_config cfg, double coef, uint64_t seed)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, seed);
    mt_tile_layout lay;
    mt_layout_build(&cfg, MT_TILE_LAYER, &lay);
    const int64_t nd = LN * cfg.hidden, E = cfg.experts;
    const int64_t saved_n = mt_layer_saved_numel(&cfg, LB, LT), scratch_n = mt_layer_scratch_numel(&cfg, LB, LT);
    double *tile = dalloc(lay.numel), *x = drandom(&rng, nd, 1.0), *R = drandom(&rng, nd, 1.0);
    fill_tile(&rng, &lay, tile, 0.3);
    double *y = dalloc(nd), *saved = dalloc(saved_n), *scratch = dalloc(scratch_n), *dx = dalloc(nd);
    double *dtile = dalloc(lay.numel), stats[2 * MT_MAX_EXPERTS] = { 0 };
    mt_cpu_layer_forward_aux_f64(&cfg, &lay, tile, LB, LT, x, y, saved, scratch, stats);
    mt_cpu_layer_backward_aux_f64(&cfg, &lay, tile, LB, LT, saved, R, dx, dtile, scratch, stats,
                                  mt_moe_aux_grad_scale(E, LN, coef, 1.0));

    float *tile32 = to_f32(tile, lay.numel), *x32 = to_f32(x, nd), *R32 = to_f32(R, nd);
    float *y32 = to_f32(y, nd), *saved32 = to_f32(saved, saved_n), *scratch32 = to_f32(scratch, scratch_n);
    float *dx32 = to_f32(dx, nd), *dtile32 = mt_xmalloc(sizeof(float) * (size_t)lay.numel);
    memset(dtile32, 0, sizeof(float) * (size_t)lay.numel);
    double stats32[2 * MT_MAX_EXPERTS] = { 0 };
    mt_cpu_layer_forward_aux_f32(&cfg, &lay, tile32, LB, LT, x32, y32, saved32, scratch32, stats32);
    for (int64_t e = 0; e < E; e++) ck_assert(stats32[e] == stats[e]); /* the same choice of experts */
    mt_cpu_layer_backward_aux_f32(&cfg, &lay, tile32, LB, LT, saved32, R32, dx32, dtile32, scratch32, stats32,
                                  mt_moe_aux_grad_scale(E, LN, coef, 1.0));
    const double ey = f32_rel_err(y32, y, nd), ex = f32_rel_err(dx32, dx, nd);
    double et = 0;
    for (int s = 0; s < lay.ntensors; s++) {
        const mt_tensor_desc *t = &lay.tensors[s];
        if (!t->numel) continue;
        const double e = f32_rel_err(dtile32 + t->offset, dtile + t->offset, t->numel);
        if (e > et) et = e;
    }
    fprintf(stderr, "fp32 vs f64 %s sparse layer: y %.3e, dx %.3e, worst tensor of dtile %.3e\n", cfg.model_type, ey,
            ex, et);
    ck_assert_msg(ey <= 1e-5, "fp32 y rel err %.3e", ey);
    ck_assert_msg(ex <= 1e-5, "fp32 dx rel err %.3e", ex);
    ck_assert_msg(et <= 1e-4, "fp32 dtile rel err %.3e", et);
    free(tile); free(x); free(R); free(y); free(saved); free(scratch); free(dx); free(dtile);
    free(tile32); free(x32); free(R32); free(y32); free(saved32); free(scratch32); free(dx32); free(dtile32);
}

START_TEST(test_f32_matches_f64)
{
    run_f32_vs_f64(moe_config(QWEN3_MOE_BASE, ", \"norm_topk_prob\": true"), 0.2, 211);
    run_f32_vs_f64(moe_config(MIXTRAL_BASE, ""), 0.0, 212);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* 9) The step graph on CPU workers runs a sparse model: its loss and gradients (two
 *    micro-batches, recompute from checkpoints) are those of the fp32 ops called directly.     */

static const char step_json[] =
    "{\"model_type\": \"qwen3_moe\", \"hidden_size\": 20, \"intermediate_size\": 27, \"num_hidden_layers\": 3,"
    " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 6, \"vocab_size\": 29,"
    " \"max_position_embeddings\": 64, \"num_experts\": 5, \"num_experts_per_tok\": 2,"
    " \"moe_intermediate_size\": 7, \"norm_topk_prob\": true}";

START_TEST(test_step_graph)
{
    enum { SB = 2, ST = 5, ACCUM = 2, SN = SB * ST };
    const mt_model_config cfg = parse_ok(step_json, "step");
    char err[512] = "";
    mt_host_state *st = mt_state_create(&cfg, MT_DTYPE_F32, 0, err, sizeof err);
    ck_assert_msg(st != NULL, "%s", err);
    mt_state_init_random(st, 9, 0.3);
    mt_step_config sc = mt_step_defaults();
    sc.B = SB; sc.T = ST; sc.K = 2; sc.accum = ACCUM; sc.clip = 0; sc.head_chunk = 3;
    mt_graph *g = mt_graph_create(st, &sc, err, sizeof err);
    ck_assert_msg(g != NULL, "%s", err);
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 221);
    int32_t tokens[ACCUM * SN], targets[ACCUM * SN];
    int64_t counted = 0;
    for (int i = 0; i < ACCUM * SN; i++) {
        tokens[i] = (int32_t)(mt_test_uniform(&rng) * cfg.vocab);
        targets[i] = i % 7 == 3 ? -1 : (int32_t)(mt_test_uniform(&rng) * cfg.vocab);
        counted += targets[i] >= 0;
    }
    const double loss = mt_graph_wait_loss(g, mt_graph_submit_compute(g, 1, tokens, targets), NULL);
    starpu_task_wait_for_all();

    /* The same step by hand: per micro-batch, forward keeping every layer, head, backward. */
    const int64_t L = cfg.layers, nd = SN * cfg.hidden, saved_n = mt_layer_saved_numel(&cfg, SB, ST);
    int64_t scratch_n = mt_layer_scratch_numel(&cfg, SB, ST);
    if (mt_head_scratch_numel(&cfg, 3) > scratch_n) scratch_n = mt_head_scratch_numel(&cfg, 3);
    float *acts = mt_xmalloc(sizeof(float) * (size_t)((L + 1) * nd)), *saved = mt_xmalloc(sizeof(float) * (size_t)(L * saved_n));
    float *scratch = mt_xmalloc(sizeof(float) * (size_t)scratch_n), *dy = mt_xmalloc(sizeof(float) * (size_t)nd);
    float *dx = mt_xmalloc(sizeof(float) * (size_t)nd);
    float **grad = mt_xmalloc(sizeof(float *) * (size_t)st->ntiles);
    for (int i = 0; i < st->ntiles; i++) grad[i] = calloc((size_t)st->tiles[i].numel, sizeof(float));
    const mt_tile *embed = &st->tiles[0], *head = &st->tiles[L + 1];
    const float *table = embed->master + embed->layout->tensors[MT_E_EMBED].offset;
    double want_loss = 0;
    for (int m = 0; m < ACCUM; m++) {
        mt_cpu_embedding_forward_f32(SN, cfg.hidden, table, tokens + m * SN, acts);
        for (int64_t l = 0; l < L; l++)
            mt_cpu_layer_forward_f32(&cfg, st->tiles[l + 1].layout, st->tiles[l + 1].master, SB, ST, acts + l * nd,
                                     acts + (l + 1) * nd, saved + l * saved_n, scratch);
        int64_t c;
        want_loss += mt_cpu_head_f32(&cfg, head->layout, head->master, embed->master, SN, acts + L * nd,
                                     targets + m * SN, 1.0 / (double)counted, 3, dy, grad[L + 1], grad[0], scratch, &c);
        for (int64_t l = L - 1; l >= 0; l--) {
            mt_cpu_layer_backward_f32(&cfg, st->tiles[l + 1].layout, st->tiles[l + 1].master, SB, ST,
                                      saved + l * saved_n, dy, dx, grad[l + 1], scratch);
            float *t = dy; dy = dx; dx = t;
        }
        mt_cpu_embedding_backward_f32(SN, cfg.hidden, tokens + m * SN, dy,
                                      grad[0] + embed->layout->tensors[MT_E_EMBED].offset);
    }
    want_loss /= (double)counted;
    fprintf(stderr, "step graph on CPU workers, sparse model: loss %.9f, by hand %.9f\n", loss, want_loss);
    ck_assert_msg(fabs(loss - want_loss) <= 1e-6 * fabs(want_loss), "loss %.9g, by hand %.9g", loss, want_loss);
    for (int i = 0; i < st->ntiles; i++) {
        mt_tile *t = &st->tiles[i];
        starpu_data_acquire(t->h_grad, STARPU_R);
        double *want = dalloc(t->numel);
        for (int64_t e = 0; e < t->numel; e++) want[e] = grad[i][e];
        const double e = f32_rel_err(t->grad, want, t->numel);
        starpu_data_release(t->h_grad);
        fprintf(stderr, "  tile %d gradient rel err %.3e\n", i, e);
        ck_assert_msg(e <= 1e-5, "tile %d: gradient rel err %.3e", i, e);
        free(want);
        free(grad[i]);
    }
    free(grad); free(acts); free(saved); free(scratch); free(dy); free(dx);
    mt_graph_destroy(g);
    mt_state_destroy(st);
}
END_TEST

/* What the step cannot run yet is refused when the graph is built, naming what to change. */
START_TEST(test_step_refuses)
{
    const char *const extras[] = { ", \"output_router_logits\": true", ", \"mlp_only_layers\": [1]" };
    const char *const wants[] = { "output_router_logits", "mlp_only_layers" };
    for (int i = 0; i < 2; i++) {
        char json[1024];
        snprintf(json, sizeof json, "%.*s%s}", (int)strlen(step_json) - 1, step_json, extras[i]);
        const mt_model_config cfg = parse_ok(json, "step-refused");
        char err[512] = "";
        mt_host_state *st = mt_state_create(&cfg, MT_DTYPE_F32, 0, err, sizeof err);
        ck_assert_msg(st != NULL, "%s", err);
        mt_step_config sc = mt_step_defaults();
        sc.B = 1; sc.T = 4; sc.K = 1; sc.accum = 1; sc.head_chunk = 4;
        mt_graph *g = mt_graph_create(st, &sc, err, sizeof err);
        fprintf(stderr, "  refused: %s\n", err);
        ck_assert_msg(g == NULL && strstr(err, "mixture-of-experts") && strstr(err, wants[i]), "'%s'", err);
        mt_state_destroy(st);
    }
}
END_TEST

static Suite *moe_suite(void)
{
    Suite *s = suite_create("moe");
    TCase *config = tcase_create("config");
    tcase_add_test(config, test_published_counts);
    tcase_add_test(config, test_defaults);
    tcase_add_test(config, test_sparse_layers);
    tcase_add_test(config, test_config_roundtrip);
    tcase_add_test(config, test_config_errors);
    tcase_add_test(config, test_router_aux_coef);
    suite_add_tcase(s, config);
    TCase *layout = tcase_create("layout");
    tcase_add_test(layout, test_layout_qwen3_moe);
    tcase_add_test(layout, test_layout_mixtral);
    suite_add_tcase(s, layout);
    TCase *hf = tcase_create("runtime"); /* HF directories and the step graph, on StarPU */
    tcase_add_checked_fixture(hf, runtime_up, runtime_down);
    tcase_add_test(hf, test_hf_roundtrip);
    tcase_add_test(hf, test_step_graph);
    tcase_add_test(hf, test_step_refuses);
    suite_add_tcase(s, hf);
    TCase *ops = tcase_create("ops");
    tcase_add_test(ops, test_router_grad);
    tcase_add_test(ops, test_router_topk_rules);
    tcase_add_test(ops, test_group);
    tcase_add_test(ops, test_expert_grad);
    tcase_add_test(ops, test_block_grad);
    tcase_add_test(ops, test_block_starved_expert);
    tcase_add_test(ops, test_block_all_to_one);
    tcase_add_test(ops, test_block_all_experts);
    tcase_add_test(ops, test_aux_loss_value);
    suite_add_tcase(s, ops);
    TCase *layer = tcase_create("layer");
    tcase_add_test(layer, test_layer_grad);
    tcase_add_test(layer, test_layer_sizes);
    tcase_add_test(layer, test_f32_matches_f64);
    suite_add_tcase(s, layer);
    TCase *model = tcase_create("tiny_model");
    tcase_add_test(model, test_tiny_model_qwen3_moe);
    tcase_add_test(model, test_tiny_model_mixtral);
    suite_add_tcase(s, model);
    return s;
}

int main(void)
{
    return mt_test_run(moe_suite(), false);
}
