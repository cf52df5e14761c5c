/* A fake libcuda.so.1 over host memory, for tests on machines without a GPU
 * (gpumempool's Go tests and Python tests share it).
 *
 *   cc -shared -fPIC -o libcuda_fake.so tests/csrc/fake_cuda.c
 *
 * It implements the driver entry points gpumempool uses, with the real
 * names (versioned where the real driver versions them), signatures, struct
 * layouts and error codes of CUDA 12/13's cuda.h, and it is stricter than
 * the real driver where strictness proves something about the caller:
 *
 *  - Devices: FAKE_CUDA_DEVICES (default 2, at most 16; 0 makes cuInit fail
 *    with CUDA_ERROR_NO_DEVICE like a driver that sees no GPU), each with
 *    FAKE_CUDA_CAPACITY bytes (default 1 GiB). Allocations past capacity fail
 *    with CUDA_ERROR_OUT_OF_MEMORY; cuMemGetInfo_v2 reports what is left.
 *    Both variables are read by cuInit and by fake_cuda_reset.
 *  - Device identity: the machine has 16 fake GPUs, GPU g with UUID
 *    fa4ec0da-0000-4000-8000-0000000000gg (cuDeviceGetUuid_v2). Ordinal i is
 *    GPU i, unless FAKE_CUDA_VISIBLE_ORDER lists the GPUs this process sees,
 *    in order, like CUDA_VISIBLE_DEVICES ("1" or "1,0": ordinal 0 is GPU 1);
 *    the list then also sets the device count. Read with the variables
 *    above; fake_cuda_set_visible_order changes it in a running process, so
 *    that one process can play an importer that sees the GPUs differently.
 *    Only the UUIDs and the count follow it: memory, contexts and pools
 *    stay keyed by ordinal.
 *  - Contexts: each thread has a context stack (cuCtxPushCurrent_v2 /
 *    cuCtxPopCurrent_v2); cuDevicePrimaryCtxRetain hands out one distinct
 *    context per device. Every memory, event, stream, pool and VMM call
 *    fails with CUDA_ERROR_INVALID_CONTEXT unless a context is current, and
 *    cuMemAlloc_v2 / cuMemHostAlloc / cuEventCreate attribute what they make
 *    to the current context's device, so a test can prove which context was
 *    pushed. Freeing memory or using an event under another device's
 *    context fails too (the real driver would accept it; the fake refuses so
 *    that a wrong push cannot go unnoticed).
 *  - Streams and events: in automatic mode (the default) every event is
 *    complete. In manual mode (fake_cuda_set_manual_events(1)) an event
 *    recorded on stream S completes when S does: fake_cuda_complete_stream,
 *    fake_cuda_complete_all or cuStreamSynchronize(S). Stream handles are
 *    any values the caller makes up (0 and 1 are the legacy default stream,
 *    2 the per-thread one), or streams from cuStreamCreate, which belong to
 *    the device they were created on (using one under another device's
 *    context, or after cuStreamDestroy_v2, fails with
 *    CUDA_ERROR_INVALID_HANDLE).
 *  - Graph capture: fake_cuda_set_global_capture plays a capture by another
 *    thread; fake_cuda_set_stream_capturing marks a stream as capturing
 *    (a made-up handle counts as a blocking stream, like torch's). While
 *    either is on, allocations are refused unless the calling thread is in
 *    the relaxed capture mode; cuStreamIsCapturing reports the capturing
 *    streams, and CUDA_ERROR_STREAM_CAPTURE_IMPLICIT for the legacy stream
 *    while a blocking stream captures; cuMemAllocFromPoolAsync,
 *    cuMemFreeAsync and cuStreamSynchronize on a capturing stream (or on the
 *    legacy one then) are refused and counted, where the real driver would
 *    add graph nodes or break the capture.
 *  - Memory is real: device allocations are aligned_alloc(512) blocks, pinned
 *    host allocations page-aligned ones. VMM reservations are PROT_NONE
 *    address ranges; cuMemCreate backs a handle with a memfd, cuMemMap maps
 *    it there (MAP_SHARED, so two mappings of one handle alias like on a
 *    GPU) and cuMemSetAccess makes it readable/writable. Shareable handles
 *    are real file descriptors (memfd_create).
 *  - VMM granularity: 2 MiB for both options, like real GPUs, unless a test
 *    sets others with fake_cuda_set_granularity; sizes, offsets and addresses
 *    are checked against the minimum one, as the driver documents.
 *  - Failure injection and inspection through the fake_cuda_* functions at
 *    the end of this file (call counts, the last stream a stream-ordered
 *    call was given, the last CUmemAllocationProp / CUmemPoolProps seen,
 *    pointers imported from pools). Everything is guarded by one mutex.
 *  - Virtual device memory (FAKE_CUDA_VIRTUAL=1, read by cuInit): device
 *    memory is address space only, as the judge of torch's allocator needs
 *    (gpumempool/oracle): each device has one PROT_NONE, MAP_NORESERVE
 *    window, and cuMemAlloc_v2 and cuMemAddressReserve take the lowest free
 *    range of it that fits, 2 MiB aligned, as a GPU hands out addresses
 *    (mmap's top-down order with reused holes would change which of two
 *    equal free blocks torch's best fit takes). cuMemCreate, cuMemMap,
 *    cuMemSetAccess and cuMemUnmap then only keep their books: nothing is
 *    ever backed, so an 80 GiB trace costs no memory and no descriptors,
 *    and nothing may touch the memory (kernels and copies of the fake
 *    runtime do nothing).
 *  - Pool IPC: a pointer imported with cuMemPoolImportPointer and not freed
 *    cannot be imported again in the same process (CUDA_ERROR_ALREADY_MAPPED),
 *    see cuMemPoolImportPointer below.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

/* ---- cuda.h types, constants and error codes: declared once, for the shim
 * that calls the real driver and for this fake (no CUDA headers on the
 * machines that build either). The path is relative to this file, so any
 * working directory builds it. The opaque handles are the fake's own. */
#include "../../gocore/cuda/driver/cuda_types.h"

typedef struct fake_ctx *CUcontext;
typedef struct fake_event *CUevent;
typedef void *CUstream;
typedef struct fake_pool *CUmemoryPool;

#define CU_MEMHOSTALLOC_ALL 0x7u   /* PORTABLE | DEVICEMAP | WRITECOMBINED */
#define CU_EVENT_FLAGS_ALL 0x7u    /* BLOCKING_SYNC | DISABLE_TIMING | INTERPROCESS */

#define MAX_DEV 16
#define MAX_DEPTH 64
#define GRANULARITY ((size_t)2 << 20) /* what real GPUs report for both options */
#define DEVICE_ALIGN 512
#define HOST_ALIGN 4096
#define MAGIC 0xFA4ECDAu

/* ---- every CUDA entry point, for call counts and failure injection ---- */
#define FAKE_FUNCS(X)                                                                        \
    X(cuInit) X(cuDeviceGet) X(cuDeviceGetCount) X(cuDevicePrimaryCtxRetain)                 \
    X(cuDevicePrimaryCtxRelease_v2) X(cuCtxPushCurrent_v2) X(cuCtxPopCurrent_v2)             \
    X(cuGetErrorName) X(cuMemAlloc_v2) X(cuMemFree_v2) X(cuMemGetInfo_v2) X(cuMemHostAlloc)  \
    X(cuMemFreeHost) X(cuMemHostGetFlags) X(cuEventCreate) X(cuEventRecord) X(cuEventQuery)  \
    X(cuEventSynchronize) X(cuEventDestroy_v2) X(cuStreamSynchronize) X(cuMemPoolCreate) X(cuMemPoolDestroy)       \
    X(cuMemAllocFromPoolAsync) X(cuMemFreeAsync) X(cuMemPoolSetAttribute)                    \
    X(cuMemPoolGetAttribute) X(cuMemPoolTrimTo) X(cuMemPoolExportToShareableHandle)          \
    X(cuMemPoolImportFromShareableHandle) X(cuMemPoolExportPointer) X(cuMemPoolImportPointer) \
    X(cuMemGetAllocationGranularity) X(cuMemCreate) X(cuMemRelease) X(cuMemAddressReserve)   \
    X(cuMemAddressFree) X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess)                          \
    X(cuMemExportToShareableHandle) X(cuMemImportFromShareableHandle) X(cuDriverGetVersion)      \
    X(cuThreadExchangeStreamCaptureMode) X(cuStreamCreate) X(cuStreamDestroy_v2)              \
    X(cuStreamIsCapturing) X(cuDeviceGetAttribute) X(cuMemPoolSetAccess) X(cuMemPoolGetAccess) \
    X(cuDeviceGetUuid_v2) X(cuDevicePrimaryCtxGetState) X(cuCtxGetCurrent)   \
    X(cuCtxSetCurrent) X(cuMemGetAddressRange_v2)

#define AS_ENUM(name) F_##name,
enum { FAKE_FUNCS(AS_ENUM) F_COUNT };
#define AS_NAME(name) #name,
static const char *const fn_names[F_COUNT] = {FAKE_FUNCS(AS_NAME)};

/* ---- state (all under mu) ---- */
struct fake_ctx {
    unsigned magic;
    int dev;
};

struct fake_event {
    struct fake_event *next;
    int dev;
    unsigned flags;
    int recorded;
    uintptr_t stream;
    uint64_t seq;
};

struct fake_stream {
    int dev;
    uintptr_t id;
    uint64_t submitted, completed;
};

enum { K_DEVICE = 1, K_HOST, K_POOL };

struct fake_alloc {
    uintptr_t ptr;
    size_t size;
    int dev; /* -1 for pinned host memory */
    int kind;
    unsigned flags;
    struct fake_pool *pool;
};

struct fake_pool {
    int id;
    int dev;
    int handle_types;
    int destroyed;
    struct fake_pool *origin; /* non-NULL: imported from origin */
    size_t max_size;
    uint64_t threshold, used, used_high, cached, reserved_high;
    int reuse[3];
    int access[MAX_DEV]; /* CUmemAccess_flags per device: the resident one's is read/write */
};

/* A stream from cuStreamCreate; kept (dead) after cuStreamDestroy_v2 so that
 * a use after destruction is caught and the handle is never reused. */
struct fake_created_stream {
    int dev;
    unsigned flags;
    int dead;
};

struct fake_handle {
    int id;
    int dev; /* -1 for an imported handle: its memory is the exporter's */
    int memfd;
    size_t size;
    int handle_types;
    int refs; /* 1 until cuMemRelease, plus one per mapping */
};

struct fake_reservation {
    uintptr_t base;
    size_t size;
};

struct fake_mapping {
    uintptr_t va;
    size_t size;
    struct fake_handle *h;
    int access[MAX_DEV];
};

/* A growable array of pointers or structs. */
#define VEC(T)       \
    struct {         \
        T *v;        \
        size_t n, c; \
    }
