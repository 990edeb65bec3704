// attention_cudnn: the optional cuDNN 9 fused-attention path behind mt_cuda_attention_forward /
// backward (selected by MT_ATTENTION=cudnn in attention.cu; the own kernel stays the default until
// this path has been measured). Written and built, not yet run on a GPU.
//
// Why the backend ("graph") C API and dlopen: cuDNN's fused flash-attention engines are reached by
// describing attention as an operation graph that their pattern matcher recognises; cudnn-frontend's
// sdpa nodes build exactly such graphs from backend descriptors. This file builds the same graphs
// (the op sequence of cudnn-frontend 1.x's SDPANode / SDPABackwardNode for a causal, unbiased,
// dropout-free attention with GQA) with plain cudnnBackend* calls, so the project needs neither the
// frontend's headers nor a link against cuDNN: libcudnn.so.9 is opened with dlopen at first use,
// and every way that can fail (no library, no GPU, an engine that does not take the graph, too
// little workspace) returns a reason and lets the caller run the own kernel.
//
// Tensors: the project's BTHD memory (row b*T + t, then head, then D) viewed as (B, heads, T, D)
// with strides (T*heads*D, D, heads*D, 1); K (and V in the backward) as the transposed view
// (B, KV, D, T) with strides (T*KV*D, D, 1, KV*D); GQA by K/V head dims KV < H (the engines map
// query head h to KV head h / (H/KV), the project's convention). Score-sized intermediates
// (B, H, T, T) are virtual: they only ever live in the engine's tiles.
//
// Forward graph (outputs O bf16, Stats fp32 (B,H,T,1) = max + log(sum exp) of the scaled, masked
// scores: the natural-log LSE attention.cu stores in lse (B,H,T), same memory layout):
//   S  = matmul(Q, K^T)                       virtual fp32
//   S1 = S * scale                            pointwise MUL, scale = 1/sqrt(D) a by-value scalar
//   row = GEN_INDEX(S1, axis 2), col = GEN_INDEX(S1, axis 3)        int32
//   keep = CMP_GE(row, col)                   boolean: query t sees keys 0..t
//   S2 = BINARY_SELECT(S1, fill, keep)        fill = -inf from cuDNN 9.10, -FLT_MAX before (mask_fill)
//   M = REDUCTION MAX(S2) over dim 3; E = EXP(S2 - M); Z = REDUCTION ADD(E)
//   Stats = M + LOG(Z); P = E / Z             P virtual bf16 (the second matmul's A type)
//   O  = matmul(P, V)
// Backward graph (cudnn-frontend's SDPABackwardNode for cuDNN >= 9, non-deterministic variant):
//   sum = REDUCTION ADD(dO * O) * 1           non-virtual fp32 (B,H,T,1) in the workspace
//   P   = EXP(mask(S1 - Stats))               S1 recomputed as above (mask after the SUB, as the
//                                             frontend orders it)
//   dV  = matmul(P^T, dO)                     P^T a RESHAPE (transposed strides) to bf16; GQA: into a
//                                             virtual (B,H,T,D) then REDUCTION ADD to (B,KV,T,D)
//   dS  = (matmul(dO, V^T) - sum) * P * scale (no "* 1" on dP: the frontend has none there without
//                                             dropout, and the engines match the op sequence)
//   dK  = matmul(dS^T, Q)                     dS^T a RESHAPE to bf16; GQA as dV
//   dQacc = matmul(dS, K)                     K a RESHAPE of K^T back to (B,KV,T,D); dQacc a
//                                             non-virtual fp32 (B,H,T,D) accumulator in the workspace
//   dQ  = IDENTITY(dQacc)
// dQ, dK, dV come out bf16 (the type the fused engines are built for) into the workspace, then
// mt_cuda_bf16_to_f32 writes the fp32 dq dk dv the interface promises (=, BTHD). The dQ
// accumulator takes float atomics inside cuDNN: unlike the own kernel, this backward is not
// bitwise reproducible run to run.
//
// Plans: one cuDNN handle per thread (created on first use, bound to that thread's current
// device; StarPU runs each CUDA worker on its own thread), and per thread a list of execution
// plans keyed by (B, T, H, KV, D, direction), built at first use of a shape (heuristics mode A,
// then FALLBACK; the first engine config whose plan finalizes) and kept for the thread's life. A
// shape whose plan fails is remembered too, so the failure costs one build. The hot path creates
// and destroys only a host-side variant pack and enqueues on the given stream: no device
// synchronisation. The forward interface has no workspace argument: a forward plan that asks for
// workspace gets it from one cudaMalloc when the plan is built (first use), kept with the plan.
//
// Workspace of the backward (mt_cuda_attention_cudnn_workspace_bytes, a pure function of the
// shape), each piece 256-byte aligned:
//   bf16 dQ, dK, dV copies   2 (B T H D + 2 B T KV D)
//   softmax sums (fp32)      4 B H T
//   dQ accumulator (fp32)    4 B H T D
//   the plan's own workspace 4 B H T D + 64 MiB (CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE is
//                            checked at every call against what is left; more needed: the own
//                            kernel runs). cuDNN 9.14's backward plan on the H200 asked for
//                            4 B H T D + 256 bytes (B 8 and 16, T 2048, H 16, KV 2, D 128,
//                            docs/gpu-logs/44-*): an fp32 dQ-sized buffer of its own.
#include <cudnn.h>
#include <dlfcn.h>
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <mutex>
#include <vector>

