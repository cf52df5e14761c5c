// Package callback is a gocore.Backend whose segments come from user
// functions with PyTorch's pluggable-allocator signatures:
//
//	void* alloc(size_t size, int device, void* stream);
//	void  free(void* ptr, size_t size, int device, void* stream);
//
// (the {alloc, deleter} pair of PyTorch's MemPool: ncclMemAlloc, cuMemCreate
// with a host NUMA location, or anything else a user writes in C, or in
// Python through a ctypes callback). cgo is used only for the two trampolines that call the
// function pointers.
//
// The package is itself a driver layer (a door to C code, as
// gocore/cuda/driver is to libcuda): its segments exist only as C function
// pointers, so without cgo there is nothing to call and the package, which
// imports "C", is not built. Splitting the trampolines into a package of
// their own would leave a backend that no CGO_ENABLED=0 build could use.
//
// The functions may be called from any OS thread, with the pool's lock held
// (never with the backend's own): they must not call into their own pool.
// The C ABI refuses such a call (CalledFromCallback, ErrReentry) rather
// than deadlock.
// A Python callback (ctypes) takes the GIL on entry; see docs/api.md (Your
// own allocator) for the deadlock this can cause under torch's allocator lock.
package callback

/*
#include <stddef.h>
#include <stdint.h>

typedef void* (*gmp_alloc_fn)(size_t, int, void*);
typedef void (*gmp_free_fn)(void*, size_t, int, void*);

// The backends whose user functions this thread is running, innermost
// first: a linked list of frames on the C stack. A call back into any of
// those pools from inside (directly, or through another pool's function:
// A's function allocating from B, whose function calls A) is refused
// instead of waiting for that pool's lock forever (CalledFromCallback). A
// C thread-local: Go code that C calls back runs on the same thread.
struct gmp_cb_frame { uintptr_t owner; struct gmp_cb_frame *prev; };
static __thread struct gmp_cb_frame *gmp_cb_top;

static uintptr_t gmp_call_alloc(uintptr_t owner, uintptr_t fn, size_t size, int device, uintptr_t stream) {
	struct gmp_cb_frame f = { owner, gmp_cb_top };
	gmp_cb_top = &f;
	uintptr_t p = (uintptr_t)((gmp_alloc_fn)fn)(size, device, (void*)stream);
	gmp_cb_top = f.prev;
	return p;
}

static void gmp_call_free(uintptr_t owner, uintptr_t fn, uintptr_t ptr, size_t size, int device, uintptr_t stream) {
	struct gmp_cb_frame f = { owner, gmp_cb_top };
	gmp_cb_top = &f;
	((gmp_free_fn)fn)((void*)ptr, size, device, (void*)stream);
	gmp_cb_top = f.prev;
}

static int gmp_callback_running(uintptr_t owner) {
	for (struct gmp_cb_frame *f = gmp_cb_top; f; f = f->prev) {
		if (f->owner == owner) {
			return 1;
		}
	}
	return 0;
}
*/
import "C"

import (
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"

	"github.com/gpumempool/gpumempool/gocore"
)

// Config names the user's functions.
type Config struct {
	// Alloc and Free are C function pointers (addresses) with the
	// signatures above. Both are required.
	Alloc, Free uintptr
	// Name identifies the allocator in errors; default "callback".
	Name string
	// Devices is how many device ordinals the functions accept (default 1).
	Devices int `option:"devices" min:"0" doc:"how many device ordinals the functions accept (0: 1)"`
	// Alignment is checked on every address Alloc returns: a misaligned
	// one is given back with Free and the allocation fails. Must be a power
	// of two; default DefaultAlignment, the alignment the pool promises for
	// its blocks (1 turns the check off).
	Alignment uint64 `option:"alignment" max:"2147483647" doc:"alignment checked on every address alloc returns, a power of two (0: 512)"`
	// Python marks functions that run Python code (ctypes thunks): once
	// the interpreter is exiting (PythonExiting) they are not called any
	// more, since the thunks die with it and no thread can take the GIL.
	Python bool
}

// MaxDevices bounds Config.Devices, as gocore.MaxDevices bounds a pool's.
const MaxDevices = gocore.MaxDevices

// pythonExiting is set by PythonExiting.
var pythonExiting atomic.Bool

