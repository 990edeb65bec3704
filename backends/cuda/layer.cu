// One pre-norm decoder layer on the GPU (Llama, Mistral, Qwen2 with q/k/v bias, Qwen3 with q/k
// RMSNorm, gpt_oss with o_proj's bias, sinks and its layers' windows), forward and backward,
// mirroring backends/cpu/layer.inc step by step; its MLP dense, or for a sparse layout
// (Qwen3-MoE, Mixtral, gpt_oss) the MoE block of moe.cu. The residual
// stream is fp32; every GEMM input is of the operand type E (bf16, or float on the fp32 path;
// fp32 accumulation either way); norm statistics are fp32. Each step is a template on E.
// Fused here: q/k-norm + RoPE on q and k in one launch (and their backward with the cast to E);
// rmsnorm + cast to E; the residual adds ride in the o/down GEMM epilogues; bias adds in q/k/v's.
#include <string.h>
#include <type_traits>

#include "backends/cuda/attention_f32.h"
#include "backends/cuda/colsum.cuh"
#include "backends/cuda/layer_ops.cuh"
#include "backends/cuda/linear.cuh"
#include "backends/cuda/moe.cuh"
#include "backends/cuda/rmsnorm.cuh"

// Parameter `slot` of a tile of E, NULL when absent.
template <class E> static const E *weight(const mt_tile_layout *layout, const E *tile, int slot)
{
    const mt_tensor_desc *t = &layout->tensors[slot];
    return t->numel > 0 ? tile + t->offset : nullptr;
}

// Gradient slot of an fp32 gradient tile, NULL when absent.
static float *grad(const mt_tile_layout *layout, float *dtile, int slot)
{
    const mt_tensor_desc *t = &layout->tensors[slot];
    return t->numel > 0 ? dtile + t->offset : nullptr;
}

// ---- attention of each precision: the bf16 tensor-core kernels (attention.cu) or fp32 (attention_f32.cu) ----

template <class E> static size_t attention_workspace_bytes(const mt_layer_dims *m);
template <> size_t attention_workspace_bytes<bf16>(const mt_layer_dims *m)
{
    return mt_cuda_attention_workspace_bytes(m->B, m->T, m->H, m->KV, m->D);
}
template <> size_t attention_workspace_bytes<float>(const mt_layer_dims *m)
{
    return mt_cuda_attention_f32_workspace_bytes(m->B, m->T, m->H, m->KV, m->D);
}

// window: the layer's sliding window (0: none); sinks (H) of E or NULL; dsinks (H) fp32 += or NULL.
static void attention_forward(mt_cuda_ctx *ctx, const mt_layer_dims *m, int64_t window, const bf16 *sinks,
                              const bf16 *q, const bf16 *k, const bf16 *v, bf16 *a, float *lse, mt_cuda_stream stream)
{
    mt_cuda_attention_forward_ex(ctx, m->B, m->T, m->H, m->KV, m->D, window,
                                 reinterpret_cast<const mt_cuda_bf16 *>(sinks),
                                 reinterpret_cast<const mt_cuda_bf16 *>(q), reinterpret_cast<const mt_cuda_bf16 *>(k),
                                 reinterpret_cast<const mt_cuda_bf16 *>(v), reinterpret_cast<mt_cuda_bf16 *>(a), lse,
                                 stream);
}

static void attention_forward(mt_cuda_ctx *, const mt_layer_dims *m, int64_t window, const float *sinks,
                              const float *q, const float *k, const float *v, float *a, float *lse,
                              mt_cuda_stream stream)
{
    mt_cuda_attention_forward_f32_ex(m->B, m->T, m->H, m->KV, m->D, window, sinks, q, k, v, a, lse, stream);
}

static void attention_backward(mt_cuda_ctx *ctx, const mt_layer_dims *m, int64_t window, const bf16 *sinks,
                               const bf16 *q, const bf16 *k, const bf16 *v, const bf16 *a, const float *lse,
                               const bf16 *da, float *dq, float *dk, float *dv, float *dsinks, void *workspace,
                               mt_cuda_stream stream)
{
    mt_cuda_attention_backward_ex(ctx, m->B, m->T, m->H, m->KV, m->D, window,
                                  reinterpret_cast<const mt_cuda_bf16 *>(sinks),
                                  reinterpret_cast<const mt_cuda_bf16 *>(q),
                                  reinterpret_cast<const mt_cuda_bf16 *>(k),
                                  reinterpret_cast<const mt_cuda_bf16 *>(v),
                                  reinterpret_cast<const mt_cuda_bf16 *>(a), lse,
                                  reinterpret_cast<const mt_cuda_bf16 *>(da), dq, dk, dv, dsinks, workspace, stream);
}

