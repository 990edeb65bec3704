// One pre-norm decoder layer on the GPU (Llama, Mistral, Qwen2 with q/k/v bias, Qwen3 with q/k
// RMSNorm), forward and backward, mirroring backends/cpu/layer.inc step by step. The residual
// stream is fp32; every GEMM input is of the operand type E (bf16, or float on the fp32 path;
// fp32 accumulation either way); norm statistics are fp32. Each step is a template on E.
// Fused here: q/k-norm + RoPE on q and k in one launch (and their backward with the cast to E);
// rmsnorm + cast to E; the residual adds ride in the o/down GEMM epilogues; bias adds in q/k/v's.
extern "C" { // C headers without their own linkage guards
#include "backends/cpu/ops.h" // mt_rope_inv_freq: the same double frequencies as the CPU path
}

#include <type_traits>

#include "backends/cuda/attention_f32.h"
#include "backends/cuda/bench.cuh"
#include "backends/cuda/colsum.cuh"
#include "backends/cuda/linear.cuh"
#include "backends/cuda/rmsnorm.cuh"

#define LAYER_MAX_HEAD_DIM 256 // RoPE pairs held in registers: 4 per lane of a warp
#define ROPE_PAIRS_PER_LANE (LAYER_MAX_HEAD_DIM / 2 / 32)

typedef struct layer_dims {
    int64_t B, T, n, d, H, KV, D, inter, qd, kvd, half; // inter = I, qd = H*D, kvd = KV*D, half = D/2
} layer_dims;

static layer_dims layer_dims_of(const mt_model_config *cfg, int64_t B, int64_t T)
{
    layer_dims m;
    m.B = B;
    m.T = T;
    m.n = B * T;
    m.d = cfg->hidden;
    m.H = cfg->heads;
    m.KV = cfg->kv_heads;
    m.D = cfg->head_dim;
    m.inter = cfg->intermediate;
    m.qd = m.H * m.D;
    m.kvd = m.KV * m.D;
    m.half = m.D / 2;
    return m;
}

static void layer_check(const mt_model_config *cfg, const mt_tile_layout *layout, const layer_dims *m)
{
    MT_CUDA_REQUIRE(layout->kind == MT_TILE_LAYER, "layer launcher given a non-layer tile layout");
    MT_CUDA_REQUIRE(m->D % 2 == 0 && m->D <= LAYER_MAX_HEAD_DIM, "head_dim %lld: must be even and <= %d",
                    (long long)m->D, LAYER_MAX_HEAD_DIM);
    MT_CUDA_REQUIRE(m->KV > 0 && m->H % m->KV == 0, "heads %lld not a multiple of kv_heads %lld", (long long)m->H,
                    (long long)m->KV);
    MT_CUDA_REQUIRE(!cfg->qk_norm || layout->tensors[MT_L_Q_NORM].numel == m->D, "q_norm size != head_dim");
}

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

template <class E> static size_t attention_workspace_bytes(const layer_dims *m);
template <> size_t attention_workspace_bytes<bf16>(const layer_dims *m)
{
    return mt_cuda_attention_workspace_bytes(m->B, m->T, m->H, m->KV, m->D);
}
template <> size_t attention_workspace_bytes<float>(const layer_dims *m)
{
    return mt_cuda_attention_f32_workspace_bytes(m->B, m->T, m->H, m->KV, m->D);
}

static void attention_forward(const layer_dims *m, const bf16 *q, const bf16 *k, const bf16 *v, bf16 *a, float *lse,
                              mt_cuda_stream stream)
{
    mt_cuda_attention_forward(m->B, m->T, m->H, m->KV, m->D, reinterpret_cast<const mt_cuda_bf16 *>(q),
                              reinterpret_cast<const mt_cuda_bf16 *>(k), reinterpret_cast<const mt_cuda_bf16 *>(v),
                              reinterpret_cast<mt_cuda_bf16 *>(a), lse, stream);
}

static void attention_forward(const layer_dims *m, const float *q, const float *k, const float *v, float *a,
                              float *lse, mt_cuda_stream stream)
{
    mt_cuda_attention_forward_f32(m->B, m->T, m->H, m->KV, m->D, q, k, v, a, lse, stream);
}

static void attention_backward(const layer_dims *m, const bf16 *q, const bf16 *k, const bf16 *v, const bf16 *a,
                               const float *lse, const bf16 *da, float *dq, float *dk, float *dv, void *workspace,
                               mt_cuda_stream stream)
{
    mt_cuda_attention_backward(m->B, m->T, m->H, m->KV, m->D, reinterpret_cast<const mt_cuda_bf16 *>(q),
                               reinterpret_cast<const mt_cuda_bf16 *>(k), reinterpret_cast<const mt_cuda_bf16 *>(v),
                               reinterpret_cast<const mt_cuda_bf16 *>(a), lse,
                               reinterpret_cast<const mt_cuda_bf16 *>(da), dq, dk, dv, workspace, stream);
}

static void attention_backward(const layer_dims *m, const float *q, const float *k, const float *v, const float *a,
                               const float *lse, const float *da, float *dq, float *dk, float *dv, void *workspace,
                               mt_cuda_stream stream)
{
    mt_cuda_attention_backward_f32(m->B, m->T, m->H, m->KV, m->D, q, k, v, a, lse, da, dq, dk, dv, workspace, stream);
}

// ---- saved: what backward needs, written by a forward given `saved` ----
// fp32: x (n,d) h (n,d) rms1 (n) rms2 (n) lse (B,H,T) [qk_norm: qrms (n*H) krms (n*KV)]
// E (the operand type): q k (after RoPE) (n,H*D) (n,KV*D), v (n,KV*D), a (n,H*D), g u (n,I)
//       [qk_norm: qpre (n,H*D) kpre (n,KV*D), the projections before the norm]
// xn and hn are recomputed from x, h and the saved inv_rms; s = swiglu(g, u) likewise.
template <class E> struct layer_saved {
    float *x, *h, *rms1, *rms2, *lse, *qrms, *krms;
    E *q, *k, *v, *a, *g, *u, *qpre, *kpre;
};

