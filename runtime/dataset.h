/* Prepared token data as the trainer reads it: a directory `megatrain prepare` wrote
 * (runtime/prepare.h: meta.json and the shards of runtime/shard.h) read back in windows, and a
 * run's training data, which is such a directory or a plain text corpus (runtime/data.h). */
#ifndef MT_RUNTIME_DATASET_H
#define MT_RUNTIME_DATASET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "runtime/data.h"

/* The document order of a split: a seeded Fisher-Yates permutation of 0..ndocs-1; the first
 * *nval entries are the validation documents (round(val_fraction * ndocs), at least 1 when
 * val_fraction > 0, at most ndocs - 1). order holds ndocs entries. */
void mt_dataset_split_order(int64_t ndocs, double val_fraction, uint64_t seed, int64_t *order, int64_t *nval);

/* ---- reading ------------------------------------------------------------------------------ */

typedef struct mt_dataset_split {
    int64_t n_seq;
    int32_t *tokens;             /* (n_seq, seq_len + 1) */
    uint8_t *mask;               /* (n_seq, seq_len + 1): 1 = the token is a counted target */
} mt_dataset_split;

typedef struct mt_dataset {
    char dir[1024];
    char tokenizer[1024];        /* the tokenizer path recorded by prepare */
    char family[16];
    int64_t seq_len;
    int64_t vocab_size;          /* the tokenizer's: every id is below it */
    mt_dataset_split train, val;
    int64_t *perm;               /* cached permutation of the training windows for perm_epoch */
    int64_t perm_epoch;
    uint64_t perm_seed;
} mt_dataset;

/* True if dir holds a meta.json (a prepared directory). */
bool mt_dataset_is_prepared(const char *dir);

/* The seq_len in dir/meta.json (the trainer's default --seq-len for the directory). */
int mt_dataset_seq_len(const char *dir, int64_t *seq_len, char *err, size_t errlen);

/* Loads meta.json and every shard. -1 with err naming the file and the problem. */
int mt_dataset_open(const char *dir, mt_dataset *d, char *err, size_t errlen);
void mt_dataset_close(mt_dataset *d);

/* ---- a run's training data ---------------------------------------------------------------- */

/* What train and bench read: a prepared directory (mt_dataset_is_prepared), or else a text
 * corpus read as bytes (mt_corpus, every 10th 4 KiB block held out for validation). */
typedef struct mt_run_data {
    bool prepared;
    mt_corpus corpus;      /* text */
    mt_dataset dataset;    /* prepared */
} mt_run_data;

/* Opens path for a model of `vocab` ids (`model` in messages) trained on T-token windows: a
 * prepared directory must suit it (its ids below vocab, its seq_len T); a text corpus needs
 * min_text_bytes in each split. -1 with err naming the file and the problem, nothing left open. */
int mt_run_data_open(mt_run_data *d, const char *path, int64_t vocab, int64_t T, int64_t min_text_bytes,
                     const char *model, char *err, size_t errlen);

/* n windows of T tokens: prepared, windows first .. first + n - 1 of the training stream
 * (mt_dataset_batch with shuffle and seed); text, n at offsets drawn from rng (mt_corpus_sample). */
void mt_run_data_batch(mt_run_data *d, bool shuffle, uint64_t seed, int64_t first, mt_rng *rng, int64_t n, int64_t T,
                       int32_t *tokens, int32_t *targets);

/* Safe on a zeroed or closed one. */
void mt_run_data_close(mt_run_data *d);

/* Window `index` of a split as tokens (T) = window[0..T-1] and targets (T) = window[1..T], with
 * target -1 where the mask of that position is 0. */
void mt_dataset_window(const mt_dataset *d, const mt_dataset_split *s, int64_t index, int32_t *tokens, int32_t *targets);

/* Windows k = first .. first + n - 1 of the endless training stream: epoch k / n_seq visits the
 * training windows in order (shuffle false) or in a permutation seeded by (seed, epoch). A pure
 * function of its arguments (the permutation is cached in d), so a resumed run reads what the
 * original would have. */
void mt_dataset_batch(mt_dataset *d, bool shuffle, uint64_t seed, int64_t first, int64_t n,
                      int32_t *tokens, int32_t *targets);

#endif
