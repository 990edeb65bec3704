/* The megatrain scheduling policy, written against StarPU's public scheduler API in the shape of
 * StarPU's eager policy: one lock, two lists.
 *   GPU list: tasks a CUDA worker can run, ordered by job id, i.e. program (submission) order;
 *             the step is a chain, so this is the order the pipeline wants.
 *   CPU list: everything else, highest priority first, then program order.
 * With no CUDA worker every task goes to the CPU list, so the policy works on CPU-only machines.
 * The pre-execution hook of a GPU task reads its hint (which tile comes next) and prefetches
 * that tile's weights to this GPU, so the transfer overlaps the current task. An opt-in trace
 * records when each CUDA task was popped, started and ended (what `bench` turns into GPU idle). */
#include "runtime/policy.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "models/util.h"
#include "runtime/state.h"

#define MAX_PENDING 64

/* One event of the trace: a worker (a CUDA one, or any with trace_all) popped, started or ended a task. */
enum { TRACE_POP, TRACE_START, TRACE_END };
typedef struct trace_event {
    const struct starpu_task *task;    /* identifies the task while it lives (job ids are all 0 without FxT) */
    int seq;                           /* the slot claimed: events of one task in the order they happened */
    double t;                          /* CLOCK_MONOTONIC seconds */
    const char *name;
    starpu_data_handle_t first;        /* the task's first buffer: a tile's weights for compute tasks */
    int worker, kind;
} trace_event;

/* A prefetch waiting for its tile's update to land. */
typedef struct pending_prefetch {
    int tile;
    uint32_t version;
    unsigned node;
} pending_prefetch;

/* A worker's current task, as the hooks last saw it: taken from the policy (its inputs are
 * being fetched) or running. A report read from another thread may see one field newer than the
 * other: it is a diagnostic. */
enum { WORKER_IDLE, WORKER_FETCHING, WORKER_RUNNING };
typedef struct worker_now {
    atomic_int phase;
    const char *name;
    double since;             /* CLOCK_MONOTONIC seconds the phase began */
} worker_now;

/* The CPU list's tasks of one priority are contiguous; `last` is the latest of them. */
typedef struct prio_group {
    int prio;
    int count;
    struct starpu_task *last;
} prio_group;

typedef struct policy_data {
    starpu_pthread_mutex_t lock;
    struct starpu_task_list gpu_tasks, cpu_tasks;
    /* The CPU list's priority groups, highest first: an insert finds its place by priority in
     * a few dozen steps instead of walking past every lower task (at a clipped step's norm some
     * 3,000 high-priority AdamW tasks become ready behind as many low-priority ones). */
    prio_group *groups;
    int ngroups, capgroups;
    int ncuda;
    /* Prefetch state, under `lock`. */
    struct mt_host_state *st;
    uint32_t *versions;            /* (ntiles) updates landed per tile */
    bool *submitting;              /* (ntiles) the graph is between a partition and an unpartition submit */
    pending_prefetch pending[MAX_PENDING];
    int npending;
    int prefetch;
    /* What each worker is doing, for mt_policy_report: each worker writes its own entry only. */
    worker_now now[STARPU_NMAXWORKERS];
    atomic_ullong finished;        /* tasks whose post_exec_hook ran: the watchdog's progress */
    atomic_ullong hinted[STARPU_NMAXWORKERS]; /* tasks with a prefetch hint each worker started */
    /* The trace: `events` and `capacity` are set before `tracing` goes on, read after it goes off;
     * `nevents` counts claimed slots and may pass `capacity` (those events are dropped). */
    atomic_int tracing;
    trace_event *events;
    int capacity;
    bool trace_all;          /* CPU workers' tasks too, not only the CUDA workers' */
    atomic_int nevents;
} policy_data;

static void init_policy(unsigned ctx);

/* The policy instance of scheduling context sched_ctx, or NULL when another policy runs there.
 * Assumes StarPU is initialised. StarPU runs a copy of the policy structure (load_sched_policy
 * copies it into the context's own), so the copy is known by its methods, not by its address. */
