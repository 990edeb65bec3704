/* The memory plan's GPU side (the buffers, StarPU's margin and the CUDA context against the
 * device) and the choice of K under --checkpoint-every auto on either side. */
#include <check.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backends/cpu/ops.h"
#include "codelets/codelets.h"
#include "mt_build_config.h"
#include "models/config.h"
#include "runtime/plan.h"
#include "tests/testutil.h"

#define GiB ((uint64_t)1 << 30)

/* The GPU side: what the device must hold is the buffers, StarPU's margin (bench's cap: 2% and
 * 256 MiB) and the CUDA context; the check refuses one byte short of it, naming the kinds, and a
 * plan without a GPU has no GPU side. */
START_TEST(test_gpu_check)
{
    mt_model_config c;
    ck_assert_int_eq(mt_config_from_shape("qwen2.5-0.5b", &c), 0);
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 61);
    for (int trial = 0; trial < 6; trial++) {
        mt_plan_params p = { .micro_batch = 1 + (int64_t)(mt_test_uniform(&rng) * 8),
                             .seq_len = 256 * (1 + (int64_t)(mt_test_uniform(&rng) * 16)),
                             .grad_accum = 1 + (int64_t)(mt_test_uniform(&rng) * 3),
                             .checkpoint_interval = 1 + (int64_t)(mt_test_uniform(&rng) * 24),
                             .compute = MT_DTYPE_BF16, .use_gpu = true, .layout = trial % 2 ? MT_LAYOUT_COMPACT : MT_LAYOUT_FULL };
        mt_plan plan;
        ck_assert_msg(mt_plan_compute(&c, &p, &plan) == 0, "%s", plan.error);
        const uint64_t g = plan.gpu_total;
        ck_assert_uint_gt(g, 0);
        ck_assert_uint_eq(plan.gpu_margin, g * 2 / 100 + ((uint64_t)256 << 20));
        ck_assert_uint_eq(plan.gpu_context, MT_PLAN_GPU_CONTEXT_BYTES);
        ck_assert_uint_eq(plan.gpu_need, g + plan.gpu_margin + plan.gpu_context);
        /* bench's STARPU_LIMIT_CUDA_MEM as it was written before the plan gave it */
        ck_assert_uint_eq(mt_plan_gpu_limit_mib(&plan), ((g + g / 50) >> 20) + 256);
        char err[1536];
        ck_assert_msg(mt_plan_check_gpu(&plan, plan.gpu_need, err, sizeof err) == 0, "%s", err);
        ck_assert_int_eq(mt_plan_check_gpu(&plan, plan.gpu_need - 1, err, sizeof err), -1);
        char need[64];
        snprintf(need, sizeof need, "needs %" PRIu64 " bytes", plan.gpu_need);
        ck_assert_msg(strstr(err, need), "%s", err);
        ck_assert_msg(strstr(err, "weights and gradients in flight") && strstr(err, "checkpoints") &&
                          strstr(err, "workspaces") && strstr(err, "CUDA context"), "%s", err);
    }
    mt_plan_params cpu = { .micro_batch = 3, .seq_len = 512, .grad_accum = 1, .checkpoint_interval = 2,
                           .compute = MT_DTYPE_F32, .use_gpu = false };
    mt_plan plan;
    ck_assert_int_eq(mt_plan_compute(&c, &cpu, &plan), 0);
    ck_assert_uint_eq(plan.gpu_need, 0);
    char err[1536];
    ck_assert_int_eq(mt_plan_check_gpu(&plan, 1, err, sizeof err), 0);
    /* where the GPU's size comes from */
    const char *source;
    ck_assert_uint_eq(mt_plan_gpu_memory(5 * GiB, 1, &source), 5 * GiB);
    ck_assert_str_eq(source, "--gpu-memory");
    ck_assert_uint_eq(mt_plan_gpu_memory(5 * GiB, 0, &source), 0);
    ck_assert_str_eq(source, "none");
    ck_assert_uint_eq(mt_plan_gpu_memory(0, 1, &source), mt_gpu_memory_total());