template <class E>
static void saved_carve(const mt_model_config *cfg, const layer_dims *m, mt_carve *c, layer_saved<E> *s)
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
    s->g = mt_take<E>(c, n * m->inter);
    s->u = mt_take<E>(c, n * m->inter);
    s->qpre = cfg->qk_norm ? mt_take<E>(c, n * m->qd) : nullptr;
    s->kpre = cfg->qk_norm ? mt_take<E>(c, n * m->kvd) : nullptr;
}

// ---- scratch of forward: [the saved set, used only when the caller passes none] xn/hn, s, rope
// ---- scratch of backward: norm_out, dnorm, dres, rope, partials, then the MLP gradients overlaid
//      by the attention gradients (the MLP ones are dead before attention backward starts).
template <class E> struct layer_fwd_scratch {
    layer_saved<E> keep;  // stands in for `saved` when it is NULL
    E *xn;                // (n, d) normed x, later normed h (hn)
    E *s;                 // (n, I) swiglu output
    float *cos_t, *sin_t; // (T, D/2) RoPE tables
};

template <class E> struct layer_bwd_scratch {
    E *norm_out;          // (n, d) hn, later xn (recomputed)
    float *dnorm;         // (n, d) gradient at the norm output: dhn, later dxn
    E *dres;              // (n, d) the residual-stream gradient as E: dy, later dh
    float *cos_t, *sin_t; // (T, D/2)
    float *partials;      // column-sum partials, widest of d and H*D
    // MLP phase
    E *s_dg;   // (n, I) s (recomputed), then dg
    E *du;     // (n, I)
    float *ds; // (n, I) gradient at the swiglu output
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
static void fwd_carve(const mt_model_config *cfg, const layer_dims *m, mt_carve *c, layer_fwd_scratch<E> *s)
{
    saved_carve(cfg, m, c, &s->keep);
    s->xn = mt_take<E>(c, m->n * m->d);
    s->s = mt_take<E>(c, m->n * m->inter);
    s->cos_t = mt_take<float>(c, m->T * m->half);
    s->sin_t = mt_take<float>(c, m->T * m->half);
}

template <class E> static void bwd_carve(const layer_dims *m, mt_carve *c, layer_bwd_scratch<E> *s)
{
    const int64_t n = m->n;
    s->norm_out = mt_take<E>(c, n * m->d);
    s->dnorm = mt_take<float>(c, n * m->d);
    s->dres = mt_take<E>(c, n * m->d);
    s->cos_t = mt_take<float>(c, m->T * m->half);
    s->sin_t = mt_take<float>(c, m->T * m->half);
    s->partials = (float *)mt_take<char>(c, (int64_t)mt_colsum_partials_bytes(m->d > m->qd ? m->d : m->qd));
    const size_t region = c->offset;
    s->s_dg = mt_take<E>(c, n * m->inter);
    s->du = mt_take<E>(c, n * m->inter);
    s->ds = mt_take<float>(c, n * m->inter);
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
    const layer_dims m = layer_dims_of(cfg, B, T);
    mt_carve c = {nullptr, 0};
    layer_saved<E> s;
    saved_carve(cfg, &m, &c, &s);
    return mt_carve_size(&c);
}

template <class E> static size_t scratch_bytes(const mt_model_config *cfg, int64_t B, int64_t T)
{
    const layer_dims m = layer_dims_of(cfg, B, T);
    mt_carve f = {nullptr, 0}, b = {nullptr, 0};
    layer_fwd_scratch<E> fs;
    layer_bwd_scratch<E> bs;
    fwd_carve(cfg, &m, &f, &fs);
    bwd_carve(&m, &b, &bs);
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

// ---- RoPE tables: cos/sin of t * inv_freq[j], computed in double and rounded as the CPU does ----

typedef struct rope_freqs {
    double f[LAYER_MAX_HEAD_DIM / 2]; // mt_rope_inv_freq on the host, passed by value (1 KiB)
} rope_freqs;

__global__ static void rope_table_kernel(int64_t T, int64_t half, rope_freqs freqs, float *cos_t, float *sin_t)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < T * half; i += (int64_t)gridDim.x * blockDim.x) {
        const double angle = (double)(i / half) * freqs.f[i % half];
        cos_t[i] = (float)cos(angle);
        sin_t[i] = (float)sin(angle);
    }
}

static void rope_tables(const mt_model_config *cfg, const layer_dims *m, float *cos_t, float *sin_t, cudaStream_t stream)
{
    rope_freqs freqs;
    memset(&freqs, 0, sizeof freqs);
    mt_rope_inv_freq(cfg, freqs.f);
    rope_table_kernel<<<mt_grid_for(m->T * m->half, 256), 256, 0, stream>>>(m->T, m->half, freqs, cos_t, sin_t);
    CUDA_CHECK_LAUNCH();
}

// ---- q/k-norm + RoPE: one warp per (row, head) vector of D, q heads first, then k heads ----

// Which vector a warp owns: source/destination offsets and its position t.
struct qk_vector {
    bool is_q;
    int64_t index; // row * heads + head, in q's or k's numbering
    int64_t t;
};

static __device__ __forceinline__ qk_vector qk_vector_of(int64_t vec, int64_t n, int64_t T, int64_t H, int64_t KV)
{
    qk_vector v;
    v.is_q = vec < n * H;
    v.index = v.is_q ? vec : vec - n * H;
    v.t = (v.index / (v.is_q ? H : KV)) % T;
    return v;
}

