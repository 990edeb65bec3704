/* The step graph on CPU workers: recompute with any K gives bitwise identical results, eager and
 * dmda agree bitwise, and the dependencies are exactly the data ones (gates hold single tasks
 * and the test watches what still runs). */
#include <check.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "codelets/adamw.h"
#include "models/config.h"
#include "runtime/plan.h"
#include "runtime/policy.h"
#include "runtime/runtime.h"
#include "runtime/state.h"
#include "runtime/step.h"
#include "runtime/step/graph.h" /* the checkpoints' homes (test_offload_checkpoints_bitwise) */
#include "tests/testutil.h"

/* Five layers so that K = 2 and 3 do not divide L; odd sizes; GQA; q/k/v bias. */
static const char *tiny_json_fmt =
    "{\"model_type\": \"qwen2\", \"hidden_size\": 40, \"intermediate_size\": 56,"
    " \"num_hidden_layers\": 5, \"num_attention_heads\": 4, \"num_key_value_heads\": 2,"
    " \"head_dim\": 10, \"vocab_size\": 256, \"max_position_embeddings\": 64,"
    " \"rope_theta\": 10000.0, \"rms_norm_eps\": 1e-6, \"tie_word_embeddings\": %s}";

static mt_model_config tiny_config(bool tied)
{
    char json[1024], err[256];
    snprintf(json, sizeof json, tiny_json_fmt, tied ? "true" : "false");
    mt_model_config cfg;
    ck_assert_msg(mt_config_parse(json, "tiny", &cfg, err, sizeof err) == 0, "%s", err);
    return cfg;
}

/* CPU workers of the runs below */
static int start_ncpu = 2;

static void start(const char *sched)
{
    mt_runtime_options ro = mt_runtime_defaults();
    ro.sched = sched;
    ro.ncpu = start_ncpu;
    ro.ncuda = 0;
    char err[256];
    ck_assert_msg(mt_runtime_init(&ro, err, sizeof err) == 0, "%s", err);
}

static void random_batch(uint64_t seed, int64_t n, int32_t *tokens, int32_t *targets)
{
    mt_test_rng r;
    mt_test_rng_seed(&r, seed);
    for (int64_t i = 0; i < n; i++) {
        tokens[i] = (int32_t)(mt_test_uniform(&r) * 256);
        /* a few ignored targets, as a loss mask would give */
        targets[i] = mt_test_uniform(&r) < 0.1 ? -1 : (int32_t)(mt_test_uniform(&r) * 256);
    }
}

/* Everything a run leaves behind that must not depend on K or the policy. */
typedef struct outcome {
    int ntiles;
    int64_t *numel;
    float **master, **grad, **m, **v;
    double loss[8];
    int64_t speculated, held;  /* mt_graph_speculation_counts at the end */
    mt_ranged_counts ranged;   /* what the graph's ranged runs did (mt_graph_adamw_stats) */
    bool deferred;             /* with a second gradient (deferred moments halves) */
    long long hinted[2];       /* devices 0 and 1's tasks with a prefetch hint (megatrain policy, 2 devices) */
} outcome;

/* adamw_split of the runs below (-1: the default, split when clipping). */
static int split_mode = -1;
/* clip_speculate of the runs below (-1: the default), their clip_range, and the host state's
 * compute precision. */
static int speculate_mode = -1;
static double speculate_range = 0, speculate_range_max = 0;
static int range_check_mode = -1; /* clip_range_check (-1: the default, on) */
/* adamw_defer of the runs below (0: off; the library's default is -1, auto); from step
 * switch_step on, clip_speculate switch_to (0: never switch). */
static int defer_mode = 0;
static int switch_step = 0, switch_to = 0;
static mt_dtype state_dtype = MT_DTYPE_F32;
/* offload_checkpoints of the runs below (0: off; the library's default is -1, auto). */
static int offload_mode = 0;
/* devices of the runs below (0: the default, one device on CPU workers) */
static int devices_mode = 0;

/* After an update every AdamW variant leaves the streamed copy the master's: bf16-rounded, and the
 * norms of a bf16 tile exact in its fp32 side (the values its next forward computes with). */
static void check_streamed(const mt_host_state *st, mt_tile *t)
{
    starpu_data_acquire(t->h_weights, STARPU_R);
    const mt_tile_layout *lay = t->layout;
    for (int k = 0; k < lay->ntensors; k++) {
        const mt_tensor_desc *d = &lay->tensors[k];
        for (int64_t e = 0; e < d->numel; e++) {
            const float want = t->master[d->offset + e];
            const bool same = st->compute_dtype == MT_DTYPE_F32 ? ((const float *)t->weights)[d->offset + e] == want
                              : d->f32_at ? ((const float *)t->weights)[d->f32_at + e] == want
                                          : ((const mt_bf16 *)t->weights)[d->offset + e] == mt_bf16_from_float(want);
            ck_assert_msg(same, "tile %d %s[%lld]: the streamed copy is not the master's %g", t->index, d->name,
                          (long long)e, (double)want);
        }
        ck_assert_int_eq(d->f32_at != 0, st->compute_dtype == MT_DTYPE_BF16 && mt_layout_is_norm(lay, k));
    }
    starpu_data_release(t->h_weights);
}

static outcome run_steps_b(const char *sched, bool tied, int K, int accum, int nsteps, double clip, int64_t B);

static outcome run_steps(const char *sched, bool tied, int K, int accum, int nsteps, double clip)
{
    return run_steps_b(sched, tied, K, accum, nsteps, clip, 2);
}

