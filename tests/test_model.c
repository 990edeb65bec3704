/* Whole-model gradient checks of the CPU backend: the decoder layer, the head and a tiny model
 * (embedding -> layers -> head) against central finite differences in double, plus fp32 vs
 * double agreement and the saved-free forward. Sizes are deliberately not multiples of 8. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cpu/ops.h"
#include "models/util.h"
#include "tests/testutil.h"

#define FD_STEP 1e-6
#define GRAD_TOL 1e-6

enum { TEST_B = 2, TEST_T = 5, TEST_NTOK = TEST_B * TEST_T };

typedef struct cfg_opts {
    mt_family family;
    bool qkv_bias, qk_norm, tied;
    mt_rope_type rope;
    int64_t layers;
    int64_t mlp_chunk; /* the dense MLP's tokens at a time (0: all, g and u kept) */
} cfg_opts;

/* d = 20 with H = 4 heads of D = 6: H*D != d on purpose; GQA with KV = 2. */
static mt_model_config make_cfg(cfg_opts o)
{
    mt_model_config c;
    memset(&c, 0, sizeof c);
    c.family = o.family;
    snprintf(c.model_type, sizeof c.model_type, "%s",
             o.family == MT_FAMILY_QWEN2 ? "qwen2" : o.family == MT_FAMILY_QWEN3 ? "qwen3" : "llama");
    c.hidden = 20;
    c.intermediate = 27;
    c.layers = o.layers;
    c.heads = 4;
    c.kv_heads = 2;
    c.head_dim = 6;
    c.vocab = 29;
    c.max_positions = 64;
    c.rope_theta = 10000.0;
    c.rms_eps = 1e-6;
    c.tied = o.tied;
    c.qkv_bias = o.qkv_bias;
    c.qk_norm = o.qk_norm;
    c.rope_type = o.rope;
    c.mlp_chunk = o.mlp_chunk;
    if (o.rope == MT_ROPE_LLAMA3) {
        /* Wavelengths 6.3, 136, 2920 against 64..256: one of each Llama-3 branch. */
        c.rope_scaling_factor = 8.0;
        c.rope_low_freq_factor = 1.0;
        c.rope_high_freq_factor = 4.0;
        c.rope_original_max_positions = 256;
    } else if (o.rope == MT_ROPE_YARN) {
        /* Over 256 original positions the ramp runs over dims [0, 2] (floor 0.08, ceil 1.21): one
         * pair extrapolated, one blended, one interpolated; the attention factor 0.1 ln 3 + 1
         * scales q and k. */
        c.rope_scaling_factor = 3.0;
        c.rope_original_max_positions = 256;
        c.rope_beta_fast = 32, c.rope_beta_slow = 1, c.rope_truncate = true;
    } else if (o.rope == MT_ROPE_DYNAMIC) {
        /* TEST_T = 5 tokens past 4 positions: the base grows with the length run. */
        c.rope_scaling_factor = 2.0;
        c.max_positions = 4;
    }
    return c;
}

static double *alloc_f64(int64_t n) { return mt_xmalloc((size_t)n * sizeof(double)); }

/* Random tile: norm weights near 1 (as trained models have them), everything else N(0, scale). */
static void fill_tile(mt_test_rng *rng, const mt_tile_layout *lay, double *tile, double scale)
{
    memset(tile, 0, (size_t)lay->numel * sizeof(double));
    for (int s = 0; s < lay->ntensors; s++) {
        const mt_tensor_desc *t = &lay->tensors[s];
        if (t->numel == 0) continue;
        const bool is_norm = t->ndim == 1 && strstr(t->name, "norm") != NULL;
        mt_test_fill_f64(rng, tile + t->offset, t->numel, is_norm ? 0.2 : scale);
        if (is_norm)
            for (int64_t i = 0; i < t->numel; i++) tile[t->offset + i] += 1.0;
    }
}

/* Central differences of f over n elements of param, compared with analytic: ||a - fd|| / ||fd||. */
static double fd_rel_err(double (*f)(void *), void *ctx, double *param, int64_t n,
                         const double *analytic)
{
    double *fd = alloc_f64(n);
    for (int64_t i = 0; i < n; i++) {
        const double keep = param[i];
        param[i] = keep + FD_STEP;
        const double fp = f(ctx);
        param[i] = keep - FD_STEP;
        const double fm = f(ctx);
        param[i] = keep;
        fd[i] = (fp - fm) / (2 * FD_STEP);
    }
    const double err = mt_test_rel_err_f64(analytic, fd, n);
    free(fd);
    return err;
}

