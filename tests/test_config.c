/* Config and layout: loading each family with HF's defaults, rope scaling of each type (and a
 * user's --rope-scaling), the sequence lengths a config takes, save/load round trips, every class
 * of bad input (message must name the file and the key), parameter counts against HF's published
 * numbers, and tile layouts (aligned, disjoint, HF names). */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "models/config.h"
#include "models/layout.h"
#include "tests/testutil.h"

static void assert_same_config(const mt_model_config *a, const mt_model_config *b)
{
    ck_assert_int_eq(a->family, b->family);
    ck_assert_str_eq(a->model_type, b->model_type);
    ck_assert_int_eq(a->hidden, b->hidden);
    ck_assert_int_eq(a->intermediate, b->intermediate);
    ck_assert_int_eq(a->layers, b->layers);
    ck_assert_int_eq(a->heads, b->heads);
    ck_assert_int_eq(a->kv_heads, b->kv_heads);
    ck_assert_int_eq(a->head_dim, b->head_dim);
    ck_assert_int_eq(a->vocab, b->vocab);
    ck_assert_int_eq(a->max_positions, b->max_positions);
    ck_assert(a->rope_theta == b->rope_theta);
    ck_assert(a->rms_eps == b->rms_eps);
    ck_assert_int_eq(a->tied, b->tied);
    ck_assert_int_eq(a->qkv_bias, b->qkv_bias);
    ck_assert_int_eq(a->qk_norm, b->qk_norm);
    ck_assert(a->rope_scaling_factor == b->rope_scaling_factor);
    ck_assert(a->rope_low_freq_factor == b->rope_low_freq_factor);
    ck_assert(a->rope_high_freq_factor == b->rope_high_freq_factor);
    ck_assert_int_eq(a->rope_original_max_positions, b->rope_original_max_positions);
    ck_assert_int_eq(a->rope_type, b->rope_type);
    ck_assert(a->rope_beta_fast == b->rope_beta_fast && a->rope_beta_slow == b->rope_beta_slow);
    ck_assert(a->rope_mscale == b->rope_mscale && a->rope_mscale_all_dim == b->rope_mscale_all_dim);
    ck_assert(a->rope_attention_factor == b->rope_attention_factor);
    ck_assert_int_eq(a->rope_truncate, b->rope_truncate);
    ck_assert_int_eq(a->sliding_window, b->sliding_window);
}

/* Writes text to a temp file and loads it; the path is copied to path_out. */
static int load_text(const char *text, mt_model_config *cfg, char *path_out, char *err, size_t errlen)
{
    const char *p = mt_test_write_temp("config.json", text);
    snprintf(path_out, 4096, "%s", p);
    return mt_config_load(path_out, cfg, err, errlen);
}

START_TEST(test_tiny_byte)
{
    mt_model_config cfg, shape;
    char err[512] = "";
    int rc = mt_config_load(mt_test_source_path("models/configs/tiny-byte.json"), &cfg, err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);
    ck_assert_int_eq(cfg.family, MT_FAMILY_QWEN2);
    ck_assert_str_eq(cfg.model_type, "qwen2");
    ck_assert_int_eq(cfg.hidden, 192);
    ck_assert_int_eq(cfg.intermediate, 512);
    ck_assert_int_eq(cfg.layers, 6);
    ck_assert_int_eq(cfg.heads, 6);
    ck_assert_int_eq(cfg.kv_heads, 2);
    ck_assert_int_eq(cfg.head_dim, 32);
    ck_assert_int_eq(cfg.vocab, 256);
    ck_assert_int_eq(cfg.max_positions, 256);
    ck_assert(cfg.rope_theta == 10000.0);
    ck_assert(cfg.rms_eps == 1e-6);
    ck_assert(cfg.tied);
    ck_assert(cfg.qkv_bias);
    ck_assert(!cfg.qk_norm);
    ck_assert(cfg.rope_scaling_factor == 0);
    ck_assert_int_eq(mt_config_from_shape("tiny", &shape), 0);
    assert_same_config(&cfg, &shape);
}
END_TEST

START_TEST(test_family_defaults)
{
    mt_model_config c;
    char err[512] = "", path[4096];
    /* Llama with only the required keys: every default. */
    int rc = load_text("{\"model_type\": \"llama\", \"hidden_size\": 256, \"intermediate_size\": 688,"
                       " \"num_hidden_layers\": 2, \"num_attention_heads\": 8, \"vocab_size\": 1000}",
                       &c, path, err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);
    ck_assert_int_eq(c.family, MT_FAMILY_LLAMA);
    ck_assert_int_eq(c.kv_heads, 8);
    ck_assert_int_eq(c.head_dim, 32);
    ck_assert_int_eq(c.max_positions, 2048);
    ck_assert(c.rope_theta == 10000.0);
    ck_assert(c.rms_eps == 1e-6);
    ck_assert(!c.tied && !c.qkv_bias && !c.qk_norm);
    ck_assert(c.rope_scaling_factor == 0);

    /* Llama with attention_bias false, explicit head_dim not dividing, nulls treated as absent. */
    rc = load_text("{\"model_type\": \"llama\", \"hidden_size\": 100, \"intermediate_size\": 300,"
                   " \"num_hidden_layers\": 1, \"num_attention_heads\": 3, \"num_key_value_heads\": 1,"
                   " \"head_dim\": 34, \"vocab_size\": 77, \"attention_bias\": false, \"rope_scaling\": null,"
                   " \"rms_norm_eps\": 1e-5, \"rope_theta\": 500000, \"tie_word_embeddings\": true}",
                   &c, path, err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);
    ck_assert_int_eq(c.head_dim, 34);
    ck_assert(!c.qkv_bias && c.tied);
    ck_assert(c.rms_eps == 1e-5);
    ck_assert(c.rope_theta == 500000.0);

    /* Qwen2: biases always, even without any key saying so. */
    rc = load_text("{\"model_type\": \"qwen2\", \"hidden_size\": 64, \"intermediate_size\": 128,"
                   " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 2,"
                   " \"vocab_size\": 50, \"use_sliding_window\": false}",
                   &c, path, err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);
    ck_assert_int_eq(c.family, MT_FAMILY_QWEN2);
    ck_assert(c.qkv_bias && !c.qk_norm && !c.tied);
    ck_assert_int_eq(c.head_dim, 16);
    ck_assert_int_eq(c.max_positions, 32768);

    /* Qwen3: q/k norms, no bias by default, head_dim independent of hidden/heads. */
    rc = load_text("{\"model_type\": \"qwen3\", \"hidden_size\": 64, \"intermediate_size\": 128,"
                   " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 2,"
                   " \"head_dim\": 32, \"vocab_size\": 50, \"rope_theta\": 1000000.0, \"tie_word_embeddings\": true}",
                   &c, path, err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);
    ck_assert_int_eq(c.family, MT_FAMILY_QWEN3);
    ck_assert(c.qk_norm && !c.qkv_bias && c.tied);
    ck_assert_int_eq(c.head_dim, 32);
    ck_assert(c.rope_theta == 1e6);

    /* Mistral with the sliding_window key it carries (null: full attention). */
    rc = load_text("{\"model_type\": \"mistral\", \"hidden_size\": 128, \"intermediate_size\": 256,"
                   " \"num_hidden_layers\": 2, \"num_attention_heads\": 8, \"num_key_value_heads\": 2,"
                   " \"vocab_size\": 300, \"sliding_window\": null, \"rms_norm_eps\": 1e-5}",
                   &c, path, err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);
    ck_assert_int_eq(c.family, MT_FAMILY_MISTRAL);
    ck_assert(!c.qk_norm && !c.qkv_bias);
    ck_assert_int_eq(c.head_dim, 16);
    ck_assert_int_eq(c.max_positions, 131072);
    ck_assert_int_eq(c.sliding_window, 0);
    /* v0.1's 4096, and a missing key, which MistralConfig reads as 4096 too; a string is refused */
    static const char *const windows[] = {"\"sliding_window\": 4096,", "", "\"sliding_window\": \"4096\","};
    for (int w = 0; w < 3; w++) {
        char text[512];
        snprintf(text, sizeof text, "{\"model_type\": \"mistral\", \"hidden_size\": 128, \"intermediate_size\": 256,"
                 " \"num_hidden_layers\": 2, \"num_attention_heads\": 8, %s \"vocab_size\": 300}", windows[w]);
        rc = load_text(text, &c, path, err, sizeof err);
        if (w < 2) {
            ck_assert_msg(rc == 0, "%s", err);
            ck_assert_int_eq(c.sliding_window, 4096);
        } else {
            ck_assert_int_eq(rc, -1);
            ck_assert_msg(strstr(err, "sliding_window") != NULL, "%s", err);
        }
    }
}
END_TEST

