/* The compact host layout (docs/design.md, section 1.1) on CPU workers in bf16: the state's
 * allocations against the plan; training against the full layout from the same weights, its own
 * resume bit for bit, exact clipping on the bf16 gradient's norm; clip speculation refused or
 * resolved to off. The planes and AdamW on them are test_compact_planes.c's. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backends/cpu/ops.h"
#include "codelets/clip.h"
#include "models/config.h"
#include "runtime/bench.h"
#include "runtime/checkpoint.h"
#include "runtime/hf.h"
#include "runtime/plan.h"
#include "runtime/runtime.h"
#include "runtime/state.h"
#include "runtime/step.h"
#include "tests/compact_util.h"
#include "tests/testutil.h"

/* ---- the state --------------------------------------------------------------------------- */

/* Five layers so that K = 2 does not divide L; odd sizes; GQA; q/k/v bias (as test_step). */
static mt_model_config tiny_config(bool tied)
{
    char json[1024], err[256];
    snprintf(json, sizeof json,
             "{\"model_type\": \"qwen2\", \"hidden_size\": 40, \"intermediate_size\": 56,"
             " \"num_hidden_layers\": 5, \"num_attention_heads\": 4, \"num_key_value_heads\": 2,"
             " \"head_dim\": 10, \"vocab_size\": 256, \"max_position_embeddings\": 64,"
             " \"rope_theta\": 10000.0, \"rms_norm_eps\": 1e-6, \"tie_word_embeddings\": %s}",
             tied ? "true" : "false");
    mt_model_config cfg;
    ck_assert_msg(mt_config_parse(json, "tiny", &cfg, err, sizeof err) == 0, "%s", err);
    return cfg;
}

static void start(void)
{
    mt_runtime_options ro = mt_runtime_defaults();
    ro.sched = "eager";
    ro.ncpu = 2;
    ro.ncuda = 0;
    char err[256];
    ck_assert_msg(mt_runtime_init(&ro, err, sizeof err) == 0, "%s", err);
}

static mt_host_state *create(const mt_model_config *cfg, mt_host_layout layout, int64_t chunk)
{
    char err[256];
    const mt_state_args a = { .cfg = cfg, .compute_dtype = MT_DTYPE_BF16, .chunk_numel = chunk, .layout = layout };
    mt_host_state *st = mt_state_create_with(&a, err, sizeof err);
    ck_assert_msg(st != NULL, "%s", err);
    return st;
}

static uint64_t page_round(uint64_t bytes) { return (bytes + 4095) / 4096 * 4096; }

/* The compact state holds what design.md says (master and fp32 gradient absent), and the plan
 * counts its allocations to the byte, kind by kind, in both layouts. fp32 weights are refused. */
