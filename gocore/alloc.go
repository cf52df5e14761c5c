package gocore

import (
	"errors"
	"fmt"
)

// Alloc returns the address of a block of at least size bytes on device dev,
// for work ordered on stream. It reuses a cached block of that stream when one
// fits (best fit by size, then address), else obtains a new segment from the
// backend; if that fails for lack of memory it releases cached segments and
// tries again, as torch does (with MaxSplitSize, first just enough cached
// oversize segments of the stream; then, counted as a retry, everything
// cached, after waiting for the frees pending on other streams), before
// returning an *OutOfMemoryError (no release while the pool holds its
// segments: KeepSegments or a capture).
func (p *Pool) Alloc(size uint64, dev int, stream Stream) (uint64, error) {
	return p.alloc(size, dev, stream, false)
}

// AllocSegment is Alloc for a caller that sizes segments itself and caches
// inside them, as torch's caching allocator does when a torch.cuda.MemPool
// gets its segments from the pool (2 MiB for its small blocks, 20 MiB or a
// 2 MiB multiple for large ones). A cached block serves it as in Alloc, but
// a miss obtains just the rounded request from the backend (a multiple of
// 2 MiB for large requests) instead of torch's 20 MiB buffer for requests
// under 10 MiB: the caller carves that buffer itself, and a second one
// beneath it would leave up to 18 MiB reserved and never used.
func (p *Pool) AllocSegment(size uint64, dev int, stream Stream) (uint64, error) {
	return p.alloc(size, dev, stream, true)
}

func (p *Pool) alloc(size uint64, dev int, stream Stream, callerSegments bool) (uint64, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	d, err := p.allocDevice(size, dev)
	if err != nil {
		return 0, err
	}
	if len(d.pending) > 0 || len(d.unrecorded) > 0 {
		p.processEventsLocked(d)
	}
	rounded := p.blockSize(size, callerSegments)
	kind := kindOf(rounded)
	f := d.freeList(stream)
	b := p.takeCachedLocked(d, f, rounded, kind)
	if b == nil {
		// Any miss, small or large, collects (torch's malloc): only large
		// segments go, but a small request may be what pushes reserved
		// memory over the threshold.
		if p.cfg.GarbageCollectionThreshold > 0 {
			p.collectGarbageLocked(d)
		}
		if b, err = p.newSegmentBlock(d, size, rounded, kind, stream, callerSegments); err != nil {
			return 0, err
		}
		f = d.freeList(stream) // releasing cached segments may have dropped the stream's lists
	}
	if p.shouldSplit(b, rounded) {
		p.splitLocked(d, f, b, rounded)
	}
	p.handOutLocked(d, b, size, kind, stream, callerSegments)
	return b.addr, nil
}

// allocDevice checks an allocation's arguments (an open pool, a size in
// [1, MaxRequest], a device of the backend) and returns its device state.
// The common case is one test per argument; allocDeviceSlow says what is
// wrong, or creates the state on a device's first allocation.
func (p *Pool) allocDevice(size uint64, dev int) (*deviceState, error) {
	if uint(dev) < uint(len(p.devices)) {
		if d := p.devices[dev]; d != nil && size-1 < MaxRequest && !p.closed {
			return d, nil
		}
	}
	return p.allocDeviceSlow(size, dev)
}

func (p *Pool) allocDeviceSlow(size uint64, dev int) (*deviceState, error) {
	if p.closed {
		return nil, fmt.Errorf("alloc %d bytes from pool %q: %w", size, p.name, ErrClosed)
	}
	if size == 0 || size > MaxRequest {
		return nil, fmt.Errorf("alloc %d bytes from pool %q: size must be in [1, %d]: %w",
			size, p.name, uint64(MaxRequest), ErrInvalidSize)
	}
	d, err := p.device(dev)
	if err != nil {
		return nil, fmt.Errorf("alloc %d bytes: %w", size, err)
	}
	return d, nil
}

// splitLocked cuts b down to rounded bytes; the rest of it becomes a free
// block of f.
func (p *Pool) splitLocked(d *deviceState, f *streamFree, b *block, rounded uint64) {
	rest := p.newBlock() // as new: only what differs is set
	rest.seg, rest.addr, rest.size = b.seg, b.addr+rounded, b.size-rounded
	rest.prev, rest.next = b, b.next
	if b.next != nil {
		b.next.prev = rest
	} else {
		b.seg.last = rest
	}
	b.next = rest
	b.size = rounded
	d.insertFree(f, rest)
}

