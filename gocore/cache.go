package gocore

import (
	"errors"
	"fmt"
	"sort"
)

// releaseSegmentLocked returns a wholly free segment to the backend: one
// free block, or free blocks and holes. On a backend error the segment
// stays cached and usable.
func (p *Pool) releaseSegmentLocked(d *deviceState, s *segment) error {
	if err := p.backend.Free(d.id, s.addr, s.size, s.stream); err != nil {
		return fmt.Errorf("pool %q: release %d-byte segment %#x on device %d: %w",
			p.name, s.size, s.addr, d.id, err)
	}
	f := d.freeList(s.stream)
	for b := s.first; b != nil; b = b.next {
		if b.inFree {
			d.removeFree(f, b)
		}
	}
	if f.empty() {
		d.dropFreeList(s.stream)
	}
	delete(d.segments, s.addr)
	if k := (growKey{s.stream, s.kind}); d.growing[k] == s {
		delete(d.growing, k)
	}
	p.traceRelease(d, s)
	d.stats.NumDeviceFree++
	d.countSegment(s, -1)
	p.addReserved(d, s.kind, -int64(s.mapped()))
	p.uncountOversize(d, s)
	return nil
}

// traceRelease records the release of segment s: a segment_free, or for an
// expandable segment, as torch writes it, a segment_unmap of each mapped
// range (torch drops the emptied address reservation untraced).
func (p *Pool) traceRelease(d *deviceState, s *segment) {
	if p.hist == nil {
		return
	}
	if !s.expandable {
		p.record(ActionSegmentFree, d.id, s.addr, s.size, s.stream)
		return
	}
	var start, n uint64
	for b := s.first; b != nil; b = b.next {
		if b.unmapped {
			if n > 0 {
				p.record(ActionSegmentUnmap, d.id, start, n, s.stream)
			}
			n = 0
			continue
		}
		if n == 0 {
			start = b.addr
		}
		n += b.size
	}
	if n > 0 {
		p.record(ActionSegmentUnmap, d.id, start, n, s.stream)
	}
}

// countSegment adds delta to Stats.Segment for s, unless s is expandable:
// torch counts in its segment stat only the segments of cudaMalloc, never
// its expandable segments (their pages count in reserved bytes alone).
func (d *deviceState) countSegment(s *segment, delta int64) {
	if !s.expandable {
		d.stats.Segment.add(s.kind, delta)
	}
}

// syncOversize keeps Stats.OversizeSegments in step with the size of s,
// after s was created, grew or shrank.
func (p *Pool) syncOversize(d *deviceState, s *segment) {
	if o := p.oversizeSegment(s); o != s.oversize {
		s.oversize = o
		if o {
			d.stats.OversizeSegments.add(1)
		} else {
			d.stats.OversizeSegments.add(-1)
		}
	}
}

// oversizeSegment reports whether s counts in Stats.OversizeSegments: a
// segment of MaxSplitSize or more, unless expandable (torch counts only
// the segments of cudaMalloc there, not the pages it maps).
func (p *Pool) oversizeSegment(s *segment) bool {
	return !s.expandable && p.isOversize(s.size)
}

// uncountOversize takes a segment that goes back out of
// Stats.OversizeSegments.
func (p *Pool) uncountOversize(d *deviceState, s *segment) {
	if s.oversize {
		s.oversize = false
		d.stats.OversizeSegments.add(-1)
	}
}

// holdingSegmentsLocked reports whether no segment may go back now: the pool
// keeps its segments (Config.KeepSegments), or a capture is under way, its
// own (EnterCapture) or anywhere in the process (AddProcessCaptures). Close
// releases them regardless.
func (p *Pool) holdingSegmentsLocked() bool {
	return p.cfg.KeepSegments || p.captures > 0 || processCaptures.Load() > 0
}

