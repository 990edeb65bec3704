/* Check suite of gpt_oss's HF files (docs/moe.md): the experts fused as transformers holds them
 * (gate_up_proj (E, d, 2 Ie) with gate and up interleaved, down_proj (E, Ie, d)) saved and read
 * back, element by element against the state's per-expert slots; published checkpoints' MXFP4
 * experts (NAME_blocks, NAME_scales) decoded on load, in one file and across shards, against a
 * decoding written here from the format's definition; and the files refused with their names. */
#include <check.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "models/config.h"
#include "models/layout.h"
#include "models/mxfp4.h"
#include "models/safetensors.h"
#include "models/util.h"
#include "runtime/hf.h"
#include "runtime/state.h"
#include "tests/moe_util.h"
#include "tests/testutil.h"

/* Experts of 64 wide (two MXFP4 groups a row) over a hidden size of 32 (one group). */
#define GPT_OSS_HF_BASE                                                                                 \
    "{\"model_type\": \"gpt_oss\", \"hidden_size\": 32, \"intermediate_size\": 64, \"num_hidden_layers\": 2," \
    " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 8, \"vocab_size\": 29,"    \
    " \"num_local_experts\": 3, \"num_experts_per_tok\": 2, \"sliding_window\": 4"

static float slot_value(const mt_host_state *st, int layer, int expert, int which, int64_t i)
{
    const mt_tile *t = &st->tiles[layer + 1];
    return t->master[t->layout->tensors[mt_layout_expert_slot(expert, which)].offset + i];
}

/* The saved file holds the fused tensors, each element where transformers reads it, and no
 * per-expert names; loaded again, the state is the same bit for bit. */
