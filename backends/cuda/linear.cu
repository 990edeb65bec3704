// Linear layers on cuBLASLt. cuBLASLt is column-major; our tensors are row-major, and a row-major
// (r, c) matrix with row stride c is exactly a column-major (c, r) matrix with ld = c. So each
// row-major product is computed as its transpose:
//   forward   y (n,out) = x W^T      <=>  y^T (out,n)  = op_T(W as (in,out)) * (x as (in,n))
//   d input   dx (n,in) = dy W       <=>  dx^T (in,n)  = (W as (in,out))     * (dy as (out,n))
//   d weight  dW (out,in) = dy^T x   <=>  dW^T (in,out) = (x as (in,n))      * op_T(dy as (out,n))
// Descriptors and the heuristic's algorithm are cached per shape in the thread's context.
#include <string.h>

#include "backends/cuda/linear.cuh"

// Everything that makes two GEMM calls interchangeable for one cached plan. Pointer alignments
// are part of it: the algorithm chosen for 256-byte aligned operands may not accept 128.
struct gemm_key {
    int32_t transa, transb; // op on the stored A / B
    int64_t m, n, k;        // column-major GEMM dimensions: D (m, n) = op(A) (m, k) op(B) (k, n)
    int64_t lda, ldb, ldd;  // leading dimensions of the stored matrices (C shares D's)
    int32_t abtype;         // cudaDataType_t of A and B (bf16 or fp32)
    int32_t dtype;          // cudaDataType_t of C and D
    int32_t bias;           // CUBLASLT_EPILOGUE_BIAS with a vector of m in D's type
    uint32_t align_a, align_b, align_c, align_d, align_bias;
};

struct gemm_plan {
    bool used;
    gemm_key key;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, cd; // C and D share one layout (in-place C == D is allowed)
    cublasLtMatmulAlgo_t algo;
};

#define GEMM_CACHE_SIZE 128 // a model uses ~20 shapes; older entries are recycled round-robin

struct mt_gemm_cache {
    gemm_plan plans[GEMM_CACHE_SIZE];
    int next; // slot to recycle when the cache is full
};

// Largest power of two up to 256 dividing the address (cuBLASLt's alignment preferences).
static uint32_t alignment_of(const void *p)
{
    const uintptr_t a = (uintptr_t)p;
    uint32_t al = 256;
    while (al > 1 && a % al != 0) al >>= 1;
    return al;
}

static void plan_destroy(gemm_plan *p)
{
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(p->a));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(p->b));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(p->cd));
    CUBLAS_CHECK(cublasLtMatmulDescDestroy(p->desc));
    p->used = false;
}

