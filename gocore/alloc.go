package gocore

import (
	"errors"
	"fmt"
	"sort"
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
//
// Its arguments come in the engine's one order, device first, as in
// Backend.Alloc, Trim and SetDeviceLimit; the C ABI and the Python API keep
// torch's alloc(size, device, stream).
func (p *Pool) Alloc(dev int, size uint64, stream Stream) (uint64, error) {
	return p.alloc(dev, size, stream, false)
}

// AllocSegment is Alloc for a caller that sizes segments itself and caches
// inside them, as torch's caching allocator does when a torch.cuda.MemPool
// gets its segments from the pool (2 MiB for its small blocks, 20 MiB or a
// 2 MiB multiple for large ones). A cached block serves it as in Alloc, but
// a miss obtains just the rounded request from the backend (a multiple of
// 2 MiB for large requests) instead of torch's 20 MiB buffer for requests
// under 10 MiB: the caller carves that buffer itself, and a second one
// beneath it would leave up to 18 MiB reserved and never used.
func (p *Pool) AllocSegment(dev int, size uint64, stream Stream) (uint64, error) {
	return p.alloc(dev, size, stream, true)
}

func (p *Pool) alloc(dev int, size uint64, stream Stream, callerSegments bool) (uint64, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	d, err := p.allocDevice(dev, size)
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
func (p *Pool) allocDevice(dev int, size uint64) (*deviceState, error) {
	if uint(dev) < uint(len(p.devices)) {
		if d := p.devices[dev]; d != nil && size-1 < MaxRequest && !p.closed {
			return d, nil
		}
	}
	return p.allocDeviceSlow(dev, size)
}

func (p *Pool) allocDeviceSlow(dev int, size uint64) (*deviceState, error) {
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
// lists are f for a rounded request (best fit by size, then address, with
// torch's preference for a block that is not the growable tail of an
// expandable segment), or returns nil when none fits.
func (p *Pool) takeCachedLocked(d *deviceState, f *streamFree, rounded uint64, kind poolKind) *block {
	var b *block
	switch {
	case kind == kindSmall && p.expander == nil:
		b = f.small.bestFit(rounded)
	case kind == kindSmall:
		if f.smallExp != nil {
			// torch's max_split_size rules concern large requests only.
			b = f.bestFit(f.smallExp, rounded, 0, 0, p.reserveLocked(d, kind))
		}
	default:
		d.largeLookups++
		var reserve uint64
		if p.expander != nil {
			reserve = p.reserveLocked(d, kind)
		}
		b = f.bestFit(f.large, rounded, p.cfg.MaxSplitSize, p.cfg.MaxNonSplitRoundingSize, reserve)
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
	if b.seg.kind == kindSmall || p.expander != nil {
		// Expandable segments grow by whole pages: what is left over must
		// stay usable. torch splits so whenever expandable segments are on.
		return rest >= MinBlockSize
	}
	return rest > SmallSize && (p.cfg.MaxSplitSize == 0 || rounded < p.cfg.MaxSplitSize)
}

// newSegmentBlock obtains a segment for a request that no cached block can
// serve, with torch's release-and-retry path for when the backend (or the
// limit) refuses, and returns it as one block. With an expandable backend
// it grows the stream's segment of the pool kind instead, and makes one
// only when the stream has none there.
func (p *Pool) newSegmentBlock(d *deviceState, size, rounded uint64, kind poolKind, stream Stream, callerSegments bool) (*block, error) {
	segSize := segmentSize(rounded, callerSegments)
	expandable := p.expander != nil
	if expandable {
		// A new growing segment starts with the pages this request needs.
		segSize = roundUp(rounded, p.expandPage(kind))
	}
	// torch checks its memory fraction against the segment the request
	// would get without expandable segments (get_allocation_size).
	allocSize := segmentSize(rounded, callerSegments)
	b, addr, err := p.obtainLocked(d, rounded, segSize, allocSize, kind, stream, expandable)
	// A pool that holds its segments has nothing to release: no retry.
	if err != nil && errors.Is(err, ErrBackendOutOfMemory) && !p.holdingSegmentsLocked() {
		// Torch's release_available_cached_blocks: with a max split size,
		// first give back just enough cached oversize segments of the
		// stream, then ask again (not counted as a retry).
		if p.cfg.MaxSplitSize != 0 && p.releaseOversizeLocked(d, d.freeList(stream), rounded) {
			b, addr, err = p.obtainLocked(d, rounded, segSize, allocSize, kind, stream, expandable)
		}
	}
	if err != nil && errors.Is(err, ErrBackendOutOfMemory) && !p.holdingSegmentsLocked() {
		// Torch's release_cached_blocks then the retry: wait for the frees
		// pending on other streams, give back every wholly free segment
		// (and, for expandable segments, their free pages), and ask once
		// more. The request is not looked up in the cache again: blocks
		// the wait freed go back to the backend if whole, and stay cached
		// (unused by this request) if not, as in torch.
		d.stats.NumAllocRetries++
		p.synchronizeEventsLocked(d)
		_, _ = p.trimLocked(d, 0) // a failed release leaves the segment cached
		b, addr, err = p.obtainLocked(d, rounded, segSize, allocSize, kind, stream, expandable)
	}
	if err != nil {
		if !errors.Is(err, ErrBackendOutOfMemory) {
			return nil, err
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
	if b != nil {
		return b, nil // the growing segment served it
	}
	return p.newSegmentLocked(d, addr, segSize, kind, stream, expandable), nil
}

// newSegmentLocked makes the segment [addr, addr+segSize) that the backend
// just gave (counted in the budget by backendAlloc) one of d's, and returns
// it as one block, neither allocated nor indexed as free.
func (p *Pool) newSegmentLocked(d *deviceState, addr, segSize uint64, kind poolKind, stream Stream, expandable bool) *block {
	p.segments++
	seg := &segment{device: d.id, addr: addr, size: segSize, stream: stream, kind: kind, expandable: expandable,
		wholeFreeAt: -1, seq: p.segments}
	b := &block{seg: seg, addr: addr, size: segSize, heapIdx: -1}
	seg.first, seg.last = b, b
	if expandable {
		d.growing[growKey{stream, kind}] = seg // the newest one has the most room to grow
	}
	d.segments[addr] = seg
	if expandable {
		// torch traces an expandable segment by its mappings alone (its
		// address reservation is no segment_alloc): memory_viz's segment
		// timeline then shows the pages mapped, not the first mapping.
		p.trace(ActionSegmentMap, d.id, addr, segSize, stream)
	} else {
		p.trace(ActionSegmentAlloc, d.id, addr, segSize, stream)
	}
	d.stats.NumDeviceAlloc++
	d.countSegment(seg, 1)
	d.stats.ReservedBytes.add(kind, int64(segSize)) // the budget counted it in backendAlloc
	p.syncOversize(d, seg)
	return b
}

// obtainLocked is one attempt at new memory for a rounded request: growing
// the stream's segment of the pool kind (a block, with an expandable
// backend), else a segment of segSize bytes from the backend (its address,
// for the caller to make it a segment). A lack of memory wraps
// ErrBackendOutOfMemory; other errors name the pool.
//
// An expandable pool with a limit checks it as torch checks its memory
// fraction with expandable segments: once, for allocSize bytes (the
// segment the request would get without them) on top of what is reserved,
// before it maps anything; the pages it then maps are not checked again,
// and may pass the limit by the rest of a page.
func (p *Pool) obtainLocked(d *deviceState, rounded, segSize, allocSize uint64, kind poolKind, stream Stream, expandable bool) (*block, uint64, error) {
	if expandable {
		if limit := p.limitLocked(d.id); limit != 0 && p.budget.Reserved(d.id)+allocSize > limit {
			return nil, 0, errLimit
		}
		// torch maps more pages into the stream's segment, and makes a new
		// one when there is none or its reservation cannot hold the pages.
		// Out of memory, a new segment (at least as large) fails too.
		b, err := p.growLocked(d, rounded, kind, stream)
		if b != nil || (err != nil && !errors.Is(err, ErrBackendOutOfMemory)) {
			return b, 0, err
		}
	}
	addr, err := p.backendAlloc(d, segSize, stream, !expandable)
	if err != nil && !errors.Is(err, ErrBackendOutOfMemory) {
		err = fmt.Errorf("pool %q: alloc %d-byte segment on device %d from %s backend: %w",
			p.name, segSize, d.id, p.backend.Name(), err)
	}
	return nil, addr, err
}

// errLimit marks an allocation refused by the pool's own limit; it wraps
// ErrBackendOutOfMemory so that it takes the same release-and-retry path.
var errLimit = fmt.Errorf("pool limit reached: %w", ErrBackendOutOfMemory)

// backendAlloc obtains a segment of size bytes, counted in the budget
// (reserved there before the backend is asked, so that pools sharing the
// budget cannot pass its limit together); the caller counts it in the
// device's stats. Unless checkLimit, the caller checked the limit itself
// (obtainLocked), and the bytes are counted regardless.
func (p *Pool) backendAlloc(d *deviceState, size uint64, stream Stream, checkLimit bool) (uint64, error) {
	if !checkLimit {
		p.budget.add(d.id, int64(size))
	} else if !p.budget.reserve(d.id, size) {
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

// expandPage is the unit expandable segments of a pool kind are mapped in:
// torch's pages, SmallBuffer for the small pool and LargeBuffer for the
// large one, rounded up to a multiple of the backend's granularity (the
// unit it maps in).
func (p *Pool) expandPage(kind poolKind) uint64 {
	return roundUp(expandablePage(kind), p.expander.Granularity())
}

// expandablePage is torch's page size for expandable segments of kind.
func expandablePage(kind poolKind) uint64 {
	if kind == kindSmall {
		return SmallBuffer
	}
	return LargeBuffer
}

// reserveLocked is the address space torch reserves for an expandable
// segment of kind on d: whole pages for 1 1/8 times the device's memory.
// Best fit ranks the free tail of a segment by what it could grow to
// within it (growableSize). Read from the backend once per device; a
// backend that cannot tell gets an effectively unbounded reservation.
func (p *Pool) reserveLocked(d *deviceState, kind poolKind) uint64 {
	if r := d.reserve[kind]; r != 0 {
		return r
	}
	r := uint64(MaxRequest)
	if total, _, err := p.backend.Capacity(d.id); err == nil && total > 0 {
		r = roundUp(total+total/8, p.expandPage(kind))
	}
	d.reserve[kind] = r
	return r
}

// growLocked serves a request from the stream's expandable segments of
// the pool kind, as torch's find_expandable_block and map_block do: from
// the lowest address, over all of them, where free blocks and unmapped
// space (holes a PageMapper left, then a segment's end) together hold it,
// it maps pages (mapping into holes, growing the segment at its end) and
// returns the free block they make, taken out of the free lists. It
// returns (nil, nil) when the stream has no expandable segment there yet or
// none has room for the request (torch then makes a new segment), and an
// error wrapping ErrBackendOutOfMemory when the backend refuses the pages;
// pages mapped before stay, as a free block. The caller checked the limit
// (obtainLocked).
func (p *Pool) growLocked(d *deviceState, rounded uint64, kind poolKind, stream Stream) (*block, error) {
	seg, c, ok := p.expandableTargetLocked(d, rounded, kind, stream)
	if !ok {
		return nil, nil // torch makes a new segment: no reservation has room
	}
	page := p.expandPage(kind)
	f := d.freeList(stream)
	var cur *block // the free block being made, out of the free lists
	if c != nil && c.inFree {
		d.removeFree(f, c)
		cur = c
	}
	for cur == nil || cur.size < rounded {
		var have uint64
		h := c // the hole or end to map next: nil is the segment's end
		if cur != nil {
			have, h = cur.size, cur.next
		}
		need := roundUp(rounded-have, page)
		if h != nil {
			need = min(need, h.size)
		}
		if err := p.mapPagesLocked(d, seg, h, need); err != nil {
			if cur != nil {
				d.insertFree(f, cur) // torch keeps what it mapped
			}
			return nil, err
		}
		switch {
		case h == nil && cur == nil:
			cur = p.newBlock()
			cur.seg, cur.addr, cur.size = seg, seg.addr+seg.size-need, need
			p.linkAfter(seg.last, cur)
		case h == nil:
			cur.size += need
		case cur == nil && need == h.size:
			h.unmapped = false
			cur = h
		case cur == nil:
			cur = p.newBlock()
			cur.seg, cur.addr, cur.size = seg, h.addr, need
			p.linkBefore(h, cur)
			h.addr += need
			h.size -= need
		case need == h.size:
			cur.size += need
			p.unlink(h)
		default:
			cur.size += need
			h.addr += need
			h.size -= need
		}
		if nb := cur.next; nb != nil && nb.inFree {
			// A hole mapped whole: the free block after it joins, as
			// torch's map_block merges the mapped block with it.
			d.removeFree(f, nb)
			cur.size += nb.size
			p.unlink(nb)
		}
	}
	return cur, nil
}

// expandableTargetLocked is the segment and the place in it (see
// expandableCandidate) where torch's find_expandable_block maps pages for a
// request of rounded bytes on stream in the pool kind: torch looks through
// the unmapped blocks of every expandable segment of the stream there,
// lowest address first, so an older segment's hole comes before the newest
// segment's end. ok is false when none has room.
func (p *Pool) expandableTargetLocked(d *deviceState, rounded uint64, kind poolKind, stream Stream) (seg *segment, c *block, ok bool) {
	reserve := p.reserveLocked(d, kind)
	segs := d.expScratch[:0]
	for _, s := range d.segments {
		if s.expandable && s.stream == stream && s.kind == kind {
			segs = append(segs, s)
		}
	}
	if len(segs) > 1 {
		sort.Slice(segs, func(i, j int) bool { return segs[i].addr < segs[j].addr })
	}
	for _, s := range segs {
		if c, ok = expandableCandidate(s, rounded, reserve); ok {
			seg = s
			break
		}
	}
	clear(segs)
	d.expScratch = segs[:0]
	return seg, c, ok
}

// expandableCandidate is where torch's find_expandable_block starts to map
// for a request of rounded bytes in seg, whose reservation is reserve
// bytes: the lowest hole (or the free block before it) from which free and
// unmapped blocks, and past the segment's end the rest of its reservation,
// hold the request; else the free last block, or nil for the segment's
// end, when the end has room. ok is false when nothing in seg has room.
func expandableCandidate(seg *segment, rounded, reserve uint64) (c *block, ok bool) {
	room := func(c *block) bool {
		var n uint64
		x := c
		for ; x != nil && (x.inFree || x.unmapped) && n < rounded; x = x.next {
			n += x.size
		}
		if x == nil && n < rounded {
			n += reserve - min(reserve, seg.size)
		}
		return n >= rounded
	}
	if seg.holes > 0 {
		for h := seg.first; h != nil; h = h.next {
			if !h.unmapped {
				continue
			}
			c := h
			if h.prev != nil && h.prev.inFree {
				c = h.prev
			}
			if room(c) {
				return c, true
			}
		}
	}
	if seg.last.inFree {
		return seg.last, room(seg.last)
	}
	return nil, reserve-min(reserve, seg.size) >= rounded
}

// mapPagesLocked maps n bytes of pages into hole h of seg (PageMapper), or
// at its end when h is nil (Expander), and counts them, in the budget too
// (obtainLocked checked the limit).
func (p *Pool) mapPagesLocked(d *deviceState, seg *segment, h *block, n uint64) error {
	p.budget.add(d.id, int64(n))
	at := seg.addr + seg.size
	var err error
	if h == nil {
		err = p.expander.Expand(d.id, seg.addr, seg.size, n, seg.stream)
	} else {
		at = h.addr
		err = p.mapper.Map(d.id, seg.addr, seg.size, h.addr-seg.addr, n, seg.stream)
	}
	if err != nil {
		p.budget.add(d.id, -int64(n))
		return fmt.Errorf("pool %q: map %d bytes at %#x of segment %#x on device %d: %w", p.name, n, at, seg.addr, d.id, err)
	}
	if h == nil {
		seg.size += n
	} else {
		seg.holes -= n
	}
	p.trace(ActionSegmentMap, d.id, at, n, seg.stream)
	d.stats.NumDeviceAlloc++
	d.stats.NumExpansions++
	d.stats.ReservedBytes.add(seg.kind, int64(n)) // the budget counted it above
	p.syncOversize(d, seg)
	return nil
}

// linkBefore puts block n right before b in b's segment.
func (p *Pool) linkBefore(b, n *block) {
	n.prev, n.next = b.prev, b
	if b.prev != nil {
		b.prev.next = n
	} else {
		b.seg.first = n
	}
	b.prev = n
}
