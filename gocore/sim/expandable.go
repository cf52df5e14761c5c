package sim

import (
	"fmt"

	"github.com/gpumempool/gpumempool/gocore"
)

// Expandable reports whether the backend grows segments in place
// (Config.Expandable).
func (b *Backend) Expandable() bool { return b.cfg.Expandable }

// Granularity is the unit segments grow by.
func (b *Backend) Granularity() uint64 { return b.cfg.Granularity }

// Expand grows the live segment [addr, addr+size) by extra bytes within the
// address space it reserved. Running out of capacity or of reserved space
// wraps gocore.ErrBackendOutOfMemory; the segment is then unchanged.
func (b *Backend) Expand(device int, addr, size, extra uint64, stream gocore.Stream) error {
	b.delay()
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.checkDevice("expand", device); err != nil {
		return err
	}
	dev := &b.devices[device]
	if !b.cfg.Expandable {
		return fmt.Errorf("sim: expand %#x on device %d: backend is not expandable: %w", addr, device, gocore.ErrUnsupported)
	}
	if got, ok := dev.live[addr]; !ok || got != size {
		return fmt.Errorf("sim: expand %#x on device %d: not a live segment of %d bytes", addr, device, size)
	}
	if extra == 0 || extra%b.cfg.Granularity != 0 {
		return fmt.Errorf("sim: expand %#x on device %d by %d bytes: not a positive multiple of the granularity %d",
			addr, device, extra, b.cfg.Granularity)
	}
	if extra > b.cfg.Capacity-dev.used {
		b.stats.FailedAllocs++
		return fmt.Errorf("sim: expand %#x on device %d by %d bytes: %d of %d bytes in use: %w",
			addr, device, extra, dev.used, b.cfg.Capacity, gocore.ErrBackendOutOfMemory)
	}
	if grown, _ := alignUp(size+extra, b.cfg.Alignment); grown > dev.reserved[addr] {
		b.stats.FailedAllocs++
		return fmt.Errorf("sim: expand %#x on device %d to %d bytes: beyond its %d reserved bytes: %w",
			addr, device, size+extra, dev.reserved[addr], gocore.ErrBackendOutOfMemory)
	}
	dev.live[addr] = size + extra
	dev.used += extra
	b.stats.Expansions++
	return nil
}

// Shrink gives back the last less bytes of the live segment
// [addr, addr+size) (a gocore.Shrinker): the segment keeps its reserved
// address space and may grow again. less must be a positive multiple of the
// granularity smaller than size; the sim always gives back all of it.
func (b *Backend) Shrink(device int, addr, size, less uint64, stream gocore.Stream) (uint64, error) {
	b.delay()
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.checkDevice("shrink", device); err != nil {
		return 0, err
	}
	dev := &b.devices[device]
	if !b.cfg.Expandable {
		return 0, fmt.Errorf("sim: shrink %#x on device %d: backend is not expandable: %w", addr, device, gocore.ErrUnsupported)
	}
	if got, ok := dev.live[addr]; !ok || got != size {
		return 0, fmt.Errorf("sim: shrink %#x on device %d: not a live segment of %d bytes", addr, device, size)
	}
	if less == 0 || less%b.cfg.Granularity != 0 || less >= size {
		return 0, fmt.Errorf("sim: shrink %#x (%d bytes) on device %d by %d bytes: not a positive multiple of the granularity %d below the size",
			addr, size, device, less, b.cfg.Granularity)
	}
	dev.live[addr] = size - less
	dev.used -= less
	b.stats.Shrinks++
	return less, nil
}

// Unmap gives back the n bytes at offset off of the live segment
// [addr, addr+size) (a gocore.PageMapper), keeping its address range: a
// hole the segment may map again with Map. off and n must be multiples of the
// granularity, the range inside the segment; the sim counts a segment's
// unmapped bytes, not where they lie.
func (b *Backend) Unmap(device int, addr, size, off, n uint64, stream gocore.Stream) error {
	b.delay()
	b.mu.Lock()
	defer b.mu.Unlock()
	dev, err := b.pageRangeLocked("unmap", device, addr, size, off, n)
	if err != nil {
		return err
	}
	if n > size-dev.holes[addr] {
		return fmt.Errorf("sim: unmap %d bytes of %#x on device %d: only %d of its %d bytes are mapped",
			n, addr, device, size-dev.holes[addr], size)
	}
	dev.holes[addr] += n
	dev.used -= n
	b.stats.Unmaps++
	return nil
}

// Map maps the n bytes at offset off of the live segment [addr, addr+size)
// again, after Unmap gave them back (a gocore.PageMapper). Running out of
// capacity wraps gocore.ErrBackendOutOfMemory; the segment is then unchanged.
func (b *Backend) Map(device int, addr, size, off, n uint64, stream gocore.Stream) error {
	b.delay()
	b.mu.Lock()
	defer b.mu.Unlock()
	dev, err := b.pageRangeLocked("map", device, addr, size, off, n)
	if err != nil {
		return err
	}
	if n > dev.holes[addr] {
		return fmt.Errorf("sim: map %d bytes of %#x on device %d: only %d of its bytes are unmapped",
			n, addr, device, dev.holes[addr])
	}
	if n > b.cfg.Capacity-dev.used {
		b.stats.FailedAllocs++
		return fmt.Errorf("sim: map %d bytes of %#x on device %d: %d of %d bytes in use: %w",
			n, addr, device, dev.used, b.cfg.Capacity, gocore.ErrBackendOutOfMemory)
	}
	dev.holes[addr] -= n
	dev.used += n
	b.stats.Maps++
	return nil
}

// pageRangeLocked checks the arguments of Unmap and Map: an expandable
// backend, a live segment of size bytes at addr, and a positive range of
// whole granules inside it.
func (b *Backend) pageRangeLocked(op string, device int, addr, size, off, n uint64) (*deviceState, error) {
	if err := b.checkDevice(op, device); err != nil {
		return nil, err
	}
	if !b.cfg.Expandable {
		return nil, fmt.Errorf("sim: %s in %#x on device %d: backend is not expandable: %w", op, addr, device, gocore.ErrUnsupported)
	}
	dev := &b.devices[device]
	if got, ok := dev.live[addr]; !ok || got != size {
		return nil, fmt.Errorf("sim: %s in %#x on device %d: not a live segment of %d bytes", op, addr, device, size)
	}
	g := b.cfg.Granularity
	if n == 0 || off%g != 0 || n%g != 0 || off > size || n > size-off {
		return nil, fmt.Errorf("sim: %s %d bytes at offset %d of %#x (%d bytes) on device %d: not a range of whole granules of %d inside it",
			op, n, off, addr, size, device, g)
	}
	return dev, nil
}
