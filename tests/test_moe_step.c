/* Check suite of the step graph on mixture-of-experts models beyond the plain sparse stack
 * (docs/moe.md): the router's load-balancing loss inside the step (its value added to the step's
 * loss, its gradient to the step's gradients), and models whose dense and sparse layers mix
 * (mlp_only_layers, decoder_sparse_step). The whole model's loss and gradients are checked against
 * a double reference and its central differences (fp32 and bf16 streamed weights); the mixed
 * models also through an HF round trip and a checkpoint resume, bit for bit. CPU workers; sizes
 * deliberately not multiples of 8. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backends/cpu/ops.h"
#include "models/config.h"
#include "models/layout.h"
#include "models/util.h"
#include "runtime/checkpoint.h"
#include "runtime/plan.h"
#include "runtime/state.h"
#include "runtime/step.h"
#include "runtime/train.h"
#include "runtime/train_checks.h"
#include "tests/moe_util.h"
#include "tests/testutil.h"

enum { SB = 2, ST = 5, ACCUM = 2, SN = SB * ST };

/* A 3-layer qwen3_moe and a 2-layer mixtral; the tests append keys. */
#define QWEN3_STEP                                                                                       \
    "{\"model_type\": \"qwen3_moe\", \"hidden_size\": 20, \"intermediate_size\": 27, \"num_hidden_layers\": 3," \
    " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 6, \"vocab_size\": 29,"     \
    " \"max_position_embeddings\": 64, \"num_experts\": 5, \"num_experts_per_tok\": 2,"                  \
    " \"moe_intermediate_size\": 7, \"norm_topk_prob\": true"
#define MIXTRAL_STEP                                                                                     \
    "{\"model_type\": \"mixtral\", \"hidden_size\": 20, \"intermediate_size\": 9, \"num_hidden_layers\": 2," \
    " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 6, \"vocab_size\": 29,"     \
    " \"max_position_embeddings\": 64, \"num_local_experts\": 4"

static mt_model_config step_config(const char *base, const char *extra)
{
    char json[2048];
    snprintf(json, sizeof json, "%s%s}", base, extra);
    return parse_ok(json, "step");
}

/* A step's fresh random tokens and targets (every seventh target ignored). */
static int64_t fill_batch(mt_test_rng *rng, int64_t vocab, int32_t *tokens, int32_t *targets)
{
    int64_t counted = 0;
    for (int i = 0; i < ACCUM * SN; i++) {
        tokens[i] = (int32_t)(mt_test_uniform(rng) * (double)vocab);
        targets[i] = i % 7 == 3 ? -1 : (int32_t)(mt_test_uniform(rng) * (double)vocab);
        counted += targets[i] >= 0;
    }
    return counted;
}

static mt_graph *step_graph(mt_host_state *st, double clip)
{
    mt_step_config sc = mt_step_defaults();
    sc.B = SB; sc.T = ST; sc.K = 2; sc.accum = ACCUM; sc.clip = clip; sc.head_chunk = 3;
    char err[512] = "";
    mt_graph *g = mt_graph_create(st, &sc, err, sizeof err);
    ck_assert_msg(g != NULL, "%s", err);
    return g;
}

/* ------------------------------------------------------------------------------------------ */
/* The reference: the whole model in double, written from the step's definition.              */

typedef struct ref_model {
    const mt_host_state *st;   /* the layouts */
    double **tiles;            /* (ntiles) the state's streamed weights, widened */
    const int32_t *tokens, *targets;
    int64_t counted;
    double coef;               /* the load-balancing loss's coefficient, 0: off */
    double *x, *y, *scratch, *stats;
    double ce, aux;            /* the last evaluation's parts: mean cross-entropy, mean aux */
} ref_model;

/* The step's objective: the cross-entropy over every counted target of the step, plus coef x the
 * mean over the micro-batches of transformers' load_balancing_loss_func over that micro-batch's
 * router rows (its tokens x the sparse layers, pooled): E sum_e (c_e / R)(P_e / R). */
