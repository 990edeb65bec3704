/* Check suite of the CUDA attention kernels (backends/cuda/attention.cu, attention_f32.cu):
 * forward and backward against the fp32 CPU reference on fresh random inputs (bf16-rounded for
 * the bf16 kernels, plain fp32 for the fp32 ones), over tile tails, head dims 32-128 (and odd
 * even ones up to 256 for fp32) and MHA / GQA / MQA; the = contract (outputs pre-filled with
 * NaN); bitwise-reproducible backward; and, with MT_CUDA_BENCH=1, the timing of a
 * Qwen2.5-3B-shaped attention. The optional cuDNN path (attention_cudnn.cu) runs the head-dim 64
 * and 128 cases against the same reference and tolerance when libcudnn.so.9 loads (its backward
 * is not required to be bitwise reproducible; with a cuDNN older than 9.15.1 a T no multiple of
 * 128 checks the dispatcher's fallback to the own backward instead), and is timed beside the own
 * kernels, which the dispatcher runs here under MT_CUDA_ATTENTION_OWN whatever the default;
 * with MT_ATTENTION=cudnn, main first prints whether it is available and why not. Without a CUDA
 * device it prints "no GPU: skipped" and exits 77. */
#include <check.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cuda/attention_cudnn.h"
#include "backends/cuda/attention_f32.h"
#include "backends/cuda/kernels.h"
#include "backends/cpu/ops.h"
#include "tests/cuda_testutil.h"
#include "tests/testutil.h"

#define TOL 1e-2 /* ||gpu - cpu|| / ||cpu|| per tensor: bf16 operands, P and dS rounded to bf16 */
/* dsinks in bf16: per head a sum over every row of exp(s - lse) Delta, Delta = sum over the keys
 * of P dP computed from the recomputed probabilities (attention_sinks.cuh): fp32 arithmetic on
 * bf16 inputs, within 1.2e-6 of the CPU for the five windows on an H100. With Delta from the
 * bf16-rounded output it was 5.5e-4 to 1.37e-2 (H200), which this bound tells apart. */
#define TOL_DSINKS 1e-5
/* dk summed over the keys (key_sums): what is left is dS's bf16 rounding in dK = dS^T Q, as in
 * transformers' autocast; 1.7e-3 to 1.95e-2 for the five windows on an H100, 4.2e-3 to 3.6e-2
 * with Delta from the output. */
#define TOL_KEY_SUMS 3e-2
#define TOL_F32 1e-5 /* the same for the fp32 kernels: fp32 ~1e-5 relative per the project's bar
                      * (only the summation order differs from the CPU) */

typedef struct { int B, T, H, KV, D; } shape;

/* Tails (T not a multiple of the 64-row tile), exact multiples, T = 1, every head dim, and
 * (H, KV) = MHA (4,4), MQA (4,1), GQA (6,2). */
static const shape cases[] = {
    {1, 1, 4, 4, 64},   {2, 7, 4, 1, 32},   {1, 77, 6, 2, 128}, {2, 200, 4, 4, 96},
    {1, 513, 4, 1, 64}, {2, 513, 6, 2, 128}, {1, 200, 6, 2, 32}, {2, 77, 4, 1, 96},
    {1, 64, 4, 4, 128}, {1, 128, 6, 2, 64}, {2, 513, 4, 4, 32}, {1, 513, 6, 2, 96},
    {1, 1, 6, 2, 128},
};
#define NCASES ((int)(sizeof cases / sizeof cases[0]))

/* Random N(0,1) values rounded to bf16: bits for the GPU, the same values as floats for the CPU. */
static void random_bf16(mt_test_rng *rng, int64_t n, mt_bf16 *bits, float *values)
{
    mt_test_fill_f32(rng, values, n, 1.0f);
    mt_f32_to_bf16(n, values, bits);
    mt_bf16_to_f32(n, bits, values);
}

static void check_err_tol(const char *what, const shape *s, double err, double tol)
{
    ck_assert_msg(err <= tol, "%s: rel err %.3e > %.1e (B=%d T=%d H=%d KV=%d D=%d)", what, err, tol, s->B, s->T,
                  s->H, s->KV, s->D);
}

static void copy_back(float *host, const float *dev, int64_t n)
{
    CK_CUDA(cudaMemcpy(host, dev, (size_t)n * sizeof(float), cudaMemcpyDeviceToHost));
}

/* Every element finite: the outputs start as NaN, so this says each was written. */
static void check_written(const char *what, const shape *s, const float *x, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        ck_assert_msg(isfinite(x[i]), "%s[%lld] = %g: not written (B=%d T=%d H=%d KV=%d D=%d)", what, (long long)i,
                      x[i], s->B, s->T, s->H, s->KV, s->D);
}

/* One run's results on the host as fp32: out lse dq dk dv, and dq2 dk2 dv2 of the backward run
 * a second time (the reference leaves those NULL). */
typedef struct attn_results { float *out, *lse, *dq, *dk, *dv, *dq2, *dk2, *dv2; } attn_results;

/* A GPU run against the CPU reference: every element written, each tensor's relative error
 * within tol, the second backward bitwise equal to the first when `bitwise`; one line printed,
 * under label. */
