/* Checks a config against what transformers can build and what this runtime implements, and
 * bounds every size and parameter count so that the layouts and the plan built from it cannot
 * overflow (the numbers come from a file). Also the mixture-of-experts fields each family has. */
#include "models/config.h"

#include <math.h>

#include "models/config/internal.h"
#include "models/layout.h"
#include "models/report.h"

/* The largest parameter count accepted: the plan multiplies it by at most 20 bytes per
 * parameter plus alignment, which must still fit in int64. */
#define MAX_PARAMS ((int64_t)1 << 56)

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

bool mt_cfg_is_moe_family(mt_family f)
{
    return f == MT_FAMILY_QWEN3_MOE || f == MT_FAMILY_MIXTRAL || f == MT_FAMILY_GPT_OSS;
}

const char *mt_cfg_expert_count_key(const mt_model_config *cfg)
{
    return cfg->family == MT_FAMILY_QWEN3_MOE ? "num_experts" : "num_local_experts";
}

/* The mixture-of-experts fields: only the MoE families have them, and what each can express in
 * transformers (Mixtral: every layer sparse, top k always renormalised). */
static int validate_experts(const mt_model_config *cfg, const char *name, char *err, size_t errlen)
{
    if (!mt_cfg_is_moe_family(cfg->family)) {
        if (cfg->experts != 0 || cfg->mlp_only_layers_count != 0)
            return mt_fail(err, errlen, "%s: key 'model_type': %s has no experts (a mixture of experts is qwen3_moe or "
                           "mixtral)", name, cfg->model_type);
        return 0;
    }
    const char *count_key = mt_cfg_expert_count_key(cfg);
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
    if (cfg->family == MT_FAMILY_GPT_OSS) {
        if (cfg->experts == 0)
            return mt_fail(err, errlen, "%s: key 'num_local_experts': must be a positive integer, got 0", name);
        if (!cfg->norm_topk_prob || cfg->decoder_sparse_step != 1 || cfg->mlp_only_layers_count != 0 ||
            cfg->expert_intermediate != cfg->intermediate || !cfg->router_bias || !cfg->expert_bias)
            return mt_fail(err, errlen, "%s: key 'model_type': gpt_oss has biased experts of intermediate_size "
                           "in every layer, a biased router and a softmax over its top k", name);
        if (!(cfg->swiglu_limit > 0) || !isfinite(cfg->swiglu_limit))
            return mt_fail(err, errlen, "%s: key 'swiglu_limit': must be a positive number, got %g", name,
                           cfg->swiglu_limit);
        if (!(cfg->swiglu_alpha > 0) || !isfinite(cfg->swiglu_alpha))
            return mt_fail(err, errlen, "%s: key 'swiglu_alpha': must be a positive number, got %g", name,
                           cfg->swiglu_alpha);
    } else if (cfg->router_bias || cfg->expert_bias || cfg->swiglu_limit != 0 || cfg->swiglu_alpha != 0) {
        return mt_fail(err, errlen, "%s: key 'model_type': %s has no router or expert biases and a plain SwiGLU",
                       name, cfg->model_type);
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

    if (mt_cfg_validate_rope_scaling(cfg, name, err, errlen)) return -1;

    /* What transformers builds for each family: refuse combinations it cannot express, so that a
     * saved config loads back into the same model there. */
    switch (cfg->family) {
    case MT_FAMILY_QWEN2:
        if (!cfg->qkv_bias || cfg->qk_norm || cfg->o_bias || cfg->attn_sinks || cfg->layer_types_count != 0)
            return mt_fail(err, errlen, "%s: key 'model_type': qwen2 always has q/k/v biases, and no o_proj bias, "
                           "q/k norm, attention sinks or layer_types", name);
        break;
    case MT_FAMILY_GPT_OSS:
        /* attention_bias gives q, k, v and o_proj their biases; every head a sink; no q/k norm */
        if (cfg->qkv_bias != cfg->o_bias || !cfg->attn_sinks || cfg->qk_norm)
            return mt_fail(err, errlen, "%s: key 'model_type': gpt_oss has biases on all four attention projections "
                           "or on none, attention sinks and no q/k norm", name);
        if (cfg->sliding_window < 0)
            return mt_fail(err, errlen, "%s: key 'sliding_window': must be positive or null, got %lld", name,
                           (long long)cfg->sliding_window);
        if (cfg->layer_types_count != 0 && cfg->layer_types_count != cfg->layers)
            return mt_fail(err, errlen, "%s: key 'layer_types': %lld entries for num_hidden_layers %lld (one per "
                           "layer)", name, (long long)cfg->layer_types_count, (long long)cfg->layers);
        break;
    case MT_FAMILY_QWEN3:
    case MT_FAMILY_QWEN3_MOE:
        if (!cfg->qk_norm)
            return mt_fail(err, errlen, "%s: key 'model_type': %s always has q/k norms", name, cfg->model_type);
        /* fall through */
    case MT_FAMILY_MISTRAL:
    case MT_FAMILY_MIXTRAL:
    case MT_FAMILY_LLAMA:
        /* transformers' Llama and Qwen3 attention give attention_bias to o_proj as well as q, k
         * and v; the layer has both kinds of bias (gpt_oss's), but these families' biased form
         * has no parity check against transformers, so it is refused rather than trained */
        if (cfg->qkv_bias)
            return mt_fail(err, errlen, "%s: key 'attention_bias': true gives %s biases on q, k, v and o_proj in "
                        "transformers; megatrain trains attention biases of qwen2 (q, k, v) and gpt_oss (all four) "
                        "only", name, cfg->model_type);
        if (cfg->o_bias || cfg->attn_sinks || cfg->layer_types_count != 0)
            return mt_fail(err, errlen, "%s: key 'model_type': %s has no o_proj bias, attention sinks or "
                           "layer_types", name, cfg->model_type);
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
    const int64_t factors[][2] = {{d, 1}, {q, d}, {q, 1}, {kv, d}, {kv, 1}, {kv, d}, {kv, 1}, {d, q}, {d, 1},
                                  {cfg->heads, 1}, {D, 1}, {D, 1}, {d, 1}, {I, d}, {I, d}, {d, I}};
    int64_t layer = 0, part;
    for (size_t i = 0; i < sizeof factors / sizeof factors[0]; i++)
        if (!size_product(factors[i][0], factors[i][1], &part) || !size_sum(layer, round_up(part, MT_TILE_ALIGN), &layer))
            return mt_fail(err, errlen, "%s: key 'hidden_size': a layer with hidden_size %lld and intermediate_size %lld "
                        "is absurdly large", name, (long long)d, (long long)I);
    /* A sparse layer holds its router and every expert besides (bounding the larger of the two
     * kinds of layer by their sum is enough here). */
    if (cfg->experts > 0) {
        int64_t router, expert, experts, biases;
        if (!size_product(cfg->experts, d, &router) || !size_sum(layer, round_up(router, MT_TILE_ALIGN), &layer) ||
            !size_product(cfg->expert_intermediate, d, &expert) ||
            !size_product(round_up(expert, MT_TILE_ALIGN), 3 * cfg->experts, &experts) ||
            !size_sum(layer, experts, &layer) ||
            !size_product(cfg->experts, 2 * cfg->expert_intermediate + d + 1, &biases) ||
            !size_sum(layer, round_up(biases, MT_TILE_ALIGN) + 3 * MT_TILE_ALIGN, &layer))
            return mt_fail(err, errlen, "%s: key '%s': %lld experts of width %lld at hidden_size %lld make a layer "
                           "absurdly large", name, mt_cfg_expert_count_key(cfg), (long long)cfg->experts,
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

int mt_config_set_layers(mt_model_config *cfg, int64_t n, char *err, size_t errlen)
{
    if (n < 1) return mt_fail(err, errlen, "--layers: must be at least 1, got %lld", (long long)n);
    if (cfg->layer_types_count > 0 && n > cfg->layer_types_count)
        return mt_fail(err, errlen, "--layers %lld: the config's layer_types names %lld layers, and says nothing of the "
                       "others", (long long)n, (long long)cfg->layer_types_count);
    if (cfg->layer_types_count > 0) cfg->layer_types_count = n;
    int64_t kept = 0; /* mlp_only_layers is sorted */
    while (kept < cfg->mlp_only_layers_count && cfg->mlp_only_layers[kept] < n) kept++;
    cfg->mlp_only_layers_count = kept;
    cfg->layers = n;
    return 0;
}
