package gocore_test

import (
	"errors"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	. "github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/sim"
)

func TestGarbageCollectionThreshold(t *testing.T) {
	p, be := newTestPool(t, sim.Config{}, Config{Limit: 100 * MiB, GarbageCollectionThreshold: 0.5})
	a := mustAlloc(t, p, 0, 20*MiB, 0)
	b := mustAlloc(t, p, 0, 20*MiB, 0)
	require.NoError(t, p.Free(a)) // cached since the 2nd large search
	c := mustAlloc(t, p, 0, 30*MiB, 0)
	require.NoError(t, p.Free(b)) // cached since the 3rd
	require.NoError(t, p.Free(c))
	assert.EqualValues(t, 70*MiB, stats(t, p).ReservedBytes[0].Current)
	// A miss with 70 MiB reserved > 50 MiB: segments at least as old as the
	// average (ages 2, 1, 1) go until 20 MiB are back: only a's.
	d := mustAlloc(t, p, 0, 40*MiB, 0)
	s := stats(t, p)
	assert.EqualValues(t, 1, s.NumGCReleases)
	assert.EqualValues(t, 90*MiB, s.ReservedBytes[0].Current)
	assert.Zero(t, s.NumAllocRetries) // the limit was never hit
	assert.Len(t, be.LiveSegmentsList(), 3)
	_, err := p.Lookup(d)
	require.NoError(t, err)
	require.NoError(t, p.CheckInvariants())
	// b and c are still cached: served without the backend.
	before := stats(t, p).NumDeviceAlloc
	mustAlloc(t, p, 0, 30*MiB, 0)
	mustAlloc(t, p, 0, 20*MiB, 0)
	assert.Equal(t, before, stats(t, p).NumDeviceAlloc)

	// Without a limit there is nothing to collect against.
	q, _ := newTestPool(t, sim.Config{}, Config{GarbageCollectionThreshold: 0.1})
	require.NoError(t, q.Free(mustAlloc(t, q, 0, 30*MiB, 0)))
	mustAlloc(t, q, 0, 40*MiB, 0)
	assert.Zero(t, stats(t, q).NumGCReleases)

	for _, bad := range []float64{-0.1, 1, 1.5, math.NaN()} {
		_, err := NewPool(Config{Backend: be, GarbageCollectionThreshold: bad})
		require.ErrorIs(t, err, ErrInvalidArgument, "threshold %v", bad)
	}
}

func TestTrimAndReleaseThreshold(t *testing.T) {
	p, be := newTestPool(t, sim.Config{}, Config{})
	var addrs []uint64
	for range 4 {
		addrs = append(addrs, mustAlloc(t, p, 0, 12*MiB, 0))
	}
	for _, a := range addrs {
		require.NoError(t, p.Free(a))
	}
	released, err := p.Trim(0, 24*MiB)
	require.NoError(t, err)
	assert.EqualValues(t, 24*MiB, released)
	assert.Equal(t, 2, be.Stats().LiveSegments)
	mustAlloc(t, p, 0, 12*MiB, 0) // the pool still works and still caches
	assert.EqualValues(t, 2, be.Stats().LiveSegments)

	q, qbe := newTestPool(t, sim.Config{}, Config{ReleaseThreshold: 30 * MiB})
	addrs = addrs[:0]
	for range 4 {
		addrs = append(addrs, mustAlloc(t, q, 0, 12*MiB, 0))
	}
	for _, a := range addrs {
		require.NoError(t, q.Free(a))
	}
	s := stats(t, q)
	assert.LessOrEqual(t, s.ReservedBytes[0].Current, int64(30*MiB))
	assert.Equal(t, 2, qbe.Stats().LiveSegments)
	require.NoError(t, q.SetReleaseThreshold(MiB))
	assert.Equal(t, 0, qbe.Stats().LiveSegments)
	_, err = q.Trim(5, 0)
	assert.ErrorIs(t, err, ErrInvalidDevice)
}

func unusedBytes(t *testing.T, p *Pool) uint64 {
	s := stats(t, p)
	return uint64(s.ReservedBytes[0].Current - s.ActiveBytes[0].Current)
}

