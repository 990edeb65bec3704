/* The command line's one option parser: each subcommand describes its options as tables (one
 * entry per option: its name, its value's kind, range and field, its help line) and parses and
 * prints its help with cli_parse. The options several subcommands take (the model, the batch
 * shape, clipping and its speculation, the StarPU workers) are tables here, defined once. */
#ifndef MT_TOOLS_CLI_OPTIONS_H
#define MT_TOOLS_CLI_OPTIONS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "models/config.h"
#include "models/dtype.h"
#include "runtime/plan.h"
#include "runtime/runtime.h"
#include "runtime/step.h"

/* Ranges that every subcommand taking the option checks alike. */
#define CLI_MAX_BATCH (1LL << 20)    /* --micro-batch, --accum, --checkpoint-every, --batch */
#define CLI_MAX_SEQ_LEN (1LL << 24)  /* --seq-len */
#define CLI_MAX_NCPU 1024
#define CLI_MAX_NCUDA 64

/* How an option's value is parsed and stored at `field` of its group's target. */
typedef enum cli_kind {
    CLI_SET,     /* no value: the bool field becomes `on` */
    CLI_STRING,  /* const char *: the argument itself */
    CLI_INT,     /* int in [min, max] */
    CLI_INT64,   /* int64_t in [min, max] */
    CLI_UINT64,  /* uint64_t in [min, max] (min >= 0) */
    CLI_DOUBLE,  /* double in [lo, hi], finite */
    CLI_WORD,    /* int (or an enum of int's size): the value of one of `words` */
    CLI_CUSTOM,  /* parse() does it: lists, several fields, a library's own parser */
} cli_kind;

/* One accepted word of a CLI_WORD option and what it stores; a list ends with { NULL }. */
typedef struct cli_word {
    const char *word;
    int value;
} cli_word;

typedef struct cli_option cli_option;
struct cli_option {
    const char *name;        /* without the leading "--" */
    const char *arg;         /* the value's name in the help; NULL: the option takes none */
    cli_kind kind;
    size_t field;            /* offsetof the value in the group's target */
    long long min, max;      /* CLI_INT, CLI_INT64, CLI_UINT64 */
    double lo, hi;           /* CLI_DOUBLE */
    bool on;                 /* CLI_SET */
    const cli_word *words;   /* CLI_WORD */
    /* CLI_CUSTOM: parses arg into target (the group's); 0, or 2 after printing why not. */
    int (*parse)(const char *cmd, const cli_option *opt, const char *arg, void *target);
    const char *help;        /* one line */
    bool show_default;       /* the help line ends with " (default V)", V read from the field */
    /* The default's text when the field's value is not it (NULL from it: none shown). */
    const char *(*show)(const void *field, char *buf, size_t size);
    bool advanced;           /* listed by --help-all only */
};

/* A table of options a subcommand takes, and the struct their fields are in. */
typedef struct cli_group {
    const char *title;        /* the help's section heading; NULL: continues the section above */
    const cli_option *options;
    int count;
    void *target;
    const char *only;         /* NULL: every option of the table; else the names taken, space-separated */
} cli_group;

#define CLI_GROUP(title, table, target) { title, table, (int)(sizeof table / sizeof table[0]), target, NULL }
#define CLI_GROUP_ONLY(title, table, target, only) \
    { title, table, (int)(sizeof table / sizeof table[0]), target, only }

typedef struct cli_command {
    const char *name;         /* "megatrain train": the messages' prefix */
    const char *usage;        /* the usage line and a short description, each line ending in \n */
    const cli_group *groups;
    int ngroups;
    const char *advanced_note; /* --help-all: what the advanced options are about (NULL: none) */
} cli_command;

#define CLI_MAX_OPTIONS 96

/* Which options the command line gave (a default and the same value given differ). */
typedef struct cli_given {
    const char *names[CLI_MAX_OPTIONS];
    int count;
} cli_given;

/* Parses argv (argv[0]: the command's name, for getopt's messages) into the groups' targets,
 * which hold the defaults on entry. True when the command is to run; false when it is done,
 * with *status its exit status: 0 after --help or --help-all printed the help, 2 after a bad
 * option, value or positional argument was named on stderr. given may be NULL. */
bool cli_parse(const cli_command *c, int argc, char **argv, cli_given *given, int *status);
bool cli_was_given(const cli_given *g, const char *name);

/* "cmd: message (try 'cmd --help')" on stderr; returns 2, the exit status of a usage error. */
int cli_usage_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* "cmd: err" on stderr; returns 1, the exit status of a run that failed. */
int cli_failed(const char *cmd, const char *err);

