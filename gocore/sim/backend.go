package sim

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/gpumempool/gpumempool/gocore"
)

// spinThreshold is the latency below which the simulator busy-waits
// instead of sleeping, because time.Sleep is too coarse for short delays.
const spinThreshold = 50 * time.Microsecond

// Backend is a simulated device (a gocore.Backend) for tests and demos. It
// hands out aligned, non-overlapping addresses from a per-device address
// range, enforces a per-device capacity, can inject allocation and free
// failures, and lets tests control when stream work (and so events)
// completes. It is safe for concurrent use.
type Backend struct {
	cfg    Config // normalized
	stride uint64
	// reserve is the address space each expandable segment reserves:
	// torch's, 1 1/8 times the capacity in whole pages.
	reserve uint64

	mu        sync.Mutex
	rng       *rand.Rand
	allocSeen uint64 // number of Alloc calls so far
	devices   []deviceState
	streams   map[streamKey]*streamState
	events    map[gocore.Event]*eventState
	nextEvent gocore.Event
	manual    bool
	stats     Stats // counters only; live fields are computed
}

var (
	_ gocore.Backend    = (*Backend)(nil)
	_ gocore.Expander   = (*Backend)(nil)
	_ gocore.Shrinker   = (*Backend)(nil)
	_ gocore.PageMapper = (*Backend)(nil)
)

// Config returns the backend's configuration with defaults applied (and the
// FreeFailRate SetFreeFailRate set last).
func (b *Backend) Config() Config {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.cfg
}

// Name returns "sim".
func (b *Backend) Name() string { return "sim" }

// Devices returns the configured number of devices.
func (b *Backend) Devices() int { return b.cfg.Devices }

// Alignment returns the configured alignment of returned addresses.
func (b *Backend) Alignment() uint64 { return b.cfg.Alignment }

// checkDevice returns an error if device is not a valid ordinal.
func (b *Backend) checkDevice(op string, device int) error {
	if device < 0 || device >= b.cfg.Devices {
		return fmt.Errorf("sim: %s: invalid device %d (backend has %d devices)", op, device, b.cfg.Devices)
	}
	return nil
}

// Capacity returns the device's capacity and the bytes not in live segments.
func (b *Backend) Capacity(device int) (total, free uint64, err error) {
	if err := b.checkDevice("capacity", device); err != nil {
		return 0, 0, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.cfg.Capacity, b.cfg.Capacity - b.devices[device].used, nil
}

// UsedBytes returns the sum of the requested sizes of device's live
// segments, or 0 for an invalid device.
func (b *Backend) UsedBytes(device int) uint64 {
	if device < 0 || device >= b.cfg.Devices {
		return 0
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.devices[device].used
}

// delay spends the configured latency without holding the lock.
func (b *Backend) delay() {
	d := b.cfg.Latency
	if d <= 0 {
		return
	}
	if d > spinThreshold {
		time.Sleep(d)
		return
	}
	start := time.Now()
	for time.Since(start) < d {
	}
}
