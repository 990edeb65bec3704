/* BPE tokenizer on small tokenizer.json files written here: GPT-2's byte-level 256 tokens with a
 * few merges, and a SentencePiece-style vocabulary of <0xXX> tokens; what they encode, every class
 * of bad file (whose message names the file and the key), PCRE2's limits on a pre-tokenizer's
 * regex, and ids far beyond the file's token count. */
#include <check.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "models/tokenizer.h"
#include "models/util.h"
#include "tests/testutil.h"
#include "tests/tokenizer_util.h"

/* GPT-2's stand-in for byte b, UTF-8 encoded into out (NUL-terminated). */
static void byte_char(int b, char out[3])
{
    int extra = 0, cp = -1;
    for (int x = 0; x < 256; x++) {
        bool printable = (x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE && x <= 0xFF);
        int c = printable ? x : 256 + extra++;
        if (x == b) cp = c;
    }
    if (cp < 0x80) {
        out[0] = (char)cp;
        out[1] = 0;
    } else {
        out[0] = (char)(0xC0 | cp >> 6);
        out[1] = (char)(0x80 | (cp & 0x3F));
        out[2] = 0;
    }
}

/* A small tokenizer.json: the 256 byte tokens, then "ab" (256), "abc" (257), and the given merges
 * and extra top-level fields; `model_extra` goes inside "model". */
static char *small_tokenizer(const char *merges, const char *model_extra, const char *extra)
{
    size_t cap = 65536, n = 0;
    char *s = malloc(cap);
    n += (size_t)snprintf(s + n, cap - n, "{\"model\": {\"type\": \"BPE\", %s \"vocab\": {", model_extra);
    for (int b = 0; b < 256; b++) {
        char c[3];
        byte_char(b, c);
        bool esc = c[0] == '"' || c[0] == '\\';
        n += (size_t)snprintf(s + n, cap - n, "\"%s%s\": %d, ", esc ? "\\" : "", c, b);
    }
    n += (size_t)snprintf(s + n, cap - n, "\"ab\": 256, \"abc\": 257}, \"merges\": %s}, "
                          "\"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false}%s}",
                          merges, extra);
    return s;
}

static mt_tokenizer *load_small(const char *json, char *path, char *err, size_t errlen)
{
    snprintf(path, 4096, "%s", mt_test_write_temp("tokenizer.json", json));
    return mt_tokenizer_load(path, err, errlen);
}

START_TEST(test_small_tokenizer)
{
    char path[4096], err[512] = "";
    /* Both merge spellings give the same tokenizer. */
    static const char *const forms[] = {"[\"a b\", \"ab c\"]", "[[\"a\", \"b\"], [\"ab\", \"c\"]]"};
    for (int f = 0; f < 2; f++) {
        char *json = small_tokenizer(forms[f], "", ", \"added_tokens\": [{\"id\": 300, \"content\": \"<x>\"},"
                                     " {\"id\": 301, \"content\": \"<xy>\", \"special\": true}]");
        mt_tokenizer *tok = load_small(json, path, err, sizeof err);
        free(json);
        ck_assert_msg(tok != NULL, "%s", err);
        size_t n;
        int32_t *ids = encode(tok, "abcab<xy><x>a b", 15, &n);
        /* Added tokens split first (longest "<xy>" wins over "<x>"); "abcab" merges a+b twice,
         * then ab+c; " b" has no merge. Byte b's token has id b in this vocabulary. */
        int32_t want[] = {257, 256, 301, 300, 'a', ' ', 'b'};
        ck_assert_uint_eq(n, 7);
        for (size_t i = 0; i < n; i++) ck_assert_int_eq(ids[i], want[i]);
        free(ids);
        ck_assert_int_eq(mt_tokenizer_vocab_size(tok), 302);
        ck_assert_int_eq(mt_tokenizer_token_id(tok, "abc"), 257);
        ck_assert_int_eq(mt_tokenizer_token_id(tok, "<xy>"), 301);
        ck_assert_int_eq(mt_tokenizer_token_id(tok, "zz"), -1);
        int32_t bad[] = {1, 299};
        size_t len;
        ck_assert_ptr_null(mt_tokenizer_decode(tok, bad, 2, &len, err, sizeof err));
        ck_assert_msg(strstr(err, "token 1") && strstr(err, "299"), "%s", err);
        mt_tokenizer_free(tok);
    }
}
END_TEST

