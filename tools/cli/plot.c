/* megatrain plot: draws the loss (and the validation loss) and the tokens per second of one or
 * more runs' metrics files (train --metrics, runtime/metrics.h) against the step, as a PNG. The
 * drawing is gnuplot's, fed a script on a pipe; the image goes to a temporary file renamed over
 * OUT once gnuplot has finished, so OUT is either the old file or the whole new one. */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "runtime/files.h"
#include "runtime/metrics.h"
#include "tools/cli/commands.h"

static const char cmd[] = "megatrain plot";

#define PLOT_MAX_RUNS 32
#define PLOT_MAX_SIDE 10000

static void usage(FILE *out)
{
    fprintf(out,
            "usage: megatrain plot FILE [FILE...] -o OUT.png [--title T] [--size WxH]\n\n"
            "Draws the metrics files that train --metrics writes: the training loss, and the validation\n"
            "loss where it was measured, against the step (top), and the tokens per second against the\n"
            "step (bottom). Several files are several runs overlaid, each named by its file. Needs\n"
            "gnuplot (Debian's gnuplot-nox); OUT is written whole or not at all.\n\n"
            "options:\n"
            "  -o, --output OUT.png  the image to write (required)\n"
            "  --title T             the title above both plots (default: the files' names)\n"
            "  --size WxH            the image's size in pixels (default 1000x800)\n"
            "  --help                this help\n");
}

static int usage_error(const char *fmt, const char *arg)
{
    fprintf(stderr, "%s: ", cmd);
    fprintf(stderr, fmt, arg);
    fprintf(stderr, " (try '%s --help')\n", cmd);
    return 2;
}

static int failed(const char *msg)
{
    fprintf(stderr, "%s: %s\n", cmd, msg);
    return 1;
}

/* The path of the gnuplot that PATH names (into buf), or NULL. */
static const char *find_gnuplot(char *buf, size_t len)
{
    const char *path = getenv("PATH");
    if (!path) return NULL;
    for (const char *p = path;;) {
        const char *end = strchr(p, ':');
        const size_t n = end ? (size_t)(end - p) : strlen(p);
        snprintf(buf, len, "%.*s/gnuplot", (int)n, n ? p : ".");
        if (access(buf, X_OK) == 0) return buf;
        if (!end) return NULL;
        p = end + 1;
    }
}

/* s as a gnuplot single-quoted string: a quote inside is doubled. */
static void quoted(FILE *f, const char *s)
{
    fputc('\'', f);
    for (; *s; s++) {
        if (*s == '\'') fputc('\'', f);
        fputc(*s, f);
    }
    fputc('\'', f);
}

/* A value gnuplot skips when it is not a number. */
static void value(FILE *f, double x)
{
    if (isfinite(x)) fprintf(f, " %.9g", x);
    else fputs(" NaN", f);
}

typedef struct run {
    const char *path;
    mt_metrics_row *rows;
    int64_t n;
    int64_t finite_loss, finite_val, finite_rate; /* rows whose value gnuplot can draw */
} run;

/* The script: one data block per run and per series, then both plots. Terminal pngcairo where
 * this gnuplot has it, else png; noenhanced so that file names print as they are. */
