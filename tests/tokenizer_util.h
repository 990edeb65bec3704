/* Shared by the tokenizer suites (test_tokenizer.c, test_tokenizer_small.c). */
#ifndef MT_TESTS_TOKENIZER_UTIL_H
#define MT_TESTS_TOKENIZER_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "models/tokenizer.h"

/* mt_tokenizer_encode and _offsets, which must succeed: the ids of text (len bytes), *count of
 * them (and each token's start in *starts); the caller frees them. */
int32_t *encode(mt_tokenizer *tok, const char *text, size_t len, size_t *count);
int32_t *encode_offsets(mt_tokenizer *tok, const char *text, size_t len, size_t *count, size_t **starts);

#endif
