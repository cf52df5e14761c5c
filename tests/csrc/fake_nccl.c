/* A fake libnccl for gpumempool's NCCL backend tests (there is no GPU, CUDA
 * or NCCL in CI). Build it as a shared library:
 *
 *   cc -shared -fPIC -o libfakenccl.so fake_nccl.c -lpthread
 *
 * It exports the four NCCL functions the backend uses, with NCCL's signatures
 * and result codes:
 *
 *   ncclGetVersion      version code from env FAKE_NCCL_VERSION (default
 *                       22304, i.e. 2.23.4), read at every call.
 *   ncclMemAlloc/Free   host memory from aligned_alloc(4096), capped at env
 *                       FAKE_NCCL_CAPACITY bytes (default 1 GiB; read on first
 *                       use and by fake_nccl_reset). A request beyond the cap
 *                       fails with ncclUnhandledCudaError, as a real
 *                       cuMemCreate/cudaMalloc failure surfaces from NCCL.
 *   ncclGetErrorString  NCCL's texts.
 *   ncclGetLastError    the last warning, process-wide and never cleared:
 *                       "Cuda failure 2 'out of memory'" after a request
 *                       beyond the cap, or an injected failure's text.
 *   ncclCommRegister/ncclCommDeregister  record the registered ranges
 *                       (comm, buffer, size) behind opaque handles, as NCCL's
 *                       registration cache does; deregistering a handle
 *                       that is not registered is ncclInvalidUsage, as
 *                       NCCL's "Could not find handle".
 *
 * Compiled with -DFAKE_NCCL_OLD it leaves out ncclMemAlloc and ncclMemFree,
 * like NCCL < 2.19, for the too-old test; with -DFAKE_NCCL_NO_REGISTER,
 * ncclCommRegister and ncclCommDeregister (which package libnccl resolves
 * as optional).
 *
 * It also carries a fake cuCtxPushCurrent/cuCtxPopCurrent pair over a
 * per-thread context stack, and ncclMemAlloc/ncclMemFree record the context on
 * top of the calling thread's stack, so that tests can check which device's
 * context was current during the call and that it was popped afterwards.
 *
 * Test controls (all thread-safe):
 *   fake_nccl_fail(code, after)  the next `after` ncclMemAlloc calls behave
 *                                normally, every later one returns `code`
 *                                (0 turns injection off).
 *   fake_nccl_fail_text(text)    the warning an injected failure logs
 *                                ("": none; kept across resets).
 *   fake_nccl_log_warning(text)  a warning from elsewhere in the process.
 *   fake_nccl_fail_free(code)    every ncclMemFree returns `code` and frees
 *                                nothing (0 turns it off).
 *   fake_nccl_calls()            ncclMemAlloc calls, failed ones included.
 *   fake_nccl_frees()            successful ncclMemFree calls.
 *   fake_nccl_live_bytes()       bytes allocated and not yet freed.
 *   fake_nccl_last_ctx()         top of the context stack at the last
 *                                ncclMemAlloc (NULL: none was current).
 *   fake_nccl_last_free_ctx()    the same for ncclMemFree.
 *   fake_nccl_reset()            zeroes the counters and recorded contexts,
 *                                turns failure injection off and re-reads
 *                                FAKE_NCCL_CAPACITY. Live allocations stay
 *                                (they are real memory someone may still free).
 *   fake_nccl_registered_count() ranges registered now.
 *   fake_nccl_registered(i, &comm, &buf, &size) the i-th of them, oldest
 *                                first (0: there is no i-th).
 *   fake_nccl_registrations()    ncclCommRegister calls that succeeded.
 *   fake_ctx_push/fake_ctx_pop   the fake cuCtxPushCurrent/cuCtxPopCurrent.
 *   fake_ctx_exchange_capture_mode / fake_ctx_capture_mode
 *                                a fake cuThreadExchangeStreamCaptureMode and
 *                                the calling thread's mode.
 *   fake_nccl_last_capture_mode() the capture mode the last ncclMemAlloc ran
 *                                in (-1: none ran).
 *   fake_nccl_last_free_capture_mode() the same for ncclMemFree.
 *   fake_ctx_current/depth()     top and depth of the calling thread's stack.
 *   fake_ctx_balance()           pushes minus pops over all threads.
 *   fake_ctx_fail(push, pop)     make every push/pop return these CUresults
 *                                (0: succeed) until reset.
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

typedef enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
} ncclResult_t;

/* CUresult values the fake context functions return. */
#define FAKE_CUDA_ERROR_INVALID_VALUE 1
#define FAKE_CUDA_ERROR_INVALID_CONTEXT 201

