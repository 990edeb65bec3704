/* Check suite of the mixture-of-experts models as the runtime takes them (docs/moe.md): the
 * qwen3_moe and mixtral configs (Qwen3-30B-A3B's and Mixtral-8x7B's published values and
 * parameter counts, defaults, round trips, named errors), the sparse layer tile's layout, the HF
 * round trip of its tensors by name, and the step graph on CPU workers against the fp32 ops called
 * directly. Sizes are deliberately not multiples of 8. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backends/cpu/ops.h"
#include "models/config.h"
#include "models/layout.h"
#include "models/util.h"
#include "runtime/state.h"
#include "runtime/step.h"
#include "tests/moe_util.h"
#include "tests/testutil.h"

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

/* gpt-oss-20b's and gpt-oss-120b's config.json as published (models/configs/), counted as
 * OpenAI's model card gives them: 20.91B parameters of which 3.61B active, 116.83B of which
 * 5.13B active (active without the embedding table: the FLOPs convention's N). By hand from the
 * shapes: per layer q, k, v, o with their biases, 64 sinks, two norms; the router with its bias;
 * per expert gate/up (2 Ie x d + 2 Ie) and down (d x Ie + d). */
START_TEST(test_gpt_oss_counts)
{
    char err[512] = "";
    mt_model_config c;
    for (int big = 0; big <= 1; big++) {
        const char *path = mt_test_source_path(big ? "models/configs/gpt-oss-120b.json"
                                                   : "models/configs/gpt-oss-20b.json");
        ck_assert_msg(mt_config_load(path, &c, err, sizeof err) == 0, "%s", err);
        const int64_t L = big ? 36 : 24, E = big ? 128 : 32;
        ck_assert_int_eq(c.family, MT_FAMILY_GPT_OSS);
        ck_assert_str_eq(c.model_type, "gpt_oss");
        ck_assert_int_eq(c.layers, L);
        ck_assert_int_eq(c.experts, E);
        ck_assert_int_eq(c.experts_per_token, 4);
        ck_assert_int_eq(c.expert_intermediate, 2880);
        ck_assert_int_eq(c.head_dim, 64);
        ck_assert(c.qkv_bias && c.o_bias && c.attn_sinks && c.router_bias && c.expert_bias && !c.qk_norm && !c.tied);
        ck_assert(c.norm_topk_prob && c.swiglu_alpha == 1.702 && c.swiglu_limit == 7.0);
        ck_assert_int_eq(c.sliding_window, 128);
        ck_assert(c.rope_type == MT_ROPE_YARN && c.rope_scaling_factor == 32.0 && !c.rope_truncate);
        ck_assert_int_eq(c.rope_original_max_positions, 4096);
        ck_assert(c.rope_theta == 150000.0 && c.rms_eps == 1e-5 && c.router_aux_loss_coef == 0.9);
        /* sliding layers attend over the last 128 keys, the others over all; long sequences pass */
        ck_assert_int_eq(mt_config_layer_window(&c, 0), 128);
        ck_assert_int_eq(mt_config_layer_window(&c, 1), 0);
        ck_assert_int_eq(mt_config_layer_window(&c, L - 2), 128);
        ck_assert_int_eq(mt_config_layer_window(&c, L - 1), 0);
        ck_assert_int_eq(mt_config_max_seq_len(&c), 131072);
        const int64_t d = 2880, q = 64 * 64, kv = 8 * 64, Ie = 2880, V = 201088;
        const int64_t attn = (q * d + q) + 2 * (kv * d + kv) + (d * q + d) + 64 + 2 * d;
        const int64_t router = E * d + E, expert = (2 * Ie * d + 2 * Ie) + (d * Ie + d);
        const int64_t total = L * (attn + router + E * expert) + 2 * V * d + d;
        const int64_t n = L * (attn + router + 4 * expert) + V * d + d;
        ck_assert_int_eq(mt_config_param_count(&c), total);
        ck_assert_int_eq(mt_config_flops_params(&c), n);
        ck_assert_int_eq(mt_config_active_param_count(&c), n + V * d);
        ck_assert_int_eq(total, big ? 116829156672LL : 20914757184LL);
        ck_assert_int_eq(n, big ? 5132849472LL : 3608307264LL);
        fprintf(stderr, "%s: %lld parameters (%.2fB), %lld active without the table (%.2fB)\n", path,
                (long long)total, total / 1e9, (long long)n, n / 1e9);
        /* the layer tile holds every one of them, under HF's names where HF keeps them apart */
        mt_tile_layout lay;
        mt_layout_build(&c, MT_TILE_LAYER, &lay);
        int64_t held = 0;
        for (int s = 0; s < lay.ntensors; s++) held += lay.tensors[s].numel;
        ck_assert_int_eq(held, attn + router + E * expert);
        ck_assert_str_eq(lay.tensors[MT_L_O_B].name, "self_attn.o_proj.bias");
        ck_assert_str_eq(lay.tensors[MT_L_SINKS].name, "self_attn.sinks");
        ck_assert_str_eq(lay.tensors[MT_L_ROUTER_W].name, "mlp.router.weight");
        ck_assert_str_eq(lay.tensors[MT_L_ROUTER_B].name, "mlp.router.bias");
        ck_assert_str_eq(lay.tensors[MT_L_EXPERT_GU_B].name, "mlp.experts.gate_up_proj_bias");
        ck_assert_int_eq(lay.tensors[MT_L_EXPERT_GU_B].numel, E * 2 * Ie);
        ck_assert_int_eq(lay.tensors[MT_L_EXPERT_DOWN_B].numel, E * d);
        /* weight decay as HF Trainer: matrices and the sinks, not biases or norms */
        ck_assert(lay.tensors[MT_L_SINKS].decay && lay.tensors[MT_L_ROUTER_W].decay);
        ck_assert(!lay.tensors[MT_L_O_B].decay && !lay.tensors[MT_L_ROUTER_B].decay);
        ck_assert(!lay.tensors[MT_L_EXPERT_GU_B].decay && !lay.tensors[MT_L_EXPERT_DOWN_B].decay);
        /* offsets grow with the slot (the AdamW chunking relies on it) */
        for (int s = 1; s < lay.ntensors; s++) ck_assert(lay.tensors[s].offset >= lay.tensors[s - 1].offset);
    }
    /* the other families have none of gpt_oss's tensors */
    mt_model_config m = parse_ok(mixtral_8x7b_json, "Mixtral-8x7B/config.json");
    mt_tile_layout lay;
    mt_layout_build(&m, MT_TILE_LAYER, &lay);
    ck_assert(lay.tensors[MT_L_O_B].numel == 0 && lay.tensors[MT_L_SINKS].numel == 0);
    ck_assert(lay.tensors[MT_L_ROUTER_B].numel == 0 && lay.tensors[MT_L_EXPERT_GU_B].numel == 0);
    ck_assert_int_eq(mt_config_layer_window(&m, 0), 0);
}
END_TEST

