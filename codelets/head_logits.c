/* The logits of selected rows (codelets/head_logits.h): the CPU implementation gathers the rows
 * and runs mt_cpu_head_logits on them; the CUDA one runs mt_cuda_head_logits. */
#include "codelets/head_logits.h"

#include <assert.h>
#include <string.h>

/* The CPU scratch: gathered rows (nrows, d), then what the loss head takes for nrows rows (its
 * kernel's scratch, whose hn the logits use, and for bf16 weights the fp32 copies of the head tile
 * and, tied, of the table). */
size_t mt_codelet_head_logits_scratch_bytes(const mt_model_config *cfg, mt_dtype weights, bool gpu, int64_t nrows)
{
#if MT_HAVE_CUDA
    if (gpu) return mt_cuda_head_logits_scratch_bytes(cfg, mt_codelet_cuda_prec(weights), nrows);
#endif
    return (size_t)(nrows * cfg->hidden) * sizeof(float) + mt_codelet_head_scratch_bytes(cfg, weights, false, nrows);
}

static void head_logits_cpu(void *buffers[], void *cl_arg)
{
    mt_compute_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    const mt_codelet_model *md = a.model;
    const int64_t d = md->cfg.hidden;
    const int64_t ntok = (int64_t)STARPU_VECTOR_GET_NX(buffers[1]) / d;
    const int64_t nrows = (int64_t)STARPU_VECTOR_GET_NX(buffers[2]);
    const float *h = (const float *)STARPU_VECTOR_GET_PTR(buffers[1]);             /* (ntok, d) */
    const int32_t *rows = (const int32_t *)STARPU_VECTOR_GET_PTR(buffers[2]);      /* (nrows) */
    float *gathered = (float *)STARPU_VECTOR_GET_PTR(buffers[4]);                  /* (nrows, d) */
    float *scratch = gathered + nrows * d;                                         /* the head kernel's */
    float *tmp = scratch + mt_head_scratch_numel(&md->cfg, nrows);                 /* bf16: fp32 weights */
    for (int64_t r = 0; r < nrows; r++) {
        assert(rows[r] >= 0 && rows[r] < ntok);
        memcpy(gathered + r * d, h + (int64_t)rows[r] * d, sizeof(float) * (size_t)d);
    }
    const float *head = mt_codelet_weights_f32(md, &md->layout_head, buffers[0], tmp);
    const float *embed = md->cfg.tied ? mt_codelet_weights_f32(md, &md->layout_embed, buffers[5], tmp + md->layout_head.numel) : NULL;
    mt_cpu_head_logits_f32(&md->cfg, &md->layout_head, head, embed, nrows, gathered,
                           (float *)STARPU_VECTOR_GET_PTR(buffers[3]), scratch);
}

#if MT_HAVE_CUDA
static void head_logits_cuda(void *buffers[], void *cl_arg)
{
    mt_compute_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    const mt_codelet_model *md = a.model;
    mt_cuda_head_logits(mt_cuda_ctx_get(), &md->cfg, &md->layout_head, mt_codelet_cuda_prec(md->dtype),
                        (const void *)STARPU_VECTOR_GET_PTR(buffers[0]),
                        md->cfg.tied ? (const void *)STARPU_VECTOR_GET_PTR(buffers[5]) : NULL,
                        (int64_t)STARPU_VECTOR_GET_NX(buffers[1]) / md->cfg.hidden,
                        (const float *)STARPU_VECTOR_GET_PTR(buffers[1]), (int64_t)STARPU_VECTOR_GET_NX(buffers[2]),
                        (const int32_t *)STARPU_VECTOR_GET_PTR(buffers[2]), (float *)STARPU_VECTOR_GET_PTR(buffers[3]),
                        (void *)STARPU_VECTOR_GET_PTR(buffers[4]), starpu_cuda_get_local_stream());
}
#endif

struct starpu_codelet mt_cl_head_logits = {
    .name = "head_logits",
    .cpu_funcs = { head_logits_cpu },
#if MT_HAVE_CUDA
    .cuda_funcs = { head_logits_cuda },
    .cuda_flags = { STARPU_CUDA_ASYNC },
#endif
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};
