/* The norm history ranged speculation predicts from, and the prediction (docs/design.md).
 *
 * A ranged run of a tile's chunk, for norm s, runs as the tile's gradient lands, before the norm
 * is known. The gradients already in bound the norm from below; the rest of its square is
 * predicted from norm s - 1: the tiles not yet in then, times the ratio of what is in now to the
 * same tiles' sums then. The run checks the range of clip scales that a rest within `spread`
 * times of the prediction (either way) allows.
 *
 * The history is two records, StarPU vectors of bytes owned by the graph: the clip task of norm s
 * writes record s % 2 from record (s - 1) % 2 (mt_norm_record, which the clip codelet is given),
 * and the ranged runs of norm s read record (s - 1) % 2 (mt_norm_range, which the AdamW codelets
 * are given). Reading the other record costs the ranged runs no wait: the clip task of norm s - 1
 * has ended before any of them can run (their gradients come from a backward that needed the
 * update that needed that norm), and the clip task of norm s + 1, which writes their record
 * again, waits for them anyway (it needs the next backward, which needs their weights). A record
 * holds its settings, so the tasks need nothing else. */
#ifndef MT_RUNTIME_SPECULATE_HISTORY_H
#define MT_RUNTIME_SPECULATE_HISTORY_H

#include <stddef.h>
#include <stdint.h>

#include "codelets/adamw.h"

/* How far back the spread looks (mt_norm_settings.memory). */
#define MT_NORM_MEMORY_MAX 16

typedef struct mt_norm_settings {
    double spread;         /* the ranged runs' spread at least */
    double grow;           /* > spread: the runs of norm s + 1 take spread times the largest error
                            * of the predictions of norms s - memory + 1 .. s (actual rest over the
                            * predicted one, or the inverse, over the tiles), up to grow: a norm
                            * that moves more than the prediction follows widens the next ranges.
                            * <= spread: fixed */
    int memory;            /* 1..MT_NORM_MEMORY_MAX (0: 1): errors come in runs of several norms,
                            * so one norm that the prediction followed does not narrow the ranges
                            * back at once */
} mt_norm_settings;

/* A record of a graph of ntiles tiles, and one that holds no norm yet. */
size_t mt_norm_record_bytes(int ntiles);
void mt_norm_record_init(void *record, int ntiles, const mt_norm_settings *s);

/* Records norm seq from the record of norm seq - 1 (mt_norm_record_fn, codelets/clip.h): the
 * tiles' sums (ntiles) and the table's head part (tied, ranged; else 0); for each tile f, whether
 * the range a ranged run of f would have had for this norm, predicted from the last, held (its
 * scale was inside; all held without a last norm); the spread of the next norm's runs; and the
 * sums into the log, when given one. */
void mt_norm_record(const void *last, void *record, int64_t seq, double clip, const double *sums, int ntiles,
                    double head_table, void *log);

/* The range of a ranged run (mt_range_fn, codelets/adamw.h) from the record of norm a->seq - 1:
 * the rest predicted within the record's spread either way, the ratio a->max_ratio widened as
 * much as the spread grew over its floor; without that norm, a->lo .. a->hi capped by the bound.
 * Widened past the float rounding of the scale the kernel forms and the order of the sums, so
 * that the scale falls inside whenever the prediction held. */
int mt_norm_range(const mt_ranged_args *a, const void *last, double known, double head_table, double grad_scale,
                  double *lo, double *hi);

/* What a record says: its norm (0: none), the sums (ntiles + 1: the tiles', then the head part),
 * each tile's held, and the spread of the runs of the next norm. */
int64_t mt_norm_record_seq(const void *record);
const double *mt_norm_record_sums(const void *record);
const uint8_t *mt_norm_record_held(const void *record);
double mt_norm_record_next_spread(const void *record);

/* A log of the records of norms from + 1 .. from + cap (a StarPU vector the clip tasks update):
 * norm s's sums at row s - 1 - from, ntiles + 1 doubles a row. */
size_t mt_norm_log_bytes(int ntiles, int64_t cap);
void mt_norm_log_init(void *log, int ntiles, int64_t from, int64_t cap);
const double *mt_norm_log_rows(const void *log);

#endif
