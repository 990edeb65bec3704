// Shared pieces of the CUDA backend: check macros, bf16 helpers, the per-thread context, the
// scratch carver and deterministic block reductions. Internal to backends/cuda (C++ only).
#ifndef MT_BACKENDS_CUDA_COMMON_CUH
#define MT_BACKENDS_CUDA_COMMON_CUH

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "backends/cuda/kernels.h"

// ---- error checks: every CUDA / cuBLASLt call goes through one of these ----

static inline const char *mt_cuda_hint(cudaError_t e)
{
    switch (e) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
        return "no usable GPU: check nvidia-smi and that the driver supports CUDA 13";
    case cudaErrorMemoryAllocation:
        return "GPU memory exhausted: lower the batch or STARPU_LIMIT_CUDA_MEM";
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorAssert:
        return "a kernel faulted (maybe an earlier, asynchronous one): rerun under compute-sanitizer";
    case cudaErrorInvalidValue:
    case cudaErrorInvalidConfiguration:
        return "bad launch or argument: check the shapes passed to this launcher";
    default:
        return "see the CUDA runtime documentation for this error";
    }
}

static inline void mt_cuda_check_at(cudaError_t e, const char *what, const char *file, int line)
{
    if (e == cudaSuccess) return;
    fprintf(stderr, "%s:%d: %s failed: %s (%s)\n  hint: %s\n", file, line, what, cudaGetErrorName(e),
            cudaGetErrorString(e), mt_cuda_hint(e));
    abort();
}

static inline void mt_cublas_check_at(cublasStatus_t s, const char *what, const char *file, int line)
{
    if (s == CUBLAS_STATUS_SUCCESS) return;
    const char *hint = s == CUBLAS_STATUS_NOT_SUPPORTED
                           ? "no cuBLASLt kernel for this shape/type/alignment combination"
                       : s == CUBLAS_STATUS_NOT_INITIALIZED ? "cuBLASLt handle missing: no GPU or driver?"
                       : s == CUBLAS_STATUS_INVALID_VALUE   ? "bad dimensions or leading dimensions"
                       : s == CUBLAS_STATUS_EXECUTION_FAILED
                           ? "the GEMM kernel failed (maybe an earlier asynchronous fault)"
                           : "see the cuBLAS documentation for this status";
    fprintf(stderr, "%s:%d: %s failed: cuBLAS status %d (%s)\n  hint: %s\n", file, line, what, (int)s,
            cublasLtGetStatusString(s), hint);
    abort();
}

#define CUDA_CHECK(call) mt_cuda_check_at((call), #call, __FILE__, __LINE__)
#define CUBLAS_CHECK(call) mt_cublas_check_at((call), #call, __FILE__, __LINE__)
// After a <<<>>> launch: catches bad configurations at once (faults surface at a later check).
#define CUDA_CHECK_LAUNCH() mt_cuda_check_at(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)

// Invariants the caller must hold: abort loudly with the violated condition.
#define MT_CUDA_REQUIRE(cond, ...)                                                                 \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: %s: ", __FILE__, __LINE__, #cond);                             \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

// ---- bf16: the C API passes raw bits (mt_cuda_bf16 = uint16_t); kernels use __nv_bfloat16 ----

typedef __nv_bfloat16 bf16;
static_assert(sizeof(bf16) == sizeof(mt_cuda_bf16), "bf16 must be 16 bits");

static inline bf16 *as_bf16(mt_cuda_bf16 *p) { return reinterpret_cast<bf16 *>(p); }
static inline const bf16 *as_bf16(const mt_cuda_bf16 *p) { return reinterpret_cast<const bf16 *>(p); }
static __device__ __forceinline__ float bf2f(bf16 x) { return __bfloat162float(x); }
static __device__ __forceinline__ bf16 f2bf(float x) { return __float2bfloat16_rn(x); } // RNE as the host

static inline cudaStream_t as_stream(mt_cuda_stream s) { return (cudaStream_t)s; }

// A sliding attention window over T keys as the attention kernels take it: query t sees keys
// t - window + 1 .. t; 0 for none, which a window of T or more (or 0 or less) is.
static inline int mt_attention_window(int64_t window, int64_t T)
{
    return window > 0 && window < T ? (int)window : 0;
}

// ---- operand types: kernels that read weights or feed GEMMs are templates on T, the element
// type of weights and GEMM inputs: bf16 (MT_CUDA_BF16, tensor cores) or float (MT_CUDA_F32, every
// value fp32). Math is fp32 either way; to_f / from_f<T> are the loads and stores. ----

static __device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
static __device__ __forceinline__ float to_f(float x) { return x; }
template <class T> static __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ bf16 from_f<bf16>(float x) { return f2bf(x); }
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }

// T itself, in a form template argument deduction skips: a parameter spelled `mt_same<T> *`
// accepts nullptr while T is deduced from the other arguments.
template <class T> struct mt_same_s { typedef T type; };
template <class T> using mt_same = typename mt_same_s<T>::type;