#define VEC_PUSH(vec, x)                                                        \
    do {                                                                        \
        if ((vec).n == (vec).c) {                                               \
            size_t nc_ = (vec).c ? (vec).c * 2 : 16;                            \
            void *nv_ = realloc((vec).v, nc_ * sizeof(*(vec).v));              \
            if (!nv_) abort();                                                  \
            (vec).v = nv_;                                                      \
            (vec).c = nc_;                                                      \
        }                                                                       \
        (vec).v[(vec).n++] = (x);                                               \
    } while (0)
#define VEC_DEL(vec, i) ((vec).v[(i)] = (vec).v[--(vec).n])

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
/* fake_cuda_hold: while held, every entry point waits on entry. */
static int held;
static pthread_cond_t unheld = PTHREAD_COND_INITIALIZER;
static int initialized;
static int n_devices = 2;
/* The "physical" GPU each ordinal names (FAKE_CUDA_VISIBLE_ORDER), which
 * decides its UUID. */
static int visible[MAX_DEV];
static const char *visible_override; /* fake_cuda_set_visible_order; NULL: the environment */
static uint64_t capacity = (uint64_t)1 << 30;
static int driver_version = 13000; /* CUDA_VERSION encoding: 1000 * major + 10 * minor */
static uint64_t dev_used[MAX_DEV]; /* bytes charged against capacity */
static long retained[MAX_DEV];
static struct fake_ctx ctxs[MAX_DEV];
static long calls[F_COUNT];
static struct {
    int code;
    long after;
} inject[F_COUNT];
static int manual_events;
/* FAKE_CUDA_VIRTUAL: device memory is address space (see the top). */
static int virt;
struct va_range {
    uintptr_t base;
    size_t size;
};
/* Each device's window and its used ranges, sorted by address. */
static struct {
    uintptr_t base;
    size_t size;
    VEC(struct va_range) used;
} windows[MAX_DEV];
static long long pushes, pops;
static unsigned generation = 1; /* bumped by reset: stale thread stacks are dropped */
static int next_id = 1;

static VEC(struct fake_alloc) allocs;
static VEC(struct fake_stream) streams;
static VEC(struct fake_pool *) pools;
static VEC(struct fake_handle *) handles;
static VEC(struct fake_reservation) reservations;
static VEC(struct fake_mapping *) mappings;
static VEC(struct fake_created_stream *) created_streams;
static VEC(uintptr_t) capturing; /* streams marked with fake_cuda_set_stream_capturing */
static struct fake_event *events;
/* CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED per device (0 until set). */
static int attr_rdma_vmm[MAX_DEV];
/* CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, or 0
 * for "not set": the attribute is then unknown, as to drivers before 12.9
 * (CUDA_ERROR_INVALID_VALUE). Stored as value + 1. */
static int attr_host_numa_vmm[MAX_DEV];

/* VMM granularities (fake_cuda_set_granularity); the minimum is enforced. */
static size_t gran_min = GRANULARITY, gran_rec = GRANULARITY;
/* The stream handle the last call of each stream-taking entry point got. */
static uintptr_t last_stream[F_COUNT];
/* The properties of the last cuMemCreate and cuMemPoolCreate calls. */
static CUmemAllocationProp last_create_prop;
static CUmemPoolProps last_pool_props;
/* Pointers imported with cuMemPoolImportPointer and not freed (cuMemFree_v2). */
struct fake_import {
    uintptr_t ptr;
    int dev;
    struct fake_pool *pool;
};
static VEC(struct fake_import) imports;

static __thread struct {
    unsigned gen;
    int depth;
    int stack[MAX_DEPTH];
} tls;

/* Stream capture: fake_cuda_set_global_capture(1) plays another thread
 * recording a CUDA graph in the default (global) mode. Like the real driver,
 * "potentially unsafe" calls (allocations) are then refused unless the
 * calling thread switched to the relaxed mode
 * (cuThreadExchangeStreamCaptureMode), and calls that would synchronize or
 * be captured (frees, event record/query, stream sync) are refused; each
 * refusal is counted (fake_cuda_capture_violations). */
static __thread int tls_capture_mode; /* CU_STREAM_CAPTURE_MODE_*, per thread */
static int global_capture;
static long capture_violations;
#define ANY_CAPTURE() (global_capture || capturing.n > 0)
#define UNSAFE_IN_CAPTURE()                                                        \
    if (ANY_CAPTURE() && tls_capture_mode != CU_STREAM_CAPTURE_MODE_RELAXED) {      \
        capture_violations++;                                                      \
        RETURN(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);                             \
    }
#define NEVER_IN_CAPTURE()                                                         \
    if (ANY_CAPTURE()) {                                                           \
        capture_violations++;                                                      \
        RETURN(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);                             \
    }

static void read_visible(void);

static void read_env(void) {
    const char *s = getenv("FAKE_CUDA_DEVICES");
    n_devices = 2;
    if (s && *s) {
        long n = strtol(s, NULL, 10);
        n_devices = n < 0 ? 0 : n > MAX_DEV ? MAX_DEV : (int)n;
    }
    capacity = (uint64_t)1 << 30;
    s = getenv("FAKE_CUDA_CAPACITY");
    if (s && *s) capacity = strtoull(s, NULL, 10);
    s = getenv("FAKE_CUDA_VIRTUAL");
    virt = s && *s && strcmp(s, "0") != 0;
    driver_version = 13000;
    s = getenv("FAKE_CUDA_DRIVER_VERSION");
    if (s && *s) driver_version = (int)strtol(s, NULL, 10);
    read_visible();
}

/* FAKE_CUDA_VISIBLE_ORDER (or fake_cuda_set_visible_order's list), when
 * set, decides the device count and each ordinal's GPU. */
static void read_visible(void) {
    for (int i = 0; i < MAX_DEV; i++) visible[i] = i;
    const char *s = visible_override ? visible_override : getenv("FAKE_CUDA_VISIBLE_ORDER");
    if (s && *s) {
        /* Like CUDA_VISIBLE_DEVICES: the list ends at the first entry that
         * is not a GPU index (0..15) or repeats one. */
        int n = 0;
        while (n < MAX_DEV) {
            char *end;
            long g = strtol(s, &end, 10);
            if (end == s || g < 0 || g >= MAX_DEV) break;
            int dup = 0;
            for (int j = 0; j < n; j++) dup |= visible[j] == g;
            if (dup) break;
            visible[n++] = (int)g;
            if (*end != ',') break;
            s = end + 1;
        }
        n_devices = n;
    }
}

static void sync_tls(void) {
    if (tls.gen != generation) {
        tls.gen = generation;
        tls.depth = 0;
    }
}

/* The device of the calling thread's current context, or -1. */
static int current_dev(void) {
    sync_tls();
    return tls.depth > 0 ? tls.stack[tls.depth - 1] : -1;
}

static int valid_dev(int dev) { return dev >= 0 && dev < n_devices; }

