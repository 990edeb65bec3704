/* The table gradient's sum of squares in its fixed order (table_sumsq.h). */
#include "backends/cpu/table_sumsq.h"

#include <stdlib.h>

#include "backends/cpu/ops.h"

double mt_cpu_row_part_sumsq(const float *g, int64_t off, int64_t b, int64_t e)
{
    return mt_cpu_sumsq_f32(e - b, g + (b - off));
}

void mt_cpu_chunk_row_sumsq(const float *g, int64_t off, int64_t n, int64_t d, double *rows)
{
    const int64_t lo = off / d, hi = (off + n - 1) / d;
    for (int64_t r = lo; r <= hi; r++) {
        int64_t b, e;
        mt_cpu_row_part(r, d, off, n, &b, &e);
        rows[r - lo] = mt_cpu_row_part_sumsq(g, off, b, e);
    }
}

double mt_cpu_sum_rows(const double *rows, int64_t nrows)
{
    double s = 0;
    for (int64_t i = 0; i < nrows; i++) s += rows[i];
    return s;
}

double mt_cpu_table_sumsq(const int64_t *chunks, int nchunks, const float *grad, int64_t d)
{
    double s = 0;
    int64_t cap = 0;
    double *rows = NULL;
    for (int c = 0; c < nchunks; c++) {
        const int64_t off = chunks[c], n = chunks[c + 1] - chunks[c], nrows = mt_cpu_chunk_rows(off, n, d);
        if (nrows > cap) rows = realloc(rows, sizeof *rows * (size_t)(cap = nrows));
        mt_cpu_chunk_row_sumsq(grad + off, off, n, d, rows);
        s += mt_cpu_sum_rows(rows, nrows);
    }
    free(rows);
    return s;
}
