/* Host state tiles: alignment of every allocation, sizes against the layout, the AdamW chunk
 * partition (exact cover, one tensor per chunk, decay flag, size cap), and the random
 * initialisation (deterministic per seed, HF statistics, bf16 copy of the master). */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/config.h"
#include "backends/cpu/ops.h"
#include "models/layout.h"
#include "runtime/runtime.h"
#include "runtime/state.h"
#include "tests/testutil.h"

#define SMALL_CHUNK 1000

/* A Qwen3-like shape with sizes that are not multiples of the tile alignment: q/k norms,
 * no biases, untied head, H*D != d. */
static const char qwen3_odd_json[] =
    "{\"model_type\": \"qwen3\", \"hidden_size\": 100, \"intermediate_size\": 333,"
    " \"num_hidden_layers\": 3, \"num_attention_heads\": 5, \"num_key_value_heads\": 1,"
    " \"head_dim\": 22, \"vocab_size\": 259, \"max_position_embeddings\": 128,"
    " \"rope_theta\": 10000.0, \"rms_norm_eps\": 1e-6, \"tie_word_embeddings\": false}";

static void load_config(int which, mt_model_config *cfg)
{
    if (which == 0) {
        ck_assert_int_eq(mt_config_from_shape("tiny", cfg), 0);
    } else {
        char err[512] = "";
        ck_assert_msg(mt_config_parse(qwen3_odd_json, "qwen3-odd", cfg, err, sizeof err) == 0, "%s", err);
        ck_assert(cfg->qk_norm && !cfg->qkv_bias && !cfg->tied);
    }
}

static const char *config_name(int which) { return which == 0 ? "tiny" : "qwen3-odd"; }

/* StarPU is started in each forked test process and stopped at its end. */
static void runtime_up(void)
{
    mt_runtime_options ro = { .sched = "eager", .ncpu = 2, .ncuda = 0 };
    char err[512] = "";
    ck_assert_msg(mt_runtime_init(&ro, err, sizeof err) == 0, "mt_runtime_init: %s", err);
}

static void runtime_down(void) { mt_runtime_shutdown(); }

static mt_host_state *create_state(int which, mt_dtype dtype, int64_t chunk_numel)
{
    mt_model_config cfg;
    load_config(which, &cfg);
    char err[512] = "";
    mt_host_state *st = mt_state_create(&cfg, dtype, chunk_numel, err, sizeof err);
    ck_assert_msg(st != NULL, "mt_state_create(%s, %s): %s", config_name(which), mt_dtype_name(dtype), err);
    return st;
}

/* The end of tensor t's range: the offset of the next present tensor, or the tile's end. */
static int64_t tensor_range_end(const mt_tile_layout *lay, int t)
{
    for (int u = t + 1; u < lay->ntensors; u++)
        if (lay->tensors[u].numel > 0) return lay->tensors[u].offset;
    return lay->numel;
}

/* Index of the present tensor whose range holds element e, or -1. */
static int tensor_of(const mt_tile_layout *lay, int64_t e)
{
    for (int t = 0; t < lay->ntensors; t++) {
        const mt_tensor_desc *d = &lay->tensors[t];
        if (d->numel > 0 && e >= d->offset && e < tensor_range_end(lay, t)) return t;
    }
    return -1;
}

/* Index in [lo, hi) of the first element of x that is not v, or -1. (Check's assertions cost a
 * pipe write each, so per-element loops search first and assert once.) */
static int64_t first_not(const float *x, int64_t lo, int64_t hi, float v)
{
    for (int64_t e = lo; e < hi; e++)
        if (x[e] != v) return e;
    return -1;
}

/* ---- structure: alignment, sizes, chunks ------------------------------------------------- */

