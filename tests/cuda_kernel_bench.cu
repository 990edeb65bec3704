// mt_test_bench_memory_kernels (cuda_kernel_bench.h): each memory-bound kernel launched through
// the backend's own launchers (backends/cuda headers), on random buffers of one call's shapes,
// timed with cudaEvents between L2 flushes. For tests and measurements only: it allocates, and
// synchronises after every run.
extern "C" { // C headers without their own linkage guards
#include "models/layout.h"
}

#include <algorithm>
#include <string.h>

#include "backends/cuda/common.cuh"
#include "backends/cuda/head.cuh"
#include "backends/cuda/layer_ops.cuh"
#include "backends/cuda/rmsnorm.cuh"
#include "backends/cuda/colsum.cuh"
#include "tests/cuda_kernel_bench.h"

#define MT_KERNEL_BENCH_MAX_BUFFERS 64

// One bench call's state: its stream and events, the L2 flush buffer, the device buffers it
// frees at the end, and the table being filled.
struct mt_kernel_bench {
    cudaStream_t stream;
    cudaEvent_t start, stop;
    int reps;
    float *ms; // (reps) this kernel's times
    void *flush;
    size_t flush_bytes; // a few times the L2: rewritten before each run
    void *buffers[MT_KERNEL_BENCH_MAX_BUFFERS];
    int nbuffers;
    mt_test_kernel_timing *out;
    int count, max;
};

// splitmix64: a counter-based hash, so every random value is a pure function of (seed, index).
static __host__ __device__ __forceinline__ uint64_t splitmix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static __device__ __forceinline__ void store(float *p, float v) { *p = v; }
static __device__ __forceinline__ void store(bf16 *p, float v) { *p = f2bf(v); }

// x (n) = uniform in [-1, 1): 24 bits of the hash of (seed, i).
template <class T> __global__ static void random_fill_kernel(T *x, int64_t n, uint64_t seed)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        store(&x[i], (float)(splitmix64((seed << 40) ^ (uint64_t)i) >> 40) * 0x1p-23f - 1.0f);
}

// Device buffer of `bytes`, contents undefined, freed when the bench call returns.
static void *mt_kernel_bench_alloc(mt_kernel_bench *b, size_t bytes)
{
    MT_CUDA_REQUIRE(b->nbuffers < MT_KERNEL_BENCH_MAX_BUFFERS, "bench buffers: raise MT_KERNEL_BENCH_MAX_BUFFERS");
    void *p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, bytes > 0 ? bytes : MT_CUDA_SCRATCH_ALIGN));
    b->buffers[b->nbuffers++] = p;
    return p;
}

// The buffer's index seeds its values, so no two buffers hold the same numbers.
template <class T> static T *random_buffer(mt_kernel_bench *b, int64_t n)
{
    T *p = (T *)mt_kernel_bench_alloc(b, (size_t)(n > 0 ? n : 0) * sizeof(T));
    random_fill_kernel<<<mt_grid_for(n, 256), 256, 0, b->stream>>>(p, n, (uint64_t)b->nbuffers);
    CUDA_CHECK_LAUNCH();
    return p;
}

// Device buffers of n elements uniform in [-1, 1) (a different stream of numbers per call).
static float *mt_kernel_bench_random_f32(mt_kernel_bench *b, int64_t n) { return random_buffer<float>(b, n); }
static bf16 *mt_kernel_bench_random_bf16(mt_kernel_bench *b, int64_t n) { return random_buffer<bf16>(b, n); }

// Appends {name, shape, median of b->ms, bytes} to the table: the median as BENCH (cuda_bench.c)
// takes it, element reps / 2 of the sorted times.
static void mt_kernel_bench_record(mt_kernel_bench *b, const char *name, const char *shape, int64_t bytes)
{
    std::sort(b->ms, b->ms + b->reps);
    mt_test_kernel_timing *t = &b->out[b->count++];
    snprintf(t->name, sizeof t->name, "%s", name);
    snprintf(t->shape, sizeof t->shape, "%s", shape);
    t->ms = b->ms[b->reps / 2];
    t->bytes = bytes;
}