#define ENTER(name)                                               \
    pthread_mutex_lock(&mu);                                      \
    while (held) pthread_cond_wait(&unheld, &mu);                 \
    calls[F_##name]++;                                            \
    if (inject[F_##name].code != 0) {                             \
        if (inject[F_##name].after > 0) {                         \
            inject[F_##name].after--;                             \
        } else {                                                  \
            int injected_ = inject[F_##name].code;                \
            pthread_mutex_unlock(&mu);                            \
            return injected_;                                     \
        }                                                         \
    }
#define RETURN(code)                   \
    do {                               \
        int rc_ = (code);              \
        pthread_mutex_unlock(&mu);     \
        return rc_;                    \
    } while (0)
#define NEED_INIT() \
    if (!initialized) RETURN(CUDA_ERROR_NOT_INITIALIZED)
/* Declares cur, the current context's device, or fails without one. */
#define NEED_CTX()                         \
    NEED_INIT();                           \
    int cur = current_dev();               \
    if (cur < 0) RETURN(CUDA_ERROR_INVALID_CONTEXT)

static uint64_t round_up(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

/* ---- virtual device memory (FAKE_CUDA_VIRTUAL) ---- */

/* The window holds the device's memory and every reservation torch makes
 * for expandable segments (each as large as the device and an eighth), so
 * it is many times the capacity; address space costs nothing. */
static int window_open(int dev) {
    if (windows[dev].base) return 1;
    size_t want = (size_t)capacity * 64;
    if (want < ((size_t)1 << 40)) want = (size_t)1 << 40;
    for (; want >= ((size_t)1 << 34); want /= 2) {
        void *p = mmap(NULL, want + GRANULARITY, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) continue;
        windows[dev].base = round_up((uintptr_t)p, GRANULARITY);
        windows[dev].size = want;
        return 1;
    }
    return 0;
}

/* The lowest free range of dev's window that holds size bytes at the given
 * alignment, or 0. */
static uintptr_t va_take(int dev, size_t size, size_t alignment) {
    if (!window_open(dev)) return 0;
    size = round_up(size, GRANULARITY);
    uintptr_t at = windows[dev].base, end = windows[dev].base + windows[dev].size;
    size_t i = 0;
    for (;; i++) {
        at = round_up(at, alignment);
        uintptr_t gap_end = i < windows[dev].used.n ? windows[dev].used.v[i].base : end;
        if (at + size <= gap_end) break;
        if (i == windows[dev].used.n) return 0;
        at = windows[dev].used.v[i].base + windows[dev].used.v[i].size;
    }
    struct va_range r = {at, size};
    VEC_PUSH(windows[dev].used, r); /* grows by one, then shift into place */
    memmove(&windows[dev].used.v[i + 1], &windows[dev].used.v[i], (windows[dev].used.n - 1 - i) * sizeof(r));
    windows[dev].used.v[i] = r;
    return at;
}

/* Gives back the range at p; -1 if no device's window has one there. */
static int va_give(uintptr_t p) {
    for (int d = 0; d < MAX_DEV; d++) {
        for (size_t i = 0; i < windows[d].used.n; i++) {
            if (windows[d].used.v[i].base != p) continue;
            memmove(&windows[d].used.v[i], &windows[d].used.v[i + 1], (windows[d].used.n - 1 - i) * sizeof(struct va_range));
            windows[d].used.n--;
            return d;
        }
    }
    return -1;
}

static long find_alloc(uintptr_t p) {
    for (size_t i = 0; i < allocs.n; i++)
        if (allocs.v[i].ptr == p) return (long)i;
    return -1;
}

static long find_containing(uintptr_t p) {
    for (size_t i = 0; i < allocs.n; i++)
        if (p >= allocs.v[i].ptr && p < allocs.v[i].ptr + allocs.v[i].size) return (long)i;
    return -1;
}

static struct fake_event *find_event(CUevent ev) {
    for (struct fake_event *e = events; e; e = e->next)
        if (e == ev) return e;
    return NULL;
}

static struct fake_stream *stream_of(int dev, uintptr_t id) {
    for (size_t i = 0; i < streams.n; i++)
        if (streams.v[i].dev == dev && streams.v[i].id == id) return &streams.v[i];
    struct fake_stream s = {dev, id, 0, 0};
    VEC_PUSH(streams, s);
    return &streams.v[streams.n - 1];
}

static struct fake_pool *find_pool(CUmemoryPool p) {
    for (size_t i = 0; i < pools.n; i++)
        if (pools.v[i] == p) return pools.v[i];
    return NULL;
}

static struct fake_handle *find_handle(CUmemGenericAllocationHandle h) {
    for (size_t i = 0; i < handles.n; i++)
        if ((CUmemGenericAllocationHandle)(uintptr_t)handles.v[i] == h) return handles.v[i];
    return NULL;
}

static int is_capturing(uintptr_t stream) {
    for (size_t i = 0; i < capturing.n; i++)
        if (capturing.v[i] == stream) return 1;
    return 0;
}

static struct fake_created_stream *find_created(uintptr_t stream) {
    for (size_t i = 0; i < created_streams.n; i++)
        if ((uintptr_t)created_streams.v[i] == stream) return created_streams.v[i];
    return NULL;
}

/* 0 and CU_STREAM_LEGACY (1) are the legacy default stream. */
static int is_legacy(uintptr_t stream) { return stream == 0 || stream == 1; }

/* A blocking stream captures: the legacy stream would join the capture. */
static int blocking_capture(void) {
    for (size_t i = 0; i < capturing.n; i++) {
        struct fake_created_stream *c = find_created(capturing.v[i]);
        if (!c || !(c->flags & CU_STREAM_NON_BLOCKING)) return 1;
    }
    return 0;
}

/* A stream from cuStreamCreate must be alive and the current device's. */
static int check_stream(int cur, uintptr_t stream) {
    struct fake_created_stream *c = find_created(stream);
    if (c && (c->dead || c->dev != cur)) return CUDA_ERROR_INVALID_HANDLE;
    return CUDA_SUCCESS;
}

/* Refuses (and counts) a stream-ordered call on a capturing stream, which
 * the real driver would turn into a graph node, or on the legacy stream while
 * a blocking stream captures, which would break that capture. */
#define NOT_ON_CAPTURING_STREAM(stream)                                   \
    if (is_capturing((uintptr_t)(stream))) {                              \
        capture_violations++;                                             \
        RETURN(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);                    \
    }                                                                     \
    if (is_legacy((uintptr_t)(stream)) && blocking_capture()) {           \
        capture_violations++;                                             \
        RETURN(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);                       \
    }

/* ======================= initialisation and devices ======================= */

EXPORT CUresult cuInit(unsigned int flags) {
    ENTER(cuInit);
    if (flags != 0) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (!initialized) read_env();
    if (n_devices == 0) RETURN(CUDA_ERROR_NO_DEVICE);
    initialized = 1;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    ENTER(cuDeviceGet);
    NEED_INIT();
    if (!device) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (!valid_dev(ordinal)) RETURN(CUDA_ERROR_INVALID_DEVICE);
    *device = ordinal;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuDeviceGetCount(int *count) {
    ENTER(cuDeviceGetCount);
    NEED_INIT();
    if (!count) RETURN(CUDA_ERROR_INVALID_VALUE);
    *count = n_devices;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev) {
    ENTER(cuDeviceGetAttribute);
    NEED_INIT();
    if (!pi) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (!valid_dev(dev)) RETURN(CUDA_ERROR_INVALID_DEVICE);
    if (attrib == CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED && attr_host_numa_vmm[dev]) {
        *pi = attr_host_numa_vmm[dev] - 1;
        RETURN(CUDA_SUCCESS);
    }
    if (attrib != CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED) RETURN(CUDA_ERROR_INVALID_VALUE);
    *pi = attr_rdma_vmm[dev];
    RETURN(CUDA_SUCCESS);
}

/* Each physical GPU g has the UUID fa4ec0da-0000-4000-8000-0000000000gg
 * (hex); ordinal dev names GPU visible[dev]. */
EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) {
    ENTER(cuDeviceGetUuid_v2);
    NEED_INIT();
    if (!uuid) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (!valid_dev(dev)) RETURN(CUDA_ERROR_INVALID_DEVICE);
    static const unsigned char base[16] = {0xfa, 0x4e, 0xc0, 0xda, 0, 0, 0x40, 0, 0x80, 0, 0, 0, 0, 0, 0, 0};
    memcpy(uuid->bytes, base, sizeof(base));
    uuid->bytes[15] = (char)visible[dev];
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    ENTER(cuDevicePrimaryCtxRetain);
    NEED_INIT();
    if (!pctx) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (!valid_dev(dev)) RETURN(CUDA_ERROR_INVALID_DEVICE);
    ctxs[dev].magic = MAGIC;
    ctxs[dev].dev = dev;
    retained[dev]++;
    *pctx = &ctxs[dev];
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    ENTER(cuDevicePrimaryCtxRelease_v2);
    NEED_INIT();
    if (!valid_dev(dev)) RETURN(CUDA_ERROR_INVALID_DEVICE);
    if (retained[dev] == 0) RETURN(CUDA_ERROR_INVALID_CONTEXT);
    retained[dev]--;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
    ENTER(cuCtxPushCurrent_v2);
    NEED_INIT();
    if (ctx < &ctxs[0] || ctx >= &ctxs[MAX_DEV] || ctx->magic != MAGIC || retained[ctx->dev] == 0)
        RETURN(CUDA_ERROR_INVALID_CONTEXT);
    sync_tls();
    if (tls.depth == MAX_DEPTH) RETURN(CUDA_ERROR_UNKNOWN);
    tls.stack[tls.depth++] = ctx->dev;
    pushes++;
    RETURN(CUDA_SUCCESS);
}

/* Torch (c10::cuda::DriverAPI) asks these; gpumempool does not. */
EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active) {
    ENTER(cuDevicePrimaryCtxGetState);
    NEED_INIT();
    if (!flags || !active) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (!valid_dev(dev)) RETURN(CUDA_ERROR_INVALID_DEVICE);
    *flags = 0;
    *active = retained[dev] > 0;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx) {
    ENTER(cuCtxGetCurrent);
    NEED_INIT();
    if (!pctx) RETURN(CUDA_ERROR_INVALID_VALUE);
    sync_tls();
    *pctx = tls.depth ? &ctxs[tls.stack[tls.depth - 1]] : NULL;
    RETURN(CUDA_SUCCESS);
}

/* Binds ctx in place of the thread's current context (NULL: none). */
EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
    ENTER(cuCtxSetCurrent);
    NEED_INIT();
    sync_tls();
    if (!ctx) {
        if (tls.depth) tls.depth--;
        RETURN(CUDA_SUCCESS);
    }
    if (ctx < &ctxs[0] || ctx >= &ctxs[MAX_DEV] || ctx->magic != MAGIC || retained[ctx->dev] == 0)
        RETURN(CUDA_ERROR_INVALID_CONTEXT);
    if (tls.depth == 0) tls.depth = 1;
    tls.stack[tls.depth - 1] = ctx->dev;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *pctx) {
    ENTER(cuCtxPopCurrent_v2);
    NEED_INIT();
    sync_tls();
    if (tls.depth == 0) RETURN(CUDA_ERROR_INVALID_CONTEXT);
    int dev = tls.stack[--tls.depth];
    if (pctx) *pctx = &ctxs[dev];
    pops++;
    RETURN(CUDA_SUCCESS);
}

static const struct {
    int code;
    const char *name;
} error_names[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED"},
    {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT"},
    {CUDA_ERROR_ALREADY_MAPPED, "CUDA_ERROR_ALREADY_MAPPED"},
    {CUDA_ERROR_NOT_MAPPED, "CUDA_ERROR_NOT_MAPPED"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED"},
    {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"},
    {CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN"},
};

/* Per thread; works before cuInit, like the real one. */
EXPORT CUresult cuThreadExchangeStreamCaptureMode(int *mode) {
    ENTER(cuThreadExchangeStreamCaptureMode);
    if (!mode || *mode < CU_STREAM_CAPTURE_MODE_GLOBAL || *mode > CU_STREAM_CAPTURE_MODE_RELAXED)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    int old = tls_capture_mode;
    tls_capture_mode = *mode;
    *mode = old;
    RETURN(CUDA_SUCCESS);
}

/* Works before cuInit, like the real one. */
EXPORT CUresult cuDriverGetVersion(int *version) {
    ENTER(cuDriverGetVersion);
    if (!version) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (!initialized) read_env();
    *version = driver_version;
    RETURN(CUDA_SUCCESS);
}

/* Works before cuInit, like the real one. */
EXPORT CUresult cuGetErrorName(CUresult error, const char **pStr) {
    ENTER(cuGetErrorName);
    if (!pStr) RETURN(CUDA_ERROR_INVALID_VALUE);
    for (size_t i = 0; i < sizeof(error_names) / sizeof(error_names[0]); i++) {
        if (error_names[i].code == error) {
            *pStr = error_names[i].name;
            RETURN(CUDA_SUCCESS);
        }
    }
    *pStr = NULL;
    RETURN(CUDA_ERROR_INVALID_VALUE);
}

/* cuda.h's plain names of the _v2 functions, which the real driver exports
 * too (torch before 2.6 looks its driver functions up by these names). */
EXPORT CUresult cuCtxPushCurrent(CUcontext ctx) __attribute__((alias("cuCtxPushCurrent_v2")));
EXPORT CUresult cuCtxPopCurrent(CUcontext *pctx) __attribute__((alias("cuCtxPopCurrent_v2")));

EXPORT CUresult cuGetErrorString(CUresult error, const char **pStr) {
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    *pStr = error == CUDA_SUCCESS ? "no error" : error == CUDA_ERROR_OUT_OF_MEMORY ? "out of memory"
                                                                                  : "error (fake CUDA driver)";
    return CUDA_SUCCESS;
}

/* Functions torch's CUDA code resolves when it starts (and asserts are
 * there) but that nothing here uses: multicast, green contexts, stream
 * memory operations, driver logs. They answer "not supported". */
#define FAKE_UNSUPPORTED(X)                                                                                 \
    X(cuMemsetD32Async) X(cuStreamWriteValue32) X(cuMulticastAddDevice) X(cuMulticastBindMem)                \
    X(cuMulticastCreate) X(cuMulticastUnbind) X(cuCtxFromGreenCtx) X(cuDevResourceGenerateDesc)              \
    X(cuDevSmResourceSplitByCount) X(cuDeviceGetDevResource) X(cuGreenCtxCreate) X(cuGreenCtxDestroy)        \
    X(cuGreenCtxStreamCreate) X(cuMemGetAllocationPropertiesFromHandle) X(cuMemRetainAllocationHandle)       \
    X(cuLogsRegisterCallback) X(cuLogsUnregisterCallback)
#define AS_UNSUPPORTED(name) \
    EXPORT CUresult name(void) { return CUDA_ERROR_NOT_SUPPORTED; }
FAKE_UNSUPPORTED(AS_UNSUPPORTED)

/* ============================== device memory ============================== */

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    ENTER(cuMemAlloc_v2);
    UNSAFE_IN_CAPTURE();
    NEED_CTX();
    if (!dptr || bytesize == 0) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (dev_used[cur] + bytesize > capacity || bytesize > capacity) RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    void *p = virt ? (void *)va_take(cur, bytesize, GRANULARITY)
                   : aligned_alloc(DEVICE_ALIGN, round_up(bytesize, DEVICE_ALIGN));
    if (!p) RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    struct fake_alloc a = {(uintptr_t)p, bytesize, cur, K_DEVICE, 0, NULL};
    VEC_PUSH(allocs, a);
    dev_used[cur] += bytesize;
    *dptr = (CUdeviceptr)(uintptr_t)p;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) {
    ENTER(cuMemFree_v2);
    NEVER_IN_CAPTURE();
    NEED_CTX();
    /* An importer frees a pointer imported from a pool with cuMemFree: that
     * only drops its mapping (in one process the exporter's allocation stays). */
    for (size_t k = 0; k < imports.n; k++) {
        if (imports.v[k].ptr != (uintptr_t)dptr) continue;
        if (imports.v[k].dev != cur) RETURN(CUDA_ERROR_INVALID_CONTEXT);
        VEC_DEL(imports, k);
        RETURN(CUDA_SUCCESS);
    }
    long i = find_alloc((uintptr_t)dptr);
    if (i < 0 || allocs.v[i].kind != K_DEVICE) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (allocs.v[i].dev != cur) RETURN(CUDA_ERROR_INVALID_CONTEXT);
    dev_used[cur] -= allocs.v[i].size;
    if (virt)
        va_give(allocs.v[i].ptr);
    else
        free((void *)allocs.v[i].ptr);
    VEC_DEL(allocs, i);
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    ENTER(cuMemGetInfo_v2);
    NEED_CTX();
    if (!free_bytes || !total) RETURN(CUDA_ERROR_INVALID_VALUE);
    *total = capacity;
    *free_bytes = dev_used[cur] >= capacity ? 0 : capacity - dev_used[cur];
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int flags) {
    ENTER(cuMemHostAlloc);
    UNSAFE_IN_CAPTURE();
    NEED_CTX();
    if (!pp || bytesize == 0 || (flags & ~CU_MEMHOSTALLOC_ALL)) RETURN(CUDA_ERROR_INVALID_VALUE);
    void *p = aligned_alloc(HOST_ALIGN, round_up(bytesize, HOST_ALIGN));
    if (!p) RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    struct fake_alloc a = {(uintptr_t)p, bytesize, -1, K_HOST, flags, NULL};
    VEC_PUSH(allocs, a);
    *pp = p;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuMemFreeHost(void *p) {
    ENTER(cuMemFreeHost);
    NEVER_IN_CAPTURE();
    NEED_CTX();
    long i = find_alloc((uintptr_t)p);
    if (i < 0 || allocs.v[i].kind != K_HOST) RETURN(CUDA_ERROR_INVALID_VALUE);
    free(p);
    VEC_DEL(allocs, i);
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuMemHostGetFlags(unsigned int *pFlags, void *p) {
    ENTER(cuMemHostGetFlags);
    NEED_CTX();
    long i = find_containing((uintptr_t)p);
    if (!pFlags || i < 0 || allocs.v[i].kind != K_HOST) RETURN(CUDA_ERROR_INVALID_VALUE);
    *pFlags = allocs.v[i].flags;
    RETURN(CUDA_SUCCESS);
}

/* ============================ events and streams ============================ */

EXPORT CUresult cuEventCreate(CUevent *phEvent, unsigned int flags) {
    ENTER(cuEventCreate);
    NEED_CTX();
    if (!phEvent || (flags & ~CU_EVENT_FLAGS_ALL)) RETURN(CUDA_ERROR_INVALID_VALUE);
    struct fake_event *e = calloc(1, sizeof(*e));
    if (!e) RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    e->dev = cur;
    e->flags = flags;
    e->next = events;
    events = e;
    *phEvent = e;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuEventRecord(CUevent hEvent, CUstream hStream) {
    ENTER(cuEventRecord);
    NEVER_IN_CAPTURE();
    NEED_CTX();
    last_stream[F_cuEventRecord] = (uintptr_t)hStream;
    if (check_stream(cur, (uintptr_t)hStream)) RETURN(CUDA_ERROR_INVALID_HANDLE);
    struct fake_event *e = find_event(hEvent);
    if (!e) RETURN(CUDA_ERROR_INVALID_HANDLE);
    if (e->dev != cur) RETURN(CUDA_ERROR_INVALID_HANDLE); /* event and stream in other contexts */
    struct fake_stream *s = stream_of(cur, (uintptr_t)hStream);
    e->recorded = 1;
    e->stream = (uintptr_t)hStream;
    e->seq = ++s->submitted;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuEventQuery(CUevent hEvent) {
    ENTER(cuEventQuery);
    NEVER_IN_CAPTURE();
    NEED_CTX();
    struct fake_event *e = find_event(hEvent);
    if (!e || e->dev != cur) RETURN(CUDA_ERROR_INVALID_HANDLE);
    if (!manual_events || !e->recorded) RETURN(CUDA_SUCCESS);
    struct fake_stream *s = stream_of(e->dev, e->stream);
    RETURN(s->completed >= e->seq ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY);
}

/* Waiting completes the work of the event's stream up to the event: what
 * the device does while the caller blocks. */
EXPORT CUresult cuEventSynchronize(CUevent hEvent) {
    ENTER(cuEventSynchronize);
    NEVER_IN_CAPTURE();
    NEED_CTX();
    struct fake_event *e = find_event(hEvent);
    if (!e || e->dev != cur) RETURN(CUDA_ERROR_INVALID_HANDLE);
    if (e->recorded) {
        struct fake_stream *s = stream_of(e->dev, e->stream);
        if (s->completed < e->seq) s->completed = e->seq;
    }
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuEventDestroy_v2(CUevent hEvent) {
    ENTER(cuEventDestroy_v2);
    NEED_CTX();
    for (struct fake_event **pp = &events; *pp; pp = &(*pp)->next) {
        if (*pp == hEvent) {
            if (hEvent->dev != cur) RETURN(CUDA_ERROR_INVALID_HANDLE);
            *pp = hEvent->next;
            free(hEvent);
            RETURN(CUDA_SUCCESS);
        }
    }
    RETURN(CUDA_ERROR_INVALID_HANDLE);
}

/* Pools release cached memory above their threshold at synchronization. */
static void pool_trim(struct fake_pool *p, uint64_t keep) {
    uint64_t room = keep > p->used ? keep - p->used : 0;
    if (p->cached > room) {
        dev_used[p->dev] -= p->cached - room;
        p->cached = room;
    }
}

/* During a capture: refused on a capturing stream and on the legacy stream
 * (whichever stream captures), allowed on others in the relaxed mode. */
EXPORT CUresult cuStreamSynchronize(CUstream hStream) {
    ENTER(cuStreamSynchronize);
    /* The legacy stream waits for every blocking stream: refused while one
     * captures (NOT_ON_CAPTURING_STREAM) or while a capture of unknown
     * streams is played; with only non-blocking streams capturing it is
     * legal in the relaxed mode (torch 2.12 and 2.13 synchronize it when a
     * CUDA graph capture begins, their RNG state's initialisation). */
    if (is_legacy((uintptr_t)hStream) && global_capture) NEVER_IN_CAPTURE();
    NOT_ON_CAPTURING_STREAM(hStream);
    UNSAFE_IN_CAPTURE();
    NEED_CTX();
    last_stream[F_cuStreamSynchronize] = (uintptr_t)hStream;
    if (check_stream(cur, (uintptr_t)hStream)) RETURN(CUDA_ERROR_INVALID_HANDLE);
    struct fake_stream *s = stream_of(cur, (uintptr_t)hStream);
    s->completed = s->submitted;
    for (size_t i = 0; i < pools.n; i++)
        if (!pools.v[i]->origin && pools.v[i]->dev == cur) pool_trim(pools.v[i], pools.v[i]->threshold);
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuStreamCreate(CUstream *phStream, unsigned int flags) {
    ENTER(cuStreamCreate);
    NEED_CTX();
    if (!phStream || (flags & ~(unsigned)CU_STREAM_NON_BLOCKING)) RETURN(CUDA_ERROR_INVALID_VALUE);
    struct fake_created_stream *c = calloc(1, sizeof(*c));
    if (!c) RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    c->dev = cur;
    c->flags = flags;
    VEC_PUSH(created_streams, c);
    *phStream = c;
    RETURN(CUDA_SUCCESS);
}

/* Stricter than the real driver: under the stream's own device's context. */
EXPORT CUresult cuStreamDestroy_v2(CUstream hStream) {
    ENTER(cuStreamDestroy_v2);
    NEED_CTX();
    struct fake_created_stream *c = find_created((uintptr_t)hStream);
    if (!c || c->dead || c->dev != cur) RETURN(CUDA_ERROR_INVALID_HANDLE);
    c->dead = 1;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuStreamIsCapturing(CUstream hStream, int *captureStatus) {
    ENTER(cuStreamIsCapturing);
    NEED_CTX();
    if (!captureStatus) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (check_stream(cur, (uintptr_t)hStream)) RETURN(CUDA_ERROR_INVALID_HANDLE);
    if (is_legacy((uintptr_t)hStream) && blocking_capture()) RETURN(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    *captureStatus = is_capturing((uintptr_t)hStream) ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
    RETURN(CUDA_SUCCESS);
}

/* ========================= stream-ordered allocator ========================= */

static int zeroed(const unsigned char *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (p[i]) return 0;
    return 1;
}

EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props) {
    ENTER(cuMemPoolCreate);
    NEED_CTX();
    if (props) last_pool_props = *props;
    if (!pool || !props || props->allocType != CU_MEM_ALLOCATION_TYPE_PINNED ||
        props->win32SecurityAttributes || !zeroed(props->reserved, sizeof(props->reserved)))
        RETURN(CUDA_ERROR_INVALID_VALUE);
    /* Before CUDA 12.2, maxSize and usage were reserved bytes that had to be 0. */
    if (driver_version < 12020 && (props->maxSize || props->usage)) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (props->location.type != CU_MEM_LOCATION_TYPE_DEVICE) RETURN(CUDA_ERROR_NOT_SUPPORTED);
    if (!valid_dev(props->location.id)) RETURN(CUDA_ERROR_INVALID_DEVICE);
    if (props->handleTypes & ~CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) RETURN(CUDA_ERROR_NOT_SUPPORTED);
    struct fake_pool *p = calloc(1, sizeof(*p));
    if (!p) RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    p->id = next_id++;
    p->dev = props->location.id;
    p->handle_types = props->handleTypes;
    p->max_size = props->maxSize;
    p->reuse[0] = p->reuse[1] = p->reuse[2] = 1;
    p->access[p->dev] = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    VEC_PUSH(pools, p);
    *pool = p;
    RETURN(CUDA_SUCCESS);
}

/* Like the real driver, destroying a pool with outstanding allocations
 * succeeds; they stay valid until freed. The struct lives until reset. */
EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool) {
    ENTER(cuMemPoolDestroy);
    NEED_CTX();
    struct fake_pool *p = find_pool(pool);
    if (!p || p->destroyed) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (!p->origin) pool_trim(p, 0);
    p->destroyed = 1;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream) {
    ENTER(cuMemAllocFromPoolAsync);
    last_stream[F_cuMemAllocFromPoolAsync] = (uintptr_t)hStream;
    NOT_ON_CAPTURING_STREAM(hStream);
    UNSAFE_IN_CAPTURE();
    NEED_CTX();
    if (check_stream(cur, (uintptr_t)hStream)) RETURN(CUDA_ERROR_INVALID_HANDLE);
    struct fake_pool *p = find_pool(pool);
    if (!dptr || bytesize == 0 || !p || p->destroyed) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (p->origin) RETURN(CUDA_ERROR_INVALID_VALUE); /* imported pools cannot allocate */
    uint64_t take = p->cached < bytesize ? p->cached : bytesize;
    uint64_t grow = bytesize - take;
    if (p->max_size && p->used + p->cached + grow > p->max_size) RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    if (dev_used[p->dev] + grow > capacity) RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    void *mem = aligned_alloc(DEVICE_ALIGN, round_up(bytesize, DEVICE_ALIGN));
    if (!mem) RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    p->cached -= take;
    p->used += bytesize;
    dev_used[p->dev] += grow;
    if (p->used > p->used_high) p->used_high = p->used;
    if (p->used + p->cached > p->reserved_high) p->reserved_high = p->used + p->cached;
    struct fake_alloc a = {(uintptr_t)mem, bytesize, p->dev, K_POOL, 0, p};
    VEC_PUSH(allocs, a);
    *dptr = (CUdeviceptr)(uintptr_t)mem;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
    ENTER(cuMemFreeAsync);
    last_stream[F_cuMemFreeAsync] = (uintptr_t)hStream;
    NOT_ON_CAPTURING_STREAM(hStream);
    NEED_CTX();
    if (check_stream(cur, (uintptr_t)hStream)) RETURN(CUDA_ERROR_INVALID_HANDLE);
    long i = find_alloc((uintptr_t)dptr);
    if (i < 0 || allocs.v[i].kind != K_POOL) RETURN(CUDA_ERROR_INVALID_VALUE);
    struct fake_pool *p = allocs.v[i].pool;
    p->used -= allocs.v[i].size;
    p->cached += allocs.v[i].size; /* cached until trimmed or synchronized */
    if (p->destroyed) pool_trim(p, 0);
    free((void *)allocs.v[i].ptr);
    VEC_DEL(allocs, i);
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value) {
    ENTER(cuMemPoolSetAttribute);
    NEED_CTX();
    struct fake_pool *p = find_pool(pool);
    if (!p || p->destroyed || !value) RETURN(CUDA_ERROR_INVALID_VALUE);
    switch (attr) {
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
        p->reuse[attr - 1] = *(int *)value;
        break;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
        p->threshold = *(uint64_t *)value;
        break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: /* high watermarks can only be reset to 0 */
        if (*(uint64_t *)value != 0) RETURN(CUDA_ERROR_INVALID_VALUE);
        p->reserved_high = p->used + p->cached;
        break;
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH:
        if (*(uint64_t *)value != 0) RETURN(CUDA_ERROR_INVALID_VALUE);
        p->used_high = p->used;
        break;
    default:
        RETURN(CUDA_ERROR_INVALID_VALUE);
    }
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value) {
    ENTER(cuMemPoolGetAttribute);
    NEED_CTX();
    struct fake_pool *p = find_pool(pool);
    if (!p || p->destroyed || !value) RETURN(CUDA_ERROR_INVALID_VALUE);
    switch (attr) {
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
        *(int *)value = p->reuse[attr - 1];
        break;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: *(uint64_t *)value = p->threshold; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: *(uint64_t *)value = p->used + p->cached; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: *(uint64_t *)value = p->reserved_high; break;
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT: *(uint64_t *)value = p->used; break;
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH: *(uint64_t *)value = p->used_high; break;
    default: RETURN(CUDA_ERROR_INVALID_VALUE);
    }
    RETURN(CUDA_SUCCESS);
}

/* The resident device's access cannot be changed (the real driver refuses
 * revoking it). */
EXPORT CUresult cuMemPoolSetAccess(CUmemoryPool pool, const CUmemAccessDesc *map, size_t count) {
    ENTER(cuMemPoolSetAccess);
    NEED_CTX();
    struct fake_pool *p = find_pool(pool);
    if (!p || p->destroyed || !map || count == 0) RETURN(CUDA_ERROR_INVALID_VALUE);
    for (size_t k = 0; k < count; k++) {
        if (map[k].location.type != CU_MEM_LOCATION_TYPE_DEVICE) RETURN(CUDA_ERROR_NOT_SUPPORTED);
        if (!valid_dev(map[k].location.id)) RETURN(CUDA_ERROR_INVALID_DEVICE);
        int f = map[k].flags;
        if (f != CU_MEM_ACCESS_FLAGS_PROT_NONE && f != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            RETURN(CUDA_ERROR_INVALID_VALUE);
        if (map[k].location.id == p->dev && f != CU_MEM_ACCESS_FLAGS_PROT_READWRITE) RETURN(CUDA_ERROR_INVALID_VALUE);
    }
    for (size_t k = 0; k < count; k++) p->access[map[k].location.id] = map[k].flags;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuMemPoolGetAccess(int *flags, CUmemoryPool memPool, CUmemLocation *location) {
    ENTER(cuMemPoolGetAccess);
    NEED_CTX();
    struct fake_pool *p = find_pool(memPool);
    if (!flags || !location || !p || p->destroyed) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (location->type != CU_MEM_LOCATION_TYPE_DEVICE) RETURN(CUDA_ERROR_NOT_SUPPORTED);
    if (!valid_dev(location->id)) RETURN(CUDA_ERROR_INVALID_DEVICE);
    *flags = p->access[location->id];
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep) {
    ENTER(cuMemPoolTrimTo);
    NEED_CTX();
    struct fake_pool *p = find_pool(pool);
    if (!p || p->destroyed || p->origin) RETURN(CUDA_ERROR_INVALID_VALUE);
    pool_trim(p, minBytesToKeep);
    RETURN(CUDA_SUCCESS);
}

/* memfd_create(2) through syscall(2): glibc wraps it only from 2.27, and
 * the oracle's copy of this driver in the manylinux wheels is built for
 * glibc 2.17 (buildtools/gmp_oracle_stack.py). */
static int fake_memfd_create(const char *name) {
#ifdef SYS_memfd_create
    return (int)syscall(SYS_memfd_create, name, 1u /* MFD_CLOEXEC */);
#else
    (void)name;
    errno = ENOSYS;
    return -1;
#endif
}

/* A shareable handle is a memfd holding a tag and the id of what it names. */
struct share_tag {
    char tag[8];
    int id;
};

static int share_fd(const char *tag, int id) {
    int fd = fake_memfd_create(tag);
    if (fd < 0) return -1;
    struct share_tag t;
    memset(&t, 0, sizeof(t));
    memcpy(t.tag, tag, strnlen(tag, sizeof(t.tag)));
    t.id = id;
    if (pwrite(fd, &t, sizeof(t), 0) != (ssize_t)sizeof(t)) {
        close(fd);
        return -1;
    }
    return fd;
}

static int share_read(int fd, const char *tag) {
    struct share_tag t;
    if (pread(fd, &t, sizeof(t), 0) != (ssize_t)sizeof(t)) return -1;
    if (strncmp(t.tag, tag, sizeof(t.tag)) != 0) return -1;
    return t.id;
}

EXPORT CUresult cuMemPoolExportToShareableHandle(void *handle_out, CUmemoryPool pool, int handleType,
                                                 unsigned long long flags) {
    ENTER(cuMemPoolExportToShareableHandle);
    NEED_CTX();
    struct fake_pool *p = find_pool(pool);
    if (!handle_out || !p || p->destroyed || p->origin || flags) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || !(p->handle_types & handleType))
        RETURN(CUDA_ERROR_INVALID_VALUE);
    int fd = share_fd("fakepool", p->id);
    if (fd < 0) RETURN(CUDA_ERROR_UNKNOWN);
    *(int *)handle_out = fd;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuMemPoolImportFromShareableHandle(CUmemoryPool *pool_out, void *handle, int handleType,
                                                   unsigned long long flags) {
    ENTER(cuMemPoolImportFromShareableHandle);
    NEED_CTX();
    if (!pool_out || flags || handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) RETURN(CUDA_ERROR_INVALID_VALUE);
    int id = share_read((int)(intptr_t)handle, "fakepool");
    struct fake_pool *origin = NULL;
    for (size_t i = 0; i < pools.n; i++)
        if (pools.v[i]->id == id && !pools.v[i]->origin && !pools.v[i]->destroyed) origin = pools.v[i];
    if (!origin) RETURN(CUDA_ERROR_INVALID_VALUE);
    struct fake_pool *p = calloc(1, sizeof(*p));
    if (!p) RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    *p = *origin;
    p->id = next_id++;
    p->origin = origin;
    p->used = p->cached = p->used_high = p->reserved_high = 0;
    /* Only the resident device, whatever the exporter granted. */
    memset(p->access, 0, sizeof(p->access));
    p->access[p->dev] = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    VEC_PUSH(pools, p);
    *pool_out = p;
    RETURN(CUDA_SUCCESS);
}

struct ptr_export {
    char tag[8];
    int pool_id;
    int pad;
    uint64_t ptr, size;
};
_Static_assert(sizeof(struct ptr_export) <= sizeof(CUmemPoolPtrExportData), "ptr_export");

EXPORT CUresult cuMemPoolExportPointer(CUmemPoolPtrExportData *out, CUdeviceptr ptr) {
    ENTER(cuMemPoolExportPointer);
    NEED_CTX();
    long i = find_alloc((uintptr_t)ptr);
    if (!out || i < 0 || allocs.v[i].kind != K_POOL) RETURN(CUDA_ERROR_INVALID_VALUE);
    struct fake_pool *p = allocs.v[i].pool;
    if (!(p->handle_types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) RETURN(CUDA_ERROR_INVALID_VALUE);
    struct ptr_export e;
    memset(&e, 0, sizeof(e));
    memcpy(e.tag, "fakeptr", 8);
    e.pool_id = p->id;
    e.ptr = ptr;
    e.size = allocs.v[i].size;
    memset(out, 0, sizeof(*out));
    memcpy(out, &e, sizeof(e));
    RETURN(CUDA_SUCCESS);
}

/* In one process the imported pointer is the exported one (a second process
 * would see its own mapping of the same memory). */
EXPORT CUresult cuMemPoolImportPointer(CUdeviceptr *ptr_out, CUmemoryPool pool, CUmemPoolPtrExportData *data) {
    ENTER(cuMemPoolImportPointer);
    NEED_CTX();
    struct fake_pool *p = find_pool(pool);
    if (!ptr_out || !data || !p || !p->origin) RETURN(CUDA_ERROR_INVALID_VALUE);
    struct ptr_export e;
    memcpy(&e, data, sizeof(e));
    if (memcmp(e.tag, "fakeptr", 8) != 0 || e.pool_id != p->origin->id) RETURN(CUDA_ERROR_INVALID_VALUE);
    long i = find_alloc((uintptr_t)e.ptr);
    if (i < 0 || allocs.v[i].pool != p->origin) RETURN(CUDA_ERROR_INVALID_VALUE);
    /* Stricter than the real driver, which maps it and lets kernels fault:
     * the importing device must have been given access to the pool. */
    if (p->access[cur] != CU_MEM_ACCESS_FLAGS_PROT_READWRITE) RETURN(CUDA_ERROR_INVALID_DEVICE);
    /* Importing an allocation that this process imported already (from any
     * imported pool) and has not freed is refused. Real drivers either
     * refuse it (CUDA_ERROR_ALREADY_MAPPED, pinned host pools) or return the
     * same address again, and then the first cuMemFree(Async) unmaps it for
     * both imports (nvbug 5570902, see NVIDIA cuda-python's
     * cuda_core/cuda/core/_cpp/resource_handles.cpp); a caller must share
     * one import instead. */
    for (size_t k = 0; k < imports.n; k++)
        if (imports.v[k].ptr == (uintptr_t)e.ptr) RETURN(CUDA_ERROR_ALREADY_MAPPED);
    struct fake_import imp = {(uintptr_t)e.ptr, cur, p};
    VEC_PUSH(imports, imp);
    *ptr_out = e.ptr;
    RETURN(CUDA_SUCCESS);
}

/* The allocation (or VMM mapping) holding dptr. */
EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr) {
    ENTER(cuMemGetAddressRange_v2);
    NEED_CTX();
    long i = find_containing((uintptr_t)dptr);
    if (i >= 0) {
        if (pbase) *pbase = allocs.v[i].ptr;
        if (psize) *psize = allocs.v[i].size;
        RETURN(CUDA_SUCCESS);
    }
    for (size_t k = 0; k < mappings.n; k++) {
        struct fake_mapping *m = mappings.v[k];
        if ((uintptr_t)dptr >= m->va && (uintptr_t)dptr < m->va + m->size) {
            if (pbase) *pbase = m->va;
            if (psize) *psize = m->size;
            RETURN(CUDA_SUCCESS);
        }
    }
    RETURN(CUDA_ERROR_NOT_FOUND);
}

/* ========================= virtual memory management ========================= */

/* gpuDirectRDMACapable is accepted on devices with
 * CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED only. */
static int check_prop(const CUmemAllocationProp *prop) {
    if (!prop || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED || prop->win32HandleMetaData ||
        !zeroed(prop->allocFlags.reserved, sizeof(prop->allocFlags.reserved)) ||
        prop->allocFlags.gpuDirectRDMACapable > 1)
        return CUDA_ERROR_INVALID_VALUE;
    if (prop->allocFlags.gpuDirectRDMACapable &&
        (prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE || !valid_dev(prop->location.id) ||
         !attr_rdma_vmm[prop->location.id]))
        return CUDA_ERROR_INVALID_VALUE;
    if (prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE) {
        if (!valid_dev(prop->location.id)) return CUDA_ERROR_INVALID_DEVICE;
    } else if (prop->location.type == CU_MEM_LOCATION_TYPE_HOST_NUMA) {
        if (driver_version < 12020) return CUDA_ERROR_INVALID_VALUE; /* a location type it does not know */
    } else {
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    if (prop->requestedHandleTypes & ~CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop, int option) {
    ENTER(cuMemGetAllocationGranularity);
    NEED_CTX();
    if (!granularity || (option != 0 && option != 1)) RETURN(CUDA_ERROR_INVALID_VALUE);
    int rc = check_prop(prop);
    if (rc) RETURN(rc);
    *granularity = option == 0 ? gran_min : gran_rec;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                            unsigned long long flags) {
    ENTER(cuMemCreate);
    UNSAFE_IN_CAPTURE();
    NEED_CTX();
    if (prop) last_create_prop = *prop;
    if (!handle || size == 0 || size % gran_min || flags) RETURN(CUDA_ERROR_INVALID_VALUE);
    int rc = check_prop(prop);
    if (rc) RETURN(rc);
    /* Host NUMA memory is not charged to a device. */
    int dev = prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE ? prop->location.id : -1;
    if (dev >= 0 && dev_used[dev] + size > capacity) RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    int fd = virt ? -1 : fake_memfd_create("fakevmm");
    if (!virt && fd < 0) RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    if (!virt && ftruncate(fd, (off_t)size) != 0) {
        close(fd);
        RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    }
    struct fake_handle *h = calloc(1, sizeof(*h));
    if (!h) {
        if (fd >= 0) close(fd);
        RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    }
    h->id = next_id++;
    h->dev = dev;
    h->memfd = fd;
    h->size = size;
    h->handle_types = prop->requestedHandleTypes;
    h->refs = 1;
    if (dev >= 0) dev_used[dev] += size;
    VEC_PUSH(handles, h);
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)h;
    RETURN(CUDA_SUCCESS);
}

static void handle_unref(struct fake_handle *h) {
    if (--h->refs > 0) return;
    for (size_t i = 0; i < handles.n; i++) {
        if (handles.v[i] == h) {
            VEC_DEL(handles, i);
            break;
        }
    }
    if (h->dev >= 0) dev_used[h->dev] -= h->size;
    if (h->memfd >= 0) close(h->memfd);
    free(h);
}

/* The memory goes once every mapping of it is unmapped, as on a GPU. */
EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    ENTER(cuMemRelease);
    NEVER_IN_CAPTURE();
    NEED_CTX();
    struct fake_handle *h = find_handle(handle);
    if (!h || h->refs <= 0) RETURN(CUDA_ERROR_INVALID_VALUE);
    h->handle_types |= 0x40000000; /* released: not exportable or mappable again */
    handle_unref(h);
    RETURN(CUDA_SUCCESS);
}

static long find_reservation(uintptr_t p, size_t size) {
    for (size_t i = 0; i < reservations.n; i++) {
        struct fake_reservation *r = &reservations.v[i];
        if (p >= r->base && p < r->base + r->size && size <= r->base + r->size - p) return (long)i;
    }
    return -1;
}

EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                    unsigned long long flags) {
    ENTER(cuMemAddressReserve);
    UNSAFE_IN_CAPTURE();
    NEED_CTX();
    if (!ptr || size == 0 || size % gran_min || flags || (alignment & (alignment - 1)))
        RETURN(CUDA_ERROR_INVALID_VALUE);
    if (alignment < gran_min) alignment = gran_min;
    if (virt) {
        uintptr_t b = va_take(cur, size, alignment);
        if (!b) RETURN(CUDA_ERROR_OUT_OF_MEMORY);
        struct fake_reservation r = {b, size};
        VEC_PUSH(reservations, r);
        *ptr = (CUdeviceptr)b;
        RETURN(CUDA_SUCCESS);
    }
    void *base = MAP_FAILED;
    if (addr && addr % alignment == 0) { /* addr is a hint, as in the real driver */
        base = mmap((void *)(uintptr_t)addr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE |
                    MAP_FIXED_NOREPLACE, -1, 0);
        /* Kernels before 4.17 treat the flag as a plain hint and may map elsewhere. */
        if (base != MAP_FAILED && (uintptr_t)base != addr) {
            munmap(base, size);
            base = MAP_FAILED;
        }
    }
    if (base == MAP_FAILED) {
        char *raw = mmap(NULL, size + alignment, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (raw == MAP_FAILED) RETURN(CUDA_ERROR_OUT_OF_MEMORY);
        uintptr_t b = round_up((uintptr_t)raw, alignment);
        if (b > (uintptr_t)raw) munmap(raw, b - (uintptr_t)raw);
        uintptr_t end = (uintptr_t)raw + size + alignment;
        if (end > b + size) munmap((void *)(b + size), end - (b + size));
        base = (void *)b;
    }
    struct fake_reservation r = {(uintptr_t)base, size};
    VEC_PUSH(reservations, r);
    *ptr = (CUdeviceptr)(uintptr_t)base;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    ENTER(cuMemAddressFree);
    NEVER_IN_CAPTURE();
    NEED_CTX();
    for (size_t i = 0; i < reservations.n; i++) {
        struct fake_reservation r = reservations.v[i];
        if (r.base != ptr) continue;
        if (r.size != size) RETURN(CUDA_ERROR_INVALID_VALUE);
        for (size_t j = 0; j < mappings.n; j++)
            if (mappings.v[j]->va >= r.base && mappings.v[j]->va < r.base + r.size) RETURN(CUDA_ERROR_INVALID_VALUE);
        if (virt)
            va_give(r.base);
        else
            munmap((void *)r.base, r.size);
        VEC_DEL(reservations, i);
        RETURN(CUDA_SUCCESS);
    }
    RETURN(CUDA_ERROR_INVALID_VALUE);
}

EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                         unsigned long long flags) {
    ENTER(cuMemMap);
    UNSAFE_IN_CAPTURE();
    NEED_CTX();
    struct fake_handle *h = find_handle(handle);
    if (!h || (h->handle_types & 0x40000000) || flags || size == 0 || ptr % gran_min || size % gran_min ||
        offset % gran_min || offset > h->size || size > h->size - offset)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    if (find_reservation((uintptr_t)ptr, size) < 0) RETURN(CUDA_ERROR_INVALID_VALUE);
    for (size_t j = 0; j < mappings.n; j++) {
        struct fake_mapping *m = mappings.v[j];
        if (ptr < m->va + m->size && m->va < ptr + size) RETURN(CUDA_ERROR_ALREADY_MAPPED);
    }
    /* No access until cuMemSetAccess, like on a GPU. */
    if (!virt && mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->memfd, (off_t)offset) == MAP_FAILED)
        RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    struct fake_mapping *m = calloc(1, sizeof(*m));
    if (!m) abort();
    m->va = ptr;
    m->size = size;
    m->h = h;
    h->refs++;
    VEC_PUSH(mappings, m);
    RETURN(CUDA_SUCCESS);
}

/* The range must consist of whole mappings. */
EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    ENTER(cuMemUnmap);
    NEVER_IN_CAPTURE();
    NEED_CTX();
    if (size == 0) RETURN(CUDA_ERROR_INVALID_VALUE);
    size_t covered = 0;
    for (size_t j = 0; j < mappings.n; j++) {
        struct fake_mapping *m = mappings.v[j];
        if (!(ptr < m->va + m->size && m->va < ptr + size)) continue;
        if (m->va < ptr || m->va + m->size > ptr + size) RETURN(CUDA_ERROR_INVALID_VALUE);
        covered += m->size;
    }
    if (covered != size) RETURN(CUDA_ERROR_INVALID_VALUE);
    for (size_t j = 0; j < mappings.n;) {
        struct fake_mapping *m = mappings.v[j];
        if (m->va >= ptr && m->va < ptr + size) {
            /* Back to a bare reservation. */
            if (!virt) mmap((void *)(uintptr_t)m->va, m->size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
                 -1, 0);
            handle_unref(m->h);
            free(m);
            VEC_DEL(mappings, j);
        } else {
            j++;
        }
    }
    RETURN(CUDA_SUCCESS);
}

/* The range must be mapped throughout. Memory becomes readable when some
 * device may read it and writable when some device may write it. */
EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    ENTER(cuMemSetAccess);
    UNSAFE_IN_CAPTURE();
    NEED_CTX();
    if (!desc || count == 0 || size == 0) RETURN(CUDA_ERROR_INVALID_VALUE);
    for (size_t k = 0; k < count; k++) {
        if (desc[k].location.type != CU_MEM_LOCATION_TYPE_DEVICE) RETURN(CUDA_ERROR_NOT_SUPPORTED);
        if (!valid_dev(desc[k].location.id)) RETURN(CUDA_ERROR_INVALID_DEVICE);
        int f = desc[k].flags;
        if (f != CU_MEM_ACCESS_FLAGS_PROT_NONE && f != CU_MEM_ACCESS_FLAGS_PROT_READ &&
            f != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            RETURN(CUDA_ERROR_INVALID_VALUE);
    }
    size_t covered = 0;
    for (size_t j = 0; j < mappings.n; j++) {
        struct fake_mapping *m = mappings.v[j];
        if (!(ptr < m->va + m->size && m->va < ptr + size)) continue;
        uintptr_t lo = m->va > ptr ? m->va : ptr, hi = m->va + m->size < ptr + size ? m->va + m->size : ptr + size;
        covered += hi - lo;
    }
    if (covered != size) RETURN(CUDA_ERROR_INVALID_VALUE);
    for (size_t j = 0; j < mappings.n; j++) {
        struct fake_mapping *m = mappings.v[j];
        if (!(ptr < m->va + m->size && m->va < ptr + size)) continue;
        int prot = PROT_NONE;
        for (size_t k = 0; k < count; k++) m->access[desc[k].location.id] = desc[k].flags;
        for (int d = 0; d < MAX_DEV; d++) {
            if (m->access[d] & CU_MEM_ACCESS_FLAGS_PROT_READ) prot |= PROT_READ;
            if (m->access[d] == CU_MEM_ACCESS_FLAGS_PROT_READWRITE) prot |= PROT_WRITE;
        }
        uintptr_t lo = m->va > ptr ? m->va : ptr, hi = m->va + m->size < ptr + size ? m->va + m->size : ptr + size;
        if (!virt) mprotect((void *)lo, hi - lo, prot);
    }
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                             int handleType, unsigned long long flags) {
    ENTER(cuMemExportToShareableHandle);
    NEED_CTX();
    struct fake_handle *h = find_handle(handle);
    if (!shareableHandle || !h || (h->handle_types & 0x40000000) || flags ||
        handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || !(h->handle_types & handleType))
        RETURN(CUDA_ERROR_INVALID_VALUE);
    int fd = fcntl(h->memfd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) RETURN(CUDA_ERROR_UNKNOWN);
    *(int *)shareableHandle = fd;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                               int shHandleType) {
    ENTER(cuMemImportFromShareableHandle);
    NEED_CTX();
    if (!handle || shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) RETURN(CUDA_ERROR_INVALID_VALUE);
    int fd = (int)(intptr_t)osHandle;
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_size <= 0 || (size_t)st.st_size % gran_min) RETURN(CUDA_ERROR_INVALID_VALUE);
    int dup = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (dup < 0) RETURN(CUDA_ERROR_INVALID_VALUE);
    struct fake_handle *h = calloc(1, sizeof(*h));
    if (!h) abort();
    h->id = next_id++;
    h->dev = -1;
    h->memfd = dup;
    h->size = (size_t)st.st_size;
    h->handle_types = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    h->refs = 1;
    VEC_PUSH(handles, h);
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)h;
    RETURN(CUDA_SUCCESS);
}

/* ============================ test controls ============================ */

static int fn_index(const char *fn) {
    if (!fn) return -1;
    for (int i = 0; i < F_COUNT; i++)
        if (strcmp(fn_names[i], fn) == 0) return i;
    return -1;
}

/* The named function returns code once after_calls more calls have gone
 * through, and keeps returning it until cleared with code 0. Returns -1 for
 * an unknown name. */
EXPORT int fake_cuda_fail(const char *fn, int code, int after_calls) {
    int i = fn_index(fn);
    if (i < 0) return -1;
    pthread_mutex_lock(&mu);
    inject[i].code = code;
    inject[i].after = after_calls < 0 ? 0 : after_calls;
    pthread_mutex_unlock(&mu);
    return 0;
}

/* Calls of the named function since the last reset, or -1 for an unknown name. */
EXPORT long fake_cuda_calls(const char *fn) {
    int i = fn_index(fn);
    if (i < 0) return -1;
    pthread_mutex_lock(&mu);
    long n = calls[i];
    pthread_mutex_unlock(&mu);
    return n;
}

/* Bytes of live allocations on dev (cuMemAlloc, pools, cuMemCreate); dev -1:
 * pinned host memory from cuMemHostAlloc. */
EXPORT unsigned long long fake_cuda_live_bytes(int dev) {
    unsigned long long n = 0;
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < allocs.n; i++)
        if (allocs.v[i].dev == dev) n += allocs.v[i].size;
    for (size_t i = 0; i < handles.n; i++)
        if (dev >= 0 && handles.v[i]->dev == dev) n += handles.v[i]->size;
    pthread_mutex_unlock(&mu);
    return n;
}

/* Number of live allocations counted like fake_cuda_live_bytes. */
EXPORT long fake_cuda_live_allocs(int dev) {
    long n = 0;
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < allocs.n; i++)
        if (allocs.v[i].dev == dev) n++;
    for (size_t i = 0; i < handles.n; i++)
        if (dev >= 0 && handles.v[i]->dev == dev) n++;
    pthread_mutex_unlock(&mu);
    return n;
}

/* Live events created on dev. */
EXPORT long fake_cuda_live_events(int dev) {
    long n = 0;
    pthread_mutex_lock(&mu);
    for (struct fake_event *e = events; e; e = e->next)
        if (e->dev == dev) n++;
    pthread_mutex_unlock(&mu);
    return n;
}

/* Depth of the calling thread's context stack. */
EXPORT int fake_cuda_ctx_depth(void) {
    pthread_mutex_lock(&mu);
    sync_tls();
    int d = tls.depth;
    pthread_mutex_unlock(&mu);
    return d;
}

/* Pushes minus pops on all threads since the last reset: non-zero after a
 * caller's push/op/pop sequences means a context was left current. */
EXPORT long long fake_cuda_ctx_balance(void) {
    pthread_mutex_lock(&mu);
    long long b = pushes - pops;
    pthread_mutex_unlock(&mu);
    return b;
}

/* Device of the calling thread's current context, or -1. */
EXPORT int fake_cuda_current_device(void) {
    pthread_mutex_lock(&mu);
    int d = current_dev();
    pthread_mutex_unlock(&mu);
    return d;
}

/* Pushes dev's primary context on the calling thread as an application
 * would, so a test can check that a library restores it. Retain counts are
 * not touched. Returns a CUresult. */
EXPORT int fake_cuda_push_device(int dev) {
    pthread_mutex_lock(&mu);
    if (!initialized || !valid_dev(dev)) {
        pthread_mutex_unlock(&mu);
        return CUDA_ERROR_INVALID_DEVICE;
    }
    sync_tls();
    if (tls.depth == MAX_DEPTH) {
        pthread_mutex_unlock(&mu);
        return CUDA_ERROR_UNKNOWN;
    }
    ctxs[dev].magic = MAGIC;
    ctxs[dev].dev = dev;
    tls.stack[tls.depth++] = dev;
    pushes++;
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

/* Undoes fake_cuda_push_device. Returns a CUresult. */
EXPORT int fake_cuda_pop_device(void) {
    pthread_mutex_lock(&mu);
    sync_tls();
    if (tls.depth == 0) {
        pthread_mutex_unlock(&mu);
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    tls.depth--;
    pops++;
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

/* How many times dev's primary context is retained. */
EXPORT long fake_cuda_retained(int dev) {
    if (dev < 0 || dev >= MAX_DEV) return -1;
    pthread_mutex_lock(&mu);
    long n = retained[dev];
    pthread_mutex_unlock(&mu);
    return n;
}

/* Device of the allocation containing ptr: -1 for pinned host memory, -2
 * when ptr is in no allocation (VMM ranges are not allocations). */
EXPORT int fake_cuda_ptr_device(uintptr_t ptr) {
    pthread_mutex_lock(&mu);
    long i = find_containing(ptr);
    int d = i < 0 ? -2 : allocs.v[i].dev;
    pthread_mutex_unlock(&mu);
    return d;
}

/* CUmemAccess_flags that cuMemSetAccess gave dev on the mapping holding
 * ptr, or -1 when ptr is not mapped. */
EXPORT int fake_cuda_access(uintptr_t ptr, int dev) {
    int f = -1;
    pthread_mutex_lock(&mu);
    for (size_t j = 0; j < mappings.n; j++) {
        struct fake_mapping *m = mappings.v[j];
        if (ptr >= m->va && ptr < m->va + m->size) f = dev >= 0 && dev < MAX_DEV ? m->access[dev] : -1;
    }
    pthread_mutex_unlock(&mu);
    return f;
}

/* Live cuMemCreate/import handles, reservations and mappings. */
EXPORT long fake_cuda_vmm_objects(void) {
    pthread_mutex_lock(&mu);
    long n = (long)(handles.n + reservations.n + mappings.n);
    pthread_mutex_unlock(&mu);
    return n;
}

/* Live memory pools, imported ones included, not destroyed. */
EXPORT long fake_cuda_live_pools(void) {
    long n = 0;
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < pools.n; i++)
        if (!pools.v[i]->destroyed) n++;
    pthread_mutex_unlock(&mu);
    return n;
}

/* The stream handle the last call of the named entry point was given
 * (cuMemAllocFromPoolAsync, cuMemFreeAsync, cuEventRecord,
 * cuStreamSynchronize; 0 for others or before any call), or ~0 for an
 * unknown name. */
EXPORT unsigned long long fake_cuda_last_stream(const char *fn) {
    int i = fn_index(fn);
    if (i < 0) return ~0ULL;
    pthread_mutex_lock(&mu);
    unsigned long long s = last_stream[i];
    pthread_mutex_unlock(&mu);
    return s;
}

/* The location and requested handle types of the CUmemAllocationProp the
 * last cuMemCreate call was given (all 0 before any call). */
EXPORT void fake_cuda_last_mem_create(int *loc_type, int *loc_id, int *handle_types) {
    pthread_mutex_lock(&mu);
    if (loc_type) *loc_type = last_create_prop.location.type;
    if (loc_id) *loc_id = last_create_prop.location.id;
    if (handle_types) *handle_types = last_create_prop.requestedHandleTypes;
    pthread_mutex_unlock(&mu);
}

/* The location, handle types and maxSize of the CUmemPoolProps the last
 * cuMemPoolCreate call was given (all 0 before any call). */
EXPORT void fake_cuda_last_pool_create(int *loc_type, int *loc_id, int *handle_types, unsigned long long *max_size) {
    pthread_mutex_lock(&mu);
    if (loc_type) *loc_type = last_pool_props.location.type;
    if (loc_id) *loc_id = last_pool_props.location.id;
    if (handle_types) *handle_types = last_pool_props.handleTypes;
    if (max_size) *max_size = last_pool_props.maxSize;
    pthread_mutex_unlock(&mu);
}

/* Sets the granularities cuMemGetAllocationGranularity reports; the minimum
 * one is what VMM calls check. Both must be powers of two, the recommended
 * one a multiple of the minimum. Call it right after a reset, before any
 * VMM object exists. Returns 0, or -1 for invalid values. Reset restores
 * 2 MiB for both. */
EXPORT int fake_cuda_set_granularity(unsigned long long minimum, unsigned long long recommended) {
    if (minimum == 0 || (minimum & (minimum - 1)) || recommended < minimum || (recommended & (recommended - 1)))
        return -1;
    pthread_mutex_lock(&mu);
    gran_min = (size_t)minimum;
    gran_rec = (size_t)recommended;
    pthread_mutex_unlock(&mu);
    return 0;
}

/* allocFlags.gpuDirectRDMACapable of the last cuMemCreate call (0 before any). */
EXPORT int fake_cuda_last_mem_create_rdma(void) {
    pthread_mutex_lock(&mu);
    int v = last_create_prop.allocFlags.gpuDirectRDMACapable;
    pthread_mutex_unlock(&mu);
    return v;
}

/* Sets a device attribute cuDeviceGetAttribute reports:
 * CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED (0 until set,
 * and after a reset) or
 * CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED (unknown
 * to the driver until set, and after a reset). Returns 0, or -1 for an
 * unknown device or attribute. */
EXPORT int fake_cuda_set_device_attribute(int dev, int attr, int value) {
    if (dev < 0 || dev >= MAX_DEV) return -1;
    pthread_mutex_lock(&mu);
    int rc = 0;
    if (attr == CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)
        attr_rdma_vmm[dev] = value;
    else if (attr == CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)
        attr_host_numa_vmm[dev] = value + 1;
    else
        rc = -1;
    pthread_mutex_unlock(&mu);
    return rc;
}

/* Marks stream as capturing a graph (on != 0) or not. */
EXPORT void fake_cuda_set_stream_capturing(uintptr_t stream, int on) {
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < capturing.n; i++) {
        if (capturing.v[i] == stream) {
            VEC_DEL(capturing, i);
            break;
        }
    }
    if (on) VEC_PUSH(capturing, stream);
    pthread_mutex_unlock(&mu);
}

/* Streams from cuStreamCreate not destroyed. */
EXPORT long fake_cuda_live_streams(void) {
    long n = 0;
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < created_streams.n; i++)
        if (!created_streams.v[i]->dead) n++;
    pthread_mutex_unlock(&mu);
    return n;
}

/* The flags a live stream from cuStreamCreate was created with and its
 * device (flags | dev << 8), or -1 for any other handle. */
EXPORT int fake_cuda_stream_info(uintptr_t stream) {
    pthread_mutex_lock(&mu);
    struct fake_created_stream *c = find_created(stream);
    int v = c && !c->dead ? (int)c->flags | c->dev << 8 : -1;
    pthread_mutex_unlock(&mu);
    return v;
}

/* The access flags dev has to pool, or -1 for an unknown pool or device. */
EXPORT int fake_cuda_pool_access(uintptr_t pool, int dev) {
    pthread_mutex_lock(&mu);
    struct fake_pool *p = find_pool((CUmemoryPool)pool);
    int v = p && dev >= 0 && dev < MAX_DEV ? p->access[dev] : -1;
    pthread_mutex_unlock(&mu);
    return v;
}

/* Pointers imported with cuMemPoolImportPointer and not yet freed with
 * cuMemFree_v2. */
EXPORT long fake_cuda_imported_ptrs(void) {
    pthread_mutex_lock(&mu);
    long n = (long)imports.n;
    pthread_mutex_unlock(&mu);
    return n;
}

/* Makes this process see the fake GPUs listed in order (a comma-separated
 * list of GPU indices, like CUDA_VISIBLE_DEVICES) from now on: the device
 * count and each ordinal's UUID change, nothing else. NULL goes back to
 * FAKE_CUDA_VISIBLE_ORDER. fake_cuda_reset clears it. Returns the new
 * device count. */
EXPORT int fake_cuda_set_visible_order(const char *order) {
    pthread_mutex_lock(&mu);
    static char buf[256];
    if (order) {
        snprintf(buf, sizeof(buf), "%s", order);
        visible_override = buf;
    } else {
        visible_override = NULL;
    }
    const char *s = getenv("FAKE_CUDA_DEVICES");
    n_devices = 2;
    if (s && *s) {
        long n = strtol(s, NULL, 10);
        n_devices = n < 0 ? 0 : n > MAX_DEV ? MAX_DEV : (int)n;
    }
    read_visible();
    int n = n_devices;
    pthread_mutex_unlock(&mu);
    return n;
}

/* Plays (1) or ends (0) a global-mode stream capture by another thread. */
EXPORT void fake_cuda_set_global_capture(int on) {
    pthread_mutex_lock(&mu);
    global_capture = on != 0;
    pthread_mutex_unlock(&mu);
}

/* Calls refused because a capture was under way. */
EXPORT long fake_cuda_capture_violations(void) {
    pthread_mutex_lock(&mu);
    long n = capture_violations;
    pthread_mutex_unlock(&mu);
    return n;
}

/* The calling thread's stream-capture mode (checks that it was restored). */
EXPORT int fake_cuda_capture_mode(void) { return tls_capture_mode; }

/* Holds every entry point on entry (on), or lets them all go on (off):
 * a test parks the driver calls of the code under test, to check what waits
 * for a call in flight. */
EXPORT void fake_cuda_hold(int on) {
    pthread_mutex_lock(&mu);
    held = on != 0;
    if (!held) pthread_cond_broadcast(&unheld);
    pthread_mutex_unlock(&mu);
}

EXPORT void fake_cuda_set_manual_events(int on) {
    pthread_mutex_lock(&mu);
    manual_events = on != 0;
    pthread_mutex_unlock(&mu);
}

/* Completes the work recorded so far on stream (on every device). */
EXPORT void fake_cuda_complete_stream(uintptr_t stream) {
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < streams.n; i++)
        if (streams.v[i].id == stream) streams.v[i].completed = streams.v[i].submitted;
    pthread_mutex_unlock(&mu);
}

EXPORT void fake_cuda_complete_all(void) {
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < streams.n; i++) streams.v[i].completed = streams.v[i].submitted;
    pthread_mutex_unlock(&mu);
}

/* Frees everything, clears counters, injections, manual events and the
 * visible order set by fake_cuda_set_visible_order, drops every thread's
 * context stack and re-reads FAKE_CUDA_DEVICES, FAKE_CUDA_CAPACITY and
 * FAKE_CUDA_VISIBLE_ORDER. Primary context retain counts and cuInit survive: a
 * loaded driver keeps its contexts. */
EXPORT void fake_cuda_reset(void) {
    pthread_mutex_lock(&mu);
    for (size_t j = 0; j < mappings.n; j++) {
        struct fake_mapping *m = mappings.v[j];
        mmap((void *)(uintptr_t)m->va, m->size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1,
             0);
        free(m);
    }
    mappings.n = 0;
    for (size_t i = 0; i < reservations.n; i++)
        if (!virt) munmap((void *)reservations.v[i].base, reservations.v[i].size);
    reservations.n = 0;
    for (size_t i = 0; i < handles.n; i++) {
        if (handles.v[i]->memfd >= 0) close(handles.v[i]->memfd);
        free(handles.v[i]);
    }
    handles.n = 0;
    for (size_t i = 0; i < allocs.n; i++)
        if (!virt || allocs.v[i].kind != K_DEVICE) free((void *)allocs.v[i].ptr);
    allocs.n = 0;
    for (int d = 0; d < MAX_DEV; d++) windows[d].used.n = 0;
    for (size_t i = 0; i < pools.n; i++) free(pools.v[i]);
    pools.n = 0;
    while (events) {
        struct fake_event *e = events;
        events = e->next;
        free(e);
    }
    streams.n = 0;
    for (size_t i = 0; i < created_streams.n; i++) free(created_streams.v[i]);
    created_streams.n = 0;
    capturing.n = 0;
    memset(attr_rdma_vmm, 0, sizeof(attr_rdma_vmm));
    memset(attr_host_numa_vmm, 0, sizeof(attr_host_numa_vmm));
    memset(dev_used, 0, sizeof(dev_used));
    memset(calls, 0, sizeof(calls));
    global_capture = 0;
    capture_violations = 0;
    memset(inject, 0, sizeof(inject));
    memset(last_stream, 0, sizeof(last_stream));
    memset(&last_create_prop, 0, sizeof(last_create_prop));
    memset(&last_pool_props, 0, sizeof(last_pool_props));
    imports.n = 0;
    visible_override = NULL;
    gran_min = gran_rec = GRANULARITY;
    manual_events = 0;
    held = 0;
    pthread_cond_broadcast(&unheld);
    pushes = pops = 0;
    generation++;
    int was = initialized;
    read_env();
    /* A device count of 0 after reset behaves like a driver that found none. */
    initialized = was && n_devices > 0;
    pthread_mutex_unlock(&mu);
}
