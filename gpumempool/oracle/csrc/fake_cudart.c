/* A fake CUDA runtime (libcudart.so.12 or .13) on which the official CUDA
 * wheels of torch run their real caching allocator without a GPU: the judge
 * that gpumempool.oracle asks what torch would have reserved.
 *
 * It is built twice by gpumempool/oracle/_stack.py: with the SONAME and
 * the symbol version node torch's libraries need (GMP_CUDART_SONAME,
 * "libcudart.so.12" or "libcudart.so.13") and with cudart_props.c compiled
 * against that release's own cuda_runtime_api.h, so that cudaDeviceProp has
 * the layout torch was compiled with. Like NVIDIA's runtime it is a layer
 * over the driver: memory, streams, events and contexts go to the fake
 * libcuda.so.1 (tests/csrc/fake_cuda.c, in its FAKE_CUDA_VIRTUAL mode, where
 * device memory is address space handed out lowest address first), and
 * cudaGetDriverEntryPoint hands torch that driver's functions.
 *
 * What it does not do: kernels, copies and memsets return success and do
 * nothing (device memory is never touched, nor backed), cuBLAS and cuDNN
 * are not there, and cudaMallocAsync is refused. So torch's allocator is
 * judged on allocation sequences, not on compute. Every other function torch
 * imports (the GMP_STUBS list below) says its name once on stderr and
 * returns cudaErrorNotSupported. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

typedef int cudaError_t;
typedef void *cudaStream_t;
typedef void *cudaEvent_t;
typedef unsigned long long CUdeviceptr;

/* ---- the fake driver (fake_cuda.c), linked as libcuda.so.1 ---- */
int cuInit(unsigned flags);
int cuDevicePrimaryCtxRetain(void **ctx, int dev);
int cuCtxSetCurrent(void *ctx);
int cuMemAlloc_v2(CUdeviceptr *p, size_t n);
int cuMemFree_v2(CUdeviceptr p);
int cuMemGetInfo_v2(size_t *free_bytes, size_t *total);
int cuDeviceGetCount(int *n);
int cuEventCreate(void **e, unsigned flags);
int cuEventRecord(void *e, void *s);
int cuEventQuery(void *e);
int cuEventSynchronize(void *e);
int cuEventDestroy_v2(void *e);
int cuStreamCreate(void **s, unsigned flags);
int cuStreamDestroy_v2(void *s);
int cuStreamSynchronize(void *s);
int cuStreamIsCapturing(void *s, int *status);
int cuThreadExchangeStreamCaptureMode(int *mode);
int cuDriverGetVersion(int *v);
void fake_cuda_complete_all(void);
void fake_cuda_set_stream_capturing(uintptr_t stream, int on);

/* cudart_props.c */
struct cudaDeviceProp;
void gmp_fake_device_props(struct cudaDeviceProp *p, int dev, size_t total);

enum {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInitializationError = 3,
    cudaErrorInvalidDevice = 101,
    cudaErrorNoDevice = 100,
    cudaErrorStreamCaptureUnsupported = 900,
    cudaErrorStreamCaptureUnmatched = 902,
    cudaErrorNotSupported = 801,
};

/* ---- devices and contexts ---- */

static pthread_once_t once = PTHREAD_ONCE_INIT;
static int n_devices;
static int init_error;
static void *primary[16];
static __thread int cur_dev;
static __thread int ctx_made; /* 1 + the device whose context this thread made current */

static void init(void) {
    if (cuInit(0) != 0 || cuDeviceGetCount(&n_devices) != 0 || n_devices == 0) {
        init_error = cudaErrorNoDevice;
        return;
    }
    if (n_devices > 16) n_devices = 16;
    for (int d = 0; d < n_devices; d++) cuDevicePrimaryCtxRetain(&primary[d], d);
}

/* What the real runtime does on first use and on cudaSetDevice: the
 * device's primary context becomes this thread's current one. */
static int ready(void) {
    pthread_once(&once, init);
    if (init_error) return init_error;
    if (ctx_made != cur_dev + 1) {
        cuCtxSetCurrent(primary[cur_dev]);
        ctx_made = cur_dev + 1;
    }
    return cudaSuccess;
}

/* Driver results as runtime errors: the codes torch looks at are the same
 * numbers (2 out of memory, 600 not ready, 400 invalid handle). */
static cudaError_t from_driver(int rc) { return rc == 201 ? cudaErrorInitializationError : rc; }

