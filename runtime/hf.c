/* HF directories in and out. The layout names every tensor a tile holds; loading matches those
 * names against the checkpoint's files (each tensor read straight into its tile's master), saving
 * walks them in HF order into one file or greedy shards. */
#include "runtime/hf.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "models/mxfp4.h"
#include "models/report.h"
#include "models/safetensors.h"
#include "runtime/files.h"

#define SINGLE_NAME "model.safetensors"
#define INDEX_NAME "model.safetensors.index.json"

/* What an HF tensor is to the state. gpt_oss holds its experts fused, each layer's in two
 * tensors: mlp.experts.gate_up_proj (E, d, 2 Ie), x @ W with gate j in column 2j and up j in
 * 2j + 1, and mlp.experts.down_proj (E, Ie, d); published checkpoints hold them in MXFP4 as
 * NAME_blocks and NAME_scales (models/mxfp4.h), rows of the transposed matrices. The state keeps
 * every expert's gate, up and down as the other families do ((Ie, d), (Ie, d), (d, Ie)). */
typedef enum expected_kind {
    EXPECT_PLAIN,        /* one slot of one tile, the same shape and order */
    EXPECT_EXPERTS_GU,   /* gpt_oss's gate_up_proj: every expert's gate and up slots */
    EXPECT_EXPERTS_DOWN, /* gpt_oss's down_proj: every expert's down slot */
} expected_kind;

/* One tensor the state holds: where it goes and the HF shape it must have. */
typedef struct expected {
    char name[192];
    expected_kind kind;
    int ndim;
    int64_t shape[3];
    int64_t numel;
    float *master;      /* tile->master + offset; NULL in the compact layout (mt_state_read_master) and for
                         * a tile a sharded state does not hold */
    int tile;
    int64_t offset;     /* in the tile */
    const mt_tile_layout *layout;
    int shard;          /* index into the shard list that holds it (or its MXFP4 blocks) */
    int scales_shard;   /* the one that holds its MXFP4 scales; -1: none */
    bool quantized;     /* the checkpoint holds NAME_blocks and NAME_scales instead */
    bool scales_seen;   /* a file held NAME_scales */
    bool loaded;
} expected;

/* How a checkpoint's tensor name matches an expected one. */
enum { MATCH_NAME, MATCH_BLOCKS, MATCH_SCALES };

static bool fused_experts(const mt_host_state *st, const mt_tile *t)
{
    return st->cfg.family == MT_FAMILY_GPT_OSS && mt_layout_is_sparse(t->layout);
}

static void set_expected(expected *x, const mt_tile *t, int tile, int64_t offset, int ndim, const int64_t *shape)
{
    x->ndim = ndim;
    x->numel = 1;
    for (int k = 0; k < ndim; k++) {
        x->shape[k] = shape[k];
        x->numel *= shape[k];
    }
    x->master = t->master ? t->master + offset : NULL;
    x->tile = tile;
    x->offset = offset;
    x->layout = t->layout;
    x->scales_shard = -1;
}

/* Every present tensor of every tile, in HF order (embedding, layers, final norm, LM head). */
static expected *list_expected(const mt_host_state *st, int *count)
{
    int cap = 0;
    for (int i = 0; i < st->ntiles; i++) cap += st->tiles[i].layout->ntensors + 2;
    expected *e = calloc((size_t)cap + 1, sizeof *e);
    int n = 0;
    for (int i = 0; e && i < st->ntiles; i++) {
        const mt_tile *t = &st->tiles[i];
        const bool fused = fused_experts(st, t);
        const int nslots = fused ? mt_layout_expert_slot(0, 0) : t->layout->ntensors;
        for (int s = 0; s < nslots; s++) {
            const mt_tensor_desc *d = &t->layout->tensors[s];
            if (d->numel == 0) continue;
            mt_layout_full_name(t->layout, i - 1, s, e[n].name, sizeof e[n].name);
            e[n].kind = EXPECT_PLAIN;
            set_expected(&e[n], t, i, d->offset, d->ndim, d->shape);
            n++;
        }
        if (!fused) continue;
        const int64_t E = st->cfg.experts, d = st->cfg.hidden, Ie = st->cfg.expert_intermediate;
        const int64_t gu[3] = { E, d, 2 * Ie }, down[3] = { E, Ie, d };
        snprintf(e[n].name, sizeof e[n].name, "model.layers.%d.mlp.experts.gate_up_proj", i - 1);
        e[n].kind = EXPECT_EXPERTS_GU;
        set_expected(&e[n++], t, i, 0, 3, gu);
        snprintf(e[n].name, sizeof e[n].name, "model.layers.%d.mlp.experts.down_proj", i - 1);
        e[n].kind = EXPECT_EXPERTS_DOWN;
        set_expected(&e[n++], t, i, 0, 3, down);
    }
    *count = n;
    return e;
}

/* The expected tensor a checkpoint's name stands for, and how (*match): the name itself or, for
 * fused experts, their MXFP4 blocks or scales. */
static expected *find_expected(expected *e, int n, const char *name, int *match)
{
    const size_t len = strlen(name);
    for (int i = 0; i < n; i++) {
        const size_t base = strlen(e[i].name);
        if (len < base || strncmp(e[i].name, name, base)) continue;
        if (name[base] == '\0') {
            *match = MATCH_NAME;
            return &e[i];
        }
        if (e[i].kind == EXPECT_PLAIN) continue;
        if (!strcmp(name + base, "_blocks")) {
            *match = MATCH_BLOCKS;
            return &e[i];
        }
        if (!strcmp(name + base, "_scales")) {
            *match = MATCH_SCALES;
            return &e[i];
        }
    }
    return NULL;
}