#if !MT_HAVE_CUDA
    ck_assert_uint_eq(mt_gpu_memory_total(), 0);
#endif
}
END_TEST

/* Auto K on the GPU side: against a device size between the K's needs, the choice is the largest
 * K that fits (brute force over every K); K+1 does not fit unless K is every layer; an explicit K
 * is kept as given; a device smaller than every K's need is refused at the K nearest to fitting. */
START_TEST(test_auto_k_gpu)
{
    mt_model_config c;
    ck_assert_int_eq(mt_config_from_shape("qwen2.5-0.5b", &c), 0);
    const int64_t L = c.layers;
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 67);
    for (int trial = 0; trial < 5; trial++) {
        mt_plan_params p = { .micro_batch = 2 + (int64_t)(mt_test_uniform(&rng) * 14),
                             .seq_len = 1024 * (1 + (int64_t)(mt_test_uniform(&rng) * 4)),
                             .grad_accum = 1 + (int64_t)(mt_test_uniform(&rng) * 2),
                             .checkpoint_interval = MT_PLAN_K_AUTO, .compute = MT_DTYPE_BF16, .use_gpu = true };
        uint64_t need[64], lo = UINT64_MAX, hi = 0;
        for (int64_t K = 1; K <= L; K++) {
            mt_plan_params q = p;
            q.checkpoint_interval = K;
            mt_plan plan;
            ck_assert_int_eq(mt_plan_compute(&c, &q, &plan), 0);
            need[K] = plan.gpu_need;
            if (need[K] < lo) lo = need[K];
            if (need[K] > hi) hi = need[K];
        }
        ck_assert_uint_lt(lo, hi);
        const uint64_t device = lo + (uint64_t)((double)(hi - lo) * (0.1 + 0.8 * mt_test_uniform(&rng)));
        int64_t expect = 0;
        for (int64_t K = L; K >= 1 && !expect; K--)
            if (need[K] <= device) expect = K;
        ck_assert_int_gt(expect, 0);
        mt_plan plan;
        mt_run_choice run;
        ck_assert_msg(mt_plan_choose_run(&c, &p, MT_LAYOUT_AUTO, 1ULL << 50, device, &plan, &run) == 0, "%s", plan.error);
        ck_assert(run.k_auto && run.gpu_checked && run.fits);
        ck_assert_int_eq(run.K, expect);
        ck_assert_int_eq(plan.params.checkpoint_interval, expect);
        ck_assert_uint_le(plan.gpu_need, device);
        if (expect < L) {
            ck_assert_uint_gt(need[expect + 1], device);
            ck_assert_msg(strstr(run.why_k, "needs") != NULL, "%s", run.why_k);
        }
        char err[2048];
        ck_assert_int_eq(mt_plan_run_refusal(&plan, &run, err, sizeof err), 0);
        /* explicit K: kept, and refused when it does not fit */
        for (int64_t K = 1; K <= L; K += 5) {
            mt_plan_params q = p;
            q.checkpoint_interval = K;
            ck_assert_int_eq(mt_plan_choose_run(&c, &q, MT_LAYOUT_AUTO, 1ULL << 50, device, &plan, &run), 0);
            ck_assert(!run.k_auto);
            ck_assert_int_eq(run.K, K);
            ck_assert(run.fits == (need[K] <= device));
            ck_assert_int_eq(mt_plan_run_refusal(&plan, &run, err, sizeof err), need[K] <= device ? 0 : -1);
        }
        /* nothing fits: the K of the least need, refused with the GPU's numbers */
        int64_t least = L;
        for (int64_t K = L; K >= 1; K--)
            if (need[K] < need[least]) least = K;
        ck_assert_int_eq(mt_plan_choose_run(&c, &p, MT_LAYOUT_AUTO, 1ULL << 50, lo - 1, &plan, &run), 0);
        ck_assert(!run.fits && !run.gpu_fits && run.k_auto);
        ck_assert_int_eq(run.K, least);
        ck_assert_int_eq(mt_plan_run_refusal(&plan, &run, err, sizeof err), -1);
        ck_assert_msg(strstr(err, "no K from 1 to 24 fits") && strstr(err, "not enough GPU memory"), "%s", err);
    }
}
END_TEST

