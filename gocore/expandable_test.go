package gocore_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	. "github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/sim"
)

func TestExpandableSegmentGrowsInPlace(t *testing.T) {
	p, be := newTestPool(t, sim.Config{Expandable: true, Capacity: 64 * MiB}, Config{})
	a := mustAlloc(t, p, 0, 3*MiB, 0)
	s := stats(t, p)
	assert.EqualValues(t, 20*MiB, s.ReservedBytes[0].Current, "first segment: one 20 MiB page, as torch maps")
	assert.EqualValues(t, 17*MiB, s.ReservedBytes[0].Current-s.AllocatedBytes[0].Current, "the tail is kept")
	assert.Zero(t, s.InactiveSplitBytes[0].Current, "expandable segments are not in inactive_split (torch)")
	assert.Zero(t, s.Segment[0].Current, "nor in the segment count (torch)")
	b := mustAlloc(t, p, 0, 30*MiB, 0)
	assert.Equal(t, a+3*MiB, b, "grown in place, right after the first block")
	s = stats(t, p)
	assert.Zero(t, s.Segment[0].Current)
	assert.EqualValues(t, 40*MiB, s.ReservedBytes[0].Current, "the 17 MiB tail and one more page")
	assert.EqualValues(t, 1, s.NumExpansions)
	assert.EqualValues(t, 1, be.Stats().Expansions)
	assert.EqualValues(t, 1, be.Stats().Allocs)
	assert.Equal(t, 1, be.Stats().LiveSegments)

	// Memory freed in two pieces serves one larger block without the backend.
	require.NoError(t, p.Free(a))
	require.NoError(t, p.Free(b))
	c := mustAlloc(t, p, 0, 33*MiB, 0)
	assert.Equal(t, a, c)
	s = stats(t, p)
	assert.EqualValues(t, 1, s.NumCacheHits)
	assert.EqualValues(t, 2, s.NumDeviceAlloc)

	// Other streams grow segments of their own.
	d := mustAlloc(t, p, 0, 2*MiB, 9)
	assert.NotEqual(t, c+33*MiB, d)
	assert.Equal(t, 2, be.Stats().LiveSegments)
	assert.EqualValues(t, 60*MiB, stats(t, p).ReservedBytes[0].Current)

	// Out of device memory: growing fails, and so does a new segment,
	// before and after the cache is released (no free page to give back):
	// typed OOM.
	_, err := p.Alloc(0, 60*MiB, 0)
	require.ErrorIs(t, err, ErrOutOfMemory)
	s = stats(t, p)
	assert.EqualValues(t, 1, s.NumAllocRetries)
	assert.Equal(t, 2, be.Stats().LiveSegments)
	require.NoError(t, p.Free(c))
	require.NoError(t, p.Free(d))
	released, err := p.EmptyCache()
	require.NoError(t, err)
	assert.EqualValues(t, 60*MiB, released)
	assert.Zero(t, be.Stats().LiveSegments)
	// A released growing segment is forgotten; the next request starts anew.
	e := mustAlloc(t, p, 0, 5*MiB, 0)
	assert.EqualValues(t, 20*MiB, stats(t, p).ReservedBytes[0].Current)
	require.NoError(t, p.Free(e))
}

// torch's get_free_block ranks the free tail of an expandable segment by
// what it could grow to: a free block elsewhere that fits is taken first,
// though the tail is smaller.
func TestExpandableBestFitPassesOverTheGrowableTail(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{Expandable: true, Capacity: 256 * MiB}, Config{})
	a := mustAlloc(t, p, 0, 8*MiB, 0)
	b := mustAlloc(t, p, 0, 10*MiB, 0) // the page holds a, b and a 2 MiB free tail
	require.Equal(t, a+8*MiB, b)
	require.NoError(t, p.Free(a)) // a free 8 MiB block before b
	c := mustAlloc(t, p, 0, 2*MiB, 0)
	assert.Equal(t, a, c, "the 8 MiB block, not the 2 MiB tail")
	d := mustAlloc(t, p, 0, 2*MiB, 0)
	assert.Equal(t, a+2*MiB, d, "the 6 MiB rest of it, still not the tail")
	e := mustAlloc(t, p, 0, 6*MiB, 0)
	assert.Equal(t, b+10*MiB, e, "nothing else fits: the tail grows")
	assert.EqualValues(t, 40*MiB, stats(t, p).ReservedBytes[0].Current)
}

