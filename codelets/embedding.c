/* Token embedding as StarPU tasks (codelets/embedding.h): forward gathers rows of the table,
 * backward scatters the gradient into the table's gradient (and, last in the step, its sum of
 * squares); the table's early update path per chunk. */
#include "codelets/embedding.h"

#include <stdlib.h>
#include <string.h>

#include "backends/cpu/table_sumsq.h"
#include "models/util.h"

static void embedding_forward_cpu(void *buffers[], void *cl_arg)
{
    mt_compute_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    const int64_t d = a.model->cfg.hidden, ntok = a.B * a.T;
    const int32_t *tokens = (const int32_t *)STARPU_VECTOR_GET_PTR(buffers[1]); /* (ntok) */
    float *h0 = (float *)STARPU_VECTOR_GET_PTR(buffers[2]);                     /* (ntok, d) */
    if (a.model->dtype == MT_DTYPE_F32) {
        mt_cpu_embedding_forward_f32(ntok, d, (const float *)STARPU_VECTOR_GET_PTR(buffers[0]), tokens, h0);
        return;
    }
    /* bf16 table: convert only the rows used. */
    const mt_bf16 *table = (const mt_bf16 *)STARPU_VECTOR_GET_PTR(buffers[0]);
    for (int64_t r = 0; r < ntok; r++) mt_bf16_to_f32(d, table + (int64_t)tokens[r] * d, h0 + r * d);
}

static void embedding_backward_cpu(void *buffers[], void *cl_arg)
{
    mt_compute_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    const int64_t d = a.model->cfg.hidden, ntok = a.B * a.T;
    float *dtable = (float *)STARPU_VECTOR_GET_PTR(buffers[2]); /* (V, d) padded tile */
    if (!a.accumulate) memset(dtable, 0, STARPU_VECTOR_GET_NX(buffers[2]) * sizeof(float));
    mt_cpu_embedding_backward_f32(ntok, d, (const int32_t *)STARPU_VECTOR_GET_PTR(buffers[0]),
                                  (const float *)STARPU_VECTOR_GET_PTR(buffers[1]), dtable);
    if (a.sumsq)
        *(double *)STARPU_VECTOR_GET_PTR(buffers[4]) =
            mt_cpu_table_sumsq(a.model->table_chunks, a.model->table_nchunks, dtable, d);
}

/* Rows [lo, hi] overlap the chunk; a row's part in it is [max(row d, off), min(row d + d, off + n)).
 * Tokens are added in micro-batch and token order, as mt_cpu_embedding_backward_f32 adds them,
 * so every element of the gradient gets the same sum, in the same order, as there. */
