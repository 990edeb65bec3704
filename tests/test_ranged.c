/* Check suite of ranged clip speculation's CPU side: the soundness of the flags
 * (backends/cpu/ranged.h) for every kind of bounds, the confirm's redo bit for bit, the flags
 * buffer's side room, the deferred pass fused and in pieces, passes over pieces of a chunk, and
 * the norm history's check, spread growth and memory (runtime/speculate/history.h). */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cpu/ops.h"
#include "backends/cpu/ranged.h"
#include "codelets/adamw.h"
#include "runtime/speculate/history.h"
#include "tests/testutil.h"

static const mt_adamw_params adam_base = {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
                                          .weight_decay = 0.1, .grad_scale = 0.37};

/* The confirm's redo (mt_cpu_ranged_redo) after a ranged pass gives, for a scale inside the
 * range, every element's weight bit for bit as the kernel at that scale: the flagged ones from
 * the side entries the pass kept (and, past their room, from the arrays), the rest as the pass
 * left them. Then as the table's embedding backward does: a range of elements gets a changed
 * gradient and mt_ranged_flags_mark; their side entries must not be used. Flag rates of ~2%
 * (entries for all) and ~20% (room for some only), flags buffers with room for 1/side_room of
 * the chunk. */
static void ranged_redo_check(int side_room)
{
    enum { N = 100003 };
    const int64_t room = N / side_room + 16; /* backends/cpu/ranged_flags.h, mt_ranged_side_capacity */
    const size_t fb = sizeof(float) * N;
    float *p = malloc(fb), *g = malloc(fb), *m = malloc(fb), *v = malloc(fb), *out = malloc(fb);
    mt_bf16 *w = malloc(sizeof(mt_bf16) * N), *wk = malloc(sizeof(mt_bf16) * N);
    void *flags = malloc(mt_ranged_flags_bytes(N, side_room));
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 43);
    const double lrs[2] = { 3e-4, 1e-2 };
    for (int l = 0; l < 2; l++) {
        for (int i = 0; i < N; i++) {
            p[i] = (float)(0.01 * (mt_test_uniform(&rng) - 0.5));
            g[i] = (float)(2e-3 * (mt_test_uniform(&rng) - 0.5));
            m[i] = (float)(1e-3 * (mt_test_uniform(&rng) - 0.5));
            v[i] = (float)(1e-6 * (0.1 + mt_test_uniform(&rng)));
        }
        mt_adamw_params a = adam_base;
        a.lr = lrs[l];
        a.step = 10;
        a.grad_scale = 0.26;
        a.grad_scale_lo = 0.24;
        mt_ranged_flags_reset(flags, N, side_room);
        int64_t flagged = 0;
        for (int64_t o = 0; o < N; o += 5000) /* in pieces, as the table's rows are */
            flagged += mt_cpu_ranged_pass(o, N - o < 5000 ? N - o : 5000, p, g, m, v, w, MT_DTYPE_BF16, &a,
                                          MT_RANGED_BOUNDS_DEFAULT, flags);
        for (int pass = 0; pass < 2; pass++) {
            if (pass == 1) {
                /* the table's touched rows: a new gradient, flagged whole, entries stale */
                for (int i = 30011; i < 30011 + 4099; i++) g[i] += (float)(1e-3 * (mt_test_uniform(&rng) - 0.5));
                mt_ranged_flags_mark(flags, 30011, 4099);
                /* and single flagged elements (their words stay sparse, so their entries would be
                 * read if not stale) */
                const uint64_t *bits = mt_ranged_bits_of(flags);
                int changed = 0;
                for (int i = 40000; i < N && changed < 300; i++)
                    if ((bits[i / 64] >> (i % 64)) & 1 && __builtin_popcountll(bits[i / 64]) < 8) {
                        g[i] = -2.0f * g[i] + 1e-4f;
                        mt_ranged_flags_mark(flags, i, 1);
                        changed++;
                    }
                ck_assert_int_gt(changed, 0);
            }
            mt_adamw_params at = a;
            at.grad_scale = 0.2537;
            at.grad_scale_lo = 0;
            mt_bf16 *wr = malloc(sizeof(mt_bf16) * N);
            memcpy(wr, w, sizeof(mt_bf16) * N);
            mt_ranged_redo_counts rc = { 0 };
            mt_cpu_ranged_redo(N, flags, p, g, m, v, wr, &at, &rc);
            if (pass == 0) {
                /* as passed: every flagged element from its side entry while they have room (at
                 * 1/16: all at lr 3e-4, 2% flagged; at lr 1e-2, 27%, the rest from the arrays) */
                ck_assert_int_eq(rc.side + rc.arrays, flagged);
                if (flagged <= room) ck_assert_int_eq(rc.arrays, 0);
                else ck_assert_int_gt(rc.arrays, 0);
                if (side_room == 16) ck_assert(l == 0 ? flagged <= room : flagged > room);
            }
            mt_cpu_adamw_params_f32(N, p, g, m, v, out, &at);
            mt_f32_to_bf16(N, out, wk);
            int bad = -1;
            for (int i = 0; i < N && bad < 0; i++)
                if (wr[i] != wk[i]) bad = i;
            free(wr);
            ck_assert_msg(bad < 0, "lr %g, %s: element %d after the redo differs from the kernel at the scale", lrs[l],
                          pass ? "rows changed" : "as passed", bad);
        }
        printf("ranged redo, lr %g: %.2f%% flagged\n", lrs[l], 100.0 * (double)flagged / N);
        ck_assert(flagged > 0 && flagged < N);
    }
    free(p); free(g); free(m); free(v); free(out); free(w); free(wk); free(flags);
}

