/* adamw_bw: the memory traffic of the AdamW variants the step runs, on the CPU alone, through
 * the CPU backend's entry points (backends/cpu/ops.h, adamw.h, ranged.h): T threads over N
 * parameters, each variant timed three times (best kept), in seconds per 1e9 parameters and GB/s
 * at its nominal bytes per parameter. Variants: the fused update in place with its bf16 streamed
 * copy (30 B), the split update's halves (18 and 28 B), the ranged pass of clip speculation (the
 * bitmap of the elements whose bf16 weight could differ within the range, and the weights of the
 * others: 18 B and a bit) with the exact bounds, the AVX2 ones, then the default ones (AVX-512's
 * where the CPU has them), the redo of the flagged elements after the norm (random data tuned to
 * flag a few percent; the row's GB/s counts 2 B per parameter, the streamed weight), and last
 * the pass of a deferred update (the last step's moments half from a second gradient and the
 * ranged run in one loop: 34 B, against 28 + 18 for the two apart), with the default bounds and
 * with AVX2's. A diagnostic, not the benchmark: `megatrain bench` measures AdamW alone and
 * inside the step. */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "backends/cpu/ops.h"
#include "backends/cpu/ranged.h"
#include "models/util.h"

enum { BLOCK = 4096, MAX_THREADS = 256 };

typedef struct bench {
    int64_t n;
    int threads, mode;
    mt_ranged_bounds bounds;  /* of the ranged passes */
    float *p, *g, *m, *v, *g0;
    mt_bf16 *w;
    void *flags[MAX_THREADS]; /* per thread: the ranged pass's buffer over its elements (one chunk) */
    mt_adamw_params prm, ranged, redo;
} bench;

/* Thread t's elements [*lo, *hi): whole blocks (the ranged bitmap's words are then never shared). */
static void range_of(const bench *b, int t, int64_t *lo, int64_t *hi)
{
    const int64_t blocks = (b->n + BLOCK - 1) / BLOCK;
    *lo = blocks * t / b->threads * BLOCK;
    *hi = blocks * (t + 1) / b->threads * BLOCK;
    if (*hi > b->n) *hi = b->n;
}

typedef struct job { bench *b; int t; } job;

static void *run(void *arg)
{
    const job *j = arg;
    bench *b = j->b;
    int64_t lo, hi;
    range_of(b, j->t, &lo, &hi);
    if (b->mode >= 3) {
        /* the thread's elements as one chunk: the ranged pass walks it block by block, the redo
         * its bitmap */
        void *flags = b->flags[j->t];
        if (b->mode >= 7) {
            mt_ranged_flags_reset(flags, hi - lo, MT_RANGED_SIDE_ROOM_DEFAULT);
            mt_cpu_ranged_pass_deferred(0, hi - lo, b->p + lo, b->g0 + lo, b->g + lo, b->m + lo, b->v + lo, b->w + lo,
                                        MT_DTYPE_BF16, &b->prm, &b->ranged, b->bounds, flags);
        } else if (b->mode != 6) {
            mt_ranged_flags_reset(flags, hi - lo, MT_RANGED_SIDE_ROOM_DEFAULT);
            mt_cpu_ranged_pass(0, hi - lo, b->p + lo, b->g + lo, b->m + lo, b->v + lo, b->w + lo, MT_DTYPE_BF16,
                               &b->ranged, b->bounds, flags);
        } else {
            mt_cpu_ranged_redo(hi - lo, flags, b->p + lo, b->g + lo, b->m + lo, b->v + lo, b->w + lo, &b->redo, NULL);
        }
        return NULL;
    }
    float *a = malloc(BLOCK * sizeof(float));
    for (int64_t o = lo; o < hi; o += BLOCK) {
        const int64_t n = hi - o < BLOCK ? hi - o : BLOCK;
        switch (b->mode) {
        case 0: mt_cpu_adamw_f32(n, b->p + o, b->g + o, b->m + o, b->v + o, &b->prm);
                mt_f32_to_bf16(n, b->p + o, b->w + o); break;
        case 1: mt_cpu_adamw_params_f32(n, b->p + o, b->g + o, b->m + o, b->v + o, a, &b->prm);
                mt_f32_to_bf16(n, a, b->w + o); break;
        default: mt_cpu_adamw_f32(n, b->p + o, b->g + o, b->m + o, b->v + o, &b->prm); break;
        }
    }
    free(a);
    return NULL;
}

