/* The forward of the host master weights through the CPU kernels (mt_host_hidden, also what
 * `megatrain grads --logits` uses), and text generation with it for the end of a training
 * job. No KV cache: each new byte re-runs the forward over the last `context` bytes, which is
 * cheap for the small byte-level models this serves. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cpu/ops.h"
#include "runtime/data.h"
#include "runtime/train.h"

/* Tile i's master as fp32 (mt_state_master_f32), aborting when memory is short: the callers
 * have no error path, and a compact state's tiles are decoded one at a time. */
static const float *master_of(const mt_host_state *st, int i, float **buf)
{
    const float *w = mt_state_master_f32(st, i, buf);
    if (!w) {
        fprintf(stderr, "megatrain: out of memory decoding tile %d's master (%lld floats)\n", i,
                (long long)st->tiles[i].numel);
        abort();
    }
    return w;
}

float *mt_host_hidden(const mt_host_state *st, int64_t B, int64_t T, const int32_t *tokens, float *x, float *y,
                     float *scratch)
{
    const mt_model_config *cfg = &st->cfg;
    float *buf = NULL;
    mt_cpu_embedding_forward_f32(B * T, cfg->hidden, master_of(st, 0, &buf), tokens, x);
    for (int i = 0; i < cfg->layers; i++) {
        mt_cpu_layer_forward_f32(cfg, &st->layout_layer, master_of(st, 1 + i, &buf), B, T, x, y, NULL, scratch);
        float *tmp = x; x = y; y = tmp;
    }
    free(buf);
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
    float *embed_buf = NULL, *head_buf = NULL;
    const float *embed = master_of(st, 0, &embed_buf), *head = master_of(st, st->ntiles - 1, &head_buf);
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
    free(embed_buf); free(head_buf);
}
