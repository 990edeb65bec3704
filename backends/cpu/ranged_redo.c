/* The redo after a ranged pass (ranged.h, mt_cpu_ranged_redo): the weights half of the flagged
 * elements at the scale the norm gave. Words with many set bits are redone whole (contiguous,
 * vectorised); the few bits of the others go through the same kernel on contiguous arrays (each
 * element's result depends on its own inputs only, so it gives the same bits), their inputs taken
 * from the side entries where one is (ranged_flags.h), else gathered from the arrays, the results
 * scattered back. */
#include "backends/cpu/ranged.h"

enum { GATHER = 1024, DENSE = 16 };

/* The weights half of k elements whose inputs were gathered into gp, gg, gm and gv, scattered
 * back to w at idx (bf16 streamed weights). */
static void redo_gathered(int k, const int64_t *idx, const float *gp, const float *gg, const float *gm,
                          const float *gv, mt_bf16 *w, const mt_adamw_params *p)
{
    float out[GATHER];
    mt_bf16 ob[GATHER];
    mt_cpu_adamw_params_f32(k, gp, gg, gm, gv, out, p);
    mt_f32_to_bf16(k, out, ob);
    for (int j = 0; j < k; j++) w[idx[j]] = ob[j];
}

/* Its AVX2 clone has popcnt as an instruction. */
MT_CPU_CLONES static void redo_flagged(int64_t n, const mt_ranged_header *hd, const float *master, const float *grad,
                                       const float *m, const float *v, mt_bf16 *w, const mt_adamw_params *p,
                                       mt_ranged_redo_counts *counts)
{
    const uint64_t *bits = mt_ranged_bits_of(hd);
    const mt_ranged_side_entry *se = mt_ranged_side(hd);
    const int64_t ns = hd->nside;
    int64_t idx[GATHER], j = 0;
    float gp[GATHER], gg[GATHER], gm[GATHER], gv[GATHER];
    int k = 0;
    int64_t start = 0; /* the bitmap walk's first element */
    if (!hd->stale) {
        /* The side entries first, in element order: they hold every flagged element up to the
         * last one's (mt_ranged_flags_append fills them in order until they run out), so no walk
         * of the bitmap there, no search for each element's entry, no dense words. */
        for (int64_t a = 0; a < ns; a += GATHER) {
            const int kk = ns - a < GATHER ? (int)(ns - a) : GATHER;
            for (int q = 0; q < kk; q++) {
                const mt_ranged_side_entry *e = &se[a + q];
                idx[q] = e->idx;
                __builtin_prefetch(&w[e->idx], 1); /* as below */
                gp[q] = e->master; gg[q] = e->grad; gm[q] = e->m; gv[q] = e->v;
            }
            redo_gathered(kk, idx, gp, gg, gm, gv, w, p);
        }
        counts->side += ns;
        if (hd->full) return;
        /* the rest, past the last entry, from the arrays */
        start = ns ? (int64_t)se[ns - 1].idx + 1 : 0;
        j = ns;
    }
    int64_t from_side = 0, from_arrays = 0;
    for (int64_t o = start / 64 * 64; o < n; o += 64) {
        uint64_t word = bits[o / 64];
        if (o < start) word &= ~(uint64_t)0 << (start - o);
        if (!word) continue;
        if (__builtin_popcountll(word) >= DENSE) {
            mt_cpu_adamw_weights(o, n - o < 64 ? n - o : 64, master, grad, m, v, w, MT_DTYPE_BF16, p);
            from_arrays += __builtin_popcountll(word);
            continue;
        }
        for (; word; word &= word - 1) {
            const int64_t i = o + __builtin_ctzll(word);
            while (j < ns && (int64_t)(se[j].idx & ~MT_RANGED_SIDE_STALE) < i) j++;
            if (j < ns && se[j].idx == (uint32_t)i) {
                gp[k] = se[j].master; gg[k] = se[j].grad; gm[k] = se[j].m; gv[k] = se[j].v;
                from_side++;
            } else {
                gp[k] = master[i]; gg[k] = grad[i]; gm[k] = m[i]; gv[k] = v[i];
                from_arrays++;
            }
            /* the line the scatter will write, so that its read overlaps the batch's listing: the
             * flagged elements' lines are far apart, and waiting for each in turn would stall the
             * redo on every one */
            __builtin_prefetch(&w[i], 1);
            idx[k++] = i;
            if (k == GATHER) {
                redo_gathered(k, idx, gp, gg, gm, gv, w, p);
                k = 0;
            }
        }
    }
    if (k) redo_gathered(k, idx, gp, gg, gm, gv, w, p);
    counts->side += from_side;
    counts->arrays += from_arrays;
}

void mt_cpu_ranged_redo(int64_t n, const void *flags, const float *master, const float *grad, const float *m,
                        const float *v, mt_bf16 *w, const mt_adamw_params *p, mt_ranged_redo_counts *counts)
{
    mt_ranged_redo_counts local = { 0 };
    redo_flagged(n, (const mt_ranged_header *)flags, master, grad, m, v, w, p, &local);
    if (counts) {
        counts->side += local.side;
        counts->arrays += local.arrays;
    }
}