static double ref_loss(void *arg)
{
    ref_model *m = arg;
    const mt_model_config *cfg = &m->st->cfg;
    const int64_t L = cfg->layers, E = cfg->experts, R = SN * mt_config_sparse_layers(cfg);
    double ce = 0, aux = 0;
    for (int u = 0; u < ACCUM; u++) {
        mt_cpu_embedding_forward_f64(SN, cfg->hidden, m->tiles[0], m->tokens + u * SN, m->x);
        memset(m->stats, 0, sizeof(double) * 2 * (size_t)(E > 0 ? E : 1));
        for (int64_t l = 0; l < L; l++) {
            const bool sparse = mt_config_layer_is_sparse(cfg, l);
            ck_assert(sparse == mt_layout_is_sparse(m->st->tiles[l + 1].layout));
            mt_cpu_layer_forward_aux_f64(cfg, m->st->tiles[l + 1].layout, m->tiles[l + 1], l, SB, ST, m->x, m->y, NULL,
                                         m->scratch, sparse ? m->stats : NULL);
            double *t = m->x; m->x = m->y; m->y = t;
        }
        int64_t c;
        ce += mt_cpu_head_f64(cfg, m->st->tiles[L + 1].layout, m->tiles[L + 1], m->tiles[0], SN, m->x,
                              m->targets + u * SN, 1.0, SN, NULL, NULL, NULL, m->scratch, &c);
        double balance = 0;
        for (int64_t e = 0; e < E; e++) balance += (m->stats[e] / (double)R) * (m->stats[E + e] / (double)R);
        aux += (double)E * balance;
    }
    m->ce = ce / (double)m->counted;
    m->aux = aux / ACCUM;
    return m->ce + m->coef * m->aux;
}

static ref_model ref_create(const mt_host_state *st, const int32_t *tokens, const int32_t *targets, int64_t counted)
{
    const mt_model_config *cfg = &st->cfg;
    ref_model m = { .st = st, .tokens = tokens, .targets = targets, .counted = counted,
                    .coef = mt_config_router_aux_coef(cfg) };
    m.tiles = mt_xmalloc(sizeof(double *) * (size_t)st->ntiles);
    for (int i = 0; i < st->ntiles; i++) {
        const mt_tile *t = &st->tiles[i];
        if (st->compute_dtype == MT_DTYPE_BF16) {
            float *w = mt_xmalloc(sizeof(float) * (size_t)t->numel);
            mt_bf16_to_f32(t->numel, t->weights, w);
            m.tiles[i] = mt_test_to_f64(w, t->numel);
            free(w);
        } else {
            m.tiles[i] = mt_test_to_f64(t->weights, t->numel);
        }
    }
    int64_t scratch_n = mt_layer_scratch_numel(cfg, SB, ST);
    if (mt_head_scratch_numel(cfg, SN) > scratch_n) scratch_n = mt_head_scratch_numel(cfg, SN);
    m.x = mt_test_alloc_f64(SN * cfg->hidden);
    m.y = mt_test_alloc_f64(SN * cfg->hidden);
    m.scratch = mt_test_alloc_f64(scratch_n);
    m.stats = mt_test_alloc_f64(2 * (cfg->experts > 0 ? cfg->experts : 1));
    return m;
}

static void ref_destroy(ref_model *m)
{
    for (int i = 0; i < m->st->ntiles; i++) free(m->tiles[i]);
    free(m->tiles); free(m->x); free(m->y); free(m->scratch); free(m->stats);
}

#define PICKS 10       /* entries per tensor checked against central differences */
#define FD_H 1e-5      /* five-point differences: truncation ~h^4, rounding ~1e-16 / h */
#define GRAD_TOL 1e-5  /* ||step - fd|| / ||fd|| per tile: the step computes in fp32 */

/* One step of the graph (clip off: its gradients as computed) with streamed weights of `dtype`
 * against the reference at those weights: the loss within 1e-6, and every tile's gradient, at
 * PICKS entries of each tensor, against central differences of the reference's objective (the
 * step computes in fp32 either way). Returns the reference's aux (mean per micro-batch). */
