/* Element types of the streamed weights and activations, and bfloat16's bit format: the one
 * fp32 <-> bf16 rounding every part of the project uses (checkpoint files, the optimizer's
 * streamed copy, the kernels' references). */
#ifndef MT_MODELS_DTYPE_H
#define MT_MODELS_DTYPE_H

#include <stddef.h>
#include <stdint.h>

typedef enum mt_dtype {
    MT_DTYPE_F32,   /* 4 bytes: the exact path, on CPU workers and (slower) on the GPU */
    MT_DTYPE_BF16,  /* 2 bytes: the GPU's fast path (tensor cores) */
} mt_dtype;

size_t mt_dtype_size(mt_dtype t);
const char *mt_dtype_name(mt_dtype t);
/* "fp32"/"f32"/"float32" or "bf16"/"bfloat16"; returns -1 if unknown. */
int mt_dtype_parse(const char *s, mt_dtype *out);

/* The memory-bound loops AdamW runs on every parameter every step (the update, its halves, the
 * bf16 conversion), built twice on x86-64 with GCC: for AVX2 and for the baseline, picked at
 * load time. The results are bitwise the same: the operations are IEEE ones in the same order,
 * and ISO C11 mode keeps GCC from contracting them into FMAs. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define MT_CPU_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef MT_CPU_CLONES
#define MT_CPU_CLONES
#endif

typedef uint16_t mt_bf16; /* bfloat16 bit pattern */

/* fp32 <-> bf16, round to nearest even; NaN stays NaN. */
mt_bf16 mt_bf16_from_float(float x);
float mt_float_from_bf16(mt_bf16 x);
void mt_f32_to_bf16(int64_t n, const float *in, mt_bf16 *out);
void mt_bf16_to_f32(int64_t n, const mt_bf16 *in, float *out);

#endif