func TestShrinkJudgesTheAnswerByTheGranularityItAskedWith(t *testing.T) {
	device, err := sim.New(sim.Config{Expandable: true, Capacity: 256 * MiB})
	require.NoError(t, err)
	// 8 MiB granules: pages of 24 MiB (torch's 20 MiB, in whole granules).
	be := &growingGranularity{Backend: device, g: 8 * MiB, doubleOnShrink: true}
	p, err := NewPool(Config{Backend: be})
	require.NoError(t, err)
	mustAlloc(t, p, 0, 24*MiB, 0)
	b := mustAlloc(t, p, 0, 24*MiB, 0) // a 48 MiB segment
	require.NoError(t, p.Free(b))
	released, err := p.EmptyCache()
	require.NoError(t, err)
	assert.EqualValues(t, 24*MiB, released, "three 8 MiB granules, though granules are 16 MiB now")
	require.NoError(t, p.CheckInvariants())
}

// A KeepSegments pool (a CUDA graph's private pool) never gives a freed
// segment back while it is open: not to make room, not by threshold,
// garbage collection or an explicit empty; Close does.
func TestKeepSegmentsReleasesOnlyAtClose(t *testing.T) {
	p, be := newTestPool(t, sim.Config{Capacity: 64 * MiB},
		Config{Name: "graph", KeepSegments: true, ReleaseThreshold: MiB, Limit: 48 * MiB, GarbageCollectionThreshold: 0.5})
	x := mustAlloc(t, p, 0, 15*MiB, 0)
	y := mustAlloc(t, p, 0, 15*MiB, 0)
	require.NoError(t, p.Free(x))
	require.NoError(t, p.Free(y)) // over the release threshold: kept anyway
	released, err := p.EmptyCache()
	require.NoError(t, err)
	assert.Zero(t, released)
	// 40 MiB would fit only if the cached 32 MiB went back: it fails instead.
	oom := mustOOM(t, p, 0, 40*MiB)
	assert.EqualValues(t, 40*MiB, oom.Requested)
	s := stats(t, p)
	assert.EqualValues(t, 32*MiB, s.ReservedBytes[0].Current, "the graph's memory stayed")
	assert.Zero(t, s.NumGCReleases)
	// The cached blocks are still served.
	assert.Equal(t, x, mustAlloc(t, p, 0, 15*MiB, 0))
	require.NoError(t, p.CheckInvariants())
	rep, err := p.Close()
	require.NoError(t, err)
	assert.EqualValues(t, 32*MiB, rep.BytesFreed)
	assert.Zero(t, be.UsedBytes(0))
}

// With a Shrinker backend the free tail of a partly used expandable segment
// goes back when the pool releases cached memory, as torch unmaps the free
// pages of its expandable segments: on the OOM retry and on EmptyCache.
func TestExpandableFreeTailGoesBack(t *testing.T) {
	p, be := newTestPool(t, sim.Config{Expandable: true, Capacity: 80 * MiB}, Config{})
	p.RecordHistory(true, 100)
	a := mustAlloc(t, p, 0, 20*MiB, 0) // one page, all in use
	b := mustAlloc(t, p, 0, 40*MiB, 0) // grows stream 0's segment to 60 MiB
	require.NoError(t, p.Free(b))      // a 40 MiB free tail, cached
	c := mustAlloc(t, p, 0, 40*MiB, 1) // another stream: the tail must go back first
	s := stats(t, p)
	assert.EqualValues(t, 1, s.NumAllocRetries)
	assert.Zero(t, s.NumOOMs)
	assert.EqualValues(t, 60*MiB, s.ReservedBytes[0].Current, "stream 0's segment is 20 MiB again, stream 1's is 40")
	assert.Zero(t, s.OversizeSegments.Current)
	assert.EqualValues(t, 1, be.Stats().Shrinks)
	assert.EqualValues(t, 60*MiB, be.UsedBytes(0))
	seg := p.Snapshot()[0]
	assert.EqualValues(t, 20*MiB, seg.TotalSize)
	require.Len(t, seg.Blocks, 1, "the tail started on a page: its block is gone")
	var unmapped []TraceEntry
	for _, e := range p.History() {
		if e.Action == ActionSegmentUnmap {
			unmapped = append(unmapped, e)
		}
	}
	require.Len(t, unmapped, 1)
	assert.Equal(t, TraceEntry{Action: ActionSegmentUnmap, Addr: a + 20*MiB, Size: 40 * MiB, TimeUS: unmapped[0].TimeUS,
		Thread: unmapped[0].Thread}, unmapped[0])
	// The shrunk segment grows again.
	d := mustAlloc(t, p, 0, 3*MiB, 0)
	assert.Equal(t, a+20*MiB, d)

	// EmptyCache gives back the pages after the last one in use; a free
	// tail that starts inside a page keeps that page.
	require.NoError(t, p.Free(c))
	e := mustAlloc(t, p, 0, 5*MiB, 1) // stream 1: 5 MiB of its 40, a 35 MiB free tail
	require.NoError(t, p.Free(d))     // stream 0: a 20 MiB free tail from offset 20 MiB
	released, err := p.EmptyCache()
	require.NoError(t, err)
	s = stats(t, p)
	assert.EqualValues(t, 20*MiB+20*MiB, released, "from 20 MiB on in each segment")
	assert.EqualValues(t, 20*MiB+20*MiB, s.ReservedBytes[0].Current)
	assert.EqualValues(t, 15*MiB, s.ReservedBytes[0].Current-s.ActiveBytes[0].Current, "the rest of a page in use stays")
	assert.EqualValues(t, 40*MiB, be.UsedBytes(0))
	assert.EqualValues(t, 3, be.Stats().Shrinks)
	require.NoError(t, p.Free(a))
	require.NoError(t, p.Free(e))
	_, err = p.EmptyCache()
	require.NoError(t, err)
	assert.Zero(t, be.Stats().LiveSegments)
	assert.Zero(t, stats(t, p).ReservedBytes[0].Current)
}

