/* The norm history and the prediction of ranged speculation (history.h). */
#include "runtime/speculate/history.h"

#include <math.h>
#include <string.h>

#include "codelets/clip.h"

/* A record: this header, then sums (ntiles + 1 doubles), then held (ntiles bytes). */
typedef struct record {
    int32_t ntiles;
    mt_norm_settings s;
    int64_t seq;                          /* the norm it holds; 0: none */
    double next_spread;                   /* the spread of the ranged runs of norm seq + 1 (0: s.spread) */
    double worst[MT_NORM_MEMORY_MAX];     /* worst[n % MAX]: norm n's prediction's largest error over
                                           * the tiles (>= 1), when worst_seq there is n */
    int64_t worst_seq[MT_NORM_MEMORY_MAX];
} record;

static double *sums_of(record *r) { return (double *)(r + 1); }
static const double *csums_of(const record *r) { return (const double *)(r + 1); }
static uint8_t *held_of(record *r) { return (uint8_t *)(sums_of(r) + r->ntiles + 1); }
static const uint8_t *cheld_of(const record *r) { return (const uint8_t *)(csums_of(r) + r->ntiles + 1); }

size_t mt_norm_record_bytes(int ntiles)
{
    return sizeof(record) + sizeof(double) * (size_t)(ntiles + 1) + (size_t)ntiles;
}

void mt_norm_record_init(void *rec, int ntiles, const mt_norm_settings *s)
{
    memset(rec, 0, mt_norm_record_bytes(ntiles));
    record *r = rec;
    r->ntiles = ntiles;
    r->s = *s;
}

int64_t mt_norm_record_seq(const void *rec) { return ((const record *)rec)->seq; }
const double *mt_norm_record_sums(const void *rec) { return csums_of(rec); }
const uint8_t *mt_norm_record_held(const void *rec) { return cheld_of(rec); }
double mt_norm_record_next_spread(const void *rec) { return ((const record *)rec)->next_spread; }

/* The rest of norm prev + 1's square a ranged run of tile first_tile predicts from the record of
 * norm prev, knowing S_known = `known` and the table's head part `head_table` (mt_ranged_args):
 * the tiles before first_tile then, times the ratio of what is known now to the same sums then. */
static double predicted_rest(const record *prev, int first_tile, bool with_head, double known, double head_table)
{
    const double *hs = csums_of(prev);
    double same = with_head ? hs[prev->ntiles] : 0, other = 0;
    for (int j = 0; j < prev->ntiles; j++) {
        if (j >= first_tile) same += hs[j];
        else other += hs[j];
    }
    const double seen = known + (with_head ? head_table : 0);
    return same > 0 ? other * (seen / same) : other;
}

/* The range of clip scales [*c_lo, *c_hi] for a rest of the norm's square predicted as `rest`,
 * within `spread` times either way, the tiles in adding `known`. */
static void scale_range(double clip, double known, double rest, double spread, double *c_lo, double *c_hi)
{
    *c_hi = mt_clip_scale(clip, sqrt(known + rest / spread));
    *c_lo = mt_clip_scale(clip, sqrt(known + rest * spread));
}

/* The spread of the ranged runs of the norm after prev's. */
static double spread_after(const record *prev)
{
    const double s = prev->next_spread;
    return s > 1 ? s : prev->s.spread;
}

