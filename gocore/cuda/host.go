package cuda

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"

	"github.com/gpumempool/gpumempool/gocore"
)

// HostBackend is a gocore.Backend over page-locked (pinned) host memory
// from cuMemHostAlloc, for staging buffers and torch's pinned-memory
// allocator. It serves one device, ordinal 0: the host. Everything runs
// under the context of one CUDA device, 0 unless NewHostBackendOn picks
// another: the memory is allocated and freed there (with HostAllocPortable
// it is pinned for every context), and its events are that device's CUDA
// events, so the streams passed to it must be that device's streams:
// recording an event on a stream of another device fails. No other
// device's context is created. It is safe for concurrent use.
type HostBackend struct {
	drv    *Driver
	flags  uint32
	device int // the CUDA device whose context is used

	mu     sync.Mutex
	events map[gocore.Event]struct{}
}

var _ gocore.Backend = (*HostBackend)(nil)

// NewHostBackend returns a HostBackend allocating with the given
// cuMemHostAlloc flags (HostAllocPortable, HostAllocDeviceMap,
// HostAllocWriteCombined); 0 means HostAllocPortable, so that the memory is
// pinned for every context, as torch's host allocator does. The driver must
// see at least one device; device 0's context holds the allocations and
// events (see NewHostBackendOn).
func NewHostBackend(drv *Driver, flags uint32) (*HostBackend, error) {
	return NewHostBackendOn(drv, flags, 0)
}

// NewHostBackendOn is NewHostBackend working under CUDA device device's
// context instead of device 0's: the device a process uses (e.g. a torchrun
// rank's cuda:LOCAL_RANK), so that no context is created on another GPU,
// and whose streams record the backend's events. An ordinal the driver does
// not see fails with an error wrapping gocore.ErrInvalidDevice.
func NewHostBackendOn(drv *Driver, flags uint32, device int) (*HostBackend, error) {
	if drv == nil {
		return nil, fmt.Errorf("host backend: nil driver: %w", gocore.ErrInvalidArgument)
	}
	if flags&^hostAllocAll != 0 {
		return nil, fmt.Errorf("host backend: unknown cuMemHostAlloc flags %#x: %w", flags&^hostAllocAll, gocore.ErrInvalidArgument)
	}
	if flags == 0 {
		flags = HostAllocPortable
	}
	n, err := drv.DeviceCount()
	if err != nil {
		return nil, fmt.Errorf("host backend: %w", err)
	}
	if n == 0 {
		return nil, fmt.Errorf("host backend: pinned memory needs a CUDA context and the driver (%s) sees no device: %w",
			drv.Path(), gocore.ErrInvalidDevice)
	}
	if device < 0 || device >= n {
		return nil, fmt.Errorf("host backend: CUDA device %d out of range [0, %d): %w", device, n, gocore.ErrInvalidDevice)
	}
	return &HostBackend{drv: drv, flags: flags, device: device, events: make(map[gocore.Event]struct{})}, nil
}

// CUDADevice returns the CUDA device whose context b works under.
func (b *HostBackend) CUDADevice() int { return b.device }

// Name returns "host".
func (b *HostBackend) Name() string { return "host" }

// Devices returns 1: the host.
func (b *HostBackend) Devices() int { return 1 }

// Alignment returns Alignment (512); cuMemHostAlloc returns page-aligned
// memory, and Alloc checks.
func (b *HostBackend) Alignment() uint64 { return Alignment }

// Flags returns the flags ptr's pinned allocation was made with
// (cuMemHostGetFlags); it fails for memory that is not pinned by the
// driver, so tests can prove that a pool's blocks are.
func (b *HostBackend) Flags(ptr uint64) (uint32, error) { return b.drv.memHostGetFlags(b.device, ptr) }

func (b *HostBackend) checkDevice(op string, dev int) error {
	if dev != 0 {
		return fmt.Errorf("host backend: %s: device %d: the host is device 0: %w", op, dev, gocore.ErrInvalidDevice)
	}
	return nil
}

// Capacity reports MemTotal and MemAvailable from /proc/meminfo: pinned
// memory comes out of ordinary RAM, and these are the numbers a user
// reading an out-of-memory error needs. Where /proc/meminfo cannot be read
// it returns an error wrapping gocore.ErrUnsupported.
func (b *HostBackend) Capacity(dev int) (total, free uint64, err error) {
	if err := b.checkDevice("capacity", dev); err != nil {
		return 0, 0, err
	}
	data, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, 0, fmt.Errorf("host backend: capacity: %v: %w", err, gocore.ErrUnsupported)
	}
	total, free, ok := parseMeminfo(data)
	if !ok {
		return 0, 0, fmt.Errorf("host backend: capacity: no MemTotal/MemAvailable in /proc/meminfo: %w", gocore.ErrUnsupported)
	}
	return total, free, nil
}

