/* `megatrain prepare` and the prepared-data reader: documents are rendered (chat template or
 * plain text), tokenised with a per-token loss mask, shuffled by document, split, packed into
 * fixed windows and written as checksummed shards next to a meta.json. */
#include "runtime/dataset.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "runtime/data.h"
#include "models/tokenizer.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "shards are read and written as little-endian memory images"
#endif

static const char *format_names[] = { "text", "alpaca", "sharegpt" };

/* FNV-1a 64 over n bytes, continuing from h (start with 0xcbf29ce484222325). */
static uint64_t fnv1a(uint64_t h, const void *data, size_t n)
{
    const uint8_t *p = data;
    for (size_t i = 0; i < n; i++) { h ^= p[i]; h *= 0x100000001b3ULL; }
    return h;
}
#define FNV_START 0xcbf29ce484222325ULL

static void put_u32(uint8_t *p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i)); }
static void put_u64(uint8_t *p, uint64_t v) { for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i)); }
static uint32_t get_u32(const uint8_t *p) { uint32_t v = 0; for (int i = 3; i >= 0; i--) v = v << 8 | p[i]; return v; }
static uint64_t get_u64(const uint8_t *p) { uint64_t v = 0; for (int i = 7; i >= 0; i--) v = v << 8 | p[i]; return v; }

/* malloc that aborts: preparation holds whole inputs in memory and has no partial state to save. */
static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) { fprintf(stderr, "megatrain: out of memory (%zu bytes)\n", n); abort(); }
    return p;
}

static void *xrealloc(void *p, size_t n)
{
    p = realloc(p, n ? n : 1);
    if (!p) { fprintf(stderr, "megatrain: out of memory (%zu bytes)\n", n); abort(); }
    return p;
}

/* ---- shards ------------------------------------------------------------------------------- */

int mt_shard_write(const char *path, int64_t seq_len, int64_t n_seq, const int32_t *tokens, const uint8_t *mask,
                   char *err, size_t errlen)
{
    size_t count = (size_t)n_seq * (size_t)(seq_len + 1);
    uint8_t header[MT_SHARD_HEADER_BYTES] = { 0 };
    memcpy(header, MT_SHARD_MAGIC, 8);
    put_u32(header + 8, MT_SHARD_VERSION);
    put_u32(header + 12, MT_SHARD_HEADER_BYTES);
    put_u64(header + 16, (uint64_t)seq_len);
    put_u64(header + 24, (uint64_t)n_seq);
    put_u32(header + 32, MT_SHARD_DTYPE_INT32);
    put_u32(header + 36, MT_SHARD_DTYPE_UINT8);
    put_u64(header + 40, fnv1a(fnv1a(FNV_START, tokens, count * 4), mask, count));
    FILE *f = fopen(path, "wb");
    if (!f) { snprintf(err, errlen, "%s: cannot create: %s", path, strerror(errno)); return -1; }
    bool ok = fwrite(header, 1, sizeof header, f) == sizeof header && fwrite(tokens, 4, count, f) == count &&
              fwrite(mask, 1, count, f) == count && fflush(f) == 0 && fsync(fileno(f)) == 0;
    int e = errno;
    if (fclose(f) != 0) ok = false;
    if (!ok) { snprintf(err, errlen, "%s: write failed: %s", path, strerror(e)); return -1; }
    return 0;
}

int mt_shard_read(const char *path, int64_t *seq_len, int64_t *n_seq, int32_t **tokens, uint8_t **mask,
                  char *err, size_t errlen)
{
    *tokens = NULL;
    *mask = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) { snprintf(err, errlen, "%s: cannot open: %s", path, strerror(errno)); return -1; }
    uint8_t h[MT_SHARD_HEADER_BYTES];
    struct stat sb;
    if (fread(h, 1, sizeof h, f) != sizeof h || memcmp(h, MT_SHARD_MAGIC, 8) != 0) {
        snprintf(err, errlen, "%s: not a megatrain shard (no '" MT_SHARD_MAGIC "' header)", path);
        fclose(f);
        return -1;
    }
    uint32_t version = get_u32(h + 8);
    uint64_t T = get_u64(h + 16), n = get_u64(h + 24);
    if (version != MT_SHARD_VERSION || get_u32(h + 12) != MT_SHARD_HEADER_BYTES ||
        get_u32(h + 32) != MT_SHARD_DTYPE_INT32 || get_u32(h + 36) != MT_SHARD_DTYPE_UINT8) {
        snprintf(err, errlen, "%s: shard version %u with header %u bytes, dtypes %u/%u; this build reads version %d "
                 "(int32 tokens, uint8 mask): prepare the data again", path, version, get_u32(h + 12), get_u32(h + 32),
                 get_u32(h + 36), MT_SHARD_VERSION);
        fclose(f);
        return -1;
    }
    fstat(fileno(f), &sb);
    if (T < 1 || T > (1u << 24) || n > (uint64_t)INT64_MAX / 5 / (T + 1) ||
        (uint64_t)sb.st_size != MT_SHARD_HEADER_BYTES + n * (T + 1) * 5) {
        snprintf(err, errlen, "%s: the header says %llu sequences of %llu + 1 tokens (%llu bytes) but the file has %lld bytes "
                 "(truncated or corrupt)", path, (unsigned long long)n, (unsigned long long)T,
                 (unsigned long long)(MT_SHARD_HEADER_BYTES + n * (T + 1) * 5), (long long)sb.st_size);
        fclose(f);
        return -1;
    }
    size_t count = (size_t)(n * (T + 1));
    *tokens = xmalloc(count * 4);
    *mask = xmalloc(count);
    if (fread(*tokens, 4, count, f) != count || fread(*mask, 1, count, f) != count) {
        snprintf(err, errlen, "%s: read failed", path);
        goto fail;
    }
    if (fnv1a(fnv1a(FNV_START, *tokens, count * 4), *mask, count) != get_u64(h + 40)) {
        snprintf(err, errlen, "%s: checksum mismatch (corrupt shard): prepare the data again", path);
        goto fail;
    }
    fclose(f);
    *seq_len = (int64_t)T;
    *n_seq = (int64_t)n;
    return 0;