static policy_data *running(unsigned sched_ctx)
{
    STARPU_ASSERT_MSG(sched_ctx < STARPU_NMAX_SCHED_CTXS, "megatrain policy: scheduling context %u does not exist",
                      sched_ctx);
    const struct starpu_sched_policy *p = starpu_sched_get_sched_policy_in_ctx(sched_ctx);
    if (!p || p->init_sched != init_policy) return NULL;
    return starpu_sched_ctx_get_policy_data(sched_ctx);
}

static void init_policy(unsigned ctx)
{
    policy_data *d = calloc(1, sizeof *d);
    starpu_task_list_init(&d->gpu_tasks);
    starpu_task_list_init(&d->cpu_tasks);
    STARPU_PTHREAD_MUTEX_INIT(&d->lock, NULL);
    d->ncuda = (int)starpu_cuda_worker_get_count();
    /* On: layer i+1's weights are prefetched from layer i's pre_exec_hook. A hint never names a
     * tile whose AdamW partition may still be active (StarPU aborts with "Could not find a valid
     * copy of the data" when a prefetch meets it), so the graph hints the next step's tile 0 only
     * for the version its update brings (mt_step_hint, runtime/step/compute.c). */
    d->prefetch = 1;
    /* A priority per tile (the graph ranks AdamW by how soon the next forward needs it). */
    starpu_sched_ctx_set_min_priority(ctx, -1000);
    starpu_sched_ctx_set_max_priority(ctx, 1000);
    starpu_sched_ctx_set_policy_data(ctx, d);
}

static void deinit_policy(unsigned ctx)
{
    policy_data *d = starpu_sched_ctx_get_policy_data(ctx);
    STARPU_ASSERT_MSG(starpu_task_list_empty(&d->gpu_tasks) && starpu_task_list_empty(&d->cpu_tasks),
                      "megatrain policy: tasks left at shutdown");
    STARPU_PTHREAD_MUTEX_DESTROY(&d->lock);
    free(d->versions);
    free(d->submitting);
    free(d->groups);
    free(d->events);
    free(d);
}

/* Whether only CUDA workers of the context can run the task (the graph pins its compute tasks to
 * the GPU). Anything a CPU worker can run - AdamW, the norm, StarPU's own partition and
 * unpartition tasks - goes to the CPU list: behind the GPU's program order it would wait for the
 * whole pipeline, and the updates the next forward needs first would land last. */
static int gpu_task(struct starpu_task *task, unsigned ctx)
{
    struct starpu_worker_collection *workers = starpu_sched_ctx_get_worker_collection(ctx);
    struct starpu_sched_ctx_iterator it;
    int gpu = 0;
    workers->init_iterator(workers, &it);
    while (workers->has_next(workers, &it)) {
        unsigned w = workers->get_next(workers, &it);
        if (!starpu_worker_can_execute_task_first_impl(w, task, NULL)) continue;
        if (starpu_worker_get_type((int)w) != STARPU_CUDA_WORKER) return 0;
        gpu = 1;
    }
    return gpu;
}

/* Inserts into the GPU list by job id, then arrival; assumes the lock is held. StarPU numbers jobs
 * only while FxT records a trace (src/core/jobs.c); otherwise every job id is 0 and the order is
 * that of arrival: ready tasks run first-in first-out, which for the GPU's dependent chain is
 * program order. */
static void insert_gpu(struct starpu_task_list *list, struct starpu_task *task)
{
    unsigned long id = starpu_task_get_job_id(task);
    struct starpu_task *t;
    /* Walk from the back: tasks mostly arrive in order, so this is usually one step. */
    for (t = starpu_task_list_back(list); t; t = t->prev)
        if (starpu_task_get_job_id(t) <= id) break;
    if (!t) starpu_task_list_push_front(list, task);
    else if (t == starpu_task_list_back(list)) starpu_task_list_push_back(list, task);
    else {
        /* insert after t */
        task->prev = t;
        task->next = t->next;
        t->next->prev = task;
        t->next = task;
    }
}

/* Inserts into the CPU list: after the tasks of higher priority and, among its equals, by job id
 * then arrival (as insert_gpu); assumes the lock is held. */
