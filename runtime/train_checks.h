/* What a training run checks before any long work starts, each check refusing with a message
 * that names the file or option and says how to fix it: the options that contradict each other,
 * that the data is of a kind the model reads, that every output can be written and replaces
 * nothing it must not, that the model's tokenizer is the one the data was prepared with, and
 * that a resumed run has the settings of the run that wrote its checkpoint. */
#ifndef MT_RUNTIME_TRAIN_CHECKS_H
#define MT_RUNTIME_TRAIN_CHECKS_H

#include <stddef.h>
#include <stdio.h>

#include "models/config.h"
#include "runtime/dataset.h"
#include "runtime/train.h"

/* Options that contradict each other or name nothing: steps, --warmup not below --steps,
 * --save-every or --keep-last without --checkpoint, unknown names in --allow-changed. */
int mt_train_check_options(const mt_train_options *o, char *err, size_t errlen);

/* The data is a byte corpus (a text file or directory) or a prepared directory; a shard file,
 * a meta.json, JSONL, or a directory of shards without meta.json is refused, and so is a byte
 * corpus when the model is not byte-level (an HF model, --model, of more than 256 ids), each
 * with the `megatrain prepare` command to run instead. config_path names the model. */
int mt_train_check_data_kind(const mt_train_options *o, const mt_model_config *cfg, const char *config_path, char *err,
                             size_t errlen);

/* --checkpoint, --metrics and --save-model can be written (their directories take files; none is
 * a directory, or for --save-model, a file); a run that does not resume does not replace an
 * existing checkpoint; --save-model is not the --model directory unless save_over_model, and
 * holds nothing but a previous megatrain output (mt_hf_check_output). */
int mt_train_check_outputs(const mt_train_options *o, char *err, size_t errlen);

/* With --model DIR holding tokenizer.json and prepared data whose meta.json records its
 * tokenizer's FNV-1a (tokenizer.fnv1a64): the two are the same file's bytes, unless
 * allow_other_tokenizer (then a note goes to log). */
int mt_train_check_tokenizer(const mt_train_options *o, FILE *log, char *err, size_t errlen);

/* What the data is, for the settings: a prepared directory by its meta.json's FNV-1a, a corpus
 * by its bytes' count and FNV-1a. */
void mt_train_data_identity(const mt_run_data *d, char *buf, size_t len);

/* The settings a run's trajectory depends on, as "name=value\n" lines (names as the options of
 * `megatrain train`): data (identity), data-path, data-order, micro-batch, accum, seq-len,
 * steps, lr, min-lr-ratio, schedule, warmup, seed, weight-decay, beta1, beta2, eps, clip, dtype,
 * rope-scaling, router-aux-loss.
 * o holds the run's resolved values (micro-batch and accum chosen, dtype decided). */
void mt_train_settings(const mt_train_options *o, const char *data_identity, char *buf, size_t len);

/* Compares this run's settings with those saved in checkpoint `path`: every difference is
 * named with both values and refused, unless its name is in o->allow_changed ("all": any);
 * accepted ones and a moved data path (same content) are noted on log. A checkpoint of version
 * 1 (saved empty) is accepted with a warning on log. 0, or -1 with err set. */
int mt_train_check_settings(const mt_train_options *o, const char *path, const char *saved, const char *now, FILE *log,
                            char *err, size_t errlen);

#endif
