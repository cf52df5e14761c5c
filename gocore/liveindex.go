package gocore

import "math/bits"

// liveIndex maps the address of every allocated block to the block: the
// lookup each Free starts with, and the insert and delete of every cache
// hit. It replaces a map[uint64]*block there because Go's map hashes a
// uint64 key with the runtime's seeded memhash and probes control groups,
// which cost about a third of an alloc+free pair served from the cache
// (BenchmarkCacheHit profile). Addresses are distinct and never 0 (a backend
// returning 0 fails), so a table of (address, block) slots with linear
// probing, Fibonacci hashing and backward-shift deletion (no tombstones) is
// enough, and it keeps each probe to one cache line in the common case.
//
// Keys are not chosen by an adversary: they are the addresses the pool's own
// backend handed out, carved into blocks by the pool. Fibonacci hashing
// takes the top bits of addr*2^64/phi, which depend on every address bit, so
// blocks spaced by any power of two still spread over the table.
type liveIndex struct {
	slots []liveSlot // len is a power of two, or 0 before the first insert
	n     int        // occupied slots
	shift uint       // 64 - log2(len(slots))
}

type liveSlot struct {
	addr uint64 // 0: empty
	b    *block
}

const (
	liveIndexMinSlots = 64
	fibonacciMul      = 0x9E3779B97F4A7C15 // 2^64 / golden ratio, odd
)

func (x *liveIndex) home(addr uint64) uint64 { return (addr * fibonacciMul) >> x.shift }

// len returns the number of blocks in the index.
func (x *liveIndex) len() int { return x.n }

// get returns the block at addr, or nil.
func (x *liveIndex) get(addr uint64) *block {
	slots := x.slots
	if len(slots) == 0 || addr == 0 {
		return nil
	}
	// Probes are masked where they index (and slots is known not empty)
	// so that the compiler drops their bounds checks.
	mask := uint64(len(slots) - 1)
	for i := x.home(addr); ; i++ {
		i &= mask
		s := &slots[i]
		if s.addr == addr {
			return s.b
		}
		if s.addr == 0 {
			return nil
		}
	}
}

// put adds b under b.addr, which must not be in the index already.
func (x *liveIndex) put(b *block) {
	if b.addr == 0 {
		panic("gocore: block at address 0")
	}
	if 2*(x.n+1) > len(x.slots) { // keep the load at most 1/2
		x.resize(max(liveIndexMinSlots, 2*len(x.slots)))
	}
	x.insert(b.addr, b)
	x.n++
}

func (x *liveIndex) insert(addr uint64, b *block) {
	slots := x.slots
	if len(slots) == 0 { // never (put resizes first); tells the compiler
		panic("gocore: live index has no slots")
	}
	mask := uint64(len(slots) - 1)
	i := x.home(addr)
	for ; ; i++ {
		i &= mask
		if slots[i].addr == 0 {
			break
		}
	}
	slots[i] = liveSlot{addr, b}
}

// remove deletes addr, which must be in the index.
func (x *liveIndex) remove(addr uint64) {
	if x.take(addr) == nil {
		panic("gocore: removing an address not in the live index")
	}
}

// take deletes addr from the index and returns its block, or returns nil
// when addr is not in the index: Free's lookup and delete in one probe
// sequence. The slots after it that could have been placed in its slot move
// back (backward-shift deletion), so no probe sequence ever crosses a hole
// it should not.
func (x *liveIndex) take(addr uint64) *block {
	slots := x.slots
	if len(slots) == 0 || addr == 0 {
		return nil
	}
	mask, shift := uint64(len(slots)-1), x.shift
	i := (addr * fibonacciMul) >> shift // home(addr)
	for ; ; i++ {
		i &= mask
		if a := slots[i].addr; a == addr {
			break
		} else if a == 0 {
			return nil
		}
	}
	b := slots[i].b
	for j := i + 1; ; j++ {
		j &= mask
		a := slots[j].addr
		if a == 0 {
			break
		}
		// Move slot j into the hole at i unless its home lies cyclically
		// in (i, j]: then it is reachable from its home without passing i.
		if h := (a * fibonacciMul) >> shift; (j-h)&mask >= (j-i)&mask {
			slots[i] = slots[j]
			i = j
		}
	}
	slots[i] = liveSlot{}
	x.n--
	if len(slots) > liveIndexMinSlots && 8*x.n < len(slots) {
		x.resize(len(slots) / 2) // a burst of frees gives its memory back
	}
	return b
}

func (x *liveIndex) resize(size int) {
	old := x.slots
	x.slots = make([]liveSlot, size)
	x.shift = uint(65 - bits.Len(uint(size)))
	for _, s := range old {
		if s.addr != 0 {
			x.insert(s.addr, s.b)
		}
	}
}

// all calls f for every block in the index, in no particular order.
func (x *liveIndex) all(f func(*block)) {
	for _, s := range x.slots {
		if s.addr != 0 {
			f(s.b)
		}
	}
}
