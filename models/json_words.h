/* Words for JSON values in error messages ("expected an integer, got a string"), shared by the
 * readers of HF files. */
#ifndef MT_MODELS_JSON_WORDS_H
#define MT_MODELS_JSON_WORDS_H

#include <jansson.h>

/* "an object", "a string", "an integer", ... for v's JSON type. */
const char *mt_json_type_name(const json_t *v);

#endif