/* Checkpoints offloaded to host memory: on the GPU only those in flight (a block boundary's
 * micro-batches, one more, one fetched ahead: accum + 2, at most all), in pinned host memory every
 * block's but the last; every other kind as with them off. A CPU plan is the same either way. */
START_TEST(test_offload_figures)
{
    ck_assert_int_eq(mt_plan_offload_in_flight(1, 1), 1);
    ck_assert_int_eq(mt_plan_offload_in_flight(2, 1), 2);
    ck_assert_int_eq(mt_plan_offload_in_flight(36, 1), 3);
    ck_assert_int_eq(mt_plan_offload_in_flight(2, 3), 5);
    ck_assert_int_eq(mt_plan_offload_in_flight(9, 4), 6);
    mt_model_config c;
    ck_assert_int_eq(mt_config_from_shape("qwen2.5-0.5b", &c), 0);
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 71);
    for (int trial = 0; trial < 8; trial++) {
        mt_plan_params p = { .micro_batch = 1 + (int64_t)(mt_test_uniform(&rng) * 4),
                             .seq_len = 512 * (1 + (int64_t)(mt_test_uniform(&rng) * 8)),
                             .grad_accum = 1 + (int64_t)(mt_test_uniform(&rng) * 3),
                             .checkpoint_interval = 1 + (int64_t)(mt_test_uniform(&rng) * 24),
                             .compute = MT_DTYPE_BF16, .use_gpu = true,
                             .layout = trial % 2 ? MT_LAYOUT_COMPACT : MT_LAYOUT_FULL };
        mt_plan off, on;
        ck_assert_msg(mt_plan_compute(&c, &p, &off) == 0, "%s", off.error);
        p.offload_checkpoints = MT_PLAN_OFFLOAD_ON;
        ck_assert_msg(mt_plan_compute(&c, &p, &on) == 0, "%s", on.error);
        const int64_t nb = (24 + p.checkpoint_interval - 1) / p.checkpoint_interval, M = p.grad_accum;
        const uint64_t hidden = (uint64_t)(p.micro_batch * p.seq_len) * 896 * 4;
        const int64_t flight = nb * M < M + 2 ? nb * M : M + 2;
        ck_assert_int_eq(off.gpu_checkpoints, nb * M);
        ck_assert_int_eq(off.host_checkpoints, 0);
        ck_assert_uint_eq(off.gpu[MT_PLAN_CHECKPOINTS], (uint64_t)(nb * M) * hidden);
        ck_assert_uint_eq(off.host[MT_PLAN_CHECKPOINTS], 0);
        ck_assert_int_eq(on.gpu_checkpoints, flight);
        ck_assert_int_eq(on.host_checkpoints, (nb - 1) * M);
        ck_assert_uint_eq(on.gpu[MT_PLAN_CHECKPOINTS], (uint64_t)flight * hidden);
        ck_assert_uint_eq(on.host[MT_PLAN_CHECKPOINTS], (uint64_t)((nb - 1) * M) * hidden);
        ck_assert(on.host_pinned[MT_PLAN_CHECKPOINTS]);
        for (int k = 0; k < MT_PLAN_KIND_COUNT; k++) {
            if (k == MT_PLAN_CHECKPOINTS) continue;
            ck_assert_uint_eq(on.gpu[k], off.gpu[k]);
            ck_assert_uint_eq(on.host[k], off.host[k]);
        }
        ck_assert_uint_eq(off.gpu_total - on.gpu_total, (uint64_t)(nb * M - flight) * hidden);
        ck_assert_uint_eq(on.host_total - off.host_total, (uint64_t)((nb - 1) * M) * hidden);
        ck_assert_uint_eq(on.host_pinned_total - off.host_pinned_total, (uint64_t)((nb - 1) * M) * hidden);
        /* the printout names the choice, the refusal offers it when off */
        char *text = NULL;
        size_t len = 0;
        FILE *f = open_memstream(&text, &len);
        mt_plan_print(&on, f);
        fclose(f);
        char line[128];
        snprintf(line, sizeof line, "checkpoints offloaded: %" PRId64 " in pinned host memory, %" PRId64 " on the GPU",
                 (nb - 1) * M, flight);
        ck_assert_msg(strstr(text, line), "%s", text);
        free(text);
        char err[1536];
        ck_assert_int_eq(mt_plan_check_gpu(&off, off.gpu_need - 1, err, sizeof err), -1);
        ck_assert_msg(strstr(err, "all on the GPU") && strstr(err, "--offload-checkpoints on"), "%s", err);
        ck_assert_int_eq(mt_plan_check_gpu(&on, on.gpu_need - 1, err, sizeof err), -1);
        snprintf(line, sizeof line, "offloaded: %" PRId64 " in flight on the GPU", flight);
        ck_assert_msg(strstr(err, line) && !strstr(err, "--offload-checkpoints on"), "%s", err);
        /* a CPU plan holds them in host memory either way */
        mt_plan cpu_off, cpu_on;
        p.use_gpu = false;
        p.compute = MT_DTYPE_F32;
        p.layout = MT_LAYOUT_FULL;
        ck_assert_int_eq(mt_plan_compute(&c, &p, &cpu_on), 0);
        p.offload_checkpoints = MT_PLAN_OFFLOAD_OFF;
        ck_assert_int_eq(mt_plan_compute(&c, &p, &cpu_off), 0);
        ck_assert_uint_eq(cpu_on.host_total, cpu_off.host_total);
        ck_assert_uint_eq(cpu_on.host[MT_PLAN_CHECKPOINTS], (uint64_t)(nb * M) * hidden);
        ck_assert_uint_eq(cpu_on.gpu_total, 0);
    }
    /* a value that is none of the three is refused */
    mt_plan_params bad = { .micro_batch = 1, .seq_len = 64, .grad_accum = 1, .checkpoint_interval = 1,
                           .compute = MT_DTYPE_BF16, .use_gpu = true, .offload_checkpoints = 2 };
    mt_plan plan;
    ck_assert_int_eq(mt_plan_compute(&c, &bad, &plan), -1);
    ck_assert_msg(strstr(plan.error, "checkpoint offload 2"), "%s", plan.error);
}
END_TEST

