/* BPE from a Hugging Face tokenizer.json: loading (jansson), pre-tokenisation (PCRE2), merges by
 * rank with a heap per word, a word cache, decoding. Two families of files: byte-level BPE
 * (GPT-2, Qwen, Llama 3) and SentencePiece-style BPE (Llama 2, Mistral: "\u2581" for spaces,
 * byte fallback, no regex). Tokens are kept as raw bytes, not the file's stand-ins (GPT-2's
 * printable characters, "\u2581" for a space, "<0x0A>" for a fallback byte), so merging works on
 * byte strings and decoding is a concatenation. */
#include "models/tokenizer.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <jansson.h>
#include <pcre2.h>
#include <utf8proc.h>

#include "models/report.h"

/* GPT-2's pre-tokeniser regex, which a ByteLevel pre_tokenizer with use_regex true applies. */
static const char GPT2_PATTERN[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

/* Words up to this many bytes go into the cache; longer ones are rare and would crowd it. */
#define CACHE_MAX_WORD 256
/* The cache is emptied when it holds this many words or bytes, which bounds its memory (~20 MB). */
#define CACHE_MAX_WORDS (1u << 17)
#define CACHE_MAX_BYTES (8u << 20)
#define MAX_SPLIT_STEPS 8

/* ---------------------------------------------------------------- growable buffers */

static void *xrealloc(void *p, size_t n)
{
    void *q = realloc(p, n ? n : 1);
    if (!q) {
        fprintf(stderr, "megatrain tokenizer: out of memory (%zu bytes)\n", n);
        abort();
    }
    return q;
}

typedef struct { char *p; size_t len, cap; } byte_buf;
typedef struct { int32_t *p; size_t len, cap; } id_buf;

static void bytes_append(byte_buf *b, const char *s, size_t n)
{
    if (b->len + n + 1 > b->cap) {
        b->cap = (b->len + n + 1) * 2;
        b->p = xrealloc(b->p, b->cap);
    }
    if (n) memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0; /* decode hands out NUL-terminated text */
}

static void ids_append(id_buf *b, const int32_t *ids, size_t n)
{
    if (b->len + n > b->cap) {
        b->cap = (b->len + n) * 2 + 16;
        b->p = xrealloc(b->p, b->cap * sizeof *b->p);
    }
    if (n) memcpy(b->p + b->len, ids, n * sizeof *ids);
    b->len += n;
}

/* ---------------------------------------------------------------- hash maps */

static uint64_t hash_bytes(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) h = (h ^ (uint8_t)s[i]) * 1099511628211ull;
    return h;
}

static uint64_t hash_u64(uint64_t x)
{
    x ^= x >> 33; /* splitmix64 finaliser: pair keys differ in few bits */
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
}

/* Byte-string keys stored as offsets into a pool the caller owns (the pool may move when it
 * grows, so slots never hold pointers). key_len UINT32_MAX marks an empty slot. */
typedef struct { uint64_t hash; uint32_t key_off, key_len; int32_t value, aux; } str_slot;
typedef struct { str_slot *slots; size_t cap, used; } str_map;

static void str_map_init(str_map *m, size_t expected)
{
    size_t cap = 64;
    while (cap < expected * 2) cap *= 2;
    m->slots = xrealloc(NULL, cap * sizeof *m->slots);
    for (size_t i = 0; i < cap; i++) m->slots[i].key_len = UINT32_MAX;
    m->cap = cap;
    m->used = 0;
}

static str_slot *str_map_find(const str_map *m, const char *pool, const char *key, size_t n)
{
    uint64_t h = hash_bytes(key, n);
    for (size_t i = h & (m->cap - 1);; i = (i + 1) & (m->cap - 1)) {
        str_slot *s = &m->slots[i];
        if (s->key_len == UINT32_MAX) return NULL;
        if (s->hash == h && s->key_len == n && memcmp(pool + s->key_off, key, n) == 0) return s;
    }
}

/* Inserts a key already stored in pool at key_off; the caller has checked it is absent. */
static void str_map_insert(str_map *m, const char *pool, uint32_t key_off, uint32_t key_len, int32_t value,
                           int32_t aux)
{
    if ((m->used + 1) * 2 > m->cap) {
        str_map old = *m;
        str_map_init(m, old.cap);
        for (size_t i = 0; i < old.cap; i++)
            if (old.slots[i].key_len != UINT32_MAX)
                str_map_insert(m, pool, old.slots[i].key_off, old.slots[i].key_len, old.slots[i].value,
                               old.slots[i].aux);
        free(old.slots);
    }
    uint64_t h = hash_bytes(pool + key_off, key_len);
    size_t i = h & (m->cap - 1);
    while (m->slots[i].key_len != UINT32_MAX) i = (i + 1) & (m->cap - 1);
    m->slots[i] = (str_slot){h, key_off, key_len, value, aux};
    m->used++;
}

static void str_map_clear(str_map *m)
{
    for (size_t i = 0; i < m->cap; i++) m->slots[i].key_len = UINT32_MAX;
    m->used = 0;
}

/* Merge table: (left id, right id) -> (rank, merged id); rank -1 marks an empty slot. */
typedef struct { uint64_t key; int32_t rank, merged; } pair_slot;
typedef struct { pair_slot *slots; size_t cap; } pair_map;

static uint64_t pair_key(int32_t left, int32_t right) { return (uint64_t)(uint32_t)left << 32 | (uint32_t)right; }

static const pair_slot *pair_find(const pair_map *m, uint64_t key)
{
    for (size_t i = hash_u64(key) & (m->cap - 1);; i = (i + 1) & (m->cap - 1)) {
        const pair_slot *s = &m->slots[i];
        if (s->rank < 0) return NULL;
        if (s->key == key) return s;
    }
}

/* ---------------------------------------------------------------- the tokenizer */

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

/* GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 bytes
 * take code points 256.. in byte order. cp_to_byte inverts it (-1: not a byte's stand-in). */
static void byte_level_tables(int cp_to_byte[324])
{
    for (int i = 0; i < 324; i++) cp_to_byte[i] = -1;
    int extra = 0;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        cp_to_byte[printable ? b : 256 + extra++] = b;
    }
}

/* Length of the well-formed UTF-8 sequence at s (Unicode table 3-7: no overlongs, surrogates or
 * code points past U+10FFFF), or 0 if s does not start one. n > 0 bytes are readable. */
static int utf8_len(const uint8_t *s, size_t n)
{
    uint8_t c = s[0];
    if (c < 0x80) return 1;
    if (c < 0xC2 || c > 0xF4) return 0;
    int len = c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    if ((size_t)len > n) return 0;
    uint8_t lo = 0x80, hi = 0xBF;
    if (c == 0xE0) lo = 0xA0;
    else if (c == 0xED) hi = 0x9F;
    else if (c == 0xF0) lo = 0x90;
    else if (c == 0xF4) hi = 0x8F;
    if (s[1] < lo || s[1] > hi) return 0;
    for (int i = 2; i < len; i++)
        if (s[i] < 0x80 || s[i] > 0xBF) return 0;
    return len;
}