START_TEST(test_state_matches_plan)
{
    start();
    for (int tied = 0; tied <= 1; tied++) {
        mt_model_config cfg = tiny_config(tied);
        for (int layout = MT_LAYOUT_FULL; layout <= MT_LAYOUT_COMPACT; layout++) {
            mt_host_state *st = create(&cfg, (mt_host_layout)layout, 0);
            const bool compact = layout == MT_LAYOUT_COMPACT;
            ck_assert_int_eq(st->layout, layout);
            uint64_t kind[5] = { 0 };
            for (int i = 0; i < st->ntiles; i++) {
                const mt_tile *t = &st->tiles[i];
                ck_assert(compact == (t->master == NULL) && compact == (t->grad == NULL));
                ck_assert(compact == (t->master_lo != NULL) && compact == (t->grad_bf16 != NULL));
                ck_assert(compact == (t->h_grad_acc != NULL) && compact == (t->h_master_lo_chunk != NULL));
                ck_assert((uintptr_t)t->weights % 4096 == 0 && (uintptr_t)t->adam_m % 4096 == 0);
                ck_assert_uint_eq(starpu_data_get_size(t->h_grad), (size_t)t->numel * (compact ? 2 : 4));
                if (compact) ck_assert_uint_eq(starpu_data_get_size(t->h_grad_acc), (size_t)t->numel * 4);
                kind[0] += t->weight_bytes;
                kind[1] += page_round((uint64_t)t->numel * (compact ? 2 : 4));
                kind[2] += page_round((uint64_t)t->numel * (compact ? 2 : 4));
                kind[3] += page_round((uint64_t)t->numel * 4);
                kind[4] += page_round((uint64_t)t->numel * 4);
            }
            const mt_plan_params pp = { .micro_batch = 2, .seq_len = 9, .grad_accum = 1, .checkpoint_interval = 2,
                                        .compute = MT_DTYPE_BF16, .use_gpu = false, .layout = (mt_host_layout)layout };
            mt_plan plan;
            ck_assert_msg(mt_plan_compute(&cfg, &pp, &plan) == 0, "%s", plan.error);
            const int kinds[5] = { MT_PLAN_WEIGHTS, MT_PLAN_MASTER, MT_PLAN_GRADS, MT_PLAN_ADAM_M, MT_PLAN_ADAM_V };
            for (int k = 0; k < 5; k++)
                ck_assert_msg(plan.host[kinds[k]] == kind[k], "layout %d tied %d kind %d: plan %llu, state %llu", layout,
                              tied, kinds[k], (unsigned long long)plan.host[kinds[k]], (unsigned long long)kind[k]);
            /* the accumulators, without a GPU in host memory: the most alive at once of the loss
             * anchor's (the head's, the table's when tied), the backward's (a layer's and the one
             * being converted, the table's when tied) and the table's at the end (with layer 0's) */
            const uint64_t E = (uint64_t)st->tiles[0].numel, Ly = (uint64_t)st->tiles[1].numel;
            const uint64_t H = (uint64_t)st->tiles[st->ntiles - 1].numel;
            uint64_t most = (tied ? E : 0) + H;
            if ((tied ? E : 0) + 2 * Ly > most) most = (tied ? E : 0) + 2 * Ly;
            if (E + Ly > most) most = E + Ly;
            ck_assert_uint_eq(plan.host[MT_PLAN_GRAD_ACC], compact ? 4 * most : 0);
            mt_state_destroy(st);
        }
    }
    char err[256];
    mt_model_config cfg = tiny_config(false);
    const mt_state_args a = { .cfg = &cfg, .compute_dtype = MT_DTYPE_F32, .layout = MT_LAYOUT_COMPACT };
    ck_assert_ptr_null(mt_state_create_with(&a, err, sizeof err));
    ck_assert_msg(strstr(err, "bf16") && strstr(err, "full"), "%s", err);
    mt_runtime_shutdown();
}
END_TEST

/* The accessors: a master written as fp32 reads back bit for bit and streams as its round to
 * nearest (ties away); a random initialisation is the full layout's, value for value. */
START_TEST(test_accessors)
{
    start();
    mt_model_config cfg = tiny_config(false);
    mt_host_state *full = create(&cfg, MT_LAYOUT_FULL, 0), *compact = create(&cfg, MT_LAYOUT_COMPACT, 0);
    mt_state_init_random(full, 3, 0.05);
    mt_state_init_random(compact, 3, 0.05);
    for (int i = 0; i < full->ntiles; i++) {
        const int64_t n = full->tiles[i].numel;
        float *a = malloc(sizeof(float) * n), *b = malloc(sizeof(float) * n);
        mt_state_read_master(full, i, 0, n, a);
        mt_state_read_master(compact, i, 0, n, b);
        ck_assert_msg(first_diff(a, b, n) < 0, "tile %d: initial masters differ at %lld", i, (long long)first_diff(a, b, n));
        /* a range written, read back and streamed */
        mt_test_rng r;
        mt_test_rng_seed(&r, (uint64_t)i);
        const int64_t o = n / 3, len = n / 2;
        mt_test_fill_f32(&r, a, len, 0.3f);
        a[0] = float_of((bits_of(a[0]) & 0xFFFF0000u) | 0x8000u);
        mt_state_write_master(compact, i, o, len, a);
        mt_state_read_master(compact, i, o, len, b);
        ck_assert_int_eq(first_diff(a, b, len), -1);
        /* the norms' master is their fp32 side */
        const mt_tile_layout *lay = compact->tiles[i].layout;
        for (int k = 0; k < lay->ntensors; k++) {
            const mt_tensor_desc *d = &lay->tensors[k];
            ck_assert_int_eq(d->f32_at != 0, mt_layout_is_norm(lay, k));
            for (int64_t e = d->offset; d->f32_at && e < d->offset + d->numel; e++)
                ck_assert_uint_eq(bits_of(((const float *)compact->tiles[i].weights)[d->f32_at + e - d->offset]),
                                  bits_of(e >= o && e < o + len ? a[e - o] : full->tiles[i].master[e]));
        }
        const mt_bf16 *w = (const mt_bf16 *)compact->tiles[i].weights + o;
        for (int64_t e = 0; e < len; e++) {
            const uint32_t x = bits_of(a[e]);
            ck_assert_uint_eq(w[e], (x + 0x8000u) >> 16);
        }
        const float *view;
        float *buf = NULL;
        view = mt_state_master_f32(compact, i, &buf);
        ck_assert_ptr_eq(view, buf);
        ck_assert_int_eq(first_diff(view + o, a, len), -1);
        ck_assert_ptr_eq(mt_state_master_f32(full, i, &buf), full->tiles[i].master);
        free(buf);
        free(a);
        free(b);
    }
    mt_state_destroy(full);
    mt_state_destroy(compact);
    mt_runtime_shutdown();
}
END_TEST