/* Checks every present tensor of a tile against finite differences; returns the largest error. */
static double check_tile_grads(const char *what, double (*f)(void *), void *ctx,
                               const mt_tile_layout *lay, double *tile, const double *dtile)
{
    double worst = 0;
    for (int s = 0; s < lay->ntensors; s++) {
        const mt_tensor_desc *t = &lay->tensors[s];
        if (t->numel == 0) continue;
        const double err = fd_rel_err(f, ctx, tile + t->offset, t->numel, dtile + t->offset);
        fprintf(stderr, "  %-10s %-36s rel err %.3e\n", what, t->name, err);
        ck_assert_msg(err <= GRAD_TOL, "%s %s: gradient rel err %.3e > %.0e", what, t->name, err, GRAD_TOL);
        if (err > worst) worst = err;
    }
    return worst;
}

/* ------------------------------------------------------------------------------------------ */
/* 1) One layer: L = sum(y * R) for a fixed random R, so dL/dy = R.                            */

typedef struct layer_case {
    mt_model_config cfg;
    mt_tile_layout lay;
    double *tile, *x, *R, *y, *scratch;
} layer_case;

static double layer_objective(void *ctx)
{
    layer_case *c = ctx;
    const int64_t n = TEST_NTOK * c->cfg.hidden;
    mt_cpu_layer_forward_f64(&c->cfg, &c->lay, c->tile, TEST_B, TEST_T, c->x, c->y, NULL, c->scratch);
    double L = 0;
    for (int64_t i = 0; i < n; i++) L += c->y[i] * c->R[i];
    return L;
}

static void run_layer_grad_check(cfg_opts o, uint64_t seed)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, seed);
    layer_case c;
    c.cfg = make_cfg(o);
    mt_layout_build(&c.cfg, MT_TILE_LAYER, &c.lay);
    ck_assert_int_eq(c.lay.tensors[MT_L_Q_B].numel > 0, o.qkv_bias);
    ck_assert_int_eq(c.lay.tensors[MT_L_Q_NORM].numel > 0, o.qk_norm);
    const int64_t nd = TEST_NTOK * c.cfg.hidden;
    const int64_t saved_n = mt_layer_saved_numel(&c.cfg, TEST_B, TEST_T);
    const int64_t scratch_n = mt_layer_scratch_numel(&c.cfg, TEST_B, TEST_T);

    c.tile = alloc_f64(c.lay.numel);
    fill_tile(&rng, &c.lay, c.tile, 0.3);
    c.x = alloc_f64(nd);
    mt_test_fill_f64(&rng, c.x, nd, 1.0);
    c.R = alloc_f64(nd);
    mt_test_fill_f64(&rng, c.R, nd, 1.0);
    c.y = alloc_f64(nd);
    c.scratch = alloc_f64(scratch_n);
    double *saved = alloc_f64(saved_n), *dx = alloc_f64(nd), *dtile = alloc_f64(c.lay.numel);

    mt_cpu_layer_forward_f64(&c.cfg, &c.lay, c.tile, TEST_B, TEST_T, c.x, c.y, saved, c.scratch);
    for (int64_t i = 0; i < nd; i++) dx[i] = NAN; /* dx is `=`: stale contents must not leak */
    memset(dtile, 0, (size_t)c.lay.numel * sizeof(double));
    mt_cpu_layer_backward_f64(&c.cfg, &c.lay, c.tile, TEST_B, TEST_T, saved, c.R, dx, dtile, c.scratch);

    fprintf(stderr, "layer %s bias=%d qk_norm=%d rope_type=%d mlp_chunk=%lld\n", c.cfg.model_type, o.qkv_bias,
            o.qk_norm, (int)o.rope, (long long)o.mlp_chunk);
    const double ex = fd_rel_err(layer_objective, &c, c.x, nd, dx);
    fprintf(stderr, "  %-10s %-36s rel err %.3e\n", "layer", "dx", ex);
    ck_assert_msg(ex <= GRAD_TOL, "dx rel err %.3e", ex);
    check_tile_grads("layer", layer_objective, &c, &c.lay, c.tile, dtile);

    /* dtile is `+=`: a second backward doubles it. */
    double *dtile2 = alloc_f64(c.lay.numel);
    memcpy(dtile2, dtile, (size_t)c.lay.numel * sizeof(double));
    mt_cpu_layer_backward_f64(&c.cfg, &c.lay, c.tile, TEST_B, TEST_T, saved, c.R, dx, dtile2, c.scratch);
    for (int64_t i = 0; i < c.lay.numel; i++)
        ck_assert(fabs(dtile2[i] - 2 * dtile[i]) <= 1e-12 * (1 + fabs(dtile[i])));

    free(dtile2); free(saved); free(dx); free(dtile);
    free(c.tile); free(c.x); free(c.R); free(c.y); free(c.scratch);
}

START_TEST(test_layer_grad_qwen2)
{
    run_layer_grad_check((cfg_opts){ .family = MT_FAMILY_QWEN2, .qkv_bias = true, .layers = 1 }, 11);
}
END_TEST

