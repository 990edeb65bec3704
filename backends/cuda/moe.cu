// The mixture-of-experts block of a sparse layer on the GPU (moe.cuh): the routing of
// moe_routing.cu, the tokens gathered into expert order, each expert's gate/up, SwiGLU and down
// over its rows, the weighted combine, the load-balancing loss's statistics; and the backward
// through all of it, the loss's gradient at the router included. gpt_oss adds a router bias,
// expert biases and its clamped SwiGLU, each a kernel of its own around the same GEMMs.
//
// The experts' GEMMs are per-expert cuBLAS calls (cublasGemmEx, fp32 accumulation) over
// contiguous row ranges of the gathered tokens. Their row counts change every call, so the host
// needs them: a kernel writes the E + 1 group offsets into mapped host memory and the block
// synchronises its stream, once per call. (A cudaMemcpyAsync would wait on a copy engine behind
// whatever transfers StarPU has queued there, whole layers' weights and gradients.) cuBLASLt's
// plans (linear.cu) are cached per exact shape and would be planned
// anew for every expert every call; cuBLAS picks its kernel per call from its own heuristics
// cache. cublasGemmGroupedBatchedEx is not used: the weight gradients need bf16 operands with an
// fp32 output, which that API does not list.
//
// Gate and up of one grouped row sit side by side, gu (nk, 2 Ie) = [g | u]: when an expert's up
// matrix follows its gate matrix in the tile without padding (Ie * d a multiple of
// MT_TILE_ALIGN, true of the published shapes), [Wg; Wu] is one (2 Ie, d) matrix and each of its
// products is one GEMM; otherwise two GEMMs write or read the two halves.
#include "backends/cuda/colsum.cuh"
#include "backends/cuda/layer_ops.cuh"
#include "backends/cuda/linear.cuh"
#include "backends/cuda/moe.cuh"

// ---- the layout ----

// Matrix `which` (MT_X_*) of expert e in a tile of T (or its fp32 gradient).
template <class P> static P *expert_matrix(const mt_tile_layout *layout, P *tile, int e, int which)
{
    return tile + layout->tensors[mt_layout_expert_slot(e, which)].offset;
}

// Whether every expert's up matrix directly follows its gate matrix: [Wg; Wu] is then (2 Ie, d).
static bool gate_up_adjacent(const mt_model_config *cfg, const mt_tile_layout *layout)
{
    const int64_t gu = cfg->expert_intermediate * cfg->hidden;
    for (int e = 0; e < (int)cfg->experts; e++)
        if (layout->tensors[mt_layout_expert_slot(e, MT_X_UP)].offset !=
            layout->tensors[mt_layout_expert_slot(e, MT_X_GATE)].offset + gu)
            return false;
    return true;
}

void mt_moe_check(const mt_model_config *cfg, const mt_tile_layout *layout, int64_t n)
{
    const int64_t E = cfg->experts, k = cfg->experts_per_token, d = cfg->hidden, Ie = cfg->expert_intermediate;
    MT_CUDA_REQUIRE(mt_layout_is_sparse(layout) && E >= 1 && E <= MT_MAX_EXPERTS, "a sparse layer of 1..%d experts",
                    MT_MAX_EXPERTS);
    MT_CUDA_REQUIRE(k >= 1 && k <= E && Ie >= 1, "top %lld of %lld experts of width %lld", (long long)k, (long long)E,
                    (long long)Ie);
    MT_CUDA_REQUIRE(layout->ntensors == mt_layout_expert_slot((int)E, 0), "the layout has not %lld experts",
                    (long long)E);
    MT_CUDA_REQUIRE(layout->tensors[MT_L_ROUTER_W].numel == E * d, "router size != experts x hidden");
    for (int e = 0; e < (int)E; e++)
        for (int x = 0; x < MT_X_COUNT; x++)
            MT_CUDA_REQUIRE(layout->tensors[mt_layout_expert_slot(e, x)].numel == Ie * d,
                            "expert %d matrix %d: size != moe_intermediate x hidden", e, x);
    MT_CUDA_REQUIRE(n * k < INT32_MAX, "%lld assignments: the routing indexes them in int32", (long long)(n * k));
}

// ---- carving: saved set, forward scratch, backward scratch ----

template <class T> void mt_moe_saved_carve(const mt_model_config *cfg, int64_t n, mt_carve *c, mt_moe_saved<T> *s)
{
    const int64_t E = cfg->experts, nk = n * cfg->experts_per_token;
    s->probs = mt_take<float>(c, n * E);
    s->weights = mt_take<float>(c, nk);
    s->experts = mt_take<int32_t>(c, nk);
    s->order = mt_take<int32_t>(c, nk);
    s->pos = mt_take<int32_t>(c, nk);
    s->offsets = mt_take<int32_t>(c, E + 1);
    s->gu = mt_take<T>(c, nk * 2 * cfg->expert_intermediate);
}