// q (n, H*D) and k (n, KV*D): [QKNorm: per-head RMSNorm of the projection, inv_rms saved] then
// the rotation, written as E. src == dst allowed (each lane reads its own pairs first).
template <class E, bool QKNorm>
__global__ static void qk_rope_forward_kernel(int64_t n, int64_t T, int64_t H, int64_t KV, int D, const E *qsrc,
                                              const E *ksrc, E *qdst, E *kdst, const E *qw, const E *kw,
                                              float *qrms, float *krms, double eps, const float *cos_t,
                                              const float *sin_t)
{
    const int64_t vec = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5; // uniform over a warp
    const int lane = threadIdx.x & 31;
    if (vec >= n * (H + KV)) return;
    const qk_vector v = qk_vector_of(vec, n, T, H, KV);
    const int half = D / 2;
    const E *src = (v.is_q ? qsrc : ksrc) + v.index * D;
    E *dst = (v.is_q ? qdst : kdst) + v.index * D;
    float x1[ROPE_PAIRS_PER_LANE], x2[ROPE_PAIRS_PER_LANE];
#pragma unroll
    for (int p = 0; p < ROPE_PAIRS_PER_LANE; p++) {
        const int j = lane + 32 * p;
        x1[p] = j < half ? to_f(src[j]) : 0.f;
        x2[p] = j < half ? to_f(src[j + half]) : 0.f;
    }
    if (QKNorm) {
        double ss = 0;
#pragma unroll
        for (int p = 0; p < ROPE_PAIRS_PER_LANE; p++) ss += (double)x1[p] * x1[p] + (double)x2[p] * x2[p];
        ss = mt_warp_sum(ss);
        const float s = (float)(1.0 / sqrt(ss / (double)D + eps));
        const E *w = v.is_q ? qw : kw;
#pragma unroll
        for (int p = 0; p < ROPE_PAIRS_PER_LANE; p++) {
            const int j = lane + 32 * p;
            if (j < half) {
                x1[p] = x1[p] * s * to_f(w[j]);
                x2[p] = x2[p] * s * to_f(w[j + half]);
            }
        }
        float *rms = v.is_q ? qrms : krms;
        if (rms && lane == 0) rms[v.index] = s;
    }
    const float *ct = cos_t + v.t * half, *st = sin_t + v.t * half;
#pragma unroll
    for (int p = 0; p < ROPE_PAIRS_PER_LANE; p++) {
        const int j = lane + 32 * p;
        if (j < half) {
            const float c = ct[j], s = st[j];
            dst[j] = from_f<E>(x1[p] * c - x2[p] * s);
            dst[j + half] = from_f<E>(x2[p] * c + x1[p] * s);
        }
    }
}

// Backward of the above on dq (n, H*D), dk (n, KV*D) fp32 from attention: the inverse rotation,
// [QKNorm: the norm's input gradient, and dq/dk overwritten with the norm weight's summands
// dy * x * inv_rms for a column sum], written as E gradients at the projections' outputs, and
// as fp32 into dq32/dk32 when those are given (for the bias gradients).
template <class E, bool QKNorm>
__global__ static void qk_rope_backward_kernel(int64_t n, int64_t T, int64_t H, int64_t KV, int D, float *dq, float *dk,
                                               const E *qpre, const E *kpre, const E *qw, const E *kw,
                                               const float *qrms, const float *krms, E *dq_proj, E *dk_proj,
                                               const float *cos_t, const float *sin_t, float *dq32, float *dk32)
{
    const int64_t vec = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (vec >= n * (H + KV)) return;
    const qk_vector v = qk_vector_of(vec, n, T, H, KV);
    const int half = D / 2;
    float *g = (v.is_q ? dq : dk) + v.index * D;
    E *dst = (v.is_q ? dq_proj : dk_proj) + v.index * D;
    float *dst32 = v.is_q ? dq32 : dk32;
    if (dst32) dst32 += v.index * D;
    const float *ct = cos_t + v.t * half, *st = sin_t + v.t * half;
    float y1[ROPE_PAIRS_PER_LANE], y2[ROPE_PAIRS_PER_LANE];
#pragma unroll
    for (int p = 0; p < ROPE_PAIRS_PER_LANE; p++) {
        const int j = lane + 32 * p;
        y1[p] = y2[p] = 0.f;
        if (j < half) {
            const float a = g[j], b = g[j + half], c = ct[j], s = st[j];
            y1[p] = a * c + b * s; // the transpose of the rotation
            y2[p] = b * c - a * s;
        }
    }
    if (!QKNorm) {
#pragma unroll
        for (int p = 0; p < ROPE_PAIRS_PER_LANE; p++) {
            const int j = lane + 32 * p;
            if (j < half) {
                dst[j] = from_f<E>(y1[p]);
                dst[j + half] = from_f<E>(y2[p]);
                if (dst32) {
                    dst32[j] = y1[p];
                    dst32[j + half] = y2[p];
                }
            }
        }
        return;
    }
    const E *x = (v.is_q ? qpre : kpre) + v.index * D;
    const E *w = v.is_q ? qw : kw;
    const float s = (v.is_q ? qrms : krms)[v.index];
    float x1[ROPE_PAIRS_PER_LANE], x2[ROPE_PAIRS_PER_LANE], w1[ROPE_PAIRS_PER_LANE], w2[ROPE_PAIRS_PER_LANE];
    double dot = 0;
#pragma unroll
    for (int p = 0; p < ROPE_PAIRS_PER_LANE; p++) {
        const int j = lane + 32 * p;
        x1[p] = x2[p] = w1[p] = w2[p] = 0.f;
        if (j < half) {
            x1[p] = to_f(x[j]);
            x2[p] = to_f(x[j + half]);
            w1[p] = to_f(w[j]);
            w2[p] = to_f(w[j + half]);
        }
        dot += (double)(w1[p] * y1[p]) * (double)x1[p] + (double)(w2[p] * y2[p]) * (double)x2[p];
    }
    dot = mt_warp_sum(dot);
    const float c = (float)(dot / (double)D) * s * s;
#pragma unroll
    for (int p = 0; p < ROPE_PAIRS_PER_LANE; p++) {
        const int j = lane + 32 * p;
        if (j < half) {
            const float g1 = s * (w1[p] * y1[p] - x1[p] * c), g2 = s * (w2[p] * y2[p] - x2[p] * c);
            dst[j] = from_f<E>(g1);
            dst[j + half] = from_f<E>(g2);
            if (dst32) {
                dst32[j] = g1;
                dst32[j + half] = g2;
            }
            g[j] = y1[p] * x1[p] * s;
            g[j + half] = y2[p] * x2[p] * s;
        }
    }
}

