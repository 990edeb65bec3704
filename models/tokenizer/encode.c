/* Encoding and decoding (the public API of models/tokenizer.h beyond loading): added tokens split
 * out literally, the text between them normalised (NFC) and pre-tokenised by the regex splits,
 * each word through BPE (bpe.c); decoding concatenates the tokens' bytes. */
#include "models/tokenizer/bpe.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "models/report.h"

typedef struct encode_ctx {
    mt_tokenizer *tok;
    id_buf *out;
    const char *text;             /* the whole input (encode_text and encode_added) */
    off_buf *starts;              /* each token's start in text, when wanted */
    size_t cursor;                /* where the next added token starts */
    char *err;                    /* the first failure's message; rc -1 from then on */
    size_t errlen;
    int rc;
} encode_ctx;

/* The message for a match of split step `step` that failed with PCRE2 code rc on n bytes. */
static void match_failed(encode_ctx *c, int step, int rc, size_t n)
{
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(rc, msg, sizeof msg);
    char limit[160];
    if (rc == PCRE2_ERROR_HEAPLIMIT)
        snprintf(limit, sizeof limit, "%u MiB of backtracking memory (after the %u MiB JIT stack)",
                 MT_TOK_HEAP_LIMIT_KIB >> 10, MT_TOK_JIT_STACK_MAX >> 20);
    else if (rc == PCRE2_ERROR_MATCHLIMIT)
        snprintf(limit, sizeof limit, "the match limit (catastrophic backtracking?)");
    else if (rc == PCRE2_ERROR_DEPTHLIMIT)
        snprintf(limit, sizeof limit, "the depth limit of %u nested backtracking points", MT_TOK_DEPTH_LIMIT);
    else
        snprintf(limit, sizeof limit, "what PCRE2 could do");
    mt_fail(c->err, c->errlen, "%s: key '%s': matching this regex on a %zu-byte stretch of text needs more than %s "
            "(PCRE2: %s); the pattern is pathological for this text: simplify it or split the text", c->tok->path,
            c->tok->split_key[step], n, limit, (const char *)msg);
    c->rc = -1;
}

/* One match of split step `step` in s[0..n) from start: PCRE2's code (match count, NOMATCH, or an
 * error). JIT first, on the tokenizer's JIT stack; a match that needs more stack than that runs
 * again in the interpreter, with its raised limits (state.h). */
static int split_match(mt_tokenizer *tok, int step, const char *s, size_t n, size_t start)
{
    int rc = PCRE2_ERROR_JIT_STACKLIMIT;
    if (tok->split_jit[step])
        rc = pcre2_match(tok->split[step], (PCRE2_SPTR)s, n, start, PCRE2_NO_UTF_CHECK, tok->match[step],
                         tok->jit_context);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
        rc = pcre2_match(tok->split[step], (PCRE2_SPTR)s, n, start, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT,
                         tok->match[step], tok->interp_context);
    return rc;
}

/* Applies split step `step` to valid UTF-8 s[0..n): matches and the gaps between them both become
 * pieces (Hugging Face's "Isolated"), each handed to the next step. Stops at the first failure. */
static void pre_tokenize(encode_ctx *c, const char *s, size_t n, int step)
{
    mt_tokenizer *tok = c->tok;
    if (c->rc) return;
    if (step == tok->n_split) {
        mt_tok_encode_word(tok, s, n, c->out);
        return;
    }
    size_t start = 0, last = 0;
    while (start < n && c->rc == 0) {
        int rc = split_match(tok, step, s, n, start);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) { /* only resource limits fail a match of valid UTF-8; wrong ids would be worse */
            match_failed(c, step, rc, n);
            return;
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(tok->match[step]);
        size_t ms = ov[0], me = ov[1];
        if (me == ms) { /* empty match: no piece; step over one character */
            if (ms >= n) break;
            start = ms + (size_t)utf8_len((const uint8_t *)s + ms, n - ms);
            continue;
        }
        if (ms > last) pre_tokenize(c, s + last, ms - last, step + 1);
        pre_tokenize(c, s + ms, me - ms, step + 1);
        last = start = me;
    }
    if (last < n) pre_tokenize(c, s + last, n - last, step + 1);
}

static const added_token *added_at(const mt_tokenizer *tok, const char *s, size_t n);

/* NFC of valid UTF-8 s[0..n), malloc'd (utf8proc: Unicode's own composition data, which no
 * hand-written table should copy); *m gets its length. NULL when n is 0 or utf8proc fails (it
 * cannot on valid UTF-8). */
static uint8_t *nfc_of(const char *s, size_t n, size_t *m)
{
    if (n == 0) return NULL;
    utf8proc_uint8_t *dst = NULL;
    utf8proc_ssize_t r = utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &dst,
                                      UTF8PROC_STABLE | UTF8PROC_COMPOSE);
    if (r < 0) return NULL; /* leave the text as it is */
    *m = (size_t)r;
    return dst;
}

