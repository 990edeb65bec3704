/* The watchdog (runtime/watchdog.h): a task that never ends is reported by name and ends the
 * process with MT_WATCHDOG_EXIT within a bounded time; a graph that keeps finishing tasks, however
 * slowly each, and a host that is busy with no task pending are never taken for a stall; a host
 * low on memory is warned of; StarPU's tidying is kept from writing live GPU buffers home. Each
 * case runs in a child process, since a firing watchdog ends the process it watches. */
#include <check.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "codelets/mt_starpu.h"
#include "models/util.h"
#include "runtime/runtime.h"
#include "runtime/watchdog.h"
#include "tests/testutil.h"

static atomic_int release_stall;

/* Sleeps for the number of milliseconds in its argument; -1: until release_stall, which no one sets. */
static void sleep_cpu(void *buffers[], void *cl_arg)
{
    int ms;
    starpu_codelet_unpack_args(cl_arg, &ms);
    if (ms < 0) {
        while (!atomic_load(&release_stall)) usleep(10000);
        return;
    }
    usleep((useconds_t)ms * 1000);
}

static struct starpu_codelet stall_cl = {
    .cpu_funcs = { sleep_cpu },
    .nbuffers = 0,
    .name = "stall_test_sleep",
};

static void submit_sleep(int ms)
{
    int rc = starpu_task_insert(&stall_cl, STARPU_VALUE, &ms, sizeof ms, 0);
    if (rc) _exit(90);
}

/* What a child did: its exit status and what it wrote on stderr. */
typedef struct child_result {
    int status;
    double seconds;
    char err[8192];
} child_result;

/* Runs body in a child with the megatrain policy on two CPU workers, stderr into a file. */
static child_result run_child(void (*body)(void))
{
    child_result r = { .status = -1 };
    char path[] = "/tmp/mt_watchdog_XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    const double t0 = mt_clock_s();
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        dup2(fd, 2);
        mt_runtime_options ro = mt_runtime_defaults();
        ro.ncpu = 2;
        ro.ncuda = 0;
        char err[256];
        if (mt_runtime_init(&ro, err, sizeof err)) {
            fprintf(stderr, "%s\n", err);
            _exit(91);
        }
        body();
        _exit(0);
    }
    int st;
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    r.seconds = mt_clock_s() - t0;
    r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    ssize_t n = pread(fd, r.err, sizeof r.err - 1, 0);
    r.err[n > 0 ? n : 0] = 0;
    close(fd);
    unlink(path);
    return r;
}

static void stalled_task(void)
{
    mt_watchdog *w = mt_watchdog_start(1.0, NULL, "test");
    submit_sleep(-1);
    starpu_task_wait_for_all(); /* never returns: the watchdog ends the process */
    mt_watchdog_stop(w);
}

START_TEST(test_stall_is_reported_and_ends_the_run)
{
    child_result r = run_child(stalled_task);
    ck_assert_msg(r.status == MT_WATCHDOG_EXIT, "exit status %d, stderr:\n%s", r.status, r.err);
    ck_assert_msg(r.seconds < 20, "took %.1f s to fire a 1 s watchdog", r.seconds);
    ck_assert_msg(strstr(r.err, "no task finished for") && strstr(r.err, "1 task submitted and unfinished"), "%s", r.err);
    /* what waits: the worker running the stuck task, by the task's name */
    ck_assert_msg(strstr(r.err, "running stall_test_sleep for"), "%s", r.err);
    ck_assert_msg(strstr(r.err, "memory node"), "%s", r.err);
}
END_TEST

/* Twenty tasks of 0.3 s each, one at a time: 6 s in all under a 1 s watchdog. */
static void slow_but_moving(void)
{
    mt_watchdog *w = mt_watchdog_start(1.0, NULL, "test");
    for (int i = 0; i < 20; i++) {
        submit_sleep(300);
        starpu_task_wait_for_all();
    }
    mt_watchdog_stop(w);
}