static void check_run(const char *label, const shape *s, const attn_results *gpu, const attn_results *ref, double tol,
                      bool bitwise)
{
    const int64_t nq = (int64_t)s->B * s->T * s->H * s->D, nkv = (int64_t)s->B * s->T * s->KV * s->D;
    const int64_t nl = (int64_t)s->B * s->H * s->T;
    const double e_out = mt_test_rel_err_f32(gpu->out, ref->out, nq);
    const double e_lse = mt_test_rel_err_f32(gpu->lse, ref->lse, nl);
    const double e_dq = mt_test_rel_err_f32(gpu->dq, ref->dq, nq), e_dk = mt_test_rel_err_f32(gpu->dk, ref->dk, nkv);
    const double e_dv = mt_test_rel_err_f32(gpu->dv, ref->dv, nkv);
    const int same = memcmp(gpu->dq, gpu->dq2, nq * 4) == 0 && memcmp(gpu->dk, gpu->dk2, nkv * 4) == 0 &&
                     memcmp(gpu->dv, gpu->dv2, nkv * 4) == 0;
    printf("attention %s B=%d T=%3d H=%d KV=%d D=%3d: rel err out %.2e lse %.2e dq %.2e dk %.2e dv %.2e; "
           "backward twice %s\n",
           label, s->B, s->T, s->H, s->KV, s->D, e_out, e_lse, e_dq, e_dk, e_dv, same ? "bitwise equal" : "DIFFERS");
    fflush(stdout);
    check_written("out", s, gpu->out, nq);
    check_written("lse", s, gpu->lse, nl);
    check_written("dq", s, gpu->dq, nq);
    check_written("dk", s, gpu->dk, nkv);
    check_written("dv", s, gpu->dv, nkv);
    check_err_tol("out", s, e_out, tol);
    check_err_tol("lse", s, e_lse, tol);
    check_err_tol("dq", s, e_dq, tol);
    check_err_tol("dk", s, e_dk, tol);
    check_err_tol("dv", s, e_dv, tol);
    ck_assert_msg(same || !bitwise, "%s: backward is not bitwise reproducible (B=%d T=%d H=%d KV=%d D=%d)", label, s->B, s->T,
                  s->H, s->KV, s->D);
}

/* The fp32 CPU reference on the inputs as the GPU sees them (bf16-rounded for the bf16 kernels):
 * its own out and lse, then the backward from them. */
static attn_results cpu_reference(const shape *s, const float *q, const float *k, const float *v, const float *dout)
{
    const int64_t B = s->B, T = s->T, H = s->H, KV = s->KV, D = s->D;
    const int64_t nq = B * T * H * D, nkv = B * T * KV * D, nl = B * H * T;
    attn_results r = { .out = mt_test_alloc_f32(nq), .lse = mt_test_alloc_f32(nl), .dq = mt_test_alloc_f32(nq),
                       .dk = mt_test_alloc_f32(nkv), .dv = mt_test_alloc_f32(nkv) };
    mt_cpu_attention_forward_f32(B, T, H, KV, D, 0, NULL, q, k, v, r.out, r.lse);
    mt_cpu_attention_backward_f32(B, T, H, KV, D, 0, NULL, q, k, v, r.out, r.lse, dout, r.dq, r.dk, r.dv, NULL);
    return r;
}

static void results_free(attn_results *r)
{
    float *p[] = {r->out, r->lse, r->dq, r->dk, r->dv, r->dq2, r->dk2, r->dv2};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) free(p[i]);
}

/* One GPU run's device buffers: inputs and out of esize bytes per element (2: bf16, 4: fp32),
 * everything else fp32; the outputs start as NaN. */
typedef struct attn_dev { void *q, *k, *v, *dout, *out, *ws; float *lse, *dq, *dk, *dv, *dq2, *dk2, *dv2; } attn_dev;

static attn_dev dev_alloc(const shape *s, size_t esize, const void *q, const void *k, const void *v, const void *dout,
                          size_t ws_bytes)
{
    const int64_t nq = (int64_t)s->B * s->T * s->H * s->D, nkv = (int64_t)s->B * s->T * s->KV * s->D;
    const int64_t nl = (int64_t)s->B * s->H * s->T;
    return (attn_dev){
        .q = mt_test_gpu_buffer(q, nq * esize), .k = mt_test_gpu_buffer(k, nkv * esize),
        .v = mt_test_gpu_buffer(v, nkv * esize), .dout = mt_test_gpu_buffer(dout, nq * esize),
        .out = mt_test_gpu_buffer(NULL, nq * esize), .ws = mt_test_gpu_buffer(NULL, ws_bytes),
        .lse = mt_test_gpu_buffer(NULL, nl * 4), .dq = mt_test_gpu_buffer(NULL, nq * 4),
        .dk = mt_test_gpu_buffer(NULL, nkv * 4), .dv = mt_test_gpu_buffer(NULL, nkv * 4),
        .dq2 = mt_test_gpu_buffer(NULL, nq * 4), .dk2 = mt_test_gpu_buffer(NULL, nkv * 4),
        .dv2 = mt_test_gpu_buffer(NULL, nkv * 4),
    };
}

static void dev_free(attn_dev *d)
{
    void *p[] = {d->q, d->k, d->v, d->dout, d->out, d->ws, d->lse, d->dq, d->dk, d->dv, d->dq2, d->dk2, d->dv2};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) CK_CUDA(cudaFree(p[i]));
}

/* The run's results on the host as fp32 (out converted from bf16 when esize is 2). */
static attn_results fetch_results(const shape *s, const attn_dev *d, size_t esize)
{
    const int64_t nq = (int64_t)s->B * s->T * s->H * s->D, nkv = (int64_t)s->B * s->T * s->KV * s->D;
    const int64_t nl = (int64_t)s->B * s->H * s->T;
    attn_results r = { .out = mt_test_alloc_f32(nq), .lse = mt_test_alloc_f32(nl), .dq = mt_test_alloc_f32(nq),
                       .dk = mt_test_alloc_f32(nkv), .dv = mt_test_alloc_f32(nkv), .dq2 = mt_test_alloc_f32(nq),
                       .dk2 = mt_test_alloc_f32(nkv), .dv2 = mt_test_alloc_f32(nkv) };
    if (esize == 2) {
        mt_bf16 *outb = malloc(nq * 2);
        ck_assert_ptr_nonnull(outb);
        CK_CUDA(cudaMemcpy(outb, d->out, nq * 2, cudaMemcpyDeviceToHost));
        mt_bf16_to_f32(nq, outb, r.out);
        free(outb);
    } else {
        copy_back(r.out, d->out, nq);
    }
    copy_back(r.lse, d->lse, nl);
    copy_back(r.dq, d->dq, nq);
    copy_back(r.dk, d->dk, nkv);
    copy_back(r.dv, d->dv, nkv);
    copy_back(r.dq2, d->dq2, nq);
    copy_back(r.dk2, d->dk2, nkv);
    copy_back(r.dv2, d->dv2, nkv);
    return r;
}