START_TEST(test_ranged_redo_exact) { ranged_redo_check(MT_RANGED_SIDE_ROOM_DEFAULT); }
END_TEST

/* A side room of 3 (mt_step_config.ranged_side_room): flags buffers sized for 1/3 of a chunk,
 * and the redo at 27% flagged then takes every input from the side entries, bit for bit as
 * before. */
START_TEST(test_ranged_side_room)
{
    const int64_t n = 100003, words = (n + 63) / 64;
    ck_assert_uint_eq(mt_ranged_flags_bytes(n, 3), 24 + 8 * words + 20 * (n / 3 + 16));
    ranged_redo_check(3);
}
END_TEST

/* The deferred pass (mt_cpu_ranged_pass_deferred: the last step's moments half and this step's
 * ranged run, fused into one loop where the bounds are AVX2's or AVX-512's) against the two
 * apart (mt_cpu_adamw_f32, then mt_cpu_ranged_pass), for each kind of bounds: master, m
 * and v bit for bit, the same flags, the same weights for the unflagged elements. A length that
 * is not a multiple of 16, so the loops' tails run too. */
START_TEST(test_ranged_deferred_fused)
{
    enum { N = 50021 };
    const size_t fb = sizeof(float) * N;
    float *p0 = malloc(fb), *g = malloc(fb), *old = malloc(fb), *m0 = malloc(fb), *v0 = malloc(fb);
    float *p = malloc(fb), *m = malloc(fb), *v = malloc(fb), *pr = malloc(fb), *mr = malloc(fb), *vr = malloc(fb);
    mt_bf16 *w = malloc(sizeof(mt_bf16) * N), *wr = malloc(sizeof(mt_bf16) * N);
    const size_t flag_bytes = mt_ranged_flags_bytes(N, MT_RANGED_SIDE_ROOM_DEFAULT);
    void *flags = malloc(flag_bytes), *fref = malloc(flag_bytes);
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 47);
    for (int i = 0; i < N; i++) {
        p0[i] = (float)(0.01 * (mt_test_uniform(&rng) - 0.5));
        g[i] = (float)(2e-3 * (mt_test_uniform(&rng) - 0.5));
        old[i] = (float)(2e-3 * (mt_test_uniform(&rng) - 0.5));
        m0[i] = (float)(1e-3 * (mt_test_uniform(&rng) - 0.5));
        v0[i] = (float)(1e-6 * (0.1 + mt_test_uniform(&rng)));
    }
    old[17] = 0.0f; /* a zero gradient and a zero moment: sqrt(0) in the moments half */
    v0[17] = 0.0f;
    mt_adamw_params a = adam_base, po = adam_base;
    a.lr = 1e-3;
    a.step = 11;
    a.grad_scale = 0.26;
    a.grad_scale_lo = 0.24;
    po.lr = 1e-3;
    po.step = 10;
    po.grad_scale = 0.2513;
    for (int k = 0; k < 3; k++) {
        const mt_ranged_bounds bounds = (mt_ranged_bounds)k;
        memcpy(pr, p0, fb); memcpy(mr, m0, fb); memcpy(vr, v0, fb);
        mt_cpu_adamw_f32(N, pr, old, mr, vr, &po);
        mt_ranged_flags_reset(fref, N, MT_RANGED_SIDE_ROOM_DEFAULT);
        const int64_t nref = mt_cpu_ranged_pass(0, N, pr, g, mr, vr, wr, MT_DTYPE_BF16, &a, bounds, fref);
        memcpy(p, p0, fb); memcpy(m, m0, fb); memcpy(v, v0, fb);
        mt_ranged_flags_reset(flags, N, MT_RANGED_SIDE_ROOM_DEFAULT);
        mt_cpu_ranged_pass_deferred(0, N, p, old, g, m, v, w, MT_DTYPE_BF16, &po, &a, bounds, flags);
        ck_assert_msg(!memcmp(p, pr, fb) && !memcmp(m, mr, fb) && !memcmp(v, vr, fb),
                      "bounds %s: the deferred pass's master, m or v differ from the moments half's",
                      mt_ranged_bounds_option(bounds));
        const uint64_t *bits = mt_ranged_bits_of(flags), *rbits = mt_ranged_bits_of(fref);
        ck_assert_msg(!memcmp(bits, rbits, (N + 63) / 64 * sizeof(uint64_t)), "bounds %s: flags differ",
                      mt_ranged_bounds_option(bounds));
        int bad = -1;
        for (int i = 0; i < N && bad < 0; i++)
            if (!((bits[i / 64] >> (i % 64)) & 1) && w[i] != wr[i]) bad = i;
        ck_assert_msg(bad < 0, "bounds %s: weight %d differs", mt_ranged_bounds_option(bounds), bad);
        ck_assert(nref > 0 && nref < N);
        /* In pieces, as the table's early path runs it row by row: rows of 2048 (the vector
         * loops, the same flags) and of 997 (pieces off the 8-element grid take the exact
         * bounds, which flag fewer); the same master, m and v, and what it returns is what it
         * flagged. */
        const int pieces[2] = { 2048, 997 };
        for (int q = 0; q < 2; q++) {
            memcpy(p, p0, fb); memcpy(m, m0, fb); memcpy(v, v0, fb);
            mt_ranged_flags_reset(flags, N, MT_RANGED_SIDE_ROOM_DEFAULT);
            int64_t nret = 0;
            for (int64_t o = 0; o < N; o += pieces[q])
                nret += mt_cpu_ranged_pass_deferred(o, N - o < pieces[q] ? N - o : pieces[q], p, old, g, m, v, w,
                                                    MT_DTYPE_BF16, &po, &a, bounds, flags);
            ck_assert_msg(!memcmp(p, pr, fb) && !memcmp(m, mr, fb) && !memcmp(v, vr, fb),
                          "bounds %s, pieces of %d: master, m or v differ", mt_ranged_bounds_option(bounds), pieces[q]);
            int64_t set = 0;
            for (int64_t wi = 0; wi < (N + 63) / 64; wi++) set += __builtin_popcountll(bits[wi]);
            ck_assert_int_eq(nret, set);
            if (pieces[q] == 2048) ck_assert(!memcmp(bits, rbits, (N + 63) / 64 * sizeof(uint64_t)));
            for (int i = 0; i < N && bad < 0; i++)
                if (!((bits[i / 64] >> (i % 64)) & 1) && !((rbits[i / 64] >> (i % 64)) & 1) && w[i] != wr[i]) bad = i;
            ck_assert_msg(bad < 0, "bounds %s, pieces of %d: weight %d differs",
                          mt_ranged_bounds_option(bounds), pieces[q], bad);
        }
        /* without flags: the moments half only, on [o, o + n) */
        memcpy(p, p0, fb); memcpy(m, m0, fb); memcpy(v, v0, fb);
        ck_assert_int_eq(mt_cpu_ranged_pass_deferred(0, 1000, p, old, g, m, v, w, MT_DTYPE_BF16, &po, &a, bounds, NULL), 0);
        ck_assert_int_eq(mt_cpu_ranged_pass_deferred(1000, N - 1000, p, old, g, m, v, w, MT_DTYPE_BF16, &po, &a, bounds, NULL),
                         0);
        ck_assert(!memcmp(p, pr, fb) && !memcmp(m, mr, fb) && !memcmp(v, vr, fb));
    }
    free(p0); free(g); free(old); free(m0); free(v0); free(p); free(m); free(v); free(pr); free(mr); free(vr);
    free(w); free(wr); free(flags); free(fref);
}
END_TEST

