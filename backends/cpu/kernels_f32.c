/* The CPU kernels instantiated for float: what the runtime executes. */
#define MT_REAL float
#define MT_SFX(name) name##_f32
#define MT_GEMM cblas_sgemm
#define MT_GEMV cblas_sgemv
#include "backends/cpu/kernels.inc"
