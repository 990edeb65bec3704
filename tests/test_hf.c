/* HF checkpoints: save/load round trips (fp32 bitwise, bf16 equal to the rounded masters, one
 * file and shards, re-saves that change the layout), F16/BF16/F32 files written by hand, and every
 * class of bad file, whose message must name the file and the tensor. */
#include <check.h>
#include <dirent.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "models/config.h"
#include "backends/cpu/ops.h"
#include "runtime/hf.h"
#include "models/layout.h"
#include "runtime/runtime.h"
#include "models/safetensors.h"
#include "models/util.h"
#include "runtime/state.h"
#include "tests/testutil.h"

/* Qwen2 with q/k/v bias, untied; H*D == d. */
static const char qwen2_json[] =
    "{\"model_type\": \"qwen2\", \"hidden_size\": 64, \"intermediate_size\": 96, \"num_hidden_layers\": 2,"
    " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"vocab_size\": 300,"
    " \"max_position_embeddings\": 128, \"tie_word_embeddings\": false}";
/* Same, tied: no lm_head.weight. */
static const char qwen2_tied_json[] =
    "{\"model_type\": \"qwen2\", \"hidden_size\": 64, \"intermediate_size\": 96, \"num_hidden_layers\": 2,"
    " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"vocab_size\": 300,"
    " \"max_position_embeddings\": 128, \"tie_word_embeddings\": true}";
/* Qwen3: q/k norm, H*D != d, sizes off the tile alignment. */
static const char qwen3_json[] =
    "{\"model_type\": \"qwen3\", \"hidden_size\": 48, \"intermediate_size\": 100, \"num_hidden_layers\": 2,"
    " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 16, \"vocab_size\": 261,"
    " \"max_position_embeddings\": 128, \"tie_word_embeddings\": false}";
static const char llama_json[] =
    "{\"model_type\": \"llama\", \"hidden_size\": 64, \"intermediate_size\": 160, \"num_hidden_layers\": 3,"
    " \"num_attention_heads\": 8, \"num_key_value_heads\": 4, \"vocab_size\": 333,"
    " \"max_position_embeddings\": 128}";

static const char *const configs[] = { qwen2_json, qwen2_tied_json, qwen3_json, llama_json };
static const char *const config_names[] = { "qwen2", "qwen2-tied", "qwen3", "llama" };
#define NCONFIGS 4

static void runtime_up(void)
{
    mt_runtime_options ro = { .sched = "eager", .ncpu = 2, .ncuda = 0 };
    char err[512] = "";
    ck_assert_msg(mt_runtime_init(&ro, err, sizeof err) == 0, "mt_runtime_init: %s", err);
}

static void runtime_down(void) { mt_runtime_shutdown(); }

static mt_model_config parse_config(int which)
{
    mt_model_config cfg;
    char err[512] = "";
    ck_assert_msg(mt_config_parse(configs[which], config_names[which], &cfg, err, sizeof err) == 0, "%s", err);
    return cfg;
}

/* A state of that config with zeroed weights. */
static mt_host_state *new_state(const mt_model_config *cfg, mt_dtype dtype)
{
    char err[512] = "";
    mt_host_state *st = mt_state_create(cfg, dtype, 0, err, sizeof err);
    ck_assert_msg(st != NULL, "mt_state_create: %s", err);
    return st;
}

static mt_host_state *random_state(int which, mt_dtype dtype, uint64_t seed)
{
    mt_model_config cfg = parse_config(which);
    mt_host_state *st = new_state(&cfg, dtype);
    /* std 1 rather than 0.02: more distinct bf16 values, so rounding mistakes show. */
    mt_state_init_random(st, seed, 1.0);
    return st;
}

/* A fresh empty directory; the caller frees the string. */
static char *temp_dir(void)
{
    char *d = strdup("/tmp/mt-hf.XXXXXX");
    ck_assert_msg(mkdtemp(d) != NULL, "mkdtemp failed");
    return d;
}

/* Removes a directory of plain files. */
static void remove_dir(char *dir)
{
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *de;
        char p[4096];
        while ((de = readdir(d)))
            if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..")) {
                snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
                unlink(p);
            }
        closedir(d);
    }
    rmdir(dir);
    free(dir);
}

static bool exists(const char *dir, const char *name)
{
    char p[4096];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return access(p, F_OK) == 0;
}

static int count_files(const char *dir, const char *suffix)
{
    DIR *d = opendir(dir);
    ck_assert(d != NULL);
    struct dirent *de;
    int n = 0;
    size_t ls = strlen(suffix);
    while ((de = readdir(d))) {
        size_t l = strlen(de->d_name);
        if (l >= ls && !strcmp(de->d_name + l - ls, suffix)) n++;
    }
    closedir(d);
    return n;
}

static void save_ok(const char *dir, const mt_host_state *st, mt_dtype dtype, uint64_t max_shard)
{
    char err[1024] = "";
    ck_assert_msg(mt_hf_save(dir, st, dtype, max_shard, err, sizeof err) == 0, "mt_hf_save(%s): %s", dir, err);
}

/* Loads dir into a fresh state of src's config and returns it. */
static mt_host_state *load_ok(const char *dir, const mt_model_config *cfg, mt_dtype compute)
{
    mt_host_state *st = new_state(cfg, compute);
    char err[1024] = "";
    ck_assert_msg(mt_hf_load(dir, st, err, sizeof err) == 0, "mt_hf_load(%s): %s", dir, err);
    return st;
}

/* Every tile's master of b equals a's (bf16: a's rounded to bf16), bit for bit, padding too; and
 * b's streamed copy was refreshed from its master. */
