package gocore_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	. "github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/sim"
)

// Memory pressure and version rules, each checked against torch's
// CUDACachingAllocator (gpumempool/oracle): these are the places where the
// engine once parted from torch on the adversarial traces.

// EmptyCache first waits for the frees pending on other streams, as torch's
// empty_cache runs synchronize_and_free_events before it releases cached
// segments: a block freed after use on another stream whose work has not
// completed goes back with its segment.
func TestEmptyCacheWaitsForPendingFrees(t *testing.T) {
	p, be := newTestPool(t, sim.Config{ManualEvents: true}, Config{})
	a := mustAlloc(t, p, 0, 30*MiB, 0)
	require.NoError(t, p.RecordStream(a, 7))
	require.NoError(t, p.Free(a)) // waits for stream 7, which never completes
	released, err := p.EmptyCache()
	require.NoError(t, err)
	assert.EqualValues(t, 30*MiB, released)
	s := stats(t, p)
	assert.Zero(t, s.ReservedBytes[0].Current)
	assert.Zero(t, s.ActiveBytes[0].Current)
	assert.EqualValues(t, 1, s.NumSyncAllStreams)
	assert.EqualValues(t, 1, be.Stats().EventWaits)
	waiting, err := p.ProcessEvents()
	require.NoError(t, err)
	assert.Zero(t, waiting)

	// Trim is not torch's empty_cache: it waits for nothing.
	b := mustAlloc(t, p, 0, 30*MiB, 0)
	require.NoError(t, p.RecordStream(b, 7))
	require.NoError(t, p.Free(b))
	released, err = p.Trim(-1, 0)
	require.NoError(t, err)
	assert.Zero(t, released)
	assert.EqualValues(t, 1, stats(t, p).NumSyncAllStreams)
}

// With a max split size, an allocation the backend refuses first gives back
// just enough cached oversize segments of its stream, as torch's
// release_available_cached_blocks does, and asks again without counting a
// retry: the smallest one at least as large as the request (and the max
// split size) when there is one...
func TestOOMReleasesOneOversizeSegmentFirst(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{Capacity: 100 * MiB}, Config{MaxSplitSize: 30 * MiB})
	require.NoError(t, p.Free(mustAlloc(t, p, 0, 40*MiB, 0)))
	require.NoError(t, p.Free(mustAlloc(t, p, 0, 44*MiB, 0)))
	s := stats(t, p)
	require.EqualValues(t, 84*MiB, s.ReservedBytes[0].Current)
	mustAlloc(t, p, 0, 20*MiB, 0) // below the max split size: it may not take them
	s = stats(t, p)
	assert.Zero(t, s.NumAllocRetries)
	assert.Zero(t, s.NumOOMs)
	assert.EqualValues(t, 64*MiB, s.ReservedBytes[0].Current, "the 40 MiB segment went, the 44 MiB one stayed")
	assert.EqualValues(t, 2, s.Segment[0].Current)
}

// ... or else the largest ones, largest first, until they add up to it.
func TestOOMReleasesLargestOversizeSegmentsFirst(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{Capacity: 130 * MiB}, Config{MaxSplitSize: 30 * MiB})
	for _, n := range []uint64{32, 40, 44} {
		require.NoError(t, p.Free(mustAlloc(t, p, 0, n*MiB, 0)))
	}
	mustAlloc(t, p, 0, 70*MiB, 0) // 116 + 70 > 130: 44 and 40 go, 32 stays
	s := stats(t, p)
	assert.Zero(t, s.NumAllocRetries)
	assert.EqualValues(t, 102*MiB, s.ReservedBytes[0].Current)

	// When they cannot add up to it, they still go, and the retry
	// (counted) releases the rest.
	q, _ := newTestPool(t, sim.Config{Capacity: 100 * MiB}, Config{MaxSplitSize: 30 * MiB})
	require.NoError(t, q.Free(mustAlloc(t, q, 0, 40*MiB, 0)))
	require.NoError(t, q.Free(mustAlloc(t, q, 0, 10*MiB, 0))) // a 20 MiB segment, not oversize
	mustAlloc(t, q, 0, 90*MiB, 0)
	s = stats(t, q)
	assert.EqualValues(t, 1, s.NumAllocRetries)
	assert.EqualValues(t, 90*MiB, s.ReservedBytes[0].Current)
}

// Without a max split size nothing is released before the retry, which is
// counted.
func TestOOMWithoutMaxSplitSizeRetriesAtOnce(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{Capacity: 100 * MiB}, Config{})
	require.NoError(t, p.Free(mustAlloc(t, p, 0, 40*MiB, 0)))
	require.NoError(t, p.Free(mustAlloc(t, p, 0, 44*MiB, 0)))
	mustAlloc(t, p, 0, 50*MiB, 0)
	s := stats(t, p)
	assert.EqualValues(t, 1, s.NumAllocRetries)
	assert.EqualValues(t, 50*MiB, s.ReservedBytes[0].Current)
}