// trimLocked releases whole free segments, largest first, then (with a
// Shrinker backend) the free tails of expandable segments, largest first,
// then (with a PageMapper backend) the other free pages of expandable
// segments, until the device's unused reserved bytes are at most keep. It
// returns the bytes released.
func (p *Pool) trimLocked(d *deviceState, keep uint64) (uint64, error) {
	if p.holdingSegmentsLocked() {
		return 0, nil
	}
	var released uint64
	var errs []error
	for _, s := range d.wholeFreeSegments() {
		if d.unusedBytes() <= keep {
			break
		}
		if err := p.releaseSegmentLocked(d, s); err != nil {
			errs = append(errs, err)
			continue
		}
		released += s.size
	}
	if p.shrinker != nil && d.unusedBytes() > keep {
		for _, s := range p.shrinkableSegments(d) {
			if d.unusedBytes() <= keep {
				break
			}
			n, err := p.shrinkTailLocked(d, s)
			errs = append(errs, err)
			released += n
		}
	}
	if p.mapper != nil && d.unusedBytes() > keep {
		n, err := p.unmapFreePagesLocked(d, keep)
		errs = append(errs, err)
		released += n
	}
	return released, errors.Join(errs...)
}

// unmapFreePagesLocked gives back the whole pages inside the free blocks of
// d's expandable segments (PageMapper), lowest segment and address first,
// until at most keep unused bytes remain, as torch's release_blocks unmaps
// every free page of its expandable segments: the pages become holes, and
// a segment left with no page mapped goes back whole. Free tails are
// shrinkTailLocked's, but for one after a hole (its pages join the hole).
func (p *Pool) unmapFreePagesLocked(d *deviceState, keep uint64) (uint64, error) {
	var segs []*segment
	for _, s := range d.segments {
		if s.expandable {
			segs = append(segs, s)
		}
	}
	sort.Slice(segs, func(i, j int) bool { return segs[i].addr < segs[j].addr })
	var released uint64
	var errs []error
	for _, s := range segs {
		for b := s.first; b != nil && d.unusedBytes() > keep; b = b.next {
			if b.inFree && (b.next != nil || b.prev == nil || b.prev.unmapped) {
				var n uint64
				var err error
				b, n, err = p.unmapBlockPagesLocked(d, s, b)
				errs = append(errs, err)
				released += n
			}
		}
		if s.holes == s.size {
			errs = append(errs, p.releaseSegmentLocked(d, s))
		}
	}
	return released, errors.Join(errs...)
}

// unmapBlockPagesLocked unmaps the whole pages inside free block b of
// expandable segment s (pages counted from the segment's start, as torch
// maps them) and returns the bytes given back: b keeps the partial pages
// at its ends as free blocks, its pages become a hole, merged with holes
// beside it. It returns the block that now ends what b covered, for the
// caller's walk (b's blocks may have merged away). On a backend error b
// stays as it was.
func (p *Pool) unmapBlockPagesLocked(d *deviceState, s *segment, b *block) (*block, uint64, error) {
	page := p.expandPage(s.kind)
	start := s.addr + roundUp(b.addr-s.addr, page)
	end := s.addr + (b.addr+b.size-s.addr)/page*page
	if end <= start {
		return b, 0, nil
	}
	n := end - start
	if err := p.mapper.Unmap(d.id, s.addr, s.size, start-s.addr, n, s.stream); err != nil {
		return b, 0, fmt.Errorf("pool %q: unmap %d free bytes at %#x of segment %#x on device %d: %w",
			p.name, n, start, s.addr, d.id, err)
	}
	f := d.freeList(s.stream)
	d.removeFree(f, b)
	var rest *block
	if after := b.addr + b.size - end; after > 0 {
		rest = p.newBlock()
		rest.seg, rest.addr, rest.size = s, end, after
		p.linkAfter(b, rest)
		d.insertFree(f, rest)
	}
	if before := start - b.addr; before > 0 {
		hole := p.newBlock()
		hole.seg, hole.addr, hole.size = s, start, n
		p.linkAfter(b, hole)
		b.size = before
		d.insertFree(f, b)
		b = hole
	} else {
		b.size = n
	}
	b.unmapped = true
	b = p.mergeHoles(b)
	s.holes += n
	p.trace(ActionSegmentUnmap, d.id, start, n, s.stream)
	d.stats.NumDeviceFree++
	p.addReserved(d, s.kind, -int64(n))
	if rest != nil {
		return rest, n, nil
	}
	return b, n, nil
}

