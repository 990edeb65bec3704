/* Text from a model: one sampling decision over a row of logits (greedy, temperature, top-p), a
 * token-by-token loop that stops at an end-of-sequence id, with two forwards to take the logits
 * from: the host master weights through the fp32 CPU ops (mt_host_hidden, mt_generate_ids) or the
 * step graph's forward on the runtime's workers, GPU or CPU (mt_generate_ids_graph); and
 * `megatrain generate`'s whole job (an HF directory and its tokenizer, a prompt, the text printed
 * as it comes), which runs the graph's. No KV cache: each new token re-runs the forward over the
 * whole context, the prompt included. */
#ifndef MT_RUNTIME_GENERATE_H
#define MT_RUNTIME_GENERATE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "runtime/data.h"
#include "runtime/runtime.h"
#include "runtime/state.h"

/* The final hidden state (B*T, d) of tokens (B, T) through the fp32 CPU ops on the host master
 * weights (no task in flight). x and y are (B*T, d) buffers, scratch mt_layer_scratch_numel(cfg,
 * B, T) floats; returns whichever of x and y holds the result. */
float *mt_host_hidden(const mt_host_state *st, int64_t B, int64_t T, const int32_t *tokens, float *x, float *y,
                      float *scratch);

/* Greedy/temperature sampling from the host master weights (no task in flight): appends n bytes
 * to prompt into out (prompt length + n + 1 bytes). Uses at most `context` bytes of history.
 * For the byte-level models of a training job's sample. */
void mt_generate(const mt_host_state *st, const char *prompt, int64_t n, int64_t context,
                 double temperature, uint64_t seed, char *out);

/* How one token is chosen from a row of logits. */
typedef struct mt_sampling {
    double temperature;  /* 0: greedy (the largest logit, the lowest id among equal ones); > 0: softmax of
                          * logits / temperature, computed in double */
    double top_p;        /* (0, 1]: only the most probable ids whose probabilities, sorted, first sum to at
                          * least top_p are drawn from (at least one), renormalised; 1: all */
} mt_sampling;

/* Scratch that mt_sample takes for V logits. */
typedef struct mt_sampler {
    int64_t V;
    double *prob;        /* (V) */
    int32_t *order;      /* (V) */
} mt_sampler;
/* 0, or -1 when memory is short. */
int mt_sampler_init(mt_sampler *s, int64_t V);
void mt_sampler_free(mt_sampler *s);

/* One id of logits (s->V): greedy, or a draw by rng (one mt_rng_uniform a call) as `how` says. */
int32_t mt_sample(mt_sampler *s, const float *logits, const mt_sampling *how, mt_rng *rng);

/* Called with each new id as it is chosen; returns nonzero to stop. */
typedef int (*mt_token_fn)(void *user, const int32_t *ids, int64_t n);

typedef struct mt_generate_args {
    int64_t max_new;        /* new ids at most */
    mt_sampling sampling;
    uint64_t seed;
    const int32_t *eos;     /* ids that end the text (not emitted); may be NULL with neos 0 */
    int neos;
    mt_token_fn on_token;   /* NULL: none. Gets every id so far (prompt first), after each new one */
    void *user;
} mt_generate_args;

/* Continues prompt (n_prompt >= 1 ids, each below the vocabulary) from the host masters (no task
 * in flight): at most max_new ids into out, stopping before an eos id (*eos_hit true) or when the
 * sequence reaches the model's longest (mt_config_max_seq_len). Each step runs the forward over
 * the whole sequence so far. Returns the number of ids written, or -1 with err set (memory). */
int64_t mt_generate_ids(const mt_host_state *st, const int32_t *prompt, int64_t n_prompt, const mt_generate_args *a,
                        int32_t *out, bool *eos_hit, char *err, size_t errlen);

/* As mt_generate_ids (the same sampling, stops and result), the logits from the step graph's
 * forward (mt_graph_logits) on the runtime's workers: the GPU when there are CUDA workers, the CPU
 * workers otherwise, with st's compute dtype (no task in flight; the runtime up). The graph holds
 * one sequence of mt_generate_bucket tokens, the context padded after its end, and is rebuilt
 * when the context outgrows it. With fp32 weights on CPU workers the logits are the host
 * forward's up to rounding (the tests hold them within 1e-5 relative). */
int64_t mt_generate_ids_graph(mt_host_state *st, const int32_t *prompt, int64_t n_prompt, const mt_generate_args *a,
                              int32_t *out, bool *eos_hit, char *err, size_t errlen);

/* The shortest graph mt_generate_ids_graph builds. */
#define MT_GENERATE_MIN_BUCKET 32
/* The graph length for a context of len tokens when the generation reaches cap: the smallest
 * power of two from MT_GENERATE_MIN_BUCKET holding len, at most cap; with a dynamic-NTK rope no
 * more than max(len, max_position_embeddings), whose frequencies are len's. */
int64_t mt_generate_bucket(const mt_model_config *cfg, int64_t len, int64_t cap);

/* ---- megatrain generate --------------------------------------------------------------------- */

typedef struct mt_generate_options {
    const char *model_dir;      /* HF directory: config.json + safetensors */
    const char *tokenizer_path; /* NULL: model_dir/tokenizer.json (or bytes: mt_generate_run) */
    const char *rope_scaling;   /* "TYPE:FACTOR" or NULL */
    const char *prompt;
    bool chat;                  /* render prompt as one user turn of the family's chat template, with the
                                 * assistant's turn opened (models/chat_template.h) */
    const char *family;         /* the template: qwen2, qwen3, llama3, mistral; NULL: from model_type */
    int64_t max_new_tokens;
    mt_sampling sampling;
    uint64_t seed;
    mt_runtime_options runtime; /* the workers: the forward runs on the GPU when there are CUDA workers
                                 * (ncuda -1, the default: every GPU), on the CPU workers otherwise */
    mt_dtype dtype;             /* of the streamed weights and the compute, when dtype_explicit */
    bool dtype_explicit;        /* else bf16 with CUDA workers, fp32 without */
} mt_generate_options;

mt_generate_options mt_generate_defaults(void);

typedef struct mt_generate_result {
    int64_t prompt_tokens, new_tokens;
    bool eos;                   /* stopped at an end-of-sequence id */
    int ncuda;                  /* the CUDA workers the forward ran on (0: the CPU workers) */
    mt_dtype dtype;             /* the compute dtype */
} mt_generate_result;

/* Loads the model and tokenizer, checks them and the prompt before any long work (missing files,
 * an empty prompt, a tokenizer with ids beyond the model's vocabulary, an unknown family), then
 * writes the new text to out as it comes, flushed per token (the prompt itself is not written).
 * End-of-sequence ids: config.json's and generation_config.json's eos_token_id, and with chat the
 * family's end-of-turn token. llama and mistral models get their bos_token_id in front of a
 * prompt that does not start with it (their tokenizers add it). A byte-level model (vocab_size at
 * most 256) whose directory has no tokenizer.json, such as the built-in model's, reads and
 * writes bytes as its ids. 0, or -1 with err set. */
int mt_generate_run(const mt_generate_options *o, FILE *out, mt_generate_result *res, char *err, size_t errlen);

#endif
