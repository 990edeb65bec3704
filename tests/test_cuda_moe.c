/* Check suite of the CUDA mixture-of-experts path (backends/cuda/moe_routing.cu, moe.cu, and the
 * decoder layer of layer.cu on a sparse layout) against the double CPU reference
 * (backends/cpu/moe.inc, moe.c, layer.inc) on fresh random inputs:
 *   routing: the softmax (fp32, another summation order), the top k with ties and NaN, the
 *     grouping by expert (bitwise the CPU's order and offsets, pos its inverse), and the
 *     load-balancing loss's statistics (up to 256 experts: several blocks of 32);
 *   the MoE block alone and the whole layer, forward output, input gradient and every weight
 *     gradient (= and +=), under imbalanced routing (a few experts take most tokens, one none),
 *     every token to one expert, and top k = the number of experts. bf16 within BF16_TOL (the
 *     dense CUDA layer's bound, tests/test_cuda.c; bias gradients BF16_BIAS_TOL), fp32
 *     (MT_CUDA_F32) within F32_TOL;
 *   the load-balancing loss in the layer: the statistics its forward adds (the assignment counts
 *     exactly, the probability sums within the tolerance) and its backward with the counts of a
 *     whole call (the router gradient's share of the loss, dx and every weight gradient).
 * The inputs make the routing decided by a wide margin: each token's hidden state is high at
 * the coordinates of the experts it is meant to choose and low at the others, and the router
 * reads those coordinates, so bf16 rounding cannot change a choice (a changed choice is not an
 * error of the kernels but would fail the comparison).
 * Then the whole step of a two-layer all-sparse model, and of a three-layer one whose middle layer
 * is dense, on a CUDA worker against CPU workers (its memory plan, the loss, and in fp32 every
 * gradient tile), without and with the load-balancing loss.
 * MT_CUDA_BENCH=1 adds the timing of the block at the Qwen3-30B-A3B layer shape. Every check
 * prints one line. Without a CUDA device it prints "no GPU: skipped" and exits 77. */
#include <check.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cpu/ops.h"
#include "backends/cuda/kernels.h"
#include "models/config.h"
#include "models/layout.h"
#include "models/util.h"
#include "runtime/plan.h"
#include "runtime/runtime.h"
#include "runtime/state.h"
#include "runtime/step.h"
#include "tests/cuda_testutil.h"
#include "tests/testutil.h"

#define BF16_TOL 1e-2 /* ||gpu - ref|| / ||ref|| per tensor where the GPU feeds bf16 to GEMMs */
/* A bias gradient sums the output gradient over the tokens, whose terms largely cancel: in bf16
 * its relative error is larger, as the dense layer's (tests/test_cuda.c, whose bound this is;
 * gpt_oss's k_proj.bias came out at 1.09e-2 on an H200) */
#define BF16_BIAS_TOL 2e-2
#define F32_TOL 1e-5  /* the same on the fp32 path */
#define SOFTMAX_TOL 1e-6 /* fp32 softmax, another summation order */
#define STATS_TOL 1e-12  /* probability sums in double, another summation order */

/* The layer tests' shape: d and the expert widths no multiple of 64 where it matters (an expert
 * width whose Ie * d is no multiple of MT_TILE_ALIGN keeps gate and up apart in the tile). */
enum { MD = 100, MB = 2, MT = 37, MBLOCK_N = 150 };

/* ---------- configs and inputs ---------- */

/* A one-layer qwen3_moe config (q/k norm) at d = MD: E experts of width Ie, top k; or with
 * gpt_oss a gpt_oss one: a window of 9 keys on its layer 0, sinks, o_proj, router and expert
 * biases, and the clamped SwiGLU at a limit low enough that some gates and ups reach it (in fp32:
 * set_clamp_for). */
