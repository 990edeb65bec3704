/* Global gradient-norm clipping as two kinds of task: a sum of squares per tile, then one task
 * that turns the partial sums into the norm and the scale min(1, max_norm / norm) every AdamW
 * task of the step reads. */
#include "codelets.h"

#include <math.h>

static void grad_sumsq_cpu(void *buffers[], void *cl_arg)
{
    (void)cl_arg;
    double *out = (double *)STARPU_VECTOR_GET_PTR(buffers[1]);
    out[0] = mt_cpu_sumsq_f32((int64_t)STARPU_VECTOR_GET_NX(buffers[0]), (const float *)STARPU_VECTOR_GET_PTR(buffers[0]));
}

static void clip_cpu(void *buffers[], void *cl_arg)
{
    double max_norm;
    starpu_codelet_unpack_args(cl_arg, &max_norm);
    struct starpu_task *task = starpu_task_get_current();
    unsigned n = STARPU_TASK_GET_NBUFFERS(task) - 1;
    double sum = 0;
    for (unsigned i = 0; i < n; i++) sum += ((const double *)STARPU_VECTOR_GET_PTR(buffers[i]))[0];
    double *out = (double *)STARPU_VECTOR_GET_PTR(buffers[n]);
    out[0] = sqrt(sum);
    /* torch.nn.utils.clip_grad_norm_: scale = max_norm / (norm + 1e-6), applied when < 1 */
    double scale = max_norm / (out[0] + 1e-6);
    out[1] = scale < 1.0 ? scale : 1.0;
}

struct starpu_codelet mt_cl_grad_sumsq = {
    .name = "grad_sumsq",
    .cpu_funcs = { grad_sumsq_cpu },
    .nbuffers = 2,
    .modes = { STARPU_R, STARPU_W },
};

struct starpu_codelet mt_cl_clip = {
    .name = "clip",
    .cpu_funcs = { clip_cpu },
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};
