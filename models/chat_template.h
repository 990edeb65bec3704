/* Chat templates, hard-coded per model family (no Jinja): a conversation rendered to the exact
 * bytes the family's instruct models were trained on, with the byte spans that SFT trains on
 * (assistant content plus the end-of-turn token). docs/data.md writes every template out. */
#ifndef MT_MODELS_CHAT_TEMPLATE_H
#define MT_MODELS_CHAT_TEMPLATE_H

#include <stdbool.h>
#include <stddef.h>

typedef enum mt_chat_family {
    MT_CHAT_QWEN2,   /* Qwen2 / Qwen2.5: ChatML, default system prompt */
    MT_CHAT_QWEN3,   /* Qwen3: ChatML, no default system prompt, no <think> blocks */
    MT_CHAT_LLAMA3,  /* Llama-3 / 3.1 header format, contents trimmed */
    MT_CHAT_MISTRAL, /* [INST] ... [/INST] answer</s> */
} mt_chat_family;

typedef enum mt_chat_role { MT_ROLE_SYSTEM, MT_ROLE_USER, MT_ROLE_ASSISTANT } mt_chat_role;

typedef struct mt_chat_message {
    mt_chat_role role;
    const char *content;     /* NUL-terminated UTF-8 */
} mt_chat_message;

/* A byte range [start, end) of the rendered text. */
typedef struct mt_chat_span { size_t start, end; } mt_chat_span;

typedef struct mt_chat_rendered {
    char *text;              /* malloc'd, NUL-terminated */
    size_t len;
    mt_chat_span *spans;     /* assistant content + its end-of-turn token, in order */
    int nspans;
} mt_chat_rendered;

/* "qwen2" (also "qwen2.5"), "qwen3", "llama3", "mistral"; 0 or -1 for an unknown name. */
int mt_chat_family_parse(const char *name, mt_chat_family *family);
const char *mt_chat_family_name(mt_chat_family family);

/* The Qwen2.5 default system prompt, used by MT_CHAT_QWEN2 when the conversation has none. */
#define MT_QWEN25_DEFAULT_SYSTEM "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

/* Renders n messages. Rules: at most one system message, and only first; then user and assistant
 * alternate starting with user; the last message is an assistant one. -1 with a message naming
 * the message index otherwise. Aborts on out-of-memory. */
int mt_chat_render(mt_chat_family family, const mt_chat_message *msgs, int n, mt_chat_rendered *out,
                   char *err, size_t errlen);
void mt_chat_rendered_free(mt_chat_rendered *r);

/* The special tokens the family's template and packing use; each must be one token of the
 * tokenizer. NULL-terminated list. */
const char *const *mt_chat_special_tokens(mt_chat_family family);

/* The end-of-text token that separates packed documents: "<|endoftext|>" (Qwen),
 * "<|end_of_text|>" (Llama-3), "</s>" (Mistral). */
const char *mt_chat_separator(mt_chat_family family);

#endif
