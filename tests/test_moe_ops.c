/* Check suite of the mixture-of-experts CPU ops in double against central differences
 * (docs/moe.md): the router (top k, renormalised or not, the load-balancing loss), the grouping of
 * rows by expert, one expert, and the MoE block with the routing's edge cases (experts no token
 * chooses, every token to one expert, k equal to the number of experts, ties) and the = / +=
 * contracts. Sizes are deliberately not multiples of 8. */
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
/* 3) The router                                                                               */

enum { RN = 11 }; /* router rows */

typedef struct router_case {
    int64_t E, k;
    bool renorm;
    double *logits, *R, *counts, aux_scale;
    double *probs, *w;
    int32_t *sel;
} router_case;

/* L = sum R * weights(logits) + aux_scale * sum_e counts_e * sum_r p_re (counts held fixed). */
static double router_objective(void *p)
{
    router_case *c = p;
    mt_cpu_router_softmax_f64(RN, c->E, c->logits, c->probs);
    mt_cpu_router_topk_f64(RN, c->E, c->k, c->renorm, c->probs, c->sel, c->w);
    double L = weighted_sum(c->R, c->w, RN * c->k);
    for (int64_t r = 0; r < RN; r++)
        for (int64_t e = 0; e < c->E; e++) L += c->aux_scale * c->counts[e] * c->probs[r * c->E + e];
    return L;
}

static void run_router_check(int64_t E, int64_t k, bool renorm, double aux_scale, uint64_t seed)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, seed);
    router_case c = { .E = E, .k = k, .renorm = renorm, .aux_scale = aux_scale };
    c.logits = mt_test_random_f64(&rng, RN * E, 1.5);
    c.R = mt_test_random_f64(&rng, RN * k, 1.0);
    c.counts = mt_test_alloc_f64(E);
    c.probs = mt_test_alloc_f64(RN * E);
    c.w = mt_test_alloc_f64(RN * k);
    c.sel = mt_xmalloc((size_t)(RN * k) * sizeof(int32_t));
    router_objective(&c);
    for (int64_t a = 0; a < RN * k; a++) c.counts[c.sel[a]] += 1;
    const double gap = topk_gap(c.probs, RN, E, k);
    ck_assert_msg(gap > 1e-4, "top-k gap %.3e: pick another seed", gap);
    double *dlogits = mt_test_alloc_f64(RN * E);
    for (int64_t i = 0; i < RN * E; i++) dlogits[i] = NAN; /* = */
    mt_cpu_router_backward_f64(RN, E, k, renorm, c.probs, c.sel, c.R, aux_scale ? c.counts : NULL, aux_scale, dlogits);
    char what[96];
    snprintf(what, sizeof what, "router E=%lld k=%lld renorm=%d aux=%g", (long long)E, (long long)k, renorm, aux_scale);
    check_grad(what, router_objective, &c, c.logits, RN * E, dlogits);
    free(dlogits); free(c.logits); free(c.R); free(c.counts); free(c.probs); free(c.w); free(c.sel);
}

START_TEST(test_router_grad)
{
    run_router_check(6, 3, false, 0.0, 101);
    run_router_check(6, 3, true, 0.0, 102);
    run_router_check(6, 3, true, 0.37, 103);
    run_router_check(7, 1, false, 0.2, 104);
    run_router_check(5, 5, false, 0.0, 105); /* k == E: the weights are the probabilities */
    run_router_check(5, 5, true, 0.3, 106);  /* ... which renormalisation leaves as they are */
    run_router_check(4, 1, true, 0.5, 107);  /* weights all 1: the router learns from the aux loss only */
}
END_TEST

