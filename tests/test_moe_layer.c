/* Check suite of the mixture-of-experts decoder layer on the CPU in double against central
 * differences (docs/moe.md): the layer with a sparse MLP, with and without the load-balancing
 * loss, its buffer sizes, a whole tiny model (embedding, sparse and dense layers, head), and the
 * fp32 layer against the double one. Sizes are deliberately not multiples of 8. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cpu/ops.h"
#include "models/config.h"
#include "models/layout.h"
#include "models/util.h"
#include "tests/moe_util.h"
#include "tests/testutil.h"

/* ------------------------------------------------------------------------------------------ */
/* 6) The decoder layer with a sparse MLP: L = sum R * y + coef * aux(this layer's rows).      */

enum { LB = 2, LT = 5, LN = LB * LT };

typedef struct layer_case {
    mt_model_config cfg;
    mt_tile_layout lay;
    double *tile, *x, *R, *y, *scratch, coef;
    int64_t layer; /* which decoder layer: gpt_oss's attention window depends on it */
    double stats[2 * MT_MAX_EXPERTS];
} layer_case;

/* The router's probabilities in a sparse layer's `saved` (x rms1 q k v a lse h rms2 probs g u
 * ...), the experts' gates and ups right after them. */
static const double *saved_probs(const mt_model_config *cfg, const double *saved)
{
    const int64_t nd = LN * cfg->hidden, qd = cfg->heads * cfg->head_dim, kvd = cfg->kv_heads * cfg->head_dim;
    return saved + 2 * nd + 2 * LN + 2 * LN * qd + 2 * LN * kvd + LN * cfg->heads;
}

/* gpt_oss's clamps: how many saved gates and ups lie beyond them, and the smallest distance of
 * any to its bound: finite differences across a clamp's kink are meaningless, as across a change
 * of the top-k choice. */
static int64_t clamp_count(const mt_model_config *cfg, const double *saved, double *gap)
{
    const int64_t half = LN * cfg->experts_per_token * cfg->expert_intermediate;
    const double *g = saved_probs(cfg, saved) + LN * cfg->experts, lim = cfg->swiglu_limit;
    int64_t clamped = 0;
    *gap = INFINITY;
    for (int64_t i = 0; lim > 0 && i < 2 * half; i++) {
        const double v = i < half ? g[i] : fabs(g[i]);
        clamped += v > lim;
        if (fabs(v - lim) < *gap) *gap = fabs(v - lim);
    }
    return clamped;
}

static double layer_objective(void *p)
{
    layer_case *c = p;
    memset(c->stats, 0, sizeof c->stats);
    mt_cpu_layer_forward_aux_f64(&c->cfg, &c->lay, c->tile, c->layer, LB, LT, c->x, c->y, NULL, c->scratch, c->stats);
    return weighted_sum(c->R, c->y, LN * c->cfg.hidden) + c->coef * mt_moe_aux_loss(c->cfg.experts, LN, c->stats);
}

/* Checks decoder layer `layer` of cfg; returns how many of the saved gates and ups lie beyond
 * cfg's swiglu_limit (gpt_oss's clamps: 0 for the others). */
