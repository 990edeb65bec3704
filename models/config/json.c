/* Reads and writes HF config.json files of the Llama/Qwen2/Qwen3/Mistral families and of the
 * mixture-of-experts Qwen3-MoE and Mixtral, with transformers' defaults; reading and writing sit
 * together so that a reader can check that every key round-trips. Every user error names the file
 * and the key, because a config is usually hand-edited or downloaded and the user must find what
 * to fix. */
#include "models/config.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "models/config/internal.h"
#include "models/report.h"

/* Looks key up; JSON null counts as absent, as transformers treats it ("head_dim": null). */
static json_t *lookup(json_t *obj, const char *key)
{
    json_t *v = json_object_get(obj, key);
    return (v && json_is_null(v)) ? NULL : v;
}

/* Reports a problem with `key`, or with field `key` of the object `parent` when parent is set,
 * always as "NAME: key 'K': ..." so the user finds the line to fix. */
static int key_fail(char *err, size_t errlen, const char *name, const char *parent, const char *key,
                    const char *fmt, ...)
{
    if (!err || !errlen) return -1;
    int n = parent ? snprintf(err, errlen, "%s: key '%s': field '%s': ", name, parent, key)
                   : snprintf(err, errlen, "%s: key '%s': ", name, key);
    if (n < 0 || (size_t)n >= errlen) return -1;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err + n, errlen - (size_t)n, fmt, ap);
    va_end(ap);
    return -1;
}

/* An integer key of obj (a field of `parent` when set): `dflt` when absent unless required.
 * Sign and range are checked by validate. */
static int get_int(json_t *obj, const char *name, const char *parent, const char *key, bool required,
                   int64_t dflt, int64_t *out, char *err, size_t errlen)
{
    json_t *v = lookup(obj, key);
    if (!v) {
        if (required) return key_fail(err, errlen, name, parent, key, "missing (required)");
        *out = dflt;
        return 0;
    }
    if (!json_is_integer(v))
        return key_fail(err, errlen, name, parent, key, "expected an integer, got %s", mt_json_type_name(v));
    *out = (int64_t)json_integer_value(v);
    return 0;
}

/* A number key (integer or real JSON value). */
static int get_real(json_t *obj, const char *name, const char *parent, const char *key, bool required,
                    double dflt, double *out, char *err, size_t errlen)
{
    json_t *v = lookup(obj, key);
    if (!v) {
        if (required) return key_fail(err, errlen, name, parent, key, "missing (required)");
        *out = dflt;
        return 0;
    }
    if (!json_is_number(v))
        return key_fail(err, errlen, name, parent, key, "expected a number, got %s", mt_json_type_name(v));
    *out = json_number_value(v);
    return 0;
}

static int get_bool(json_t *obj, const char *name, const char *key, bool dflt, bool *out, char *err,
                    size_t errlen)
{
    json_t *v = lookup(obj, key);
    if (!v) {
        *out = dflt;
        return 0;
    }
    if (!json_is_boolean(v))
        return key_fail(err, errlen, name, NULL, key, "expected true or false, got %s", mt_json_type_name(v));
    *out = json_is_true(v);
    return 0;
}

/* yarn's keys beyond the factor, with transformers' defaults (_compute_yarn_parameters): beta_fast
 * and beta_slow read with `or`, so 0 and absent both mean 32 and 1; mscale and mscale_all_dim
 * count only when both are non-zero; truncate defaults to true. A null factor is
 * max_position_embeddings / original_max_position_embeddings there too. */
