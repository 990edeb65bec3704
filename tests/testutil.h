/* Shared helpers of the Check suites: random fills, relative errors, temp files. */
#ifndef MT_TESTS_TESTUTIL_H
#define MT_TESTS_TESTUTIL_H

#include <stdbool.h>
#include <stdint.h>
#include <stddef.h>

#include <check.h>

#include "models/config.h"

/* Deterministic xorshift generator for test inputs. */
typedef struct { uint64_t s; } mt_test_rng;
void mt_test_rng_seed(mt_test_rng *r, uint64_t seed);
double mt_test_uniform(mt_test_rng *r);              /* [0, 1) */
double mt_test_normal(mt_test_rng *r);               /* N(0, 1) */
void mt_test_fill_f64(mt_test_rng *r, double *x, int64_t n, double scale);
void mt_test_fill_f32(mt_test_rng *r, float *x, int64_t n, float scale);

/* ||a - b|| / ||b|| (b all zero: ||a||); _mixed: an f32 result against an f64 one. */
double mt_test_rel_err_f64(const double *a, const double *b, int64_t n);
double mt_test_rel_err_f32(const float *a, const float *b, int64_t n);
double mt_test_rel_err_mixed(const float *a, const double *b, int64_t n);

/* Prints what and its relative error, one line, and asserts err <= tol; _close: of a against
 * b; _bitwise: prints whether the bytes are the same and asserts they are. */
void mt_test_report(const char *what, double err, double tol);
void mt_test_check_close(const char *what, const float *a, const float *b, int64_t n, double tol);
void mt_test_check_bitwise(const char *what, const void *a, const void *b, size_t bytes);

/* New arrays of n elements (at least one; the caller frees them, allocation failure aborts):
 * zeroed; N(0, scale^2); a copy of x; x rounded to float; x widened to double (exactly the
 * float values, for a double reference). */
double *mt_test_alloc_f64(int64_t n);
float *mt_test_alloc_f32(int64_t n);
double *mt_test_random_f64(mt_test_rng *r, int64_t n, double scale);
float *mt_test_random_f32(mt_test_rng *r, int64_t n, float scale);
double *mt_test_copy_f64(const double *x, int64_t n);
float *mt_test_to_f32(const double *x, int64_t n);
double *mt_test_to_f64(const float *x, int64_t n);

/* Writes text to a new file in a fresh temporary directory; returns its path (static buffer
 * owned by the caller until the next call: copy it). */
const char *mt_test_write_temp(const char *name, const char *text);

/* Removes a directory of plain files (and the files). */
void mt_test_remove_dir(const char *dir);

/* One tensor of a hand-written safetensors file: raw little-endian bytes under a dtype name
 * ("F16", "U8", ...), for the files megatrain's own writer does not make (other dtypes than it
 * writes, MXFP4 experts). */
typedef struct mt_test_raw_tensor {
    const char *name;
    const char *dtype;
    int ndim;
    int64_t shape[4];
    const void *data;
    size_t bytes;
} mt_test_raw_tensor;

/* Writes a safetensors file of the n tensors at path, their data in order, no padding. */
void mt_test_write_raw_safetensors(const char *path, const mt_test_raw_tensor *t, int n);

/* Absolute path of a file in the source tree (from MT_SOURCE_ROOT). */
const char *mt_test_source_path(const char *relative);

/* Runs every test of the suite (in this process when in_process: a process that has touched
 * CUDA cannot fork usable children, and costly fixtures load once) and returns main's exit
 * status: EXIT_SUCCESS when none failed. */
int mt_test_run(Suite *s, bool in_process);

/* The small qwen2 of the GPU step suites (test_gpu_step, test_gpu_compact): d 192, 3 layers, 3
 * heads of 64 over one KV head, intermediate 333, vocabulary 1001, tied head or not. */
mt_model_config mt_test_gpu_config(bool tied);

#endif
