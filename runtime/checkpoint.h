/* Training checkpoints: everything needed to continue a run bit for bit (fp32 master weights,
 * AdamW m and v, the step, the data sampler's RNG state), in one file written atomically
 * (temporary file, fsync, rename): a crash while saving leaves the previous checkpoint intact. */
#ifndef MT_RUNTIME_CHECKPOINT_H
#define MT_RUNTIME_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

#include "runtime/state.h"

typedef struct mt_checkpoint_meta {
    int64_t step;          /* optimizer steps done */
    uint64_t rng_state;    /* the data sampler's generator after sampling `step` */
    uint64_t seed;         /* the run's seed, for the record */
} mt_checkpoint_meta;

/* Writes st (no task may be in flight) and meta to path. Returns 0 or -1 with err set. */
int mt_checkpoint_save(const char *path, const mt_host_state *st, const mt_checkpoint_meta *meta,
                       char *err, size_t errlen);

/* Reads a checkpoint into st (created from the same config; no task in flight) and meta, then
 * refreshes the streamed weights. Refuses a file of another model or a damaged one, naming the
 * file and what is wrong. */
int mt_checkpoint_load(const char *path, mt_host_state *st, mt_checkpoint_meta *meta, char *err, size_t errlen);

/* FNV-1a hash of every tile's fp32 master weights: a cheap fingerprint of a model's state. */
uint64_t mt_state_hash(const mt_host_state *st);

#endif
