package cabi

/*
#include <stddef.h>
#include <stdint.h>
*/
import "C"

import (
	"fmt"
	"math"

	"github.com/gpumempool/gpumempool/bindings/registry"
	"github.com/gpumempool/gpumempool/gocore"
)

// Torch's CUDAPluggableAllocator takes optional hooks besides alloc and
// free. They are exported per slot like the alloc/free pair, so that torch
// calls straight into Go: no Python callback, hence no GIL taken under
// torch's allocator lock (the GIL -> allocator-lock order that deadlocks).
// Most return void, so a failure is kept as the pool's last error
// (gmp_last_error, MemPool.last_error()).
//
//	void  gmp_init_<i>(int device_count);
//	void  gmp_empty_cache_<i>(void);
//	void  gmp_memory_fraction_<i>(double fraction, int device);
//	void  gmp_record_stream_<i>(void* ptr, cudaStream_t stream);
//	void* gmp_base_alloc_<i>(void* ptr, size_t* size);
//
// and, in C (zz_slots.c, graphs.go), the CUDA-graph / MemPool hooks
// gmp_begin_allocate_to_pool_<i>, gmp_end_allocate_to_pool_<i> and
// gmp_release_pool_<i>.

// HookSymbols returns torch's setter name -> exported function for slot.
// The setter names are those of torch's Python binding of
// CUDAPluggableAllocator; each takes the function's address.
func HookSymbols(slot int) map[string]string {
	return map[string]string{
		"set_init_fn":                 fmt.Sprintf("gmp_init_%d", slot),
		"set_reset_fn":                fmt.Sprintf("gmp_empty_cache_%d", slot),
		"set_memory_fraction_fn":      fmt.Sprintf("gmp_memory_fraction_%d", slot),
		"set_record_stream_fn":        fmt.Sprintf("gmp_record_stream_%d", slot),
		"set_base_alloc_fn":           fmt.Sprintf("gmp_base_alloc_%d", slot),
		"set_begin_allocate_to_pool":  fmt.Sprintf("gmp_begin_allocate_to_pool_%d", slot),
		"set_end_allocate_to_pool_fn": fmt.Sprintf("gmp_end_allocate_to_pool_%d", slot),
		"set_release_pool":            fmt.Sprintf("gmp_release_pool_%d", slot),
	}
}

// slotHook runs fn for the pool holding slot, turning an error or a panic
// into the pool's last error.
func slotHook(slot int, where string, fn func(e *registry.Entry) error) {
	e := registry.BySlot(slot)
	if e == nil {
		registry.SetOrphanError(fmt.Errorf("%s_%d: no pool holds this slot (closed?)", where, slot))
		return
	}
	guarded(e, where, func() error { return fn(e) })
}

func slotInit(slot int, deviceCount C.int) {
	slotHook(slot, "gmp_init", func(e *registry.Entry) error {
		if n := e.Pool.Backend().Devices(); int(deviceCount) > n {
			return fmt.Errorf("torch sees %d devices but the pool's %s backend serves %d; "+
				"allocations on the others will fail", int(deviceCount), e.Pool.Backend().Name(), n)
		}
		return nil
	})
}

func slotEmptyCache(slot int) {
	slotHook(slot, "gmp_empty_cache", func(e *registry.Entry) error {
		_, err := e.Pool.EmptyCache()
		return err
	})
}

func slotMemoryFraction(slot int, fraction C.double, device C.int) {
	slotHook(slot, "gmp_memory_fraction", func(e *registry.Entry) error {
		limit, err := fractionLimit(e.Pool.Backend(), float64(fraction), int(device))
		if err != nil {
			return err
		}
		return e.Pool.SetDeviceLimit(int(device), limit)
	})
}

// fractionLimit turns torch's per-process memory fraction of device into a
// byte limit. Fraction 0 allows nothing (a limit of one byte: limit 0 would
// mean none).
func fractionLimit(be gocore.Backend, fraction float64, device int) (uint64, error) {
	if math.IsNaN(fraction) || fraction < 0 || fraction > 1 {
		return 0, fmt.Errorf("memory fraction %v of device %d is outside [0, 1]: %w",
			fraction, device, gocore.ErrInvalidArgument)
	}
	total, _, err := be.Capacity(device)
	if err != nil {
		return 0, fmt.Errorf("memory fraction of device %d: total memory unknown: %w", device, err)
	}
	return max(uint64(fraction*float64(total)), 1), nil
}

func slotRecordStream(slot int, ptr, stream C.uintptr_t) {
	if ptr == 0 {
		// An empty tensor's storage (torch passes its NULL data pointer,
		// e.g. for NCCL collectives on empty tensors): nothing to record,
		// as torch's own allocator returns early too.
		return
	}
	slotHook(slot, "gmp_record_stream", func(e *registry.Entry) error {
		return e.Pool.RecordStream(uint64(ptr), gocore.Stream(stream))
	})
}

// slotBaseAlloc is torch's getBaseAllocation: the segment (the backend's
// allocation) holding the block at ptr, and its size. Without the hook
// torch takes the block itself for the base of its allocation, which is
// wrong for any block but a segment's first: torch versions whose CUDA
// tensor sharing (torch.multiprocessing) was built on getBaseAllocation
// would have sent the segment's first bytes. (Recent torch shares through
// shareIpcHandle, which a pluggable allocator cannot provide: sharing CUDA
// tensors between processes fails there with torch's own error.)
// NULL (and the pool's last error) when ptr is not a live block.
func slotBaseAlloc(slot int, ptr C.uintptr_t, size *C.size_t) C.uintptr_t {
	var base uint64
	slotHook(slot, "gmp_base_alloc", func(e *registry.Entry) error {
		addr := uint64(ptr)
		info, err := e.Pool.Lookup(addr)
		if err != nil {
			return err
		}
		base = info.SegmentAddr
		if size != nil {
			*size = C.size_t(info.SegmentSize)
		}
		return nil
	})
	return C.uintptr_t(base)
}
