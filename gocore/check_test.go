package gocore

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// liveBlock returns the allocated block at addr (white box).
func liveBlock(t *testing.T, p *Pool, addr uint64) *block {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	b := p.live.get(addr)
	require.NotNil(t, b)
	return b
}

// The checker's own statement of the rounding policy, against numbers worked
// out by hand (not by the engine's rounding functions).
func TestLeastBlockSizeFollowsThePolicy(t *testing.T) {
	plain, _ := newTestPool(t, fakeConfig{}, Config{})
	div4, _ := newTestPool(t, fakeConfig{}, Config{RoundupPower2Divisions: 4})
	by := make([]uint64, RoundupIntervals)
	by[2] = 8 // [4 MiB, 8 MiB) in eighths
	bySize, _ := newTestPool(t, fakeConfig{}, Config{RoundupPower2DivisionsBySize: by})
	for _, c := range []struct {
		p           *Pool
		size, least uint64
		callerSized bool
	}{
		{plain, 1, 512, false},
		{plain, 512, 512, false},
		{plain, 513, 1024, false},
		{plain, 5*MiB + 1, 5*MiB + 512, false},
		{div4, 2048, 2048, false},                 // up to 512*4: plain
		{div4, 2049, 2560, false},                 // [2048, 4096) in steps of 512
		{div4, 5*MiB + 1, 6 * MiB, false},         // [4, 8) MiB in steps of 1 MiB
		{div4, 4 * MiB, 4 * MiB, false},           // a power of two stays
		{div4, 5*MiB + 1, 5*MiB + 512, true},      // AllocSegment: only 512-byte rounding
		{bySize, 5*MiB + 1, 5*MiB + MiB/2, false}, // interval 2: eighths of 4 MiB
		{bySize, 3*MiB + 1, 3*MiB + 512, false},   // interval 1: no divisions
	} {
		assert.Equal(t, c.least, c.p.leastBlockSize(c.size, c.callerSized), "size %d caller-sized %v", c.size, c.callerSized)
	}
}

// A block smaller than its rounded request is a violation: an audit made
// 512-byte rounding give a 513-byte request a 512-byte block, and nothing
// noticed.
func TestCheckInvariantsCatchesABlockThatDoesNotCoverItsRequest(t *testing.T) {
	p, _ := newTestPool(t, fakeConfig{}, Config{})
	a := mustAlloc(t, p, 0, 513, 0)
	require.NoError(t, p.CheckInvariants())
	b := liveBlock(t, p, a)
	require.EqualValues(t, 1024, b.size)
	b.requested = 1025 // as if the block were rounded down
	err := p.CheckInvariants()
	require.ErrorIs(t, err, ErrInvariant)
	assert.Contains(t, err.Error(), "1024 bytes for a 1025-byte request that rounds to 1536")
	b.requested = 0
	require.ErrorIs(t, p.CheckInvariants(), ErrInvariant, "an active block must record its request")
	b.requested = 513
	require.NoError(t, p.CheckInvariants())
}

// The pool's roundup_power2_divisions counts, not only 512-byte rounding: a
// block rounded without the divisions breaks the invariant, and a block
// that AllocSegment's caller sized does not.
func TestCheckInvariantsAppliesThePoolsRounding(t *testing.T) {
	p, _ := newTestPool(t, fakeConfig{}, Config{})
	a := mustAlloc(t, p, 0, 5*MiB+1, 0)
	s := mustAlloc(t, p, 0, 5*MiB+1, 1)
	liveBlock(t, p, s).callerSized = true
	require.NoError(t, p.CheckInvariants())
	p.cfg.RoundupPower2Divisions = 4 // the policy wants 6 MiB for 5 MiB + 1
	err := p.CheckInvariants()
	require.ErrorIs(t, err, ErrInvariant)
	assert.Contains(t, err.Error(), "request that rounds to 6291456")
	assert.NotContains(t, err.Error(), "in a free list")
	require.NoError(t, p.Free(a))
	require.NoError(t, p.CheckInvariants(), "a caller-sized block is held to 512-byte rounding only")
}

// A small bin out of heap order is a violation even while its first entry is
// still its lowest address: a remove that only sifted down left such bins,
// and best fit went wrong only several operations later.
func TestCheckInvariantsCatchesASmallBinOutOfHeapOrder(t *testing.T) {
	p, _ := newTestPool(t, fakeConfig{}, Config{})
	var addrs []uint64
	for range 8 {
		addrs = append(addrs, mustAlloc(t, p, 0, 512, 0))
	}
	for i := 0; i < len(addrs); i += 2 { // four free 512-byte blocks, not merged
		require.NoError(t, p.Free(addrs[i]))
	}
	require.NoError(t, p.CheckInvariants())
	p.mu.Lock()
	bin := p.devices[0].streams[0].small.bins[0]
	require.Len(t, bin, 4)
	bin[1], bin[3] = bin[3], bin[1] // a child below its parent's address...
	bin[1].heapIdx, bin[3].heapIdx = 1, 3
	p.mu.Unlock()
	require.Less(t, bin[3].addr, bin[1].addr)
	err := p.CheckInvariants()
	require.ErrorIs(t, err, ErrInvariant)
	assert.Contains(t, err.Error(), "small class 0")
	assert.Same(t, bin[0], p.devices[0].streams[0].small.bestFit(512), "...under the lowest address at the root")
}

