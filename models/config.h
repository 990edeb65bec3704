/* The model description: a Llama/Qwen2-family decoder, dense or with mixture-of-experts MLPs, read
 * from a HF-style config.json.
 * Describes only; nothing here allocates tensors or computes. */
#ifndef MT_MODELS_CONFIG_H
#define MT_MODELS_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum mt_family {
    MT_FAMILY_LLAMA,   /* "llama"   */
    MT_FAMILY_QWEN2,   /* "qwen2"   (q/k/v bias) */
    MT_FAMILY_QWEN3,   /* "qwen3"   (q/k RMSNorm over head_dim) */
    MT_FAMILY_MISTRAL, /* "mistral" */
    MT_FAMILY_QWEN3_MOE, /* "qwen3_moe" (Qwen3 attention, mixture-of-experts MLPs) */
    MT_FAMILY_MIXTRAL,   /* "mixtral"   (Mistral attention, mixture-of-experts MLPs) */
} mt_family;

/* The most experts a mixture-of-experts layer may have: a layer tile describes every expert's
 * three matrices (models/layout.h), and published models use at most 128. */
#define MT_MAX_EXPERTS 256
/* The most entries of qwen3_moe's mlp_only_layers (published models list none). */
#define MT_MAX_MLP_ONLY_LAYERS 256

/* Whether the router's auxiliary load-balancing loss is in the objective: as the config's
 * output_router_logits says, or forced by a run option. */
typedef enum mt_router_aux_mode {
    MT_ROUTER_AUX_FROM_CONFIG = 0,
    MT_ROUTER_AUX_ON,
    MT_ROUTER_AUX_OFF,
} mt_router_aux_mode;

typedef struct mt_model_config {
    mt_family family;
    char model_type[32];     /* the config's "model_type" string */
    int64_t hidden;          /* d: hidden_size */
    int64_t intermediate;    /* I: intermediate_size */
    int64_t layers;          /* L: num_hidden_layers */
    int64_t heads;           /* H: num_attention_heads */
    int64_t kv_heads;        /* KV: num_key_value_heads (defaults to heads) */
    int64_t head_dim;        /* D: head_dim (defaults to hidden / heads) */
    int64_t vocab;           /* V: vocab_size */
    int64_t max_positions;   /* max_position_embeddings */
    double rope_theta;       /* rotary base, HF half-split convention */
    double rms_eps;          /* rms_norm_eps */
    bool tied;               /* tie_word_embeddings: LM head reuses the embedding table */
    bool qkv_bias;           /* q/k/v projections carry a bias (Qwen2) */
    bool qk_norm;            /* per-head RMSNorm of q and k before RoPE (Qwen3) */
    /* Llama-3 rope scaling ("rope_scaling": {"rope_type": "llama3", ...}); factor 0 = none. */
    double rope_scaling_factor;
    double rope_low_freq_factor;
    double rope_high_freq_factor;
    int64_t rope_original_max_positions;
    /* Mistral's sliding_window (0: none, the key null). Attention here is full causal, which is
     * the same up to that many tokens, so longer sequences are refused (runtime/step/graph.c). */
    int64_t sliding_window;

    /* Mixture of experts (qwen3_moe, mixtral; docs/moe.md). experts == 0: every layer dense. A
     * sparse layer routes each token to experts_per_token of its experts (softmax over all of
     * them, top k, renormalised when norm_topk_prob), each a SwiGLU MLP of width
     * expert_intermediate; a dense layer of the same model is the usual MLP of width
     * intermediate. mt_config_layer_is_sparse says which layer is which. */
    int64_t experts;             /* E: num_experts (qwen3_moe), num_local_experts (mixtral) */
    int64_t experts_per_token;   /* k: num_experts_per_tok */
    int64_t expert_intermediate; /* moe_intermediate_size (qwen3_moe); intermediate_size (mixtral) */
    bool norm_topk_prob;         /* always true for mixtral */
    int64_t decoder_sparse_step; /* qwen3_moe: layer i is sparse when (i + 1) % step == 0; mixtral 1 */
    int64_t mlp_only_layers_count;                     /* qwen3_moe: dense layers named in the config */
    int32_t mlp_only_layers[MT_MAX_MLP_ONLY_LAYERS];   /* sorted, without repeats */
    double router_aux_loss_coef; /* weight of the load-balancing loss in the objective */
    bool output_router_logits;   /* the config's switch for that loss (saved as read) */
    mt_router_aux_mode router_aux; /* a run's override of output_router_logits; never saved */
} mt_model_config;

/* Reads and validates a config.json. Returns 0, or -1 with a message in err naming the file and
 * the offending key ("config.json: key 'num_attention_heads': 12 does not divide hidden_size 1000"). */
int mt_config_load(const char *path, mt_model_config *cfg, char *err, size_t errlen);

/* Same, from a JSON text; `name` is used in messages in place of a file path. */
int mt_config_parse(const char *json_text, const char *name, mt_model_config *cfg, char *err, size_t errlen);

/* Checks the invariants a loaded config must hold (positive sizes, heads dividing, ...).
 * Returns 0 or -1 with a message naming `name` and the key. */
int mt_config_validate(const mt_model_config *cfg, const char *name, char *err, size_t errlen);

/* Writes cfg as a HF config.json that transformers loads. Returns 0 or -1 with err set. */
int mt_config_save(const mt_model_config *cfg, const char *path, char *err, size_t errlen);

/* Parameter counts: every parameter, and the convention's N (all but the embedding table; the LM
 * head counts also when tied). For a mixture of experts, N counts the active parameters (the k
 * experts a token uses, not all of them): the FLOPs a token costs. */
int64_t mt_config_param_count(const mt_model_config *cfg);
int64_t mt_config_flops_params(const mt_model_config *cfg);

/* Mixture of experts: whether layer `layer` (0-based) is sparse (router and experts) rather than
 * a dense MLP, as transformers decides it (mlp_only_layers, then decoder_sparse_step). */
bool mt_config_layer_is_sparse(const mt_model_config *cfg, int64_t layer);
/* The number of sparse layers (0 for a dense model), and whether the model has dense ones. */
int64_t mt_config_sparse_layers(const mt_model_config *cfg);
bool mt_config_has_dense_layers(const mt_model_config *cfg);
/* Parameters one token uses: every parameter of mt_config_param_count except the experts it is
 * not routed to (attention, norms, routers, k experts per sparse layer, dense layers, the table
 * and the head). Equal to mt_config_param_count for a dense model. */
int64_t mt_config_active_param_count(const mt_model_config *cfg);
/* The coefficient of the router's load-balancing loss in the objective: router_aux_loss_coef
 * when the loss is on (output_router_logits, or the override router_aux), 0 when it is off or
 * the model has no sparse layer. The step reads this. */
double mt_config_router_aux_coef(const mt_model_config *cfg);

/* A named published shape ("qwen2.5-0.5b", "qwen2.5-3b", ... docs/design.md, section 4), or -1 if
 * unknown. */
int mt_config_from_shape(const char *shape_name, mt_model_config *cfg);

#endif
