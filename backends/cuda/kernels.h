/* The CUDA backend, callable from C. Every launcher enqueues on the given stream (StarPU's local
 * stream inside a codelet) and never synchronises the device. Formats on the GPU:
 *   weights        the precision's type (mt_cuda_prec: bf16 or fp32), the host tile's layout
 *                  (models/layout.h offsets)
 *   weight grads   fp32, same layout; `accumulate` false writes (=), true adds (+=)
 *   hidden states  fp32 (B*T, d): layer inputs/outputs, checkpoints and their gradients
 *   saved          an opaque per-layer buffer of mt_cuda_layer_saved_bytes (fp32 parts and parts
 *                  of the precision's type)
 * ntok = B * T rows, row r = b * T + t. Contracts mirror backends/cpu/ops.h. */
#ifndef MT_BACKENDS_CUDA_KERNELS_H
#define MT_BACKENDS_CUDA_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" { /* the models' C headers have no linkage guards of their own */
#endif

#include "backends/cuda/options.h"
#include "models/config.h"
#include "models/layout.h"

typedef struct CUstream_st *mt_cuda_stream;
typedef uint16_t mt_cuda_bf16; /* bfloat16 bits, as on the host */

/* The precision of the model code (layer, head, embedding): the type of the weights and of every
 * GEMM input. Accumulation, the residual stream, norm statistics and gradients are fp32 in both.
 *   MT_CUDA_BF16  bf16 operands on the tensor cores: the fast path (--dtype bf16).
 *   MT_CUDA_F32   fp32 operands and fp32 GEMMs (no TF32), attention in fp32: agrees with the CPU
 *                 path to fp32 rounding, several times slower (--dtype fp32). */
typedef enum mt_cuda_prec { MT_CUDA_BF16, MT_CUDA_F32 } mt_cuda_prec;

/* Per-thread GPU context (options, cuBLASLt handle and workspace), its device resources created on
 * first use on the calling thread's current device. StarPU runs each CUDA worker on its own
 * thread; the runtime configures each worker's context when it starts. */
typedef struct mt_cuda_ctx mt_cuda_ctx;
mt_cuda_ctx *mt_cuda_ctx_get(void);
/* Sets the options of the calling thread's context, creating the context (not yet its device
 * resources) when the thread has none. A thread never configured runs with every option at its
 * default. */
void mt_cuda_ctx_configure(const mt_cuda_options *options);

/* ---- small kernels ---- */
/* x (n) = value */
void mt_cuda_fill_f32(float *x, int64_t n, float value, mt_cuda_stream stream);
/* 1 if p is page-locked host memory CUDA knows, 0 if pageable, -1 on error. */
int mt_cuda_host_pointer_pinned(const void *p);
/* Device memory in use on the current device, every process and allocator included (what
 * nvidia-smi shows): total - free from cudaMemGetInfo. 0, or -1 on error. */
int mt_cuda_device_memory_used(size_t *used);
void mt_cuda_f32_to_bf16(const float *in, mt_cuda_bf16 *out, int64_t n, mt_cuda_stream stream);
void mt_cuda_bf16_to_f32(const mt_cuda_bf16 *in, float *out, int64_t n, mt_cuda_stream stream);
/* out[0] = sum of x^2 (double, device memory) */
void mt_cuda_sumsq_f32(const float *x, int64_t n, double *out, mt_cuda_stream stream);
/* y (n) += x (n), each element one correctly rounded fp32 add (the devices' gradient sum) */
void mt_cuda_add_f32(float *y, const float *x, int64_t n, mt_cuda_stream stream);
/* y (n) = x (n), device to device */
void mt_cuda_copy_f32(float *y, const float *x, int64_t n, mt_cuda_stream stream);
/* The compact layout's gradient home (backends/cpu/grad_home.h): out (n) bf16 = acc (n) fp32
 * rounded to nearest even; sumsq[0] (device double, may be NULL) = the sum of the squares of
 * those bf16 values, bitwise repeatable. */
void mt_cuda_grad_home(const float *acc, mt_cuda_bf16 *out, int64_t n, double *sumsq, mt_cuda_stream stream);

