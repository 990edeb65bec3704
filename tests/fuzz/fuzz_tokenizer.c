/* libFuzzer harness: tokenizer.json loading (models/tokenizer/load.c, pipeline.c) and encoding
 * with what was loaded. The input is the file, then optionally a NUL byte and a text (a raw NUL
 * cannot occur in JSON text); without one the input encodes itself. A file the loader refuses
 * must be named in the message; one it accepts must keep tokenizer_check.h's invariants on the
 * text. Long texts (the JIT-stack case of a Split regex needs more than a kilobyte) come from
 * -max_len. */
#include <stdio.h>
#include <string.h>

#include "models/tokenizer.h"
#include "tests/fuzz/fuzz.h"
#include "tests/fuzz/tokenizer_check.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *nul = memchr(data, 0, size);
    size_t json_len = nul ? (size_t)(nul - data) : size;
    char path[8192];
    snprintf(path, sizeof path, "%s", fuzz_write("tokenizer.json", data, json_len));
    char err[2048];
    mt_tokenizer *tok = mt_tokenizer_load(path, err, sizeof err);
    if (!tok) {
        FUZZ_CHECK(strstr(err, path) != NULL, "message without the path: %s", err);
        return 0;
    }
    const char *text = nul ? (const char *)nul + 1 : (const char *)data;
    size_t len = nul ? size - json_len - 1 : size;
    fuzz_check_encoding(tok, path, text, len);
    mt_tokenizer_token_id(tok, "<|endoftext|>");
    mt_tokenizer_free(tok);
    return 0;
}