START_TEST(test_fused_roundtrip)
{
    const mt_model_config cfg = moe_config(GPT_OSS_HF_BASE, "");
    const int64_t E = cfg.experts, d = cfg.hidden, Ie = cfg.expert_intermediate;
    char err[1024] = "";
    mt_host_state *a = mt_state_create(&cfg, MT_DTYPE_F32, 0, err, sizeof err);
    ck_assert_msg(a != NULL, "%s", err);
    mt_state_init_random(a, 31, 1.0);
    char dir[] = "/tmp/mt-gpt-oss-hf.XXXXXX";
    ck_assert(mkdtemp(dir) != NULL);
    ck_assert_msg(mt_hf_save(dir, a, MT_DTYPE_F32, 0, err, sizeof err) == 0, "%s", err);

    char path[4200];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    mt_st_file *f = mt_st_open(path, err, sizeof err);
    ck_assert_msg(f != NULL, "%s", err);
    for (int l = 0; l < cfg.layers; l++) {
        char name[128];
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.gate_up_proj", l);
        const mt_st_tensor *gu = mt_st_find(f, name);
        ck_assert_msg(gu && gu->ndim == 3 && gu->shape[0] == E && gu->shape[1] == d && gu->shape[2] == 2 * Ie, "%s",
                      name);
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.down_proj", l);
        const mt_st_tensor *dn = mt_st_find(f, name);
        ck_assert_msg(dn && dn->ndim == 3 && dn->shape[0] == E && dn->shape[1] == Ie && dn->shape[2] == d, "%s", name);
        float *g = mt_xmalloc(sizeof(float) * (size_t)gu->numel), *w = mt_xmalloc(sizeof(float) * (size_t)dn->numel);
        ck_assert(mt_st_read_f32(f, gu, g, err, sizeof err) == 0 && mt_st_read_f32(f, dn, w, err, sizeof err) == 0);
        for (int e = 0; e < E; e++)
            for (int64_t i = 0; i < d; i++)
                for (int64_t j = 0; j < Ie; j++) {
                    /* x @ gate_up_proj[e]: column 2j the gate's row j, 2j + 1 the up's */
                    ck_assert(g[(e * d + i) * 2 * Ie + 2 * j] == slot_value(a, l, e, MT_X_GATE, j * d + i));
                    ck_assert(g[(e * d + i) * 2 * Ie + 2 * j + 1] == slot_value(a, l, e, MT_X_UP, j * d + i));
                    /* gated @ down_proj[e]: row j, column i is the down's row i, column j */
                    ck_assert(w[(e * Ie + j) * d + i] == slot_value(a, l, e, MT_X_DOWN, i * Ie + j));
                }
        free(g);
        free(w);
        const char *present[] = { "mlp.router.weight", "mlp.router.bias", "mlp.experts.gate_up_proj_bias",
                                  "mlp.experts.down_proj_bias", "self_attn.sinks", "self_attn.o_proj.bias" };
        for (size_t k = 0; k < sizeof present / sizeof present[0]; k++) {
            snprintf(name, sizeof name, "model.layers.%d.%s", l, present[k]);
            ck_assert_msg(mt_st_find(f, name) != NULL, "no %s", name);
        }
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.0.gate_proj.weight", l);
        ck_assert_msg(mt_st_find(f, name) == NULL, "holds per-expert %s", name);
    }
    /* per layer: norm x2, q k v o weights and biases, sinks, router x2, fused x2, biases x2 */
    ck_assert_int_eq(f->ntensors, 1 + cfg.layers * 17 + 2);
    mt_st_close(f);

    mt_model_config back;
    ck_assert_msg(mt_config_load(dir, &back, err, sizeof err) == 0, "%s", err);
    assert_same_config(&cfg, &back);
    mt_host_state *b = mt_state_create(&back, MT_DTYPE_F32, 0, err, sizeof err);
    ck_assert_msg(b != NULL, "%s", err);
    ck_assert_msg(mt_hf_load(dir, b, err, sizeof err) == 0, "%s", err);
    for (int i = 0; i < a->ntiles; i++)
        ck_assert(memcmp(a->tiles[i].master, b->tiles[i].master, sizeof(float) * (size_t)a->tiles[i].numel) == 0);
    mt_state_destroy(a);
    mt_state_destroy(b);
    mt_test_remove_dir(dir);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* Published checkpoints: written here as raw safetensors, the experts in MXFP4.                */

/* E2M1 from its definition: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; exponent 0
 * subnormal (0 or 0.5). */
static double e2m1(unsigned code)
{
    const unsigned ex = (code >> 1) & 3u, m = code & 1u;
    const double v = ex == 0 ? 0.5 * m : ldexp(1.0 + 0.5 * m, (int)ex - 1);
    return code & 8u ? -v : v;
}

/* A published-style checkpoint of cfg: every tensor but the experts' matrices random in F32,
 * those in MXFP4 with random codes and scales 2^-4 .. 2^3, each tensor's bytes kept in t (its
 * name in names). shards: 1 (one file) or 2 (the blocks of each layer in one shard, their scales
 * in the other, with an index). */
typedef struct published {
    int n;
    mt_test_raw_tensor t[64];
    char names[64][128];
} published;

static void make_published(const mt_model_config *cfg, mt_host_state *st, const char *dir, int shards, uint64_t seed,
                           published *p)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, seed);
    p->n = 0;
    const int64_t E = cfg->experts, d = cfg->hidden, Ie = cfg->expert_intermediate;
    for (int i = 0; i < st->ntiles; i++) {
        const mt_tile_layout *lay = st->tiles[i].layout;
        const bool sparse = mt_layout_is_sparse(lay);
        const int nslots = sparse ? mt_layout_expert_slot(0, 0) : lay->ntensors;
        for (int s = 0; s < nslots; s++) {
            const mt_tensor_desc *td = &lay->tensors[s];
            if (!td->numel) continue;
            char *name = p->names[p->n];
            mt_test_raw_tensor *r = &p->t[p->n++];
            mt_layout_full_name(lay, i - 1, s, name, sizeof p->names[0]);
            r->name = name;
            r->dtype = "F32";
            r->ndim = td->ndim;
            r->shape[0] = td->shape[0];
            r->shape[1] = td->shape[1];
            r->bytes = sizeof(float) * (size_t)td->numel;
            float *v = mt_xmalloc(r->bytes);
            for (int64_t k = 0; k < td->numel; k++) v[k] = (float)(mt_test_uniform(&rng) - 0.5);
            r->data = v;
        }
        if (!sparse) continue;
        for (int kind = 0; kind < 2; kind++) { /* gate_up: rows 2 Ie of d; down: rows d of Ie */
            const int64_t R = kind ? d : 2 * Ie, C = kind ? Ie : d, G = C / MT_MXFP4_GROUP;
            char *bname = p->names[p->n], *sname = p->names[p->n + 1];
            mt_test_raw_tensor *b = &p->t[p->n++], *sc = &p->t[p->n++];
            snprintf(bname, sizeof p->names[0], "model.layers.%d.mlp.experts.%s_blocks", i - 1,
                     kind ? "down_proj" : "gate_up_proj");
            snprintf(sname, sizeof p->names[0], "model.layers.%d.mlp.experts.%s_scales", i - 1,
                     kind ? "down_proj" : "gate_up_proj");
            b->name = bname;
            sc->name = sname;
            b->dtype = sc->dtype = "U8";
            b->ndim = 4;
            sc->ndim = 3;
            b->shape[0] = sc->shape[0] = E;
            b->shape[1] = sc->shape[1] = R;
            b->shape[2] = sc->shape[2] = G;
            b->shape[3] = MT_MXFP4_GROUP / 2;
            b->bytes = (size_t)(E * R * G * MT_MXFP4_GROUP / 2);
            sc->bytes = (size_t)(E * R * G);
            uint8_t *bv = mt_xmalloc(b->bytes), *sv = mt_xmalloc(sc->bytes);
            for (size_t k = 0; k < b->bytes; k++) bv[k] = (uint8_t)(mt_test_uniform(&rng) * 256);
            for (size_t k = 0; k < sc->bytes; k++) sv[k] = (uint8_t)(123 + mt_test_uniform(&rng) * 8);
            b->data = bv;
            sc->data = sv;
        }
    }
    ck_assert(p->n <= 64);
    char path[4200];
    if (shards == 1) {
        snprintf(path, sizeof path, "%s/model.safetensors", dir);
        mt_test_write_raw_safetensors(path, p->t, p->n);
        return;
    }
    /* shard 1: everything but the scales; shard 2: the scales */
    mt_test_raw_tensor first[64], second[64];
    int n1 = 0, n2 = 0;
    json_t *map = json_object();
    for (int i = 0; i < p->n; i++) {
        const bool scales = strstr(p->t[i].name, "_scales") != NULL;
        if (scales) second[n2++] = p->t[i];
        else first[n1++] = p->t[i];
        json_object_set_new(map, p->t[i].name, json_string(scales ? "model-00002-of-00002.safetensors"
                                                                   : "model-00001-of-00002.safetensors"));
    }
    snprintf(path, sizeof path, "%s/model-00001-of-00002.safetensors", dir);
    mt_test_write_raw_safetensors(path, first, n1);
    snprintf(path, sizeof path, "%s/model-00002-of-00002.safetensors", dir);
    mt_test_write_raw_safetensors(path, second, n2);
    json_t *root = json_object();
    json_object_set_new(root, "metadata", json_object());
    json_object_set_new(root, "weight_map", map);
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    ck_assert(json_dump_file(root, path, JSON_INDENT(2)) == 0);
    json_decref(root);
}

