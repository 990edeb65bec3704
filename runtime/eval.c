/* The validation loss of a saved model: the checks a training run makes on its data first, then
 * the weights into a host state and the validation windows through mt_graph_eval, as train's
 * validation does, but over every window (or the first max_sequences). */
#include "runtime/eval.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "models/config.h"
#include "runtime/dataset.h"
#include "runtime/hf.h"
#include "runtime/state.h"
#include "runtime/step.h"
#include "runtime/train.h"
#include "runtime/train_checks.h"

/* A byte corpus's default window, train's. */
#define TEXT_SEQ_LEN 128

mt_eval_options mt_eval_defaults(void)
{
    return (mt_eval_options){ .B = 8, .K = 4, .dtype = MT_DTYPE_F32, .runtime = mt_runtime_defaults() };
}

/* The validation windows: a prepared directory's (padded to a multiple of B with windows whose
 * targets are all -1, which count for nothing), or a corpus's consecutive ones (a last partial
 * micro-batch dropped). *n gets the padded count, *windows the real one; NULL when memory is
 * short. */
static int32_t *windows_of(const mt_run_data *data, int64_t B, int64_t T, int64_t max, int64_t *n, int64_t *windows,
                           int32_t **targets)
{
    int64_t avail;
    if (data->prepared) avail = data->dataset.val.n_seq;
    else avail = data->corpus.nval >= T + 1 ? (data->corpus.nval - 1) / T : 0;
    if (max > 0 && avail > max) avail = max;
    const int64_t room = avail + B;
    int32_t *tok = malloc(sizeof *tok * (size_t)(room * T)), *tgt = malloc(sizeof *tgt * (size_t)(room * T));
    if (!tok || !tgt) {
        free(tok);
        free(tgt);
        return NULL;
    }
    int64_t k;
    if (data->prepared) {
        for (k = 0; k < avail; k++) mt_dataset_window(&data->dataset, &data->dataset.val, k, tok + k * T, tgt + k * T);
        *windows = k;
        for (; k % B; k++)
            for (int64_t t = 0; t < T; t++) { tok[k * T + t] = tok[t]; tgt[k * T + t] = -1; }
    } else {
        k = mt_corpus_validation(&data->corpus, avail, T, tok, tgt);
        k -= k % B;
        *windows = k;
    }
    *n = k;
    *targets = tgt;
    return tok;
}

int mt_eval_run(const mt_eval_options *o, mt_eval_result *res, FILE *log, char *err, size_t errlen)
{
    memset(res, 0, sizeof *res);
    res->loss = res->perplexity = NAN;
    if (!o->model_dir || !o->data_path) {
        snprintf(err, errlen, "--model DIR and --data PATH are both needed");
        return -1;
    }
    if (access(o->data_path, F_OK) != 0) {
        snprintf(err, errlen, "--data %s: %s", o->data_path, strerror(errno));
        return -1;
    }
    char config_path[4200];
    snprintf(config_path, sizeof config_path, "%s/config.json", o->model_dir);
    mt_model_config cfg;
    if (mt_config_load(config_path, &cfg, err, errlen) ||
        (o->rope_scaling && mt_config_set_rope_scaling(&cfg, o->rope_scaling, err, errlen)))
        return -1;
    const bool prepared = mt_dataset_is_prepared(o->data_path);
    int64_t T = o->T;
    if (T == 0) {
        if (prepared) {
            if (mt_dataset_seq_len(o->data_path, &T, err, errlen)) return -1;
        } else {
            T = TEXT_SEQ_LEN;
        }
    }
    if (mt_config_check_seq_len(&cfg, T, err, errlen)) return -1;
    if (!prepared && cfg.vocab < 256) {
        snprintf(err, errlen, "%s: key 'vocab_size': a text corpus is read as bytes, which needs at least 256, got %lld",
                 config_path, (long long)cfg.vocab);
        return -1;
    }
    /* The data checks of a training run, on the same fields. */
    mt_train_options checks = mt_train_defaults();
    checks.model_dir = o->model_dir;
    checks.data_path = o->data_path;
    checks.config_path = config_path;
    checks.step.T = T;
    checks.allow_other_tokenizer = o->allow_other_tokenizer;
    if (mt_train_check_data_kind(&checks, &cfg, config_path, err, errlen) ||
        mt_train_check_tokenizer(&checks, log, err, errlen))
        return -1;
    mt_run_data data;
    if (mt_run_data_open(&data, o->data_path, cfg.vocab, T, T + 1, o->model_dir, err, errlen)) return -1;
    int64_t n = 0, windows = 0;
    int32_t *tgt = NULL, *tok = windows_of(&data, o->B, T, o->max_sequences, &n, &windows, &tgt);
    int rc = -1;
    mt_host_state *st = NULL;
    mt_graph *g = NULL;
    bool runtime_up = false;
    if (!tok) {
        snprintf(err, errlen, "out of memory for the validation windows of %s", o->data_path);
        goto out;
    }
    if (windows == 0) {
        if (prepared)
            snprintf(err, errlen, "%s holds no validation windows (prepared with --val-fraction 0?): prepare it with "
                     "--val-fraction above 0", o->data_path);
        else
            snprintf(err, errlen, "%s: its validation bytes hold fewer than %lld windows of %lld + 1 bytes: lower "
                     "--micro-batch or --seq-len", o->data_path, (long long)o->B, (long long)T);
        goto out;
    }
    if (mt_runtime_init(&o->runtime, err, errlen)) goto out;
    runtime_up = true;
    res->ncuda = mt_runtime_ncuda();
    res->dtype = o->dtype_explicit ? o->dtype : res->ncuda > 0 ? MT_DTYPE_BF16 : MT_DTYPE_F32;
    st = mt_state_create(&cfg, res->dtype, 0, err, errlen);
    if (!st || mt_hf_load(o->model_dir, st, err, errlen)) goto out;
    mt_step_config sc = mt_step_defaults();
    sc.B = o->B;
    sc.T = T;
    sc.K = o->K < 1 ? 1 : o->K > cfg.layers ? (int)cfg.layers : o->K;
    sc.clip = 0;
    g = mt_graph_create(st, &sc, err, errlen);
    if (!g) goto out;
    if (log) {
        fprintf(log, "megatrain: %s (%s, %lld layers, d=%lld, %.2fM parameters), %s on %d CPU + %d CUDA workers\n",
                o->model_dir, cfg.model_type, (long long)cfg.layers, (long long)cfg.hidden,
                mt_config_param_count(&cfg) / 1e6, mt_dtype_name(res->dtype), mt_runtime_ncpu(), res->ncuda);
        fprintf(log, "megatrain: %lld validation windows of %lld tokens of %s, %lld at a time\n", (long long)windows,
                (long long)T, o->data_path, (long long)o->B);
        fflush(log);
    }
    res->loss = mt_graph_eval(g, n, tok, tgt, &res->tokens);
    res->perplexity = exp(res->loss);
    res->sequences = windows;
    res->T = T;
    if (res->tokens == 0) {
        snprintf(err, errlen, "%s: the validation windows count no target (every position masked)", o->data_path);
        goto out;
    }
    rc = 0;
out:
    if (g) mt_graph_destroy(g);
    if (st) mt_state_destroy(st);
    if (runtime_up) mt_runtime_shutdown();
    mt_run_data_close(&data);
    free(tok);
    free(tgt);
    return rc;
}