// linkAfter puts block n right after b in b's segment.
func (p *Pool) linkAfter(b, n *block) {
	n.prev, n.next = b, b.next
	if b.next != nil {
		b.next.prev = n
	} else {
		b.seg.last = n
	}
	b.next = n
}

// unlink takes block b out of its segment's list and drops it.
func (p *Pool) unlink(b *block) {
	if b.prev != nil {
		b.prev.next = b.next
	} else {
		b.seg.first = b.next
	}
	if b.next != nil {
		b.next.prev = b.prev
	} else {
		b.seg.last = b.prev
	}
	p.dropBlock(b)
}

// mergeHoles merges hole h with the holes beside it, as torch merges
// unmapped blocks; it returns the merged hole.
func (p *Pool) mergeHoles(h *block) *block {
	if n := h.next; n != nil && n.unmapped {
		h.size += n.size
		p.unlink(n)
	}
	if pr := h.prev; pr != nil && pr.unmapped {
		pr.size += h.size
		p.unlink(h)
		h = pr
	}
	return h
}

// shrinkable is how many bytes at the end of s can go back: an expandable
// segment, partly in use, whose last block is free gives back its pages
// after the last one in use (torch unmaps the pages wholly inside a free
// block). The end of s need not lie on a page: a backend may have given
// back less than asked, or learnt a coarser granularity since (a backend
// learns a device's only when it first uses it); the tail is then rounded
// down to whole granules, and may be none.
func (p *Pool) shrinkable(s *segment) uint64 {
	return shrinkableIn(s, p.expandPage(s.kind), p.expander.Granularity())
}

// shrinkableIn is shrinkable for pages of page bytes, given back in
// granules of g.
func shrinkableIn(s *segment, page, g uint64) uint64 {
	last := s.last
	if !s.expandable || !last.inFree || last.prev == nil {
		return 0 // wholly free segments are released whole
	}
	keep := roundUp(last.addr-s.addr, page)
	if keep >= s.size {
		return 0
	}
	return (s.size - keep) / g * g
}

// shrinkableSegments lists the segments of d with a free tail to give back,
// the largest tail first, then by address. O(segments): for the release
// paths, not the hot path.
func (p *Pool) shrinkableSegments(d *deviceState) []*segment {
	var segs []*segment
	for _, s := range d.segments {
		if p.shrinkable(s) > 0 {
			segs = append(segs, s)
		}
	}
	sort.Slice(segs, func(i, j int) bool {
		if a, b := p.shrinkable(segs[i]), p.shrinkable(segs[j]); a != b {
			return a > b
		}
		return segs[i].addr < segs[j].addr
	})
	return segs
}

// shrinkTailLocked gives the free tail of expandable segment s back to the
// backend (Shrinker), as torch unmaps the free pages of its expandable
// segments, and returns the bytes given back. On a backend error s stays
// as it was.
func (p *Pool) shrinkTailLocked(d *deviceState, s *segment) (uint64, error) {
	// One reading of the granularity for the request and the check of the
	// answer: a backend shared with other pools (torch's private pools) may
	// learn a larger one meanwhile, when a device is first used.
	g := p.expander.Granularity()
	less := shrinkableIn(s, roundUp(expandablePage(s.kind), g), g)
	if less == 0 {
		return 0, nil
	}
	released, err := p.shrinker.Shrink(d.id, s.addr, s.size, less, s.stream)
	if err != nil {
		return 0, fmt.Errorf("pool %q: give back the %d-byte free tail of segment %#x on device %d: %w",
			p.name, less, s.addr, d.id, err)
	}
	if released == 0 {
		return 0, nil
	}
	if released > less || released%g != 0 {
		// The backend broke the Shrinker contract: the segment no longer
		// matches its blocks, so say so rather than guess.
		return 0, fmt.Errorf("pool %q: backend %s shrank segment %#x on device %d by %d bytes, asked for at most %d in granules of %d: %w",
			p.name, p.backend.Name(), s.addr, d.id, released, less, g, ErrInvariant)
	}
	last := s.last
	f := d.freeList(s.stream)
	d.removeFree(f, last)
	s.size -= released
	last.size -= released
	if last.size == 0 { // the tail started on a granule: its block goes
		s.last = last.prev
		s.last.next = nil
		p.dropBlock(last)
	} else {
		d.insertFree(f, last)
	}
	p.trace(ActionSegmentUnmap, d.id, s.addr+s.size, released, s.stream)
	d.stats.NumDeviceFree++
	p.addReserved(d, s.kind, -int64(released))
	p.syncOversize(d, s)
	if s.holes == s.size {
		// The tail was all that was mapped (the rest are holes that
		// unmapFreePagesLocked made): nothing is left, so the segment goes
		// whole, as there.
		if err := p.releaseSegmentLocked(d, s); err != nil {
			return released, err
		}
	}
	return released, nil
}

