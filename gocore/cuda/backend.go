package cuda

import (
	"fmt"
	"sync"

	"github.com/gpumempool/gpumempool/gocore"
)

// Alignment is what Backend and HostBackend guarantee for every address
// they return. CUDA documents at least 256 bytes for cuMemAlloc (the CUDA
// C++ Programming Guide: "any address ... returned by one of the memory
// allocation routines from the driver or runtime API is always aligned to
// at least 256 bytes"); drivers in practice return 512-byte (or coarser)
// aligned memory, and torch's allocator works in 512-byte units too. We
// promise 512 and check it on every allocation, so a driver that ever
// returned less fails loudly instead of breaking the promise. The engine
// only relies on it for segment bases: blocks are carved at 512-byte
// multiples from there.
const Alignment = 512

// Backend is a gocore.Backend over device memory from cuMemAlloc_v2. Its
// events are CUDA events created with CU_EVENT_DISABLE_TIMING on the
// device the pool asks for; each is recorded, queried and destroyed under
// that device's context. Streams are the caller's CUstream values (0: the
// legacy default stream). It is safe for concurrent use.
type Backend struct {
	drv     *Driver
	devices int

	mu     sync.Mutex
	events map[gocore.Event]int // live event -> its device
}

var _ gocore.Backend = (*Backend)(nil)

// NewBackend returns a Backend over drv's devices. It fails when drv is nil
// or sees no device.
func NewBackend(drv *Driver) (*Backend, error) {
	if drv == nil {
		return nil, fmt.Errorf("cuda backend: nil driver: %w", gocore.ErrInvalidArgument)
	}
	n, err := drv.DeviceCount()
	if err != nil {
		return nil, fmt.Errorf("cuda backend: %w", err)
	}
	if n == 0 {
		return nil, fmt.Errorf("cuda backend: the driver (%s) sees no CUDA device: %w", drv.Path(), gocore.ErrInvalidDevice)
	}
	return &Backend{drv: drv, devices: n, events: make(map[gocore.Event]int)}, nil
}

// Name returns "cuda".
func (b *Backend) Name() string { return "cuda" }

// Devices returns the number of devices the driver saw when b was made.
func (b *Backend) Devices() int { return b.devices }

// Alignment returns Alignment (512).
func (b *Backend) Alignment() uint64 { return Alignment }

// Driver returns the driver b allocates through.
func (b *Backend) Driver() *Driver { return b.drv }

func (b *Backend) checkDevice(op string, dev int) error {
	if dev < 0 || dev >= b.devices {
		return fmt.Errorf("cuda backend: %s: device %d out of range [0, %d): %w", op, dev, b.devices, gocore.ErrInvalidDevice)
	}
	return nil
}

// Capacity reports the device's total and free memory (cuMemGetInfo_v2).
func (b *Backend) Capacity(dev int) (total, free uint64, err error) {
	if err := b.checkDevice("capacity", dev); err != nil {
		return 0, 0, err
	}
	free, total, err = b.drv.MemGetInfo(dev)
	return total, free, err
}

// Alloc returns size bytes of device memory. cuMemAlloc is not stream
// ordered: the memory is usable on any stream of the device at once, so
// stream is not passed on. CUDA_ERROR_OUT_OF_MEMORY matches
// gocore.ErrBackendOutOfMemory.
func (b *Backend) Alloc(dev int, size uint64, stream gocore.Stream) (uint64, error) {
	if err := b.checkDevice("alloc", dev); err != nil {
		return 0, err
	}
	addr, err := b.drv.MemAlloc(dev, size)
	if err != nil {
		return 0, err
	}
	if addr%Alignment != 0 {
		// Not ours to keep: hand it back rather than break the promise.
		_ = b.drv.MemFree(dev, addr)
		return 0, fmt.Errorf("cuda backend: cuMemAlloc_v2 returned %#x, not aligned to %d bytes", addr, Alignment)
	}
	return addr, nil
}

// Free returns a segment from Alloc (cuMemFree_v2, which waits for the
// device's work on it to finish).
func (b *Backend) Free(dev int, addr, size uint64, stream gocore.Stream) error {
	if err := b.checkDevice("free", dev); err != nil {
		return err
	}
	return b.drv.MemFree(dev, addr)
}

// NewEvent creates an event on dev.
func (b *Backend) NewEvent(dev int) (gocore.Event, error) {
	if err := b.checkDevice("new event", dev); err != nil {
		return 0, err
	}
	ev, err := b.drv.EventCreate(dev)
	if err != nil {
		return 0, err
	}
	b.mu.Lock()
	b.events[gocore.Event(ev)] = dev
	b.mu.Unlock()
	return gocore.Event(ev), nil
}

func (b *Backend) eventDevice(op string, ev gocore.Event) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	dev, ok := b.events[ev]
	if !ok {
		return 0, fmt.Errorf("cuda backend: %s unknown event %#x: %w", op, uint64(ev), gocore.ErrInvalidArgument)
	}
	return dev, nil
}

// RecordEvent records ev on stream, a stream of the event's device.
func (b *Backend) RecordEvent(ev gocore.Event, stream gocore.Stream) error {
	dev, err := b.eventDevice("record", ev)
	if err != nil {
		return err
	}
	return b.drv.EventRecord(dev, uint64(ev), uint64(stream))
}

// QueryEvent reports whether the work captured by ev has completed.
func (b *Backend) QueryEvent(ev gocore.Event) (bool, error) {
	dev, err := b.eventDevice("query", ev)
	if err != nil {
		return false, err
	}
	return b.drv.EventQuery(dev, uint64(ev))
}

// SynchronizeEvent waits for the work captured by ev
// (gocore.EventSynchronizer).
func (b *Backend) SynchronizeEvent(ev gocore.Event) error {
	dev, err := b.eventDevice("synchronize", ev)
	if err != nil {
		return err
	}
	return b.drv.EventSynchronize(dev, uint64(ev))
}

// DestroyEvent destroys ev. The entry leaves the event table before
// cuEventDestroy: once the driver destroyed the event it may hand the same
// handle to a NewEvent on another thread, whose fresh entry a later delete
// would remove. Should cuEventDestroy fail, the event is still alive and its
// entry is put back.
func (b *Backend) DestroyEvent(ev gocore.Event) error {
	b.mu.Lock()
	dev, ok := b.events[ev]
	delete(b.events, ev)
	b.mu.Unlock()
	if !ok {
		return fmt.Errorf("cuda backend: destroy unknown event %#x: %w", uint64(ev), gocore.ErrInvalidArgument)
	}
	if err := b.drv.EventDestroy(dev, uint64(ev)); err != nil {
		b.mu.Lock()
		b.events[ev] = dev // still alive, so its handle cannot have been reused
		b.mu.Unlock()
		return err
	}
	return nil
}

// LiveEvents reports how many events b has created and not destroyed.
func (b *Backend) LiveEvents() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.events)
}