// The checker's rounding policy at its edges: two divisions (halves), many
// divisions of a small request (a step below one byte), and the last
// interval of the per-size table, which holds every size from 32 GiB up.
func TestLeastBlockSizeAtThePolicysEdges(t *testing.T) {
	div2, _ := newTestPool(t, fakeConfig{}, Config{RoundupPower2Divisions: 2})
	div32, _ := newTestPool(t, fakeConfig{}, Config{RoundupPower2Divisions: 32})
	by := make([]uint64, RoundupIntervals)
	by[RoundupIntervals-1] = 4
	bySize, _ := newTestPool(t, fakeConfig{}, Config{RoundupPower2DivisionsBySize: by})
	for _, c := range []struct {
		p           *Pool
		size, least uint64
	}{
		{div2, 5*MiB + 1, 6 * MiB}, // [4, 8) MiB in halves
		{div2, 1025, 1536},         // up to 512*2: plain
		{div32, 17, 512},
		{div32, 16*1024 + 1, 16*1024 + 512}, // up to 512*32: plain
		{bySize, 1<<40 + 1, 1<<40 + 1<<38},  // 1 TiB: the last interval, in quarters
		{bySize, 1<<35 + 1, 1<<35 + 1<<33},  // 32 GiB, the interval's first size
	} {
		assert.Equal(t, c.least, c.p.leastBlockSize(c.size, false), "divisions %d, by size %v, size %d",
			c.p.cfg.RoundupPower2Divisions, c.p.cfg.RoundupPower2DivisionsBySize != nil, c.size)
	}
}

// CheckInvariants reports these corruptions (and says where), rather than
// missing them or failing itself.
func TestCheckInvariantsReportsCorruptions(t *testing.T) {
	for _, c := range []struct {
		name    string
		corrupt func(d *deviceState) string // returns the expected report
	}{
		{"cached free lists of another stream", func(d *deviceState) string {
			d.lastStream, d.lastFree = 0, newStreamFree(false)
			return "device 0: cached free lists of stream 0x0 are not its lists"
		}},
		{"wholly free segment placed past the list's end", func(d *deviceState) string {
			s := d.wholeFree[0]
			s.wholeFreeAt = len(d.wholeFree)
			return fmt.Sprintf("wholly free segment %#x is not listed", s.addr)
		}},
		{"blocks end short of their segment", func(d *deviceState) string {
			for _, s := range d.segments {
				if s.kind == kindSmall {
					s.last.size -= MinBlockSize
					return fmt.Sprintf("segment %#x: blocks end at %#x, segment at %#x", s.addr, s.addr+s.size-MinBlockSize, s.addr+s.size)
				}
			}
			panic("no small segment")
		}},
		{"small bitmap bit without blocks", func(d *deviceState) string {
			d.streams[0].small.nonEmpty[1] |= 1 << 5
			return "device 0 stream 0x0: small class 69: 0 free blocks, bitmap bit true"
		}},
		{"free small block placed past its bin's end", func(d *deviceState) string {
			for _, s := range d.segments {
				if s.kind == kindSmall {
					s.last.heapIdx = len(d.streams[0].small.bins[smallClass(s.last.size)])
					return fmt.Sprintf("free block %#x is not indexed under stream 0x0", s.last.addr)
				}
			}
			panic("no small segment")
		}},
		{"small bitmap bit cleared over blocks", func(d *deviceState) string {
			// The small segment's free rest: 2 MiB - 4096 bytes, class 4087.
			d.streams[0].small.nonEmpty[63] &^= 1 << 55
			return "device 0 stream 0x0: small class 4087: 1 free blocks, bitmap bit false"
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			p, _ := newTestPool(t, fakeConfig{}, Config{})
			mustAlloc(t, p, 0, 4096, 0)                               // a split small segment
			require.NoError(t, p.Free(mustAlloc(t, p, 0, 12*MiB, 0))) // a wholly free large one
			require.NoError(t, p.CheckInvariants())
			want := c.corrupt(p.devices[0])
			err := p.CheckInvariants()
			require.ErrorIs(t, err, ErrInvariant)
			assert.Contains(t, err.Error(), want)
		})
	}
}