#include "backends/cuda/attention_cudnn.h"
#include "backends/cuda/common.cuh"

namespace {

typedef cudnnBackendDescriptor_t desc;

// ---------------------------------------------------------------- the library, loaded once

// The functions used, typed from cudnn.h; filled by dlsym.
struct cudnn_api {
    decltype(&cudnnGetVersion) GetVersion;
    decltype(&cudnnGetErrorString) GetErrorString;
    decltype(&cudnnGetLastErrorString) GetLastErrorString; // optional: the detail of the last error
    decltype(&cudnnCreate) Create;
    decltype(&cudnnSetStream) SetStream;
    decltype(&cudnnBackendCreateDescriptor) CreateDescriptor;
    decltype(&cudnnBackendDestroyDescriptor) DestroyDescriptor;
    decltype(&cudnnBackendSetAttribute) SetAttribute;
    decltype(&cudnnBackendGetAttribute) GetAttribute;
    decltype(&cudnnBackendFinalize) Finalize;
    decltype(&cudnnBackendExecute) Execute;
};

cudnn_api api;
size_t api_version;    // cudnnGetVersion() of the loaded library, e.g. 91900
bool api_loaded;       // set once by load_once
char api_why[256];     // why not, when not
std::once_flag api_once;

// The HANDLE attributes of the operation graph and the execution plan are deprecated in cuDNN
// 9.19 in favour of DEVICEPROP descriptors, which older 9.x releases lack; the handle form works
// on every 9.x. Named by value so the deprecation attribute does not warn.
const cudnnBackendAttributeName_t ATTR_OPERATIONGRAPH_HANDLE = (cudnnBackendAttributeName_t)800;
const cudnnBackendAttributeName_t ATTR_EXECUTION_PLAN_HANDLE = (cudnnBackendAttributeName_t)400;

void load_once()
{
    void *lib = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *e = dlerror();
        snprintf(api_why, sizeof api_why, "dlopen libcudnn.so.9: %s", e ? e : "unknown error");
        return;
    }
    const struct {
        void **slot;
        const char *name;
        bool required;
    } syms[] = {
        {(void **)&api.GetVersion, "cudnnGetVersion", true},
        {(void **)&api.GetErrorString, "cudnnGetErrorString", true},
        {(void **)&api.GetLastErrorString, "cudnnGetLastErrorString", false},
        {(void **)&api.Create, "cudnnCreate", true},
        {(void **)&api.SetStream, "cudnnSetStream", true},
        {(void **)&api.CreateDescriptor, "cudnnBackendCreateDescriptor", true},
        {(void **)&api.DestroyDescriptor, "cudnnBackendDestroyDescriptor", true},
        {(void **)&api.SetAttribute, "cudnnBackendSetAttribute", true},
        {(void **)&api.GetAttribute, "cudnnBackendGetAttribute", true},
        {(void **)&api.Finalize, "cudnnBackendFinalize", true},
        {(void **)&api.Execute, "cudnnBackendExecute", true},
    };
    for (const auto &s : syms) {
        *s.slot = dlsym(lib, s.name);
        if (!*s.slot && s.required) {
            snprintf(api_why, sizeof api_why, "dlsym %s in libcudnn.so.9: not found", s.name);
            dlclose(lib);
            return;
        }
    }
    api_version = api.GetVersion();
    if (api_version < 90000) {
        snprintf(api_why, sizeof api_why, "libcudnn.so.9 reports version %zu, older than 9.0.0", api_version);
        dlclose(lib);
        return;
    }
    api_loaded = true; // the library stays open for the process's life
}