// Times launch() (enqueues on b->stream): one warm-up run, then b->reps timed runs between two
// cudaEvents. The flush buffer is rewritten before every run, outside the events, so inputs come
// from HBM as they do inside a step (a (4096, 2048) fp32 tensor would otherwise sit in L2).
template <class F>
static void mt_kernel_bench_time(mt_kernel_bench *b, const char *name, const char *shape, int64_t bytes, F launch)
{
    MT_CUDA_REQUIRE(b->count < b->max, "more kernels than the %d table entries given: pass MT_TEST_BENCH_MAX_KERNELS",
                    b->max);
    for (int r = -1; r < b->reps; r++) { // r = -1: the warm-up, not recorded
        CUDA_CHECK(cudaMemsetAsync(b->flush, 0, b->flush_bytes, b->stream));
        if (r >= 0) CUDA_CHECK(cudaEventRecord(b->start, b->stream));
        launch();
        if (r < 0) continue;
        CUDA_CHECK(cudaEventRecord(b->stop, b->stream));
        CUDA_CHECK(cudaEventSynchronize(b->stop));
        CUDA_CHECK(cudaEventElapsedTime(&b->ms[r], b->start, b->stop));
    }
    mt_kernel_bench_record(b, name, shape, bytes);
}

// The layer's memory-bound kernels through the helpers its own code calls, on random buffers of
// one call's shapes, in the order of a forward then a backward. bytes: the least traffic, every
// input read once and every output written once at its element size (n = B*T rows, qk = H*D +
// KV*D elements of q and k per row, heads = H + KV). The residual adds ride in the o and down
// GEMMs' epilogues: no kernel of their own.
static void bench_layer(mt_kernel_bench *b, const mt_model_config *cfg, const mt_tile_layout *layout, int64_t B,
                        int64_t T)
{
    const mt_layer_dims m = mt_layer_dims_of(cfg, B, T);
    mt_layer_check(cfg, layout, &m);
    const int64_t n = m.n, d = m.d, I = m.inter, qk = m.qd + m.kvd, heads = m.H + m.KV;
    const cudaStream_t st = b->stream;
    // the norms' weights fp32, as a bf16 tile streams them (models/layout.h, mt_layout_keep_norms_f32)
    const float *norm_w = mt_kernel_bench_random_f32(b, d);                                   // (d)
    const float *qw = cfg->qk_norm ? mt_kernel_bench_random_f32(b, m.D) : nullptr;            // (D)
    const float *kw = cfg->qk_norm ? mt_kernel_bench_random_f32(b, m.D) : nullptr;            // (D)
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

    // x 4nd + w 4d read; y 2nd + inv_rms 4n written
    mt_kernel_bench_time(b, "rmsnorm forward", nd, 6 * n * d + 4 * d + 4 * n,
                         [&] { mt_rmsnorm_forward(n, d, x, norm_w, cfg->rms_eps, xn, inv_rms, st); });
    // cos, sin (T, D/2) fp32 written; double cos/sin: compute, not memory, bound
    mt_kernel_bench_time(b, "rope tables", tab, 8 * T * m.half,
                         [&] { mt_layer_rope_tables(cfg, &m, cos_t, sin_t, st); });
    // q k 2 n qk read and 2 n qk written (bf16), cos sin 8 T D/2 read;
    // [qk_norm: the weights 2 x 4D read, inv_rms 4 n heads written]
    mt_kernel_bench_time(b, cfg->qk_norm ? "q/k-norm + rope forward" : "rope forward", qks,
                         4 * n * qk + 8 * T * m.half + (cfg->qk_norm ? 8 * m.D + 4 * n * heads : 0), [&] {
                             mt_layer_qk_rope_forward(cfg, &m, cfg->qk_norm ? qpre : q, cfg->qk_norm ? kpre : k, q, k,
                                                      qw, kw, qrms, krms, cos_t, sin_t, st);
                         });
    // g u 4 n I read, s 2 n I written
    mt_kernel_bench_time(b, "swiglu forward", ni, 6 * n * I, [&] { mt_layer_swiglu_forward(n * I, g, u, s_dg, st); });
    // x 4nd + inv_rms 4n + w 4d read, y 2nd written
    mt_kernel_bench_time(b, "rmsnorm apply (recompute)", nd, 6 * n * d + 4 * d + 4 * n,
                         [&] { mt_rmsnorm_apply(n, d, x, norm_w, inv_rms, xn, st); });
    // g u 4 n I + ds 4 n I read, dg du 4 n I written
    mt_kernel_bench_time(b, "swiglu backward", ni, 12 * n * I,
                         [&] { mt_layer_swiglu_backward(n * I, g, u, ds, s_dg, du, st); });
    // The MLP norm's: x dy resid 12nd + w 4d + inv_rms 4n read, dx 4nd + its bf16 copy 2nd written
    mt_kernel_bench_time(b, "rmsnorm backward (+ resid, bf16 copy)", nd, 18 * n * d + 4 * d + 4 * n,
                         [&] { mt_rmsnorm_backward<bf16>(n, d, x, norm_w, inv_rms, dy, resid, dx, dres, st); });
    // x dy 8nd + inv_rms 4n read, dw (d) fp32 read and written 8d
    mt_kernel_bench_time(b, "rmsnorm weight gradient (+=)", nd, 8 * n * d + 4 * n + 8 * d,
                         [&] { mt_rmsnorm_backward_weight(n, d, x, inv_rms, dy, dw, true, partials, st); });
    // dq dk 4 n qk + cos sin 8 T D/2 read, the bf16 gradients 2 n qk written [qkv_bias: their fp32
    // copies 4 n qk] [qk_norm: qpre kpre 2 n qk + inv_rms 4 n heads + the weights 8D read, the
    // weight's summands 4 n qk written over dq dk]
    mt_kernel_bench_time(b, cfg->qk_norm ? "q/k-norm + rope backward" : "rope backward", qks,
                         6 * n * qk + 8 * T * m.half + (cfg->qkv_bias ? 4 * n * qk : 0) +
                             (cfg->qk_norm ? 6 * n * qk + 4 * n * heads + 8 * m.D : 0),
                         [&] {
                             mt_layer_qk_rope_backward(cfg, &m, dq, dk, qpre, kpre, qw, kw, qrms, krms, dq_proj, dk_proj,
                                                       cos_t, sin_t, dq32, dk32, st);
                         });
    // dq dk 4 n qk read, the two (D) fp32 gradients read and written 16 D
    if (cfg->qk_norm)
        mt_kernel_bench_time(b, "q/k-norm weight gradients (+=)", norm_cols, 4 * n * qk + 16 * m.D,
                             [&] { mt_layer_qk_norm_weight_grads(&m, dq, dk, dqkw, dqkw + m.D, partials, st); });
    // dq32 dk32 dv 4 n qkv read, the fp32 biases (qkv) read and written 8 qkv
    const int64_t qkv = m.qd + 2 * m.kvd;
    if (cfg->qkv_bias)
        mt_kernel_bench_time(b, "q/k/v bias gradients (+=)", bias, 4 * n * qkv + 8 * qkv, [&] {
            mt_layer_qkv_bias_grads(&m, dq32, dk32, dv, dbias, dbias + m.qd, dbias + m.qd + m.kvd, partials, st);
        });
    // The attention norm's, in place: x dy dx 12nd + w 4d + inv_rms 4n read, dx 4nd written
    mt_kernel_bench_time(b, "rmsnorm backward (in place)", nd, 16 * n * d + 4 * d + 4 * n,
                         [&] { mt_rmsnorm_backward<bf16>(n, d, x, norm_w, inv_rms, dy, dx, dx, nullptr, st); });
}

