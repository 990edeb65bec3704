/* Check suite of the CUDA model pieces (backends/cuda: context.cu, linear.cu, rmsnorm.cu,
 * layer.cu, head.cu, embedding.cu) against the fp32 CPU reference (backends/cpu) on fresh random
 * bf16-rounded inputs, at sizes that are not multiples of 64: conversions, sum of squares,
 * embedding, attention, decoder layer forward/backward (every gradient tensor, = and +=, padding,
 * bitwise determinism), head (tied/untied, ignored targets, chunk < ntok). The embedding, layer
 * and head run in both precisions: bf16 (bound 1e-2) and fp32 on fresh fp32 values (bound 1e-5). Every measured error
 * is printed, one line per tensor. MT_CUDA_BENCH=1 adds timings at a Qwen2.5-3B layer shape:
 * TFLOP/s of the layer, attention and head, then GB/s of the memory-bound kernels.
 * Without a CUDA device it prints "no GPU: skipped" and exits 77. */
#include <check.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cuda/kernels.h"
#include "runtime/runtime.h"
#include "tests/cuda_kernel_bench.h"
#include "backends/cpu/ops.h"
#include "models/util.h"
#include "tests/testutil.h"

#define BF16_TOL 1e-2  /* ||gpu - cpu|| / ||cpu|| per tensor where the GPU feeds bf16 to GEMMs */
#define F32_TOL 1e-5   /* the same on the fp32 path (MT_CUDA_F32): fp32 in another summation order */
#define LOSS_TOL 1e-3  /* summed cross-entropy: per-row errors are random and average out */
#define LSE_TOL 1e-4   /* attention log-sum-exp: fp32 from the same bf16 inputs */
#define SUMSQ_TOL 1e-12 /* double sums in another order */

/* Test sizes: B*T = 154 rows, d = 200, I = 333, V = 1001: none a multiple of 64. */
enum { TB = 2, TT = 77, TD = 200, TI = 333, TV = 1001 };

#define CK_CUDA(call)                                                                           \
    do {                                                                                        \
        cudaError_t err_ = (call);                                                              \
        ck_assert_msg(err_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(err_));          \
    } while (0)

/* ---------- host and device helpers ---------- */

static float *falloc(int64_t n) { return mt_xcalloc(1, (size_t)(n > 0 ? n : 1) * sizeof(float)); }

static float *frandom(mt_test_rng *rng, int64_t n, float scale)
{
    float *p = falloc(n);
    mt_test_fill_f32(rng, p, n, scale);
    return p;
}

/* x rounded to bf16 in place (so the CPU sees exactly the GPU's operands); bits optional. */
static void round_bf16(float *x, int64_t n, mt_bf16 *bits)
{
    mt_bf16 *b = bits ? bits : mt_xcalloc(1, (size_t)n * sizeof(mt_bf16));
    mt_f32_to_bf16(n, x, b);
    mt_bf16_to_f32(n, b, x);
    if (!bits) free(b);
}

static mt_bf16 *bf16_of(const float *x, int64_t n)
{
    mt_bf16 *b = mt_xcalloc(1, (size_t)(n > 0 ? n : 1) * sizeof(mt_bf16));
    mt_f32_to_bf16(n, x, b);
    return b;
}

/* Device buffer: a copy of host, or (host NULL) all bytes 0xff, i.e. NaN in fp32 and bf16, so an
 * output element left unwritten shows up. */
static void *gpu_buffer(const void *host, size_t bytes)
{
    void *p = NULL;
    CK_CUDA(cudaMalloc(&p, bytes ? bytes : 16));
    if (host) CK_CUDA(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice));
    else CK_CUDA(cudaMemset(p, 0xff, bytes ? bytes : 16));
    return p;
}

static void gpu_fill_nan(void *p, size_t bytes, cudaStream_t st) { CK_CUDA(cudaMemsetAsync(p, 0xff, bytes, st)); }

static float *download_f32(const float *dev, int64_t n)
{
    float *h = falloc(n);
    CK_CUDA(cudaMemcpy(h, dev, (size_t)n * sizeof(float), cudaMemcpyDeviceToHost));
    return h;
}

static float *download_bf16_as_f32(const mt_cuda_bf16 *dev, int64_t n)
{
    mt_bf16 *b = mt_xcalloc(1, (size_t)n * sizeof(mt_bf16));
    CK_CUDA(cudaMemcpy(b, dev, (size_t)n * sizeof(mt_bf16), cudaMemcpyDeviceToHost));
    float *h = falloc(n);
    mt_bf16_to_f32(n, b, h);
    free(b);
    return h;
}

static void check_close(const char *what, const float *gpu, const float *cpu, int64_t n, double tol)
{
    const double err = mt_test_rel_err_f32(gpu, cpu, n);
    printf("  %-52s rel err %.3e  (tol %.0e)%s\n", what, err, tol, err <= tol ? "" : "  FAIL");
    fflush(stdout);
    ck_assert_msg(err <= tol, "%s: rel err %.3e > %.0e", what, err, tol);
}

static void check_bitwise(const char *what, const void *a, const void *b, size_t bytes)
{
    const bool same = memcmp(a, b, bytes) == 0;
    printf("  %-52s %s\n", what, same ? "bitwise identical" : "DIFFERENT  FAIL");
    fflush(stdout);
    ck_assert_msg(same, "%s: not bitwise identical", what);
}

/* Elements of a gradient tile outside every present tensor must be exactly 0. */
static void check_padding_zero(const char *what, const mt_tile_layout *lay, const float *dtile)
{
    char *inside = mt_xcalloc(1, (size_t)lay->numel);
    for (int s = 0; s < lay->ntensors; s++)
        memset(inside + lay->tensors[s].offset, 1, (size_t)lay->tensors[s].numel);
    int64_t bad = 0;
    for (int64_t i = 0; i < lay->numel; i++)
        if (!inside[i] && dtile[i] != 0.0f) bad++;
    free(inside);
    printf("  %-52s %lld non-zero padding elements\n", what, (long long)bad);
    fflush(stdout);
    ck_assert_msg(bad == 0, "%s: %lld padding elements not zero", what, (long long)bad);
}

static mt_model_config make_cfg(mt_family family, bool qkv_bias, bool qk_norm, int64_t H, int64_t KV, int64_t D,
                                bool tied)
{
    mt_model_config c;
    memset(&c, 0, sizeof c);
    c.family = family;
    snprintf(c.model_type, sizeof c.model_type, "%s",
             family == MT_FAMILY_QWEN2 ? "qwen2" : family == MT_FAMILY_QWEN3 ? "qwen3" : "llama");
    c.hidden = TD;
    c.intermediate = TI;
    c.layers = 1;
    c.heads = H;
    c.kv_heads = KV;
    c.head_dim = D;
    c.vocab = TV;
    c.max_positions = 4096;
    c.rope_theta = family == MT_FAMILY_LLAMA ? 500000.0 : 1000000.0;
    c.rms_eps = 1e-6;
    c.tied = tied;
    c.qkv_bias = qkv_bias;
    c.qk_norm = qk_norm;
    return c;
}