// Forward: the grouping's workspace; X (nk, d) T, the gathered inputs, overlaid by o (nk, d)
// fp32, the experts' outputs (every gate/up GEMM, the last readers of X, is queued before the
// first down GEMM); s (nk, Ie) T, the SwiGLU outputs.
template <class T> struct moe_fwd_scratch {
    void *group;
    T *X;
    float *o;
    T *s;
};

template <class T> static void fwd_carve(const mt_model_config *cfg, int64_t n, mt_carve *c, moe_fwd_scratch<T> *s)
{
    const int64_t nk = n * cfg->experts_per_token, d = cfg->hidden;
    s->group = mt_take<char>(c, (int64_t)mt_moe_group_workspace_bytes(n, cfg->experts, cfg->experts_per_token));
    const size_t region = c->offset;
    s->X = mt_take<T>(c, nk * d);
    const size_t x_end = c->offset;
    c->offset = region;
    s->o = mt_take<float>(c, nk * d);
    if (x_end > c->offset) c->offset = x_end;
    s->s = mt_take<T>(c, nk * cfg->expert_intermediate);
}

// Backward: X, dY (nk, d) T, the gathered inputs and output gradients, overlaid by dX (nk, d)
// fp32, the experts' input gradients (queued after the weight gradients, the last readers of X
// and dY); dz (nk, Ie) fp32, the gradient at s before the routing weight; dw (nk) fp32, at the
// routing weights; ws (nk, Ie) T, s times the weight; dgu (nk, 2 Ie) T, at [g | u]; dlogits
// (n, E) T; with a router bias (gpt_oss) the column sums' partials of its gradient.
template <class T> struct moe_bwd_scratch {
    T *X, *dY;
    float *dX, *dz, *dw;
    T *ws, *dgu, *dlogits;
    float *partials;
};

template <class T> static void bwd_carve(const mt_model_config *cfg, int64_t n, mt_carve *c, moe_bwd_scratch<T> *s)
{
    const int64_t nk = n * cfg->experts_per_token, d = cfg->hidden, Ie = cfg->expert_intermediate;
    const size_t region = c->offset;
    s->X = mt_take<T>(c, nk * d);
    s->dY = mt_take<T>(c, nk * d);
    const size_t xy_end = c->offset;
    c->offset = region;
    s->dX = mt_take<float>(c, nk * d);
    if (xy_end > c->offset) c->offset = xy_end;
    s->dz = mt_take<float>(c, nk * Ie);
    s->dw = mt_take<float>(c, nk);
    s->ws = mt_take<T>(c, nk * Ie);
    s->dgu = mt_take<T>(c, nk * 2 * Ie);
    s->dlogits = mt_take<T>(c, n * cfg->experts);
    s->partials = cfg->router_bias ? (float *)mt_take<char>(c, (int64_t)mt_colsum_partials_bytes(cfg->experts))
                                   : nullptr;
}

template <class T> size_t mt_moe_forward_scratch_bytes(const mt_model_config *cfg, int64_t n)
{
    mt_carve c = {nullptr, 0};
    moe_fwd_scratch<T> s;
    fwd_carve(cfg, n, &c, &s);
    return mt_carve_size(&c);
}

template <class T> size_t mt_moe_backward_scratch_bytes(const mt_model_config *cfg, int64_t n)
{
    mt_carve c = {nullptr, 0};
    moe_bwd_scratch<T> s;
    bwd_carve(cfg, n, &c, &s);
    return mt_carve_size(&c);
}

// ---- element-wise kernels: a block (or grid-stride share of blocks) per row ----

// out (rows, d) T: row i = row order[i] / k of src (n, d) T, the token of grouped row i.
template <class T>
__global__ static void gather_kernel(int64_t rows, int64_t d, int k, const int32_t *order, const T *src, T *out)
{
    for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
        const T *from = src + (int64_t)(order[i] / k) * d;
        for (int64_t j = threadIdx.x; j < d; j += blockDim.x) out[i * d + j] = from[j];
    }
}

// s (rows, Ie) T = silu(g) * u from gu (rows, 2 Ie) = [g | u]: the dense path's formula, fp32 math
// with expf.
template <class T> __global__ static void swiglu_kernel(int64_t rows, int64_t Ie, const T *gu, T *s)
{
    for (int64_t i = blockIdx.x; i < rows; i += gridDim.x)
        for (int64_t j = threadIdx.x; j < Ie; j += blockDim.x) {
            const float g = to_f(gu[i * 2 * Ie + j]);
            const float sig = 1.f / (1.f + expf(-g));
            s[i * Ie + j] = from_f<T>(g * sig * to_f(gu[i * 2 * Ie + Ie + j]));
        }
}

