// RMSNorm on the GPU (as backends/cpu/rmsnorm.inc): fp32 residual stream in, bf16 out for the
// GEMMs that follow, statistics in double, inv_rms kept in fp32. Internal to backends/cuda.
#ifndef MT_BACKENDS_CUDA_RMSNORM_CUH
#define MT_BACKENDS_CUDA_RMSNORM_CUH

#include "common.cuh"

// y (n, d) bf16 = x (n, d) * inv_rms * w (d);  inv_rms (n) = 1/sqrt(mean(x^2) + eps), may be NULL.
void mt_rmsnorm_forward(int64_t n, int64_t d, const float *x, const bf16 *w, double eps, bf16 *y,
                        float *inv_rms, cudaStream_t stream);

// y (n, d) bf16 = x * inv_rms (n) * w: the forward again from saved statistics (backward recompute).
void mt_rmsnorm_apply(int64_t n, int64_t d, const float *x, const bf16 *w, const float *inv_rms, bf16 *y,
                      cudaStream_t stream);

// dx (n, d) fp32 = resid (n, d) (NULL: 0) + the gradient through the norm of dy (n, d) fp32;
// dx_bf16 (n, d), may be NULL, receives the same values rounded for the next GEMM. resid == dx ok.
void mt_rmsnorm_backward(int64_t n, int64_t d, const float *x, const bf16 *w, const float *inv_rms,
                         const float *dy, const float *resid, float *dx, bf16 *dx_bf16, cudaStream_t stream);

// dw (d) fp32 = or += sum over rows of dy * x * inv_rms; partials: mt_colsum_partials_bytes(d).
void mt_rmsnorm_backward_weight(int64_t n, int64_t d, const float *x, const float *inv_rms, const float *dy,
                                float *dw, bool accumulate, float *partials, cudaStream_t stream);

#endif