/* ---- training ---------------------------------------------------------------------------- */

/* The host state a run ends with, as fp32 (the accessors'), and its losses. */
typedef struct snapshot {
    int ntiles;
    int64_t *numel;
    float **master, **grad, **m, **v;
    double loss[8], norm[8];
    int64_t speculated;
    bool defers;
} snapshot;

static void snapshot_free(snapshot *s)
{
    for (int i = 0; i < s->ntiles; i++) { free(s->master[i]); free(s->grad[i]); free(s->m[i]); free(s->v[i]); }
    free(s->master); free(s->grad); free(s->m); free(s->v); free(s->numel);
}

static void take_snapshot(const mt_host_state *st, snapshot *s)
{
    s->ntiles = st->ntiles;
    s->numel = calloc(st->ntiles, sizeof *s->numel);
    s->master = calloc(st->ntiles, sizeof *s->master);
    s->grad = calloc(st->ntiles, sizeof *s->grad);
    s->m = calloc(st->ntiles, sizeof *s->m);
    s->v = calloc(st->ntiles, sizeof *s->v);
    for (int i = 0; i < st->ntiles; i++) {
        const mt_tile *t = &st->tiles[i];
        const size_t bytes = sizeof(float) * (size_t)t->numel;
        s->numel[i] = t->numel;
        s->master[i] = malloc(bytes);
        s->grad[i] = malloc(bytes);
        s->m[i] = malloc(bytes);
        s->v[i] = malloc(bytes);
        /* acquire: the AdamW chunks are gathered back into the whole tile */
        starpu_data_acquire(t->h_grad, STARPU_R);
        mt_state_read_grad(st, i, 0, t->numel, s->grad[i]);
        starpu_data_release(t->h_grad);
        mt_state_read_master(st, i, 0, t->numel, s->master[i]);
        memcpy(s->m[i], t->adam_m, bytes);
        memcpy(s->v[i], t->adam_v, bytes);
    }
}

/* Restores a snapshot's master, m and v into st (a checkpoint's contents, through the accessors). */
static void restore(mt_host_state *st, const snapshot *s)
{
    for (int i = 0; i < st->ntiles; i++) {
        mt_state_write_master(st, i, 0, s->numel[i], s->master[i]);
        memcpy(st->tiles[i].adam_m, s->m[i], sizeof(float) * (size_t)s->numel[i]);
        memcpy(st->tiles[i].adam_v, s->v[i], sizeof(float) * (size_t)s->numel[i]);
    }
}

static void random_batch(uint64_t seed, int64_t n, int32_t *tokens, int32_t *targets)
{
    mt_test_rng r;
    mt_test_rng_seed(&r, seed);
    for (int64_t i = 0; i < n; i++) {
        tokens[i] = (int32_t)(mt_test_uniform(&r) * 256);
        targets[i] = mt_test_uniform(&r) < 0.1 ? -1 : (int32_t)(mt_test_uniform(&r) * 256);
    }
}

/* What a run is: its layout and step settings; it starts from `from` (NULL: the seeded random
 * initialisation) and runs steps first..last on batches of those step numbers (one batch for
 * every step with same_batch: a loss that falls). */
typedef struct run_spec {
    mt_host_layout layout;
    bool tied, same_batch;
    int K, accum, first, last;
    double clip;
    int speculate, defer, split;
    int devices;               /* mt_step_config.devices: 0 or 1 one, 2 the CPU workers as two devices */
    const snapshot *from;
    const char *load, *save;   /* a checkpoint file to start from, to write at the end (NULL: none) */
} run_spec;

static mt_step_config step_config(const run_spec *r)
{
    mt_step_config sc = mt_step_defaults();
    sc.B = 2; sc.T = 9; sc.K = r->K; sc.accum = r->accum; sc.clip = r->clip; sc.head_chunk = 7;
    sc.weight_decay = 0.1;
    sc.clip_speculate = r->speculate;
    sc.adamw_defer = r->defer;
    sc.adamw_split = r->split;
    sc.devices = r->devices;
    return sc;
}