/* Softmax against exp / sum, top k in rank order, ties to the lower index, NaN first. */
START_TEST(test_router_topk_rules)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 111);
    double *l = mt_test_random_f64(&rng, 3 * 9, 2.0), p[27];
    mt_cpu_router_softmax_f64(3, 9, l, p);
    for (int r = 0; r < 3; r++) {
        double sum = 0;
        for (int e = 0; e < 9; e++) sum += exp(l[r * 9 + e]);
        for (int e = 0; e < 9; e++) ck_assert(fabs(p[r * 9 + e] - exp(l[r * 9 + e]) / sum) <= 1e-15);
    }
    /* The float softmax in float agrees with the double one to float rounding. */
    float lf[27], pf[27];
    for (int i = 0; i < 27; i++) lf[i] = (float)l[i];
    mt_cpu_router_softmax_f32(3, 9, lf, pf);
    ck_assert(mt_test_rel_err_mixed(pf, p, 27) < 1e-6);
    int32_t sel[9];
    double w[9];
    mt_cpu_router_topk_f64(1, 9, 9, false, p, sel, w);
    for (int j = 1; j < 9; j++) ck_assert(w[j - 1] >= w[j]);
    free(l);

    const double ties[6] = { 0.1, 0.25, 0.05, 0.25, 0.1, 0.25 };
    mt_cpu_router_topk_f64(1, 6, 2, false, ties, sel, w);
    ck_assert(sel[0] == 1 && sel[1] == 3); /* three equal at the top: the two lowest indices */
    mt_cpu_router_topk_f64(1, 6, 4, false, ties, sel, w);
    ck_assert(sel[0] == 1 && sel[1] == 3 && sel[2] == 5 && sel[3] == 0);
    mt_cpu_router_topk_f64(1, 6, 4, true, ties, sel, w);
    ck_assert(fabs(w[0] - 0.25 / 0.85) < 1e-15 && fabs(w[3] - 0.1 / 0.85) < 1e-15);
    const double with_nan[4] = { 0.3, NAN, 0.6, 0.1 };
    mt_cpu_router_topk_f64(1, 4, 2, false, with_nan, sel, w);
    ck_assert(sel[0] == 1 && sel[1] == 2);
    const double equal[5] = { 0.2, 0.2, 0.2, 0.2, 0.2 };
    mt_cpu_router_topk_f64(1, 5, 3, false, equal, sel, w);
    ck_assert(sel[0] == 0 && sel[1] == 1 && sel[2] == 2);
}
END_TEST

/* Grouping: every assignment once, in its expert's group, tokens ascending; empty groups. */
START_TEST(test_group)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 121);
    enum { N = 37, E = 9, K = 3 };
    int32_t experts[N * K], offsets[E + 1], order[N * K];
    for (int r = 0; r < N; r++) {
        /* three distinct experts of 0..7: expert 8 gets none */
        int32_t a = (int32_t)(mt_test_uniform(&rng) * 8), b = (a + 1 + (int32_t)(mt_test_uniform(&rng) * 6)) % 8;
        int32_t c = a;
        while (c == a || c == b) c = (c + 1) % 8;
        experts[r * K] = a;
        experts[r * K + 1] = b;
        experts[r * K + 2] = c;
    }
    mt_moe_group(N, E, K, experts, offsets, order);
    ck_assert_int_eq(offsets[0], 0);
    ck_assert_int_eq(offsets[E], N * K);
    ck_assert_int_eq(offsets[8], offsets[9]); /* the expert no token chose */
    int seen[N * K] = { 0 };
    for (int e = 0; e < E; e++)
        for (int i = offsets[e]; i < offsets[e + 1]; i++) {
            ck_assert_int_eq(experts[order[i]], e);
            if (i > offsets[e]) ck_assert_int_lt(order[i - 1] / K, order[i] / K);
            seen[order[i]]++;
        }
    for (int a = 0; a < N * K; a++) ck_assert_int_eq(seen[a], 1);

    /* Gather and combine against plain loops. */
    enum { DG = 5 };
    double x[N * DG], o[N * K * DG], y[N * DG], want[N * DG], wts[N * K], rows[N * K * DG];
    mt_test_fill_f64(&rng, x, N * DG, 1.0);
    mt_test_fill_f64(&rng, o, N * K * DG, 1.0);
    mt_test_fill_f64(&rng, wts, N * K, 1.0);
    mt_test_fill_f64(&rng, y, N * DG, 1.0);
    memcpy(want, y, sizeof want);
    mt_cpu_moe_gather_f64(N * K, DG, K, order, x, rows);
    for (int i = 0; i < N * K; i++)
        for (int j = 0; j < DG; j++) {
            ck_assert(rows[i * DG + j] == x[(order[i] / K) * DG + j]);
            want[(order[i] / K) * DG + j] += wts[order[i]] * o[i * DG + j];
        }
    mt_cpu_moe_combine_f64(N * K, DG, K, order, wts, o, y);
    ck_assert(mt_test_rel_err_f64(y, want, N * DG) <= 1e-15);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* 4) One expert: L = sum R * (w * expert(X)) over X, its three matrices and w.                */

