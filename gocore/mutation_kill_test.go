package gocore_test

// Tests written for the survivors (and uncovered mutants) of the gremlins
// pass over gocore (benchmarks/results/mutation.md): each pins behaviour that
// a one-token mutation changed without any other test noticing.

import (
	"errors"
	"slices"
	"testing"

	. "github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/sim"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// failingRecord is a sim backend whose RecordEvent fails on one stream.
type failingRecord struct {
	*sim.Backend
	bad Stream
}

func (b *failingRecord) RecordEvent(ev Event, s Stream) error {
	if s == b.bad {
		return errors.New("record failed")
	}
	return b.Backend.RecordEvent(ev, s)
}

// A block used on several streams whose event cannot be recorded on one of
// them stays out of use for good, even once the events recorded on the
// other streams complete: nothing says when the failed stream is done with
// it.
func TestAFailedEventRecordKeepsTheBlockOutOfUse(t *testing.T) {
	for _, bad := range []Stream{7, 8} { // the first stream used, the last
		device, err := sim.New(sim.Config{ManualEvents: true})
		require.NoError(t, err)
		p, err := NewPool(Config{Backend: &failingRecord{Backend: device, bad: bad}})
		require.NoError(t, err)
		a := mustAlloc(t, p, 4096, 0, 0)
		require.NoError(t, p.RecordStream(a, 7))
		require.NoError(t, p.RecordStream(a, 8))
		err = p.Free(a)
		require.Error(t, err, "stream %d", bad)
		assert.Contains(t, err.Error(), "record event on stream")
		device.CompleteAll()
		_, err = p.ProcessEvents()
		require.NoError(t, err)
		assert.NotEqual(t, a, mustAlloc(t, p, 4096, 0, 0), "failing stream %d: the block was handed out again", bad)
		s := stats(t, p)
		assert.EqualValues(t, 2, s.Active[0].Current, "failing stream %d", bad)
	}
}

// A second free of a block is a double free, not an interior pointer, both
// while the block waits for its events and when it ends where an allocated
// neighbour begins.
func TestFreeingTwiceIsADoubleFreeAtBlockBoundaries(t *testing.T) {
	p, be := newTestPool(t, sim.Config{ManualEvents: true}, Config{})
	a := mustAlloc(t, p, 4096, 0, 0)
	b := mustAlloc(t, p, 4096, 0, 0)
	c := mustAlloc(t, p, 4096, 0, 0)
	require.Equal(t, a+4096, b, "b starts where a ends")
	require.Equal(t, b+4096, c, "c starts where b ends")

	require.NoError(t, p.Free(b)) // a and c, its neighbours, stay allocated
	err := p.Free(b)
	require.ErrorIs(t, err, ErrDoubleFree)
	assert.NotErrorIs(t, err, ErrInteriorPointer)

	require.NoError(t, p.RecordStream(c, 7))
	require.NoError(t, p.Free(c)) // parked until stream 7's event completes
	err = p.Free(c)
	require.ErrorIs(t, err, ErrDoubleFree, "c waits for its event")
	assert.NotErrorIs(t, err, ErrInteriorPointer)
	assert.ErrorIs(t, p.Free(c+512), ErrInteriorPointer, "inside the parked block")
	be.CompleteAll()
	require.NoError(t, p.Free(a))
	stats(t, p)
}

// The first address past a segment belongs to no segment of the pool: an
// unknown pointer, not a double free.
func TestFreeingTheAddressPastASegmentIsAnUnknownPointer(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{}, Config{})
	a := mustAlloc(t, p, 4096, 0, 0)
	info, err := p.Lookup(a)
	require.NoError(t, err)
	end := info.SegmentAddr + info.SegmentSize
	err = p.Free(end)
	require.ErrorIs(t, err, ErrUnknownPointer)
	assert.NotErrorIs(t, err, ErrDoubleFree)
	assert.ErrorIs(t, p.Free(end-512), ErrDoubleFree, "the segment's last free bytes")
}