static outcome run_steps_b(const char *sched, bool tied, int K, int accum, int nsteps, double clip, int64_t B)
{
    start(sched);
    mt_model_config cfg = tiny_config(tied);
    char err[256];
    mt_host_state *st = mt_state_create(&cfg, state_dtype, 700, err, sizeof err);
    ck_assert_msg(st != NULL, "%s", err);
    mt_state_init_random(st, 7, 0.05);
    mt_step_config sc = mt_step_defaults();
    sc.clip_range = speculate_range;
    sc.clip_range_max = speculate_range_max;
    sc.clip_range_check = range_check_mode;
    sc.B = B; sc.T = 9; sc.K = K; sc.accum = accum; sc.clip = clip; sc.head_chunk = 7;
    sc.weight_decay = 0.1;
    sc.adamw_split = split_mode;
    sc.clip_speculate = speculate_mode;
    sc.adamw_defer = defer_mode;
    sc.offload_checkpoints = offload_mode;
    sc.devices = devices_mode;
    mt_graph *g = mt_graph_create(st, &sc, err, sizeof err);
    ck_assert_msg(g != NULL, "%s", err);
    /* auto resolves to off on CPU workers (nothing to offload from). Every activation buffer has
     * its home in host memory, so that StarPU's RAM node never has to hold one (graph.c,
     * alloc_homes); offloaded, every block's checkpoint but the last's is pinned there. */
    ck_assert(mt_graph_offloads_checkpoints(g) == (offload_mode == 1));
    for (int b = 0; b < g->nblocks; b++)
        for (int u = 0; u < accum; u++) {
            const int home = starpu_data_get_home_node(mt_step_ckpt(g, b, u));
            ck_assert_msg(home == STARPU_MAIN_RAM, "checkpoint of block %d, micro-batch %d: home node %d", b, u, home);
            ck_assert(g->homes[b * accum + u].pinned == (offload_mode == 1 && b < g->nblocks - 1));
        }
    for (int u = 0; u < accum; u++)
        for (int i = 0; i < 2; i++) {
            ck_assert_int_eq(starpu_data_get_home_node(g->act[u][i]), STARPU_MAIN_RAM);
            ck_assert_int_eq(starpu_data_get_home_node(g->grad[u][i]), STARPU_MAIN_RAM);
        }
    for (int j = 0; j < sc.K; j++) ck_assert_int_eq(starpu_data_get_home_node(g->saved[j]), STARPU_MAIN_RAM);
    /* pinned only where a GPU copies every step: nothing else on CPU workers */
    for (int h = g->nblocks * accum; h < g->nhomes; h++) ck_assert(!g->homes[h].pinned);
    int64_t n = accum * sc.B * sc.T;
    int32_t *tok = malloc(sizeof *tok * n), *tgt = malloc(sizeof *tgt * n);
    outcome o = { .ntiles = st->ntiles };
    int slots[8];
    ck_assert(nsteps <= 8);
    /* As the training loop does: step s's loss is read once step s+1 is submitted, before its
     * slot is reused by step s+2 (two slots). */
    for (int s = 1; s <= nsteps; s++) {
        random_batch(100 + s, n, tok, tgt);
        if (switch_step && s == switch_step) mt_graph_set_clip_speculate(g, switch_to);
        slots[s - 1] = mt_graph_submit_step(g, s, tok, tgt, 1e-2);
        if (s >= 2) o.loss[s - 2] = mt_graph_wait_loss(g, slots[s - 2], NULL);
    }
    o.loss[nsteps - 1] = mt_graph_wait_loss(g, slots[nsteps - 1], NULL);
    mt_graph_flush(g); /* deferred moments halves of the last update */
    starpu_task_wait_for_all();
    mt_graph_speculation_counts(g, &o.speculated, &o.held);
    if (g->ndev == 2)
        for (int dv = 0; dv < 2; dv++) o.hinted[dv] = mt_policy_hinted_tasks(MT_SCHED_CTX_INITIAL, g->dev_worker[dv]);
    o.ranged = mt_adamw_stats_ranged(mt_graph_adamw_stats(g));
    o.deferred = st->tiles[1].grad_alt != NULL;
    /* every tile's moments are deferred, the table's too (into its early path), or none */
    for (int i = 0; i < st->ntiles; i++) ck_assert((st->tiles[i].grad_alt != NULL) == o.deferred);
    o.numel = calloc(st->ntiles, sizeof *o.numel);
    o.master = calloc(st->ntiles, sizeof *o.master);
    o.grad = calloc(st->ntiles, sizeof *o.grad);
    o.m = calloc(st->ntiles, sizeof *o.m);
    o.v = calloc(st->ntiles, sizeof *o.v);
    for (int i = 0; i < st->ntiles; i++) {
        mt_tile *t = &st->tiles[i];
        o.numel[i] = t->numel;
        /* acquire: the partitioned chunks are gathered back into the whole tile */
        starpu_data_acquire(t->h_grad, STARPU_R);
        o.grad[i] = malloc(sizeof(float) * t->numel);
        memcpy(o.grad[i], t->grad, sizeof(float) * t->numel);
        starpu_data_release(t->h_grad);
        o.master[i] = malloc(sizeof(float) * t->numel);
        memcpy(o.master[i], t->master, sizeof(float) * t->numel);
        check_streamed(st, t);
        o.m[i] = malloc(sizeof(float) * t->numel);
        memcpy(o.m[i], t->adam_m, sizeof(float) * t->numel);
        o.v[i] = malloc(sizeof(float) * t->numel);
        memcpy(o.v[i], t->adam_v, sizeof(float) * t->numel);
    }
    free(tok); free(tgt);
    mt_graph_destroy(g);
    mt_state_destroy(st);
    mt_runtime_shutdown();
    return o;
}

static void outcome_free(outcome *o)
{
    for (int i = 0; i < o->ntiles; i++) { free(o->master[i]); free(o->grad[i]); free(o->m[i]); free(o->v[i]); }
    free(o->master); free(o->grad); free(o->m); free(o->v); free(o->numel);
}

static void assert_bitwise(const outcome *a, const outcome *b, int nsteps, const char *what)
{
    ck_assert_int_eq(a->ntiles, b->ntiles);
    for (int s = 0; s < nsteps; s++)
        ck_assert_msg(memcmp(&a->loss[s], &b->loss[s], sizeof(double)) == 0, "%s: loss of step %d differs: %.17g vs %.17g",
                      what, s + 1, a->loss[s], b->loss[s]);
    for (int i = 0; i < a->ntiles; i++) {
        ck_assert_msg(memcmp(a->grad[i], b->grad[i], sizeof(float) * a->numel[i]) == 0, "%s: gradient of tile %d differs", what, i);
        ck_assert_msg(memcmp(a->master[i], b->master[i], sizeof(float) * a->numel[i]) == 0, "%s: weights of tile %d differ", what, i);
        ck_assert_msg(memcmp(a->m[i], b->m[i], sizeof(float) * a->numel[i]) == 0, "%s: Adam m of tile %d differs", what, i);
        ck_assert_msg(memcmp(a->v[i], b->v[i], sizeof(float) * a->numel[i]) == 0, "%s: Adam v of tile %d differs", what, i);
    }
}

START_TEST(test_recompute_any_k_bitwise)
{
    for (int tied = 0; tied <= 1; tied++) {
        outcome ref = run_steps("eager", tied, 1, 1, 2, 1.0);
        ck_assert(ref.loss[0] > 4.0 && ref.loss[0] < 7.0); /* about ln 256 at initialisation */
        const int ks[] = { 2, 3, 5 };
        for (int k = 0; k < 3; k++) {
            outcome o = run_steps("eager", tied, ks[k], 1, 2, 1.0);
            char what[64];
            snprintf(what, sizeof what, "K=%d tied=%d", ks[k], tied);
            assert_bitwise(&ref, &o, 2, what);
            outcome_free(&o);
        }
        /* The update really changed the weights: a run of 1 step differs from 2 steps. */
        outcome one = run_steps("eager", tied, 1, 1, 1, 1.0);
        bool differs = false;
        for (int i = 0; i < one.ntiles && !differs; i++)
            differs = memcmp(one.master[i], ref.master[i], sizeof(float) * one.numel[i]) != 0;
        ck_assert_msg(differs, "second step left the weights unchanged");
        outcome_free(&one);
        outcome_free(&ref);
    }
}
END_TEST