/* Random bf16 inputs of a case, and the same values widened to fp32 for the CPU reference. */
typedef struct bf16_inputs {
    mt_bf16 *qb, *kb, *vb, *dob;
    float *q, *k, *v, *dout;
} bf16_inputs;

static bf16_inputs bf16_inputs_new(const shape *s, uint64_t seed)
{
    const int64_t nq = (int64_t)s->B * s->T * s->H * s->D, nkv = (int64_t)s->B * s->T * s->KV * s->D;
    mt_test_rng rng;
    mt_test_rng_seed(&rng, seed);
    bf16_inputs in = {malloc(nq * 2), malloc(nkv * 2), malloc(nkv * 2), malloc(nq * 2),
                      mt_test_alloc_f32(nq), mt_test_alloc_f32(nkv), mt_test_alloc_f32(nkv), mt_test_alloc_f32(nq)};
    random_bf16(&rng, nq, in.qb, in.q);
    random_bf16(&rng, nkv, in.kb, in.k);
    random_bf16(&rng, nkv, in.vb, in.v);
    random_bf16(&rng, nq, in.dob, in.dout);
    return in;
}

static void bf16_inputs_free(bf16_inputs *in)
{
    void *host[] = {in->qb, in->kb, in->vb, in->dob, in->q, in->k, in->v, in->dout};
    for (size_t i = 0; i < sizeof host / sizeof host[0]; i++) free(host[i]);
}

/* Every case under each query-block form (mt_cuda_qblock, named as MT_ATTENTION_QBLOCK names
 * them): 64 rows, 128 rows of 8 warps, 128 rows of 4 warps with 32 rows each (the default; its
 * dQ pass is the 64-row one). */
static const struct {
    const char *name;
    mt_cuda_qblock qblock;
} forms[] = {{"64", MT_CUDA_QBLOCK_64}, {"128", MT_CUDA_QBLOCK_128}, {"128w", MT_CUDA_QBLOCK_128W}};
#define NFORMS ((int)(sizeof forms / sizeof forms[0]))

/* This thread's CUDA context, set to run these attention kernels (the tests run on one thread). */
static mt_cuda_ctx *attention_ctx(mt_cuda_attention attention, mt_cuda_qblock qblock)
{
    const mt_cuda_options o = { .attention = attention, .qblock = qblock };
    mt_cuda_ctx_configure(&o);
    return mt_cuda_ctx_get();
}
START_TEST(test_attention_vs_cpu)
{
    const shape *s = &cases[_i % NCASES];
    const char *qblock = forms[_i / NCASES].name;
    mt_cuda_ctx *ctx = attention_ctx(MT_CUDA_ATTENTION_OWN, forms[_i / NCASES].qblock);
    const int64_t B = s->B, T = s->T, H = s->H, KV = s->KV, D = s->D;
    bf16_inputs in = bf16_inputs_new(s, 1000 + (uint64_t)_i);
    attn_results ref = cpu_reference(s, in.q, in.k, in.v, in.dout);

    attn_dev d = dev_alloc(s, 2, in.qb, in.kb, in.vb, in.dob, mt_cuda_attention_workspace_bytes(B, T, H, KV, D));
    cudaStream_t stream;
    CK_CUDA(cudaStreamCreate(&stream));
    mt_cuda_attention_forward(ctx, B, T, H, KV, D, d.q, d.k, d.v, d.out, d.lse, (mt_cuda_stream)stream);
    mt_cuda_attention_backward(ctx, B, T, H, KV, D, d.q, d.k, d.v, d.out, d.lse, d.dout, d.dq, d.dk, d.dv, d.ws,
                               (mt_cuda_stream)stream);
    /* the same backward again (workspace reused): must match bitwise */
    mt_cuda_attention_backward(ctx, B, T, H, KV, D, d.q, d.k, d.v, d.out, d.lse, d.dout, d.dq2, d.dk2, d.dv2, d.ws,
                               (mt_cuda_stream)stream);
    CK_CUDA(cudaStreamSynchronize(stream));
    CK_CUDA(cudaGetLastError());
    CK_CUDA(cudaStreamDestroy(stream));
    attn_results gpu = fetch_results(s, &d, 2);

    char label[64];
    snprintf(label, sizeof label, "(query block %s)", qblock);
    check_run(label, s, &gpu, &ref, TOL, true);

    dev_free(&d);
    results_free(&gpu);
    results_free(&ref);
    bf16_inputs_free(&in);
}
END_TEST

/* gpt_oss's attention: sliding windows of 1, 9, 64 and 100 keys (within one tile, across tiles,
 * past T) and a sink logit per head, through the dispatcher (the windowed layers on the own
 * kernels, cuDNN's forward allowed for the unwindowed one, the backward with sinks the own one),
 * bf16 and fp32, against the CPU's (which a naive reference and central differences check,
 * tests/test_ops.c): out, lse, dq, dk, dv, dsinks and dk summed over the keys. */