static int parse_yarn(json_t *rs, const char *name, const char *rs_key, mt_model_config *cfg, char *err, size_t errlen)
{
    if (get_int(rs, name, rs_key, "original_max_position_embeddings", false, cfg->max_positions,
                &cfg->rope_original_max_positions, err, errlen) ||
        get_real(rs, name, rs_key, "factor", false, 0, &cfg->rope_scaling_factor, err, errlen) ||
        get_real(rs, name, rs_key, "beta_fast", false, 0, &cfg->rope_beta_fast, err, errlen) ||
        get_real(rs, name, rs_key, "beta_slow", false, 0, &cfg->rope_beta_slow, err, errlen) ||
        get_real(rs, name, rs_key, "mscale", false, 0, &cfg->rope_mscale, err, errlen) ||
        get_real(rs, name, rs_key, "mscale_all_dim", false, 0, &cfg->rope_mscale_all_dim, err, errlen) ||
        get_real(rs, name, rs_key, "attention_factor", false, 0, &cfg->rope_attention_factor, err, errlen))
        return -1;
    if (!json_object_get(rs, "factor"))
        return key_fail(err, errlen, name, rs_key, "factor", "missing (required for yarn)");
    if (!lookup(rs, "factor") && cfg->rope_original_max_positions > 0)
        cfg->rope_scaling_factor = (double)cfg->max_positions / (double)cfg->rope_original_max_positions;
    if (cfg->rope_beta_fast == 0) cfg->rope_beta_fast = 32;
    if (cfg->rope_beta_slow == 0) cfg->rope_beta_slow = 1;
    if (lookup(rs, "attention_factor") && !(cfg->rope_attention_factor > 0))
        return key_fail(err, errlen, name, rs_key, "attention_factor", "must be positive, got %g",
                        cfg->rope_attention_factor);
    json_t *truncate = lookup(rs, "truncate");
    if (truncate && !json_is_boolean(truncate))
        return key_fail(err, errlen, name, rs_key, "truncate", "expected true or false, got %s",
                        mt_json_type_name(truncate));
    cfg->rope_truncate = !truncate || json_is_true(truncate);
    return 0;
}

/* Rope scaling; null, absent or rope_type "default" mean none. linear, dynamic, yarn and llama3
 * are read with transformers' defaults; every other type (longrope, ...) changes the
 * frequencies in ways the kernels do not implement, so it is refused rather than ignored. */
static int parse_rope_scaling(json_t *root, const char *name, mt_model_config *cfg, char *err, size_t errlen)
{
    /* transformers 5 writes one object "rope_parameters" holding rope_theta, rope_type and the
     * scaling fields; earlier versions a top-level rope_theta and "rope_scaling". */
    const char *rs_key = lookup(root, "rope_scaling") ? "rope_scaling" : "rope_parameters";
    json_t *rs = lookup(root, rs_key);
    /* A partial rotation (rotary dims < head_dim) is not implemented; 1 is the whole head. */
    double partial = 1.0;
    if (get_real(root, name, NULL, "partial_rotary_factor", false, 1.0, &partial, err, errlen) ||
        (rs && json_is_object(rs) &&
         get_real(rs, name, rs_key, "partial_rotary_factor", false, partial, &partial, err, errlen)))
        return -1;
    if (partial != 1.0)
        return mt_fail(err, errlen, "%s: key 'partial_rotary_factor': %g; rotating part of each head is not "
                       "implemented (only 1.0)", name, partial);
    if (!rs) return 0;
    if (!json_is_object(rs))
        return mt_fail(err, errlen, "%s: key '%s': expected an object or null, got %s", name, rs_key,
                    mt_json_type_name(rs));
    if (!lookup(root, "rope_theta") &&
        get_real(rs, name, rs_key, "rope_theta", false, cfg->rope_theta, &cfg->rope_theta, err, errlen))
        return -1;
    json_t *type = lookup(rs, "rope_type");
    if (!type) type = lookup(rs, "type"); /* the older transformers spelling */
    if (!type && strcmp(rs_key, "rope_parameters") == 0) return 0; /* rope_theta alone */
    if (!type || !json_is_string(type))
        return mt_fail(err, errlen, "%s: key '%s': needs a string 'rope_type'", name, rs_key);
    const char *t = json_string_value(type);
    int found = -1;
    for (int k = 0; k < (int)(sizeof mt_cfg_rope_type_names / sizeof mt_cfg_rope_type_names[0]); k++)
        if (strcmp(t, mt_cfg_rope_type_names[k]) == 0) found = k;
    if (found < 0)
        return mt_fail(err, errlen, "%s: key '%s': rope_type '%s' is not supported (one of default, linear, "
                       "dynamic, yarn, llama3)", name, rs_key, t);
    cfg->rope_type = (mt_rope_type)found;
    switch (cfg->rope_type) {
    case MT_ROPE_DEFAULT: return 0;
    case MT_ROPE_LINEAR:
    case MT_ROPE_DYNAMIC:
        if (get_real(rs, name, rs_key, "factor", true, 0, &cfg->rope_scaling_factor, err, errlen)) return -1;
        break;
    case MT_ROPE_YARN:
        if (parse_yarn(rs, name, rs_key, cfg, err, errlen)) return -1;
        break;
    case MT_ROPE_LLAMA3:
        if (get_real(rs, name, rs_key, "factor", true, 0, &cfg->rope_scaling_factor, err, errlen) ||
            get_real(rs, name, rs_key, "low_freq_factor", true, 0, &cfg->rope_low_freq_factor, err, errlen) ||
            get_real(rs, name, rs_key, "high_freq_factor", true, 0, &cfg->rope_high_freq_factor, err, errlen) ||
            get_int(rs, name, rs_key, "original_max_position_embeddings", true, 0,
                    &cfg->rope_original_max_positions, err, errlen))
            return -1;
        break;
    }
    if (!(cfg->rope_scaling_factor > 0))
        return mt_fail(err, errlen, "%s: key '%s': factor must be positive, got %g", name, rs_key,
                    cfg->rope_scaling_factor);
    return 0;
}

