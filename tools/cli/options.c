/* The option parser (getopt_long over the subcommand's tables), the help printer, the value
 * parsers every subcommand uses, and the tables of the options several subcommands share. */
#include "tools/cli/options.h"

#include "backends/cpu/ranged_flags.h"

#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define STRINGIFY(x) #x
#define TEXT(x) STRINGIFY(x)

/* ---- messages and values -------------------------------------------------------------- */

int cli_usage_error(const char *cmd, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: ", cmd);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, " (try '%s --help')\n", cmd);
    va_end(ap);
    return 2;
}

int cli_failed(const char *cmd, const char *err)
{
    fprintf(stderr, "%s: %s\n", cmd, err);
    return 1;
}

int cli_parse_int(const char *cmd, const char *flag, const char *s, long long lo, long long hi, long long *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end) {
        cli_usage_error(cmd, "%s: '%s' is not an integer", flag, s);
        return -1;
    }
    if (v < lo || v > hi) {
        fprintf(stderr, "%s: %s: %lld is out of range [%lld, %lld]\n", cmd, flag, v, lo, hi);
        return -1;
    }
    *out = v;
    return 0;
}

int cli_parse_double(const char *cmd, const char *flag, const char *s, double lo, double hi, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v)) {
        cli_usage_error(cmd, "%s: '%s' is not a number", flag, s);
        return -1;
    }
    if (v < lo || v > hi) {
        fprintf(stderr, "%s: %s: %g is out of range [%g, %g]\n", cmd, flag, v, lo, hi);
        return -1;
    }
    *out = v;
    return 0;
}

int cli_parse_bytes(const char *cmd, const char *flag, const char *s, uint64_t *out)
{
    static const struct { const char *suffix; double unit; } units[] = {
        { "", 1 }, { "B", 1 },
        { "K", 0x1p10 }, { "KiB", 0x1p10 }, { "KB", 1e3 }, { "M", 0x1p20 }, { "MiB", 0x1p20 }, { "MB", 1e6 },
        { "G", 0x1p30 }, { "GiB", 0x1p30 }, { "GB", 1e9 }, { "T", 0x1p40 }, { "TiB", 0x1p40 }, { "TB", 1e12 },
        { "P", 0x1p50 }, { "PiB", 0x1p50 }, { "PB", 1e15 },
    };
    char *end;
    errno = 0;
    const double v = strtod(s, &end);
    for (size_t k = 0; end != s && !errno && isfinite(v) && v >= 0 && k < sizeof units / sizeof units[0]; k++) {
        if (strcmp(end, units[k].suffix)) continue;
        const double bytes = v * units[k].unit;
        if (bytes >= 0x1p63) break;
        *out = (uint64_t)bytes;
        return 0;
    }
    cli_usage_error(cmd, "%s: '%s' is not a byte count (a number, or one with a suffix: K M G T P, powers of 1024, "
                         "or KB MB GB TB PB, powers of 1000: 125G, 1.5T)", flag, s);
    return -1;
}

int cli_bytes_option(const char *cmd, const cli_option *opt, const char *arg, void *target)
{
    char flag[64];
    snprintf(flag, sizeof flag, "--%s", opt->name);
    uint64_t *out = (uint64_t *)((char *)target + opt->field);
    if (cli_parse_bytes(cmd, flag, arg, out)) return 2;
    if (*out >= (uint64_t)opt->min) return 0;
    fprintf(stderr, "%s: %s: %s is below %lld bytes\n", cmd, flag, arg, opt->min);
    return 2;
}

/* "a, b or c": the words of a list, for a message. */
static const char *word_choices(const cli_word *words, char *buf, size_t size)
{
    size_t n = 0;
    while (words[n].word) n++;
    buf[0] = 0;
    for (size_t k = 0; k < n; k++) {
        const char *sep = k == 0 ? "" : k + 1 == n ? " or " : ", ";
        size_t used = strlen(buf);
        snprintf(buf + used, size - used, "%s%s", sep, words[k].word);
    }
    return buf;
}

