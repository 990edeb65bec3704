/* The whole training step on the GPU against the same step on CPU workers: same weights, same
 * batch, every gradient tile within 1e-2 in bf16 (--dtype bf16, the default on a GPU) and within
 * 1e-5 in fp32 (--dtype fp32: fp32 weights and compute on the GPU too). Skips (exit 77) without
 * a GPU. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "codelets/adamw.h"
#include "backends/cuda/kernels.h"
#include "models/config.h"
#include "runtime/plan.h"
#include "runtime/runtime.h"
#include "runtime/state.h"
#include "runtime/step.h"
#include "runtime/step/graph.h"
#include "tests/testutil.h"

typedef struct result {
    int ntiles;
    int64_t *numel;
    float **grad;
    double loss;
} result;

/* What both kinds of test start from: StarPU with the megatrain policy, ncpu CPU and ncuda CUDA
 * workers; a state in dtype with random weights; a graph for 2 x fixture_T tokens per micro-batch; and
 * accum micro-batches of random tokens and targets (a tenth of the targets ignored when asked). */
typedef struct fixture {
    mt_model_config cfg;
    mt_step_config sc;
    mt_host_state *st;
    mt_graph *g;
    int32_t *tok, *tgt;
} fixture;

/* clip_speculate of the graphs fixture_open builds (-1: the default). */
static int fixture_speculate = -1;
/* offload_checkpoints of those graphs (0: off; 1: on, the graph says so). */
static int fixture_offload = 0;
/* devices of the graphs fixture_open builds on CUDA workers (mt_step_config.devices; 0: one) */
static int fixture_devices = 0;
/* Tokens per sequence of fixture_open's graphs: 77 (no tile multiple), or 128, which every cuDNN 9
 * fused attention backward takes (head dim 64: the default attention is then cuDNN's both ways). */
static int64_t fixture_T = 77;

/* With a CUDA worker every host state allocation is pinned (state.c pins them itself), the
 * second gradients too when `alt`: CUDA says so of each. */
static void assert_pinned(const mt_host_state *st, bool alt)
{
    ck_assert_msg(st->pinned, "host state not pinned");
    for (int i = 0; i < st->ntiles; i++) {
        const mt_tile *t = &st->tiles[i];
        const void *p[6] = { t->weights, t->master, t->grad, t->adam_m, t->adam_v, t->grad_alt };
        for (int k = 0; k < 6; k++) {
            if (k == 5 && !alt) continue;
            ck_assert_msg(p[k] && mt_cuda_host_pointer_pinned(p[k]) == 1, "tile %d allocation %d not pinned", i, k);
        }
    }
}

/* The fixtures' runtimes run the attention MT_ATTENTION names (as the CLI maps it), or the own
 * kernels while a test that compares bits sets this. */
static bool fixture_own_attention;

