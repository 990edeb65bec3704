/* `megatrain eval`: the validation loss of an HF model directory on the validation split of a
 * prepared directory (runtime/dataset.h) or of a text corpus read as bytes (byte-level models),
 * through the step graph's forward-only path (mt_graph_eval), the one training validates with:
 * on the GPU when there is one (bf16 by default), on the CPU workers in fp32 otherwise. */
#ifndef MT_RUNTIME_EVAL_H
#define MT_RUNTIME_EVAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "models/dtype.h"
#include "runtime/runtime.h"

typedef struct mt_eval_options {
    const char *model_dir;      /* HF directory: config.json + safetensors (+ tokenizer.json) */
    const char *data_path;      /* a `megatrain prepare` directory, or a text file or directory */
    const char *rope_scaling;   /* "TYPE:FACTOR" or NULL */
    int64_t B;                  /* sequences per graph pass */
    int64_t T;                  /* tokens per sequence; 0: the prepared data's seq_len (text: 128) */
    int64_t max_sequences;      /* validation windows at most; 0: all */
    int K;                      /* layers per recompute block of the graph (no effect on the loss) */
    bool dtype_explicit;        /* dtype was asked for; else bf16 with CUDA workers, fp32 without */
    mt_dtype dtype;
    bool allow_other_tokenizer; /* evaluate although the model's tokenizer.json is not the data's */
    mt_runtime_options runtime;
} mt_eval_options;

mt_eval_options mt_eval_defaults(void);

typedef struct mt_eval_result {
    double loss;                /* mean over counted targets of -log p(target), nats per token */
    double perplexity;          /* exp(loss) */
    int64_t tokens;             /* targets counted (a prepared directory's masked ones are not) */
    int64_t sequences;          /* validation windows read */
    int64_t T;                  /* their length */
    mt_dtype dtype;             /* of the computation */
    int ncuda;                  /* CUDA workers that ran */
} mt_eval_result;

/* Checks everything before any long work (the model's config, the data's kind against the model,
 * the tokenizer the data was prepared with against the model's, the sequence length), then loads
 * the weights and evaluates. Progress (what is evaluated) goes to log (NULL: silent). 0, or -1
 * with err naming the file and the problem (also: no validation windows in the data). */
int mt_eval_run(const mt_eval_options *o, mt_eval_result *res, FILE *log, char *err, size_t errlen);

#endif
