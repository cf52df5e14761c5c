// C side of hook.go (a file of its own: a cgo preamble next to //export may
// only declare).
#include <stddef.h>
#include <stdint.h>

#include "_cgo_export.h"

static char gmp_test_misaligned_buf[4096] __attribute__((aligned(512)));

static void* gmp_test_misaligned_alloc(size_t size, int device, void* stream) {
	(void)size; (void)device; (void)stream;
	return gmp_test_misaligned_buf + 8;
}

static void gmp_test_hook_free(void* p, size_t size, int device, void* stream) {
	(void)size; (void)device; (void)stream;
	gmpTestFreeHook((uintptr_t)p);
}

uintptr_t gmp_test_misaligned_alloc_addr(void) { return (uintptr_t)gmp_test_misaligned_alloc; }
uintptr_t gmp_test_hook_free_addr(void) { return (uintptr_t)gmp_test_hook_free; }