/* Llama-3.1-8B's rope_scaling block, as in its config.json. */
static const char *llama31 =
    "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\", \"hidden_size\": 4096,"
    " \"intermediate_size\": 14336, \"num_hidden_layers\": 32, \"num_attention_heads\": 32,"
    " \"num_key_value_heads\": 8, \"vocab_size\": 128256, \"max_position_embeddings\": 131072,"
    " \"rope_theta\": 500000.0, \"rms_norm_eps\": 1e-05, \"tie_word_embeddings\": false,"
    " \"attention_bias\": false, \"hidden_act\": \"silu\", \"torch_dtype\": \"bfloat16\","
    " \"rope_scaling\": {\"factor\": 8.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0,"
    " \"original_max_position_embeddings\": 8192, \"rope_type\": \"llama3\"}}";

START_TEST(test_llama3_rope_scaling)
{
    mt_model_config c;
    char err[512] = "", path[4096];
    int rc = load_text(llama31, &c, path, err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);
    ck_assert_int_eq(c.rope_type, MT_ROPE_LLAMA3);
    ck_assert(c.rope_scaling_factor == 8.0);
    ck_assert(c.rope_low_freq_factor == 1.0);
    ck_assert(c.rope_high_freq_factor == 4.0);
    ck_assert_int_eq(c.rope_original_max_positions, 8192);
    ck_assert(c.rope_theta == 500000.0);
    ck_assert(c.rms_eps == 1e-5);
    ck_assert_int_eq(c.head_dim, 128);
    /* HF's count for Llama-3.1-8B. */
    ck_assert_int_eq(mt_config_param_count(&c), 8030261248LL);
}
END_TEST

/* The same model as transformers 5 writes it: rope_theta and the scaling fields inside one
 * "rope_parameters" object, "dtype" instead of "torch_dtype". */
static const char *llama31_v5 =
    "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\", \"hidden_size\": 4096,"
    " \"intermediate_size\": 14336, \"num_hidden_layers\": 32, \"num_attention_heads\": 32,"
    " \"num_key_value_heads\": 8, \"vocab_size\": 128256, \"max_position_embeddings\": 131072,"
    " \"rms_norm_eps\": 1e-05, \"tie_word_embeddings\": false, \"dtype\": \"bfloat16\","
    " \"rope_parameters\": {\"rope_theta\": 500000.0, \"factor\": 8.0, \"low_freq_factor\": 1.0,"
    " \"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 8192, \"rope_type\": \"llama3\"}}";

START_TEST(test_rope_parameters_v5)
{
    mt_model_config a, b;
    char err[512] = "", path[4096];
    ck_assert_msg(load_text(llama31, &a, path, err, sizeof err) == 0, "%s", err);
    ck_assert_msg(load_text(llama31_v5, &b, path, err, sizeof err) == 0, "%s", err);
    assert_same_config(&a, &b);
    ck_assert(b.rope_theta == 500000.0 && b.rope_scaling_factor == 8.0);
    /* default rope type: only the theta */
    ck_assert_msg(load_text("{\"model_type\": \"qwen3\", \"hidden_size\": 64, \"intermediate_size\": 96,"
                            " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"head_dim\": 16,"
                            " \"vocab_size\": 300, \"rope_parameters\": {\"rope_type\": \"default\","
                            " \"rope_theta\": 1000000.0}}", &b, path, err, sizeof err) == 0, "%s", err);
    ck_assert(b.rope_theta == 1000000.0 && b.rope_scaling_factor == 0);
    /* a scaling type the kernels lack is refused under its own key name */
    ck_assert_int_eq(load_text("{\"model_type\": \"llama\", \"hidden_size\": 64, \"intermediate_size\": 96,"
                               " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"vocab_size\": 300,"
                               " \"rope_parameters\": {\"rope_type\": \"longrope\", \"rope_theta\": 1e4,"
                               " \"factor\": 4.0}}", &b, path, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "'rope_parameters'") && strstr(err, "longrope") && strstr(err, "yarn"), "%s", err);
}
END_TEST

/* A Qwen2 of 32768 positions (Qwen2.5's) around the given rope keys. */
static int load_rope(const char *rope_keys, mt_model_config *c, char *err, size_t errlen)
{
    char text[1024], path[4096];
    snprintf(text, sizeof text, "{\"model_type\": \"qwen2\", \"hidden_size\": 64, \"intermediate_size\": 96,"
             " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"vocab_size\": 300,"
             " \"max_position_embeddings\": 32768, \"rope_theta\": 1000000.0, %s}", rope_keys);
    return load_text(text, c, path, err, errlen);
}

/* Each rope type with the keys HF configs give, in both spellings, and transformers' defaults
 * for the keys left out. */
