/* The cuda.h declarations that both sides of the driver boundary need: the
 * shim that calls the real driver (shim.h) and the fake driver the tests
 * build (tests/csrc/fake_cuda.c, which includes this file by its path
 * relative to itself). One copy, so that the two cannot drift apart.
 *
 * gpumempool builds without CUDA headers, so the types are declared here.
 * tests/test_cuda_headers.py compiles them (with shim.h's prototypes and
 * consts.go's values) against NVIDIA's cuda.h of CUDA 12.0, 12.9, 13.0 and
 * 13.5 and fails on any difference in a prototype, a struct size or offset,
 * or a constant. Newer releases add fields in reserved bytes
 * (CUmemPoolProps.maxSize in 12.2, usage in 12.6, gpuDirectRDMACapable in
 * 13.x) and put a union around CUmemLocation's id; neither moves anything
 * we use, and we zero every byte we do not set, which is what the driver
 * requires of reserved fields. Fields and values newer than 12.0 are marked
 * with the release that added them; package cuda checks the driver's
 * version before using them. The static asserts pin the sizes (x86-64 and
 * aarch64, LP64).
 *
 * The opaque handles (CUcontext, CUevent, CUstream, CUmemoryPool) are left
 * to the includer: the shim passes them around as void *, the fake points
 * them at its own structs. */
#ifndef GMP_CUDA_TYPES_H
#define GMP_CUDA_TYPES_H

#include <stddef.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

/* CUmemLocation_v1: { CUmemLocationType type; int id; } */
typedef struct {
	int type; /* CUmemLocationType */
	int id;
} CUmemLocation;

/* CUmemAllocationProp_v1 */
typedef struct {
	int type;                 /* CUmemAllocationType */
	int requestedHandleTypes; /* CUmemAllocationHandleType */
	CUmemLocation location;
	void *win32HandleMetaData;
	struct {
		unsigned char compressionType;
		unsigned char gpuDirectRDMACapable;
		unsigned short usage;
		unsigned char reserved[4];
	} allocFlags;
} CUmemAllocationProp;

/* CUmemPoolProps_v1 (maxSize: CUDA 12.2+, usage: 12.6+, reserved bytes before;
 * 13.x uses reserved[0] as gpuDirectRDMACapable, which we leave 0). */
typedef struct {
	int allocType;   /* CUmemAllocationType */
	int handleTypes; /* CUmemAllocationHandleType */
	CUmemLocation location;
	void *win32SecurityAttributes;
	size_t maxSize;
	unsigned short usage;
	unsigned char reserved[54];
} CUmemPoolProps;

/* CUmemAccessDesc_v1 */
typedef struct {
	CUmemLocation location;
	int flags; /* CUmemAccess_flags */
} CUmemAccessDesc;

/* CUmemPoolPtrExportData_v1 */
typedef struct {
	unsigned char reserved[64];
} CUmemPoolPtrExportData;

/* CUuuid (cuDeviceGetUuid_v2) */
typedef struct {
	char bytes[16];
} CUuuid;

/* C11 and C++ spell it differently (tests/csrc/cuda_abi_check.cpp includes
 * this file from C++). */