/* mode < 0: first touch of every array, in parallel, with values that keep AdamW finite */
static void *touch(void *arg)
{
    const job *j = arg;
    bench *b = j->b;
    int64_t lo, hi;
    range_of(b, j->t, &lo, &hi);
    /* varied values, so that the ranged pass flags a realistic share (a percent or two) */
    uint64_t s = 0x9E3779B97F4A7C15ull * (uint64_t)(j->t + 1);
    for (int64_t i = lo; i < hi; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        const float u1 = (float)(s >> 40) * 0x1p-24f, u2 = (float)((s >> 16) & 0xFFFFFF) * 0x1p-24f;
        b->p[i] = 0.01f * (u1 - 0.5f);
        b->g[i] = 2e-3f * (u2 - 0.5f);
        b->g0[i] = 2e-3f * (u1 - 0.5f);
        b->m[i] = 1e-3f * (u2 - u1);
        b->v[i] = 1e-6f * (0.1f + u1);
        b->w[i] = 0;
    }
    return NULL;
}

static double parallel(bench *b, void *(*fn)(void *))
{
    pthread_t th[MAX_THREADS];
    job jobs[MAX_THREADS];
    const double t0 = mt_clock_s();
    for (int t = 0; t < b->threads; t++) {
        jobs[t] = (job){ b, t };
        pthread_create(&th[t], NULL, fn, &jobs[t]);
    }
    for (int t = 0; t < b->threads; t++) pthread_join(th[t], NULL);
    return mt_clock_s() - t0;
}

/* Elements the last ranged pass flagged, over the threads' bitmaps. */
static int64_t count_flagged(const bench *b)
{
    int64_t flagged = 0;
    for (int t = 0; t < b->threads; t++) {
        int64_t lo, hi;
        range_of(b, t, &lo, &hi);
        const size_t words = (size_t)(hi - lo + 63) / 64;
        const uint64_t *bits = mt_ranged_bits_of(b->flags[t]);
        for (size_t k = 0; k < words; k++) flagged += __builtin_popcountll(bits[k]);
    }
    return flagged;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: adamw_bw [--params N] [--threads T] [--lr X]\n"
               "  The memory traffic of the AdamW variants megatrain runs, CPU only (see the source).\n"
               "  --params N    parameters (default 300000000: 5 fp32 arrays and a bf16 one, 6.6 GB)\n"
               "  --threads T   threads (default: online CPUs - 1, as the StarPU CPU workers)\n"
               "  --lr X        the ranged pass's learning rate, which sets the share it flags (default\n"
               "                3e-4: about 2%% of these random values)\n"
               "  --pages P     the arrays' pages: small (madvise MADV_NOHUGEPAGE), huge (MADV_HUGEPAGE,\n"
               "                as the step's host state asks) or default (as the kernel gives; the default)\n");
}

