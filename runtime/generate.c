/* The forward of the host master weights through the CPU kernels (mt_host_hidden, also what
 * `megatrain grads --logits` uses), and text generation with it for the end of a training
 * job. No KV cache: each new byte re-runs the forward over the last `context` bytes, which is
 * cheap for the small byte-level models this serves. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cpu/ops.h"
#include "runtime/data.h"
#include "runtime/train.h"

float *mt_host_hidden(const mt_host_state *st, int64_t B, int64_t T, const int32_t *tokens, float *x, float *y,
                     float *scratch)
{
    const mt_model_config *cfg = &st->cfg;
    mt_cpu_embedding_forward_f32(B * T, cfg->hidden, mt_state_embed((mt_host_state *)st)->master, tokens, x);
    for (int i = 0; i < cfg->layers; i++) {
        mt_cpu_layer_forward_f32(cfg, &st->layout_layer, st->tiles[1 + i].master, B, T, x, y, NULL, scratch);
        float *tmp = x; x = y; y = tmp;
    }
    return x;
}

void mt_generate(const mt_host_state *st, const char *prompt, int64_t n, int64_t context,
                 double temperature, uint64_t seed, char *out)
{
    const mt_model_config *cfg = &st->cfg;
    const int64_t d = cfg->hidden, V = cfg->vocab;
    size_t plen = strlen(prompt);
    memcpy(out, prompt, plen);
    int64_t len = (int64_t)plen;
    const int64_t longest = mt_config_max_seq_len(cfg);
    if (context > longest) context = longest;
    int32_t *tokens = malloc(sizeof *tokens * context);
    float *x = malloc(sizeof *x * context * d), *y = malloc(sizeof *y * context * d);
    float *scratch = malloc(sizeof(float) * mt_layer_scratch_numel(cfg, 1, context));
    float *hscratch = malloc(sizeof(float) * mt_head_scratch_numel(cfg, 1));
    float *logits = malloc(sizeof *logits * V);
    const float *embed = mt_state_embed((mt_host_state *)st)->master;
    const float *head = mt_state_head((mt_host_state *)st)->master;
    mt_rng rng;
    mt_rng_seed(&rng, seed);
    for (int64_t k = 0; k < n; k++) {
        int64_t T = len < context ? len : context;
        if (T == 0) { tokens[0] = '\n'; T = 1; }
        else for (int64_t t = 0; t < T; t++) tokens[t] = (uint8_t)out[len - T + t];
        const float *h = mt_host_hidden(st, 1, T, tokens, x, y, scratch);
        mt_cpu_head_logits_f32(cfg, &st->layout_head, head, cfg->tied ? embed : NULL, 1, h + (T - 1) * d, logits, hscratch);
        /* Sample among byte values only: a byte-level model's text is bytes. */
        int64_t nv = V < 256 ? V : 256;
        double mx = -INFINITY;
        for (int64_t v = 0; v < nv; v++) mx = fmax(mx, logits[v]);
        double total = 0;
        for (int64_t v = 0; v < nv; v++) total += exp((logits[v] - mx) / temperature);
        double r = mt_rng_uniform(&rng) * total, acc = 0;
        int64_t pick = nv - 1;
        for (int64_t v = 0; v < nv; v++) {
            acc += exp((logits[v] - mx) / temperature);
            if (acc >= r) { pick = v; break; }
        }
        out[len++] = (char)pick;
    }
    out[len] = 0;
    free(tokens); free(x); free(y); free(scratch); free(hscratch); free(logits);
}
