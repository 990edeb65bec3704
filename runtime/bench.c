/* The benchmark: builds the host state of a published shape with random weights and times the
 * real step graph. Step time is the period between the last AdamW task of consecutive steps,
 * which is what a long run sustains (steps overlap: the next forward runs during AdamW). */
#include "runtime/bench.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backends/cpu/ranged.h"
#include "codelets/adamw.h"
#include "models/config.h"
#include "models/util.h"
#include "runtime/dataset.h"
#include "mt_build_config.h"
#include "runtime/plan.h"
#include "runtime/policy.h"
#include "runtime/state.h"
#if MT_HAVE_CUDA
#include "backends/cuda/kernels.h"
#endif

mt_bench_options mt_bench_defaults(void)
{
    mt_bench_options o = { .shape = "qwen2.5-0.5b", .step = mt_step_defaults(), .warmup = 2, .steps = 5,
                           .resident = false, .prefetch = true, .gpu_limit_mib = 0, .dtype = MT_DTYPE_BF16,
                           .host_layout = MT_LAYOUT_AUTO, .runtime = mt_runtime_defaults() };
    o.step.B = 8;
    o.step.T = 2048;
    o.step.K = 4;
    return o;
}

static double ts_sec(struct timespec t) { return t.tv_sec + t.tv_nsec * 1e-9; }

/* Event times per step: what the observer saw. */
typedef struct timeline {
    pthread_mutex_t lock;
    int nsteps;
    double *fwd0_start;     /* (nsteps+1) forward of layer 0 started */
    double *bwd0_end;       /* backward of layer 0 ended */
    double *adam_first, *adam_last;
    double *embed_start;    /* embedding forward started */
    double *adam_tile_end;  /* ((nsteps+1) * 3) last AdamW end of tiles 0, 1, 2 */
    double *ready;          /* ((nsteps+1) * 3) update landed for tiles 0, 1, 2 */
    unsigned gpu_node;
    size_t peak_gpu;
} timeline;

static void on_event(void *user, mt_event_kind kind, int64_t step, int tile)
{
    timeline *tl = user;
    double t = mt_clock_s();
    if (step < 1 || step > tl->nsteps) return;
    pthread_mutex_lock(&tl->lock);
    if (kind == MT_EV_FORWARD_START && tile == 1 && tl->fwd0_start[step] == 0) tl->fwd0_start[step] = t;
    if (kind == MT_EV_FORWARD_START && tile == 0 && tl->embed_start[step] == 0) tl->embed_start[step] = t;
    if (kind == MT_EV_ADAMW && tile < 3) tl->adam_tile_end[step * 3 + tile] = t;
    if (kind == MT_EV_TILE_READY && tile < 3) tl->ready[step * 3 + tile] = t;
    if (kind == MT_EV_BACKWARD && tile == 1) tl->bwd0_end[step] = t;
    if (kind == MT_EV_ADAMW) {
        if (tl->adam_first[step] == 0) tl->adam_first[step] = t;
        tl->adam_last[step] = t;
    }
    if (tl->gpu_node) {
        size_t used = starpu_memory_get_used(tl->gpu_node);
        if (used > tl->peak_gpu) tl->peak_gpu = used;
    }
    pthread_mutex_unlock(&tl->lock);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    if (n <= 0) return NAN;
    qsort(v, n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static double peak_rss_gib(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return NAN;
    char line[256];
    double kib = NAN;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "VmHWM: %lf kB", &kib) == 1) break;
    fclose(f);
    return kib / (1024.0 * 1024.0);
}


const char *mt_bench_model_name(const mt_bench_options *o)
{
    return o->config_path ? o->config_path : o->shape;
}

int mt_bench_count(const mt_bench_options *o)
{
    return (o->nsweep_K > 0 ? o->nsweep_K : 1) * (o->nsweep_clip > 0 ? o->nsweep_clip : 1) *
           (o->nsweep_defer > 0 ? o->nsweep_defer : 1) * (o->nsweep_bounds > 0 ? o->nsweep_bounds : 1);
}

/* The settings of result i: K outermost, then clip, adamw_defer, ranged_bounds innermost. */
static void pair_of(const mt_bench_options *o, int i, mt_bench_result *r)
{
    const int nb = o->nsweep_bounds > 0 ? o->nsweep_bounds : 1, nd = o->nsweep_defer > 0 ? o->nsweep_defer : 1;
    const int nc = o->nsweep_clip > 0 ? o->nsweep_clip : 1;
    r->bounds = o->nsweep_bounds > 0 ? o->sweep_bounds[i % nb] : (int)o->step.ranged_bounds;
    i /= nb;
    r->defer = o->nsweep_defer > 0 ? o->sweep_defer[i % nd] : o->step.adamw_defer;
    i /= nd;
    r->clip = o->nsweep_clip > 0 ? o->sweep_clip[i % nc] : o->step.clip;
    r->K = o->nsweep_K > 0 ? o->sweep_K[i / nc] : o->step.K;
}

/* Events the trace needs for the measured steps: three per GPU task, twice what the graph
 * submits per micro-batch (embedding, L forwards, head, L recomputes and L backwards, embedding
 * backward) plus room for StarPU's own tasks. Capped at 4M events (160 MB); beyond, events drop. */