static void assert_masters(const mt_host_state *a, const mt_host_state *b, bool bf16_rounded)
{
    for (int i = 0; i < a->ntiles; i++) {
        const mt_tile *ta = &a->tiles[i], *tb = &b->tiles[i];
        ck_assert_int_eq(ta->numel, tb->numel);
        float *want = malloc(sizeof(float) * (size_t)ta->numel);
        for (int64_t e = 0; e < ta->numel; e++)
            want[e] = bf16_rounded ? mt_float_from_bf16(mt_bf16_from_float(ta->master[e])) : ta->master[e];
        int64_t bad = -1;
        for (int64_t e = 0; e < ta->numel && bad < 0; e++)
            if (memcmp(&want[e], &tb->master[e], sizeof(float))) bad = e;
        ck_assert_msg(bad < 0, "tile %d element %lld: %.9g, want %.9g", i, (long long)bad,
                      bad >= 0 ? tb->master[bad] : 0.0, bad >= 0 ? want[bad] : 0.0);
        if (b->compute_dtype == MT_DTYPE_F32) {
            ck_assert(memcmp(tb->weights, tb->master, sizeof(float) * (size_t)tb->numel) == 0);
        } else {
            const mt_bf16 *w = tb->weights;
            for (int64_t e = 0; e < tb->numel; e++) ck_assert_uint_eq(w[e], mt_bf16_from_float(tb->master[e]));
        }
        free(want);
    }
}

/* Each config, saved in fp32 as one file, loads back bit for bit, into fp32 and bf16 states. */
START_TEST(test_roundtrip_fp32)
{
    for (int c = 0; c < NCONFIGS; c++) {
        mt_host_state *src = random_state(c, MT_DTYPE_F32, 11 + c);
        char *dir = temp_dir();
        save_ok(dir, src, MT_DTYPE_F32, 0);
        ck_assert(exists(dir, "model.safetensors"));
        ck_assert(exists(dir, "config.json"));
        ck_assert(!exists(dir, "model.safetensors.index.json"));
        ck_assert_int_eq(count_files(dir, ".tmp"), 0);
        for (int d = 0; d < 2; d++) {
            mt_host_state *dst = load_ok(dir, &src->cfg, d ? MT_DTYPE_BF16 : MT_DTYPE_F32);
            assert_masters(src, dst, false);
            mt_state_destroy(dst);
        }
        /* The config written beside the weights describes the same model. */
        char path[4096], err[512] = "";
        mt_model_config back;
        snprintf(path, sizeof path, "%s/config.json", dir);
        ck_assert_msg(mt_config_load(path, &back, err, sizeof err) == 0, "%s", err);
        ck_assert_int_eq(back.family, src->cfg.family);
        ck_assert_int_eq(back.tied, src->cfg.tied);
        ck_assert_int_eq(back.qkv_bias, src->cfg.qkv_bias);
        ck_assert_int_eq(back.qk_norm, src->cfg.qk_norm);
        ck_assert_int_eq(back.head_dim, src->cfg.head_dim);
        remove_dir(dir);
        mt_state_destroy(src);
    }
}
END_TEST

/* Saved in bf16, the masters come back as the bf16 rounding of the originals; config.json says
 * bfloat16. */
START_TEST(test_roundtrip_bf16)
{
    for (int c = 0; c < NCONFIGS; c++) {
        mt_host_state *src = random_state(c, MT_DTYPE_BF16, 21 + c);
        char *dir = temp_dir();
        save_ok(dir, src, MT_DTYPE_BF16, 0);
        mt_host_state *dst = load_ok(dir, &src->cfg, MT_DTYPE_F32);
        assert_masters(src, dst, true);
        mt_state_destroy(dst);
        char path[4096];
        snprintf(path, sizeof path, "%s/config.json", dir);
        json_t *o = json_load_file(path, 0, NULL);
        ck_assert(o != NULL);
        ck_assert_str_eq(json_string_value(json_object_get(o, "torch_dtype")), "bfloat16");
        json_decref(o);
        remove_dir(dir);
        mt_state_destroy(src);
    }
}
END_TEST

/* The weight_map of an index file, as a new reference. */
static json_t *read_index(const char *dir)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    json_t *o = json_load_file(path, 0, NULL);
    ck_assert_msg(o != NULL, "%s unreadable", path);
    return o;
}

/* A small shard limit gives several shards and an index (total_size, every tensor mapped); they
 * load back bit for bit; re-saving the same directory unsharded, or with another shard count,
 * leaves no stale file that transformers or mt_hf_load would pick up. */
START_TEST(test_sharded)
{
    for (int c = 0; c < NCONFIGS; c++) {
        for (int d = 0; d < 2; d++) {
            mt_dtype dt = d ? MT_DTYPE_BF16 : MT_DTYPE_F32;
            mt_host_state *src = random_state(c, MT_DTYPE_F32, 31 + c);
            char *dir = temp_dir();
            save_ok(dir, src, dt, 30000);
            int nshards = count_files(dir, ".safetensors");
            ck_assert_msg(nshards >= 3, "%s: %d shards", config_names[c], nshards);
            ck_assert(!exists(dir, "model.safetensors"));
            char first[64];
            snprintf(first, sizeof first, "model-00001-of-%05d.safetensors", nshards);
            ck_assert_msg(exists(dir, first), "no %s", first);
            json_t *ix = read_index(dir);
            json_t *map = json_object_get(ix, "weight_map");
            int64_t params = 0;
            for (int i = 0; i < src->ntiles; i++)
                for (int s = 0; s < src->tiles[i].layout->ntensors; s++)
                    params += src->tiles[i].layout->tensors[s].numel;
            ck_assert_int_eq(mt_config_param_count(&src->cfg), params);
            ck_assert_int_eq(json_integer_value(json_object_get(json_object_get(ix, "metadata"), "total_size")),
                             params * (d ? 2 : 4));
            int ntensors = 0;
            for (int i = 0; i < src->ntiles; i++)
                for (int s = 0; s < src->tiles[i].layout->ntensors; s++) ntensors += src->tiles[i].layout->tensors[s].numel > 0;
            ck_assert_int_eq(json_object_size(map), ntensors);
            json_decref(ix);
            mt_host_state *dst = load_ok(dir, &src->cfg, MT_DTYPE_F32);
            assert_masters(src, dst, d == 1);
            mt_state_destroy(dst);
            /* Other shard count, then a single file: stale files go. */
            save_ok(dir, src, dt, 60000);
            int n2 = count_files(dir, ".safetensors");
            ck_assert_msg(n2 >= 2 && n2 < nshards, "%d shards after re-save, %d before", n2, nshards);
            save_ok(dir, src, dt, 0);
            ck_assert_int_eq(count_files(dir, ".safetensors"), 1);
            ck_assert(exists(dir, "model.safetensors"));
            ck_assert(!exists(dir, "model.safetensors.index.json"));
            dst = load_ok(dir, &src->cfg, MT_DTYPE_F32);
            assert_masters(src, dst, d == 1);
            mt_state_destroy(dst);
            remove_dir(dir);
            mt_state_destroy(src);
        }
    }
}
END_TEST

