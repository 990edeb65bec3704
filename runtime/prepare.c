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

/* What one preparation run shares: the tokenizer, byte lengths of ids, progress state. */
typedef struct prep {
    const mt_prepare_options *o;
    mt_tokenizer *tok;
    doc_set docs;
    FILE *log;
    double last_progress;
} prep;

/* Tokenises text and adds it as a document: a token is trained when the text it covers overlaps a
 * span (all tokens when spans is NULL), as HF's assistant masks map character spans to tokens.
 * The tokenizer says where each token starts (a SentencePiece-style token may carry a space the
 * text does not have, so the tokens' own lengths would drift from the text). */
static void add_document(prep *p, const char *text, size_t len, const mt_chat_span *spans, int nspans)
{
    size_t n, *starts;
    int32_t *ids = mt_tokenizer_encode_offsets(p->tok, text, len, &n, &starts);
    uint8_t *mask = mt_xmalloc(n);
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

static void progress(prep *p, const char *path, int64_t line, size_t done, size_t total, bool final)
{
    if (!p->log) return;
    double t = mt_clock_s();
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
    char *buf = mt_read_file(path, &len, err, errlen);
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
    char *buf = mt_read_file(path, &len, err, errlen);
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
    prep p = { .o = o, .log = log, .last_progress = mt_clock_s() };
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
    order = mt_xmalloc(sizeof *order * p.docs.ndocs);
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
