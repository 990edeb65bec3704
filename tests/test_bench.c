/* The bench's GPU time breakdown: idle gaps and their attribution computed from synthetic trace
 * records (serial, pipelined and unsorted tasks, the inputs split, the longest gaps, many names,
 * each GPU apart, and its printing), and the megatrain policy's trace switching on under that
 * policy only; a run on CPU workers: its table and its progress lines. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/bench.h"
#include "runtime/policy.h"
#include "runtime/runtime.h"
#include "tests/testutil.h"

#define TOL 1e-12

static mt_policy_trace_record rec(const char *name, int tile, double pop, double start, double end)
{
    return (mt_policy_trace_record){ .name = name, .tile = tile, .pop_s = pop, .start_s = start, .end_s = end };
}

static const mt_gpu_idle *idle_of(const mt_gpu_breakdown *b, const char *name)
{
    for (int i = 0; i < b->nnames; i++)
        if (!strcmp(b->names[i].name, name)) return &b->names[i];
    ck_abort_msg("no entry for %s", name);
    return NULL;
}

/* One task after another: gaps charged to the next task, busy = span - idle, and the part of a
 * gap after the task was popped counted as waiting for inputs. */
START_TEST(test_serial_gaps)
{
    mt_policy_trace_record r[] = {
        rec("embedding_forward", 0, 0, 10.0, 11.0),
        rec("layer_forward", 1, 11.25, 11.5, 12.0),   /* idle 0.5, popped 0.25 in: inputs 0.25 */
        rec("layer_forward", 2, 11.75, 12.0, 13.0),   /* starts as the last ends: no gap */
        rec("layer_backward", 2, 12.5, 13.25, 14.0),  /* popped before the GPU went idle: all inputs */
        rec("head", 7, 0, 15.0, 15.5),                /* popped before the trace: no split */
    };
    mt_gpu_breakdown b;
    mt_bench_gpu_breakdown(r, 5, &b);
    ck_assert_int_eq(b.status, MT_GPU_TRACE_OK);
    ck_assert_int_eq(b.tasks, 5);
    ck_assert_double_eq_tol(b.span_s, 5.5, TOL);
    ck_assert_double_eq_tol(b.idle_s, 0.5 + 0.25 + 1.0, TOL);
    ck_assert_double_eq_tol(b.busy_s, 5.5 - 1.75, TOL);
    ck_assert_double_eq_tol(b.inputs_s, 0.25 + 0.25, TOL);

    /* Most idle first: head 1.0, layer_forward 0.5, layer_backward 0.25, embedding_forward 0. */
    ck_assert_int_eq(b.nnames, 4);
    ck_assert_str_eq(b.names[0].name, "head");
    ck_assert_str_eq(b.names[1].name, "layer_forward");
    ck_assert_str_eq(b.names[2].name, "layer_backward");
    ck_assert_str_eq(b.names[3].name, "embedding_forward");
    const mt_gpu_idle *f = idle_of(&b, "layer_forward");
    ck_assert_int_eq(f->tasks, 2);
    ck_assert_int_eq(f->gaps, 1);
    ck_assert_double_eq_tol(f->idle_s, 0.5, TOL);
    ck_assert_double_eq_tol(f->inputs_s, 0.25, TOL);
    ck_assert_double_eq_tol(idle_of(&b, "layer_backward")->inputs_s, 0.25, TOL);
    ck_assert_double_eq_tol(idle_of(&b, "head")->inputs_s, 0.0, TOL);
    ck_assert_int_eq(idle_of(&b, "embedding_forward")->gaps, 0);

    /* Longest first, each at the end it follows, with the next task's tile. */
    ck_assert_int_eq(b.nlongest, 3);
    ck_assert_str_eq(b.longest[0].name, "head");
    ck_assert_int_eq(b.longest[0].tile, 7);
    ck_assert_double_eq_tol(b.longest[0].at_s, 14.0, TOL);
    ck_assert_double_eq_tol(b.longest[0].idle_s, 1.0, TOL);
    ck_assert_str_eq(b.longest[1].name, "layer_forward");
    ck_assert_int_eq(b.longest[1].tile, 1);
    ck_assert_double_eq_tol(b.longest[1].at_s, 11.0, TOL);
    ck_assert_double_eq_tol(b.longest[2].idle_s, 0.25, TOL);
    ck_assert_int_eq(b.longest[0].step, 0); /* steps are the bench's to fill */
}
END_TEST

/* Overlapping tasks (a pipeline, or several workers): a gap only where no earlier task is still
 * running - measured from the latest end so far, not from the previous task's end. */