fail:
    fclose(f);
    free(*tokens); free(*mask);
    *tokens = NULL; *mask = NULL;
    return -1;
}

/* ---- documents ---------------------------------------------------------------------------- */

/* Every document's tokens and mask, concatenated; document i is offsets[i]..offsets[i+1]. */
typedef struct doc_set {
    int32_t *tokens;
    uint8_t *mask;
    int64_t ntok, cap;
    int64_t *offsets;
    int64_t ndocs, doc_cap;
} doc_set;

static void docs_add(doc_set *s, const int32_t *ids, const uint8_t *mask, int64_t n)
{
    if (s->ntok + n > s->cap) {
        while (s->ntok + n > s->cap) s->cap = s->cap ? s->cap * 2 : 1 << 16;
        s->tokens = xrealloc(s->tokens, sizeof *s->tokens * s->cap);
        s->mask = xrealloc(s->mask, s->cap);
    }
    memcpy(s->tokens + s->ntok, ids, sizeof *ids * n);
    memcpy(s->mask + s->ntok, mask, n);
    s->ntok += n;
    if (s->ndocs + 2 > s->doc_cap) {
        s->doc_cap = s->doc_cap ? s->doc_cap * 2 : 1024;
        s->offsets = xrealloc(s->offsets, sizeof *s->offsets * s->doc_cap);
    }
    s->offsets[0] = 0;
    s->offsets[++s->ndocs] = s->ntok;
}

static void docs_free(doc_set *s) { free(s->tokens); free(s->mask); free(s->offsets); }

/* What one preparation run shares: the tokenizer, byte lengths of ids, progress state. */
typedef struct prep {
    const mt_prepare_options *o;
    mt_tokenizer *tok;
    doc_set docs;
    FILE *log;
    double last_progress;
} prep;

