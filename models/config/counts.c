/* What a config's numbers imply: which layers are sparse, the parameter counts (total, active,
 * those a token's FLOPs follow, as HF's num_parameters() counts them) and the router's aux loss
 * coefficient. The config is valid (mt_config_validate), so no count overflows. */
#include "models/config.h"

#include <stdio.h>

bool mt_config_layer_is_sparse(const mt_model_config *cfg, int64_t layer)
{
    /* Qwen3MoeDecoderLayer: sparse unless listed in mlp_only_layers, when there are experts and
     * (layer + 1) is a multiple of decoder_sparse_step. */
    if (cfg->experts <= 0 || cfg->decoder_sparse_step <= 0) return false;
    for (int64_t i = 0; i < cfg->mlp_only_layers_count; i++)
        if (cfg->mlp_only_layers[i] == layer) return false;
    return (layer + 1) % cfg->decoder_sparse_step == 0;
}

/* In closed form, not a loop over the layers: a config may name billions of them before the
 * plan refuses it, and these counts are what the refusal is computed from. */
int64_t mt_config_sparse_layers(const mt_model_config *cfg)
{
    if (cfg->experts <= 0 || cfg->decoder_sparse_step <= 0) return 0;
    int64_t n = cfg->layers / cfg->decoder_sparse_step;
    /* the entries of mlp_only_layers are distinct (validated); each that would be sparse is not */
    for (int64_t i = 0; i < cfg->mlp_only_layers_count; i++) {
        const int64_t l = cfg->mlp_only_layers[i];
        n -= l >= 0 && l < cfg->layers && (l + 1) % cfg->decoder_sparse_step == 0;
    }
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
    if (cfg->o_bias) n += d;
    if (cfg->attn_sinks) n += cfg->heads;
    if (cfg->qk_norm) n += 2 * D;
    return n;
}

/* Every layer's attention block and MLP: gate, up, down of a dense layer; of a sparse one the
 * router and all experts, or (active) the router and the k experts one token uses. */
static int64_t layers_params(const mt_model_config *cfg, bool active)
{
    const int64_t d = cfg->hidden, sparse = mt_config_sparse_layers(cfg);
    const int64_t used = active ? cfg->experts_per_token : cfg->experts;
    const int64_t dense_mlp = 3 * cfg->intermediate * d;
    const int64_t Ie = cfg->expert_intermediate;
    const int64_t expert = 3 * Ie * d + (cfg->expert_bias ? 2 * Ie + d : 0);
    const int64_t router = cfg->experts * d + (cfg->router_bias ? cfg->experts : 0);
    const int64_t sparse_mlp = sparse ? router + used * expert : 0;
    return cfg->layers * attention_params(cfg) + (cfg->layers - sparse) * dense_mlp + sparse * sparse_mlp;
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

bool mt_config_layer_sliding(const mt_model_config *cfg, int64_t layer)
{
    if (cfg->family != MT_FAMILY_GPT_OSS || layer < 0) return false;
    /* GptOssConfig: layer_types as given, else "sliding_attention" where (i + 1) % 2 != 0 */
    return layer < cfg->layer_types_count ? cfg->layer_sliding[layer] != 0 : layer % 2 == 0;
}

int64_t mt_config_layer_window(const mt_model_config *cfg, int64_t layer)
{
    return mt_config_layer_sliding(cfg, layer) && cfg->sliding_window > 0 ? cfg->sliding_window : 0;
}

bool mt_config_mlp_chunked(const mt_model_config *cfg) { return cfg->mlp_chunk > 0; }

int64_t mt_config_mlp_rows(const mt_model_config *cfg, int64_t n)
{
    return mt_config_mlp_chunked(cfg) && cfg->mlp_chunk < n ? cfg->mlp_chunk : n;
}

double mt_config_router_aux_coef(const mt_model_config *cfg)
{
    const bool on = cfg->router_aux == MT_ROUTER_AUX_ON ||
                    (cfg->router_aux == MT_ROUTER_AUX_FROM_CONFIG && cfg->output_router_logits);
    if (!on || mt_config_sparse_layers(cfg) == 0) return 0.0;
    return cfg->router_aux == MT_ROUTER_AUX_ON && cfg->router_aux_coef_run > 0 ? cfg->router_aux_coef_run
                                                                                 : cfg->router_aux_loss_coef;
}