/* The model_type values this file reads, for messages. */
#define FAMILY_NAMES "llama, qwen2, qwen3, mistral, qwen3_moe, mixtral, gpt_oss"

/* sliding_window: `dflt` when absent, 0 for null, else a positive integer. */
static int parse_window(json_t *root, const char *name, int64_t dflt, int64_t *out, char *err, size_t errlen)
{
    json_t *sw = json_object_get(root, "sliding_window");
    if (!sw) *out = dflt;
    else if (json_is_null(sw)) *out = 0;
    else if (json_is_integer(sw) && json_integer_value(sw) > 0) *out = json_integer_value(sw);
    else
        return mt_fail(err, errlen, "%s: key 'sliding_window': expected a positive integer or null, got %s", name,
                       mt_json_type_name(sw));
    return 0;
}

/* The expert count: each family's own key, or the other spelling, which transformers maps onto it
 * (attribute_map num_experts -> num_local_experts); both present must agree. */
static int parse_expert_count(json_t *root, const char *name, mt_model_config *c, char *err, size_t errlen)
{
    const char *own = mt_cfg_expert_count_key(c);
    const char *other = strcmp(own, "num_experts") == 0 ? "num_local_experts" : "num_experts";
    int64_t a = 0, b = 0;
    if (get_int(root, name, NULL, own, false, c->family == MT_FAMILY_MIXTRAL ? 8 : 128, &a, err, errlen) ||
        get_int(root, name, NULL, other, false, a, &b, err, errlen))
        return -1;
    if (lookup(root, own) && lookup(root, other) && a != b)
        return mt_fail(err, errlen, "%s: key '%s': %lld disagrees with '%s' %lld (the same count under two names)",
                       name, other, (long long)b, own, (long long)a);
    c->experts = lookup(root, own) ? a : b;
    return 0;
}

/* qwen3_moe's mlp_only_layers: null or absent is none; kept sorted, without repeats (transformers
 * tests membership). Ranges are checked by validate, which knows the layer count. */
static int parse_mlp_only_layers(json_t *root, const char *name, mt_model_config *c, char *err, size_t errlen)
{
    json_t *list = lookup(root, "mlp_only_layers");
    if (!list) return 0;
    if (!json_is_array(list))
        return mt_fail(err, errlen, "%s: key 'mlp_only_layers': expected an array of layer indices, got %s", name,
                       mt_json_type_name(list));
    size_t i;
    json_t *v;
    json_array_foreach(list, i, v) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX)
            return mt_fail(err, errlen, "%s: key 'mlp_only_layers[%zu]': expected a layer index (0 .. "
                           "num_hidden_layers - 1), got %s", name, i, json_is_integer(v) ? "a negative or huge integer"
                                                                                          : mt_json_type_name(v));
        const int32_t layer = (int32_t)json_integer_value(v);
        int64_t at = 0;
        while (at < c->mlp_only_layers_count && c->mlp_only_layers[at] < layer) at++;
        if (at < c->mlp_only_layers_count && c->mlp_only_layers[at] == layer) continue;
        if (c->mlp_only_layers_count == MT_MAX_MLP_ONLY_LAYERS)
            return mt_fail(err, errlen, "%s: key 'mlp_only_layers': more than %d layers listed", name,
                           MT_MAX_MLP_ONLY_LAYERS);
        memmove(c->mlp_only_layers + at + 1, c->mlp_only_layers + at,
                (size_t)(c->mlp_only_layers_count - at) * sizeof c->mlp_only_layers[0]);
        c->mlp_only_layers[at] = layer;
        c->mlp_only_layers_count++;
    }
    return 0;
}