static void attention_backward(mt_cuda_ctx *, const mt_layer_dims *m, int64_t window, const float *sinks,
                               const float *q, const float *k, const float *v, const float *a, const float *lse,
                               const float *da, float *dq, float *dk, float *dv, float *dsinks, void *workspace,
                               mt_cuda_stream stream)
{
    mt_cuda_attention_backward_f32_ex(m->B, m->T, m->H, m->KV, m->D, window, sinks, q, k, v, a, lse, da, dq, dk, dv,
                                      dsinks, workspace, stream);
}

// ---- saved: what backward needs, written by a forward given `saved` ----
// fp32: x (n,d) h (n,d) rms1 (n) rms2 (n) lse (B,H,T) [qk_norm: qrms (n*H) krms (n*KV)]
// E (the operand type): q k (after RoPE) (n,H*D) (n,KV*D), v (n,KV*D), a (n,H*D)
//       [qk_norm: qpre (n,H*D) kpre (n,KV*D), the projections before the norm]
// then the MLP's: a dense layer's g u (n,I) E (none with cfg->mlp_chunk: recomputed chunk by
// chunk in backward), or a sparse layer's MoE set (moe.cuh), in one region sized for the larger
// kind of layer the model has.
// xn and hn are recomputed from x, h and the saved inv_rms; s = swiglu(g, u) likewise.
template <class E> struct layer_saved {
    float *x, *h, *rms1, *rms2, *lse, *qrms, *krms;
    E *q, *k, *v, *a, *qpre, *kpre;
    E *g, *u;               // dense
    mt_moe_saved<E> moe;    // sparse
};

// The kinds of layer the model has: the carves size the MLP regions for both when it has both.
static bool has_dense(const mt_model_config *cfg) { return mt_config_has_dense_layers(cfg); }
static bool has_sparse(const mt_model_config *cfg) { return mt_config_sparse_layers(cfg) > 0; }

// Ends the overlay of two alternatives that started at the same offset: past the longer one.
static void overlay_end(mt_carve *c, size_t other_end)
{
    if (other_end > c->offset) c->offset = other_end;
}

template <class E>
static void saved_carve(const mt_model_config *cfg, const mt_layer_dims *m, mt_carve *c, layer_saved<E> *s)
{
    const int64_t n = m->n;
    s->x = mt_take<float>(c, n * m->d);
    s->h = mt_take<float>(c, n * m->d);
    s->rms1 = mt_take<float>(c, n);
    s->rms2 = mt_take<float>(c, n);
    s->lse = mt_take<float>(c, n * m->H);
    s->qrms = cfg->qk_norm ? mt_take<float>(c, n * m->H) : nullptr;
    s->krms = cfg->qk_norm ? mt_take<float>(c, n * m->KV) : nullptr;
    s->q = mt_take<E>(c, n * m->qd);
    s->k = mt_take<E>(c, n * m->kvd);
    s->v = mt_take<E>(c, n * m->kvd);
    s->a = mt_take<E>(c, n * m->qd);
    s->qpre = cfg->qk_norm ? mt_take<E>(c, n * m->qd) : nullptr;
    s->kpre = cfg->qk_norm ? mt_take<E>(c, n * m->kvd) : nullptr;
    const size_t mlp = c->offset;
    const bool kept = has_dense(cfg) && !mt_config_mlp_chunked(cfg);
    s->g = kept ? mt_take<E>(c, n * m->inter) : nullptr;
    s->u = kept ? mt_take<E>(c, n * m->inter) : nullptr;
    const size_t dense_end = c->offset;
    c->offset = mlp;
    memset(&s->moe, 0, sizeof s->moe);
    if (has_sparse(cfg)) mt_moe_saved_carve(cfg, n, c, &s->moe);
    overlay_end(c, dense_end);
}

