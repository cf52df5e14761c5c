package cabi

/*
#include <stddef.h>
*/
import "C"

import (
	"fmt"
	"math"
	"unsafe"

	"github.com/gpumempool/gpumempool/bindings/registry"
	"github.com/gpumempool/gpumempool/gocore"
)

// Torch's CUDAPluggableAllocator takes four optional hooks besides alloc and
// free (set_init_fn, set_reset_fn, set_memory_fraction_fn,
// set_record_stream_fn). They are exported per slot like the alloc/free
// pair, so that torch calls straight into Go: no Python callback, hence no
// GIL taken under torch's allocator lock (the GIL -> allocator-lock order
// that deadlocks). Their C signatures return void, so a failure is kept as
// the pool's last error (gmp_last_error, MemPool.last_error()).
//
//	void gmp_init_<i>(int device_count);
//	void gmp_empty_cache_<i>(void);
//	void gmp_memory_fraction_<i>(double fraction, int device);
//	void gmp_record_stream_<i>(void* ptr, cudaStream_t stream);

// HookSymbols returns torch's setter name -> exported function for slot.
func HookSymbols(slot int) map[string]string {
	return map[string]string{
		"set_init_fn":            fmt.Sprintf("gmp_init_%d", slot),
		"set_reset_fn":           fmt.Sprintf("gmp_empty_cache_%d", slot),
		"set_memory_fraction_fn": fmt.Sprintf("gmp_memory_fraction_%d", slot),
		"set_record_stream_fn":   fmt.Sprintf("gmp_record_stream_%d", slot),
	}
}

// slotHook runs fn for the pool holding slot, turning an error or a panic
// into the pool's last error.
func slotHook(slot int, where string, fn func(e *registry.Entry) error) {
	e := registry.BySlot(slot)
	if e == nil {
		registry.SetOrphanError(fmt.Sprintf("%s_%d: no pool holds this slot (closed?)", where, slot))
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
		limit, err := fractionLimit(e.Pool, float64(fraction), int(device))
		if err != nil {
			return err
		}
		return e.Pool.SetDeviceLimit(int(device), limit)
	})
}

// fractionLimit turns torch's per-process memory fraction of device into a
// byte limit. Fraction 0 allows nothing (a limit of one byte: limit 0 would
// mean none).
func fractionLimit(p *gocore.Pool, fraction float64, device int) (uint64, error) {
	if math.IsNaN(fraction) || fraction < 0 || fraction > 1 {
		return 0, fmt.Errorf("memory fraction %v of device %d is outside [0, 1]: %w",
			fraction, device, gocore.ErrInvalidArgument)
	}
	total, _, err := p.Backend().Capacity(device)
	if err != nil {
		return 0, fmt.Errorf("memory fraction of device %d: total memory unknown: %w", device, err)
	}
	return max(uint64(fraction*float64(total)), 1), nil
}

func slotRecordStream(slot int, ptr, stream unsafe.Pointer) {
	slotHook(slot, "gmp_record_stream", func(e *registry.Entry) error {
		return e.Pool.RecordStream(uint64(uintptr(ptr)), gocore.Stream(uintptr(stream)))
	})
}
