// The head on the GPU (as backends/cpu/head.inc): final RMSNorm, LM head and cross-entropy,
// `chunk` rows at a time so that at most chunk x V logits exist. The loss is summed per row, then
// over rows in a fixed order (no atomics): repeated runs agree bitwise.
#include <assert.h>
#include <math.h>

extern "C" { // C header without its own linkage guard: mt_layout_build
#include "models/layout.h"
}

#include "backends/cuda/colsum.cuh"
#include "backends/cuda/head.cuh"
#include "backends/cuda/linear.cuh"
#include "backends/cuda/rmsnorm.cuh"

enum { CE_THREADS = 512, LOSS_THREADS = 256 };

// Per chunk: hn (chunk,d) T, inv_rms (chunk) fp32, logits (chunk,V) fp32, dlogits (chunk,V) T
// (the GEMMs' input), dhn (chunk,d) fp32, per-row loss (chunk) double and counted flag (chunk)
// int, column-sum partials for the norm weight (64 x d fp32). T: the precision's operand type.
template <class T> struct head_scratch {
    T *hn;
    float *inv_rms, *logits;
    T *dlogits;
    float *dhn;
    double *row_loss;
    int *row_counted;
    float *partials;
};

template <class T> static void head_carve(const mt_model_config *cfg, int64_t chunk, mt_carve *c, head_scratch<T> *s)
{
    const int64_t d = cfg->hidden, V = cfg->vocab;
    s->hn = mt_take<T>(c, chunk * d);
    s->inv_rms = mt_take<float>(c, chunk);
    s->logits = mt_take<float>(c, chunk * V);
    s->dlogits = mt_take<T>(c, chunk * V);
    s->dhn = mt_take<float>(c, chunk * d);
    s->row_loss = mt_take<double>(c, chunk);
    s->row_counted = mt_take<int>(c, chunk);
    s->partials = (float *)mt_take<char>(c, (int64_t)mt_colsum_partials_bytes(d));
}

extern "C" size_t mt_cuda_head_scratch_bytes(const mt_model_config *cfg, mt_cuda_prec prec, int64_t chunk)
{
    MT_CUDA_REQUIRE(chunk > 0, "head chunk must be positive");
    mt_carve c = {nullptr, 0};
    if (prec == MT_CUDA_F32) {
        head_scratch<float> s;
        head_carve(cfg, chunk, &c, &s);
    } else {
        head_scratch<bf16> s;
        head_carve(cfg, chunk, &c, &s);
    }
    return mt_carve_size(&c);
}

// One block per row of logits (rows, V): log-sum-exp by an online max/sum per thread (float exp,
// double sums), row_loss = lse - logit[target]; with Backward also
// dlogits = loss_scale (softmax - onehot(target)) as T. Rows with target < 0 count nothing and
// get zero gradient.
template <class T, bool Backward>
__global__ static void cross_entropy_kernel(int64_t V, const float *logits, const int32_t *targets, double loss_scale,
                                            T *dlogits, double *row_loss, int *row_counted)
{
    __shared__ float shared_max[32];
    __shared__ double shared_sum[32];
    const int64_t r = blockIdx.x;
    const float *row = logits + r * V;
    const int32_t target = targets[r];
    if (target < 0) { // uniform over the block
        if (Backward)
            for (int64_t j = threadIdx.x; j < V; j += blockDim.x) dlogits[r * V + j] = from_f<T>(0.f);
        if (threadIdx.x == 0) {
            row_loss[r] = 0;
            row_counted[r] = 0;
        }
        return;
    }
    assert(target < V); // a target outside the vocabulary is a data bug: fault loudly

    float mx = -INFINITY;
    double sum = 0;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
        const float x = row[j];
        if (x > mx) {
            sum = sum * (double)expf(mx - x) + 1.0;
            mx = x;
        } else {
            sum += (double)expf(x - mx);
        }
    }
    const float row_max = mt_block_max(mx, shared_max);
    const double part = mx == -INFINITY ? 0.0 : sum * (double)expf(mx - row_max);
    const double total = mt_block_sum(part, shared_sum);
    const double lse = (double)row_max + log(total);
    if (threadIdx.x == 0) {
        row_loss[r] = lse - (double)row[target];
        row_counted[r] = 1;
    }
    if (!Backward) return;
    const float scale = (float)loss_scale;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
        float g = (float)(loss_scale * (double)expf((float)((double)row[j] - lse)));
        if (j == target) g -= scale;
        dlogits[r * V + j] = from_f<T>(g);
    }
}