/* The mixture-of-experts keys, with transformers' defaults (Qwen3MoeConfig, MixtralConfig). */
static int parse_experts(json_t *root, const char *name, mt_model_config *c, char *err, size_t errlen)
{
    if (!mt_cfg_is_moe_family(c->family)) return 0;
    const bool mixtral = c->family == MT_FAMILY_MIXTRAL, gpt_oss = c->family == MT_FAMILY_GPT_OSS;
    if (parse_expert_count(root, name, c, err, errlen) ||
        get_int(root, name, NULL, "num_experts_per_tok", false, mixtral ? 2 : gpt_oss ? 4 : 8, &c->experts_per_token,
                err, errlen) ||
        get_real(root, name, NULL, "router_aux_loss_coef", false, gpt_oss ? 0.9 : 0.001, &c->router_aux_loss_coef, err,
                 errlen) ||
        get_bool(root, name, "output_router_logits", false, &c->output_router_logits, err, errlen))
        return -1;
    if (gpt_oss) {
        /* GptOssTopKRouter: the softmax over the k largest logits, the same weights as the softmax
         * over all renormalised over the k; experts of intermediate_size in every layer, biased
         * like the router, with the clamped SwiGLU. */
        c->expert_intermediate = c->intermediate;
        c->norm_topk_prob = true;
        c->decoder_sparse_step = 1;
        c->router_bias = c->expert_bias = true;
        if (get_real(root, name, NULL, "swiglu_alpha", false, 1.702, &c->swiglu_alpha, err, errlen) ||
            get_real(root, name, NULL, "swiglu_limit", false, 7.0, &c->swiglu_limit, err, errlen))
            return -1;
        /* transformers' GptOssExperts clamps at alpha 1.702 and limit 7.0 whatever the config says
         * (checked against transformers 5.17: a config's swiglu_limit of 0.5 changes nothing
         * there); another value would train a model that transformers does not run */
        if (c->swiglu_alpha != 1.702 || c->swiglu_limit != 7.0)
            return mt_fail(err, errlen, "%s: key '%s': %g, but transformers' GptOssExperts uses %g whatever the "
                           "config says; a model trained with another value is not the one transformers runs",
                           name, c->swiglu_limit != 7.0 ? "swiglu_limit" : "swiglu_alpha",
                           c->swiglu_limit != 7.0 ? c->swiglu_limit : c->swiglu_alpha,
                           c->swiglu_limit != 7.0 ? 7.0 : 1.702);
        return 0;
    }
    if (mixtral) {
        /* Mixtral's experts are intermediate_size wide and always renormalise their top k. */
        c->expert_intermediate = c->intermediate;
        c->norm_topk_prob = true;
        c->decoder_sparse_step = 1;
        double jitter = 0;
        if (get_real(root, name, NULL, "router_jitter_noise", false, 0.0, &jitter, err, errlen)) return -1;
        if (jitter != 0)
            return mt_fail(err, errlen, "%s: key 'router_jitter_noise': %g; the router's multiplicative noise in "
                           "training is not implemented (set 0.0)", name, jitter);
        return 0;
    }
    return get_int(root, name, NULL, "moe_intermediate_size", false, 768, &c->expert_intermediate, err, errlen) ||
           get_bool(root, name, "norm_topk_prob", false, &c->norm_topk_prob, err, errlen) ||
           get_int(root, name, NULL, "decoder_sparse_step", false, 1, &c->decoder_sparse_step, err, errlen) ||
           parse_mlp_only_layers(root, name, c, err, errlen) ? -1 : 0;
}

