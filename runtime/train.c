/* The training loop. Step s+1 is submitted before step s's loss is read, so the task graph
 * always holds one step ahead and the CPU optimizer of step s overlaps the forward of s+1. */
#include "runtime/train.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "codelets/adamw.h"
#include "models/config.h"
#include "models/util.h"
#include "runtime/data.h"
#include "runtime/dataset.h"
#include "mt_build_config.h"
#include "runtime/checkpoint.h"
#include "runtime/hf.h"
#include "runtime/plan.h"

/* The built-in model's config: in the source tree this binary was built from, else beside the
 * executable's build tree (a copied checkout), else where `meson install` puts it. */
static const char *builtin_config_path(void)
{
    static char path[4096];
    const char *rel = "models/configs/tiny-byte.json";
    snprintf(path, sizeof path, "%s/%s", MT_SOURCE_ROOT, rel);
    if (access(path, R_OK) == 0) return path;
    char exe[2048];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
        exe[n] = 0;
        /* build/tools/megatrain -> the checkout is two levels up */
        for (int up = 0; up < 3; up++) {
            char *slash = strrchr(exe, '/');
            if (!slash) break;
            *slash = 0;
            if (up == 2) {
                snprintf(path, sizeof path, "%s/%s", exe, rel);
                if (access(path, R_OK) == 0) return path;
            }
        }
    }
    snprintf(path, sizeof path, "%s/megatrain/configs/tiny-byte.json", MT_DATADIR);
    return path;
}

mt_train_options mt_train_defaults(void)
{
    mt_train_options o = {
        .config_path = builtin_config_path(),
        .data_path = "/usr/share/games/fortunes",
        .steps = 250,
        .step = mt_step_defaults(),
        .lr = 2e-3, .min_lr_ratio = 0.1, .warmup = 30, .schedule = MT_LR_COSINE,
        .seed = 1234, .init_std = 0.02,
        .eval_every = 50, .eval_sequences = 64, .log_every = 10,
        .dtype = MT_DTYPE_F32, .data_shuffle = true,
        .sample_bytes = 300, .sample_prompt = "Q: What is the meaning of life?\nA:",
        .time_limit = 0,
        .tokens_per_step = 0, .activation_budget = (uint64_t)2 << 30,
        .runtime = mt_runtime_defaults(),
    };
    o.step.B = 16;
    o.step.T = 128;
    o.step.K = 2;
    o.step.weight_decay = 0.1;
    o.step.beta2 = 0.99;
    return o;
}

double mt_lr_at(const mt_train_options *o, int64_t s)
{
    if (o->warmup > 0 && s <= o->warmup) return o->lr * (double)s / (double)o->warmup;
    if (o->schedule == MT_LR_CONSTANT) return o->lr;
    double span = (double)(o->steps - o->warmup);
    double prog = span > 0 ? (double)(s - o->warmup) / span : 1.0;
    if (prog > 1) prog = 1;
    double min_lr = o->lr * o->min_lr_ratio;
    return min_lr + 0.5 * (o->lr - min_lr) * (1 + cos(M_PI * prog));
}

static void format_duration(double s, char *buf, size_t len)
{
    if (s < 0 || !isfinite(s)) s = 0;
    long t = (long)(s + 0.5);
    if (t >= 3600) snprintf(buf, len, "%ldh%02ldm", t / 3600, t / 60 % 60);
    else if (t >= 60) snprintf(buf, len, "%ldm%02lds", t / 60, t % 60);
    else snprintf(buf, len, "%lds", t);
}

/* Validation loss over the first eval_sequences windows. Byte corpora drop a last partial
 * micro-batch; prepared data fills it with windows whose targets are all -1, which count for
 * nothing, so every validation window is used. tok/tgt hold (eval_sequences + B) * T. */
static double validate(mt_graph *g, const mt_corpus *c, const mt_dataset *d, const mt_train_options *o,
                       int32_t *tok, int32_t *tgt, int64_t *counted)
{
    const int64_t T = o->step.T, B = o->step.B;
    int64_t n;
    *counted = 0;
    if (d) {
        n = d->val.n_seq < o->eval_sequences ? d->val.n_seq : o->eval_sequences;
        for (int64_t i = 0; i < n; i++) mt_dataset_window(d, &d->val, i, tok + i * T, tgt + i * T);
        if (n == 0) return NAN;
        for (; n % B; n++)
            for (int64_t t = 0; t < T; t++) { tok[n * T + t] = tok[t]; tgt[n * T + t] = -1; }
    } else {
        n = mt_corpus_validation(c, o->eval_sequences, T, tok, tgt);
        n -= n % B;
        if (n == 0) return NAN;
    }
    return mt_graph_eval(g, n, tok, tgt, counted);
}

