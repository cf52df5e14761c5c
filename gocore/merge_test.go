package gocore_test

import (
	"cmp"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	. "github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/sim"
)

// TestFreeMergeCountsFollowTheNeighbours frees random blocks of small and
// large segments (expandable or not) and checks each free against a model
// worked out from the snapshot before it: the freed block absorbs its free
// neighbours, which leave inactive_split (freed +1 and their bytes each),
// and the merged block enters it (allocated +1 and its bytes) unless it is
// the whole segment or the segment is expandable; the peak follows the
// count after the free, and the other kind's counts do not move. The block
// each allocation is served from is the best fit by (size, address) among
// the free blocks of its stream and pool, as the snapshot shows them, but
// for torch's preference for any other fitting block over the free tail of
// an expandable segment.
func TestFreeMergeCountsFollowTheNeighbours(t *testing.T) {
	for _, expandable := range []bool{false, true} {
		t.Run(fmt.Sprintf("expandable=%v", expandable), func(t *testing.T) {
			p, _ := newTestPool(t, sim.Config{Capacity: 1 << 30}, Config{})
			if expandable {
				p, _ = newTestPool(t, sim.Config{Capacity: 1 << 30, Expandable: true}, Config{})
			}
			r := rand.New(rand.NewPCG(7, uint64(len(t.Name()))))
			var live []uint64
			frees, merges, wholes, expandableMerges, bestFits := 0, [3]int{}, 0, 0, 0
			for step := range 3000 {
				if len(live) < 8 || (len(live) < 400 && r.IntN(2) == 0) {
					size := 512 * uint64(1+r.IntN(6)) // deep bins of a few classes
					switch r.IntN(8) {
					case 0:
						size = uint64(1+r.IntN(40)) * 64 << 10 // up to the small/large split
					case 1:
						size = uint64(1+r.IntN(24)) * MiB / 2
					}
					stream := Stream(r.IntN(2))
					want, wantOK := bestFitInSnapshot(p.Snapshot(), roundSizeForTest(size), size, stream)
					addr := mustAlloc(t, p, 0, size, stream)
					if wantOK {
						bestFits++
						require.Equal(t, want, addr, "step %d: alloc %d on stream %d", step, size, stream)
					}
					live = append(live, addr)
				} else {
					i := r.IntN(len(live))
					addr := live[i]
					live[i] = live[len(live)-1]
					live = live[:len(live)-1]
					nMerged, whole, inExpandable := checkFreeAgainstModel(t, p, addr)
					frees++
					if inExpandable && nMerged > 0 {
						expandableMerges++
					}
					merges[nMerged]++
					if whole {
						wholes++
					}
				}
				require.NoError(t, p.CheckInvariants(), "step %d", step)
			}
			// Every case of the merge was met: no neighbour, one, both, and
			// a segment made wholly free.
			require.Positive(t, merges[0], "frees merging nothing")
			require.Positive(t, merges[1], "frees merging one neighbour")
			require.Positive(t, merges[2], "frees merging both")
			require.Positive(t, wholes, "frees leaving a wholly free segment")
			require.Greater(t, frees, 1000)
			require.Greater(t, bestFits, 500, "allocations served from the cache")
			if expandable {
				require.Positive(t, expandableMerges, "merges in expandable segments")
			}
			t.Logf("frees %d merges %v wholes %d expandable merges %d best fits %d", frees, merges, wholes, expandableMerges, bestFits)
		})
	}
}

// roundSizeForTest is the block size an Alloc of size gets in a pool (default
// config): 512-byte rounding.
func roundSizeForTest(size uint64) uint64 {
	return (size + MinBlockSize - 1) &^ (MinBlockSize - 1)
}

