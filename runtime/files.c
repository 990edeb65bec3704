/* Helpers of the files a run writes. A temporary carries its writer's pid so that a stale one can
 * be told from a live writer's: only names of our pattern whose process is gone are removed. */
#include "runtime/files.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int mt_file_fnv1a64(const char *path, uint64_t *hash, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "%s: cannot open: %s", path, strerror(errno));
        return -1;
    }
    unsigned char buf[1 << 16];
    uint64_t h = MT_FNV1A64_START;
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) h = mt_fnv1a64(h, buf, n);
    const int failed = ferror(f);
    fclose(f);
    if (failed) {
        snprintf(err, errlen, "%s: read error", path);
        return -1;
    }
    *hash = h;
    return 0;
}

void mt_temp_name(const char *path, char *buf, size_t len)
{
    snprintf(buf, len, "%s.tmp.%ld", path, (long)getpid());
}

/* The pid of a name ending in ".tmp.PID" or ".cfg.PID", else 0. */
static long temporary_pid(const char *name)
{
    const char *dot = strrchr(name, '.');
    if (!dot || dot - name < 4 || !dot[1]) return 0;
    if (strncmp(dot - 4, ".tmp", 4) && strncmp(dot - 4, ".cfg", 4)) return 0;
    char *end;
    long pid = strtol(dot + 1, &end, 10);
    return *end || pid <= 0 ? 0 : pid;
}

int mt_remove_stale_temporaries(const char *dir, const char *prefix, FILE *log, const char *log_prefix)
{
    DIR *d = opendir(dir);
    if (!d) return 0;
    int removed = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (strncmp(de->d_name, prefix, strlen(prefix))) continue;
        const long pid = temporary_pid(de->d_name);
        if (pid == 0 || pid == (long)getpid()) continue;
        if (kill((pid_t)pid, 0) == 0 || errno != ESRCH) continue; /* alive, or not ours to judge */
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        struct stat sb;
        if (lstat(path, &sb) != 0 || S_ISDIR(sb.st_mode)) continue;
        if (unlink(path) == 0) {
            removed++;
            if (log) {
                fprintf(log, "%s: removed %s, left by process %ld, which is gone\n", log_prefix, path, pid);
                fflush(log);
            }
        }
    }
    closedir(d);
    return removed;
}

void mt_remove_stale_temporaries_of(const char *path, FILE *log, const char *log_prefix)
{
    char dir[4096];
    mt_dir_of(path, dir, sizeof dir);
    const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    mt_remove_stale_temporaries(dir, base, log, log_prefix);
}

int mt_probe_directory(const char *dir, char *err, size_t errlen)
{
    struct stat sb;
    if (stat(dir, &sb) != 0) {
        snprintf(err, errlen, "%s: %s", dir, errno == ENOENT ? "no such directory" : strerror(errno));
        return -1;
    }
    if (!S_ISDIR(sb.st_mode)) {
        snprintf(err, errlen, "%s: not a directory", dir);
        return -1;
    }
    char name[4200], probe[4300];
    snprintf(name, sizeof name, "%s/.megatrain-probe", dir);
    mt_temp_name(name, probe, sizeof probe);
    int fd = open(probe, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) {
        snprintf(err, errlen, "%s: cannot create a file in it: %s", dir, strerror(errno));
        return -1;
    }
    close(fd);
    unlink(probe);
    return 0;
}

bool mt_same_file(const char *a, const char *b)
{
    struct stat sa, sb;
    return stat(a, &sa) == 0 && stat(b, &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

void mt_dir_of(const char *path, char *buf, size_t len)
{
    const char *slash = strrchr(path, '/');
    if (!slash) snprintf(buf, len, ".");
    else if (slash == path) snprintf(buf, len, "/");
    else snprintf(buf, len, "%.*s", (int)(slash - path), path);
}

int mt_check_output_file(const char *path, const char *what, char *err, size_t errlen)
{
    struct stat sb;
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) {
        snprintf(err, errlen, "%s %s: is a directory: name a file in it", what, path);
        return -1;
    }
    char dir[4096], why[4400];
    mt_dir_of(path, dir, sizeof dir);
    if (mt_probe_directory(dir, why, sizeof why)) {
        snprintf(err, errlen, "%s %s: cannot be written: %s (create the directory or choose another path)", what, path,
                 why);
        return -1;
    }
    return 0;
}

void mt_sync_dir(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        fsync(fd);
        close(fd);
    }
}
