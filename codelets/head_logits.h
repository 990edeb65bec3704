/* The logits of selected rows as a StarPU codelet: final norm + LM head over the rows of the
 * last hidden state whose next token generation samples (one per sequence), so that only
 * nrows x V logits are computed and come back to the host. Arguments: mt_compute_args
 * (codelets/common.h; model only). */
#ifndef MT_CODELETS_HEAD_LOGITS_H
#define MT_CODELETS_HEAD_LOGITS_H

#include "codelets/common.h"

/* head_logits: [0] head weights R, [1] h_L (ntok, d) fp32 R, [2] rows (nrows) int32 R: indices
 *   into h_L's rows, [3] logits (nrows, V) fp32 W, [4] scratch SCRATCH
 *   (mt_codelet_head_logits_scratch_bytes), [5] embed weights R when tied */
extern struct starpu_codelet mt_cl_head_logits;

/* Bytes of head_logits' scratch for nrows rows on the kind of worker that runs it (as
 * mt_codelet_head_scratch_bytes). */
size_t mt_codelet_head_logits_scratch_bytes(const mt_model_config *cfg, mt_dtype weights, bool gpu, int64_t nrows);

#endif
