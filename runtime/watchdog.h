/* The watchdog: turns a task graph that stopped making progress into an error. A thread watches
 * the tasks finished (as the megatrain policy counts them) and StarPU's count of submitted,
 * unfinished tasks; when tasks are pending and neither has moved for the given time, it says what is waiting
 * (the policy's report: each busy worker's task and for how long, the ready lists), the memory of
 * every memory node, and ends the process with MT_WATCHDOG_EXIT. An idle graph (nothing pending,
 * the host busy with its own work: validation input, a checkpoint) is never a stall. It also
 * warns, once, when the host's available memory falls under 1 GiB (MT_HOST_LOW_MIB sets the
 * figure), naming this process's resident memory: a run the kernel kills for memory ends without
 * a word of its own. */
#ifndef MT_RUNTIME_WATCHDOG_H
#define MT_RUNTIME_WATCHDOG_H

#include <stdio.h>

/* The exit status of a process the watchdog ended (a stall, not a crash). */
#define MT_WATCHDOG_EXIT 3
/* Seconds without progress before it fires, when the caller gives none: far above any one task
 * of the graph (a layer of a 512k-token sequence runs for seconds, not minutes). */
#define MT_WATCHDOG_DEFAULT_S 300.0

typedef struct mt_watchdog mt_watchdog;

/* Starts watching (StarPU must be running) with `seconds` > 0; its report goes to stderr and, when
 * log is not NULL and not stderr, to log too; `what` names the run in it ("train", "bench").
 * Returns NULL when seconds <= 0 (no watchdog) or no thread could be started (said on stderr). */
mt_watchdog *mt_watchdog_start(double seconds, FILE *log, const char *what);
/* Stops and frees it (NULL: nothing); call before mt_runtime_shutdown. */
void mt_watchdog_stop(mt_watchdog *w);

#endif