static int trace_capacity(const mt_bench_options *o, const mt_step_config *sc, const mt_model_config *cfg)
{
    double events = 3.0 * 2.0 * o->steps * ((double)sc->accum * (3.0 * (double)cfg->layers + 4) + 64);
    return events < (1 << 22) ? (int)events : 1 << 22;
}

/* --task-log: every task the trace holds (every worker's), by start, in ms from the measured
 * window's start `t0`; first the steps' embedding forward starts and layer 0's backward ends as
 * the observer saw them, to cut the timeline into steps and find the boundary. */
static void write_tasks(FILE *out, const mt_step_config *sc, const timeline *tl, double t0,
                        mt_policy_trace_record *records, int n, int dropped)
{
    mt_bench_sort_records(records, n);
    fprintf(out, "# K=%d clip %g: %d tasks%s\n", sc->K, sc->clip, n, dropped > 0 ? " (events dropped: the trace was full)" : "");
    for (int k = 1; k <= tl->nsteps; k++)
        if (tl->embed_start[k] >= t0)
            fprintf(out, "# step %d: embedding forward %.3f ms, layer 0 backward end %.3f ms\n", k,
                    1e3 * (tl->embed_start[k] - t0), tl->bwd0_end[k] > 0 ? 1e3 * (tl->bwd0_end[k] - t0) : -1.0);
    fprintf(out, "worker,kind,name,tile,pop_ms,start_ms,end_ms\n");
    for (int i = 0; i < n; i++) {
        const mt_policy_trace_record *t = &records[i];
        fprintf(out, "%d,%s,%s,%d,%.3f,%.3f,%.3f\n", t->worker, t->cuda ? "cuda" : "cpu", t->name, t->tile,
                t->pop_s > 0 ? 1e3 * (t->pop_s - t0) : -1.0, 1e3 * (t->start_s - t0), 1e3 * (t->end_s - t0));
    }
}

/* Ends the measured window's trace (`traced`: it began) and fills r->gpu and r->gpu_idle_s; the
 * longest gaps get their step from the embedding starts the observer saw. With `tasks` (the trace
 * then held every worker's tasks) writes them there first. */
static void gpu_time(const mt_bench_options *o, bool traced, const timeline *tl, double t0, FILE *tasks,
                     const mt_step_config *sc, mt_bench_result *r)
{
    mt_policy_trace_record *records = NULL;
    int n = 0, dropped = traced ? mt_policy_trace_end(MT_SCHED_CTX_INITIAL, &records, &n) : -1;
    if (tasks && dropped >= 0) write_tasks(tasks, sc, tl, t0, records, n, dropped);
    int ncuda = 0; /* the breakdown is the GPUs': the CUDA workers' tasks only, each worker's apart */
    for (int i = 0; i < n; i++)
        if (records[i].cuda) records[ncuda++] = records[i];
    n = ncuda;
    r->ngpu_shares = mt_bench_gpu_breakdowns(records, n, r->gpu_each, MT_BENCH_MAX_GPUS, &r->gpu);
    free(records);
    r->gpu.dropped = dropped > 0 ? dropped : 0;
    if (dropped < 0) r->gpu.status = MT_GPU_TRACE_OTHER_POLICY;
    else if (starpu_cuda_worker_get_count() == 0) r->gpu.status = MT_GPU_TRACE_NO_CUDA;
    double idle = 0;
    const int kept = r->ngpu_shares < MT_BENCH_MAX_GPUS ? r->ngpu_shares : MT_BENCH_MAX_GPUS;
    for (int i = 0; i < kept; i++) idle += r->gpu_each[i].idle_s;
    r->gpu_idle_s = r->gpu.status != MT_GPU_TRACE_OK ? NAN : kept > 0 ? idle / kept / o->steps : 0;
    for (int i = 0; i < r->gpu.nlongest; i++) {
        mt_gpu_gap *g = &r->gpu.longest[i];
        for (int k = 1; k <= tl->nsteps; k++)
            if (tl->embed_start[k] > 0 && tl->embed_start[k] <= g->at_s) {
                g->step = k;
                g->since_step_s = g->at_s - tl->embed_start[k];
            }
    }
}

/* The batches of --data (mt_run_data): a text corpus read as bytes, windows at seeded random
 * offsets of its training split; or a prepared directory, its training stream in order. One
 * source for the whole run, so the pairs after the first train on new batches. */
typedef struct bench_data {
    bool on;
    mt_run_data src;
    mt_rng rng;
    int64_t next; /* prepared: the next window of the stream */
} bench_data;

static int bench_data_open(const mt_bench_options *o, const mt_model_config *cfg, bench_data *d, FILE *log, char *err,
                           size_t errlen)
{
    memset(d, 0, sizeof *d);
    if (!o->data) return 0;
    char model[1100];
    snprintf(model, sizeof model, "%s %s", o->config_path ? "config" : "shape", mt_bench_model_name(o));
    if (mt_run_data_open(&d->src, o->data, cfg->vocab, o->step.T, o->step.T + 1, model, err, errlen)) return -1;
    mt_rng_seed(&d->rng, 1);
    if (log && d->src.prepared)
        fprintf(log, "bench: data %s: %lld training windows of %lld tokens, a fresh batch each step\n", o->data,
                (long long)d->src.dataset.train.n_seq, (long long)d->src.dataset.seq_len);
    else if (log)
        fprintf(log, "bench: data %s: %lld bytes (the byte-level trainer's training split) as tokens, a fresh batch at "
                     "random offsets each step\n", o->data, (long long)d->src.corpus.ntrain);
    d->on = true;
    return 0;
}