#define READY()                   \
    do {                          \
        int rc_ = ready();        \
        if (rc_) return rc_;      \
    } while (0)

/* CUDA frees another device's memory (unified addressing) and queries,
 * waits on and destroys another device's events and streams, whichever
 * device is current: torch's empty_cache and its OOM retry release every
 * device's segments, and wait on their events, from the current one. The
 * fake driver wants the owner's context current (it answers 201 or 400
 * otherwise), so the call is made again in each other device's primary
 * context until one owns the object, and the current context restored. */
#define ON_OWNER(expr)                                                          \
    do {                                                                        \
        READY();                                                                \
        int rc_ = (expr);                                                       \
        if (rc_ != 201 && rc_ != 400) return from_driver(rc_);                  \
        for (int d_ = 0; d_ < n_devices && (rc_ == 201 || rc_ == 400); d_++) {  \
            if (d_ == cur_dev) continue;                                        \
            cuCtxSetCurrent(primary[d_]);                                       \
            int again_ = (expr);                                                \
            if (again_ != 201 && again_ != 400) rc_ = again_;                   \
        }                                                                       \
        cuCtxSetCurrent(primary[cur_dev]);                                      \
        return from_driver(rc_);                                                \
    } while (0)

EXPORT cudaError_t cudaGetDeviceCount(int *n) {
    pthread_once(&once, init);
    *n = init_error ? 0 : n_devices;
    return init_error;
}
EXPORT cudaError_t cudaGetDevice(int *d) {
    *d = cur_dev;
    return cudaSuccess;
}
EXPORT cudaError_t cudaSetDevice(int d) {
    pthread_once(&once, init);
    if (init_error) return init_error;
    if (d < 0 || d >= n_devices) return cudaErrorInvalidDevice;
    cur_dev = d;
    return ready();
}
EXPORT cudaError_t cudaInitDevice(int d, unsigned a, unsigned b) { return cudaSetDevice(d); }
EXPORT cudaError_t cudaDeviceSynchronize(void) {
    READY();
    fake_cuda_complete_all();
    return cudaSuccess;
}
EXPORT cudaError_t cudaDriverGetVersion(int *v) { return from_driver(cuDriverGetVersion(v)); }
EXPORT cudaError_t cudaRuntimeGetVersion(int *v) {
    *v = GMP_CUDART_VERSION;
    return cudaSuccess;
}
EXPORT cudaError_t cudaGetLastError(void) { return cudaSuccess; }
EXPORT cudaError_t cudaPeekAtLastError(void) { return cudaSuccess; }
EXPORT const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorNotSupported: return "operation not supported (gpumempool's fake CUDA runtime)";
    default: return "error (gpumempool's fake CUDA runtime)";
    }
}
EXPORT const char *cudaGetErrorName(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    default: return "cudaErrorUnknown";
    }
}

static size_t device_total(void) {
    size_t fr = 0, tot = 0;
    if (ready() == 0) cuMemGetInfo_v2(&fr, &tot);
    return tot;
}
EXPORT cudaError_t cudaGetDeviceProperties_v2(struct cudaDeviceProp *p, int d) {
    READY();
    if (d < 0 || d >= n_devices) return cudaErrorInvalidDevice;
    gmp_fake_device_props(p, d, device_total());
    return cudaSuccess;
}
EXPORT cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int d) { return cudaGetDeviceProperties_v2(p, d); }

/* enum cudaDeviceAttr: an H100-like answer, 1 for the rest. */
EXPORT cudaError_t cudaDeviceGetAttribute(int *v, int attr, int d) {
    switch (attr) {
    case 1: case 2: case 3: *v = 1024; break; /* max threads per block, block dims x y */
    case 4: *v = 64; break;
    case 5: *v = 2147483647; break;           /* max grid dim x */
    case 6: case 7: *v = 65535; break;
    case 8: *v = 49152; break;                /* max shared memory per block */
    case 10: *v = 32; break;                  /* warp size */
    case 16: *v = 132; break;                 /* multiprocessors */
    case 39: *v = 2048; break;                /* max threads per multiprocessor */
    case 75: *v = 9; break;                   /* compute capability major */
    case 76: *v = 0; break;                   /* minor */
    case 81: *v = 233472; break;              /* max shared memory per multiprocessor */
    case 97: *v = 232448; break;              /* max shared memory per block, opt-in */
    default: *v = 1;
    }
    return cudaSuccess;
}
EXPORT cudaError_t cudaDeviceGetStreamPriorityRange(int *lo, int *hi) {
    if (lo) *lo = 0;
    if (hi) *hi = -5;
    return cudaSuccess;
}
EXPORT cudaError_t cudaDeviceCanAccessPeer(int *can, int a, int b) {
    *can = 0;
    return cudaSuccess;
}
EXPORT cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned flags) { return cudaSuccess; }
EXPORT cudaError_t cudaDeviceGetPCIBusId(char *id, int len, int d) {
    snprintf(id, (size_t)len, "0000:%02x:00.0", d + 1);
    return cudaSuccess;
}
EXPORT cudaError_t cudaThreadExchangeStreamCaptureMode(int *mode) {
    READY();
    return from_driver(cuThreadExchangeStreamCaptureMode(mode));
}

