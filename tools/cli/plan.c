/* megatrain plan: every byte a run will hold on the host and the GPU (runtime/plan.h), before
 * allocating any, and whether it fits in this machine's memory. */
#include <limits.h>
#include <stdio.h>

#include "runtime/plan.h"
#include "tools/cli/commands.h"
#include "tools/cli/options.h"

static const char cmd[] = "megatrain plan";

typedef struct plan_request {
    mt_dtype compute;
    bool use_gpu;
    uint64_t host_memory;  /* 0: MemAvailable */
} plan_request;

static const cli_option plan_options[] = {
    { .name = "dtype", .arg = "bf16|fp32", .kind = CLI_CUSTOM, .field = offsetof(plan_request, compute),
      .parse = cli_dtype_option, .help = "streamed weight precision (default bf16)" },
    { .name = "cpu", .kind = CLI_SET, .field = offsetof(plan_request, use_gpu), .on = false,
      .help = "plan a CPU-only run (activations on the host)" },
    { .name = "host-memory", .arg = "BYTES", .kind = CLI_UINT64, .field = offsetof(plan_request, host_memory),
      .min = 1, .max = LLONG_MAX, .help = "check against this much instead of MemAvailable" },
};

int cli_plan(int argc, char **argv)
{
    cli_model model = { 0 };
    mt_step_config batch = { .B = 16, .T = 2048, .accum = 1, .K = 4 };
    plan_request req = { .compute = MT_DTYPE_BF16, .use_gpu = true };
    const cli_group groups[] = {
        CLI_GROUP_ONLY("model", cli_model_options, &model, "shape config rope-scaling"),
        CLI_GROUP("batch", cli_batch_options, &batch),
        CLI_GROUP("run", plan_options, &req),
    };
    const cli_command c = {
        .name = cmd,
        .usage = "usage: megatrain plan (--shape NAME | --config FILE) [options]\n\n"
                 "Prints every byte a run will hold on the host and the GPU, before allocating any,\n"
                 "and says whether it fits in this machine's memory.\n",
        .groups = groups,
        .ngroups = sizeof groups / sizeof groups[0],
    };
    int status;
    if (!cli_parse(&c, argc, argv, NULL, &status)) return status;
    if (!model.shape == !model.config_path) return cli_usage_error(cmd, "give exactly one of --shape and --config");
    mt_model_config cfg;
    const int bad = cli_model_config(cmd, &model, &cfg);
    if (bad) return bad;
    char e[1024];
    if (mt_config_check_seq_len(&cfg, batch.T, e, sizeof e)) return cli_failed(cmd, e);
    const mt_plan_params pp = { .micro_batch = batch.B, .seq_len = batch.T, .grad_accum = batch.accum,
                                .checkpoint_interval = batch.K, .compute = req.compute, .use_gpu = req.use_gpu };
    mt_plan plan;
    if (mt_plan_compute(&cfg, &pp, &plan)) return cli_failed(cmd, plan.error);
    printf("model: %s, %lld layers, hidden %lld\n", model.shape ? model.shape : model.config_path,
           (long long)cfg.layers, (long long)cfg.hidden);
    mt_plan_print(&plan, stdout);
    const uint64_t avail = req.host_memory ? req.host_memory : mt_host_memory_available();
    char err[1024];
    if (mt_plan_check_host(&plan, avail, err, sizeof err)) return cli_failed(cmd, err);
    printf("fits: host plan within %d%% of %s available\n", MT_PLAN_HOST_USABLE_PERCENT,
           mt_format_bytes(avail, err, sizeof err));
    return 0;
}