static void write_script(FILE *f, const run *runs, int nruns, const char *title, const char *tmp, int width,
                         int height)
{
    fprintf(f, "set encoding utf8\n");
    fprintf(f, "if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) { set terminal pngcairo noenhanced size %d,%d } "
               "else { set terminal png noenhanced size %d,%d }\n", width, height, width, height);
    fputs("set output ", f);
    quoted(f, tmp);
    fputc('\n', f);
    for (int r = 0; r < nruns; r++) {
        fprintf(f, "$train%d << EOD\n", r);
        for (int64_t i = 0; i < runs[r].n; i++) {
            fprintf(f, "%lld", (long long)runs[r].rows[i].step);
            value(f, runs[r].rows[i].loss);
            value(f, runs[r].rows[i].tokens_per_s);
            fputc('\n', f);
        }
        fprintf(f, "EOD\n$val%d << EOD\n", r);
        for (int64_t i = 0; i < runs[r].n; i++)
            if (isfinite(runs[r].rows[i].val_loss))
                fprintf(f, "%lld %.9g\n", (long long)runs[r].rows[i].step, runs[r].rows[i].val_loss);
        fprintf(f, "EOD\n");
    }
    fputs("set multiplot layout 2,1 title ", f);
    quoted(f, title);
    /* the same left margin and the keys below: both plots' step axes line up */
    fputs("\nset grid\nset lmargin 12\nset key below\nset xlabel 'step'\nset ylabel 'loss'\nplot ", f);
    bool first = true;
    for (int r = 0; r < nruns; r++) {
        if (runs[r].finite_loss) {
            fprintf(f, "%s$train%d using 1:2 with lines linecolor %d linewidth 1.5 title ", first ? "" : ", ", r, r + 1);
            quoted(f, runs[r].path);
            first = false;
        }
        if (runs[r].finite_val) {
            char label[4200];
            snprintf(label, sizeof label, "%s (validation)", runs[r].path);
            fprintf(f, "%s$val%d using 1:2 with linespoints linecolor %d dashtype 2 pointtype 7 title ",
                    first ? "" : ", ", r, r + 1);
            quoted(f, label);
            first = false;
        }
    }
    fputs("\nset ylabel 'tokens/s'\nplot ", f);
    first = true;
    for (int r = 0; r < nruns; r++) {
        if (!runs[r].finite_rate) continue;
        fprintf(f, "%s$train%d using 1:3 with lines linecolor %d linewidth 1.5 title ", first ? "" : ", ", r, r + 1);
        quoted(f, runs[r].path);
        first = false;
    }
    fputs("\nunset multiplot\nset output\n", f);
}

/* Runs gnuplot on the script; 0 when it exited 0. Its own messages go to stderr. */
static int run_gnuplot(const char *gnuplot, const run *runs, int nruns, const char *title, const char *tmp, int width,
                       int height, char *err, size_t errlen)
{
    int fds[2];
    if (pipe(fds)) {
        snprintf(err, errlen, "cannot make a pipe to gnuplot: %s", strerror(errno));
        return -1;
    }
    const pid_t pid = fork();
    if (pid < 0) {
        snprintf(err, errlen, "cannot start gnuplot: %s", strerror(errno));
        close(fds[0]);
        close(fds[1]);
        return -1;
    }
    if (pid == 0) {
        dup2(fds[0], STDIN_FILENO);
        close(fds[0]);
        close(fds[1]);
        execl(gnuplot, "gnuplot", (char *)NULL);
        fprintf(stderr, "%s: cannot run %s: %s\n", cmd, gnuplot, strerror(errno));
        _exit(127);
    }
    close(fds[0]);
    /* gnuplot ending early must be reported from its status, not end this process. */
    signal(SIGPIPE, SIG_IGN);
    FILE *f = fdopen(fds[1], "w");
    if (f) {
        write_script(f, runs, nruns, title, tmp, width, height);
        fclose(f);
    } else {
        close(fds[1]);
    }
    int status;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return 0;
    if (WIFEXITED(status))
        snprintf(err, errlen, "gnuplot (%s) failed with exit status %d (its message is above)", gnuplot,
                 WEXITSTATUS(status));
    else
        snprintf(err, errlen, "gnuplot (%s) was killed by signal %d", gnuplot, WTERMSIG(status));
    return -1;
}

