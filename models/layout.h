/* Where each parameter lives inside a layer tile. A model's state is a list of tiles: the
 * embedding, the L decoder layers, and the head (final norm + untied LM head). Inside a tile,
 * tensors follow HF order, each starting on a MT_TILE_ALIGN-element boundary, so the same
 * element offsets serve the bf16, fp32 master, gradient and Adam copies of the tile. A sparse
 * (mixture-of-experts) layer's tile holds its router and every expert: the whole layer streams,
 * whichever experts its tokens use. */
#ifndef MT_MODELS_LAYOUT_H
#define MT_MODELS_LAYOUT_H

#include <stddef.h>

#include "models/config.h"

#define MT_TILE_ALIGN 64 /* elements; 128 B in bf16, 256 B in fp32 */

typedef enum mt_tile_kind { MT_TILE_EMBED, MT_TILE_LAYER, MT_TILE_HEAD } mt_tile_kind;

/* Tensor slots of a decoder layer tile; an absent tensor (no bias, no q/k norm) has numel 0. */
enum {
    MT_L_ATTN_NORM,   /* input_layernorm.weight            (d)       */
    MT_L_Q_W,         /* self_attn.q_proj.weight           (H*D, d)  */
    MT_L_Q_B,         /* self_attn.q_proj.bias             (H*D)     */
    MT_L_K_W,         /* self_attn.k_proj.weight           (KV*D, d) */
    MT_L_K_B,         /* self_attn.k_proj.bias             (KV*D)    */
    MT_L_V_W,         /* self_attn.v_proj.weight           (KV*D, d) */
    MT_L_V_B,         /* self_attn.v_proj.bias             (KV*D)    */
    MT_L_O_W,         /* self_attn.o_proj.weight           (d, H*D)  */
    MT_L_O_B,         /* self_attn.o_proj.bias             (d)       gpt_oss */
    MT_L_SINKS,       /* self_attn.sinks                   (H)       gpt_oss */
    MT_L_Q_NORM,      /* self_attn.q_norm.weight           (D)       */
    MT_L_K_NORM,      /* self_attn.k_norm.weight           (D)       */
    MT_L_MLP_NORM,    /* post_attention_layernorm.weight   (d)       */
    MT_L_GATE_W,      /* mlp.gate_proj.weight              (I, d)    */
    MT_L_UP_W,        /* mlp.up_proj.weight                (I, d)    */
    MT_L_DOWN_W,      /* mlp.down_proj.weight              (d, I)    */
    MT_L_COUNT,       /* the slots of a dense layer */
    /* A sparse layer: the dense MLP slots above are absent; then the router, and from
     * MT_L_EXPERT_BASE three slots per expert (mt_layout_expert_slot), under HF names:
     * qwen3_moe mlp.gate.weight, mlp.experts.{e}.gate_proj / up_proj / down_proj.weight;
     * mixtral   block_sparse_moe.gate.weight, block_sparse_moe.experts.{e}.w1 / w3 / w2.weight;
     * gpt_oss   mlp.router.weight and .bias, the experts' biases as HF holds them (gate and up
     *           interleaved: gate j at 2j, up j at 2j + 1), and the experts' matrices in the
     *           others' form, mlp.experts.{e}.gate_proj / up_proj / down_proj.weight (HF fuses
     *           them into mlp.experts.gate_up_proj (E, d, 2 Ie), interleaved, and down_proj (E, Ie, d)). */
    MT_L_ROUTER_W = MT_L_COUNT, /* router                       (E, d)    */
    MT_L_ROUTER_B,              /* router bias                  (E)       gpt_oss */
    MT_L_EXPERT_GU_B,           /* mlp.experts.gate_up_proj_bias (E, 2 Ie) gpt_oss */
    MT_L_EXPERT_DOWN_B,         /* mlp.experts.down_proj_bias   (E, d)    gpt_oss */
    MT_L_EXPERT_BASE
};
/* The three matrices of an expert, in slot order. */
enum {
    MT_X_GATE,        /* gate_proj / w1                    (Ie, d)   */
    MT_X_UP,          /* up_proj / w3                      (Ie, d)   */
    MT_X_DOWN,        /* down_proj / w2                    (d, Ie)   */
    MT_X_COUNT
};
enum { MT_E_EMBED, MT_E_COUNT };                    /* model.embed_tokens.weight (V, d) */
enum { MT_H_NORM, MT_H_LM_HEAD, MT_H_COUNT };       /* model.norm.weight (d), lm_head.weight (V, d) */

