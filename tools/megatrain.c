/* The megatrain command: `info` (what StarPU sees), `plan` (the memory plan of a run), `train`
 * (the training job). Every subcommand takes --help; bad flags and values are named. */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/config.h"
#include "runtime/dataset.h"
#include "mt_build_config.h"
#include "mt_commit.h"
#include "codelets/mt_starpu.h"
#include "runtime/plan.h"
#include "runtime/runtime.h"
#include "runtime/state.h"
#include "runtime/train.h"
#include "runtime/bench.h"
#include "runtime/grads.h"
#include "runtime/policy.h"
#include "codelets/codelets.h"
#if MT_HAVE_CUDA
#include "backends/cuda/kernels.h"
#endif

static const char *cmd = "megatrain";

static int usage_error(const char *fmt, const char *a, const char *b)
{
    fprintf(stderr, "%s: ", cmd);
    fprintf(stderr, fmt, a, b);
    fprintf(stderr, " (try '%s --help')\n", cmd);
    return 2;
}

/* Parses a whole-string integer in [lo, hi]; on failure prints a message naming the flag. */
static int parse_int(const char *flag, const char *s, long long lo, long long hi, long long *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end) { usage_error("%s: '%s' is not an integer", flag, s); return -1; }
    if (v < lo || v > hi) {
        fprintf(stderr, "%s: %s: %lld is out of range [%lld, %lld]\n", cmd, flag, v, lo, hi);
        return -1;
    }
    *out = v;
    return 0;
}

static int parse_double(const char *flag, const char *s, double lo, double hi, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v)) { usage_error("%s: '%s' is not a number", flag, s); return -1; }
    if (v < lo || v > hi) {
        fprintf(stderr, "%s: %s: %g is out of range [%g, %g]\n", cmd, flag, v, lo, hi);
        return -1;
    }
    *out = v;
    return 0;
}

/* Splits a comma-separated list of at most `max` items, calling item(flag, token, k, ctx) on
 * item k; *n: how many. Each parser below reports its own errors. */
static int split_list(const char *flag, const char *s, int max, int *n,
                      int (*item)(const char *flag, const char *tok, int k, void *ctx), void *ctx)
{
    char buf[256];
    if (strlen(s) >= sizeof buf) return usage_error("%s: '%s' is too long", flag, s), -1;
    snprintf(buf, sizeof buf, "%s", s);
    *n = 0;
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (*n == max) {
            fprintf(stderr, "%s: %s: at most %d values\n", cmd, flag, max);
            return -1;
        }
        if (item(flag, tok, (*n)++, ctx)) return -1;
    }
    if (*n == 0) return usage_error("%s: '%s' holds no value", flag, s), -1;
    return 0;
}

typedef struct number_item { double lo, hi, *out; } number_item;

static int number_of(const char *flag, const char *tok, int k, void *ctx)
{
    const number_item *c = ctx;
    return parse_double(flag, tok, c->lo, c->hi, &c->out[k]);
}

/* A comma-separated list of at most `max` numbers, each checked as parse_double does. */
static int parse_list(const char *flag, const char *s, double lo, double hi, double *out, int max, int *n)
{
    number_item c = { lo, hi, out };
    return split_list(flag, s, max, n, number_of, &c);
}

typedef struct word_item { const char *const *names; const int *values; int nnames; const char *expect; int *out; } word_item;

static int word_of(const char *flag, const char *tok, int k, void *ctx)
{
    const word_item *c = ctx;
    int j = 0;
    while (j < c->nnames && strcmp(tok, c->names[j])) j++;
    if (j == c->nnames) {
        fprintf(stderr, "%s: %s: '%s' is not %s (try '%s --help')\n", cmd, flag, tok, c->expect, cmd);
        return -1;
    }
    c->out[k] = c->values[j];
    return 0;
}

/* A comma-separated list of at most `max` words, each one of names[0..nnames) (`expect` says
 * which, for the message), stored as values[k] of its name. */
static int parse_word_list(const char *flag, const char *s, const char *const *names, const int *values, int nnames,
                           const char *expect, int *out, int max, int *n)
{
    word_item c = { names, values, nnames, expect, out };
    return split_list(flag, s, max, n, word_of, &c);
}

/* ---- info ------------------------------------------------------------------------------- */

static void info_help(void)
{
    printf("usage: megatrain info [--sched NAME] [--ncpu N] [--ncuda N]\n\n"
           "Starts StarPU, lists its workers, runs a fill task on every worker, and checks that\n"
           "a host state tile is pinned where a GPU is present.\n");
}

static int cmd_info(int argc, char **argv)
{
    static const struct option opts[] = {
        { "sched", required_argument, 0, 's' }, { "ncpu", required_argument, 0, 'c' },
        { "ncuda", required_argument, 0, 'g' }, { "help", no_argument, 0, 'h' }, { 0, 0, 0, 0 },
    };
    mt_runtime_options ro = mt_runtime_defaults();
    long long v;
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 's': ro.sched = optarg; break;
        case 'c': if (parse_int("--ncpu", optarg, 0, 1024, &v)) return 2; ro.ncpu = (int)v; break;
        case 'g': if (parse_int("--ncuda", optarg, 0, 64, &v)) return 2; ro.ncuda = (int)v; break;
        case 'h': info_help(); return 0;
        default: return 2;
        }
    }
    if (optind < argc) return usage_error("info: unexpected argument '%s'%s", argv[optind], "");
    char err[512];
    if (mt_runtime_init(&ro, err, sizeof err)) { fprintf(stderr, "%s: %s\n", cmd, err); return 1; }
    printf("megatrain %s (commit %s), StarPU %d.%d.%d, built %s CUDA\n", MT_VERSION, MT_COMMIT, STARPU_MAJOR_VERSION,
           STARPU_MINOR_VERSION, STARPU_RELEASE_VERSION, MT_HAVE_CUDA ? "with" : "without");
    printf("workers: %d CPU, %d CUDA; policy %s\n", mt_runtime_ncpu(), mt_runtime_ncuda(), ro.sched ? ro.sched : mt_default_sched());
    for (unsigned w = 0; w < starpu_worker_get_count(); w++) {
        char name[128];
        starpu_worker_get_name((int)w, name, sizeof name);
        printf("  worker %u: %s (memory node %u)\n", w, name, starpu_worker_get_memory_node(w));
    }
    int failures = 0;
    /* One fill task pinned to each worker proves every kind of worker executes codelets. */
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
    /* A host tile as the trainer allocates it. */
    mt_model_config cfg;
    mt_config_from_shape("tiny", &cfg);
    mt_host_state *st = mt_state_create(&cfg, MT_DTYPE_BF16, 0, err, sizeof err);
    if (!st) { fprintf(stderr, "%s: %s\n", cmd, err); failures++; }
    else {
        printf("host tile: %zu bytes, 4 KiB-aligned: %s, allocated pinned: %s\n", mt_state_layer(st, 0)->weight_bytes,
               ((uintptr_t)mt_state_layer(st, 0)->weights % 4096) == 0 ? "yes" : "NO", st->pinned ? "yes" : "no");
#if MT_HAVE_CUDA
        if (mt_runtime_ncuda() > 0) {
            int p = mt_cuda_host_pointer_pinned(mt_state_layer(st, 0)->master);
            printf("cudaPointerGetAttributes(master tile): %s\n", p == 1 ? "page-locked host memory" : p == 0 ? "PAGEABLE" : "error");
            failures += p != 1;
        }
#endif
        mt_state_destroy(st);
    }
    mt_runtime_shutdown();
    printf("%s\n", failures ? "info: FAILED" : "info: ok");
    return failures ? 1 : 0;
}

