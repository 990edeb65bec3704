/* The megatrain scheduling policy, written against StarPU's public scheduler API in the shape of
 * StarPU's eager policy: one lock, two lists.
 *   GPU list: tasks a CUDA worker can run, ordered by job id, i.e. program (submission) order;
 *             the step is a chain, so this is the order the pipeline wants.
 *   CPU list: everything else, highest priority first, then program order.
 * With no CUDA worker every task goes to the CPU list, so the policy works on CPU-only machines.
 * The pre-execution hook of a GPU task reads its hint (which tile comes next) and prefetches
 * that tile's weights to this GPU, so the transfer overlaps the current task. */
#include "policy.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "state.h"

#define MAX_PENDING 64

/* A prefetch waiting for its tile's update to land. */
typedef struct pending_prefetch {
    int tile;
    uint32_t version;
    unsigned node;
} pending_prefetch;

typedef struct policy_data {
    starpu_pthread_mutex_t lock;
    struct starpu_task_list gpu_tasks, cpu_tasks;
    int ncuda;
    /* Prefetch state, under `lock`. */
    struct mt_host_state *st;
    uint32_t *versions;            /* (ntiles) updates landed per tile */
    pending_prefetch pending[MAX_PENDING];
    int npending;
    int prefetch;
} policy_data;

/* The policy instance of the running context, or NULL when another policy runs. Assumes
 * StarPU is initialised. */
static policy_data *running(void)
{
    if (starpu_sched_get_sched_policy() != &mt_sched_policy) return NULL;
    return starpu_sched_ctx_get_policy_data(0); /* the initial (global) context */
}

static void init_policy(unsigned ctx)
{
    policy_data *d = calloc(1, sizeof *d);
    starpu_task_list_init(&d->gpu_tasks);
    starpu_task_list_init(&d->cpu_tasks);
    STARPU_PTHREAD_MUTEX_INIT(&d->lock, NULL);
    d->ncuda = (int)starpu_cuda_worker_get_count();
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

/* Inserts by (priority desc when by_priority, then job id asc); assumes the lock is held. */
static void insert_sorted(struct starpu_task_list *list, struct starpu_task *task, int by_priority)
{
    unsigned long id = starpu_task_get_job_id(task);
    struct starpu_task *t;
    /* Walk from the back: tasks mostly arrive in order, so this is usually one step. */
    for (t = starpu_task_list_back(list); t; t = t->prev) {
        int before = by_priority ? (t->priority > task->priority ||
                                    (t->priority == task->priority && starpu_task_get_job_id(t) < id))
                                 : starpu_task_get_job_id(t) < id;
        if (before) break;
    }
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

static int push_task(struct starpu_task *task)
{
    unsigned ctx = task->sched_ctx;
    policy_data *d = starpu_sched_ctx_get_policy_data(ctx);
    int on_gpu = d->ncuda > 0 && gpu_task(task, ctx);
    STARPU_PTHREAD_MUTEX_LOCK(&d->lock);
    insert_sorted(on_gpu ? &d->gpu_tasks : &d->cpu_tasks, task, !on_gpu);
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

/* First task of `list` this worker can run; assumes the lock is held. */
static struct starpu_task *take(struct starpu_task_list *list, unsigned worker)
{
    for (struct starpu_task *t = starpu_task_list_begin(list); t; t = starpu_task_list_next(t))
        if (starpu_worker_can_execute_task_first_impl(worker, t, NULL)) {
            starpu_task_list_erase(list, t);
            return t;
        }
    return NULL;
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
        } else if (head) {
            t = take(list, (unsigned)w);
        }
    } else {
        t = take(list, (unsigned)w);
    }
    STARPU_PTHREAD_MUTEX_UNLOCK(&d->lock);
    return t;
}

void *mt_policy_hint(int tile, uint32_t version)
{
    if (tile < 0) return NULL;
    return (void *)(((uintptr_t)(uint32_t)(tile + 1) << 32) | version);
}

/* Starts the asynchronous transfer of a tile's weights to `node`; assumes the lock is held. */
static void prefetch_tile(policy_data *d, int tile, unsigned node)
{
    starpu_data_prefetch_on_node(d->st->tiles[tile].h_weights, node, 1);
}

static void pre_exec_hook(struct starpu_task *task, unsigned ctx)
{
    policy_data *d = starpu_sched_ctx_get_policy_data(ctx);
    uintptr_t hint = (uintptr_t)task->sched_data;
    if (!hint || !d->prefetch) return;
    int w = starpu_worker_get_id();
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

void mt_policy_tile_updated(int tile)
{
    policy_data *d = running();
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

void mt_policy_attach(struct mt_host_state *st)
{
    policy_data *d = running();
    if (!d) return;
    STARPU_PTHREAD_MUTEX_LOCK(&d->lock);
    d->st = st;
    free(d->versions);
    d->versions = calloc(st->ntiles, sizeof *d->versions);
    d->npending = 0;
    STARPU_PTHREAD_MUTEX_UNLOCK(&d->lock);
}

void mt_policy_detach(void)
{
    policy_data *d = running();
    if (!d) return;
    STARPU_PTHREAD_MUTEX_LOCK(&d->lock);
    d->st = NULL;
    d->npending = 0;
    STARPU_PTHREAD_MUTEX_UNLOCK(&d->lock);
}

void mt_policy_set_prefetch(int enabled)
{
    policy_data *d = running();
    if (d) d->prefetch = enabled;
}

struct starpu_sched_policy mt_sched_policy = {
    .init_sched = init_policy,
    .deinit_sched = deinit_policy,
    .push_task = push_task,
    .pop_task = pop_task,
    .pre_exec_hook = pre_exec_hook,
    .policy_name = "megatrain",
    .policy_description = "megatrain: GPU tasks in program order, next layer prefetched from the pre-exec hook",
    .worker_type = STARPU_WORKER_LIST,
};
