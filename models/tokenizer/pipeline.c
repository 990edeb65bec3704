/* The text pipeline of a tokenizer.json around its BPE model: the normalizer and pre-tokenizer of
 * byte-level files (PCRE2 regex splits, NFC), and the normalizer, Metaspace pre-tokenizer and
 * decoder steps of SentencePiece-style files, reduced to the few settings encoding needs. */
#include "models/tokenizer/load.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/report.h"

/* GPT-2's pre-tokeniser regex, which a ByteLevel pre_tokenizer with use_regex true applies. */
static const char GPT2_PATTERN[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static int compile_split(mt_tokenizer *tok, const char *pattern, const char *path, const char *key, char *err,
                         size_t errlen)
{
    if (tok->n_split == MAX_SPLIT_STEPS)
        return mt_fail(err, errlen, "%s: key '%s': more than %d regex splits", path, key, MAX_SPLIT_STEPS);
    int code;
    PCRE2_SIZE offset;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &code,
                                   &offset, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(code, msg, sizeof msg);
        return mt_fail(err, errlen, "%s: key '%s': PCRE2 cannot compile the regex at offset %zu: %s", path, key,
                       (size_t)offset, (const char *)msg);
    }
    /* JIT is only speed: without it (unsupported CPU) the interpreter gives the same matches. */
    int n = tok->n_split;
    tok->split_jit[n] = pcre2_jit_compile(re, PCRE2_JIT_COMPLETE) == 0;
    tok->split[n] = re;
    tok->split_key[n] = strdup(key);
    tok->match[n] = pcre2_match_data_create_from_pattern(re, NULL);
    if (!tok->interp_context) { /* the first split: the match resources every split shares */
        tok->jit_context = pcre2_match_context_create(NULL);
        tok->interp_context = pcre2_match_context_create(NULL);
        tok->jit_stack = pcre2_jit_stack_create(MT_TOK_JIT_STACK_START, MT_TOK_JIT_STACK_MAX, NULL);
        if (tok->jit_context && tok->jit_stack) pcre2_jit_stack_assign(tok->jit_context, NULL, tok->jit_stack);
        if (tok->interp_context) {
            pcre2_set_heap_limit(tok->interp_context, MT_TOK_HEAP_LIMIT_KIB);
            pcre2_set_match_limit(tok->interp_context, MT_TOK_MATCH_LIMIT);
            pcre2_set_depth_limit(tok->interp_context, MT_TOK_DEPTH_LIMIT);
        }
    }
    if (!tok->jit_stack) tok->split_jit[n] = false; /* a PCRE2 without JIT: the interpreter matches */
    if (!tok->match[n] || !tok->split_key[n] || !tok->jit_context || !tok->interp_context) {
        fprintf(stderr, "megatrain tokenizer: out of memory\n");
        abort();
    }
    tok->n_split++;
    return 0;
}

/* A ByteLevel step: only the options these files use; its own regex when use_regex is on. */
static int parse_byte_level(mt_tokenizer *tok, const json_t *pre, const char *path, const char *key, char *err,
                            size_t errlen)
{
    if (flag(pre, "add_prefix_space"))
        return mt_fail(err, errlen, "%s: key '%s.add_prefix_space': true is not supported (Llama-3 and Qwen use false)",
                       path, key);
    json_t *use_regex = lookup(pre, "use_regex");
    if (!use_regex || json_is_true(use_regex)) return compile_split(tok, GPT2_PATTERN, path, key, err, errlen);
    return 0;
}