/* Tensors a checkpoint may carry that the state has no place for and does not need: rotary
 * frequency buffers (older transformers saved them) and, when tied, the LM head copy. */
static bool harmless_extra(const mt_host_state *st, const char *name)
{
    size_t len = strlen(name), suffix = strlen("rotary_emb.inv_freq");
    if (len >= suffix && !strcmp(name + len - suffix, "rotary_emb.inv_freq")) return true;
    return st->cfg.tied && !strcmp(name, "lm_head.weight");
}

static void shape_text(int ndim, const int64_t *shape, char *buf, size_t len)
{
    size_t at = (size_t)snprintf(buf, len, "[");
    for (int i = 0; i < ndim && at < len; i++)
        at += (size_t)snprintf(buf + at, len - at, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (at < len) snprintf(buf + at, len - at, "]");
}

/* A shard name from the index must stay inside the directory. */
static bool plain_file_name(const char *s)
{
    return s[0] && !strchr(s, '/') && strcmp(s, ".") && strcmp(s, "..");
}

/* Reads the index into shard names (unique, first-appearance order) and each expected tensor's
 * shard. Checks every entry is expected (or harmless) and every expected tensor is listed. */
static int read_index(const char *index_path, const mt_host_state *st, expected *e, int ne, char ***shards,
                      int *nshards, char *err, size_t errlen)
{
    json_error_t je;
    json_t *root = json_load_file(index_path, JSON_REJECT_DUPLICATES, &je);
    if (!root) return mt_fail(err, errlen, "%s: not valid JSON (line %d: %s)", index_path, je.line, je.text);
    json_t *map = json_object_get(root, "weight_map");
    if (!json_is_object(map)) {
        json_decref(root);
        return mt_fail(err, errlen, "%s: no 'weight_map' object", index_path);
    }
    char **names = calloc(json_object_size(map) + 1, sizeof *names);
    int n = 0, rc = 0;
    for (int i = 0; i < ne; i++) e[i].shard = -1;
    const char *key;
    json_t *v;
    json_object_foreach(map, key, v) {
        if (!json_is_string(v) || !plain_file_name(json_string_value(v))) {
            rc = mt_fail(err, errlen, "%s: tensor '%s': the shard is not a file name in this directory", index_path, key);
            break;
        }
        const char *file = json_string_value(v);
        int match = MATCH_NAME;
        expected *x = find_expected(e, ne, key, &match);
        if (!x && !harmless_extra(st, key)) {
            rc = mt_fail(err, errlen, "%s: tensor '%s': unexpected tensor (not part of this %s config)", index_path, key,
                      st->cfg.model_type);
            break;
        }
        int s = 0;
        while (s < n && strcmp(names[s], file)) s++;
        if (s == n) names[n++] = strdup(file);
        if (!x) continue;
        if (match == MATCH_SCALES) {
            x->scales_shard = s;
        } else if (x->shard >= 0) {
            rc = mt_fail(err, errlen, "%s: tensor '%s': listed both as itself and as its MXFP4 blocks", index_path,
                         x->name);
            break;
        } else {
            x->shard = s;
            x->quantized = match == MATCH_BLOCKS;
        }
    }
    for (int i = 0; i < ne && rc == 0; i++) {
        if (e[i].shard < 0) rc = mt_fail(err, errlen, "%s: tensor '%s': missing from the weight_map", index_path, e[i].name);
        else if (e[i].quantized != (e[i].scales_shard >= 0))
            rc = mt_fail(err, errlen, "%s: tensor '%s_%s': missing from the weight_map (its %s is listed)", index_path,
                         e[i].name, e[i].quantized ? "scales" : "blocks", e[i].quantized ? "blocks" : "scales");
    }
    json_decref(root);
    *shards = names;
    *nshards = n;
    return rc;
}

/* Writes n floats of an expected tensor's tile at element `offset` of the tile. */
static void write_tile(mt_host_state *st, const expected *x, int64_t offset, int64_t n, const float *src)
{
    if (st->tiles[x->tile].master) memcpy(st->tiles[x->tile].master + offset, src, sizeof(float) * (size_t)n);
    else mt_state_write_master(st, x->tile, offset, n, src);
}

static int64_t slot_offset(const expected *x, int expert, int which)
{
    return x->layout->tensors[mt_layout_expert_slot(expert, which)].offset;
}

/* Expert e's slots from its part of a fused tensor. rows: gate_up_proj's (d, 2 Ie), gate j and
 * up j the columns 2j and 2j + 1; down_proj's (Ie, d). tmp: Ie * d floats. */
static void store_fused_expert(mt_host_state *st, const expected *x, int e, const float *rows, float *tmp)
{
    const int64_t d = st->cfg.hidden, Ie = st->cfg.expert_intermediate;
    if (x->kind == EXPECT_EXPERTS_DOWN) { /* down (d, Ie) = rows^T */
        for (int64_t o = 0; o < d; o++)
            for (int64_t j = 0; j < Ie; j++) tmp[o * Ie + j] = rows[j * d + o];
        write_tile(st, x, slot_offset(x, e, MT_X_DOWN), d * Ie, tmp);
        return;
    }
    for (int parity = 0; parity < 2; parity++) { /* gate (Ie, d), then up */
        for (int64_t j = 0; j < Ie; j++)
            for (int64_t i = 0; i < d; i++) tmp[j * d + i] = rows[i * 2 * Ie + 2 * j + parity];
        write_tile(st, x, slot_offset(x, e, parity ? MT_X_UP : MT_X_GATE), Ie * d, tmp);
    }
}

/* Expert e's slots from its decoded MXFP4 rows: gate_up's (2 Ie, d), gate j and up j the rows
 * 2j and 2j + 1 (the transpose of gate_up_proj's columns); down's (d, Ie), the down slot as it
 * is. */
static void store_decoded_expert(mt_host_state *st, const expected *x, int e, const float *rows)
{
    const int64_t d = st->cfg.hidden, Ie = st->cfg.expert_intermediate;
    if (x->kind == EXPECT_EXPERTS_DOWN) {
        write_tile(st, x, slot_offset(x, e, MT_X_DOWN), d * Ie, rows);
        return;
    }
    for (int64_t j = 0; j < Ie; j++) {
        write_tile(st, x, slot_offset(x, e, MT_X_GATE) + j * d, d, rows + 2 * j * d);
        write_tile(st, x, slot_offset(x, e, MT_X_UP) + j * d, d, rows + (2 * j + 1) * d);
    }
}

static int bad_shape(const char *path, const mt_st_tensor *t, int ndim, const int64_t *shape, char *err, size_t errlen)
{
    char got[128], want[128];
    shape_text(t->ndim, t->shape, got, sizeof got);
    shape_text(ndim, shape, want, sizeof want);
    return mt_fail(err, errlen, "%s: tensor '%s': shape %s, the config wants %s", path, t->name, got, want);
}

static bool same_shape(const mt_st_tensor *t, int ndim, const int64_t *shape)
{
    if (t->ndim != ndim) return false;
    for (int k = 0; k < ndim; k++)
        if (t->shape[k] != shape[k]) return false;
    return true;
}

/* A fused experts tensor in floating point, expert by expert. */
static int load_fused(mt_st_file *f, const mt_st_tensor *t, mt_host_state *st, const expected *x, char *err,
                      size_t errlen)
{
    const int64_t per = x->numel / x->shape[0];
    float *rows = malloc(sizeof(float) * (size_t)per), *tmp = malloc(sizeof(float) * (size_t)per);
    int rc = rows && tmp ? 0 : mt_fail(err, errlen, "%s: tensor '%s': out of memory", f->path, t->name);
    for (int e = 0; rc == 0 && e < (int)x->shape[0]; e++) {
        rc = mt_st_read_f32_range(f, t, e * per, per, rows, err, errlen);
        if (rc == 0) store_fused_expert(st, x, e, rows, tmp);
    }
    free(rows);
    free(tmp);
    return rc;
}

/* A fused experts tensor in MXFP4: blocks (E, R, C/32, 16) and scales (E, R, C/32), both U8,
 * where R x C is each expert's (transposed) matrix: (2 Ie, d) for gate_up_proj, (d, Ie) for
 * down_proj. Decoded expert by expert. */
static int load_quantized(mt_st_file *fb, const mt_st_tensor *blocks, mt_st_file *fs, const mt_st_tensor *scales,
                          mt_host_state *st, const expected *x, char *err, size_t errlen)
{
    const int64_t E = x->shape[0], R = x->shape[2], C = x->shape[1];
    if (C % MT_MXFP4_GROUP)
        return mt_fail(err, errlen, "%s: tensor '%s': MXFP4 rows of %lld elements, not a multiple of %d", fb->path,
                       blocks->name, (long long)C, MT_MXFP4_GROUP);
    const int64_t G = C / MT_MXFP4_GROUP;
    const int64_t bshape[4] = { E, R, G, MT_MXFP4_GROUP / 2 }, sshape[3] = { E, R, G };
    if (blocks->dtype != MT_ST_U8 || scales->dtype != MT_ST_U8)
        return mt_fail(err, errlen, "%s: tensor '%s': dtype %s, MXFP4 %s are U8", blocks->dtype != MT_ST_U8 ? fb->path
                       : fs->path, blocks->dtype != MT_ST_U8 ? blocks->name : scales->name,
                       mt_st_dtype_name(blocks->dtype != MT_ST_U8 ? blocks->dtype : scales->dtype),
                       blocks->dtype != MT_ST_U8 ? "blocks" : "scales");
    if (!same_shape(blocks, 4, bshape)) return bad_shape(fb->path, blocks, 4, bshape, err, errlen);
    if (!same_shape(scales, 3, sshape)) return bad_shape(fs->path, scales, 3, sshape, err, errlen);
    const uint64_t bbytes = (uint64_t)(R * G * MT_MXFP4_GROUP / 2), sbytes = (uint64_t)(R * G);
    uint8_t *b = malloc(bbytes), *sc = malloc(sbytes);
    float *rows = malloc(sizeof(float) * (size_t)(R * C));
    int rc = b && sc && rows ? 0 : mt_fail(err, errlen, "%s: tensor '%s': out of memory", fb->path, blocks->name);
    for (int64_t e = 0; rc == 0 && e < E; e++) {
        rc = mt_st_read_bytes(fb, blocks, (uint64_t)e * bbytes, bbytes, b, err, errlen) ||
             mt_st_read_bytes(fs, scales, (uint64_t)e * sbytes, sbytes, sc, err, errlen) ? -1 : 0;
        if (rc) break;
        mt_mxfp4_decode(R, G, b, sc, rows);
        store_decoded_expert(st, x, (int)e, rows);
    }
    free(b);
    free(sc);
    free(rows);
    return rc;
}

/* Where the shards are, for a tensor whose MXFP4 scales lie in another shard than its blocks. */
typedef struct shard_list {
    const char *dir;
    char **names;
} shard_list;

/* Loads every expected tensor that lives in shard `s` (opened as f). `index_path` is NULL for a
 * single-file checkpoint. */
static int load_shard(mt_st_file *f, int s, const char *index_path, const shard_list *shards, mt_host_state *st,
                      expected *e, int ne, char *err, size_t errlen)
{
    for (int i = 0; i < f->ntensors; i++) {
        const mt_st_tensor *t = &f->tensors[i];
        int match = MATCH_NAME;
        expected *x = find_expected(e, ne, t->name, &match);
        if (!x) {
            if (harmless_extra(st, t->name)) continue;
            return mt_fail(err, errlen, "%s: tensor '%s': unexpected tensor (not part of this %s config)", f->path, t->name,
                        st->cfg.model_type);
        }
        if (match == MATCH_SCALES) { /* read with the blocks */
            x->scales_seen = true;
            continue;
        }
        if (!index_path) x->quantized = match == MATCH_BLOCKS;
        if (x->shard != s || x->quantized != (match == MATCH_BLOCKS))
            return mt_fail(err, errlen, "%s: tensor '%s': present here but %s lists it in another shard", f->path, t->name,
                        index_path);
        if (x->loaded)
            return mt_fail(err, errlen, "%s: tensor '%s': present both as itself and as its MXFP4 blocks", f->path,
                           x->name);
        if (match == MATCH_BLOCKS) {
            char sname[200];
            snprintf(sname, sizeof sname, "%s_scales", x->name);
            mt_st_file *fs = f, *other = NULL;
            if (index_path && x->scales_shard != s) {
                char path[4096];
                snprintf(path, sizeof path, "%s/%s", shards->dir, shards->names[x->scales_shard]);
                if (!(other = mt_st_open(path, err, errlen))) return -1;
                fs = other;
            }
            const mt_st_tensor *ts = mt_st_find(fs, sname);
            int rc = ts ? load_quantized(f, t, fs, ts, st, x, err, errlen)
                        : mt_fail(err, errlen, "%s: tensor '%s': missing (the MXFP4 scales of %s)", fs->path, sname,
                                  t->name);
            if (other) mt_st_close(other);
            if (rc) return -1;
            x->loaded = true;
            continue;
        }
        if (t->dtype != MT_ST_F32 && t->dtype != MT_ST_F16 && t->dtype != MT_ST_BF16)
            return mt_fail(err, errlen, "%s: tensor '%s': dtype %s, weights must be F32, F16 or BF16", f->path, t->name,
                        mt_st_dtype_name(t->dtype));
        if (!same_shape(t, x->ndim, x->shape)) return bad_shape(f->path, t, x->ndim, x->shape, err, errlen);
        if (x->kind != EXPECT_PLAIN) {
            if (load_fused(f, t, st, x, err, errlen)) return -1;
        } else if (x->master) {
            if (mt_st_read_f32(f, t, x->master, err, errlen)) return -1;
        } else { /* compact: read as fp32, then encoded into the tile's planes */
            float *tmp = malloc(sizeof(float) * (size_t)x->numel);
            if (!tmp) return mt_fail(err, errlen, "%s: tensor '%s': out of memory", f->path, t->name);
            const int bad = mt_st_read_f32(f, t, tmp, err, errlen);
            if (!bad) mt_state_write_master(st, x->tile, x->offset, x->numel, tmp);
            free(tmp);
            if (bad) return -1;
        }
        x->loaded = true;
    }
    for (int i = 0; i < ne; i++)
        if (e[i].shard == s && !e[i].loaded)
            return mt_fail(err, errlen, "%s: tensor '%s': missing%s%s%s", f->path, e[i].name,
                        index_path ? " (" : "", index_path ? index_path : "", index_path ? " lists it in this file)" : "");
    return 0;
}

int mt_hf_load(const char *dir, mt_host_state *st, char *err, size_t errlen)
{
    char single[4096], index[4096], path[4096];
    snprintf(single, sizeof single, "%s/%s", dir, SINGLE_NAME);
    snprintf(index, sizeof index, "%s/%s", dir, INDEX_NAME);
    bool have_single = access(single, F_OK) == 0, have_index = access(index, F_OK) == 0;
    if (!have_single && !have_index)
        return mt_fail(err, errlen, "%s: neither %s nor %s: not a safetensors checkpoint directory", dir, SINGLE_NAME, INDEX_NAME);
    int ne = 0;
    expected *e = list_expected(st, &ne);
    if (!e) return mt_fail(err, errlen, "%s: out of memory", dir);
    char **shards = NULL;
    int nshards = 0, rc = 0;
    if (have_single) { /* transformers prefers the single file too */
        shards = calloc(2, sizeof *shards);
        shards[0] = strdup(SINGLE_NAME);
        nshards = 1;
        for (int i = 0; i < ne; i++) e[i].shard = 0;
    } else {
        rc = read_index(index, st, e, ne, &shards, &nshards, err, errlen);
    }
    for (int s = 0; s < nshards && rc == 0; s++) {
        snprintf(path, sizeof path, "%s/%s", dir, shards[s]);
        mt_st_file *f = mt_st_open(path, err, errlen);
        if (!f) {
            /* Name a tensor the shard was to provide, unless the reader's message names one: it
             * is read past the path the message starts with (a file name may hold "tensor '"). */
            const size_t plen = strlen(path);
            const char *said = strncmp(err, path, plen) == 0 ? err + plen : err;
            if (!have_single && !strstr(said, "tensor '")) {
                const char *who = "?";
                for (int i = 0; i < ne; i++)
                    if (e[i].shard == s) { who = e[i].name; break; }
                size_t at = strlen(err);
                snprintf(err + at, errlen > at ? errlen - at : 0, " (shard of tensor '%s' in %s)", who, index);
            }
            rc = -1;
            break;
        }
        const shard_list list = { .dir = dir, .names = shards };
        rc = load_shard(f, s, have_single ? NULL : index, &list, st, e, ne, err, errlen);
        mt_st_close(f);
    }
    for (int i = 0; i < ne && rc == 0; i++)
        if (e[i].scales_seen && !e[i].quantized)
            rc = mt_fail(err, errlen, "%s: tensor '%s_scales': MXFP4 scales beside the unquantised '%s'",
                         have_single ? single : index, e[i].name, e[i].name);
    for (int s = 0; s < nshards; s++) free(shards[s]);
    free(shards);
    free(e);
    if (rc == 0) mt_state_sync_weights(st);
    return rc;
}

/* Writes text to path through a temporary, fsync and rename. */
static int write_text_atomic(const char *path, const char *text, char *err, size_t errlen)
{
    char tmp[4200];
    mt_temp_name(path, tmp, sizeof tmp);
    FILE *fp = fopen(tmp, "w");
    if (!fp) return mt_fail(err, errlen, "%s: cannot create: %s", tmp, strerror(errno));
    int rc = fputs(text, fp) < 0 || fflush(fp) != 0 || fsync(fileno(fp)) != 0;
    rc |= fclose(fp) != 0;
    if (rc) {
        unlink(tmp);
        return mt_fail(err, errlen, "%s: write error: %s", tmp, strerror(errno));
    }
    if (rename(tmp, path) != 0) {
        unlink(tmp);
        return mt_fail(err, errlen, "%s: cannot rename %s into place: %s", path, tmp, strerror(errno));
    }
    return 0;
}

/* config.json as mt_config_save writes it, with torch_dtype naming the saved weights' dtype. */
static int save_config(const char *dir, const mt_model_config *cfg, mt_dtype dtype, char *err, size_t errlen)
{
    char path[4096], tmp[4200];
    snprintf(path, sizeof path, "%s/config.json", dir);
    snprintf(tmp, sizeof tmp, "%s.cfg.%ld", path, (long)getpid());
    if (mt_config_save(cfg, tmp, err, errlen)) return -1;
    json_error_t je;
    json_t *o = json_load_file(tmp, 0, &je);
    unlink(tmp);
    if (!o) return mt_fail(err, errlen, "%s: cannot read back the written config: %s", tmp, je.text);
    json_object_set_new(o, "torch_dtype", json_string(dtype == MT_DTYPE_BF16 ? "bfloat16" : "float32"));
    char *text = json_dumps(o, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(o);
    if (!text) return mt_fail(err, errlen, "%s: out of memory", path);
    int rc = write_text_atomic(path, text, err, errlen);
    free(text);
    return rc;
}

/* "model-00001-of-00004.safetensors" */
static void shard_name(int k, int n, char *buf, size_t len)
{
    snprintf(buf, len, "model-%05d-of-%05d.safetensors", k + 1, n);
}

/* Removes files of an earlier save that the new layout does not use: the single file, the index,
 * and shard files not in this save's set (nshards 1 = single file). */
static void remove_stale(const char *dir, int nshards)
{
    char path[4096], keep[64];
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *de;
    while ((de = readdir(d))) {
        int k, n;
        char tail[32];
        bool stale = false;
        if (nshards > 1 && !strcmp(de->d_name, SINGLE_NAME)) stale = true;
        if (nshards == 1 && !strcmp(de->d_name, INDEX_NAME)) stale = true;
        if (sscanf(de->d_name, "model-%5d-of-%5d.%31s", &k, &n, tail) == 3 && !strcmp(tail, "safetensors")) {
            shard_name(k - 1, n, keep, sizeof keep);
            stale = !strcmp(keep, de->d_name) && (nshards == 1 || n != nshards);
        }
        if (stale) {
            snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
            unlink(path);
        }
    }
    closedir(d);
}

/* One tensor of a compact tile, read out of its master planes for the writer. */
typedef struct master_source {
    const mt_host_state *st;
    int tile;
    int64_t offset;
} master_source;

static void read_master_chunk(const void *ctx, int64_t first, int64_t n, float *dst)
{
    const master_source *m = ctx;
    mt_state_read_master(m->st, m->tile, m->offset + first, n, dst);
}

/* A fused experts tensor of gpt_oss for the writer (the inverse of store_fused_expert): its
 * elements in HF order, from one expert's slots at a time, which every such tensor of the save
 * caches in one buffer (the writer reads a tensor through before the next). */
typedef struct fused_cache {
    float *buf;          /* 2 Ie d floats: an expert's gate and up, or its down */
    const void *tensor;  /* whose expert it holds (NULL: none) */
    int expert;
} fused_cache;

/* The masters a sharded state does not hold (rank 0 saving a model trained over several ranks):
 * read whole through mt_state_master_f32, whose st->remote_master has the owner send it, into one
 * buffer that every such tensor of the save shares. The writer reads a tensor through before the
 * next, and a tile's tensors are neighbours in HF order, so rank 0 holds one tile's master at a
 * time (a tile read again is sent again). */
typedef struct remote_cache {
    const mt_host_state *st;
    float *buf;
    int tile; /* whose master buf holds (-1: none) */
} remote_cache;

static const float *remote_tile(remote_cache *c, int tile)
{
    if (c->tile != tile) {
        c->tile = -1;
        if (!mt_state_master_f32(c->st, tile, &c->buf)) {
            /* the writer's reads cannot fail: a lost rank, or no memory for one tile */
            fprintf(stderr, "megatrain: cannot read tile %d's master weights (rank %d's) for the save\n", tile,
                    mt_state_owner(c->st, tile));
            abort();
        }
        c->tile = tile;
    }
    return c->buf;
}

typedef struct remote_source {
    remote_cache *cache;
    int tile;
    int64_t offset;
} remote_source;

static void read_remote_chunk(const void *ctx, int64_t first, int64_t n, float *dst)
{
    const remote_source *r = ctx;
    memcpy(dst, remote_tile(r->cache, r->tile) + r->offset + first, sizeof(float) * (size_t)n);
}

typedef struct fused_source {
    const mt_host_state *st;
    const struct expected *x;
    fused_cache *cache;
    remote_cache *remote;
} fused_source;

static void read_tile(const fused_source *f, int tile, int64_t offset, int64_t n, float *dst)
{
    const mt_host_state *st = f->st;
    if (st->tiles[tile].master) memcpy(dst, st->tiles[tile].master + offset, sizeof(float) * (size_t)n);
    else if (st->layout == MT_LAYOUT_COMPACT) mt_state_read_master(st, tile, offset, n, dst);
    else memcpy(dst, remote_tile(f->remote, tile) + offset, sizeof(float) * (size_t)n);
}

static void read_fused_chunk(const void *ctx, int64_t first, int64_t n, float *dst)
{
    const fused_source *f = ctx;
    const expected *x = f->x;
    fused_cache *c = f->cache;
    const int64_t d = f->st->cfg.hidden, Ie = f->st->cfg.expert_intermediate, per = x->numel / x->shape[0];
    const bool gu = x->kind == EXPECT_EXPERTS_GU;
    for (int64_t k = 0; k < n; k++) {
        const int64_t idx = first + k, e = idx / per, r = idx % per;
        if (c->tensor != x || c->expert != (int)e) {
            if (gu) {
                read_tile(f, x->tile, slot_offset(x, (int)e, MT_X_GATE), Ie * d, c->buf);
                read_tile(f, x->tile, slot_offset(x, (int)e, MT_X_UP), Ie * d, c->buf + Ie * d);
            } else {
                read_tile(f, x->tile, slot_offset(x, (int)e, MT_X_DOWN), d * Ie, c->buf);
            }
            c->tensor = x;
            c->expert = (int)e;
        }
        if (gu) { /* (d, 2 Ie): row i, column c is gate (c even) or up (c odd) row c / 2, column i */
            const int64_t i = r / (2 * Ie), col = r % (2 * Ie);
            dst[k] = c->buf[(col & 1) * Ie * d + (col >> 1) * d + i];
        } else { /* (Ie, d): row j, column o is down's row o, column j */
            const int64_t j = r / d, o = r % d;
            dst[k] = c->buf[o * Ie + j];
        }
    }
}

int mt_hf_save(const char *dir, const mt_host_state *st, mt_dtype dtype, uint64_t max_shard_bytes,
               char *err, size_t errlen)
{
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) return mt_fail(err, errlen, "%s: cannot create: %s", dir, strerror(errno));
    char marker[4200];
    snprintf(marker, sizeof marker, "%s/%s", dir, MT_HF_MARKER);
    if (write_text_atomic(marker, "{\n  \"written_by\": \"megatrain\",\n  \"note\": \"a directory megatrain wrote: a later "
                                  "--save-model may replace its files\"\n}\n", err, errlen))
        return -1;
    mt_st_dtype fdtype = dtype == MT_DTYPE_BF16 ? MT_ST_BF16 : MT_ST_F32;
    int ne = 0;
    expected *e = list_expected(st, &ne);
    mt_st_source *src = calloc((size_t)ne + 1, sizeof *src);
    master_source *ctx = calloc((size_t)ne + 1, sizeof *ctx);
    fused_source *fctx = calloc((size_t)ne + 1, sizeof *fctx);
    remote_source *rctx = calloc((size_t)ne + 1, sizeof *rctx);
    fused_cache cache = { .buf = NULL, .tensor = NULL, .expert = -1 };
    remote_cache remote = { .st = st, .buf = NULL, .tile = -1 };
    if (st->cfg.family == MT_FAMILY_GPT_OSS && mt_config_sparse_layers(&st->cfg) > 0)
        cache.buf = malloc(sizeof(float) * (size_t)(2 * st->cfg.expert_intermediate * st->cfg.hidden));
    if (!e || !src || !ctx || !fctx || !rctx || (st->cfg.family == MT_FAMILY_GPT_OSS && !cache.buf)) {
        free(e);
        free(src);
        free(ctx);
        free(fctx);
        free(rctx);
        free(cache.buf);
        return mt_fail(err, errlen, "%s: out of memory", dir);
    }
    /* Greedy shards in HF order, as save_pretrained: a new shard when the next tensor would
     * overflow this one; a tensor larger than the limit sits alone. */
    uint64_t in_shard = 0, total = 0;
    int nshards = 1;
    for (int i = 0; i < ne; i++) {
        uint64_t bytes = mt_st_nbytes(fdtype, e[i].numel);
        if (max_shard_bytes > 0 && in_shard > 0 && in_shard + bytes > max_shard_bytes) {
            nshards++;
            in_shard = 0;
        }
        e[i].shard = nshards - 1;
        in_shard += bytes;
        total += bytes;
        src[i] = (mt_st_source){ .name = e[i].name, .ndim = e[i].ndim,
                                 .shape = { e[i].shape[0], e[i].shape[1], e[i].shape[2] }, .data = e[i].master };
        if (e[i].kind != EXPECT_PLAIN) {
            fctx[i] = (fused_source){ .st = st, .x = &e[i], .cache = &cache, .remote = &remote };
            src[i].data = NULL;
            src[i].read = read_fused_chunk;
            src[i].ctx = &fctx[i];
        } else if (st->layout == MT_LAYOUT_COMPACT) {
            /* compact: the masters are decoded from their planes chunk by chunk as the writer goes */
            ctx[i] = (master_source){ .st = st, .tile = e[i].tile, .offset = e[i].offset };
            src[i].data = NULL;
            src[i].read = read_master_chunk;
            src[i].ctx = &ctx[i];
        } else if (!e[i].master) {
            rctx[i] = (remote_source){ .cache = &remote, .tile = e[i].tile, .offset = e[i].offset };
            src[i].read = read_remote_chunk;
            src[i].ctx = &rctx[i];
        }
    }
    char path[4096], name[64];
    int rc = 0;
    json_t *map = json_object();
    for (int s = 0, first = 0; s < nshards && rc == 0; s++) {
        int last = first;
        while (last < ne && e[last].shard == s) last++;
        if (nshards == 1) snprintf(name, sizeof name, "%s", SINGLE_NAME);
        else shard_name(s, nshards, name, sizeof name);
        snprintf(path, sizeof path, "%s/%s", dir, name);
        rc = mt_st_write(path, src + first, last - first, fdtype, err, errlen);
        for (int i = first; i < last; i++) json_object_set_new(map, e[i].name, json_string(name));
        first = last;
    }
    if (rc == 0 && nshards > 1) {
        json_t *root = json_object(), *meta = json_object();
        json_object_set_new(meta, "total_size", json_integer((json_int_t)total));
        json_object_set_new(root, "metadata", meta);
        json_object_set(root, "weight_map", map);
        char *text = json_dumps(root, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
        json_decref(root);
        snprintf(path, sizeof path, "%s/%s", dir, INDEX_NAME);
        rc = text ? write_text_atomic(path, text, err, errlen) : mt_fail(err, errlen, "%s: out of memory", path);
        free(text);
    }
    json_decref(map);
    if (rc == 0) rc = save_config(dir, &st->cfg, dtype, err, errlen);
    if (rc == 0) remove_stale(dir, nshards);
    if (rc == 0) mt_sync_dir(dir); /* make the renames durable */
    free(remote.buf);
    free(cache.buf);
    free(rctx);
    free(fctx);
    free(ctx);
    free(src);
    free(e);
    return rc;
}

/* Tokenizer files of an HF directory: copied with the weights, and accepted in an output that a
 * later save replaces. */
static const char *const tokenizer_files[] = {
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
    "chat_template.jinja", "chat_template.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
    NULL,
};

/* Whether a directory entry is one mt_hf_save or mt_hf_copy_tokenizer writes (or their temporaries). */
static bool megatrain_output_name(const char *name)
{
    static const char *const fixed[] = { "config.json", SINGLE_NAME, INDEX_NAME, MT_HF_MARKER, NULL };
    for (const char *const *f = fixed; *f; f++)
        if (!strcmp(name, *f)) return true;
    for (const char *const *f = tokenizer_files; *f; f++)
        if (!strcmp(name, *f)) return true;
    int k, n;
    char tail[32];
    if (sscanf(name, "model-%5d-of-%5d.%31s", &k, &n, tail) == 3 && !strcmp(tail, "safetensors")) return true;
    const char *tmp = strstr(name, ".tmp.");
    if (!tmp) tmp = strstr(name, ".cfg.");
    if (tmp && tmp[5]) {
        size_t digits = strspn(tmp + 5, "0123456789");
        if (!tmp[5 + digits]) return true;
    }
    return false;
}

int mt_hf_check_output(const char *dir, char *err, size_t errlen)
{
    char why[4400];
    struct stat sb;
    if (stat(dir, &sb) != 0) {
        if (errno != ENOENT) return mt_fail(err, errlen, "%s: %s", dir, strerror(errno));
        char path[4096], parent[4096];
        snprintf(path, sizeof path, "%s", dir);
        for (size_t n = strlen(path); n > 1 && path[n - 1] == '/'; n--) path[n - 1] = 0;
        mt_dir_of(path, parent, sizeof parent);
        if (mt_probe_directory(parent, why, sizeof why))
            return mt_fail(err, errlen, "%s: cannot be created: %s", dir, why);
        return 0;
    }
    if (!S_ISDIR(sb.st_mode))
        return mt_fail(err, errlen, "%s: an existing file, not a directory: name a new or empty directory", dir);
    DIR *d = opendir(dir);
    if (!d) return mt_fail(err, errlen, "%s: cannot list: %s", dir, strerror(errno));
    char unrelated[512] = "";
    size_t at = 0;
    int nunrelated = 0, nentries = 0;
    bool marked = false;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        nentries++;
        /* the marker, or its temporary: a save cut short while writing it */
        if (!strncmp(de->d_name, MT_HF_MARKER, strlen(MT_HF_MARKER))) marked = true;
        if (megatrain_output_name(de->d_name)) continue;
        if (nunrelated++ < 4 && at < sizeof unrelated)
            at += (size_t)snprintf(unrelated + at, sizeof unrelated - at, "%s%s", at ? ", " : "", de->d_name);
    }
    closedir(d);
    if (nunrelated > 0)
        return mt_fail(err, errlen, "%s: holds files megatrain does not write (%s%s): name a new or empty directory", dir,
                       unrelated, nunrelated > 4 ? ", ..." : "");
    if (nentries > 0 && !marked)
        return mt_fail(err, errlen, "%s: holds a model megatrain did not write (no %s): name a new or empty directory, "
                       "or remove it first", dir, MT_HF_MARKER);
    if (mt_probe_directory(dir, why, sizeof why)) return mt_fail(err, errlen, "%s", why);
    return 0;
}

/* Copies from to to through a temporary, fsync and rename. */
static int copy_file_atomic(const char *from, const char *to, char *err, size_t errlen)
{
    FILE *in = fopen(from, "rb");
    if (!in) return mt_fail(err, errlen, "%s: cannot open: %s", from, strerror(errno));
    char tmp[4200];
    mt_temp_name(to, tmp, sizeof tmp);
    FILE *out = fopen(tmp, "wb");
    if (!out) {
        fclose(in);
        return mt_fail(err, errlen, "%s: cannot create: %s", tmp, strerror(errno));
    }
    char buf[1 << 16];
    size_t n;
    bool failed = false;
    while (!failed && (n = fread(buf, 1, sizeof buf, in)) > 0) failed = fwrite(buf, 1, n, out) != n;
    failed |= ferror(in) != 0;
    fclose(in);
    failed |= fflush(out) != 0 || fsync(fileno(out)) != 0;
    failed |= fclose(out) != 0;
    if (failed || rename(tmp, to) != 0) {
        int e = errno;
        unlink(tmp);
        return mt_fail(err, errlen, "%s: cannot write (from %s): %s", to, from, strerror(e));
    }
    return 0;
}

int mt_hf_copy_tokenizer(const char *from, const char *to, int *copied, char *err, size_t errlen)
{
    if (copied) *copied = 0;
    if (mt_same_file(from, to)) return 0;
    for (const char *const *f = tokenizer_files; *f; f++) {
        char src[4200], dst[4200];
        snprintf(src, sizeof src, "%s/%s", from, *f);
        snprintf(dst, sizeof dst, "%s/%s", to, *f);
        if (access(src, F_OK) != 0) continue;
        if (copy_file_atomic(src, dst, err, errlen)) return -1;
        if (copied) (*copied)++;
    }
    mt_sync_dir(to);
    return 0;
}

/* Keys of a base config.json that a save does not take over: the dtype is the saved weights' own
 * (mt_hf_save writes torch_dtype), and the version of transformers that wrote the base did not
 * write this directory. */
static bool base_key_skipped(const char *key)
{
    /* quantization_config: the weights are saved unquantised (a gpt_oss checkpoint's MXFP4
     * experts are decoded on load), so the base's would misdescribe them */
    return !strcmp(key, "torch_dtype") || !strcmp(key, "dtype") || !strcmp(key, "transformers_version") ||
           !strcmp(key, "quantization_config");
}

int mt_hf_keep_base_config(const char *base_dir, const char *dir, int *kept, char *err, size_t errlen)
{
    if (kept) *kept = 0;
    if (mt_same_file(base_dir, dir)) return 0;
    char base_path[4200], path[4200];
    snprintf(base_path, sizeof base_path, "%s/config.json", base_dir);
    snprintf(path, sizeof path, "%s/config.json", dir);
    json_error_t je;
    json_t *base = json_load_file(base_path, 0, &je);
    if (!base || !json_is_object(base)) {
        json_decref(base);
        return mt_fail(err, errlen, "%s: cannot read it as a JSON object: %s", base_path, je.text);
    }
    json_t *saved = json_load_file(path, JSON_PRESERVE_ORDER, &je);
    if (!saved || !json_is_object(saved)) {
        json_decref(base);
        json_decref(saved);
        return mt_fail(err, errlen, "%s: cannot read back the written config: %s", path, je.text);
    }
    int n = 0;
    const char *key;
    json_t *v;
    json_object_foreach(base, key, v) {
        if (base_key_skipped(key) || json_object_get(saved, key)) continue;
        json_object_set(saved, key, v);
        n++;
    }
    int rc = 0;
    if (n > 0) {
        char *text = json_dumps(saved, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
        rc = text ? write_text_atomic(path, text, err, errlen) : mt_fail(err, errlen, "%s: out of memory", path);
        free(text);
        if (rc == 0) mt_sync_dir(dir);
    }
    json_decref(base);
    json_decref(saved);
    if (rc == 0 && kept) *kept = n;
    return rc;
}

int mt_hf_weights_dtype(const char *dir, mt_st_dtype *dtype, char *err, size_t errlen)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, SINGLE_NAME);
    if (access(path, F_OK) != 0) {
        char index[4200];
        snprintf(index, sizeof index, "%s/%s", dir, INDEX_NAME);
        json_error_t je;
        json_t *root = json_load_file(index, 0, &je);
        if (!root) return mt_fail(err, errlen, "%s: neither %s nor a readable %s", dir, SINGLE_NAME, INDEX_NAME);
        const char *key, *first = NULL;
        json_t *v;
        json_object_foreach(json_object_get(root, "weight_map"), key, v) {
            if (json_is_string(v) && plain_file_name(json_string_value(v))) {
                first = json_string_value(v);
                break;
            }
        }
        if (first) snprintf(path, sizeof path, "%s/%s", dir, first);
        json_decref(root);
        if (!first) return mt_fail(err, errlen, "%s: no shard in its weight_map", index);
    }
    mt_st_file *f = mt_st_open(path, err, errlen);
    if (!f) return -1;
    int count[3] = { 0, 0, 0 }; /* F32, F16, BF16 */
    for (int i = 0; i < f->ntensors; i++)
        if (f->tensors[i].dtype <= MT_ST_BF16) count[f->tensors[i].dtype]++;
    mt_st_close(f);
    int best = MT_ST_F32;
    for (int k = 1; k < 3; k++)
        if (count[k] > count[best]) best = k;
    *dtype = (mt_st_dtype)best;
    return 0;
}
