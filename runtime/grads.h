/* One batch's loss and every parameter gradient, written with HF tensor names: what the parity
 * check against transformers compares (tools/parity.py). */
#ifndef MT_RUNTIME_GRADS_H
#define MT_RUNTIME_GRADS_H

#include <stddef.h>
#include <stdint.h>

#include "runtime.h"

typedef struct mt_grads_options {
    const char *model_dir;      /* HF directory (config.json + safetensors) */
    const char *tokens_path;    /* B x (T + 1) little-endian int32 token ids */
    int64_t B, T;
    int K;                      /* checkpoint interval */
    const char *out_path;       /* safetensors: "loss" [1] then one fp32 gradient per parameter */
    mt_runtime_options runtime;
} mt_grads_options;

/* Runs the forward, loss and backward of one batch (no update) with the graph of a training step
 * and writes the result. On CPU workers everything is fp32; on a GPU the weights stream as bf16.
 * Returns 0, or -1 with err set (bad token file, ids beyond the vocabulary, ...). */
int mt_grads_run(const mt_grads_options *o, double *loss, char *err, size_t errlen);

#endif
