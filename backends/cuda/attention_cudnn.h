/* The optional cuDNN fused-attention path behind mt_cuda_attention_forward / backward
 * (backends/cuda/attention_cudnn.cu; selected by MT_ATTENTION=cudnn in attention.cu). Same shapes,
 * layouts and contracts as those two functions (kernels.h): q (B,T,H,D), k v (B,T,KV,D) bf16,
 * out bf16 =, lse (B,H,T) fp32 = natural-log LSE of the scaled scores, dq dk dv fp32 =.
 *
 * libcudnn.so.9 is loaded with dlopen at first use: nothing links against cuDNN, and a machine
 * without it gets a reason string, never a crash. Every function returns 0 on success and -1 with
 * a one-line reason in why[0..n) on failure; a failure has enqueued nothing the caller must
 * undo (the caller then runs the own kernel, which writes every output).
 *
 * Built only when cudnn.h was found at configure time (MT_HAVE_CUDNN_HEADERS); otherwise the
 * inline stubs below answer "not built". C-callable. */
#ifndef MT_BACKENDS_CUDA_ATTENTION_CUDNN_H
#define MT_BACKENDS_CUDA_ATTENTION_CUDNN_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "backends/cuda/kernels.h"
#include "mt_build_config.h"

#ifdef __cplusplus
extern "C" {
#endif

#if MT_HAVE_CUDNN_HEADERS

/* 1 if libcudnn.so.9 (>= 9.0) loads and a cuDNN handle exists on the calling thread's current
 * device; 0 and the reason otherwise (e.g. "dlopen libcudnn.so.9: ..." or "cudnnCreate: ..."). */
int mt_cuda_attention_cudnn_available(char *why, size_t n);

/* Builds (and destroys) the forward and backward graphs' tensor and operation descriptors of this
 * shape: no handle, no GPU needed, so it checks the graph code's attributes on any machine with
 * libcudnn.so.9 (the operation graph, heuristics and plan need a GPU). 0 and a summary in why;
 * -1 and the first failing call; -2 when cuDNN is not there to ask (not built, no library). */
int mt_cuda_attention_cudnn_check_graphs(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D, char *why, size_t n);

/* 1 if the cuDNN path takes this shape at all (D 64 or 128, B T >= 1, H a multiple of KV). */
int mt_cuda_attention_cudnn_supports(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D);

/* The workspace bytes the execution plan of this shape and direction asked for, as built on the
 * calling thread; -1 when none was built there (or building failed). A forward plan's workspace
 * is one cudaMalloc at its build (its first use on the thread); a backward plan's comes from the
 * caller's workspace. */
int64_t mt_cuda_attention_cudnn_plan_workspace(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D, int backward);

/* 1 if the loaded cuDNN's fused backward takes sequence length T: any T from 9.15.1, a multiple
 * of 128 before (attention_cudnn.cu says why); 0 also when the library does not load. */
int mt_cuda_attention_cudnn_backward_takes_T(int64_t T);

/* The workspace bytes the cuDNN backward asks of mt_cuda_attention_workspace_bytes, a pure
 * function of the shape (0 for shapes it does not take); see attention_cudnn.cu for the formula. */
size_t mt_cuda_attention_cudnn_workspace_bytes(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D);

int mt_cuda_attention_cudnn_forward(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D, const mt_cuda_bf16 *q,
                                    const mt_cuda_bf16 *k, const mt_cuda_bf16 *v, mt_cuda_bf16 *out, float *lse,
                                    mt_cuda_stream stream, char *why, size_t n);

/* workspace: workspace_bytes (at least mt_cuda_attention_cudnn_workspace_bytes) of device memory. */
int mt_cuda_attention_cudnn_backward(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D, const mt_cuda_bf16 *q,
                                     const mt_cuda_bf16 *k, const mt_cuda_bf16 *v, const mt_cuda_bf16 *out,
                                     const float *lse, const mt_cuda_bf16 *dout, float *dq, float *dk, float *dv,
                                     void *workspace, size_t workspace_bytes, mt_cuda_stream stream, char *why,
                                     size_t n);

#else /* built without cudnn.h: the own kernel always */

static inline int mt_cuda_attention_cudnn_not_built(char *why, size_t n)
{
    if (why && n) snprintf(why, n, "built without cudnn.h (MT_HAVE_CUDNN_HEADERS = 0)");
    return -1;
}
static inline int mt_cuda_attention_cudnn_available(char *why, size_t n)
{
    mt_cuda_attention_cudnn_not_built(why, n);
    return 0;
}
static inline int mt_cuda_attention_cudnn_check_graphs(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                                                       char *why, size_t n)
{
    (void)B, (void)T, (void)H, (void)KV, (void)D;
    mt_cuda_attention_cudnn_not_built(why, n);
    return -2;
}
static inline int mt_cuda_attention_cudnn_supports(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D)
{
    (void)B, (void)T, (void)H, (void)KV, (void)D;
    return 0;
}
static inline int64_t mt_cuda_attention_cudnn_plan_workspace(int64_t B, int64_t T, int64_t H, int64_t KV,
                                                             int64_t D, int backward)
{
    (void)B, (void)T, (void)H, (void)KV, (void)D, (void)backward;
    return -1;
}
static inline int mt_cuda_attention_cudnn_backward_takes_T(int64_t T)
{
    (void)T;
    return 0;
}
static inline size_t mt_cuda_attention_cudnn_workspace_bytes(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D)
{
    (void)B, (void)T, (void)H, (void)KV, (void)D;
    return 0;
}
static inline int mt_cuda_attention_cudnn_forward(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                                                  const mt_cuda_bf16 *q, const mt_cuda_bf16 *k,
                                                  const mt_cuda_bf16 *v, mt_cuda_bf16 *out, float *lse,
                                                  mt_cuda_stream stream, char *why, size_t n)
{
    (void)B, (void)T, (void)H, (void)KV, (void)D, (void)q, (void)k, (void)v, (void)out, (void)lse, (void)stream;
    return mt_cuda_attention_cudnn_not_built(why, n);
}
static inline int mt_cuda_attention_cudnn_backward(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                                                   const mt_cuda_bf16 *q, const mt_cuda_bf16 *k,
                                                   const mt_cuda_bf16 *v, const mt_cuda_bf16 *out, const float *lse,
                                                   const mt_cuda_bf16 *dout, float *dq, float *dk, float *dv,
                                                   void *workspace, size_t workspace_bytes, mt_cuda_stream stream,
                                                   char *why, size_t n)
{
    (void)B, (void)T, (void)H, (void)KV, (void)D, (void)q, (void)k, (void)v, (void)out, (void)lse, (void)dout;
    (void)dq, (void)dk, (void)dv, (void)workspace, (void)workspace_bytes, (void)stream;
    return mt_cuda_attention_cudnn_not_built(why, n);
}

#endif

#ifdef __cplusplus
}
#endif

#endif
