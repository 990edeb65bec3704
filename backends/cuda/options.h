/* The CUDA backend's settings: chosen by whoever starts the backend (mt_runtime_options.cuda,
 * which the CLI fills from MT_ATTENTION and MT_ATTENTION_QBLOCK), handed to each thread's
 * context with mt_cuda_ctx_configure and read by the launchers from there. Plain C and no CUDA
 * types, so that builds without CUDA can carry them. Zero is the default of every field. */
#ifndef MT_BACKENDS_CUDA_OPTIONS_H
#define MT_BACKENDS_CUDA_OPTIONS_H

/* Which kernels the bf16 attention entry points run (names "auto", "cudnn", "own"). */
typedef enum mt_cuda_attention {
    MT_CUDA_ATTENTION_AUTO = 0, /* cuDNN's fused attention where the library loads and takes the
                                 * shape (head dims 64 and 128), the own kernels elsewhere */
    MT_CUDA_ATTENTION_CUDNN,    /* the same choice, asked for by name */
    MT_CUDA_ATTENTION_OWN,      /* the own kernels always: a bitwise reproducible backward */
} mt_cuda_attention;

/* The own kernels' query blocks (names "128w", "64", "128"). */
typedef enum mt_cuda_qblock {
    MT_CUDA_QBLOCK_128W = 0, /* forward: 128 rows, 4 warps of 32 (each K/V fragment a warp reads
                              * feeds four MMAs); dQ pass: as 64 */
    MT_CUDA_QBLOCK_64,       /* 64 rows, 4 warps of 16 */
    MT_CUDA_QBLOCK_128,      /* 128 rows, 8 warps of 16, forward and dQ pass */
} mt_cuda_qblock;

typedef struct mt_cuda_options {
    mt_cuda_attention attention;
    mt_cuda_qblock qblock;
} mt_cuda_options;

#endif
