/* Training checkpoints: N steps straight equal N/2 + save + resume + N/2, bitwise; damaged or
 * foreign checkpoints are refused naming the file; an unwritable path is refused before the
 * first step; a failed save leaves the previous one. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "runtime/checkpoint.h"
#include "models/config.h"
#include "runtime/files.h"
#include "runtime/runtime.h"
#include "runtime/train.h"
#include "tests/testutil.h"

static char dir[256];

static mt_train_options small_run(int64_t steps)
{
    mt_train_options o = mt_train_defaults();
    o.config_path = strdup(mt_test_source_path("models/configs/tiny-byte.json"));
    o.steps = steps;
    o.warmup = steps > 2 ? 2 : 0;
    o.step.B = 4;
    o.step.T = 32;
    o.step.K = 4;
    o.eval_every = 0;
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
    char err[512];
    ck_assert_msg(mt_train_run(o, r, NULL, err, sizeof err) == 0, "%s", err);
}

static void make_dir(void)
{
    snprintf(dir, sizeof dir, "/tmp/mt-ckpt.XXXXXX");
    ck_assert(mkdtemp(dir) != NULL);
}

START_TEST(test_resume_is_bit_exact)
{
    make_dir();
    char path[512];
    snprintf(path, sizeof path, "%s/run.ckpt", dir);
    mt_train_result straight, first, second;
    mt_train_options o = small_run(6);
    run_ok(&o, &straight);

    o.stop_after = 3;
    o.checkpoint_path = path;
    run_ok(&o, &first);
    ck_assert_int_eq(first.steps_done, 3);
    ck_assert_msg(access(path, R_OK) == 0, "no checkpoint written");
    char ls[600];
    snprintf(ls, sizeof ls, "ls -a '%s' | grep -q '\\.tmp'", dir);
    ck_assert_msg(system(ls) != 0, "a temporary file was left behind in %s", dir);

    o.stop_after = 0;
    o.checkpoint_path = NULL;
    o.resume_path = path;
    run_ok(&o, &second);
    ck_assert_int_eq(second.steps_done, 6);
    for (int s = 0; s < 3; s++)
        ck_assert_msg(memcmp(&first.losses[s], &straight.losses[s], sizeof(double)) == 0, "step %d loss differs", s + 1);
    for (int s = 3; s < 6; s++)
        ck_assert_msg(memcmp(&second.losses[s], &straight.losses[s], sizeof(double)) == 0,
                      "step %d after resuming: %.17g vs %.17g", s + 1, second.losses[s], straight.losses[s]);
    ck_assert_msg(second.weights_hash == straight.weights_hash, "final weights differ after resuming");
    ck_assert_msg(first.weights_hash != straight.weights_hash, "3 and 6 steps gave the same weights");
    free(straight.losses); free(first.losses); free(second.losses);
}
END_TEST

/* A checkpoint file of the tiny model for the damage tests: step 2 of the run small_run(4). */
static void write_checkpoint(const char *path)
{
    mt_train_options o = small_run(4);
    o.stop_after = 2;
    o.checkpoint_path = path;
    mt_train_result r;
    run_ok(&o, &r);
    free(r.losses);
}

static void expect_load_error(const char *path, const char *needle)
{
    mt_train_options o = small_run(4);
    o.resume_path = path;
    mt_train_result r;
    char err[512];
    ck_assert_int_eq(mt_train_run(&o, &r, NULL, err, sizeof err), -1);
    free(r.losses);
    ck_assert_msg(strstr(err, path) != NULL, "message does not name the file: %s", err);
    ck_assert_msg(strstr(err, needle) != NULL, "message lacks '%s': %s", needle, err);
}

