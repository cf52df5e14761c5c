package driver

/*
#include "shim.h"
*/
import "C"

import (
	"fmt"

	"github.com/gpumempool/gpumempool/gocore"
)

func cbool(b bool) C.int {
	if b {
		return 1
	}
	return 0
}

// MemGetAllocationGranularity returns the granularity that sizes and
// addresses of VMM calls for prop must be multiples of; option is
// MemAllocGranularityMinimum or MemAllocGranularityRecommended.
func (d *Driver) MemGetAllocationGranularity(dev int, prop AllocProp, option int) (uint64, error) {
	if err := d.require(C.GMP_cuMemGetAllocationGranularity); err != nil {
		return 0, err
	}
	var g C.uint64_t
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res {
		return C.gmp_granularity(d.fns, ctx, C.int(prop.LocationType), C.int(prop.LocationID),
			C.int(prop.HandleType), cbool(prop.GPUDirectRDMACapable), C.int(option), &g)
	})
	if err != nil {
		return 0, fmt.Errorf("cuda: allocation granularity of %+v (option %d): %w", prop, option, err)
	}
	return uint64(g), nil
}

// MemCreate creates size bytes of physical memory described by prop and
// returns its handle (cuMemCreate). size must be a multiple of the
// granularity. Running out of memory matches gocore.ErrBackendOutOfMemory.
func (d *Driver) MemCreate(dev int, size uint64, prop AllocProp) (uint64, error) {
	if err := d.require(C.GMP_cuMemCreate); err != nil {
		return 0, err
	}
	var h C.uint64_t
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res {
		return C.gmp_mem_create(d.fns, ctx, C.size_t(size), C.int(prop.LocationType), C.int(prop.LocationID),
			C.int(prop.HandleType), cbool(prop.GPUDirectRDMACapable), &h)
	})
	if err != nil {
		return 0, fmt.Errorf("cuda: create %d bytes of %+v: %w", size, prop, err)
	}
	return uint64(h), nil
}

// MemRelease releases a handle from MemCreate or
// MemImportFromShareableHandle; the memory goes once it is also unmapped.
func (d *Driver) MemRelease(dev int, handle uint64) error {
	if err := d.require(C.GMP_cuMemRelease); err != nil {
		return err
	}
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res { return C.gmp_mem_release(d.fns, ctx, C.uint64_t(handle)) })
	if err != nil {
		return fmt.Errorf("cuda: release memory handle %#x: %w", handle, err)
	}
	return nil
}

// MemAddressReserve reserves size bytes of virtual address space aligned to
// align (0: the granularity), at fixedAddr if the driver can (0: anywhere;
// it is a hint, check the result).
func (d *Driver) MemAddressReserve(dev int, size, align, fixedAddr uint64) (uint64, error) {
	if err := d.require(C.GMP_cuMemAddressReserve); err != nil {
		return 0, err
	}
	var p C.uint64_t
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res {
		return C.gmp_address_reserve(d.fns, ctx, C.size_t(size), C.size_t(align), C.uint64_t(fixedAddr), &p)
	})
	if err != nil {
		return 0, fmt.Errorf("cuda: reserve %d bytes of address space: %w", size, err)
	}
	return uint64(p), nil
}

// MemAddressFree returns a whole reservation from MemAddressReserve; it must
// be unmapped.
func (d *Driver) MemAddressFree(dev int, ptr, size uint64) error {
	if err := d.require(C.GMP_cuMemAddressFree); err != nil {
		return err
	}
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res {
		return C.gmp_address_free(d.fns, ctx, C.uint64_t(ptr), C.size_t(size))
	})
	if err != nil {
		return fmt.Errorf("cuda: free address range %#x+%d: %w", ptr, size, err)
	}
	return nil
}

// MemMap maps size bytes of handle's memory, from offset, at ptr inside a
// reservation. The range is inaccessible until MemSetAccess.
func (d *Driver) MemMap(dev int, ptr, size, offset, handle uint64) error {
	if err := d.require(C.GMP_cuMemMap); err != nil {
		return err
	}
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res {
		return C.gmp_mem_map(d.fns, ctx, C.uint64_t(ptr), C.size_t(size), C.size_t(offset), C.uint64_t(handle))
	})
	if err != nil {
		return fmt.Errorf("cuda: map %d bytes of handle %#x (offset %d) at %#x: %w", size, handle, offset, ptr, err)
	}
	return nil
}

// MemUnmap unmaps [ptr, ptr+size), which must consist of whole mappings.
func (d *Driver) MemUnmap(dev int, ptr, size uint64) error {
	if err := d.require(C.GMP_cuMemUnmap); err != nil {
		return err
	}
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res {
		return C.gmp_mem_unmap(d.fns, ctx, C.uint64_t(ptr), C.size_t(size))
	})
	if err != nil {
		return fmt.Errorf("cuda: unmap %#x+%d: %w", ptr, size, err)
	}
	return nil
}

// MemSetAccess makes the mapped range [ptr, ptr+size) readable and writable
// (CU_MEM_ACCESS_FLAGS_PROT_READWRITE) from each device in accessDevices.
func (d *Driver) MemSetAccess(dev int, ptr, size uint64, accessDevices []int) error {
	if len(accessDevices) == 0 || len(accessDevices) > MaxAccessDevices {
		return fmt.Errorf("cuda: set access of %#x+%d: %d devices, want 1 to %d: %w",
			ptr, size, len(accessDevices), MaxAccessDevices, gocore.ErrInvalidArgument)
	}
	if err := d.require(C.GMP_cuMemSetAccess); err != nil {
		return err
	}
	devs := make([]C.int, len(accessDevices))
	for i, a := range accessDevices {
		devs[i] = C.int(a)
	}
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res {
		return C.gmp_mem_set_access(d.fns, ctx, C.uint64_t(ptr), C.size_t(size), &devs[0], C.int(len(devs)))
	})
	if err != nil {
		return fmt.Errorf("cuda: set read/write access of %#x+%d for devices %v: %w", ptr, size, accessDevices, err)
	}
	return nil
}

// MemExportToShareableHandle exports handle, created with HandleType
// MemHandleTypePosixFD, as a file descriptor the caller owns.
func (d *Driver) MemExportToShareableHandle(dev int, handle uint64, handleType int) (int, error) {
	if err := posixFDOnly("export memory handle", handleType); err != nil {
		return -1, err
	}
	if err := d.require(C.GMP_cuMemExportToShareableHandle); err != nil {
		return -1, err
	}
	var fd C.int
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res {
		return C.gmp_mem_export(d.fns, ctx, C.uint64_t(handle), C.int(handleType), &fd)
	})
	if err != nil {
		return -1, fmt.Errorf("cuda: export memory handle %#x: %w", handle, err)
	}
	return int(fd), nil
}

// MemImportFromShareableHandle imports memory exported as file descriptor
// fd and returns a handle to map and, eventually, MemRelease. The
// descriptor stays the caller's to close.
func (d *Driver) MemImportFromShareableHandle(dev int, fd int, handleType int) (uint64, error) {
	if err := posixFDOnly("import memory handle", handleType); err != nil {
		return 0, err
	}
	if err := d.require(C.GMP_cuMemImportFromShareableHandle); err != nil {
		return 0, err
	}
	var h C.uint64_t
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res {
		return C.gmp_mem_import(d.fns, ctx, C.int(fd), C.int(handleType), &h)
	})
	if err != nil {
		return 0, fmt.Errorf("cuda: import memory handle from fd %d: %w", fd, err)
	}
	return uint64(h), nil
}
