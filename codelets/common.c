/* Helpers shared by the CPU implementations of the codelets: bf16 weight views, scratch sizes. */
#include "codelets/common.h"

#include <string.h>

const float *mt_codelet_weights_f32(const mt_codelet_model *model, const mt_tile_layout *layout, void *buffer,
                                    float *tmp)
{
    void *w = (void *)STARPU_VECTOR_GET_PTR(buffer);
    if (model->dtype == MT_DTYPE_F32) return w;
    mt_bf16_to_f32(layout->numel, w, tmp);
    /* the norms a tile keeps in fp32: their side's values, not the bf16 elements (stale there) */
    for (int k = 0; layout->f32_numel && k < layout->ntensors; k++) {
        const mt_tensor_desc *d = &layout->tensors[k];
        if (d->f32_at) memcpy(tmp + d->offset, (const float *)w + d->f32_at, (size_t)d->numel * sizeof(float));
    }
    return tmp;
}

size_t mt_codelet_layer_scratch_bytes(const mt_model_config *cfg, mt_dtype weights, bool gpu, int64_t B, int64_t T)
{
#if MT_HAVE_CUDA
    if (gpu) {
        size_t layer = mt_cuda_layer_scratch_bytes(cfg, mt_codelet_cuda_prec(weights), B, T);
        /* the embedding backward borrows this scratch for its workspace */
        size_t embed = mt_cuda_embedding_workspace_bytes(B * T, cfg->vocab);
        return layer > embed ? layer : embed;
    }
#else
    (void)gpu;
#endif
    int64_t n = mt_layer_scratch_numel(cfg, B, T);
    if (weights == MT_DTYPE_BF16) n += mt_layout_largest_layer_numel(cfg);
    return (size_t)n * sizeof(float);
}

size_t mt_codelet_head_scratch_bytes(const mt_model_config *cfg, mt_dtype weights, bool gpu, int64_t chunk)
{
#if MT_HAVE_CUDA
    if (gpu) return mt_cuda_head_scratch_bytes(cfg, mt_codelet_cuda_prec(weights), chunk);
#else
    (void)gpu;
#endif
    int64_t n = mt_head_scratch_numel(cfg, chunk);
    if (weights == MT_DTYPE_BF16) {
        mt_tile_layout head, embed;
        mt_layout_build(cfg, MT_TILE_HEAD, &head);
        mt_layout_build(cfg, MT_TILE_EMBED, &embed);
        n += head.numel + (cfg->tied ? embed.numel : 0);
    }
    return (size_t)n * sizeof(float);
}

size_t mt_codelet_layer_saved_bytes(const mt_model_config *cfg, mt_dtype weights, bool gpu, int64_t B, int64_t T)
{
#if MT_HAVE_CUDA
    if (gpu) return mt_cuda_layer_saved_bytes(cfg, mt_codelet_cuda_prec(weights), B, T);
#else
    (void)gpu;
    (void)weights;
#endif
    return (size_t)mt_layer_saved_numel(cfg, B, T) * sizeof(float);
}

void mt_codelet_sumsq_cpu(void *grad_buffer, void *sumsq_buffer)
{
    double *out = (double *)STARPU_VECTOR_GET_PTR(sumsq_buffer);
    out[0] = mt_cpu_sumsq_f32((int64_t)STARPU_VECTOR_GET_NX(grad_buffer), (const float *)STARPU_VECTOR_GET_PTR(grad_buffer));
}
