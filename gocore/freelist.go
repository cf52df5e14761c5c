package gocore

import (
	"math/bits"
	"slices"
	"sort"

	"github.com/google/btree"
)

// smallBins indexes the free blocks of small segments (at most SmallBuffer
// bytes each) by exact size class, each class a min-heap on address (or, with
// bySegment, on segment age then address). Best fit by (size, address) is
// then a bitmap scan plus a heap pop: O(1) in the number of free blocks of
// other sizes, which keeps the cache-hit path fast however fragmented the
// pool is.
type smallBins struct {
	// bySegment breaks ties between equal-size blocks by the age of their
	// segments, oldest first, as torch 2.15 does (see blockBefore).
	bySegment bool
	nonEmpty  [smallClasses / 64]uint64
	// Bit w is set while nonEmpty[w] is not zero: a block far above the
	// requested class (typically a whole free 2 MiB segment, the last
	// class) is found without scanning the words in between.
	nonEmptyWords uint64
	bins          [smallClasses][]*block
}

const smallClasses = SmallBuffer / MinBlockSize

// nonEmptyWords has a bit per word of nonEmpty.
var _ [64 - smallClasses/64]struct{}

// smallClass is the bin of a block size (a multiple of MinBlockSize),
// unsigned so that its word and bit are a shift and a mask.
func smallClass(size uint64) uint { return uint(size/MinBlockSize) - 1 }

func (s *smallBins) insert(b *block) {
	c := smallClass(b.size)
	bin := &s.bins[c]
	n := len(*bin)
	if n < cap(*bin) {
		*bin = (*bin)[:n+1] // the length alone changes
	} else {
		*bin = append(*bin, nil)
	}
	siftUp(*bin, n, b, s.bySegment)
	s.nonEmpty[c/64] |= 1 << (c % 64)
	s.nonEmptyWords |= 1 << (c / 64)
}

func (s *smallBins) remove(b *block) {
	c := smallClass(b.size)
	bin := &s.bins[c]
	h := *bin
	i, last := b.heapIdx, len(h)-1
	moved := h[last]
	h[last] = nil
	h = h[:last]
	*bin = h // the length alone changes
	if i < last {
		// The last entry fills the hole at i, moving up or down.
		if !siftUp(h, i, moved, s.bySegment) {
			siftDown(h, i, moved, s.bySegment)
		}
	}
	if last == 0 {
		s.nonEmpty[c/64] &^= 1 << (c % 64)
		if s.nonEmpty[c/64] == 0 {
			s.nonEmptyWords &^= 1 << (c / 64)
		}
	}
	b.heapIdx = -1
}

// bestFit returns the first free block (lowest address, or oldest segment
// with bySegment) of the smallest size class that holds size bytes, or nil.
func (s *smallBins) bestFit(size uint64) *block {
	c := smallClass(size)
	w := c / 64
	m := s.nonEmpty[w] &^ (1<<(c%64) - 1)
	if m == 0 {
		above := s.nonEmptyWords &^ (1<<(w+1) - 1)
		if above == 0 {
			return nil
		}
		w = uint(bits.TrailingZeros64(above))
		m = s.nonEmpty[w]
	}
	return s.bins[w*64+uint(bits.TrailingZeros64(m))][0]
}

// blockBefore orders two free blocks of one size: by address (torch 2.5 to
// 2.14), or with bySegment by the order their segments were created in,
// then by address within a segment (torch 2.15's
// BlockComparatorSizeCounterAddress: every block carries the creation
// counter of its segment, so equal sizes go to the oldest segment first).
func blockBefore(a, b *block, bySegment bool) bool {
	if bySegment && a.seg != b.seg {
		return a.seg.seq < b.seg.seq
	}
	return a.addr < b.addr
}

// siftUp places e in the hole at h[i], moving it up past the parents that
// come after it (each moved parent is written once, not swapped). It reports
// whether e moved (if not, siftDown may still move it down).
func siftUp(h []*block, i int, e *block, bySegment bool) bool {
	j := i
	for j > 0 {
		p := (j - 1) >> 1
		parent := h[p]
		if !blockBefore(e, parent, bySegment) {
			break
		}
		h[j] = parent
		parent.heapIdx = j
		j = p
	}
	h[j] = e
	e.heapIdx = j
	return j != i
}

