// fill: the smallest CUDA kernel, and the pinned-memory probe used by `megatrain info`.
#include <cuda_runtime.h>

#include "backends/cuda/kernels.h"

__global__ static void fill_kernel(float *x, int64_t n, float value)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        x[i] = value;
}

extern "C" void mt_cuda_fill_f32(float *x, int64_t n, float value, mt_cuda_stream stream)
{
    if (n <= 0) return;
    int64_t blocks = (n + 255) / 256;
    if (blocks > 65535) blocks = 65535;
    fill_kernel<<<(unsigned)blocks, 256, 0, (cudaStream_t)stream>>>(x, n, value);
}

extern "C" int mt_cuda_host_pointer_pinned(const void *p)
{
    cudaPointerAttributes attr;
    if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
        cudaGetLastError();
        return -1;
    }
    return attr.type == cudaMemoryTypeHost ? 1 : 0;
}

extern "C" int mt_cuda_device_memory_used(size_t *used)
{
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
        cudaGetLastError();
        return -1;
    }
    *used = total_b - free_b;
    return 0;
}
