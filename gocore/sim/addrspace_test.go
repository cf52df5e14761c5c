package sim

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/gocore"
)

func TestSimAddressReuse(t *testing.T) {
	b := newSim(t, Config{Capacity: 1 << 20, Alignment: 512})
	a1, err := b.Alloc(0, 1000, 0) // 1024 rounded
	require.NoError(t, err)
	a2, err := b.Alloc(0, 512, 0)
	require.NoError(t, err)
	a3, err := b.Alloc(0, 4096, 0)
	require.NoError(t, err)
	assert.Equal(t, a1+1024, a2, "sizes are rounded to the alignment")
	assert.Equal(t, a2+512, a3)

	// A freed hole is reused by an allocation that fits it.
	require.NoError(t, b.Free(0, a2, 512, 0))
	got, err := b.Alloc(0, 100, 0)
	require.NoError(t, err)
	assert.Equal(t, a2, got, "freed range reused")
	require.NoError(t, b.Free(0, got, 100, 0))

	// Freeing neighbours coalesces them into one range that fits a larger
	// allocation at the lowest address.
	require.NoError(t, b.Free(0, a1, 1000, 0))
	got, err = b.Alloc(0, 1536, 0)
	require.NoError(t, err)
	assert.Equal(t, a1, got, "a1 and a2 coalesced")
	require.NoError(t, b.Free(0, got, 1536, 0))
	require.NoError(t, b.Free(0, a3, 4096, 0))
	got, err = b.Alloc(0, 1024+512+4096, 0)
	require.NoError(t, err)
	assert.Equal(t, a1, got, "everything coalesced")
	require.NoError(t, b.Free(0, got, 1024+512+4096, 0))
	checkSimInvariants(t, b, map[Segment]bool{})
}

func TestSimPlaceNext(t *testing.T) {
	b := newSim(t, Config{Devices: 2, Capacity: 1 << 30})
	lo, hi := simDeviceRange(b, 1)
	win := lo + (hi-lo)/2
	live := map[Segment]bool{}
	alloc := func(size uint64) uint64 {
		t.Helper()
		a, err := b.Alloc(1, size, 0)
		require.NoError(t, err)
		live[Segment{Device: 1, Addr: a, Size: size}] = true
		return a
	}

	// Placed segments go into the upper half, in the order of their
	// offsets, whatever order they are allocated in.
	require.NoError(t, b.PlaceNext(1, 4*MiB, 2*MiB))
	first := alloc(2 * MiB)
	require.NoError(t, b.PlaceNext(1, 0, 2*MiB))
	second := alloc(2 * MiB)
	assert.Equal(t, win+4*MiB, first)
	assert.Equal(t, win, second, "the second segment sits below the first, as asked")
	assert.Equal(t, uint64(2), b.Stats().Placed)

	// An Alloc of another size leaves the placement for the one it names;
	// unplaced segments go first fit, from the bottom of the range.
	require.NoError(t, b.PlaceNext(1, 2*MiB, 20*MiB))
	assert.Equal(t, lo, alloc(2*MiB))
	// 20 MiB at win+2 MiB would overlap first: first fit instead, and the
	// placement is spent.
	got := alloc(20 * MiB)
	assert.Equal(t, lo+2*MiB, got)
	assert.Equal(t, lo+22*MiB, alloc(20*MiB), "a spent placement does not apply again")

	// A gap between placed segments is used exactly; freeing them coalesces.
	require.NoError(t, b.PlaceNext(1, 2*MiB, 2*MiB))
	mid := alloc(2 * MiB)
	assert.Equal(t, win+2*MiB, mid)
	checkSimInvariants(t, b, live)
	for s := range live {
		require.NoError(t, b.Free(s.Device, s.Addr, s.Size, 0))
		delete(live, s)
	}
	checkSimInvariants(t, b, live)

	// Size 0 withdraws; an offset beyond the window is never honoured.
	require.NoError(t, b.PlaceNext(1, 8*MiB, 2*MiB))
	require.NoError(t, b.PlaceNext(1, 0, 0))
	assert.Equal(t, lo, alloc(2*MiB))
	require.NoError(t, b.PlaceNext(1, hi-win, 2*MiB))
	assert.Equal(t, lo+2*MiB, alloc(2*MiB))
	assert.Equal(t, uint64(3), b.Stats().Placed)
	checkSimInvariants(t, b, live)

	assert.ErrorIs(t, b.PlaceNext(1, 100, 2*MiB), gocore.ErrInvalidArgument, "offsets are aligned")
	assert.Error(t, b.PlaceNext(2, 0, 2*MiB), "no device 2")
}
