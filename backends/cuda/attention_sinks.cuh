// Attention sinks (gpt_oss): a logit per head in every query row's softmax that takes probability
// and gives no value. Added after any attention kernel, own or cuDNN's, as a fix-up of its output:
// with l = the row's log-sum-exp over its keys and s the sink, the softmax over keys and sink has
// log-sum-exp l' = logaddexp(l, s) and scales each key's probability, so the output, by
// exp(l - l'). The backward needs nothing else of the kernels: given l', their P = exp(S - l') are
// the sink softmax's probabilities, and with Delta = sum over the keys of P dP (the sink's dP
// being 0) dq, dk, dv come out right; each sink's gradient is -sum over its head's rows of
// exp(s - l') Delta.
// Delta must be that sum itself, not rowsum(dO . O) from the bf16 output: a row's dS = P (dP -
// Delta) sums over its keys to p_sink Delta, a small number (zero without a sink) that every key's
// gradient shares, and the key bias's gradient sums it over the rows. The output's bf16 rounding in
// Delta (several times p_sink Delta) lands there uncancelled; so with sinks the own backward
// computes Delta from the recomputed P and dP (mt_attention_own_backward's exact_delta), and cuDNN's
// backward, which takes Delta from O, is not used. Internal to backends/cuda.
#ifndef MT_BACKENDS_CUDA_ATTENTION_SINKS_CUH
#define MT_BACKENDS_CUDA_ATTENTION_SINKS_CUH

#include "backends/cuda/common.cuh"

// out (B,T,H,D) and lse (B,H,T), as an attention forward left them, become the sink softmax's;
// sinks (H) of the weights' type.
void mt_attention_sinks_apply_bf16(int64_t B, int64_t T, int64_t H, int64_t D, const bf16 *sinks, bf16 *out,
                                   float *lse, cudaStream_t stream);
void mt_attention_sinks_apply_f32(int64_t B, int64_t T, int64_t H, int64_t D, const float *sinks, float *out,
                                  float *lse, cudaStream_t stream);
// dsinks (H) += the sinks' gradient, from the backward's lse (after the fix-up) and Delta (B, H, T).
// One block per head, a fixed summation order: the same bits every run.
void mt_attention_sinks_grad_bf16(int64_t B, int64_t T, int64_t H, const bf16 *sinks, const float *lse,
                                  const float *delta, float *dsinks, cudaStream_t stream);
void mt_attention_sinks_grad_f32(int64_t B, int64_t T, int64_t H, const float *sinks, const float *lse,
                                 const float *delta, float *dsinks, cudaStream_t stream);

#endif