// PythonExiting stops every backend made with Config.Python from calling
// its functions: an allocation then fails as out of memory and a free is
// skipped (the memory dies with the process). Called from Python's atexit,
// before the interpreter tears the functions down: torch or other C code
// may still allocate or free through a pool at that point.
func PythonExiting() { pythonExiting.Store(true) }

// errPythonExited is returned by the functions of a Python backend after
// PythonExiting.
var errPythonExited = errors.New("the Python interpreter is exiting, so its allocator functions are not called any more")

// DefaultAlignment is the alignment of Config.Alignment 0: torch's 512-byte
// block alignment, which the pool's blocks keep only if segments start on it.
const DefaultAlignment uint64 = 512

// Backend calls user functions for segments. Their allocations are assumed
// usable on any stream once returned (as ncclMemAlloc's and cuMemCreate's
// are), so events complete at once: cross-stream reuse of a freed block is
// ordered by the caller, not by events. Backends with real events (cuda)
// come in their own packages.
type Backend struct {
	cfg   Config
	owner uintptr // this backend's mark while its user functions run

	mu        sync.Mutex
	live      map[uint64]uint64 // segment address -> size
	nextEvent gocore.Event
	events    map[gocore.Event]struct{}
}

var _ gocore.Backend = (*Backend)(nil)

var owners atomic.Uintptr

// ErrReentry is wrapped by the errors of calls made into a pool from inside
// its own allocator function (which runs under the pool's lock).
var ErrReentry = errors.New("called from inside the pool's own allocator function, which runs under the pool's lock")

// New validates cfg and returns a Backend.
func New(cfg Config) (*Backend, error) {
	if cfg.Alloc == 0 || cfg.Free == 0 {
		return nil, fmt.Errorf("callback backend: both alloc and free functions are required: %w", gocore.ErrInvalidArgument)
	}
	if cfg.Name == "" {
		cfg.Name = "callback"
	}
	if cfg.Devices == 0 {
		cfg.Devices = 1
	}
	if cfg.Devices < 0 || cfg.Devices > MaxDevices {
		return nil, fmt.Errorf("callback backend %q: %d devices (at most %d): %w", cfg.Name, cfg.Devices, MaxDevices, gocore.ErrInvalidArgument)
	}
	if cfg.Alignment == 0 {
		cfg.Alignment = DefaultAlignment
	}
	if cfg.Alignment&(cfg.Alignment-1) != 0 {
		return nil, fmt.Errorf("callback backend %q: alignment %d is not a power of two: %w", cfg.Name, cfg.Alignment, gocore.ErrInvalidArgument)
	}
	return &Backend{cfg: cfg, owner: owners.Add(1), live: make(map[uint64]uint64),
		events: make(map[gocore.Event]struct{})}, nil
}

// CalledFromCallback reports whether the calling thread is inside one of
// b's user functions, however deep (a C function calling back into its own
// pool, maybe through another pool's function, would wait forever for the
// pool's lock). It costs one cgo call.
func (b *Backend) CalledFromCallback() bool { return C.gmp_callback_running(C.uintptr_t(b.owner)) != 0 }

// Name returns the configured name.
func (b *Backend) Name() string { return b.cfg.Name }

// Devices returns the configured device count.
func (b *Backend) Devices() int { return b.cfg.Devices }

// Alignment returns the alignment every returned address is checked for.
func (b *Backend) Alignment() uint64 { return b.cfg.Alignment }

// Capacity is unknown for user functions.
func (b *Backend) Capacity(device int) (uint64, uint64, error) {
	return 0, 0, fmt.Errorf("callback backend %q capacity: %w", b.cfg.Name, gocore.ErrUnsupported)
}