static double check_whole_model(const mt_model_config *cfg, uint64_t seed, mt_dtype dtype)
{
    char err[512] = "";
    mt_host_state *st = mt_state_create(cfg, dtype, 0, err, sizeof err);
    ck_assert_msg(st != NULL, "%s", err);
    mt_state_init_random(st, seed, 0.3);
    mt_graph *g = step_graph(st, 0);
    mt_test_rng rng;
    mt_test_rng_seed(&rng, seed + 1000);
    int32_t tokens[ACCUM * SN], targets[ACCUM * SN];
    const int64_t counted = fill_batch(&rng, cfg->vocab, tokens, targets);
    const double loss = mt_graph_wait_loss(g, mt_graph_submit_compute(g, 1, tokens, targets), NULL);
    starpu_task_wait_for_all();

    ref_model m = ref_create(st, tokens, targets, counted);
    const double want = ref_loss(&m);
    const double ce = m.ce, aux = m.aux;
    fprintf(stderr, "%s, %lld sparse of %lld layers, coef %g: step loss %.9f, reference %.9f (cross-entropy %.9f, "
            "aux %.9f)\n", cfg->model_type, (long long)mt_config_sparse_layers(cfg), (long long)cfg->layers, m.coef,
            loss, want, ce, aux);
    ck_assert_msg(fabs(loss - want) <= 1e-6 * fabs(want), "loss %.9g, reference %.9g", loss, want);
    for (int i = 0; i < st->ntiles; i++) {
        const mt_tile *t = &st->tiles[i];
        double num = 0, den = 0;
        for (int s = 0; s < t->layout->ntensors; s++) {
            const mt_tensor_desc *d = &t->layout->tensors[s];
            for (int j = 0; j < PICKS && j < d->numel; j++) {
                const int64_t at = d->offset + (int64_t)j * d->numel / PICKS + (j * 7919) % (d->numel / PICKS + 1);
                double *x = &m.tiles[i][at];
                const double keep = *x;
                double f[4];
                const double steps[4] = { -2, -1, 1, 2 };
                for (int k = 0; k < 4; k++) {
                    *x = keep + steps[k] * FD_H;
                    f[k] = ref_loss(&m);
                }
                *x = keep;
                const double fd = (8 * (f[2] - f[1]) - (f[3] - f[0])) / (12 * FD_H);
                num += (t->grad[at] - fd) * (t->grad[at] - fd);
                den += fd * fd;
            }
        }
        const double e = den > 0 ? sqrt(num / den) : sqrt(num);
        fprintf(stderr, "  tile %d gradient against central differences: rel err %.3e\n", i, e);
        ck_assert_msg(den > 0 && e <= GRAD_TOL, "tile %d: gradient rel err %.3e (|fd| %.3e)", i, e, sqrt(den));
    }
    ref_destroy(&m);
    mt_graph_destroy(g);
    mt_state_destroy(st);
    return aux;
}

/* ------------------------------------------------------------------------------------------ */
/* 1) The load-balancing loss in the step.                                                     */

/* A large coefficient, so that a missing or misweighted aux term fails the check by far more
 * than the tolerance. */
START_TEST(test_aux_qwen3_moe)
{
    const mt_model_config cfg =
        step_config(QWEN3_STEP, ", \"output_router_logits\": true, \"router_aux_loss_coef\": 0.7");
    const double aux = check_whole_model(&cfg, 31, MT_DTYPE_F32);
    ck_assert(aux > 0.5); /* k = 2 of E = 5 balanced gives 2 */
}
END_TEST

START_TEST(test_aux_mixtral)
{
    const mt_model_config cfg =
        step_config(MIXTRAL_STEP, ", \"output_router_logits\": true, \"router_aux_loss_coef\": 0.9");
    const double aux = check_whole_model(&cfg, 32, MT_DTYPE_F32);
    ck_assert(aux > 0.5);
}
END_TEST

/* Run's override of the config, and the coefficient 0: the loss and gradients of the plain
 * step, bit for bit. */