/* The word's entry in words, else NULL after a message naming the flag and the choices. */
static const cli_word *find_word(const char *cmd, const char *flag, const char *arg, const cli_word *words)
{
    for (const cli_word *w = words; w->word; w++)
        if (!strcmp(arg, w->word)) return w;
    char choices[256];
    cli_usage_error(cmd, "%s: '%s' is not %s", flag, arg, word_choices(words, choices, sizeof choices));
    return NULL;
}

/* Calls item(k, token) on each comma-separated token of s, at most max of them; *n: how many.
 * Each item reports its own errors. */
typedef int (*list_item)(const char *cmd, const char *flag, const char *tok, int k, const void *ctx);

static int split_list(const char *cmd, const char *flag, const char *s, int max, int *n, list_item item, const void *ctx)
{
    char buf[256];
    if (strlen(s) >= sizeof buf) return cli_usage_error(cmd, "%s: '%s' is too long", flag, s), -1;
    snprintf(buf, sizeof buf, "%s", s);
    *n = 0;
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (*n == max) {
            fprintf(stderr, "%s: %s: at most %d values\n", cmd, flag, max);
            return -1;
        }
        if (item(cmd, flag, tok, (*n)++, ctx)) return -1;
    }
    if (*n == 0) return cli_usage_error(cmd, "%s: '%s' holds no value", flag, s), -1;
    return 0;
}

typedef struct number_item { double lo, hi, *out; } number_item;

static int number_of(const char *cmd, const char *flag, const char *tok, int k, const void *ctx)
{
    const number_item *c = ctx;
    return cli_parse_double(cmd, flag, tok, c->lo, c->hi, &c->out[k]);
}

int cli_parse_list(const char *cmd, const char *flag, const char *s, double lo, double hi, double *out, int max, int *n)
{
    number_item c = { lo, hi, out };
    return split_list(cmd, flag, s, max, n, number_of, &c);
}

typedef struct word_item { const cli_word *words; int *out; } word_item;

static int word_of(const char *cmd, const char *flag, const char *tok, int k, const void *ctx)
{
    const word_item *c = ctx;
    const cli_word *w = find_word(cmd, flag, tok, c->words);
    if (!w) return -1;
    c->out[k] = w->value;
    return 0;
}

int cli_parse_word_list(const char *cmd, const char *flag, const char *s, const cli_word *words, int *out, int max,
                        int *n)
{
    word_item c = { words, out };
    return split_list(cmd, flag, s, max, n, word_of, &c);
}

const cli_word cli_auto_on_off[] = { { "auto", -1 }, { "on", 1 }, { "off", 0 }, { NULL, 0 } };

int cli_dtype_option(const char *cmd, const cli_option *opt, const char *arg, void *target)
{
    if (!mt_dtype_parse(arg, (mt_dtype *)((char *)target + opt->field))) return 0;
    return cli_usage_error(cmd, "--%s: '%s' is not fp32 or bf16", opt->name, arg);
}

/* ---- the parser ------------------------------------------------------------------------ */

/* Whether group g takes the option named name (its `only` list, when it has one). */
static bool group_takes(const cli_group *g, const char *name)
{
    if (!g->only) return true;
    size_t len = strlen(name);
    for (const char *p = g->only; (p = strstr(p, name)); p += len)
        if ((p == g->only || p[-1] == ' ') && (p[len] == 0 || p[len] == ' ')) return true;
    return false;
}

/* The options a command takes, in help order: option k of it comes from groups[group[k]]. */
typedef struct option_list {
    const cli_option *options[CLI_MAX_OPTIONS];
    int group[CLI_MAX_OPTIONS];
    int count;
} option_list;

/* Two entries of one name, or more than CLI_MAX_OPTIONS, are errors in the tables: abort. */
static void list_options(const cli_command *c, option_list *l)
{
    l->count = 0;
    for (int g = 0; g < c->ngroups; g++)
        for (int k = 0; k < c->groups[g].count; k++) {
            const cli_option *o = &c->groups[g].options[k];
            if (!group_takes(&c->groups[g], o->name)) continue;
            for (int j = 0; j < l->count; j++)
                if (!strcmp(l->options[j]->name, o->name)) {
                    fprintf(stderr, "%s: --%s is in two of the command's option tables\n", c->name, o->name);
                    abort();
                }
            if (l->count == CLI_MAX_OPTIONS) {
                fprintf(stderr, "%s: more than %d options (CLI_MAX_OPTIONS)\n", c->name, CLI_MAX_OPTIONS);
                abort();
            }
            l->options[l->count] = o;
            l->group[l->count++] = g;
        }
}

