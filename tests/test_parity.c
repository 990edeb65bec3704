/* Parity with transformers (docs/parity.md): for every fixture directory under
 * tests/fixtures/parity (or $MT_PARITY_FIXTURES), the loss, logits and every gradient of
 * `megatrain grads` on the fp32 CPU path against what transformers computed in fp32 for the same
 * batch, per tensor ||ours - ref|| / ||ref|| <= 1e-5; and an HF load -> save -> load round trip,
 * bit for bit.
 *
 * A fixture directory, as tools/parity_suite.py writes it, holds the HF model (config.json and
 * model.safetensors, or shards listed by model.safetensors.index.json, as save_pretrained writes
 * them; they may also sit in a model/ subdirectory), tokens.bin (B x (T + 1) little-endian int32
 * ids), batch.json ({"batch": B, "seq_len": T, ...}) and reference.safetensors (F32: "loss" [1],
 * "logits" [B, T, V] and one gradient per parameter under transformers' named_parameters names). */
#include <check.h>
#include <dirent.h>
#include <ftw.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "models/config.h"
#include "runtime/grads.h"
#include "runtime/hf.h"
#include "runtime/runtime.h"
#include "models/safetensors.h"
#include "runtime/state.h"
#include "tests/testutil.h"

#define PARITY_BOUND 1e-5

static char fixtures_root[1024];
static char **fixtures; /* names of the fixture directories, sorted */
static int nfixtures;

/* path = fixture i's directory + "/" + name (name "" for the directory itself). */
static void fixture_file(int i, const char *name, char *path, size_t len)
{
    snprintf(path, len, "%s/%s%s%s", fixtures_root, fixtures[i], name[0] ? "/" : "", name);
}

/* The HF model of fixture i: the fixture directory itself, or its model/ subdirectory when that
 * has a config.json. */
static void model_dir(int i, char *path, size_t len)
{
    char probe[4096];
    fixture_file(i, "model/config.json", probe, sizeof probe);
    fixture_file(i, access(probe, F_OK) == 0 ? "model" : "", path, len);
}

static mt_model_config load_config(const char *dir)
{
    char path[4200], err[1024] = "";
    snprintf(path, sizeof path, "%s/config.json", dir);
    mt_model_config cfg;
    ck_assert_msg(mt_config_load(path, &cfg, err, sizeof err) == 0, "%s", err);
    return cfg;
}

/* batch.json: {"batch": B, "seq_len": T}, both positive integers. */
static void read_batch(int i, int64_t *B, int64_t *T)
{
    char path[4096];
    fixture_file(i, "batch.json", path, sizeof path);
    json_error_t je;
    json_t *o = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    ck_assert_msg(o != NULL, "%s: not valid JSON (line %d: %s)", path, je.line, je.text);
    json_t *b = json_object_get(o, "batch"), *t = json_object_get(o, "seq_len");
    ck_assert_msg(json_is_integer(b) && json_integer_value(b) > 0 && json_is_integer(t) && json_integer_value(t) > 0,
                  "%s: wants {\"batch\": B, \"seq_len\": T} with positive integers", path);
    *B = json_integer_value(b);
    *T = json_integer_value(t);
    json_decref(o);
}

/* The targets of tokens.bin (B x (T + 1) int32): row b * T + t holds token t + 1 of sequence b. */
static int32_t *read_targets(int i, int64_t B, int64_t T)
{
    char path[4096];
    fixture_file(i, "tokens.bin", path, sizeof path);
    int32_t *ids = malloc(sizeof *ids * (size_t)(B * (T + 1))), *tgt = malloc(sizeof *tgt * (size_t)(B * T));
    FILE *f = fopen(path, "rb");
    ck_assert_msg(f && fread(ids, 4, (size_t)(B * (T + 1)), f) == (size_t)(B * (T + 1)), "%s: cannot read", path);
    fclose(f);
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) tgt[b * T + t] = ids[b * (T + 1) + t + 1];
    free(ids);
    return tgt;
}

static mt_st_file *open_ok(const char *path)
{
    char err[1024] = "";
    mt_st_file *f = mt_st_open(path, err, sizeof err);
    ck_assert_msg(f != NULL, "%s", err);
    return f;
}

