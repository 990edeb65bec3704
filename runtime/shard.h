/* Token shards: one file holds n_seq windows of seq_len + 1 int32 tokens and their uint8 loss
 * mask behind a 64-byte header with a checksum. `megatrain prepare` writes them
 * (runtime/prepare.h), the reader loads them (runtime/dataset.h); docs/data.md specifies the
 * format. */
#ifndef MT_RUNTIME_SHARD_H
#define MT_RUNTIME_SHARD_H

#include <stddef.h>
#include <stdint.h>

#define MT_SHARD_MAGIC "MTSHARDS"
#define MT_SHARD_VERSION 1
#define MT_SHARD_HEADER_BYTES 64
#define MT_SHARD_DTYPE_INT32 1
#define MT_SHARD_DTYPE_UINT8 2

/* Writes one shard: the 64-byte header, then tokens (n_seq, seq_len + 1) int32 little-endian,
 * then mask (n_seq, seq_len + 1) uint8. Flushed and fsync'd. -1 with err naming the path. */
int mt_shard_write(const char *path, int64_t seq_len, int64_t n_seq, const int32_t *tokens, const uint8_t *mask,
                   char *err, size_t errlen);

/* Reads a shard, checking magic, version, dtypes, size and checksum; *tokens and *mask are
 * malloc'd (free them). -1 with err naming the path and what is wrong. */
int mt_shard_read(const char *path, int64_t *seq_len, int64_t *n_seq, int32_t **tokens, uint8_t **mask,
                  char *err, size_t errlen);

#endif
