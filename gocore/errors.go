package gocore

import (
	"errors"
	"fmt"
)

// Sentinel errors returned (wrapped, with context) by Pool methods. Test them
// with errors.Is.
var (
	// ErrClosed: the pool has been closed.
	ErrClosed = errors.New("pool is closed")
	// ErrInvalidSize: a size of zero, or one too large to ever be served.
	ErrInvalidSize = errors.New("invalid size")
	// ErrInvalidDevice: a device ordinal the backend does not serve.
	ErrInvalidDevice = errors.New("invalid device")
	// ErrInvalidArgument: any other malformed argument or configuration.
	ErrInvalidArgument = errors.New("invalid argument")
	// ErrUnknownPointer: the address is not inside any segment of the pool.
	ErrUnknownPointer = errors.New("pointer not owned by this pool")
	// ErrDoubleFree: the address is inside the pool but is not the start of
	// an allocated block, nor inside one: it was freed already.
	ErrDoubleFree = errors.New("pointer is not an allocated block (double free?)")
	// ErrInteriorPointer: the address is inside an allocated block (or one
	// whose free waits for other streams) but is not its start.
	ErrInteriorPointer = errors.New("pointer is inside an allocated block, not its start")
	// ErrOutOfMemory is matched (errors.Is) by every *OutOfMemoryError.
	ErrOutOfMemory = errors.New("out of memory")
)

// OutOfMemoryError is returned when an allocation cannot be served even after
// the pool released its cached segments and retried. It names every number a
// user needs to understand why.
type OutOfMemoryError struct {
	Pool      string // pool name
	Backend   string // backend name
	Device    int    // device ordinal
	Requested uint64 // bytes the caller asked for
	Segment   uint64 // bytes the pool tried to obtain from the backend
	Allocated uint64 // bytes allocated to callers on the device by this pool
	Reserved  uint64 // bytes reserved from the backend on the device by this pool
	Limit     uint64 // the pool's byte limit on the device, 0 when unlimited
	// SharedReserved is what the pools sharing the limit (Config.Budget:
	// the graphs' private pools of a pool torch uses) reserve on the device
	// together, this one included; 0 when the budget is the pool's alone.
	SharedReserved uint64
	// DeviceFree and DeviceTotal come from Backend.Capacity; both are 0 when
	// the backend cannot tell.
	DeviceFree, DeviceTotal uint64
	// Cause is the backend's error, or nil when the pool's limit was hit.
	Cause error
}

// Error formats the numbers the way torch's OutOfMemoryError does.
func (e *OutOfMemoryError) Error() string {
	limit := "none"
	if e.Limit > 0 {
		limit = FormatBytes(e.Limit)
	}
	msg := fmt.Sprintf("pool %q (%s backend) out of memory on device %d: tried to allocate %s "+
		"(segment of %s); pool has %s allocated, %s reserved, limit %s",
		e.Pool, e.Backend, e.Device, FormatBytes(e.Requested), FormatBytes(e.Segment),
		FormatBytes(e.Allocated), FormatBytes(e.Reserved), limit)
	if e.SharedReserved > 0 {
		msg += fmt.Sprintf(" (%s reserved by the pools sharing it)", FormatBytes(e.SharedReserved))
	}
	if e.DeviceTotal > 0 {
		msg += fmt.Sprintf("; device has %s free of %s", FormatBytes(e.DeviceFree), FormatBytes(e.DeviceTotal))
	}
	if e.Cause != nil {
		msg += ": " + e.Cause.Error()
	}
	return msg
}

// Is makes errors.Is(err, ErrOutOfMemory) true.
func (e *OutOfMemoryError) Is(target error) bool { return target == ErrOutOfMemory }

// Unwrap returns the backend's error.
func (e *OutOfMemoryError) Unwrap() error { return e.Cause }

// FormatBytes renders n with a binary unit, e.g. "20.00 MiB".
func FormatBytes(n uint64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := uint64(unit), 0
	for m := n / unit; m >= unit && exp < 5; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.2f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}