void mt_norm_record(const void *last_rec, void *rec, int64_t seq, double clip, const double *sums, int ntiles,
                    double head_table, void *log)
{
    const record *last = last_rec;
    record *r = rec;
    /* the settings and the errors of the norms before, then this norm's own */
    memcpy(r, last, sizeof *r);
    double *now = sums_of(r);
    memcpy(now, sums, sizeof(double) * (size_t)ntiles);
    now[ntiles] = head_table;
    const int64_t prev = seq - 1;
    const bool history = prev >= 1 && last->seq == prev;
    uint8_t *held = held_of(r);
    double total = 0;
    for (int j = 0; j < ntiles; j++) total += now[j];
    const double scale = mt_clip_scale(clip, sqrt(total));
    const bool with_head = now[ntiles] != 0;
    const double spread = history ? spread_after(last) : r->s.spread;
    double known = 0; /* tiles f..ntiles-1, as a run of tile f knows them */
    double worst = 1; /* the prediction's largest error over the tiles */
    for (int f = ntiles - 1; f >= 0; f--) {
        known += now[f];
        held[f] = 1;
        if (!history) continue;
        const double rest = predicted_rest(last, f, with_head, known, now[ntiles]);
        double actual = 0; /* the rest as it came: tiles 0..f-1 */
        for (int j = 0; j < f; j++) actual += now[j];
        /* mt_norm_range's range for this tile, without the roundings' widening */
        double c_lo, c_hi;
        scale_range(clip, known, rest, spread, &c_lo, &c_hi);
        held[f] = scale >= c_lo * (1 - 1e-6) && scale <= c_hi * (1 + 1e-6);
        if (f > 0) worst = fmax(worst, rest > 0 && actual > 0 ? fmax(actual / rest, rest / actual)
                                       : rest == actual ? 1 : INFINITY);
    }
    if (history) {
        r->worst[seq % MT_NORM_MEMORY_MAX] = worst;
        r->worst_seq[seq % MT_NORM_MEMORY_MAX] = seq;
    }
    /* the largest error over the last `memory` norms judged (norms without one count 1) */
    const int memory = r->s.memory < 1 ? 1 : r->s.memory > MT_NORM_MEMORY_MAX ? MT_NORM_MEMORY_MAX : r->s.memory;
    double recent = 1;
    for (int64_t s = seq; s > seq - memory && s >= 1; s--)
        if (r->worst_seq[s % MT_NORM_MEMORY_MAX] == s) recent = fmax(recent, r->worst[s % MT_NORM_MEMORY_MAX]);
    r->next_spread = r->s.grow > r->s.spread ? fmin(r->s.spread * recent, r->s.grow) : r->s.spread;
    r->seq = seq;
    if (log) {
        const int64_t *head = log;
        const int64_t from = head[0], cap = head[1];
        const int64_t row = seq - 1 - from;
        if (row >= 0 && row < cap)
            memcpy((double *)(head + 2) + row * (ntiles + 1), now, sizeof(double) * (size_t)(ntiles + 1));
    }
}

int mt_norm_range(const mt_ranged_args *a, const void *last_rec, double known, double head_table, double grad_scale,
                  double *lo, double *hi)
{
    const record *last = last_rec;
    /* every tile's sum adds to the norm: it is at least sqrt(known), the scale at most this */
    double c_hi = mt_clip_scale(a->clip, sqrt(known)), c_lo;
    const int64_t prev = a->seq - 1;
    const bool history = last && prev >= 1 && last->seq == prev;
    double max_ratio = a->max_ratio;
    if (history) {
        const double rest = predicted_rest(last, a->first_tile, a->head_table, known, head_table);
        const double spread = spread_after(last);
        scale_range(a->clip, known, rest, spread, &c_lo, &c_hi);
        max_ratio *= spread / last->s.spread;
    } else {
        c_hi = fmin(c_hi, a->hi);
        c_lo = fmin(a->lo, c_hi);
    }
    *lo = grad_scale * c_lo * (1 - 1e-6);
    *hi = grad_scale * c_hi * (1 + 1e-6);
    if (c_hi > c_lo * max_ratio) return MT_RANGE_WIDE;
    if (history && a->check && !cheld_of(last)[a->first_tile]) return MT_RANGE_UNHELD;
    return MT_RANGE_NARROW;
}

/* A log: from, cap, then the rows. */
size_t mt_norm_log_bytes(int ntiles, int64_t cap)
{
    return 2 * sizeof(int64_t) + sizeof(double) * (size_t)cap * (size_t)(ntiles + 1);
}

void mt_norm_log_init(void *log, int ntiles, int64_t from, int64_t cap)
{
    memset(log, 0, mt_norm_log_bytes(ntiles, cap));
    int64_t *head = log;
    head[0] = from;
    head[1] = cap;
}

const double *mt_norm_log_rows(const void *log) { return (const double *)((const int64_t *)log + 2); }
