/* Where each parameter lives inside a layer tile. A model's state is a list of tiles: the
 * embedding, the L decoder layers, and the head (final norm + untied LM head). Inside a tile,
 * tensors follow HF order, each starting on a MT_TILE_ALIGN-element boundary, so the same
 * element offsets serve the bf16, fp32 master, gradient and Adam copies of the tile. */
#ifndef MT_MODELS_LAYOUT_H
#define MT_MODELS_LAYOUT_H

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
    MT_L_Q_NORM,      /* self_attn.q_norm.weight           (D)       */
    MT_L_K_NORM,      /* self_attn.k_norm.weight           (D)       */
    MT_L_MLP_NORM,    /* post_attention_layernorm.weight   (d)       */
    MT_L_GATE_W,      /* mlp.gate_proj.weight              (I, d)    */
    MT_L_UP_W,        /* mlp.up_proj.weight                (I, d)    */
    MT_L_DOWN_W,      /* mlp.down_proj.weight              (d, I)    */
    MT_L_COUNT
};
enum { MT_E_EMBED, MT_E_COUNT };                    /* model.embed_tokens.weight (V, d) */
enum { MT_H_NORM, MT_H_LM_HEAD, MT_H_COUNT };       /* model.norm.weight (d), lm_head.weight (V, d) */

#define MT_MAX_TILE_TENSORS MT_L_COUNT

typedef struct mt_tensor_desc {
    const char *name;   /* HF name relative to its owner, e.g. "self_attn.q_proj.weight" */
    int ndim;           /* 1 or 2 */
    int64_t shape[2];   /* HF shape: (out, in) for linear weights */
    int64_t offset;     /* in elements from the tile start, MT_TILE_ALIGN-aligned */
    int64_t numel;      /* 0 when the tensor is absent in this family/config */
    bool decay;         /* weight decay applies (matrices only, not norms or biases) */
} mt_tensor_desc;

typedef struct mt_tile_layout {
    mt_tile_kind kind;
    int ntensors;                                /* slots, including absent ones */
    mt_tensor_desc tensors[MT_MAX_TILE_TENSORS];
    int64_t numel;                               /* tile size in elements, padding included */
} mt_tile_layout;

/* Fills the layout of one kind of tile for this config. */
void mt_layout_build(const mt_model_config *cfg, mt_tile_kind kind, mt_tile_layout *out);

/* HF full name of tensor `slot` of a tile ("model.layers.3.mlp.up_proj.weight"). */
void mt_layout_full_name(const mt_tile_layout *layout, int layer, int slot, char *buf, size_t len);

#endif
