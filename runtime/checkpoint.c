/* Training checkpoint files. Layout (little-endian, as the host):
 *   "MTCKPT01" | u32 version | u32 ntiles | the model's shape (8 int64 + 2 double) |
 *   step, rng_state, seed (3 x u64) | version 2: updates (u64), u32 n, n bytes of settings |
 *   version 3: u32 shard ranks, u32 shard rank |
 *   per tile: i64 numel, then master, m, v (numel fp32 each; nothing more for a tile the shard
 *   does not hold) | u64 FNV-1a of everything before it.
 * The shape is compared on load so a checkpoint of another model is refused up front. */
#include "runtime/checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "runtime/files.h"

/* The file name a path ends in. */
static const char *name_of(const char *path) { return strrchr(path, '/') ? strrchr(path, '/') + 1 : path; }

static const char magic[8] = { 'M', 'T', 'C', 'K', 'P', 'T', '0', '1' };
enum { NSHAPE = 8 };

typedef struct writer { FILE *f; uint64_t hash; int failed; } writer;

static void put(writer *w, const void *p, size_t n)
{
    if (w->failed) return;
    if (fwrite(p, 1, n, w->f) != n) w->failed = errno ? errno : EIO;
    w->hash = mt_fnv1a64(w->hash, p, n);
}

static void shape_of(const mt_model_config *c, int64_t shape[NSHAPE], double fshape[2])
{
    int64_t s[NSHAPE] = { c->hidden, c->intermediate, c->layers, c->heads, c->kv_heads, c->head_dim, c->vocab,
                          (int64_t)c->tied | (int64_t)c->qkv_bias << 1 | (int64_t)c->qk_norm << 2 };
    memcpy(shape, s, sizeof s);
    fshape[0] = c->rope_theta;
    fshape[1] = c->rms_eps;
}

/* The message for a checkpoint of another model: every field of the shape that differs, with the
 * checkpoint's value and this run's, under the config.json key that sets it. */
static void describe_difference(const char *path, uint32_t ntiles, const int64_t shape[NSHAPE], const double fshape[2],
                                int want_tiles, const int64_t want[NSHAPE], const double fwant[2], char *err,
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
    if (!n && want_tiles >= 0 && ntiles != (uint32_t)want_tiles) ADD("%u tiles (this run: %d)", ntiles, want_tiles);
#undef ADD
    snprintf(err, errlen, "%s: checkpoint of another model: %s", path, list);
}

int mt_checkpoint_save(const char *path, const mt_host_state *st, const mt_checkpoint_meta *meta,
                       char *err, size_t errlen)
{
    char tmp[4200];
    mt_temp_name(path, tmp, sizeof tmp);
    FILE *f = fopen(tmp, "wb");
    if (!f) {
        snprintf(err, errlen, "%s: cannot create: %s", tmp, strerror(errno));
        return -1;
    }
    writer w = { .f = f, .hash = MT_FNV1A64_START };
    uint32_t version = MT_CHECKPOINT_VERSION, ntiles = (uint32_t)st->ntiles;
    int64_t shape[NSHAPE];
    double fshape[2];
    shape_of(&st->cfg, shape, fshape);
    put(&w, magic, sizeof magic);
    put(&w, &version, sizeof version);
    put(&w, &ntiles, sizeof ntiles);
    put(&w, shape, sizeof shape);
    put(&w, fshape, sizeof fshape);
    uint64_t m4[4] = { (uint64_t)meta->step, meta->rng_state, meta->seed, (uint64_t)meta->updates };
    put(&w, m4, sizeof m4);
    uint32_t nsettings = (uint32_t)strnlen(meta->settings, sizeof meta->settings);
    put(&w, &nsettings, sizeof nsettings);
    put(&w, meta->settings, nsettings);
    const uint32_t shard[2] = { (uint32_t)st->shard_ranks, (uint32_t)st->shard_rank };
    put(&w, shard, sizeof shard);
    float *buf = NULL; /* a compact tile's master, decoded */
    for (int i = 0; i < st->ntiles; i++) {
        const mt_tile *t = &st->tiles[i];
        size_t bytes = (size_t)t->numel * sizeof(float);
        put(&w, &t->numel, sizeof t->numel);
        if (!mt_state_holds(st, i)) continue; /* another rank's shard has it */
        const float *master = mt_state_master_f32(st, i, &buf);
        if (!master && !w.failed) w.failed = ENOMEM;
        put(&w, master, bytes);
        put(&w, t->adam_m, bytes);
        put(&w, t->adam_v, bytes);
    }
    free(buf);
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
    char dir[4096];
    mt_dir_of(path, dir, sizeof dir);
    mt_sync_dir(dir);
    return 0;
}