static double seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Tokenises text and adds it as a document: a token is trained when the text it covers overlaps a
 * span (all tokens when spans is NULL), as HF's assistant masks map character spans to tokens.
 * The tokenizer says where each token starts (a SentencePiece-style token may carry a space the
 * text does not have, so the tokens' own lengths would drift from the text). */
static void add_document(prep *p, const char *text, size_t len, const mt_chat_span *spans, int nspans)
{
    size_t n, *starts;
    int32_t *ids = mt_tokenizer_encode_offsets(p->tok, text, len, &n, &starts);
    uint8_t *mask = xmalloc(n);
    int s = 0;
    for (size_t i = 0; i < n; i++) {
        size_t pos = starts[i], end = i + 1 < n ? starts[i + 1] : len;
        if (!spans) mask[i] = 1;
        else {
            while (s < nspans && spans[s].end <= pos) s++;
            mask[i] = s < nspans && spans[s].start < end && pos < spans[s].end;
        }
    }
    if (n > 0) docs_add(&p->docs, ids, mask, (int64_t)n);
    free(ids);
    free(starts);
    free(mask);
}

/* Reads a whole file; NULL with err naming it. */
static char *read_file(const char *path, size_t *len, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    if (!f) { snprintf(err, errlen, "%s: cannot open: %s", path, strerror(errno)); return NULL; }
    size_t cap = 1 << 16, n = 0;
    char *buf = xmalloc(cap + 1);
    size_t got;
    while ((got = fread(buf + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) { cap *= 2; buf = xrealloc(buf, cap + 1); }
    }
    bool bad = ferror(f);
    fclose(f);
    if (bad) { snprintf(err, errlen, "%s: read failed", path); free(buf); return NULL; }
    buf[n] = 0;
    *len = n;
    return buf;
}

static void progress(prep *p, const char *path, int64_t line, size_t done, size_t total, bool final)
{
    if (!p->log) return;
    double t = seconds();
    if (!final && t - p->last_progress < 2.0) return;
    p->last_progress = t;
    fprintf(p->log, "prepare: %s: %lld lines, %.1f of %.1f MB, %lld documents, %lld tokens\n", path, (long long)line,
            done / 1e6, total / 1e6, (long long)p->docs.ndocs, (long long)p->docs.ntok);
    fflush(p->log);
}

/* Plain text: paragraphs (runs of non-blank lines, without the final newline) or the whole file. */
static int read_text(prep *p, const char *path, char *err, size_t errlen)
{
    size_t len;
    char *buf = read_file(path, &len, err, errlen);
    if (!buf) return -1;
    if (p->o->text_unit == MT_TEXT_FILE) {
        if (len > 0) add_document(p, buf, len, NULL, 0);
    } else {
        size_t i = 0, start = 0, end = 0; /* current paragraph [start, end) */
        bool in_par = false;
        int64_t line = 0;
        while (i < len) {
            size_t eol = i;
            while (eol < len && buf[eol] != '\n') eol++;
            bool blank = true;
            for (size_t k = i; k < eol; k++)
                if (buf[k] != ' ' && buf[k] != '\t' && buf[k] != '\r') { blank = false; break; }
            if (!blank) {
                if (!in_par) { start = i; in_par = true; }
                end = eol;
            } else if (in_par) {
                add_document(p, buf + start, end - start, NULL, 0);
                in_par = false;
            }
            i = eol + 1;
            progress(p, path, ++line, i < len ? i : len, len, false);
        }
        if (in_par) add_document(p, buf + start, end - start, NULL, 0);
    }
    progress(p, path, 0, len, len, true);
    free(buf);
    return 0;
}

static const char *json_type_name(const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: case JSON_REAL: return "a number";
    case JSON_TRUE: case JSON_FALSE: return "a boolean";
    case JSON_NULL: return "null";
    }
    return "?";
}

/* The string at key: required (error when missing), or optional (NULL when missing or null). */
static int get_string(json_t *obj, const char *key, bool required, const char **out, const char *where,
                      char *err, size_t errlen)
{
    json_t *v = json_object_get(obj, key);
    *out = NULL;
    if (!v || (!required && json_is_null(v))) {
        if (!required) return 0;
        snprintf(err, errlen, "%s: key '%s' is missing", where, key);
        return -1;
    }
    if (!json_is_string(v)) {
        snprintf(err, errlen, "%s: key '%s' must be a string, got %s", where, key, json_type_name(v));
        return -1;
    }
    *out = json_string_value(v);
    return 0;
}

/* Maps a sharegpt "from" (or OpenAI "role") value to a role; -1 for an unknown one. */
static int parse_role(const char *s, mt_chat_role *r)
{
    if (!strcmp(s, "system")) *r = MT_ROLE_SYSTEM;
    else if (!strcmp(s, "human") || !strcmp(s, "user")) *r = MT_ROLE_USER;
    else if (!strcmp(s, "gpt") || !strcmp(s, "assistant") || !strcmp(s, "model") || !strcmp(s, "chatgpt")) *r = MT_ROLE_ASSISTANT;
    else return -1;
    return 0;
}

/* One JSONL record to messages (at most *n), rendered and added. where = "FILE:LINE". */
static int add_record(prep *p, json_t *rec, const char *where, char *err, size_t errlen)
{
    if (!json_is_object(rec)) {
        snprintf(err, errlen, "%s: a record must be a JSON object, got %s", where, json_type_name(rec));
        return -1;
    }
    mt_chat_message *msgs = NULL;
    int n = 0;
    char *user = NULL;
    int rc = -1;
    if (p->o->format == MT_INPUT_ALPACA) {
        const char *instruction, *input, *output, *system;
        if (get_string(rec, "instruction", true, &instruction, where, err, errlen) ||
            get_string(rec, "input", false, &input, where, err, errlen) ||
            get_string(rec, "output", true, &output, where, err, errlen) ||
            get_string(rec, "system", false, &system, where, err, errlen)) return -1;
        msgs = xmalloc(sizeof *msgs * 3);
        if (system && *system) msgs[n++] = (mt_chat_message){ MT_ROLE_SYSTEM, system };
        if (input && *input) {
            user = xmalloc(strlen(instruction) + strlen(input) + 3);
            sprintf(user, "%s\n\n%s", instruction, input);
            msgs[n++] = (mt_chat_message){ MT_ROLE_USER, user };
        } else msgs[n++] = (mt_chat_message){ MT_ROLE_USER, instruction };
        msgs[n++] = (mt_chat_message){ MT_ROLE_ASSISTANT, output };
    } else {
        const char *list_key = "conversations", *role_key = "from", *text_key = "value";
        json_t *conv = json_object_get(rec, list_key);
        if (!conv && json_object_get(rec, "messages")) { list_key = "messages"; role_key = "role"; text_key = "content"; conv = json_object_get(rec, list_key); }
        if (!conv) { snprintf(err, errlen, "%s: key 'conversations' is missing", where); return -1; }
        if (!json_is_array(conv)) {
            snprintf(err, errlen, "%s: key '%s' must be an array, got %s", where, list_key, json_type_name(conv));
            return -1;
        }
        msgs = xmalloc(sizeof *msgs * (json_array_size(conv) + 1));
        for (size_t i = 0; i < json_array_size(conv); i++) {
            json_t *m = json_array_get(conv, i);
            char at[1200];
            snprintf(at, sizeof at, "%s: %s[%zu]", where, list_key, i);
            if (!json_is_object(m)) {
                snprintf(err, errlen, "%s: must be an object, got %s", at, json_type_name(m));
                goto out;
            }
            const char *role, *text;
            if (get_string(m, role_key, true, &role, at, err, errlen) || get_string(m, text_key, true, &text, at, err, errlen)) goto out;
            mt_chat_role r;
            if (parse_role(role, &r)) {
                snprintf(err, errlen, "%s: unknown %s '%s' (system, human/user, gpt/assistant)", at, role_key, role);
                goto out;
            }
            msgs[n++] = (mt_chat_message){ r, text };
        }
    }
    mt_chat_rendered r;
    char why[512];
    if (mt_chat_render(p->o->family, msgs, n, &r, why, sizeof why)) {
        snprintf(err, errlen, "%s: %s", where, why);
        goto out;
    }
    add_document(p, r.text, r.len, r.spans, r.nspans);
    mt_chat_rendered_free(&r);
    rc = 0;
out:
    free(msgs);
    free(user);
    return rc;
}

static int read_jsonl(prep *p, const char *path, char *err, size_t errlen)
{
    size_t len;
    char *buf = read_file(path, &len, err, errlen);
    if (!buf) return -1;
    int64_t line = 0;
    size_t i = 0;
    int rc = 0;
    while (i < len && rc == 0) {
        size_t eol = i;
        while (eol < len && buf[eol] != '\n') eol++;
        line++;
        size_t k = i;
        while (k < eol && (buf[k] == ' ' || buf[k] == '\t' || buf[k] == '\r')) k++;
        if (k < eol) {
            char where[1100];
            snprintf(where, sizeof where, "%s:%lld", path, (long long)line);
            json_error_t je;
            json_t *rec = json_loadb(buf + i, eol - i, 0, &je);
            if (!rec) {
                snprintf(err, errlen, "%s: invalid JSON: %s (column %d)", where, je.text, je.column);
                rc = -1;
            } else {
                rc = add_record(p, rec, where, err, errlen);
                json_decref(rec);
            }
        }
        i = eol + 1;
        progress(p, path, line, i < len ? i : len, len, false);
    }
    if (rc == 0) progress(p, path, line, len, len, true);
    free(buf);
    return rc;
}

static int compare_names(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* The input files: the path itself, or a directory's regular files (not hidden) in name order. */
static char **list_inputs(const char *path, int *count, char *err, size_t errlen)
{
    struct stat sb;
    *count = 0;
    if (stat(path, &sb) != 0) { snprintf(err, errlen, "%s: %s", path, strerror(errno)); return NULL; }
    char **names = NULL;
    if (!S_ISDIR(sb.st_mode)) {
        names = xmalloc(sizeof *names);
        names[0] = strdup(path);
        *count = 1;
        return names;
    }
    DIR *d = opendir(path);
    if (!d) { snprintf(err, errlen, "%s: cannot open directory: %s", path, strerror(errno)); return NULL; }
    struct dirent *e;
    int n = 0;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char full[4400];
        snprintf(full, sizeof full, "%s/%s", path, e->d_name);
        if (lstat(full, &sb) != 0 || !S_ISREG(sb.st_mode)) continue;
        names = xrealloc(names, sizeof *names * (n + 1));
        names[n++] = strdup(full);
    }
    closedir(d);
    if (n == 0) { snprintf(err, errlen, "%s: the directory holds no regular files", path); return NULL; }
    qsort(names, n, sizeof *names, compare_names);
    *count = n;
    return names;
}

/* ---- split and packing -------------------------------------------------------------------- */

void mt_dataset_split_order(int64_t ndocs, double val_fraction, uint64_t seed, int64_t *order, int64_t *nval)
{
    for (int64_t i = 0; i < ndocs; i++) order[i] = i;
    mt_rng r;
    mt_rng_seed(&r, seed);
    for (int64_t i = ndocs - 1; i > 0; i--) {
        int64_t j = (int64_t)(mt_rng_next(&r) % (uint64_t)(i + 1));
        int64_t t = order[i]; order[i] = order[j]; order[j] = t;
    }
    int64_t v = (int64_t)(val_fraction * (double)ndocs + 0.5);
    if (val_fraction > 0 && v < 1) v = 1;
    if (v > ndocs - 1) v = ndocs - 1;
    if (v < 0) v = 0;
    *nval = v;
}

int64_t mt_dataset_pack(const int32_t *tokens, const uint8_t *mask, const int64_t *offsets, const int64_t *order,
                        int64_t ndocs, int32_t separator, uint8_t separator_mask, int64_t T,
                        int32_t **tokens_out, uint8_t **mask_out)
{
    int64_t n = 0;
    for (int64_t i = 0; i < ndocs; i++) n += offsets[order[i] + 1] - offsets[order[i]] + 1;
    int64_t windows = n >= 2 ? (n - 1 + T - 1) / T : 0;
    int64_t total = windows * (T + 1);
    int32_t *stream = xmalloc(sizeof *stream * (size_t)(windows * T + 1));
    uint8_t *smask = xmalloc((size_t)(windows * T + 1));
    int64_t pos = 0;
    for (int64_t i = 0; i < ndocs; i++) {
        int64_t a = offsets[order[i]], b = offsets[order[i] + 1];
        memcpy(stream + pos, tokens + a, sizeof *stream * (b - a));
        memcpy(smask + pos, mask + a, b - a);
        pos += b - a;
        stream[pos] = separator;
        smask[pos++] = separator_mask;
    }
    for (; pos < windows * T + 1; pos++) { stream[pos] = separator; smask[pos] = 0; }
    int32_t *tok = xmalloc(sizeof *tok * (size_t)total);
    uint8_t *msk = xmalloc((size_t)total);
    for (int64_t w = 0; w < windows; w++) {
        memcpy(tok + w * (T + 1), stream + w * T, sizeof *tok * (T + 1));
        memcpy(msk + w * (T + 1), smask + w * T, T + 1);
    }
    free(stream);
    free(smask);
    *tokens_out = tok;
    *mask_out = msk;
    return windows;
}

/* ---- output ------------------------------------------------------------------------------- */

/* Removes the files prepare writes into dir and dir itself (cleanup after a failure). */
static void remove_output(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (strcmp(e->d_name, "meta.json") && strncmp(e->d_name, "train-", 6) && strncmp(e->d_name, "val-", 4)) continue;
        char full[4400];
        snprintf(full, sizeof full, "%s/%s", dir, e->d_name);
        unlink(full);
    }
    closedir(d);
    rmdir(dir);
}