/* --offload-checkpoints auto: off where the plan with every checkpoint on the GPU fits, on where
 * only the offloaded one does (at the given K, or with auto's K the largest K that fits
 * offloaded), the nearer when neither fits; off without a GPU or a device size. */
START_TEST(test_offload_auto)
{
    mt_model_config c;
    ck_assert_int_eq(mt_config_from_shape("qwen2.5-0.5b", &c), 0);
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 73);
    for (int trial = 0; trial < 4; trial++) {
        mt_plan_params p = { .micro_batch = 1 + (int64_t)(mt_test_uniform(&rng) * 2),
                             .seq_len = 4096 * (1 + (int64_t)(mt_test_uniform(&rng) * 4)),
                             .grad_accum = 1 + (int64_t)(mt_test_uniform(&rng) * 2), .checkpoint_interval = 1,
                             .compute = MT_DTYPE_BF16, .use_gpu = true, .offload_checkpoints = MT_PLAN_OFFLOAD_AUTO };
        mt_plan off, on, plan;
        mt_plan_params q = p;
        q.offload_checkpoints = MT_PLAN_OFFLOAD_OFF;
        ck_assert_int_eq(mt_plan_compute(&c, &q, &off), 0);
        q.offload_checkpoints = MT_PLAN_OFFLOAD_ON;
        ck_assert_int_eq(mt_plan_compute(&c, &q, &on), 0);
        ck_assert_uint_lt(on.gpu_need, off.gpu_need);
        const uint64_t between = on.gpu_need + (uint64_t)((double)(off.gpu_need - on.gpu_need) * mt_test_uniform(&rng));
        mt_run_choice run;
        /* fits with them on the GPU: off */
        ck_assert_int_eq(mt_plan_choose_run(&c, &p, MT_LAYOUT_AUTO, 1ULL << 50, off.gpu_need, &plan, &run), 0);
        ck_assert(run.fits && run.offload_auto && !run.offload);
        ck_assert_int_eq(plan.params.offload_checkpoints, MT_PLAN_OFFLOAD_OFF);
        ck_assert(!mt_plan_offload_needed(&c, &p, off.gpu_need));
        /* only offloaded: on */
        ck_assert_int_eq(mt_plan_choose_run(&c, &p, MT_LAYOUT_AUTO, 1ULL << 50, between, &plan, &run), 0);
        ck_assert_msg(run.fits && run.offload, "%s", run.why_offload);
        ck_assert_int_eq(plan.params.offload_checkpoints, MT_PLAN_OFFLOAD_ON);
        ck_assert_uint_eq(plan.gpu_need, on.gpu_need);
        ck_assert_msg(strstr(run.why_offload, "does not fit, with them offloaded it does"), "%s", run.why_offload);
        ck_assert(mt_plan_offload_needed(&c, &p, between));
        /* neither: offloaded is nearer, refused */
        ck_assert_int_eq(mt_plan_choose_run(&c, &p, MT_LAYOUT_AUTO, 1ULL << 50, on.gpu_need - 1, &plan, &run), 0);
        ck_assert(!run.fits && run.offload);
        char err[2048];
        ck_assert_int_eq(mt_plan_run_refusal(&plan, &run, err, sizeof err), -1);
        /* no device size, no GPU: off */
        ck_assert_int_eq(mt_plan_choose_run(&c, &p, MT_LAYOUT_AUTO, 1ULL << 50, 0, &plan, &run), 0);
        ck_assert(!run.offload && !run.gpu_checked);
        ck_assert(!mt_plan_offload_needed(&c, &p, 0));
        mt_plan_params cpu = p;
        cpu.use_gpu = false;
        cpu.compute = MT_DTYPE_F32;
        ck_assert_int_eq(mt_plan_choose_run(&c, &cpu, MT_LAYOUT_AUTO, 1ULL << 50, between, &plan, &run), 0);
        ck_assert(!run.offload);
        /* explicit: as asked, fitting or not */
        q = p;
        q.offload_checkpoints = MT_PLAN_OFFLOAD_OFF;
        ck_assert_int_eq(mt_plan_choose_run(&c, &q, MT_LAYOUT_AUTO, 1ULL << 50, between, &plan, &run), 0);
        ck_assert(!run.offload && !run.fits && !run.offload_auto);
        q.offload_checkpoints = MT_PLAN_OFFLOAD_ON;
        ck_assert_int_eq(mt_plan_choose_run(&c, &q, MT_LAYOUT_AUTO, 1ULL << 50, off.gpu_need, &plan, &run), 0);
        ck_assert(run.offload && run.fits);
        /* with auto's K: the largest K that fits offloaded, when no K fits with them on the GPU */
        p.checkpoint_interval = MT_PLAN_K_AUTO;
        uint64_t least_off = UINT64_MAX, need_on[25];
        for (int64_t K = 1; K <= 24; K++) {
            mt_plan_params r = p;
            r.checkpoint_interval = K;
            r.offload_checkpoints = MT_PLAN_OFFLOAD_OFF;
            ck_assert_int_eq(mt_plan_compute(&c, &r, &plan), 0);
            if (plan.gpu_need < least_off) least_off = plan.gpu_need;
            r.offload_checkpoints = MT_PLAN_OFFLOAD_ON;
            ck_assert_int_eq(mt_plan_compute(&c, &r, &plan), 0);
            need_on[K] = plan.gpu_need;
        }
        const uint64_t device = least_off - 1;
        int64_t expect = 0;
        for (int64_t K = 24; K >= 1 && !expect; K--)
            if (need_on[K] <= device) expect = K;
        ck_assert_int_eq(mt_plan_choose_run(&c, &p, MT_LAYOUT_AUTO, 1ULL << 50, device, &plan, &run), 0);
        if (expect) {
            ck_assert_msg(run.fits && run.offload && run.k_auto, "%s / %s", run.why_k, run.why_offload);
            ck_assert_int_eq(run.K, expect);
        } else {
            ck_assert(!run.fits);
        }
    }
}
END_TEST