static int64_t run_layer_check_at(const char *what, mt_model_config cfg, int64_t layer, double coef, uint64_t seed)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, seed);
    layer_case c;
    memset(&c, 0, sizeof c);
    c.cfg = cfg;
    c.coef = coef;
    c.layer = layer;
    mt_layout_build_layer(&c.cfg, layer, &c.lay);
    ck_assert(mt_layout_is_sparse(&c.lay));
    const int64_t nd = LN * cfg.hidden, E = cfg.experts;
    c.tile = mt_test_alloc_f64(c.lay.numel);
    fill_tile(&rng, &c.lay, c.tile, 0.3);
    c.x = mt_test_random_f64(&rng, nd, 1.0);
    c.R = mt_test_random_f64(&rng, nd, 1.0);
    c.y = mt_test_alloc_f64(nd);
    c.scratch = mt_test_alloc_f64(mt_layer_scratch_numel(&c.cfg, LB, LT));
    double *saved = mt_test_alloc_f64(mt_layer_saved_numel(&c.cfg, LB, LT)), *dx = mt_test_alloc_f64(nd);
    double *dtile = mt_test_alloc_f64(c.lay.numel);
    double stats[2 * MT_MAX_EXPERTS] = { 0 };
    mt_cpu_layer_forward_aux_f64(&c.cfg, &c.lay, c.tile, layer, LB, LT, c.x, c.y, saved, c.scratch, stats);
    const double gap = topk_gap(saved_probs(&cfg, saved), LN, E, cfg.experts_per_token);
    ck_assert_msg(gap > 1e-4, "%s: top-k gap %.3e: pick another seed", what, gap);
    double clamp_gap;
    const int64_t clamped = clamp_count(&cfg, saved, &clamp_gap);
    ck_assert_msg(clamp_gap > 1e-4, "%s: a gate or up %.3e from its clamp: pick another seed", what, clamp_gap);
    for (int64_t i = 0; i < nd; i++) dx[i] = NAN; /* = */
    mt_cpu_layer_backward_aux_f64(&c.cfg, &c.lay, c.tile, layer, LB, LT, saved, c.R, dx, dtile, c.scratch,
                                  coef ? stats : NULL, mt_moe_aux_grad_scale(E, LN, coef, 1.0));
    fprintf(stderr, "sparse layer %s: %s layer %lld (window %lld) E=%lld k=%lld coef=%g, %lld gates/ups clamped\n",
            what, cfg.model_type, (long long)layer, (long long)mt_config_layer_window(&cfg, layer), (long long)E,
            (long long)cfg.experts_per_token, coef, (long long)clamped);
    check_grad("layer dx", layer_objective, &c, c.x, nd, dx);
    check_tile_grads("layer", layer_objective, &c, &c.lay, c.tile, dtile);

    /* dtile is +=: a second backward doubles it. */
    double *dtile2 = mt_test_alloc_f64(c.lay.numel);
    memcpy(dtile2, dtile, sizeof(double) * (size_t)c.lay.numel);
    mt_cpu_layer_backward_aux_f64(&c.cfg, &c.lay, c.tile, layer, LB, LT, saved, c.R, dx, dtile2, c.scratch,
                                  coef ? stats : NULL, mt_moe_aux_grad_scale(E, LN, coef, 1.0));
    for (int64_t i = 0; i < c.lay.numel; i++) ck_assert(fabs(dtile2[i] - 2 * dtile[i]) <= 1e-12 * (1 + fabs(dtile[i])));
    free(dtile2); free(saved); free(dx); free(dtile);
    free(c.tile); free(c.x); free(c.R); free(c.y); free(c.scratch);
    return clamped;
}

static void run_layer_check(const char *what, mt_model_config cfg, double coef, uint64_t seed)
{
    run_layer_check_at(what, cfg, 0, coef, seed);
}

START_TEST(test_layer_grad)
{
    run_layer_check("qwen3_moe", moe_config(QWEN3_MOE_BASE, ", \"norm_topk_prob\": true"), 0.0, 181);
    run_layer_check("qwen3_moe with aux", moe_config(QWEN3_MOE_BASE, ""), 0.25, 182);
    run_layer_check("mixtral with aux", moe_config(MIXTRAL_BASE, ""), 0.1, 183);
}
END_TEST

/* gpt_oss: o_proj bias, sinks, a window on the sliding layers, router and expert biases, the
 * clamped SwiGLU (the limit low enough that the clamps hold some of the gates and ups, whose
 * gradient is then 0 in that input). */
START_TEST(test_layer_grad_gpt_oss)
{
    const mt_model_config cfg = gpt_oss_clamping("");
    ck_assert(mt_config_layer_window(&cfg, 0) == 3 && mt_config_layer_window(&cfg, 1) == 0);
    ck_assert(cfg.swiglu_alpha == 1.702 && cfg.router_bias && cfg.expert_bias && cfg.o_bias && cfg.attn_sinks);
    const int64_t clamped = run_layer_check_at("gpt_oss sliding", cfg, 0, 0.0, 301);
    ck_assert_msg(clamped > 0, "no gate or up reached the clamp: the test would not check it");
    run_layer_check_at("gpt_oss full, with aux", cfg, 1, 0.3, 192);
}
END_TEST