/* One tensor of a hand-written file: raw little-endian bytes under a given dtype name. */
typedef struct raw_tensor {
    const char *name;
    const char *dtype;
    int ndim;
    int64_t shape[2];
    const void *data;
    size_t bytes;
} raw_tensor;

/* Writes a safetensors file from raw tensors, offsets in order, no padding. */
static void write_raw(const char *path, const raw_tensor *t, int n)
{
    json_t *root = json_object();
    size_t at = 0;
    for (int i = 0; i < n; i++) {
        json_t *shape = json_array();
        for (int d = 0; d < t[i].ndim; d++) json_array_append_new(shape, json_integer(t[i].shape[d]));
        json_object_set_new(root, t[i].name, json_pack("{s:s, s:o, s:[I, I]}", "dtype", t[i].dtype, "shape", shape,
                                                       "data_offsets", (json_int_t)at, (json_int_t)(at + t[i].bytes)));
        at += t[i].bytes;
    }
    char *h = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(root);
    FILE *f = fopen(path, "wb");
    ck_assert(f != NULL);
    uint64_t len = strlen(h);
    ck_assert(fwrite(&len, 8, 1, f) == 1);
    ck_assert(fwrite(h, 1, len, f) == len);
    for (int i = 0; i < n; i++) ck_assert(fwrite(t[i].data, 1, t[i].bytes, f) == t[i].bytes);
    ck_assert(fclose(f) == 0);
    free(h);
}

/* Independent half decoding: sign * mantissa * 2^exponent. */
static float half_reference(uint16_t h)
{
    int exp = (h >> 10) & 31, mant = h & 1023;
    double v = exp == 0 ? ldexp(mant, -24) : ldexp(1024 + mant, exp - 25);
    return (float)((h & 0x8000) ? -v : v);
}

/* A file mixing F16, BF16 and F32 tensors (F16 covering subnormals, signed zeros and large values)
 * loads every one exactly. */
START_TEST(test_f16_bf16_f32_by_hand)
{
    mt_model_config cfg = parse_config(2);
    mt_host_state *st = new_state(&cfg, MT_DTYPE_F32);
    mt_host_state *want = new_state(&cfg, MT_DTYPE_F32);
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 5);
    raw_tensor t[64];
    void *bufs[64];
    int n = 0;
    for (int i = 0; i < st->ntiles; i++) {
        mt_tile *tile = &want->tiles[i];
        for (int s = 0; s < tile->layout->ntensors; s++) {
            const mt_tensor_desc *d = &tile->layout->tensors[s];
            if (!d->numel) continue;
            static char names[64][128];
            mt_layout_full_name(tile->layout, i - 1, s, names[n], sizeof names[n]);
            int kind = n % 3; /* 0 F16, 1 BF16, 2 F32 */
            size_t esz = kind == 2 ? 4 : 2;
            bufs[n] = malloc((size_t)d->numel * esz);
            float *dst = tile->master + d->offset;
            for (int64_t e = 0; e < d->numel; e++) {
                uint32_t r = (uint32_t)(mt_test_uniform(&rng) * 4294967296.0);
                if (kind == 0) {
                    uint16_t h = (uint16_t)r;
                    if (((h >> 10) & 31) == 31) h &= 0xBFFF; /* finite only */
                    ((uint16_t *)bufs[n])[e] = h;
                    dst[e] = half_reference(h);
                } else if (kind == 1) {
                    float x = (float)mt_test_normal(&rng);
                    mt_bf16 b = mt_bf16_from_float(x);
                    ((uint16_t *)bufs[n])[e] = b;
                    uint32_t u = (uint32_t)b << 16;
                    memcpy(&dst[e], &u, 4);
                } else {
                    float x = (float)mt_test_normal(&rng);
                    ((float *)bufs[n])[e] = x;
                    dst[e] = x;
                }
            }
            t[n] = (raw_tensor){ names[n], kind == 0 ? "F16" : kind == 1 ? "BF16" : "F32", d->ndim,
                                 { d->shape[0], d->shape[1] }, bufs[n], (size_t)d->numel * esz };
            n++;
        }
    }
    char *dir = temp_dir();
    char path[4096], err[1024] = "";
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    write_raw(path, t, n);
    ck_assert_msg(mt_hf_load(dir, st, err, sizeof err) == 0, "%s", err);
    assert_masters(want, st, false);
    for (int i = 0; i < n; i++) free(bufs[i]);
    remove_dir(dir);
    mt_state_destroy(st);
    mt_state_destroy(want);
}
END_TEST

/* The writer's file: 8 + header length a multiple of 8, space padding, {"format": "pt"} metadata,
 * data as given; and the reader's view of it. */
