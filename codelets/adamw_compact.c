/* AdamW over the compact layout's planes, on a CPU worker (codelets/adamw_compact.h). */
#include "codelets/adamw_compact.h"

#include "backends/cpu/master_planes.h"
#include "models/util.h"

/* The update's parameters with the clip task's scale (buffers[clip], present when clipped) folded
 * into the gradient multiplier, as the fp32 codelets form it. */
static mt_adamw_params clipped_params(const mt_adamw_args *a, void *buffers[], int clip)
{
    mt_adamw_params p = a->p;
    if (a->clipped) p.grad_scale *= ((const double *)STARPU_VECTOR_GET_PTR(buffers[clip]))[1];
    return p;
}

static int64_t count(void *buffer) { return (int64_t)STARPU_VECTOR_GET_NX(buffer); }
static void *ptr(void *buffer) { return (void *)STARPU_VECTOR_GET_PTR(buffer); }
/* A chunk of a norm, whose master is its fp32 streamed copy (the weights buffer holds floats;
 * the low plane's chunk is unused): models/layout.h, mt_layout_keep_norms_f32. */
static bool fp32_master(void *weights) { return STARPU_VECTOR_GET_ELEMSIZE(weights) == sizeof(float); }

static void adamw_compact_cpu(void *buffers[], void *cl_arg)
{
    const int64_t t0 = mt_clock_ns();
    mt_adamw_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    const mt_adamw_params p = clipped_params(&a, buffers, 5);
    if (fp32_master(buffers[0]))
        mt_cpu_adamw_f32_master(count(buffers[0]), ptr(buffers[0]), ptr(buffers[4]), ptr(buffers[2]), ptr(buffers[3]), &p);
    else
        mt_cpu_adamw_planes(count(buffers[0]), ptr(buffers[0]), ptr(buffers[1]), ptr(buffers[4]), ptr(buffers[2]),
                            ptr(buffers[3]), &p);
    mt_adamw_stats_time(a.stats, MT_AK_FUSED, mt_clock_ns() - t0);
}

static void adamw_compact_weights_cpu(void *buffers[], void *cl_arg)
{
    const int64_t t0 = mt_clock_ns();
    mt_adamw_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    const mt_adamw_params p = clipped_params(&a, buffers, 5);
    if (fp32_master(buffers[0]))
        mt_cpu_adamw_f32_master_weights(count(buffers[0]), ptr(buffers[0]), ptr(buffers[4]), ptr(buffers[2]),
                                        ptr(buffers[3]), &p);
    else
        mt_cpu_adamw_planes_weights(count(buffers[0]), ptr(buffers[0]), ptr(buffers[1]), ptr(buffers[4]),
                                    ptr(buffers[2]), ptr(buffers[3]), &p);
    mt_adamw_stats_time(a.stats, MT_AK_WEIGHTS, mt_clock_ns() - t0);
}

static void adamw_compact_moments_cpu(void *buffers[], void *cl_arg)
{
    const int64_t t0 = mt_clock_ns();
    mt_adamw_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    const mt_adamw_params p = clipped_params(&a, buffers, 3);
    mt_cpu_adamw_planes_moments(count(buffers[0]), ptr(buffers[2]), ptr(buffers[0]), ptr(buffers[1]), &p);
    mt_adamw_stats_time(a.stats, MT_AK_MOMENTS, mt_clock_ns() - t0);
}

struct starpu_codelet mt_cl_adamw_compact = {
    .name = "adamw_compact",
    .cpu_funcs = { adamw_compact_cpu },
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};

struct starpu_codelet mt_cl_adamw_compact_weights = {
    .name = "adamw_compact_weights",
    .cpu_funcs = { adamw_compact_weights_cpu },
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};

struct starpu_codelet mt_cl_adamw_compact_moments = {
    .name = "adamw_compact_moments",
    .cpu_funcs = { adamw_compact_moments_cpu },
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};