// stingyShrinker gives back at most granules granules per Shrink, or fails.
type stingyShrinker struct {
	*sim.Backend
	granules uint64
	err      error
}

func (s *stingyShrinker) Shrink(dev int, addr, size, less uint64, st Stream) (uint64, error) {
	if s.err != nil {
		return 0, s.err
	}
	if s.granules == 0 {
		return 0, nil
	}
	return s.Backend.Shrink(dev, addr, size, min(less, s.granules*s.Granularity()), st)
}

// A Shrinker may give back less than asked, nothing, or fail: the segment
// then matches what the backend kept; KeepSegments and captures shrink
// nothing.
func TestExpandableShrinkPartialAndFailing(t *testing.T) {
	device, err := sim.New(sim.Config{Expandable: true})
	require.NoError(t, err)
	be := &stingyShrinker{Backend: device, granules: 1}
	p, err := NewPool(Config{Backend: be})
	require.NoError(t, err)
	a := mustAlloc(t, p, 0, 2*MiB, 0)
	b := mustAlloc(t, p, 0, 38*MiB, 0) // two 20 MiB pages
	require.NoError(t, p.Free(b))
	released, err := p.EmptyCache()
	require.NoError(t, err)
	assert.EqualValues(t, 2*MiB, released, "one granule of the free page")
	assert.EqualValues(t, 38*MiB, stats(t, p).ReservedBytes[0].Current)
	assert.EqualValues(t, 38*MiB, device.UsedBytes(0))

	be.granules = 0
	released, err = p.EmptyCache()
	require.NoError(t, err)
	assert.Zero(t, released)

	be.err = errors.New("unmap failed")
	_, err = p.EmptyCache()
	require.ErrorIs(t, err, be.err)
	assert.EqualValues(t, 38*MiB, stats(t, p).ReservedBytes[0].Current, "unchanged")

	be.err = nil
	be.granules = 100
	p.EnterCapture()
	released, err = p.EmptyCache()
	require.NoError(t, err)
	assert.Zero(t, released, "no release during a capture")
	require.NoError(t, p.ExitCapture())
	released, err = p.EmptyCache()
	require.NoError(t, err)
	assert.EqualValues(t, 18*MiB, released, "the rest of the page the backend kept")
	assert.EqualValues(t, 20*MiB, stats(t, p).ReservedBytes[0].Current)
	require.NoError(t, p.Free(a))
	_, err = p.Close()
	require.NoError(t, err)
	assert.Zero(t, device.Stats().LiveSegments)

	// A pool over a backend that cannot shrink keeps the tail.
	q, _ := newTestPool(t, sim.Config{Expandable: true}, Config{KeepSegments: true})
	mustAlloc(t, q, 0, 2*MiB, 0)
	require.NoError(t, q.Free(mustAlloc(t, q, 0, 8*MiB, 0)))
	released, err = q.EmptyCache()
	require.NoError(t, err)
	assert.Zero(t, released)
}

