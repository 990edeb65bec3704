/* What the codelets of a training step share: the description of the model they compute, the
 * arguments of the compute codelets, the buffer sizes their implementations need, and the
 * binding of a dtype to the CUDA backend's precision. Every codelet has a CPU implementation, so
 * a run without a GPU executes the same graph; kernel contracts are in backends/cpu/ops.h and
 * backends/cuda/kernels.h. */
#ifndef MT_CODELETS_COMMON_H
#define MT_CODELETS_COMMON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "codelets/mt_starpu.h"

#include "backends/cpu/ops.h"
#include "models/config.h"
#include "models/dtype.h"
#include "models/layout.h"

#include "mt_build_config.h"
#if MT_HAVE_CUDA
#include "backends/cuda/kernels.h"

/* The CUDA backend's precision for a dtype of the streamed weights: bf16 weights compute on the
 * tensor cores, fp32 weights compute in fp32 throughout. */
static inline mt_cuda_prec mt_codelet_cuda_prec(mt_dtype weights)
{
    return weights == MT_DTYPE_F32 ? MT_CUDA_F32 : MT_CUDA_BF16;
}
#endif

/* The model a graph's tasks compute: its config, the layouts of its kinds of tile (a model with
 * dense and sparse layers has two layer layouts: mt_host_state's), the dtype of the streamed
 * weights, and the table's AdamW chunks (as boundaries: chunk c is elements
 * [table_chunks[c], table_chunks[c + 1]) of the table), which the table's sum of squares follows.
 * Built by the graph and never changed while tasks run: they get a pointer to it. */
typedef struct mt_codelet_model {
    mt_model_config cfg;
    mt_dtype dtype;
    mt_tile_layout layout_embed, layout_layer, layout_head, layout_dense_layer;
    int table_nchunks;
    const int64_t *table_chunks;  /* table_nchunks + 1 */
} mt_codelet_model;

/* Arguments shared by the compute codelets (passed by value). */
typedef struct mt_compute_args {
    const mt_codelet_model *model;
    int64_t B, T;            /* sequences and tokens per sequence of this micro-batch */
    bool save;               /* layer forward: also write the saved activations */
    bool accumulate;         /* backward: add into the gradient (RW) instead of overwriting (W) */
    double loss_scale;       /* head: d(step loss)/d(per-token loss), 1 / counted tokens of the step */
    int64_t head_chunk;      /* head: rows per chunk */
    bool sumsq;              /* backward/head: a last buffer (1 double, W) receives the sum of
                              * squares of the gradient tile just written (for clipping) */
    bool table_sumsq;        /* head, tied, with sumsq: one more buffer after it (1 double, W)
                              * receives that of the table's gradient as the head leaves it (what
                              * ranged speculation predicts from: mt_ranged_args) */
    int64_t layer;           /* layer tasks: the decoder layer (0-based), which picks its layout */
    bool router_stats;       /* layer tasks of a sparse layer, with the load-balancing loss: a last
                              * buffer holds the micro-batch's router statistics (2E doubles,
                              * mt_moe_aux_loss): the forward adds to them (RW), the backward reads
                              * their counts (R) */
    double aux_scale;        /* layer backward with router_stats: mt_moe_aux_grad_scale */
} mt_compute_args;

/* The layout of decoder layer `layer`'s tile. */
static inline const mt_tile_layout *mt_codelet_layer_layout(const mt_codelet_model *model, int64_t layer)
{
    return model->layout_dense_layer.numel > 0 && !mt_config_layer_is_sparse(&model->cfg, layer)
               ? &model->layout_dense_layer : &model->layout_layer;
}

/* Bytes of the buffers a codelet needs on the kind of worker that runs it (gpu: the CUDA op's,
 * which keeps activations of the weights' dtype; else the CPU op's own fp32 scratch plus, for
 * bf16 weights, an fp32 copy of the tile). A graph's compute runs on one kind only, so its
 * buffers are sized for that kind; the memory plan (runtime/plan.c) counts the same numbers.
 * Without CUDA in the build, gpu is ignored. */
size_t mt_codelet_layer_scratch_bytes(const mt_model_config *cfg, mt_dtype weights, bool gpu, int64_t B, int64_t T);
size_t mt_codelet_head_scratch_bytes(const mt_model_config *cfg, mt_dtype weights, bool gpu, int64_t chunk);
size_t mt_codelet_layer_saved_bytes(const mt_model_config *cfg, mt_dtype weights, bool gpu, int64_t B, int64_t T);

/* Writes the sum of squares of a gradient tile into the task's sumsq buffer (CPU). */
void mt_codelet_sumsq_cpu(void *grad_buffer, void *sumsq_buffer);

/* fp32 view of the streamed weights of a tile of `layout` inside a CPU task: the buffer itself for
 * fp32, or for bf16 its conversion into tmp (numel floats), the norms it keeps in fp32 copied. */
const float *mt_codelet_weights_f32(const mt_codelet_model *model, const mt_tile_layout *layout, void *buffer,
                                    float *tmp);

#endif
