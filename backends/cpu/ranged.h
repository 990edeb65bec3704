/* The kernels of ranged clip speculation (docs/design.md): AdamW's weights half for a range of
 * clip scales, pure functions over a chunk's buffers.
 *
 * The streamed bf16 weight of an element depends on the clip scale c only through one rounding
 * of the fp32 result. A ranged pass bounds that result over every c in [grad_scale_lo,
 * grad_scale] (mt_adamw_params), writes the bf16 weight of every element whose bounds round to
 * the same value (it is the kernel's at any scale in the range) and flags the others in its
 * flags buffer (ranged_flags.h). Once the norm is known, the redo writes the flagged elements'
 * weights at the real scale. Each element's flag depends on its own inputs only, so a chunk may
 * be passed in pieces, in element order. */
#ifndef MT_BACKENDS_CPU_RANGED_H
#define MT_BACKENDS_CPU_RANGED_H

#include <stdint.h>

#include "backends/cpu/adamw.h"
#include "backends/cpu/ranged_flags.h"
#include "models/dtype.h"

/* How a pass bounds the weights: AVX2 on x86-64 CPUs with AVX2 and FMA, 8 lanes, approximate
 * reciprocals refined by a Newton step; AVX512, the default, the same in 16 lanes where the CPU
 * has AVX-512 F, VL, DQ and BW (else as AVX2); EXACT divides, in plain C, as on other CPUs
 * (where the others fall back to it). All three flag soundly, not quite alike. */
typedef enum mt_ranged_bounds { MT_RANGED_BOUNDS_AVX2, MT_RANGED_BOUNDS_AVX512, MT_RANGED_BOUNDS_EXACT } mt_ranged_bounds;
#define MT_RANGED_BOUNDS_DEFAULT MT_RANGED_BOUNDS_AVX512

/* The bounds a pass asked for b runs on this CPU (b, less what the CPU lacks). */
mt_ranged_bounds mt_ranged_bounds_used(mt_ranged_bounds b);
/* b's name as options spell it: avx2, avx512, exact. */
const char *mt_ranged_bounds_option(mt_ranged_bounds b);
/* What a pass asked for b runs on this CPU, in words ("AVX-512 approximate-reciprocal"). */
const char *mt_ranged_bounds_name(mt_ranged_bounds b);

/* A ranged pass over elements [o, o + n) of a chunk (every pointer at the chunk's start; flags
 * begun for the chunk, mt_ranged_flags_begin): the flags of those elements and the streamed
 * weights of the unflagged ones; master, grad, m and v are only read. p's range: [grad_scale_lo,
 * grad_scale]. Returns how many it flagged. */
int64_t mt_cpu_ranged_pass(int64_t o, int64_t n, const float *master, const float *grad, const float *m,
                           const float *v, void *weights, mt_dtype dtype, const mt_adamw_params *p,
                           mt_ranged_bounds bounds, void *flags);

/* A deferred update's pass over elements [o, o + n) of a chunk: the last step's moments half
 * (master, m and v in place from its gradient `old`, po with its scale: the kernel's operations
 * on the same values as mt_cpu_adamw_f32, so the same bits), then this step's ranged pass on the
 * new values (grad, p with the range) into weights and flags; flags NULL: the moments half only.
 * One pass over master, m and v instead of two. With the vector bounds both run in one loop, 8
 * or 16 elements at a time; with the exact ones block by block, each block still in cache for
 * the second. Returns how many it flagged (0 without flags). */
int64_t mt_cpu_ranged_pass_deferred(int64_t o, int64_t n, float *master, const float *old, const float *grad,
                                    float *m, float *v, void *weights, mt_dtype dtype, const mt_adamw_params *po,
                                    const mt_adamw_params *p, mt_ranged_bounds bounds, void *flags);

/* Where the redo took its flagged elements' inputs from. */
typedef struct mt_ranged_redo_counts {
    int64_t side;          /* side entries */
    int64_t arrays;        /* master, grad, m and v (past the room for entries, stale entries,
                            * words with many flags redone whole) */
} mt_ranged_redo_counts;

/* The redo of a chunk of n elements after its ranged pass, the scale inside the range: the
 * weights half (p, with the scale) of the flagged elements into the bf16 streamed weights w, bit
 * for bit the kernel's. Adds where it read the inputs from to *counts (may be NULL). */
void mt_cpu_ranged_redo(int64_t n, const void *flags, const float *master, const float *grad, const float *m,
                        const float *v, mt_bf16 *w, const mt_adamw_params *p, mt_ranged_redo_counts *counts);

#endif