#define FAKE_ALIGN 4096

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

/* Guarded by mu. */
static long calls, frees, live_bytes;
static long capacity = -1; /* -1: not read from the environment yet */
static int fail_code, fail_free_code;
static long fail_after;
static void *last_ctx, *last_free_ctx;
static int ctx_push_fail, ctx_pop_fail;
static long ctx_balance;

#ifndef FAKE_NCCL_OLD
/* Live allocations, to check frees and know their sizes (ncclMemFree gets
 * no size). A list is enough for the few segments tests make. */
struct fake_alloc {
    void *ptr;
    long size;
    struct fake_alloc *next;
};
static struct fake_alloc *live;
#endif

#define FAKE_CTX_MAX 16
static __thread void *ctx_stack[FAKE_CTX_MAX];
static __thread int ctx_depth;
/* The fake cuThreadExchangeStreamCaptureMode's per-thread mode, and the mode
 * the last ncclMemAlloc / ncclMemFree ran in (-1 before any). */
static __thread int capture_mode;
static int last_capture_mode = -1;
static int last_free_capture_mode = -1;

static long env_long(const char *name, long def) {
    const char *s = getenv(name);
    if (s == NULL || *s == 0) return def;
    char *end;
    errno = 0;
    long v = strtol(s, &end, 0);
    if (errno != 0 || *end != 0) return def;
    return v;
}

#ifndef FAKE_NCCL_OLD
/* Call with mu held. */
static long capacity_locked(void) {
    if (capacity < 0) capacity = env_long("FAKE_NCCL_CAPACITY", 1L << 30);
    return capacity;
}
#endif

void *fake_ctx_current(void) { return ctx_depth > 0 ? ctx_stack[ctx_depth - 1] : NULL; }

/* A cuThreadExchangeStreamCaptureMode stand-in (0 global, 2 relaxed). */
int fake_ctx_exchange_capture_mode(int *mode) {
    if (mode == NULL || *mode < 0 || *mode > 2) return FAKE_CUDA_ERROR_INVALID_VALUE;
    int old = capture_mode;
    capture_mode = *mode;
    *mode = old;
    return 0;
}

int fake_ctx_capture_mode(void) { return capture_mode; }

int fake_ctx_depth(void) { return ctx_depth; }

int fake_ctx_push(void *ctx) {
    pthread_mutex_lock(&mu);
    int fail = ctx_push_fail;
    pthread_mutex_unlock(&mu);
    if (fail) return fail;
    if (ctx == NULL) return FAKE_CUDA_ERROR_INVALID_CONTEXT;
    if (ctx_depth == FAKE_CTX_MAX) return FAKE_CUDA_ERROR_INVALID_VALUE;
    ctx_stack[ctx_depth++] = ctx;
    pthread_mutex_lock(&mu);
    ctx_balance++;
    pthread_mutex_unlock(&mu);
    return 0;
}

int fake_ctx_pop(void **out) {
    pthread_mutex_lock(&mu);
    int fail = ctx_pop_fail;
    pthread_mutex_unlock(&mu);
    if (fail) return fail;
    if (ctx_depth == 0) return FAKE_CUDA_ERROR_INVALID_CONTEXT;
    void *ctx = ctx_stack[--ctx_depth];
    if (out) *out = ctx;
    pthread_mutex_lock(&mu);
    ctx_balance--;
    pthread_mutex_unlock(&mu);
    return 0;
}

long fake_ctx_balance(void) {
    pthread_mutex_lock(&mu);
    long v = ctx_balance;
    pthread_mutex_unlock(&mu);
    return v;
}