// handOutLocked makes b the allocation of a request of size bytes: it
// indexes it by address, counts it and records it.
func (p *Pool) handOutLocked(d *deviceState, b *block, size uint64, kind poolKind, stream Stream, callerSegments bool) {
	b.allocated = true
	b.requested = size
	b.callerSized = callerSegments
	p.live.put(b)
	st := &d.stats
	st.Allocation.up(kind, 1)
	st.AllocatedBytes.up(kind, int64(b.size))
	st.Active.up(kind, 1)
	st.ActiveBytes.up(kind, int64(b.size))
	st.RequestedBytes.up(kind, int64(size))
	if p.isOversize(b.size) {
		st.OversizeAllocations.up(1)
	}
	if e := p.trace(ActionAlloc, d.id, b.addr, size, stream); e != nil {
		e.CallerSized = callerSegments
	}
}

// takeCachedLocked takes the best cached block of the stream whose free
// lists are f for a rounded request (best fit by size, then address), or
// returns nil when none fits.
func (p *Pool) takeCachedLocked(d *deviceState, f *streamFree, rounded uint64, kind poolKind) *block {
	var b *block
	if kind == kindSmall {
		b = f.small.bestFit(rounded)
	} else {
		d.largeLookups++
		b = f.bestFitLarge(rounded, p.cfg.MaxSplitSize, p.cfg.MaxNonSplitRoundingSize)
	}
	if b != nil {
		d.removeFree(f, b)
		d.stats.NumCacheHits++
	}
	return b
}

func (p *Pool) isOversize(size uint64) bool {
	return p.cfg.MaxSplitSize != 0 && size >= p.cfg.MaxSplitSize
}

// shouldSplit keeps the remainder as a free block when it is worth keeping:
// any remainder in the small pool; in the large pool a remainder of more
// than SmallSize, and never for requests of MaxSplitSize or more (torch's rule).
func (p *Pool) shouldSplit(b *block, rounded uint64) bool {
	rest := b.size - rounded
	if b.seg.kind == kindSmall || b.seg.expandable {
		// Expandable segments grow by whole granules: what is left over
		// must stay usable, as in torch's expandable segments.
		return rest >= MinBlockSize
	}
	return rest > SmallSize && (p.cfg.MaxSplitSize == 0 || rounded < p.cfg.MaxSplitSize)
}

// newSegmentBlock obtains a segment for a request that no cached block can
// serve, with torch's release-and-retry path for when the backend (or the
// limit) refuses, and returns it as one block.
func (p *Pool) newSegmentBlock(d *deviceState, size, rounded uint64, kind poolKind, stream Stream, callerSegments bool) (*block, error) {
	segSize := segmentSize(rounded, callerSegments)
	expandable := p.expander != nil && kind == kindLarge
	if expandable {
		if b, err := p.growLocked(d, rounded, stream); b != nil || err != nil {
			return b, err
		}
		// A new growing segment starts with what this request needs.
		segSize = roundUp(rounded, p.expander.Granularity())
	}
	addr, err := p.backendAlloc(d, segSize, stream)
	// A pool that holds its segments has nothing to release: no retry.
	if err != nil && errors.Is(err, ErrBackendOutOfMemory) && !p.holdingSegmentsLocked() {
		// Torch's release_available_cached_blocks: with a max split size,
		// first give back just enough cached oversize segments of the
		// stream, then ask again (not counted as a retry).
		if p.cfg.MaxSplitSize != 0 && p.releaseOversizeLocked(d, d.freeList(stream), rounded) {
			addr, err = p.backendAlloc(d, segSize, stream)
		}
	}
	if err != nil && errors.Is(err, ErrBackendOutOfMemory) && !p.holdingSegmentsLocked() {
		// Torch's release_cached_blocks then the retry: wait for the frees
		// pending on other streams, give back every wholly free segment,
		// and ask once more. The request is not looked up in the cache
		// again: blocks the wait freed go back to the backend if whole,
		// and stay cached (unused by this request) if not, as in torch.
		d.stats.NumAllocRetries++
		p.synchronizeEventsLocked(d)
		_, _ = p.trimLocked(d, 0) // a failed release leaves the segment cached
		addr, err = p.backendAlloc(d, segSize, stream)
	}
	if err != nil {
		if !errors.Is(err, ErrBackendOutOfMemory) {
			return nil, fmt.Errorf("pool %q: alloc %d-byte segment on device %d from %s backend: %w",
				p.name, segSize, d.id, p.backend.Name(), err)
		}
		d.stats.NumOOMs++
		oom := &OutOfMemoryError{
			Pool: p.name, Backend: p.backend.Name(), Device: d.id, Requested: size, Segment: segSize,
			Allocated: uint64(d.stats.AllocatedBytes[0].Current),
			Reserved:  uint64(d.stats.ReservedBytes[0].Current),
			Limit:     p.limitLocked(d.id),
		}
		if shared := p.budget.Reserved(d.id); shared != oom.Reserved {
			oom.SharedReserved = shared
		}
		if !errors.Is(err, errLimit) {
			oom.Cause = err
		}
		if total, free, cerr := p.backend.Capacity(d.id); cerr == nil {
			oom.DeviceTotal, oom.DeviceFree = total, free
		}
		if e := p.trace(ActionOOM, d.id, 0, size, stream); e != nil {
			e.DeviceFree = oom.DeviceFree
		}
		return nil, oom
	}
	p.segments++
	seg := &segment{device: d.id, addr: addr, size: segSize, stream: stream, kind: kind, expandable: expandable,
		wholeFreeAt: -1, seq: p.segments}
	b := &block{seg: seg, addr: addr, size: segSize, heapIdx: -1}
	seg.first, seg.last = b, b
	if expandable {
		d.growing[stream] = seg // the newest one has the most room to grow
	}
	d.segments[addr] = seg
	p.trace(ActionSegmentAlloc, d.id, addr, segSize, stream)
	d.stats.NumDeviceAlloc++
	d.stats.Segment.add(kind, 1)
	d.stats.ReservedBytes.add(kind, int64(segSize)) // the budget counted it in backendAlloc
	p.syncOversize(d, seg)
	return b, nil
}

