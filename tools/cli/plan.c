/* megatrain plan: what `megatrain train` with the same options will hold in memory, before
 * allocating any (runtime/plan.h): its defaults are train's (mt_train_defaults), its workers those
 * StarPU would start here, and its host total counts the process around the state. With --shapes
 * (or --host-memory and no model), every published shape's verdict instead. */
#include <limits.h>
#include <stdio.h>

#include "runtime/dataset.h"
#include "runtime/plan.h"
#include "runtime/train.h"
#include "tools/cli/commands.h"
#include "tools/cli/options.h"

static const char cmd[] = "megatrain plan";

typedef struct plan_request {
    bool cpu;              /* --cpu: --ncuda 0 */
    bool shapes;           /* --shapes: the published shapes' table */
    uint64_t host_memory;  /* 0: MemAvailable */
    uint64_t gpu_memory;   /* 0: the device's (mt_plan_gpu_memory) */
    int64_t ranks;         /* --ranks: the plan of one rank of a run over that many (0: one process) */
    int64_t node_ranks;    /* --ranks-per-node: of those, how many share this machine (0: all) */
} plan_request;

#define FIELD(name) offsetof(mt_train_options, name)

/* train's options of the same names (tools/cli/train.c), into the same fields. */
static const cli_option run_options[] = {
    { .name = "data", .arg = "PATH", .kind = CLI_STRING, .field = FIELD(data_path),
      .help = "train's data: its size is counted, a prepared directory sets --seq-len (default: none counted)" },
    { .name = "dtype", .arg = "fp32|bf16", .kind = CLI_CUSTOM, .field = FIELD(dtype), .parse = cli_dtype_option,
      .help = "streamed weights and compute (default: bf16 with a GPU, else fp32)" },
};

static const cli_option tokens_options[] = {
    { .name = "tokens-per-step", .arg = "N", .kind = CLI_INT64, .field = FIELD(tokens_per_step), .min = 1,
      .max = 1LL << 40, .help = "tokens per step: micro-batch and accum then fit --activation-budget" },
    { .name = "activation-budget", .arg = "BYTES", .kind = CLI_UINT64, .field = FIELD(activation_budget), .min = 1,
      .max = LLONG_MAX, .show_default = true, .help = "activation memory of one micro-batch" },
};

static const cli_option plan_options[] = {
    { .name = "host-memory", .arg = "BYTES", .kind = CLI_CUSTOM, .field = offsetof(plan_request, host_memory),
      .min = 1, .parse = cli_bytes_option, .help = "check against this much (125G, 1.5T) instead of MemAvailable" },
    { .name = "shapes", .kind = CLI_SET, .field = offsetof(plan_request, shapes), .on = true,
      .help = "what fits of each published shape (the default with --host-memory and no model)" },
    { .name = "cpu", .kind = CLI_SET, .field = offsetof(plan_request, cpu), .on = true,
      .help = "plan a CPU-only run (as --ncuda 0)" },
    { .name = "ranks", .arg = "N", .kind = CLI_INT64, .field = offsetof(plan_request, ranks), .min = 1, .max = 4096,
      .help = "one rank's plan of `mpirun -np N megatrain train` (--micro-batch is per rank)" },
    { .name = "ranks-per-node", .arg = "M", .kind = CLI_INT64, .field = offsetof(plan_request, node_ranks), .min = 1,
      .max = 4096, .help = "of the --ranks, those on one machine, each checked against 1/M of its memory "
                           "(default: all of them, as train does with them all on this one)" },
};