// A small request that misses the cache collects garbage too, as torch's
// malloc does for any miss: it may be what passes the threshold.
func TestGarbageCollectionOnSmallMiss(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{}, Config{Limit: 100 * MiB, GarbageCollectionThreshold: 0.5})
	require.NoError(t, p.Free(mustAlloc(t, p, 0, 60*MiB, 0))) // cached: 60 MiB reserved, over 50
	mustAlloc(t, p, 0, 4096, 0)                               // a new small segment
	s := stats(t, p)
	assert.EqualValues(t, 1, s.NumGCReleases)
	assert.EqualValues(t, SmallBuffer, s.ReservedBytes[0].Current)
}

// tieBreak leaves two wholly free segments of one size on stream 0, the
// older at the higher address, and returns their addresses: old (created
// second) and young (created fourth, where the first one was).
func tieBreak(t *testing.T, p *Pool, size uint64) (old, young uint64) {
	t.Helper()
	first := mustAlloc(t, p, 0, size, 0)
	old = mustAlloc(t, p, 0, size, 0)
	mustAlloc(t, p, 0, size, 0) // keeps the address space after old taken
	require.NoError(t, p.Free(first))
	_, err := p.EmptyCache() // the lowest address range is free again
	require.NoError(t, err)
	young = mustAlloc(t, p, 0, size, 0)
	require.Equal(t, first, young, "the backend hands out the lowest free address")
	require.NoError(t, p.Free(old))
	require.NoError(t, p.Free(young))
	return old, young
}

// Torch 2.5 to 2.14 break best-fit ties between equal-size free blocks by
// address; 2.15 by the order their segments were created, oldest first
// (BlockComparatorSizeCounterAddress): Config.TorchVersion selects which,
// in the large and the small free lists.
func TestTorchVersionBestFitTieBreak(t *testing.T) {
	for _, c := range []struct {
		version string
		oldest  bool
	}{{"", false}, {"2.5.1", false}, {"2.14", false}, {"2.15", true}, {"2.15.0+cu130", true}, {"3.0", true}} {
		for _, size := range []uint64{40 * MiB, SmallBuffer / 2} {
			p, _ := newTestPool(t, sim.Config{}, Config{TorchVersion: c.version})
			if size <= SmallSize {
				// Fill each small segment with two blocks, so that the
				// segments are the tied free blocks.
				old, young := tieBreakSmall(t, p)
				want := young
				if c.oldest {
					want = old
				}
				assert.Equal(t, want, mustAlloc(t, p, 0, size, 0), "torch %q, small", c.version)
				require.NoError(t, p.CheckInvariants())
				continue
			}
			old, young := tieBreak(t, p, size)
			want := young
			if c.oldest {
				want = old
			}
			assert.Equal(t, want, mustAlloc(t, p, 0, size, 0), "torch %q, large", c.version)
			require.NoError(t, p.CheckInvariants())
		}
	}
}

// tieBreakSmall is tieBreak for small segments, each filled by two 1 MiB
// blocks.
func tieBreakSmall(t *testing.T, p *Pool) (old, young uint64) {
	t.Helper()
	pair := func() (uint64, uint64) { return mustAlloc(t, p, 0, SmallSize, 0), mustAlloc(t, p, 0, SmallSize, 0) }
	f1, f2 := pair()
	o1, o2 := pair()
	pair() // keeps the address space after old taken
	require.NoError(t, p.Free(f1))
	require.NoError(t, p.Free(f2))
	_, err := p.EmptyCache()
	require.NoError(t, err)
	y1, y2 := pair()
	require.Equal(t, f1, y1, "the backend hands out the lowest free address")
	for _, a := range []uint64{o1, o2, y1, y2} {
		require.NoError(t, p.Free(a))
	}
	return o1, y1
}

func TestTorchVersionIsChecked(t *testing.T) {
	be, err := sim.New(sim.Config{})
	require.NoError(t, err)
	for _, bad := range []string{"2", "two.15", "2.x", "-2.15", "2.-1", ".15"} {
		_, err := NewPool(Config{Backend: be, TorchVersion: bad})
		assert.ErrorIs(t, err, ErrInvalidArgument, bad)
	}
	p, err := NewPool(Config{Backend: be, TorchVersion: "2.15.0a0+git1234"})
	require.NoError(t, err)
	assert.Equal(t, "2.15.0a0+git1234", p.Config().TorchVersion)
	assert.True(t, p.BestFitBySegment())
}
