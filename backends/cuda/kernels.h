/* The CUDA backend's launchers, callable from C. Each enqueues on the given stream (StarPU's
 * local stream inside a codelet) and never synchronises the device. */
#ifndef MT_BACKENDS_CUDA_KERNELS_H
#define MT_BACKENDS_CUDA_KERNELS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct CUstream_st *mt_cuda_stream;

/* x (n) = value */
void mt_cuda_fill_f32(float *x, int64_t n, float value, mt_cuda_stream stream);

/* Reports whether host pointer p is page-locked memory CUDA knows about (1), pageable (0), or
 * an error (-1). */
int mt_cuda_host_pointer_pinned(const void *p);

#ifdef __cplusplus
}
#endif

#endif
