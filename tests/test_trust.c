/* What the training job promises beyond training (the library's side of tests/test_trust_cli.sh):
 * a stop request ends the run after its step with the checkpoint saved, and the resume is bit for
 * bit; NaN or infinite steps stop the run with the last good checkpoint intact, or skip exactly
 * their update; a checkpoint records the run's settings (a version 1 file still loads, with a
 * warning); numbered checkpoints; the metrics file after a resume; no temporary file is left. */
#include <check.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "models/layout.h"
#include "runtime/checkpoint.h"
#include "runtime/files.h"
#include "runtime/hf.h"
#include "runtime/runtime.h"
#include "runtime/train.h"
#include "tests/testutil.h"

static char dir[256];

static void make_dir(void)
{
    snprintf(dir, sizeof dir, "/tmp/mt-trust.XXXXXX");
    ck_assert(mkdtemp(dir) != NULL);
}

/* dir/name, in a static buffer of its own per call site's slot (k = 0..3). */
static const char *in_dir(int k, const char *name)
{
    static char paths[4][512];
    snprintf(paths[k], sizeof paths[k], "%s/%s", dir, name);
    return paths[k];
}

static mt_train_options small_run(int64_t steps)
{
    mt_train_options o = mt_train_defaults();
    o.config_path = strdup(mt_test_source_path("models/configs/tiny-byte.json"));
    o.steps = steps;
    o.warmup = 1;
    o.step.B = 4;
    o.step.T = 32;
    o.step.K = 4;
    o.eval_every = 0;
    o.eval_at_start = false;
    o.eval_sequences = 4;
    o.sample_bytes = 0;
    o.seed = 77;
    o.runtime.sched = "eager";
    o.runtime.ncpu = 2;
    o.runtime.ncuda = 0;
    o.hash_weights = true;
    return o;
}

static void run_ok(const mt_train_options *o, mt_train_result *r)
{
    char err[1024];
    ck_assert_msg(mt_train_run(o, r, NULL, err, sizeof err) == 0, "%s", err);
}

/* Runs o with its log captured into *text (caller frees); returns mt_train_run's status. */
static int run_logged(const mt_train_options *o, mt_train_result *r, char **text, char *err, size_t errlen)
{
    size_t len;
    FILE *log = open_memstream(text, &len);
    int rc = mt_train_run(o, r, log, err, errlen);
    fclose(log);
    return rc;
}

/* Whether dir holds a name with ".tmp." in it. */
static bool temporaries_left(const char *d)
{
    char cmd[600];
    snprintf(cmd, sizeof cmd, "ls -a '%s' | grep -q '\\.tmp\\.'", d);
    return system(cmd) == 0;
}

/* ---- stop requests -------------------------------------------------------------------------- */

typedef struct stopper {
    volatile sig_atomic_t flag;
    const char *metrics;    /* set the flag once this file has `after` lines */
    int after;
} stopper;

static int count_lines(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    int n = 0, c;
    while ((c = fgetc(f)) != EOF) n += c == '\n';
    fclose(f);
    return n;
}

static void *stop_later(void *arg)
{
    stopper *s = arg;
    for (int k = 0; k < 30000 && count_lines(s->metrics) < s->after; k++) usleep(1000);
    s->flag = SIGINT;
    return NULL;
}

/* A stop request after step 3 or so: the run ends after the step in flight with its checkpoint
 * saved and says so; the resumed run then equals an uninterrupted one bit for bit. */
