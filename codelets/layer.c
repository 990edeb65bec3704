/* One decoder layer as StarPU tasks: forward (optionally keeping what backward needs) and
 * backward (dx, and the layer's weight gradient written or accumulated). */
#include "codelets/layer.h"

#include <string.h>

static void layer_forward_cpu(void *buffers[], void *cl_arg)
{
    mt_compute_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    const mt_codelet_model *md = a.model;
    float *scratch = (float *)STARPU_VECTOR_GET_PTR(buffers[3]);
    float *wtmp = scratch + mt_layer_scratch_numel(&md->cfg, a.B, a.T); /* bf16 only */
    const float *w = mt_codelet_weights_f32(md, mt_codelet_layer_layout(md, a.layer), buffers[0], wtmp);
    double *stats = a.router_stats ? (double *)STARPU_VECTOR_GET_PTR(buffers[a.save ? 5 : 4]) : NULL;
    mt_cpu_layer_forward_aux_f32(&md->cfg, mt_codelet_layer_layout(md, a.layer), w, a.layer, a.B, a.T,
                                 (const float *)STARPU_VECTOR_GET_PTR(buffers[1]),
                                 (float *)STARPU_VECTOR_GET_PTR(buffers[2]),
                                 a.save ? (float *)STARPU_VECTOR_GET_PTR(buffers[4]) : NULL, scratch, stats);
}

static void layer_backward_cpu(void *buffers[], void *cl_arg)
{
    mt_compute_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    const mt_codelet_model *md = a.model;
    float *scratch = (float *)STARPU_VECTOR_GET_PTR(buffers[5]);
    float *wtmp = scratch + mt_layer_scratch_numel(&md->cfg, a.B, a.T);
    const float *w = mt_codelet_weights_f32(md, mt_codelet_layer_layout(md, a.layer), buffers[0], wtmp);
    float *dtile = (float *)STARPU_VECTOR_GET_PTR(buffers[4]);
    if (!a.accumulate) memset(dtile, 0, STARPU_VECTOR_GET_NX(buffers[4]) * sizeof(float));
    /* the counts are the first E of the statistics, final once every sparse forward has run */
    const double *counts = a.router_stats ? (const double *)STARPU_VECTOR_GET_PTR(buffers[a.sumsq ? 7 : 6]) : NULL;
    mt_cpu_layer_backward_aux_f32(&md->cfg, mt_codelet_layer_layout(md, a.layer), w, a.layer, a.B, a.T,
                                  (const float *)STARPU_VECTOR_GET_PTR(buffers[1]),
                                  (const float *)STARPU_VECTOR_GET_PTR(buffers[2]),
                                  (float *)STARPU_VECTOR_GET_PTR(buffers[3]), dtile, scratch, counts, a.aux_scale);
    if (a.sumsq) mt_codelet_sumsq_cpu(buffers[4], buffers[6]);
}

#if MT_HAVE_CUDA
static void layer_forward_cuda(void *buffers[], void *cl_arg)
{
    mt_compute_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    const mt_codelet_model *md = a.model;
    /* the statistics handle is on this GPU (RW): the layer adds to it on its stream */
    double *stats = a.router_stats ? (double *)STARPU_VECTOR_GET_PTR(buffers[a.save ? 5 : 4]) : NULL;
    mt_cuda_layer_forward_aux(mt_cuda_ctx_get(), &md->cfg, mt_codelet_layer_layout(md, a.layer),
                              mt_codelet_cuda_prec(md->dtype), (const void *)STARPU_VECTOR_GET_PTR(buffers[0]),
                              a.layer, a.B, a.T, (const float *)STARPU_VECTOR_GET_PTR(buffers[1]),
                              (float *)STARPU_VECTOR_GET_PTR(buffers[2]),
                              a.save ? (void *)STARPU_VECTOR_GET_PTR(buffers[4]) : NULL,
                              (void *)STARPU_VECTOR_GET_PTR(buffers[3]), stats, starpu_cuda_get_local_stream());
}

static void layer_backward_cuda(void *buffers[], void *cl_arg)
{
    mt_compute_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    const mt_codelet_model *md = a.model;
    cudaStream_t stream = starpu_cuda_get_local_stream();
    float *dtile = (float *)STARPU_VECTOR_GET_PTR(buffers[4]);
    /* the counts are the first E of the statistics (R, on this GPU), final once every sparse forward has run */
    const double *counts = a.router_stats ? (const double *)STARPU_VECTOR_GET_PTR(buffers[a.sumsq ? 7 : 6]) : NULL;
    mt_cuda_layer_backward_aux(mt_cuda_ctx_get(), &md->cfg, mt_codelet_layer_layout(md, a.layer),
                               mt_codelet_cuda_prec(md->dtype), (const void *)STARPU_VECTOR_GET_PTR(buffers[0]),
                               a.layer, a.B, a.T, (const void *)STARPU_VECTOR_GET_PTR(buffers[1]),
                               (const float *)STARPU_VECTOR_GET_PTR(buffers[2]),
                               (float *)STARPU_VECTOR_GET_PTR(buffers[3]), dtile, a.accumulate,
                               (void *)STARPU_VECTOR_GET_PTR(buffers[5]), counts, a.aux_scale, stream);
    if (a.sumsq)
        mt_cuda_sumsq_f32(dtile, (int64_t)STARPU_VECTOR_GET_NX(buffers[4]), (double *)STARPU_VECTOR_GET_PTR(buffers[6]), stream);
}
#endif

/* Buffer count and the gradient's mode depend on the task (save or not, W or RW): both are
 * given at insertion. */
struct starpu_codelet mt_cl_layer_forward = {
    .name = "layer_forward",
    .cpu_funcs = { layer_forward_cpu },
#if MT_HAVE_CUDA
    .cuda_funcs = { layer_forward_cuda },
    .cuda_flags = { STARPU_CUDA_ASYNC },
#endif
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};

struct starpu_codelet mt_cl_layer_backward = {
    .name = "layer_backward",
    .cpu_funcs = { layer_backward_cpu },
#if MT_HAVE_CUDA
    .cuda_funcs = { layer_backward_cuda },
    .cuda_flags = { STARPU_CUDA_ASYNC },
#endif
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};
