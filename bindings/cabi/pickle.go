package cabi

/*
#include <stddef.h>
#include <stdint.h>
*/
import "C"

import (
	"errors"
	"unsafe"

	"github.com/gpumempool/gpumempool/internal/picklescan"
)

// Results of gmp_pickle_scan.
const (
	pickleOK        = 0
	pickleRefused   = 1
	pickleTruncated = 2
	pickleFailed    = 3 // a Go panic, recovered; the message is in why
)

// gmpgo_pickle_scan (in C gmp_pickle_scan, exports.c, which first refuses a forked child) checks the pickle in data[0:n] before Python unpickles it
// (picklescan.Scan; gpumempool's loader of snapshots calls it through
// gpumempool._fastcall). It returns 0 when the pickle may be unpickled, 1
// when it is refused (the reason in why, NUL-terminated, at most why_len
// bytes), 2 when it is truncated, 3 when the scan itself failed. *ops and
// *pos receive where (picklescan.Error). For a pickle it accepts, *nodes and
// *depth receive the bound of picklescan.Shape, or *depth = -1 when it has
// none. data is only read, and not kept.
//
//export gmpgo_pickle_scan
func gmpgo_pickle_scan(data *C.uint8_t, n C.size_t, maxDepth C.int64_t, ops, pos *C.int64_t, why *C.char, whyLen C.size_t,
	nodes *C.uint64_t, depth *C.int64_t) C.int {
	*nodes, *depth = 0, -1
	err := panicFree(func() error {
		var buf []byte
		if n > 0 {
			buf = unsafe.Slice((*byte)(unsafe.Pointer(data)), int(n))
		}
		shape, err := picklescan.ScanShape(buf, int(maxDepth))
		if err == nil && shape.Known {
			*nodes, *depth = C.uint64_t(shape.Nodes), C.int64_t(shape.Depth)
		}
		return err
	})
	if err == nil {
		return pickleOK
	}
	var e *picklescan.Error
	if !errors.As(err, &e) { // a panic, recovered
		copyCString(err.Error(), why, whyLen)
		return pickleFailed
	}
	*ops, *pos = C.int64_t(e.Ops), C.int64_t(e.Pos)
	if e.Truncated {
		return pickleTruncated
	}
	copyCString(e.Why, why, whyLen)
	return pickleRefused
}
