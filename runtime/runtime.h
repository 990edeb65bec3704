/* Starting and stopping the StarPU runtime the way megatrain needs it: an explicit scheduling
 * policy, a fixed number of workers, OpenBLAS at one thread per worker. */
#ifndef MT_RUNTIME_RUNTIME_H
#define MT_RUNTIME_RUNTIME_H

#include <stdbool.h>
#include <stddef.h>

#include "backends/cuda/options.h"

typedef struct mt_runtime_options {
    const char *sched;   /* StarPU policy name ("eager", "dmda", ...); NULL = mt_default_sched() */
    int ncpu;            /* CPU workers; -1 = one per core StarPU finds */
    int ncuda;           /* CUDA workers; -1 = every GPU, 0 = none */
    /* The CUDA backend's options, handed to every CUDA worker's context at start; zero is the
     * default of each (ignored without CUDA workers). The CLI maps the environment to them:
     *   cuda.attention  MT_ATTENTION: auto (default), cudnn or own (the own kernels, whose
     *                   backward is bitwise reproducible: what a resumed GPU run needs to repeat
     *                   its bits)
     *   cuda.qblock     MT_ATTENTION_QBLOCK: 128w (default), 64 or 128 (the own kernels' query
     *                   blocks) */
    mt_cuda_options cuda;
    /* Seconds without any task finishing (with tasks pending) after which the run is declared
     * stalled: reported and ended (runtime/watchdog.h); 0: no watchdog. Default
     * MT_WATCHDOG_DEFAULT_S. */
    double watchdog_s;
    /* Launched as one of several ranks (runtime/dist.h): start MPI and StarPU-MPI with StarPU,
     * the node's cores shared among its ranks (ncpu -1), each rank on its own GPU (the rank's
     * place on the node). Ignored when not launched so. */
    bool distributed;
} mt_runtime_options;

/* The names of cuda.attention and cuda.qblock, as MT_ATTENTION and MT_ATTENTION_QBLOCK spell
 * them: NULL or "" leaves *out as it is; a known name sets it and returns 0; another gives -1
 * with err naming the value and the choices (the CLI warns and keeps the default). */
int mt_runtime_parse_attention(const char *name, mt_cuda_attention *out, char *err, size_t errlen);
int mt_runtime_parse_qblock(const char *name, mt_cuda_qblock *out, char *err, size_t errlen);

/* The policy every entry point uses unless told otherwise. */
const char *mt_default_sched(void);

/* Options with every field at its default. */
mt_runtime_options mt_runtime_defaults(void);

/* Starts StarPU, configures each CUDA worker's backend context with opts->cuda and starts the
 * watchdog; mt_runtime_shutdown stops both. Returns 0, or -1 with a message in err (unknown
 * policy, no worker). */
int mt_runtime_init(const mt_runtime_options *opts, char *err, size_t errlen);
void mt_runtime_shutdown(void);

/* Worker counts once started. */
int mt_runtime_ncpu(void);
int mt_runtime_ncuda(void);
/* The cores this process may run on (its CPU affinity; else the online processors); any time. */
int mt_runtime_cores(void);

#endif
