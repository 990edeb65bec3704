// The cuDNN attention path's operation graphs, built with plain cudnnBackend* calls: the op
// sequence of cudnn-frontend 1.x's SDPANode / SDPABackwardNode for a causal, unbiased,
// dropout-free attention with GQA, which cuDNN's fused flash-attention engines' pattern matcher
// recognises (attention_cudnn.cu's header comment lists both graphs).
#include <stdio.h>

#include "backends/cuda/attention_cudnn_graph.cuh"

namespace mt_cudnn {

// The HANDLE attributes of the operation graph and the execution plan are deprecated in cuDNN
// 9.19 in favour of DEVICEPROP descriptors, which older 9.x releases lack; the handle form works
// on every 9.x. Named by value so the deprecation attribute does not warn.
const cudnnBackendAttributeName_t ATTR_OPERATIONGRAPH_HANDLE = (cudnnBackendAttributeName_t)800;
const cudnnBackendAttributeName_t ATTR_EXECUTION_PLAN_HANDLE = (cudnnBackendAttributeName_t)400;

static desc create(graph &g, cudnnBackendDescriptorType_t type, const char *what)
{
    if (g.failed) return nullptr;
    desc d = nullptr;
    cudnnStatus_t s = api.CreateDescriptor(type, &d);
    if (s != CUDNN_STATUS_SUCCESS) {
        g.fail("cudnnBackendCreateDescriptor", what, s);
        return nullptr;
    }
    g.owned.push_back(d);
    return d;
}

static void set_attr(graph &g, desc d, cudnnBackendAttributeName_t attr, cudnnBackendAttributeType_t type,
                     int64_t count, const void *value, const char *attr_name)
{
    if (g.failed) return;
    cudnnStatus_t s = api.SetAttribute(d, attr, type, count, value);
    if (s != CUDNN_STATUS_SUCCESS) g.fail("cudnnBackendSetAttribute", attr_name, s);
}
#define SET(g, d, attr, type, count, value) set_attr(g, d, attr, type, count, value, #attr)

static void finalize(graph &g, desc d, const char *what)
{
    if (g.failed) return;
    cudnnStatus_t s = api.Finalize(d);
    if (s != CUDNN_STATUS_SUCCESS) g.fail("cudnnBackendFinalize", what, s);
}

static desc tensor(graph &g, const char *what, cudnnDataType_t type, const layout &l, bool is_virtual,
                   int64_t uid = 0)
{
    desc t = create(g, CUDNN_BACKEND_TENSOR_DESCRIPTOR, what);
    if (uid == 0) uid = g.next_uid++;
    const int64_t align = 16;
    SET(g, t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type);
    SET(g, t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, l.dim);
    SET(g, t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, l.stride);
    SET(g, t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
    SET(g, t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align);
    if (is_virtual) {
        const bool v = true;
        SET(g, t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &v);
    }
    finalize(g, t, what);
    return t;
}

// A by-value fp32 scalar (1,1,1,1): its variant-pack pointer is a host pointer to the value.
static desc scalar(graph &g, const char *what, int64_t uid)
{
    const layout one = {{1, 1, 1, 1}, {1, 1, 1, 1}};
    desc t = create(g, CUDNN_BACKEND_TENSOR_DESCRIPTOR, what);
    const cudnnDataType_t type = CUDNN_DATA_FLOAT;
    const int64_t align = 16;
    const bool by_value = true;
    SET(g, t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type);
    SET(g, t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, one.dim);
    SET(g, t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, one.stride);
    SET(g, t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
    SET(g, t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align);
    SET(g, t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value);
    finalize(g, t, what);
    return t;
}

static void add_op(graph &g, desc op, const char *what)
{
    finalize(g, op, what);
    if (!g.failed) g.ops.push_back(op);
}

// y = mode(x [, b [, t]]) computed in prec; axis >= 0 for GEN_INDEX. BINARY_SELECT: y = t ? x : b.
static void pointwise(graph &g, const char *what, cudnnPointwiseMode_t mode, cudnnDataType_t prec, desc x, desc b,
                      desc t, desc y, int64_t axis = -1)
{
    desc pw = create(g, CUDNN_BACKEND_POINTWISE_DESCRIPTOR, what);
    SET(g, pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    SET(g, pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec);
    if (axis >= 0) SET(g, pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
    finalize(g, pw, what);
    desc op = create(g, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, what);
    SET(g, op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw);
    SET(g, op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    if (b) SET(g, op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b);
    if (t) SET(g, op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t);
    SET(g, op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    add_op(g, op, what);
}

// fp32 pointwise, the common case
static void pw_f32(graph &g, const char *what, cudnnPointwiseMode_t mode, desc x, desc b, desc y)
{
    pointwise(g, what, mode, CUDNN_DATA_FLOAT, x, b, nullptr, y);
}

// c = a b over the last two dims, batched over the first two (broadcast where a's or b's head
// dim is smaller: GQA), fp32 accumulation.
static void matmul(graph &g, const char *what, desc a, desc b, desc c)
{
    desc mm = create(g, CUDNN_BACKEND_MATMUL_DESCRIPTOR, what);
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    SET(g, mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp);
    finalize(g, mm, what);
    desc op = create(g, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, what);
    SET(g, op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a);
    SET(g, op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b);
    SET(g, op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c);
    SET(g, op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &mm);
    add_op(g, op, what);
}

// y = reduce(x) over the dims where y's extent is smaller than x's.
static void reduction(graph &g, const char *what, cudnnReduceTensorOp_t mode, desc x, desc y)
{
    desc r = create(g, CUDNN_BACKEND_REDUCTION_DESCRIPTOR, what);
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    SET(g, r, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode);
    SET(g, r, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp);
    finalize(g, r, what);
    desc op = create(g, CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, what);
    SET(g, op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    SET(g, op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    SET(g, op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &r);
    add_op(g, op, what);
}

// y = x seen through y's dims and strides (the transposes of the backward).
static void reshape(graph &g, const char *what, desc x, desc y)
{
    desc op = create(g, CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, what);
    SET(g, op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    SET(g, op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    add_op(g, op, what);
}

layouts layouts_of(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D)
{
    layouts l = {
        {{B, H, T, D}, {T * H * D, D, H * D, 1}},
        {{B, KV, D, T}, {T * KV * D, D, 1, KV * D}},
        {{B, KV, T, D}, {T * KV * D, D, KV * D, 1}},
        {{B, H, T, T}, {H * T * T, T * T, T, 1}},
        {{B, H, T, T}, {H * T * T, T * T, 1, T}},
        {{B, H, T, 1}, {H * T, T, 1, 1}},
        {{B, H, T, D}, {H * T * D, T * D, D, 1}},
    };
    return l;
}

const cudnnDataType_t F32 = CUDNN_DATA_FLOAT, BF16 = CUDNN_DATA_BFLOAT16;

// The causal mask on scores s (virtual fp32, layout ss): keep where row >= column, else fill.
static desc causal_mask(graph &g, const layouts &l, desc s, desc fill)
{
    desc row = tensor(g, "row index", CUDNN_DATA_INT32, l.ss, true);
    desc col = tensor(g, "column index", CUDNN_DATA_INT32, l.ss, true);
    desc keep = tensor(g, "causal keep", CUDNN_DATA_BOOLEAN, l.ss, true);
    desc out = tensor(g, "masked scores", F32, l.ss, true);
    pointwise(g, "GEN_INDEX row", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, s, nullptr, nullptr, row, 2);
    pointwise(g, "GEN_INDEX column", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, s, nullptr, nullptr, col, 3);
    pointwise(g, "CMP_GE row column", CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, col, nullptr, keep);
    pointwise(g, "BINARY_SELECT causal", CUDNN_POINTWISE_BINARY_SELECT, F32, s, fill, keep, out);
    return out;
}

void build_forward(graph &g, const layouts &l)
{
    desc Q = tensor(g, "Q", BF16, l.q, false, UID_Q);
    desc KT = tensor(g, "K^T", BF16, l.kt, false, UID_K);
    desc V = tensor(g, "V", BF16, l.kv, false, UID_V);
    desc O = tensor(g, "O", BF16, l.q, false, UID_O);
    desc stats = tensor(g, "Stats", F32, l.row, false, UID_STATS);
    desc scale = scalar(g, "scale", UID_SCALE);
    desc fill = scalar(g, "mask fill", UID_FILL);

    desc S = tensor(g, "S", F32, l.ss, true);
    matmul(g, "S = Q K^T", Q, KT, S);
    desc S1 = tensor(g, "S scaled", F32, l.ss, true);
    pw_f32(g, "S * scale", CUDNN_POINTWISE_MUL, S, scale, S1);
    desc S2 = causal_mask(g, l, S1, fill);

    desc M = tensor(g, "row max", F32, l.row, true);
    reduction(g, "REDUCTION MAX", CUDNN_REDUCE_TENSOR_MAX, S2, M);
    desc S3 = tensor(g, "S - max", F32, l.ss, true);
    pw_f32(g, "SUB max", CUDNN_POINTWISE_SUB, S2, M, S3);
    desc E = tensor(g, "exp", F32, l.ss, true);
    pw_f32(g, "EXP", CUDNN_POINTWISE_EXP, S3, nullptr, E);
    desc Z = tensor(g, "row sum", F32, l.row, true);
    reduction(g, "REDUCTION ADD", CUDNN_REDUCE_TENSOR_ADD, E, Z);
    desc logZ = tensor(g, "log row sum", F32, l.row, true);
    pw_f32(g, "LOG", CUDNN_POINTWISE_LOG, Z, nullptr, logZ);
    pw_f32(g, "Stats = max + log sum", CUDNN_POINTWISE_ADD, M, logZ, stats);
    desc P = tensor(g, "P", BF16, l.ss, true);
    pw_f32(g, "P = exp / sum", CUDNN_POINTWISE_DIV, E, Z, P);

    matmul(g, "O = P V", P, V, O);
}

// c (B,KV,T,D) = a b summed over the query heads of each group: with GQA the product over all H
// heads into a virtual bf16 (B,H,T,D), then REDUCTION ADD down to KV heads (as cudnn-frontend
// builds dK and dV); without, the product straight into c.
static void matmul_to_kv_heads(graph &g, const layouts &l, bool gqa, const char *what, desc a, desc b, desc c)
{
    if (!gqa) {
        matmul(g, what, a, b, c);
        return;
    }
    desc all = tensor(g, what, BF16, l.full, true);
    matmul(g, what, a, b, all);
    reduction(g, "REDUCTION ADD over the query heads", CUDNN_REDUCE_TENSOR_ADD, all, c);
}

void build_backward(graph &g, const layouts &l, bool gqa)
{
    desc Q = tensor(g, "Q", BF16, l.q, false, UID_Q);
    desc KT = tensor(g, "K^T", BF16, l.kt, false, UID_K);
    desc VT = tensor(g, "V^T", BF16, l.kt, false, UID_V);
    desc O = tensor(g, "O", BF16, l.q, false, UID_O);
    desc dO = tensor(g, "dO", BF16, l.q, false, UID_DO);
    desc stats = tensor(g, "Stats", F32, l.row, false, UID_STATS);
    desc dQ = tensor(g, "dQ", BF16, l.q, false, UID_DQ);
    desc dK = tensor(g, "dK", BF16, l.kv, false, UID_DK);
    desc dV = tensor(g, "dV", BF16, l.kv, false, UID_DV);
    desc sum = tensor(g, "softmax sum", F32, l.row, false, UID_SUM);
    desc dQacc = tensor(g, "dQ accumulator", F32, l.full, false, UID_DQACC);
    desc scale = scalar(g, "scale", UID_SCALE);
    desc one = scalar(g, "one", UID_ONE);
    desc fill = scalar(g, "mask fill", UID_FILL);

    // sum = rowsum(dO * O) (the softmax backward's Delta)
    desc dOO = tensor(g, "dO * O", F32, l.full, true);
    pw_f32(g, "MUL dO O", CUDNN_POINTWISE_MUL, dO, O, dOO);
    desc rs = tensor(g, "row sum dO O", F32, l.row, true);
    reduction(g, "REDUCTION ADD dO O", CUDNN_REDUCE_TENSOR_ADD, dOO, rs);
    pw_f32(g, "softmax sum * 1", CUDNN_POINTWISE_MUL, rs, one, sum);

    // P = exp(mask(S * scale - Stats))
    desc S = tensor(g, "S", F32, l.ss, true);
    matmul(g, "S = Q K^T", Q, KT, S);
    desc S1 = tensor(g, "S scaled", F32, l.ss, true);
    pw_f32(g, "S * scale", CUDNN_POINTWISE_MUL, S, scale, S1);
    desc S2 = tensor(g, "S - Stats", F32, l.ss, true);
    pw_f32(g, "SUB Stats", CUDNN_POINTWISE_SUB, S1, stats, S2);
    desc S3 = causal_mask(g, l, S2, fill);
    desc P = tensor(g, "P", F32, l.ss, true);
    pw_f32(g, "EXP", CUDNN_POINTWISE_EXP, S3, nullptr, P);

    // dV = P^T dO (summed over the query heads of a group)
    desc PT = tensor(g, "P^T", BF16, l.ss_t, true);
    reshape(g, "RESHAPE P^T", P, PT);
    matmul_to_kv_heads(g, l, gqa, "dV = P^T dO", PT, dO, dV);

    // dS = P (dO V^T - sum) scale
    desc dP = tensor(g, "dP", F32, l.ss, true);
    matmul(g, "dP = dO V^T", dO, VT, dP);
    // (cudnn-frontend's CompositeSDPABackwardNode goes straight from matmul_dO_VT to
    // sub_dP_softmax_sum when there is no dropout; an extra MUL by 1 here is an op the fused
    // backward engines' pattern does not have)
    desc dP2 = tensor(g, "dP - sum", F32, l.ss, true);
    pw_f32(g, "SUB softmax sum", CUDNN_POINTWISE_SUB, dP, sum, dP2);
    desc dS = tensor(g, "dS unscaled", F32, l.ss, true);
    pw_f32(g, "MUL P", CUDNN_POINTWISE_MUL, dP2, P, dS);
    desc dS1 = tensor(g, "dS", F32, l.ss, true);
    pw_f32(g, "dS * scale", CUDNN_POINTWISE_MUL, dS, scale, dS1);

    // dK = dS^T Q (summed over the query heads of a group)
    desc dST = tensor(g, "dS^T", BF16, l.ss_t, true);
    reshape(g, "RESHAPE dS^T", dS1, dST);
    matmul_to_kv_heads(g, l, gqa, "dK = dS^T Q", dST, Q, dK);

    // dQ = dS K, through the fp32 accumulator
    desc K = tensor(g, "K", F32, l.kv, true);
    reshape(g, "RESHAPE K", KT, K);
    matmul(g, "dQacc = dS K", dS1, K, dQacc);
    pw_f32(g, "IDENTITY dQ", CUDNN_POINTWISE_IDENTITY, dQacc, nullptr, dQ);
}

bool make_plan(graph &g, cudnnHandle_t h, desc *plan_out, int64_t *workspace, char *why, size_t n)
{
    desc og = create(g, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph");
    SET(g, og, ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &h);
    SET(g, og, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, (int64_t)g.ops.size(), g.ops.data());
    finalize(g, og, "operation graph");
    if (g.failed) {
        snprintf(why, n, "%s", g.why);
        return false;
    }
    char last[256] = "no engine config";
    int64_t tried = 0;
    const cudnnBackendHeurMode_t modes[] = {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK};
    for (cudnnBackendHeurMode_t mode : modes) {
        const char *mode_name = mode == CUDNN_HEUR_MODE_A ? "heuristics mode A" : "heuristics mode FALLBACK";
        graph hg; // this mode's descriptors: its errors are not fatal to the next mode
        desc heur = create(hg, CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, mode_name);
        SET(hg, heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &og);
        SET(hg, heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
        finalize(hg, heur, mode_name);
        int64_t count = 0;
        if (!hg.failed) {
            cudnnStatus_t s =
                api.GetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr);
            if (s != CUDNN_STATUS_SUCCESS) hg.fail("cudnnBackendGetAttribute", "CUDNN_ATTR_ENGINEHEUR_RESULTS count", s);
        }
        std::vector<desc> cfgs;
        for (int64_t i = 0; i < count && !hg.failed; i++)
            cfgs.push_back(create(hg, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine config"));
        int64_t got = 0;
        if (!hg.failed && count > 0) {
            cudnnStatus_t s = api.GetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                               count, &got, cfgs.data());
            if (s != CUDNN_STATUS_SUCCESS) hg.fail("cudnnBackendGetAttribute", "CUDNN_ATTR_ENGINEHEUR_RESULTS", s);
        }
        if (hg.failed) {
            snprintf(last, sizeof last, "%s", hg.why);
            hg.destroy_all();
            continue;
        }
        for (int64_t i = 0; i < got && i < count; i++) {
            tried++;
            desc plan = nullptr;
            cudnnStatus_t s = api.CreateDescriptor(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &plan);
            if (s != CUDNN_STATUS_SUCCESS) {
                status_why(last, sizeof last, "cudnnBackendCreateDescriptor", "execution plan", s);
                break;
            }
            s = api.SetAttribute(plan, ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &h);
            if (s == CUDNN_STATUS_SUCCESS)
                s = api.SetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                                     &cfgs[(size_t)i]);
            if (s == CUDNN_STATUS_SUCCESS) s = api.Finalize(plan);
            int64_t ws = 0, got_ws = 0;
            if (s == CUDNN_STATUS_SUCCESS)
                s = api.GetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &got_ws, &ws);
            if (s == CUDNN_STATUS_SUCCESS) {
                // keep the heuristics' descriptors (the chosen config among them) with the plan
                g.owned.insert(g.owned.end(), hg.owned.begin(), hg.owned.end());
                *plan_out = plan;
                *workspace = ws;
                return true;
            }
            char what[96];
            snprintf(what, sizeof what, "execution plan, engine config %lld of %lld, %s", (long long)i + 1,
                     (long long)got, mode_name);
            status_why(last, sizeof last, "cudnnBackendFinalize", what, s);
            api.DestroyDescriptor(plan);
        }
        hg.destroy_all();
    }
    snprintf(why, n, "no execution plan (%lld engine configs tried); last: %s", (long long)tried, last);
    return false;
}

} // namespace mt_cudnn
