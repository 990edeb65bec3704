/* The checks a training run makes before its long work. Each names what is wrong and the option
 * or command that fixes it; none of them reads more than a header, a meta.json or a directory
 * listing, except the data kind's look at the first bytes of the corpus files. */
#include "runtime/train_checks.h"

#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "models/report.h"
#include "runtime/files.h"
#include "runtime/hf.h"
#include "runtime/shard.h"

/* ---- options -------------------------------------------------------------------------------- */

/* The settings mt_train_settings records, in its order; "data-path" is only noted when it moves. */
static const char *const setting_names[] = {
    "data", "data-path", "data-order", "micro-batch", "accum", "seq-len", "steps", "lr", "min-lr-ratio", "schedule",
    "warmup", "seed", "weight-decay", "beta1", "beta2", "eps", "clip", "dtype", "rope-scaling",
    "router-aux-loss", NULL,
};

static bool known_setting(const char *name, size_t len)
{
    for (const char *const *s = setting_names; *s; s++)
        if (strlen(*s) == len && !strncmp(*s, name, len)) return true;
    return len == 3 && !strncmp(name, "all", 3);
}

/* Whether the comma-separated list holds name (or "all"). */
static bool listed(const char *list, const char *name)
{
    for (const char *p = list; p && *p;) {
        size_t len = strcspn(p, ",");
        if ((len == 3 && !strncmp(p, "all", 3)) || (len == strlen(name) && !strncmp(p, name, len))) return true;
        p += len + (p[len] == ',');
    }
    return false;
}

int mt_train_check_options(const mt_train_options *o, char *err, size_t errlen)
{
    if (o->steps < 1) return mt_fail(err, errlen, "steps must be at least 1");
    if (o->warmup > 0 && o->warmup >= o->steps)
        return mt_fail(err, errlen, "--warmup %lld is not below --steps %lld: the learning rate would not reach --lr "
                       "before the run ends; give a --warmup below %lld (0: none)", (long long)o->warmup,
                       (long long)o->steps, (long long)o->steps);
    if (o->save_every > 0 && !o->checkpoint_path)
        return mt_fail(err, errlen, "--save-every %lld without --checkpoint FILE: there is nowhere to save; add "
                       "--checkpoint FILE", (long long)o->save_every);
    if (o->keep_last > 0 && !o->checkpoint_path)
        return mt_fail(err, errlen, "--keep-last %lld without --checkpoint FILE: add --checkpoint FILE",
                       (long long)o->keep_last);
    for (const char *p = o->allow_changed; p && *p;) {
        size_t len = strcspn(p, ",");
        if (!known_setting(p, len)) {
            char names[512] = "";
            for (const char *const *s = setting_names; *s; s++)
                snprintf(names + strlen(names), sizeof names - strlen(names), "%s, ", *s);
            return mt_fail(err, errlen, "--allow-changed: '%.*s' is not a setting (%sall)", (int)len, p, names);
        }
        p += len + (p[len] == ',');
    }
    if (o->allow_changed && !o->resume_path)
        return mt_fail(err, errlen, "--allow-changed is for --resume: this run starts afresh");
    return 0;
}

/* ---- the data's kind ---------------------------------------------------------------------- */

typedef enum data_kind { KIND_TEXT, KIND_SHARD, KIND_JSONL } data_kind;

static bool ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && !strcmp(s + n - k, suffix);
}

/* A shard by its magic, JSONL by its name or by a first line that is a JSON object, else text. */
static data_kind sniff(const char *path)
{
    if (ends_with(path, ".jsonl") || ends_with(path, ".json")) return KIND_JSONL;
    FILE *f = fopen(path, "rb");
    if (!f) return KIND_TEXT;
    char buf[1 << 16];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    if (n >= 8 && !memcmp(buf, MT_SHARD_MAGIC, 8)) return KIND_SHARD;
    size_t at = 0;
    if (n >= 3 && !memcmp(buf, "\xEF\xBB\xBF", 3)) at = 3;
    while (at < n && (buf[at] == ' ' || buf[at] == '\t' || buf[at] == '\r' || buf[at] == '\n')) at++;
    if (at >= n || buf[at] != '{') return KIND_TEXT;
    size_t end = at + strcspn(buf + at, "\n");
    json_error_t je;
    json_t *line = json_loadb(buf + at, end - at, 0, &je);
    const bool object = json_is_object(line);
    json_decref(line);
    return object ? KIND_JSONL : KIND_TEXT;
}

