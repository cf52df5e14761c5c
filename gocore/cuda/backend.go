package cuda

import (
	"fmt"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/cuda/driver"
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
// events (Events) are CUDA events on the device the pool asks for. Streams
// are the caller's CUstream values (0: the legacy default stream). It is
// safe for concurrent use.
type Backend struct {
	*Events
	drv     *driver.Driver
	devices int
}

var _ gocore.Backend = (*Backend)(nil)

// NewBackend returns a Backend over drv's devices. It fails when drv is nil
// or sees no device.
func NewBackend(drv *driver.Driver) (*Backend, error) {
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
	b := &Backend{drv: drv, devices: n}
	b.Events = newEvents(drv, "cuda backend", func(op string, dev int) (int, error) { return dev, b.checkDevice(op, dev) })
	return b, nil
}

// Name returns "cuda".
func (b *Backend) Name() string { return "cuda" }

// Devices returns the number of devices the driver saw when b was made.
func (b *Backend) Devices() int { return b.devices }

// Alignment returns Alignment (512).
func (b *Backend) Alignment() uint64 { return Alignment }

// Driver returns the driver b allocates through.
func (b *Backend) Driver() *driver.Driver { return b.drv }

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