/* Packs one split and writes its shards; fills the split's meta object. */
static int write_split(prep *p, const char *tmp, const char *name, const int64_t *order, int64_t ndocs,
                       int32_t separator, uint8_t separator_mask, json_t *meta, int64_t *res, char *err, size_t errlen)
{
    const int64_t T = p->o->seq_len;
    int32_t *tok;
    uint8_t *mask;
    int64_t windows = mt_dataset_pack(p->docs.tokens, p->docs.mask, p->docs.offsets, order, ndocs, separator,
                                      separator_mask, T, &tok, &mask);
    int64_t ntok = 0, trained = 0;
    for (int64_t i = 0; i < ndocs; i++) ntok += p->docs.offsets[order[i] + 1] - p->docs.offsets[order[i]] + 1;
    for (int64_t w = 0; w < windows; w++)
        for (int64_t t = 1; t <= T; t++) trained += mask[w * (T + 1) + t];
    int64_t per_shard = p->o->shard_sequences > 0 ? p->o->shard_sequences : ((int64_t)256 << 20) / (4 * (T + 1));
    if (per_shard < 1) per_shard = 1;
    json_t *shards = json_array();
    int rc = 0;
    for (int64_t first = 0, k = 0; first < windows; first += per_shard, k++) {
        int64_t count = windows - first < per_shard ? windows - first : per_shard;
        char file[64], path[4200];
        snprintf(file, sizeof file, "%s-%05lld.bin", name, (long long)k);
        snprintf(path, sizeof path, "%s/%s", tmp, file);
        if (mt_shard_write(path, T, count, tok + first * (T + 1), mask + first * (T + 1), err, errlen)) { rc = -1; break; }
        json_array_append_new(shards, json_string(file));
    }
    free(tok);
    free(mask);
    json_t *s = json_object();
    json_object_set_new(s, "documents", json_integer(ndocs));
    json_object_set_new(s, "sequences", json_integer(windows));
    json_object_set_new(s, "tokens", json_integer(ntok));
    json_object_set_new(s, "trained_targets", json_integer(trained));
    json_object_set_new(s, "shards", shards);
    json_object_set_new(meta, name, s);
    res[0] = ndocs; res[1] = windows; res[2] = ntok; res[3] = trained;
    return rc;
}