// bestFitInSnapshot is the address a cache hit must return for a request of
// rounded bytes on stream, by torch's best fit over the snapshot's inactive
// blocks of the request's pool: smallest size, then lowest address. It
// reports false when no cached block qualifies (a new segment, or a large
// request whose candidates the max_split rules or an expandable segment's
// growth decide, which this model does not follow).
func bestFitInSnapshot(segs []SnapshotSegment, rounded, requested uint64, stream Stream) (uint64, bool) {
	small := requested <= SmallSize
	if !small {
		return 0, false
	}
	// torch's get_free_block ranks the last block of an expandable segment
	// by what it could grow to: past any block that fits.
	const unmapped = 1 << 60
	growable := func(s *SnapshotSegment, j int) uint64 {
		if s.IsExpandable && j == len(s.Blocks)-1 {
			return s.Blocks[j].Size + unmapped
		}
		return s.Blocks[j].Size
	}
	type cand struct {
		b        *SnapshotBlock
		growable uint64
	}
	var fits []cand
	for i := range segs {
		s := &segs[i]
		if s.Stream != uint64(stream) || (s.SegmentType == "small") != small {
			continue
		}
		for j := range s.Blocks {
			b := &s.Blocks[j]
			if b.State == StateInactive && b.Size >= rounded {
				fits = append(fits, cand{b, growable(s, j)})
			}
		}
	}
	if len(fits) == 0 {
		return 0, false
	}
	slices.SortFunc(fits, func(x, y cand) int {
		if c := cmp.Compare(x.b.Size, y.b.Size); c != 0 {
			return c
		}
		return cmp.Compare(x.b.Address, y.b.Address)
	})
	best := fits[0]
	for _, c := range fits[1:] {
		if c.growable >= best.growable {
			break
		}
		best = c
	}
	return best.b.Address, true
}

// checkFreeAgainstModel frees addr and checks the merged block and the
// inactive_split counts against the snapshot taken before. It returns how
// many free neighbours were merged and whether the segment became one free
// block.
func checkFreeAgainstModel(t *testing.T, p *Pool, addr uint64) (nMerged int, whole, expandable bool) {
	t.Helper()
	before := stats(t, p)
	var seg *SnapshotSegment
	idx := -1
	snap := p.Snapshot()
	for i := range snap {
		for j, b := range snap[i].Blocks {
			if b.Address == addr {
				seg, idx = &snap[i], j
			}
		}
	}
	require.NotNil(t, seg, "block %#x in the snapshot", addr)
	blocks := seg.Blocks
	require.Equal(t, StateAllocated, blocks[idx].State)
	kind := KindLarge
	if seg.SegmentType == "small" {
		kind = KindSmall
	}
	start, size := blocks[idx].Address, blocks[idx].Size
	var merged, mergedBytes int64
	if idx > 0 && blocks[idx-1].State == StateInactive {
		merged++
		mergedBytes += int64(blocks[idx-1].Size)
		start = blocks[idx-1].Address
	}
	if idx+1 < len(blocks) && blocks[idx+1].State == StateInactive {
		merged++
		mergedBytes += int64(blocks[idx+1].Size)
	}
	size += uint64(mergedBytes)
	whole = start == seg.Address && size == seg.TotalSize

	require.NoError(t, p.Free(addr))
	after := stats(t, p)
	require.Equal(t, before.ReservedBytes, after.ReservedBytes, "a free under no threshold releases nothing")

	// The merged block, in the snapshot after.
	found := false
	for _, s := range p.Snapshot() {
		for _, b := range s.Blocks {
			if b.Address == start {
				require.Equal(t, size, b.Size, "merged block at %#x", start)
				require.Equal(t, StateInactive, b.State)
				found = true
			}
		}
	}
	require.True(t, found, "merged block at %#x", start)

	wantCount, wantBytes := before.InactiveSplit, before.InactiveSplitBytes
	if !seg.IsExpandable {
		wantCount.Down(kind, merged)
		wantBytes.Down(kind, mergedBytes)
		if !whole {
			wantCount.Up(kind, 1)
			wantBytes.Up(kind, int64(size))
		}
	}
	require.Equal(t, wantCount, after.InactiveSplit, "free %#x: %d neighbours merged, whole %v", addr, merged, whole)
	require.Equal(t, wantBytes, after.InactiveSplitBytes, "free %#x: %d neighbours merged, whole %v", addr, merged, whole)
	return int(merged), whole, seg.IsExpandable
}