bool load(char *why, size_t n)
{
    std::call_once(api_once, load_once);
    if (!api_loaded) snprintf(why, n, "%s", api_why);
    return api_loaded;
}

// "call (what): status text (code): detail" into why; clears a CUDA runtime error a failed call
// may have left behind, so that the own kernel's launch checks that follow do not see it.
void status_why(char *why, size_t n, const char *call, const char *what, cudnnStatus_t s)
{
    char detail[192] = "";
    if (api.GetLastErrorString) {
        api.GetLastErrorString(detail, sizeof detail);
        for (char *c = detail; *c; c++)
            if (*c == '\n' || *c == '\r') *c = ' ';
    }
    snprintf(why, n, "%s%s%s%s: %s (%d)%s%s", call, what ? " (" : "", what ? what : "", what ? ")" : "",
             api.GetErrorString(s), (int)s, detail[0] ? ": " : "", detail);
    (void)cudaGetLastError();
}

// ---------------------------------------------------------------- per-thread handle and plans

enum direction { FORWARD = 0, BACKWARD = 1 };

struct plan_entry {
    int64_t B, T, H, KV, D;
    int dir, device;
    desc plan;                 // NULL: building failed, why says why
    std::vector<desc> owned;   // the descriptors the plan was built from, kept alive with it
    int64_t workspace;         // the plan's own workspace bytes
    void *fwd_workspace;       // forward only: `workspace` bytes of device memory, from the build
    char why[256];
    plan_entry *next;
};

struct thread_state {
    bool tried;            // handle creation attempted on this thread
    cudnnHandle_t handle;  // NULL when that failed
    int device;            // the device current at creation
    char why[256];
    plan_entry *plans;     // never freed: plans live for the thread's life
};
thread_local thread_state tls;

cudnnHandle_t thread_handle(char *why, size_t n)
{
    if (!load(why, n)) return nullptr;
    if (!tls.tried) {
        tls.tried = true;
        cudnnStatus_t s = api.Create(&tls.handle);
        if (s != CUDNN_STATUS_SUCCESS) {
            status_why(tls.why, sizeof tls.why, "cudnnCreate", nullptr, s);
            tls.handle = nullptr;
        } else if (cudaGetDevice(&tls.device) != cudaSuccess) {
            snprintf(tls.why, sizeof tls.why, "cudaGetDevice: %s", cudaGetErrorString(cudaGetLastError()));
            tls.handle = nullptr; // (the handle leaks: this thread has no usable device anyway)
        }
    }
    if (!tls.handle) {
        snprintf(why, n, "%s", tls.why);
        return nullptr;
    }
    int dev = -1;
    if (cudaGetDevice(&dev) != cudaSuccess || dev != tls.device) {
        (void)cudaGetLastError();
        snprintf(why, n, "this thread's cuDNN handle is on device %d, the current device is %d", tls.device, dev);
        return nullptr;
    }
    return tls.handle;
}

// ---------------------------------------------------------------- graph building