START_TEST(test_recompute_with_accumulation_bitwise)
{
    outcome ref = run_steps("eager", false, 1, 3, 2, 1.0);
    outcome o = run_steps("eager", false, 3, 3, 2, 1.0);
    assert_bitwise(&ref, &o, 2, "accum=3 K=3 vs K=1");
    outcome_free(&o);
    outcome_free(&ref);
}
END_TEST

/* Accumulating 3 micro-batches of 2 sequences gives the gradient of one batch of 6 (up to fp32
 * summation order), and the same loss. */
START_TEST(test_accumulation_matches_one_batch)
{
    for (int tied = 0; tied <= 1; tied++) {
        outcome one = run_steps_b("eager", tied, 2, 1, 1, 0.0, 6);
        outcome acc = run_steps_b("eager", tied, 2, 3, 1, 0.0, 2);
        ck_assert_msg(fabs(one.loss[0] - acc.loss[0]) <= 1e-6 * fabs(one.loss[0]), "loss %.9g vs %.9g", one.loss[0], acc.loss[0]);
        for (int i = 0; i < one.ntiles; i++) {
            double e = mt_test_rel_err_f32(acc.grad[i], one.grad[i], one.numel[i]);
            ck_assert_msg(e <= 1e-5, "tied=%d tile %d: accumulated gradient differs by %.3e", tied, i, e);
        }
        outcome_free(&acc);
        outcome_free(&one);
    }
}
END_TEST

/* AdamW split in a weights task and a moments task per chunk gives the fused update's bits, with
 * and without clipping, under a policy that runs the two halves far apart (megatrain puts the
 * moments half last) and one that does not. */
START_TEST(test_adamw_split_bitwise)
{
    const char *scheds[] = { "eager", "megatrain" };
    for (int k = 0; k < 2; k++)
        for (int clip = 0; clip <= 1; clip++) {
            split_mode = 0;
            outcome fused = run_steps(scheds[k], true, 2, 1, 3, clip ? 1.0 : 0.0);
            split_mode = 1;
            outcome split = run_steps(scheds[k], true, 2, 1, 3, clip ? 1.0 : 0.0);
            split_mode = -1; /* the default: some tiles split, some not */
            outcome mixed = run_steps(scheds[k], true, 2, 1, 3, clip ? 1.0 : 0.0);
            char what[64];
            snprintf(what, sizeof what, "split vs fused AdamW, %s, clip %d", scheds[k], clip);
            assert_bitwise(&fused, &split, 3, what);
            snprintf(what, sizeof what, "default vs fused AdamW, %s, clip %d", scheds[k], clip);
            assert_bitwise(&fused, &mixed, 3, what);
            outcome_free(&mixed);
            outcome_free(&split);
            outcome_free(&fused);
        }
}
END_TEST

/* Speculative clipping (each weights half run as its gradient lands, as if the scale were 1, and
 * redone after the norm only when the scale is below 1) gives the bits of the ordinary clipped
 * update: with a bound the norm stays under (the speculation holds every step; then also the
 * bits of no clipping) and with one it exceeds (it fails every step and is redone). */
START_TEST(test_clip_speculation_bitwise)
{
    const char *scheds[] = { "eager", "megatrain" };
    const double bounds[] = { 1e3, 1e-3 };
    for (int k = 0; k < 2; k++)
        for (int b = 0; b < 2; b++) {
            speculate_mode = 0;
            outcome plain = run_steps(scheds[k], true, 2, 1, 3, bounds[b]);
            speculate_mode = 1;
            outcome spec = run_steps(scheds[k], true, 2, 1, 3, bounds[b]);
            speculate_mode = -1;
            char what[80];
            snprintf(what, sizeof what, "speculative vs plain clipping at %g, %s", bounds[b], scheds[k]);
            assert_bitwise(&plain, &spec, 3, what);
            ck_assert_int_eq(plain.speculated, 0);
            ck_assert_int_eq(spec.speculated, 3);
            ck_assert_msg(spec.held == (b == 0 ? 3 : 0), "%s: speculation held %lld of 3 steps", what,
                          (long long)spec.held);
            if (b == 0) {
                outcome none = run_steps(scheds[k], true, 2, 1, 3, 0.0);
                assert_bitwise(&none, &spec, 3, "clipping at 1e3 vs none");
                outcome_free(&none);
            }
            outcome_free(&spec);
            outcome_free(&plain);
        }
    /* Untied: the table's gradient is zero before its embedding backward (filled, not written by
     * the head), with and without clipping. */
    for (int b = 0; b < 2; b++) {
        speculate_mode = 0;
        outcome plain = run_steps("megatrain", false, 2, 2, 3, bounds[b]);
        speculate_mode = 1;
        outcome spec = run_steps("megatrain", false, 2, 2, 3, bounds[b]);
        speculate_mode = -1;
        char what[80];
        snprintf(what, sizeof what, "untied, accum 2: speculative vs plain clipping at %g", bounds[b]);
        assert_bitwise(&plain, &spec, 3, what);
        outcome_free(&spec);
        outcome_free(&plain);
    }
    split_mode = 0;
    outcome fused = run_steps("megatrain", false, 2, 2, 3, 0.0);
    split_mode = -1;
    outcome early = run_steps("megatrain", false, 2, 2, 3, 0.0);
    assert_bitwise(&fused, &early, 3, "untied, accum 2, no clipping: early table update vs fused");
    outcome_free(&early);
    outcome_free(&fused);
    /* The default (-1) speculates once a norm within the bound has been read back: not on the
     * first step, whose loss is read after the second is submitted; from the third on. */
    outcome autom = run_steps("megatrain", true, 2, 1, 3, 1e3);
    ck_assert_msg(autom.speculated == 1 && autom.held == 1, "auto: speculated %lld, held %lld",
                  (long long)autom.speculated, (long long)autom.held);
    outcome_free(&autom);
}
END_TEST

/* Ranged speculation (bf16 streamed weights, clipping with a scale below 1): each chunk's weights
 * half runs as its gradient lands, for the range of scales the gradients already in and the last
 * norm allow; it flags the elements whose bf16 weight could differ within that range, and after
 * the norm only those are redone (all when the scale falls outside, or when the range was too
 * wide to try). Bitwise the plain clipped update in each case:
 * - the defaults (some chunks speculated, few elements flagged);
 * - a prediction taken as exact (spread 1 + 1e-9: the scale falls outside some ranges);
 * - a range limit only exact ranges meet (little speculated). */
