/* The gradients of one batch, for comparing the whole model with an independent implementation.
 * Targets are the tokens shifted by one, as transformers' causal-LM loss computes them from
 * input_ids = the B x (T + 1) tokens and labels = input_ids. The logits come from the fp32 CPU
 * ops on the host masters, so they are the reference forward whichever workers ran the step. */
#include "runtime/grads.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "models/config.h"
#include "backends/cpu/ops.h"
#include "runtime/generate.h"
#include "runtime/hf.h"
#include "models/safetensors.h"
#include "runtime/state.h"
#include "runtime/step.h"
#include "runtime/train.h"

/* Reads exactly B * (T + 1) int32 ids; checks them against the vocabulary. */
static int32_t *read_tokens(const mt_grads_options *o, int64_t vocab, char *err, size_t errlen)
{
    const int64_t n = o->B * (o->T + 1);
    struct stat sb;
    if (stat(o->tokens_path, &sb) != 0) {
        snprintf(err, errlen, "%s: %s", o->tokens_path, strerror(errno));
        return NULL;
    }
    if ((int64_t)sb.st_size != n * 4) {
        snprintf(err, errlen, "%s: %lld bytes, expected %lld (B=%lld sequences of T+1=%lld int32 ids)", o->tokens_path,
                 (long long)sb.st_size, (long long)(n * 4), (long long)o->B, (long long)(o->T + 1));
        return NULL;
    }
    int32_t *ids = malloc(sizeof *ids * n);
    FILE *f = fopen(o->tokens_path, "rb");
    if (!f || fread(ids, 4, (size_t)n, f) != (size_t)n) {
        snprintf(err, errlen, "%s: cannot read: %s", o->tokens_path, strerror(errno));
        if (f) fclose(f);
        free(ids);
        return NULL;
    }
    fclose(f);
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= vocab) {
            snprintf(err, errlen, "%s: token %lld is %d, outside the vocabulary [0, %lld)", o->tokens_path, (long long)i,
                     ids[i], (long long)vocab);
            free(ids);
            return NULL;
        }
    return ids;
}

/* logits (B, T, V) of tok (B, T) through the fp32 CPU ops on the host masters, as generate.c does
 * for one position. No task may be writing the masters. Returns NULL when memory is short. */
static float *cpu_logits(mt_host_state *st, int64_t B, int64_t T, const int32_t *tok)
{
    const mt_model_config *cfg = &st->cfg;
    const int64_t d = cfg->hidden, V = cfg->vocab, ntok = B * T;
    float *x = malloc(sizeof *x * (size_t)(ntok * d)), *y = malloc(sizeof *y * (size_t)(ntok * d));
    float *scratch = malloc(sizeof(float) * (size_t)mt_layer_scratch_numel(cfg, B, T));
    float *head_scratch = malloc(sizeof(float) * (size_t)mt_head_scratch_numel(cfg, T));
    float *logits = malloc(sizeof *logits * (size_t)(ntok * V));
    float *embed_buf = NULL, *head_buf = NULL;
    const float *embed = x && y && scratch && head_scratch && logits ? mt_state_master_f32(st, 0, &embed_buf) : NULL;
    const float *head = embed ? mt_state_master_f32(st, st->ntiles - 1, &head_buf) : NULL;
    if (head) {
        const float *h = mt_host_hidden(st, B, T, tok, x, y, scratch);
        /* One sequence at a time keeps the head's scratch at T rows. */
        for (int64_t b = 0; b < B; b++)
            mt_cpu_head_logits_f32(cfg, &st->layout_head, head, cfg->tied ? embed : NULL, T, h + b * T * d,
                                   logits + b * T * V, head_scratch);
    } else {
        free(logits);
        logits = NULL;
    }
    free(x); free(y); free(scratch); free(head_scratch); free(embed_buf); free(head_buf);
    return logits;
}