/* Decodes one code point of a valid UTF-8 string (jansson guarantees validity). */
static uint32_t utf8_next(const uint8_t **s)
{
    const uint8_t *p = *s;
    uint32_t c = p[0];
    int len = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    if (len > 1) c &= 0x3F >> (len - 1);
    for (int i = 1; i < len; i++) c = c << 6 | (p[i] & 0x3F);
    *s = p + len;
    return c;
}

/* Raw bytes of a vocabulary token written in byte-level characters; -1 with the offending code
 * point in *bad when a character is not one of the 256 stand-ins. */
static int byte_level_decode(const int cp_to_byte[324], const char *token, byte_buf *out, uint32_t *bad)
{
    out->len = 0;
    const uint8_t *s = (const uint8_t *)token;
    while (*s) {
        uint32_t c = utf8_next(&s);
        if (c >= 324 || cp_to_byte[c] < 0) {
            *bad = c;
            return -1;
        }
        char b = (char)cp_to_byte[c];
        bytes_append(out, &b, 1);
    }
    return 0;
}

static const char METASPACE[] = "\xE2\x96\x81"; /* U+2581, SentencePiece's stand-in for a space */

/* Raw bytes of a SentencePiece-style vocabulary token: "\u2581" becomes a space; "<0xXX>" (a
 * fallback byte) gives -2 with the byte in *fallback and nothing in out. -1 when the token holds a
 * literal space, which would be indistinguishable from "\u2581" here (no such file is known). */
static int spm_piece(const char *token, byte_buf *out, int *fallback)
{
    out->len = 0;
    unsigned b;
    char tail;
    const char *hex = "0123456789ABCDEF"; /* the file's spelling: two upper-case digits */
    if (strlen(token) == 6 && token[3] && strchr(hex, token[3]) && token[4] && strchr(hex, token[4]) &&
        sscanf(token, "<0x%2X%c", &b, &tail) == 2 && tail == '>') {
        *fallback = (int)b;
        return -2;
    }
    for (const char *p = token; *p;) {
        if (strncmp(p, METASPACE, 3) == 0) {
            bytes_append(out, " ", 1);
            p += 3;
        } else if (*p == ' ') {
            return -1;
        } else {
            bytes_append(out, p, 1);
            p++;
        }
    }
    return 0;
}

/* obj[key], NULL when absent or JSON null (tokenizer.json writes null for unset options). */
static json_t *lookup(const json_t *obj, const char *key)
{
    json_t *v = json_is_object(obj) ? json_object_get(obj, key) : NULL;
    return (v && json_is_null(v)) ? NULL : v;
}

static bool flag(const json_t *obj, const char *key) { return json_is_true(lookup(obj, key)); }

static int compile_split(mt_tokenizer *tok, const char *pattern, const char *path, const char *key, char *err,
                         size_t errlen)
{
    if (tok->n_split == MAX_SPLIT_STEPS)
        return mt_fail(err, errlen, "%s: key '%s': more than %d regex splits", path, key, MAX_SPLIT_STEPS);
    int code;
    PCRE2_SIZE offset;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &code,
                                   &offset, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(code, msg, sizeof msg);
        return mt_fail(err, errlen, "%s: key '%s': PCRE2 cannot compile the regex at offset %zu: %s", path, key,
                    (size_t)offset, (const char *)msg);
    }
    /* JIT is only speed: without it (unsupported CPU) the interpreter gives the same matches. */
    (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
    tok->split[tok->n_split] = re;
    tok->match[tok->n_split] = pcre2_match_data_create_from_pattern(re, NULL);
    if (!tok->match[tok->n_split]) {
        fprintf(stderr, "megatrain tokenizer: out of memory\n");
        abort();
    }
    tok->n_split++;
    return 0;
}

/* A ByteLevel step: only the options these files use; its own regex when use_regex is on. */
static int parse_byte_level(mt_tokenizer *tok, const json_t *pre, const char *path, const char *key, char *err,
                            size_t errlen)
{
    if (flag(pre, "add_prefix_space"))
        return mt_fail(err, errlen, "%s: key '%s.add_prefix_space': true is not supported (Llama-3 and Qwen use false)",
                    path, key);
    json_t *use_regex = lookup(pre, "use_regex");
    if (!use_regex || json_is_true(use_regex)) return compile_split(tok, GPT2_PATTERN, path, key, err, errlen);
    return 0;
}

static int parse_pre_tokenizer(mt_tokenizer *tok, const json_t *root, const char *path, char *err, size_t errlen)
{
    json_t *pre = lookup(root, "pre_tokenizer");
    if (!pre)
        return mt_fail(err, errlen, "%s: key 'pre_tokenizer': missing; only byte-level BPE tokenizers are supported",
                    path);
    const char *type = json_string_value(lookup(pre, "type"));
    if (!type) return mt_fail(err, errlen, "%s: key 'pre_tokenizer.type': missing or not a string", path);
    if (strcmp(type, "ByteLevel") == 0) return parse_byte_level(tok, pre, path, "pre_tokenizer", err, errlen);
    if (strcmp(type, "Sequence") != 0)
        return mt_fail(err, errlen, "%s: key 'pre_tokenizer.type': '%s' is not supported (ByteLevel or Sequence)",
                    path, type);
    json_t *steps = lookup(pre, "pretokenizers");
    if (!json_is_array(steps))
        return mt_fail(err, errlen, "%s: key 'pre_tokenizer.pretokenizers': missing or not an array", path);
    bool byte_level = false;
    size_t i;
    json_t *step;
    json_array_foreach(steps, i, step) {
        char key[96];
        snprintf(key, sizeof key, "pre_tokenizer.pretokenizers[%zu]", i);
        const char *st = json_string_value(lookup(step, "type"));
        if (byte_level)
            return mt_fail(err, errlen, "%s: key '%s': ByteLevel must be the last pre-tokenizer", path, key);
        if (st && strcmp(st, "ByteLevel") == 0) {
            if (parse_byte_level(tok, step, path, key, err, errlen)) return -1;
            byte_level = true;
            continue;
        }
        if (!st || strcmp(st, "Split") != 0)
            return mt_fail(err, errlen, "%s: key '%s.type': '%s' is not supported (Split or ByteLevel)", path, key,
                        st ? st : "(missing)");
        const char *regex = json_string_value(lookup(lookup(step, "pattern"), "Regex"));
        if (!regex)
            return mt_fail(err, errlen, "%s: key '%s.pattern.Regex': missing (string patterns are not supported)",
                        path, key);
        const char *behavior = json_string_value(lookup(step, "behavior"));
        if (!behavior || strcmp(behavior, "Isolated") != 0 || flag(step, "invert"))
            return mt_fail(err, errlen, "%s: key '%s.behavior': only Isolated without invert is supported", path, key);
        char rkey[128];
        snprintf(rkey, sizeof rkey, "%s.pattern.Regex", key);
        if (compile_split(tok, regex, path, rkey, err, errlen)) return -1;
    }
    if (!byte_level)
        return mt_fail(err, errlen, "%s: key 'pre_tokenizer.pretokenizers': no ByteLevel step; only byte-level BPE "
                    "tokenizers are supported", path);
    return 0;
}