/* Hex FNV-1a 64 of a file's bytes. */
static int file_hash(const char *path, char *hex, char *err, size_t errlen)
{
    size_t len;
    char *buf = read_file(path, &len, err, errlen);
    if (!buf) return -1;
    snprintf(hex, 17, "%016llx", (unsigned long long)fnv1a(FNV_START, buf, len));
    free(buf);
    return 0;
}

mt_prepare_options mt_prepare_defaults(void)
{
    return (mt_prepare_options){ .format = MT_INPUT_TEXT, .family = MT_CHAT_QWEN3, .text_unit = MT_TEXT_PARAGRAPH,
                                 .seq_len = 2048, .val_fraction = 0.05, .seed = 1234 };
}

/* Checks that the family's special tokens are single tokens of this tokenizer. */
static int check_special_tokens(prep *p, char *err, size_t errlen)
{
    for (const char *const *s = mt_chat_special_tokens(p->o->family); *s; s++) {
        size_t n = 0;
        int32_t *ids = mt_tokenizer_encode(p->tok, *s, strlen(*s), &n);
        bool one = n == 1 && ids[0] == mt_tokenizer_token_id(p->tok, *s);
        free(ids);
        if (!one) {
            snprintf(err, errlen, "%s: family %s needs '%s' as one token and this tokenizer has no such token: use the "
                     "family's own tokenizer.json", p->o->tokenizer_path, mt_chat_family_name(p->o->family), *s);
            return -1;
        }
    }
    return 0;
}

