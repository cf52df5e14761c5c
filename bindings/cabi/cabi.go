// Package cabi exports gpumempool's C ABI from the same shared library as the
// Python extension (one Go runtime per process). Torch's
// CUDAPluggableAllocator dlopens that library and looks the functions up by
// name:
//
//	void* gmp_alloc_<i>(size_t size, int device, cudaStream_t stream);
//	void  gmp_free_<i>(void* ptr, size_t size, int device, cudaStream_t stream);
//
// Slot i (0 <= i < registry.NumSlots) routes to whichever pool holds it, so
// several pools can be plugged in at once, each through its own pair. Plain C
// callers may also use gmp_pool_alloc / gmp_pool_free with a pool handle, and
// gmp_last_error to read why a call returned NULL or -1 (gmp_last_error_value:
// the same as package pyerr's structured value, with its kind and fields).
//
// Every call serves the pool through registry.Entry.Pool, which routes to
// the private pools of CUDA graphs (package graphpool) while a capture or a
// private block says so. Besides: torch's optional hooks per slot
// (hooks.go), the CUDA-graph hooks (graphs.go, zz_slots.c), the throwing alloc
// (zz_slots.c), and the Python API's fast path (pyfast.go).
//
// Every entry point is a C function (exports.c, zz_slots.c) that refuses a
// forked child before it could enter Go, whose runtime does not survive
// fork(): NULL (or -1) with the reason in gmp_last_error, never a hang. The
// Go functions behind them are named gmpgo_*. Every one recovers Go panics:
// a panic becomes a NULL return (or -1) and an error message kept for
// Python, never a crash of the host process.
package cabi

/*
#include <stddef.h>
#include <stdint.h>
*/
import "C"

import (
	"errors"
	"fmt"
	"unicode/utf8"
	"unsafe"

	"github.com/gpumempool/gpumempool/bindings/pyerr"
	"github.com/gpumempool/gpumempool/bindings/registry"
	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/callback"
)

//go:generate go run gen_slots.go

// Pointers and streams cross the C boundary as uintptr_t, not void*: the Go
// runtime treats an unsafe.Pointer that holds a small non-zero value as a
// corrupt pointer and may abort the process when it meets one on a stack,
// and CUDA's special streams are exactly such values (cudaStreamLegacy is
// 0x1, cudaStreamPerThread 0x2). uintptr_t and void* are passed and returned
// in the same registers on every platform we build for, so C callers
// declaring void* are unaffected.

// recovered runs fn and turns a Go panic in it (real, or injected with
// e.PanicNext) into an error, so that nothing unwinds into a C caller. A
// call made from inside the pool's own allocator function is refused
// (Reentered) before fn runs. The hot entry points (alloc and free) do the
// same without a closure: allocRecovered, freeRecovered.
func recovered(e *registry.Entry, fn func() error) (err error) {
	returned := false
	defer stopPanic(&returned, &err)
	if err = enter(e); err == nil {
		err = fn()
	}
	returned = true
	return err
}

// panicFree runs fn and turns a Go panic in it into an error, for entry
// points that serve no pool (gmp_pickle_scan).
func panicFree(fn func() error) (err error) {
	returned := false
	defer stopPanic(&returned, &err)
	err = fn()
	returned = true
	return err
}

// enter makes the checks of every entry point before it serves e's pool:
// the panic PanicNext injects, and a call from inside the pool's own
// allocator function (Reentered). PanicNext is swapped only when set: an
// atomic swap on every call would cost more than a load.
func enter(e *registry.Entry) error {
	if e.PanicNext.Load() {
		injectPanic(e)
	}
	if e.CalledFromCallback() { // Reentered, one call less
		return reentryError(e)
	}
	return nil
}

// injectPanic panics once PanicNext was set (and clears it).
func injectPanic(e *registry.Entry) {
	if e.PanicNext.Swap(false) {
		panic("injected by PanicNext")
	}
}

// stopPanic, deferred, is the one place where entry points stop a Go panic
// before it reaches their C caller: unless the function returned (set
// *returned last), a panic becomes *err. recover runs only then, off the
// hot path.
func stopPanic(returned *bool, err *error) {
	if *returned {
		return
	}
	if r := recover(); r != nil {
		*err = fmt.Errorf("Go panic recovered: %v", r)
	}
}

// allocRecovered is recovered around e's allocation (Alloc, or AllocSegment
// with segment): the hot path, with no closure.
func allocRecovered(e *registry.Entry, size uint64, device int, stream gocore.Stream, segment bool) (addr uint64, err error) {
	returned := false
	defer stopPanic(&returned, &err)
	if err = enter(e); err == nil {
		if segment {
			addr, err = e.Pool.AllocSegment(device, size, stream)
		} else {
			addr, err = e.Pool.Alloc(device, size, stream)
		}
	}
	returned = true
	return addr, err
}