// growingGranularity is a sim backend whose granularity grows after
// segments exist, as the vmm backend's does when it first meets a device
// with a coarser one (with doubleOnShrink, during a Shrink: a pool sharing
// the backend did so meanwhile).
type growingGranularity struct {
	*sim.Backend
	g              uint64
	asked          []uint64
	doubleOnShrink bool
}

func (b *growingGranularity) Granularity() uint64 { return b.g }

func (b *growingGranularity) Shrink(dev int, addr, size, less uint64, st Stream) (uint64, error) {
	b.asked = append(b.asked, less)
	n, err := b.Backend.Shrink(dev, addr, size, less, st)
	if b.doubleOnShrink {
		b.g *= 2
	}
	return n, err
}

// A segment made in 2 MiB granules, its tail then measured in 4 MiB ones:
// no underflow (6 MiB - 8 MiB), and only whole new granules are asked for.
func TestShrinkableTailAfterTheGranularityGrew(t *testing.T) {
	device, err := sim.New(sim.Config{Expandable: true, Granularity: 2 * MiB})
	require.NoError(t, err)
	be := &growingGranularity{Backend: device, g: 2 * MiB}
	p, err := NewPool(Config{Backend: be})
	require.NoError(t, err)
	a := mustAlloc(t, p, 0, 5*MiB, 0) // a 6 MiB segment with a 1 MiB free tail
	be.g = 4 * MiB
	n, err := p.EmptyCache()
	require.NoError(t, err)
	assert.Zero(t, n)
	assert.Empty(t, be.asked, "no whole 4 MiB granule is free")
	b := mustAlloc(t, p, 0, 5*MiB, 0) // grows the segment by a 4 MiB granule
	require.NoError(t, p.Free(b))
	_, err = p.EmptyCache()
	require.NoError(t, err)
	for _, less := range be.asked {
		assert.Zero(t, less%(4*MiB), "asked %d", less)
	}
	require.NoError(t, p.Free(a))
	require.NoError(t, p.CheckInvariants())
	_, err = p.Close()
	require.NoError(t, err)
	assert.Zero(t, device.UsedBytes(0))
}

// Trim and the release threshold give back wholly free segments largest
// first (the fewest backend calls to reach the target; torch's
// release_available_cached_blocks also frees its largest blocks first),
// equal sizes by address, lowest first.
func TestTrimReleasesTheLargestWholeSegmentsFirst(t *testing.T) {
	p, be := newTestPool(t, sim.Config{}, Config{})
	small := mustAlloc(t, p, 0, 12*MiB, 0) // a segment of its own size
	mid := mustAlloc(t, p, 0, 40*MiB, 0)
	large := mustAlloc(t, p, 0, 60*MiB, 0)
	for _, a := range []uint64{small, mid, large} {
		require.NoError(t, p.Free(a))
	}
	// 112 MiB unused; keep 90: the 60 MiB segment alone is enough (smallest
	// first would release 12 and 40 instead).
	released, err := p.Trim(0, 90*MiB)
	require.NoError(t, err)
	assert.EqualValues(t, 60*MiB, released)
	assert.Equal(t, 2, be.Stats().LiveSegments)
	assert.Equal(t, small, mustAlloc(t, p, 0, 12*MiB, 0), "the 12 MiB segment stays cached")
	assert.Equal(t, mid, mustAlloc(t, p, 0, 40*MiB, 0), "the 40 MiB segment stays cached")

	// Equal sizes: the lowest address goes first.
	q, qbe := newTestPool(t, sim.Config{}, Config{})
	x := mustAlloc(t, q, 0, 12*MiB, 0)
	y := mustAlloc(t, q, 0, 12*MiB, 0)
	require.Less(t, x, y)
	require.NoError(t, q.Free(y))
	require.NoError(t, q.Free(x))
	released, err = q.Trim(0, 20*MiB)
	require.NoError(t, err)
	assert.EqualValues(t, 12*MiB, released)
	assert.Equal(t, 1, qbe.Stats().LiveSegments)
	assert.Equal(t, y, mustAlloc(t, q, 0, 12*MiB, 0), "the higher segment stays cached")

	// The release threshold takes the same path.
	r, rbe := newTestPool(t, sim.Config{}, Config{ReleaseThreshold: 90 * MiB})
	small = mustAlloc(t, r, 0, 12*MiB, 0)
	mid = mustAlloc(t, r, 0, 40*MiB, 0)
	large = mustAlloc(t, r, 0, 60*MiB, 0)
	for _, a := range []uint64{small, mid, large} {
		require.NoError(t, r.Free(a))
	}
	assert.Equal(t, 2, rbe.Stats().LiveSegments, "only the 60 MiB segment went back")
	assert.Equal(t, mid, mustAlloc(t, r, 0, 40*MiB, 0))
	require.NoError(t, p.CheckInvariants())
	require.NoError(t, q.CheckInvariants())
	require.NoError(t, r.CheckInvariants())
}