static void embedding_backward_chunk_cpu(void *buffers[], void *cl_arg)
{
    mt_embed_chunk_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    float *g = (float *)STARPU_VECTOR_GET_PTR(buffers[0]);
    const int64_t n = (int64_t)STARPU_VECTOR_GET_NX(buffers[0]), off = a.offset, d = a.d;
    const int64_t lo = off / d, hi = (off + n - 1) / d;
    unsigned char *touched = calloc((size_t)(hi - lo + 1), 1);
    for (int u = 0; u < a.micro_batches; u++) {
        const int32_t *tokens = (const int32_t *)STARPU_VECTOR_GET_PTR(buffers[1 + 2 * u]);
        const float *dh = (const float *)STARPU_VECTOR_GET_PTR(buffers[2 + 2 * u]);
        for (int64_t r = 0; r < a.ntok; r++) {
            const int64_t row = tokens[r];
            if (row < lo || row > hi) continue;
            int64_t b, e;
            mt_cpu_row_part(row, d, off, n, &b, &e);
            const float *src = dh + r * d + (b - row * d);
            float *dst = g + (b - off);
            for (int64_t j = 0; j < e - b; j++) dst[j] += src[j];
            touched[row - lo] = 1;
        }
    }
    const float *master = (const float *)STARPU_VECTOR_GET_PTR(buffers[1 + 2 * a.micro_batches]);
    const float *m = (const float *)STARPU_VECTOR_GET_PTR(buffers[2 + 2 * a.micro_batches]);
    const float *v = (const float *)STARPU_VECTOR_GET_PTR(buffers[3 + 2 * a.micro_batches]);
    void *w = (void *)STARPU_VECTOR_GET_PTR(buffers[4 + 2 * a.micro_batches]);
    double *rows = a.sumsq ? (double *)STARPU_VECTOR_GET_PTR(buffers[5 + 2 * a.micro_batches]) : NULL;
    void *flags = a.ranged ? (void *)STARPU_VECTOR_GET_PTR(buffers[STARPU_TASK_GET_NBUFFERS(starpu_task_get_current()) - 1]) : NULL;
    int64_t nflag = 0;
    for (int64_t row = lo; row <= hi; row++) {
        if (!touched[row - lo]) continue;
        int64_t b, e;
        mt_cpu_row_part(row, d, off, n, &b, &e);
        if (flags) mt_ranged_flags_mark(flags, b - off, e - b), nflag += e - b;
        else mt_cpu_adamw_weights(b - off, e - b, master, g, m, v, w, a.dtype, &a.p);
        if (rows) rows[row - lo] = mt_cpu_row_part_sumsq(g, off, b, e);
    }
    free(touched);
    if (nflag) atomic_fetch_add(&a.stats->table_touched, (long long)nflag);
    if (a.sumsq) *(double *)STARPU_VECTOR_GET_PTR(buffers[6 + 2 * a.micro_batches]) = mt_cpu_sum_rows(rows, hi - lo + 1);
}

/* The weights half of AdamW on one chunk of the table and its row sums (mt_cl_embedding_update_
 * early); deferred, the last update's moments half first, in the same pass. */
static void embedding_update_early_cpu(void *buffers[], void *cl_arg)
{
    const int64_t t0 = mt_clock_ns();
    mt_embed_chunk_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    const int64_t n = (int64_t)STARPU_VECTOR_GET_NX(buffers[0]), off = a.offset, d = a.d;
    const float *master = (const float *)STARPU_VECTOR_GET_PTR(buffers[0]);
    const float *m = (const float *)STARPU_VECTOR_GET_PTR(buffers[1]), *v = (const float *)STARPU_VECTOR_GET_PTR(buffers[2]);
    const float *g = (const float *)STARPU_VECTOR_GET_PTR(buffers[3]);
    void *w = (void *)STARPU_VECTOR_GET_PTR(buffers[4]);
    double *rows = (double *)STARPU_VECTOR_GET_PTR(buffers[5]);
    /* Ranged: the range from the head tile's sum of squares, the one in, and the table's as the
     * head left it (mt_ranged_args) */
    void *flags = a.ranged ? (void *)STARPU_VECTOR_GET_PTR(buffers[6]) : NULL;
    const double *known = flags ? (const double *)STARPU_VECTOR_GET_PTR(buffers[7]) : NULL;
    const void *last = flags ? (const void *)STARPU_VECTOR_GET_PTR(buffers[8]) : NULL;
    const bool weights = !flags || mt_codelet_ranged_begin(flags, n, known, last, &a.ra, &a.p, a.stats);
    const float *old = a.deferred ? (const float *)STARPU_VECTOR_GET_PTR(buffers[9]) : NULL;
    mt_adamw_params po = a.po;
    if (old) po.grad_scale *= ((const double *)STARPU_VECTOR_GET_PTR(buffers[10]))[1]; /* as adamw_moments_cpu */
    /* Row by row, so each row's gradient is summed while it is in cache (per element, AdamW
     * does not depend on how the chunk is cut). */
    int64_t flagged = 0;
    for (int64_t r = off / d; r <= (off + n - 1) / d; r++) {
        int64_t b, e;
        mt_cpu_row_part(r, d, off, n, &b, &e);
        if (old) /* master, m and v are the buffers' own: written */
            flagged += mt_cpu_ranged_pass_deferred(b - off, e - b, (float *)master, old, g, (float *)m, (float *)v, w,
                                                   a.dtype, &po, &a.p, a.ra.bounds, weights ? flags : NULL);
        else if (flags && weights)
            flagged += mt_cpu_ranged_pass(b - off, e - b, master, g, m, v, w, a.dtype, &a.p, a.ra.bounds, flags);
        else if (weights) mt_cpu_adamw_weights(b - off, e - b, master, g, m, v, w, a.dtype, &a.p);
        rows[r - off / d] = mt_cpu_row_part_sumsq(g, off, b, e);
    }
    atomic_fetch_add(&a.stats->flagged, (long long)flagged);
    if (flags && weights) {
        atomic_fetch_add(&a.stats->table_checked, (long long)n);
        atomic_fetch_add(&a.stats->table_flagged, (long long)flagged);
    }
    /* counted as AdamW (its row sums ride along) */
    mt_adamw_stats_time(a.stats, MT_AK_TABLE_EARLY, mt_clock_ns() - t0);
}