/* ---- plan ------------------------------------------------------------------------------- */

static void plan_help(void)
{
    printf("usage: megatrain plan (--shape NAME | --config FILE) [options]\n\n"
           "Prints every byte a run will hold on the host and the GPU, before allocating any,\n"
           "and says whether it fits in this machine's memory.\n\n"
           "  --shape NAME         qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-3b, qwen2.5-7b, qwen2.5-14b, tiny\n"
           "  --config FILE        a HF config.json\n"
           "  --micro-batch B      sequences per micro-batch (default 16)\n"
           "  --seq-len T          tokens per sequence (default 2048)\n"
           "  --accum N            micro-batches per step (default 1)\n"
           "  --checkpoint-every K layers per recompute block (default 4)\n"
           "  --dtype bf16|fp32    streamed weight precision (default bf16)\n"
           "  --cpu                plan a CPU-only run (activations on the host)\n"
           "  --host-memory BYTES  check against this much instead of MemAvailable\n");
}

static int cmd_plan(int argc, char **argv)
{
    static const struct option opts[] = {
        { "shape", required_argument, 0, 's' }, { "config", required_argument, 0, 'f' },
        { "micro-batch", required_argument, 0, 'b' }, { "seq-len", required_argument, 0, 't' },
        { "accum", required_argument, 0, 'a' }, { "checkpoint-every", required_argument, 0, 'k' },
        { "dtype", required_argument, 0, 'd' }, { "cpu", no_argument, 0, 'c' },
        { "host-memory", required_argument, 0, 'm' }, { "help", no_argument, 0, 'h' }, { 0, 0, 0, 0 },
    };
    const char *shape = NULL, *config = NULL;
    mt_plan_params pp = { .micro_batch = 16, .seq_len = 2048, .grad_accum = 1, .checkpoint_interval = 4,
                          .compute = MT_DTYPE_BF16, .use_gpu = true };
    long long v, host_mem = 0;
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 's': shape = optarg; break;
        case 'f': config = optarg; break;
        case 'b': if (parse_int("--micro-batch", optarg, 1, 1 << 20, &v)) return 2; pp.micro_batch = v; break;
        case 't': if (parse_int("--seq-len", optarg, 1, 1 << 24, &v)) return 2; pp.seq_len = v; break;
        case 'a': if (parse_int("--accum", optarg, 1, 1 << 20, &v)) return 2; pp.grad_accum = v; break;
        case 'k': if (parse_int("--checkpoint-every", optarg, 1, 1 << 20, &v)) return 2; pp.checkpoint_interval = v; break;
        case 'd': if (mt_dtype_parse(optarg, &pp.compute)) return usage_error("--dtype: '%s' is not bf16 or fp32%s", optarg, ""); break;
        case 'c': pp.use_gpu = false; break;
        case 'm': if (parse_int("--host-memory", optarg, 1, LLONG_MAX, &host_mem)) return 2; break;
        case 'h': plan_help(); return 0;
        default: return 2;
        }
    }
    if (optind < argc) return usage_error("plan: unexpected argument '%s'%s", argv[optind], "");
    if (!shape == !config) return usage_error("plan: give exactly one of --shape and --config%s%s", "", "");
    mt_model_config cfg;
    char err[1024];
    if (shape && mt_config_from_shape(shape, &cfg))
        return usage_error("--shape: unknown shape '%s'%s", shape, " (qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-3b, qwen2.5-7b, qwen2.5-14b, tiny)");
    if (config && mt_config_load(config, &cfg, err, sizeof err)) { fprintf(stderr, "%s: %s\n", cmd, err); return 1; }
    mt_plan plan;
    if (mt_plan_compute(&cfg, &pp, &plan)) { fprintf(stderr, "%s: %s\n", cmd, plan.error); return 1; }
    printf("model: %s, %lld layers, hidden %lld\n", shape ? shape : config, (long long)cfg.layers, (long long)cfg.hidden);
    mt_plan_print(&plan, stdout);
    uint64_t avail = host_mem ? (uint64_t)host_mem : mt_host_memory_available();
    if (mt_plan_check_host(&plan, avail, err, sizeof err)) {
        fprintf(stderr, "%s: %s\n", cmd, err);
        return 1;
    }
    printf("fits: host plan within %d%% of %s available\n", MT_PLAN_HOST_USABLE_PERCENT, mt_format_bytes(avail, err, sizeof err));
    return 0;
}

/* ---- train ------------------------------------------------------------------------------ */

/* --clip-speculate auto|on|off|ranged -> mt_step_config.clip_speculate (-1, 1, 0, 2). */
static int parse_speculate(const char *arg, int *out)
{
    if (!strcmp(arg, "auto")) *out = -1;
    else if (!strcmp(arg, "on")) *out = 1;
    else if (!strcmp(arg, "off")) *out = 0;
    else if (!strcmp(arg, "ranged")) *out = 2;
    else return usage_error("--clip-speculate: '%s' is not auto, on, off or ranged%s", arg, "");
    return 0;
}

/* auto|on|off -> -1, 1, 0 (--adamw-defer, and bench's list of --adamw-defer). */
static const char *const auto_on_off_names[] = { "auto", "on", "off" };
static const int auto_on_off_values[] = { -1, 1, 0 };

static int parse_auto_on_off(const char *flag, const char *arg, int *out)
{
    for (int k = 0; k < 3; k++)
        if (!strcmp(arg, auto_on_off_names[k])) {
            *out = auto_on_off_values[k];
            return 0;
        }
    usage_error("%s: '%s' is not auto, on or off", flag, arg);
    return -1;
}

/* on|off -> 1, 0 (--clip-range-check). */
static int parse_on_off(const char *flag, const char *arg, int *out)
{
    if (!strcmp(arg, "on")) *out = 1;
    else if (!strcmp(arg, "off")) *out = 0;
    else {
        usage_error("%s: '%s' is not on or off", flag, arg);
        return -1;
    }
    return 0;
}

