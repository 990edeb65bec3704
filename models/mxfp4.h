/* MXFP4, the OCP microscaling format gpt-oss checkpoints publish their experts' matrices in:
 * blocks of 32 consecutive elements of a row share one scale, an E8M0 byte (2^(byte - 127));
 * each element is a 4-bit E2M1 code, two to a byte, the low nibble the even element. A row of C
 * elements is C/32 scale bytes and C/2 block bytes. transformers' convert_moe_packed_tensors
 * decodes the same way; every value decoded is exact in fp32 (and in bf16). */
#ifndef MT_MODELS_MXFP4_H
#define MT_MODELS_MXFP4_H

#include <stdint.h>

/* Elements per scale, and per block byte. */
#define MT_MXFP4_GROUP 32

/* The E2M1 value of a 4-bit code: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}, bit 3 the sign. */
float mt_mxfp4_value(unsigned code);

/* out (rows, groups * 32) = the decoded rows of blocks (rows, groups, 16) and scales (rows,
 * groups). */
void mt_mxfp4_decode(int64_t rows, int64_t groups, const uint8_t *blocks, const uint8_t *scales, float *out);

#endif