// freeRecovered is recovered around e's free of addr: the hot path, with
// no closure.
func freeRecovered(e *registry.Entry, addr uint64) (err error) {
	returned := false
	defer stopPanic(&returned, &err)
	if err = enter(e); err == nil {
		err = e.Pool.Free(addr)
	}
	returned = true
	return err
}

// guarded runs fn for the pool of e at the C boundary: an error or a Go
// panic becomes the pool's last error and false.
func guarded(e *registry.Entry, where string, fn func() error) bool {
	return guardedErr(e, where, fn) == nil
}

// guardedErr is guarded returning the error (prefixed with where, as
// recorded) instead of false.
func guardedErr(e *registry.Entry, where string, fn func() error) error {
	if err := recovered(e, fn); err != nil {
		return failed(e, where, err)
	}
	return nil
}

// failed records err, prefixed with where, as e's last error and returns
// it so prefixed.
func failed(e *registry.Entry, where string, err error) error {
	err = fmt.Errorf("%s: %w", where, err)
	e.SetError(err)
	return err
}

// Reentered refuses a call made from inside the pool's own allocator
// function: the pool's lock is held by the very thread, which would wait
// for it forever. Every C entry point checks it (recovered); the Python
// API's alloc and free do too.
func Reentered(e *registry.Entry) error {
	if e.CalledFromCallback() {
		return reentryError(e)
	}
	return nil
}

// reentryError is Reentered's refusal.
func reentryError(e *registry.Entry) error {
	return fmt.Errorf("pool %q: %w", e.Pool.Name(), callback.ErrReentry)
}

// entryAlloc is an allocation of e's pool at the C boundary (Alloc, or
// AllocSegment with segment): a failure or a panic becomes the pool's last
// error, prefixed with where.
func entryAlloc(e *registry.Entry, where string, size C.size_t, device C.int, stream C.uintptr_t, segment bool) (C.uintptr_t, error) {
	addr, err := allocRecovered(e, uint64(size), int(device), gocore.Stream(stream), segment)
	if err != nil {
		return 0, failed(e, where, err)
	}
	return C.uintptr_t(addr), nil
}

// entryFree is a free of e's pool at the C boundary: 0, or -1 with the
// failure (or panic) as the pool's last error, prefixed with where.
func entryFree(e *registry.Entry, where string, ptr C.uintptr_t) C.int {
	if err := freeRecovered(e, uint64(ptr)); err != nil {
		failed(e, where, err)
		return -1
	}
	return 0
}

// slotAlloc is gmp_alloc_<slot>. Size 0 gets NULL and is no error: torch
// asks for it for empty tensors, whose pointer is NULL.
func slotAlloc(slot int, size C.size_t, device C.int, stream C.uintptr_t) (C.uintptr_t, error) {
	return slotAllocAs(slot, "gmp_alloc", size, device, stream, false)
}

// slotAllocSegment is gmp_segment_alloc_<slot>: gmp_alloc_<slot> for
// torch's caching allocator getting the segments of a torch.cuda.MemPool,
// which it sizes and carves itself (gocore.Pool.AllocSegment).
func slotAllocSegment(slot int, size C.size_t, device C.int, stream C.uintptr_t) (C.uintptr_t, error) {
	return slotAllocAs(slot, "gmp_segment_alloc", size, device, stream, true)
}

func slotAllocAs(slot int, name string, size C.size_t, device C.int, stream C.uintptr_t, segment bool) (C.uintptr_t, error) {
	e := registry.BySlot(slot)
	if e == nil {
		return 0, noPoolInSlot(name, slot)
	}
	if size == 0 {
		return 0, nil
	}
	return entryAlloc(e, name, size, device, stream, segment)
}

// noPoolInSlot records and returns the error of a call of slot's function
// name when no pool holds the slot.
func noPoolInSlot(name string, slot int) error {
	err := fmt.Errorf("%s_%d: no pool holds this slot (closed?)", name, slot)
	registry.SetOrphanError(err)
	return err
}

// slotFree is gmp_free_<slot>. Freeing NULL (an empty tensor) does nothing.
func slotFree(slot int, ptr C.uintptr_t) {
	if ptr == 0 {
		return
	}
	e := registry.BySlot(slot)
	if e == nil {
		registry.SetOrphanError(fmt.Errorf("gmp_free_%d(%#x): no pool holds this slot (closed?)", slot, uint64(ptr)))
		return
	}
	entryFree(e, "gmp_free", ptr)
}

