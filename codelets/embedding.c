/* Token embedding as StarPU tasks: forward gathers rows of the table, backward scatters the
 * gradient into the table's gradient (and, last in the step, its sum of squares). */
#include "codelets.h"

#include <string.h>

#include "mt_build_config.h"
#if MT_HAVE_CUDA
#include "cuda/kernels.h"
#endif

static void embedding_forward_cpu(void *buffers[], void *cl_arg)
{
    mt_compute_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    const int64_t d = a.st->cfg.hidden, ntok = a.B * a.T;
    const int32_t *tokens = (const int32_t *)STARPU_VECTOR_GET_PTR(buffers[1]); /* (ntok) */
    float *h0 = (float *)STARPU_VECTOR_GET_PTR(buffers[2]);                     /* (ntok, d) */
    if (a.st->compute_dtype == MT_DTYPE_F32) {
        mt_cpu_embedding_forward_f32(ntok, d, (const float *)STARPU_VECTOR_GET_PTR(buffers[0]), tokens, h0);
        return;
    }
    /* bf16 table: convert only the rows used. */
    const mt_bf16 *table = (const mt_bf16 *)STARPU_VECTOR_GET_PTR(buffers[0]);
    for (int64_t r = 0; r < ntok; r++) mt_cpu_bf16_to_f32(d, table + (int64_t)tokens[r] * d, h0 + r * d);
}

static void embedding_backward_cpu(void *buffers[], void *cl_arg)
{
    mt_compute_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    const int64_t d = a.st->cfg.hidden, ntok = a.B * a.T;
    float *dtable = (float *)STARPU_VECTOR_GET_PTR(buffers[2]); /* (V, d) padded tile */
    if (!a.accumulate) memset(dtable, 0, STARPU_VECTOR_GET_NX(buffers[2]) * sizeof(float));
    mt_cpu_embedding_backward_f32(ntok, d, (const int32_t *)STARPU_VECTOR_GET_PTR(buffers[0]),
                                  (const float *)STARPU_VECTOR_GET_PTR(buffers[1]), dtable);
    if (a.sumsq) mt_codelet_sumsq_cpu(buffers[2], buffers[4]);
}

#if MT_HAVE_CUDA
static void embedding_forward_cuda(void *buffers[], void *cl_arg)
{
    mt_compute_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    mt_cuda_embedding_forward(a.B * a.T, a.st->cfg.hidden, (const mt_cuda_bf16 *)STARPU_VECTOR_GET_PTR(buffers[0]),
                              (const int32_t *)STARPU_VECTOR_GET_PTR(buffers[1]),
                              (float *)STARPU_VECTOR_GET_PTR(buffers[2]), starpu_cuda_get_local_stream());
}

static void embedding_backward_cuda(void *buffers[], void *cl_arg)
{
    mt_compute_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    cudaStream_t stream = starpu_cuda_get_local_stream();
    float *dtable = (float *)STARPU_VECTOR_GET_PTR(buffers[2]);
    size_t n = STARPU_VECTOR_GET_NX(buffers[2]);
    if (!a.accumulate) cudaMemsetAsync(dtable, 0, n * sizeof(float), stream);
    mt_cuda_embedding_backward(a.B * a.T, a.st->cfg.hidden, a.st->cfg.vocab,
                               (const int32_t *)STARPU_VECTOR_GET_PTR(buffers[0]),
                               (const float *)STARPU_VECTOR_GET_PTR(buffers[1]), dtable,
                               (void *)STARPU_VECTOR_GET_PTR(buffers[3]), stream);
    if (a.sumsq) mt_cuda_sumsq_f32(dtable, (int64_t)n, (double *)STARPU_VECTOR_GET_PTR(buffers[4]), stream);
}
#endif

struct starpu_codelet mt_cl_embedding_forward = {
    .name = "embedding_forward",
    .cpu_funcs = { embedding_forward_cpu },
#if MT_HAVE_CUDA
    .cuda_funcs = { embedding_forward_cuda },
    .cuda_flags = { STARPU_CUDA_ASYNC },
#endif
    .nbuffers = 3,
    .modes = { STARPU_R, STARPU_R, STARPU_W },
};

/* Mode of the gradient is given at insertion (W on the step's first write, RW after). */
struct starpu_codelet mt_cl_embedding_backward = {
    .name = "embedding_backward",
    .cpu_funcs = { embedding_backward_cpu },
#if MT_HAVE_CUDA
    .cuda_funcs = { embedding_backward_cuda },
    .cuda_flags = { STARPU_CUDA_ASYNC },
#endif
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};
