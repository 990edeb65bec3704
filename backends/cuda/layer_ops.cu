// The layer's element-wise steps of layer_ops.cuh, instantiated for bf16 and float.
extern "C" { // C headers without their own linkage guards
#include "backends/cpu/ops.h" // mt_rope_inv_freq: the same double frequencies as the CPU path
}

#include "backends/cuda/colsum.cuh"
#include "backends/cuda/layer_ops.cuh"

#define ROPE_PAIRS_PER_LANE (LAYER_MAX_HEAD_DIM / 2 / 32)

mt_layer_dims mt_layer_dims_of(const mt_model_config *cfg, int64_t B, int64_t T)
{
    mt_layer_dims m;
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

void mt_layer_check(const mt_model_config *cfg, const mt_tile_layout *layout, const mt_layer_dims *m)
{
    MT_CUDA_REQUIRE(layout->kind == MT_TILE_LAYER, "layer launcher given a non-layer tile layout");
    MT_CUDA_REQUIRE(m->D % 2 == 0 && m->D <= LAYER_MAX_HEAD_DIM, "head_dim %lld: must be even and <= %d",
                    (long long)m->D, LAYER_MAX_HEAD_DIM);
    MT_CUDA_REQUIRE(m->KV > 0 && m->H % m->KV == 0, "heads %lld not a multiple of kv_heads %lld", (long long)m->H,
                    (long long)m->KV);
    MT_CUDA_REQUIRE(!cfg->qk_norm || layout->tensors[MT_L_Q_NORM].numel == m->D, "q_norm size != head_dim");
}

// ---- RoPE tables: attention_factor * cos/sin of t * inv_freq[j], computed in double and rounded
// as the CPU does ----

typedef struct rope_freqs {
    double f[LAYER_MAX_HEAD_DIM / 2]; // mt_rope_inv_freq on the host, passed by value (1 KiB)
    double attention_factor;          // its return value: yarn's factor on cos and sin, else 1
} rope_freqs;

__global__ static void rope_table_kernel(int64_t T, int64_t half, rope_freqs freqs, float *cos_t, float *sin_t)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < T * half; i += (int64_t)gridDim.x * blockDim.x) {
        const double angle = (double)(i / half) * freqs.f[i % half];
        cos_t[i] = (float)(freqs.attention_factor * cos(angle));
        sin_t[i] = (float)(freqs.attention_factor * sin(angle));
    }
}

