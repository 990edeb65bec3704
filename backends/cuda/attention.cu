// The bf16 attention entry points of kernels.h: causal grouped-query attention, scale 1/sqrt(D),
// with gpt_oss's sliding windows (the own kernels only) and sinks (attention_sinks.cuh; their
// backward the own kernels only).
// Each call first tries cuDNN 9's fused flash attention (attention_cudnn.cu: libcudnn.so.9
// loaded with dlopen, head dims 64 and 128) unless the context's options say
// MT_CUDA_ATTENTION_OWN, and on any cuDNN failure prints one line on stderr per direction and
// context, then runs the own kernels (attention_forward.cu, attention_backward.cu). cuDNN's
// backward is not bitwise reproducible (float atomics on dQ); the own one is. The workspace size
// covers both paths whenever cuDNN headers were found at build time.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "backends/cuda/attention_cudnn.h"
#include "backends/cuda/attention_own.cuh"
#include "backends/cuda/attention_sinks.cuh"
#include "backends/cuda/attention_tiles.cuh"

namespace {

void check_shapes(const char *what, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D, const void *const *ptrs,
                  int nptrs)
{
    if (B < 0 || T < 0 || H <= 0 || KV <= 0 || H % KV != 0 || (D != 32 && D != 64 && D != 96 && D != 128) ||
        T > 65535LL * mt_attention::BLOCK || H > 65535 || KV > 65535 || B > 65535) {
        fprintf(stderr,
                "%s: unsupported shape B=%lld T=%lld H=%lld KV=%lld D=%lld (need H %% KV == 0, head dim "
                "32, 64, 96 or 128, B, H <= 65535, T <= %lld: the grid's z dimension counts 64-row blocks)\n",
                what, (long long)B, (long long)T, (long long)H, (long long)KV, (long long)D,
                65535LL * mt_attention::BLOCK);
        abort();
    }
    for (int i = 0; i < nptrs; i++)
        if ((uintptr_t)ptrs[i] % 16 != 0) {
            fprintf(stderr, "%s: tensor %d is not 16-byte aligned (cp.async loads need it)\n", what, i);
            abort();
        }
}

// Whether the entry points try cuDNN for this shape first: MT_CUDA_ATTENTION_AUTO and _CUDNN
// do for the shapes it takes (the others run the own kernels silently); _OWN never.
bool cudnn_first(const mt_cuda_ctx *ctx, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D)
{
    return ctx->options.attention != MT_CUDA_ATTENTION_OWN && mt_cuda_attention_cudnn_supports(B, T, H, KV, D);
}

// The cuDNN path failed: say so once per direction (forward, backward) and context, then the own
// kernel runs.
void cudnn_fallback_note(mt_cuda_ctx *ctx, bool forward, const char *why)
{
    bool *said = &ctx->cudnn_fallback_said[forward ? 0 : 1];
    if (*said) return;
    *said = true;
    fprintf(stderr, "megatrain: cuDNN attention unavailable (%s: %s), using the own kernel\n",
            forward ? "forward" : "backward", why);
}

} // namespace

extern "C" int mt_cuda_attention_reproducible(const mt_cuda_ctx *ctx, int64_t B, int64_t T, int64_t H, int64_t KV,
                                              int64_t D)
{
    return !(cudnn_first(ctx, B, T, H, KV, D) && mt_cuda_attention_cudnn_backward_takes_T(T));
}

extern "C" void mt_cuda_attention_forward_ex(mt_cuda_ctx *ctx, int64_t B, int64_t T, int64_t H, int64_t KV,
                                             int64_t D, int64_t window, const mt_cuda_bf16 *sinks,
                                             const mt_cuda_bf16 *q, const mt_cuda_bf16 *k, const mt_cuda_bf16 *v,
                                             mt_cuda_bf16 *out, float *lse, mt_cuda_stream stream)
{
    const void *ptrs[] = {q, k, v, out};
    check_shapes("mt_cuda_attention_forward", B, T, H, KV, D, ptrs, 4);
    if (B == 0 || T == 0) return;
    const int w = mt_attention_window(window, T);
    bool done = false;
    // cuDNN's plans here have no sliding window: a windowed layer runs the own kernels
    if (!w && cudnn_first(ctx, B, T, H, KV, D)) {
        char why[384];
        done = mt_cuda_attention_cudnn_forward(B, T, H, KV, D, q, k, v, out, lse, stream, why, sizeof why) == 0;
        if (!done) cudnn_fallback_note(ctx, true, why);
    }
    if (!done)
        mt_attention_own_forward(ctx->options.qblock, B, T, H, KV, D, w, as_bf16(q), as_bf16(k), as_bf16(v),
                                 as_bf16(out), lse, as_stream(stream));
    if (sinks) mt_attention_sinks_apply_bf16(B, T, H, D, as_bf16(sinks), as_bf16(out), lse, as_stream(stream));
}

