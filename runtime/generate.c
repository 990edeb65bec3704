/* The forward of the host master weights through the CPU kernels (mt_host_hidden, also what
 * `megatrain grads --logits` uses), sampling over a row of logits, and text generation: byte-level
 * from the host forward for the end of a training job (mt_generate), token-level from either the
 * host forward or the step graph's (mt_generate_ids, mt_generate_ids_graph), and `megatrain
 * generate`, which takes the graph's so that it runs on the GPU when there is one. No KV cache:
 * each new token re-runs the forward over the whole context. */
#include "runtime/generate.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backends/cpu/ops.h"
#include "models/chat_template.h"
#include "models/config.h"
#include "models/tokenizer.h"
#include "runtime/hf.h"
#include "runtime/runtime.h"
#include "runtime/step.h"

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
        mt_cpu_layer_forward_aux_f32(cfg, st->tiles[1 + i].layout, master_of(st, 1 + i, &buf), i, B, T, x, y, NULL, scratch,
                                     NULL);
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

/* ---- sampling ------------------------------------------------------------------------------- */

int mt_sampler_init(mt_sampler *s, int64_t V)
{
    s->V = V;
    s->prob = malloc(sizeof *s->prob * (size_t)V);
    s->order = malloc(sizeof *s->order * (size_t)V);
    if (s->prob && s->order) return 0;
    mt_sampler_free(s);
    return -1;
}

void mt_sampler_free(mt_sampler *s)
{
    free(s->prob);
    free(s->order);
    s->prob = NULL;
    s->order = NULL;
}

/* The most probable first, the lower id first among equal ones: a total order, so the nucleus
 * does not depend on qsort's handling of ties. */
static const double *sort_prob;
static int by_prob_desc(const void *pa, const void *pb)
{
    const int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    if (sort_prob[a] != sort_prob[b]) return sort_prob[a] > sort_prob[b] ? -1 : 1;
    return a < b ? -1 : a > b;
}

int32_t mt_sample(mt_sampler *s, const float *logits, const mt_sampling *how, mt_rng *rng)
{
    const int64_t V = s->V;
    int32_t best = 0;
    for (int64_t v = 1; v < V; v++)
        if (logits[v] > logits[best]) best = (int32_t)v;
    if (how->temperature <= 0) return best;
    /* Probabilities relative to the largest logit's, so that exp never overflows. */
    const double mx = logits[best];
    double total = 0;
    for (int64_t v = 0; v < V; v++) total += s->prob[v] = exp(((double)logits[v] - mx) / how->temperature);
    int64_t keep = V;
    if (how->top_p < 1) {
        for (int64_t v = 0; v < V; v++) s->order[v] = (int32_t)v;
        sort_prob = s->prob;
        qsort(s->order, (size_t)V, sizeof *s->order, by_prob_desc);
        double acc = 0;
        for (keep = 0; keep < V;) {
            acc += s->prob[s->order[keep++]];
            if (acc >= how->top_p * total) break;
        }
        total = acc;
    }
    const double r = mt_rng_uniform(rng) * total;
    double acc = 0;
    for (int64_t k = 0; k < keep; k++) {
        const int32_t v = how->top_p < 1 ? s->order[k] : (int32_t)k;
        acc += s->prob[v];
        if (r < acc) return v;
    }
    /* Rounding left r at the very top: the last kept id with a probability. */
    for (int64_t k = keep - 1; k >= 0; k--) {
        const int32_t v = how->top_p < 1 ? s->order[k] : (int32_t)k;
        if (s->prob[v] > 0) return v;
    }
    return best;
}

/* ---- token-by-token generation -------------------------------------------------------------- */

static bool is_eos(const mt_generate_args *a, int32_t id)
{
    for (int k = 0; k < a->neos; k++)
        if (a->eos[k] == id) return true;
    return false;
}

/* The logits (V) of the last of the T ids of seq, from one of the two forwards below; 0, or -1
 * with err set. */
