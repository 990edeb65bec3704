/* The memory plan: byte counts of two shapes checked against arithmetic written out by hand, the
 * host check refusing what does not fit (7B and 14B against a 125 GiB box) with a message that
 * names the bytes, and parameter validation; the compact layout's bytes (14.0 per parameter all
 * in), the choice of a layout, and the table of what fits; the process's rows, the data's bytes, the
 * workers StarPU would start and the resident set. The GPU side and the choice of K:
 * test_plan_choice.c. */
#include <check.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backends/cpu/ops.h"
#include "codelets/codelets.h"
#include "mt_build_config.h"
#include "models/config.h"
#include "runtime/plan.h"
#include "tests/testutil.h"

#define GiB ((uint64_t)1 << 30)

/* tiny (models/configs/tiny-byte.json), CPU only, fp32, B=2, T=16, K=2, accumulation 3. */
START_TEST(test_tiny_cpu)
{
    mt_model_config c;
    ck_assert_int_eq(mt_config_from_shape("tiny", &c), 0);
    mt_plan_params p = {.micro_batch = 2, .seq_len = 16, .grad_accum = 3, .checkpoint_interval = 2,
                        .compute = MT_DTYPE_F32, .use_gpu = false};
    mt_plan plan;
    ck_assert_msg(mt_plan_compute(&c, &p, &plan) == 0, "%s", plan.error);

    /* Tiles (d=192, I=512, H=6, KV=2, D=32, V=256, q/k/v bias, tied), every tensor a multiple of 64:
     * layer = 2*192 norms + 2*192*192 q,o + 2*64*192 k,v + (192+64+64) biases + 3*512*192 MLP
     *       = 384 + 73728 + 24576 + 320 + 294912 = 393920
     * embed = 256*192 = 49152; head = final norm only (tied) = 192. */
    ck_assert_int_eq(plan.tile_numel[MT_TILE_EMBED], 49152);
    ck_assert_int_eq(plan.tile_numel[MT_TILE_LAYER], 393920);
    ck_assert_int_eq(plan.tile_numel[MT_TILE_HEAD], 192);
    ck_assert_int_eq(plan.num_tiles, 8);
    ck_assert_int_eq(plan.tokens_per_step, 96);
    ck_assert_int_eq(plan.param_count, 49152 + 6 * 393920 + 192);
    ck_assert_int_eq(plan.params.head_chunk, 32);

    /* fp32 per kind: embed 196608 B (48 pages), layer 1575680 B -> 385 pages = 1576960,
     * head 768 B -> 4096. 196608 + 6*1576960 + 4096 = 9662464. Streamed copy is fp32 too. */
    const uint64_t kind = 9662464;
    ck_assert_uint_eq(plan.host[MT_PLAN_WEIGHTS], kind);
    ck_assert_uint_eq(plan.host[MT_PLAN_MASTER], kind);
    ck_assert_uint_eq(plan.host[MT_PLAN_GRADS], kind);
    ck_assert_uint_eq(plan.host[MT_PLAN_ADAM_M], kind);
    ck_assert_uint_eq(plan.host[MT_PLAN_ADAM_V], kind);
    /* Activations on the host: ntok = 32. Checkpoints ceil(6/2) = 3 of 32*192 fp32, for each
     * of the 3 micro-batches. */
    ck_assert_int_eq(plan.num_checkpoints, 3);
    ck_assert_uint_eq(plan.host[MT_PLAN_CHECKPOINTS], 3 * 3 * 32 * 192 * 4);
    /* The layer's own buffer sizes come from the CPU backend's contract. */
    const uint64_t saved = (uint64_t)mt_layer_saved_numel(&c, 2, 16);
    const uint64_t scratch = (uint64_t)mt_layer_scratch_numel(&c, 2, 16);
    ck_assert_uint_gt(saved, 0);
    ck_assert_uint_eq(plan.host[MT_PLAN_BLOCK_SAVED], 2 * saved * 4);
    /* two hidden states and two gradients per micro-batch (ping-pong) */
    ck_assert_uint_eq(plan.host[MT_PLAN_ACT_GRADS], 3 * 4 * 32 * 192 * 4);
    /* Head scratch per chunk of 32 rows: hn, dhn (2*192), inv_rms (1), logits (256). */
    ck_assert_int_eq(mt_head_scratch_numel(&c, 32), 32 * (2 * 192 + 1 + 256));
    ck_assert_uint_eq(plan.host[MT_PLAN_WORKSPACE], (scratch + 32 * 641) * 4);
    /* tokens and targets: two slots of 3 micro-batches plus one for evaluation */
    ck_assert_uint_eq(plan.host[MT_PLAN_INPUTS], 7 * 2 * 4 * 32);
    ck_assert_uint_eq(plan.host_total, 5 * kind + 3 * 73728 + 8 * saved + 3 * 98304 + (scratch + 20512) * 4 + 7 * 256);
    /* Not in the totals: the second gradient of every tile (--adamw-defer auto or on), a gradient. */
    ck_assert_uint_eq(plan.host_grad_alt, kind);
    /* flags: 49152 / 64, 393920 / 64 (6155 words), 192 / 64 words of 8 bytes, and 20 bytes for
     * each 16 elements (49152 / 16 = 3072, 393920 / 16 = 24620, 192 / 16 = 12), plus per tile
     * (8: the embedding, 6 layers, the head) a 24-byte header and 16 spare entries */
    ck_assert_uint_eq(plan.host_clip_flags,
                      8 * (768 + 6 * 6155 + 3) + 20 * (3072 + 6 * 24620 + 12) + 8 * (24 + 16 * 20));
    ck_assert_uint_eq(plan.host[MT_PLAN_CLIP_FLAGS], 0); /* no GPU: no ranged speculation by default */
    /* No GPU: nothing on it, nothing pinned. */
    ck_assert_uint_eq(plan.gpu_total, 0);
    ck_assert_uint_eq(plan.host_pinned_total, 0);
    char err[1024];
    ck_assert_msg(mt_plan_check_host(&plan, 1 * GiB, err, sizeof err) == 0, "%s", err);
}
END_TEST

