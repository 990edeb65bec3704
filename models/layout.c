/* The tensor layout inside each kind of tile: names, HF shapes and aligned element offsets.
 * One layout serves every copy of a tile (bf16 weights, fp32 master, gradient, Adam m and v), so
 * a tensor sits at the same element offset in all of them. */
#include "models/layout.h"

#include <assert.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static int64_t round_up(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

/* Appends a slot at the next aligned offset, named by a printf format; `present` false keeps ndim
 * and shape (so callers can still print what the tensor would be) but gives it no elements and
 * no space. */
static void add(mt_tile_layout *t, int slot, int ndim, int64_t rows, int64_t cols, bool present, int64_t *cursor,
                const char *name_format, ...)
{
    mt_tensor_desc *d = &t->tensors[slot];
    va_list ap;
    va_start(ap, name_format);
    int len = vsnprintf(d->name, sizeof d->name, name_format, ap);
    va_end(ap);
    assert(len > 0 && len < (int)sizeof d->name);
    (void)len;
    d->ndim = ndim;
    d->shape[0] = rows;
    d->shape[1] = ndim == 2 ? cols : 0;
    d->numel = present ? (ndim == 2 ? rows * cols : rows) : 0;
    d->offset = *cursor;
    /* Weight decay applies to matrices only, as HF Trainer does (not norms, not biases). */
    d->decay = ndim == 2;
    *cursor = round_up(*cursor + d->numel, MT_TILE_ALIGN);
}

int mt_layout_expert_slot(int expert, int which)
{
    return MT_L_EXPERT_BASE + MT_X_COUNT * expert + which;
}

/* A decoder layer, dense or sparse. The sparse MLP's slots come after the dense ones (absent
 * there), so offsets still grow with the slot index, which the AdamW chunking relies on. */
static void build_layer(const mt_model_config *cfg, bool sparse, mt_tile_layout *out)
{
    int64_t d = cfg->hidden, D = cfg->head_dim, I = cfg->intermediate;
    int64_t q = cfg->heads * D, kv = cfg->kv_heads * D;
    int64_t at = 0;
    out->ntensors = MT_L_COUNT;
    /* HF state_dict order of a decoder layer. */
    add(out, MT_L_ATTN_NORM, 1, d, 0, true, &at, "input_layernorm.weight");
    add(out, MT_L_Q_W, 2, q, d, true, &at, "self_attn.q_proj.weight");
    add(out, MT_L_Q_B, 1, q, 0, cfg->qkv_bias, &at, "self_attn.q_proj.bias");
    add(out, MT_L_K_W, 2, kv, d, true, &at, "self_attn.k_proj.weight");
    add(out, MT_L_K_B, 1, kv, 0, cfg->qkv_bias, &at, "self_attn.k_proj.bias");
    add(out, MT_L_V_W, 2, kv, d, true, &at, "self_attn.v_proj.weight");
    add(out, MT_L_V_B, 1, kv, 0, cfg->qkv_bias, &at, "self_attn.v_proj.bias");
    add(out, MT_L_O_W, 2, d, q, true, &at, "self_attn.o_proj.weight");
    add(out, MT_L_O_B, 1, d, 0, cfg->o_bias, &at, "self_attn.o_proj.bias");
    add(out, MT_L_SINKS, 1, cfg->heads, 0, cfg->attn_sinks, &at, "self_attn.sinks");
    out->tensors[MT_L_SINKS].decay = cfg->attn_sinks; /* a parameter HF Trainer decays: neither bias nor norm */
    add(out, MT_L_Q_NORM, 1, D, 0, cfg->qk_norm, &at, "self_attn.q_norm.weight");
    add(out, MT_L_K_NORM, 1, D, 0, cfg->qk_norm, &at, "self_attn.k_norm.weight");
    add(out, MT_L_MLP_NORM, 1, d, 0, true, &at, "post_attention_layernorm.weight");
    add(out, MT_L_GATE_W, 2, I, d, !sparse, &at, "mlp.gate_proj.weight");
    add(out, MT_L_UP_W, 2, I, d, !sparse, &at, "mlp.up_proj.weight");
    add(out, MT_L_DOWN_W, 2, d, I, !sparse, &at, "mlp.down_proj.weight");
    out->numel = at;
    if (!sparse) return;

    const bool mixtral = cfg->family == MT_FAMILY_MIXTRAL, gpt_oss = cfg->family == MT_FAMILY_GPT_OSS;
    const char *block = mixtral ? "block_sparse_moe" : "mlp";
    /* Mixtral's w1 is the gate, w3 the up and w2 the down projection: in the slot order of the
     * others, not its own w1, w2, w3. */
    const char *const names[MT_X_COUNT] = { mixtral ? "w1" : "gate_proj", mixtral ? "w3" : "up_proj",
                                            mixtral ? "w2" : "down_proj" };
    const int64_t E = cfg->experts, Ie = cfg->expert_intermediate;
    assert(E > 0 && E <= MT_MAX_EXPERTS);
    add(out, MT_L_ROUTER_W, 2, E, d, true, &at, gpt_oss ? "%s.router.weight" : "%s.gate.weight", block);
    add(out, MT_L_ROUTER_B, 1, E, 0, cfg->router_bias, &at, "%s.router.bias", block);
    add(out, MT_L_EXPERT_GU_B, 2, E, 2 * Ie, cfg->expert_bias, &at, "%s.experts.gate_up_proj_bias", block);
    add(out, MT_L_EXPERT_DOWN_B, 2, E, d, cfg->expert_bias, &at, "%s.experts.down_proj_bias", block);
    out->tensors[MT_L_EXPERT_GU_B].decay = out->tensors[MT_L_EXPERT_DOWN_B].decay = false; /* biases */
    for (int e = 0; e < E; e++) {
        add(out, mt_layout_expert_slot(e, MT_X_GATE), 2, Ie, d, true, &at, "%s.experts.%d.%s.weight", block, e,
            names[MT_X_GATE]);
        add(out, mt_layout_expert_slot(e, MT_X_UP), 2, Ie, d, true, &at, "%s.experts.%d.%s.weight", block, e,
            names[MT_X_UP]);
        add(out, mt_layout_expert_slot(e, MT_X_DOWN), 2, d, Ie, true, &at, "%s.experts.%d.%s.weight", block, e,
            names[MT_X_DOWN]);
    }
    out->ntensors = mt_layout_expert_slot((int)E, 0);
    out->numel = at;
}