/* The norm history's two records (runtime/speculate/history.h) for T tiles, holding no norm. */
static void records_open(void *rec[2], int T, double spread, double grow, int memory)
{
    const mt_norm_settings ns = { .spread = spread, .grow = grow, .memory = memory };
    for (int k = 0; k < 2; k++) {
        rec[k] = malloc(mt_norm_record_bytes(T));
        mt_norm_record_init(rec[k], T, &ns);
    }
}

/* Norm s recorded as the clip task does: from record (s - 1) % 2 into record s % 2, sums (T
 * tiles, then the table's head part), clip 1. */
static void record_norm(void *rec[2], int64_t s, const double *sums, int T)
{
    mt_norm_record(rec[(s - 1) % 2], rec[s % 2], s, 1.0, sums, T, sums[T], NULL);
}

/* A ranged run's arguments as the graph gives them, clip 1. */
static mt_ranged_args ranged_run(int64_t seq, int first_tile, bool check, double max_ratio)
{
    return (mt_ranged_args){ .range = mt_norm_range, .seq = seq, .first_tile = first_tile, .check = check,
                             .clip = 1.0, .max_ratio = max_ratio, .side_room = MT_RANGED_SIDE_ROOM_DEFAULT,
                             .bounds = MT_RANGED_BOUNDS_DEFAULT };
}

