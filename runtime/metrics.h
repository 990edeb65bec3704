/* A training run's metrics file (--metrics): one JSON object a line, one line a step, flushed as
 * written, for plotting and for tools that follow a run. Keys: step, loss, grad_norm (null
 * without clipping), lr, tokens_per_s (this step's), elapsed_s (since the run began, resumes
 * counted), epoch (passes over the training data), val_loss (when measured at that step),
 * skipped (true when the step's update was skipped, --on-nonfinite skip). NaN and infinities are
 * written as null. */
#ifndef MT_RUNTIME_METRICS_H
#define MT_RUNTIME_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef struct mt_metrics_row {
    int64_t step;
    double loss, grad_norm, lr, tokens_per_s, elapsed_s, epoch;
    double val_loss;   /* NAN: not measured at this step */
    bool skipped;
} mt_metrics_row;

typedef struct mt_metrics {
    FILE *f;
    double elapsed_before;  /* elapsed_s of the last line kept from the run resumed */
} mt_metrics;

/* Opens path for a run that starts after step `resumed` (0: a fresh run, the file is
 * truncated). A resumed run keeps the lines of steps up to `resumed` (the checkpoint's; later
 * ones were lost with the run that wrote them) and appends. 0, or -1 with err naming the file. */
int mt_metrics_open(mt_metrics *m, const char *path, int64_t resumed, char *err, size_t errlen);

/* Writes one line and flushes it. */
void mt_metrics_write(mt_metrics *m, const mt_metrics_row *row);

/* Closes the file; 0, or -1 with err when a write failed. Safe on a zeroed one. */
int mt_metrics_close(mt_metrics *m, const char *path, char *err, size_t errlen);

/* Reads a metrics file back (megatrain plot): *rows gets one entry a line, in file order, to free();
 * a key absent or null reads as NAN (val_loss too), skipped as false; blank lines are skipped.
 * 0, or -1 with err naming the file, and the line for a line that is not a JSON object with an
 * integer "step". A file of no line is no error (*n = 0). */
int mt_metrics_read(const char *path, mt_metrics_row **rows, int64_t *n, char *err, size_t errlen);

#endif