// gpt_oss's clamped gate: (clamp(u, -limit, limit) + 1) g sigmoid(alpha g), g = min(gate, limit),
// from gu (rows, 2 Ie) = [g | u].
template <class T>
__global__ static void glu_clamped_kernel(int64_t rows, int64_t Ie, float alpha, float limit, const T *gu, T *s)
{
    for (int64_t i = blockIdx.x; i < rows; i += gridDim.x)
        for (int64_t j = threadIdx.x; j < Ie; j += blockDim.x) {
            const float g = fminf(to_f(gu[i * 2 * Ie + j]), limit);
            const float u = fminf(fmaxf(to_f(gu[i * 2 * Ie + Ie + j]), -limit), limit);
            const float sig = 1.f / (1.f + expf(-(g * alpha)));
            s[i * Ie + j] = from_f<T>((u + 1.f) * (g * sig));
        }
}

// gu (rows, 2 Ie) = [g | u] += expert e's biases, gate j at bgu[e 2 Ie + 2j] and up j at 2j + 1
// (HF's interleaved gate_up_proj_bias), e the expert of grouped row i.
template <class T>
__global__ static void gu_bias_kernel(int64_t rows, int64_t Ie, const int32_t *order, const int32_t *experts,
                                      const T *bgu, T *gu)
{
    for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
        const int64_t e = experts[order[i]];
        for (int64_t j = threadIdx.x; j < Ie; j += blockDim.x) {
            gu[i * 2 * Ie + j] = from_f<T>(to_f(gu[i * 2 * Ie + j]) + to_f(bgu[e * 2 * Ie + 2 * j]));
            gu[i * 2 * Ie + Ie + j] = from_f<T>(to_f(gu[i * 2 * Ie + Ie + j]) + to_f(bgu[e * 2 * Ie + 2 * j + 1]));
        }
    }
}

// o (rows, d) fp32 += expert e's down bias bd (E, d) on grouped row i (inside the routing weight,
// which the combine applies).
template <class T>
__global__ static void down_bias_kernel(int64_t rows, int64_t d, const int32_t *order, const int32_t *experts,
                                        const T *bd, float *o)
{
    for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
        const int64_t e = experts[order[i]];
        for (int64_t j = threadIdx.x; j < d; j += blockDim.x) o[i * d + j] += to_f(bd[e * d + j]);
    }
}

// Per grouped row i with routing weight w = weights[order[i]], from dz (the gradient at the
// forward's s, as T, before the weight): dw[i] = <dz, s>, ws = w s (for the down matrix's
// gradient), and through the SwiGLU with ds = w dz: dgu = [dg | du]. s is recomputed from gu
// exactly as swiglu_kernel rounded it. blockDim.x a multiple of 32.
template <class T>
__global__ static void act_backward_kernel(int64_t rows, int64_t Ie, const T *gu, const float *dz,
                                           const int32_t *order, const float *weights, float *dw, T *ws, T *dgu)
{
    __shared__ float shared[32];
    for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) { // uniform over the block
        const float w = weights[order[i]];
        float acc = 0.f;
        for (int64_t j = threadIdx.x; j < Ie; j += blockDim.x) {
            const float g = to_f(gu[i * 2 * Ie + j]), u = to_f(gu[i * 2 * Ie + Ie + j]);
            const float sig = 1.f / (1.f + expf(-g));
            const float s = to_f(from_f<T>(g * sig * u)); // the forward's s
            const float z = dz[i * Ie + j], ds = w * z;
            acc += z * s;
            ws[i * Ie + j] = from_f<T>(w * s);
            dgu[i * 2 * Ie + j] = from_f<T>(ds * u * sig * (1.f + g * (1.f - sig)));
            dgu[i * 2 * Ie + Ie + j] = from_f<T>(ds * g * sig);
        }
        acc = mt_block_sum(acc, shared);
        if (threadIdx.x == 0) dw[i] = acc;
    }
}

// The same through gpt_oss's clamped gate: the clamps pass the gradient where the input lies
// within them, bounds included (torch.clamp's backward).
template <class T>
__global__ static void act_clamped_backward_kernel(int64_t rows, int64_t Ie, float alpha, float limit, const T *gu,
                                                   const float *dz, const int32_t *order, const float *weights,
                                                   float *dw, T *ws, T *dgu)
{
    __shared__ float shared[32];
    for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) { // uniform over the block
        const float w = weights[order[i]];
        float acc = 0.f;
        for (int64_t j = threadIdx.x; j < Ie; j += blockDim.x) {
            const float g0 = to_f(gu[i * 2 * Ie + j]), u0 = to_f(gu[i * 2 * Ie + Ie + j]);
            const bool g_in = g0 <= limit, u_in = u0 >= -limit && u0 <= limit;
            const float g = fminf(g0, limit), u = fminf(fmaxf(u0, -limit), limit);
            const float sig = 1.f / (1.f + expf(-(g * alpha)));
            const float s = to_f(from_f<T>((u + 1.f) * (g * sig))); // the forward's s
            const float z = dz[i * Ie + j], ds = w * z;
            acc += z * s;
            ws[i * Ie + j] = from_f<T>(w * s);
            dgu[i * 2 * Ie + j] = from_f<T>(g_in ? ds * (u + 1.f) * sig * (1.f + alpha * g * (1.f - sig)) : 0.f);
            dgu[i * 2 * Ie + Ie + j] = from_f<T>(u_in ? ds * g * sig : 0.f);
        }
        acc = mt_block_sum(acc, shared);
        if (threadIdx.x == 0) dw[i] = acc;
    }
}

