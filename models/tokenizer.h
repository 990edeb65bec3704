/* Byte-level BPE tokenizer read from a Hugging Face tokenizer.json (Qwen2/Qwen3, Llama-3, GPT-2
 * style): added tokens split out literally, PCRE2 regex pre-tokenisation, GPT-2 byte-to-unicode
 * mapping, rank-ordered merges. Owns the vocabulary, the merge table and a per-word cache. */
#ifndef MT_MODELS_TOKENIZER_H
#define MT_MODELS_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

typedef struct mt_tokenizer mt_tokenizer;

/* Loads path (a tokenizer.json). NULL on error, with a message naming the file and the key.
 * Accepted: model.type "BPE" with vocab and merges ("a b" strings or [a, b] pairs), a
 * pre_tokenizer that is ByteLevel (GPT-2 regex) or a Sequence of Split(Regex, Isolated) steps and a
 * ByteLevel(use_regex false), added_tokens without lstrip/rstrip/single_word, and normalizer null
 * or NFC (applied to the text between added tokens, with utf8proc). */
mt_tokenizer *mt_tokenizer_load(const char *path, char *err, size_t errlen);
void mt_tokenizer_free(mt_tokenizer *tok);

/* Token ids of len bytes of text (any bytes; NUL is an ordinary byte). The result is malloc'd
 * (free it), *count gets its length. Added tokens are matched literally, leftmost and longest first.
 * Bytes that are not well-formed UTF-8 never reach the regex: each maximal run of them is one
 * pre-token of its own, encoded byte-level, and the valid text between runs is normalised (NFC,
 * when tokenizer.json names it, as Qwen's does) and pre-tokenised as if it were a whole string.
 * So decode(encode(x)) == mt_tokenizer_normalize(x) for every x (== x without a normalizer).
 * Not thread-safe (word cache): one tokenizer per thread. Aborts on out-of-memory. */
int32_t *mt_tokenizer_encode(mt_tokenizer *tok, const char *text, size_t len, size_t *count);

/* The bytes of ids, concatenated (added tokens give their content), malloc'd and NUL-terminated
 * for convenience; *len gets the length without the NUL. NULL with a message for an unknown id. */
char *mt_tokenizer_decode(const mt_tokenizer *tok, const int32_t *ids, size_t n, size_t *len,
                          char *err, size_t errlen);

/* Id of an added token by content, else of a vocabulary token by its bytes; -1 if neither. */
int32_t mt_tokenizer_token_id(const mt_tokenizer *tok, const char *token);

/* One past the largest id (vocabulary and added tokens). */
int32_t mt_tokenizer_vocab_size(const mt_tokenizer *tok);

/* The text as encode sees it: the valid UTF-8 stretches normalised (NFC) when the tokenizer has a
 * normalizer, invalid bytes unchanged. malloc'd, NUL-terminated; *out_len gets its length. */
char *mt_tokenizer_normalize(const mt_tokenizer *tok, const char *text, size_t len, size_t *out_len);

/* The normalizer tokenizer.json names and this tokenizer applies ("NFC"), or NULL. */
const char *mt_tokenizer_normalizer(const mt_tokenizer *tok);

#endif
