/* `megatrain prepare`: plain text or JSONL conversations (alpaca, sharegpt) become packed token
 * shards (runtime/shard.h) with a loss mask and a meta.json, which runtime/dataset.h reads back.
 * docs/data.md specifies meta.json. */
#ifndef MT_RUNTIME_PREPARE_H
#define MT_RUNTIME_PREPARE_H

#include <stdint.h>
#include <stdio.h>

#include "models/chat_template.h"
#include "models/tokenizer.h"

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
 * and line for bad input (JSONL syntax, a missing key, a wrong type, a bad conversation). The
 * output's place is tried (output_dir.tmp created) before the tokenizer is read, so an output
 * that cannot be written fails at once. A UTF-8 byte order mark at the start of an input file is
 * skipped. */
int mt_prepare(const mt_prepare_options *o, mt_prepare_result *res, FILE *log, char *err, size_t errlen);

/* Called for each record of a chat JSONL buffer: the rendered conversation, its line number and
 * the bytes of the buffer read so far. Returns 0, or -1 with err set to stop the reading. */
typedef int (*mt_prepare_record_fn)(void *arg, const mt_chat_rendered *r, int64_t line, size_t done, char *err,
                                    size_t errlen);

/* The reading of a chat JSONL file without the tokenising and the writing (what `prepare` does
 * with each file of format alpaca or sharegpt): buf[0..len) one JSON object per line, blank lines
 * skipped, a UTF-8 byte order mark skipped at the start (elsewhere it is an error naming it), each
 * record rendered with the family's template and handed to fn. -1 with err naming path:LINE and
 * the problem (JSON syntax, a missing key, a wrong type, a conversation the template refuses). */
int mt_prepare_read_chat(mt_input_format format, mt_chat_family family, const char *path, const char *buf, size_t len,
                         mt_prepare_record_fn fn, void *arg, char *err, size_t errlen);

/* The tokens of text[0..len) (malloc'd *ids, *count of them) and each one's loss mask (malloc'd
 * *mask): 1 when the text the token covers (mt_tokenizer_encode_offsets) overlaps one of the
 * sorted, disjoint spans, as HF's assistant masks map character spans to tokens; every token 1
 * when spans is NULL. -1 with err when the tokenizer fails (mt_tokenizer_encode). */
int mt_prepare_tokenize(mt_tokenizer *tok, const char *text, size_t len, const mt_chat_span *spans, int nspans,
                        int32_t **ids, uint8_t **mask, size_t *count, char *err, size_t errlen);

/* Packs documents (doc i = tokens[offsets[i]..offsets[i+1]) with its mask) in the given order:
 * each document then `separator` (mask separator_mask), concatenated, cut into windows of T + 1
 * tokens with stride T (the last token of a window is the first of the next); the last window is
 * padded with the separator at mask 0. Returns the number of windows; *tokens_out, *mask_out are
 * malloc'd (windows, T + 1). */
int64_t mt_dataset_pack(const int32_t *tokens, const uint8_t *mask, const int64_t *offsets, const int64_t *order,
                        int64_t ndocs, int32_t separator, uint8_t separator_mask, int64_t T,
                        int32_t **tokens_out, uint8_t **mask_out);

#endif