// dw[i] += <dY row i, bd of its expert>: the down bias's share of the routing weight's gradient.
template <class T>
__global__ static void dw_down_bias_kernel(int64_t rows, int64_t d, const int32_t *order, const int32_t *experts,
                                           const T *bd, const T *dY, float *dw)
{
    __shared__ float shared[32];
    for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
        const int64_t e = experts[order[i]];
        float acc = 0.f;
        for (int64_t j = threadIdx.x; j < d; j += blockDim.x) acc += to_f(dY[i * d + j]) * to_f(bd[e * d + j]);
        acc = mt_block_sum(acc, shared);
        if (threadIdx.x == 0) dw[i] += acc;
    }
}

// The experts' bias gradients, each column of each expert summed over its grouped rows in order
// (no atomics): blockIdx.x the expert, columns by blockIdx.y and threads. down (dgu NULL): dbd (E,
// d) += w dY over the rows; gate/up (dY NULL): dbgu (E, 2 Ie) += dgu's columns, [dg | du] column
// c to HF's interleaved index (gate j at 2j, up j at 2j + 1).
template <class T>
__global__ static void expert_bias_grad_kernel(int64_t C, int64_t Ie, const int32_t *offsets, const int32_t *order,
                                               const float *weights, const T *dY, const T *dgu, float *db)
{
    const int64_t e = blockIdx.x, c = blockIdx.y * (int64_t)blockDim.x + threadIdx.x;
    if (c >= C) return;
    float acc = 0.f;
    for (int64_t i = offsets[e]; i < offsets[e + 1]; i++)
        acc += dY ? weights[order[i]] * to_f(dY[i * C + c]) : to_f(dgu[i * C + c]);
    const int64_t to = dY ? c : c < Ie ? 2 * c : 2 * (c - Ie) + 1;
    db[e * C + to] += acc;
}

// Element (r, j) of a row-major (R, C) matrix of T, as fp32: mt_colsum's summand.
template <class T> struct t_element {
    const T *m;
    int64_t C;
    __device__ float operator()(int64_t r, int64_t j) const { return to_f(m[r * C + j]); }
};

// y (n, d) fp32 = resid (NULL: 0) + sum over token t's k slots, in rank order, of weight x the
// grouped row pos[t k + j] of o (nk, d) fp32 (weights NULL: 1). No atomics: each token gathers.
__global__ static void combine_kernel(int64_t n, int64_t d, int k, const int32_t *pos, const float *weights,
                                      const float *o, const float *resid, float *y)
{
    for (int64_t t = blockIdx.x; t < n; t += gridDim.x)
        for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
            float acc = 0.f;
            for (int s = 0; s < k; s++) {
                const int64_t a = t * k + s;
                const float v = o[(int64_t)pos[a] * d + j];
                acc += weights ? weights[a] * v : v;
            }
            y[t * d + j] = resid ? resid[t * d + j] + acc : acc;
        }
}

// Blocks of a row-per-block kernel over `rows` rows (grid-stride beyond).
static unsigned row_blocks(int64_t rows) { return (unsigned)(rows < 1 ? 1 : rows < 65535 ? rows : 65535); }

// ---- the experts' GEMMs: cuBLAS, row-major in the HF convention (as linear.cu), one expert's rows ----
// A row-major (r, c) matrix with row stride ld is a column-major (c, r) one with leading dimension
// ld, so each product is computed as its transpose.

static const float gemm_one = 1.f, gemm_zero = 0.f;

// Y (r, out) [row stride ldy] = X (r, in) [ldx] W^T, W (out, in) contiguous. Y of ytype.
static void expert_forward(cublasHandle_t h, int64_t r, int64_t in, int64_t out, cudaDataType_t type, const void *X,
                           int64_t ldx, const void *W, void *Y, int64_t ldy, cudaDataType_t ytype)
{
    // Y^T (out, r) = op_T(W stored (in, out)) * X stored (in, r)
    CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)out, (int)r, (int)in, &gemm_one, W, type, (int)in, X,
                              type, (int)ldx, &gemm_zero, Y, ytype, (int)ldy, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// dX (r, in) fp32 [ldx] = or += (accumulate) dY (r, out) [ldy] W, W (out, in) contiguous.