#define MT_MAX_TILE_TENSORS (MT_L_EXPERT_BASE + MT_X_COUNT * MT_MAX_EXPERTS)
#define MT_TENSOR_NAME_MAX 48 /* "block_sparse_moe.experts.255.w1.weight", "mlp.experts.255.gate_proj.weight"
                               * and their NUL fit */

typedef struct mt_tensor_desc {
    char name[MT_TENSOR_NAME_MAX]; /* HF name relative to its owner, e.g. "self_attn.q_proj.weight" */
    int ndim;           /* 1 or 2 */
    int64_t shape[2];   /* HF shape: (out, in) for linear weights */
    int64_t offset;     /* in elements from the tile start, MT_TILE_ALIGN-aligned */
    int64_t numel;      /* 0 when the tensor is absent in this family/config */
    bool decay;         /* weight decay applies (matrices only, not norms or biases) */
    int64_t f32_at;     /* a tile whose bf16 streamed copy keeps an fp32 side (mt_layout_keep_norms_f32):
                         * where this tensor's fp32 copy starts, in floats from the tile's start;
                         * 0 when the tensor has none */
} mt_tensor_desc;

typedef struct mt_tile_layout {
    mt_tile_kind kind;
    int ntensors;                                /* slots, including absent ones */
    mt_tensor_desc tensors[MT_MAX_TILE_TENSORS];
    int64_t numel;                               /* tile size in elements, padding included */
    int64_t f32_numel;                           /* floats of the fp32 side, 0 without one */
} mt_tile_layout;

/* Fills the layout of one kind of tile for this config. For MT_TILE_LAYER in a model with sparse
 * layers, the layout of a sparse layer (mt_layout_build_layer gives each layer its own). */
void mt_layout_build(const mt_model_config *cfg, mt_tile_kind kind, mt_tile_layout *out);

/* The layout of decoder layer `layer`: sparse or dense as mt_config_layer_is_sparse says. */
void mt_layout_build_layer(const mt_model_config *cfg, int64_t layer, mt_tile_layout *out);

/* A model that mixes dense and sparse layers: the layout of its dense layers into out, true;
 * any other model (one layout serves every layer: mt_layout_build's): false, out untouched. */
bool mt_layout_build_dense_layer(const mt_model_config *cfg, mt_tile_layout *out);

/* Elements of the largest decoder layer tile of the model: a model with dense and sparse layers
 * has two layer layouts, and buffers that hold any layer's tile are sized by the larger. */
int64_t mt_layout_largest_layer_numel(const mt_model_config *cfg);

/* Whether a layer layout is that of a sparse layer (a router and experts). */
bool mt_layout_is_sparse(const mt_tile_layout *layout);

/* The slot of matrix `which` (MT_X_*) of expert `expert` in a sparse layer's layout. The experts
 * follow one another at one stride: expert e's matrix starts at that of expert 0 plus
 * e * mt_layout_expert_stride, which a batched GEMM over the experts can use. */
int mt_layout_expert_slot(int expert, int which);
int64_t mt_layout_expert_stride(const mt_tile_layout *layout);

/* The bf16 streamed copy of a tile with an fp32 side: the RMSNorm weights (input, post-attention,
 * q/k and final norms) also as fp32, after the tile's bf16 elements, each over its tensor's whole
 * span (padding included, as its AdamW chunks cover it); what the norm kernels read (the bf16
 * elements of a norm are stale), and in the compact layout the norms' master. Mixed-precision
 * training as transformers' autocast does it computes the norms with fp32 weights; rounding these
 * few weights to bf16 costs more accuracy than all the matrices' rounding on some models
 * (docs/design.md, section 8). Sets the tensors' f32_at and the layout's f32_numel; returns the
 * bytes of the streamed copy (bf16 elements, then the side, 256-byte aligned). The embedding has
 * no norm and gets no side. */
size_t mt_layout_keep_norms_f32(mt_tile_layout *layout);
/* Bytes of a tile's streamed copy of elements of esz bytes, its fp32 side included. */
size_t mt_layout_stream_bytes(const mt_tile_layout *layout, size_t esz);
/* Whether tensor `slot` is an RMSNorm weight (what mt_layout_keep_norms_f32 keeps in fp32). */
bool mt_layout_is_norm(const mt_tile_layout *layout, int slot);
/* HF full name of tensor `slot` of a tile ("model.layers.3.mlp.up_proj.weight"). */
void mt_layout_full_name(const mt_tile_layout *layout, int layer, int slot, char *buf, size_t len);

#endif