static snapshot run(const run_spec *r)
{
    start();
    mt_model_config cfg = tiny_config(r->tied);
    mt_host_state *st = create(&cfg, r->layout, 700);
    mt_state_init_random(st, 7, 0.05);
    if (r->from) restore(st, r->from);
    char err[512];
    if (r->load) {
        mt_checkpoint_meta meta;
        ck_assert_msg(mt_checkpoint_load(r->load, st, &meta, err, sizeof err) == 0, "%s", err);
        ck_assert_int_eq(meta.step, r->first - 1);
    }
    const mt_step_config sc = step_config(r);
    mt_graph *g = mt_graph_create(st, &sc, err, sizeof err);
    ck_assert_msg(g != NULL, "%s", err);
    const int64_t n = r->accum * sc.B * sc.T;
    int32_t *tok = malloc(sizeof *tok * n), *tgt = malloc(sizeof *tgt * n);
    snapshot s = { 0 };
    int slots[8];
    ck_assert(r->last - r->first < 8);
    for (int k = r->first; k <= r->last; k++) {
        random_batch(r->same_batch ? 100 : 100 + k, n, tok, tgt);
        slots[k - r->first] = mt_graph_submit_step(g, k, tok, tgt, 1e-2);
        if (k > r->first) s.loss[k - 1 - r->first] = mt_graph_wait_loss(g, slots[k - 1 - r->first], &s.norm[k - 1 - r->first]);
    }
    s.loss[r->last - r->first] = mt_graph_wait_loss(g, slots[r->last - r->first], &s.norm[r->last - r->first]);
    mt_graph_flush(g);
    starpu_task_wait_for_all();
    int64_t held;
    mt_graph_speculation_counts(g, &s.speculated, &held);
    s.defers = mt_graph_defers(g);
    take_snapshot(st, &s);
    if (r->save) {
        const mt_checkpoint_meta meta = { .step = r->last, .rng_state = 1, .seed = 7 };
        ck_assert_msg(mt_checkpoint_save(r->save, st, &meta, err, sizeof err) == 0, "%s", err);
    }
    free(tok);
    free(tgt);
    mt_graph_destroy(g);
    mt_state_destroy(st);
    mt_runtime_shutdown();
    return s;
}

static void assert_same(const snapshot *a, const snapshot *b, int nsteps, const char *what)
{
    for (int k = 0; k < nsteps; k++)
        ck_assert_msg(memcmp(&a->loss[k], &b->loss[k], sizeof(double)) == 0, "%s: loss %d: %.17g vs %.17g", what, k,
                      a->loss[k], b->loss[k]);
    for (int i = 0; i < a->ntiles; i++) {
        ck_assert_msg(first_diff(a->master[i], b->master[i], a->numel[i]) < 0, "%s: master of tile %d differs", what, i);
        ck_assert_msg(first_diff(a->m[i], b->m[i], a->numel[i]) < 0, "%s: m of tile %d differs", what, i);
        ck_assert_msg(first_diff(a->v[i], b->v[i], a->numel[i]) < 0, "%s: v of tile %d differs", what, i);
        ck_assert_msg(first_diff(a->grad[i], b->grad[i], a->numel[i]) < 0, "%s: gradient of tile %d differs", what, i);
    }
}

/* Compact against full from the same weights, bf16 on CPU workers, tied and untied, clipping
 * scaling every step, two micro-batches, six steps on one batch (the loss falls by a third):
 * each step's loss within 1e-3 relative. What differs is the gradient, rounded to bf16 once a
 * step instead of kept in fp32 (2^-9 relative per element, which AdamW's normalised step passes
 * on at lr 1e-2), and a streamed weight at an exact tie; a lost micro-batch or an unclipped
 * update moves the loss by far more. */
