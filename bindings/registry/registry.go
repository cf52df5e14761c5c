// Package registry maps the integer handles that Python and C hold to live
// pools, and pools to the numbered C entry points (slots) that torch's
// CUDAPluggableAllocator calls. It is shared by the gopy-facing bindings
// package and the cgo C ABI in bindings/cabi, which both live in one .so.
package registry

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/graphpool"
	"github.com/gpumempool/gpumempool/gocore/sim"
)

// NumSlots is how many pools can have C entry points at once. Each slot is a
// pair of exported functions gmp_alloc_<i> / gmp_free_<i>; see bindings/cabi.
const NumSlots = 64

// ErrNoSuchPool: the handle was never issued or its pool was closed.
var ErrNoSuchPool = errors.New("no such pool")

// ErrNoFreeSlot: all NumSlots C entry points are taken by open pools or
// retired (see FreeSlot).
var ErrNoFreeSlot = errors.New("all C entry points are in use")

// Entry is a registered pool.
type Entry struct {
	ID int64
	// Pool is the pool with the private pools of its CUDA graphs and
	// torch.cuda.MemPools: the one face of the pool every entry point (C,
	// torch, Python) sees; it decides which of them a call concerns.
	Pool *graphpool.Pools
	// Sim is the pool's backend when it is a simulator, for test controls.
	Sim *sim.Backend

	// reentry is the pool's backend when it runs user code under the
	// pool's lock (package callback), else nil: looked up once, not on
	// every call (CalledFromCallback).
	reentry interface{ CalledFromCallback() bool }

	// PanicNext makes the next C-ABI call on this pool panic inside Go:
	// fault injection proving that no panic crosses the C boundary.
	PanicNext atomic.Bool

	slot   atomic.Int32 // -1 when none
	pinned atomic.Bool  // the slot is never reused (AssignPinnedSlot)
	// called: a C entry point of the slot found this pool (BySlot), so a C
	// caller (torch, cupy, anyone who resolved the names) holds the
	// functions and may still call them, e.g. to free a block it got.
	called  atomic.Bool
	lastErr atomic.Pointer[error]
}

// CalledFromCallback reports whether the calling thread is inside the
// pool's own allocator function (a callback backend's), which holds the
// pool's lock: a call of the pool from there would wait for it forever.
func (e *Entry) CalledFromCallback() bool { return e.reentry != nil && e.reentry.CalledFromCallback() }

// SetError records the last error seen at the C boundary for this pool:
// the error itself, so that it crosses as text (gmp_last_error) or as its
// structured value (gmp_last_error_value, package pyerr).
func (e *Entry) SetError(err error) { e.lastErr.Store(&err) }

// TakeError returns and clears the last recorded error (nil when none).
func (e *Entry) TakeError() error { return take(&e.lastErr) }

// take returns and clears the error held by p, or nil.
func take(p *atomic.Pointer[error]) error {
	if err := p.Swap(nil); err != nil {
		return *err
	}
	return nil
}

// Slot returns the entry's C slot, or -1.
func (e *Entry) Slot() int { return int(e.slot.Load()) }

// Slots are handed out least recently used first, and a slot is reused
// only when nothing can call it for the pool that held it: torch keeps the
// function pointers of a CUDAPluggableAllocator for the life of the process,
// so a free of a block of a closed pool, or any call of a pinned slot, would
// otherwise reach the next pool to get the slot - and free one of its live
// blocks that happens to have the same address.
var (
	mu     sync.Mutex
	nextID int64
	// pools maps handles to entries (int64 to *Entry). It is written under
	// mu, with the slot changes that go with it, and read without it: Get
	// runs on every call of the Python API and of gmp_pool_alloc/free, from
	// any thread, and must not make the calls of unrelated pools wait for
	// one another.
	pools sync.Map
	slots [NumSlots]atomic.Pointer[Entry]
	// freeSlots queues the slots no pool holds, least recently freed first.
	freeSlots = func() []int {
		s := make([]int, NumSlots)
		for i := range s {
			s[i] = i
		}
		return s
	}()
	// retiredSlots counts the slots retired because their pool closed with
	// live blocks after C callers had used the slot; pinnedSlots those kept
	// for torch (AssignPinnedSlot, KeepSlotRetired).
	retiredSlots, pinnedSlots int
	// orphanErr holds errors from C calls on slots with no pool.
	orphanErr atomic.Pointer[error]
)

// Add registers a pool and returns its entry with a fresh handle.
func Add(p *gocore.Pool, sim *sim.Backend) *Entry {
	mu.Lock()
	defer mu.Unlock()
	nextID++
	e := &Entry{ID: nextID, Pool: graphpool.New(p), Sim: sim}
	e.reentry, _ = p.Backend().(interface{ CalledFromCallback() bool })
	e.slot.Store(-1)
	pools.Store(e.ID, e)
	return e
}

// Get returns the entry for a handle.
func Get(id int64) (*Entry, error) {
	e := lookup(id)
	if e == nil {
		return nil, fmt.Errorf("pool handle %d: %w", id, ErrNoSuchPool)
	}
	return e, nil
}

// Remove unregisters a handle and frees its slot for reuse (unless pinned).
// The pool itself is not closed here.
func Remove(id int64) {
	if e := Unregister(id); e != nil {
		FreeSlot(e, true)
	}
}