START_TEST(test_clip_ranged_speculation_bitwise)
{
    state_dtype = MT_DTYPE_BF16;
    speculate_mode = 0;
    outcome plain = run_steps("megatrain", true, 2, 1, 6, 0.05);
    const struct { double spread, max_ratio; int check; const char *what; } cases[4] = {
        { 0, 0, -1, "defaults" }, { 1 + 1e-9, 1e9, 0, "exact prediction, not checked" },
        { 0, 1 + 1e-12, -1, "only exact ranges" }, { 1 + 1e-9, 1e9, 1, "exact prediction, checked" },
    };
    for (int r = 0; r < 4; r++) {
        speculate_mode = 2;
        speculate_range = cases[r].spread;
        speculate_range_max = cases[r].max_ratio;
        range_check_mode = cases[r].check;
        const mt_ranged_counts c0 = { 0 };
        outcome spec = run_steps("megatrain", true, 2, 1, 6, 0.05);
        const mt_ranged_counts c1 = spec.ranged; /* the run's graph counted from 0 */
        speculate_mode = -1;
        speculate_range = speculate_range_max = 0;
        range_check_mode = -1;
        const int64_t checked = c1.checked - c0.checked, flagged = c1.flagged - c0.flagged;
        const int64_t skipped = c1.skipped - c0.skipped, outside = c1.outside - c0.outside;
        const int64_t unheld = c1.unheld - c0.unheld;
        char what[80];
        snprintf(what, sizeof what, "ranged speculation (%s) vs plain clipping", cases[r].what);
        assert_bitwise(&plain, &spec, 6, what);
        printf("%s: %lld elements checked, %lld flagged, %lld not speculated (%lld as the last prediction missed), "
               "%lld redone whole\n", what, (long long)checked, (long long)flagged, (long long)skipped,
               (long long)unheld, (long long)outside);
        ck_assert_msg(spec.speculated == 6, "%s: speculated %lld of 6 steps", what, (long long)spec.speculated);
        if (r == 0) {
            /* step 1 has no last norm to predict from: its chunks are not speculated. (At this
             * test's learning rate of 1e-2 most bf16 weights move: a third is flagged.) */
            ck_assert(skipped > 0 && checked > 0 && flagged < checked && outside < checked);
        } else if (r == 1) {
            ck_assert(checked > 0 && outside > 0 && unheld == 0);
        } else if (r == 3) {
            /* a miss at one norm: that tile is not speculated at the next */
            ck_assert(checked > 0 && outside > 0 && unheld > 0);
        } else {
            /* only the embedding's ranges (the last tile in: the norm is known) are exact */
            ck_assert(skipped > checked);
        }
        outcome_free(&spec);
    }
    outcome_free(&plain);
    /* untied head, two micro-batches, the defaults */
    speculate_mode = 0;
    plain = run_steps("megatrain", false, 2, 2, 6, 0.05);
    speculate_mode = 2;
    outcome spec = run_steps("megatrain", false, 2, 2, 6, 0.05);
    speculate_mode = -1;
    assert_bitwise(&plain, &spec, 6, "ranged speculation vs plain clipping, untied, 2 micro-batches");
    outcome_free(&spec);
    outcome_free(&plain);
    state_dtype = MT_DTYPE_F32;
}
END_TEST

/* Deferred moments halves (adamw_defer 1, with ranged speculation): each update's
 * moments half of tiles 1.. runs in the next step's ranged run of the same chunk, the table's in
 * its next early path, on the gradient kept in the second buffer. Bitwise the plain clipped update and the ranged one
 * without deferral:
 * - over 5 steps (an odd number of gradient swaps), tied and untied with 2 micro-batches;
 * - with the mode switched after 3 ranged steps, to plain clipping (the pending moments then run
 *   before the next update) and to unit speculation;
 * - under eager too (no ordering from the policy: StarPU's dependencies alone), there with
 *   adamw_defer -1 (auto, the default), which must defer too.
 * The runs read the state after mt_graph_flush. */
START_TEST(test_clip_ranged_deferred_bitwise)
{
    state_dtype = MT_DTYPE_BF16;
    for (int tied = 0; tied <= 1; tied++) {
        const int accum = tied ? 1 : 2;
        speculate_mode = 0;
        outcome plain = run_steps("megatrain", tied, 2, accum, 5, 0.05);
        speculate_mode = 2;
        outcome ranged = run_steps("megatrain", tied, 2, accum, 5, 0.05);
        defer_mode = 1;
        outcome deferred = run_steps("megatrain", tied, 2, accum, 5, 0.05);
        defer_mode = -1; /* auto, the default: defers, the second gradient being small here */
        outcome eager = run_steps("eager", tied, 2, accum, 5, 0.05);
        defer_mode = 0;
        speculate_mode = -1;
        ck_assert(!plain.deferred && !ranged.deferred && deferred.deferred && eager.deferred);
        char what[96];
        snprintf(what, sizeof what, "deferred moments vs plain clipping, %s", tied ? "tied" : "untied, 2 micro-batches");
        assert_bitwise(&plain, &deferred, 5, what);
        snprintf(what, sizeof what, "deferred vs not, ranged, %s", tied ? "tied" : "untied");
        assert_bitwise(&ranged, &deferred, 5, what);
        snprintf(what, sizeof what, "deferred moments under eager vs plain, %s", tied ? "tied" : "untied");
        assert_bitwise(&plain, &eager, 5, what);
        outcome_free(&eager);
        outcome_free(&deferred);
        outcome_free(&ranged);
        outcome_free(&plain);
    }
    speculate_mode = 0;
    outcome plain = run_steps("megatrain", true, 2, 1, 6, 0.05);
    const int targets[2] = { 0, 1 };
    for (int k = 0; k < 2; k++) {
        speculate_mode = 2;
        defer_mode = 1;
        switch_step = 4;
        switch_to = targets[k];
        outcome sw = run_steps("megatrain", true, 2, 1, 6, 0.05);
        ck_assert(sw.deferred);
        switch_step = 0;
        defer_mode = 0;
        speculate_mode = -1;
        char what[96];
        snprintf(what, sizeof what, "deferred moments, then clip_speculate %d from step 4, vs plain", targets[k]);
        assert_bitwise(&plain, &sw, 6, what);
        outcome_free(&sw);
    }
    outcome_free(&plain);
    state_dtype = MT_DTYPE_F32;
}
END_TEST

START_TEST(test_policies_bitwise)
{
    outcome a = run_steps("eager", true, 2, 2, 3, 1.0);
    outcome b = run_steps("dmda", true, 2, 2, 3, 1.0);
    assert_bitwise(&a, &b, 3, "eager vs dmda");
    outcome m = run_steps("megatrain", true, 2, 2, 3, 1.0);
    assert_bitwise(&a, &m, 3, "eager vs megatrain");
    outcome_free(&m);
    outcome_free(&b);
    outcome_free(&a);
    outcome c = run_steps("eager", false, 2, 1, 3, 0.0);
    outcome d = run_steps("dmda", false, 2, 1, 3, 0.0);
    assert_bitwise(&c, &d, 3, "eager vs dmda, no clipping");
    outcome_free(&d);
    outcome_free(&c);
}
END_TEST