int mt_prepare(const mt_prepare_options *o, mt_prepare_result *res, FILE *log, char *err, size_t errlen)
{
    memset(res, 0, sizeof *res);
    if (o->seq_len < 1) { snprintf(err, errlen, "--seq-len must be at least 1"); return -1; }
    if (!(o->val_fraction >= 0 && o->val_fraction < 1)) { snprintf(err, errlen, "--val-fraction must be in [0, 1)"); return -1; }
    struct stat sb;
    if (stat(o->output_dir, &sb) == 0) {
        snprintf(err, errlen, "%s exists: remove it or choose another --output", o->output_dir);
        return -1;
    }
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", o->output_dir);
    if (stat(tmp, &sb) == 0) {
        snprintf(err, errlen, "%s exists (left by an interrupted prepare?): remove it", tmp);
        return -1;
    }
    prep p = { .o = o, .log = log, .last_progress = seconds() };
    p.tok = mt_tokenizer_load(o->tokenizer_path, err, errlen);
    if (!p.tok) return -1;
    int rc = -1, nfiles = 0;
    char **files = NULL;
    int64_t *order = NULL;
    json_t *meta = NULL;
    bool made_tmp = false;
    if (check_special_tokens(&p, err, errlen)) goto out;
    int32_t vocab = mt_tokenizer_vocab_size(p.tok);
    files = list_inputs(o->input_path, &nfiles, err, errlen);
    if (!files) goto out;
    for (int i = 0; i < nfiles; i++)
        if ((o->format == MT_INPUT_TEXT ? read_text : read_jsonl)(&p, files[i], err, errlen)) goto out;
    if (p.docs.ndocs == 0) { snprintf(err, errlen, "%s: no documents (empty input)", o->input_path); goto out; }
    if (o->val_fraction > 0 && p.docs.ndocs < 2) {
        snprintf(err, errlen, "%s: 1 document cannot be split for validation: add documents or use --val-fraction 0",
                 o->input_path);
        goto out;
    }
    int64_t nval;
    order = xmalloc(sizeof *order * p.docs.ndocs);
    mt_dataset_split_order(p.docs.ndocs, o->val_fraction, o->seed, order, &nval);
    const char *sep_text = mt_chat_separator(o->family);
    int32_t sep = mt_tokenizer_token_id(p.tok, sep_text);
    uint8_t sep_mask = o->format == MT_INPUT_TEXT;
    char hash[17];
    if (file_hash(o->tokenizer_path, hash, err, errlen)) goto out;
    if (mkdir(tmp, 0777) != 0) { snprintf(err, errlen, "%s: cannot create: %s", tmp, strerror(errno)); goto out; }
    made_tmp = true;
    meta = json_object();
    char real[PATH_MAX];
    json_t *tj = json_object();
    json_object_set_new(tj, "path", json_string(realpath(o->tokenizer_path, real) ? real : o->tokenizer_path));
    json_object_set_new(tj, "fnv1a64", json_string(hash));
    json_object_set_new(tj, "vocab_size", json_integer(vocab));
    json_object_set_new(meta, "format", json_string("megatrain-token-shards"));
    json_object_set_new(meta, "version", json_integer(MT_SHARD_VERSION));
    json_object_set_new(meta, "tokenizer", tj);
    json_object_set_new(meta, "family", json_string(mt_chat_family_name(o->family)));
    json_object_set_new(meta, "input", json_string(o->input_path));
    json_object_set_new(meta, "input_format", json_string(format_names[o->format]));
    if (o->format == MT_INPUT_TEXT)
        json_object_set_new(meta, "text_unit", json_string(o->text_unit == MT_TEXT_FILE ? "file" : "paragraph"));
    json_object_set_new(meta, "seq_len", json_integer(o->seq_len));
    json_object_set_new(meta, "seed", json_integer((json_int_t)o->seed));
    json_object_set_new(meta, "val_fraction", json_real(o->val_fraction));
    json_t *sj = json_object();
    json_object_set_new(sj, "token", json_string(sep_text));
    json_object_set_new(sj, "id", json_integer(sep));
    json_object_set_new(sj, "mask", json_integer(sep_mask));
    json_object_set_new(meta, "separator", sj);
    int64_t tr[4], va[4];
    if (write_split(&p, tmp, "train", order + nval, p.docs.ndocs - nval, sep, sep_mask, meta, tr, err, errlen) ||
        write_split(&p, tmp, "val", order, nval, sep, sep_mask, meta, va, err, errlen)) goto out;
    if (tr[1] == 0) { snprintf(err, errlen, "%s: no training window (too little text)", o->input_path); goto out; }
    char mpath[4200];
    snprintf(mpath, sizeof mpath, "%s/meta.json", tmp);
    if (json_dump_file(meta, mpath, JSON_INDENT(2) | JSON_SORT_KEYS)) {
        snprintf(err, errlen, "%s: cannot write", mpath);
        goto out;
    }
    int fd = open(tmp, O_RDONLY);
    if (fd >= 0) { fsync(fd); close(fd); }
    if (rename(tmp, o->output_dir) != 0) {
        snprintf(err, errlen, "cannot rename %s to %s: %s", tmp, o->output_dir, strerror(errno));
        goto out;
    }
    made_tmp = false;
    for (int k = 0; k < 4; k++) {
        int64_t *dst[4] = { res->documents, res->sequences, res->tokens, res->trained };
        dst[k][0] = tr[k];
        dst[k][1] = va[k];
    }
    if (log) fprintf(log, "prepare: %s: %lld + %lld documents, %lld + %lld windows of %lld + 1 tokens, %lld + %lld trained "
                     "targets (train + validation)\n", o->output_dir, (long long)tr[0], (long long)va[0], (long long)tr[1],
                     (long long)va[1], (long long)o->seq_len, (long long)tr[3], (long long)va[3]);
    rc = 0;
out:
    if (made_tmp) remove_output(tmp);
    json_decref(meta);
    for (int i = 0; i < nfiles; i++) free(files[i]);
    free(files);
    free(order);
    docs_free(&p.docs);
    mt_tokenizer_free(p.tok);
    return rc;
}

