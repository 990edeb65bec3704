/* Starting and stopping StarPU for megatrain. Policy and worker counts are always explicit: a
 * run does what its options say whatever STARPU_SCHED says, and StarPU's default policy (lws)
 * can stall on the step's many small CPU tasks. */
#include "runtime/runtime.h"

#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "codelets/mt_starpu.h"

#include "mt_build_config.h"
#include "runtime/policy.h"
#if MT_HAVE_CUDA
#include "backends/cuda/kernels.h"
#endif

static const char *const known_policies[] = {
    "megatrain", "eager", "dmda", "dm", "dmdas", "prio", "random", "ws", "lws", "heft", "peager", NULL,
};

const char *mt_default_sched(void) { return "megatrain"; }

mt_runtime_options mt_runtime_defaults(void)
{
    mt_runtime_options o = { .sched = NULL, .ncpu = -1, .ncuda = -1, .cuda = { 0 } };
    return o;
}

int mt_runtime_parse_attention(const char *name, mt_cuda_attention *out, char *err, size_t errlen)
{
    if (!name || !*name) return 0;
    if (strcmp(name, "auto") == 0) *out = MT_CUDA_ATTENTION_AUTO;
    else if (strcmp(name, "cudnn") == 0) *out = MT_CUDA_ATTENTION_CUDNN;
    else if (strcmp(name, "own") == 0) *out = MT_CUDA_ATTENTION_OWN;
    else {
        snprintf(err, errlen, "MT_ATTENTION=%s is not one of auto, cudnn, own", name);
        return -1;
    }
    return 0;
}

int mt_runtime_parse_qblock(const char *name, mt_cuda_qblock *out, char *err, size_t errlen)
{
    if (!name || !*name) return 0;
    if (strcmp(name, "128w") == 0) *out = MT_CUDA_QBLOCK_128W;
    else if (strcmp(name, "64") == 0) *out = MT_CUDA_QBLOCK_64;
    else if (strcmp(name, "128") == 0) *out = MT_CUDA_QBLOCK_128;
    else {
        snprintf(err, errlen, "MT_ATTENTION_QBLOCK=%s is not one of 128w, 64, 128", name);
        return -1;
    }
    return 0;
}

#if MT_HAVE_CUDA
/* Runs on each CUDA worker's thread (starpu_execute_on_each_worker): that thread's backend
 * context takes the options; its device resources still wait for the first task. */
static void configure_cuda_worker(void *arg) { mt_cuda_ctx_configure(arg); }
#endif

static bool policy_known(const char *name)
{
    for (int i = 0; known_policies[i]; i++)
        if (strcmp(known_policies[i], name) == 0) return true;
    return false;
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
    int ret = starpu_init(&conf);
    if (ret == -ENODEV) {
        snprintf(err, errlen, "StarPU found no worker (asked for %d CPU and %d CUDA workers)", o.ncpu, o.ncuda);
        return -1;
    }
    if (ret != 0) {
        snprintf(err, errlen, "starpu_init failed (%d)", ret);
        return -1;
    }
#if MT_HAVE_CUDA
    if (starpu_cuda_worker_get_count() > 0) starpu_execute_on_each_worker(configure_cuda_worker, &o.cuda, STARPU_CUDA);
#endif
    return 0;
}

void mt_runtime_shutdown(void) { starpu_shutdown(); }

int mt_runtime_ncpu(void) { return (int)starpu_cpu_worker_get_count(); }
int mt_runtime_ncuda(void) { return (int)starpu_cuda_worker_get_count(); }