/* A factor above 1 (--clip-range, --clip-range-max). */
static int parse_ratio(const char *flag, const char *arg, double *out)
{
    if (parse_double(flag, arg, 1, 1e6, out)) return -1;
    if (*out > 1) return 0;
    usage_error("%s: '%s' must be above 1", flag, arg);
    return -1;
}

/* The options of clip speculation and the AdamW state, the same in train and bench (their help:
 * SPECULATE_HELP): one list of long options and one parser, past both commands' own codes. */
enum { O_SPEC = 512, O_CRANGE, O_CRANGE_MAX, O_CRANGE_CHECK, O_CRANGE_GROW, O_CRANGE_MEMORY, O_DEFER };
#define STEP_LONG_OPTIONS                                                                           \
    { "clip-speculate", required_argument, 0, O_SPEC }, { "clip-range", required_argument, 0, O_CRANGE }, \
    { "clip-range-max", required_argument, 0, O_CRANGE_MAX },                                       \
    { "clip-range-check", required_argument, 0, O_CRANGE_CHECK },                                   \
    { "clip-range-grow", required_argument, 0, O_CRANGE_GROW },                                     \
    { "clip-range-memory", required_argument, 0, O_CRANGE_MEMORY },                                 \
    { "adamw-defer", required_argument, 0, O_DEFER }

/* Option c of STEP_LONG_OPTIONS into s: 1 when taken, 0 when c is none of them (getopt's '?' for
 * an unknown option included), -1 (message printed) when its argument is bad. */
static int parse_step_option(int c, const char *arg, mt_step_config *s)
{
    long long v;
    switch (c) {
    case O_SPEC: return parse_speculate(arg, &s->clip_speculate) ? -1 : 1;
    case O_CRANGE: return parse_ratio("--clip-range", arg, &s->clip_range) ? -1 : 1;
    case O_CRANGE_MAX: return parse_ratio("--clip-range-max", arg, &s->clip_range_max) ? -1 : 1;
    case O_CRANGE_CHECK: return parse_on_off("--clip-range-check", arg, &s->clip_range_check) ? -1 : 1;
    case O_CRANGE_GROW: return parse_double("--clip-range-grow", arg, 1, 1e6, &s->clip_range_grow) ? -1 : 1;
    case O_CRANGE_MEMORY:
        if (parse_int("--clip-range-memory", arg, 1, MT_CLIP_RANGE_MEMORY_MAX, &v)) return -1;
        s->clip_range_memory = (int)v;
        return 1;
    case O_DEFER: return parse_auto_on_off("--adamw-defer", arg, &s->adamw_defer) ? -1 : 1;
    default: return 0;
    }
}

#define SPECULATE_HELP                                                                              \
    "  --clip-speculate M   auto|on|off|ranged (default auto): with clipping, run each layer's\n"     \
    "                       update as its gradient lands, as if the norm were within the bound,\n"  \
    "                       and redo it after the norm only when it was not (exact either way);\n"  \
    "                       ranged also speculates when it was not, for the range of scales the\n"\
    "                       gradients already in and the last norm allow, redoing after the norm\n"\
    "                       only the weights whose bf16 value could differ within it (bf16 only;\n"\
    "                       exact); auto: as the last norm asks, ranged only with bf16 weights\n"  \
    "                       and a GPU (H200, 3B, clip 1.0 every step: 1.86-2.02 s a step,\n"      \
    "                       against 1.99-2.16 without speculation)\n"                           \
    "  --clip-range F       ranged: the part of the norm still to come is taken to be within F\n"  \
    "                       times of its prediction from the last norm (default 1.25, > 1)\n"     \
    "  --clip-range-max R   ranged: a chunk whose range of scales is wider than R times is not\n"  \
    "                       speculated (default 1.4, > 1; grows with the spread)\n"               \
    "  --clip-range-grow G  ranged: after norms whose rest came up to x times off its prediction,\n"\
    "                       the next ranges take F times x, up to G (default 3; 1: F always)\n"   \
    "  --clip-range-memory N ranged: x is the largest error over the last N norms (default 4,\n"  \
    "                       1..16; 1: the last norm only)\n"                                     \
    "  --clip-range-check M on|off (default on): ranged: do not speculate a layer whose range,\n"  \
    "                       predicted at the last norm, missed it (the norm moves in ways the\n"  \
    "                       prediction does not follow; a miss costs a whole redo)\n"           \
    "  --adamw-defer M      auto|on|off (default auto): ranged: run each tile's second half of\n"\
    "                       AdamW (master, m and v) in the next step's ranged pass over the same\n"\
    "                       chunk, reading them once instead of twice (4 bytes per parameter\n"   \
    "                       more pinned host memory for a second gradient); bitwise the same\n"   \
    "                       results; auto: with ranged speculation, when the second gradient\n"  \
    "                       takes at most 80%% of the memory available (megatrain plan shows\n"  \
    "                       its size); on an H200 at 3B: AdamW 0.37-0.46 s per 1e9 parameters\n" \
    "                       in the step against 0.45-0.52 (docs/benchmarks.md)\n"

