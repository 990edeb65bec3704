/* reduce (codelets/reduce.h). */
#include "codelets/reduce.h"

#include <stdlib.h>
#include <string.h>

static void grad_sum_cpu(void *buffers[], void *cl_arg)
{
    mt_grad_sum_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    const int n = STARPU_TASK_GET_NBUFFERS(starpu_task_get_current());
    const int64_t numel = (int64_t)STARPU_VECTOR_GET_NX(buffers[0]);
    float **g = malloc(sizeof *g * (size_t)n);
    for (int k = 0; k < n; k++) g[k] = (float *)STARPU_VECTOR_GET_PTR(buffers[k]);
    float *out = g[a.own];
    for (int64_t i = 0; i < numel; i++) {
        float s = g[0][i];
        for (int k = 1; k < n; k++) s += g[k][i];
        out[i] = s;
    }
    free(g);
}

#if MT_HAVE_CUDA
/* g_0 receives the sum: adding g_1, g_2, ... into it in turn is the CPU's order. */
static void grad_sum_cuda(void *buffers[], void *cl_arg)
{
    mt_grad_sum_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    STARPU_ASSERT_MSG(a.own == 0, "grad_sum on a GPU sums into buffer 0, not %d", a.own);
    const int n = STARPU_TASK_GET_NBUFFERS(starpu_task_get_current());
    const int64_t numel = (int64_t)STARPU_VECTOR_GET_NX(buffers[0]);
    float *out = (float *)STARPU_VECTOR_GET_PTR(buffers[0]);
    for (int k = 1; k < n; k++)
        mt_cuda_add_f32(out, (const float *)STARPU_VECTOR_GET_PTR(buffers[k]), numel, starpu_cuda_get_local_stream());
}
#endif

struct starpu_codelet mt_cl_grad_sum = {
    .name = "grad_sum",
    .cpu_funcs = { grad_sum_cpu },
#if MT_HAVE_CUDA
    .cuda_funcs = { grad_sum_cuda },
    .cuda_flags = { STARPU_CUDA_ASYNC },
#endif
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};

static void grad_copy_cpu(void *buffers[], void *cl_arg)
{
    (void)cl_arg;
    memcpy((void *)STARPU_VECTOR_GET_PTR(buffers[1]), (const void *)STARPU_VECTOR_GET_PTR(buffers[0]),
           (size_t)STARPU_VECTOR_GET_NX(buffers[0]) * sizeof(float));
}

#if MT_HAVE_CUDA
static void grad_copy_cuda(void *buffers[], void *cl_arg)
{
    (void)cl_arg;
    mt_cuda_copy_f32((float *)STARPU_VECTOR_GET_PTR(buffers[1]), (const float *)STARPU_VECTOR_GET_PTR(buffers[0]),
                     (int64_t)STARPU_VECTOR_GET_NX(buffers[0]), starpu_cuda_get_local_stream());
}
#endif

struct starpu_codelet mt_cl_grad_copy = {
    .name = "grad_copy",
    .cpu_funcs = { grad_copy_cpu },
#if MT_HAVE_CUDA
    .cuda_funcs = { grad_copy_cuda },
    .cuda_flags = { STARPU_CUDA_ASYNC },
#endif
    .nbuffers = 2,
    .modes = { STARPU_R, STARPU_W },
};

static void grad_sumsq_cpu(void *buffers[], void *cl_arg)
{
    (void)cl_arg;
    mt_codelet_sumsq_cpu(buffers[0], buffers[1]);
}

struct starpu_codelet mt_cl_grad_sumsq = {
    .name = "grad_sumsq",
    .cpu_funcs = { grad_sumsq_cpu },
    .nbuffers = 2,
    .modes = { STARPU_R, STARPU_W },
};
