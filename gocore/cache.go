package gocore

import (
	"errors"
	"fmt"
	"sort"
)

// releaseSegmentLocked returns a wholly free segment to the backend. On a
// backend error the segment stays cached and usable.
func (p *Pool) releaseSegmentLocked(d *deviceState, s *segment) error {
	if err := p.backend.Free(d.id, s.addr, s.size, s.stream); err != nil {
		return fmt.Errorf("pool %q: release %d-byte segment %#x on device %d: %w",
			p.name, s.size, s.addr, d.id, err)
	}
	d.removeFree(d.freeList(s.stream), s.first)
	delete(d.segments, s.addr)
	if d.growing[s.stream] == s {
		delete(d.growing, s.stream)
	}
	p.trace(ActionSegmentFree, d.id, s.addr, s.size, s.stream)
	d.stats.NumDeviceFree++
	d.stats.Segment.add(s.kind, -1)
	d.stats.ReservedBytes.add(s.kind, -int64(s.size))
	if p.isOversize(s.size) {
		d.stats.OversizeSegments.add(-1)
	}
	return nil
}

// holdingSegmentsLocked reports whether no segment may go back now: the pool
// keeps its segments (Config.KeepSegments), or a capture is under way
// (EnterCapture). Close releases them regardless.
func (p *Pool) holdingSegmentsLocked() bool { return p.cfg.KeepSegments || p.captures > 0 }

// trimLocked releases whole free segments, largest first, until the device's
// unused reserved bytes are at most keep. It returns the bytes released.
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
	return released, errors.Join(errs...)
}

// releaseCachedLocked is trimLocked after freeing parked blocks whose events
// completed.
func (p *Pool) releaseCachedLocked(d *deviceState, keep uint64) (uint64, error) {
	if len(d.pending) > 0 {
		p.processEventsLocked(d)
	}
	return p.trimLocked(d, keep)
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
	reserved := uint64(d.stats.ReservedBytes[0].Current)
	if reserved <= threshold {
		return
	}
	target := reserved - threshold
	var cands []*segment
	var totalAge uint64
	for s, since := range d.wholeFree {
		if s.kind == kindLarge && !s.expandable {
			cands = append(cands, s)
			totalAge += d.largeLookups - since
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
			age := d.largeLookups - d.wholeFree[s]
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
// Segments that still hold a live block stay.
func (p *Pool) EmptyCache() (uint64, error) {
	return p.Trim(-1, 0)
}

// Trim shrinks the cache of device dev (every device when dev < 0) until at
// most keep unused reserved bytes remain, releasing whole free segments
// largest first, like cudaMemPoolTrimTo. The pool stays usable.
func (p *Pool) Trim(dev int, keep uint64) (uint64, error) {
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
		n, err := p.releaseCachedLocked(d, keep)
		total += n
		errs = append(errs, err)
	}
	if dev >= len(p.devices) {
		return 0, fmt.Errorf("trim pool %q: device %d out of range [0, %d): %w", p.name, dev, len(p.devices), ErrInvalidDevice)
	}
	return total, errors.Join(errs...)
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