static void train_help(const mt_train_options *d)
{
    printf("usage: megatrain train [options]\n\n"
           "Trains a model on a text corpus with the streaming step (a StarPU task graph), shows\n"
           "progress and validation loss, and ends with a sample of generated text. With no\n"
           "options: the built-in byte-level model on the fortunes corpus.\n\n");
    printf("  --config FILE        HF config.json (default %s)\n", d->config_path);
    printf("  --model DIR          start from an HF model directory (config.json + safetensors)\n");
    printf("  --save-model DIR     write the trained model as an HF directory (fp32 safetensors)\n");
    printf("  --data PATH          text file or directory (default %s), or a directory\n"
           "                       written by 'megatrain prepare' (token shards with a loss mask)\n", d->data_path);
    printf("  --data-order ORDER   prepared data: shuffled (seeded, per epoch) or sequential (default shuffled)\n");
    printf("  --steps N            optimizer steps (default %lld)\n", (long long)d->steps);
    printf("  --micro-batch B      sequences per micro-batch (default %lld)\n", (long long)d->step.B);
    printf("  --seq-len T          tokens per sequence (default %lld; prepared data: its seq_len)\n", (long long)d->step.T);
    printf("  --accum N            micro-batches per step, gradients accumulated (default %d)\n", d->step.accum);
    printf("  --tokens-per-step N  tokens per optimizer step; micro-batch and accumulation are then\n"
           "                       chosen to fit --activation-budget (default: B x T x accum)\n");
    printf("  --activation-budget BYTES  activation memory of one micro-batch (default %llu)\n",
           (unsigned long long)d->activation_budget);
    printf("  --checkpoint-every K layers per recompute block (default %d)\n", d->step.K);
    printf("  --lr X               peak learning rate (default %g)\n", d->lr);
    printf("  --schedule S         cosine (linear warm-up then cosine) or constant (default cosine)\n");
    printf("  --warmup N           warm-up steps (default %lld)\n", (long long)d->warmup);
    printf("  --weight-decay X     AdamW decoupled weight decay on matrices (default %g)\n", d->step.weight_decay);
    printf("  --clip X             max global gradient norm, 0 = off (default %g)\n", d->step.clip);
    printf(SPECULATE_HELP);
    printf("  --dtype fp32|bf16    precision of the streamed weights and of the compute (default: fp32\n"
           "                       on CPU workers, bf16 when a GPU computes; fp32 on a GPU is exact\n"
           "                       fp32, several times slower than bf16)\n");
    printf("  --seed N             initialisation and sampling seed (default %llu)\n", (unsigned long long)d->seed);
    printf("  --eval-every N       validation every N steps, 0 = at the end only (default %lld)\n", (long long)d->eval_every);
    printf("  --log-every N        progress line every N steps (default %lld)\n", (long long)d->log_every);
    printf("  --sample-bytes N     bytes of text generated at the end (default %lld)\n", (long long)d->sample_bytes);
    printf("  --time-limit SEC     stop after the step that passes SEC seconds (default none)\n");
    printf("  --stop-after N       stop after step N (the schedule still spans --steps)\n");
    printf("  --checkpoint FILE    save a training checkpoint (weights, AdamW state, step, data\n"
           "                       position) at the end, atomically\n");
    printf("  --save-every N       also every N steps\n");
    printf("  --resume FILE        continue a run from its checkpoint, bit for bit\n");
    printf("  --sched NAME         StarPU policy: eager, dmda, ... (default %s)\n", mt_default_sched());
    printf("  --ncpu N, --ncuda N  StarPU workers (default: all)\n");
}

static int cmd_train(int argc, char **argv)
{
    enum { O_CONFIG = 256, O_DATA, O_STEPS, O_B, O_T, O_ACCUM, O_K, O_LR, O_SCHED_LR, O_WARMUP, O_WD, O_CLIP,
           O_DTYPE, O_SEED, O_EVAL, O_LOG, O_SAMPLE, O_TIME, O_SCHED, O_NCPU, O_NCUDA, O_HELP, O_TPS, O_BUDGET,
           O_CKPT, O_SAVE_EVERY, O_RESUME, O_STOP, O_MODEL, O_SAVE_MODEL, O_DATA_ORDER };
    static const struct option opts[] = {
        { "config", required_argument, 0, O_CONFIG }, { "data", required_argument, 0, O_DATA },
        { "steps", required_argument, 0, O_STEPS }, { "micro-batch", required_argument, 0, O_B },
        { "seq-len", required_argument, 0, O_T }, { "accum", required_argument, 0, O_ACCUM },
        { "checkpoint-every", required_argument, 0, O_K }, { "lr", required_argument, 0, O_LR },
        { "schedule", required_argument, 0, O_SCHED_LR }, { "warmup", required_argument, 0, O_WARMUP },
        { "weight-decay", required_argument, 0, O_WD }, { "clip", required_argument, 0, O_CLIP },
        { "dtype", required_argument, 0, O_DTYPE }, { "seed", required_argument, 0, O_SEED },
        { "eval-every", required_argument, 0, O_EVAL }, { "log-every", required_argument, 0, O_LOG },
        { "sample-bytes", required_argument, 0, O_SAMPLE }, { "time-limit", required_argument, 0, O_TIME },
        { "sched", required_argument, 0, O_SCHED }, { "ncpu", required_argument, 0, O_NCPU },
        { "ncuda", required_argument, 0, O_NCUDA }, { "help", no_argument, 0, O_HELP },
        { "tokens-per-step", required_argument, 0, O_TPS }, { "activation-budget", required_argument, 0, O_BUDGET },
        { "checkpoint", required_argument, 0, O_CKPT }, { "save-every", required_argument, 0, O_SAVE_EVERY },
        { "resume", required_argument, 0, O_RESUME }, { "stop-after", required_argument, 0, O_STOP },
        { "model", required_argument, 0, O_MODEL }, { "save-model", required_argument, 0, O_SAVE_MODEL },
        { "data-order", required_argument, 0, O_DATA_ORDER }, STEP_LONG_OPTIONS,
        { 0, 0, 0, 0 },
    };
    mt_train_options o = mt_train_defaults();
    bool seq_len_given = false;
    long long v;
    double x;
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case O_CONFIG: o.config_path = optarg; break;
        case O_DATA: o.data_path = optarg; break;
        case O_STEPS: if (parse_int("--steps", optarg, 1, 1LL << 40, &v)) return 2; o.steps = v; break;
        case O_B: if (parse_int("--micro-batch", optarg, 1, 1 << 20, &v)) return 2; o.step.B = v; break;
        case O_T: if (parse_int("--seq-len", optarg, 1, 1 << 24, &v)) return 2; o.step.T = v; seq_len_given = true; break;
        case O_ACCUM: if (parse_int("--accum", optarg, 1, 1 << 20, &v)) return 2; o.step.accum = (int)v; break;
        case O_K: if (parse_int("--checkpoint-every", optarg, 1, 1 << 20, &v)) return 2; o.step.K = (int)v; break;
        case O_LR: if (parse_double("--lr", optarg, 0, 10, &o.lr)) return 2; break;
        case O_DATA_ORDER:
            if (!strcmp(optarg, "shuffled")) o.data_shuffle = true;
            else if (!strcmp(optarg, "sequential")) o.data_shuffle = false;
            else return usage_error("--data-order: '%s' is not shuffled or sequential%s", optarg, "");
            break;
        case O_SCHED_LR:
            if (!strcmp(optarg, "cosine")) o.schedule = MT_LR_COSINE;
            else if (!strcmp(optarg, "constant")) o.schedule = MT_LR_CONSTANT;
            else return usage_error("--schedule: '%s' is not cosine or constant%s", optarg, "");
            break;
        case O_WARMUP: if (parse_int("--warmup", optarg, 0, 1LL << 40, &v)) return 2; o.warmup = v; break;
        case O_WD: if (parse_double("--weight-decay", optarg, 0, 10, &o.step.weight_decay)) return 2; break;
        case O_CLIP: if (parse_double("--clip", optarg, 0, 1e30, &o.step.clip)) return 2; break;
        case O_DTYPE:
            if (mt_dtype_parse(optarg, &o.dtype)) return usage_error("--dtype: '%s' is not fp32 or bf16%s", optarg, "");
            o.dtype_explicit = true;
            break;
        case O_SEED: if (parse_int("--seed", optarg, 0, LLONG_MAX, &v)) return 2; o.seed = (uint64_t)v; break;
        case O_EVAL: if (parse_int("--eval-every", optarg, 0, 1LL << 40, &v)) return 2; o.eval_every = v; break;
        case O_LOG: if (parse_int("--log-every", optarg, 1, 1LL << 40, &v)) return 2; o.log_every = v; break;
        case O_SAMPLE: if (parse_int("--sample-bytes", optarg, 0, 1 << 20, &v)) return 2; o.sample_bytes = v; break;
        case O_TIME: if (parse_double("--time-limit", optarg, 0, 1e9, &x)) return 2; o.time_limit = x; break;
        case O_SCHED: o.runtime.sched = optarg; break;
        case O_NCPU: if (parse_int("--ncpu", optarg, 1, 1024, &v)) return 2; o.runtime.ncpu = (int)v; break;
        case O_NCUDA: if (parse_int("--ncuda", optarg, 0, 64, &v)) return 2; o.runtime.ncuda = (int)v; break;
        case O_TPS: if (parse_int("--tokens-per-step", optarg, 1, 1LL << 40, &v)) return 2; o.tokens_per_step = v; break;
        case O_BUDGET: if (parse_int("--activation-budget", optarg, 1, LLONG_MAX, &v)) return 2; o.activation_budget = (uint64_t)v; break;
        case O_CKPT: o.checkpoint_path = optarg; break;
        case O_SAVE_EVERY: if (parse_int("--save-every", optarg, 0, 1LL << 40, &v)) return 2; o.save_every = v; break;
        case O_RESUME: o.resume_path = optarg; break;
        case O_MODEL: o.model_dir = optarg; break;
        case O_SAVE_MODEL: o.save_model_dir = optarg; break;
        case O_STOP: if (parse_int("--stop-after", optarg, 1, 1LL << 40, &v)) return 2; o.stop_after = v; break;
        case O_HELP: train_help(&o); return 0;
        default: {
            const int r = parse_step_option(c, optarg, &o.step);
            if (r <= 0) return 2;
            break;
        }
        }
    }
    if (optind < argc) return usage_error("train: unexpected argument '%s'%s", argv[optind], "");
    if (o.warmup >= o.steps) o.warmup = o.steps / 10;
    mt_train_result res;
    char err[1024];
    if (!seq_len_given && mt_dataset_is_prepared(o.data_path)) {
        int64_t T;
        if (mt_dataset_seq_len(o.data_path, &T, err, sizeof err)) { fprintf(stderr, "%s: %s\n", cmd, err); return 1; }
        o.step.T = T;
    }
    if (mt_train_run(&o, &res, stdout, err, sizeof err)) {
        fprintf(stderr, "%s: %s\n", cmd, err);
        free(res.losses);
        return 1;
    }
    free(res.losses);
    return 0;
}