static void expert_backward_input(cublasHandle_t h, int64_t r, int64_t in, int64_t out, cudaDataType_t type,
                                  const void *dY, int64_t ldy, const void *W, float *dX, int64_t ldx, bool accumulate)
{
    // dX^T (in, r) = W stored (in, out) * dY stored (out, r)
    CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, (int)in, (int)r, (int)out, &gemm_one, W, type, (int)in, dY,
                              type, (int)ldy, accumulate ? &gemm_one : &gemm_zero, dX, CUDA_R_32F, (int)ldx,
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// dW (out, in) fp32 contiguous += dY (r, out) [ldy]^T X (r, in) [ldx].
static void expert_backward_weight(cublasHandle_t h, int64_t r, int64_t in, int64_t out, cudaDataType_t type,
                                   const void *X, int64_t ldx, const void *dY, int64_t ldy, float *dW)
{
    // dW^T (in, out) = X stored (in, r) * op_T(dY stored (out, r))
    CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, (int)in, (int)out, (int)r, &gemm_one, X, type, (int)ldx, dY,
                              type, (int)ldy, &gemm_one, dW, CUDA_R_32F, (int)in, CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT));
}

// The context's cuBLAS handle on `stream`, with the context's GEMM workspace (setting the stream
// resets cuBLAS to its own workspace pool, which would allocate).
static cublasHandle_t blas_on(mt_cuda_ctx *ctx, cudaStream_t stream)
{
    CUBLAS_CHECK(cublasSetStream(ctx->blas, stream));
    CUBLAS_CHECK(cublasSetWorkspace(ctx->blas, ctx->gemm_workspace, ctx->gemm_workspace_bytes));
    return ctx->blas;
}

__global__ static void copy_offsets_kernel(int n, const int32_t *from, int32_t *to)
{
    for (int i = threadIdx.x; i < n; i += blockDim.x) to[i] = from[i];
}

// The group offsets (E + 1) on the host, once the stream has computed them: stored by a kernel
// through the context's mapped host buffer (the SMs' writes cross the bus on their own, queued
// behind no copy), read after the stream's synchronisation, which makes them visible.
static void offsets_to_host(mt_cuda_ctx *ctx, const int32_t *offsets, int64_t E, int32_t *host, cudaStream_t stream)
{
    int32_t *mapped;
    CUDA_CHECK(cudaHostGetDevicePointer((void **)&mapped, ctx->host_offsets, 0));
    copy_offsets_kernel<<<1, 256, 0, stream>>>((int)(E + 1), offsets, mapped);
    CUDA_CHECK_LAUNCH();
    CUDA_CHECK(cudaStreamSynchronize(stream));
    memcpy(host, ctx->host_offsets, (size_t)(E + 1) * sizeof(int32_t));
}

// ---- forward ----

template <class T>
void mt_moe_forward(mt_cuda_ctx *ctx, const mt_model_config *cfg, const mt_tile_layout *layout, const T *tile,
                    int64_t n, const T *hn, const float *resid, float *y, const mt_moe_saved<T> *sv,
                    double *router_stats, void *scratch, cudaStream_t stream)
{
    mt_moe_check(cfg, layout, n);
    if (n <= 0) return;
    const int64_t d = cfg->hidden, E = cfg->experts, k = cfg->experts_per_token, Ie = cfg->expert_intermediate;
    const int64_t nk = n * k;
    const cudaDataType_t type = mt_cuda_type<T>();
    mt_carve c = {(char *)scratch, 0};
    moe_fwd_scratch<T> s;
    fwd_carve(cfg, n, &c, &s);

    // Router: logits (n, E) fp32 into probs, the softmax in place, the top k, the grouping.
    mt_linear_forward(ctx, n, d, E, hn, tile + layout->tensors[MT_L_ROUTER_W].offset, nullptr, sv->probs, CUDA_R_32F,
                      stream);
    const mt_tensor_desc *rb = &layout->tensors[MT_L_ROUTER_B];
    if (rb->numel > 0) mt_layer_add_bias(n, E, tile + rb->offset, sv->probs, stream); // gpt_oss's router bias
    mt_moe_router_softmax(n, E, sv->probs, sv->probs, stream);
    mt_moe_router_topk(n, E, k, cfg->norm_topk_prob, sv->probs, sv->experts, sv->weights, stream);
    mt_moe_group(n, E, k, sv->experts, sv->offsets, sv->order, sv->pos, s.group, stream);
    if (router_stats) mt_moe_router_stats(n, E, sv->probs, sv->offsets, router_stats, stream);
    gather_kernel<<<row_blocks(nk), 256, 0, stream>>>(nk, d, (int)k, sv->order, hn, s.X);
    CUDA_CHECK_LAUNCH();
    int32_t off[MT_MAX_EXPERTS + 1];
    offsets_to_host(ctx, sv->offsets, E, off, stream);

    // Each expert over its rows: gu = X [Wg; Wu]^T, s = silu(g) u, o = s Wd^T. An expert no token
    // chose computes nothing.
    cublasHandle_t h = blas_on(ctx, stream);
    const bool fused = gate_up_adjacent(cfg, layout);
    for (int e = 0; e < (int)E; e++) {
        const int64_t first = off[e], r = off[e + 1] - first;
        if (r == 0) continue;
        const T *X = s.X + first * d;
        T *gu = sv->gu + first * 2 * Ie;
        if (fused) {
            expert_forward(h, r, d, 2 * Ie, type, X, d, expert_matrix(layout, tile, e, MT_X_GATE), gu, 2 * Ie, type);
        } else {
            expert_forward(h, r, d, Ie, type, X, d, expert_matrix(layout, tile, e, MT_X_GATE), gu, 2 * Ie, type);
            expert_forward(h, r, d, Ie, type, X, d, expert_matrix(layout, tile, e, MT_X_UP), gu + Ie, 2 * Ie, type);
        }
    }
    const mt_tensor_desc *gub = &layout->tensors[MT_L_EXPERT_GU_B], *db = &layout->tensors[MT_L_EXPERT_DOWN_B];
    if (gub->numel > 0) { // gpt_oss: the biases of gate and up before the activation (saved with them)
        gu_bias_kernel<<<row_blocks(nk), 256, 0, stream>>>(nk, Ie, sv->order, sv->experts, tile + gub->offset, sv->gu);
        CUDA_CHECK_LAUNCH();
    }
    if (cfg->swiglu_alpha > 0)
        glu_clamped_kernel<<<row_blocks(nk), 256, 0, stream>>>(nk, Ie, (float)cfg->swiglu_alpha,
                                                               (float)cfg->swiglu_limit, sv->gu, s.s);
    else
        swiglu_kernel<<<row_blocks(nk), 256, 0, stream>>>(nk, Ie, sv->gu, s.s);
    CUDA_CHECK_LAUNCH();
    for (int e = 0; e < (int)E; e++) {
        const int64_t first = off[e], r = off[e + 1] - first;
        if (r == 0) continue;
        expert_forward(h, r, Ie, d, type, s.s + first * Ie, Ie, expert_matrix(layout, tile, e, MT_X_DOWN),
                       s.o + first * d, d, CUDA_R_32F);
    }
    if (db->numel > 0) {
        down_bias_kernel<<<row_blocks(nk), 256, 0, stream>>>(nk, d, sv->order, sv->experts, tile + db->offset, s.o);
        CUDA_CHECK_LAUNCH();
    }
    combine_kernel<<<row_blocks(n), 256, 0, stream>>>(n, d, (int)k, sv->pos, sv->weights, s.o, resid, y);
    CUDA_CHECK_LAUNCH();
}