/* Auto K on a CPU plan: the host side alone decides (the checkpoints and the block live there),
 * the choice the largest K within the usable share, and no GPU side (a device size is ignored). */
/* host[K] for K = 1 .. the layers: the host total of p at K under the layout `request`, against
 * an unbounded host. */
static void host_by_k(const mt_model_config *c, const mt_plan_params *p, mt_host_layout request, uint64_t *host)
{
    for (int64_t K = 1; K <= c->layers; K++) {
        mt_plan_params q = *p;
        q.checkpoint_interval = K;
        mt_plan plan;
        mt_layout_choice choice;
        ck_assert_int_eq(mt_plan_choose(c, &q, request, 1ULL << 50, &plan, &choice), 0);
        host[K] = choice.host_total;
    }
}

START_TEST(test_auto_k_host)
{
    mt_model_config c;
    ck_assert_int_eq(mt_config_from_shape("qwen2.5-0.5b", &c), 0);
    const int64_t L = c.layers;
    mt_plan_params p = { .micro_batch = 8, .seq_len = 2048, .grad_accum = 1, .checkpoint_interval = MT_PLAN_K_AUTO,
                         .compute = MT_DTYPE_F32, .use_gpu = false };
    uint64_t host[64], lo = UINT64_MAX, hi = 0;
    host_by_k(&c, &p, MT_LAYOUT_AUTO, host);
    for (int64_t K = 1; K <= L; K++) {
        if (host[K] < lo) lo = host[K];
        if (host[K] > hi) hi = host[K];
    }
    ck_assert_uint_lt(lo, hi);
    /* available such that the usable 90% lies between the least and the most */
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 71);
    const uint64_t usable = lo + (uint64_t)((double)(hi - lo) * (0.2 + 0.6 * mt_test_uniform(&rng)));
    const uint64_t available = usable / 90 * 100 + 100;
    int64_t expect = 0;
    for (int64_t K = L; K >= 1 && !expect; K--)
        if (host[K] <= available / 100 * 90) expect = K;
    mt_plan plan;
    mt_run_choice run;
    ck_assert_int_eq(mt_plan_choose_run(&c, &p, MT_LAYOUT_AUTO, available, 1, &plan, &run), 0);
    ck_assert(run.fits && !run.gpu_checked && run.k_auto);
    ck_assert_int_eq(run.K, expect);
    if (expect < L) ck_assert_uint_gt(host[expect + 1], available / 100 * 90);
}
END_TEST

