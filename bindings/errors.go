package bindings

import (
	"errors"
	"fmt"
	"runtime/debug"

	"github.com/gpumempool/gpumempool/bindings/registry"
)

// errorKind names the Python exception for err. gopy raises every Go error
// as RuntimeError with the error's text; the Python layer reads this prefix
// to raise the right subclass.
func errorKind(err error) string { return registry.Kind(err) }

// kindError carries the Python exception name in front of the message.
type kindError struct{ err error }

func (k kindError) Error() string { return errorKind(k.err) + ": " + k.err.Error() }
func (k kindError) Unwrap() error { return k.err }

// guard turns a panic into an error and prefixes every error with its kind.
// Deferred by every exported function.
func guard(err *error) {
	if r := recover(); r != nil {
		*err = fmt.Errorf("gpumempool internal error (Go panic recovered): %v\n%s", r, debug.Stack())
	}
	if *err != nil {
		var k kindError
		if !errors.As(*err, &k) {
			*err = kindError{*err}
		}
	}
}

// okOf is the result of a binding that has nothing to return but an error.
// gopy (errorGoToPy) gives such a function a C string result that nobody
// frees, about 32 bytes a call, so every binding returns a value: ok, true
// when err is nil.
func okOf(err error) (bool, error) { return err == nil, err }