void fake_ctx_fail(int push_code, int pop_code) {
    pthread_mutex_lock(&mu);
    ctx_push_fail = push_code;
    ctx_pop_fail = pop_code;
    pthread_mutex_unlock(&mu);
}

/* ncclGetLastError: the text of the last WARN, process-wide, as NCCL keeps
 * it (never cleared). Failures set it: an injected one to the text given to
 * fake_nccl_fail_text ("" leaves it alone, as a failure that logs nothing),
 * a lack of capacity to CUDA's out-of-memory warning. */
static char last_error[256];
static char fail_text[256];

const char *ncclGetLastError(void *comm) {
    (void)comm;
    return last_error;
}

/* A warning logged by some other NCCL activity of the process. */
void fake_nccl_log_warning(const char *text) {
    pthread_mutex_lock(&mu);
    snprintf(last_error, sizeof last_error, "%s", text ? text : "");
    pthread_mutex_unlock(&mu);
}

void fake_nccl_fail_text(const char *text) {
    pthread_mutex_lock(&mu);
    snprintf(fail_text, sizeof fail_text, "%s", text ? text : "");
    pthread_mutex_unlock(&mu);
}

ncclResult_t ncclGetVersion(int *version) {
    if (version == NULL) return ncclInvalidArgument;
    *version = (int)env_long("FAKE_NCCL_VERSION", 22304);
    return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t r) {
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}

#ifndef FAKE_NCCL_OLD
ncclResult_t ncclMemAlloc(void **ptr, size_t size) {
    void *ctx = fake_ctx_current();
    pthread_mutex_lock(&mu);
    calls++;
    last_ctx = ctx;
    last_capture_mode = capture_mode;
    ncclResult_t ret = ncclSuccess;
    if (fail_code != 0) {
        if (fail_after > 0) fail_after--;
        else {
            ret = (ncclResult_t)fail_code;
            if (fail_text[0]) snprintf(last_error, sizeof last_error, "%s", fail_text);
        }
    }
    if (ret == ncclSuccess && (ptr == NULL || size == 0)) ret = ncclInvalidArgument;
    if (ret == ncclSuccess && live_bytes + (long)size > capacity_locked()) {
        ret = ncclUnhandledCudaError;
        snprintf(last_error, sizeof last_error, "Cuda failure 2 'out of memory'");
    }
    struct fake_alloc *a = NULL;
    if (ret == ncclSuccess) {
        a = malloc(sizeof *a);
        /* aligned_alloc wants a multiple of the alignment. */
        void *p = a ? aligned_alloc(FAKE_ALIGN, (size + FAKE_ALIGN - 1) / FAKE_ALIGN * FAKE_ALIGN) : NULL;
        if (p == NULL) {
            free(a);
            ret = ncclSystemError;
        } else {
            a->ptr = p;
            a->size = (long)size;
            a->next = live;
            live = a;
            live_bytes += (long)size;
            *ptr = p;
        }
    }
    pthread_mutex_unlock(&mu);
    return ret;
}

ncclResult_t ncclMemFree(void *ptr) {
    void *ctx = fake_ctx_current();
    pthread_mutex_lock(&mu);
    last_free_ctx = ctx;
    last_free_capture_mode = capture_mode;
    if (fail_free_code != 0) {
        pthread_mutex_unlock(&mu);
        return (ncclResult_t)fail_free_code;
    }
    struct fake_alloc **pp = &live;
    while (*pp != NULL && (*pp)->ptr != ptr) pp = &(*pp)->next;
    if (*pp == NULL) {
        pthread_mutex_unlock(&mu);
        return ncclInvalidArgument;
    }
    struct fake_alloc *a = *pp;
    *pp = a->next;
    live_bytes -= a->size;
    frees++;
    pthread_mutex_unlock(&mu);
    free(a->ptr);
    free(a);
    return ncclSuccess;
}
#endif

void fake_nccl_fail(int code, int after_calls) {
    pthread_mutex_lock(&mu);
    fail_code = code;
    fail_after = after_calls;
    pthread_mutex_unlock(&mu);
}

void fake_nccl_fail_free(int code) {
    pthread_mutex_lock(&mu);
    fail_free_code = code;
    pthread_mutex_unlock(&mu);
}

