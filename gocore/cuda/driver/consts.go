package driver

// CUresult codes the package and its tests use, from cuda.h's
// cudaError_enum (unchanged from CUDA 11 to 13).
const (
	CodeSuccess        = 0   // CUDA_SUCCESS
	CodeInvalidValue   = 1   // CUDA_ERROR_INVALID_VALUE
	CodeOutOfMemory    = 2   // CUDA_ERROR_OUT_OF_MEMORY
	CodeNotInitialized = 3   // CUDA_ERROR_NOT_INITIALIZED
	CodeDeinitialized  = 4   // CUDA_ERROR_DEINITIALIZED
	CodeNoDevice       = 100 // CUDA_ERROR_NO_DEVICE
	CodeInvalidDevice  = 101 // CUDA_ERROR_INVALID_DEVICE
	CodeInvalidContext = 201 // CUDA_ERROR_INVALID_CONTEXT
	CodeAlreadyMapped  = 208 // CUDA_ERROR_ALREADY_MAPPED
	CodeNotMapped      = 211 // CUDA_ERROR_NOT_MAPPED
	CodeInvalidHandle  = 400 // CUDA_ERROR_INVALID_HANDLE
	CodeNotFound       = 500 // CUDA_ERROR_NOT_FOUND
	CodeNotReady       = 600 // CUDA_ERROR_NOT_READY
	CodeIllegalAddress = 700 // CUDA_ERROR_ILLEGAL_ADDRESS
	CodeNotPermitted   = 800 // CUDA_ERROR_NOT_PERMITTED
	CodeNotSupported   = 801 // CUDA_ERROR_NOT_SUPPORTED
	// CodeStreamCaptureUnsupported is what a call that would break a CUDA
	// graph capture returns (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED).
	CodeStreamCaptureUnsupported = 900 // CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
	// CodeStreamCaptureImplicit is cuStreamIsCapturing's answer for the
	// legacy default stream while a blocking stream of its context captures
	// (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT).
	CodeStreamCaptureImplicit = 906 // CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
	CodeUnknown               = 999 // CUDA_ERROR_UNKNOWN
)

// Stream capture statuses (CUstreamCaptureStatus), from
// Driver.StreamIsCapturing.
const (
	StreamCaptureStatusNone        = 0 // CU_STREAM_CAPTURE_STATUS_NONE
	StreamCaptureStatusActive      = 1 // CU_STREAM_CAPTURE_STATUS_ACTIVE
	StreamCaptureStatusInvalidated = 2 // CU_STREAM_CAPTURE_STATUS_INVALIDATED
)

// Stream creation flags (CUstream_flags).
const (
	StreamDefault     = 0x0 // CU_STREAM_DEFAULT
	StreamNonBlocking = 0x1 // CU_STREAM_NON_BLOCKING: no implicit synchronization with the legacy default stream
)

// Device attributes (CUdevice_attribute) for Driver.DeviceAttribute: the
// ones the package uses.
const (
	// DeviceAttrGPUDirectRDMAWithCUDAVMMSupported is 1 when cuMemCreate
	// accepts allocFlags.gpuDirectRDMACapable on the device.
	DeviceAttrGPUDirectRDMAWithCUDAVMMSupported = 110 // CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
	// DeviceAttrHostNUMAVMMSupported is 1 when cuMemCreate and cuMemMap
	// accept a CU_MEM_LOCATION_TYPE_HOST_NUMA location for the device; older
	// drivers do not know the attribute.
	DeviceAttrHostNUMAVMMSupported = 141 // CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED (CUDA 12.9+)
)

// Event creation flags (CUevent_flags).
const (
	EventDefault       = 0x0 // CU_EVENT_DEFAULT
	EventBlockingSync  = 0x1 // CU_EVENT_BLOCKING_SYNC
	EventDisableTiming = 0x2 // CU_EVENT_DISABLE_TIMING: what EventCreate uses
)