// The cross-entropy over `rows` rows of random logits, without and with the gradient. The head's
// norm is the layer's rmsnorm at the same (rows, d), timed there; loss_sum_kernel is one block
// over `rows` doubles (latency, not bandwidth); the GEMMs are not memory-bound.
static void bench_head(mt_kernel_bench *b, const mt_model_config *cfg, int64_t rows, const int32_t *targets)
{
    const int64_t V = cfg->vocab;
    MT_CUDA_REQUIRE(rows > 0 && rows < (1ll << 31), "bench rows %lld exceed the grid", (long long)rows);
    const float *logits = mt_kernel_bench_random_f32(b, rows * V);                       // (rows, V)
    bf16 *dlogits = (bf16 *)mt_kernel_bench_alloc(b, (size_t)(rows * V) * sizeof(bf16)); // (rows, V)
    double *row_loss = (double *)mt_kernel_bench_alloc(b, (size_t)rows * sizeof(double));
    int *row_counted = (int *)mt_kernel_bench_alloc(b, (size_t)rows * sizeof(int));
    char shape[48];
    snprintf(shape, sizeof shape, "%lldx%lld", (long long)rows, (long long)V);
    // logits 4 rows V + targets 4 rows read, row_loss 8 rows + row_counted 4 rows written
    mt_kernel_bench_time(b, "cross-entropy (loss)", shape, 4 * rows * V + 16 * rows, [&] {
        mt_head_cross_entropy<bf16>(rows, V, logits, targets, 1.0 / (double)rows, nullptr, row_loss, row_counted,
                                    b->stream);
    });
    // the same + dlogits 2 rows V written
    mt_kernel_bench_time(b, "cross-entropy (loss + gradient)", shape, 6 * rows * V + 16 * rows, [&] {
        mt_head_cross_entropy(rows, V, logits, targets, 1.0 / (double)rows, dlogits, row_loss, row_counted, b->stream);
    });
}