typedef int (*last_logits_fn)(void *user, const int32_t *seq, int64_t T, float *logits, char *err, size_t errlen);

/* The token loop of both forwards; cap: the longest sequence it reaches (what the forward's
 * buffers hold). */
static int64_t generate_loop(const mt_model_config *cfg, last_logits_fn last_logits, void *user, int64_t cap,
                             const int32_t *prompt, int64_t n_prompt, const mt_generate_args *a, int32_t *out,
                             bool *eos_hit, char *err, size_t errlen)
{
    const int64_t V = cfg->vocab;
    int32_t *seq = malloc(sizeof *seq * (size_t)cap);
    float *logits = malloc(sizeof *logits * (size_t)V);
    mt_sampler sampler = { 0 };
    int64_t n = -1;
    if (!seq || !logits || mt_sampler_init(&sampler, V)) {
        snprintf(err, errlen, "out of memory for a sequence of %lld tokens", (long long)cap);
        goto out;
    }
    mt_rng rng;
    mt_rng_seed(&rng, a->seed);
    memcpy(seq, prompt, sizeof *seq * (size_t)n_prompt);
    int64_t T = n_prompt;
    for (n = 0; n < a->max_new && T < cap; n++) {
        if (last_logits(user, seq, T, logits, err, errlen)) {
            n = -1;
            break;
        }
        const int32_t id = mt_sample(&sampler, logits, &a->sampling, &rng);
        if (is_eos(a, id)) {
            *eos_hit = true;
            break;
        }
        out[n] = seq[T++] = id;
        if (a->on_token && a->on_token(a->user, seq, T)) {
            n++;
            break;
        }
    }
out:
    free(seq); free(logits);
    mt_sampler_free(&sampler);
    return n;
}

/* The prompt's length against the model's; the longest sequence a generation reaches into *cap.
 * 0, or -1 with err set. */
static int check_prompt(const mt_model_config *cfg, int64_t n_prompt, const mt_generate_args *a, int64_t *cap,
                        char *err, size_t errlen)
{
    const int64_t longest = mt_config_max_seq_len(cfg);
    if (n_prompt < 1 || n_prompt > longest) {
        snprintf(err, errlen, "the prompt has %lld tokens; the model takes 1 to %lld", (long long)n_prompt,
                 (long long)longest);
        return -1;
    }
    *cap = n_prompt + a->max_new;
    if (*cap > longest) *cap = longest;
    return 0;
}

/* The host forward: mt_host_hidden over the whole sequence, the head on its last row. */
typedef struct host_forward {
    const mt_host_state *st;
    const float *embed, *head;  /* fp32 masters */
    float *x, *y, *scratch, *hscratch;
} host_forward;

static int host_last_logits(void *user, const int32_t *seq, int64_t T, float *logits, char *err, size_t errlen)
{
    (void)err; (void)errlen;
    host_forward *f = user;
    const mt_model_config *cfg = &f->st->cfg;
    const float *h = mt_host_hidden(f->st, 1, T, seq, f->x, f->y, f->scratch);
    mt_cpu_head_logits_f32(cfg, &f->st->layout_head, f->head, cfg->tied ? f->embed : NULL, 1, h + (T - 1) * cfg->hidden,
                           logits, f->hscratch);
    return 0;
}

