/* The training loop. Step s+1 is submitted before step s's loss is read, so the task graph
 * always holds one step ahead and the CPU optimizer of step s overlaps the forward of s+1. */
#include "runtime/train.h"

#include <malloc.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "codelets/adamw.h"
#include "models/config.h"
#include "models/util.h"
#include "runtime/data.h"
#include "runtime/dataset.h"
#include "runtime/dist.h"
#include "mt_build_config.h"
#include "runtime/checkpoint.h"
#include "runtime/files.h"
#include "runtime/generate.h"
#include "runtime/hf.h"
#include "runtime/metrics.h"
#include "runtime/plan.h"
#include "runtime/train_checks.h"

/* glibc's default mmap threshold, here fixed (mt_train_run says why). */
#define MT_TRAIN_MMAP_THRESHOLD (128 * 1024)

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
        .eval_every = 50, .eval_at_start = true, .eval_sequences = 64, .log_every = 10,
        .dtype = MT_DTYPE_F32, .data_shuffle = true, .host_layout = MT_LAYOUT_AUTO,
        .sample_bytes = 300, .sample_prompt = "Q: What is the meaning of life?\nA:",
        .time_limit = 0,
        .tokens_per_step = 0, .activation_budget = (uint64_t)2 << 30,
        .runtime = mt_runtime_defaults(), .router_aux_loss = -1,
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

/* A line (or the end of one) on the log, flushed at once: after a kill, the log has said all that
 * is on disk. */
