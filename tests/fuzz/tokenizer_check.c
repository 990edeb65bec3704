/* Shared checks of the tokenizer harnesses (tokenizer_check.h). */
#include "tests/fuzz/tokenizer_check.h"

#include <stdlib.h>
#include <string.h>

#include "tests/fuzz/fuzz.h"

void fuzz_check_encoding(mt_tokenizer *tok, const char *path, const char *text, size_t len)
{
    char err[2048] = "";
    size_t n;
    int32_t *ids = mt_tokenizer_encode(tok, text, len, &n, err, sizeof err);
    if (!ids) {
        FUZZ_CHECK(strstr(err, path) != NULL, "encode failed without naming the file: '%s'", err);
        return;
    }
    int32_t vocab = mt_tokenizer_vocab_size(tok);
    for (size_t i = 0; i < n; i++) FUZZ_CHECK(ids[i] >= 0 && ids[i] < vocab, "id %d of %d", ids[i], vocab);
    size_t dlen, nlen;
    char *back = mt_tokenizer_decode(tok, ids, n, &dlen, err, sizeof err);
    FUZZ_CHECK(back != NULL, "decode of encode's ids: %s", err);
    char *norm = mt_tokenizer_normalize(tok, text, len, &nlen);
    FUZZ_CHECK(norm != NULL, "normalize failed");
    FUZZ_CHECK(dlen == nlen && memcmp(back, norm, dlen) == 0, "decode(encode(x)) (%zu bytes) != normalize(x) (%zu bytes)",
               dlen, nlen);
    free(back);
    free(norm);

    size_t m, *starts;
    int32_t *again = mt_tokenizer_encode_offsets(tok, text, len, &m, &starts, err, sizeof err);
    FUZZ_CHECK(again != NULL, "encode_offsets failed where encode did not: %s", err);
    FUZZ_CHECK(m == n && memcmp(again, ids, n * sizeof *ids) == 0, "encode_offsets gives other ids");
    for (size_t i = 0; i < m; i++) {
        FUZZ_CHECK(starts[i] < len, "token %zu of %zu starts at %zu of %zu bytes", i, m, starts[i], len);
        FUZZ_CHECK(i == 0 || starts[i] >= starts[i - 1], "token %zu starts at %zu, before %zu", i, starts[i],
                   starts[i - 1]);
    }
    free(starts);
    free(again);
    free(ids);
}