/* The step of a numbered checkpoint "BASE.NNNNNN" of base, else -1. */
static int64_t numbered_step(const char *name, const char *base)
{
    size_t n = strlen(base);
    if (strncmp(name, base, n) || name[n] != '.' || !name[n + 1]) return -1;
    int64_t step = 0;
    for (const char *p = name + n + 1; *p; p++) {
        if (*p < '0' || *p > '9' || step > (INT64_MAX - 9) / 10) return -1;
        step = step * 10 + (*p - '0');
    }
    return step;
}

/* Removes base's numbered checkpoints in dir of steps below `step` but the keep - 1 most recent. */
static void prune_numbered(const char *dir, const char *base, int64_t step, int64_t keep)
{
    DIR *d = opendir(dir);
    if (!d) return;
    int64_t *steps = NULL;
    size_t n = 0, cap = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        int64_t s = numbered_step(de->d_name, base);
        if (s < 0 || s >= step) continue;
        if (n == cap) {
            int64_t *grown = realloc(steps, (cap = cap ? 2 * cap : 16) * sizeof *steps);
            if (!grown) break;
            steps = grown;
        }
        steps[n++] = s;
    }
    closedir(d);
    /* the most recent first; keep the keep - 1 of them that stay beside `step` */
    for (size_t i = 0; i < n; i++)
        for (size_t j = i + 1; j < n; j++)
            if (steps[j] > steps[i]) { int64_t t = steps[i]; steps[i] = steps[j]; steps[j] = t; }
    for (size_t i = (size_t)(keep - 1); i < n; i++) {
        char path[8300];
        snprintf(path, sizeof path, "%s/%s.%06lld", dir, base, (long long)steps[i]);
        unlink(path);
    }
    free(steps);
}

int mt_checkpoint_save_kept(const char *path, int64_t keep_last, const mt_host_state *st, const mt_checkpoint_meta *meta,
                            char *written, size_t len, char *err, size_t errlen)
{
    if (keep_last <= 0) {
        snprintf(written, len, "%s", path);
        return mt_checkpoint_save(path, st, meta, err, errlen);
    }
    char numbered[4200];
    snprintf(numbered, sizeof numbered, "%s.%06lld", path, (long long)meta->step);
    if (mt_checkpoint_save(numbered, st, meta, err, errlen)) return -1;
    snprintf(written, len, "%s", numbered);
    /* path -> the numbered file, by its name: the link stays valid when the directory moves */
    const char *target = name_of(numbered);
    char tmp[4200];
    mt_temp_name(path, tmp, sizeof tmp);
    unlink(tmp);
    if (symlink(target, tmp) != 0 || rename(tmp, path) != 0) {
        snprintf(err, errlen, "%s: cannot point it at %s: %s (the checkpoint itself is saved there)", path, numbered,
                 strerror(errno));
        unlink(tmp);
        return -1;
    }
    char dir[4096];
    mt_dir_of(path, dir, sizeof dir);
    mt_sync_dir(dir);
    prune_numbered(dir, name_of(path), meta->step, keep_last);
    return 0;
}

/* "PREFIX.shardRofN": rank's shards are this prefix's numbered files (mt_checkpoint_save_kept's
 * numbering, which prune_numbered reads). */
static void shard_prefix(const char *prefix, int rank, int ranks, char *out, size_t len)
{
    snprintf(out, len, "%s.shard%dof%d", prefix, rank, ranks);
}

