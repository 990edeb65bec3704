/* What the libFuzzer harnesses of tests/fuzz/ share: a scratch directory for the readers that take
 * a path, the source tree's fixtures, the seed-writing mode, and a check that reports a broken
 * invariant as a crash (libFuzzer then keeps the input). */
#ifndef MT_TESTS_FUZZ_FUZZ_H
#define MT_TESTS_FUZZ_FUZZ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* A per-process directory under $TMPDIR (default /dev/shm where writable, else /tmp), created on
 * first use and removed at exit. */
const char *fuzz_dir(void);

/* Writes size bytes to fuzz_dir()/name (replacing it); returns the path, in a static buffer that
 * the next call overwrites. Aborts when the write fails, which is not the input's fault. */
const char *fuzz_write(const char *name, const void *data, size_t size);

/* The absolute path of a file of the source tree (FUZZ_SOURCE_ROOT, compiled in). */
const char *fuzz_source(const char *relative);

/* The directory named by FUZZ_MAKE_SEEDS, or NULL: harnesses whose seeds are binary files write
 * them there from their LLVMFuzzerInitialize (through the project's own writers) and exit. */
const char *fuzz_seed_dir(void);

/* With FUZZ_MAKE_SEEDS set: write_seeds(that directory), then exit (1 if it returned nonzero). */
void fuzz_seeds_if_asked(int (*write_seeds)(const char *dir));

/* A broken invariant: prints what and aborts, so libFuzzer records the input as a crash. */
#define FUZZ_CHECK(cond, ...)                                                                    \
    do {                                                                                         \
        if (!(cond)) fuzz_fail(__FILE__, __LINE__, #cond, __VA_ARGS__);                          \
    } while (0)
void fuzz_fail(const char *file, int line, const char *cond, const char *fmt, ...)
    __attribute__((noreturn, format(printf, 4, 5)));

#endif
