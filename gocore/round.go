package gocore

import "math/bits"

// Request rounding: every size the allocation path derives from a request
// (the block size, the pool kind, the segment to obtain, the growth of an
// expandable segment) is computed here.

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

// blockSize is the size of the block that serves a request of size bytes. A
// caller that sizes its segments (AllocSegment) applied its rounding
// options itself (torch's): only the 512-byte rounding applies beneath it.
func (p *Pool) blockSize(size uint64, callerSegments bool) uint64 {
	if callerSegments || (p.cfg.RoundupPower2Divisions < 2 && p.cfg.RoundupPower2DivisionsBySize == nil) {
		return roundSize(size) // what roundRequest comes to without divisions
	}
	return p.roundRequest(size)
}

// roundRequest rounds a request to its block size under the pool's policy.
func (p *Pool) roundRequest(size uint64) uint64 {
	if by := p.cfg.RoundupPower2DivisionsBySize; by != nil {
		return roundPower2Divisions(size, by[roundupInterval(size)])
	}
	return roundPower2Divisions(size, p.cfg.RoundupPower2Divisions)
}

// roundSize rounds a request up to MinBlockSize.
func roundSize(size uint64) uint64 {
	if size < MinBlockSize {
		return MinBlockSize
	}
	return (size + MinBlockSize - 1) / MinBlockSize * MinBlockSize
}

func roundUp(n, unit uint64) uint64 { return (n + unit - 1) / unit * unit }

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

// kindOf is the pool that serves a rounded request.
func kindOf(rounded uint64) poolKind {
	if rounded <= SmallSize {
		return kindSmall
	}
	return kindLarge
}

// segmentSize is how much to obtain from the backend for a rounded request
// that no cached block serves. A caller that sizes its segments gets just
// the rounded request (a multiple of RoundLarge for large ones) instead of
// LargeBuffer: it carves that segment itself (see AllocSegment).
func segmentSize(rounded uint64, callerSegments bool) uint64 {
	switch {
	case rounded <= SmallSize:
		return SmallBuffer
	case rounded < MinLargeAlloc && !callerSegments:
		return LargeBuffer
	default:
		return roundUp(rounded, RoundLarge)
	}
}