/* ---- reading ------------------------------------------------------------------------------ */

bool mt_dataset_is_prepared(const char *dir)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/meta.json", dir);
    return access(path, F_OK) == 0;
}

int mt_dataset_seq_len(const char *dir, int64_t *seq_len, char *err, size_t errlen)
{
    char mpath[4200];
    snprintf(mpath, sizeof mpath, "%s/meta.json", dir);
    json_error_t je;
    json_t *meta = json_load_file(mpath, 0, &je);
    if (!meta) { snprintf(err, errlen, "%s:%d: %s", mpath, je.line, je.text); return -1; }
    json_t *T = json_object_get(meta, "seq_len");
    int rc = json_is_integer(T) && json_integer_value(T) >= 1 ? 0 : -1;
    if (rc) snprintf(err, errlen, "%s: key 'seq_len' must be a positive integer", mpath);
    else *seq_len = json_integer_value(T);
    json_decref(meta);
    return rc;
}

/* Loads the shards a split's meta lists, appending them. */
static int load_split(mt_dataset *d, json_t *meta, const char *name, mt_dataset_split *s, const char *mpath,
                      char *err, size_t errlen)
{
    json_t *sj = json_object_get(meta, name), *shards = sj ? json_object_get(sj, "shards") : NULL;
    if (!json_is_array(shards)) { snprintf(err, errlen, "%s: key '%s.shards' is missing or not an array", mpath, name); return -1; }
    for (size_t i = 0; i < json_array_size(shards); i++) {
        json_t *f = json_array_get(shards, i);
        if (!json_is_string(f) || strchr(json_string_value(f), '/')) {
            snprintf(err, errlen, "%s: %s.shards[%zu] must be a file name", mpath, name, i);
            return -1;
        }
        char path[4200];
        snprintf(path, sizeof path, "%s/%s", d->dir, json_string_value(f));
        int64_t T, n;
        int32_t *tok;
        uint8_t *mask;
        if (mt_shard_read(path, &T, &n, &tok, &mask, err, errlen)) return -1;
        if (T != d->seq_len) {
            snprintf(err, errlen, "%s: seq_len %lld, but meta.json says %lld", path, (long long)T, (long long)d->seq_len);
            free(tok); free(mask);
            return -1;
        }
        for (int64_t k = 0; k < n * (T + 1); k++)
            if (tok[k] < 0 || tok[k] >= d->vocab_size) {
                snprintf(err, errlen, "%s: token %d at %lld is outside the tokenizer's vocabulary (%lld)", path, tok[k],
                         (long long)k, (long long)d->vocab_size);
                free(tok); free(mask);
                return -1;
            }
        size_t w = (size_t)(T + 1);
        s->tokens = xrealloc(s->tokens, sizeof *s->tokens * (s->n_seq + n) * w);
        s->mask = xrealloc(s->mask, (s->n_seq + n) * w);
        memcpy(s->tokens + s->n_seq * w, tok, sizeof *tok * n * w);
        memcpy(s->mask + s->n_seq * w, mask, n * w);
        s->n_seq += n;
        free(tok); free(mask);
    }
    return 0;
}