static int parse_normalizer(mt_tokenizer *tok, const json_t *root, const char *path, char *err, size_t errlen)
{
    json_t *norm = lookup(root, "normalizer");
    if (!norm) return 0;
    const char *type = json_string_value(lookup(norm, "type"));
    if (!type || strcmp(type, "NFC") != 0)
        return mt_fail(err, errlen, "%s: key 'normalizer.type': '%s' is not supported (only NFC)", path, type ? type : "(missing)");
    snprintf(tok->normalizer, sizeof tok->normalizer, "%s", type);
    return 0;
}

/* ---------------------------------------------------------------- SentencePiece-style files */

static bool str_is(const json_t *v, const char *s) { return json_is_string(v) && strcmp(json_string_value(v), s) == 0; }

/* The steps of a component: its "Sequence" list under list_key, or the component alone. */
static json_t *steps_of(json_t *component, const char *list_key, json_t **single)
{
    *single = NULL;
    if (str_is(lookup(component, "type"), "Sequence")) return lookup(component, list_key);
    json_t *a = json_array();
    json_array_append(a, component);
    *single = a;
    return a;
}

/* Whether a Metaspace pre-tokenizer or decoder step prepends (and its decoder so drops) "\u2581":
 * not with add_prefix_space false or prepend_scheme "never" (tokenizers reads both spellings). */
static bool metaspace_prepends(const json_t *step)
{
    const char *scheme = json_string_value(lookup(step, "prepend_scheme"));
    return !json_is_false(lookup(step, "add_prefix_space")) && !(scheme && strcmp(scheme, "never") == 0);
}

/* normalizer, pre_tokenizer and decoder of a SentencePiece-style tokenizer.json, in the forms
 * Llama 2 and Mistral v0.1/v0.2 (a Prepend("\u2581") + Replace(" ", "\u2581") normalizer, no
 * pre-tokenizer; decoder Replace, ByteFallback, Fuse, Strip(" ", 1, 0)) and Mistral v0.3 (a
 * Metaspace pre-tokenizer, split false; a Metaspace decoder) write them. */
static int parse_spm(mt_tokenizer *tok, const json_t *root, const char *path, char *err, size_t errlen)
{
    bool prepend = false, replace = false;
    json_t *norm = lookup(root, "normalizer"), *single, *steps, *st;
    size_t i;
    if (norm) {
        steps = steps_of(norm, "normalizers", &single);
        if (!json_is_array(steps)) return mt_fail(err, errlen, "%s: key 'normalizer.normalizers': not an array", path);
        json_array_foreach(steps, i, st) {
            if (str_is(lookup(st, "type"), "Prepend") && str_is(lookup(st, "prepend"), METASPACE)) prepend = true;
            else if (str_is(lookup(st, "type"), "Replace") && str_is(lookup(lookup(st, "pattern"), "String"), " ") &&
                     str_is(lookup(st, "content"), METASPACE)) replace = true;
            else {
                json_decref(single);
                return mt_fail(err, errlen, "%s: key 'normalizer': step %zu is not supported with byte_fallback (only "
                            "Prepend(\"\u2581\") and Replace(\" \", \"\u2581\"), as Llama 2 and Mistral write)", path, i);
            }
        }
        json_decref(single);
    }
    tok->spm_prepend = prepend ? SPM_PREPEND_EVERY : SPM_PREPEND_NEVER;
    json_t *pre = lookup(root, "pre_tokenizer");
    if (pre) {
        if (!str_is(lookup(pre, "type"), "Metaspace") || !str_is(lookup(pre, "replacement"), METASPACE))
            return mt_fail(err, errlen, "%s: key 'pre_tokenizer': only Metaspace with replacement \"\u2581\" is "
                        "supported with byte_fallback", path);
        if (flag(pre, "split"))
            return mt_fail(err, errlen, "%s: key 'pre_tokenizer.split': true is not supported (Mistral writes false)",
                        path);
        if (prepend)
            return mt_fail(err, errlen, "%s: key 'pre_tokenizer': a Metaspace pre-tokenizer after a Prepend "
                        "normalizer is not supported", path);
        const char *scheme = json_string_value(lookup(pre, "prepend_scheme"));
        if (!metaspace_prepends(pre)) tok->spm_prepend = SPM_PREPEND_NEVER;
        else if (scheme && strcmp(scheme, "first") == 0) tok->spm_prepend = SPM_PREPEND_FIRST;
        else if (!scheme || strcmp(scheme, "always") == 0) tok->spm_prepend = SPM_PREPEND_ALWAYS;
        else return mt_fail(err, errlen, "%s: key 'pre_tokenizer.prepend_scheme': '%s' is not first, always or never",
                         path, scheme);
        tok->spm_metaspace = true;
        replace = true;
    }
    if (!replace)
        return mt_fail(err, errlen, "%s: key 'normalizer': spaces are never written as \"\u2581\" (byte_fallback "
                    "needs a Replace normalizer or a Metaspace pre-tokenizer)", path);
    json_t *dec = lookup(root, "decoder");
    tok->spm_strip = SPM_STRIP_NONE;
    if (!dec) return 0;
    steps = steps_of(dec, "decoders", &single);
    if (!json_is_array(steps)) return mt_fail(err, errlen, "%s: key 'decoder.decoders': not an array", path);
    int rc = 0;
    json_array_foreach(steps, i, st) {
        const json_t *type = lookup(st, "type");
        if (str_is(type, "ByteFallback") || str_is(type, "Fuse")) continue;
        if (str_is(type, "Replace") && str_is(lookup(lookup(st, "pattern"), "String"), METASPACE) &&
            str_is(lookup(st, "content"), " "))
            continue;
        if (str_is(type, "Strip") && str_is(lookup(st, "content"), " ") && json_integer_value(lookup(st, "start")) <= 1 &&
            json_integer_value(lookup(st, "stop")) == 0) {
            if (json_integer_value(lookup(st, "start")) == 1) tok->spm_strip = SPM_STRIP_FUSED;
            continue;
        }
        if (str_is(type, "Metaspace") && str_is(lookup(st, "replacement"), METASPACE)) {
            if (metaspace_prepends(st)) tok->spm_strip = SPM_STRIP_FIRST_TOKEN;
            continue;
        }
        rc = mt_fail(err, errlen, "%s: key 'decoder': step %zu (%s) is not supported with byte_fallback (Replace, "
                     "ByteFallback, Fuse, Strip, Metaspace)", path, i, json_is_string(type) ? json_string_value(type) : "?");
        break;
    }
    json_decref(single);
    return rc;
}

/* Records the bytes of token id (an added token overrides a vocabulary entry of the same id). */
static void set_piece(mt_tokenizer *tok, int32_t id, const char *bytes, size_t n)
{
    tok->piece_off[id] = (uint32_t)tok->pieces.len;
    tok->piece_len[id] = (int32_t)n;
    bytes_append(&tok->pieces, bytes, n);
}

