/* `megatrain prepare`: documents are rendered (chat template or plain text), tokenised with a
 * per-token loss mask, shuffled by document, split, packed into fixed windows and written as
 * checksummed shards (runtime/shard.h) next to a meta.json that runtime/dataset.h reads. */
#include "runtime/prepare.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "models/tokenizer.h"
#include "models/util.h"
#include "runtime/dataset.h"
#include "runtime/shard.h"

static const char *format_names[] = { "text", "alpaca", "sharegpt" };

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
        s->tokens = mt_xrealloc(s->tokens, sizeof *s->tokens * s->cap);
        s->mask = mt_xrealloc(s->mask, s->cap);
    }
    memcpy(s->tokens + s->ntok, ids, sizeof *ids * n);
    memcpy(s->mask + s->ntok, mask, n);
    s->ntok += n;
    if (s->ndocs + 2 > s->doc_cap) {
        s->doc_cap = s->doc_cap ? s->doc_cap * 2 : 1024;
        s->offsets = mt_xrealloc(s->offsets, sizeof *s->offsets * s->doc_cap);
    }
    s->offsets[0] = 0;
    s->offsets[++s->ndocs] = s->ntok;
}

static void docs_free(doc_set *s) { free(s->tokens); free(s->mask); free(s->offsets); }

/* What one preparation run shares: the tokenizer, the documents, progress state. */
typedef struct prep {
    const mt_prepare_options *o;
    mt_tokenizer *tok;
    doc_set docs;
    FILE *log;
    double last_progress;
    int64_t file_docs, file_tokens;   /* docs.ndocs and docs.ntok when the current file began */
} prep;

int mt_prepare_tokenize(mt_tokenizer *tok, const char *text, size_t len, const mt_chat_span *spans, int nspans,
                        int32_t **ids_out, uint8_t **mask_out, size_t *count, char *err, size_t errlen)
{
    size_t n, *starts;
    int32_t *ids = mt_tokenizer_encode_offsets(tok, text, len, &n, &starts, err, errlen);
    if (!ids) return -1;
    uint8_t *mask = mt_xmalloc(n);
    /* Token i covers [starts[i], end[i]): up to the next larger start (tokens that NFC made out of
     * one piece of the text share its start and its bytes), the last ones to len. */
    size_t *end = mt_xmalloc((n ? n : 1) * sizeof *end);
    for (size_t i = n; i-- > 0;)
        end[i] = i + 1 == n ? len : starts[i + 1] > starts[i] ? starts[i + 1] : end[i + 1];
    int s = 0;
    for (size_t i = 0; i < n; i++) {
        if (!spans) mask[i] = 1;
        else { /* spans are sorted and disjoint: the token overlaps one iff it overlaps the first that ends after its start */
            while (s < nspans && spans[s].end <= starts[i]) s++;
            mask[i] = s < nspans && spans[s].start < end[i];
        }
    }
    free(end);
    free(starts);
    *ids_out = ids;
    *mask_out = mask;
    *count = n;
    return 0;
}

/* Tokenises text and adds it as a document (mt_prepare_tokenize gives its mask). */
static int add_document(prep *p, const char *text, size_t len, const mt_chat_span *spans, int nspans, char *err,
                        size_t errlen)
{
    int32_t *ids;
    uint8_t *mask;
    size_t n;
    if (mt_prepare_tokenize(p->tok, text, len, spans, nspans, &ids, &mask, &n, err, errlen)) return -1;
    if (n > 0) docs_add(&p->docs, ids, mask, (int64_t)n);
    free(ids);
    free(mask);
    return 0;
}

/* "0 bytes", "812 bytes", "3.4 KB", "12.3 MB", "1.20 GB" (decimal units). */
static const char *size_text(size_t bytes, char buf[32])
{
    if (bytes < 1000) snprintf(buf, 32, "%zu byte%s", bytes, bytes == 1 ? "" : "s");
    else if (bytes < 1000000) snprintf(buf, 32, "%.1f KB", bytes / 1e3);
    else if (bytes < 1000000000) snprintf(buf, 32, "%.1f MB", bytes / 1e6);
    else snprintf(buf, 32, "%.2f GB", bytes / 1e9);
    return buf;
}

