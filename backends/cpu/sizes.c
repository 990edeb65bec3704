/* How much memory the CPU decoder layer and head ask their callers for: the element counts of the
 * layer's `saved` and `scratch` buffers and of the head's per-chunk scratch. These sums mirror
 * the buffer plans at the top of layer.inc, moe.inc and head.inc; change them together. A model
 * with both dense and sparse layers gets the larger of the two kinds, so one size serves every
 * layer. */
#include "backends/cpu/ops.h"

#include <assert.h>

/* The routing of moe.inc: experts, order (n*k each), offsets (E+1), weights (n*k). */
static int64_t moe_routing_numel(const mt_model_config *cfg, int64_t n)
{
    return 3 * n * cfg->experts_per_token + cfg->experts + 1;
}

/* The routing; per expert X, o (n,d), s (n,Ie); without saving also g, u (n,Ie). */
int64_t mt_moe_forward_scratch_numel(const mt_model_config *cfg, int64_t n, bool saving)
{
    const int64_t Ie = cfg->expert_intermediate;
    return moe_routing_numel(cfg, n) + 2 * n * cfg->hidden + (saving ? 1 : 3) * n * Ie;
}

/* The routing, dweights (n*k), dlogits (n,E), w and dw (n); per expert X, dY, dX (n,d), s, dz,
 * du (n,Ie). */
int64_t mt_moe_backward_scratch_numel(const mt_model_config *cfg, int64_t n)
{
    const int64_t k = cfg->experts_per_token, E = cfg->experts, Ie = cfg->expert_intermediate;
    return moe_routing_numel(cfg, n) + n * k + n * E + 2 * n + 3 * n * cfg->hidden + 3 * n * Ie;
}

/* The kinds of layer the model has: dense, sparse, or both. */
static bool has_dense(const mt_model_config *cfg) { return mt_config_has_dense_layers(cfg); }
static bool has_sparse(const mt_model_config *cfg) { return mt_config_sparse_layers(cfg) > 0; }

/* The MLP's part of `saved`: g, u (n,I) of a dense layer (none with mlp_chunk: recomputed);
 * probs (n,E), g, u (n*k,Ie) of a sparse one. */
static int64_t mlp_saved_numel(const mt_model_config *cfg, int64_t n, bool sparse)
{
    if (!sparse) return mt_config_mlp_chunked(cfg) ? 0 : 2 * n * cfg->intermediate;
    return n * cfg->experts + 2 * n * cfg->experts_per_token * cfg->expert_intermediate;
}

/* Saved (see layer.inc): x (n,d), rms1 (n), q (n,H*D), k (n,KV*D), v (n,KV*D), a (n,H*D),
 * lse (B,H,T), h (n,d), rms2 (n), the MLP's part; with qk_norm also qpre (n,H*D), kpre (n,KV*D),
 * qrms (n*H), krms (n*KV). xn and hn are recomputed in backward, not kept. */
int64_t mt_layer_saved_numel(const mt_model_config *cfg, int64_t B, int64_t T)
{
    const int64_t n = B * T, d = cfg->hidden;
    const int64_t qd = cfg->heads * cfg->head_dim, kvd = cfg->kv_heads * cfg->head_dim;
    int64_t total = 2 * n * d + 2 * n + 2 * n * qd + 2 * n * kvd + n * cfg->heads;
    if (cfg->qk_norm) total += n * qd + n * kvd + n * cfg->heads + n * cfg->kv_heads;
    int64_t mlp = 0;
    if (has_dense(cfg)) mlp = mlp_saved_numel(cfg, n, false);
    if (has_sparse(cfg) && mlp_saved_numel(cfg, n, true) > mlp) mlp = mlp_saved_numel(cfg, n, true);
    return total + mlp;
}

/* The largest of the three plans of layer.inc, over the kinds of layer the model has: forward
 * keeping `saved` (xn/hn, then s (and g, u when chunked) or the MoE forward's scratch), forward
 * without `saved` (h, then the attention phase overlaid by the MLP phase), and backward (hn/xn,
 * dhn/dxn, then the MLP gradients overlaid by the attention gradients). The dense MLP's buffers
 * have c = mlp_chunk rows (all n without it). */
static int64_t layer_scratch_numel(const mt_model_config *cfg, int64_t B, int64_t T, bool sparse)
{
    const int64_t n = B * T, d = cfg->hidden, inter = cfg->intermediate;
    const int64_t qd = cfg->heads * cfg->head_dim, kvd = cfg->kv_heads * cfg->head_dim;
    const int64_t qk = cfg->qk_norm ? 1 : 0;
    const bool chunked = mt_config_mlp_chunked(cfg);
    const int64_t c = mt_config_mlp_rows(cfg, n);

    const int64_t fwd_saved = n * d + (sparse ? mt_moe_forward_scratch_numel(cfg, n, true)
                                              : (chunked ? 3 : 1) * c * inter);
    const int64_t attn_phase = n * d + 2 * n * qd + 2 * n * kvd + n * cfg->heads + qk * (n * qd + n * kvd);
    const int64_t mlp_phase = n * d + (sparse ? n * cfg->experts + mt_moe_forward_scratch_numel(cfg, n, false)
                                              : 3 * c * inter);
    const int64_t fwd_unsaved = n * d + (attn_phase > mlp_phase ? attn_phase : mlp_phase);
    const int64_t bwd_mlp = sparse ? mt_moe_backward_scratch_numel(cfg, n) : (chunked ? 5 : 3) * c * inter;
    const int64_t bwd_attn = 2 * n * qd + 2 * n * kvd + qk * n * kvd;
    const int64_t bwd = 2 * n * d + (bwd_mlp > bwd_attn ? bwd_mlp : bwd_attn);

    int64_t total = fwd_saved;
    if (fwd_unsaved > total) total = fwd_unsaved;
    if (bwd > total) total = bwd;
    return total;
}

int64_t mt_layer_scratch_numel(const mt_model_config *cfg, int64_t B, int64_t T)
{
    int64_t total = 0;
    if (has_dense(cfg)) total = layer_scratch_numel(cfg, B, T, false);
    if (has_sparse(cfg) && layer_scratch_numel(cfg, B, T, true) > total) total = layer_scratch_numel(cfg, B, T, true);
    return total;
}

/* Per chunk of rows: hn (chunk,d), inv_rms (chunk), logits/dlogits (chunk,V), dhn (chunk,d). */
int64_t mt_head_scratch_numel(const mt_model_config *cfg, int64_t chunk)
{
    assert(chunk > 0);
    return chunk * (2 * cfg->hidden + cfg->vocab + 1);
}
