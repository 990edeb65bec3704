/* megatrain eval: the validation loss and perplexity of an HF model directory on prepared data
 * or a text corpus (runtime/eval.h), through the training graph's forward-only path. */
#include <stdio.h>

#include "runtime/eval.h"
#include "tools/cli/commands.h"
#include "tools/cli/options.h"

static const char cmd[] = "megatrain eval";

#define FIELD(name) offsetof(mt_eval_options, name)

static const cli_option eval_options[] = {
    { .name = "data", .arg = "PATH", .kind = CLI_STRING, .field = FIELD(data_path),
      .help = "a 'megatrain prepare' directory (its validation split), or text read as bytes (byte-level models)" },
    { .name = "seq-len", .arg = "T", .kind = CLI_INT64, .field = FIELD(T), .min = 1, .max = CLI_MAX_SEQ_LEN,
      .help = "tokens per window (default: the prepared data's seq_len; text: 128)" },
    { .name = "max-sequences", .arg = "N", .kind = CLI_INT64, .field = FIELD(max_sequences), .min = 1,
      .max = INT64_MAX / 2, .help = "evaluate the first N validation windows only (default: all)" },
    { .name = "dtype", .arg = "fp32|bf16", .kind = CLI_CUSTOM, .field = FIELD(dtype), .parse = cli_dtype_option,
      .help = "weights and compute (default: bf16 on a GPU, else fp32)" },
    { .name = "allow-other-tokenizer", .kind = CLI_SET, .field = FIELD(allow_other_tokenizer), .on = true,
      .help = "evaluate although the model's tokenizer.json is not the one the data was prepared with" },
};

int cli_eval(int argc, char **argv)
{
    mt_eval_options o = mt_eval_defaults();
    cli_model model = { 0 };
    mt_step_config batch = { .B = o.B, .K = o.K };
    const cli_group groups[] = {
        CLI_GROUP_ONLY("options", cli_model_options, &model, "model rope-scaling"),
        CLI_GROUP(NULL, eval_options, &o),
        CLI_GROUP_ONLY(NULL, cli_batch_options, &batch, "micro-batch checkpoint-every"),
        CLI_GROUP("workers", cli_worker_options, &o.runtime),
    };
    const cli_command c = {
        .name = cmd,
        .usage = "usage: megatrain eval --model DIR --data PATH [options]\n\n"
                 "Prints the model's loss on the validation windows of PATH, in nats per token, its\n"
                 "perplexity (exp of the loss) and the targets counted (a prepared directory's masked\n"
                 "positions count for nothing). PATH is a 'megatrain prepare' directory (its validation\n"
                 "split), or, for byte-level models, a text file or directory read as bytes (every 10th\n"
                 "4 KiB block, as train validates). It runs train's validation path: on the GPU in bf16\n"
                 "when there is one, on the CPU workers in fp32 otherwise (--ncuda 0).\n",
        .groups = groups,
        .ngroups = sizeof groups / sizeof groups[0],
    };
    cli_given given;
    int status;
    if (!cli_parse(&c, argc, argv, &given, &status)) return status;
    const int env = cli_environment(cmd, &o.runtime, NULL);
    if (env) return env;
    if (!model.model_dir || !o.data_path) return cli_usage_error(cmd, "--model DIR and --data PATH are both needed");
    o.model_dir = model.model_dir;
    o.rope_scaling = model.rope_scaling;
    o.B = batch.B;
    o.K = batch.K;
    o.dtype_explicit = cli_was_given(&given, "dtype");
    mt_eval_result r;
    char err[2048];
    if (mt_eval_run(&o, &r, stderr, err, sizeof err)) return cli_failed(cmd, err);
    printf("loss %.6f nats/token, perplexity %.4f, %lld tokens counted in %lld windows of %lld (%s)\n", r.loss,
           r.perplexity, (long long)r.tokens, (long long)r.sequences, (long long)r.T, mt_dtype_name(r.dtype));
    return 0;
}