int mt_config_parse(const char *json_text, const char *name, mt_model_config *cfg, char *err, size_t errlen)
{
    if (!name) name = "config";
    json_error_t jerr;
    json_t *root = json_loads(json_text, 0, &jerr);
    if (!root)
        return mt_fail(err, errlen, "%s:%d:%d: malformed JSON: %s", name, jerr.line, jerr.column, jerr.text);
    int rc = -1;
    mt_model_config c;
    memset(&c, 0, sizeof c);
    if (!json_is_object(root)) {
        mt_fail(err, errlen, "%s: the top level must be a JSON object, got %s", name, mt_json_type_name(root));
        goto out;
    }

    json_t *mt = lookup(root, "model_type");
    if (!mt) {
        mt_fail(err, errlen, "%s: key 'model_type': missing (required; one of " FAMILY_NAMES ")", name);
        goto out;
    }
    if (!json_is_string(mt)) {
        mt_fail(err, errlen, "%s: key 'model_type': expected a string, got %s", name, mt_json_type_name(mt));
        goto out;
    }
    const char *type = json_string_value(mt);
    if (strcmp(type, "llama") == 0) c.family = MT_FAMILY_LLAMA;
    else if (strcmp(type, "qwen2") == 0) c.family = MT_FAMILY_QWEN2;
    else if (strcmp(type, "qwen3") == 0) c.family = MT_FAMILY_QWEN3;
    else if (strcmp(type, "mistral") == 0) c.family = MT_FAMILY_MISTRAL;
    else if (strcmp(type, "qwen3_moe") == 0) c.family = MT_FAMILY_QWEN3_MOE;
    else if (strcmp(type, "mixtral") == 0) c.family = MT_FAMILY_MIXTRAL;
    else if (strcmp(type, "gpt_oss") == 0) c.family = MT_FAMILY_GPT_OSS;
    else {
        mt_fail(err, errlen, "%s: key 'model_type': '%s' is not supported (one of " FAMILY_NAMES ")", name, type);
        goto out;
    }
    snprintf(c.model_type, sizeof c.model_type, "%s", type);

    if (get_int(root, name, NULL, "hidden_size", true, 0, &c.hidden, err, errlen) ||
        get_int(root, name, NULL, "intermediate_size", true, 0, &c.intermediate, err, errlen) ||
        get_int(root, name, NULL, "num_hidden_layers", true, 0, &c.layers, err, errlen) ||
        get_int(root, name, NULL, "num_attention_heads", true, 0, &c.heads, err, errlen) ||
        get_int(root, name, NULL, "vocab_size", true, 0, &c.vocab, err, errlen) ||
        get_int(root, name, NULL, "num_key_value_heads", false, c.heads, &c.kv_heads, err, errlen))
        goto out;

    /* head_dim: transformers reads the key when present; Qwen3Config defaults it to 128, the
     * others derive it from hidden_size, which then must divide evenly. */
    if (lookup(root, "head_dim")) {
        if (get_int(root, name, NULL, "head_dim", true, 0, &c.head_dim, err, errlen)) goto out;
    } else if (c.family == MT_FAMILY_QWEN3) {
        c.head_dim = 128;
    } else if (c.family == MT_FAMILY_GPT_OSS) {
        c.head_dim = 64; /* GptOssConfig's default */
    } else {
        if (c.heads > 0 && c.hidden > 0 && c.hidden % c.heads != 0) {
            mt_fail(err, errlen, "%s: key 'num_attention_heads': %lld does not divide hidden_size %lld "
                 "(and no head_dim is given)", name, (long long)c.heads, (long long)c.hidden);
            goto out;
        }
        c.head_dim = c.heads > 0 ? c.hidden / c.heads : 0;
    }

    /* transformers' per-family default context length (LlamaConfig 2048, Qwen2/Qwen3 32768,
     * Mistral 131072), so that a key left out means what it means there. */
    const bool mixtral = c.family == MT_FAMILY_MIXTRAL, gpt_oss = c.family == MT_FAMILY_GPT_OSS;
    int64_t default_positions = c.family == MT_FAMILY_LLAMA ? 2048
                              : c.family == MT_FAMILY_MISTRAL || mixtral || gpt_oss ? 131072 : 32768;
    /* MixtralConfig's own defaults: rope_theta 1e6, rms_norm_eps 1e-5; GptOssConfig's 150000, 1e-5. */
    if (get_int(root, name, NULL, "max_position_embeddings", false, default_positions, &c.max_positions, err, errlen) ||
        get_real(root, name, NULL, "rope_theta", false, mixtral ? 1e6 : gpt_oss ? 150000.0 : 10000.0, &c.rope_theta,
                 err, errlen) ||
        get_real(root, name, NULL, "rms_norm_eps", false, mixtral || gpt_oss ? 1e-5 : 1e-6, &c.rms_eps, err, errlen) ||
        get_bool(root, name, "tie_word_embeddings", false, &c.tied, err, errlen))
        goto out;

    /* Qwen2 always has q/k/v biases (Qwen2Attention hard-codes bias=True); the others read
     * attention_bias, default false. Only Qwen3 normalises q and k per head. */
    if (c.family == MT_FAMILY_QWEN2) {
        c.qkv_bias = true;
    } else {
        /* GptOssConfig defaults attention_bias to true, and gives o_proj the bias too */
        if (get_bool(root, name, "attention_bias", gpt_oss, &c.qkv_bias, err, errlen)) goto out;
        c.o_bias = gpt_oss && c.qkv_bias;
        c.attn_sinks = gpt_oss;
    }
    /* Keys that change what transformers computes, which this model does not do: refused rather
     * than ignored (a model trained here would not be the one transformers builds). */
    bool sliding = false, mlp_bias = false;
    double dropout = 0;
    if (get_bool(root, name, "use_sliding_window", false, &sliding, err, errlen) ||
        get_bool(root, name, "mlp_bias", false, &mlp_bias, err, errlen) ||
        get_real(root, name, NULL, "attention_dropout", false, 0.0, &dropout, err, errlen))
        goto out;
    if (sliding) {
        mt_fail(err, errlen, "%s: key 'use_sliding_window': sliding-window attention is not implemented "
             "(set it to false)", name);
        goto out;
    }
    if (mlp_bias) {
        mt_fail(err, errlen, "%s: key 'mlp_bias': biases on the MLP projections are not implemented", name);
        goto out;
    }
    if (dropout != 0) {
        mt_fail(err, errlen, "%s: key 'attention_dropout': %g; dropout is not implemented (training here is "
             "without it: set 0.0)", name, dropout);
        goto out;
    }
    json_t *types = lookup(root, "layer_types");
    if (types) {
        size_t i;
        json_t *t;
        if (!json_is_array(types)) {
            mt_fail(err, errlen, "%s: key 'layer_types': expected an array, got %s", name, mt_json_type_name(types));
            goto out;
        }
        json_array_foreach(types, i, t) {
            const bool full = json_is_string(t) && strcmp(json_string_value(t), "full_attention") == 0;
            const bool sliding = json_is_string(t) && strcmp(json_string_value(t), "sliding_attention") == 0;
            if (!full && !(gpt_oss && sliding)) {
                mt_fail(err, errlen, "%s: key 'layer_types[%zu]': only \"full_attention\"%s is implemented", name, i,
                        gpt_oss ? " or \"sliding_attention\"" : "");
                goto out;
            }
            if (gpt_oss) {
                if (i >= MT_MAX_LAYER_TYPES) {
                    mt_fail(err, errlen, "%s: key 'layer_types': more than %d entries", name, MT_MAX_LAYER_TYPES);
                    goto out;
                }
                c.layer_sliding[i] = sliding;
                c.layer_types_count = (int64_t)i + 1;
            }
        }
    }
    c.qk_norm = c.family == MT_FAMILY_QWEN3 || c.family == MT_FAMILY_QWEN3_MOE;
    /* sliding_window, absent: MistralConfig's 4096, MixtralConfig's null (full attention),
     * GptOssConfig's 128 (its sliding layers' window); null is no window (Mistral v0.2 and later
     * write null, v0.1 4096; a gpt_oss sliding layer then attends to every earlier key). */
    if ((c.family == MT_FAMILY_MISTRAL || mixtral || gpt_oss) &&
        parse_window(root, name, c.family == MT_FAMILY_MISTRAL ? 4096 : gpt_oss ? 128 : 0, &c.sliding_window, err,
                     errlen))
        goto out;
    if (parse_experts(root, name, &c, err, errlen)) goto out;

    json_t *act = lookup(root, "hidden_act");
    if (act && (!json_is_string(act) || strcmp(json_string_value(act), "silu") != 0)) {
        mt_fail(err, errlen, "%s: key 'hidden_act': only \"silu\" (SwiGLU) is implemented, got %s%s%s", name,
             json_is_string(act) ? "\"" : "", json_is_string(act) ? json_string_value(act) : mt_json_type_name(act),
             json_is_string(act) ? "\"" : "");
        goto out;
    }

    if (parse_rope_scaling(root, name, &c, err, errlen)) goto out;
    if (gpt_oss && !lookup(root, "rope_scaling") && !lookup(root, "rope_parameters")) {
        /* GptOssConfig's rope when the config gives none: yarn over 4096 positions, factor 32 */
        c.rope_type = MT_ROPE_YARN;
        c.rope_scaling_factor = 32.0;
        c.rope_original_max_positions = 4096;
        c.rope_beta_fast = 32.0;
        c.rope_beta_slow = 1.0;
        c.rope_truncate = false;
    }
    if (mt_config_validate(&c, name, err, errlen)) goto out;
    *cfg = c;
    rc = 0;
out:
    json_decref(root);
    return rc;
}

