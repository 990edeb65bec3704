/* AdamW on one chunk of one tile, on a CPU worker: fp32 master and moments updated in place,
 * the streamed copy rewritten for the next forward. With clipping, the global-norm task's
 * scale multiplies the gradient first. */
#include "codelets.h"

#include <math.h>
#include <string.h>

static void adamw_cpu(void *buffers[], void *cl_arg)
{
    mt_adamw_params p;
    mt_dtype dtype;
    int clipped;
    starpu_codelet_unpack_args(cl_arg, &p, &dtype, &clipped);
    int64_t n = (int64_t)STARPU_VECTOR_GET_NX(buffers[0]);
    float *master = (float *)STARPU_VECTOR_GET_PTR(buffers[0]);
    if (clipped) p.grad_scale *= ((const double *)STARPU_VECTOR_GET_PTR(buffers[5]))[1];
    const float *grad = (const float *)STARPU_VECTOR_GET_PTR(buffers[3]);
    float *m = (float *)STARPU_VECTOR_GET_PTR(buffers[1]), *v = (float *)STARPU_VECTOR_GET_PTR(buffers[2]);
    void *w = (void *)STARPU_VECTOR_GET_PTR(buffers[4]);
    /* Block by block, so the streamed copy is written from master while it is still in cache:
     * AdamW is bound by memory traffic, and a second pass would re-read all of master. */
    const int64_t block = 4096;
    for (int64_t o = 0; o < n; o += block) {
        int64_t len = n - o < block ? n - o : block;
        mt_cpu_adamw_f32(len, master + o, grad + o, m + o, v + o, &p);
        if (dtype == MT_DTYPE_BF16) mt_cpu_f32_to_bf16(len, master + o, (mt_bf16 *)w + o);
        else memcpy((float *)w + o, master + o, (size_t)len * sizeof(float));
    }
}

struct starpu_codelet mt_cl_adamw = {
    .name = "adamw",
    .cpu_funcs = { adamw_cpu },
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};