int main(int argc, char **argv)
{
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    bench b = { .n = 300000000, .threads = cpus > 1 ? (int)cpus - 1 : 1,
                .prm = { .lr = 1e-5, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1, .step = 10,
                         .grad_scale = 1.0 } };
    const char *pages = "default";
    double ranged_lr = 3e-4; /* with this data, about 2% flagged */
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) { usage(stdout); return 0; }
        if (!strcmp(argv[i], "--lr") && i + 1 < argc) {
            char *end;
            const double x = strtod(argv[++i], &end);
            if (end == argv[i] || *end || !(x > 0 && x < 1)) {
                fprintf(stderr, "adamw_bw: --lr: '%s' is not a number in (0, 1)\n", argv[i]);
                return 2;
            }
            ranged_lr = x;
            continue;
        }
        if (!strcmp(argv[i], "--pages") && i + 1 < argc) {
            pages = argv[++i];
            if (strcmp(pages, "small") && strcmp(pages, "huge") && strcmp(pages, "default")) {
                fprintf(stderr, "adamw_bw: --pages: '%s' is not small, huge or default\n", pages);
                return 2;
            }
            continue;
        }
        const bool params = !strcmp(argv[i], "--params"), threads = !strcmp(argv[i], "--threads");
        if ((!params && !threads) || i + 1 >= argc) {
            fprintf(stderr, "adamw_bw: unexpected argument '%s'\n", argv[i]);
            usage(stderr);
            return 2;
        }
        char *end;
        errno = 0;
        const long long x = strtoll(argv[++i], &end, 10);
        if (errno || *end || x < 1 || (threads && x > MAX_THREADS) || (params && x > ((long long)1 << 34))) {
            fprintf(stderr, "adamw_bw: %s: '%s' is not a count in range\n", argv[i - 1], argv[i]);
            return 2;
        }
        if (params) b.n = x;
        else b.threads = (int)x;
    }
    const size_t fb = ((size_t)b.n * sizeof(float) + 4095) / 4096 * 4096, wb = ((size_t)b.n * 2 + 4095) / 4096 * 4096;
    float **arrays[] = { &b.p, &b.g, &b.m, &b.v, &b.g0 };
    for (size_t k = 0; k < sizeof arrays / sizeof arrays[0]; k++)
        if (!(*arrays[k] = aligned_alloc(4096, fb))) { fprintf(stderr, "adamw_bw: out of memory\n"); return 1; }
    if (!(b.w = aligned_alloc(4096, wb))) { fprintf(stderr, "adamw_bw: out of memory\n"); return 1; }
    if (strcmp(pages, "default")) {
        /* before the first touch, which is when the kernel picks the pages */
        const int advice = !strcmp(pages, "huge") ? MADV_HUGEPAGE : MADV_NOHUGEPAGE;
        for (size_t k = 0; k < sizeof arrays / sizeof arrays[0]; k++)
            if (madvise(*arrays[k], fb, advice)) perror("adamw_bw: madvise");
        if (madvise(b.w, wb, advice)) perror("adamw_bw: madvise");
    }
    /* the ranged pass: a range of clip scales around 0.25, as a model clipped every step sees; the
     * redo at 0.25 */
    for (int t = 0; t < b.threads; t++) {
        int64_t lo, hi;
        range_of(&b, t, &lo, &hi);
        if (!(b.flags[t] = calloc(1, mt_ranged_flags_bytes(hi - lo, MT_RANGED_SIDE_ROOM_DEFAULT)))) {
            fprintf(stderr, "adamw_bw: out of memory\n");
            return 1;
        }
    }
    b.ranged = b.prm;
    b.ranged.lr = ranged_lr;
    b.ranged.grad_scale = 0.26;
    b.ranged.grad_scale_lo = 0.24;
    b.redo = b.ranged;
    b.redo.grad_scale = 0.25;
    b.redo.grad_scale_lo = 0;
    parallel(&b, touch);
    printf("adamw_bw: %lld parameters, %d threads, %s pages\n", (long long)b.n, b.threads, pages);
    static const struct { const char *name; double bytes; } modes[] = {
        { "fused, in place, + bf16 copy", 30 }, { "split: weights half", 18 }, { "split: moments half", 28 },
        { "ranged pass, exact bounds", 18 }, { "ranged pass, AVX2 bounds", 18 },
        { "ranged pass (weights half + flags)", 18 }, { "ranged redo (flagged elements)", 2 },
        { "deferred: moments + ranged pass", 34 }, { "deferred, AVX2 bounds", 34 },
    };
    int64_t flagged_exact = 0;
    for (int mode = 0; mode < 9; mode++) {
        b.mode = mode;
        b.bounds = mode == 3 ? MT_RANGED_BOUNDS_EXACT : mode == 4 || mode == 8 ? MT_RANGED_BOUNDS_AVX2 : MT_RANGED_BOUNDS_DEFAULT;
        if (mode == 4) flagged_exact = count_flagged(&b);
        double best = 1e30;
        for (int r = 0; r < 3; r++) {
            const double dt = parallel(&b, run);
            if (dt < best) best = dt;
        }
        printf("| %-34s | %.3f s per 1e9 parameters | %6.1f GB/s at %2.0f B per parameter |\n", modes[mode].name,
               best * 1e9 / (double)b.n, modes[mode].bytes * (double)b.n / best / 1e9, modes[mode].bytes);
    }
    for (size_t k = 0; k < sizeof arrays / sizeof arrays[0]; k++) free(*arrays[k]);
    free(b.w);
    const int64_t flagged = count_flagged(&b);
    for (int t = 0; t < b.threads; t++) free(b.flags[t]);
    printf("adamw_bw: the ranged pass (%s bounds on this CPU) flagged %.2f%% of the parameters (the redo's "
           "share; %.2f%% with exact bounds)\n", mt_ranged_bounds_name(MT_RANGED_BOUNDS_DEFAULT), 100.0 * (double)flagged / (double)b.n,
           100.0 * (double)flagged_exact / (double)b.n);
    return 0;
}