// ---- backward ----

template <class T>
void mt_moe_backward(mt_cuda_ctx *ctx, const mt_model_config *cfg, const mt_tile_layout *layout, const T *tile,
                     int64_t n, const T *hn, const mt_moe_saved<T> *sv, const T *dy, const double *aux_counts,
                     double aux_scale, float *dhn, float *dtile, void *scratch, cudaStream_t stream)
{
    mt_moe_check(cfg, layout, n);
    if (n <= 0) return;
    const int64_t d = cfg->hidden, E = cfg->experts, k = cfg->experts_per_token, Ie = cfg->expert_intermediate;
    const int64_t nk = n * k;
    const cudaDataType_t type = mt_cuda_type<T>();
    mt_carve c = {(char *)scratch, 0};
    moe_bwd_scratch<T> s;
    bwd_carve(cfg, n, &c, &s);

    gather_kernel<<<row_blocks(nk), 256, 0, stream>>>(nk, d, (int)k, sv->order, hn, s.X);
    CUDA_CHECK_LAUNCH();
    gather_kernel<<<row_blocks(nk), 256, 0, stream>>>(nk, d, (int)k, sv->order, dy, s.dY);
    CUDA_CHECK_LAUNCH();
    int32_t off[MT_MAX_EXPERTS + 1];
    offsets_to_host(ctx, sv->offsets, E, off, stream);
    cublasHandle_t h = blas_on(ctx, stream);
    const bool fused = gate_up_adjacent(cfg, layout);

    // dz = dY Wd per expert; then per row dw = <dz, s>, ws = w s, dgu through the SwiGLU.
    for (int e = 0; e < (int)E; e++) {
        const int64_t first = off[e], r = off[e + 1] - first;
        if (r == 0) continue;
        expert_backward_input(h, r, Ie, d, type, s.dY + first * d, d, expert_matrix(layout, tile, e, MT_X_DOWN),
                              s.dz + first * Ie, Ie, false);
    }
    if (cfg->swiglu_alpha > 0)
        act_clamped_backward_kernel<<<row_blocks(nk), 256, 0, stream>>>(nk, Ie, (float)cfg->swiglu_alpha,
                                                                        (float)cfg->swiglu_limit, sv->gu, s.dz,
                                                                        sv->order, sv->weights, s.dw, s.ws, s.dgu);
    else
        act_backward_kernel<<<row_blocks(nk), 256, 0, stream>>>(nk, Ie, sv->gu, s.dz, sv->order, sv->weights, s.dw,
                                                                s.ws, s.dgu);
    CUDA_CHECK_LAUNCH();
    // gpt_oss's expert biases: the down bias's share of dw, and both biases' gradients
    const mt_tensor_desc *gub = &layout->tensors[MT_L_EXPERT_GU_B], *db = &layout->tensors[MT_L_EXPERT_DOWN_B];
    if (db->numel > 0) {
        dw_down_bias_kernel<<<row_blocks(nk), 256, 0, stream>>>(nk, d, sv->order, sv->experts, tile + db->offset,
                                                                s.dY, s.dw);
        CUDA_CHECK_LAUNCH();
        expert_bias_grad_kernel<T><<<dim3((unsigned)E, (unsigned)((d + 255) / 256)), 256, 0, stream>>>(
            d, Ie, sv->offsets, sv->order, sv->weights, s.dY, nullptr, dtile + db->offset);
        CUDA_CHECK_LAUNCH();
    }
    if (gub->numel > 0) {
        expert_bias_grad_kernel<T><<<dim3((unsigned)E, (unsigned)((2 * Ie + 255) / 256)), 256, 0, stream>>>(
            2 * Ie, Ie, sv->offsets, sv->order, sv->weights, nullptr, s.dgu, dtile + gub->offset);
        CUDA_CHECK_LAUNCH();
    }
    // Weight gradients (+=): dWd += dY^T ws, [dWg; dWu] += dgu^T X. An expert no token chose keeps
    // its gradient as it is.
    for (int e = 0; e < (int)E; e++) {
        const int64_t first = off[e], r = off[e + 1] - first;
        if (r == 0) continue;
        const T *X = s.X + first * d, *dgu = s.dgu + first * 2 * Ie;
        expert_backward_weight(h, r, Ie, d, type, s.ws + first * Ie, Ie, s.dY + first * d, d,
                               expert_matrix(layout, dtile, e, MT_X_DOWN));
        if (fused) {
            expert_backward_weight(h, r, d, 2 * Ie, type, X, d, dgu, 2 * Ie, expert_matrix(layout, dtile, e, MT_X_GATE));
        } else {
            expert_backward_weight(h, r, d, Ie, type, X, d, dgu, 2 * Ie, expert_matrix(layout, dtile, e, MT_X_GATE));
            expert_backward_weight(h, r, d, Ie, type, X, d, dgu + Ie, 2 * Ie,
                                   expert_matrix(layout, dtile, e, MT_X_UP));
        }
    }
    // Input gradients, over X and dY (dead now): dX = dgu [Wg; Wu].
    for (int e = 0; e < (int)E; e++) {
        const int64_t first = off[e], r = off[e + 1] - first;
        if (r == 0) continue;
        const T *dgu = s.dgu + first * 2 * Ie;
        float *dX = s.dX + first * d;
        if (fused) {
            expert_backward_input(h, r, d, 2 * Ie, type, dgu, 2 * Ie, expert_matrix(layout, tile, e, MT_X_GATE), dX, d,
                                  false);
        } else {
            expert_backward_input(h, r, d, Ie, type, dgu, 2 * Ie, expert_matrix(layout, tile, e, MT_X_GATE), dX, d,
                                  false);
            expert_backward_input(h, r, d, Ie, type, dgu + Ie, 2 * Ie, expert_matrix(layout, tile, e, MT_X_UP), dX, d,
                                  true);
        }
    }
    // dhn = the sum of each token's k input gradients (the weights are inside them already), then
    // the router's share: dlogits from dw and the load-balancing loss, dWr += dlogits^T hn, dhn +=
    // dlogits Wr.
    combine_kernel<<<row_blocks(n), 256, 0, stream>>>(n, d, (int)k, sv->pos, nullptr, s.dX, nullptr, dhn);
    CUDA_CHECK_LAUNCH();
    mt_moe_router_backward(n, E, k, cfg->norm_topk_prob, sv->probs, sv->experts, sv->pos, s.dw, aux_counts, aux_scale,
                           s.dlogits, stream);
    const T *router = tile + layout->tensors[MT_L_ROUTER_W].offset;
    mt_linear_backward_weight(ctx, n, d, E, hn, s.dlogits, dtile + layout->tensors[MT_L_ROUTER_W].offset, true,
                              stream);
    const mt_tensor_desc *rb = &layout->tensors[MT_L_ROUTER_B];
    if (rb->numel > 0) // the router bias's gradient: dlogits' column sums
        mt_colsum(t_element<T>{s.dlogits, E}, n, E, dtile + rb->offset, true, s.partials, stream);
    mt_linear_backward_input(ctx, n, d, E, s.dlogits, router, dhn, CUDA_R_32F, true, stream);
}

