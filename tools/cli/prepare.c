/* megatrain prepare: text or chat JSONL tokenised into packed token shards with a loss mask
 * (runtime/dataset.h, docs/data.md), for train --data. */
#include <limits.h>
#include <stdio.h>

#include "runtime/dataset.h"
#include "runtime/prepare.h"
#include "tools/cli/commands.h"
#include "tools/cli/options.h"

static const char cmd[] = "megatrain prepare";

_Static_assert(sizeof(mt_input_format) == sizeof(int), "--format stores an int");
_Static_assert(sizeof(mt_text_unit) == sizeof(int), "--text-unit stores an int");

/* --family: mt_chat_family_parse's names. */
static int parse_family(const char *cmd, const cli_option *opt, const char *arg, void *target)
{
    if (!mt_chat_family_parse(arg, &((mt_prepare_options *)target)->family)) return 0;
    return cli_usage_error(cmd, "--family: '%s' is not qwen2, qwen3, llama3 or mistral", arg);
}

static const cli_word formats[] = {
    { "text", MT_INPUT_TEXT }, { "alpaca", MT_INPUT_ALPACA }, { "sharegpt", MT_INPUT_SHAREGPT }, { NULL, 0 },
};
static const cli_word text_units[] = { { "paragraph", MT_TEXT_PARAGRAPH }, { "file", MT_TEXT_FILE }, { NULL, 0 } };

#define FIELD(name) offsetof(mt_prepare_options, name)

static const cli_option prepare_options[] = {
    { .name = "tokenizer", .arg = "FILE", .kind = CLI_STRING, .field = FIELD(tokenizer_path),
      .help = "HF tokenizer.json: byte-level BPE, or BPE with byte fallback" },
    { .name = "format", .arg = "F", .kind = CLI_WORD, .field = FIELD(format), .words = formats,
      .help = "text, alpaca (instruction JSONL) or sharegpt (conversation JSONL)" },
    { .name = "family", .arg = "NAME", .kind = CLI_CUSTOM, .field = FIELD(family), .parse = parse_family,
      .help = "chat template and separator: qwen2 (Qwen2/2.5), qwen3, llama3, mistral" },
    { .name = "input", .arg = "PATH", .kind = CLI_STRING, .field = FIELD(input_path),
      .help = "a file, or a directory whose files are read in name order" },
    { .name = "output", .arg = "DIR", .kind = CLI_STRING, .field = FIELD(output_dir),
      .help = "new directory (written as DIR.tmp, then renamed)" },
    { .name = "seq-len", .arg = "T", .kind = CLI_INT64, .field = FIELD(seq_len), .min = 1, .max = CLI_MAX_SEQ_LEN,
      .help = "tokens per training sequence" },
    { .name = "val-fraction", .arg = "F", .kind = CLI_DOUBLE, .field = FIELD(val_fraction), .lo = 0, .hi = 0.99,
      .show_default = true, .help = "fraction of documents held out for validation" },
    { .name = "seed", .arg = "N", .kind = CLI_UINT64, .field = FIELD(seed), .min = 0, .max = LLONG_MAX,
      .show_default = true, .help = "document shuffle seed" },
    { .name = "text-unit", .arg = "U", .kind = CLI_WORD, .field = FIELD(text_unit), .words = text_units,
      .show_default = true, .help = "plain text: a document is a paragraph or a whole file" },
    { .name = "shard-sequences", .arg = "N", .kind = CLI_INT64, .field = FIELD(shard_sequences), .min = 1,
      .max = 1LL << 40, .help = "windows per shard file (default: about 256 MiB of tokens)" },
};

/* "1 document, 3 windows, 40 trained targets": a split's counts, each noun in the number it has. */
static void counts_text(int64_t documents, int64_t windows, int64_t trained, char buf[160])
{
    snprintf(buf, 160, "%lld document%s, %lld window%s, %lld trained target%s", (long long)documents,
             documents == 1 ? "" : "s", (long long)windows, windows == 1 ? "" : "s", (long long)trained,
             trained == 1 ? "" : "s");
}

int cli_prepare(int argc, char **argv)
{
    mt_prepare_options o = mt_prepare_defaults();
    const cli_group groups[] = { CLI_GROUP("options", prepare_options, &o) };
    const cli_command c = {
        .name = cmd,
        .usage = "usage: megatrain prepare --tokenizer FILE --format text|alpaca|sharegpt --family FAMILY\n"
                 "                         --input FILE_OR_DIR --output DIR --seq-len T [options]\n\n"
                 "Tokenises text or JSONL conversations into packed token shards with a loss mask, for\n"
                 "'megatrain train --data DIR'. Conversations are rendered with the family's chat template\n"
                 "and only assistant answers (and their end-of-turn token) are trained. Documents are\n"
                 "shuffled with the seed, split into train and validation, joined with the family's\n"
                 "end-of-text token and cut into windows of T + 1 tokens. docs/data.md has the format.\n",
        .groups = groups,
        .ngroups = sizeof groups / sizeof groups[0],
    };
    cli_given given;
    int status;
    if (!cli_parse(&c, argc, argv, &given, &status)) return status;
    /* The format, family and length have defaults in mt_prepare_options, but a run must name them. */
    if (!o.tokenizer_path) return cli_usage_error(cmd, "--tokenizer FILE is required");
    if (!cli_was_given(&given, "format")) return cli_usage_error(cmd, "--format text|alpaca|sharegpt is required");
    if (!cli_was_given(&given, "family")) return cli_usage_error(cmd, "--family qwen2|qwen3|llama3|mistral is required");
    if (!o.input_path) return cli_usage_error(cmd, "--input FILE_OR_DIR is required");
    if (!o.output_dir) return cli_usage_error(cmd, "--output DIR is required");
    if (!cli_was_given(&given, "seq-len")) return cli_usage_error(cmd, "--seq-len T is required");
    mt_prepare_result res;
    char err[2048];
    if (mt_prepare(&o, &res, stderr, err, sizeof err)) return cli_failed(cmd, err);
    char part[2][160];
    for (int s = 0; s < 2; s++) counts_text(res.documents[s], res.sequences[s], res.trained[s], part[s]);
    printf("prepared %s: train %s; validation %s\n", o.output_dir, part[0], part[1]);
    return 0;
}