/* Largest id in model.vocab and added_tokens, checking each is an integer in [0, 2^31 - 2]. */
static int max_id(const json_t *vocab, const json_t *added, const char *path, int64_t *out, char *err,
                  size_t errlen)
{
    int64_t max = -1;
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)vocab, k, v) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= INT32_MAX)
            return mt_fail(err, errlen, "%s: key 'model.vocab': token '%s': id must be an integer in [0, 2^31-1), got %s",
                        path, k, mt_json_type_name(v));
        if (json_integer_value(v) > max) max = json_integer_value(v);
    }
    size_t i;
    json_array_foreach((json_t *)added, i, v) {
        json_t *id = lookup(v, "id");
        if (!json_is_integer(id) || json_integer_value(id) < 0 || json_integer_value(id) >= INT32_MAX)
            return mt_fail(err, errlen, "%s: key 'added_tokens[%zu].id': must be an integer in [0, 2^31-1)", path, i);
        if (json_integer_value(id) > max) max = json_integer_value(id);
    }
    *out = max;
    return 0;
}

static int parse_vocab(mt_tokenizer *tok, const json_t *vocab, const int cp_to_byte[324], const char *path,
                       char *err, size_t errlen)
{
    byte_buf raw = {0};
    const char *k;
    json_t *v;
    str_map_init(&tok->vocab, json_object_size(vocab));
    for (int b = 0; b < 256; b++) tok->fallback_id[b] = -1;
    json_object_foreach((json_t *)vocab, k, v) {
        int32_t id = (int32_t)json_integer_value(v);
        uint32_t bad;
        if (tok->spm) {
            int fb = -1, rc = spm_piece(k, &raw, &fb);
            if (rc == -1) {
                free(raw.p);
                return mt_fail(err, errlen, "%s: key 'model.vocab': token '%s' holds a space; SentencePiece-style "
                            "vocabularies write it as U+2581", path, k);
            }
            if (rc == -2) { /* a fallback byte: decodes to that byte, never looked up as text */
                char c = (char)fb;
                if (tok->piece_len[id] >= 0) {
                    free(raw.p);
                    return mt_fail(err, errlen, "%s: key 'model.vocab': id %d is used twice (token '%s')", path, id, k);
                }
                set_piece(tok, id, &c, 1);
                tok->fallback_id[fb] = id;
                continue;
            }
        } else if (byte_level_decode(cp_to_byte, k, &raw, &bad)) {
            free(raw.p);
            return mt_fail(err, errlen, "%s: key 'model.vocab': token '%s' has U+%04X, which is not a byte-level "
                        "character (is this a byte-level BPE?)", path, k, (unsigned)bad);
        }
        if (raw.len == 0) {
            free(raw.p);
            return mt_fail(err, errlen, "%s: key 'model.vocab': empty token (id %d)", path, id);
        }
        if (tok->piece_len[id] >= 0) {
            free(raw.p);
            return mt_fail(err, errlen, "%s: key 'model.vocab': id %d is used twice (token '%s')", path, id, k);
        }
        set_piece(tok, id, raw.p, raw.len);
        str_map_insert(&tok->vocab, tok->pieces.p, tok->piece_off[id], (uint32_t)raw.len, id, 0);
    }
    free(raw.p);
    if (tok->spm) {
        for (int b = 0; b < 256; b++)
            if (tok->fallback_id[b] < 0)
                return mt_fail(err, errlen, "%s: key 'model.vocab': no token <0x%02X>; byte_fallback needs all 256",
                            path, b);
        return 0;
    }
    for (int b = 0; b < 256; b++) {
        char c = (char)b;
        const str_slot *s = str_map_find(&tok->vocab, tok->pieces.p, &c, 1);
        if (!s) return mt_fail(err, errlen, "%s: key 'model.vocab': no token for byte 0x%02X; a byte-level BPE "
                            "needs all 256", path, b);
        tok->byte_id[b] = s->value;
    }
    return 0;
}

/* The id of a byte-level token string, or -1 with a message naming merge i. */
static int32_t merge_part_id(mt_tokenizer *tok, const int cp_to_byte[324], const char *part, byte_buf *raw,
                             const char *path, size_t i, char *err, size_t errlen)
{
    uint32_t bad;
    int fb;
    if (tok->spm) {
        if (spm_piece(part, raw, &fb) != 0) {
            mt_fail(err, errlen, "%s: key 'model.merges[%zu]': '%s' is a fallback byte or holds a space", path, i, part);
            return -1;
        }
    } else if (byte_level_decode(cp_to_byte, part, raw, &bad)) {
        mt_fail(err, errlen, "%s: key 'model.merges[%zu]': '%s' has U+%04X, not a byte-level character", path, i, part,
             (unsigned)bad);
        return -1;
    }
    const str_slot *s = str_map_find(&tok->vocab, tok->pieces.p, raw->p, raw->len);
    if (!s) mt_fail(err, errlen, "%s: key 'model.merges[%zu]': '%s' is not in model.vocab", path, i, part);
    return s ? s->value : -1;
}

static int parse_merges(mt_tokenizer *tok, const json_t *merges, const int cp_to_byte[324], const char *path,
                        char *err, size_t errlen)
{
    size_t n = json_array_size(merges), cap = 64;
    while (cap < n * 2) cap *= 2;
    tok->merges.cap = cap;
    tok->merges.slots = xrealloc(NULL, cap * sizeof *tok->merges.slots);
    for (size_t i = 0; i < cap; i++) tok->merges.slots[i].rank = -1;
    byte_buf raw = {0}, joined = {0};
    char *split = NULL;
    int rc = -1;
    for (size_t i = 0; i < n; i++) {
        json_t *m = json_array_get(merges, i);
        const char *left, *right;
        if (json_is_string(m)) {
            /* "a b": byte-level tokens never contain a space (it is written as U+0120). */
            free(split);
            split = strdup(json_string_value(m));
            char *space = split ? strchr(split, ' ') : NULL;
            if (!space || space == split || !space[1] || strchr(space + 1, ' ')) {
                mt_fail(err, errlen, "%s: key 'model.merges[%zu]': '%s' is not two tokens separated by one space",
                     path, i, json_string_value(m));
                goto out;
            }
            *space = 0;
            left = split;
            right = space + 1;
        } else if (json_is_array(m) && json_array_size(m) == 2 && json_is_string(json_array_get(m, 0)) &&
                   json_is_string(json_array_get(m, 1))) {
            left = json_string_value(json_array_get(m, 0));
            right = json_string_value(json_array_get(m, 1));
        } else {
            mt_fail(err, errlen, "%s: key 'model.merges[%zu]': expected \"a b\" or [\"a\", \"b\"], got %s", path, i,
                 mt_json_type_name(m));
            goto out;
        }
        int32_t l = merge_part_id(tok, cp_to_byte, left, &raw, path, i, err, errlen);
        if (l < 0) goto out;
        int32_t r = merge_part_id(tok, cp_to_byte, right, &raw, path, i, err, errlen);
        if (r < 0) goto out;
        joined.len = 0;
        bytes_append(&joined, tok->pieces.p + tok->piece_off[l], (size_t)tok->piece_len[l]);
        bytes_append(&joined, tok->pieces.p + tok->piece_off[r], (size_t)tok->piece_len[r]);
        const str_slot *merged = str_map_find(&tok->vocab, tok->pieces.p, joined.p, joined.len);
        if (!merged) {
            mt_fail(err, errlen, "%s: key 'model.merges[%zu]': '%s%s' (the merge's result) is not in model.vocab",
                 path, i, left, right);
            goto out;
        }
        uint64_t key = pair_key(l, r);
        size_t s = hash_u64(key) & (cap - 1);
        while (tok->merges.slots[s].rank >= 0 && tok->merges.slots[s].key != key) s = (s + 1) & (cap - 1);
        if (tok->merges.slots[s].rank < 0) /* a repeated pair keeps its first (best) rank */
            tok->merges.slots[s] = (pair_slot){key, (int32_t)i, merged->value};
    }
    rc = 0;
out:
    free(split);
    free(raw.p);
    free(joined.p);
    return rc;
}

