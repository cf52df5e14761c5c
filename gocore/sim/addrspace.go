package sim

import (
	"fmt"
	"math/bits"
	"slices"
	"sort"

	"github.com/gpumempool/gpumempool/gocore"
)

// deviceStride is the minimum distance between the address ranges of two
// consecutive simulated devices (1 TiB).
const deviceStride uint64 = 1 << 40

// freeRange is a half-open free address range [start, end).
type freeRange struct {
	start, end uint64
}

// deviceState is the per-device state of a Backend.
type deviceState struct {
	used uint64            // sum of requested sizes of live segments
	free []freeRange       // sorted, coalesced free address ranges
	live map[uint64]uint64 // segment start -> requested size
	// reserved maps a segment start to the address space it holds when the
	// backend is expandable (at least the rounded size).
	reserved map[uint64]uint64
	// holes maps a segment start to the bytes inside it that Unmap gave
	// back (and Map has not mapped again); they are not in used.
	holes map[uint64]uint64
	// place is the address PlaceNext asked for the next segment of
	// placeSize bytes (placeSize 0: none).
	place, placeSize uint64
}

// alignUp rounds v up to a multiple of the power of two a, reporting false
// on overflow.
func alignUp(v, a uint64) (uint64, bool) {
	r, carry := bits.Add64(v, a-1, 0)
	if carry != 0 {
		return 0, false
	}
	return r &^ (a - 1), true
}

// takeFirstFit removes span bytes from the lowest free range that holds
// them and returns their start.
func (dev *deviceState) takeFirstFit(span uint64) (uint64, bool) {
	for i := range dev.free {
		r := &dev.free[i]
		if r.end-r.start < span {
			continue
		}
		addr := r.start
		r.start += span
		if r.start == r.end {
			dev.free = slices.Delete(dev.free, i, i+1)
		}
		return addr, true
	}
	return 0, false
}

// takeAt removes [addr, addr+span) from the free ranges if one free range
// holds all of it.
func (dev *deviceState) takeAt(addr, span uint64) (uint64, bool) {
	end, carry := bits.Add64(addr, span, 0)
	if carry != 0 {
		return 0, false
	}
	// i is the last free range that starts at or before addr.
	i := sort.Search(len(dev.free), func(i int) bool { return dev.free[i].start > addr }) - 1
	if i < 0 || dev.free[i].end < end {
		return 0, false
	}
	r := dev.free[i]
	switch {
	case r.start == addr && r.end == end:
		dev.free = slices.Delete(dev.free, i, i+1)
	case r.start == addr:
		dev.free[i].start = end
	case r.end == end:
		dev.free[i].end = addr
	default:
		dev.free[i].end = addr
		dev.free = slices.Insert(dev.free, i+1, freeRange{start: end, end: r.end})
	}
	return addr, true
}

// PlaceNext asks that the next segment of exactly size bytes that Alloc
// hands out on device start offset bytes into the device's placement
// window: the upper half of its address range. First fit allocates from the
// bottom of the range, so it leaves the window to placed segments, whose
// addresses keep the order their offsets have. Replay uses it to give
// segments the relative addresses the recording allocator's device gave
// them: best fit breaks ties between free blocks of equal size by address,
// so the order of segments decides which block is reused.
//
// The placement holds for one Alloc of that size on device (Allocs of other
// sizes leave it); if its range is not free then, or lies beyond the window,
// that segment is placed by first fit instead. size 0 withdraws the
// placement. offset must be a multiple of Alignment.
func (b *Backend) PlaceNext(device int, offset, size uint64) error {
	if err := b.checkDevice("place next segment", device); err != nil {
		return err
	}
	if offset%b.cfg.Alignment != 0 {
		return fmt.Errorf("sim: place next segment on device %d at offset %#x: not a multiple of the alignment %d: %w",
			device, offset, b.cfg.Alignment, gocore.ErrInvalidArgument)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	dev := &b.devices[device]
	if size == 0 {
		dev.place, dev.placeSize = 0, 0
		return nil
	}
	start, half := b.placementWindow(device)
	if offset >= half {
		// Beyond the window: nothing can go there; first fit will serve it.
		dev.place, dev.placeSize = 0, 0
		return nil
	}
	dev.place, dev.placeSize = start+offset, size
	return nil
}

// placementWindow returns the start and size of device's placement window,
// the upper half of its range (stride is a multiple of 1 TiB and of the
// alignment, so the middle is aligned unless the alignment is the whole
// stride; then the window is empty).
func (b *Backend) placementWindow(device int) (start, size uint64) {
	lo := b.cfg.Base + uint64(device)*b.stride
	mid, _ := alignUp(lo+b.stride/2, b.cfg.Alignment) // below the range's end, which is aligned
	return mid, lo + b.stride - mid
}

// release returns [start, end) to the device's free list, coalescing it with
// adjacent free ranges.
func (dev *deviceState) release(start, end uint64) {
	// i is the first free range that starts at or after end.
	i := sort.Search(len(dev.free), func(i int) bool { return dev.free[i].start >= end })
	mergePrev := i > 0 && dev.free[i-1].end == start
	mergeNext := i < len(dev.free) && dev.free[i].start == end
	switch {
	case mergePrev && mergeNext:
		dev.free[i-1].end = dev.free[i].end
		dev.free = slices.Delete(dev.free, i, i+1)
	case mergePrev:
		dev.free[i-1].end = end
	case mergeNext:
		dev.free[i].start = start
	default:
		dev.free = slices.Insert(dev.free, i, freeRange{start: start, end: end})
	}
}
