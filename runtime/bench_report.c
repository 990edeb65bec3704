/* The benchmark's reports: the results table (one for GPU runs, one for CPU workers alone), its
 * notes, and where the GPU waited (the idle time before each kind of task, from the policy's
 * trace). */
#include "runtime/bench.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp_record_start(const void *a, const void *b)
{
    const mt_policy_trace_record *x = a, *y = b;
    if (x->start_s != y->start_s) return x->start_s < y->start_s ? -1 : 1;
    return (x->end_s > y->end_s) - (x->end_s < y->end_s);
}

void mt_bench_sort_records(mt_policy_trace_record *records, int n)
{
    if (n > 0) qsort(records, (size_t)n, sizeof *records, cmp_record_start);
}

/* Most idle first, then by name: the order the breakdown prints. */
static int cmp_idle_desc(const void *a, const void *b)
{
    const mt_gpu_idle *x = a, *y = b;
    if (x->idle_s != y->idle_s) return x->idle_s > y->idle_s ? -1 : 1;
    return strcmp(x->name, y->name);
}

/* The entry of `name`; past MT_GPU_MAX_NAMES names the last entry becomes "other". */
static mt_gpu_idle *idle_of(mt_gpu_breakdown *b, const char *name)
{
    for (int i = 0; i < b->nnames; i++)
        if (!strcmp(b->names[i].name, name)) return &b->names[i];
    if (b->nnames == MT_GPU_MAX_NAMES) {
        b->names[MT_GPU_MAX_NAMES - 1].name = "other";
        return &b->names[MT_GPU_MAX_NAMES - 1];
    }
    b->names[b->nnames] = (mt_gpu_idle){ .name = name };
    return &b->names[b->nnames++];
}

/* Keeps `g` among the longest gaps (longest first). */
static void keep_longest(mt_gpu_breakdown *b, mt_gpu_gap g)
{
    if (b->nlongest == MT_GPU_LONGEST && b->longest[MT_GPU_LONGEST - 1].idle_s >= g.idle_s) return;
    int i = b->nlongest < MT_GPU_LONGEST ? b->nlongest++ : MT_GPU_LONGEST - 1;
    for (; i > 0 && b->longest[i - 1].idle_s < g.idle_s; i--) b->longest[i] = b->longest[i - 1];
    b->longest[i] = g;
}

void mt_bench_gpu_breakdown(mt_policy_trace_record *records, int n, mt_gpu_breakdown *out)
{
    memset(out, 0, sizeof *out);
    out->status = MT_GPU_TRACE_OK;
    out->tasks = n;
    if (n <= 0) return;
    mt_bench_sort_records(records, n);
    double last_end = records[0].end_s; /* the latest end among the tasks started so far */
    for (int i = 0; i < n; i++) {
        const mt_policy_trace_record *t = &records[i];
        mt_gpu_idle *e = idle_of(out, t->name);
        e->tasks++;
        if (i > 0 && t->start_s > last_end) {
            double idle = t->start_s - last_end;
            /* Popped before the GPU went idle: all of the gap waited for its inputs. */
            double from = t->pop_s > last_end ? t->pop_s : last_end;
            double inputs = t->pop_s > 0 && t->start_s > from ? t->start_s - from : 0;
            e->gaps++;
            e->idle_s += idle;
            e->inputs_s += inputs;
            out->idle_s += idle;
            out->inputs_s += inputs;
            keep_longest(out, (mt_gpu_gap){ .name = t->name, .tile = t->tile, .at_s = last_end, .idle_s = idle,
                                            .inputs_s = inputs });
        }
        if (t->end_s > last_end) last_end = t->end_s;
    }
    out->span_s = last_end - records[0].start_s;
    out->busy_s = out->span_s - out->idle_s;
    qsort(out->names, (size_t)out->nnames, sizeof *out->names, cmp_idle_desc);
}