/* ---- the driver's functions, for torch's expandable segments ---- */

/* What a function the fake driver lacks does when torch calls it. */
static int driver_not_supported(void) { return 801; /* CUDA_ERROR_NOT_SUPPORTED */ }
static int driver_error_string(int e, const char **s) {
    *s = e == 2 ? "out of memory" : "error (gpumempool's fake CUDA driver)";
    return 0;
}

/* Torch resolves its driver functions by name and asserts that each one
 * is found: the fake driver's version where it has one (name, then _v2,
 * _v3 as cuda.h's macros name them), else a function that answers "not
 * supported". */
static void *driver_symbol(const char *name) {
    void *driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (strcmp(name, "cuGetErrorString") == 0) return (void *)driver_error_string;
    static const char *const suffix[] = {"", "_v2", "_v3"};
    for (int i = 0; i < 3; i++) {
        char buf[160];
        snprintf(buf, sizeof(buf), "%s%s", name, suffix[i]);
        void *f = dlsym(driver, buf);
        if (f) return f;
    }
    return (void *)driver_not_supported;
}
EXPORT cudaError_t cudaGetDriverEntryPoint(const char *symbol, void **fn, unsigned long long flags, int *status) {
    *fn = driver_symbol(symbol);
    if (status) *status = 0; /* cudaDriverEntryPointSuccess */
    return cudaSuccess;
}
EXPORT cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned version,
                                                    unsigned long long flags, int *status) {
    return cudaGetDriverEntryPoint(symbol, fn, flags, status);
}

/* ---- memory ---- */

EXPORT cudaError_t cudaMalloc(void **p, size_t n) {
    READY();
    if (n == 0) {
        *p = NULL;
        return cudaSuccess;
    }
    CUdeviceptr d = 0;
    int rc = cuMemAlloc_v2(&d, n);
    *p = rc ? NULL : (void *)(uintptr_t)d;
    return from_driver(rc);
}
EXPORT cudaError_t cudaFree(void *p) {
    if (!p) {
        READY();
        return cudaSuccess;
    }
    ON_OWNER(cuMemFree_v2((CUdeviceptr)(uintptr_t)p));
}
EXPORT cudaError_t cudaMemGetInfo(size_t *fr, size_t *tot) {
    READY();
    return from_driver(cuMemGetInfo_v2(fr, tot));
}
/* Pinned host memory is plain host memory. */
EXPORT cudaError_t cudaHostAlloc(void **p, size_t n, unsigned flags) {
    return posix_memalign(p, 4096, n ? n : 1) ? cudaErrorMemoryAllocation : cudaSuccess;
}
EXPORT cudaError_t cudaMallocHost(void **p, size_t n) { return cudaHostAlloc(p, n, 0); }
EXPORT cudaError_t cudaFreeHost(void *p) {
    free(p);
    return cudaSuccess;
}
EXPORT cudaError_t cudaHostRegister(void *p, size_t n, unsigned flags) { return cudaSuccess; }
EXPORT cudaError_t cudaHostUnregister(void *p) { return cudaSuccess; }
EXPORT cudaError_t cudaHostGetDevicePointer(void **d, void *h, unsigned flags) {
    *d = h;
    return cudaSuccess;
}
/* struct cudaPointerAttributes { type, device, devicePointer, hostPointer }:
 * every pointer is the current device's memory. */