/* Ranged speculation's check of its last prediction (mt_norm_record's held, mt_ranged_args.
 * check): a tile whose range, predicted for the last norm from the one before, missed that norm
 * is not speculated at the next (counted as unheld); one whose range held is; with the check
 * off, both are. Four tiles; norm 2 scales every tile alike (every prediction exact), norm 3
 * doubles tile 0 and triples tile 1 (the prediction holds for tiles 0 and 1 only: for tile 1
 * the known tiles doubled, as tile 0 did). */
START_TEST(test_ranged_held)
{
    enum { T = 4, N = 1000 };
    double s1[T + 1] = { 4, 3, 2, 1, 0 }, s2[T + 1], s3[T + 1] = { 12, 13.5, 3, 1.5, 0 };
    for (int j = 0; j <= T; j++) s2[j] = 1.5 * s1[j];
    void *rec[2];
    records_open(rec, T, 1.1, 0, 0);
    const double *norms[3] = { s1, s2, s3 };
    for (int s = 1; s <= 3; s++) {
        record_norm(rec, s, norms[s - 1], T);
        ck_assert_int_eq(mt_norm_record_seq(rec[s % 2]), s);
        const uint8_t *held = mt_norm_record_held(rec[s % 2]);
        for (int f = 0; f < T; f++) {
            const int expect = s < 3 || f <= 1;
            ck_assert_msg(held[f] == expect, "norm %d, tile %d: held %d", s, f, held[f]);
        }
    }
    /* the ranged runs of norm 4: tiles 3 and 1, as when their gradients are in (norm 4 as 3) */
    void *flags = malloc(mt_ranged_flags_bytes(N, MT_RANGED_SIDE_ROOM_DEFAULT));
    mt_adamw_stats stats = { 0 };
    for (int check = 1; check >= 0; check--) {
        for (int f = 3; f >= 1; f -= 2) {
            double known = 0;
            for (int j = f; j < T; j++) known += s3[j];
            const mt_ranged_args a = ranged_run(4, f, check, 1.25);
            mt_adamw_params p = adam_base;
            p.grad_scale = 1;
            const mt_ranged_counts c0 = mt_adamw_stats_ranged(&stats);
            const bool spec = mt_codelet_ranged_begin(flags, N, (const double[2]){ known, 0 }, rec[1], &a, &p, &stats);
            const mt_ranged_counts c1 = mt_adamw_stats_ranged(&stats);
            const bool expect = !check || f == 1;
            ck_assert_msg(spec == expect, "check %d, tile %d: speculated %d", check, f, spec);
            ck_assert_int_eq(c1.unheld - c0.unheld, expect ? 0 : N);
            ck_assert_int_eq(c1.skipped - c0.skipped, expect ? 0 : N);
            ck_assert_int_eq(c1.checked - c0.checked, expect ? N : 0);
        }
    }
    free(flags);
    free(rec[0]);
    free(rec[1]);
}
END_TEST