// siftDown places e in the hole at h[i], moving it down past the children
// that come before it.
func siftDown(h []*block, i int, e *block, bySegment bool) {
	j := i
	for {
		m := 2*j + 1
		if m >= len(h) {
			break
		}
		child := h[m]
		if r := m + 1; r < len(h) && blockBefore(h[r], child, bySegment) {
			m, child = r, h[r]
		}
		if !blockBefore(child, e, bySegment) {
			break
		}
		h[j] = child
		child.heapIdx = j
		j = m
	}
	h[j] = e
	e.heapIdx = j
}

// largeLess orders large free blocks by (size, address): torch's best fit
// before 2.15.
func largeLess(a, b *block) bool {
	if a.size != b.size {
		return a.size < b.size
	}
	return a.addr < b.addr
}

// largeLessBySegment orders large free blocks by (size, segment age,
// address): torch 2.15's best fit (see blockBefore).
func largeLessBySegment(a, b *block) bool {
	if a.size != b.size {
		return a.size < b.size
	}
	return blockBefore(a, b, true)
}

// searchSegment is the segment of search keys: created before every real
// one (segment.seq starts at 1), so a key of size n comes before every
// free block of n bytes in either order, as torch's search key does.
var searchSegment = segment{wholeFreeAt: -1}

// streamFree holds one stream's free blocks on one device. Keying free lists
// by stream first is what makes reuse stream-ordered: a block freed on S is
// handed out again only for work on S.
type streamFree struct {
	small smallBins
	large *btree.BTreeG[*block]
	// smallExp holds the free blocks of expandable small segments, which
	// grow past SmallBuffer and so outgrow the small bins' size classes;
	// nil until the first one is freed.
	smallExp *btree.BTreeG[*block]
	pivot    block // scratch key for tree searches, to avoid an allocation
}

// newStreamFree returns empty free lists that break ties between blocks of
// one size by address or, with bySegment, by segment age (torch 2.15).
func newStreamFree(bySegment bool) *streamFree {
	less := largeLess
	if bySegment {
		less = largeLessBySegment
	}
	f := &streamFree{large: btree.NewG(16, less)}
	f.small.bySegment = bySegment
	f.pivot.seg = &searchSegment
	return f
}

// treeFor returns the ordered tree that indexes the free blocks of s, or
// nil when they go in the small bins (small segments that do not grow).
func (f *streamFree) treeFor(s *segment) *btree.BTreeG[*block] {
	switch {
	case s.kind == kindLarge:
		return f.large
	case !s.expandable:
		return nil
	case f.smallExp == nil:
		f.smallExp = btree.NewG(16, largeLess)
	}
	return f.smallExp
}

// empty reports whether the lists hold no block.
func (f *streamFree) empty() bool {
	if f.large.Len() != 0 || (f.smallExp != nil && f.smallExp.Len() != 0) {
		return false
	}
	for _, w := range f.small.nonEmpty {
		if w != 0 {
			return false
		}
	}
	return true
}

// bestFitLarge is bestFit in the large tree.
func (f *streamFree) bestFitLarge(size, maxSplit, maxNonSplitRounding uint64) *block {
	return f.bestFit(f.large, size, maxSplit, maxNonSplitRounding, 0)
}

// bestFit is torch's get_free_block in tree t: the smallest block that
// holds size bytes, then the max_split_size rules: a request below maxSplit
// never takes an oversize block (one that will not be split), and an
// oversize request takes an oversize block only if it wastes less than
// maxNonSplitRounding.
//
// Among the blocks of expandable segments, torch ranks the free tail of a
// segment by what it could grow to (its size plus the segment's unmapped
// address space, up to its reservation of reserve bytes), not by its size: from
// the smallest block that fits it walks on to the next larger one while
// that one's growable size is smaller. So a fitting block elsewhere is
// preferred to the tail, which stays free to grow.
func (f *streamFree) bestFit(t *btree.BTreeG[*block], size, maxSplit, maxNonSplitRounding, reserve uint64) *block {
	f.pivot.size, f.pivot.addr = size, 0
	var found *block
	t.AscendGreaterOrEqual(&f.pivot, func(b *block) bool {
		if found == nil || growableSize(b, reserve) < growableSize(found, reserve) {
			found = b
			return b.seg.expandable
		}
		return false
	})
	if found == nil || maxSplit == 0 {
		return found
	}
	if size < maxSplit && found.size >= maxSplit {
		return nil
	}
	if size >= maxSplit && found.size-size >= maxNonSplitRounding { // not size+rounding: it may wrap
		return nil
	}
	return found
}

