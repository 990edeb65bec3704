/* The training job end to end: the tiny byte-level model learns the fortunes corpus and two runs
 * with one seed give bitwise the same losses; corpus and config errors name the path and the
 * reason; the learning-rate schedule; batch sampling. */
#include <check.h>
#include <errno.h>
#include <libgen.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "models/util.h"
#include "runtime/data.h"
#include "runtime/train.h"
#include "tests/testutil.h"

#define FORTUNES "/usr/share/games/fortunes"
#define LN_256 5.545177444479562

/* Measured with short_run() (2 CPU workers, eager, fp32): training loss 5.563 -> 3.313 after 50
 * steps (mean of the last 10: 3.29), validation 5.516 -> 3.129. The bounds leave 0.3 nats of
 * margin; step-to-step noise at the plateau is about +-0.15. */
#define TRAIN_LOSS_BOUND 3.65
#define TRAIN_LAST10_BOUND 3.6

/* A short run of the built-in tiny model: 50 steps of 8 x 64 tokens, fixed seed. */
static mt_train_options short_run(void)
{
    mt_train_options o = mt_train_defaults();
    o.config_path = mt_test_source_path("models/configs/tiny-byte.json");
    o.data_path = FORTUNES;
    o.steps = 50;
    o.step.B = 8;
    o.step.T = 64;
    o.step.K = 2;
    o.lr = 2e-3;
    o.warmup = 5;
    o.eval_every = 0;
    o.eval_sequences = 16;
    o.sample_bytes = 0;
    o.seed = 20240611;
    o.runtime = (mt_runtime_options){ .sched = "eager", .ncpu = 2, .ncuda = 0 };
    return o;
}

/* ---- the training run ------------------------------------------------------------------- */

START_TEST(test_train_learns_and_repeats)
{
    mt_train_options o = short_run();
    mt_train_result r1, r2;
    char err[1024] = "";
    FILE *devnull = fopen("/dev/null", "w");
    ck_assert_ptr_nonnull(devnull);

    double t0 = mt_clock_s();
    ck_assert_msg(mt_train_run(&o, &r1, devnull, err, sizeof err) == 0, "first run: %s", err);
    double t1 = mt_clock_s();
    ck_assert_msg(mt_train_run(&o, &r2, NULL, err, sizeof err) == 0, "second run: %s", err);
    double t2 = mt_clock_s();
    fclose(devnull);

    fprintf(stderr, "train: loss %.4f -> %.4f, val %.4f -> %.4f, %.1f s and %.1f s per run (bound %.2f)\n",
            r1.first_loss, r1.last_loss, r1.first_val, r1.last_val, t1 - t0, t2 - t1, TRAIN_LOSS_BOUND);
    fprintf(stderr, "train: losses");
    for (int s = 0; s < r1.steps_done; s++) fprintf(stderr, " %.3f", r1.losses[s]);
    fprintf(stderr, "\n");

    ck_assert_int_eq(r1.steps_done, 50);
    ck_assert_int_eq(r2.steps_done, 50);
    ck_assert_ptr_nonnull(r1.losses);
    for (int s = 0; s < 50; s++) ck_assert_msg(isfinite(r1.losses[s]), "loss of step %d is %g", s + 1, r1.losses[s]);
    ck_assert(r1.first_loss == r1.losses[0]);
    ck_assert(r1.last_loss == r1.losses[49]);
    /* An untrained byte model is near uniform over 256 bytes. */
    ck_assert_msg(fabs(r1.first_loss - LN_256) < 0.5, "first loss %g, expected about ln 256 = %g", r1.first_loss, LN_256);
    ck_assert_msg(fabs(r1.first_val - LN_256) < 0.5, "first validation loss %g, expected about %g", r1.first_val, LN_256);
    ck_assert_msg(r1.last_loss < TRAIN_LOSS_BOUND, "final training loss %g, expected < %g", r1.last_loss, TRAIN_LOSS_BOUND);
    double last10 = 0;
    for (int s = 40; s < 50; s++) last10 += r1.losses[s] / 10;
    ck_assert_msg(last10 < TRAIN_LAST10_BOUND, "mean loss of steps 41-50 %g, expected < %g", last10, TRAIN_LAST10_BOUND);
    ck_assert_msg(r1.losses[9] < r1.losses[0] - 1.0, "loss of step 10 %g, of step 1 %g: no progress", r1.losses[9], r1.losses[0]);
    ck_assert_msg(r1.last_val < r1.first_val - 1.0, "validation loss %g -> %g did not drop by a nat", r1.first_val, r1.last_val);
    ck_assert_msg(isfinite(r1.seconds) && r1.seconds > 0 && r1.tokens_per_second > 0, "timing %g s, %g tok/s",
                  r1.seconds, r1.tokens_per_second);

    /* Same seed, same graph: the same losses to the bit, whatever order the workers ran tasks in. */
    int first_diff = -1;
    for (int s = 0; s < 50 && first_diff < 0; s++)
        if (memcmp(&r1.losses[s], &r2.losses[s], sizeof(double)) != 0) first_diff = s;
    ck_assert_msg(first_diff < 0, "runs differ first at step %d: %.17g vs %.17g", first_diff + 1,
                  first_diff < 0 ? 0.0 : r1.losses[first_diff], first_diff < 0 ? 0.0 : r2.losses[first_diff]);
    ck_assert(memcmp(r1.losses, r2.losses, 50 * sizeof(double)) == 0);
    ck_assert(memcmp(&r1.last_val, &r2.last_val, sizeof(double)) == 0);
    free(r1.losses);
    free(r2.losses);
}
END_TEST

