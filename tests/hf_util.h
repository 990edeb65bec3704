/* Shared by the HF checkpoint suites (test_hf_roundtrip.c, test_hf_bad_files.c): small configs of
 * each family, states of them, temporary directories, and saves and loads that must succeed. */
#ifndef MT_TESTS_HF_UTIL_H
#define MT_TESTS_HF_UTIL_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#include "models/config.h"
#include "models/dtype.h"
#include "runtime/state.h"

/* The configs: qwen2 untied with q/k/v bias (H*D == d), the same tied (no lm_head.weight), qwen3
 * (q/k norm, H*D != d, sizes off the tile alignment), llama. */
#define NCONFIGS 4
extern const char *const config_names[NCONFIGS];

/* StarPU on two CPU workers, for a checked fixture. */
void runtime_up(void);
void runtime_down(void);

/* Config `which` (0 .. NCONFIGS - 1), parsed. */
mt_model_config parse_config(int which);

/* A state of that config with zeroed weights. */
mt_host_state *new_state(const mt_model_config *cfg, mt_dtype dtype);

/* A state of config `which` with random weights of std 1. */
mt_host_state *random_state(int which, mt_dtype dtype, uint64_t seed);

/* A fresh empty directory; the caller frees the string. */
char *temp_dir(void);

/* Removes a directory of plain files and frees the string. */
void remove_dir(char *dir);

/* Whether dir/name exists; how many files of dir end with suffix. */
bool exists(const char *dir, const char *name);
int count_files(const char *dir, const char *suffix);

/* mt_hf_save and mt_hf_load, which must succeed (load_ok: into a fresh state of cfg). */
void save_ok(const char *dir, const mt_host_state *st, mt_dtype dtype, uint64_t max_shard);
mt_host_state *load_ok(const char *dir, const mt_model_config *cfg, mt_dtype compute);

/* Every tile's master of b equals a's (bf16: a's rounded to bf16), bit for bit, padding too; and
 * b's streamed copy was refreshed from its master. */
void assert_masters(const mt_host_state *a, const mt_host_state *b, bool bf16_rounded);

/* The weight_map of an index file, as a new reference. */
json_t *read_index(const char *dir);

#endif
