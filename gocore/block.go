package gocore

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
	// unmapped: a hole of an expandable segment, pages given back with a
	// PageMapper (never allocated, pending or free; whole pages).
	unmapped   bool
	streamUses []Stream // streams other than seg.stream that used the block
}

// mapped is the segment's reserved memory: its size less its holes.
func (s *segment) mapped() uint64 { return s.size - s.holes }

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
	expandable bool   // may grow in place (Expander backends)
	// holes is how many of the segment's bytes are unmapped (its unmapped
	// blocks): reserved memory is size - holes.
	holes uint64
	// oversize: the segment is counted in Stats.OversizeSegments (its size
	// is at least MaxSplitSize). Kept with the segment so that the count
	// follows it as it grows or shrinks and is taken back exactly once.
	oversize bool
	// wholeFreeAt is the segment's index in its device's wholeFree list
	// while it is one free block, else -1; wholeFreeSince is the
	// largeLookups clock when it became so (garbage collection's age).
	wholeFreeAt    int
	wholeFreeSince uint64
	// seq numbers the pool's segments in the order they were created, from
	// 1: torch 2.15 breaks best-fit ties between equal-size blocks by it
	// (Config.TorchVersion).
	seq uint64
}