template <class T>
void mt_head_cross_entropy(int64_t rows, int64_t V, const float *logits, const int32_t *targets, double loss_scale,
                           T *dlogits, double *row_loss, int *row_counted, cudaStream_t stream)
{
    if (dlogits)
        cross_entropy_kernel<T, true><<<(unsigned)rows, CE_THREADS, 0, stream>>>(V, logits, targets, loss_scale,
                                                                                 dlogits, row_loss, row_counted);
    else
        cross_entropy_kernel<T, false><<<(unsigned)rows, CE_THREADS, 0, stream>>>(V, logits, targets, loss_scale,
                                                                                  nullptr, row_loss, row_counted);
    CUDA_CHECK_LAUNCH();
}
template void mt_head_cross_entropy<bf16>(int64_t, int64_t, const float *, const int32_t *, double, bf16 *, double *,
                                          int *, cudaStream_t);
template void mt_head_cross_entropy<float>(int64_t, int64_t, const float *, const int32_t *, double, float *,
                                           double *, int *, cudaStream_t);

// loss[0] += sum of row_loss (rows), loss[1] += counted rows: one block, fixed order.
__global__ static void loss_sum_kernel(int64_t rows, const double *row_loss, const int *row_counted, double *loss)
{
    __shared__ double shared[32];
    double s = 0, c = 0;
    for (int64_t i = threadIdx.x; i < rows; i += blockDim.x) {
        s += row_loss[i];
        c += (double)row_counted[i];
    }
    s = mt_block_sum(s, shared);
    c = mt_block_sum(c, shared);
    if (threadIdx.x == 0) {
        loss[0] += s;
        loss[1] += c;
    }
}