static unsigned qk_blocks(const layer_dims *m)
{
    const int64_t warps = m->n * (m->H + m->KV);
    return (unsigned)((warps * 32 + 255) / 256);
}

// The forward launch: with cfg->qk_norm the per-head norm (qw kw (D), qrms (n*H) krms (n*KV)
// written), else the rotation alone (those four unused).
template <class E>
static void qk_rope_forward(const mt_model_config *cfg, const layer_dims *m, const E *qsrc, const E *ksrc,
                            E *qdst, E *kdst, const E *qw, const E *kw, float *qrms, float *krms,
                            const float *cos_t, const float *sin_t, cudaStream_t stream)
{
    if (cfg->qk_norm)
        qk_rope_forward_kernel<E, true><<<qk_blocks(m), 256, 0, stream>>>(m->n, m->T, m->H, m->KV, (int)m->D, qsrc,
                                                                           ksrc, qdst, kdst, qw, kw, qrms, krms,
                                                                           cfg->rms_eps, cos_t, sin_t);
    else
        qk_rope_forward_kernel<E, false><<<qk_blocks(m), 256, 0, stream>>>(m->n, m->T, m->H, m->KV, (int)m->D, qsrc,
                                                                         ksrc, qdst, kdst, nullptr, nullptr, nullptr,
                                                                         nullptr, cfg->rms_eps, cos_t, sin_t);
    CUDA_CHECK_LAUNCH();
}

// The backward launch, same variants: qpre kpre qw kw qrms krms used only with cfg->qk_norm.
template <class E>
static void qk_rope_backward(const mt_model_config *cfg, const layer_dims *m, float *dq, float *dk, const E *qpre,
                             const E *kpre, const E *qw, const E *kw, const float *qrms, const float *krms,
                             E *dq_proj, E *dk_proj, const float *cos_t, const float *sin_t, float *dq32,
                             float *dk32, cudaStream_t stream)
{
    if (cfg->qk_norm)
        qk_rope_backward_kernel<E, true><<<qk_blocks(m), 256, 0, stream>>>(m->n, m->T, m->H, m->KV, (int)m->D, dq, dk,
                                                                         qpre, kpre, qw, kw, qrms, krms, dq_proj,
                                                                         dk_proj, cos_t, sin_t, dq32, dk32);
    else
        qk_rope_backward_kernel<E, false><<<qk_blocks(m), 256, 0, stream>>>(m->n, m->T, m->H, m->KV, (int)m->D, dq, dk,
                                                                          nullptr, nullptr, nullptr, nullptr, nullptr,
                                                                          nullptr, dq_proj, dk_proj, cos_t, sin_t,
                                                                          dq32, dk32);
    CUDA_CHECK_LAUNCH();
}

// ---- SwiGLU ----

// s (len) = silu(g) * u, E in and out, fp32 math with expf as the CPU's float path.
template <class E>
__global__ static void swiglu_forward_kernel(int64_t len, const E *gate, const E *up, E *out)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < len; i += (int64_t)gridDim.x * blockDim.x) {
        const float g = to_f(gate[i]);
        const float sig = 1.f / (1.f + expf(-g));
        out[i] = from_f<E>(g * sig * to_f(up[i]));
    }
}

// dgate = ds u sig (1 + g (1 - sig)), dup = ds silu(g): E out for the gate/up GEMMs.
// dgate may alias the E buffer s was in (dead by then); ds is fp32.
template <class E>
__global__ static void swiglu_backward_kernel(int64_t len, const E *gate, const E *up, const float *dout,
                                              E *dgate, E *dup)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < len; i += (int64_t)gridDim.x * blockDim.x) {
        const float g = to_f(gate[i]), u = to_f(up[i]), d = dout[i];
        const float sig = 1.f / (1.f + expf(-g));
        dgate[i] = from_f<E>(d * u * sig * (1.f + g * (1.f - sig)));
        dup[i] = from_f<E>(d * g * sig);
    }
}

template <class E> static void swiglu_forward(int64_t len, const E *gate, const E *up, E *out, cudaStream_t stream)
{
    swiglu_forward_kernel<<<mt_grid_for(len, 256), 256, 0, stream>>>(len, gate, up, out);
    CUDA_CHECK_LAUNCH();
}

template <class E>
static void swiglu_backward(int64_t len, const E *gate, const E *up, const float *dout, E *dgate, E *dup,
                            cudaStream_t stream)
{
    swiglu_backward_kernel<<<mt_grid_for(len, 256), 256, 0, stream>>>(len, gate, up, dout, dgate, dup);
    CUDA_CHECK_LAUNCH();
}

// Element (r, j) of a row-major fp32 (R, C) matrix: the q/k-norm weight gradient's summand.
struct f32_element {
    const float *m;
    int64_t C;
    __device__ float operator()(int64_t r, int64_t j) const { return m[r * C + j]; }
};

