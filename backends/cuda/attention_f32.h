/* Causal grouped-query attention with fp32 operands and fp32 math (backends/cuda/attention_f32.cu):
 * the --dtype fp32 GPU path, within ~1e-6 relative of mt_cpu_attention_forward_f32 / backward_f32.
 * The bf16 tensor-core kernels of kernels.h (attention.cu) stay the fast path. */
#ifndef MT_BACKENDS_CUDA_ATTENTION_F32_H
#define MT_BACKENDS_CUDA_ATTENTION_F32_H

#include <stddef.h>
#include <stdint.h>

#include "backends/cuda/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Same layouts and semantics as mt_cuda_attention_forward/backward: q (B,T,H,D), k v (B,T,KV,D)
 * row-major fp32; query head h reads kv head h / (H/KV); query t sees keys 0..t; scale 1/sqrt(D).
 * D even, 2 <= D <= 256, H % KV == 0; tensors 8-byte aligned. Never a T x T matrix in memory.
 * out (B,T,H,D) =; lse (B,H,T) = max_s + log(sum_s exp(score_s - max_s)) of the scaled scores
 * (natural log, as mt_cpu_attention_forward_f32). B or T = 0 is a no-op. */
void mt_cuda_attention_forward_f32(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D, const float *q,
                                   const float *k, const float *v, float *out, float *lse, mt_cuda_stream stream);
/* Bytes of the backward's workspace: Delta (B,H,T) = rowwise dout . out. */
size_t mt_cuda_attention_f32_workspace_bytes(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D);
/* dq (B,T,H,D) =, dk dv (B,T,KV,D) = (overwritten, never accumulated). Deterministic: no float
 * atomics, so the same inputs give bitwise the same gradients. */
void mt_cuda_attention_backward_f32(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D, const float *q,
                                    const float *k, const float *v, const float *out, const float *lse,
                                    const float *dout, float *dq, float *dk, float *dv, void *workspace,
                                    mt_cuda_stream stream);

/* The same for one layer of gpt_oss: window > 0 limits query t to keys t - window + 1 .. t;
 * sinks (H, or NULL) put a logit per head in every row's softmax, with no value, so that out and
 * lse are those of that softmax; the backward then adds each sink's gradient to dsinks (H, +=;
 * NULL: not wanted). */
void mt_cuda_attention_forward_f32_ex(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D, int64_t window,
                                      const float *sinks, const float *q, const float *k, const float *v, float *out,
                                      float *lse, mt_cuda_stream stream);
void mt_cuda_attention_backward_f32_ex(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D, int64_t window,
                                       const float *sinks, const float *q, const float *k, const float *v,
                                       const float *out, const float *lse, const float *dout, float *dq, float *dk,
                                       float *dv, float *dsinks, void *workspace, mt_cuda_stream stream);

#ifdef __cplusplus
}
#endif

#endif