/* The spread grows after a norm the prediction missed (mt_norm_settings.grow): norm 2's embedding
 * doubled while the layers stayed, so its rest came 2 times off for tile 1 (1.57 and 1.44 for
 * tiles 2 and 3); the runs of norm 3 then take 1.1 x 2 (grow 3), 2 (grow 2, the cap), or 1.1
 * (grow 1: fixed). With 2.2, norm 3 (its embedding 1.8 times norm 2's) holds for tile 1, which
 * it does not with 1.1; a run's range is the prediction's rest over and times 2.2, and is still
 * speculated though 2.07 times wide (max_ratio 1.25 grows with the spread, to 2.5). */
START_TEST(test_ranged_spread_grows)
{
    enum { T = 4, N = 256 };
    const double s1[T + 1] = { 4, 3, 2, 1, 0 }, s2[T + 1] = { 8, 3, 2, 1, 0 }, s3[T + 1] = { 14.4, 3, 2, 1, 0 };
    const double grows[3] = { 3, 2, 1 }, expect_spread[3] = { 2.2, 2, 1.1 };
    void *flags = malloc(mt_ranged_flags_bytes(N, MT_RANGED_SIDE_ROOM_DEFAULT));
    mt_adamw_stats stats = { 0 };
    for (int k = 0; k < 3; k++) {
        void *rec[2];
        records_open(rec, T, 1.1, grows[k], 0);
        record_norm(rec, 1, s1, T);
        ck_assert_double_eq_tol(mt_norm_record_next_spread(rec[1]), 1.1, 1e-12); /* no prediction to judge yet */
        record_norm(rec, 2, s2, T);
        ck_assert_double_eq_tol(mt_norm_record_next_spread(rec[0]), expect_spread[k], 1e-12);
        /* the run of tile 3 for norm 3, its own sum in (its range for norm 2 missed: unchecked) */
        const mt_ranged_args a = ranged_run(3, 3, false, 1.25);
        mt_adamw_params p = adam_base;
        p.grad_scale = 1;
        ck_assert(mt_codelet_ranged_begin(flags, N, (const double[2]){ s3[3], 0 }, rec[0], &a, &p, &stats));
        const double rest = (s2[0] + s2[1] + s2[2]) * (s3[3] / s2[3]), F = expect_spread[k];
        ck_assert_double_eq_tol(p.grad_scale, 1 / (sqrt(s3[3] + rest / F) + 1e-6) * (1 + 1e-6), 1e-12);
        ck_assert_double_eq_tol(p.grad_scale_lo, 1 / (sqrt(s3[3] + rest * F) + 1e-6) * (1 - 1e-6), 1e-12);
        record_norm(rec, 3, s3, T);
        const uint8_t *held = mt_norm_record_held(rec[1]);
        ck_assert_msg(held[1] == (k < 2), "grow %g: tile 1 held %d", grows[k], held[1]);
        free(rec[0]);
        free(rec[1]);
    }
    free(flags);
}
END_TEST

