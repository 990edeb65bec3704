/* Encoding and decoding (the public API of models/tokenizer.h beyond loading): added tokens split
 * out literally, the text between them normalised (NFC) and pre-tokenised by the regex splits,
 * each word through BPE (bpe.c); decoding concatenates the tokens' bytes. */
#include "models/tokenizer/bpe.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "models/report.h"

/* Applies split step `step` to valid UTF-8 s[0..n): matches and the gaps between them both become
 * pieces (Hugging Face's "Isolated"), each handed to the next step. */
static void pre_tokenize(mt_tokenizer *tok, const char *s, size_t n, int step, id_buf *out)
{
    if (step == tok->n_split) {
        mt_tok_encode_word(tok, s, n, out);
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
    else mt_tok_encode_word(c->tok, p, len, c->out);
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
    if (c->tok->spm) mt_tok_spm_encode(c->tok, s, n, s == c->text, at, c->out, c->starts);
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
