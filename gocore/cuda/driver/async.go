package driver

/*
#include "shim.h"
*/
import "C"

import (
	"fmt"
	"unsafe"

	"github.com/gpumempool/gpumempool/gocore"
)

// MemPoolCreate creates a memory pool (cuMemPoolCreate) under dev's context.
func (d *Driver) MemPoolCreate(dev int, props PoolProps) (uint64, error) {
	if err := d.require(C.GMP_cuMemPoolCreate); err != nil {
		return 0, err
	}
	var pool C.uint64_t
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res {
		return C.gmp_pool_create(d.fns, ctx, C.int(props.HandleType), C.int(props.LocationType),
			C.int(props.LocationID), C.uint64_t(props.MaxSize), &pool)
	})
	if err != nil {
		return 0, fmt.Errorf("cuda: create memory pool %+v on device %d: %w", props, dev, err)
	}
	return uint64(pool), nil
}

// MemPoolDestroy destroys pool. Allocations still outstanding stay valid
// until freed, as the driver documents.
func (d *Driver) MemPoolDestroy(dev int, pool uint64) error {
	if err := d.require(C.GMP_cuMemPoolDestroy); err != nil {
		return err
	}
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res { return C.gmp_pool_destroy(d.fns, ctx, C.uint64_t(pool)) })
	if err != nil {
		return fmt.Errorf("cuda: destroy memory pool %#x on device %d: %w", pool, dev, err)
	}
	return nil
}

// MemAllocFromPoolAsync allocates size bytes from pool, ordered on stream
// (cuMemAllocFromPoolAsync). Running out of memory matches
// gocore.ErrBackendOutOfMemory.
func (d *Driver) MemAllocFromPoolAsync(dev int, size, pool, stream uint64) (uint64, error) {
	if err := d.require(C.GMP_cuMemAllocFromPoolAsync); err != nil {
		return 0, err
	}
	var p C.uint64_t
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res {
		return C.gmp_pool_alloc_async(d.fns, ctx, C.size_t(size), C.uint64_t(pool), C.uint64_t(stream), &p)
	})
	if err != nil {
		return 0, fmt.Errorf("cuda: alloc %d bytes from pool %#x on stream %#x of device %d: %w", size, pool, stream, dev, err)
	}
	return uint64(p), nil
}

// MemFreeAsync frees ptr, ordered on stream (cuMemFreeAsync).
func (d *Driver) MemFreeAsync(dev int, ptr, stream uint64) error {
	if err := d.require(C.GMP_cuMemFreeAsync); err != nil {
		return err
	}
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res {
		return C.gmp_free_async(d.fns, ctx, C.uint64_t(ptr), C.uint64_t(stream))
	})
	if err != nil {
		return fmt.Errorf("cuda: free %#x on stream %#x of device %d: %w", ptr, stream, dev, err)
	}
	return nil
}

// MemPoolSetAttribute sets a pool attribute (MemPoolAttr*). The REUSE_*
// attributes are passed to the driver as ints (0 or 1), the others as
// 64-bit values; the high watermarks only accept 0 (a reset).
func (d *Driver) MemPoolSetAttribute(dev int, pool uint64, attr int, value uint64) error {
	if err := d.require(C.GMP_cuMemPoolSetAttribute); err != nil {
		return err
	}
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res {
		return C.gmp_pool_set_attr(d.fns, ctx, C.uint64_t(pool), C.int(attr), C.uint64_t(value))
	})
	if err != nil {
		return fmt.Errorf("cuda: set attribute %d of memory pool %#x to %d: %w", attr, pool, value, err)
	}
	return nil
}

// MemPoolGetAttribute reads a pool attribute (MemPoolAttr*).
func (d *Driver) MemPoolGetAttribute(dev int, pool uint64, attr int) (uint64, error) {
	if err := d.require(C.GMP_cuMemPoolGetAttribute); err != nil {
		return 0, err
	}
	var v C.uint64_t
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res {
		return C.gmp_pool_get_attr(d.fns, ctx, C.uint64_t(pool), C.int(attr), &v)
	})
	if err != nil {
		return 0, fmt.Errorf("cuda: get attribute %d of memory pool %#x: %w", attr, pool, err)
	}
	return uint64(v), nil
}

// MemPoolTrimTo releases pool memory until the pool holds at most keep
// bytes beyond its outstanding allocations (cuMemPoolTrimTo).
func (d *Driver) MemPoolTrimTo(dev int, pool, keep uint64) error {
	if err := d.require(C.GMP_cuMemPoolTrimTo); err != nil {
		return err
	}
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res {
		return C.gmp_pool_trim(d.fns, ctx, C.uint64_t(pool), C.uint64_t(keep))
	})
	if err != nil {
		return fmt.Errorf("cuda: trim memory pool %#x to %d bytes: %w", pool, keep, err)
	}
	return nil
}