/* ---- corpus loading --------------------------------------------------------------------- */

/* A path to an existing file of n bytes (in its own temporary directory); caller frees. */
static char *temp_file_of(const char *name, size_t n)
{
    char *text = malloc(n + 1);
    for (size_t i = 0; i < n; i++) text[i] = (char)('a' + i % 26);
    text[n] = 0;
    char *path = strdup(mt_test_write_temp(name, text));
    free(text);
    return path;
}

/* mt_corpus_load fails with a message that names the path and contains `reason`, and
 * mt_train_run on the same data fails with that same message. */
static void expect_corpus_error(const char *path, const char *reason)
{
    mt_corpus c;
    char err[1024] = "";
    ck_assert_msg(mt_corpus_load(path, 10, 65 * 4, &c, err, sizeof err) == -1, "%s: loaded", path);
    ck_assert_msg(strstr(err, path) != NULL, "message does not name %s: '%s'", path, err);
    ck_assert_msg(strstr(err, reason) != NULL, "message for %s does not say '%s': '%s'", path, reason, err);
    ck_assert_ptr_null(c.train);
    ck_assert_ptr_null(c.val);

    mt_train_options o = short_run();
    o.data_path = path;
    mt_train_result r;
    char terr[1024] = "";
    ck_assert_int_eq(mt_train_run(&o, &r, NULL, terr, sizeof terr), -1);
    ck_assert_msg(strcmp(terr, err) == 0, "mt_train_run said '%s', mt_corpus_load '%s'", terr, err);
    ck_assert_int_eq(r.steps_done, 0);
    free(r.losses);
}

START_TEST(test_corpus_empty_file)
{
    char *p = temp_file_of("empty.txt", 0);
    expect_corpus_error(p, "empty");
    free(p);
}
END_TEST

START_TEST(test_corpus_truncated_file)
{
    /* Shorter than one window of T+1 = 65 bytes. */
    char *p = temp_file_of("short.txt", 7);
    expect_corpus_error(p, "too small");
    free(p);
    /* Enough training bytes but no validation block (a file shorter than 10 blocks). */
    p = temp_file_of("one-block.txt", 5000);
    expect_corpus_error(p, "too small");
    free(p);
}
END_TEST

