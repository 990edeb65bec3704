/* The "megatrain" StarPU scheduling policy: GPU tasks run in program order, CPU tasks by
 * priority, and the weights of the next layer are prefetched to the GPU from the pre-execution
 * hook of the current one (prefetching from pop_task thrashes under a tight memory budget),
 * only once that layer's AdamW update has landed. */
#ifndef MT_RUNTIME_POLICY_H
#define MT_RUNTIME_POLICY_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "codelets/mt_starpu.h"

struct mt_host_state;

/* Give it to starpu_conf.sched_policy, or pick it by name through mt_runtime_init ("megatrain"). */
extern struct starpu_sched_policy mt_sched_policy;

/* A compute task's prefetch hint, for starpu_task.sched_data (STARPU_TASK_SCHED_DATA): when the
 * task starts on a GPU, bring tile `tile`'s streamed weights there once `version` updates of
 * that tile have landed. Encoded in the pointer itself: nothing to free. tile < 0: no hint. */
void *mt_policy_hint(int tile, uint32_t version);

/* StarPU's initial scheduling context, the one starpu_init (so mt_runtime_init) creates and the
 * policy it was given runs in: id 0 in StarPU's API, where starpu_sched_ctx_create hands out the
 * others. The functions below take the context whose policy they address; each is a no-op (or
 * returns -1) when another policy runs there, and assumes StarPU is initialised. */
#define MT_SCHED_CTX_INITIAL 0u

/* Binds the context's policy to a host state's weight handles; detach before the state is
 * destroyed. */
void mt_policy_attach(unsigned sched_ctx, struct mt_host_state *st);
void mt_policy_detach(unsigned sched_ctx);

/* The graph brackets its submission of an update of `tile` (partition, AdamW tasks, unpartition)
 * with this, true then false: meanwhile the tile is not prefetched (StarPU counts the handle as
 * partitioned then, and prefetching a partitioned handle unpartitions it). */
void mt_policy_tile_submitting(unsigned sched_ctx, int tile, bool submitting);

/* The graph calls this when an update of `tile` has landed (its streamed weights are whole and
 * current in host memory): issues a prefetch that was waiting for it. */
void mt_policy_tile_updated(unsigned sched_ctx, int tile);

/* Whether the pre-execution hook prefetches; on from the policy's start (`bench --no-prefetch`
 * turns it off to measure what it brings). */
void mt_policy_set_prefetch(unsigned sched_ctx, int enabled);

/* Says on `out` what each busy worker is doing (running a task, or waiting for its inputs: the
 * task's name and for how long) and the policy's ready lists (length, first tasks): what the
 * watchdog prints when nothing finishes. -1 when the megatrain policy is not the running one. */
int mt_policy_report(unsigned sched_ctx, FILE *out);
/* How many tasks that carried a prefetch hint (mt_policy_hint) worker `worker` has started under
 * the policy since it started, or -1 when the megatrain policy is not the running one. Over several
 * devices each device's worker sees its own share (the hints prefetch to its memory node). */
long long mt_policy_hinted_tasks(unsigned sched_ctx, int worker);
/* How many tasks have finished under the policy since it started (the watchdog's measure of
 * progress), or -1 when the megatrain policy is not the running one. */
long long mt_policy_finished(unsigned sched_ctx);

/* One task a worker ran while the trace was on. Times are CLOCK_MONOTONIC seconds. */
typedef struct mt_policy_trace_record {
    const char *name;      /* the codelet's name (static storage), or "?" */
    int worker;            /* the worker that ran it */
    bool cuda;             /* a CUDA worker (the only kind traced unless all_workers) */
    int tile;              /* the tile whose weights, or a chunk of whose weights, gradient, master or
                            * m, are its first buffer (0 embedding, 1..L layers, L+1 head), or -1 */
    double pop_s;          /* the worker took it from the policy; 0 when that was before the trace */
    double start_s;        /* pre_exec_hook: its inputs are on the GPU, its kernels about to be queued */
    double end_s;          /* post_exec_hook: StarPU saw its kernels complete */
} mt_policy_trace_record;

/* Starts recording every task a CUDA worker runs (all_workers: every worker), into room for
 * `capacity` events (three per task: pop, start, end). On a CPU worker the start is the codelet's
 * call and the end its return. Returns 0, or -1 when the megatrain policy does not run in the context
 * (other policies have no hooks). Costs nothing while off; while on, one atomic add per event. */
int mt_policy_trace_begin(unsigned sched_ctx, int capacity, bool all_workers);

/* Stops the trace; call it with no task running (after starpu_task_wait_for_all). *records gets
 * the tasks that both started and ended while it ran, in no particular order (malloc'd, the
 * caller frees it), *n their count. Returns how many events did not fit in the capacity (0: complete), or -1
 * when no trace runs. */
int mt_policy_trace_end(unsigned sched_ctx, mt_policy_trace_record **records, int *n);

#endif