static void insert_cpu(policy_data *d, struct starpu_task *task)
{
    int k = 0;
    while (k < d->ngroups && d->groups[k].prio > task->priority) k++;
    if (k == d->ngroups || d->groups[k].prio != task->priority) {
        if (d->ngroups == d->capgroups) {
            d->capgroups = d->capgroups ? 2 * d->capgroups : 32;
            d->groups = realloc(d->groups, sizeof *d->groups * d->capgroups);
        }
        memmove(d->groups + k + 1, d->groups + k, sizeof *d->groups * (d->ngroups - k));
        d->groups[k] = (prio_group){ .prio = task->priority, .count = 0, .last = NULL };
        d->ngroups++;
    }
    prio_group *g = &d->groups[k];
    /* The task to insert after: the last of this group with a job id not above ours, else the
     * last of the group before (NULL: the front). */
    struct starpu_task *after = NULL;
    unsigned long id = starpu_task_get_job_id(task);
    int left = g->count;
    for (struct starpu_task *t = g->last; left > 0; t = t->prev, left--)
        if (starpu_task_get_job_id(t) <= id) { after = t; break; }
    if (!after && left == 0 && k > 0) after = d->groups[k - 1].last;
    if (!after) starpu_task_list_push_front(&d->cpu_tasks, task);
    else if (after == starpu_task_list_back(&d->cpu_tasks)) starpu_task_list_push_back(&d->cpu_tasks, task);
    else {
        task->prev = after;
        task->next = after->next;
        after->next->prev = task;
        after->next = task;
    }
    if (g->count == 0 || after == g->last) g->last = task;
    g->count++;
}

/* Removes a task of the CPU list; assumes the lock is held. */
static void erase_cpu(policy_data *d, struct starpu_task *task)
{
    int k = 0;
    while (d->groups[k].prio != task->priority) k++;
    prio_group *g = &d->groups[k];
    if (--g->count == 0) {
        memmove(d->groups + k, d->groups + k + 1, sizeof *d->groups * (d->ngroups - k - 1));
        d->ngroups--;
    } else if (g->last == task) {
        g->last = task->prev;
    }
    starpu_task_list_erase(&d->cpu_tasks, task);
}

static int push_task(struct starpu_task *task)
{
    unsigned ctx = task->sched_ctx;
    policy_data *d = starpu_sched_ctx_get_policy_data(ctx);
    int on_gpu = d->ncuda > 0 && gpu_task(task, ctx);
    STARPU_PTHREAD_MUTEX_LOCK(&d->lock);
    if (on_gpu) insert_gpu(&d->gpu_tasks, task);
    else insert_cpu(d, task);
    starpu_push_task_end(task);
    STARPU_PTHREAD_MUTEX_UNLOCK(&d->lock);

    struct starpu_worker_collection *workers = starpu_sched_ctx_get_worker_collection(ctx);
    struct starpu_sched_ctx_iterator it;
    workers->init_iterator(workers, &it);
    while (workers->has_next(workers, &it)) {
        unsigned w = workers->get_next(workers, &it);
        int is_gpu = starpu_worker_get_type((int)w) == STARPU_CUDA_WORKER;
        if (is_gpu == on_gpu && starpu_wake_worker_relax_light((int)w)) break;
    }
    return 0;
}

/* First task of `list` this worker can run, still in the list; assumes the lock is held. */
static struct starpu_task *first_runnable(struct starpu_task_list *list, unsigned worker)
{
    for (struct starpu_task *t = starpu_task_list_begin(list); t; t = starpu_task_list_next(t))
        if (starpu_worker_can_execute_task_first_impl(worker, t, NULL)) return t;
    return NULL;
}

/* The name a report gives a task: its codelet's, else its own. */
static const char *task_name(const struct starpu_task *task)
{
    const char *name = task->cl && task->cl->name ? task->cl->name : starpu_task_get_name((struct starpu_task *)task);
    return name ? name : "?";
}