static void file_begins(prep *p)
{
    p->file_docs = p->docs.ndocs;
    p->file_tokens = p->docs.ntok;
}

/* Every 2 s while a file is read: where the reading is, and what the file has given so far. */
static void progress(prep *p, const char *path, int64_t line, size_t done, size_t total)
{
    if (!p->log) return;
    double t = mt_clock_s();
    if (t - p->last_progress < 2.0) return;
    p->last_progress = t;
    char a[32], b[32];
    fprintf(p->log, "prepare: %s: line %lld, %s of %s read, %lld documents, %lld tokens so far\n", path,
            (long long)line, size_text(done, a), size_text(total, b), (long long)(p->docs.ndocs - p->file_docs),
            (long long)(p->docs.ntok - p->file_tokens));
    fflush(p->log);
}

/* After a file: its lines (0 for a whole-file document) and size, and what it gave. */
static void file_done(prep *p, const char *path, int64_t lines, size_t len)
{
    if (!p->log) return;
    char a[32];
    int64_t docs = p->docs.ndocs - p->file_docs, tokens = p->docs.ntok - p->file_tokens;
    if (len == 0) fprintf(p->log, "prepare: %s: empty file, no documents\n", path);
    else if (docs == 0)
        fprintf(p->log, "prepare: %s: %lld line%s (%s), no documents in it\n", path, (long long)lines,
                lines == 1 ? "" : "s", size_text(len, a));
    else if (lines == 0)
        fprintf(p->log, "prepare: %s: %s, 1 document, %lld token%s\n", path, size_text(len, a), (long long)tokens,
                tokens == 1 ? "" : "s");
    else
        fprintf(p->log, "prepare: %s: %lld line%s (%s), %lld document%s, %lld token%s\n", path, (long long)lines,
                lines == 1 ? "" : "s", size_text(len, a), (long long)docs, docs == 1 ? "" : "s", (long long)tokens,
                tokens == 1 ? "" : "s");
    fflush(p->log);
    p->last_progress = mt_clock_s();
}

/* The UTF-8 byte order mark some editors write at the start of a file. */
static const char BOM[] = "\xEF\xBB\xBF";

static bool starts_with_bom(const char *s, size_t n) { return n >= 3 && memcmp(s, BOM, 3) == 0; }

/* Plain text: paragraphs (runs of non-blank lines, without the final newline) or the whole file;
 * a byte order mark at the start is not part of the text. */
