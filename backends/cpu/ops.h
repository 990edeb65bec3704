/* The CPU backend: every operation of the model, forward and backward, as plain functions over
 * host arrays. Each is written once, type-generic, and instantiated for float (_f32, what the
 * runtime runs) and double (_f64, the finite-difference twin the tests use).
 * Row-major throughout; ntok = B * T rows, row r = b * T + t is token t of sequence b.
 * Backward contracts say which outputs are overwritten (=) and which accumulate (+=).
 * GEMMs go through CBLAS (OpenBLAS): callers inside StarPU workers keep it at one thread. */
#ifndef MT_BACKENDS_CPU_OPS_H
#define MT_BACKENDS_CPU_OPS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "models/config.h"
#include "models/dtype.h"
#include "models/layout.h"

/* Rotary inverse frequencies inv_freq (D/2, HF half-split convention) of cfg's rope type for
 * sequences of seq_len tokens (the whole sequence's length: dynamic scaling depends on it), in
 * double; returns the attention factor that multiplies cos and sin (yarn's; 1 otherwise). */
double mt_rope_inv_freq(const mt_model_config *cfg, int64_t seq_len, double *inv_freq);

/* AdamW (torch.optim.AdamW semantics) over one contiguous range of one tensor. */
typedef struct mt_adamw_params {
    double lr, beta1, beta2, eps;
    double weight_decay;   /* applied as p -= lr * wd * p; the caller passes 0 for norms/biases */
    int64_t step;          /* 1-based step count after this update (bias correction) */
    double grad_scale;     /* multiplies the gradient first: clip factor * 1/accumulation */
    double grad_scale_lo;  /* ranged passes (ranged.h): the scales [lo, grad_scale] the streamed
                            * weights are checked against; 0 otherwise */
} mt_adamw_params;

/* Elements of `saved` one decoder layer keeps for its backward, and of `scratch` its forward or
 * backward needs, for B sequences of T tokens. */
int64_t mt_layer_saved_numel(const mt_model_config *cfg, int64_t B, int64_t T);
int64_t mt_layer_scratch_numel(const mt_model_config *cfg, int64_t B, int64_t T);
/* Scratch of the head for `chunk` rows at a time. */
int64_t mt_head_scratch_numel(const mt_model_config *cfg, int64_t chunk);

/* Mixture of experts (backends/cpu/moe.inc, moe.c; docs/moe.md). Each of n tokens is routed to
 * k = cfg->experts_per_token of E = cfg->experts experts: assignment a = token * k + slot, slots
 * in rank order. Index arrays (int32) live in the callers' `real` scratch, one element each. */

/* Groups the n*k assignments by expert (a counting sort): order[offsets[e] .. offsets[e+1]) are
 * the assignments routed to expert e, tokens ascending; offsets has E + 1 entries. */
void mt_moe_group(int64_t n, int64_t E, int64_t k, const int32_t *experts, int32_t *offsets, int32_t *order);
/* transformers' load_balancing_loss_func over the `rows` router rows of one forward call (tokens
 * times sparse layers, concatenated): E * sum_e (count_e / rows) * (probsum_e / rows), from the
 * statistics the MoE forward gathers, stats (2E): [0, E) assignments per expert (over all k
 * slots), [E, 2E) the sum of each expert's probability over the rows. */
double mt_moe_aux_loss(int64_t E, int64_t rows, const double *stats);
/* The gradient scale the MoE backward takes with those counts: the derivative of
 * weight * coef * mt_moe_aux_loss with respect to count_e * probsum_e, i.e.
 * weight * coef * E / rows^2 (the top-k counts are piecewise constant). */
double mt_moe_aux_grad_scale(int64_t E, int64_t rows, double coef, double weight);
/* Scratch of the MoE block of one layer over n tokens (mt_cpu_moe_forward / _backward), and
 * what the decoder layer keeps of it in `saved` (probabilities (n, E), g and u (n*k, Ie)). */
int64_t mt_moe_forward_scratch_numel(const mt_model_config *cfg, int64_t n, bool saving);
int64_t mt_moe_backward_scratch_numel(const mt_model_config *cfg, int64_t n);