int mt_grads_run(const mt_grads_options *o, double *loss, char *err, size_t errlen)
{
    char cfg_path[4096];
    snprintf(cfg_path, sizeof cfg_path, "%s/config.json", o->model_dir);
    mt_model_config cfg;
    if (mt_config_load(cfg_path, &cfg, err, errlen) ||
        (o->rope_scaling && mt_config_set_rope_scaling(&cfg, o->rope_scaling, err, errlen)) ||
        mt_config_check_seq_len(&cfg, o->T, err, errlen))
        return -1;
    cfg.mlp_chunk = o->mlp_chunk > 0 ? o->mlp_chunk : 0; /* auto: no plan here, all at once */
    int32_t *ids = read_tokens(o, cfg.vocab, err, errlen);
    if (!ids) return -1;
    const int64_t ntok = o->B * o->T;
    int32_t *tok = malloc(sizeof *tok * ntok), *tgt = malloc(sizeof *tgt * ntok);
    for (int64_t b = 0; b < o->B; b++)
        for (int64_t t = 0; t < o->T; t++) {
            tok[b * o->T + t] = ids[b * (o->T + 1) + t];
            tgt[b * o->T + t] = ids[b * (o->T + 1) + t + 1];
        }
    free(ids);
    if (mt_runtime_init(&o->runtime, err, errlen)) {
        free(tok);
        free(tgt);
        return -1;
    }
    int rc = -1;
    mt_graph *g = NULL;
    mt_st_source *src = NULL;
    float *logits = NULL, **grads = NULL;
    const mt_dtype dtype = o->dtype_explicit ? o->dtype : mt_runtime_ncuda() > 0 ? MT_DTYPE_BF16 : MT_DTYPE_F32;
    mt_host_state *st = mt_state_create(&cfg, dtype, 0, err, errlen);
    if (!st || mt_hf_load(o->model_dir, st, err, errlen)) goto out;
    if (o->save_model_dir && mt_hf_save(o->save_model_dir, st, MT_DTYPE_F32, MT_HF_DEFAULT_SHARD_BYTES, err, errlen))
        goto out;
    mt_step_config sc = mt_step_defaults();
    sc.B = o->B;
    sc.T = o->T;
    sc.K = o->K < 1 ? 1 : o->K > cfg.layers ? (int)cfg.layers : o->K;
    sc.clip = 0;
    g = mt_graph_create(st, &sc, err, errlen);
    if (!g) goto out;
    int slot = mt_graph_submit_compute(g, 1, tok, tgt);
    *loss = mt_graph_wait_loss(g, slot, NULL);
    starpu_task_wait_for_all();
    if (o->logits) {
        logits = cpu_logits(st, o->B, o->T, tok);
        if (!logits) {
            snprintf(err, errlen, "%s: out of memory for the logits (%lld x %lld x %lld fp32)", o->out_path,
                     (long long)o->B, (long long)o->T, (long long)cfg.vocab);
            goto out;
        }
    }

    /* "loss" first, then the logits, then every parameter's gradient under its HF name. */
    int cap = 2 + st->ntiles * MT_MAX_TILE_TENSORS, n = 0;
    src = calloc(cap, sizeof *src);
    char (*names)[256] = calloc(cap, sizeof *names);
    float loss32 = (float)*loss;
    src[n++] = (mt_st_source){ .name = "loss", .ndim = 1, .shape = { 1 }, .data = &loss32 };
    if (logits) src[n++] = (mt_st_source){ .name = "logits", .ndim = 3, .shape = { o->B, o->T, cfg.vocab }, .data = logits };
    /* The gradients as fp32, whatever the layout holds them as (mt_state_read_grad). */
    grads = calloc(st->ntiles, sizeof *grads);
    for (int i = 0; i < st->ntiles; i++) {
        mt_tile *t = &st->tiles[i];
        if (!grads || !(grads[i] = malloc(sizeof(float) * (size_t)t->numel))) {
            snprintf(err, errlen, "%s: out of memory for the gradients", o->out_path);
            free(names);
            goto out;
        }
        starpu_data_acquire(t->h_grad, STARPU_R);
        mt_state_read_grad(st, i, 0, t->numel, grads[i]);
        starpu_data_release(t->h_grad);
        for (int k = 0; k < t->layout->ntensors; k++) {
            const mt_tensor_desc *d = &t->layout->tensors[k];
            if (d->numel == 0) continue;
            mt_layout_full_name(t->layout, i - 1, k, names[n], sizeof names[n]);
            src[n] = (mt_st_source){ .name = names[n], .ndim = d->ndim, .data = grads[i] + d->offset };
            for (int a = 0; a < d->ndim; a++) src[n].shape[a] = d->shape[a];
            n++;
        }
    }
    rc = mt_st_write(o->out_path, src, n, MT_ST_F32, err, errlen);
    free(names);
out:
    for (int i = 0; grads && i < st->ntiles; i++) free(grads[i]);
    free(grads);
    free(src);
    free(logits);
    free(tok);
    free(tgt);
    mt_graph_destroy(g);
    mt_state_destroy(st);
    mt_runtime_shutdown();
    return rc;
}
