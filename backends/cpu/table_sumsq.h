/* The sum of squares of the table's gradient (rows of d elements, cut into AdamW chunks) as every
 * CPU path forms it, so that they give the same bits: per chunk, per row part in double, the
 * rows added in order, then the chunks in order. The plain embedding backward sums the whole
 * table so; the table's early update path sums the rows as it goes and redoes the touched ones. */
#ifndef MT_BACKENDS_CPU_TABLE_SUMSQ_H
#define MT_BACKENDS_CPU_TABLE_SUMSQ_H

#include <stdint.h>

/* Rows of d elements that overlap the chunk [off, off + n). */
static inline int64_t mt_cpu_chunk_rows(int64_t off, int64_t n, int64_t d) { return (off + n - 1) / d - off / d + 1; }

/* Row r's part [*b, *e) of the chunk [off, off + n). */
static inline void mt_cpu_row_part(int64_t r, int64_t d, int64_t off, int64_t n, int64_t *b, int64_t *e)
{
    *b = r * d > off ? r * d : off;
    *e = r * d + d < off + n ? r * d + d : off + n;
}

/* Sum of squares of one row's part [b, e) of a chunk starting at `off` (g at the chunk's start):
 * the unit every path adds up in the same order. */
double mt_cpu_row_part_sumsq(const float *g, int64_t off, int64_t b, int64_t e);
/* rows[i] = sum of squares of row (off / d + i)'s part of the chunk g = [off, off + n). */
void mt_cpu_chunk_row_sumsq(const float *g, int64_t off, int64_t n, int64_t d, double *rows);
/* The chunk's sum of squares from its nrows row sums, in row order. */
double mt_cpu_sum_rows(const double *rows, int64_t nrows);
/* The whole table's, grad at its start, chunk c being [chunks[c], chunks[c + 1]). */
double mt_cpu_table_sumsq(const int64_t *chunks, int nchunks, const float *grad, int64_t d);

#endif
