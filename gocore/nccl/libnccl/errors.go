package libnccl

import (
	"errors"
	"fmt"
	"strings"

	"github.com/gpumempool/gpumempool/gocore"
)

var (
	// ErrNoNCCL is wrapped when no libnccl can be found or the file found
	// is not NCCL.
	ErrNoNCCL = errors.New("libnccl not found")
	// ErrTooOld is wrapped when the NCCL found has no ncclMemAlloc
	// (NCCL < 2.19).
	ErrTooOld = errors.New("NCCL too old")
	// ErrConflict is wrapped when the library asked for ($GMP_LIBNCCL or a
	// path) is not the NCCL the process has loaded already: a second copy of
	// NCCL is not loaded next to it.
	ErrConflict = errors.New("another NCCL is already loaded in this process")
)

// Result is an ncclResult_t.
type Result int

// The ncclResult_t values of nccl.h.
const (
	Success            Result = 0 // ncclSuccess
	UnhandledCudaError Result = 1 // ncclUnhandledCudaError
	SystemError        Result = 2 // ncclSystemError
	InternalError      Result = 3 // ncclInternalError
	InvalidArgument    Result = 4 // ncclInvalidArgument
	InvalidUsage       Result = 5 // ncclInvalidUsage
	RemoteError        Result = 6 // ncclRemoteError
	InProgress         Result = 7 // ncclInProgress
)

var resultNames = [...]string{
	"ncclSuccess", "ncclUnhandledCudaError", "ncclSystemError", "ncclInternalError",
	"ncclInvalidArgument", "ncclInvalidUsage", "ncclRemoteError", "ncclInProgress",
}

// String is the enumerator's name in nccl.h, e.g. "ncclSystemError".
func (r Result) String() string {
	if r >= 0 && int(r) < len(resultNames) {
		return resultNames[r]
	}
	return fmt.Sprintf("ncclResult_t(%d)", int(r))
}

// Error is a failed NCCL call. Backend errors wrap it: use errors.As to get
// the code.
type Error struct {
	Func string // the NCCL function, e.g. "ncclMemAlloc"
	Code Result
	Text string // ncclGetErrorString(Code)
	// Detail is the warning NCCL logged for this failure (ncclGetLastError,
	// e.g. "Cuda failure 2 'out of memory'"), or "" when it logged none.
	Detail string
}

// Error reads like "ncclMemAlloc: unhandled cuda error (...) [ncclUnhandledCudaError = 1]",
// followed by ": " and the Detail when there is one.
func (e *Error) Error() string {
	msg := fmt.Sprintf("%s: %s [%s = %d]", e.Func, e.Text, e.Code, int(e.Code))
	if e.Detail != "" {
		msg += ": " + e.Detail
	}
	return msg
}

// OutOfMemory reports whether the failure may be for lack of memory. With
// NCCL's own warning at hand, a CUDA failure is one only when the warning
// says so (a sticky error after a kernel fault is not, and releasing the
// cache would not help); without it, see Result.outOfMemory.
func (e *Error) OutOfMemory() bool {
	if e.Code == UnhandledCudaError && e.Detail != "" {
		return strings.Contains(strings.ToLower(e.Detail), "out of memory")
	}
	return e.Code.outOfMemory()
}

// outOfMemory reports whether a failed ncclMemAlloc may be for lack of
// memory. NCCL has no out-of-memory code: a failed cuMemCreate or cudaMalloc
// comes back as ncclUnhandledCudaError, a failed host allocation as
// ncclSystemError. Treating both as OOM lets the engine release its cache
// and retry; at worst a different CUDA failure is retried once.
func (r Result) outOfMemory() bool { return r == UnhandledCudaError || r == SystemError }

// errNoCgo is what Load fails with when the package was built without cgo
// (zz_nocgo.go).
var errNoCgo = fmt.Errorf("nccl: gpumempool was built without cgo (CGO_ENABLED=0), which loading libnccl needs: %w",
	gocore.ErrUnsupported)
