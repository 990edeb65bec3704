/* Token embedding as StarPU tasks: forward gathers rows of the table, backward scatters the
 * gradient into the table's gradient. */
#include "codelets.h"

#include <string.h>

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
}

struct starpu_codelet mt_cl_embedding_forward = {
    .name = "embedding_forward",
    .cpu_funcs = { embedding_forward_cpu },
    .nbuffers = 3,
    .modes = { STARPU_R, STARPU_R, STARPU_W },
};

/* Mode of the gradient is given at insertion (W on the step's first write, RW after). */
struct starpu_codelet mt_cl_embedding_backward = {
    .name = "embedding_backward",
    .cpu_funcs = { embedding_backward_cpu },
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};