// The end of a capture applies the release threshold it held back to free
// tails of expandable segments too, when no segment is wholly free.
func TestReleaseThresholdShrinksAnExpandableTailWhenACaptureEnds(t *testing.T) {
	p, be := newTestPool(t, sim.Config{Expandable: true, Capacity: 256 * MiB}, Config{ReleaseThreshold: 8 * MiB})
	mustAlloc(t, p, 20*MiB, 0, 0) // one page, in use
	p.EnterCapture()
	b := mustAlloc(t, p, 100*MiB, 0, 0) // grows the segment to 120 MiB
	require.NoError(t, p.Free(b))       // a 100 MiB free tail, kept during the capture
	assert.EqualValues(t, 100*MiB, unusedBytes(t, p))
	require.NoError(t, p.ExitCapture())
	assert.LessOrEqual(t, unusedBytes(t, p), uint64(8*MiB))
	assert.LessOrEqual(t, be.UsedBytes(0), uint64(20*MiB))
}

// MaxSplitSize's bounds, exactly: a block of MaxSplitSize is oversize (a
// smaller request never takes it), and a request of MaxSplitSize is an
// oversize request (it may take it whole).
func TestMaxSplitSizeIsTheFirstOversizeSize(t *testing.T) {
	p, be := newTestPool(t, sim.Config{}, Config{MaxSplitSize: 24 * MiB})
	big := mustAlloc(t, p, 24*MiB, 0, 0) // a 24 MiB segment, oversize
	require.NoError(t, p.Free(big))
	below := mustAlloc(t, p, 21*MiB, 0, 0)
	assert.NotEqual(t, big, below, "a request below MaxSplitSize took an oversize block")
	assert.Equal(t, 2, be.Stats().LiveSegments)
	assert.Equal(t, big, mustAlloc(t, p, 24*MiB, 0, 0), "a MaxSplitSize request reuses the cached MaxSplitSize block")
	assert.Equal(t, 2, be.Stats().LiveSegments)
	s := stats(t, p)
	assert.EqualValues(t, 1, s.OversizeAllocations.Current)
	assert.EqualValues(t, 1, s.OversizeSegments.Current)

	// A MaxSplitSize request is held to MaxNonSplitRoundingSize (20 MiB):
	// a 44 MiB block would waste exactly that.
	q, qbe := newTestPool(t, sim.Config{}, Config{MaxSplitSize: 24 * MiB})
	huge := mustAlloc(t, q, 44*MiB, 0, 0)
	require.NoError(t, q.Free(huge))
	assert.NotEqual(t, huge, mustAlloc(t, q, 24*MiB, 0, 0), "20 MiB wasted in a cached block")
	assert.Equal(t, 2, qbe.Stats().LiveSegments)
}

// MaxRoundupDivisions itself is a valid division count, for the pool and
// for an interval of the per-size table; the next power of two is not.
func TestRoundupDivisionsUpToTheirMaximum(t *testing.T) {
	be, err := sim.New(sim.Config{})
	require.NoError(t, err)
	by := make([]uint64, RoundupIntervals)
	by[3] = MaxRoundupDivisions
	for _, cfg := range []Config{
		{Backend: be, RoundupPower2Divisions: MaxRoundupDivisions},
		{Backend: be, RoundupPower2DivisionsBySize: by},
	} {
		p, err := NewPool(cfg)
		require.NoError(t, err)
		mustAlloc(t, p, 5*MiB+1, 0, 0)
		stats(t, p)
	}
	_, err = NewPool(Config{Backend: be, RoundupPower2Divisions: 2 * MaxRoundupDivisions})
	assert.ErrorIs(t, err, ErrInvalidArgument)
	by[3] = 2 * MaxRoundupDivisions
	_, err = NewPool(Config{Backend: be, RoundupPower2DivisionsBySize: by})
	assert.ErrorIs(t, err, ErrInvalidArgument)
}

// deviceCount is a sim backend that reports n devices.
type deviceCount struct {
	*sim.Backend
	n int
}

func (b *deviceCount) Devices() int { return b.n }

// A backend may have from 1 to MaxDevices devices.
func TestNewPoolTakesOneToMaxDevices(t *testing.T) {
	device, err := sim.New(sim.Config{})
	require.NoError(t, err)
	for _, c := range []struct {
		n  int
		ok bool
	}{{-1, false}, {0, false}, {1, true}, {MaxDevices, true}, {MaxDevices + 1, false}} {
		p, err := NewPool(Config{Backend: &deviceCount{Backend: device, n: c.n}})
		if !c.ok {
			assert.ErrorIs(t, err, ErrInvalidArgument, "%d devices", c.n)
			continue
		}
		require.NoError(t, err, "%d devices", c.n)
		_, err = p.Stats(c.n - 1)
		assert.NoError(t, err, "the last of %d devices", c.n)
	}
}

