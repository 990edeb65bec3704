/* The CPU kernels instantiated for double: the finite-difference twin the tests use. */
#define MT_REAL double
#define MT_SFX(name) name##_f64
#define MT_GEMM cblas_dgemm
#define MT_GEMV cblas_dgemv
#include "backends/cpu/kernels.inc"
