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
    MT_FAMILY_GPT_OSS,   /* "gpt_oss"   (attention with biases and sinks, alternating sliding-window and
                          * full layers; biased experts with a clamped SwiGLU). */
} mt_family;

/* The most experts a mixture-of-experts layer may have: a layer tile describes every expert's
 * three matrices (models/layout.h), and published models use at most 128. */
#define MT_MAX_EXPERTS 256
/* The most entries of qwen3_moe's mlp_only_layers (published models list none). */
#define MT_MAX_MLP_ONLY_LAYERS 256
/* mlp_chunk as "auto" (below). */
#define MT_MLP_CHUNK_AUTO (-1)

/* The most entries of gpt_oss's layer_types (published models have 24 and 36 layers). */
#define MT_MAX_LAYER_TYPES 1024

/* Whether the router's auxiliary load-balancing loss is in the objective: as the config's
 * output_router_logits says, or forced by a run option. */
typedef enum mt_router_aux_mode {
    MT_ROUTER_AUX_FROM_CONFIG = 0,
    MT_ROUTER_AUX_ON,
    MT_ROUTER_AUX_OFF,
} mt_router_aux_mode;

/* How the rotary frequencies stretch beyond the pretraining context: the "rope_type" of HF's
 * "rope_scaling" (transformers 5: "rope_parameters"), each as transformers' ROPE_INIT_FUNCTIONS
 * compute it (backends/cpu/rope_freq.c). */
typedef enum mt_rope_type {
    MT_ROPE_DEFAULT, /* none: theta^(-2j/D) */
    MT_ROPE_LINEAR,  /* positions / factor */
    MT_ROPE_DYNAMIC, /* NTK-aware: the base grows with the length run past max_position_embeddings */
    MT_ROPE_YARN,    /* a ramp between interpolated and extrapolated frequencies; cos, sin scaled */
    MT_ROPE_LLAMA3,  /* Llama 3.1: long wavelengths stretched, short ones kept, a band between */
} mt_rope_type;

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
    /* Rope scaling ("rope_scaling": {"rope_type": ..., "factor": ...}). rope_type DEFAULT has
     * factor 0 and no other field set; every other type has a factor. */
    mt_rope_type rope_type;
    double rope_scaling_factor;
    double rope_low_freq_factor;         /* llama3 */
    double rope_high_freq_factor;        /* llama3 */
    /* llama3, yarn: original_max_position_embeddings, the pretraining context (yarn: defaults to
     * max_position_embeddings, as transformers' standardize_rope_params). 0 for linear and
     * dynamic, whose factor multiplies max_position_embeddings itself. */
    int64_t rope_original_max_positions;
    double rope_beta_fast, rope_beta_slow;    /* yarn: the ramp's ends in rotations (32, 1) */
    double rope_mscale, rope_mscale_all_dim;  /* yarn: 0 when absent */
    double rope_attention_factor;             /* yarn: 0 = derived from factor (and the mscales) */
    bool rope_truncate;                       /* yarn: the ramp's ends rounded to whole dims (true) */
    /* Mistral's sliding_window (0: none, the key null). Attention here is full causal, which is
     * the same up to that many tokens, so longer sequences are refused (mt_config_check_seq_len). */
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
    /* Tokens the dense MLP computes at a time (a run's setting, never saved): 0 runs it over all
     * of a layer call's tokens and keeps its gate and up for the backward; N > 0 runs it N tokens
     * at a time and recomputes them there, so that its buffers do not grow with the length
     * (docs/long-context.md). The results are the same bits either way on CPU workers.
     * MT_MLP_CHUNK_AUTO: the run's memory plan picks (runtime/plan.h); the layer reads it as 0. */
    int64_t mlp_chunk;
    mt_router_aux_mode router_aux; /* a run's override of output_router_logits; never saved */
    double router_aux_coef_run;  /* with router_aux ON: the run's coefficient (--router-aux-loss); never
                                  * saved, so a saved config keeps router_aux_loss_coef as read */

    /* gpt_oss (GptOssConfig): attention_bias gives o_proj a bias as well as q, k and v; every
     * head has a sink logit; layer i attends over the last sliding_window keys where layer_types
     * says "sliding_attention" (transformers' default: the even layers); the router has a bias,
     * each expert's gate/up and down projections have biases, and the experts' SwiGLU is
     * clamped: gate at most limit, up within +-limit, out = (up + 1) gate sigmoid(alpha gate).
     * The top k's weights are the softmax over the k chosen logits, which is the softmax over all
     * experts renormalised over the k (norm_topk_prob). */
    bool o_bias;
    bool attn_sinks;
    int64_t layer_types_count;                 /* entries given (0: the default alternation) */
    uint8_t layer_sliding[MT_MAX_LAYER_TYPES]; /* 1: "sliding_attention", 0: "full_attention" */
    bool router_bias;
    bool expert_bias;
    double swiglu_alpha, swiglu_limit;         /* 0 for the other families (the plain SwiGLU) */
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
/* Whether decoder layer `layer` is a "sliding_attention" layer (gpt_oss's layer_types), and its
 * attention window: sliding_window for those layers, 0 (full causal attention) for every other
 * layer and family. */