static void check_structure(int which, mt_dtype dtype, int64_t chunk_numel)
{
    mt_host_state *st = create_state(which, dtype, chunk_numel);
    const char *nm = config_name(which);
    ck_assert_int_eq(st->ntiles, (int)st->cfg.layers + 2);
    ck_assert_int_eq(st->compute_dtype, dtype);
    int64_t cap = chunk_numel > 0 ? chunk_numel : (int64_t)1 << 20;
    ck_assert_int_eq(st->chunk_numel, cap);

    for (int i = 0; i < st->ntiles; i++) {
        mt_tile *t = &st->tiles[i];
        const mt_tile_layout *want = i == 0 ? &st->layout_embed : i == st->ntiles - 1 ? &st->layout_head : &st->layout_layer;
        mt_tile_kind kind = i == 0 ? MT_TILE_EMBED : i == st->ntiles - 1 ? MT_TILE_HEAD : MT_TILE_LAYER;
        mt_tile_layout fresh;
        mt_layout_build(&st->cfg, kind, &fresh);
        ck_assert_int_eq(t->index, i);
        ck_assert_ptr_eq(t->layout, want);
        ck_assert_int_eq(t->layout->kind, kind);
        ck_assert_int_eq(t->numel, fresh.numel);
        ck_assert_int_eq(t->numel % MT_TILE_ALIGN, 0);
        ck_assert_int_eq(t->weight_bytes % 4096, 0);
        /* bf16 tiles with norms keep them in fp32 too, after their bf16 elements */
        size_t stream = (size_t)t->numel * mt_dtype_size(dtype);
        int64_t norms = 0;
        for (int k = 0; k < t->layout->ntensors; k++)
            if (mt_layout_is_norm(t->layout, k)) norms += (t->layout->tensors[k].numel + MT_TILE_ALIGN - 1) / MT_TILE_ALIGN * MT_TILE_ALIGN;
        if (dtype == MT_DTYPE_BF16 && norms) {
            ck_assert_int_ne(kind, MT_TILE_EMBED);
            ck_assert_int_eq(t->layout->f32_numel, norms);
            stream = (stream + 255) / 256 * 256 + (size_t)norms * sizeof(float);
        } else {
            ck_assert_int_eq(t->layout->f32_numel, 0);
        }
        ck_assert_uint_eq(mt_layout_stream_bytes(t->layout, mt_dtype_size(dtype)), stream);
        ck_assert_uint_ge(t->weight_bytes, stream);
        ck_assert_uint_lt(t->weight_bytes, stream + 4096);

        void *ptrs[] = { t->weights, t->master, t->grad, t->adam_m, t->adam_v };
        const char *kinds[] = { "weights", "master", "grad", "m", "v" };
        for (int k = 0; k < 5; k++) {
            ck_assert_msg(ptrs[k] != NULL, "%s tile %d: %s is NULL", nm, i, kinds[k]);
            ck_assert_msg((uintptr_t)ptrs[k] % 4096 == 0, "%s %s tile %d: %s at %p is not 4096-aligned", nm,
                          mt_dtype_name(dtype), i, kinds[k], ptrs[k]);
        }
        /* Gradients and moments start at zero. */
        int64_t nonzero = first_not(t->grad, 0, t->numel, 0.0f);
        if (nonzero < 0) nonzero = first_not(t->adam_m, 0, t->numel, 0.0f);
        if (nonzero < 0) nonzero = first_not(t->adam_v, 0, t->numel, 0.0f);
        ck_assert_msg(nonzero < 0, "%s tile %d: gradient or moment not zero at %lld", nm, i, (long long)nonzero);

        /* The chunks tile [0, numel) in order; each stays inside one tensor's range. */
        ck_assert_int_gt(t->nchunks, 0);
        ck_assert_ptr_nonnull(t->chunks);
        int64_t at = 0;
        int prev_tensor = -1;
        for (int c = 0; c < t->nchunks; c++) {
            const mt_chunk *ch = &t->chunks[c];
            ck_assert_msg(ch->offset == at, "%s tile %d chunk %d: offset %lld, expected %lld (gap or overlap)", nm, i, c,
                          (long long)ch->offset, (long long)at);
            ck_assert_msg(ch->numel > 0, "%s tile %d chunk %d: empty", nm, i, c);
            ck_assert_msg(ch->numel <= cap, "%s tile %d chunk %d: %lld elements > chunk_numel %lld", nm, i, c,
                          (long long)ch->numel, (long long)cap);
            int tt = tensor_of(t->layout, ch->offset);
            ck_assert_msg(tt >= 0, "%s tile %d chunk %d: offset %lld in no tensor", nm, i, c, (long long)ch->offset);
            int64_t lo = t->layout->tensors[tt].offset, hi = tensor_range_end(t->layout, tt);
            ck_assert_msg(ch->offset >= lo && ch->offset + ch->numel <= hi,
                          "%s tile %d chunk %d [%lld, %lld) crosses tensor %s [%lld, %lld)", nm, i, c,
                          (long long)ch->offset, (long long)(ch->offset + ch->numel), t->layout->tensors[tt].name,
                          (long long)lo, (long long)hi);
            ck_assert_msg(ch->decay == t->layout->tensors[tt].decay, "%s tile %d chunk %d (%s): decay %d, tensor says %d",
                          nm, i, c, t->layout->tensors[tt].name, ch->decay, t->layout->tensors[tt].decay);
            ck_assert_int_ge(tt, prev_tensor);
            prev_tensor = tt;
            at += ch->numel;
        }
        ck_assert_msg(at == t->numel, "%s tile %d: chunks cover %lld of %lld elements", nm, i, (long long)at,
                      (long long)t->numel);
        /* Every present tensor starts a chunk (its first element is covered by a chunk that starts there). */
        for (int k = 0; k < t->layout->ntensors; k++) {
            const mt_tensor_desc *d = &t->layout->tensors[k];
            if (d->numel == 0) continue;
            int found = 0;
            for (int c = 0; c < t->nchunks; c++) found |= t->chunks[c].offset == d->offset;
            ck_assert_msg(found, "%s tile %d: no chunk starts at tensor %s (%lld)", nm, i, d->name, (long long)d->offset);
        }
        ck_assert_ptr_nonnull(t->h_weights);
        ck_assert_ptr_nonnull(t->h_grad);
        for (int c = 0; c < t->nchunks; c++) {
            ck_assert_ptr_nonnull(t->h_master_chunk[c]);
            ck_assert_ptr_nonnull(t->h_m_chunk[c]);
            ck_assert_ptr_nonnull(t->h_v_chunk[c]);
            ck_assert_ptr_nonnull(t->h_weights_chunk[c]);
            ck_assert_ptr_nonnull(t->h_grad_chunk[c]);
            /* a chunk's streamed copy: its elements in the compute dtype, or a norm's in the fp32 side */
            const mt_chunk *ch = &t->chunks[c];
            const mt_tensor_desc *d = &t->layout->tensors[tensor_of(t->layout, ch->offset)];
            const size_t esz = d->f32_at ? sizeof(float) : mt_dtype_size(dtype);
            const char *want_at = d->f32_at ? (const char *)t->weights + (d->f32_at + ch->offset - d->offset) * 4
                                            : (const char *)t->weights + ch->offset * mt_dtype_size(dtype);
            ck_assert_uint_eq(starpu_vector_get_elemsize(t->h_weights_chunk[c]), esz);
            ck_assert_uint_eq(starpu_vector_get_nx(t->h_weights_chunk[c]), (unsigned)ch->numel);
            ck_assert_ptr_eq((const void *)starpu_vector_get_local_ptr(t->h_weights_chunk[c]), want_at);
            ck_assert_msg(!d->f32_at || (const char *)want_at + ch->numel * 4 <= (const char *)t->weights + t->weight_bytes,
                          "%s tile %d chunk %d: side past the allocation", nm, i, c);
        }
    }
    /* With a small cap, a big tensor must be split: the embedding table (V*d) is > 1000. */
    if (chunk_numel > 0 && chunk_numel < st->tiles[0].numel) ck_assert_int_gt(st->tiles[0].nchunks, 1);
    mt_state_destroy(st);
}

