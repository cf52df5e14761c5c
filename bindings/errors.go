package bindings

import (
	"fmt"
	"runtime/debug"

	"github.com/gpumempool/gpumempool/bindings/pyerr"
	"github.com/gpumempool/gpumempool/bindings/registry"
	"github.com/gpumempool/gpumempool/gocore"
)

// guard turns a panic into an error and every error into the value that
// crosses to Python (pyerr: gopy raises an error as RuntimeError with its
// text, which is then the value's JSON). Deferred by every exported
// function.
func guard(err *error) {
	if r := recover(); r != nil {
		*err = fmt.Errorf("gpumempool internal error (Go panic recovered): %v\n%s", r, debug.Stack())
	}
	*err = pyerr.Wrap(*err)
}

// withEntry runs work on the pool behind handle id, under guard: the one
// way an entry point reaches a pool.
func withEntry[T any](id int64, work func(e *registry.Entry) (T, error)) (out T, err error) {
	defer guard(&err)
	e, err := registry.Get(id)
	if err != nil {
		return out, err
	}
	return work(e)
}

// withEntryOK is withEntry for work with nothing to return but an error
// (see okOf).
func withEntryOK(id int64, work func(e *registry.Entry) error) (bool, error) {
	return withEntry(id, func(e *registry.Entry) (bool, error) {
		err := work(e)
		return err == nil, err
	})
}

// okOf is the result of a binding that has nothing to return but an error.
// gopy (errorGoToPy) gives such a function a C string result that nobody
// frees, about 32 bytes a call, so every binding returns a value: ok, true
// when err is nil.
func okOf(err error) (bool, error) { return err == nil, err }

// ErrorKinds lists, as JSON, the kinds of error that cross to Python
// (pyerr.Kinds): gpumempool's tests check that it has a class for each.
func ErrorKinds() (js string, err error) {
	defer guard(&err)
	return marshal(pyerr.Kinds())
}

// FailedRequest is what an out-of-memory error of pool says it could not
// do - pool "name" could not allocate 20.00 MiB on device 0 - in the
// engine's own words: the name quoted as its messages quote it (Go's %q,
// with Go's Unicode tables, not Python's) and the size as gocore.FormatBytes
// writes it. Python text that names a failed request asks here rather than
// copying either rule.
func FailedRequest(pool string, requested uint64, device int64) (text string, err error) {
	defer guard(&err)
	return fmt.Sprintf("pool %q could not allocate %s on device %d", pool, gocore.FormatBytes(requested), device), nil
}