bool mt_config_layer_sliding(const mt_model_config *cfg, int64_t layer);
int64_t mt_config_layer_window(const mt_model_config *cfg, int64_t layer);
/* Whether cfg's dense MLP runs in token chunks (mlp_chunk > 0; 0 and MT_MLP_CHUNK_AUTO are not),
 * and the rows it runs at a time over n tokens: mlp_chunk, or all n. Every sizing and every
 * layer of the CPU and CUDA backends reads the chunking through these. */
bool mt_config_mlp_chunked(const mt_model_config *cfg);
int64_t mt_config_mlp_rows(const mt_model_config *cfg, int64_t n);
/* The coefficient of the router's load-balancing loss in the objective: router_aux_loss_coef
 * when the loss is on (output_router_logits, or the override router_aux), 0 when it is off or
 * the model has no sparse layer. The step reads this. */
double mt_config_router_aux_coef(const mt_model_config *cfg);

/* The longest sequence cfg takes: max_position_embeddings; with rope scaling factor x the
 * original length (linear, dynamic: max_position_embeddings; yarn, llama3: the original
 * pretraining length), never less than max_position_embeddings; with Mistral's sliding window,
 * at most the window (attention here is full causal, the same up to it). */
int64_t mt_config_max_seq_len(const mt_model_config *cfg);

/* 0 when sequences of seq_len tokens are allowed for cfg, else -1 with a message naming the
 * length, the limit and, where scaling raises it, the --rope-scaling value that does. To be
 * called before anything is allocated. */
int mt_config_check_seq_len(const mt_model_config *cfg, int64_t seq_len, char *err, size_t errlen);

/* A --rope-scaling value, "TYPE:FACTOR": TYPE linear, dynamic or yarn, FACTOR a number above 1.
 * 0, or -1 with a message naming the value and the choices. */
int mt_rope_scaling_parse(const char *spec, mt_rope_type *type, double *factor, char *err, size_t errlen);

/* Keeps the first n decoder layers of the model (--layers; n may also exceed the config's count):
 * num_hidden_layers n, with the lists that name layers cut to them (gpt_oss's layer_types,
 * qwen3_moe's mlp_only_layers). More layers than a layer_types list names are refused: the list
 * says nothing of the others. 0, or -1 with err set and cfg unchanged. */
int mt_config_set_layers(mt_model_config *cfg, int64_t n, char *err, size_t errlen);

/* Applies a --rope-scaling value to cfg: a model without scaling gets TYPE with FACTOR, the
 * original length being its max_position_embeddings (which stays, as HF configs of extended
 * models keep it: Qwen2.5's yarn), so that sequences up to FACTOR times it are allowed and
 * mt_config_save writes the scaling; a model already scaled by TYPE gets the new FACTOR over
 * the same original length. Another type than the model's own, or a model scaled by llama3, is
 * refused. 0, or -1 with err set and cfg unchanged. */
int mt_config_set_rope_scaling(mt_model_config *cfg, const char *spec, char *err, size_t errlen);

/* A named published shape ("qwen2.5-0.5b", "qwen2.5-3b", ... docs/design.md, section 4), or -1 if
 * unknown. */
int mt_config_from_shape(const char *shape_name, mt_model_config *cfg);

#endif
