/* One batch's loss, logits and every parameter gradient, written with HF tensor names: what the
 * parity check against transformers compares (tools/parity_suite.py, tests/test_parity.c). */
#ifndef MT_RUNTIME_GRADS_H
#define MT_RUNTIME_GRADS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "models/dtype.h"
#include "runtime/runtime.h"

typedef struct mt_grads_options {
    const char *model_dir;      /* HF directory (config.json + safetensors) */
    const char *rope_scaling;   /* "TYPE:FACTOR" applied to its config (mt_config_set_rope_scaling), or NULL */
    const char *tokens_path;    /* B x (T + 1) little-endian int32 token ids */
    int64_t B, T;
    int K;                      /* checkpoint interval */
    int64_t mlp_chunk;          /* the dense MLP's tokens at a time (models/config.h), 0: all */
    const char *out_path;       /* safetensors: "loss" [1], "logits" [B, T, V] when asked, then one
                                 * fp32 gradient per parameter (tied: no lm_head.weight) */
    bool logits;                /* also write "logits": the fp32 CPU forward of the host masters,
                                 * whatever computes the gradients */
    const char *save_model_dir; /* when set, the loaded model is also written here as an HF
                                 * directory (fp32, default shards), as train --save-model does */
    bool dtype_explicit;        /* dtype below was asked for; else bf16 with CUDA workers, fp32 without */
    mt_dtype dtype;             /* streamed weights and compute: fp32 is exact on CPU and GPU alike */
    mt_runtime_options runtime;
} mt_grads_options;

/* Runs the forward, loss and backward of one batch (no update) with the graph of a training step
 * and writes the result, in o->dtype (by default fp32 on CPU workers, bf16 on a GPU).
 * Returns 0, or -1 with err set, naming the file (bad token file, ids beyond the vocabulary, ...). */
int mt_grads_run(const mt_grads_options *o, double *loss, char *err, size_t errlen);

#endif
