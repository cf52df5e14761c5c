// Package testalloc provides C allocator functions with torch's pluggable
// signatures for the callback backend's tests (cgo is not allowed in
// _test.go files). The functions use aligned_alloc and count their calls;
// failures can be injected.
package testalloc

/*
#include <stdlib.h>
#include <stdint.h>

static long gmp_test_allocs, gmp_test_frees, gmp_test_fail_after = -1;
static long gmp_test_live_bytes;
static void* gmp_test_last_stream;
static int gmp_test_last_device;

static void* gmp_test_alloc(size_t size, int device, void* stream) {
	if (gmp_test_fail_after >= 0 && gmp_test_allocs >= gmp_test_fail_after) return NULL;
	void* p = aligned_alloc(512, (size + 511) / 512 * 512);
	if (!p) return NULL;
	gmp_test_allocs++;
	gmp_test_live_bytes += (long)size;
	gmp_test_last_stream = stream;
	gmp_test_last_device = device;
	return p;
}

static void gmp_test_free(void* p, size_t size, int device, void* stream) {
	gmp_test_frees++;
	gmp_test_live_bytes -= (long)size;
	free(p);
}

// Returns the same address twice: a broken allocator.
static char gmp_test_static_buf[4096] __attribute__((aligned(512)));
static void* gmp_test_alloc_same(size_t size, int device, void* stream) { return gmp_test_static_buf; }
static void gmp_test_free_nothing(void* p, size_t size, int device, void* stream) {}

static uintptr_t gmp_test_alloc_addr(void) { return (uintptr_t)gmp_test_alloc; }
static uintptr_t gmp_test_free_addr(void) { return (uintptr_t)gmp_test_free; }
static uintptr_t gmp_test_alloc_same_addr(void) { return (uintptr_t)gmp_test_alloc_same; }
static uintptr_t gmp_test_free_nothing_addr(void) { return (uintptr_t)gmp_test_free_nothing; }
static void gmp_test_reset(long fail_after) {
	gmp_test_allocs = gmp_test_frees = gmp_test_live_bytes = 0;
	gmp_test_fail_after = fail_after;
}
static long gmp_test_get(int what) {
	switch (what) {
	case 0: return gmp_test_allocs;
	case 1: return gmp_test_frees;
	case 2: return gmp_test_live_bytes;
	case 3: return (long)(uintptr_t)gmp_test_last_stream;
	default: return gmp_test_last_device;
	}
}
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
func Reset(failAfter int) { C.gmp_test_reset(C.long(failAfter)) }

// Counters reports allocations, frees and live bytes so far.
func Counters() (allocs, frees, liveBytes int64) {
	return int64(C.gmp_test_get(0)), int64(C.gmp_test_get(1)), int64(C.gmp_test_get(2))
}

// Last reports the stream and device of the last successful allocation.
func Last() (stream uint64, device int) {
	return uint64(C.gmp_test_get(3)), int(C.gmp_test_get(4))
}
