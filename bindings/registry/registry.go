// Package registry maps the integer handles that Python and C hold to live
// pools, and pools to the numbered C entry points (slots) that torch's
// CUDAPluggableAllocator calls. It is shared by the gopy-facing bindings
// package and the cgo C ABI in bindings/cabi, which both live in one .so.
package registry

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/gpumempool/gpumempool/gocore"
)

// NumSlots is how many pools can have C entry points at once. Each slot is a
// pair of exported functions gmp_alloc_<i> / gmp_free_<i>; see bindings/cabi.
const NumSlots = 64

// ErrNoSuchPool: the handle was never issued or its pool was closed.
var ErrNoSuchPool = errors.New("no such pool")

// ErrNoFreeSlot: all NumSlots C entry points are taken by open pools.
var ErrNoFreeSlot = errors.New("all C entry points are in use")

// Entry is a registered pool.
type Entry struct {
	ID   int64
	Pool *gocore.Pool
	// Sim is the pool's backend when it is a simulator, for test controls.
	Sim *gocore.SimBackend
	// Keep holds the objects the backend depends on (e.g. a private
	// backend) for as long as the entry lives.
	Keep any

	// PanicNext makes the next C-ABI call on this pool panic inside Go:
	// fault injection proving that no panic crosses the C boundary.
	PanicNext atomic.Bool

	slot    atomic.Int32 // -1 when none
	lastErr atomic.Pointer[string]
	lastOOM atomic.Bool // the last error was an out-of-memory one
}

// SetError records the last error seen at the C boundary for this pool.
func (e *Entry) SetError(msg string) {
	e.lastOOM.Store(false)
	e.lastErr.Store(&msg)
}

// SetOutOfMemory records msg as the last error, an out-of-memory one.
func (e *Entry) SetOutOfMemory(msg string) {
	e.lastOOM.Store(true)
	e.lastErr.Store(&msg)
}

// LastErrorIsOutOfMemory reports whether the last error recorded was an
// out-of-memory one.
func (e *Entry) LastErrorIsOutOfMemory() bool { return e.lastOOM.Load() }

// TakeError returns and clears the last recorded error ("" when none).
func (e *Entry) TakeError() string {
	if p := e.lastErr.Swap(nil); p != nil {
		return *p
	}
	return ""
}

// PeekError returns the last recorded error without clearing it.
func (e *Entry) PeekError() string {
	if p := e.lastErr.Load(); p != nil {
		return *p
	}
	return ""
}

// Slot returns the entry's C slot, or -1.
func (e *Entry) Slot() int { return int(e.slot.Load()) }

var (
	mu     sync.Mutex
	nextID int64
	pools  = map[int64]*Entry{}
	slots  [NumSlots]atomic.Pointer[Entry]
	// orphanErr holds errors from C calls on slots with no pool.
	orphanErr atomic.Pointer[string]
)

// Add registers a pool and returns its entry with a fresh handle.
func Add(p *gocore.Pool, sim *gocore.SimBackend, keep any) *Entry {
	mu.Lock()
	defer mu.Unlock()
	nextID++
	e := &Entry{ID: nextID, Pool: p, Sim: sim, Keep: keep}
	e.slot.Store(-1)
	pools[e.ID] = e
	return e
}

// Get returns the entry for a handle.
func Get(id int64) (*Entry, error) {
	mu.Lock()
	defer mu.Unlock()
	e := pools[id]
	if e == nil {
		return nil, fmt.Errorf("pool handle %d: %w", id, ErrNoSuchPool)
	}
	return e, nil
}

// Remove unregisters a handle and frees its slot. The pool itself is not
// closed here.
func Remove(id int64) {
	mu.Lock()
	defer mu.Unlock()
	if e := pools[id]; e != nil {
		if s := e.slot.Load(); s >= 0 {
			slots[s].Store(nil)
		}
		delete(pools, id)
	}
}

// All returns the registered entries ordered by handle.
func All() []*Entry {
	mu.Lock()
	defer mu.Unlock()
	out := make([]*Entry, 0, len(pools))
	for id := int64(1); id <= nextID; id++ {
		if e := pools[id]; e != nil {
			out = append(out, e)
		}
	}
	return out
}

// AssignSlot gives the entry a C slot (the same one on every call).
func AssignSlot(e *Entry) (int, error) {
	mu.Lock()
	defer mu.Unlock()
	if s := e.slot.Load(); s >= 0 {
		return int(s), nil
	}
	if pools[e.ID] != e {
		return -1, fmt.Errorf("assign C entry points to pool handle %d: %w", e.ID, ErrNoSuchPool)
	}
	for i := range slots {
		if slots[i].Load() == nil {
			slots[i].Store(e)
			e.slot.Store(int32(i))
			return i, nil
		}
	}
	return -1, fmt.Errorf("pool %q needs C entry points but %d pools hold them; close one: %w",
		e.Pool.Name(), NumSlots, ErrNoFreeSlot)
}

// BySlot returns the entry behind a C slot, or nil. It takes no lock: the C
// hot path calls it on every allocation.
func BySlot(i int) *Entry {
	if i < 0 || i >= NumSlots {
		return nil
	}
	return slots[i].Load()
}

// Kind names the Python exception for err (gpumempool's exception classes,
// or a builtin): the Python layer raises it for a message "Kind: text".
func Kind(err error) string {
	switch {
	case errors.Is(err, gocore.ErrOutOfMemory):
		return "OutOfMemoryError"
	case errors.Is(err, gocore.ErrDoubleFree):
		return "DoubleFreeError"
	case errors.Is(err, gocore.ErrUnknownPointer):
		return "InvalidPointerError"
	case errors.Is(err, gocore.ErrClosed), errors.Is(err, ErrNoSuchPool):
		return "PoolClosedError"
	case errors.Is(err, gocore.ErrInvalidSize), errors.Is(err, gocore.ErrInvalidDevice),
		errors.Is(err, gocore.ErrInvalidArgument):
		return "ValueError"
	default:
		return "RuntimeError"
	}
}

// SetOrphanError records an error from a C call that no pool could own.
func SetOrphanError(msg string) { orphanErr.Store(&msg) }

// TakeOrphanError returns and clears the last such error.
func TakeOrphanError() string {
	if p := orphanErr.Swap(nil); p != nil {
		return *p
	}
	return ""
}
