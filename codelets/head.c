/* The loss anchor as StarPU tasks: final norm + LM head + cross-entropy, chunked over tokens,
 * with its backward (training) or alone (validation). */
#include "codelets/head.h"

#include <string.h>

static void head_cpu(void *buffers[], void *cl_arg)
{
    mt_compute_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    const mt_codelet_model *md = a.model;
    const bool tied = md->cfg.tied;
    float *scratch = (float *)STARPU_VECTOR_GET_PTR(buffers[6]);
    float *tmp = scratch + mt_head_scratch_numel(&md->cfg, a.head_chunk);
    const float *head = mt_codelet_weights_f32(md, &md->layout_head, buffers[0], tmp);
    const float *embed = tied ? mt_codelet_weights_f32(md, &md->layout_embed, buffers[7], tmp + md->layout_head.numel) : NULL;
    float *dhead = (float *)STARPU_VECTOR_GET_PTR(buffers[4]);
    float *dembed = tied ? (float *)STARPU_VECTOR_GET_PTR(buffers[8]) : NULL;
    if (!a.accumulate) {
        memset(dhead, 0, STARPU_VECTOR_GET_NX(buffers[4]) * sizeof(float));
        if (tied) memset(dembed, 0, STARPU_VECTOR_GET_NX(buffers[8]) * sizeof(float));
    }
    int64_t counted = 0;
    double *loss = (double *)STARPU_VECTOR_GET_PTR(buffers[5]);
    loss[0] = mt_cpu_head_f32(&md->cfg, &md->layout_head, head, embed, a.B * a.T,
                              (const float *)STARPU_VECTOR_GET_PTR(buffers[1]),
                              (const int32_t *)STARPU_VECTOR_GET_PTR(buffers[2]), a.loss_scale,
                              a.head_chunk, (float *)STARPU_VECTOR_GET_PTR(buffers[3]), dhead,
                              dembed, scratch, &counted);
    loss[1] = (double)counted;
    if (a.sumsq) mt_codelet_sumsq_cpu(buffers[4], buffers[tied ? 9 : 7]);
    if (a.sumsq && tied && a.table_sumsq) mt_codelet_sumsq_cpu(buffers[8], buffers[10]);
}

static void head_eval_cpu(void *buffers[], void *cl_arg)
{
    mt_compute_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    const mt_codelet_model *md = a.model;
    const bool tied = md->cfg.tied;
    float *scratch = (float *)STARPU_VECTOR_GET_PTR(buffers[4]);
    float *tmp = scratch + mt_head_scratch_numel(&md->cfg, a.head_chunk);
    const float *head = mt_codelet_weights_f32(md, &md->layout_head, buffers[0], tmp);
    const float *embed = tied ? mt_codelet_weights_f32(md, &md->layout_embed, buffers[5], tmp + md->layout_head.numel) : NULL;
    int64_t counted = 0;
    double *loss = (double *)STARPU_VECTOR_GET_PTR(buffers[3]);
    loss[0] = mt_cpu_head_f32(&md->cfg, &md->layout_head, head, embed, a.B * a.T,
                              (const float *)STARPU_VECTOR_GET_PTR(buffers[1]),
                              (const int32_t *)STARPU_VECTOR_GET_PTR(buffers[2]), 0.0, a.head_chunk,
                              NULL, NULL, NULL, scratch, &counted);
    loss[1] = (double)counted;
}

#if MT_HAVE_CUDA
static void head_cuda(void *buffers[], void *cl_arg)
{
    mt_compute_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    const mt_codelet_model *md = a.model;
    const bool tied = md->cfg.tied;
    cudaStream_t stream = starpu_cuda_get_local_stream();
    float *dhead = (float *)STARPU_VECTOR_GET_PTR(buffers[4]);
    mt_cuda_head(mt_cuda_ctx_get(), &md->cfg, &md->layout_head, mt_codelet_cuda_prec(md->dtype),
                 (const void *)STARPU_VECTOR_GET_PTR(buffers[0]),
                 tied ? (const void *)STARPU_VECTOR_GET_PTR(buffers[7]) : NULL, a.B * a.T,
                 (const float *)STARPU_VECTOR_GET_PTR(buffers[1]), (const int32_t *)STARPU_VECTOR_GET_PTR(buffers[2]),
                 a.loss_scale, a.head_chunk, (float *)STARPU_VECTOR_GET_PTR(buffers[3]), dhead,
                 tied ? (float *)STARPU_VECTOR_GET_PTR(buffers[8]) : NULL, a.accumulate,
                 (double *)STARPU_VECTOR_GET_PTR(buffers[5]), (void *)STARPU_VECTOR_GET_PTR(buffers[6]), stream);
    if (a.sumsq)
        mt_cuda_sumsq_f32(dhead, (int64_t)STARPU_VECTOR_GET_NX(buffers[4]),
                          (double *)STARPU_VECTOR_GET_PTR(buffers[tied ? 9 : 7]), stream);
    if (a.sumsq && tied && a.table_sumsq)
        mt_cuda_sumsq_f32((const float *)STARPU_VECTOR_GET_PTR(buffers[8]), (int64_t)STARPU_VECTOR_GET_NX(buffers[8]),
                          (double *)STARPU_VECTOR_GET_PTR(buffers[10]), stream);
}

static void head_eval_cuda(void *buffers[], void *cl_arg)
{
    mt_compute_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    const mt_codelet_model *md = a.model;
    const bool tied = md->cfg.tied;
    mt_cuda_head(mt_cuda_ctx_get(), &md->cfg, &md->layout_head, mt_codelet_cuda_prec(md->dtype),
                 (const void *)STARPU_VECTOR_GET_PTR(buffers[0]),
                 tied ? (const void *)STARPU_VECTOR_GET_PTR(buffers[5]) : NULL, a.B * a.T,
                 (const float *)STARPU_VECTOR_GET_PTR(buffers[1]), (const int32_t *)STARPU_VECTOR_GET_PTR(buffers[2]),
                 0.0, a.head_chunk, NULL, NULL, NULL, false, (double *)STARPU_VECTOR_GET_PTR(buffers[3]),
                 (void *)STARPU_VECTOR_GET_PTR(buffers[4]), starpu_cuda_get_local_stream());
}
#endif

struct starpu_codelet mt_cl_head = {
    .name = "head",
    .cpu_funcs = { head_cpu },
#if MT_HAVE_CUDA
    .cuda_funcs = { head_cuda },
    .cuda_flags = { STARPU_CUDA_ASYNC },
#endif
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};

struct starpu_codelet mt_cl_head_eval = {
    .name = "head_eval",
    .cpu_funcs = { head_eval_cpu },
#if MT_HAVE_CUDA
    .cuda_funcs = { head_eval_cuda },
    .cuda_flags = { STARPU_CUDA_ASYNC },
#endif
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};
