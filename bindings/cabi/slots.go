package cabi

/*
#include <stddef.h>
#include <stdint.h>
*/
import "C"

// The Go side of every registry slot's C entry points (GMP_SLOT_ENTRY_POINTS
// in exports.h, instantiated per slot in zz_slots.c). C has no closures, so
// each slot needs C functions of its own, named by its number, for torch to
// find with dlsym; they pass the number on, and Go needs one function per
// kind rather than one per slot.

//export gmpgo_alloc
func gmpgo_alloc(slot C.int, size C.size_t, device C.int, stream C.uintptr_t) C.uintptr_t {
	addr, _ := slotAlloc(int(slot), size, device, stream)
	return addr
}

//export gmpgo_segment_alloc
func gmpgo_segment_alloc(slot C.int, size C.size_t, device C.int, stream C.uintptr_t) C.uintptr_t {
	addr, _ := slotAllocSegment(int(slot), size, device, stream)
	return addr
}

//export gmpgo_free
func gmpgo_free(slot C.int, ptr C.uintptr_t, size C.size_t, device C.int, stream C.uintptr_t) {
	slotFree(int(slot), ptr)
}

//export gmpgo_init
func gmpgo_init(slot C.int, deviceCount C.int) {
	slotInit(int(slot), deviceCount)
}

//export gmpgo_empty_cache
func gmpgo_empty_cache(slot C.int) {
	slotEmptyCache(int(slot))
}

//export gmpgo_memory_fraction
func gmpgo_memory_fraction(slot C.int, fraction C.double, device C.int) {
	slotMemoryFraction(int(slot), fraction, device)
}

//export gmpgo_record_stream
func gmpgo_record_stream(slot C.int, ptr, stream C.uintptr_t) {
	slotRecordStream(int(slot), ptr, stream)
}

//export gmpgo_base_alloc
func gmpgo_base_alloc(slot C.int, ptr C.uintptr_t, size *C.size_t) C.uintptr_t {
	return slotBaseAlloc(int(slot), ptr, size)
}
