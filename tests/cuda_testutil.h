/* Shared helpers of the CUDA suites (test_cuda, test_cuda_attention): device buffers and copies
 * with every CUDA call asserted, host inputs rounded to bf16, and test_cuda's one-layer configs,
 * random tiles and padding check. */
#ifndef MT_TESTS_CUDA_TESTUTIL_H
#define MT_TESTS_CUDA_TESTUTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <check.h>
#include <cuda_runtime.h>

#include "backends/cpu/ops.h"
#include "backends/cuda/kernels.h"
#include "tests/testutil.h"

#define CK_CUDA(call)                                                                           \
    do {                                                                                        \
        cudaError_t err_ = (call);                                                              \
        ck_assert_msg(err_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(err_));          \
    } while (0)

/* test_cuda's sizes: B*T = 154 rows, d = 200, I = 333, V = 1001: none a multiple of 64. */
enum { TB = 2, TT = 77, TD = 200, TI = 333, TV = 1001 };

/* x rounded to bf16 in place (so the CPU sees exactly the GPU's operands); bits optional. */
void mt_test_round_bf16(float *x, int64_t n, mt_bf16 *bits);
/* A new array of x's bf16 bits. */
mt_bf16 *mt_test_bf16_of(const float *x, int64_t n);

/* Device buffer: a copy of host, or (host NULL) all bytes 0xff, i.e. NaN in fp32 and bf16, so an
 * output element left unwritten shows up. */
void *mt_test_gpu_buffer(const void *host, size_t bytes);
/* All bytes of p 0xff (NaN), on st. */
void mt_test_gpu_fill_nan(void *p, size_t bytes, cudaStream_t st);
/* New host arrays of n floats copied from the device: fp32 as it is, bf16 widened. */
float *mt_test_download_f32(const float *dev, int64_t n);
float *mt_test_download_bf16(const mt_cuda_bf16 *dev, int64_t n);
/* A non-blocking stream. */
cudaStream_t mt_test_new_stream(void);

/* A one-layer config at test_cuda's sizes (TD, TI, TV), H query heads and KV key/value heads of
 * dimension D. */
mt_model_config mt_test_cuda_config(mt_family family, bool qkv_bias, bool qk_norm, int64_t H, int64_t KV, int64_t D,
                                    bool tied);
/* Random tile: norm weights near 1 (as trained models have them), the rest N(0, scale); values
 * rounded to bf16 when bf16_valued (for the bf16 path, so the CPU sees the GPU's weights), but
 * for the norms of a layout that streams them in fp32 (mt_layout_keep_norms_f32). */
float *mt_test_random_tile(mt_test_rng *rng, const mt_tile_layout *lay, float scale, bool bf16_valued);
/* A tile's values rounded to bf16 in place, but the norms of a layout with an fp32 side. */
void mt_test_round_tile_bf16(float *tile, const mt_tile_layout *lay);
/* A tile on the device as the step streams it: fp32 as it is (f32), or its elements in bf16 and,
 * for a layout with an fp32 side (mt_layout_keep_norms_f32, what the bf16 path's norm kernels
 * read), its norms' values in it. */
void *mt_test_gpu_tile(const float *tile, const mt_tile_layout *lay, bool f32);
/* Asserts that the elements of a gradient tile outside every present tensor are exactly 0. */
void mt_test_check_padding_zero(const char *what, const mt_tile_layout *lay, const float *dtile);

/* A CUDA suite's main: 77 without a GPU; the attention kernels of MT_ATTENTION (default "own":
 * the own kernels, bitwise reproducible) and MT_ATTENTION_QBLOCK, as the CLI reads them, on this
 * thread's context; then the suite, unforked (CUDA is initialised in this process by the device
 * count, and a forked child could not use it). */
int mt_test_cuda_main(const char *name, Suite *suite);

/* test_cuda's timings (cuda_bench.c), a test case of their own. */
TCase *mt_test_cuda_bench_tcase(void);

#endif
