/* The model description: a Llama/Qwen2-family decoder read from a HF-style config.json.
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
} mt_family;

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
 * head counts also when tied). */
int64_t mt_config_param_count(const mt_model_config *cfg);
int64_t mt_config_flops_params(const mt_model_config *cfg);

/* A named published shape ("qwen2.5-0.5b", "qwen2.5-3b", ... docs/design.md, section 4), or -1 if
 * unknown. */
int mt_config_from_shape(const char *shape_name, mt_model_config *cfg);

#endif