/* The spread remembers the largest error of the last `memory` norms (mt_norm_settings.memory):
 * norm 2's embedding doubled (tile 1's rest 2 times off, as in test_ranged_spread_grows), norms
 * 3, 4 and 5 repeat norm 2 (each prediction exact). The spread after norm 3 is 1.1 x 2 with a
 * memory of 2 or more, back to 1.1 with a memory of 1; after norm 4 still 2.2 with a memory of
 * 3; after norm 5 back to 1.1 with every memory below 4. */
START_TEST(test_ranged_spread_remembers)
{
    enum { T = 4 };
    const double s1[T + 1] = { 4, 3, 2, 1, 0 }, s2[T + 1] = { 8, 3, 2, 1, 0 };
    const int memories[4] = { 1, 2, 3, 0 }; /* 0: as 1 */
    const double after[4][3] = { { 1.1, 1.1, 1.1 }, { 2.2, 1.1, 1.1 }, { 2.2, 2.2, 1.1 }, { 1.1, 1.1, 1.1 } };
    for (int k = 0; k < 4; k++) {
        void *rec[2];
        records_open(rec, T, 1.1, 3, memories[k]);
        record_norm(rec, 1, s1, T);
        record_norm(rec, 2, s2, T);
        ck_assert_double_eq_tol(mt_norm_record_next_spread(rec[0]), 2.2, 1e-12);
        for (int s = 3; s <= 5; s++) {
            record_norm(rec, s, s2, T);
            const double spread = mt_norm_record_next_spread(rec[s % 2]);
            ck_assert_msg(fabs(spread - after[k][s - 3]) < 1e-12, "memory %d, after norm %d: spread %g, not %g",
                          memories[k], s, spread, after[k][s - 3]);
            const uint8_t *held = mt_norm_record_held(rec[s % 2]);
            for (int f = 0; f < T; f++) ck_assert(held[f]); /* exact predictions hold at any spread */
        }
        free(rec[0]);
        free(rec[1]);
    }
}
END_TEST

/* The soundness of ranged speculation's flags (backends/cpu/ranged.h, mt_cpu_ranged_pass), which
 * the exactness of `--clip-speculate ranged` rests on: for every element it leaves unflagged,
 * the weights half's bf16 result is the same for every clip scale in the range. Checked against
 * the kernel itself at 33 scales across the range (both ends, evenly spaced, and random ones), on
 * 2^18 elements of random magnitudes (weights 1e-4..1, gradients 1e-7..1e-1, moments to match,
 * some zero), at three learning rates (few, some and most weights moving across a bf16 step),
 * early and late steps, two ranges. Also that a useful share is left unflagged. */
/* test_ranged_flags_sound's loop 0 checks the AVX2 bounds (approximate reciprocals where the CPU
 * has them), loop 1 the AVX-512 ones (the default where it has them), loop 2 the exact ones
 * (each loop prints which ran). */