/* NFC of a valid UTF-8 stretch when the tokenizer has that normalizer, else NULL. */
static uint8_t *nfc(const mt_tokenizer *tok, const char *s, size_t n, size_t *m)
{
    return tok->normalizer[0] ? nfc_of(s, n, m) : NULL;
}

/* Calls fn on each maximal stretch of valid UTF-8 (normalised: p, len) and each maximal run of
 * invalid bytes (as they are) of s[0..n), in order, with the stretch's original bytes (orig,
 * orig_len). */
static void for_each_stretch(const mt_tokenizer *tok, const char *s, size_t n,
                             void (*fn)(void *arg, const char *p, size_t len, bool valid, const char *orig,
                                        size_t orig_len),
                             void *arg)
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
            if (norm) fn(arg, (const char *)norm, m, true, s + i, j - i);
            else fn(arg, s + i, j - i, true, s + i, j - i);
            free(norm);
        }
        i = j;
        while (j < n && utf8_len(u + j, n - j) == 0) j++;
        if (j > i) fn(arg, s + i, j - i, false, s + i, j - i);
        i = j;
    }
}

/* ---- offsets through NFC */

/* A piece of a valid UTF-8 stretch that NFC maps on its own: its original and normalised lengths
 * and whether NFC changed its bytes. */
typedef struct nfc_piece { size_t orig_len, norm_len; bool changed; } nfc_piece;
typedef struct { nfc_piece *p; size_t len, cap; } piece_buf;

static void pieces_append(piece_buf *b, const char *s, size_t n)
{
    size_t m = 0;
    uint8_t *norm = nfc_of(s, n, &m);
    if (!norm) m = n;
    if (b->len == b->cap) {
        b->cap = b->cap * 2 + 16;
        b->p = mt_xrealloc(b->p, b->cap * sizeof *b->p);
    }
    b->p[b->len++] = (nfc_piece){ n, m, norm && (m != n || memcmp(norm, s, n) != 0) };
    free(norm);
}

/* Whether NFC(a + b) is NFC(a) followed by NFC(b) for a = s[0..na), b = s[na..na+nb). */
static bool nfc_splits(const char *s, size_t na, size_t nb)
{
    size_t ma = 0, mb = 0, mab = 0;
    uint8_t *a = nfc_of(s, na, &ma), *b = nfc_of(s + na, nb, &mb), *ab = nfc_of(s, na + nb, &mab);
    bool ok = a && b && ab && mab == ma + mb && memcmp(ab, a, ma) == 0 && memcmp(ab + ma, b, mb) == 0;
    free(a);
    free(b);
    free(ab);
    return ok;
}

static int32_t code_point_at(const char *s, size_t n, size_t i, size_t *len)
{
    utf8proc_int32_t cp;
    utf8proc_ssize_t k = utf8proc_iterate((const utf8proc_uint8_t *)s + i, (utf8proc_ssize_t)(n - i), &cp);
    *len = k > 0 ? (size_t)k : 1;
    return k > 0 ? cp : -1;
}

/* A pending piece longer than this is cut only before ASCII, whose boundaries cost no check: the
 * check normalises the whole pending piece, which a run of characters that NFC reorders together
 * (U+0F73 decomposes into marks) would make quadratic. */
#define NFC_PIECE_CHECKED_BYTES 256

/* The pieces of valid UTF-8 s[0..n) that NFC maps independently (NFC(s) is the concatenation of
 * their NFCs). A piece ends before a starter (combining class 0; reordering never crosses one,
 * and a starter composes with nothing but the character just before it) that composes with
 * nothing before it: always before ASCII, which is never the second character of a composition;
 * otherwise when NFC of the pending piece and the starter's run (it and the marks after it) is
 * their two NFCs side by side. Hangul jamo, which compose starter with starter, stay together. */
static void nfc_pieces(const char *s, size_t n, piece_buf *out)
{
    out->len = 0;
    size_t a = 0, i = 0, k;
    while (i < n) {
        int32_t cp = code_point_at(s, n, i, &k);
        if (i > a && (cp < 0x80 || (i - a <= NFC_PIECE_CHECKED_BYTES &&
                                    utf8proc_get_property(cp)->combining_class == 0))) {
            size_t j = i + k, kj;
            while (j < n && utf8proc_get_property(code_point_at(s, n, j, &kj))->combining_class != 0) j += kj;
            if (cp < 0x80 || nfc_splits(s + a, i - a, j - i)) {
                pieces_append(out, s + a, i - a);
                a = i;
            }
        }
        i += k;
    }
    if (n > a) pieces_append(out, s + a, n - a);
}

/* Offsets of the tokens ids[0..count) of a valid stretch orig[0..orig_len) (at `at` of the text)
 * that NFC turned into norm[0..norm_len): exact inside pieces NFC left as they were; a token that
 * starts inside a changed piece starts where that piece does. */