/* Records one event of a task on a CUDA worker; assumes the trace is on. Lock-free: one atomic
 * add claims a slot. Where StarPU calls the hooks for an asynchronous CUDA task (STARPU_CUDA_ASYNC,
 * every codelet of the graph), read in StarPU 1.4.10's src/drivers/cuda/driver_cuda.c and
 * src/core/jobs.c:
 *   pre_exec_hook: from _starpu_driver_start_job, after the task's inputs arrived. Alone in the
 *     worker's pipeline, just before the codelet queues its kernels; queued behind another task
 *     (STARPU_CUDA_PIPELINE, default 2), only once the driver has seen that one complete, its
 *     kernels already queued on the stream.
 *   post_exec_hook: from _starpu_handle_job_termination, when the driver's poll finds the event
 *     recorded after the task's kernels complete (cudaEventQuery), before the task's callback
 *     and the release of its dependents; never for StarPU's internal tasks.
 * So end times are completion as the driver saw it (poll latency late), and the time from one
 * task's end to the next one's start holds the driver's own work between them: an upper bound
 * of the GPU's idle time, exact up to microseconds per task. */
static void trace_task(policy_data *d, struct starpu_task *task, int kind)
{
    int w = starpu_worker_get_id();
    if (w < 0 || (!d->trace_all && starpu_worker_get_type(w) != STARPU_CUDA_WORKER)) return;
    int i = atomic_fetch_add_explicit(&d->nevents, 1, memory_order_relaxed);
    if (i >= d->capacity) return;
    d->events[i] = (trace_event){ .task = task, .seq = i, .t = mt_clock_s(), .name = task_name(task),
                                  .first = STARPU_TASK_GET_NBUFFERS(task) > 0 ? STARPU_TASK_GET_HANDLE(task, 0) : NULL,
                                  .worker = w, .kind = kind };
}

/* Records what worker w now does (a store or two: every hook pays it). */
static void worker_is(policy_data *d, int w, int phase, const struct starpu_task *task)
{
    if (w < 0 || w >= STARPU_NMAXWORKERS) return;
    worker_now *n = &d->now[w];
    if (task) n->name = task_name(task);
    n->since = mt_clock_s();
    atomic_store_explicit(&n->phase, phase, memory_order_release);
}

/* Whether the trace is on: one load, all the hooks pay while it is off. */
static int tracing(policy_data *d)
{
    return atomic_load_explicit(&d->tracing, memory_order_acquire);
}

static struct starpu_task *pop_task(unsigned ctx)
{
    policy_data *d = starpu_sched_ctx_get_policy_data(ctx);
    int w = starpu_worker_get_id_check();
    int is_gpu = starpu_worker_get_type(w) == STARPU_CUDA_WORKER;
    struct starpu_task_list *list = is_gpu ? &d->gpu_tasks : &d->cpu_tasks;
    if (starpu_task_list_empty(list)) return NULL; /* unlocked peek: a push wakes us again */
    STARPU_PTHREAD_MUTEX_LOCK(&d->lock);
    /* GPU: strictly the head, so the GPU runs the program order. CPU: the best it can run. */
    struct starpu_task *t = NULL;
    if (is_gpu) {
        struct starpu_task *head = starpu_task_list_begin(list);
        if (head && starpu_worker_can_execute_task_first_impl((unsigned)w, head, NULL)) {
            starpu_task_list_erase(list, head);
            t = head;
        } else if (head && (t = first_runnable(list, (unsigned)w))) {
            starpu_task_list_erase(list, t);
        }
    } else if ((t = first_runnable(list, (unsigned)w))) {
        erase_cpu(d, t);
    }
    STARPU_PTHREAD_MUTEX_UNLOCK(&d->lock);
    if (t) worker_is(d, w, WORKER_FETCHING, t);
    if (t && tracing(d)) trace_task(d, t, TRACE_POP);
    return t;
}

void *mt_policy_hint(int tile, uint32_t version)
{
    if (tile < 0) return NULL;
    return (void *)(((uintptr_t)(uint32_t)(tile + 1) << 32) | version);
}

