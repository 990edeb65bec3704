/* The invariants of models/tokenizer.h that both tokenizer harnesses check on every text: encode
 * succeeds or names the file; ids are in the vocabulary; decode(encode(x)) == normalize(x);
 * encode_offsets gives the same ids with starts that never decrease and stay below the length. */
#ifndef MT_TESTS_FUZZ_TOKENIZER_CHECK_H
#define MT_TESTS_FUZZ_TOKENIZER_CHECK_H

#include <stddef.h>

#include "models/tokenizer.h"

void fuzz_check_encoding(mt_tokenizer *tok, const char *path, const char *text, size_t len);

#endif
