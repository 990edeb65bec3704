/* Helpers for error messages, shared by the readers of model files (config.json, tokenizer.json,
 * safetensors, HF directories): formatting into the caller's buffer, and words for JSON types. */
#ifndef MT_MODELS_REPORT_H
#define MT_MODELS_REPORT_H

#include <jansson.h>
#include <stddef.h>

/* Formats the message into err (when err is non-NULL and errlen > 0) and returns -1, so a reader
 * can `return mt_fail(err, errlen, "...", ...)`. */
int mt_fail(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* "an object", "a string", "an integer", ... for v's JSON type ("expected an integer, got a
 * string"). */
const char *mt_json_type_name(const json_t *v);

#endif