#ifdef __cplusplus
#define GMP_STATIC_ASSERT static_assert
#else
#define GMP_STATIC_ASSERT _Static_assert
#endif
GMP_STATIC_ASSERT(sizeof(CUmemLocation) == 8, "CUmemLocation is 8 bytes in cuda.h");
GMP_STATIC_ASSERT(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp is 32 bytes in cuda.h");
GMP_STATIC_ASSERT(offsetof(CUmemAllocationProp, location) == 8, "CUmemAllocationProp.location");
GMP_STATIC_ASSERT(offsetof(CUmemAllocationProp, allocFlags) == 24, "CUmemAllocationProp.allocFlags");
GMP_STATIC_ASSERT(offsetof(CUmemAllocationProp, allocFlags.gpuDirectRDMACapable) == 25,
                  "CUmemAllocationProp.allocFlags.gpuDirectRDMACapable");
GMP_STATIC_ASSERT(sizeof(CUmemPoolProps) == 88, "CUmemPoolProps is 88 bytes in cuda.h");
GMP_STATIC_ASSERT(offsetof(CUmemPoolProps, maxSize) == 24, "CUmemPoolProps.maxSize");
GMP_STATIC_ASSERT(offsetof(CUmemPoolProps, usage) == 32, "CUmemPoolProps.usage");
GMP_STATIC_ASSERT(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc is 12 bytes in cuda.h");
GMP_STATIC_ASSERT(sizeof(CUmemPoolPtrExportData) == 64, "CUmemPoolPtrExportData is 64 bytes in cuda.h");
GMP_STATIC_ASSERT(sizeof(CUuuid) == 16, "CUuuid is 16 bytes in cuda.h");

/* cudaError_enum: the codes used here (package cuda's Code* constants in
 * consts.go are the same values for Go). */
enum {
	CUDA_SUCCESS = 0,
	CUDA_ERROR_INVALID_VALUE = 1,
	CUDA_ERROR_OUT_OF_MEMORY = 2,
	CUDA_ERROR_NOT_INITIALIZED = 3,
	CUDA_ERROR_DEINITIALIZED = 4,
	CUDA_ERROR_NO_DEVICE = 100,
	CUDA_ERROR_INVALID_DEVICE = 101,
	CUDA_ERROR_INVALID_CONTEXT = 201,
	CUDA_ERROR_ALREADY_MAPPED = 208,
	CUDA_ERROR_NOT_MAPPED = 211,
	CUDA_ERROR_INVALID_HANDLE = 400,
	CUDA_ERROR_NOT_FOUND = 500,
	CUDA_ERROR_NOT_READY = 600,
	CUDA_ERROR_ILLEGAL_ADDRESS = 700,
	CUDA_ERROR_NOT_PERMITTED = 800,
	CUDA_ERROR_NOT_SUPPORTED = 801,
	CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
	CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906,
	CUDA_ERROR_UNKNOWN = 999,
};

/* CUmemAllocationType, CUmemLocationType, CUmemAllocationHandleType and
 * CUmemAccess_flags: the values used here, one per line, with the CUDA
 * release that introduced the newer ones (tests/test_cuda_headers.py checks
 * each against cuda.h). */
enum {
	CU_MEM_ALLOCATION_TYPE_PINNED = 1,
};
enum {
	CU_MEM_LOCATION_TYPE_DEVICE = 1,
	CU_MEM_LOCATION_TYPE_HOST_NUMA = 3, /* CUDA 12.2+ */
};
enum {
	CU_MEM_HANDLE_TYPE_NONE = 0,
	CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1,
};
enum {
	CU_MEM_ACCESS_FLAGS_PROT_NONE = 0,
	CU_MEM_ACCESS_FLAGS_PROT_READ = 1,
	CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3,
};

/* CUstreamCaptureMode */
enum {
	CU_STREAM_CAPTURE_MODE_GLOBAL = 0,
	CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1,
	CU_STREAM_CAPTURE_MODE_RELAXED = 2,
};

/* CUstreamCaptureStatus (cuStreamIsCapturing) */
enum {
	CU_STREAM_CAPTURE_STATUS_NONE = 0,
	CU_STREAM_CAPTURE_STATUS_ACTIVE = 1,
	CU_STREAM_CAPTURE_STATUS_INVALIDATED = 2,
};

/* CUstream_flags (cuStreamCreate) */
enum {
	CU_STREAM_DEFAULT = 0x0,
	CU_STREAM_NON_BLOCKING = 0x1,
};

/* CUdevice_attribute: the ones used here. */
enum {
	CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED = 110,
	CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 141, /* CUDA 12.9+ */
};

/* CUmemPool_attribute: the REUSE_* ones are ints, the others cuuint64_t. */
enum {
	CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES = 1,
	CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC = 2,
	CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES = 3,
	CU_MEMPOOL_ATTR_RELEASE_THRESHOLD = 4,
	CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT = 5,
	CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH = 6,
	CU_MEMPOOL_ATTR_USED_MEM_CURRENT = 7,
	CU_MEMPOOL_ATTR_USED_MEM_HIGH = 8,
};

#endif