static void nfc_offsets(const mt_tokenizer *tok, const int32_t *ids, size_t count, const char *orig, size_t orig_len,
                        size_t norm_len, size_t at, off_buf *starts)
{
    piece_buf pieces = {0};
    nfc_pieces(orig, orig_len, &pieces);
    size_t total = 0;
    for (size_t k = 0; k < pieces.len; k++) total += pieces.p[k].norm_len;
    if (total != norm_len) { /* cannot happen (NFC is piecewise by construction); stay in bounds */
        pieces.len = 1;
        pieces.p[0] = (nfc_piece){ orig_len, norm_len, true };
    }
    size_t q = 0, k = 0, norm_at = 0, orig_at = 0; /* q: the token's start in the normalised text */
    for (size_t i = 0; i < count; i++) {
        while (k + 1 < pieces.len && q >= norm_at + pieces.p[k].norm_len) {
            norm_at += pieces.p[k].norm_len;
            orig_at += pieces.p[k].orig_len;
            k++;
        }
        size_t inside = q - norm_at;
        if (pieces.p[k].changed || inside > pieces.p[k].orig_len) inside = 0;
        offs_append(starts, at + orig_at + inside);
        q += (size_t)tok->piece_len[ids[i]];
    }
    free(pieces.p);
}

/* ---- encoding */

static void encode_stretch(void *arg, const char *p, size_t len, bool valid, const char *orig, size_t orig_len)
{
    encode_ctx *c = arg;
    size_t first_new = c->out->len;
    if (valid) pre_tokenize(c, p, len, 0);
    else mt_tok_encode_word(c->tok, p, len, c->out);
    if (!c->starts || c->rc) return;
    size_t at = (size_t)(orig - c->text);
    if (p != orig && (len != orig_len || memcmp(p, orig, len) != 0)) {
        nfc_offsets(c->tok, c->out->p + first_new, c->out->len - first_new, orig, orig_len, len, at, c->starts);
        return;
    }
    /* the text as it stands: byte-level tokens hold its bytes in order, so their running sum */
    for (size_t i = first_new; i < c->out->len; i++) {
        offs_append(c->starts, at);
        at += (size_t)c->tok->piece_len[c->out->p[i]];
    }
}

static void append_stretch(void *arg, const char *p, size_t len, bool valid, const char *orig, size_t orig_len)
{
    (void)valid;
    (void)orig;
    (void)orig_len;
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
         * thread-unsafe as encode. Neither fails: these files have no regex, and the ids are ours. */
        size_t n;
        char err[512];
        int32_t *ids = mt_tokenizer_encode((mt_tokenizer *)tok, text, len, &n, err, sizeof err);
        char *out = ids ? mt_tokenizer_decode(tok, ids, n, out_len, err, sizeof err) : NULL;
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

/* Text between added tokens: SentencePiece-style, one section; byte-level, valid UTF-8 stretches
 * are normalised and pre-tokenised as whole strings, and each maximal run of invalid bytes is a
 * word of its own (the regex never sees invalid UTF-8). */
static void encode_text(void *arg, const char *s, size_t n)
{
    encode_ctx *c = arg;
    if (c->rc) return;
    size_t at = (size_t)(s - c->text);
    if (c->tok->spm) mt_tok_spm_encode(c->tok, s, n, s == c->text, at, c->out, c->starts);
    else for_each_stretch(c->tok, s, n, encode_stretch, c);
    c->cursor = at + n;
}

static void encode_added(void *arg, const added_token *t)
{
    encode_ctx *c = arg;
    if (c->rc) return;
    ids_append(c->out, &t->id, 1);
    if (c->starts) offs_append(c->starts, c->cursor);
    c->cursor += t->len;
}

/* Both encode entry points: the ids, and each token's start when starts is not NULL. */
static int32_t *encode_all(mt_tokenizer *tok, const char *text, size_t len, size_t *count, off_buf *starts, char *err,
                           size_t errlen)
{
    id_buf out = { mt_xmalloc(16 * sizeof(int32_t)), 0, 16 }; /* never NULL: NULL means failure */
    encode_ctx c = { tok, &out, text, starts, 0, err, errlen, 0 };
    for_each_added_split(tok, text, len, encode_text, encode_added, &c);
    *count = c.rc ? 0 : out.len;
    if (c.rc) {
        free(out.p);
        return NULL;
    }
    return out.p;
}

int32_t *mt_tokenizer_encode(mt_tokenizer *tok, const char *text, size_t len, size_t *count, char *err, size_t errlen)
{
    return encode_all(tok, text, len, count, NULL, err, errlen);
}

int32_t *mt_tokenizer_encode_offsets(mt_tokenizer *tok, const char *text, size_t len, size_t *count, size_t **starts,
                                     char *err, size_t errlen)
{
    off_buf st = {0};
    offs_append(&st, 0); /* never empty, so the caller always gets an array */
    st.len = 0;
    int32_t *ids = encode_all(tok, text, len, count, &st, err, errlen);
    if (!ids) {
        free(st.p);
        *starts = NULL;
        return NULL;
    }
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