static const struct {
    shape s;
    int window;
} window_cases[] = {
    {{2, 77, 4, 1, 64}, 9}, {{1, 200, 6, 2, 64}, 64}, {{1, 513, 4, 4, 128}, 100}, {{2, 33, 4, 2, 64}, 1},
    {{1, 150, 4, 1, 64}, 0},
};
#define NWINDOW ((int)(sizeof window_cases / sizeof window_cases[0]))

/* dk (B, T, KV, D) summed over B and T: a key bias's gradient. Each query row's dS sums over its
 * keys to p_sink Delta, small next to the row's terms, so this sum shows how exactly the backward
 * keeps Delta (attention_sinks.cuh). */
static float *key_sums(const shape *s, const float *dk)
{
    const int64_t n = (int64_t)s->KV * s->D;
    double *acc = calloc((size_t)n, sizeof *acc);
    float *out = malloc((size_t)n * sizeof *out);
    ck_assert_ptr_nonnull(acc);
    ck_assert_ptr_nonnull(out);
    for (int64_t r = 0; r < (int64_t)s->B * s->T; r++)
        for (int64_t i = 0; i < n; i++) acc[i] += dk[r * n + i];
    for (int64_t i = 0; i < n; i++) out[i] = (float)acc[i];
    free(acc);
    return out;
}

START_TEST(test_attention_window_sinks_vs_cpu)
{
    const shape *s = &window_cases[_i / 2].s;
    const int64_t W = window_cases[_i / 2].window;
    const bool f32 = _i % 2;
    mt_cuda_ctx *ctx = attention_ctx(MT_CUDA_ATTENTION_AUTO, MT_CUDA_QBLOCK_128W);
    const int64_t B = s->B, T = s->T, H = s->H, KV = s->KV, D = s->D;
    const int64_t nq = B * T * H * D, nkv = B * T * KV * D, nl = B * H * T;
    bf16_inputs in = bf16_inputs_new(s, 3000 + (uint64_t)_i);
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 4000 + (uint64_t)_i);
    float sinks[8];
    mt_bf16 sinks_b[8];
    random_bf16(&rng, H, sinks_b, sinks);
    attn_results ref = { .out = mt_test_alloc_f32(nq), .lse = mt_test_alloc_f32(nl), .dq = mt_test_alloc_f32(nq),
                         .dk = mt_test_alloc_f32(nkv), .dv = mt_test_alloc_f32(nkv) };
    float dsinks_ref[8] = { 0 }, dsinks[8];
    mt_cpu_attention_forward_f32(B, T, H, KV, D, W, sinks, in.q, in.k, in.v, ref.out, ref.lse);
    mt_cpu_attention_backward_f32(B, T, H, KV, D, W, sinks, in.q, in.k, in.v, ref.out, ref.lse, in.dout, ref.dq, ref.dk,
                                  ref.dv, dsinks_ref);

    const size_t ws = f32 ? mt_cuda_attention_f32_workspace_bytes(B, T, H, KV, D)
                          : mt_cuda_attention_workspace_bytes(B, T, H, KV, D);
    attn_dev d = f32 ? dev_alloc(s, 4, in.q, in.k, in.v, in.dout, ws) : dev_alloc(s, 2, in.qb, in.kb, in.vb, in.dob, ws);
    float *d_dsinks = mt_test_gpu_buffer(NULL, H * 4), *d_dsinks2 = mt_test_gpu_buffer(NULL, H * 4);
    CK_CUDA(cudaMemset(d_dsinks, 0, H * 4));
    CK_CUDA(cudaMemset(d_dsinks2, 0, H * 4));
    void *d_sinks = f32 ? mt_test_gpu_buffer(sinks, H * 4) : mt_test_gpu_buffer(sinks_b, H * 2);
    cudaStream_t stream;
    CK_CUDA(cudaStreamCreate(&stream));
    const mt_cuda_stream st = (mt_cuda_stream)stream;
    if (f32) {
        mt_cuda_attention_forward_f32_ex(B, T, H, KV, D, W, d_sinks, d.q, d.k, d.v, d.out, d.lse, st);
        mt_cuda_attention_backward_f32_ex(B, T, H, KV, D, W, d_sinks, d.q, d.k, d.v, d.out, d.lse, d.dout, d.dq, d.dk,
                                          d.dv, d_dsinks, d.ws, st);
        mt_cuda_attention_backward_f32_ex(B, T, H, KV, D, W, d_sinks, d.q, d.k, d.v, d.out, d.lse, d.dout, d.dq2,
                                          d.dk2, d.dv2, d_dsinks2, d.ws, st);
    } else {
        mt_cuda_attention_forward_ex(ctx, B, T, H, KV, D, W, d_sinks, d.q, d.k, d.v, d.out, d.lse, st);
        mt_cuda_attention_backward_ex(ctx, B, T, H, KV, D, W, d_sinks, d.q, d.k, d.v, d.out, d.lse, d.dout, d.dq, d.dk,
                                      d.dv, d_dsinks, d.ws, st);
        mt_cuda_attention_backward_ex(ctx, B, T, H, KV, D, W, d_sinks, d.q, d.k, d.v, d.out, d.lse, d.dout, d.dq2,
                                      d.dk2, d.dv2, d_dsinks2, d.ws, st);
    }
    CK_CUDA(cudaStreamSynchronize(stream));
    CK_CUDA(cudaGetLastError());
    CK_CUDA(cudaStreamDestroy(stream));
    attn_results gpu = fetch_results(s, &d, f32 ? 4 : 2);
    copy_back(dsinks, d_dsinks, H);

    char label[64];
    snprintf(label, sizeof label, "%s window %lld, sinks", f32 ? "fp32" : "bf16", (long long)W);
    /* with sinks the backward is the own one (cuDNN's is not bitwise reproducible) */
    check_run(label, s, &gpu, &ref, f32 ? TOL_F32 : TOL, true);
    const double e_sinks = mt_test_rel_err_f32(dsinks, dsinks_ref, H);
    float *sums = key_sums(s, gpu.dk), *sums_ref = key_sums(s, ref.dk);
    const double e_sums = mt_test_rel_err_f32(sums, sums_ref, KV * D);
    printf("attention %s: dsinks rel err %.2e, dk summed over the keys %.2e\n", label, e_sinks, e_sums);
    check_err_tol("dsinks", s, e_sinks, f32 ? TOL_F32 : TOL_DSINKS);
    check_err_tol("dk summed over the keys", s, e_sums, f32 ? TOL_F32 : TOL_KEY_SUMS);
    free(sums);
    free(sums_ref);

    CK_CUDA(cudaFree(d_dsinks));
    CK_CUDA(cudaFree(d_dsinks2));
    CK_CUDA(cudaFree(d_sinks));
    dev_free(&d);
    results_free(&gpu);
    results_free(&ref);
    bf16_inputs_free(&in);
}
END_TEST

