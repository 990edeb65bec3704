/* Element types: sizes, names, parsing. */
#include "dtype.h"

#include <string.h>

size_t mt_dtype_size(mt_dtype t) { return t == MT_DTYPE_BF16 ? 2 : 4; }
const char *mt_dtype_name(mt_dtype t) { return t == MT_DTYPE_BF16 ? "bf16" : "fp32"; }

int mt_dtype_parse(const char *s, mt_dtype *out)
{
    if (!strcmp(s, "fp32") || !strcmp(s, "f32") || !strcmp(s, "float32")) *out = MT_DTYPE_F32;
    else if (!strcmp(s, "bf16") || !strcmp(s, "bfloat16")) *out = MT_DTYPE_BF16;
    else return -1;
    return 0;
}