// torch's small pool is expandable too: one segment a stream, mapped in
// 2 MiB pages, whose free blocks may outgrow the small size classes.
func TestExpandableSmallPoolGrowsIn2MiBPages(t *testing.T) {
	p, be := newTestPool(t, sim.Config{Expandable: true, Capacity: 256 * MiB}, Config{})
	var addrs []uint64
	for range 5 {
		addrs = append(addrs, mustAlloc(t, p, 0, MiB, 0))
	}
	for i, a := range addrs {
		assert.Equal(t, addrs[0]+uint64(i)*MiB, a, "one segment, grown in place")
	}
	s := stats(t, p)
	assert.EqualValues(t, 6*MiB, s.ReservedBytes[KindSmall].Current, "three 2 MiB pages")
	assert.Zero(t, s.ReservedBytes[KindLarge].Current)
	assert.Zero(t, s.Segment[0].Current)
	assert.EqualValues(t, 2, s.NumExpansions)
	assert.Equal(t, 1, be.Stats().LiveSegments)
	for _, a := range addrs[:4] {
		require.NoError(t, p.Free(a))
	}
	// A free 4 MiB block in the small pool: beyond any small size class.
	assert.Equal(t, addrs[0], mustAlloc(t, p, 0, 512, 0), "the lowest fit, not the 1 MiB tail")
	released, err := p.EmptyCache()
	require.NoError(t, err)
	assert.EqualValues(t, 2*MiB, released, "the second page, wholly free: 512 bytes in the first, the fifth block in the third")
	require.NoError(t, p.Free(addrs[4]))
	released, err = p.EmptyCache()
	require.NoError(t, err)
	assert.EqualValues(t, 2*MiB, released, "the third page")
	assert.EqualValues(t, 2*MiB, stats(t, p).ReservedBytes[KindSmall].Current)
}

// With a PageMapper backend (the sim), releasing the cache unmaps every
// free page of an expandable segment, as torch's release_blocks does, not
// only those of its free tail: a free page between blocks in use becomes a
// hole. A later request maps pages into the lowest hole that it fits
// (with the free blocks beside it) before it grows the segment's end, and
// best fit counts a hole after a free block as room that block can grow in.
func TestExpandableHolesAreUnmappedAndMappedAgain(t *testing.T) {
	p, be := newTestPool(t, sim.Config{Expandable: true, Capacity: 512 * MiB}, Config{})
	a := mustAlloc(t, p, 0, 30*MiB, 0)
	b := mustAlloc(t, p, 0, 30*MiB, 0)
	c := mustAlloc(t, p, 0, 30*MiB, 0) // pages 0-4 (100 MiB), a 10 MiB free tail
	require.NoError(t, p.Free(b))      // free from 30 to 60 MiB: page 2 (40-60) wholly
	released, err := p.EmptyCache()
	require.NoError(t, err)
	assert.EqualValues(t, 20*MiB, released, "the free page between a and c")
	s := stats(t, p)
	assert.EqualValues(t, 80*MiB, s.ReservedBytes[0].Current)
	assert.EqualValues(t, 80*MiB, be.UsedBytes(0))
	assert.EqualValues(t, 1, be.Stats().Unmaps)
	seg := p.Snapshot()[0]
	assert.EqualValues(t, 80*MiB, seg.TotalSize)
	assert.Len(t, seg.Blocks, 4, "a, 10 MiB free, (the hole), c, the free tail")

	// 25 MiB: the free 10 MiB before the hole plus the hole (30 MiB of
	// room) fits it; the 10 MiB tail fits nothing. Torch maps the hole
	// rather than grow the end.
	grew := be.Stats().Expansions
	d := mustAlloc(t, p, 0, 25*MiB, 0)
	assert.Equal(t, a+30*MiB, d)
	s = stats(t, p)
	assert.EqualValues(t, 100*MiB, s.ReservedBytes[0].Current, "the hole mapped again")
	assert.EqualValues(t, 1, be.Stats().Maps)
	assert.Equal(t, grew, be.Stats().Expansions, "the end did not grow")

	// All free: every page goes, and the segment with it.
	require.NoError(t, p.Free(a))
	require.NoError(t, p.Free(c))
	require.NoError(t, p.Free(d))
	_, err = p.EmptyCache()
	require.NoError(t, err)
	assert.Zero(t, be.Stats().LiveSegments)
	assert.Zero(t, stats(t, p).ReservedBytes[0].Current)
}

