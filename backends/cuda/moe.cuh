// The mixture-of-experts block of a sparse decoder layer on the GPU (Qwen3-MoE, Mixtral), as
// backends/cpu/moe.inc computes it: router logits and softmax, the top k per token, the
// assignments grouped by expert and the load-balancing loss's statistics (moe_routing.cu), each
// expert's SwiGLU MLP over its gathered rows as per-expert cuBLAS GEMMs, and the weighted
// combine; and the backward through all of it, that loss's gradient included. T is the operand type (bf16, or float on the fp32 path); GEMMs
// accumulate in fp32, the combine and every gradient are fp32. Internal to backends/cuda
// (layer.cu calls it; kernels.h has its C entry points). docs/moe.md.
#ifndef MT_BACKENDS_CUDA_MOE_CUH
#define MT_BACKENDS_CUDA_MOE_CUH

extern "C" { // C headers without their own linkage guards
#include "models/config.h"
#include "models/layout.h"
}

#include "backends/cuda/common.cuh"

// What the backward of the block needs, written by its forward: n tokens, k experts each,
// nk = n * k assignments (a = token * k + slot), E experts, Ie expert width.
//   probs (n, E) fp32          router probabilities
//   experts (n, k) int32       each token's experts in rank order
//   weights (n, k) fp32        their routing weights (renormalised when the config says so)
//   order (nk) int32           the assignments grouped by expert, tokens ascending within one
//   pos (nk) int32             its inverse: order[pos[a]] = a, the grouped row of assignment a
//   offsets (E + 1) int32      expert e's rows are [offsets[e], offsets[e + 1]) of the grouped order
//   gu (nk, 2 Ie) T            per grouped row the gate and up pre-activations, [g | u]
template <class T> struct mt_moe_saved {
    float *probs, *weights;
    int32_t *experts, *order, *pos, *offsets;
    T *gu;
};

// Carves the saved set for n tokens from c (sizing only when c->base is NULL).
template <class T> void mt_moe_saved_carve(const mt_model_config *cfg, int64_t n, mt_carve *c, mt_moe_saved<T> *s);
// Scratch bytes of the block's forward (besides the saved set) and of its backward.
template <class T> size_t mt_moe_forward_scratch_bytes(const mt_model_config *cfg, int64_t n);
template <class T> size_t mt_moe_backward_scratch_bytes(const mt_model_config *cfg, int64_t n);

// Aborts naming the violated condition unless layout is cfg's sparse layer layout and the
// routing fits the kernels (E <= MT_MAX_EXPERTS, n * k < 2^31).
void mt_moe_check(const mt_model_config *cfg, const mt_tile_layout *layout, int64_t n);

// y (n, d) fp32 = resid (n, d) fp32 (NULL: 0) + MoE(hn (n, d) T), the experts' weighted sum;
// sv written. tile: the sparse layer's tile of T. router_stats (2E) device doubles += the
// load-balancing loss's statistics, as mt_cpu_moe_forward's (the E assignment counts, then the E
// probability sums), or NULL. Synchronises `stream` once (the experts' row counts decide the
// GEMMs' shapes on the host).
template <class T>
void mt_moe_forward(mt_cuda_ctx *ctx, const mt_model_config *cfg, const mt_tile_layout *layout, const T *tile,
                    int64_t n, const T *hn, const float *resid, float *y, const mt_moe_saved<T> *sv,
                    double *router_stats, void *scratch, cudaStream_t stream);

// Its backward from dy (n, d) T, the gradient at the block's output: dhn (n, d) fp32 =; dtile fp32
// += at the router and at every expert some token chose (the others' stay as they are). hn and sv
// as the forward had them. aux_counts (E) device doubles, the assignments per expert of the whole
// forward call, or NULL: aux_scale x aux_counts[e] joins the gradient at each row's probability
// of expert e (mt_moe_aux_grad_scale). Synchronises `stream` once.
template <class T>
void mt_moe_backward(mt_cuda_ctx *ctx, const mt_model_config *cfg, const mt_tile_layout *layout, const T *tile,
                     int64_t n, const T *hn, const mt_moe_saved<T> *sv, const T *dy, const double *aux_counts,
                     double aux_scale, float *dhn, float *dtile, void *scratch, cudaStream_t stream);

// ---- routing (moe_routing.cu): the kernels behind kernels.h's mt_cuda_router_* and mt_cuda_moe_group ----

void mt_moe_router_softmax(int64_t n, int64_t E, const float *logits, float *probs, cudaStream_t stream);
void mt_moe_router_topk(int64_t n, int64_t E, int64_t k, bool renormalise, const float *probs, int32_t *experts,
                        float *weights, cudaStream_t stream);
size_t mt_moe_group_workspace_bytes(int64_t n, int64_t E, int64_t k);
void mt_moe_group(int64_t n, int64_t E, int64_t k, const int32_t *experts, int32_t *offsets, int32_t *order,
                  int32_t *pos, void *workspace, cudaStream_t stream);
// stats (2E) double += the load-balancing loss's statistics of n rows: stats[e] the assignments
// to expert e from the grouping's offsets (E + 1), stats[E + e] the sum of probs (n, E) column e.
void mt_moe_router_stats(int64_t n, int64_t E, const float *probs, const int32_t *offsets, double *stats,
                         cudaStream_t stream);
// dlogits (n, E) T = the gradient at the router logits from dgrouped (nk) fp32, the gradient at
// each grouped row's routing weight, and the load-balancing loss's aux_scale x aux_counts[e] (E
// doubles; NULL: none) at each probability of expert e: through the renormalisation, when on,
// and the softmax, as mt_cpu_router_backward.
template <class T>
void mt_moe_router_backward(int64_t n, int64_t E, int64_t k, bool renormalise, const float *probs,
                            const int32_t *experts, const int32_t *pos, const float *dgrouped,
                            const double *aux_counts, double aux_scale, T *dlogits, cudaStream_t stream);

#endif