START_TEST(test_overlap_uses_latest_end)
{
    mt_policy_trace_record r[] = {
        rec("a", -1, 0, 0.0, 5.0),
        rec("b", -1, 0, 1.0, 2.0),   /* inside a */
        rec("c", -1, 0, 3.0, 4.0),   /* after b ends but a still runs: no gap */
        rec("d", -1, 0, 4.5, 6.0),   /* starts before a ends */
        rec("e", -1, 0, 6.5, 7.0),   /* 0.5 after d */
    };
    mt_gpu_breakdown b;
    mt_bench_gpu_breakdown(r, 5, &b);
    ck_assert_double_eq_tol(b.span_s, 7.0, TOL);
    ck_assert_double_eq_tol(b.idle_s, 0.5, TOL);
    ck_assert_double_eq_tol(b.busy_s, 6.5, TOL);
    ck_assert_int_eq(b.nlongest, 1);
    ck_assert_str_eq(b.longest[0].name, "e");
    ck_assert_double_eq_tol(b.longest[0].at_s, 6.0, TOL);
    ck_assert_int_eq(idle_of(&b, "c")->gaps, 0);
}
END_TEST

/* Records in any order give the same breakdown (they are sorted by start in place). */
START_TEST(test_unsorted_records)
{
    mt_policy_trace_record sorted[] = {
        rec("x", -1, 0, 0.0, 1.0), rec("y", -1, 0, 2.0, 3.0), rec("x", -1, 0, 3.5, 4.0),
        rec("y", -1, 0, 4.0, 5.0), rec("x", -1, 0, 7.0, 8.0),
    };
    mt_policy_trace_record shuffled[] = { sorted[3], sorted[0], sorted[4], sorted[2], sorted[1] };
    mt_gpu_breakdown a, b;
    mt_bench_gpu_breakdown(sorted, 5, &a);
    mt_bench_gpu_breakdown(shuffled, 5, &b);
    ck_assert_double_eq_tol(b.idle_s, 1.0 + 0.5 + 2.0, TOL);
    ck_assert_double_eq_tol(a.idle_s, b.idle_s, TOL);
    ck_assert_double_eq_tol(a.span_s, b.span_s, TOL);
    ck_assert_double_eq_tol(idle_of(&b, "x")->idle_s, 2.5, TOL);
    ck_assert_double_eq_tol(idle_of(&b, "y")->idle_s, 1.0, TOL);
    for (int i = 0; i < 5; i++) ck_assert_double_eq(shuffled[i].start_s, sorted[i].start_s);
}
END_TEST

/* Seven gaps of distinct lengths: the five longest, longest first. */
START_TEST(test_longest_five)
{
    const double gaps[7] = { 0.3, 0.7, 0.1, 0.9, 0.5, 0.2, 0.8 };
    mt_policy_trace_record r[8];
    double t = 0;
    r[0] = rec("first", -1, 0, t, t + 1);
    t += 1;
    for (int i = 0; i < 7; i++) {
        t += gaps[i];
        r[i + 1] = rec("layer_backward", i + 1, 0, t, t + 1);
        t += 1;
    }
    mt_gpu_breakdown b;
    mt_bench_gpu_breakdown(r, 8, &b);
    ck_assert_int_eq(b.nlongest, MT_GPU_LONGEST);
    const double want[5] = { 0.9, 0.8, 0.7, 0.5, 0.3 };
    const int tile[5] = { 4, 7, 2, 5, 1 };
    for (int i = 0; i < 5; i++) {
        ck_assert_double_eq_tol(b.longest[i].idle_s, want[i], 1e-9);
        ck_assert_int_eq(b.longest[i].tile, tile[i]);
    }
    ck_assert_int_eq(idle_of(&b, "layer_backward")->gaps, 7);
    ck_assert_double_eq_tol(b.idle_s, 3.5, 1e-9);
}
END_TEST

