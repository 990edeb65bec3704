/* The tensor layout inside each kind of tile: names, HF shapes and aligned element offsets.
 * One layout serves every copy of a tile (bf16 weights, fp32 master, gradient, Adam m and v), so
 * a tensor sits at the same element offset in all of them. */
#include "models/layout.h"

#include <stdio.h>
#include <string.h>

static int64_t round_up(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

/* Appends a slot at the next aligned offset; `present` false keeps ndim and shape (so callers can
 * still print what the tensor would be) but gives it no elements and no space. */
static void add(mt_tile_layout *t, int slot, const char *name, int ndim, int64_t rows, int64_t cols,
                bool present, int64_t *cursor)
{
    mt_tensor_desc *d = &t->tensors[slot];
    d->name = name;
    d->ndim = ndim;
    d->shape[0] = rows;
    d->shape[1] = ndim == 2 ? cols : 0;
    d->numel = present ? (ndim == 2 ? rows * cols : rows) : 0;
    d->offset = *cursor;
    /* Weight decay applies to matrices only, as HF Trainer does (not norms, not biases). */
    d->decay = ndim == 2;
    *cursor = round_up(*cursor + d->numel, MT_TILE_ALIGN);
}

void mt_layout_build(const mt_model_config *cfg, mt_tile_kind kind, mt_tile_layout *out)
{
    memset(out, 0, sizeof *out);
    out->kind = kind;
    int64_t d = cfg->hidden, D = cfg->head_dim, I = cfg->intermediate, V = cfg->vocab;
    int64_t q = cfg->heads * D, kv = cfg->kv_heads * D;
    int64_t at = 0;
    switch (kind) {
    case MT_TILE_EMBED:
        out->ntensors = MT_E_COUNT;
        add(out, MT_E_EMBED, "embed_tokens.weight", 2, V, d, true, &at);
        break;
    case MT_TILE_LAYER:
        out->ntensors = MT_L_COUNT;
        /* HF state_dict order of a decoder layer. */
        add(out, MT_L_ATTN_NORM, "input_layernorm.weight", 1, d, 0, true, &at);
        add(out, MT_L_Q_W, "self_attn.q_proj.weight", 2, q, d, true, &at);
        add(out, MT_L_Q_B, "self_attn.q_proj.bias", 1, q, 0, cfg->qkv_bias, &at);
        add(out, MT_L_K_W, "self_attn.k_proj.weight", 2, kv, d, true, &at);
        add(out, MT_L_K_B, "self_attn.k_proj.bias", 1, kv, 0, cfg->qkv_bias, &at);
        add(out, MT_L_V_W, "self_attn.v_proj.weight", 2, kv, d, true, &at);
        add(out, MT_L_V_B, "self_attn.v_proj.bias", 1, kv, 0, cfg->qkv_bias, &at);
        add(out, MT_L_O_W, "self_attn.o_proj.weight", 2, d, q, true, &at);
        add(out, MT_L_Q_NORM, "self_attn.q_norm.weight", 1, D, 0, cfg->qk_norm, &at);
        add(out, MT_L_K_NORM, "self_attn.k_norm.weight", 1, D, 0, cfg->qk_norm, &at);
        add(out, MT_L_MLP_NORM, "post_attention_layernorm.weight", 1, d, 0, true, &at);
        add(out, MT_L_GATE_W, "mlp.gate_proj.weight", 2, I, d, true, &at);
        add(out, MT_L_UP_W, "mlp.up_proj.weight", 2, I, d, true, &at);
        add(out, MT_L_DOWN_W, "mlp.down_proj.weight", 2, d, I, true, &at);
        break;
    case MT_TILE_HEAD:
        out->ntensors = MT_H_COUNT;
        add(out, MT_H_NORM, "norm.weight", 1, d, 0, true, &at);
        /* Tied: the LM head is the embedding table, which lives in the embedding tile. */
        add(out, MT_H_LM_HEAD, "lm_head.weight", 2, V, d, !cfg->tied, &at);
        break;
    }
    out->numel = at;
}

void mt_layout_full_name(const mt_tile_layout *layout, int layer, int slot, char *buf, size_t len)
{
    const char *name = (slot >= 0 && slot < layout->ntensors) ? layout->tensors[slot].name : NULL;
    if (!name) {
        snprintf(buf, len, "?");
        return;
    }
    switch (layout->kind) {
    case MT_TILE_LAYER: snprintf(buf, len, "model.layers.%d.%s", layer, name); break;
    case MT_TILE_EMBED: snprintf(buf, len, "model.%s", name); break;
    case MT_TILE_HEAD:
        /* The final norm belongs to the base model; the LM head sits beside it. */
        if (slot == MT_H_NORM) snprintf(buf, len, "model.%s", name);
        else snprintf(buf, len, "%s", name);
        break;
    }
}