START_TEST(test_damaged_checkpoints_refused)
{
    make_dir();
    char good[512], bad[512];
    snprintf(good, sizeof good, "%s/good.ckpt", dir);
    write_checkpoint(good);
    struct stat sb;
    ck_assert_int_eq(stat(good, &sb), 0);
    FILE *in = fopen(good, "rb");
    char *bytes = malloc(sb.st_size);
    ck_assert_int_eq(fread(bytes, 1, sb.st_size, in), sb.st_size);
    fclose(in);

    snprintf(bad, sizeof bad, "%s/truncated.ckpt", dir);
    FILE *f = fopen(bad, "wb");
    fwrite(bytes, 1, sb.st_size / 2, f);
    fclose(f);
    expect_load_error(bad, "truncated");

    snprintf(bad, sizeof bad, "%s/flipped.ckpt", dir);
    bytes[sb.st_size / 2] ^= 0x40;
    f = fopen(bad, "wb");
    fwrite(bytes, 1, sb.st_size, f);
    fclose(f);
    expect_load_error(bad, "checksum");
    bytes[sb.st_size / 2] ^= 0x40;

    snprintf(bad, sizeof bad, "%s/magic.ckpt", dir);
    f = fopen(bad, "wb");
    fwrite("NOTACKPT", 1, 8, f);
    fwrite(bytes + 8, 1, sb.st_size - 8, f);
    fclose(f);
    expect_load_error(bad, "not a megatrain checkpoint");

    snprintf(bad, sizeof bad, "%s/missing.ckpt", dir);
    expect_load_error(bad, "cannot open");

    /* Another model: the tiny config with one layer less. */
    char cfgpath[512];
    snprintf(cfgpath, sizeof cfgpath, "%s/config.json", dir);
    f = fopen(cfgpath, "w");
    fputs("{\"model_type\": \"qwen2\", \"hidden_size\": 192, \"intermediate_size\": 512, \"num_hidden_layers\": 5,"
          " \"num_attention_heads\": 6, \"num_key_value_heads\": 2, \"head_dim\": 32, \"vocab_size\": 256,"
          " \"max_position_embeddings\": 256, \"tie_word_embeddings\": true}", f);
    fclose(f);
    mt_train_options o = small_run(4);
    o.config_path = cfgpath;
    o.resume_path = good;
    mt_train_result r;
    char err[512];
    ck_assert_int_eq(mt_train_run(&o, &r, NULL, err, sizeof err), -1);
    free(r.losses);
    ck_assert_msg(strstr(err, "another model") != NULL && strstr(err, good) != NULL, "%s", err);
    ck_assert_msg(strstr(err, "num_hidden_layers 6 (this run: 5)") != NULL, "%s", err);

    /* Differences in the intermediate size, the heads and the rope theta: each is named with both values. */
    f = fopen(cfgpath, "w");
    fputs("{\"model_type\": \"qwen2\", \"hidden_size\": 192, \"intermediate_size\": 384, \"num_hidden_layers\": 6,"
          " \"num_attention_heads\": 12, \"num_key_value_heads\": 2, \"head_dim\": 16, \"vocab_size\": 256,"
          " \"max_position_embeddings\": 256, \"rope_theta\": 500000.0, \"tie_word_embeddings\": true}", f);
    fclose(f);
    ck_assert_int_eq(mt_train_run(&o, &r, NULL, err, sizeof err), -1);
    free(r.losses);
    ck_assert_msg(strstr(err, "intermediate_size 512 (this run: 384)") && strstr(err, "num_attention_heads 6 (this run: 12)") &&
                  strstr(err, "head_dim 32 (this run: 16)") && strstr(err, "rope_theta 10000 (this run: 500000)") &&
                  !strstr(err, "hidden_size"), "%s", err);

    /* A crash while saving leaves a partial temporary file: the checkpoint itself still loads,
     * and the next run that saves there removes the dead writer's leftover. */
    pid_t child = fork();
    if (child == 0) _exit(0);
    waitpid(child, NULL, 0);
    char tmp[600];
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", good, (int)child);
    f = fopen(tmp, "wb");
    fwrite(bytes, 1, 100, f);
    fclose(f);
    o = small_run(4);
    o.resume_path = good;
    o.checkpoint_path = good;
    ck_assert_msg(mt_train_run(&o, &r, NULL, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(r.steps_done, 4);
    ck_assert_msg(access(tmp, F_OK) != 0, "the partial temporary of a dead process is left");
    free(r.losses);
    free(bytes);
}
END_TEST

/* A checkpoint path that cannot be written is refused before the first step. */
START_TEST(test_unwritable_checkpoint_refused_first)
{
    make_dir();
    char path[512];
    snprintf(path, sizeof path, "%s/nodir/run.ckpt", dir);
    mt_train_options o = small_run(2);
    o.checkpoint_path = path;
    mt_train_result r;
    char err[512];
    ck_assert_int_eq(mt_train_run(&o, &r, NULL, err, sizeof err), -1);
    ck_assert_int_eq(r.steps_done, 0);
    free(r.losses);
    ck_assert_msg(strstr(err, "--checkpoint") && strstr(err, "nodir: no such directory"), "%s", err);
}
END_TEST

/* A save that fails (here: its temporary's name is taken by a directory) says which file and
 * leaves the previous checkpoint as it was. */
START_TEST(test_failed_save_keeps_previous)
{
    make_dir();
    char path[512], tmp[600];
    snprintf(path, sizeof path, "%s/run.ckpt", dir);
    mt_train_options o = small_run(4);
    o.checkpoint_path = path;
    o.stop_after = 2;
    mt_train_result r;
    run_ok(&o, &r);
    free(r.losses);
    mt_temp_name(path, tmp, sizeof tmp);
    ck_assert_int_eq(mkdir(tmp, 0755), 0);
    o.stop_after = 0;
    o.resume_path = path;
    char err[512];
    ck_assert_int_eq(mt_train_run(&o, &r, NULL, err, sizeof err), -1);
    free(r.losses);
    ck_assert_msg(strstr(err, tmp) && strstr(err, "cannot create"), "%s", err);
    rmdir(tmp);
    mt_model_config cfg;
    ck_assert(mt_config_load(o.config_path, &cfg, err, sizeof err) == 0);
    mt_checkpoint_meta *meta = malloc(sizeof *meta);
    ck_assert_msg(mt_checkpoint_read_header(path, &cfg, meta, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(meta->step, 2);
    free(meta);
    o.stop_after = 3; /* and it loads whole */
    o.checkpoint_path = NULL;
    run_ok(&o, &r);
    ck_assert_int_eq(r.first_step, 3);
    free(r.losses);
}
END_TEST

/* --save-model writes an HF directory; --model starts from it with the same weights. */
START_TEST(test_hf_model_round_trip)
{
    make_dir();
    char model[512];
    snprintf(model, sizeof model, "%s/model", dir);
    mt_train_options o = small_run(2);
    o.save_model_dir = model;
    mt_train_result a, b;
    run_ok(&o, &a);
    mt_train_options p = small_run(1);
    p.model_dir = model;
    run_ok(&p, &b);
    ck_assert_msg(memcmp(&a.last_val, &b.first_val, sizeof(double)) == 0,
                  "validation loss of the saved model %.17g, of the loaded one %.17g", a.last_val, b.first_val);
    free(a.losses);
    free(b.losses);
    p.model_dir = "/nonexistent/model";
    char err[512];
    ck_assert_int_eq(mt_train_run(&p, &b, NULL, err, sizeof err), -1);
    free(b.losses);
    ck_assert_msg(strstr(err, "/nonexistent/model/config.json") != NULL, "%s", err);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("checkpoint");
    TCase *tc = tcase_create("checkpoint");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_resume_is_bit_exact);
    tcase_add_test(tc, test_damaged_checkpoints_refused);
    tcase_add_test(tc, test_unwritable_checkpoint_refused_first);
    tcase_add_test(tc, test_failed_save_keeps_previous);
    tcase_add_test(tc, test_hf_model_round_trip);
    suite_add_tcase(s, tc);
    return mt_test_run(s, false);
}
