/* Loading the BPE model of a tokenizer.json (jansson): the vocabulary as raw bytes (byte-level
 * characters or SentencePiece pieces decoded), the merge table by rank, the added tokens; then
 * the text pipeline (pipeline.c). Two families of files: byte-level BPE (GPT-2, Qwen, Llama 3)
 * and SentencePiece-style BPE (Llama 2, Mistral: "\u2581" for spaces, byte fallback, no regex). */
#include "models/tokenizer/load.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/report.h"

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
        if (strncmp(p, MT_TOK_METASPACE, 3) == 0) {
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

/* Records the bytes of token id (an added token that repeats a vocabulary entry records them again). */
static void set_piece(mt_tokenizer *tok, int32_t id, const char *bytes, size_t n)
{
    tok->piece_off[id] = (uint32_t)tok->pieces.len;
    tok->piece_len[id] = (int32_t)n;
    bytes_append(&tok->pieces, bytes, n);
}

/* The id table (piece_off, piece_len) has one entry per id up to the largest, so the ids must be
 * about as many as the tokens the file defines: real files number them densely (Qwen, Llama,
 * Mistral: 0 .. vocabulary + added tokens - 1). Holes are allowed, up to ids below twice the
 * number of tokens plus ID_SLACK; an id beyond that is a damaged or crafted file, refused before
 * anything that large is allocated. */
#define ID_SLACK 1024

/* Largest id in model.vocab and added_tokens, checking each is an integer in [0, 2^31 - 2] and
 * within the bound above. */
static int max_id(const json_t *vocab, const json_t *added, const char *path, int64_t *out, char *err,
                  size_t errlen)
{
    int64_t max = -1, defined = (int64_t)json_object_size(vocab) + (int64_t)json_array_size(added);
    int64_t bound = 2 * defined + ID_SLACK;
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)vocab, k, v) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= INT32_MAX)
            return mt_fail(err, errlen, "%s: key 'model.vocab': token '%s': id must be an integer in [0, 2^31-1), got %s",
                           path, k, mt_json_type_name(v));
        if (json_integer_value(v) >= bound)
            return mt_fail(err, errlen, "%s: key 'model.vocab': token '%s': id %lld is far beyond the %lld tokens the "
                           "file defines (ids must be below %lld: twice that plus %d, holes allowed); is the file damaged?", path,
                           k, (long long)json_integer_value(v), (long long)defined, (long long)bound, ID_SLACK);
        if (json_integer_value(v) > max) max = json_integer_value(v);
    }
    size_t i;
    json_array_foreach((json_t *)added, i, v) {
        json_t *id = lookup(v, "id");
        if (!json_is_integer(id) || json_integer_value(id) < 0 || json_integer_value(id) >= INT32_MAX)
            return mt_fail(err, errlen, "%s: key 'added_tokens[%zu].id': must be an integer in [0, 2^31-1)", path, i);
        if (json_integer_value(id) >= bound)
            return mt_fail(err, errlen, "%s: key 'added_tokens[%zu].id': id %lld is far beyond the %lld tokens the "
                           "file defines (ids must be below %lld: twice that plus %d, holes allowed); is the file damaged?", path,
                           i, (long long)json_integer_value(id), (long long)defined, (long long)bound, ID_SLACK);
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
    mt_tok_str_map_init(&tok->vocab, json_object_size(vocab));
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
        mt_tok_str_map_insert(&tok->vocab, tok->pieces.p, tok->piece_off[id], (uint32_t)raw.len, id, 0);
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
    tok->merges.slots = mt_xmalloc(cap * sizeof *tok->merges.slots);
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
    tok->added = mt_xmalloc((n ? n : 1) * sizeof *tok->added);
    json_array_foreach((json_t *)added, i, a) {
        json_t *content = lookup(a, "content");
        if (!json_is_string(content) || json_string_length(content) == 0)
            return mt_fail(err, errlen, "%s: key 'added_tokens[%zu].content': missing, empty or not a string", path, i);
        if (flag(a, "lstrip") || flag(a, "rstrip") || flag(a, "single_word"))
            return mt_fail(err, errlen, "%s: key 'added_tokens[%zu]' ('%s'): lstrip, rstrip and single_word are not "
                           "supported", path, i, json_string_value(content));
        int32_t id = (int32_t)json_integer_value(lookup(a, "id"));
        size_t len = json_string_length(content);
        /* An id names one token: an added token may repeat a vocabulary entry (Llama 2's <s>),
         * not give its id other bytes, which encoding and decoding would then disagree on (HF's
         * loader too gives such a token another id than the file's). */
        if (tok->piece_len[id] >= 0 && ((size_t)tok->piece_len[id] != len ||
                                        memcmp(tok->pieces.p + tok->piece_off[id], json_string_value(content), len)))
            return mt_fail(err, errlen, "%s: key 'added_tokens[%zu]' ('%s'): id %d is already another token's "
                           "(in model.vocab or an earlier added token)", path, i, json_string_value(content), id);
        added_token *t = &tok->added[tok->n_added++];
        t->content = mt_xmalloc(len + 1);
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
    tok->piece_off = mt_xmalloc((size_t)tok->vocab_size * sizeof *tok->piece_off);
    tok->piece_len = mt_xmalloc((size_t)tok->vocab_size * sizeof *tok->piece_len);
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
    mt_tokenizer *tok = mt_xmalloc(sizeof *tok);
    memset(tok, 0, sizeof *tok);
    tok->path = mt_xmalloc(strlen(path) + 1);
    memcpy(tok->path, path, strlen(path) + 1);
    int rc = -1;
    if (!json_is_object(root)) mt_fail(err, errlen, "%s: expected a JSON object at the top", path);
    else rc = parse_model(tok, root, path, err, errlen);
    if (rc == 0 && tok->spm) rc = mt_tok_parse_spm(tok, root, path, err, errlen);
    if (rc == 0 && !tok->spm) rc = mt_tok_parse_normalizer(tok, root, path, err, errlen);
    if (rc == 0 && !tok->spm) rc = mt_tok_parse_pre_tokenizer(tok, root, path, err, errlen);
    json_decref(root);
    if (rc) {
        mt_tokenizer_free(tok);
        return NULL;
    }
    mt_tok_str_map_init(&tok->cache, 1024);
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
        free(tok->split_key[i]);
    }
    pcre2_match_context_free(tok->jit_context);
    pcre2_match_context_free(tok->interp_context);
    pcre2_jit_stack_free(tok->jit_stack);
    free(tok->path);
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