START_TEST(test_layer_grad_mlp_chunk)
{
    /* the MLP 3 tokens at a time (10 = 3 + 3 + 3 + 1), and 1 */
    run_layer_grad_check((cfg_opts){ .family = MT_FAMILY_QWEN2, .qkv_bias = true, .layers = 1, .mlp_chunk = 3 }, 17);
    run_layer_grad_check((cfg_opts){ .family = MT_FAMILY_LLAMA, .layers = 1, .mlp_chunk = 1 }, 18);
}
END_TEST

START_TEST(test_layer_grad_llama)
{
    run_layer_grad_check((cfg_opts){ .family = MT_FAMILY_LLAMA, .layers = 1 }, 12);
    run_layer_grad_check((cfg_opts){ .family = MT_FAMILY_LLAMA, .rope = MT_ROPE_LLAMA3, .layers = 1 }, 13);
    run_layer_grad_check((cfg_opts){ .family = MT_FAMILY_LLAMA, .rope = MT_ROPE_YARN, .layers = 1 }, 15);
    run_layer_grad_check((cfg_opts){ .family = MT_FAMILY_LLAMA, .rope = MT_ROPE_DYNAMIC, .layers = 1 }, 16);
}
END_TEST

START_TEST(test_layer_grad_qwen3)
{
    run_layer_grad_check((cfg_opts){ .family = MT_FAMILY_QWEN3, .qk_norm = true, .layers = 1 }, 14);
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* 2) The head: loss against a naive reference, gradients against finite differences.          */

typedef struct head_case {
    mt_model_config cfg;
    mt_tile_layout lay;
    double *tile, *embed, *h, *scratch;
    int32_t targets[TEST_NTOK];
    int64_t chunk;
    double loss_scale;
} head_case;

static double head_objective(void *ctx)
{
    head_case *c = ctx;
    int64_t counted;
    return c->loss_scale * mt_cpu_head_f64(&c->cfg, &c->lay, c->tile, c->embed, TEST_NTOK, c->h,
                                           c->targets, c->loss_scale, c->chunk, NULL, NULL, NULL,
                                           c->scratch, &counted);
}

/* The same loss written out directly (no kernels, no chunks). */
static double head_naive_loss(const head_case *c, int64_t *counted)
{
    const int64_t d = c->cfg.hidden, V = c->cfg.vocab;
    const double *norm = c->tile + c->lay.tensors[MT_H_NORM].offset;
    const double *W = c->cfg.tied ? c->embed : c->tile + c->lay.tensors[MT_H_LM_HEAD].offset;
    double loss = 0, *hn = alloc_f64(d), *logit = alloc_f64(V);
    *counted = 0;
    for (int64_t r = 0; r < TEST_NTOK; r++) {
        if (c->targets[r] < 0) continue;
        double ms = 0;
        for (int64_t j = 0; j < d; j++) ms += c->h[r * d + j] * c->h[r * d + j];
        const double inv = 1.0 / sqrt(ms / d + c->cfg.rms_eps);
        for (int64_t j = 0; j < d; j++) hn[j] = c->h[r * d + j] * inv * norm[j];
        double sum = 0;
        for (int64_t v = 0; v < V; v++) {
            logit[v] = 0;
            for (int64_t j = 0; j < d; j++) logit[v] += hn[j] * W[v * d + j];
            sum += exp(logit[v]);
        }
        loss += log(sum) - logit[c->targets[r]];
        (*counted)++;
    }
    free(hn);
    free(logit);
    return loss;
}