START_TEST(test_structure_tiny_fp32) { check_structure(0, MT_DTYPE_F32, SMALL_CHUNK); }
END_TEST
START_TEST(test_structure_tiny_bf16) { check_structure(0, MT_DTYPE_BF16, SMALL_CHUNK); }
END_TEST
START_TEST(test_structure_qwen3_fp32) { check_structure(1, MT_DTYPE_F32, SMALL_CHUNK); }
END_TEST
START_TEST(test_structure_qwen3_bf16) { check_structure(1, MT_DTYPE_BF16, SMALL_CHUNK); }
END_TEST
/* The default cap (1 << 20 elements): one chunk per tensor for these small shapes. */
START_TEST(test_structure_default_chunk)
{
    check_structure(0, MT_DTYPE_BF16, 0);
    check_structure(1, MT_DTYPE_F32, 0);
    mt_host_state *st = create_state(1, MT_DTYPE_F32, 0);
    int present = 0;
    for (int k = 0; k < st->layout_layer.ntensors; k++) present += st->layout_layer.tensors[k].numel > 0;
    ck_assert_int_eq(mt_state_layer(st, 0)->nchunks, present);
    mt_state_destroy(st);
}
END_TEST

/* ---- initialisation --------------------------------------------------------------------- */

/* Checks norms 1, biases 0, padding 0 and matrix statistics of every tile's master. */
static void check_init_stats(const mt_host_state *st, double std, const char *nm)
{
    for (int i = 0; i < st->ntiles; i++) {
        const mt_tile *t = &st->tiles[i];
        const mt_tile_layout *lay = t->layout;
        for (int k = 0; k < lay->ntensors; k++) {
            const mt_tensor_desc *d = &lay->tensors[k];
            if (d->numel == 0) continue;
            const float *p = t->master + d->offset;
            int64_t end = tensor_range_end(lay, k);
            int64_t bad = first_not(t->master, d->offset + d->numel, end, 0.0f);
            ck_assert_msg(bad < 0, "%s tile %d %s: padding element %lld is %g", nm, i, d->name, (long long)bad,
                          bad < 0 ? 0.0 : t->master[bad]);
            if (d->ndim == 2) {
                double s = 0, s2 = 0;
                for (int64_t e = 0; e < d->numel; e++) { s += p[e]; s2 += (double)p[e] * p[e]; }
                double mean = s / d->numel, sd = sqrt(s2 / d->numel - mean * mean);
                ck_assert_msg(fabs(sd - std) <= 0.10 * std, "%s tile %d %s: std %g, expected %g within 10%%", nm, i,
                              d->name, sd, std);
                /* Mean within 5 standard errors of 0. */
                ck_assert_msg(fabs(mean) <= 5 * std / sqrt((double)d->numel), "%s tile %d %s: mean %g", nm, i, d->name, mean);
            } else if (strstr(d->name, "norm")) {
                int64_t e = first_not(p, 0, d->numel, 1.0f);
                ck_assert_msg(e < 0, "%s tile %d %s[%lld] = %g, expected 1", nm, i, d->name, (long long)e, e < 0 ? 1.0 : p[e]);
            } else {
                ck_assert_msg(strstr(d->name, "bias") != NULL, "%s: unexpected 1-D tensor %s", nm, d->name);
                int64_t e = first_not(p, 0, d->numel, 0.0f);
                ck_assert_msg(e < 0, "%s tile %d %s[%lld] = %g, expected 0", nm, i, d->name, (long long)e, e < 0 ? 0.0 : p[e]);
            }
        }
    }
}