START_TEST(test_writer_format)
{
    float a[6] = { 1, -2, 3.5f, 1e-3f, 0, -0.0f }, b[3] = { 7, 8, 9 };
    mt_st_source src[2] = { { "a", 2, { 2, 3 }, a }, { "b.c", 1, { 3 }, b } };
    char *dir = temp_dir();
    char path[4096], err[512] = "";
    snprintf(path, sizeof path, "%s/x.safetensors", dir);
    for (int k = 0; k < 2; k++) {
        mt_st_dtype dt = k ? MT_ST_BF16 : MT_ST_F32;
        ck_assert_msg(mt_st_write(path, src, 2, dt, err, sizeof err) == 0, "%s", err);
        FILE *f = fopen(path, "rb");
        uint64_t n;
        ck_assert(fread(&n, 8, 1, f) == 1);
        ck_assert_uint_eq((8 + n) % 8, 0);
        char *h = calloc(n + 1, 1);
        ck_assert(fread(h, 1, n, f) == n);
        fclose(f);
        json_t *o = json_loads(h, 0, NULL);
        ck_assert(o != NULL);
        ck_assert_str_eq(json_string_value(json_object_get(json_object_get(o, "__metadata__"), "format")), "pt");
        ck_assert_str_eq(json_string_value(json_object_get(json_object_get(o, "a"), "dtype")), k ? "BF16" : "F32");
        json_decref(o);
        free(h);
        mt_st_file *sf = mt_st_open(path, err, sizeof err);
        ck_assert_msg(sf != NULL, "%s", err);
        ck_assert_int_eq(sf->data_start % 8, 0);
        ck_assert_int_eq(sf->ntensors, 2);
        const mt_st_tensor *ta = mt_st_find(sf, "a"), *tb = mt_st_find(sf, "b.c");
        ck_assert(ta && tb && !mt_st_find(sf, "zz"));
        ck_assert_int_eq(ta->ndim, 2);
        ck_assert_int_eq(ta->shape[1], 3);
        float ra[6], rb[3];
        ck_assert(mt_st_read_f32(sf, ta, ra, err, sizeof err) == 0);
        ck_assert(mt_st_read_f32(sf, tb, rb, err, sizeof err) == 0);
        for (int i = 0; i < 6; i++) {
            float w = k ? mt_float_from_bf16(mt_bf16_from_float(a[i])) : a[i];
            ck_assert(memcmp(&ra[i], &w, 4) == 0);
        }
        ck_assert(rb[0] == 7 && rb[1] == 8 && rb[2] == 9);
        mt_st_close(sf);
    }
    /* A name given twice is refused. */
    mt_st_source dup[2] = { src[0], src[0] };
    ck_assert_int_eq(mt_st_write(path, dup, 2, MT_ST_F32, err, sizeof err), -1);
    ck_assert_ptr_nonnull(strstr(err, "'a'"));
    remove_dir(dir);
}
END_TEST

/* ---- bad files. The base: qwen2 (untied, biases) saved in fp32 as one file. ---- */

typedef struct bad_fixture {
    mt_host_state *src;   /* the saved state */
    mt_host_state *dst;   /* a state to load into */
    char *dir;
    char file[4096];      /* dir/model.safetensors */
} bad_fixture;

static bad_fixture bad_setup(int which, uint64_t max_shard)
{
    bad_fixture b;
    b.src = random_state(which, MT_DTYPE_F32, 99);
    b.dst = new_state(&b.src->cfg, MT_DTYPE_F32);
    b.dir = temp_dir();
    save_ok(b.dir, b.src, MT_DTYPE_F32, max_shard);
    snprintf(b.file, sizeof b.file, "%s/model.safetensors", b.dir);
    return b;
}

static void bad_teardown(bad_fixture *b)
{
    mt_state_destroy(b->src);
    mt_state_destroy(b->dst);
    remove_dir(b->dir);
}

/* Loading fails and the message holds each of the given strings (NULL: no check). MT_TEST_VERBOSE=1
 * prints every message, to review them. */
static void expect_error(bad_fixture *b, const char *what, const char *s1, const char *s2, const char *s3)
{
    char err[2048] = "";
    int rc = mt_hf_load(b->dir, b->dst, err, sizeof err);
    ck_assert_msg(rc == -1, "%s: load succeeded", what);
    if (getenv("MT_TEST_VERBOSE")) fprintf(stderr, "%-32s %s\n", what, err);
    const char *must[3] = { s1, s2, s3 };
    for (int i = 0; i < 3; i++)
        ck_assert_msg(!must[i] || strstr(err, must[i]), "%s: message lacks \"%s\": %s", what, must[i], err);
}

static void expect_ok(bad_fixture *b, const char *what)
{
    char err[2048] = "";
    ck_assert_msg(mt_hf_load(b->dir, b->dst, err, sizeof err) == 0, "%s: %s", what, err);
}

/* The file's bytes; *len set. */
static unsigned char *slurp(const char *path, size_t *len)
{
    char err[512];
    unsigned char *p = (unsigned char *)mt_read_file(path, len, err, sizeof err);
    ck_assert_msg(p != NULL, "%s", err);
    return p;
}

static void spit(const char *path, const void *p, size_t len)
{
    FILE *f = fopen(path, "wb");
    ck_assert(f != NULL);
    ck_assert(fwrite(p, 1, len, f) == len);
    ck_assert(fclose(f) == 0);
}

/* Rewrites the file's header through edit(root, data_size), keeping the data buffer. */
static void edit_header(const char *path, void (*edit)(json_t *root, uint64_t data_size))
{
    size_t len;
    unsigned char *p = slurp(path, &len);
    uint64_t n;
    memcpy(&n, p, 8);
    json_t *root = json_loadb((const char *)p + 8, n, 0, NULL);
    ck_assert(root != NULL);
    edit(root, len - 8 - n);
    char *h = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(root);
    uint64_t hn = strlen(h);
    FILE *f = fopen(path, "wb");
    ck_assert(fwrite(&hn, 8, 1, f) == 1);
    ck_assert(fwrite(h, 1, hn, f) == hn);
    ck_assert(fwrite(p + 8 + n, 1, len - 8 - n, f) == len - 8 - n);
    ck_assert(fclose(f) == 0);
    free(h);
    free(p);
}

