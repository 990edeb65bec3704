/* Chat templates written out as code, one function per family, so that a reader sees the exact
 * bytes and the trained spans without a template engine. docs/data.md is their specification. */
#include "models/chat_template.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct buffer { char *data; size_t len, cap; } buffer;

/* Appends n bytes, growing the buffer; aborts on out-of-memory. */
static void put_n(buffer *b, const char *s, size_t n)
{
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1) cap *= 2;
        b->data = realloc(b->data, cap);
        if (!b->data) { fprintf(stderr, "megatrain: out of memory rendering a chat template\n"); abort(); }
        b->cap = cap;
    }
    memcpy(b->data + b->len, s, n);
    b->len += n;
    b->data[b->len] = 0;
}

static void put(buffer *b, const char *s) { put_n(b, s, strlen(s)); }

/* Records [start, b->len) as a trained span. */
static void add_span(mt_chat_rendered *r, size_t start, size_t end)
{
    r->spans = realloc(r->spans, sizeof *r->spans * (r->nspans + 1));
    if (!r->spans) abort();
    r->spans[r->nspans++] = (mt_chat_span){ start, end };
}

/* Jinja's `| trim`: strips leading and trailing ASCII whitespace. */
static void put_trimmed(buffer *b, const char *s)
{
    size_t n = strlen(s);
    while (n && isspace((unsigned char)*s)) { s++; n--; }
    while (n && isspace((unsigned char)s[n - 1])) n--;
    put_n(b, s, n);
}

int mt_chat_family_parse(const char *name, mt_chat_family *family)
{
    if (!strcmp(name, "qwen2") || !strcmp(name, "qwen2.5")) *family = MT_CHAT_QWEN2;
    else if (!strcmp(name, "qwen3")) *family = MT_CHAT_QWEN3;
    else if (!strcmp(name, "llama3")) *family = MT_CHAT_LLAMA3;
    else if (!strcmp(name, "mistral")) *family = MT_CHAT_MISTRAL;
    else return -1;
    return 0;
}

const char *mt_chat_family_name(mt_chat_family family)
{
    switch (family) {
    case MT_CHAT_QWEN2: return "qwen2";
    case MT_CHAT_QWEN3: return "qwen3";
    case MT_CHAT_LLAMA3: return "llama3";
    case MT_CHAT_MISTRAL: return "mistral";
    }
    return "?";
}

