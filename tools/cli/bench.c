/* megatrain bench: times the training step of a published shape (runtime/bench.h), for each
 * combination of the lists it is given, on one host state. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cpu/ranged.h"
#include "mt_build_config.h"
#include "mt_commit.h"
#include "runtime/bench.h"
#include "tools/cli/commands.h"
#include "tools/cli/options.h"

static const char cmd[] = "megatrain bench";

/* --checkpoint-every K[,K...] or auto: the first is the step's, the list the sweep's; auto
 * (MT_PLAN_K_AUTO) stands alone, the run's plan resolves it. */
static int parse_k_list(const char *cmd, const cli_option *opt, const char *arg, void *target)
{
    mt_bench_options *o = target;
    if (!strcmp(arg, "auto")) {
        o->nsweep_K = 1;
        o->sweep_K[0] = o->step.K = MT_PLAN_K_AUTO;
        return 0;
    }
    if (strstr(arg, "auto"))
        return cli_usage_error(cmd, "--checkpoint-every: '%s': auto stands alone (the largest K that fits), not in a list",
                               arg);
    double ks[MT_BENCH_MAX_SWEEP];
    if (cli_parse_list(cmd, "--checkpoint-every", arg, 1, 1 << 20, ks, MT_BENCH_MAX_SWEEP, &o->nsweep_K)) return 2;
    for (int i = 0; i < o->nsweep_K; i++) {
        if (ks[i] != (int)ks[i]) return cli_usage_error(cmd, "--checkpoint-every: '%s' is not a list of integers", arg);
        o->sweep_K[i] = (int)ks[i];
    }
    o->step.K = o->sweep_K[0];
    return 0;
}

/* --clip X[,X...] */
static int parse_clip_list(const char *cmd, const cli_option *opt, const char *arg, void *target)
{
    mt_bench_options *o = target;
    if (cli_parse_list(cmd, "--clip", arg, 0, 1e30, o->sweep_clip, MT_BENCH_MAX_SWEEP, &o->nsweep_clip)) return 2;
    o->step.clip = o->sweep_clip[0];
    return 0;
}

/* --adamw-defer M[,M...] (the step option of train takes one value) */
static int parse_defer_list(const char *cmd, const cli_option *opt, const char *arg, void *target)
{
    mt_bench_options *o = target;
    if (cli_parse_word_list(cmd, "--adamw-defer", arg, cli_auto_on_off, o->sweep_defer, MT_BENCH_MAX_SWEEP,
                            &o->nsweep_defer))
        return 2;
    o->step.adamw_defer = o->sweep_defer[0];
    return 0;
}

/* --ranged-bounds B[,B...]: the names the codelets give mt_ranged_bounds. */
static int parse_bounds_list(const char *cmd, const cli_option *opt, const char *arg, void *target)
{
    mt_bench_options *o = target;
    cli_word names[4] = { { NULL, 0 } };
    for (int b = 0; b < 3; b++) names[b] = (cli_word){ mt_ranged_bounds_option((mt_ranged_bounds)b), b };
    if (cli_parse_word_list(cmd, "--ranged-bounds", arg, names, o->sweep_bounds, MT_BENCH_MAX_SWEEP, &o->nsweep_bounds))
        return 2;
    o->step.ranged_bounds = (mt_ranged_bounds)o->sweep_bounds[0];
    return 0;
}

static const char *show_k(const void *field, char *buf, size_t size)
{
    if (*(const int *)field == MT_PLAN_K_AUTO) return "auto";
    snprintf(buf, size, "%d", *(const int *)field);
    return buf;
}

static const char *show_double(const void *field, char *buf, size_t size)
{
    snprintf(buf, size, "%g", *(const double *)field);
    return buf;
}

#define FIELD(name) offsetof(mt_bench_options, name)