/* ---- gates ---------------------------------------------------------------------------------- */

enum { MAX_STEPS = 3, MAX_TILES = 16 };
typedef struct watch {
    pthread_mutex_t lock;
    bool seen[MT_EV_COUNT][MAX_STEPS + 1][MAX_TILES];
} watch;

static void observe(void *user, mt_event_kind kind, int64_t step, int tile)
{
    watch *w = user;
    pthread_mutex_lock(&w->lock);
    if (kind < MT_EV_COUNT && step >= 0 && step <= MAX_STEPS && tile >= 0 && tile < MAX_TILES)
        w->seen[kind][step][tile] = true;
    pthread_mutex_unlock(&w->lock);
}

static bool seen(watch *w, mt_event_kind kind, int64_t step, int tile)
{
    pthread_mutex_lock(&w->lock);
    bool s = w->seen[kind][step][tile];
    pthread_mutex_unlock(&w->lock);
    return s;
}

static bool seen_any(watch *w, mt_event_kind kind, int64_t step)
{
    bool any = false;
    for (int t = 0; t < MAX_TILES; t++) any |= seen(w, kind, step, t);
    return any;
}

/* Waits up to 60 s for an event; false on time-out. */
static bool wait_for(watch *w, mt_event_kind kind, int64_t step, int tile)
{
    for (int i = 0; i < 6000; i++) {
        if (seen(w, kind, step, tile)) return true;
        usleep(10000);
    }
    return false;
}

static void noop_cpu(void *buffers[], void *arg) { (void)buffers; (void)arg; }
static struct starpu_codelet gate_cl = { .cpu_funcs = { noop_cpu }, .nbuffers = 1, .modes = { STARPU_RW }, .name = "gate" };

/* A task that holds `h` (RW) until the test notifies `release`. */
static void submit_gate(starpu_data_handle_t h, starpu_tag_t gate, starpu_tag_t release)
{
    struct starpu_task *t = starpu_task_create();
    t->cl = &gate_cl;
    t->handles[0] = h;
    t->use_tag = 1;
    t->tag_id = gate;
    starpu_tag_declare_deps(gate, 1, release);
    ck_assert_int_eq(starpu_task_submit(t), 0);
}

typedef struct gated_run {
    mt_host_state *st;
    mt_graph *g;
    watch w;
    int32_t *tok, *tgt;
} gated_run;

static const char *gate_policy = "eager";

static void gated_setup(gated_run *r, double clip)
{
    start(gate_policy);
    mt_model_config cfg = tiny_config(false);
    char err[256];
    r->st = mt_state_create(&cfg, MT_DTYPE_F32, 0, err, sizeof err);
    ck_assert_msg(r->st != NULL, "%s", err);
    mt_state_init_random(r->st, 3, 0.05);
    mt_step_config sc = mt_step_defaults();
    sc.B = 2; sc.T = 9; sc.K = 2; sc.clip = clip;
    r->g = mt_graph_create(r->st, &sc, err, sizeof err);
    ck_assert_msg(r->g != NULL, "%s", err);
    memset(&r->w, 0, sizeof r->w);
    pthread_mutex_init(&r->w.lock, NULL);
    mt_graph_set_observer(r->g, observe, &r->w);
    r->tok = malloc(sizeof(int32_t) * 18);
    r->tgt = malloc(sizeof(int32_t) * 18);
    random_batch(5, 18, r->tok, r->tgt);
}

static void gated_teardown(gated_run *r)
{
    starpu_task_wait_for_all();
    mt_graph_destroy(r->g);
    mt_state_destroy(r->st);
    mt_runtime_shutdown();
    free(r->tok); free(r->tgt);
}

/* AdamW of layer j held: the next step's forward runs every layer before j, and not j. */
static void check_forward_waits_for_its_adamw(double clip)
{
    gated_run r;
    gated_setup(&r, clip);
    const int j = 3, tile_j = 1 + j;
    mt_graph_submit_compute(r.g, 1, r.tok, r.tgt);
    mt_graph_submit_norm(r.g);
    /* Before the update is submitted, so AdamW of layer j's first chunk queues behind it. */
    submit_gate(r.st->tiles[tile_j].h_master_chunk[0], 1001, 1002);
    mt_graph_submit_update(r.g, 1, 1e-3);
    mt_graph_submit_step(r.g, 2, r.tok, r.tgt, 1e-3);
    for (int i = 0; i < j; i++)
        ck_assert_msg(wait_for(&r.w, MT_EV_FORWARD, 2, 1 + i), "clip %g: forward of layer %d in step 2 did not complete while layer %d's AdamW was held", clip, i, j);
    usleep(300000);
    ck_assert_msg(!seen(&r.w, MT_EV_FORWARD_START, 2, tile_j), "clip %g: forward of layer %d in step 2 started before its AdamW", clip, j);
    ck_assert(!seen(&r.w, MT_EV_FORWARD_START, 2, tile_j + 1));
    starpu_tag_notify_from_apps(1002);
    ck_assert(wait_for(&r.w, MT_EV_FORWARD, 2, tile_j));
    ck_assert(wait_for(&r.w, MT_EV_BACKWARD, 2, 1));
    gated_teardown(&r);
}

START_TEST(test_gate_adamw_no_clip) { check_forward_waits_for_its_adamw(0.0); }
END_TEST

START_TEST(test_gate_adamw_clip) { check_forward_waits_for_its_adamw(1.0); }
END_TEST

/* The norm task held: no AdamW of the step and no forward of the next one may run. */
START_TEST(test_gate_norm_task)
{
    gated_run r;
    gated_setup(&r, 1.0);
    mt_graph_submit_compute(r.g, 1, r.tok, r.tgt);
    submit_gate(mt_graph_clip_handle(r.g), 2001, 2002);
    mt_graph_submit_norm(r.g);
    mt_graph_submit_update(r.g, 1, 1e-3);
    mt_graph_submit_step(r.g, 2, r.tok, r.tgt, 1e-3);
    ck_assert(wait_for(&r.w, MT_EV_BACKWARD, 1, 1));
    usleep(300000);
    ck_assert_msg(!seen_any(&r.w, MT_EV_ADAMW, 1), "an AdamW task ran before the global norm was known");
    ck_assert_msg(!seen_any(&r.w, MT_EV_FORWARD_START, 2), "a forward of step 2 ran before step 1's update");
    starpu_tag_notify_from_apps(2002);
    ck_assert(wait_for(&r.w, MT_EV_FORWARD, 2, 5));
    gated_teardown(&r);
}
END_TEST

/* Backward of layer 0 held. Without clipping the last layer's AdamW runs meanwhile (it needs
 * only its own gradient); with clipping no AdamW may. */