// Builds descriptors for `key` and asks the heuristic for its best algorithm. `bias` is the actual
// bias pointer: the heuristic reads its alignment from it.
static void plan_create(mt_cuda_ctx *ctx, const gemm_key *key, const void *bias, gemm_plan *p)
{
    p->key = *key;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = key->transa ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t tb = key->transb ? CUBLAS_OP_T : CUBLAS_OP_N;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    if (key->bias) {
        const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
        const int32_t bias_type = key->dtype; // D's type, the default: said explicitly
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                                    sizeof bias_type));
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
    }
    // Stored shapes: op_T(A) is (m, k), so a transposed A is stored (k, m).
    const uint64_t a_rows = key->transa ? key->k : key->m, a_cols = key->transa ? key->m : key->k;
    const uint64_t b_rows = key->transb ? key->n : key->k, b_cols = key->transb ? key->k : key->n;
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->a, (cudaDataType_t)key->abtype, a_rows, a_cols, key->lda));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->b, (cudaDataType_t)key->abtype, b_rows, b_cols, key->ldb));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->cd, (cudaDataType_t)key->dtype, (uint64_t)key->m,
                                            (uint64_t)key->n, key->ldd));

    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = ctx->gemm_workspace_bytes;
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &key->align_a, sizeof(uint32_t)));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &key->align_b, sizeof(uint32_t)));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &key->align_c, sizeof(uint32_t)));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &key->align_d, sizeof(uint32_t)));
    cublasLtMatmulHeuristicResult_t result;
    int found = 0;
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(ctx->lt, p->desc, p->a, p->b, p->cd, p->cd, pref, 1,
                                                             &result, &found);
    CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
    if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
        fprintf(stderr,
                "cuBLASLt found no algorithm for D(%lld,%lld) = op%s(A) op%s(B), k=%lld, lda=%lld ldb=%lld "
                "ldd=%lld, A/B type %d, D type %d, bias %d, alignments A%u B%u C%u D%u bias%u\n",
                (long long)key->m, (long long)key->n, key->transa ? "T" : "N", key->transb ? "T" : "N",
                (long long)key->k, (long long)key->lda, (long long)key->ldb, (long long)key->ldd, key->abtype, key->dtype,
                key->bias, key->align_a, key->align_b, key->align_c, key->align_d, key->align_bias);
        CUBLAS_CHECK(st != CUBLAS_STATUS_SUCCESS ? st : CUBLAS_STATUS_NOT_SUPPORTED);
    }
    p->algo = result.algo;
    p->used = true;
}

// The cached plan for `key`, created on a miss.
static gemm_plan *plan_get(mt_cuda_ctx *ctx, const gemm_key *key, const void *bias)
{
    if (!ctx->gemm_cache) {
        ctx->gemm_cache = (mt_gemm_cache *)calloc(1, sizeof(mt_gemm_cache));
        MT_CUDA_REQUIRE(ctx->gemm_cache != nullptr, "out of host memory for the GEMM cache");
    }
    mt_gemm_cache *cache = ctx->gemm_cache;
    for (int i = 0; i < GEMM_CACHE_SIZE; i++)
        if (cache->plans[i].used && memcmp(&cache->plans[i].key, key, sizeof *key) == 0) return &cache->plans[i];
    gemm_plan *p = &cache->plans[cache->next];
    cache->next = (cache->next + 1) % GEMM_CACHE_SIZE;
    // Destroying descriptors is host-only; a GEMM already enqueued with them keeps its own copy.
    if (p->used) plan_destroy(p);
    plan_create(ctx, key, bias, p);
    return p;
}

// Column-major D (m, n) = op(A) op(B) + beta C, C == D's buffer unless given (residual form).
// A and B are of type abtype; a bias is of D's type, which must then be abtype.
static void gemm(mt_cuda_ctx *ctx, bool transa, bool transb, int64_t m, int64_t n, int64_t k, cudaDataType_t abtype,
                 const void *A, int64_t lda, const void *B, int64_t ldb, const void *C, void *D, int64_t ldd,
                 cudaDataType_t dtype, float beta, const void *bias, cudaStream_t stream)
{
    MT_CUDA_REQUIRE(!bias || dtype == abtype, "a bias epilogue needs an output of the inputs' type");
    if (m <= 0 || n <= 0) return;
    if (!C) C = D;
    const size_t esize = dtype == CUDA_R_32F ? 4 : 2;
    if (k <= 0) { // an empty product: D = beta C
        if (beta == 0.f) CUDA_CHECK(cudaMemsetAsync(D, 0, (size_t)(m * n) * esize, stream));
        else if (C != D) CUDA_CHECK(cudaMemcpyAsync(D, C, (size_t)(m * n) * esize, cudaMemcpyDeviceToDevice, stream));
        return;
    }
    gemm_key key;
    memset(&key, 0, sizeof key); // padding too: keys are compared with memcmp
    key.transa = transa;
    key.transb = transb;
    key.m = m;
    key.n = n;
    key.k = k;
    key.lda = lda;
    key.ldb = ldb;
    key.ldd = ldd;
    key.abtype = (int32_t)abtype;
    key.dtype = (int32_t)dtype;
    key.bias = bias != nullptr;
    key.align_a = alignment_of(A);
    key.align_b = alignment_of(B);
    key.align_c = alignment_of(C);
    key.align_d = alignment_of(D);
    key.align_bias = bias ? alignment_of(bias) : 0;
    gemm_plan *p = plan_get(ctx, &key, bias);
    if (bias)
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
    const float alpha = 1.f;
    CUBLAS_CHECK(cublasLtMatmul(ctx->lt, p->desc, &alpha, A, p->a, B, p->b, &beta, C, p->cd, D, p->cd, &p->algo,
                                ctx->gemm_workspace, ctx->gemm_workspace_bytes, stream));
}