/* ---- attention (backends/cuda/attention.cu) ---- */
/* Causal grouped-query attention, scale 1/sqrt(D), never a T x T matrix in memory, with the
 * kernels ctx's options choose (mt_cuda_attention, mt_cuda_qblock).
 * q (B,T,H,D), k v (B,T,KV,D) bf16; out (B,T,H,D) bf16 =; lse (B,H,T) fp32 = (natural log). */
void mt_cuda_attention_forward(mt_cuda_ctx *ctx, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                               const mt_cuda_bf16 *q, const mt_cuda_bf16 *k, const mt_cuda_bf16 *v,
                               mt_cuda_bf16 *out, float *lse, mt_cuda_stream stream);
/* dq (B,T,H,D) fp32 =, dk dv (B,T,KV,D) fp32 =. workspace: mt_cuda_attention_workspace_bytes,
 * enough for either kernel whatever the options. */
size_t mt_cuda_attention_workspace_bytes(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D);
/* 1 when the backward of this shape runs the own kernel under ctx's options, bitwise
 * reproducible run to run; 0 when it runs cuDNN's (attention auto or cudnn, and the library
 * loads and takes the shape), whose float atomics on dQ can change the last bits. */
int mt_cuda_attention_reproducible(const mt_cuda_ctx *ctx, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D);
void mt_cuda_attention_backward(mt_cuda_ctx *ctx, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                                const mt_cuda_bf16 *q, const mt_cuda_bf16 *k, const mt_cuda_bf16 *v,
                                const mt_cuda_bf16 *out, const float *lse, const mt_cuda_bf16 *dout,
                                float *dq, float *dk, float *dv, void *workspace, mt_cuda_stream stream);
/* The same for one layer of gpt_oss: window > 0 (and < T) limits query t to keys t - window + 1
 * .. t (the own kernels then run, cuDNN's plans having no window); sinks (H, bf16, or NULL) put a
 * logit per head in every row's softmax with no value, out and lse being that softmax's; the
 * backward adds each sink's gradient to dsinks (H fp32, +=; NULL: not wanted). */
void mt_cuda_attention_forward_ex(mt_cuda_ctx *ctx, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                                  int64_t window, const mt_cuda_bf16 *sinks, const mt_cuda_bf16 *q,
                                  const mt_cuda_bf16 *k, const mt_cuda_bf16 *v, mt_cuda_bf16 *out, float *lse,
                                  mt_cuda_stream stream);
void mt_cuda_attention_backward_ex(mt_cuda_ctx *ctx, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                                   int64_t window, const mt_cuda_bf16 *sinks, const mt_cuda_bf16 *q,
                                   const mt_cuda_bf16 *k, const mt_cuda_bf16 *v, const mt_cuda_bf16 *out,
                                   const float *lse, const mt_cuda_bf16 *dout, float *dq, float *dk, float *dv,
                                   float *dsinks, void *workspace, mt_cuda_stream stream);

/* ---- model pieces (backends/cuda/layer.cu, head.cu, head_logits.cu, embedding.cu) ---- */
/* h0 (ntok, d) fp32 = rows of the table (V, d) of the precision's type */
void mt_cuda_embedding_forward(int64_t ntok, int64_t d, mt_cuda_prec prec, const void *table, const int32_t *tokens,
                               float *h0, mt_cuda_stream stream);
/* dtable (V, d) fp32 += scatter of dh0 (deterministic: no float atomics) */
void mt_cuda_embedding_backward(int64_t ntok, int64_t d, int64_t V, const int32_t *tokens, const float *dh0,
                                float *dtable, void *workspace, mt_cuda_stream stream);
size_t mt_cuda_embedding_workspace_bytes(int64_t ntok, int64_t V);

size_t mt_cuda_layer_saved_bytes(const mt_model_config *cfg, mt_cuda_prec prec, int64_t B, int64_t T);
size_t mt_cuda_layer_scratch_bytes(const mt_model_config *cfg, mt_cuda_prec prec, int64_t B, int64_t T);
/* One decoder layer (as mt_cpu_layer_forward): tile of prec's type; x, y (ntok, d) fp32; saved
 * may be NULL. A sparse layout (its MLP a router and experts) runs the MoE block below; the sizes
 * above are those of the larger kind of layer cfg has. */