static void run_head_check(bool tied, uint64_t seed)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, seed);
    head_case c;
    c.cfg = make_cfg((cfg_opts){ .family = MT_FAMILY_QWEN2, .qkv_bias = true, .tied = tied, .layers = 1 });
    mt_tile_layout elay;
    mt_layout_build(&c.cfg, MT_TILE_HEAD, &c.lay);
    mt_layout_build(&c.cfg, MT_TILE_EMBED, &elay);
    const int64_t d = c.cfg.hidden, V = c.cfg.vocab, nd = TEST_NTOK * d;
    ck_assert_int_eq(c.lay.tensors[MT_H_LM_HEAD].numel, tied ? 0 : V * d);
    c.chunk = 3; /* < ntok and does not divide it */
    c.loss_scale = 0.37;

    c.tile = alloc_f64(c.lay.numel);
    fill_tile(&rng, &c.lay, c.tile, 0.5);
    c.embed = alloc_f64(elay.numel);
    fill_tile(&rng, &elay, c.embed, 0.5);
    c.h = alloc_f64(nd);
    mt_test_fill_f64(&rng, c.h, nd, 1.0);
    for (int64_t r = 0; r < TEST_NTOK; r++) c.targets[r] = (int32_t)(mt_test_uniform(&rng) * V);
    c.targets[1] = c.targets[6] = -1;
    /* the whole third chunk (rows 6..8) but one row ignored; row 9 alone in the last chunk */
    c.targets[7] = -1;
    c.scratch = alloc_f64(mt_head_scratch_numel(&c.cfg, c.chunk));

    /* Loss: chunked equals naive, and independent of the chunk size. */
    int64_t counted, counted_ref;
    const double ref = head_naive_loss(&c, &counted_ref);
    const double loss = mt_cpu_head_f64(&c.cfg, &c.lay, c.tile, c.embed, TEST_NTOK, c.h, c.targets,
                                        1.0, c.chunk, NULL, NULL, NULL, c.scratch, &counted);
    ck_assert_int_eq(counted, counted_ref);
    ck_assert_int_eq(counted, TEST_NTOK - 3);
    fprintf(stderr, "head tied=%d: loss %.12f naive %.12f rel %.3e\n", tied, loss, ref, fabs(loss - ref) / ref);
    ck_assert_msg(fabs(loss - ref) <= 1e-12 * fabs(ref), "head loss %.15g vs naive %.15g", loss, ref);
    double *big = alloc_f64(mt_head_scratch_numel(&c.cfg, TEST_NTOK));
    const double whole = mt_cpu_head_f64(&c.cfg, &c.lay, c.tile, c.embed, TEST_NTOK, c.h, c.targets,
                                         1.0, TEST_NTOK, NULL, NULL, NULL, big, &counted);
    ck_assert_msg(fabs(whole - ref) <= 1e-12 * fabs(ref), "unchunked head loss %.15g vs %.15g", whole, ref);

    /* Gradients of loss_scale * loss. */
    double *dh = alloc_f64(nd), *dhead = alloc_f64(c.lay.numel), *dembed = alloc_f64(elay.numel);
    for (int64_t i = 0; i < nd; i++) dh[i] = NAN; /* dh is `=` */
    memset(dhead, 0, (size_t)c.lay.numel * sizeof(double));
    memset(dembed, 0, (size_t)elay.numel * sizeof(double));
    const double loss2 = mt_cpu_head_f64(&c.cfg, &c.lay, c.tile, c.embed, TEST_NTOK, c.h, c.targets,
                                         c.loss_scale, c.chunk, dh, dhead, dembed, c.scratch, &counted);
    ck_assert(loss2 == loss);
    for (int i = 0; i < d; i++) {
        ck_assert(dh[1 * d + i] == 0.0); /* ignored rows get no gradient */
        ck_assert(dh[6 * d + i] == 0.0);
    }
    const double eh = fd_rel_err(head_objective, &c, c.h, nd, dh);
    fprintf(stderr, "  %-10s %-36s rel err %.3e\n", "head", "dh", eh);
    ck_assert_msg(eh <= GRAD_TOL, "head dh rel err %.3e", eh);
    check_tile_grads("head", head_objective, &c, &c.lay, c.tile, dhead);
    if (tied) {
        check_tile_grads("embed", head_objective, &c, &elay, c.embed, dembed);
    } else {
        for (int64_t i = 0; i < elay.numel; i++) ck_assert(dembed[i] == 0.0); /* untied: untouched */
    }

    free(big); free(dh); free(dhead); free(dembed);
    free(c.tile); free(c.embed); free(c.h); free(c.scratch);
}

START_TEST(test_head_untied) { run_head_check(false, 21); }
END_TEST

START_TEST(test_head_tied) { run_head_check(true, 22); }
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* 3-5) A tiny model: embedding -> L layers -> head; loss = mean over counted targets.        */

typedef struct tiny_model {
    mt_model_config cfg;
    mt_tile_layout elay, llay, hlay;
    double *embed, **layer, *head;         /* parameters */
    double *dembed, **dlayer, *dhead;      /* gradients */
    int32_t tokens[TEST_NTOK], targets[TEST_NTOK];
    int64_t counted;
    double *acts;                          /* (L+1, ntok, d): h_0 .. h_L */
    double *saved;                         /* (L, saved_numel), NULL when no backward */
    double *dacts;                         /* (2, ntok, d) */
    double *scratch;
    int64_t saved_n;
} tiny_model;

