/* The metrics file read back (mt_metrics_read, what megatrain plot draws): random rows written
 * by mt_metrics_write come back with their values (to the digits the writer keeps), NaN as
 * absent, validation losses where measured, resumed runs' elapsed time added; a bad line is
 * named by file and line number. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/metrics.h"
#include "tests/testutil.h"

/* Rows the writer gets: random values, a validation loss every third step, a NaN loss and a
 * skipped step at row 4, no clipping norm at row 2. */
static void random_rows(mt_test_rng *rng, mt_metrics_row *rows, int n)
{
    for (int i = 0; i < n; i++) {
        rows[i] = (mt_metrics_row){
            .step = 1 + i, .loss = 2 + 5 * mt_test_uniform(rng), .grad_norm = 10 * mt_test_uniform(rng),
            .lr = 1e-3 * mt_test_uniform(rng), .tokens_per_s = 100 + 1e4 * mt_test_uniform(rng),
            .elapsed_s = 0.5 * (i + 1) + 0.1 * mt_test_uniform(rng), .epoch = 0.01 * (i + 1),
            .val_loss = (i + 1) % 3 == 0 ? 2 + 5 * mt_test_uniform(rng) : NAN,
        };
    }
    rows[2].grad_norm = NAN;
    rows[4].loss = NAN;
    rows[4].skipped = true;
}

/* Equal, or both NaN; else within tol relative (the writer's %.1f and %.3f round). */
static void expect_close(const char *what, int64_t step, double got, double want, double tol)
{
    if (isnan(want)) {
        ck_assert_msg(isnan(got), "step %lld %s: %g read, expected absent", (long long)step, what, got);
        return;
    }
    ck_assert_msg(fabs(got - want) <= tol * fabs(want), "step %lld %s: %.17g read, %.17g written", (long long)step,
                  what, got, want);
}

/* Writes rows[from..n) as a run resumed after step `from` (0: a fresh run) does. */
static void write_rows(const char *path, const mt_metrics_row *rows, int from, int n)
{
    char err[512];
    mt_metrics m;
    ck_assert_msg(mt_metrics_open(&m, path, from, err, sizeof err) == 0, "%s", err);
    for (int i = from; i < n; i++) mt_metrics_write(&m, &rows[i]);
    ck_assert_msg(mt_metrics_close(&m, path, err, sizeof err) == 0, "%s", err);
}

START_TEST(test_rows_round_trip)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 20261201);
    enum { N = 40 };
    mt_metrics_row rows[N];
    random_rows(&rng, rows, N);
    const char *path = mt_test_write_temp("m.jsonl", "");
    write_rows(path, rows, 0, N);

    char err[512];
    mt_metrics_row *got;
    int64_t n;
    ck_assert_msg(mt_metrics_read(path, &got, &n, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(n, N);
    for (int i = 0; i < N; i++) {
        const mt_metrics_row *w = &rows[i], *r = &got[i];
        ck_assert_int_eq(r->step, w->step);
        expect_close("loss", w->step, r->loss, w->loss, 1e-15);
        expect_close("grad_norm", w->step, r->grad_norm, w->grad_norm, 1e-15);
        expect_close("lr", w->step, r->lr, w->lr, 1e-15);
        expect_close("tokens_per_s", w->step, r->tokens_per_s, w->tokens_per_s, 1e-3); /* %.1f of >= 100 */
        expect_close("elapsed_s", w->step, r->elapsed_s, w->elapsed_s, 2e-3);          /* %.3f of >= 0.5 */
        expect_close("epoch", w->step, r->epoch, w->epoch, 1e-4);                      /* %.6f of >= 0.01 */
        expect_close("val_loss", w->step, r->val_loss, w->val_loss, 1e-15);
        ck_assert_int_eq(r->skipped, w->skipped);
    }
    free(got);
}
END_TEST

START_TEST(test_resumed_elapsed_adds_up)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 7);
    enum { N = 10 };
    mt_metrics_row rows[N];
    random_rows(&rng, rows, N);
    const char *path = mt_test_write_temp("r.jsonl", "");
    write_rows(path, rows, 0, N);
    /* resumed after step 6: steps 7..10 rewritten, their elapsed time counted from step 6's */
    const double at6_written = rows[5].elapsed_s;
    for (int i = 6; i < N; i++) rows[i].elapsed_s = 0.25 * (i - 5);
    write_rows(path, rows, 6, N);
    char err[512];
    mt_metrics_row *got;
    int64_t n;
    ck_assert_msg(mt_metrics_read(path, &got, &n, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(n, N);
    const double at6 = got[5].elapsed_s;
    expect_close("elapsed_s", 6, at6, at6_written, 2e-3);
    for (int i = 6; i < N; i++) {
        ck_assert_int_eq(got[i].step, i + 1);
        expect_close("resumed elapsed_s", i + 1, got[i].elapsed_s, at6 + 0.25 * (i - 5), 1e-3);
    }
    free(got);
}
END_TEST

/* mt_metrics_read of text fails with a message containing want. */
static void expect_refused(const char *text, const char *want)
{
    const char *path = mt_test_write_temp("bad.jsonl", text);
    char full[512];
    snprintf(full, sizeof full, "%s%s", path, want);
    static mt_metrics_row unset;
    mt_metrics_row *rows = &unset;
    int64_t n = -1;
    char err[512] = "";
    ck_assert_int_eq(mt_metrics_read(path, &rows, &n, err, sizeof err), -1);
    ck_assert_msg(strstr(err, full) != NULL, "'%s' does not contain '%s'", err, full);
    ck_assert_ptr_null(rows);
    ck_assert_int_eq(n, 0);
}

START_TEST(test_bad_lines_named)
{
    expect_refused("{\"step\": 1, \"loss\": 3.5}\n\n{\"step\": 2, \"loss\": 3.4}\n{\"step\": 3, \"lo", ":4: not JSON");
    expect_refused("{\"step\": 1}\n[1, 2]\n", ":2: not a metrics line");
    expect_refused("{\"loss\": 3.5}\n", ":1: not a metrics line");
    expect_refused("{\"step\": 1.5}\n", ":1: not a metrics line");

    char err[512];
    mt_metrics_row *rows;
    int64_t n;
    ck_assert_int_eq(mt_metrics_read("/nonexistent/m.jsonl", &rows, &n, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "/nonexistent/m.jsonl: cannot open") != NULL, "%s", err);
    /* no line: no error, no rows */
    const char *empty = mt_test_write_temp("empty.jsonl", "\n  \n");
    ck_assert_int_eq(mt_metrics_read(empty, &rows, &n, err, sizeof err), 0);
    ck_assert_int_eq(n, 0);
    free(rows);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("plot_read");
    TCase *tc = tcase_create("plot_read");
    tcase_add_test(tc, test_rows_round_trip);
    tcase_add_test(tc, test_resumed_elapsed_adds_up);
    tcase_add_test(tc, test_bad_lines_named);
    suite_add_tcase(s, tc);
    return mt_test_run(s, false);
}
