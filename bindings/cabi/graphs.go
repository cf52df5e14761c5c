package cabi

/*
// Unwind tables for C: a C++ exception thrown by gmp_alloc_or_throw unwinds
// through the C frames of torch_glue.c on its way to torch.
#cgo CFLAGS: -fexceptions
#cgo CXXFLAGS: -fexceptions
#cgo LDFLAGS: -ldl
#include <stdint.h>

#include "filter.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"unsafe"

	"github.com/gpumempool/gpumempool/bindings/registry"
	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/graphpool"
)

// Torch's CUDA-graph / torch.cuda.MemPool hooks: beginAllocateToPool,
// endAllocateToPool and releasePool, which the private pools of package
// graphpool serve (registry.Entry.Pool). Torch passes a MempoolId_t and a
// std::function stream filter by value, so C wrappers (zz_slots.c,
// torch_glue.c) hand Go plain values and a heap copy of the filter.

// cppFilter adapts torch's filter, a heap copy of its std::function owned
// from gmpgo_graph_begin on (torch_glue.c), to graphpool: Release deletes
// the copy.
func cppFilter(p unsafe.Pointer) graphpool.Filter {
	return graphpool.Filter{
		Accepts: func(stream gocore.Stream) bool {
			return C.gmp_filter_accepts(p, C.uintptr_t(stream)) != 0
		},
		Release: func() { C.gmp_filter_delete(p) },
	}
}

// gmpgo_graph_begin (in C gmp_graph_begin, exports.c, which first refuses a
// forked child) is beginAllocateToPool: the C wrapper hands over a heap copy
// of torch's filter, which is owned from here on.
//
//export gmpgo_graph_begin
func gmpgo_graph_begin(slot, device C.int, id0, id1 C.uint64_t, filter unsafe.Pointer) {
	f := cppFilter(filter)
	e := registry.BySlot(int(slot))
	if e == nil {
		f.Release()
		registry.SetOrphanError(fmt.Errorf("gmp_begin_allocate_to_pool_%d: no pool holds this slot (closed?)", int(slot)))
		return
	}
	passed := false
	guarded(e, "gmp_begin_allocate_to_pool", func() error {
		passed = true // BeginCapture owns f from here, whatever happens
		return e.Pool.BeginCapture(int(device), graphpool.ID{uint64(id0), uint64(id1)}, f)
	})
	if !passed { // a panic came first (PanicNext): nobody owns the filter
		f.Release()
	}
}

// gmpgo_graph_refuse (in C gmp_graph_refuse, exports.c, which first
// refuses a forked child) records why torch_glue.c refused a
// beginAllocateToPool without calling through torch's filter (its layout
// is not libstdc++'s) as the pool's last error.
//
//export gmpgo_graph_refuse
func gmpgo_graph_refuse(slot C.int, why *C.char) {
	msg := C.GoString(why)
	slotHook(int(slot), "gmp_begin_allocate_to_pool", func(*registry.Entry) error { return errors.New(msg) })
}

// gmpgo_graph_end (in C gmp_graph_end, exports.c, which first refuses a
// forked child) is endAllocateToPool: the capture (or use_mem_pool) begun
// for (device, id) stops routing allocations.
//
//export gmpgo_graph_end
func gmpgo_graph_end(slot, device C.int, id0, id1 C.uint64_t) {
	graphEnd(int(slot), int(device), graphpool.ID{uint64(id0), uint64(id1)})
}

// graphEnd is gmpgo_graph_end. When no pool holds the slot any more, its
// pool closed during its own capture: the backend may then have refused
// the private pools' segments (the stream still captured: the CUDA
// backends' ErrCaptureUnderway), which linger. Torch ends the allocation
// to the pool after the capture ended, so they are offered again now;
// otherwise they would wait for another pool's sweep, maybe forever.
func graphEnd(slot, device int, id graphpool.ID) {
	if registry.BySlot(slot) == nil {
		if _, err := graphpool.RetryLingering(); err != nil {
			registry.SetOrphanError(fmt.Errorf("gmp_end_allocate_to_pool_%d: give back the segments of a pool closed during its capture: %w", slot, err))
		}
	}
	slotHook(slot, "gmp_end_allocate_to_pool", func(e *registry.Entry) error {
		return e.Pool.EndCapture(device, id)
	})
}

// gmpgo_graph_release (in C gmp_graph_release, exports.c, which first
// refuses a forked child) is releasePool: the graph (or torch.cuda.MemPool)
// is gone, so the pool's segments go back once its last block is freed.
//
//export gmpgo_graph_release
func gmpgo_graph_release(slot, device C.int, id0, id1 C.uint64_t) {
	slotHook(int(slot), "gmp_release_pool", func(e *registry.Entry) error {
		return e.Pool.Release(int(device), graphpool.ID{uint64(id0), uint64(id1)})
	})
}
