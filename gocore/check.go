package gocore

import (
	"errors"
	"fmt"
	"math/bits"
)

// ErrInvariant is wrapped by every violation CheckInvariants reports.
var ErrInvariant = errors.New("allocator invariant violated")

// CheckInvariants verifies the pool's internal consistency and returns every
// violation found (nil when consistent): each segment is tiled exactly by its
// blocks, no two free blocks are adjacent, free blocks are indexed under
// their own stream and nothing else is, each small bin is a min-heap on
// address, live blocks are exactly the allocated ones, every active block
// covers its request rounded by the pool's policy, and the current values of
// the stats equal a recount. It takes the pool's lock and is O(blocks): for
// tests and debugging.
func (p *Pool) CheckInvariants() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("pool %q: "+format+": %w", append([]any{p.name}, append(args, ErrInvariant)...)...))
	}
	allocatedSeen := 0
	for _, d := range p.devices {
		if d == nil {
			continue
		}
		var want Stats
		indexed := 0
		for _, s := range d.segments {
			if !s.expandable {
				want.Segment.add(s.kind, 1)
			}
			want.ReservedBytes.add(s.kind, int64(s.mapped()))
			if s.oversize != p.oversizeSegment(s) {
				bad("segment %#x (%d bytes): counted as oversize %v", s.addr, s.size, s.oversize)
			}
			if s.oversize {
				want.OversizeSegments.add(1)
			}
			if s.first == nil || s.first.prev != nil || s.first.addr != s.addr {
				bad("segment %#x: first block does not start it", s.addr)
				continue
			}
			end := s.addr
			var holes uint64
			for b := s.first; b != nil; b = b.next {
				if b.seg != s {
					bad("block %#x: wrong segment", b.addr)
				}
				if b.addr != end {
					bad("segment %#x: gap or overlap at %#x (block starts %#x)", s.addr, end, b.addr)
				}
				if b.size == 0 || b.size%MinBlockSize != 0 {
					bad("block %#x: size %d not a positive multiple of %d", b.addr, b.size, MinBlockSize)
				}
				end = b.addr + b.size
				if b.next != nil && b.next.prev != b {
					bad("block %#x: broken neighbour links", b.addr)
				}
				if b.unmapped {
					holes += b.size
					if !s.expandable || p.mapper == nil {
						bad("segment %#x: hole %#x in a segment that cannot have one", s.addr, b.addr)
					}
					if b.allocated || b.pending > 0 || b.inFree || b.heapIdx != -1 {
						bad("hole %#x is also in use or free", b.addr)
					}
					if b.next != nil && b.next.unmapped {
						bad("holes %#x and %#x were not merged", b.addr, b.next.addr)
					}
					continue
				}
				active := b.allocated || b.pending > 0
				if b.allocated {
					allocatedSeen++
					if p.live.get(b.addr) != b {
						bad("allocated block %#x missing from the live map", b.addr)
					}
					want.Allocation.add(s.kind, 1)
					want.AllocatedBytes.add(s.kind, int64(b.size))
					if p.isOversize(b.size) {
						want.OversizeAllocations.add(1)
					}
				}
				if active {
					want.Active.add(s.kind, 1)
					want.ActiveBytes.add(s.kind, int64(b.size))
					want.RequestedBytes.add(s.kind, int64(b.requested))
					if b.requested == 0 {
						bad("active block %#x (%d bytes) records no requested size", b.addr, b.size)
					} else if least := p.leastBlockSize(b.requested, b.callerSized); b.size < least {
						bad("block %#x: %d bytes for a %d-byte request that rounds to %d", b.addr, b.size, b.requested, least)
					}
					if b.inFree {
						bad("active block %#x is in a free list", b.addr)
					}
					if b.heapIdx != -1 {
						bad("active block %#x keeps small-bin index %d", b.addr, b.heapIdx)
					}
					continue
				}
				if !b.inFree {
					bad("free block %#x is not in a free list", b.addr)
					continue
				}
				indexed++
				if (s.kind != kindSmall || s.expandable) && b.heapIdx != -1 {
					bad("free block %#x of a segment outside the small bins has small-bin index %d", b.addr, b.heapIdx)
				}
				if !d.isIndexed(b) {
					bad("free block %#x is not indexed under stream %#x", b.addr, uint64(s.stream))
				}
				if b.next != nil && b.next.inFree {
					bad("free blocks %#x and %#x were not merged", b.addr, b.next.addr)
				}
				whole := s.wholeFreeAt >= 0 && s.wholeFreeAt < len(d.wholeFree) && d.wholeFree[s.wholeFreeAt] == s
				if b.isSplit() {
					if !s.expandable {
						want.InactiveSplit.add(s.kind, 1)
						want.InactiveSplitBytes.add(s.kind, int64(b.size))
					}
					if whole {
						bad("split segment %#x is listed as wholly free", s.addr)
					}
				} else if !whole {
					bad("wholly free segment %#x is not listed", s.addr)
				}
			}
			if holes != s.holes || holes >= s.size {
				bad("segment %#x: holes of %d bytes, %d counted, in %d bytes", s.addr, holes, s.holes, s.size)
			}
			if s.last == nil || s.last.next != nil || s.last.addr+s.last.size != s.addr+s.size {
				bad("segment %#x: last block does not end it", s.addr)
			}
			if s.expandable && p.expander == nil {
				bad("segment %#x: expandable in a pool whose backend does not grow segments", s.addr)
			}
			if end != s.addr+s.size {
				bad("segment %#x: blocks end at %#x, segment at %#x", s.addr, end, s.addr+s.size)
			}
		}
		if n := d.indexedCount(); n != indexed {
			bad("device %d: %d blocks indexed as free, %d free blocks in segments", d.id, n, indexed)
		}
		for st, f := range d.streams {
			if err := f.small.bitmapError(); err != nil {
				bad("device %d stream %#x: %v", d.id, uint64(st), err)
			}
			if err := f.small.heapOrderError(); err != nil {
				bad("device %d stream %#x: %v", d.id, uint64(st), err)
			}
		}
		for i, s := range d.wholeFree {
			if s.first == nil || s.first != s.last || !s.first.inFree {
				bad("device %d: segment %#x is listed as wholly free but is not one free block", d.id, s.addr)
			}
			if s.wholeFreeAt != i {
				bad("device %d: wholly free segment %#x listed at %d thinks it is at %d", d.id, s.addr, i, s.wholeFreeAt)
			}
			if d.segments[s.addr] != s {
				bad("device %d: wholly free segment %#x is not a live segment", d.id, s.addr)
			}
		}
		got := &d.stats
		pairs := []struct {
			name      string
			got, want *StatArray
		}{
			{"allocation", &got.Allocation, &want.Allocation}, {"segment", &got.Segment, &want.Segment},
			{"active", &got.Active, &want.Active}, {"inactive_split", &got.InactiveSplit, &want.InactiveSplit},
			{"allocated_bytes", &got.AllocatedBytes, &want.AllocatedBytes},
			{"reserved_bytes", &got.ReservedBytes, &want.ReservedBytes},
			{"active_bytes", &got.ActiveBytes, &want.ActiveBytes},
			{"inactive_split_bytes", &got.InactiveSplitBytes, &want.InactiveSplitBytes},
			{"requested_bytes", &got.RequestedBytes, &want.RequestedBytes},
		}
		for _, pr := range pairs {
			for k := range pr.got {
				if pr.got[k].Current != pr.want[k].Current {
					bad("device %d: stat %s[%d].current = %d, recount %d", d.id, pr.name, k, pr.got[k].Current, pr.want[k].Current)
				}
			}
		}
		for _, pr := range []struct {
			name      string
			got, want *Stat
		}{
			{"oversize_allocations", &got.OversizeAllocations, &want.OversizeAllocations},
			{"oversize_segments", &got.OversizeSegments, &want.OversizeSegments},
		} {
			if pr.got.Current != pr.want.Current {
				bad("device %d: stat %s.current = %d, recount %d", d.id, pr.name, pr.got.Current, pr.want.Current)
			}
		}
		if d.lastFree != nil && d.streams[d.lastStream] != d.lastFree {
			bad("device %d: cached free lists of stream %#x are not its lists", d.id, uint64(d.lastStream))
		}
		// The budget counts this pool's segments (and those of the pools
		// sharing it): never less than this pool's own.
		if own, budget := uint64(want.ReservedBytes[0].Current), p.budget.Reserved(d.id); budget < own {
			bad("device %d: budget counts %d reserved bytes, the pool alone holds %d", d.id, budget, own)
		}
	}
	if allocatedSeen != p.live.len() {
		bad("%d blocks in the live map, %d allocated blocks in segments", p.live.len(), allocatedSeen)
	}
	return errors.Join(errs...)
}

