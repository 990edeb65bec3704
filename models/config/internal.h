/* Private to models/config/ (never included from outside it): what the files that read, check
 * and write a config share. The public API is models/config.h. */
#ifndef MT_MODELS_CONFIG_INTERNAL_H
#define MT_MODELS_CONFIG_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "models/config.h"

/* Any single size above this is a typo or an attack, not a model; it also keeps every product the
 * layout and the memory plan form (sizes times 18-20 bytes) far from int64 overflow. */
#define MAX_SIZE ((int64_t)1 << 31)

/* The rope_type names of HF configs, indexed by mt_rope_type (rope.c). */
extern const char *const mt_cfg_rope_type_names[MT_ROPE_LLAMA3 + 1];
/* The name of t, "?" for a value outside mt_rope_type. */
const char *mt_cfg_rope_type_name(mt_rope_type t);

/* The length a scaling's factor multiplies (rope.c). */
int64_t mt_cfg_rope_original_length(const mt_model_config *cfg);

/* The rope scaling fields of cfg against what each type needs; errors name `name` (rope.c). */
int mt_cfg_validate_rope_scaling(const mt_model_config *cfg, const char *name, char *err, size_t errlen);

/* Whether the family is a mixture of experts, Qwen3-MoE or Mixtral (validate.c). */
bool mt_cfg_is_moe_family(mt_family f);

/* The key that holds the expert count under cfg's family: num_local_experts or num_experts
 * (validate.c). */
const char *mt_cfg_expert_count_key(const mt_model_config *cfg);

#endif
