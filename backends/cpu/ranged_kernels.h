/* Inside the ranged passes (ranged.c, ranged_simd.c): the float constants of a pass and its
 * loops by kind of bounds. Not for other callers: ranged.h is the interface. */
#ifndef MT_BACKENDS_CPU_RANGED_KERNELS_H
#define MT_BACKENDS_CPU_RANGED_KERNELS_H

#include <stdint.h>

#include "backends/cpu/ops.h"
#include "models/dtype.h"

/* The float values the kernel computes with (adamw.inc, adamw_consts_of), and the range [cl, ch]
 * of gradient multipliers. */
typedef struct mt_ranged_consts {
    float b1, one_b1, b2, one_b2, step_size, sqrt_bc2, eps, decay, cl, ch;
} mt_ranged_consts;

mt_ranged_consts mt_ranged_consts_of(const mt_adamw_params *p);

/* The exact bounds over n < 16 elements, the weights rounded to bf16 and the flags as bytes (bit
 * j of byte j / 8 for element j): the tail of the vector loops. */
void mt_cpu_ranged_exact_tail(int64_t n, const float *master, const float *grad, const float *m, const float *v,
                              const mt_ranged_consts *k, mt_bf16 *w, uint8_t *flagb);

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MT_RANGED_VECTOR 1
/* The vector loops (ranged_simd.c), on a block whose first element is on a byte of the bitmap:
 * bf16 weights into w, flags as bytes into flagb (bit j of byte k for element 8k + j). pass: the
 * ranged pass alone; deferred: the last step's moments half first (po its parameters, o their
 * float constants with po's scale as ch), then the pass on the new values. Callers check the CPU
 * (ranged.c, mt_ranged_bounds_used). */
void mt_cpu_ranged_pass_avx2(int64_t n, const float *master, const float *grad, const float *m, const float *v,
                             const mt_ranged_consts *k, mt_bf16 *w, uint8_t *flagb);
void mt_cpu_ranged_deferred_avx2(int64_t n, float *master, const float *old, const float *grad, float *m, float *v,
                                 const mt_ranged_consts *o, const mt_adamw_params *po, const mt_ranged_consts *k,
                                 mt_bf16 *w, uint8_t *flagb);
void mt_cpu_ranged_pass_avx512(int64_t n, const float *master, const float *grad, const float *m, const float *v,
                               const mt_ranged_consts *k, mt_bf16 *w, uint8_t *flagb);
void mt_cpu_ranged_deferred_avx512(int64_t n, float *master, const float *old, const float *grad, float *m, float *v,
                                   const mt_ranged_consts *o, const mt_adamw_params *po, const mt_ranged_consts *k,
                                   mt_bf16 *w, uint8_t *flagb);
#endif

#endif