START_TEST(test_progress_is_no_stall)
{
    child_result r = run_child(slow_but_moving);
    ck_assert_msg(r.status == 0, "exit status %d, stderr:\n%s", r.status, r.err);
    ck_assert_msg(!strstr(r.err, "no task finished"), "%s", r.err);
}
END_TEST

/* The host works for 3 s with nothing pending (as while writing a checkpoint). */
static void idle_graph(void)
{
    mt_watchdog *w = mt_watchdog_start(1.0, NULL, "test");
    submit_sleep(10);
    starpu_task_wait_for_all();
    sleep(3);
    submit_sleep(10);
    starpu_task_wait_for_all();
    mt_watchdog_stop(w);
}

START_TEST(test_idle_graph_is_no_stall)
{
    child_result r = run_child(idle_graph);
    ck_assert_msg(r.status == 0, "exit status %d, stderr:\n%s", r.status, r.err);
}
END_TEST

/* One short task under a watchdog, with MT_HOST_LOW_MIB as the child's environment has it. */
static void one_task(void)
{
    mt_watchdog *w = mt_watchdog_start(30.0, NULL, "test");
    submit_sleep(1500);
    starpu_task_wait_for_all();
    mt_watchdog_stop(w);
}

/* Warned once when the host has less available than the figure (a figure above any host's memory,
 * then 0 MiB, under which no host falls). */
START_TEST(test_host_memory_low_is_warned)
{
    setenv("MT_HOST_LOW_MIB", "1099511627776", 1); /* 2^40 MiB */
    child_result r = run_child(one_task);
    ck_assert_msg(r.status == 0, "exit status %d, stderr:\n%s", r.status, r.err);
    const char *hit = strstr(r.err, "megatrain test: warning: the host has ");
    ck_assert_msg(hit && strstr(hit, "GiB of memory available and this process holds "), "%s", r.err);
    /* (the runtime's own watchdog, "run", warns too) */
    ck_assert_msg(!strstr(hit + 1, "megatrain test: warning: the host has"), "warned more than once:\n%s", r.err);
    setenv("MT_HOST_LOW_MIB", "0", 1);
    r = run_child(one_task);
    unsetenv("MT_HOST_LOW_MIB");
    ck_assert_msg(r.status == 0 && !strstr(r.err, "warning: the host has"), "exit %d, stderr:\n%s", r.status, r.err);
}
END_TEST

/* Exits 0 when StarPU's clean-buffer shares are as MT_EXPECT_CLEAN says (runtime.c). */
static void clean_shares(void)
{
    const char *want = getenv("MT_EXPECT_CLEAN"), *min = getenv("STARPU_MINIMUM_CLEAN_BUFFERS"),
               *target = getenv("STARPU_TARGET_CLEAN_BUFFERS");
    if (!min || !target || strcmp(min, want) || strcmp(target, "0")) {
        fprintf(stderr, "minimum %s, target %s, expected %s and 0\n", min ? min : "unset", target ? target : "unset", want);
        _exit(1);
    }
}

/* StarPU's tidying never writes live GPU buffers home to keep a share of them clean (the runtime
 * sets both shares to 0 before StarPU starts), unless the environment sets them. */
START_TEST(test_gpu_buffers_are_not_tidied_home)
{
    unsetenv("STARPU_MINIMUM_CLEAN_BUFFERS");
    unsetenv("STARPU_TARGET_CLEAN_BUFFERS");
    setenv("MT_EXPECT_CLEAN", "0", 1);
    child_result r = run_child(clean_shares);
    ck_assert_msg(r.status == 0, "exit status %d, stderr:\n%s", r.status, r.err);
    setenv("STARPU_MINIMUM_CLEAN_BUFFERS", "7", 1);
    setenv("STARPU_TARGET_CLEAN_BUFFERS", "0", 1);
    setenv("MT_EXPECT_CLEAN", "7", 1);
    r = run_child(clean_shares);
    unsetenv("STARPU_MINIMUM_CLEAN_BUFFERS");
    unsetenv("STARPU_TARGET_CLEAN_BUFFERS");
    unsetenv("MT_EXPECT_CLEAN");
    ck_assert_msg(r.status == 0, "a user's value: exit status %d, stderr:\n%s", r.status, r.err);
}
END_TEST

