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
/* PCRE2's resources for one match of a Split regex. The JIT matcher's stack grows to
 * JIT_STACK_MAX (PCRE2's own default is 32 KiB, which a pattern such as "(.)*" exhausts after
 * about 1,365 characters); a match that needs more runs again in the interpreter, whose
 * backtracking memory is bounded by HEAP_LIMIT_KIB and its steps by MATCH_LIMIT and DEPTH_LIMIT
 * (ten times PCRE2's defaults). Past those, encoding fails with a message, never with wrong ids. */
#define MT_TOK_JIT_STACK_START (32u << 10)
#define MT_TOK_JIT_STACK_MAX (64u << 20)
#define MT_TOK_HEAP_LIMIT_KIB (1u << 20)
#define MT_TOK_MATCH_LIMIT 100000000u
#define MT_TOK_DEPTH_LIMIT 100000000u
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
    bool split_jit[MAX_SPLIT_STEPS];   /* JIT-compiled (else the interpreter matches it) */
    char *split_key[MAX_SPLIT_STEPS];  /* the regex's key in the file, for messages */
    int n_split;
    pcre2_jit_stack *jit_stack;        /* up to MT_TOK_JIT_STACK_MAX, shared by the splits */
    pcre2_match_context *jit_context;  /* matches with jit_stack */
    pcre2_match_context *interp_context; /* the interpreter's raised limits */
    char *path;                   /* the tokenizer.json, for messages */
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