/* Random tile: norm weights near 1 (as trained models have them), the rest N(0, scale); values
 * rounded to bf16 when bf16_valued (for the bf16 path, so the CPU sees the GPU's weights). */
static float *random_tile(mt_test_rng *rng, const mt_tile_layout *lay, float scale, bool bf16_valued)
{
    float *tile = falloc(lay->numel);
    for (int s = 0; s < lay->ntensors; s++) {
        const mt_tensor_desc *t = &lay->tensors[s];
        if (t->numel == 0) continue;
        const bool is_norm = t->ndim == 1 && strstr(t->name, "norm") != NULL;
        mt_test_fill_f32(rng, tile + t->offset, t->numel, is_norm ? 0.2f : scale);
        if (is_norm)
            for (int64_t i = 0; i < t->numel; i++) tile[t->offset + i] += 1.0f;
    }
    if (bf16_valued) round_bf16(tile, lay->numel, NULL);
    return tile;
}

static cudaStream_t new_stream(void)
{
    cudaStream_t st;
    CK_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    return st;
}

/* ---------- conversions and sum of squares ---------- */

START_TEST(test_conversions)
{
    printf("conversions: n = 100003, specials included\n");
    const int64_t n = 100003;
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 11);
    float *x = falloc(n);
    for (int64_t i = 0; i < n; i++) /* spread over many binades, ties and specials */
        x[i] = (float)(mt_test_normal(&rng) * pow(2.0, (double)(i % 61) - 30.0));
    const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, 3.4028235e38f, 1e-40f, -1e-45f, 1.00390625f, 1.01171875f};
    memcpy(x, specials, sizeof specials);
    mt_bf16 *cpu_bits = bf16_of(x, n);
    cudaStream_t st = new_stream();
    float *d_x = gpu_buffer(x, (size_t)n * sizeof(float));
    mt_cuda_bf16 *d_b = gpu_buffer(NULL, (size_t)n * sizeof(mt_bf16));
    float *d_back = gpu_buffer(NULL, (size_t)n * sizeof(float));
    mt_cuda_f32_to_bf16(d_x, d_b, n, (mt_cuda_stream)st);
    mt_cuda_bf16_to_f32(d_b, d_back, n, (mt_cuda_stream)st);
    CK_CUDA(cudaStreamSynchronize(st));
    mt_bf16 *gpu_bits = mt_xcalloc(1, (size_t)n * sizeof(mt_bf16));
    CK_CUDA(cudaMemcpy(gpu_bits, d_b, (size_t)n * sizeof(mt_bf16), cudaMemcpyDeviceToHost));
    check_bitwise("f32 -> bf16 bits vs mt_f32_to_bf16", gpu_bits, cpu_bits, (size_t)n * sizeof(mt_bf16));
    float *back = download_f32(d_back, n), *cpu_back = falloc(n);
    mt_bf16_to_f32(n, cpu_bits, cpu_back);
    check_bitwise("bf16 -> f32 vs mt_bf16_to_f32", back, cpu_back, (size_t)n * sizeof(float));
    CK_CUDA(cudaFree(d_x));
    CK_CUDA(cudaFree(d_b));
    CK_CUDA(cudaFree(d_back));
    CK_CUDA(cudaStreamDestroy(st));
    free(x), free(cpu_bits), free(gpu_bits), free(back), free(cpu_back);
}
END_TEST

START_TEST(test_sumsq)
{
    printf("sum of squares\n");
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 12);
    const int64_t sizes[] = {0, 1, 77, 1000003, 5000011};
    cudaStream_t st = new_stream();
    double *d_out = gpu_buffer(NULL, 2 * sizeof(double));
    for (size_t c = 0; c < sizeof sizes / sizeof sizes[0]; c++) {
        const int64_t n = sizes[c];
        float *x = frandom(&rng, n, 3.0f);
        float *d_x = gpu_buffer(x, (size_t)(n > 0 ? n : 1) * sizeof(float));
        mt_cuda_sumsq_f32(d_x, n, d_out, (mt_cuda_stream)st);
        mt_cuda_sumsq_f32(d_x, n, d_out + 1, (mt_cuda_stream)st);
        CK_CUDA(cudaStreamSynchronize(st));
        double got[2];
        CK_CUDA(cudaMemcpy(got, d_out, sizeof got, cudaMemcpyDeviceToHost));
        const double want = mt_cpu_sumsq_f32(n, x);
        const double err = want > 0 ? fabs(got[0] - want) / want : fabs(got[0]);
        char what[96];
        snprintf(what, sizeof what, "sumsq n=%lld", (long long)n);
        printf("  %-52s rel err %.3e  (tol %.0e)%s\n", what, err, SUMSQ_TOL, err <= SUMSQ_TOL ? "" : "  FAIL");
        ck_assert_msg(err <= SUMSQ_TOL, "%s: %.17g vs %.17g", what, got[0], want);
        snprintf(what, sizeof what, "sumsq n=%lld twice", (long long)n);
        check_bitwise(what, &got[0], &got[1], sizeof(double));
        CK_CUDA(cudaFree(d_x));
        free(x);
    }
    CK_CUDA(cudaFree(d_out));
    CK_CUDA(cudaStreamDestroy(st));
}
END_TEST

/* ---------- embedding ---------- */