static void check_adamw_overlaps_backward(double clip)
{
    gated_run r;
    gated_setup(&r, clip);
    const int last = (int)r.st->cfg.layers; /* tile of the last layer */
    /* Submitted first, so layer 0's backward (which writes this gradient) queues behind it. */
    submit_gate(r.st->tiles[1].h_grad, 3001, 3002);
    mt_graph_submit_step(r.g, 1, r.tok, r.tgt, 1e-3);
    ck_assert(wait_for(&r.w, MT_EV_BACKWARD, 1, 2));
    if (clip == 0) {
        ck_assert_msg(wait_for(&r.w, MT_EV_ADAMW, 1, last), "without clipping, the last layer's AdamW did not run during the backward");
        ck_assert(!seen(&r.w, MT_EV_BACKWARD, 1, 1));
    } else {
        usleep(300000);
        ck_assert_msg(!seen_any(&r.w, MT_EV_ADAMW, 1), "with clipping, an AdamW task ran before the backward ended");
    }
    starpu_tag_notify_from_apps(3002);
    ck_assert(wait_for(&r.w, MT_EV_ADAMW, 1, 1));
    gated_teardown(&r);
}

START_TEST(test_adamw_overlaps_backward_without_clip) { check_adamw_overlaps_backward(0.0); }
END_TEST

START_TEST(test_no_adamw_during_backward_with_clip) { check_adamw_overlaps_backward(1.0); }
END_TEST

/* The same dependencies hold under the megatrain policy (CPU workers only here). */
START_TEST(test_gates_megatrain_policy)
{
    gate_policy = "megatrain";
    check_forward_waits_for_its_adamw(1.0);
    check_adamw_overlaps_backward(0.0);
    check_adamw_overlaps_backward(1.0);
    gate_policy = "eager";
}
END_TEST

/* The megatrain policy runs ready CPU tasks by priority, and those of equal priority first-in
 * first-out. StarPU's job ids (a natural tie-break) are all 0 without an FxT trace, so a sorted
 * insert that placed each new task in front of its equals would run them last-in first-out. One
 * CPU worker is held busy while three equal tasks queue; they must then run in submission
 * order. */
static atomic_int fifo_release, fifo_next, fifo_order[16];

static void fifo_blocker_cpu(void *buffers[], void *arg)
{
    (void)buffers; (void)arg;
    while (!atomic_load(&fifo_release)) usleep(1000);
}

static void fifo_record_cpu(void *buffers[], void *arg)
{
    (void)buffers;
    int id;
    starpu_codelet_unpack_args(arg, &id);
    fifo_order[atomic_fetch_add(&fifo_next, 1)] = id;
}

static struct starpu_codelet fifo_blocker_cl = { .cpu_funcs = { fifo_blocker_cpu }, .nbuffers = 0, .name = "blocker" };
static struct starpu_codelet fifo_record_cl = { .cpu_funcs = { fifo_record_cpu }, .nbuffers = 0, .name = "record" };

START_TEST(test_policy_fifo_for_equals)
{
    mt_runtime_options ro = mt_runtime_defaults();
    ro.sched = "megatrain";
    ro.ncpu = 1;
    ro.ncuda = 0;
    char err[256];
    ck_assert_msg(mt_runtime_init(&ro, err, sizeof err) == 0, "%s", err);
    atomic_store(&fifo_release, 0);
    atomic_store(&fifo_next, 0);
    ck_assert_int_eq(starpu_task_insert(&fifo_blocker_cl, 0), 0);
    usleep(100000); /* the worker has taken the blocker */
    for (int id = 0; id < 3; id++) ck_assert_int_eq(starpu_task_insert(&fifo_record_cl, STARPU_VALUE, &id, sizeof id, 0), 0);
    usleep(100000); /* all three are queued behind it */
    atomic_store(&fifo_release, 1);
    starpu_task_wait_for_all();
    ck_assert_int_eq(atomic_load(&fifo_next), 3);
    for (int i = 0; i < 3; i++) ck_assert_msg(fifo_order[i] == i, "run %d was task %d (order %d %d %d)", i, fifo_order[i],
                                              fifo_order[0], fifo_order[1], fifo_order[2]);

    /* Mixed priorities queued behind the blocker run highest first, equals in arrival order
     * (the CPU list keeps one group per priority). Task id = 10 * rank + arrival among equals. */
    atomic_store(&fifo_release, 0);
    atomic_store(&fifo_next, 0);
    ck_assert_int_eq(starpu_task_insert(&fifo_blocker_cl, 0), 0);
    usleep(100000);
    const int prio[10] = { 1, 7, 1, -3, 7, 4, 1, -3, 7, 4 };
    const int want[10] = { 1, 4, 8, 5, 9, 0, 2, 6, 3, 7 }; /* submission indices, in run order */
    for (int i = 0; i < 10; i++)
        ck_assert_int_eq(starpu_task_insert(&fifo_record_cl, STARPU_VALUE, &i, sizeof i, STARPU_PRIORITY, prio[i], 0), 0);
    usleep(100000);
    atomic_store(&fifo_release, 1);
    starpu_task_wait_for_all();
    ck_assert_int_eq(atomic_load(&fifo_next), 10);
    for (int i = 0; i < 10; i++)
        ck_assert_msg(fifo_order[i] == want[i], "run %d was task %d, not %d", i, fifo_order[i], want[i]);
    mt_runtime_shutdown();
}
END_TEST

/* Checkpoints with a host home (written through, marked as not used soon once the forward has
 * read them, prefetched from the end of each unit's first recompute) give the bits of those kept
 * where they were written: loss, gradients, weights and moments after three steps, K = 1 and 2
 * (three and two blocks of five layers), one and two micro-batches, under the megatrain policy
 * and eager, tied and untied. On CPU workers the home is where the compute runs, so this holds the
 * graph's order and its callbacks to the plain graph's results; the transfers themselves need a
 * GPU (tests/test_gpu_step.c). */
START_TEST(test_offload_checkpoints_bitwise)
{
    const struct { const char *sched; bool tied; int K, accum; } cases[] = {
        { "eager", true, 1, 1 }, { "eager", false, 2, 2 }, { "megatrain", true, 2, 1 }, { "megatrain", false, 1, 2 },
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        offload_mode = 0;
        outcome off = run_steps(cases[c].sched, cases[c].tied, cases[c].K, cases[c].accum, 3, 1.0);
        offload_mode = 1;
        outcome on = run_steps(cases[c].sched, cases[c].tied, cases[c].K, cases[c].accum, 3, 1.0);
        offload_mode = -1; /* auto: off here */
        outcome automatic = run_steps(cases[c].sched, cases[c].tied, cases[c].K, cases[c].accum, 3, 1.0);
        offload_mode = 0;
        char what[96];
        snprintf(what, sizeof what, "offloaded checkpoints, %s, tied %d, K=%d, accum %d", cases[c].sched,
                 cases[c].tied, cases[c].K, cases[c].accum);
        assert_bitwise(&off, &on, 3, what);
        assert_bitwise(&off, &automatic, 3, what);
        ck_assert(off.loss[0] > 4.0 && off.loss[0] < 7.0 && off.loss[2] != off.loss[0]);
        outcome_free(&automatic);
        outcome_free(&on);
        outcome_free(&off);
    }
}
END_TEST

