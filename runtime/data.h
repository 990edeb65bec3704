/* Training text for the built-in byte-level model: a file or a directory of text files, split
 * into training and validation bytes, sampled into (B, T) token/target batches. */
#ifndef MT_RUNTIME_DATA_H
#define MT_RUNTIME_DATA_H

#include <stddef.h>
#include <stdint.h>

typedef struct mt_corpus {
    uint8_t *train, *val;     /* bytes of each split */
    int64_t ntrain, nval;
    int nfiles;               /* files read */
} mt_corpus;

/* Reads `path` (a regular file, or every regular file of a directory in name order, skipping
 * fortune index files *.dat and symbolic links). Every `val_every`-th 4 KiB block goes to
 * validation. Both splits must hold at least min_bytes; otherwise -1 with err naming the path
 * and what is wrong (missing, unreadable, empty, too small). */
int mt_corpus_load(const char *path, int val_every, int64_t min_bytes, mt_corpus *c, char *err, size_t errlen);
void mt_corpus_free(mt_corpus *c);

/* Deterministic generator for sampling. */
typedef struct mt_rng { uint64_t state; } mt_rng;
void mt_rng_seed(mt_rng *r, uint64_t seed);
uint64_t mt_rng_next(mt_rng *r);
double mt_rng_uniform(mt_rng *r); /* [0, 1) */

/* B windows of T+1 bytes at random offsets of the training split: tokens (B, T) are bytes
 * 0..T-1 of each window, targets (B, T) bytes 1..T. */
void mt_corpus_sample(const mt_corpus *c, mt_rng *r, int64_t B, int64_t T, int32_t *tokens, int32_t *targets);

/* The first n_seq consecutive windows of the validation split (fewer if it is short); returns
 * how many were written. */
int64_t mt_corpus_validation(const mt_corpus *c, int64_t n_seq, int64_t T, int32_t *tokens, int32_t *targets);

#endif