/* Exits 0 when StarPU will give each CUDA worker a thread of its own (runtime.c). */
static void thread_per_cuda_worker(void)
{
    const char *v = getenv("STARPU_CUDA_THREAD_PER_WORKER");
    if (!v || strcmp(v, "1")) {
        fprintf(stderr, "STARPU_CUDA_THREAD_PER_WORKER %s, expected 1\n", v ? v : "unset");
        _exit(1);
    }
}

/* Exits 0 when the runtime left StarPU's thread per worker at its default (one worker per GPU). */
static void thread_setting_untouched(void)
{
    if (getenv("STARPU_CUDA_THREAD_PER_WORKER")) {
        fprintf(stderr, "STARPU_CUDA_THREAD_PER_WORKER set to %s\n", getenv("STARPU_CUDA_THREAD_PER_WORKER"));
        _exit(1);
    }
}

/* Starts the runtime in a child under `var`=`value` and expects the start refused, naming them. */
static void assert_refused(const char *var, const char *value)
{
    setenv(var, value, 1);
    child_result r = run_child(thread_per_cuda_worker);
    unsetenv(var);
    char named[96];
    snprintf(named, sizeof named, "%s=%s", var, value);
    ck_assert_msg(r.status == 91 && strstr(r.err, named), "%s: exit status %d, stderr:\n%s", named, r.status, r.err);
}

/* Several workers per GPU: each gets a thread of its own (the CUDA backend's context, its GEMM
 * workspace, is per thread), and a setting that shares a thread among them is refused, naming it,
 * before StarPU starts. One worker per GPU: nothing set; one thread for every GPU: refused. */
START_TEST(test_cuda_workers_get_a_thread_each)
{
    unsetenv("STARPU_CUDA_THREAD_PER_WORKER");
    unsetenv("STARPU_CUDA_THREAD_PER_DEV");
    setenv("STARPU_NWORKER_PER_CUDA", "2", 1);
    child_result r = run_child(thread_per_cuda_worker);
    ck_assert_msg(r.status == 0, "exit status %d, stderr:\n%s", r.status, r.err);
    assert_refused("STARPU_CUDA_THREAD_PER_DEV", "1");
    assert_refused("STARPU_CUDA_THREAD_PER_WORKER", "0");
    unsetenv("STARPU_NWORKER_PER_CUDA");
    r = run_child(thread_setting_untouched);
    ck_assert_msg(r.status == 0, "exit status %d, stderr:\n%s", r.status, r.err);
    assert_refused("STARPU_CUDA_THREAD_PER_DEV", "0");
}
END_TEST

START_TEST(test_no_limit_no_watchdog)
{
    ck_assert_ptr_null(mt_watchdog_start(0, NULL, "test"));
    ck_assert_ptr_null(mt_watchdog_start(-1, NULL, "test"));
    mt_watchdog_stop(NULL);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("watchdog");
    TCase *tc = tcase_create("watchdog");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_stall_is_reported_and_ends_the_run);
    tcase_add_test(tc, test_progress_is_no_stall);
    tcase_add_test(tc, test_idle_graph_is_no_stall);
    tcase_add_test(tc, test_host_memory_low_is_warned);
    tcase_add_test(tc, test_gpu_buffers_are_not_tidied_home);
    tcase_add_test(tc, test_cuda_workers_get_a_thread_each);
    tcase_add_test(tc, test_no_limit_no_watchdog);
    suite_add_tcase(s, tc);
    return mt_test_run(s, true);
}