void mt_checkpoint_shard_name(const char *base, int rank, int ranks, int64_t step, char *out, size_t len)
{
    char prefix[4300];
    shard_prefix(base, rank, ranks, prefix, sizeof prefix);
    snprintf(out, len, "%s.%06lld", prefix, (long long)step);
}

void mt_checkpoint_base_of(const char *path, int64_t step, char *out, size_t len)
{
    snprintf(out, len, "%s", path);
    const char *dot = strrchr(path, '.'), *name = name_of(path);
    if (!dot || dot <= name) return;
    char base[4200];
    snprintf(base, sizeof base, "%.*s", (int)(dot - path), path);
    if (numbered_step(name, name_of(base)) == step) snprintf(out, len, "%s", base);
}

void mt_checkpoint_prune_shards(const char *base, int rank, int ranks, int64_t step, int64_t keep)
{
    char dir[4096], prefix[4400];
    mt_dir_of(base, dir, sizeof dir);
    shard_prefix(name_of(base), rank, ranks, prefix, sizeof prefix);
    prune_numbered(dir, prefix, step, keep < 1 ? 1 : keep);
}

typedef struct reader { FILE *f; uint64_t hash; const char *path; char *err; size_t errlen; } reader;

static int get(reader *r, void *p, size_t n, const char *what)
{
    if (fread(p, 1, n, r->f) != n) {
        snprintf(r->err, r->errlen, "%s: truncated checkpoint (while reading %s)", r->path, what);
        return -1;
    }
    r->hash = mt_fnv1a64(r->hash, p, n);
    return 0;
}

/* Reads everything before the tiles into meta, checking the shape against cfg (and the tile
 * count against want_tiles, unless negative); *ntiles gets the file's. */
static int read_header(reader *r, const mt_model_config *cfg, int want_tiles, uint32_t *ntiles, mt_checkpoint_meta *meta)
{
    char mg[8];
    uint32_t version;
    int64_t shape[NSHAPE], want[NSHAPE];
    double fshape[2], fwant[2];
    if (get(r, mg, sizeof mg, "the magic number")) return -1;
    if (memcmp(mg, magic, sizeof magic) != 0) {
        snprintf(r->err, r->errlen, "%s: not a megatrain checkpoint (bad magic number)", r->path);
        return -1;
    }
    if (get(r, &version, sizeof version, "the version") || get(r, ntiles, sizeof *ntiles, "the tile count")) return -1;
    if (version < 1 || version > MT_CHECKPOINT_VERSION) {
        snprintf(r->err, r->errlen, "%s: checkpoint version %u, this build reads versions 1 to %d", r->path, version,
                 MT_CHECKPOINT_VERSION);
        return -1;
    }
    if (get(r, shape, sizeof shape, "the model shape") || get(r, fshape, sizeof fshape, "the model shape")) return -1;
    shape_of(cfg, want, fwant);
    if ((want_tiles >= 0 && *ntiles != (uint32_t)want_tiles) || memcmp(shape, want, sizeof shape) != 0 ||
        memcmp(fshape, fwant, sizeof fshape) != 0) {
        describe_difference(r->path, *ntiles, shape, fshape, want_tiles, want, fwant, r->err, r->errlen);
        return -1;
    }
    uint64_t m3[3];
    if (get(r, m3, sizeof m3, "the step")) return -1;
    memset(meta, 0, sizeof *meta);
    meta->version = version;
    meta->step = (int64_t)m3[0];
    meta->rng_state = m3[1];
    meta->seed = m3[2];
    meta->updates = meta->step;
    if (version >= 2) {
        uint64_t updates;
        uint32_t n;
        if (get(r, &updates, sizeof updates, "the update count") || get(r, &n, sizeof n, "the settings")) return -1;
        if (n >= sizeof meta->settings) {
            snprintf(r->err, r->errlen, "%s: settings of %u bytes, at most %zu (damaged file?)", r->path, n,
                     sizeof meta->settings - 1);
            return -1;
        }
        if (get(r, meta->settings, n, "the settings")) return -1;
        meta->settings[n] = 0;
        meta->updates = (int64_t)updates;
        if (strlen(meta->settings) != n) {
            snprintf(r->err, r->errlen, "%s: the settings hold a NUL byte (damaged file?)", r->path);
            return -1;
        }
    }
    meta->shard_ranks = 1;
    meta->shard_rank = 0;
    if (version >= 3) {
        uint32_t shard[2];
        if (get(r, shard, sizeof shard, "the shard")) return -1;
        if (shard[0] < 1 || shard[0] > (1u << 20) || shard[1] >= shard[0]) {
            snprintf(r->err, r->errlen, "%s: shard %u of %u ranks (damaged file?)", r->path, shard[1], shard[0]);
            return -1;
        }
        meta->shard_ranks = shard[0];
        meta->shard_rank = shard[1];
    }
    return 0;
}

