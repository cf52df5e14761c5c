package sim

import (
	"errors"
	"fmt"

	"github.com/gpumempool/gpumempool/gocore"
)

// Alloc returns the start of a new segment of size bytes on device. The
// address is aligned to Alignment and the segment, rounded up to Alignment,
// overlaps no other live segment. Errors caused by exhausted capacity or by
// injected failures (FailOnNthAlloc, FailRate) wrap
// gocore.ErrBackendOutOfMemory. The stream is ignored: the simulator's allocations are synchronous.
func (b *Backend) Alloc(device int, size uint64, stream gocore.Stream) (addr uint64, err error) {
	b.delay()
	b.mu.Lock()
	defer b.mu.Unlock()
	b.allocSeen++
	addr, err = b.allocLocked(device, size)
	if err != nil {
		b.stats.FailedAllocs++
		return 0, err
	}
	b.stats.Allocs++
	return addr, nil
}

// allocLocked does Alloc's work; b.mu must be held.
func (b *Backend) allocLocked(device int, size uint64) (uint64, error) {
	if err := b.checkDevice("alloc", device); err != nil {
		return 0, err
	}
	if size == 0 {
		return 0, fmt.Errorf("sim: alloc on device %d: size is 0", device)
	}
	if n := b.cfg.FailOnNthAlloc; n > 0 && b.allocSeen == uint64(n) {
		return 0, fmt.Errorf("sim: alloc of %d bytes on device %d: injected failure on alloc call %d: %w",
			size, device, n, gocore.ErrBackendOutOfMemory)
	}
	if b.cfg.FailRate > 0 && b.rng.Float64() < b.cfg.FailRate {
		return 0, fmt.Errorf("sim: alloc of %d bytes on device %d: injected failure (FailRate %v): %w",
			size, device, b.cfg.FailRate, gocore.ErrBackendOutOfMemory)
	}
	dev := &b.devices[device]
	if size > b.cfg.Capacity-dev.used {
		return 0, fmt.Errorf("sim: alloc of %d bytes on device %d: %d of %d bytes in use: %w",
			size, device, dev.used, b.cfg.Capacity, gocore.ErrBackendOutOfMemory)
	}
	// size <= Capacity, whose rounding was checked not to overflow.
	rounded, _ := alignUp(size, b.cfg.Alignment)
	span := rounded
	if b.cfg.Expandable {
		span = max(rounded, b.reserve)
	}
	addr, ok := uint64(0), false
	if dev.placeSize == size {
		// One try: a placement that cannot be honoured (its range is taken)
		// is dropped, and this segment goes where first fit puts it.
		addr, ok = dev.takeAt(dev.place, span)
		dev.place, dev.placeSize = 0, 0
		if ok {
			b.stats.Placed++
		}
	}
	if !ok {
		addr, ok = dev.takeFirstFit(span)
	}
	if !ok {
		return 0, fmt.Errorf("sim: alloc of %d bytes on device %d: no contiguous free address range (%d of %d bytes in use): %w",
			size, device, dev.used, b.cfg.Capacity, gocore.ErrBackendOutOfMemory)
	}
	if b.cfg.Expandable {
		dev.reserved[addr] = span
	}
	dev.live[addr] = size
	dev.used += size
	return addr, nil
}

// Free releases the segment at addr on device, which must be the start of a
// live segment allocated with exactly size bytes; otherwise Free returns an
// error and changes nothing. With FreeFailRate, a valid Free may fail with a
// plain error, leaving the segment live.
func (b *Backend) Free(device int, addr, size uint64, stream gocore.Stream) error {
	b.delay()
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.freeLocked(device, addr, size); err != nil {
		b.stats.FailedFrees++
		return err
	}
	b.stats.Frees++
	return nil
}

// errInjectedFreeFailure is wrapped by injected Free failures.
var errInjectedFreeFailure = errors.New("injected free failure")

// freeLocked does Free's work; b.mu must be held.
func (b *Backend) freeLocked(device int, addr, size uint64) error {
	if err := b.checkDevice("free", device); err != nil {
		return err
	}
	dev := &b.devices[device]
	liveSize, ok := dev.live[addr]
	if !ok {
		return fmt.Errorf("sim: free of %#x on device %d: not the start of a live segment", addr, device)
	}
	if liveSize != size {
		return fmt.Errorf("sim: free of %#x on device %d: size %d does not match allocated size %d",
			addr, device, size, liveSize)
	}
	if b.cfg.FreeFailRate > 0 && b.rng.Float64() < b.cfg.FreeFailRate {
		return fmt.Errorf("sim: free of %#x (%d bytes) on device %d: %w (FreeFailRate %v)",
			addr, size, device, errInjectedFreeFailure, b.cfg.FreeFailRate)
	}
	span, _ := alignUp(size, b.cfg.Alignment)
	if r, ok := dev.reserved[addr]; ok {
		span = r
		delete(dev.reserved, addr)
	}
	delete(dev.live, addr)
	dev.used -= size - dev.holes[addr]
	delete(dev.holes, addr)
	dev.release(addr, addr+span)
	return nil
}

// SetFreeFailRate changes Config.FreeFailRate, a probability in [0, 1], for
// the Frees that follow: a test makes the device refuse to take segments back
// (1) and then take them again (0).
func (b *Backend) SetFreeFailRate(rate float64) error {
	if !validRate(rate) {
		return configErr("FreeFailRate", rate, "is not a probability in [0, 1]")
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.cfg.FreeFailRate = rate
	return nil
}
