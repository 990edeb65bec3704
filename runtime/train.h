/* The training job: load a config and a corpus (bytes) or prepared token shards (dataset.h), build the host state and the step graph,
 * train with progress lines and periodic validation, then sample some text. */
#ifndef MT_RUNTIME_TRAIN_H
#define MT_RUNTIME_TRAIN_H

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "runtime/runtime.h"
#include "runtime/state.h"
#include "runtime/step.h"

typedef enum mt_lr_schedule { MT_LR_COSINE, MT_LR_CONSTANT } mt_lr_schedule;

/* What a step whose loss or gradient norm is NaN or infinite does. */
typedef enum mt_nonfinite {
    MT_NONFINITE_STOP,  /* the run stops with an error naming the step; nothing more is saved, so
                         * the last checkpoint is that of the last good step it saved */
    MT_NONFINITE_SKIP,  /* the step's update is not applied (weights and AdamW state as before it;
                         * its batch is consumed; the learning rate follows the step, AdamW's bias
                         * correction the updates applied). So that it can be withheld, each step's
                         * update is submitted only once its loss and norm are known: it no longer
                         * runs ahead of the norm (no clip speculation, no moments deferral). */
} mt_nonfinite;

typedef struct mt_train_options {
    const char *config_path;   /* HF-style config.json */
    const char *data_path;     /* text file or directory, or a `megatrain prepare` directory (meta.json) */
    bool data_shuffle;         /* prepared data: visit training windows in a seeded order per epoch (else in order) */
    int64_t steps;
    mt_step_config step;       /* B, T, accum, K, clip, AdamW betas/eps/wd */
    int64_t tokens_per_step;   /* > 0: choose B and accum for this many tokens under the budget */
    uint64_t activation_budget;/* bytes of activations one micro-batch may take */
    double lr, min_lr_ratio;   /* peak learning rate; cosine decays to lr * min_lr_ratio */
    int64_t warmup;            /* linear warm-up steps */
    mt_lr_schedule schedule;
    uint64_t seed;
    double init_std;
    int64_t eval_every;        /* validate every N steps (and at the end); 0 = only at the end */
    bool eval_at_start;        /* also before the first step (the command line: when eval_every > 0) */
    int64_t eval_sequences;    /* validation windows of T tokens */
    int64_t log_every;
    mt_dtype dtype;            /* streamed weights; used as given only when dtype_explicit */
    bool dtype_explicit;       /* false: fp32 on CPU workers, bf16 when a GPU computes */
    bool k_default;            /* step.K is a default, not asked for: where its plan does not fit,
                                * the smallest larger K that fits (mt_plan_params.k_default) */
    mt_host_layout host_layout;/* AUTO (default): full with clip speculation where it fits, else
                                * compact (runtime/plan.h: mt_plan_choose); FULL; COMPACT */
    uint64_t gpu_memory;       /* with a CUDA worker, the GPU plan is checked against this many bytes;
                                * 0: the device's (runtime/plan.h: mt_plan_gpu_memory). step.K may be
                                * MT_PLAN_K_AUTO: the largest K that fits both, chosen before the state */
    int64_t sample_bytes;      /* generated after training; 0 = none */
    const char *sample_prompt;
    double time_limit;         /* seconds; stop early (after a step) when exceeded; 0 = none */
    int64_t stop_after;        /* > 0: stop after this step (the schedule still spans `steps`) */
    const char *checkpoint_path; /* save training checkpoints here (NULL: none) */
    int64_t save_every;        /* every N steps, and at the end; 0 = at the end only */
    int64_t keep_last;         /* > 0: numbered checkpoints, the last N kept (mt_checkpoint_save_kept) */
    const char *resume_path;   /* continue from this checkpoint */
    const char *allow_changed; /* resume: settings that may differ from the checkpoint's, comma-separated
                                * (names of mt_train_settings), or "all"; NULL: none */
    const char *model_dir;     /* start from this HF directory's config and weights (NULL: config_path, random) */
    const char *rope_scaling;  /* "TYPE:FACTOR" replacing the config's rope scaling (mt_config_set_rope_scaling);
                                * NULL: the config's own */
    double router_aux_loss;    /* a mixture-of-experts model's load-balancing loss coefficient, replacing the
                                * config's output_router_logits and router_aux_loss_coef: 0 off, > 0 on with
                                * this coefficient; < 0 (the default): the config's */
    const char *save_model_dir;/* write the trained model here as an HF directory, with model_dir's tokenizer files */
    bool save_over_model;      /* save_model_dir may be model_dir (the base model is replaced) */
    mt_dtype save_dtype;       /* the saved weights' dtype; used as given only when save_dtype_explicit */
    bool save_dtype_explicit;  /* false: model_dir's weights' dtype (bf16 stays bf16, else fp32), fp32 without one */
    bool hash_weights;         /* fill the result's weights_hash: one pass over every fp32 master (for tests;
                                * about a minute for a 7B model) */
    bool allow_other_tokenizer;/* train although model_dir's tokenizer.json is not the prepared data's */
    mt_nonfinite on_nonfinite;
    const char *metrics_path;  /* one JSON line a step (runtime/metrics.h); NULL: none */
    /* Nonzero: the number of a signal that asks the run to stop (set from a handler, read between
     * steps): the step in flight ends, no further one starts, the checkpoint is written (and the
     * model, when the run had reached its end). NULL: none. */
    const volatile sig_atomic_t *stop_signal;
    mt_runtime_options runtime;
} mt_train_options;

typedef struct mt_train_result {
    int64_t steps_done;               /* the last step done (counting a resumed run's earlier ones) */
    int64_t first_step;               /* the first step this run did (after a resume: the checkpoint's + 1) */
    int64_t skipped;                  /* steps whose update was skipped (--on-nonfinite skip), this run */
    int stopped_by;                   /* the signal that stopped the run (*stop_signal), else 0 */
    double first_loss, last_loss;     /* training loss of the first and last step */
    double first_val, last_val;       /* validation loss before training and at the end (NAN: not measured) */
    int64_t val_counted;              /* targets the last validation counted (masked ones do not) */
    double seconds, tokens_per_second;
    double *losses;                   /* (steps) training loss by step (index step-1); caller frees */
    uint64_t weights_hash;            /* mt_state_hash of the final master weights (hash_weights), else 0 */
} mt_train_result;

/* Defaults: the built-in tiny byte-level model on the fortunes corpus. */
mt_train_options mt_train_defaults(void);

/* Learning rate at 1-based step s. */
double mt_lr_at(const mt_train_options *o, int64_t s);

/* Runs the job. Progress goes to `log` (NULL: silent). Starts and stops StarPU itself.
 * Returns 0, or -1 with a message in err. */
int mt_train_run(const mt_train_options *o, mt_train_result *res, FILE *log, char *err, size_t errlen);

#endif
