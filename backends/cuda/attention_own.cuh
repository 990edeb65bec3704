// The own bf16 flash-attention kernels behind mt_cuda_attention_forward / backward (attention.cu),
// with the contracts of those entry points (kernels.h): q (B,T,H,D), k v (B,T,KV,D) bf16; out
// bf16 =, lse (B,H,T) fp32 =; dq dk dv fp32 =. D is 32, 64, 96 or 128 and the shape checked by
// the caller. The backward is deterministic: no float atomics, each output written once.
// Internal to backends/cuda.
#ifndef MT_BACKENDS_CUDA_ATTENTION_OWN_CUH
#define MT_BACKENDS_CUDA_ATTENTION_OWN_CUH

#include "backends/cuda/common.cuh"

// Bytes of the own backward's workspace: Delta (B, H, T) fp32.
size_t mt_attention_own_workspace_bytes(int64_t B, int64_t T, int64_t H);

// The forward; qblock picks the query-block form (backends/cuda/options.h); window > 0: query t
// sees keys t - window + 1 .. t only.
void mt_attention_own_forward(mt_cuda_qblock qblock, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                              int64_t window, const bf16 *q, const bf16 *k, const bf16 *v, bf16 *out, float *lse,
                              cudaStream_t stream);

// The backward; delta: mt_attention_own_workspace_bytes of device memory, left holding Delta.
// exact_delta: Delta = rowsum(P dP) from the recomputed probabilities (a pass like dQ's without its
// last GEMM) instead of rowsum(dO . out); what sinks need (attention_sinks.cuh).
void mt_attention_own_backward(mt_cuda_qblock qblock, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                               int64_t window, const bf16 *q, const bf16 *k, const bf16 *v, const bf16 *out,
                               const float *lse, const bf16 *dout, float *dq, float *dk, float *dv, float *delta,
                               bool exact_delta, cudaStream_t stream);

#endif
