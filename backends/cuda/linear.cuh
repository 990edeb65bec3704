// Linear layers on cuBLASLt, in the HF convention: W (out, in) row-major, y = x W^T (+ b).
// The inputs of a GEMM are T (bf16, or float for the fp32 path), accumulation fp32
// (CUBLAS_COMPUTE_32F, which with float inputs is full fp32, no TF32). Internal to backends/cuda.
#ifndef MT_BACKENDS_CUDA_LINEAR_CUH
#define MT_BACKENDS_CUDA_LINEAR_CUH

#include "backends/cuda/common.cuh"

// y (n, out) = x (n, in) W^T (+ bias (out), may be NULL). y is T (ytype mt_cuda_type<T>()) or fp32
// (CUDA_R_32F); a bias needs y of type T (it is added in the epilogue, in y's type).
template <class T>
void mt_linear_forward(mt_cuda_ctx *ctx, int64_t n, int64_t in, int64_t out, const T *x, const T *W,
                       const mt_same<T> *bias, void *y, cudaDataType_t ytype, cudaStream_t stream);

// y (n, out) fp32 = resid (n, out) fp32 + x (n, in) W^T: the residual add in the GEMM epilogue.
// resid == y is allowed (in place).
template <class T>
void mt_linear_forward_residual(mt_cuda_ctx *ctx, int64_t n, int64_t in, int64_t out, const T *x, const T *W,
                                const float *resid, float *y, cudaStream_t stream);

// dx (n, in) = dy (n, out) W, or += with accumulate (fp32 dx only). dxtype CUDA_R_32F or T's.
template <class T>
void mt_linear_backward_input(mt_cuda_ctx *ctx, int64_t n, int64_t in, int64_t out, const T *dy, const T *W,
                              void *dx, cudaDataType_t dxtype, bool accumulate, cudaStream_t stream);

// dW (out, in) fp32 = dy^T (out, n) x (n, in), or += with accumulate.
template <class T>
void mt_linear_backward_weight(mt_cuda_ctx *ctx, int64_t n, int64_t in, int64_t out, const T *x, const T *dy,
                               float *dW, bool accumulate, cudaStream_t stream);

#endif