// ---- scratch of forward: [the saved set, used only when the caller passes none] xn/hn, then s or
//      the MoE block's scratch, rope
// ---- scratch of backward: norm_out, dnorm, dres, rope, partials, then the MLP gradients (dense,
//      or the MoE block's scratch) overlaid by the attention gradients (the MLP ones are dead
//      before attention backward starts).
template <class E> struct layer_fwd_scratch {
    layer_saved<E> keep;  // stands in for `saved` when it is NULL
    E *xn;                // (n, d) normed x, later normed h (hn)
    E *s;                 // (c, I) swiglu output (dense; c = mt_config_mlp_rows)
    E *g_c, *u_c;         // (c, I) gate and up when they are not kept (dense, mlp_chunk)
    void *moe;            // the MoE block's forward scratch (sparse)
    float *cos_t, *sin_t; // (T, D/2) RoPE tables
};

template <class E> struct layer_bwd_scratch {
    E *norm_out;          // (n, d) hn, later xn (recomputed)
    float *dnorm;         // (n, d) gradient at the norm output: dhn, later dxn
    E *dres;              // (n, d) the residual-stream gradient as E: dy, later dh
    float *cos_t, *sin_t; // (T, D/2)
    float *partials;      // column-sum partials, widest of d and H*D
    // MLP phase
    E *s_dg;   // (c, I) s (recomputed), then dg (dense; c = mt_config_mlp_rows)
    E *du;     // (c, I) (dense)
    float *ds; // (c, I) gradient at the swiglu output (dense)
    E *g_re, *u_re; // (c, I) gate and up recomputed (dense, mlp_chunk)
    void *moe; // the MoE block's backward scratch (sparse)
    // attention phase, overlaying the MLP phase
    E *da_dqp;            // (n, H*D) gradient at the attention output, then at q's projection
    E *dkp, *dvb;         // (n, KV*D) gradients at k's projection and v, E for the GEMMs (dvb
                          // empty when E is float: dv is that already)
    float *dq, *dk, *dv;  // (n, H*D) (n, KV*D) (n, KV*D) from attention backward
    float *dqp32, *dkp32; // (n, H*D) (n, KV*D) fp32 gradients at q's and k's projections: the
                          // bias gradients sum them (bf16 would lose the cancelling sums' digits);
                          // empty when E is float: da_dqp and dkp are those gradients already
    void *attn_workspace; // attention_workspace_bytes<E>
};

template <class E>
static void fwd_carve(const mt_model_config *cfg, const mt_layer_dims *m, mt_carve *c, layer_fwd_scratch<E> *s)
{
    saved_carve(cfg, m, c, &s->keep);
    s->xn = mt_take<E>(c, m->n * m->d);
    const size_t mlp = c->offset;
    const int64_t rows = mt_config_mlp_rows(cfg, m->n);
    const bool chunked = has_dense(cfg) && mt_config_mlp_chunked(cfg);
    s->s = has_dense(cfg) ? mt_take<E>(c, rows * m->inter) : nullptr;
    s->g_c = chunked ? mt_take<E>(c, rows * m->inter) : nullptr;
    s->u_c = chunked ? mt_take<E>(c, rows * m->inter) : nullptr;
    const size_t dense_end = c->offset;
    c->offset = mlp;
    s->moe = has_sparse(cfg) ? mt_take<char>(c, (int64_t)mt_moe_forward_scratch_bytes<E>(cfg, m->n)) : nullptr;
    overlay_end(c, dense_end);
    s->cos_t = mt_take<float>(c, m->T * m->half);
    s->sin_t = mt_take<float>(c, m->T * m->half);
}

