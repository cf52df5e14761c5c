package cuda

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/cuda/driver"
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
	*Events // on device, whatever device (0) the pool asks for
	drv     *driver.Driver
	flags   uint32
	device  int // the CUDA device whose context is used
}

var _ gocore.Backend = (*HostBackend)(nil)

// HostOptions configures a HostBackend (NewHostBackendWith).
type HostOptions struct {
	// Flags are the cuMemHostAlloc flags (HostAllocPortable, ...); 0 means
	// HostAllocPortable.
	Flags uint32 `option:"host_flags" max:"2147483647" doc:"cuMemHostAlloc flags (0: portable)"`
	// Device is the CUDA device whose context holds the memory and the
	// events (see NewHostBackendOn).
	Device int `option:"host_device" type:"device" doc:"the CUDA device whose context holds the memory and events"`
}

// NewHostBackendWith is NewHostBackendOn(drv, opts.Flags, opts.Device).
func NewHostBackendWith(drv *driver.Driver, opts HostOptions) (*HostBackend, error) {
	return NewHostBackendOn(drv, opts.Flags, opts.Device)
}

// NewHostBackend returns a HostBackend allocating with the given
// cuMemHostAlloc flags (HostAllocPortable, HostAllocDeviceMap,
// HostAllocWriteCombined); 0 means HostAllocPortable, so that the memory is
// pinned for every context, as torch's host allocator does. The driver must
// see at least one device; device 0's context holds the allocations and
// events (see NewHostBackendOn).
func NewHostBackend(drv *driver.Driver, flags uint32) (*HostBackend, error) {
	return NewHostBackendOn(drv, flags, 0)
}

// NewHostBackendOn is NewHostBackend working under CUDA device device's
// context instead of device 0's: the device a process uses (e.g. a torchrun
// rank's cuda:LOCAL_RANK), so that no context is created on another GPU,
// and whose streams record the backend's events. An ordinal the driver does
// not see fails with an error wrapping gocore.ErrInvalidDevice.
func NewHostBackendOn(drv *driver.Driver, flags uint32, device int) (*HostBackend, error) {
	if drv == nil {
		return nil, fmt.Errorf("host backend: nil driver: %w", gocore.ErrInvalidArgument)
	}
	if flags&^driver.HostAllocAll != 0 {
		return nil, fmt.Errorf("host backend: unknown cuMemHostAlloc flags %#x: %w", flags&^driver.HostAllocAll, gocore.ErrInvalidArgument)
	}
	if flags == 0 {
		flags = driver.HostAllocPortable
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
	b := &HostBackend{drv: drv, flags: flags, device: device}
	b.Events = newEvents(drv, "host backend", func(op string, dev int) (int, error) { return b.device, b.checkDevice(op, dev) })
	return b, nil
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
func (b *HostBackend) Flags(ptr uint64) (uint32, error) { return b.drv.MemHostGetFlags(b.device, ptr) }

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
	addr, err := b.drv.MemHostAlloc(b.device, size, b.flags)
	if err != nil {
		return 0, err
	}
	if addr%Alignment != 0 {
		_ = b.drv.MemFreeHost(b.device, addr)
		return 0, fmt.Errorf("host backend: cuMemHostAlloc returned %#x, not aligned to %d bytes", addr, Alignment)
	}
	return addr, nil
}

// Free returns memory from Alloc (cuMemFreeHost).
func (b *HostBackend) Free(dev int, addr, size uint64, stream gocore.Stream) error {
	if err := b.checkDevice("free", dev); err != nil {
		return err
	}
	return b.drv.MemFreeHost(b.device, addr)
}
