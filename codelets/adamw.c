/* AdamW on one chunk of one tile, on a CPU worker (codelets/adamw.h): fp32 master and moments
 * updated in place, the streamed copy rewritten for the next forward. With clipping, the clip
 * task's scale multiplies the gradient first. Split in two (adamw_params, then adamw_moments),
 * the graph can put only the first on the critical path. */
#include "codelets/adamw.h"

#include <string.h>

#include "models/util.h"

const char *const mt_adamw_kind_names[MT_AK_COUNT] = {
    "fused", "weights half", "confirm", "ranged pass", "ranged pass with last moments", "ranged redo",
    "moments half", "table early",
};

void mt_adamw_stats_time(mt_adamw_stats *s, mt_adamw_kind kind, int64_t ns)
{
    atomic_fetch_add(&s->ns[kind], (long long)ns);
}

double mt_adamw_stats_seconds(const mt_adamw_stats *s)
{
    long long ns = 0;
    for (int k = 0; k < MT_AK_COUNT; k++) ns += atomic_load(&s->ns[k]);
    return (double)ns * 1e-9;
}

void mt_adamw_stats_seconds_by_kind(const mt_adamw_stats *s, double out[MT_AK_COUNT])
{
    for (int k = 0; k < MT_AK_COUNT; k++) out[k] = (double)atomic_load(&s->ns[k]) * 1e-9;
}

mt_ranged_counts mt_adamw_stats_ranged(const mt_adamw_stats *s)
{
    const long long below = atomic_load(&s->below);
    return (mt_ranged_counts){ .checked = atomic_load(&s->checked), .flagged = atomic_load(&s->flagged),
                               .skipped = atomic_load(&s->skipped), .outside = atomic_load(&s->outside) + below,
                               .below = below, .unheld = atomic_load(&s->unheld),
                               .table_checked = atomic_load(&s->table_checked),
                               .table_flagged = atomic_load(&s->table_flagged),
                               .table_touched = atomic_load(&s->table_touched),
                               .redo_side = atomic_load(&s->redo_side), .redo_arrays = atomic_load(&s->redo_arrays) };
}

/* The dtype of a chunk's streamed copy (buffer [4]): the tile's, or fp32 for a chunk of a norm
 * that a bf16 tile keeps in fp32 (its fp32 side, mt_layout_keep_norms_f32). */
static mt_dtype streamed_dtype(void *weights_buffer, mt_dtype tile)
{
    return STARPU_VECTOR_GET_ELEMSIZE(weights_buffer) == sizeof(float) ? MT_DTYPE_F32 : tile;
}

/* A ranged run's start on a chunk: as mt_codelet_ranged_begin, but a chunk streamed in fp32 has
 * no bf16 rounding to absorb the scale, so its run is skipped (its confirm computes it). */
static bool ranged_begin(void *buffers[], void *flags, int64_t n, const mt_adamw_args *a, mt_adamw_params *p)
{
    if (streamed_dtype(buffers[4], a->dtype) != a->dtype) {
        mt_ranged_flags_begin(flags, n, a->ranged.side_room, 0, 0, true);
        return false;
    }
    return mt_codelet_ranged_begin(flags, n, (const double *)STARPU_VECTOR_GET_PTR(buffers[6]),
                                   (const void *)STARPU_VECTOR_GET_PTR(buffers[7]), &a->ranged, p, a->stats);
}

/* The clip task's scale times the update's gradient multiplier, as the clipped kernel forms it. */
static double clip_scale(void *clip_buffer) { return ((const double *)STARPU_VECTOR_GET_PTR(clip_buffer))[1]; }

/* The fused update (fused: master, m and v in place, then the streamed copy, block by block) or
 * the first half of a split one (the weights half over the chunk: master, m and v read). The
 * two take the same buffers. */
