/* Training checkpoint files. Layout (little-endian, as the host):
 *   "MTCKPT01" | u32 version | u32 ntiles | the model's shape (8 int64 + 2 double) |
 *   step, rng_state, seed (3 x u64) | per tile: i64 numel, then master, m, v (numel fp32 each) |
 *   u64 FNV-1a of everything before it.
 * The shape is compared on load so a checkpoint of another model is refused up front. */
#include "runtime/checkpoint.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char magic[8] = { 'M', 'T', 'C', 'K', 'P', 'T', '0', '1' };
enum { VERSION = 1, NSHAPE = 8 };

typedef struct writer { FILE *f; uint64_t hash; int failed; } writer;

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001B3ull;
    return h;
}

static void put(writer *w, const void *p, size_t n)
{
    if (w->failed) return;
    if (fwrite(p, 1, n, w->f) != n) w->failed = errno ? errno : EIO;
    w->hash = fnv(w->hash, p, n);
}

static void shape_of(const mt_host_state *st, int64_t shape[NSHAPE], double fshape[2])
{
    const mt_model_config *c = &st->cfg;
    int64_t s[NSHAPE] = { c->hidden, c->intermediate, c->layers, c->heads, c->kv_heads, c->head_dim, c->vocab,
                          (int64_t)c->tied | (int64_t)c->qkv_bias << 1 | (int64_t)c->qk_norm << 2 };
    memcpy(shape, s, sizeof s);
    fshape[0] = c->rope_theta;
    fshape[1] = c->rms_eps;
}

/* The message for a checkpoint of another model: every field of the shape that differs, with the
 * checkpoint's value and this run's, under the config.json key that sets it. */
