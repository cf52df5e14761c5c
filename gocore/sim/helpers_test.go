package sim

import (
	"testing"

	"github.com/stretchr/testify/require"
)

const MiB = 1 << 20

func newSim(t *testing.T, cfg Config) *Backend {
	t.Helper()
	b, err := New(cfg)
	require.NoError(t, err)
	return b
}

// simDeviceRange returns the half-open address range [lo, hi) of device d.
func simDeviceRange(b *Backend, d int) (lo, hi uint64) {
	lo = b.cfg.Base + uint64(d)*b.stride
	return lo, lo + b.stride
}

// checkSimInvariants verifies that the live segments of b are exactly want,
// aligned, inside their device's range and pairwise non-overlapping (rounded
// to the alignment), that the free list is sorted, coalesced and disjoint
// from the segments, and that the byte accounting matches.
func checkSimInvariants(t *testing.T, b *Backend, want map[Segment]bool) {
	t.Helper()
	segs := b.LiveSegmentsList()
	if len(segs) != len(want) {
		t.Fatalf("%d live segments, want %d", len(segs), len(want))
	}
	align := b.Alignment()
	used := make([]uint64, b.Devices())
	var total uint64
	for i, s := range segs {
		if !want[s] {
			t.Fatalf("unexpected live segment %+v", s)
		}
		if s.Addr%align != 0 {
			t.Fatalf("segment %+v not aligned to %d", s, align)
		}
		lo, hi := simDeviceRange(b, s.Device)
		rounded, _ := alignUp(s.Size, align)
		if s.Addr < lo || s.Addr+rounded > hi {
			t.Fatalf("segment %+v outside device range [%#x, %#x)", s, lo, hi)
		}
		if i > 0 {
			prev := segs[i-1]
			if prev.Device > s.Device || (prev.Device == s.Device && prev.Addr >= s.Addr) {
				t.Fatalf("LiveSegmentsList not sorted: %+v before %+v", prev, s)
			}
			// Sorted by address, so no overlap between neighbours means
			// no overlap between any pair.
			prevRounded, _ := alignUp(prev.Size, align)
			if prev.Device == s.Device && prev.Addr+prevRounded > s.Addr {
				t.Fatalf("segments %+v and %+v overlap", prev, s)
			}
		}
		used[s.Device] += s.Size
		total += s.Size
	}
	b.mu.Lock()
	for d := range b.devices {
		free := b.devices[d].free
		for i, r := range free {
			if r.start >= r.end {
				b.mu.Unlock()
				t.Fatalf("empty free range %v on device %d", r, d)
			}
			if i > 0 && free[i-1].end >= r.start {
				b.mu.Unlock()
				t.Fatalf("free ranges %v and %v on device %d not sorted or not coalesced", free[i-1], r, d)
			}
		}
	}
	b.mu.Unlock()
	for d := range used {
		if got := b.UsedBytes(d); got != used[d] {
			t.Fatalf("UsedBytes(%d) = %d, want %d", d, got, used[d])
		}
		capTotal, capFree, err := b.Capacity(d)
		require.NoError(t, err)
		if capTotal != b.cfg.Capacity || capFree != capTotal-used[d] {
			t.Fatalf("Capacity(%d) = (%d, %d), want (%d, %d)", d, capTotal, capFree, b.cfg.Capacity, b.cfg.Capacity-used[d])
		}
	}
	st := b.Stats()
	if st.LiveSegments != len(want) || st.LiveBytes != total {
		t.Fatalf("Stats live = (%d segments, %d bytes), want (%d, %d)", st.LiveSegments, st.LiveBytes, len(want), total)
	}
}