static int cmp_record_worker(const void *a, const void *b)
{
    const mt_policy_trace_record *x = a, *y = b;
    if (x->worker != y->worker) return x->worker < y->worker ? -1 : 1;
    return cmp_record_start(a, b);
}

int mt_bench_gpu_breakdowns(mt_policy_trace_record *records, int n, mt_gpu_share *each, int max, mt_gpu_breakdown *out)
{
    mt_bench_gpu_breakdown(NULL, 0, out);
    if (n <= 0) return 0;
    qsort(records, (size_t)n, sizeof *records, cmp_record_worker);
    mt_gpu_breakdown b;
    double least = INFINITY;
    int count = 0;
    for (int a = 0, z; a < n; a = z) {
        for (z = a + 1; z < n && records[z].worker == records[a].worker; z++) {}
        mt_bench_gpu_breakdown(records + a, z - a, &b);
        if (count < max)
            each[count] = (mt_gpu_share){ .worker = records[a].worker, .tasks = b.tasks, .span_s = b.span_s,
                                          .busy_s = b.busy_s, .idle_s = b.idle_s, .inputs_s = b.inputs_s };
        count++;
        const double busy = b.span_s > 0 ? b.busy_s / b.span_s : 1.0;
        if (busy < least) {
            least = busy;
            *out = b;
        }
    }
    return count;
}

/* The last column: how clip speculation fared. */
static void speculation_text(const mt_bench_result *r, char *spec, size_t len)
{
    snprintf(spec, len, "-");
    if (r->speculated) snprintf(spec, len, "%lld of %lld steps", (long long)r->speculation_held, (long long)r->speculated);
    if (r->ranged_spec > 0)
        snprintf(spec, len, "ranged %.0f%%, in range %.0f%%, %.2f%% flagged, %s bounds%s", 100 * r->ranged_spec,
                 100 * r->ranged_in, 100 * r->ranged_flagged,
                 mt_ranged_bounds_option((mt_ranged_bounds)r->bounds_used),
                 r->deferred ? ", deferred" : "");
}

/* The table without a CUDA worker: no transfers, GPU time or GPU memory to show. The model's
 * rate is in GFLOP/s, where a CPU's figure has digits. */