/* The table in each precision; the forward is a copy either way, so exact. */
START_TEST(test_embedding)
{
    const int64_t ntok = TB * TT, d = TD, V = TV;
    printf("embedding: ntok=%lld d=%lld V=%lld, repeated tokens\n", (long long)ntok, (long long)d, (long long)V);
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 13);
    int32_t *tokens = mt_xcalloc(1, (size_t)ntok * sizeof(int32_t));
    for (int64_t i = 0; i < ntok; i++) /* mostly a small range, so most tokens repeat */
        tokens[i] = (int32_t)(i % 5 == 0 ? (int64_t)(mt_test_uniform(&rng) * V) : (int64_t)(mt_test_uniform(&rng) * 17));
    tokens[ntok - 1] = (int32_t)(V - 1);
    tokens[0] = 0;
    float *table = frandom(&rng, V * d, 1.0f);
    mt_bf16 *table_bits = mt_xcalloc(1, (size_t)(V * d) * sizeof(mt_bf16));
    round_bf16(table, V * d, table_bits);
    float *dh0 = frandom(&rng, ntok * d, 1.0f);
    float *dtable = frandom(&rng, V * d, 1.0f); /* += onto arbitrary values */

    float *h0_cpu = falloc(ntok * d), *dtable_cpu = falloc(V * d);
    mt_cpu_embedding_forward_f32(ntok, d, table, tokens, h0_cpu);
    memcpy(dtable_cpu, dtable, (size_t)(V * d) * sizeof(float));
    mt_cpu_embedding_backward_f32(ntok, d, tokens, dh0, dtable_cpu);

    cudaStream_t st = new_stream();
    mt_cuda_bf16 *d_table = gpu_buffer(table_bits, (size_t)(V * d) * sizeof(mt_bf16));
    int32_t *d_tokens = gpu_buffer(tokens, (size_t)ntok * sizeof(int32_t));
    float *d_h0 = gpu_buffer(NULL, (size_t)(ntok * d) * sizeof(float));
    float *d_dh0 = gpu_buffer(dh0, (size_t)(ntok * d) * sizeof(float));
    float *d_dtable = gpu_buffer(dtable, (size_t)(V * d) * sizeof(float));
    void *d_ws = gpu_buffer(NULL, mt_cuda_embedding_workspace_bytes(ntok, V));
    mt_cuda_embedding_forward(ntok, d, MT_CUDA_BF16, d_table, d_tokens, d_h0, (mt_cuda_stream)st);
    mt_cuda_embedding_backward(ntok, d, V, d_tokens, d_dh0, d_dtable, d_ws, (mt_cuda_stream)st);
    CK_CUDA(cudaStreamSynchronize(st));
    float *h0 = download_f32(d_h0, ntok * d), *dt = download_f32(d_dtable, V * d);
    check_bitwise("embedding forward h0 vs CPU", h0, h0_cpu, (size_t)(ntok * d) * sizeof(float));
    /* fp32 table: values that are not bf16 (so a bf16 read would show), gathered exactly. */
    float *table32 = frandom(&rng, V * d, 1.0f), *h0_cpu32 = falloc(ntok * d);
    mt_cpu_embedding_forward_f32(ntok, d, table32, tokens, h0_cpu32);
    float *d_table32 = gpu_buffer(table32, (size_t)(V * d) * sizeof(float));
    gpu_fill_nan(d_h0, (size_t)(ntok * d) * sizeof(float), st);
    mt_cuda_embedding_forward(ntok, d, MT_CUDA_F32, d_table32, d_tokens, d_h0, (mt_cuda_stream)st);
    CK_CUDA(cudaStreamSynchronize(st));
    float *h0_32 = download_f32(d_h0, ntok * d);
    check_bitwise("embedding forward h0 vs CPU (fp32 table)", h0_32, h0_cpu32, (size_t)(ntok * d) * sizeof(float));
    CK_CUDA(cudaFree(d_table32));
    free(table32), free(h0_cpu32), free(h0_32);
    /* Same additions in the same (position) order as the CPU loop: exact. */
    check_close("embedding backward dtable (+=) vs CPU", dt, dtable_cpu, V * d, 0.0);
    check_bitwise("embedding backward dtable vs CPU", dt, dtable_cpu, (size_t)(V * d) * sizeof(float));

    CK_CUDA(cudaFree(d_table));
    CK_CUDA(cudaFree(d_tokens));
    CK_CUDA(cudaFree(d_h0));
    CK_CUDA(cudaFree(d_dh0));
    CK_CUDA(cudaFree(d_dtable));
    CK_CUDA(cudaFree(d_ws));
    CK_CUDA(cudaStreamDestroy(st));
    free(tokens), free(table), free(table_bits), free(dh0), free(dtable), free(h0_cpu), free(dtable_cpu);
    free(h0), free(dt);
}
END_TEST

/* ---------- attention, called directly ---------- */

static void run_attention_case(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D)
{
    printf("attention: B=%lld T=%lld H=%lld KV=%lld D=%lld\n", (long long)B, (long long)T, (long long)H,
           (long long)KV, (long long)D);
    const int64_t nq = B * T * H * D, nkv = B * T * KV * D, nl = B * H * T;
    mt_test_rng rng;
    mt_test_rng_seed(&rng, (uint64_t)(100 + D + KV));
    float *q = frandom(&rng, nq, 1.0f), *k = frandom(&rng, nkv, 1.0f), *v = frandom(&rng, nkv, 1.0f);
    float *dout = frandom(&rng, nq, 1.0f);
    mt_bf16 *qb = mt_xcalloc((size_t)nq, 2), *kb = mt_xcalloc((size_t)nkv, 2), *vb = mt_xcalloc((size_t)nkv, 2);
    mt_bf16 *dob = mt_xcalloc((size_t)nq, 2);
    round_bf16(q, nq, qb), round_bf16(k, nkv, kb), round_bf16(v, nkv, vb), round_bf16(dout, nq, dob);

    float *out = falloc(nq), *lse = falloc(nl), *dq = falloc(nq), *dk = falloc(nkv), *dv = falloc(nkv);
    mt_cpu_attention_forward_f32(B, T, H, KV, D, q, k, v, out, lse);
    mt_cpu_attention_backward_f32(B, T, H, KV, D, q, k, v, out, lse, dout, dq, dk, dv);

    cudaStream_t st = new_stream();
    mt_cuda_bf16 *d_q = gpu_buffer(qb, (size_t)nq * 2), *d_k = gpu_buffer(kb, (size_t)nkv * 2);
    mt_cuda_bf16 *d_v = gpu_buffer(vb, (size_t)nkv * 2), *d_do = gpu_buffer(dob, (size_t)nq * 2);
    mt_cuda_bf16 *d_out = gpu_buffer(NULL, (size_t)nq * 2);
    float *d_lse = gpu_buffer(NULL, (size_t)nl * 4);
    float *d_dq = gpu_buffer(NULL, (size_t)nq * 4), *d_dk = gpu_buffer(NULL, (size_t)nkv * 4);
    float *d_dv = gpu_buffer(NULL, (size_t)nkv * 4);
    void *d_ws = gpu_buffer(NULL, mt_cuda_attention_workspace_bytes(B, T, H, KV, D));
    mt_cuda_ctx *ctx = mt_cuda_ctx_get();
    mt_cuda_attention_forward(ctx, B, T, H, KV, D, d_q, d_k, d_v, d_out, d_lse, (mt_cuda_stream)st);
    /* Backward from the GPU's own (bf16) output, as the layer runs it. */
    mt_cuda_attention_backward(ctx, B, T, H, KV, D, d_q, d_k, d_v, d_out, d_lse, d_do, d_dq, d_dk, d_dv, d_ws,
                               (mt_cuda_stream)st);
    CK_CUDA(cudaStreamSynchronize(st));
    float *g_out = download_bf16_as_f32(d_out, nq), *g_lse = download_f32(d_lse, nl);
    float *g_dq = download_f32(d_dq, nq), *g_dk = download_f32(d_dk, nkv), *g_dv = download_f32(d_dv, nkv);
    check_close("attention out", g_out, out, nq, BF16_TOL);
    check_close("attention lse", g_lse, lse, nl, LSE_TOL);
    check_close("attention dq", g_dq, dq, nq, BF16_TOL);
    check_close("attention dk", g_dk, dk, nkv, BF16_TOL);
    check_close("attention dv", g_dv, dv, nkv, BF16_TOL);

    void *bufs[] = {d_q, d_k, d_v, d_do, d_out, d_lse, d_dq, d_dk, d_dv, d_ws};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) CK_CUDA(cudaFree(bufs[i]));
    CK_CUDA(cudaStreamDestroy(st));
    void *hbufs[] = {q, k, v, dout, qb, kb, vb, dob, out, lse, dq, dk, dv, g_out, g_lse, g_dq, g_dk, g_dv};
    for (size_t i = 0; i < sizeof hbufs / sizeof hbufs[0]; i++) free(hbufs[i]);
}