/* Loading text must fail with a message holding every string in want. */
static void assert_load_fails(const char *json, const char *want1, const char *want2)
{
    char path[4096], err[512] = "";
    mt_tokenizer *tok = load_small(json, path, err, sizeof err);
    ck_assert_msg(tok == NULL, "loaded a bad file: %s", json);
    ck_assert_msg(strstr(err, path) != NULL, "message lacks the path: %s", err);
    ck_assert_msg(strstr(err, want1) != NULL, "message lacks '%s': %s", want1, err);
    if (want2) ck_assert_msg(strstr(err, want2) != NULL, "message lacks '%s': %s", want2, err);
}

START_TEST(test_errors)
{
    char err[512] = "";
    const char *missing = "/nonexistent/dir/tokenizer.json";
    ck_assert_ptr_null(mt_tokenizer_load(missing, err, sizeof err));
    ck_assert_msg(strstr(err, missing) != NULL, "%s", err);

    assert_load_fails("{\"model\": {\"vocab\": {", "line", NULL);
    assert_load_fails("[1, 2]", "object", NULL);
    assert_load_fails("{\"model\": {\"type\": \"BPE\", \"merges\": []}}", "model.vocab", "missing");
    assert_load_fails("{\"pre_tokenizer\": null}", "'model'", NULL);
    assert_load_fails("{\"model\": {\"type\": \"Unigram\", \"vocab\": {}}}", "model.type", "Unigram");
    assert_load_fails("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}}}", "model.merges", NULL);
    assert_load_fails("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": \"zero\"}, \"merges\": []}}", "model.vocab",
                      "'a'");
    assert_load_fails("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}}", "model.vocab",
                      "byte 0x00");
    assert_load_fails("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"\\u4f60\": 0}, \"merges\": []}}", "model.vocab",
                      "U+4F60");

    char *json = small_tokenizer("[\"a q\", \"x\"]", "", "");
    assert_load_fails(json, "model.merges[0]", NULL); /* "a q" merges to "aq", not in the vocabulary */
    free(json);
    json = small_tokenizer("[\"a b\", \"ab\"]", "", "");
    assert_load_fails(json, "model.merges[1]", "one space");
    free(json);
    json = small_tokenizer("[\"a b\", 7]", "", "");
    assert_load_fails(json, "model.merges[1]", "an integer");
    free(json);
    json = small_tokenizer("[]", "\"byte_fallback\": true,", "");
    assert_load_fails(json, "model.vocab", "<0x00>"); /* SentencePiece-style needs the 256 <0xXX> tokens */
    free(json);
    json = small_tokenizer("[]", "", ", \"normalizer\": {\"type\": \"Lowercase\"}");
    assert_load_fails(json, "normalizer.type", "Lowercase");
    free(json);
    json = small_tokenizer("[]", "", ", \"added_tokens\": [{\"id\": 5, \"content\": \"<s>\", \"lstrip\": true}]");
    assert_load_fails(json, "added_tokens[0]", "lstrip");
    free(json);
    json = small_tokenizer("[]", "", ", \"added_tokens\": [{\"id\": -5, \"content\": \"<s>\"}]");
    assert_load_fails(json, "added_tokens[0].id", NULL);
    free(json);
    /* One id, two tokens (found by tests/fuzz: encode gave "<a>" the id that decodes as "<b>"). */
    json = small_tokenizer("[]", "", ", \"added_tokens\": [{\"id\": 300, \"content\": \"<a>\"}, "
                           "{\"id\": 300, \"content\": \"<b>\"}]");
    assert_load_fails(json, "added_tokens[1]", "id 300 is already");
    free(json);
    json = small_tokenizer("[]", "", ", \"added_tokens\": [{\"id\": 256, \"content\": \"<a>\"}]");
    assert_load_fails(json, "added_tokens[0]", "id 256 is already"); /* "ab" in model.vocab */
    free(json);
    json = small_tokenizer("[]", "", ", \"added_tokens\": [{\"id\": 256, \"content\": \"ab\"}]");
    char path[4096];
    mt_tokenizer *same = load_small(json, path, err, sizeof err); /* repeating a vocabulary entry is fine */
    ck_assert_msg(same != NULL, "%s", err);
    mt_tokenizer_free(same);
    free(json);

    /* pre_tokenizer problems: the last key wins, so these override small_tokenizer's ByteLevel. */
    json = small_tokenizer("[]", "", ", \"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": "
                           "[{\"type\": \"Split\", \"pattern\": {\"Regex\": \"(\"}, \"behavior\": \"Isolated\"},"
                           " {\"type\": \"ByteLevel\", \"use_regex\": false}]}");
    assert_load_fails(json, "pre_tokenizer.pretokenizers[0].pattern.Regex", "PCRE2");
    free(json);
    json = small_tokenizer("[]", "", ", \"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": "
                           "[{\"type\": \"Split\", \"pattern\": {\"Regex\": \"a\"}, \"behavior\": \"Removed\"},"
                           " {\"type\": \"ByteLevel\", \"use_regex\": false}]}");
    assert_load_fails(json, "pre_tokenizer.pretokenizers[0].behavior", NULL);
    free(json);
    json = small_tokenizer("[]", "", ", \"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": "
                           "[{\"type\": \"Split\", \"pattern\": {\"Regex\": \"a\"}, \"behavior\": \"Isolated\"}]}");
    assert_load_fails(json, "pre_tokenizer.pretokenizers", "ByteLevel");
    free(json);
    json = small_tokenizer("[]", "", ", \"pre_tokenizer\": {\"type\": \"Whitespace\"}");
    assert_load_fails(json, "pre_tokenizer.type", "Whitespace");
    free(json);
    json = small_tokenizer("[]", "", ", \"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": true}");
    assert_load_fails(json, "add_prefix_space", NULL);
    free(json);
}
END_TEST