static float *read_tensor(mt_st_file *f, const mt_st_tensor *t)
{
    char err[1024] = "";
    float *x = malloc(sizeof *x * (size_t)(t->numel ? t->numel : 1));
    ck_assert_msg(mt_st_read_f32(f, t, x, err, sizeof err) == 0, "%s", err);
    return x;
}

/* "[2, 16, 256]" into buf; returns buf. */
static const char *dims(const mt_st_tensor *t, char *buf, size_t len)
{
    size_t at = (size_t)snprintf(buf, len, "[");
    for (int k = 0; k < t->ndim && at < len; k++)
        at += (size_t)snprintf(buf + at, len - at, k ? ", %lld" : "%lld", (long long)t->shape[k]);
    if (at < len) snprintf(buf + at, len - at, "]");
    return buf;
}

/* Mean cross-entropy of logits (n, V) against targets (n), in double. */
static double loss_of_logits(const float *logits, const int32_t *targets, int64_t n, int64_t V)
{
    double sum = 0;
    for (int64_t r = 0; r < n; r++) {
        const float *row = logits + r * V;
        double mx = row[0], s = 0;
        for (int64_t j = 1; j < V; j++) mx = fmax(mx, row[j]);
        for (int64_t j = 0; j < V; j++) s += exp((double)row[j] - mx);
        sum += mx + log(s) - row[targets[r]];
    }
    return sum / (double)n;
}

/* Problems of one fixture, gathered so that one run names all of them. */
typedef struct report {
    char text[8192];
    size_t at;
    int count;
} report;

static void problem(report *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void problem(report *r, const char *fmt, ...)
{
    r->count++;
    if (r->at >= sizeof r->text) return;
    va_list ap;
    va_start(ap, fmt);
    r->at += (size_t)vsnprintf(r->text + r->at, sizeof r->text - r->at, fmt, ap);
    va_end(ap);
    if (r->at < sizeof r->text) r->at += (size_t)snprintf(r->text + r->at, sizeof r->text - r->at, "\n");
}

/* The file's "loss" [1] and "logits" [B, T, V] agree: the logits are those of the input positions
 * whose next tokens the loss predicts. With the router's load-balancing loss on, the loss is their
 * mean cross-entropy plus coef x aux, and aux = E sum_e (c_e / R)(P_e / R) lies in (0, E k]
 * (docs/moe.md): what the logits leave of the loss must be such an aux. */
static void check_loss_of_logits(report *r, const char *path, mt_st_file *f, const int32_t *targets,
                                 int64_t B, int64_t T, const mt_model_config *cfg)
{
    const int64_t V = cfg->vocab;
    const double coef = mt_config_router_aux_coef(cfg);
    const mt_st_tensor *l = mt_st_find(f, "loss"), *z = mt_st_find(f, "logits");
    if (!l || !z || l->numel != 1 || z->ndim != 3 || z->shape[0] != B || z->shape[1] != T || z->shape[2] != V)
        return; /* reported by the comparison */
    float *loss = read_tensor(f, l), *logits = read_tensor(f, z);
    double from_logits = loss_of_logits(logits, targets, B * T, V);
    if (coef > 0) {
        const double aux = ((double)loss[0] - from_logits) / coef, most = (double)(cfg->experts * cfg->experts_per_token);
        if (!(aux > 0 && aux <= most))
            problem(r, "%s: \"loss\" is %.9g and its \"logits\" give a mean cross-entropy of %.9g: the load-balancing "
                    "loss (coefficient %g) would be %.6g, outside (0, %g]", path, loss[0], from_logits, coef, aux, most);
        free(loss);
        free(logits);
        return;
    }
    double err = fabs(from_logits - loss[0]) / fabs((double)loss[0]);
    if (!(err <= PARITY_BOUND))
        problem(r, "%s: \"loss\" is %.9g but its \"logits\" give a mean cross-entropy of %.9g (relative %.3e)", path,
                loss[0], from_logits, err);
    free(loss);
    free(logits);
}

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb; (void)flag; (void)ftw;
    return remove(path);
}