START_TEST(test_attention)
{
    run_attention_case(TB, TT, 5, 1, 64);
    run_attention_case(TB, TT, 5, 5, 64);
    run_attention_case(TB, TT, 4, 2, 128);
}
END_TEST

/* ---------- decoder layer ---------- */

/* One layer in one precision: bf16 (weights rounded to bf16, the CPU given the same values) or
 * fp32 (the fp32 weights as they are, bound F32_TOL). */
static void run_layer_prec(const char *name, mt_model_config cfg, int64_t B, int64_t T, mt_cuda_prec prec)
{
    mt_tile_layout lay;
    mt_layout_build(&cfg, MT_TILE_LAYER, &lay);
    const int64_t n = B * T, d = cfg.hidden;
    const bool f32 = prec == MT_CUDA_F32;
    const double tol = f32 ? F32_TOL : BF16_TOL;
    printf("layer %s, %s: B=%lld T=%lld d=%lld H=%lld KV=%lld D=%lld I=%lld bias=%d qk_norm=%d\n", name,
           f32 ? "fp32" : "bf16", (long long)B, (long long)T, (long long)d, (long long)cfg.heads,
           (long long)cfg.kv_heads, (long long)cfg.head_dim, (long long)cfg.intermediate, cfg.qkv_bias, cfg.qk_norm);
    mt_test_rng rng;
    mt_test_rng_seed(&rng, (uint64_t)(1000 + cfg.head_dim * 10 + cfg.kv_heads + cfg.qk_norm * 7 + cfg.qkv_bias * 3 +
                                      f32 * 500));
    float *tile = random_tile(&rng, &lay, 0.05f, !f32);
    mt_bf16 *tile_bits = bf16_of(tile, lay.numel);
    float *x = frandom(&rng, n * d, 1.0f), *dy = frandom(&rng, n * d, 1.0f);

    /* CPU reference: fp32 on the same weights as the GPU's (bf16-valued for bf16). */
    float *saved = falloc(mt_layer_saved_numel(&cfg, B, T)), *scratch = falloc(mt_layer_scratch_numel(&cfg, B, T));
    float *y_cpu = falloc(n * d), *dx_cpu = falloc(n * d), *dtile_cpu = falloc(lay.numel);
    mt_cpu_layer_forward_f32(&cfg, &lay, tile, B, T, x, y_cpu, saved, scratch);
    mt_cpu_layer_backward_f32(&cfg, &lay, tile, B, T, saved, dy, dx_cpu, dtile_cpu, scratch);

    cudaStream_t st = new_stream();
    const mt_cuda_stream s = (mt_cuda_stream)st;
    mt_cuda_ctx *ctx = mt_cuda_ctx_get();
    const size_t vec_bytes = (size_t)(n * d) * sizeof(float), tile_bytes = (size_t)lay.numel * sizeof(float);
    void *d_tile = f32 ? gpu_buffer(tile, tile_bytes) : gpu_buffer(tile_bits, (size_t)lay.numel * sizeof(mt_bf16));
    float *d_x = gpu_buffer(x, vec_bytes), *d_dy = gpu_buffer(dy, vec_bytes);
    float *d_y = gpu_buffer(NULL, vec_bytes), *d_y2 = gpu_buffer(NULL, vec_bytes), *d_dx = gpu_buffer(NULL, vec_bytes);
    void *d_saved = gpu_buffer(NULL, mt_cuda_layer_saved_bytes(&cfg, prec, B, T));
    const size_t scratch_bytes = mt_cuda_layer_scratch_bytes(&cfg, prec, B, T);
    void *d_scratch = gpu_buffer(NULL, scratch_bytes);
    float *d_dtile = gpu_buffer(NULL, tile_bytes), *d_dtile2 = gpu_buffer(NULL, tile_bytes);

    mt_cuda_layer_forward(ctx, &cfg, &lay, prec, d_tile, B, T, d_x, d_y, NULL, d_scratch, s); /* no saved */
    mt_cuda_layer_forward(ctx, &cfg, &lay, prec, d_tile, B, T, d_x, d_y2, d_saved, d_scratch, s);
    gpu_fill_nan(d_scratch, scratch_bytes, st); /* backward may not rely on it */
    mt_cuda_layer_backward(ctx, &cfg, &lay, prec, d_tile, B, T, d_saved, d_dy, d_dx, d_dtile, false, d_scratch, s);
    mt_cuda_layer_backward(ctx, &cfg, &lay, prec, d_tile, B, T, d_saved, d_dy, d_dx, d_dtile2, false, d_scratch, s);
    CK_CUDA(cudaStreamSynchronize(st));
    float *y = download_f32(d_y, n * d), *y2 = download_f32(d_y2, n * d), *dx = download_f32(d_dx, n * d);
    float *dtile = download_f32(d_dtile, lay.numel), *dtile2 = download_f32(d_dtile2, lay.numel);

    check_close("forward y", y, y_cpu, n * d, tol);
    check_bitwise("forward y, saved vs no saved", y, y2, vec_bytes);
    check_close("backward dx", dx, dx_cpu, n * d, tol);
    char what[128];
    for (int t = 0; t < lay.ntensors; t++) {
        const mt_tensor_desc *desc = &lay.tensors[t];
        if (desc->numel == 0) continue;
        snprintf(what, sizeof what, "d %s (=)", desc->name);
        check_close(what, dtile + desc->offset, dtile_cpu + desc->offset, desc->numel, tol);
    }
    check_padding_zero("dtile padding (=)", &lay, dtile);
    if (f32 || mt_cuda_attention_reproducible(ctx, B, T, cfg.heads, cfg.kv_heads, cfg.head_dim))
        check_bitwise("dtile, backward run twice", dtile, dtile2, tile_bytes);
    else /* cuDNN's attention backward (float atomics on dQ) may change the last bits */
        check_close("dtile, backward run twice (cuDNN attention)", dtile2, dtile, lay.numel, tol);

    /* += on top of the first result: every tensor twice the reference. */
    mt_cuda_layer_backward(ctx, &cfg, &lay, prec, d_tile, B, T, d_saved, d_dy, d_dx, d_dtile, true, d_scratch, s);
    CK_CUDA(cudaStreamSynchronize(st));
    float *dtile_acc = download_f32(d_dtile, lay.numel), *dx2 = download_f32(d_dx, n * d);
    for (int64_t i = 0; i < lay.numel; i++) dtile_cpu[i] *= 2.0f;
    for (int t = 0; t < lay.ntensors; t++) {
        const mt_tensor_desc *desc = &lay.tensors[t];
        if (desc->numel == 0) continue;
        snprintf(what, sizeof what, "d %s (+=)", desc->name);
        check_close(what, dtile_acc + desc->offset, dtile_cpu + desc->offset, desc->numel, tol);
    }
    check_padding_zero("dtile padding (+=)", &lay, dtile_acc);
    check_bitwise("dx (=) again in += mode", dx2, dx, vec_bytes);

    void *bufs[] = {d_tile, d_x, d_dy, d_y, d_y2, d_dx, d_saved, d_scratch, d_dtile, d_dtile2};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) CK_CUDA(cudaFree(bufs[i]));
    CK_CUDA(cudaStreamDestroy(st));
    void *hbufs[] = {tile, tile_bits, x, dy, saved, scratch, y_cpu, dx_cpu, dtile_cpu, y, y2, dx, dtile, dtile2,
                     dtile_acc, dx2};
    for (size_t i = 0; i < sizeof hbufs / sizeof hbufs[0]; i++) free(hbufs[i]);
}