/* The streamed copy is the master converted to the compute dtype, element by element. */
static void check_streamed_copy(const mt_host_state *st, const char *nm)
{
    for (int i = 0; i < st->ntiles; i++) {
        const mt_tile *t = &st->tiles[i];
        if (st->compute_dtype == MT_DTYPE_BF16) {
            const mt_bf16 *w = t->weights;
            int64_t e = 0;
            while (e < t->numel && w[e] == mt_bf16_from_float(t->master[e])) e++;
            ck_assert_msg(e == t->numel, "%s tile %d: bf16[%lld] = 0x%04x, master %g -> 0x%04x", nm, i, (long long)e,
                          w[e], t->master[e], mt_bf16_from_float(t->master[e]));
            /* the norms' fp32 side: the master's values exactly */
            for (int k = 0; k < t->layout->ntensors; k++) {
                const mt_tensor_desc *d = &t->layout->tensors[k];
                ck_assert_int_eq(d->f32_at != 0, mt_layout_is_norm(t->layout, k));
                if (d->f32_at)
                    ck_assert_msg(memcmp((const float *)t->weights + d->f32_at, t->master + d->offset,
                                         (size_t)d->numel * sizeof(float)) == 0,
                                  "%s tile %d: %s's fp32 side differs from the master", nm, i, d->name);
            }
        } else {
            ck_assert_msg(memcmp(t->weights, t->master, (size_t)t->numel * sizeof(float)) == 0,
                          "%s tile %d: fp32 streamed copy differs from master", nm, i);
        }
    }
}