template <class T>
static void head_run(mt_cuda_ctx *ctx, const mt_model_config *cfg, const mt_tile_layout *head_layout,
                     const T *head_tile, const T *embed_tile, int64_t ntok, const float *h, const int32_t *targets, double loss_scale,
                     int64_t chunk, float *dh, float *dhead, float *dembed, bool accumulate, double *loss,
                     void *scratch, mt_cuda_stream stream_)
{
    const cudaStream_t stream = as_stream(stream_);
    const int64_t d = cfg->hidden, V = cfg->vocab;
    MT_CUDA_REQUIRE(head_layout->kind == MT_TILE_HEAD, "head launcher given a non-head tile layout");
    MT_CUDA_REQUIRE(chunk > 0, "head chunk must be positive");
    MT_CUDA_REQUIRE(cfg->tied || head_layout->tensors[MT_H_LM_HEAD].numel == V * d, "untied head without lm_head");
    const mt_tensor_desc *norm_t = &head_layout->tensors[MT_H_NORM], *lm_t = &head_layout->tensors[MT_H_LM_HEAD];
    const float *norm_w = mt_tile_norm(head_layout, head_tile, MT_H_NORM); // (d)
    const T *W = cfg->tied ? embed_tile : head_tile + lm_t->offset; // (V, d)

    float *dW = nullptr, *dnorm = nullptr;
    if (dh) {
        MT_CUDA_REQUIRE(dhead && (!cfg->tied || dembed), "head backward needs dhead (and dembed when tied)");
        dW = cfg->tied ? dembed : dhead + lm_t->offset; // (V, d)
        dnorm = dhead + norm_t->offset;                  // (d)
        if (!accumulate) {
            // `=`: the first chunk's GEMM writes dW with beta 0; everything else of the gradient
            // tiles (the norm, padding) is zeroed here so the norm can accumulate chunk by chunk.
            if (cfg->tied) {
                CUDA_CHECK(cudaMemsetAsync(dhead, 0, (size_t)head_layout->numel * sizeof(float), stream));
                mt_tile_layout embed_layout;
                mt_layout_build(cfg, MT_TILE_EMBED, &embed_layout);
                const int64_t tail = embed_layout.numel - V * d;
                if (tail > 0) CUDA_CHECK(cudaMemsetAsync(dembed + V * d, 0, (size_t)tail * sizeof(float), stream));
            } else {
                CUDA_CHECK(cudaMemsetAsync(dhead, 0, (size_t)lm_t->offset * sizeof(float), stream));
                const int64_t tail = head_layout->numel - (lm_t->offset + V * d);
                if (tail > 0)
                    CUDA_CHECK(cudaMemsetAsync(dhead + lm_t->offset + V * d, 0, (size_t)tail * sizeof(float), stream));
            }
            if (ntok <= 0) CUDA_CHECK(cudaMemsetAsync(dW, 0, (size_t)(V * d) * sizeof(float), stream));
        }
    }
    CUDA_CHECK(cudaMemsetAsync(loss, 0, 2 * sizeof(double), stream));

    mt_carve c = {(char *)scratch, 0};
    head_scratch<T> s;
    head_carve(cfg, chunk, &c, &s);
    for (int64_t r0 = 0; r0 < ntok; r0 += chunk) {
        const int64_t rows = ntok - r0 < chunk ? ntok - r0 : chunk;
        const float *hc = h + r0 * d; // (rows, d)
        mt_rmsnorm_forward(rows, d, hc, norm_w, cfg->rms_eps, s.hn, s.inv_rms, stream);
        mt_linear_forward(ctx, rows, d, V, s.hn, W, nullptr, s.logits, CUDA_R_32F, stream); // (rows, V)
        mt_head_cross_entropy(rows, V, s.logits, targets + r0, loss_scale, dh ? s.dlogits : nullptr, s.row_loss,
                              s.row_counted, stream);
        loss_sum_kernel<<<1, LOSS_THREADS, 0, stream>>>(rows, s.row_loss, s.row_counted, loss);
        CUDA_CHECK_LAUNCH();
        if (!dh) continue;

        // Ignored rows carry zero dlogits, so they add nothing below (no host-side count needed).
        mt_linear_backward_weight(ctx, rows, d, V, s.hn, s.dlogits, dW, accumulate || r0 > 0, stream);
        mt_linear_backward_input(ctx, rows, d, V, s.dlogits, W, s.dhn, CUDA_R_32F, false, stream); // dhn (rows, d)
        mt_rmsnorm_backward<T>(rows, d, hc, norm_w, s.inv_rms, s.dhn, nullptr, dh + r0 * d, nullptr, stream);
        mt_rmsnorm_backward_weight(rows, d, hc, s.inv_rms, s.dhn, dnorm, true, s.partials, stream);
    }
}

extern "C" void mt_cuda_head(mt_cuda_ctx *ctx, const mt_model_config *cfg, const mt_tile_layout *head_layout,
                             mt_cuda_prec prec, const void *head_tile, const void *embed_tile, int64_t ntok,
                             const float *h, const int32_t *targets, double loss_scale, int64_t chunk, float *dh,
                             float *dhead, float *dembed, bool accumulate, double *loss, void *scratch,
                             mt_cuda_stream stream)
{
    if (prec == MT_CUDA_F32)
        head_run(ctx, cfg, head_layout, (const float *)head_tile, (const float *)embed_tile, ntok, h, targets,
                 loss_scale, chunk, dh, dhead, dembed, accumulate, loss, scratch, stream);
    else
        head_run(ctx, cfg, head_layout, (const bf16 *)head_tile, (const bf16 *)embed_tile, ntok, h, targets,
                 loss_scale, chunk, dh, dhead, dembed, accumulate, loss, scratch, stream);
}