// Collects every descriptor it creates (destroyed together on failure, kept with the plan on
// success) and the first error. Every helper does nothing once an error is recorded, so a graph
// is written as a straight sequence of calls and checked once at the end.
struct graph {
    std::vector<desc> owned;
    std::vector<desc> ops;
    int64_t next_uid = 100; // virtual tensors; the non-virtual ones use the UID_ constants
    bool failed = false;
    char why[256] = "";

    void fail(const char *call, const char *what, cudnnStatus_t s)
    {
        if (failed) return;
        failed = true;
        status_why(why, sizeof why, call, what, s);
    }
    void destroy_all()
    {
        for (size_t i = owned.size(); i-- > 0;) api.DestroyDescriptor(owned[i]);
        owned.clear();
        ops.clear();
    }
};

desc create(graph &g, cudnnBackendDescriptorType_t type, const char *what)
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

void set_attr(graph &g, desc d, cudnnBackendAttributeName_t attr, cudnnBackendAttributeType_t type, int64_t count,
              const void *value, const char *attr_name)
{
    if (g.failed) return;
    cudnnStatus_t s = api.SetAttribute(d, attr, type, count, value);
    if (s != CUDNN_STATUS_SUCCESS) g.fail("cudnnBackendSetAttribute", attr_name, s);
}
#define SET(g, d, attr, type, count, value) set_attr(g, d, attr, type, count, value, #attr)

void finalize(graph &g, desc d, const char *what)
{
    if (g.failed) return;
    cudnnStatus_t s = api.Finalize(d);
    if (s != CUDNN_STATUS_SUCCESS) g.fail("cudnnBackendFinalize", what, s);
}

struct layout {
    int64_t dim[4], stride[4];
};

// UIDs of the tensors the variant pack binds (virtual ones count up from 100).
enum : int64_t {
    UID_Q = 1, UID_K, UID_V, UID_O, UID_STATS, UID_DO, UID_DQ, UID_DK, UID_DV, UID_SUM, UID_DQACC,
    UID_SCALE, UID_ONE, UID_FILL,
};

desc tensor(graph &g, const char *what, cudnnDataType_t type, const layout &l, bool is_virtual, int64_t uid = 0)
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
desc scalar(graph &g, const char *what, int64_t uid)
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

void add_op(graph &g, desc op, const char *what)
{
    finalize(g, op, what);
    if (!g.failed) g.ops.push_back(op);
}

// y = mode(x [, b [, t]]) computed in prec; axis >= 0 for GEN_INDEX. BINARY_SELECT: y = t ? x : b.
void pointwise(graph &g, const char *what, cudnnPointwiseMode_t mode, cudnnDataType_t prec, desc x, desc b, desc t,
               desc y, int64_t axis = -1)
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
void pw_f32(graph &g, const char *what, cudnnPointwiseMode_t mode, desc x, desc b, desc y)
{
    pointwise(g, what, mode, CUDNN_DATA_FLOAT, x, b, nullptr, y);
}