// errLimit marks an allocation refused by the pool's own limit; it wraps
// ErrBackendOutOfMemory so that it takes the same release-and-retry path.
var errLimit = fmt.Errorf("pool limit reached: %w", ErrBackendOutOfMemory)

// backendAlloc obtains a segment of size bytes, counted in the budget
// (reserved there before the backend is asked, so that pools sharing the
// budget cannot pass its limit together); the caller counts it in the
// device's stats.
func (p *Pool) backendAlloc(d *deviceState, size uint64, stream Stream) (uint64, error) {
	if !p.budget.reserve(d.id, size) {
		return 0, errLimit
	}
	addr, err := p.backend.Alloc(d.id, size, stream)
	if err == nil && addr == 0 {
		// NULL means failure to every C caller, and the live index keys by
		// address with 0 as its empty slot: such a segment cannot be used.
		err = fmt.Errorf("%s backend returned address 0 for %d bytes", p.backend.Name(), size)
		if ferr := p.backend.Free(d.id, 0, size, stream); ferr != nil {
			err = fmt.Errorf("%w (and freeing it failed: %w)", err, ferr)
		}
	}
	if err != nil {
		p.budget.add(d.id, -int64(size))
	}
	return addr, err
}

// newBlock reuses a block struct dropped by a merge, sparing the garbage
// collector on the split/merge cycle of the hot path. The block is as new:
// the zero block with heapIdx -1 (and the capacity of its streamUses).
func (p *Pool) newBlock() *block {
	if n := len(p.spare); n > 0 {
		b := p.spare[n-1]
		p.spare[n-1] = nil
		p.spare = p.spare[:n-1]
		return b
	}
	return &block{heapIdx: -1}
}

// dropBlock keeps a block struct that a merge made unreachable for reuse.
func (p *Pool) dropBlock(b *block) {
	if len(p.spare) < maxSpareBlocks {
		*b = block{heapIdx: -1, streamUses: b.streamUses[:0]}
		p.spare = append(p.spare, b)
	}
}

const maxSpareBlocks = 1024

// growLocked serves a large request by growing the stream's growing segment
// in place: its free tail plus the new granules become the block. It returns
// (nil, nil) when that is not possible (no growing segment yet, the limit,
// or the backend out of memory), so that the caller falls back to a new
// segment with the usual release-and-retry path.
func (p *Pool) growLocked(d *deviceState, rounded uint64, stream Stream) (*block, error) {
	seg := d.growing[stream]
	if seg == nil {
		return nil, nil
	}
	last := seg.last
	need := rounded
	if last.inFree {
		if last.size >= rounded {
			return nil, nil // refused by the max-split rules: not a size problem
		}
		need -= last.size
	}
	extra := roundUp(need, p.expander.Granularity())
	if !p.budget.reserve(d.id, extra) {
		return nil, nil
	}
	if err := p.expander.Expand(d.id, seg.addr, seg.size, extra, stream); err != nil {
		p.budget.add(d.id, -int64(extra))
		if errors.Is(err, ErrBackendOutOfMemory) {
			return nil, nil
		}
		return nil, fmt.Errorf("pool %q: grow segment %#x on device %d by %d bytes: %w", p.name, seg.addr, d.id, extra, err)
	}
	seg.size += extra
	p.trace(ActionSegmentMap, d.id, seg.addr+seg.size-extra, extra, stream)
	d.stats.NumDeviceAlloc++
	d.stats.NumExpansions++
	d.stats.ReservedBytes.add(kindLarge, int64(extra)) // the budget counted it above
	p.syncOversize(d, seg)                             // growing may make it oversize
	if last.inFree {
		d.removeFree(d.freeList(stream), last)
		last.size += extra
		return last, nil
	}
	b := p.newBlock()
	*b = block{seg: seg, addr: seg.addr + seg.size - extra, size: extra, prev: last, heapIdx: -1, streamUses: b.streamUses[:0]}
	last.next = b
	seg.last = b
	return b, nil
}