// growableSize is torch's expandable_size: the size of a free block of an
// expandable segment plus the unmapped address space right after it: a
// hole, or for the segment's last mapped block, the rest of its
// reservation of reserve bytes.
func growableSize(b *block, reserve uint64) uint64 {
	s, n := b.seg, b.next
	switch {
	case !s.expandable || (n != nil && !n.unmapped):
		return b.size
	case n == nil:
		return b.size + reserve - min(reserve, s.size)
	case n.next == nil: // a hole at the end: it runs on to the reservation's end
		return b.size + max(reserve, s.size) - (n.addr - s.addr)
	}
	return b.size + n.size
}

// The free-index operations of a device state: its free lists by stream,
// and the accounting that follows what they hold.

// freeList returns the free lists of stream s on d.
func (d *deviceState) freeList(s Stream) *streamFree {
	if f := d.lastFree; f != nil && d.lastStream == s {
		return f
	}
	return d.freeListSlow(s)
}

// freeListSlow is freeList for another stream than the last one's.
func (d *deviceState) freeListSlow(s Stream) *streamFree {
	f := d.streams[s]
	if f == nil {
		f = newStreamFree(d.bySegment)
		d.streams[s] = f
	}
	d.lastStream, d.lastFree = s, f
	return f
}

// dropFreeList forgets the (empty) free lists of stream s, so that a pool
// used by many short-lived streams does not keep a free list for each.
func (d *deviceState) dropFreeList(s Stream) {
	if d.lastFree != nil && d.lastStream == s {
		d.lastFree = nil
	}
	delete(d.streams, s)
}

// dropEmptyFreeLists forgets the free lists that hold no block, such as
// those of streams whose allocations all failed; O(streams).
func (d *deviceState) dropEmptyFreeLists() {
	for s, f := range d.streams {
		if f.empty() {
			d.dropFreeList(s)
		}
	}
}

// insertFree indexes a free block and keeps the split and whole-segment
// accounting that depends on it. Like torch, inactive_split leaves out
// expandable segments: their free pages can always be given back, which is
// what the stat is meant to exclude. freeBlockLocked writes it out.
func (d *deviceState) insertFree(f *streamFree, b *block) {
	seg := b.seg
	if t := f.treeFor(seg); t == nil {
		f.small.insert(b)
	} else {
		t.ReplaceOrInsert(b)
	}
	b.inFree = true
	if !b.isSplit() {
		d.addWholeFree(seg)
	} else if !seg.expandable {
		d.stats.InactiveSplit.up(seg.kind, 1)
		d.stats.InactiveSplitBytes.up(seg.kind, int64(b.size))
	}
}

// removeFree takes a free block out of the index, undoing insertFree.
func (d *deviceState) removeFree(f *streamFree, b *block) {
	seg := b.seg
	if t := f.treeFor(seg); t == nil {
		f.small.remove(b)
	} else {
		t.Delete(b)
	}
	b.inFree = false
	if !b.isSplit() {
		d.dropWholeFree(seg)
	} else if !seg.expandable {
		d.stats.InactiveSplit.down(seg.kind, 1)
		d.stats.InactiveSplitBytes.down(seg.kind, int64(b.size))
	}
}

// addWholeFree lists s as one free block, aged from now.
func (d *deviceState) addWholeFree(s *segment) {
	if s.wholeFreeAt >= 0 {
		return
	}
	s.wholeFreeAt = len(d.wholeFree)
	s.wholeFreeSince = d.largeLookups
	d.wholeFree = append(d.wholeFree, s)
}

// dropWholeFree takes s off the list (the last entry fills its place).
func (d *deviceState) dropWholeFree(s *segment) {
	i := s.wholeFreeAt
	if i < 0 {
		return
	}
	last := d.wholeFree[len(d.wholeFree)-1]
	d.wholeFree[i] = last
	last.wholeFreeAt = i
	d.wholeFree[len(d.wholeFree)-1] = nil
	d.wholeFree = d.wholeFree[:len(d.wholeFree)-1]
	s.wholeFreeAt = -1
}

// unusedBytes is reserved memory that holds no active block.
func (d *deviceState) unusedBytes() uint64 {
	return uint64(d.stats.ReservedBytes[0].Current - d.stats.ActiveBytes[0].Current)
}

// wholeFreeSegments lists the segments that could be released now, largest
// first (fewest backend calls to reach a target), then by address so the
// order is deterministic.
func (d *deviceState) wholeFreeSegments() []*segment {
	segs := slices.Clone(d.wholeFree)
	sort.Slice(segs, func(i, j int) bool {
		if segs[i].size != segs[j].size {
			return segs[i].size > segs[j].size
		}
		return segs[i].addr < segs[j].addr
	})
	return segs
}
