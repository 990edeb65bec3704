/* HF checkpoints that must be refused: every class of bad file (truncated, bad header length,
 * offsets, dtypes and shapes, missing and extra tensors, bad index files, random damage), whose
 * message must name the file and the tensor. */
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

#include "backends/cpu/ops.h"
#include "models/config.h"
#include "models/layout.h"
#include "models/safetensors.h"
#include "models/util.h"
#include "runtime/hf.h"
#include "runtime/state.h"
#include "tests/hf_util.h"
#include "tests/testutil.h"

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
            l->src[l->n] = (mt_st_source){ .name = l->names[l->n], .ndim = d->ndim, .shape = { d->shape[0], d->shape[1] }, .data = t->master + d->offset };
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
    l->src[l->n++] = (mt_st_source){ .name = "model.layers.0.self_attn.extra.weight", .ndim = 1, .shape = { 4 }, .data = extra };
    write_sources(b.file, l);
    expect_error(&b, "extra tensor", b.file, "tensor 'model.layers.0.self_attn.extra.weight'", "unexpected");
    sources_of(b.src, l);
    l->src[l->n++] = (mt_st_source){ .name = "model.layers.2.input_layernorm.weight", .ndim = 1, .shape = { 64 }, .data = b.src->tiles[1].master };
    write_sources(b.file, l);
    expect_error(&b, "layer beyond the config", b.file, "tensor 'model.layers.2.input_layernorm.weight'", "unexpected");
    /* Harmless extras: rotary buffers. */
    sources_of(b.src, l);
    l->src[l->n++] = (mt_st_source){ .name = "model.layers.0.self_attn.rotary_emb.inv_freq", .ndim = 1, .shape = { 4 }, .data = extra };
    l->src[l->n++] = (mt_st_source){ .name = "model.rotary_emb.inv_freq", .ndim = 1, .shape = { 4 }, .data = extra };
    write_sources(b.file, l);
    expect_ok(&b, "rotary buffers");
    assert_masters(b.src, b.dst, false);
    bad_teardown(&b);
    /* Tied: an lm_head.weight in the file is ignored; a missing embedding is still an error. */
    b = bad_setup(1, 0);
    sources_of(b.src, l);
    l->src[l->n++] = (mt_st_source){ .name = "lm_head.weight", .ndim = 2, .shape = { 300, 64 }, .data = b.src->tiles[0].master };
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
    l->src[l->n++] = (mt_st_source){ .name = "model.layers.0.self_attn.q_proj.bias", .ndim = 1, .shape = { 4 }, .data = extra };
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

    /* A missing shard whose own name holds "tensor '" (shard 2's tensors sent to it): the message
     * still says which tensor and which index named it (a file name is no reader's message about
     * a tensor). */
    ix = json_deep_copy(orig);
    json_object_foreach(json_object_get(ix, "weight_map"), key, v)
        if (!strcmp(json_string_value(v), name2)) json_string_set(v, "model-00009-of-00tensor 'x.safetensors");
    write_index(b.dir, ix);
    json_decref(ix);
    char named[200];
    snprintf(named, sizeof named, "(shard of %s in", first2);
    expect_error(&b, "missing shard named with tensor '", "00tensor 'x.safetensors", named, "model.safetensors.index.json)");

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
static Suite *hf_bad_files_suite(void)
{
    Suite *s = suite_create("hf_bad_files");
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
    return mt_test_run(hf_bad_files_suite(), false);
}