/* A sliding layer attends to fewer keys than a full one: the same tile and input give another
 * output, and the first `window` positions of each sequence (which see every key either way)
 * the same one, to rounding: the two layers' attention may reach BLAS with other shapes, whose
 * kernels sum in another order on some CPUs (5.6e-17 seen on an AVX-512 Xeon). */
START_TEST(test_gpt_oss_window_applies)
{
    const mt_model_config cfg = gpt_oss_clamping("");
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 193);
    mt_tile_layout lay;
    mt_layout_build_layer(&cfg, 0, &lay);
    const int64_t d = cfg.hidden, nd = LN * d, W = mt_config_layer_window(&cfg, 0);
    double *tile = mt_test_alloc_f64(lay.numel), *x = mt_test_random_f64(&rng, nd, 1.0);
    double *y0 = mt_test_alloc_f64(nd), *y1 = mt_test_alloc_f64(nd);
    double *scratch = mt_test_alloc_f64(mt_layer_scratch_numel(&cfg, LB, LT));
    fill_tile(&rng, &lay, tile, 0.3);
    mt_cpu_layer_forward_aux_f64(&cfg, &lay, tile, 0, LB, LT, x, y0, NULL, scratch, NULL);
    mt_cpu_layer_forward_aux_f64(&cfg, &lay, tile, 1, LB, LT, x, y1, NULL, scratch, NULL);
    for (int64_t b = 0; b < LB; b++)
        for (int64_t t = 0; t < LT; t++) {
            const double e = mt_test_rel_err_f64(y0 + (b * LT + t) * d, y1 + (b * LT + t) * d, d);
            if (t < W) ck_assert_msg(e <= 1e-13, "position %lld within the window differs: %.3e", (long long)t, e);
            else ck_assert_msg(e > 1e-6, "position %lld past the window is the same", (long long)t);
        }
    free(tile); free(x); free(y0); free(y1); free(scratch);
}
END_TEST

/* Forward without `saved` gives the same y; every element of saved is written, nothing past
 * saved or scratch is touched, in forward and backward; a mixed model's sizes fit both kinds. */
static void run_sizes(mt_model_config cfg, int64_t layer, uint64_t seed)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, seed);
    mt_tile_layout lay;
    mt_layout_build_layer(&cfg, layer, &lay);
    const int64_t nd = LN * cfg.hidden, guard = 64;
    const int64_t saved_n = mt_layer_saved_numel(&cfg, LB, LT), scratch_n = mt_layer_scratch_numel(&cfg, LB, LT);
    double *tile = mt_test_alloc_f64(lay.numel), *x = mt_test_random_f64(&rng, nd, 1.0), *y1 = mt_test_alloc_f64(nd);
    double *y2 = mt_test_alloc_f64(nd);
    double *saved = mt_test_alloc_f64(saved_n + guard), *scratch = mt_test_alloc_f64(scratch_n + guard);
    fill_tile(&rng, &lay, tile, 0.3);
    for (int64_t i = 0; i < saved_n + guard; i++) saved[i] = NAN;
    for (int64_t i = 0; i < scratch_n + guard; i++) scratch[i] = NAN;
    const double sentinel = 12345.678;
    for (int64_t i = 0; i < guard; i++) saved[saved_n + i] = scratch[scratch_n + i] = sentinel;
    mt_cpu_layer_forward_f64(&cfg, &lay, tile, LB, LT, x, y1, saved, scratch);
    /* The kind of layer that sets the size writes all of it. */
    int64_t written = 0;
    while (written < saved_n && !isnan(saved[written])) written++;
    const bool sparse = mt_layout_is_sparse(&lay);
    const int64_t dense_part = 2 * LN * cfg.intermediate;
    const int64_t sparse_part = LN * cfg.experts + 2 * LN * cfg.experts_per_token * cfg.expert_intermediate;
    const int64_t other = sparse ? (mt_config_has_dense_layers(&cfg) ? dense_part : 0)
                                 : (mt_config_sparse_layers(&cfg) > 0 ? sparse_part : 0);
    const bool sets_size = (sparse ? sparse_part : dense_part) >= other;
    if (sets_size) ck_assert_msg(written == saved_n, "saved[%lld] of %lld never written", (long long)written,
                                 (long long)saved_n);
    mt_cpu_layer_forward_f64(&cfg, &lay, tile, LB, LT, x, y2, NULL, scratch);
    const double e = mt_test_rel_err_f64(y2, y1, nd);
    fprintf(stderr, "saved-free forward %s layer %lld (%s): rel diff %.3e\n", cfg.model_type, (long long)layer,
            mt_layout_is_sparse(&lay) ? "sparse" : "dense", e);
    ck_assert_msg(e <= 1e-14, "y without saved differs: rel %.3e", e);
    double *dx = mt_test_alloc_f64(nd), *dtile = mt_test_alloc_f64(lay.numel);
    mt_cpu_layer_backward_f64(&cfg, &lay, tile, LB, LT, saved, y1, dx, dtile, scratch);
    for (int64_t i = 0; i < nd; i++) ck_assert(isfinite(dx[i]));
    for (int64_t i = 0; i < guard; i++) {
        ck_assert_msg(saved[saved_n + i] == sentinel, "write past mt_layer_saved_numel");
        ck_assert_msg(scratch[scratch_n + i] == sentinel, "write past mt_layer_scratch_numel");
    }
    free(tile); free(x); free(y1); free(y2); free(saved); free(scratch); free(dx); free(dtile);
}