/* ---- prepare ---------------------------------------------------------------------------- */

static void prepare_help(const mt_prepare_options *d)
{
    printf("usage: megatrain prepare --tokenizer FILE --format text|alpaca|sharegpt --family FAMILY\n"
           "                         --input FILE_OR_DIR --output DIR --seq-len T [options]\n\n"
           "Tokenises text or JSONL conversations into packed token shards with a loss mask, for\n"
           "'megatrain train --data DIR'. Conversations are rendered with the family's chat template\n"
           "and only assistant answers (and their end-of-turn token) are trained. Documents are\n"
           "shuffled with the seed, split into train and validation, joined with the family's\n"
           "end-of-text token and cut into windows of T + 1 tokens. docs/data.md has the format.\n\n");
    printf("  --tokenizer FILE     HF tokenizer.json: byte-level BPE (Qwen, Llama 3) or SentencePiece-style\n"
           "                       BPE with byte fallback (Llama 2, Mistral)\n");
    printf("  --format F           text (plain text), alpaca (JSONL instruction/input/output[/system]),\n"
           "                       sharegpt (JSONL conversations: [{from, value}] or messages: [{role, content}])\n");
    printf("  --family NAME        chat template and separator: qwen2 (Qwen2/2.5), qwen3, llama3, mistral\n");
    printf("  --input PATH         a file, or a directory whose files are read in name order\n");
    printf("  --output DIR         new directory (written as DIR.tmp, then renamed)\n");
    printf("  --seq-len T          tokens per training sequence\n");
    printf("  --val-fraction F     fraction of documents held out for validation (default %g)\n", d->val_fraction);
    printf("  --seed N             document shuffle seed (default %llu)\n", (unsigned long long)d->seed);
    printf("  --text-unit U        plain text documents: paragraph (blank-line separated) or file\n"
           "                       (default paragraph)\n");
    printf("  --shard-sequences N  windows per shard file (default: about 256 MiB of tokens)\n");
}