static void tiny_init(tiny_model *m, cfg_opts o, uint64_t seed)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, seed);
    m->cfg = make_cfg(o);
    mt_layout_build(&m->cfg, MT_TILE_EMBED, &m->elay);
    mt_layout_build(&m->cfg, MT_TILE_LAYER, &m->llay);
    mt_layout_build(&m->cfg, MT_TILE_HEAD, &m->hlay);
    const int64_t L = m->cfg.layers, nd = TEST_NTOK * m->cfg.hidden;
    m->embed = alloc_f64(m->elay.numel);
    m->dembed = alloc_f64(m->elay.numel);
    fill_tile(&rng, &m->elay, m->embed, 1.0);
    m->layer = mt_xmalloc((size_t)L * sizeof(double *));
    m->dlayer = mt_xmalloc((size_t)L * sizeof(double *));
    for (int64_t l = 0; l < L; l++) {
        m->layer[l] = alloc_f64(m->llay.numel);
        m->dlayer[l] = alloc_f64(m->llay.numel);
        fill_tile(&rng, &m->llay, m->layer[l], 0.3);
    }
    m->head = alloc_f64(m->hlay.numel);
    m->dhead = alloc_f64(m->hlay.numel);
    fill_tile(&rng, &m->hlay, m->head, 0.5);
    m->counted = 0;
    for (int64_t r = 0; r < TEST_NTOK; r++) {
        m->tokens[r] = (int32_t)(mt_test_uniform(&rng) * m->cfg.vocab);
        m->targets[r] = (int32_t)(mt_test_uniform(&rng) * m->cfg.vocab);
    }
    m->targets[TEST_T - 1] = m->targets[2 * TEST_T - 1] = -1; /* last token of each sequence */
    for (int64_t r = 0; r < TEST_NTOK; r++) m->counted += m->targets[r] >= 0;
    m->acts = alloc_f64((L + 1) * nd);
    m->saved_n = mt_layer_saved_numel(&m->cfg, TEST_B, TEST_T);
    m->saved = alloc_f64(L * m->saved_n);
    m->dacts = alloc_f64(2 * nd);
    int64_t sn = mt_layer_scratch_numel(&m->cfg, TEST_B, TEST_T);
    const int64_t hs = mt_head_scratch_numel(&m->cfg, 4);
    if (hs > sn) sn = hs;
    const int64_t ls = mt_head_scratch_numel(&m->cfg, TEST_NTOK);
    if (ls > sn) sn = ls;
    m->scratch = alloc_f64(sn);
}

static void tiny_free(tiny_model *m)
{
    for (int64_t l = 0; l < m->cfg.layers; l++) {
        free(m->layer[l]);
        free(m->dlayer[l]);
    }
    free(m->layer); free(m->dlayer);
    free(m->embed); free(m->dembed); free(m->head); free(m->dhead);
    free(m->acts); free(m->saved); free(m->dacts); free(m->scratch);
}

static const double *tiny_table(const tiny_model *m) { return m->embed + m->elay.tensors[MT_E_EMBED].offset; }

/* Forward to the mean loss; keeps `saved` per layer when keep is set. */
static double tiny_forward(tiny_model *m, bool keep)
{
    const int64_t nd = TEST_NTOK * m->cfg.hidden;
    mt_cpu_embedding_forward_f64(TEST_NTOK, m->cfg.hidden, tiny_table(m), m->tokens, m->acts);
    for (int64_t l = 0; l < m->cfg.layers; l++)
        mt_cpu_layer_forward_f64(&m->cfg, &m->llay, m->layer[l], TEST_B, TEST_T, m->acts + l * nd,
                                 m->acts + (l + 1) * nd, keep ? m->saved + l * m->saved_n : NULL,
                                 m->scratch);
    int64_t counted;
    const double sum = mt_cpu_head_f64(&m->cfg, &m->hlay, m->head, m->embed, TEST_NTOK,
                                       m->acts + m->cfg.layers * nd, m->targets, 1.0, 4, NULL,
                                       NULL, NULL, m->scratch, &counted);
    ck_assert_int_eq(counted, m->counted);
    return sum / (double)counted;
}

static double tiny_objective(void *ctx) { return tiny_forward(ctx, false); }

/* The sequential backward: head, then layers last to first, then the embedding scatter. */
static void tiny_backward(tiny_model *m)
{
    const int64_t L = m->cfg.layers, nd = TEST_NTOK * m->cfg.hidden;
    memset(m->dembed, 0, (size_t)m->elay.numel * sizeof(double));
    memset(m->dhead, 0, (size_t)m->hlay.numel * sizeof(double));
    for (int64_t l = 0; l < L; l++) memset(m->dlayer[l], 0, (size_t)m->llay.numel * sizeof(double));
    tiny_forward(m, true);
    double *dy = m->dacts, *dx = m->dacts + nd;
    int64_t counted;
    mt_cpu_head_f64(&m->cfg, &m->hlay, m->head, m->embed, TEST_NTOK, m->acts + L * nd, m->targets,
                    1.0 / (double)m->counted, 4, dy, m->dhead, m->dembed, m->scratch, &counted);
    for (int64_t l = L - 1; l >= 0; l--) {
        mt_cpu_layer_backward_f64(&m->cfg, &m->llay, m->layer[l], TEST_B, TEST_T,
                                  m->saved + l * m->saved_n, dy, dx, m->dlayer[l], m->scratch);
        double *t = dy; dy = dx; dx = t;
    }
    mt_cpu_embedding_backward_f64(TEST_NTOK, m->cfg.hidden, m->tokens, dy,
                                  m->dembed + m->elay.tensors[MT_E_EMBED].offset);
}