/* Qwen2.5-0.5B on a GPU, bf16, B=4, T=1024, K=4, accumulation 8. */
START_TEST(test_qwen05_gpu)
{
    mt_model_config c;
    ck_assert_int_eq(mt_config_from_shape("qwen2.5-0.5b", &c), 0);
    mt_plan_params p = {.micro_batch = 4, .seq_len = 1024, .grad_accum = 8, .checkpoint_interval = 4,
                        .compute = MT_DTYPE_BF16, .use_gpu = true};
    mt_plan plan;
    ck_assert_msg(mt_plan_compute(&c, &p, &plan) == 0, "%s", plan.error);
    ck_assert_int_eq(plan.param_count, 494032768);
    ck_assert_int_eq(plan.tokens_per_step, 32768);
    ck_assert_int_eq(plan.params.head_chunk, 1024);
    /* Tiles (d=896, I=4864, q 896, kv 128; every tensor a multiple of 64, so no padding):
     * layer = 2*896 + 2*896*896 + 2*128*896 + (896+128+128) + 3*4864*896 = 14912384,
     * embed = 151936*896 = 136134656, head = 896 (tied). */
    ck_assert_int_eq(plan.tile_numel[MT_TILE_LAYER], 14912384);
    ck_assert_int_eq(plan.tile_numel[MT_TILE_EMBED], 136134656);
    ck_assert_int_eq(plan.tile_numel[MT_TILE_HEAD], 896);
    ck_assert_int_eq(plan.max_tile_numel, 136134656);

    /* bf16 streamed copy: embed 272269312 (66472 pages exactly); layer 29824768 and its norms'
     * fp32 side 2 x 896 x 4 = 7168 -> 7284 pages = 29835264; head 1792 -> 256-byte boundary 1792,
     * its norm's side 3584 -> 8192: 272269312 + 24*29835264 + 8192 = 988323840. */
    ck_assert_uint_eq(plan.host[MT_PLAN_WEIGHTS], 988323840ULL);
    /* fp32 kinds: embed 544538624 (exact), layer 59649536 -> 14563 pages = 59650048,
     * head 3584 -> 4096: 544538624 + 24*59650048 + 4096 = 1976143872. */
    ck_assert_uint_eq(plan.host[MT_PLAN_MASTER], 1976143872ULL);
    ck_assert_uint_eq(plan.host[MT_PLAN_GRADS], 1976143872ULL);
    ck_assert_uint_eq(plan.host[MT_PLAN_ADAM_M], 1976143872ULL);
    ck_assert_uint_eq(plan.host[MT_PLAN_ADAM_V], 1976143872ULL);
    /* Host: state + tokens/targets (2 * 4096 int32 for 2 slots of 8 micro-batches and one
     * evaluation micro-batch), no activations. */
    ck_assert_uint_eq(plan.host[MT_PLAN_INPUTS], 17 * 32768);
    ck_assert_uint_eq(plan.host[MT_PLAN_CHECKPOINTS], 0);
    ck_assert_uint_eq(plan.host[MT_PLAN_BLOCK_SAVED], 0);
    /* Ranged clip speculation's flags (GPU, bf16): per tile n / 64 words of 8 bytes, n / 16 + 16
     * entries of 20 and a 24-byte header: embed 17016832 + 170168640 + 24, layer 1864048 +
     * 18640800 + 24 (x 24), head 112 + 1440 + 24. */
    ck_assert_uint_eq(plan.host_clip_flags, 187185496ULL + 24ULL * 20504872 + 1576);
    ck_assert_uint_eq(plan.host[MT_PLAN_CLIP_FLAGS], plan.host_clip_flags);
    /* each micro-batch's dh0 in pinned host memory, read by the table's CPU backward: 8 x 4096 x 896 fp32 */
    ck_assert_uint_eq(plan.host[MT_PLAN_ACT_GRADS], 8ULL * 4096 * 896 * 4);
    ck_assert_uint_eq(plan.host_total,
                      988323840ULL + 4 * 1976143872ULL + 17 * 32768 + plan.host_clip_flags + 8ULL * 4096 * 896 * 4);
    ck_assert_uint_eq(plan.host_total, 9690200896ULL);
    /* all pinned but the flags, which only CPU tasks touch */
    ck_assert_uint_eq(plan.host_pinned_total, plan.host_total - plan.host_clip_flags);
    /* About 18 bytes per parameter of state, as docs/design.md says, and 1.375 of flags. */
    const uint64_t state = plan.host_total - plan.host_clip_flags - plan.host[MT_PLAN_ACT_GRADS];
    ck_assert(state > 18ULL * 494032768 && state < 18ULL * 494032768 + 2000000);

    /* GPU: two weight buffers of the largest tile (the embedding) in bf16, two fp32 gradient
     * buffers, 6 checkpoints (ceil(24/4)) of 4096*896 fp32 per micro-batch (8), one block of
     * 4 layers' saved activations, two hidden states and two gradients per micro-batch, layer +
     * head workspace, tokens/targets; the kernel-specific sizes from the functions
     * runtime/step/graph.c sizes its buffers with (the CUDA kernels' when the build has them). */
    ck_assert_uint_eq(plan.gpu[MT_PLAN_WEIGHTS], 2ULL * 136134656 * 2);
    ck_assert_uint_eq(plan.gpu[MT_PLAN_GRADS], 2ULL * 136134656 * 4);
    ck_assert_int_eq(plan.num_checkpoints, 6);
    ck_assert_uint_eq(plan.gpu[MT_PLAN_CHECKPOINTS], 8 * 6ULL * 4096 * 896 * 4);
    const uint64_t saved = mt_codelet_layer_saved_bytes(&c, MT_DTYPE_BF16, true, 4, 1024);
    const uint64_t scratch = mt_codelet_layer_scratch_bytes(&c, MT_DTYPE_BF16, true, 4, 1024) +
                             mt_codelet_head_scratch_bytes(&c, MT_DTYPE_BF16, true, 1024);
    ck_assert_uint_eq(plan.gpu[MT_PLAN_BLOCK_SAVED], 4 * saved);
    ck_assert_uint_eq(plan.gpu[MT_PLAN_ACT_GRADS], 8 * 4ULL * 4096 * 896 * 4);
    ck_assert_uint_eq(plan.gpu[MT_PLAN_WORKSPACE], scratch);
    ck_assert_uint_eq(plan.gpu[MT_PLAN_INPUTS], 17 * 32768);
    ck_assert_uint_eq(plan.gpu_total, 544538624ULL + 1089077248ULL + 48 * 14680064ULL + 4 * saved + 32 * 14680064ULL +
                                          scratch + 17 * 32768);
#if MT_HAVE_CUDA
    /* The CUDA layer keeps bf16 activations: less than the CPU op's fp32 saved buffer. */
    ck_assert_uint_lt(saved, (uint64_t)mt_layer_saved_numel(&c, 4, 1024) * 4);
    /* On the fp32 GPU path (--dtype fp32) the weights stream as fp32 and the layer keeps fp32
     * copies of what it kept as bf16: twice the weight buffers, more saved bytes and workspace. */
    {
        mt_plan_params p32 = p;
        p32.compute = MT_DTYPE_F32;
        mt_plan plan32;
        ck_assert_int_eq(mt_plan_compute(&c, &p32, &plan32), 0);
        ck_assert_uint_eq(plan32.gpu[MT_PLAN_WEIGHTS], 2 * plan.gpu[MT_PLAN_WEIGHTS]);
        ck_assert_uint_eq(plan32.gpu[MT_PLAN_GRADS], plan.gpu[MT_PLAN_GRADS]);
        const uint64_t saved32 = mt_codelet_layer_saved_bytes(&c, MT_DTYPE_F32, true, 4, 1024);
        ck_assert_uint_gt(saved32, saved);
        ck_assert_uint_eq(plan32.gpu[MT_PLAN_BLOCK_SAVED], 4 * saved32);
        ck_assert_uint_gt(plan32.gpu[MT_PLAN_WORKSPACE], plan.gpu[MT_PLAN_WORKSPACE]);
        ck_assert_uint_eq(plan32.gpu[MT_PLAN_CHECKPOINTS], plan.gpu[MT_PLAN_CHECKPOINTS]);
    }
#endif

    char err[1024];
    ck_assert_msg(mt_plan_check_host(&plan, 125 * GiB, err, sizeof err) == 0, "%s", err);
    ck_assert_msg(mt_plan_check_gpu(&plan, 139 * GiB, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(mt_plan_check_gpu(&plan, 1 * GiB, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "GPU") != NULL, "%s", err);

    /* The table names every kind that holds bytes, and the totals. */
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    mt_plan_print(&plan, f);
    fclose(f);
    ck_assert_ptr_nonnull(strstr(text, "master weights"));
    ck_assert_ptr_nonnull(strstr(text, "checkpoints"));
    ck_assert_ptr_nonnull(strstr(text, "total"));
    ck_assert_ptr_nonnull(strstr(text, "clip speculation flags"));
    ck_assert_ptr_nonnull(strstr(text, "9690200896"));
    ck_assert_ptr_nonnull(strstr(text, "9.02 GiB"));
    free(text);
}
END_TEST

/* Refusals on the GPU box's 125 GiB: Qwen2.5-7B (~137 GB at 18 B/param) and 14B; 3B fits. */
START_TEST(test_host_refusal)
{
    mt_model_config c;
    mt_plan_params p = {.micro_batch = 8, .seq_len = 1024, .grad_accum = 1, .checkpoint_interval = 4,
                        .compute = MT_DTYPE_BF16, .use_gpu = true};
    mt_plan plan;
    char err[1024], num[32];

    ck_assert_int_eq(mt_config_from_shape("qwen2.5-7b", &c), 0);
    ck_assert_msg(mt_plan_compute(&c, &p, &plan) == 0, "%s", plan.error);
    /* 7615616512 * 18 = 137,081,097,216 bytes, plus page padding and the token buffers, plus the
     * clip speculation flags (~1.375 B per parameter), plus the dh0 of the micro-batch (8 x 1024 x
     * 3584 fp32). */
    ck_assert_uint_eq(plan.host[MT_PLAN_ACT_GRADS], 8ULL * 1024 * 3584 * 4);
    const uint64_t state = plan.host_total - plan.host_clip_flags - plan.host[MT_PLAN_ACT_GRADS];
    ck_assert_uint_ge(state, 137081097216ULL);
    ck_assert_uint_lt(state, 137081097216ULL + 4 * 1024 * 1024);
    ck_assert_msg(llabs((long long)plan.host_clip_flags - 7615616512LL / 8 * 11) < 1000000, "flags %llu",
                  (unsigned long long)plan.host_clip_flags);
    ck_assert_int_eq(mt_plan_check_host(&plan, 125 * GiB, err, sizeof err), -1);
    snprintf(num, sizeof num, "%" PRIu64, plan.host_total);
    ck_assert_msg(strstr(err, num) != NULL, "message lacks the bytes needed (%s): %s", num, err);
    ck_assert_msg(strstr(err, "125.00 GiB") != NULL, "message lacks what there is: %s", err);
    ck_assert_msg(strstr(err, "smaller") != NULL && strstr(err, "RAM") != NULL, "no advice: %s", err);
    /* It would fit on a 160 GiB box (137.1e9 <= 0.9 * 171.8e9). */
    ck_assert_msg(mt_plan_check_host(&plan, 160 * GiB, err, sizeof err) == 0, "%s", err);

    ck_assert_int_eq(mt_config_from_shape("qwen2.5-14b", &c), 0);
    ck_assert_msg(mt_plan_compute(&c, &p, &plan) == 0, "%s", plan.error);
    ck_assert_uint_ge(plan.host_total, 18ULL * 14770033664ULL);
    ck_assert_int_eq(mt_plan_check_host(&plan, 125 * GiB, err, sizeof err), -1);
    snprintf(num, sizeof num, "%" PRIu64, plan.host_total);
    ck_assert_msg(strstr(err, num) != NULL, "message lacks the bytes needed (%s): %s", num, err);

    ck_assert_int_eq(mt_config_from_shape("qwen2.5-3b", &c), 0);
    ck_assert_msg(mt_plan_compute(&c, &p, &plan) == 0, "%s", plan.error);
    ck_assert_msg(mt_plan_check_host(&plan, 125 * GiB, err, sizeof err) == 0, "%s", err);

    /* The 90% rule at its edge: exactly 90% of 1000 bytes' worth is accepted, one more byte not. */
    mt_plan edge;
    memset(&edge, 0, sizeof edge);
    edge.param_count = 1;
    edge.host_total = 900;
    ck_assert_int_eq(mt_plan_check_host(&edge, 1000, err, sizeof err), 0);
    edge.host_total = 901;
    ck_assert_int_eq(mt_plan_check_host(&edge, 1000, err, sizeof err), -1);
}
END_TEST

static mt_model_config qwen72b(void)
{
    /* Qwen2.5-72B's config.json values */
    static const char json[] =
        "{\"model_type\": \"qwen2\", \"hidden_size\": 8192, \"intermediate_size\": 29568,"
        " \"num_hidden_layers\": 80, \"num_attention_heads\": 64, \"num_key_value_heads\": 8,"
        " \"vocab_size\": 152064, \"max_position_embeddings\": 32768, \"rope_theta\": 1000000.0,"
        " \"rms_norm_eps\": 1e-6, \"tie_word_embeddings\": false}";
    mt_model_config c;
    char err[256];
    ck_assert_msg(mt_config_parse(json, "qwen2.5-72b", &c, err, sizeof err) == 0, "%s", err);
    return c;
}

/* Qwen2.5-7B in the compact layout on a GPU, 16 x 2048, bf16: every host kind by hand, 14.0
 * bytes per parameter all in, and the GPU's bf16 gradients and fp32 accumulators. */
START_TEST(test_compact_bytes)
{
    mt_model_config c;
    ck_assert_int_eq(mt_config_from_shape("qwen2.5-7b", &c), 0);
    mt_plan_params p = {.micro_batch = 16, .seq_len = 2048, .grad_accum = 1, .checkpoint_interval = 4,
                        .compute = MT_DTYPE_BF16, .use_gpu = true, .layout = MT_LAYOUT_COMPACT};
    mt_plan plan;
    ck_assert_msg(mt_plan_compute(&c, &p, &plan) == 0, "%s", plan.error);
    /* Tiles (d=3584, I=18944, q 3584, kv 512, untied; every tensor a multiple of 64):
     * layer = 2*3584 + 2*3584^2 + 2*512*3584 + (3584+1024) + 3*18944*3584 = 233057792,
     * embed = 152064*3584 = 544997376, head = 3584 + 544997376 = 545000960. */
    ck_assert_int_eq(plan.tile_numel[MT_TILE_LAYER], 233057792);
    ck_assert_int_eq(plan.tile_numel[MT_TILE_EMBED], 544997376);
    ck_assert_int_eq(plan.tile_numel[MT_TILE_HEAD], 545000960);
    ck_assert_int_eq(plan.param_count, 7615616512LL);
    /* 16-bit kinds (the master's two halves, the gradient): embed 1089994752 (266112 pages),
     * layer 466115584 -> 113798 pages = 466116608, head 1090001920 -> 266114 pages = 1090002944:
     * 1089994752 + 28*466116608 + 1090002944 = 15231262720. The streamed half has the norms'
     * fp32 side too: layer + 2 x 3584 x 4 -> 113805 pages = 466145280, head + 3584 x 4 -> 266118
     * pages = 1090019328: 1089994752 + 28*466145280 + 1090019328 = 15232081920. fp32 kinds (m, v):
     * 2179989504 + 28*932233216 + 2180005888 = 30462525440. */
    const uint64_t streamed = 15232081920ULL;
    ck_assert_uint_eq(plan.host[MT_PLAN_WEIGHTS], streamed);
    ck_assert_uint_eq(plan.host[MT_PLAN_MASTER], 15231262720ULL);
    ck_assert_uint_eq(plan.host[MT_PLAN_GRADS], 15231262720ULL);
    ck_assert_uint_eq(plan.host[MT_PLAN_ADAM_M], 30462525440ULL);
    ck_assert_uint_eq(plan.host[MT_PLAN_ADAM_V], 30462525440ULL);
    /* no speculation: no flags, no second gradient */
    ck_assert_uint_eq(plan.host[MT_PLAN_CLIP_FLAGS], 0);
    ck_assert_uint_eq(plan.host_grad_alt, 0);
    ck_assert_uint_eq(plan.host[MT_PLAN_INPUTS], 3 * 2 * 4 * 32768);
    /* dh0 (16 x 2048 x 3584 fp32) and the table's fp32 accumulator (152064 x 3584), both pinned */
    const uint64_t dh0 = 16ULL * 2048 * 3584 * 4, acc = 544997376ULL * 4;
    ck_assert_uint_eq(plan.host[MT_PLAN_ACT_GRADS], dh0);
    ck_assert_uint_eq(plan.host[MT_PLAN_GRAD_ACC], acc);
    ck_assert_uint_eq(plan.host_total, streamed + 2 * 15231262720ULL + 2 * 30462525440ULL + 786432 + dh0 + acc);
    /* only what the GPU copies is pinned: the streamed half, the gradient, the inputs, dh0, the
     * table's accumulator */
    ck_assert_uint_eq(plan.host_pinned_total, streamed + 15231262720ULL + 786432 + dh0 + acc);
    /* 14.0 bytes per parameter with the inputs; dh0 adds 0.06, the accumulator 0.29 */
    const double per = (double)(plan.host_total - dh0 - acc) / (double)plan.param_count;
    ck_assert_msg(per >= 14.0 && per < 14.0005, "%.6f bytes per parameter", per);
    /* GPU: two buffers of the largest tile's streamed copy (the head, its norm's side included),
     * the bf16 gradients as the weights (their handles have the weights' size); the accumulators
     * at their most: the table's with layer 0's being converted, fp32 */
    ck_assert_uint_eq(plan.gpu[MT_PLAN_GRADS], 2ULL * (545000960 * 2 + 3584 * 4));
    ck_assert_uint_eq(plan.gpu[MT_PLAN_WEIGHTS], 2ULL * (545000960 * 2 + 3584 * 4));
    ck_assert_uint_eq(plan.gpu[MT_PLAN_GRAD_ACC], 4ULL * (544997376 + 233057792));
    ck_assert_uint_eq(plan.host[MT_PLAN_GRAD_ACC], acc); /* the table's, at its home */
    /* several micro-batches keep a block's K accumulators, and one more being converted */
    p.grad_accum = 4;
    ck_assert_msg(mt_plan_compute(&c, &p, &plan) == 0, "%s", plan.error);
    ck_assert_uint_eq(plan.gpu[MT_PLAN_GRAD_ACC], 4ULL * 5 * 233057792);
    /* fp32 weights have no compact layout */
    p.compute = MT_DTYPE_F32;
    ck_assert_int_eq(mt_plan_compute(&c, &p, &plan), -1);
    ck_assert_msg(strstr(plan.error, "bf16") && strstr(plan.error, "full"), "%s", plan.error);
    /* the table says which halves the kinds are */
    p.compute = MT_DTYPE_BF16;
    p.grad_accum = 1;
    ck_assert_int_eq(mt_plan_compute(&c, &p, &plan), 0);
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    mt_plan_print(&plan, f);
    fclose(f);
    ck_assert_ptr_nonnull(strstr(text, "master high half"));
    ck_assert_ptr_nonnull(strstr(text, "gradient accumulators"));
    /* one micro-batch's dh0 (16 x 2048 x 3584 fp32) adds 0.06 to the state's 14, the table's
     * accumulator 0.29 */
    ck_assert_msg(strstr(text, "training state 14.00 bytes per parameter; all in 14.35 bytes per parameter"), "%s", text);
    free(text);
}
END_TEST

/* auto: the full layout with speculation where it fits, else compact, else refused; the choice
 * says why. Qwen2.5-3B keeps full with speculation on 125 GiB, 7B goes compact, 14B is refused;
 * Qwen2.5-72B fits 1.5 TB in compact. */
START_TEST(test_layout_choice)
{
    const mt_plan_params p = {.micro_batch = 16, .seq_len = 2048, .grad_accum = 1, .checkpoint_interval = 4,
                              .compute = MT_DTYPE_BF16, .use_gpu = true};
    mt_model_config c;
    mt_plan plan;
    mt_layout_choice ch;
    ck_assert_int_eq(mt_config_from_shape("qwen2.5-3b", &c), 0);
    ck_assert_int_eq(mt_plan_choose(&c, &p, MT_LAYOUT_AUTO, 125 * GiB, &plan, &ch), 0);
    ck_assert(ch.fits && ch.layout == MT_LAYOUT_FULL && ch.speculation);
    ck_assert_int_eq(plan.params.layout, MT_LAYOUT_FULL);
    /* 18 + 1.375 of flags + 4 of the second gradient */
    ck_assert(ch.full_speculation == plan.host_total + plan.host_grad_alt);
    const double dh0 = (double)plan.host[MT_PLAN_ACT_GRADS];
    ck_assert(dh0 == 16.0 * 2048 * 2048 * 4);
    ck_assert_msg(fabs(((double)ch.full_speculation - dh0) / (double)ch.param_count - 23.375) < 0.01, "%.4f",
                  ((double)ch.full_speculation - dh0) / (double)ch.param_count);
    ck_assert_uint_eq(ch.host_total, ch.full_speculation);

    ck_assert_int_eq(mt_config_from_shape("qwen2.5-7b", &c), 0);
    ck_assert_int_eq(mt_plan_choose(&c, &p, MT_LAYOUT_AUTO, 125 * GiB, &plan, &ch), 0);
    ck_assert(ch.fits && ch.layout == MT_LAYOUT_COMPACT && !ch.speculation);
    ck_assert_int_eq(plan.params.layout, MT_LAYOUT_COMPACT);
    ck_assert_uint_eq(ch.compact, plan.host_total);
    ck_assert_uint_eq(ch.host_total, plan.host_total);
    ck_assert(ch.full_plain > ch.usable && ch.compact <= ch.usable);
    ck_assert_msg(strstr(ch.why, "would need") && strstr(ch.why, "compact needs"), "%s", ch.why);
    /* asked for full, it is refused there, saying why; asked for compact, the same as auto */
    ck_assert_int_eq(mt_plan_choose(&c, &p, MT_LAYOUT_FULL, 125 * GiB, &plan, &ch), 0);
    ck_assert(!ch.fits && ch.layout == MT_LAYOUT_FULL && plan.params.layout == MT_LAYOUT_FULL);
    char err[1024];
    ck_assert_int_eq(mt_plan_check_host(&plan, 125 * GiB, err, sizeof err), -1);
    ck_assert_int_eq(mt_plan_choose(&c, &p, MT_LAYOUT_COMPACT, 125 * GiB, &plan, &ch), 0);
    ck_assert(ch.fits && ch.layout == MT_LAYOUT_COMPACT);
    /* fp32: no compact layout; auto is the full one, refused */
    mt_plan_params p32 = p;
    p32.compute = MT_DTYPE_F32;
    ck_assert_int_eq(mt_plan_choose(&c, &p32, MT_LAYOUT_AUTO, 125 * GiB, &plan, &ch), 0);
    ck_assert(!ch.fits && ch.layout == MT_LAYOUT_FULL && ch.compact == 0);
    ck_assert_int_eq(mt_plan_choose(&c, &p32, MT_LAYOUT_COMPACT, 125 * GiB, &plan, &ch), -1);
    ck_assert_msg(strstr(plan.error, "bf16"), "%s", plan.error);
    ck_assert_int_eq(mt_plan_choose(&c, &p, (mt_host_layout)7, 125 * GiB, &plan, &ch), -1);

    ck_assert_int_eq(mt_config_from_shape("qwen2.5-14b", &c), 0);
    ck_assert_int_eq(mt_plan_choose(&c, &p, MT_LAYOUT_AUTO, 125 * GiB, &plan, &ch), 0);
    ck_assert(!ch.fits && ch.layout == MT_LAYOUT_COMPACT);
    ck_assert_int_eq(mt_plan_check_host(&plan, 125 * GiB, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "14.0 bytes/parameter"), "%s", err);

    /* Qwen2.5-72B: 72.7e9 parameters; 1.5 TB (decimal, and binary) hold it compact, not full */
    c = qwen72b();
    const uint64_t tb15[2] = { 1500000000000ULL, 1536ULL * GiB };
    for (int k = 0; k < 2; k++) {
        ck_assert_int_eq(mt_plan_choose(&c, &p, MT_LAYOUT_AUTO, tb15[k], &plan, &ch), 0);
        ck_assert_int_eq(ch.param_count, 72706203648LL);
        ck_assert_msg(ch.fits && ch.layout == MT_LAYOUT_COMPACT, "%s", ch.why);
        ck_assert(ch.full_speculation > ch.usable);
        const double per = (double)(plan.host_total - plan.host[MT_PLAN_ACT_GRADS] - plan.host[MT_PLAN_GRAD_ACC]) /
                           (double)plan.param_count;
        ck_assert_msg(per >= 14.0 && per < 14.0005, "%.6f", per);
    }
}
END_TEST

/* What fits on 125 GiB: the three small shapes full with speculation, 7B compact, 14B refused
 * with the deepest model of its width that fits (and one layer more does not). */
START_TEST(test_fit_table)
{
    const mt_plan_params p = {.micro_batch = 16, .seq_len = 2048, .grad_accum = 1, .checkpoint_interval = 4,
                              .compute = MT_DTYPE_BF16, .use_gpu = true};
    mt_plan_fit rows[MT_PLAN_NSHAPES];
    char err[256];
    ck_assert_int_eq(mt_plan_fit_shapes(&p, MT_LAYOUT_AUTO, 125 * GiB, rows, err, sizeof err), MT_PLAN_NSHAPES);
    for (int i = 0; i < 3; i++) {
        ck_assert(rows[i].choice.fits && rows[i].choice.layout == MT_LAYOUT_FULL && rows[i].choice.speculation);
        ck_assert_int_eq(rows[i].max_layers, rows[i].layers);
    }
    ck_assert_str_eq(rows[3].shape, "qwen2.5-7b");
    ck_assert(rows[3].choice.fits && rows[3].choice.layout == MT_LAYOUT_COMPACT);
    ck_assert_int_eq(rows[3].params, 7615616512LL);
    ck_assert_str_eq(rows[4].shape, "qwen2.5-14b");
    ck_assert(!rows[4].choice.fits);
    const int64_t most = rows[4].max_layers;
    ck_assert(most > 0 && most < 48);
    mt_model_config c;
    ck_assert_int_eq(mt_config_from_shape("qwen2.5-14b", &c), 0);
    mt_plan plan;
    mt_layout_choice ch;
    c.layers = most;
    ck_assert_int_eq(mt_plan_choose(&c, &p, MT_LAYOUT_AUTO, 125 * GiB, &plan, &ch), 0);
    ck_assert(ch.fits && ch.layout == MT_LAYOUT_COMPACT);
    ck_assert_int_eq(rows[4].max_params, plan.param_count);
    c.layers = most + 1;
    ck_assert_int_eq(mt_plan_choose(&c, &p, MT_LAYOUT_AUTO, 125 * GiB, &plan, &ch), 0);
    ck_assert(!ch.fits);
    /* the printed table: one row a shape, the layout, the verdict */
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    mt_plan_print_fits(rows, MT_PLAN_NSHAPES, f);
    fclose(f);
    ck_assert_msg(strstr(text, "| qwen2.5-7b | 7.616B | compact | 101.77 GiB | 14.35 | fits |"), "%s", text);
    ck_assert_msg(strstr(text, "| qwen2.5-3b | 3.086B | full + clip speculation |"), "%s", text);
    char want[64];
    snprintf(want, sizeof want, "refused; at this width %lld of its 48 layers fit", (long long)most);
    ck_assert_msg(strstr(text, want), "%s", text);
    free(text);
    /* on 16 GiB not one 14B layer and its table fit */
    ck_assert_int_eq(mt_plan_fit_shapes(&p, MT_LAYOUT_AUTO, 16 * GiB, rows, err, sizeof err), MT_PLAN_NSHAPES);
    ck_assert(rows[0].choice.fits);
    ck_assert_int_eq(rows[4].max_layers, 0);
}
END_TEST

START_TEST(test_bad_params)
{
    mt_model_config c;
    ck_assert_int_eq(mt_config_from_shape("tiny", &c), 0);
    const mt_plan_params good = {.micro_batch = 1, .seq_len = 8, .grad_accum = 1, .checkpoint_interval = 1,
                                 .compute = MT_DTYPE_F32};
    mt_plan plan;
    mt_plan_params p = good;
    p.micro_batch = 0;
    ck_assert_int_eq(mt_plan_compute(&c, &p, &plan), -1);
    ck_assert_msg(strstr(plan.error, "micro batch") != NULL, "%s", plan.error);
    p = good;
    p.seq_len = -3;
    ck_assert_int_eq(mt_plan_compute(&c, &p, &plan), -1);
    ck_assert_msg(strstr(plan.error, "sequence length") != NULL, "%s", plan.error);
    p = good;
    p.checkpoint_interval = 0;
    ck_assert_int_eq(mt_plan_compute(&c, &p, &plan), -1);
    ck_assert_msg(strstr(plan.error, "checkpoint interval") != NULL, "%s", plan.error);
    p = good;
    p.grad_accum = 0;
    ck_assert_int_eq(mt_plan_compute(&c, &p, &plan), -1);
    p = good;
    p.micro_batch = INT64_MAX / 2;
    p.seq_len = 1000;
    ck_assert_int_eq(mt_plan_compute(&c, &p, &plan), -1);
    ck_assert_msg(strstr(plan.error, "absurdly large") != NULL, "%s", plan.error);
    /* An invalid config is refused, not planned. */
    mt_model_config bad = c;
    bad.kv_heads = 4;
    ck_assert_int_eq(mt_plan_compute(&bad, &good, &plan), -1);
    ck_assert_msg(strstr(plan.error, "num_key_value_heads") != NULL, "%s", plan.error);

    /* K beyond L means one block of all layers: clamped, one checkpoint. */
    p = good;
    p.checkpoint_interval = 100;
    ck_assert_msg(mt_plan_compute(&c, &p, &plan) == 0, "%s", plan.error);
    ck_assert_int_eq(plan.params.checkpoint_interval, 6);
    ck_assert_int_eq(plan.num_checkpoints, 1);
}
END_TEST

START_TEST(test_available)
{
    uint64_t avail = mt_host_memory_available();
    ck_assert_uint_gt(avail, 16 * 1024 * 1024);
    char buf[32];
    ck_assert_str_eq(mt_format_bytes(512, buf, sizeof buf), "512 B");
    ck_assert_str_eq(mt_format_bytes(1536, buf, sizeof buf), "1.50 KiB");
    ck_assert_str_eq(mt_format_bytes(125 * GiB, buf, sizeof buf), "125.00 GiB");
}
END_TEST

START_TEST(test_micro_batch_choice)
{
    mt_model_config cfg;
    ck_assert_int_eq(mt_config_from_shape("tiny", &cfg), 0);
    mt_plan_params p = { .micro_batch = 1, .seq_len = 64, .grad_accum = 1, .checkpoint_interval = 2,
                         .compute = MT_DTYPE_F32, .use_gpu = false };
    char err[256];
    int64_t B = 0, accum = 0;
    /* The activation bytes of a split: B sequences per micro-batch, `accum` micro-batches. */
    uint64_t need[17] = { 0 };
    for (int b = 1; b <= 16; b++) {
        mt_plan_params q = p;
        q.micro_batch = b;
        q.grad_accum = (16 + b - 1) / b;
        mt_plan plan;
        ck_assert_int_eq(mt_plan_compute(&cfg, &q, &plan), 0);
        need[b] = mt_plan_activation_bytes(&plan);
    }
    ck_assert(need[4] < need[8] && need[8] < need[16]);
    /* 16 sequences with room for exactly 4 x 4: chosen; one byte less than 8 x 2 still gives 4. */
    ck_assert_int_eq(mt_plan_micro_batch(&cfg, &p, 16 * 64, need[4], &B, &accum, err, sizeof err), 0);
    ck_assert_int_eq(B, 4);
    ck_assert_int_eq(accum, 4);
    ck_assert_int_eq(mt_plan_micro_batch(&cfg, &p, 16 * 64, need[8] - 1, &B, &accum, err, sizeof err), 0);
    ck_assert_int_eq(B, 4);
    /* Plenty of room: one micro-batch. */
    ck_assert_int_eq(mt_plan_micro_batch(&cfg, &p, 16 * 64, UINT64_MAX, &B, &accum, err, sizeof err), 0);
    ck_assert_int_eq(B, 16);
    ck_assert_int_eq(accum, 1);
    /* 12 sequences: only divisors of 12 are candidates (6 x 2 does not fit, 4 x 3 does). */
    mt_plan_params q = p;
    q.micro_batch = 4;
    q.grad_accum = 3;
    mt_plan plan43, plan62;
    ck_assert_int_eq(mt_plan_compute(&cfg, &q, &plan43), 0);
    q.micro_batch = 6;
    q.grad_accum = 2;
    ck_assert_int_eq(mt_plan_compute(&cfg, &q, &plan62), 0);
    ck_assert(mt_plan_activation_bytes(&plan43) < mt_plan_activation_bytes(&plan62));
    ck_assert_int_eq(mt_plan_micro_batch(&cfg, &p, 12 * 64, mt_plan_activation_bytes(&plan62) - 1, &B, &accum, err, sizeof err), 0);
    ck_assert_int_eq(B, 4);
    ck_assert_int_eq(accum, 3);
    /* Not a multiple of T, and a budget too small for one sequence. */
    ck_assert_int_eq(mt_plan_micro_batch(&cfg, &p, 100, UINT64_MAX, &B, &accum, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "multiple") != NULL, "%s", err);
    ck_assert_int_eq(mt_plan_micro_batch(&cfg, &p, 16 * 64, 1000, &B, &accum, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "budget") != NULL, "%s", err);
}
END_TEST

/* The process's rows: counted only when asked, each as its rule says, in the total, for random
 * worker counts, program and data sizes; a GPU plan has the CUDA context and no CPU copies. */
START_TEST(test_process_rows)
{
    mt_model_config c;
    ck_assert_int_eq(mt_config_from_shape("tiny", &c), 0);
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 41);
    for (int trial = 0; trial < 20; trial++) {
        const bool gpu = trial % 2;
        const int ncpu = 1 + (int)(mt_test_uniform(&rng) * 16);
        const uint64_t program = 1 + (uint64_t)(mt_test_uniform(&rng) * 4e8), data = 1 + (uint64_t)(mt_test_uniform(&rng) * 1e9);
        const int64_t B = 1 + (int64_t)(mt_test_uniform(&rng) * 8), T = 16 << (int)(mt_test_uniform(&rng) * 4);
        const int64_t accum = 1 + (int64_t)(mt_test_uniform(&rng) * 3), eval = (int64_t)(mt_test_uniform(&rng) * 100);
        mt_plan_params p = { .micro_batch = B, .seq_len = T, .grad_accum = accum, .checkpoint_interval = 2,
                             .compute = gpu ? MT_DTYPE_BF16 : MT_DTYPE_F32, .use_gpu = gpu };
        mt_plan bare, plan;
        ck_assert_msg(mt_plan_compute(&c, &p, &bare) == 0, "%s", bare.error);
        p.process = (mt_plan_process){ .counted = true, .ncpu = ncpu, .program_bytes = program, .data_bytes = data,
                                       .eval_sequences = eval };
        ck_assert_msg(mt_plan_compute(&c, &p, &plan) == 0, "%s", plan.error);
        for (int k = MT_PLAN_PROGRAM; k <= MT_PLAN_DATA; k++) ck_assert_uint_eq(bare.host[k], 0);
        ck_assert_uint_eq(plan.host[MT_PLAN_PROGRAM], program);
        ck_assert_uint_eq(plan.host[MT_PLAN_RUNTIME], (9ULL << 19) + (uint64_t)ncpu * (1ULL << 18));
        ck_assert_uint_eq(plan.host[MT_PLAN_DATA], data + (uint64_t)(accum * B * T) * 8 + (uint64_t)((eval + B) * T) * 8);
        uint64_t rows = 0;
        for (int k = MT_PLAN_PROGRAM; k <= MT_PLAN_DATA; k++) rows += plan.host[k];
        ck_assert_uint_eq(plan.host_total, bare.host_total + rows);
        ck_assert_uint_eq(plan.gpu_total, bare.gpu_total);
        if (gpu) {
            ck_assert_uint_eq(plan.host[MT_PLAN_CPU_SCRATCH], 0);
            ck_assert_uint_eq(plan.host[MT_PLAN_CUDA], 288ULL << 20);
        } else {
            /* the other workers' scratch copies, and 25% of the working set with them */
            const uint64_t copies = (uint64_t)(ncpu - 1) * plan.host[MT_PLAN_WORKSPACE];
            uint64_t working = copies;
            for (int k = MT_PLAN_CHECKPOINTS; k <= MT_PLAN_GRAD_ACC; k++) working += plan.host[k];
            ck_assert_uint_eq(plan.host[MT_PLAN_CPU_SCRATCH], copies + working / 100 * 25);
            ck_assert_uint_eq(plan.host[MT_PLAN_CUDA], 0);
        }
    }
    /* a counted process needs a worker */
    mt_plan_params p = { .micro_batch = 1, .seq_len = 16, .grad_accum = 1, .checkpoint_interval = 1,
                         .compute = MT_DTYPE_F32, .process = { .counted = true, .ncpu = 0 } };
    mt_plan plan;
    ck_assert_int_eq(mt_plan_compute(&c, &p, &plan), -1);
    ck_assert_msg(strstr(plan.error, "CPU worker") != NULL, "%s", plan.error);
}
END_TEST

/* Writes n random bytes to dir/name; returns n. */
static uint64_t write_random_file(const char *dir, const char *name, mt_test_rng *rng)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    const uint64_t n = 1 + (uint64_t)(mt_test_uniform(rng) * 20000);
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    for (uint64_t i = 0; i < n; i++) fputc((int)(mt_test_uniform(rng) * 256), f);
    fclose(f);
    return n;
}

