/* Prepared token data for SFT and pre-training: `megatrain prepare` turns plain text or JSONL
 * conversations (alpaca, sharegpt) into packed token shards with a loss mask; the trainer reads
 * them back in windows. docs/data.md specifies the shard format and meta.json. */
#ifndef MT_RUNTIME_DATASET_H
#define MT_RUNTIME_DATASET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "models/chat_template.h"
#include "runtime/data.h"

typedef enum mt_input_format { MT_INPUT_TEXT, MT_INPUT_ALPACA, MT_INPUT_SHAREGPT } mt_input_format;
typedef enum mt_text_unit { MT_TEXT_PARAGRAPH, MT_TEXT_FILE } mt_text_unit;

/* ---- shards ------------------------------------------------------------------------------- */

#define MT_SHARD_MAGIC "MTSHARDS"
#define MT_SHARD_VERSION 1
#define MT_SHARD_HEADER_BYTES 64
#define MT_SHARD_DTYPE_INT32 1
#define MT_SHARD_DTYPE_UINT8 2

/* Writes one shard: the 64-byte header, then tokens (n_seq, seq_len + 1) int32 little-endian,
 * then mask (n_seq, seq_len + 1) uint8. Flushed and fsync'd. -1 with err naming the path. */
int mt_shard_write(const char *path, int64_t seq_len, int64_t n_seq, const int32_t *tokens, const uint8_t *mask,
                   char *err, size_t errlen);

/* Reads a shard, checking magic, version, dtypes, size and checksum; *tokens and *mask are
 * malloc'd (free them). -1 with err naming the path and what is wrong. */
int mt_shard_read(const char *path, int64_t *seq_len, int64_t *n_seq, int32_t **tokens, uint8_t **mask,
                  char *err, size_t errlen);

/* ---- preparation -------------------------------------------------------------------------- */

typedef struct mt_prepare_options {
    const char *tokenizer_path;  /* tokenizer.json */
    const char *input_path;      /* a file, or a directory whose regular files are read in name order */
    const char *output_dir;      /* must not exist; written as output_dir.tmp, then renamed */
    mt_input_format format;
    mt_chat_family family;
    mt_text_unit text_unit;      /* plain text: a document is a paragraph (default) or a file */
    int64_t seq_len;             /* T: windows hold T + 1 tokens */
    double val_fraction;         /* of the documents, after shuffling */
    uint64_t seed;               /* document shuffle */
    int64_t shard_sequences;     /* windows per shard file; 0 = about 256 MiB of tokens */
} mt_prepare_options;

mt_prepare_options mt_prepare_defaults(void);

typedef struct mt_prepare_result {
    int64_t documents[2], sequences[2], tokens[2], trained[2];  /* [0] train, [1] validation */
} mt_prepare_result;

/* Runs the preparation. Progress lines go to log (NULL: silent). -1 with err naming the file
 * and line for bad input (JSONL syntax, a missing key, a wrong type, a bad conversation). */
int mt_prepare(const mt_prepare_options *o, mt_prepare_result *res, FILE *log, char *err, size_t errlen);

/* The document order of a split: a seeded Fisher-Yates permutation of 0..ndocs-1; the first
 * *nval entries are the validation documents (round(val_fraction * ndocs), at least 1 when
 * val_fraction > 0, at most ndocs - 1). order holds ndocs entries. */
void mt_dataset_split_order(int64_t ndocs, double val_fraction, uint64_t seed, int64_t *order, int64_t *nval);

/* Packs documents (doc i = tokens[offsets[i]..offsets[i+1]) with its mask) in the given order:
 * each document then `separator` (mask separator_mask), concatenated, cut into windows of T + 1
 * tokens with stride T (the last token of a window is the first of the next); the last window is
 * padded with the separator at mask 0. Returns the number of windows; *tokens_out, *mask_out are
 * malloc'd (windows, T + 1). */
int64_t mt_dataset_pack(const int32_t *tokens, const uint8_t *mask, const int64_t *offsets, const int64_t *order,
                        int64_t ndocs, int32_t separator, uint8_t separator_mask, int64_t T,
                        int32_t **tokens_out, uint8_t **mask_out);

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