START_TEST(test_layer_sizes)
{
    run_sizes(moe_config(QWEN3_MOE_BASE, ""), 0, 191);
    run_sizes(moe_config(MIXTRAL_BASE, ", \"num_experts_per_tok\": 4"), 1, 192);
    run_sizes(gpt_oss_clamping(""), 0, 197);
    /* mixed: dense layers wider (I = 27) than k experts (2 * 7), and the other way round */
    run_sizes(moe_config(QWEN3_MOE_BASE, ", \"mlp_only_layers\": [2]"), 2, 193);
    run_sizes(moe_config(QWEN3_MOE_BASE, ", \"mlp_only_layers\": [2]"), 3, 194);
    run_sizes(moe_config(QWEN3_MOE_BASE, ", \"mlp_only_layers\": [2], \"moe_intermediate_size\": 30"), 2, 195);
    run_sizes(moe_config(QWEN3_MOE_BASE, ", \"mlp_only_layers\": [2], \"moe_intermediate_size\": 30"), 4, 196);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* 7) A whole tiny model: embedding -> layers (sparse and dense) -> head;                      */
/*    loss = mean cross-entropy + coef * load_balancing_loss over every sparse layer's rows.   */

typedef struct tiny_model {
    mt_model_config cfg;
    mt_tile_layout elay, hlay, *llay;
    double *embed, **layer, *head, *dembed, **dlayer, *dhead;
    int32_t tokens[LN], targets[LN];
    int64_t counted;
    double *acts, *saved, *dacts, *scratch, coef;
    int64_t saved_n;
    double stats[2 * MT_MAX_EXPERTS];
} tiny_model;

static void tiny_init(tiny_model *m, mt_model_config cfg, double coef, uint64_t seed)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, seed);
    m->cfg = cfg;
    m->coef = coef;
    const int64_t L = cfg.layers, nd = LN * cfg.hidden;
    mt_layout_build(&cfg, MT_TILE_EMBED, &m->elay);
    mt_layout_build(&cfg, MT_TILE_HEAD, &m->hlay);
    m->llay = mt_xmalloc((size_t)L * sizeof *m->llay);
    m->layer = mt_xmalloc((size_t)L * sizeof(double *));
    m->dlayer = mt_xmalloc((size_t)L * sizeof(double *));
    m->embed = mt_test_alloc_f64(m->elay.numel);
    m->dembed = mt_test_alloc_f64(m->elay.numel);
    fill_tile(&rng, &m->elay, m->embed, 1.0);
    for (int64_t l = 0; l < L; l++) {
        mt_layout_build_layer(&cfg, l, &m->llay[l]);
        m->layer[l] = mt_test_alloc_f64(m->llay[l].numel);
        m->dlayer[l] = mt_test_alloc_f64(m->llay[l].numel);
        fill_tile(&rng, &m->llay[l], m->layer[l], 0.3);
    }
    m->head = mt_test_alloc_f64(m->hlay.numel);
    m->dhead = mt_test_alloc_f64(m->hlay.numel);
    fill_tile(&rng, &m->hlay, m->head, 0.5);
    m->counted = 0;
    for (int64_t r = 0; r < LN; r++) {
        m->tokens[r] = (int32_t)(mt_test_uniform(&rng) * cfg.vocab);
        m->targets[r] = (int32_t)(mt_test_uniform(&rng) * cfg.vocab);
    }
    m->targets[LT - 1] = m->targets[2 * LT - 1] = -1;
    for (int64_t r = 0; r < LN; r++) m->counted += m->targets[r] >= 0;
    m->acts = mt_test_alloc_f64((L + 1) * nd);
    m->saved_n = mt_layer_saved_numel(&cfg, LB, LT);
    m->saved = mt_test_alloc_f64(L * m->saved_n);
    m->dacts = mt_test_alloc_f64(2 * nd);
    int64_t sn = mt_layer_scratch_numel(&cfg, LB, LT);
    if (mt_head_scratch_numel(&cfg, 4) > sn) sn = mt_head_scratch_numel(&cfg, 4);
    m->scratch = mt_test_alloc_f64(sn);
}

