package driver

import (
	"errors"
	"fmt"

	"github.com/gpumempool/gpumempool/gocore"
)

// ErrNoDriver is wrapped by Load when the driver library cannot be found:
// the machine has no NVIDIA driver (or GMP_LIBCUDA names a missing file).
var ErrNoDriver = errors.New("libcuda.so.1 not found (no NVIDIA driver?)")

// ErrDriverClosed is wrapped by every method of a Driver after Close.
var ErrDriverClosed = errors.New("cuda driver is closed")

// ErrDriverTooOld is wrapped when the loaded driver lacks an entry point:
// by Load for a required one, and by the stream-ordered allocator and VMM
// methods for theirs ("driver too old: cuMemPoolCreate missing"); and when
// an option needs a newer CUDA version than the driver supports (see
// Driver.Version). It also
// matches gocore.ErrUnsupported, so callers can fall back to another
// backend with one errors.Is check.
var ErrDriverTooOld error = driverTooOld{}

type driverTooOld struct{}

// Error returns "driver too old".
func (driverTooOld) Error() string { return "driver too old" }

// Is makes errors.Is(ErrDriverTooOld, gocore.ErrUnsupported) true.
func (driverTooOld) Is(target error) bool { return target == gocore.ErrUnsupported }

// Error is a CUresult other than CUDA_SUCCESS returned by a driver entry
// point.
type Error struct {
	// Op is the entry point that failed, e.g. "cuMemAlloc_v2". It names the
	// context push or pop when those failed rather than the operation.
	Op string
	// Code is the CUresult.
	Code int
	// Name is the driver's name for Code (cuGetErrorName), or "" when the
	// driver does not know it.
	Name string
}

// Error formats e like "cuMemAlloc_v2: CUDA_ERROR_OUT_OF_MEMORY (2)".
func (e *Error) Error() string {
	name := e.Name
	if name == "" {
		name = "CUDA error"
	}
	return fmt.Sprintf("%s: %s (%d)", e.Op, name, e.Code)
}

// Is maps driver codes onto the engine's sentinels: CUDA_ERROR_OUT_OF_MEMORY
// matches gocore.ErrBackendOutOfMemory (so a pool releases its cache and
// retries), CUDA_ERROR_INVALID_DEVICE matches gocore.ErrInvalidDevice and
// CUDA_ERROR_NOT_SUPPORTED matches gocore.ErrUnsupported.
func (e *Error) Is(target error) bool {
	switch target {
	case gocore.ErrBackendOutOfMemory:
		return e.Code == CodeOutOfMemory
	case gocore.ErrInvalidDevice:
		return e.Code == CodeInvalidDevice
	case gocore.ErrUnsupported:
		return e.Code == CodeNotSupported
	}
	return false
}

// errNoCgo is what every entry of the package fails with when it was built
// without cgo (zz_nocgo.go): Load, and so every backend over it.
var errNoCgo = fmt.Errorf("cuda: gpumempool was built without cgo (CGO_ENABLED=0), which loading libcuda needs: %w",
	gocore.ErrUnsupported)
