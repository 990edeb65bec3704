/* The harnesses' shared helpers (fuzz.h). */
#include "tests/fuzz/fuzz.h"

#include <dirent.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char scratch[4096];

static void remove_scratch(void)
{
    DIR *d = opendir(scratch);
    if (!d) return;
    struct dirent *e;
    char path[8192];
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(path, sizeof path, "%s/%s", scratch, e->d_name);
        unlink(path);
    }
    closedir(d);
    rmdir(scratch);
}

const char *fuzz_dir(void)
{
    if (!scratch[0]) {
        /* memory, where there is a tmpfs: every input is written to a file, and a disk makes that
         * the cost of a run */
        const char *tmp = getenv("TMPDIR");
        if (!tmp || !*tmp) tmp = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
        snprintf(scratch, sizeof scratch, "%s/mt-fuzz.XXXXXX", tmp);
        if (!mkdtemp(scratch)) {
            perror(scratch);
            abort();
        }
        atexit(remove_scratch);
    }
    return scratch;
}

const char *fuzz_write(const char *name, const void *data, size_t size)
{
    static char path[8192];
    snprintf(path, sizeof path, "%s/%s", fuzz_dir(), name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, size, f) != size || fclose(f) != 0) {
        perror(path);
        abort();
    }
    return path;
}

const char *fuzz_source(const char *relative)
{
    static char path[8192];
    snprintf(path, sizeof path, "%s/%s", FUZZ_SOURCE_ROOT, relative);
    return path;
}

const char *fuzz_seed_dir(void)
{
    const char *d = getenv("FUZZ_MAKE_SEEDS");
    return d && *d ? d : NULL;
}

void fuzz_seeds_if_asked(int (*write_seeds)(const char *dir))
{
    if (fuzz_seed_dir()) exit(write_seeds(fuzz_seed_dir()) ? 1 : 0);
}

void fuzz_fail(const char *file, int line, const char *cond, const char *fmt, ...)
{
    fprintf(stderr, "%s:%d: invariant broken: %s: ", file, line, cond);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    abort();
}