static int cmp_added(const void *a, const void *b)
{
    const added_token *x = a, *y = b;
    uint8_t cx = (uint8_t)x->content[0], cy = (uint8_t)y->content[0];
    if (cx != cy) return cx < cy ? -1 : 1;
    if (x->len != y->len) return x->len > y->len ? -1 : 1;
    return x->id - y->id;
}

static int parse_added(mt_tokenizer *tok, const json_t *added, const char *path, char *err, size_t errlen)
{
    size_t n = json_array_size(added), i;
    json_t *a;
    tok->added = xrealloc(NULL, (n ? n : 1) * sizeof *tok->added);
    json_array_foreach((json_t *)added, i, a) {
        json_t *content = lookup(a, "content");
        if (!json_is_string(content) || json_string_length(content) == 0)
            return mt_fail(err, errlen, "%s: key 'added_tokens[%zu].content': missing, empty or not a string", path, i);
        if (flag(a, "lstrip") || flag(a, "rstrip") || flag(a, "single_word"))
            return mt_fail(err, errlen, "%s: key 'added_tokens[%zu]' ('%s'): lstrip, rstrip and single_word are not "
                        "supported", path, i, json_string_value(content));
        int32_t id = (int32_t)json_integer_value(lookup(a, "id"));
        size_t len = json_string_length(content);
        added_token *t = &tok->added[tok->n_added++];
        t->content = xrealloc(NULL, len + 1);
        memcpy(t->content, json_string_value(content), len + 1);
        t->len = len;
        t->id = id;
        set_piece(tok, id, t->content, len);
    }
    qsort(tok->added, (size_t)tok->n_added, sizeof *tok->added, cmp_added);
    int k = 0;
    for (int b = 0; b <= 256; b++) {
        while (k < tok->n_added && (uint8_t)tok->added[k].content[0] < b) k++;
        tok->added_first[b] = k;
    }
    return 0;
}

static int parse_model(mt_tokenizer *tok, const json_t *root, const char *path, char *err, size_t errlen)
{
    json_t *model = lookup(root, "model");
    if (!json_is_object(model)) return mt_fail(err, errlen, "%s: key 'model': missing or not an object", path);
    const char *type = json_string_value(lookup(model, "type"));
    if (type && strcmp(type, "BPE") != 0)
        return mt_fail(err, errlen, "%s: key 'model.type': '%s' is not supported (only BPE)", path, type);
    json_t *vocab = lookup(model, "vocab"), *merges = lookup(model, "merges");
    json_t *added = lookup(root, "added_tokens");
    if (!json_is_object(vocab)) return mt_fail(err, errlen, "%s: key 'model.vocab': missing or not an object", path);
    if (!json_is_array(merges)) return mt_fail(err, errlen, "%s: key 'model.merges': missing or not an array", path);
    if (added && !json_is_array(added)) return mt_fail(err, errlen, "%s: key 'added_tokens': not an array", path);
    tok->spm = flag(model, "byte_fallback"); /* SentencePiece-style (Llama 2, Mistral) */
    const char *prefix = json_string_value(lookup(model, "continuing_subword_prefix"));
    const char *suffix = json_string_value(lookup(model, "end_of_word_suffix"));
    if ((prefix && *prefix) || (suffix && *suffix))
        return mt_fail(err, errlen, "%s: key 'model.continuing_subword_prefix'/'end_of_word_suffix': not supported",
                    path);
    json_t *dropout = lookup(model, "dropout");
    if (dropout && json_number_value(dropout) != 0)
        return mt_fail(err, errlen, "%s: key 'model.dropout': BPE dropout is for training tokenizers; not supported",
                    path);
    tok->ignore_merges = flag(model, "ignore_merges");

    int64_t max = -1;
    if (max_id(vocab, added, path, &max, err, errlen)) return -1;
    tok->vocab_size = (int32_t)(max + 1);
    tok->piece_off = xrealloc(NULL, (size_t)tok->vocab_size * sizeof *tok->piece_off);
    tok->piece_len = xrealloc(NULL, (size_t)tok->vocab_size * sizeof *tok->piece_len);
    for (int32_t i = 0; i < tok->vocab_size; i++) tok->piece_len[i] = -1;

    int cp_to_byte[324];
    byte_level_tables(cp_to_byte);
    if (parse_vocab(tok, vocab, cp_to_byte, path, err, errlen)) return -1;
    if (parse_merges(tok, merges, cp_to_byte, path, err, errlen)) return -1;
    return parse_added(tok, added, path, err, errlen);
}

mt_tokenizer *mt_tokenizer_load(const char *path, char *err, size_t errlen)
{
    json_error_t jerr;
    /* JSON_ALLOW_NUL: a token may be the byte 0 written as \u0000. */
    json_t *root = json_load_file(path, JSON_ALLOW_NUL, &jerr);
    if (!root) {
        mt_fail(err, errlen, "%s: cannot read tokenizer.json: %s (line %d)", path, jerr.text, jerr.line);
        return NULL;
    }
    mt_tokenizer *tok = xrealloc(NULL, sizeof *tok);
    memset(tok, 0, sizeof *tok);
    int rc = -1;
    if (!json_is_object(root)) mt_fail(err, errlen, "%s: expected a JSON object at the top", path);
    else rc = parse_model(tok, root, path, err, errlen);
    if (rc == 0 && tok->spm) rc = parse_spm(tok, root, path, err, errlen);
    if (rc == 0 && !tok->spm) rc = parse_normalizer(tok, root, path, err, errlen);
    if (rc == 0 && !tok->spm) rc = parse_pre_tokenizer(tok, root, path, err, errlen);
    json_decref(root);
    if (rc) {
        mt_tokenizer_free(tok);
        return NULL;
    }
    str_map_init(&tok->cache, 1024);
    return tok;
}