/* A default K (k_default) whose plan does not fit gives way to the smallest larger K that fits;
 * the same K asked for is refused as it is; a default that fits stays. The host side only (the
 * GPU not checked), where a larger K offloads fewer checkpoints; the compact layout asked (the
 * full one falls back to its plain form) so that fitting is one total against the usable share. */
START_TEST(test_default_k_gives_way)
{
    mt_model_config c;
    ck_assert_int_eq(mt_config_from_shape("qwen2.5-0.5b", &c), 0);
    const int64_t L = c.layers, k0 = 2;
    mt_plan_params p = { .micro_batch = 8, .seq_len = 2048, .grad_accum = 1, .checkpoint_interval = k0,
                         .compute = MT_DTYPE_BF16, .use_gpu = true, .offload_checkpoints = MT_PLAN_OFFLOAD_ON };
    uint64_t host[64];
    host_by_k(&c, &p, MT_LAYOUT_COMPACT, host);
    /* the usable share just below the default's need: the nearest larger K under it */
    const uint64_t available = (host[k0] - 1) / 90 * 100;
    const uint64_t usable = available / 100 * 90;
    int64_t expect = 0;
    for (int64_t K = k0 + 1; K <= L && !expect; K++)
        if (host[K] <= usable) expect = K;
    ck_assert_msg(expect > k0, "no K above %lld needs less than K=%lld: the test's premise", (long long)k0, (long long)k0);
    mt_plan plan;
    mt_run_choice run;
    p.k_default = true;
    ck_assert_int_eq(mt_plan_choose_run(&c, &p, MT_LAYOUT_COMPACT, available, 0, &plan, &run), 0);
    ck_assert_msg(run.fits && run.k_auto, "K=%lld: %s", (long long)run.K, run.why_k);
    ck_assert_int_eq(run.K, expect);
    ck_assert_int_eq(plan.params.checkpoint_interval, expect);
    ck_assert_msg(strstr(run.why_k, "the default K=2 does not fit the host"), "%s", run.why_k);
    /* asked for: as it is, refused */
    p.k_default = false;
    ck_assert_int_eq(mt_plan_choose_run(&c, &p, MT_LAYOUT_COMPACT, available, 0, &plan, &run), 0);
    ck_assert(!run.fits && !run.k_auto);
    ck_assert_int_eq(run.K, k0);
    char err[512];
    ck_assert_int_eq(mt_plan_run_refusal(&plan, &run, err, sizeof err), -1);
    /* a default that fits stays */
    p.k_default = true;
    ck_assert_int_eq(mt_plan_choose_run(&c, &p, MT_LAYOUT_COMPACT, 1ULL << 50, 0, &plan, &run), 0);
    ck_assert(run.fits && !run.k_auto);
    ck_assert_int_eq(run.K, k0);
    /* none fits: the default's refusal */
    ck_assert_int_eq(mt_plan_choose_run(&c, &p, MT_LAYOUT_COMPACT, 1ULL << 20, 0, &plan, &run), 0);
    ck_assert(!run.fits && !run.k_auto);
    ck_assert_int_eq(run.K, k0);
}
END_TEST