int mt_config_load(const char *path, mt_model_config *cfg, char *err, size_t errlen)
{
    /* A model directory stands for the config.json inside it. */
    struct stat sb;
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) {
        char inner[4096];
        if (snprintf(inner, sizeof inner, "%s/config.json", path) >= (int)sizeof inner)
            return mt_fail(err, errlen, "%s: path too long", path);
        if (access(inner, F_OK) != 0)
            return mt_fail(err, errlen, "%s: a directory without a config.json (give the config file, or a model "
                           "directory holding one)", path);
        return mt_config_load(inner, cfg, err, errlen);
    }
    /* Read the file ourselves so a missing file reports errno, not a parse error. */
    FILE *f = fopen(path, "rb");
    if (!f) return mt_fail(err, errlen, "%s: cannot open the config: %s", path, strerror(errno));
    size_t cap = 1 << 16, len = 0;
    char *text = malloc(cap);
    if (!text) {
        fclose(f);
        return mt_fail(err, errlen, "%s: out of memory reading the config", path);
    }
    for (;;) {
        if (len + 1 >= cap) {
            if (cap >= ((size_t)64 << 20)) {
                free(text);
                fclose(f);
                return mt_fail(err, errlen, "%s: larger than 64 MiB: not a config.json", path);
            }
            char *t = realloc(text, cap * 2);
            if (!t) {
                free(text);
                fclose(f);
                return mt_fail(err, errlen, "%s: out of memory reading the config", path);
            }
            text = t;
            cap *= 2;
        }
        size_t n = fread(text + len, 1, cap - 1 - len, f);
        len += n;
        if (n == 0) break;
    }
    int bad = ferror(f);
    fclose(f);
    text[len] = '\0';
    if (bad) {
        free(text);
        return mt_fail(err, errlen, "%s: read error", path);
    }
    int rc = mt_config_parse(text, path, cfg, err, errlen);
    free(text);
    return rc;
}