static void adamw_streamed(void *buffers[], mt_adamw_params p, mt_dtype dtype, int clipped, bool fused)
{
    const int64_t n = (int64_t)STARPU_VECTOR_GET_NX(buffers[0]);
    float *master = (float *)STARPU_VECTOR_GET_PTR(buffers[0]);
    if (clipped) {
        const double scale = clip_scale(buffers[5]);
        /* the kernel multiplies by (float)(grad_scale * scale): 1.0f is the speculative run's */
        if (clipped == MT_ADAMW_CONFIRM && (float)(p.grad_scale * scale) == 1.0f) return;
        p.grad_scale *= scale;
    }
    const float *grad = (const float *)STARPU_VECTOR_GET_PTR(buffers[3]);
    float *m = (float *)STARPU_VECTOR_GET_PTR(buffers[1]), *v = (float *)STARPU_VECTOR_GET_PTR(buffers[2]);
    void *w = (void *)STARPU_VECTOR_GET_PTR(buffers[4]);
    dtype = streamed_dtype(buffers[4], dtype);
    if (fused) mt_cpu_adamw_streamed(n, master, grad, m, v, w, dtype, &p);
    else mt_cpu_adamw_weights(0, n, master, grad, m, v, w, dtype, &p);
}

bool mt_codelet_ranged_begin(void *flags, int64_t n, const double known[2], const void *last, const mt_ranged_args *a,
                             mt_adamw_params *p, mt_adamw_stats *stats)
{
    double lo, hi;
    const int why = a->range(a, last, known[0], known[1], p->grad_scale, &lo, &hi);
    mt_ranged_flags_begin(flags, n, a->side_room, (float)lo, (float)hi, why != MT_RANGE_NARROW);
    if (why != MT_RANGE_NARROW) {
        atomic_fetch_add(&stats->skipped, (long long)n);
        if (why == MT_RANGE_UNHELD) atomic_fetch_add(&stats->unheld, (long long)n);
        return false;
    }
    p->grad_scale = hi;
    p->grad_scale_lo = lo;
    atomic_fetch_add(&stats->checked, (long long)n);
    return true;
}

/* adamw_params, MT_ADAMW_RANGED: the flags, and the weights of the unflagged elements. */
static void adamw_params_ranged(void *buffers[], const mt_adamw_args *a)
{
    const int64_t n = (int64_t)STARPU_VECTOR_GET_NX(buffers[0]);
    const float *master = (const float *)STARPU_VECTOR_GET_PTR(buffers[0]);
    const float *m = (const float *)STARPU_VECTOR_GET_PTR(buffers[1]), *v = (const float *)STARPU_VECTOR_GET_PTR(buffers[2]);
    const float *grad = (const float *)STARPU_VECTOR_GET_PTR(buffers[3]);
    void *w = (void *)STARPU_VECTOR_GET_PTR(buffers[4]);
    void *flags = (void *)STARPU_VECTOR_GET_PTR(buffers[5]);
    mt_adamw_params p = a->p;
    if (!ranged_begin(buffers, flags, n, a, &p)) return;
    const int64_t flagged = mt_cpu_ranged_pass(0, n, master, grad, m, v, w, a->dtype, &p, a->ranged.bounds, flags);
    atomic_fetch_add(&a->stats->flagged, (long long)flagged);
}

/* adamw_params, MT_ADAMW_RANGED_DEFERRED: the last step's moments half and this step's ranged
 * run in one pass. */
static void adamw_params_ranged_deferred(void *buffers[], const mt_adamw_args *a)
{
    const int64_t n = (int64_t)STARPU_VECTOR_GET_NX(buffers[0]);
    float *master = (float *)STARPU_VECTOR_GET_PTR(buffers[0]);
    float *m = (float *)STARPU_VECTOR_GET_PTR(buffers[1]), *v = (float *)STARPU_VECTOR_GET_PTR(buffers[2]);
    const float *grad = (const float *)STARPU_VECTOR_GET_PTR(buffers[3]);
    void *w = (void *)STARPU_VECTOR_GET_PTR(buffers[4]);
    void *flags = (void *)STARPU_VECTOR_GET_PTR(buffers[5]);
    const float *old = (const float *)STARPU_VECTOR_GET_PTR(buffers[8]);
    mt_adamw_params po = a->last, p = a->p;
    po.grad_scale *= clip_scale(buffers[9]); /* as adamw_moments_cpu */
    const bool ranged = ranged_begin(buffers, flags, n, a, &p);
    const int64_t flagged = mt_cpu_ranged_pass_deferred(0, n, master, old, grad, m, v, w, a->dtype, &po, &p,
                                                        a->ranged.bounds, ranged ? flags : NULL);
    atomic_fetch_add(&a->stats->flagged, (long long)flagged);
}