// The cuBLASLt / CUDA type of T.
template <class T> static inline cudaDataType_t mt_cuda_type();
template <> inline cudaDataType_t mt_cuda_type<bf16>() { return CUDA_R_16BF; }
template <> inline cudaDataType_t mt_cuda_type<float>() { return CUDA_R_32F; }

// out (n) T = in (n) fp32: the bf16 rounding (as mt_cuda_f32_to_bf16) or a copy.
template <class T> void mt_cuda_from_f32(const float *in, T *out, int64_t n, cudaStream_t stream);

// ---- the per-thread context ----

struct mt_gemm_cache; // linear.cu: cuBLASLt descriptors and algorithms per GEMM shape

// One per host thread (StarPU runs each CUDA worker on its own thread), bound to the device that
// was current when its device resources were created (mt_cuda_ctx_get). Buffers are allocated
// once, there, never by a launcher; they are shared by every call of the thread, so those calls
// must be ordered (one stream per thread).
struct mt_cuda_ctx {
    mt_cuda_options options;   // mt_cuda_ctx_configure; zero (every default) until then
    bool cudnn_fallback_said[2]; // the cuDNN attention's failure was reported: [0] forward, [1] backward
    bool ready;                // the device resources below exist
    int device;
    cublasLtHandle_t lt;
    cublasHandle_t blas;  // cuBLAS: the per-expert GEMMs of moe.cu, whose row counts change every call
    void *gemm_workspace; // MT_CUDA_GEMM_WORKSPACE bytes for cuBLASLt (split-K and friends)
    size_t gemm_workspace_bytes;
    double *reduce_partials; // MT_CUDA_REDUCE_BLOCKS doubles: stage 1 of mt_cuda_sumsq_f32
    // MT_MAX_EXPERTS + 1 int32 of pinned host memory mapped into the device: the MoE block's group
    // offsets, written there by a kernel (moe.cu, offsets_to_host) rather than by a copy, which
    // would queue on a copy engine behind the step's transfers of whole layers.
    int32_t *host_offsets;
    mt_gemm_cache *gemm_cache; // created by linear.cu on first GEMM
};

#define MT_CUDA_GEMM_WORKSPACE ((size_t)32 << 20)
#define MT_CUDA_REDUCE_BLOCKS 1024

// out[0] (device double, =) = the sum of partials[0, nparts) in a fixed order, bitwise repeatable:
// the second stage of the two-stage reductions into reduce_partials (context.cu).
void mt_cuda_sum_partials(const double *partials, int nparts, double *out, cudaStream_t stream);

// ---- scratch carving: one bump allocator serves both sizing (base NULL) and carving ----

#define MT_CUDA_SCRATCH_ALIGN 256 // bytes: what cuBLASLt's default alignment preference assumes

struct mt_carve {
    char *base;    // NULL while only sizing
    size_t offset; // bytes used so far
};

template <class T> static inline T *mt_take(mt_carve *c, int64_t count)
{
    c->offset = (c->offset + MT_CUDA_SCRATCH_ALIGN - 1) / MT_CUDA_SCRATCH_ALIGN * MT_CUDA_SCRATCH_ALIGN;
    T *p = c->base ? reinterpret_cast<T *>(c->base + c->offset) : nullptr;
    c->offset += (size_t)(count > 0 ? count : 0) * sizeof(T);
    return p;
}

static inline size_t mt_carve_size(const mt_carve *c)
{
    return (c->offset + MT_CUDA_SCRATCH_ALIGN - 1) / MT_CUDA_SCRATCH_ALIGN * MT_CUDA_SCRATCH_ALIGN;
}

// Blocks for a grid-stride loop over n elements: enough to fill the GPU, bounded so the grid is a
// pure function of n (determinism never depends on it here, but timing stays predictable).
static inline unsigned mt_grid_for(int64_t n, int threads)
{
    int64_t blocks = (n + threads - 1) / threads;
    if (blocks < 1) blocks = 1;
    if (blocks > 8192) blocks = 8192;
    return (unsigned)blocks;
}

// ---- deterministic reductions: fixed shuffle pattern, fixed shared-memory order ----

template <class T> static __device__ __forceinline__ T mt_warp_sum(T v)
{
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

template <class T> static __device__ __forceinline__ T mt_warp_max(T v)
{
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `shared` holds 32 T. The order depends only on blockDim, so repeated runs agree bitwise.
template <class T> static __device__ T mt_block_sum(T v, T *shared)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = mt_warp_sum(v);
    __syncthreads(); // shared may still be read by a previous call
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    T r = lane < nwarps ? shared[lane] : T(0);
    return mt_warp_sum(r);
}

// Max over the block, same contract as mt_block_sum.
template <class T> static __device__ T mt_block_max(T v, T *shared)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = mt_warp_max(v);
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    T r = lane < nwarps ? shared[lane] : shared[0];
    return mt_warp_max(r);
}

#endif
