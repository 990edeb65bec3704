/* libFuzzer harness: prepare's reading of chat JSONL (mt_prepare_read_chat: the alpaca and
 * sharegpt records, the chat templates of models/chat_template.c) and its loss masks
 * (mt_prepare_tokenize), without the shards. The first byte picks the format and the family, the
 * rest is the file. Each rendered conversation must have sorted, disjoint spans inside its text;
 * its tokens (Qwen3's tokenizer, or for mistral the SentencePiece-style fixture) get a mask of 0s
 * and 1s with at least one 1 where a span holds text. A refused file is named with its line. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/prepare.h"
#include "tests/fuzz/fuzz.h"

static mt_tokenizer *qwen3, *spm;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    char err[2048];
    qwen3 = mt_tokenizer_load(fuzz_source("tests/fixtures/tokenizers/qwen3/tokenizer.json"), err, sizeof err);
    if (qwen3) spm = mt_tokenizer_load(fuzz_source("tests/fixtures/tokenizers/spm/tokenizer.json"), err, sizeof err);
    if (!qwen3 || !spm) {
        fprintf(stderr, "fuzz_chat: %s\n", err);
        exit(1);
    }
    return 0;
}

typedef struct record_ctx { mt_tokenizer *tok; int64_t last_line; size_t len; } record_ctx;

static int check_record(void *arg, const mt_chat_rendered *r, int64_t line, size_t done, char *err, size_t errlen)
{
    (void)err;
    (void)errlen;
    record_ctx *c = arg;
    FUZZ_CHECK(line > c->last_line && done <= c->len, "line %lld after %lld, %zu of %zu bytes", (long long)line,
               (long long)c->last_line, done, c->len);
    c->last_line = line;
    FUZZ_CHECK(strlen(r->text) <= r->len && r->text[r->len] == 0, "text of %zu bytes not NUL-terminated", r->len);
    for (int s = 0; s < r->nspans; s++) {
        FUZZ_CHECK(r->spans[s].start <= r->spans[s].end && r->spans[s].end <= r->len, "span %d [%zu, %zu) of %zu", s,
                   r->spans[s].start, r->spans[s].end, r->len);
        FUZZ_CHECK(s == 0 || r->spans[s].start >= r->spans[s - 1].end, "span %d overlaps the one before", s);
    }
    int32_t *ids;
    uint8_t *mask;
    size_t n;
    char why[2048];
    FUZZ_CHECK(mt_prepare_tokenize(c->tok, r->text, r->len, r->spans, r->nspans, &ids, &mask, &n, why, sizeof why) == 0,
               "tokenize: %s", why);
    size_t trained = 0;
    for (size_t i = 0; i < n; i++) {
        FUZZ_CHECK(mask[i] <= 1, "mask %u", mask[i]);
        trained += mask[i];
    }
    size_t span_bytes = 0;
    for (int s = 0; s < r->nspans; s++) span_bytes += r->spans[s].end - r->spans[s].start;
    FUZZ_CHECK(span_bytes == 0 || trained > 0, "%zu bytes in spans, no token trained", span_bytes);
    free(ids);
    free(mask);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0) return 0;
    mt_input_format format = data[0] & 1 ? MT_INPUT_SHAREGPT : MT_INPUT_ALPACA;
    mt_chat_family family = (mt_chat_family)((data[0] >> 1) % 4);
    record_ctx c = { family == MT_CHAT_MISTRAL ? spm : qwen3, 0, size - 1 };
    char err[4096] = "";
    if (mt_prepare_read_chat(format, family, "chat.jsonl", (const char *)data + 1, size - 1, check_record, &c, err,
                             sizeof err))
        FUZZ_CHECK(strncmp(err, "chat.jsonl:", 11) == 0, "message without FILE:LINE: %s", err);
    return 0;
}
