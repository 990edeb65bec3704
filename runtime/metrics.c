/* The metrics file. A resumed run rewrites it (temporary, rename) without the lines of steps its
 * checkpoint does not hold, so that every step appears once, with the values of the run whose
 * state went on. */
#include "runtime/metrics.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "runtime/files.h"

/* Keeps the lines of path whose step is at most `resumed`; *elapsed gets the last kept one's
 * elapsed_s. A missing file is an empty one. */
static int keep_through(const char *path, int64_t resumed, double *elapsed, char *err, size_t errlen)
{
    FILE *in = fopen(path, "r");
    if (!in) {
        if (errno == ENOENT) return 0;
        snprintf(err, errlen, "--metrics %s: cannot open: %s", path, strerror(errno));
        return -1;
    }
    char tmp[4200];
    mt_temp_name(path, tmp, sizeof tmp);
    FILE *out = fopen(tmp, "w");
    if (!out) {
        fclose(in);
        snprintf(err, errlen, "--metrics %s: cannot create: %s", tmp, strerror(errno));
        return -1;
    }
    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    while ((n = getline(&line, &cap, in)) > 0) {
        json_error_t je;
        json_t *o = json_loadb(line, (size_t)n, 0, &je);
        json_t *step = json_object_get(o, "step"), *el = json_object_get(o, "elapsed_s");
        if (json_is_integer(step) && json_integer_value(step) <= resumed) {
            fputs(line, out);
            if (line[n - 1] != '\n') fputc('\n', out);
            if (json_is_number(el)) *elapsed = json_number_value(el);
        }
        json_decref(o);
    }
    free(line);
    fclose(in);
    const bool failed = fflush(out) != 0 || fsync(fileno(out)) != 0;
    if (fclose(out) != 0 || failed || rename(tmp, path) != 0) {
        snprintf(err, errlen, "--metrics %s: cannot rewrite: %s", path, strerror(errno));
        unlink(tmp);
        return -1;
    }
    return 0;
}

int mt_metrics_open(mt_metrics *m, const char *path, int64_t resumed, char *err, size_t errlen)
{
    memset(m, 0, sizeof *m);
    if (resumed > 0 && keep_through(path, resumed, &m->elapsed_before, err, errlen)) return -1;
    m->f = fopen(path, resumed > 0 ? "a" : "w");
    if (!m->f) {
        snprintf(err, errlen, "--metrics %s: cannot open for writing: %s", path, strerror(errno));
        return -1;
    }
    return 0;
}

/* A JSON number, or null for what JSON cannot hold. */
static void number(FILE *f, const char *key, double x, const char *format)
{
    fprintf(f, ", \"%s\": ", key);
    if (isfinite(x)) fprintf(f, format, x);
    else fputs("null", f);
}

void mt_metrics_write(mt_metrics *m, const mt_metrics_row *r)
{
    if (!m->f) return;
    fprintf(m->f, "{\"step\": %lld", (long long)r->step);
    number(m->f, "loss", r->loss, "%.17g");
    number(m->f, "grad_norm", r->grad_norm, "%.17g");
    number(m->f, "lr", r->lr, "%.17g");
    number(m->f, "tokens_per_s", r->tokens_per_s, "%.1f");
    number(m->f, "elapsed_s", m->elapsed_before + r->elapsed_s, "%.3f");
    number(m->f, "epoch", r->epoch, "%.6f");
    if (!isnan(r->val_loss)) number(m->f, "val_loss", r->val_loss, "%.17g");
    if (r->skipped) fputs(", \"skipped\": true", m->f);
    fputs("}\n", m->f);
    fflush(m->f);
}

int mt_metrics_close(mt_metrics *m, const char *path, char *err, size_t errlen)
{
    if (!m->f) return 0;
    const bool failed = ferror(m->f) != 0;
    const bool close_failed = fclose(m->f) != 0;
    m->f = NULL;
    if (failed || close_failed) {
        snprintf(err, errlen, "--metrics %s: write error", path);
        return -1;
    }
    return 0;
}

/* The number at key, NAN when absent or null. */
static double number_of(const json_t *o, const char *key)
{
    const json_t *v = json_object_get(o, key);
    return json_is_number(v) ? json_number_value(v) : NAN;
}

/* True for a line of spaces only. */
static bool blank(const char *line)
{
    for (; *line; line++)
        if (*line != ' ' && *line != '\t' && *line != '\r' && *line != '\n') return false;
    return true;
}

int mt_metrics_read(const char *path, mt_metrics_row **rows, int64_t *n, char *err, size_t errlen)
{
    *rows = NULL;
    *n = 0;
    FILE *in = fopen(path, "r");
    if (!in) {
        snprintf(err, errlen, "%s: cannot open: %s", path, strerror(errno));
        return -1;
    }
    mt_metrics_row *out = NULL;
    int64_t count = 0, cap = 0, lineno = 0;
    char *line = NULL;
    size_t linecap = 0;
    ssize_t len;
    int rc = 0;
    while ((len = getline(&line, &linecap, in)) > 0) {
        lineno++;
        if (blank(line)) continue;
        json_error_t je;
        json_t *o = json_loadb(line, (size_t)len, 0, &je);
        if (!o) {
            snprintf(err, errlen, "%s:%lld: not JSON (%s): is it a --metrics file?", path, (long long)lineno, je.text);
            rc = -1;
            break;
        }
        const json_t *step = json_object_get(o, "step");
        if (!json_is_object(o) || !json_is_integer(step)) {
            snprintf(err, errlen, "%s:%lld: not a metrics line (a JSON object with an integer \"step\")", path,
                     (long long)lineno);
            json_decref(o);
            rc = -1;
            break;
        }
        if (count == cap) {
            cap = cap ? 2 * cap : 256;
            mt_metrics_row *grown = realloc(out, sizeof *out * (size_t)cap);
            if (!grown) {
                snprintf(err, errlen, "%s: out of memory at line %lld", path, (long long)lineno);
                json_decref(o);
                rc = -1;
                break;
            }
            out = grown;
        }
        out[count++] = (mt_metrics_row){
            .step = json_integer_value(step), .loss = number_of(o, "loss"), .grad_norm = number_of(o, "grad_norm"),
            .lr = number_of(o, "lr"), .tokens_per_s = number_of(o, "tokens_per_s"),
            .elapsed_s = number_of(o, "elapsed_s"), .epoch = number_of(o, "epoch"),
            .val_loss = number_of(o, "val_loss"), .skipped = json_is_true(json_object_get(o, "skipped")),
        };
        json_decref(o);
    }
    if (rc == 0 && ferror(in)) {
        snprintf(err, errlen, "%s: read error: %s", path, strerror(errno));
        rc = -1;
    }
    free(line);
    fclose(in);
    if (rc) {
        free(out);
        return -1;
    }
    *rows = out;
    *n = count;
    return 0;
}
