/* HF checkpoints that must load: save/load round trips (fp32 bitwise, bf16 equal to the rounded
 * masters, one file and shards, re-saves that change the layout), F16/BF16/F32 files written by
 * hand, the writer's format, where a save may go, the tokenizer files copied alongside, and the
 * weights' dtype. */
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
    mt_test_raw_tensor t[64];
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
            t[n] = (mt_test_raw_tensor){ names[n], kind == 0 ? "F16" : kind == 1 ? "BF16" : "F32", d->ndim,
                                         { d->shape[0], d->shape[1] }, bufs[n], (size_t)d->numel * esz };
            n++;
        }
    }
    char *dir = temp_dir();
    char path[4096], err[1024] = "";
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    mt_test_write_raw_safetensors(path, t, n);
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
    mt_st_source src[2] = { { .name = "a", .ndim = 2, .shape = { 2, 3 }, .data = a }, { .name = "b.c", .ndim = 1, .shape = { 3 }, .data = b } };
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

/* A source read back chunk by chunk by the writer: here, from a plain array with an offset. */
static void read_from_array(const void *ctx, int64_t first, int64_t n, float *dst)
{
    memcpy(dst, (const float *)ctx + first, sizeof(float) * (size_t)n);
}

/* A source with a read function instead of data writes the same bytes as the data would, in
 * both dtypes, over several of the writer's chunks (2.5M elements, chunks of 1M). */
START_TEST(test_writer_read_sources)
{
    const int64_t n = 2500001;
    float *x = malloc(sizeof(float) * (size_t)n);
    mt_test_rng r;
    mt_test_rng_seed(&r, 5);
    for (int64_t i = 0; i < n; i++) x[i] = (float)(mt_test_uniform(&r) * 4 - 2);
    float small[3] = { 0.5f, -1.25f, 3 };
    mt_st_source plain[2] = { { .name = "big", .ndim = 1, .shape = { n }, .data = x },
                              { .name = "small", .ndim = 1, .shape = { 3 }, .data = small } };
    mt_st_source produced[2] = { { .name = "big", .ndim = 1, .shape = { n }, .read = read_from_array, .ctx = x },
                                 plain[1] };
    char *dir = temp_dir(), a[4096], b[4096], err[512], cmd[9000];
    snprintf(a, sizeof a, "%s/plain.safetensors", dir);
    snprintf(b, sizeof b, "%s/produced.safetensors", dir);
    for (int k = 0; k < 2; k++) {
        mt_st_dtype dt = k ? MT_ST_BF16 : MT_ST_F32;
        ck_assert_msg(mt_st_write(a, plain, 2, dt, err, sizeof err) == 0, "%s", err);
        ck_assert_msg(mt_st_write(b, produced, 2, dt, err, sizeof err) == 0, "%s", err);
        snprintf(cmd, sizeof cmd, "cmp -s '%s' '%s'", a, b);
        ck_assert_msg(system(cmd) == 0, "%s: the read source wrote other bytes than the data", mt_st_dtype_name(dt));
    }
    free(x);
    remove_dir(dir);
}
END_TEST

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

/* A save from a base model keeps the base config's keys megatrain does not model; its own keys
 * and the saved dtype win; the base's dtype keys and transformers_version are not taken. */
START_TEST(test_base_config_keys_kept)
{
    char *base = temp_dir(), *out = temp_dir(), err[1024], path[4200];
    mt_host_state *st = random_state(1, MT_DTYPE_F32, 6);
    save_ok(base, st, MT_DTYPE_BF16, 0);
    snprintf(path, sizeof path, "%s/config.json", base);
    json_t *o = json_load_file(path, 0, NULL);
    ck_assert(o);
    json_object_set_new(o, "bos_token_id", json_integer(151643));
    json_object_set_new(o, "eos_token_id", json_pack("[ii]", 151645, 151643));
    json_object_set_new(o, "sliding_window", json_integer(131072));
    json_object_set_new(o, "pad_token_id", json_integer(151643));
    json_object_set_new(o, "dtype", json_string("bfloat16"));
    json_object_set_new(o, "transformers_version", json_string("4.43.1"));
    json_object_set_new(o, "hidden_size", json_integer(12345)); /* megatrain's own key: its value wins */
    ck_assert_int_eq(json_dump_file(o, path, JSON_INDENT(2)), 0);
    json_decref(o);

    save_ok(out, st, MT_DTYPE_F32, 0);
    int kept = -1;
    ck_assert_msg(mt_hf_keep_base_config(base, out, &kept, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(kept, 4);
    snprintf(path, sizeof path, "%s/config.json", out);
    o = json_load_file(path, 0, NULL);
    ck_assert(o);
    ck_assert_int_eq(json_integer_value(json_object_get(o, "bos_token_id")), 151643);
    json_t *eos = json_object_get(o, "eos_token_id");
    ck_assert(json_is_array(eos) && json_array_size(eos) == 2);
    ck_assert_int_eq(json_integer_value(json_array_get(eos, 0)), 151645);
    ck_assert_int_eq(json_integer_value(json_object_get(o, "sliding_window")), 131072);
    ck_assert_int_eq(json_integer_value(json_object_get(o, "pad_token_id")), 151643);
    ck_assert_str_eq(json_string_value(json_object_get(o, "torch_dtype")), "float32");
    ck_assert(!json_object_get(o, "dtype") && !json_object_get(o, "transformers_version"));
    ck_assert_int_eq(json_integer_value(json_object_get(o, "hidden_size")), st->cfg.hidden);
    json_decref(o);
    /* the merged config loads as the same model */
    mt_model_config back;
    ck_assert_msg(mt_config_load(path, &back, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(back.hidden, st->cfg.hidden);
    ck_assert_int_eq(back.layers, st->cfg.layers);
    /* again: nothing left to add; the same directory: nothing at all */
    ck_assert_msg(mt_hf_keep_base_config(base, out, &kept, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(kept, 0);
    ck_assert_int_eq(mt_hf_keep_base_config(out, out, &kept, err, sizeof err), 0);
    ck_assert_int_eq(kept, 0);
    /* a base without a readable config.json is named */
    snprintf(path, sizeof path, "%s/config.json", base);
    unlink(path);
    ck_assert_int_eq(mt_hf_keep_base_config(base, out, &kept, err, sizeof err), -1);
    ck_assert_msg(strstr(err, path), "%s", err);
    mt_state_destroy(st);
    remove_dir(base);
    remove_dir(out);
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

static Suite *hf_roundtrip_suite(void)
{
    Suite *s = suite_create("hf_roundtrip");
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
    tcase_add_test(tc, test_base_config_keys_kept);
    tcase_add_test(tc, test_writer_read_sources);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return mt_test_run(hf_roundtrip_suite(), false);
}