static const cli_option run_options[] = {
    { .name = "steps", .arg = "N", .kind = CLI_INT, .field = FIELD(steps), .min = 1, .max = 1000,
      .show_default = true, .help = "measured steps" },
    { .name = "warmup", .arg = "N", .kind = CLI_INT, .field = FIELD(warmup), .min = 0, .max = 1000,
      .show_default = true, .help = "steps not measured" },
    { .name = "data", .arg = "PATH", .kind = CLI_STRING, .field = FIELD(data),
      .help = "a corpus as train reads it, a fresh batch a step (default: one random batch)" },
    { .name = "dtype", .arg = "bf16|fp32", .kind = CLI_CUSTOM, .field = FIELD(dtype), .parse = cli_dtype_option,
      .help = "weights and compute (default bf16; fp32 is exact fp32, slower)" },
};

static const cli_option k_options[] = {
    { .name = "checkpoint-every", .arg = "K", .kind = CLI_CUSTOM, .field = FIELD(step.K), .parse = parse_k_list,
      .show_default = true, .show = show_k,
      .help = "layers per recompute block; a list (1,2,4) measures each; auto: the largest that fits" },
};

static const cli_option clip_options[] = {
    { .name = "clip", .arg = "X", .kind = CLI_CUSTOM, .field = FIELD(step.clip), .parse = parse_clip_list,
      .show_default = true, .show = show_double, .help = "max gradient norm, 0 = off; a list (1,0) measures each" },
};

static const cli_option memory_options[] = {
    { .name = "resident", .kind = CLI_SET, .field = FIELD(resident), .on = true,
      .help = "no GPU memory limit: no weight is ever evicted" },
    { .name = "gpu-limit-mib", .arg = "N", .kind = CLI_UINT64, .field = FIELD(gpu_limit_mib), .min = 1,
      .max = 1LL << 30, .help = "GPU memory StarPU may use (default: the memory plan + 2% + 256 MiB)" },
    { .name = "gpu-limit-margin", .arg = "P", .kind = CLI_DOUBLE, .field = FIELD(gpu_limit_margin), .lo = 0.01,
      .hi = 1000, .advanced = true, .help = "the GPU limit is the plan + P percent (the bounded-memory test)" },
    { .name = "prefetch", .kind = CLI_SET, .field = FIELD(prefetch), .on = true, .advanced = true,
      .help = "the megatrain policy prefetches the next layer's weights (default)" },
    { .name = "no-prefetch", .kind = CLI_SET, .field = FIELD(prefetch), .on = false, .advanced = true,
      .help = "turn that prefetch off (the ablation)" },
    { .name = "adamw-defer", .arg = "M", .kind = CLI_CUSTOM, .field = FIELD(step.adamw_defer),
      .parse = parse_defer_list, .advanced = true,
      .help = "ranged: auto|on|off, AdamW moments deferred; a list measures each" },
    { .name = "ranged-bounds", .arg = "B", .kind = CLI_CUSTOM, .field = FIELD(step.ranged_bounds),
      .parse = parse_bounds_list, .advanced = true,
      .help = "avx512|avx2 (approximate) or exact; a list measures each (default avx512)" },
    { .name = "norm-log", .arg = "FILE", .kind = CLI_STRING, .field = FIELD(norm_log), .advanced = true,
      .help = "every norm's sums of squares per tile as CSV (what ranged predicts from)" },
    { .name = "task-log", .arg = "FILE", .kind = CLI_STRING, .field = FIELD(task_log), .advanced = true,
      .help = "every task of the measured steps, CPU and GPU workers', as CSV (megatrain policy)" },
};