#if MT_HAVE_CUDA
static void embedding_forward_cuda(void *buffers[], void *cl_arg)
{
    mt_compute_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    mt_cuda_embedding_forward(a.B * a.T, a.model->cfg.hidden, mt_codelet_cuda_prec(a.model->dtype),
                              (const void *)STARPU_VECTOR_GET_PTR(buffers[0]),
                              (const int32_t *)STARPU_VECTOR_GET_PTR(buffers[1]),
                              (float *)STARPU_VECTOR_GET_PTR(buffers[2]), starpu_cuda_get_local_stream());
}

static void embedding_backward_cuda(void *buffers[], void *cl_arg)
{
    mt_compute_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    cudaStream_t stream = starpu_cuda_get_local_stream();
    float *dtable = (float *)STARPU_VECTOR_GET_PTR(buffers[2]);
    size_t n = STARPU_VECTOR_GET_NX(buffers[2]);
    if (!a.accumulate) cudaMemsetAsync(dtable, 0, n * sizeof(float), stream);
    mt_cuda_embedding_backward(a.B * a.T, a.model->cfg.hidden, a.model->cfg.vocab,
                               (const int32_t *)STARPU_VECTOR_GET_PTR(buffers[0]),
                               (const float *)STARPU_VECTOR_GET_PTR(buffers[1]), dtable,
                               (void *)STARPU_VECTOR_GET_PTR(buffers[3]), stream);
    if (a.sumsq) mt_cuda_sumsq_f32(dtable, (int64_t)n, (double *)STARPU_VECTOR_GET_PTR(buffers[4]), stream);
}
#endif

struct starpu_codelet mt_cl_embedding_forward = {
    .name = "embedding_forward",
    .cpu_funcs = { embedding_forward_cpu },
#if MT_HAVE_CUDA
    .cuda_funcs = { embedding_forward_cuda },
    .cuda_flags = { STARPU_CUDA_ASYNC },
#endif
    .nbuffers = 3,
    .modes = { STARPU_R, STARPU_R, STARPU_W },
};

struct starpu_codelet mt_cl_embedding_backward_chunk = {
    .name = "embedding_backward_chunk",
    .cpu_funcs = { embedding_backward_chunk_cpu },
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};

struct starpu_codelet mt_cl_embedding_update_early = {
    .name = "embedding_update_early",
    .cpu_funcs = { embedding_update_early_cpu },
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};

struct starpu_codelet mt_cl_embedding_backward = {
    .name = "embedding_backward",
    .cpu_funcs = { embedding_backward_cpu },
#if MT_HAVE_CUDA
    .cuda_funcs = { embedding_backward_cuda },
    .cuda_flags = { STARPU_CUDA_ASYNC },
#endif
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};