// leastBlockSize is the smallest block the pool's rounding policy gives a
// request of size bytes: 512-byte rounding, and for a block not sized by
// its caller (AllocSegment) the pool's roundup_power2_divisions. It is
// written apart from roundSize and roundPower2Divisions on purpose, so that
// a fault in those is caught here rather than repeated.
func (p *Pool) leastBlockSize(size uint64, callerSized bool) uint64 {
	least := (size + MinBlockSize - 1) &^ (MinBlockSize - 1) // MinBlockSize is a power of two
	if callerSized {
		return least
	}
	divisions := p.cfg.RoundupPower2Divisions
	if by := p.cfg.RoundupPower2DivisionsBySize; by != nil {
		// Interval 0 holds sizes under 2 MiB, interval i [2^(20+i), 2^(21+i)).
		divisions = by[min(max(bits.Len64(size)-21, 0), len(by)-1)]
	}
	if divisions < 2 || size <= MinBlockSize*divisions || bits.OnesCount64(size) == 1 {
		return least
	}
	step := (uint64(1) << (bits.Len64(size) - 1)) / divisions
	return max(least, size+(step-size%step)%step)
}

func (d *deviceState) isIndexed(b *block) bool {
	f := d.streams[b.seg.stream]
	if f == nil {
		return false
	}
	if b.seg.kind == kindSmall && !b.seg.expandable {
		h := f.small.bins[smallClass(b.size)]
		return b.heapIdx >= 0 && b.heapIdx < len(h) && h[b.heapIdx] == b
	}
	t := f.large
	if b.seg.kind == kindSmall {
		if t = f.smallExp; t == nil {
			return false
		}
	}
	got, ok := t.Get(b)
	return ok && got == b
}