enum { XR = 9, XD = 10, XI = 7 };

typedef struct expert_case {
    double *X, *Wg, *Wu, *Wd, *w, *R, *g, *u, *s, *o;
} expert_case;

static double expert_objective(void *p)
{
    expert_case *c = p;
    mt_cpu_expert_forward_f64(XR, XD, XI, c->X, c->Wg, c->Wu, c->Wd, NULL, c->g, c->u, c->s, c->o);
    double L = 0;
    for (int64_t i = 0; i < XR; i++)
        for (int64_t j = 0; j < XD; j++) L += c->R[i * XD + j] * c->w[i] * c->o[i * XD + j];
    return L;
}

START_TEST(test_expert_grad)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 131);
    expert_case c;
    c.X = mt_test_random_f64(&rng, XR * XD, 1.0);
    c.Wg = mt_test_random_f64(&rng, XI * XD, 0.4);
    c.Wu = mt_test_random_f64(&rng, XI * XD, 0.4);
    c.Wd = mt_test_random_f64(&rng, XD * XI, 0.4);
    c.w = mt_test_random_f64(&rng, XR, 1.0);
    c.R = mt_test_random_f64(&rng, XR * XD, 1.0);
    c.g = mt_test_alloc_f64(XR * XI); c.u = mt_test_alloc_f64(XR * XI);
    c.s = mt_test_alloc_f64(XR * XI); c.o = mt_test_alloc_f64(XR * XD);
    expert_objective(&c);
    double *dX = mt_test_alloc_f64(XR * XD), *dw = mt_test_alloc_f64(XR), *dWg = mt_test_alloc_f64(XI * XD);
    double *dWu = mt_test_alloc_f64(XI * XD);
    double *dWd = mt_test_alloc_f64(XD * XI), *s = mt_test_alloc_f64(XR * XI), *dz = mt_test_alloc_f64(XR * XI);
    double *du = mt_test_alloc_f64(XR * XI);
    for (int i = 0; i < XR * XD; i++) dX[i] = NAN; /* = */
    for (int i = 0; i < XR; i++) dw[i] = NAN;      /* = */
    mt_cpu_expert_backward_f64(XR, XD, XI, c.X, c.Wg, c.Wu, c.Wd, NULL, c.g, c.u, c.w, c.R, dX, dw, dWg, dWu, dWd, NULL, s, dz,
                               du);
    check_grad("expert dX", expert_objective, &c, c.X, XR * XD, dX);
    check_grad("expert dw", expert_objective, &c, c.w, XR, dw);
    check_grad("expert dWg", expert_objective, &c, c.Wg, XI * XD, dWg);
    check_grad("expert dWu", expert_objective, &c, c.Wu, XI * XD, dWu);
    check_grad("expert dWd", expert_objective, &c, c.Wd, XD * XI, dWd);
    /* the weight gradients are += */
    double *again = mt_test_alloc_f64(XD * XI);
    memcpy(again, dWd, sizeof(double) * XD * XI);
    mt_cpu_expert_backward_f64(XR, XD, XI, c.X, c.Wg, c.Wu, c.Wd, NULL, c.g, c.u, c.w, c.R, dX, dw, dWg, dWu, again, NULL, s,
                               dz, du);
    for (int i = 0; i < XD * XI; i++) ck_assert(fabs(again[i] - 2 * dWd[i]) <= 1e-12 * (1 + fabs(dWd[i])));
    free(again); free(dX); free(dw); free(dWg); free(dWu); free(dWd); free(s); free(dz); free(du);
    free(c.X); free(c.Wg); free(c.Wu); free(c.Wd); free(c.w); free(c.R); free(c.g); free(c.u); free(c.s); free(c.o);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* 5) The MoE block over given inputs x (n, d):                                                 */
