/* Shared by the mixture-of-experts suites (test_moe_model.c, test_moe_ops.c, test_moe_layer.c):
 * gradients against five-point central differences in double, random tiles, and configs parsed
 * from JSON text that must be accepted or refused. */
#ifndef MT_TESTS_MOE_UTIL_H
#define MT_TESTS_MOE_UTIL_H

#include <stdint.h>

#include "models/config.h"
#include "models/layout.h"
#include "tests/testutil.h"

/* A base tiny qwen3_moe config followed by extra keys. */
#define QWEN3_MOE_BASE                                                                                  \
    "{\"model_type\": \"qwen3_moe\", \"hidden_size\": 20, \"intermediate_size\": 27, \"num_hidden_layers\": 6," \
    " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 6, \"vocab_size\": 29,"    \
    " \"num_experts\": 5, \"num_experts_per_tok\": 2, \"moe_intermediate_size\": 7"
#define MIXTRAL_BASE                                                                                    \
    "{\"model_type\": \"mixtral\", \"hidden_size\": 20, \"intermediate_size\": 9, \"num_hidden_layers\": 2," \
    " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 6, \"vocab_size\": 29,"    \
    " \"num_local_experts\": 4"
/* gpt_oss: windows of 3 keys on the even layers, sinks, biases everywhere (gpt_oss_clamping sets
 * its clamp to GPT_OSS_TEST_LIMIT). */
#define GPT_OSS_TINY_BASE                                                                               \
    "{\"model_type\": \"gpt_oss\", \"hidden_size\": 20, \"intermediate_size\": 7, \"num_hidden_layers\": 3," \
    " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 6, \"vocab_size\": 29,"    \
    " \"num_local_experts\": 5, \"num_experts_per_tok\": 2, \"sliding_window\": 3"
/* The clamped SwiGLU's limit in the gpt_oss tests: low enough that some of the random gates and
 * ups reach it (a config's swiglu_limit must be transformers' 7.0, which they never reach). */
#define GPT_OSS_TEST_LIMIT 1.1


/* sum over i of w[i] * y[i]: the objective whose gradient in y is w. */
double weighted_sum(const double *w, const double *y, int64_t n);

/* The finite-difference gradient of f over x (n), perturbing x in place, against analytic, to a
 * relative error of 1e-6. A zero gradient must be exactly zero on both sides (an expert no token
 * chose). */
void check_grad(const char *what, double (*f)(void *), void *ctx, double *x, int64_t n, const double *analytic);

/* Random tile: norm weights near 1, everything else N(0, scale). */
void fill_tile(mt_test_rng *rng, const mt_tile_layout *lay, double *tile, double scale);

/* Checks every present tensor of a tile against finite differences. */
void check_tile_grads(const char *what, double (*f)(void *), void *ctx, const mt_tile_layout *lay, double *tile,
                      const double *dtile);

/* The config of the JSON text, which must be accepted. */
mt_model_config parse_ok(const char *json, const char *name);

/* The message of a config that must be refused contains name and every one of the fragments
 * (want2 may be NULL). */
void parse_fails(const char *json, const char *name, const char *want1, const char *want2);

/* The smallest gap, over rows of probs (n, E), between the k-th and the (k+1)-th probability:
 * finite differences are only meaningful while no perturbation can change the choice. */
double topk_gap(const double *probs, int64_t n, int64_t E, int64_t k);

/* QWEN3_MOE_BASE or MIXTRAL_BASE closed after the extra keys (", \"key\": value" pairs). */
mt_model_config moe_config(const char *base, const char *extra);
/* GPT_OSS_TINY_BASE closed after the extra keys, its clamp at GPT_OSS_TEST_LIMIT. */
mt_model_config gpt_oss_clamping(const char *extra);

/* Every field of the two configs is the same (the run's override is not the model's). */
void assert_same_config(const mt_model_config *a, const mt_model_config *b);

/* StarPU on two CPU workers, no GPU: the checked fixture of the suites that run tasks. */
void moe_runtime_up(void);
void moe_runtime_down(void);

/* A tensor an HF file must hold (rows 0: it must not hold it). */
typedef struct hf_tensor {
    const char *name;
    int64_t rows, cols;
} hf_tensor;

/* A random fp32 model of cfg saved as an HF directory holds one tensor per present slot of every
 * tile, each of `want` (ended by a NULL name) with its shape or, rows 0, not at all; its config
 * loads back as cfg and its weights into a fresh state bit for bit. StarPU must run. */
void check_hf_roundtrip(const mt_model_config *cfg, uint64_t seed, const hf_tensor *want);

#endif
