/* The loss anchor as StarPU codelets: final norm + LM head + cross-entropy, chunked over tokens,
 * with its backward (training) or alone (validation). Arguments: mt_compute_args
 * (codelets/common.h). */
#ifndef MT_CODELETS_HEAD_H
#define MT_CODELETS_HEAD_H

#include "codelets/common.h"

/* head (loss anchor, forward + backward): [0] head weights R, [1] h_L R, [2] targets R,
 *   [3] dh_L W, [4] head grad W|RW, [5] loss (2 doubles: sum, count) W, [6] scratch SCRATCH,
 *   and when tied: [7] embed weights R, [8] embed grad (same W|RW as [4]); then the sumsq
 *   buffer of the head tile when args.sumsq, then the table's when args.table_sumsq */
extern struct starpu_codelet mt_cl_head;
/* head_eval (loss only): [0] head weights R, [1] h_L R, [2] targets R, [3] loss W,
 *   [4] scratch SCRATCH, [5] embed weights R when tied */
extern struct starpu_codelet mt_cl_head_eval;

#endif