static void run_layer_case(const char *name, mt_model_config cfg, int64_t B, int64_t T)
{
    run_layer_prec(name, cfg, B, T, MT_CUDA_BF16);
    run_layer_prec(name, cfg, B, T, MT_CUDA_F32);
}

START_TEST(test_layer_llama_mqa)
{
    mt_model_config cfg = make_cfg(MT_FAMILY_LLAMA, false, false, 5, 1, 64, false);
    /* Llama-3 rope scaling: the host-computed frequencies travel to the kernel. */
    cfg.rope_type = MT_ROPE_LLAMA3;
    cfg.rope_scaling_factor = 8.0;
    cfg.rope_low_freq_factor = 1.0;
    cfg.rope_high_freq_factor = 4.0;
    cfg.rope_original_max_positions = 64;
    run_layer_case("llama KV=1", cfg, TB, TT);
}
END_TEST

START_TEST(test_layer_rope_scaled)
{
    char err[256];
    /* yarn over 32 positions: the attention factor travels in the tables, the ramp's blend in
     * the frequencies */
    mt_model_config cfg = make_cfg(MT_FAMILY_QWEN2, true, false, 5, 1, 64, false);
    cfg.max_positions = 32;
    ck_assert_msg(mt_config_set_rope_scaling(&cfg, "yarn:4", err, sizeof err) == 0, "%s", err);
    run_layer_case("qwen2 yarn:4", cfg, TB, TT);
    /* dynamic, run past max_position_embeddings: the base the tables use grows with T */
    cfg = make_cfg(MT_FAMILY_LLAMA, false, false, 5, 1, 64, false);
    cfg.max_positions = TT / 2;
    ck_assert_msg(mt_config_set_rope_scaling(&cfg, "dynamic:4", err, sizeof err) == 0, "%s", err);
    run_layer_case("llama dynamic:4", cfg, TB, TT);
}
END_TEST

START_TEST(test_layer_qwen2_mha)
{
    run_layer_case("qwen2 KV=5 (bias)", make_cfg(MT_FAMILY_QWEN2, true, false, 5, 5, 64, false), TB, TT);
}
END_TEST

START_TEST(test_layer_qwen3_qknorm)
{
    run_layer_case("qwen3 KV=1 (q/k norm)", make_cfg(MT_FAMILY_QWEN3, false, true, 5, 1, 64, false), TB, TT);
}
END_TEST

START_TEST(test_layer_d128)
{
    run_layer_case("qwen2 D=128 KV=2", make_cfg(MT_FAMILY_QWEN2, true, false, 4, 2, 128, false), TB, TT);
    run_layer_case("qwen3 D=128 KV=2 (bias + q/k norm)", make_cfg(MT_FAMILY_QWEN3, true, true, 4, 2, 128, false),
                   1, 131);
}
END_TEST

/* ---------- head ---------- */