static mt_model_config moe_config(int64_t E, int64_t k, int64_t Ie, bool norm_topk, bool gpt_oss)
{
    char json[768], err[512] = "";
    if (gpt_oss)
        snprintf(json, sizeof json,
                 "{\"model_type\": \"gpt_oss\", \"hidden_size\": %d, \"intermediate_size\": %lld,"
                 " \"num_hidden_layers\": 1, \"num_attention_heads\": 2, \"num_key_value_heads\": 1, \"head_dim\": 64,"
                 " \"vocab_size\": 50, \"max_position_embeddings\": 4096, \"sliding_window\": 9,"
                 " \"num_local_experts\": %lld, \"num_experts_per_tok\": %lld,"
                 " \"output_router_logits\": false}",
                 (int)MD, (long long)Ie, (long long)E, (long long)k);
    else
        snprintf(json, sizeof json,
             "{\"model_type\": \"qwen3_moe\", \"hidden_size\": %d, \"intermediate_size\": 160,"
             " \"num_hidden_layers\": 1, \"num_attention_heads\": 2, \"num_key_value_heads\": 1, \"head_dim\": 64,"
             " \"vocab_size\": 50, \"max_position_embeddings\": 4096, \"rms_norm_eps\": 1e-6,"
             " \"num_experts\": %lld, \"num_experts_per_tok\": %lld, \"moe_intermediate_size\": %lld,"
             " \"norm_topk_prob\": %s, \"output_router_logits\": false}",
             (int)MD, (long long)E, (long long)k, (long long)Ie, norm_topk ? "true" : "false");
    mt_model_config cfg;
    ck_assert_msg(mt_config_parse(json, "test_cuda_moe", &cfg, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(mt_config_sparse_layers(&cfg), 1);
    /* a config's limit is transformers' 7.0, which these random gates never reach */
    if (gpt_oss) cfg.swiglu_limit = 0.05;
    return cfg;
}

/* The clamp's limit of a case at a precision. In bf16, a gate or up within bf16's rounding of
 * the limit lands on the other side of it than in double, and its gradient element is then all
 * or nothing: at 0.05 enough of them do to take a tensor past any bf16 bound (5e-2 seen on an
 * H100). The kernels clamp in fp32 after loading either type (backends/cuda/moe.cu), so the fp32
 * run checks the clamp at 0.05, and the bf16 run the rest of gpt_oss (biases, sinks, the window)
 * at the config's 7.0, which no gate reaches. */
static void set_clamp_for(mt_model_config *cfg, bool gpt_oss, bool f32)
{
    if (gpt_oss && !f32) cfg->swiglu_limit = 7.0;
}

/* How the tokens are meant to choose: popularity[e] the relative chance that a token takes
 * expert e (0: never); k distinct experts per token, drawn without replacement. */
typedef struct routing_case {
    const char *name;
    int64_t E, k, Ie;
    bool norm_topk;
    double popularity[16];
    bool gpt_oss; /* a gpt_oss layer (moe_config) */
} routing_case;

static const routing_case CASES[] = {
    /* experts 0-2 take most tokens, 3-14 few, 15 none; gate/up apart in the tile (42 * 100) */
    {"imbalanced, E=16 k=4, expert 15 unused", 16, 4, 42, true,
     {40, 30, 20, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0}, false},
    /* every token to expert 3 and no other: the router's gradient without renormalisation */
    {"every token to expert 3, E=8 k=1", 8, 1, 64, false, {0, 0, 0, 1, 0, 0, 0, 0}, false},
    /* every expert for every token */
    {"top k = E = 4", 4, 4, 48, true, {1, 1, 1, 1}, false},
    /* gpt_oss: biases, sinks, a sliding window, the clamped SwiGLU; imbalanced, expert 7 unused */
    {"gpt_oss, E=8 k=2, expert 7 unused", 8, 2, 40, true, {20, 10, 5, 1, 1, 1, 1, 0}, true},
};
#define NCASES ((int)(sizeof CASES / sizeof CASES[0]))

/* chosen (n, E) 0/1: each token's k experts drawn by popularity. */
static void draw_choices(mt_test_rng *rng, const routing_case *rc, int64_t n, unsigned char *chosen)
{
    memset(chosen, 0, (size_t)(n * rc->E));
    for (int64_t t = 0; t < n; t++)
        for (int64_t j = 0; j < rc->k; j++) {
            double total = 0;
            for (int64_t e = 0; e < rc->E; e++) total += chosen[t * rc->E + e] ? 0 : rc->popularity[e];
            if (total <= 0) { /* fewer popular experts than k: the lowest free index */
                for (int64_t e = 0; e < rc->E; e++)
                    if (!chosen[t * rc->E + e]) {
                        chosen[t * rc->E + e] = 1;
                        break;
                    }
                continue;
            }
            double u = mt_test_uniform(rng) * total;
            int64_t pick = -1;
            for (int64_t e = 0; e < rc->E; e++) {
                if (chosen[t * rc->E + e] || rc->popularity[e] <= 0) continue;
                pick = e;
                u -= rc->popularity[e];
                if (u < 0) break;
            }
            chosen[t * rc->E + pick] = 1;
        }
}

/* Rows (n, d) of a hidden state whose first E coordinates carry the choice: +1.5 at a chosen
 * expert, -1.5 at the others (each +- N(0, 0.3)); the rest N(0, 1). */
static void designed_rows(mt_test_rng *rng, const routing_case *rc, int64_t n, int64_t d, float *x)
{
    unsigned char *chosen = mt_xcalloc(1, (size_t)(n * rc->E));
    draw_choices(rng, rc, n, chosen);
    for (int64_t t = 0; t < n; t++)
        for (int64_t j = 0; j < d; j++)
            x[t * d + j] = j < rc->E ? (float)((chosen[t * rc->E + j] ? 1.5 : -1.5) + 0.3 * mt_test_normal(rng))
                                     : (float)mt_test_normal(rng);
    free(chosen);
}

/* The router reads coordinate e for expert e (weight 2), plus N(0, 0.01) everywhere. */
static void designed_router(mt_test_rng *rng, const mt_model_config *cfg, const mt_tile_layout *lay, float *tile)
{
    float *r = tile + lay->tensors[MT_L_ROUTER_W].offset;
    for (int64_t e = 0; e < cfg->experts; e++)
        for (int64_t j = 0; j < cfg->hidden; j++)
            r[e * cfg->hidden + j] = (float)((j == e ? 2.0 : 0.0) + 0.01 * mt_test_normal(rng));
}

static double *widen(const float *x, int64_t n) { return mt_test_to_f64(x, n); }

/* One line: the relative error of a against the double reference b. */
static void check_vs(const char *what, const float *a, const double *b, int64_t n, double tol)
{
    mt_test_report(what, mt_test_rel_err_mixed(a, b, n), tol);
}

/* Every present tensor of a gradient tile from slot `first` on against the reference; `tag` ends
 * each line. */
static void check_tile(const char *prefix, const char *tag, const mt_tile_layout *lay, int first, const float *dtile,
                       const double *ref, double tol)
{
    char what[160];
    for (int t = first; t < lay->ntensors; t++) {
        const mt_tensor_desc *desc = &lay->tensors[t];
        if (desc->numel == 0) continue;
        snprintf(what, sizeof what, "%sd %s (%s)", prefix, desc->name, tag);
        check_vs(what, dtile + desc->offset, ref + desc->offset, desc->numel,
                 tol == BF16_TOL && strstr(desc->name, "bias") ? BF16_BIAS_TOL : tol);
    }
}

#define MIN_MARGIN 0.5 /* log p of a token's k-th expert over its (k+1)-th, at least */

/* Prints how many tokens each expert took in the reference's routing (probs (n, E)) and the
 * smallest margin of a choice, log p_(k) - log p_(k+1) over the tokens; asserts that the experts
 * meant to be unused took none and that no choice was close (the inputs' design holds). */
static void report_routing(const routing_case *rc, const mt_model_config *cfg, int64_t n, const double *probs)
{
    const int64_t E = cfg->experts, k = cfg->experts_per_token;
    int32_t *experts = mt_xcalloc((size_t)(n * k), sizeof(int32_t));
    double *w = mt_test_alloc_f64(n * k);
    mt_cpu_router_topk_f64(n, E, k, cfg->norm_topk_prob, probs, experts, w);
    int64_t load[MT_MAX_EXPERTS] = {0};
    double margin = INFINITY;
    for (int64_t t = 0; t < n; t++) {
        double pk = INFINITY, next = 0;
        for (int64_t j = 0; j < k; j++) {
            load[experts[t * k + j]]++;
            pk = fmin(pk, probs[t * E + experts[t * k + j]]);
        }
        for (int64_t e = 0; e < E; e++) {
            bool in = false;
            for (int64_t j = 0; j < k; j++) in = in || experts[t * k + j] == e;
            if (!in) next = fmax(next, probs[t * E + e]);
        }
        if (k < E) margin = fmin(margin, log(pk) - log(next));
    }
    printf("  tokens per expert:");
    for (int64_t e = 0; e < E; e++) printf(" %lld", (long long)load[e]);
    printf("; smallest routing margin %.2f (at least %.1f)\n", margin, MIN_MARGIN);
    fflush(stdout);
    for (int64_t e = 0; e < E; e++)
        if (rc->popularity[e] <= 0 && rc->k < rc->E)
            ck_assert_msg(load[e] == 0, "expert %lld was meant to take no token, took %lld", (long long)e,
                          (long long)load[e]);
    ck_assert_msg(margin >= MIN_MARGIN, "a routing choice within %.3f of the next expert", margin);
    free(experts), free(w);
}

/* The router probabilities in the CPU layer's saved set (its order: backends/cpu/layer.inc). */
static const double *layer_saved_probs(const mt_model_config *cfg, int64_t n, const double *saved)
{
    const int64_t d = cfg->hidden, qd = cfg->heads * cfg->head_dim, kvd = cfg->kv_heads * cfg->head_dim;
    return saved + n * d + n + n * qd + 2 * n * kvd + n * qd + n * cfg->heads + n * d + n;
}

/* ---------- routing pieces ---------- */

static bool same_or_both_nan(float a, float b) { return (isnan(a) && isnan(b)) || memcmp(&a, &b, sizeof a) == 0; }

static void run_routing_case(int64_t n, int64_t E, int64_t k, uint64_t seed)
{
    printf("routing: n=%lld E=%lld k=%lld\n", (long long)n, (long long)E, (long long)k);
    mt_test_rng rng;
    mt_test_rng_seed(&rng, seed);
    const int64_t nE = n * E, nk = n * k;
    cudaStream_t st = mt_test_new_stream();
    const mt_cuda_stream s = (mt_cuda_stream)st;

    /* softmax of N(0, 3) logits */
    float *logits = mt_test_random_f32(&rng, nE, 3.0f), *probs_cpu = mt_test_alloc_f32(nE);
    mt_cpu_router_softmax_f32(n, E, logits, probs_cpu);
    float *d_logits = mt_test_gpu_buffer(logits, (size_t)nE * 4), *d_probs = mt_test_gpu_buffer(NULL, (size_t)nE * 4);
    mt_cuda_router_softmax(n, E, d_logits, d_probs, s);
    CK_CUDA(cudaStreamSynchronize(st));
    float *probs = mt_test_download_f32(d_probs, nE);
    mt_test_check_close("softmax vs CPU", probs, probs_cpu, nE, SOFTMAX_TOL);

    /* top k over values with many ties (multiples of 1/8), a few NaN, one row all equal */
    float *p = mt_test_alloc_f32(nE);
    for (int64_t i = 0; i < nE; i++) p[i] = (float)floor(mt_test_uniform(&rng) * 8.0) / 8.0f;
    for (int64_t i = 0; i < nE; i += 997) p[i] = NAN;
    for (int64_t e = 0; e < E; e++) p[(n / 2) * E + e] = 0.25f;
    CK_CUDA(cudaMemcpy(d_probs, p, (size_t)nE * 4, cudaMemcpyHostToDevice));
    int32_t *d_experts = mt_test_gpu_buffer(NULL, (size_t)nk * 4);
    float *d_w = mt_test_gpu_buffer(NULL, (size_t)nk * 4);
    int32_t *ex_cpu = mt_xcalloc((size_t)nk, 4), *ex = mt_xcalloc((size_t)nk, 4);
    float *w_cpu = mt_test_alloc_f32(nk);
    for (int renorm = 0; renorm < 2; renorm++) {
        mt_cpu_router_topk_f32(n, E, k, renorm, p, ex_cpu, w_cpu);
        mt_cuda_router_topk(n, E, k, renorm, d_probs, d_experts, d_w, s);
        CK_CUDA(cudaStreamSynchronize(st));
        CK_CUDA(cudaMemcpy(ex, d_experts, (size_t)nk * 4, cudaMemcpyDeviceToHost));
        float *w = mt_test_download_f32(d_w, nk);
        char what[96];
        snprintf(what, sizeof what, "top k experts (ties, NaN), renormalise=%d", renorm);
        mt_test_check_bitwise(what, ex, ex_cpu, (size_t)nk * 4);
        int64_t bad = 0;
        for (int64_t a = 0; a < nk; a++) bad += !same_or_both_nan(w[a], w_cpu[a]);
        printf("  %-52s %lld differ\n", renorm ? "top k weights, renormalised, bitwise" : "top k weights, bitwise",
               (long long)bad);
        ck_assert_msg(bad == 0, "%lld top-k weights differ from the CPU's", (long long)bad);
        free(w);
    }

    /* grouping: from the top k of skewed probabilities (expert 0 everyone's first choice) */
    for (int64_t i = 0; i < nE; i++) p[i] = (float)mt_test_uniform(&rng) * ((i % E) == 0 ? 4.0f : 1.0f);
    mt_cpu_router_topk_f32(n, E, k, true, p, ex_cpu, w_cpu);
    CK_CUDA(cudaMemcpy(d_experts, ex_cpu, (size_t)nk * 4, cudaMemcpyHostToDevice));
    int32_t *off_cpu = mt_xcalloc((size_t)(E + 1), 4), *ord_cpu = mt_xcalloc((size_t)nk, 4);
    mt_moe_group(n, E, k, ex_cpu, off_cpu, ord_cpu);
    int32_t *d_off = mt_test_gpu_buffer(NULL, (size_t)(E + 1) * 4), *d_ord = mt_test_gpu_buffer(NULL, (size_t)nk * 4);
    int32_t *d_pos = mt_test_gpu_buffer(NULL, (size_t)nk * 4);
    void *d_ws = mt_test_gpu_buffer(NULL, mt_cuda_moe_group_workspace_bytes(n, E, k));
    mt_cuda_moe_group(n, E, k, d_experts, d_off, d_ord, d_pos, d_ws, s);
    CK_CUDA(cudaStreamSynchronize(st));
    int32_t *off = mt_xcalloc((size_t)(E + 1), 4), *ord = mt_xcalloc((size_t)nk, 4), *pos = mt_xcalloc((size_t)nk, 4);
    CK_CUDA(cudaMemcpy(off, d_off, (size_t)(E + 1) * 4, cudaMemcpyDeviceToHost));
    CK_CUDA(cudaMemcpy(ord, d_ord, (size_t)nk * 4, cudaMemcpyDeviceToHost));
    CK_CUDA(cudaMemcpy(pos, d_pos, (size_t)nk * 4, cudaMemcpyDeviceToHost));
    mt_test_check_bitwise("grouping offsets vs mt_moe_group", off, off_cpu, (size_t)(E + 1) * 4);
    mt_test_check_bitwise("grouping order vs mt_moe_group", ord, ord_cpu, (size_t)nk * 4);
    int64_t bad = 0;
    for (int64_t a = 0; a < nk; a++) bad += pos[a] < 0 || pos[a] >= nk || ord[pos[a]] != a;
    printf("  %-52s %lld wrong\n", "grouping pos: order[pos[a]] == a", (long long)bad);
    ck_assert_msg(bad == 0, "pos is not the inverse of order at %lld assignments", (long long)bad);

    /* the load-balancing loss's statistics of those probabilities and offsets, added onto random
     * ones (as another layer leaves them) twice from the same start: the counts exactly, the
     * sums against a double sum in row order, the two runs bitwise */
    const int64_t E2 = 2 * E;
    double *stats0 = mt_test_alloc_f64(E2), *want = mt_test_alloc_f64(E2);
    for (int64_t e = 0; e < E; e++) {
        stats0[e] = floor(mt_test_uniform(&rng) * (double)nk);
        stats0[E + e] = mt_test_uniform(&rng) * (double)n;
        want[e] = stats0[e] + (double)(off_cpu[e + 1] - off_cpu[e]);
        double sum = 0;
        for (int64_t r = 0; r < n; r++) sum += (double)p[r * E + e];
        want[E + e] = stats0[E + e] + sum;
    }
    CK_CUDA(cudaMemcpy(d_probs, p, (size_t)nE * 4, cudaMemcpyHostToDevice));
    double *d_stats = mt_test_gpu_buffer(stats0, (size_t)E2 * 8), *d_stats2 = mt_test_gpu_buffer(stats0, (size_t)E2 * 8);
    mt_cuda_router_stats(n, E, d_probs, d_off, d_stats, s);
    mt_cuda_router_stats(n, E, d_probs, d_off, d_stats2, s);
    CK_CUDA(cudaStreamSynchronize(st));
    double *stats = mt_test_alloc_f64(E2), *stats2 = mt_test_alloc_f64(E2);
    CK_CUDA(cudaMemcpy(stats, d_stats, (size_t)E2 * 8, cudaMemcpyDeviceToHost));
    CK_CUDA(cudaMemcpy(stats2, d_stats2, (size_t)E2 * 8, cudaMemcpyDeviceToHost));
    mt_test_check_bitwise("aux statistics: counts vs the grouping's", stats, want, (size_t)E * 8);
    mt_test_report("aux statistics: probability sums vs double", mt_test_rel_err_f64(stats + E, want + E, E),
                   STATS_TOL);
    mt_test_check_bitwise("aux statistics, run twice", stats, stats2, (size_t)E2 * 8);

    void *bufs[] = {d_logits, d_probs, d_experts, d_w, d_off, d_ord, d_pos, d_ws, d_stats, d_stats2};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) CK_CUDA(cudaFree(bufs[i]));
    CK_CUDA(cudaStreamDestroy(st));
    void *hbufs[] = {logits, probs_cpu, probs, p, ex_cpu, ex, w_cpu, off_cpu, ord_cpu, off, ord, pos,
                     stats0, want, stats, stats2};
    for (size_t i = 0; i < sizeof hbufs / sizeof hbufs[0]; i++) free(hbufs[i]);
}

START_TEST(test_routing)
{
    run_routing_case(1000, 128, 8, 1);  /* Qwen3-MoE's router: 32 grouping chunks */
    run_routing_case(333, 256, 256, 2); /* the widest router, every expert chosen */
    run_routing_case(77, 5, 2, 3);
    run_routing_case(300, 8, 1, 4);
}
END_TEST

/* ---------- the MoE block alone ---------- */

static void run_block_prec(const routing_case *rc, mt_cuda_prec prec, uint64_t seed)
{
    const bool f32 = prec == MT_CUDA_F32;
    const double tol = f32 ? F32_TOL : BF16_TOL;
    mt_model_config cfg = moe_config(rc->E, rc->k, rc->Ie, rc->norm_topk, rc->gpt_oss);
    set_clamp_for(&cfg, rc->gpt_oss, f32);
    mt_tile_layout lay;
    mt_layout_build(&cfg, MT_TILE_LAYER, &lay);
    ck_assert(mt_layout_is_sparse(&lay));
    const int64_t n = MBLOCK_N, d = cfg.hidden, E = cfg.experts, k = cfg.experts_per_token;
    const int64_t Ie = cfg.expert_intermediate, nd = n * d;
    printf("MoE block, %s, %s: n=%lld d=%lld E=%lld k=%lld Ie=%lld norm_topk_prob=%d\n", rc->name,
           f32 ? "fp32" : "bf16", (long long)n, (long long)d, (long long)E, (long long)k, (long long)Ie,
           cfg.norm_topk_prob);
    mt_test_rng rng;
    mt_test_rng_seed(&rng, seed);
    float *tile = mt_test_random_tile(&rng, &lay, 0.1f, false);
    designed_router(&rng, &cfg, &lay, tile);
    float *hn = mt_test_alloc_f32(nd), *dy = mt_test_random_f32(&rng, nd, 1.0f);
    designed_rows(&rng, rc, n, d, hn);
    if (!f32) { /* the CPU sees exactly the GPU's operands */
        mt_test_round_bf16(tile, lay.numel, NULL);
        mt_test_round_bf16(hn, nd, NULL);
        mt_test_round_bf16(dy, nd, NULL);
    }

    /* double reference */
    double *tile64 = widen(tile, lay.numel), *hn64 = widen(hn, nd), *dy64 = widen(dy, nd);
    double *probs64 = mt_test_alloc_f64(n * E), *y64 = mt_test_alloc_f64(nd), *dhn64 = mt_test_alloc_f64(nd);
    double *g64 = mt_test_alloc_f64(n * k * Ie), *u64 = mt_test_alloc_f64(n * k * Ie);
    double *dtile64 = mt_test_alloc_f64(lay.numel);
    const int64_t fs = mt_moe_forward_scratch_numel(&cfg, n, true), bs = mt_moe_backward_scratch_numel(&cfg, n);
    double *scr64 = mt_test_alloc_f64(fs > bs ? fs : bs);
    mt_cpu_moe_forward_f64(&cfg, &lay, tile64, n, hn64, probs64, y64, g64, u64, NULL, scr64);
    mt_cpu_moe_backward_f64(&cfg, &lay, tile64, n, hn64, probs64, g64, u64, dy64, NULL, 0.0, dhn64, dtile64, scr64);
    report_routing(rc, &cfg, n, probs64);

    cudaStream_t st = mt_test_new_stream();
    const mt_cuda_stream s = (mt_cuda_stream)st;
    mt_cuda_ctx *ctx = mt_cuda_ctx_get();
    const size_t es = f32 ? 4 : 2, tile_bytes = (size_t)lay.numel * 4;
    mt_bf16 *tile_bits = mt_test_bf16_of(tile, lay.numel), *hn_bits = mt_test_bf16_of(hn, nd);
    mt_bf16 *dy_bits = mt_test_bf16_of(dy, nd);
    void *d_tile = mt_test_gpu_buffer(f32 ? (void *)tile : (void *)tile_bits, (size_t)lay.numel * es);
    void *d_hn = mt_test_gpu_buffer(f32 ? (void *)hn : (void *)hn_bits, (size_t)nd * es);
    void *d_dy = mt_test_gpu_buffer(f32 ? (void *)dy : (void *)dy_bits, (size_t)nd * es);
    float *d_y = mt_test_gpu_buffer(NULL, (size_t)nd * 4), *d_y2 = mt_test_gpu_buffer(NULL, (size_t)nd * 4);
    float *d_dhn = mt_test_gpu_buffer(NULL, (size_t)nd * 4);
    void *d_saved = mt_test_gpu_buffer(NULL, mt_cuda_moe_saved_bytes(&cfg, prec, n));
    const size_t scratch_bytes = mt_cuda_moe_scratch_bytes(&cfg, prec, n);
    void *d_scratch = mt_test_gpu_buffer(NULL, scratch_bytes);
    float *d_dtile = mt_test_gpu_buffer(NULL, tile_bytes);
    CK_CUDA(cudaMemset(d_dtile, 0, tile_bytes)); /* the block adds (+=) */

    mt_cuda_moe_forward(ctx, &cfg, &lay, prec, d_tile, n, d_hn, NULL, d_y, NULL, d_scratch, s); /* no saved */
    mt_cuda_moe_forward(ctx, &cfg, &lay, prec, d_tile, n, d_hn, NULL, d_y2, d_saved, d_scratch, s);
    mt_test_gpu_fill_nan(d_scratch, scratch_bytes, st); /* backward may not rely on it */
    mt_cuda_moe_backward(ctx, &cfg, &lay, prec, d_tile, n, d_hn, d_saved, d_dy, d_dhn, d_dtile, d_scratch, s);
    CK_CUDA(cudaStreamSynchronize(st));
    float *y = mt_test_download_f32(d_y, nd), *y2 = mt_test_download_f32(d_y2, nd);
    float *dhn = mt_test_download_f32(d_dhn, nd), *dtile = mt_test_download_f32(d_dtile, lay.numel);
    check_vs("block forward y", y, y64, nd, tol);
    mt_test_check_bitwise("block forward y, saved vs no saved", y, y2, (size_t)nd * 4);
    check_vs("block backward dhn", dhn, dhn64, nd, tol);
    check_tile("block ", "+= onto 0", &lay, MT_L_ROUTER_W, dtile, dtile64, tol);
    mt_test_check_padding_zero("block dtile padding", &lay, dtile);

    /* again onto the first result: twice the reference, dhn (=) the same bits */
    mt_cuda_moe_backward(ctx, &cfg, &lay, prec, d_tile, n, d_hn, d_saved, d_dy, d_dhn, d_dtile, d_scratch, s);
    CK_CUDA(cudaStreamSynchronize(st));
    float *dtile2 = mt_test_download_f32(d_dtile, lay.numel), *dhn2 = mt_test_download_f32(d_dhn, nd);
    for (int64_t i = 0; i < lay.numel; i++) dtile64[i] *= 2.0;
    check_tile("block ", "+= twice", &lay, MT_L_ROUTER_W, dtile2, dtile64, tol);
    mt_test_check_bitwise("block dhn (=), backward run twice", dhn2, dhn, (size_t)nd * 4);

    void *bufs[] = {d_tile, d_hn, d_dy, d_y, d_y2, d_dhn, d_saved, d_scratch, d_dtile};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) CK_CUDA(cudaFree(bufs[i]));
    CK_CUDA(cudaStreamDestroy(st));
    void *hbufs[] = {tile, hn, dy, tile64, hn64, dy64, probs64, y64, dhn64, g64, u64, dtile64, scr64, tile_bits,
                     hn_bits, dy_bits, y, y2, dhn, dtile, dtile2, dhn2};
    for (size_t i = 0; i < sizeof hbufs / sizeof hbufs[0]; i++) free(hbufs[i]);
}

