/* MXFP4 decoding (models/mxfp4.h). */
#include "models/mxfp4.h"

#include <math.h>

float mt_mxfp4_value(unsigned code)
{
    static const float e2m1[8] = { 0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f };
    const float v = e2m1[code & 7u];
    return code & 8u ? -v : v;
}

void mt_mxfp4_decode(int64_t rows, int64_t groups, const uint8_t *blocks, const uint8_t *scales, float *out)
{
    for (int64_t g = 0; g < rows * groups; g++) {
        /* torch.ldexp's scaling: exact, as each code has at most two significant bits */
        const int exp = (int)scales[g] - 127;
        const uint8_t *b = blocks + g * (MT_MXFP4_GROUP / 2);
        float *o = out + g * MT_MXFP4_GROUP;
        for (int i = 0; i < MT_MXFP4_GROUP / 2; i++) {
            o[2 * i] = ldexpf(mt_mxfp4_value(b[i] & 0xfu), exp);
            o[2 * i + 1] = ldexpf(mt_mxfp4_value(b[i] >> 4), exp);
        }
    }
}
