package gocore

import (
	"errors"
	"fmt"
)

// SeedBlock is one block of a segment that SeedSegment makes: Size bytes
// (a multiple of MinBlockSize), allocated for a request of Requested bytes
// when Live, else cached.
type SeedBlock struct {
	Size, Requested uint64
	Live            bool
}

// SeedSegment makes a segment of the given blocks, in address order, on
// device dev for stream, as if the pool had obtained it (from its backend,
// within its limit) and then served and freed requests until it held them:
// the live blocks are allocated (their addresses are returned, in order)
// and the others are cached, merged with free neighbours as a free would
// merge them. small puts the segment in the small pool (torch's 2 MiB
// segments for requests of up to 1 MiB), else in the large one.
//
// A replay of a trace that starts in the middle of a run seeds the pool
// with the recording allocator's segments at the first event, so that it
// starts where that allocator was instead of from an empty device: which
// cached block best fit takes, and whether a request needs a new segment,
// depend on them. Pools with expandable segments cannot be seeded: their
// segments grow page by page, and a snapshot's layout of one has no
// counterpart here.
func (p *Pool) SeedSegment(dev int, stream Stream, small bool, blocks []SeedBlock) ([]uint64, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, fmt.Errorf("seed segment in pool %q: %w", p.name, ErrClosed)
	}
	if p.expander != nil {
		return nil, fmt.Errorf("seed segment in pool %q: a pool with expandable segments cannot be seeded: %w",
			p.name, ErrInvalidArgument)
	}
	if len(blocks) == 0 {
		return nil, fmt.Errorf("seed segment in pool %q: no blocks: %w", p.name, ErrInvalidArgument)
	}
	var total uint64
	for i, sb := range blocks {
		if sb.Size == 0 || sb.Size%MinBlockSize != 0 || sb.Size > MaxRequest {
			return nil, fmt.Errorf("seed segment in pool %q: block %d has size %d (a multiple of %d in [%d, %d]): %w",
				p.name, i, sb.Size, MinBlockSize, MinBlockSize, uint64(MaxRequest), ErrInvalidSize)
		}
		if sb.Live && sb.Requested > sb.Size {
			return nil, fmt.Errorf("seed segment in pool %q: block %d of %d bytes has a request of %d: %w",
				p.name, i, sb.Size, sb.Requested, ErrInvalidSize)
		}
		total += sb.Size
		if total > MaxRequest {
			return nil, fmt.Errorf("seed segment in pool %q: blocks total more than %d bytes: %w",
				p.name, uint64(MaxRequest), ErrInvalidSize)
		}
	}
	if small && total > SmallBuffer {
		// The small pool's bins index blocks of at most SmallBuffer bytes.
		return nil, fmt.Errorf("seed segment in pool %q: a small segment holds at most %d bytes, got %d: %w",
			p.name, uint64(SmallBuffer), total, ErrInvalidArgument)
	}
	d, err := p.device(dev)
	if err != nil {
		return nil, fmt.Errorf("seed segment: %w", err)
	}
	kind := kindLarge
	if small {
		kind = kindSmall
	}
	addr, err := p.backendAlloc(d, total, stream, true)
	if errors.Is(err, ErrBackendOutOfMemory) {
		oom := &OutOfMemoryError{Pool: p.name, Backend: p.backend.Name(), Device: d.id, Requested: total,
			Segment: total, Reserved: uint64(d.stats.ReservedBytes[0].Current), Limit: p.limitLocked(d.id)}
		if !errors.Is(err, errLimit) {
			oom.Cause = err
		}
		return nil, oom
	}
	if err != nil {
		return nil, fmt.Errorf("seed %d-byte segment in pool %q on device %d: %w", total, p.name, d.id, err)
	}
	b := p.newSegmentLocked(d, addr, total, kind, stream, false)
	f := d.freeList(stream)
	live := make([]uint64, 0, len(blocks))
	var cached []uint64
	for i, sb := range blocks {
		var rest *block
		if i < len(blocks)-1 {
			p.splitLocked(d, f, b, sb.Size)
			rest = b.next
			d.removeFree(f, rest)
		}
		requested := sb.Requested
		if !sb.Live || requested == 0 {
			requested = sb.Size
		}
		// Sized by the recording's allocator, not by this pool's rounding
		// (whose roundup_power2_divisions may differ): as AllocSegment's.
		p.handOutLocked(d, b, requested, kind, stream, sb.Live)
		if sb.Live {
			live = append(live, b.addr)
		} else {
			cached = append(cached, b.addr)
		}
		b = rest
	}
	// Cached blocks are freed as any block is (merging, indexing, the
	// release threshold), in address order.
	for _, a := range cached {
		if err := p.freeLocked(a); err != nil {
			return nil, fmt.Errorf("seed segment in pool %q: %w", p.name, err)
		}
	}
	return live, nil
}

// ResetPeakStats makes every peak of the pool's statistics its current
// value, on every device (torch's reset_peak_memory_stats).
func (p *Pool) ResetPeakStats() {
	p.eachStat(func(st *Stat) { st.Peak = st.Current }, nil)
}

// ResetAccumulatedStats zeroes the running totals of the pool's statistics
// (the allocated and freed counts of each stat and the Num counters), on
// every device (torch's reset_accumulated_memory_stats); current values and
// peaks stay.
func (p *Pool) ResetAccumulatedStats() {
	p.eachStat(func(st *Stat) { st.Allocated, st.Freed = 0, 0 }, func(s *Stats) {
		s.NumAllocRetries, s.NumOOMs, s.NumDeviceAlloc, s.NumDeviceFree = 0, 0, 0, 0
		s.NumCacheHits, s.NumRecordStream, s.NumExpansions, s.NumGCReleases, s.NumSyncAllStreams = 0, 0, 0, 0, 0
	})
}

// eachStat calls stat on every Stat of every device's statistics, then
// whole (if not nil) on each device's Stats, under the pool's lock.
func (p *Pool) eachStat(stat func(*Stat), whole func(*Stats)) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, d := range p.devices {
		if d == nil {
			continue
		}
		s := &d.stats
		for _, a := range s.statArrays() {
			for k := range a {
				stat(&a[k])
			}
		}
		for _, st := range s.singleStats() {
			stat(st)
		}
		if whole != nil {
			whole(s)
		}
	}
}