/* adamw_params, MT_ADAMW_CONFIRM_RANGED. */
static void adamw_confirm_ranged(void *buffers[], const mt_adamw_args *a)
{
    const int64_t n = (int64_t)STARPU_VECTOR_GET_NX(buffers[0]);
    const float *master = (const float *)STARPU_VECTOR_GET_PTR(buffers[0]);
    const float *m = (const float *)STARPU_VECTOR_GET_PTR(buffers[1]), *v = (const float *)STARPU_VECTOR_GET_PTR(buffers[2]);
    const float *grad = (const float *)STARPU_VECTOR_GET_PTR(buffers[3]);
    void *w = (void *)STARPU_VECTOR_GET_PTR(buffers[4]);
    const mt_ranged_header *hd = (const mt_ranged_header *)STARPU_VECTOR_GET_PTR(buffers[6]);
    mt_adamw_params p = a->p;
    p.grad_scale *= clip_scale(buffers[5]); /* as adamw_streamed forms it */
    p.grad_scale_lo = 0;
    const float c = (float)p.grad_scale;
    if (hd->skipped || !(c >= hd->cl && c <= hd->ch)) {
        if (!hd->skipped) atomic_fetch_add(c < hd->cl ? &a->stats->below : &a->stats->outside, (long long)n);
        mt_cpu_adamw_weights(0, n, master, grad, m, v, w, streamed_dtype(buffers[4], a->dtype), &p);
        return;
    }
    mt_ranged_redo_counts counts = { 0 };
    mt_cpu_ranged_redo(n, hd, master, grad, m, v, (mt_bf16 *)w, &p, &counts);
    atomic_fetch_add(&a->stats->redo_side, (long long)counts.side);
    atomic_fetch_add(&a->stats->redo_arrays, (long long)counts.arrays);
}

static void adamw_cpu(void *buffers[], void *cl_arg)
{
    const int64_t t0 = mt_clock_ns();
    mt_adamw_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    adamw_streamed(buffers, a.p, a.dtype, a.clipped, true);
    mt_adamw_stats_time(a.stats, MT_AK_FUSED, mt_clock_ns() - t0);
}

static void adamw_params_cpu(void *buffers[], void *cl_arg)
{
    const int64_t t0 = mt_clock_ns();
    mt_adamw_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    if (a.clipped == MT_ADAMW_RANGED) adamw_params_ranged(buffers, &a);
    else if (a.clipped == MT_ADAMW_RANGED_DEFERRED) adamw_params_ranged_deferred(buffers, &a);
    else if (a.clipped == MT_ADAMW_CONFIRM_RANGED) adamw_confirm_ranged(buffers, &a);
    else adamw_streamed(buffers, a.p, a.dtype, a.clipped, false);
    const mt_adamw_kind kind = a.clipped == MT_ADAMW_RANGED ? MT_AK_RANGED
                             : a.clipped == MT_ADAMW_RANGED_DEFERRED ? MT_AK_RANGED_DEFERRED
                             : a.clipped == MT_ADAMW_CONFIRM_RANGED ? MT_AK_CONFIRM_RANGED
                             : a.clipped == MT_ADAMW_CONFIRM ? MT_AK_CONFIRM : MT_AK_WEIGHTS;
    mt_adamw_stats_time(a.stats, kind, mt_clock_ns() - t0);
}

/* The second half: master, m and v in place (the fused kernel, without the streamed copy the
 * first half wrote from the same values). */
static void adamw_moments_cpu(void *buffers[], void *cl_arg)
{
    const int64_t t0 = mt_clock_ns();
    mt_adamw_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    const int64_t n = (int64_t)STARPU_VECTOR_GET_NX(buffers[0]);
    mt_adamw_params p = a.p;
    if (a.clipped) p.grad_scale *= clip_scale(buffers[4]);
    mt_cpu_adamw_f32(n, (float *)STARPU_VECTOR_GET_PTR(buffers[0]), (const float *)STARPU_VECTOR_GET_PTR(buffers[3]),
                     (float *)STARPU_VECTOR_GET_PTR(buffers[1]), (float *)STARPU_VECTOR_GET_PTR(buffers[2]), &p);
    mt_adamw_stats_time(a.stats, MT_AK_MOMENTS, mt_clock_ns() - t0);
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
