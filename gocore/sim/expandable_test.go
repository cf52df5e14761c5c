package sim

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/gocore"
)

// An expandable sim segment reserves what torch reserves for one, 1 1/8
// times the device's capacity in whole 20 MiB pages, so it can grow to
// anything the device can back, with room for holes; a device's range
// holds ExpandableSegments of them.
func TestSimExpandableReservations(t *testing.T) {
	b := newSim(t, Config{Expandable: true, Capacity: 3*MiB + 512})
	assert.EqualValues(t, 20*MiB, b.reserve, "3.375 MiB rounded up to a 20 MiB page")
	x, err := b.Alloc(0, 512, 0)
	require.NoError(t, err)
	y, err := b.Alloc(0, 512, 0)
	require.NoError(t, err)
	assert.Equal(t, x+20*MiB, y)

	// 10 GiB: a reservation of 11,520 MiB (576 pages), and 4096 of them
	// fill a whole number of TiB.
	const capacity, reservation = 10 << 30, 11520 * MiB
	b = newSim(t, Config{Expandable: true, Capacity: capacity})
	assert.EqualValues(t, reservation, b.reserve)
	lo, hi := simDeviceRange(b, 0)
	assert.EqualValues(t, ExpandableSegments*reservation, hi-lo)
	want := map[Segment]bool{}
	var prev uint64
	for i := range ExpandableSegments {
		addr, err := b.Alloc(0, 512, 0)
		require.NoError(t, err, "segment %d", i+1)
		if i > 0 {
			require.Equal(t, prev+reservation, addr)
		}
		prev = addr
		want[Segment{Addr: addr, Size: 512}] = true
	}
	_, err = b.Alloc(0, 512, 0)
	require.ErrorIs(t, err, gocore.ErrBackendOutOfMemory, "the address range is full")
	assert.Contains(t, err.Error(), "no contiguous free address range")
	checkSimInvariants(t, b, want)
	for s := range want {
		require.NoError(t, b.Free(0, s.Addr, s.Size, 0))
	}
	checkSimInvariants(t, b, nil)

	// One segment grows to the whole capacity.
	b = newSim(t, Config{Expandable: true, Capacity: 64 * MiB})
	addr, err := b.Alloc(0, 2*MiB, 0)
	require.NoError(t, err)
	require.NoError(t, b.Expand(0, addr, 2*MiB, 62*MiB, 0))
	require.ErrorIs(t, b.Expand(0, addr, 64*MiB, 2*MiB, 0), gocore.ErrBackendOutOfMemory, "beyond the capacity")
	checkSimInvariants(t, b, map[Segment]bool{{Addr: addr, Size: 64 * MiB}: true})

	// Shrink gives the end back, keeping the reservation: it grows again.
	for _, bad := range []struct{ size, less uint64 }{{64 * MiB, 0}, {64 * MiB, MiB}, {64 * MiB, 64 * MiB}, {62 * MiB, 2 * MiB}} {
		_, err := b.Shrink(0, addr, bad.size, bad.less, 0)
		require.Error(t, err, "%+v", bad)
	}
	n, err := b.Shrink(0, addr, 64*MiB, 60*MiB, 0)
	require.NoError(t, err)
	assert.EqualValues(t, 60*MiB, n)
	checkSimInvariants(t, b, map[Segment]bool{{Addr: addr, Size: 4 * MiB}: true})
	assert.EqualValues(t, 1, b.Stats().Shrinks)
	require.NoError(t, b.Expand(0, addr, 4*MiB, 60*MiB, 0))
	require.NoError(t, b.Free(0, addr, 64*MiB, 0))
	checkSimInvariants(t, b, nil)
	_, err = newSim(t, Config{}).Shrink(0, addr, 4*MiB, 2*MiB, 0)
	require.ErrorIs(t, err, gocore.ErrUnsupported)
}
