/* Corpus loading and batch sampling for byte-level training. */
#include "runtime/data.h"

#include <dirent.h>
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "models/util.h"

#define BLOCK 4096

typedef struct buffer { uint8_t *p; int64_t n, cap; } buffer;

/* -1 when memory runs out (the buffer is then as it was). */
static int append(buffer *b, const uint8_t *src, int64_t n)
{
    if (b->n + n > b->cap) {
        int64_t cap = b->cap;
        while (b->n + n > cap) cap = cap ? cap * 2 : 1 << 16;
        uint8_t *p = realloc(b->p, (size_t)cap);
        if (!p) return -1;
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, src, (size_t)n);
    b->n += n;
    return 0;
}

/* Appends the file's bytes to b; the first file's buffer becomes b itself, so a corpus of one
 * file is never copied. */
static int read_file(const char *path, buffer *b, char *err, size_t errlen)
{
    size_t len;
    char *text = mt_read_file(path, &len, err, errlen);
    if (!text) return -1;
    if (b->n == 0) {
        free(b->p);
        b->p = (uint8_t *)text;
        b->n = b->cap = (int64_t)len;
        return 0;
    }
    const int rc = append(b, (const uint8_t *)text, (int64_t)len);
    free(text);
    if (rc) snprintf(err, errlen, "%s: out of memory after %lld bytes of the corpus", path, (long long)b->n);
    return rc;
}

static int cmp_names(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static bool skip_name(const char *name)
{
    size_t n = strlen(name);
    return name[0] == '.' || (n > 4 && strcmp(name + n - 4, ".dat") == 0);
}

int mt_corpus_load(const char *path, int val_every, int64_t min_bytes, mt_corpus *c, char *err, size_t errlen)
{
    memset(c, 0, sizeof *c);
    struct stat sb;
    if (stat(path, &sb) != 0) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return -1;
    }
    buffer all = { 0 };
    if (S_ISDIR(sb.st_mode)) {
        DIR *d = opendir(path);
        if (!d) {
            snprintf(err, errlen, "%s: cannot list directory: %s", path, strerror(errno));
            return -1;
        }
        char **names = NULL;
        int n = 0, cap = 0;
        bool oom = false;
        struct dirent *e;
        while ((e = readdir(d))) {
            if (skip_name(e->d_name)) continue;
            char full[4096];
            snprintf(full, sizeof full, "%s/%s", path, e->d_name);
            struct stat fs;
            if (lstat(full, &fs) != 0 || !S_ISREG(fs.st_mode)) continue;
            if (n == cap) {
                char **grown = realloc(names, sizeof *names * (size_t)(cap ? cap * 2 : 32));
                if (!grown) { oom = true; break; }
                names = grown;
                cap = cap ? cap * 2 : 32;
            }
            if (!(names[n] = strdup(full))) { oom = true; break; }
            n++;
        }
        closedir(d);
        if (oom) {
            for (int i = 0; i < n; i++) free(names[i]);
            free(names);
            snprintf(err, errlen, "%s: out of memory listing the directory", path);
            return -1;
        }
        if (n > 1) qsort(names, n, sizeof *names, cmp_names); /* names is NULL when n is 0 */
        int rc = 0;
        for (int i = 0; i < n && rc == 0; i++) rc = read_file(names[i], &all, err, errlen);
        for (int i = 0; i < n; i++) free(names[i]);
        free(names);
        c->nfiles = n;
        if (rc) { free(all.p); return -1; }
        if (n == 0) {
            snprintf(err, errlen, "%s: directory holds no text files", path);
            return -1;
        }
    } else {
        if (read_file(path, &all, err, errlen)) { free(all.p); return -1; }
        c->nfiles = 1;
    }
    if (all.n == 0) {
        snprintf(err, errlen, "%s: corpus is empty", path);
        free(all.p);
        return -1;
    }
    buffer tr = { 0 }, va = { 0 };
    for (int64_t o = 0, blk = 0; o < all.n; o += BLOCK, blk++) {
        int64_t len = all.n - o < BLOCK ? all.n - o : BLOCK;
        if (append(val_every > 0 && blk % val_every == val_every - 1 ? &va : &tr, all.p + o, len)) {
            snprintf(err, errlen, "%s: out of memory splitting %lld bytes into training and validation", path,
                     (long long)all.n);
            free(all.p);
            free(tr.p);
            free(va.p);
            return -1;
        }
    }
    free(all.p);
    if (tr.n < min_bytes || va.n < min_bytes) {
        snprintf(err, errlen, "%s: corpus too small: %lld training and %lld validation bytes, need at least %lld in each "
                 "(use a larger corpus or a shorter --seq-len)", path, (long long)tr.n, (long long)va.n, (long long)min_bytes);
        free(tr.p);
        free(va.p);
        return -1;
    }
    c->train = tr.p; c->ntrain = tr.n;
    c->val = va.p; c->nval = va.n;
    return 0;
}

void mt_corpus_free(mt_corpus *c)
{
    free(c->train);
    free(c->val);
    memset(c, 0, sizeof *c);
}

void mt_rng_seed(mt_rng *r, uint64_t seed) { r->state = seed ^ 0x853C49E6748FEA9Bull; }

uint64_t mt_rng_next(mt_rng *r)
{
    uint64_t z = (r->state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

double mt_rng_uniform(mt_rng *r) { return (double)(mt_rng_next(r) >> 11) * (1.0 / 9007199254740992.0); }

void mt_corpus_sample(const mt_corpus *c, mt_rng *r, int64_t B, int64_t T, int32_t *tokens, int32_t *targets)
{
    int64_t span = c->ntrain - T; /* windows of T+1 bytes: offsets 0 .. ntrain-T-1 */
    for (int64_t b = 0; b < B; b++) {
        int64_t o = (int64_t)(mt_rng_next(r) % (uint64_t)span);
        for (int64_t t = 0; t < T; t++) {
            tokens[b * T + t] = c->train[o + t];
            targets[b * T + t] = c->train[o + t + 1];
        }
    }
}

int64_t mt_corpus_validation(const mt_corpus *c, int64_t n_seq, int64_t T, int32_t *tokens, int32_t *targets)
{
    int64_t s = 0;
    for (; s < n_seq && (s + 1) * T + 1 <= c->nval; s++)
        for (int64_t t = 0; t < T; t++) {
            tokens[s * T + t] = c->val[s * T + t];
            targets[s * T + t] = c->val[s * T + t + 1];
        }
    return s;
}