static const mt_test_raw_tensor *find_raw(const published *p, const char *name)
{
    for (int i = 0; i < p->n; i++)
        if (!strcmp(p->t[i].name, name)) return &p->t[i];
    return NULL;
}

static void free_published(published *p)
{
    for (int i = 0; i < p->n; i++) free((void *)p->t[i].data);
}

/* Every expert slot of st against the published blocks and scales decoded here; every other
 * tensor against its F32 values. */
static void check_decoded(const mt_model_config *cfg, const mt_host_state *st, const published *p)
{
    const int64_t E = cfg->experts, d = cfg->hidden, Ie = cfg->expert_intermediate;
    int64_t nonzero = 0;
    for (int l = 0; l < cfg->layers; l++) {
        char name[160];
        for (int kind = 0; kind < 2; kind++) {
            const int64_t R = kind ? d : 2 * Ie, C = kind ? Ie : d, G = C / MT_MXFP4_GROUP;
            snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%s_blocks", l, kind ? "down_proj" : "gate_up_proj");
            const uint8_t *b = find_raw(p, name)->data;
            snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%s_scales", l, kind ? "down_proj" : "gate_up_proj");
            const uint8_t *sc = find_raw(p, name)->data;
            for (int64_t e = 0; e < E; e++)
                for (int64_t r = 0; r < R; r++)
                    for (int64_t c = 0; c < C; c++) {
                        const int64_t byte = ((e * R + r) * G + c / 32) * 16 + (c % 32) / 2;
                        const unsigned code = c % 2 ? b[byte] >> 4 : b[byte] & 15u;
                        const double want = ldexp(e2m1(code), (int)sc[(e * R + r) * G + c / 32] - 127);
                        /* gate_up rows: 2j the gate's row j, 2j + 1 the up's; down rows: its own */
                        const float got = kind ? slot_value(st, l, (int)e, MT_X_DOWN, r * Ie + c)
                                               : slot_value(st, l, (int)e, r % 2 ? MT_X_UP : MT_X_GATE, (r / 2) * d + c);
                        ck_assert_msg(got == (float)want, "layer %d %s expert %lld row %lld col %lld: %g, want %g", l,
                                      kind ? "down" : "gate_up", (long long)e, (long long)r, (long long)c, got, want);
                        nonzero += want != 0;
                    }
        }
    }
    ck_assert(nonzero > 0);
    for (int i = 0; i < p->n; i++) {
        const mt_test_raw_tensor *r = &p->t[i];
        if (strcmp(r->dtype, "F32")) continue;
        int tile = 0, slot = -1;
        for (tile = 0; tile < st->ntiles && slot < 0; tile++)
            for (int s = 0; s < st->tiles[tile].layout->ntensors; s++) {
                char full[160];
                mt_layout_full_name(st->tiles[tile].layout, tile - 1, s, full, sizeof full);
                if (!strcmp(full, r->name)) {
                    slot = s;
                    break;
                }
            }
        tile--;
        ck_assert_msg(slot >= 0, "%s has no slot", r->name);
        const mt_tile *t = &st->tiles[tile];
        ck_assert(memcmp(t->master + t->layout->tensors[slot].offset, r->data, r->bytes) == 0);
    }
}