static void run_tiny_grad_check(cfg_opts o, uint64_t seed)
{
    tiny_model m;
    tiny_init(&m, o, seed);
    tiny_backward(&m);
    fprintf(stderr, "tiny model %s L=%ld bias=%d tied=%d\n", m.cfg.model_type, (long)m.cfg.layers,
            o.qkv_bias, o.tied);
    check_tile_grads("embed", tiny_objective, &m, &m.elay, m.embed, m.dembed);
    for (int64_t l = 0; l < m.cfg.layers; l++) {
        char what[32];
        snprintf(what, sizeof what, "layer %ld", (long)l);
        check_tile_grads(what, tiny_objective, &m, &m.llay, m.layer[l], m.dlayer[l]);
    }
    check_tile_grads("head", tiny_objective, &m, &m.hlay, m.head, m.dhead);
    tiny_free(&m);
}

START_TEST(test_tiny_model_untied)
{
    run_tiny_grad_check((cfg_opts){ .family = MT_FAMILY_QWEN2, .qkv_bias = true, .layers = 3 }, 31);
}
END_TEST

START_TEST(test_tiny_model_tied)
{
    run_tiny_grad_check((cfg_opts){ .family = MT_FAMILY_QWEN2, .qkv_bias = true, .tied = true, .layers = 2 }, 32);
}
END_TEST

START_TEST(test_tiny_model_qwen3)
{
    run_tiny_grad_check((cfg_opts){ .family = MT_FAMILY_QWEN3, .qk_norm = true, .tied = true, .layers = 2 }, 33);
}
END_TEST

static float *to_f32(const double *x, int64_t n)
{
    float *y = mt_xmalloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) y[i] = (float)x[i];
    return y;
}

/* 4) The fp32 instantiation runs the same model as the double one. */
static void run_f32_vs_f64(cfg_opts o, uint64_t seed)
{
    tiny_model m;
    tiny_init(&m, o, seed);
    const int64_t L = m.cfg.layers, d = m.cfg.hidden, V = m.cfg.vocab, nd = TEST_NTOK * d;
    const double loss64 = tiny_forward(&m, false);
    double *logits64 = alloc_f64(TEST_NTOK * V);
    mt_cpu_head_logits_f64(&m.cfg, &m.hlay, m.head, m.embed, TEST_NTOK, m.acts + L * nd, logits64, m.scratch);

    float *embed = to_f32(m.embed, m.elay.numel), *head = to_f32(m.head, m.hlay.numel);
    float *x = mt_xmalloc((size_t)nd * sizeof(float)), *y = mt_xmalloc((size_t)nd * sizeof(float));
    int64_t scratch_n = mt_layer_scratch_numel(&m.cfg, TEST_B, TEST_T);
    if (mt_head_scratch_numel(&m.cfg, TEST_NTOK) > scratch_n) scratch_n = mt_head_scratch_numel(&m.cfg, TEST_NTOK);
    float *scratch = mt_xmalloc((size_t)scratch_n * sizeof(float));
    float *saved = mt_xmalloc((size_t)m.saved_n * sizeof(float));
    mt_cpu_embedding_forward_f32(TEST_NTOK, d, embed + m.elay.tensors[MT_E_EMBED].offset, m.tokens, x);
    for (int64_t l = 0; l < L; l++) {
        float *tile = to_f32(m.layer[l], m.llay.numel);
        mt_cpu_layer_forward_f32(&m.cfg, &m.llay, tile, TEST_B, TEST_T, x, y, l % 2 ? saved : NULL, scratch);
        float *t = x; x = y; y = t;
        free(tile);
    }
    float *logits32 = mt_xmalloc((size_t)(TEST_NTOK * V) * sizeof(float));
    mt_cpu_head_logits_f32(&m.cfg, &m.hlay, head, embed, TEST_NTOK, x, logits32, scratch);
    int64_t counted;
    const double loss32 = mt_cpu_head_f32(&m.cfg, &m.hlay, head, embed, TEST_NTOK, x, m.targets, 1.0,
                                          4, NULL, NULL, NULL, scratch, &counted) / (double)counted;
    double *l32 = alloc_f64(TEST_NTOK * V);
    for (int64_t i = 0; i < TEST_NTOK * V; i++) l32[i] = logits32[i];
    const double elog = mt_test_rel_err_f64(l32, logits64, TEST_NTOK * V);
    const double eloss = fabs(loss32 - loss64) / fabs(loss64);
    fprintf(stderr, "fp32 vs f64 %s tied=%d: logits rel err %.3e, loss rel err %.3e\n",
            m.cfg.model_type, o.tied, elog, eloss);
    ck_assert_msg(elog <= 1e-5, "fp32 logits rel err %.3e", elog);
    ck_assert_msg(eloss <= 1e-5, "fp32 loss rel err %.3e", eloss);

    free(l32); free(logits32); free(saved); free(scratch); free(x); free(y); free(embed); free(head);
    free(logits64);
    tiny_free(&m);
}

START_TEST(test_f32_matches_f64)
{
    run_f32_vs_f64((cfg_opts){ .family = MT_FAMILY_QWEN2, .qkv_bias = true, .layers = 3 }, 41);
    run_f32_vs_f64((cfg_opts){ .family = MT_FAMILY_QWEN3, .qk_norm = true, .tied = true, .layers = 2 }, 42);
}
END_TEST