static int cmd_prepare(int argc, char **argv)
{
    enum { O_TOK = 256, O_FORMAT, O_FAMILY, O_INPUT, O_OUTPUT, O_T, O_VAL, O_SEED, O_UNIT, O_SHARD, O_HELP };
    static const struct option opts[] = {
        { "tokenizer", required_argument, 0, O_TOK }, { "format", required_argument, 0, O_FORMAT },
        { "family", required_argument, 0, O_FAMILY }, { "input", required_argument, 0, O_INPUT },
        { "output", required_argument, 0, O_OUTPUT }, { "seq-len", required_argument, 0, O_T },
        { "val-fraction", required_argument, 0, O_VAL }, { "seed", required_argument, 0, O_SEED },
        { "text-unit", required_argument, 0, O_UNIT }, { "shard-sequences", required_argument, 0, O_SHARD },
        { "help", no_argument, 0, O_HELP }, { 0, 0, 0, 0 },
    };
    mt_prepare_options o = mt_prepare_defaults();
    bool have_format = false, have_family = false, have_T = false;
    long long v;
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case O_TOK: o.tokenizer_path = optarg; break;
        case O_FORMAT:
            if (!strcmp(optarg, "text")) o.format = MT_INPUT_TEXT;
            else if (!strcmp(optarg, "alpaca")) o.format = MT_INPUT_ALPACA;
            else if (!strcmp(optarg, "sharegpt")) o.format = MT_INPUT_SHAREGPT;
            else return usage_error("--format: '%s' is not text, alpaca or sharegpt%s", optarg, "");
            have_format = true;
            break;
        case O_FAMILY:
            if (mt_chat_family_parse(optarg, &o.family)) return usage_error("--family: '%s' is not qwen2, qwen3, llama3 or mistral%s", optarg, "");
            have_family = true;
            break;
        case O_INPUT: o.input_path = optarg; break;
        case O_OUTPUT: o.output_dir = optarg; break;
        case O_T: if (parse_int("--seq-len", optarg, 1, 1 << 24, &v)) return 2; o.seq_len = v; have_T = true; break;
        case O_VAL: if (parse_double("--val-fraction", optarg, 0, 0.99, &o.val_fraction)) return 2; break;
        case O_SEED: if (parse_int("--seed", optarg, 0, LLONG_MAX, &v)) return 2; o.seed = (uint64_t)v; break;
        case O_UNIT:
            if (!strcmp(optarg, "paragraph")) o.text_unit = MT_TEXT_PARAGRAPH;
            else if (!strcmp(optarg, "file")) o.text_unit = MT_TEXT_FILE;
            else return usage_error("--text-unit: '%s' is not paragraph or file%s", optarg, "");
            break;
        case O_SHARD: if (parse_int("--shard-sequences", optarg, 1, 1LL << 40, &v)) return 2; o.shard_sequences = v; break;
        case O_HELP: prepare_help(&o); return 0;
        default: return 2;
        }
    }
    if (optind < argc) return usage_error("prepare: unexpected argument '%s'%s", argv[optind], "");
    if (!o.tokenizer_path) return usage_error("prepare: --tokenizer FILE is required%s%s", "", "");
    if (!have_format) return usage_error("prepare: --format text|alpaca|sharegpt is required%s%s", "", "");
    if (!have_family) return usage_error("prepare: --family qwen2|qwen3|llama3|mistral is required%s%s", "", "");
    if (!o.input_path) return usage_error("prepare: --input FILE_OR_DIR is required%s%s", "", "");
    if (!o.output_dir) return usage_error("prepare: --output DIR is required%s%s", "", "");
    if (!have_T) return usage_error("prepare: --seq-len T is required%s%s", "", "");
    mt_prepare_result res;
    char err[2048];
    if (mt_prepare(&o, &res, stderr, err, sizeof err)) { fprintf(stderr, "%s: %s\n", cmd, err); return 1; }
    printf("prepared %s: train %lld documents, %lld windows, %lld trained targets; validation %lld documents, %lld windows, "
           "%lld trained targets\n", o.output_dir, (long long)res.documents[0], (long long)res.sequences[0],
           (long long)res.trained[0], (long long)res.documents[1], (long long)res.sequences[1], (long long)res.trained[1]);
    return 0;
}

/* ---- bench ------------------------------------------------------------------------------ */

static void bench_help(const mt_bench_options *d)
{
    printf("usage: megatrain bench [options]\n\n"
           "Times the training step of a published shape with random weights: medians over the\n"
           "measured steps after warm-up. Model TFLOP/s = (6 N + 6 L d T) tokens / time, N = all\n"
           "parameters but the embedding table (the LM head counts also when tied); recompute\n"
           "not counted. After each row, stderr shows where the CUDA worker sat idle in the\n"
           "measured steps (megatrain policy only): idle before each kind of task, the longest gaps.\n"
           "AdamW columns: alone = one fused update of every parameter with nothing else running;\n"
           "in step = the CPU workers' seconds in AdamW tasks per measured step, and that over the\n"
           "workers and 1e9 parameters; span = first to last AdamW end of a step; tail = its last\n"
           "AdamW end after layer 0's backward.\n\n");
    printf("  --shape NAME         qwen2.5-0.5b|1.5b|3b|7b|14b, tiny (default %s)\n", d->shape);
    printf("  --micro-batch B      sequences per micro-batch (default %lld)\n", (long long)d->step.B);
    printf("  --seq-len T          tokens per sequence (default %lld)\n", (long long)d->step.T);
    printf("  --accum N            micro-batches per step (default %d)\n", d->step.accum);
    printf("  --checkpoint-every K layers per recompute block (default %d); a list (1,2,4) measures each\n", d->step.K);
    printf("  --clip X             max gradient norm, 0 = off (default %g); a list (1,0) measures each.\n"
           "                       Lists share one host state: every K and clip pair in one run\n", d->step.clip);
    printf(SPECULATE_HELP);
    printf("  --warmup N           steps not measured (default %d)\n", d->warmup);
    printf("  --steps N            measured steps (default %d)\n", d->steps);
    printf("  --resident           no GPU memory limit: no weight is ever evicted\n");
    printf("  --gpu-limit-mib N    GPU memory StarPU may use (default: the memory plan + 2%% + 256 MiB)\n");
    printf("  --gpu-limit-margin P the plan + P percent instead (a tight bound: the bounded-memory test)\n");
    printf("  --prefetch           the megatrain policy prefetches the next layer's weights (default)\n");
    printf("  --no-prefetch        turn that prefetch off (the ablation)\n");
    printf("  --norm-log FILE      write every gradient norm's sums of squares per tile as CSV (what\n"
           "                       ranged speculation predicts from; clipping only)\n");
    printf("  --data PATH          train on a corpus, a fresh batch each step: a text file or directory\n"
           "                       (bytes as tokens, as train reads it) or a directory written by\n"
           "                       'megatrain prepare' (default: one batch of random tokens, the same\n"
           "                       every step, as tools/torch_bench.py feeds; the model memorises it\n"
           "                       within about 16 steps, and its gradient norm then jumps)\n");
    printf("  --layers N           override the shape's layer count (memory-bound checks)\n");
    printf("  --dtype bf16|fp32    weights and compute (default bf16; fp32 is exact fp32, slower)\n");
    printf("  --ranged-bounds avx2|avx512|exact  how ranged speculation bounds each weight: avx512\n"
           "                       (default) with approximate reciprocals in 16 lanes where the CPU\n"
           "                       has AVX-512, else as avx2: in 8 where it has AVX2 and FMA; exact\n"
           "                       divides, as on other CPUs (where the others fall back to it).\n"
           "                       All are sound; they cost differently and may flag slightly\n"
           "                       different elements. A list (avx2,avx512) measures each, as does\n"
           "                       one for --adamw-defer (on,off), on the same host state: for each\n"
           "                       K and clip, each --adamw-defer value, and within it each bounds\n"
           "                       (a value may repeat: avx2,avx2 runs it twice). The last column\n"
           "                       names the bounds that ran and whether the moments were deferred.\n"
           "                       Each run trains on from the state the last left: alternate\n"
           "                       the settings to compare them (avx2,avx512,avx2,avx512)\n");
    printf("  --sched NAME         megatrain (default), dmda, eager, ...\n");
    printf("  --ncpu N, --ncuda N  StarPU workers (default: all)\n");
}

