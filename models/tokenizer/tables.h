/* The tokenizer's containers: growable byte, id and offset buffers, and the two open-addressing
 * maps (byte strings -> id, merge pair -> rank), with the UTF-8 scan that loading and encoding
 * share. Internal to models/tokenizer/. The lookups and appends are inline: encoding calls them
 * for every word and symbol. They abort on out-of-memory (mt_xrealloc), as encode promises. */
#ifndef MT_MODELS_TOKENIZER_TABLES_H
#define MT_MODELS_TOKENIZER_TABLES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "models/util.h"

/* ---- growable buffers ---- */

typedef struct { char *p; size_t len, cap; } byte_buf;
typedef struct { int32_t *p; size_t len, cap; } id_buf;
typedef struct { size_t *p; size_t len, cap; } off_buf;

static inline void bytes_append(byte_buf *b, const char *s, size_t n)
{
    if (b->len + n + 1 > b->cap) {
        b->cap = (b->len + n + 1) * 2;
        b->p = mt_xrealloc(b->p, b->cap);
    }
    if (n) memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0; /* decode hands out NUL-terminated text */
}

static inline void ids_append(id_buf *b, const int32_t *ids, size_t n)
{
    if (b->len + n > b->cap) {
        b->cap = (b->len + n) * 2 + 16;
        b->p = mt_xrealloc(b->p, b->cap * sizeof *b->p);
    }
    if (n) memcpy(b->p + b->len, ids, n * sizeof *ids);
    b->len += n;
}

static inline void offs_append(off_buf *b, size_t v)
{
    if (b->len + 1 > b->cap) {
        b->cap = b->cap * 2 + 16;
        b->p = mt_xrealloc(b->p, b->cap * sizeof *b->p);
    }
    b->p[b->len++] = v;
}

/* ---- hash maps ---- */

static inline uint64_t hash_bytes(const char *s, size_t n) { return mt_fnv1a64(MT_FNV1A64_START, s, n); }

static inline uint64_t hash_u64(uint64_t x)
{
    x ^= x >> 33; /* splitmix64 finaliser: pair keys differ in few bits */
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
}

/* Byte-string keys stored as offsets into a pool the caller owns (the pool may move when it
 * grows, so slots never hold pointers). key_len UINT32_MAX marks an empty slot. */
typedef struct { uint64_t hash; uint32_t key_off, key_len; int32_t value, aux; } str_slot;
typedef struct { str_slot *slots; size_t cap, used; } str_map;

/* Room for about `expected` keys, all slots empty. */
void mt_tok_str_map_init(str_map *m, size_t expected);

static inline str_slot *str_map_find(const str_map *m, const char *pool, const char *key, size_t n)
{
    uint64_t h = hash_bytes(key, n);
    for (size_t i = h & (m->cap - 1);; i = (i + 1) & (m->cap - 1)) {
        str_slot *s = &m->slots[i];
        if (s->key_len == UINT32_MAX) return NULL;
        if (s->hash == h && s->key_len == n && memcmp(pool + s->key_off, key, n) == 0) return s;
    }
}

/* Inserts a key already stored in pool at key_off; the caller has checked it is absent. */
void mt_tok_str_map_insert(str_map *m, const char *pool, uint32_t key_off, uint32_t key_len, int32_t value,
                           int32_t aux);

/* Empties the map, keeping its slots. */
void mt_tok_str_map_clear(str_map *m);

/* Merge table: (left id, right id) -> (rank, merged id); rank -1 marks an empty slot. */
typedef struct { uint64_t key; int32_t rank, merged; } pair_slot;
typedef struct { pair_slot *slots; size_t cap; } pair_map;

static inline uint64_t pair_key(int32_t left, int32_t right) { return (uint64_t)(uint32_t)left << 32 | (uint32_t)right; }

static inline const pair_slot *pair_find(const pair_map *m, uint64_t key)
{
    for (size_t i = hash_u64(key) & (m->cap - 1);; i = (i + 1) & (m->cap - 1)) {
        const pair_slot *s = &m->slots[i];
        if (s->rank < 0) return NULL;
        if (s->key == key) return s;
    }
}

/* ---- UTF-8 ---- */

/* Length of the well-formed UTF-8 sequence at s (Unicode table 3-7: no overlongs, surrogates or
 * code points past U+10FFFF), or 0 if s does not start one. n > 0 bytes are readable. */
static inline int utf8_len(const uint8_t *s, size_t n)
{
    uint8_t c = s[0];
    if (c < 0x80) return 1;
    if (c < 0xC2 || c > 0xF4) return 0;
    int len = c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    if ((size_t)len > n) return 0;
    uint8_t lo = 0x80, hi = 0xBF;
    if (c == 0xE0) lo = 0xA0;
    else if (c == 0xED) hi = 0x9F;
    else if (c == 0xF0) lo = 0x90;
    else if (c == 0xF4) hi = 0x8F;
    if (s[1] < lo || s[1] > hi) return 0;
    for (int i = 2; i < len; i++)
        if (s[i] < 0x80 || s[i] > 0xBF) return 0;
    return len;
}

#endif
