/* The C half of package cuda: the driver entry points we resolve with dlsym,
 * the cuda.h types they take, and one helper per operation that pushes the
 * device's primary context, calls the driver and pops it again, all inside a
 * single C call. It must be one C call: CUDA's current context is per OS
 * thread, and a goroutine may move to another thread between two cgo calls.
 *
 * No CUDA headers are needed to build: the cuda.h types, constants and
 * error codes are declared in cuda_types.h (shared with the fake driver the
 * tests use, tests/csrc/fake_cuda.c), the opaque handles here; the
 * prototypes below are checked against the real cuda.h by
 * tests/test_cuda_headers.py. */
#ifndef GMP_CUDA_SHIM_H
#define GMP_CUDA_SHIM_H

#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "cuda_types.h"

typedef void *CUcontext;
typedef void *CUevent;
typedef void *CUstream;
typedef void *CUmemoryPool;

/* Every entry point: X(name, required). Missing required ones fail Load;
 * missing optional ones (the stream-ordered allocator and VMM, CUDA 10.2 to
 * 11.2, and the ones only their backends use) only fail the methods that
 * need them.
 *
 * cuStreamIsCapturing is resolved rather than cuStreamGetCaptureInfo: its
 * name and prototype have not changed since CUDA 10.0, while cuda.h maps
 * cuStreamGetCaptureInfo to _v2 in 12.x and _v3 in 13.x, with different
 * prototypes. Neither is resolved as _ptsz: the stream handles we are given
 * are explicit (0 is the legacy default stream, CU_STREAM_PER_THREAD names
 * the per-thread one), as for every other stream-taking call here.
 *
 * cuDeviceGetUuid_v2 (CUDA 11.4+) rather than cuDeviceGetUuid: for a MIG
 * instance the first returns the instance's own UUID, the second its GPU's;
 * cuda.h maps the plain name to _v2 from CUDA 13.0 on. IPC handles carry it
 * so that the importer finds the exporter's device whatever ordinal
 * CUDA_VISIBLE_DEVICES gives it there. */
#define GMP_FUNCS(X)                                                             \
	X(cuInit, 1)                                                                 \
	X(cuDriverGetVersion, 1)                                                     \
	X(cuDeviceGet, 1)                                                            \
	X(cuDeviceGetCount, 1)                                                       \
	X(cuDevicePrimaryCtxRetain, 1)                                               \
	X(cuDevicePrimaryCtxRelease_v2, 1)                                           \
	X(cuCtxPushCurrent_v2, 1)                                                    \
	X(cuCtxPopCurrent_v2, 1)                                                     \
	X(cuGetErrorName, 1)                                                         \
	X(cuMemAlloc_v2, 1)                                                          \
	X(cuMemFree_v2, 1)                                                           \
	X(cuMemGetInfo_v2, 1)                                                        \
	X(cuMemHostAlloc, 1)                                                         \
	X(cuMemFreeHost, 1)                                                          \
	X(cuMemHostGetFlags, 1)                                                      \
	X(cuEventCreate, 1)                                                          \
	X(cuEventRecord, 1)                                                          \
	X(cuEventQuery, 1)                                                           \
	X(cuEventSynchronize, 1)                                                     \
	X(cuEventDestroy_v2, 1)                                                      \
	X(cuStreamSynchronize, 1)                                                    \
	X(cuMemPoolCreate, 0)                                                        \
	X(cuMemPoolDestroy, 0)                                                       \
	X(cuMemAllocFromPoolAsync, 0)                                                \
	X(cuMemFreeAsync, 0)                                                         \
	X(cuMemPoolSetAttribute, 0)                                                  \
	X(cuMemPoolGetAttribute, 0)                                                  \
	X(cuMemPoolTrimTo, 0)                                                        \
	X(cuMemPoolExportToShareableHandle, 0)                                       \
	X(cuMemPoolImportFromShareableHandle, 0)                                     \
	X(cuMemPoolExportPointer, 0)                                                 \
	X(cuMemPoolImportPointer, 0)                                                 \
	X(cuMemGetAddressRange_v2, 0)                                                \
	X(cuMemGetAllocationGranularity, 0)                                          \
	X(cuMemCreate, 0)                                                            \
	X(cuMemRelease, 0)                                                           \
	X(cuMemAddressReserve, 0)                                                    \
	X(cuMemAddressFree, 0)                                                       \
	X(cuMemMap, 0)                                                               \
	X(cuMemUnmap, 0)                                                             \
	X(cuMemSetAccess, 0)                                                         \
	X(cuMemExportToShareableHandle, 0)                                           \
	X(cuMemImportFromShareableHandle, 0)                                         \
	X(cuThreadExchangeStreamCaptureMode, 0)                                      \
	X(cuStreamCreate, 0)                                                         \
	X(cuStreamDestroy_v2, 0)                                                     \
	X(cuStreamIsCapturing, 0)                                                    \
	X(cuDeviceGetAttribute, 0)                                                   \
	X(cuMemPoolSetAccess, 0)                                                     \
	X(cuMemPoolGetAccess, 0)                                                     \
	X(cuDeviceGetUuid_v2, 0)