void mt_cuda_layer_forward(mt_cuda_ctx *ctx, const mt_model_config *cfg, const mt_tile_layout *layout,
                           mt_cuda_prec prec, const void *tile, int64_t B, int64_t T, const float *x, float *y,
                           void *saved, void *scratch, mt_cuda_stream stream);
/* The same for decoder layer `layer` (its attention window; the plain form: layer 0's), a sparse
 * layer also adding the load-balancing loss's statistics to router_stats (2E device doubles,
 * NULL: none), as mt_cpu_layer_forward_aux: the E assignment counts over all k slots, then the E
 * probability sums. A dense layer leaves them as they are. */
void mt_cuda_layer_forward_aux(mt_cuda_ctx *ctx, const mt_model_config *cfg, const mt_tile_layout *layout,
                               mt_cuda_prec prec, const void *tile, int64_t layer, int64_t B, int64_t T,
                               const float *x, float *y, void *saved, void *scratch, double *router_stats,
                               mt_cuda_stream stream);
/* dx (ntok, d) fp32 =; dtile fp32 = or += (accumulate); saved from a forward of the same prec */
void mt_cuda_layer_backward(mt_cuda_ctx *ctx, const mt_model_config *cfg, const mt_tile_layout *layout,
                            mt_cuda_prec prec, const void *tile, int64_t B, int64_t T, const void *saved,
                            const float *dy, float *dx, float *dtile, bool accumulate, void *scratch,
                            mt_cuda_stream stream);
/* The same with the load-balancing loss's gradient, as mt_cpu_layer_backward_aux: aux_counts (E
 * device doubles, NULL: none) the assignments per expert over every sparse layer of the forward
 * call, aux_scale mt_moe_aux_grad_scale. */
void mt_cuda_layer_backward_aux(mt_cuda_ctx *ctx, const mt_model_config *cfg, const mt_tile_layout *layout,
                                mt_cuda_prec prec, const void *tile, int64_t layer, int64_t B, int64_t T,
                                const void *saved, const float *dy, float *dx, float *dtile, bool accumulate,
                                void *scratch, const double *aux_counts, double aux_scale, mt_cuda_stream stream);

/* ---- mixture of experts (backends/cuda/moe_routing.cu, moe.cu; docs/moe.md) ----
 * n tokens each routed to k of E experts (E <= MT_MAX_EXPERTS); assignment a = token * k + slot.
 * mt_cuda_layer_forward/backward run a sparse layer's MoE block through these; they are also
 * callable alone (the tests compare each with backends/cpu, the bench times the block). */
/* probs (n, E) fp32 = the softmax of each row of logits (n, E) fp32, in fp32 with expf (in place
 * allowed). */
void mt_cuda_router_softmax(int64_t n, int64_t E, const float *logits, float *probs, mt_cuda_stream stream);
/* The top k of each row of probs (n, E) in rank order: NaN above every number, then the larger
 * probability, then the lower expert index. experts (n, k) int32 =, weights (n, k) fp32 = their
 * probabilities, divided by their sum (added in rank order) when renormalise: bitwise
 * mt_cpu_router_topk_f32's. */
void mt_cuda_router_topk(int64_t n, int64_t E, int64_t k, bool renormalise, const float *probs, int32_t *experts,
                         float *weights, mt_cuda_stream stream);
/* The n*k assignments grouped by expert, bitwise mt_moe_group's: offsets (E + 1) =, order (n*k) =
 * (experts ascending, tokens ascending within one), and pos (n*k) = its inverse, order[pos[a]] = a.
 * workspace: mt_cuda_moe_group_workspace_bytes. */
size_t mt_cuda_moe_group_workspace_bytes(int64_t n, int64_t E, int64_t k);
void mt_cuda_moe_group(int64_t n, int64_t E, int64_t k, const int32_t *experts, int32_t *offsets, int32_t *order,
                       int32_t *pos, void *workspace, mt_cuda_stream stream);
