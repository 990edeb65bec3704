/* The watchdog thread (runtime/watchdog.h). It polls twice a second: a poll costs two atomic
 * reads and a read of /proc/meminfo, and a stall is minutes long, so the interval only bounds how
 * late the report comes. */
#include "runtime/watchdog.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "codelets/mt_starpu.h"
#include "models/util.h"
#include "runtime/plan.h"
#include "runtime/policy.h"

struct mt_watchdog {
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    bool stop;
    double seconds;
    FILE *log;
    const char *what;
    uint64_t host_low;  /* bytes: the host's available memory under which it warns */
    bool host_warned;   /* re-armed once twice host_low is available again */
};

/* The host's available memory under which the watchdog warns, unless MT_HOST_LOW_MIB says
 * otherwise: the kernel ends a process that takes the rest, with SIGKILL and no word from it, so
 * this warning is what a log of such a run has to show. */
#define HOST_LOW_DEFAULT ((uint64_t)1 << 30)

static uint64_t host_low_bytes(void)
{
    const char *v = getenv("MT_HOST_LOW_MIB");
    char *end;
    if (v && *v) {
        const unsigned long long mib = strtoull(v, &end, 10);
        if (*end == 0) return (uint64_t)mib << 20;
    }
    return HOST_LOW_DEFAULT;
}

static void report_host_low(FILE *out, const mt_watchdog *w, uint64_t avail)
{
    fprintf(out, "megatrain %s: warning: the host has %.2f GiB of memory available and this process holds %.2f GiB: "
                 "the kernel may end the run if it takes the rest (`megatrain plan` shows what a run needs)\n",
            w->what, (double)avail / 1073741824.0, (double)mt_host_rss() / 1073741824.0);
    fflush(out);
}

/* Warns once when the host's available memory falls under host_low, and again only after it has
 * come back above twice that. */
static void watch_host(mt_watchdog *w)
{
    const uint64_t avail = mt_host_memory_available();
    if (avail == 0) return; /* unknown */
    if (w->host_warned) {
        w->host_warned = avail < 2 * w->host_low;
        return;
    }
    if (avail >= w->host_low) return;
    w->host_warned = true;
    report_host_low(stderr, w, avail);
    if (w->log && w->log != stderr) report_host_low(w->log, w, avail);
}

/* The memory of every memory node StarPU manages, as its allocator counts it. A buffer StarPU
 * allocates itself on a node that has no room for it waits there until room is made: a full
 * node is named. */
static void report_memory(FILE *out)
{
    const unsigned n = starpu_memory_nodes_get_count();
    for (unsigned node = 0; node < n; node++) {
        char name[64];
        starpu_memory_node_get_name(node, name, sizeof name);
        const starpu_ssize_t total = starpu_memory_get_total(node);
        const double used = (double)starpu_memory_get_used(node);
        if (total <= 0) {
            fprintf(out, "  memory node %s: %.2f GiB in use, no limit set\n", name, used / 1073741824.0);
            continue;
        }
        fprintf(out, "  memory node %s: %.2f GiB of %.2f GiB in use\n", name, used / 1073741824.0,
                (double)total / 1073741824.0);
        if (used < 0.9 * (double)total) continue;
        fprintf(out, "    nearly full: a buffer StarPU allocates there waits for room%s\n",
                starpu_node_get_kind(node) == STARPU_CPU_RAM
                    ? " (StarPU sizes its RAM node from hwloc's reading of the machine's memory, whatever else is free; "
                      "STARPU_LIMIT_CPU_MEM can only lower it)"
                    : "");
    }
}

static void report(FILE *out, const mt_watchdog *w, int pending, double idle)
{
    fprintf(out, "megatrain %s: error: no task finished for %.0f s (the watchdog's limit is %.0f s): %d task%s "
                 "submitted and unfinished, %d ready\n",
            w->what, idle, w->seconds, pending, pending == 1 ? "" : "s", starpu_task_nready());
    if (mt_policy_report(MT_SCHED_CTX_INITIAL, out) != 0)
        fprintf(out, "  (the running scheduling policy is not megatrain's: no report of its workers and lists)\n");
    report_memory(out);
    fprintf(out, "megatrain %s: ending the run (exit status %d); the last checkpoint written is intact\n", w->what,
            MT_WATCHDOG_EXIT);
    fflush(out);
}

/* What moves while the graph makes progress: the tasks finished (the megatrain policy counts
 * them) and the tasks submitted and unfinished (under other policies the only count there is;
 * a task ending as another is submitted leaves it unchanged, but not for minutes). */
typedef struct progress {
    long long finished;
    int pending;
} progress;

static progress progress_now(void)
{
    return (progress){ mt_policy_finished(MT_SCHED_CTX_INITIAL), starpu_task_nsubmitted() };
}

static void *watch(void *arg)
{
    mt_watchdog *w = arg;
    progress last = progress_now();
    double since = mt_clock_s();
    pthread_mutex_lock(&w->lock);
    while (!w->stop) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += 500000000L;
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&w->wake, &w->lock, &until);
        if (w->stop) break;
        watch_host(w);
        const progress p = progress_now();
        const double now = mt_clock_s();
        if (p.finished != last.finished || p.pending != last.pending || p.pending == 0) {
            last = p;
            since = now;
            continue;
        }
        if (now - since < w->seconds) continue;
        report(stderr, w, p.pending, now - since);
        if (w->log && w->log != stderr) report(w->log, w, p.pending, now - since);
        /* StarPU cannot be shut down with tasks stuck inside it; what the run wrote is on disk. */
        _exit(MT_WATCHDOG_EXIT);
    }
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

mt_watchdog *mt_watchdog_start(double seconds, FILE *log, const char *what)
{
    if (!(seconds > 0)) return NULL;
    mt_watchdog *w = calloc(1, sizeof *w);
    if (!w) return NULL;
    *w = (mt_watchdog){ .seconds = seconds, .log = log, .what = what ? what : "run", .host_low = host_low_bytes() };
    pthread_mutex_init(&w->lock, NULL);
    pthread_cond_init(&w->wake, NULL);
    if (pthread_create(&w->thread, NULL, watch, w) != 0) {
        fprintf(stderr, "megatrain %s: warning: the watchdog thread could not start; a stalled run will not be "
                        "detected\n", w->what);
        pthread_cond_destroy(&w->wake);
        pthread_mutex_destroy(&w->lock);
        free(w);
        return NULL;
    }
    return w;
}

void mt_watchdog_stop(mt_watchdog *w)
{
    if (!w) return;
    pthread_mutex_lock(&w->lock);
    w->stop = true;
    pthread_cond_signal(&w->wake);
    pthread_mutex_unlock(&w->lock);
    pthread_join(w->thread, NULL);
    pthread_cond_destroy(&w->wake);
    pthread_mutex_destroy(&w->lock);
    free(w);
}
