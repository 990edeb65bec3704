/* Token embedding as StarPU tasks: forward gathers rows of the table, backward scatters the
 * gradient into the table's gradient (and, last in the step, its sum of squares). */
#include "codelets/codelets.h"

#include <stdlib.h>
#include <string.h>

#include "mt_build_config.h"
#if MT_HAVE_CUDA
#include "backends/cuda/kernels.h"
#endif

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
    for (int64_t r = 0; r < ntok; r++) mt_bf16_to_f32(d, table + (int64_t)tokens[r] * d, h0 + r * d);
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
    if (a.sumsq) *(double *)STARPU_VECTOR_GET_PTR(buffers[4]) = mt_codelet_tile_sumsq(&a.st->tiles[0], dtable, d);
}

/* Sum of squares of one row's part [b, e) of a chunk starting at `off`: the unit every path adds
 * up in the same order. */
static double row_part_sumsq(const float *g, int64_t off, int64_t b, int64_t e)
{
    return mt_cpu_sumsq_f32(e - b, g + (b - off));
}

/* Row r's part of the chunk [off, off + n) of a table with rows of d elements. */
static void row_part(int64_t r, int64_t d, int64_t off, int64_t n, int64_t *b, int64_t *e)
{
    *b = r * d > off ? r * d : off;
    *e = r * d + d < off + n ? r * d + d : off + n;
}

void mt_codelet_chunk_row_sumsq(const float *g, int64_t off, int64_t n, int64_t d, double *rows)
{
    const int64_t lo = off / d, hi = (off + n - 1) / d;
    for (int64_t r = lo; r <= hi; r++) {
        int64_t b, e;
        row_part(r, d, off, n, &b, &e);
        rows[r - lo] = row_part_sumsq(g, off, b, e);
    }
}

double mt_codelet_sum_rows(const double *rows, int64_t nrows)
{
    double s = 0;
    for (int64_t i = 0; i < nrows; i++) s += rows[i];
    return s;
}

double mt_codelet_tile_sumsq(const mt_tile *t, const float *grad, int64_t d)
{
    double s = 0;
    int64_t cap = 0;
    double *rows = NULL;
    for (int c = 0; c < t->nchunks; c++) {
        const int64_t off = t->chunks[c].offset, n = t->chunks[c].numel, nrows = mt_codelet_chunk_rows(off, n, d);
        if (nrows > cap) rows = realloc(rows, sizeof *rows * (size_t)(cap = nrows));
        mt_codelet_chunk_row_sumsq(grad + off, off, n, d, rows);
        s += mt_codelet_sum_rows(rows, nrows);
    }
    free(rows);
    return s;
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
            row_part(row, d, off, n, &b, &e);
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
        row_part(row, d, off, n, &b, &e);
        if (flags) mt_codelet_ranged_flag(b - off, e - b, flags), nflag += e - b;
        else mt_codelet_adamw_params_range(b - off, e - b, master, g, m, v, w, a.dtype, &a.p);
        if (rows) rows[row - lo] = row_part_sumsq(g, off, b, e);
    }
    free(touched);
    if (nflag) mt_codelet_ranged_table_add(0, 0, nflag);
    if (a.sumsq) *(double *)STARPU_VECTOR_GET_PTR(buffers[6 + 2 * a.micro_batches]) = mt_codelet_sum_rows(rows, hi - lo + 1);
}

/* The weights half of AdamW on one chunk of the table, as adamw_params, and the sums of squares
 * of the chunk's rows (of the gradient as it is then: the head's part), for the early path's
 * embedding backward to finish: [0] master R, [1] m R, [2] v R, [3] gradient R, [4] streamed
 * weights W, [5] row sums W. Args: mt_embed_chunk_args. Deferred (a.deferred): the last
 * update's moments half first, in the same pass (mt_codelet_ranged_pass_deferred): master, m and
 * v RW, then [8] the last update's gradient R and [9] its clip buffer R. */
static void embedding_update_early_cpu(void *buffers[], void *cl_arg)
{
    const int64_t t0 = mt_codelet_now_ns();
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
    const bool weights = !flags || mt_codelet_ranged_begin(flags, n, known[0], known[1], &a.ra, &a.p);
    const float *old = a.deferred ? (const float *)STARPU_VECTOR_GET_PTR(buffers[8]) : NULL;
    mt_adamw_params po = a.po;
    if (old) po.grad_scale *= ((const double *)STARPU_VECTOR_GET_PTR(buffers[9]))[1]; /* as adamw_moments_cpu */
    /* Row by row, so each row's gradient is summed while it is in cache (per element, AdamW
     * does not depend on how the chunk is cut). */
    int64_t flagged = 0;
    for (int64_t r = off / d; r <= (off + n - 1) / d; r++) {
        int64_t b, e;
        row_part(r, d, off, n, &b, &e);
        if (old) /* master, m and v are the buffers' own: written */
            flagged += mt_codelet_ranged_pass_deferred(b - off, e - b, (float *)master, old, g, (float *)m, (float *)v, w,
                                                       a.dtype, &po, &a.p, weights ? flags : NULL);
        else if (flags && weights) flagged += mt_codelet_ranged_pass(b - off, e - b, master, g, m, v, w, a.dtype, &a.p, flags);
        else if (weights) mt_codelet_adamw_params_range(b - off, e - b, master, g, m, v, w, a.dtype, &a.p);
        rows[r - off / d] = row_part_sumsq(g, off, b, e);
    }
    if (flags && weights) mt_codelet_ranged_table_add(n, flagged, 0);
    mt_codelet_adamw_time_add(MT_AK_TABLE_EARLY, mt_codelet_now_ns() - t0); /* counted as AdamW (its row sums ride along) */
}

static void sum_partials_cpu(void *buffers[], void *cl_arg)
{
    (void)cl_arg;
    unsigned n = STARPU_TASK_GET_NBUFFERS(starpu_task_get_current()) - 1;
    double s = 0;
    for (unsigned i = 0; i < n; i++) s += *(const double *)STARPU_VECTOR_GET_PTR(buffers[i]);
    *(double *)STARPU_VECTOR_GET_PTR(buffers[n]) = s;
}

#if MT_HAVE_CUDA
static void embedding_forward_cuda(void *buffers[], void *cl_arg)
{
    mt_compute_args a;
    starpu_codelet_unpack_args(cl_arg, &a);
    mt_cuda_embedding_forward(a.B * a.T, a.st->cfg.hidden, mt_codelet_cuda_prec(a.st->compute_dtype),
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
    mt_cuda_embedding_backward(a.B * a.T, a.st->cfg.hidden, a.st->cfg.vocab,
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

struct starpu_codelet mt_cl_sum_partials = {
    .name = "sum_partials",
    .cpu_funcs = { sum_partials_cpu },
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};

/* Mode of the gradient is given at insertion (W on the step's first write, RW after). */
struct starpu_codelet mt_cl_embedding_backward = {
    .name = "embedding_backward",
    .cpu_funcs = { embedding_backward_cpu },
#if MT_HAVE_CUDA
    .cuda_funcs = { embedding_backward_cuda },
    .cuda_flags = { STARPU_CUDA_ASYNC },
#endif
    .nbuffers = STARPU_VARIABLE_NBUFFERS,
};