/* A pre_tokenizer of one Split(regex, Isolated) and a ByteLevel without its own regex, to follow
 * small_tokenizer's (the last key wins). */
static char *split_pre_tokenizer(const char *regex)
{
    char *s = malloc(1024);
    snprintf(s, 1024, ", \"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", "
             "\"pattern\": {\"Regex\": \"%s\"}, \"behavior\": \"Isolated\"}, {\"type\": \"ByteLevel\", \"use_regex\": "
             "false}]}", regex);
    return s;
}

/* small_tokenizer with one Split(regex) and the given merges; the test fails if it does not load. */
static mt_tokenizer *load_split(const char *regex, const char *merges, char *path)
{
    char err[1024] = "";
    char *pre = split_pre_tokenizer(regex);
    char *json = small_tokenizer(merges, "", pre);
    mt_tokenizer *tok = load_small(json, path, err, sizeof err);
    free(json);
    free(pre);
    ck_assert_msg(tok != NULL, "%s", err);
    return tok;
}

/* n bytes of "abcxyz " repeated (no newline, so "(.)*" matches all of it), malloc'd. */
static char *repeated_text(size_t n)
{
    char *text = malloc(n);
    for (size_t i = 0; i < n; i++) text[i] = "abcxyz "[i % 7];
    return text;
}

/* PCRE2's limits: "(.)*" exhausts PCRE2's default 32 KiB JIT stack after about 1,365 characters,
 * which aborted the process; the tokenizer's larger stack encodes far more. A regex that
 * backtracks catastrophically fails with a message naming the file, the regex's key and the
 * limit, and encode returns NULL. */
START_TEST(test_regex_limits)
{
    char path[4096], err[1024] = "";
    mt_tokenizer *tok = load_split("(.)*", "[\"a b\", \"ab c\"]", path);
    enum { LONG = 100000 };
    char *text = repeated_text(LONG);
    size_t n, len, *starts;
    int32_t *ids = mt_tokenizer_encode_offsets(tok, text, LONG, &n, &starts, err, sizeof err);
    ck_assert_msg(ids != NULL, "%s", err);
    char *back = mt_tokenizer_decode(tok, ids, n, &len, err, sizeof err);
    ck_assert_uint_eq(len, LONG);
    ck_assert_int_eq(memcmp(back, text, LONG), 0);
    for (size_t i = 0; i < n; i++) ck_assert_uint_lt(starts[i], LONG);
    free(back);
    free(ids);
    free(starts);
    free(text);
    mt_tokenizer_free(tok);

    tok = load_split("(a*)*[bc]", "[]", path);
    const char *as = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    err[0] = 0;
    ck_assert_ptr_null(mt_tokenizer_encode(tok, as, strlen(as), &n, err, sizeof err));
    ck_assert_msg(strstr(err, path) && strstr(err, "pre_tokenizer.pretokenizers[0].pattern.Regex") &&
                  strstr(err, "match limit"), "%s", err);
    starts = (size_t *)1;
    ck_assert_ptr_null(mt_tokenizer_encode_offsets(tok, as, strlen(as), &n, &starts, err, sizeof err));
    ck_assert_ptr_null(starts);
    mt_tokenizer_free(tok);
}
END_TEST

/* By hand (MT_TEST_LONG=1, some seconds): a match past the 64 MiB JIT stack runs in the
 * interpreter and gives the same ids as the JIT would. */