// gmpgo_slot_alloc_ex (in C gmp_slot_alloc_ex, exports.c, which first refuses a forked child) is gmp_alloc_<slot> reporting its own failure: the
// error into buf (n bytes) and *oom = 1 when it was an out-of-memory one.
// The entry point of full replacement (zz_slots.c) throws it; the
// pool's last error could meanwhile be another thread's.
//
//export gmpgo_slot_alloc_ex
func gmpgo_slot_alloc_ex(slot C.int, size C.size_t, device C.int, stream C.uintptr_t, buf *C.char, n C.size_t, oom *C.int) C.uintptr_t {
	addr, err := slotAlloc(int(slot), size, device, stream)
	if err != nil {
		copyCString(err.Error(), buf, n)
		if oom != nil && errors.Is(err, gocore.ErrOutOfMemory) {
			*oom = 1
		}
	}
	return addr
}

// gmpgo_pool_alloc (in C gmp_pool_alloc, exports.c, which first refuses a forked child) allocates from the pool with handle pool; NULL on error.
//
//export gmpgo_pool_alloc
func gmpgo_pool_alloc(pool C.int64_t, size C.size_t, device C.int, stream C.uintptr_t) C.uintptr_t {
	e, err := registry.Get(int64(pool))
	if err != nil {
		registry.SetOrphanError(fmt.Errorf("gmp_pool_alloc: %w", err))
		return 0
	}
	addr, _ := entryAlloc(e, "gmp_pool_alloc", size, device, stream, false)
	return addr
}

// gmpgo_pool_free (in C gmp_pool_free, exports.c, which first refuses a forked child) frees ptr in the pool with handle pool; 0 on success, -1 on
// error (see gmp_last_error).
//
//export gmpgo_pool_free
func gmpgo_pool_free(pool C.int64_t, ptr C.uintptr_t, size C.size_t, device C.int, stream C.uintptr_t) C.int {
	e, err := registry.Get(int64(pool))
	if err != nil {
		registry.SetOrphanError(fmt.Errorf("gmp_pool_free: %w", err))
		return -1
	}
	return entryFree(e, "gmp_pool_free", ptr)
}

// copyCString writes msg into buf (n bytes) as a NUL-terminated string,
// truncated like snprintf but never inside a UTF-8 sequence (the text
// becomes a Python str), and returns len(msg).
func copyCString(msg string, buf *C.char, n C.size_t) C.size_t {
	if buf != nil && n > 0 {
		k := len(msg)
		if uint64(k) > uint64(n)-1 {
			k = int(uint64(n) - 1)
			for k > 0 && !utf8.RuneStart(msg[k]) {
				k--
			}
		}
		dst := unsafe.Slice((*byte)(unsafe.Pointer(buf)), k+1)
		copy(dst, msg[:k])
		dst[k] = 0
	}
	return C.size_t(len(msg))
}

// takeLastError returns and clears the last error of pool (for pool 0, of
// calls no pool owned); for a handle of no pool, that is the error.
func takeLastError(pool C.int64_t) error {
	if pool == 0 {
		return registry.TakeOrphanError()
	}
	e, err := registry.Get(int64(pool))
	if err != nil {
		return err
	}
	return e.TakeError()
}

// gmpgo_last_error (in C gmp_last_error, exports.c, which first refuses a
// forked child) copies the last error of pool (or, for pool 0, of calls no
// pool owned) into buf as a NUL-terminated string, clears it, and returns
// its full length (0 when there was none). Like snprintf, it writes at most
// n bytes.
//
//export gmpgo_last_error
func gmpgo_last_error(pool C.int64_t, buf *C.char, n C.size_t) C.size_t {
	var msg string
	if err := takeLastError(pool); err != nil {
		msg = err.Error()
	}
	return copyCString(msg, buf, n)
}

// gmpgo_last_error_value (in C gmp_last_error_value, exports.c, which first
// refuses a forked child) is gmp_last_error as the structured value every
// error crosses to Python as (package pyerr: kind, message, fields, in
// JSON), "" when there was none. A message too long for n bytes is
// shortened so that the value still decodes; it returns the length written.
//
//export gmpgo_last_error_value
func gmpgo_last_error_value(pool C.int64_t, buf *C.char, n C.size_t) C.size_t {
	var value string
	if err := takeLastError(pool); err != nil {
		value = pyerr.Of(err).JSONWithin(int(n))
	}
	return copyCString(value, buf, n)
}
