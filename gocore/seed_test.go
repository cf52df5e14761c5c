package gocore_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	. "github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/sim"
)

// A seeded segment holds its live blocks at their offsets and its cached
// ones as free blocks that best fit reuses, as a segment built by requests
// and frees would.
func TestSeedSegmentLayout(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{}, Config{})
	live, err := p.SeedSegment(0, 0, false, []SeedBlock{
		{Size: 4 * MiB, Requested: 4*MiB - 100, Live: true},
		{Size: 6 * MiB},
		{Size: 2 * MiB},
		{Size: 8 * MiB, Requested: 8 * MiB, Live: true},
	})
	require.NoError(t, err)
	require.Len(t, live, 2)
	assert.Equal(t, live[0]+12*MiB, live[1], "the second live block sits after 12 MiB of others")
	s, err := p.Stats(0)
	require.NoError(t, err)
	assert.EqualValues(t, 20*MiB, s.ReservedBytes[0].Current)
	assert.EqualValues(t, 12*MiB, s.AllocatedBytes[0].Current)
	assert.EqualValues(t, 2, s.Allocation[0].Current)
	assert.EqualValues(t, 1, s.Segment[0].Current)
	// The two cached blocks merged into one of 8 MiB: a request of 8 MiB
	// takes it whole, at the first live block's end, with no new segment.
	a, err := p.Alloc(0, 8*MiB, 0)
	require.NoError(t, err)
	assert.Equal(t, live[0]+4*MiB, a)
	s, err = p.Stats(0)
	require.NoError(t, err)
	assert.EqualValues(t, 1, s.Segment[0].Current)
	assert.EqualValues(t, 1, s.NumDeviceAlloc)
	// Freeing everything leaves one wholly free segment that empty_cache gives back.
	for _, x := range append(live, a) {
		require.NoError(t, p.Free(x))
	}
	released, err := p.EmptyCache()
	require.NoError(t, err)
	assert.EqualValues(t, 20*MiB, released)
	require.NoError(t, p.CheckInvariants())
}

// Small segments go to the small pool, where a request of up to 1 MiB
// reuses their cached blocks.
func TestSeedSegmentSmall(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{}, Config{})
	live, err := p.SeedSegment(0, 7, true, []SeedBlock{{Size: 512 << 10}, {Size: 1536 << 10, Requested: 1500 << 10, Live: true}})
	require.NoError(t, err)
	a, err := p.Alloc(0, 512<<10, 7)
	require.NoError(t, err)
	assert.Equal(t, live[0]-512<<10, a, "the cached block before the live one")
	_, err = p.Alloc(0, 512<<10, 0)
	require.NoError(t, err)
	s, err := p.Stats(0)
	require.NoError(t, err)
	assert.EqualValues(t, 2, s.Segment[1].Current, "another stream cannot use the seeded stream's blocks")
	require.NoError(t, p.CheckInvariants())
}

func TestSeedSegmentRefuses(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{Capacity: 64 * MiB}, Config{})
	for name, blocks := range map[string][]SeedBlock{
		"none":          nil,
		"zero size":     {{Size: 0}},
		"unaligned":     {{Size: 1000}},
		"request above": {{Size: 512, Requested: 1024, Live: true}},
	} {
		_, err := p.SeedSegment(0, 0, false, blocks)
		assert.Error(t, err, name)
	}
	_, err := p.SeedSegment(0, 0, false, []SeedBlock{{Size: 128 * MiB}})
	assert.ErrorIs(t, err, ErrBackendOutOfMemory, "a segment beyond the device")
	_, err = p.SeedSegment(5, 0, false, []SeedBlock{{Size: 2 * MiB}})
	assert.ErrorIs(t, err, ErrInvalidDevice)
	s, err := p.Stats(-1)
	require.NoError(t, err)
	assert.Zero(t, s.ReservedBytes[0].Current, "a refused seed reserves nothing")

	e, _ := newTestPool(t, sim.Config{Expandable: true}, Config{})
	_, err = e.SeedSegment(0, 0, false, []SeedBlock{{Size: 20 * MiB}})
	assert.ErrorIs(t, err, ErrInvalidArgument)
}

func TestResetStats(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{}, Config{})
	a, err := p.Alloc(0, 30*MiB, 0)
	require.NoError(t, err)
	require.NoError(t, p.Free(a))
	_, err = p.Alloc(0, 2*MiB, 0)
	require.NoError(t, err)
	p.ResetPeakStats()
	s, err := p.Stats(0)
	require.NoError(t, err)
	assert.EqualValues(t, 2*MiB, s.AllocatedBytes[0].Peak, "peak is now the current value")
	assert.EqualValues(t, 30*MiB, s.ReservedBytes[0].Peak)
	assert.EqualValues(t, 2, s.Allocation[0].Allocated)
	p.ResetAccumulatedStats()
	s, err = p.Stats(0)
	require.NoError(t, err)
	assert.Zero(t, s.Allocation[0].Allocated)
	assert.Zero(t, s.NumDeviceAlloc)
	assert.EqualValues(t, 1, s.Allocation[0].Current, "current values stay")
	assert.EqualValues(t, -1, s.MaxSplitSize)
}

// A small segment larger than SmallBuffer is refused, not indexed in the
// small bins (whose size classes end at SmallBuffer: a panic).
func TestSeedSegmentSmallTooLarge(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{}, Config{})
	_, err := p.SeedSegment(0, 0, true, []SeedBlock{{Size: 10 * MiB, Requested: MiB, Live: true}, {Size: 30 * MiB}})
	require.ErrorIs(t, err, ErrInvalidArgument)
	_, err = p.SeedSegment(0, 0, true, []SeedBlock{{Size: MiB, Requested: MiB, Live: true}, {Size: MiB}})
	require.NoError(t, err)
	require.NoError(t, p.CheckInvariants())
}

// A live block sized by another allocator's rounding keeps the pool's
// invariants even where this pool would round its request higher.
func TestSeedSegmentOtherRounding(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{}, Config{RoundupPower2Divisions: 4})
	_, err := p.SeedSegment(0, 0, false, []SeedBlock{{Size: 20*MiB + 512, Requested: 20*MiB + 1, Live: true}, {Size: 2*MiB - 512}})
	require.NoError(t, err)
	require.NoError(t, p.CheckInvariants())
}