/* Starts the asynchronous transfer of a tile's weights to `node`; assumes the lock is held.
 * Never while the graph is submitting an update of the tile (between its partition and
 * unpartition submits, when StarPU counts the handle as partitioned): the prefetch of a
 * partitioned handle makes StarPU submit an implicit unpartition from this worker thread,
 * racing the graph's own (StarPU then aborts with "handle is not initialized, it cannot be read").
 * The window is the submitting thread's few microseconds, not the update's run: holding the
 * prefetch back until the update lands would delay the next layer's weights by a whole update,
 * as updates are submitted a step ahead. */
static void prefetch_tile(policy_data *d, int tile, unsigned node)
{
    if (d->submitting[tile]) return;
    starpu_data_prefetch_on_node(d->st->tiles[tile].h_weights, node, 1);
}

static void pre_exec_hook(struct starpu_task *task, unsigned ctx)
{
    policy_data *d = starpu_sched_ctx_get_policy_data(ctx);
    worker_is(d, starpu_worker_get_id(), WORKER_RUNNING, task);
    if (tracing(d)) trace_task(d, task, TRACE_START);
    uintptr_t hint = (uintptr_t)task->sched_data;
    int w = starpu_worker_get_id();
    if (hint && w >= 0 && w < STARPU_NMAXWORKERS) atomic_fetch_add_explicit(&d->hinted[w], 1, memory_order_relaxed);
    if (!hint || !d->prefetch) return;
    if (w < 0 || starpu_worker_get_type(w) != STARPU_CUDA_WORKER) return;
    unsigned node = starpu_worker_get_memory_node((unsigned)w);
    int tile = (int)(hint >> 32) - 1;
    uint32_t version = (uint32_t)hint;
    STARPU_PTHREAD_MUTEX_LOCK(&d->lock);
    if (d->st && tile < d->st->ntiles) {
        if (d->versions[tile] >= version) prefetch_tile(d, tile, node);
        else if (d->npending < MAX_PENDING)
            /* Its update has not landed: prefetching now would fetch stale weights (prefetch is
             * not ordered with the update), so wait for mt_policy_tile_updated. */
            d->pending[d->npending++] = (pending_prefetch){ tile, version, node };
    }
    STARPU_PTHREAD_MUTEX_UNLOCK(&d->lock);
}

static void post_exec_hook(struct starpu_task *task, unsigned ctx)
{
    policy_data *d = starpu_sched_ctx_get_policy_data(ctx);
    worker_is(d, starpu_worker_get_id(), WORKER_IDLE, NULL);
    atomic_fetch_add_explicit(&d->finished, 1, memory_order_relaxed);
    if (tracing(d)) trace_task(d, task, TRACE_END);
}

void mt_policy_tile_submitting(unsigned sched_ctx, int tile, bool submitting)
{
    policy_data *d = running(sched_ctx);
    if (!d) return;
    STARPU_PTHREAD_MUTEX_LOCK(&d->lock);
    if (d->st && tile >= 0 && tile < d->st->ntiles) d->submitting[tile] = submitting;
    STARPU_PTHREAD_MUTEX_UNLOCK(&d->lock);
}

void mt_policy_tile_updated(unsigned sched_ctx, int tile)
{
    policy_data *d = running(sched_ctx);
    if (!d) return;
    STARPU_PTHREAD_MUTEX_LOCK(&d->lock);
    if (d->st && tile >= 0 && tile < d->st->ntiles) {
        d->versions[tile]++;
        for (int i = 0; i < d->npending;) {
            if (d->pending[i].tile == tile && d->versions[tile] >= d->pending[i].version) {
                prefetch_tile(d, tile, d->pending[i].node);
                d->pending[i] = d->pending[--d->npending];
            } else {
                i++;
            }
        }
    }
    STARPU_PTHREAD_MUTEX_UNLOCK(&d->lock);
}

