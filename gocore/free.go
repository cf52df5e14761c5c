package gocore

import "fmt"

// Free returns the block at addr to the pool. If the block was used on
// streams other than its own (RecordStream), it becomes reusable only once
// events recorded now on those streams complete; until then it counts as
// active but not allocated.
func (p *Pool) Free(addr uint64) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.freeLocked(addr)
}

func (p *Pool) freeLocked(addr uint64) error {
	if p.closed {
		return p.closedErrorLocked("free", addr)
	}
	b := p.live.take(addr)
	if b == nil {
		return p.notAllocatedLocked("free", addr)
	}
	d := p.devices[b.seg.device]
	kind := b.seg.kind
	st := &d.stats
	st.Allocation.down(kind, 1)
	st.AllocatedBytes.down(kind, int64(b.size))
	if p.isOversize(b.size) {
		st.OversizeAllocations.down(1)
	}
	b.allocated = false
	// Like torch, history carries the caller's size; b.requested, and
	// Stats.RequestedBytes with it, are kept until the block is inactive
	// (a pending block still counts, as in active_bytes).
	p.trace(ActionFreeRequested, d.id, b.addr, b.requested, b.seg.stream)
	if len(b.streamUses) > 0 {
		if p.capturingLocked() {
			// No event may be recorded during a capture (in the process:
			// one on the legacy stream would break a blocking stream's):
			// the block waits, unusable, for ExitCapture or, after another
			// pool's capture, the next processing of events, to record them.
			b.pending = 1
			d.unrecorded = append(d.unrecorded, b)
			return nil
		}
		return p.deferFreeLocked(d, b)
	}
	p.freeBlockLocked(d, b)
	return nil
}

// liveBlockLocked returns the allocated block at addr, or the error that
// explains why there is none (closed pool, double free, foreign pointer).
func (p *Pool) liveBlockLocked(op string, addr uint64) (*block, error) {
	if p.closed {
		return nil, p.closedErrorLocked(op, addr)
	}
	if b := p.live.get(addr); b != nil {
		return b, nil
	}
	return nil, p.notAllocatedLocked(op, addr)
}

// closedErrorLocked is the error of an operation on addr in a closed pool.
func (p *Pool) closedErrorLocked(op string, addr uint64) error {
	return fmt.Errorf("%s %#x in pool %q: %w", op, addr, p.name, ErrClosed)
}

// notAllocatedLocked builds the error for an address that is not a live
// block: a double free (or interior pointer) when it lies inside one of the
// pool's segments, an unknown pointer otherwise.
func (p *Pool) notAllocatedLocked(op string, addr uint64) error {
	for _, d := range p.devices {
		if d == nil {
			continue
		}
		if s := d.segmentContaining(addr); s != nil {
			for b := s.first; b != nil; b = b.next {
				if (b.allocated || b.pending > 0) && addr > b.addr && addr < b.addr+b.size {
					return fmt.Errorf("%s %#x in pool %q: %#x is %d bytes into the block %#x+%d: %w",
						op, addr, p.name, addr, addr-b.addr, b.addr, b.size, ErrInteriorPointer)
				}
			}
			return fmt.Errorf("%s %#x in pool %q (segment %#x+%d on device %d): %w",
				op, addr, p.name, s.addr, s.size, d.id, ErrDoubleFree)
		}
	}
	return fmt.Errorf("%s %#x in pool %q: %w", op, addr, p.name, ErrUnknownPointer)
}

func (d *deviceState) segmentContaining(addr uint64) *segment {
	for _, s := range d.segments {
		if addr >= s.addr && addr < s.addr+s.size {
			return s
		}
	}
	return nil
}

// RecordStream marks the block at addr as used on stream, so that after it
// is freed it is not reused on its own stream before the work queued on
// stream up to the free has completed (torch's Tensor.record_stream).
func (p *Pool) RecordStream(addr uint64, stream Stream) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	b, err := p.liveBlockLocked("record stream for", addr)
	if err != nil {
		return err
	}
	if stream == b.seg.stream {
		return nil
	}
	for _, s := range b.streamUses {
		if s == stream {
			return nil
		}
	}
	b.streamUses = append(b.streamUses, stream)
	p.trace(ActionRecordStream, b.seg.device, addr, b.size, stream)
	p.devices[b.seg.device].stats.NumRecordStream++
	return nil
}