static int read_text(prep *p, const char *path, char *err, size_t errlen)
{
    size_t len;
    char *buf = mt_read_file(path, &len, err, errlen);
    if (!buf) return -1;
    file_begins(p);
    size_t from = starts_with_bom(buf, len) ? 3 : 0;
    int64_t line = 0;
    int rc = 0;
    if (p->o->text_unit == MT_TEXT_FILE) {
        if (len > from) rc = add_document(p, buf + from, len - from, NULL, 0, err, errlen);
    } else {
        size_t i = from, start = 0, end = 0; /* current paragraph [start, end) */
        bool in_par = false;
        while (i < len && rc == 0) {
            size_t eol = i;
            while (eol < len && buf[eol] != '\n') eol++;
            bool blank = true;
            for (size_t k = i; k < eol; k++)
                if (buf[k] != ' ' && buf[k] != '\t' && buf[k] != '\r') { blank = false; break; }
            if (!blank) {
                if (!in_par) { start = i; in_par = true; }
                end = eol;
            } else if (in_par) {
                rc = add_document(p, buf + start, end - start, NULL, 0, err, errlen);
                in_par = false;
            }
            i = eol + 1;
            progress(p, path, ++line, i < len ? i : len, len);
        }
        if (in_par && rc == 0) rc = add_document(p, buf + start, end - start, NULL, 0, err, errlen);
    }
    if (rc) {
        size_t at = strlen(err);
        snprintf(err + at, errlen > at ? errlen - at : 0, " (in %s)", path);
    } else file_done(p, path, line, len);
    free(buf);
    return rc;
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

/* One JSONL record to messages, rendered into *r. where = "FILE:LINE". */
static int render_record(mt_input_format format, mt_chat_family family, json_t *rec, const char *where,
                         mt_chat_rendered *r, char *err, size_t errlen)
{
    if (!json_is_object(rec)) {
        snprintf(err, errlen, "%s: a record must be a JSON object, got %s", where, json_type_name(rec));
        return -1;
    }
    mt_chat_message *msgs = NULL;
    int n = 0;
    char *user = NULL;
    int rc = -1;
    if (format == MT_INPUT_ALPACA) {
        const char *instruction, *input, *output, *system;
        if (get_string(rec, "instruction", true, &instruction, where, err, errlen) ||
            get_string(rec, "input", false, &input, where, err, errlen) ||
            get_string(rec, "output", true, &output, where, err, errlen) ||
            get_string(rec, "system", false, &system, where, err, errlen)) return -1;
        msgs = mt_xmalloc(sizeof *msgs * 3);
        if (system && *system) msgs[n++] = (mt_chat_message){ MT_ROLE_SYSTEM, system };
        if (input && *input) {
            user = mt_xmalloc(strlen(instruction) + strlen(input) + 3);
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
        msgs = mt_xmalloc(sizeof *msgs * (json_array_size(conv) + 1));
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
            mt_chat_role role_id;
            if (parse_role(role, &role_id)) {
                snprintf(err, errlen, "%s: unknown %s '%s' (system, human/user, gpt/assistant)", at, role_key, role);
                goto out;
            }
            msgs[n++] = (mt_chat_message){ role_id, text };
        }
    }
    char why[512];
    if (mt_chat_render(family, msgs, n, r, why, sizeof why)) {
        snprintf(err, errlen, "%s: %s", where, why);
        goto out;
    }
    rc = 0;
out:
    free(msgs);
    free(user);
    return rc;
}

int mt_prepare_read_chat(mt_input_format format, mt_chat_family family, const char *path, const char *buf, size_t len,
                         mt_prepare_record_fn fn, void *arg, char *err, size_t errlen)
{
    int64_t line = 0;
    size_t i = starts_with_bom(buf, len) ? 3 : 0;
    int rc = 0;
    while (i < len && rc == 0) {
        size_t eol = i;
        while (eol < len && buf[eol] != '\n') eol++;
        line++;
        size_t k = i;
        while (k < eol && (buf[k] == ' ' || buf[k] == '\t' || buf[k] == '\r')) k++;
        char where[1100];
        snprintf(where, sizeof where, "%s:%lld", path, (long long)line);
        if (starts_with_bom(buf + k, eol - k)) {
            snprintf(err, errlen, "%s: a UTF-8 byte order mark (U+FEFF) starts this line; only the file's first line "
                     "may have one (were files joined with cat?): remove it", where);
            return -1;
        }
        if (k < eol) {
            json_error_t je;
            json_t *rec = json_loadb(buf + i, eol - i, 0, &je);
            if (!rec) {
                snprintf(err, errlen, "%s: invalid JSON: %s (column %d)", where, je.text, je.column);
                rc = -1;
            } else {
                mt_chat_rendered r;
                rc = render_record(format, family, rec, where, &r, err, errlen);
                json_decref(rec);
                if (rc == 0) {
                    rc = fn(arg, &r, line, eol < len ? eol + 1 : len, err, errlen);
                    mt_chat_rendered_free(&r);
                }
            }
        }
        i = eol + 1;
    }
    return rc;
}

typedef struct chat_ctx { prep *p; const char *path; size_t len; int64_t lines; } chat_ctx;

static int add_chat(void *arg, const mt_chat_rendered *r, int64_t line, size_t done, char *err, size_t errlen)
{
    chat_ctx *c = arg;
    if (add_document(c->p, r->text, r->len, r->spans, r->nspans, err, errlen)) {
        size_t at = strlen(err);
        snprintf(err + at, errlen > at ? errlen - at : 0, " (in %s:%lld)", c->path, (long long)line);
        return -1;
    }
    c->lines = line;
    progress(c->p, c->path, line, done, c->len);
    return 0;
}

static int read_jsonl(prep *p, const char *path, char *err, size_t errlen)
{
    size_t len;
    char *buf = mt_read_file(path, &len, err, errlen);
    if (!buf) return -1;
    file_begins(p);
    chat_ctx c = { p, path, len, 0 };
    int rc = mt_prepare_read_chat(p->o->format, p->o->family, path, buf, len, add_chat, &c, err, errlen);
    if (rc == 0) {
        int64_t lines = 0; /* every line, blank ones too, as an editor counts them */
        for (size_t i = 0; i < len; i++) lines += buf[i] == '\n';
        if (len > 0 && buf[len - 1] != '\n') lines++;
        file_done(p, path, lines, len);
    }
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
        names = mt_xmalloc(sizeof *names);
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
        names = mt_xrealloc(names, sizeof *names * (n + 1));
        names[n++] = strdup(full);
    }
    closedir(d);
    if (n == 0) { snprintf(err, errlen, "%s: the directory holds no regular files", path); return NULL; }
    qsort(names, n, sizeof *names, compare_names);
    *count = n;
    return names;
}