static fixture fixture_open(bool tied, int ncpu, int ncuda, mt_dtype dtype, uint64_t weight_seed, int K, int accum,
                            double clip, uint64_t data_seed, bool ignore_some)
{
    fixture f;
    mt_runtime_options ro = mt_runtime_defaults();
    ro.sched = "megatrain";
    ro.ncpu = ncpu;
    ro.ncuda = ncuda;
    char err[256];
    ck_assert_msg(mt_runtime_parse_attention(getenv("MT_ATTENTION"), &ro.cuda.attention, err, sizeof err) == 0, "%s",
                  err);
    if (fixture_own_attention) ro.cuda.attention = MT_CUDA_ATTENTION_OWN;
    ck_assert_msg(mt_runtime_init(&ro, err, sizeof err) == 0, "%s", err);
    f.cfg = mt_test_gpu_config(tied);
    f.st = mt_state_create(&f.cfg, dtype, 0, err, sizeof err);
    ck_assert_msg(f.st != NULL, "%s", err);
    if (ncuda > 0) assert_pinned(f.st, false);
    mt_state_init_random(f.st, weight_seed, 0.05);
    f.sc = mt_step_defaults();
    f.sc.B = 2; f.sc.T = fixture_T; f.sc.K = K; f.sc.accum = accum; f.sc.head_chunk = 50; f.sc.clip = clip;
    f.sc.clip_speculate = fixture_speculate;
    f.sc.offload_checkpoints = fixture_offload;
    if (ncuda > 0) f.sc.devices = fixture_devices;
    f.g = mt_graph_create(f.st, &f.sc, err, sizeof err);
    ck_assert_msg(f.g != NULL, "%s", err);
    ck_assert(mt_graph_offloads_checkpoints(f.g) == (fixture_offload == 1));
    /* each micro-batch's dh0, which the table's CPU backward reads, has a pinned host home where a
     * GPU computes (StarPU allocates none of it in its RAM node: graph.c, alloc_homes) */
    for (int u = 0; ncuda > 0 && u < accum; u++)
        ck_assert_int_eq(mt_cuda_host_pointer_pinned(starpu_data_handle_to_pointer(f.g->grad[u][0], STARPU_MAIN_RAM)), 1);
    const int64_t n = accum * f.sc.B * f.sc.T;
    f.tok = malloc(sizeof *f.tok * n);
    f.tgt = malloc(sizeof *f.tgt * n);
    mt_test_rng r;
    mt_test_rng_seed(&r, data_seed);
    for (int64_t i = 0; i < n; i++) {
        f.tok[i] = (int32_t)(mt_test_uniform(&r) * f.cfg.vocab);
        f.tgt[i] = ignore_some && mt_test_uniform(&r) < 0.1 ? -1 : (int32_t)(mt_test_uniform(&r) * f.cfg.vocab);
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

/* One step's gradients (no update) with `ncuda` CUDA workers, weights and compute in dtype. */
static result run(bool tied, int ncuda, int K, int accum, mt_dtype dtype)
{
    fixture f = fixture_open(tied, 2, ncuda, dtype, 11, K, accum, mt_step_defaults().clip, 99, true);
    /* The memory plan counts exactly the buffers the graph registers, on either kind of worker. */
    mt_plan_params pp = { .micro_batch = f.sc.B, .seq_len = f.sc.T, .grad_accum = accum, .checkpoint_interval = K,
                          .compute = dtype, .use_gpu = ncuda > 0, .head_chunk = f.sc.head_chunk,
                          .offload_checkpoints = fixture_offload, .devices = f.sc.devices };
    mt_plan plan;
    ck_assert_msg(mt_plan_compute(&f.cfg, &pp, &plan) == 0, "%s", plan.error);
    uint64_t planned = mt_plan_activation_bytes(&plan) - (ncuda > 0 ? plan.gpu : plan.host)[MT_PLAN_INPUTS];
    ck_assert_msg(mt_graph_working_bytes(f.g) == planned, "ncuda %d: graph %llu bytes, plan %llu", ncuda,
                  (unsigned long long)mt_graph_working_bytes(f.g), (unsigned long long)planned);
    int slot = mt_graph_submit_compute(f.g, 1, f.tok, f.tgt);
    result res = { .ntiles = f.st->ntiles };
    res.loss = mt_graph_wait_loss(f.g, slot, NULL);
    starpu_task_wait_for_all();
    res.numel = calloc(f.st->ntiles, sizeof *res.numel);
    res.grad = calloc(f.st->ntiles, sizeof *res.grad);
    for (int i = 0; i < f.st->ntiles; i++) {
        mt_tile *t = &f.st->tiles[i];
        res.numel[i] = t->numel;
        res.grad[i] = malloc(sizeof(float) * t->numel);
        starpu_data_acquire(t->h_grad, STARPU_R);
        memcpy(res.grad[i], t->grad, sizeof(float) * t->numel);
        starpu_data_release(t->h_grad);
    }
    fixture_close(&f);
    return res;
}

/* Bounds per dtype: ||gpu - cpu|| / ||cpu|| per gradient tile, and the loss's relative error. */
static double grad_tol(mt_dtype dtype) { return dtype == MT_DTYPE_F32 ? 1e-5 : 1e-2; }
static double loss_tol(mt_dtype dtype) { return dtype == MT_DTYPE_F32 ? 1e-6 : 1e-3; }

/* CUDA workers of the GPU runs compare makes */
static int compare_ncuda = 1;

static double norm_f32(const float *a, int64_t n)
{
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += (double)a[i] * a[i];
    return sqrt(s);
}

/* Every tile's error printed (with both norms, which tell garbage from a scale) before the first
 * bound that fails is asserted. */
static void compare(bool tied, int K, int accum, mt_dtype dtype)
{
    result cpu = run(tied, 0, K, accum, dtype);
    result gpu = run(tied, compare_ncuda, K, accum, dtype);
    double lrel = fabs(gpu.loss - cpu.loss) / fabs(cpu.loss);
    printf("%s tied=%d K=%d accum=%d devices=%d: loss cpu %.8f gpu %.8f (rel %.2e)\n", mt_dtype_name(dtype), tied, K,
           accum, fixture_devices, cpu.loss, gpu.loss, lrel);
    int bad = -1;
    double bad_e = 0;
    for (int i = 0; i < cpu.ntiles; i++) {
        double e = mt_test_rel_err_f32(gpu.grad[i], cpu.grad[i], cpu.numel[i]);
        printf("  tile %d gradient rel err %.3e (||gpu|| %.4e, ||cpu|| %.4e)\n", i, e,
               norm_f32(gpu.grad[i], cpu.numel[i]), norm_f32(cpu.grad[i], cpu.numel[i]));
        if (bad < 0 && !(e <= grad_tol(dtype))) { bad = i; bad_e = e; }
        free(cpu.grad[i]);
        free(gpu.grad[i]);
    }
    free(cpu.grad); free(gpu.grad); free(cpu.numel); free(gpu.numel);
    ck_assert_msg(lrel <= loss_tol(dtype), "loss differs: cpu %.8f gpu %.8f", cpu.loss, gpu.loss);
    ck_assert_msg(bad < 0, "tile %d gradient: ||gpu - cpu|| / ||cpu|| = %.3e > %.0e", bad, bad_e, grad_tol(dtype));
}

/* Many short pipelined training steps with updates and clipping, as `megatrain train` submits
 * them (step s+1 before the loss of step s is read), prefetch on: a small model's steps take
 * milliseconds, so the next update's partition of a tile meets the policy's prefetch of it (it
 * aborted StarPU after ~10 steps before the policy held prefetches back during an update).
 * The loss on a repeated batch must fall, and end within 5% of the CPU run's. */
static double train_steps(int ncuda, int steps, double clip, mt_dtype dtype, double *first)
{
    fixture f = fixture_open(true, 4, ncuda, dtype, 5, 2, 1, clip, 7, false);
    double loss = 0;
    int prev = -1;
    for (int s = 1; s <= steps; s++) {
        int slot = mt_graph_submit_step(f.g, s, f.tok, f.tgt, 1e-3);
        if (prev >= 0) {
            loss = mt_graph_wait_loss(f.g, prev, NULL);
            if (s == 2) *first = loss;
        }
        prev = slot;
    }
    loss = mt_graph_wait_loss(f.g, prev, NULL);
    fixture_close(&f);
    return loss;
}

/* 40 steps in dtype; the GPU's final loss within `tol` (relative) of the CPU's. */
static void pipelined(mt_dtype dtype, double tol)
{
    /* Clipping at 1.0 (plain while the norm is above it, speculative once it is within), and none
     * (the table's update started before its embedding backward every step). */
    const double clips[2] = { 1.0, 0.0 };
    for (int k = 0; k < 2; k++) {
        double first_cpu, first_gpu;
        double cpu = train_steps(0, 40, clips[k], dtype, &first_cpu), gpu = train_steps(1, 40, clips[k], dtype, &first_gpu);
        printf("%s, 40 steps, clip %g: loss cpu %.6f -> %.6f, gpu %.6f -> %.6f\n", mt_dtype_name(dtype), clips[k],
               first_cpu, cpu, first_gpu, gpu);
        ck_assert_msg(isfinite(gpu) && gpu < 0.8 * first_gpu, "clip %g: gpu loss %.4f -> %.4f did not fall", clips[k],
                      first_gpu, gpu);
        ck_assert_msg(fabs(gpu - cpu) <= tol * cpu + 1e-4, "%s, clip %g, after 40 steps: gpu loss %.6f, cpu %.6f",
                      mt_dtype_name(dtype), clips[k], gpu, cpu);
    }
}

START_TEST(test_pipelined_training_steps) { pipelined(MT_DTYPE_BF16, 0.05); }
END_TEST
/* fp32 on both: the same arithmetic up to summation order, so the runs stay 10x closer. */
START_TEST(test_pipelined_training_steps_f32) { pipelined(MT_DTYPE_F32, 0.005); }
END_TEST

/* master, m and v of every tile after `steps` pipelined bf16 steps on the GPU, clipping at 0.05
 * (the scale below 1 every step), with clip_speculate `speculate`; *checked: the elements ranged
 * runs checked. */
typedef struct state_copy { int ntiles; int64_t *numel; float **master, **m, **v; bool deferred; } state_copy;
/* K of clipped_steps' graphs. */
static int fixture_K = 2;

static state_copy clipped_steps(int speculate, int steps, int64_t *checked)
{
    fixture_speculate = speculate;
    fixture f = fixture_open(true, 4, 1, MT_DTYPE_BF16, 5, fixture_K, 1, 0.05, 7, false);
    fixture_speculate = -1;
    const mt_ranged_counts c0 = mt_adamw_stats_ranged(mt_graph_adamw_stats(f.g));
    int prev = -1;
    for (int s = 1; s <= steps; s++) {
        int slot = mt_graph_submit_step(f.g, s, f.tok, f.tgt, 1e-3);
        if (prev >= 0) mt_graph_wait_loss(f.g, prev, NULL);
        prev = slot;
    }
    mt_graph_wait_loss(f.g, prev, NULL);
    mt_graph_flush(f.g);
    starpu_task_wait_for_all();
    *checked = mt_adamw_stats_ranged(mt_graph_adamw_stats(f.g)).checked - c0.checked;
    state_copy c = { .ntiles = f.st->ntiles, .deferred = mt_graph_defers(f.g) };
    if (c.deferred) assert_pinned(f.st, true);
    c.numel = calloc(c.ntiles, sizeof *c.numel);
    float ***dst[3] = { &c.master, &c.m, &c.v };
    for (int k = 0; k < 3; k++) *dst[k] = calloc(c.ntiles, sizeof(float *));
    for (int i = 0; i < c.ntiles; i++) {
        const mt_tile *t = &f.st->tiles[i];
        const float *src[3] = { t->master, t->adam_m, t->adam_v };
        c.numel[i] = t->numel;
        for (int k = 0; k < 3; k++) {
            (*dst[k])[i] = malloc(sizeof(float) * t->numel);
            memcpy((*dst[k])[i], src[k], sizeof(float) * t->numel);
        }
    }
    fixture_close(&f);
    return c;
}

/* clipped_steps with the moments of plain clipping, at K = 1, checkpoints offloaded or not. */
static state_copy offload_steps(int offload, int64_t *checked)
{
    fixture_offload = offload;
    fixture_K = 1;
    state_copy c = clipped_steps(0, 5, checked);
    fixture_K = 2;
    fixture_offload = 0;
    return c;
}

static bool states_equal(const state_copy *a, const state_copy *b, char *what, size_t n)
{
    for (int i = 0; i < a->ntiles; i++) {
        const float *pa[3] = { a->master[i], a->m[i], a->v[i] }, *pb[3] = { b->master[i], b->m[i], b->v[i] };
        for (int k = 0; k < 3; k++)
            if (memcmp(pa[k], pb[k], sizeof(float) * a->numel[i]) != 0) {
                snprintf(what, n, "tile %d %s", i, k == 0 ? "master" : k == 1 ? "m" : "v");
                return false;
            }
    }
    return true;
}

static void state_copy_free(state_copy *c)
{
    for (int i = 0; i < c->ntiles; i++) { free(c->master[i]); free(c->m[i]); free(c->v[i]); }
    free(c->master); free(c->m); free(c->v); free(c->numel);
}

/* With a GPU and bf16 weights the default speculation is ranged once the scale is below 1, with
 * the moments halves deferred (adamw_defer auto): its updates are the plain clipped ones bit for
 * bit. Only as exact as the GPU's gradients are
 * repeatable, so the plain run is made twice first: when those two differ, the GPU is not
 * deterministic here and the test says so and checks nothing more. */
START_TEST(test_default_ranged_bitwise)
{
    int64_t checked_off, checked_off2, checked_auto;
    /* the own attention kernels: cuDNN's backward (the default where it loads and takes the
     * shape) is not bitwise reproducible, and this compares bits */
    fixture_own_attention = true;
    state_copy off = clipped_steps(0, 5, &checked_off);
    state_copy off2 = clipped_steps(0, 5, &checked_off2);
    state_copy au = clipped_steps(-1, 5, &checked_auto);
    char what[64];
    printf("default speculation, clip 0.05, 5 steps on the GPU: ranged runs checked %lld elements\n",
           (long long)checked_auto);
    ck_assert_msg(checked_off == 0 && checked_auto > 0, "ranged runs: %lld without speculation, %lld by default",
                  (long long)checked_off, (long long)checked_auto);
    /* the defaults defer the moments halves with ranged speculation (adamw_defer auto) */
    ck_assert_msg(!off.deferred && au.deferred, "moments deferred: %d without speculation, %d by default", off.deferred,
                  au.deferred);
    if (!states_equal(&off, &off2, what, sizeof what)) {
        printf("the plain GPU run is not repeatable bit for bit (%s differs): ranged vs plain not compared\n", what);
    } else {
        ck_assert_msg(states_equal(&off, &au, what, sizeof what), "default (ranged) vs plain clipping: %s differs", what);
    }
    fixture_own_attention = false;
    state_copy_free(&au);
    state_copy_free(&off2);
    state_copy_free(&off);
}
END_TEST

/* Checkpoints in host memory (written through, fetched back ahead of their recompute) give the
 * GPU's own bits: master, m and v after 5 clipped steps at K = 1 (three blocks, two offloaded),
 * against the same run with them on the GPU; only where the plain run repeats bit for bit. */
START_TEST(test_offload_checkpoints_bitwise)
{
    fixture_own_attention = true;
    int64_t checked;
    state_copy off = offload_steps(0, &checked);
    state_copy off2 = offload_steps(0, &checked);
    state_copy on = offload_steps(1, &checked);
    char what[64];
    if (!states_equal(&off, &off2, what, sizeof what)) {
        printf("the plain GPU run is not repeatable bit for bit (%s differs): offloaded vs plain not compared\n", what);
    } else {
        ck_assert_msg(states_equal(&off, &on, what, sizeof what), "offloaded vs plain checkpoints: %s differs", what);
    }
    fixture_own_attention = false;
    state_copy_free(&on);
    state_copy_free(&off2);
    state_copy_free(&off);
}
END_TEST

/* The GPU step with offloaded checkpoints (the plan's count of them in flight held to the graph's)
 * against CPU workers, two micro-batches at K = 1. */
START_TEST(test_step_gradients_offloaded)
{
    fixture_offload = 1;
    compare(true, 1, 2, MT_DTYPE_BF16);
    fixture_offload = 0;
}
END_TEST

START_TEST(test_step_gradients_untied) { compare(false, 2, 1, MT_DTYPE_BF16); }
END_TEST
START_TEST(test_step_gradients_tied_accum) { compare(true, 1, 2, MT_DTYPE_BF16); }
END_TEST
START_TEST(test_step_gradients_t128)
{
    fixture_T = 128;
    compare(false, 2, 1, MT_DTYPE_BF16);
    fixture_T = 77;
}
END_TEST
START_TEST(test_step_gradients_untied_f32) { compare(false, 2, 1, MT_DTYPE_F32); }
END_TEST
START_TEST(test_step_gradients_tied_accum_f32) { compare(true, 1, 2, MT_DTYPE_F32); }
END_TEST
/* untied with accumulation: the embedding backward's = then += on the GPU */
START_TEST(test_step_gradients_untied_accum_f32) { compare(false, 1, 4, MT_DTYPE_F32); }
END_TEST

/* GPUs StarPU found (main) */
static int gpus_found;

/* Two devices: micro-batch u on device u mod 2, device 1's gradient copies added into device 0's by
 * the CUDA grad_sum after each tile's last backward, against CPU workers (one device), four
 * micro-batches (two for one each), in bf16 and fp32, tied and untied. With two GPUs or more,
 * two of them (device 1's copies travel to device 0's GPU); with one, two CUDA workers on it
 * (STARPU_NWORKER_PER_CUDA=2). */
static void compare_two_devices(bool tied, int K, int accum, mt_dtype dtype)
{
    if (gpus_found < 2) setenv("STARPU_NWORKER_PER_CUDA", "2", 1);
    compare_ncuda = gpus_found < 2 ? 1 : 2;
    fixture_devices = 2;
    compare(tied, K, accum, dtype);
    fixture_devices = 0;
    compare_ncuda = 1;
    unsetenv("STARPU_NWORKER_PER_CUDA");
}

START_TEST(test_step_gradients_two_devices) { compare_two_devices(true, 2, 4, MT_DTYPE_BF16); }
END_TEST
START_TEST(test_step_gradients_two_devices_untied_f32) { compare_two_devices(false, 1, 4, MT_DTYPE_F32); }
END_TEST
START_TEST(test_step_gradients_two_devices_tied_f32) { compare_two_devices(true, 1, 4, MT_DTYPE_F32); }
END_TEST
/* one micro-batch per device: every copy written once (=), none accumulated */
START_TEST(test_step_gradients_two_devices_one_each_f32) { compare_two_devices(false, 1, 2, MT_DTYPE_F32); }
END_TEST

int main(void)
{
    /* Skip when StarPU finds no CUDA worker. */
    mt_runtime_options ro = mt_runtime_defaults();
    ro.ncpu = 1;
    char err[256];
    if (mt_runtime_init(&ro, err, sizeof err) != 0) return 77;
    int ncuda = mt_runtime_ncuda();
    gpus_found = ncuda;
    mt_runtime_shutdown();
    if (ncuda == 0) {
        printf("no GPU: skipped\n");
        return 77;
    }
    Suite *s = suite_create("gpu_step");
    TCase *tc = tcase_create("step");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_step_gradients_untied);
    tcase_add_test(tc, test_step_gradients_tied_accum);
    tcase_add_test(tc, test_step_gradients_t128);
    tcase_add_test(tc, test_step_gradients_untied_f32);
    tcase_add_test(tc, test_step_gradients_tied_accum_f32);
    tcase_add_test(tc, test_step_gradients_untied_accum_f32);
    tcase_add_test(tc, test_pipelined_training_steps);
    tcase_add_test(tc, test_pipelined_training_steps_f32);
    tcase_add_test(tc, test_default_ranged_bitwise);
    tcase_add_test(tc, test_offload_checkpoints_bitwise);
    tcase_add_test(tc, test_step_gradients_offloaded);
    tcase_add_test(tc, test_step_gradients_two_devices);
    tcase_add_test(tc, test_step_gradients_two_devices_untied_f32);
    tcase_add_test(tc, test_step_gradients_two_devices_tied_f32);
    tcase_add_test(tc, test_step_gradients_two_devices_one_each_f32);
    suite_add_tcase(s, tc);
    return mt_test_run(s, true);
}