static void print_cpu(const mt_bench_options *o, const mt_bench_result *r, bool header, FILE *out)
{
    if (header)
        fprintf(out, "| shape | tokens/step | K | clip | policy | CPU workers | step s | tok/s | model GFLOP/s | AdamW alone s (s/1e9) | AdamW in step CPU s (s/1e9) | AdamW span s | AdamW tail s | boundary gap s | peak host GiB | clip speculation held |\n"
                     "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    char spec[96];
    speculation_text(r, spec, sizeof spec);
    fprintf(out, "| %s | %d x %lld x %lld | %d | %g | %s | %d | %.3f | %.0f | %.2f | %.2f (%.3f) | %.2f (%.3f) | %.3f | %.3f | %.3f | %.1f | %s |\n",
            mt_bench_model_name(o), o->step.accum, (long long)o->step.B, (long long)o->step.T, r->K, r->clip,
            o->runtime.sched ? o->runtime.sched : mt_default_sched(), r->ncpu, r->step_s, r->tokens_per_s,
            1e3 * r->tflops, r->adamw_standalone_s, r->adamw_s_per_gparam, r->adamw_step_cpu_s,
            r->adamw_step_s_per_gparam, r->adamw_span_s, r->adamw_tail_s, r->boundary_gap_s, r->peak_host_gib, spec);
}

void mt_bench_print(const mt_bench_options *o, const mt_bench_result *r, bool header, FILE *out)
{
    if (!r->cuda) {
        print_cpu(o, r, header, out);
        return;
    }
    if (header)
        fprintf(out, "| shape | tokens/step | K | clip | policy | prefetch | GPU limit | step s | tok/s | model TFLOP/s | H2D GB/step (GB/s) | D2H GB/step (GB/s) | GPU busy | GPU idle s/step | AdamW alone s (s/1e9) | AdamW in step CPU s (s/1e9) | AdamW span s | AdamW tail s | boundary gap s | peak GPU GiB (plan) | peak host GiB | clip speculation held |\n"
                     "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    char idle[32] = "-", spec[96];
    speculation_text(r, spec, sizeof spec);
    if (!isnan(r->gpu_idle_s)) snprintf(idle, sizeof idle, "%.3f", r->gpu_idle_s);
    fprintf(out, "| %s | %d x %lld x %lld | %d | %g | %s | %s | %s | %.3f | %.0f | %.1f | %.2f (%.1f) | %.2f (%.1f) | %.2f | %s | %.2f (%.3f) | %.2f (%.3f) | %.3f | %.3f | %.3f | %.2f (%.2f) | %.1f | %s |\n",
            mt_bench_model_name(o), o->step.accum, (long long)o->step.B, (long long)o->step.T, r->K, r->clip,
            o->runtime.sched ? o->runtime.sched : mt_default_sched(), o->prefetch ? "on" : "off",
            r->gpu_limit_mib ? "bounded" : "resident", r->step_s, r->tokens_per_s, r->tflops, r->h2d_gb, r->h2d_gbs,
            r->d2h_gb, r->d2h_gbs, r->gpu_busy, idle, r->adamw_standalone_s, r->adamw_s_per_gparam, r->adamw_step_cpu_s, r->adamw_step_s_per_gparam, r->adamw_span_s,
            r->adamw_tail_s, r->boundary_gap_s, r->peak_gpu_gib, r->plan_gpu_gib, r->peak_host_gib, spec);
}

/* The notes under a table: the limit, and what the memory columns mean. */
void mt_bench_print_notes(const mt_bench_options *o, const mt_bench_result *r, int count, FILE *out)
{
    if (!r[0].cuda) {
        for (int i = 0; i < count; i++)
            fprintf(out, "(K=%d clip %g: %lld layers, %lld checkpoints of %.4f GiB; no CUDA worker: every task ran on the "
                         "%d CPU workers; model GFLOP/s = (6 N + 6 L d T) tokens / step time)\n",
                    r[i].K, r[i].clip, (long long)r[i].layers, (long long)r[i].checkpoints, r[i].checkpoint_gib,
                    r[i].ncpu);
        return;
    }
    if (r[0].gpu_limit_mib) fprintf(out, "(GPU limit STARPU_LIMIT_CUDA_MEM = %llu MiB)\n", (unsigned long long)r[0].gpu_limit_mib);
    for (int i = 0; i < count && r[0].ncuda > 1; i++)
        fprintf(out, "(K=%d clip %g: %d CUDA workers: GPU busy is their mean, the least busy %.2f; H2D and D2H are "
                     "every GPU's; between GPUs %.2f GB/step)\n",
                r[i].K, r[i].clip, r[i].ncuda, r[i].gpu_busy_min, r[i].p2p_gb);
    for (int i = 0; i < count; i++)
        fprintf(out, "(K=%d clip %g: %lld layers, %lld checkpoints of %.4f GiB; peak GPU = StarPU's allocated bytes, sampled at "
                     "task ends: %.2f GiB against the memory plan's %.2f GiB (%+.1f%%); whole device in use at the end, CUDA "
                     "context and libraries included: %.2f GiB)\n",
                r[i].K, r[i].clip, (long long)r[i].layers, (long long)r[i].checkpoints, r[i].checkpoint_gib,
                r[i].peak_gpu_gib, r[i].plan_gpu_gib,
                r[i].plan_gpu_gib > 0 ? 100.0 * (r[i].peak_gpu_gib / r[i].plan_gpu_gib - 1) : 0.0, r[i].device_used_gib);
}

/* "layer i" for a layer's tile, "tile i" for the embedding's and the head's, "-" unknown. */
static const char *tile_label(int tile, int64_t layers, char *buf, size_t len)
{
    if (tile < 0) return "-";
    if (tile >= 1 && tile <= layers) snprintf(buf, len, "layer %d", tile - 1);
    else snprintf(buf, len, "tile %d", tile);
    return buf;
}

/* One GPU's time over the window, the rest of a line. */
static void print_time(FILE *out, int tasks, double busy_s, double span_s, double idle_s, double inputs_s, int steps)
{
    fprintf(out, "%d tasks, busy %.3f s of %.3f s (%.1f%%); idle %.3f s/step, of which %.3f s/step waiting for inputs\n",
            tasks, busy_s, span_s, span_s > 0 ? 100.0 * busy_s / span_s : 0.0, idle_s / steps, inputs_s / steps);
}

void mt_bench_print_gpu(const mt_bench_options *o, const mt_bench_result *r, FILE *out)
{
    const mt_gpu_breakdown *b = &r->gpu;
    fprintf(out, "bench: GPU time, K=%d clip %g, %d measured step%s: ", r->K, r->clip, o->steps, o->steps == 1 ? "" : "s");
    if (b->status == MT_GPU_TRACE_OTHER_POLICY) {
        fprintf(out, "not available (policy %s)\n", o->runtime.sched ? o->runtime.sched : mt_default_sched());
        return;
    }
    if (b->status == MT_GPU_TRACE_NO_CUDA) {
        fprintf(out, "no CUDA worker\n");
        return;
    }
    if (b->tasks == 0) {
        fprintf(out, "no task ran on a CUDA worker\n");
        return;
    }
    if (r->ngpu_shares > 1) {
        /* a line a GPU; the breakdown below is the least busy one's */
        fprintf(out, "%d CUDA workers, each apart:\n", r->ngpu_shares);
        const int shown = r->ngpu_shares < MT_BENCH_MAX_GPUS ? r->ngpu_shares : MT_BENCH_MAX_GPUS;
        for (int i = 0; i < shown; i++) {
            const mt_gpu_share *g = &r->gpu_each[i];
            fprintf(out, "bench:   worker %d: ", g->worker);
            print_time(out, g->tasks, g->busy_s, g->span_s, g->idle_s, g->inputs_s, o->steps);
        }
        fprintf(out, "bench: the least busy one's: ");
    }
    print_time(out, b->tasks, b->busy_s, b->span_s, b->idle_s, b->inputs_s, o->steps);
    if (b->dropped)
        fprintf(out, "bench: the trace was full: %d events dropped, the breakdown misses their tasks\n", b->dropped);
    fprintf(out, "| idle before | tasks | gaps | idle s | of which inputs s | share of idle |\n|---|---|---|---|---|---|\n");
    for (int i = 0; i < b->nnames; i++) {
        const mt_gpu_idle *e = &b->names[i];
        fprintf(out, "| %s | %d | %d | %.4f | %.4f | %.1f%% |\n", e->name, e->tasks, e->gaps, e->idle_s, e->inputs_s,
                b->idle_s > 0 ? 100.0 * e->idle_s / b->idle_s : 0.0);
    }
    if (!b->nlongest) return;
    fprintf(out, "| longest gaps: before | tile | step | idle from, s into the step | idle ms | of which inputs ms |\n"
                 "|---|---|---|---|---|---|\n");
    for (int i = 0; i < b->nlongest; i++) {
        const mt_gpu_gap *g = &b->longest[i];
        char tile[32], step[32] = "-", since[32] = "-";
        if (g->step > 0) {
            snprintf(step, sizeof step, "%d", g->step);
            snprintf(since, sizeof since, "%.4f", g->since_step_s);
        }
        fprintf(out, "| %s | %s | %s | %s | %.3f | %.3f |\n", g->name, tile_label(g->tile, r->layers, tile, sizeof tile),
                step, since, 1e3 * g->idle_s, 1e3 * g->inputs_s);
    }
}