START_TEST(test_mxfp4_load)
{
    const mt_model_config cfg = moe_config(GPT_OSS_HF_BASE, "");
    char err[1024] = "";
    for (int shards = 1; shards <= 2; shards++) {
        mt_host_state *st = mt_state_create(&cfg, MT_DTYPE_F32, 0, err, sizeof err);
        ck_assert_msg(st != NULL, "%s", err);
        char dir[] = "/tmp/mt-gpt-oss-mx.XXXXXX";
        ck_assert(mkdtemp(dir) != NULL);
        published p;
        make_published(&cfg, st, dir, shards, 40 + (uint64_t)shards, &p);
        ck_assert_msg(mt_hf_load(dir, st, err, sizeof err) == 0, "%s", err);
        fprintf(stderr, "MXFP4 experts decoded (%d shard%s)\n", shards, shards > 1 ? "s, the scales apart" : "");
        check_decoded(&cfg, st, &p);

        /* saved back unquantised, it loads into the same state */
        char out[] = "/tmp/mt-gpt-oss-out.XXXXXX";
        ck_assert(mkdtemp(out) != NULL);
        ck_assert_msg(mt_hf_save(out, st, MT_DTYPE_F32, 0, err, sizeof err) == 0, "%s", err);
        mt_host_state *b = mt_state_create(&cfg, MT_DTYPE_F32, 0, err, sizeof err);
        ck_assert_msg(b && mt_hf_load(out, b, err, sizeof err) == 0, "%s", err);
        for (int i = 0; i < st->ntiles; i++)
            ck_assert(memcmp(st->tiles[i].master, b->tiles[i].master, sizeof(float) * (size_t)st->tiles[i].numel) == 0);
        mt_state_destroy(b);
        mt_test_remove_dir(out);
        free_published(&p);
        mt_state_destroy(st);
        mt_test_remove_dir(dir);
    }
}
END_TEST