int64_t mt_generate_ids(const mt_host_state *st, const int32_t *prompt, int64_t n_prompt, const mt_generate_args *a,
                        int32_t *out, bool *eos_hit, char *err, size_t errlen)
{
    const mt_model_config *cfg = &st->cfg;
    const int64_t d = cfg->hidden;
    *eos_hit = false;
    int64_t cap;
    if (check_prompt(cfg, n_prompt, a, &cap, err, errlen)) return -1;
    host_forward f = { .st = st };
    f.x = malloc(sizeof *f.x * (size_t)(cap * d));
    f.y = malloc(sizeof *f.y * (size_t)(cap * d));
    f.scratch = malloc(sizeof(float) * (size_t)mt_layer_scratch_numel(cfg, 1, cap));
    f.hscratch = malloc(sizeof(float) * (size_t)mt_head_scratch_numel(cfg, 1));
    float *embed_buf = NULL, *head_buf = NULL;
    int64_t n = -1;
    if (!f.x || !f.y || !f.scratch || !f.hscratch) {
        snprintf(err, errlen, "out of memory for a sequence of %lld tokens", (long long)cap);
        goto out;
    }
    f.embed = master_of(st, 0, &embed_buf);
    f.head = master_of(st, st->ntiles - 1, &head_buf);
    n = generate_loop(cfg, host_last_logits, &f, cap, prompt, n_prompt, a, out, eos_hit, err, errlen);
out:
    free(embed_buf); free(head_buf);
    free(f.x); free(f.y); free(f.scratch); free(f.hscratch);
    return n;
}

/* The graph's forward: a graph of one sequence of `T` tokens, rebuilt for a longer bucket when
 * the sequence outgrows it; the tokens past the sequence are padding that the causal attention
 * keeps from the last position's logits. */
typedef struct graph_forward {
    mt_host_state *st;
    mt_graph *g;
    int64_t T;          /* the graph's length; 0: no graph yet */
    int64_t cap;        /* the longest sequence of this generation */
    int32_t *tokens;    /* (cap) */
} graph_forward;

/* The graph length for a sequence of len tokens (len <= cap): the smallest power of two from
 * MT_GENERATE_MIN_BUCKET up that holds it, at most cap, so that a generation builds a few
 * graphs and never runs more than twice its length. A dynamic-NTK rope's frequencies follow the
 * length run past max_position_embeddings: there the bucket is the sequence itself (or
 * max_position_embeddings, which gives the same frequencies), as the host forward runs. */
int64_t mt_generate_bucket(const mt_model_config *cfg, int64_t len, int64_t cap)
{
    int64_t T = MT_GENERATE_MIN_BUCKET;
    while (T < len) T *= 2;
    if (T > cap) T = cap;
    if (cfg->rope_type == MT_ROPE_DYNAMIC && T > cfg->max_positions)
        T = len > cfg->max_positions ? len : cfg->max_positions;
    return T;
}

static int graph_last_logits(void *user, const int32_t *seq, int64_t T, float *logits, char *err, size_t errlen)
{
    graph_forward *f = user;
    const int64_t want = mt_generate_bucket(&f->st->cfg, T, f->cap);
    if (want != f->T) {
        if (f->g) mt_graph_destroy(f->g);
        mt_step_config sc = mt_step_defaults();
        sc.B = 1;
        sc.T = want;
        sc.K = f->st->cfg.layers < 4 ? (int)f->st->cfg.layers : 4;
        sc.clip = 0;
        sc.head_chunk = 1; /* the loss head never runs here */
        f->g = mt_graph_create(f->st, &sc, err, errlen);
        f->T = f->g ? want : 0;
        if (!f->g) return -1;
    }
    memcpy(f->tokens, seq, sizeof *seq * (size_t)T);
    /* Padding: a repeat of the last id, any id of the vocabulary would do. */
    for (int64_t t = T; t < f->T; t++) f->tokens[t] = seq[T - 1];
    const int32_t last = (int32_t)(T - 1);
    mt_graph_logits(f->g, f->tokens, &last, logits);
    return 0;
}

int64_t mt_generate_ids_graph(mt_host_state *st, const int32_t *prompt, int64_t n_prompt, const mt_generate_args *a,
                              int32_t *out, bool *eos_hit, char *err, size_t errlen)
{
    *eos_hit = false;
    graph_forward f = { .st = st };
    if (check_prompt(&st->cfg, n_prompt, a, &f.cap, err, errlen)) return -1;
    f.tokens = malloc(sizeof *f.tokens * (size_t)f.cap);
    if (!f.tokens) {
        snprintf(err, errlen, "out of memory for a sequence of %lld tokens", (long long)f.cap);
        return -1;
    }
    const int64_t n = generate_loop(&st->cfg, graph_last_logits, &f, f.cap, prompt, n_prompt, a, out, eos_hit, err,
                                    errlen);
    if (f.g) mt_graph_destroy(f.g);
    free(f.tokens);
    return n;
}