/* One case in one precision a run (_i: case _i / 2, bf16 then fp32), so that a failure hides no
 * other case. */
START_TEST(test_block)
{
    const int c = _i / 2;
    if (_i % 2) run_block_prec(&CASES[c], MT_CUDA_F32, 200 + (uint64_t)c);
    else run_block_prec(&CASES[c], MT_CUDA_BF16, 100 + (uint64_t)c);
}
END_TEST

/* ---------- the decoder layer on a sparse layout ---------- */

static void run_layer_prec(const routing_case *rc, mt_cuda_prec prec, uint64_t seed)
{
    const bool f32 = prec == MT_CUDA_F32;
    const double tol = f32 ? F32_TOL : BF16_TOL;
    mt_model_config cfg = moe_config(rc->E, rc->k, rc->Ie, rc->norm_topk, rc->gpt_oss);
    set_clamp_for(&cfg, rc->gpt_oss, f32);
    mt_tile_layout lay;
    mt_layout_build(&cfg, MT_TILE_LAYER, &lay);
    if (!f32) mt_layout_keep_norms_f32(&lay); /* as the bf16 step streams it: the norms in fp32 */
    const int64_t B = MB, T = MT, n = B * T, d = cfg.hidden, nd = n * d;
    printf("layer, %s, %s: B=%lld T=%lld d=%lld H=%lld KV=%lld D=%lld E=%lld k=%lld Ie=%lld\n", rc->name,
           f32 ? "fp32" : "bf16", (long long)B, (long long)T, (long long)d, (long long)cfg.heads,
           (long long)cfg.kv_heads, (long long)cfg.head_dim, (long long)cfg.experts, (long long)cfg.experts_per_token,
           (long long)cfg.expert_intermediate);
    mt_test_rng rng;
    mt_test_rng_seed(&rng, seed);
    float *tile = mt_test_random_tile(&rng, &lay, 0.05f, false);
    designed_router(&rng, &cfg, &lay, tile);
    if (!f32) mt_test_round_tile_bf16(tile, &lay);
    /* x carries the choice; attention (weights N(0, 0.05)) moves it far less than the margin */
    float *x = mt_test_alloc_f32(nd), *dy = mt_test_random_f32(&rng, nd, 1.0f);
    designed_rows(&rng, rc, n, d, x);

    double *tile64 = widen(tile, lay.numel), *x64 = widen(x, nd), *dy64 = widen(dy, nd);
    double *saved64 = mt_test_alloc_f64(mt_layer_saved_numel(&cfg, B, T));
    double *scr64 = mt_test_alloc_f64(mt_layer_scratch_numel(&cfg, B, T));
    double *y64 = mt_test_alloc_f64(nd), *dx64 = mt_test_alloc_f64(nd), *dtile64 = mt_test_alloc_f64(lay.numel);
    /* The load-balancing loss's statistics are added onto random ones, as another sparse layer of
     * the forward call leaves them (integer counts, positive sums). */
    const int64_t E = cfg.experts;
    double *stats0 = mt_test_alloc_f64(2 * E);
    for (int64_t e = 0; e < E; e++) {
        stats0[e] = floor(mt_test_uniform(&rng) * 3.0 * (double)n);
        stats0[E + e] = 1.0 + mt_test_uniform(&rng) * (double)n;
    }
    double *stats64 = mt_test_copy_f64(stats0, 2 * E);
    mt_cpu_layer_forward_aux_f64(&cfg, &lay, tile64, 0, B, T, x64, y64, saved64, scr64, stats64);
    mt_cpu_layer_backward_f64(&cfg, &lay, tile64, B, T, saved64, dy64, dx64, dtile64, scr64);
    report_routing(rc, &cfg, n, layer_saved_probs(&cfg, n, saved64));
    /* The backward with that loss: the counts of the whole call (stats64's first E) at the scale
     * that makes the loss's share of the router's gradient (linear in the scale) as large as the
     * rest of it, so that a wrong or missing share shows. */
    const mt_tensor_desc *router = &lay.tensors[MT_L_ROUTER_W];
    double *dx_aux64 = mt_test_alloc_f64(nd), *dtile_aux64 = mt_test_alloc_f64(lay.numel);
    double *share64 = mt_test_alloc_f64(router->numel);
    mt_cpu_layer_backward_aux_f64(&cfg, &lay, tile64, 0, B, T, saved64, dy64, dx_aux64, dtile_aux64, scr64, stats64, 1.0);
    double share_sq = 0, rest_sq = 0;
    for (int64_t i = 0; i < router->numel; i++) {
        const double g0 = dtile64[router->offset + i], share = dtile_aux64[router->offset + i] - g0;
        share_sq += share * share, rest_sq += g0 * g0;
    }
    ck_assert_msg(share_sq > 0 && rest_sq > 0, "the router's gradient has no share of the load-balancing loss");
    const double aux_scale = sqrt(rest_sq / share_sq);
    memset(dtile_aux64, 0, (size_t)lay.numel * sizeof(double));
    mt_cpu_layer_backward_aux_f64(&cfg, &lay, tile64, 0, B, T, saved64, dy64, dx_aux64, dtile_aux64, scr64, stats64,
                                  aux_scale);
    for (int64_t i = 0; i < router->numel; i++)
        share64[i] = dtile_aux64[router->offset + i] - dtile64[router->offset + i];

    cudaStream_t st = mt_test_new_stream();
    const mt_cuda_stream s = (mt_cuda_stream)st;
    mt_cuda_ctx *ctx = mt_cuda_ctx_get();
    const size_t vec_bytes = (size_t)nd * 4, tile_bytes = (size_t)lay.numel * 4;
    void *d_tile = mt_test_gpu_tile(tile, &lay, f32);
    float *d_x = mt_test_gpu_buffer(x, vec_bytes), *d_dy = mt_test_gpu_buffer(dy, vec_bytes);
    float *d_y = mt_test_gpu_buffer(NULL, vec_bytes), *d_y2 = mt_test_gpu_buffer(NULL, vec_bytes);
    float *d_dx = mt_test_gpu_buffer(NULL, vec_bytes);
    void *d_saved = mt_test_gpu_buffer(NULL, mt_cuda_layer_saved_bytes(&cfg, prec, B, T));
    const size_t scratch_bytes = mt_cuda_layer_scratch_bytes(&cfg, prec, B, T);
    void *d_scratch = mt_test_gpu_buffer(NULL, scratch_bytes);
    float *d_dtile = mt_test_gpu_buffer(NULL, tile_bytes), *d_dtile2 = mt_test_gpu_buffer(NULL, tile_bytes);

    mt_cuda_layer_forward(ctx, &cfg, &lay, prec, d_tile, B, T, d_x, d_y, NULL, d_scratch, s); /* no saved */
    mt_cuda_layer_forward(ctx, &cfg, &lay, prec, d_tile, B, T, d_x, d_y2, d_saved, d_scratch, s);
    mt_test_gpu_fill_nan(d_scratch, scratch_bytes, st);
    mt_cuda_layer_backward(ctx, &cfg, &lay, prec, d_tile, B, T, d_saved, d_dy, d_dx, d_dtile, false, d_scratch, s);
    mt_cuda_layer_backward(ctx, &cfg, &lay, prec, d_tile, B, T, d_saved, d_dy, d_dx, d_dtile2, false, d_scratch, s);
    CK_CUDA(cudaStreamSynchronize(st));
    float *y = mt_test_download_f32(d_y, nd), *y2 = mt_test_download_f32(d_y2, nd);
    float *dx = mt_test_download_f32(d_dx, nd);
    float *dtile = mt_test_download_f32(d_dtile, lay.numel), *dtile2 = mt_test_download_f32(d_dtile2, lay.numel);

    /* The residual dominates y and dx: the layer's own share (y - x, dx - dy) is checked too. */
    float *y_res = mt_test_alloc_f32(nd), *dx_res = mt_test_alloc_f32(nd);
    double *y64_res = mt_test_alloc_f64(nd), *dx64_res = mt_test_alloc_f64(nd);
    for (int64_t i = 0; i < nd; i++) {
        y_res[i] = y[i] - x[i], y64_res[i] = y64[i] - x64[i];
        dx_res[i] = dx[i] - dy[i], dx64_res[i] = dx64[i] - dy64[i];
    }
    check_vs("forward y", y, y64, nd, tol);
    check_vs("forward y - x", y_res, y64_res, nd, tol);
    mt_test_check_bitwise("forward y, saved vs no saved", y, y2, vec_bytes);
    check_vs("backward dx", dx, dx64, nd, tol);
    check_vs("backward dx - dy", dx_res, dx64_res, nd, tol);
    check_tile("", "=", &lay, 0, dtile, dtile64, tol);
    mt_test_check_padding_zero("dtile padding (=)", &lay, dtile);
    if (f32 || mt_cuda_attention_reproducible(ctx, B, T, cfg.heads, cfg.kv_heads, cfg.head_dim))
        mt_test_check_bitwise("dtile, backward run twice", dtile, dtile2, tile_bytes);
    else /* cuDNN's attention backward (float atomics on dQ) may change the last bits */
        mt_test_check_close("dtile, backward run twice (cuDNN attention)", dtile2, dtile, lay.numel, tol);

    mt_cuda_layer_backward(ctx, &cfg, &lay, prec, d_tile, B, T, d_saved, d_dy, d_dx, d_dtile, true, d_scratch, s);
    CK_CUDA(cudaStreamSynchronize(st));
    float *dtile_acc = mt_test_download_f32(d_dtile, lay.numel), *dx2 = mt_test_download_f32(d_dx, nd);
    for (int64_t i = 0; i < lay.numel; i++) dtile64[i] *= 2.0;
    check_tile("", "+=", &lay, 0, dtile_acc, dtile64, tol);
    mt_test_check_padding_zero("dtile padding (+=)", &lay, dtile_acc);
    mt_test_check_bitwise("dx (=) again in += mode", dx2, dx, vec_bytes);

    /* The load-balancing loss: the forward's statistics onto stats0, then the backward with the
     * CPU's counts and aux_scale (the saved set written again, the same bits). */
    const size_t stats_bytes = (size_t)(2 * E) * sizeof(double);
    double *d_stats = mt_test_gpu_buffer(stats0, stats_bytes), *d_counts = mt_test_gpu_buffer(stats64, stats_bytes);
    float *d_y3 = mt_test_gpu_buffer(NULL, vec_bytes);
    mt_cuda_layer_forward_aux(ctx, &cfg, &lay, prec, d_tile, 0, B, T, d_x, d_y3, d_saved, d_scratch, d_stats, s);
    mt_cuda_layer_backward_aux(ctx, &cfg, &lay, prec, d_tile, 0, B, T, d_saved, d_dy, d_dx, d_dtile, false, d_scratch,
                               d_counts, aux_scale, s);
    CK_CUDA(cudaStreamSynchronize(st));
    double *stats = mt_test_alloc_f64(2 * E);
    CK_CUDA(cudaMemcpy(stats, d_stats, stats_bytes, cudaMemcpyDeviceToHost));
    float *y3 = mt_test_download_f32(d_y3, nd), *dx_aux = mt_test_download_f32(d_dx, nd);
    float *dtile_aux = mt_test_download_f32(d_dtile, lay.numel), *share = mt_test_alloc_f32(router->numel);
    mt_test_check_bitwise("forward y, with the statistics vs without", y3, y2, vec_bytes);
    double count_diff = 0;
    double *sums = mt_test_alloc_f64(E), *sums64 = mt_test_alloc_f64(E);
    for (int64_t e = 0; e < E; e++) {
        count_diff = fmax(count_diff, fabs(stats[e] - stats64[e]));
        sums[e] = stats[E + e] - stats0[E + e], sums64[e] = stats64[E + e] - stats0[E + e];
    }
    mt_test_report("aux statistics: assignment counts (exactly)", count_diff, 0.0);
    mt_test_report("aux statistics: probability sums", mt_test_rel_err_f64(sums, sums64, E), tol);
    for (int64_t i = 0; i < router->numel; i++) share[i] = dtile_aux[router->offset + i] - dtile[router->offset + i];
    printf("  aux scale %.4g (the loss's share of the router's gradient as large as the rest)\n", aux_scale);
    check_vs("aux backward: the router gradient's share of the loss", share, share64, router->numel, tol);
    check_vs("aux backward dx", dx_aux, dx_aux64, nd, tol);
    check_tile("aux backward: ", "=", &lay, 0, dtile_aux, dtile_aux64, tol);

    void *bufs[] = {d_tile, d_x, d_dy, d_y, d_y2, d_dx, d_saved, d_scratch, d_dtile, d_dtile2, d_stats, d_counts,
                    d_y3};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) CK_CUDA(cudaFree(bufs[i]));
    CK_CUDA(cudaStreamDestroy(st));
    void *hbufs[] = {tile, x, dy, tile64, x64, dy64, saved64, scr64, y64, dx64, dtile64, y, y2, dx,
                     dtile, dtile2, y_res, dx_res, y64_res, dx64_res, dtile_acc, dx2, stats0, stats64, dx_aux64,
                     dtile_aux64, share64, stats, y3, dx_aux, dtile_aux, share, sums, sums64};
    for (size_t i = 0; i < sizeof hbufs / sizeof hbufs[0]; i++) free(hbufs[i]);
}

