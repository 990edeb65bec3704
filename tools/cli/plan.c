/* megatrain plan: what fits in this machine's memory (runtime/plan.h), before allocating any:
 * without a model, every published shape's verdict; with one, every byte its run will hold on the
 * host and the GPU, the host layouts compared, the one chosen and whether it fits. */
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
    mt_host_layout layout;
} plan_request;

static const cli_option plan_options[] = {
    { .name = "dtype", .arg = "bf16|fp32", .kind = CLI_CUSTOM, .field = offsetof(plan_request, compute),
      .parse = cli_dtype_option, .help = "streamed weight precision (default bf16)" },
    { .name = "cpu", .kind = CLI_SET, .field = offsetof(plan_request, use_gpu), .on = false,
      .help = "plan a CPU-only run (activations on the host)" },
    { .name = "host-memory", .arg = "BYTES", .kind = CLI_CUSTOM, .field = offsetof(plan_request, host_memory),
      .min = 1, .parse = cli_bytes_option, .help = "check against this much (125G, 1.5T) instead of MemAvailable" },
};

int cli_plan(int argc, char **argv)
{
    cli_model model = { 0 };
    mt_step_config batch = { .B = 16, .T = 2048, .accum = 1, .K = 4 };
    plan_request req = { .compute = MT_DTYPE_BF16, .use_gpu = true, .layout = MT_LAYOUT_AUTO };
    const cli_group groups[] = {
        CLI_GROUP_ONLY("model", cli_model_options, &model, "shape config layers rope-scaling"),
        CLI_GROUP("batch", cli_batch_options, &batch),
        CLI_GROUP("run", plan_options, &req),
        CLI_GROUP(NULL, cli_layout_options, &req.layout),
    };
    const cli_command c = {
        .name = cmd,
        .usage = "usage: megatrain plan [--shape NAME | --config FILE] [options]\n\n"
                 "Says what fits in this machine's memory (or --host-memory), before allocating any.\n"
                 "Without a model: for each published shape, its parameters, the host layout chosen, its\n"
                 "host bytes and whether it fits, else how many of its layers would. With one: every byte\n"
                 "its run will hold on the host and the GPU, the host layouts compared (bytes per parameter\n"
                 "= host total / parameters), the one chosen and why, and whether it fits.\n",
        .groups = groups,
        .ngroups = sizeof groups / sizeof groups[0],
    };
    int status;
    if (!cli_parse(&c, argc, argv, NULL, &status)) return status;
    if (model.shape && model.config_path) return cli_usage_error(cmd, "give at most one of --shape and --config");
    const mt_plan_params pp = { .micro_batch = batch.B, .seq_len = batch.T, .grad_accum = batch.accum,
                                .checkpoint_interval = batch.K, .compute = req.compute, .use_gpu = req.use_gpu };
    const uint64_t avail = req.host_memory ? req.host_memory : mt_host_memory_available();
    char err[1024], have[32];
    mt_format_bytes(avail, have, sizeof have);
    if (!model.shape && !model.config_path) {
        if (model.layers > 0) return cli_usage_error(cmd, "--layers needs --shape or --config");
        mt_plan_fit rows[MT_PLAN_NSHAPES];
        const int n = mt_plan_fit_shapes(&pp, req.layout, avail, rows, err, sizeof err);
        if (n < 0) return cli_failed(cmd, err);
        printf("host memory %s (%s), %d%% usable; %lld x %lld tokens per micro-batch, weights %s, %s, --host-layout %s\n",
               have, req.host_memory ? "--host-memory" : "MemAvailable", MT_PLAN_HOST_USABLE_PERCENT,
               (long long)batch.B, (long long)batch.T, mt_dtype_name(req.compute), req.use_gpu ? "GPU" : "CPU only",
               mt_host_layout_name(req.layout));
        mt_plan_print_fits(rows, n, stdout);
        return 0;
    }
    mt_model_config cfg;
    const int bad = cli_model_config(cmd, &model, &cfg);
    if (bad) return bad;
    if (mt_config_check_seq_len(&cfg, batch.T, err, sizeof err)) return cli_failed(cmd, err);
    mt_plan plan;
    mt_layout_choice choice;
    if (mt_plan_choose(&cfg, &pp, req.layout, avail, &plan, &choice)) return cli_failed(cmd, plan.error);
    printf("model: %s, %lld layers, hidden %lld", model.shape ? model.shape : model.config_path,
           (long long)cfg.layers, (long long)cfg.hidden);
    if (cfg.experts > 0)
        printf(", %lld experts of which %lld per token in %lld sparse layers", (long long)cfg.experts,
               (long long)cfg.experts_per_token, (long long)mt_config_sparse_layers(&cfg));
    printf("\n");
    mt_plan_print(&plan, stdout);
    mt_plan_print_choice(&choice, stdout);
    if (!choice.fits) {
        if (mt_plan_check_host(&plan, avail, err, sizeof err)) return cli_failed(cmd, err);
        return cli_failed(cmd, choice.why);
    }
    printf("fits: host plan within %d%% of %s available (%s host layout)\n", MT_PLAN_HOST_USABLE_PERCENT, have,
           mt_host_layout_name(choice.layout));
    return 0;
}