static void set_offsets(json_t *root, const char *name, uint64_t b, uint64_t e)
{
    json_t *t = json_object_get(root, name);
    ck_assert_msg(t != NULL, "no %s", name);
    json_object_set_new(t, "data_offsets", json_pack("[I, I]", (json_int_t)b, (json_int_t)e));
}

static void edit_out_of_range(json_t *root, uint64_t ds)
{
    set_offsets(root, "model.norm.weight", ds, ds + 64 * 4);
}

static void edit_overlap(json_t *root, uint64_t ds)
{
    json_t *v = json_object_get(json_object_get(root, "model.layers.0.self_attn.v_proj.weight"), "data_offsets");
    json_object_set(json_object_get(root, "model.layers.0.self_attn.k_proj.weight"), "data_offsets", v);
}

static void edit_size(json_t *root, uint64_t ds)
{
    json_object_set_new(json_object_get(root, "model.layers.1.post_attention_layernorm.weight"), "shape", json_pack("[i]", 65));
}

static void edit_dtype_i32(json_t *root, uint64_t ds)
{
    json_object_set_new(json_object_get(root, "model.layers.1.input_layernorm.weight"), "dtype", json_string("I32"));
}

static void edit_dtype_i64(json_t *root, uint64_t ds)
{
    json_t *t = json_object_get(root, "model.layers.0.self_attn.q_proj.bias");
    json_object_set_new(t, "dtype", json_string("I64"));
    json_object_set_new(t, "shape", json_pack("[i]", 32)); /* same bytes as 64 F32 */
}

static void edit_dtype_unknown(json_t *root, uint64_t ds)
{
    json_object_set_new(json_object_get(root, "model.embed_tokens.weight"), "dtype", json_string("Q4_K"));
}

static void edit_shape(json_t *root, uint64_t ds)
{
    /* Same element count and bytes, not the config's (64, 64). */
    json_object_set_new(json_object_get(root, "model.layers.0.self_attn.o_proj.weight"), "shape", json_pack("[i, i]", 128, 32));
}

static void edit_offsets_type(json_t *root, uint64_t ds)
{
    json_object_set_new(json_object_get(root, "model.layers.0.mlp.up_proj.weight"), "data_offsets", json_pack("[i]", 0));
}

static void edit_reversed(json_t *root, uint64_t ds)
{
    set_offsets(root, "model.layers.1.mlp.gate_proj.weight", 100, 50);
}

START_TEST(test_bad_truncated)
{
    bad_fixture b = bad_setup(0, 0);
    size_t len;
    unsigned char *p = slurp(b.file, &len);
    ck_assert_int_eq(truncate(b.file, (off_t)len - 100), 0);
    /* The last tensor's range now runs past the end. */
    expect_error(&b, "truncated by 100 bytes", b.file, "tensor 'lm_head.weight'", "out of range");
    ck_assert_int_eq(truncate(b.file, 5), 0);
    expect_error(&b, "truncated to 5 bytes", b.file, "too short", NULL);
    ck_assert_int_eq(truncate(b.file, 0), 0);
    expect_error(&b, "empty", b.file, NULL, NULL);
    /* Cut inside the header. */
    spit(b.file, p, 40);
    expect_error(&b, "cut in the header", b.file, "header length", NULL);
    free(p);
    bad_teardown(&b);
}
END_TEST

START_TEST(test_bad_header_length)
{
    bad_fixture b = bad_setup(0, 0);
    size_t len;
    unsigned char *p = slurp(b.file, &len);
    uint64_t n, real;
    memcpy(&real, p, 8);
    n = len; /* beyond the file */
    memcpy(p, &n, 8);
    spit(b.file, p, len);
    expect_error(&b, "header length past the end", b.file, "exceeds the file", NULL);
    n = UINT64_MAX;
    memcpy(p, &n, 8);
    spit(b.file, p, len);
    expect_error(&b, "header length 2^64-1", b.file, "exceeds the file", NULL);
    n = 20; /* inside the JSON */
    memcpy(p, &n, 8);
    spit(b.file, p, len);
    expect_error(&b, "header length inside the JSON", b.file, "not valid JSON", NULL);
    n = real + 64; /* JSON followed by binary data */
    memcpy(p, &n, 8);
    spit(b.file, p, len);
    expect_error(&b, "header length into the data", b.file, "not valid JSON", NULL);
    n = 0;
    memcpy(p, &n, 8);
    spit(b.file, p, len);
    expect_error(&b, "header length 0", b.file, "header", NULL);
    free(p);
    bad_teardown(&b);
}
END_TEST

START_TEST(test_bad_offsets)
{
    bad_fixture b = bad_setup(0, 0);
    size_t len;
    unsigned char *orig = slurp(b.file, &len);
    edit_header(b.file, edit_out_of_range);
    expect_error(&b, "offsets out of range", b.file, "tensor 'model.norm.weight'", "out of range");
    spit(b.file, orig, len);
    edit_header(b.file, edit_overlap);
    expect_error(&b, "overlapping offsets", b.file, "self_attn.k_proj.weight", "overlap");
    spit(b.file, orig, len);
    edit_header(b.file, edit_offsets_type);
    expect_error(&b, "one offset", b.file, "tensor 'model.layers.0.mlp.up_proj.weight'", "data_offsets");
    spit(b.file, orig, len);
    edit_header(b.file, edit_reversed);
    expect_error(&b, "reversed offsets", b.file, "tensor 'model.layers.1.mlp.gate_proj.weight'", "ascending");
    /* Extra bytes after the last tensor (the buffer must be fully indexed). */
    unsigned char *more = malloc(len + 16);
    memcpy(more, orig, len);
    memset(more + len, 0, 16);
    spit(b.file, more, len + 16);
    expect_error(&b, "trailing bytes", b.file, "'lm_head.weight'", "after the last tensor");
    free(more);
    spit(b.file, orig, len);
    expect_ok(&b, "restored");
    assert_masters(b.src, b.dst, false);
    free(orig);
    bad_teardown(&b);
}
END_TEST