int mt_checkpoint_read_header(const char *path, const mt_model_config *cfg, mt_checkpoint_meta *meta, char *err,
                              size_t errlen)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "%s: cannot open: %s", path, strerror(errno));
        return -1;
    }
    reader r = { .f = f, .hash = MT_FNV1A64_START, .path = path, .err = err, .errlen = errlen };
    uint32_t ntiles;
    int rc = read_header(&r, cfg, -1, &ntiles, meta);
    fclose(f);
    return rc;
}

int mt_checkpoint_load(const char *path, mt_host_state *st, mt_checkpoint_meta *meta, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "%s: cannot open: %s", path, strerror(errno));
        return -1;
    }
    reader r = { .f = f, .hash = MT_FNV1A64_START, .path = path, .err = err, .errlen = errlen };
    int rc = -1;
    float *buf = NULL; /* a compact tile's master, read before it is encoded */
    uint32_t ntiles;
    mt_checkpoint_meta *m = malloc(sizeof *m);
    if (!m) {
        snprintf(err, errlen, "%s: out of memory", path);
        goto out;
    }
    if (read_header(&r, &st->cfg, st->ntiles, &ntiles, m)) goto out;
    if (m->shard_ranks != (uint32_t)st->shard_ranks || m->shard_rank != (uint32_t)st->shard_rank) {
        if (m->shard_ranks == 1)
            snprintf(err, errlen, "%s: a checkpoint of one process, not a shard: this run has %d ranks (resume it without "
                     "mpirun, or with the same ranks that wrote it)", path, st->shard_ranks);
        else
            snprintf(err, errlen, "%s: rank %u's shard of a checkpoint written by %u ranks; this is rank %d of %d: resume "
                     "with mpirun -np %u", path, m->shard_rank, m->shard_ranks, st->shard_rank, st->shard_ranks,
                     m->shard_ranks);
        goto out;
    }
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
        if (!mt_state_holds(st, i)) continue; /* its owner's shard has it */
        size_t bytes = (size_t)numel * sizeof(float);
        float *master = t->master;
        if (!master && !(master = buf = realloc(buf, bytes))) {
            snprintf(err, errlen, "%s: out of memory reading tile %d", path, i);
            goto out;
        }
        if (get(&r, master, bytes, what) || get(&r, t->adam_m, bytes, what) || get(&r, t->adam_v, bytes, what)) goto out;
        if (!t->master) mt_state_write_master(st, i, 0, numel, master);
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
    *meta = *m;
    mt_state_sync_weights(st);
    rc = 0;
out:
    free(m);
    free(buf);
    fclose(f);
    return rc;
}

uint64_t mt_state_hash(const mt_host_state *st)
{
    uint64_t h = MT_FNV1A64_START;
    float *buf = NULL; /* a compact tile's master, decoded: the hash is the fp32 master's in either layout */
    for (int i = 0; i < st->ntiles; i++) {
        const float *master = mt_state_master_f32(st, i, &buf);
        if (!master) {
            fprintf(stderr, "megatrain: out of memory hashing tile %d's master\n", i);
            abort();
        }
        h = mt_fnv1a64(h, master, (size_t)st->tiles[i].numel * sizeof(float));
    }
    free(buf);
    return h;
}