/* The memory plan counts exactly the working buffers the graph registers, for several shapes. */
/* ||a - b|| / ||b|| over n floats */
static double rel_diff(const float *a, const float *b, int64_t n)
{
    double d = 0, r = 0;
    for (int64_t i = 0; i < n; i++) {
        d += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        r += (double)b[i] * b[i];
    }
    return r > 0 ? sqrt(d / r) : sqrt(d);
}

/* Data parallelism over the devices of one process, the CPU workers as the devices: micro-batch
 * u writes device u mod 2's copy of every gradient, summed in device order before the norm and
 * AdamW. The order of the sums differs from one device's ((u0 + u2) + (u1 + u3) against
 * ((u0 + u1) + u2) + u3), so not bit for bit: the first step's summed gradients within 1e-6 of
 * the one-device graph's per tensor (measured: at most 1.5e-7), and the losses of three steps
 * within 1e-6 (AdamW's first update is lr x sign(g), so a gradient element near zero may flip the
 * weight's step: weights are compared through the losses); clipped and not, tied and untied; and
 * bit for bit from one run to the next, under another policy. */
START_TEST(test_devices_match_one_device)
{
    const double clips[2] = { 0.0, 1.0 };
    for (int tied = 0; tied <= 1; tied++)
        for (int c = 0; c < 2; c++) {
            devices_mode = 0;
            outcome one1 = run_steps("eager", tied, 2, 4, 1, clips[c]);
            outcome one = run_steps("eager", tied, 2, 4, 3, clips[c]);
            devices_mode = 2;
            outcome two1 = run_steps("eager", tied, 2, 4, 1, clips[c]);
            outcome two = run_steps("eager", tied, 2, 4, 3, clips[c]);
            outcome again = run_steps("megatrain", tied, 2, 4, 3, clips[c]);
            devices_mode = 0;
            assert_bitwise(&two, &again, 3, "devices, again");
            /* Each device's first and last micro-batches carry the policy's prefetch hints, which
             * prefetch to the memory node of the device that runs them: both devices see as many
             * (4 micro-batches, 2 each). */
            ck_assert_msg(again.hinted[0] > 0 && again.hinted[0] == again.hinted[1],
                          "tied %d clip %g: hinted tasks %lld on device 0, %lld on device 1", tied, clips[c],
                          again.hinted[0], again.hinted[1]);
            for (int s = 0; s < 3; s++)
                ck_assert_msg(fabs(two.loss[s] - one.loss[s]) <= 1e-6 * fabs(one.loss[s]),
                              "tied %d clip %g: loss of step %d %.9g vs %.9g", tied, clips[c], s + 1, two.loss[s], one.loss[s]);
            double worst = 0;
            for (int i = 0; i < one1.ntiles; i++) {
                const double e = rel_diff(two1.grad[i], one1.grad[i], one1.numel[i]);
                ck_assert_msg(e <= 1e-6, "tied %d clip %g: tile %d's gradient differs by %.3g relative", tied, clips[c], i, e);
                if (e > worst) worst = e;
            }
            printf("devices: tied %d clip %g: the first step's gradients within %.3g relative\n", tied, clips[c], worst);
            outcome_free(&one1);
            outcome_free(&one);
            outcome_free(&two1);
            outcome_free(&two);
            outcome_free(&again);
        }
}
END_TEST

/* Three and five devices (as many CPU workers), their copies summed in a tree: with three,
 * g_0 + (g_1 + g_2); with five, g_0 + ((g_1 + g_2) + (g_3 + g_4)). Two micro-batches per device
 * against one device's: the first step's gradients within 1e-6 per tensor and three clipped steps'
 * losses within 1e-6 relative, as for two; bit for bit again. */
START_TEST(test_more_devices_match_one_device)
{
    const int counts[2] = { 3, 5 };
    for (int c = 0; c < 2; c++) {
        const int n = counts[c], accum = 2 * n;
        start_ncpu = n;
        devices_mode = 0;
        outcome one1 = run_steps("eager", true, 2, accum, 1, 1.0);
        outcome one = run_steps("eager", true, 2, accum, 3, 1.0);
        devices_mode = n;
        outcome many1 = run_steps("eager", true, 2, accum, 1, 1.0);
        outcome many = run_steps("eager", true, 2, accum, 3, 1.0);
        outcome again = run_steps("megatrain", true, 2, accum, 3, 1.0);
        devices_mode = 0;
        start_ncpu = 2;
        assert_bitwise(&many, &again, 3, "devices, again");
        for (int s = 0; s < 3; s++)
            ck_assert_msg(fabs(many.loss[s] - one.loss[s]) <= 1e-6 * fabs(one.loss[s]), "%d devices: loss of step %d %.9g vs %.9g",
                          n, s + 1, many.loss[s], one.loss[s]);
        double worst = 0;
        for (int i = 0; i < one1.ntiles; i++) {
            const double e = rel_diff(many1.grad[i], one1.grad[i], one1.numel[i]);
            ck_assert_msg(e <= 1e-6, "%d devices: tile %d's gradient differs by %.3g relative", n, i, e);
            if (e > worst) worst = e;
        }
        printf("%d devices: the first step's gradients within %.3g relative\n", n, worst);
        outcome_free(&one1);
        outcome_free(&one);
        outcome_free(&many1);
        outcome_free(&many);
        outcome_free(&again);
    }
}
END_TEST

/* Two devices and one micro-batch a step: device 1 idles, device 0's copy alone is the gradient,
 * copied into the tile's: bit for bit one device's run. */
START_TEST(test_idle_device_matches_one_device)
{
    devices_mode = 0;
    outcome one = run_steps("eager", true, 2, 1, 3, 1.0);
    devices_mode = 2;
    outcome two = run_steps("eager", true, 2, 1, 3, 1.0);
    devices_mode = 0;
    assert_bitwise(&one, &two, 3, "an idle device");
    outcome_free(&one);
    outcome_free(&two);
}
END_TEST

/* What a graph over `devices` devices and `accum` micro-batches logs of them (mt_graph_log_devices),
 * to free(). */
static char *devices_log(int devices, int accum)
{
    start("eager");
    mt_model_config cfg = tiny_config(true);
    char err[256];
    mt_host_state *st = mt_state_create(&cfg, MT_DTYPE_F32, 700, err, sizeof err);
    ck_assert_msg(st != NULL, "%s", err);
    mt_step_config sc = mt_step_defaults();
    sc.B = 2; sc.T = 9; sc.K = 2; sc.accum = accum; sc.head_chunk = 7; sc.devices = devices;
    mt_graph *g = mt_graph_create(st, &sc, err, sizeof err);
    ck_assert_msg(g != NULL, "%s", err);
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    mt_graph_log_devices(g, f, "test");
    fclose(f);
    mt_graph_destroy(g);
    mt_state_destroy(st);
    mt_runtime_shutdown();
    return text;
}