static void tiny_free(tiny_model *m)
{
    for (int64_t l = 0; l < m->cfg.layers; l++) {
        free(m->layer[l]);
        free(m->dlayer[l]);
    }
    free(m->llay); free(m->layer); free(m->dlayer);
    free(m->embed); free(m->dembed); free(m->head); free(m->dhead);
    free(m->acts); free(m->saved); free(m->dacts); free(m->scratch);
}

/* The router rows of one forward call: every token of every sparse layer. */
static int64_t tiny_router_rows(const tiny_model *m) { return LN * mt_config_sparse_layers(&m->cfg); }

static double tiny_forward(tiny_model *m, bool keep)
{
    const int64_t nd = LN * m->cfg.hidden;
    memset(m->stats, 0, sizeof m->stats);
    mt_cpu_embedding_forward_f64(LN, m->cfg.hidden, m->embed + m->elay.tensors[MT_E_EMBED].offset, m->tokens, m->acts);
    for (int64_t l = 0; l < m->cfg.layers; l++)
        mt_cpu_layer_forward_aux_f64(&m->cfg, &m->llay[l], m->layer[l], l, LB, LT, m->acts + l * nd,
                                     m->acts + (l + 1) * nd, keep ? m->saved + l * m->saved_n : NULL, m->scratch,
                                     m->stats);
    int64_t counted;
    const double sum = mt_cpu_head_f64(&m->cfg, &m->hlay, m->head, m->embed, LN, m->acts + m->cfg.layers * nd,
                                       m->targets, 1.0, 4, NULL, NULL, NULL, m->scratch, &counted);
    ck_assert_int_eq(counted, m->counted);
    return sum / (double)counted + m->coef * mt_moe_aux_loss(m->cfg.experts, tiny_router_rows(m), m->stats);
}

static double tiny_objective(void *ctx) { return tiny_forward(ctx, false); }

static void tiny_backward(tiny_model *m)
{
    const int64_t L = m->cfg.layers, nd = LN * m->cfg.hidden;
    memset(m->dembed, 0, sizeof(double) * (size_t)m->elay.numel);
    memset(m->dhead, 0, sizeof(double) * (size_t)m->hlay.numel);
    for (int64_t l = 0; l < L; l++) memset(m->dlayer[l], 0, sizeof(double) * (size_t)m->llay[l].numel);
    tiny_forward(m, true);
    /* The counts over every sparse layer, known once the forward has run them all. */
    const double aux_scale = mt_moe_aux_grad_scale(m->cfg.experts, tiny_router_rows(m), m->coef, 1.0);
    double *dy = m->dacts, *dx = m->dacts + nd;
    int64_t counted;
    mt_cpu_head_f64(&m->cfg, &m->hlay, m->head, m->embed, LN, m->acts + L * nd, m->targets, 1.0 / (double)m->counted,
                    4, dy, m->dhead, m->dembed, m->scratch, &counted);
    for (int64_t l = L - 1; l >= 0; l--) {
        mt_cpu_layer_backward_aux_f64(&m->cfg, &m->llay[l], m->layer[l], l, LB, LT, m->saved + l * m->saved_n, dy, dx,
                                      m->dlayer[l], m->scratch, m->coef ? m->stats : NULL, aux_scale);
        double *t = dy; dy = dx; dx = t;
    }
    mt_cpu_embedding_backward_f64(LN, m->cfg.hidden, m->tokens, dy, m->dembed + m->elay.tensors[MT_E_EMBED].offset);
}

