/* libFuzzer harness: the sharded-safetensors index (model.safetensors.index.json, read by
 * mt_hf_load in runtime/hf.c) of an HF directory whose two shards hold the tensors of a tiny
 * model (fake_state.h: no StarPU). The input is the index; the shards and config.json are
 * written once, by mt_hf_save's sharding. A refusal names a file of the directory: the index, or
 * a shard (one the index names that is missing names the index too: tests/test_hf_bad_files.c
 * checks that, also for a shard whose name holds "tensor '", an input this harness found). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "models/util.h"
#include "runtime/hf.h"
#include "tests/fuzz/fake_state.h"
#include "tests/fuzz/fuzz.h"

static mt_host_state *st;
static char dir[8192], index_path[8192];

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    st = fuzz_fake_state();
    snprintf(dir, sizeof dir, "%s", fuzz_dir());
    char err[2048];
    /* a shard limit below the model's size: two or more shards and an index */
    if (mt_hf_save(dir, st, MT_DTYPE_F32, 2048, err, sizeof err)) {
        fprintf(stderr, "fuzz_index: %s\n", err);
        exit(1);
    }
    snprintf(index_path, sizeof index_path, "%s/model.safetensors.index.json", dir);
    if (fuzz_seed_dir()) { /* the index mt_hf_save wrote */
        size_t len;
        char *text = mt_read_file(index_path, &len, err, sizeof err);
        char path[8192];
        snprintf(path, sizeof path, "%s/saved-index.json", fuzz_seed_dir());
        FILE *f = fopen(path, "wb");
        if (!text || !f || fwrite(text, 1, len, f) != len || fclose(f)) exit(1);
        free(text);
        exit(0);
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    FILE *f = fopen(index_path, "wb");
    if (!f || fwrite(data, 1, size, f) != size || fclose(f)) abort();
    char err[4096];
    if (mt_hf_load(dir, st, err, sizeof err))
        FUZZ_CHECK(strstr(err, dir) != NULL, "message names no file of the directory: %s", err);
    return 0;
}