/*    L = sum R * out + coef * load_balancing_loss(router rows of this call).                  */

enum { BN = 10 }; /* block rows */

typedef struct block_case {
    mt_model_config cfg;
    mt_tile_layout lay;
    double *tile, *x, *R, *out, *probs, *scratch, coef;
    double stats[2 * MT_MAX_EXPERTS];
} block_case;

static double block_objective(void *p)
{
    block_case *c = p;
    memset(c->stats, 0, sizeof c->stats);
    mt_cpu_moe_forward_f64(&c->cfg, &c->lay, c->tile, BN, c->x, c->probs, c->out, NULL, NULL, c->stats, c->scratch);
    return weighted_sum(c->R, c->out, BN * c->cfg.hidden) + c->coef * mt_moe_aux_loss(c->cfg.experts, BN, c->stats);
}

typedef enum { ROUTE_RANDOM, ROUTE_STARVE_LAST, ROUTE_ALL_TO_ONE } route_kind;
#define ROUTE_PUSH 1.5 /* the router's weight on feature 0 that starves or favours an expert */

static void run_block_check(const char *what, mt_model_config cfg, route_kind route, double coef, uint64_t seed)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, seed);
    block_case c;
    memset(&c, 0, sizeof c);
    c.cfg = cfg;
    c.coef = coef;
    mt_layout_build(&c.cfg, MT_TILE_LAYER, &c.lay);
    const int64_t d = cfg.hidden, E = cfg.experts, k = cfg.experts_per_token, Ie = cfg.expert_intermediate;
    c.tile = mt_test_alloc_f64(c.lay.numel);
    fill_tile(&rng, &c.lay, c.tile, 0.4);
    c.x = mt_test_random_f64(&rng, BN * d, 1.0);
    c.R = mt_test_random_f64(&rng, BN * d, 1.0);
    double *router = c.tile + c.lay.tensors[MT_L_ROUTER_W].offset;
    if (route != ROUTE_RANDOM) {
        /* Feature 0 of every token is large and positive; the router's column 0 pushes the last
         * expert out of every top k, or expert 2 into every one. */
        for (int64_t r = 0; r < BN; r++) c.x[r * d] = 2.0 + mt_test_uniform(&rng);
        for (int64_t i = 0; i < E * d; i++) router[i] *= 0.5;
        for (int64_t e = 0; e < E; e++) router[e * d] = 0;
        if (route == ROUTE_STARVE_LAST) router[(E - 1) * d] = -ROUTE_PUSH;
        else router[2 * d] = ROUTE_PUSH;
    }
    c.out = mt_test_alloc_f64(BN * d);
    c.probs = mt_test_alloc_f64(BN * E);
    const int64_t fs = mt_moe_forward_scratch_numel(&c.cfg, BN, false), bs = mt_moe_backward_scratch_numel(&c.cfg, BN);
    c.scratch = mt_test_alloc_f64(fs > bs ? fs : bs);

    /* The forward keeping g and u gives the same output as the one that does not. */
    double *g = mt_test_alloc_f64(BN * k * Ie), *u = mt_test_alloc_f64(BN * k * Ie), *out2 = mt_test_alloc_f64(BN * d);
    block_objective(&c);
    double stats[2 * MT_MAX_EXPERTS] = { 0 };
    mt_cpu_moe_forward_f64(&c.cfg, &c.lay, c.tile, BN, c.x, c.probs, out2, g, u, stats, c.scratch);
    ck_assert(memcmp(out2, c.out, sizeof(double) * (size_t)(BN * d)) == 0);
    ck_assert(memcmp(stats, c.stats, sizeof stats) == 0);
    double assigned = 0;
    for (int64_t e = 0; e < E; e++) assigned += stats[e];
    ck_assert(assigned == BN * k);
    if (route == ROUTE_STARVE_LAST) ck_assert_msg(stats[E - 1] == 0, "%s: the last expert got tokens", what);
    if (route == ROUTE_ALL_TO_ONE) ck_assert_msg(stats[2] == BN, "%s: expert 2 got %g of %d tokens", what, stats[2], BN);
    const double gap = topk_gap(c.probs, BN, E, k);
    ck_assert_msg(gap > 1e-4, "%s: top-k gap %.3e: pick another seed", what, gap);

    double *dx = mt_test_alloc_f64(BN * d), *dtile = mt_test_alloc_f64(c.lay.numel);
    for (int64_t i = 0; i < BN * d; i++) dx[i] = NAN; /* = */
    mt_cpu_moe_backward_f64(&c.cfg, &c.lay, c.tile, BN, c.x, c.probs, g, u, c.R, coef ? stats : NULL,
                            mt_moe_aux_grad_scale(E, BN, coef, 1.0), dx, dtile, c.scratch);
    fprintf(stderr, "MoE block %s: E=%lld k=%lld renorm=%d coef=%g\n", what, (long long)E, (long long)k,
            cfg.norm_topk_prob, coef);
    check_grad("block dx", block_objective, &c, c.x, BN * d, dx);
    check_tile_grads("block", block_objective, &c, &c.lay, c.tile, dtile);
    if (route == ROUTE_STARVE_LAST)
        for (int x = 0; x < MT_X_COUNT; x++) {
            const mt_tensor_desc *t = &c.lay.tensors[mt_layout_expert_slot((int)E - 1, x)];
            for (int64_t i = 0; i < t->numel; i++) ck_assert(dtile[t->offset + i] == 0.0);
        }
    free(dx); free(dtile); free(g); free(u); free(out2);
    free(c.tile); free(c.x); free(c.R); free(c.out); free(c.probs); free(c.scratch);
}