START_TEST(test_regex_interpreter_fallback)
{
    char path[4096], err[1024] = "";
    mt_tokenizer *tok = load_split("(.)*", "[\"a b\", \"ab c\"]", path);
    enum { HUGE = 3000000 };
    char *text = repeated_text(HUGE);
    size_t n, len;
    int32_t *ids = mt_tokenizer_encode(tok, text, HUGE, &n, err, sizeof err);
    ck_assert_msg(ids != NULL, "%s", err);
    char *back = mt_tokenizer_decode(tok, ids, n, &len, err, sizeof err);
    ck_assert_uint_eq(len, HUGE);
    ck_assert_int_eq(memcmp(back, text, HUGE), 0);
    free(back);
    free(ids);
    free(text);
    mt_tokenizer_free(tok);
}
END_TEST

/* Ids far beyond the number of tokens a file defines are refused, naming the id and the file,
 * before the id table is allocated (one added token with id 2^31 - 2 took 16 GiB); holes up to
 * the bound load. */
START_TEST(test_sparse_ids)
{
    char path[4096], err[512] = "";
    char *json = small_tokenizer("[]", "", ", \"added_tokens\": [{\"id\": 2147483646, \"content\": \"<big>\"}]");
    double t0 = mt_clock_s();
    mt_tokenizer *tok = load_small(json, path, err, sizeof err);
    free(json);
    ck_assert_ptr_null(tok);
    ck_assert_msg(strstr(err, path) && strstr(err, "added_tokens[0].id") && strstr(err, "2147483646") &&
                  strstr(err, "259 tokens"), "%s", err);
    ck_assert_msg(mt_clock_s() - t0 < 1.0, "refusing took %.1f s", mt_clock_s() - t0);
    json = small_tokenizer("[]", "", ", \"added_tokens\": [{\"id\": 1542, \"content\": \"<x>\"}]");
    assert_load_fails(json, "added_tokens[0].id", "below 1542");
    free(json);
    /* the same in model.vocab: byte tokens 0-255, "ab" 256 and "abc" moved far out */
    json = small_tokenizer("[]", "", "");
    char *abc = strstr(json, "\"abc\": 257");
    ck_assert_ptr_nonnull(abc);
    char *moved = malloc(strlen(json) + 16);
    snprintf(moved, strlen(json) + 16, "%.*s\"abc\": 100000%s", (int)(abc - json), json, abc + strlen("\"abc\": 257"));
    assert_load_fails(moved, "model.vocab", "100000");
    free(moved);
    free(json);
    /* within the bound: a hole of ids 258..1540 */
    json = small_tokenizer("[]", "", ", \"added_tokens\": [{\"id\": 1541, \"content\": \"<x>\"}]");
    tok = load_small(json, path, err, sizeof err);
    free(json);
    ck_assert_msg(tok != NULL, "%s", err);
    ck_assert_int_eq(mt_tokenizer_vocab_size(tok), 1542);
    size_t n;
    int32_t *ids = encode(tok, "a<x>", 4, &n);
    ck_assert_uint_eq(n, 2);
    ck_assert_int_eq(ids[1], 1541);
    free(ids);
    mt_tokenizer_free(tok);
}
END_TEST

/* A small SentencePiece-style file: the 256 <0xXX> tokens (ids 0-255), "\u2581" 256, "a" 257, "b"
 * 258, "\u2581a" 259, "ab" 260; merges "\u2581 a" then "a b"; `top` ends the object (normalizer,
 * pre_tokenizer, decoder); `vocab_extra` goes into the vocabulary. */
static char *small_spm(const char *vocab_extra, const char *top)
{
    size_t cap = 65536, n = 0;
    char *s = malloc(cap);
    n += (size_t)snprintf(s + n, cap - n, "{\"model\": {\"type\": \"BPE\", \"byte_fallback\": true, \"vocab\": {");
    for (int b = 0; b < 256; b++) n += (size_t)snprintf(s + n, cap - n, "\"<0x%02X>\": %d, ", b, b);
    n += (size_t)snprintf(s + n, cap - n, "%s\"\\u2581\": 256, \"a\": 257, \"b\": 258, \"\\u2581a\": 259, \"ab\": 260}, "
                          "\"merges\": [\"\\u2581 a\", \"a b\"]}, %s}", vocab_extra, top);
    return s;
}

static const char SPM_NORM[] = "\"normalizer\": {\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"Prepend\", "
                               "\"prepend\": \"\\u2581\"}, {\"type\": \"Replace\", \"pattern\": {\"String\": \" \"}, "
                               "\"content\": \"\\u2581\"}]}";