static const char *architecture(mt_family f)
{
    switch (f) {
    case MT_FAMILY_LLAMA: return "LlamaForCausalLM";
    case MT_FAMILY_QWEN2: return "Qwen2ForCausalLM";
    case MT_FAMILY_QWEN3: return "Qwen3ForCausalLM";
    case MT_FAMILY_MISTRAL: return "MistralForCausalLM";
    case MT_FAMILY_QWEN3_MOE: return "Qwen3MoeForCausalLM";
    case MT_FAMILY_MIXTRAL: return "MixtralForCausalLM";
    case MT_FAMILY_GPT_OSS: return "GptOssForCausalLM";
    }
    return "LlamaForCausalLM";
}

/* The mixture-of-experts keys, under each family's names. The run's override of the aux loss is
 * not the model's, so output_router_logits is saved as it was read. */
static void save_experts(const mt_model_config *cfg, json_t *o)
{
    if (!mt_cfg_is_moe_family(cfg->family)) return;
    const bool mixtral = cfg->family == MT_FAMILY_MIXTRAL;
    json_object_set_new(o, mt_cfg_expert_count_key(cfg), json_integer(cfg->experts));
    json_object_set_new(o, "num_experts_per_tok", json_integer(cfg->experts_per_token));
    if (cfg->family == MT_FAMILY_GPT_OSS) {
        json_object_set_new(o, "swiglu_alpha", json_real(cfg->swiglu_alpha));
        json_object_set_new(o, "swiglu_limit", json_real(cfg->swiglu_limit));
        /* as read: given (one per layer), or absent for transformers' default alternation */
        if (cfg->layer_types_count > 0) {
            json_t *types = json_array();
            for (int64_t i = 0; i < cfg->layer_types_count; i++)
                json_array_append_new(types, json_string(cfg->layer_sliding[i] ? "sliding_attention" : "full_attention"));
            json_object_set_new(o, "layer_types", types);
        }
    } else if (mixtral) {
        json_object_set_new(o, "router_jitter_noise", json_real(0.0));
    } else {
        json_object_set_new(o, "moe_intermediate_size", json_integer(cfg->expert_intermediate));
        json_object_set_new(o, "norm_topk_prob", json_boolean(cfg->norm_topk_prob));
        json_object_set_new(o, "decoder_sparse_step", json_integer(cfg->decoder_sparse_step));
        json_t *dense = json_array();
        for (int64_t i = 0; i < cfg->mlp_only_layers_count; i++)
            json_array_append_new(dense, json_integer(cfg->mlp_only_layers[i]));
        json_object_set_new(o, "mlp_only_layers", dense);
        json_object_set_new(o, "use_sliding_window", json_false());
    }
    json_object_set_new(o, "router_aux_loss_coef", json_real(cfg->router_aux_loss_coef));
    json_object_set_new(o, "output_router_logits", json_boolean(cfg->output_router_logits));
}

/* The "rope_scaling" object transformers reads (null without scaling): each type's keys, yarn's
 * optional ones only when they differ from "absent". */