// reversedDevices is a two-device sim backend whose device 1 hands out
// lower addresses than device 0 (real devices' ranges come in any order).
type reversedDevices struct{ *sim.Backend }

func (b *reversedDevices) Alloc(device int, size uint64, s Stream) (uint64, error) {
	return b.Backend.Alloc(1-device, size, s)
}

func (b *reversedDevices) Free(device int, addr, size uint64, s Stream) error {
	return b.Backend.Free(1-device, addr, size, s)
}

func (b *reversedDevices) NewEvent(device int) (Event, error) {
	return b.Backend.NewEvent(1 - device)
}

func (b *reversedDevices) Capacity(device int) (uint64, uint64, error) {
	return b.Backend.Capacity(1 - device)
}

// Close lists the live blocks by device, then address, whatever the order
// of the devices' address ranges.
func TestCloseListsLiveBlocksByDeviceThenAddress(t *testing.T) {
	device, err := sim.New(sim.Config{Devices: 2})
	require.NoError(t, err)
	p, err := NewPool(Config{Backend: &reversedDevices{Backend: device}})
	require.NoError(t, err)
	var dev0 []uint64
	for range 20 {
		dev0 = append(dev0, mustAlloc(t, p, 4096, 0, 0))
	}
	dev1 := mustAlloc(t, p, 4096, 1, 0)
	require.Less(t, dev1, slices.Min(dev0), "device 1's addresses are the lower")
	rep, err := p.Close()
	require.NoError(t, err)
	var got []LiveBlock
	for _, a := range dev0 {
		got = append(got, LiveBlock{Device: 0, Addr: a, Size: 4096, Requested: 4096})
	}
	got = append(got, LiveBlock{Device: 1, Addr: dev1, Size: 4096, Requested: 4096})
	assert.Equal(t, got, rep.LiveBlocks)
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
		bases = append(bases, mustAlloc(t, p, 20*MiB, 0, s))
		require.NoError(t, p.Free(mustAlloc(t, p, 20*MiB, 0, s))) // a 20 MiB free tail each
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
	a := mustAlloc(t, p, 12*MiB, 0, 0)
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
	a := mustAlloc(t, p, 20*MiB, 0, 0)
	e := mustAlloc(t, p, 14*MiB, 0, 0)
	b := mustAlloc(t, p, 12*MiB, 0, 0)
	c := mustAlloc(t, p, 12*MiB, 0, 0)
	h := mustAlloc(t, p, 16*MiB, 0, 0)
	require.IsIncreasing(t, []uint64{e, b, c}, "address order is not size order")
	require.NoError(t, p.Free(h))
	require.NoError(t, p.Free(a))
	assert.Equal(t, h, mustAlloc(t, p, 16*MiB, 0, 0), "a large search served from the cache: a ages")
	for _, x := range []uint64{e, b, c} {
		require.NoError(t, p.Free(x))
	}
	// 74 MiB reserved, 30 allowed: a (age 2, above the average 1.25) goes
	// first; 20 MiB is not enough, so e, b and c (age 1, the new average)
	// follow, smallest first.
	mustAlloc(t, p, 30*MiB, 0, 0)
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
	require.NoError(t, p.Free(mustAlloc(t, p, 12*MiB, 0, 0)))
	require.NoError(t, p.Free(mustAlloc(t, p, 12*MiB, 1, 0)))
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

// MaxRequest itself is a valid size (it fails for want of memory, not as
// an invalid size).
func TestAllocOfMaxRequestIsOutOfMemory(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{}, Config{})
	_, err := p.Alloc(MaxRequest, 0, 0)
	require.ErrorIs(t, err, ErrOutOfMemory)
	assert.NotErrorIs(t, err, ErrInvalidSize)
}

// A block freed during another pool's capture gets its event when an
// allocation after the capture processes events, and serves it once done.
func TestAllocAfterAnotherPoolsCaptureReusesTheBlocksFreedDuringIt(t *testing.T) {
	p, be := newTestPool(t, sim.Config{}, Config{})
	a := mustAlloc(t, p, 4096, 0, 0)
	require.NoError(t, p.RecordStream(a, 7))
	AddProcessCaptures(1)
	require.NoError(t, p.Free(a))
	AddProcessCaptures(-1)
	assert.Equal(t, a, mustAlloc(t, p, 4096, 0, 0))
	assert.EqualValues(t, 1, be.Stats().EventsCreated)
}

