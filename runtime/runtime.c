/* Starting and stopping StarPU for megatrain. Policy and worker counts are always explicit:
 * StarPU's default policy (lws) was seen stalling on many small CPU tasks (design.md). */
#include "runtime/runtime.h"

#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "codelets/mt_starpu.h"

#include "mt_build_config.h"
#include "runtime/policy.h"

static const char *const known_policies[] = {
    "megatrain", "eager", "dmda", "dm", "dmdas", "prio", "random", "ws", "lws", "heft", "peager", NULL,
};

const char *mt_default_sched(void) { return "megatrain"; }

mt_runtime_options mt_runtime_defaults(void)
{
    mt_runtime_options o = { .sched = NULL, .ncpu = -1, .ncuda = -1 };
    return o;
}

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
    return 0;
}

void mt_runtime_shutdown(void) { starpu_shutdown(); }

int mt_runtime_ncpu(void) { return (int)starpu_cpu_worker_get_count(); }
int mt_runtime_ncuda(void) { return (int)starpu_cuda_worker_get_count(); }