#define MOE_INSTANTIATE(T)                                                                                       \
    template void mt_moe_saved_carve<T>(const mt_model_config *, int64_t, mt_carve *, mt_moe_saved<T> *);         \
    template size_t mt_moe_forward_scratch_bytes<T>(const mt_model_config *, int64_t);                           \
    template size_t mt_moe_backward_scratch_bytes<T>(const mt_model_config *, int64_t);                          \
    template void mt_moe_forward<T>(mt_cuda_ctx *, const mt_model_config *, const mt_tile_layout *, const T *,    \
                                    int64_t, const T *, const float *, float *, const mt_moe_saved<T> *,          \
                                    double *, void *, cudaStream_t);                                             \
    template void mt_moe_backward<T>(mt_cuda_ctx *, const mt_model_config *, const mt_tile_layout *, const T *,   \
                                     int64_t, const T *, const mt_moe_saved<T> *, const T *, const double *,      \
                                     double, float *, float *, void *, cudaStream_t);
MOE_INSTANTIATE(bf16)
MOE_INSTANTIATE(float)

// ---- C entry points (kernels.h): the block alone, its saved set in `saved` or in scratch ----

template <class T> static size_t saved_bytes(const mt_model_config *cfg, int64_t n)
{
    mt_carve c = {nullptr, 0};
    mt_moe_saved<T> s;
    mt_moe_saved_carve(cfg, n, &c, &s);
    return mt_carve_size(&c);
}