// twoFreeTails is an expandable pool whose two streams' segments end in
// free tails of 20 MiB (stream 0) and 40 MiB (stream 1).
func twoFreeTails(t *testing.T) (*Pool, *sim.Backend) {
	t.Helper()
	p, be := newTestPool(t, sim.Config{Expandable: true, Capacity: 256 * MiB}, Config{})
	mustAlloc(t, p, 0, 20*MiB, 0)                             // a page in use
	require.NoError(t, p.Free(mustAlloc(t, p, 0, 20*MiB, 0))) // stream 0: a 20 MiB free tail
	mustAlloc(t, p, 0, 20*MiB, 1)
	require.NoError(t, p.Free(mustAlloc(t, p, 0, 40*MiB, 1))) // stream 1: a 40 MiB one
	require.EqualValues(t, 60*MiB, unusedBytes(t, p))
	return p, be
}

// Free tails of expandable segments go back largest first too, until the
// target is met.
func TestTrimShrinksTheLargestFreeTailsFirst(t *testing.T) {
	p, be := twoFreeTails(t)
	released, err := p.Trim(0, 30*MiB) // the 40 MiB tail alone is enough
	require.NoError(t, err)
	assert.EqualValues(t, 40*MiB, released)
	assert.EqualValues(t, 1, be.Stats().Shrinks)
	sizes := map[uint64]uint64{}
	for _, s := range p.Snapshot() {
		sizes[s.Stream] = s.TotalSize
	}
	assert.Equal(t, map[uint64]uint64{0: 40 * MiB, 1: 20 * MiB}, sizes)
}

// Trim stops shrinking free tails as soon as the unused bytes are down to
// what it may keep, exactly.
func TestTrimShrinksNoTailOnceAtTheTarget(t *testing.T) {
	p, be := twoFreeTails(t)
	deviceFrees := stats(t, p).NumDeviceFree
	released, err := p.Trim(0, 20*MiB) // the 40 MiB tail leaves exactly 20
	require.NoError(t, err)
	assert.EqualValues(t, 40*MiB, released)
	assert.EqualValues(t, 1, be.Stats().Shrinks)
	assert.EqualValues(t, 20*MiB, unusedBytes(t, p))
	assert.Equal(t, deviceFrees+1, stats(t, p).NumDeviceFree, "a shrink counts as a device free")
}

// Of equal free tails, Trim shrinks the lowest segment's first.
func TestTrimOfEqualTailsShrinksTheLowestSegmentFirst(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{Expandable: true, Capacity: 256 * MiB}, Config{})
	var bases []uint64
	for s := range Stream(3) {
		bases = append(bases, mustAlloc(t, p, 0, 20*MiB, s))
		require.NoError(t, p.Free(mustAlloc(t, p, 0, 20*MiB, s))) // a 20 MiB free tail each
	}
	require.IsIncreasing(t, bases)
	released, err := p.Trim(0, 40*MiB)
	require.NoError(t, err)
	assert.EqualValues(t, 20*MiB, released)
	sizes := map[uint64]uint64{}
	for _, s := range p.Snapshot() {
		sizes[s.Address] = s.TotalSize
	}
	assert.Equal(t, map[uint64]uint64{bases[0]: 20 * MiB, bases[1]: 40 * MiB, bases[2]: 40 * MiB}, sizes)
}

