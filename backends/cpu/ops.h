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

/* Rotary inverse frequencies (D/2 values, HF half-split convention), with Llama-3 scaling when
 * cfg->rope_scaling_factor > 0. Computed in double. */
void mt_rope_inv_freq(const mt_model_config *cfg, double *inv_freq);

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
    /* in place on x (B, T, nh, D): rotate each head by position t */                             \
    void mt_cpu_rope_forward_##sfx(int64_t B, int64_t T, int64_t nh, int64_t D,                  \
                                   const double *inv_freq, real *x);                             \
    /* in place on dx (B, T, nh, D): the transposed (inverse) rotation */                         \
    void mt_cpu_rope_backward_##sfx(int64_t B, int64_t T, int64_t nh, int64_t D,                 \
                                    const double *inv_freq, real *dx);                           \
    /* causal grouped-query attention, scale 1/sqrt(D). q (B,T,H,D), k v (B,T,KV,D);           \
     * out (B,T,H,D) =, lse (B,H,T) = log-sum-exp of the scaled scores (kept for backward) */     \
    void mt_cpu_attention_forward_##sfx(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,  \
                                        const real *q, const real *k, const real *v, real *out,  \
                                        real *lse);                                              \
    /* dq (B,T,H,D) =, dk dv (B,T,KV,D) = ; recomputes probabilities from lse, never T x T */    \
    void mt_cpu_attention_backward_##sfx(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D, \
                                         const real *q, const real *k, const real *v,            \
                                         const real *out, const real *lse, const real *dout,     \
                                         real *dq, real *dk, real *dv);                          \
    /* out (n, inter) = silu(gate) * up */                                                            \
    void mt_cpu_swiglu_forward_##sfx(int64_t n, int64_t inter, const real *gate, const real *up,     \
                                     real *out);                                                 \
    /* dgate (n, inter) =, dup (n, inter) = */                                                            \
    void mt_cpu_swiglu_backward_##sfx(int64_t n, int64_t inter, const real *gate, const real *up,    \
                                      const real *dout, real *dgate, real *dup);                 \
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
    /* One decoder layer, pre-norm: h = x + o(attn(rope(q,k), v)); y = h + down(swiglu).       \
     * tile laid out by `layout` (MT_TILE_LAYER); x, y (B*T, d). saved (may be NULL when no     \
     * backward follows) receives mt_layer_saved_numel elements, x included. */                 \
    void mt_cpu_layer_forward_##sfx(const mt_model_config *cfg, const mt_tile_layout *layout,    \
                                    const real *tile, int64_t B, int64_t T, const real *x,       \
                                    real *y, real *saved, real *scratch);                        \
    /* dx (B*T, d) =, dtile += (same layout as tile) */                                          \
    void mt_cpu_layer_backward_##sfx(const mt_model_config *cfg, const mt_tile_layout *layout,   \
                                     const real *tile, int64_t B, int64_t T, const real *saved,  \
                                     const real *dy, real *dx, real *dtile, real *scratch);      \
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
