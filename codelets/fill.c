/* fill: sets an fp32 vector to a value. The smallest codelet with CPU and CUDA implementations;
 * `megatrain info` uses it to prove both kinds of worker run. */
#include "codelets/fill.h"

static void fill_cpu(void *buffers[], void *cl_arg)
{
    float value;
    starpu_codelet_unpack_args(cl_arg, &value);
    float *x = (float *)STARPU_VECTOR_GET_PTR(buffers[0]);
    size_t n = STARPU_VECTOR_GET_NX(buffers[0]);
    for (size_t i = 0; i < n; i++) x[i] = value;
}

#if MT_HAVE_CUDA
static void fill_cuda(void *buffers[], void *cl_arg)
{
    float value;
    starpu_codelet_unpack_args(cl_arg, &value);
    mt_cuda_fill_f32((float *)STARPU_VECTOR_GET_PTR(buffers[0]), (int64_t)STARPU_VECTOR_GET_NX(buffers[0]),
                     value, starpu_cuda_get_local_stream());
}
#endif

struct starpu_codelet mt_cl_fill = {
    .name = "fill",
    .cpu_funcs = { fill_cpu },
#if MT_HAVE_CUDA
    .cuda_funcs = { fill_cuda },
    .cuda_flags = { STARPU_CUDA_ASYNC },
#endif
    .nbuffers = 1,
    .modes = { STARPU_W },
};
