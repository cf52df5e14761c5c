// Compile-time proof that the driver declarations gpumempool builds with
// (gocore/cuda/driver/cuda_types.h and shim.h, gocore/nccl/libnccl/nccl_api.h)
// agree with NVIDIA's real headers. We build without CUDA headers, so these
// declarations are ours; a wrong struct offset or a missing argument would
// only show up as memory corruption on a GPU. tests/test_cuda_headers.py
// compiles this file with -fsyntax-only against the cuda.h of several CUDA
// releases (and nccl.h where one is found): every static_assert names what
// disagrees.
//
// Ours go into namespace ours, the real ones stay global, so both sets of
// names can be seen at once. The system headers shim.h includes are
// included first, so that their include guards keep them out of the
// namespace.
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <type_traits>

#include <cuda.h>
#ifdef GMP_HAVE_NCCL_H
#include <nccl.h>
#endif

namespace ours {
#include "cuda/driver/shim.h"
#include "nccl/libnccl/nccl_api.h"
}  // namespace ours

// ---------------------------------------------------------------------------
// When two parameter (or return) types are the same at the ABI level.
//
// Real cuda.h uses enums (CUresult, CUmemPool_attribute, ...) where we use
// int, and typed opaque handles (CUstream = struct CUstream_st *) where we
// use void *. Both are fine; anything else must match exactly: same size and
// signedness for integers, same constness and a compatible pointee for
// pointers, and same size for structs (their fields are checked below).
template <class Real, class Ours>
constexpr bool same_abi() {
    using R = std::remove_cv_t<Real>;
    using O = std::remove_cv_t<Ours>;
    if constexpr (std::is_same_v<R, O>) {
        return true;
    } else if constexpr (std::is_pointer_v<R> && std::is_pointer_v<O>) {
        using PR = std::remove_pointer_t<R>;
        using PO = std::remove_pointer_t<O>;
        if constexpr (std::is_const_v<PR> != std::is_const_v<PO>) {
            return false;
        } else if constexpr (std::is_void_v<std::remove_cv_t<PO>>) {
            // void * for an opaque handle (pointer to an incomplete struct) or for void *.
            return std::is_void_v<std::remove_cv_t<PR>> || std::is_class_v<PR>;
        } else if constexpr (std::is_class_v<PR> && std::is_class_v<PO>) {
            return sizeof(PR) == sizeof(PO);
        } else {
            return same_abi<PR, PO>();
        }
    } else if constexpr ((std::is_integral_v<R> || std::is_enum_v<R>) &&
                         (std::is_integral_v<O> || std::is_enum_v<O>)) {
        if constexpr (std::is_integral_v<R> && std::is_integral_v<O>) {
            return sizeof(R) == sizeof(O) && std::is_signed_v<R> == std::is_signed_v<O>;
        } else {
            return sizeof(R) == sizeof(O);
        }
    } else {
        return false;
    }
}

template <class RR, class... RA, class OR, class... OA>
constexpr bool same_signature(RR (*)(RA...), OR (*)(OA...)) {
    if constexpr (sizeof...(RA) != sizeof...(OA)) {
        return false;
    } else {
        return same_abi<RR, OR>() && (same_abi<RA, OA>() && ...);
    }
}