START_TEST(test_compact_trains_as_full)
{
    for (int tied = 0; tied <= 1; tied++) {
        const run_spec f = { .layout = MT_LAYOUT_FULL, .tied = tied, .same_batch = true, .K = 2, .accum = 2, .first = 1, .last = 6,
                             .clip = 0.5, .speculate = 0, .defer = 0, .split = -1 };
        run_spec c = f;
        c.layout = MT_LAYOUT_COMPACT;
        c.speculate = -1;
        c.defer = -1;
        snapshot a = run(&f), b = run(&c);
        double worst = 0;
        for (int k = 0; k < 6; k++) worst = fmax(worst, fabs(b.loss[k] - a.loss[k]) / a.loss[k]);
        ck_assert_msg(worst < 1e-3, "tied %d: losses differ by %.3g relative (full %.6f.. %.6f, compact %.6f.. %.6f)", tied,
                      worst, a.loss[0], a.loss[5], b.loss[0], b.loss[5]);
        /* it trained: the loss fell, the norm was clipped (over the bound) */
        ck_assert(b.loss[5] < b.loss[0] && b.norm[0] > 0.5);
        /* nothing speculated or deferred */
        ck_assert_int_eq(b.speculated, 0);
        ck_assert(!b.defers);
        /* the norms (the compact layout's fp32 side is their master) moved from their initial 1
         * as the full layout's did: each norm's change agrees to 5% */
        mt_model_config cfg = tiny_config(tied);
        for (int i = 1; i < a.ntiles; i++) {
            mt_tile_layout lay;
            mt_layout_build(&cfg, i == a.ntiles - 1 ? MT_TILE_HEAD : MT_TILE_LAYER, &lay);
            for (int k = 0; k < lay.ntensors; k++) {
                if (!mt_layout_is_norm(&lay, k)) continue;
                const mt_tensor_desc *d = &lay.tensors[k];
                double moved = 0, diff = 0;
                for (int64_t e = d->offset; e < d->offset + d->numel; e++) {
                    moved += (a.master[i][e] - 1.0) * (a.master[i][e] - 1.0);
                    diff += (b.master[i][e] - a.master[i][e]) * (b.master[i][e] - a.master[i][e]);
                }
                ck_assert_msg(moved > 0 && sqrt(diff) < 0.05 * sqrt(moved), "tied %d tile %d %s: moved %.3g, compact off by %.3g",
                              tied, i, d->name, sqrt(moved), sqrt(diff));
            }
        }
        /* the gradients agree to bf16's rounding */
        for (int i = 0; i < a.ntiles; i++)
            ck_assert_msg(mt_test_rel_err_f32(b.grad[i], a.grad[i], a.numel[i]) < 2e-2, "tied %d tile %d: gradient error %.3g",
                          tied, i, mt_test_rel_err_f32(b.grad[i], a.grad[i], a.numel[i]));
        snapshot_free(&a);
        snapshot_free(&b);
    }
}
END_TEST

/* Two devices (the two CPU workers) in the compact layout: micro-batch u on device u mod 2, each
 * device accumulating its own fp32 copy, device 1's added into device 0's accumulator in device
 * order before the rounding to the bf16 home. Against one device accumulating the same four
 * micro-batches, tied and untied, clipping scaling every step, six steps on one batch: the sums
 * differ in their order ((u0 + u2) + (u1 + u3) against ((u0 + u1) + u2) + u3), which the bf16
 * rounding passes on to an element now and then: each step's loss within 1e-4 relative and the
 * last gradients within 1e-2 (measured 1.9e-6 and 9.8e-4); with device 1's share left out the
 * losses part by 0.22 relative. Bit for bit from one run to the next. */
START_TEST(test_compact_devices)
{
    for (int tied = 0; tied <= 1; tied++) {
        const run_spec one = { .layout = MT_LAYOUT_COMPACT, .tied = tied, .same_batch = true, .K = 2, .accum = 4,
                               .first = 1, .last = 6, .clip = 0.5, .speculate = -1, .defer = -1, .split = -1 };
        run_spec two = one;
        two.devices = 2;
        snapshot a = run(&one), b = run(&two), again = run(&two);
        assert_same(&b, &again, 6, "two devices, again");
        double worst = 0;
        for (int k = 0; k < 6; k++) worst = fmax(worst, fabs(b.loss[k] - a.loss[k]) / a.loss[k]);
        ck_assert_msg(worst < 1e-4, "tied %d: losses differ by %.3g relative (one device %.6f.. %.6f, two %.6f.. %.6f)",
                      tied, worst, a.loss[0], a.loss[5], b.loss[0], b.loss[5]);
        ck_assert(b.loss[5] < b.loss[0] && b.norm[0] > 0.5);
        double gworst = 0;
        for (int i = 0; i < a.ntiles; i++) {
            const double e = mt_test_rel_err_f32(b.grad[i], a.grad[i], a.numel[i]);
            ck_assert_msg(e < 1e-2, "tied %d tile %d: gradient error %.3g", tied, i, e);
            gworst = fmax(gworst, e);
        }
        printf("compact, two devices, tied %d: losses within %.3g relative, last gradients within %.3g\n", tied, worst,
               gworst);
        snapshot_free(&a);
        snapshot_free(&b);
        snapshot_free(&again);
    }
}
END_TEST

/* Compact runs repeat themselves, and resume bit for bit from the fp32 master, m and v a
 * checkpoint keeps: steps 1-4 at once equal steps 1-2, restored into a fresh state, then 3-4.
 * The same contents load into a full state as its master, bit for bit. Fused (no clipping, split
 * only at the step boundary) and split (clipping) updates both. */
