// Linear layers on cuBLASLt, in the HF convention: W (out, in) row-major, y = x W^T (+ b).
// Inputs of every GEMM are bf16, accumulation fp32 (CUBLAS_COMPUTE_32F). Internal to backends/cuda.
#ifndef MT_BACKENDS_CUDA_LINEAR_CUH
#define MT_BACKENDS_CUDA_LINEAR_CUH

#include "common.cuh"

// y (n, out) = x (n, in) W^T (+ bias (out), may be NULL). y is bf16 (ytype CUDA_R_16BF) or fp32
// (CUDA_R_32F); a bias needs a bf16 y (it is added in the epilogue, in y's type).
void mt_linear_forward(mt_cuda_ctx *ctx, int64_t n, int64_t in, int64_t out, const bf16 *x, const bf16 *W,
                       const bf16 *bias, void *y, cudaDataType_t ytype, cudaStream_t stream);

// y (n, out) fp32 = resid (n, out) fp32 + x (n, in) W^T: the residual add in the GEMM epilogue.
// resid == y is allowed (in place).
void mt_linear_forward_residual(mt_cuda_ctx *ctx, int64_t n, int64_t in, int64_t out, const bf16 *x,
                                const bf16 *W, const float *resid, float *y, cudaStream_t stream);

// dx (n, in) = dy (n, out) W, or += with accumulate (fp32 dx only). dxtype CUDA_R_32F or CUDA_R_16BF.
void mt_linear_backward_input(mt_cuda_ctx *ctx, int64_t n, int64_t in, int64_t out, const bf16 *dy,
                              const bf16 *W, void *dx, cudaDataType_t dxtype, bool accumulate,
                              cudaStream_t stream);

// dW (out, in) fp32 = dy^T (out, n) x (n, in), or += with accumulate.
void mt_linear_backward_weight(mt_cuda_ctx *ctx, int64_t n, int64_t in, int64_t out, const bf16 *x,
                               const bf16 *dy, float *dW, bool accumulate, cudaStream_t stream);

// db (out) fp32 = or += column sums of dy (n, out) bf16; partials: mt_colsum_partials_bytes(out).
void mt_linear_backward_bias(int64_t n, int64_t out, const bf16 *dy, float *db, bool accumulate, float *partials,
                             cudaStream_t stream);

#endif