EXPORT cudaError_t cudaPointerGetAttributes(void *attr, const void *p) {
    int *a = attr;
    a[0] = 2; /* cudaMemoryTypeDevice */
    a[1] = cur_dev;
    ((const void **)attr)[1] = p;
    ((const void **)attr)[2] = NULL;
    return cudaSuccess;
}
/* Copies and memsets do nothing; a copy to the host gives zeros. */
EXPORT cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, int kind, cudaStream_t st) {
    if (kind == 2) memset(d, 0, n); /* cudaMemcpyDeviceToHost */
    return cudaSuccess;
}
EXPORT cudaError_t cudaMemcpy(void *d, const void *s, size_t n, int kind) { return cudaMemcpyAsync(d, s, n, kind, NULL); }
EXPORT cudaError_t cudaMemcpy2DAsync(void *d, size_t dp, const void *s, size_t sp, size_t w, size_t h, int kind,
                                     cudaStream_t st) {
    return cudaSuccess;
}
EXPORT cudaError_t cudaMemcpyPeerAsync(void *d, int dd, const void *s, int sd, size_t n, cudaStream_t st) { return cudaSuccess; }
EXPORT cudaError_t cudaMemsetAsync(void *d, int v, size_t n, cudaStream_t st) { return cudaSuccess; }
EXPORT cudaError_t cudaMemset(void *d, int v, size_t n) { return cudaSuccess; }

/* ---- streams and events (the driver's, whose completion the caller of
 * fake_cuda_set_manual_events controls) ---- */

EXPORT cudaError_t cudaStreamCreateWithPriority(cudaStream_t *s, unsigned flags, int priority) {
    READY();
    return from_driver(cuStreamCreate(s, flags & 1u));
}
EXPORT cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags) { return cudaStreamCreateWithPriority(s, flags, 0); }
EXPORT cudaError_t cudaStreamCreate(cudaStream_t *s) { return cudaStreamCreateWithPriority(s, 0, 0); }
EXPORT cudaError_t cudaStreamDestroy(cudaStream_t s) {
    READY();
    return from_driver(cuStreamDestroy_v2(s));
}
EXPORT cudaError_t cudaStreamSynchronize(cudaStream_t s) { ON_OWNER(cuStreamSynchronize(s)); }
EXPORT cudaError_t cudaStreamQuery(cudaStream_t s) { return cudaSuccess; }
EXPORT cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags) { return cudaSuccess; }
EXPORT cudaError_t cudaStreamGetPriority(cudaStream_t s, int *p) {
    *p = 0;
    return cudaSuccess;
}
EXPORT cudaError_t cudaStreamIsCapturing(cudaStream_t s, int *status) {
    READY();
    return from_driver(cuStreamIsCapturing(s, status));
}
EXPORT cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags) {
    READY();
    return from_driver(cuEventCreate(e, flags & 0x7u));
}
EXPORT cudaError_t cudaEventCreate(cudaEvent_t *e) { return cudaEventCreateWithFlags(e, 0); }
EXPORT cudaError_t cudaEventDestroy(cudaEvent_t e) { ON_OWNER(cuEventDestroy_v2(e)); }
EXPORT cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
    READY();
    return from_driver(cuEventRecord(e, s));
}
EXPORT cudaError_t cudaEventRecordWithFlags(cudaEvent_t e, cudaStream_t s, unsigned flags) { return cudaEventRecord(e, s); }
EXPORT cudaError_t cudaEventQuery(cudaEvent_t e) { ON_OWNER(cuEventQuery(e)); }
EXPORT cudaError_t cudaEventSynchronize(cudaEvent_t e) { ON_OWNER(cuEventSynchronize(e)); }
EXPORT cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) {
    *ms = 1.0f;
    return cudaSuccess;
}
EXPORT cudaError_t cudaStreamAddCallback(cudaStream_t s, void (*cb)(cudaStream_t, cudaError_t, void *), void *u,
                                         unsigned flags) {
    cb(s, cudaSuccess, u);
    return cudaSuccess;
}
EXPORT cudaError_t cudaLaunchHostFunc(cudaStream_t s, void (*fn)(void *), void *u) {
    fn(u);
    return cudaSuccess;
}

/* ---- graph capture: one capturing stream at a time, told to the driver
 * so that what torch's allocator does meanwhile is judged as on a GPU ---- */

static cudaStream_t cap_stream;
static unsigned long long cap_id;
static uintptr_t next_handle = 0x7a000;

