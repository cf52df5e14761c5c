// Package nccl is a gocore.Backend named "nccl" whose segments come from
// NCCL's ncclMemAlloc/ncclMemFree (NCCL >= 2.19): memory that NVLS
// reductions and user-buffer registration (ncclCommRegister) can use.
//
// libnccl is opened at run time with dlopen by package libnccl, the only
// package of the NCCL side with cgo, so that this one is plain Go and
// builds without CUDA, NCCL or cgo.
//
// ncclMemAlloc allocates on the CUDA device current on the calling OS
// thread. A goroutine may change threads between cgo calls and CUDA contexts
// are per thread, so one C call pushes the device's primary context (from a
// ContextSource), calls NCCL and pops it. Stream ordering is CUDA events'
// business: the backend embeds an EventSource (in production the cuda
// backend), whose event methods and capacity are the backend's.
package nccl

import (
	"errors"
	"fmt"
	"time"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/internal/segtrack"
	"github.com/gpumempool/gpumempool/gocore/nccl/libnccl"
)

// ContextSource gives the primary CUDA context of a device and the addresses of
// cuCtxPushCurrent_v2 / cuCtxPopCurrent_v2, so that one C call can push the
// context, call NCCL and pop it (a goroutine may change OS threads between cgo
// calls, and CUDA contexts are per thread).
//
// The functions must have the driver's signatures:
//
//	CUresult cuCtxPushCurrent(CUcontext ctx);
//	CUresult cuCtxPopCurrent(CUcontext* pctx);
type ContextSource interface {
	ContextFuncs(dev int) (ctx, push, pop uintptr, err error)
}

// CaptureModeSource is optionally implemented by a ContextSource (the cuda
// package's Driver does): the address of cuThreadExchangeStreamCaptureMode,
// 0 when the driver lacks it, so that ncclMemAlloc runs in the relaxed
// stream-capture mode and is not refused while another thread records a
// CUDA graph.
//
//	CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode* mode);
type CaptureModeSource interface {
	CaptureModeFunc() uintptr
}

// EventSource provides the device count, capacity and CUDA events of the
// devices NCCL allocates on. The cuda backend implements it.
type EventSource interface {
	Devices() int
	Capacity(device int) (total, free uint64, err error)
	gocore.EventSource
	gocore.EventSynchronizer
}

// deviceEvents is EventSource under the name the Backend embeds it by (an
// unexported field, whose methods Backend promotes).
type deviceEvents = EventSource

// Segment is a live allocation of the backend, for registering buffers with
// NCCL communicators (ncclCommRegister takes an address and a size).
type Segment struct {
	Device int    `json:"device"`
	Addr   uint64 `json:"addr"`
	Size   uint64 `json:"size"`
}

// Alignment is what the backend guarantees and checks on every segment.
// ncclMemAlloc reserves its address range at the allocation granularity
// (2 MiB on current GPUs), but falls back to cudaMalloc when the cuMem API is
// unavailable; 512 bytes is what the engine rounds to and what cudaMalloc
// gives in practice, so it is claimed and verified rather than assumed.
const Alignment = 512

// Backend allocates segments with ncclMemAlloc. It is safe for concurrent
// use; NCCL calls run without the backend's lock.
type Backend struct {
	deviceEvents // Capacity and the event methods (gocore.EventSynchronizer too)
	lib          *libnccl.Lib
	ctx          ContextSource
	devices      int
	live         *segtrack.Table // the segments allocated and not freed
}

var (
	_ gocore.Backend           = (*Backend)(nil)
	_ gocore.EventSynchronizer = (*Backend)(nil) // ncclMemFree does not wait for other streams' work
)

