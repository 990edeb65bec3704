/* How much memory the CPU decoder layer and head ask their callers for: the element counts of the
 * layer's `saved` and `scratch` buffers and of the head's per-chunk scratch. These sums mirror
 * the buffer plans at the top of layer.inc and head.inc; change them together. */
#include "backends/cpu/ops.h"

#include <assert.h>

/* Saved (see layer.inc): x (n,d), rms1 (n), q (n,H*D), k (n,KV*D), v (n,KV*D), a (n,H*D),
 * lse (B,H,T), h (n,d), rms2 (n), g (n,I), u (n,I); with qk_norm also qpre (n,H*D),
 * kpre (n,KV*D), qrms (n*H), krms (n*KV). xn and hn are recomputed in backward, not kept. */
int64_t mt_layer_saved_numel(const mt_model_config *cfg, int64_t B, int64_t T)
{
    const int64_t n = B * T, d = cfg->hidden, inter = cfg->intermediate;
    const int64_t qd = cfg->heads * cfg->head_dim, kvd = cfg->kv_heads * cfg->head_dim;
    int64_t total = 2 * n * d + 2 * n + 2 * n * qd + 2 * n * kvd + n * cfg->heads + 2 * n * inter;
    if (cfg->qk_norm) total += n * qd + n * kvd + n * cfg->heads + n * cfg->kv_heads;
    return total;
}

/* The largest of the three plans of layer.inc: forward keeping `saved` (xn/hn, s), forward
 * without `saved` (h, then the attention phase overlaid by the MLP phase), and backward (hn/xn,
 * dhn/dxn, then the MLP gradients overlaid by the attention gradients). */
int64_t mt_layer_scratch_numel(const mt_model_config *cfg, int64_t B, int64_t T)
{
    const int64_t n = B * T, d = cfg->hidden, inter = cfg->intermediate;
    const int64_t qd = cfg->heads * cfg->head_dim, kvd = cfg->kv_heads * cfg->head_dim;
    const int64_t qk = cfg->qk_norm ? 1 : 0;

    const int64_t fwd_saved = n * d + n * inter;
    const int64_t attn_phase = n * d + 2 * n * qd + 2 * n * kvd + n * cfg->heads + qk * (n * qd + n * kvd);
    const int64_t mlp_phase = n * d + 3 * n * inter;
    const int64_t fwd_unsaved = n * d + (attn_phase > mlp_phase ? attn_phase : mlp_phase);
    const int64_t bwd_mlp = 3 * n * inter;
    const int64_t bwd_attn = 2 * n * qd + 2 * n * kvd + qk * n * kvd;
    const int64_t bwd = 2 * n * d + (bwd_mlp > bwd_attn ? bwd_mlp : bwd_attn);

    int64_t total = fwd_saved;
    if (fwd_unsaved > total) total = fwd_unsaved;
    if (bwd > total) total = bwd;
    return total;
}

/* Per chunk of rows: hn (chunk,d), inv_rms (chunk), logits/dlogits (chunk,V), dhn (chunk,d). */
int64_t mt_head_scratch_numel(const mt_model_config *cfg, int64_t chunk)
{
    assert(chunk > 0);
    return chunk * (2 * cfg->hidden + cfg->vocab + 1);
}
