// The decoder layer's own element-wise steps on the GPU, the kernels of layer.cu's forward and
// backward besides the GEMMs (linear.cuh), RMSNorm (rmsnorm.cuh) and attention: the RoPE
// tables, q/k-norm + RoPE in one launch (and its backward with the cast to E), SwiGLU, and the
// q/k-norm weight and q/k/v bias gradients (deterministic column sums, colsum.cuh). E is the
// operand type, bf16 or float; every launcher enqueues on `stream` and allocates nothing.
// Internal to backends/cuda (tests time them).
#ifndef MT_BACKENDS_CUDA_LAYER_OPS_CUH
#define MT_BACKENDS_CUDA_LAYER_OPS_CUH

extern "C" { // C headers without their own linkage guards
#include "models/config.h"
#include "models/layout.h"
}

#include "backends/cuda/common.cuh"

#define LAYER_MAX_HEAD_DIM 256 // RoPE pairs held in registers: 4 per lane of a warp

// One layer call's sizes: n = B*T rows, inter = I, qd = H*D, kvd = KV*D, half = D/2.
typedef struct mt_layer_dims {
    int64_t B, T, n, d, H, KV, D, inter, qd, kvd, half;
} mt_layer_dims;

mt_layer_dims mt_layer_dims_of(const mt_model_config *cfg, int64_t B, int64_t T);

// Aborts naming the violated condition unless the layout is cfg's layer layout and the head
// dimensions fit these kernels.
void mt_layer_check(const mt_model_config *cfg, const mt_tile_layout *layout, const mt_layer_dims *m);

// cos_t, sin_t (T, D/2) fp32 = attention_factor * cos/sin of t * inv_freq[j], both from
// mt_rope_inv_freq for sequences of m->T tokens, computed in double and rounded as the CPU path
// does.
void mt_layer_rope_tables(const mt_model_config *cfg, const mt_layer_dims *m, float *cos_t, float *sin_t,
                          cudaStream_t stream);

// q (n, H*D) and k (n, KV*D) as E: [cfg->qk_norm: per-head RMSNorm of qsrc ksrc by qw kw (D),
// inv_rms qrms (n*H) krms (n*KV) written] then the rotation, into qdst kdst (src == dst allowed).
template <class E>
void mt_layer_qk_rope_forward(const mt_model_config *cfg, const mt_layer_dims *m, const E *qsrc, const E *ksrc,
                              E *qdst, E *kdst, const float *qw, const float *kw, float *qrms, float *krms,
                              const float *cos_t, const float *sin_t, cudaStream_t stream);

// Its backward on dq (n, H*D), dk (n, KV*D) fp32 from attention: the transpose of the rotation
// scaled by the tables' attention factor, [qk_norm: the norm's input gradient from qpre kpre qw
// kw qrms krms, and dq dk overwritten with the norm weight's summands], written as E into
// dq_proj dk_proj and as fp32 into dq32 dk32 when given.
template <class E>
void mt_layer_qk_rope_backward(const mt_model_config *cfg, const mt_layer_dims *m, float *dq, float *dk,
                               const E *qpre, const E *kpre, const float *qw, const float *kw, const float *qrms,
                               const float *krms, E *dq_proj, E *dk_proj, const float *cos_t, const float *sin_t,
                               float *dq32, float *dk32, cudaStream_t stream);

// out (len) E = silu(gate) * up, fp32 math with expf as the CPU's float path.
template <class E> void mt_layer_swiglu_forward(int64_t len, const E *gate, const E *up, E *out, cudaStream_t stream);

// dgate = dout up sig (1 + g (1 - sig)), dup = dout silu(g), E; dout fp32. dgate may alias the
// buffer the forward's output was in.
template <class E>
void mt_layer_swiglu_backward(int64_t len, const E *gate, const E *up, const float *dout, E *dgate, E *dup,
                              cudaStream_t stream);

// q/k-norm weight gradients dqw dkw (D) += column sums of the summands the qk_norm backward left
// in dq (n*H, D) and dk (n*KV, D). partials: mt_colsum_partials_bytes(D).
void mt_layer_qk_norm_weight_grads(const mt_layer_dims *m, const float *dq, const float *dk, float *dqw, float *dkw,
                                   float *partials, cudaStream_t stream);

// q/k/v bias gradients dqb (H*D), dkb dvb (KV*D) += column sums of the fp32 gradients at the
// projections' outputs dq32 (n, H*D), dk32 dv (n, KV*D). partials: mt_colsum_partials_bytes of
// the widest.
void mt_layer_qkv_bias_grads(const mt_layer_dims *m, const float *dq32, const float *dk32, const float *dv,
                             float *dqb, float *dkb, float *dvb, float *partials, cudaStream_t stream);

// y (rows, C) fp32 += bias (C) of E on every row: o_proj's bias on the residual stream (its GEMM
// writes fp32 with the residual in its epilogue), the router's on its fp32 logits.
template <class E> void mt_layer_add_bias(int64_t rows, int64_t C, const E *bias, float *y, cudaStream_t stream);

// db (C) += column sums of dy (rows, C) fp32: o_proj's bias gradient. partials:
// mt_colsum_partials_bytes(C).
void mt_layer_bias_grad(int64_t rows, int64_t C, const float *dy, float *db, float *partials, cudaStream_t stream);

#endif
