// The operation graphs of the cuDNN attention path (attention_cudnn_graph.cu) and what the
// two files of that path share: the library's function table, the error formatting, the
// tensors' UIDs. Internal to backends/cuda, built only with cudnn.h (MT_HAVE_CUDNN_HEADERS).
#ifndef MT_BACKENDS_CUDA_ATTENTION_CUDNN_GRAPH_CUH
#define MT_BACKENDS_CUDA_ATTENTION_CUDNN_GRAPH_CUH

#include <cudnn.h>
#include <stddef.h>
#include <stdint.h>

#include <vector>

#include "backends/cuda/common.cuh"

namespace mt_cudnn {

typedef cudnnBackendDescriptor_t desc;

// The functions of cuDNN used, typed from cudnn.h.
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

// The functions of libcudnn.so.9, filled once by load (attention_cudnn.cu, under a
// std::call_once) and only read afterwards; the library stays open for the process's life.
extern cudnn_api api;
extern size_t api_version; // cudnnGetVersion() of the loaded library, e.g. 91900

// Loads the library at the first call: true, or false with the reason in why.
bool load(char *why, size_t n);

// "call (what): status text (code): detail" into why; clears a CUDA runtime error a failed call
// may have left behind, so that the own kernel's launch checks that follow do not see it.
void status_why(char *why, size_t n, const char *call, const char *what, cudnnStatus_t s);

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

struct layout {
    int64_t dim[4], stride[4];
};

// UIDs of the tensors the variant pack binds (virtual ones count up from 100).
enum : int64_t {
    UID_Q = 1, UID_K, UID_V, UID_O, UID_STATS, UID_DO, UID_DQ, UID_DK, UID_DV, UID_SUM, UID_DQACC,
    UID_SCALE, UID_ONE, UID_FILL,
};

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

layouts layouts_of(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D);

// The forward and backward graphs of one shape (attention_cudnn.cu's header comment gives their
// op sequences), into g; g.failed with g.why when a descriptor does not finalize.
void build_forward(graph &g, const layouts &l);
void build_backward(graph &g, const layouts &l, bool gqa);

// The operation graph of g, heuristics (mode A, then FALLBACK) and the first engine config whose
// execution plan finalizes: *plan and its *workspace bytes. False with why otherwise.
bool make_plan(graph &g, cudnnHandle_t h, desc *plan, int64_t *workspace, char *why, size_t n);

} // namespace mt_cudnn

#endif
