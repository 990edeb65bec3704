/* megatrain info: what StarPU sees (its workers), a fill task run on every worker, and a host
 * state tile checked to be pinned where a GPU is present. */
#include <stdint.h>
#include <stdio.h>

#include "codelets/fill.h"
#include "codelets/mt_starpu.h"
#include "models/config.h"
#include "mt_build_config.h"
#include "mt_commit.h"
#include "runtime/runtime.h"
#include "runtime/state.h"
#include "tools/cli/commands.h"
#include "tools/cli/options.h"
#if MT_HAVE_CUDA
#include "backends/cuda/kernels.h"
#endif

static const char cmd[] = "megatrain info";

/* info starts StarPU with no CPU worker when asked (a CUDA-only check). */
static const cli_option info_options[] = {
    { .name = "ncpu", .arg = "N", .kind = CLI_INT, .field = offsetof(mt_runtime_options, ncpu), .min = 0,
      .max = CLI_MAX_NCPU, .help = "StarPU CPU workers (default all)" },
};

/* One fill task pinned to each worker: every kind of worker executes codelets. The number of
 * workers that failed. */
static int fill_on_every_worker(void)
{
    int failures = 0;
    float *buf;
    starpu_malloc((void **)&buf, 1000 * sizeof(float));
    starpu_data_handle_t h;
    starpu_vector_data_register(&h, STARPU_MAIN_RAM, (uintptr_t)buf, 1000, sizeof(float));
    for (unsigned w = 0; w < starpu_worker_get_count(); w++) {
        float value = 1.0f + (float)w;
        int ret = starpu_task_insert(&mt_cl_fill, STARPU_W, h, STARPU_VALUE, &value, sizeof value,
                                     STARPU_EXECUTE_ON_WORKER, (int)w, 0);
        starpu_data_acquire(h, STARPU_R);
        int ok = ret == 0 && buf[0] == value && buf[999] == value;
        starpu_data_release(h);
        char name[128];
        starpu_worker_get_name((int)w, name, sizeof name);
        printf("fill task on %-24s %s\n", name, ok ? "ok" : "FAILED");
        failures += !ok;
    }
    starpu_data_unregister(h);
    starpu_free_noflag(buf, 1000 * sizeof(float));
    return failures;
}

/* A host tile as the trainer allocates it: aligned, and pinned where a GPU is present. The
 * number of checks that failed. */
static int check_host_tile(void)
{
    mt_model_config cfg;
    mt_config_from_shape("tiny", &cfg);
    char err[512];
    mt_host_state *st = mt_state_create(&cfg, MT_DTYPE_BF16, 0, err, sizeof err);
    if (!st) {
        cli_failed(cmd, err);
        return 1;
    }
    int failures = 0;
    printf("host tile: %zu bytes, 4 KiB-aligned: %s, allocated pinned: %s\n", mt_state_layer(st, 0)->weight_bytes,
           ((uintptr_t)mt_state_layer(st, 0)->weights % 4096) == 0 ? "yes" : "NO", st->pinned ? "yes" : "no");
#if MT_HAVE_CUDA
    if (mt_runtime_ncuda() > 0) {
        int p = mt_cuda_host_pointer_pinned(mt_state_layer(st, 0)->master);
        printf("cudaPointerGetAttributes(master tile): %s\n",
               p == 1 ? "page-locked host memory" : p == 0 ? "PAGEABLE" : "error");
        failures += p != 1;
    }
#endif
    mt_state_destroy(st);
    return failures;
}

int cli_info(int argc, char **argv)
{
    mt_runtime_options ro = mt_runtime_defaults();
    const cli_group groups[] = {
        CLI_GROUP_ONLY("workers", cli_worker_options, &ro, "sched"),
        CLI_GROUP(NULL, info_options, &ro),
        CLI_GROUP_ONLY(NULL, cli_worker_options, &ro, "ncuda"),
    };
    const cli_command c = {
        .name = cmd,
        .usage = "usage: megatrain info [--sched NAME] [--ncpu N] [--ncuda N]\n\n"
                 "Starts StarPU, lists its workers, runs a fill task on every worker, and checks that\n"
                 "a host state tile is pinned where a GPU is present.\n",
        .groups = groups,
        .ngroups = sizeof groups / sizeof groups[0],
    };
    int status;
    if (!cli_parse(&c, argc, argv, NULL, &status)) return status;
    const int env = cli_environment(cmd, &ro, NULL);
    if (env) return env;
    char err[512];
    if (mt_runtime_init(&ro, err, sizeof err)) return cli_failed(cmd, err);
    printf("megatrain %s (commit %s), StarPU %d.%d.%d, built %s CUDA\n", MT_VERSION, MT_COMMIT, STARPU_MAJOR_VERSION,
           STARPU_MINOR_VERSION, STARPU_RELEASE_VERSION, MT_HAVE_CUDA ? "with" : "without");
    printf("workers: %d CPU, %d CUDA; policy %s\n", mt_runtime_ncpu(), mt_runtime_ncuda(),
           ro.sched ? ro.sched : mt_default_sched());
    for (unsigned w = 0; w < starpu_worker_get_count(); w++) {
        char name[128];
        starpu_worker_get_name((int)w, name, sizeof name);
        printf("  worker %u: %s (memory node %u)\n", w, name, starpu_worker_get_memory_node(w));
    }
    int failures = fill_on_every_worker();
    failures += check_host_tile();
    mt_runtime_shutdown();
    printf("%s\n", failures ? "info: FAILED" : "info: ok");
    return failures ? 1 : 0;
}