/* The cuDNN path: the head-dim 64 and 128 cases above (T = 1, tails, MHA, MQA, GQA) and the
 * Qwen2.5-3B head layout (H 16, KV 2, D 128) at a T that is no multiple of 64. */
static const shape cases_cudnn[] = {
    {1, 1, 4, 4, 64},   {1, 77, 6, 2, 128}, {1, 513, 4, 1, 64}, {2, 513, 6, 2, 128},
    {1, 64, 4, 4, 128}, {1, 128, 6, 2, 64}, {1, 1, 6, 2, 128},  {2, 200, 16, 2, 128},
    /* multiples of 128, which every cuDNN 9 backward takes (cuDNN 9.14's takes no other T) */
    {2, 256, 16, 2, 128}, {1, 384, 4, 1, 64}, {3, 128, 8, 8, 128},
};
#define NCUDNN ((int)(sizeof cases_cudnn / sizeof cases_cudnn[0]))

/* MT_ATTENTION=cudnn was given: the cuDNN path must load (main reads it; the own kernels' tests,
 * which call the dispatcher, run it under MT_CUDA_ATTENTION_OWN whatever it says). */
static int cudnn_asked;

/* 1 when the cuDNN path loads on this thread; otherwise prints why (once) and returns 0. */
static int cudnn_available_or_say(void)
{
    static int said;
    char why[384];
    if (mt_cuda_attention_cudnn_available(why, sizeof why)) return 1;
    if (!said) printf("attention cudnn: skipped (%s)\n", why), fflush(stdout);
    said = 1;
    return 0;
}

/* The cuDNN entry points called directly (a failure is a test failure here, not a silent fallback
 * to the own kernel): same inputs, reference, tolerance and = contract as test_attention_vs_cpu. */
START_TEST(test_attention_cudnn_vs_cpu)
{
    if (!cudnn_available_or_say()) {
        /* optional without the library; asked for by name, its absence is a failure */
        ck_assert_msg(!cudnn_asked, "MT_ATTENTION=cudnn, but the cuDNN path does not load");
        return;
    }
    const shape *s = &cases_cudnn[_i];
    const int64_t B = s->B, T = s->T, H = s->H, KV = s->KV, D = s->D;
    bf16_inputs in = bf16_inputs_new(s, 9000 + (uint64_t)_i);
    attn_results ref = cpu_reference(s, in.q, in.k, in.v, in.dout);

    const size_t ws_bytes = mt_cuda_attention_workspace_bytes(B, T, H, KV, D);
    attn_dev d = dev_alloc(s, 2, in.qb, in.kb, in.vb, in.dob, ws_bytes);
    cudaStream_t stream;
    CK_CUDA(cudaStreamCreate(&stream));
    char why[384] = "";
    int rc = mt_cuda_attention_cudnn_forward(B, T, H, KV, D, d.q, d.k, d.v, d.out, d.lse, (mt_cuda_stream)stream, why,
                                             sizeof why);
    ck_assert_msg(rc == 0, "cudnn forward B=%d T=%d H=%d KV=%d D=%d: %s", s->B, s->T, s->H, s->KV, s->D, why);
    rc = mt_cuda_attention_cudnn_backward(B, T, H, KV, D, d.q, d.k, d.v, d.out, d.lse, d.dout, d.dq, d.dk, d.dv, d.ws,
                                          ws_bytes, (mt_cuda_stream)stream, why, sizeof why);
    const char *label = "(cudnn)";
    if (!mt_cuda_attention_cudnn_backward_takes_T(T)) {
        /* an older cuDNN declines this T, saying why; MT_CUDA_ATTENTION_CUDNN then runs the own
         * backward through the dispatcher (checked below as the cuDNN one would be) */
        ck_assert_msg(rc != 0 && strstr(why, "T % 128 == 0"), "cudnn backward T=%d: declined without the T reason: %s",
                      s->T, why);
        printf("attention cudnn backward T=%d declined (%s): the dispatcher's fallback is checked instead\n", s->T, why);
        mt_cuda_ctx *ctx = attention_ctx(MT_CUDA_ATTENTION_CUDNN, MT_CUDA_QBLOCK_128W);
        mt_cuda_attention_backward(ctx, B, T, H, KV, D, d.q, d.k, d.v, d.out, d.lse, d.dout, d.dq, d.dk, d.dv, d.ws,
                                   (mt_cuda_stream)stream);
        mt_cuda_attention_backward(ctx, B, T, H, KV, D, d.q, d.k, d.v, d.out, d.lse, d.dout, d.dq2, d.dk2, d.dv2,
                                   d.ws, (mt_cuda_stream)stream);
        attention_ctx(MT_CUDA_ATTENTION_OWN, MT_CUDA_QBLOCK_128W); /* as main left it */
        label = "(cudnn forward, own backward)";
    } else {
        ck_assert_msg(rc == 0, "cudnn backward B=%d T=%d H=%d KV=%d D=%d: %s", s->B, s->T, s->H, s->KV, s->D, why);
        rc = mt_cuda_attention_cudnn_backward(B, T, H, KV, D, d.q, d.k, d.v, d.out, d.lse, d.dout, d.dq2, d.dk2,
                                              d.dv2, d.ws, ws_bytes, (mt_cuda_stream)stream, why, sizeof why);
        ck_assert_msg(rc == 0, "cudnn backward (second) B=%d T=%d H=%d KV=%d D=%d: %s", s->B, s->T, s->H, s->KV,
                      s->D, why);
    }
    CK_CUDA(cudaStreamSynchronize(stream));
    CK_CUDA(cudaGetLastError());
    CK_CUDA(cudaStreamDestroy(stream));
    attn_results gpu = fetch_results(s, &d, 2);

    /* float atomics on dQ inside cuDNN: the second backward may differ in the last bits */
    check_run(label, s, &gpu, &ref, TOL, false);

    dev_free(&d);
    results_free(&gpu);
    results_free(&ref);
    bf16_inputs_free(&in);
}
END_TEST