/* The first shard or JSONL file of a directory the corpus reader would read, else KIND_TEXT. */
static data_kind sniff_directory(const char *dir, char *which, size_t len)
{
    DIR *d = opendir(dir);
    if (!d) return KIND_TEXT;
    data_kind kind = KIND_TEXT;
    struct dirent *de;
    while (kind == KIND_TEXT && (de = readdir(d))) {
        char path[4200];
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        struct stat sb;
        if (de->d_name[0] == '.' || ends_with(de->d_name, ".dat") || lstat(path, &sb) != 0 || !S_ISREG(sb.st_mode))
            continue;
        kind = sniff(path);
        if (kind != KIND_TEXT) snprintf(which, len, "%s", path);
    }
    closedir(d);
    return kind;
}

int mt_train_check_data_kind(const mt_train_options *o, const mt_model_config *cfg, const char *config_path, char *err,
                             size_t errlen)
{
    const char *path = o->data_path;
    if (mt_dataset_is_prepared(path)) return 0;
    struct stat sb;
    if (stat(path, &sb) != 0) return 0; /* the corpus reader names the path and the reason */
    const char *model = o->model_dir ? o->model_dir : config_path;
    char tokenizer[4200];
    if (o->model_dir) snprintf(tokenizer, sizeof tokenizer, "%s/tokenizer.json", o->model_dir);
    else snprintf(tokenizer, sizeof tokenizer, "TOKENIZER.json");
    const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    char which[4200];
    data_kind kind = KIND_TEXT;
    if (S_ISREG(sb.st_mode)) {
        if (!strcmp(base, "meta.json")) {
            char dir[4096];
            mt_dir_of(path, dir, sizeof dir);
            return mt_fail(err, errlen, "--data %s: the meta.json of a prepared directory: pass the directory, "
                           "--data %s", path, dir);
        }
        kind = sniff(path);
        snprintf(which, sizeof which, "%s", path);
    } else if (S_ISDIR(sb.st_mode)) {
        kind = sniff_directory(path, which, sizeof which);
    }
    if (kind == KIND_SHARD) {
        if (!strcmp(which, path)) {
            char dir[4096];
            mt_dir_of(path, dir, sizeof dir);
            return mt_fail(err, errlen, "--data %s: one shard of a prepared directory, which train would read as bytes: "
                           "pass the directory that holds it and its meta.json (--data %s)", path, dir);
        }
        return mt_fail(err, errlen, "--data %s: holds the token shard %s but no meta.json: pass the whole directory "
                       "'megatrain prepare' wrote, or prepare the data again", path, which);
    }
    if (kind == KIND_JSONL)
        return mt_fail(err, errlen, "--data %s: %s is JSONL, which train would read as bytes: render and tokenise it "
                       "first, 'megatrain prepare --tokenizer %s --format alpaca|sharegpt --input %s --output DIR', "
                       "then --data DIR", path, which, tokenizer, which);
    if (o->model_dir && cfg->vocab > 256)
        return mt_fail(err, errlen, "--data %s: text, which train reads as byte ids 0-255, but %s is not a byte-level "
                       "model (vocab_size %lld): tokenise it first, 'megatrain prepare --tokenizer %s --format text "
                       "--input %s --output DIR --seq-len %lld', then --data DIR", path, model, (long long)cfg->vocab,
                       tokenizer, path, (long long)o->step.T);
    return 0;
}

/* ---- outputs ------------------------------------------------------------------------------ */

int mt_train_check_outputs(const mt_train_options *o, char *err, size_t errlen)
{
    char why[4600];
    if (o->checkpoint_path) {
        if (mt_check_output_file(o->checkpoint_path, "--checkpoint", err, errlen)) return -1;
        struct stat sb;
        if (!o->resume_path && lstat(o->checkpoint_path, &sb) == 0)
            return mt_fail(err, errlen, "--checkpoint %s exists and this run does not resume it: continue it with "
                           "--resume %s, or remove it (or choose another --checkpoint) to start over",
                           o->checkpoint_path, o->checkpoint_path);
    }
    if (o->metrics_path && mt_check_output_file(o->metrics_path, "--metrics", err, errlen)) return -1;
    if (o->save_model_dir) {
        if (o->model_dir && mt_same_file(o->save_model_dir, o->model_dir)) {
            if (!o->save_over_model)
                return mt_fail(err, errlen, "--save-model %s is the --model directory: the trained model would replace "
                               "the base model; choose another directory, or pass --save-over-model to replace it",
                               o->save_model_dir);
            if (mt_probe_directory(o->save_model_dir, why, sizeof why))
                return mt_fail(err, errlen, "--save-model %s", why);
        } else if (mt_hf_check_output(o->save_model_dir, why, sizeof why)) {
            return mt_fail(err, errlen, "--save-model %s", why);
        }
    }
    return 0;
}

