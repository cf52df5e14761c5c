package gocore

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

// bestFitByScan is smallBins.bestFit the slow way: every class from size's
// upward, the lowest address of the first non-empty one.
func bestFitByScan(s *smallBins, size uint64) *block {
	for c := smallClass(size); c < smallClasses; c++ {
		var best *block
		for _, b := range s.bins[c] {
			if best == nil || b.addr < best.addr {
				best = b
			}
		}
		if best != nil {
			return best
		}
	}
	return nil
}

// TestSmallBinsBestFitMatchesAScan drives the bins with random inserts and
// removes, blocks far apart in class (a whole free segment in the last
// class, as after a small segment merges back) and close together, and
// checks every best fit and the bitmaps after each step.
func TestSmallBinsBestFitMatchesAScan(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var s smallBins
	var free []*block
	addr := uint64(1 << 30)
	classSize := func() uint64 {
		if rng.IntN(4) == 0 {
			return SmallBuffer // the last class
		}
		return uint64(1+rng.IntN(smallClasses)) * MinBlockSize
	}
	for step := range 20000 {
		if len(free) > 0 && rng.IntN(3) == 0 {
			i := rng.IntN(len(free))
			s.remove(free[i])
			free[i] = free[len(free)-1]
			free = free[:len(free)-1]
		} else if len(free) < 64 {
			addr += 1 << 21
			b := &block{addr: addr - uint64(rng.IntN(1<<20)), size: classSize()}
			s.insert(b)
			free = append(free, b)
		}
		require.NoError(t, s.bitmapError(), "step %d", step)
		for range 4 {
			size := uint64(1+rng.IntN(smallClasses)) * MinBlockSize // rounded, as alloc asks
			require.Same(t, bestFitByScan(&s, size), s.bestFit(size), "step %d, size %d", step, size)
		}
	}
	for _, b := range free {
		s.remove(b)
	}
	require.Zero(t, s.nonEmptyWords)
	require.Nil(t, s.bestFit(MinBlockSize))
}

// heapIdxError says which entry of a bin disagrees with its heapIdx (nil
// when none does).
func heapIdxError(bin []*block) error {
	for i, b := range bin {
		if b.heapIdx != i {
			return fmt.Errorf("entry %d (%#x) thinks it is at %d", i, b.addr, b.heapIdx)
		}
	}
	return nil
}

// TestSmallBinsRemoveMovesTheLastEntryUpOrDown: the last entry filling a
// removed entry's place must move up when it is below the parent of that
// place (it came from another subtree), and down when it is above a child.
func TestSmallBinsRemoveMovesTheLastEntryUpOrDown(t *testing.T) {
	newBin := func(addrs ...uint64) (*smallBins, map[uint64]*block) {
		var s smallBins
		byAddr := map[uint64]*block{}
		for _, a := range addrs {
			b := &block{addr: a, size: MinBlockSize}
			s.insert(b)
			byAddr[a] = b
		}
		return &s, byAddr
	}
	layout := func(s *smallBins) []uint64 {
		var out []uint64
		for _, b := range s.bins[0] {
			out = append(out, b.addr)
		}
		return out
	}
	// Inserted in heap order, so the layout is the insertion order:
	//            1
	//       10        2
	//     11  12    3
	s, blocks := newBin(1, 10, 2, 11, 12, 3)
	require.Equal(t, []uint64{1, 10, 2, 11, 12, 3}, layout(s))
	s.remove(blocks[11]) // 3 fills index 3 and must pass its parent 10
	require.Equal(t, []uint64{1, 3, 2, 10, 12}, layout(s))
	require.Equal(t, -1, blocks[11].heapIdx)
	s.remove(blocks[1]) // the root: 12 fills it and moves down past 2
	require.Equal(t, []uint64{2, 3, 12, 10}, layout(s))
	s.remove(blocks[3]) // 10 fills index 1, where it has no child: it stays
	require.Equal(t, []uint64{2, 10, 12}, layout(s))
	s.remove(blocks[12]) // the last entry
	require.Equal(t, []uint64{2, 10}, layout(s))
	require.Same(t, blocks[2], s.bestFit(MinBlockSize))
	s.remove(blocks[2]) // the root of a bin of 2
	require.Equal(t, []uint64{10}, layout(s))
	require.Same(t, blocks[10], s.bestFit(MinBlockSize))
	s.remove(blocks[10]) // the only entry
	require.Empty(t, layout(s))
	require.Nil(t, s.bestFit(MinBlockSize))
	require.NoError(t, s.bitmapError())
}

// TestSmallBinsStayHeaps drives a few classes with deep bins (hundreds of
// blocks each) through random inserts and removes of the root, the last
// entry and entries in between, checking every bin's heap order and best
// fit after each step.
func TestSmallBinsStayHeaps(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	var s smallBins
	var free []*block
	used := map[uint64]bool{}
	for step := range 30_000 {
		if len(free) > 0 && (len(free) > 600 || rng.IntN(5) < 2) {
			var i int
			switch rng.IntN(4) {
			case 0: // a root
				c := smallClass(free[rng.IntN(len(free))].size)
				i = slices.Index(free, s.bins[c][0])
			case 1: // a last entry
				c := smallClass(free[rng.IntN(len(free))].size)
				i = slices.Index(free, s.bins[c][len(s.bins[c])-1])
			default:
				i = rng.IntN(len(free))
			}
			b := free[i]
			s.remove(b)
			require.Equal(t, -1, b.heapIdx)
			delete(used, b.addr)
			free[i] = free[len(free)-1]
			free = free[:len(free)-1]
		} else {
			a := uint64(1+rng.IntN(1<<16)) * SmallBuffer
			for used[a] {
				a += SmallBuffer
			}
			used[a] = true
			b := &block{addr: a, size: uint64(1+rng.IntN(3)) * MinBlockSize}
			s.insert(b)
			free = append(free, b)
		}
		require.NoError(t, s.heapOrderError(), "step %d", step)
		for c := range 3 {
			require.NoError(t, heapIdxError(s.bins[c]), "step %d, class %d", step, c)
		}
		require.NoError(t, s.bitmapError(), "step %d", step)
		for c := range 3 {
			size := uint64(c+1) * MinBlockSize
			require.Same(t, bestFitByScan(&s, size), s.bestFit(size), "step %d, size %d", step, size)
		}
	}
}

// Many free blocks of one size class (a heap on address, not one or two
// blocks a class as in a mixed workload): every best fit is the lowest
// address left, through random inserts and removes anywhere in the heap.
func TestSmallBinsOneClassHeapKeepsTheLowestAddressFirst(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	var s smallBins
	var free []*block
	for step := range 5000 {
		if len(free) > 0 && (len(free) >= 300 || rng.IntN(2) == 0) {
			i := rng.IntN(len(free))
			s.remove(free[i])
			free[i] = free[len(free)-1]
			free = free[:len(free)-1]
		} else {
			b := &block{addr: uint64(1<<30) + uint64(rng.IntN(1<<24))*MinBlockSize, size: 8 * MinBlockSize}
			if slices.ContainsFunc(free, func(o *block) bool { return o.addr == b.addr }) {
				continue
			}
			s.insert(b)
			free = append(free, b)
		}
		require.Same(t, bestFitByScan(&s, MinBlockSize), s.bestFit(MinBlockSize), "step %d", step)
	}
}