/* Whole-string values, with a message naming the flag on failure (0 on success, else -1). */
int cli_parse_int(const char *cmd, const char *flag, const char *s, long long lo, long long hi, long long *out);
int cli_parse_double(const char *cmd, const char *flag, const char *s, double lo, double hi, double *out);
/* A comma-separated list of at most max numbers, each checked as cli_parse_double does. */
int cli_parse_list(const char *cmd, const char *flag, const char *s, double lo, double hi, double *out, int max, int *n);
/* A comma-separated list of at most max words of `words`, stored as their values. */
int cli_parse_word_list(const char *cmd, const char *flag, const char *s, const cli_word *words, int *out, int max,
                        int *n);

/* auto|on|off: -1, 1, 0. */
extern const cli_word cli_auto_on_off[];
/* A CLI_CUSTOM parser for --dtype: mt_dtype_parse's names into the mt_dtype field. */
int cli_dtype_option(const char *cmd, const cli_option *opt, const char *arg, void *target);
/* A CLI_CUSTOM parser of a byte count into the uint64_t field: a whole number, or a number with a
 * suffix, K M G T P (powers of 1024, also KiB..PiB) or KB MB GB TB PB (powers of 1000): 125G, 1.5T.
 * At least opt->min bytes. */
int cli_bytes_option(const char *cmd, const cli_option *opt, const char *arg, void *target);
/* The value of a byte count as cli_bytes_option reads it: 0, or -1 after a message naming flag. */
int cli_parse_bytes(const char *cmd, const char *flag, const char *s, uint64_t *out);

/* ---- the shared options --------------------------------------------------------------- */

/* --config, --model, --shape, --layers, --rope-scaling: which model a run is of. */
typedef struct cli_model {
    const char *config_path;  /* an HF config.json */
    const char *model_dir;    /* an HF directory: config.json and safetensors */
    const char *shape;        /* a published shape's name (mt_config_from_shape) */
    int64_t layers;           /* > 0: the shape's layer count replaced (memory-bound checks) */
    const char *rope_scaling; /* "TYPE:FACTOR" checked by mt_rope_scaling_parse, for
                               * mt_config_set_rope_scaling; NULL: the model's own rope */
} cli_model;
extern const cli_option cli_model_options[5];
/* The config of --shape or --config (whichever is set; the shape first) with --layers and
 * --rope-scaling applied: 0, 2 after a usage error (an unknown shape), 1 after a config that
 * could not be read or a scaling it does not take. */
int cli_model_config(const char *cmd, const cli_model *m, mt_model_config *cfg);

/* --micro-batch, --seq-len, --accum, --checkpoint-every into an mt_step_config. */
extern const cli_option cli_batch_options[4];
/* --checkpoint-every K|auto into an mt_step_config's K (auto: MT_PLAN_K_AUTO, which
 * mt_plan_choose_run resolves): train's, plan's. eval and grads take cli_batch_options' K. */
extern const cli_option cli_checkpoint_options[1];
/* --gpu-memory BYTES into a uint64_t, the group's target that field itself (0: the device's,
 * runtime/plan.h: mt_plan_gpu_memory): train, plan and bench. */
extern const cli_option cli_gpu_memory_options[1];
/* --offload-checkpoints auto|on|off into an mt_step_config's offload_checkpoints (-1, 1, 0;
 * runtime/plan.h: mt_plan_choose_run resolves auto): train, plan and bench. */
extern const cli_option cli_offload_options[1];
/* --mlp-chunk into mt_step_config.mlp_chunk. */
extern const cli_option cli_mlp_chunk_options[1];
/* --clip and clip speculation (the advanced knobs of ranged speculation and the AdamW deferral)
 * into an mt_step_config. */
extern const cli_option cli_clip_options[8];
/* What clip speculation does, the note above the advanced options of train and bench. */
extern const char cli_speculation_note[];
/* --sched, --ncpu, --ncuda, --watchdog into an mt_runtime_options. */
extern const cli_option cli_worker_options[4];
/* --host-layout auto|full|compact into an mt_host_layout: the group's target is that field itself
 * (plan, bench and train take it; runtime/plan.h: mt_plan_choose resolves auto). */
extern const cli_option cli_layout_options[1];

/* Maps the documented environment variables to the library's options; the one place the
 * command line reads the environment for the library. A value that names nothing is reported
 * and the default kept; returns 0, or 2 when the command must stop. */
int cli_environment(const char *cmd, mt_runtime_options *runtime, mt_step_config *step);

#endif