/* ---- the tokenizer ------------------------------------------------------------------------ */

int mt_train_check_tokenizer(const mt_train_options *o, FILE *log, char *err, size_t errlen)
{
    if (!o->model_dir || !mt_dataset_is_prepared(o->data_path)) return 0;
    char tokenizer[4200], meta_path[4200];
    snprintf(tokenizer, sizeof tokenizer, "%s/tokenizer.json", o->model_dir);
    snprintf(meta_path, sizeof meta_path, "%s/meta.json", o->data_path);
    if (access(tokenizer, F_OK) != 0) return 0;
    json_error_t je;
    json_t *meta = json_load_file(meta_path, 0, &je);
    if (!meta) return 0; /* the data reader names the file and the error */
    json_t *tj = json_object_get(meta, "tokenizer");
    json_t *hash = json_object_get(tj, "fnv1a64"), *path = json_object_get(tj, "path");
    int rc = 0;
    uint64_t model_hash;
    if (json_is_string(hash) && !(rc = mt_file_fnv1a64(tokenizer, &model_hash, err, errlen))) {
        char hex[17];
        snprintf(hex, sizeof hex, "%016llx", (unsigned long long)model_hash);
        const char *data_tokenizer = json_is_string(path) ? json_string_value(path) : "?";
        if (strcmp(hex, json_string_value(hash))) {
            if (!o->allow_other_tokenizer) {
                rc = mt_fail(err, errlen, "--data %s was prepared with the tokenizer %s (fnv1a64 %s), but %s is another "
                             "(fnv1a64 %s): prepare the data with %s, or pass --allow-other-tokenizer if the two encode "
                             "alike", o->data_path, data_tokenizer, json_string_value(hash), tokenizer, hex, tokenizer);
            } else if (log) {
                fprintf(log, "megatrain: note: %s was prepared with the tokenizer %s, not %s (--allow-other-tokenizer)\n",
                        o->data_path, data_tokenizer, tokenizer);
                fflush(log);
            }
        }
    }
    json_decref(meta);
    return rc;
}

/* ---- resume settings ---------------------------------------------------------------------- */

void mt_train_data_identity(const mt_run_data *d, char *buf, size_t len)
{
    if (d->prepared) {
        char meta[4200], err[256];
        snprintf(meta, sizeof meta, "%s/meta.json", d->dataset.dir);
        uint64_t h = 0;
        if (mt_file_fnv1a64(meta, &h, err, sizeof err)) snprintf(buf, len, "prepared, meta.json unreadable");
        else snprintf(buf, len, "prepared, meta.json fnv1a64 %016llx", (unsigned long long)h);
        return;
    }
    const mt_corpus *c = &d->corpus;
    uint64_t h = mt_fnv1a64(mt_fnv1a64(MT_FNV1A64_START, c->train, (size_t)c->ntrain), c->val, (size_t)c->nval);
    snprintf(buf, len, "text, %lld + %lld bytes, fnv1a64 %016llx", (long long)c->ntrain, (long long)c->nval,
             (unsigned long long)h);
}

void mt_train_settings(const mt_train_options *o, const char *data_identity, char *buf, size_t len)
{
    char real[4096];
    const char *data_path = realpath(o->data_path, real) ? real : o->data_path;
    char router_aux[32] = "the config's";
    if (o->router_aux_loss >= 0) snprintf(router_aux, sizeof router_aux, "%.17g", o->router_aux_loss);
    snprintf(buf, len,
             "data=%s\ndata-path=%s\ndata-order=%s\nmicro-batch=%lld\naccum=%d\nseq-len=%lld\nsteps=%lld\nlr=%.17g\n"
             "min-lr-ratio=%.17g\nschedule=%s\nwarmup=%lld\nseed=%llu\nweight-decay=%.17g\nbeta1=%.17g\nbeta2=%.17g\n"
             "eps=%.17g\nclip=%.17g\ndtype=%s\nrope-scaling=%s\nrouter-aux-loss=%s\n",
             data_identity, data_path, o->data_shuffle ? "shuffled" : "sequential", (long long)o->step.B, o->step.accum,
             (long long)o->step.T, (long long)o->steps, o->lr, o->min_lr_ratio,
             o->schedule == MT_LR_COSINE ? "cosine" : "constant", (long long)o->warmup, (unsigned long long)o->seed,
             o->step.weight_decay, o->step.beta1, o->step.beta2, o->step.eps, o->step.clip, mt_dtype_name(o->dtype),
             o->rope_scaling ? o->rope_scaling : "the config's", router_aux);
}