static void describe_difference(const char *path, uint32_t ntiles, const int64_t shape[NSHAPE], const double fshape[2],
                                const mt_host_state *st, const int64_t want[NSHAPE], const double fwant[2], char *err,
                                size_t errlen)
{
    static const char *const keys[NSHAPE] = { "hidden_size", "intermediate_size", "num_hidden_layers",
                                              "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                                              NULL };
    static const char *const flags[3] = { "tie_word_embeddings", "q/k/v biases", "q/k norms" };
    char list[1024] = "";
    size_t n = 0;
#define ADD(...) (n += (size_t)snprintf(list + n, n < sizeof list ? sizeof list - n : 0, __VA_ARGS__))
    for (int i = 0; i < NSHAPE - 1; i++)
        if (shape[i] != want[i]) ADD("%s%s %lld (this run: %lld)", n ? ", " : "", keys[i], (long long)shape[i], (long long)want[i]);
    for (int b = 0; b < 3; b++)
        if ((shape[NSHAPE - 1] >> b & 1) != (want[NSHAPE - 1] >> b & 1))
            ADD("%s%s %s (this run: %s)", n ? ", " : "", flags[b], shape[NSHAPE - 1] >> b & 1 ? "on" : "off",
                want[NSHAPE - 1] >> b & 1 ? "on" : "off");
    if (fshape[0] != fwant[0]) ADD("%srope_theta %.17g (this run: %.17g)", n ? ", " : "", fshape[0], fwant[0]);
    if (fshape[1] != fwant[1]) ADD("%srms_norm_eps %.17g (this run: %.17g)", n ? ", " : "", fshape[1], fwant[1]);
    if (!n && ntiles != (uint32_t)st->ntiles) ADD("%u tiles (this run: %d)", ntiles, st->ntiles);
#undef ADD
    snprintf(err, errlen, "%s: checkpoint of another model: %s", path, list);
}

int mt_checkpoint_save(const char *path, const mt_host_state *st, const mt_checkpoint_meta *meta,
                       char *err, size_t errlen)
{
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    if (!f) {
        snprintf(err, errlen, "%s: cannot create: %s", tmp, strerror(errno));
        return -1;
    }
    writer w = { .f = f, .hash = 0xCBF29CE484222325ull };
    uint32_t version = VERSION, ntiles = (uint32_t)st->ntiles;
    int64_t shape[NSHAPE];
    double fshape[2];
    shape_of(st, shape, fshape);
    put(&w, magic, sizeof magic);
    put(&w, &version, sizeof version);
    put(&w, &ntiles, sizeof ntiles);
    put(&w, shape, sizeof shape);
    put(&w, fshape, sizeof fshape);
    uint64_t m3[3] = { (uint64_t)meta->step, meta->rng_state, meta->seed };
    put(&w, m3, sizeof m3);
    for (int i = 0; i < st->ntiles; i++) {
        const mt_tile *t = &st->tiles[i];
        size_t bytes = (size_t)t->numel * sizeof(float);
        put(&w, &t->numel, sizeof t->numel);
        put(&w, t->master, bytes);
        put(&w, t->adam_m, bytes);
        put(&w, t->adam_v, bytes);
    }
    uint64_t h = w.hash;
    put(&w, &h, sizeof h);
    if (!w.failed && fflush(f) != 0) w.failed = errno;
    if (!w.failed && fsync(fileno(f)) != 0) w.failed = errno;
    if (fclose(f) != 0 && !w.failed) w.failed = errno;
    if (w.failed) {
        snprintf(err, errlen, "%s: writing failed: %s (the previous checkpoint, if any, is untouched)", tmp, strerror(w.failed));
        unlink(tmp);
        return -1;
    }
    if (rename(tmp, path) != 0) {
        snprintf(err, errlen, "%s: cannot rename to %s: %s", tmp, path, strerror(errno));
        unlink(tmp);
        return -1;
    }
    /* Make the rename itself durable. */
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    int dfd = open(dirname(dir), O_RDONLY | O_DIRECTORY);
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
    return 0;
}

typedef struct reader { FILE *f; uint64_t hash; const char *path; char *err; size_t errlen; } reader;

static int get(reader *r, void *p, size_t n, const char *what)
{
    if (fread(p, 1, n, r->f) != n) {
        snprintf(r->err, r->errlen, "%s: truncated checkpoint (while reading %s)", r->path, what);
        return -1;
    }
    r->hash = fnv(r->hash, p, n);
    return 0;
}

int mt_checkpoint_load(const char *path, mt_host_state *st, mt_checkpoint_meta *meta, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "%s: cannot open: %s", path, strerror(errno));
        return -1;
    }
    reader r = { .f = f, .hash = 0xCBF29CE484222325ull, .path = path, .err = err, .errlen = errlen };
    int rc = -1;
    char mg[8];
    uint32_t version, ntiles;
    int64_t shape[NSHAPE], want[NSHAPE];
    double fshape[2], fwant[2];
    uint64_t m3[3];
    if (get(&r, mg, sizeof mg, "the magic number")) goto out;
    if (memcmp(mg, magic, sizeof magic) != 0) {
        snprintf(err, errlen, "%s: not a megatrain checkpoint (bad magic number)", path);
        goto out;
    }
    if (get(&r, &version, sizeof version, "the version") || get(&r, &ntiles, sizeof ntiles, "the tile count")) goto out;
    if (version != VERSION) {
        snprintf(err, errlen, "%s: checkpoint version %u, this build reads version %d", path, version, VERSION);
        goto out;
    }
    if (get(&r, shape, sizeof shape, "the model shape") || get(&r, fshape, sizeof fshape, "the model shape")) goto out;
    shape_of(st, want, fwant);
    if (ntiles != (uint32_t)st->ntiles || memcmp(shape, want, sizeof shape) != 0 || memcmp(fshape, fwant, sizeof fshape) != 0) {
        describe_difference(path, ntiles, shape, fshape, st, want, fwant, err, errlen);
        goto out;
    }
    if (get(&r, m3, sizeof m3, "the step")) goto out;
    for (int i = 0; i < st->ntiles; i++) {
        mt_tile *t = &st->tiles[i];
        int64_t numel;
        char what[64];
        snprintf(what, sizeof what, "tile %d", i);
        if (get(&r, &numel, sizeof numel, what)) goto out;
        if (numel != t->numel) {
            snprintf(err, errlen, "%s: tile %d has %lld elements, the model's has %lld", path, i, (long long)numel, (long long)t->numel);
            goto out;
        }
        size_t bytes = (size_t)numel * sizeof(float);
        if (get(&r, t->master, bytes, what) || get(&r, t->adam_m, bytes, what) || get(&r, t->adam_v, bytes, what)) goto out;
    }
    uint64_t expect = r.hash, stored;
    if (fread(&stored, 1, sizeof stored, f) != sizeof stored) {
        snprintf(err, errlen, "%s: truncated checkpoint (no checksum)", path);
        goto out;
    }
    if (stored != expect) {
        snprintf(err, errlen, "%s: checksum mismatch: the file is damaged", path);
        goto out;
    }
    if (fgetc(f) != EOF) {
        snprintf(err, errlen, "%s: trailing bytes after the checksum", path);
        goto out;
    }
    meta->step = (int64_t)m3[0];
    meta->rng_state = m3[1];
    meta->seed = m3[2];
    mt_state_sync_weights(st);
    rc = 0;
out:
    fclose(f);
    return rc;
}

uint64_t mt_state_hash(const mt_host_state *st)
{
    uint64_t h = 0xCBF29CE484222325ull;
    for (int i = 0; i < st->ntiles; i++) h = fnv(h, st->tiles[i].master, (size_t)st->tiles[i].numel * sizeof(float));
    return h;
}