template <class T> static size_t scratch_bytes(const mt_model_config *cfg, int64_t n)
{
    const size_t fwd = saved_bytes<T>(cfg, n) + mt_moe_forward_scratch_bytes<T>(cfg, n);
    const size_t bwd = mt_moe_backward_scratch_bytes<T>(cfg, n);
    return fwd > bwd ? fwd : bwd;
}

// The saved set of n tokens at the start of `saved`, or of scratch (then *rest is past it).
template <class T>
static mt_moe_saved<T> saved_view(const mt_model_config *cfg, int64_t n, void *saved, void *scratch, void **rest)
{
    mt_moe_saved<T> s;
    mt_carve c = {(char *)(saved ? saved : scratch), 0};
    mt_moe_saved_carve(cfg, n, &c, &s);
    *rest = saved ? scratch : (char *)scratch + mt_carve_size(&c);
    return s;
}

extern "C" size_t mt_cuda_moe_saved_bytes(const mt_model_config *cfg, mt_cuda_prec prec, int64_t ntok)
{
    return prec == MT_CUDA_F32 ? saved_bytes<float>(cfg, ntok) : saved_bytes<bf16>(cfg, ntok);
}

extern "C" size_t mt_cuda_moe_scratch_bytes(const mt_model_config *cfg, mt_cuda_prec prec, int64_t ntok)
{
    return prec == MT_CUDA_F32 ? scratch_bytes<float>(cfg, ntok) : scratch_bytes<bf16>(cfg, ntok);
}

template <class T>
static void forward_entry(mt_cuda_ctx *ctx, const mt_model_config *cfg, const mt_tile_layout *layout, const void *tile,
                          int64_t ntok, const void *hn, const float *resid, float *y, void *saved, void *scratch,
                          cudaStream_t stream)
{
    void *rest;
    const mt_moe_saved<T> sv = saved_view<T>(cfg, ntok, saved, scratch, &rest);
    mt_moe_forward(ctx, cfg, layout, (const T *)tile, ntok, (const T *)hn, resid, y, &sv, nullptr, rest, stream);
}

extern "C" void mt_cuda_moe_forward(mt_cuda_ctx *ctx, const mt_model_config *cfg, const mt_tile_layout *layout,
                                    mt_cuda_prec prec, const void *tile, int64_t ntok, const void *hn,
                                    const float *resid, float *y, void *saved, void *scratch, mt_cuda_stream stream)
{
    if (prec == MT_CUDA_F32)
        forward_entry<float>(ctx, cfg, layout, tile, ntok, hn, resid, y, saved, scratch, as_stream(stream));
    else
        forward_entry<bf16>(ctx, cfg, layout, tile, ntok, hn, resid, y, saved, scratch, as_stream(stream));
}

extern "C" void mt_cuda_moe_backward(mt_cuda_ctx *ctx, const mt_model_config *cfg, const mt_tile_layout *layout,
                                     mt_cuda_prec prec, const void *tile, int64_t ntok, const void *hn,
                                     const void *saved, const void *dy, float *dhn, float *dtile, void *scratch,
                                     mt_cuda_stream stream)
{
    MT_CUDA_REQUIRE(saved != nullptr, "the MoE backward needs the saved set of its forward");
    void *rest;
    if (prec == MT_CUDA_F32) {
        const mt_moe_saved<float> sv = saved_view<float>(cfg, ntok, (void *)saved, scratch, &rest);
        mt_moe_backward(ctx, cfg, layout, (const float *)tile, ntok, (const float *)hn, &sv, (const float *)dy,
                        nullptr, 0.0, dhn, dtile, rest, as_stream(stream));
    } else {
        const mt_moe_saved<bf16> sv = saved_view<bf16>(cfg, ntok, (void *)saved, scratch, &rest);
        mt_moe_backward(ctx, cfg, layout, (const bf16 *)tile, ntok, (const bf16 *)hn, &sv, (const bf16 *)dy,
                        nullptr, 0.0, dhn, dtile, rest, as_stream(stream));
    }
}