int mt_dataset_open(const char *dir, mt_dataset *d, char *err, size_t errlen)
{
    memset(d, 0, sizeof *d);
    d->perm_epoch = -1;
    snprintf(d->dir, sizeof d->dir, "%s", dir);
    char mpath[4200];
    snprintf(mpath, sizeof mpath, "%s/meta.json", dir);
    json_error_t je;
    json_t *meta = json_load_file(mpath, 0, &je);
    if (!meta) { snprintf(err, errlen, "%s:%d: %s", mpath, je.line, je.text); return -1; }
    int rc = -1;
    json_t *version = json_object_get(meta, "version"), *T = json_object_get(meta, "seq_len");
    json_t *tj = json_object_get(meta, "tokenizer"), *family = json_object_get(meta, "family");
    json_t *vocab = tj ? json_object_get(tj, "vocab_size") : NULL, *tpath = tj ? json_object_get(tj, "path") : NULL;
    if (!json_is_integer(version) || json_integer_value(version) != MT_SHARD_VERSION) {
        snprintf(err, errlen, "%s: key 'version' must be %d (prepare the data again with this build)", mpath, MT_SHARD_VERSION);
        goto out;
    }
    if (!json_is_integer(T) || json_integer_value(T) < 1 || !json_is_integer(vocab) || json_integer_value(vocab) < 1 ||
        !json_is_string(tpath) || !json_is_string(family)) {
        snprintf(err, errlen, "%s: needs integer 'seq_len' and 'tokenizer.vocab_size', string 'tokenizer.path' and 'family'", mpath);
        goto out;
    }
    d->seq_len = json_integer_value(T);
    d->vocab_size = json_integer_value(vocab);
    snprintf(d->tokenizer, sizeof d->tokenizer, "%s", json_string_value(tpath));
    snprintf(d->family, sizeof d->family, "%s", json_string_value(family));
    if (load_split(d, meta, "train", &d->train, mpath, err, errlen) || load_split(d, meta, "val", &d->val, mpath, err, errlen)) goto out;
    if (d->train.n_seq == 0) { snprintf(err, errlen, "%s: no training windows", dir); goto out; }
    rc = 0;
out:
    json_decref(meta);
    if (rc) mt_dataset_close(d);
    return rc;
}

/* Whether a model of `vocab` ids (named `model` in the message) trained on --seq-len T can use d:
 * -1 with err naming both when the tokenizer's ids do not fit or the seq_len differs. */
static int check_run(const mt_dataset *d, int64_t vocab, int64_t T, const char *model, char *err, size_t errlen)
{
    if (vocab < d->vocab_size) {
        snprintf(err, errlen, "%s: vocab_size %lld does not cover the tokenizer of %s (%s, %lld ids): use the model "
                 "the data was prepared for", model, (long long)vocab, d->dir, d->tokenizer, (long long)d->vocab_size);
        return -1;
    }
    if (T != d->seq_len) {
        snprintf(err, errlen, "%s was prepared with seq_len %lld, the run has --seq-len %lld: they must agree", d->dir,
                 (long long)d->seq_len, (long long)T);
        return -1;
    }
    return 0;
}

int mt_run_data_open(mt_run_data *d, const char *path, int64_t vocab, int64_t T, int64_t min_text_bytes,
                     const char *model, char *err, size_t errlen)
{
    memset(d, 0, sizeof *d);
    d->prepared = mt_dataset_is_prepared(path);
    if (!d->prepared) return mt_corpus_load(path, 10, min_text_bytes, &d->corpus, err, errlen);
    if (mt_dataset_open(path, &d->dataset, err, errlen)) return -1;
    if (check_run(&d->dataset, vocab, T, model, err, errlen)) {
        mt_dataset_close(&d->dataset);
        return -1;
    }
    return 0;
}

void mt_run_data_batch(mt_run_data *d, bool shuffle, uint64_t seed, int64_t first, mt_rng *rng, int64_t n, int64_t T,
                       int32_t *tokens, int32_t *targets)
{
    if (d->prepared) mt_dataset_batch(&d->dataset, shuffle, seed, first, n, tokens, targets);
    else mt_corpus_sample(&d->corpus, rng, n, T, tokens, targets);
}

void mt_run_data_close(mt_run_data *d)
{
    if (d->prepared) mt_dataset_close(&d->dataset);
    else mt_corpus_free(&d->corpus);
}

void mt_dataset_close(mt_dataset *d)
{
    free(d->train.tokens); free(d->train.mask);
    free(d->val.tokens); free(d->val.mask);
    free(d->perm);
    memset(d, 0, sizeof *d);
}

void mt_dataset_window(const mt_dataset *d, const mt_dataset_split *s, int64_t index, int32_t *tokens, int32_t *targets)
{
    const int64_t T = d->seq_len;
    const int32_t *w = s->tokens + index * (T + 1);
    const uint8_t *m = s->mask + index * (T + 1);
    for (int64_t t = 0; t < T; t++) {
        tokens[t] = w[t];
        targets[t] = m[t + 1] ? w[t + 1] : -1;
    }
}

void mt_dataset_batch(mt_dataset *d, bool shuffle, uint64_t seed, int64_t first, int64_t n, int32_t *tokens, int32_t *targets)
{
    const int64_t N = d->train.n_seq, T = d->seq_len;
    for (int64_t i = 0; i < n; i++) {
        int64_t k = first + i, epoch = k / N, index = k % N;
        if (shuffle) {
            if (!d->perm || d->perm_epoch != epoch || d->perm_seed != seed) {
                if (!d->perm) d->perm = xmalloc(sizeof *d->perm * N);
                int64_t nval;
                mt_dataset_split_order(N, 0, seed ^ (0x9e3779b97f4a7c15ULL * (uint64_t)(epoch + 1)), d->perm, &nval);
                d->perm_epoch = epoch;
                d->perm_seed = seed;
            }
            index = d->perm[index];
        }
        mt_dataset_window(d, &d->train, index, tokens + i * T, targets + i * T);
    }
}