/* The load-balancing loss's statistics of n rows, as mt_cpu_moe_forward adds them: stats (2E
 * doubles) += the assignments per expert (offsets[e + 1] - offsets[e], offsets from the grouping)
 * in [0, E), the sums of probs (n, E) fp32 per expert, in double, in [E, 2E). No atomics: the
 * same bits every run. */
void mt_cuda_router_stats(int64_t n, int64_t E, const float *probs, const int32_t *offsets, double *stats,
                          mt_cuda_stream stream);
/* The MoE block of a sparse layer (as mt_cpu_moe_forward/backward without the load-balancing
 * loss, which mt_cuda_layer_forward_aux/backward_aux carry), the experts' GEMMs per expert on cuBLAS, fp32 accumulation; each call synchronises its
 * stream once (the experts' row counts shape the GEMMs). tile: a sparse layer's tile of prec's
 * type; hn (ntok, d) of prec's type, the normed hidden state. Forward: y (ntok, d) fp32 = resid
 * (NULL: 0) + the experts' weighted sum; saved (mt_cuda_moe_saved_bytes) may be NULL. Backward
 * from dy (ntok, d) of prec's type, with the forward's saved: dhn (ntok, d) fp32 =, dtile fp32 +=
 * at the router and at every expert some token chose. scratch: mt_cuda_moe_scratch_bytes. */
size_t mt_cuda_moe_saved_bytes(const mt_model_config *cfg, mt_cuda_prec prec, int64_t ntok);
size_t mt_cuda_moe_scratch_bytes(const mt_model_config *cfg, mt_cuda_prec prec, int64_t ntok);
void mt_cuda_moe_forward(mt_cuda_ctx *ctx, const mt_model_config *cfg, const mt_tile_layout *layout, mt_cuda_prec prec,
                         const void *tile, int64_t ntok, const void *hn, const float *resid, float *y, void *saved,
                         void *scratch, mt_cuda_stream stream);
void mt_cuda_moe_backward(mt_cuda_ctx *ctx, const mt_model_config *cfg, const mt_tile_layout *layout,
                          mt_cuda_prec prec, const void *tile, int64_t ntok, const void *hn, const void *saved,
                          const void *dy, float *dhn, float *dtile, void *scratch, mt_cuda_stream stream);

size_t mt_cuda_head_scratch_bytes(const mt_model_config *cfg, mt_cuda_prec prec, int64_t chunk);
/* Final norm + LM head + cross-entropy, `chunk` rows at a time (as mt_cpu_head). loss (device,
 * 2 doubles) = { sum of -log p over counted rows, counted }. With dh != NULL also the backward
 * of loss_scale * sum: dh =, dhead (norm, untied LM head) and dembed (tied) = or += per
 * accumulate. embed_tile is the LM head when cfg->tied. Both tiles of prec's type. */
void mt_cuda_head(mt_cuda_ctx *ctx, const mt_model_config *cfg, const mt_tile_layout *head_layout,
                  mt_cuda_prec prec, const void *head_tile, const void *embed_tile, int64_t ntok,
                  const float *h, const int32_t *targets, double loss_scale, int64_t chunk,
                  float *dh, float *dhead, float *dembed, bool accumulate, double *loss,
                  void *scratch, mt_cuda_stream stream);
/* The logits of selected rows (backends/cuda/head_logits.cu, as mt_cpu_head_logits): logits
 * (nrows, V) fp32 = LM head of the final-normed rows h[rows[r]] of h (ntok, d) fp32; rows (nrows)
 * device int32 in [0, ntok). Tiles of prec's type; scratch: mt_cuda_head_logits_scratch_bytes. */
size_t mt_cuda_head_logits_scratch_bytes(const mt_model_config *cfg, mt_cuda_prec prec, int64_t nrows);
void mt_cuda_head_logits(mt_cuda_ctx *ctx, const mt_model_config *cfg, const mt_tile_layout *head_layout,
                         mt_cuda_prec prec, const void *head_tile, const void *embed_tile, int64_t ntok,
                         const float *h, int64_t nrows, const int32_t *rows, float *logits, void *scratch,
                         mt_cuda_stream stream);

#ifdef __cplusplus
}
#endif

#endif