const char *const *mt_chat_special_tokens(mt_chat_family family)
{
    static const char *const qwen[] = { "<|im_start|>", "<|im_end|>", "<|endoftext|>", NULL };
    static const char *const llama[] = { "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                         "<|eot_id|>", "<|end_of_text|>", NULL };
    /* [INST] and [/INST] are added tokens in Mistral v0.3's tokenizer.json but plain text in
     * v0.1/v0.2's (SentencePiece pieces), as transformers tokenizes them: not required here. */
    static const char *const mistral[] = { "<s>", "</s>", NULL };
    switch (family) {
    case MT_CHAT_QWEN2: case MT_CHAT_QWEN3: return qwen;
    case MT_CHAT_LLAMA3: return llama;
    case MT_CHAT_MISTRAL: return mistral;
    }
    return qwen;
}

const char *mt_chat_separator(mt_chat_family family)
{
    switch (family) {
    case MT_CHAT_QWEN2: case MT_CHAT_QWEN3: return "<|endoftext|>";
    case MT_CHAT_LLAMA3: return "<|end_of_text|>";
    case MT_CHAT_MISTRAL: return "</s>";
    }
    return "";
}

/* Checks the message order all templates share: [system] user assistant (user assistant)*. */
static int check_order(const mt_chat_message *msgs, int n, char *err, size_t errlen)
{
    int first = n > 0 && msgs[0].role == MT_ROLE_SYSTEM ? 1 : 0;
    if (n - first < 2) {
        snprintf(err, errlen, "a conversation needs at least one user and one assistant message");
        return -1;
    }
    for (int i = first; i < n; i++) {
        mt_chat_role want = (i - first) % 2 == 0 ? MT_ROLE_USER : MT_ROLE_ASSISTANT;
        if (msgs[i].role != want) {
            snprintf(err, errlen, "message %d is %s, expected %s (a system message may only come first; then user and "
                     "assistant alternate)", i, msgs[i].role == MT_ROLE_SYSTEM ? "system" : msgs[i].role == MT_ROLE_USER ? "user" : "assistant",
                     want == MT_ROLE_USER ? "user" : "assistant");
            return -1;
        }
        if (!msgs[i].content) { snprintf(err, errlen, "message %d has no content", i); return -1; }
    }
    if (msgs[n - 1].role != MT_ROLE_ASSISTANT) {
        snprintf(err, errlen, "the last message must be the assistant's");
        return -1;
    }
    return 0;
}

/* ChatML (Qwen2/2.5/3): <|im_start|>ROLE\nCONTENT<|im_end|>\n per message; trained: assistant
 * CONTENT<|im_end|>. Qwen2 adds the Qwen2.5 default system prompt when there is none. */
static void render_chatml(const mt_chat_message *msgs, int n, bool default_system, buffer *b, mt_chat_rendered *r)
{
    static const char *names[] = { "system", "user", "assistant" };
    if (default_system && msgs[0].role != MT_ROLE_SYSTEM)
        put(b, "<|im_start|>system\n" MT_QWEN25_DEFAULT_SYSTEM "<|im_end|>\n");
    for (int i = 0; i < n; i++) {
        put(b, "<|im_start|>");
        put(b, names[msgs[i].role]);
        put(b, "\n");
        size_t start = b->len;
        put(b, msgs[i].content);
        put(b, "<|im_end|>");
        if (msgs[i].role == MT_ROLE_ASSISTANT) add_span(r, start, b->len);
        put(b, "\n");
    }
}

/* Llama-3: <|begin_of_text|> then <|start_header_id|>ROLE<|end_header_id|>\n\nTRIMMED<|eot_id|>
 * per message; trained: assistant TRIMMED<|eot_id|>. */
static void render_llama3(const mt_chat_message *msgs, int n, buffer *b, mt_chat_rendered *r)
{
    static const char *names[] = { "system", "user", "assistant" };
    put(b, "<|begin_of_text|>");
    for (int i = 0; i < n; i++) {
        put(b, "<|start_header_id|>");
        put(b, names[msgs[i].role]);
        put(b, "<|end_header_id|>\n\n");
        size_t start = b->len;
        put_trimmed(b, msgs[i].content);
        put(b, "<|eot_id|>");
        if (msgs[i].role == MT_ROLE_ASSISTANT) add_span(r, start, b->len);
    }
}

/* Mistral, as the template Mistral-7B-Instruct-v0.2 and v0.3 ship (mistral's "v1" template):
 * <s> then " [INST] USER [/INST]" and " ANSWER</s>" per exchange; a system message is prepended
 * to the first user message with a blank line; trained: ANSWER</s> (the space before it is the
 * template's). */
static void render_mistral(const mt_chat_message *msgs, int n, buffer *b, mt_chat_rendered *r)
{
    int first = msgs[0].role == MT_ROLE_SYSTEM ? 1 : 0;
    put(b, "<s>");
    for (int i = first; i < n; i++) {
        if (msgs[i].role == MT_ROLE_USER) {
            put(b, " [INST] ");
            if (first && i == first) {
                put(b, msgs[0].content);
                put(b, "\n\n");
            }
            put(b, msgs[i].content);
            put(b, " [/INST]");
        } else {
            put(b, " ");
            size_t start = b->len;
            put(b, msgs[i].content);
            put(b, "</s>");
            add_span(r, start, b->len);
        }
    }
}

int mt_chat_render(mt_chat_family family, const mt_chat_message *msgs, int n, mt_chat_rendered *out,
                   char *err, size_t errlen)
{
    memset(out, 0, sizeof *out);
    if (check_order(msgs, n, err, errlen)) return -1;
    buffer b = { 0 };
    put(&b, "");
    switch (family) {
    case MT_CHAT_QWEN2: render_chatml(msgs, n, true, &b, out); break;
    case MT_CHAT_QWEN3: render_chatml(msgs, n, false, &b, out); break;
    case MT_CHAT_LLAMA3: render_llama3(msgs, n, &b, out); break;
    case MT_CHAT_MISTRAL: render_mistral(msgs, n, &b, out); break;
    }
    out->text = b.data;
    out->len = b.len;
    return 0;
}

void mt_chat_rendered_free(mt_chat_rendered *r)
{
    free(r->text);
    free(r->spans);
    memset(r, 0, sizeof *r);
}