START_TEST(test_rope_scaling_types)
{
    mt_model_config c;
    char err[512] = "";
    ck_assert_msg(load_rope("\"rope_scaling\": {\"type\": \"linear\", \"factor\": 4.0}", &c, err, sizeof err) == 0,
                  "%s", err);
    ck_assert(c.rope_type == MT_ROPE_LINEAR && c.rope_scaling_factor == 4.0 && c.rope_original_max_positions == 0);
    ck_assert_msg(load_rope("\"rope_scaling\": {\"rope_type\": \"dynamic\", \"factor\": 2.5}", &c, err, sizeof err) == 0,
                  "%s", err);
    ck_assert(c.rope_type == MT_ROPE_DYNAMIC && c.rope_scaling_factor == 2.5);
    /* Qwen2.5's yarn block: the betas default to 32 and 1, truncate to true, nothing derived
     * is stored (the attention factor stays 0: computed from the factor) */
    ck_assert_msg(load_rope("\"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4.0, "
                            "\"original_max_position_embeddings\": 32768}", &c, err, sizeof err) == 0, "%s", err);
    ck_assert(c.rope_type == MT_ROPE_YARN && c.rope_scaling_factor == 4.0);
    ck_assert_int_eq(c.rope_original_max_positions, 32768);
    ck_assert(c.rope_beta_fast == 32 && c.rope_beta_slow == 1 && c.rope_truncate);
    ck_assert(c.rope_mscale == 0 && c.rope_mscale_all_dim == 0 && c.rope_attention_factor == 0);
    /* transformers 5's spelling, every yarn key given; 0 betas read as the defaults (`or`) */
    ck_assert_msg(load_rope("\"rope_parameters\": {\"rope_type\": \"yarn\", \"rope_theta\": 150000.0, \"factor\": 32,"
                            " \"beta_fast\": 0, \"beta_slow\": 0, \"mscale\": 1, \"mscale_all_dim\": 0.5,"
                            " \"attention_factor\": 1.25, \"truncate\": false, \"original_max_position_embeddings\": 4096}",
                            &c, err, sizeof err) == 0, "%s", err);
    ck_assert(c.rope_theta == 1e6); /* the top-level key wins, as before */
    ck_assert(c.rope_type == MT_ROPE_YARN && c.rope_scaling_factor == 32 && c.rope_original_max_positions == 4096);
    ck_assert(c.rope_beta_fast == 32 && c.rope_beta_slow == 1 && !c.rope_truncate);
    ck_assert(c.rope_mscale == 1 && c.rope_mscale_all_dim == 0.5 && c.rope_attention_factor == 1.25);
    /* no original length: max_position_embeddings (standardize_rope_params); a null factor: the
     * ratio of the two lengths (DeepSeek-V3's convention) */
    ck_assert_msg(load_rope("\"rope_scaling\": {\"type\": \"yarn\", \"factor\": 2.0}", &c, err, sizeof err) == 0,
                  "%s", err);
    ck_assert_int_eq(c.rope_original_max_positions, 32768);
    ck_assert_msg(load_rope("\"rope_scaling\": {\"type\": \"yarn\", \"factor\": null, "
                            "\"original_max_position_embeddings\": 4096}", &c, err, sizeof err) == 0, "%s", err);
    ck_assert(c.rope_scaling_factor == 8.0);
    /* "default" with stray keys is no scaling */
    ck_assert_msg(load_rope("\"rope_scaling\": {\"rope_type\": \"default\", \"factor\": 4.0}", &c, err, sizeof err) == 0,
                  "%s", err);
    ck_assert(c.rope_type == MT_ROPE_DEFAULT && c.rope_scaling_factor == 0);
}
END_TEST

/* The longest sequence of each kind of config, and the refusal past it: the length, the limit and
 * the option that raises it. */