static void run_head_prec(const char *name, bool tied, bool first_chunk_ignored, mt_cuda_prec prec)
{
    const mt_model_config cfg = make_cfg(MT_FAMILY_QWEN2, true, false, 5, 1, 64, tied);
    mt_tile_layout hl, el;
    mt_layout_build(&cfg, MT_TILE_HEAD, &hl);
    mt_layout_build(&cfg, MT_TILE_EMBED, &el);
    const int64_t ntok = TB * TT, d = cfg.hidden, V = cfg.vocab, chunk = 64;
    const double loss_scale = 1.0 / 117.0;
    const bool f32 = prec == MT_CUDA_F32;
    const double tol = f32 ? F32_TOL : BF16_TOL, loss_tol = f32 ? F32_TOL : LOSS_TOL;
    printf("head %s, %s: ntok=%lld d=%lld V=%lld chunk=%lld tied=%d\n", name, f32 ? "fp32" : "bf16", (long long)ntok,
           (long long)d, (long long)V, (long long)chunk, tied);
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 77 + tied * 2 + first_chunk_ignored + f32 * 10);
    float *head = random_tile(&rng, &hl, 0.05f, !f32), *embed = random_tile(&rng, &el, 0.05f, !f32);
    mt_bf16 *head_bits = bf16_of(head, hl.numel), *embed_bits = bf16_of(embed, el.numel);
    float *h = frandom(&rng, ntok * d, 1.0f);
    int32_t *targets = mt_xcalloc(1, (size_t)ntok * sizeof(int32_t));
    for (int64_t i = 0; i < ntok; i++) {
        const bool ignored = mt_test_uniform(&rng) < 0.2 || (first_chunk_ignored && i < chunk);
        targets[i] = ignored ? -100 : (int32_t)(mt_test_uniform(&rng) * V);
    }

    float *scratch = falloc(mt_head_scratch_numel(&cfg, chunk));
    float *dh_cpu = falloc(ntok * d), *dhead_cpu = falloc(hl.numel), *dembed_cpu = falloc(el.numel);
    int64_t counted_cpu = 0;
    const double loss_cpu = mt_cpu_head_f32(&cfg, &hl, head, embed, ntok, h, targets, loss_scale, chunk, dh_cpu,
                                            dhead_cpu, tied ? dembed_cpu : NULL, scratch, &counted_cpu);

    cudaStream_t st = new_stream();
    const mt_cuda_stream s = (mt_cuda_stream)st;
    mt_cuda_ctx *ctx = mt_cuda_ctx_get();
    void *d_head = f32 ? gpu_buffer(head, (size_t)hl.numel * 4) : gpu_buffer(head_bits, (size_t)hl.numel * 2);
    void *d_embed = f32 ? gpu_buffer(embed, (size_t)el.numel * 4) : gpu_buffer(embed_bits, (size_t)el.numel * 2);
    float *d_h = gpu_buffer(h, (size_t)(ntok * d) * 4), *d_dh = gpu_buffer(NULL, (size_t)(ntok * d) * 4);
    int32_t *d_targets = gpu_buffer(targets, (size_t)ntok * 4);
    float *d_dhead = gpu_buffer(NULL, (size_t)hl.numel * 4), *d_dembed = gpu_buffer(NULL, (size_t)el.numel * 4);
    double *d_loss = gpu_buffer(NULL, 4 * sizeof(double));
    void *d_scratch = gpu_buffer(NULL, mt_cuda_head_scratch_bytes(&cfg, prec, chunk));

    mt_cuda_head(ctx, &cfg, &hl, prec, d_head, d_embed, ntok, d_h, d_targets, loss_scale, chunk, NULL, NULL, NULL,
                 false, d_loss + 2, d_scratch, s); /* loss only */
    mt_cuda_head(ctx, &cfg, &hl, prec, d_head, d_embed, ntok, d_h, d_targets, loss_scale, chunk, d_dh, d_dhead,
                 tied ? d_dembed : NULL, false, d_loss, d_scratch, s);
    CK_CUDA(cudaStreamSynchronize(st));
    double loss[4];
    CK_CUDA(cudaMemcpy(loss, d_loss, sizeof loss, cudaMemcpyDeviceToHost));
    const double loss_err = fabs(loss[0] - loss_cpu) / fabs(loss_cpu);
    printf("  %-52s rel err %.3e  (tol %.0e)%s   [gpu %.6f cpu %.6f]\n", "loss sum", loss_err, loss_tol,
           loss_err <= loss_tol ? "" : "  FAIL", loss[0], loss_cpu);
    ck_assert_msg(loss_err <= loss_tol, "loss %.9g vs %.9g", loss[0], loss_cpu);
    printf("  %-52s gpu %.0f cpu %lld\n", "counted rows", loss[1], (long long)counted_cpu);
    ck_assert_msg(loss[1] == (double)counted_cpu, "counted %.0f vs %lld", loss[1], (long long)counted_cpu);
    check_bitwise("loss, with and without backward", &loss[0], &loss[2], 2 * sizeof(double));

    float *dh = download_f32(d_dh, ntok * d), *dhead = download_f32(d_dhead, hl.numel);
    float *dembed = download_f32(d_dembed, el.numel);
    check_close("dh (=)", dh, dh_cpu, ntok * d, tol);
    const mt_tensor_desc *nt = &hl.tensors[MT_H_NORM], *lt = &hl.tensors[MT_H_LM_HEAD];
    check_close("d norm.weight (=)", dhead + nt->offset, dhead_cpu + nt->offset, d, tol);
    if (tied) {
        check_close("d embed_tokens.weight (tied LM head, =)", dembed, dembed_cpu, V * d, tol);
        check_padding_zero("dembed padding (=)", &el, dembed);
    } else {
        check_close("d lm_head.weight (=)", dhead + lt->offset, dhead_cpu + lt->offset, V * d, tol);
    }
    check_padding_zero("dhead padding (=)", &hl, dhead);

    /* += on top: gradients twice the reference, dh and the loss still =. */
    mt_cuda_head(ctx, &cfg, &hl, prec, d_head, d_embed, ntok, d_h, d_targets, loss_scale, chunk, d_dh, d_dhead,
                 tied ? d_dembed : NULL, true, d_loss, d_scratch, s);
    CK_CUDA(cudaStreamSynchronize(st));
    double loss2[2];
    CK_CUDA(cudaMemcpy(loss2, d_loss, sizeof loss2, cudaMemcpyDeviceToHost));
    check_bitwise("loss (not accumulated) in += mode", loss2, loss, sizeof loss2);
    float *dh2 = download_f32(d_dh, ntok * d), *dhead2 = download_f32(d_dhead, hl.numel);
    float *dembed2 = download_f32(d_dembed, el.numel);
    check_bitwise("dh (=) again in += mode", dh2, dh, (size_t)(ntok * d) * 4);
    for (int64_t i = 0; i < hl.numel; i++) dhead_cpu[i] *= 2.0f;
    for (int64_t i = 0; i < el.numel; i++) dembed_cpu[i] *= 2.0f;
    check_close("d norm.weight (+=)", dhead2 + nt->offset, dhead_cpu + nt->offset, d, tol);
    if (tied) check_close("d embed_tokens.weight (tied LM head, +=)", dembed2, dembed_cpu, V * d, tol);
    else check_close("d lm_head.weight (+=)", dhead2 + lt->offset, dhead_cpu + lt->offset, V * d, tol);

    void *bufs[] = {d_head, d_embed, d_h, d_dh, d_targets, d_dhead, d_dembed, d_loss, d_scratch};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) CK_CUDA(cudaFree(bufs[i]));
    CK_CUDA(cudaStreamDestroy(st));
    void *hbufs[] = {head, embed, head_bits, embed_bits, h, targets, scratch, dh_cpu, dhead_cpu, dembed_cpu, dh,
                     dhead, dembed, dh2, dhead2, dembed2};
    for (size_t i = 0; i < sizeof hbufs / sizeof hbufs[0]; i++) free(hbufs[i]);
}

static void run_head_case(const char *name, bool tied, bool first_chunk_ignored)
{
    run_head_prec(name, tied, first_chunk_ignored, MT_CUDA_BF16);
    run_head_prec(name, tied, first_chunk_ignored, MT_CUDA_F32);
}

START_TEST(test_head_untied) { run_head_case("untied", false, false); }
END_TEST

START_TEST(test_head_tied) { run_head_case("tied", true, false); }
END_TEST

START_TEST(test_head_tied_ignored_chunk) { run_head_case("tied, first chunk all ignored", true, true); }
END_TEST

/* ---------- timings (MT_CUDA_BENCH=1) ---------- */

/* Median of n floats (sorts in place). */
static float median(float *v, int n)
{
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && v[j] < v[j - 1]; j--) {
            const float t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
    return v[n / 2];
}

enum { BENCH_REPS = 7 };

/* Runs `what` BENCH_REPS times after one warm-up, printing the median ms and TFLOP/s. */
#define BENCH(label, flops, stmt)                                                                   \
    do {                                                                                          \
        float ms_[BENCH_REPS];                                                                    \
        stmt;                                                                                     \
        for (int r_ = 0; r_ < BENCH_REPS; r_++) {                                                 \
            CK_CUDA(cudaEventRecord(e0, st));                                                     \
            stmt;                                                                                 \
            CK_CUDA(cudaEventRecord(e1, st));                                                     \
            CK_CUDA(cudaEventSynchronize(e1));                                                    \
            CK_CUDA(cudaEventElapsedTime(&ms_[r_], e0, e1));                                      \
        }                                                                                         \
        const float med_ = median(ms_, BENCH_REPS);                                               \
        printf("  %-44s %9.3f ms  %7.1f TFLOP/s\n", label, med_, (flops) / (med_ * 1e-3) / 1e12); \
        fflush(stdout);                                                                           \
    } while (0)

/* The memory-bound kernels' table: GB/s from the least bytes each must move (1 GB = 1e9 B),
 * against t[0], the device's own copy measured the same way. */
static void print_memory_timings(const mt_test_kernel_timing *t, int count)
{
    const double copy_gbs = (double)t[0].bytes / (t[0].ms * 1e-3) / 1e9;
    printf("  %-40s %-24s %9s %13s %8s %9s\n", "kernel", "shape", "ms", "bytes", "GB/s", "% of copy");
    for (int i = 0; i < count; i++) {
        const double gbs = (double)t[i].bytes / (t[i].ms * 1e-3) / 1e9;
        printf("  %-40s %-24s %9.4f %13lld %8.1f %8.1f%%\n", t[i].name, t[i].shape, t[i].ms, (long long)t[i].bytes,
               gbs, 100.0 * gbs / copy_gbs);
    }
    fflush(stdout);
}

