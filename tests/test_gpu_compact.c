/* The compact host layout on the GPU: the grad_home kernel against the CPU's (the same bf16 bits,
 * the sum of squares within double rounding, repeatable to the bit); one step's bf16 gradients on
 * the GPU against CPU workers and the norm that of the bf16 gradients; what is pinned; pipelined
 * training against the full layout on the GPU. Skips (exit 77) without a GPU. */
#include <check.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cpu/grad_home.h"
#include "backends/cuda/kernels.h"
#include "models/config.h"
#include "runtime/plan.h"
#include "runtime/runtime.h"
#include "runtime/state.h"
#include "runtime/step.h"
#include "tests/testutil.h"

#define CK_CUDA(call)                                                                           \
    do {                                                                                        \
        cudaError_t err_ = (call);                                                              \
        ck_assert_msg(err_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(err_));          \
    } while (0)

/* A double sum of the same squares in another order. */
#define SUMSQ_TOL 1e-12

START_TEST(test_grad_home_kernel)
{
    const int64_t sizes[] = { 0, 1, 77, 1000003 };
    mt_test_rng r;
    mt_test_rng_seed(&r, 3);
    cudaStream_t st;
    CK_CUDA(cudaStreamCreate(&st));
    double *d_sum;
    CK_CUDA(cudaMalloc((void **)&d_sum, 2 * sizeof(double)));
    for (size_t c = 0; c < sizeof sizes / sizeof sizes[0]; c++) {
        const int64_t n = sizes[c];
        const size_t nb = (size_t)(n > 0 ? n : 1);
        float *acc = malloc(sizeof(float) * nb);
        mt_bf16 *cpu = malloc(sizeof(mt_bf16) * nb), *gpu = malloc(sizeof(mt_bf16) * nb);
        mt_test_fill_f32(&r, acc, n, 1e-2f);
        for (int64_t i = 0; i < n; i += 7) { /* exact ties, to even */
            uint32_t b;
            memcpy(&b, &acc[i], sizeof b);
            b = (b & 0xFFFF0000u) | 0x8000u;
            memcpy(&acc[i], &b, sizeof b);
        }
        float *d_acc;
        mt_cuda_bf16 *d_out;
        CK_CUDA(cudaMalloc((void **)&d_acc, sizeof(float) * nb));
        CK_CUDA(cudaMalloc((void **)&d_out, sizeof(mt_bf16) * nb));
        CK_CUDA(cudaMemcpy(d_acc, acc, sizeof(float) * (size_t)n, cudaMemcpyHostToDevice));
        mt_cuda_grad_home(d_acc, d_out, n, d_sum, (mt_cuda_stream)st);
        mt_cuda_grad_home(d_acc, d_out, n, d_sum + 1, (mt_cuda_stream)st);
        CK_CUDA(cudaStreamSynchronize(st));
        double got[2];
        CK_CUDA(cudaMemcpy(got, d_sum, sizeof got, cudaMemcpyDeviceToHost));
        CK_CUDA(cudaMemcpy(gpu, d_out, sizeof(mt_bf16) * (size_t)n, cudaMemcpyDeviceToHost));
        const double want = mt_cpu_grad_home(n, acc, cpu);
        ck_assert_msg(n == 0 || memcmp(cpu, gpu, sizeof(mt_bf16) * (size_t)n) == 0, "n=%lld: bf16 values differ",
                      (long long)n);
        const double err = want > 0 ? fabs(got[0] - want) / want : fabs(got[0]);
        printf("grad_home n=%lld: sum of squares rel err %.3e (tol %.0e)\n", (long long)n, err, SUMSQ_TOL);
        ck_assert_msg(err <= SUMSQ_TOL, "n=%lld: %.17g vs %.17g", (long long)n, got[0], want);
        ck_assert_msg(memcmp(&got[0], &got[1], sizeof(double)) == 0, "n=%lld: not repeatable", (long long)n);
        CK_CUDA(cudaFree(d_acc));
        CK_CUDA(cudaFree(d_out));
        free(acc); free(cpu); free(gpu);
    }
    CK_CUDA(cudaFree(d_sum));
    CK_CUDA(cudaStreamDestroy(st));
}
END_TEST

/* StarPU with the megatrain policy, 4 CPU workers and ncuda CUDA ones, a bf16 state in `layout`
 * with seeded weights, a graph of accum micro-batches of 2 x 77 tokens, their random batch. */
typedef struct fixture {
    mt_host_state *st;
    mt_graph *g;
    int32_t *tok, *tgt;
} fixture;