START_TEST(test_compact_resume_bitwise)
{
    for (int clipped = 0; clipped <= 1; clipped++) {
        const run_spec whole = { .layout = MT_LAYOUT_COMPACT, .tied = true, .K = 2, .accum = 1, .first = 1, .last = 4,
                                 .clip = clipped ? 1.0 : 0, .speculate = -1, .defer = -1, .split = -1 };
        snapshot all = run(&whole), again = run(&whole);
        assert_same(&all, &again, 4, "the same run twice");
        run_spec first = whole;
        first.last = 2;
        snapshot half = run(&first);
        run_spec second = whole;
        second.first = 3;
        second.from = &half;
        snapshot resumed = run(&second);
        /* losses of steps 3 and 4 */
        for (int k = 0; k < 2; k++)
            ck_assert_msg(memcmp(&resumed.loss[k], &all.loss[k + 2], sizeof(double)) == 0, "clip %d: resumed loss %d: %.17g vs %.17g",
                          clipped, k + 3, resumed.loss[k], all.loss[k + 2]);
        for (int i = 0; i < all.ntiles; i++) {
            ck_assert_msg(first_diff(resumed.master[i], all.master[i], all.numel[i]) < 0, "clip %d: resumed master of tile %d",
                          clipped, i);
            ck_assert_msg(first_diff(resumed.m[i], all.m[i], all.numel[i]) < 0, "clip %d: resumed m of tile %d", clipped, i);
            ck_assert_msg(first_diff(resumed.v[i], all.v[i], all.numel[i]) < 0, "clip %d: resumed v of tile %d", clipped, i);
        }
        /* into a full state: the same fp32 master */
        start();
        mt_model_config cfg = tiny_config(true);
        mt_host_state *full = create(&cfg, MT_LAYOUT_FULL, 700);
        restore(full, &half);
        for (int i = 0; i < full->ntiles; i++) {
            ck_assert_int_eq(first_diff(full->tiles[i].master, half.master[i], half.numel[i]), -1);
            const mt_bf16 *w = full->tiles[i].weights;
            for (int64_t e = 0; e < half.numel[i]; e++) ck_assert_uint_eq(w[e], mt_bf16_from_float(half.master[i][e]));
        }
        mt_state_destroy(full);
        mt_runtime_shutdown();
        snapshot_free(&all); snapshot_free(&again); snapshot_free(&half); snapshot_free(&resumed);
    }
}
END_TEST

/* The same through checkpoint files: a compact run's checkpoint (the fp32 master, m and v) resumes
 * bit for bit in compact, and loads into a full state with the same master (the same hash). */
START_TEST(test_compact_checkpoint_resume)
{
    char dir[] = "/tmp/mt-compact.XXXXXX", path[64];
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/run.ckpt", dir);
    const run_spec whole = { .layout = MT_LAYOUT_COMPACT, .tied = false, .K = 2, .accum = 2, .first = 1, .last = 4,
                             .clip = 1.0, .speculate = -1, .defer = -1, .split = -1 };
    snapshot all = run(&whole);
    run_spec first = whole;
    first.last = 2;
    first.save = path;
    snapshot half = run(&first);
    run_spec second = whole;
    second.first = 3;
    second.load = path;
    snapshot resumed = run(&second);
    for (int k = 0; k < 2; k++)
        ck_assert_msg(memcmp(&resumed.loss[k], &all.loss[k + 2], sizeof(double)) == 0, "resumed loss %d", k + 3);
    for (int i = 0; i < all.ntiles; i++) {
        ck_assert_int_eq(first_diff(resumed.master[i], all.master[i], all.numel[i]), -1);
        ck_assert_int_eq(first_diff(resumed.m[i], all.m[i], all.numel[i]), -1);
        ck_assert_int_eq(first_diff(resumed.v[i], all.v[i], all.numel[i]), -1);
    }
    /* into a full state */
    start();
    mt_model_config cfg = tiny_config(false);
    mt_host_state *full = create(&cfg, MT_LAYOUT_FULL, 700), *compact = create(&cfg, MT_LAYOUT_COMPACT, 700);
    char err[512];
    mt_checkpoint_meta meta;
    ck_assert_msg(mt_checkpoint_load(path, full, &meta, err, sizeof err) == 0, "%s", err);
    ck_assert_msg(mt_checkpoint_load(path, compact, &meta, err, sizeof err) == 0, "%s", err);
    for (int i = 0; i < full->ntiles; i++) ck_assert_int_eq(first_diff(full->tiles[i].master, half.master[i], half.numel[i]), -1);
    ck_assert_uint_eq(mt_state_hash(full), mt_state_hash(compact));
    mt_state_destroy(full);
    mt_state_destroy(compact);
    mt_runtime_shutdown();
    unlink(path);
    rmdir(dir);
    snapshot_free(&all); snapshot_free(&half); snapshot_free(&resumed);
}
END_TEST