/* Copies every tile's master into one buffer (to compare two initialisations). */
static float *snapshot_master(const mt_host_state *st, int64_t *total)
{
    int64_t n = 0;
    for (int i = 0; i < st->ntiles; i++) n += st->tiles[i].numel;
    float *all = malloc(sizeof *all * n);
    int64_t at = 0;
    for (int i = 0; i < st->ntiles; i++) {
        memcpy(all + at, st->tiles[i].master, sizeof(float) * st->tiles[i].numel);
        at += st->tiles[i].numel;
    }
    *total = n;
    return all;
}

static void check_init(int which, mt_dtype dtype)
{
    const char *nm = config_name(which);
    mt_host_state *a = create_state(which, dtype, SMALL_CHUNK);
    mt_host_state *b = create_state(which, dtype, 0);
    const double std = 0.02;

    mt_state_init_random(a, 42, std);
    mt_state_init_random(b, 42, std);
    int64_t na, nb;
    float *sa = snapshot_master(a, &na);
    float *sb = snapshot_master(b, &nb);
    ck_assert_int_eq(na, nb);
    ck_assert_msg(memcmp(sa, sb, sizeof(float) * na) == 0, "%s: same seed gave different weights", nm);
    check_init_stats(a, std, nm);
    check_streamed_copy(a, nm);

    /* A different seed: different matrices, same norms. */
    mt_state_init_random(b, 43, std);
    free(sb);
    sb = snapshot_master(b, &nb);
    int64_t differ = 0;
    for (int64_t e = 0; e < na; e++) differ += sa[e] != sb[e];
    ck_assert_msg(differ > na / 2, "%s: seeds 42 and 43 differ in only %lld of %lld elements", nm, (long long)differ,
                  (long long)na);
    /* Layers differ from each other too: a seed per tile, not one stream repeated. */
    for (int i = 2; i < a->ntiles - 1; i++) {
        const mt_tensor_desc *q = &a->layout_layer.tensors[MT_L_Q_W];
        ck_assert_msg(memcmp(a->tiles[i].master + q->offset, a->tiles[i - 1].master + q->offset,
                             sizeof(float) * q->numel) != 0, "%s: layers %d and %d have identical q_proj", nm, i - 2, i - 1);
    }
    check_init_stats(b, std, nm);
    check_streamed_copy(b, nm);

    /* Another std is honoured. */
    mt_state_init_random(b, 7, 0.05);
    check_init_stats(b, 0.05, nm);
    check_streamed_copy(b, nm);

    /* sync_weights after editing the master refreshes the streamed copy. */
    for (int i = 0; i < b->ntiles; i++) b->tiles[i].master[0] = 0.123456789f + (float)i;
    mt_state_sync_weights(b);
    check_streamed_copy(b, nm);
    /* so does writing a range of it (crossing a norm: a layer's first tensor) */
    float vals[3] = { 1.0f / 3.0f, 2.0f / 3.0f, 0.1f };
    mt_tile *l0 = &b->tiles[1];
    mt_state_write_master(b, 1, l0->layout->tensors[0].numel - 2, 3, vals);
    check_streamed_copy(b, nm);

    free(sa);
    free(sb);
    mt_state_destroy(a);
    mt_state_destroy(b);
}