/* --tokens-per-step with auto K: the micro-batch is the largest whose activations fit the budget
 * at some K, so at least as large as with any one K. */
START_TEST(test_micro_batch_auto_k)
{
    mt_model_config c;
    ck_assert_int_eq(mt_config_from_shape("qwen2.5-0.5b", &c), 0);
    mt_plan_params base = { .seq_len = 1024, .checkpoint_interval = MT_PLAN_K_AUTO, .compute = MT_DTYPE_BF16,
                            .use_gpu = true };
    char err[512];
    int64_t B, accum;
    ck_assert_msg(mt_plan_micro_batch(&c, &base, 64 * 1024, 6 * GiB, &B, &accum, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(B * accum, 64);
    for (int64_t K = 1; K <= c.layers; K += 3) {
        mt_plan_params q = base;
        q.checkpoint_interval = K;
        int64_t Bk, ak;
        if (mt_plan_micro_batch(&c, &q, 64 * 1024, 6 * GiB, &Bk, &ak, err, sizeof err) == 0) ck_assert_int_ge(B, Bk);
    }
}
END_TEST

int main(void)
{
    Suite *s = suite_create("plan_choice");
    TCase *tc = tcase_create("plan_choice");
    tcase_add_test(tc, test_gpu_check);
    tcase_add_test(tc, test_auto_k_gpu);
    tcase_add_test(tc, test_auto_k_host);
    tcase_add_test(tc, test_default_k_gives_way);
    tcase_add_test(tc, test_micro_batch_auto_k);
    tcase_add_test(tc, test_offload_figures);
    tcase_add_test(tc, test_offload_auto);
    suite_add_tcase(s, tc);
    return mt_test_run(s, false);
}