/* A small gpt_oss config, to be closed with "}" or continued with more keys. */
#define GPT_OSS_BASE(layers)                                                                                  \
    "{\"model_type\": \"gpt_oss\", \"hidden_size\": 64, \"intermediate_size\": 48, \"num_attention_heads\": 4," \
    " \"vocab_size\": 50, \"num_hidden_layers\": " #layers

/* GptOssConfig's defaults when the keys are absent, its layer_types, and what it refuses. */
START_TEST(test_gpt_oss_keys)
{
    mt_model_config c = parse_ok(GPT_OSS_BASE(3) "}", "gpt_oss-defaults");
    ck_assert_int_eq(c.experts, 128);
    ck_assert_int_eq(c.experts_per_token, 4);
    ck_assert_int_eq(c.head_dim, 64);
    ck_assert_int_eq(c.kv_heads, 4);
    ck_assert_int_eq(c.sliding_window, 128);
    ck_assert(c.qkv_bias && c.o_bias && c.attn_sinks);
    ck_assert(c.rope_theta == 150000.0 && c.rope_type == MT_ROPE_YARN && c.rope_scaling_factor == 32.0);
    ck_assert(c.rope_beta_fast == 32.0 && c.rope_beta_slow == 1.0 && !c.rope_truncate);
    ck_assert_int_eq(c.rope_original_max_positions, 4096);
    ck_assert(c.router_aux_loss_coef == 0.9 && !c.output_router_logits); /* GptOssConfig's, not Mixtral's 0.001 */
    ck_assert_int_eq(c.max_positions, 131072);
    /* the default alternation: sliding, full, sliding */
    ck_assert(mt_config_layer_sliding(&c, 0) && !mt_config_layer_sliding(&c, 1) && mt_config_layer_sliding(&c, 2));
    /* given layer_types, a null window, no biases */
    c = parse_ok(GPT_OSS_BASE(3) ", \"attention_bias\": false,"
                 " \"layer_types\": [\"full_attention\", \"sliding_attention\", \"sliding_attention\"],"
                 " \"sliding_window\": null, \"num_local_experts\": 6, \"swiglu_limit\": 7.0}", "gpt_oss-keys");
    ck_assert(!c.qkv_bias && !c.o_bias && c.attn_sinks);
    ck_assert(!mt_config_layer_sliding(&c, 0) && mt_config_layer_sliding(&c, 1) && mt_config_layer_sliding(&c, 2));
    ck_assert_int_eq(mt_config_layer_window(&c, 1), 0); /* null: a sliding layer attends to every key */
    ck_assert(c.swiglu_limit == 7.0);
    ck_assert_int_eq(c.experts, 6);
    /* saved and read back: the same model, layer_types as given */
    char path[] = "/tmp/mt-gpt-oss-config.XXXXXX";
    int fd = mkstemp(path);
    ck_assert(fd >= 0);
    close(fd);
    char err[512] = "";
    for (int i = 0; i < 2; i++) {
        if (i == 1) {
            const char *published = mt_test_source_path("models/configs/gpt-oss-20b.json");
            ck_assert_msg(mt_config_load(published, &c, err, sizeof err) == 0, "%s", err);
        }
        ck_assert_msg(mt_config_save(&c, path, err, sizeof err) == 0, "%s", err);
        mt_model_config b;
        ck_assert_msg(mt_config_load(path, &b, err, sizeof err) == 0, "%s", err);
        assert_same_config(&c, &b);
        FILE *f = fopen(path, "r");
        char text[16384] = "";
        ck_assert(fread(text, 1, sizeof text - 1, f) > 0);
        fclose(f);
        ck_assert(strstr(text, "\"GptOssForCausalLM\"") && strstr(text, "\"num_local_experts\"") &&
                  strstr(text, "\"layer_types\"") && strstr(text, "\"swiglu_limit\""));
    }
    /* a plain rope and no layer_types: saved so that GptOssConfig (which reads a missing rope as
     * its yarn) builds the same model, and read back to the same bytes */
    c = parse_ok(GPT_OSS_BASE(2) ", \"rope_parameters\": {\"rope_theta\": 10000.0, \"rope_type\": \"default\"}}",
                 "gpt_oss-plain");
    ck_assert(c.rope_type == MT_ROPE_DEFAULT && c.rope_theta == 10000.0 && c.layer_types_count == 0);
    ck_assert_msg(mt_config_save(&c, path, err, sizeof err) == 0, "%s", err);
    mt_model_config again;
    ck_assert_msg(mt_config_load(path, &again, err, sizeof err) == 0, "%s", err);
    ck_assert(memcmp(&c, &again, sizeof c) == 0);
    unlink(path);
    /* refused, naming the key */
    parse_fails(GPT_OSS_BASE(3) ", \"layer_types\": [\"full_attention\"]}", "gpt_oss-types", "layer_types",
                "one per layer");
    parse_fails(GPT_OSS_BASE(1) ", \"layer_types\": [\"chunked_attention\"]}", "gpt_oss-type", "layer_types[0]",
                "sliding_attention");
    /* transformers' GptOssExperts clamps at 7.0 and scales by 1.702 whatever the config says */
    parse_fails(GPT_OSS_BASE(1) ", \"swiglu_limit\": -1}", "gpt_oss-limit", "swiglu_limit", "uses 7 whatever");
    parse_fails(GPT_OSS_BASE(1) ", \"swiglu_limit\": 3.5}", "gpt_oss-limit2", "swiglu_limit", "transformers runs");
    parse_fails(GPT_OSS_BASE(1) ", \"swiglu_alpha\": 1.5}", "gpt_oss-alpha", "swiglu_alpha", "uses 1.702");
    parse_fails(GPT_OSS_BASE(1) ", \"sliding_window\": \"wide\"}", "gpt_oss-window", "sliding_window",
                "positive integer");
    /* sliding layers stay refused for the other families */
    parse_fails(QWEN3_MOE_BASE ", \"layer_types\": [\"sliding_attention\", \"full_attention\"]}", "qwen3-sliding",
                "layer_types[0]", "full_attention");
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

/* The sparse-layer count is computed in closed form: it must equal the per-layer rule summed
 * over the layers for every step and mlp_only_layers list, and a config naming a billion layers
 * must count at once (the fuzzer found the loop it replaced taking minutes). */
START_TEST(test_sparse_count_closed_form)
{
    mt_model_config c = parse_ok(QWEN3_MOE_BASE "}", "base");
    /* each: the count of layers listed, then the layers (sorted, distinct) */
    const int64_t only[][5] = { { 0 }, { 1, 0 }, { 2, 0, 3 }, { 4, 1, 2, 5, 7 }, { 3, 0, 5, 7 } };
    for (int64_t layers = 1; layers <= 13; layers++)
        for (int64_t step = 1; step <= 5; step++)
            for (size_t k = 0; k < sizeof only / sizeof only[0]; k++) {
                c.layers = layers;
                c.decoder_sparse_step = step;
                c.mlp_only_layers_count = 0;
                for (int64_t i = 1; i <= only[k][0]; i++)
                    if (only[k][i] < layers) c.mlp_only_layers[c.mlp_only_layers_count++] = only[k][i];
                int64_t want = 0;
                for (int64_t l = 0; l < layers; l++) want += mt_config_layer_is_sparse(&c, l);
                ck_assert_msg(mt_config_sparse_layers(&c) == want, "%lld layers, step %lld, list %zu: %lld, want %lld",
                              (long long)layers, (long long)step, k, (long long)mt_config_sparse_layers(&c),
                              (long long)want);
            }
    mt_model_config big = parse_ok("{\"model_type\": \"llama\", \"hidden_size\": 80, \"intermediate_size\": 72,"
                                   " \"num_hidden_layers\": 1214748364, \"num_attention_heads\": 4,"
                                   " \"vocab_size\": 1}", "many-layers");
    const clock_t t0 = clock();
    ck_assert_int_gt(mt_config_param_count(&big), big.layers);
    ck_assert_int_gt(mt_config_flops_params(&big), big.layers);
    const double took = (double)(clock() - t0) / CLOCKS_PER_SEC;
    ck_assert_msg(took < 1.0, "counting %lld layers took %.1f s of CPU", (long long)big.layers, took);
}
END_TEST

/* --layers (mt_config_set_layers): the lists that name layers are cut to the layers kept, and the
 * result validates; more layers than layer_types names are refused, the config unchanged. */
START_TEST(test_set_layers)
{
    char err[512] = "";
    mt_model_config c = parse_ok(GPT_OSS_BASE(4) ", \"layer_types\": [\"full_attention\", \"sliding_attention\","
                                 " \"sliding_attention\", \"full_attention\"]}", "layers-gpt_oss");
    ck_assert_msg(mt_config_set_layers(&c, 3, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(c.layers, 3);
    ck_assert_int_eq(c.layer_types_count, 3);
    ck_assert(!mt_config_layer_sliding(&c, 0) && mt_config_layer_sliding(&c, 1) && mt_config_layer_sliding(&c, 2));
    ck_assert_msg(mt_config_validate(&c, "layers-gpt_oss", err, sizeof err) == 0, "%s", err);
    const mt_model_config before = c;
    ck_assert_int_eq(mt_config_set_layers(&c, 5, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "--layers 5") && strstr(err, "names 3 layers"), "%s", err);
    ck_assert(memcmp(&before, &c, sizeof c) == 0);
    ck_assert_int_eq(mt_config_set_layers(&c, 0, err, sizeof err), -1);
    /* without layer_types, any count: the default alternation goes on */
    c = parse_ok(GPT_OSS_BASE(2) "}", "layers-gpt_oss-default");
    ck_assert_msg(mt_config_set_layers(&c, 7, err, sizeof err) == 0, "%s", err);
    ck_assert(mt_config_layer_sliding(&c, 6) && !mt_config_layer_sliding(&c, 5));
    ck_assert_msg(mt_config_validate(&c, "layers-gpt_oss-default", err, sizeof err) == 0, "%s", err);

    /* qwen3_moe: the dense layers past the cut are dropped, those before it kept */
    c = parse_ok(QWEN3_MOE_BASE ", \"mlp_only_layers\": [1, 4, 5]}", "layers-qwen3_moe");
    ck_assert_msg(mt_config_set_layers(&c, 4, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(c.mlp_only_layers_count, 1);
    ck_assert_int_eq(c.mlp_only_layers[0], 1);
    ck_assert_int_eq(mt_config_sparse_layers(&c), 3);
    ck_assert_msg(mt_config_validate(&c, "layers-qwen3_moe", err, sizeof err) == 0, "%s", err);
    ck_assert_msg(mt_config_set_layers(&c, 12, err, sizeof err) == 0, "%s", err); /* more: nothing to cut */
    ck_assert_int_eq(c.mlp_only_layers_count, 1);
    ck_assert_int_eq(mt_config_sparse_layers(&c), 11);
}
END_TEST

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

/* A sparse model saved as an HF directory holds every expert under its HF name and shape, and
 * loads back into a fresh state bit for bit, through the generic code of runtime/hf.c. */
START_TEST(test_hf_roundtrip)
{
    const mt_model_config q = parse_ok(QWEN3_MOE_BASE "}", "hf"), m = parse_ok(MIXTRAL_BASE "}", "hf");
    check_hf_roundtrip(&q, 7, (const hf_tensor[]){ { "model.layers.5.mlp.experts.4.down_proj.weight", 20, 7 }, { 0 } });
    check_hf_roundtrip(&m, 7, (const hf_tensor[]){ { "model.layers.0.block_sparse_moe.experts.3.w3.weight", 9, 20 },
                                                   { 0 } });
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
        double *want = mt_test_alloc_f64(t->numel);
        for (int64_t e = 0; e < t->numel; e++) want[e] = grad[i][e];
        const double e = mt_test_rel_err_mixed(t->grad, want, t->numel);
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

static Suite *moe_model_suite(void)
{
    Suite *s = suite_create("moe_model");
    TCase *config = tcase_create("config");
    tcase_add_test(config, test_published_counts);
    tcase_add_test(config, test_defaults);
    tcase_add_test(config, test_gpt_oss_counts);
    tcase_add_test(config, test_gpt_oss_keys);
    tcase_add_test(config, test_sparse_layers);
    tcase_add_test(config, test_set_layers);
    tcase_add_test(config, test_sparse_count_closed_form);
    tcase_add_test(config, test_config_roundtrip);
    tcase_add_test(config, test_config_errors);
    tcase_add_test(config, test_router_aux_coef);
    suite_add_tcase(s, config);
    TCase *layout = tcase_create("layout");
    tcase_add_test(layout, test_layout_qwen3_moe);
    tcase_add_test(layout, test_layout_mixtral);
    suite_add_tcase(s, layout);
    TCase *hf = tcase_create("runtime"); /* HF directories and the step graph, on StarPU */
    tcase_add_checked_fixture(hf, moe_runtime_up, moe_runtime_down);
    tcase_add_test(hf, test_hf_roundtrip);
    tcase_add_test(hf, test_step_graph);
    suite_add_tcase(s, hf);
    return s;
}

int main(void)
{
    return mt_test_run(moe_model_suite(), false);
}