START_TEST(test_bench)
{
    if (!getenv("MT_CUDA_BENCH") || strcmp(getenv("MT_CUDA_BENCH"), "1") != 0) {
        printf("bench: MT_CUDA_BENCH=1 not set, skipped\n");
        return;
    }
    /* A Qwen2.5-3B layer (q/k/v bias) on B=4 x T=1024 tokens; the head at its vocabulary. */
    const int64_t B = 4, T = 1024, n = B * T;
    mt_model_config cfg = make_cfg(MT_FAMILY_QWEN2, true, false, 16, 2, 128, true);
    cfg.hidden = 2048;
    cfg.intermediate = 11008;
    cfg.vocab = 151936;
    const int64_t d = cfg.hidden, V = cfg.vocab;
    mt_tile_layout lay, hl;
    mt_layout_build(&cfg, MT_TILE_LAYER, &lay);
    mt_layout_build(&cfg, MT_TILE_HEAD, &hl);
    printf("bench (median of %d, cudaEvent; FLOPs: 2 N + 2 d T per token forward, "
           "twice that backward, attention counted once):\n  layer B=%lld T=%lld d=%lld H=%lld KV=%lld D=%lld "
           "I=%lld, head V=%lld\n",
           BENCH_REPS, (long long)B, (long long)T, (long long)d, (long long)cfg.heads, (long long)cfg.kv_heads,
           (long long)cfg.head_dim, (long long)cfg.intermediate, (long long)V);
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 5);
    float *tile = random_tile(&rng, &lay, 0.02f, true);
    mt_bf16 *tile_bits = bf16_of(tile, lay.numel);
    float *x = frandom(&rng, n * d, 1.0f);
    float *emb = frandom(&rng, V * d, 0.02f);
    mt_bf16 *emb_bits = bf16_of(emb, V * d);
    mt_bf16 *norm_bits = mt_xcalloc(1, (size_t)hl.numel * 2);
    for (int64_t i = 0; i < hl.numel; i++) norm_bits[i] = mt_bf16_from_float(1.0f);
    int32_t *targets = mt_xcalloc(1, (size_t)n * 4);
    for (int64_t i = 0; i < n; i++) targets[i] = (int32_t)(mt_test_uniform(&rng) * V);

    cudaStream_t st = new_stream();
    const mt_cuda_stream s = (mt_cuda_stream)st;
    cudaEvent_t e0, e1;
    CK_CUDA(cudaEventCreate(&e0));
    CK_CUDA(cudaEventCreate(&e1));
    mt_cuda_ctx *ctx = mt_cuda_ctx_get();
    const size_t vec_bytes = (size_t)(n * d) * 4;
    mt_cuda_bf16 *d_tile = gpu_buffer(tile_bits, (size_t)lay.numel * 2);
    float *d_x = gpu_buffer(x, vec_bytes), *d_y = gpu_buffer(NULL, vec_bytes), *d_dx = gpu_buffer(NULL, vec_bytes);
    void *d_saved = gpu_buffer(NULL, mt_cuda_layer_saved_bytes(&cfg, MT_CUDA_BF16, B, T));
    void *d_scratch = gpu_buffer(NULL, mt_cuda_layer_scratch_bytes(&cfg, MT_CUDA_BF16, B, T));
    float *d_dtile = gpu_buffer(NULL, (size_t)lay.numel * 4);
    printf("  saved %.1f MiB, scratch %.1f MiB per layer call\n", mt_cuda_layer_saved_bytes(&cfg, MT_CUDA_BF16, B, T) / 1048576.0,
           mt_cuda_layer_scratch_bytes(&cfg, MT_CUDA_BF16, B, T) / 1048576.0);

    int64_t layer_params = 0;
    for (int t = 0; t < lay.ntensors; t++) layer_params += lay.tensors[t].numel;
    const double fwd_flops = 2.0 * (double)layer_params * n + 2.0 * d * T * n;
    BENCH("layer forward (saved)", fwd_flops,
          mt_cuda_layer_forward(ctx, &cfg, &lay, MT_CUDA_BF16, d_tile, B, T, d_x, d_y, d_saved, d_scratch, s));
    BENCH("layer forward (no saved)", fwd_flops,
          mt_cuda_layer_forward(ctx, &cfg, &lay, MT_CUDA_BF16, d_tile, B, T, d_x, d_y, NULL, d_scratch, s));
    BENCH("layer backward (=)", 2 * fwd_flops,
          mt_cuda_layer_backward(ctx, &cfg, &lay, MT_CUDA_BF16, d_tile, B, T, d_saved, d_x, d_dx, d_dtile, false, d_scratch, s));
    BENCH("layer backward (+=)", 2 * fwd_flops,
          mt_cuda_layer_backward(ctx, &cfg, &lay, MT_CUDA_BF16, d_tile, B, T, d_saved, d_x, d_dx, d_dtile, true, d_scratch, s));

    /* The same layer on the fp32 path (--dtype fp32): fp32 weights, GEMMs and attention. */
    {
        float *d_tile32 = gpu_buffer(tile, (size_t)lay.numel * 4);
        void *d_saved32 = gpu_buffer(NULL, mt_cuda_layer_saved_bytes(&cfg, MT_CUDA_F32, B, T));
        void *d_scratch32 = gpu_buffer(NULL, mt_cuda_layer_scratch_bytes(&cfg, MT_CUDA_F32, B, T));
        BENCH("layer forward (saved), fp32", fwd_flops,
              mt_cuda_layer_forward(ctx, &cfg, &lay, MT_CUDA_F32, d_tile32, B, T, d_x, d_y, d_saved32, d_scratch32, s));
        BENCH("layer backward (=), fp32", 2 * fwd_flops,
              mt_cuda_layer_backward(ctx, &cfg, &lay, MT_CUDA_F32, d_tile32, B, T, d_saved32, d_x, d_dx, d_dtile, false,
                                     d_scratch32, s));
        CK_CUDA(cudaFree(d_tile32));
        CK_CUDA(cudaFree(d_saved32));
        CK_CUDA(cudaFree(d_scratch32));
    }

    /* Attention alone, on the forward's saved q/k/v (the layer's share of it). */
    const int64_t H = cfg.heads, KV = cfg.kv_heads, D = cfg.head_dim;
    mt_cuda_bf16 *q = gpu_buffer(NULL, (size_t)(n * H * D) * 2), *k = gpu_buffer(NULL, (size_t)(n * KV * D) * 2);
    mt_cuda_bf16 *v = gpu_buffer(NULL, (size_t)(n * KV * D) * 2), *o = gpu_buffer(NULL, (size_t)(n * H * D) * 2);
    CK_CUDA(cudaMemset(q, 0, (size_t)(n * H * D) * 2));
    CK_CUDA(cudaMemset(k, 0, (size_t)(n * KV * D) * 2));
    CK_CUDA(cudaMemset(v, 0, (size_t)(n * KV * D) * 2));
    float *lse = gpu_buffer(NULL, (size_t)(n * H) * 4), *dq = gpu_buffer(NULL, (size_t)(n * H * D) * 4);
    float *dk = gpu_buffer(NULL, (size_t)(n * KV * D) * 4), *dv = gpu_buffer(NULL, (size_t)(n * KV * D) * 4);
    void *aws = gpu_buffer(NULL, mt_cuda_attention_workspace_bytes(B, T, H, KV, D));
    const double attn_flops = 2.0 * 2.0 * B * H * (double)T * T * D / 2.0; /* QK^T and PV, causal half */
    BENCH("attention forward", attn_flops, mt_cuda_attention_forward(ctx, B, T, H, KV, D, q, k, v, o, lse, s));
    BENCH("attention backward", 2.5 * attn_flops,
          mt_cuda_attention_backward(ctx, B, T, H, KV, D, q, k, v, o, lse, o, dq, dk, dv, aws, s));

    /* Head over the same tokens, tied, chunk 4096 rows. */
    const int64_t chunk = 4096;
    mt_cuda_bf16 *d_norm = gpu_buffer(norm_bits, (size_t)hl.numel * 2), *d_emb = gpu_buffer(emb_bits, (size_t)(V * d) * 2);
    int32_t *d_targets = gpu_buffer(targets, (size_t)n * 4);
    float *d_dhead = gpu_buffer(NULL, (size_t)hl.numel * 4), *d_dembed = gpu_buffer(NULL, (size_t)(V * d) * 4);
    double *d_loss = gpu_buffer(NULL, 2 * sizeof(double));
    void *d_hscratch = gpu_buffer(NULL, mt_cuda_head_scratch_bytes(&cfg, MT_CUDA_BF16, chunk));
    const double head_flops = 2.0 * (double)V * d * n;
    BENCH("head loss only", head_flops,
          mt_cuda_head(ctx, &cfg, &hl, MT_CUDA_BF16, d_norm, d_emb, n, d_x, d_targets, 1.0 / n, chunk, NULL, NULL, NULL, false,
                       d_loss, d_hscratch, s));
    BENCH("head loss + backward", 3 * head_flops,
          mt_cuda_head(ctx, &cfg, &hl, MT_CUDA_BF16, d_norm, d_emb, n, d_x, d_targets, 1.0 / n, chunk, d_dx, d_dhead, d_dembed,
                       false, d_loss, d_hscratch, s));

    /* Embedding over the same tokens. */
    float *d_dtable = d_dembed;
    void *ews = gpu_buffer(NULL, mt_cuda_embedding_workspace_bytes(n, V));
    BENCH("embedding forward", 0.0, mt_cuda_embedding_forward(n, d, MT_CUDA_BF16, d_emb, d_targets, d_y, s));
    BENCH("embedding backward", 0.0, mt_cuda_embedding_backward(n, d, V, d_targets, d_x, d_dtable, ews, s));
    BENCH("sumsq over the layer gradient", 0.0, mt_cuda_sumsq_f32(d_dtile, lay.numel, d_loss, s));

    void *bufs[] = {d_tile, d_x, d_y, d_dx, d_saved, d_scratch, d_dtile, q, k, v, o, lse, dq, dk, dv, aws,
                    d_norm, d_emb, d_targets, d_dhead, d_dembed, d_loss, d_hscratch, ews};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) CK_CUDA(cudaFree(bufs[i]));

    /* Memory-bound kernels at the same layer shape, on their own buffers (the ones above freed). */
    mt_test_kernel_timing timings[MT_TEST_BENCH_MAX_KERNELS];
    const int ntimings = mt_test_bench_memory_kernels(&cfg, B, T, BENCH_REPS, timings, MT_TEST_BENCH_MAX_KERNELS);
    printf("memory-bound kernels (median of %d, cudaEvent, L2 flushed before each run; bytes: the least traffic, "
           "each input read and each output written once; %% of the first line, a device-to-device copy):\n",
           BENCH_REPS);
    ck_assert_msg(ntimings > 1, "%d memory-bound timings", ntimings);
    for (int i = 0; i < ntimings; i++)
        ck_assert_msg(timings[i].ms > 0 && isfinite(timings[i].ms) && timings[i].bytes > 0, "%s: %.4f ms, %lld bytes",
                      timings[i].name, timings[i].ms, (long long)timings[i].bytes);
    print_memory_timings(timings, ntimings);

    CK_CUDA(cudaEventDestroy(e0));
    CK_CUDA(cudaEventDestroy(e1));
    CK_CUDA(cudaStreamDestroy(st));
    free(tile), free(tile_bits), free(x), free(emb), free(emb_bits), free(norm_bits), free(targets);
}
END_TEST