START_TEST(test_aux_off_is_plain)
{
    mt_model_config cfgs[4] = {
        step_config(QWEN3_STEP, ""),
        step_config(QWEN3_STEP, ", \"output_router_logits\": true, \"router_aux_loss_coef\": 0"),
        step_config(QWEN3_STEP, ", \"output_router_logits\": true, \"router_aux_loss_coef\": 0.3"),
        step_config(QWEN3_STEP, ", \"router_aux_loss_coef\": 0.3"),
    };
    cfgs[2].router_aux = MT_ROUTER_AUX_OFF;  /* --router-aux-loss 0 */
    cfgs[3].router_aux = MT_ROUTER_AUX_ON;   /* --router-aux-loss 0.3 on a config without it */
    double loss[4];
    float *grads[4][8];
    for (int c = 0; c < 4; c++) {
        char err[512] = "";
        mt_host_state *st = mt_state_create(&cfgs[c], MT_DTYPE_F32, 0, err, sizeof err);
        ck_assert_msg(st != NULL, "%s", err);
        ck_assert_int_le(st->ntiles, 8);
        mt_state_init_random(st, 41, 0.3);
        mt_graph *g = step_graph(st, 0);
        mt_test_rng rng;
        mt_test_rng_seed(&rng, 42);
        int32_t tokens[ACCUM * SN], targets[ACCUM * SN];
        fill_batch(&rng, cfgs[c].vocab, tokens, targets);
        loss[c] = mt_graph_wait_loss(g, mt_graph_submit_compute(g, 1, tokens, targets), NULL);
        starpu_task_wait_for_all();
        for (int i = 0; i < st->ntiles; i++) {
            grads[c][i] = mt_xmalloc(sizeof(float) * (size_t)st->tiles[i].numel);
            memcpy(grads[c][i], st->tiles[i].grad, sizeof(float) * (size_t)st->tiles[i].numel);
        }
        fprintf(stderr, "aux off/on case %d: loss %.9f\n", c, loss[c]);
        if (c > 0)
            for (int i = 0; i < st->ntiles; i++) {
                const bool same = !memcmp(grads[0][i], grads[c][i], sizeof(float) * (size_t)st->tiles[i].numel);
                ck_assert_msg(c == 3 ? true : same, "case %d: tile %d's gradient differs from the plain step's", c, i);
            }
        if (c == 3) {
            /* on: the router's gradient moves, the loss grows by coef x aux */
            const mt_tile *t = &st->tiles[1];
            const mt_tensor_desc *r = &t->layout->tensors[MT_L_ROUTER_W];
            ck_assert(memcmp(grads[0][1] + r->offset, grads[3][1] + r->offset, sizeof(float) * (size_t)r->numel));
        }
        mt_graph_destroy(g);
        mt_state_destroy(st);
    }
    ck_assert_msg(!memcmp(&loss[0], &loss[1], sizeof loss[0]) && !memcmp(&loss[0], &loss[2], sizeof loss[0]),
                  "losses %.17g %.17g %.17g", loss[0], loss[1], loss[2]);
    ck_assert_msg(loss[3] > loss[0] + 0.3 * 0.5, "with the loss on %.9f, off %.9f", loss[3], loss[0]);
    for (int c = 0; c < 4; c++)
        for (int i = 0; i < (int)cfgs[c].layers + 2; i++) free(grads[c][i]);
}
END_TEST

/* --router-aux-loss goes into the checkpoint's settings: a resume with another value is refused
 * naming it, unless allowed. */
START_TEST(test_aux_setting_resumes)
{
    mt_train_options o = mt_train_defaults();
    char was[8192], is[8192], err[1024] = "";
    o.router_aux_loss = 0.01;
    mt_train_settings(&o, "text", was, sizeof was);
    ck_assert(strstr(was, "router-aux-loss=0.01") != NULL);
    ck_assert_int_eq(mt_train_check_settings(&o, "ck", was, was, NULL, err, sizeof err), 0);
    o.router_aux_loss = -1;
    mt_train_settings(&o, "text", is, sizeof is);
    ck_assert(strstr(is, "router-aux-loss=the config's") != NULL);
    ck_assert_int_eq(mt_train_check_settings(&o, "ck", was, is, NULL, err, sizeof err), -1);
    fprintf(stderr, "  refused: %s\n", err);
    ck_assert_msg(strstr(err, "router-aux-loss") && strstr(err, "0.01"), "'%s'", err);
    o.allow_changed = "router-aux-loss";
    ck_assert_int_eq(mt_train_check_settings(&o, "ck", was, is, NULL, err, sizeof err), 0);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* 2) Dense and sparse layers in one model.                                                    */

static const char *const mixed_extras[2] = { ", \"mlp_only_layers\": [0]", ", \"decoder_sparse_step\": 2" };

START_TEST(test_mixed_whole_model)
{
    for (int c = 0; c < 2; c++) {
        const mt_model_config cfg = step_config(QWEN3_STEP, mixed_extras[c]);
        ck_assert(mt_config_has_dense_layers(&cfg) && mt_config_sparse_layers(&cfg) > 0);
        check_whole_model(&cfg, 51 + (uint64_t)c, MT_DTYPE_F32);
        /* and with the load-balancing loss, whose rows are those of the sparse layers only */
        char extra[256];
        snprintf(extra, sizeof extra, "%s, \"output_router_logits\": true, \"router_aux_loss_coef\": 0.6", mixed_extras[c]);
        const mt_model_config aux = step_config(QWEN3_STEP, extra);
        check_whole_model(&aux, 53 + (uint64_t)c, MT_DTYPE_F32);
    }
}
END_TEST

