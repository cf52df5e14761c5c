package cabi

/*
#include <stddef.h>
#include <stdint.h>
*/
import "C"

import (
	"github.com/gpumempool/gpumempool/bindings/pyerr"
	"github.com/gpumempool/gpumempool/bindings/registry"
	"github.com/gpumempool/gpumempool/gocore"
)

// The Python API's hot path. MemPool.alloc / free call these through a small
// C extension (gpumempool/csrc/_fastcall.c) instead of gopy's generated wrappers:
// a gopy call costs several hundred nanoseconds on its own (it releases and
// retakes the GIL and converts (value, error) results), more than the
// engine's cache hit. The error, if any, is written to buf as the value that
// crosses to Python (pyerr: kind, message, fields, as JSON), as gopy's
// wrappers carry it, so that concurrent failures in other threads cannot
// swap messages (the pool's last_error is per pool, not per call).

// pyFailure writes err for Python into buf (n bytes).
func pyFailure(err error, buf *C.char, n C.size_t) {
	copyCString(pyerr.Of(err).JSONWithin(int(n)), buf, n)
}

// gmpgo_py_alloc (in C gmp_py_alloc, exports.c, which first refuses a
// forked child) allocates like MemPool.alloc; 0 on failure, with the error
// in buf.
//
//export gmpgo_py_alloc
func gmpgo_py_alloc(handle C.int64_t, size C.uint64_t, device C.int, stream C.uintptr_t, buf *C.char, n C.size_t) C.uintptr_t {
	e, err := registry.Get(int64(handle))
	var addr uint64
	if err == nil {
		addr, err = allocRecovered(e, uint64(size), int(device), gocore.Stream(stream), false)
	}
	if err != nil {
		pyFailure(err, buf, n)
		return 0
	}
	return C.uintptr_t(addr)
}

// gmpgo_py_free (in C gmp_py_free, exports.c, which first refuses a forked
// child) frees like MemPool.free; 0 on success, -1 with the error in buf.
//
//export gmpgo_py_free
func gmpgo_py_free(handle C.int64_t, ptr C.uintptr_t, buf *C.char, n C.size_t) C.int {
	e, err := registry.Get(int64(handle))
	if err == nil {
		err = freeRecovered(e, uint64(ptr))
	}
	if err != nil {
		pyFailure(err, buf, n)
		return -1
	}
	return 0
}