static void run_tiny_check(const char *what, mt_model_config cfg, double coef, uint64_t seed)
{
    tiny_model m;
    tiny_init(&m, cfg, coef, seed);
    tiny_backward(&m);
    for (int64_t l = 0; l < cfg.layers; l++) {
        if (!mt_config_layer_is_sparse(&cfg, l)) continue;
        double gap;
        clamp_count(&cfg, m.saved + l * m.saved_n, &gap);
        ck_assert_msg(gap > 1e-4, "%s layer %lld: a gate or up %.3e from its clamp: pick another seed", what,
                      (long long)l, gap);
        ck_assert_msg(topk_gap(saved_probs(&cfg, m.saved + l * m.saved_n), LN, cfg.experts, cfg.experts_per_token) > 1e-4,
                      "%s layer %lld: top-k gap: pick another seed", what, (long long)l);
    }
    fprintf(stderr, "tiny model %s: %s, %lld layers (%lld sparse), coef %g, loss %.6f\n", what, cfg.model_type,
            (long long)cfg.layers, (long long)mt_config_sparse_layers(&cfg), coef, tiny_forward(&m, false));
    check_tile_grads("embed", tiny_objective, &m, &m.elay, m.embed, m.dembed);
    for (int64_t l = 0; l < cfg.layers; l++) {
        char label[32];
        snprintf(label, sizeof label, "layer %lld", (long long)l);
        check_tile_grads(label, tiny_objective, &m, &m.llay[l], m.layer[l], m.dlayer[l]);
    }
    check_tile_grads("head", tiny_objective, &m, &m.hlay, m.head, m.dhead);
    tiny_free(&m);
}

START_TEST(test_tiny_model_qwen3_moe)
{
    /* layers 0 and 2 sparse, 1 dense; the aux loss spans both sparse layers' rows */
    run_tiny_check("qwen3_moe mixed", moe_config(QWEN3_MOE_BASE, ", \"num_hidden_layers\": 3, \"mlp_only_layers\": [1],"
                                                                 " \"norm_topk_prob\": true"), 0.3, 201);
}
END_TEST

START_TEST(test_tiny_model_mixtral)
{
    run_tiny_check("mixtral tied", moe_config(MIXTRAL_BASE, ", \"tie_word_embeddings\": true"), 0.0, 202);
    run_tiny_check("mixtral with aux", moe_config(MIXTRAL_BASE, ""), 0.2, 203);
}
END_TEST

START_TEST(test_tiny_model_gpt_oss)
{
    /* layers 0 and 2 sliding, 1 full; untied, as published */
    run_tiny_check("gpt_oss", gpt_oss_clamping(""), 0.0, 301);
    run_tiny_check("gpt_oss with aux", gpt_oss_clamping(", \"output_router_logits\": true"), 0.9, 205);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* 8) The fp32 sparse layer computes what the double one does, forward and backward.           */

