// Command cabifloor is built by benchmarks/cpu_bench.py as a C shared
// library (go build -buildmode=c-shared) whose two exports do nothing, with
// the signatures of the extension's torch entry points (gmp_alloc_N,
// gmp_free_N: torch's CUDAPluggableAllocator's alloc and free). A C caller
// timing a pair of calls into it measures what any C->Go exported call pair
// costs, the floor under the extension's cache-hit pair: the benchmark
// reports that pair as a multiple of this one, measured in the same run.
//
// It is not part of the extension: the benchmark builds it for itself.
package main

/*
#include <stddef.h>
#include <stdint.h>
*/
import "C"

// gmp_floor_alloc returns size as a non-zero "address" (a C caller checks for
// NULL), like gmpgo_alloc_N without the pool behind it.
//
//export gmp_floor_alloc
func gmp_floor_alloc(size C.size_t, device C.int, stream C.uintptr_t) C.uintptr_t {
	return C.uintptr_t(size)
}

// gmp_floor_free does nothing, with the signature of gmpgo_free_N.
//
//export gmp_floor_free
func gmp_floor_free(ptr C.uintptr_t, size C.size_t, device C.int, stream C.uintptr_t) {}

func main() {}
