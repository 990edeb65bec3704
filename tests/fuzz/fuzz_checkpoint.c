/* libFuzzer harness: the checkpoint reader (mt_checkpoint_load, runtime/checkpoint.c) against the
 * state of a tiny model (fake_state.h: no StarPU). The input is a flags byte, then the file; flag
 * bit 0 writes the right checksum over its last 8 bytes first, so mutations get past it. A refused
 * file is named in the message. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/util.h"
#include "runtime/checkpoint.h"
#include "tests/fuzz/fake_state.h"
#include "tests/fuzz/fuzz.h"

static mt_host_state *st;

/* A checkpoint of the tiny state through the project's writer, behind each flags value. */
static int write_seeds(const char *dir)
{
    char path[4096], err[512];
    snprintf(path, sizeof path, "%s/checkpoint.tmp", dir);
    mt_checkpoint_meta meta = { .step = 12, .rng_state = 0x1234567890abcdefull, .seed = 7 };
    if (mt_checkpoint_save(path, st, &meta, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return -1;
    }
    size_t len;
    char *bytes = mt_read_file(path, &len, err, sizeof err);
    remove(path);
    for (int flags = 0; flags < 2; flags++) {
        snprintf(path, sizeof path, "%s/tiny-flags%d", dir, flags);
        FILE *f = fopen(path, "wb");
        if (!bytes || !f || fputc(flags, f) == EOF || fwrite(bytes, 1, len, f) != len || fclose(f)) return -1;
    }
    free(bytes);
    return 0;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    st = fuzz_fake_state();
    fuzz_seeds_if_asked(write_seeds);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0) return 0;
    size_t len = size - 1;
    uint8_t *file = malloc(len + 1);
    memcpy(file, data + 1, len);
    if ((data[0] & 1) && len >= 8) {
        uint64_t h = mt_fnv1a64(MT_FNV1A64_START, file, len - 8);
        memcpy(file + len - 8, &h, 8);
    }
    char path[8192], err[2048];
    snprintf(path, sizeof path, "%s", fuzz_write("run.ckpt", file, len));
    free(file);
    mt_checkpoint_meta meta;
    if (mt_checkpoint_load(path, st, &meta, err, sizeof err))
        FUZZ_CHECK(strstr(err, path) != NULL, "message without the path: %s", err);
    return 0;
}