/* bf16 streamed weights, whose CPU tasks widen a layer's tile into their scratch: with a dense
 * layer larger than the sparse ones, that room is the larger tile's. */
START_TEST(test_mixed_bf16_dense_larger)
{
    const mt_model_config cfg = step_config(
        "{\"model_type\": \"qwen3_moe\", \"hidden_size\": 20, \"intermediate_size\": 200, \"num_hidden_layers\": 3,"
        " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 6, \"vocab_size\": 29,"
        " \"max_position_embeddings\": 64, \"num_experts\": 5, \"num_experts_per_tok\": 2, \"moe_intermediate_size\": 7",
        ", \"mlp_only_layers\": [2], \"output_router_logits\": true");
    mt_tile_layout dense, sparse;
    mt_layout_build_layer(&cfg, 2, &dense);
    mt_layout_build_layer(&cfg, 0, &sparse);
    ck_assert(dense.numel > sparse.numel && mt_layout_largest_layer_numel(&cfg) == dense.numel);
    check_whole_model(&cfg, 57, MT_DTYPE_BF16);
}
END_TEST

/* The plan of a mixed model counts each host tile at its own layer's size, as the host state
 * allocates them, and sizes the GPU's layer buffers by the larger layer. */
START_TEST(test_mixed_plan_bytes)
{
    const mt_model_config cfg = step_config(
        "{\"model_type\": \"qwen3_moe\", \"hidden_size\": 20, \"intermediate_size\": 200, \"num_hidden_layers\": 3,"
        " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 6, \"vocab_size\": 29,"
        " \"max_position_embeddings\": 64, \"num_experts\": 5, \"num_experts_per_tok\": 2, \"moe_intermediate_size\": 7",
        ", \"mlp_only_layers\": [2]");
    char err[512];
    mt_host_state *st = mt_state_create(&cfg, MT_DTYPE_F32, 0, err, sizeof err);
    ck_assert_msg(st, "%s", err);
    uint64_t want = 0;
    for (int i = 0; i < st->ntiles; i++)
        want += ((uint64_t)st->tiles[i].numel * 4 + MT_PLAN_TILE_BYTES_ALIGN - 1) / MT_PLAN_TILE_BYTES_ALIGN *
                MT_PLAN_TILE_BYTES_ALIGN;
    mt_plan_params p = { .micro_batch = 2, .seq_len = 8, .grad_accum = 1, .checkpoint_interval = 1,
                         .compute = MT_DTYPE_F32, .use_gpu = false };
    mt_plan plan;
    ck_assert_msg(mt_plan_compute(&cfg, &p, &plan) == 0, "%s", plan.error);
    ck_assert_uint_eq(plan.host[MT_PLAN_MASTER], want);
    ck_assert_int_eq(plan.dense_layers, 1);
    /* the dense layer (intermediate 200) is the largest tile, larger than the sparse layers' */
    ck_assert_int_eq(plan.max_tile_numel, mt_layout_largest_layer_numel(&cfg));
    ck_assert_int_gt(plan.max_tile_numel, plan.tile_numel[MT_TILE_LAYER]);
    mt_state_destroy(st);
}
END_TEST

/* Saved as an HF directory: a dense layer's MLP and a sparse layer's experts under their names
 * and shapes, and neither under the other's; loaded back bit for bit. */
START_TEST(test_mixed_hf_roundtrip)
{
    const hf_tensor want[] = {
        { "model.layers.0.mlp.gate_proj.weight", 27, 20 }, { "model.layers.1.mlp.experts.4.down_proj.weight", 20, 7 },
        { "model.layers.1.mlp.gate.weight", 5, 20 }, { "model.layers.0.mlp.gate.weight", 0, 0 },
        { "model.layers.1.mlp.gate_proj.weight", 0, 0 }, { NULL, 0, 0 },
    };
    for (int c = 0; c < 2; c++) {
        const mt_model_config cfg = step_config(QWEN3_STEP, mixed_extras[c]);
        check_hf_roundtrip(&cfg, 61 + (uint64_t)c, want);
    }
}
END_TEST

/* `steps` training steps from step first, on fresh data drawn from rng; clipping on. */
static void train_steps(mt_host_state *st, int64_t first, int64_t steps, mt_test_rng *rng)
{
    mt_graph *g = step_graph(st, 1.0);
    for (int64_t s = first; s < first + steps; s++) {
        int32_t tokens[ACCUM * SN], targets[ACCUM * SN];
        fill_batch(rng, st->cfg.vocab, tokens, targets);
        const double loss = mt_graph_wait_loss(g, mt_graph_submit_step(g, s, tokens, targets, 0.01), NULL);
        ck_assert(isfinite(loss));
    }
    mt_graph_destroy(g);
}

