/* Shared helpers of the Check suites. */
#include "tests/testutil.h"

#include <dirent.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "models/util.h"
#include "mt_build_config.h"

void mt_test_rng_seed(mt_test_rng *r, uint64_t seed) { r->s = seed * 0x9E3779B97F4A7C15ull + 1; }

static uint64_t next_u64(mt_test_rng *r)
{
    uint64_t x = r->s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    r->s = x;
    return x * 0x2545F4914F6CDD1Dull;
}

double mt_test_uniform(mt_test_rng *r) { return (double)(next_u64(r) >> 11) * (1.0 / 9007199254740992.0); }

double mt_test_normal(mt_test_rng *r)
{
    double u1 = mt_test_uniform(r), u2 = mt_test_uniform(r);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

void mt_test_fill_f64(mt_test_rng *r, double *x, int64_t n, double scale)
{
    for (int64_t i = 0; i < n; i++) x[i] = scale * mt_test_normal(r);
}

void mt_test_fill_f32(mt_test_rng *r, float *x, int64_t n, float scale)
{
    for (int64_t i = 0; i < n; i++) x[i] = (float)(scale * mt_test_normal(r));
}

double mt_test_rel_err_f64(const double *a, const double *b, int64_t n)
{
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = a[i] - b[i];
        num += d * d;
        den += b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

double mt_test_rel_err_f32(const float *a, const float *b, int64_t n)
{
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)a[i] - (double)b[i];
        num += d * d;
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

double mt_test_rel_err_mixed(const float *a, const double *b, int64_t n)
{
    double *a64 = mt_test_to_f64(a, n);
    const double e = mt_test_rel_err_f64(a64, b, n);
    free(a64);
    return e;
}

void mt_test_report(const char *what, double err, double tol)
{
    printf("  %-52s rel err %.3e  (tol %.0e)%s\n", what, err, tol, err <= tol ? "" : "  FAIL");
    fflush(stdout);
    ck_assert_msg(err <= tol, "%s: relative error %.3e exceeds %.1e", what, err, tol);
}

void mt_test_check_close(const char *what, const float *a, const float *b, int64_t n, double tol)
{
    mt_test_report(what, mt_test_rel_err_f32(a, b, n), tol);
}

void mt_test_check_bitwise(const char *what, const void *a, const void *b, size_t bytes)
{
    const bool same = memcmp(a, b, bytes) == 0;
    printf("  %-52s %s\n", what, same ? "bitwise identical" : "DIFFERENT  FAIL");
    fflush(stdout);
    ck_assert_msg(same, "%s: not bitwise identical", what);
}

double *mt_test_alloc_f64(int64_t n) { return mt_xcalloc((size_t)(n > 0 ? n : 1), sizeof(double)); }

float *mt_test_alloc_f32(int64_t n) { return mt_xcalloc((size_t)(n > 0 ? n : 1), sizeof(float)); }

double *mt_test_random_f64(mt_test_rng *r, int64_t n, double scale)
{
    double *p = mt_test_alloc_f64(n);
    mt_test_fill_f64(r, p, n, scale);
    return p;
}

float *mt_test_random_f32(mt_test_rng *r, int64_t n, float scale)
{
    float *p = mt_test_alloc_f32(n);
    mt_test_fill_f32(r, p, n, scale);
    return p;
}

double *mt_test_copy_f64(const double *x, int64_t n)
{
    double *p = mt_test_alloc_f64(n);
    memcpy(p, x, (size_t)n * sizeof(double));
    return p;
}

float *mt_test_to_f32(const double *x, int64_t n)
{
    float *p = mt_test_alloc_f32(n);
    for (int64_t i = 0; i < n; i++) p[i] = (float)x[i];
    return p;
}

double *mt_test_to_f64(const float *x, int64_t n)
{
    double *p = mt_test_alloc_f64(n);
    for (int64_t i = 0; i < n; i++) p[i] = (double)x[i];
    return p;
}

const char *mt_test_write_temp(const char *name, const char *text)
{
    static char path[4096];
    char dir[] = "/tmp/mt-test.XXXXXX";
    if (!mkdtemp(dir)) { perror("mkdtemp"); abort(); }
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    if (!f) { perror(path); abort(); }
    fputs(text, f);
    fclose(f);
    return path;
}

void mt_test_remove_dir(const char *dir)
{
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *de;
        char p[4096];
        while ((de = readdir(d)))
            if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..")) {
                snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
                unlink(p);
            }
        closedir(d);
    }
    rmdir(dir);
}

const char *mt_test_source_path(const char *relative)
{
    static char path[4096];
    const char *root = getenv("MT_SOURCE_ROOT");
    snprintf(path, sizeof path, "%s/%s", root ? root : MT_SOURCE_ROOT, relative);
    return path;
}

int mt_test_run(Suite *s, bool in_process)
{
    SRunner *sr = srunner_create(s);
    if (in_process) srunner_set_fork_status(sr, CK_NOFORK);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

mt_model_config mt_test_gpu_config(bool tied)
{
    char json[1024], err[256];
    snprintf(json, sizeof json,
             "{\"model_type\": \"qwen2\", \"hidden_size\": 192, \"intermediate_size\": 333,"
             " \"num_hidden_layers\": 3, \"num_attention_heads\": 3, \"num_key_value_heads\": 1,"
             " \"head_dim\": 64, \"vocab_size\": 1001, \"max_position_embeddings\": 512,"
             " \"rope_theta\": 1000000.0, \"rms_norm_eps\": 1e-6, \"tie_word_embeddings\": %s}",
             tied ? "true" : "false");
    mt_model_config cfg;
    ck_assert_msg(mt_config_parse(json, "gpu-test", &cfg, err, sizeof err) == 0, "%s", err);
    return cfg;
}

void mt_test_write_raw_safetensors(const char *path, const mt_test_raw_tensor *t, int n)
{
    json_t *root = json_object();
    size_t at = 0;
    for (int i = 0; i < n; i++) {
        json_t *shape = json_array();
        for (int d = 0; d < t[i].ndim; d++) json_array_append_new(shape, json_integer(t[i].shape[d]));
        json_object_set_new(root, t[i].name, json_pack("{s:s, s:o, s:[I, I]}", "dtype", t[i].dtype, "shape", shape,
                                                       "data_offsets", (json_int_t)at, (json_int_t)(at + t[i].bytes)));
        at += t[i].bytes;
    }
    char *h = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(root);
    FILE *f = fopen(path, "wb");
    ck_assert(f != NULL && h != NULL);
    uint64_t len = strlen(h);
    ck_assert(fwrite(&len, 8, 1, f) == 1);
    ck_assert(fwrite(h, 1, len, f) == len);
    for (int i = 0; i < n; i++) ck_assert(fwrite(t[i].data, 1, t[i].bytes, f) == t[i].bytes);
    ck_assert(fclose(f) == 0);
    free(h);
}