/* The state in the compact layout (bf16 weights, the master in two planes) reads MXFP4 exactly:
 * every decoded value is a bf16 value. */
START_TEST(test_mxfp4_load_compact)
{
    const mt_model_config cfg = moe_config(GPT_OSS_HF_BASE, "");
    char err[1024] = "";
    mt_host_state *full = mt_state_create(&cfg, MT_DTYPE_F32, 0, err, sizeof err);
    ck_assert_msg(full != NULL, "%s", err);
    const mt_state_args sa = { .cfg = &cfg, .compute_dtype = MT_DTYPE_BF16, .layout = MT_LAYOUT_COMPACT };
    mt_host_state *compact = mt_state_create_with(&sa, err, sizeof err);
    ck_assert_msg(compact != NULL, "%s", err);
    char dir[] = "/tmp/mt-gpt-oss-mxc.XXXXXX";
    ck_assert(mkdtemp(dir) != NULL);
    published p;
    make_published(&cfg, full, dir, 1, 44, &p);
    ck_assert_msg(mt_hf_load(dir, full, err, sizeof err) == 0, "%s", err);
    ck_assert_msg(mt_hf_load(dir, compact, err, sizeof err) == 0, "%s", err);
    for (int i = 1; i <= cfg.layers; i++) {
        const mt_tile_layout *lay = full->tiles[i].layout;
        for (int e = 0; e < cfg.experts; e++)
            for (int which = 0; which < MT_X_COUNT; which++) {
                const mt_tensor_desc *t = &lay->tensors[mt_layout_expert_slot(e, which)];
                float *got = mt_xmalloc(sizeof(float) * (size_t)t->numel);
                mt_state_read_master(compact, i, t->offset, t->numel, got);
                ck_assert(memcmp(got, full->tiles[i].master + t->offset, sizeof(float) * (size_t)t->numel) == 0);
                free(got);
            }
    }
    free_published(&p);
    mt_state_destroy(full);
    mt_state_destroy(compact);
    mt_test_remove_dir(dir);
}
END_TEST

/* Refusals name the file and the tensor: scales missing, blocks of the wrong dtype or shape, a
 * tensor both fused and quantised. */
static void expect_refused(const mt_model_config *cfg, published *p, const char *dir, const char *want1,
                           const char *want2)
{
    char path[4200], err[1024] = "";
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    mt_test_write_raw_safetensors(path, p->t, p->n);
    mt_host_state *st = mt_state_create(cfg, MT_DTYPE_F32, 0, err, sizeof err);
    ck_assert_msg(st != NULL, "%s", err);
    ck_assert(mt_hf_load(dir, st, err, sizeof err) != 0);
    fprintf(stderr, "  refused: %s\n", err);
    ck_assert_msg(strstr(err, "model.safetensors") && strstr(err, want1) && (!want2 || strstr(err, want2)),
                  "message: %s", err);
    mt_state_destroy(st);
}