// NewBackend returns a backend over lib. events is required. ctx may be nil:
// then no context is pushed, the caller guarantees that device 0's context is
// current on whatever thread the pool calls from (e.g. a single-GPU process
// where torch made it current everywhere), and only device 0 is served
// (Devices reports at most 1).
func NewBackend(lib *libnccl.Lib, ctx ContextSource, events EventSource) (*Backend, error) {
	if lib == nil {
		return nil, fmt.Errorf("nccl backend: no library (see libnccl.Load): %w", gocore.ErrInvalidArgument)
	}
	if events == nil {
		return nil, fmt.Errorf("nccl backend: no event source: %w", gocore.ErrInvalidArgument)
	}
	n := events.Devices()
	if n <= 0 {
		return nil, fmt.Errorf("nccl backend: event source reports %d devices: %w", n, gocore.ErrInvalidArgument)
	}
	if ctx == nil {
		n = 1
	}
	return &Backend{deviceEvents: events, lib: lib, ctx: ctx, devices: n, live: segtrack.New("nccl backend")}, nil
}

// Name returns "nccl".
func (b *Backend) Name() string { return "nccl" }

// Lib returns the library the backend calls.
func (b *Backend) Lib() *libnccl.Lib { return b.lib }

// Devices is the event source's device count, or 1 without a ContextSource
// (it hides the event source's own).
func (b *Backend) Devices() int { return b.devices }

// Alignment returns the package's Alignment.
func (b *Backend) Alignment() uint64 { return Alignment }

// Alloc calls ncclMemAlloc with device's context current. The memory is
// usable on any stream once it returns (ncclMemAlloc is synchronous), so
// stream is not used. A failure that may be for lack of memory
// (Error.OutOfMemory: NCCL has no OOM code, so its logged warning decides
// where there is one) wraps gocore.ErrBackendOutOfMemory so that the engine
// releases its cache and retries; every NCCL failure wraps an *Error with
// NCCL's text, code and warning.
func (b *Backend) Alloc(device int, size uint64, stream gocore.Stream) (uint64, error) {
	dc, err := b.deviceCtx("alloc", device)
	if err != nil {
		return 0, err
	}
	r := b.lib.MemAlloc(dc, size)
	if err := b.callError("ncclMemAlloc", device, size, r); err != nil {
		var nerr *libnccl.Error
		if errors.As(err, &nerr) && nerr.OutOfMemory() {
			return 0, fmt.Errorf("%w: %w", err, gocore.ErrBackendOutOfMemory)
		}
		return 0, err
	}
	if r.Ptr == 0 {
		return 0, fmt.Errorf("nccl backend: ncclMemAlloc(%d bytes) on device %d returned NULL with ncclSuccess", size, device)
	}
	if r.Ptr%Alignment != 0 {
		// Hand it back rather than let the engine break its alignment
		// promise; ignore a failure there, the report below matters more.
		b.lib.MemFree(dc, r.Ptr)
		return 0, fmt.Errorf("nccl backend: ncclMemAlloc(%d bytes) on device %d returned %#x, not aligned to %d bytes",
			size, device, r.Ptr, Alignment)
	}
	// An address whose Free is in flight is fair game: NCCL may hand it
	// out again as soon as ncclMemFree returns, before that Free takes the
	// lock to forget it (it then leaves this new entry alone).
	if !b.live.Add(segtrack.Segment{Device: device, Addr: r.Ptr, Size: size}) {
		// NCCL handed out memory we still hold: never free it twice.
		return 0, fmt.Errorf("nccl backend: ncclMemAlloc(%d bytes) on device %d returned %#x, which is still allocated",
			size, device, r.Ptr)
	}
	return r.Ptr, nil
}

// Free waits for the work queued on stream, then calls ncclMemFree with
// device's context current. The wait is there because ncclMemFree unmaps
// cuMem memory, which unlike cudaFree does not wait for kernels still using
// it (torch synchronizes before unmapping for the same reason); like
// cudaFree's synchronization it blocks the caller, pool lock included, and
// only segment frees pay it. The segment must be live with that device and
// size. On any error the segment stays
// allocated and the engine keeps it cached.
func (b *Backend) Free(device int, addr, size uint64, stream gocore.Stream) error {
	return b.live.Free(device, addr, size, func() error { return b.free(device, addr, size, stream) })
}