/* The default's text of option o over target (NULL: none to show). */
static const char *default_text(const cli_option *o, const void *target, char *buf, size_t size)
{
    const char *field = (const char *)target + o->field;
    if (o->show) return o->show(field, buf, size);
    switch (o->kind) {
    case CLI_STRING: return *(const char *const *)field;
    case CLI_INT: snprintf(buf, size, "%d", *(const int *)field); return buf;
    case CLI_INT64: snprintf(buf, size, "%lld", (long long)*(const int64_t *)field); return buf;
    case CLI_UINT64: snprintf(buf, size, "%llu", (unsigned long long)*(const uint64_t *)field); return buf;
    case CLI_DOUBLE: snprintf(buf, size, "%g", *(const double *)field); return buf;
    case CLI_WORD:
        for (const cli_word *w = o->words; w->word; w++)
            if (w->value == *(const int *)field) return w->word;
        return NULL;
    case CLI_SET:
    case CLI_CUSTOM: return NULL;
    }
    return NULL;
}

static void print_line(const char *name, const char *arg, const char *help, const char *dflt)
{
    char head[64];
    snprintf(head, sizeof head, "--%s%s%s", name, arg ? " " : "", arg ? arg : "");
    printf("  %-21s %s", head, help);
    if (dflt) printf(" (default %s)", dflt);
    putchar('\n');
}

static void print_option(const cli_option *o, const void *target)
{
    char buf[64];
    print_line(o->name, o->arg, o->help, o->show_default ? default_text(o, target, buf, sizeof buf) : NULL);
}

/* The help: usage, the sections of the options that are not advanced (the defaults read from
 * the targets as they are), then, with all, the advanced options. */
static void print_help(const cli_command *c, const option_list *l, bool all)
{
    fputs(c->usage, stdout);
    int advanced = 0;
    const char *printed = NULL; /* the heading of the section printed last */
    for (int k = 0; k < l->count; k++) {
        if (l->options[k]->advanced) {
            advanced++;
            continue;
        }
        const char *section = NULL; /* the title of this group, or of the nearest group above */
        for (int g = l->group[k]; g >= 0 && !section; g--) section = c->groups[g].title;
        if (section && section != printed) printf("\n%s:\n", printed = section);
        print_option(l->options[k], c->groups[l->group[k]].target);
    }
    print_line("help", NULL, advanced ? "this help; --help-all: also the advanced options" : "this help", NULL);
    if (!all || !advanced) return;
    printf("\nadvanced (research and measurement):\n");
    if (c->advanced_note) fputs(c->advanced_note, stdout);
    for (int k = 0; k < l->count; k++)
        if (l->options[k]->advanced) print_option(l->options[k], c->groups[l->group[k]].target);
}

/* Stores option o's argument at its field of target: 0, or 2 after the message. */
static int take(const char *cmd, const cli_option *o, const char *arg, void *target)
{
    char *field = (char *)target + o->field;
    char flag[64];
    snprintf(flag, sizeof flag, "--%s", o->name);
    long long v;
    switch (o->kind) {
    case CLI_SET: *(bool *)field = o->on; return 0;
    case CLI_STRING: *(const char **)field = arg; return 0;
    case CLI_INT:
        if (cli_parse_int(cmd, flag, arg, o->min, o->max, &v)) return 2;
        *(int *)field = (int)v;
        return 0;
    case CLI_INT64:
        if (cli_parse_int(cmd, flag, arg, o->min, o->max, &v)) return 2;
        *(int64_t *)field = v;
        return 0;
    case CLI_UINT64:
        if (cli_parse_int(cmd, flag, arg, o->min, o->max, &v)) return 2;
        *(uint64_t *)field = (uint64_t)v;
        return 0;
    case CLI_DOUBLE: return cli_parse_double(cmd, flag, arg, o->lo, o->hi, (double *)field) ? 2 : 0;
    case CLI_WORD: {
        const cli_word *w = find_word(cmd, flag, arg, o->words);
        if (!w) return 2;
        *(int *)field = w->value;
        return 0;
    }
    case CLI_CUSTOM: return o->parse(cmd, o, arg, target);
    }
    return 2;
}

