/* Helpers shared by the CPU implementations of the codelets: bf16 weight views and scratch
 * sizes. */
#include "codelets.h"

#include "mt_build_config.h"
#if MT_HAVE_CUDA
#include "cuda/kernels.h"
#endif

const float *mt_codelet_weights_f32(const mt_host_state *st, void *buffer, float *tmp)
{
    void *w = (void *)STARPU_VECTOR_GET_PTR(buffer);
    if (st->compute_dtype == MT_DTYPE_F32) return w;
    mt_cpu_bf16_to_f32((int64_t)STARPU_VECTOR_GET_NX(buffer), w, tmp);
    return tmp;
}

#if MT_HAVE_CUDA
static size_t max_size(size_t a, size_t b) { return a > b ? a : b; }
#endif

size_t mt_codelet_layer_scratch_bytes(const mt_host_state *st, int64_t B, int64_t T)
{
    int64_t n = mt_layer_scratch_numel(&st->cfg, B, T);
    if (st->compute_dtype == MT_DTYPE_BF16) n += st->layout_layer.numel;
    size_t bytes = (size_t)n * sizeof(float);
#if MT_HAVE_CUDA
    bytes = max_size(bytes, mt_cuda_layer_scratch_bytes(&st->cfg, B, T));
    /* the embedding backward borrows this scratch for its workspace */
    bytes = max_size(bytes, mt_cuda_embedding_workspace_bytes(B * T, st->cfg.vocab));
#endif
    return bytes;
}

size_t mt_codelet_head_scratch_bytes(const mt_host_state *st, int64_t chunk)
{
    int64_t n = mt_head_scratch_numel(&st->cfg, chunk);
    if (st->compute_dtype == MT_DTYPE_BF16)
        n += st->layout_head.numel + (st->cfg.tied ? st->layout_embed.numel : 0);
    size_t bytes = (size_t)n * sizeof(float);
#if MT_HAVE_CUDA
    bytes = max_size(bytes, mt_cuda_head_scratch_bytes(&st->cfg, chunk));
#endif
    return bytes;
}

size_t mt_codelet_layer_saved_bytes(const mt_host_state *st, int64_t B, int64_t T)
{
    size_t bytes = (size_t)mt_layer_saved_numel(&st->cfg, B, T) * sizeof(float);
#if MT_HAVE_CUDA
    bytes = max_size(bytes, mt_cuda_layer_saved_bytes(&st->cfg, B, T));
#endif
    return bytes;
}

void mt_codelet_sumsq_cpu(void *grad_buffer, void *sumsq_buffer)
{
    double *out = (double *)STARPU_VECTOR_GET_PTR(sumsq_buffer);
    out[0] = mt_cpu_sumsq_f32((int64_t)STARPU_VECTOR_GET_NX(grad_buffer), (const float *)STARPU_VECTOR_GET_PTR(grad_buffer));
}