static fixture fixture_open(bool tied, int ncuda, mt_host_layout layout, int K, int accum, double clip)
{
    mt_runtime_options ro = mt_runtime_defaults();
    ro.sched = "megatrain";
    ro.ncpu = 4;
    ro.ncuda = ncuda;
    char err[512];
    ck_assert_msg(mt_runtime_parse_attention(getenv("MT_ATTENTION"), &ro.cuda.attention, err, sizeof err) == 0, "%s",
                  err);
    ck_assert_msg(mt_runtime_init(&ro, err, sizeof err) == 0, "%s", err);
    const mt_model_config cfg = mt_test_gpu_config(tied);
    const mt_state_args a = { .cfg = &cfg, .compute_dtype = MT_DTYPE_BF16, .layout = layout };
    fixture f;
    f.st = mt_state_create_with(&a, err, sizeof err);
    ck_assert_msg(f.st != NULL, "%s", err);
    mt_state_init_random(f.st, 11, 0.05);
    mt_step_config sc = mt_step_defaults();
    sc.B = 2; sc.T = 77; sc.K = K; sc.accum = accum; sc.head_chunk = 50; sc.clip = clip;
    f.g = mt_graph_create(f.st, &sc, err, sizeof err);
    ck_assert_msg(f.g != NULL, "%s", err);
    const int64_t n = accum * sc.B * sc.T;
    f.tok = malloc(sizeof *f.tok * n);
    f.tgt = malloc(sizeof *f.tgt * n);
    mt_test_rng r;
    mt_test_rng_seed(&r, 99);
    for (int64_t i = 0; i < n; i++) {
        f.tok[i] = (int32_t)(mt_test_uniform(&r) * cfg.vocab);
        f.tgt[i] = mt_test_uniform(&r) < 0.1 ? -1 : (int32_t)(mt_test_uniform(&r) * cfg.vocab);
    }
    return f;
}

static void fixture_close(fixture *f)
{
    starpu_task_wait_for_all();
    free(f->tok);
    free(f->tgt);
    mt_graph_destroy(f->g);
    mt_state_destroy(f->st);
    mt_runtime_shutdown();
}

typedef struct result {
    int ntiles;
    int64_t *numel;
    float **grad;
    double loss, norm;
} result;

/* One step (with its update, so that the norm is reported) in the compact layout; the bf16
 * gradients as fp32. On the GPU, what the GPU copies is pinned and nothing else. */
static result one_step(bool tied, int ncuda, int K, int accum)
{
    fixture f = fixture_open(tied, ncuda, MT_LAYOUT_COMPACT, K, accum, 1.0);
    for (int i = 0; ncuda > 0 && i < f.st->ntiles; i++) {
        const mt_tile *t = &f.st->tiles[i];
        ck_assert_msg(mt_cuda_host_pointer_pinned(t->weights) == 1 && mt_cuda_host_pointer_pinned(t->grad_bf16) == 1,
                      "tile %d: weights or gradient not pinned", i);
        ck_assert_msg(mt_cuda_host_pointer_pinned(t->master_lo) == 0 && mt_cuda_host_pointer_pinned(t->adam_m) == 0,
                      "tile %d: the low half or m pinned", i);
    }
    const int slot = mt_graph_submit_step(f.g, 1, f.tok, f.tgt, 1e-3);
    result res = { .ntiles = f.st->ntiles };
    res.loss = mt_graph_wait_loss(f.g, slot, &res.norm);
    starpu_task_wait_for_all();
    res.numel = calloc(f.st->ntiles, sizeof *res.numel);
    res.grad = calloc(f.st->ntiles, sizeof *res.grad);
    for (int i = 0; i < f.st->ntiles; i++) {
        mt_tile *t = &f.st->tiles[i];
        res.numel[i] = t->numel;
        res.grad[i] = malloc(sizeof(float) * t->numel);
        starpu_data_acquire(t->h_grad, STARPU_R);
        mt_state_read_grad(f.st, i, 0, t->numel, res.grad[i]);
        starpu_data_release(t->h_grad);
    }
    fixture_close(&f);
    return res;
}

/* The bf16 gradients on the GPU within 1e-2 of the CPU workers' (as test_gpu_step's bf16 bound),
 * the loss within 1e-3; and each run's norm is that of its own bf16 gradients. */