int cli_plot(int argc, char **argv)
{
    const char *out = NULL, *title = NULL;
    int width = 1000, height = 800;
    enum { TITLE = 256, SIZE, HELP };
    static const struct option longopts[] = {
        { "output", required_argument, 0, 'o' }, { "title", required_argument, 0, TITLE },
        { "size", required_argument, 0, SIZE },  { "help", no_argument, 0, HELP },
        { "help-all", no_argument, 0, HELP },    { 0, 0, 0, 0 },
    };
    int ch;
    while ((ch = getopt_long(argc, argv, "o:h", longopts, NULL)) != -1) {
        switch (ch) {
        case 'o': out = optarg; break;
        case TITLE: title = optarg; break;
        case SIZE: {
            char x;
            char rest;
            if (sscanf(optarg, "%d%c%d%c", &width, &x, &height, &rest) != 3 || (x != 'x' && x != 'X') || width < 16 ||
                height < 16 || width > PLOT_MAX_SIDE || height > PLOT_MAX_SIDE)
                return usage_error("--size: '%s' is not WxH, each from 16 to 10000 pixels", optarg);
            break;
        }
        case 'h':
        case HELP: usage(stdout); return 0;
        default: return 2; /* getopt named the option */
        }
    }
    const int nruns = argc - optind;
    if (nruns == 0) return usage_error("%s", "no metrics FILE given");
    if (nruns > PLOT_MAX_RUNS) return usage_error("%s", "more than 32 metrics files");
    if (!out) return usage_error("%s", "-o OUT.png is required");

    /* Everything that can be wrong is found before gnuplot starts: gnuplot, the files, OUT. */
    char gnuplot[4200];
    if (!find_gnuplot(gnuplot, sizeof gnuplot))
        return failed("gnuplot is not installed (no gnuplot on PATH): install Debian's package gnuplot-nox "
                      "(apt-get install gnuplot-nox)");
    run runs[PLOT_MAX_RUNS] = { 0 };
    char err[4400];
    int rc = 1;
    for (int r = 0; r < nruns; r++) {
        run *u = &runs[r];
        u->path = argv[optind + r];
        if (mt_metrics_read(u->path, &u->rows, &u->n, err, sizeof err)) goto done;
        for (int64_t i = 0; i < u->n; i++) {
            u->finite_loss += isfinite(u->rows[i].loss);
            u->finite_val += isfinite(u->rows[i].val_loss);
            u->finite_rate += isfinite(u->rows[i].tokens_per_s);
        }
        if (u->n == 0) {
            snprintf(err, sizeof err, "%s: no steps (an empty metrics file: did the run reach its first step?)", u->path);
            goto done;
        }
        if (u->finite_loss == 0 || u->finite_rate == 0) {
            snprintf(err, sizeof err, "%s: no step has a finite %s to draw", u->path,
                     u->finite_loss ? "tokens_per_s" : "loss");
            goto done;
        }
    }
    struct stat st;
    if (stat(out, &st) == 0 && S_ISDIR(st.st_mode)) {
        snprintf(err, sizeof err, "-o %s: is a directory", out);
        goto done;
    }
    char tmp[4200];
    mt_temp_name(out, tmp, sizeof tmp);
    FILE *probe = fopen(tmp, "w");
    if (!probe) {
        snprintf(err, sizeof err, "-o %s: cannot be written: %s", out, strerror(errno));
        goto done;
    }
    fclose(probe);

    char default_title[4200] = "";
    if (!title) {
        size_t used = 0;
        for (int r = 0; r < nruns && used < sizeof default_title; r++)
            used += (size_t)snprintf(default_title + used, sizeof default_title - used, "%s%s", r ? ", " : "",
                                     runs[r].path);
        title = default_title;
    }
    if (run_gnuplot(gnuplot, runs, nruns, title, tmp, width, height, err, sizeof err)) {
        unlink(tmp);
        goto done;
    }
    if (stat(tmp, &st) != 0 || st.st_size == 0) {
        snprintf(err, sizeof err, "gnuplot (%s) wrote no image", gnuplot);
        unlink(tmp);
        goto done;
    }
    if (rename(tmp, out)) {
        snprintf(err, sizeof err, "-o %s: cannot rename %s over it: %s", out, tmp, strerror(errno));
        unlink(tmp);
        goto done;
    }
    int64_t steps = 0;
    for (int r = 0; r < nruns; r++) steps += runs[r].n;
    printf("plot: %d run%s, %lld steps, written to %s (%dx%d)\n", nruns, nruns == 1 ? "" : "s", (long long)steps, out,
           width, height);
    rc = 0;
done:
    if (rc) failed(err);
    for (int r = 0; r < nruns; r++) free(runs[r].rows);
    return rc;
}
