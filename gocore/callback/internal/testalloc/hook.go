package testalloc

/*
#include <stdint.h>

uintptr_t gmp_test_misaligned_alloc_addr(void);
uintptr_t gmp_test_hook_free_addr(void);
*/
import "C"

import "sync"

var hook struct {
	sync.Mutex
	free func(ptr uintptr)
}

//export gmpTestFreeHook
func gmpTestFreeHook(ptr C.uintptr_t) {
	hook.Lock()
	f := hook.free
	hook.Unlock()
	if f != nil {
		f(uintptr(ptr))
	}
}

// SetFreeHook makes HookFree call f (nil: nothing) with the pointer freed.
func SetFreeHook(f func(ptr uintptr)) {
	hook.Lock()
	hook.free = f
	hook.Unlock()
}

// MisalignedAlloc is the address of an alloc that returns an address 8
// bytes past a 512-byte boundary (a static buffer); HookFree that of a free
// that calls the Go function set with SetFreeHook.
func MisalignedAlloc() uintptr { return uintptr(C.gmp_test_misaligned_alloc_addr()) }

// HookFree: see MisalignedAlloc.
func HookFree() uintptr { return uintptr(C.gmp_test_hook_free_addr()) }