static void compare(bool tied, int K, int accum)
{
    result cpu = one_step(tied, 0, K, accum), gpu = one_step(tied, 1, K, accum);
    const double lrel = fabs(gpu.loss - cpu.loss) / cpu.loss;
    printf("compact tied=%d K=%d accum=%d: loss cpu %.8f gpu %.8f (rel %.2e), norm cpu %.6f gpu %.6f\n", tied, K, accum,
           cpu.loss, gpu.loss, lrel, cpu.norm, gpu.norm);
    ck_assert_msg(lrel <= 1e-3, "loss: cpu %.8f gpu %.8f", cpu.loss, gpu.loss);
    const result *both[2] = { &cpu, &gpu };
    for (int k = 0; k < 2; k++) {
        double sum = 0;
        for (int i = 0; i < both[k]->ntiles; i++)
            for (int64_t e = 0; e < both[k]->numel[i]; e++) sum += (double)both[k]->grad[i][e] * both[k]->grad[i][e];
        const double err = fabs(sqrt(sum) - both[k]->norm) / sqrt(sum);
        ck_assert_msg(err <= SUMSQ_TOL, "%s: norm %.17g, its bf16 gradients' %.17g", k ? "gpu" : "cpu", both[k]->norm,
                      sqrt(sum));
    }
    for (int i = 0; i < cpu.ntiles; i++) {
        const double e = mt_test_rel_err_f32(gpu.grad[i], cpu.grad[i], cpu.numel[i]);
        printf("  tile %d gradient rel err %.3e\n", i, e);
        ck_assert_msg(e <= 1e-2, "tile %d gradient: %.3e", i, e);
        free(cpu.grad[i]);
        free(gpu.grad[i]);
    }
    free(cpu.grad); free(gpu.grad); free(cpu.numel); free(gpu.numel);
}

START_TEST(test_compact_gradients_untied) { compare(false, 2, 1); }
END_TEST
START_TEST(test_compact_gradients_tied_accum) { compare(true, 1, 3); }
END_TEST

/* 40 pipelined steps on the GPU on a repeated batch, clipping at 1: compact's loss falls, and its
 * mean over the steps is within 5% of the full layout's (the bound test_gpu_step holds the GPU to
 * against CPU workers), with no speculation. The mean, not the last loss: the batch is learnt
 * by heart, the last losses are a thousandth of the first, and there the bf16 rounding of the
 * compact layout's gradient is a large part of what is left. */
static double train(mt_host_layout layout, int64_t *speculated, double *last)
{
    fixture f = fixture_open(true, 1, layout, 2, 1, 1.0);
    double loss = 0, first = 0, sum = 0;
    int prev = -1;
    for (int s = 1; s <= 41; s++) {
        const int slot = s <= 40 ? mt_graph_submit_step(f.g, s, f.tok, f.tgt, 1e-3) : -1;
        if (prev >= 0) {
            loss = mt_graph_wait_loss(f.g, prev, NULL);
            sum += loss;
            if (s == 2) first = loss;
        }
        prev = slot;
    }
    int64_t held;
    mt_graph_speculation_counts(f.g, speculated, &held);
    fixture_close(&f);
    ck_assert_msg(isfinite(loss) && loss < 0.8 * first, "%s: loss %.4f -> %.4f did not fall",
                  mt_host_layout_name(layout), first, loss);
    *last = loss;
    return sum / 40;
}

START_TEST(test_compact_training)
{
    int64_t spec_full, spec_compact;
    double last_full, last_compact;
    const double full = train(MT_LAYOUT_FULL, &spec_full, &last_full);
    const double compact = train(MT_LAYOUT_COMPACT, &spec_compact, &last_compact);
    printf("40 steps on the GPU, clip 1: mean loss full %.6f, compact %.6f; last full %.6f, compact %.6f\n", full,
           compact, last_full, last_compact);
    ck_assert_msg(fabs(compact - full) <= 0.05 * full, "mean loss compact %.6f, full %.6f", compact, full);
    ck_assert_int_eq(spec_compact, 0);
}
END_TEST

int main(void)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        printf("no GPU: skipped\n");
        return 77;
    }
    Suite *s = suite_create("gpu_compact");
    TCase *tc = tcase_create("compact");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_grad_home_kernel);
    tcase_add_test(tc, test_compact_gradients_untied);
    tcase_add_test(tc, test_compact_gradients_tied_accum);
    tcase_add_test(tc, test_compact_training);
    suite_add_tcase(s, tc);
    /* CUDA is initialised in this process (the device count): the tests run in it */
    return mt_test_run(s, true);
}
