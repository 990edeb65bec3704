/* megatrain grads: one batch's loss, logits and gradients (runtime/grads.h) as fp32
 * safetensors, what tools/parity_suite.py and tests/test_parity.c compare with transformers. */
#include <stdio.h>

#include "runtime/grads.h"
#include "tools/cli/commands.h"
#include "tools/cli/options.h"

static const char cmd[] = "megatrain grads";

#define FIELD(name) offsetof(mt_grads_options, name)

static const cli_option grads_options[] = {
    { .name = "tokens", .arg = "FILE", .kind = CLI_STRING, .field = FIELD(tokens_path),
      .help = "B x (T + 1) little-endian int32 ids; targets are the next ids" },
    { .name = "batch", .arg = "B", .kind = CLI_INT64, .field = FIELD(B), .min = 1, .max = CLI_MAX_BATCH,
      .help = "sequences" },
    { .name = "seq-len", .arg = "T", .kind = CLI_INT64, .field = FIELD(T), .min = 1, .max = CLI_MAX_SEQ_LEN,
      .help = "predicted positions per sequence" },
    { .name = "out", .arg = "FILE", .kind = CLI_STRING, .field = FIELD(out_path), .help = "output .safetensors" },
    { .name = "logits", .kind = CLI_SET, .field = FIELD(logits), .on = true,
      .help = "also write \"logits\" [B, T, V], the fp32 CPU forward's, whatever --ncuda says" },
    { .name = "save-model", .arg = "DIR", .kind = CLI_STRING, .field = FIELD(save_model_dir),
      .help = "also write the loaded model as an HF directory (fp32 safetensors)" },
    { .name = "dtype", .arg = "fp32|bf16", .kind = CLI_CUSTOM, .field = FIELD(dtype), .parse = cli_dtype_option,
      .help = "weights and compute; fp32 is exact (default: bf16 on a GPU, else fp32)" },
};

int cli_grads(int argc, char **argv)
{
    mt_grads_options o = { .K = 2, .runtime = mt_runtime_defaults() };
    cli_model model = { 0 };
    mt_step_config batch = { .K = o.K };
    const cli_group groups[] = {
        CLI_GROUP_ONLY("options", cli_model_options, &model, "model rope-scaling"),
        CLI_GROUP(NULL, grads_options, &o),
        CLI_GROUP_ONLY(NULL, cli_batch_options, &batch, "checkpoint-every"),
        CLI_GROUP(NULL, cli_mlp_chunk_options, &batch),
        CLI_GROUP("workers", cli_worker_options, &o.runtime),
    };
    const cli_command c = {
        .name = cmd,
        .usage = "usage: megatrain grads --model DIR --tokens FILE --batch B --seq-len T --out FILE [options]\n\n"
                 "Runs the forward, loss and backward of one batch with the training step's graph (no\n"
                 "update) and writes the loss and every parameter gradient, under HF names, as fp32\n"
                 "safetensors: what tools/parity_suite.py and tests/test_parity.c compare with\n"
                 "transformers. --ncuda 0 runs the exact fp32 CPU path.\n",
        .groups = groups,
        .ngroups = sizeof groups / sizeof groups[0],
    };
    cli_given given;
    int status;
    if (!cli_parse(&c, argc, argv, &given, &status)) return status;
    const int env = cli_environment(cmd, &o.runtime, NULL);
    if (env) return env;
    o.model_dir = model.model_dir;
    o.rope_scaling = model.rope_scaling;
    o.K = batch.K;
    o.mlp_chunk = batch.mlp_chunk;
    o.dtype_explicit = cli_was_given(&given, "dtype");
    if (!o.model_dir || !o.tokens_path || !o.out_path || !o.B || !o.T)
        return cli_usage_error(cmd, "--model, --tokens, --batch, --seq-len and --out are all needed");
    double loss;
    char err[1024];
    if (mt_grads_run(&o, &loss, err, sizeof err)) return cli_failed(cmd, err);
    printf("loss %.9f; %s written to %s\n", loss, o.logits ? "logits and gradients" : "gradients", o.out_path);
    if (o.save_model_dir) printf("model saved to %s (HF format, fp32)\n", o.save_model_dir);
    return 0;
}
