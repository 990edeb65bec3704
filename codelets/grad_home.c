/* The gradient home of the compact layout (codelets/grad_home.h). */
#include "codelets/grad_home.h"

#include "backends/cpu/grad_home.h"

/* The sum of squares buffer, when the task has one. */
static void *sumsq_buffer(void *buffers[])
{
    return STARPU_TASK_GET_NBUFFERS(starpu_task_get_current()) > 2 ? buffers[2] : NULL;
}

static void grad_home_cpu(void *buffers[], void *cl_arg)
{
    (void)cl_arg;
    void *sumsq = sumsq_buffer(buffers);
    const double s = mt_cpu_grad_home((int64_t)STARPU_VECTOR_GET_NX(buffers[0]),
                                      (const float *)STARPU_VECTOR_GET_PTR(buffers[0]),
                                      (mt_bf16 *)STARPU_VECTOR_GET_PTR(buffers[1]));
    if (sumsq) *(double *)STARPU_VECTOR_GET_PTR(sumsq) = s;
}

#if MT_HAVE_CUDA
static void grad_home_cuda(void *buffers[], void *cl_arg)
{
    (void)cl_arg;
    void *sumsq = sumsq_buffer(buffers);
    mt_cuda_grad_home((const float *)STARPU_VECTOR_GET_PTR(buffers[0]), (mt_cuda_bf16 *)STARPU_VECTOR_GET_PTR(buffers[1]),
                      (int64_t)STARPU_VECTOR_GET_NX(buffers[0]), sumsq ? (double *)STARPU_VECTOR_GET_PTR(sumsq) : NULL,
                      starpu_cuda_get_local_stream());
}
#endif

struct starpu_codelet mt_cl_grad_home = {
    .name = "grad_home",
    .cpu_funcs = { grad_home_cpu },
#if MT_HAVE_CUDA
    .cuda_funcs = { grad_home_cuda },
    .cuda_flags = { STARPU_CUDA_ASYNC },
#endif
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};
