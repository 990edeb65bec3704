// The head's cross-entropy kernel (head.cu), the step of mt_cuda_head the tests time on its own.
// Internal to backends/cuda.
#ifndef MT_BACKENDS_CUDA_HEAD_CUH
#define MT_BACKENDS_CUDA_HEAD_CUH

#include "backends/cuda/common.cuh"

// One block per row of logits (rows, V) fp32: row_loss (rows) double = lse - logit[target],
// row_counted (rows) = 1 (0, and zero gradient, for target < 0); with dlogits (rows, V) of T
// also its gradient loss_scale (softmax - onehot(target)) =, without (NULL) the loss alone.
template <class T>
void mt_head_cross_entropy(int64_t rows, int64_t V, const float *logits, const int32_t *targets, double loss_scale,
                           T *dlogits, double *row_loss, int *row_counted, cudaStream_t stream);

#endif
