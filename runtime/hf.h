/* HF model directories in and out: config.json plus model.safetensors, or shards listed by
 * model.safetensors.index.json. Loading streams each tensor into its place in the host tiles;
 * saving streams the fp32 masters out, converted to the requested dtype. */
#ifndef MT_RUNTIME_HF_H
#define MT_RUNTIME_HF_H

#include <stddef.h>
#include <stdint.h>

#include "models/dtype.h"
#include "models/safetensors.h"
#include "runtime/state.h"

/* HF's default shard limit (save_pretrained's max_shard_size "5GB"). */
#define MT_HF_DEFAULT_SHARD_BYTES ((uint64_t)5000000000)

/* Loads the weights of the HF directory `dir` into the fp32 masters of `st`, then refreshes the
 * streamed copy (mt_state_sync_weights). `st` was created from dir/config.json. Reads
 * model.safetensors if present (as transformers does), else model.safetensors.index.json and its
 * shards; F32, F16 or BF16 on disk. Every tensor the layout has must be there with its HF shape;
 * an unknown extra tensor is an error, except rotary "inv_freq" buffers and, for tied
 * embeddings, lm_head.weight (the embedding table serves). Returns 0, or -1 with a message that
 * names the file and the tensor ("DIR/model.safetensors: tensor 'NAME': ..."); after an error the
 * masters may hold part of the checkpoint. */
int mt_hf_load(const char *dir, mt_host_state *st, char *err, size_t errlen);

/* Writes st's fp32 masters as an HF directory that transformers' from_pretrained loads:
 * config.json (torch_dtype set to the saved dtype), and model.safetensors when everything fits in
 * max_shard_bytes (0 = no limit), else model-0000K-of-0000N.safetensors shards, filled greedily
 * in HF order like save_pretrained, plus model.safetensors.index.json. Creates dir if missing;
 * writes MT_HF_MARKER first (so that even a save cut short is known as megatrain's output, which
 * a later save may replace: mt_hf_check_output); every file goes through a temporary + fsync +
 * rename; a previous save's files of the other layout (single file vs shards) are removed.
 * Returns 0, or -1 with err set. */
int mt_hf_save(const char *dir, const mt_host_state *st, mt_dtype dtype, uint64_t max_shard_bytes,
               char *err, size_t errlen);

/* The file that marks a directory as megatrain's output. */
#define MT_HF_MARKER "megatrain.json"

/* Whether `dir` may receive mt_hf_save's output, checked before any work: not an existing file,
 * absent or empty or a previous megatrain output (MT_HF_MARKER, and only the files megatrain
 * writes: weights, index, config, tokenizer files, temporaries), and its directory (or itself)
 * takes new files. 0, or -1 with err naming the directory, the problem and the fix. */
int mt_hf_check_output(const char *dir, char *err, size_t errlen);

/* Copies the tokenizer files of an HF directory (tokenizer.json, tokenizer_config.json,
 * special_tokens_map.json, generation_config.json, chat templates, vocabularies) that exist in
 * `from` into `to`, each atomically, so that `to` is a complete HF directory. Nothing when they
 * are the same directory. *copied (may be NULL) gets how many. 0, or -1 with err set. */
int mt_hf_copy_tokenizer(const char *from, const char *to, int *copied, char *err, size_t errlen);

/* Adds to dir/config.json (mt_hf_save's) the keys of base_dir/config.json that it lacks: what the
 * base model's config says and megatrain does not model (bos and eos token ids, sliding-window
 * settings, keys of later transformers versions), so that the saved directory keeps them. The keys
 * megatrain wrote win; the base's dtype and transformers_version are not taken. Nothing when
 * they are the same directory. *kept (may be NULL) gets how many keys were added. 0, or -1 with
 * err naming the file. */
int mt_hf_keep_base_config(const char *base_dir, const char *dir, int *kept, char *err, size_t errlen);

/* The dtype most of the weights of HF directory `dir` are stored in (F32, F16 or BF16; of
 * model.safetensors, else of the index's first shard). 0, or -1 with err set. */
int mt_hf_weights_dtype(const char *dir, mt_st_dtype *dtype, char *err, size_t errlen);

#endif
