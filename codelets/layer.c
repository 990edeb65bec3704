/* One decoder layer as StarPU tasks: forward (optionally keeping what backward needs) and
 * backward (dx, and the layer's weight gradient written or accumulated). */
#include "codelets.h"

#include <string.h>

static void layer_forward_cpu(void *buffers[], void *cl_arg)
{
    mt_compute_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    const mt_host_state *st = a.st;
    float *scratch = (float *)STARPU_VECTOR_GET_PTR(buffers[3]);
    float *wtmp = scratch + mt_layer_scratch_numel(&st->cfg, a.B, a.T); /* bf16 only */
    const float *w = mt_codelet_weights_f32(st, buffers[0], wtmp);
    mt_cpu_layer_forward_f32(&st->cfg, &st->layout_layer, w, a.B, a.T,
                             (const float *)STARPU_VECTOR_GET_PTR(buffers[1]),
                             (float *)STARPU_VECTOR_GET_PTR(buffers[2]),
                             a.save ? (float *)STARPU_VECTOR_GET_PTR(buffers[4]) : NULL, scratch);
}

static void layer_backward_cpu(void *buffers[], void *cl_arg)
{
    mt_compute_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    const mt_host_state *st = a.st;
    float *scratch = (float *)STARPU_VECTOR_GET_PTR(buffers[5]);
    float *wtmp = scratch + mt_layer_scratch_numel(&st->cfg, a.B, a.T);
    const float *w = mt_codelet_weights_f32(st, buffers[0], wtmp);
    float *dtile = (float *)STARPU_VECTOR_GET_PTR(buffers[4]);
    if (!a.accumulate) memset(dtile, 0, STARPU_VECTOR_GET_NX(buffers[4]) * sizeof(float));
    mt_cpu_layer_backward_f32(&st->cfg, &st->layout_layer, w, a.B, a.T,
                              (const float *)STARPU_VECTOR_GET_PTR(buffers[1]),
                              (const float *)STARPU_VECTOR_GET_PTR(buffers[2]),
                              (float *)STARPU_VECTOR_GET_PTR(buffers[3]), dtile, scratch);
}

/* Buffer count and the gradient's mode depend on the task (save or not, W or RW): both are
 * given at insertion. */
struct starpu_codelet mt_cl_layer_forward = {
    .name = "layer_forward",
    .cpu_funcs = { layer_forward_cpu },
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};

struct starpu_codelet mt_cl_layer_backward = {
    .name = "layer_backward",
    .cpu_funcs = { layer_backward_cpu },
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};
