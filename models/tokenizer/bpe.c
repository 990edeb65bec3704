/* BPE merges over words and SentencePiece-style sections, and the word cache (bpe.h). */
#include "models/tokenizer/bpe.h"

#include <stdlib.h>
#include <string.h>

/* Words up to this many bytes go into the cache; longer ones are rare and would crowd it. */
#define CACHE_MAX_WORD 256
/* The cache is emptied when it holds this many words or bytes, which bounds its memory (~20 MB). */
#define CACHE_MAX_WORDS (1u << 17)
#define CACHE_MAX_BYTES (8u << 20)

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
        tok->sym = mt_xrealloc(tok->sym, tok->scratch_cap * sizeof *tok->sym);
        tok->prev = mt_xrealloc(tok->prev, tok->scratch_cap * sizeof *tok->prev);
        tok->next = mt_xrealloc(tok->next, tok->scratch_cap * sizeof *tok->next);
        tok->heap = mt_xrealloc(tok->heap, tok->scratch_cap * sizeof *tok->heap);
        tok->pos = mt_xrealloc(tok->pos, tok->scratch_cap * sizeof *tok->pos);
    }
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
    bool lead = n >= 3 && memcmp(s, MT_TOK_METASPACE, 3) == 0;
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
        bool meta = i + 3 <= n && memcmp(s + i, MT_TOK_METASPACE, 3) == 0;
        bytes_append(out, meta ? " " : s + i, 1);
        if (orig) offs_append(orig, at + i);
        i += meta ? 3 : 1;
    }
}

/* A SentencePiece-style section: one word (no regex), each well-formed character its vocabulary
 * token or its bytes' fallback tokens, each byte of malformed UTF-8 its fallback token; then the
 * merges (fallback tokens take part in none). */
void mt_tok_spm_encode(mt_tokenizer *tok, const char *s, size_t n, bool first, size_t at, id_buf *out,
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
void mt_tok_encode_word(mt_tokenizer *tok, const char *word, size_t n, id_buf *out)
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
        mt_tok_str_map_clear(&tok->cache);
        tok->cache_bytes.len = 0;
        tok->cache_ids.len = 0;
    }
    uint32_t key_off = (uint32_t)tok->cache_bytes.len;
    bytes_append(&tok->cache_bytes, word, n);
    int32_t ids_off = (int32_t)tok->cache_ids.len;
    ids_append(&tok->cache_ids, out->p + start, out->len - start);
    mt_tok_str_map_insert(&tok->cache, tok->cache_bytes.p, key_off, (uint32_t)n, ids_off, (int32_t)(out->len - start));
}