/* Over several devices the run says how the micro-batches go, and warns when --accum leaves a
 * device idle or loads them unevenly; over one it says nothing. */
START_TEST(test_devices_logged)
{
    char *one = devices_log(0, 2), *idle = devices_log(2, 1), *uneven = devices_log(2, 3), *even = devices_log(2, 4);
    ck_assert_str_eq(one, "");
    const char *line = "test: 2 devices: micro-batch u on device u mod 2, the gradients summed on the devices into device 0's\n";
    ck_assert_msg(strncmp(even, line, strlen(line)) == 0 && !strstr(even, "warning"), "%s", even);
    ck_assert_msg(strstr(idle, "test: warning: 1 micro-batch a step for 2 devices: 1 of them compute nothing (--accum 2, or "
                               "a multiple of it, uses them all)\n") != NULL, "%s", idle);
    ck_assert_msg(strstr(uneven, "test: warning: 3 micro-batches a step over 2 devices: 1 of them compute one more than "
                                 "the others (--accum a multiple of 2 balances them)\n") != NULL, "%s", uneven);
    free(one);
    free(idle);
    free(uneven);
    free(even);
}
END_TEST

START_TEST(test_plan_matches_graph)
{
    start("eager");
    const struct { bool tied; int64_t B, T; int K, accum; } cases[] = { {true, 2, 8, 2, 1}, {false, 3, 16, 3, 2}, {true, 1, 33, 5, 3} };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        mt_model_config cfg = tiny_config(cases[c].tied);
        char err[256];
        mt_host_state *st = mt_state_create(&cfg, MT_DTYPE_F32, 0, err, sizeof err);
        ck_assert_msg(st != NULL, "%s", err);
        for (int offload = 0; offload <= 1; offload++) {
            mt_step_config sc = mt_step_defaults();
            sc.B = cases[c].B; sc.T = cases[c].T; sc.K = cases[c].K; sc.accum = cases[c].accum;
            sc.offload_checkpoints = offload;
            mt_graph *g = mt_graph_create(st, &sc, err, sizeof err);
            ck_assert_msg(g != NULL, "%s", err);
            mt_plan_params pp = { .micro_batch = sc.B, .seq_len = sc.T, .grad_accum = sc.accum,
                                  .checkpoint_interval = sc.K, .compute = MT_DTYPE_F32, .use_gpu = false,
                                  .head_chunk = sc.head_chunk, .offload_checkpoints = offload };
            mt_plan plan;
            ck_assert_msg(mt_plan_compute(&cfg, &pp, &plan) == 0, "%s", plan.error);
            uint64_t planned = mt_plan_activation_bytes(&plan) - plan.host[MT_PLAN_INPUTS];
            ck_assert_msg(mt_graph_working_bytes(g) == planned, "case %zu offload %d: graph %llu bytes, plan %llu", c,
                          offload, (unsigned long long)mt_graph_working_bytes(g), (unsigned long long)planned);
            mt_graph_destroy(g);
        }
        mt_state_destroy(st);
    }
    mt_runtime_shutdown();
}
END_TEST

START_TEST(test_bad_step_config)
{
    start("eager");
    mt_model_config cfg = tiny_config(true);
    char err[256];
    mt_host_state *st = mt_state_create(&cfg, MT_DTYPE_F32, 0, err, sizeof err);
    mt_step_config sc = mt_step_defaults();
    sc.B = 1; sc.T = 8; sc.K = 6; /* more than the 5 layers */
    ck_assert(mt_graph_create(st, &sc, err, sizeof err) == NULL);
    ck_assert_msg(strstr(err, "K=6") != NULL, "%s", err);
    sc.K = 2; sc.offload_checkpoints = 2; /* auto -1, off 0, on 1 */
    ck_assert(mt_graph_create(st, &sc, err, sizeof err) == NULL);
    ck_assert_msg(strstr(err, "offload_checkpoints=2") != NULL, "%s", err);
    sc.offload_checkpoints = -1;
    sc.K = 2; sc.T = 65; /* beyond max_position_embeddings 64 */
    ck_assert(mt_graph_create(st, &sc, err, sizeof err) == NULL);
    ck_assert_msg(strstr(err, "max_position_embeddings") != NULL, "%s", err);
    mt_state_destroy(st);
    cfg.sliding_window = 16; /* as Mistral v0.1's 4096, smaller */
    st = mt_state_create(&cfg, MT_DTYPE_F32, 0, err, sizeof err);
    sc.T = 17;
    ck_assert(mt_graph_create(st, &sc, err, sizeof err) == NULL);
    ck_assert_msg(strstr(err, "sliding_window 16") != NULL, "%s", err);
    sc.T = 16; /* up to the window, full causal attention is the window's */
    mt_graph *g = mt_graph_create(st, &sc, err, sizeof err);
    ck_assert_msg(g != NULL, "%s", err);
    mt_graph_destroy(g);
    mt_state_destroy(st);
    mt_runtime_shutdown();
}
END_TEST

int main(void)
{
    Suite *s = suite_create("step");
    TCase *tc = tcase_create("graph");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_recompute_any_k_bitwise);
    tcase_add_test(tc, test_recompute_with_accumulation_bitwise);
    tcase_add_test(tc, test_accumulation_matches_one_batch);
    tcase_add_test(tc, test_policies_bitwise);
    tcase_add_test(tc, test_adamw_split_bitwise);
    tcase_add_test(tc, test_clip_speculation_bitwise);
    tcase_add_test(tc, test_clip_ranged_speculation_bitwise);
    tcase_add_test(tc, test_clip_ranged_deferred_bitwise);
    tcase_add_test(tc, test_gate_adamw_no_clip);
    tcase_add_test(tc, test_gate_adamw_clip);
    tcase_add_test(tc, test_gate_norm_task);
    tcase_add_test(tc, test_adamw_overlaps_backward_without_clip);
    tcase_add_test(tc, test_no_adamw_during_backward_with_clip);
    tcase_add_test(tc, test_gates_megatrain_policy);
    tcase_add_test(tc, test_plan_matches_graph);
    tcase_add_test(tc, test_offload_checkpoints_bitwise);
    tcase_add_test(tc, test_policy_fifo_for_equals);
    tcase_add_test(tc, test_bad_step_config);
    suite_add_tcase(s, tc);
    TCase *dev = tcase_create("devices");
    tcase_set_timeout(dev, 600);
    tcase_add_test(dev, test_devices_match_one_device);
    tcase_add_test(dev, test_more_devices_match_one_device);
    tcase_add_test(dev, test_devices_logged);
    tcase_add_test(dev, test_idle_device_matches_one_device);
    suite_add_tcase(s, dev);
    return mt_test_run(s, false);
}