/* The next step's batch, (accum, B, T); nothing without --data. */
static void bench_data_batch(bench_data *d, const mt_step_config *sc, int32_t *tok, int32_t *tgt)
{
    const int64_t windows = (int64_t)sc->accum * sc->B;
    if (!d->on) return;
    mt_run_data_batch(&d->src, false, 0, d->next, &d->rng, windows, sc->T, tok, tgt);
    d->next += windows;
}

static void bench_data_close(bench_data *d) { mt_run_data_close(&d->src); }

/* One pair: a fresh graph over the shared state, warm-up, measured steps, AdamW alone. */
/* The norms a graph kept (mt_graph_keep_norms) as CSV rows: K, clip, the norm's number, the norm,
 * then the columns of write_norm_header. */
static void write_norms(const mt_graph *g, const mt_step_config *sc, FILE *out)
{
    int64_t count;
    int width;
    const double *rows = mt_graph_kept_norms(g, &count, &width);
    for (int64_t i = 0; rows && i < count; i++) {
        const double *row = rows + i * width;
        double sum = 0;
        for (int j = 0; j < width - 1; j++) sum += row[j];
        fprintf(out, "%d,%g,%lld,%.9g", sc->K, sc->clip, (long long)(i + 1), sqrt(sum));
        for (int j = 0; j < width; j++) fprintf(out, ",%.9g", row[j]);
        fputc('\n', out);
    }
}

static void write_norm_header(const mt_host_state *st, FILE *out)
{
    fprintf(out, "K,clip,norm,grad_norm,embedding");
    for (int i = 1; i <= st->cfg.layers; i++) fprintf(out, ",layer%d", i - 1);
    for (int i = (int)st->cfg.layers + 1; i < st->ntiles; i++) fprintf(out, ",head");
    fprintf(out, ",table_head_part\n");
}

/* The log's heartbeat: a thread that, while one phase (the host state's set-up, a step) lasts
 * longer than `every` seconds, says which and for how long, so that a slow run on CPU workers is
 * never silent. Each phase's own line (ticker_phase) restarts its clock. */
typedef struct ticker {
    FILE *log;
    double every;
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    bool stop, running;
    char phase[128];
    double since;
} ticker;

static void *ticker_main(void *arg)
{
    ticker *t = arg;
    pthread_mutex_lock(&t->lock);
    while (!t->stop) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        const double at = until.tv_nsec * 1e-9 + t->every;
        until.tv_sec += (time_t)at;
        until.tv_nsec = (long)((at - floor(at)) * 1e9);
        pthread_cond_timedwait(&t->wake, &t->lock, &until);
        const double held = mt_clock_s() - t->since;
        if (!t->stop && t->phase[0] && held >= t->every) {
            fprintf(t->log, "bench: still %s (%.*f s)\n", t->phase, t->every < 1 ? 2 : 0, held);
            fflush(t->log);
        }
    }
    pthread_mutex_unlock(&t->lock);
    return NULL;
}

/* Starts the heartbeat on log every `every` seconds (none when log is NULL or the thread cannot
 * start). */
static void ticker_start(ticker *t, FILE *log, double every)
{
    memset(t, 0, sizeof *t);
    t->log = log;
    t->every = every;
    if (!log) return;
    pthread_mutex_init(&t->lock, NULL);
    pthread_cond_init(&t->wake, NULL);
    t->since = mt_clock_s();
    t->running = pthread_create(&t->thread, NULL, ticker_main, t) == 0;
}

/* Prints "bench: LINE" (none for NULL) and makes the phase "WHAT" (the heartbeat's words), its
 * clock restarted. */
static void ticker_phase(ticker *t, const char *line, const char *what)
{
    if (!t->log) return;
    if (line) {
        fprintf(t->log, "bench: %s\n", line);
        fflush(t->log);
    }
    if (!t->running) return;
    pthread_mutex_lock(&t->lock);
    snprintf(t->phase, sizeof t->phase, "%s", what);
    t->since = mt_clock_s();
    pthread_mutex_unlock(&t->lock);
}

static void ticker_stop(ticker *t)
{
    if (!t->running) return;
    pthread_mutex_lock(&t->lock);
    t->stop = true;
    pthread_cond_signal(&t->wake);
    pthread_mutex_unlock(&t->lock);
    pthread_join(t->thread, NULL);
    pthread_cond_destroy(&t->wake);
    pthread_mutex_destroy(&t->lock);
    t->running = false;
}

/* "warm-up step i/n" or "measured step i/n" as step `step` (1-based, warm-up first) starts running:
 * printed once the step before it has ended. */