static Suite *cuda_suite(void)
{
    Suite *s = suite_create("cuda");
    TCase *small = tcase_create("kernels");
    tcase_add_test(small, test_conversions);
    tcase_add_test(small, test_sumsq);
    tcase_add_test(small, test_embedding);
    tcase_add_test(small, test_attention);
    suite_add_tcase(s, small);
    TCase *layer = tcase_create("layer");
    tcase_add_test(layer, test_layer_llama_mqa);
    tcase_add_test(layer, test_layer_rope_scaled);
    tcase_add_test(layer, test_layer_qwen2_mha);
    tcase_add_test(layer, test_layer_qwen3_qknorm);
    tcase_add_test(layer, test_layer_d128);
    suite_add_tcase(s, layer);
    TCase *head = tcase_create("head");
    tcase_add_test(head, test_head_untied);
    tcase_add_test(head, test_head_tied);
    tcase_add_test(head, test_head_tied_ignored_chunk);
    suite_add_tcase(s, head);
    TCase *bench = tcase_create("bench");
    tcase_add_test(bench, test_bench);
    suite_add_tcase(s, bench);
    return s;
}

int main(void)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        printf("no GPU: skipped\n");
        return 77;
    }
    /* The attention kernels of every case, on this (the only) thread's context: MT_ATTENTION and
     * MT_ATTENTION_QBLOCK as the CLI reads them, except that MT_ATTENTION defaults to "own" here.
     * The layer cases check the own kernels: cuDNN's attention is checked by test_cuda_attention
     * (kernel) and test_gpu_step (the step, under the default). Under cuDNN's forward the qwen3
     * D=128 case's k_proj.bias gradient comes out at the 1e-2 bound (a column sum over 131 rows
     * and two query heads, the worst-conditioned tensor of the suite). */
    const char *attn = getenv("MT_ATTENTION") ? getenv("MT_ATTENTION") : "own";
    mt_cuda_options opts = { .attention = MT_CUDA_ATTENTION_OWN };
    char why[256];
    if (mt_runtime_parse_attention(attn, &opts.attention, why, sizeof why) ||
        mt_runtime_parse_qblock(getenv("MT_ATTENTION_QBLOCK"), &opts.qblock, why, sizeof why)) {
        fprintf(stderr, "test_cuda: %s\n", why);
        return 1;
    }
    mt_cuda_ctx_configure(&opts);
    printf("attention: MT_ATTENTION=%s\n", attn);
    /* CUDA is already initialised in this process (the device count): a forked child could not
     * use it, so the tests run in this process. */
    return mt_test_run(cuda_suite(), true);
}