/* ---- packing ------------------------------------------------------------------------------ */

int64_t mt_dataset_pack(const int32_t *tokens, const uint8_t *mask, const int64_t *offsets, const int64_t *order,
                        int64_t ndocs, int32_t separator, uint8_t separator_mask, int64_t T,
                        int32_t **tokens_out, uint8_t **mask_out)
{
    int64_t n = 0;
    for (int64_t i = 0; i < ndocs; i++) n += offsets[order[i] + 1] - offsets[order[i]] + 1;
    int64_t windows = n >= 2 ? (n - 1 + T - 1) / T : 0;
    int64_t total = windows * (T + 1);
    int32_t *stream = mt_xmalloc(sizeof *stream * (size_t)(windows * T + 1));
    uint8_t *smask = mt_xmalloc((size_t)(windows * T + 1));
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
    int32_t *tok = mt_xmalloc(sizeof *tok * (size_t)total);
    uint8_t *msk = mt_xmalloc((size_t)total);
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
    char *buf = mt_read_file(path, &len, err, errlen);
    if (!buf) return -1;
    snprintf(hex, 17, "%016llx", (unsigned long long)mt_fnv1a64(MT_FNV1A64_START, buf, len));
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
        int32_t *ids = mt_tokenizer_encode(p->tok, *s, strlen(*s), &n, err, errlen);
        if (!ids) return -1;
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
    size_t base = strlen(o->output_dir);
    while (base > 1 && o->output_dir[base - 1] == '/') base--; /* "out/" is written as "out.tmp" */
    snprintf(tmp, sizeof tmp, "%.*s.tmp", (int)base, o->output_dir);
    if (stat(tmp, &sb) == 0) {
        snprintf(err, errlen, "%s exists (left by an interrupted prepare?): remove it", tmp);
        return -1;
    }
    /* The output's place is tried first, so that a path that cannot be written fails before the
     * tokenising, not after it: the shards are written into tmp, renamed to output_dir at the end. */
    if (mkdir(tmp, 0777) != 0) {
        int e = errno;
        char parent[4096];
        snprintf(parent, sizeof parent, "%s", tmp);
        char *slash = strrchr(parent, '/');
        if (slash) *slash = 0;
        bool no_parent = e == ENOENT && slash && slash != parent && stat(parent, &sb) != 0;
        snprintf(err, errlen, "--output %s: cannot create %s: %s%s%s%s", o->output_dir, tmp, strerror(e),
                 no_parent ? " (there is no directory " : "", no_parent ? parent : "", no_parent ? ")" : "");
        return -1;
    }
    bool made_tmp = true;
    prep p = { .o = o, .log = log };
    int rc = -1, nfiles = 0;
    char **files = NULL;
    int64_t *order = NULL;
    json_t *meta = NULL;
    p.tok = mt_tokenizer_load(o->tokenizer_path, err, errlen);
    if (!p.tok) goto out;
    p.last_progress = mt_clock_s();
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
    order = mt_xmalloc(sizeof *order * p.docs.ndocs);
    mt_dataset_split_order(p.docs.ndocs, o->val_fraction, o->seed, order, &nval);
    const char *sep_text = mt_chat_separator(o->family);
    int32_t sep = mt_tokenizer_token_id(p.tok, sep_text);
    uint8_t sep_mask = o->format == MT_INPUT_TEXT;
    char hash[17];
    if (file_hash(o->tokenizer_path, hash, err, errlen)) goto out;
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