template <class E>
static void bwd_carve(const mt_model_config *cfg, const mt_layer_dims *m, mt_carve *c, layer_bwd_scratch<E> *s)
{
    const int64_t n = m->n;
    s->norm_out = mt_take<E>(c, n * m->d);
    s->dnorm = mt_take<float>(c, n * m->d);
    s->dres = mt_take<E>(c, n * m->d);
    s->cos_t = mt_take<float>(c, m->T * m->half);
    s->sin_t = mt_take<float>(c, m->T * m->half);
    s->partials = (float *)mt_take<char>(c, (int64_t)mt_colsum_partials_bytes(m->d > m->qd ? m->d : m->qd));
    const size_t region = c->offset;
    const int64_t dense_inter = has_dense(cfg) ? m->inter : 0, rows = mt_config_mlp_rows(cfg, n);
    const bool chunked = has_dense(cfg) && mt_config_mlp_chunked(cfg);
    s->s_dg = mt_take<E>(c, rows * dense_inter);
    s->du = mt_take<E>(c, rows * dense_inter);
    s->ds = mt_take<float>(c, rows * dense_inter);
    s->g_re = chunked ? mt_take<E>(c, rows * m->inter) : nullptr;
    s->u_re = chunked ? mt_take<E>(c, rows * m->inter) : nullptr;
    const size_t dense_end = c->offset;
    c->offset = region;
    s->moe = has_sparse(cfg) ? mt_take<char>(c, (int64_t)mt_moe_backward_scratch_bytes<E>(cfg, n)) : nullptr;
    overlay_end(c, dense_end);
    const size_t mlp_end = c->offset;
    c->offset = region;
    s->da_dqp = mt_take<E>(c, n * m->qd);
    s->dkp = mt_take<E>(c, n * m->kvd);
    const bool e_is_f32 = std::is_same<E, float>::value;
    s->dvb = mt_take<E>(c, e_is_f32 ? 0 : n * m->kvd);
    s->dq = mt_take<float>(c, n * m->qd);
    s->dk = mt_take<float>(c, n * m->kvd);
    s->dv = mt_take<float>(c, n * m->kvd);
    s->dqp32 = mt_take<float>(c, e_is_f32 ? 0 : n * m->qd);
    s->dkp32 = mt_take<float>(c, e_is_f32 ? 0 : n * m->kvd);
    s->attn_workspace = mt_take<char>(c, (int64_t)attention_workspace_bytes<E>(m));
    if (mlp_end > c->offset) c->offset = mlp_end;
}

template <class E> static size_t saved_bytes(const mt_model_config *cfg, int64_t B, int64_t T)
{
    const mt_layer_dims m = mt_layer_dims_of(cfg, B, T);
    mt_carve c = {nullptr, 0};
    layer_saved<E> s;
    saved_carve(cfg, &m, &c, &s);
    return mt_carve_size(&c);
}

template <class E> static size_t scratch_bytes(const mt_model_config *cfg, int64_t B, int64_t T)
{
    const mt_layer_dims m = mt_layer_dims_of(cfg, B, T);
    mt_carve f = {nullptr, 0}, b = {nullptr, 0};
    layer_fwd_scratch<E> fs;
    layer_bwd_scratch<E> bs;
    fwd_carve(cfg, &m, &f, &fs);
    bwd_carve(cfg, &m, &b, &bs);
    const size_t fb = mt_carve_size(&f), bb = mt_carve_size(&b);
    return fb > bb ? fb : bb;
}

extern "C" size_t mt_cuda_layer_saved_bytes(const mt_model_config *cfg, mt_cuda_prec prec, int64_t B, int64_t T)
{
    return prec == MT_CUDA_F32 ? saved_bytes<float>(cfg, B, T) : saved_bytes<bf16>(cfg, B, T);
}

extern "C" size_t mt_cuda_layer_scratch_bytes(const mt_model_config *cfg, mt_cuda_prec prec, int64_t B, int64_t T)
{
    return prec == MT_CUDA_F32 ? scratch_bytes<float>(cfg, B, T) : scratch_bytes<bf16>(cfg, B, T);
}

// ---- forward ----