void mt_tokenizer_free(mt_tokenizer *tok)
{
    if (!tok) return;
    free(tok->piece_off);
    free(tok->piece_len);
    free(tok->pieces.p);
    free(tok->vocab.slots);
    free(tok->merges.slots);
    for (int i = 0; i < tok->n_added; i++) free(tok->added[i].content);
    free(tok->added);
    for (int i = 0; i < tok->n_split; i++) {
        pcre2_match_data_free(tok->match[i]);
        pcre2_code_free(tok->split[i]);
    }
    free(tok->cache.slots);
    free(tok->cache_bytes.p);
    free(tok->cache_ids.p);
    free(tok->sym);
    free(tok->prev);
    free(tok->next);
    free(tok->heap);
    free(tok->pos);
    free(tok);
}

/* ---------------------------------------------------------------- encoding */

/* A candidate merge of the symbol at pos with its right neighbour; stale once either changed. */
struct heap_entry { int32_t rank, pos, left, right; };

/* Lowest rank first, then leftmost, as Hugging Face's BPE orders its queue. */
static bool heap_less(const struct heap_entry *a, const struct heap_entry *b)
{
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static void heap_push(struct heap_entry *h, size_t *n, struct heap_entry e)
{
    size_t i = (*n)++;
    while (i > 0 && heap_less(&e, &h[(i - 1) / 2])) {
        h[i] = h[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    h[i] = e;
}

static struct heap_entry heap_pop(struct heap_entry *h, size_t *n)
{
    struct heap_entry top = h[0], last = h[--*n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && heap_less(&h[c + 1], &h[c])) c++;
        if (!heap_less(&h[c], &last)) break;
        h[i] = h[c];
        i = c;
    }
    if (*n) h[i] = last;
    return top;
}

/* Queues the merge of symbol pos with its right neighbour when the pair has a rank. */
static void push_pair(mt_tokenizer *tok, size_t *heap_n, int32_t pos)
{
    if (pos < 0 || tok->next[pos] < 0) return;
    int32_t nx = tok->next[pos];
    const pair_slot *s = pair_find(&tok->merges, pair_key(tok->sym[pos], tok->sym[nx]));
    if (s) heap_push(tok->heap, heap_n, (struct heap_entry){s->rank, pos, tok->sym[pos], tok->sym[nx]});
}

/* Room for the merge loop over up to n symbols. Each merge can add at most two queue entries, so
 * the heap never exceeds 3n. */
static void bpe_reserve(mt_tokenizer *tok, size_t n)
{
    if (n * 3 > tok->scratch_cap) {
        tok->scratch_cap = n * 3;
        tok->sym = xrealloc(tok->sym, tok->scratch_cap * sizeof *tok->sym);
        tok->prev = xrealloc(tok->prev, tok->scratch_cap * sizeof *tok->prev);
        tok->next = xrealloc(tok->next, tok->scratch_cap * sizeof *tok->next);
        tok->heap = xrealloc(tok->heap, tok->scratch_cap * sizeof *tok->heap);
        tok->pos = xrealloc(tok->pos, tok->scratch_cap * sizeof *tok->pos);
    }
}

typedef struct { size_t *p; size_t len, cap; } off_buf;

static void offs_append(off_buf *b, size_t v)
{
    if (b->len + 1 > b->cap) {
        b->cap = b->cap * 2 + 16;
        b->p = xrealloc(b->p, b->cap * sizeof *b->p);
    }
    b->p[b->len++] = v;
}

/* The merges over the n > 0 symbols in tok->sym, the result appended to out; with starts, also
 * each resulting token's start, orig[pos of its first symbol]. */
static void bpe_symbols(mt_tokenizer *tok, size_t n, id_buf *out, const size_t *orig, off_buf *starts)
{
    for (size_t i = 0; i < n; i++) {
        tok->prev[i] = (int32_t)i - 1;
        tok->next[i] = i + 1 < n ? (int32_t)i + 1 : -1;
    }
    size_t heap_n = 0;
    for (size_t i = 0; i + 1 < n; i++) push_pair(tok, &heap_n, (int32_t)i);
    while (heap_n) {
        struct heap_entry e = heap_pop(tok->heap, &heap_n);
        int32_t nx = tok->next[e.pos];
        /* Dead symbols have sym -1, so a stale entry fails one of these checks. */
        if (tok->sym[e.pos] != e.left || nx < 0 || tok->sym[nx] != e.right) continue;
        tok->sym[e.pos] = pair_find(&tok->merges, pair_key(e.left, e.right))->merged;
        tok->sym[nx] = -1;
        tok->next[e.pos] = tok->next[nx];
        if (tok->next[nx] >= 0) tok->prev[tok->next[nx]] = e.pos;
        push_pair(tok, &heap_n, tok->prev[e.pos]);
        push_pair(tok, &heap_n, e.pos);
    }
    for (int32_t i = 0; i >= 0; i = tok->next[i]) {
        ids_append(out, &tok->sym[i], 1);
        if (starts) offs_append(starts, orig[tok->pos[i]]);
    }
}

/* BPE of one byte-level pre-token of n > 0 bytes, appended to out. */
static void bpe_merge(mt_tokenizer *tok, const char *word, size_t n, id_buf *out)
{
    bpe_reserve(tok, n);
    for (size_t i = 0; i < n; i++) tok->sym[i] = tok->byte_id[(uint8_t)word[i]];
    bpe_symbols(tok, n, out, NULL, NULL);
}

/* A SentencePiece-style text section (between added tokens) as the file's normalizer and
 * Metaspace pre-tokenizer would hand it to the model, with ' ' for "\u2581": a space prepended
 * (every section with the Prepend normalizer; the first or every section with Metaspace, unless
 * the text starts with a space), and every "\u2581" of the text a space. Appended to out. */
static void spm_section(const mt_tokenizer *tok, const char *s, size_t n, bool first, byte_buf *out,
                        off_buf *orig, size_t at)
{
    if (n == 0) return;
    bool lead = n >= 3 && memcmp(s, METASPACE, 3) == 0;
    bool prepend = tok->spm_prepend == SPM_PREPEND_EVERY || tok->spm_prepend == SPM_PREPEND_ALWAYS ||
                   (tok->spm_prepend == SPM_PREPEND_FIRST && first);
    if (tok->spm_metaspace && (s[0] == ' ' || lead)) prepend = false;
    /* orig (when wanted): for each output byte, the offset of the input byte it comes from, at
     * being the section's offset in the input; the prepended space sits where the section starts */
    if (prepend) {
        bytes_append(out, " ", 1);
        if (orig) offs_append(orig, at);
    }
    size_t i = 0;
    while (i < n) {
        bool meta = i + 3 <= n && memcmp(s + i, METASPACE, 3) == 0;
        bytes_append(out, meta ? " " : s + i, 1);
        if (orig) offs_append(orig, at + i);
        i += meta ? 3 : 1;
    }
}

/* A SentencePiece-style section: one word (no regex), each well-formed character its vocabulary
 * token or its bytes' fallback tokens, each byte of malformed UTF-8 its fallback token; then the
 * merges (fallback tokens take part in none). */
static void spm_encode(mt_tokenizer *tok, const char *s, size_t n, bool first, size_t at, id_buf *out,
                       off_buf *starts)
{
    byte_buf text = {0};
    off_buf orig = {0};
    spm_section(tok, s, n, first, &text, starts ? &orig : NULL, at);
    if (text.len == 0) {
        free(text.p);
        return;
    }
    bpe_reserve(tok, text.len);
    const uint8_t *u = (const uint8_t *)text.p;
    size_t nsym = 0;
    for (size_t i = 0; i < text.len;) {
        int k = utf8_len(u + i, text.len - i);
        const str_slot *hit = k > 0 ? str_map_find(&tok->vocab, tok->pieces.p, text.p + i, (size_t)k) : NULL;
        if (hit) {
            tok->pos[nsym] = i;
            tok->sym[nsym++] = hit->value;
        } else {
            for (int j = 0; j < (k > 0 ? k : 1); j++) {
                tok->pos[nsym] = i + (size_t)j;
                tok->sym[nsym++] = tok->fallback_id[u[i + (size_t)j]];
            }
        }
        i += k > 0 ? (size_t)k : 1;
    }
    free(text.p);
    bpe_symbols(tok, nsym, out, orig.p, starts);
    free(orig.p);
}

/* One pre-token: from the cache, as a whole token (ignore_merges), or merged. */
static void encode_word(mt_tokenizer *tok, const char *word, size_t n, id_buf *out)
{
    if (n == 0) return;
    bool cacheable = n <= CACHE_MAX_WORD;
    if (cacheable) {
        const str_slot *s = str_map_find(&tok->cache, tok->cache_bytes.p, word, n);
        if (s) {
            ids_append(out, tok->cache_ids.p + s->value, (size_t)s->aux);
            return;
        }
    }
    size_t start = out->len;
    const str_slot *whole = tok->ignore_merges ? str_map_find(&tok->vocab, tok->pieces.p, word, n) : NULL;
    if (whole) ids_append(out, &whole->value, 1);
    else bpe_merge(tok, word, n, out);
    if (!cacheable) return;
    if (tok->cache.used >= CACHE_MAX_WORDS || tok->cache_bytes.len + n > CACHE_MAX_BYTES) {
        str_map_clear(&tok->cache);
        tok->cache_bytes.len = 0;
        tok->cache_ids.len = 0;
    }
    uint32_t key_off = (uint32_t)tok->cache_bytes.len;
    bytes_append(&tok->cache_bytes, word, n);
    int32_t ids_off = (int32_t)tok->cache_ids.len;
    ids_append(&tok->cache_ids, out->p + start, out->len - start);
    str_map_insert(&tok->cache, tok->cache_bytes.p, key_off, (uint32_t)n, ids_off, (int32_t)(out->len - start));
}

/* Applies split step `step` to valid UTF-8 s[0..n): matches and the gaps between them both become
 * pieces (Hugging Face's "Isolated"), each handed to the next step. */
static void pre_tokenize(mt_tokenizer *tok, const char *s, size_t n, int step, id_buf *out)
{
    if (step == tok->n_split) {
        encode_word(tok, s, n, out);
        return;
    }
    pcre2_match_data *md = tok->match[step];
    size_t start = 0, last = 0;
    while (start < n) {
        int rc = pcre2_match(tok->split[step], (PCRE2_SPTR)s, n, start, PCRE2_NO_UTF_CHECK, md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            /* Only resource limits can fail a match of valid UTF-8; giving wrong ids would be worse. */
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            fprintf(stderr, "megatrain tokenizer: regex match failed: %s\n", (const char *)msg);
            abort();
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t ms = ov[0], me = ov[1];
        if (me == ms) { /* empty match: no piece; step over one character */
            if (ms >= n) break;
            start = ms + (size_t)utf8_len((const uint8_t *)s + ms, n - ms);
            continue;
        }
        if (ms > last) pre_tokenize(tok, s + last, ms - last, step + 1, out);
        pre_tokenize(tok, s + ms, me - ms, step + 1, out);
        last = start = me;
    }
    if (last < n) pre_tokenize(tok, s + last, n - last, step + 1, out);
}

static const added_token *added_at(const mt_tokenizer *tok, const char *s, size_t n);

/* NFC of a valid UTF-8 stretch, malloc'd (utf8proc: Unicode's own composition data, which no
 * hand-written table should copy); *m gets its length. NULL when no normaliser applies. */
static uint8_t *nfc(const mt_tokenizer *tok, const char *s, size_t n, size_t *m)
{
    if (!tok->normalizer[0] || n == 0) return NULL;
    utf8proc_uint8_t *dst = NULL;
    utf8proc_ssize_t r = utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &dst,
                                      UTF8PROC_STABLE | UTF8PROC_COMPOSE);
    if (r < 0) return NULL; /* cannot happen on valid UTF-8; leave the text as it is */
    *m = (size_t)r;
    return dst;
}

/* Calls fn on each maximal stretch of valid UTF-8 (normalised) and each maximal run of invalid
 * bytes (as they are) of s[0..n), in order. */
static void for_each_stretch(const mt_tokenizer *tok, const char *s, size_t n,
                             void (*fn)(void *arg, const char *p, size_t len, bool valid), void *arg)
{
    const uint8_t *u = (const uint8_t *)s;
    size_t i = 0;
    while (i < n) {
        size_t j = i;
        int k;
        while (j < n && (k = utf8_len(u + j, n - j)) > 0) j += (size_t)k;
        if (j > i) {
            size_t m;
            uint8_t *norm = nfc(tok, s + i, j - i, &m);
            if (norm) fn(arg, (const char *)norm, m, true);
            else fn(arg, s + i, j - i, true);
            free(norm);
        }
        i = j;
        while (j < n && utf8_len(u + j, n - j) == 0) j++;
        if (j > i) fn(arg, s + i, j - i, false);
        i = j;
    }
}

typedef struct encode_ctx {
    mt_tokenizer *tok;
    id_buf *out;
    const char *text;             /* the whole input (encode_text and encode_added) */
    off_buf *starts;              /* each token's start in text, when wanted */
    size_t cursor;                /* where the next added token starts */
} encode_ctx;

static void encode_stretch(void *arg, const char *p, size_t len, bool valid)
{
    encode_ctx *c = arg;
    if (valid) pre_tokenize(c->tok, p, len, 0, c->out);
    else encode_word(c->tok, p, len, c->out);
}

/* Text between added tokens: valid UTF-8 stretches are normalised and pre-tokenised as whole
 * strings, and each maximal run of invalid bytes is a word of its own (the regex never sees
 * invalid UTF-8). */
static void encode_chunk(mt_tokenizer *tok, const char *s, size_t n, id_buf *out)
{
    encode_ctx c = { tok, out, NULL, NULL, 0 };
    for_each_stretch(tok, s, n, encode_stretch, &c);
}

static void append_stretch(void *arg, const char *p, size_t len, bool valid)
{
    (void)valid;
    bytes_append(arg, p, len);
}

/* Splits text at the added tokens (the longest one at each position, matched on the raw text):
 * text(arg, s, n) for each stretch between them (possibly empty), added(arg, token) for each. */
static void for_each_added_split(const mt_tokenizer *tok, const char *text, size_t len,
                                 void (*on_text)(void *arg, const char *s, size_t n),
                                 void (*on_added)(void *arg, const added_token *t), void *arg)
{
    size_t chunk = 0;
    for (size_t p = 0; p < len; p++) {
        const added_token *t = tok->n_added ? added_at(tok, text + p, len - p) : NULL;
        if (!t) continue;
        on_text(arg, text + chunk, p - chunk);
        on_added(arg, t);
        p += t->len - 1;
        chunk = p + 1;
    }
    on_text(arg, text + chunk, len - chunk);
}

typedef struct normalize_ctx {
    const mt_tokenizer *tok;
    byte_buf out;
} normalize_ctx;

static void normalize_text(void *arg, const char *s, size_t n)
{
    normalize_ctx *c = arg;
    for_each_stretch(c->tok, s, n, append_stretch, &c->out);
}

static void normalize_added(void *arg, const added_token *t)
{
    normalize_ctx *c = arg;
    bytes_append(&c->out, t->content, t->len);
}

char *mt_tokenizer_normalize(const mt_tokenizer *tok, const char *text, size_t len, size_t *out_len)
{
    if (tok->spm) {
        /* What the decoder drops depends on the tokens (the Metaspace decoder drops every space of
         * the first token), so this is decode(encode(text)) itself; encode's scratch makes it as
         * thread-unsafe as encode. */
        size_t n;
        int32_t *ids = mt_tokenizer_encode((mt_tokenizer *)tok, text, len, &n);
        char err[64];
        char *out = mt_tokenizer_decode(tok, ids, n, out_len, err, sizeof err); /* cannot fail: ids are ours */
        free(ids);
        return out;
    }
    normalize_ctx c = { tok, {0} };
    bytes_append(&c.out, NULL, 0);
    /* Added tokens are not normalised (they are matched on the raw text first). */
    for_each_added_split(tok, text, len, normalize_text, normalize_added, &c);
    *out_len = c.out.len;
    return c.out.p;
}

/* The longest added token starting at s[0..n), or NULL. */
static const added_token *added_at(const mt_tokenizer *tok, const char *s, size_t n)
{
    uint8_t b = (uint8_t)s[0];
    for (int k = tok->added_first[b]; k < tok->added_first[b + 1]; k++) {
        const added_token *t = &tok->added[k];
        if (t->len <= n && memcmp(t->content, s, t->len) == 0) return t;
    }
    return NULL;
}

static void encode_text(void *arg, const char *s, size_t n)
{
    encode_ctx *c = arg;
    size_t at = (size_t)(s - c->text), first_new = c->out->len;
    if (c->tok->spm) spm_encode(c->tok, s, n, s == c->text, at, c->out, c->starts);
    else {
        encode_chunk(c->tok, s, n, c->out);
        /* byte-level tokens hold the section's bytes in order (NFC aside): their running sum */
        for (size_t i = first_new; c->starts && i < c->out->len; i++) {
            offs_append(c->starts, at);
            at += (size_t)c->tok->piece_len[c->out->p[i]];
        }
    }
    c->cursor = (size_t)(s - c->text) + n;
}

static void encode_added(void *arg, const added_token *t)
{
    encode_ctx *c = arg;
    ids_append(c->out, &t->id, 1);
    if (c->starts) offs_append(c->starts, c->cursor);
    c->cursor += t->len;
}

/* Both encode entry points: the ids, and each token's start when starts is not NULL. */
static int32_t *encode_all(mt_tokenizer *tok, const char *text, size_t len, size_t *count, off_buf *starts)
{
    id_buf out = {0};
    ids_append(&out, NULL, 0);
    encode_ctx c = { tok, &out, text, starts, 0 };
    for_each_added_split(tok, text, len, encode_text, encode_added, &c);
    *count = out.len;
    return out.p;
}

int32_t *mt_tokenizer_encode(mt_tokenizer *tok, const char *text, size_t len, size_t *count)
{
    return encode_all(tok, text, len, count, NULL);
}

int32_t *mt_tokenizer_encode_offsets(mt_tokenizer *tok, const char *text, size_t len, size_t *count, size_t **starts)
{
    off_buf st = {0};
    offs_append(&st, 0); /* never empty, so the caller always gets an array */
    st.len = 0;
    int32_t *ids = encode_all(tok, text, len, count, &st);
    *starts = st.p;
    return ids;
}

/* ---------------------------------------------------------------- decoding and lookups */

char *mt_tokenizer_decode(const mt_tokenizer *tok, const int32_t *ids, size_t n, size_t *len, char *err,
                          size_t errlen)
{
    byte_buf out = {0};
    bytes_append(&out, NULL, 0);
    for (size_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= tok->vocab_size || tok->piece_len[id] < 0) {
            mt_fail(err, errlen, "decode: token %zu: id %d is not in the vocabulary (size %d)", i, id, tok->vocab_size);
            free(out.p);
            return NULL;
        }
        bytes_append(&out, tok->pieces.p + tok->piece_off[id], (size_t)tok->piece_len[id]);
    }
    /* SentencePiece-style decoders drop the space the encoder prepended. Strip after Fuse takes
     * one leading space off the whole text. Metaspace drops every "\u2581" of the first token
     * (tokenizers' Metaspace::decode_chain) when that is a vocabulary piece, whose spaces all
     * stand for "\u2581" (not an added token; not a fallback byte, whose "<0x20>" has none). */
    if (tok->spm && n > 0 && out.len > 0) {
        if (tok->spm_strip == SPM_STRIP_FUSED && out.p[0] == ' ') memmove(out.p, out.p + 1, out.len--);
        else if (tok->spm_strip == SPM_STRIP_FIRST_TOKEN) {
            bool piece = tok->fallback_id[(uint8_t)out.p[0]] != ids[0];
            for (int k = 0; k < tok->n_added && piece; k++) piece = tok->added[k].id != ids[0];
            size_t first = (size_t)tok->piece_len[ids[0]], kept = 0;
            if (piece) {
                for (size_t i = 0; i < first; i++)
                    if (out.p[i] != ' ') out.p[kept++] = out.p[i];
                memmove(out.p + kept, out.p + first, out.len - first + 1);
                out.len -= first - kept;
            }
        }
    }
    *len = out.len;
    return out.p;
}

int32_t mt_tokenizer_token_id(const mt_tokenizer *tok, const char *token)
{
    size_t n = strlen(token);
    if (n == 0) return -1;
    for (int k = 0; k < tok->n_added; k++)
        if (tok->added[k].len == n && memcmp(tok->added[k].content, token, n) == 0) return tok->added[k].id;
    const str_slot *s = str_map_find(&tok->vocab, tok->pieces.p, token, n);
    return s ? s->value : -1;
}

int32_t mt_tokenizer_vocab_size(const mt_tokenizer *tok) { return tok->vocab_size; }

const char *mt_tokenizer_normalizer(const mt_tokenizer *tok) { return tok->normalizer[0] ? tok->normalizer : NULL; }
