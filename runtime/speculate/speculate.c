/* Clip speculation's state and its choices (speculate.h): the buffers, the mode of a step, the
 * norm task with its record, the known sums, the kept records. */
#include "runtime/speculate/speculate.h"

#include <math.h>
#include <stdlib.h>

#include "codelets/clip.h"
#include "runtime/plan.h"
#include "runtime/speculate/history.h"

_Static_assert(MT_CLIP_RANGE_MEMORY_MAX == MT_NORM_MEMORY_MAX, "step.h and history.h disagree");

static starpu_data_handle_t host_vector(void *p, int64_t n, size_t esz)
{
    starpu_data_handle_t h;
    starpu_vector_data_register(&h, STARPU_MAIN_RAM, (uintptr_t)p, (uint32_t)n, esz);
    return h;
}

/* A buffer of at least `bytes` with no home (StarPU allocates it where the task runs), counted in
 * floats as the graph's other work buffers. */
static starpu_data_handle_t new_bytes(size_t bytes)
{
    starpu_data_handle_t h;
    starpu_vector_data_register(&h, -1, 0, (uint32_t)((bytes + sizeof(float) - 1) / sizeof(float)), sizeof(float));
    return h;
}

/* Whether the second gradient deferral adds may be had: at most 80% of the host memory
 * available now. */
static bool fits_host(uint64_t bytes) { return bytes <= mt_host_memory_available() / 10 * 8; }

int mt_speculation_init(mt_speculation *s, mt_host_state *st, const mt_step_config *sc, bool gpu, char *err,
                        size_t errlen)
{
    /* the compact layout's streamed weights are its master's high half: nothing runs ahead of the
     * norm (auto resolves to off; graph.c refused the rest) */
    const bool compact = st->layout == MT_LAYOUT_COMPACT;
    *s = (mt_speculation){
        .clip = sc->clip, .option = compact ? 0 : sc->clip_speculate, .defer_option = sc->adamw_defer,
        .max_ratio = sc->clip_range_max > 1 ? sc->clip_range_max : MT_CLIP_RANGE_MAX_DEFAULT,
        .check = sc->clip_range_check != 0,
        .side_room = sc->ranged_side_room > 0 ? sc->ranged_side_room : MT_RANGED_SIDE_ROOM_DEFAULT,
        .bounds = sc->ranged_bounds,
    };
    /* Ranged speculation needs bf16 weights; auto asks for it where a GPU computes. Deferred
     * moments halves need a second gradient for every tile, the table's included (its moments
     * half goes into its early path); auto: when it takes at most 80% of the memory available. */
    s->ranged = !compact && sc->clip > 0 && st->compute_dtype == MT_DTYPE_BF16 &&
                (sc->clip_speculate == 2 || (sc->clip_speculate < 0 && gpu));
    s->defer = s->ranged && (sc->adamw_defer > 0 || (sc->adamw_defer < 0 && fits_host(mt_state_grad_alt_bytes(st, 0))));
    if (s->defer && mt_state_enable_grad_alt(st, 0, err, errlen)) return -1;
    s->settings = (mt_norm_settings){
        .spread = sc->clip_range > 1 ? sc->clip_range : MT_CLIP_SPREAD_DEFAULT,
        .grow = sc->clip_range_grow > 0 ? sc->clip_range_grow : MT_CLIP_RANGE_GROW_DEFAULT,
        .memory = sc->clip_range_memory > 0 ? sc->clip_range_memory : MT_CLIP_RANGE_MEMORY_DEFAULT,
    };
    return 0;
}

void mt_speculation_register(mt_speculation *s, const mt_host_state *st)
{
    if (s->ranged) {
        /* One bit per parameter and room for side entries, per AdamW chunk: 1.375 bytes per
         * parameter, read and written by CPU tasks only. Their home is plain host memory, so that
         * StarPU's RAM node (hwloc's reading of the machine's memory, a few GiB on some machines
         * whatever the host has: runtime/step/graph.c, alloc_homes) need not hold them; where
         * that memory is refused, StarPU allocates the chunk's itself. */
        s->flags = calloc(st->ntiles, sizeof *s->flags);
        s->flags_mem = calloc(st->ntiles, sizeof *s->flags_mem);
        for (int i = 0; i < st->ntiles; i++) {
            const mt_tile *t = &st->tiles[i];
            s->flags[i] = calloc(t->nchunks, sizeof **s->flags);
            s->flags_mem[i] = calloc(t->nchunks, sizeof **s->flags_mem);
            for (int c = 0; c < t->nchunks; c++) {
                const size_t bytes = mt_ranged_flags_bytes(t->chunks[c].numel, s->side_room);
                const int64_t n = (int64_t)((bytes + sizeof(float) - 1) / sizeof(float));
                s->flags_mem[i][c] = calloc((size_t)n, sizeof(float));
                s->flags[i][c] = s->flags_mem[i][c] ? host_vector(s->flags_mem[i][c], n, sizeof(float)) : new_bytes(bytes);
            }
        }
        if (st->cfg.tied) s->head_table = host_vector(&s->head_table_mem, 1, sizeof(double));
        s->known_mem = calloc(st->ntiles, sizeof *s->known_mem);
        s->known = calloc(st->ntiles, sizeof *s->known);
        for (int i = 0; i < st->ntiles; i++) s->known[i] = host_vector(s->known_mem[i], 2, sizeof(double));
    }
    if (s->clip > 0) {
        const size_t bytes = mt_norm_record_bytes(st->ntiles);
        for (int k = 0; k < 2; k++) {
            s->record_mem[k] = malloc(bytes);
            mt_norm_record_init(s->record_mem[k], st->ntiles, &s->settings);
            s->record[k] = host_vector(s->record_mem[k], (int64_t)bytes, 1);
        }
    }
}