static void progress(ticker *t, const mt_bench_options *o, const mt_step_config *sc, int step)
{
    char which[64], line[128], what[128];
    if (step <= o->warmup) snprintf(which, sizeof which, "warm-up step %d/%d", step, o->warmup);
    else snprintf(which, sizeof which, "measured step %d/%d", step - o->warmup, o->steps);
    snprintf(line, sizeof line, "K=%d clip %g: %s", sc->K, sc->clip, which);
    snprintf(what, sizeof what, "in %s", which);
    ticker_phase(t, line, what);
}

/* The research logs a run may write (advanced options): NULL when not asked for. */
typedef struct bench_logs {
    FILE *norms; /* --norm-log */
    FILE *tasks; /* --task-log */
} bench_logs;

static int measure(const mt_bench_options *o, const mt_step_config *sc, const mt_model_config *cfg, mt_host_state *st,
                   bench_data *data, mt_bench_result *r, FILE *log, ticker *tick, const bench_logs *logs, char *err,
                   size_t errlen)
{
    FILE *norms = logs->norms;
    ticker_phase(tick, NULL, "building the step graph");
    mt_graph *g = mt_graph_create(st, sc, err, errlen);
    if (!g) return -1;
    if (norms && sc->clip > 0 && mt_graph_keep_norms(g, o->warmup + o->steps + 1)) {
        snprintf(err, errlen, "out of memory for the norm log");
        mt_graph_destroy(g);
        return -1;
    }
    if (log) {
        char prefix[64];
        snprintf(prefix, sizeof prefix, "bench: K=%d clip %g", sc->K, sc->clip);
        mt_graph_log_defer(g, log, prefix);
        mt_graph_log_devices(g, log, prefix);
    }
    r->deferred = mt_graph_defers(g);
    mt_policy_set_prefetch(MT_SCHED_CTX_INITIAL, o->prefetch);
    r->layers = cfg->layers;
    r->checkpoints = (cfg->layers + sc->K - 1) / sc->K;
    r->checkpoint_gib = (double)sc->B * sc->T * cfg->hidden * sizeof(float) / 1073741824.0;

    int total = o->warmup + o->steps;
    timeline tl = { .nsteps = total };
    pthread_mutex_init(&tl.lock, NULL);
    tl.fwd0_start = calloc(total + 2, sizeof(double));
    tl.bwd0_end = calloc(total + 2, sizeof(double));
    tl.adam_first = calloc(total + 2, sizeof(double));
    tl.adam_last = calloc(total + 2, sizeof(double));
    tl.embed_start = calloc(total + 2, sizeof(double));
    tl.adam_tile_end = calloc((total + 2) * 3, sizeof(double));
    tl.ready = calloc((total + 2) * 3, sizeof(double));
    for (unsigned w = 0; w < starpu_worker_get_count(); w++)
        if (starpu_worker_get_type((int)w) == STARPU_CUDA_WORKER) tl.gpu_node = starpu_worker_get_memory_node(w);
    mt_graph_set_observer(g, on_event, &tl);

    int64_t n = (int64_t)sc->accum * sc->B * sc->T;
    int32_t *tok = malloc(sizeof *tok * n), *tgt = malloc(sizeof *tgt * n);
    uint64_t s = 12345;
    for (int64_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        tok[i] = (int32_t)((s >> 33) % (uint64_t)cfg->vocab);
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        tgt[i] = (int32_t)((s >> 33) % (uint64_t)cfg->vocab);
    }
    int *slots = calloc(total + 1, sizeof(int));
    const mt_adamw_stats *stats = mt_graph_adamw_stats(g);
    mt_ranged_counts rc0 = mt_adamw_stats_ranged(stats);
    double measure_start = 0, adamw_cpu0 = 0, kind0[MT_AK_COUNT] = { 0 };
    bool traced = false;
    for (int step = 1; step <= total; step++) {
        if (step == 1) progress(tick, o, sc, 1);
        if (step == o->warmup + 1) {
            /* Start the measured window once the warm-up steps are done. */
            starpu_task_wait_for_all();
            for (int b = 0; b < starpu_bus_get_count(); b++) starpu_bus_get_profiling_info(b, NULL);
            for (unsigned w = 0; w < starpu_worker_get_count(); w++) starpu_profiling_worker_get_info((int)w, NULL);
            pthread_mutex_lock(&tl.lock);
            tl.peak_gpu = 0;
            pthread_mutex_unlock(&tl.lock);
            traced = mt_policy_trace_begin(MT_SCHED_CTX_INITIAL, logs->tasks ? 1 << 22 : trace_capacity(o, sc, cfg),
                                           logs->tasks != NULL) == 0;
            adamw_cpu0 = mt_adamw_stats_seconds(stats);
            mt_adamw_stats_seconds_by_kind(stats, kind0);
            rc0 = mt_adamw_stats_ranged(stats);
            measure_start = mt_clock_s();
        }
        bench_data_batch(data, sc, tok, tgt);
        slots[step] = mt_graph_submit_step(g, step, tok, tgt, 1e-5);
        if (step >= 2) {
            double norm;
            double loss = mt_graph_wait_loss(g, slots[step - 1], &norm);
            if (step == 2) r->loss_first = loss;
            if (log) fprintf(log, "bench: K=%d clip %g step %d loss %.4f grad norm %.4g\n", sc->K, sc->clip, step - 1, loss, norm);
            progress(tick, o, sc, step);
        }
    }
    r->loss_last = mt_graph_wait_loss(g, slots[total], NULL);
    starpu_task_wait_for_all();
    if (norms) {
        write_norms(g, sc, norms);
        fflush(norms);
    }
    mt_graph_speculation_counts(g, &r->speculated, &r->speculation_held);
    const mt_ranged_counts rc = mt_adamw_stats_ranged(stats);
    const int64_t rchecked = rc.checked - rc0.checked, rskipped = rc.skipped - rc0.skipped;
    if (rchecked + rskipped > 0) {
        r->ranged_spec = (double)rchecked / (double)(rchecked + rskipped);
        r->ranged_in = rchecked ? 1.0 - (double)(rc.outside - rc0.outside) / (double)rchecked : 0;
        r->ranged_flagged = rchecked ? (double)(rc.flagged - rc0.flagged) / (double)rchecked : 0;
    }
    if (log && rchecked + rskipped > 0)
        fprintf(log, "bench: K=%d clip %g: ranged speculation (%s bounds) checked %lld parameter updates and flagged "
                     "%.3f%% of them; %lld not speculated (range too wide: %lld; the last norm's prediction missed: "
                     "%lld), %lld redone whole (scale outside the range; below it: %lld)\n",
                sc->K, sc->clip, mt_ranged_bounds_name(sc->ranged_bounds), (long long)rchecked,
                rchecked ? 100.0 * (double)(rc.flagged - rc0.flagged) / (double)rchecked : 0.0,
                (long long)rskipped, (long long)(rskipped - (rc.unheld - rc0.unheld)), (long long)(rc.unheld - rc0.unheld),
                (long long)(rc.outside - rc0.outside), (long long)(rc.below - rc0.below));
    const int64_t tchecked = rc.table_checked - rc0.table_checked, ttouched = rc.table_touched - rc0.table_touched;
    if (log && rchecked + rskipped > 0 && tchecked + ttouched > 0)
        fprintf(log, "bench: K=%d clip %g: of those, the table's: %lld checked on its early path, %.3f%% of them flagged; "
                     "%lld elements of the rows the tokens touch flagged whole (redone after the norm)\n",
                sc->K, sc->clip, (long long)tchecked,
                tchecked ? 100.0 * (double)(rc.table_flagged - rc0.table_flagged) / (double)tchecked : 0.0,
                (long long)ttouched);
    const int64_t rside = rc.redo_side - rc0.redo_side, rarrays = rc.redo_arrays - rc0.redo_arrays;
    if (log && rside + rarrays > 0)
        fprintf(log, "bench: K=%d clip %g: the redo took %lld flagged elements' inputs from side entries, %lld (%.1f%%) "
                     "from the arrays (past a chunk's room for entries, 1/%d of it; stale entries; words redone whole)\n",
                sc->K, sc->clip, (long long)rside, (long long)rarrays, 100.0 * (double)rarrays / (double)(rside + rarrays),
                sc->ranged_side_room > 0 ? sc->ranged_side_room : MT_RANGED_SIDE_ROOM_DEFAULT);
    double window = mt_clock_s() - measure_start;
    gpu_time(o, traced, &tl, measure_start, logs->tasks, sc, r);
    /* The measured steps' AdamW tasks, all of them (the warm-up's drained before the window). */
    r->adamw_step_cpu_s = (mt_adamw_stats_seconds(stats) - adamw_cpu0) / o->steps;
    if (log && o->steps > 0) {
        /* where that time goes, by kind of task */
        double kind1[MT_AK_COUNT];
        mt_adamw_stats_seconds_by_kind(stats, kind1);
        fprintf(log, "bench: K=%d clip %g: AdamW tasks, CPU-s per measured step:", sc->K, sc->clip);
        for (int k = 0; k < MT_AK_COUNT; k++)
            if (kind1[k] > kind0[k]) fprintf(log, " %s %.3f;", mt_adamw_kind_names[k], (kind1[k] - kind0[k]) / o->steps);
        fprintf(log, " total %.3f\n", r->adamw_step_cpu_s);
    }
    const unsigned ncpu = starpu_cpu_worker_get_count();
    r->ncpu = (int)ncpu;
    r->cuda = starpu_cuda_worker_get_count() > 0;
    r->adamw_step_s_per_gparam = ncpu ? r->adamw_step_cpu_s / ncpu / (mt_config_param_count(cfg) / 1e9) : NAN;

    long long h2d = 0, d2h = 0, p2p = 0;
    for (int b = 0; b < starpu_bus_get_count(); b++) {
        struct starpu_profiling_bus_info bi;
        starpu_bus_get_profiling_info(b, &bi);
        if (starpu_bus_get_src(b) == STARPU_MAIN_RAM) h2d += bi.transferred_bytes;
        else if (starpu_bus_get_dst(b) == STARPU_MAIN_RAM) d2h += bi.transferred_bytes;
        else p2p += bi.transferred_bytes;
    }
    r->h2d_gb = h2d / 1e9 / o->steps;
    r->d2h_gb = d2h / 1e9 / o->steps;
    r->h2d_gbs = h2d / 1e9 / window;
    r->d2h_gbs = d2h / 1e9 / window;
    r->p2p_gb = p2p / 1e9 / o->steps;
    /* over several GPUs, each one's share of the window: the mean and the least busy one's */
    r->ncuda = 0;
    r->gpu_busy = 0;
    r->gpu_busy_min = INFINITY;
    for (unsigned w = 0; w < starpu_worker_get_count(); w++) {
        if (starpu_worker_get_type((int)w) != STARPU_CUDA_WORKER) continue;
        struct starpu_profiling_worker_info wi;
        starpu_profiling_worker_get_info((int)w, &wi);
        const double busy = ts_sec(wi.executing_time) / window;
        r->gpu_busy += busy;
        if (busy < r->gpu_busy_min) r->gpu_busy_min = busy;
        r->ncuda++;
    }
    if (r->ncuda) r->gpu_busy /= r->ncuda;
    else r->gpu_busy_min = 0;

    double *steps = calloc(total + 1, sizeof(double)), *gaps = calloc(total + 1, sizeof(double));
    double *spans = calloc(total + 1, sizeof(double)), *tails = calloc(total + 1, sizeof(double));
    int ns = 0, ng = 0;
    for (int k = o->warmup + 1; k <= total; k++) {
        if (k >= 2 && tl.adam_last[k - 1] > 0) steps[ns++] = tl.adam_last[k] - tl.adam_last[k - 1];
        if (k >= 2 && tl.fwd0_start[k] > 0 && tl.bwd0_end[k - 1] > 0) gaps[ng++] = tl.fwd0_start[k] - tl.bwd0_end[k - 1];
        spans[k - o->warmup - 1] = tl.adam_last[k] - tl.adam_first[k];
        tails[k - o->warmup - 1] = tl.adam_last[k] - tl.bwd0_end[k];
    }
    /* The first measured step follows a drained pipeline: time it from the window start. */
    if (ns == 0 || o->warmup == 0) steps[ns++] = window / o->steps;
    if (log) {
        /* Every measured period, in order: one slow step shows here (the median hides it). */
        fprintf(log, "bench: K=%d clip %g: step periods s:", sc->K, sc->clip);
        for (int i = 0; i < ns; i++) fprintf(log, " %.3f", steps[i]);
        fprintf(log, " (window %.3f s over %d steps)\n", window, o->steps);
    }
    r->step_s = median(steps, ns);
    r->boundary_gap_s = median(gaps, ng);
    r->adamw_span_s = median(spans, o->steps);
    r->adamw_tail_s = median(tails, o->steps);
    r->tokens_per_s = n / r->step_s;
    double flops_per_token = 6.0 * (double)mt_config_flops_params(cfg) + 6.0 * cfg->layers * cfg->hidden * sc->T;
    r->tflops = flops_per_token * n / r->step_s / 1e12;
    r->peak_gpu_gib = tl.peak_gpu / 1073741824.0;
#if MT_HAVE_CUDA
    size_t used = 0;
    if (starpu_cuda_worker_get_count() > 0 && mt_cuda_device_memory_used(&used) == 0) r->device_used_gib = used / 1073741824.0;
#endif

    /* AdamW alone: one update of every tile with nothing else running, fused (the split the
     * step may use for its critical path moves 12 bytes/param more in all), not speculative (a
     * speculative update is split and adds its confirm tasks, so it would time more than the
     * update itself). */
    mt_graph_set_observer(g, NULL, NULL);
    mt_graph_set_adamw_split(g, 0);
    mt_graph_set_clip_speculate(g, 0);
    char line[128];
    snprintf(line, sizeof line, "K=%d clip %g: AdamW alone (one update of every parameter, nothing else running)", sc->K,
             sc->clip);
    ticker_phase(tick, line, "timing AdamW alone");
    mt_graph_flush(g); /* deferred moments of the last step, not timed */
    starpu_task_wait_for_all();
    double a0 = mt_clock_s();
    mt_graph_submit_update(g, total + 1, 1e-5);
    starpu_task_wait_for_all();
    r->adamw_standalone_s = mt_clock_s() - a0;
    r->adamw_s_per_gparam = r->adamw_standalone_s / (mt_config_param_count(cfg) / 1e9);
    r->peak_host_gib = peak_rss_gib();
    if (log && total >= 2) {
        /* Where the step boundary goes, for the last measured step (seconds after layer 0's backward). */
        int k = total - 1;
        double b = tl.bwd0_end[k];
        fprintf(log, "bench: boundary of step %d -> %d, seconds after layer 0's backward: first AdamW end %.3f, "
                     "AdamW end tile 0 %.3f, tile 1 %.3f, tile 2 %.3f; update landed tile 0 %.3f, tile 1 %.3f, tile 2 %.3f; "
                     "embedding forward start %.3f, layer 0 forward start %.3f; last AdamW end %.3f\n",
                k, k + 1, tl.adam_first[k] - b, tl.adam_tile_end[k * 3] - b, tl.adam_tile_end[k * 3 + 1] - b,
                tl.adam_tile_end[k * 3 + 2] - b, tl.ready[k * 3] - b, tl.ready[k * 3 + 1] - b, tl.ready[k * 3 + 2] - b,
                tl.embed_start[k + 1] - b, tl.fwd0_start[k + 1] - b, tl.adam_last[k] - b);
    }
    free(steps); free(gaps); free(spans); free(tails); free(slots); free(tok); free(tgt);
    free(tl.fwd0_start); free(tl.bwd0_end); free(tl.adam_first); free(tl.adam_last);
    free(tl.embed_start); free(tl.adam_tile_end); free(tl.ready);
    pthread_mutex_destroy(&tl.lock);
    mt_graph_destroy(g);
    return 0;
}

