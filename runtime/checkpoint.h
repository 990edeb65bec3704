/* Training checkpoints: everything needed to continue a run bit for bit (fp32 master weights,
 * AdamW m and v, the step, the data sampler's RNG state) and the settings the run's trajectory
 * depends on, in one file written atomically (temporary file, fsync, rename): a crash while
 * saving leaves the previous checkpoint intact. */
#ifndef MT_RUNTIME_CHECKPOINT_H
#define MT_RUNTIME_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

#include "models/config.h"
#include "runtime/state.h"

#define MT_CHECKPOINT_VERSION 3
#define MT_CHECKPOINT_SETTINGS_MAX 8192

typedef struct mt_checkpoint_meta {
    int64_t step;          /* optimizer steps done */
    uint64_t rng_state;    /* the data sampler's generator after sampling `step` */
    uint64_t seed;         /* the run's seed, for the record */
    int64_t updates;       /* AdamW updates applied: step less the steps skipped (--on-nonfinite
                            * skip); the next update's bias correction counts from it */
    uint32_t version;      /* the file's format version (set by the readers) */
    /* the shard the file holds (set by the readers; 1 and 0 before version 3): a run over
     * shard_ranks ranks writes one file per rank, each with the master and moments of its tiles
     * (runtime/state.h; mt_checkpoint_shard_name) */
    uint32_t shard_ranks, shard_rank;
    /* "name=value\n" lines: the settings the trajectory depends on (train_checks.h); empty in a
     * version 1 file, which did not record them */
    char settings[MT_CHECKPOINT_SETTINGS_MAX];
} mt_checkpoint_meta;

/* Writes st (no task may be in flight) and meta to path, through mt_temp_name(path). Returns 0
 * or -1 with err set (the previous file at path untouched). */
int mt_checkpoint_save(const char *path, const mt_host_state *st, const mt_checkpoint_meta *meta,
                       char *err, size_t errlen);

/* As mt_checkpoint_save, keeping the last keep_last checkpoints: 0 writes path itself; else the
 * checkpoint goes to "path.STEP" (STEP zero-padded to 6 digits), path becomes a symbolic link to
 * it (replaced atomically), and the numbered files of earlier steps beyond the keep_last most
 * recent are removed (those of later steps, from a run resumed from an older file, are left).
 * written (len bytes) gets the name of the file written. */
int mt_checkpoint_save_kept(const char *path, int64_t keep_last, const mt_host_state *st, const mt_checkpoint_meta *meta,
                            char *written, size_t len, char *err, size_t errlen);

/* A run over several ranks (a sharded state) writes one file per rank: rank 0's is the checkpoint
 * itself (path, or its numbered file), rank r > 0's "BASE.shardRofN.STEP" (STEP zero-padded to 6
 * digits) beside it, BASE being --checkpoint's path. mt_checkpoint_shard_name gives that name;
 * mt_checkpoint_base_of the BASE of a checkpoint file of step `step` (path less a ".STEP" suffix
 * equal to step, as mt_checkpoint_save_kept numbers them; else path itself);
 * mt_checkpoint_prune_shards removes rank's shards of BASE of steps below `step` but the keep - 1
 * most recent (keep below 1: as 1), those of later steps left. */
void mt_checkpoint_shard_name(const char *base, int rank, int ranks, int64_t step, char *out, size_t len);
void mt_checkpoint_base_of(const char *path, int64_t step, char *out, size_t len);
void mt_checkpoint_prune_shards(const char *base, int rank, int ranks, int64_t step, int64_t keep);

/* Reads only the header: magic, version, the model's shape (checked against cfg, every
 * difference named with both values) and meta, settings included. Cheap: no tile is read. */
int mt_checkpoint_read_header(const char *path, const mt_model_config *cfg, mt_checkpoint_meta *meta, char *err,
                              size_t errlen);

/* Reads a checkpoint into st (created from the same config; no task in flight) and meta, then
 * refreshes the streamed weights. Refuses a file of another model or a damaged one, naming the
 * file and what is wrong. Reads version 1 files (no settings, updates = step) and version 2. */
int mt_checkpoint_load(const char *path, mt_host_state *st, mt_checkpoint_meta *meta, char *err, size_t errlen);

/* FNV-1a hash of every tile's fp32 master weights: a cheap fingerprint of a model's state. */
uint64_t mt_state_hash(const mt_host_state *st);

#endif