START_TEST(test_ranged_flags_sound)
{
    static const mt_ranged_bounds modes[3] = { MT_RANGED_BOUNDS_AVX2, MT_RANGED_BOUNDS_AVX512, MT_RANGED_BOUNDS_EXACT };
    enum { N = 1 << 18, NP = N - 5, SCALES = 33 };
    const mt_ranged_bounds bounds = modes[_i];
    const char *used = mt_ranged_bounds_name(bounds);
    const size_t fb = sizeof(float) * N;
    float *p = malloc(fb), *g = malloc(fb), *m = malloc(fb), *v = malloc(fb), *out = malloc(fb);
    mt_bf16 *w = malloc(sizeof(mt_bf16) * N), *wk = malloc(sizeof(mt_bf16) * N);
    const size_t flag_bytes = mt_ranged_flags_bytes(N, MT_RANGED_SIDE_ROOM_DEFAULT), words = (N + 63) / 64;
    void *flags = malloc(flag_bytes);
    const uint64_t *bits = mt_ranged_bits_of(flags);
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 41);
    for (int i = 0; i < N; i++) {
        p[i] = (float)(mt_test_normal(&rng) * pow(10.0, -4.0 * mt_test_uniform(&rng)));
        const double gs = pow(10.0, -7.0 + 6.0 * mt_test_uniform(&rng));
        g[i] = (float)(mt_test_normal(&rng) * gs);
        m[i] = (float)(mt_test_normal(&rng) * gs * 0.5);
        v[i] = (float)(gs * gs * (0.1 + mt_test_uniform(&rng)));
        if (i % 97 == 0) g[i] = 0;
        if (i % 101 == 0) m[i] = v[i] = 0;
    }
    const double lrs[3] = { 1e-5, 1e-3, 3e-2 }, ranges[3][2] = { { 0.24, 0.26 }, { 0.9, 1.0 }, { 0.2, 0.28 } };
    const int64_t steps[2] = { 1, 40 };
    for (int l = 0; l < 3; l++)
        for (int r = 0; r < 3; r++)
            for (int st = 0; st < 2; st++) {
                mt_adamw_params a = adam_base;
                a.lr = lrs[l];
                a.step = steps[st];
                a.grad_scale = ranges[r][1];
                a.grad_scale_lo = ranges[r][0];
                /* NP elements: the last block ends in 11 past the 16-lane loop (8 of them in 8
                 * lanes, 3 in C), 3 past the 8-lane one */
                mt_ranged_flags_reset(flags, NP, MT_RANGED_SIDE_ROOM_DEFAULT);
                mt_cpu_ranged_pass(0, NP, p, g, m, v, w, MT_DTYPE_BF16, &a, bounds, flags);
                int64_t flagged = 0;
                for (size_t k = 0; k < words; k++) flagged += __builtin_popcountll(bits[k]);
                for (int k = 0; k < SCALES; k++) {
                    const float cl = (float)ranges[r][0], ch = (float)ranges[r][1];
                    float c = k == 0 ? cl : k == 1 ? ch : k < 17 ? cl + (ch - cl) * (float)(k - 1) / 16.0f
                                                              : cl + (ch - cl) * (float)mt_test_uniform(&rng);
                    if (c > ch) c = ch;
                    mt_adamw_params ak = a;
                    ak.grad_scale = c;
                    ak.grad_scale_lo = 0;
                    mt_cpu_adamw_params_f32(N, p, g, m, v, out, &ak);
                    mt_f32_to_bf16(N, out, wk);
                    /* the flagged elements' weights are the redo's to write: nothing is checked of
                     * them here (the vector loops leave whatever their bounds rounded to) */
                    for (int i = 0; i < NP; i++) {
                        if (((bits[i / 64] >> (i % 64)) & 1) || wk[i] == w[i]) continue; /* ck_assert per element is a syscall */
                        ck_assert_msg(false,
                                      "lr %g, range [%g, %g], step %lld: element %d unflagged but its bf16 weight "
                                      "at scale %.9g is 0x%04x, not 0x%04x (p %.9g g %.9g m %.9g v %.9g)",
                                      lrs[l], cl, ch, (long long)a.step, i, (double)c, wk[i], w[i], (double)p[i],
                                      (double)g[i], (double)m[i], (double)v[i]);
                    }
                }
                /* the bound is not trivially "flag everything": at the smallest rate most stay */
                if (l == 0) ck_assert_msg(flagged < N / 4, "lr %g: %lld of %d flagged", lrs[l], (long long)flagged, N);
                printf("ranged flags (%s bounds), lr %g, range [%g, %g], step %lld: %.2f%% flagged\n", used,
                       lrs[l], ranges[r][0], ranges[r][1], (long long)a.step, 100.0 * (double)flagged / N);
            }
    free(p); free(g); free(m); free(v); free(out); free(w); free(wk); free(flags);
}
END_TEST

/* A ranged pass over pieces of a chunk sets the same bits as one pass over all of it, for each
 * kind of bounds: pieces that start on a byte of the bitmap but not a word (the byte path's
 * partial words), off a byte (the int path), and end mid-byte. Each element's flag depends on
 * its own inputs only, so any split must agree; so must the weights of the unflagged ones (the
 * flagged ones' are the redo's to write). */