// Unregister removes a handle, so that no call finds its pool any more
// (calls through its slot find none either), and returns its entry, or nil.
// The slot stays out of use until FreeSlot.
func Unregister(id int64) *Entry {
	mu.Lock()
	defer mu.Unlock()
	v, ok := pools.LoadAndDelete(id)
	if !ok {
		return nil
	}
	e := v.(*Entry)
	if s := e.slot.Load(); s >= 0 {
		slots[s].Store(nil)
	}
	return e
}

// FreeSlot ends the hold of an unregistered entry on its slot. The slot goes
// to the back of the queue unless it is pinned (torch may call it for the
// rest of the process) or reusable is false (blocks of the pool outlived it)
// and a C caller has used the slot (it may still free one of those blocks
// through it); then it is retired for the life of the process, and calls of
// it keep failing cleanly. A slot whose names were handed out but never
// called is reused even after a close with live blocks: nobody outside
// holds a block through it.
func FreeSlot(e *Entry, reusable bool) {
	mu.Lock()
	defer mu.Unlock()
	s := e.slot.Load()
	if s < 0 || lookup(e.ID) == e {
		return // no slot, already freed, or still registered
	}
	e.slot.Store(-1)
	switch {
	case e.pinned.Load():
		pinnedSlots++
	case !reusable && e.called.Load():
		retiredSlots++
	default:
		freeSlots = append(freeSlots, int(s))
	}
}

// KeepSlotRetired makes the entry's slot, if it has one, never serve
// another pool once this one is gone: torch objects over its C functions
// (a torch.cuda.MemPool that could not be released) may still call them.
func KeepSlotRetired(e *Entry) { e.pinned.Store(true) }

// All returns the registered entries ordered by handle.
func All() []*Entry {
	var out []*Entry
	pools.Range(func(_, v any) bool {
		out = append(out, v.(*Entry))
		return true
	})
	slices.SortFunc(out, func(a, b *Entry) int { return cmp.Compare(a.ID, b.ID) })
	return out
}

// lookup returns the entry registered under id, or nil.
func lookup(id int64) *Entry {
	if v, ok := pools.Load(id); ok {
		return v.(*Entry)
	}
	return nil
}

// AssignSlot gives the entry a C slot (the same one on every call).
func AssignSlot(e *Entry) (int, error) { return assignSlot(e, false) }

// AssignPinnedSlot is AssignSlot for entry points torch calls for the rest
// of the process (full replacement): the slot will never serve another
// pool, even after this one is closed. The pin is set under the registry's
// lock, so a concurrent close cannot free the slot first.
func AssignPinnedSlot(e *Entry) (int, error) { return assignSlot(e, true) }

func assignSlot(e *Entry, pin bool) (int, error) {
	mu.Lock()
	defer mu.Unlock()
	if lookup(e.ID) != e {
		return -1, fmt.Errorf("assign C entry points to pool handle %d: %w", e.ID, ErrNoSuchPool)
	}
	if pin {
		e.pinned.Store(true)
	}
	if s := e.slot.Load(); s >= 0 {
		return int(s), nil
	}
	if len(freeSlots) == 0 {
		return -1, fmt.Errorf("pool %q needs C entry points but %s: %w", e.Pool.Name(), noSlotReason(), ErrNoFreeSlot)
	}
	i := freeSlots[0]
	freeSlots = freeSlots[1:]
	slots[i].Store(e)
	e.slot.Store(int32(i))
	return i, nil
}

// noSlotReason says where the NumSlots slots went and what can be done,
// naming only the causes that apply. Called with mu held.
func noSlotReason() string {
	held := NumSlots - retiredSlots - pinnedSlots
	var where, fixes []string
	if held > 0 {
		where = append(where, fmt.Sprintf("%d held by open pools", held))
		fixes = append(fixes, "close a pool that called pluggable_symbols() or was given to torch "+
			"(its slot is reused once nothing outside holds a block of it)")
	}
	if retiredSlots > 0 {
		where = append(where, fmt.Sprintf("%d retired because their pools were closed while blocks "+
			"allocated through their C functions were still live (a caller may still free those through them)",
			retiredSlots))
		fixes = append(fixes, "free every block a C caller got from a pool (drop its torch tensors) "+
			"before closing the pool, so its slot is reused")
	}
	if pinnedSlots > 0 {
		where = append(where, fmt.Sprintf("%d kept for torch, which may call them for the rest of the "+
			"process (set_torch_allocator, or torch objects over a pool that was closed)", pinnedSlots))
	}
	if retiredSlots+pinnedSlots > 0 {
		fixes = append(fixes, "retired slots come back only in a new process")
	}
	return fmt.Sprintf("all %d are taken: %s; %s", NumSlots, strings.Join(where, ", "), strings.Join(fixes, "; "))
}

// BySlot returns the entry behind a C slot, or nil. It takes no lock: the C
// hot path calls it on every call, and marks the entry as called (one
// atomic load once it is).
func BySlot(i int) *Entry {
	if i < 0 || i >= NumSlots {
		return nil
	}
	e := slots[i].Load()
	if e != nil && !e.called.Load() {
		e.called.Store(true)
	}
	return e
}

// SetOrphanError records an error from a C call that no pool could own.
func SetOrphanError(err error) { orphanErr.Store(&err) }

// TakeOrphanError returns and clears the last such error (nil when none).
func TakeOrphanError() error { return take(&orphanErr) }