void mt_policy_attach(unsigned sched_ctx, struct mt_host_state *st)
{
    policy_data *d = running(sched_ctx);
    if (!d) return;
    STARPU_PTHREAD_MUTEX_LOCK(&d->lock);
    d->st = st;
    free(d->versions);
    d->versions = calloc(st->ntiles, sizeof *d->versions);
    free(d->submitting);
    d->submitting = calloc(st->ntiles, sizeof *d->submitting);
    d->npending = 0;
    STARPU_PTHREAD_MUTEX_UNLOCK(&d->lock);
}

void mt_policy_detach(unsigned sched_ctx)
{
    policy_data *d = running(sched_ctx);
    if (!d) return;
    STARPU_PTHREAD_MUTEX_LOCK(&d->lock);
    d->st = NULL;
    d->npending = 0;
    STARPU_PTHREAD_MUTEX_UNLOCK(&d->lock);
}

void mt_policy_set_prefetch(unsigned sched_ctx, int enabled)
{
    policy_data *d = running(sched_ctx);
    if (d) d->prefetch = enabled;
}

int mt_policy_trace_begin(unsigned sched_ctx, int capacity, bool all_workers)
{
    policy_data *d = running(sched_ctx);
    if (!d) return -1;
    STARPU_ASSERT_MSG(capacity > 0, "mt_policy_trace_begin: capacity %d, give room for at least one event", capacity);
    STARPU_ASSERT_MSG(!tracing(d), "mt_policy_trace_begin: a trace is already on; end it first");
    free(d->events);
    d->events = malloc(sizeof *d->events * (size_t)capacity);
    STARPU_ASSERT_MSG(d->events, "mt_policy_trace_begin: no memory for %d events", capacity);
    d->capacity = capacity;
    d->trace_all = all_workers;
    atomic_store_explicit(&d->nevents, 0, memory_order_relaxed);
    atomic_store_explicit(&d->tracing, 1, memory_order_release);
    return 0;
}

/* By task, then in the order they happened: a task's events side by side, and those of a later
 * task at the same address (StarPU frees tasks that end) after them. */
static int cmp_event(const void *a, const void *b)
{
    const trace_event *x = a, *y = b;
    if (x->task != y->task) return (uintptr_t)x->task < (uintptr_t)y->task ? -1 : 1;
    return (x->seq > y->seq) - (x->seq < y->seq);
}

/* Whether `h` is one of the chunk handles of `hs` (NULL: that partition does not exist). */
static bool in_chunks(starpu_data_handle_t const *hs, int n, starpu_data_handle_t h)
{
    for (int c = 0; hs && c < n; c++)
        if (hs[c] == h) return true;
    return false;
}

/* The tile whose weights are `h`, or whose chunk of weights, gradient, master (or its low half) or m `h` is
 * (the first buffer of the CPU's update and embedding tasks), or -1; assumes the lock is held. */
static int tile_of(const policy_data *d, starpu_data_handle_t h)
{
    for (int i = 0; h && d->st && i < d->st->ntiles; i++) {
        const mt_tile *t = &d->st->tiles[i];
        if (t->h_weights == h || in_chunks(t->h_weights_chunk, t->nchunks, h) ||
            in_chunks(t->h_grad_chunk, t->nchunks, h) || in_chunks(t->h_master_chunk, t->nchunks, h) ||
            in_chunks(t->h_master_lo_chunk, t->nchunks, h) || in_chunks(t->h_m_chunk, t->nchunks, h))
            return i;
    }
    return -1;
}