/* What gpt_oss's experts have beyond the plain SwiGLU expert: the biases of gate and up
 * (gu_bias, 2 Ie, interleaved as HF's gate_up_proj_bias: gate j at 2j, up j at 2j + 1) and of
 * down (down_bias, d), and the clamped gate (mt_cpu_glu_clamped_forward, alpha > 0). In a
 * gradient (dex) only the biases are used. */
#define MT_EXPERT_EXTRA_DECLARE(real, sfx)                                                         \
    typedef struct mt_expert_extra_##sfx {                                                         \
        real *gu_bias, *down_bias;                                                                 \
        double alpha, limit;                                                                       \
    } mt_expert_extra_##sfx;
MT_EXPERT_EXTRA_DECLARE(float, f32)
MT_EXPERT_EXTRA_DECLARE(double, f64)

#define MT_CPU_OPS_DECLARE(real, sfx)                                                              \
    /* out (ntok, d) = table[tokens] */                                                           \
    void mt_cpu_embedding_forward_##sfx(int64_t ntok, int64_t d, const real *table,              \
                                        const int32_t *tokens, real *out);                       \
    /* dtable (V, d) += scatter of dout (ntok, d) */                                              \
    void mt_cpu_embedding_backward_##sfx(int64_t ntok, int64_t d, const int32_t *tokens,         \
                                         const real *dout, real *dtable);                        \
    /* y (n, d) = x / rms(x) * w;  inv_rms (n) = 1/rms, may be NULL */                            \
    void mt_cpu_rmsnorm_forward_##sfx(int64_t n, int64_t d, const real *x, const real *w,        \
                                      double eps, real *y, real *inv_rms);                       \
    /* dx (n, d) +=, dw (d) += */                                                                 \
    void mt_cpu_rmsnorm_backward_##sfx(int64_t n, int64_t d, const real *x, const real *w,       \
                                       const real *inv_rms, const real *dy, real *dx, real *dw); \
    /* y (n, out) = x (n, in) W^T + b;  W (out, in) as HF stores it, b may be NULL */             \
    void mt_cpu_linear_forward_##sfx(int64_t n, int64_t in, int64_t out, const real *x,          \
                                     const real *W, const real *b, real *y);                     \
    /* dx (n, in) = or += (accumulate_dx), dW (out, in) +=, db (out) += (may be NULL) */          \
    void mt_cpu_linear_backward_##sfx(int64_t n, int64_t in, int64_t out, const real *x,         \
                                      const real *W, const real *dy, real *dx,                   \
                                      bool accumulate_dx, real *dW, real *db);                   \
    /* The fixed-order products of gemm_ordered.inc (the dense MLP's): each element's sequence  \
     * of operations is the same whatever the rows of the call. y (n, out) = x (n, in) W^T.     \
     * c (m, k) = (accumulate ? c : 0) + sum over j < na, in order, of a(i, j) b (j, k), with a \
     * (m, na) or (a_trans) stored as (na, m). */                                              \
    void mt_cpu_gemm_nt_##sfx(int64_t n, int64_t in, int64_t out, const real *x, const real *W,   \
                              real *y);                                                          \
    void mt_cpu_gemm_axpy_##sfx(int64_t m, int64_t k, int64_t na, const real *a, bool a_trans,    \
                                const real *b, real *c, bool accumulate);                        \
    /* in place on x (B, T, nh, D): rotate each head by position t, scaled by attention_factor */ \
    void mt_cpu_rope_forward_##sfx(int64_t B, int64_t T, int64_t nh, int64_t D,                  \
                                   const double *inv_freq, double attention_factor, real *x);    \
    /* in place on dx (B, T, nh, D): the transpose (the inverse rotation, scaled alike) */          \
    void mt_cpu_rope_backward_##sfx(int64_t B, int64_t T, int64_t nh, int64_t D,                 \
                                    const double *inv_freq, double attention_factor, real *dx);  \
    /* causal grouped-query attention, scale 1/sqrt(D). q (B,T,H,D), k v (B,T,KV,D);           \
     * out (B,T,H,D) =, lse (B,H,T) = log-sum-exp of the scaled scores (kept for backward).    \
     * window > 0: query t sees keys t-window+1..t only (0: all of 0..t); sinks (H) or NULL:   \
     * a logit per head in every row's softmax, with no value (gpt-oss) */                     \
    void mt_cpu_attention_forward_##sfx(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,  \
                                        int64_t window, const real *sinks, const real *q,        \
                                        const real *k, const real *v, real *out, real *lse);     \
    /* dq (B,T,H,D) =, dk dv (B,T,KV,D) = , dsinks (H) += (with sinks); recomputes              \
     * probabilities from lse, never T x T */                                                    \
    void mt_cpu_attention_backward_##sfx(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D, \
                                         int64_t window, const real *sinks, const real *q,       \
                                         const real *k, const real *v, const real *out,          \
                                         const real *lse, const real *dout, real *dq, real *dk,  \
                                         real *dv, real *dsinks);                                \
    /* out (n, inter) = silu(gate) * up */                                                            \
    void mt_cpu_swiglu_forward_##sfx(int64_t n, int64_t inter, const real *gate, const real *up,     \
                                     real *out);                                                 \
    /* dgate (n, inter) =, dup (n, inter) = */                                                            \
    void mt_cpu_swiglu_backward_##sfx(int64_t n, int64_t inter, const real *gate, const real *up,    \
                                      const real *dout, real *dgate, real *dup);                 \
    /* gpt_oss's expert gate: out (n, inter) = (v + 1) g sigmoid(alpha g), g = min(gate, limit), \
     * v = clamp(up, -limit, limit) */                                                         \
    void mt_cpu_glu_clamped_forward_##sfx(int64_t n, int64_t inter, double alpha, double limit,  \
                                          const real *gate, const real *up, real *out);          \
    /* dgate (n, inter) =, dup (n, inter) = (zero where the clamps hold the input) */           \
    void mt_cpu_glu_clamped_backward_##sfx(int64_t n, int64_t inter, double alpha, double limit, \
                                           const real *gate, const real *up, const real *dout,   \
                                           real *dgate, real *dup);                              \
    /* y (n) += x (n) */                                                                          \
    void mt_cpu_add_##sfx(int64_t n, const real *x, real *y);                                    \
    /* sum of squares, accumulated in double */                                                   \
    double mt_cpu_sumsq_##sfx(int64_t n, const real *x);                                         \
    /* AdamW on n elements: master, m, v updated in place from grad */                           \
    void mt_cpu_adamw_##sfx(int64_t n, real *master, const real *grad, real *m, real *v,         \
                            const mt_adamw_params *p);                                           \
    /* The updated weights into out (n) without writing master, grad, m or v: the first half   \
     * of a split update whose second half is mt_cpu_adamw; bitwise its master. */              \
    void mt_cpu_adamw_params_##sfx(int64_t n, const real *master, const real *grad, const real *m, \
                                   const real *v, real *out, const mt_adamw_params *p);         \
    /* m and v (n) in place from grad, no master: bitwise mt_cpu_adamw's m and v (the moments   \
     * half of an update whose master is kept as two planes, master_planes.h) */                 \
    void mt_cpu_adamw_moments_##sfx(int64_t n, const real *grad, real *m, real *v,              \
                                    const mt_adamw_params *p);                                   \
    /* Router: probs (n, E) = softmax over the experts of logits (n, E), in the precision of    \
     * real (probs may be logits). */                                                          \
    void mt_cpu_router_softmax_##sfx(int64_t n, int64_t E, const real *logits, real *probs);    \
    /* Router: the k best experts of each row of probs (n, E) into experts (n, k) =, in rank     \
     * order: the larger probability first, NaN above every number, and of equal values the     \
     * lower expert index first (torch.topk's choice on CUDA and in its CPU partial-sort path;  \
     * its CPU nth_element path, k * 64 > E, leaves exact ties unspecified). weights (n, k) =   \
     * their probabilities, divided by their sum when renormalise. */                          \
    void mt_cpu_router_topk_##sfx(int64_t n, int64_t E, int64_t k, bool renormalise,             \
                                  const real *probs, int32_t *experts, real *weights);           \
    /* Router backward: dlogits (n, E) = the gradient at the logits of dweights (n, k) through  \
     * the renormalisation and the softmax (the top-k choice is piecewise constant); with      \
     * aux_counts (E), aux_scale * aux_counts[e] joins the gradient at each row's probability  \
     * of expert e (the load-balancing loss, mt_moe_aux_grad_scale). */                        \
    void mt_cpu_router_backward_##sfx(int64_t n, int64_t E, int64_t k, bool renormalise,         \
                                      const real *probs, const int32_t *experts,                 \
                                      const real *dweights, const double *aux_counts,            \
                                      double aux_scale, real *dlogits);                          \
    /* out (rows, d) = x[order[i] / k]: the tokens of a group of assignments, gathered. */      \
    void mt_cpu_moe_gather_##sfx(int64_t rows, int64_t d, int64_t k, const int32_t *order,      \
                                 const real *x, real *out);                                      \
    /* The combine: y[order[i] / k] += weights[order[i]] * o[i] for o (rows, d); weights NULL:  \
     * unweighted (the backward's scatter of the inputs' gradients). */                         \
    void mt_cpu_moe_combine_##sfx(int64_t rows, int64_t d, int64_t k, const int32_t *order,     \
                                  const real *weights, const real *o, real *y);                  \
    /* One expert over its rows X (rows, d): g, u (rows, Ie) = X Wg^T + bg, X Wu^T + bu;       \
     * s = act(g, u); o (rows, d) = s Wd^T + bd. Wg, Wu (Ie, d), Wd (d, Ie) as HF stores them.  \
     * ex: the biases and activation (NULL: none, silu(g) * u). All = . */                     \
    void mt_cpu_expert_forward_##sfx(int64_t rows, int64_t d, int64_t Ie, const real *X,        \
                                     const real *Wg, const real *Wu, const real *Wd,             \
                                     const mt_expert_extra_##sfx *ex, real *g, real *u, real *s, \
                                     real *o);                                                   \
    /* Backward of w[i] * expert(X[i]) per row, given dy (rows, d) at that product: dX (rows, d) \
     * =, dw (rows) = <dy, expert(X)>, dWg dWu dWd +=, and with ex's biases dex +=. s, dz, du:  \
     * scratch (rows, Ie) each. */                                                             \
    void mt_cpu_expert_backward_##sfx(int64_t rows, int64_t d, int64_t Ie, const real *X,       \
                                      const real *Wg, const real *Wu, const real *Wd,            \
                                      const mt_expert_extra_##sfx *ex, const real *g,            \
                                      const real *u, const real *w, const real *dy, real *dX,    \
                                      real *dw, real *dWg, real *dWu, real *dWd,                 \
                                      mt_expert_extra_##sfx *dex, real *s, real *dz, real *du);  \
    /* The MoE block of a sparse layer over x (n, d) (the normed hidden state): router, top k,  \
     * the experts over their gathered tokens, the combine summed expert by expert in ascending \
     * order (as transformers' loop does). out (n, d) =, probs (n, E) = (kept for backward);    \
     * g_saved, u_saved (n*k, Ie) =, grouped by expert, or NULL when no backward follows;       \
     * router_stats (2E) += the aux loss's statistics (mt_moe_aux_loss), or NULL. scratch:     \
     * mt_moe_forward_scratch_numel(cfg, n, g_saved != NULL). */                              \
    void mt_cpu_moe_forward_##sfx(const mt_model_config *cfg, const mt_tile_layout *layout,     \
                                  const real *tile, int64_t n, const real *x, real *probs,       \
                                  real *out, real *g_saved, real *u_saved, double *router_stats, \
                                  real *scratch);                                                \
    /* Its backward from dout (n, d): dx (n, d) =, dtile += (router and experts); aux_counts    \
     * (E, may be NULL) and aux_scale as for mt_cpu_router_backward. scratch:                   \
     * mt_moe_backward_scratch_numel. */                                                        \
    void mt_cpu_moe_backward_##sfx(const mt_model_config *cfg, const mt_tile_layout *layout,    \
                                   const real *tile, int64_t n, const real *x, const real *probs, \
                                   const real *g_saved, const real *u_saved, const real *dout,   \
                                   const double *aux_counts, double aux_scale, real *dx,         \
                                   real *dtile, real *scratch);                                  \
    /* One decoder layer, pre-norm: h = x + o(attn(rope(q,k), v)); y = h + mlp(norm(h)), the   \
     * MLP dense (down(swiglu)) or, for a sparse layout, the MoE block. tile laid out by        \
     * `layout` (MT_TILE_LAYER); x, y (B*T, d). saved (may be NULL when no backward follows)    \
     * receives at most mt_layer_saved_numel elements, x included. */                           \
    void mt_cpu_layer_forward_##sfx(const mt_model_config *cfg, const mt_tile_layout *layout,    \
                                    const real *tile, int64_t B, int64_t T, const real *x,       \
                                    real *y, real *saved, real *scratch);                        \
    /* The same for decoder layer `layer` (the plain form computes layer 0's attention window),  \
     * a sparse layer adding its router statistics to router_stats (2E, may be NULL) for the     \
     * load-balancing loss. Pass NULL in a recompute, whose statistics are counted. */          \
    void mt_cpu_layer_forward_aux_##sfx(const mt_model_config *cfg, const mt_tile_layout *layout, \
                                        const real *tile, int64_t layer, int64_t B, int64_t T,   \
                                        const real *x, real *y, real *saved, real *scratch,      \
                                        double *router_stats);                                   \
    /* dx (B*T, d) =, dtile += (same layout as tile) */                                          \
    void mt_cpu_layer_backward_##sfx(const mt_model_config *cfg, const mt_tile_layout *layout,   \
                                     const real *tile, int64_t B, int64_t T, const real *saved,  \
                                     const real *dy, real *dx, real *dtile, real *scratch);      \
    /* The same for decoder layer `layer`, with the load-balancing loss's gradient: aux_counts \
     * (E) the assignments per expert over every sparse layer of the forward call, aux_scale    \
     * mt_moe_aux_grad_scale. */                                                               \
    void mt_cpu_layer_backward_aux_##sfx(const mt_model_config *cfg, const mt_tile_layout *layout, \
                                         const real *tile, int64_t layer, int64_t B, int64_t T,  \
                                         const real *saved, const real *dy, real *dx,            \
                                         real *dtile, real *scratch, const double *aux_counts,   \
                                         double aux_scale);                                      \
    /* Final norm + LM head + cross-entropy, chunked over rows (never ntok x V logits).         \
     * targets < 0 are ignored. Returns the sum over counted rows of -log p(target); *counted  \
     * gets their number. head_tile: MT_TILE_HEAD layout; embed_tile (V, d) is the LM head when \
     * cfg->tied. With dh != NULL also the backward of loss_scale * sum: dh (ntok, d) =,        \
     * dhead += (norm and untied LM head), dembed += (tied LM head). */                          \
    double mt_cpu_head_##sfx(const mt_model_config *cfg, const mt_tile_layout *head_layout,      \
                             const real *head_tile, const real *embed_tile, int64_t ntok,        \
                             const real *h, const int32_t *targets, double loss_scale,           \
                             int64_t chunk, real *dh, real *dhead, real *dembed, real *scratch,  \
                             int64_t *counted);                                                  \
    /* logits (nrows, V) = LM head of the final-normed rows h (nrows, d) */                     \
    void mt_cpu_head_logits_##sfx(const mt_model_config *cfg, const mt_tile_layout *head_layout, \
                                  const real *head_tile, const real *embed_tile, int64_t nrows,  \
                                  const real *h, real *logits, real *scratch);

MT_CPU_OPS_DECLARE(float, f32)
MT_CPU_OPS_DECLARE(double, f64)

#endif