/* The data's bytes: a file's size; a directory's files but hidden ones, *.dat and meta.json; a
 * missing path named. */
START_TEST(test_data_bytes)
{
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 43);
    char dir[] = "/tmp/mt_plan_dataXXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(dir));
    const uint64_t a = write_random_file(dir, "a.txt", &rng), b = write_random_file(dir, "shard-0.bin", &rng);
    write_random_file(dir, ".hidden", &rng);
    write_random_file(dir, "a.txt.dat", &rng);
    write_random_file(dir, "meta.json", &rng);
    uint64_t bytes;
    char err[256], path[600];
    ck_assert_int_eq(mt_plan_data_bytes(dir, &bytes, err, sizeof err), 0);
    ck_assert_uint_eq(bytes, a + b);
    snprintf(path, sizeof path, "%s/a.txt", dir);
    ck_assert_int_eq(mt_plan_data_bytes(path, &bytes, err, sizeof err), 0);
    ck_assert_uint_eq(bytes, a);
    snprintf(path, sizeof path, "%s/none", dir);
    ck_assert_int_eq(mt_plan_data_bytes(path, &bytes, err, sizeof err), -1);
    ck_assert_msg(strstr(err, path) != NULL, "%s", err);
    const char *names[] = { "a.txt", "shard-0.bin", ".hidden", "a.txt.dat", "meta.json" };
    for (int i = 0; i < 5; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        remove(path);
    }
    rmdir(dir);
}
END_TEST