EXPORT cudaError_t cudaStreamBeginCapture(cudaStream_t s, int mode) {
    if (cap_stream) return cudaErrorStreamCaptureUnsupported;
    cap_stream = s;
    cap_id++;
    fake_cuda_set_stream_capturing((uintptr_t)s, 1);
    return cudaSuccess;
}
EXPORT cudaError_t cudaStreamEndCapture(cudaStream_t s, void **graph) {
    if (s != cap_stream) return cudaErrorStreamCaptureUnmatched;
    fake_cuda_set_stream_capturing((uintptr_t)s, 0);
    cap_stream = NULL;
    *graph = (void *)(next_handle += 16);
    return cudaSuccess;
}
static void capture_info(cudaStream_t s, int *status, unsigned long long *id) {
    int on = s && s == cap_stream;
    if (status) *status = on; /* cudaStreamCaptureStatusActive */
    if (id) *id = on ? cap_id : 0;
}
#if GMP_CUDART_VERSION >= 13000
/* CUDA 13: (stream, status, id, graph, dependencies, edge data, count). */
EXPORT cudaError_t cudaStreamGetCaptureInfo(cudaStream_t s, int *status, unsigned long long *id, void **graph,
                                            const void **deps, const void **edges, size_t *n) {
    capture_info(s, status, id);
    if (graph) *graph = NULL;
    if (deps) *deps = NULL;
    if (edges) *edges = NULL;
    if (n) *n = 0;
    return cudaSuccess;
}
#else
/* CUDA 12: the original (stream, status, id), _v2 adds graph, dependencies
 * and count, _v3 edge data before the count. */
EXPORT cudaError_t cudaStreamGetCaptureInfo(cudaStream_t s, int *status, unsigned long long *id) {
    capture_info(s, status, id);
    return cudaSuccess;
}
EXPORT cudaError_t cudaStreamGetCaptureInfo_v2(cudaStream_t s, int *status, unsigned long long *id, void **graph,
                                               const void **deps, size_t *n) {
    capture_info(s, status, id);
    if (graph) *graph = NULL;
    if (deps) *deps = NULL;
    if (n) *n = 0;
    return cudaSuccess;
}
#endif
EXPORT cudaError_t cudaGraphInstantiateWithFlags(void **exec, void *g, unsigned long long flags) {
    *exec = (void *)(next_handle += 16);
    return cudaSuccess;
}
EXPORT cudaError_t cudaGraphInstantiate(void **exec, void *g, unsigned long long flags) {
    return cudaGraphInstantiateWithFlags(exec, g, flags);
}
EXPORT cudaError_t cudaGraphLaunch(void *exec, cudaStream_t s) { return cudaSuccess; }
EXPORT cudaError_t cudaGraphDestroy(void *g) { return cudaSuccess; }
EXPORT cudaError_t cudaGraphExecDestroy(void *e) { return cudaSuccess; }
EXPORT cudaError_t cudaGraphGetNodes(void *g, void **nodes, size_t *n) {
    *n = 0;
    return cudaSuccess;
}
EXPORT cudaError_t cudaGraphDebugDotPrint(void *g, const char *path, unsigned flags) { return cudaSuccess; }
EXPORT cudaError_t cudaStreamUpdateCaptureDependencies(cudaStream_t s, void *deps, ...) { return cudaSuccess; }
EXPORT cudaError_t cudaUserObjectCreate(void **o, void *p, void (*destroy)(void *), unsigned n, unsigned flags) {
    *o = (void *)(next_handle += 16);
    return cudaSuccess;
}
EXPORT cudaError_t cudaUserObjectRelease(void *o, unsigned n) { return cudaSuccess; }
EXPORT cudaError_t cudaGraphRetainUserObject(void *g, void *o, unsigned n, unsigned flags) { return cudaSuccess; }

/* ---- kernels: registered, launched, and never run ---- */

static void *fatbin_handle[1];
EXPORT void **__cudaRegisterFatBinary(void *fatbin) { return fatbin_handle; }
EXPORT void __cudaRegisterFatBinaryEnd(void **h) {}
EXPORT void __cudaUnregisterFatBinary(void **h) {}
EXPORT void __cudaRegisterFunction(void **h, const char *host, char *dev, const char *name, int limit, void *tid,
                                   void *bid, void *bdim, void *gdim, int *wsize) {}
EXPORT void __cudaRegisterVar(void **h, char *host, char *dev, const char *name, int ext, size_t size, int constant,
                              int global) {}