static void remove_tree(const char *dir) { nftw(dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS); }

/* megatrain grads (fp32 CPU path, with logits) against reference.safetensors. */
START_TEST(test_grads_match_transformers)
{
    char model[4096], tokens[4096], ref_path[4096], work[] = "/tmp/mt-parity.XXXXXX", ours_path[4200], err[1024] = "";
    model_dir(_i, model, sizeof model);
    fixture_file(_i, "tokens.bin", tokens, sizeof tokens);
    fixture_file(_i, "reference.safetensors", ref_path, sizeof ref_path);
    ck_assert_msg(mkdtemp(work) != NULL, "mkdtemp failed");
    snprintf(ours_path, sizeof ours_path, "%s/grads.safetensors", work);
    const mt_model_config cfg = load_config(model);
    mt_grads_options o = { .model_dir = model, .tokens_path = tokens, .K = 2, .out_path = ours_path, .logits = true,
                           .runtime = mt_runtime_defaults() };
    o.runtime.ncuda = 0;
    read_batch(_i, &o.B, &o.T);
    double loss;
    ck_assert_msg(mt_grads_run(&o, &loss, err, sizeof err) == 0, "%s: megatrain grads: %s", fixtures[_i], err);

    mt_st_file *ours = open_ok(ours_path), *ref = open_ok(ref_path);
    report *r = calloc(1, sizeof *r);
    double worst = -1;
    const char *worst_name = "none";
    for (int k = 0; k < ref->ntensors; k++) {
        const mt_st_tensor *want = &ref->tensors[k], *got = mt_st_find(ours, want->name);
        if (!got) { problem(r, "%s: tensor '%s': megatrain wrote none", ref_path, want->name); continue; }
        if (want->dtype != MT_ST_F32) {
            problem(r, "%s: tensor '%s': dtype %s, the reference must be F32", ref_path, want->name,
                    mt_st_dtype_name(want->dtype));
            continue;
        }
        char want_dims[160], got_dims[160];
        if (strcmp(dims(want, want_dims, sizeof want_dims), dims(got, got_dims, sizeof got_dims))) {
            problem(r, "%s: tensor '%s': shape %s, ours %s", ref_path, want->name, want_dims, got_dims);
            continue;
        }
        float *a = read_tensor(ours, got), *b = read_tensor(ref, want);
        double e = mt_test_rel_err_f32(a, b, want->numel);
        free(a);
        free(b);
        if (!isnan(worst) && !(e <= worst)) { worst = e; worst_name = want->name; } /* a NaN stays the worst */
        if (!(e <= PARITY_BOUND)) problem(r, "tensor '%s': relative error %.3e (bound %g)", want->name, e, PARITY_BOUND);
    }
    /* Tied models: transformers lists no lm_head.weight; ours would be the embedding's anyway. */
    for (int k = 0; k < ours->ntensors; k++)
        if (!mt_st_find(ref, ours->tensors[k].name) && !(cfg.tied && !strcmp(ours->tensors[k].name, "lm_head.weight")))
            problem(r, "%s: tensor '%s': megatrain wrote it, the reference has none", ref_path, ours->tensors[k].name);
    int32_t *targets = read_targets(_i, o.B, o.T);
    check_loss_of_logits(r, ours_path, ours, targets, o.B, o.T, &cfg);
    check_loss_of_logits(r, ref_path, ref, targets, o.B, o.T, &cfg);
    printf("parity %s: loss %.9f, worst relative error %.3e (%s) over %d reference tensors, bound %g\n", fixtures[_i],
           loss, worst, worst_name, ref->ntensors, PARITY_BOUND);
    fflush(stdout);
    free(targets);
    mt_st_close(ours);
    mt_st_close(ref);
    remove_tree(work);
    ck_assert_msg(r->count == 0, "%s: %d problem(s):\n%s", fixtures[_i], r->count, r->text);
    free(r);
}
END_TEST

static void runtime_up(void)
{
    mt_runtime_options ro = { .sched = "eager", .ncpu = 2, .ncuda = 0 };
    char err[512] = "";
    ck_assert_msg(mt_runtime_init(&ro, err, sizeof err) == 0, "mt_runtime_init: %s", err);
}