/* An HF directory written from a compact state (fp32, in several shards: each decoded apart) loads
 * into a full state and into another compact one with the same masters, bit for bit. */
START_TEST(test_compact_hf_round_trip)
{
    char dir[] = "/tmp/mt-compact-hf.XXXXXX", err[512];
    ck_assert_ptr_nonnull(mkdtemp(dir));
    start();
    mt_model_config cfg = tiny_config(false);
    mt_host_state *a = create(&cfg, MT_LAYOUT_COMPACT, 0), *b = create(&cfg, MT_LAYOUT_COMPACT, 0);
    mt_host_state *full = create(&cfg, MT_LAYOUT_FULL, 0);
    mt_state_init_random(a, 21, 0.05);
    ck_assert_msg(mt_hf_save(dir, a, MT_DTYPE_F32, 100000, err, sizeof err) == 0, "%s", err);
    ck_assert_msg(mt_hf_load(dir, b, err, sizeof err) == 0, "%s", err);
    ck_assert_msg(mt_hf_load(dir, full, err, sizeof err) == 0, "%s", err);
    for (int i = 0; i < a->ntiles; i++) {
        const int64_t n = a->tiles[i].numel;
        float *x = malloc(sizeof(float) * n), *y = malloc(sizeof(float) * n);
        mt_state_read_master(a, i, 0, n, x);
        mt_state_read_master(b, i, 0, n, y);
        ck_assert_msg(first_diff(x, y, n) < 0, "tile %d: compact -> compact differs", i);
        ck_assert_msg(first_diff(x, full->tiles[i].master, n) < 0, "tile %d: compact -> full differs", i);
        free(x);
        free(y);
    }
    ck_assert_uint_eq(mt_state_hash(a), mt_state_hash(full));
    mt_state_destroy(a);
    mt_state_destroy(b);
    mt_state_destroy(full);
    mt_runtime_shutdown();
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    ck_assert_int_eq(system(cmd), 0);
}
END_TEST

/* Exact clipping on the bf16 gradient: one step with clipping that scales; the norm the graph
 * reports is that of the bf16 gradients AdamW reads (per tile in element order, the tiles in
 * order, to the bit), and every master is the fp32 kernel's update of the initial one with that
 * norm's scale. Untied, several micro-batches, fused and split updates. */
START_TEST(test_compact_clip_exact)
{
    for (int split = 0; split <= 1; split++) {
        const double clip = 0.05;
        const run_spec r = { .layout = MT_LAYOUT_COMPACT, .tied = false, .K = 3, .accum = 3, .first = 1, .last = 1,
                             .clip = clip, .speculate = -1, .defer = -1, .split = split };
        snapshot s = run(&r);
        start();
        mt_model_config cfg = tiny_config(false);
        mt_host_state *st = create(&cfg, MT_LAYOUT_COMPACT, 700);
        mt_state_init_random(st, 7, 0.05);
        double sum = 0;
        for (int i = 0; i < s.ntiles; i++) {
            double t = 0;
            for (int64_t e = 0; e < s.numel[i]; e++) t += (double)s.grad[i][e] * (double)s.grad[i][e];
            sum += t;
        }
        const double norm = sqrt(sum);
        ck_assert_msg(memcmp(&norm, &s.norm[0], sizeof norm) == 0, "norm %.17g, the bf16 gradients' %.17g", s.norm[0], norm);
        const double scale = mt_clip_scale(clip, norm);
        ck_assert(scale < 0.5);
        const mt_step_config sc = step_config(&r);
        for (int i = 0; i < s.ntiles; i++) {
            const mt_tile *t = &st->tiles[i];
            float *want = malloc(sizeof(float) * (size_t)t->numel), *m = calloc(t->numel, sizeof(float));
            float *v = calloc(t->numel, sizeof(float));
            mt_state_read_master(st, i, 0, t->numel, want);
            for (int c = 0; c < t->nchunks; c++) {
                const mt_chunk *ch = &t->chunks[c];
                const mt_adamw_params p = { .lr = 1e-2, .beta1 = sc.beta1, .beta2 = sc.beta2, .eps = sc.eps,
                                            .weight_decay = ch->decay ? sc.weight_decay : 0, .step = 1,
                                            .grad_scale = 1.0 * scale };
                mt_cpu_adamw_f32(ch->numel, want + ch->offset, s.grad[i] + ch->offset, m + ch->offset, v + ch->offset, &p);
            }
            ck_assert_msg(first_diff(s.master[i], want, t->numel) < 0, "split %d tile %d: master differs at %lld", split, i,
                          (long long)first_diff(s.master[i], want, t->numel));
            ck_assert_msg(first_diff(s.m[i], m, t->numel) < 0 && first_diff(s.v[i], v, t->numel) < 0,
                          "split %d tile %d: moments differ", split, i);
            free(want); free(m); free(v);
        }
        mt_state_destroy(st);
        mt_runtime_shutdown();
        snapshot_free(&s);
    }
}
END_TEST

