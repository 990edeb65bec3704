/* test_cuda's timings (MT_CUDA_BENCH=1; otherwise it says so and returns): at a Qwen2.5-3B layer
 * shape, TFLOP/s of the layer (both precisions), attention, the head and the embedding, then the
 * memory-bound kernels' GB/s against the device's own copy (cuda_kernel_bench.cu). */
#include <check.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cuda/kernels.h"
#include "models/util.h"
#include "tests/cuda_kernel_bench.h"
#include "tests/cuda_testutil.h"
#include "tests/testutil.h"

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
    mt_model_config cfg = mt_test_cuda_config(MT_FAMILY_QWEN2, true, false, 16, 2, 128, true);
    cfg.hidden = 2048;
    cfg.intermediate = 11008;
    cfg.vocab = 151936;
    const int64_t d = cfg.hidden, V = cfg.vocab;
    mt_tile_layout lay, hl;
    mt_layout_build(&cfg, MT_TILE_LAYER, &lay);
    mt_layout_build(&cfg, MT_TILE_HEAD, &hl);
    mt_layout_keep_norms_f32(&lay); /* as the bf16 step streams them: the norms in fp32 */
    mt_layout_keep_norms_f32(&hl);
    printf("bench (median of %d, cudaEvent; FLOPs: 2 N + 2 d T per token forward, "
           "twice that backward, attention counted once):\n  layer B=%lld T=%lld d=%lld H=%lld KV=%lld D=%lld "
           "I=%lld, head V=%lld\n",
           BENCH_REPS, (long long)B, (long long)T, (long long)d, (long long)cfg.heads, (long long)cfg.kv_heads,
           (long long)cfg.head_dim, (long long)cfg.intermediate, (long long)V);
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 5);
    float *tile = mt_test_random_tile(&rng, &lay, 0.02f, true);
    float *x = mt_test_random_f32(&rng, n * d, 1.0f);
    float *emb = mt_test_random_f32(&rng, V * d, 0.02f);
    mt_bf16 *emb_bits = mt_test_bf16_of(emb, V * d);
    float *head = mt_test_alloc_f32(hl.numel);
    for (int64_t i = 0; i < hl.numel; i++) head[i] = 1.0f;
    int32_t *targets = mt_xcalloc(1, (size_t)n * 4);
    for (int64_t i = 0; i < n; i++) targets[i] = (int32_t)(mt_test_uniform(&rng) * V);

    cudaStream_t st = mt_test_new_stream();
    const mt_cuda_stream s = (mt_cuda_stream)st;
    cudaEvent_t e0, e1;
    CK_CUDA(cudaEventCreate(&e0));
    CK_CUDA(cudaEventCreate(&e1));
    mt_cuda_ctx *ctx = mt_cuda_ctx_get();
    const size_t vec_bytes = (size_t)(n * d) * 4;
    mt_cuda_bf16 *d_tile = mt_test_gpu_tile(tile, &lay, false);
    float *d_x = mt_test_gpu_buffer(x, vec_bytes), *d_y = mt_test_gpu_buffer(NULL, vec_bytes);
    float *d_dx = mt_test_gpu_buffer(NULL, vec_bytes);
    void *d_saved = mt_test_gpu_buffer(NULL, mt_cuda_layer_saved_bytes(&cfg, MT_CUDA_BF16, B, T));
    void *d_scratch = mt_test_gpu_buffer(NULL, mt_cuda_layer_scratch_bytes(&cfg, MT_CUDA_BF16, B, T));
    float *d_dtile = mt_test_gpu_buffer(NULL, (size_t)lay.numel * 4);
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
        float *d_tile32 = mt_test_gpu_buffer(tile, (size_t)lay.numel * 4);
        void *d_saved32 = mt_test_gpu_buffer(NULL, mt_cuda_layer_saved_bytes(&cfg, MT_CUDA_F32, B, T));
        void *d_scratch32 = mt_test_gpu_buffer(NULL, mt_cuda_layer_scratch_bytes(&cfg, MT_CUDA_F32, B, T));
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
    mt_cuda_bf16 *q = mt_test_gpu_buffer(NULL, (size_t)(n * H * D) * 2);
    mt_cuda_bf16 *k = mt_test_gpu_buffer(NULL, (size_t)(n * KV * D) * 2);
    mt_cuda_bf16 *v = mt_test_gpu_buffer(NULL, (size_t)(n * KV * D) * 2);
    mt_cuda_bf16 *o = mt_test_gpu_buffer(NULL, (size_t)(n * H * D) * 2);
    CK_CUDA(cudaMemset(q, 0, (size_t)(n * H * D) * 2));
    CK_CUDA(cudaMemset(k, 0, (size_t)(n * KV * D) * 2));
    CK_CUDA(cudaMemset(v, 0, (size_t)(n * KV * D) * 2));
    float *lse = mt_test_gpu_buffer(NULL, (size_t)(n * H) * 4), *dq = mt_test_gpu_buffer(NULL, (size_t)(n * H * D) * 4);
    float *dk = mt_test_gpu_buffer(NULL, (size_t)(n * KV * D) * 4);
    float *dv = mt_test_gpu_buffer(NULL, (size_t)(n * KV * D) * 4);
    void *aws = mt_test_gpu_buffer(NULL, mt_cuda_attention_workspace_bytes(B, T, H, KV, D));
    const double attn_flops = 2.0 * 2.0 * B * H * (double)T * T * D / 2.0; /* QK^T and PV, causal half */
    BENCH("attention forward", attn_flops, mt_cuda_attention_forward(ctx, B, T, H, KV, D, q, k, v, o, lse, s));
    BENCH("attention backward", 2.5 * attn_flops,
          mt_cuda_attention_backward(ctx, B, T, H, KV, D, q, k, v, o, lse, o, dq, dk, dv, aws, s));

    /* Head over the same tokens, tied, chunk 4096 rows. */
    const int64_t chunk = 4096;
    mt_cuda_bf16 *d_norm = mt_test_gpu_tile(head, &hl, false);
    mt_cuda_bf16 *d_emb = mt_test_gpu_buffer(emb_bits, (size_t)(V * d) * 2);
    int32_t *d_targets = mt_test_gpu_buffer(targets, (size_t)n * 4);
    float *d_dhead = mt_test_gpu_buffer(NULL, (size_t)hl.numel * 4);
    float *d_dembed = mt_test_gpu_buffer(NULL, (size_t)(V * d) * 4);
    double *d_loss = mt_test_gpu_buffer(NULL, 2 * sizeof(double));
    void *d_hscratch = mt_test_gpu_buffer(NULL, mt_cuda_head_scratch_bytes(&cfg, MT_CUDA_BF16, chunk));
    const double head_flops = 2.0 * (double)V * d * n;
    BENCH("head loss only", head_flops,
          mt_cuda_head(ctx, &cfg, &hl, MT_CUDA_BF16, d_norm, d_emb, n, d_x, d_targets, 1.0 / n, chunk, NULL, NULL, NULL, false,
                       d_loss, d_hscratch, s));
    BENCH("head loss + backward", 3 * head_flops,
          mt_cuda_head(ctx, &cfg, &hl, MT_CUDA_BF16, d_norm, d_emb, n, d_x, d_targets, 1.0 / n, chunk, d_dx, d_dhead, d_dembed,
                       false, d_loss, d_hscratch, s));

    /* Embedding over the same tokens. */
    float *d_dtable = d_dembed;
    void *ews = mt_test_gpu_buffer(NULL, mt_cuda_embedding_workspace_bytes(n, V));
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
    free(tile), free(x), free(emb), free(emb_bits), free(head), free(targets);
}
END_TEST

TCase *mt_test_cuda_bench_tcase(void)
{
    TCase *bench = tcase_create("bench");
    tcase_add_test(bench, test_bench);
    return bench;
}
