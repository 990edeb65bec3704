/* BPE tokenizer read from a Hugging Face tokenizer.json: byte-level (Qwen2/Qwen3, Llama-3, GPT-2
 * style: PCRE2 regex pre-tokenisation, GPT-2 byte-to-unicode mapping) or SentencePiece-style
 * (Llama 2, Mistral: "\u2581" for spaces, byte fallback, one word per section between added
 * tokens). Added tokens are split out literally; merges go by rank. Owns the vocabulary, the
 * merge table and a per-word cache. Implemented in models/tokenizer/: loading (load.c, the text
 * pipeline in pipeline.c), BPE (bpe.c), encoding and decoding (encode.c). */
#ifndef MT_MODELS_TOKENIZER_H
#define MT_MODELS_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

typedef struct mt_tokenizer mt_tokenizer;

/* Loads path (a tokenizer.json). NULL on error, with a message naming the file and the key.
 * Ids may leave holes but must stay below twice the number of tokens the file defines plus 1024
 * (the id table has an entry per id; real files number their tokens densely).
 * Accepted: model.type "BPE" with vocab and merges ("a b" strings or [a, b] pairs),
 * added_tokens without lstrip/rstrip/single_word, and either
 *  - byte-level: a pre_tokenizer that is ByteLevel (GPT-2 regex) or a Sequence of Split(Regex,
 *    Isolated) steps and a ByteLevel(use_regex false), normalizer null or NFC (applied to the
 *    text between added tokens, with utf8proc); or
 *  - SentencePiece-style (model.byte_fallback true, the 256 <0xXX> tokens): a Prepend("\u2581")
 *    and Replace(" ", "\u2581") normalizer (Llama 2, Mistral v0.1/v0.2) or a Metaspace
 *    pre-tokenizer with split false (Mistral v0.3), and a decoder of Replace, ByteFallback, Fuse,
 *    Strip or Metaspace steps. */
mt_tokenizer *mt_tokenizer_load(const char *path, char *err, size_t errlen);
void mt_tokenizer_free(mt_tokenizer *tok);

/* Token ids of len bytes of text (any bytes; NUL is an ordinary byte). The result is malloc'd
 * (free it), *count gets its length. Added tokens are matched literally, leftmost and longest first.
 * Bytes that are not well-formed UTF-8 never reach the regex: each maximal run of them is one
 * pre-token of its own, encoded byte-level, and the valid text between runs is normalised (NFC,
 * when tokenizer.json names it, as Qwen's does) and pre-tokenised as if it were a whole string.
 * So decode(encode(x)) == mt_tokenizer_normalize(x) for every x (== x without a normalizer).
 * NULL with err naming the file and the regex when a Split regex cannot match the text within
 * PCRE2's limits (a pathological pattern such as "(a*)*b": models/tokenizer/state.h has the
 * limits); never wrong ids. Not thread-safe (word cache): one tokenizer per thread. Aborts on
 * out-of-memory. */
int32_t *mt_tokenizer_encode(mt_tokenizer *tok, const char *text, size_t len, size_t *count, char *err,
                             size_t errlen);

/* encode, and *starts (malloc'd, count entries) the byte offset in text where each token starts:
 * token i covers text from starts[i] to the next larger start (the last ones to len), so
 * character spans of the text map to tokens (SFT loss masks). Starts never decrease and stay
 * below len. Byte-level tokenizers: the running sum of the tokens' bytes where the text is as NFC
 * leaves it; where NFC changes it (U+0344 becomes U+0308 U+0301), a token that starts inside a
 * changed piece (a character with its marks, as NFC composes them) starts where that piece starts
 * in the original text, so several tokens can share a start. SentencePiece-style: exact; the
 * space prepended to a section starts where the section does, and a "\u2581" of the text belongs
 * to the token holding the space it became. NULL (and *starts NULL) as encode. */
int32_t *mt_tokenizer_encode_offsets(mt_tokenizer *tok, const char *text, size_t len, size_t *count,
                                     size_t **starts, char *err, size_t errlen);

/* The bytes of ids, concatenated (added tokens give their content), malloc'd and NUL-terminated
 * for convenience; *len gets the length without the NUL. NULL with a message for an unknown id.
 * SentencePiece-style: "\u2581" decodes to a space, and the decoder drops the whole text's leading
 * space (Strip after Fuse) or every space of the first token (Metaspace, as tokenizers does);
 * fallback bytes decode to the bytes themselves, also where they do not form UTF-8 (transformers
 * would write U+FFFD there). */
char *mt_tokenizer_decode(const mt_tokenizer *tok, const int32_t *ids, size_t n, size_t *len,
                          char *err, size_t errlen);

/* Id of an added token by content, else of a vocabulary token by its bytes; -1 if neither. */
int32_t mt_tokenizer_token_id(const mt_tokenizer *tok, const char *token);

/* One past the largest id (vocabulary and added tokens). */
int32_t mt_tokenizer_vocab_size(const mt_tokenizer *tok);

/* The text as encode sees it, which is decode(encode(text)): the valid UTF-8 stretches normalised
 * (NFC) when the tokenizer has that normalizer, invalid bytes unchanged. SentencePiece-style, it
 * is computed as decode(encode(text)) (the spaces the encoder prepends to sections, "\u2581" as a
 * space, less what the decoder drops, which depends on the first token), with encode's scratch.
 * malloc'd, NUL-terminated; *out_len gets its length. */
char *mt_tokenizer_normalize(const mt_tokenizer *tok, const char *text, size_t len, size_t *out_len);

/* The normalizer tokenizer.json names and this tokenizer applies ("NFC"), or NULL. */
const char *mt_tokenizer_normalizer(const mt_tokenizer *tok);

#endif