/* The value of `name` in "name=value\n" lines, into buf; false when absent. */
static bool setting_value(const char *lines, const char *name, char *buf, size_t len)
{
    size_t n = strlen(name);
    for (const char *p = lines; p && *p;) {
        size_t line = strcspn(p, "\n");
        if (line > n && !strncmp(p, name, n) && p[n] == '=') {
            snprintf(buf, len, "%.*s", (int)(line - n - 1), p + n + 1);
            return true;
        }
        p += line + (p[line] == '\n');
    }
    return false;
}

/* A setting's value as the user would write it: a number in its shortest exact form. */
static void shown(const char *value, char *buf, size_t len)
{
    char *end;
    double x = strtod(value, &end);
    snprintf(buf, len, "%s", value);
    if (end == value || *end || !isfinite(x)) return;
    if (x == floor(x) && fabs(x) < 1e15) {
        snprintf(buf, len, "%.0f", x);
        return;
    }
    for (int digits = 1; digits <= 17; digits++) {
        snprintf(buf, len, "%.*g", digits, x);
        if (strtod(buf, NULL) == x) return;
    }
}

int mt_train_check_settings(const mt_train_options *o, const char *path, const char *saved, const char *now, FILE *log,
                            char *err, size_t errlen)
{
    if (!saved[0]) {
        if (log) {
            fprintf(log, "megatrain: warning: %s is a version 1 checkpoint, which does not record the run's settings: "
                         "they cannot be checked; the run continues with this command's\n", path);
            fflush(log);
        }
        return 0;
    }
    char refused[2048] = "", accepted[2048] = "", names[512] = "";
    size_t nr = 0, na = 0, nn = 0;
    char was_path[4200] = "?", is_path[4200] = "?";
    setting_value(saved, "data-path", was_path, sizeof was_path);
    setting_value(now, "data-path", is_path, sizeof is_path);
    for (const char *const *s = setting_names; *s; s++) {
        char was[4200], is[4200], a[4400], b[4400];
        if (!setting_value(saved, *s, was, sizeof was) || !setting_value(now, *s, is, sizeof is) || !strcmp(was, is))
            continue;
        if (!strcmp(*s, "data-path")) {
            if (log && setting_value(saved, "data", a, sizeof a) &&
                setting_value(now, "data", b, sizeof b) && !strcmp(a, b)) {
                fprintf(log, "megatrain: note: the data moved from %s to %s (the same content)\n", was, is);
                fflush(log);
            }
            continue;
        }
        if (!strcmp(*s, "data")) { /* the content, under the paths */
            snprintf(a, sizeof a, "%s: %s", was_path, was);
            snprintf(b, sizeof b, "%s: %s", is_path, is);
        } else {
            shown(was, a, sizeof a);
            shown(is, b, sizeof b);
        }
        char *list = listed(o->allow_changed, *s) ? accepted : refused;
        size_t *at = list == accepted ? &na : &nr;
        if (*at < 2048)
            *at += (size_t)snprintf(list + *at, 2048 - *at, "%s--%s %s (the checkpoint's run: %s)", *at ? ", " : "", *s,
                                    b, a);
        if (list == refused && nn < sizeof names) nn += (size_t)snprintf(names + nn, sizeof names - nn, "%s%s", nn ? "," : "", *s);
    }
    if (nr)
        return mt_fail(err, errlen, "%s: this run's settings differ from those of the run that saved it: %s; resume with "
                       "the checkpoint's values to continue it bit for bit, or accept the change with --allow-changed %s",
                       path, refused, names);
    if (na && log) {
        fprintf(log, "megatrain: resuming with changed settings (--allow-changed): %s\n", accepted);
        fflush(log);
    }
    return 0;
}