extern "C" void mt_cuda_attention_forward(mt_cuda_ctx *ctx, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                                          const mt_cuda_bf16 *q, const mt_cuda_bf16 *k, const mt_cuda_bf16 *v,
                                          mt_cuda_bf16 *out, float *lse, mt_cuda_stream stream)
{
    mt_cuda_attention_forward_ex(ctx, B, T, H, KV, D, 0, nullptr, q, k, v, out, lse, stream);
}

// The own backward needs Delta (B, H, T) fp32; the cuDNN one its bf16 gradients, fp32 accumulators
// and the plan's own workspace (mt_cuda_attention_cudnn_workspace_bytes: 0 for shapes it does not
// take, and when built without cudnn.h). The larger of the two, whatever the options say: the
// memory plan sizes this without a GPU and without a context.
extern "C" size_t mt_cuda_attention_workspace_bytes(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D)
{
    const size_t own = mt_attention_own_workspace_bytes(B, T, H);
    const size_t cudnn = mt_cuda_attention_cudnn_workspace_bytes(B, T, H, KV, D);
    return own > cudnn ? own : cudnn;
}

extern "C" void mt_cuda_attention_backward_ex(mt_cuda_ctx *ctx, int64_t B, int64_t T, int64_t H, int64_t KV,
                                              int64_t D, int64_t window, const mt_cuda_bf16 *sinks,
                                              const mt_cuda_bf16 *q, const mt_cuda_bf16 *k, const mt_cuda_bf16 *v,
                                              const mt_cuda_bf16 *out, const float *lse, const mt_cuda_bf16 *dout,
                                              float *dq, float *dk, float *dv, float *dsinks, void *workspace,
                                              mt_cuda_stream stream)
{
    const void *ptrs[] = {q, k, v, out, dout, dq, dk, dv};
    check_shapes("mt_cuda_attention_backward", B, T, H, KV, D, ptrs, 8);
    if (B == 0 || T == 0) return;
    const int w = mt_attention_window(window, T);
    bool done = false;
    // a layer with sinks runs the own backward: its Delta exact (attention_sinks.cuh)
    if (!w && !sinks && cudnn_first(ctx, B, T, H, KV, D)) {
        char why[384];
        done = mt_cuda_attention_cudnn_backward(B, T, H, KV, D, q, k, v, out, lse, dout, dq, dk, dv, workspace,
                                                mt_cuda_attention_workspace_bytes(B, T, H, KV, D), stream, why,
                                                sizeof why) == 0;
        if (!done) cudnn_fallback_note(ctx, false, why);
    }
    if (!done)
        mt_attention_own_backward(ctx->options.qblock, B, T, H, KV, D, w, as_bf16(q), as_bf16(k), as_bf16(v),
                                  as_bf16(out), lse, as_bf16(dout), dq, dk, dv, (float *)workspace, sinks != nullptr,
                                  as_stream(stream));
    if (sinks && dsinks)
        mt_attention_sinks_grad_bf16(B, T, H, as_bf16(sinks), lse, (const float *)workspace, dsinks, as_stream(stream));
}

extern "C" void mt_cuda_attention_backward(mt_cuda_ctx *ctx, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                                           const mt_cuda_bf16 *q, const mt_cuda_bf16 *k, const mt_cuda_bf16 *v,
                                           const mt_cuda_bf16 *out, const float *lse, const mt_cuda_bf16 *dout,
                                           float *dq, float *dk, float *dv, void *workspace, mt_cuda_stream stream)
{
    mt_cuda_attention_backward_ex(ctx, B, T, H, KV, D, 0, nullptr, q, k, v, out, lse, dout, dq, dk, dv, nullptr,
                                  workspace, stream);
}