void mt_speculation_destroy(mt_speculation *s, const mt_host_state *st)
{
    for (int i = 0; s->flags && i < st->ntiles; i++) {
        for (int c = 0; c < st->tiles[i].nchunks; c++) {
            starpu_data_unregister_no_coherency(s->flags[i][c]);
            free(s->flags_mem[i][c]);
        }
        free(s->flags[i]);
        free(s->flags_mem[i]);
    }
    free(s->flags);
    free(s->flags_mem);
    if (s->head_table) starpu_data_unregister(s->head_table);
    for (int i = 0; s->known && i < st->ntiles; i++) starpu_data_unregister(s->known[i]);
    free(s->known);
    free(s->known_mem);
    for (int k = 0; k < 2; k++)
        if (s->record[k]) {
            starpu_data_unregister(s->record[k]);
            free(s->record_mem[k]);
        }
    if (s->log) starpu_data_unregister(s->log);
    free(s->log_mem);
}

mt_speculation_choice mt_speculation_choose(const mt_speculation *s)
{
    if (s->clip <= 0 || s->option == 0) return (mt_speculation_choice){ MT_SPECULATION_NONE, 0, 0 };
    if (s->option == 1 || s->last_scale == 1.0) return (mt_speculation_choice){ MT_SPECULATION_UNIT, 1.0, 1.0 };
    if ((s->option == 2 || s->option < 0) && s->flags) {
        if (s->last_scale <= 0) return (mt_speculation_choice){ MT_SPECULATION_RANGED, 0, 1.0 };
        return (mt_speculation_choice){ MT_SPECULATION_RANGED, s->last_scale / 1.25, fmin(1.0, s->last_scale * 1.25) };
    }
    return (mt_speculation_choice){ MT_SPECULATION_NONE, 0, 0 };
}

bool mt_speculation_early_table(mt_speculation_choice sp) { return sp.mode != MT_SPECULATION_NONE; }

void mt_speculation_scale_read(mt_speculation *s, double scale, bool speculated)
{
    s->last_scale = scale;
    if (!speculated) return;
    /* held: the scale was 1, what a unit speculation assumed (a ranged one's chunks count their
     * own: mt_adamw_stats) */
    s->speculated++;
    s->held += (float)scale == 1.0f;
}

mt_ranged_args mt_speculation_ranged_args(const mt_speculation *s, int first_tile, mt_speculation_choice sp,
                                          int64_t seq)
{
    return (mt_ranged_args){
        .range = mt_norm_range, .seq = seq, .first_tile = first_tile, .head_table = s->head_table != NULL,
        .check = s->check, .clip = s->clip, .max_ratio = s->max_ratio, .lo = sp.lo, .hi = sp.hi,
        .side_room = s->side_room, .bounds = s->bounds,
    };
}

starpu_data_handle_t mt_speculation_last_record(const mt_speculation *s, int64_t seq)
{
    return s->record[(seq - 1) % 2];
}

void mt_speculation_insert_known(const mt_speculation *s, const mt_host_state *st, const starpu_data_handle_t *partials,
                                 int i)
{
    if (!s->known) return;
    const int head_tile = st->ntiles - 1;
    int from_head = i == head_tile, n = 0;
    struct starpu_data_descr d[3];
    d[n++] = (struct starpu_data_descr){ partials[i], STARPU_R };
    if (!from_head) d[n++] = (struct starpu_data_descr){ s->known[i + 1], STARPU_R };
    else if (s->head_table) d[n++] = (struct starpu_data_descr){ s->head_table, STARPU_R };
    d[n++] = (struct starpu_data_descr){ s->known[i], STARPU_W };
    mt_step_check_insert(starpu_task_insert(&mt_cl_known, STARPU_DATA_MODE_ARRAY, d, n, STARPU_VALUE, &from_head,
                                            sizeof from_head, STARPU_EXECUTE_WHERE, STARPU_CPU, STARPU_PRIORITY,
                                            STARPU_MAX_PRIO, STARPU_NAME, "known", 0),
                         "known");
}