template <class E>
static void layer_forward(mt_cuda_ctx *ctx, const mt_model_config *cfg, const mt_tile_layout *layout, const E *tile,
                          int64_t layer, int64_t B, int64_t T, const float *x, float *y, void *saved, void *scratch,
                          double *router_stats, mt_cuda_stream stream_)
{
    const cudaStream_t stream = as_stream(stream_);
    const mt_layer_dims m = mt_layer_dims_of(cfg, B, T);
    const int64_t n = m.n;
    const bool sparse = mt_layout_is_sparse(layout);
    mt_layer_check(cfg, layout, &m);
    if (sparse) mt_moe_check(cfg, layout, n);
    if (n <= 0) return;

    mt_carve sc = {(char *)scratch, 0};
    layer_fwd_scratch<E> fs;
    fwd_carve(cfg, &m, &sc, &fs);
    layer_saved<E> sv = fs.keep;
    if (saved) {
        mt_carve c = {(char *)saved, 0};
        saved_carve(cfg, &m, &c, &sv);
        CUDA_CHECK(cudaMemcpyAsync(sv.x, x, (size_t)(n * m.d) * sizeof(float), cudaMemcpyDeviceToDevice, stream));
    }

    // Attention block: h = x + attn(rope(q), rope(k), v) Wo^T.
    mt_rmsnorm_forward(n, m.d, x, mt_tile_norm(layout, tile, MT_L_ATTN_NORM), cfg->rms_eps, fs.xn, sv.rms1, stream);
    E *q_proj = cfg->qk_norm ? sv.qpre : sv.q; // (n, H*D)
    E *k_proj = cfg->qk_norm ? sv.kpre : sv.k; // (n, KV*D)
    mt_linear_forward(ctx, n, m.d, m.qd, fs.xn, weight(layout, tile, MT_L_Q_W), weight(layout, tile, MT_L_Q_B),
                      q_proj, mt_cuda_type<E>(), stream);
    mt_linear_forward(ctx, n, m.d, m.kvd, fs.xn, weight(layout, tile, MT_L_K_W), weight(layout, tile, MT_L_K_B),
                      k_proj, mt_cuda_type<E>(), stream);
    mt_linear_forward(ctx, n, m.d, m.kvd, fs.xn, weight(layout, tile, MT_L_V_W), weight(layout, tile, MT_L_V_B),
                      sv.v, mt_cuda_type<E>(), stream);
    mt_layer_rope_tables(cfg, &m, fs.cos_t, fs.sin_t, stream);
    mt_layer_qk_rope_forward(cfg, &m, q_proj, k_proj, sv.q, sv.k, mt_tile_norm(layout, tile, MT_L_Q_NORM),
                             mt_tile_norm(layout, tile, MT_L_K_NORM), sv.qrms, sv.krms, fs.cos_t, fs.sin_t, stream);
    attention_forward(ctx, &m, mt_config_layer_window(cfg, layer), weight(layout, tile, MT_L_SINKS), sv.q, sv.k, sv.v,
                      sv.a, sv.lse, stream_); // a (n, H*D)
    mt_linear_forward_residual(ctx, n, m.qd, m.d, sv.a, weight(layout, tile, MT_L_O_W), x, sv.h, stream);
    if (weight(layout, tile, MT_L_O_B)) mt_layer_add_bias(n, m.d, weight(layout, tile, MT_L_O_B), sv.h, stream);

    // MLP block: y = h + swiglu(hn Wg^T, hn Wu^T) Wd^T, or y = h + MoE(hn).
    E *hn = fs.xn; // xn is dead once q/k/v are projected
    mt_rmsnorm_forward(n, m.d, sv.h, mt_tile_norm(layout, tile, MT_L_MLP_NORM), cfg->rms_eps, hn, sv.rms2, stream);
    if (sparse) {
        mt_moe_forward(ctx, cfg, layout, tile, n, hn, sv.h, y, &sv.moe, router_stats, fs.moe, stream);
        return;
    }
    // c rows at a time (all n without mlp_chunk): g and u into `saved`, or scratch when not kept
    const cudaDataType_t e_type = mt_cuda_type<E>();
    const int64_t c_rows = mt_config_mlp_rows(cfg, n);
    const bool keep = !mt_config_mlp_chunked(cfg);
    for (int64_t r0 = 0; r0 < n; r0 += c_rows) {
        const int64_t rows = n - r0 < c_rows ? n - r0 : c_rows;
        E *g = keep ? sv.g + r0 * m.inter : fs.g_c, *u = keep ? sv.u + r0 * m.inter : fs.u_c;
        mt_linear_forward(ctx, rows, m.d, m.inter, hn + r0 * m.d, weight(layout, tile, MT_L_GATE_W), nullptr, g,
                          e_type, stream);
        mt_linear_forward(ctx, rows, m.d, m.inter, hn + r0 * m.d, weight(layout, tile, MT_L_UP_W), nullptr, u, e_type,
                          stream);
        mt_layer_swiglu_forward(rows * m.inter, g, u, fs.s, stream);
        mt_linear_forward_residual(ctx, rows, m.inter, m.d, fs.s, weight(layout, tile, MT_L_DOWN_W), sv.h + r0 * m.d,
                                   y + r0 * m.d, stream);
    }
}