START_TEST(test_bad_dtype_and_shape)
{
    bad_fixture b = bad_setup(0, 0);
    size_t len;
    unsigned char *orig = slurp(b.file, &len);
    edit_header(b.file, edit_size);
    expect_error(&b, "size not matching the shape", b.file, "tensor 'model.layers.1.post_attention_layernorm.weight'", "bytes");
    spit(b.file, orig, len);
    edit_header(b.file, edit_dtype_i32);
    expect_error(&b, "I32 dtype", b.file, "tensor 'model.layers.1.input_layernorm.weight'", "I32");
    spit(b.file, orig, len);
    edit_header(b.file, edit_dtype_i64);
    expect_error(&b, "I64 dtype", b.file, "tensor 'model.layers.0.self_attn.q_proj.bias'", "I64");
    spit(b.file, orig, len);
    edit_header(b.file, edit_dtype_unknown);
    expect_error(&b, "unknown dtype", b.file, "tensor 'model.embed_tokens.weight'", "Q4_K");
    spit(b.file, orig, len);
    edit_header(b.file, edit_shape);
    expect_error(&b, "shape not the config's", b.file, "tensor 'model.layers.0.self_attn.o_proj.weight'", "[128, 32]");
    free(orig);
    bad_teardown(&b);
    /* A whole checkpoint of another config: the first tensor already disagrees. */
    b = bad_setup(3, 0); /* llama, d = 64, V = 333 */
    mt_model_config other = parse_config(0);
    mt_state_destroy(b.dst);
    b.dst = new_state(&other, MT_DTYPE_F32);
    expect_error(&b, "other config", b.file, "tensor 'model.embed_tokens.weight'", "[333, 64]");
    bad_teardown(&b);
}
END_TEST

/* The fixture's tensors as writer sources, in HF order; names live in the returned storage. */
typedef struct source_list { mt_st_source src[128]; char names[128][128]; int n; } source_list;

static void sources_of(const mt_host_state *st, source_list *l)
{
    l->n = 0;
    for (int i = 0; i < st->ntiles; i++) {
        const mt_tile *t = &st->tiles[i];
        for (int s = 0; s < t->layout->ntensors; s++) {
            const mt_tensor_desc *d = &t->layout->tensors[s];
            if (!d->numel) continue;
            mt_layout_full_name(t->layout, i - 1, s, l->names[l->n], sizeof l->names[l->n]);
            l->src[l->n] = (mt_st_source){ l->names[l->n], d->ndim, { d->shape[0], d->shape[1] }, t->master + d->offset };
            l->n++;
        }
    }
}

static void drop_source(source_list *l, const char *name)
{
    for (int i = 0; i < l->n; i++)
        if (!strcmp(l->src[i].name, name)) {
            memmove(&l->src[i], &l->src[i + 1], sizeof l->src[0] * (size_t)(l->n - i - 1));
            l->n--;
            return;
        }
    ck_abort_msg("no tensor %s", name);
}

static void write_sources(const char *path, const source_list *l)
{
    char err[512] = "";
    ck_assert_msg(mt_st_write(path, l->src, l->n, MT_ST_F32, err, sizeof err) == 0, "%s", err);
}

START_TEST(test_bad_missing_and_extra)
{
    static float extra[4] = { 1, 2, 3, 4 };
    bad_fixture b = bad_setup(0, 0);
    source_list *l = malloc(sizeof *l);
    sources_of(b.src, l);
    drop_source(l, "model.layers.1.mlp.up_proj.weight");
    write_sources(b.file, l);
    expect_error(&b, "missing tensor", b.file, "tensor 'model.layers.1.mlp.up_proj.weight'", "missing");
    sources_of(b.src, l);
    drop_source(l, "lm_head.weight");
    write_sources(b.file, l);
    expect_error(&b, "missing lm_head (untied)", b.file, "tensor 'lm_head.weight'", "missing");
    sources_of(b.src, l);
    l->src[l->n++] = (mt_st_source){ "model.layers.0.self_attn.extra.weight", 1, { 4 }, extra };
    write_sources(b.file, l);
    expect_error(&b, "extra tensor", b.file, "tensor 'model.layers.0.self_attn.extra.weight'", "unexpected");
    sources_of(b.src, l);
    l->src[l->n++] = (mt_st_source){ "model.layers.2.input_layernorm.weight", 1, { 64 }, b.src->tiles[1].master };
    write_sources(b.file, l);
    expect_error(&b, "layer beyond the config", b.file, "tensor 'model.layers.2.input_layernorm.weight'", "unexpected");
    /* Harmless extras: rotary buffers. */
    sources_of(b.src, l);
    l->src[l->n++] = (mt_st_source){ "model.layers.0.self_attn.rotary_emb.inv_freq", 1, { 4 }, extra };
    l->src[l->n++] = (mt_st_source){ "model.rotary_emb.inv_freq", 1, { 4 }, extra };
    write_sources(b.file, l);
    expect_ok(&b, "rotary buffers");
    assert_masters(b.src, b.dst, false);
    bad_teardown(&b);
    /* Tied: an lm_head.weight in the file is ignored; a missing embedding is still an error. */
    b = bad_setup(1, 0);
    sources_of(b.src, l);
    l->src[l->n++] = (mt_st_source){ "lm_head.weight", 2, { 300, 64 }, b.src->tiles[0].master };
    write_sources(b.file, l);
    expect_ok(&b, "tied with lm_head");
    assert_masters(b.src, b.dst, false);
    sources_of(b.src, l);
    drop_source(l, "model.embed_tokens.weight");
    write_sources(b.file, l);
    expect_error(&b, "tied without the embedding", b.file, "tensor 'model.embed_tokens.weight'", "missing");
    bad_teardown(&b);
    /* Qwen2 biases in a Llama checkpoint are extras. */
    b = bad_setup(3, 0);
    sources_of(b.src, l);
    l->src[l->n++] = (mt_st_source){ "model.layers.0.self_attn.q_proj.bias", 1, { 4 }, extra };
    write_sources(b.file, l);
    expect_error(&b, "bias in llama", b.file, "tensor 'model.layers.0.self_attn.q_proj.bias'", "unexpected");
    bad_teardown(&b);
    free(l);
}
END_TEST