int mt_tok_parse_pre_tokenizer(mt_tokenizer *tok, const json_t *root, const char *path, char *err, size_t errlen)
{
    json_t *pre = lookup(root, "pre_tokenizer");
    if (!pre)
        return mt_fail(err, errlen, "%s: key 'pre_tokenizer': missing; only byte-level BPE tokenizers are supported",
                       path);
    const char *type = json_string_value(lookup(pre, "type"));
    if (!type) return mt_fail(err, errlen, "%s: key 'pre_tokenizer.type': missing or not a string", path);
    if (strcmp(type, "ByteLevel") == 0) return parse_byte_level(tok, pre, path, "pre_tokenizer", err, errlen);
    if (strcmp(type, "Sequence") != 0)
        return mt_fail(err, errlen, "%s: key 'pre_tokenizer.type': '%s' is not supported (ByteLevel or Sequence)",
                       path, type);
    json_t *steps = lookup(pre, "pretokenizers");
    if (!json_is_array(steps))
        return mt_fail(err, errlen, "%s: key 'pre_tokenizer.pretokenizers': missing or not an array", path);
    bool byte_level = false;
    size_t i;
    json_t *step;
    json_array_foreach(steps, i, step) {
        char key[96];
        snprintf(key, sizeof key, "pre_tokenizer.pretokenizers[%zu]", i);
        const char *st = json_string_value(lookup(step, "type"));
        if (byte_level)
            return mt_fail(err, errlen, "%s: key '%s': ByteLevel must be the last pre-tokenizer", path, key);
        if (st && strcmp(st, "ByteLevel") == 0) {
            if (parse_byte_level(tok, step, path, key, err, errlen)) return -1;
            byte_level = true;
            continue;
        }
        if (!st || strcmp(st, "Split") != 0)
            return mt_fail(err, errlen, "%s: key '%s.type': '%s' is not supported (Split or ByteLevel)", path, key,
                           st ? st : "(missing)");
        const char *regex = json_string_value(lookup(lookup(step, "pattern"), "Regex"));
        if (!regex)
            return mt_fail(err, errlen, "%s: key '%s.pattern.Regex': missing (string patterns are not supported)",
                           path, key);
        const char *behavior = json_string_value(lookup(step, "behavior"));
        if (!behavior || strcmp(behavior, "Isolated") != 0 || flag(step, "invert"))
            return mt_fail(err, errlen, "%s: key '%s.behavior': only Isolated without invert is supported", path, key);
        char rkey[128];
        snprintf(rkey, sizeof rkey, "%s.pattern.Regex", key);
        if (compile_split(tok, regex, path, rkey, err, errlen)) return -1;
    }
    if (!byte_level)
        return mt_fail(err, errlen, "%s: key 'pre_tokenizer.pretokenizers': no ByteLevel step; only byte-level BPE "
                       "tokenizers are supported", path);
    return 0;
}

int mt_tok_parse_normalizer(mt_tokenizer *tok, const json_t *root, const char *path, char *err, size_t errlen)
{
    json_t *norm = lookup(root, "normalizer");
    if (!norm) return 0;
    const char *type = json_string_value(lookup(norm, "type"));
    if (!type || strcmp(type, "NFC") != 0)
        return mt_fail(err, errlen, "%s: key 'normalizer.type': '%s' is not supported (only NFC)", path, type ? type : "(missing)");
    snprintf(tok->normalizer, sizeof tok->normalizer, "%s", type);
    return 0;
}

/* ---------------------------------------------------------------- SentencePiece-style files */

static bool str_is(const json_t *v, const char *s) { return json_is_string(v) && strcmp(json_string_value(v), s) == 0; }

/* The steps of a component: its "Sequence" list under list_key, or the component alone. */
static json_t *steps_of(json_t *component, const char *list_key, json_t **single)
{
    *single = NULL;
    if (str_is(lookup(component, "type"), "Sequence")) return lookup(component, list_key);
    json_t *a = json_array();
    json_array_append(a, component);
    *single = a;
    return a;
}

/* Whether a Metaspace pre-tokenizer or decoder step prepends (and its decoder so drops) "\u2581":
 * not with add_prefix_space false or prepend_scheme "never" (tokenizers reads both spellings). */
static bool metaspace_prepends(const json_t *step)
{
    const char *scheme = json_string_value(lookup(step, "prepend_scheme"));
    return !json_is_false(lookup(step, "add_prefix_space")) && !(scheme && strcmp(scheme, "never") == 0);
}

/* normalizer, pre_tokenizer and decoder of a SentencePiece-style tokenizer.json, in the forms
 * Llama 2 and Mistral v0.1/v0.2 (a Prepend("\u2581") + Replace(" ", "\u2581") normalizer, no
 * pre-tokenizer; decoder Replace, ByteFallback, Fuse, Strip(" ", 1, 0)) and Mistral v0.3 (a
 * Metaspace pre-tokenizer, split false; a Metaspace decoder) write them. */
