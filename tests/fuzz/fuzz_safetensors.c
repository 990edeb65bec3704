/* libFuzzer harness: a safetensors file (models/safetensors.c). The input is the whole file; a
 * header the reader accepts must describe tensors that lie inside the file, and every F32, F16
 * or BF16 tensor of it must read as fp32. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/safetensors.h"
#include "tests/fuzz/fuzz.h"

/* Valid files through the project's writer: F32 and BF16, a scalar, a matrix, an empty tensor. */
static int write_seeds(const char *dir)
{
    float data[12] = { 1, -2, 3.5f, 0, 1e-3f, 65504, -1e30f, 7, 8, 9, 10, 11 };
    mt_st_source t[] = {
        { .name = "model.embed_tokens.weight", .ndim = 2, .shape = { 3, 4 }, .data = data },
        { .name = "model.norm.weight", .ndim = 1, .shape = { 4 }, .data = data + 4 },
        { .name = "scalar", .ndim = 0, .data = data + 8 },
        { .name = "empty", .ndim = 2, .shape = { 0, 5 }, .data = data },
    };
    char path[4096], err[512];
    snprintf(path, sizeof path, "%s/f32.safetensors", dir);
    int rc = mt_st_write(path, t, 4, MT_ST_F32, err, sizeof err);
    snprintf(path, sizeof path, "%s/bf16.safetensors", dir);
    if (rc == 0) rc = mt_st_write(path, t, 2, MT_ST_BF16, err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    return rc;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    fuzz_seeds_if_asked(write_seeds);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *path = fuzz_write("model.safetensors", data, size);
    char err[1024];
    mt_st_file *f = mt_st_open(path, err, sizeof err);
    if (!f) {
        FUZZ_CHECK(strstr(err, path) != NULL, "message without the path: %s", err);
        return 0;
    }
    FUZZ_CHECK(f->data_start <= f->file_size, "data starts at %llu of %llu", (unsigned long long)f->data_start,
               (unsigned long long)f->file_size);
    for (int i = 0; i < f->ntensors; i++) {
        const mt_st_tensor *t = &f->tensors[i];
        FUZZ_CHECK(t->begin <= t->end && f->data_start + t->end <= f->file_size, "tensor %s [%llu, %llu)", t->name,
                   (unsigned long long)t->begin, (unsigned long long)t->end);
        FUZZ_CHECK(t->end - t->begin == mt_st_nbytes(t->dtype, t->numel), "tensor %s: %llu bytes for %lld elements",
                   t->name, (unsigned long long)(t->end - t->begin), (long long)t->numel);
        FUZZ_CHECK(mt_st_find(f, t->name) == t, "tensor %s: another of its name found", t->name);
        if (t->dtype != MT_ST_F32 && t->dtype != MT_ST_F16 && t->dtype != MT_ST_BF16) continue;
        float *dst = malloc((size_t)t->numel * sizeof *dst + 1);
        FUZZ_CHECK(mt_st_read_f32(f, t, dst, err, sizeof err) == 0, "tensor %s: %s", t->name, err);
        free(dst);
    }
    mt_st_close(f);
    return 0;
}