func (b *Backend) free(device int, addr, size uint64, stream gocore.Stream) error {
	if err := b.waitStream(device, stream); err != nil {
		return fmt.Errorf("nccl backend: free %#x (%d bytes) on device %d: %w", addr, size, device, err)
	}
	dc, err := b.deviceCtx("free", device)
	if err != nil {
		return err
	}
	r := b.lib.MemFree(dc, addr)
	if r.Push == 0 && r.NCCL == libnccl.Success {
		// Freed, even if the pop failed: reporting an error would make the
		// engine keep using memory that is gone.
		return nil
	}
	return b.callError("ncclMemFree", device, size, r)
}

// waitStream blocks until the work queued so far on stream has completed.
// EventSource has no blocking wait, so it polls with a backoff that stays
// short: a free usually waits for at most the last kernel.
func (b *Backend) waitStream(device int, stream gocore.Stream) error {
	ev, err := b.deviceEvents.NewEvent(device)
	if err != nil {
		return fmt.Errorf("create event to wait for stream %#x: %w", uint64(stream), err)
	}
	// The event only served this wait: a failure to destroy it leaks an
	// event, which must not keep the segment from being freed.
	defer func() { _ = b.deviceEvents.DestroyEvent(ev) }()
	if err := b.deviceEvents.RecordEvent(ev, stream); err != nil {
		return fmt.Errorf("record event on stream %#x: %w", uint64(stream), err)
	}
	for delay := time.Microsecond; ; delay = min(2*delay, time.Millisecond) {
		done, err := b.deviceEvents.QueryEvent(ev)
		if err != nil {
			return fmt.Errorf("wait for stream %#x: %w", uint64(stream), err)
		}
		if done {
			return nil
		}
		time.Sleep(delay)
	}
}

// deviceCtx checks device and gets what makes it current.
func (b *Backend) deviceCtx(op string, device int) (libnccl.DeviceContext, error) {
	if device < 0 || device >= b.devices {
		why := ""
		if b.ctx == nil {
			why = " (no ContextSource: only device 0)"
		}
		return libnccl.DeviceContext{}, fmt.Errorf("nccl backend: %s on device %d: out of range [0, %d)%s: %w",
			op, device, b.devices, why, gocore.ErrInvalidDevice)
	}
	if b.ctx == nil {
		return libnccl.DeviceContext{}, nil
	}
	ctx, push, pop, err := b.ctx.ContextFuncs(device)
	if err != nil {
		return libnccl.DeviceContext{}, fmt.Errorf("nccl backend: %s on device %d: get CUDA context: %w", op, device, err)
	}
	if ctx == 0 || push == 0 || pop == 0 {
		return libnccl.DeviceContext{}, fmt.Errorf("nccl backend: %s on device %d: context source gave ctx=%#x push=%#x pop=%#x: %w",
			op, device, ctx, push, pop, gocore.ErrInvalidArgument)
	}
	c := libnccl.DeviceContext{Ctx: ctx, Push: push, Pop: pop}
	if cm, ok := b.ctx.(CaptureModeSource); ok {
		c.Exchange = cm.CaptureModeFunc()
	}
	return c, nil
}

// callError describes a failed push/NCCL/pop round trip, or returns nil.
func (b *Backend) callError(fn string, device int, size uint64, r libnccl.CallResult) error {
	switch {
	case r.Push != 0:
		return fmt.Errorf("nccl backend: %s(%d bytes) on device %d: cuCtxPushCurrent failed with CUresult %d",
			fn, size, device, r.Push)
	case r.NCCL != libnccl.Success:
		return fmt.Errorf("nccl backend: %d bytes on device %d: %w",
			size, device, &libnccl.Error{Func: fn, Code: r.NCCL, Text: b.lib.ErrorString(r.NCCL), Detail: r.Last})
	case r.Pop != 0:
		return fmt.Errorf("nccl backend: %s(%d bytes) on device %d: cuCtxPopCurrent failed with CUresult %d",
			fn, size, device, r.Pop)
	}
	return nil
}

// Segments lists the live segments by device and address: what a caller
// registers with NCCL communicators (ncclCommRegister) to get zero-copy
// collectives on pool memory.
func (b *Backend) Segments() []Segment {
	live := b.live.Segments()
	out := make([]Segment, 0, len(live))
	for _, s := range live {
		out = append(out, Segment(s))
	}
	return out
}
