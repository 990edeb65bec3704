/* `megatrain prepare`: plain text or JSONL conversations (alpaca, sharegpt) become packed token
 * shards (runtime/shard.h) with a loss mask and a meta.json, which runtime/dataset.h reads back.
 * docs/data.md specifies meta.json. */
#ifndef MT_RUNTIME_PREPARE_H
#define MT_RUNTIME_PREPARE_H

#include <stdint.h>
#include <stdio.h>

#include "models/chat_template.h"

typedef enum mt_input_format { MT_INPUT_TEXT, MT_INPUT_ALPACA, MT_INPUT_SHAREGPT } mt_input_format;
typedef enum mt_text_unit { MT_TEXT_PARAGRAPH, MT_TEXT_FILE } mt_text_unit;

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

/* Packs documents (doc i = tokens[offsets[i]..offsets[i+1]) with its mask) in the given order:
 * each document then `separator` (mask separator_mask), concatenated, cut into windows of T + 1
 * tokens with stride T (the last token of a window is the first of the next); the last window is
 * padded with the separator at mask 0. Returns the number of windows; *tokens_out, *mask_out are
 * malloc'd (windows, T + 1). */
int64_t mt_dataset_pack(const int32_t *tokens, const uint8_t *mask, const int64_t *offsets, const int64_t *order,
                        int64_t ndocs, int32_t separator, uint8_t separator_mask, int64_t T,
                        int32_t **tokens_out, uint8_t **mask_out);

#endif
