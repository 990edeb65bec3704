/* The flags buffer of a ranged run (ranged clip speculation, docs/design.md): what a ranged pass
 * over one AdamW chunk leaves for the redo after the norm. Written by the passes (ranged.h), read
 * by the redo; both use the helpers here and nothing else of the layout.
 *
 * Layout, for a chunk of n elements:
 *   the header (mt_ranged_header, 24 bytes): the range of clip scales the pass checked;
 *   the bitmap: ceil(n / 64) words, bit i set when element i's bf16 weight could differ within
 *     the range (the redo writes it);
 *   the side entries: the inputs of the first flagged elements, in element order, copied while
 *     the pass had them in cache, so that the redo reads those few bytes instead of gathering
 *     each flagged element from master, m, v and the gradient (cache lines far apart). Room for
 *     n / side_room + 16 of them; the flagged elements past the room are read from the arrays.
 * An entry whose element's gradient changed after the pass (mt_ranged_flags_mark: the table's
 * rows the step's tokens touch) is marked stale and not used. */
#ifndef MT_BACKENDS_CPU_RANGED_FLAGS_H
#define MT_BACKENDS_CPU_RANGED_FLAGS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Room for the side entries of 1/16 of a chunk's elements by default: a redo then takes most
 * flagged elements' inputs from the entries at the flag rates ranged runs see (docs/benchmarks.md
 * has the measurements of other rooms). Any room from MT_RANGED_SIDE_ROOM_MIN to _MAX works. */
#define MT_RANGED_SIDE_ROOM_DEFAULT 16
#define MT_RANGED_SIDE_ROOM_MIN 2
#define MT_RANGED_SIDE_ROOM_MAX 64

typedef struct mt_ranged_header {
    float cl, ch;          /* the scales (gradient multipliers, as the kernel forms them) checked */
    int8_t skipped;        /* the range was too wide: nothing written, the confirm redoes all */
    uint8_t side_room;     /* the buffer has room for side entries of 1/side_room of the chunk */
    int8_t full;           /* every flagged element got a side entry */
    int8_t stale;          /* mt_ranged_flags_mark ran: some entries may be stale */
    int32_t nside;         /* side entries written */
    int64_t n;             /* the chunk's elements */
} mt_ranged_header;

typedef struct mt_ranged_side_entry {
    uint32_t idx;          /* the element; MT_RANGED_SIDE_STALE set: not to be used */
    float master, grad, m, v;
} mt_ranged_side_entry;

#define MT_RANGED_SIDE_STALE 0x80000000u

/* Bytes of the flags buffer of a chunk of n elements with room for 1/side_room of them. */
size_t mt_ranged_flags_bytes(int64_t n, int side_room);

/* Starts a flags buffer for a chunk of n elements: the header (the range [cl, ch], skipped, no
 * side entry yet) and, unless skipped, a cleared bitmap. Everything a pass or the redo reads
 * afterwards is written by this call or by the pass, so the buffer's old contents never matter. */
void mt_ranged_flags_begin(void *flags, int64_t n, int side_room, float cl, float ch, bool skipped);
/* mt_ranged_flags_begin with no range: for callers that run passes with a range of their own. */
void mt_ranged_flags_reset(void *flags, int64_t n, int side_room);

static inline int64_t mt_ranged_words(int64_t n) { return (n + 63) / 64; }
static inline uint64_t *mt_ranged_bits(mt_ranged_header *hd) { return (uint64_t *)(hd + 1); }
static inline const uint64_t *mt_ranged_bits_of(const void *flags)
{
    return (const uint64_t *)((const mt_ranged_header *)flags + 1);
}
static inline mt_ranged_side_entry *mt_ranged_side(const mt_ranged_header *hd)
{
    return (mt_ranged_side_entry *)((uint64_t *)(hd + 1) + mt_ranged_words(hd->n));
}
static inline int64_t mt_ranged_side_capacity(const mt_ranged_header *hd) { return hd->n / hd->side_room + 16; }

/* Side entries for the bits set in [e, e + len) of the bitmap, `flagged` of them, while there is
 * room; called in element order (the redo relies on the entries being sorted). When some get
 * none, the header is no longer full. */
void mt_ranged_flags_append(mt_ranged_header *hd, int64_t e, int64_t len, int64_t flagged, const float *master,
                            const float *grad, const float *m, const float *v);

/* Flags elements [o, o + n) whatever the pass decided (their gradient changes after the pass:
 * the redo recomputes them) and marks their side entries stale. */
void mt_ranged_flags_mark(void *flags, int64_t o, int64_t n);

/* bits |= may[0..n) at bit positions pos.. (may[i] 0 or 1); returns how many were set in may. */
int64_t mt_ranged_or_ints(int64_t pos, int64_t n, const int32_t *may, uint64_t *bits);
/* The bitmap's bytes from byte b on |= flagb[0..nb) (bit j of byte k: element 8k + j, the
 * bitmap's own layout on a little-endian CPU); returns how many bits flagb had set. */
int64_t mt_ranged_or_bytes(int64_t b, int64_t nb, const uint8_t *flagb, uint64_t *bits);

#endif