int cli_bench(int argc, char **argv)
{
    mt_bench_options o = mt_bench_defaults();
    cli_model model = { .shape = o.shape };
    const cli_group groups[] = {
        CLI_GROUP_ONLY("model and data", cli_model_options, &model, "config shape layers rope-scaling"),
        CLI_GROUP(NULL, run_options, &o),
        CLI_GROUP_ONLY("batch", cli_batch_options, &o.step, "micro-batch seq-len accum"),
        CLI_GROUP(NULL, k_options, &o),
        CLI_GROUP("clipping", clip_options, &o),
        CLI_GROUP_ONLY(NULL, cli_clip_options, &o.step,
                       "clip-speculate clip-range clip-range-max clip-range-grow clip-range-memory clip-range-check"),
        CLI_GROUP("host memory", cli_layout_options, &o.host_layout),
        CLI_GROUP("GPU memory", memory_options, &o),
        CLI_GROUP(NULL, cli_gpu_memory_options, &o.gpu_memory),
        CLI_GROUP(NULL, cli_offload_options, &o.step),
        CLI_GROUP(NULL, cli_mlp_chunk_options, &o.step),
        CLI_GROUP("workers", cli_worker_options, &o.runtime),
    };
    const cli_command c = {
        .name = cmd,
        .usage = "usage: megatrain bench [options]\n\n"
                 "Times the training step of a published shape, or of an HF config.json's model (--config),\n"
                 "with random weights: medians over the measured steps after warm-up. Model TFLOP/s =\n"
                 "(6 N + 6 L d T) tokens / time, N = all parameters but the embedding table (the LM head\n"
                 "counts also when tied; of an MoE, the active parameters only); recompute not counted.\n"
                 "After each row, stderr shows where the CUDA worker sat idle in the measured steps\n"
                 "(megatrain policy only): idle before each kind of task, the longest gaps.\n"
                 "AdamW columns: alone = one fused update of every parameter with nothing else running;\n"
                 "in step = the CPU workers' seconds in AdamW tasks per measured step, and that over the\n"
                 "workers and 1e9 parameters; span = first to last AdamW end of a step; tail = its last\n"
                 "AdamW end after layer 0's backward.\n"
                 "Lists share one host state, each run training on from the last: for each K and clip,\n"
                 "each --adamw-defer value, within it each --ranged-bounds (a value may repeat).\n"
                 "--seq-len: 2048 unless given, or the model's longest sequence where that is shorter\n"
                 "(tiny: 256). Without a CUDA worker the table drops the GPU columns.\n",
        .groups = groups,
        .ngroups = sizeof groups / sizeof groups[0],
        .advanced_note = cli_speculation_note,
    };
    int status;
    cli_given given;
    if (!cli_parse(&c, argc, argv, &given, &status)) return status;
    const int env = cli_environment(cmd, &o.runtime, &o.step);
    if (env) return env;
    if (cli_was_given(&given, "config")) {
        if (cli_was_given(&given, "shape")) return cli_usage_error(cmd, "give --config or --shape, not both");
        model.shape = NULL;
    }
    o.shape = model.shape;
    o.config_path = model.config_path;
    o.layers = model.layers;
    o.rope_scaling = model.rope_scaling;
    o.k_default = !cli_was_given(&given, "checkpoint-every");
    mt_model_config cfg;
    const int bad = cli_model_config(cmd, &model, &cfg);
    if (bad) return bad;
    if (o.step.K > cfg.layers) o.step.K = (int)cfg.layers;
    /* The default length is one every shape takes; a length given is checked as it is. */
    if (!cli_was_given(&given, "seq-len") && o.step.T > mt_config_max_seq_len(&cfg)) o.step.T = mt_config_max_seq_len(&cfg);
    const int count = mt_bench_count(&o);
    mt_bench_result *res = calloc((size_t)count, sizeof *res);
    if (!res) return cli_failed(cmd, "out of memory for the results");
    char err[1024];
    fprintf(stderr, "bench: megatrain %s, commit %s\n", MT_VERSION, MT_COMMIT);
    /* Rows print as each pair finishes, so a long sweep cut short keeps what it measured. */
    if (mt_bench_run(&o, res, stderr, stdout, err, sizeof err)) {
        free(res);
        return cli_failed(cmd, err);
    }
    mt_bench_print_notes(&o, res, count, stdout);
    free(res);
    return 0;
}
