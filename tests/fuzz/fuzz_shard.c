/* libFuzzer harness: the token shard reader (mt_shard_read, runtime/shard.c) and, for a shard it
 * accepts, the prepared-directory reader over it (mt_dataset_open and batches, runtime/dataset.c).
 * The input is a flags byte, then the shard file. Flag bit 0 writes the right checksum into the
 * header first, so mutations get past it; bit 1 gives meta.json a vocabulary of 256 ids (else
 * 2^20). A refused shard is named in the message. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/util.h"
#include "runtime/dataset.h"
#include "runtime/shard.h"
#include "tests/fuzz/fuzz.h"

/* Valid shards through the project's writer, each behind a flags byte. */
static int write_seeds(const char *dir)
{
    int32_t tokens[3 * 9];
    uint8_t mask[3 * 9];
    for (int i = 0; i < 27; i++) {
        tokens[i] = (i * 37) % 256;
        mask[i] = (uint8_t)(i % 3 != 0);
    }
    static const struct { const char *name; int64_t T, n; uint8_t flags; } seeds[] = {
        { "three-windows", 8, 3, 3 }, { "one-window", 8, 1, 0 }, { "long-window", 26, 1, 1 },
    };
    for (size_t s = 0; s < sizeof seeds / sizeof seeds[0]; s++) {
        char path[4096], err[512];
        snprintf(path, sizeof path, "%s/shard.tmp", dir);
        if (mt_shard_write(path, seeds[s].T, seeds[s].n, tokens, mask, err, sizeof err)) {
            fprintf(stderr, "%s\n", err);
            return -1;
        }
        size_t len;
        char *bytes = mt_read_file(path, &len, err, sizeof err);
        remove(path);
        snprintf(path, sizeof path, "%s/%s", dir, seeds[s].name);
        FILE *f = fopen(path, "wb");
        if (!bytes || !f || fputc(seeds[s].flags, f) == EOF || fwrite(bytes, 1, len, f) != len || fclose(f)) return -1;
        free(bytes);
    }
    return 0;
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
    if (size == 0) return 0;
    uint8_t flags = data[0];
    size_t len = size - 1;
    uint8_t *file = malloc(len + 1);
    memcpy(file, data + 1, len);
    if ((flags & 1) && len >= MT_SHARD_HEADER_BYTES) {
        uint64_t h = mt_fnv1a64(MT_FNV1A64_START, file + MT_SHARD_HEADER_BYTES, len - MT_SHARD_HEADER_BYTES);
        memcpy(file + 40, &h, 8); /* the checksum field, little-endian as the host */
    }
    char path[8192], err[2048];
    snprintf(path, sizeof path, "%s", fuzz_write("train-00000.bin", file, len));
    free(file);
    int64_t T, n;
    int32_t *tokens;
    uint8_t *mask;
    if (mt_shard_read(path, &T, &n, &tokens, &mask, err, sizeof err)) {
        FUZZ_CHECK(strstr(err, path) != NULL, "message without the path: %s", err);
        FUZZ_CHECK(tokens == NULL && mask == NULL, "a refused shard left buffers");
        return 0;
    }
    FUZZ_CHECK(T >= 1 && n >= 0 && (uint64_t)len == MT_SHARD_HEADER_BYTES + (uint64_t)n * (uint64_t)(T + 1) * 5,
               "accepted T %lld, n %lld for %zu bytes", (long long)T, (long long)n, len);
    free(tokens);
    free(mask);

    char meta[1024];
    int m = snprintf(meta, sizeof meta, "{\"format\": \"megatrain-token-shards\", \"version\": %d, \"seq_len\": %lld, "
                     "\"family\": \"qwen3\", \"tokenizer\": {\"path\": \"tokenizer.json\", \"vocab_size\": %d}, "
                     "\"train\": {\"shards\": [\"train-00000.bin\"]}, \"val\": {\"shards\": []}}",
                     MT_SHARD_VERSION, (long long)T, flags & 2 ? 256 : 1 << 20);
    fuzz_write("meta.json", meta, (size_t)m);
    mt_dataset d;
    if (mt_dataset_open(fuzz_dir(), &d, err, sizeof err)) return 0;
    FUZZ_CHECK(d.train.n_seq == n && d.seq_len == T, "read %lld windows of %lld", (long long)d.train.n_seq,
               (long long)d.seq_len);
    int32_t *tok = malloc(sizeof *tok * (size_t)T * 3), *tgt = malloc(sizeof *tgt * (size_t)T * 3);
    mt_dataset_batch(&d, true, 7, 5 * n - 1, 3, tok, tgt);
    for (int64_t i = 0; i < 3 * T; i++)
        FUZZ_CHECK(tok[i] >= 0 && tok[i] < d.vocab_size && tgt[i] >= -1 && tgt[i] < d.vocab_size, "token %d, target %d",
                   tok[i], tgt[i]);
    free(tok);
    free(tgt);
    mt_dataset_close(&d);
    return 0;
}