static json_t *rope_scaling_json(const mt_model_config *cfg)
{
    if (cfg->rope_type == MT_ROPE_DEFAULT && cfg->family == MT_FAMILY_GPT_OSS) {
        /* GptOssConfig reads a missing or null rope as its yarn: the plain rope is said outright */
        json_t *rs = json_object();
        json_object_set_new(rs, "rope_type", json_string("default"));
        return rs;
    }
    if (cfg->rope_type == MT_ROPE_DEFAULT) return json_null();
    json_t *rs = json_object();
    json_object_set_new(rs, "rope_type", json_string(mt_cfg_rope_type_name(cfg->rope_type)));
    json_object_set_new(rs, "factor", json_real(cfg->rope_scaling_factor));
    if (cfg->rope_type == MT_ROPE_LLAMA3) {
        json_object_set_new(rs, "low_freq_factor", json_real(cfg->rope_low_freq_factor));
        json_object_set_new(rs, "high_freq_factor", json_real(cfg->rope_high_freq_factor));
    }
    if (cfg->rope_type == MT_ROPE_YARN || cfg->rope_type == MT_ROPE_LLAMA3)
        json_object_set_new(rs, "original_max_position_embeddings", json_integer(cfg->rope_original_max_positions));
    if (cfg->rope_type == MT_ROPE_YARN) {
        json_object_set_new(rs, "beta_fast", json_real(cfg->rope_beta_fast));
        json_object_set_new(rs, "beta_slow", json_real(cfg->rope_beta_slow));
        if (cfg->rope_mscale != 0) json_object_set_new(rs, "mscale", json_real(cfg->rope_mscale));
        if (cfg->rope_mscale_all_dim != 0) json_object_set_new(rs, "mscale_all_dim", json_real(cfg->rope_mscale_all_dim));
        if (cfg->rope_attention_factor != 0)
            json_object_set_new(rs, "attention_factor", json_real(cfg->rope_attention_factor));
        if (!cfg->rope_truncate) json_object_set_new(rs, "truncate", json_false());
    }
    return rs;
}

int mt_config_save(const mt_model_config *cfg, const char *path, char *err, size_t errlen)
{
    if (mt_config_validate(cfg, path, err, errlen)) return -1;
    json_t *o = json_object();
    json_t *arch = json_array();
    json_array_append_new(arch, json_string(architecture(cfg->family)));
    json_object_set_new(o, "architectures", arch);
    json_object_set_new(o, "model_type", json_string(cfg->model_type));
    json_object_set_new(o, "hidden_size", json_integer(cfg->hidden));
    json_object_set_new(o, "intermediate_size", json_integer(cfg->intermediate));
    json_object_set_new(o, "num_hidden_layers", json_integer(cfg->layers));
    json_object_set_new(o, "num_attention_heads", json_integer(cfg->heads));
    json_object_set_new(o, "num_key_value_heads", json_integer(cfg->kv_heads));
    json_object_set_new(o, "head_dim", json_integer(cfg->head_dim));
    json_object_set_new(o, "vocab_size", json_integer(cfg->vocab));
    json_object_set_new(o, "max_position_embeddings", json_integer(cfg->max_positions));
    json_object_set_new(o, "rope_theta", json_real(cfg->rope_theta));
    json_object_set_new(o, "rms_norm_eps", json_real(cfg->rms_eps));
    json_object_set_new(o, "tie_word_embeddings", json_boolean(cfg->tied));
    json_object_set_new(o, "hidden_act", json_string("silu"));
    json_object_set_new(o, "torch_dtype", json_string("float32"));
    json_object_set_new(o, "attention_dropout", json_real(0.0));
    if (cfg->family == MT_FAMILY_QWEN2) {
        json_object_set_new(o, "use_sliding_window", json_false());
    } else {
        json_object_set_new(o, "attention_bias", json_boolean(cfg->qkv_bias));
    }
    /* The model's own window, or null (full attention; MistralConfig would read a missing key as
     * 4096). A Mistral or Mixtral here never trains past its window (mt_config_check_seq_len),
     * where full attention and the window agree; gpt_oss's sliding layers use theirs. */
    if (cfg->family == MT_FAMILY_MISTRAL || cfg->family == MT_FAMILY_MIXTRAL || cfg->family == MT_FAMILY_GPT_OSS)
        json_object_set_new(o, "sliding_window", cfg->sliding_window > 0 ? json_integer(cfg->sliding_window) : json_null());
    save_experts(cfg, o);
    json_object_set_new(o, "rope_scaling", rope_scaling_json(cfg));
    /* Default real precision (17 digits) so every double reads back bit for bit. */
    int rc = json_dump_file(o, path, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(o);
    if (rc != 0) return mt_fail(err, errlen, "%s: cannot write the config: %s", path, strerror(errno));
    return 0;
}