int mt_train_run(const mt_train_options *o, mt_train_result *res, FILE *log, char *err, size_t errlen)
{
    memset(res, 0, sizeof *res);
    mt_model_config cfg;
    char model_config[4096];
    const char *config_path = o->config_path;
    if (o->model_dir) {
        snprintf(model_config, sizeof model_config, "%s/config.json", o->model_dir);
        config_path = model_config;
    }
    if (mt_config_load(config_path, &cfg, err, errlen)) return -1;
    const bool prepared = mt_dataset_is_prepared(o->data_path);
    if (!prepared && cfg.vocab < 256) {
        snprintf(err, errlen, "%s: key 'vocab_size': the byte-level trainer needs at least 256, got %lld",
                 config_path, (long long)cfg.vocab);
        return -1;
    }
    if (o->steps < 1) {
        snprintf(err, errlen, "steps must be at least 1");
        return -1;
    }
    /* Decide the micro-batch and check host memory before allocating anything. */
    mt_train_options run = *o;
    mt_plan_params pp = { .micro_batch = o->step.B, .seq_len = o->step.T, .grad_accum = o->step.accum,
                          .checkpoint_interval = o->step.K, .compute = o->dtype, .use_gpu = false,
                          .head_chunk = o->step.head_chunk };
    if (o->tokens_per_step > 0) {
        int64_t B, accum;
        if (mt_plan_micro_batch(&cfg, &pp, o->tokens_per_step, o->activation_budget, &B, &accum, err, errlen)) return -1;
        run.step.B = pp.micro_batch = B;
        run.step.accum = (int)accum;
        pp.grad_accum = accum;
    }
    o = &run;
    mt_plan plan;
    if (mt_plan_compute(&cfg, &pp, &plan)) {
        snprintf(err, errlen, "%s", plan.error);
        return -1;
    }
    if (mt_plan_check_host(&plan, mt_host_memory_available(), err, errlen)) return -1;

    mt_run_data data;
    if (mt_run_data_open(&data, o->data_path, cfg.vocab, o->step.T, (o->step.T + 1) * 4, config_path, err, errlen))
        return -1;
    const mt_corpus *corpus = &data.corpus;
    const mt_dataset *ds = data.prepared ? &data.dataset : NULL;

    if (mt_runtime_init(&o->runtime, err, errlen)) {
        mt_run_data_close(&data);
        return -1;
    }
    /* Without an explicit --dtype: bf16 when a GPU computes (the fast path), fp32 on CPU workers. */
    if (!o->dtype_explicit) run.dtype = mt_runtime_ncuda() > 0 ? MT_DTYPE_BF16 : MT_DTYPE_F32;
    int rc = -1;
    mt_host_state *st = mt_state_create(&cfg, o->dtype, 0, err, errlen);
    mt_graph *g = NULL;
    int32_t *tok = NULL, *tgt = NULL, *vtok = NULL, *vtgt = NULL;
    if (!st) goto out;
    mt_state_init_random(st, o->seed, o->init_std);
    if (o->model_dir && mt_hf_load(o->model_dir, st, err, errlen)) goto out;
    g = mt_graph_create(st, &o->step, err, errlen);
    if (!g) goto out;

    const int64_t per_step = o->step.accum * o->step.B * o->step.T;
    tok = malloc(sizeof *tok * per_step);
    tgt = malloc(sizeof *tgt * per_step);
    vtok = malloc(sizeof *vtok * (o->eval_sequences + o->step.B) * o->step.T);
    vtgt = malloc(sizeof *vtgt * (o->eval_sequences + o->step.B) * o->step.T);
    res->losses = calloc(o->steps, sizeof(double));

    if (log) {
        fprintf(log, "megatrain: %s (%s, %lld layers, d=%lld, %.2fM parameters), %s dtype\n", o->model_dir ? o->model_dir : config_path,
                cfg.model_type, (long long)cfg.layers, (long long)cfg.hidden, mt_config_param_count(&cfg) / 1e6,
                mt_dtype_name(o->dtype));
        if (ds)
            fprintf(log, "megatrain: data %s (%s, tokenizer %s): %lld train + %lld validation windows of %lld tokens, %s order\n",
                    o->data_path, ds->family, ds->tokenizer, (long long)ds->train.n_seq, (long long)ds->val.n_seq,
                    (long long)ds->seq_len, o->data_shuffle ? "shuffled" : "sequential");
        else
            fprintf(log, "megatrain: corpus %s: %d files, %.2f MB train, %.2f MB validation\n", o->data_path,
                    corpus->nfiles, corpus->ntrain / 1e6, corpus->nval / 1e6);
        fprintf(log, "megatrain: %lld steps of %d x %lld x %lld tokens, K=%d, clip %g, lr %g (%s), %d CPU + %d CUDA workers, policy %s\n",
                (long long)o->steps, o->step.accum, (long long)o->step.B, (long long)o->step.T, o->step.K, o->step.clip,
                o->lr, o->schedule == MT_LR_COSINE ? "warm-up + cosine" : "constant", mt_runtime_ncpu(),
                mt_runtime_ncuda(), o->runtime.sched ? o->runtime.sched : mt_default_sched());
        mt_graph_log_defer(g, log, "megatrain");
    }
    mt_rng rng;
    mt_rng_seed(&rng, o->seed);
    int64_t first = 1;
    if (o->resume_path) {
        mt_checkpoint_meta meta;
        if (mt_checkpoint_load(o->resume_path, st, &meta, err, errlen)) goto out;
        if (meta.step >= o->steps) {
            snprintf(err, errlen, "%s: the checkpoint is at step %lld, --steps is %lld: nothing left to do",
                     o->resume_path, (long long)meta.step, (long long)o->steps);
            goto out;
        }
        first = meta.step + 1;
        rng.state = meta.rng_state;
        if (log) fprintf(log, "megatrain: resumed from %s at step %lld\n", o->resume_path, (long long)meta.step);
    }
    int64_t counted;
    res->first_val = validate(g, corpus, ds, o, vtok, vtgt, &counted);
    if (log) fprintf(log, "step %5lld | val %.4f\n", (long long)(first - 1), res->first_val);

    double t0 = mt_clock_s();
    const mt_ranged_counts rc0 = mt_adamw_stats_ranged(mt_graph_adamw_stats(g));
    int slot = -1;
    int64_t last = o->stop_after > 0 && o->stop_after < o->steps ? o->stop_after : o->steps;
    for (int64_t s = first; s <= last + 1; s++) {
        const int64_t p = s - 1; /* the step reported in this iteration */
        if (p >= first) {
            /* Step s is not submitted yet: the loss of p is known halfway through p, so the
             * graph still holds p's backward and update while we report, validate or save. */
            double gnorm;
            double loss = mt_graph_wait_loss(g, slot, &gnorm);
            res->losses[p - 1] = loss;
            res->steps_done = p;
            if (p == first) res->first_loss = loss;
            res->last_loss = loss;
            double el = mt_clock_s() - t0;
            int64_t done = p - first + 1;
            if (!isfinite(loss)) {
                snprintf(err, errlen, "training diverged at step %lld (loss %g); try a lower --lr", (long long)p, loss);
                goto out;
            }
            bool eval_now = o->eval_every > 0 && p % o->eval_every == 0 && p < last;
            if (log && (p % o->log_every == 0 || p == first || eval_now)) {
                char eta[32];
                format_duration(el / done * (last - p), eta, sizeof eta);
                fprintf(log, "step %5lld/%lld | loss %.4f | grad-norm %7.3f | lr %.2e | %6.0f tok/s | ETA %s",
                        (long long)p, (long long)o->steps, loss, gnorm, mt_lr_at(o, p), done * per_step / el, eta);
                if (!eval_now) fputc('\n', log);
                fflush(log);
            }
            /* Validation reads the weights after p's update: it is ordered before step s. */
            if (eval_now) {
                double v = validate(g, corpus, ds, o, vtok, vtgt, &counted);
                if (log) fprintf(log, " | val %.4f\n", v);
            }
            bool stop = o->time_limit > 0 && el > o->time_limit && p < last;
            if (o->checkpoint_path && ((o->save_every > 0 && p % o->save_every == 0) || p == last || stop)) {
                mt_graph_flush(g); /* the state of step p's update, whole */
                starpu_task_wait_for_all();
                mt_checkpoint_meta meta = { .step = p, .rng_state = rng.state, .seed = o->seed };
                if (mt_checkpoint_save(o->checkpoint_path, st, &meta, err, errlen)) goto out;
                if (log) fprintf(log, "megatrain: checkpoint of step %lld saved to %s\n", (long long)p, o->checkpoint_path);
            }
            if (stop) {
                if (log) fprintf(log, "megatrain: time limit %.0f s reached after step %lld\n", o->time_limit, (long long)p);
                break;
            }
        }
        if (s <= last) {
            const int64_t windows = o->step.accum * o->step.B;
            mt_run_data_batch(&data, o->data_shuffle, o->seed, (s - 1) * windows, &rng, windows, o->step.T, tok, tgt);
            slot = mt_graph_submit_step(g, s, tok, tgt, mt_lr_at(o, s));
        }
    }
    mt_graph_flush(g);
    starpu_task_wait_for_all();
    res->seconds = mt_clock_s() - t0;
    res->tokens_per_second = (res->steps_done - first + 1) * per_step / res->seconds;
    res->weights_hash = mt_state_hash(st);
    if (o->save_model_dir) {
        if (mt_hf_save(o->save_model_dir, st, MT_DTYPE_F32, MT_HF_DEFAULT_SHARD_BYTES, err, errlen)) goto out;
        if (log) fprintf(log, "megatrain: model saved to %s (HF format, fp32)\n", o->save_model_dir);
    }
    res->last_val = validate(g, corpus, ds, o, vtok, vtgt, &res->val_counted);
    if (log) fprintf(log, "done: %lld steps in %.1f s (%.0f tok/s) | train loss %.4f -> %.4f | val %.4f -> %.4f nats/%s\n",
                     (long long)res->steps_done, res->seconds, res->tokens_per_second, res->first_loss,
                     res->last_loss, res->first_val, res->last_val, ds ? "token" : "byte");
    int64_t speculated, held;
    mt_graph_speculation_counts(g, &speculated, &held);
    if (log && o->step.clip > 0)
        fprintf(log, "clipping at %g: the update ran ahead of the norm in %lld steps; the norm was within the bound in "
                     "%lld of them (--clip-speculate)\n", o->step.clip, (long long)speculated, (long long)held);
    const mt_ranged_counts rc1 = mt_adamw_stats_ranged(mt_graph_adamw_stats(g));
    const long long checked = rc1.checked - rc0.checked, skipped = rc1.skipped - rc0.skipped;
    if (log && checked + skipped > 0)
        fprintf(log, "clipping at %g: ranged speculation checked %lld parameter updates, flagged %.3f%% of them for a "
                     "redo; %lld not speculated (range too wide: %lld; the last norm's prediction missed: %lld), %lld "
                     "redone whole (scale outside the range)\n",
                o->step.clip, checked, checked ? 100.0 * (double)(rc1.flagged - rc0.flagged) / (double)checked : 0.0,
                skipped, skipped - (long long)(rc1.unheld - rc0.unheld), (long long)(rc1.unheld - rc0.unheld),
                (long long)(rc1.outside - rc0.outside));
    /* Sampling decodes bytes: it is the byte-level model's; prepared data has its own tokenizer. */
    if (log && !ds && o->sample_bytes > 0) {
        starpu_task_wait_for_all();
        size_t plen = strlen(o->sample_prompt);
        char *text = malloc(plen + o->sample_bytes + 1);
        mt_generate(st, o->sample_prompt, o->sample_bytes, o->step.T, 0.8, o->seed, text);
        fprintf(log, "--- sample (temperature 0.8) ---\n%s\n--- end of sample ---\n", text);
        free(text);
    }
    rc = 0;
out:
    free(tok); free(tgt); free(vtok); free(vtgt);
    mt_graph_destroy(g);
    mt_state_destroy(st);
    mt_runtime_shutdown();
    mt_run_data_close(&data);
    return rc;
}