// c = a b over the last two dims, batched over the first two (broadcast where a's or b's head
// dim is smaller: GQA), fp32 accumulation.
void matmul(graph &g, const char *what, desc a, desc b, desc c)
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
void reduction(graph &g, const char *what, cudnnReduceTensorOp_t mode, desc x, desc y)
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
void reshape(graph &g, const char *what, desc x, desc y)
{
    desc op = create(g, CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, what);
    SET(g, op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    SET(g, op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    add_op(g, op, what);
}

// The layouts of one shape.
struct layouts {
    layout q;      // (B,H,T,D) over BTHD memory: Q, O, dO, dQ
    layout kt;     // (B,KV,D,T) over BTHD memory: K^T (and V^T in the backward)
    layout kv;     // (B,KV,T,D) over BTHD memory: V, dK, dV, and K again in the backward
    layout ss;     // (B,H,T,T) scores, packed
    layout ss_t;   // (B,H,T,T) transposed strides: P^T, dS^T
    layout row;    // (B,H,T,1) row statistics (Stats, softmax sums)
    layout full;   // (B,H,T,D) packed: dQ accumulator, full-head dK dV, dO*O
};

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
desc causal_mask(graph &g, const layouts &l, desc s, desc fill)
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
void matmul_to_kv_heads(graph &g, const layouts &l, bool gqa, const char *what, desc a, desc b, desc c)
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

// The operation graph of g, heuristics (mode A, then FALLBACK) and the first engine config whose
// execution plan finalizes: e->plan and e->workspace. False with e->why otherwise.
bool make_plan(graph &g, cudnnHandle_t h, plan_entry *e)
{
    desc og = create(g, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph");
    SET(g, og, ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &h);
    SET(g, og, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, (int64_t)g.ops.size(), g.ops.data());
    finalize(g, og, "operation graph");
    if (g.failed) {
        snprintf(e->why, sizeof e->why, "%s", g.why);
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
            int64_t ws = 0, n = 0;
            if (s == CUDNN_STATUS_SUCCESS)
                s = api.GetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n, &ws);
            if (s == CUDNN_STATUS_SUCCESS) {
                // keep the heuristics' descriptors (the chosen config among them) with the plan
                g.owned.insert(g.owned.end(), hg.owned.begin(), hg.owned.end());
                e->plan = plan;
                e->workspace = ws;
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
    snprintf(e->why, sizeof e->why, "no execution plan (%lld engine configs tried); last: %s", (long long)tried, last);
    return false;
}

// The plan of this shape and direction on this thread, built at first use. NULL with why.
// This thread's plan entry of the shape and direction (a failed build included), or NULL.
plan_entry *find_plan(direction dir, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D)
{
    for (plan_entry *e = tls.plans; e; e = e->next)
        if (e->B == B && e->T == T && e->H == H && e->KV == KV && e->D == D && e->dir == dir &&
            e->device == tls.device)
            return e;
    return nullptr;
}

plan_entry *get_plan(cudnnHandle_t h, direction dir, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D, char *why,
                     size_t n)
{
    plan_entry *e = find_plan(dir, B, T, H, KV, D);
    if (!e) {
        e = new plan_entry();
        e->B = B, e->T = T, e->H = H, e->KV = KV, e->D = D, e->dir = dir, e->device = tls.device;
        graph g;
        const layouts l = layouts_of(B, T, H, KV, D);
        if (dir == FORWARD) build_forward(g, l);
        else build_backward(g, l, H != KV);
        if (g.failed) snprintf(e->why, sizeof e->why, "%s", g.why);
        else if (make_plan(g, h, e) && dir == FORWARD && e->workspace > 0) {
            cudaError_t ce = cudaMalloc(&e->fwd_workspace, (size_t)e->workspace);
            if (ce != cudaSuccess) {
                (void)cudaGetLastError();
                snprintf(e->why, sizeof e->why, "cudaMalloc of the forward plan's %lld-byte workspace: %s",
                         (long long)e->workspace, cudaGetErrorString(ce));
                api.DestroyDescriptor(e->plan);
                e->plan = nullptr;
                e->fwd_workspace = nullptr;
            }
        }
        if (e->plan) e->owned.swap(g.owned);
        else g.destroy_all();
        e->next = tls.plans;
        tls.plans = e;
    }
    if (!e->plan) {
        snprintf(why, n, "%s plan B=%lld T=%lld H=%lld KV=%lld D=%lld: %s", dir == FORWARD ? "forward" : "backward",
                 (long long)B, (long long)T, (long long)H, (long long)KV, (long long)D, e->why);
        return nullptr;
    }
    return e;
}

// Binds the pointers to the plan's tensors and enqueues it on the handle's stream.
int execute(cudnnHandle_t h, const plan_entry *e, const int64_t *uids, void *const *ptrs, int64_t count,
            void *workspace, char *why, size_t n)
{
    desc vp = nullptr;
    cudnnStatus_t s = api.CreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &vp);
    if (s != CUDNN_STATUS_SUCCESS) {
        status_why(why, n, "cudnnBackendCreateDescriptor", "variant pack", s);
        return -1;
    }
    const char *call = "cudnnBackendSetAttribute";
    s = api.SetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, count, uids);
    if (s == CUDNN_STATUS_SUCCESS)
        s = api.SetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, count, ptrs);
    if (s == CUDNN_STATUS_SUCCESS)
        s = api.SetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace);
    if (s == CUDNN_STATUS_SUCCESS) call = "cudnnBackendFinalize", s = api.Finalize(vp);
    if (s == CUDNN_STATUS_SUCCESS) call = "cudnnBackendExecute", s = api.Execute(h, e->plan, vp);
    if (s != CUDNN_STATUS_SUCCESS) status_why(why, n, call, "variant pack", s);
    api.DestroyDescriptor(vp);
    return s == CUDNN_STATUS_SUCCESS ? 0 : -1;
}

bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

// The causal mask's fill value, as cudnn-frontend picks it (utils/attn_score_modifiers.h,
// get_negative_inf_value: "older cuDNN version prefers lowest for softmax mask"): -inf from cuDNN
// 9.10, the lowest finite float before. Either way exp() of a masked score is 0 and every causal
// row keeps its diagonal, so Stats stays finite.
float mask_fill() { return api_version < 91000 ? -FLT_MAX : -INFINITY; }

constexpr size_t WS_ALIGN = 256;
constexpr size_t WS_SLACK = (size_t)64 << 20; // room for the plan's own workspace beyond 4 B H T D

size_t align_up(size_t x) { return (x + WS_ALIGN - 1) / WS_ALIGN * WS_ALIGN; }

// The backward's pieces of the workspace, in order (see the header comment).
struct bwd_carve {
    size_t dq16, dk16, dv16, sum, dqacc, plan, end; // byte offsets; end: the whole size
};
bwd_carve carve_backward(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D)
{
    const size_t nq = (size_t)(B * T * H * D), nkv = (size_t)(B * T * KV * D), nrow = (size_t)(B * H * T);
    bwd_carve c;
    c.dq16 = 0;
    c.dk16 = c.dq16 + align_up(nq * 2);
    c.dv16 = c.dk16 + align_up(nkv * 2);
    c.sum = c.dv16 + align_up(nkv * 2);
    c.dqacc = c.sum + align_up(nrow * 4);
    c.plan = c.dqacc + align_up(nq * 4);
    c.end = c.plan + align_up(nq * 4) + WS_SLACK;
    return c;
}

int fail(char *why, size_t n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
int fail(char *why, size_t n, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, n, fmt, ap);
    va_end(ap);
    return -1;
}

} // namespace

extern "C" int mt_cuda_attention_cudnn_available(char *why, size_t n)
{
    return thread_handle(why, n) ? 1 : 0;
}

extern "C" int mt_cuda_attention_cudnn_check_graphs(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                                                    char *why, size_t n)
{
    if (!load(why, n)) return -2;
    if (!mt_cuda_attention_cudnn_supports(B, T, H, KV, D))
        return fail(why, n, "shape B=%lld T=%lld H=%lld KV=%lld D=%lld not taken (D must be 64 or 128)",
                    (long long)B, (long long)T, (long long)H, (long long)KV, (long long)D);
    const layouts l = layouts_of(B, T, H, KV, D);
    for (int dir = FORWARD; dir <= BACKWARD; dir++) {
        graph g;
        if (dir == FORWARD) build_forward(g, l);
        else build_backward(g, l, H != KV);
        const bool failed = g.failed;
        if (failed) snprintf(why, n, "%s graph: %s", dir == FORWARD ? "forward" : "backward", g.why);
        else snprintf(why, n, "forward and backward graphs: every descriptor finalized (cuDNN %zu)", api_version);
        g.destroy_all();
        if (failed) return -1;
    }
    return 0;
}

extern "C" int mt_cuda_attention_cudnn_supports(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D)
{
    return B >= 1 && T >= 1 && H >= 1 && KV >= 1 && H % KV == 0 && (D == 64 || D == 128);
}

extern "C" size_t mt_cuda_attention_cudnn_workspace_bytes(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D)
{
    if (!mt_cuda_attention_cudnn_supports(B, T, H, KV, D)) return 0;
    return carve_backward(B, T, H, KV, D).end;
}

