/* The flags buffer of a ranged run: header, bitmap and side entries (ranged_flags.h). */
#include "backends/cpu/ranged_flags.h"

#include <assert.h>
#include <string.h>

#include "models/dtype.h"

_Static_assert(sizeof(mt_ranged_header) == 24, "the header's size is part of the buffer's byte count (runtime/plan.c)");
_Static_assert(sizeof(mt_ranged_side_entry) == 20, "a side entry is an index and four floats");

size_t mt_ranged_flags_bytes(int64_t n, int side_room)
{
    assert(side_room >= MT_RANGED_SIDE_ROOM_MIN && side_room <= MT_RANGED_SIDE_ROOM_MAX);
    return sizeof(mt_ranged_header) + (size_t)mt_ranged_words(n) * sizeof(uint64_t) +
           (size_t)(n / side_room + 16) * sizeof(mt_ranged_side_entry);
}

void mt_ranged_flags_begin(void *flags, int64_t n, int side_room, float cl, float ch, bool skipped)
{
    assert(side_room >= MT_RANGED_SIDE_ROOM_MIN && side_room <= MT_RANGED_SIDE_ROOM_MAX);
    mt_ranged_header *hd = (mt_ranged_header *)flags;
    *hd = (mt_ranged_header){ .cl = cl, .ch = ch, .skipped = skipped, .side_room = (uint8_t)side_room, .full = 1,
                              .nside = 0, .n = n };
    if (!skipped) memset(mt_ranged_bits(hd), 0, (size_t)mt_ranged_words(n) * sizeof(uint64_t));
}

void mt_ranged_flags_reset(void *flags, int64_t n, int side_room) { mt_ranged_flags_begin(flags, n, side_room, 0, 0, false); }

void mt_ranged_flags_append(mt_ranged_header *hd, int64_t e, int64_t len, int64_t flagged, const float *master,
                            const float *grad, const float *m, const float *v)
{
    const int64_t cap = mt_ranged_side_capacity(hd);
    int64_t k = hd->nside;
    if (cap - k < flagged) hd->full = 0;
    if (hd->n <= 0 || k >= cap || len <= 0) return;
    const uint64_t *bits = mt_ranged_bits(hd);
    mt_ranged_side_entry *se = mt_ranged_side(hd);
    for (int64_t wi = e / 64; wi <= (e + len - 1) / 64 && k < cap; wi++) {
        const int64_t base = wi * 64;
        uint64_t word = bits[wi];
        if (base < e) word &= ~(uint64_t)0 << (e - base);
        if (e + len - base < 64) word &= ((uint64_t)1 << (e + len - base)) - 1;
        for (; word && k < cap; word &= word - 1) {
            const int64_t i = base + __builtin_ctzll(word);
            se[k++] = (mt_ranged_side_entry){ (uint32_t)i, master[i], grad[i], m[i], v[i] };
        }
    }
    hd->nside = (int32_t)k;
}

void mt_ranged_flags_mark(void *flags, int64_t o, int64_t n)
{
    mt_ranged_header *hd = (mt_ranged_header *)flags;
    hd->stale = 1;
    /* the side entries of [o, o + n) go stale: the first at or after o by bisection, then on */
    mt_ranged_side_entry *se = mt_ranged_side(hd);
    int64_t a = 0, b = hd->nside;
    while (a < b) {
        const int64_t mid = (a + b) / 2;
        if ((int64_t)(se[mid].idx & ~MT_RANGED_SIDE_STALE) < o) a = mid + 1;
        else b = mid;
    }
    for (; a < hd->nside && (int64_t)(se[a].idx & ~MT_RANGED_SIDE_STALE) < o + n; a++) se[a].idx |= MT_RANGED_SIDE_STALE;
    uint64_t *bits = mt_ranged_bits(hd);
    for (int64_t i = o; i < o + n;) {
        if (i % 64 == 0 && o + n - i >= 64) {
            bits[i / 64] = ~(uint64_t)0;
            i += 64;
        } else {
            bits[i / 64] |= (uint64_t)1 << (i % 64);
            i++;
        }
    }
}

MT_CPU_CLONES int64_t mt_ranged_or_ints(int64_t pos, int64_t n, const int32_t *restrict may, uint64_t *restrict bits)
{
    int64_t count = 0;
    for (int64_t i = 0; i < n;) {
        const int64_t b0 = pos % 64, take = 64 - b0 < n - i ? 64 - b0 : n - i;
        uint64_t word = 0;
        for (int64_t k = 0; k < take; k++) word |= (uint64_t)(may[i + k] & 1) << (b0 + k);
        bits[pos / 64] |= word;
        count += __builtin_popcountll(word);
        i += take;
        pos += take;
    }
    return count;
}

/* Eight bytes at a time where aligned. The bits past a chunk's last element are 0 in flagb (the
 * passes build the last byte from its elements only). */
int64_t mt_ranged_or_bytes(int64_t b, int64_t nb, const uint8_t *flagb, uint64_t *bits)
{
    uint8_t *bytes = (uint8_t *)bits;
    int64_t count = 0, j = 0;
    for (; j < nb && (b + j) % 8; j++) {
        bytes[b + j] |= flagb[j];
        count += __builtin_popcount(flagb[j]);
    }
    for (; j + 8 <= nb; j += 8) {
        uint64_t word;
        memcpy(&word, flagb + j, sizeof word);
        if (!word) continue;
        bits[(b + j) / 8] |= word;
        count += __builtin_popcountll(word);
    }
    for (; j < nb; j++) {
        bytes[b + j] |= flagb[j];
        count += __builtin_popcount(flagb[j]);
    }
    return count;
}
