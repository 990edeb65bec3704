// Attention sinks (gpt_oss): a logit per head in every query row's softmax that takes probability
// and gives no value. Added after any attention kernel, own or cuDNN's, as a fix-up of its output:
// with l = the row's log-sum-exp over its keys and s the sink, the softmax over keys and sink has
// log-sum-exp l' = logaddexp(l, s) and scales each key's probability, so the output, by
// exp(l - l'). The backward needs nothing else of the kernels: given l' and the scaled output,
// their P = exp(S - l') are the sink softmax's probabilities and their Delta = rowsum(dO . O) is
// the sum over the keys, the sink's dP being 0; so dq, dk, dv come out right, and each sink's
// gradient is -sum over its head's rows of exp(s - l') Delta. Internal to backends/cuda.
#ifndef MT_BACKENDS_CUDA_ATTENTION_SINKS_CUH
#define MT_BACKENDS_CUDA_ATTENTION_SINKS_CUH

#include "backends/cuda/common.cuh"

// out (B,T,H,D) and lse (B,H,T), as an attention forward left them, become the sink softmax's;
// sinks (H) of the weights' type.
void mt_attention_sinks_apply_bf16(int64_t B, int64_t T, int64_t H, int64_t D, const bf16 *sinks, bf16 *out,
                                   float *lse, cudaStream_t stream);
void mt_attention_sinks_apply_f32(int64_t B, int64_t T, int64_t H, int64_t D, const float *sinks, float *out,
                                  float *lse, cudaStream_t stream);
// dsinks (H) += the sinks' gradient, from the forward's out and lse (after the fix-up) and dout.
// One block per head, a fixed summation order: the same bits every run.
void mt_attention_sinks_grad_bf16(int64_t B, int64_t T, int64_t H, int64_t D, const bf16 *sinks, const bf16 *out,
                                  const bf16 *dout, const float *lse, float *dsinks, cudaStream_t stream);
void mt_attention_sinks_grad_f32(int64_t B, int64_t T, int64_t H, int64_t D, const float *sinks, const float *out,
                                 const float *dout, const float *lse, float *dsinks, cudaStream_t stream);

#endif