START_TEST(test_init_tiny_fp32) { check_init(0, MT_DTYPE_F32); }
END_TEST
START_TEST(test_init_tiny_bf16) { check_init(0, MT_DTYPE_BF16); }
END_TEST
START_TEST(test_init_qwen3_fp32) { check_init(1, MT_DTYPE_F32); }
END_TEST
START_TEST(test_init_qwen3_bf16) { check_init(1, MT_DTYPE_BF16); }
END_TEST

/* ---- runtime start-up ------------------------------------------------------------------- */

START_TEST(test_runtime_unknown_policy)
{
    mt_runtime_options ro = { .sched = "no-such-policy", .ncpu = 2, .ncuda = 0 };
    char err[512] = "";
    ck_assert_int_eq(mt_runtime_init(&ro, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "no-such-policy") != NULL, "message does not name the policy: '%s'", err);
    ck_assert_msg(strstr(err, "eager") != NULL, "message does not list the known policies: '%s'", err);
    /* A rejected start leaves nothing running: a correct start afterwards works. */
    ro.sched = "eager";
    ck_assert_msg(mt_runtime_init(&ro, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(mt_runtime_ncpu(), 2);
    ck_assert_int_eq(mt_runtime_ncuda(), 0);
    mt_runtime_shutdown();
}
END_TEST

START_TEST(test_runtime_workers)
{
    ck_assert_int_eq(mt_runtime_ncpu(), 2);
    ck_assert_int_eq(mt_runtime_ncuda(), 0);
    ck_assert_str_eq(mt_default_sched(), "megatrain");
    mt_runtime_options d = mt_runtime_defaults();
    ck_assert_ptr_null(d.sched);
    ck_assert_int_eq(d.ncpu, -1);
    ck_assert_int_eq(d.ncuda, -1);
}
END_TEST

START_TEST(test_dtype_names)
{
    mt_dtype t;
    ck_assert_int_eq(mt_dtype_parse("bf16", &t), 0);
    ck_assert_int_eq(t, MT_DTYPE_BF16);
    ck_assert_int_eq(mt_dtype_parse("float32", &t), 0);
    ck_assert_int_eq(t, MT_DTYPE_F32);
    ck_assert_int_eq(mt_dtype_parse("fp16", &t), -1);
    ck_assert_uint_eq(mt_dtype_size(MT_DTYPE_BF16), 2);
    ck_assert_uint_eq(mt_dtype_size(MT_DTYPE_F32), 4);
    ck_assert_str_eq(mt_dtype_name(MT_DTYPE_BF16), "bf16");
}
END_TEST

static Suite *tiles_suite(void)
{
    Suite *s = suite_create("tiles");
    TCase *tc = tcase_create("state");
    tcase_add_checked_fixture(tc, runtime_up, runtime_down);
    tcase_add_test(tc, test_structure_tiny_fp32);
    tcase_add_test(tc, test_structure_tiny_bf16);
    tcase_add_test(tc, test_structure_qwen3_fp32);
    tcase_add_test(tc, test_structure_qwen3_bf16);
    tcase_add_test(tc, test_structure_default_chunk);
    tcase_add_test(tc, test_init_tiny_fp32);
    tcase_add_test(tc, test_init_tiny_bf16);
    tcase_add_test(tc, test_init_qwen3_fp32);
    tcase_add_test(tc, test_init_qwen3_bf16);
    tcase_add_test(tc, test_runtime_workers);
    suite_add_tcase(s, tc);
    TCase *tr = tcase_create("runtime");
    tcase_add_test(tr, test_runtime_unknown_policy);
    tcase_add_test(tr, test_dtype_names);
    suite_add_tcase(s, tr);
    return s;
}

int main(void)
{
    return mt_test_run(tiles_suite(), false);
}
