/* The prepared-data reader: meta.json and the shards `megatrain prepare` wrote, the windows of
 * each split, and a run's training data (a prepared directory or a text corpus). */
#include "runtime/dataset.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "models/util.h"
#include "runtime/shard.h"

/* ---- split order -------------------------------------------------------------------------- */

void mt_dataset_split_order(int64_t ndocs, double val_fraction, uint64_t seed, int64_t *order, int64_t *nval)
{
    for (int64_t i = 0; i < ndocs; i++) order[i] = i;
    mt_rng r;
    mt_rng_seed(&r, seed);
    for (int64_t i = ndocs - 1; i > 0; i--) {
        int64_t j = (int64_t)(mt_rng_next(&r) % (uint64_t)(i + 1));
        int64_t t = order[i]; order[i] = order[j]; order[j] = t;
    }
    int64_t v = (int64_t)(val_fraction * (double)ndocs + 0.5);
    if (val_fraction > 0 && v < 1) v = 1;
    if (v > ndocs - 1) v = ndocs - 1;
    if (v < 0) v = 0;
    *nval = v;
}

/* ---- reading ------------------------------------------------------------------------------ */

bool mt_dataset_is_prepared(const char *dir)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/meta.json", dir);
    return access(path, F_OK) == 0;
}

int mt_dataset_seq_len(const char *dir, int64_t *seq_len, char *err, size_t errlen)
{
    char mpath[4200];
    snprintf(mpath, sizeof mpath, "%s/meta.json", dir);
    json_error_t je;
    json_t *meta = json_load_file(mpath, 0, &je);
    if (!meta) { snprintf(err, errlen, "%s:%d: %s", mpath, je.line, je.text); return -1; }
    json_t *T = json_object_get(meta, "seq_len");
    int rc = json_is_integer(T) && json_integer_value(T) >= 1 ? 0 : -1;
    if (rc) snprintf(err, errlen, "%s: key 'seq_len' must be a positive integer", mpath);
    else *seq_len = json_integer_value(T);
    json_decref(meta);
    return rc;
}

/* Loads the shards a split's meta lists, appending them. */
static int load_split(mt_dataset *d, json_t *meta, const char *name, mt_dataset_split *s, const char *mpath,
                      char *err, size_t errlen)
{
    json_t *sj = json_object_get(meta, name), *shards = sj ? json_object_get(sj, "shards") : NULL;
    if (!json_is_array(shards)) { snprintf(err, errlen, "%s: key '%s.shards' is missing or not an array", mpath, name); return -1; }
    for (size_t i = 0; i < json_array_size(shards); i++) {
        json_t *f = json_array_get(shards, i);
        if (!json_is_string(f) || strchr(json_string_value(f), '/')) {
            snprintf(err, errlen, "%s: %s.shards[%zu] must be a file name", mpath, name, i);
            return -1;
        }
        char path[4200];
        snprintf(path, sizeof path, "%s/%s", d->dir, json_string_value(f));
        int64_t T, n;
        int32_t *tok;
        uint8_t *mask;
        if (mt_shard_read(path, &T, &n, &tok, &mask, err, errlen)) return -1;
        if (T != d->seq_len) {
            snprintf(err, errlen, "%s: seq_len %lld, but meta.json says %lld", path, (long long)T, (long long)d->seq_len);
            free(tok); free(mask);
            return -1;
        }
        for (int64_t k = 0; k < n * (T + 1); k++)
            if (tok[k] < 0 || tok[k] >= d->vocab_size) {
                snprintf(err, errlen, "%s: token %d at %lld is outside the tokenizer's vocabulary (%lld)", path, tok[k],
                         (long long)k, (long long)d->vocab_size);
                free(tok); free(mask);
                return -1;
            }
        size_t w = (size_t)(T + 1);
        s->tokens = mt_xrealloc(s->tokens, sizeof *s->tokens * (s->n_seq + n) * w);
        s->mask = mt_xrealloc(s->mask, (s->n_seq + n) * w);
        memcpy(s->tokens + s->n_seq * w, tok, sizeof *tok * n * w);
        memcpy(s->mask + s->n_seq * w, mask, n * w);
        s->n_seq += n;
        free(tok); free(mask);
    }
    return 0;
}

