package gocore

import (
	"math/rand/v2"
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