START_TEST(test_ranged_pieces)
{
    enum { N = 3 * 4096 + 77 };
    static const mt_ranged_bounds modes[3] = { MT_RANGED_BOUNDS_AVX2, MT_RANGED_BOUNDS_AVX512, MT_RANGED_BOUNDS_EXACT };
    static const int64_t cuts[][4] = { { 0, 8, 4104, N }, { 0, 5, 4101, N }, { 0, 24, 8211, N }, { 0, 4096, 8192, N } };
    float *p = malloc(sizeof(float) * N), *g = malloc(sizeof(float) * N), *m = malloc(sizeof(float) * N),
          *v = malloc(sizeof(float) * N);
    mt_bf16 *w = malloc(sizeof(mt_bf16) * N), *w1 = malloc(sizeof(mt_bf16) * N);
    const size_t flag_bytes = mt_ranged_flags_bytes(N, MT_RANGED_SIDE_ROOM_DEFAULT);
    void *whole = malloc(flag_bytes), *pieces = malloc(flag_bytes);
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 43);
    for (int i = 0; i < N; i++) {
        p[i] = (float)(0.02 * mt_test_normal(&rng));
        g[i] = (float)(1e-3 * mt_test_normal(&rng));
        m[i] = (float)(5e-4 * mt_test_normal(&rng));
        v[i] = (float)(1e-6 * (0.1 + mt_test_uniform(&rng)));
    }
    mt_adamw_params a = adam_base;
    a.lr = 1e-3;
    a.step = 7;
    a.grad_scale = 0.3;
    a.grad_scale_lo = 0.24;
    for (int b = 0; b < 3; b++) {
        const char *name = mt_ranged_bounds_name(modes[b]);
        mt_ranged_flags_reset(whole, N, MT_RANGED_SIDE_ROOM_DEFAULT);
        const int64_t nwhole = mt_cpu_ranged_pass(0, N, p, g, m, v, w, MT_DTYPE_BF16, &a, modes[b], whole);
        ck_assert_int_gt(nwhole, 0);
        ck_assert_int_lt(nwhole, N);
        for (size_t c = 0; c < sizeof cuts / sizeof cuts[0]; c++) {
            mt_ranged_flags_reset(pieces, N, MT_RANGED_SIDE_ROOM_DEFAULT);
            int64_t npieces = 0;
            for (int k = 0; k < 3; k++)
                npieces += mt_cpu_ranged_pass(cuts[c][k], cuts[c][k + 1] - cuts[c][k], p, g, m, v, w1, MT_DTYPE_BF16,
                                              &a, modes[b], pieces);
            ck_assert_msg(npieces == nwhole, "%s bounds, cut %zu: %lld flagged in pieces, %lld whole", name, c,
                          (long long)npieces, (long long)nwhole);
            const uint64_t *bw = mt_ranged_bits_of(whole), *bp = mt_ranged_bits_of(pieces);
            for (int i = 0; i < N; i++) {
                if (((bw[i / 64] ^ bp[i / 64]) >> (i % 64)) & 1)
                    ck_assert_msg(false, "%s bounds, cut %zu: element %d's flag differs", name, c, i);
                if (!((bw[i / 64] >> (i % 64)) & 1) && w[i] != w1[i])
                    ck_assert_msg(false, "%s bounds, cut %zu: unflagged element %d's weight differs", name, c, i);
            }
        }
    }
    free(p); free(g); free(m); free(v); free(w); free(w1); free(whole); free(pieces);
}
END_TEST

static Suite *ranged_suite(void)
{
    Suite *s = suite_create("ranged");
    TCase *tc = tcase_create("cpu");
    tcase_set_timeout(tc, 600);
    tcase_add_loop_test(tc, test_ranged_flags_sound, 0, 3);
    tcase_add_test(tc, test_ranged_redo_exact);
    tcase_add_test(tc, test_ranged_side_room);
    tcase_add_test(tc, test_ranged_deferred_fused);
    tcase_add_test(tc, test_ranged_pieces);
    tcase_add_test(tc, test_ranged_held);
    tcase_add_test(tc, test_ranged_spread_grows);
    tcase_add_test(tc, test_ranged_spread_remembers);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return mt_test_run(ranged_suite(), false);
}
