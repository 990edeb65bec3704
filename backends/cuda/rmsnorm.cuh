// RMSNorm on the GPU (as backends/cpu/rmsnorm.inc): fp32 residual stream in, T (bf16, or float on
// the fp32 path) out for the GEMMs that follow, fp32 weights (a bf16 tile keeps its norms in fp32:
// models/layout.h, mt_layout_keep_norms_f32), statistics in double, inv_rms kept in fp32. Internal
// to backends/cuda.
#ifndef MT_BACKENDS_CUDA_RMSNORM_CUH
#define MT_BACKENDS_CUDA_RMSNORM_CUH

#include <type_traits>

#include "backends/cuda/common.cuh"
#include "models/layout.h"

// Norm `slot` of a streamed tile of E, fp32: an fp32 tile's elements, a bf16 tile's fp32 side
// (f32_at); NULL when absent. A bf16 tile without the side is a caller's error.
template <class E> static inline const float *mt_tile_norm(const mt_tile_layout *layout, const E *tile, int slot)
{
    const mt_tensor_desc *t = &layout->tensors[slot];
    if (t->numel == 0) return nullptr;
    if constexpr (std::is_same<E, float>::value) {
        return tile + t->offset;
    } else {
        MT_CUDA_REQUIRE(t->f32_at != 0, "%s: a bf16 tile's norms stream in fp32 (mt_layout_keep_norms_f32)", t->name);
        return reinterpret_cast<const float *>(tile) + t->f32_at;
    }
}

// y (n, d) T = x (n, d) * inv_rms * w (d);  inv_rms (n) = 1/sqrt(mean(x^2) + eps), may be NULL.
template <class T>
void mt_rmsnorm_forward(int64_t n, int64_t d, const float *x, const float *w, double eps, T *y, float *inv_rms,
                        cudaStream_t stream);

// y (n, d) T = x * inv_rms (n) * w: the forward again from saved statistics (backward recompute).
template <class T>
void mt_rmsnorm_apply(int64_t n, int64_t d, const float *x, const float *w, const float *inv_rms, T *y,
                      cudaStream_t stream);

// dx (n, d) fp32 = resid (n, d) (NULL: 0) + the gradient through the norm of dy (n, d) fp32;
// dx_low (n, d), may be NULL, receives the same values as T for the next GEMM. resid == dx ok.
template <class T>
void mt_rmsnorm_backward(int64_t n, int64_t d, const float *x, const float *w, const float *inv_rms, const float *dy,
                         const float *resid, float *dx, mt_same<T> *dx_low, cudaStream_t stream);

// dw (d) fp32 = or += sum over rows of dy * x * inv_rms; partials: mt_colsum_partials_bytes(d).
void mt_rmsnorm_backward_weight(int64_t n, int64_t d, const float *x, const float *inv_rms, const float *dy,
                                float *dw, bool accumulate, float *partials, cudaStream_t stream);

#endif