long fake_nccl_calls(void) {
    pthread_mutex_lock(&mu);
    long v = calls;
    pthread_mutex_unlock(&mu);
    return v;
}

long fake_nccl_frees(void) {
    pthread_mutex_lock(&mu);
    long v = frees;
    pthread_mutex_unlock(&mu);
    return v;
}

long fake_nccl_live_bytes(void) {
    pthread_mutex_lock(&mu);
    long v = live_bytes;
    pthread_mutex_unlock(&mu);
    return v;
}

int fake_nccl_last_capture_mode(void) {
    pthread_mutex_lock(&mu);
    int v = last_capture_mode;
    pthread_mutex_unlock(&mu);
    return v;
}

int fake_nccl_last_free_capture_mode(void) {
    pthread_mutex_lock(&mu);
    int v = last_free_capture_mode;
    pthread_mutex_unlock(&mu);
    return v;
}

void *fake_nccl_last_ctx(void) {
    pthread_mutex_lock(&mu);
    void *v = last_ctx;
    pthread_mutex_unlock(&mu);
    return v;
}

void *fake_nccl_last_free_ctx(void) {
    pthread_mutex_lock(&mu);
    void *v = last_free_ctx;
    pthread_mutex_unlock(&mu);
    return v;
}

void fake_nccl_reset(void) {
    pthread_mutex_lock(&mu);
    calls = frees = 0;
    fail_code = fail_free_code = 0;
    fail_after = 0;
    last_ctx = last_free_ctx = NULL;
    last_capture_mode = last_free_capture_mode = -1;
    ctx_push_fail = ctx_pop_fail = 0;
    ctx_balance = 0;
    capacity = -1;
    pthread_mutex_unlock(&mu);
}

/* Registered ranges, oldest first (guarded by mu). The handle NCCL returns
 * is opaque: here it is the record itself. */
struct fake_reg {
    void *comm, *buf;
    size_t size;
    struct fake_reg *next;
};
static struct fake_reg *regs;
static long registrations;

#ifndef FAKE_NCCL_NO_REGISTER
ncclResult_t ncclCommRegister(void *comm, void *buf, size_t size, void **handle) {
    if (comm == NULL || handle == NULL) return ncclInvalidArgument;
    struct fake_reg *r = calloc(1, sizeof *r);
    if (r == NULL) return ncclSystemError;
    r->comm = comm;
    r->buf = buf;
    r->size = size;
    pthread_mutex_lock(&mu);
    struct fake_reg **pp = &regs;
    while (*pp != NULL) pp = &(*pp)->next;
    *pp = r;
    registrations++;
    pthread_mutex_unlock(&mu);
    *handle = r;
    return ncclSuccess;
}

ncclResult_t ncclCommDeregister(void *comm, void *handle) {
    pthread_mutex_lock(&mu);
    struct fake_reg **pp = &regs;
    while (*pp != NULL && *pp != handle) pp = &(*pp)->next;
    if (*pp == NULL || (*pp)->comm != comm) {
        pthread_mutex_unlock(&mu);
        return ncclInvalidUsage;
    }
    struct fake_reg *r = *pp;
    *pp = r->next;
    pthread_mutex_unlock(&mu);
    free(r);
    return ncclSuccess;
}
#endif

long fake_nccl_registered_count(void) {
    pthread_mutex_lock(&mu);
    long n = 0;
    for (struct fake_reg *r = regs; r != NULL; r = r->next) n++;
    pthread_mutex_unlock(&mu);
    return n;
}

int fake_nccl_registered(long i, void **comm, void **buf, size_t *size) {
    pthread_mutex_lock(&mu);
    struct fake_reg *r = regs;
    while (r != NULL && i-- > 0) r = r->next;
    if (r != NULL) {
        *comm = r->comm;
        *buf = r->buf;
        *size = r->size;
    }
    pthread_mutex_unlock(&mu);
    return r != NULL;
}

long fake_nccl_registrations(void) {
    pthread_mutex_lock(&mu);
    long v = registrations;
    pthread_mutex_unlock(&mu);
    return v;
}
