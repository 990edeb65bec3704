/* The tokenizer suites' shared helpers (tests/tokenizer_util.h). */
#include "tests/tokenizer_util.h"

#include <check.h>

int32_t *encode(mt_tokenizer *tok, const char *text, size_t len, size_t *count)
{
    char err[1024] = "";
    int32_t *ids = mt_tokenizer_encode(tok, text, len, count, err, sizeof err);
    ck_assert_msg(ids != NULL, "%s", err);
    return ids;
}

int32_t *encode_offsets(mt_tokenizer *tok, const char *text, size_t len, size_t *count, size_t **starts)
{
    char err[1024] = "";
    int32_t *ids = mt_tokenizer_encode_offsets(tok, text, len, count, starts, err, sizeof err);
    ck_assert_msg(ids != NULL, "%s", err);
    return ids;
}