START_TEST(test_seq_len_limits)
{
    mt_model_config c;
    char err[512] = "", path[4096];
    ck_assert_int_eq(mt_config_from_shape("qwen2.5-3b", &c), 0);
    ck_assert_int_eq(mt_config_max_seq_len(&c), 32768);
    ck_assert_int_eq(mt_config_check_seq_len(&c, 32768, err, sizeof err), 0);
    ck_assert_int_eq(mt_config_check_seq_len(&c, 131072, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "131072") && strstr(err, "max_position_embeddings 32768") &&
                  strstr(err, "--rope-scaling yarn:4"), "%s", err);
    ck_assert_int_eq(mt_config_check_seq_len(&c, 0, err, sizeof err), -1);
    /* extended: factor x the original length; then past it the next factor is named */
    ck_assert_msg(mt_config_set_rope_scaling(&c, "yarn:4", err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(mt_config_max_seq_len(&c), 131072);
    ck_assert_int_eq(mt_config_check_seq_len(&c, 131072, err, sizeof err), 0);
    ck_assert_int_eq(mt_config_check_seq_len(&c, 131073, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "131073") && strstr(err, "131072") && strstr(err, "--rope-scaling yarn:5"), "%s", err);
    /* linear and dynamic multiply max_position_embeddings; a fractional factor rounds down */
    ck_assert_msg(load_rope("\"rope_scaling\": {\"type\": \"dynamic\", \"factor\": 2.5}", &c, err, sizeof err) == 0,
                  "%s", err);
    ck_assert_int_eq(mt_config_max_seq_len(&c), 81920);
    ck_assert_msg(load_rope("\"rope_scaling\": {\"type\": \"linear\", \"factor\": 1.00001}", &c, err, sizeof err) == 0,
                  "%s", err);
    ck_assert_int_eq(mt_config_max_seq_len(&c), 32768);
    /* Llama 3.1: 131072 positions, more than its factor 8 over 8192 */
    ck_assert_msg(load_text(llama31, &c, path, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(mt_config_max_seq_len(&c), 131072);
    ck_assert_int_eq(mt_config_check_seq_len(&c, 262144, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "262144") && strstr(err, "131072") && strstr(err, "llama3"), "%s", err);
    /* Mistral v0.1's window bounds the length whatever the rope allows */
    ck_assert_msg(load_text("{\"model_type\": \"mistral\", \"hidden_size\": 128, \"intermediate_size\": 256,"
                            " \"num_hidden_layers\": 2, \"num_attention_heads\": 8, \"vocab_size\": 300,"
                            " \"sliding_window\": 4096, \"max_position_embeddings\": 32768,"
                            " \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 2.0}}", &c, path, err, sizeof err) == 0,
                  "%s", err);
    ck_assert_int_eq(mt_config_max_seq_len(&c), 4096);
    ck_assert_int_eq(mt_config_check_seq_len(&c, 4097, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "4097") && strstr(err, "sliding_window 4096"), "%s", err);
}
END_TEST

/* --rope-scaling's values: what each does to a config, and every refusal with the choices named
 * and the config left alone. */
START_TEST(test_set_rope_scaling)
{
    mt_model_config c, before;
    char err[512] = "", path[4096];
    ck_assert_int_eq(mt_config_from_shape("qwen2.5-3b", &c), 0);
    ck_assert_msg(mt_config_set_rope_scaling(&c, "yarn:4", err, sizeof err) == 0, "%s", err);
    ck_assert(c.rope_type == MT_ROPE_YARN && c.rope_scaling_factor == 4.0);
    ck_assert_int_eq(c.rope_original_max_positions, 32768);
    ck_assert_int_eq(c.max_positions, 32768); /* kept, as Qwen's yarn configs keep it */
    ck_assert(c.rope_beta_fast == 32 && c.rope_beta_slow == 1 && c.rope_truncate && c.rope_attention_factor == 0);
    /* the same type again: a new factor over the same original length */
    ck_assert_msg(mt_config_set_rope_scaling(&c, "yarn:8", err, sizeof err) == 0, "%s", err);
    ck_assert(c.rope_scaling_factor == 8.0 && c.rope_original_max_positions == 32768);
    ck_assert_int_eq(mt_config_max_seq_len(&c), 262144);
    ck_assert_int_eq(mt_config_from_shape("qwen2.5-3b", &c), 0);
    ck_assert_msg(mt_config_set_rope_scaling(&c, "linear:2", err, sizeof err) == 0, "%s", err);
    ck_assert(c.rope_type == MT_ROPE_LINEAR && c.rope_scaling_factor == 2.0 && c.rope_original_max_positions == 0);
    ck_assert_msg(mt_config_set_rope_scaling(&c, "linear:3.5", err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(mt_config_max_seq_len(&c), 114688);

    static const struct {
        const char *spec, *model, *want, *also; /* model: NULL = Qwen2.5-3B, "llama31", or the linear one */
    } bad[] = {
        {"ntk:4", NULL, "'ntk'", "linear, dynamic, yarn"},
        {"yarn", NULL, "TYPE:FACTOR", "linear, dynamic, yarn"},
        {"", NULL, "TYPE:FACTOR", "yarn:4"},
        {"llama3:8", NULL, "llama3 is not offered", "linear, dynamic, yarn"},
        {"yarn:abc", NULL, "'abc' is not a number", "yarn:abc"},
        {"yarn:nan", NULL, "not a number", "nan"},
        {"yarn:4x", NULL, "not a number", "4x"},
        {"yarn:1", NULL, "above 1", "yarn:1"},
        {"dynamic:0.5", NULL, "above 1", "0.5"},
        {"yarn:1e9", NULL, "absurdly large", "32768"},
        {"yarn:2", "llama31", "llama3-scaled", "does not change"},
        {"yarn:2", "linear", "linear-scaled", "linear:F"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        if (!bad[k].model) ck_assert_int_eq(mt_config_from_shape("qwen2.5-3b", &c), 0);
        else if (!strcmp(bad[k].model, "llama31")) ck_assert_int_eq(load_text(llama31, &c, path, err, sizeof err), 0);
        else ck_assert_int_eq(load_rope("\"rope_scaling\": {\"type\": \"linear\", \"factor\": 2}", &c, err, sizeof err), 0);
        before = c;
        err[0] = 0;
        ck_assert_msg(mt_config_set_rope_scaling(&c, bad[k].spec, err, sizeof err) == -1, "'%s' accepted", bad[k].spec);
        ck_assert_msg(strstr(err, "--rope-scaling") && strstr(err, bad[k].want) && strstr(err, bad[k].also),
                      "'%s': %s", bad[k].spec, err);
        ck_assert(memcmp(&c, &before, sizeof c) == 0);
        mt_rope_type type;
        double factor;
        if (!bad[k].model && strcmp(bad[k].spec, "yarn:1e9") != 0)
            ck_assert_int_eq(mt_rope_scaling_parse(bad[k].spec, &type, &factor, err, sizeof err), -1);
    }
}
END_TEST

static void round_trip(const mt_model_config *c)
{
    char err[512] = "";
    const char *p = mt_test_write_temp("saved.json", "");
    char path[4096];
    snprintf(path, sizeof path, "%s", p);
    ck_assert_msg(mt_config_save(c, path, err, sizeof err) == 0, "%s", err);
    mt_model_config back;
    ck_assert_msg(mt_config_load(path, &back, err, sizeof err) == 0, "%s", err);
    assert_same_config(c, &back);
    /* The file carries what transformers needs to build the right class. */
    FILE *f = fopen(path, "r");
    ck_assert_ptr_nonnull(f);
    char text[8192];
    size_t n = fread(text, 1, sizeof text - 1, f);
    text[n] = '\0';
    fclose(f);
    ck_assert_ptr_nonnull(strstr(text, "\"architectures\""));
    ck_assert_ptr_nonnull(strstr(text, "\"torch_dtype\": \"float32\""));
    ck_assert_ptr_nonnull(strstr(text, "\"hidden_act\": \"silu\""));
    const char *arch = c->family == MT_FAMILY_QWEN2 ? "Qwen2ForCausalLM"
                     : c->family == MT_FAMILY_QWEN3 ? "Qwen3ForCausalLM"
                     : c->family == MT_FAMILY_MISTRAL ? "MistralForCausalLM" : "LlamaForCausalLM";
    ck_assert_ptr_nonnull(strstr(text, arch));
    /* yarn and llama3 carry their original length; transformers' linear and dynamic read none */
    const bool original = c->rope_type == MT_ROPE_YARN || c->rope_type == MT_ROPE_LLAMA3;
    ck_assert_int_eq(strstr(text, "\"original_max_position_embeddings\"") != NULL, original);
    if (c->family == MT_FAMILY_QWEN2) ck_assert_ptr_nonnull(strstr(text, "\"use_sliding_window\": false"));
    else ck_assert_ptr_nonnull(strstr(text, "\"attention_bias\""));
}

START_TEST(test_save_load_round_trip)
{
    const char *shapes[] = {"tiny", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b",
                            "qwen2.5-32b"};
    mt_model_config c;
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        ck_assert_int_eq(mt_config_from_shape(shapes[i], &c), 0);
        round_trip(&c);
    }
    char err[512] = "", path[4096];
    ck_assert_msg(load_text(llama31, &c, path, err, sizeof err) == 0, "%s", err);
    round_trip(&c);
    ck_assert_msg(load_text("{\"model_type\": \"qwen3\", \"hidden_size\": 64, \"intermediate_size\": 96,"
                            " \"num_hidden_layers\": 3, \"num_attention_heads\": 4, \"num_key_value_heads\": 1,"
                            " \"head_dim\": 24, \"vocab_size\": 99, \"attention_bias\": false,"
                            " \"rms_norm_eps\": 3.3e-7, \"rope_theta\": 12345.678}",
                            &c, path, err, sizeof err) == 0, "%s", err);
    round_trip(&c);
    ck_assert_msg(load_text("{\"model_type\": \"mistral\", \"hidden_size\": 128, \"intermediate_size\": 256,"
                            " \"num_hidden_layers\": 2, \"num_attention_heads\": 8, \"num_key_value_heads\": 2,"
                            " \"vocab_size\": 300, \"tie_word_embeddings\": true}",
                            &c, path, err, sizeof err) == 0, "%s", err);
    round_trip(&c);
    /* every rope type, yarn with and without its optional keys, and --rope-scaling's result */
    static const char *const ropes[] = {
        "\"rope_scaling\": {\"type\": \"linear\", \"factor\": 4.0}",
        "\"rope_scaling\": {\"rope_type\": \"dynamic\", \"factor\": 2.5}",
        "\"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4.0, \"original_max_position_embeddings\": 32768}",
        "\"rope_parameters\": {\"rope_type\": \"yarn\", \"factor\": 32, \"beta_fast\": 16, \"beta_slow\": 2,"
        " \"mscale\": 0.707, \"mscale_all_dim\": 1.3, \"attention_factor\": 0.875, \"truncate\": false,"
        " \"original_max_position_embeddings\": 4096}",
    };
    for (size_t k = 0; k < sizeof ropes / sizeof ropes[0]; k++) {
        ck_assert_msg(load_rope(ropes[k], &c, err, sizeof err) == 0, "%s", err);
        round_trip(&c);
    }
    const char *const specs[] = {"yarn:4", "linear:2.5", "dynamic:8"};
    for (size_t k = 0; k < sizeof specs / sizeof specs[0]; k++) {
        ck_assert_int_eq(mt_config_from_shape("qwen2.5-3b", &c), 0);
        ck_assert_msg(mt_config_set_rope_scaling(&c, specs[k], err, sizeof err) == 0, "%s", err);
        round_trip(&c);
    }
    ck_assert_int_eq(mt_config_from_shape("qwen2.5-72b", &c), -1);
}
END_TEST

/* A valid base with one key replaced: lets each bad case change exactly one thing. */
#define BASE_BEFORE "{\"model_type\": \"qwen2\", \"intermediate_size\": 128, \"num_hidden_layers\": 2, " \
                    "\"vocab_size\": 50, "

static const struct bad_case {
    const char *json;
    const char *key;     /* must appear in the message ("key 'X'"), NULL for malformed JSON */
    const char *also;    /* another substring the message must hold */
} bad_cases[] = {
    {"{\"model_type\": \"qwen2\", \"hidden_size\": 64,\n  \"intermediate_size\": 128 \"x\": 1}", NULL, ":2:"},
    {"{\"model_type\": \"qwen2\", \"hidden_size\": 64,", NULL, "malformed JSON"},
    {"[1, 2]", NULL, "object"},
    {BASE_BEFORE "\"num_attention_heads\": 4}", "hidden_size", "missing"},
    {BASE_BEFORE "\"hidden_size\": 64}", "num_attention_heads", "missing"},
    {"{\"model_type\": \"qwen2\", \"hidden_size\": 64, \"num_hidden_layers\": 2, \"vocab_size\": 50, "
     "\"num_attention_heads\": 4}", "intermediate_size", "missing"},
    {"{\"model_type\": \"qwen2\", \"hidden_size\": 64, \"intermediate_size\": 128, \"vocab_size\": 50, "
     "\"num_attention_heads\": 4}", "num_hidden_layers", "missing"},
    {"{\"model_type\": \"qwen2\", \"hidden_size\": 64, \"intermediate_size\": 128, \"num_hidden_layers\": 2, "
     "\"num_attention_heads\": 4}", "vocab_size", "missing"},
    {"{\"hidden_size\": 64, \"intermediate_size\": 128, \"num_hidden_layers\": 2, \"vocab_size\": 50, "
     "\"num_attention_heads\": 4}", "model_type", "missing"},
    {BASE_BEFORE "\"hidden_size\": \"64\", \"num_attention_heads\": 4}", "hidden_size", "string"},
    {BASE_BEFORE "\"hidden_size\": 64.5, \"num_attention_heads\": 4}", "hidden_size", "integer"},
    {BASE_BEFORE "\"hidden_size\": 64, \"num_attention_heads\": 4, \"rope_theta\": \"big\"}", "rope_theta", "number"},
    {BASE_BEFORE "\"hidden_size\": 64, \"num_attention_heads\": 4, \"tie_word_embeddings\": 1}",
     "tie_word_embeddings", "true or false"},
    {BASE_BEFORE "\"hidden_size\": 100, \"num_attention_heads\": 8}", "num_attention_heads", "does not divide"},
    {BASE_BEFORE "\"hidden_size\": 64, \"num_attention_heads\": 4, \"num_key_value_heads\": 3}",
     "num_key_value_heads", "does not divide"},
    {BASE_BEFORE "\"hidden_size\": 64, \"num_attention_heads\": 4, \"num_key_value_heads\": 8}",
     "num_key_value_heads", "does not divide"},
    {BASE_BEFORE "\"hidden_size\": -64, \"num_attention_heads\": 4}", "hidden_size", "positive"},
    {BASE_BEFORE "\"hidden_size\": 0, \"num_attention_heads\": 4}", "hidden_size", "positive"},
    {BASE_BEFORE "\"hidden_size\": 64, \"num_attention_heads\": 0}", "num_attention_heads", "positive"},
    {BASE_BEFORE "\"hidden_size\": 64, \"num_attention_heads\": 4, \"num_key_value_heads\": -2}",
     "num_key_value_heads", "positive"},
    {"{\"model_type\": \"qwen2\", \"hidden_size\": 64, \"intermediate_size\": 128, \"num_hidden_layers\": -1, "
     "\"vocab_size\": 50, \"num_attention_heads\": 4}", "num_hidden_layers", "positive"},
    {"{\"model_type\": \"qwen2\", \"hidden_size\": 64, \"intermediate_size\": 128, \"num_hidden_layers\": 2, "
     "\"vocab_size\": 0, \"num_attention_heads\": 4}", "vocab_size", "positive"},
    {BASE_BEFORE "\"hidden_size\": 64, \"num_attention_heads\": 4, \"head_dim\": 0}", "head_dim", "positive"},
    {BASE_BEFORE "\"hidden_size\": 64, \"num_attention_heads\": 4, \"rms_norm_eps\": -1e-6}", "rms_norm_eps", "positive"},
    {BASE_BEFORE "\"hidden_size\": 64, \"num_attention_heads\": 4, \"rope_theta\": 0}", "rope_theta", "positive"},
    {BASE_BEFORE "\"hidden_size\": 64, \"num_attention_heads\": 4, \"max_position_embeddings\": 0}",
     "max_position_embeddings", "positive"},
    {"{\"model_type\": \"gpt2\", \"hidden_size\": 64, \"intermediate_size\": 128, \"num_hidden_layers\": 2, "
     "\"vocab_size\": 50, \"num_attention_heads\": 4}", "model_type", "gpt2"},
    {"{\"model_type\": 2, \"hidden_size\": 64}", "model_type", "string"},
    {BASE_BEFORE "\"hidden_size\": 64, \"num_attention_heads\": 4, \"hidden_act\": \"gelu\"}", "hidden_act", "gelu"},
    {BASE_BEFORE "\"hidden_size\": 64, \"num_attention_heads\": 4, \"use_sliding_window\": true}",
     "use_sliding_window", "sliding"},
    {BASE_BEFORE "\"hidden_size\": 64, \"num_attention_heads\": 4, "
     "\"rope_scaling\": {\"rope_type\": \"longrope\", \"factor\": 4.0}}", "rope_scaling", "longrope"},
    {BASE_BEFORE "\"hidden_size\": 64, \"num_attention_heads\": 4, "
     "\"rope_scaling\": {\"type\": \"linear\"}}", "rope_scaling", "factor"},
    {BASE_BEFORE "\"hidden_size\": 64, \"num_attention_heads\": 4, "
     "\"rope_scaling\": {\"type\": \"dynamic\", \"factor\": -2.0}}", "rope_scaling", "positive"},
    {BASE_BEFORE "\"hidden_size\": 64, \"num_attention_heads\": 4, "
     "\"rope_scaling\": {\"type\": \"yarn\", \"original_max_position_embeddings\": 64}}", "rope_scaling",
     "factor"},
    {BASE_BEFORE "\"hidden_size\": 64, \"num_attention_heads\": 4, "
     "\"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4.0, \"beta_fast\": 1.0, \"beta_slow\": 32.0}}",
     "rope_scaling", "beta_fast >= beta_slow"},
    {BASE_BEFORE "\"hidden_size\": 64, \"num_attention_heads\": 4, "
     "\"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4.0, \"attention_factor\": 0}}", "rope_scaling",
     "attention_factor"},
    {BASE_BEFORE "\"hidden_size\": 64, \"num_attention_heads\": 4, "
     "\"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4.0, \"truncate\": \"no\"}}", "rope_scaling",
     "truncate"},
    {BASE_BEFORE "\"hidden_size\": 64, \"num_attention_heads\": 4, "
     "\"rope_scaling\": {\"type\": \"yarn\", \"factor\": 1e300}}", "rope_scaling", "absurd"},
    {BASE_BEFORE "\"hidden_size\": 64, \"num_attention_heads\": 4, \"partial_rotary_factor\": 0.5}",
     "partial_rotary_factor", "0.5"},
    {BASE_BEFORE "\"hidden_size\": 64, \"num_attention_heads\": 32, "
     "\"rope_scaling\": {\"type\": \"dynamic\", \"factor\": 2.0}}", "rope_scaling", "head_dim > 2"},
    {BASE_BEFORE "\"hidden_size\": 64, \"num_attention_heads\": 4, "
     "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0}}", "rope_scaling", "low_freq_factor"},
    {BASE_BEFORE "\"hidden_size\": 64, \"num_attention_heads\": 4, "
     "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 4.0, "
     "\"high_freq_factor\": 1.0, \"original_max_position_embeddings\": 8192}}", "rope_scaling", "low_freq_factor"},
    {BASE_BEFORE "\"hidden_size\": 64, \"num_attention_heads\": 4, \"rope_scaling\": 3}", "rope_scaling", "object"},
    /* Absurd sizes: each alone is accepted by no sane reading; products must not overflow. */
    {BASE_BEFORE "\"hidden_size\": 9223372036854775807, \"num_attention_heads\": 1}", "hidden_size", "absurd"},
    {"{\"model_type\": \"llama\", \"hidden_size\": 2147483648, \"intermediate_size\": 2147483648, "
     "\"num_hidden_layers\": 2147483648, \"vocab_size\": 2147483648, \"num_attention_heads\": 1}",
     "hidden_size", "absurd"},
    {"{\"model_type\": \"llama\", \"hidden_size\": 65536, \"intermediate_size\": 65536, "
     "\"num_hidden_layers\": 2147483647, \"vocab_size\": 50, \"num_attention_heads\": 1}",
     "num_hidden_layers", "absurd"},
    /* Small heads keep each layer small while the table is 2^62 elements: the table's two
     * copies are 2^63, which wrapped to a negative total that passed as fitting. */
    {"{\"model_type\": \"llama\", \"hidden_size\": 2147483647, \"intermediate_size\": 1, "
     "\"num_hidden_layers\": 1, \"vocab_size\": 2147483647, \"num_attention_heads\": 1, \"head_dim\": 2}",
     "vocab_size", "absurd"},
    {"{\"model_type\": \"mistral\", \"hidden_size\": 64, \"intermediate_size\": 128, \"num_hidden_layers\": 2, "
     "\"vocab_size\": 50, \"num_attention_heads\": 4, \"attention_bias\": true}", "attention_bias", "mistral"},
    /* Keys that change what transformers computes and are not implemented. */
    {BASE_BEFORE "\"hidden_size\": 64, \"num_attention_heads\": 4, \"mlp_bias\": true}", "mlp_bias", "MLP"},
    {BASE_BEFORE "\"hidden_size\": 64, \"num_attention_heads\": 4, \"attention_dropout\": 0.1}", "attention_dropout",
     "dropout"},
    {BASE_BEFORE "\"hidden_size\": 64, \"num_attention_heads\": 4, \"layer_types\": [\"full_attention\", "
     "\"sliding_attention\"]}", "layer_types[1]", "full_attention"},
    {"{\"model_type\": \"qwen3\", \"hidden_size\": 64, \"intermediate_size\": 128, \"num_hidden_layers\": 2, "
     "\"vocab_size\": 50, \"num_attention_heads\": 4, \"use_sliding_window\": true}", "use_sliding_window", "sliding-window"},
    /* transformers' Llama and Qwen3 then bias o_proj too: refused for these families */
    {"{\"model_type\": \"llama\", \"hidden_size\": 64, \"intermediate_size\": 128, \"num_hidden_layers\": 2, "
     "\"vocab_size\": 50, \"num_attention_heads\": 4, \"attention_bias\": true}", "attention_bias", "o_proj"},
    {"{\"model_type\": \"qwen3\", \"hidden_size\": 64, \"intermediate_size\": 128, \"num_hidden_layers\": 2, "
     "\"vocab_size\": 50, \"num_attention_heads\": 4, \"attention_bias\": true}", "attention_bias", "o_proj"},
};

START_TEST(test_bad_inputs)
{
    const struct bad_case *bc = &bad_cases[_i];
    mt_model_config c;
    memset(&c, 0x5a, sizeof c);
    mt_model_config before = c;
    char err[512] = "", path[4096];
    int rc = load_text(bc->json, &c, path, err, sizeof err);
    ck_assert_msg(rc == -1, "case %d accepted: %s", _i, bc->json);
    ck_assert_msg(strstr(err, path) != NULL, "case %d: message lacks the path: %s", _i, err);
    if (bc->key) {
        char want[128];
        snprintf(want, sizeof want, "key '%s'", bc->key);
        ck_assert_msg(strstr(err, want) != NULL, "case %d: message lacks %s: %s", _i, want, err);
    }
    ck_assert_msg(strstr(err, bc->also) != NULL, "case %d: message lacks '%s': %s", _i, bc->also, err);
    /* A failed load leaves the caller's struct alone. */
    ck_assert(memcmp(&c, &before, sizeof c) == 0);
}
END_TEST

START_TEST(test_nonexistent_file)
{
    mt_model_config c;
    char err[512] = "";
    const char *path = "/nonexistent/dir/config.json";
    ck_assert_int_eq(mt_config_load(path, &c, err, sizeof err), -1);
    ck_assert_msg(strstr(err, path) != NULL, "%s", err);
    ck_assert_msg(strstr(err, "No such file") != NULL, "%s", err);
    /* The parse entry point names its source too. */
    ck_assert_int_eq(mt_config_parse("{", "inline.json", &c, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "inline.json:1:") != NULL, "%s", err);
}
END_TEST

/* A directory stands for its config.json; one without says so instead of "read error". */
START_TEST(test_config_directory)
{
    mt_model_config c;
    char err[512] = "", dir[] = "/tmp/mt_config_dir_XXXXXX", path[600];
    ck_assert_ptr_nonnull(mkdtemp(dir));
    ck_assert_int_eq(mt_config_load(dir, &c, err, sizeof err), -1);
    ck_assert_msg(strstr(err, dir) && strstr(err, "without a config.json"), "%s", err);
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    fputs("{\"model_type\": \"llama\", \"hidden_size\": 64, \"intermediate_size\": 128, \"num_hidden_layers\": 2,"
          " \"vocab_size\": 50, \"num_attention_heads\": 4}", f);
    fclose(f);
    ck_assert_msg(mt_config_load(dir, &c, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(c.hidden, 64);
    unlink(path);
    rmdir(dir);
}
END_TEST

START_TEST(test_param_counts)
{
    mt_model_config c;
    /* HF model.num_parameters() of the published checkpoints. */
    ck_assert_int_eq(mt_config_from_shape("qwen2.5-0.5b", &c), 0);
    ck_assert_int_eq(mt_config_param_count(&c), 494032768LL);
    /* Tied: N counts the head, which is the table counted once in the total. */
    ck_assert_int_eq(mt_config_flops_params(&c), 494032768LL);
    ck_assert_int_eq(mt_config_from_shape("qwen2.5-7b", &c), 0);
    ck_assert_int_eq(mt_config_param_count(&c), 7615616512LL);
    /* Untied: all but the embedding table, 152064 * 3584 = 544997376. */
    ck_assert_int_eq(mt_config_flops_params(&c), 7615616512LL - 544997376LL);
    ck_assert_int_eq(mt_config_from_shape("qwen2.5-1.5b", &c), 0);
    ck_assert_int_eq(mt_config_param_count(&c), 1543714304LL);
    ck_assert_int_eq(mt_config_from_shape("qwen2.5-3b", &c), 0);
    ck_assert_int_eq(mt_config_param_count(&c), 3085938688LL);
    ck_assert_int_eq(mt_config_from_shape("qwen2.5-14b", &c), 0);
    ck_assert_int_eq(mt_config_param_count(&c), 14770033664LL);
    ck_assert_int_eq(mt_config_from_shape("qwen2.5-32b", &c), 0);
    ck_assert_int_eq(mt_config_param_count(&c), 32763876352LL);
}
END_TEST

/* Checks one layout: slots aligned, in order, disjoint, inside the tile; returns the unpadded sum. */
static int64_t check_layout(const mt_tile_layout *t)
{
    int64_t end = 0, sum = 0;
    for (int s = 0; s < t->ntensors; s++) {
        const mt_tensor_desc *d = &t->tensors[s];
        ck_assert_ptr_nonnull(d->name);
        ck_assert_int_eq(d->offset % MT_TILE_ALIGN, 0);
        ck_assert_int_ge(d->offset, end);
        ck_assert(d->ndim == 1 || d->ndim == 2);
        int64_t full = d->ndim == 2 ? d->shape[0] * d->shape[1] : d->shape[0];
        ck_assert(d->numel == 0 || d->numel == full);
        ck_assert_int_eq(d->decay, d->ndim == 2);
        end = d->offset + d->numel;
        sum += d->numel;
    }
    ck_assert_int_le(end, t->numel);
    ck_assert_int_eq(t->numel % MT_TILE_ALIGN, 0);
    ck_assert_int_lt(t->numel - end, MT_TILE_ALIGN);
    return sum;
}

START_TEST(test_layout)
{
    const char *shapes[] = {"tiny", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b",
                            "qwen2.5-32b"};
    mt_model_config c;
    mt_tile_layout e, l, h;
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        ck_assert_int_eq(mt_config_from_shape(shapes[i], &c), 0);
        mt_layout_build(&c, MT_TILE_EMBED, &e);
        mt_layout_build(&c, MT_TILE_LAYER, &l);
        mt_layout_build(&c, MT_TILE_HEAD, &h);
        int64_t total = check_layout(&e) + c.layers * check_layout(&l) + check_layout(&h);
        ck_assert_int_eq(total, mt_config_param_count(&c));
    }

    /* Odd sizes so padding shows: d = 100, H*D = 3*34 = 102, KV*D = 34, I = 300, V = 77. */
    char err[512] = "", path[4096];
    ck_assert_msg(load_text("{\"model_type\": \"qwen3\", \"hidden_size\": 100, \"intermediate_size\": 300,"
                            " \"num_hidden_layers\": 3, \"num_attention_heads\": 3, \"num_key_value_heads\": 1,"
                            " \"head_dim\": 34, \"vocab_size\": 77}",
                            &c, path, err, sizeof err) == 0, "%s", err);
    /* q/k/v biases next to the q/k norms, so every tensor kind has a place (no config family has
     * both: the layout does not care) */
    c.qkv_bias = true;
    mt_layout_build(&c, MT_TILE_LAYER, &l);
    check_layout(&l);
    ck_assert_int_eq(l.kind, MT_TILE_LAYER);
    ck_assert_int_eq(l.ntensors, MT_L_COUNT);
    /* Offsets written out: each tensor starts at the previous end rounded up to 64. */
    static const int64_t want_offset[MT_L_COUNT] = {
        0,      /* input_layernorm 100 -> 128 */
        128,    /* q 102*100 = 10200 -> 10240 + 128 = 10368 */
        10368,  /* q bias 102 -> 128 */
        10496,  /* k 34*100 = 3400 -> 3456 */
        13952,  /* k bias 34 -> 64 */
        14016,  /* v 3400 -> 3456 */
        17472,  /* v bias 64 */
        17536,  /* o 100*102 = 10200 -> 10240 */
        27776,  /* o bias: absent here (gpt_oss), no space */
        27776,  /* sinks: absent here (gpt_oss), no space */
        27776,  /* q_norm 34 -> 64 */
        27840,  /* k_norm 64 */
        27904,  /* post_attention_layernorm 128 */
        28032,  /* gate 300*100 = 30000 -> 30016 */
        58048,  /* up 30016 */
        88064,  /* down 30016 -> ends at 118080 */
    };
    for (int s = 0; s < MT_L_COUNT; s++) ck_assert_int_eq(l.tensors[s].offset, want_offset[s]);
    ck_assert_int_eq(l.numel, 118080);
    ck_assert_int_eq(l.tensors[MT_L_Q_W].shape[0], 102);
    ck_assert_int_eq(l.tensors[MT_L_Q_W].shape[1], 100);
    ck_assert_int_eq(l.tensors[MT_L_O_W].shape[0], 100);
    ck_assert_int_eq(l.tensors[MT_L_O_W].shape[1], 102);
    ck_assert_int_eq(l.tensors[MT_L_DOWN_W].shape[1], 300);
    ck_assert(!l.tensors[MT_L_Q_NORM].decay && !l.tensors[MT_L_Q_B].decay && l.tensors[MT_L_GATE_W].decay);

    /* Absent tensors: llama without bias has numel 0 biases and norms, ndim kept. */
    ck_assert_msg(load_text("{\"model_type\": \"llama\", \"hidden_size\": 64, \"intermediate_size\": 128,"
                            " \"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"vocab_size\": 10}",
                            &c, path, err, sizeof err) == 0, "%s", err);
    mt_layout_build(&c, MT_TILE_LAYER, &l);
    check_layout(&l);
    ck_assert_int_eq(l.tensors[MT_L_Q_B].numel, 0);
    ck_assert_int_eq(l.tensors[MT_L_Q_B].ndim, 1);
    ck_assert_int_eq(l.tensors[MT_L_K_NORM].numel, 0);
    ck_assert_int_eq(l.tensors[MT_L_K_W].offset, l.tensors[MT_L_Q_W].offset + 64 * 64);
    mt_layout_build(&c, MT_TILE_HEAD, &h);
    ck_assert_int_eq(h.tensors[MT_H_LM_HEAD].numel, 640);
    ck_assert_int_eq(h.tensors[MT_H_LM_HEAD].offset, 64);
    ck_assert_int_eq(h.numel, 704);
    ck_assert(h.tensors[MT_H_LM_HEAD].decay && !h.tensors[MT_H_NORM].decay);
    c.tied = true;
    mt_layout_build(&c, MT_TILE_HEAD, &h);
    ck_assert_int_eq(h.tensors[MT_H_LM_HEAD].numel, 0);
    ck_assert_int_eq(h.numel, 64);
}
END_TEST

START_TEST(test_full_names)
{
    mt_model_config c;
    ck_assert_int_eq(mt_config_from_shape("qwen2.5-7b", &c), 0);
    mt_tile_layout e, l, h;
    mt_layout_build(&c, MT_TILE_EMBED, &e);
    mt_layout_build(&c, MT_TILE_LAYER, &l);
    mt_layout_build(&c, MT_TILE_HEAD, &h);
    char name[256];
    mt_layout_full_name(&e, 0, MT_E_EMBED, name, sizeof name);
    ck_assert_str_eq(name, "model.embed_tokens.weight");
    mt_layout_full_name(&h, 0, MT_H_NORM, name, sizeof name);
    ck_assert_str_eq(name, "model.norm.weight");
    mt_layout_full_name(&h, 0, MT_H_LM_HEAD, name, sizeof name);
    ck_assert_str_eq(name, "lm_head.weight");
    static const char *want[MT_L_COUNT] = {
        "model.layers.3.input_layernorm.weight", "model.layers.3.self_attn.q_proj.weight",
        "model.layers.3.self_attn.q_proj.bias", "model.layers.3.self_attn.k_proj.weight",
        "model.layers.3.self_attn.k_proj.bias", "model.layers.3.self_attn.v_proj.weight",
        "model.layers.3.self_attn.v_proj.bias", "model.layers.3.self_attn.o_proj.weight",
        "model.layers.3.self_attn.o_proj.bias", "model.layers.3.self_attn.sinks",
        "model.layers.3.self_attn.q_norm.weight", "model.layers.3.self_attn.k_norm.weight",
        "model.layers.3.post_attention_layernorm.weight", "model.layers.3.mlp.gate_proj.weight",
        "model.layers.3.mlp.up_proj.weight", "model.layers.3.mlp.down_proj.weight",
    };
    for (int s = 0; s < MT_L_COUNT; s++) {
        mt_layout_full_name(&l, 3, s, name, sizeof name);
        ck_assert_str_eq(name, want[s]);
    }
    mt_layout_full_name(&l, 27, MT_L_UP_W, name, sizeof name);
    ck_assert_str_eq(name, "model.layers.27.mlp.up_proj.weight");
}
END_TEST

int main(void)
{
    Suite *s = suite_create("config");
    TCase *tc = tcase_create("config");
    tcase_add_test(tc, test_tiny_byte);
    tcase_add_test(tc, test_family_defaults);
    tcase_add_test(tc, test_llama3_rope_scaling);
    tcase_add_test(tc, test_rope_parameters_v5);
    tcase_add_test(tc, test_rope_scaling_types);
    tcase_add_test(tc, test_seq_len_limits);
    tcase_add_test(tc, test_set_rope_scaling);
    tcase_add_test(tc, test_save_load_round_trip);
    tcase_add_loop_test(tc, test_bad_inputs, 0, (int)(sizeof bad_cases / sizeof bad_cases[0]));
    tcase_add_test(tc, test_nonexistent_file);
    tcase_add_test(tc, test_config_directory);
    tcase_add_test(tc, test_param_counts);
    tcase_add_test(tc, test_layout);
    tcase_add_test(tc, test_full_names);
    suite_add_tcase(s, tc);
    return mt_test_run(s, false);
}