// q/k-norm weight gradients dqw dkw (D) += column sums of the summands qk_rope_backward left in
// dq (n*H, D) and dk (n*KV, D).
static void qk_norm_weight_grads(const layer_dims *m, const float *dq, const float *dk, float *dqw, float *dkw,
                                 float *partials, cudaStream_t stream)
{
    mt_colsum(f32_element{dq, m->D}, m->n * m->H, m->D, dqw, true, partials, stream);
    mt_colsum(f32_element{dk, m->D}, m->n * m->KV, m->D, dkw, true, partials, stream);
}

// q/k/v bias gradients dqb (H*D), dkb dvb (KV*D) += column sums of the fp32 gradients at the
// projections' outputs dq32 (n, H*D), dk32 dv (n, KV*D).
static void qkv_bias_grads(const layer_dims *m, const float *dq32, const float *dk32, const float *dv, float *dqb,
                           float *dkb, float *dvb, float *partials, cudaStream_t stream)
{
    mt_colsum(f32_element{dq32, m->qd}, m->n, m->qd, dqb, true, partials, stream);
    mt_colsum(f32_element{dk32, m->kvd}, m->n, m->kvd, dkb, true, partials, stream);
    mt_colsum(f32_element{dv, m->kvd}, m->n, m->kvd, dvb, true, partials, stream);
}

// ---- forward ----

template <class E>
static void layer_forward(mt_cuda_ctx *ctx, const mt_model_config *cfg, const mt_tile_layout *layout, const E *tile,
                          int64_t B, int64_t T, const float *x, float *y, void *saved, void *scratch,
                          mt_cuda_stream stream_)
{
    const cudaStream_t stream = as_stream(stream_);
    const layer_dims m = layer_dims_of(cfg, B, T);
    const int64_t n = m.n;
    layer_check(cfg, layout, &m);
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
    mt_rmsnorm_forward(n, m.d, x, weight(layout, tile, MT_L_ATTN_NORM), cfg->rms_eps, fs.xn, sv.rms1, stream);
    E *q_proj = cfg->qk_norm ? sv.qpre : sv.q; // (n, H*D)
    E *k_proj = cfg->qk_norm ? sv.kpre : sv.k; // (n, KV*D)
    mt_linear_forward(ctx, n, m.d, m.qd, fs.xn, weight(layout, tile, MT_L_Q_W), weight(layout, tile, MT_L_Q_B),
                      q_proj, mt_cuda_type<E>(), stream);
    mt_linear_forward(ctx, n, m.d, m.kvd, fs.xn, weight(layout, tile, MT_L_K_W), weight(layout, tile, MT_L_K_B),
                      k_proj, mt_cuda_type<E>(), stream);
    mt_linear_forward(ctx, n, m.d, m.kvd, fs.xn, weight(layout, tile, MT_L_V_W), weight(layout, tile, MT_L_V_B),
                      sv.v, mt_cuda_type<E>(), stream);
    rope_tables(cfg, &m, fs.cos_t, fs.sin_t, stream);
    qk_rope_forward(cfg, &m, q_proj, k_proj, sv.q, sv.k, weight(layout, tile, MT_L_Q_NORM),
                    weight(layout, tile, MT_L_K_NORM), sv.qrms, sv.krms, fs.cos_t, fs.sin_t, stream);
    attention_forward(&m, sv.q, sv.k, sv.v, sv.a, sv.lse, stream_); // a (n, H*D)
    mt_linear_forward_residual(ctx, n, m.qd, m.d, sv.a, weight(layout, tile, MT_L_O_W), x, sv.h, stream);

    // MLP block: y = h + swiglu(hn Wg^T, hn Wu^T) Wd^T.
    E *hn = fs.xn; // xn is dead once q/k/v are projected
    mt_rmsnorm_forward(n, m.d, sv.h, weight(layout, tile, MT_L_MLP_NORM), cfg->rms_eps, hn, sv.rms2, stream);
    const cudaDataType_t e_type = mt_cuda_type<E>();
    mt_linear_forward(ctx, n, m.d, m.inter, hn, weight(layout, tile, MT_L_GATE_W), nullptr, sv.g, e_type, stream);
    mt_linear_forward(ctx, n, m.d, m.inter, hn, weight(layout, tile, MT_L_UP_W), nullptr, sv.u, e_type, stream);
    swiglu_forward(n * m.inter, sv.g, sv.u, fs.s, stream);
    mt_linear_forward_residual(ctx, n, m.inter, m.d, fs.s, weight(layout, tile, MT_L_DOWN_W), sv.h, y, stream);
}

// ---- backward ----

