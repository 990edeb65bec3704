/* Reads, checks and writes HF config.json files of the Llama/Qwen2/Qwen3/Mistral families and of
 * the mixture-of-experts Qwen3-MoE and Mixtral, counts their parameters (total and active), and
 * knows the published shapes the benchmarks use. Every user error names the file and the key,
 * because a config is usually hand-edited or downloaded and the user must find what to fix. */
#include "models/config.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "models/report.h"

#include "models/layout.h"

/* Any single size above this is a typo or an attack, not a model; it also keeps every product the
 * layout and the memory plan form (sizes times 18-20 bytes) far from int64 overflow. */
#define MAX_SIZE ((int64_t)1 << 31)
/* The largest parameter count accepted: the plan multiplies it by at most 20 bytes per
 * parameter plus alignment, which must still fit in int64. */
#define MAX_PARAMS ((int64_t)1 << 56)

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

/* The rope_type names of HF configs, by mt_rope_type. */
static const char *const rope_type_names[] = {"default", "linear", "dynamic", "yarn", "llama3"};

static const char *rope_type_name(mt_rope_type t)
{
    return (unsigned)t < sizeof rope_type_names / sizeof rope_type_names[0] ? rope_type_names[t] : "?";
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
    for (int k = 0; k < (int)(sizeof rope_type_names / sizeof rope_type_names[0]); k++)
        if (strcmp(t, rope_type_names[k]) == 0) found = k;
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
#define FAMILY_NAMES "llama, qwen2, qwen3, mistral, qwen3_moe, mixtral"

static bool is_moe_family(mt_family f) { return f == MT_FAMILY_QWEN3_MOE || f == MT_FAMILY_MIXTRAL; }

/* The expert count: each family's own key, or the other spelling, which transformers maps onto it
 * (attribute_map num_experts -> num_local_experts); both present must agree. */
static int parse_expert_count(json_t *root, const char *name, mt_model_config *c, char *err, size_t errlen)
{
    const bool mixtral = c->family == MT_FAMILY_MIXTRAL;
    const char *own = mixtral ? "num_local_experts" : "num_experts";
    const char *other = mixtral ? "num_experts" : "num_local_experts";
    int64_t a = 0, b = 0;
    if (get_int(root, name, NULL, own, false, mixtral ? 8 : 128, &a, err, errlen) ||
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
    if (!is_moe_family(c->family)) return 0;
    const bool mixtral = c->family == MT_FAMILY_MIXTRAL;
    if (parse_expert_count(root, name, c, err, errlen) ||
        get_int(root, name, NULL, "num_experts_per_tok", false, mixtral ? 2 : 8, &c->experts_per_token, err, errlen) ||
        get_real(root, name, NULL, "router_aux_loss_coef", false, 0.001, &c->router_aux_loss_coef, err, errlen) ||
        get_bool(root, name, "output_router_logits", false, &c->output_router_logits, err, errlen))
        return -1;
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
    const bool mixtral = c.family == MT_FAMILY_MIXTRAL;
    int64_t default_positions = c.family == MT_FAMILY_LLAMA ? 2048
                              : c.family == MT_FAMILY_MISTRAL || mixtral ? 131072 : 32768;
    /* MixtralConfig's own defaults: rope_theta 1e6, rms_norm_eps 1e-5. */
    if (get_int(root, name, NULL, "max_position_embeddings", false, default_positions, &c.max_positions, err, errlen) ||
        get_real(root, name, NULL, "rope_theta", false, mixtral ? 1e6 : 10000.0, &c.rope_theta, err, errlen) ||
        get_real(root, name, NULL, "rms_norm_eps", false, mixtral ? 1e-5 : 1e-6, &c.rms_eps, err, errlen) ||
        get_bool(root, name, "tie_word_embeddings", false, &c.tied, err, errlen))
        goto out;

    /* Qwen2 always has q/k/v biases (Qwen2Attention hard-codes bias=True); the others read
     * attention_bias, default false. Only Qwen3 normalises q and k per head. */
    if (c.family == MT_FAMILY_QWEN2) {
        c.qkv_bias = true;
    } else {
        if (get_bool(root, name, "attention_bias", false, &c.qkv_bias, err, errlen)) goto out;
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
        json_array_foreach(types, i, t)
            if (!json_is_string(t) || strcmp(json_string_value(t), "full_attention") != 0) {
                mt_fail(err, errlen, "%s: key 'layer_types[%zu]': only \"full_attention\" is implemented", name, i);
                goto out;
            }
    }
    c.qk_norm = c.family == MT_FAMILY_QWEN3 || c.family == MT_FAMILY_QWEN3_MOE;
    /* Mistral: sliding_window, which MistralConfig defaults to 4096 when the key is absent; null
     * is full attention (v0.2 and later write null, v0.1 4096). */
    if (c.family == MT_FAMILY_MISTRAL) {
        json_t *sw = json_object_get(root, "sliding_window");
        if (!sw) c.sliding_window = 4096;
        else if (json_is_null(sw)) c.sliding_window = 0;
        else if (json_is_integer(sw) && json_integer_value(sw) > 0) c.sliding_window = json_integer_value(sw);
        else {
            mt_fail(err, errlen, "%s: key 'sliding_window': expected a positive integer or null, got %s", name,
                 mt_json_type_name(sw));
            goto out;
        }
    }
    /* Mixtral: the same key, but MixtralConfig defaults it to null (full attention). */
    if (mixtral) {
        json_t *sw = lookup(root, "sliding_window");
        if (sw && !(json_is_integer(sw) && json_integer_value(sw) > 0)) {
            mt_fail(err, errlen, "%s: key 'sliding_window': expected a positive integer or null, got %s", name,
                    mt_json_type_name(sw));
            goto out;
        }
        c.sliding_window = sw ? json_integer_value(sw) : 0;
    }
    if (parse_experts(root, name, &c, err, errlen)) goto out;

    json_t *act = lookup(root, "hidden_act");
    if (act && (!json_is_string(act) || strcmp(json_string_value(act), "silu") != 0)) {
        mt_fail(err, errlen, "%s: key 'hidden_act': only \"silu\" (SwiGLU) is implemented, got %s%s%s", name,
             json_is_string(act) ? "\"" : "", json_is_string(act) ? json_string_value(act) : mt_json_type_name(act),
             json_is_string(act) ? "\"" : "");
        goto out;
    }

    if (parse_rope_scaling(root, name, &c, err, errlen)) goto out;
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

/* A size key must be a positive integer of sane magnitude. */
static int check_size(const char *name, const char *key, int64_t v, char *err, size_t errlen)
{
    if (v <= 0) return mt_fail(err, errlen, "%s: key '%s': must be a positive integer, got %lld", name, key, (long long)v);
    if (v > MAX_SIZE)
        return mt_fail(err, errlen, "%s: key '%s': %lld is absurdly large (limit %lld)", name, key, (long long)v,
                    (long long)MAX_SIZE);
    return 0;
}

static int64_t round_up(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

/* *out = a * b, or a + b, when it neither overflows nor exceeds MAX_PARAMS (so that rounding it
 * up to the tile alignment cannot overflow either); false otherwise. */
static bool size_product(int64_t a, int64_t b, int64_t *out)
{
    return !__builtin_mul_overflow(a, b, out) && *out <= MAX_PARAMS;
}
static bool size_sum(int64_t a, int64_t b, int64_t *out)
{
    return !__builtin_add_overflow(a, b, out) && *out <= MAX_PARAMS;
}

static const char *expert_count_key(const mt_model_config *cfg)
{
    return cfg->family == MT_FAMILY_MIXTRAL ? "num_local_experts" : "num_experts";
}

/* The mixture-of-experts fields: only the MoE families have them, and what each can express in
 * transformers (Mixtral: every layer sparse, top k always renormalised). */
static int validate_experts(const mt_model_config *cfg, const char *name, char *err, size_t errlen)
{
    if (!is_moe_family(cfg->family)) {
        if (cfg->experts != 0 || cfg->mlp_only_layers_count != 0)
            return mt_fail(err, errlen, "%s: key 'model_type': %s has no experts (a mixture of experts is qwen3_moe or "
                           "mixtral)", name, cfg->model_type);
        return 0;
    }
    const char *count_key = expert_count_key(cfg);
    if (cfg->experts < 0 || cfg->experts > MT_MAX_EXPERTS)
        return mt_fail(err, errlen, "%s: key '%s': %lld experts; between 0 and %d are supported", name, count_key,
                       (long long)cfg->experts, MT_MAX_EXPERTS);
    if (cfg->family == MT_FAMILY_MIXTRAL) {
        if (cfg->experts == 0)
            return mt_fail(err, errlen, "%s: key 'num_local_experts': must be a positive integer, got 0", name);
        if (!cfg->norm_topk_prob || cfg->decoder_sparse_step != 1 || cfg->mlp_only_layers_count != 0 ||
            cfg->expert_intermediate != cfg->intermediate)
            return mt_fail(err, errlen, "%s: key 'model_type': mixtral renormalises its top k, has experts of "
                           "intermediate_size in every layer", name);
    }
    if (!(cfg->router_aux_loss_coef >= 0) || !isfinite(cfg->router_aux_loss_coef))
        return mt_fail(err, errlen, "%s: key 'router_aux_loss_coef': must be a finite number >= 0, got %g", name,
                       cfg->router_aux_loss_coef);
    if (cfg->router_aux != MT_ROUTER_AUX_FROM_CONFIG && cfg->router_aux != MT_ROUTER_AUX_ON &&
        cfg->router_aux != MT_ROUTER_AUX_OFF)
        return mt_fail(err, errlen, "%s: the router aux loss override is %d, not one of from-config, on, off", name,
                       (int)cfg->router_aux);
    if (cfg->experts == 0) return 0; /* qwen3_moe with no experts: every layer dense */
    if (cfg->experts_per_token < 1 || cfg->experts_per_token > cfg->experts)
        return mt_fail(err, errlen, "%s: key 'num_experts_per_tok': %lld; must be between 1 and %s (%lld)", name,
                       (long long)cfg->experts_per_token, count_key, (long long)cfg->experts);
    if (check_size(name, cfg->family == MT_FAMILY_MIXTRAL ? "intermediate_size" : "moe_intermediate_size",
                   cfg->expert_intermediate, err, errlen) ||
        check_size(name, "decoder_sparse_step", cfg->decoder_sparse_step, err, errlen))
        return -1;
    if (cfg->mlp_only_layers_count < 0 || cfg->mlp_only_layers_count > MT_MAX_MLP_ONLY_LAYERS)
        return mt_fail(err, errlen, "%s: key 'mlp_only_layers': %lld entries; at most %d are supported", name,
                       (long long)cfg->mlp_only_layers_count, MT_MAX_MLP_ONLY_LAYERS);
    for (int64_t i = 0; i < cfg->mlp_only_layers_count; i++) {
        const int64_t l = cfg->mlp_only_layers[i];
        if (l < 0 || l >= cfg->layers)
            return mt_fail(err, errlen, "%s: key 'mlp_only_layers': layer %lld does not exist (num_hidden_layers is "
                           "%lld)", name, (long long)l, (long long)cfg->layers);
        if (i > 0 && l <= cfg->mlp_only_layers[i - 1])
            return mt_fail(err, errlen, "%s: key 'mlp_only_layers': entries must be sorted and distinct", name);
    }
    return 0;
}

/* The length a scaling's factor multiplies: the original pretraining context for yarn and
 * llama3, max_position_embeddings itself for linear and dynamic (transformers' formulas use it). */
static int64_t rope_original_length(const mt_model_config *cfg)
{
    return cfg->rope_type == MT_ROPE_YARN || cfg->rope_type == MT_ROPE_LLAMA3 ? cfg->rope_original_max_positions
                                                                              : cfg->max_positions;
}

/* The rope scaling fields of a config against what each type needs. */
static int validate_rope_scaling(const mt_model_config *cfg, const char *name, char *err, size_t errlen)
{
    if ((unsigned)cfg->rope_type > MT_ROPE_LLAMA3)
        return mt_fail(err, errlen, "%s: key 'rope_scaling': unknown rope type %d", name, (int)cfg->rope_type);
    if (cfg->rope_type == MT_ROPE_DEFAULT) {
        if (cfg->rope_scaling_factor != 0)
            return mt_fail(err, errlen, "%s: key 'rope_scaling': factor %g without a rope_type", name,
                           cfg->rope_scaling_factor);
        return 0;
    }
    const char *type = rope_type_name(cfg->rope_type);
    if (!(cfg->rope_scaling_factor > 0) || !isfinite(cfg->rope_scaling_factor))
        return mt_fail(err, errlen, "%s: key 'rope_scaling': %s factor must be positive, got %g", name, type,
                    cfg->rope_scaling_factor);
    if (cfg->rope_type == MT_ROPE_LLAMA3 &&
        (!(cfg->rope_low_freq_factor > 0) || !(cfg->rope_high_freq_factor > cfg->rope_low_freq_factor) ||
         !isfinite(cfg->rope_high_freq_factor)))
        return mt_fail(err, errlen, "%s: key 'rope_scaling': needs 0 < low_freq_factor < high_freq_factor, "
                    "got %g and %g", name, cfg->rope_low_freq_factor, cfg->rope_high_freq_factor);
    if ((cfg->rope_type == MT_ROPE_YARN || cfg->rope_type == MT_ROPE_LLAMA3) &&
        (cfg->rope_original_max_positions <= 0 || cfg->rope_original_max_positions > MAX_SIZE))
        return mt_fail(err, errlen, "%s: key 'rope_scaling': original_max_position_embeddings must be a "
                    "positive integer, got %lld", name, (long long)cfg->rope_original_max_positions);
    if (cfg->rope_type == MT_ROPE_YARN) {
        /* The ramp's ends are dims at which a wavelength makes beta turns over the original
         * context: log(original / (beta 2 pi)) needs beta > 0, and the ramp rises only when the
         * fast end (more turns, shorter wavelengths) is at or above the slow one. */
        if (!(cfg->rope_beta_fast > 0) || !(cfg->rope_beta_slow > 0) || !isfinite(cfg->rope_beta_fast) ||
            cfg->rope_beta_fast < cfg->rope_beta_slow)
            return mt_fail(err, errlen, "%s: key 'rope_scaling': yarn needs beta_fast >= beta_slow > 0, got %g and %g",
                        name, cfg->rope_beta_fast, cfg->rope_beta_slow);
        if (!isfinite(cfg->rope_mscale) || !isfinite(cfg->rope_mscale_all_dim) ||
            !(cfg->rope_attention_factor >= 0) || !isfinite(cfg->rope_attention_factor))
            return mt_fail(err, errlen, "%s: key 'rope_scaling': yarn's mscale %g, mscale_all_dim %g and "
                        "attention_factor %g must be finite (attention_factor positive, or 0 when derived)", name,
                        cfg->rope_mscale, cfg->rope_mscale_all_dim, cfg->rope_attention_factor);
    }
    /* dynamic raises the base to the power D / (D - 2) */
    if (cfg->rope_type == MT_ROPE_DYNAMIC && cfg->head_dim <= 2)
        return mt_fail(err, errlen, "%s: key 'rope_scaling': dynamic scaling needs head_dim > 2, got %lld", name,
                    (long long)cfg->head_dim);
    const double longest = cfg->rope_scaling_factor * (double)rope_original_length(cfg);
    if (!(longest <= (double)MAX_SIZE))
        return mt_fail(err, errlen, "%s: key 'rope_scaling': factor %g x %lld positions is absurdly large (limit %lld)",
                    name, cfg->rope_scaling_factor, (long long)rope_original_length(cfg), (long long)MAX_SIZE);
    return 0;
}

int mt_config_validate(const mt_model_config *cfg, const char *name, char *err, size_t errlen)
{
    if (!name) name = "config";
    if (check_size(name, "hidden_size", cfg->hidden, err, errlen) ||
        check_size(name, "intermediate_size", cfg->intermediate, err, errlen) ||
        check_size(name, "num_hidden_layers", cfg->layers, err, errlen) ||
        check_size(name, "num_attention_heads", cfg->heads, err, errlen) ||
        check_size(name, "num_key_value_heads", cfg->kv_heads, err, errlen) ||
        check_size(name, "head_dim", cfg->head_dim, err, errlen) ||
        check_size(name, "vocab_size", cfg->vocab, err, errlen) ||
        check_size(name, "max_position_embeddings", cfg->max_positions, err, errlen))
        return -1;
    if (cfg->heads % cfg->kv_heads != 0)
        return mt_fail(err, errlen, "%s: key 'num_key_value_heads': %lld does not divide num_attention_heads %lld",
                    name, (long long)cfg->kv_heads, (long long)cfg->heads);
    /* RoPE rotates pairs (half-split), so the head dimension must be even. */
    if (cfg->head_dim % 2 != 0)
        return mt_fail(err, errlen, "%s: key 'head_dim': %lld must be even for rotary embeddings", name,
                    (long long)cfg->head_dim);
    if (!(cfg->rope_theta > 0) || !isfinite(cfg->rope_theta))
        return mt_fail(err, errlen, "%s: key 'rope_theta': must be a positive number, got %g", name, cfg->rope_theta);
    if (!(cfg->rms_eps > 0) || !isfinite(cfg->rms_eps))
        return mt_fail(err, errlen, "%s: key 'rms_norm_eps': must be a positive number, got %g", name, cfg->rms_eps);

    if (validate_rope_scaling(cfg, name, err, errlen)) return -1;

    /* What transformers builds for each family: refuse combinations it cannot express, so that a
     * saved config loads back into the same model there. */
    switch (cfg->family) {
    case MT_FAMILY_QWEN2:
        if (!cfg->qkv_bias || cfg->qk_norm)
            return mt_fail(err, errlen, "%s: key 'model_type': qwen2 always has q/k/v biases and no q/k norm", name);
        break;
    case MT_FAMILY_QWEN3:
    case MT_FAMILY_QWEN3_MOE:
        if (!cfg->qk_norm)
            return mt_fail(err, errlen, "%s: key 'model_type': %s always has q/k norms", name, cfg->model_type);
        /* fall through */
    case MT_FAMILY_MISTRAL:
    case MT_FAMILY_MIXTRAL:
    case MT_FAMILY_LLAMA:
        /* transformers' Llama, Mistral and Qwen3 attention give attention_bias to o_proj as well
         * as q, k and v; only Qwen2's q/k/v-only biases are implemented here */
        if (cfg->qkv_bias)
            return mt_fail(err, errlen, "%s: key 'attention_bias': true gives %s biases on q, k, v and o_proj in "
                        "transformers; the o_proj bias is not implemented", name, cfg->model_type);
        if (cfg->family == MT_FAMILY_QWEN3 || cfg->family == MT_FAMILY_QWEN3_MOE) break;
        if (cfg->qk_norm)
            return mt_fail(err, errlen, "%s: key 'model_type': %s has no q/k norm", name, cfg->model_type);
        break;
    default:
        return mt_fail(err, errlen, "%s: key 'model_type': unknown family %d", name, (int)cfg->family);
    }

    if (validate_experts(cfg, name, err, errlen)) return -1;

    /* Every product and sum below is checked (the numbers come from a file), and the total is
     * bounded by MAX_PARAMS so that the layout's offsets and the plan's byte counts, which
     * multiply it by a few dozen at most, cannot overflow either. */
    int64_t d = cfg->hidden, D = cfg->head_dim, I = cfg->intermediate;
    int64_t q, kv;
    if (!size_product(cfg->heads, D, &q) || !size_product(cfg->kv_heads, D, &kv) || q > MAX_SIZE || kv > MAX_SIZE)
        return mt_fail(err, errlen, "%s: key 'num_attention_heads': num_attention_heads * head_dim = %lld * %lld is absurdly large",
                    name, (long long)cfg->heads, (long long)D);
    const int64_t factors[][2] = {{d, 1}, {q, d}, {q, 1}, {kv, d}, {kv, 1}, {kv, d}, {kv, 1}, {d, q}, {D, 1}, {D, 1},
                                  {d, 1}, {I, d}, {I, d}, {d, I}};
    int64_t layer = 0, part;
    for (size_t i = 0; i < sizeof factors / sizeof factors[0]; i++)
        if (!size_product(factors[i][0], factors[i][1], &part) || !size_sum(layer, round_up(part, MT_TILE_ALIGN), &layer))
            return mt_fail(err, errlen, "%s: key 'hidden_size': a layer with hidden_size %lld and intermediate_size %lld "
                        "is absurdly large", name, (long long)d, (long long)I);
    /* A sparse layer holds its router and every expert besides (bounding the larger of the two
     * kinds of layer by their sum is enough here). */
    if (cfg->experts > 0) {
        int64_t router, expert, experts;
        if (!size_product(cfg->experts, d, &router) || !size_sum(layer, round_up(router, MT_TILE_ALIGN), &layer) ||
            !size_product(cfg->expert_intermediate, d, &expert) ||
            !size_product(round_up(expert, MT_TILE_ALIGN), 3 * cfg->experts, &experts) ||
            !size_sum(layer, experts, &layer))
            return mt_fail(err, errlen, "%s: key '%s': %lld experts of width %lld at hidden_size %lld make a layer "
                           "absurdly large", name, expert_count_key(cfg), (long long)cfg->experts,
                           (long long)cfg->expert_intermediate, (long long)d);
    }
    int64_t layers_total;
    if (!size_product(cfg->layers, layer, &layers_total))
        return mt_fail(err, errlen, "%s: key 'num_hidden_layers': %lld layers of %lld parameters each is absurdly large",
                    name, (long long)cfg->layers, (long long)layer);
    int64_t table, tables, total;
    if (!size_product(cfg->vocab, d, &table) || !size_product(round_up(table, MT_TILE_ALIGN), 2, &tables) ||
        !size_sum(layers_total, tables, &total))
        return mt_fail(err, errlen, "%s: key 'vocab_size': %lld * hidden_size %lld makes the model absurdly large",
                    name, (long long)cfg->vocab, (long long)d);
    return 0;
}

bool mt_config_layer_is_sparse(const mt_model_config *cfg, int64_t layer)
{
    /* Qwen3MoeDecoderLayer: sparse unless listed in mlp_only_layers, when there are experts and
     * (layer + 1) is a multiple of decoder_sparse_step. */
    if (cfg->experts <= 0 || cfg->decoder_sparse_step <= 0) return false;
    for (int64_t i = 0; i < cfg->mlp_only_layers_count; i++)
        if (cfg->mlp_only_layers[i] == layer) return false;
    return (layer + 1) % cfg->decoder_sparse_step == 0;
}

int64_t mt_config_sparse_layers(const mt_model_config *cfg)
{
    int64_t n = 0;
    for (int64_t l = 0; l < cfg->layers; l++) n += mt_config_layer_is_sparse(cfg, l);
    return n;
}

bool mt_config_has_dense_layers(const mt_model_config *cfg)
{
    return mt_config_sparse_layers(cfg) < cfg->layers;
}

/* The per-layer parameter count without padding, as HF's num_parameters() counts it: the
 * attention block with both norms, then the MLP. */
static int64_t attention_params(const mt_model_config *cfg)
{
    int64_t d = cfg->hidden, D = cfg->head_dim;
    int64_t q = cfg->heads * D, kv = cfg->kv_heads * D;
    int64_t n = 2 * d;                       /* input and post-attention norms */
    n += q * d + 2 * kv * d + d * q;         /* q, k, v, o projections */
    if (cfg->qkv_bias) n += q + 2 * kv;
    if (cfg->qk_norm) n += 2 * D;
    return n;
}

/* The MLP of layer `layer`: gate, up, down of a dense layer; of a sparse one the router and all
 * experts, or (active) the router and the k experts one token uses. */
static int64_t mlp_params(const mt_model_config *cfg, int64_t layer, bool active)
{
    const int64_t d = cfg->hidden;
    if (!mt_config_layer_is_sparse(cfg, layer)) return 3 * cfg->intermediate * d;
    const int64_t used = active ? cfg->experts_per_token : cfg->experts;
    return cfg->experts * d + used * 3 * cfg->expert_intermediate * d;
}

static int64_t layers_params(const mt_model_config *cfg, bool active)
{
    int64_t n = 0;
    for (int64_t l = 0; l < cfg->layers; l++) n += attention_params(cfg) + mlp_params(cfg, l, active);
    return n;
}

int64_t mt_config_param_count(const mt_model_config *cfg)
{
    int64_t table = cfg->vocab * cfg->hidden;
    return table + layers_params(cfg, false) + cfg->hidden + (cfg->tied ? 0 : table);
}

int64_t mt_config_active_param_count(const mt_model_config *cfg)
{
    int64_t table = cfg->vocab * cfg->hidden;
    return table + layers_params(cfg, true) + cfg->hidden + (cfg->tied ? 0 : table);
}

int64_t mt_config_flops_params(const mt_model_config *cfg)
{
    /* The embedding lookup does no FLOPs; the LM head's matmul does, tied or not. A token's
     * FLOPs follow the experts it is routed to: active parameters. */
    return layers_params(cfg, true) + cfg->hidden + cfg->vocab * cfg->hidden;
}

double mt_config_router_aux_coef(const mt_model_config *cfg)
{
    const bool on = cfg->router_aux == MT_ROUTER_AUX_ON ||
                    (cfg->router_aux == MT_ROUTER_AUX_FROM_CONFIG && cfg->output_router_logits);
    return on && mt_config_sparse_layers(cfg) > 0 ? cfg->router_aux_loss_coef : 0.0;
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
    }
    return "LlamaForCausalLM";
}

/* The mixture-of-experts keys, under each family's names. The run's override of the aux loss is
 * not the model's, so output_router_logits is saved as it was read. */
static void save_experts(const mt_model_config *cfg, json_t *o)
{
    if (!is_moe_family(cfg->family)) return;
    const bool mixtral = cfg->family == MT_FAMILY_MIXTRAL;
    json_object_set_new(o, expert_count_key(cfg), json_integer(cfg->experts));
    json_object_set_new(o, "num_experts_per_tok", json_integer(cfg->experts_per_token));
    if (mixtral) {
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
    if (cfg->rope_type == MT_ROPE_DEFAULT) return json_null();
    json_t *rs = json_object();
    json_object_set_new(rs, "rope_type", json_string(rope_type_name(cfg->rope_type)));
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
     * 4096). Training here never passes the window (runtime/step/graph.c refuses it), where the
     * two agree. */
    if (cfg->family == MT_FAMILY_MISTRAL || cfg->family == MT_FAMILY_MIXTRAL)
        json_object_set_new(o, "sliding_window", cfg->sliding_window > 0 ? json_integer(cfg->sliding_window) : json_null());
    save_experts(cfg, o);
    json_object_set_new(o, "rope_scaling", rope_scaling_json(cfg));
    /* Default real precision (17 digits) so every double reads back bit for bit. */
    int rc = json_dump_file(o, path, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(o);
    if (rc != 0) return mt_fail(err, errlen, "%s: cannot write the config: %s", path, strerror(errno));
    return 0;
}

/* ---- rope scaling set by the user, and the sequence lengths a config takes ---- */

int64_t mt_config_max_seq_len(const mt_model_config *cfg)
{
    int64_t limit = cfg->max_positions;
    if (cfg->rope_type != MT_ROPE_DEFAULT) {
        /* validate bounds factor x original by MAX_SIZE, so the product fits */
        const int64_t scaled = (int64_t)floor(cfg->rope_scaling_factor * (double)rope_original_length(cfg));
        if (scaled > limit) limit = scaled;
    }
    if (cfg->sliding_window > 0 && cfg->sliding_window < limit) limit = cfg->sliding_window;
    return limit;
}

/* The smallest whole factor above 1 that takes seq_len over `original` positions. */
static long long factor_for(int64_t seq_len, int64_t original)
{
    const long long f = (long long)((seq_len + original - 1) / original);
    return f < 2 ? 2 : f;
}

int mt_config_check_seq_len(const mt_model_config *cfg, int64_t seq_len, char *err, size_t errlen)
{
    if (seq_len < 1) return mt_fail(err, errlen, "sequence length %lld: must be at least 1", (long long)seq_len);
    const int64_t limit = mt_config_max_seq_len(cfg);
    if (seq_len <= limit) return 0;
    const long long T = (long long)seq_len, L = (long long)limit;
    if (cfg->sliding_window > 0 && limit == cfg->sliding_window)
        return mt_fail(err, errlen, "sequence length %lld exceeds the model's sliding_window %lld: sliding-window "
                       "attention is not implemented (full causal attention, which is the same up to that length)",
                       T, L);
    const int64_t original = rope_original_length(cfg);
    switch (cfg->rope_type) {
    case MT_ROPE_DEFAULT:
        return mt_fail(err, errlen, "sequence length %lld exceeds the model's max_position_embeddings %lld: "
                       "--rope-scaling yarn:%lld (or linear:%lld, dynamic:%lld) extends the rope to %lld positions",
                       T, L, factor_for(seq_len, original), factor_for(seq_len, original),
                       factor_for(seq_len, original), factor_for(seq_len, original) * (long long)original);
    case MT_ROPE_LLAMA3:
        return mt_fail(err, errlen, "sequence length %lld exceeds the model's %lld positions (max_position_embeddings, "
                       "with llama3 rope scaling of factor %g over %lld, which --rope-scaling does not change)", T, L,
                       cfg->rope_scaling_factor, (long long)original);
    default:
        return mt_fail(err, errlen, "sequence length %lld exceeds the model's %lld positions (%s rope scaling: factor %g "
                       "x %lld): --rope-scaling %s:%lld extends it to %lld", T, L, rope_type_name(cfg->rope_type),
                       cfg->rope_scaling_factor, (long long)original, rope_type_name(cfg->rope_type),
                       factor_for(seq_len, original), factor_for(seq_len, original) * (long long)original);
    }
}

int mt_rope_scaling_parse(const char *spec, mt_rope_type *type, double *factor, char *err, size_t errlen)
{
    const char *colon = spec ? strchr(spec, ':') : NULL;
    if (!colon)
        return mt_fail(err, errlen, "--rope-scaling %s: expected TYPE:FACTOR, TYPE one of linear, dynamic, yarn "
                       "(e.g. yarn:4)", spec ? spec : "");
    const size_t n = (size_t)(colon - spec);
    mt_rope_type t;
    if (n == 6 && strncmp(spec, "linear", n) == 0) t = MT_ROPE_LINEAR;
    else if (n == 7 && strncmp(spec, "dynamic", n) == 0) t = MT_ROPE_DYNAMIC;
    else if (n == 4 && strncmp(spec, "yarn", n) == 0) t = MT_ROPE_YARN;
    else if (n == 6 && strncmp(spec, "llama3", n) == 0)
        return mt_fail(err, errlen, "--rope-scaling %s: llama3 is not offered (its factor does not set the length: "
                       "Llama 3.1 has factor 8 over 8192 and 131072 positions); one of linear, dynamic, yarn", spec);
    else
        return mt_fail(err, errlen, "--rope-scaling %s: type '%.*s' is not one of linear, dynamic, yarn", spec,
                       (int)n, spec);
    char *end;
    errno = 0;
    const double f = strtod(colon + 1, &end);
    if (errno || end == colon + 1 || *end || !isfinite(f))
        return mt_fail(err, errlen, "--rope-scaling %s: factor '%s' is not a number", spec, colon + 1);
    if (!(f > 1))
        return mt_fail(err, errlen, "--rope-scaling %s: factor %g must be above 1 (the new length over the original)",
                       spec, f);
    *type = t;
    *factor = f;
    return 0;
}

int mt_config_set_rope_scaling(mt_model_config *cfg, const char *spec, char *err, size_t errlen)
{
    mt_rope_type type;
    double factor;
    if (mt_rope_scaling_parse(spec, &type, &factor, err, errlen)) return -1;
    mt_model_config c = *cfg;
    if (c.rope_type == MT_ROPE_DEFAULT) {
        c.rope_type = type;
        if (type == MT_ROPE_YARN) {
            /* transformers' defaults for the keys a user does not give (_compute_yarn_parameters) */
            c.rope_original_max_positions = c.max_positions;
            c.rope_beta_fast = 32;
            c.rope_beta_slow = 1;
            c.rope_mscale = c.rope_mscale_all_dim = c.rope_attention_factor = 0;
            c.rope_truncate = true;
        }
    } else if (c.rope_type != type || type == MT_ROPE_LLAMA3) {
        return c.rope_type == MT_ROPE_LLAMA3
                   ? mt_fail(err, errlen, "--rope-scaling %s: the model's rope is already llama3-scaled (factor %g), "
                             "which --rope-scaling does not change", spec, c.rope_scaling_factor)
                   : mt_fail(err, errlen, "--rope-scaling %s: the model's rope is already %s-scaled (factor %g); "
                             "--rope-scaling can change its factor (%s:F), not its type", spec,
                             rope_type_name(c.rope_type), c.rope_scaling_factor, rope_type_name(c.rope_type));
    }
    c.rope_scaling_factor = factor;
    const double longest = factor * (double)rope_original_length(&c);
    if (!(longest <= (double)MAX_SIZE))
        return mt_fail(err, errlen, "--rope-scaling %s: factor %g x %lld positions is absurdly large (limit %lld)", spec,
                       factor, (long long)rope_original_length(&c), (long long)MAX_SIZE);
    char name[128];
    snprintf(name, sizeof name, "--rope-scaling %s", spec);
    if (validate_rope_scaling(&c, name, err, errlen)) return -1;
    *cfg = c;
    return 0;
}

/* A published Qwen2.5 shape: the values of its HF config.json (docs/design.md, section 4). */
static void qwen25(mt_model_config *c, int64_t d, int64_t I, int64_t L, int64_t H, int64_t KV, int64_t V,
                   bool tied)
{
    memset(c, 0, sizeof *c);
    c->family = MT_FAMILY_QWEN2;
    snprintf(c->model_type, sizeof c->model_type, "qwen2");
    c->hidden = d;
    c->intermediate = I;
    c->layers = L;
    c->heads = H;
    c->kv_heads = KV;
    c->head_dim = d / H;
    c->vocab = V;
    c->max_positions = 32768;
    c->rope_theta = 1e6;
    c->rms_eps = 1e-6;
    c->tied = tied;
    c->qkv_bias = true;
}

int mt_config_from_shape(const char *shape_name, mt_model_config *cfg)
{
    if (!shape_name) return -1;
    if (strcmp(shape_name, "qwen2.5-0.5b") == 0) qwen25(cfg, 896, 4864, 24, 14, 2, 151936, true);
    else if (strcmp(shape_name, "qwen2.5-1.5b") == 0) qwen25(cfg, 1536, 8960, 28, 12, 2, 151936, true);
    else if (strcmp(shape_name, "qwen2.5-3b") == 0) qwen25(cfg, 2048, 11008, 36, 16, 2, 151936, true);
    else if (strcmp(shape_name, "qwen2.5-7b") == 0) qwen25(cfg, 3584, 18944, 28, 28, 4, 152064, false);
    else if (strcmp(shape_name, "qwen2.5-14b") == 0) qwen25(cfg, 5120, 13824, 48, 40, 8, 152064, false);
    else if (strcmp(shape_name, "tiny") == 0) {
        /* models/configs/tiny-byte.json: a byte-level model for tests and smoke runs. */
        qwen25(cfg, 192, 512, 6, 6, 2, 256, true);
        cfg->head_dim = 32;
        cfg->max_positions = 256;
        cfg->rope_theta = 10000.0;
    } else
        return -1;
    return 0;
}