/* The fp32 kernels also take any even head dim up to 256: a few that are no multiple of 32 (or
 * of 4), beyond 128, and the smallest, with tails in every tile size (32 and 64 rows). */
static const shape cases_f32_extra[] = {
    {1, 77, 4, 2, 80}, {2, 65, 2, 1, 256}, {1, 33, 2, 2, 2}, {1, 100, 6, 3, 160}, {2, 31, 4, 4, 6},
};
#define NEXTRA ((int)(sizeof cases_f32_extra / sizeof cases_f32_extra[0]))

/* The fp32 kernels against the fp32 CPU reference on the same plain fp32 inputs. */
START_TEST(test_attention_f32_vs_cpu)
{
    const shape *s = _i < NCASES ? &cases[_i] : &cases_f32_extra[_i - NCASES];
    const int64_t B = s->B, T = s->T, H = s->H, KV = s->KV, D = s->D;
    const int64_t nq = B * T * H * D, nkv = B * T * KV * D;
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 5000 + (uint64_t)_i);

    float *q = mt_test_alloc_f32(nq), *k = mt_test_alloc_f32(nkv), *v = mt_test_alloc_f32(nkv);
    float *dout = mt_test_alloc_f32(nq);
    mt_test_fill_f32(&rng, q, nq, 1.0f);
    mt_test_fill_f32(&rng, k, nkv, 1.0f);
    mt_test_fill_f32(&rng, v, nkv, 1.0f);
    mt_test_fill_f32(&rng, dout, nq, 1.0f);
    attn_results ref = cpu_reference(s, q, k, v, dout);

    attn_dev d = dev_alloc(s, 4, q, k, v, dout, mt_cuda_attention_f32_workspace_bytes(B, T, H, KV, D));
    cudaStream_t stream;
    CK_CUDA(cudaStreamCreate(&stream));
    mt_cuda_attention_forward_f32(B, T, H, KV, D, d.q, d.k, d.v, d.out, d.lse, (mt_cuda_stream)stream);
    mt_cuda_attention_backward_f32(B, T, H, KV, D, d.q, d.k, d.v, d.out, d.lse, d.dout, d.dq, d.dk, d.dv, d.ws,
                                   (mt_cuda_stream)stream);
    /* the same backward again (workspace reused): must match bitwise */
    mt_cuda_attention_backward_f32(B, T, H, KV, D, d.q, d.k, d.v, d.out, d.lse, d.dout, d.dq2, d.dk2, d.dv2, d.ws,
                                   (mt_cuda_stream)stream);
    CK_CUDA(cudaStreamSynchronize(stream));
    CK_CUDA(cudaGetLastError());
    CK_CUDA(cudaStreamDestroy(stream));
    attn_results gpu = fetch_results(s, &d, 4);

    check_run("fp32", s, &gpu, &ref, TOL_F32, true);

    dev_free(&d);
    results_free(&gpu);
    results_free(&ref);
    void *host[] = {q, k, v, dout};
    for (size_t i = 0; i < sizeof host / sizeof host[0]; i++) free(host[i]);
}
END_TEST

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* Timing, only with MT_CUDA_BENCH=1: Qwen2.5-3B attention shape. Median of 10 after 3 warm-up
 * runs; TFLOP/s with forward = 4 B H T^2 D / 2 (causal half), backward = 2.5 x forward.
 * MT_CUDA_BENCH=profile runs each kernel once and nothing else, for a profiler (ncu). */
static bool bench_profile(void)
{
    const char *env = getenv("MT_CUDA_BENCH");
    return env && strcmp(env, "profile") == 0;
}

/* The buffers of a timed attention call (dev_alloc's), its stream and the events time_call
 * records; and the calls timed: the dispatcher (the own kernels, under MT_CUDA_ATTENTION_OWN),
 * the cuDNN entry points (a failure fails the bench), the fp32 kernels. */
typedef struct bench_bufs {
    int64_t B, T, H, KV, D;
    attn_dev d;
    size_t ws_bytes;
    cudaStream_t stream;
    cudaEvent_t start, stop;
} bench_bufs;
typedef void (*bench_call)(const bench_bufs *b, bool fwd);

static bench_bufs bench_open(const shape *s, size_t esize, const void *q, const void *k, const void *v,
                             const void *dout, size_t ws_bytes)
{
    bench_bufs b = { .B = s->B, .T = s->T, .H = s->H, .KV = s->KV, .D = s->D,
                     .d = dev_alloc(s, esize, q, k, v, dout, ws_bytes), .ws_bytes = ws_bytes };
    CK_CUDA(cudaStreamCreate(&b.stream));
    CK_CUDA(cudaEventCreate(&b.start));
    CK_CUDA(cudaEventCreate(&b.stop));
    return b;
}

