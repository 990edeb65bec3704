/* Starting and stopping StarPU for megatrain. Policy and worker counts are always explicit: a
 * run does what its options say whatever STARPU_SCHED says, and StarPU's default policy (lws)
 * can stall on the step's many small CPU tasks. */
#include "runtime/runtime.h"

#include <cblas.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "codelets/mt_starpu.h"

#include "mt_build_config.h"
#include "runtime/dist.h"
#include "runtime/policy.h"
#include "runtime/watchdog.h"
#if MT_HAVE_CUDA
#include "backends/cuda/kernels.h"
#endif

/* The running StarPU's watchdog: one per process, as StarPU itself is. */
static mt_watchdog *watchdog;

static const char *const known_policies[] = {
    "megatrain", "eager", "dmda", "dm", "dmdas", "prio", "random", "ws", "lws", "heft", "peager", NULL,
};

const char *mt_default_sched(void) { return "megatrain"; }

mt_runtime_options mt_runtime_defaults(void)
{
    mt_runtime_options o = { .sched = NULL, .ncpu = -1, .ncuda = -1, .cuda = { 0 }, .watchdog_s = MT_WATCHDOG_DEFAULT_S };
    return o;
}

/* names[0..n) are the choices of environment variable `var` in their enum's order: *out gets the
 * index of name and 1 is returned; 0 for NULL or "" (*out untouched); -1 with err otherwise. */
static int parse_choice(const char *var, const char *name, const char *const *names, int n, int *out, char *err,
                        size_t errlen)
{
    if (!name || !*name) return 0;
    for (int i = 0; i < n; i++)
        if (strcmp(name, names[i]) == 0) {
            *out = i;
            return 1;
        }
    int len = snprintf(err, errlen, "%s=%s is not one of", var, name);
    for (int i = 0; i < n && len >= 0 && (size_t)len < errlen; i++)
        len += snprintf(err + len, errlen - (size_t)len, "%s %s", i ? "," : "", names[i]);
    return -1;
}

int mt_runtime_parse_attention(const char *name, mt_cuda_attention *out, char *err, size_t errlen)
{
    static const char *const names[] = {
        [MT_CUDA_ATTENTION_AUTO] = "auto", [MT_CUDA_ATTENTION_CUDNN] = "cudnn", [MT_CUDA_ATTENTION_OWN] = "own",
    };
    int i;
    const int rc = parse_choice("MT_ATTENTION", name, names, 3, &i, err, errlen);
    if (rc > 0) *out = (mt_cuda_attention)i;
    return rc < 0 ? -1 : 0;
}

int mt_runtime_parse_qblock(const char *name, mt_cuda_qblock *out, char *err, size_t errlen)
{
    static const char *const names[] = {
        [MT_CUDA_QBLOCK_128W] = "128w", [MT_CUDA_QBLOCK_64] = "64", [MT_CUDA_QBLOCK_128] = "128",
    };
    int i;
    const int rc = parse_choice("MT_ATTENTION_QBLOCK", name, names, 3, &i, err, errlen);
    if (rc > 0) *out = (mt_cuda_qblock)i;
    return rc < 0 ? -1 : 0;
}

#if MT_HAVE_CUDA
typedef struct cuda_setup {
    const mt_cuda_options *options;
    pthread_t thread[STARPU_NMAXWORKERS]; /* the thread each CUDA worker ran this on */
} cuda_setup;

/* Runs on each CUDA worker's thread (starpu_execute_on_each_worker): that thread's backend
 * context takes the options; its device resources still wait for the first task. */
static void configure_cuda_worker(void *arg)
{
    cuda_setup *s = arg;
    mt_cuda_ctx_configure(s->options);
    s->thread[starpu_worker_get_id_check()] = pthread_self();
}

/* Configures every CUDA worker's backend context, and checks that no two workers share a thread
 * (and so a context: one_thread_per_cuda_worker) whatever StarPU made of the environment. */