static void say(FILE *log, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void say(FILE *log, const char *fmt, ...)
{
    if (!log) return;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(log, fmt, ap);
    va_end(ap);
    fflush(log);
}

static const char *signal_name(int sig, char *buf, size_t len)
{
    if (sig == SIGINT) return "SIGINT";
    if (sig == SIGTERM) return "SIGTERM";
    snprintf(buf, len, "signal %d", sig);
    return buf;
}

/* The global norm the last norm task computed (clipping on), once it has run. */
static double read_norm(mt_graph *g)
{
    starpu_data_handle_t h = mt_graph_clip_handle(g);
    starpu_data_acquire(h, STARPU_R);
    const double norm = ((const double *)starpu_vector_get_local_ptr(h))[0];
    starpu_data_release(h);
    return norm;
}

/* Whether a step's values allow its update: without clipping no norm is computed, so only the
 * loss is checked. */
static bool finite_step(const mt_train_options *o, double loss, double norm)
{
    return isfinite(loss) && (o->step.clip <= 0 || isfinite(norm));
}

/* Saves the state after step p's update (no task left in flight) as the run's checkpoint. Over
 * several ranks every rank saves its shard, the others' first: rank 0's file, written last, once
 * every other shard of the step is on disk, names the step, so that whenever a run is cut short
 * the checkpoint file holds a step all of whose shards exist. Collective then. */
static int save_checkpoint(const mt_train_options *o, mt_graph *g, const mt_host_state *st, mt_checkpoint_meta *meta,
                           FILE *log, char *err, size_t errlen)
{
    mt_graph_flush(g); /* the state of step p's update, whole */
    starpu_task_wait_for_all();
    char written[4200];
    const int ranks = st->shard_ranks, rank = st->shard_rank;
    if (ranks > 1) {
        int bad = 0;
        if (rank > 0) {
            mt_checkpoint_shard_name(o->checkpoint_path, rank, ranks, meta->step, written, sizeof written);
            bad = mt_checkpoint_save(written, st, meta, err, errlen) != 0;
        }
        const int64_t failed = mt_dist_max_i64(bad ? rank : 0);
        if (failed) {
            if (!bad)
                snprintf(err, errlen, "rank %lld could not write its shard of the checkpoint of step %lld (its error is on "
                         "its own output); the last complete checkpoint is untouched", (long long)failed,
                         (long long)meta->step);
            return -1;
        }
    }
    int bad = rank == 0 && mt_checkpoint_save_kept(o->checkpoint_path, o->keep_last, st, meta, written, sizeof written,
                                                   err, errlen) != 0;
    if (ranks > 1) {
        if (mt_dist_max_i64(bad)) {
            if (!bad) snprintf(err, errlen, "rank 0 could not write the checkpoint of step %lld", (long long)meta->step);
            return -1;
        }
        if (rank > 0) mt_checkpoint_prune_shards(o->checkpoint_path, rank, ranks, meta->step, o->keep_last);
    }
    if (bad) return -1;
    say(log, "megatrain: checkpoint of step %lld saved to %s%s\n", (long long)meta->step, written,
        ranks > 1 ? " and the other ranks' shards beside it" : "");
    return 0;
}

/* Loads the resumed checkpoint: rank 0's file, or over several ranks each rank's shard (named
 * after the step rank 0's file holds), then every tile's weights from its owner. Collective then. */
static int load_checkpoint(const char *path, const mt_checkpoint_meta *header, mt_host_state *st, mt_checkpoint_meta *meta,
                           char *err, size_t errlen)
{
    const int ranks = st->shard_ranks, rank = st->shard_rank;
    char shard[4400];
    snprintf(shard, sizeof shard, "%s", path);
    if (rank > 0) {
        char base[4200];
        mt_checkpoint_base_of(path, header->step, base, sizeof base);
        mt_checkpoint_shard_name(base, rank, ranks, header->step, shard, sizeof shard);
    }
    int bad = mt_checkpoint_load(shard, st, meta, err, errlen) != 0;
    if (!bad && meta->step != header->step) {
        snprintf(err, errlen, "%s: a shard of step %lld, and %s is of step %lld", shard, (long long)meta->step, path,
                 (long long)header->step);
        bad = 1;
    }
    if (ranks > 1) {
        const int64_t failed = mt_dist_max_i64(bad ? rank + 1 : 0);
        if (failed) {
            if (!bad)
                snprintf(err, errlen, "rank %lld could not read its shard of %s (its error is on its own output)",
                         (long long)failed - 1, path);
            return -1;
        }
        return mt_dist_share_weights(st, err, errlen);
    }
    return bad ? -1 : 0;
}

/* The dtype the trained model is saved in: as asked, else that of the base model's weights
 * (bf16 stays bf16; f16, which is not written, and fp32 give fp32), else fp32. */
static int saved_dtype(const mt_train_options *o, mt_dtype *dtype, char *err, size_t errlen)
{
    *dtype = MT_DTYPE_F32;
    if (o->save_dtype_explicit) *dtype = o->save_dtype;
    else if (o->save_model_dir && o->model_dir) {
        mt_st_dtype d;
        if (mt_hf_weights_dtype(o->model_dir, &d, err, errlen)) return -1;
        if (d == MT_ST_BF16) *dtype = MT_DTYPE_BF16;
    }
    return 0;
}

/* Writes the model and the base model's tokenizer files: a complete HF directory. */
static int save_model(const mt_train_options *o, const mt_host_state *st, mt_dtype dtype, FILE *log, char *err,
                      size_t errlen)
{
    say(log, "megatrain: writing the model to %s ...\n", o->save_model_dir);
    if (mt_hf_save(o->save_model_dir, st, dtype, MT_HF_DEFAULT_SHARD_BYTES, err, errlen)) return -1;
    int copied = 0, kept = 0;
    if (o->model_dir && mt_hf_copy_tokenizer(o->model_dir, o->save_model_dir, &copied, err, errlen)) return -1;
    if (o->model_dir && mt_hf_keep_base_config(o->model_dir, o->save_model_dir, &kept, err, errlen)) return -1;
    char extra[4200] = "";
    size_t at = 0;
    if (copied) at += (size_t)snprintf(extra, sizeof extra, ", %d tokenizer files from %s", copied, o->model_dir);
    if (kept && at < sizeof extra)
        snprintf(extra + at, sizeof extra - at, ", %d more config.json keys of %s", kept, o->model_dir);
    say(log, "megatrain: model saved to %s (HF format, %s weights%s)\n", o->save_model_dir, mt_dtype_name(dtype), extra);
    return 0;
}

int mt_train_run(const mt_train_options *o, mt_train_result *res, FILE *log, char *err, size_t errlen)
{
    const uint64_t program_bytes = mt_host_rss(); /* the plan's: before the run loads anything */
    /* Large buffers always mapped on their own, so that what is freed goes back at once: glibc's
     * threshold otherwise rises with each such free, and the buffers StarPU then places in the
     * workers' arenas stay resident by amounts that depend on thread timing, which no plan can
     * count. */
    mallopt(M_MMAP_THRESHOLD, MT_TRAIN_MMAP_THRESHOLD);
    memset(res, 0, sizeof *res);
    res->first_val = res->last_val = NAN;
    mt_model_config cfg;
    char model_config[4096];
    const char *config_path = o->config_path;
    if (o->model_dir) {
        snprintf(model_config, sizeof model_config, "%s/config.json", o->model_dir);
        config_path = model_config;
    }
    if (mt_config_load(config_path, &cfg, err, errlen)) return -1;
    if ((o->rope_scaling && mt_config_set_rope_scaling(&cfg, o->rope_scaling, err, errlen)) ||
        mt_config_check_seq_len(&cfg, o->step.T, err, errlen))
        return -1;
    cfg.mlp_chunk = o->step.mlp_chunk;
    if (o->router_aux_loss >= 0) {
        if (o->router_aux_loss > 0 && mt_config_sparse_layers(&cfg) == 0) {
            snprintf(err, errlen, "%s: --router-aux-loss %g: the model has no mixture-of-experts layer, so no router "
                     "to balance; leave the option out", config_path, o->router_aux_loss);
            return -1;
        }
        cfg.router_aux = o->router_aux_loss > 0 ? MT_ROUTER_AUX_ON : MT_ROUTER_AUX_OFF;
        if (o->router_aux_loss > 0) cfg.router_aux_coef_run = o->router_aux_loss;
    }
    const bool prepared = mt_dataset_is_prepared(o->data_path);
    if (!prepared && cfg.vocab < 256) {
        snprintf(err, errlen, "%s: key 'vocab_size': the byte-level trainer needs at least 256, got %lld",
                 config_path, (long long)cfg.vocab);
        return -1;
    }
    /* Everything that can be refused is, before any long work (data, weights, steps). */
    if (mt_train_check_options(o, err, errlen) || mt_train_check_data_kind(o, &cfg, config_path, err, errlen) ||
        mt_train_check_outputs(o, err, errlen) || mt_train_check_tokenizer(o, log, err, errlen))
        return -1;
    mt_dtype save_dtype;
    if (saved_dtype(o, &save_dtype, err, errlen)) return -1;
    mt_checkpoint_meta header, *resumed = NULL; /* the resumed checkpoint's step and settings */
    if (o->resume_path) {
        if (mt_checkpoint_read_header(o->resume_path, &cfg, &header, err, errlen)) return -1;
        resumed = &header;
        /* a sharded checkpoint (one file per rank) continues on the ranks that wrote it */
        const int launched = mt_dist_launched_size();
        if ((int64_t)header.shard_ranks != launched) {
            if (header.shard_ranks > 1)
                snprintf(err, errlen, "%s: a checkpoint written by %u ranks (a shard per rank); this run has %d: resume "
                         "with mpirun -np %u", o->resume_path, header.shard_ranks, launched, header.shard_ranks);
            else
                snprintf(err, errlen, "%s: a checkpoint of one process, not written by %d ranks: resume it without mpirun",
                         o->resume_path, launched);
            return -1;
        }
    }
    const int64_t last = o->stop_after > 0 && o->stop_after < o->steps ? o->stop_after : o->steps;
    /* A checkpoint at the end: only the model is left to write (a save cut short is redone). */
    const bool save_only = resumed && resumed->step >= last;
    if (save_only && !o->save_model_dir) {
        snprintf(err, errlen, "%s: the checkpoint is at step %lld, the run ends at step %lld: nothing left to do "
                 "(--save-model DIR writes its model)", o->resume_path, (long long)resumed->step, (long long)last);
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
    /* Skipping withholds an update until its step's loss and norm are known: nothing may run it
     * ahead of them. */
    const bool skip_mode = o->on_nonfinite == MT_NONFINITE_SKIP;
    if (skip_mode) {
        run.step.clip_speculate = 0;
        run.step.adamw_defer = 0;
    }
    o = &run;

    mt_run_data data;
    if (mt_run_data_open(&data, o->data_path, cfg.vocab, o->step.T, (o->step.T + 1) * 4, config_path, err, errlen))
        return -1;
    const mt_corpus *corpus = &data.corpus;
    const mt_dataset *ds = data.prepared ? &data.dataset : NULL;

    /* StarPU's start puts its own SIGINT handler in front of the caller's, which it hands the
     * signal to only after putting it back: two quick signals then reach the caller's as one.
     * The caller that stops runs on signals gets its handler back. */
    struct sigaction caller_sigint;
    sigaction(SIGINT, NULL, &caller_sigint);
    run.runtime.distributed = true; /* when launched as one of several ranks (runtime/dist.h) */
    if (mt_runtime_init(&o->runtime, err, errlen)) {
        mt_run_data_close(&data);
        return -1;
    }
    if (o->stop_signal) sigaction(SIGINT, &caller_sigint, NULL);
    /* Without an explicit --dtype: bf16 when a GPU computes (the fast path), fp32 on CPU workers. */
    if (!o->dtype_explicit) run.dtype = mt_runtime_ncuda() > 0 ? MT_DTYPE_BF16 : MT_DTYPE_F32;
    /* Several ranks: each trains its share of the global batch on a sharded host state (the
     * gradients are summed into each tile's owner, which updates it and sends the weights to the
     * others, in the step graph); every rank writes its shard of the checkpoint; rank 0 alone logs
     * and writes the metrics and the model, reading the other ranks' masters from them. */
    const int ranks = mt_dist_size(), rank = mt_dist_rank();
    /* What reads the whole model at the end, decided alike on every rank (collectives serve it):
     * the model's save and the weights' hash read rank 0's masters one tile at a time, each sent
     * by its owner then (mt_dist_masters_open); the byte-level sample, which reads every master
     * for each byte it draws, has them all gathered to rank 0 first. */
    const bool gather_all = ranks > 1 && !ds && o->sample_bytes > 0;
    const bool tile_at_a_time = ranks > 1 && (o->save_model_dir || o->hash_weights);
    if (rank > 0) {
        log = NULL;
        run.metrics_path = NULL;
        run.save_model_dir = NULL;
    }
    int rc = -1;
    mt_host_state *st = NULL;
    mt_graph *g = NULL;
    int32_t *tok = NULL, *tgt = NULL, *vtok = NULL, *vtgt = NULL;
    mt_metrics metrics = { 0 };
    char settings[MT_CHECKPOINT_SETTINGS_MAX];
    mt_checkpoint_meta checkpoint = { .step = 0 }, *meta = &checkpoint; /* the last one saved or loaded */
    char identity[256];
    mt_train_data_identity(&data, identity, sizeof identity);
    mt_train_settings(o, identity, settings, sizeof settings);
    if (ranks > 1 && o->host_layout == MT_LAYOUT_COMPACT) {
        snprintf(err, errlen, "--host-layout compact: a run over %d ranks sums the gradients in fp32, which the compact "
                 "layout does not keep; use --host-layout full (or auto)", ranks);
        goto out;
    }
    if (mt_dist_check_same("options or data", settings, strlen(settings), err, errlen)) goto out;
    if (resumed && mt_train_check_settings(o, o->resume_path, resumed->settings, settings, log, err, errlen)) goto out;
    /* Leftovers of killed runs (numbered checkpoints' and links' temporaries share the prefix). */
    if (o->checkpoint_path) mt_remove_stale_temporaries_of(o->checkpoint_path, log, "megatrain");
    if (o->save_model_dir) mt_remove_stale_temporaries(o->save_model_dir, "", log, "megatrain");
    if (o->metrics_path) {
        mt_remove_stale_temporaries_of(o->metrics_path, log, "megatrain");
        if (mt_metrics_open(&metrics, o->metrics_path, resumed ? resumed->step : 0, err, errlen)) goto out;
    }

    /* The host layout, and the host check, once the dtype and the workers are known. */
    pp.compute = o->dtype;
    pp.use_gpu = mt_runtime_ncuda() > 0;
    pp.devices = mt_runtime_ncuda();
    pp.ranks = ranks;
    pp.gather_masters = gather_all;
    pp.offload_checkpoints = o->step.offload_checkpoints;
    pp.k_default = o->k_default;
    pp.process = (mt_plan_process){ .counted = true, .ncpu = mt_runtime_ncpu(), .program_bytes = program_bytes,
                                    .eval_sequences = o->eval_sequences };
    if (mt_plan_data_bytes(o->data_path, &pp.process.data_bytes, err, errlen)) goto out;
    mt_plan plan;
    mt_run_choice chosen; /* plan's choice (tools/cli/plan.c): the host layout, the GPU, auto's K */
    const char *gpu_source;
    /* The ranks of a node start together and each sees the node's memory free: each plans
     * within its share of it, so that together they fit. */
    const int node_ranks = ranks > 1 ? mt_dist_local_size() : 1;
    const uint64_t avail = mt_host_memory_available() / (uint64_t)(node_ranks > 0 ? node_ranks : 1);
    const uint64_t gpu_memory = mt_plan_gpu_memory(o->gpu_memory, mt_runtime_ncuda(), &gpu_source);
    if (mt_plan_choose_run(&cfg, &pp, o->host_layout, avail, gpu_memory, &plan, &chosen)) {
        snprintf(err, errlen, "%s", plan.error);
        goto out;
    }
    if (mt_plan_run_refusal(&plan, &chosen, err, errlen)) {
        if (node_ranks > 1 && !chosen.layout.fits) {
            const size_t n = strlen(err);
            snprintf(err + n, errlen - n, " (this rank's share of the node's available memory: %d ranks run on this node)",
                     node_ranks);
        }
        goto out;
    }
    const mt_layout_choice layout = chosen.layout;
    if (chosen.k_auto) {
        run.step.K = (int)chosen.K;
        say(log, "megatrain: checkpoint interval %s\n", chosen.why_k);
    }
    run.step.offload_checkpoints = chosen.offload ? 1 : 0; /* auto resolved as plan resolves it */
    cfg.mlp_chunk = chosen.mlp_chunk; /* auto resolved likewise */
    if (chosen.mlp_chunk_auto && chosen.mlp_chunk > 0) say(log, "megatrain: %s\n", chosen.why_mlp_chunk);
    if (pp.use_gpu) say(log, "megatrain: checkpoints %s\n", chosen.why_offload);
    if (chosen.gpu_checked) {
        char need[32], have[32];
        say(log, "megatrain: GPU plan %s (buffers, StarPU's margin, CUDA context) within the %s of the GPU (%s)\n",
            mt_format_bytes(plan.gpu_need, need, sizeof need), mt_format_bytes(gpu_memory, have, sizeof have), gpu_source);
    }
    const mt_state_args sa = { .cfg = &cfg, .compute_dtype = o->dtype, .layout = layout.layout, .shard_ranks = ranks,
                               .shard_rank = rank };
    st = mt_state_create_with(&sa, err, errlen);
    if (!st) goto out;
    mt_state_init_random(st, o->seed, o->init_std);
    if (o->model_dir && mt_hf_load(o->model_dir, st, err, errlen)) goto out;
    g = mt_graph_create(st, &o->step, err, errlen);
    if (!g) goto out;

    /* per_step: the global batch's tokens, every rank's; this rank trains its slice of it */
    const int64_t rank_step = o->step.accum * o->step.B * o->step.T, per_step = rank_step * ranks;
    tok = malloc(sizeof *tok * per_step);
    tgt = malloc(sizeof *tgt * per_step);
    vtok = malloc(sizeof *vtok * (o->eval_sequences + o->step.B) * o->step.T);
    vtgt = malloc(sizeof *vtgt * (o->eval_sequences + o->step.B) * o->step.T);
    res->losses = calloc(o->steps, sizeof(double));

    if (log) {
        fprintf(log, "megatrain: %s (%s, %lld layers, d=%lld, %.2fM parameters), %s dtype\n", o->model_dir ? o->model_dir : config_path,
                cfg.model_type, (long long)cfg.layers, (long long)cfg.hidden, mt_config_param_count(&cfg) / 1e6,
                mt_dtype_name(o->dtype));
        if (mt_config_router_aux_coef(&cfg) > 0)
            fprintf(log, "megatrain: the router's load-balancing loss is on (coefficient %g): the step's loss includes "
                         "it, the validation loss does not\n", mt_config_router_aux_coef(&cfg));
        if (ds)
            fprintf(log, "megatrain: data %s (%s, tokenizer %s): %lld train + %lld validation windows of %lld tokens, %s order\n",
                    o->data_path, ds->family, ds->tokenizer, (long long)ds->train.n_seq, (long long)ds->val.n_seq,
                    (long long)ds->seq_len, o->data_shuffle ? "shuffled" : "sequential");
        else {
            /* Binary units with two decimals: a small corpus reads as KiB or bytes, never 0.00 MB. */
            char train_bytes[32], val_bytes[32];
            fprintf(log, "megatrain: corpus %s: %d file%s, %s train, %s validation\n", o->data_path, corpus->nfiles,
                    corpus->nfiles == 1 ? "" : "s",
                    mt_format_bytes((uint64_t)corpus->ntrain, train_bytes, sizeof train_bytes),
                    mt_format_bytes((uint64_t)corpus->nval, val_bytes, sizeof val_bytes));
        }
        fprintf(log, "megatrain: %lld step%s of %d x %lld x %lld tokens, K=%d, clip %g, lr %g (%s), %d CPU + %d CUDA workers, policy %s\n",
                (long long)o->steps, o->steps == 1 ? "" : "s", o->step.accum, (long long)o->step.B, (long long)o->step.T, o->step.K, o->step.clip,
                o->lr, o->schedule == MT_LR_COSINE ? "warm-up + cosine" : "constant", mt_runtime_ncpu(),
                mt_runtime_ncuda(), o->runtime.sched ? o->runtime.sched : mt_default_sched());
        fprintf(log, "megatrain: %s host layout (--host-layout %s), %.2f bytes per parameter of host memory: %s\n",
                mt_host_layout_name(layout.layout), mt_host_layout_name(o->host_layout),
                (double)layout.host_total / (double)plan.param_count, layout.why);
        mt_graph_log_defer(g, log, "megatrain");
        mt_graph_log_devices(g, log, "megatrain");
        if (ranks > 1)
            fprintf(log, "megatrain: %d ranks (StarPU-MPI), each training %d x %lld sequences of the global batch's %lld; "
                         "each tile's gradient summed into its owner (rank tile mod %d), which alone holds its master and "
                         "moments and sends the updated weights (no clip speculation)\n",
                    ranks, o->step.accum, (long long)o->step.B, (long long)(o->step.accum * o->step.B * ranks), ranks);
    }
    mt_rng rng;
    mt_rng_seed(&rng, o->seed);
    int64_t first = 1, updates = 0; /* updates: AdamW updates applied before step `first` */
    if (resumed) {
        if (load_checkpoint(o->resume_path, resumed, st, meta, err, errlen)) goto out;
        first = meta->step + 1;
        updates = meta->updates;
        rng.state = meta->rng_state;
        say(log, "megatrain: resumed from %s at step %lld\n", o->resume_path, (long long)meta->step);
    }
    /* Said, and so flushed, after the header lines of every run. */
    if (o->schedule == MT_LR_COSINE)
        say(log, "megatrain: learning rate: %lld warm-up step%s to %g, then cosine to %g at step %lld\n",
            (long long)o->warmup, o->warmup == 1 ? "" : "s", o->lr, o->lr * o->min_lr_ratio, (long long)o->steps);
    else
        say(log, "megatrain: learning rate: %lld warm-up step%s to %g, then constant\n", (long long)o->warmup,
            o->warmup == 1 ? "" : "s", o->lr);
    if (skip_mode) say(log, "megatrain: --on-nonfinite skip: each update waits for its step's loss and gradient norm\n");
    res->first_step = first;
    res->steps_done = first - 1;
    int64_t counted;
    /* Whether there is validation data: prepared data may hold none (--val-fraction 0). */
    const bool has_val = ds ? ds->val.n_seq > 0 : mt_corpus_validation(corpus, o->eval_sequences, o->step.T, vtok, vtgt) >= o->step.B;
    if (!has_val) say(log, "megatrain: no validation data in %s: no validation loss is measured\n", o->data_path);
    if (has_val && o->eval_at_start && !save_only) {
        res->first_val = validate(g, corpus, ds, o, vtok, vtgt, &counted);
        say(log, "step %5lld | val %.4f\n", (long long)(first - 1), res->first_val);
    }
    if (save_only) say(log, "megatrain: the checkpoint is at step %lld, the run ends at step %lld: nothing to train\n",
                       (long long)meta->step, (long long)last);
    /* Training data passed per step, for the epoch count. */
    const double epoch_per_step = ds ? (double)(o->step.accum * o->step.B * ranks) / (double)ds->train.n_seq
                                     : (double)per_step / (double)corpus->ntrain;

    double t0 = mt_clock_s();
    const mt_ranged_counts rc0 = mt_adamw_stats_ranged(mt_graph_adamw_stats(g));
    int slot = -1;
    double t_prev = t0;
    double next_loss = NAN, next_norm = NAN; /* skip mode: those of the step last submitted */
    bool next_skipped = false;
    int sig = 0;
    char signame[32];
    for (int64_t s = first; s <= last + 1; s++) {
        const int64_t p = s - 1; /* the step reported in this iteration */
        if (p >= first) {
            /* Step s is not submitted yet: the loss of p is known halfway through p, so the
             * graph still holds p's backward and update while we report, validate or save. */
            double gnorm = next_norm, loss = next_loss;
            const bool skipped = skip_mode && next_skipped;
            if (!skip_mode) loss = mt_graph_wait_loss(g, slot, &gnorm);
            res->losses[p - 1] = loss;
            res->steps_done = p;
            if (p == first) res->first_loss = loss;
            res->last_loss = loss;
            const double t = mt_clock_s(), el = t - t0;
            const int64_t done = p - first + 1;
            mt_metrics_row row = { .step = p, .loss = loss, .grad_norm = gnorm, .lr = mt_lr_at(o, p),
                                   .tokens_per_s = per_step / (t - t_prev), .elapsed_s = el,
                                   .epoch = p * epoch_per_step, .val_loss = NAN, .skipped = skipped };
            t_prev = t;
            if (!skip_mode && !finite_step(o, loss, gnorm)) {
                mt_metrics_write(&metrics, &row);
                char kept[4400] = "; no checkpoint was saved";
                if (o->checkpoint_path && meta->step > 0)
                    snprintf(kept, sizeof kept, "; the last checkpoint, %s at step %lld, is intact", o->checkpoint_path,
                             (long long)meta->step);
                snprintf(err, errlen, "step %lld: loss %g, gradient norm %g: not finite, the run stops%s; try a lower "
                         "--lr, or --on-nonfinite skip to skip such steps", (long long)p, loss, gnorm, kept);
                goto out;
            }
            if (skipped) {
                res->skipped++;
                say(log, "step %5lld/%lld | loss %g | grad-norm %g: not finite, the update is skipped (--on-nonfinite "
                    "skip)\n", (long long)p, (long long)o->steps, loss, gnorm);
            }
            const bool eval_now = has_val && o->eval_every > 0 && p % o->eval_every == 0 && p < last;
            /* Validation reads the weights after p's update: it is ordered before step s. */
            if (eval_now) row.val_loss = validate(g, corpus, ds, o, vtok, vtgt, &counted);
            if (log && !skipped && (p % o->log_every == 0 || p == first || eval_now)) {
                char eta[32], elapsed[32];
                format_duration(el / done * (last - p), eta, sizeof eta);
                format_duration(row.elapsed_s + metrics.elapsed_before, elapsed, sizeof elapsed);
                fprintf(log, "step %5lld/%lld | loss %.4f | grad-norm %7.3f | lr %.2e | %6.0f tok/s | epoch %.3g | %s, ETA %s",
                        (long long)p, (long long)o->steps, loss, gnorm, row.lr, done * per_step / el, row.epoch, elapsed, eta);
                if (eval_now) fprintf(log, " | val %.4f", row.val_loss);
                say(log, "\n");
            }
            mt_metrics_write(&metrics, &row);
            sig = o->stop_signal ? *o->stop_signal : 0;
            bool over_time = o->time_limit > 0 && el > o->time_limit;
            if (ranks > 1) {
                /* every rank stops after the same step: a signal or the time limit on any one
                 * stops them all (mpirun forwards signals, but they land between different steps) */
                sig = (int)mt_dist_max_i64(sig);
                over_time = mt_dist_max_i64(over_time) > 0;
            }
            const bool stop = (sig || over_time) && p < last;
            if (o->checkpoint_path && ((o->save_every > 0 && p % o->save_every == 0) || p == last || stop)) {
                *meta = (mt_checkpoint_meta){ .step = p, .rng_state = rng.state, .seed = o->seed, .updates = updates };
                snprintf(meta->settings, sizeof meta->settings, "%s", settings);
                if (save_checkpoint(o, g, st, meta, log, err, errlen)) goto out;
            }
            if (stop && !sig) {
                say(log, "megatrain: time limit %.0f s reached after step %lld\n", o->time_limit, (long long)p);
                break;
            }
            if (stop) break;
        }
        if (s <= last) {
            if (s == first && o->stop_signal) {
                sig = *o->stop_signal;
                if (ranks > 1) sig = (int)mt_dist_max_i64(sig);
                if (sig) break;
            }
            /* every rank draws the global batch (the same windows, the same generator state) */
            const int64_t windows = o->step.accum * o->step.B * ranks;
            mt_run_data_batch(&data, o->data_shuffle, o->seed, (s - 1) * windows, &rng, windows, o->step.T, tok, tgt);
            const int32_t *my_tok = tok + rank * rank_step, *my_tgt = tgt + rank * rank_step;
            const double lr = mt_lr_at(o, s);
            /* AdamW's step counts the updates applied (they are the steps, unless some were skipped). */
            if (!skip_mode) {
                slot = mt_graph_submit_step(g, ++updates, my_tok, my_tgt, lr);
            } else {
                slot = mt_graph_submit_compute(g, s, my_tok, my_tgt);
                mt_graph_submit_norm(g);
                next_loss = mt_graph_wait_loss(g, slot, NULL);
                next_norm = o->step.clip > 0 ? read_norm(g) : NAN;
                next_skipped = !finite_step(o, next_loss, next_norm);
                if (!next_skipped) mt_graph_submit_update(g, ++updates, lr);
            }
        }
    }
    mt_graph_flush(g);
    starpu_task_wait_for_all();
    res->seconds = mt_clock_s() - t0;
    const int64_t trained = res->steps_done >= first ? res->steps_done - first + 1 : 0;
    res->tokens_per_second = trained > 0 ? trained * per_step / res->seconds : 0;
    if (gather_all && mt_dist_gather_masters(st, err, errlen)) goto out;
    /* ranks 1.. return from it once rank 0 has saved (or stops): mt_dist_masters_close */
    if (tile_at_a_time && mt_dist_masters_open(st, err, errlen)) goto out;
    res->weights_hash = o->hash_weights && rank == 0 ? mt_state_hash(st) : 0;
    const bool reached_end = res->steps_done >= last;
    if (!sig && o->stop_signal) sig = *o->stop_signal;
    if (sig && !reached_end) {
        res->stopped_by = sig;
        if (res->steps_done < first)
            say(log, "megatrain: %s: stopped before step %lld; nothing new to save\n", signal_name(sig, signame, sizeof signame),
                (long long)first);
        else if (o->checkpoint_path)
            say(log, "megatrain: %s: stopped after step %lld of %lld; the checkpoint of step %lld is in %s: continue with "
                "--resume %s\n", signal_name(sig, signame, sizeof signame), (long long)res->steps_done, (long long)last,
                (long long)res->steps_done, o->checkpoint_path, o->checkpoint_path);
        else
            say(log, "megatrain: %s: stopped after step %lld of %lld; without --checkpoint its state is not saved\n",
                signal_name(sig, signame, sizeof signame), (long long)res->steps_done, (long long)last);
        rc = 0;
        goto out;
    }
    if (o->save_model_dir && save_model(o, st, save_dtype, log, err, errlen)) goto out;
    mt_dist_masters_close(st);
    if (!sig && o->stop_signal) sig = *o->stop_signal;
    if (sig) {
        res->stopped_by = sig;
        say(log, "megatrain: %s: the run had reached its end (step %lld)%s%s; stopping before the final validation\n",
            signal_name(sig, signame, sizeof signame), (long long)res->steps_done,
            o->checkpoint_path ? "; checkpoint saved" : "", o->save_model_dir ? "; model saved" : "");
        rc = 0;
        goto out;
    }
    if (has_val) res->last_val = validate(g, corpus, ds, o, vtok, vtgt, &res->val_counted);
    if (log) {
        char steps[128], val[128] = "";
        if (first > 1)
            snprintf(steps, sizeof steps, "%lld steps (%lld-%lld of %lld)", (long long)trained, (long long)first,
                     (long long)res->steps_done, (long long)o->steps);
        else
            snprintf(steps, sizeof steps, "%lld steps", (long long)trained);
        if (has_val && isnan(res->first_val)) snprintf(val, sizeof val, " | val %.4f nats/%s", res->last_val, ds ? "token" : "byte");
        else if (has_val) snprintf(val, sizeof val, " | val %.4f -> %.4f nats/%s", res->first_val, res->last_val, ds ? "token" : "byte");
        if (trained > 0)
            fprintf(log, "done: %s in %.1f s (%.0f tok/s) | train loss %.4f -> %.4f%s\n", steps, res->seconds,
                    res->tokens_per_second, res->first_loss, res->last_loss, val);
        else
            fprintf(log, "done: no step trained (the checkpoint was at step %lld)%s\n", (long long)res->steps_done, val);
        char peak[32], planned[32];
        fprintf(log, "megatrain: peak host memory %s (plan %s)\n", mt_format_bytes(mt_host_peak_rss(), peak, sizeof peak),
                mt_format_bytes(layout.host_total, planned, sizeof planned));
        if (res->skipped) fprintf(log, "megatrain: %lld steps skipped (loss or gradient norm not finite)\n", (long long)res->skipped);
        fflush(log);
    } else if (ranks > 1) {
        /* each process's own, on stderr, which the launcher forwards: what every rank of a node takes */
        char peak[32], planned[32];
        fprintf(stderr, "megatrain: rank %d of %d: peak host memory %s (the largest rank's plan %s)\n", rank, ranks,
                mt_format_bytes(mt_host_peak_rss(), peak, sizeof peak),
                mt_format_bytes(layout.host_total, planned, sizeof planned));
    }
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
    mt_dist_masters_close(st); /* rank 0 leaving early: the other ranks stop waiting for it */
    if (log) fflush(log);
    if (mt_metrics_close(&metrics, o->metrics_path, rc ? NULL : err, rc ? 0 : errlen)) rc = -1;
    free(tok); free(tgt); free(vtok); free(vtgt);
    mt_graph_destroy(g);
    mt_state_destroy(st);
    mt_runtime_shutdown();
    mt_run_data_close(&data);
    return rc;
}
