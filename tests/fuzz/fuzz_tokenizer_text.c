/* libFuzzer harness: encoding arbitrary long texts (models/tokenizer/encode.c, bpe.c) with the
 * committed tokenizers: Qwen3's (byte-level, NFC, 151,669 ids) and the two SentencePiece-style
 * ones of tests/fixtures/tokenizers. The first byte picks the tokenizer, the rest is the text;
 * tokenizer_check.h's invariants must hold. The tokenizers load once (Qwen3's takes a second). */
#include <stdio.h>
#include <stdlib.h>

#include "models/tokenizer.h"
#include "tests/fuzz/fuzz.h"
#include "tests/fuzz/tokenizer_check.h"

static const char *const fixtures[] = {
    "tests/fixtures/tokenizers/qwen3/tokenizer.json",
    "tests/fixtures/tokenizers/spm/tokenizer.json",
    "tests/fixtures/tokenizers/spm-metaspace/tokenizer.json",
};
enum { NTOK = sizeof fixtures / sizeof fixtures[0] };
static mt_tokenizer *toks[NTOK];
static char paths[NTOK][8192];

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    for (int i = 0; i < NTOK; i++) {
        char err[2048];
        snprintf(paths[i], sizeof paths[i], "%s", fuzz_source(fixtures[i]));
        toks[i] = mt_tokenizer_load(paths[i], err, sizeof err);
        if (!toks[i]) {
            fprintf(stderr, "fuzz_tokenizer_text: %s\n", err);
            exit(1);
        }
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0) return 0;
    int t = data[0] % NTOK;
    fuzz_check_encoding(toks[t], paths[t], (const char *)data + 1, size - 1);
    return 0;
}