/* Clip speculation needs the full layout: unit, ranged and --adamw-defer on are refused with a
 * message that says why and what to use; auto resolves to none. */
START_TEST(test_compact_speculation)
{
    start();
    mt_model_config cfg = tiny_config(true);
    mt_host_state *st = create(&cfg, MT_LAYOUT_COMPACT, 700);
    const run_spec base = { .layout = MT_LAYOUT_COMPACT, .tied = true, .K = 2, .accum = 1, .clip = 1.0,
                            .speculate = -1, .defer = -1, .split = -1 };
    char err[512];
    const int refused[3][2] = { { 1, -1 }, { 2, -1 }, { -1, 1 } };
    for (int k = 0; k < 3; k++) {
        run_spec r = base;
        r.speculate = refused[k][0];
        r.defer = refused[k][1];
        const mt_step_config sc = step_config(&r);
        err[0] = 0;
        mt_graph *g = mt_graph_create(st, &sc, err, sizeof err);
        ck_assert_msg(g == NULL, "case %d accepted", k);
        ck_assert_msg(strstr(err, "full host layout") && strstr(err, "--host-layout full") && strstr(err, "auto"), "%s", err);
    }
    run_spec r = base;
    r.defer = 0;
    const mt_step_config sc = step_config(&r);
    mt_graph *g = mt_graph_create(st, &sc, err, sizeof err);
    ck_assert_msg(g != NULL, "%s", err);
    ck_assert(!mt_graph_defers(g));
    ck_assert(st->tiles[0].grad_alt == NULL);
    mt_graph_destroy(g);
    mt_state_destroy(st);
    mt_runtime_shutdown();
    /* and over steps, with the last scale 1 (clip large: unit would be chosen) and below 1 */
    for (int k = 0; k < 2; k++) {
        run_spec t = base;
        t.first = 1;
        t.last = 3;
        t.clip = k ? 0.05 : 1e6;
        snapshot s = run(&t);
        ck_assert_int_eq(s.speculated, 0);
        snapshot_free(&s);
    }
}
END_TEST

/* bench --host-layout: a compact run of the tiny shape on CPU workers says its layout and bytes
 * per parameter, trains, and refuses clip speculation. */
START_TEST(test_bench_compact)
{
    mt_bench_options o = mt_bench_defaults();
    o.shape = "tiny";
    o.step.B = 2;
    o.step.T = 64;
    o.warmup = 1;
    o.steps = 2;
    o.host_layout = MT_LAYOUT_COMPACT;
    o.runtime.ncpu = 2;
    o.runtime.ncuda = 0;
    mt_bench_result r;
    char err[512], *text = NULL;
    size_t len = 0;
    FILE *log = open_memstream(&text, &len);
    const int rc = mt_bench_run(&o, &r, log, NULL, err, sizeof err);
    fclose(log);
    ck_assert_msg(rc == 0, "%s", err);
    ck_assert_msg(strstr(text, "bench: host layout compact (--host-layout compact), 14.") && strstr(text, "bytes per parameter"),
                  "%s", text);
    ck_assert_msg(strstr(text, "compact host state"), "%s", text);
    ck_assert(isfinite(r.loss_first) && isfinite(r.loss_last) && r.speculated == 0);
    free(text);
    o.step.clip_speculate = 2;
    ck_assert_int_eq(mt_bench_run(&o, &r, NULL, NULL, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "full host layout"), "%s", err);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("compact");
    TCase *state = tcase_create("state");
    tcase_add_test(state, test_state_matches_plan);
    tcase_add_test(state, test_accessors);
    suite_add_tcase(s, state);
    TCase *train = tcase_create("train");
    tcase_add_test(train, test_compact_trains_as_full);
    tcase_add_test(train, test_compact_devices);
    tcase_add_test(train, test_compact_resume_bitwise);
    tcase_add_test(train, test_compact_checkpoint_resume);
    tcase_add_test(train, test_compact_hf_round_trip);
    tcase_add_test(train, test_compact_clip_exact);
    tcase_add_test(train, test_compact_speculation);
    tcase_add_test(train, test_bench_compact);
    suite_add_tcase(s, train);
    return mt_test_run(s, false);
}
