/* The maps of tables.h that are not on the encoder's hot path: creating, growing, clearing. */
#include "models/tokenizer/tables.h"

#include <stdlib.h>

void mt_tok_str_map_init(str_map *m, size_t expected)
{
    size_t cap = 64;
    while (cap < expected * 2) cap *= 2;
    m->slots = mt_xmalloc(cap * sizeof *m->slots);
    for (size_t i = 0; i < cap; i++) m->slots[i].key_len = UINT32_MAX;
    m->cap = cap;
    m->used = 0;
}

void mt_tok_str_map_insert(str_map *m, const char *pool, uint32_t key_off, uint32_t key_len, int32_t value,
                           int32_t aux)
{
    if ((m->used + 1) * 2 > m->cap) {
        str_map old = *m;
        mt_tok_str_map_init(m, old.cap);
        for (size_t i = 0; i < old.cap; i++)
            if (old.slots[i].key_len != UINT32_MAX)
                mt_tok_str_map_insert(m, pool, old.slots[i].key_off, old.slots[i].key_len, old.slots[i].value,
                                      old.slots[i].aux);
        free(old.slots);
    }
    uint64_t h = hash_bytes(pool + key_off, key_len);
    size_t i = h & (m->cap - 1);
    while (m->slots[i].key_len != UINT32_MAX) i = (i + 1) & (m->cap - 1);
    m->slots[i] = (str_slot){h, key_off, key_len, value, aux};
    m->used++;
}

void mt_tok_str_map_clear(str_map *m)
{
    for (size_t i = 0; i < m->cap; i++) m->slots[i].key_len = UINT32_MAX;
    m->used = 0;
}