// An expandable pool checks its limit as torch checks its memory fraction
// with expandable segments: once a request, for the segment it would get
// without them (20 MiB under 10 MiB, else the request in 2 MiB steps) on
// top of what is reserved; the 20 MiB pages it then maps may pass it.
func TestExpandableLimitIsTorchsFractionCheck(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{Expandable: true}, Config{Limit: 30 * MiB})
	mustAlloc(t, p, 0, 12*MiB, 0) // 0 + 12 <= 30: one page
	mustAlloc(t, p, 0, 10*MiB, 0) // 20 + 10 <= 30: 8 MiB free, one more page
	assert.EqualValues(t, 40*MiB, stats(t, p).ReservedBytes[0].Current, "past the limit, as torch")
	mustAlloc(t, p, 0, 16*MiB, 0)  // from the 18 MiB free tail: no check, nothing mapped
	oom := mustOOM(t, p, 0, 3*MiB) // the 2 MiB left do not hold it, and 40 + 20 > 30
	assert.EqualValues(t, 30*MiB, oom.Limit)

	q, _ := newTestPool(t, sim.Config{Expandable: true}, Config{Limit: 30 * MiB})
	mustAlloc(t, q, 0, 5*MiB, 0) // 0 + 20 <= 30: one page
	mustOOM(t, q, 0, 16*MiB)     // 20 + 16 > 30, though 15 MiB of the page are free
	assert.EqualValues(t, 20*MiB, stats(t, q).ReservedBytes[0].Current)
}

func TestExpandableRespectsLimitAndSmallPool(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{Expandable: true}, Config{Limit: 40 * MiB})
	mustAlloc(t, p, 0, 15*MiB, 0) // one page
	mustAlloc(t, p, 0, 15*MiB, 0) // two
	oom := mustOOM(t, p, 0, 15*MiB)
	assert.EqualValues(t, 40*MiB, oom.Limit)
	assert.EqualValues(t, 40*MiB, oom.Reserved)
	// Small requests map one 2 MiB page of the stream's small segment.
	q, _ := newTestPool(t, sim.Config{Expandable: true}, Config{})
	mustAlloc(t, q, 0, 1000, 0)
	assert.EqualValues(t, 2*MiB, stats(t, q).ReservedBytes[KindSmall].Current)
}

// An expandable segment that grows past MaxSplitSize is no oversize
// segment: torch counts there only the segments of cudaMalloc. Its blocks
// of MaxSplitSize or more are oversize allocations.
func TestExpandableSegmentsAreNotOversizeSegments(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{Expandable: true}, Config{MaxSplitSize: 20 * MiB})
	a := mustAlloc(t, p, 0, 3*MiB, 0)  // a new 20 MiB segment
	b := mustAlloc(t, p, 0, 30*MiB, 0) // grows it in place to 40 MiB
	s := stats(t, p)
	assert.Zero(t, s.Segment[0].Current)
	assert.EqualValues(t, 40*MiB, s.ReservedBytes[0].Current)
	assert.Zero(t, s.OversizeSegments.Current)
	assert.EqualValues(t, 1, s.OversizeAllocations.Current)
	require.NoError(t, p.Free(a))
	require.NoError(t, p.Free(b))
	_, err := p.EmptyCache()
	require.NoError(t, err)
	s = stats(t, p)
	assert.Zero(t, s.ReservedBytes[0].Current)
	assert.Zero(t, s.OversizeSegments.Allocated)
	assert.Zero(t, s.OversizeAllocations.Current)
}

