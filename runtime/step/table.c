/* The table's early update path (runtime/step/graph.h): its update started before its embedding
 * backward, so that the next forward waits for the rows the step's tokens touch only. */
#include "runtime/step/graph.h"

#include <stdlib.h>

#include "codelets/clip.h"
#include "codelets/embedding.h"
#include "codelets/fill.h"
#include "runtime/policy.h"

/* The table's update, started before its embedding backward. The tied head wrote the table's
 * gradient at the start of the backward (untied: it is zero before the embedding backward), and
 * that is the whole gradient of every row no token of the step touches: so the weights half
 * runs on each chunk then, during the backward, and the embedding backward, on the CPU per chunk
 * once dh0 is in, adds the tokens' rows and redoes the weights half of those rows only. The next
 * forward then waits for the touched rows instead of the whole table. Bitwise the same weights
 * and gradient as the plain path; the sum of squares for clipping too (per row, in the order of
 * backends/cpu/table_sumsq.h: the head's rows summed during the backward, only the touched ones
 * again at its end). Ranged: the chunks' ranges come from the head tile's known buffer, in by
 * then; with moments pending (deferred), the table's run in its early ranged runs, as the
 * update's do for the other tiles. */
void mt_step_submit_table_early(mt_graph *g, int slot_id, int64_t step, double lr, mt_speculation_choice sp)
{
    mt_host_state *st = g->st;
    mt_tile *t = mt_state_embed(st);
    mt_step_slot *sl = &g->slots[slot_id];
    const int M = g->sc.accum, clipped = g->sc.clip > 0;
    const bool take_over = mt_speculation_take_over(&g->speculation, &g->update, sp);
    mt_policy_tile_submitting(MT_SCHED_CTX_INITIAL, 0, true);
    starpu_data_partition_submit(t->h_weights, t->nchunks, t->h_weights_chunk);
    starpu_data_partition_submit(t->h_grad, t->nchunks, t->h_grad_chunk);
    const int nbuf = 1 + 2 * M + 4 + 2 * clipped + 1;
    struct starpu_data_descr *d = calloc(nbuf, sizeof *d);
    for (int c = 0; c < t->nchunks; c++) {
        mt_adamw_params p = mt_step_adamw_params(&g->sc, &t->chunks[c], step, lr);
        if (!st->cfg.tied) {
            float zero = 0.0f;
            mt_step_check_insert(starpu_task_insert(&mt_cl_fill, STARPU_W, t->h_grad_chunk[c], STARPU_VALUE, &zero, sizeof zero,
                                            STARPU_EXECUTE_WHERE, STARPU_CPU, STARPU_PRIORITY, STARPU_MAX_PRIO, 0),
                         "fill");
        }
        mt_embed_chunk_args a = { .offset = t->chunks[c].offset, .d = st->cfg.hidden, .ntok = g->ntok,
                                  .micro_batches = M, .sumsq = clipped, .p = p, .dtype = st->compute_dtype,
                                  .ranged = sp.mode == MT_SPECULATION_RANGED, .stats = &g->stats };
        /* the step's norm is the next one: not submitted yet */
        if (a.ranged)
            a.ra = mt_speculation_ranged_args(&g->speculation, st->ntiles - 1, sp, g->speculation.norm_seq + 1);
        a.deferred = take_over;
        if (take_over) a.po = mt_speculation_pending_params(&g->speculation, &g->update, t, c);
        const enum starpu_data_access_mode state = take_over ? STARPU_RW : STARPU_R;
        struct starpu_data_descr ud[11] = {
            { t->h_master_chunk[c], state }, { t->h_m_chunk[c], state }, { t->h_v_chunk[c], state },
            { t->h_grad_chunk[c], STARPU_R }, { t->h_weights_chunk[c], STARPU_W }, { g->embed_rows[c], STARPU_W },
            { a.ranged ? g->speculation.flags[0][c] : NULL, STARPU_W },
            { a.ranged ? g->speculation.known[st->ntiles - 1] : NULL, STARPU_R },
            { a.ranged ? mt_speculation_last_record(&g->speculation, a.ra.seq) : NULL, STARPU_R },
            { take_over ? t->h_grad_alt_chunk[c] : NULL, STARPU_R }, { g->speculation.pend.clip, STARPU_R },
        };
        mt_step_check_insert(starpu_task_insert(&mt_cl_embedding_update_early, STARPU_DATA_MODE_ARRAY, ud,
                                        take_over ? 11 : a.ranged ? 9 : 6,
                                        STARPU_VALUE, &a, sizeof a, STARPU_EXECUTE_WHERE, STARPU_CPU,
                                        STARPU_PRIORITY, STARPU_MAX_PRIO, 0),
                     "embedding_update_early");
        int k = 0;
        d[k++] = (struct starpu_data_descr){ t->h_grad_chunk[c], STARPU_RW };
        for (int u = 0; u < M; u++) {
            d[k++] = (struct starpu_data_descr){ sl->h_tokens[u], STARPU_R };
            d[k++] = (struct starpu_data_descr){ g->grad[u][0], STARPU_R };
        }
        d[k++] = (struct starpu_data_descr){ t->h_master_chunk[c], STARPU_R };
        d[k++] = (struct starpu_data_descr){ t->h_m_chunk[c], STARPU_R };
        d[k++] = (struct starpu_data_descr){ t->h_v_chunk[c], STARPU_R };
        d[k++] = (struct starpu_data_descr){ t->h_weights_chunk[c], STARPU_RW };
        if (clipped) {
            d[k++] = (struct starpu_data_descr){ g->embed_rows[c], STARPU_RW };
            d[k++] = (struct starpu_data_descr){ g->embed_partial[c], STARPU_W };
        }
        if (a.ranged) d[k++] = (struct starpu_data_descr){ g->speculation.flags[0][c], STARPU_RW };
        mt_step_check_insert(starpu_task_insert(&mt_cl_embedding_backward_chunk, STARPU_DATA_MODE_ARRAY, d, k,
                                        STARPU_VALUE, &a, sizeof a, STARPU_EXECUTE_WHERE, STARPU_CPU,
                                        STARPU_PRIORITY, STARPU_MAX_PRIO, STARPU_NAME, "embedding_backward_chunk",
                                        MT_OBSERVE_END(&g->observer, !clipped, MT_EV_ADAMW, step, 0), 0),
                     "embedding_backward_chunk");
    }
    free(d);
    if (take_over) starpu_data_unpartition_submit(t->h_grad_alt, t->nchunks, t->h_grad_alt_chunk, STARPU_MAIN_RAM);
    if (clipped) {
        struct starpu_data_descr *pd = calloc(t->nchunks + 1, sizeof *pd);
        for (int c = 0; c < t->nchunks; c++) pd[c] = (struct starpu_data_descr){ g->embed_partial[c], STARPU_R };
        pd[t->nchunks] = (struct starpu_data_descr){ g->partial[0], STARPU_W };
        mt_step_check_insert(starpu_task_insert(&mt_cl_sum_partials, STARPU_DATA_MODE_ARRAY, pd, t->nchunks + 1,
                                        STARPU_EXECUTE_WHERE, STARPU_CPU, STARPU_PRIORITY, STARPU_MAX_PRIO,
                                        STARPU_NAME, "sum_partials", 0),
                     "sum_partials");
        free(pd);
    }
    for (int u = 0; u < M; u++) mt_step_drop(g->grad[u][0]);
}

