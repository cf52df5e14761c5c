/* A user allocator with torch's pluggable signatures, for the callback
 * backend's tests, plus a C caller of gpumempool's exported ABI (the
 * "C caller that dlopens that path") and its round-trip benchmark. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static long n_allocs, n_frees, live_bytes, fail_after = -1;
static void *last_stream;
static int last_device;

void *test_alloc(size_t size, int device, void *stream) {
    if (fail_after >= 0 && n_allocs >= fail_after) return NULL;
    void *p = aligned_alloc(512, (size + 511) / 512 * 512);
    if (!p) return NULL;
    n_allocs++;
    live_bytes += (long)size;
    last_stream = stream;
    last_device = device;
    return p;
}

void test_free(void *ptr, size_t size, int device, void *stream) {
    (void)device; (void)stream;
    n_frees++;
    live_bytes -= (long)size;
    free(ptr);
}

void test_reset(long fail) { n_allocs = n_frees = live_bytes = 0; fail_after = fail; }
long test_allocs(void) { return n_allocs; }
long test_frees(void) { return n_frees; }
long test_live_bytes(void) { return live_bytes; }
void *test_last_stream(void) { return last_stream; }
int test_last_device(void) { return last_device; }

typedef void *(*alloc_fn)(size_t, int, void *);
typedef void (*free_fn)(void *, size_t, int, void *);

static void *handle;
static alloc_fn abi_alloc;
static free_fn abi_free;

/* Open gpumempool's library by path and look up a pool's entry points,
 * as torch's CUDAPluggableAllocator does. 0 on success. */
int caller_open(const char *path, const char *alloc_sym, const char *free_sym) {
    handle = dlopen(path, RTLD_NOW);
    if (!handle) return -1;
    abi_alloc = (alloc_fn)dlsym(handle, alloc_sym);
    abi_free = (free_fn)dlsym(handle, free_sym);
    return (abi_alloc && abi_free) ? 0 : -2;
}

void *caller_alloc(size_t size, int device, void *stream) { return abi_alloc(size, device, stream); }

/* An allocator that calls back into a pool (the one caller_open opened)
 * before allocating: a C function calling its own pool, which must be
 * refused, not deadlock. reentry_result() is what the inner call got. */
static uintptr_t reentry_result_value = 1;

void *reentrant_alloc(size_t size, int device, void *stream) {
    reentry_result_value = (uintptr_t)abi_alloc(64, device, stream);
    return test_alloc(size, device, stream);
}

uintptr_t reentry_result(void) { return reentry_result_value; }
void caller_free(void *ptr, size_t size, int device, void *stream) { abi_free(ptr, size, device, stream); }

/* Nanoseconds per alloc+free round trip through the exported symbols. */
double caller_bench(size_t size, long iters) {
    struct timespec t0, t1;
    void *p = abi_alloc(size, 0, 0); /* warm: the segment exists afterwards */
    abi_free(p, size, 0, 0);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < iters; i++) {
        p = abi_alloc(size, 0, 0);
        if (!p) return -1;
        abi_free(p, size, 0, 0);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / (double)iters;
}