int mt_policy_trace_end(unsigned sched_ctx, mt_policy_trace_record **records, int *n)
{
    *records = NULL;
    *n = 0;
    policy_data *d = running(sched_ctx);
    if (!d || !tracing(d)) return -1;
    atomic_store_explicit(&d->tracing, 0, memory_order_seq_cst);
    int claimed = atomic_load_explicit(&d->nevents, memory_order_acquire);
    int nev = claimed < d->capacity ? claimed : d->capacity;
    qsort(d->events, (size_t)nev, sizeof *d->events, cmp_event);
    mt_policy_trace_record *r = malloc(sizeof *r * (size_t)(nev / 2 + 1));
    STARPU_ASSERT_MSG(r, "mt_policy_trace_end: no memory for %d records", nev / 2 + 1);
    int count = 0;
    STARPU_PTHREAD_MUTEX_LOCK(&d->lock);
    for (int i = 0; i < nev;) {
        /* One run of a task: pop, start, end of one address, each at most once and in that order. */
        int j = i;
        double t[3] = { 0, 0, 0 };
        while (j < nev && d->events[j].task == d->events[i].task && (j == i || d->events[j].kind > d->events[j - 1].kind)) {
            t[d->events[j].kind] = d->events[j].t;
            j++;
        }
        const trace_event *e = &d->events[j - 1];
        if (t[TRACE_START] > 0 && t[TRACE_END] > 0)
            r[count++] = (mt_policy_trace_record){ .name = e->name, .worker = e->worker,
                                                   .cuda = starpu_worker_get_type(e->worker) == STARPU_CUDA_WORKER,
                                                   .tile = tile_of(d, e->first), .pop_s = t[TRACE_POP],
                                                   .start_s = t[TRACE_START], .end_s = t[TRACE_END] };
        i = j;
    }
    STARPU_PTHREAD_MUTEX_UNLOCK(&d->lock);
    free(d->events);
    d->events = NULL;
    d->capacity = 0;
    *records = r;
    *n = count;
    return claimed - nev;
}

/* Up to `max` names of a list's first tasks; assumes the lock is held. */
static void print_list_head(FILE *out, const char *what, struct starpu_task_list *list, int max)
{
    int n = 0;
    for (struct starpu_task *t = starpu_task_list_begin(list); t; t = starpu_task_list_next(t)) n++;
    fprintf(out, "  %s: %d ready task%s", what, n, n == 1 ? "" : "s");
    int k = 0;
    for (struct starpu_task *t = starpu_task_list_begin(list); t && k < max; t = starpu_task_list_next(t), k++)
        fprintf(out, "%s%s (priority %d)", k ? ", " : ", first ", task_name(t), t->priority);
    fputc('\n', out);
}

long long mt_policy_hinted_tasks(unsigned sched_ctx, int worker)
{
    policy_data *d = running(sched_ctx);
    if (!d || worker < 0 || worker >= STARPU_NMAXWORKERS) return -1;
    return (long long)atomic_load_explicit(&d->hinted[worker], memory_order_relaxed);
}

long long mt_policy_finished(unsigned sched_ctx)
{
    policy_data *d = running(sched_ctx);
    return d ? (long long)atomic_load_explicit(&d->finished, memory_order_relaxed) : -1;
}

int mt_policy_report(unsigned sched_ctx, FILE *out)
{
    policy_data *d = running(sched_ctx);
    if (!d) return -1;
    const double now = mt_clock_s();
    const unsigned nw = starpu_worker_get_count();
    for (unsigned w = 0; w < nw && w < STARPU_NMAXWORKERS; w++) {
        char name[64];
        starpu_worker_get_name((int)w, name, sizeof name);
        const worker_now *n = &d->now[w];
        const int phase = atomic_load_explicit(&n->phase, memory_order_acquire);
        if (phase == WORKER_IDLE) continue;
        fprintf(out, "  %s: %s %s for %.0f s\n", name, phase == WORKER_RUNNING ? "running" : "waiting for the inputs of",
                n->name ? n->name : "?", now - n->since);
    }
    STARPU_PTHREAD_MUTEX_LOCK(&d->lock);
    if (d->ncuda > 0) print_list_head(out, "GPU list", &d->gpu_tasks, 3);
    print_list_head(out, "CPU list", &d->cpu_tasks, 3);
    STARPU_PTHREAD_MUTEX_UNLOCK(&d->lock);
    return 0;
}

struct starpu_sched_policy mt_sched_policy = {
    .init_sched = init_policy,
    .deinit_sched = deinit_policy,
    .push_task = push_task,
    .pop_task = pop_task,
    .pre_exec_hook = pre_exec_hook,
    .post_exec_hook = post_exec_hook,
    .policy_name = "megatrain",
    .policy_description = "megatrain: GPU tasks in program order, next layer prefetched from the pre-exec hook",
    .worker_type = STARPU_WORKER_LIST,
};