#define GMP_AS_ENUM(name, req) GMP_##name,
enum { GMP_FUNCS(GMP_AS_ENUM) GMP_NFUNCS };
#undef GMP_AS_ENUM

typedef CUresult (*t_cuInit)(unsigned int);
typedef CUresult (*t_cuDriverGetVersion)(int *);
typedef CUresult (*t_cuDeviceGet)(CUdevice *, int);
typedef CUresult (*t_cuDeviceGetCount)(int *);
typedef CUresult (*t_cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
typedef CUresult (*t_cuDevicePrimaryCtxRelease_v2)(CUdevice);
typedef CUresult (*t_cuCtxPushCurrent_v2)(CUcontext);
typedef CUresult (*t_cuCtxPopCurrent_v2)(CUcontext *);
typedef CUresult (*t_cuGetErrorName)(CUresult, const char **);
typedef CUresult (*t_cuMemAlloc_v2)(CUdeviceptr *, size_t);
typedef CUresult (*t_cuMemFree_v2)(CUdeviceptr);
typedef CUresult (*t_cuMemGetInfo_v2)(size_t *, size_t *);
typedef CUresult (*t_cuMemHostAlloc)(void **, size_t, unsigned int);
typedef CUresult (*t_cuMemFreeHost)(void *);
typedef CUresult (*t_cuMemHostGetFlags)(unsigned int *, void *);
typedef CUresult (*t_cuEventCreate)(CUevent *, unsigned int);
typedef CUresult (*t_cuEventRecord)(CUevent, CUstream);
typedef CUresult (*t_cuEventQuery)(CUevent);
typedef CUresult (*t_cuEventSynchronize)(CUevent);
typedef CUresult (*t_cuEventDestroy_v2)(CUevent);
typedef CUresult (*t_cuStreamSynchronize)(CUstream);
typedef CUresult (*t_cuMemPoolCreate)(CUmemoryPool *, const CUmemPoolProps *);
typedef CUresult (*t_cuMemPoolDestroy)(CUmemoryPool);
typedef CUresult (*t_cuMemAllocFromPoolAsync)(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
typedef CUresult (*t_cuMemFreeAsync)(CUdeviceptr, CUstream);
typedef CUresult (*t_cuMemPoolSetAttribute)(CUmemoryPool, int, void *);
typedef CUresult (*t_cuMemPoolGetAttribute)(CUmemoryPool, int, void *);
typedef CUresult (*t_cuMemPoolTrimTo)(CUmemoryPool, size_t);
typedef CUresult (*t_cuMemPoolExportToShareableHandle)(void *, CUmemoryPool, int, unsigned long long);
typedef CUresult (*t_cuMemPoolImportFromShareableHandle)(CUmemoryPool *, void *, int, unsigned long long);
typedef CUresult (*t_cuMemPoolExportPointer)(CUmemPoolPtrExportData *, CUdeviceptr);
typedef CUresult (*t_cuMemPoolImportPointer)(CUdeviceptr *, CUmemoryPool, CUmemPoolPtrExportData *);
typedef CUresult (*t_cuMemGetAddressRange_v2)(CUdeviceptr *, size_t *, CUdeviceptr);
typedef CUresult (*t_cuMemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *, int);
typedef CUresult (*t_cuMemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                                  unsigned long long);
typedef CUresult (*t_cuMemRelease)(CUmemGenericAllocationHandle);
typedef CUresult (*t_cuMemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
typedef CUresult (*t_cuMemAddressFree)(CUdeviceptr, size_t);
typedef CUresult (*t_cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
typedef CUresult (*t_cuMemUnmap)(CUdeviceptr, size_t);
typedef CUresult (*t_cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
typedef CUresult (*t_cuMemExportToShareableHandle)(void *, CUmemGenericAllocationHandle, int, unsigned long long);
typedef CUresult (*t_cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle *, void *, int);
typedef CUresult (*t_cuThreadExchangeStreamCaptureMode)(int *);
typedef CUresult (*t_cuStreamCreate)(CUstream *, unsigned int);
typedef CUresult (*t_cuStreamDestroy_v2)(CUstream);
typedef CUresult (*t_cuStreamIsCapturing)(CUstream, int *);
typedef CUresult (*t_cuDeviceGetAttribute)(int *, int, CUdevice);
typedef CUresult (*t_cuMemPoolSetAccess)(CUmemoryPool, const CUmemAccessDesc *, size_t);
typedef CUresult (*t_cuMemPoolGetAccess)(int *, CUmemoryPool, CUmemLocation *);
typedef CUresult (*t_cuDeviceGetUuid_v2)(CUuuid *, CUdevice);

/* The resolved entry points, in C memory (calloc'ed by Go). */
typedef struct {
	void *fn[GMP_NFUNCS];
} gmp_drv;

#define GMP_FN(d, name) ((t_##name)(d)->fn[GMP_##name])

/* A driver result and the entry point (GMP_ index) that produced it. */
typedef struct {
	int code;
	int fn;
} gmp_res;

static inline const char *gmp_name(int i) {
#define GMP_AS_NAME(name, req) #name,
	static const char *const names[GMP_NFUNCS] = {GMP_FUNCS(GMP_AS_NAME)};
#undef GMP_AS_NAME
	return i >= 0 && i < GMP_NFUNCS ? names[i] : "?";
}

static inline int gmp_required(int i) {
#define GMP_AS_REQ(name, req) req,
	static const int req[GMP_NFUNCS] = {GMP_FUNCS(GMP_AS_REQ)};
#undef GMP_AS_REQ
	return req[i];
}

/* dlopen and dlerror in one C call: dlerror's message is per thread. */
static inline uintptr_t gmp_dlopen(const char *path, char *err, size_t errlen) {
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!h) {
		const char *e = dlerror();
		snprintf(err, errlen, "%s", e ? e : "dlopen failed");
	}
	return (uintptr_t)h;
}

static inline void gmp_dlclose(uintptr_t h) { dlclose((void *)h); }

/* Resolves every entry point; returns how many are missing. */
static inline int gmp_resolve(gmp_drv *d, uintptr_t h) {
	int missing = 0;
	for (int i = 0; i < GMP_NFUNCS; i++) {
		d->fn[i] = dlsym((void *)h, gmp_name(i));
		if (!d->fn[i]) missing++;
	}
	return missing;
}

static inline int gmp_has(gmp_drv *d, int i) { return d->fn[i] != NULL; }
static inline uintptr_t gmp_addr(gmp_drv *d, int i) { return (uintptr_t)d->fn[i]; }

static inline gmp_res gmp_res_of(int code, int fn) {
	gmp_res r = {code, fn};
	return r;
}

/* Runs CALL with ctx current on this thread and restores the caller's
 * current context (whatever it was) by popping ours. A failed op is
 * reported over a failed pop.
 *
 * CALL runs in the relaxed stream-capture mode, and the thread's mode is
 * restored after: while another thread records a CUDA graph in the default
 * (global) mode, the driver refuses "potentially unsafe" calls such as
 * cuMemAlloc from every thread, and refusing invalidates the capture.
 * Allocating a segment is safe during a capture as long as nothing frees it
 * before the graph is gone (the engine frees nothing during one); torch
 * wraps its cudaMalloc the same way. */
#define GMP_IN_CTX(d, ctx, r, FN_ID, CALL)                                  \
	do {                                                                     \
		(r).fn = GMP_cuCtxPushCurrent_v2;                                    \
		(r).code = GMP_FN(d, cuCtxPushCurrent_v2)((CUcontext)(ctx));         \
		if ((r).code != 0) break;                                            \
		int mode_ = CU_STREAM_CAPTURE_MODE_RELAXED;                          \
		int relaxed_ = gmp_has(d, GMP_cuThreadExchangeStreamCaptureMode) &&  \
		               GMP_FN(d, cuThreadExchangeStreamCaptureMode)(&mode_) == 0; \
		(r).fn = (FN_ID);                                                    \
		(r).code = (CALL);                                                   \
		if (relaxed_) GMP_FN(d, cuThreadExchangeStreamCaptureMode)(&mode_);  \
		CUcontext popped_ = NULL;                                            \
		int pop_ = GMP_FN(d, cuCtxPopCurrent_v2)(&popped_);                  \
		if ((r).code == 0 && pop_ != 0) {                                    \
			(r).code = pop_;                                                 \
			(r).fn = GMP_cuCtxPopCurrent_v2;                                 \
		}                                                                    \
	} while (0)

/* ---------------------------- no context needed ---------------------------- */

static inline gmp_res gmp_init(gmp_drv *d) { return gmp_res_of(GMP_FN(d, cuInit)(0), GMP_cuInit); }

static inline gmp_res gmp_driver_version(gmp_drv *d, int *v) {
	return gmp_res_of(GMP_FN(d, cuDriverGetVersion)(v), GMP_cuDriverGetVersion);
}

static inline gmp_res gmp_device_count(gmp_drv *d, int *n) {
	return gmp_res_of(GMP_FN(d, cuDeviceGetCount)(n), GMP_cuDeviceGetCount);
}

static inline gmp_res gmp_retain(gmp_drv *d, int ordinal, uintptr_t *ctx) {
	CUdevice dev = 0;
	int rc = GMP_FN(d, cuDeviceGet)(&dev, ordinal);
	if (rc != 0) return gmp_res_of(rc, GMP_cuDeviceGet);
	CUcontext c = NULL;
	rc = GMP_FN(d, cuDevicePrimaryCtxRetain)(&c, dev);
	*ctx = (uintptr_t)c;
	return gmp_res_of(rc, GMP_cuDevicePrimaryCtxRetain);
}

static inline gmp_res gmp_release(gmp_drv *d, int ordinal) {
	CUdevice dev = 0;
	int rc = GMP_FN(d, cuDeviceGet)(&dev, ordinal);
	if (rc != 0) return gmp_res_of(rc, GMP_cuDeviceGet);
	return gmp_res_of(GMP_FN(d, cuDevicePrimaryCtxRelease_v2)(dev), GMP_cuDevicePrimaryCtxRelease_v2);
}

/* A device attribute needs no context: cuDeviceGetAttribute takes the
 * device. */
static inline gmp_res gmp_device_attribute(gmp_drv *d, int ordinal, int attr, int *out) {
	CUdevice dev = 0;
	int rc = GMP_FN(d, cuDeviceGet)(&dev, ordinal);
	if (rc != 0) return gmp_res_of(rc, GMP_cuDeviceGet);
	int v = 0;
	rc = GMP_FN(d, cuDeviceGetAttribute)(&v, attr, dev);
	*out = v;
	return gmp_res_of(rc, GMP_cuDeviceGetAttribute);
}

/* The device's UUID (cuDeviceGetUuid_v2: a MIG instance's own UUID, where
 * cuDeviceGetUuid would name its GPU). No context needed either. */
static inline gmp_res gmp_device_uuid(gmp_drv *d, int ordinal, unsigned char out[16]) {
	CUdevice dev = 0;
	int rc = GMP_FN(d, cuDeviceGet)(&dev, ordinal);
	if (rc != 0) return gmp_res_of(rc, GMP_cuDeviceGet);
	CUuuid u;
	memset(&u, 0, sizeof(u));
	rc = GMP_FN(d, cuDeviceGetUuid_v2)(&u, dev);
	memcpy(out, u.bytes, sizeof(u.bytes));
	return gmp_res_of(rc, GMP_cuDeviceGetUuid_v2);
}

/* NULL when the driver does not know the code. */
static inline const char *gmp_error_name(gmp_drv *d, int code) {
	const char *s = NULL;
	if (GMP_FN(d, cuGetErrorName)(code, &s) != 0) return NULL;
	return s;
}

/* ------------------------------ with a context ------------------------------ */

static inline gmp_res gmp_mem_alloc(gmp_drv *d, uintptr_t ctx, size_t size, uint64_t *out) {
	gmp_res r;
	CUdeviceptr p = 0;
	GMP_IN_CTX(d, ctx, r, GMP_cuMemAlloc_v2, GMP_FN(d, cuMemAlloc_v2)(&p, size));
	*out = p;
	return r;
}

static inline gmp_res gmp_mem_free(gmp_drv *d, uintptr_t ctx, uint64_t ptr) {
	gmp_res r;
	GMP_IN_CTX(d, ctx, r, GMP_cuMemFree_v2, GMP_FN(d, cuMemFree_v2)(ptr));
	return r;
}

static inline gmp_res gmp_mem_get_info(gmp_drv *d, uintptr_t ctx, uint64_t *free_bytes, uint64_t *total) {
	gmp_res r;
	size_t f = 0, t = 0;
	GMP_IN_CTX(d, ctx, r, GMP_cuMemGetInfo_v2, GMP_FN(d, cuMemGetInfo_v2)(&f, &t));
	*free_bytes = f;
	*total = t;
	return r;
}

static inline gmp_res gmp_host_alloc(gmp_drv *d, uintptr_t ctx, size_t size, unsigned flags, uint64_t *out) {
	gmp_res r;
	void *p = NULL;
	GMP_IN_CTX(d, ctx, r, GMP_cuMemHostAlloc, GMP_FN(d, cuMemHostAlloc)(&p, size, flags));
	*out = (uint64_t)(uintptr_t)p;
	return r;
}

static inline gmp_res gmp_host_free(gmp_drv *d, uintptr_t ctx, uint64_t ptr) {
	gmp_res r;
	GMP_IN_CTX(d, ctx, r, GMP_cuMemFreeHost, GMP_FN(d, cuMemFreeHost)((void *)(uintptr_t)ptr));
	return r;
}

static inline gmp_res gmp_host_get_flags(gmp_drv *d, uintptr_t ctx, uint64_t ptr, unsigned *flags) {
	gmp_res r;
	GMP_IN_CTX(d, ctx, r, GMP_cuMemHostGetFlags, GMP_FN(d, cuMemHostGetFlags)(flags, (void *)(uintptr_t)ptr));
	return r;
}

static inline gmp_res gmp_event_create(gmp_drv *d, uintptr_t ctx, unsigned flags, uint64_t *out) {
	gmp_res r;
	CUevent e = NULL;
	GMP_IN_CTX(d, ctx, r, GMP_cuEventCreate, GMP_FN(d, cuEventCreate)(&e, flags));
	*out = (uint64_t)(uintptr_t)e;
	return r;
}

static inline gmp_res gmp_event_record(gmp_drv *d, uintptr_t ctx, uint64_t ev, uint64_t stream) {
	gmp_res r;
	GMP_IN_CTX(d, ctx, r, GMP_cuEventRecord,
	           GMP_FN(d, cuEventRecord)((CUevent)(uintptr_t)ev, (CUstream)(uintptr_t)stream));
	return r;
}

static inline gmp_res gmp_event_query(gmp_drv *d, uintptr_t ctx, uint64_t ev) {
	gmp_res r;
	GMP_IN_CTX(d, ctx, r, GMP_cuEventQuery, GMP_FN(d, cuEventQuery)((CUevent)(uintptr_t)ev));
	return r;
}

static inline gmp_res gmp_event_sync(gmp_drv *d, uintptr_t ctx, uint64_t ev) {
	gmp_res r;
	GMP_IN_CTX(d, ctx, r, GMP_cuEventSynchronize, GMP_FN(d, cuEventSynchronize)((CUevent)(uintptr_t)ev));
	return r;
}

static inline gmp_res gmp_event_destroy(gmp_drv *d, uintptr_t ctx, uint64_t ev) {
	gmp_res r;
	GMP_IN_CTX(d, ctx, r, GMP_cuEventDestroy_v2, GMP_FN(d, cuEventDestroy_v2)((CUevent)(uintptr_t)ev));
	return r;
}

static inline gmp_res gmp_stream_sync(gmp_drv *d, uintptr_t ctx, uint64_t stream) {
	gmp_res r;
	GMP_IN_CTX(d, ctx, r, GMP_cuStreamSynchronize, GMP_FN(d, cuStreamSynchronize)((CUstream)(uintptr_t)stream));
	return r;
}

static inline gmp_res gmp_stream_create(gmp_drv *d, uintptr_t ctx, unsigned flags, uint64_t *out) {
	gmp_res r;
	CUstream s = NULL;
	GMP_IN_CTX(d, ctx, r, GMP_cuStreamCreate, GMP_FN(d, cuStreamCreate)(&s, flags));
	*out = (uint64_t)(uintptr_t)s;
	return r;
}

static inline gmp_res gmp_stream_destroy(gmp_drv *d, uintptr_t ctx, uint64_t stream) {
	gmp_res r;
	GMP_IN_CTX(d, ctx, r, GMP_cuStreamDestroy_v2, GMP_FN(d, cuStreamDestroy_v2)((CUstream)(uintptr_t)stream));
	return r;
}

static inline gmp_res gmp_stream_is_capturing(gmp_drv *d, uintptr_t ctx, uint64_t stream, int *status) {
	gmp_res r;
	int st = CU_STREAM_CAPTURE_STATUS_NONE;
	GMP_IN_CTX(d, ctx, r, GMP_cuStreamIsCapturing, GMP_FN(d, cuStreamIsCapturing)((CUstream)(uintptr_t)stream, &st));
	*status = st;
	return r;
}

/* ------------------------- stream-ordered allocator ------------------------- */

static inline gmp_res gmp_pool_create(gmp_drv *d, uintptr_t ctx, int handle_types, int loc_type, int loc_id,
                                      uint64_t max_size, uint64_t *out) {
	gmp_res r;
	CUmemPoolProps props;
	memset(&props, 0, sizeof(props));
	props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
	props.handleTypes = handle_types;
	props.location.type = loc_type;
	props.location.id = loc_id;
	props.maxSize = max_size;
	CUmemoryPool pool = NULL;
	GMP_IN_CTX(d, ctx, r, GMP_cuMemPoolCreate, GMP_FN(d, cuMemPoolCreate)(&pool, &props));
	*out = (uint64_t)(uintptr_t)pool;
	return r;
}

static inline gmp_res gmp_pool_destroy(gmp_drv *d, uintptr_t ctx, uint64_t pool) {
	gmp_res r;
	GMP_IN_CTX(d, ctx, r, GMP_cuMemPoolDestroy, GMP_FN(d, cuMemPoolDestroy)((CUmemoryPool)(uintptr_t)pool));
	return r;
}

static inline gmp_res gmp_pool_alloc_async(gmp_drv *d, uintptr_t ctx, size_t size, uint64_t pool, uint64_t stream,
                                           uint64_t *out) {
	gmp_res r;
	CUdeviceptr p = 0;
	GMP_IN_CTX(d, ctx, r, GMP_cuMemAllocFromPoolAsync,
	           GMP_FN(d, cuMemAllocFromPoolAsync)(&p, size, (CUmemoryPool)(uintptr_t)pool,
	                                              (CUstream)(uintptr_t)stream));
	*out = p;
	return r;
}

static inline gmp_res gmp_free_async(gmp_drv *d, uintptr_t ctx, uint64_t ptr, uint64_t stream) {
	gmp_res r;
	GMP_IN_CTX(d, ctx, r, GMP_cuMemFreeAsync, GMP_FN(d, cuMemFreeAsync)(ptr, (CUstream)(uintptr_t)stream));
	return r;
}

/* The REUSE_* attributes (1..3) are ints in cuda.h, the others cuuint64_t. */
static inline gmp_res gmp_pool_set_attr(gmp_drv *d, uintptr_t ctx, uint64_t pool, int attr, uint64_t value) {
	gmp_res r;
	int iv = (int)value;
	uint64_t uv = value;
	void *p = attr <= CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES ? (void *)&iv : (void *)&uv;
	GMP_IN_CTX(d, ctx, r, GMP_cuMemPoolSetAttribute,
	           GMP_FN(d, cuMemPoolSetAttribute)((CUmemoryPool)(uintptr_t)pool, attr, p));
	return r;
}

static inline gmp_res gmp_pool_get_attr(gmp_drv *d, uintptr_t ctx, uint64_t pool, int attr, uint64_t *value) {
	gmp_res r;
	int iv = 0;
	uint64_t uv = 0;
	int small = attr <= CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES;
	GMP_IN_CTX(d, ctx, r, GMP_cuMemPoolGetAttribute,
	           GMP_FN(d, cuMemPoolGetAttribute)((CUmemoryPool)(uintptr_t)pool, attr, small ? (void *)&iv : (void *)&uv));
	*value = small ? (uint64_t)(unsigned)iv : uv;
	return r;
}

static inline gmp_res gmp_pool_trim(gmp_drv *d, uintptr_t ctx, uint64_t pool, uint64_t keep) {
	gmp_res r;
	GMP_IN_CTX(d, ctx, r, GMP_cuMemPoolTrimTo, GMP_FN(d, cuMemPoolTrimTo)((CUmemoryPool)(uintptr_t)pool, keep));
	return r;
}

/* Read/write access to pool for each device ordinal in devs (at most 64). */
static inline gmp_res gmp_pool_set_access(gmp_drv *d, uintptr_t ctx, uint64_t pool, const int *devs, int n) {
	gmp_res r;
	CUmemAccessDesc desc[64];
	if (n <= 0 || n > 64) return gmp_res_of(CUDA_ERROR_INVALID_VALUE, GMP_cuMemPoolSetAccess);
	memset(desc, 0, sizeof(desc));
	for (int i = 0; i < n; i++) {
		desc[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
		desc[i].location.id = devs[i];
		desc[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
	}
	GMP_IN_CTX(d, ctx, r, GMP_cuMemPoolSetAccess,
	           GMP_FN(d, cuMemPoolSetAccess)((CUmemoryPool)(uintptr_t)pool, desc, (size_t)n));
	return r;
}

/* The access flags (CUmemAccess_flags) device dev has to pool. */
static inline gmp_res gmp_pool_get_access(gmp_drv *d, uintptr_t ctx, uint64_t pool, int dev, int *flags) {
	gmp_res r;
	CUmemLocation loc;
	memset(&loc, 0, sizeof(loc));
	loc.type = CU_MEM_LOCATION_TYPE_DEVICE;
	loc.id = dev;
	int f = CU_MEM_ACCESS_FLAGS_PROT_NONE;
	GMP_IN_CTX(d, ctx, r, GMP_cuMemPoolGetAccess, GMP_FN(d, cuMemPoolGetAccess)(&f, (CUmemoryPool)(uintptr_t)pool, &loc));
	*flags = f;
	return r;
}

/* POSIX file descriptors only: the handle is an int. */
static inline gmp_res gmp_pool_export(gmp_drv *d, uintptr_t ctx, uint64_t pool, int type, int *fd) {
	gmp_res r;
	int h = -1;
	GMP_IN_CTX(d, ctx, r, GMP_cuMemPoolExportToShareableHandle,
	           GMP_FN(d, cuMemPoolExportToShareableHandle)(&h, (CUmemoryPool)(uintptr_t)pool, type, 0));
	*fd = h;
	return r;
}

/* A POSIX file descriptor is passed as the handle itself, cast to void*. */
static inline gmp_res gmp_pool_import(gmp_drv *d, uintptr_t ctx, int fd, int type, uint64_t *out) {
	gmp_res r;
	CUmemoryPool pool = NULL;
	GMP_IN_CTX(d, ctx, r, GMP_cuMemPoolImportFromShareableHandle,
	           GMP_FN(d, cuMemPoolImportFromShareableHandle)(&pool, (void *)(intptr_t)fd, type, 0));
	*out = (uint64_t)(uintptr_t)pool;
	return r;
}

static inline gmp_res gmp_pool_export_ptr(gmp_drv *d, uintptr_t ctx, uint64_t ptr, unsigned char *out64) {
	gmp_res r;
	CUmemPoolPtrExportData data;
	memset(&data, 0, sizeof(data));
	GMP_IN_CTX(d, ctx, r, GMP_cuMemPoolExportPointer, GMP_FN(d, cuMemPoolExportPointer)(&data, ptr));
	memcpy(out64, data.reserved, sizeof(data.reserved));
	return r;
}

static inline gmp_res gmp_pool_import_ptr(gmp_drv *d, uintptr_t ctx, uint64_t pool, const unsigned char *data64,
                                          uint64_t *out) {
	gmp_res r;
	CUmemPoolPtrExportData data;
	memcpy(data.reserved, data64, sizeof(data.reserved));
	CUdeviceptr p = 0;
	GMP_IN_CTX(d, ctx, r, GMP_cuMemPoolImportPointer,
	           GMP_FN(d, cuMemPoolImportPointer)(&p, (CUmemoryPool)(uintptr_t)pool, &data));
	*out = p;
	return r;
}

/* The allocation holding ptr: its base address and size. */
static inline gmp_res gmp_mem_range(gmp_drv *d, uintptr_t ctx, uint64_t ptr, uint64_t *base, uint64_t *size) {
	gmp_res r;
	CUdeviceptr b = 0;
	size_t n = 0;
	GMP_IN_CTX(d, ctx, r, GMP_cuMemGetAddressRange_v2, GMP_FN(d, cuMemGetAddressRange_v2)(&b, &n, (CUdeviceptr)ptr));
	*base = b;
	*size = n;
	return r;
}

/* ------------------------ virtual memory management ------------------------ */

/* rdma sets allocFlags.gpuDirectRDMACapable, which the driver accepts on
 * devices with CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED. */
static inline void gmp_alloc_prop(CUmemAllocationProp *prop, int loc_type, int loc_id, int handle_types, int rdma) {
	memset(prop, 0, sizeof(*prop));
	prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
	prop->requestedHandleTypes = handle_types;
	prop->location.type = loc_type;
	prop->location.id = loc_id;
	prop->allocFlags.gpuDirectRDMACapable = rdma ? 1 : 0;
}

static inline gmp_res gmp_granularity(gmp_drv *d, uintptr_t ctx, int loc_type, int loc_id, int handle_types,
                                      int rdma, int option, uint64_t *out) {
	gmp_res r;
	CUmemAllocationProp prop;
	gmp_alloc_prop(&prop, loc_type, loc_id, handle_types, rdma);
	size_t g = 0;
	GMP_IN_CTX(d, ctx, r, GMP_cuMemGetAllocationGranularity,
	           GMP_FN(d, cuMemGetAllocationGranularity)(&g, &prop, option));
	*out = g;
	return r;
}

static inline gmp_res gmp_mem_create(gmp_drv *d, uintptr_t ctx, size_t size, int loc_type, int loc_id,
                                     int handle_types, int rdma, uint64_t *out) {
	gmp_res r;
	CUmemAllocationProp prop;
	gmp_alloc_prop(&prop, loc_type, loc_id, handle_types, rdma);
	CUmemGenericAllocationHandle h = 0;
	GMP_IN_CTX(d, ctx, r, GMP_cuMemCreate, GMP_FN(d, cuMemCreate)(&h, size, &prop, 0));
	*out = h;
	return r;
}

static inline gmp_res gmp_mem_release(gmp_drv *d, uintptr_t ctx, uint64_t handle) {
	gmp_res r;
	GMP_IN_CTX(d, ctx, r, GMP_cuMemRelease, GMP_FN(d, cuMemRelease)(handle));
	return r;
}

static inline gmp_res gmp_address_reserve(gmp_drv *d, uintptr_t ctx, size_t size, size_t align, uint64_t addr,
                                          uint64_t *out) {
	gmp_res r;
	CUdeviceptr p = 0;
	GMP_IN_CTX(d, ctx, r, GMP_cuMemAddressReserve, GMP_FN(d, cuMemAddressReserve)(&p, size, align, addr, 0));
	*out = p;
	return r;
}

static inline gmp_res gmp_address_free(gmp_drv *d, uintptr_t ctx, uint64_t ptr, size_t size) {
	gmp_res r;
	GMP_IN_CTX(d, ctx, r, GMP_cuMemAddressFree, GMP_FN(d, cuMemAddressFree)(ptr, size));
	return r;
}

static inline gmp_res gmp_mem_map(gmp_drv *d, uintptr_t ctx, uint64_t ptr, size_t size, size_t offset,
                                  uint64_t handle) {
	gmp_res r;
	GMP_IN_CTX(d, ctx, r, GMP_cuMemMap, GMP_FN(d, cuMemMap)(ptr, size, offset, handle, 0));
	return r;
}

static inline gmp_res gmp_mem_unmap(gmp_drv *d, uintptr_t ctx, uint64_t ptr, size_t size) {
	gmp_res r;
	GMP_IN_CTX(d, ctx, r, GMP_cuMemUnmap, GMP_FN(d, cuMemUnmap)(ptr, size));
	return r;
}

/* Read/write access for each device ordinal in devs (at most 64). */
static inline gmp_res gmp_mem_set_access(gmp_drv *d, uintptr_t ctx, uint64_t ptr, size_t size, const int *devs,
                                         int n) {
	gmp_res r;
	CUmemAccessDesc desc[64];
	if (n <= 0 || n > 64) return gmp_res_of(CUDA_ERROR_INVALID_VALUE, GMP_cuMemSetAccess);
	memset(desc, 0, sizeof(desc));
	for (int i = 0; i < n; i++) {
		desc[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
		desc[i].location.id = devs[i];
		desc[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
	}
	GMP_IN_CTX(d, ctx, r, GMP_cuMemSetAccess, GMP_FN(d, cuMemSetAccess)(ptr, size, desc, (size_t)n));
	return r;
}

static inline gmp_res gmp_mem_export(gmp_drv *d, uintptr_t ctx, uint64_t handle, int type, int *fd) {
	gmp_res r;
	int h = -1;
	GMP_IN_CTX(d, ctx, r, GMP_cuMemExportToShareableHandle,
	           GMP_FN(d, cuMemExportToShareableHandle)(&h, handle, type, 0));
	*fd = h;
	return r;
}

static inline gmp_res gmp_mem_import(gmp_drv *d, uintptr_t ctx, int fd, int type, uint64_t *out) {
	gmp_res r;
	CUmemGenericAllocationHandle h = 0;
	GMP_IN_CTX(d, ctx, r, GMP_cuMemImportFromShareableHandle,
	           GMP_FN(d, cuMemImportFromShareableHandle)(&h, (void *)(intptr_t)fd, type));
	*out = h;
	return r;
}

#endif