START_TEST(test_layer) /* as test_block: one case in one precision a run */
{
    const int c = _i / 2;
    if (_i % 2) run_layer_prec(&CASES[c], MT_CUDA_F32, 400 + (uint64_t)c);
    else run_layer_prec(&CASES[c], MT_CUDA_BF16, 300 + (uint64_t)c);
}
END_TEST

/* ---------- the whole step of a sparse model, GPU against CPU workers ---------- */

/* A two-layer qwen3_moe, every layer sparse (8 experts of width 96, top 2, renormalised); or with
 * `mixed` three layers whose middle one is dense (`mlp_only_layers`: an SwiGLU MLP of width 160),
 * so that the CUDA layer runs both layouts in one step, a dense layer between two sparse ones. */
static mt_model_config step_config(bool mixed)
{
    char err[512] = "", json[1024];
    snprintf(json, sizeof json,
             "{\"model_type\": \"qwen3_moe\", \"hidden_size\": 128, \"intermediate_size\": 160,"
             " \"num_hidden_layers\": %d, \"num_attention_heads\": 2, \"num_key_value_heads\": 1,"
             " \"head_dim\": 64, \"vocab_size\": 301, \"max_position_embeddings\": 512,"
             " \"rms_norm_eps\": 1e-6, \"num_experts\": 8, \"num_experts_per_tok\": 2,"
             " \"moe_intermediate_size\": 96, \"norm_topk_prob\": true, \"output_router_logits\": false%s}",
             mixed ? 3 : 2, mixed ? ", \"mlp_only_layers\": [1]" : "");
    mt_model_config cfg;
    ck_assert_msg(mt_config_parse(json, "moe-step", &cfg, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(mt_config_sparse_layers(&cfg), mixed ? 2 : cfg.layers);
    return cfg;
}

typedef struct step_result {
    int ntiles;
    int64_t *numel;
    float **grad;
    double loss;
} step_result;

enum { STEP_B = 2, STEP_T = 77 };

/* One step's gradients (no update) with `ncuda` CUDA workers, in dtype, the load-balancing loss
 * at aux_coef (0: off); the memory plan must count exactly the buffers the graph registers (the
 * CUDA layer's sizes of a sparse layer included). */
static step_result run_step(int ncuda, mt_dtype dtype, double aux_coef, bool mixed)
{
    mt_runtime_options ro = mt_runtime_defaults();
    ro.sched = "megatrain";
    ro.ncpu = 2;
    ro.ncuda = ncuda;
    ro.cuda.attention = MT_CUDA_ATTENTION_OWN;
    char err[512];
    ck_assert_msg(mt_runtime_init(&ro, err, sizeof err) == 0, "%s", err);
    mt_model_config cfg = step_config(mixed);
    if (aux_coef > 0) cfg.router_aux = MT_ROUTER_AUX_ON, cfg.router_aux_coef_run = aux_coef; /* --router-aux-loss */
    mt_host_state *st = mt_state_create(&cfg, dtype, 0, err, sizeof err);
    ck_assert_msg(st != NULL, "%s", err);
    mt_state_init_random(st, 11, 0.05);
    mt_step_config sc = mt_step_defaults();
    sc.B = STEP_B, sc.T = STEP_T, sc.K = 2, sc.accum = 1, sc.head_chunk = 50;
    mt_graph *g = mt_graph_create(st, &sc, err, sizeof err);
    ck_assert_msg(g != NULL, "%s", err);
    mt_plan_params pp = {.micro_batch = sc.B, .seq_len = sc.T, .grad_accum = 1, .checkpoint_interval = sc.K,
                         .compute = dtype, .use_gpu = ncuda > 0, .head_chunk = sc.head_chunk};
    mt_plan plan;
    ck_assert_msg(mt_plan_compute(&cfg, &pp, &plan) == 0, "%s", plan.error);
    const uint64_t planned = mt_plan_activation_bytes(&plan) - (ncuda > 0 ? plan.gpu : plan.host)[MT_PLAN_INPUTS];
    printf("  ncuda %d: graph %llu working bytes, plan %llu\n", ncuda, (unsigned long long)mt_graph_working_bytes(g),
           (unsigned long long)planned);
    ck_assert_msg(mt_graph_working_bytes(g) == planned, "the graph's working bytes are not the plan's");
    const int64_t n = sc.B * sc.T;
    int32_t *tok = malloc(sizeof *tok * (size_t)n), *tgt = malloc(sizeof *tgt * (size_t)n);
    mt_test_rng r;
    mt_test_rng_seed(&r, 99);
    for (int64_t i = 0; i < n; i++) {
        tok[i] = (int32_t)(mt_test_uniform(&r) * cfg.vocab);
        tgt[i] = (int32_t)(mt_test_uniform(&r) * cfg.vocab);
    }
    const int slot = mt_graph_submit_compute(g, 1, tok, tgt);
    step_result res = {.ntiles = st->ntiles};
    res.loss = mt_graph_wait_loss(g, slot, NULL);
    starpu_task_wait_for_all();
    res.numel = calloc((size_t)st->ntiles, sizeof *res.numel);
    res.grad = calloc((size_t)st->ntiles, sizeof *res.grad);
    for (int i = 0; i < st->ntiles; i++) {
        mt_tile *t = &st->tiles[i];
        res.numel[i] = t->numel;
        res.grad[i] = malloc(sizeof(float) * (size_t)t->numel);
        starpu_data_acquire(t->h_grad, STARPU_R);
        memcpy(res.grad[i], t->grad, sizeof(float) * (size_t)t->numel);
        starpu_data_release(t->h_grad);
    }
    free(tok), free(tgt);
    mt_graph_destroy(g);
    mt_state_destroy(st);
    mt_runtime_shutdown();
    return res;
}

/* fp32: every gradient tile within F32_TOL and the loss within 1e-6. bf16: the loss within 1e-3
 * only; with random weights some routing choices are near ties that bf16 rounding flips, which
 * moves single experts' gradients far more than rounding does (the layer and block cases above
 * check bf16 gradients on inputs whose routing has a margin). With the load-balancing loss on
 * (aux_coef > 0) the loss includes its value and the gradients its share. */
static void compare_step(mt_dtype dtype, double aux_coef, bool mixed)
{
    const bool f32 = dtype == MT_DTYPE_F32;
    printf("step of %s qwen3_moe, %s: B=%d T=%d, load-balancing loss %g\n",
           mixed ? "a sparse-dense-sparse" : "an all-sparse", mt_dtype_name(dtype), (int)STEP_B, (int)STEP_T, aux_coef);
    step_result cpu = run_step(0, dtype, aux_coef, mixed), gpu = run_step(1, dtype, aux_coef, mixed);
    const double lrel = fabs(gpu.loss - cpu.loss) / fabs(cpu.loss), ltol = f32 ? 1e-6 : 1e-3;
    printf("  %-52s rel err %.3e  (tol %.0e)%s   [gpu %.8f cpu %.8f]\n", "loss", lrel, ltol,
           lrel <= ltol ? "" : "  FAIL", gpu.loss, cpu.loss);
    ck_assert_msg(lrel <= ltol, "loss: gpu %.9g cpu %.9g", gpu.loss, cpu.loss);
    for (int i = 0; i < cpu.ntiles; i++) {
        char what[64];
        snprintf(what, sizeof what, "tile %d gradient", i);
        if (f32) mt_test_check_close(what, gpu.grad[i], cpu.grad[i], cpu.numel[i], F32_TOL);
        else printf("  %-52s rel err %.3e  (not bounded in bf16)\n", what,
                    mt_test_rel_err_f32(gpu.grad[i], cpu.grad[i], cpu.numel[i]));
        free(cpu.grad[i]), free(gpu.grad[i]);
    }
    free(cpu.grad), free(gpu.grad), free(cpu.numel), free(gpu.numel);
}

START_TEST(test_step)
{
    compare_step(MT_DTYPE_F32, 0.0, false);
    compare_step(MT_DTYPE_BF16, 0.0, false);
    compare_step(MT_DTYPE_F32, 0.5, false); /* a large coefficient: the loss's share of the gradients shows */
    compare_step(MT_DTYPE_BF16, 0.5, false);
    compare_step(MT_DTYPE_F32, 0.0, true);
    compare_step(MT_DTYPE_BF16, 0.0, true);
    compare_step(MT_DTYPE_F32, 0.5, true);
}
END_TEST

/* ---------- timing (MT_CUDA_BENCH=1) ---------- */

/* n uniform values in [-a, a) as bf16 bits, directly on the host (xorshift: the bench's tile is
 * 0.6 G elements). */
static void fill_bf16(uint64_t seed, mt_bf16 *out, int64_t n, float a)
{
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    for (int64_t i = 0; i < n; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        const float v = a * (float)((double)(x >> 11) * (2.0 / 9007199254740992.0) - 1.0);
        uint32_t bits;
        memcpy(&bits, &v, 4);
        out[i] = (mt_bf16)(bits >> 16);
    }
}

enum { MOE_BENCH_REPS = 5 };

/* The Qwen3-30B-A3B MoE block (d 2048, 128 experts of width 768, top 8, renormalised), bf16,
 * forward + backward at 8k and 32k tokens. Model FLOPs in the active-parameter convention:
 * 6 x tokens x active parameters (the router's E d and k experts' 3 Ie d); the experts' GEMMs
 * alone are 6 x tokens x k x 3 Ie d. Routing over random inputs, near balanced. */
START_TEST(test_bench)
{
    if (!getenv("MT_CUDA_BENCH") || strcmp(getenv("MT_CUDA_BENCH"), "1") != 0) {
        printf("MoE timings: skipped (MT_CUDA_BENCH=1 runs them)\n");
        return;
    }
    char err[512] = "";
    const char *json = "{\"model_type\": \"qwen3_moe\", \"hidden_size\": 2048, \"intermediate_size\": 6144,"
                       " \"num_hidden_layers\": 1, \"num_attention_heads\": 32, \"num_key_value_heads\": 4,"
                       " \"head_dim\": 128, \"vocab_size\": 151936, \"num_experts\": 128,"
                       " \"num_experts_per_tok\": 8, \"moe_intermediate_size\": 768, \"norm_topk_prob\": true,"
                       " \"output_router_logits\": false}";
    mt_model_config cfg;
    ck_assert_msg(mt_config_parse(json, "qwen3-30b-a3b", &cfg, err, sizeof err) == 0, "%s", err);
    mt_tile_layout lay;
    mt_layout_build(&cfg, MT_TILE_LAYER, &lay);
    const int64_t d = cfg.hidden, E = cfg.experts, k = cfg.experts_per_token, Ie = cfg.expert_intermediate;
    const double active = (double)E * d + (double)k * 3 * Ie * d, expert_params = (double)k * 3 * Ie * d;
    printf("MoE block timings, bf16: d=%lld E=%lld k=%lld Ie=%lld, %.3g active parameters per token\n", (long long)d,
           (long long)E, (long long)k, (long long)Ie, active);
    mt_bf16 *tile_bits = mt_xcalloc((size_t)lay.numel, sizeof(mt_bf16));
    fill_bf16(1, tile_bits, lay.numel, 0.03f);
    mt_cuda_ctx *ctx = mt_cuda_ctx_get();
    cudaStream_t st = mt_test_new_stream();
    const mt_cuda_stream s = (mt_cuda_stream)st;
    void *d_tile = mt_test_gpu_buffer(tile_bits, (size_t)lay.numel * 2);
    float *d_dtile = mt_test_gpu_buffer(NULL, (size_t)lay.numel * 4);
    CK_CUDA(cudaMemset(d_dtile, 0, (size_t)lay.numel * 4));
    free(tile_bits);
    cudaEvent_t e0, e1, e2;
    CK_CUDA(cudaEventCreate(&e0));
    CK_CUDA(cudaEventCreate(&e1));
    CK_CUDA(cudaEventCreate(&e2));
    const int64_t sizes[] = {8192, 32768};
    for (size_t c = 0; c < sizeof sizes / sizeof sizes[0]; c++) {
        const int64_t n = sizes[c], nd = n * d;
        mt_bf16 *h = mt_xcalloc((size_t)nd, sizeof(mt_bf16));
        fill_bf16(2 + c, h, nd, 1.7f);
        void *d_hn = mt_test_gpu_buffer(h, (size_t)nd * 2);
        fill_bf16(9 + c, h, nd, 1.7f);
        void *d_dy = mt_test_gpu_buffer(h, (size_t)nd * 2);
        free(h);
        float *d_y = mt_test_gpu_buffer(NULL, (size_t)nd * 4), *d_dhn = mt_test_gpu_buffer(NULL, (size_t)nd * 4);
        void *d_saved = mt_test_gpu_buffer(NULL, mt_cuda_moe_saved_bytes(&cfg, MT_CUDA_BF16, n));
        void *d_scratch = mt_test_gpu_buffer(NULL, mt_cuda_moe_scratch_bytes(&cfg, MT_CUDA_BF16, n));
        float fwd[MOE_BENCH_REPS], bwd[MOE_BENCH_REPS];
        for (int r = -1; r < MOE_BENCH_REPS; r++) { /* r = -1: warm-up */
            CK_CUDA(cudaEventRecord(e0, st));
            mt_cuda_moe_forward(ctx, &cfg, &lay, MT_CUDA_BF16, d_tile, n, d_hn, NULL, d_y, d_saved, d_scratch, s);
            CK_CUDA(cudaEventRecord(e1, st));
            mt_cuda_moe_backward(ctx, &cfg, &lay, MT_CUDA_BF16, d_tile, n, d_hn, d_saved, d_dy, d_dhn, d_dtile,
                                 d_scratch, s);
            CK_CUDA(cudaEventRecord(e2, st));
            CK_CUDA(cudaEventSynchronize(e2));
            if (r < 0) continue;
            CK_CUDA(cudaEventElapsedTime(&fwd[r], e0, e1));
            CK_CUDA(cudaEventElapsedTime(&bwd[r], e1, e2));
        }
        float best_f = fwd[0], best_b = bwd[0], best = fwd[0] + bwd[0];
        for (int r = 1; r < MOE_BENCH_REPS; r++) {
            best_f = fwd[r] < best_f ? fwd[r] : best_f;
            best_b = bwd[r] < best_b ? bwd[r] : best_b;
            best = fwd[r] + bwd[r] < best ? fwd[r] + bwd[r] : best;
        }
        const double model = 6.0 * (double)n * active, experts = 6.0 * (double)n * expert_params;
        printf("  %6lld tokens: forward %.2f ms (%.1f TFLOP/s)  backward %.2f ms (%.1f TFLOP/s)  "
               "forward+backward %.2f ms: %.1f TFLOP/s model (active parameters), experts' GEMMs %.1f TFLOP/s\n",
               (long long)n, best_f, 2.0 * n * active / (best_f * 1e9), best_b, 4.0 * n * active / (best_b * 1e9),
               best, model / (best * 1e9), experts / (best * 1e9));
        fflush(stdout);
        void *bufs[] = {d_hn, d_dy, d_y, d_dhn, d_saved, d_scratch};
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) CK_CUDA(cudaFree(bufs[i]));
    }
    CK_CUDA(cudaEventDestroy(e0));
    CK_CUDA(cudaEventDestroy(e1));
    CK_CUDA(cudaEventDestroy(e2));
    CK_CUDA(cudaFree(d_tile));
    CK_CUDA(cudaFree(d_dtile));
    CK_CUDA(cudaStreamDestroy(st));
}
END_TEST

static Suite *cuda_moe_suite(void)
{
    Suite *s = suite_create("cuda_moe");
    TCase *routing = tcase_create("routing");
    tcase_set_timeout(routing, 600);
    tcase_add_test(routing, test_routing);
    suite_add_tcase(s, routing);
    TCase *block = tcase_create("block");
    tcase_set_timeout(block, 600);
    tcase_add_loop_test(block, test_block, 0, 2 * NCASES);
    suite_add_tcase(s, block);
    TCase *layer = tcase_create("layer");
    tcase_set_timeout(layer, 600);
    tcase_add_loop_test(layer, test_layer, 0, 2 * NCASES);
    suite_add_tcase(s, layer);
    TCase *bench = tcase_create("bench");
    tcase_set_timeout(bench, 900);
    tcase_add_test(bench, test_bench);
    suite_add_tcase(s, bench);
    /* Last: StarPU's shutdown resets the device, which leaves this thread's CUDA context (its
     * handles and mapped buffers, created before) stale for any test after it. */
    TCase *step = tcase_create("step");
    tcase_set_timeout(step, 600);
    tcase_add_test(step, test_step);
    suite_add_tcase(s, step);
    return s;
}

int main(void)
{
    /* The layer cases run the own attention kernels, as test_cuda's do (MT_ATTENTION overrides). */
    return mt_test_cuda_main("test_cuda_moe", cuda_moe_suite());
}