int cli_plan(int argc, char **argv)
{
    /* train's program, as this one: the same binary and libraries, loaded and nothing else yet */
    const uint64_t program_bytes = mt_host_rss();
    mt_train_options o = mt_train_defaults();
    cli_model model = { .config_path = o.config_path };
    plan_request req = { 0 };
    const cli_group groups[] = {
        CLI_GROUP_ONLY("model and data", cli_model_options, &model, "config model shape layers rope-scaling"),
        CLI_GROUP(NULL, run_options, &o),
        CLI_GROUP_ONLY("batch", cli_batch_options, &o.step, "micro-batch seq-len accum"),
        CLI_GROUP(NULL, cli_checkpoint_options, &o.step),
        CLI_GROUP(NULL, tokens_options, &o),
        CLI_GROUP("host memory", cli_layout_options, &o.host_layout),
        CLI_GROUP(NULL, plan_options, &req),
        CLI_GROUP("GPU memory", cli_gpu_memory_options, &req.gpu_memory),
        CLI_GROUP(NULL, cli_offload_options, &o.step),
        CLI_GROUP(NULL, cli_mlp_chunk_options, &o.step),
        CLI_GROUP_ONLY("workers", cli_worker_options, &o.runtime, "ncpu ncuda"),
    };
    const cli_command c = {
        .name = cmd,
        .usage = "usage: megatrain plan [--model DIR | --config FILE | --shape NAME] [train's options]\n\n"
                 "Says what `megatrain train` with the same options will hold in memory, before allocating\n"
                 "any: train's defaults (the built-in model without a model option), on the workers StarPU\n"
                 "would start here (a CPU run in fp32 without a CUDA device or with --ncuda 0). Every byte on\n"
                 "the host and the GPU: the state, the step's buffers, and the process around them (runtime,\n"
                 "CPU workers' activations, CUDA, data); the host layouts compared (bytes per parameter =\n"
                 "host total / parameters), the one chosen and why, and whether it fits in MemAvailable (or\n"
                 "--host-memory) and, with a CUDA worker, in the GPU's memory (or --gpu-memory). Without --data\n"
                 "no data is counted. With --shapes, or --host-memory and no model: for each published shape, its\n"
                 "parameters, layout, host bytes and whether it fits, else how many of its layers would.\n",
        .groups = groups,
        .ngroups = sizeof groups / sizeof groups[0],
    };
    cli_given given;
    int status;
    if (!cli_parse(&c, argc, argv, &given, &status)) return status;
    const bool has_config = cli_was_given(&given, "config"), has_shape = model.shape != NULL,
               has_dir = model.model_dir != NULL;
    if (has_config + has_shape + has_dir > 1) return cli_usage_error(cmd, "give at most one of --model, --config and --shape");
    if (req.cpu && o.runtime.ncuda > 0) return cli_usage_error(cmd, "--cpu plans no CUDA worker, --ncuda asks for %d", o.runtime.ncuda);
    const bool any_model = has_config || has_shape || has_dir;
    const bool table = req.shapes || (req.host_memory && !any_model);
    if (table && any_model) return cli_usage_error(cmd, "--shapes plans the published shapes: give no model with it");
    if (model.layers > 0 && !any_model) return cli_usage_error(cmd, "--layers needs --shape, --config or --model");
    if (req.node_ranks > 0 && req.node_ranks > (req.ranks > 0 ? req.ranks : 1))
        return cli_usage_error(cmd, "--ranks-per-node %lld: more than the %lld ranks of the run (--ranks)",
                               (long long)req.node_ranks, (long long)(req.ranks > 0 ? req.ranks : 1));

    char err[1024], have[32], path[4200];
    if (has_dir) {
        snprintf(path, sizeof path, "%s/config.json", model.model_dir);
        model.config_path = path;
    }
    /* Without --data nothing is read: train's default corpus need not be on this machine. */
    const bool has_data = cli_was_given(&given, "data");
    /* what train does with prepared data and no --seq-len */
    if (has_data && !cli_was_given(&given, "seq-len") && mt_dataset_is_prepared(o.data_path)) {
        int64_t T;
        if (mt_dataset_seq_len(o.data_path, &T, err, sizeof err)) return cli_failed(cmd, err);
        o.step.T = T;
    }
    uint64_t data_bytes = 0;
    if (has_data && mt_plan_data_bytes(o.data_path, &data_bytes, err, sizeof err)) return cli_failed(cmd, err);
    int ncpu, ncuda;
    mt_plan_workers(o.runtime.ncpu, req.cpu ? 0 : o.runtime.ncuda, &ncpu, &ncuda);
    /* train's rule: without --dtype, bf16 when a GPU computes, else fp32 */
    const mt_dtype dtype = cli_was_given(&given, "dtype") ? o.dtype : ncuda > 0 ? MT_DTYPE_BF16 : MT_DTYPE_F32;
    mt_plan_params pp = { .micro_batch = o.step.B, .seq_len = o.step.T, .grad_accum = o.step.accum,
                          .checkpoint_interval = o.step.K, .compute = dtype, .use_gpu = ncuda > 0,
                          .head_chunk = o.step.head_chunk, .ranks = req.ranks, .devices = ncuda,
                          .offload_checkpoints = o.step.offload_checkpoints,
                          .k_default = !cli_was_given(&given, "checkpoint-every"),
                          .process = { .counted = true, .ncpu = ncpu, .program_bytes = program_bytes, .data_bytes = data_bytes,
                                       .eval_sequences = o.eval_sequences } };
    /* train's rule: the ranks of a node each plan within their share of its memory */
    const int64_t node_ranks = req.node_ranks > 0 ? req.node_ranks : req.ranks > 1 ? req.ranks : 1;
    const uint64_t avail = (req.host_memory ? req.host_memory : mt_host_memory_available()) / (uint64_t)node_ranks;
    mt_format_bytes(avail, have, sizeof have);
    char share[96] = "";
    if (node_ranks > 1)
        snprintf(share, sizeof share, " (this rank's share: %lld ranks on the machine, --ranks-per-node)", (long long)node_ranks);
    char workers[96];
    snprintf(workers, sizeof workers, "%d CPU + %d CUDA workers%s", ncpu, ncuda,
             ncuda > 0 || req.cpu || o.runtime.ncuda == 0 ? "" : " (no CUDA device here)");
    const char *gpu_source;
    const uint64_t gpu_memory = mt_plan_gpu_memory(req.gpu_memory, ncuda, &gpu_source);
    if (table) {
        if (pp.checkpoint_interval == MT_PLAN_K_AUTO) pp.checkpoint_interval = 1; /* the host side only */
        mt_plan_fit rows[MT_PLAN_NSHAPES];
        const int n = mt_plan_fit_shapes(&pp, o.host_layout, avail, rows, err, sizeof err);
        if (n < 0) return cli_failed(cmd, err);
        printf("host memory %s (%s), %d%% usable; %lld x %lld tokens per micro-batch, weights %s, %s, --host-layout %s\n",
               have, req.host_memory ? "--host-memory" : "MemAvailable", MT_PLAN_HOST_USABLE_PERCENT,
               (long long)pp.micro_batch, (long long)pp.seq_len, mt_dtype_name(dtype), workers,
               mt_host_layout_name(o.host_layout));
        mt_plan_print_fits(rows, n, stdout);
        return 0;
    }
    mt_model_config cfg;
    const int bad = cli_model_config(cmd, &model, &cfg);
    if (bad) return bad;
    cfg.mlp_chunk = o.step.mlp_chunk;
    if (mt_config_check_seq_len(&cfg, pp.seq_len, err, sizeof err)) return cli_failed(cmd, err);
    if (o.tokens_per_step > 0) {
        /* as train chooses them (runtime/train.c): before the workers are known, against the
         * activations of a CPU run in the dtype asked for */
        mt_plan_params base = pp;
        base.compute = o.dtype;
        base.use_gpu = false;
        int64_t B, accum;
        if (mt_plan_micro_batch(&cfg, &base, o.tokens_per_step, o.activation_budget, &B, &accum, err, sizeof err))
            return cli_failed(cmd, err);
        pp.micro_batch = B;
        pp.grad_accum = accum;
    }
    mt_plan plan;
    mt_run_choice run;
    if (mt_plan_choose_run(&cfg, &pp, o.host_layout, avail, gpu_memory, &plan, &run)) return cli_failed(cmd, plan.error);
    const mt_layout_choice *choice = &run.layout;
    printf("model: %s, %lld layers, hidden %lld", has_shape ? model.shape : has_dir ? model.model_dir : model.config_path,
           (long long)cfg.layers, (long long)cfg.hidden);
    if (cfg.experts > 0)
        printf(", %lld experts of which %lld per token in %lld sparse layers", (long long)cfg.experts,
               (long long)cfg.experts_per_token, (long long)mt_config_sparse_layers(&cfg));
    if (has_data) printf("\nrun: %s, data %s\n", workers, o.data_path);
    else printf("\nrun: %s, no data counted (no --data)\n", workers);
    mt_plan_print(&plan, stdout);
    mt_plan_print_choice(choice, stdout);
    mt_plan_print_run(&plan, &run, gpu_source, stdout);
    if (mt_plan_run_refusal(&plan, &run, err, sizeof err)) {
        /* what does fit of this model: its first layers, as --layers keeps them */
        int64_t max_layers, max_params;
        mt_host_layout max_layout;
        char why[512];
        if (!run.layout.fits && cfg.layers > 1 &&
            mt_plan_max_layers(&cfg, &pp, o.host_layout, avail, &max_layers, &max_params, &max_layout, why,
                               sizeof why) == 0 && max_layers > 0)
            snprintf(err + strlen(err), sizeof err - strlen(err),
                     "; the first %lld of its %lld layers fit (%.3fB parameters, %s layout): --layers %lld plans them",
                     (long long)max_layers, (long long)cfg.layers, max_params / 1e9, mt_host_layout_name(max_layout),
                     (long long)max_layers);
        if (!run.layout.fits && node_ranks > 1) snprintf(err + strlen(err), sizeof err - strlen(err), "%s", share);
        return cli_failed(cmd, err);
    }
    char gpu[96] = "";
    if (run.gpu_checked) {
        char need[32], dev[32];
        snprintf(gpu, sizeof gpu, "; GPU plan %s within %s", mt_format_bytes(plan.gpu_need, need, sizeof need),
                 mt_format_bytes(gpu_memory, dev, sizeof dev));
    }
    printf("fits: host plan within %d%% of %s available%s (%s host layout)%s\n", MT_PLAN_HOST_USABLE_PERCENT, have,
           share, mt_host_layout_name(choice->layout), gpu);
    return 0;
}
