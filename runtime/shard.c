/* The shard file: a 64-byte little-endian header (magic, version, sizes, dtypes, FNV-1a 64 of the
 * payload), then the tokens and the mask of n_seq windows. docs/data.md specifies it. */
#include "runtime/shard.h"

#include <errno.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "models/util.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "shards are read and written as little-endian memory images"
#endif

static void put_u32(uint8_t *p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i)); }
static void put_u64(uint8_t *p, uint64_t v) { for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i)); }
static uint32_t get_u32(const uint8_t *p) { uint32_t v = 0; for (int i = 3; i >= 0; i--) v = v << 8 | p[i]; return v; }
static uint64_t get_u64(const uint8_t *p) { uint64_t v = 0; for (int i = 7; i >= 0; i--) v = v << 8 | p[i]; return v; }

int mt_shard_write(const char *path, int64_t seq_len, int64_t n_seq, const int32_t *tokens, const uint8_t *mask,
                   char *err, size_t errlen)
{
    size_t count = (size_t)n_seq * (size_t)(seq_len + 1);
    uint8_t header[MT_SHARD_HEADER_BYTES] = { 0 };
    memcpy(header, MT_SHARD_MAGIC, 8);
    put_u32(header + 8, MT_SHARD_VERSION);
    put_u32(header + 12, MT_SHARD_HEADER_BYTES);
    put_u64(header + 16, (uint64_t)seq_len);
    put_u64(header + 24, (uint64_t)n_seq);
    put_u32(header + 32, MT_SHARD_DTYPE_INT32);
    put_u32(header + 36, MT_SHARD_DTYPE_UINT8);
    put_u64(header + 40, mt_fnv1a64(mt_fnv1a64(MT_FNV1A64_START, tokens, count * 4), mask, count));
    FILE *f = fopen(path, "wb");
    if (!f) { snprintf(err, errlen, "%s: cannot create: %s", path, strerror(errno)); return -1; }
    bool ok = fwrite(header, 1, sizeof header, f) == sizeof header && fwrite(tokens, 4, count, f) == count &&
              fwrite(mask, 1, count, f) == count && fflush(f) == 0 && fsync(fileno(f)) == 0;
    int e = errno;
    if (fclose(f) != 0) ok = false;
    if (!ok) { snprintf(err, errlen, "%s: write failed: %s", path, strerror(e)); return -1; }
    return 0;
}

int mt_shard_read(const char *path, int64_t *seq_len, int64_t *n_seq, int32_t **tokens, uint8_t **mask,
                  char *err, size_t errlen)
{
    *tokens = NULL;
    *mask = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) { snprintf(err, errlen, "%s: cannot open: %s", path, strerror(errno)); return -1; }
    uint8_t h[MT_SHARD_HEADER_BYTES];
    struct stat sb;
    if (fread(h, 1, sizeof h, f) != sizeof h || memcmp(h, MT_SHARD_MAGIC, 8) != 0) {
        snprintf(err, errlen, "%s: not a megatrain shard (no '" MT_SHARD_MAGIC "' header)", path);
        fclose(f);
        return -1;
    }
    uint32_t version = get_u32(h + 8);
    uint64_t T = get_u64(h + 16), n = get_u64(h + 24);
    if (version != MT_SHARD_VERSION || get_u32(h + 12) != MT_SHARD_HEADER_BYTES ||
        get_u32(h + 32) != MT_SHARD_DTYPE_INT32 || get_u32(h + 36) != MT_SHARD_DTYPE_UINT8) {
        snprintf(err, errlen, "%s: shard version %u with header %u bytes, dtypes %u/%u; this build reads version %d "
                 "(int32 tokens, uint8 mask): prepare the data again", path, version, get_u32(h + 12), get_u32(h + 32),
                 get_u32(h + 36), MT_SHARD_VERSION);
        fclose(f);
        return -1;
    }
    fstat(fileno(f), &sb);
    if (T < 1 || T > (1u << 24) || n > (uint64_t)INT64_MAX / 5 / (T + 1) ||
        (uint64_t)sb.st_size != MT_SHARD_HEADER_BYTES + n * (T + 1) * 5) {
        snprintf(err, errlen, "%s: the header says %llu sequences of %llu + 1 tokens (%llu bytes) but the file has %lld bytes "
                 "(truncated or corrupt)", path, (unsigned long long)n, (unsigned long long)T,
                 (unsigned long long)(MT_SHARD_HEADER_BYTES + n * (T + 1) * 5), (long long)sb.st_size);
        fclose(f);
        return -1;
    }
    size_t count = (size_t)(n * (T + 1));
    *tokens = mt_xmalloc(count * 4);
    *mask = mt_xmalloc(count);
    if (fread(*tokens, 4, count, f) != count || fread(*mask, 1, count, f) != count) {
        snprintf(err, errlen, "%s: read failed", path);
        goto fail;
    }
    if (mt_fnv1a64(mt_fnv1a64(MT_FNV1A64_START, *tokens, count * 4), *mask, count) != get_u64(h + 40)) {
        snprintf(err, errlen, "%s: checksum mismatch (corrupt shard): prepare the data again", path);
        goto fail;
    }
    fclose(f);
    *seq_len = (int64_t)T;
    *n_seq = (int64_t)n;
    return 0;
fail:
    fclose(f);
    free(*tokens); free(*mask);
    *tokens = NULL; *mask = NULL;
    return -1;
}