void mt_layer_rope_tables(const mt_model_config *cfg, const mt_layer_dims *m, float *cos_t, float *sin_t,
                          cudaStream_t stream)
{
    rope_freqs freqs;
    memset(&freqs, 0, sizeof freqs);
    // the sequence's length m->T: dynamic scaling's frequencies depend on it
    freqs.attention_factor = mt_rope_inv_freq(cfg, m->T, freqs.f);
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
                                              const E *ksrc, E *qdst, E *kdst, const float *qw, const float *kw,
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
        const float *w = v.is_q ? qw : kw;
#pragma unroll
        for (int p = 0; p < ROPE_PAIRS_PER_LANE; p++) {
            const int j = lane + 32 * p;
            if (j < half) {
                x1[p] = x1[p] * s * w[j];
                x2[p] = x2[p] * s * w[j + half];
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

// Backward of the above on dq (n, H*D), dk (n, KV*D) fp32 from attention: the transpose of the
// scaled rotation, [QKNorm: the norm's input gradient, and dq/dk overwritten with the norm
// weight's summands dy * x * inv_rms for a column sum], written as E gradients at the
// projections' outputs, and as fp32 into dq32/dk32 when those are given (for the bias gradients).
template <class E, bool QKNorm>
__global__ static void qk_rope_backward_kernel(int64_t n, int64_t T, int64_t H, int64_t KV, int D, float *dq, float *dk,
                                               const E *qpre, const E *kpre, const float *qw, const float *kw,
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
    const float *w = v.is_q ? qw : kw;
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
            w1[p] = w[j];
            w2[p] = w[j + half];
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

static unsigned qk_blocks(const mt_layer_dims *m)
{
    const int64_t warps = m->n * (m->H + m->KV);
    return (unsigned)((warps * 32 + 255) / 256);
}

// The forward launch: with cfg->qk_norm the per-head norm (qw kw (D), qrms (n*H) krms (n*KV)
// written), else the rotation alone (those four unused).
template <class E>
void mt_layer_qk_rope_forward(const mt_model_config *cfg, const mt_layer_dims *m, const E *qsrc, const E *ksrc,
                              E *qdst, E *kdst, const float *qw, const float *kw, float *qrms, float *krms,
                              const float *cos_t, const float *sin_t, cudaStream_t stream)
{
    const unsigned blocks = qk_blocks(m);
    if (cfg->qk_norm)
        qk_rope_forward_kernel<E, true><<<blocks, 256, 0, stream>>>(m->n, m->T, m->H, m->KV, (int)m->D, qsrc, ksrc,
                                                                    qdst, kdst, qw, kw, qrms, krms, cfg->rms_eps,
                                                                    cos_t, sin_t);
    else
        qk_rope_forward_kernel<E, false><<<blocks, 256, 0, stream>>>(m->n, m->T, m->H, m->KV, (int)m->D, qsrc, ksrc,
                                                                     qdst, kdst, nullptr, nullptr, nullptr, nullptr,
                                                                     cfg->rms_eps, cos_t, sin_t);
    CUDA_CHECK_LAUNCH();
}

// The backward launch, same variants: qpre kpre qw kw qrms krms used only with cfg->qk_norm.
template <class E>
void mt_layer_qk_rope_backward(const mt_model_config *cfg, const mt_layer_dims *m, float *dq, float *dk, const E *qpre,
                               const E *kpre, const float *qw, const float *kw, const float *qrms, const float *krms,
                               E *dq_proj, E *dk_proj, const float *cos_t, const float *sin_t, float *dq32,
                               float *dk32, cudaStream_t stream)
{
    const unsigned blocks = qk_blocks(m);
    if (cfg->qk_norm)
        qk_rope_backward_kernel<E, true><<<blocks, 256, 0, stream>>>(m->n, m->T, m->H, m->KV, (int)m->D, dq, dk, qpre,
                                                                     kpre, qw, kw, qrms, krms, dq_proj, dk_proj, cos_t,
                                                                     sin_t, dq32, dk32);
    else
        qk_rope_backward_kernel<E, false><<<blocks, 256, 0, stream>>>(m->n, m->T, m->H, m->KV, (int)m->D, dq, dk,
                                                                      nullptr, nullptr, nullptr, nullptr, nullptr,
                                                                      nullptr, dq_proj, dk_proj, cos_t, sin_t, dq32,
                                                                      dk32);
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

template <class E> void mt_layer_swiglu_forward(int64_t len, const E *gate, const E *up, E *out, cudaStream_t stream)
{
    swiglu_forward_kernel<<<mt_grid_for(len, 256), 256, 0, stream>>>(len, gate, up, out);
    CUDA_CHECK_LAUNCH();
}

template <class E>
void mt_layer_swiglu_backward(int64_t len, const E *gate, const E *up, const float *dout, E *dgate, E *dup,
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

// q/k-norm weight gradients dqw dkw (D) += column sums of the summands mt_layer_qk_rope_backward left in
// dq (n*H, D) and dk (n*KV, D).
void mt_layer_qk_norm_weight_grads(const mt_layer_dims *m, const float *dq, const float *dk, float *dqw, float *dkw,
                                   float *partials, cudaStream_t stream)
{
    mt_colsum(f32_element{dq, m->D}, m->n * m->H, m->D, dqw, true, partials, stream);
    mt_colsum(f32_element{dk, m->D}, m->n * m->KV, m->D, dkw, true, partials, stream);
}

// q/k/v bias gradients dqb (H*D), dkb dvb (KV*D) += column sums of the fp32 gradients at the
// projections' outputs dq32 (n, H*D), dk32 dv (n, KV*D).
void mt_layer_qkv_bias_grads(const mt_layer_dims *m, const float *dq32, const float *dk32, const float *dv, float *dqb,
                             float *dkb, float *dvb, float *partials, cudaStream_t stream)
{
    mt_colsum(f32_element{dq32, m->qd}, m->n, m->qd, dqb, true, partials, stream);
    mt_colsum(f32_element{dk32, m->kvd}, m->n, m->kvd, dkb, true, partials, stream);
    mt_colsum(f32_element{dv, m->kvd}, m->n, m->kvd, dvb, true, partials, stream);
}

template <class E> __global__ static void add_bias_kernel(int64_t rows, int64_t C, const E *bias, float *y)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < rows * C; i += (int64_t)gridDim.x * blockDim.x)
        y[i] += to_f(bias[i % C]);
}

template <class E> void mt_layer_add_bias(int64_t rows, int64_t C, const E *bias, float *y, cudaStream_t stream)
{
    if (rows * C == 0) return;
    const int64_t blocks = (rows * C + 255) / 256;
    add_bias_kernel<E><<<(unsigned)(blocks < 65535 ? blocks : 65535), 256, 0, stream>>>(rows, C, bias, y);
    CUDA_CHECK_LAUNCH();
}

void mt_layer_bias_grad(int64_t rows, int64_t C, const float *dy, float *db, float *partials, cudaStream_t stream)
{
    mt_colsum(f32_element{dy, C}, rows, C, db, true, partials, stream);
}

#define MT_LAYER_OPS_INSTANTIATE(E)                                                                            \
    template void mt_layer_qk_rope_forward<E>(const mt_model_config *, const mt_layer_dims *, const E *,       \
                                              const E *, E *, E *, const float *, const float *, float *,      \
                                              float *, const float *, const float *, cudaStream_t);            \
    template void mt_layer_qk_rope_backward<E>(const mt_model_config *, const mt_layer_dims *, float *,        \
                                               float *, const E *, const E *, const float *, const float *,    \
                                               const float *, const float *, E *, E *, const float *,          \
                                               const float *, float *, float *, cudaStream_t);                 \
    template void mt_layer_swiglu_forward<E>(int64_t, const E *, const E *, E *, cudaStream_t);                   \
    template void mt_layer_swiglu_backward<E>(int64_t, const E *, const E *, const float *, E *, E *, cudaStream_t); \
    template void mt_layer_add_bias<E>(int64_t, int64_t, const E *, float *, cudaStream_t);
MT_LAYER_OPS_INSTANTIATE(bf16)
MT_LAYER_OPS_INSTANTIATE(float)
