/* The HF checkpoint suites' shared fixtures (tests/hf_util.h). */
#include "tests/hf_util.h"

#include <check.h>
#include <dirent.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "models/util.h"
#include "runtime/hf.h"
#include "runtime/runtime.h"
#include "tests/testutil.h"

const char *const config_names[NCONFIGS] = { "qwen2", "qwen2-tied", "qwen3", "llama" };

/* Qwen2 with q/k/v bias, untied; H*D == d. */
static const char qwen2_json[] =
    "{\"model_type\": \"qwen2\", \"hidden_size\": 64, \"intermediate_size\": 96, \"num_hidden_layers\": 2,"
    " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"vocab_size\": 300,"
    " \"max_position_embeddings\": 128, \"tie_word_embeddings\": false}";
/* Same, tied: no lm_head.weight. */
static const char qwen2_tied_json[] =
    "{\"model_type\": \"qwen2\", \"hidden_size\": 64, \"intermediate_size\": 96, \"num_hidden_layers\": 2,"
    " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"vocab_size\": 300,"
    " \"max_position_embeddings\": 128, \"tie_word_embeddings\": true}";
/* Qwen3: q/k norm, H*D != d, sizes off the tile alignment. */
static const char qwen3_json[] =
    "{\"model_type\": \"qwen3\", \"hidden_size\": 48, \"intermediate_size\": 100, \"num_hidden_layers\": 2,"
    " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 16, \"vocab_size\": 261,"
    " \"max_position_embeddings\": 128, \"tie_word_embeddings\": false}";
static const char llama_json[] =
    "{\"model_type\": \"llama\", \"hidden_size\": 64, \"intermediate_size\": 160, \"num_hidden_layers\": 3,"
    " \"num_attention_heads\": 8, \"num_key_value_heads\": 4, \"vocab_size\": 333,"
    " \"max_position_embeddings\": 128}";

static const char *const configs[NCONFIGS] = { qwen2_json, qwen2_tied_json, qwen3_json, llama_json };

void runtime_up(void)
{
    mt_runtime_options ro = { .sched = "eager", .ncpu = 2, .ncuda = 0 };
    char err[512] = "";
    ck_assert_msg(mt_runtime_init(&ro, err, sizeof err) == 0, "mt_runtime_init: %s", err);
}

void runtime_down(void) { mt_runtime_shutdown(); }

mt_model_config parse_config(int which)
{
    mt_model_config cfg;
    char err[512] = "";
    ck_assert_msg(mt_config_parse(configs[which], config_names[which], &cfg, err, sizeof err) == 0, "%s", err);
    return cfg;
}

/* A state of that config with zeroed weights. */
mt_host_state *new_state(const mt_model_config *cfg, mt_dtype dtype)
{
    char err[512] = "";
    mt_host_state *st = mt_state_create(cfg, dtype, 0, err, sizeof err);
    ck_assert_msg(st != NULL, "mt_state_create: %s", err);
    return st;
}

mt_host_state *random_state(int which, mt_dtype dtype, uint64_t seed)
{
    mt_model_config cfg = parse_config(which);
    mt_host_state *st = new_state(&cfg, dtype);
    /* std 1 rather than 0.02: more distinct bf16 values, so rounding mistakes show. */
    mt_state_init_random(st, seed, 1.0);
    return st;
}

/* A fresh empty directory; the caller frees the string. */
char *temp_dir(void)
{
    char *d = strdup("/tmp/mt-hf.XXXXXX");
    ck_assert_msg(mkdtemp(d) != NULL, "mkdtemp failed");
    return d;
}

/* Removes a directory of plain files. */
void remove_dir(char *dir)
{
    mt_test_remove_dir(dir);
    free(dir);
}

bool exists(const char *dir, const char *name)
{
    char p[4096];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return access(p, F_OK) == 0;
}

int count_files(const char *dir, const char *suffix)
{
    DIR *d = opendir(dir);
    ck_assert(d != NULL);
    struct dirent *de;
    int n = 0;
    size_t ls = strlen(suffix);
    while ((de = readdir(d))) {
        size_t l = strlen(de->d_name);
        if (l >= ls && !strcmp(de->d_name + l - ls, suffix)) n++;
    }
    closedir(d);
    return n;
}

void save_ok(const char *dir, const mt_host_state *st, mt_dtype dtype, uint64_t max_shard)
{
    char err[1024] = "";
    ck_assert_msg(mt_hf_save(dir, st, dtype, max_shard, err, sizeof err) == 0, "mt_hf_save(%s): %s", dir, err);
}

/* Loads dir into a fresh state of src's config and returns it. */
mt_host_state *load_ok(const char *dir, const mt_model_config *cfg, mt_dtype compute)
{
    mt_host_state *st = new_state(cfg, compute);
    char err[1024] = "";
    ck_assert_msg(mt_hf_load(dir, st, err, sizeof err) == 0, "mt_hf_load(%s): %s", dir, err);
    return st;
}

/* Every tile's master of b equals a's (bf16: a's rounded to bf16), bit for bit, padding too; and
 * b's streamed copy was refreshed from its master. */
void assert_masters(const mt_host_state *a, const mt_host_state *b, bool bf16_rounded)
{
    for (int i = 0; i < a->ntiles; i++) {
        const mt_tile *ta = &a->tiles[i], *tb = &b->tiles[i];
        ck_assert_int_eq(ta->numel, tb->numel);
        float *want = malloc(sizeof(float) * (size_t)ta->numel);
        for (int64_t e = 0; e < ta->numel; e++)
            want[e] = bf16_rounded ? mt_float_from_bf16(mt_bf16_from_float(ta->master[e])) : ta->master[e];
        int64_t bad = -1;
        for (int64_t e = 0; e < ta->numel && bad < 0; e++)
            if (memcmp(&want[e], &tb->master[e], sizeof(float))) bad = e;
        ck_assert_msg(bad < 0, "tile %d element %lld: %.9g, want %.9g", i, (long long)bad,
                      bad >= 0 ? tb->master[bad] : 0.0, bad >= 0 ? want[bad] : 0.0);
        if (b->compute_dtype == MT_DTYPE_F32) {
            ck_assert(memcmp(tb->weights, tb->master, sizeof(float) * (size_t)tb->numel) == 0);
        } else {
            const mt_bf16 *w = tb->weights;
            for (int64_t e = 0; e < tb->numel; e++) ck_assert_uint_eq(w[e], mt_bf16_from_float(tb->master[e]));
        }
        free(want);
    }
}


/* The weight_map of an index file, as a new reference. */
json_t *read_index(const char *dir)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    json_t *o = json_load_file(path, 0, NULL);
    ck_assert_msg(o != NULL, "%s unreadable", path);
    return o;
}