extern "C" int64_t mt_cuda_attention_cudnn_plan_workspace(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                                                         int backward)
{
    const plan_entry *e = find_plan(backward ? BACKWARD : FORWARD, B, T, H, KV, D);
    return e && e->plan ? e->workspace : -1;
}

extern "C" int mt_cuda_attention_cudnn_backward_takes_T(int64_t T)
{
    char why[256];
    if (!load(why, sizeof why)) return 0;
    return T >= 1 && (api_version > 91500 || T % 128 == 0);
}

extern "C" int mt_cuda_attention_cudnn_forward(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                                               const mt_cuda_bf16 *q, const mt_cuda_bf16 *k, const mt_cuda_bf16 *v,
                                               mt_cuda_bf16 *out, float *lse, mt_cuda_stream stream, char *why,
                                               size_t n)
{
    if (!mt_cuda_attention_cudnn_supports(B, T, H, KV, D))
        return fail(why, n, "shape B=%lld T=%lld H=%lld KV=%lld D=%lld not taken (D must be 64 or 128)",
                    (long long)B, (long long)T, (long long)H, (long long)KV, (long long)D);
    if (!aligned16(q) || !aligned16(k) || !aligned16(v) || !aligned16(out) || !aligned16(lse))
        return fail(why, n, "a forward tensor is not 16-byte aligned");
    cudnnHandle_t h = thread_handle(why, n);
    if (!h) return -1;
    // cudnn-frontend refuses the bf16/fp16 forward on these two releases "due to known bugs"
    // (node/sdpa_support_surface.h, validate_sdpa_support_surface)
    if (api_version == 91000 || api_version == 91001)
        return fail(why, n, "cuDNN %zu: the fused attention forward has known bugs in 9.10.0/9.10.1", api_version);
    plan_entry *e = get_plan(h, FORWARD, B, T, H, KV, D, why, n);
    if (!e) return -1;
    cudnnStatus_t s = api.SetStream(h, (cudaStream_t)stream);
    if (s != CUDNN_STATUS_SUCCESS) {
        status_why(why, n, "cudnnSetStream", nullptr, s);
        return -1;
    }
    float scale = (float)(1.0 / sqrt((double)D)), fill = mask_fill(); // the own kernel's scale
    const int64_t uids[] = {UID_Q, UID_K, UID_V, UID_O, UID_STATS, UID_SCALE, UID_FILL};
    void *const ptrs[] = {(void *)q, (void *)k, (void *)v, out, lse, &scale, &fill};
    static_assert(sizeof uids / sizeof uids[0] == sizeof ptrs / sizeof ptrs[0], "one pointer per UID");
    return execute(h, e, uids, ptrs, (int64_t)(sizeof uids / sizeof uids[0]), e->fwd_workspace, why, n);
}