static int configure_cuda_workers(const mt_cuda_options *options, char *err, size_t errlen)
{
    cuda_setup s = { .options = options }; /* starpu_execute_on_each_worker returns when all have run */
    starpu_execute_on_each_worker(configure_cuda_worker, &s, STARPU_CUDA);
    int ids[STARPU_NMAXWORKERS];
    const int n = (int)starpu_worker_get_ids_by_type(STARPU_CUDA_WORKER, ids, STARPU_NMAXWORKERS);
    for (int i = 0; i < n; i++)
        for (int j = 0; j < i; j++)
            if (pthread_equal(s.thread[ids[i]], s.thread[ids[j]])) {
                snprintf(err, errlen, "CUDA workers %d and %d run on one thread, which would share its CUDA context "
                         "(GEMM workspace) between their streams; check STARPU_CUDA_THREAD_PER_WORKER", ids[j], ids[i]);
                return -1;
            }
    return 0;
}
#endif

static bool policy_known(const char *name)
{
    for (int i = 0; known_policies[i]; i++)
        if (strcmp(known_policies[i], name) == 0) return true;
    return false;
}

int mt_runtime_cores(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

/* StarPU keeps a share of each GPU's buffers clean: when fewer than STARPU_MINIMUM_CLEAN_BUFFERS
 * percent (5 by default) of a GPU's allocations have a current copy in their home, its memory
 * tidying writes dirty ones home, between tasks, until STARPU_TARGET_CLEAN_BUFFERS percent (10)
 * are. On the step's GPU the dirty buffers are the live activations (a block's saved activations,
 * the hidden states and their gradients) and gradients on their way home; the activations' homes
 * are plain host memory that costs RAM only where a page is written (runtime/step/graph.c), which
 * the plan does not count. Written home, a 524,288-token step's saved activations alone (12.5 GiB
 * a layer) would take host memory the plan gives to the state. The plan keeps the GPU's need
 * within the device, so nothing must be written home to make room; a buffer StarPU still has to
 * evict when an allocation fails goes home then, as before. Both are 0 unless the environment
 * sets them: the user's values win, for experiments. */
static void keep_live_buffers_on_device(void)
{
    setenv("STARPU_MINIMUM_CLEAN_BUFFERS", "0", 0);
    setenv("STARPU_TARGET_CLEAN_BUFFERS", "0", 0);
}

/* The CUDA backend's context (its cuBLASLt workspace and reduction partials:
 * backends/cuda/context.cu) belongs to a thread, and a task's kernels run on its worker's stream.
 * StarPU drives all the workers (streams) of a GPU from one thread unless
 * STARPU_CUDA_THREAD_PER_WORKER is 1: with several workers per GPU (STARPU_NWORKER_PER_CUDA) two
 * tasks' GEMMs would then use one workspace from two streams at once, and give garbage. So each
 * CUDA worker gets its own thread, and a setting that shares one between workers is refused. */
static int one_thread_per_cuda_worker(char *err, size_t errlen)
{
    const char *nper = getenv("STARPU_NWORKER_PER_CUDA"), *per_worker = getenv("STARPU_CUDA_THREAD_PER_WORKER"),
               *per_dev = getenv("STARPU_CUDA_THREAD_PER_DEV");
    if (per_dev && atoi(per_dev) == 0) {
        snprintf(err, errlen, "STARPU_CUDA_THREAD_PER_DEV=%s drives every GPU from one thread, whose CUDA context (GEMM "
                 "workspace) their workers would share: unset it", per_dev);
        return -1;
    }
    if (!nper || atoi(nper) <= 1) return 0;
    if (per_dev || (per_worker && atoi(per_worker) != 1)) {
        const char *var = per_dev ? "STARPU_CUDA_THREAD_PER_DEV" : "STARPU_CUDA_THREAD_PER_WORKER";
        snprintf(err, errlen, "STARPU_NWORKER_PER_CUDA=%s with %s=%s: one thread would drive several workers of a GPU, "
                 "which would share its CUDA context (GEMM workspace) from two streams at once; unset %s", nper, var,
                 per_dev ? per_dev : per_worker, var);
        return -1;
    }
    setenv("STARPU_CUDA_THREAD_PER_WORKER", "1", 1);
    return 0;
}

int mt_runtime_init(const mt_runtime_options *opts, char *err, size_t errlen)
{
    mt_runtime_options o = opts ? *opts : mt_runtime_defaults();
    const char *sched = o.sched ? o.sched : mt_default_sched();
    if (!policy_known(sched)) {
        snprintf(err, errlen, "unknown scheduling policy '%s' (known: megatrain, eager, dmda, dm, dmdas, prio, random, ws, lws, heft, peager)", sched);
        return -1;
    }
    struct starpu_conf conf;
    starpu_conf_init(&conf);
    if (strcmp(sched, "megatrain") == 0) conf.sched_policy = &mt_sched_policy;
    else conf.sched_policy_name = sched;
    /* Our options win over STARPU_SCHED & co., so a run does what its command line says. */
    conf.precedence_over_environment_variables = 1;
    if (o.ncpu >= 0) conf.ncpus = o.ncpu;
    if (o.ncuda >= 0) conf.ncuda = o.ncuda;
    if (!MT_HAVE_CUDA) conf.ncuda = 0;
    conf.nopencl = 0;
    /* Each worker is one core: a multithreaded BLAS inside a task would oversubscribe them
     * and make results depend on thread timing. */
    openblas_set_num_threads(1);
    const bool dist = o.distributed && mt_dist_launched();
    if (dist && o.ncpu < 0) {
        const int share = mt_runtime_cores() / mt_dist_local_size();
        conf.ncpus = share > 1 ? share : 1;
    }
    if (dist && mt_dist_local_size() > 1 && conf.ncuda != 0) {
        conf.ncuda = 1;
        conf.use_explicit_workers_cuda_gpuid = 1;
        conf.workers_cuda_gpuid[0] = (unsigned)mt_dist_local_rank();
    }
    /* StarPU reads its environment as it starts: in mt_dist_start across ranks */
    keep_live_buffers_on_device();
    if (one_thread_per_cuda_worker(err, errlen)) return -1;
    if (dist && mt_dist_start(&conf, err, errlen)) return -1;
    int ret = dist ? 0 : starpu_init(&conf);
    if (ret == -ENODEV) {
        snprintf(err, errlen, "StarPU found no worker (asked for %d CPU and %d CUDA workers)", o.ncpu, o.ncuda);
        return -1;
    }
    if (ret != 0) {
        snprintf(err, errlen, "starpu_init failed (%d)", ret);
        return -1;
    }
#if MT_HAVE_CUDA
    if (starpu_cuda_worker_get_count() > 0 && configure_cuda_workers(&o.cuda, err, errlen)) {
        mt_runtime_shutdown();
        return -1;
    }
#endif
    /* Not an error: a run on shared cores is slower, not wrong. Every command starts StarPU here,
     * so this is the one place that says so. */
    const int cores = mt_runtime_cores();
    if (o.ncpu > cores)
        fprintf(stderr, "megatrain: warning: --ncpu %d asks for more CPU workers than the %d cores this process may "
                        "run on: StarPU started %u, sharing the cores (slower, not faster)\n", o.ncpu, cores,
                starpu_cpu_worker_get_count());
    watchdog = mt_watchdog_start(o.watchdog_s, NULL, "run");
    return 0;
}

void mt_runtime_shutdown(void)
{
    mt_watchdog_stop(watchdog);
    watchdog = NULL;
    if (mt_dist_running()) mt_dist_shutdown();
    else starpu_shutdown();
}

int mt_runtime_ncpu(void) { return (int)starpu_cpu_worker_get_count(); }
int mt_runtime_ncuda(void) { return (int)starpu_cuda_worker_get_count(); }
