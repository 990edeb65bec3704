/* Small helpers every part of megatrain uses: a monotonic clock, FNV-1a hashing, allocation that
 * aborts, whole-file reading and the gradient-clipping scale. They live in models/, the one
 * folder every other folder may include (tools -> runtime -> codelets -> backends; models are
 * used by all), because the tokenizer hashes and codelets read the clock and the clip scale.
 * Nothing here keeps state. */
#ifndef MT_MODELS_UTIL_H
#define MT_MODELS_UTIL_H

#include <stddef.h>
#include <stdint.h>

/* ---- clock ---- */

/* CLOCK_MONOTONIC, in seconds and in nanoseconds: for durations, never for dates. */
double mt_clock_s(void);
int64_t mt_clock_ns(void);

/* ---- hashing ---- */

#define MT_FNV1A64_START 0xcbf29ce484222325ULL

/* FNV-1a 64 over n bytes of data, continuing from h (MT_FNV1A64_START for a fresh hash), so a
 * hash over several buffers is mt_fnv1a64(mt_fnv1a64(MT_FNV1A64_START, a, na), b, nb). Inline:
 * the tokenizer's maps hash every word they look up. */
static inline uint64_t mt_fnv1a64(uint64_t h, const void *data, size_t n)
{
    const uint8_t *p = (const uint8_t *)data;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ULL;
    return h;
}

/* ---- allocation ---- */

/* malloc and realloc that abort with a message naming the size when memory runs out: for code
 * that holds whole inputs in memory and has no partial state worth keeping (the tokenizer, data
 * preparation, tests). Size 0 allocates 1 byte, so the result is never NULL. */
void *mt_xmalloc(size_t n);
void *mt_xcalloc(size_t count, size_t size); /* zeroed */
void *mt_xrealloc(void *p, size_t n);

/* ---- files ---- */

/* The whole file at path, malloc'd with a NUL after its last byte (the caller frees it); *len gets
 * its length without the NUL. NULL with err naming the path and the problem (cannot open, read
 * failed, out of memory). */
char *mt_read_file(const char *path, size_t *len, char *err, size_t errlen);

/* ---- gradient clipping ---- */

/* The factor every gradient is scaled by for a global norm `norm` and bound `max_norm`, as
 * torch.nn.utils.clip_grad_norm_ computes it: max_norm / (norm + 1e-6), at most 1. */
double mt_clip_scale(double max_norm, double norm);

#endif
