/* The "megatrain" StarPU scheduling policy: GPU tasks run in program order, CPU tasks by
 * priority, and the weights of the next layer are prefetched to the GPU from the pre-execution
 * hook of the current one (design.md: prefetching from pop_task thrashes under a tight budget),
 * only once that layer's AdamW update has landed. */
#ifndef MT_RUNTIME_POLICY_H
#define MT_RUNTIME_POLICY_H

#include <stdint.h>

#include "mt_starpu.h"

struct mt_host_state;

/* Give it to starpu_conf.sched_policy, or pick it by name through mt_runtime_init ("megatrain"). */
extern struct starpu_sched_policy mt_sched_policy;

/* A compute task's prefetch hint, for starpu_task.sched_data (STARPU_TASK_SCHED_DATA): when the
 * task starts on a GPU, bring tile `tile`'s streamed weights there once `version` updates of
 * that tile have landed. Encoded in the pointer itself: nothing to free. tile < 0: no hint. */
void *mt_policy_hint(int tile, uint32_t version);

/* Binds the policy (when it is the running one) to a host state's weight handles; detach before
 * the state is destroyed. No effect under other policies. */
void mt_policy_attach(struct mt_host_state *st);
void mt_policy_detach(void);

/* The graph calls this when an update of `tile` has landed (its streamed weights are whole and
 * current in host memory): issues a prefetch that was waiting for it. */
void mt_policy_tile_updated(int tile);

/* Whether prefetching is on (default) - `bench` turns it off for the ablation. */
void mt_policy_set_prefetch(int enabled);

#endif
