/* Global gradient-norm clipping: the last backward task of each tile leaves the sum of squares
 * of its gradient; this task turns them into the norm and the scale every AdamW task of the
 * step reads, and keeps the partials for the next step's ranged speculation (adamw.c). */
#include "codelets/codelets.h"

#include <math.h>

static void clip_cpu(void *buffers[], void *cl_arg)
{
    double max_norm;
    mt_norm_history *hist;
    int64_t seq;
    starpu_codelet_unpack_args(cl_arg, &max_norm, &hist, &seq);
    struct starpu_task *task = starpu_task_get_current();
    const unsigned nbuf = STARPU_TASK_GET_NBUFFERS(task);
    const bool extra = hist && (int)nbuf == hist->ntiles + 2; /* the table's head part after the output */
    const unsigned n = extra ? nbuf - 2 : nbuf - 1;
    double sum = 0;
    for (unsigned i = 0; i < n; i++) sum += ((const double *)STARPU_VECTOR_GET_PTR(buffers[i]))[0];
    if (hist) {
        /* the ranged runs of norm seq + 1 read these (mt_ranged_args) */
        double *h = hist->sumsq[seq % 2];
        for (unsigned i = 0; i < n && (int)i < hist->ntiles; i++) h[i] = ((const double *)STARPU_VECTOR_GET_PTR(buffers[i]))[0];
        h[hist->ntiles] = extra ? ((const double *)STARPU_VECTOR_GET_PTR(buffers[n + 1]))[0] : 0;
        mt_codelet_norm_recorded(hist, seq, max_norm);
    }
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

/* The sums of squares in when a tile's backward ends, for ranged speculation (mt_ranged_args):
 * {the tile's and every tile's whose backward came before, the table's head part}. */
static void known_cpu(void *buffers[], void *cl_arg)
{
    int from_head;
    starpu_codelet_unpack_args(cl_arg, &from_head);
    const unsigned nbuf = STARPU_TASK_GET_NBUFFERS(starpu_task_get_current());
    const double partial = ((const double *)STARPU_VECTOR_GET_PTR(buffers[0]))[0];
    double *out = (double *)STARPU_VECTOR_GET_PTR(buffers[nbuf - 1]);
    if (from_head) {
        out[0] = partial;
        out[1] = nbuf == 3 ? ((const double *)STARPU_VECTOR_GET_PTR(buffers[1]))[0] : 0;
    } else {
        const double *next = (const double *)STARPU_VECTOR_GET_PTR(buffers[1]);
        out[0] = partial + next[0];
        out[1] = next[1];
    }
}

struct starpu_codelet mt_cl_known = {
    .name = "known",
    .cpu_funcs = { known_cpu },
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};