int mt_dataset_open(const char *dir, mt_dataset *d, char *err, size_t errlen)
{
    memset(d, 0, sizeof *d);
    d->perm_epoch = -1;
    snprintf(d->dir, sizeof d->dir, "%s", dir);
    char mpath[4200];
    snprintf(mpath, sizeof mpath, "%s/meta.json", dir);
    json_error_t je;
    json_t *meta = json_load_file(mpath, 0, &je);
    if (!meta) { snprintf(err, errlen, "%s:%d: %s", mpath, je.line, je.text); return -1; }
    int rc = -1;
    json_t *version = json_object_get(meta, "version"), *T = json_object_get(meta, "seq_len");
    json_t *tj = json_object_get(meta, "tokenizer"), *family = json_object_get(meta, "family");
    json_t *vocab = tj ? json_object_get(tj, "vocab_size") : NULL, *tpath = tj ? json_object_get(tj, "path") : NULL;
    if (!json_is_integer(version) || json_integer_value(version) != MT_SHARD_VERSION) {
        snprintf(err, errlen, "%s: key 'version' must be %d (prepare the data again with this build)", mpath, MT_SHARD_VERSION);
        goto out;
    }
    if (!json_is_integer(T) || json_integer_value(T) < 1 || !json_is_integer(vocab) || json_integer_value(vocab) < 1 ||
        !json_is_string(tpath) || !json_is_string(family)) {
        snprintf(err, errlen, "%s: needs integer 'seq_len' and 'tokenizer.vocab_size', string 'tokenizer.path' and 'family'", mpath);
        goto out;
    }
    d->seq_len = json_integer_value(T);
    d->vocab_size = json_integer_value(vocab);
    snprintf(d->tokenizer, sizeof d->tokenizer, "%s", json_string_value(tpath));
    snprintf(d->family, sizeof d->family, "%s", json_string_value(family));
    if (load_split(d, meta, "train", &d->train, mpath, err, errlen) || load_split(d, meta, "val", &d->val, mpath, err, errlen)) goto out;
    if (d->train.n_seq == 0) { snprintf(err, errlen, "%s: no training windows", dir); goto out; }
    rc = 0;
out:
    json_decref(meta);
    if (rc) mt_dataset_close(d);
    return rc;
}

/* Whether a model of `vocab` ids (named `model` in the message) trained on --seq-len T can use d:
 * -1 with err naming both when the tokenizer's ids do not fit or the seq_len differs. */
static int check_run(const mt_dataset *d, int64_t vocab, int64_t T, const char *model, char *err, size_t errlen)
{
    if (vocab < d->vocab_size) {
        snprintf(err, errlen, "%s: vocab_size %lld does not cover the tokenizer of %s (%s, %lld ids): use the model "
                 "the data was prepared for", model, (long long)vocab, d->dir, d->tokenizer, (long long)d->vocab_size);
        return -1;
    }
    if (T != d->seq_len) {
        snprintf(err, errlen, "%s was prepared with seq_len %lld, the run has --seq-len %lld: they must agree", d->dir,
                 (long long)d->seq_len, (long long)T);
        return -1;
    }
    return 0;
}

int mt_run_data_open(mt_run_data *d, const char *path, int64_t vocab, int64_t T, int64_t min_text_bytes,
                     const char *model, char *err, size_t errlen)
{
    memset(d, 0, sizeof *d);
    d->prepared = mt_dataset_is_prepared(path);
    if (!d->prepared) return mt_corpus_load(path, 10, min_text_bytes, &d->corpus, err, errlen);
    if (mt_dataset_open(path, &d->dataset, err, errlen)) return -1;
    if (check_run(&d->dataset, vocab, T, model, err, errlen)) {
        mt_dataset_close(&d->dataset);
        return -1;
    }
    return 0;
}

void mt_run_data_batch(mt_run_data *d, bool shuffle, uint64_t seed, int64_t first, mt_rng *rng, int64_t n, int64_t T,
                       int32_t *tokens, int32_t *targets)
{
    if (d->prepared) mt_dataset_batch(&d->dataset, shuffle, seed, first, n, tokens, targets);
    else mt_corpus_sample(&d->corpus, rng, n, T, tokens, targets);
}

void mt_run_data_close(mt_run_data *d)
{
    if (d->prepared) mt_dataset_close(&d->dataset);
    else mt_corpus_free(&d->corpus);
}

void mt_dataset_close(mt_dataset *d)
{
    free(d->train.tokens); free(d->train.mask);
    free(d->val.tokens); free(d->val.mask);
    free(d->perm);
    memset(d, 0, sizeof *d);
}

void mt_dataset_window(const mt_dataset *d, const mt_dataset_split *s, int64_t index, int32_t *tokens, int32_t *targets)
{
    const int64_t T = d->seq_len;
    const int32_t *w = s->tokens + index * (T + 1);
    const uint8_t *m = s->mask + index * (T + 1);
    for (int64_t t = 0; t < T; t++) {
        tokens[t] = w[t];
        targets[t] = m[t + 1] ? w[t + 1] : -1;
    }
}

void mt_dataset_batch(mt_dataset *d, bool shuffle, uint64_t seed, int64_t first, int64_t n, int32_t *tokens, int32_t *targets)
{
    const int64_t N = d->train.n_seq, T = d->seq_len;
    for (int64_t i = 0; i < n; i++) {
        int64_t k = first + i, epoch = k / N, index = k % N;
        if (shuffle) {
            if (!d->perm || d->perm_epoch != epoch || d->perm_seed != seed) {
                if (!d->perm) d->perm = mt_xmalloc(sizeof *d->perm * N);
                int64_t nval;
                mt_dataset_split_order(N, 0, seed ^ (0x9e3779b97f4a7c15ULL * (uint64_t)(epoch + 1)), d->perm, &nval);
                d->perm_epoch = epoch;
                d->perm_seed = seed;
            }
            index = d->perm[index];
        }
        mt_dataset_window(d, &d->train, index, tokens + i * T, targets + i * T);
    }
}
