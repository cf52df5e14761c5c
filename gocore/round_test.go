package gocore_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	. "github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/sim"
)

func TestRoundingAndSegmentSizes(t *testing.T) {
	cases := []struct {
		size, block, segment uint64
		small                bool
	}{
		{1, 512, 2 * MiB, true},
		{512, 512, 2 * MiB, true},
		{513, 1024, 2 * MiB, true},
		{MiB, MiB, 2 * MiB, true},
		{MiB + 1, MiB + 512, 20 * MiB, false},
		{10*MiB - 512, 10*MiB - 512, 20 * MiB, false},
		{10 * MiB, 10 * MiB, 10 * MiB, false},
		{11*MiB + 3, 12 * MiB, 12 * MiB, false}, // remainder < 1 MiB: not split
	}
	for _, c := range cases {
		p, _ := newTestPool(t, sim.Config{}, Config{})
		mustAlloc(t, p, 0, c.size, 0)
		s := stats(t, p)
		k := 2
		if c.small {
			k = 1
		}
		assert.EqualValues(t, c.block, s.AllocatedBytes[k].Current, "block for %d", c.size)
		assert.EqualValues(t, c.segment, s.ReservedBytes[k].Current, "segment for %d", c.size)
		assert.EqualValues(t, c.size, s.RequestedBytes[0].Current)
	}
}

func TestRoundupPower2Divisions(t *testing.T) {
	cases := []struct{ size, divisions, want uint64 }{
		{1200 * MiB, 4, 1280 * MiB}, // torch's documented example: 1024..2048 MiB in steps of 256
		{1200 * MiB, 2, 1536 * MiB},
		{1200 * MiB, 8, 1280 * MiB},
		{1100 * MiB, 8, 1152 * MiB},
		{1024 * MiB, 4, 1024 * MiB}, // a power of two stays
		{1280 * MiB, 4, 1280 * MiB}, // on a step already
		{3000, 4, 3072},
		{2048, 4, 2048},             // <= 512*divisions: plain rounding
		{1500, 4, 1536},             // plain
		{5*MiB + 1, 0, 5*MiB + 512}, // off
		{5*MiB + 1, 1, 5*MiB + 512},
		{5*MiB + 1, 64, 5*MiB + 64<<10},
	}
	for _, c := range cases {
		assert.EqualValues(t, c.want, RoundPower2Divisions(c.size, c.divisions), "%d with %d divisions", c.size, c.divisions)
	}

	p, _ := newTestPool(t, sim.Config{}, Config{RoundupPower2Divisions: 4})
	a := mustAlloc(t, p, 0, 1200*MiB, 0)
	s := stats(t, p)
	assert.EqualValues(t, 1280*MiB, s.AllocatedBytes[0].Current)
	assert.EqualValues(t, 1200*MiB, s.RequestedBytes[0].Current)
	require.NoError(t, p.Free(a))
	b := mustAlloc(t, p, 0, 1100*MiB, 0) // rounds to the same 1280 MiB block size: a cache hit
	assert.Equal(t, a, b)
	assert.EqualValues(t, 1, stats(t, p).NumCacheHits)
	require.NoError(t, p.CheckInvariants())

	for _, bad := range []uint64{3, 6, MaxRoundupDivisions * 2} {
		_, err := NewPool(Config{Backend: p.Backend(), RoundupPower2Divisions: bad})
		require.ErrorIs(t, err, ErrInvalidArgument, "divisions %d", bad)
	}
}

func TestRoundupPower2DivisionsBySize(t *testing.T) {
	for _, c := range []struct {
		size uint64
		want int
	}{{512, 0}, {MiB, 0}, {2*MiB - 1, 0}, {2 * MiB, 1}, {3 * MiB, 1}, {4 * MiB, 2}, {31 << 30, 14}, {32 << 30, 15}, {1 << 40, 15}} {
		assert.Equal(t, c.want, RoundupInterval(c.size), "interval of %d", c.size)
	}
	by := make([]uint64, RoundupIntervals)
	by[RoundupInterval(1200*MiB)] = 4 // [1 GiB, 2 GiB) in quarters, nothing else rounded
	p, _ := newTestPool(t, sim.Config{}, Config{RoundupPower2DivisionsBySize: by})
	by[RoundupInterval(1200*MiB)] = 2 // the pool keeps its own copy
	a := mustAlloc(t, p, 0, 1200*MiB, 0)
	b := mustAlloc(t, p, 0, 600*MiB+1, 0)
	s := stats(t, p)
	assert.EqualValues(t, 1280*MiB+600*MiB+512, s.AllocatedBytes[0].Current)
	assert.EqualValues(t, 4, p.Config().RoundupPower2DivisionsBySize[RoundupInterval(1200*MiB)])
	require.NoError(t, p.Free(a))
	require.NoError(t, p.Free(b))

	_, err := NewPool(Config{Backend: p.Backend(), RoundupPower2DivisionsBySize: make([]uint64, 3)})
	require.ErrorIs(t, err, ErrInvalidArgument)
	by[5] = 3
	_, err = NewPool(Config{Backend: p.Backend(), RoundupPower2DivisionsBySize: by})
	require.ErrorIs(t, err, ErrInvalidArgument)
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
		mustAlloc(t, p, 0, 5*MiB+1, 0)
		stats(t, p)
	}
	_, err = NewPool(Config{Backend: be, RoundupPower2Divisions: 2 * MaxRoundupDivisions})
	assert.ErrorIs(t, err, ErrInvalidArgument)
	by[3] = 2 * MaxRoundupDivisions
	_, err = NewPool(Config{Backend: be, RoundupPower2DivisionsBySize: by})
	assert.ErrorIs(t, err, ErrInvalidArgument)
}

// roundup_power2_divisions:2, the smallest setting that rounds, is applied:
// 5000 bytes lie between 4 KiB and 8 KiB, cut into 2 steps of 2 KiB, so the
// block is 6 KiB where plain rounding gives 5 KiB (as torch's round_size).
func TestRoundupPower2DivisionsTwoRounds(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{Capacity: 1 << 30}, Config{RoundupPower2Divisions: 2})
	info, err := p.Lookup(mustAlloc(t, p, 0, 5000, 0))
	require.NoError(t, err)
	assert.Equal(t, uint64(6144), info.Size)
	info, err = p.Lookup(mustAlloc(t, p, 0, 1000, 0)) // at most 512*divisions: plain rounding
	require.NoError(t, err)
	assert.Equal(t, uint64(1024), info.Size)
}