template <class E>
static void layer_backward(mt_cuda_ctx *ctx, const mt_model_config *cfg, const mt_tile_layout *layout, const E *tile,
                           int64_t B, int64_t T, const void *saved, const float *dy, float *dx, float *dtile,
                           bool accumulate, void *scratch, mt_cuda_stream stream_)
{
    const cudaStream_t stream = as_stream(stream_);
    const layer_dims m = layer_dims_of(cfg, B, T);
    const int64_t n = m.n;
    layer_check(cfg, layout, &m);

    // `=` is "+= onto zeros": one memset also zeroes the padding between tensors, which the host
    // tile expects to stay 0. Every weight gradient below then accumulates.
    if (!accumulate) CUDA_CHECK(cudaMemsetAsync(dtile, 0, (size_t)layout->numel * sizeof(float), stream));
    if (n <= 0) return;

    layer_saved<E> sv;
    mt_carve c = {(char *)saved, 0};
    saved_carve(cfg, &m, &c, &sv);
    mt_carve sc = {(char *)scratch, 0};
    layer_bwd_scratch<E> s;
    bwd_carve(&m, &sc, &s);

    // MLP block.
    const E *mlp_norm_w = weight(layout, tile, MT_L_MLP_NORM);
    mt_rmsnorm_apply(n, m.d, sv.h, mlp_norm_w, sv.rms2, s.norm_out, stream); // hn (n, d)
    swiglu_forward(n * m.inter, sv.g, sv.u, s.s_dg, stream);
    mt_cuda_from_f32(dy, s.dres, n * m.d, stream); // dy as E (n, d)
    mt_linear_backward_weight(ctx, n, m.inter, m.d, s.s_dg, s.dres, grad(layout, dtile, MT_L_DOWN_W), true, stream);
    mt_linear_backward_input(ctx, n, m.inter, m.d, s.dres, weight(layout, tile, MT_L_DOWN_W), s.ds, CUDA_R_32F, false,
                             stream); // ds (n, I)
    swiglu_backward(n * m.inter, sv.g, sv.u, s.ds, s.s_dg, s.du, stream); // dg, du (n, I)
    mt_linear_backward_weight(ctx, n, m.d, m.inter, s.norm_out, s.s_dg, grad(layout, dtile, MT_L_GATE_W), true, stream);
    mt_linear_backward_weight(ctx, n, m.d, m.inter, s.norm_out, s.du, grad(layout, dtile, MT_L_UP_W), true, stream);
    mt_linear_backward_input(ctx, n, m.d, m.inter, s.s_dg, weight(layout, tile, MT_L_GATE_W), s.dnorm, CUDA_R_32F,
                             false, stream);
    mt_linear_backward_input(ctx, n, m.d, m.inter, s.du, weight(layout, tile, MT_L_UP_W), s.dnorm, CUDA_R_32F, true,
                             stream); // dhn (n, d)
    // dx holds dh = dy + the norm's share (and dres its copy as E for the o_proj GEMMs).
    mt_rmsnorm_backward(n, m.d, sv.h, mlp_norm_w, sv.rms2, s.dnorm, dy, dx, s.dres, stream);
    mt_rmsnorm_backward_weight(n, m.d, sv.h, sv.rms2, s.dnorm, grad(layout, dtile, MT_L_MLP_NORM), true, s.partials,
                               stream);

    // Attention block.
    mt_linear_backward_weight(ctx, n, m.qd, m.d, sv.a, s.dres, grad(layout, dtile, MT_L_O_W), true, stream);
    mt_linear_backward_input(ctx, n, m.qd, m.d, s.dres, weight(layout, tile, MT_L_O_W), s.da_dqp, mt_cuda_type<E>(),
                             false, stream); // da (n, H*D)
    attention_backward(&m, sv.q, sv.k, sv.v, sv.a, sv.lse, s.da_dqp, s.dq, s.dk, s.dv, s.attn_workspace, stream_);
    rope_tables(cfg, &m, s.cos_t, s.sin_t, stream);
    E *dq_proj = s.da_dqp; // da is dead once attention backward has run
    // The bias gradients' fp32 inputs: dq_proj and dkp themselves when E is float, else copies.
    const bool e_is_f32 = std::is_same<E, float>::value, copies = cfg->qkv_bias && !e_is_f32;
    const float *dq_bias = e_is_f32 ? reinterpret_cast<const float *>(dq_proj) : s.dqp32;
    const float *dk_bias = e_is_f32 ? reinterpret_cast<const float *>(s.dkp) : s.dkp32;
    qk_rope_backward(cfg, &m, s.dq, s.dk, sv.qpre, sv.kpre, weight(layout, tile, MT_L_Q_NORM),
                     weight(layout, tile, MT_L_K_NORM), sv.qrms, sv.krms, dq_proj, s.dkp, s.cos_t, s.sin_t,
                     copies ? s.dqp32 : nullptr, copies ? s.dkp32 : nullptr, stream);
    if (cfg->qk_norm)
        qk_norm_weight_grads(&m, s.dq, s.dk, grad(layout, dtile, MT_L_Q_NORM), grad(layout, dtile, MT_L_K_NORM),
                             s.partials, stream);
    // dv as E for the GEMMs: dv itself when E is float
    const E *dv_e = e_is_f32 ? reinterpret_cast<const E *>(s.dv) : s.dvb;
    if (!e_is_f32) mt_cuda_from_f32(s.dv, s.dvb, n * m.kvd, stream);
    if (cfg->qkv_bias)
        qkv_bias_grads(&m, dq_bias, dk_bias, s.dv, grad(layout, dtile, MT_L_Q_B), grad(layout, dtile, MT_L_K_B),
                       grad(layout, dtile, MT_L_V_B), s.partials, stream);
    const E *attn_norm_w = weight(layout, tile, MT_L_ATTN_NORM);
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
    mt_rmsnorm_backward(n, m.d, sv.x, attn_norm_w, sv.rms1, s.dnorm, dx, dx, nullptr, stream);
    mt_rmsnorm_backward_weight(n, m.d, sv.x, sv.rms1, s.dnorm, grad(layout, dtile, MT_L_ATTN_NORM), true, s.partials,
                               stream);
}
// ---- the entry points: one instantiation per precision ----

extern "C" void mt_cuda_layer_forward(mt_cuda_ctx *ctx, const mt_model_config *cfg, const mt_tile_layout *layout,
                                      mt_cuda_prec prec, const void *tile, int64_t B, int64_t T, const float *x,
                                      float *y, void *saved, void *scratch, mt_cuda_stream stream)
{
    if (prec == MT_CUDA_F32)
        layer_forward(ctx, cfg, layout, (const float *)tile, B, T, x, y, saved, scratch, stream);
    else
        layer_forward(ctx, cfg, layout, (const bf16 *)tile, B, T, x, y, saved, scratch, stream);
}

extern "C" void mt_cuda_layer_backward(mt_cuda_ctx *ctx, const mt_model_config *cfg, const mt_tile_layout *layout,
                                       mt_cuda_prec prec, const void *tile, int64_t B, int64_t T, const void *saved,
                                       const float *dy, float *dx, float *dtile, bool accumulate, void *scratch,
                                       mt_cuda_stream stream)
{
    if (prec == MT_CUDA_F32)
        layer_backward(ctx, cfg, layout, (const float *)tile, B, T, saved, dy, dx, dtile, accumulate, scratch, stream);
    else
        layer_backward(ctx, cfg, layout, (const bf16 *)tile, B, T, saved, dy, dx, dtile, accumulate, scratch, stream);
}