// The expandable sim reserves the device's capacity per segment in a range
// sized for many segments: hundreds of segments, small and large, on a
// default (80 GiB) device.
func TestExpandableSimHoldsManySegments(t *testing.T) {
	p, be := newTestPool(t, sim.Config{Expandable: true}, Config{})
	const streams = 200
	var addrs []uint64
	for s := range streams {
		addrs = append(addrs, mustAlloc(t, p, 0, 512, Stream(s)))   // a growing small segment each
		addrs = append(addrs, mustAlloc(t, p, 0, 3*MiB, Stream(s))) // and a growing large one
	}
	for range 40 { // one stream, one small segment of 20 pages
		addrs = append(addrs, mustAlloc(t, p, 0, MiB, streams))
	}
	s := stats(t, p)
	assert.Zero(t, s.Segment[0].Current, "torch does not count expandable segments")
	assert.Equal(t, 2*streams+1, be.Stats().LiveSegments)
	// Every large segment can still grow to what the device can back.
	grown := s.NumExpansions
	mustAlloc(t, p, 0, 40<<30, 0)
	assert.EqualValues(t, grown+1, stats(t, p).NumExpansions)
	for _, a := range addrs {
		require.NoError(t, p.Free(a))
	}
}

// Torch's find_expandable_block looks at every expandable segment of the
// stream and pool, lowest address first, not only the newest: a request
// that no cached block serves maps pages into the first hole (or free
// block and hole, or tail) of any of them that has room. Here the older
// segment's first hole takes it, though the newer segment could grow.
func TestExpandableMapsIntoAnOlderSegmentsHole(t *testing.T) {
	p, be := newTestPool(t, sim.Config{Expandable: true, Capacity: 1024 * MiB}, Config{})
	var xs, ys []uint64
	for i := 0; i < 3; i++ { // 300 MiB blocks between 20 MiB ones: 960 MiB of the 1,160 MiB reservation
		xs = append(xs, mustAlloc(t, p, 0, 300*MiB, 0))
		ys = append(ys, mustAlloc(t, p, 0, 20*MiB, 0))
	}
	for _, x := range xs {
		require.NoError(t, p.Free(x))
	}
	_, err := p.EmptyCache() // three 300 MiB holes
	require.NoError(t, err)
	assert.EqualValues(t, 60*MiB, stats(t, p).ReservedBytes[0].Current)
	// No hole of the first segment and not its 200 MiB of room at the end
	// holds 400 MiB: a second segment.
	c := mustAlloc(t, p, 0, 400*MiB, 0)
	assert.Len(t, p.Snapshot(), 2)
	assert.Greater(t, c, ys[2])
	// 250 MiB fits the first segment's first hole, the lowest address that
	// has room: torch maps it there, not at the end of the second segment.
	maps := be.Stats().Maps
	d := mustAlloc(t, p, 0, 250*MiB, 0)
	assert.Equal(t, xs[0], d)
	assert.Equal(t, maps+1, be.Stats().Maps, "mapped into the hole")
	assert.EqualValues(t, 720*MiB, stats(t, p).ReservedBytes[0].Current)
	for _, a := range append(ys, c, d) {
		require.NoError(t, p.Free(a))
	}
}

// Growing an expandable segment: the trace maps the new granules at the
// segment's old end, and a failed growth gives its bytes back to the
// budget.
func TestGrowthIsTracedAtTheOldEndAndAFailedOneUncounted(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{Expandable: true, Capacity: 64 * MiB}, Config{})
	p.RecordHistory(true, 100)
	a := mustAlloc(t, p, 0, 40*MiB, 0)
	info, err := p.Lookup(a)
	require.NoError(t, err)
	require.EqualValues(t, 40*MiB, info.SegmentSize)
	mustAlloc(t, p, 0, 6*MiB, 0) // grows the segment by a 20 MiB page
	var maps []TraceEntry
	for _, h := range p.History() {
		if h.Action == ActionSegmentMap {
			maps = append(maps, h)
		}
	}
	require.Len(t, maps, 2, "the segment's first mapping, then its growth")
	assert.Equal(t, info.SegmentAddr, maps[0].Addr)
	assert.EqualValues(t, 40*MiB, maps[0].Size)
	assert.Equal(t, info.SegmentAddr+40*MiB, maps[1].Addr)
	assert.EqualValues(t, 20*MiB, maps[1].Size)

	_, err = p.Alloc(0, 30*MiB, 0) // beyond the device: growth fails, before and after the retry
	require.ErrorIs(t, err, ErrOutOfMemory)
	assert.EqualValues(t, 60*MiB, p.Budget().Reserved(0))
	assert.EqualValues(t, 60*MiB, stats(t, p).ReservedBytes[0].Current)
}