// bitmapError says how the small bins' bitmaps disagree with the bins
// (nil when they agree): bestFit trusts them to find a class's blocks.
func (s *smallBins) bitmapError() error {
	for w, word := range s.nonEmpty {
		for i := range 64 {
			if has, set := len(s.bins[w*64+i]) > 0, word&(1<<i) != 0; has != set {
				return fmt.Errorf("small class %d: %d free blocks, bitmap bit %v", w*64+i, len(s.bins[w*64+i]), set)
			}
		}
		if set := s.nonEmptyWords&(1<<w) != 0; set != (word != 0) {
			return fmt.Errorf("small bitmap word %d is %#x, summary bit %v", w, word, set)
		}
	}
	return nil
}

// heapOrderError says where a bin breaks its min-heap order (on address, or
// segment age then address: blockBefore; nil when none does): bestFit trusts
// each bin's first entry to come first, and a misplaced entry deeper down
// would surface only later.
func (s *smallBins) heapOrderError() error {
	for c, h := range s.bins {
		for i := 1; i < len(h); i++ {
			if p := (i - 1) / 2; blockBefore(h[i], h[p], s.bySegment) {
				return fmt.Errorf("small class %d: free block %#x at %d is below %#x at %d", c, h[i].addr, i, h[p].addr, p)
			}
		}
	}
	return nil
}

func (d *deviceState) indexedCount() int {
	n := 0
	for _, f := range d.streams {
		for _, h := range f.small.bins {
			n += len(h)
		}
		n += f.large.Len()
		if f.smallExp != nil {
			n += f.smallExp.Len()
		}
	}
	return n
}