/* 5) Forward without `saved` gives the same y; the buffer sizes are exact: every element of
 * saved is written, and nothing past saved or scratch is touched. */
static void run_saved_free(cfg_opts o, uint64_t seed)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, seed);
    const mt_model_config cfg = make_cfg(o);
    mt_tile_layout lay;
    mt_layout_build(&cfg, MT_TILE_LAYER, &lay);
    const int64_t nd = TEST_NTOK * cfg.hidden, guard = 64;
    const int64_t saved_n = mt_layer_saved_numel(&cfg, TEST_B, TEST_T);
    const int64_t scratch_n = mt_layer_scratch_numel(&cfg, TEST_B, TEST_T);
    double *tile = alloc_f64(lay.numel), *x = alloc_f64(nd), *y1 = alloc_f64(nd), *y2 = alloc_f64(nd);
    double *saved = alloc_f64(saved_n + guard), *scratch = alloc_f64(scratch_n + guard);
    fill_tile(&rng, &lay, tile, 0.3);
    mt_test_fill_f64(&rng, x, nd, 1.0);
    for (int64_t i = 0; i < saved_n + guard; i++) saved[i] = NAN;
    for (int64_t i = 0; i < scratch_n + guard; i++) scratch[i] = NAN;
    const double sentinel = 12345.678;
    for (int64_t i = 0; i < guard; i++) saved[saved_n + i] = scratch[scratch_n + i] = sentinel;

    mt_cpu_layer_forward_f64(&cfg, &lay, tile, TEST_B, TEST_T, x, y1, saved, scratch);
    for (int64_t i = 0; i < saved_n; i++) ck_assert_msg(!isnan(saved[i]), "saved[%ld] never written", (long)i);
    mt_cpu_layer_forward_f64(&cfg, &lay, tile, TEST_B, TEST_T, x, y2, NULL, scratch);
    const double e = mt_test_rel_err_f64(y2, y1, nd);
    fprintf(stderr, "saved-free forward %s: rel diff %.3e\n", cfg.model_type, e);
    ck_assert_msg(e <= 1e-14, "y without saved differs: rel %.3e", e);
    double *dx = alloc_f64(nd), *dtile = alloc_f64(lay.numel);
    memset(dtile, 0, (size_t)lay.numel * sizeof(double));
    mt_cpu_layer_backward_f64(&cfg, &lay, tile, TEST_B, TEST_T, saved, y1, dx, dtile, scratch);
    for (int64_t i = 0; i < nd; i++) ck_assert(isfinite(dx[i]));
    for (int64_t i = 0; i < guard; i++) {
        ck_assert_msg(saved[saved_n + i] == sentinel, "write past mt_layer_saved_numel");
        ck_assert_msg(scratch[scratch_n + i] == sentinel, "write past mt_layer_scratch_numel");
    }
    free(tile); free(x); free(y1); free(y2); free(saved); free(scratch); free(dx); free(dtile);
}

START_TEST(test_saved_free_forward)
{
    run_saved_free((cfg_opts){ .family = MT_FAMILY_QWEN2, .qkv_bias = true, .layers = 1 }, 51);
    run_saved_free((cfg_opts){ .family = MT_FAMILY_QWEN3, .qk_norm = true, .layers = 1 }, 52);
    run_saved_free((cfg_opts){ .family = MT_FAMILY_LLAMA, .layers = 1 }, 53);
    run_saved_free((cfg_opts){ .family = MT_FAMILY_QWEN2, .qkv_bias = true, .layers = 1, .mlp_chunk = 3 }, 54);
    run_saved_free((cfg_opts){ .family = MT_FAMILY_LLAMA, .layers = 1, .mlp_chunk = 1 }, 55);
}
END_TEST

/* 6) The dense MLP in token chunks gives the bits of the whole: y (kept and not), dx and every
 * weight gradient of the fp32 layer with the MLP run 1, 3, 7, n and more than n tokens at a time
 * are those with it run over all n tokens at once, g and u kept. Widths with every path of the
 * fixed-order products (vector blocks, a lone vector, scalar tails), rows not a multiple of their
 * blocks, and a length past their reduction block. */