START_TEST(test_corpus_missing)
{
    expect_corpus_error("/nonexistent/megatrain-corpus.txt", strerror(ENOENT));
}
END_TEST

START_TEST(test_corpus_not_a_directory)
{
    /* A path through a regular file: stat fails with ENOTDIR (mode 000 would not stop root). */
    expect_corpus_error("/etc/passwd/x", strerror(ENOTDIR));
}
END_TEST

START_TEST(test_corpus_directory_without_text)
{
    /* Only a fortune index file and a subdirectory: nothing to read. */
    char *p = strdup(mt_test_write_temp("index.dat", "not text"));
    char *dir = dirname(p);
    char sub[4200];
    snprintf(sub, sizeof sub, "%s/subdir", dir);
    ck_assert_int_eq(mkdir(sub, 0755), 0);
    expect_corpus_error(dir, "no text files");
    free(p);
}
END_TEST

START_TEST(test_corpus_directory_with_empty_files)
{
    char *p = strdup(mt_test_write_temp("a.txt", ""));
    expect_corpus_error(dirname(p), "empty");
    free(p);
}
END_TEST

START_TEST(test_corpus_fortunes_split)
{
    mt_corpus c;
    char err[1024] = "";
    ck_assert_msg(mt_corpus_load(FORTUNES, 10, 65 * 4, &c, err, sizeof err) == 0, "%s", err);
    ck_assert_int_gt(c.nfiles, 1);
    ck_assert_int_gt(c.nval, 0);
    /* Every 10th 4 KiB block goes to validation: about a tenth of the bytes. */
    double frac = (double)c.nval / (double)(c.ntrain + c.nval);
    ck_assert_msg(frac > 0.09 && frac < 0.11, "validation fraction %g", frac);
    mt_corpus_free(&c);
    ck_assert_ptr_null(c.train);

    /* A directory and the same bytes as one file load the same. */
    char *p = temp_file_of("plain.txt", 50000);
    mt_corpus a, b;
    ck_assert_msg(mt_corpus_load(p, 10, 100, &a, err, sizeof err) == 0, "%s", err);
    char *dir = strdup(p);
    ck_assert_msg(mt_corpus_load(dirname(dir), 10, 100, &b, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(a.ntrain + a.nval, 50000);
    ck_assert_int_eq(a.nval, 4096); /* blocks 0..12, block 9 is validation */
    ck_assert_int_eq(a.ntrain, b.ntrain);
    ck_assert_int_eq(a.nval, b.nval);
    ck_assert(memcmp(a.train, b.train, a.ntrain) == 0);
    ck_assert(memcmp(a.val, b.val, a.nval) == 0);
    mt_corpus_free(&a);
    mt_corpus_free(&b);
    free(p);
    free(dir);
}
END_TEST

START_TEST(test_train_bad_config)
{
    mt_train_options o = short_run();
    o.config_path = "/nonexistent/config.json";
    mt_train_result r;
    char err[1024] = "";
    ck_assert_int_eq(mt_train_run(&o, &r, NULL, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "/nonexistent/config.json") != NULL, "message does not name the config: '%s'", err);

    /* A config that parses but is invalid. */
    char *p = strdup(mt_test_write_temp("config.json", "{\"model_type\": \"llama\", \"hidden_size\": 100}"));
    o.config_path = p;
    err[0] = 0;
    ck_assert_int_eq(mt_train_run(&o, &r, NULL, err, sizeof err), -1);
    ck_assert_msg(strstr(err, p) != NULL, "message does not name %s: '%s'", p, err);
    free(p);

    /* A vocabulary too small for bytes. */
    p = strdup(mt_test_write_temp("config.json",
        "{\"model_type\": \"llama\", \"hidden_size\": 64, \"intermediate_size\": 128, \"num_hidden_layers\": 1,"
        " \"num_attention_heads\": 2, \"vocab_size\": 100, \"max_position_embeddings\": 128}"));
    o.config_path = p;
    err[0] = 0;
    ck_assert_int_eq(mt_train_run(&o, &r, NULL, err, sizeof err), -1);
    ck_assert_msg(strstr(err, p) && strstr(err, "vocab_size"), "message: '%s'", err);
    free(p);
}
END_TEST

/* ---- learning-rate schedule ------------------------------------------------------------- */

START_TEST(test_lr_schedule)
{
    mt_train_options o = mt_train_defaults();
    o.lr = 1e-3;
    o.min_lr_ratio = 0.1;
    o.warmup = 10;
    o.steps = 110;
    o.schedule = MT_LR_COSINE;
    const double tol = 1e-15;
    /* Linear warm-up reaching the peak at step `warmup`. */
    for (int s = 1; s <= 10; s++)
        ck_assert_double_eq_tol(mt_lr_at(&o, s), 1e-3 * s / 10, tol);
    /* Cosine: half-way between peak and floor at mid-decay, floor at the last step and after. */
    ck_assert_double_eq_tol(mt_lr_at(&o, 60), 1e-4 + 0.5 * 9e-4, tol);
    ck_assert_double_eq_tol(mt_lr_at(&o, 35), 1e-4 + 0.5 * 9e-4 * (1 + cos(M_PI * 0.25)), tol);
    ck_assert_double_eq_tol(mt_lr_at(&o, 110), 1e-4, tol);
    ck_assert_double_eq_tol(mt_lr_at(&o, 500), 1e-4, tol);
    for (int s = 11; s <= 110; s++) ck_assert(mt_lr_at(&o, s) < mt_lr_at(&o, s - 1) || s == 11);
    ck_assert(mt_lr_at(&o, 11) <= 1e-3);

    /* No warm-up: the cosine starts at step 1, just under the peak. */
    o.warmup = 0;
    ck_assert_double_eq_tol(mt_lr_at(&o, 110), 1e-4, tol);
    ck_assert(mt_lr_at(&o, 1) < 1e-3 && mt_lr_at(&o, 1) > 0.99e-3);

    /* Constant after warm-up. */
    o.schedule = MT_LR_CONSTANT;
    o.warmup = 4;
    ck_assert_double_eq_tol(mt_lr_at(&o, 2), 0.5e-3, tol);
    for (int s = 4; s <= 200; s += 7) ck_assert_double_eq_tol(mt_lr_at(&o, s), 1e-3, tol);
    o.min_lr_ratio = 0;
    ck_assert_double_eq_tol(mt_lr_at(&o, 110), 1e-3, tol);
}
END_TEST

/* ---- sampling --------------------------------------------------------------------------- */

START_TEST(test_sample_windows)
{
    /* Training bytes 0, 1, ..., 199: a window's first token is its offset. */
    enum { N = 200, B = 64, T = 16 };
    uint8_t bytes[N];
    for (int i = 0; i < N; i++) bytes[i] = (uint8_t)i;
    mt_corpus c = { .train = bytes, .ntrain = N };
    int32_t tok[B * T], tgt[B * T], tok2[B * T], tgt2[B * T];
    mt_rng r;
    mt_rng_seed(&r, 5);
    mt_corpus_sample(&c, &r, B, T, tok, tgt);
    int32_t lo = N, hi = -1;
    for (int b = 0; b < B; b++) {
        int32_t o = tok[b * T];
        ck_assert_msg(o >= 0 && o + T < N, "window %d at %d leaves the split", b, o);
        lo = o < lo ? o : lo;
        hi = o > hi ? o : hi;
        for (int t = 0; t < T; t++) {
            ck_assert_int_eq(tok[b * T + t], o + t);
            ck_assert_int_eq(tgt[b * T + t], o + t + 1);
        }
    }
    ck_assert_msg(hi - lo > N / 4, "64 windows spread only over offsets %d..%d", lo, hi);

    /* Deterministic per seed; another seed gives other windows. */
    mt_rng_seed(&r, 5);
    mt_corpus_sample(&c, &r, B, T, tok2, tgt2);
    ck_assert(memcmp(tok, tok2, sizeof tok) == 0 && memcmp(tgt, tgt2, sizeof tgt) == 0);
    mt_rng_seed(&r, 6);
    mt_corpus_sample(&c, &r, B, T, tok2, tgt2);
    ck_assert(memcmp(tok, tok2, sizeof tok) != 0);
}
END_TEST

START_TEST(test_sample_fortunes)
{
    mt_corpus c;
    char err[1024] = "";
    ck_assert_msg(mt_corpus_load(FORTUNES, 10, 1000, &c, err, sizeof err) == 0, "%s", err);
    enum { B = 32, T = 128 };
    static int32_t tok[B * T], tgt[B * T];
    mt_rng r;
    mt_rng_seed(&r, 1234);
    mt_corpus_sample(&c, &r, B, T, tok, tgt);
    int bad = 0, shifted = 0;
    for (int i = 0; i < B * T; i++) bad += tok[i] < 0 || tok[i] > 255 || tgt[i] < 0 || tgt[i] > 255;
    for (int b = 0; b < B; b++)
        for (int t = 0; t + 1 < T; t++) shifted += tgt[b * T + t] == tok[b * T + t + 1];
    ck_assert_int_eq(bad, 0);
    ck_assert_int_eq(shifted, B * (T - 1));
    /* Each window is a real substring of the training split. */
    for (int b = 0; b < B; b++) {
        uint8_t w[T + 1];
        for (int t = 0; t < T; t++) w[t] = (uint8_t)tok[b * T + t];
        w[T] = (uint8_t)tgt[b * T + T - 1];
        ck_assert_msg(memmem(c.train, (size_t)c.ntrain, w, T + 1) != NULL, "window %d is not in the training split", b);
    }

    /* Validation windows are consecutive from the start of the validation split. */
    int64_t n = mt_corpus_validation(&c, 4, T, tok, tgt);
    ck_assert_int_eq(n, 4);
    for (int i = 0; i < 4 * T; i++) {
        ck_assert_int_eq(tok[i], c.val[i]);
        ck_assert_int_eq(tgt[i], c.val[i + 1]);
    }
    /* A short split yields fewer windows. */
    mt_corpus small = c;
    small.nval = 3 * T + 1;
    ck_assert_int_eq(mt_corpus_validation(&small, 10, T, tok, tgt), 3);
    mt_corpus_free(&c);
}
END_TEST

static Suite *train_suite(void)
{
    Suite *s = suite_create("train");
    TCase *tc = tcase_create("run");
    tcase_set_timeout(tc, 900);
    tcase_add_test(tc, test_train_learns_and_repeats);
    suite_add_tcase(s, tc);
    TCase *te = tcase_create("errors");
    tcase_add_test(te, test_corpus_empty_file);
    tcase_add_test(te, test_corpus_truncated_file);
    tcase_add_test(te, test_corpus_missing);
    tcase_add_test(te, test_corpus_not_a_directory);
    tcase_add_test(te, test_corpus_directory_without_text);
    tcase_add_test(te, test_corpus_directory_with_empty_files);
    tcase_add_test(te, test_train_bad_config);
    suite_add_tcase(s, te);
    TCase *td = tcase_create("data");
    tcase_add_test(td, test_corpus_fortunes_split);
    tcase_add_test(td, test_lr_schedule);
    tcase_add_test(td, test_sample_windows);
    tcase_add_test(td, test_sample_fortunes);
    suite_add_tcase(s, td);
    return s;
}

int main(void)
{
    return mt_test_run(train_suite(), false);
}
