/* AdamW on one chunk of one tile, on a CPU worker: fp32 master and moments updated in place,
 * the streamed copy rewritten for the next forward. With clipping, the global-norm task's
 * scale multiplies the gradient first. Also split in two (adamw_params, then adamw_moments) for
 * the graph to put only the first on the critical path (step.c). */
#include "codelets.h"

#include <math.h>
#include <stdbool.h>
#include <string.h>

/* The streamed copy of master[o, o+len), in the compute precision. */
static void write_streamed(int64_t len, const float *master, void *w, mt_dtype dtype)
{
    if (dtype == MT_DTYPE_BF16) mt_cpu_f32_to_bf16(len, master, (mt_bf16 *)w);
    else memcpy(w, master, (size_t)len * sizeof(float));
}

/* Block by block, so the streamed copy is written from master while it is still in cache:
 * AdamW is bound by memory traffic, and a second pass would re-read all of master. */
enum { BLOCK = 4096 };

/* The fused update (fused: master, m and v in place) or the first half of a split one (master,
 * m and v read; the updated weights go through a block on the stack); both write the streamed
 * copy block by block. The two take the same buffers and arguments. */
static void adamw_streamed(void *buffers[], void *cl_arg, bool fused)
{
    mt_adamw_params p;
    mt_dtype dtype;
    int clipped;
    starpu_codelet_unpack_args(cl_arg, &p, &dtype, &clipped);
    int64_t n = (int64_t)STARPU_VECTOR_GET_NX(buffers[0]);
    float *master = (float *)STARPU_VECTOR_GET_PTR(buffers[0]);
    if (clipped) {
        double scale = ((const double *)STARPU_VECTOR_GET_PTR(buffers[5]))[1];
        if (clipped == MT_ADAMW_CONFIRM && scale == 1.0) return;
        p.grad_scale *= scale;
    }
    const float *grad = (const float *)STARPU_VECTOR_GET_PTR(buffers[3]);
    float *m = (float *)STARPU_VECTOR_GET_PTR(buffers[1]), *v = (float *)STARPU_VECTOR_GET_PTR(buffers[2]);
    char *w = (char *)STARPU_VECTOR_GET_PTR(buffers[4]);
    const size_t wsz = dtype == MT_DTYPE_BF16 ? sizeof(mt_bf16) : sizeof(float);
    float updated[BLOCK];
    for (int64_t o = 0; o < n; o += BLOCK) {
        int64_t len = n - o < BLOCK ? n - o : BLOCK;
        if (fused) {
            mt_cpu_adamw_f32(len, master + o, grad + o, m + o, v + o, &p);
            write_streamed(len, master + o, w + (size_t)o * wsz, dtype);
        } else {
            mt_cpu_adamw_params_f32(len, master + o, grad + o, m + o, v + o, updated, &p);
            write_streamed(len, updated, w + (size_t)o * wsz, dtype);
        }
    }
}

void mt_codelet_adamw_params_range(int64_t o, int64_t n, const float *master, const float *grad, const float *m,
                                   const float *v, void *weights, mt_dtype dtype, const mt_adamw_params *p)
{
    const size_t wsz = dtype == MT_DTYPE_BF16 ? sizeof(mt_bf16) : sizeof(float);
    float updated[BLOCK];
    for (int64_t e = o; e < o + n; e += BLOCK) {
        int64_t len = o + n - e < BLOCK ? o + n - e : BLOCK;
        mt_cpu_adamw_params_f32(len, master + e, grad + e, m + e, v + e, updated, p);
        write_streamed(len, updated, (char *)weights + (size_t)e * wsz, dtype);
    }
}

static void adamw_cpu(void *buffers[], void *cl_arg) { adamw_streamed(buffers, cl_arg, true); }

static void adamw_params_cpu(void *buffers[], void *cl_arg) { adamw_streamed(buffers, cl_arg, false); }

/* The second half: master, m and v in place (the fused kernel, without the streamed copy the
 * first half wrote from the same values). */
static void adamw_moments_cpu(void *buffers[], void *cl_arg)
{
    mt_adamw_params p;
    int clipped;
    starpu_codelet_unpack_args(cl_arg, &p, &clipped);
    int64_t n = (int64_t)STARPU_VECTOR_GET_NX(buffers[0]);
    if (clipped) p.grad_scale *= ((const double *)STARPU_VECTOR_GET_PTR(buffers[4]))[1];
    mt_cpu_adamw_f32(n, (float *)STARPU_VECTOR_GET_PTR(buffers[0]), (const float *)STARPU_VECTOR_GET_PTR(buffers[3]),
                     (float *)STARPU_VECTOR_GET_PTR(buffers[1]), (float *)STARPU_VECTOR_GET_PTR(buffers[2]), &p);
}

struct starpu_codelet mt_cl_adamw = {
    .name = "adamw",
    .cpu_funcs = { adamw_cpu },
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};

struct starpu_codelet mt_cl_adamw_params = {
    .name = "adamw_params",
    .cpu_funcs = { adamw_params_cpu },
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};

struct starpu_codelet mt_cl_adamw_moments = {
    .name = "adamw_moments",
    .cpu_funcs = { adamw_moments_cpu },
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};