START_TEST(test_stop_request_saves_and_resumes)
{
    make_dir();
    mt_train_options o = small_run(12);
    mt_train_result straight, stopped, resumed;
    run_ok(&o, &straight);

    stopper s = { .metrics = in_dir(0, "m.jsonl"), .after = 3 };
    o.metrics_path = s.metrics;
    o.checkpoint_path = in_dir(1, "run.ckpt");
    o.stop_signal = &s.flag;
    pthread_t t;
    pthread_create(&t, NULL, stop_later, &s);
    char *log, err[1024];
    ck_assert_msg(run_logged(&o, &stopped, &log, err, sizeof err) == 0, "%s", err);
    pthread_join(t, NULL);
    ck_assert_int_eq(stopped.stopped_by, SIGINT);
    ck_assert_msg(stopped.steps_done >= 3 && stopped.steps_done < 12, "stopped after step %lld", (long long)stopped.steps_done);
    char want[256];
    snprintf(want, sizeof want, "SIGINT: stopped after step %lld of 12", (long long)stopped.steps_done);
    ck_assert_msg(strstr(log, want), "no '%s' in the log:\n%s", want, log);
    free(log);
    mt_model_config cfg;
    ck_assert(mt_config_load(o.config_path, &cfg, err, sizeof err) == 0);
    mt_checkpoint_meta *meta = malloc(sizeof *meta);
    ck_assert_msg(mt_checkpoint_read_header(o.checkpoint_path, &cfg, meta, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(meta->step, stopped.steps_done);
    ck_assert_int_eq(count_lines(s.metrics), stopped.steps_done);
    ck_assert_msg(!temporaries_left(dir), "a temporary file is left in %s", dir);

    s.flag = 0;
    o.resume_path = o.checkpoint_path;
    run_ok(&o, &resumed);
    ck_assert_int_eq(resumed.stopped_by, 0);
    ck_assert_int_eq(resumed.steps_done, 12);
    ck_assert_int_eq(resumed.first_step, stopped.steps_done + 1);
    for (int64_t k = stopped.steps_done; k < 12; k++)
        ck_assert_msg(memcmp(&resumed.losses[k], &straight.losses[k], sizeof(double)) == 0, "step %lld", (long long)k + 1);
    ck_assert(resumed.weights_hash == straight.weights_hash);
    ck_assert_int_eq(count_lines(s.metrics), 12);

    /* A request before the first step: nothing trained, nothing replaced, the model not written. */
    s.flag = SIGTERM;
    o.save_model_dir = in_dir(2, "model");
    o.steps = 14;
    o.allow_changed = "steps";
    mt_train_result none;
    run_ok(&o, &none);
    ck_assert_int_eq(none.stopped_by, SIGTERM);
    ck_assert_int_eq(none.steps_done, 12);
    ck_assert_msg(access(o.save_model_dir, F_OK) != 0, "the model was written");
    ck_assert_msg(mt_checkpoint_read_header(o.checkpoint_path, &cfg, meta, err, sizeof err) == 0 && meta->step == 12,
                  "the checkpoint changed");

    /* A request once the run is at its end: the model is still written. */
    o.steps = 12;
    o.allow_changed = NULL;
    run_ok(&o, &none);
    ck_assert_int_eq(none.stopped_by, SIGTERM);
    ck_assert_msg(access(in_dir(3, "model/model.safetensors"), F_OK) == 0, "the model was not written");
    free(meta);
    free(straight.losses); free(stopped.losses); free(resumed.losses); free(none.losses);
}
END_TEST

/* ---- NaN and infinite steps ----------------------------------------------------------------- */

/* An untied tiny model whose embedding row of byte '#' is NaN, written to dir/nan-model: every
 * batch that holds a '#' gives a NaN loss, the others train normally. */
static const char *nan_model(void)
{
    static const char untied[] =
        "{\"model_type\": \"qwen2\", \"hidden_size\": 64, \"intermediate_size\": 128, \"num_hidden_layers\": 2,"
        " \"num_attention_heads\": 2, \"num_key_value_heads\": 1, \"head_dim\": 32, \"vocab_size\": 256,"
        " \"max_position_embeddings\": 256, \"tie_word_embeddings\": false}";
    char err[1024];
    mt_model_config cfg;
    ck_assert(mt_config_parse(untied, "untied", &cfg, err, sizeof err) == 0);
    mt_runtime_options ro = { .sched = "eager", .ncpu = 2, .ncuda = 0 };
    ck_assert_msg(mt_runtime_init(&ro, err, sizeof err) == 0, "%s", err);
    mt_host_state *st = mt_state_create(&cfg, MT_DTYPE_F32, 0, err, sizeof err);
    ck_assert_msg(st, "%s", err);
    mt_state_init_random(st, 3, 0.02);
    mt_tile *embed = mt_state_embed(st);
    float *row = embed->master + embed->layout->tensors[MT_E_EMBED].offset + '#' * cfg.hidden;
    for (int64_t k = 0; k < cfg.hidden; k++) row[k] = NAN;
    const char *model = in_dir(0, "nan-model");
    ck_assert_msg(mt_hf_save(model, st, MT_DTYPE_F32, 0, err, sizeof err) == 0, "%s", err);
    mt_state_destroy(st);
    mt_runtime_shutdown();
    return model;
}

/* Text with a '#' every 600 bytes or so: some batches of 4 x 33 bytes hold one. */
static const char *hash_corpus(void)
{
    const char *path = in_dir(1, "hash.txt");
    FILE *f = fopen(path, "w");
    mt_test_rng r;
    mt_test_rng_seed(&r, 11);
    for (int i = 0; i < 60000; i++) fputc(i % 600 == 599 ? '#' : "abcdefgh ijklmnop\n"[(int)(mt_test_uniform(&r) * 18)], f);
    fclose(f);
    return path;
}

static mt_train_options nan_run(const char *model, const char *corpus, int64_t steps)
{
    mt_train_options o = small_run(steps);
    o.model_dir = model;
    o.data_path = corpus;
    o.step.K = 2;
    return o;
}

/* Stop (the default): the first non-finite step ends the run with an error naming it, and the
 * checkpoint of the step before stays as it was. Skip: exactly the non-finite steps' updates are
 * withheld (the weights after a skipped step are those before it), the others train, and the
 * run resumes bit for bit. */
START_TEST(test_nonfinite_stop_and_skip)
{
    make_dir();
    char model[512], corpus[512];
    snprintf(model, sizeof model, "%s", nan_model());
    snprintf(corpus, sizeof corpus, "%s", hash_corpus());
    char err[1024];

    mt_train_options o = nan_run(model, corpus, 24);
    o.on_nonfinite = MT_NONFINITE_SKIP;
    o.metrics_path = in_dir(2, "skip.jsonl");
    mt_train_result skip;
    run_ok(&o, &skip);
    int64_t first_bad = 0, good_after = 0, nbad = 0;
    for (int64_t k = 1; k <= 24; k++) {
        if (isfinite(skip.losses[k - 1])) {
            if (first_bad && !good_after) good_after = k;
            continue;
        }
        nbad++;
        if (!first_bad) first_bad = k;
    }
    ck_assert_msg(nbad > 0 && nbad < 20 && first_bad > 1 && good_after > first_bad,
                  "%lld non-finite steps, the first %lld: the corpus does not exercise the test", (long long)nbad,
                  (long long)first_bad);
    ck_assert_int_eq(skip.skipped, nbad);
    FILE *mf = fopen(o.metrics_path, "r");
    char line[1024];
    int64_t marked = 0;
    while (fgets(line, sizeof line, mf)) marked += strstr(line, "\"skipped\": true") != NULL;
    fclose(mf);
    ck_assert_int_eq(marked, nbad);

    /* Step first_bad was skipped: the weights after it are those before it. */
    mt_train_result before, after;
    o.metrics_path = NULL;
    o.stop_after = first_bad - 1;
    run_ok(&o, &before);
    o.stop_after = first_bad;
    run_ok(&o, &after);
    ck_assert_msg(before.weights_hash == after.weights_hash, "the skipped step %lld changed the weights", (long long)first_bad);
    o.stop_after = good_after;
    run_ok(&o, &after);
    ck_assert_msg(before.weights_hash != after.weights_hash, "step %lld trained nothing", (long long)good_after);

    /* Stopped after a skip and resumed: the same as straight through. */
    o.stop_after = first_bad;
    o.checkpoint_path = in_dir(3, "skip.ckpt");
    run_ok(&o, &before);
    o.stop_after = 0;
    o.resume_path = o.checkpoint_path;
    run_ok(&o, &after);
    ck_assert_msg(after.weights_hash == skip.weights_hash, "resumed after a skipped step, other weights");
    for (int64_t k = first_bad; k < 24; k++)
        ck_assert_msg(!memcmp(&after.losses[k], &skip.losses[k], sizeof(double)), "step %lld after resuming", (long long)k + 1);

    /* Stop: the message names the step; the checkpoint of the step before is intact. */
    mt_train_options p = nan_run(model, corpus, 24);
    p.checkpoint_path = in_dir(3, "stop.ckpt");
    p.save_every = 1;
    mt_train_result stop;
    ck_assert_int_eq(mt_train_run(&p, &stop, NULL, err, sizeof err), -1);
    char want[64];
    snprintf(want, sizeof want, "step %lld: loss nan", (long long)first_bad);
    ck_assert_msg(strstr(err, want) && strstr(err, "--on-nonfinite skip"), "%s", err);
    snprintf(want, sizeof want, "at step %lld, is intact", (long long)first_bad - 1);
    ck_assert_msg(strstr(err, want), "%s", err);
    p.resume_path = p.checkpoint_path;
    p.stop_after = first_bad - 1 + 1; /* loads it whole: the checksum holds */
    p.on_nonfinite = MT_NONFINITE_SKIP;
    p.checkpoint_path = NULL;
    p.save_every = 0;
    run_ok(&p, &stop);
    ck_assert_int_eq(stop.first_step, first_bad);
    free(skip.losses); free(before.losses); free(after.losses); free(stop.losses);
}
END_TEST

/* Without any non-finite step, skip mode (updates after the norm) trains bit for bit as the
 * default (updates ahead of it). */
START_TEST(test_skip_mode_is_exact)
{
    mt_train_options o = small_run(6);
    mt_train_result a, b;
    run_ok(&o, &a);
    o.on_nonfinite = MT_NONFINITE_SKIP;
    run_ok(&o, &b);
    ck_assert_int_eq(b.skipped, 0);
    for (int k = 0; k < 6; k++) ck_assert_msg(!memcmp(&a.losses[k], &b.losses[k], sizeof(double)), "step %d", k + 1);
    ck_assert(a.weights_hash == b.weights_hash);
    free(a.losses); free(b.losses);
}
END_TEST

/* ---- checkpoints ---------------------------------------------------------------------------- */

static char *read_all(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    ck_assert_ptr_nonnull(f);
    fseek(f, 0, SEEK_END);
    *len = (size_t)ftell(f);
    rewind(f);
    char *b = malloc(*len);
    ck_assert_uint_eq(fread(b, 1, *len, f), *len);
    fclose(f);
    return b;
}

/* A version 1 file (the format before settings were recorded) of a version 3 one of one
 * process: the same bytes without the update count, the settings and the shard, the checksum
 * redone. */
static void write_version_1(const char *v2, const char *v1)
{
    size_t len;
    char *b = read_all(v2, &len);
    const size_t head = 8 + 4 + 4 + 8 * 8 + 2 * 8 + 3 * 8; /* through step, rng_state, seed */
    uint32_t n;
    memcpy(&n, b + head + 8, sizeof n);
    const size_t cut = 8 + 4 + n + 2 * 4, rest = len - head - cut - 8;
    uint32_t one = 1;
    memcpy(b + 8, &one, sizeof one);
    memmove(b + head, b + head + cut, rest);
    uint64_t h = mt_fnv1a64(MT_FNV1A64_START, b, head + rest);
    memcpy(b + head + rest, &h, sizeof h);
    FILE *f = fopen(v1, "wb");
    fwrite(b, 1, head + rest + 8, f);
    fclose(f);
    free(b);
}

START_TEST(test_version_1_checkpoint_loads_with_a_warning)
{
    make_dir();
    mt_train_options o = small_run(6);
    mt_train_result straight, first, resumed;
    run_ok(&o, &straight);
    o.stop_after = 3;
    o.checkpoint_path = in_dir(0, "v2.ckpt");
    run_ok(&o, &first);
    write_version_1(o.checkpoint_path, in_dir(1, "v1.ckpt"));
    o.stop_after = 0;
    o.checkpoint_path = NULL;
    o.resume_path = in_dir(1, "v1.ckpt");
    o.lr = 1e-3; /* not checked: a version 1 file does not record it */
    char *log, err[1024];
    ck_assert_msg(run_logged(&o, &resumed, &log, err, sizeof err) == 0, "%s", err);
    ck_assert_msg(strstr(log, "version 1 checkpoint") && strstr(log, "cannot be checked"), "%s", log);
    free(log);
    free(resumed.losses);
    o.lr = mt_train_defaults().lr;
    run_ok(&o, &resumed);
    ck_assert(resumed.weights_hash == straight.weights_hash);
    free(straight.losses); free(first.losses); free(resumed.losses);
}
END_TEST

/* --keep-last: numbered files, the link at the newest, older ones pruned; resuming through the
 * link continues the run. */
START_TEST(test_keep_last)
{
    make_dir();
    mt_train_options o = small_run(5);
    o.checkpoint_path = in_dir(0, "run.ckpt");
    o.save_every = 1;
    o.keep_last = 2;
    o.stop_after = 4;
    mt_train_result r;
    run_ok(&o, &r);
    char target[64] = "";
    ck_assert(readlink(o.checkpoint_path, target, sizeof target - 1) > 0);
    ck_assert_str_eq(target, "run.ckpt.000004");
    ck_assert_int_eq(access(in_dir(1, "run.ckpt.000003"), F_OK), 0);
    ck_assert_int_ne(access(in_dir(1, "run.ckpt.000002"), F_OK), 0);
    ck_assert_int_ne(access(in_dir(1, "run.ckpt.000001"), F_OK), 0);
    free(r.losses);
    o.stop_after = 0;
    o.resume_path = o.checkpoint_path;
    run_ok(&o, &r);
    ck_assert_int_eq(r.first_step, 5);
    memset(target, 0, sizeof target);
    ck_assert(readlink(o.checkpoint_path, target, sizeof target - 1) > 0);
    ck_assert_str_eq(target, "run.ckpt.000005");
    ck_assert_int_ne(access(in_dir(1, "run.ckpt.000003"), F_OK), 0);
    ck_assert(!temporaries_left(dir));
    free(r.losses);
}
END_TEST

/* Every setting the checkpoint records is checked, each named with both values. */
START_TEST(test_settings_checked)
{
    make_dir();
    mt_train_options o = small_run(4);
    o.stop_after = 2;
    o.checkpoint_path = in_dir(0, "run.ckpt");
    mt_train_result r;
    run_ok(&o, &r);
    free(r.losses);
    o.stop_after = 0;
    o.resume_path = o.checkpoint_path;
    static const char *const names[] = { "accum", "seq-len", "warmup", "weight-decay", "clip", "schedule", "dtype" };
    static const char *const wants[] = {
        "--accum 2 (the checkpoint's run: 1)", "--seq-len 16 (the checkpoint's run: 32)",
        "--warmup 2 (the checkpoint's run: 1)", "--weight-decay 0.05 (the checkpoint's run: 0.1)",
        "--clip 0.5 (the checkpoint's run: 1)", "--schedule constant (the checkpoint's run: cosine)",
        "--dtype bf16 (the checkpoint's run: fp32)",
    };
    for (int k = 0; k < 7; k++) {
        mt_train_options p = o;
        switch (k) {
        case 0: p.step.accum = 2; break;
        case 1: p.step.T = 16; break;
        case 2: p.warmup = 2; break;
        case 3: p.step.weight_decay = 0.05; break;
        case 4: p.step.clip = 0.5; break;
        case 5: p.schedule = MT_LR_CONSTANT; break;
        case 6: p.dtype = MT_DTYPE_BF16; p.dtype_explicit = true; break;
        }
        char err[2048];
        ck_assert_int_eq(mt_train_run(&p, &r, NULL, err, sizeof err), -1);
        free(r.losses);
        ck_assert_msg(strstr(err, wants[k]) && strstr(err, o.checkpoint_path), "%s: %s", names[k], err);
        p.allow_changed = names[k];
        ck_assert_msg(mt_train_run(&p, &r, NULL, err, sizeof err) == 0, "%s allowed: %s", names[k], err);
        free(r.losses);
        /* The accepted run saved its own settings: write the original checkpoint again. */
        mt_train_options again = o;
        again.resume_path = NULL;
        again.stop_after = 2;
        unlink(o.checkpoint_path);
        run_ok(&again, &r);
        free(r.losses);
    }
}
END_TEST

/* A fresh run does not replace an existing checkpoint; resuming the last step with --save-model
 * writes the model; a dead writer's temporaries are removed, a live one's kept. */
START_TEST(test_final_save_redone)
{
    make_dir();
    mt_train_options o = small_run(3);
    o.checkpoint_path = in_dir(0, "run.ckpt");
    mt_train_result r;
    run_ok(&o, &r);
    free(r.losses);
    char err[1024];
    ck_assert_int_eq(mt_train_run(&o, &r, NULL, err, sizeof err), -1);
    free(r.losses);
    ck_assert_msg(strstr(err, "exists and this run does not resume it"), "%s", err);

    pid_t child = fork();
    if (child == 0) _exit(0);
    waitpid(child, NULL, 0);
    char stale[600], live[600];
    snprintf(stale, sizeof stale, "%s.tmp.%d", o.checkpoint_path, (int)child);
    snprintf(live, sizeof live, "%s.tmp.%d", o.checkpoint_path, (int)getppid());
    fclose(fopen(stale, "w"));
    fclose(fopen(live, "w"));
    o.resume_path = o.checkpoint_path;
    o.save_model_dir = in_dir(1, "model");
    char *log;
    ck_assert_msg(run_logged(&o, &r, &log, err, sizeof err) == 0, "%s", err);
    ck_assert_msg(strstr(log, "nothing to train") && strstr(log, "model saved to"), "%s", log);
    ck_assert_msg(strstr(log, "done: no step trained (the checkpoint was at step 3)"), "%s", log);
    free(log);
    free(r.losses);
    ck_assert_int_eq(access(in_dir(2, "model/model.safetensors"), F_OK), 0);
    ck_assert_msg(access(stale, F_OK) != 0, "the dead process's temporary is left");
    ck_assert_msg(access(live, F_OK) == 0, "a live process's temporary was removed");
    unlink(live);
    /* Without --save-model there is nothing left to do. */
    o.save_model_dir = NULL;
    ck_assert_int_eq(mt_train_run(&o, &r, NULL, err, sizeof err), -1);
    free(r.losses);
    ck_assert_msg(strstr(err, "nothing left to do"), "%s", err);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("trust");
    TCase *tc = tcase_create("trust");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_stop_request_saves_and_resumes);
    tcase_add_test(tc, test_nonfinite_stop_and_skip);
    tcase_add_test(tc, test_skip_mode_is_exact);
    tcase_add_test(tc, test_version_1_checkpoint_loads_with_a_warning);
    tcase_add_test(tc, test_keep_last);
    tcase_add_test(tc, test_settings_checked);
    tcase_add_test(tc, test_final_save_redone);
    suite_add_tcase(s, tc);
    return mt_test_run(s, false);
}
