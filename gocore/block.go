package gocore

import "math/bits"

// Size policy, the same as PyTorch's CUDACachingAllocator so that memory use
// is what torch users expect.
const (
	// MinBlockSize is the rounding granularity of every request.
	MinBlockSize = 512
	// SmallSize is the largest request served from the small pool.
	SmallSize = 1 << 20
	// SmallBuffer is the segment size the small pool obtains from a backend.
	SmallBuffer = 2 << 20
	// LargeBuffer is the segment size for large requests under MinLargeAlloc.
	LargeBuffer = 20 << 20
	// MinLargeAlloc: large requests at least this big get a segment of their
	// own size rounded up to RoundLarge.
	MinLargeAlloc = 10 << 20
	// RoundLarge is the rounding of segments for requests >= MinLargeAlloc.
	RoundLarge = 2 << 20
	// MaxRequest bounds a single request (1 PiB); anything larger is a bug
	// in the caller, not a real allocation.
	MaxRequest = 1 << 50
)

// poolKind tells which free lists a block belongs to; it indexes StatArray.
type poolKind int

const (
	kindSmall poolKind = 1
	kindLarge poolKind = 2
)

// block is a contiguous range inside a segment: either handed to a caller
// (allocated), waiting for events on other streams (pending), or free and
// indexed in its stream's free lists.
type block struct {
	seg        *segment
	addr, size uint64
	requested  uint64 // the caller's size, before rounding
	// callerSized: allocated by AllocSegment, whose caller rounded the
	// request itself (only the 512-byte rounding applies, not the pool's).
	callerSized bool
	allocated   bool
	pending     int    // outstanding events before the block may be reused
	prev, next  *block // address-ordered neighbours in the same segment
	heapIdx     int    // index in a small bin while free, else -1
	inFree      bool
	streamUses  []Stream // streams other than seg.stream that used the block
}

// isSplit reports whether the block shares its segment with other blocks.
func (b *block) isSplit() bool { return b.prev != nil || b.next != nil }

// segment is one allocation obtained from the backend. Blocks carved from it
// may only be reused on the stream that created it (stream-ordered reuse).
type segment struct {
	device     int
	addr, size uint64
	stream     Stream
	kind       poolKind
	first      *block // lowest-address block
	last       *block // highest-address block
	expandable bool   // may grow in place (Expander backends, large pool)
	// oversize: the segment is counted in Stats.OversizeSegments (its size
	// is at least MaxSplitSize). Kept with the segment so that the count
	// follows it as it grows or shrinks and is taken back exactly once.
	oversize bool
	// wholeFreeAt is the segment's index in its device's wholeFree list
	// while it is one free block, else -1; wholeFreeSince is the
	// largeLookups clock when it became so (garbage collection's age).
	wholeFreeAt    int
	wholeFreeSince uint64
}

// roundSize rounds a request up to MinBlockSize.
func roundSize(size uint64) uint64 {
	if size < MinBlockSize {
		return MinBlockSize
	}
	return (size + MinBlockSize - 1) / MinBlockSize * MinBlockSize
}

// roundPower2Divisions rounds a request as torch's roundup_power2_divisions
// does: the range between the powers of two around size is cut into
// divisions equal steps and size goes up to the next step, so that requests
// of similar sizes share block sizes (less fragmentation from many distinct
// sizes, at the cost of some rounding waste). Powers of two, sizes up to
// MinBlockSize*divisions, and divisions < 2 get plain rounding. divisions
// must be a power of two.
func roundPower2Divisions(size, divisions uint64) uint64 {
	if divisions < 2 || size <= MinBlockSize*divisions || size&(size-1) == 0 {
		return roundSize(size)
	}
	floor := uint64(1) << (63 - bits.LeadingZeros64(size))
	return roundUp(size, floor/divisions)
}

// RoundupIntervals is how many size intervals torch's per-size
// roundup_power2_divisions has: interval 0 holds sizes below 2 MiB, interval
// i sizes in [2^(20+i), 2^(21+i)), and the last one everything from 32 GiB.
const RoundupIntervals = 16

// roundupInterval is the interval of torch's divisions table that size falls
// in.
func roundupInterval(size uint64) int {
	const start = 20 // log2(1 MiB)
	log := 63 - bits.LeadingZeros64(size)
	if log <= start {
		return 0
	}
	return min(log-start, RoundupIntervals-1)
}

// segmentSize is how much to obtain from the backend for a rounded request.
func segmentSize(rounded uint64) uint64 {
	switch {
	case rounded <= SmallSize:
		return SmallBuffer
	case rounded < MinLargeAlloc:
		return LargeBuffer
	default:
		return (rounded + RoundLarge - 1) / RoundLarge * RoundLarge
	}
}

// kindOf is the pool that serves a rounded request.
func kindOf(rounded uint64) poolKind {
	if rounded <= SmallSize {
		return kindSmall
	}
	return kindLarge
}