// parseMeminfo extracts MemTotal and MemAvailable (reported in kB) in bytes.
func parseMeminfo(data []byte) (total, avail uint64, ok bool) {
	var haveTotal, haveAvail bool
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 2 {
			continue
		}
		v, err := strconv.ParseUint(fields[1], 10, 64)
		if err != nil {
			continue
		}
		if len(fields) > 2 && fields[2] == "kB" {
			v *= 1024
		}
		switch fields[0] {
		case "MemTotal:":
			total, haveTotal = v, true
		case "MemAvailable:":
			avail, haveAvail = v, true
		}
	}
	return total, avail, haveTotal && haveAvail
}

// Alloc returns size bytes of pinned host memory. Failing to pin matches
// gocore.ErrBackendOutOfMemory (the driver reports CUDA_ERROR_OUT_OF_MEMORY).
func (b *HostBackend) Alloc(dev int, size uint64, stream gocore.Stream) (uint64, error) {
	if err := b.checkDevice("alloc", dev); err != nil {
		return 0, err
	}
	addr, err := b.drv.memHostAlloc(b.device, size, b.flags)
	if err != nil {
		return 0, err
	}
	if addr%Alignment != 0 {
		_ = b.drv.memFreeHost(b.device, addr)
		return 0, fmt.Errorf("host backend: cuMemHostAlloc returned %#x, not aligned to %d bytes", addr, Alignment)
	}
	return addr, nil
}

// Free returns memory from Alloc (cuMemFreeHost).
func (b *HostBackend) Free(dev int, addr, size uint64, stream gocore.Stream) error {
	if err := b.checkDevice("free", dev); err != nil {
		return err
	}
	return b.drv.memFreeHost(b.device, addr)
}

// NewEvent creates an event on b's CUDA device.
func (b *HostBackend) NewEvent(dev int) (gocore.Event, error) {
	if err := b.checkDevice("new event", dev); err != nil {
		return 0, err
	}
	ev, err := b.drv.EventCreate(b.device)
	if err != nil {
		return 0, err
	}
	b.mu.Lock()
	b.events[gocore.Event(ev)] = struct{}{}
	b.mu.Unlock()
	return gocore.Event(ev), nil
}

func (b *HostBackend) checkEvent(op string, ev gocore.Event) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, ok := b.events[ev]; !ok {
		return fmt.Errorf("host backend: %s unknown event %#x: %w", op, uint64(ev), gocore.ErrInvalidArgument)
	}
	return nil
}

// RecordEvent records ev on stream, a stream of b's CUDA device.
func (b *HostBackend) RecordEvent(ev gocore.Event, stream gocore.Stream) error {
	if err := b.checkEvent("record", ev); err != nil {
		return err
	}
	return b.drv.EventRecord(b.device, uint64(ev), uint64(stream))
}

// QueryEvent reports whether the work captured by ev has completed.
func (b *HostBackend) QueryEvent(ev gocore.Event) (bool, error) {
	if err := b.checkEvent("query", ev); err != nil {
		return false, err
	}
	return b.drv.EventQuery(b.device, uint64(ev))
}

// SynchronizeEvent waits for the work captured by ev.
func (b *HostBackend) SynchronizeEvent(ev gocore.Event) error {
	if err := b.checkEvent("synchronize", ev); err != nil {
		return err
	}
	return b.drv.EventSynchronize(b.device, uint64(ev))
}

// DestroyEvent destroys ev. As in Backend.DestroyEvent, the entry leaves
// the event table before cuEventDestroy, which frees the handle for reuse
// by a concurrent NewEvent, and comes back if cuEventDestroy fails.
func (b *HostBackend) DestroyEvent(ev gocore.Event) error {
	b.mu.Lock()
	_, ok := b.events[ev]
	delete(b.events, ev)
	b.mu.Unlock()
	if !ok {
		return fmt.Errorf("host backend: destroy unknown event %#x: %w", uint64(ev), gocore.ErrInvalidArgument)
	}
	if err := b.drv.EventDestroy(b.device, uint64(ev)); err != nil {
		b.mu.Lock()
		b.events[ev] = struct{}{} // still alive, so its handle cannot have been reused
		b.mu.Unlock()
		return err
	}
	return nil
}
