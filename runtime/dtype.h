/* Element types of the streamed weights and activations. */
#ifndef MT_RUNTIME_DTYPE_H
#define MT_RUNTIME_DTYPE_H

#include <stddef.h>

typedef enum mt_dtype {
    MT_DTYPE_F32,   /* 4 bytes: the exact path, on CPU workers and (slower) on the GPU */
    MT_DTYPE_BF16,  /* 2 bytes: the GPU's fast path (tensor cores) */
} mt_dtype;

size_t mt_dtype_size(mt_dtype t);
const char *mt_dtype_name(mt_dtype t);
/* "fp32"/"f32"/"float32" or "bf16"/"bfloat16"; returns -1 if unknown. */
int mt_dtype_parse(const char *s, mt_dtype *out);

#endif
