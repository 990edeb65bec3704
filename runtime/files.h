/* The files a run writes (checkpoints, HF directories, metrics): the temporary name every atomic
 * write goes through, the removal of temporaries that dead processes left, a probe that a
 * directory takes new files, and the FNV-1a fingerprint the project records of its inputs. */
#ifndef MT_RUNTIME_FILES_H
#define MT_RUNTIME_FILES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "models/util.h"

/* FNV-1a 64 (mt_fnv1a64, models/util.h) of a whole file (what `prepare` records as tokenizer.fnv1a64). 0, or -1 with err
 * naming the file. */
int mt_file_fnv1a64(const char *path, uint64_t *hash, char *err, size_t errlen);

/* "PATH.tmp.PID": an atomic write of PATH goes through it, then fsync and rename. The pid lets a
 * later run tell a dead process's leftover from a live writer's file. */
void mt_temp_name(const char *path, char *buf, size_t len);

/* Removes the entries of dir whose names start with prefix ("" for any) and end in ".tmp.PID"
 * or ".cfg.PID" (mt_hf_save's config scratch) where PID is not a live process, nor this one.
 * Names each on log after log_prefix (log NULL: silent). Returns how many went. */
int mt_remove_stale_temporaries(const char *dir, const char *prefix, FILE *log, const char *log_prefix);

/* The same for the temporaries of the file `path`: in its directory, the names that start with
 * its base name. */
void mt_remove_stale_temporaries_of(const char *path, FILE *log, const char *log_prefix);

/* Whether dir exists, is a directory and takes a new file (created and removed again: the only
 * test that holds for root, read-only mounts and /proc alike). 0, or -1 with err naming dir and
 * the reason. */
int mt_probe_directory(const char *dir, char *err, size_t errlen);

/* Whether a file at path can be written before any work: its directory takes files and path is
 * not a directory (an existing file is fine). `what` names the option in messages ("--metrics").
 * 0, or -1 with err naming the option, the path and the fix. */
int mt_check_output_file(const char *path, const char *what, char *err, size_t errlen);

/* Whether a and b name the same existing file or directory (device and inode). */
bool mt_same_file(const char *a, const char *b);

/* The directory part of path ("." for a bare name), into buf. */
void mt_dir_of(const char *path, char *buf, size_t len);

/* fsync of a directory, so that the renames in it are durable; errors are ignored (some file
 * systems refuse to sync a directory, and the data itself was synced). */
void mt_sync_dir(const char *dir);

#endif