EXPORT char __cudaInitModule(void **h) { return 1; }
EXPORT unsigned __cudaPushCallConfiguration(unsigned long long grid_xy, unsigned grid_z, unsigned long long block_xy,
                                            unsigned block_z, size_t shared, void *stream) {
    return 0;
}
EXPORT cudaError_t __cudaPopCallConfiguration(void *grid, void *block, size_t *shared, void *stream) {
    if (shared) *shared = 0;
    return cudaSuccess;
}
EXPORT cudaError_t cudaLaunchKernel(const void *f, ...) { return cudaSuccess; }
EXPORT cudaError_t __cudaLaunchKernel(const void *f, ...) { return cudaSuccess; }
EXPORT cudaError_t cudaLaunchKernelExC(const void *config, const void *f, void **args) { return cudaSuccess; }
EXPORT cudaError_t cudaLaunchCooperativeKernel(const void *f, ...) { return cudaSuccess; }
/* struct cudaFuncAttributes: maxThreadsPerBlock 1024, numRegs 32, ptx/binary 90. */
EXPORT cudaError_t cudaFuncGetAttributes(void *attr, const void *f) {
    char *a = attr;
    memset(a, 0, 64);
    *(int *)(a + 24) = 1024;
    *(int *)(a + 28) = 32;
    *(int *)(a + 32) = 90;
    *(int *)(a + 36) = 90;
    return cudaSuccess;
}
/* cudaGetKernel's runtime half (torch 2.12 and 2.13 ask it for a kernel of
 * their own when a CUDA graph capture begins): the handle is the stub's
 * address, which nothing here dereferences. */
EXPORT cudaError_t __cudaGetKernel(void **kernel, const void *entry) {
    *kernel = (void *)entry;
    return cudaSuccess;
}
EXPORT cudaError_t cudaFuncSetAttribute(const void *f, int attr, int v) { return cudaSuccess; }
EXPORT cudaError_t cudaKernelSetAttributeForDevice(void *k, int attr, int v, int d) { return cudaSuccess; }
EXPORT cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int *n, const void *f, int bs, size_t sm) {
    *n = 4;
    return cudaSuccess;
}
EXPORT cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int *n, const void *f, int bs, size_t sm,
                                                                          unsigned flags) {
    *n = 4;
    return cudaSuccess;
}
static char symbol_storage[1 << 16];
EXPORT cudaError_t cudaGetSymbolAddress(void **p, const void *symbol) {
    *p = symbol_storage;
    return cudaSuccess;
}
EXPORT cudaError_t cudaMemcpyToSymbol(const void *symbol, const void *src, size_t n, size_t off, int kind) {
    return cudaSuccess;
}
EXPORT cudaError_t cudaProfilerStart(void) { return cudaSuccess; }
EXPORT cudaError_t cudaProfilerStop(void) { return cudaSuccess; }

/* ---- the rest of what torch 2.5-2.15 import: "not supported", said once ---- */

#define GMP_STUBS(X)                                                                                      \
    X(cudaDeviceGetDefaultMemPool) X(cudaDeviceGetGraphMemAttribute) X(cudaDeviceSetGraphMemAttribute)     \
    X(cudaFreeAsync) X(cudaMallocAsync) X(cudaMallocManaged) X(cudaMemPoolGetAttribute)                    \
    X(cudaMemPoolSetAccess) X(cudaMemPoolSetAttribute) X(cudaMemPoolTrimTo) X(cudaIpcCloseMemHandle)        \
    X(cudaIpcGetEventHandle) X(cudaIpcGetMemHandle) X(cudaIpcOpenEventHandle) X(cudaIpcOpenMemHandle)       \
    X(cudaGraphAddEmptyNode) X(cudaGraphAddNode) X(cudaGraphConditionalHandleCreate)                       \
    X(cudaGraphNodeGetDependencies) X(cudaGraphNodeGetType) X(cudaStreamBeginCaptureToGraph)               \
    X(cudaLibraryGetGlobal) X(cudaLibraryGetKernel) X(cudaLibraryGetKernelCount) X(cudaLibraryGetManaged)  \
    X(cudaLibraryGetUnifiedFunction) X(cudaLibraryLoadData) X(cudaLibraryLoadFromFile) X(cudaLibraryUnload)

static pthread_mutex_t said_mu = PTHREAD_MUTEX_INITIALIZER;
static void say_once(const char *name, int *said) {
    pthread_mutex_lock(&said_mu);
    if (!*said) {
        *said = 1;
        fprintf(stderr, "gpumempool fake CUDA runtime: %s is not supported\n", name);
    }
    pthread_mutex_unlock(&said_mu);
}
#define GMP_STUB(name)                    \
    EXPORT cudaError_t name(void) {       \
        static int said;                  \
        say_once(#name, &said);           \
        return cudaErrorNotSupported;     \
    }
GMP_STUBS(GMP_STUB)