// cuMemHostAlloc flags (CU_MEMHOSTALLOC_*).
const (
	HostAllocPortable      = 0x1 // CU_MEMHOSTALLOC_PORTABLE: pinned for every context
	HostAllocDeviceMap     = 0x2 // CU_MEMHOSTALLOC_DEVICEMAP: mapped into the device address space
	HostAllocWriteCombined = 0x4 // CU_MEMHOSTALLOC_WRITECOMBINED
	// HostAllocAll is every flag MemHostAlloc knows.
	HostAllocAll = HostAllocPortable | HostAllocDeviceMap | HostAllocWriteCombined
)

// Memory location types (CUmemLocationType).
const (
	MemLocationTypeInvalid         = 0x0 // CU_MEM_LOCATION_TYPE_INVALID
	MemLocationTypeDevice          = 0x1 // CU_MEM_LOCATION_TYPE_DEVICE: id is a device ordinal
	MemLocationTypeHost            = 0x2 // CU_MEM_LOCATION_TYPE_HOST (CUDA 12.2+)
	MemLocationTypeHostNUMA        = 0x3 // CU_MEM_LOCATION_TYPE_HOST_NUMA (CUDA 12.2+): id is a NUMA node
	MemLocationTypeHostNUMACurrent = 0x4 // CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT (CUDA 12.2+)
)

// Shareable handle types (CUmemAllocationHandleType). The wrappers that
// export and import handles support MemHandleTypePosixFD only.
const (
	MemHandleTypeNone     = 0x0 // CU_MEM_HANDLE_TYPE_NONE
	MemHandleTypePosixFD  = 0x1 // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
	MemHandleTypeWin32    = 0x2 // CU_MEM_HANDLE_TYPE_WIN32
	MemHandleTypeWin32KMT = 0x4 // CU_MEM_HANDLE_TYPE_WIN32_KMT
	MemHandleTypeFabric   = 0x8 // CU_MEM_HANDLE_TYPE_FABRIC (CUDA 12.3+)
)

// MemAllocationTypePinned is CU_MEM_ALLOCATION_TYPE_PINNED, the only type
// the pool and VMM wrappers request.
const MemAllocationTypePinned = 0x1 // CU_MEM_ALLOCATION_TYPE_PINNED

// Access flags (CUmemAccess_flags).
const (
	MemAccessProtNone      = 0x0 // CU_MEM_ACCESS_FLAGS_PROT_NONE
	MemAccessProtRead      = 0x1 // CU_MEM_ACCESS_FLAGS_PROT_READ
	MemAccessProtReadWrite = 0x3 // CU_MEM_ACCESS_FLAGS_PROT_READWRITE: what MemSetAccess grants
)

// Granularity options for MemGetAllocationGranularity
// (CUmemAllocationGranularity_flags).
const (
	MemAllocGranularityMinimum     = 0x0 // CU_MEM_ALLOC_GRANULARITY_MINIMUM
	MemAllocGranularityRecommended = 0x1 // CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
)

// Memory pool attributes (CUmemPool_attribute). The REUSE_* ones are ints
// in the driver and take 0 or 1; the others are 64-bit byte counts.
const (
	MemPoolAttrReuseFollowEventDependencies   = 1 // CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES
	MemPoolAttrReuseAllowOpportunistic        = 2 // CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC
	MemPoolAttrReuseAllowInternalDependencies = 3 // CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES
	MemPoolAttrReleaseThreshold               = 4 // CU_MEMPOOL_ATTR_RELEASE_THRESHOLD
	MemPoolAttrReservedMemCurrent             = 5 // CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT (read only)
	MemPoolAttrReservedMemHigh                = 6 // CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH (reset with 0)
	MemPoolAttrUsedMemCurrent                 = 7 // CU_MEMPOOL_ATTR_USED_MEM_CURRENT (read only)
	MemPoolAttrUsedMemHigh                    = 8 // CU_MEMPOOL_ATTR_USED_MEM_HIGH (reset with 0)
)