// ---- backward ----

template <class E>
static void layer_backward(mt_cuda_ctx *ctx, const mt_model_config *cfg, const mt_tile_layout *layout, const E *tile,
                           int64_t layer, int64_t B, int64_t T, const void *saved, const float *dy, float *dx,
                           float *dtile, bool accumulate, void *scratch, const double *aux_counts, double aux_scale,
                           mt_cuda_stream stream_)
{
    const cudaStream_t stream = as_stream(stream_);
    const mt_layer_dims m = mt_layer_dims_of(cfg, B, T);
    const int64_t n = m.n;
    const bool sparse = mt_layout_is_sparse(layout);
    mt_layer_check(cfg, layout, &m);
    if (sparse) mt_moe_check(cfg, layout, n);

    // `=` is "+= onto zeros": one memset also zeroes the padding between tensors, which the host
    // tile expects to stay 0. Every weight gradient below then accumulates.
    if (!accumulate) CUDA_CHECK(cudaMemsetAsync(dtile, 0, (size_t)layout->numel * sizeof(float), stream));
    if (n <= 0) return;

    layer_saved<E> sv;
    mt_carve c = {(char *)saved, 0};
    saved_carve(cfg, &m, &c, &sv);
    mt_carve sc = {(char *)scratch, 0};
    layer_bwd_scratch<E> s;
    bwd_carve(cfg, &m, &sc, &s);

    // MLP block.
    const float *mlp_norm_w = mt_tile_norm(layout, tile, MT_L_MLP_NORM);
    mt_rmsnorm_apply(n, m.d, sv.h, mlp_norm_w, sv.rms2, s.norm_out, stream); // hn (n, d)
    mt_cuda_from_f32(dy, s.dres, n * m.d, stream); // dy as E (n, d)
    if (sparse) {
        mt_moe_backward(ctx, cfg, layout, tile, n, s.norm_out, &sv.moe, s.dres, aux_counts, aux_scale, s.dnorm,
                        dtile, s.moe, stream); // dhn (n, d)
    } else {
        // c rows at a time (all n without mlp_chunk), g and u recomputed when not kept; the weight
        // gradients accumulate over the chunks
        const int64_t c_rows = mt_config_mlp_rows(cfg, n);
        const bool recompute = mt_config_mlp_chunked(cfg);
        const cudaDataType_t e_type = mt_cuda_type<E>();
        for (int64_t r0 = 0; r0 < n; r0 += c_rows) {
            const int64_t rows = n - r0 < c_rows ? n - r0 : c_rows;
            const E *hn = s.norm_out + r0 * m.d, *dres = s.dres + r0 * m.d;
            E *g = recompute ? s.g_re : sv.g + r0 * m.inter, *u = recompute ? s.u_re : sv.u + r0 * m.inter;
            if (recompute) {
                mt_linear_forward(ctx, rows, m.d, m.inter, hn, weight(layout, tile, MT_L_GATE_W), nullptr, g, e_type,
                                  stream);
                mt_linear_forward(ctx, rows, m.d, m.inter, hn, weight(layout, tile, MT_L_UP_W), nullptr, u, e_type,
                                  stream);
            }
            mt_layer_swiglu_forward(rows * m.inter, g, u, s.s_dg, stream);
            mt_linear_backward_weight(ctx, rows, m.inter, m.d, s.s_dg, dres, grad(layout, dtile, MT_L_DOWN_W), true,
                                      stream);
            mt_linear_backward_input(ctx, rows, m.inter, m.d, dres, weight(layout, tile, MT_L_DOWN_W), s.ds,
                                     CUDA_R_32F, false, stream); // ds (c, I)
            mt_layer_swiglu_backward(rows * m.inter, g, u, s.ds, s.s_dg, s.du, stream); // dg, du (c, I)
            mt_linear_backward_weight(ctx, rows, m.d, m.inter, hn, s.s_dg, grad(layout, dtile, MT_L_GATE_W), true,
                                      stream);
            mt_linear_backward_weight(ctx, rows, m.d, m.inter, hn, s.du, grad(layout, dtile, MT_L_UP_W), true, stream);
            mt_linear_backward_input(ctx, rows, m.d, m.inter, s.s_dg, weight(layout, tile, MT_L_GATE_W),
                                     s.dnorm + r0 * m.d, CUDA_R_32F, false, stream);
            mt_linear_backward_input(ctx, rows, m.d, m.inter, s.du, weight(layout, tile, MT_L_UP_W),
                                     s.dnorm + r0 * m.d, CUDA_R_32F, true, stream); // dhn (c, d)
        }
    }
    // dx holds dh = dy + the norm's share (and dres its copy as E for the o_proj GEMMs).
    mt_rmsnorm_backward<E>(n, m.d, sv.h, mlp_norm_w, sv.rms2, s.dnorm, dy, dx, s.dres, stream);
    mt_rmsnorm_backward_weight(n, m.d, sv.h, sv.rms2, s.dnorm, grad(layout, dtile, MT_L_MLP_NORM), true, s.partials,
                               stream);

    // Attention block. o_proj's bias gradient: the column sums of dh.
    if (grad(layout, dtile, MT_L_O_B)) mt_layer_bias_grad(n, m.d, dx, grad(layout, dtile, MT_L_O_B), s.partials, stream);
    mt_linear_backward_weight(ctx, n, m.qd, m.d, sv.a, s.dres, grad(layout, dtile, MT_L_O_W), true, stream);
    mt_linear_backward_input(ctx, n, m.qd, m.d, s.dres, weight(layout, tile, MT_L_O_W), s.da_dqp, mt_cuda_type<E>(),
                             false, stream); // da (n, H*D)
    attention_backward(ctx, &m, mt_config_layer_window(cfg, layer), weight(layout, tile, MT_L_SINKS), sv.q, sv.k, sv.v,
                       sv.a, sv.lse, s.da_dqp, s.dq, s.dk, s.dv, grad(layout, dtile, MT_L_SINKS), s.attn_workspace,
                       stream_);
    mt_layer_rope_tables(cfg, &m, s.cos_t, s.sin_t, stream);
    E *dq_proj = s.da_dqp; // da is dead once attention backward has run
    // The bias gradients' fp32 inputs: dq_proj and dkp themselves when E is float, else copies.
    const bool e_is_f32 = std::is_same<E, float>::value, copies = cfg->qkv_bias && !e_is_f32;
    const float *dq_bias = e_is_f32 ? reinterpret_cast<const float *>(dq_proj) : s.dqp32;
    const float *dk_bias = e_is_f32 ? reinterpret_cast<const float *>(s.dkp) : s.dkp32;
    mt_layer_qk_rope_backward(cfg, &m, s.dq, s.dk, sv.qpre, sv.kpre, mt_tile_norm(layout, tile, MT_L_Q_NORM),
                              mt_tile_norm(layout, tile, MT_L_K_NORM), sv.qrms, sv.krms, dq_proj, s.dkp, s.cos_t, s.sin_t,
                              copies ? s.dqp32 : nullptr, copies ? s.dkp32 : nullptr, stream);
    if (cfg->qk_norm)
        mt_layer_qk_norm_weight_grads(&m, s.dq, s.dk, grad(layout, dtile, MT_L_Q_NORM),
                                      grad(layout, dtile, MT_L_K_NORM), s.partials, stream);
    // dv as E for the GEMMs: dv itself when E is float
    const E *dv_e = e_is_f32 ? reinterpret_cast<const E *>(s.dv) : s.dvb;
    if (!e_is_f32) mt_cuda_from_f32(s.dv, s.dvb, n * m.kvd, stream);
    if (cfg->qkv_bias)
        mt_layer_qkv_bias_grads(&m, dq_bias, dk_bias, s.dv, grad(layout, dtile, MT_L_Q_B),
                                grad(layout, dtile, MT_L_K_B), grad(layout, dtile, MT_L_V_B), s.partials, stream);
    const float *attn_norm_w = mt_tile_norm(layout, tile, MT_L_ATTN_NORM);
    mt_rmsnorm_apply(n, m.d, sv.x, attn_norm_w, sv.rms1, s.norm_out, stream); // xn (n, d)
    mt_linear_backward_weight(ctx, n, m.d, m.qd, s.norm_out, dq_proj, grad(layout, dtile, MT_L_Q_W), true, stream);
    mt_linear_backward_weight(ctx, n, m.d, m.kvd, s.norm_out, s.dkp, grad(layout, dtile, MT_L_K_W), true, stream);
    mt_linear_backward_weight(ctx, n, m.d, m.kvd, s.norm_out, dv_e, grad(layout, dtile, MT_L_V_W), true, stream);
    mt_linear_backward_input(ctx, n, m.d, m.qd, dq_proj, weight(layout, tile, MT_L_Q_W), s.dnorm, CUDA_R_32F, false,
                             stream);
    mt_linear_backward_input(ctx, n, m.d, m.kvd, s.dkp, weight(layout, tile, MT_L_K_W), s.dnorm, CUDA_R_32F, true,
                             stream);
    mt_linear_backward_input(ctx, n, m.d, m.kvd, dv_e, weight(layout, tile, MT_L_V_W), s.dnorm, CUDA_R_32F, true,
                             stream); // dxn (n, d)
    // dx = dh (residual) + the attention norm's share, in place.
    mt_rmsnorm_backward<E>(n, m.d, sv.x, attn_norm_w, sv.rms1, s.dnorm, dx, dx, nullptr, stream);
    mt_rmsnorm_backward_weight(n, m.d, sv.x, sv.rms1, s.dnorm, grad(layout, dtile, MT_L_ATTN_NORM), true, s.partials,
                               stream);
}
// ---- the entry points: one instantiation per precision ----