/* Two steps, a checkpoint, a fresh state loaded from it and a third step: the uninterrupted run's
 * master weights and moments, bit for bit. */
START_TEST(test_mixed_resume)
{
    for (int c = 0; c < 2; c++) {
        char extra[256];
        snprintf(extra, sizeof extra, "%s%s", mixed_extras[c], c ? ", \"output_router_logits\": true" : "");
        const mt_model_config cfg = step_config(QWEN3_STEP, extra);
        char err[1024] = "";
        mt_host_state *whole = mt_state_create(&cfg, MT_DTYPE_F32, 0, err, sizeof err);
        mt_host_state *part = mt_state_create(&cfg, MT_DTYPE_F32, 0, err, sizeof err);
        ck_assert_msg(whole && part, "%s", err);
        mt_state_init_random(whole, 71, 0.3);
        mt_state_init_random(part, 71, 0.3);
        mt_test_rng rw, rp;
        mt_test_rng_seed(&rw, 72);
        mt_test_rng_seed(&rp, 72);
        train_steps(whole, 1, 3, &rw);
        train_steps(part, 1, 2, &rp);
        char dir[] = "/tmp/mt-moe-resume.XXXXXX";
        ck_assert(mkdtemp(dir) != NULL);
        char path[4200];
        snprintf(path, sizeof path, "%s/ck", dir);
        mt_checkpoint_meta meta = { .step = 2, .updates = 2, .seed = 71 };
        ck_assert_msg(mt_checkpoint_save(path, part, &meta, err, sizeof err) == 0, "%s", err);
        mt_state_destroy(part);
        mt_host_state *resumed = mt_state_create(&cfg, MT_DTYPE_F32, 0, err, sizeof err);
        ck_assert_msg(resumed != NULL, "%s", err);
        ck_assert_msg(mt_checkpoint_load(path, resumed, &meta, err, sizeof err) == 0, "%s", err);
        ck_assert_int_eq(meta.step, 2);
        train_steps(resumed, 3, 1, &rp);
        for (int i = 0; i < whole->ntiles; i++) {
            const size_t bytes = sizeof(float) * (size_t)whole->tiles[i].numel;
            ck_assert_msg(!memcmp(whole->tiles[i].master, resumed->tiles[i].master, bytes) &&
                              !memcmp(whole->tiles[i].adam_m, resumed->tiles[i].adam_m, bytes) &&
                              !memcmp(whole->tiles[i].adam_v, resumed->tiles[i].adam_v, bytes),
                          "model %d: tile %d differs after the resume", c, i);
        }
        ck_assert(mt_state_hash(whole) == mt_state_hash(resumed));
        fprintf(stderr, "mixed model %d: resumed bit for bit (state hash %016llx)\n", c,
                (unsigned long long)mt_state_hash(whole));
        mt_state_destroy(whole);
        mt_state_destroy(resumed);
        mt_test_remove_dir(dir);
    }
}
END_TEST

static Suite *moe_step_suite(void)
{
    Suite *s = suite_create("moe_step");
    TCase *aux = tcase_create("aux");
    tcase_add_checked_fixture(aux, moe_runtime_up, moe_runtime_down);
    tcase_set_timeout(aux, 300);
    tcase_add_test(aux, test_aux_qwen3_moe);
    tcase_add_test(aux, test_aux_mixtral);
    tcase_add_test(aux, test_aux_off_is_plain);
    tcase_add_test(aux, test_aux_setting_resumes);
    suite_add_tcase(s, aux);
    TCase *mixed = tcase_create("mixed");
    tcase_add_checked_fixture(mixed, moe_runtime_up, moe_runtime_down);
    tcase_set_timeout(mixed, 300);
    tcase_add_test(mixed, test_mixed_whole_model);
    tcase_add_test(mixed, test_mixed_bf16_dense_larger);
    tcase_add_test(mixed, test_mixed_hf_roundtrip);
    tcase_add_test(mixed, test_mixed_plan_bytes);
    tcase_add_test(mixed, test_mixed_resume);
    suite_add_tcase(s, mixed);
    return s;
}

int main(void)
{
    return mt_test_run(moe_step_suite(), false);
}