// ---- timings (mt_cuda_bench_memory_kernels, bench.cu) ----
// The layer's memory-bound kernels through the helpers its own code calls, on random buffers of
// one call's shapes, in the order of a forward then a backward. bytes: the least traffic, every
// input read once and every output written once at its element size (n = B*T rows, qk = H*D +
// KV*D elements of q and k per row, heads = H + KV). The residual adds ride in the o and down
// GEMMs' epilogues: no kernel of their own.
void mt_kernel_bench_layer(mt_kernel_bench *b, const mt_model_config *cfg, const mt_tile_layout *layout, int64_t B,
                           int64_t T)
{
    const layer_dims m = layer_dims_of(cfg, B, T);
    layer_check(cfg, layout, &m);
    const int64_t n = m.n, d = m.d, I = m.inter, qk = m.qd + m.kvd, heads = m.H + m.KV;
    const cudaStream_t st = b->stream;
    const bf16 *tile = mt_kernel_bench_random_bf16(b, layout->numel);
    const bf16 *norm_w = weight(layout, tile, MT_L_MLP_NORM);                                    // (d)
    const bf16 *qw = weight(layout, tile, MT_L_Q_NORM), *kw = weight(layout, tile, MT_L_K_NORM); // (D), qk_norm
    // RMSNorm: x (n, d) its input, dy (n, d) the gradient at its output, resid (n, d) the residual
    // stream's gradient, dx (n, d) fp32 and dres (n, d) bf16 the input gradient, xn (n, d) bf16
    // its output, inv_rms (n) set by the forward (timed first), dw (d) the weight gradient.
    float *x = mt_kernel_bench_random_f32(b, n * d), *dy = mt_kernel_bench_random_f32(b, n * d);
    const float *resid = mt_kernel_bench_random_f32(b, n * d);
    float *dx = mt_kernel_bench_random_f32(b, n * d);
    bf16 *dres = (bf16 *)mt_kernel_bench_alloc(b, (size_t)(n * d) * sizeof(bf16));
    bf16 *xn = (bf16 *)mt_kernel_bench_alloc(b, (size_t)(n * d) * sizeof(bf16));
    float *inv_rms = (float *)mt_kernel_bench_alloc(b, (size_t)n * sizeof(float));
    float *dw = mt_kernel_bench_random_f32(b, d);
    float *partials = (float *)mt_kernel_bench_alloc(b, mt_colsum_partials_bytes(d > m.qd ? d : m.qd));
    // RoPE: cos sin (T, D/2); q k (n, H*D) (n, KV*D) bf16 rotated in place, or [qk_norm] normed
    // and rotated from qpre kpre with inv_rms qrms (n*H) krms (n*KV); backward: dq dk fp32 in,
    // dq_proj dk_proj bf16 out [qkv_bias: and dq32 dk32 fp32]; dqkw (2, D) the q/k-norm weight
    // gradients; dv (n, KV*D) and dbias (H*D + 2 KV*D) for the bias gradients.
    float *cos_t = (float *)mt_kernel_bench_alloc(b, (size_t)(T * m.half) * sizeof(float));
    float *sin_t = (float *)mt_kernel_bench_alloc(b, (size_t)(T * m.half) * sizeof(float));
    bf16 *q = mt_kernel_bench_random_bf16(b, n * m.qd), *k = mt_kernel_bench_random_bf16(b, n * m.kvd);
    bf16 *qpre = cfg->qk_norm ? mt_kernel_bench_random_bf16(b, n * m.qd) : nullptr;
    bf16 *kpre = cfg->qk_norm ? mt_kernel_bench_random_bf16(b, n * m.kvd) : nullptr;
    float *qrms = cfg->qk_norm ? (float *)mt_kernel_bench_alloc(b, (size_t)(n * m.H) * sizeof(float)) : nullptr;
    float *krms = cfg->qk_norm ? (float *)mt_kernel_bench_alloc(b, (size_t)(n * m.KV) * sizeof(float)) : nullptr;
    float *dq = mt_kernel_bench_random_f32(b, n * m.qd), *dk = mt_kernel_bench_random_f32(b, n * m.kvd);
    bf16 *dq_proj = (bf16 *)mt_kernel_bench_alloc(b, (size_t)(n * m.qd) * sizeof(bf16));
    bf16 *dk_proj = (bf16 *)mt_kernel_bench_alloc(b, (size_t)(n * m.kvd) * sizeof(bf16));
    float *dq32 = cfg->qkv_bias ? mt_kernel_bench_random_f32(b, n * m.qd) : nullptr;
    float *dk32 = cfg->qkv_bias ? mt_kernel_bench_random_f32(b, n * m.kvd) : nullptr;
    float *dqkw = mt_kernel_bench_random_f32(b, 2 * m.D);
    const float *dv = mt_kernel_bench_random_f32(b, n * m.kvd);
    float *dbias = mt_kernel_bench_random_f32(b, m.qd + 2 * m.kvd); // (H*D + 2 KV*D)
    // SwiGLU: g u (n, I) bf16, s_dg (n, I) bf16 its output and later dg (as in the layer),
    // ds (n, I) fp32 the gradient at its output, du (n, I) bf16.
    const bf16 *g = mt_kernel_bench_random_bf16(b, n * I), *u = mt_kernel_bench_random_bf16(b, n * I);
    bf16 *s_dg = (bf16 *)mt_kernel_bench_alloc(b, (size_t)(n * I) * sizeof(bf16));
    const float *ds = mt_kernel_bench_random_f32(b, n * I);
    bf16 *du = (bf16 *)mt_kernel_bench_alloc(b, (size_t)(n * I) * sizeof(bf16));

    char nd[48], ni[48], tab[48], qks[48], bias[48], norm_cols[48];
    snprintf(nd, sizeof nd, "%lldx%lld", (long long)n, (long long)d);
    snprintf(ni, sizeof ni, "%lldx%lld", (long long)n, (long long)I);
    snprintf(tab, sizeof tab, "%lldx%lld", (long long)T, (long long)m.half);
    snprintf(qks, sizeof qks, "q %lldx%lld k %lldx%lld", (long long)n, (long long)m.qd, (long long)n, (long long)m.kvd);
    snprintf(bias, sizeof bias, "q %lldx%lld k v %lldx%lld", (long long)n, (long long)m.qd, (long long)n,
             (long long)m.kvd);
    snprintf(norm_cols, sizeof norm_cols, "%lldx%lld", (long long)(n * heads), (long long)m.D);

    // x 4nd + w 2d read; y 2nd + inv_rms 4n written
    mt_kernel_bench_time(b, "rmsnorm forward", nd, 6 * n * d + 2 * d + 4 * n,
                         [&] { mt_rmsnorm_forward(n, d, x, norm_w, cfg->rms_eps, xn, inv_rms, st); });
    // cos, sin (T, D/2) fp32 written; double cos/sin: compute, not memory, bound
    mt_kernel_bench_time(b, "rope tables", tab, 8 * T * m.half, [&] { rope_tables(cfg, &m, cos_t, sin_t, st); });
    // q k 2 n qk read and 2 n qk written (bf16), cos sin 8 T D/2 read;
    // [qk_norm: the weights 2 x 2D read, inv_rms 4 n heads written]
    mt_kernel_bench_time(b, cfg->qk_norm ? "q/k-norm + rope forward" : "rope forward", qks,
                         4 * n * qk + 8 * T * m.half + (cfg->qk_norm ? 4 * m.D + 4 * n * heads : 0), [&] {
                             qk_rope_forward(cfg, &m, cfg->qk_norm ? qpre : q, cfg->qk_norm ? kpre : k, q, k, qw, kw,
                                             qrms, krms, cos_t, sin_t, st);
                         });
    // g u 4 n I read, s 2 n I written
    mt_kernel_bench_time(b, "swiglu forward", ni, 6 * n * I, [&] { swiglu_forward(n * I, g, u, s_dg, st); });
    // x 4nd + inv_rms 4n + w 2d read, y 2nd written
    mt_kernel_bench_time(b, "rmsnorm apply (recompute)", nd, 6 * n * d + 2 * d + 4 * n,
                         [&] { mt_rmsnorm_apply(n, d, x, norm_w, inv_rms, xn, st); });
    // g u 4 n I + ds 4 n I read, dg du 4 n I written
    mt_kernel_bench_time(b, "swiglu backward", ni, 12 * n * I, [&] { swiglu_backward(n * I, g, u, ds, s_dg, du, st); });
    // The MLP norm's: x dy resid 12nd + w 2d + inv_rms 4n read, dx 4nd + its bf16 copy 2nd written
    mt_kernel_bench_time(b, "rmsnorm backward (+ resid, bf16 copy)", nd, 18 * n * d + 2 * d + 4 * n,
                         [&] { mt_rmsnorm_backward(n, d, x, norm_w, inv_rms, dy, resid, dx, dres, st); });
    // x dy 8nd + inv_rms 4n read, dw (d) fp32 read and written 8d
    mt_kernel_bench_time(b, "rmsnorm weight gradient (+=)", nd, 8 * n * d + 4 * n + 8 * d,
                         [&] { mt_rmsnorm_backward_weight(n, d, x, inv_rms, dy, dw, true, partials, st); });
    // dq dk 4 n qk + cos sin 8 T D/2 read, the bf16 gradients 2 n qk written [qkv_bias: their fp32
    // copies 4 n qk] [qk_norm: qpre kpre 2 n qk + inv_rms 4 n heads + the weights 4D read, the
    // weight's summands 4 n qk written over dq dk]
    mt_kernel_bench_time(b, cfg->qk_norm ? "q/k-norm + rope backward" : "rope backward", qks,
                         6 * n * qk + 8 * T * m.half + (cfg->qkv_bias ? 4 * n * qk : 0) +
                             (cfg->qk_norm ? 6 * n * qk + 4 * n * heads + 4 * m.D : 0),
                         [&] {
                             qk_rope_backward(cfg, &m, dq, dk, qpre, kpre, qw, kw, qrms, krms, dq_proj, dk_proj, cos_t,
                                              sin_t, dq32, dk32, st);
                         });
    // dq dk 4 n qk read, the two (D) fp32 gradients read and written 16 D
    if (cfg->qk_norm)
        mt_kernel_bench_time(b, "q/k-norm weight gradients (+=)", norm_cols, 4 * n * qk + 16 * m.D,
                             [&] { qk_norm_weight_grads(&m, dq, dk, dqkw, dqkw + m.D, partials, st); });
    // dq32 dk32 dv 4 n qkv read, the fp32 biases (qkv) read and written 8 qkv
    const int64_t qkv = m.qd + 2 * m.kvd;
    if (cfg->qkv_bias)
        mt_kernel_bench_time(b, "q/k/v bias gradients (+=)", bias, 4 * n * qkv + 8 * qkv, [&] {
            qkv_bias_grads(&m, dq32, dk32, dv, dbias, dbias + m.qd, dbias + m.qd + m.kvd, partials, st);
        });
    // The attention norm's, in place: x dy dx 12nd + w 2d + inv_rms 4n read, dx 4nd written
    mt_kernel_bench_time(b, "rmsnorm backward (in place)", nd, 16 * n * d + 2 * d + 4 * n,
                         [&] { mt_rmsnorm_backward(n, d, x, norm_w, inv_rms, dy, dx, dx, nullptr, st); });
}