// releaseCachedLocked is trimLocked after freeing parked blocks whose events
// completed.
func (p *Pool) releaseCachedLocked(d *deviceState, keep uint64) (uint64, error) {
	if len(d.pending) > 0 || len(d.unrecorded) > 0 {
		p.processEventsLocked(d)
	}
	return p.trimLocked(d, keep)
}

// releaseOversizeLocked is torch's release_available_cached_blocks, the
// first answer to an allocation the backend (or the limit) refused when a
// max split size is set: it gives back the smallest cached oversize segment
// of the stream's free lists f that is at least the request (and at least
// MaxSplitSize), or else the largest oversize ones, largest first, until
// their bytes reach that much. It reports whether it released enough; what
// it released when it could not stays released, as in torch. Expandable
// segments are skipped, and small requests find nothing (small blocks are
// never oversize).
func (p *Pool) releaseOversizeLocked(d *deviceState, f *streamFree, rounded uint64) bool {
	maxSplit := p.cfg.MaxSplitSize
	if kindOf(rounded) == kindSmall {
		return false
	}
	key := max(rounded, maxSplit)
	f.pivot.size, f.pivot.addr = key, 0
	var found *block
	f.large.AscendGreaterOrEqual(&f.pivot, func(b *block) bool {
		found = b
		return false
	})
	if found != nil && !found.seg.expandable {
		// A free block of MaxSplitSize or more is a whole segment: nothing
		// that large is ever split off (isSplit guards all the same).
		return !found.isSplit() && p.releaseSegmentLocked(d, found.seg) == nil
	}
	var victims []*segment
	var total uint64
	f.large.DescendLessOrEqual(&f.pivot, func(b *block) bool {
		if total >= key || b.size < maxSplit {
			return false
		}
		if !b.seg.expandable && !b.isSplit() {
			victims = append(victims, b.seg)
			total += b.size
		}
		return true
	})
	for _, s := range victims {
		if p.releaseSegmentLocked(d, s) != nil {
			total -= s.size // a failed release leaves the segment cached
		}
	}
	return total >= key
}

// collectGarbageLocked is torch's garbage_collect_cached_blocks: when the
// device reserves more than GarbageCollectionThreshold of its limit, release
// whole cached large segments (not expandable ones) whose age, in large-pool
// searches since they became free, is at least the average age of such
// segments; repeat with the new average until enough is released or nothing
// more goes. A failed release leaves the segment cached.
func (p *Pool) collectGarbageLocked(d *deviceState) {
	limit := p.limitLocked(d.id)
	if limit == 0 || p.holdingSegmentsLocked() {
		return
	}
	threshold := uint64(p.cfg.GarbageCollectionThreshold * float64(limit))
	// Against the limit's whole budget, as torch counts its graph pools in.
	reserved := p.budget.Reserved(d.id)
	if reserved <= threshold {
		return
	}
	target := reserved - threshold
	var cands []*segment
	var totalAge uint64
	for _, s := range d.wholeFree {
		if s.kind == kindLarge && !s.expandable {
			cands = append(cands, s)
			totalAge += d.largeLookups - s.wholeFreeSince
		}
	}
	sort.Slice(cands, func(i, j int) bool { // torch's order: size, then address
		if cands[i].size != cands[j].size {
			return cands[i].size < cands[j].size
		}
		return cands[i].addr < cands[j].addr
	})
	var reclaimed uint64
	for reclaimed < target && len(cands) > 0 {
		avg := float64(totalAge) / float64(len(cands))
		kept := cands[:0]
		for _, s := range cands {
			age := d.largeLookups - s.wholeFreeSince
			if float64(age) >= avg && p.releaseSegmentLocked(d, s) == nil {
				reclaimed += s.size
				totalAge -= age
				d.stats.NumGCReleases++
				continue
			}
			kept = append(kept, s)
		}
		if len(kept) == len(cands) {
			break // nothing more can go
		}
		cands = kept
	}
}