// tokens (n) uniform in [0, V) on the device; returns how many distinct values they hold (the
// table rows the embedding must touch).
static int64_t random_tokens(mt_kernel_bench *b, int64_t n, int64_t V, int32_t **tokens)
{
    int32_t *host = (int32_t *)malloc((size_t)n * sizeof(int32_t));
    MT_CUDA_REQUIRE(host != nullptr, "out of host memory for %lld bench tokens", (long long)n);
    for (int64_t i = 0; i < n; i++) host[i] = (int32_t)(splitmix64((uint64_t)i) % (uint64_t)V);
    *tokens = (int32_t *)mt_kernel_bench_alloc(b, (size_t)n * sizeof(int32_t));
    CUDA_CHECK(cudaMemcpyAsync(*tokens, host, (size_t)n * sizeof(int32_t), cudaMemcpyHostToDevice, b->stream));
    CUDA_CHECK(cudaStreamSynchronize(b->stream)); // host is freed below
    std::sort(host, host + n);
    const int64_t distinct = std::unique(host, host + n) - host;
    free(host);
    return distinct;
}

extern "C" int mt_test_bench_memory_kernels(const mt_model_config *cfg, int64_t B, int64_t T, int reps,
                                            mt_test_kernel_timing *out, int max)
{
    MT_CUDA_REQUIRE(B > 0 && T > 0 && reps > 0, "bench B=%lld T=%lld reps=%d: all must be positive", (long long)B,
                    (long long)T, reps);
    MT_CUDA_REQUIRE(cfg->vocab > 0 && cfg->vocab <= INT32_MAX, "vocab %lld outside the int32 tokens",
                    (long long)cfg->vocab);
    mt_kernel_bench b;
    memset(&b, 0, sizeof b);
    b.reps = reps;
    b.out = out;
    b.max = max;
    b.ms = (float *)calloc((size_t)reps, sizeof(float));
    MT_CUDA_REQUIRE(b.ms != nullptr, "out of host memory for %d bench times", reps);
    CUDA_CHECK(cudaStreamCreateWithFlags(&b.stream, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreate(&b.start));
    CUDA_CHECK(cudaEventCreate(&b.stop));
    int device = 0, l2 = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
    b.flush_bytes = (size_t)4 * (size_t)(l2 > 0 ? l2 : 64 << 20);
    b.flush = mt_kernel_bench_alloc(&b, b.flush_bytes);
    const mt_cuda_stream s = (mt_cuda_stream)b.stream;

    // The baseline: copy bytes read + copy bytes written.
    const int64_t copy = (int64_t)1 << 30;
    const float *src = mt_kernel_bench_random_f32(&b, copy / (int64_t)sizeof(float));
    void *dst = mt_kernel_bench_alloc(&b, (size_t)copy);
    mt_kernel_bench_time(&b, "device copy (cudaMemcpyAsync)", "1 GiB", 2 * copy, [&] {
        CUDA_CHECK(cudaMemcpyAsync(dst, src, (size_t)copy, cudaMemcpyDeviceToDevice, b.stream));
    });

    mt_tile_layout layout;
    mt_layout_build(cfg, MT_TILE_LAYER, &layout);
    bench_layer(&b, cfg, &layout, B, T);

    // A layer tile's worth of elements N: the conversions move 4 N + 2 N bytes either way, the
    // sum of squares reads 4 N and writes one double.
    const int64_t N = layout.numel;
    char shape[48];
    snprintf(shape, sizeof shape, "%lld", (long long)N);
    const float *f32 = mt_kernel_bench_random_f32(&b, N);
    mt_cuda_bf16 *bf = (mt_cuda_bf16 *)mt_kernel_bench_random_bf16(&b, N);
    float *f32_out = (float *)mt_kernel_bench_alloc(&b, (size_t)N * sizeof(float));
    double *sum = (double *)mt_kernel_bench_alloc(&b, sizeof(double));
    mt_kernel_bench_time(&b, "f32 -> bf16", shape, 6 * N, [&] { mt_cuda_f32_to_bf16(f32, bf, N, s); });
    mt_kernel_bench_time(&b, "bf16 -> f32", shape, 6 * N, [&] { mt_cuda_bf16_to_f32(bf, f32_out, N, s); });
    mt_kernel_bench_time(&b, "sum of squares", shape, 4 * N + (int64_t)sizeof(double),
                         [&] { mt_cuda_sumsq_f32(f32, N, sum, s); });

    // The embedding over n = B*T tokens of a (V, d) table, `distinct` of its rows touched.
    // forward: tokens 4 n + the touched rows 2 d distinct read, h0 4 n d written;
    // backward: tokens 4 n + dh0 4 n d read, the touched rows of dtable 4 d distinct read and
    // written (its key sort's traffic is overhead, not counted).
    const int64_t n = B * T, d = cfg->hidden, V = cfg->vocab;
    int32_t *tokens = nullptr;
    const int64_t distinct = random_tokens(&b, n, V, &tokens);
    const mt_cuda_bf16 *table = (const mt_cuda_bf16 *)mt_kernel_bench_random_bf16(&b, V * d); // (V, d)
    float *dtable = mt_kernel_bench_random_f32(&b, V * d);                                    // (V, d)
    float *h0 = (float *)mt_kernel_bench_alloc(&b, (size_t)(n * d) * sizeof(float));          // (n, d)
    const float *dh0 = mt_kernel_bench_random_f32(&b, n * d);                                 // (n, d)
    void *workspace = mt_kernel_bench_alloc(&b, mt_cuda_embedding_workspace_bytes(n, V));
    snprintf(shape, sizeof shape, "%lldx%lld of V %lld", (long long)n, (long long)d, (long long)V);
    mt_kernel_bench_time(&b, "embedding forward (gather)", shape, 4 * n + 2 * d * distinct + 4 * n * d,
                         [&] { mt_cuda_embedding_forward(n, d, MT_CUDA_BF16, table, tokens, h0, s); });
    mt_kernel_bench_time(&b, "embedding backward (scatter-add)", shape, 4 * n + 4 * n * d + 8 * d * distinct,
                         [&] { mt_cuda_embedding_backward(n, d, V, tokens, dh0, dtable, workspace, s); });

    bench_head(&b, cfg, n, tokens);

    CUDA_CHECK(cudaStreamSynchronize(b.stream));
    for (int i = 0; i < b.nbuffers; i++) CUDA_CHECK(cudaFree(b.buffers[i]));
    CUDA_CHECK(cudaEventDestroy(b.start));
    CUDA_CHECK(cudaEventDestroy(b.stop));
    CUDA_CHECK(cudaStreamDestroy(b.stream));
    free(b.ms);
    return b.count;
}
