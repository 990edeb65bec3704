/* struct mt_tokenizer: what loading a tokenizer.json fills in (load.c, pipeline.c) and encoding
 * and decoding read (bpe.c, encode.c), with the encoder's scratch. Internal to models/tokenizer/.
 * Tokens are kept as raw bytes, not the file's stand-ins (GPT-2's printable characters, "\u2581"
 * for a space, "<0x0A>" for a fallback byte), so merging works on byte strings and decoding is a
 * concatenation. */
#ifndef MT_MODELS_TOKENIZER_STATE_H
#define MT_MODELS_TOKENIZER_STATE_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "models/tokenizer.h"
#include "models/tokenizer/tables.h"

#define MAX_SPLIT_STEPS 8
#define MT_TOK_METASPACE "\xE2\x96\x81" /* U+2581, SentencePiece's stand-in for a space */

typedef struct { char *content; size_t len; int32_t id; } added_token;

struct mt_tokenizer {
    int32_t vocab_size;           /* one past the largest id */
    uint32_t *piece_off;          /* (vocab_size) offset of each token's bytes in pieces */
    int32_t *piece_len;           /* (vocab_size) -1 where no token has that id */
    byte_buf pieces;
    str_map vocab;                /* model.vocab: raw bytes -> id (added tokens are not in it) */
    pair_map merges;
    int32_t byte_id[256];         /* id of each single-byte token, where merging starts */
    /* SentencePiece-style files (model.byte_fallback): a word is a whole text section with its
     * spaces as pieces' "\u2581" (kept as ' '), each character its vocabulary token or, when it
     * has none, its bytes' <0xXX> tokens (fallback_id; these are not in vocab). */
    bool spm;
    int32_t fallback_id[256];
    enum { SPM_PREPEND_NEVER, SPM_PREPEND_EVERY, SPM_PREPEND_FIRST, SPM_PREPEND_ALWAYS } spm_prepend;
    bool spm_metaspace;           /* the Metaspace pre-tokenizer: no "\u2581" is prepended to text that
                                   * already starts with one (the Prepend normalizer always adds it) */
    enum { SPM_STRIP_NONE, SPM_STRIP_FUSED, SPM_STRIP_FIRST_TOKEN } spm_strip; /* decoder: one leading
                                   * space off the whole text (Strip after Fuse) or every space of
                                   * the first token when it is a vocabulary piece (Metaspace) */
    bool ignore_merges;           /* Llama-3: a word that is a whole token skips the merges */
    added_token *added;           /* sorted by first byte, then longest first */
    int n_added;
    int added_first[257];         /* added[added_first[b] .. added_first[b+1]) start with byte b */
    pcre2_code *split[MAX_SPLIT_STEPS];
    pcre2_match_data *match[MAX_SPLIT_STEPS];
    int n_split;
    char normalizer[32];          /* "NFC" (applied with utf8proc) or "" when none */
    /* Scratch reused across calls (hence not thread-safe). */
    str_map cache;                /* word bytes -> (offset in cache_ids, count) */
    byte_buf cache_bytes;
    id_buf cache_ids;
    int32_t *sym, *prev, *next;   /* (word bytes) the merge loop's linked list of symbols */
    size_t *pos;                  /* (word bytes) SentencePiece-style: where each symbol starts in
                                   * the section's normalised text (a merge keeps the left one's) */
    struct heap_entry *heap;
    size_t scratch_cap;
};

#endif