// With a limit but no garbage collection threshold, a large miss releases
// nothing cached.
func TestNoGarbageCollectionWithoutItsThreshold(t *testing.T) {
	p, be := newTestPool(t, sim.Config{}, Config{Limit: 100 * MiB})
	a := mustAlloc(t, p, 20*MiB, 0, 0)
	require.NoError(t, p.Free(a))
	mustAlloc(t, p, 30*MiB, 0, 0) // a miss
	assert.Zero(t, stats(t, p).NumGCReleases)
	assert.Equal(t, 2, be.Stats().LiveSegments)
	assert.Equal(t, a, mustAlloc(t, p, 20*MiB, 0, 0), "still cached")
}

// Splitting at its bounds: a small block keeps a 512-byte remainder as a
// free block, and a request of exactly MaxSplitSize takes a cached oversize
// block whole.
func TestSplitAtItsBounds(t *testing.T) {
	p, be := newTestPool(t, sim.Config{}, Config{})
	mustAlloc(t, p, MiB, 0, 0)
	b := mustAlloc(t, p, MiB-512, 0, 0) // leaves 512 bytes of the 2 MiB segment
	info, err := p.Lookup(b)
	require.NoError(t, err)
	assert.EqualValues(t, MiB-512, info.Size)
	c := mustAlloc(t, p, 512, 0, 0)
	assert.Equal(t, b+MiB-512, c, "the 512-byte remainder serves a 512-byte request")
	assert.Equal(t, 1, be.Stats().LiveSegments)

	q, _ := newTestPool(t, sim.Config{}, Config{MaxSplitSize: 24 * MiB})
	big := mustAlloc(t, q, 40*MiB, 0, 0)
	require.NoError(t, q.Free(big))
	require.Equal(t, big, mustAlloc(t, q, 24*MiB, 0, 0), "16 MiB wasted is under the rounding allowance")
	info, err = q.Lookup(big)
	require.NoError(t, err)
	assert.EqualValues(t, 40*MiB, info.Size, "not split: a MaxSplitSize request")
	assert.EqualValues(t, 40*MiB, stats(t, q).AllocatedBytes[0].Current)
}

// zeroBasedFreeFails is zeroBasedBackend whose Free fails.
type zeroBasedFreeFails struct{ zeroBasedBackend }

func (z zeroBasedFreeFails) Free(int, uint64, uint64, Stream) error {
	return errors.New("free refused")
}

// The error for a segment at address 0 says that giving it back failed
// only when it did.
func TestBackendAddressZeroErrorSaysWhetherItWentBack(t *testing.T) {
	for _, c := range []struct {
		backend  func(*sim.Backend) Backend
		freeFail bool
	}{
		{func(s *sim.Backend) Backend { return zeroBasedBackend{s} }, false},
		{func(s *sim.Backend) Backend { return zeroBasedFreeFails{zeroBasedBackend{s}} }, true},
	} {
		device, err := sim.New(sim.Config{Capacity: 1 << 30})
		require.NoError(t, err)
		be := c.backend(device)
		p, err := NewPool(Config{Backend: be})
		require.NoError(t, err)
		_, err = p.Alloc(4096, 0, 0)
		require.ErrorContains(t, err, "returned address 0")
		if c.freeFail {
			assert.ErrorContains(t, err, "freeing it failed: free refused")
		} else {
			assert.NotContains(t, err.Error(), "freeing it failed")
		}
	}
}

// The split/merge cycle of a cache hit reuses block structs: an alloc and
// free that split a cached block and merge it back allocate nothing.
func TestCacheHitSplitAndMergeAllocateNothing(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{}, Config{})
	require.NoError(t, p.Free(mustAlloc(t, p, 4096, 0, 0)))
	allocs := testing.AllocsPerRun(100, func() {
		a, err := p.Alloc(4096, 0, 0)
		if err != nil {
			panic(err)
		}
		if err := p.Free(a); err != nil {
			panic(err)
		}
	})
	assert.Zero(t, allocs)
}