static void bench_close(bench_bufs *b)
{
    CK_CUDA(cudaGetLastError());
    CK_CUDA(cudaEventDestroy(b->start));
    CK_CUDA(cudaEventDestroy(b->stop));
    CK_CUDA(cudaStreamDestroy(b->stream));
    dev_free(&b->d);
}

static void call_own(const bench_bufs *b, bool fwd)
{
    if (fwd)
        mt_cuda_attention_forward(mt_cuda_ctx_get(), b->B, b->T, b->H, b->KV, b->D, b->d.q, b->d.k, b->d.v, b->d.out,
                                  b->d.lse, (mt_cuda_stream)b->stream);
    else
        mt_cuda_attention_backward(mt_cuda_ctx_get(), b->B, b->T, b->H, b->KV, b->D, b->d.q, b->d.k, b->d.v, b->d.out,
                                   b->d.lse, b->d.dout, b->d.dq, b->d.dk, b->d.dv, b->d.ws, (mt_cuda_stream)b->stream);
}

static void call_cudnn(const bench_bufs *b, bool fwd)
{
    char why[384] = "";
    int rc;
    if (fwd)
        rc = mt_cuda_attention_cudnn_forward(b->B, b->T, b->H, b->KV, b->D, b->d.q, b->d.k, b->d.v, b->d.out, b->d.lse,
                                             (mt_cuda_stream)b->stream, why, sizeof why);
    else
        rc = mt_cuda_attention_cudnn_backward(b->B, b->T, b->H, b->KV, b->D, b->d.q, b->d.k, b->d.v, b->d.out,
                                              b->d.lse, b->d.dout, b->d.dq, b->d.dk, b->d.dv, b->d.ws, b->ws_bytes,
                                              (mt_cuda_stream)b->stream, why, sizeof why);
    ck_assert_msg(rc == 0, "cudnn %s: %s", fwd ? "forward" : "backward", why);
}

static void call_f32(const bench_bufs *b, bool fwd)
{
    if (fwd)
        mt_cuda_attention_forward_f32(b->B, b->T, b->H, b->KV, b->D, b->d.q, b->d.k, b->d.v, b->d.out, b->d.lse,
                                      (mt_cuda_stream)b->stream);
    else
        mt_cuda_attention_backward_f32(b->B, b->T, b->H, b->KV, b->D, b->d.q, b->d.k, b->d.v, b->d.out, b->d.lse,
                                       b->d.dout, b->d.dq, b->d.dk, b->d.dv, b->d.ws, (mt_cuda_stream)b->stream);
}

/* Times call: median of 10 after 3 warm-up runs, printed as "<prefix> forward |backward <tag> B=..
 * median .. ms (min .., max ..), .. TFLOP/s (forward = 4 B H T^2 D / 2, backward = 2.5 x
 * forward<note>)". */
static void time_call(const char *prefix, const char *tag, const char *note, bench_call call, const bench_bufs *b,
                      bool fwd)
{
    float ms[10];
    for (int r = 0; r < 13; r++) {
        CK_CUDA(cudaEventRecord(b->start, b->stream));
        call(b, fwd);
        CK_CUDA(cudaEventRecord(b->stop, b->stream));
        CK_CUDA(cudaEventSynchronize(b->stop));
        if (r >= 3) CK_CUDA(cudaEventElapsedTime(&ms[r - 3], b->start, b->stop));
    }
    qsort(ms, 10, sizeof ms[0], cmp_float);
    const double fwd_flops = 4.0 * b->B * b->H * (double)b->T * b->T * b->D / 2;
    const double med = 0.5 * (ms[4] + ms[5]), flops = fwd ? fwd_flops : 2.5 * fwd_flops;
    printf("%s %s%s B=%lld T=%lld H=%lld KV=%lld D=%lld: median %.3f ms (min %.3f, max %.3f), %.1f TFLOP/s (forward = "
           "4 B H T^2 D / 2, backward = 2.5 x forward%s)\n",
           prefix, fwd ? "forward " : "backward", tag, (long long)b->B, (long long)b->T, (long long)b->H,
           (long long)b->KV, (long long)b->D, med, ms[0], ms[9], flops / (med * 1e-3) / 1e12, note);
    fflush(stdout);
}