// freeBlockLocked makes an inactive block free: it merges it with free
// neighbours, indexes it, and applies the release threshold.
func (p *Pool) freeBlockLocked(d *deviceState, b *block) {
	kind := b.seg.kind
	d.stats.Active.down(kind, 1)
	d.stats.ActiveBytes.down(kind, int64(b.size))
	d.stats.RequestedBytes.down(kind, int64(b.requested))
	p.trace(ActionFreeCompleted, d.id, b.addr, b.requested, b.seg.stream)
	b.requested = 0
	b.callerSized = false
	b.streamUses = b.streamUses[:0]
	f := d.freeList(b.seg.stream)
	// The free neighbours merged into b leave the index, then b enters it:
	// removeFree of each and insertFree of b, written out here so that the
	// hot path makes one call per index operation, with the inactive_split
	// counts applied in one pass (a neighbour is always split: b is beside
	// it).
	tree := f.treeFor(b.seg) // nil: the small bins
	var merged, mergedBytes int64
	if n := b.next; n != nil && n.inFree {
		if tree == nil {
			f.small.remove(n)
		} else {
			tree.Delete(n)
		}
		n.inFree = false
		merged++
		mergedBytes += int64(n.size)
		b.size += n.size
		b.next = n.next
		if b.next != nil {
			b.next.prev = b
		} else {
			b.seg.last = b
		}
		p.dropBlock(n)
	}
	if pr := b.prev; pr != nil && pr.inFree {
		if tree == nil {
			f.small.remove(pr)
		} else {
			tree.Delete(pr)
		}
		pr.inFree = false
		merged++
		mergedBytes += int64(pr.size)
		pr.size += b.size
		pr.next = b.next
		if pr.next != nil {
			pr.next.prev = pr
		} else {
			pr.seg.last = pr
		}
		p.dropBlock(b)
		b = pr
	}
	if tree == nil {
		f.small.insert(b)
	} else {
		tree.ReplaceOrInsert(b)
	}
	b.inFree = true
	seg := b.seg
	if !b.isSplit() {
		d.addWholeFree(seg)
		if merged > 0 && !seg.expandable {
			d.stats.InactiveSplit.down(kind, merged)
			d.stats.InactiveSplitBytes.down(kind, mergedBytes)
		}
	} else if !seg.expandable {
		d.stats.InactiveSplit.swap(kind, merged, 1)
		d.stats.InactiveSplitBytes.swap(kind, mergedBytes, int64(b.size))
	}
	p.applyReleaseThresholdLocked(d, b.seg)
}

// applyReleaseThresholdLocked gives cached memory of d back while more than
// the release threshold is unused: wholly free segments (whichever freed
// block pushed the total over, in this segment or another), then free tails
// of expandable segments. After a free in seg, only seg's tail can have
// grown, so the guard keeps a free O(1) when nothing could go back; a nil
// seg (the end of a capture) or a release a capture held back looks at all.
// A failed release leaves the segment cached.
func (p *Pool) applyReleaseThresholdLocked(d *deviceState, seg *segment) {
	if t := p.cfg.ReleaseThreshold; t != 0 && d.unusedBytes() > t {
		p.releaseOverThresholdLocked(d, seg, t)
	}
}

// releaseOverThresholdLocked is applyReleaseThresholdLocked once d keeps more
// than t unused bytes, kept apart so that the check above stays small enough
// to be inlined into every free.
func (p *Pool) releaseOverThresholdLocked(d *deviceState, seg *segment, t uint64) {
	if p.holdingSegmentsLocked() {
		// A capture, here or elsewhere in the process: released when it is
		// over (processEventsLocked, or the next free that gets here).
		d.releaseHeld = !p.cfg.KeepSegments
		return
	}
	if seg == nil || d.releaseHeld || len(d.wholeFree) > 0 || (p.shrinker != nil && p.shrinkable(seg) > 0) ||
		(p.mapper != nil && seg.expandable) {
		d.releaseHeld = false
		_, _ = p.trimLocked(d, t)
	}
}

// BlockInfo describes a live block and the segment holding it.
type BlockInfo struct {
	Device      int
	Addr, Size  uint64
	SegmentAddr uint64
	SegmentSize uint64
	Stream      Stream
}

// Lookup describes the allocated block at addr (for IPC export).
func (p *Pool) Lookup(addr uint64) (BlockInfo, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	b, err := p.liveBlockLocked("look up", addr)
	if err != nil {
		return BlockInfo{}, err
	}
	return BlockInfo{Device: b.seg.device, Addr: b.addr, Size: b.size, SegmentAddr: b.seg.addr,
		SegmentSize: b.seg.size, Stream: b.seg.stream}, nil
}