// Trim first records the events of blocks freed during another pool's
// capture (now over) and frees those whose events are done, so their
// segments go back too.
func TestTrimFreesBlocksHeldByAnotherPoolsCaptureFirst(t *testing.T) {
	p, be := newTestPool(t, sim.Config{}, Config{})
	a := mustAlloc(t, p, 0, 12*MiB, 0)
	require.NoError(t, p.RecordStream(a, 7))
	AddProcessCaptures(1)
	require.NoError(t, p.Free(a)) // waits, with no event, for the capture to end
	AddProcessCaptures(-1)
	released, err := p.Trim(0, 0)
	require.NoError(t, err)
	assert.EqualValues(t, 12*MiB, released)
	assert.Zero(t, be.Stats().LiveSegments)
	assert.Zero(t, stats(t, p).ReservedBytes[0].Current)
}

// Garbage collection goes on with a new average while the target is not
// reached, and releases each pass's segments in torch's order: size, then
// address (as the trace shows).
func TestGarbageCollectionPassesAndOrder(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{}, Config{Limit: 100 * MiB, GarbageCollectionThreshold: 0.3})
	p.RecordHistory(true, 1000)
	a := mustAlloc(t, p, 0, 20*MiB, 0)
	e := mustAlloc(t, p, 0, 14*MiB, 0)
	b := mustAlloc(t, p, 0, 12*MiB, 0)
	c := mustAlloc(t, p, 0, 12*MiB, 0)
	h := mustAlloc(t, p, 0, 16*MiB, 0)
	require.IsIncreasing(t, []uint64{e, b, c}, "address order is not size order")
	require.NoError(t, p.Free(h))
	require.NoError(t, p.Free(a))
	assert.Equal(t, h, mustAlloc(t, p, 0, 16*MiB, 0), "a large search served from the cache: a ages")
	for _, x := range []uint64{e, b, c} {
		require.NoError(t, p.Free(x))
	}
	// 74 MiB reserved, 30 allowed: a (age 2, above the average 1.25) goes
	// first; 20 MiB is not enough, so e, b and c (age 1, the new average)
	// follow, smallest first.
	mustAlloc(t, p, 0, 30*MiB, 0)
	var released []uint64
	for _, h := range p.History() {
		if h.Action == ActionSegmentFree {
			released = append(released, h.Addr)
		}
	}
	assert.Equal(t, []uint64{a, b, c, e}, released)
	s := stats(t, p)
	assert.EqualValues(t, 4, s.NumGCReleases)
	assert.EqualValues(t, 46*MiB, s.ReservedBytes[0].Current)
}

// Trim and Stats take a device ordinal: Trim(0) leaves device 1's cache,
// and the first ordinal past the last device is refused.
func TestTrimAndStatsOfOneDevice(t *testing.T) {
	p, be := newTestPool(t, sim.Config{Devices: 2}, Config{})
	require.NoError(t, p.Free(mustAlloc(t, p, 0, 12*MiB, 0)))
	require.NoError(t, p.Free(mustAlloc(t, p, 1, 12*MiB, 0)))
	released, err := p.Trim(0, 0)
	require.NoError(t, err)
	assert.EqualValues(t, 12*MiB, released)
	assert.Equal(t, 1, be.Stats().LiveSegments, "device 1's segment stays cached")
	s, err := p.Stats(1)
	require.NoError(t, err)
	assert.EqualValues(t, 12*MiB, s.ReservedBytes[0].Current)
	_, err = p.Trim(2, 0)
	assert.ErrorIs(t, err, ErrInvalidDevice)
	_, err = p.Stats(2)
	assert.ErrorIs(t, err, ErrInvalidDevice)
}

// With a limit but no garbage collection threshold, a large miss releases
// nothing cached.
func TestNoGarbageCollectionWithoutItsThreshold(t *testing.T) {
	p, be := newTestPool(t, sim.Config{}, Config{Limit: 100 * MiB})
	a := mustAlloc(t, p, 0, 20*MiB, 0)
	require.NoError(t, p.Free(a))
	mustAlloc(t, p, 0, 30*MiB, 0) // a miss
	assert.Zero(t, stats(t, p).NumGCReleases)
	assert.Equal(t, 2, be.Stats().LiveSegments)
	assert.Equal(t, a, mustAlloc(t, p, 0, 20*MiB, 0), "still cached")
}