#define GMP_SAME_SIGNATURE(real, ours_type)                                     \
    static_assert(same_signature(static_cast<decltype(&::real)>(nullptr),      \
                                 static_cast<ours_type>(nullptr)),              \
                  #ours_type " does not match the declaration of " #real)

// ---------------------------------------------------------------------------
// Every entry point shim.h resolves (its GMP_FUNCS list, so a new one cannot
// be forgotten): t_<name> has the prototype cuda.h declares for <name>. A
// name cuda.h does not declare fails to compile here.
// (cuStreamIsCapturing, cuStreamCreate, cuStreamDestroy_v2,
// cuDeviceGetAttribute, cuMemPoolSetAccess, cuMemPoolGetAccess and
// cuDeviceGetUuid_v2 included;
// the CUstreamCaptureStatus, CUstream_flags, CUdevice_attribute and
// CUDA_ERROR_STREAM_CAPTURE_IMPLICIT values they use are checked with the
// other constants.)
#define GMP_CHECK_FUNC(name, required) GMP_SAME_SIGNATURE(name, ours::t_##name);
GMP_FUNCS(GMP_CHECK_FUNC)
#undef GMP_CHECK_FUNC

// package libnccl pushes and pops the device context itself.
GMP_SAME_SIGNATURE(cuCtxPushCurrent_v2, ours::gmp_cu_push_fn);
GMP_SAME_SIGNATURE(cuCtxPopCurrent_v2, ours::gmp_cu_pop_fn);
GMP_SAME_SIGNATURE(cuThreadExchangeStreamCaptureMode, ours::gmp_cu_exchange_capture_mode_fn);

#ifdef GMP_HAVE_NCCL_H
GMP_SAME_SIGNATURE(ncclGetVersion, ours::gmp_nccl_version_fn);
GMP_SAME_SIGNATURE(ncclMemAlloc, ours::gmp_nccl_alloc_fn);
GMP_SAME_SIGNATURE(ncclMemFree, ours::gmp_nccl_free_fn);
GMP_SAME_SIGNATURE(ncclGetErrorString, ours::gmp_nccl_errstr_fn);
GMP_SAME_SIGNATURE(ncclGetLastError, ours::gmp_nccl_last_error_fn);
GMP_SAME_SIGNATURE(ncclCommRegister, ours::gmp_nccl_comm_register_fn);
GMP_SAME_SIGNATURE(ncclCommDeregister, ours::gmp_nccl_comm_deregister_fn);
static_assert(sizeof(ncclResult_t) == sizeof(int), "ncclResult_t is an int-sized enum");
#endif

// ---------------------------------------------------------------------------
// The structs the shim fills in: same size, and every field we set at the
// same offset with the same size. (Fields we do not name stay zeroed: the
// shim memsets every struct first, which is what the driver asks of
// reserved bytes.)
#define GMP_SAME_SIZE(T) static_assert(sizeof(::T) == sizeof(ours::T), "sizeof(" #T ") differs from cuda.h")
#define GMP_SAME_FIELD(T, f)                                                    \
    static_assert(offsetof(::T, f) == offsetof(ours::T, f), "offset of " #T "." #f " differs from cuda.h"); \
    static_assert(sizeof(::T::f) == sizeof(ours::T::f), "size of " #T "." #f " differs from cuda.h")

GMP_SAME_SIZE(CUmemLocation);
GMP_SAME_FIELD(CUmemLocation, type);
static_assert(offsetof(::CUmemLocation, id) == offsetof(ours::CUmemLocation, id), "offset of CUmemLocation.id");
static_assert(sizeof(::CUmemLocation{}.id) == sizeof(ours::CUmemLocation{}.id), "size of CUmemLocation.id");

GMP_SAME_SIZE(CUmemAllocationProp);
GMP_SAME_FIELD(CUmemAllocationProp, type);
GMP_SAME_FIELD(CUmemAllocationProp, requestedHandleTypes);
GMP_SAME_FIELD(CUmemAllocationProp, location);
GMP_SAME_FIELD(CUmemAllocationProp, win32HandleMetaData);
GMP_SAME_FIELD(CUmemAllocationProp, allocFlags);
static_assert(offsetof(::CUmemAllocationProp, allocFlags.compressionType) ==
                  offsetof(ours::CUmemAllocationProp, allocFlags.compressionType),
              "offset of CUmemAllocationProp.allocFlags.compressionType");
static_assert(offsetof(::CUmemAllocationProp, allocFlags.gpuDirectRDMACapable) ==
                  offsetof(ours::CUmemAllocationProp, allocFlags.gpuDirectRDMACapable),
              "offset of CUmemAllocationProp.allocFlags.gpuDirectRDMACapable");
// The VMM backend sets it (devices with
// CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED).
static_assert(sizeof(::CUmemAllocationProp{}.allocFlags.gpuDirectRDMACapable) ==
                  sizeof(ours::CUmemAllocationProp{}.allocFlags.gpuDirectRDMACapable),
              "size of CUmemAllocationProp.allocFlags.gpuDirectRDMACapable");
static_assert(offsetof(::CUmemAllocationProp, allocFlags.usage) ==
                  offsetof(ours::CUmemAllocationProp, allocFlags.usage),
              "offset of CUmemAllocationProp.allocFlags.usage");

GMP_SAME_SIZE(CUmemPoolProps);
GMP_SAME_FIELD(CUmemPoolProps, allocType);
GMP_SAME_FIELD(CUmemPoolProps, handleTypes);
GMP_SAME_FIELD(CUmemPoolProps, location);
GMP_SAME_FIELD(CUmemPoolProps, win32SecurityAttributes);
#if CUDA_VERSION >= 12020
GMP_SAME_FIELD(CUmemPoolProps, maxSize);
#else
// Before CUDA 12.2, maxSize was reserved bytes, which a driver of
// that age requires to be zero: package cuda refuses a MaxSize with such a
// driver (cuDriverGetVersion < 12020) instead of sending it.
static_assert(offsetof(::CUmemPoolProps, reserved) <= offsetof(ours::CUmemPoolProps, maxSize),
              "CUmemPoolProps.maxSize must lie in the reserved bytes of CUDA < 12.2");
#endif

GMP_SAME_SIZE(CUmemAccessDesc);
GMP_SAME_FIELD(CUmemAccessDesc, location);
GMP_SAME_FIELD(CUmemAccessDesc, flags);

GMP_SAME_SIZE(CUmemPoolPtrExportData);

// cuDeviceGetUuid_v2 fills it in; IPC handles carry its bytes.
GMP_SAME_SIZE(CUuuid);
GMP_SAME_FIELD(CUuuid, bytes);

static_assert(sizeof(::CUdeviceptr) == sizeof(ours::CUdeviceptr), "CUdeviceptr");
static_assert(sizeof(::CUmemGenericAllocationHandle) == sizeof(ours::CUmemGenericAllocationHandle),
              "CUmemGenericAllocationHandle");

// The test proves that this file can fail: each GMP_ABI_SELFTEST case is a
// declaration that is wrong in one way, and must not compile.
#if GMP_ABI_SELFTEST == 1
GMP_SAME_SIGNATURE(cuMemAlloc_v2, CUresult (*)(CUdeviceptr *, unsigned int));  // size_t -> 32 bits
#elif GMP_ABI_SELFTEST == 2
GMP_SAME_SIGNATURE(cuMemMap, CUresult (*)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle));  // an argument short
#elif GMP_ABI_SELFTEST == 3
GMP_SAME_SIGNATURE(cuMemPoolCreate, CUresult (*)(void **, CUmemPoolProps *));  // const dropped
#elif GMP_ABI_SELFTEST == 4
GMP_SAME_SIGNATURE(cuMemSetAccess, CUresult (*)(CUdeviceptr, size_t, const CUmemLocation *, size_t));  // wrong struct
#endif

// The enumerators of cuda_types.h and the constants of package driver's
// consts.go are checked by assertions the test generates from those files.
#ifdef GMP_EXTRA_CHECKS
#include GMP_EXTRA_CHECKS
#endif

int main() { return 0; }
