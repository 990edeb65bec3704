/* megatrain train: the training job (runtime/train.h) on a text corpus or prepared shards,
 * from a config or an HF model directory. */
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "runtime/dataset.h"
#include "runtime/train.h"
#include "tools/cli/commands.h"
#include "tools/cli/options.h"

static const char cmd[] = "megatrain train";

/* The signal that asked the run to stop (mt_train_options.stop_signal). */
static volatile sig_atomic_t stop_signal;

/* The first SIGINT or SIGTERM asks the run to stop after the step in flight (saying so at once);
 * a second one ends the process at once. Only async-signal-safe calls. */
static void on_stop_signal(int sig)
{
    if (stop_signal) _exit(128 + sig);
    stop_signal = sig;
    static const char note[] = "\nmegatrain train: stopping after the step in flight, saving the checkpoint if there "
                               "is one (the same signal again: exit at once)\n";
    ssize_t ignored = write(STDERR_FILENO, note, sizeof note - 1);
    (void)ignored;
}

static void catch_stop_signals(void)
{
    struct sigaction sa = { .sa_handler = on_stop_signal };
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

_Static_assert(sizeof(mt_lr_schedule) == sizeof(int), "--schedule stores an int");
_Static_assert(sizeof(mt_nonfinite) == sizeof(int), "--on-nonfinite stores an int");

/* --data-order shuffled|sequential into data_shuffle. */
static int parse_order(const char *cmd, const cli_option *opt, const char *arg, void *target)
{
    mt_train_options *o = target;
    if (!strcmp(arg, "shuffled")) o->data_shuffle = true;
    else if (!strcmp(arg, "sequential")) o->data_shuffle = false;
    else return cli_usage_error(cmd, "--data-order: '%s' is not shuffled or sequential", arg);
    return 0;
}

static const char *show_order(const void *field, char *buf, size_t size)
{
    return *(const bool *)field ? "shuffled" : "sequential";
}

static const cli_word schedules[] = { { "cosine", MT_LR_COSINE }, { "constant", MT_LR_CONSTANT }, { NULL, 0 } };
static const cli_word nonfinite[] = { { "stop", MT_NONFINITE_STOP }, { "skip", MT_NONFINITE_SKIP }, { NULL, 0 } };

#define FIELD(name) offsetof(mt_train_options, name)

static const cli_option data_options[] = {
    { .name = "save-model", .arg = "DIR", .kind = CLI_STRING, .field = FIELD(save_model_dir),
      .help = "write the trained model and --model's tokenizer files as an HF directory" },
    { .name = "save-dtype", .arg = "fp32|bf16", .kind = CLI_CUSTOM, .field = FIELD(save_dtype), .parse = cli_dtype_option,
      .help = "the saved weights' dtype (default: that of --model's weights, else fp32)" },
    { .name = "save-over-model", .kind = CLI_SET, .field = FIELD(save_over_model), .on = true, .advanced = true,
      .help = "let --save-model name the --model directory (replaces the base model)" },
    { .name = "data", .arg = "PATH", .kind = CLI_STRING, .field = FIELD(data_path), .show_default = true,
      .help = "a text file or directory, or a 'megatrain prepare' directory" },
    { .name = "data-order", .arg = "ORDER", .kind = CLI_CUSTOM, .field = FIELD(data_shuffle), .parse = parse_order,
      .show_default = true, .show = show_order, .help = "prepared data: shuffled (seeded, per epoch) or sequential" },
    { .name = "dtype", .arg = "fp32|bf16", .kind = CLI_CUSTOM, .field = FIELD(dtype), .parse = cli_dtype_option,
      .help = "streamed weights and compute (default: bf16 on a GPU, else fp32)" },
    { .name = "seed", .arg = "N", .kind = CLI_UINT64, .field = FIELD(seed), .min = 0, .max = LLONG_MAX,
      .show_default = true, .help = "initialisation and sampling seed" },
    { .name = "allow-other-tokenizer", .kind = CLI_SET, .field = FIELD(allow_other_tokenizer), .on = true,
      .advanced = true, .help = "train although --model's tokenizer.json is not the one --data was prepared with" },
};

static const cli_option tokens_options[] = {
    { .name = "tokens-per-step", .arg = "N", .kind = CLI_INT64, .field = FIELD(tokens_per_step), .min = 1,
      .max = 1LL << 40, .help = "tokens per step: micro-batch and accum then fit --activation-budget" },
    { .name = "activation-budget", .arg = "BYTES", .kind = CLI_UINT64, .field = FIELD(activation_budget), .min = 1,
      .max = LLONG_MAX, .show_default = true, .help = "activation memory of one micro-batch" },
};

static const cli_option optimizer_options[] = {
    { .name = "steps", .arg = "N", .kind = CLI_INT64, .field = FIELD(steps), .min = 1, .max = 1LL << 40,
      .show_default = true, .help = "optimizer steps" },
    { .name = "lr", .arg = "X", .kind = CLI_DOUBLE, .field = FIELD(lr), .lo = 0, .hi = 10, .show_default = true,
      .help = "peak learning rate" },
    { .name = "schedule", .arg = "S", .kind = CLI_WORD, .field = FIELD(schedule), .words = schedules,
      .show_default = true, .help = "cosine (linear warm-up, then cosine) or constant" },
    { .name = "warmup", .arg = "N", .kind = CLI_INT64, .field = FIELD(warmup), .min = 0, .max = 1LL << 40,
      .help = "linear warm-up steps, fewer than --steps (default 30, or a tenth of a shorter run)" },
    { .name = "weight-decay", .arg = "X", .kind = CLI_DOUBLE, .field = FIELD(step.weight_decay), .lo = 0, .hi = 10,
      .show_default = true, .help = "AdamW decoupled weight decay on matrices" },
    { .name = "router-aux-loss", .arg = "COEF", .kind = CLI_DOUBLE, .field = FIELD(router_aux_loss), .lo = 0,
      .hi = 100, .help = "MoE: the router's load-balancing loss coefficient, 0 = off (default: the config's "
      "output_router_logits and router_aux_loss_coef)" },
};

static const cli_option progress_options[] = {
    { .name = "eval-every", .arg = "N", .kind = CLI_INT64, .field = FIELD(eval_every), .min = 0, .max = 1LL << 40,
      .show_default = true, .help = "validation before training and every N steps; 0 = at the end only" },
    { .name = "log-every", .arg = "N", .kind = CLI_INT64, .field = FIELD(log_every), .min = 1, .max = 1LL << 40,
      .show_default = true, .help = "progress line every N steps" },
    { .name = "sample-bytes", .arg = "N", .kind = CLI_INT64, .field = FIELD(sample_bytes), .min = 0, .max = 1 << 20,
      .show_default = true, .help = "bytes of text generated at the end" },
    { .name = "time-limit", .arg = "SEC", .kind = CLI_DOUBLE, .field = FIELD(time_limit), .lo = 0, .hi = 1e9,
      .help = "stop after the step that passes SEC seconds (default none)" },
    { .name = "stop-after", .arg = "N", .kind = CLI_INT64, .field = FIELD(stop_after), .min = 1, .max = 1LL << 40,
      .help = "stop after step N (the schedule still spans --steps)" },
    { .name = "metrics", .arg = "FILE", .kind = CLI_STRING, .field = FIELD(metrics_path),
      .help = "one JSON line a step: loss, grad_norm, lr, tokens_per_s, elapsed_s, epoch, val_loss" },
    { .name = "checkpoint", .arg = "FILE", .kind = CLI_STRING, .field = FIELD(checkpoint_path),
      .help = "save a training checkpoint at the end and on SIGINT or SIGTERM" },
    { .name = "save-every", .arg = "N", .kind = CLI_INT64, .field = FIELD(save_every), .min = 0, .max = 1LL << 40,
      .help = "also every N steps" },
    { .name = "keep-last", .arg = "N", .kind = CLI_INT64, .field = FIELD(keep_last), .min = 1, .max = 1LL << 40,
      .help = "numbered checkpoints FILE.STEP, the last N kept, FILE a link to the newest" },
    { .name = "resume", .arg = "FILE", .kind = CLI_STRING, .field = FIELD(resume_path),
      .help = "continue a run from its checkpoint, bit for bit (its settings are checked)" },
    { .name = "allow-changed", .arg = "LIST", .kind = CLI_STRING, .field = FIELD(allow_changed),
      .help = "--resume: accept these changed settings (lr,steps,... or all)" },
    { .name = "on-nonfinite", .arg = "M", .kind = CLI_WORD, .field = FIELD(on_nonfinite), .words = nonfinite,
      .show_default = true, .help = "NaN or infinite loss or norm: stop, or skip the step's update" },
};

int cli_train(int argc, char **argv)
{
    char advanced_note[2048];
    snprintf(advanced_note, sizeof advanced_note,
             "--save-over-model and --allow-other-tokenizer each turn off a check that protects a run.\n%s",
             cli_speculation_note);
    mt_train_options o = mt_train_defaults();
    cli_model model = { .config_path = o.config_path };
    const cli_group groups[] = {
        CLI_GROUP_ONLY("model and data", cli_model_options, &model, "config model rope-scaling"),
        CLI_GROUP(NULL, data_options, &o),
        CLI_GROUP_ONLY("batch", cli_batch_options, &o.step, "micro-batch seq-len accum"),
        CLI_GROUP(NULL, cli_checkpoint_options, &o.step),
        CLI_GROUP(NULL, tokens_options, &o),
        CLI_GROUP("optimizer", optimizer_options, &o),
        CLI_GROUP(NULL, cli_clip_options, &o.step),
        CLI_GROUP("progress and checkpoints", progress_options, &o),
        CLI_GROUP("memory", cli_layout_options, &o.host_layout),
        CLI_GROUP(NULL, cli_gpu_memory_options, &o.gpu_memory),
        CLI_GROUP(NULL, cli_offload_options, &o.step),
        CLI_GROUP(NULL, cli_mlp_chunk_options, &o.step),
        CLI_GROUP("workers", cli_worker_options, &o.runtime),
    };
    const cli_command c = {
        .name = cmd,
        .usage = "usage: megatrain train [options]\n\n"
                 "Trains a model with the streaming step (a StarPU task graph), showing progress and\n"
                 "validation loss; no options: the built-in byte-level model on the fortunes corpus.\n"
                 "Ctrl-C or SIGTERM stops it after the step in flight and saves --checkpoint (a second\n"
                 "one at once). Under mpirun -np N the ranks train data-parallel, --micro-batch each.\n",
        .groups = groups,
        .ngroups = sizeof groups / sizeof groups[0],
        .advanced_note = advanced_note,
    };
    cli_given given;
    int status;
    if (!cli_parse(&c, argc, argv, &given, &status)) return status;
    const int env = cli_environment(cmd, &o.runtime, &o.step);
    if (env) return env;
    /* Each line as it is printed: the log of a run that is killed shows all it did. */
    setvbuf(stdout, NULL, _IOLBF, 0);
    o.config_path = model.config_path;
    o.model_dir = model.model_dir;
    o.rope_scaling = model.rope_scaling;
    o.dtype_explicit = cli_was_given(&given, "dtype");
    o.k_default = !cli_was_given(&given, "checkpoint-every");
    o.save_dtype_explicit = cli_was_given(&given, "save-dtype");
    o.eval_at_start = o.eval_every > 0;
    /* A --warmup not below --steps is refused; the default shrinks to a tenth of a short run (the
     * log's learning-rate line says how many). */
    if (!cli_was_given(&given, "warmup") && o.warmup >= o.steps) o.warmup = o.steps / 10;
    char err[1024];
    /* Prepared data set the sequence length unless --seq-len gives one. */
    if (!cli_was_given(&given, "seq-len") && mt_dataset_is_prepared(o.data_path)) {
        int64_t T;
        if (mt_dataset_seq_len(o.data_path, &T, err, sizeof err)) return cli_failed(cmd, err);
        o.step.T = T;
    }
    o.stop_signal = &stop_signal;
    catch_stop_signals();
    mt_train_result res;
    const int failed = mt_train_run(&o, &res, stdout, err, sizeof err);
    free(res.losses);
    if (failed) return cli_failed(cmd, err);
    return res.stopped_by ? 128 + res.stopped_by : 0;
}
