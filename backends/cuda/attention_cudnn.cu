// attention_cudnn: the optional cuDNN 9 fused-attention path behind mt_cuda_attention_forward /
// backward (attention.cu tries it first unless the context's options say
// MT_CUDA_ATTENTION_OWN).
//
// Why the backend ("graph") C API and dlopen: cuDNN's fused flash-attention engines are reached by
// describing attention as an operation graph that their pattern matcher recognises;
// cudnn-frontend's sdpa nodes build exactly such graphs from backend descriptors.
// attention_cudnn_graph.cu builds the same graphs (the op sequence of cudnn-frontend 1.x's
// SDPANode / SDPABackwardNode for a causal, unbiased, dropout-free attention with GQA) with plain
// cudnnBackend* calls, so the project needs neither the frontend's headers nor a link against
// cuDNN: libcudnn.so.9 is opened with dlopen at first use, and every way that can fail (no
// library, no GPU, an engine that does not take the graph, too little workspace) returns a reason
// and lets the caller run the own kernel.
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
//                            kernel runs). cuDNN 9.14's backward plans ask for 4 B H T D + 256
//                            bytes at B 8 and 16, T 2048, H 16, KV 2, D 128: an fp32
//                            dQ-sized buffer of their own.
//
// This file: loading the library, the per-thread handle and plan cache, the variant packs and the
// entry points; attention_cudnn_graph.cu builds the graphs and their plans.
#include <dlfcn.h>
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <mutex>

#include "backends/cuda/attention_cudnn.h"
#include "backends/cuda/attention_cudnn_graph.cuh"

using namespace mt_cudnn;

// ---------------------------------------------------------------- the library, loaded once

namespace mt_cudnn {
cudnn_api api;
size_t api_version;
} // namespace mt_cudnn

namespace {

bool api_loaded;       // set once by load_once
char api_why[256];     // why not, when not
std::once_flag api_once;

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

} // namespace

bool mt_cudnn::load(char *why, size_t n)
{
    std::call_once(api_once, load_once);
    if (!api_loaded) snprintf(why, n, "%s", api_why);
    return api_loaded;
}

// "call (what): status text (code): detail" into why; clears a CUDA runtime error a failed call
// may have left behind, so that the own kernel's launch checks that follow do not see it.
void mt_cudnn::status_why(char *why, size_t n, const char *call, const char *what, cudnnStatus_t s)
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

namespace {

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

// This thread's plan entry of the shape and direction (a failed build included), or NULL.
plan_entry *find_plan(direction dir, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D)
{
    for (plan_entry *e = tls.plans; e; e = e->next)
        if (e->B == B && e->T == T && e->H == H && e->KV == KV && e->D == D && e->dir == dir &&
            e->device == tls.device)
            return e;
    return nullptr;
}

// The plan of this shape and direction on this thread, built at first use. NULL with why.
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
        else if (make_plan(g, h, &e->plan, &e->workspace, e->why, sizeof e->why) && dir == FORWARD &&
                 e->workspace > 0) {
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