// MemPoolSetAccess gives each device in accessDevices read/write access to
// pool's memory (cuMemPoolSetAccess).
func (d *Driver) MemPoolSetAccess(dev int, pool uint64, accessDevices []int) error {
	if len(accessDevices) == 0 || len(accessDevices) > MaxAccessDevices {
		return fmt.Errorf("cuda: set access of memory pool %#x: %d devices, want 1 to %d: %w",
			pool, len(accessDevices), MaxAccessDevices, gocore.ErrInvalidArgument)
	}
	if err := d.require(C.GMP_cuMemPoolSetAccess); err != nil {
		return err
	}
	devs := make([]C.int, len(accessDevices))
	for i, a := range accessDevices {
		devs[i] = C.int(a)
	}
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res {
		return C.gmp_pool_set_access(d.fns, ctx, C.uint64_t(pool), &devs[0], C.int(len(devs)))
	})
	if err != nil {
		return fmt.Errorf("cuda: set read/write access of memory pool %#x for devices %v: %w", pool, accessDevices, err)
	}
	return nil
}

// MemPoolGetAccess returns the access flags (MemAccessProt*) device
// accessor has to pool's memory (cuMemPoolGetAccess).
func (d *Driver) MemPoolGetAccess(dev int, pool uint64, accessor int) (int, error) {
	if err := d.require(C.GMP_cuMemPoolGetAccess); err != nil {
		return 0, err
	}
	var f C.int
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res {
		return C.gmp_pool_get_access(d.fns, ctx, C.uint64_t(pool), C.int(accessor), &f)
	})
	if err != nil {
		return 0, fmt.Errorf("cuda: access of device %d to memory pool %#x: %w", accessor, pool, err)
	}
	return int(f), nil
}

// posixFDOnly rejects handle types whose handles are not file descriptors
// (the wrappers pass and return an int).
func posixFDOnly(op string, handleType int) error {
	if handleType != MemHandleTypePosixFD {
		return fmt.Errorf("cuda: %s: handle type %#x: only POSIX file descriptors (%#x) are supported: %w",
			op, handleType, MemHandleTypePosixFD, gocore.ErrUnsupported)
	}
	return nil
}

// MemPoolExportToShareableHandle exports pool, created with HandleType
// MemHandleTypePosixFD, as a file descriptor another process can import.
// The caller owns (and closes) the descriptor.
func (d *Driver) MemPoolExportToShareableHandle(dev int, pool uint64, handleType int) (int, error) {
	if err := posixFDOnly("export memory pool", handleType); err != nil {
		return -1, err
	}
	if err := d.require(C.GMP_cuMemPoolExportToShareableHandle); err != nil {
		return -1, err
	}
	var fd C.int
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res {
		return C.gmp_pool_export(d.fns, ctx, C.uint64_t(pool), C.int(handleType), &fd)
	})
	if err != nil {
		return -1, fmt.Errorf("cuda: export memory pool %#x: %w", pool, err)
	}
	return int(fd), nil
}

// MemPoolImportFromShareableHandle imports a pool exported as file
// descriptor fd. The descriptor stays the caller's to close.
func (d *Driver) MemPoolImportFromShareableHandle(dev int, fd int, handleType int) (uint64, error) {
	if err := posixFDOnly("import memory pool", handleType); err != nil {
		return 0, err
	}
	if err := d.require(C.GMP_cuMemPoolImportFromShareableHandle); err != nil {
		return 0, err
	}
	var pool C.uint64_t
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res {
		return C.gmp_pool_import(d.fns, ctx, C.int(fd), C.int(handleType), &pool)
	})
	if err != nil {
		return 0, fmt.Errorf("cuda: import memory pool from fd %d: %w", fd, err)
	}
	return uint64(pool), nil
}

// MemPoolExportPointer returns the opaque data (CUmemPoolPtrExportData)
// with which another process imports ptr, an allocation from an exportable
// pool.
func (d *Driver) MemPoolExportPointer(dev int, ptr uint64) ([64]byte, error) {
	var data [64]byte
	if err := d.require(C.GMP_cuMemPoolExportPointer); err != nil {
		return data, err
	}
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res {
		return C.gmp_pool_export_ptr(d.fns, ctx, C.uint64_t(ptr), (*C.uchar)(unsafe.Pointer(&data[0])))
	})
	if err != nil {
		return [64]byte{}, fmt.Errorf("cuda: export pointer %#x: %w", ptr, err)
	}
	return data, nil
}

// MemGetAddressRange returns the base address and size of the allocation
// holding ptr (cuMemGetAddressRange_v2): what an imported pointer really
// maps, whatever the exporter said.
func (d *Driver) MemGetAddressRange(dev int, ptr uint64) (base, size uint64, err error) {
	if err := d.require(C.GMP_cuMemGetAddressRange_v2); err != nil {
		return 0, 0, err
	}
	var b, n C.uint64_t
	err = d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res {
		return C.gmp_mem_range(d.fns, ctx, C.uint64_t(ptr), &b, &n)
	})
	if err != nil {
		return 0, 0, fmt.Errorf("cuda: address range of %#x: %w", ptr, err)
	}
	return uint64(b), uint64(n), nil
}

// MemPoolImportPointer maps the allocation described by data (from
// MemPoolExportPointer) out of pool, an imported pool.
func (d *Driver) MemPoolImportPointer(dev int, pool uint64, data [64]byte) (uint64, error) {
	if err := d.require(C.GMP_cuMemPoolImportPointer); err != nil {
		return 0, err
	}
	var p C.uint64_t
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res {
		return C.gmp_pool_import_ptr(d.fns, ctx, C.uint64_t(pool), (*C.uchar)(unsafe.Pointer(&data[0])), &p)
	})
	if err != nil {
		return 0, fmt.Errorf("cuda: import pointer from memory pool %#x: %w", pool, err)
	}
	return uint64(p), nil
}