static int cmd_bench(int argc, char **argv)
{
    enum { O_SHAPE = 256, O_B, O_T, O_ACCUM, O_K, O_CLIP, O_WARM, O_STEPS, O_RES, O_LIMIT, O_NOPF, O_SCHED, O_NCPU, O_NCUDA, O_HELP, O_LAYERS, O_PF, O_MARGIN, O_DTYPE, O_NORMLOG, O_DATA, O_BOUNDS };
    static const struct option opts[] = {
        { "shape", required_argument, 0, O_SHAPE }, { "micro-batch", required_argument, 0, O_B },
        { "seq-len", required_argument, 0, O_T }, { "accum", required_argument, 0, O_ACCUM },
        { "checkpoint-every", required_argument, 0, O_K }, { "clip", required_argument, 0, O_CLIP },
        { "warmup", required_argument, 0, O_WARM }, { "steps", required_argument, 0, O_STEPS },
        { "resident", no_argument, 0, O_RES }, { "gpu-limit-mib", required_argument, 0, O_LIMIT }, { "gpu-limit-margin", required_argument, 0, O_MARGIN },
        { "no-prefetch", no_argument, 0, O_NOPF }, { "prefetch", no_argument, 0, O_PF },
        { "sched", required_argument, 0, O_SCHED },
        { "ncpu", required_argument, 0, O_NCPU }, { "ncuda", required_argument, 0, O_NCUDA },
        { "help", no_argument, 0, O_HELP }, { "layers", required_argument, 0, O_LAYERS },
        { "dtype", required_argument, 0, O_DTYPE }, STEP_LONG_OPTIONS,
        { "norm-log", required_argument, 0, O_NORMLOG },
        { "data", required_argument, 0, O_DATA }, { "ranged-bounds", required_argument, 0, O_BOUNDS },
        { 0, 0, 0, 0 },
    };
    mt_bench_options o = mt_bench_defaults();
    long long v;
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case O_SHAPE: o.shape = optarg; break;
        case O_B: if (parse_int("--micro-batch", optarg, 1, 1 << 20, &v)) return 2; o.step.B = v; break;
        case O_T: if (parse_int("--seq-len", optarg, 1, 1 << 24, &v)) return 2; o.step.T = v; break;
        case O_ACCUM: if (parse_int("--accum", optarg, 1, 1 << 20, &v)) return 2; o.step.accum = (int)v; break;
        case O_K: {
            double ks[MT_BENCH_MAX_SWEEP];
            if (parse_list("--checkpoint-every", optarg, 1, 1 << 20, ks, MT_BENCH_MAX_SWEEP, &o.nsweep_K)) return 2;
            for (int i = 0; i < o.nsweep_K; i++) {
                if (ks[i] != (int)ks[i]) return usage_error("--checkpoint-every: '%s' is not a list of integers%s", optarg, "");
                o.sweep_K[i] = (int)ks[i];
            }
            o.step.K = o.sweep_K[0];
            break;
        }
        case O_CLIP:
            if (parse_list("--clip", optarg, 0, 1e30, o.sweep_clip, MT_BENCH_MAX_SWEEP, &o.nsweep_clip)) return 2;
            o.step.clip = o.sweep_clip[0];
            break;
        case O_WARM: if (parse_int("--warmup", optarg, 0, 1000, &v)) return 2; o.warmup = (int)v; break;
        case O_STEPS: if (parse_int("--steps", optarg, 1, 1000, &v)) return 2; o.steps = (int)v; break;
        case O_RES: o.resident = true; break;
        case O_LIMIT: if (parse_int("--gpu-limit-mib", optarg, 1, 1LL << 30, &v)) return 2; o.gpu_limit_mib = (uint64_t)v; break;
        case O_MARGIN: if (parse_double("--gpu-limit-margin", optarg, 0.01, 1000, &o.gpu_limit_margin)) return 2; break;
        case O_NOPF: o.prefetch = false; break;
        case O_PF: o.prefetch = true; break;
        case O_LAYERS: if (parse_int("--layers", optarg, 1, 1 << 16, &v)) return 2; o.layers = v; break;
        case O_DTYPE:
            if (mt_dtype_parse(optarg, &o.dtype)) return usage_error("--dtype: '%s' is not bf16 or fp32%s", optarg, "");
            break;
        case O_SCHED: o.runtime.sched = optarg; break;
        case O_NCPU: if (parse_int("--ncpu", optarg, 1, 1024, &v)) return 2; o.runtime.ncpu = (int)v; break;
        case O_NCUDA: if (parse_int("--ncuda", optarg, 0, 64, &v)) return 2; o.runtime.ncuda = (int)v; break;
        case O_NORMLOG: o.norm_log = optarg; break;
        case O_DATA: o.data = optarg; break;
        case O_BOUNDS: {
            const char *names[3];
            int values[3];
            for (int b = 0; b < 3; b++) names[b] = mt_ranged_bounds_option((mt_ranged_bounds)(values[b] = b));
            if (parse_word_list("--ranged-bounds", optarg, names, values, 3, "avx2, avx512 or exact", o.sweep_bounds,
                                MT_BENCH_MAX_SWEEP, &o.nsweep_bounds))
                return 2;
            o.step.ranged_bounds = (mt_ranged_bounds)o.sweep_bounds[0];
            break;
        }
        case O_DEFER: { /* bench takes a list (the step option's parser takes one value) */
            if (parse_word_list("--adamw-defer", optarg, auto_on_off_names, auto_on_off_values, 3, "auto, on or off",
                                o.sweep_defer, MT_BENCH_MAX_SWEEP, &o.nsweep_defer))
                return 2;
            o.step.adamw_defer = o.sweep_defer[0];
            break;
        }
        case O_HELP: bench_help(&o); return 0;
        default: {
            const int r = parse_step_option(c, optarg, &o.step);
            if (r <= 0) return 2;
            break;
        }
        }
    }
    if (optind < argc) return usage_error("bench: unexpected argument '%s'%s", argv[optind], "");
    mt_model_config cfg;
    if (mt_config_from_shape(o.shape, &cfg))
        return usage_error("--shape: unknown shape '%s'%s", o.shape, " (qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-3b, qwen2.5-7b, qwen2.5-14b, tiny)");
    if (o.layers > 0) cfg.layers = o.layers;
    if (o.step.K > cfg.layers) o.step.K = (int)cfg.layers;
    int count = mt_bench_count(&o);
    mt_bench_result *r = calloc((size_t)count, sizeof *r);
    char err[1024];
    fprintf(stderr, "bench: megatrain %s, commit %s\n", MT_VERSION, MT_COMMIT);
    /* Rows print as each pair finishes, so a long sweep cut short keeps what it measured. */
    if (mt_bench_run(&o, r, stderr, stdout, err, sizeof err)) {
        fprintf(stderr, "%s: %s\n", cmd, err);
        free(r);
        return 1;
    }
    mt_bench_print_notes(&o, r, count, stdout);
    free(r);
    return 0;
}

/* ---- grads ------------------------------------------------------------------------------ */

