/* Global gradient-norm clipping (codelets/clip.h). */
#include "codelets/clip.h"

#include <math.h>

static double value_of(void *buffer) { return ((const double *)STARPU_VECTOR_GET_PTR(buffer))[0]; }

static void clip_cpu(void *buffers[], void *cl_arg)
{
    mt_clip_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    const int n = a.ntiles;
    double sum = 0;
    for (int i = 0; i < n; i++) sum += value_of(buffers[i]);
    int next = n + 1;
    const double head_table = a.head_table ? value_of(buffers[next++]) : 0;
    if (a.record) {
        /* the ranged runs of norm seq + 1 read this record */
        double sums[n];
        for (int i = 0; i < n; i++) sums[i] = value_of(buffers[i]);
        const void *last = (const void *)STARPU_VECTOR_GET_PTR(buffers[next]);
        void *record = (void *)STARPU_VECTOR_GET_PTR(buffers[next + 1]);
        void *log = a.log ? (void *)STARPU_VECTOR_GET_PTR(buffers[next + 2]) : NULL;
        a.record(last, record, a.seq, a.max_norm, sums, n, head_table, log);
    }
    double *out = (double *)STARPU_VECTOR_GET_PTR(buffers[n]);
    out[0] = sqrt(sum);
    out[1] = mt_clip_scale(a.max_norm, out[0]);
}

struct starpu_codelet mt_cl_clip = {
    .name = "clip",
    .cpu_funcs = { clip_cpu },
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};

/* The sums of squares in when a tile's backward ends: {the tile's and every tile's whose backward
 * came before, the table's head part}. */
static void known_cpu(void *buffers[], void *cl_arg)
{
    int from_head;
    starpu_codelet_unpack_args(cl_arg, &from_head);
    const unsigned nbuf = STARPU_TASK_GET_NBUFFERS(starpu_task_get_current());
    const double partial = value_of(buffers[0]);
    double *out = (double *)STARPU_VECTOR_GET_PTR(buffers[nbuf - 1]);
    if (from_head) {
        out[0] = partial;
        out[1] = nbuf == 3 ? value_of(buffers[1]) : 0;
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

static void sum_partials_cpu(void *buffers[], void *cl_arg)
{
    (void)cl_arg;
    unsigned n = STARPU_TASK_GET_NBUFFERS(starpu_task_get_current()) - 1;
    double s = 0;
    for (unsigned i = 0; i < n; i++) s += value_of(buffers[i]);
    *(double *)STARPU_VECTOR_GET_PTR(buffers[n]) = s;
}

struct starpu_codelet mt_cl_sum_partials = {
    .name = "sum_partials",
    .cpu_funcs = { sum_partials_cpu },
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};
