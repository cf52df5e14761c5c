package gocore

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

// checkLiveIndex verifies the index against want and its own structure: the
// count, every key reachable from its home slot without crossing a hole.
func checkLiveIndex(t *testing.T, x *liveIndex, want map[uint64]*block) {
	t.Helper()
	require.Equal(t, len(want), x.len())
	for a, b := range want {
		require.Same(t, b, x.get(a), "address %#x", a)
	}
	seen := 0
	mask := uint64(len(x.slots) - 1)
	for i, s := range x.slots {
		if s.addr == 0 {
			continue
		}
		seen++
		require.Equal(t, s.addr, s.b.addr)
		for j := x.home(s.addr); j != uint64(i); j = (j + 1) & mask {
			require.NotZero(t, x.slots[j].addr, "hole between home %d and slot %d of %#x", x.home(s.addr), i, s.addr)
		}
	}
	require.Equal(t, len(want), seen)
	if len(x.slots) > 0 {
		require.LessOrEqual(t, 2*x.len(), len(x.slots), "load above 1/2")
	}
}

func TestLiveIndexAgainstAMap(t *testing.T) {
	for _, tc := range []struct {
		name string
		addr func(r *rand.Rand) uint64
	}{
		// Blocks of one segment: 512-byte steps, the common case.
		{"dense512", func(r *rand.Rand) uint64 { return 1<<40 + 512*uint64(1+r.IntN(4096)) }},
		// Large strides: each address a multiple of 2 MiB.
		{"stride2MiB", func(r *rand.Rand) uint64 { return uint64(1+r.IntN(4096)) << 21 }},
		// Anything, including the top of the address space.
		{"any", func(r *rand.Rand) uint64 { return max(1, r.Uint64()>>uint(r.IntN(64))) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := rand.New(rand.NewPCG(1, uint64(len(tc.name))))
			var x liveIndex
			want := map[uint64]*block{}
			require.Nil(t, x.get(12345))
			for step := range 200_000 {
				a := tc.addr(r)
				if b, ok := want[a]; ok {
					require.Same(t, b, x.get(a))
					x.remove(a)
					delete(want, a)
				} else if r.IntN(3) > 0 || len(want) < 8 { // grow, then churn
					b := &block{addr: a}
					x.put(b)
					want[a] = b
				}
				if step%20_000 == 0 || step < 300 {
					checkLiveIndex(t, &x, want)
				}
			}
			checkLiveIndex(t, &x, want)
			peak := len(x.slots)
			for a := range want {
				x.remove(a)
				delete(want, a)
			}
			checkLiveIndex(t, &x, want)
			require.Less(t, len(x.slots), peak, "freeing every block gives the table's memory back")
			require.Equal(t, liveIndexMinSlots, len(x.slots))
		})
	}
}

func TestLiveIndexRefusesMisuse(t *testing.T) {
	var x liveIndex
	require.Panics(t, func() { x.put(&block{addr: 0}) })
	require.Nil(t, x.get(0))
	x.put(&block{addr: 4096})
	require.Panics(t, func() { x.remove(8192) })
	n := 0
	x.all(func(b *block) { n++; require.Equal(t, uint64(4096), b.addr) })
	require.Equal(t, 1, n)
}

// TestLiveIndexTake: take (Free's lookup and delete in one) returns the
// block and removes it, or returns nil and leaves the index as it was.
func TestLiveIndexTake(t *testing.T) {
	var x liveIndex
	require.Nil(t, x.take(4096), "empty index")
	r := rand.New(rand.NewPCG(3, 4))
	want := map[uint64]*block{}
	for step := range 20_000 {
		a := 1<<40 + 512*uint64(1+r.IntN(2048))
		if b, ok := want[a]; ok {
			require.Same(t, b, x.take(a))
			delete(want, a)
			require.Nil(t, x.take(a), "taken twice")
		} else {
			require.Nil(t, x.take(a), "never put")
			b := &block{addr: a}
			x.put(b)
			want[a] = b
		}
		if step%2_000 == 0 {
			checkLiveIndex(t, &x, want)
		}
	}
	require.Nil(t, x.take(0))
	checkLiveIndex(t, &x, want)
}

// BenchmarkLiveIndex compares the index with the map it replaced on the
// cache-hit pattern: put, get, remove of one address among n live ones.
func BenchmarkLiveIndex(b *testing.B) {
	const n = 10_000
	blocks := make([]*block, n+1)
	for i := range blocks {
		blocks[i] = &block{addr: 1<<40 + 512*uint64(3*i+1)}
	}
	b.Run("liveIndex", func(b *testing.B) {
		var x liveIndex
		for _, bl := range blocks[:n] {
			x.put(bl)
		}
		hot := blocks[n]
		for range b.N {
			x.put(hot)
			if x.get(hot.addr) != hot {
				b.Fatal("lost")
			}
			x.remove(hot.addr)
		}
	})
	b.Run("map", func(b *testing.B) {
		m := map[uint64]*block{}
		for _, bl := range blocks[:n] {
			m[bl.addr] = bl
		}
		hot := blocks[n]
		for range b.N {
			m[hot.addr] = hot
			if m[hot.addr] != hot {
				b.Fatal("lost")
			}
			delete(m, hot.addr)
		}
	})
}

// TestLiveIndexShiftsBackAcrossTheWrap: keys whose home is the last slot
// spill over to the first ones; taking the one in the last slot moves each
// of them back across the end of the table, and a key at home in slot 0
// follows them back to it, never before its home.
func TestLiveIndexShiftsBackAcrossTheWrap(t *testing.T) {
	var x liveIndex
	x.resize(liveIndexMinSlots)
	last := uint64(liveIndexMinSlots - 1)
	var atLast, atZero []uint64
	for a := uint64(512); len(atLast) < 3 || len(atZero) < 1; a += 512 {
		switch x.home(a) {
		case last:
			atLast = append(atLast, a)
		case 0:
			atZero = append(atZero, a)
		}
	}
	want := map[uint64]*block{}
	for _, a := range []uint64{atLast[0], atLast[1], atLast[2], atZero[0]} {
		b := &block{addr: a}
		x.put(b)
		want[a] = b
	}
	slotOf := func(a uint64) int {
		return slices.IndexFunc(x.slots, func(s liveSlot) bool { return s.addr == a })
	}
	require.Equal(t, []int{int(last), 0, 1, 2}, []int{slotOf(atLast[0]), slotOf(atLast[1]), slotOf(atLast[2]), slotOf(atZero[0])})
	require.Same(t, want[atLast[0]], x.take(atLast[0]))
	delete(want, atLast[0])
	require.Equal(t, []int{int(last), 0, 1}, []int{slotOf(atLast[1]), slotOf(atLast[2]), slotOf(atZero[0])})
	checkLiveIndex(t, &x, want)
	require.Same(t, want[atLast[2]], x.take(atLast[2])) // the key at home in 0 moves back to it
	delete(want, atLast[2])
	require.Equal(t, []int{int(last), 0}, []int{slotOf(atLast[1]), slotOf(atZero[0])})
	checkLiveIndex(t, &x, want)
	for a := range want {
		require.Same(t, want[a], x.take(a))
		delete(want, a)
	}
	checkLiveIndex(t, &x, want)
	require.Len(t, x.slots, liveIndexMinSlots, "an empty table keeps its slots...")
	require.Nil(t, x.get(atLast[0]), "...and a probe in it ends at the first empty slot")
	require.Nil(t, x.take(atZero[0]))
}