static void grads_help(void)
{
    printf("usage: megatrain grads --model DIR --tokens FILE --batch B --seq-len T --out FILE [options]\n\n"
           "Runs the forward, loss and backward of one batch with the training step's graph (no\n"
           "update) and writes the loss and every parameter gradient, under HF names, as fp32\n"
           "safetensors: what tools/parity_suite.py and tests/test_parity.c compare\n"
           "with transformers.\n\n"
           "  --model DIR          HF directory (config.json + safetensors)\n"
           "  --tokens FILE        B x (T + 1) little-endian int32 ids; targets are the next ids\n"
           "  --batch B            sequences\n"
           "  --seq-len T          predicted positions per sequence\n"
           "  --out FILE           output .safetensors\n"
           "  --logits             also write \"logits\" [B, T, V]: every position's logits from the\n"
           "                       fp32 CPU forward of the loaded weights (whatever --ncuda says)\n"
           "  --save-model DIR     also write the loaded model as an HF directory (fp32 safetensors),\n"
           "                       replacing the model files in DIR as train --save-model does\n"
           "  --checkpoint-every K layers per recompute block (default 2)\n"
           "  --dtype fp32|bf16    precision of the weights and compute (default: bf16 when a GPU\n"
           "                       computes, fp32 on CPU workers; fp32 on the GPU agrees with the CPU)\n"
           "  --sched NAME, --ncpu N, --ncuda N   StarPU (--ncuda 0: the exact fp32 CPU path)\n");
}

static int cmd_grads(int argc, char **argv)
{
    enum { O_MODEL = 256, O_TOKENS, O_B, O_T, O_OUT, O_K, O_SCHED, O_NCPU, O_NCUDA, O_HELP, O_LOGITS, O_SAVE_MODEL,
           O_DTYPE };
    static const struct option opts[] = {
        { "model", required_argument, 0, O_MODEL }, { "tokens", required_argument, 0, O_TOKENS },
        { "batch", required_argument, 0, O_B }, { "seq-len", required_argument, 0, O_T },
        { "out", required_argument, 0, O_OUT }, { "checkpoint-every", required_argument, 0, O_K },
        { "sched", required_argument, 0, O_SCHED }, { "ncpu", required_argument, 0, O_NCPU },
        { "ncuda", required_argument, 0, O_NCUDA }, { "help", no_argument, 0, O_HELP },
        { "logits", no_argument, 0, O_LOGITS }, { "save-model", required_argument, 0, O_SAVE_MODEL },
        { "dtype", required_argument, 0, O_DTYPE }, { 0, 0, 0, 0 },
    };
    mt_grads_options o = { .K = 2, .runtime = mt_runtime_defaults() };
    long long v;
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case O_MODEL: o.model_dir = optarg; break;
        case O_TOKENS: o.tokens_path = optarg; break;
        case O_B: if (parse_int("--batch", optarg, 1, 1 << 20, &v)) return 2; o.B = v; break;
        case O_T: if (parse_int("--seq-len", optarg, 1, 1 << 24, &v)) return 2; o.T = v; break;
        case O_OUT: o.out_path = optarg; break;
        case O_LOGITS: o.logits = true; break;
        case O_SAVE_MODEL: o.save_model_dir = optarg; break;
        case O_DTYPE:
            if (mt_dtype_parse(optarg, &o.dtype)) return usage_error("--dtype: '%s' is not fp32 or bf16%s", optarg, "");
            o.dtype_explicit = true;
            break;
        case O_K: if (parse_int("--checkpoint-every", optarg, 1, 1 << 20, &v)) return 2; o.K = (int)v; break;
        case O_SCHED: o.runtime.sched = optarg; break;
        case O_NCPU: if (parse_int("--ncpu", optarg, 1, 1024, &v)) return 2; o.runtime.ncpu = (int)v; break;
        case O_NCUDA: if (parse_int("--ncuda", optarg, 0, 64, &v)) return 2; o.runtime.ncuda = (int)v; break;
        case O_HELP: grads_help(); return 0;
        default: return 2;
        }
    }
    if (optind < argc) return usage_error("grads: unexpected argument '%s'%s", argv[optind], "");
    if (!o.model_dir || !o.tokens_path || !o.out_path || !o.B || !o.T)
        return usage_error("grads: --model, --tokens, --batch, --seq-len and --out are all needed%s%s", "", "");
    double loss;
    char err[1024];
    if (mt_grads_run(&o, &loss, err, sizeof err)) {
        fprintf(stderr, "%s: %s\n", cmd, err);
        return 1;
    }
    printf("loss %.9f; %s written to %s\n", loss, o.logits ? "logits and gradients" : "gradients", o.out_path);
    if (o.save_model_dir) printf("model saved to %s (HF format, fp32)\n", o.save_model_dir);
    return 0;
}

/* ---- main ------------------------------------------------------------------------------- */

static void main_help(void)
{
    printf("usage: megatrain COMMAND [options]\n\n"
           "Trains LLMs that do not fit in GPU memory: host RAM holds every weight, gradient and\n"
           "AdamW state; layers stream through the GPU as a StarPU task graph.\n\n"
           "commands:\n"
           "  train   train a model (default: the built-in byte-level model on fortunes)\n"
           "  prepare tokenise text or chat JSONL into token shards for train --data\n"
           "  plan    print the memory plan of a run and check that it fits\n"
           "  bench   time the training step of a published shape (random weights)\n"
           "  grads   one batch's loss, logits and gradients as safetensors (parity with transformers)\n"
           "  info    show StarPU's workers and check that every kind runs a task\n\n"
           "'megatrain COMMAND --help' describes each command.\n");
}

int main(int argc, char **argv)
{
    if (argc < 2) { main_help(); return 2; }
    const char *sub = argv[1];
    if (!strcmp(sub, "--help") || !strcmp(sub, "-h") || !strcmp(sub, "help")) { main_help(); return 0; }
    if (!strcmp(sub, "--version")) { printf("megatrain %s (commit %s)\n", MT_VERSION, MT_COMMIT); return 0; }
    static char name[64];
    snprintf(name, sizeof name, "megatrain %s", sub);
    cmd = name;
    argv[1] = name;
    if (!strcmp(sub, "info")) return cmd_info(argc - 1, argv + 1);
    if (!strcmp(sub, "plan")) return cmd_plan(argc - 1, argv + 1);
    if (!strcmp(sub, "train")) return cmd_train(argc - 1, argv + 1);
    if (!strcmp(sub, "bench")) return cmd_bench(argc - 1, argv + 1);
    if (!strcmp(sub, "prepare")) return cmd_prepare(argc - 1, argv + 1);
    if (!strcmp(sub, "grads")) return cmd_grads(argc - 1, argv + 1);
    cmd = "megatrain";
    return usage_error("unknown command '%s'%s", sub, " (train, prepare, plan, bench, grads, info)");
}
