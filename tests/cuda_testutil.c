/* Shared helpers of the CUDA suites. */
#include "tests/cuda_testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/util.h"
#include "runtime/runtime.h"

void mt_test_round_bf16(float *x, int64_t n, mt_bf16 *bits)
{
    mt_bf16 *b = bits ? bits : mt_xcalloc(1, (size_t)n * sizeof(mt_bf16));
    mt_f32_to_bf16(n, x, b);
    mt_bf16_to_f32(n, b, x);
    if (!bits) free(b);
}

mt_bf16 *mt_test_bf16_of(const float *x, int64_t n)
{
    mt_bf16 *b = mt_xcalloc(1, (size_t)(n > 0 ? n : 1) * sizeof(mt_bf16));
    mt_f32_to_bf16(n, x, b);
    return b;
}

void *mt_test_gpu_buffer(const void *host, size_t bytes)
{
    void *p = NULL;
    CK_CUDA(cudaMalloc(&p, bytes ? bytes : 16));
    if (host) CK_CUDA(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice));
    else CK_CUDA(cudaMemset(p, 0xff, bytes ? bytes : 16));
    return p;
}

void mt_test_gpu_fill_nan(void *p, size_t bytes, cudaStream_t st) { CK_CUDA(cudaMemsetAsync(p, 0xff, bytes, st)); }

float *mt_test_download_f32(const float *dev, int64_t n)
{
    float *h = mt_test_alloc_f32(n);
    CK_CUDA(cudaMemcpy(h, dev, (size_t)n * sizeof(float), cudaMemcpyDeviceToHost));
    return h;
}

float *mt_test_download_bf16(const mt_cuda_bf16 *dev, int64_t n)
{
    mt_bf16 *b = mt_xcalloc(1, (size_t)n * sizeof(mt_bf16));
    CK_CUDA(cudaMemcpy(b, dev, (size_t)n * sizeof(mt_bf16), cudaMemcpyDeviceToHost));
    float *h = mt_test_alloc_f32(n);
    mt_bf16_to_f32(n, b, h);
    free(b);
    return h;
}

cudaStream_t mt_test_new_stream(void)
{
    cudaStream_t st;
    CK_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    return st;
}

mt_model_config mt_test_cuda_config(mt_family family, bool qkv_bias, bool qk_norm, int64_t H, int64_t KV, int64_t D,
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

float *mt_test_random_tile(mt_test_rng *rng, const mt_tile_layout *lay, float scale, bool bf16_valued)
{
    float *tile = mt_test_alloc_f32(lay->numel);
    for (int s = 0; s < lay->ntensors; s++) {
        const mt_tensor_desc *t = &lay->tensors[s];
        if (t->numel == 0) continue;
        const bool is_norm = t->ndim == 1 && strstr(t->name, "norm") != NULL;
        mt_test_fill_f32(rng, tile + t->offset, t->numel, is_norm ? 0.2f : scale);
        if (is_norm)
            for (int64_t i = 0; i < t->numel; i++) tile[t->offset + i] += 1.0f;
    }
    if (bf16_valued) mt_test_round_tile_bf16(tile, lay);
    return tile;
}

void mt_test_round_tile_bf16(float *tile, const mt_tile_layout *lay)
{
    for (int s = 0; s < lay->ntensors; s++) {
        const mt_tensor_desc *t = &lay->tensors[s];
        if (t->numel > 0 && !t->f32_at) mt_test_round_bf16(tile + t->offset, t->numel, NULL);
    }
}

void *mt_test_gpu_tile(const float *tile, const mt_tile_layout *lay, bool f32)
{
    if (f32) return mt_test_gpu_buffer(tile, (size_t)lay->numel * sizeof(float));
    const size_t bytes = mt_layout_stream_bytes(lay, sizeof(mt_bf16));
    unsigned char *host = mt_xcalloc(1, bytes);
    mt_f32_to_bf16(lay->numel, tile, (mt_bf16 *)host);
    for (int s = 0; s < lay->ntensors; s++) {
        const mt_tensor_desc *t = &lay->tensors[s];
        if (t->numel > 0 && t->f32_at)
            memcpy((float *)host + t->f32_at, tile + t->offset, (size_t)t->numel * sizeof(float));
    }
    void *dev = mt_test_gpu_buffer(host, bytes);
    free(host);
    return dev;
}

void mt_test_check_padding_zero(const char *what, const mt_tile_layout *lay, const float *dtile)
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

int mt_test_cuda_main(const char *name, Suite *suite)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        printf("no GPU: skipped\n");
        return 77;
    }
    const char *attn = getenv("MT_ATTENTION") ? getenv("MT_ATTENTION") : "own";
    mt_cuda_options opts = { .attention = MT_CUDA_ATTENTION_OWN };
    char why[256];
    if (mt_runtime_parse_attention(attn, &opts.attention, why, sizeof why) ||
        mt_runtime_parse_qblock(getenv("MT_ATTENTION_QBLOCK"), &opts.qblock, why, sizeof why)) {
        fprintf(stderr, "%s: %s\n", name, why);
        return 1;
    }
    mt_cuda_ctx_configure(&opts);
    printf("attention: MT_ATTENTION=%s\n", attn);
    return mt_test_run(suite, true);
}
