/* Starting and stopping the StarPU runtime the way megatrain needs it: an explicit scheduling
 * policy, a fixed number of workers, OpenBLAS at one thread per worker. */
#ifndef MT_RUNTIME_RUNTIME_H
#define MT_RUNTIME_RUNTIME_H

#include <stdbool.h>
#include <stddef.h>

typedef struct mt_runtime_options {
    const char *sched;   /* StarPU policy name ("eager", "dmda", ...); NULL = mt_default_sched() */
    int ncpu;            /* CPU workers; -1 = one per core StarPU finds */
    int ncuda;           /* CUDA workers; -1 = every GPU, 0 = none */
} mt_runtime_options;

/* The policy every entry point uses unless told otherwise. */
const char *mt_default_sched(void);

/* Options with every field at its default. */
mt_runtime_options mt_runtime_defaults(void);

/* Starts StarPU. Returns 0, or -1 with a message in err (unknown policy, no worker). */
int mt_runtime_init(const mt_runtime_options *opts, char *err, size_t errlen);
void mt_runtime_shutdown(void);

/* Worker counts once started. */
int mt_runtime_ncpu(void);
int mt_runtime_ncuda(void);

#endif