static void run_mlp_chunk_bitwise(int64_t B, int64_t T, int64_t d, int64_t inter, uint64_t seed)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, seed);
    mt_model_config cfg = make_cfg((cfg_opts){ .family = MT_FAMILY_QWEN2, .qkv_bias = true, .layers = 1 });
    cfg.hidden = d;
    cfg.intermediate = inter;
    cfg.max_positions = T;
    mt_tile_layout lay;
    mt_layout_build(&cfg, MT_TILE_LAYER, &lay);
    const int64_t nd = B * T * d, n = B * T;
    double *tile64 = alloc_f64(lay.numel), *x64 = alloc_f64(nd), *R64 = alloc_f64(nd);
    fill_tile(&rng, &lay, tile64, 0.3);
    mt_test_fill_f64(&rng, x64, nd, 1.0);
    mt_test_fill_f64(&rng, R64, nd, 1.0);
    float *tile = to_f32(tile64, lay.numel), *x = to_f32(x64, nd), *R = to_f32(R64, nd);
    float *want_y = NULL, *want_dx = NULL, *want_dtile = NULL;
    const int64_t chunks[] = { 0, 1, 3, 7, n, n + 5 };
    for (size_t ci = 0; ci < sizeof chunks / sizeof chunks[0]; ci++) {
        cfg.mlp_chunk = chunks[ci];
        const int64_t saved_n = mt_layer_saved_numel(&cfg, B, T), scratch_n = mt_layer_scratch_numel(&cfg, B, T);
        float *saved = mt_xmalloc(sizeof(float) * (size_t)saved_n), *scratch = mt_xmalloc(sizeof(float) * (size_t)scratch_n);
        float *y = mt_xmalloc(sizeof(float) * (size_t)nd), *y2 = mt_xmalloc(sizeof(float) * (size_t)nd);
        float *dx = mt_xmalloc(sizeof(float) * (size_t)nd), *dtile = calloc((size_t)lay.numel, sizeof(float));
        mt_cpu_layer_forward_f32(&cfg, &lay, tile, B, T, x, y, saved, scratch);
        mt_cpu_layer_forward_f32(&cfg, &lay, tile, B, T, x, y2, NULL, scratch);
        mt_cpu_layer_backward_f32(&cfg, &lay, tile, B, T, saved, R, dx, dtile, scratch);
        ck_assert_msg(memcmp(y, y2, sizeof(float) * (size_t)nd) == 0, "chunk %lld: y with and without saved differ",
                      (long long)chunks[ci]);
        if (ci == 0) {
            want_y = y;
            want_dx = dx;
            want_dtile = dtile;
            mt_model_config chunked = cfg;
            chunked.mlp_chunk = 1;
            /* g and u are not kept when chunked */
            ck_assert_int_eq(saved_n - mt_layer_saved_numel(&chunked, B, T), 2 * n * inter);
        } else {
            ck_assert_msg(memcmp(y, want_y, sizeof(float) * (size_t)nd) == 0, "chunk %lld: y differs",
                          (long long)chunks[ci]);
            ck_assert_msg(memcmp(dx, want_dx, sizeof(float) * (size_t)nd) == 0, "chunk %lld: dx differs",
                          (long long)chunks[ci]);
            for (int sl = 0; sl < lay.ntensors; sl++) {
                const mt_tensor_desc *t = &lay.tensors[sl];
                ck_assert_msg(memcmp(dtile + t->offset, want_dtile + t->offset, sizeof(float) * (size_t)t->numel) == 0,
                              "chunk %lld: the gradient of %s differs", (long long)chunks[ci], t->name);
            }
            free(y);
            free(dx);
            free(dtile);
        }
        free(y2);
        free(saved);
        free(scratch);
    }
    fprintf(stderr, "dense MLP in chunks of 1, 3, 7, %lld and %lld tokens: the bits of the whole (B %lld, T %lld, d %lld, "
            "I %lld)\n", (long long)n, (long long)(n + 5), (long long)B, (long long)T, (long long)d, (long long)inter);
    free(want_y); free(want_dx); free(want_dtile);
    free(tile64); free(x64); free(R64); free(tile); free(x); free(R);
}

START_TEST(test_mlp_chunk_bitwise)
{
    run_mlp_chunk_bitwise(2, 13, 40, 70, 61);
    run_mlp_chunk_bitwise(1, 150, 20, 27, 62); /* 150 tokens: past the 128 of a reduction block */
}
END_TEST

static Suite *model_suite(void)
{
    Suite *s = suite_create("model");
    TCase *layer = tcase_create("layer");
    tcase_add_test(layer, test_layer_grad_qwen2);
    tcase_add_test(layer, test_layer_grad_llama);
    tcase_add_test(layer, test_layer_grad_qwen3);
    tcase_add_test(layer, test_saved_free_forward);
    tcase_add_test(layer, test_layer_grad_mlp_chunk);
    tcase_add_test(layer, test_mlp_chunk_bitwise);
    suite_add_tcase(s, layer);
    TCase *head = tcase_create("head");
    tcase_add_test(head, test_head_untied);
    tcase_add_test(head, test_head_tied);
    suite_add_tcase(s, head);
    TCase *model = tcase_create("tiny_model");
    tcase_add_test(model, test_tiny_model_untied);
    tcase_add_test(model, test_tiny_model_tied);
    tcase_add_test(model, test_tiny_model_qwen3);
    tcase_add_test(model, test_f32_matches_f64);
    suite_add_tcase(s, model);
    return s;
}

int main(void)
{
    return mt_test_run(model_suite(), false);
}