static void write_index(const char *dir, json_t *ix)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    ck_assert(json_dump_file(ix, path, JSON_INDENT(1)) == 0);
}

START_TEST(test_bad_index)
{
    bad_fixture b = bad_setup(0, 30000);
    char index[4096], shard[4096];
    snprintf(index, sizeof index, "%s/model.safetensors.index.json", b.dir);
    int n = count_files(b.dir, ".safetensors");
    ck_assert_int_ge(n, 3);
    json_t *orig = read_index(b.dir);
    /* The first tensor of shard 2, to find in the message. */
    char name2[64], first2[160] = "";
    snprintf(name2, sizeof name2, "model-00002-of-%05d.safetensors", n);
    const char *key;
    json_t *v;
    json_object_foreach(json_object_get(orig, "weight_map"), key, v)
        if (!first2[0] && !strcmp(json_string_value(v), name2)) snprintf(first2, sizeof first2, "tensor '%s'", key);
    ck_assert(first2[0]);
    snprintf(shard, sizeof shard, "%s/%s", b.dir, name2);
    size_t len;
    unsigned char *bytes = slurp(shard, &len);

    unlink(shard);
    expect_error(&b, "missing shard", name2, first2, "model.safetensors.index.json");
    spit(shard, bytes, len / 2);
    expect_error(&b, "truncated shard", name2, "tensor '", "out of range");
    spit(shard, bytes, len);
    expect_ok(&b, "restored shards");
    assert_masters(b.src, b.dst, false);

    json_t *ix = json_deep_copy(orig);
    json_object_del(json_object_get(ix, "weight_map"), "model.layers.0.mlp.down_proj.weight");
    write_index(b.dir, ix);
    json_decref(ix);
    expect_error(&b, "tensor not in the weight_map", index, "tensor 'model.layers.0.mlp.down_proj.weight'", "weight_map");

    ix = json_deep_copy(orig);
    json_object_set_new(json_object_get(ix, "weight_map"), "model.layers.0.mlp.bogus.weight", json_string(name2));
    write_index(b.dir, ix);
    json_decref(ix);
    expect_error(&b, "unknown tensor in the weight_map", index, "tensor 'model.layers.0.mlp.bogus.weight'", "unexpected");

    ix = json_deep_copy(orig);
    json_object_set_new(json_object_get(ix, "weight_map"), "model.norm.weight", json_string("../elsewhere.safetensors"));
    write_index(b.dir, ix);
    json_decref(ix);
    expect_error(&b, "shard outside the directory", index, "tensor 'model.norm.weight'", NULL);

    /* The index sends a tensor to a shard that does not hold it. */
    ix = json_deep_copy(orig);
    char name1[64];
    snprintf(name1, sizeof name1, "model-00001-of-%05d.safetensors", n);
    json_object_set_new(json_object_get(ix, "weight_map"), "lm_head.weight", json_string(name1));
    write_index(b.dir, ix);
    json_decref(ix);
    expect_error(&b, "tensor in the wrong shard", "tensor 'lm_head.weight'", "index.json", NULL);

    ix = json_deep_copy(orig);
    json_object_del(ix, "weight_map");
    write_index(b.dir, ix);
    json_decref(ix);
    expect_error(&b, "no weight_map", index, "weight_map", NULL);

    spit(index, "{\"weight_map\": {", 16);
    expect_error(&b, "index not JSON", index, "JSON", NULL);

    unlink(index);
    expect_error(&b, "no checkpoint", b.dir, "model.safetensors", NULL);
    json_decref(orig);
    free(bytes);
    bad_teardown(&b);
}
END_TEST

/* Random corruption of the header bytes and the length field: every load returns 0 or -1 with a
 * message, never crashes; a corrupted file that still loads gives the original values only when
 * no data moved. */
START_TEST(test_bad_fuzz)
{
    bad_fixture b = bad_setup(2, 0);
    size_t len;
    unsigned char *orig = slurp(b.file, &len);
    uint64_t hn;
    memcpy(&hn, orig, 8);
    unsigned char *p = malloc(len);
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 1234);
    int failures = 0;
    for (int it = 0; it < 300; it++) {
        memcpy(p, orig, len);
        int flips = 1 + (int)(mt_test_uniform(&rng) * 4);
        for (int k = 0; k < flips; k++) {
            size_t at = (size_t)(mt_test_uniform(&rng) * (double)(8 + hn));
            p[at] = (unsigned char)(mt_test_uniform(&rng) * 256);
        }
        size_t cut = it % 5 == 0 ? (size_t)(mt_test_uniform(&rng) * (double)len) : len;
        spit(b.file, p, cut);
        char err[2048] = "";
        int rc = mt_hf_load(b.dir, b.dst, err, sizeof err);
        ck_assert(rc == 0 || rc == -1);
        if (rc) {
            failures++;
            ck_assert_msg(err[0] != 0, "iteration %d: empty message", it);
            ck_assert_msg(strstr(err, b.dir) != NULL, "iteration %d: message names no path: %s", it, err);
        }
    }
    ck_assert_int_gt(failures, 200);
    free(p);
    free(orig);
    bad_teardown(&b);
}
END_TEST