START_TEST(test_spm_small)
{
    char path[4096], err[512] = "";
    char top[1024];
    snprintf(top, sizeof top, "%s, \"decoder\": {\"type\": \"Sequence\", \"decoders\": [{\"type\": \"Replace\", "
             "\"pattern\": {\"String\": \"\\u2581\"}, \"content\": \" \"}, {\"type\": \"ByteFallback\"}, {\"type\": "
             "\"Fuse\"}, {\"type\": \"Strip\", \"content\": \" \", \"start\": 1, \"stop\": 0}]}", SPM_NORM);
    char *json = small_spm("", top);
    mt_tokenizer *tok = load_small(json, path, err, sizeof err);
    free(json);
    ck_assert_msg(tok != NULL, "%s", err);
    /* "a b" is "\u2581a\u2581b": "\u2581 a" merges first; "a b" cannot apply after it. "ab" is
     * "\u2581ab": "\u2581 a" (rank 0) beats "a b" (rank 1). "c" has no token: its byte. */
    static const struct { const char *text; int32_t want[4]; size_t n; } cases[] = {
        {"a b", {259, 256, 258}, 3}, {"ab", {259, 258}, 2}, {"c", {256, 'c'}, 2}, {"", {0}, 0}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        size_t n, len;
        int32_t *ids = encode(tok, cases[c].text, strlen(cases[c].text), &n);
        ck_assert_uint_eq(n, cases[c].n);
        for (size_t i = 0; i < n; i++) ck_assert_int_eq(ids[i], cases[c].want[i]);
        char *back = mt_tokenizer_decode(tok, ids, n, &len, err, sizeof err);
        ck_assert_str_eq(back, cases[c].text);
        free(back);
        free(ids);
    }
    /* Where each token starts in the text: the prepended space where its section starts, a
     * "\u2581" of the text (3 bytes) where it stands. */
    static const struct { const char *text; size_t want[3]; } offs[] = {{"a b", {0, 1, 2}}, {"a\xE2\x96\x81" "b", {0, 1, 4}}};
    for (size_t c = 0; c < 2; c++) {
        size_t n, *starts;
        int32_t *ids = encode_offsets(tok, offs[c].text, strlen(offs[c].text), &n, &starts);
        ck_assert_uint_eq(n, 3);
        ck_assert_int_eq(ids[0], 259);
        for (size_t i = 0; i < n; i++) ck_assert_uint_eq(starts[i], offs[c].want[i]);
        free(ids);
        free(starts);
    }
    mt_tokenizer_free(tok);

    /* Bad files: each names the file and the key. */
    json = small_spm("", SPM_NORM);
    char *hole = strstr(json, "\"<0x41>\": 65, ");
    memmove(hole, hole + 14, strlen(hole + 14) + 1);
    assert_load_fails(json, "model.vocab", "<0x41>");
    free(json);
    json = small_spm("\"x y\": 300, ", SPM_NORM);
    assert_load_fails(json, "model.vocab", "holds a space");
    free(json);
    json = small_spm("", "\"normalizer\": {\"type\": \"Lowercase\"}");
    assert_load_fails(json, "normalizer", "step 0");
    free(json);
    json = small_spm("", "\"normalizer\": {\"type\": \"Prepend\", \"prepend\": \"\\u2581\"}");
    assert_load_fails(json, "normalizer", "never written");
    free(json);
    json = small_spm("", "\"pre_tokenizer\": {\"type\": \"Metaspace\", \"replacement\": \"\\u2581\", \"split\": true}");
    assert_load_fails(json, "pre_tokenizer.split", NULL);
    free(json);
    json = small_spm("", "\"pre_tokenizer\": {\"type\": \"Metaspace\", \"replacement\": \"\\u2581\", "
                     "\"prepend_scheme\": \"sometimes\"}");
    assert_load_fails(json, "pre_tokenizer.prepend_scheme", "sometimes");
    free(json);
    snprintf(top, sizeof top, "%s, \"decoder\": {\"type\": \"WordPiece\"}", SPM_NORM);
    json = small_spm("", top);
    assert_load_fails(json, "decoder", "WordPiece");
    free(json);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("tokenizer_small");
    TCase *tc = tcase_create("tokenizer_small");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_small_tokenizer);
    tcase_add_test(tc, test_spm_small);
    tcase_add_test(tc, test_errors);
    tcase_add_test(tc, test_regex_limits);
    if (getenv("MT_TEST_LONG")) tcase_add_test(tc, test_regex_interpreter_fallback);
    tcase_add_test(tc, test_sparse_ids);
    suite_add_tcase(s, tc);
    return mt_test_run(s, false);
}