int mt_tok_parse_spm(mt_tokenizer *tok, const json_t *root, const char *path, char *err, size_t errlen)
{
    bool prepend = false, replace = false;
    json_t *norm = lookup(root, "normalizer"), *single, *steps, *st;
    size_t i;
    if (norm) {
        steps = steps_of(norm, "normalizers", &single);
        if (!json_is_array(steps)) return mt_fail(err, errlen, "%s: key 'normalizer.normalizers': not an array", path);
        json_array_foreach(steps, i, st) {
            if (str_is(lookup(st, "type"), "Prepend") && str_is(lookup(st, "prepend"), MT_TOK_METASPACE)) prepend = true;
            else if (str_is(lookup(st, "type"), "Replace") && str_is(lookup(lookup(st, "pattern"), "String"), " ") &&
                     str_is(lookup(st, "content"), MT_TOK_METASPACE)) replace = true;
            else {
                json_decref(single);
                return mt_fail(err, errlen, "%s: key 'normalizer': step %zu is not supported with byte_fallback (only "
                               "Prepend(\"\u2581\") and Replace(\" \", \"\u2581\"), as Llama 2 and Mistral write)", path, i);
            }
        }
        json_decref(single);
    }
    tok->spm_prepend = prepend ? SPM_PREPEND_EVERY : SPM_PREPEND_NEVER;
    json_t *pre = lookup(root, "pre_tokenizer");
    if (pre) {
        if (!str_is(lookup(pre, "type"), "Metaspace") || !str_is(lookup(pre, "replacement"), MT_TOK_METASPACE))
            return mt_fail(err, errlen, "%s: key 'pre_tokenizer': only Metaspace with replacement \"\u2581\" is "
                           "supported with byte_fallback", path);
        if (flag(pre, "split"))
            return mt_fail(err, errlen, "%s: key 'pre_tokenizer.split': true is not supported (Mistral writes false)",
                           path);
        if (prepend)
            return mt_fail(err, errlen, "%s: key 'pre_tokenizer': a Metaspace pre-tokenizer after a Prepend "
                           "normalizer is not supported", path);
        const char *scheme = json_string_value(lookup(pre, "prepend_scheme"));
        if (!metaspace_prepends(pre)) tok->spm_prepend = SPM_PREPEND_NEVER;
        else if (scheme && strcmp(scheme, "first") == 0) tok->spm_prepend = SPM_PREPEND_FIRST;
        else if (!scheme || strcmp(scheme, "always") == 0) tok->spm_prepend = SPM_PREPEND_ALWAYS;
        else return mt_fail(err, errlen, "%s: key 'pre_tokenizer.prepend_scheme': '%s' is not first, always or never",
                            path, scheme);
        tok->spm_metaspace = true;
        replace = true;
    }
    if (!replace)
        return mt_fail(err, errlen, "%s: key 'normalizer': spaces are never written as \"\u2581\" (byte_fallback "
                       "needs a Replace normalizer or a Metaspace pre-tokenizer)", path);
    json_t *dec = lookup(root, "decoder");
    tok->spm_strip = SPM_STRIP_NONE;
    if (!dec) return 0;
    steps = steps_of(dec, "decoders", &single);
    if (!json_is_array(steps)) return mt_fail(err, errlen, "%s: key 'decoder.decoders': not an array", path);
    int rc = 0;
    json_array_foreach(steps, i, st) {
        const json_t *type = lookup(st, "type");
        if (str_is(type, "ByteFallback") || str_is(type, "Fuse")) continue;
        if (str_is(type, "Replace") && str_is(lookup(lookup(st, "pattern"), "String"), MT_TOK_METASPACE) &&
            str_is(lookup(st, "content"), " "))
            continue;
        if (str_is(type, "Strip") && str_is(lookup(st, "content"), " ") && json_integer_value(lookup(st, "start")) <= 1 &&
            json_integer_value(lookup(st, "stop")) == 0) {
            if (json_integer_value(lookup(st, "start")) == 1) tok->spm_strip = SPM_STRIP_FUSED;
            continue;
        }
        if (str_is(type, "Metaspace") && str_is(lookup(st, "replacement"), MT_TOK_METASPACE)) {
            if (metaspace_prepends(st)) tok->spm_strip = SPM_STRIP_FIRST_TOKEN;
            continue;
        }
        rc = mt_fail(err, errlen, "%s: key 'decoder': step %zu (%s) is not supported with byte_fallback (Replace, "
                     "ByteFallback, Fuse, Strip, Metaspace)", path, i, json_is_string(type) ? json_string_value(type) : "?");
        break;
    }
    json_decref(single);
    return rc;
}