static void run_f32_vs_f64(mt_model_config cfg, double coef, uint64_t seed)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, seed);
    mt_tile_layout lay;
    mt_layout_build(&cfg, MT_TILE_LAYER, &lay);
    const int64_t nd = LN * cfg.hidden, E = cfg.experts;
    const int64_t saved_n = mt_layer_saved_numel(&cfg, LB, LT), scratch_n = mt_layer_scratch_numel(&cfg, LB, LT);
    double *tile = mt_test_alloc_f64(lay.numel), *x = mt_test_random_f64(&rng, nd, 1.0);
    double *R = mt_test_random_f64(&rng, nd, 1.0);
    fill_tile(&rng, &lay, tile, 0.3);
    double *y = mt_test_alloc_f64(nd), *saved = mt_test_alloc_f64(saved_n), *scratch = mt_test_alloc_f64(scratch_n);
    double *dx = mt_test_alloc_f64(nd);
    double *dtile = mt_test_alloc_f64(lay.numel), stats[2 * MT_MAX_EXPERTS] = { 0 };
    mt_cpu_layer_forward_aux_f64(&cfg, &lay, tile, 0, LB, LT, x, y, saved, scratch, stats);
    mt_cpu_layer_backward_aux_f64(&cfg, &lay, tile, 0, LB, LT, saved, R, dx, dtile, scratch, stats,
                                  mt_moe_aux_grad_scale(E, LN, coef, 1.0));

    float *tile32 = mt_test_to_f32(tile, lay.numel), *x32 = mt_test_to_f32(x, nd), *R32 = mt_test_to_f32(R, nd);
    float *y32 = mt_test_to_f32(y, nd), *saved32 = mt_test_to_f32(saved, saved_n);
    float *scratch32 = mt_test_to_f32(scratch, scratch_n);
    float *dx32 = mt_test_to_f32(dx, nd), *dtile32 = mt_xmalloc(sizeof(float) * (size_t)lay.numel);
    memset(dtile32, 0, sizeof(float) * (size_t)lay.numel);
    double stats32[2 * MT_MAX_EXPERTS] = { 0 };
    mt_cpu_layer_forward_aux_f32(&cfg, &lay, tile32, 0, LB, LT, x32, y32, saved32, scratch32, stats32);
    for (int64_t e = 0; e < E; e++) ck_assert(stats32[e] == stats[e]); /* the same choice of experts */
    mt_cpu_layer_backward_aux_f32(&cfg, &lay, tile32, 0, LB, LT, saved32, R32, dx32, dtile32, scratch32, stats32,
                                  mt_moe_aux_grad_scale(E, LN, coef, 1.0));
    const double ey = mt_test_rel_err_mixed(y32, y, nd), ex = mt_test_rel_err_mixed(dx32, dx, nd);
    double et = 0;
    for (int s = 0; s < lay.ntensors; s++) {
        const mt_tensor_desc *t = &lay.tensors[s];
        if (!t->numel) continue;
        const double e = mt_test_rel_err_mixed(dtile32 + t->offset, dtile + t->offset, t->numel);
        if (e > et) et = e;
    }
    fprintf(stderr, "fp32 vs f64 %s sparse layer: y %.3e, dx %.3e, worst tensor of dtile %.3e\n", cfg.model_type, ey,
            ex, et);
    ck_assert_msg(ey <= 1e-5, "fp32 y rel err %.3e", ey);
    ck_assert_msg(ex <= 1e-5, "fp32 dx rel err %.3e", ex);
    ck_assert_msg(et <= 1e-4, "fp32 dtile rel err %.3e", et);
    free(tile); free(x); free(R); free(y); free(saved); free(scratch); free(dx); free(dtile);
    free(tile32); free(x32); free(R32); free(y32); free(saved32); free(scratch32); free(dx32); free(dtile32);
}

START_TEST(test_f32_matches_f64)
{
    run_f32_vs_f64(moe_config(QWEN3_MOE_BASE, ", \"norm_topk_prob\": true"), 0.2, 211);
    run_f32_vs_f64(moe_config(MIXTRAL_BASE, ""), 0.0, 212);
    run_f32_vs_f64(gpt_oss_clamping(""), 0.3, 213);
}
END_TEST


static Suite *moe_layer_suite(void)
{
    Suite *s = suite_create("moe_layer");
    TCase *layer = tcase_create("layer");
    tcase_add_test(layer, test_layer_grad);
    tcase_add_test(layer, test_layer_grad_gpt_oss);
    tcase_add_test(layer, test_gpt_oss_window_applies);
    tcase_add_test(layer, test_layer_sizes);
    tcase_add_test(layer, test_f32_matches_f64);
    suite_add_tcase(s, layer);
    TCase *model = tcase_create("tiny_model");
    tcase_add_test(model, test_tiny_model_qwen3_moe);
    tcase_add_test(model, test_tiny_model_mixtral);
    tcase_add_test(model, test_tiny_model_gpt_oss);
    suite_add_tcase(s, model);
    return s;
}

int main(void)
{
    return mt_test_run(moe_layer_suite(), false);
}
