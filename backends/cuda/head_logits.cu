// The logits of selected rows on the GPU (as mt_cpu_head_logits over gathered rows): the rows
// are gathered, final-normed and multiplied by the LM head with the head's own cuBLASLt GEMM,
// for the few positions whose next token generation samples.
#include <assert.h>

#include "backends/cuda/common.cuh"
#include "backends/cuda/linear.cuh"
#include "backends/cuda/rmsnorm.cuh"

enum { GATHER_THREADS = 256 };

// Scratch: the gathered rows (nrows, d) fp32, their norm (nrows, d) T, inv_rms (nrows) fp32.
template <class T> struct logits_scratch {
    float *rows;
    T *hn;
    float *inv_rms;
};

template <class T> static void logits_carve(const mt_model_config *cfg, int64_t nrows, mt_carve *c, logits_scratch<T> *s)
{
    s->rows = mt_take<float>(c, nrows * cfg->hidden);
    s->hn = mt_take<T>(c, nrows * cfg->hidden);
    s->inv_rms = mt_take<float>(c, nrows);
}

extern "C" size_t mt_cuda_head_logits_scratch_bytes(const mt_model_config *cfg, mt_cuda_prec prec, int64_t nrows)
{
    MT_CUDA_REQUIRE(nrows > 0, "head logits: at least one row");
    mt_carve c = {nullptr, 0};
    if (prec == MT_CUDA_F32) {
        logits_scratch<float> s;
        logits_carve(cfg, nrows, &c, &s);
    } else {
        logits_scratch<bf16> s;
        logits_carve(cfg, nrows, &c, &s);
    }
    return mt_carve_size(&c);
}

// out (nrows, d) = h[rows[r]] for each r: one block per selected row. rows are device int32
// indices into h (ntok, d); one outside [0, ntok) is a caller bug: fault loudly.
__global__ static void gather_rows_kernel(int64_t d, int64_t ntok, const float *h, const int32_t *rows, float *out)
{
    const int64_t r = blockIdx.x;
    const int32_t src = rows[r];
    assert(src >= 0 && src < ntok);
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) out[r * d + j] = h[(int64_t)src * d + j];
}

template <class T>
static void logits_run(mt_cuda_ctx *ctx, const mt_model_config *cfg, const mt_tile_layout *head_layout,
                       const T *head_tile, const T *embed_tile, int64_t ntok, const float *h, int64_t nrows,
                       const int32_t *rows, float *logits, void *scratch, cudaStream_t stream)
{
    const int64_t d = cfg->hidden, V = cfg->vocab;
    MT_CUDA_REQUIRE(head_layout->kind == MT_TILE_HEAD, "head logits given a non-head tile layout");
    MT_CUDA_REQUIRE(cfg->tied || head_layout->tensors[MT_H_LM_HEAD].numel == V * d, "untied head without lm_head");
    const float *norm_w = mt_tile_norm(head_layout, head_tile, MT_H_NORM); // (d)
    const T *W = cfg->tied ? embed_tile : head_tile + head_layout->tensors[MT_H_LM_HEAD].offset; // (V, d)
    mt_carve c = {(char *)scratch, 0};
    logits_scratch<T> s;
    logits_carve(cfg, nrows, &c, &s);
    gather_rows_kernel<<<(unsigned)nrows, GATHER_THREADS, 0, stream>>>(d, ntok, h, rows, s.rows);
    CUDA_CHECK_LAUNCH();
    mt_rmsnorm_forward(nrows, d, s.rows, norm_w, cfg->rms_eps, s.hn, s.inv_rms, stream);
    mt_linear_forward(ctx, nrows, d, V, s.hn, W, nullptr, logits, CUDA_R_32F, stream); // (nrows, V) fp32
}

extern "C" void mt_cuda_head_logits(mt_cuda_ctx *ctx, const mt_model_config *cfg, const mt_tile_layout *head_layout,
                                    mt_cuda_prec prec, const void *head_tile, const void *embed_tile, int64_t ntok,
                                    const float *h, int64_t nrows, const int32_t *rows, float *logits, void *scratch,
                                    mt_cuda_stream stream)
{
    if (prec == MT_CUDA_F32)
        logits_run(ctx, cfg, head_layout, (const float *)head_tile, (const float *)embed_tile, ntok, h, nrows, rows,
                   logits, scratch, as_stream(stream));
    else
        logits_run(ctx, cfg, head_layout, (const bf16 *)head_tile, (const bf16 *)embed_tile, ntok, h, nrows, rows,
                   logits, scratch, as_stream(stream));
}