extern "C" int mt_cuda_attention_cudnn_backward(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                                                const mt_cuda_bf16 *q, const mt_cuda_bf16 *k, const mt_cuda_bf16 *v,
                                                const mt_cuda_bf16 *out, const float *lse, const mt_cuda_bf16 *dout,
                                                float *dq, float *dk, float *dv, void *workspace,
                                                size_t workspace_bytes, mt_cuda_stream stream, char *why, size_t n)
{
    if (!mt_cuda_attention_cudnn_supports(B, T, H, KV, D))
        return fail(why, n, "shape B=%lld T=%lld H=%lld KV=%lld D=%lld not taken (D must be 64 or 128)",
                    (long long)B, (long long)T, (long long)H, (long long)KV, (long long)D);
    if (!aligned16(q) || !aligned16(k) || !aligned16(v) || !aligned16(out) || !aligned16(lse) || !aligned16(dout))
        return fail(why, n, "a backward tensor is not 16-byte aligned");
    // the carve's offsets are WS_ALIGN-aligned from a WS_ALIGN-aligned base (the slack covers the pad)
    const size_t pad = (size_t)(align_up((uintptr_t)workspace) - (uintptr_t)workspace);
    if (!workspace || pad > workspace_bytes) return fail(why, n, "no backward workspace");
    workspace = (char *)workspace + pad;
    workspace_bytes -= pad;
    const bwd_carve c = carve_backward(B, T, H, KV, D);
    if (workspace_bytes < c.plan)
        return fail(why, n, "backward workspace of %zu bytes, the bf16 gradients and fp32 accumulators need %zu",
                    workspace_bytes, c.plan);
    cudnnHandle_t h = thread_handle(why, n);
    if (!h) return -1;
    // Up to cuDNN 9.15.0 cudnn-frontend adds a "workaround padding mask" (seq_len tensors of T, in
    // its own workspace) to every unpadded backward whose key length is no multiple of 128
    // (CompositeSDPABackwardNode::pre_validate_node_derived); this graph has none, so those
    // releases run the own kernel for such T rather than risk the bug it works around.
    if (!mt_cuda_attention_cudnn_backward_takes_T(T))
        return fail(why, n, "cuDNN %zu: the fused attention backward needs T %% 128 == 0 before 9.15.1 (T = %lld)",
                    api_version, (long long)T);
    plan_entry *e = get_plan(h, BACKWARD, B, T, H, KV, D, why, n);
    if (!e) return -1;
    const size_t left = workspace_bytes - c.plan;
    if ((uint64_t)e->workspace > (uint64_t)left)
        return fail(why, n,
                    "the backward plan needs %lld bytes of workspace, %zu are left of the %zu given (after %zu for "
                    "the bf16 gradients and fp32 accumulators)",
                    (long long)e->workspace, left, workspace_bytes, c.plan);
    char *ws = (char *)workspace;
    mt_cuda_bf16 *dq16 = (mt_cuda_bf16 *)(ws + c.dq16), *dk16 = (mt_cuda_bf16 *)(ws + c.dk16);
    mt_cuda_bf16 *dv16 = (mt_cuda_bf16 *)(ws + c.dv16);
    const size_t nq = (size_t)(B * T * H * D), nkv = (size_t)(B * T * KV * D);
    if (api_version < 90600) {
        // Before cuDNN 9.6 the caller zeroes the dQ accumulator (cudnn-frontend did the same).
        cudaError_t ce = cudaMemsetAsync(ws + c.dqacc, 0, nq * 4, (cudaStream_t)stream);
        if (ce != cudaSuccess) {
            (void)cudaGetLastError();
            return fail(why, n, "cudaMemsetAsync of the dQ accumulator: %s", cudaGetErrorString(ce));
        }
    }
    cudnnStatus_t s = api.SetStream(h, (cudaStream_t)stream);
    if (s != CUDNN_STATUS_SUCCESS) {
        status_why(why, n, "cudnnSetStream", nullptr, s);
        return -1;
    }
    float scale = (float)(1.0 / sqrt((double)D)), one = 1.0f, fill = mask_fill();
    const int64_t uids[] = {UID_Q,  UID_K,  UID_V,  UID_O,   UID_DO,    UID_STATS, UID_DQ,
                            UID_DK, UID_DV, UID_SUM, UID_DQACC, UID_SCALE, UID_ONE,   UID_FILL};
    void *const ptrs[] = {(void *)q, (void *)k, (void *)v, (void *)out, (void *)dout, (void *)lse, dq16,
                          dk16,      dv16,      ws + c.sum, ws + c.dqacc, &scale,     &one,        &fill};
    static_assert(sizeof uids / sizeof uids[0] == sizeof ptrs / sizeof ptrs[0], "one pointer per UID");
    if (execute(h, e, uids, ptrs, (int64_t)(sizeof uids / sizeof uids[0]), ws + c.plan, why, n) != 0) return -1;
    // bf16 gradients -> the fp32 outputs (=), same BTHD layout
    mt_cuda_bf16_to_f32(dq16, dq, (int64_t)nq, stream);
    mt_cuda_bf16_to_f32(dk16, dk, (int64_t)nkv, stream);
    mt_cuda_bf16_to_f32(dv16, dv, (int64_t)nkv, stream);
    return 0;
}