// EmptyCache returns every wholly free segment on every device to the
// backend, like torch.cuda.empty_cache(), and reports the bytes released.
// Like torch it first waits for the frees pending on other streams
// (RecordStream) when the backend is an EventSynchronizer, so that their
// blocks are released too. Segments that still hold a live block stay; with
// a Shrinker backend the free tails of expandable ones go back (whole
// pages), and with a PageMapper backend every free page of them, as torch
// unmaps them. It also forgets the free lists of streams that have nothing
// cached.
func (p *Pool) EmptyCache() (uint64, error) {
	return p.trim(-1, 0, true)
}

// Trim shrinks the cache of device dev (every device when dev < 0) until at
// most keep unused reserved bytes remain, releasing whole free segments
// largest first, then (with a Shrinker backend) the free tails of
// expandable segments and (with a PageMapper backend) their other free
// pages, like cudaMemPoolTrimTo. The pool stays usable.
func (p *Pool) Trim(dev int, keep uint64) (uint64, error) {
	return p.trim(dev, keep, false)
}

// trim is Trim; sync first waits for the pending frees (EmptyCache).
func (p *Pool) trim(dev int, keep uint64, sync bool) (uint64, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return 0, fmt.Errorf("trim pool %q: %w", p.name, ErrClosed)
	}
	var total uint64
	var errs []error
	for i, d := range p.devices {
		if d == nil || (dev >= 0 && i != dev) {
			continue
		}
		if sync && !p.holdingSegmentsLocked() {
			p.synchronizeEventsLocked(d)
		}
		n, err := p.releaseCachedLocked(d, keep)
		total += n
		errs = append(errs, err)
		d.dropEmptyFreeLists()
	}
	if dev >= len(p.devices) {
		return 0, fmt.Errorf("trim pool %q: device %d out of range [0, %d): %w", p.name, dev, len(p.devices), ErrInvalidDevice)
	}
	p.traceCacheCall(dev, keep, sync)
	return total, errors.Join(errs...)
}

// traceCacheCall records an EmptyCache (sync) or a Trim of device dev
// (every device when dev < 0) that was not refused, once it released what
// it could: one that failed on the way may have released some, and a
// replay must make the call there too.
func (p *Pool) traceCacheCall(dev int, keep uint64, sync bool) {
	if dev < 0 {
		dev = AllDevices
	}
	if sync {
		p.trace(ActionEmptyCache, dev, 0, 0, 0)
	} else {
		p.trace(ActionTrim, dev, 0, keep, 0)
	}
}

// Stats returns a copy of the pool's statistics on device dev, or summed over
// all devices when dev < 0.
func (p *Pool) Stats(dev int) (Stats, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var s Stats
	s.MaxSplitSize = maxSplitStat(p.cfg.MaxSplitSize)
	if dev >= len(p.devices) {
		return s, fmt.Errorf("stats of pool %q: device %d out of range [0, %d): %w", p.name, dev, len(p.devices), ErrInvalidDevice)
	}
	for i, d := range p.devices {
		if d != nil && (dev < 0 || i == dev) {
			s.Merge(&d.stats)
		}
	}
	return s, nil
}
