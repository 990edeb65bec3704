/* megatrain generate: text from an HF model directory, token by token, printed as it comes
 * (runtime/generate.h). */
#include <stdio.h>

#include "runtime/generate.h"
#include "tools/cli/commands.h"
#include "tools/cli/options.h"

static const char cmd[] = "megatrain generate";

#define FIELD(name) offsetof(mt_generate_options, name)

static const cli_option generate_options[] = {
    { .name = "tokenizer", .arg = "FILE", .kind = CLI_STRING, .field = FIELD(tokenizer_path),
      .help = "the tokenizer.json (default: the model directory's)" },
    { .name = "prompt", .arg = "TEXT", .kind = CLI_STRING, .field = FIELD(prompt), .help = "the text to continue" },
    { .name = "chat", .kind = CLI_SET, .field = FIELD(chat), .on = true,
      .help = "the prompt is a user turn of the chat template; the answer stops at its end-of-turn token" },
    { .name = "family", .arg = "NAME", .kind = CLI_STRING, .field = FIELD(family),
      .help = "chat template: qwen2, qwen3, llama3, mistral (default: from model_type)" },
    { .name = "max-new-tokens", .arg = "N", .kind = CLI_INT64, .field = FIELD(max_new_tokens), .min = 1,
      .max = CLI_MAX_SEQ_LEN, .help = "new tokens at most", .show_default = true },
    { .name = "temperature", .arg = "T", .kind = CLI_DOUBLE, .field = FIELD(sampling.temperature), .lo = 0, .hi = 1e6,
      .help = "softmax temperature; 0: greedy (the most probable token)", .show_default = true },
    { .name = "top-p", .arg = "P", .kind = CLI_DOUBLE, .field = FIELD(sampling.top_p), .lo = 1e-300, .hi = 1,
      .help = "draw among the most probable tokens whose probabilities sum to P", .show_default = true },
    { .name = "seed", .arg = "S", .kind = CLI_UINT64, .field = FIELD(seed), .min = 0, .max = INT64_MAX,
      .help = "the sampler's seed (the same seed, the same text)", .show_default = true },
    { .name = "dtype", .arg = "fp32|bf16", .kind = CLI_CUSTOM, .field = FIELD(dtype), .parse = cli_dtype_option,
      .help = "weights and compute (default: bf16 on a GPU, else fp32)" },
};

int cli_generate(int argc, char **argv)
{
    mt_generate_options o = mt_generate_defaults();
    cli_model model = { 0 };
    const cli_group groups[] = {
        CLI_GROUP_ONLY("options", cli_model_options, &model, "model rope-scaling"),
        CLI_GROUP(NULL, generate_options, &o),
        CLI_GROUP("workers", cli_worker_options, &o.runtime),
    };
    const cli_command c = {
        .name = cmd,
        .usage = "usage: megatrain generate --model DIR --prompt TEXT [options]\n\n"
                 "Continues the prompt with the model, token by token, and prints the new text as it\n"
                 "comes; stops at an end-of-sequence token (config.json's and generation_config.json's\n"
                 "eos_token_id, with --chat also the template's end of turn) or after --max-new-tokens.\n"
                 "Greedy by default; --temperature T > 0 samples, --top-p P keeps the nucleus.\n"
                 "It runs the training graph's forward: on the GPU in bf16 when there is one, on the\n"
                 "CPU workers in fp32 otherwise (--ncuda 0), with no KV cache: each new token runs the\n"
                 "model over the whole text so far.\n",
        .groups = groups,
        .ngroups = sizeof groups / sizeof groups[0],
    };
    cli_given given;
    int status;
    if (!cli_parse(&c, argc, argv, &given, &status)) return status;
    const int env = cli_environment(cmd, &o.runtime, NULL);
    if (env) return env;
    if (!model.model_dir || !o.prompt) return cli_usage_error(cmd, "--model DIR and --prompt TEXT are both needed");
    o.model_dir = model.model_dir;
    o.rope_scaling = model.rope_scaling;
    o.dtype_explicit = cli_was_given(&given, "dtype");
    mt_generate_result r;
    char err[2048];
    if (mt_generate_run(&o, stdout, &r, err, sizeof err)) {
        fflush(stdout);
        return cli_failed(cmd, err);
    }
    printf("\n");
    fprintf(stderr, "megatrain generate: %lld prompt tokens, %lld new, %s (%s on %s)\n", (long long)r.prompt_tokens,
            (long long)r.new_tokens, r.eos ? "stopped at end of sequence" : "stopped at --max-new-tokens or the model's length",
            mt_dtype_name(r.dtype), r.ncuda > 0 ? "the GPU" : "the CPU workers");
    return 0;
}