/* More names than entries: the last entry gathers the rest as "other"; nothing is lost. */
START_TEST(test_many_names_fold_into_other)
{
    enum { N = MT_GPU_MAX_NAMES + 3 };
    static char names[N][8];
    mt_policy_trace_record r[N];
    for (int i = 0; i < N; i++) {
        snprintf(names[i], sizeof names[i], "op%d", i);
        r[i] = rec(names[i], -1, 0, 2.0 * i, 2.0 * i + 1); /* 1 s idle before each but the first */
    }
    mt_gpu_breakdown b;
    mt_bench_gpu_breakdown(r, N, &b);
    ck_assert_int_eq(b.nnames, MT_GPU_MAX_NAMES);
    const mt_gpu_idle *other = idle_of(&b, "other");
    ck_assert_int_eq(other->tasks, 4);
    ck_assert_double_eq_tol(other->idle_s, 4.0, TOL);
    ck_assert_str_eq(b.names[0].name, "other"); /* the most idle */
    double sum = 0;
    int tasks = 0;
    for (int i = 0; i < b.nnames; i++) {
        sum += b.names[i].idle_s;
        tasks += b.names[i].tasks;
    }
    ck_assert_double_eq_tol(sum, N - 1, TOL);
    ck_assert_int_eq(tasks, N);
}
END_TEST

/* Two GPUs: each worker's records apart, so a gap on one is not hidden by the other's tasks; the
 * breakdown kept is the least busy worker's. Merged, the two would show no idle at all. */
START_TEST(test_each_gpu_apart)
{
    mt_policy_trace_record r[] = {
        rec("layer_forward", 1, 0, 0.0, 2.0),   rec("layer_forward", 2, 0, 2.0, 4.0), /* worker 3: never idle */
        rec("layer_forward", 1, 0, 0.0, 1.0),   rec("layer_backward", 1, 0, 3.0, 4.0), /* worker 5: 2 s idle */
    };
    r[0].worker = r[1].worker = 3;
    r[2].worker = r[3].worker = 5;
    mt_policy_trace_record merged[4];
    memcpy(merged, r, sizeof r);
    mt_gpu_breakdown m;
    mt_bench_gpu_breakdown(merged, 4, &m);
    ck_assert_double_eq_tol(m.idle_s, 0, TOL);

    mt_gpu_share each[4];
    mt_gpu_breakdown b;
    /* given out of worker order: the shares come in it */
    mt_policy_trace_record shuffled[4] = { r[3], r[1], r[2], r[0] };
    ck_assert_int_eq(mt_bench_gpu_breakdowns(shuffled, 4, each, 4, &b), 2);
    ck_assert_int_eq(each[0].worker, 3);
    ck_assert_int_eq(each[0].tasks, 2);
    ck_assert_double_eq_tol(each[0].busy_s, 4.0, TOL);
    ck_assert_double_eq_tol(each[0].idle_s, 0, TOL);
    ck_assert_int_eq(each[1].worker, 5);
    ck_assert_double_eq_tol(each[1].span_s, 4.0, TOL);
    ck_assert_double_eq_tol(each[1].idle_s, 2.0, TOL);
    ck_assert_double_eq_tol(each[1].busy_s, 2.0, TOL);
    ck_assert_int_eq(b.tasks, 2); /* worker 5's */
    ck_assert_double_eq_tol(b.idle_s, 2.0, TOL);
    ck_assert_str_eq(b.names[0].name, "layer_backward");
    ck_assert_int_eq(b.nlongest, 1);
    ck_assert_double_eq_tol(b.longest[0].at_s, 1.0, TOL);

    /* room for one share: the count is still both, the least busy still found */
    memcpy(shuffled, r, sizeof r);
    ck_assert_int_eq(mt_bench_gpu_breakdowns(shuffled, 4, each, 1, &b), 2);
    ck_assert_int_eq(each[0].worker, 3);
    ck_assert_double_eq_tol(b.idle_s, 2.0, TOL);
    ck_assert_int_eq(mt_bench_gpu_breakdowns(NULL, 0, each, 4, &b), 0);
    ck_assert_int_eq(b.tasks, 0);
}
END_TEST

START_TEST(test_empty)
{
    mt_gpu_breakdown b;
    mt_bench_gpu_breakdown(NULL, 0, &b);
    ck_assert_int_eq(b.status, MT_GPU_TRACE_OK);
    ck_assert_int_eq(b.tasks, 0);
    ck_assert_int_eq(b.nnames, 0);
    ck_assert_int_eq(b.nlongest, 0);
    ck_assert_double_eq(b.idle_s, 0);
}
END_TEST

static void noop(void *buffers[], void *arg)
{
    (void)buffers;
    (void)arg;
}

static struct starpu_codelet noop_cl = { .cpu_funcs = { noop }, .nbuffers = 0, .name = "noop" };

/* Under the megatrain policy the trace starts (StarPU runs a copy of the policy structure, so the
 * policy must know itself by more than its address) and, with CPU workers only, records nothing;
 * under another policy it does not start. */