START_TEST(test_block_grad)
{
    run_block_check("qwen3_moe", moe_config(QWEN3_MOE_BASE, ""), ROUTE_RANDOM, 0.0, 141);
    run_block_check("qwen3_moe renormalised, aux", moe_config(QWEN3_MOE_BASE, ", \"norm_topk_prob\": true"),
                    ROUTE_RANDOM, 0.3, 142);
    run_block_check("mixtral top 3, aux", moe_config(MIXTRAL_BASE, ", \"num_experts_per_tok\": 3"), ROUTE_RANDOM,
                    0.05, 143);
}
END_TEST

/* An expert no token chose: no output, its gradients exactly zero (and the differences too). */
START_TEST(test_block_starved_expert)
{
    run_block_check("last expert starved", moe_config(QWEN3_MOE_BASE, ""), ROUTE_STARVE_LAST, 0.2, 151);
    run_block_check("last expert starved, top 1", moe_config(QWEN3_MOE_BASE, ", \"num_experts_per_tok\": 1"),
                    ROUTE_STARVE_LAST, 0.0, 152);
}
END_TEST

/* Every token to one expert: top 1 (the others starve; renormalised weights are all 1, so the
 * router learns from the aux loss alone) and top 2. */
START_TEST(test_block_all_to_one)
{
    run_block_check("all to expert 2, top 1", moe_config(QWEN3_MOE_BASE, ", \"num_experts_per_tok\": 1"),
                    ROUTE_ALL_TO_ONE, 0.0, 161);
    run_block_check("all to expert 2, top 1, renormalised, aux",
                    moe_config(QWEN3_MOE_BASE, ", \"num_experts_per_tok\": 1, \"norm_topk_prob\": true"),
                    ROUTE_ALL_TO_ONE, 0.4, 162);
    run_block_check("all to expert 2, top 2", moe_config(QWEN3_MOE_BASE, ""), ROUTE_ALL_TO_ONE, 0.1, 163);
}
END_TEST

