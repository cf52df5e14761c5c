// Package segtrack keeps the live segments of a backend whose driver calls
// run outside the backend's lock (package cuda's async backend, package
// nccl's backend): what Free checks a segment against, and the rules for a
// Free in flight. A second Free of a segment whose Free is in flight is
// refused. An Alloc may get back an address whose Free is in flight, since
// the driver may hand it out again as soon as its free returns, before that
// Free takes the lock to forget it; that Free then leaves the new segment
// alone.
package segtrack

import (
	"cmp"
	"fmt"
	"slices"
	"sync"

	"github.com/gpumempool/gpumempool/gocore"
)

// Segment is a live segment: its device, address and size.
type Segment struct {
	Device int
	Addr   uint64
	Size   uint64
}

type entry struct {
	Segment
	freeing bool // a Free is in flight: refuse a second one
}

// Table is the set of live segments of one backend, by address (addresses
// are unique across devices: UVA). It is safe for concurrent use.
type Table struct {
	who  string // what errors start with, e.g. "nccl backend"
	mu   sync.Mutex
	live map[uint64]*entry
}

// New returns an empty table whose errors start with who.
func New(who string) *Table {
	return &Table{who: who, live: make(map[uint64]*entry)}
}

// Add records s as live. It returns false and records nothing when s.Addr
// is a live segment whose Free is not in flight: the driver handed out
// memory that is still held, which the caller reports (and must never free
// twice).
func (t *Table) Add(s Segment) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if old, dup := t.live[s.Addr]; dup && !old.freeing {
		return false
	}
	t.live[s.Addr] = &entry{Segment: s}
	return true
}

// Lookup returns the live segment at addr, whether or not a Free of it is
// in flight.
func (t *Table) Lookup(addr uint64) (Segment, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.live[addr]
	if !ok {
		return Segment{}, false
	}
	return e.Segment, true
}

// Free frees the live segment at addr with free, which it calls without
// the table's lock. The segment must be live with device dev and size
// bytes, and no other Free of it in flight; otherwise the error wraps
// gocore.ErrInvalidArgument and free is not called. When free fails, its
// error is returned as it is and the segment stays live.
func (t *Table) Free(dev int, addr, size uint64, free func() error) error {
	t.mu.Lock()
	e, ok := t.live[addr]
	switch {
	case !ok || e.Device != dev || e.Size != size:
		t.mu.Unlock()
		return fmt.Errorf("%s: free(%#x, %d bytes, device %d): not a live segment of that size and device: %w",
			t.who, addr, size, dev, gocore.ErrInvalidArgument)
	case e.freeing:
		t.mu.Unlock()
		return fmt.Errorf("%s: free(%#x): already being freed: %w", t.who, addr, gocore.ErrInvalidArgument)
	}
	e.freeing = true
	t.mu.Unlock()

	err := free()
	t.mu.Lock()
	defer t.mu.Unlock()
	if err != nil {
		e.freeing = false
		return err
	}
	// Only our entry: after the driver's free an Add may already own addr.
	if t.live[addr] == e {
		delete(t.live, addr)
	}
	return nil
}

// Segments lists the live segments by device and address; never nil.
func (t *Table) Segments() []Segment {
	t.mu.Lock()
	out := make([]Segment, 0, len(t.live))
	for _, e := range t.live {
		out = append(out, e.Segment)
	}
	t.mu.Unlock()
	slices.SortFunc(out, func(x, y Segment) int {
		return cmp.Or(cmp.Compare(x.Device, y.Device), cmp.Compare(x.Addr, y.Addr))
	})
	return out
}