// Growing an expandable segment: the trace maps the new granules at the
// segment's old end, and a failed growth gives its bytes back to the
// budget.
func TestGrowthIsTracedAtTheOldEndAndAFailedOneUncounted(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{Expandable: true, Capacity: 64 * MiB}, Config{})
	p.RecordHistory(true, 100)
	a := mustAlloc(t, p, 40*MiB, 0, 0)
	info, err := p.Lookup(a)
	require.NoError(t, err)
	require.EqualValues(t, 40*MiB, info.SegmentSize)
	mustAlloc(t, p, 6*MiB, 0, 0) // grows the segment by a 20 MiB page
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

	_, err = p.Alloc(30*MiB, 0, 0) // beyond the device: growth fails, before and after the retry
	require.ErrorIs(t, err, ErrOutOfMemory)
	assert.EqualValues(t, 60*MiB, p.Budget().Reserved(0))
	assert.EqualValues(t, 60*MiB, stats(t, p).ReservedBytes[0].Current)
}

// The release threshold held back while another pool's capture ran
// (AddProcessCaptures: nothing may be released then) applies once it ends,
// at the pool's next event processing, though this pool parked no block
// during it (the mutation pass found it skipped: 20 MiB stayed reserved).
func TestReleaseThresholdHeldByAProcessCaptureAppliesWhenItEnds(t *testing.T) {
	p, be := newTestPool(t, sim.Config{Capacity: 256 * MiB}, Config{ReleaseThreshold: MiB})
	b := mustAlloc(t, p, 4*MiB, 0, 0) // a 20 MiB segment
	AddProcessCaptures(1)
	require.NoError(t, p.Free(b))
	assert.EqualValues(t, 20*MiB, be.UsedBytes(0), "held during the capture")
	AddProcessCaptures(-1)
	_, err := p.ProcessEvents()
	require.NoError(t, err)
	assert.Zero(t, be.UsedBytes(0), "the threshold applies once the capture is over")
	require.NoError(t, p.CheckInvariants())
}

// The same, found by the next free: its own segment has nothing to give
// back, but the expandable tail freed during the capture goes.
func TestReleaseThresholdHeldByAProcessCaptureAppliesAtTheNextFree(t *testing.T) {
	p, be := newTestPool(t, sim.Config{Expandable: true, Capacity: 256 * MiB}, Config{ReleaseThreshold: 8 * MiB})
	mustAlloc(t, p, 20*MiB, 0, 0) // one page, in use
	AddProcessCaptures(1)
	big := mustAlloc(t, p, 100*MiB, 0, 0)
	require.NoError(t, p.Free(big)) // a 100 MiB free tail, held
	AddProcessCaptures(-1)
	small := mustAlloc(t, p, 4096, 0, 0)
	mustAlloc(t, p, 4096, 0, 0)
	require.NoError(t, p.Free(small))
	assert.LessOrEqual(t, unusedBytes(t, p), uint64(8*MiB))
	assert.Less(t, be.UsedBytes(0), uint64(100*MiB))
	require.NoError(t, p.CheckInvariants())
}

// roundup_power2_divisions:2, the smallest setting that rounds, is applied:
// 5000 bytes lie between 4 KiB and 8 KiB, cut into 2 steps of 2 KiB, so the
// block is 6 KiB where plain rounding gives 5 KiB (as torch's round_size).
func TestRoundupPower2DivisionsTwoRounds(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{Capacity: 1 << 30}, Config{RoundupPower2Divisions: 2})
	info, err := p.Lookup(mustAlloc(t, p, 5000, 0, 0))
	require.NoError(t, err)
	assert.Equal(t, uint64(6144), info.Size)
	info, err = p.Lookup(mustAlloc(t, p, 1000, 0, 0)) // at most 512*divisions: plain rounding
	require.NoError(t, err)
	assert.Equal(t, uint64(1024), info.Size)
}

// A size out of [1, MaxRequest] is refused on a device already in use too,
// where Alloc's fast path (allocDevice) answers without the slow checks.
func TestBadSizesAreRefusedOnADeviceInUse(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{Capacity: 1 << 30}, Config{})
	mustAlloc(t, p, 4096, 0, 0) // the device's state exists now
	for _, size := range []uint64{0, MaxRequest + 1, MaxRequest + 2, 1<<64 - 1} {
		_, err := p.Alloc(size, 0, 0)
		require.ErrorIs(t, err, ErrInvalidSize, "size %d", size)
	}
	a, err := p.Alloc(1, 0, 0)
	require.NoError(t, err, "1 byte is a valid size")
	require.NoError(t, p.Free(a))
}