START_TEST(test_trace_under_policies)
{
    char err[256];
    mt_runtime_options ro = mt_runtime_defaults();
    ro.ncpu = 2;
    ro.ncuda = 0;
    ro.sched = "megatrain";
    ck_assert_msg(mt_runtime_init(&ro, err, sizeof err) == 0, "%s", err);
    mt_policy_trace_record *r = NULL;
    int n = -1;
    ck_assert_int_eq(mt_policy_trace_end(MT_SCHED_CTX_INITIAL, &r, &n), -1); /* none began */
    ck_assert_int_eq(mt_policy_trace_begin(MT_SCHED_CTX_INITIAL, 64, false), 0);
    for (int i = 0; i < 8; i++) ck_assert_int_eq(starpu_task_insert(&noop_cl, 0), 0);
    starpu_task_wait_for_all();
    ck_assert_int_eq(mt_policy_trace_end(MT_SCHED_CTX_INITIAL, &r, &n), 0);
    ck_assert_int_eq(n, 0);
    free(r);
    /* every worker's: the eight CPU tasks, each popped, started and ended in that order */
    ck_assert_int_eq(mt_policy_trace_begin(MT_SCHED_CTX_INITIAL, 64, true), 0);
    for (int i = 0; i < 8; i++) ck_assert_int_eq(starpu_task_insert(&noop_cl, 0), 0);
    starpu_task_wait_for_all();
    ck_assert_int_eq(mt_policy_trace_end(MT_SCHED_CTX_INITIAL, &r, &n), 0);
    ck_assert_int_eq(n, 8);
    for (int i = 0; i < n; i++) {
        ck_assert(!r[i].cuda);
        ck_assert(r[i].pop_s > 0 && r[i].pop_s <= r[i].start_s && r[i].start_s <= r[i].end_s);
    }
    free(r);
    mt_runtime_shutdown();

    ro.sched = "eager";
    ck_assert_msg(mt_runtime_init(&ro, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(mt_policy_trace_begin(MT_SCHED_CTX_INITIAL, 64, false), -1);
    ck_assert_int_eq(mt_policy_trace_end(MT_SCHED_CTX_INITIAL, &r, &n), -1);
    ck_assert_ptr_null(r);
    ck_assert_int_eq(n, 0);
    mt_runtime_shutdown();
}
END_TEST

/* The whole text of f (rewound), to free(). */
static char *slurp(FILE *f)
{
    fflush(f);
    const long n = ftell(f);
    char *text = calloc((size_t)n + 1, 1);
    rewind(f);
    ck_assert_int_eq(fread(text, 1, (size_t)n, f), (size_t)n);
    return text;
}

/* The tiny shape on CPU workers: the table is the CPU one (no GPU column), the log names each
 * phase before it runs, in order, and a heartbeat shorter than a step names the step again. */
START_TEST(test_cpu_run_table_and_progress)
{
    mt_bench_options o = mt_bench_defaults();
    o.shape = "tiny";
    o.step.B = 2;
    o.step.T = 64;
    o.warmup = 1;
    o.steps = 2;
    o.heartbeat_s = 0.01;
    o.runtime.ncpu = 2;
    o.runtime.ncuda = 0;
    mt_bench_result r;
    FILE *log = tmpfile(), *table = tmpfile();
    ck_assert(log && table);
    char err[512];
    ck_assert_msg(mt_bench_run(&o, &r, log, table, err, sizeof err) == 0, "%s", err);
    char *logged = slurp(log), *printed = slurp(table);
    ck_assert(!r.cuda);
    ck_assert_int_eq(r.ncpu, 2);
    ck_assert_int_eq(r.ncuda, 0);
    ck_assert_msg(strstr(printed, "| CPU workers | step s | tok/s | model GFLOP/s |") != NULL, "%s", printed);
    ck_assert_msg(strstr(printed, "GPU") == NULL && strstr(printed, "H2D") == NULL, "a GPU column on CPU: %s", printed);
    /* model GFLOP/s as printed: 1e3 x TFLOP/s, which is (6 N + 6 L d T) tokens / step time */
    ck_assert(r.tflops > 0 && r.tokens_per_s > 0);
    const char *phases[] = { "bench: starting StarPU\n", "bench: setting up the host state of tiny",
                             "bench: K=4 clip 1: warm-up step 1/1\n", "bench: K=4 clip 1: measured step 1/2\n",
                             "bench: K=4 clip 1: measured step 2/2\n", "bench: K=4 clip 1: AdamW alone" };
    const char *at = logged;
    for (size_t i = 0; i < sizeof phases / sizeof phases[0]; i++) {
        const char *next = strstr(at, phases[i]);
        ck_assert_msg(next != NULL, "no '%s' after the one before it in:\n%s", phases[i], logged);
        at = next;
    }
    ck_assert_msg(strstr(logged, "bench: still in measured step ") != NULL, "no heartbeat in a step:\n%s", logged);
    free(logged);
    free(printed);
    fclose(log);
    fclose(table);
}
END_TEST

/* Over several GPUs the notes under the table say how many, the least busy one's share beside the
 * mean the table shows, and the bytes between GPUs; over one they say nothing of it. */
START_TEST(test_notes_over_several_gpus)
{
    mt_bench_options o = mt_bench_defaults();
    mt_bench_result r[2] = {
        { .cuda = true, .K = 2, .clip = 1, .ncuda = 2, .gpu_busy = 0.95, .gpu_busy_min = 0.91, .p2p_gb = 1.5 },
        { .cuda = true, .K = 4, .clip = 1, .ncuda = 2, .gpu_busy = 0.9, .gpu_busy_min = 0.87, .p2p_gb = 0.25 },
    };
    FILE *f = tmpfile();
    ck_assert(f);
    mt_bench_print_notes(&o, r, 2, f);
    char *text = slurp(f);
    ck_assert_msg(strstr(text, "(K=2 clip 1: 2 CUDA workers: GPU busy is their mean, the least busy 0.91; H2D and D2H "
                               "are every GPU's; between GPUs 1.50 GB/step)\n") != NULL, "%s", text);
    ck_assert_msg(strstr(text, "(K=4 clip 1: 2 CUDA workers: GPU busy is their mean, the least busy 0.87; H2D and D2H "
                               "are every GPU's; between GPUs 0.25 GB/step)\n") != NULL, "%s", text);
    free(text);
    fclose(f);
    r[0].ncuda = r[1].ncuda = 1;
    f = tmpfile();
    mt_bench_print_notes(&o, r, 2, f);
    text = slurp(f);
    ck_assert_msg(strstr(text, "CUDA workers") == NULL, "%s", text);
    free(text);
    fclose(f);

    /* the GPU time: a line for each worker, then the least busy one's breakdown */
    o.steps = 2;
    mt_policy_trace_record t[] = { rec("layer_forward", 1, 0, 0.0, 2.0), rec("layer_forward", 1, 0, 0.0, 1.0),
                                   rec("layer_backward", 1, 0, 3.0, 4.0) };
    t[0].worker = 3;
    t[1].worker = t[2].worker = 5;
    r[0].ngpu_shares = mt_bench_gpu_breakdowns(t, 3, r[0].gpu_each, MT_BENCH_MAX_GPUS, &r[0].gpu);
    f = tmpfile();
    mt_bench_print_gpu(&o, &r[0], f);
    text = slurp(f);
    ck_assert_msg(strstr(text, "2 CUDA workers, each apart:\n"
                               "bench:   worker 3: 1 tasks, busy 2.000 s of 2.000 s (100.0%); idle 0.000 s/step, of "
                               "which 0.000 s/step waiting for inputs\n"
                               "bench:   worker 5: 2 tasks, busy 2.000 s of 4.000 s (50.0%); idle 1.000 s/step, of "
                               "which 0.000 s/step waiting for inputs\n"
                               "bench: the least busy one's: 2 tasks, busy 2.000 s of 4.000 s (50.0%)") != NULL,
                  "%s", text);
    ck_assert_msg(strstr(text, "| layer_backward | 1 | 1 | 2.0000 |") != NULL, "%s", text);
    free(text);
    fclose(f);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("bench");
    TCase *tc = tcase_create("gpu_time");
    tcase_add_test(tc, test_serial_gaps);
    tcase_add_test(tc, test_overlap_uses_latest_end);
    tcase_add_test(tc, test_unsorted_records);
    tcase_add_test(tc, test_longest_five);
    tcase_add_test(tc, test_many_names_fold_into_other);
    tcase_add_test(tc, test_each_gpu_apart);
    tcase_add_test(tc, test_empty);
    tcase_add_test(tc, test_trace_under_policies);
    tcase_add_test(tc, test_notes_over_several_gpus);
    suite_add_tcase(s, tc);
    TCase *run = tcase_create("cpu_run");
    tcase_set_timeout(run, 600);
    tcase_add_test(run, test_cpu_run_table_and_progress);
    suite_add_tcase(s, run);
    return mt_test_run(s, false);
}