/* Writes text to dir/name. */
static void put_file(const char *dir, const char *name, const char *text)
{
    char p[4096];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    fclose(f);
}

/* Where a save may go: a new directory in one that takes files, an empty one, a previous
 * megatrain output (its marker written first, so even a save cut short counts); not a file, a
 * missing parent, a directory of other files or another tool's model. */
START_TEST(test_output_checks)
{
    char *d = temp_dir();
    char path[4096], err[1024];
    snprintf(path, sizeof path, "%s/new", d);
    ck_assert_msg(mt_hf_check_output(path, err, sizeof err) == 0, "%s", err);
    snprintf(path, sizeof path, "%s/missing/new", d);
    ck_assert_int_eq(mt_hf_check_output(path, err, sizeof err), -1);
    ck_assert_msg(strstr(err, path) && strstr(err, "cannot be created"), "%s", err);
    ck_assert_int_eq(mt_hf_check_output("/proc/megatrain-model", err, sizeof err), -1);
    put_file(d, "a-file", "x");
    snprintf(path, sizeof path, "%s/a-file", d);
    ck_assert_int_eq(mt_hf_check_output(path, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "an existing file, not a directory"), "%s", err);
    ck_assert_msg(mt_hf_check_output(d, err, sizeof err) == -1 && strstr(err, "a-file"), "%s", err);

    char *out = temp_dir();
    ck_assert_msg(mt_hf_check_output(out, err, sizeof err) == 0, "an empty directory: %s", err);
    mt_host_state *st = random_state(0, MT_DTYPE_F32, 5);
    save_ok(out, st, MT_DTYPE_F32, 0);
    ck_assert(exists(out, MT_HF_MARKER));
    put_file(out, "tokenizer.json", "{}");
    put_file(out, "model.safetensors.tmp.12345", "");
    ck_assert_msg(mt_hf_check_output(out, err, sizeof err) == 0, "a previous output: %s", err);
    put_file(out, "notes.txt", "mine");
    ck_assert_int_eq(mt_hf_check_output(out, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "notes.txt") && strstr(err, "megatrain does not write"), "%s", err);
    char p[4096];
    snprintf(p, sizeof p, "%s/notes.txt", out);
    unlink(p);
    snprintf(p, sizeof p, "%s/%s", out, MT_HF_MARKER);
    unlink(p);
    ck_assert_int_eq(mt_hf_check_output(out, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "a model megatrain did not write"), "%s", err);
    mt_state_destroy(st);
    remove_dir(out);
    remove_dir(d);
}
END_TEST

/* The tokenizer files present are copied byte for byte; none when the directory is the same. */
START_TEST(test_tokenizer_copy)
{
    char *from = temp_dir(), *to = temp_dir(), err[1024];
    put_file(from, "tokenizer.json", "{\"model\": {}}");
    put_file(from, "tokenizer_config.json", "{\"chat_template\": \"x\"}");
    put_file(from, "chat_template.jinja", "{{ messages }}");
    put_file(from, "README.md", "not a tokenizer file");
    int copied = -1;
    ck_assert_msg(mt_hf_copy_tokenizer(from, to, &copied, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(copied, 3);
    ck_assert(exists(to, "tokenizer.json") && exists(to, "tokenizer_config.json") && exists(to, "chat_template.jinja"));
    ck_assert(!exists(to, "README.md") && !exists(to, "special_tokens_map.json"));
    char cmd[9000];
    snprintf(cmd, sizeof cmd, "cmp -s '%s/chat_template.jinja' '%s/chat_template.jinja'", from, to);
    ck_assert_int_eq(system(cmd), 0);
    ck_assert_int_eq(mt_hf_copy_tokenizer(from, from, &copied, err, sizeof err), 0);
    ck_assert_int_eq(copied, 0);
    remove_dir(from);
    remove_dir(to);
}
END_TEST

/* The dtype of a directory's weights, single file or shards. */
START_TEST(test_weights_dtype)
{
    char *d = temp_dir(), err[1024];
    mt_host_state *st = random_state(1, MT_DTYPE_F32, 6);
    mt_st_dtype t;
    save_ok(d, st, MT_DTYPE_BF16, 0);
    ck_assert_msg(mt_hf_weights_dtype(d, &t, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(t, MT_ST_BF16);
    save_ok(d, st, MT_DTYPE_F32, 40000);
    ck_assert(exists(d, "model.safetensors.index.json"));
    ck_assert_msg(mt_hf_weights_dtype(d, &t, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(t, MT_ST_F32);
    mt_state_destroy(st);
    remove_dir(d);
}
END_TEST

static Suite *hf_suite(void)
{
    Suite *s = suite_create("hf");
    TCase *tc = tcase_create("roundtrip");
    tcase_add_checked_fixture(tc, runtime_up, runtime_down);
    tcase_add_test(tc, test_roundtrip_fp32);
    tcase_add_test(tc, test_roundtrip_bf16);
    tcase_add_test(tc, test_sharded);
    tcase_add_test(tc, test_f16_bf16_f32_by_hand);
    tcase_add_test(tc, test_writer_format);
    tcase_add_test(tc, test_output_checks);
    tcase_add_test(tc, test_tokenizer_copy);
    tcase_add_test(tc, test_weights_dtype);
    suite_add_tcase(s, tc);
    TCase *tb = tcase_create("bad files");
    tcase_add_checked_fixture(tb, runtime_up, runtime_down);
    tcase_add_test(tb, test_bad_truncated);
    tcase_add_test(tb, test_bad_header_length);
    tcase_add_test(tb, test_bad_offsets);
    tcase_add_test(tb, test_bad_dtype_and_shape);
    tcase_add_test(tb, test_bad_missing_and_extra);
    tcase_add_test(tb, test_bad_index);
    tcase_add_test(tb, test_bad_fuzz);
    suite_add_tcase(s, tb);
    return s;
}

int main(void)
{
    return mt_test_run(hf_suite(), false);
}