template <class T>
void mt_linear_forward(mt_cuda_ctx *ctx, int64_t n, int64_t in, int64_t out, const T *x, const T *W,
                       const mt_same<T> *bias, void *y, cudaDataType_t ytype, cudaStream_t stream)
{
    // y^T (out, n) = op_T(W stored (in, out)) * x stored (in, n)
    gemm(ctx, true, false, out, n, in, mt_cuda_type<T>(), W, in, x, in, nullptr, y, out, ytype, 0.f, bias, stream);
}

template <class T>
void mt_linear_forward_residual(mt_cuda_ctx *ctx, int64_t n, int64_t in, int64_t out, const T *x, const T *W,
                                const float *resid, float *y, cudaStream_t stream)
{
    gemm(ctx, true, false, out, n, in, mt_cuda_type<T>(), W, in, x, in, resid, y, out, CUDA_R_32F, 1.f, nullptr,
         stream);
}

template <class T>
void mt_linear_backward_input(mt_cuda_ctx *ctx, int64_t n, int64_t in, int64_t out, const T *dy, const T *W,
                              void *dx, cudaDataType_t dxtype, bool accumulate, cudaStream_t stream)
{
    MT_CUDA_REQUIRE(!accumulate || dxtype == CUDA_R_32F, "dx += needs an fp32 dx");
    // dx^T (in, n) = W stored (in, out) * dy stored (out, n)
    gemm(ctx, false, false, in, n, out, mt_cuda_type<T>(), W, in, dy, out, nullptr, dx, in, dxtype,
         accumulate ? 1.f : 0.f, nullptr, stream);
}

template <class T>
void mt_linear_backward_weight(mt_cuda_ctx *ctx, int64_t n, int64_t in, int64_t out, const T *x, const T *dy,
                               float *dW, bool accumulate, cudaStream_t stream)
{
    // dW^T (in, out) = x stored (in, n) * op_T(dy stored (out, n))
    gemm(ctx, false, true, in, out, n, mt_cuda_type<T>(), x, in, dy, out, nullptr, dW, in, CUDA_R_32F,
         accumulate ? 1.f : 0.f, nullptr, stream);
}

// The two operand types the backend builds.
#define LINEAR_INSTANTIATE(T)                                                                                    \
    template void mt_linear_forward<T>(mt_cuda_ctx *, int64_t, int64_t, int64_t, const T *, const T *,           \
                                       const mt_same<T> *, void *, cudaDataType_t, cudaStream_t);               \
    template void mt_linear_forward_residual<T>(mt_cuda_ctx *, int64_t, int64_t, int64_t, const T *, const T *,  \
                                                const float *, float *, cudaStream_t);                           \
    template void mt_linear_backward_input<T>(mt_cuda_ctx *, int64_t, int64_t, int64_t, const T *, const T *,   \
                                              void *, cudaDataType_t, bool, cudaStream_t);                       \
    template void mt_linear_backward_weight<T>(mt_cuda_ctx *, int64_t, int64_t, int64_t, const T *, const T *,  \
                                               float *, bool, cudaStream_t);
LINEAR_INSTANTIATE(bf16)
LINEAR_INSTANTIATE(float)
