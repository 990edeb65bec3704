/* Helpers shared by the CPU implementations of the codelets: bf16 weight views and scratch
 * sizes. */
#include "codelets.h"

const float *mt_codelet_weights_f32(const mt_host_state *st, void *buffer, float *tmp)
{
    void *w = (void *)STARPU_VECTOR_GET_PTR(buffer);
    if (st->compute_dtype == MT_DTYPE_F32) return w;
    mt_cpu_bf16_to_f32((int64_t)STARPU_VECTOR_GET_NX(buffer), w, tmp);
    return tmp;
}

int64_t mt_codelet_layer_scratch_numel(const mt_host_state *st, int64_t B, int64_t T)
{
    int64_t n = mt_layer_scratch_numel(&st->cfg, B, T);
    if (st->compute_dtype == MT_DTYPE_BF16) n += st->layout_layer.numel;
    return n;
}

int64_t mt_codelet_head_scratch_numel(const mt_host_state *st, int64_t chunk)
{
    int64_t n = mt_head_scratch_numel(&st->cfg, chunk);
    if (st->compute_dtype == MT_DTYPE_BF16)
        n += st->layout_head.numel + (st->cfg.tied ? st->layout_embed.numel : 0);
    return n;
}