/* ---- megatrain generate --------------------------------------------------------------------- */

mt_generate_options mt_generate_defaults(void)
{
    return (mt_generate_options){
        .max_new_tokens = 128,
        .sampling = { .temperature = 0, .top_p = 1 },
        .seed = 0,
        .runtime = mt_runtime_defaults(),
        .dtype = MT_DTYPE_F32,
    };
}

/* Appends the ids of `key` in the JSON file `path` (an integer or a list of them; absent: none)
 * to ids, up to max. A missing file adds none; an unreadable one is an error naming it. */
static int read_ids(const char *path, const char *key, int32_t *ids, int *n, int max, bool must_exist, char *err,
                    size_t errlen)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        if (!must_exist) return 0;
        snprintf(err, errlen, "%s: cannot be read", path);
        return -1;
    }
    fclose(f);
    json_error_t je;
    json_t *root = json_load_file(path, 0, &je);
    if (!root) {
        snprintf(err, errlen, "%s: line %d: %s", path, je.line, je.text);
        return -1;
    }
    json_t *v = json_object_get(root, key);
    int rc = 0;
    if (json_is_integer(v) && *n < max) ids[(*n)++] = (int32_t)json_integer_value(v);
    else if (json_is_array(v)) {
        size_t i;
        json_t *e;
        json_array_foreach(v, i, e) {
            if (!json_is_integer(e)) {
                snprintf(err, errlen, "%s: key '%s': entry %zu is not an integer", path, key, i);
                rc = -1;
                break;
            }
            if (*n < max) ids[(*n)++] = (int32_t)json_integer_value(e);
        }
    } else if (v && !json_is_null(v)) {
        snprintf(err, errlen, "%s: key '%s' is neither an integer nor a list of them", path, key);
        rc = -1;
    }
    json_decref(root);
    return rc;
}

/* The chat family of a model_type (llama: Llama 3's template, the one llama chat models here use). */
static int family_of(const char *model_type, mt_chat_family *family)
{
    if (!strcmp(model_type, "qwen2")) *family = MT_CHAT_QWEN2;
    else if (!strcmp(model_type, "qwen3") || !strcmp(model_type, "qwen3_moe")) *family = MT_CHAT_QWEN3;
    else if (!strcmp(model_type, "llama")) *family = MT_CHAT_LLAMA3;
    else if (!strcmp(model_type, "mistral") || !strcmp(model_type, "mixtral")) *family = MT_CHAT_MISTRAL;
    else return -1;
    return 0;
}

/* The end-of-turn token of a family's assistant answers. */
static const char *end_of_turn(mt_chat_family family)
{
    switch (family) {
    case MT_CHAT_QWEN2:
    case MT_CHAT_QWEN3: return "<|im_end|>";
    case MT_CHAT_LLAMA3: return "<|eot_id|>";
    case MT_CHAT_MISTRAL: return "</s>";
    }
    return NULL;
}

/* What the printing callback needs: the text of the ids so far is decoded whole each time, and
 * what lies beyond the part already written is written, so that tokenizers whose decoding depends
 * on the neighbours (SentencePiece's leading space) print what decoding the whole text gives. */
typedef struct printer {
    const mt_tokenizer *tok;  /* NULL: byte ids */
    FILE *out;
    size_t written;   /* bytes of the decoded text already written or belonging to the prompt */
    bool failed;
    char err[512];
} printer;