// Alloc calls the user's alloc function. NULL means out of memory, so the
// engine releases its cache and retries before failing.
func (b *Backend) Alloc(device int, size uint64, stream gocore.Stream) (uint64, error) {
	if device < 0 || device >= b.cfg.Devices {
		return 0, fmt.Errorf("callback backend %q: device %d out of range [0, %d): %w", b.cfg.Name, device, b.cfg.Devices, gocore.ErrInvalidDevice)
	}
	if b.cfg.Python && pythonExiting.Load() {
		return 0, fmt.Errorf("callback backend %q: alloc(%d): %w: %w", b.cfg.Name, size, errPythonExited, gocore.ErrBackendOutOfMemory)
	}
	addr := uint64(C.gmp_call_alloc(C.uintptr_t(b.owner), C.uintptr_t(b.cfg.Alloc), C.size_t(size), C.int(device), C.uintptr_t(stream)))
	if addr == 0 {
		return 0, fmt.Errorf("callback backend %q: alloc(%d, device %d) returned NULL: %w", b.cfg.Name, size, device, gocore.ErrBackendOutOfMemory)
	}
	giveBack := func() {
		// Not ours to keep: hand it back so that nothing leaks (without
		// b.mu: the user's function runs unlocked, as in Free).
		C.gmp_call_free(C.uintptr_t(b.owner), C.uintptr_t(b.cfg.Free), C.uintptr_t(addr), C.size_t(size), C.int(device), C.uintptr_t(stream))
	}
	if addr%b.cfg.Alignment != 0 {
		giveBack()
		return 0, fmt.Errorf("callback backend %q: alloc(%d) returned %#x, not aligned to %d bytes (the backend's "+
			"alignment; the address was given back with the free function)", b.cfg.Name, size, addr, b.cfg.Alignment)
	}
	if addr > math.MaxUint64-size {
		giveBack()
		return 0, fmt.Errorf("callback backend %q: alloc(%d) returned %#x, whose %d bytes would run past the end of "+
			"the address space (the address was given back with the free function)", b.cfg.Name, size, addr, size)
	}
	if a, n, overlap := b.add(addr, size); overlap {
		giveBack()
		return 0, fmt.Errorf("callback backend %q: alloc(%d) returned %#x, which overlaps the segment %#x+%d "+
			"it returned before and still holds (the address was given back with the free function)",
			b.cfg.Name, size, addr, a, n)
	}
	return addr, nil
}

// add records the live segment [addr, addr+size) unless it overlaps one
// recorded already (a, n), which the function still holds: memory must
// never be served twice. A linear scan: it runs once per segment, next to a
// call of the user's allocator.
func (b *Backend) add(addr, size uint64) (a, n uint64, overlap bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for a, n := range b.live {
		if addr < a+n && a < addr+size {
			return a, n, true
		}
	}
	b.live[addr] = size
	return 0, 0, false
}

// Free calls the user's free function with the size and stream of the
// segment's allocation.
func (b *Backend) Free(device int, addr, size uint64, stream gocore.Stream) error {
	b.mu.Lock()
	got, ok := b.live[addr]
	if ok && got == size {
		delete(b.live, addr)
	}
	b.mu.Unlock()
	if !ok || got != size {
		return fmt.Errorf("callback backend %q: free(%#x, %d): not a live segment of that size: %w", b.cfg.Name, addr, size, gocore.ErrInvalidArgument)
	}
	if b.cfg.Python && pythonExiting.Load() {
		return nil // the memory dies with the process
	}
	C.gmp_call_free(C.uintptr_t(b.owner), C.uintptr_t(b.cfg.Free), C.uintptr_t(addr), C.size_t(size), C.int(device), C.uintptr_t(stream))
	return nil
}

// LiveSegments reports how many segments the user's functions hold for us.
func (b *Backend) LiveSegments() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.live)
}

// NewEvent returns an event that is complete as soon as it is recorded.
func (b *Backend) NewEvent(device int) (gocore.Event, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.nextEvent++
	b.events[b.nextEvent] = struct{}{}
	return b.nextEvent, nil
}

// RecordEvent checks that ev exists.
func (b *Backend) RecordEvent(ev gocore.Event, stream gocore.Stream) error {
	return b.checkEvent("record", ev)
}

// QueryEvent reports every live event as complete.
func (b *Backend) QueryEvent(ev gocore.Event) (bool, error) {
	if err := b.checkEvent("query", ev); err != nil {
		return false, err
	}
	return true, nil
}

// DestroyEvent forgets ev.
func (b *Backend) DestroyEvent(ev gocore.Event) error {
	if err := b.checkEvent("destroy", ev); err != nil {
		return err
	}
	b.mu.Lock()
	delete(b.events, ev)
	b.mu.Unlock()
	return nil
}

func (b *Backend) checkEvent(op string, ev gocore.Event) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, ok := b.events[ev]; !ok {
		return fmt.Errorf("callback backend %q: %s unknown event %d: %w", b.cfg.Name, op, ev, gocore.ErrInvalidArgument)
	}
	return nil
}
