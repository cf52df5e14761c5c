// Package testalloc provides C allocator functions with torch's pluggable
// signatures for the callback backend's tests (cgo is not allowed in
// _test.go files). The functions use aligned_alloc and count their calls;
// failures can be injected.
package testalloc

/*
// The counting allocator is the one the Python tests use.
#include "../../../../tests/csrc/testalloc.c"

// Returns the same address twice: a broken allocator.
static char gmp_test_static_buf[4096] __attribute__((aligned(512)));
static void* gmp_test_alloc_same(size_t size, int device, void* stream) { return gmp_test_static_buf; }
static void gmp_test_free_nothing(void* p, size_t size, int device, void* stream) {}

static uintptr_t gmp_test_alloc_addr(void) { return (uintptr_t)test_alloc; }
static uintptr_t gmp_test_free_addr(void) { return (uintptr_t)test_free; }
static uintptr_t gmp_test_alloc_same_addr(void) { return (uintptr_t)gmp_test_alloc_same; }
static uintptr_t gmp_test_free_nothing_addr(void) { return (uintptr_t)gmp_test_free_nothing; }
*/
import "C"

// Alloc and Free are the addresses of the counting malloc-backed functions.
func Alloc() uintptr { return uintptr(C.gmp_test_alloc_addr()) }

// Free is the address of the matching free function.
func Free() uintptr { return uintptr(C.gmp_test_free_addr()) }

// AllocSame returns the address of a broken alloc that always returns the
// same buffer; FreeNothing the address of a free that does nothing.
func AllocSame() uintptr { return uintptr(C.gmp_test_alloc_same_addr()) }

// FreeNothing is the no-op free paired with AllocSame.
func FreeNothing() uintptr { return uintptr(C.gmp_test_free_nothing_addr()) }

// Reset zeroes the counters; alloc returns NULL once failAfter allocations
// have succeeded (failAfter < 0: never).
func Reset(failAfter int) { C.test_reset(C.long(failAfter)) }

// Counters reports allocations, frees and live bytes so far.
func Counters() (allocs, frees, liveBytes int64) {
	return int64(C.test_allocs()), int64(C.test_frees()), int64(C.test_live_bytes())
}

// Last reports the stream and device of the last successful allocation.
func Last() (stream uint64, device int) {
	return uint64(uintptr(C.test_last_stream())), int(C.test_last_device())
}