static int print_new(void *user, const int32_t *ids, int64_t n)
{
    printer *p = user;
    if (!p->tok) {
        /* Byte ids: the new one is the next byte (ids from 256 up have no text). */
        if (ids[n - 1] < 256) fputc(ids[n - 1], p->out);
        fflush(p->out);
        return 0;
    }
    size_t len;
    char *text = mt_tokenizer_decode(p->tok, ids, (size_t)n, &len, p->err, sizeof p->err);
    if (!text) {
        p->failed = true;
        return 1;
    }
    if (len > p->written) {
        fwrite(text + p->written, 1, len - p->written, p->out);
        p->written = len;
    }
    fflush(p->out);
    free(text);
    return 0;
}

#define MAX_EOS 16

int mt_generate_run(const mt_generate_options *o, FILE *out, mt_generate_result *res, char *err, size_t errlen)
{
    memset(res, 0, sizeof *res);
    if (!o->model_dir) {
        snprintf(err, errlen, "--model DIR is needed");
        return -1;
    }
    if (!o->prompt || !o->prompt[0]) {
        snprintf(err, errlen, "--prompt: the prompt is empty; give the text to continue");
        return -1;
    }
    if (o->max_new_tokens < 1) {
        snprintf(err, errlen, "--max-new-tokens: %lld; at least 1", (long long)o->max_new_tokens);
        return -1;
    }
    if (!(o->sampling.temperature >= 0) || !(o->sampling.top_p > 0 && o->sampling.top_p <= 1)) {
        snprintf(err, errlen, "--temperature must be >= 0 and --top-p in (0, 1], got %g and %g", o->sampling.temperature,
                 o->sampling.top_p);
        return -1;
    }
    char config_path[4200], gen_path[4200], tok_default[4200];
    snprintf(config_path, sizeof config_path, "%s/config.json", o->model_dir);
    snprintf(gen_path, sizeof gen_path, "%s/generation_config.json", o->model_dir);
    snprintf(tok_default, sizeof tok_default, "%s/tokenizer.json", o->model_dir);
    const char *tok_path = o->tokenizer_path ? o->tokenizer_path : tok_default;
    mt_model_config cfg;
    if (mt_config_load(config_path, &cfg, err, errlen) ||
        (o->rope_scaling && mt_config_set_rope_scaling(&cfg, o->rope_scaling, err, errlen)))
        return -1;
    mt_chat_family family = MT_CHAT_QWEN2;
    if (o->family ? mt_chat_family_parse(o->family, &family) : family_of(cfg.model_type, &family)) {
        if (o->chat || o->family) {
            if (o->family) snprintf(err, errlen, "--family: unknown family '%s' (qwen2, qwen3, llama3, mistral)", o->family);
            else snprintf(err, errlen, "%s: model_type '%s' has no chat template here: name one with --family", config_path,
                          cfg.model_type);
            return -1;
        }
    }
    /* The end-of-sequence and beginning-of-sequence ids, before the tokenizer's long load. */
    int32_t eos[MAX_EOS], bos[1];
    int neos = 0, nbos = 0;
    if (read_ids(config_path, "eos_token_id", eos, &neos, MAX_EOS, true, err, errlen) ||
        read_ids(gen_path, "eos_token_id", eos, &neos, MAX_EOS, false, err, errlen) ||
        read_ids(config_path, "bos_token_id", bos, &nbos, 1, true, err, errlen))
        return -1;
    /* A byte-level model without a tokenizer (the built-in one's): its ids are the text's bytes. */
    const bool bytes = !o->tokenizer_path && access(tok_default, F_OK) != 0 && cfg.vocab <= 256;
    if (bytes && o->chat) {
        snprintf(err, errlen, "--chat: %s is a byte-level model without a tokenizer.json: no chat template applies",
                 o->model_dir);
        return -1;
    }
    mt_tokenizer *tok = bytes ? NULL : mt_tokenizer_load(tok_path, err, errlen);
    if (!bytes && !tok) return -1;
    int rc = -1;
    int32_t *ids = NULL, *gen = NULL;
    char *text = NULL;
    mt_host_state *st = NULL;
    bool runtime_up = false;
    if (tok && mt_tokenizer_vocab_size(tok) > cfg.vocab) {
        snprintf(err, errlen, "%s has ids up to %d but %s has vocab_size %lld: use the model's own tokenizer", tok_path,
                 mt_tokenizer_vocab_size(tok) - 1, config_path, (long long)cfg.vocab);
        goto out;
    }
    size_t len = strlen(o->prompt);
    const char *prompt_text = o->prompt;
    if (o->chat) {
        const mt_chat_message msgs[2] = { { MT_ROLE_USER, o->prompt }, { MT_ROLE_ASSISTANT, "" } };
        mt_chat_rendered r;
        if (mt_chat_render(family, msgs, 2, &r, err, errlen)) goto out;
        /* The conversation up to where the assistant's answer starts: the generation prompt.
         * Mistral's template puts a space before the answer, which its generation prompt ends
         * without ("[/INST]"): the answer's first token carries it. */
        len = r.nspans > 0 ? r.spans[0].start : r.len;
        if (family == MT_CHAT_MISTRAL && len > 0 && r.text[len - 1] == ' ') len--;
        text = malloc(len + 1);
        memcpy(text, r.text, len);
        text[len] = 0;
        mt_chat_rendered_free(&r);
        prompt_text = text;
        const int32_t eot = mt_tokenizer_token_id(tok, end_of_turn(family));
        if (eot >= 0 && neos < MAX_EOS) eos[neos++] = eot;
    }
    size_t count = len;
    int32_t *encoded;
    if (bytes) {
        encoded = malloc(sizeof *encoded * len);
        for (size_t k = 0; k < len; k++) encoded[k] = (uint8_t)prompt_text[k];
    } else {
        encoded = mt_tokenizer_encode(tok, prompt_text, len, &count, err, errlen);
        if (!encoded) goto out;
    }
    const bool add_bos = nbos == 1 && (!strcmp(cfg.model_type, "llama") || !strcmp(cfg.model_type, "mistral")) &&
                         (count == 0 || encoded[0] != bos[0]);
    const int64_t n_prompt = (int64_t)count + add_bos;
    ids = malloc(sizeof *ids * (size_t)(n_prompt + 1));
    if (add_bos) ids[0] = bos[0];
    memcpy(ids + add_bos, encoded, sizeof *ids * count);
    free(encoded);
    if (mt_config_check_seq_len(&cfg, n_prompt, err, errlen)) goto out;
    res->prompt_tokens = n_prompt;

    if (mt_runtime_init(&o->runtime, err, errlen)) goto out;
    runtime_up = true;
    res->ncuda = mt_runtime_ncuda();
    res->dtype = o->dtype_explicit ? o->dtype : res->ncuda > 0 ? MT_DTYPE_BF16 : MT_DTYPE_F32;
    st = mt_state_create(&cfg, res->dtype, 0, err, errlen);
    if (!st || mt_hf_load(o->model_dir, st, err, errlen)) goto out;

    printer p = { .tok = tok, .out = out, .written = (size_t)n_prompt };
    if (tok) {
        char *ptext = mt_tokenizer_decode(tok, ids, (size_t)n_prompt, &p.written, err, errlen);
        if (!ptext) goto out;
        free(ptext);
    }
    gen = malloc(sizeof *gen * (size_t)o->max_new_tokens);
    const mt_generate_args a = { .max_new = o->max_new_tokens, .sampling = o->sampling, .seed = o->seed, .eos = eos,
                                 .neos = neos, .on_token = out ? print_new : NULL, .user = &p };
    const int64_t n = mt_generate_ids_graph(st, ids, n_prompt, &a, gen, &res->eos, err, errlen);
    if (n < 0) goto out;
    if (p.failed) {
        snprintf(err, errlen, "%s: %s", tok_path, p.err);
        goto out;
    }
    res->new_tokens = n;
    rc = 0;
out:
    if (st) mt_state_destroy(st);
    if (runtime_up) mt_runtime_shutdown();
    if (tok) mt_tokenizer_free(tok);
    free(ids); free(gen); free(text);
    return rc;
}
