/* Loading a tokenizer.json, in two files: load.c reads the BPE model (vocabulary, merges, added
 * tokens) and owns mt_tokenizer_load / mt_tokenizer_free; pipeline.c reads the text pipeline
 * around it (normalizer, pre-tokenizer, SentencePiece-style decoder). Internal to
 * models/tokenizer/. Each parser returns 0, or -1 with err naming the file and the key. */
#ifndef MT_MODELS_TOKENIZER_LOAD_H
#define MT_MODELS_TOKENIZER_LOAD_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "models/tokenizer/state.h"

/* obj[key], NULL when absent or JSON null (tokenizer.json writes null for unset options). */
static inline json_t *lookup(const json_t *obj, const char *key)
{
    json_t *v = json_is_object(obj) ? json_object_get(obj, key) : NULL;
    return (v && json_is_null(v)) ? NULL : v;
}

static inline bool flag(const json_t *obj, const char *key) { return json_is_true(lookup(obj, key)); }

/* Byte-level files: the pre-tokenizer's regex splits (tok->split) and the normalizer (NFC). */
int mt_tok_parse_pre_tokenizer(mt_tokenizer *tok, const json_t *root, const char *path, char *err, size_t errlen);
int mt_tok_parse_normalizer(mt_tokenizer *tok, const json_t *root, const char *path, char *err, size_t errlen);

/* SentencePiece-style files (model.byte_fallback): the prepend, Metaspace and strip settings. */
int mt_tok_parse_spm(mt_tokenizer *tok, const json_t *root, const char *path, char *err, size_t errlen);

#endif