extern "C" void mt_cuda_layer_forward_aux(mt_cuda_ctx *ctx, const mt_model_config *cfg, const mt_tile_layout *layout,
                                          mt_cuda_prec prec, const void *tile, int64_t layer, int64_t B, int64_t T,
                                          const float *x, float *y, void *saved, void *scratch, double *router_stats,
                                          mt_cuda_stream stream)
{
    if (prec == MT_CUDA_F32)
        layer_forward(ctx, cfg, layout, (const float *)tile, layer, B, T, x, y, saved, scratch, router_stats, stream);
    else
        layer_forward(ctx, cfg, layout, (const bf16 *)tile, layer, B, T, x, y, saved, scratch, router_stats, stream);
}

extern "C" void mt_cuda_layer_forward(mt_cuda_ctx *ctx, const mt_model_config *cfg, const mt_tile_layout *layout,
                                      mt_cuda_prec prec, const void *tile, int64_t B, int64_t T, const float *x,
                                      float *y, void *saved, void *scratch, mt_cuda_stream stream)
{
    mt_cuda_layer_forward_aux(ctx, cfg, layout, prec, tile, 0, B, T, x, y, saved, scratch, nullptr, stream);
}

extern "C" void mt_cuda_layer_backward_aux(mt_cuda_ctx *ctx, const mt_model_config *cfg, const mt_tile_layout *layout,
                                           mt_cuda_prec prec, const void *tile, int64_t layer, int64_t B, int64_t T,
                                           const void *saved, const float *dy, float *dx, float *dtile,
                                           bool accumulate, void *scratch, const double *aux_counts, double aux_scale,
                                           mt_cuda_stream stream)
{
    if (prec == MT_CUDA_F32)
        layer_backward(ctx, cfg, layout, (const float *)tile, layer, B, T, saved, dy, dx, dtile, accumulate, scratch,
                       aux_counts, aux_scale, stream);
    else
        layer_backward(ctx, cfg, layout, (const bf16 *)tile, layer, B, T, saved, dy, dx, dtile, accumulate, scratch,
                       aux_counts, aux_scale, stream);
}

extern "C" void mt_cuda_layer_backward(mt_cuda_ctx *ctx, const mt_model_config *cfg, const mt_tile_layout *layout,
                                       mt_cuda_prec prec, const void *tile, int64_t B, int64_t T, const void *saved,
                                       const float *dy, float *dx, float *dtile, bool accumulate, void *scratch,
                                       mt_cuda_stream stream)
{
    mt_cuda_layer_backward_aux(ctx, cfg, layout, prec, tile, 0, B, T, saved, dy, dx, dtile, accumulate, scratch,
                               nullptr, 0.0, stream);
}