int64_t mt_speculation_insert_norm(mt_speculation *s, const mt_host_state *st, const starpu_data_handle_t *partials,
                                   starpu_data_handle_t clip)
{
    const int64_t seq = ++s->norm_seq;
    /* The partial sums were left by each tile's last backward task of the step; the table's head
     * part and the record of the last norm are read, this norm's record written, for the next
     * step's ranged runs. */
    struct starpu_data_descr *cd = calloc(st->ntiles + 5, sizeof *cd);
    int n = 0;
    for (int i = 0; i < st->ntiles; i++) cd[n++] = (struct starpu_data_descr){ partials[i], STARPU_R };
    cd[n++] = (struct starpu_data_descr){ clip, STARPU_W };
    if (s->head_table) cd[n++] = (struct starpu_data_descr){ s->head_table, STARPU_R };
    cd[n++] = (struct starpu_data_descr){ s->record[(seq - 1) % 2], STARPU_R };
    cd[n++] = (struct starpu_data_descr){ s->record[seq % 2], STARPU_W };
    if (s->log) cd[n++] = (struct starpu_data_descr){ s->log, STARPU_RW };
    const mt_clip_args a = { .max_norm = s->clip, .ntiles = st->ntiles, .head_table = s->head_table != NULL,
                             .record = mt_norm_record, .seq = seq, .log = s->log != NULL };
    mt_step_check_insert(starpu_task_insert(&mt_cl_clip, STARPU_DATA_MODE_ARRAY, cd, n, STARPU_VALUE, &a, sizeof a,
                                            STARPU_NAME, "clip", STARPU_EXECUTE_WHERE, STARPU_CPU, STARPU_PRIORITY,
                                            STARPU_MAX_PRIO, 0),
                         "clip");
    free(cd);
    return seq;
}

int mt_speculation_keep_norms(mt_speculation *s, const mt_host_state *st, int64_t max_norms)
{
    starpu_task_wait_for_all(); /* no clip task writes the log while it moves */
    if (s->log) starpu_data_unregister(s->log);
    free(s->log_mem);
    s->log = NULL;
    s->log_mem = NULL;
    s->log_cap = 0;
    s->log_from = s->norm_seq;
    if (max_norms <= 0 || s->clip <= 0) return 0;
    const size_t bytes = mt_norm_log_bytes(st->ntiles, max_norms);
    if (!(s->log_mem = malloc(bytes))) return -1;
    mt_norm_log_init(s->log_mem, st->ntiles, s->log_from, max_norms);
    s->log = host_vector(s->log_mem, (int64_t)bytes, 1);
    s->log_cap = max_norms;
    return 0;
}

const double *mt_speculation_kept_norms(const mt_speculation *s, const mt_host_state *st, int64_t *count, int *width)
{
    *width = st->ntiles + 1;
    const int64_t n = s->norm_seq - s->log_from;
    *count = s->log ? (n < s->log_cap ? n : s->log_cap) : 0;
    if (!s->log) return NULL;
    /* the clip tasks that wrote it have ended (the caller waited for them); the acquisition
     * says so to StarPU, which then holds no copy elsewhere */
    starpu_data_acquire(s->log, STARPU_R);
    starpu_data_release(s->log);
    return mt_norm_log_rows(s->log_mem);
}

void mt_speculation_log_defer(const mt_speculation *s, const mt_host_state *st, FILE *log, const char *prefix)
{
    if (st->layout == MT_LAYOUT_COMPACT) {
        if (s->clip > 0)
            fprintf(log, "%s: compact host layout: no clip speculation or AdamW deferral (they need the full layout); "
                         "each layer's clipped update waits for the norm and overlaps the next step's forward\n", prefix);
        return;
    }
    const double gb = (double)mt_state_grad_alt_bytes(st, 0) / 1e9;
    if (s->defer_option > 0 && !s->defer)
        fprintf(log, "%s: --adamw-defer on has no effect here: it needs ranged clip speculation (bf16 weights, clipping, "
                     "and --clip-speculate ranged, or auto with a GPU)\n", prefix);
    if (s->defer_option < 0 && s->flags && !s->defer) /* ranged, but auto declined (fits_host) */
        fprintf(log, "%s: AdamW moments halves not deferred (--adamw-defer auto): a second gradient (%.2f GB) would "
                     "take over 80%% of the host memory available\n", prefix, gb);
    if (s->defer)
        fprintf(log, "%s: AdamW moments halves deferred to the next step's ranged runs (--adamw-defer): %.2f GB more "
                     "%shost memory for a second gradient\n", prefix, gb, st->pinned ? "pinned " : "");
}
