package driver

import (
	"encoding/hex"
	"fmt"
)

// DefaultLibrary is the driver library Load opens when given no path and
// $GMP_LIBCUDA is unset (the name the NVIDIA driver installs).
const DefaultLibrary = "libcuda.so.1"

// EnvLibrary names the environment variable that overrides DefaultLibrary.
const EnvLibrary = "GMP_LIBCUDA"

// Options says which library Load opens: the option every backend over the
// driver has.
type Options struct {
	// Library is the path Load is given ("": $GMP_LIBCUDA, else
	// DefaultLibrary).
	Library string `option:"libcuda" type:"path" doc:"path of libcuda.so.1 (default: $GMP_LIBCUDA, else the loader's)"`
}

// PoolProps describes a memory pool for MemPoolCreate (the fields of
// CUmemPoolProps that matter on Linux; the allocation type is always
// pinned and every other byte is zero).
type PoolProps struct {
	// HandleType is the shareable handle type allocations may be exported
	// with: MemHandleTypeNone or MemHandleTypePosixFD.
	HandleType int
	// LocationType and LocationID say where the memory lives, normally
	// MemLocationTypeDevice and a device ordinal.
	LocationType int
	LocationID   int
	// MaxSize caps the pool's reserved bytes; 0 lets the driver choose.
	MaxSize uint64
}

// AllocProp describes physical memory for MemCreate and
// MemGetAllocationGranularity (the fields of CUmemAllocationProp that
// matter on Linux; the type is always pinned and every other byte zero).
type AllocProp struct {
	// LocationType and LocationID say where the memory lives:
	// MemLocationTypeDevice and a device ordinal, or
	// MemLocationTypeHostNUMA and a NUMA node.
	LocationType int
	LocationID   int
	// HandleType is the shareable handle type the memory may be exported
	// with (MemHandleTypeNone or MemHandleTypePosixFD).
	HandleType int
	// GPUDirectRDMACapable sets allocFlags.gpuDirectRDMACapable: the memory
	// will be used for GPUDirect RDMA (NICs reading and writing it). Only
	// devices whose DeviceAttrGPUDirectRDMAWithCUDAVMMSupported is 1 accept
	// it.
	GPUDirectRDMACapable bool
}

// MaxAccessDevices bounds the device lists of MemSetAccess and
// MemPoolSetAccess (the C helpers build the descriptors on their stack).
const MaxAccessDevices = 64

// VersionString formats a CUDA version number as "major.minor", e.g.
// VersionString(12020) == "12.2".
func VersionString(v int) string { return fmt.Sprintf("%d.%d", v/1000, v%1000/10) }

// RequireVersion fails with an error wrapping ErrDriverTooOld when d
// supports a CUDA version older than min, for the feature named (who names
// the caller, for the message).
func (d *Driver) RequireVersion(who, feature string, min int) error {
	v, err := d.Version()
	if err != nil {
		return fmt.Errorf("%s: %w", who, err)
	}
	if v < min {
		return fmt.Errorf("%s: %s needs a driver for CUDA %s or newer; %s supports CUDA %s: %w",
			who, feature, VersionString(min), d.Path(), VersionString(v), ErrDriverTooOld)
	}
	return nil
}

// UUID is a device's UUID as cuDeviceGetUuid_v2 returns it: the same
// device has the same UUID in every process, whatever ordinal
// CUDA_VISIBLE_DEVICES gives it there (for a MIG instance, the instance's
// own UUID).
type UUID [16]byte

// String formats u the way nvidia-smi does:
// GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx.
func (u UUID) String() string {
	h := hex.EncodeToString(u[:])
	return "GPU-" + h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}

// DeviceByUUID returns the ordinal under which this process sees the
// device with UUID u; ok is false when none of its devices has it (another
// CUDA_VISIBLE_DEVICES hides it).
func (d *Driver) DeviceByUUID(u UUID) (dev int, ok bool, err error) {
	n, err := d.DeviceCount()
	if err != nil {
		return 0, false, err
	}
	for i := 0; i < n; i++ {
		got, err := d.DeviceUUID(i)
		if err != nil {
			return 0, false, err
		}
		if got == u {
			return i, true, nil
		}
	}
	return 0, false, nil
}
