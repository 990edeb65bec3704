/* Token embedding as StarPU codelets: forward gathers rows of the table, backward scatters the
 * gradient into the table's gradient (and, last in the step, its sum of squares); and the two
 * codelets of the table's early update path, per AdamW chunk on CPU workers, which start the
 * table's update before its embedding backward (runtime/step/table.c says when and why). */
#ifndef MT_CODELETS_EMBEDDING_H
#define MT_CODELETS_EMBEDDING_H

#include <stdbool.h>
#include <stdint.h>

#include "codelets/adamw.h"
#include "codelets/common.h"

/* embedding_forward: [0] embed weights R, [1] tokens (int32, ntok) R, [2] h0 (ntok, d) W;
 *   args: mt_compute_args */
extern struct starpu_codelet mt_cl_embedding_forward;
/* embedding_backward: [0] tokens R, [1] dh0 (ntok, d) R, [2] embed grad W|RW (accumulate),
 *   [3] scratch SCRATCH, then the sumsq buffer when args.sumsq; args: mt_compute_args. The
 *   gradient's mode is given at insertion. */
extern struct starpu_codelet mt_cl_embedding_backward;

/* The early path's codelets. Args of both: mt_embed_chunk_args.
 * embedding_update_early: the weights half of AdamW on the chunk, as adamw_params, on the
 *   gradient as the head left it (the whole gradient of every row no token touches), and the
 *   chunk's row sums of squares of it: [0] master R, [1] m R, [2] v R, [3] gradient R, [4]
 *   streamed weights W, [5] row sums W (one double per row overlapping the chunk,
 *   backends/cpu/table_sumsq.h); ranged, [6] flags W, [7] the head tile's known buffer R and
 *   [8] the last norm's record R; deferred, master, m and v RW, [9] the last update's gradient
 *   chunk R and [10] its clip buffer R.
 * embedding_backward_chunk: the embedding backward on the chunk, after it: [0] gradient RW, then
 *   per micro-batch tokens R and dh0 (ntok, d) R, then master, m, v R and the streamed weights RW;
 *   the rows the step's tokens touch get the weights half again, now on the whole gradient. With
 *   `sumsq`, then the row sums RW (the touched rows' redone) and the chunk's sum of squares W;
 *   ranged, the flags buffer RW last: the touched rows are flagged instead of redone. */
typedef struct mt_embed_chunk_args {
    int64_t offset;          /* the chunk's first element in the table */
    int64_t d, ntok;         /* hidden size; tokens per micro-batch */
    int micro_batches;
    bool sumsq;
    mt_adamw_params p;       /* unclipped: the weights half as if the clip scale were 1 */
    mt_dtype dtype;          /* of the streamed weights */
    bool ranged;             /* ranged speculation instead (bf16), with `ra` */
    mt_ranged_args ra;
    bool deferred;           /* ranged: embedding_update_early runs the last update's moments
                              * half too (with po, the last update's parameters, unclipped) */
    mt_adamw_params po;
    mt_adamw_stats *stats;   /* the graph's (codelets/adamw.h) */
} mt_embed_chunk_args;
extern struct starpu_codelet mt_cl_embedding_update_early;
extern struct starpu_codelet mt_cl_embedding_backward_chunk;

#endif