START_TEST(test_attention_bench)
{
    const char *env = getenv("MT_CUDA_BENCH");
    const bool profile = bench_profile();
    if (!env || (strcmp(env, "1") != 0 && !profile)) {
        printf("attention bench: skipped (set MT_CUDA_BENCH=1)\n");
        return;
    }
    const shape bs = {8, 2048, 16, 2, 128};
    const int64_t B = bs.B, T = bs.T, H = bs.H, KV = bs.KV, D = bs.D;
    const int64_t nq = B * T * H * D, nkv = B * T * KV * D;
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 7);
    mt_bf16 *qb = malloc(nq * 2), *kb = malloc(nkv * 2), *vb = malloc(nkv * 2), *dob = malloc(nq * 2);
    float *tmp = mt_test_alloc_f32(nq);
    random_bf16(&rng, nq, qb, tmp);
    random_bf16(&rng, nkv, kb, tmp);
    random_bf16(&rng, nkv, vb, tmp);
    random_bf16(&rng, nq, dob, tmp);
    bench_bufs bufs = bench_open(&bs, 2, qb, kb, vb, dob, mt_cuda_attention_workspace_bytes(B, T, H, KV, D));
    /* passes 2f, 2f + 1: forward, backward under form f */
    for (int pass = 0; pass < 2 * NFORMS; pass++) {
        attention_ctx(MT_CUDA_ATTENTION_OWN, forms[pass / 2].qblock);
        const bool fwd = pass % 2 == 0;
        if (profile) {
            call_own(&bufs, fwd);
            CK_CUDA(cudaStreamSynchronize(bufs.stream));
            continue;
        }
        char tag[64];
        snprintf(tag, sizeof tag, " (MT_ATTENTION_QBLOCK=%s)", forms[pass / 2].name);
        time_call("attention bench", tag, "", call_own, &bufs, fwd);
    }
    attention_ctx(MT_CUDA_ATTENTION_OWN, MT_CUDA_QBLOCK_128W);

    /* The cuDNN path, called directly (a failure fails the bench instead of timing the own
     * kernel), on the same buffers; its forward first leaves its own out and lse. */
    if (!profile && cudnn_available_or_say()) {
        for (int pass = 0; pass < 2; pass++)
            time_call("attention bench", " (cudnn)", "; the backward includes the bf16 -> fp32 conversion of dq dk dv",
                      call_cudnn, &bufs, pass == 0);
        printf("attention cudnn plans B=%lld T=%lld H=%lld KV=%lld D=%lld: forward workspace %lld bytes, backward "
               "%lld bytes (of the %zu the backward is given)\n",
               (long long)B, (long long)T, (long long)H, (long long)KV, (long long)D,
               (long long)mt_cuda_attention_cudnn_plan_workspace(B, T, H, KV, D, 0),
               (long long)mt_cuda_attention_cudnn_plan_workspace(B, T, H, KV, D, 1), bufs.ws_bytes);
        fflush(stdout);
    }
    bench_close(&bufs);
    free(qb), free(kb), free(vb), free(dob), free(tmp);
}
END_TEST

/* Timing of the fp32 kernels, only with MT_CUDA_BENCH=1: the same shape and convention as
 * test_attention_bench (median of 10 after 3 warm-up runs). */
START_TEST(test_attention_f32_bench)
{
    const char *env = getenv("MT_CUDA_BENCH");
    if (!env || strcmp(env, "1") != 0) {
        printf("attention fp32 bench: skipped (set MT_CUDA_BENCH=1)\n");
        return;
    }
    const shape bs = {8, 2048, 16, 2, 128};
    const int64_t nq = (int64_t)bs.B * bs.T * bs.H * bs.D, nkv = (int64_t)bs.B * bs.T * bs.KV * bs.D;
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 8);
    float *tmp = mt_test_alloc_f32(nq);
    mt_test_fill_f32(&rng, tmp, nq, 1.0f);
    bench_bufs bufs = bench_open(&bs, 4, tmp, tmp, tmp + nkv, tmp,
                                 mt_cuda_attention_f32_workspace_bytes(bs.B, bs.T, bs.H, bs.KV, bs.D));
    /* the backward reads out and lse: one forward first */
    call_f32(&bufs, true);
    for (int pass = 0; pass < 2; pass++) time_call("attention fp32 bench", "", "", call_f32, &bufs, pass == 0);
    bench_close(&bufs);
    free(tmp);
}
END_TEST

static Suite *cuda_attention_suite(void)
{
    Suite *s = suite_create("cuda_attention");
    TCase *tc = tcase_create("gpu");
    tcase_set_timeout(tc, 1200);
    if (!bench_profile()) tcase_add_loop_test(tc, test_attention_vs_cpu, 0, NFORMS * NCASES);
    if (!bench_profile()) tcase_add_loop_test(tc, test_attention_f32_vs_cpu, 0, NCASES + NEXTRA);
    if (!bench_profile()) tcase_add_loop_test(tc, test_attention_cudnn_vs_cpu, 0, NCUDNN);
    if (!bench_profile()) tcase_add_loop_test(tc, test_attention_window_sinks_vs_cpu, 0, 2 * NWINDOW);
    tcase_add_test(tc, test_attention_bench);
    tcase_add_test(tc, test_attention_f32_bench);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    /* MT_ATTENTION=cudnn: say whether the cuDNN path loads here, and why not (this runs without
     * a GPU too: then cudnnCreate fails, cleanly). */
    const char *attn = getenv("MT_ATTENTION");
    cudnn_asked = attn && strcmp(attn, "cudnn") == 0;
    if (cudnn_asked) {
        char why[384] = "";
        const int ok = mt_cuda_attention_cudnn_available(why, sizeof why);
        printf("attention cudnn: %s%s%s\n", ok ? "available" : "unavailable (", ok ? "" : why, ok ? "" : ")");
        /* the graphs' descriptors, which need no GPU: GQA (backward with head reductions) and MHA;
         * a descriptor cuDNN rejects fails the suite, cuDNN absent (-2) does not */
        const int gqa = mt_cuda_attention_cudnn_check_graphs(2, 200, 16, 2, 128, why, sizeof why);
        printf("attention cudnn graphs B=2 T=200 H=16 KV=2 D=128: %s\n", why);
        const int mha = mt_cuda_attention_cudnn_check_graphs(1, 77, 4, 4, 64, why, sizeof why);
        printf("attention cudnn graphs B=1 T=77 H=4 KV=4 D=64: %s\n", why);
        fflush(stdout);
        if (gqa == -1 || mha == -1) return 1;
    }
    int ndev = 0;
    cudaError_t err = cudaGetDeviceCount(&ndev);
    if (err != cudaSuccess || ndev == 0) {
        printf("no GPU: skipped (%s)\n", err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
        return 77;
    }
    /* CUDA is already initialised in this process (the device count): a forked child could not
     * use it, so the tests run in-process, on this thread's context. */
    const mt_cuda_options own = { .attention = MT_CUDA_ATTENTION_OWN };
    mt_cuda_ctx_configure(&own);
    return mt_test_run(cuda_attention_suite(), true);
}