static void runtime_down(void) { mt_runtime_shutdown(); }

static mt_host_state *load_state(const char *dir, const mt_model_config *cfg)
{
    char err[1024] = "";
    mt_host_state *st = mt_state_create(cfg, MT_DTYPE_F32, 0, err, sizeof err);
    ck_assert_msg(st != NULL, "mt_state_create: %s", err);
    ck_assert_msg(mt_hf_load(dir, st, err, sizeof err) == 0, "%s", err);
    return st;
}

/* The fixture's model, saved by mt_hf_save (fp32, default shards) and loaded again, gives the same
 * masters bit for bit. */
START_TEST(test_hf_round_trip)
{
    char model[4096], work[] = "/tmp/mt-parity-hf.XXXXXX", err[1024] = "";
    model_dir(_i, model, sizeof model);
    ck_assert_msg(mkdtemp(work) != NULL, "mkdtemp failed");
    const mt_model_config cfg = load_config(model);
    mt_host_state *a = load_state(model, &cfg);
    ck_assert_msg(mt_hf_save(work, a, MT_DTYPE_F32, MT_HF_DEFAULT_SHARD_BYTES, err, sizeof err) == 0, "%s", err);
    mt_host_state *b = load_state(work, &cfg);
    for (int t = 0; t < a->ntiles; t++) {
        int64_t bad = -1;
        for (int64_t e = 0; e < a->tiles[t].numel && bad < 0; e++)
            if (memcmp(&a->tiles[t].master[e], &b->tiles[t].master[e], sizeof(float))) bad = e;
        ck_assert_msg(bad < 0, "%s: tile %d element %lld: %.9g after the round trip, %.9g before", fixtures[_i], t,
                      (long long)bad, bad >= 0 ? b->tiles[t].master[bad] : 0.0, bad >= 0 ? a->tiles[t].master[bad] : 0.0);
    }
    mt_state_destroy(a);
    mt_state_destroy(b);
    remove_tree(work);
}
END_TEST

/* Fills `fixtures` with the subdirectories of fixtures_root. Returns -1 when it cannot be read. */
static int list_fixtures(void)
{
    struct dirent **entries;
    int n = scandir(fixtures_root, &entries, NULL, alphasort);
    if (n < 0) return -1;
    fixtures = calloc((size_t)n + 1, sizeof *fixtures);
    for (int k = 0; k < n; k++) {
        char path[4096];
        struct stat sb;
        snprintf(path, sizeof path, "%s/%s", fixtures_root, entries[k]->d_name);
        if (entries[k]->d_name[0] != '.' && stat(path, &sb) == 0 && S_ISDIR(sb.st_mode))
            fixtures[nfixtures++] = strdup(entries[k]->d_name);
        free(entries[k]);
    }
    free(entries);
    return 0;
}

int main(void)
{
    const char *env = getenv("MT_PARITY_FIXTURES");
    snprintf(fixtures_root, sizeof fixtures_root, "%s", env && env[0] ? env : mt_test_source_path("tests/fixtures/parity"));
    if (list_fixtures()) {
        fprintf(stderr, "test_parity: %s: cannot read the directory\n", fixtures_root);
        return EXIT_FAILURE;
    }
    if (nfixtures == 0) {
        /* The fixtures (tools/parity_suite.py on the GPU machine) are committed: none is a failure. */
        fprintf(stderr, "test_parity: no parity fixtures under %s\n", fixtures_root);
        return EXIT_FAILURE;
    }
    Suite *s = suite_create("parity");
    TCase *tg = tcase_create("grads");
    tcase_add_loop_test(tg, test_grads_match_transformers, 0, nfixtures);
    suite_add_tcase(s, tg);
    TCase *th = tcase_create("hf round trip");
    tcase_add_checked_fixture(th, runtime_up, runtime_down);
    tcase_add_loop_test(th, test_hf_round_trip, 0, nfixtures);
    suite_add_tcase(s, th);
    int status = mt_test_run(s, false);
    for (int k = 0; k < nfixtures; k++) free(fixtures[k]);
    free(fixtures);
    return status;
}
