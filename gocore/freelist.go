package gocore

import (
	"math/bits"

	"github.com/google/btree"
)

// smallBins indexes the free blocks of small segments (at most SmallBuffer
// bytes each) by exact size class, each class a min-heap on address. Best fit
// by (size, address) is then a bitmap scan plus a heap pop: O(1) in the
// number of free blocks of other sizes, which keeps the cache-hit path fast
// however fragmented the pool is.
type smallBins struct {
	nonEmpty [smallClasses / 64]uint64
	// Bit w is set while nonEmpty[w] is not zero: a block far above the
	// requested class (typically a whole free 2 MiB segment, the last
	// class) is found without scanning the words in between.
	nonEmptyWords uint64
	bins          [smallClasses][]*block
}

const smallClasses = SmallBuffer / MinBlockSize

// nonEmptyWords has a bit per word of nonEmpty.
var _ [64 - smallClasses/64]struct{}

func smallClass(size uint64) int { return int(size/MinBlockSize) - 1 }

func (s *smallBins) insert(b *block) {
	c := smallClass(b.size)
	h := append(s.bins[c], b)
	b.heapIdx = len(h) - 1
	siftUp(h, b.heapIdx)
	s.bins[c] = h
	s.nonEmpty[c/64] |= 1 << (c % 64)
	s.nonEmptyWords |= 1 << (c / 64)
}

func (s *smallBins) remove(b *block) {
	c := smallClass(b.size)
	h := s.bins[c]
	i, last := b.heapIdx, len(h)-1
	if i != last {
		h[i] = h[last]
		h[i].heapIdx = i
	}
	h[last] = nil
	h = h[:last]
	if i < len(h) {
		if !siftUp(h, i) {
			siftDown(h, i)
		}
	}
	s.bins[c] = h
	if len(h) == 0 {
		s.nonEmpty[c/64] &^= 1 << (c % 64)
		if s.nonEmpty[c/64] == 0 {
			s.nonEmptyWords &^= 1 << (c / 64)
		}
	}
	b.heapIdx = -1
}

// bestFit returns the lowest-addressed free block of the smallest size class
// that holds size bytes, or nil.
func (s *smallBins) bestFit(size uint64) *block {
	c := smallClass(size)
	w := c / 64
	m := s.nonEmpty[w] &^ (1<<(c%64) - 1)
	if m == 0 {
		above := s.nonEmptyWords &^ (1<<(w+1) - 1)
		if above == 0 {
			return nil
		}
		w = bits.TrailingZeros64(above)
		m = s.nonEmpty[w]
	}
	return s.bins[w*64+bits.TrailingZeros64(m)][0]
}

func siftUp(h []*block, i int) bool {
	moved := false
	for i > 0 {
		p := (i - 1) / 2
		if h[p].addr <= h[i].addr {
			break
		}
		h[p], h[i] = h[i], h[p]
		h[p].heapIdx, h[i].heapIdx = p, i
		i = p
		moved = true
	}
	return moved
}

func siftDown(h []*block, i int) {
	for {
		l := 2*i + 1
		if l >= len(h) {
			return
		}
		m := l
		if r := l + 1; r < len(h) && h[r].addr < h[l].addr {
			m = r
		}
		if h[i].addr <= h[m].addr {
			return
		}
		h[i], h[m] = h[m], h[i]
		h[i].heapIdx, h[m].heapIdx = i, m
		i = m
	}
}

// largeLess orders large free blocks by (size, address): torch's best fit.
func largeLess(a, b *block) bool {
	if a.size != b.size {
		return a.size < b.size
	}
	return a.addr < b.addr
}

// streamFree holds one stream's free blocks on one device. Keying free lists
// by stream first is what makes reuse stream-ordered: a block freed on S is
// handed out again only for work on S.
type streamFree struct {
	small smallBins
	large *btree.BTreeG[*block]
	pivot block // scratch key for tree searches, to avoid an allocation
}

func newStreamFree() *streamFree {
	return &streamFree{large: btree.NewG(16, largeLess)}
}

// empty reports whether the lists hold no block.
func (f *streamFree) empty() bool {
	if f.large.Len() != 0 {
		return false
	}
	for _, w := range f.small.nonEmpty {
		if w != 0 {
			return false
		}
	}
	return true
}

func (f *streamFree) insert(b *block) {
	if b.seg.kind == kindSmall {
		f.small.insert(b)
	} else {
		f.large.ReplaceOrInsert(b)
	}
	b.inFree = true
}

func (f *streamFree) remove(b *block) {
	if b.seg.kind == kindSmall {
		f.small.remove(b)
	} else {
		f.large.Delete(b)
	}
	b.inFree = false
}

// bestFitLarge applies torch's max_split_size rules: a request below
// maxSplit never takes an oversize block (one that will not be split), and an
// oversize request takes an oversize block only if it wastes less than
// maxNonSplitRounding.
func (f *streamFree) bestFitLarge(size, maxSplit, maxNonSplitRounding uint64) *block {
	f.pivot.size, f.pivot.addr = size, 0
	var found *block
	f.large.AscendGreaterOrEqual(&f.pivot, func(b *block) bool {
		found = b
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