/* The workers: requests kept (CUDA workers too, in a build without CUDA: a plan for elsewhere),
 * CPU workers one per core less the CUDA workers and at least one. */
START_TEST(test_workers)
{
    int ncpu, ncuda, cores, none;
    mt_plan_workers(-1, 0, &cores, &none);
    ck_assert_int_eq(none, 0);
    ck_assert_int_ge(cores, 1);
    mt_plan_workers(3, 0, &ncpu, &ncuda);
    ck_assert_int_eq(ncpu, 3);
    mt_plan_workers(-1, 2, &ncpu, &ncuda);
    ck_assert_int_eq(ncuda, 2);
    ck_assert_int_eq(ncpu, cores - ncuda >= 1 ? cores - ncuda : 1);
    mt_plan_workers(-1, -1, &ncpu, &ncuda);
    ck_assert_int_ge(ncuda, 0);
    ck_assert_int_ge(ncpu, 1);
}
END_TEST

/* The resident set: the peak at least the current one, and both grow by what is touched. */
START_TEST(test_resident_set)
{
    const uint64_t rss = mt_host_rss(), peak = mt_host_peak_rss();
    ck_assert_uint_gt(rss, 0);
    ck_assert_uint_ge(peak, rss);
    const size_t n = (size_t)64 << 20;
    mt_test_rng rng;
    mt_test_rng_seed(&rng, 47);
    unsigned char *touched = malloc(n);
    ck_assert_ptr_nonnull(touched);
    for (size_t i = 0; i < n; i += 4096) touched[i] = (unsigned char)(1 + mt_test_uniform(&rng) * 254);
    /* 64 MiB touched: within 4 MiB of it in both (other pages may come and go meanwhile) */
    ck_assert_uint_ge(mt_host_rss(), rss + n - (4 << 20));
    ck_assert_uint_ge(mt_host_peak_rss(), rss + n - (4 << 20));
    unsigned sum = 0;
    for (size_t i = 0; i < n; i += 4096) sum += touched[i];
    ck_assert_uint_gt(sum, 0);
    free(touched);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("plan");
    TCase *tc = tcase_create("plan");
    tcase_add_test(tc, test_tiny_cpu);
    tcase_add_test(tc, test_qwen05_gpu);
    tcase_add_test(tc, test_host_refusal);
    tcase_add_test(tc, test_bad_params);
    tcase_add_test(tc, test_available);
    tcase_add_test(tc, test_micro_batch_choice);
    tcase_add_test(tc, test_compact_bytes);
    tcase_add_test(tc, test_layout_choice);
    tcase_add_test(tc, test_fit_table);
    tcase_add_test(tc, test_process_rows);
    tcase_add_test(tc, test_data_bytes);
    tcase_add_test(tc, test_workers);
    tcase_add_test(tc, test_resident_set);
    suite_add_tcase(s, tc);
    return mt_test_run(s, false);
}
