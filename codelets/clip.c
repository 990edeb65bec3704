/* Global gradient-norm clipping: the last backward task of each tile leaves the sum of squares
 * of its gradient; this task turns them into the norm and the scale every AdamW task of the
 * step reads. */
#include "codelets.h"

#include <math.h>

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

struct starpu_codelet mt_cl_clip = {
    .name = "clip",
    .cpu_funcs = { clip_cpu },
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};