/* Opens the log `path` of option `opt` for writing (*f stays NULL without a path). */
static int open_log(const char *opt, const char *path, FILE **f, char *err, size_t errlen)
{
    *f = NULL;
    if (path && !(*f = fopen(path, "w"))) {
        snprintf(err, errlen, "%s: cannot write '%s': %s", opt, path, strerror(errno));
        return -1;
    }
    return 0;
}

/* Closes the logs; returns rc, or -1 with the message when rc was 0 and a write failed. */
static int close_logs(const mt_bench_options *o, bench_logs *logs, int rc, char *err, size_t errlen)
{
    const struct { FILE *f; const char *opt, *path; } l[2] = { { logs->norms, "--norm-log", o->norm_log },
                                                               { logs->tasks, "--task-log", o->task_log } };
    for (int i = 0; i < 2; i++)
        if (l[i].f && fclose(l[i].f) && rc == 0) {
            snprintf(err, errlen, "%s: writing '%s' failed: %s", l[i].opt, l[i].path, strerror(errno));
            rc = -1;
        }
    logs->norms = logs->tasks = NULL;
    return rc;
}

int mt_bench_run(const mt_bench_options *o, mt_bench_result *results, FILE *log, FILE *table, char *err, size_t errlen)
{
    const int count = mt_bench_count(o);
    memset(results, 0, sizeof *results * (size_t)count);
    mt_model_config cfg;
    if (o->config_path) {
        if (mt_config_load(o->config_path, &cfg, err, errlen)) return -1;
    } else if (mt_config_from_shape(o->shape, &cfg)) {
        snprintf(err, errlen, "unknown shape '%s'", o->shape);
        return -1;
    }
    /* before anything is allocated: a length the model cannot take is refused at once */
    if ((o->layers > 0 && mt_config_set_layers(&cfg, o->layers, err, errlen)) ||
        (o->rope_scaling && mt_config_set_rope_scaling(&cfg, o->rope_scaling, err, errlen)) ||
        mt_config_check_seq_len(&cfg, o->step.T, err, errlen))
        return -1;
    cfg.mlp_chunk = o->step.mlp_chunk;
    bench_logs logs = { 0 };
    if (open_log("--norm-log", o->norm_log, &logs.norms, err, errlen) ||
        open_log("--task-log", o->task_log, &logs.tasks, err, errlen)) {
        close_logs(o, &logs, 0, err, errlen);
        return -1;
    }
    FILE *norms = logs.norms;
    bench_data data; /* before the plans: a wrong path is the first thing to hear of */
    if (bench_data_open(o, &cfg, &data, log, err, errlen)) {
        close_logs(o, &logs, 0, err, errlen);
        return -1;
    }

    /* Every pair's plan; the GPU budget is the largest, the host state (its layout chosen from the
     * first pair's plan, as plan and train choose it, with auto's K) the same for all. */
    uint64_t gpu_need = 0, plan_limit_mib = 0;
    mt_layout_choice layout;
    int offload = o->step.offload_checkpoints; /* auto: as the first pair's plan resolves it */
    const char *gpu_source;
    const uint64_t gpu_memory = mt_plan_gpu_memory(o->gpu_memory, o->runtime.ncuda == 0 ? 0 : 1, &gpu_source);
    for (int i = 0; i < count; i++) {
        mt_bench_result *r = &results[i];
        pair_of(o, i, r);
        if (r->K == MT_PLAN_K_AUTO && i > 0) r->K = results[0].K;
        if (r->K > cfg.layers) r->K = (int)cfg.layers;
        int ncpu, ncuda; /* the workers StarPU will start, before it does */
        mt_plan_workers(o->runtime.ncpu, o->runtime.ncuda, &ncpu, &ncuda);
        mt_plan_params pp = { .micro_batch = o->step.B, .seq_len = o->step.T, .grad_accum = o->step.accum,
                              .checkpoint_interval = r->K, .compute = o->dtype, .use_gpu = true,
                              .head_chunk = o->step.head_chunk, .layout = i ? layout.layout : MT_LAYOUT_FULL,
                              .offload_checkpoints = offload, .devices = ncuda, .k_default = o->k_default };
        mt_plan plan;
        const uint64_t avail = mt_host_memory_available();
        if (i == 0) {
            mt_run_choice chosen;
            if (mt_plan_choose_run(&cfg, &pp, o->host_layout, avail, gpu_memory, &plan, &chosen)) {
                snprintf(err, errlen, "%s", plan.error);
                goto fail;
            }
            layout = chosen.layout;
            r->K = (int)chosen.K;
            offload = chosen.offload ? 1 : 0;
            cfg.mlp_chunk = chosen.mlp_chunk; /* auto resolved: every pair runs the first's */
            if (chosen.mlp_chunk_auto && chosen.mlp_chunk > 0 && log) fprintf(log, "bench: %s\n", chosen.why_mlp_chunk);
            if (log) fprintf(log, "bench: checkpoints %s\n", chosen.why_offload);
            if (chosen.k_auto && log) fprintf(log, "bench: checkpoint interval %s\n", chosen.why_k);
            if (mt_plan_run_refusal(&plan, &chosen, err, errlen)) goto fail;
        } else {
            if (mt_plan_compute(&cfg, &pp, &plan)) {
                snprintf(err, errlen, "%s", plan.error);
                goto fail;
            }
            if (gpu_memory && mt_plan_check_gpu(&plan, gpu_memory, err, errlen)) goto fail;
        }
        if (i == 0 && log)
            fprintf(log, "bench: host layout %s (--host-layout %s), %.2f bytes per parameter of host memory in all "
                         "(%.2f GiB): %s\n", mt_host_layout_name(layout.layout), mt_host_layout_name(o->host_layout),
                    (double)layout.host_total / (double)plan.param_count, layout.host_total / 1073741824.0, layout.why);
        r->plan_gpu_gib = plan.gpu_total / 1073741824.0;
        if (plan.gpu_total > gpu_need) gpu_need = plan.gpu_total;
        if (mt_plan_gpu_limit_mib(&plan) > plan_limit_mib) plan_limit_mib = mt_plan_gpu_limit_mib(&plan);
    }

    /* The GPU budget must be set before StarPU starts. The plan counts every buffer the graph
     * registers (runtime/plan.c); its margin leaves room for StarPU's own small allocations. */
    uint64_t limit_mib = 0;
    if (!o->resident) {
        if (o->gpu_limit_mib) limit_mib = o->gpu_limit_mib;
        else if (o->gpu_limit_margin > 0) limit_mib = (uint64_t)ceil(gpu_need * (1 + o->gpu_limit_margin / 100) / 1048576.0);
        else limit_mib = plan_limit_mib;
        char v[32];
        snprintf(v, sizeof v, "%llu", (unsigned long long)limit_mib);
        setenv("STARPU_LIMIT_CUDA_MEM", v, 1);
    } else {
        unsetenv("STARPU_LIMIT_CUDA_MEM");
    }
    setenv("STARPU_PROFILING", "1", 1);
    if (log) {
        fprintf(log, "bench: starting StarPU\n");
        fflush(log);
    }
    if (mt_runtime_init(&o->runtime, err, errlen)) goto fail;
    int rc = -1;
    const bool cuda = starpu_cuda_worker_get_count() > 0;
    ticker tick;
    ticker_start(&tick, log, o->heartbeat_s > 0 ? o->heartbeat_s : MT_BENCH_HEARTBEAT_S);
    char line[1280];
    snprintf(line, sizeof line, "setting up the host state of %s (%.2f GiB, random weights) on %u CPU worker%s%s",
             mt_bench_model_name(o),
             layout.host_total / 1073741824.0, starpu_cpu_worker_get_count(),
             starpu_cpu_worker_get_count() == 1 ? "" : "s",
             !cuda ? ", no CUDA worker" : starpu_cuda_worker_get_count() == 1 ? " and a GPU" : " and the CUDA workers");
    ticker_phase(&tick, line, "setting up the host state");
    double t0 = mt_clock_s();
    const mt_state_args sa = { .cfg = &cfg, .compute_dtype = o->dtype, .chunk_numel = (int64_t)1 << 22,
                               .layout = layout.layout };
    mt_host_state *st = mt_state_create_with(&sa, err, errlen);
    if (!st) goto out;
    mt_state_init_random(st, 1, 0.02);
    if (norms) write_norm_header(st, norms);
    if (log) fprintf(log, "bench: %s (%lld layers, %s), %.3fB parameters, %s host state in %.1f s, GPU limit %s\n",
                     mt_bench_model_name(o),
                     (long long)cfg.layers, mt_dtype_name(o->dtype), mt_config_param_count(&cfg) / 1e9,
                     mt_host_layout_name(st->layout), mt_clock_s() - t0,
                     !cuda ? "none (no CUDA worker)" : o->resident ? "none (resident)" : "from the memory plan");
    for (int i = 0; i < count; i++) {
        mt_bench_result *r = &results[i];
        r->gpu_limit_mib = limit_mib;
        mt_step_config sc = o->step;
        sc.K = r->K;
        sc.clip = r->clip;
        sc.adamw_defer = r->defer;
        sc.offload_checkpoints = offload;
        sc.ranged_bounds = (mt_ranged_bounds)r->bounds;
        r->bounds_used = (int)mt_ranged_bounds_used(sc.ranged_bounds);
        if (measure(o, &sc, &cfg, st, &data, r, log, &tick, &logs, err, errlen)) goto out;
        if (table) {
            mt_bench_print(o, r, i == 0, table);
            fflush(table);
        }
        if (log) mt_bench_print_gpu(o, r, log);
    }
    rc = 0;
out:
    ticker_stop(&tick);
    mt_state_destroy(st);
    mt_runtime_shutdown();
    bench_data_close(&data);
    return close_logs(o, &logs, rc, err, errlen);
fail: /* before StarPU started */
    bench_data_close(&data);
    close_logs(o, &logs, 0, err, errlen);
    return -1;
}