START_TEST(test_mxfp4_refusals)
{
    const mt_model_config cfg = moe_config(GPT_OSS_HF_BASE, "");
    char err[1024] = "";
    mt_host_state *st = mt_state_create(&cfg, MT_DTYPE_F32, 0, err, sizeof err);
    ck_assert_msg(st != NULL, "%s", err);
    char dir[] = "/tmp/mt-gpt-oss-bad.XXXXXX";
    ck_assert(mkdtemp(dir) != NULL);
    published p;
    make_published(&cfg, st, dir, 1, 45, &p);
    mt_state_destroy(st);
    int scales = -1, blocks = -1;
    for (int i = 0; i < p.n; i++) {
        if (!strcmp(p.t[i].name, "model.layers.1.mlp.experts.down_proj_scales")) scales = i;
        if (!strcmp(p.t[i].name, "model.layers.0.mlp.experts.gate_up_proj_blocks")) blocks = i;
    }
    ck_assert(scales >= 0 && blocks >= 0);

    mt_test_raw_tensor keep = p.t[scales];
    p.t[scales].name = "model.layers.1.mlp.experts.down_proj_scale";
    expect_refused(&cfg, &p, dir, "down_proj_scale", NULL); /* missing, or unexpected: whichever comes first */
    p.t[scales] = keep;
    p.t[scales].dtype = "F32"; /* the same bytes as a quarter as many floats */
    p.t[scales].ndim = 1;
    p.t[scales].shape[0] = (int64_t)keep.bytes / 4;
    expect_refused(&cfg, &p, dir, "down_proj_scales", "U8");
    p.t[scales] = keep;
    p.t[blocks].shape[1] -= 1; /* one row short, the bytes to match */
    p.t[blocks].bytes -= (size_t)(p.t[blocks].shape[0] * p.t[blocks].shape[2] * 16);
    expect_refused(&cfg, &p, dir, "gate_up_proj_blocks", "the config wants [3, 128, 1, 16]");
    p.t[blocks].shape[1] += 1;
    p.t[blocks].bytes = (size_t)(p.t[blocks].shape[0] * p.t[blocks].shape[1] * p.t[blocks].shape[2] * 16);
    /* scales beside an unquantised tensor: the fused down_proj of layer 1 in F32 and its scales */
    {
        published q = p;
        mt_test_raw_tensor extra[64];
        memcpy(extra, p.t, sizeof(mt_test_raw_tensor) * (size_t)p.n);
        int bi = -1;
        for (int i = 0; i < p.n; i++)
            if (!strcmp(p.t[i].name, "model.layers.1.mlp.experts.down_proj_blocks")) bi = i;
        ck_assert(bi >= 0);
        const int64_t E = cfg.experts, d = cfg.hidden, Ie = cfg.expert_intermediate;
        mt_test_raw_tensor *f = &extra[bi];
        f->name = "model.layers.1.mlp.experts.down_proj";
        f->dtype = "F32";
        f->ndim = 3;
        f->shape[0] = E, f->shape[1] = Ie, f->shape[2] = d;
        f->bytes = sizeof(float) * (size_t)(E * Ie * d);
        float *zeros = calloc((size_t)(E * Ie * d), sizeof(float));
        f->data = zeros;
        memcpy(q.t, extra, sizeof(mt_test_raw_tensor) * (size_t)p.n);
        expect_refused(&cfg, &q, dir, "down_proj_scales", "unquantised");
        free(zeros);
    }
    /* drop the scales altogether */
    p.t[scales] = p.t[p.n - 1];
    p.t[p.n - 1] = keep;
    p.n--;
    expect_refused(&cfg, &p, dir, "model.layers.1.mlp.experts.down_proj_scales", "missing");
    p.n++;
    free_published(&p);
    mt_test_remove_dir(dir);
}
END_TEST

static Suite *gpt_oss_hf_suite(void)
{
    Suite *s = suite_create("gpt_oss_hf");
    TCase *tc = tcase_create("hf");
    tcase_add_checked_fixture(tc, moe_runtime_up, moe_runtime_down);
    tcase_add_test(tc, test_fused_roundtrip);
    tcase_add_test(tc, test_mxfp4_load);
    tcase_add_test(tc, test_mxfp4_load_compact);
    tcase_add_test(tc, test_mxfp4_refusals);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return mt_test_run(gpt_oss_hf_suite(), false);
}