void mt_layout_build(const mt_model_config *cfg, mt_tile_kind kind, mt_tile_layout *out)
{
    memset(out, 0, sizeof *out);
    out->kind = kind;
    int64_t d = cfg->hidden, V = cfg->vocab;
    int64_t at = 0;
    switch (kind) {
    case MT_TILE_EMBED:
        out->ntensors = MT_E_COUNT;
        add(out, MT_E_EMBED, 2, V, d, true, &at, "embed_tokens.weight");
        break;
    case MT_TILE_LAYER:
        build_layer(cfg, mt_config_sparse_layers(cfg) > 0, out);
        return;
    case MT_TILE_HEAD:
        out->ntensors = MT_H_COUNT;
        add(out, MT_H_NORM, 1, d, 0, true, &at, "norm.weight");
        /* Tied: the LM head is the embedding table, which lives in the embedding tile. */
        add(out, MT_H_LM_HEAD, 2, V, d, !cfg->tied, &at, "lm_head.weight");
        break;
    }
    out->numel = at;
}

static void layer_layout(const mt_model_config *cfg, bool sparse, mt_tile_layout *out)
{
    memset(out, 0, sizeof *out);
    out->kind = MT_TILE_LAYER;
    build_layer(cfg, sparse, out);
}

void mt_layout_build_layer(const mt_model_config *cfg, int64_t layer, mt_tile_layout *out)
{
    layer_layout(cfg, mt_config_layer_is_sparse(cfg, layer), out);
}

bool mt_layout_build_dense_layer(const mt_model_config *cfg, mt_tile_layout *out)
{
    if (mt_config_sparse_layers(cfg) == 0 || !mt_config_has_dense_layers(cfg)) return false;
    layer_layout(cfg, false, out);
    return true;
}

int64_t mt_layout_largest_layer_numel(const mt_model_config *cfg)
{
    mt_tile_layout lay, dense;
    mt_layout_build(cfg, MT_TILE_LAYER, &lay);
    return mt_layout_build_dense_layer(cfg, &dense) && dense.numel > lay.numel ? dense.numel : lay.numel;
}

bool mt_layout_is_sparse(const mt_tile_layout *layout)
{
    return layout->kind == MT_TILE_LAYER && layout->ntensors > MT_L_ROUTER_W &&
           layout->tensors[MT_L_ROUTER_W].numel > 0;
}

int64_t mt_layout_expert_stride(const mt_tile_layout *layout)
{
    if (!mt_layout_is_sparse(layout) || layout->ntensors <= mt_layout_expert_slot(1, 0)) return 0;
    return layout->tensors[mt_layout_expert_slot(1, 0)].offset - layout->tensors[mt_layout_expert_slot(0, 0)].offset;
}

bool mt_layout_is_norm(const mt_tile_layout *layout, int slot)
{
    if (slot < 0 || slot >= layout->ntensors || layout->tensors[slot].numel == 0) return false;
    if (layout->kind == MT_TILE_HEAD) return slot == MT_H_NORM;
    return layout->kind == MT_TILE_LAYER &&
           (slot == MT_L_ATTN_NORM || slot == MT_L_Q_NORM || slot == MT_L_K_NORM || slot == MT_L_MLP_NORM);
}

/* The side's first float: past the bf16 elements, on a 256-byte boundary. */
static int64_t side_base(const mt_tile_layout *layout) { return round_up(layout->numel * 2, 256) / 4; }

size_t mt_layout_keep_norms_f32(mt_tile_layout *layout)
{
    int64_t at = side_base(layout);
    layout->f32_numel = 0;
    for (int k = 0; k < layout->ntensors; k++) {
        mt_tensor_desc *d = &layout->tensors[k];
        d->f32_at = 0;
        if (!mt_layout_is_norm(layout, k)) continue;
        d->f32_at = at;
        const int64_t span = round_up(d->numel, MT_TILE_ALIGN); /* up to the next tensor's start */
        at += span;
        layout->f32_numel += span;
    }
    return mt_layout_stream_bytes(layout, 2);
}

size_t mt_layout_stream_bytes(const mt_tile_layout *layout, size_t esz)
{
    if (layout->f32_numel == 0) return (size_t)layout->numel * esz;
    return (size_t)(side_base(layout) + layout->f32_numel) * sizeof(float);
}

void mt_layout_full_name(const mt_tile_layout *layout, int layer, int slot, char *buf, size_t len)
{
    const char *name = (slot >= 0 && slot < layout->ntensors) ? layout->tensors[slot].name : NULL;
    if (!name || !name[0]) {
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