/* k equal to the number of experts: every expert sees every token. */
START_TEST(test_block_all_experts)
{
    run_block_check("top 5 of 5", moe_config(QWEN3_MOE_BASE, ", \"num_experts_per_tok\": 5"), ROUTE_RANDOM, 0.2, 171);
    run_block_check("top 4 of 4, mixtral", moe_config(MIXTRAL_BASE, ", \"num_experts_per_tok\": 4"), ROUTE_RANDOM,
                    0.0, 172);
}
END_TEST

/* The load-balancing loss from the statistics two sparse layers' forwards gather equals
 * transformers' load_balancing_loss_func written out over their concatenated router rows: the
 * top k by repeated argmax, one-hot (rows, k, E), its mean over rows times the mean probability. */
START_TEST(test_aux_loss_value)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 175);
    const mt_model_config cfg = moe_config(QWEN3_MOE_BASE, ", \"num_experts_per_tok\": 3");
    mt_tile_layout lay;
    mt_layout_build(&cfg, MT_TILE_LAYER, &lay);
    enum { E = 5, K = 3, ROWS = 2 * BN };
    const int64_t d = cfg.hidden;
    double probs[ROWS * E], stats[2 * E] = { 0 };
    double *x = mt_test_random_f64(&rng, BN * d, 1.0), *out = mt_test_alloc_f64(BN * d);
    double *tile = mt_test_alloc_f64(lay.numel);
    double *scratch = mt_test_alloc_f64(mt_moe_forward_scratch_numel(&cfg, BN, false));
    for (int layer = 0; layer < 2; layer++) {
        fill_tile(&rng, &lay, tile, 0.5);
        mt_cpu_moe_forward_f64(&cfg, &lay, tile, BN, x, probs + layer * BN * E, out, NULL, NULL, stats, scratch);
    }
    double tokens_per_expert[K][E] = { { 0 } }, router_prob[E] = { 0 };
    for (int r = 0; r < ROWS; r++) {
        bool taken[E] = { false };
        for (int j = 0; j < K; j++) {
            int best = -1;
            for (int e = 0; e < E; e++)
                if (!taken[e] && (best < 0 || probs[r * E + e] > probs[r * E + best])) best = e;
            taken[best] = true;
            tokens_per_expert[j][best] += 1.0 / ROWS;
        }
        for (int e = 0; e < E; e++) router_prob[e] += probs[r * E + e] / ROWS;
    }
    double want = 0;
    for (int j = 0; j < K; j++)
        for (int e = 0; e < E; e++) want += tokens_per_expert[j][e] * router_prob[e];
    want *= E;
    const double got = mt_moe_aux_loss(E, ROWS, stats);
    fprintf(stderr, "load-balancing loss %.15f, written out %.15f\n", got, want);
    ck_assert_msg(fabs(got - want) <= 1e-14 * want, "aux loss %.17g, want %.17g", got, want);
    ck_assert(want > 0.1); /* k = 3 at perfect balance */
    free(x); free(out); free(tile); free(scratch);
}
END_TEST


static Suite *moe_ops_suite(void)
{
    Suite *s = suite_create("moe_ops");
    TCase *ops = tcase_create("ops");
    tcase_add_test(ops, test_router_grad);
    tcase_add_test(ops, test_router_topk_rules);
    tcase_add_test(ops, test_group);
    tcase_add_test(ops, test_expert_grad);
    tcase_add_test(ops, test_block_grad);
    tcase_add_test(ops, test_block_starved_expert);
    tcase_add_test(ops, test_block_all_to_one);
    tcase_add_test(ops, test_block_all_experts);
    tcase_add_test(ops, test_aux_loss_value);
    suite_add_tcase(s, ops);
    return s;
}

int main(void)
{
    return mt_test_run(moe_ops_suite(), false);
}