bool cli_was_given(const cli_given *g, const char *name)
{
    for (int k = 0; k < g->count; k++)
        if (!strcmp(g->names[k], name)) return true;
    return false;
}

bool cli_parse(const cli_command *c, int argc, char **argv, cli_given *given, int *status)
{
    option_list l;
    list_options(c, &l);
    enum { FIRST = 256, HELP = FIRST + CLI_MAX_OPTIONS, HELP_ALL };
    struct option longopts[CLI_MAX_OPTIONS + 3];
    for (int k = 0; k < l.count; k++)
        longopts[k] = (struct option){ l.options[k]->name, l.options[k]->arg ? required_argument : no_argument, 0, FIRST + k };
    longopts[l.count] = (struct option){ "help", no_argument, 0, HELP };
    longopts[l.count + 1] = (struct option){ "help-all", no_argument, 0, HELP_ALL };
    longopts[l.count + 2] = (struct option){ 0, 0, 0, 0 };
    if (given) given->count = 0;
    int ch;
    while ((ch = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
        if (ch == HELP || ch == HELP_ALL) {
            print_help(c, &l, ch == HELP_ALL);
            *status = 0;
            return false;
        }
        *status = 2;
        if (ch < FIRST || ch >= FIRST + l.count) return false; /* getopt named the option */
        const cli_option *o = l.options[ch - FIRST];
        if (take(c->name, o, optarg, c->groups[l.group[ch - FIRST]].target)) return false;
        if (given && !cli_was_given(given, o->name)) given->names[given->count++] = o->name;
    }
    if (optind < argc) {
        *status = cli_usage_error(c->name, "unexpected argument '%s'", argv[optind]);
        return false;
    }
    *status = 0;
    return true;
}

/* ---- the shared options ------------------------------------------------------------------ */

#define SHAPES "qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-3b, qwen2.5-7b, qwen2.5-14b, qwen2.5-32b, tiny"
#define SHAPES_SHORT "qwen2.5-0.5b|1.5b|3b|7b|14b|32b or tiny"

/* --rope-scaling TYPE:FACTOR, checked here so that a typo stops the command before any work. */
static int parse_rope_scaling(const char *cmd, const cli_option *opt, const char *arg, void *target)
{
    mt_rope_type type;
    double factor;
    char err[256];
    if (mt_rope_scaling_parse(arg, &type, &factor, err, sizeof err))
        return cli_usage_error(cmd, "%s", err);
    *(const char **)((char *)target + opt->field) = arg;
    return 0;
}

const cli_option cli_model_options[5] = {
    { .name = "config", .arg = "FILE", .kind = CLI_STRING, .field = offsetof(cli_model, config_path),
      .help = "an HF config.json", .show_default = true },
    { .name = "model", .arg = "DIR", .kind = CLI_STRING, .field = offsetof(cli_model, model_dir),
      .help = "an HF model directory (config.json + safetensors)" },
    { .name = "shape", .arg = "NAME", .kind = CLI_STRING, .field = offsetof(cli_model, shape),
      .help = SHAPES_SHORT, .show_default = true },
    { .name = "layers", .arg = "N", .kind = CLI_INT64, .field = offsetof(cli_model, layers), .min = 1, .max = 1 << 16,
      .help = "override the shape's layer count (memory-bound checks)", .advanced = true },
    { .name = "rope-scaling", .arg = "TYPE:F", .kind = CLI_CUSTOM, .field = offsetof(cli_model, rope_scaling),
      .parse = parse_rope_scaling,
      .help = "yarn|linear|dynamic: F times the model's context (e.g. yarn:4)" },
};

int cli_model_config(const char *cmd, const cli_model *m, mt_model_config *cfg)
{
    char err[1024];
    if (m->shape) {
        if (mt_config_from_shape(m->shape, cfg)) return cli_usage_error(cmd, "--shape: unknown shape '%s' (" SHAPES ")", m->shape);
    } else if (mt_config_load(m->config_path, cfg, err, sizeof err)) {
        return cli_failed(cmd, err);
    }
    if (m->layers > 0 && mt_config_set_layers(cfg, m->layers, err, sizeof err)) return cli_failed(cmd, err);
    if (m->rope_scaling) {
        if (mt_config_set_rope_scaling(cfg, m->rope_scaling, err, sizeof err))
            return cli_failed(cmd, err);
    }
    return 0;
}

const cli_option cli_batch_options[4] = {
    { .name = "micro-batch", .arg = "B", .kind = CLI_INT64, .field = offsetof(mt_step_config, B), .min = 1,
      .max = CLI_MAX_BATCH, .help = "sequences per micro-batch", .show_default = true },
    { .name = "seq-len", .arg = "T", .kind = CLI_INT64, .field = offsetof(mt_step_config, T), .min = 1,
      .max = CLI_MAX_SEQ_LEN, .help = "tokens per sequence", .show_default = true },
    { .name = "accum", .arg = "N", .kind = CLI_INT, .field = offsetof(mt_step_config, accum), .min = 1,
      .max = CLI_MAX_BATCH, .help = "micro-batches per step, gradients accumulated", .show_default = true },
    { .name = "checkpoint-every", .arg = "K", .kind = CLI_INT, .field = offsetof(mt_step_config, K), .min = 1,
      .max = CLI_MAX_BATCH, .help = "layers per recompute block", .show_default = true },
};

/* --checkpoint-every: a whole number in [1, CLI_MAX_BATCH], or auto. */
static int parse_checkpoint(const char *cmd, const cli_option *opt, const char *arg, void *target)
{
    int *K = (int *)((char *)target + opt->field);
    if (!strcmp(arg, "auto")) {
        *K = MT_PLAN_K_AUTO;
        return 0;
    }
    long long v;
    if (cli_parse_int(cmd, "--checkpoint-every", arg, 1, CLI_MAX_BATCH, &v)) {
        fprintf(stderr, "%s: --checkpoint-every takes a number of layers or auto\n", cmd);
        return 2;
    }
    *K = (int)v;
    return 0;
}

static const char *show_checkpoint(const void *field, char *buf, size_t size)
{
    const int K = *(const int *)field;
    if (K == MT_PLAN_K_AUTO) return "auto";
    snprintf(buf, size, "%d", K);
    return buf;
}

const cli_option cli_checkpoint_options[1] = {
    { .name = "checkpoint-every", .arg = "K", .kind = CLI_CUSTOM, .field = offsetof(mt_step_config, K),
      .parse = parse_checkpoint, .show_default = true, .show = show_checkpoint,
      .help = "layers per recompute block, or auto: the largest K that fits host and GPU" },
};

const cli_option cli_gpu_memory_options[1] = {
    { .name = "gpu-memory", .arg = "BYTES", .kind = CLI_CUSTOM, .field = 0, .min = 1, .parse = cli_bytes_option,
      .help = "check the GPU plan against this much (80G, 141GB) instead of the device's memory" },
};

const cli_option cli_offload_options[1] = {
    { .name = "offload-checkpoints", .arg = "M", .kind = CLI_WORD, .field = offsetof(mt_step_config, offload_checkpoints),
      .words = cli_auto_on_off, .show_default = true,
      .help = "auto|on|off: checkpoints in host RAM, fetched back for the recompute" },
};

/* --mlp-chunk: a number of tokens (0: none), or auto. */
static int parse_mlp_chunk(const char *cmd, const cli_option *opt, const char *arg, void *target)
{
    int64_t *chunk = (int64_t *)((char *)target + opt->field);
    if (!strcmp(arg, "auto")) {
        *chunk = MT_MLP_CHUNK_AUTO;
        return 0;
    }
    long long v;
    if (cli_parse_int(cmd, "--mlp-chunk", arg, 0, CLI_MAX_SEQ_LEN, &v)) {
        fprintf(stderr, "%s: --mlp-chunk takes a number of tokens (0: all at once) or auto\n", cmd);
        return 2;
    }
    *chunk = (int64_t)v;
    return 0;
}

static const char *show_mlp_chunk(const void *field, char *buf, size_t size)
{
    const int64_t c = *(const int64_t *)field;
    if (c == MT_MLP_CHUNK_AUTO) return "auto";
    snprintf(buf, size, "%lld", (long long)c);
    return buf;
}

const cli_option cli_mlp_chunk_options[1] = {
    { .name = "mlp-chunk", .arg = "N", .kind = CLI_CUSTOM, .field = offsetof(mt_step_config, mlp_chunk),
      .parse = parse_mlp_chunk, .show_default = true, .show = show_mlp_chunk, .advanced = true,
      .help = "the dense MLP N tokens at a time, recomputed in backward (0: all at once; auto: chunks where the "
              "memory plan needs them)" },
};

/* A factor above 1 into the double field (--clip-range, --clip-range-max). */
static int parse_ratio(const char *cmd, const cli_option *opt, const char *arg, void *target)
{
    char flag[64];
    snprintf(flag, sizeof flag, "--%s", opt->name);
    double *out = (double *)((char *)target + opt->field);
    if (cli_parse_double(cmd, flag, arg, 1, 1e6, out)) return 2;
    if (*out > 1) return 0;
    return cli_usage_error(cmd, "%s: '%s' must be above 1", flag, arg);
}

/* mt_step_config.clip_speculate's values. */
static const cli_word speculate_modes[] = {
    { "auto", -1 }, { "off", 0 }, { "unit", 1 }, { "ranged", 2 }, { NULL, 0 },
};
static const cli_word on_off[] = { { "on", 1 }, { "off", 0 }, { NULL, 0 } };

const cli_option cli_clip_options[8] = {
    { .name = "clip", .arg = "X", .kind = CLI_DOUBLE, .field = offsetof(mt_step_config, clip), .lo = 0, .hi = 1e30,
      .help = "max global gradient norm, 0 = off", .show_default = true },
    { .name = "clip-speculate", .arg = "M", .kind = CLI_WORD, .field = offsetof(mt_step_config, clip_speculate),
      .words = speculate_modes, .show_default = true,
      .help = "auto|off|unit|ranged: update ahead of the norm, exactly" },
    { .name = "clip-range", .arg = "F", .kind = CLI_CUSTOM, .field = offsetof(mt_step_config, clip_range),
      .parse = parse_ratio, .advanced = true,
      .help = "ranged: the norm's rest within F times its prediction, > 1 (default " TEXT(MT_CLIP_SPREAD_DEFAULT) ")" },
    { .name = "clip-range-max", .arg = "R", .kind = CLI_CUSTOM, .field = offsetof(mt_step_config, clip_range_max),
      .parse = parse_ratio, .advanced = true,
      .help = "ranged: no speculation where scales span over R times, > 1 (default " TEXT(MT_CLIP_RANGE_MAX_DEFAULT) ")" },
    { .name = "clip-range-grow", .arg = "G", .kind = CLI_DOUBLE, .field = offsetof(mt_step_config, clip_range_grow),
      .lo = 1, .hi = 1e6, .advanced = true,
      .help = "ranged: after a miss F grows by it, up to G times; 1: fixed (default " TEXT(MT_CLIP_RANGE_GROW_DEFAULT) ")" },
    { .name = "clip-range-memory", .arg = "N", .kind = CLI_INT, .field = offsetof(mt_step_config, clip_range_memory),
      .min = 1, .max = MT_CLIP_RANGE_MEMORY_MAX, .advanced = true,
      .help = "ranged: the largest miss of the last N norms, 1.." TEXT(MT_CLIP_RANGE_MEMORY_MAX)
              " (default " TEXT(MT_CLIP_RANGE_MEMORY_DEFAULT) ")" },
    { .name = "clip-range-check", .arg = "M", .kind = CLI_WORD, .field = offsetof(mt_step_config, clip_range_check),
      .words = on_off, .advanced = true,
      .help = "ranged: on|off, skip layers whose range missed at the last norm (default on)" },
    { .name = "adamw-defer", .arg = "M", .kind = CLI_WORD, .field = offsetof(mt_step_config, adamw_defer),
      .words = cli_auto_on_off, .show_default = true, .advanced = true,
      .help = "ranged: auto|on|off, AdamW moments deferred to the next step" },
};

const char cli_speculation_note[] =
    "Clip speculation (--clip-speculate, with --clip): each layer's update runs as its gradient\n"
    "lands, before the norm is known, and is redone after it where the norm changes it, so the\n"
    "result is exact. unit: as if the norm were within the bound, redone when it is not; ranged:\n"
    "for the range of scales the norm can still take, redoing only the weights whose bf16 value\n"
    "that range can change (bf16 weights); auto: unit while the last norm was within the bound,\n"
    "else ranged where the weights are bf16 and a GPU computes (else off); off: the update waits\n"
    "for the norm.\n";

static const char *show_sched(const void *field, char *buf, size_t size)
{
    const char *s = *(const char *const *)field;
    return s ? s : mt_default_sched();
}

static const char *show_workers(const void *field, char *buf, size_t size)
{
    const int n = *(const int *)field;
    if (n < 0) return "all";
    snprintf(buf, size, "%d", n);
    return buf;
}

const cli_option cli_worker_options[4] = {
    { .name = "sched", .arg = "NAME", .kind = CLI_STRING, .field = offsetof(mt_runtime_options, sched),
      .help = "StarPU policy: megatrain, dmda, eager, ...", .show_default = true, .show = show_sched },
    { .name = "ncpu", .arg = "N", .kind = CLI_INT, .field = offsetof(mt_runtime_options, ncpu), .min = 1,
      .max = CLI_MAX_NCPU, .help = "StarPU CPU workers", .show_default = true, .show = show_workers },
    { .name = "ncuda", .arg = "N", .kind = CLI_INT, .field = offsetof(mt_runtime_options, ncuda), .min = 0,
      .max = CLI_MAX_NCUDA, .help = "StarPU CUDA workers, 0 = CPU only", .show_default = true, .show = show_workers },
    { .name = "watchdog", .arg = "S", .kind = CLI_DOUBLE, .field = offsetof(mt_runtime_options, watchdog_s), .lo = 0,
      .hi = 1e9, .advanced = true, .help = "end a run in which no task finished for S seconds (default 300; 0: never)" },
};

_Static_assert(sizeof(mt_host_layout) == sizeof(int), "--host-layout stores an int");
static const cli_word host_layouts[] = {
    { "auto", MT_LAYOUT_AUTO }, { "full", MT_LAYOUT_FULL }, { "compact", MT_LAYOUT_COMPACT }, { NULL, 0 },
};

const cli_option cli_layout_options[1] = {
    { .name = "host-layout", .arg = "L", .kind = CLI_WORD, .field = 0, .words = host_layouts, .show_default = true,
      .help = "host state: full, compact (14 B/param, bf16), auto (full where it fits)" },
};

int cli_environment(const char *cmd, mt_runtime_options *runtime, mt_step_config *step)
{
    /* MT_ATTENTION (the bf16 attention kernels: auto, cudnn, own) and MT_ATTENTION_QBLOCK (the own
     * kernels' query block) into the runtime's CUDA options; MT_RANGED_SIDE_ROOM=R (ranged
     * speculation's side entries hold the inputs of 1/R of a chunk, a measurement knob) into the
     * step's. A value that names nothing is reported and the default kept. Nothing else in the
     * command line reads the environment on the library's behalf. */
    char err[128];
    if (mt_runtime_parse_attention(getenv("MT_ATTENTION"), &runtime->cuda.attention, err, sizeof err))
        fprintf(stderr, "megatrain %s: %s; using auto\n", cmd, err);
    if (mt_runtime_parse_qblock(getenv("MT_ATTENTION_QBLOCK"), &runtime->cuda.qblock, err, sizeof err))
        fprintf(stderr, "megatrain %s: %s; using 128w\n", cmd, err);
    const char *room = getenv("MT_RANGED_SIDE_ROOM");
    if (step && room && *room) {
        char *end;
        const long r = strtol(room, &end, 10);
        if (*end || r < MT_RANGED_SIDE_ROOM_MIN || r > MT_RANGED_SIDE_ROOM_MAX)
            fprintf(stderr, "megatrain %s: MT_RANGED_SIDE_ROOM=%s ignored: expected a whole number from %d to %d (room "
                            "for 1/R of a chunk's elements); using %d\n", cmd, room, MT_RANGED_SIDE_ROOM_MIN,
                    MT_RANGED_SIDE_ROOM_MAX, MT_RANGED_SIDE_ROOM_DEFAULT);
        else
            step->ranged_side_room = (int)r;
    }
    return 0;
}
