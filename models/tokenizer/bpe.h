/* BPE on words: the merge loop (lowest rank first, a heap per word, as Hugging Face orders it),
 * the word cache of byte-level files, and SentencePiece-style sections (one word per section,
 * byte fallback). Internal to models/tokenizer/; uses the tokenizer's scratch, so not
 * thread-safe. */
#ifndef MT_MODELS_TOKENIZER_BPE_H
#define MT_MODELS_TOKENIZER_BPE_H

#include <stdbool.h>
#include <stddef.h>

#include "models/tokenizer/state.h"

/* One byte-level pre-token of n bytes (any bytes): its ids appended to out, from the cache, as a
 * whole token (ignore_merges) or merged. */
void mt_tok_encode_word(mt_tokenizer *tok, const char *word, size_t n, id_buf *out);

/* A SentencePiece-style section s[0..n) between added tokens, `first` when it starts the text, at
 * offset `at` of the text: its ids appended to out and, with starts, each token's start. */
void mt_tok_spm_encode(mt_tokenizer *tok, const char *s, size_t n, bool first, size_t at, id_buf *out,
                       off_buf *starts);

#endif
