// Package gocore is gpumempool's device-agnostic caching allocator engine.
//
// A Pool hands out blocks carved from segments that it obtains from a
// Backend (a simulated device, CUDA, NCCL, user callbacks, ...). The policy
// follows PyTorch's CUDACachingAllocator so users get what they know:
// 512-byte rounding, separate small and large free lists, best fit by
// (stream, size, address), splitting and merging, stream-ordered reuse with
// events for blocks used on other streams, and an OOM path that releases
// cached segments and retries before failing with a typed error.
package gocore

import "errors"

// Stream is an opaque stream handle as the caller's runtime knows it (for
// CUDA, the cudaStream_t value; 0 is the default stream). The engine never
// dereferences it: it only keys free lists by it and hands it to the backend.
type Stream uint64

// Event is an opaque backend event handle (for CUDA, a CUevent).
type Event uint64

// Backend is where a pool gets its segments from (the methods below) and
// how it learns that work queued on a stream has finished (its
// EventSource). Implementations must be safe for concurrent use: many pools
// may share one backend.
//
// The two halves are separate concerns: a backend that allocates through
// one library and orders work with another's events (the GPU backends all
// use CUDA events) embeds a value that implements EventSource (and, where
// it can wait, EventSynchronizer), rather than forwarding each event method
// by hand; Go promotes the embedded value's methods.
type Backend interface {
	// Name identifies the backend in errors and stats ("sim", "callback", ...).
	Name() string
	// Devices reports how many devices the backend serves; valid device
	// ordinals are 0..Devices()-1.
	Devices() int
	// Alignment is the guaranteed alignment of every address Alloc returns.
	Alignment() uint64
	// Capacity reports total and free bytes on a device, or an error that
	// wraps ErrUnsupported when the backend cannot tell.
	Capacity(device int) (total, free uint64, err error)
	// Alloc obtains a segment of exactly size bytes on device, ordered on
	// stream. A failure because memory ran out wraps ErrBackendOutOfMemory
	// so that the engine can release its cache and retry. The address is
	// never 0: C callers (torch) read NULL as failure, and the engine gives
	// such a segment back and fails the allocation.
	Alloc(device int, size uint64, stream Stream) (addr uint64, err error)
	// Free returns a segment obtained from Alloc.
	Free(device int, addr, size uint64, stream Stream) error
	// The events that order the reuse of blocks across streams.
	EventSource
}

// EventSource is the event half of a Backend: events that capture the work
// queued on a stream, so that the engine reuses a block freed on one stream
// on another only once that work has completed.
type EventSource interface {
	// NewEvent creates an event on device.
	NewEvent(device int) (Event, error)
	// RecordEvent captures the work queued so far on stream into ev.
	RecordEvent(ev Event, stream Stream) error
	// QueryEvent reports whether the work captured by ev has completed.
	QueryEvent(ev Event) (done bool, err error)
	// DestroyEvent releases ev.
	DestroyEvent(ev Event) error
}

// Expander is implemented by backends that can grow a segment in place by
// mapping more memory right after it (CUDA virtual memory management). With
// an expandable backend the engine keeps one growing segment per device,
// stream and pool kind (small, large) instead of allocating a new segment
// on every miss, like torch's expandable_segments, and maps torch's pages
// into it (2 MiB in the small pool, 20 MiB in the large one): fewer, larger
// segments, so a large block can be served from memory freed in smaller
// pieces.
type Expander interface {
	// Expandable reports whether growing is enabled (a backend option).
	Expandable() bool
	// Granularity is the unit segments are created and grown in.
	Granularity() uint64
	// Expand turns the segment [addr, addr+size) into
	// [addr, addr+size+extra). Running out of memory or of reserved address
	// space wraps ErrBackendOutOfMemory, and the segment stays as it was.
	Expand(device int, addr, size, extra uint64, stream Stream) error
}

// Shrinker is implemented by Expander backends that can also give back the
// end of a segment (with CUDA virtual memory management: unmap and release
// its last physical chunks, keeping the address range reserved). With one,
// the engine gives back the free tail of its expandable segments whenever it
// releases cached memory (the out-of-memory retry, EmptyCache, Trim and the
// release threshold), as torch unmaps the free pages of its expandable
// segments; without one, only wholly free segments go back.
type Shrinker interface {
	// Shrink gives back at most less bytes from the end of the segment
	// [addr, addr+size), which may later grow again with Expand; less is a
	// positive multiple of Granularity smaller than size, and no block in
	// that range is in use. It returns how many bytes it gave back: a
	// multiple of Granularity, at most less, 0 when it can give back
	// nothing there (its mappings need not end on the boundary asked); the
	// segment is then [addr, addr+size-released). On an error nothing was
	// given back.
	Shrink(device int, addr, size, less uint64, stream Stream) (released uint64, err error)
}

// PageMapper is implemented by Shrinker backends that can also give back
// pages inside a segment and map them again later, leaving holes in its
// address range (CUDA virtual memory management: unmap a range, map new
// memory there). With one, the engine releases cached memory as torch does
// with its expandable segments: every free page of an expandable segment
// goes back, not only those of its free tail, and a later request maps
// pages into the lowest hole it fits before it grows a segment at its end.
type PageMapper interface {
	// Unmap gives back the n bytes at offset off of the segment
	// [addr, addr+size), which are mapped and hold no block in use; off
	// and n are multiples of Granularity. The segment keeps its size (its
	// address range): the bytes become a hole.
	Unmap(device int, addr, size, off, n uint64, stream Stream) error
	// Map maps the n bytes at offset off of the segment again, a range
	// Unmap gave back; off and n are multiples of Granularity. Running out
	// of memory wraps ErrBackendOutOfMemory, and nothing is mapped.
	Map(device int, addr, size, off, n uint64, stream Stream) error
}

// EventSynchronizer is implemented by backends that can wait for an event
// (cuEventSynchronize). When a pool closes, a block whose free still waits
// for other streams may still be in use there: Close waits for its events
// before it gives the segment back, as torch's allocator synchronizes its
// outstanding events before it frees cached memory. Without one (backends
// whose events complete at once), Close does not wait.
type EventSynchronizer interface {
	// SynchronizeEvent blocks until the work captured by ev has completed.
	SynchronizeEvent(ev Event) error
}

// ErrUnsupported is wrapped by backend methods that a backend cannot serve.
var ErrUnsupported = errors.New("not supported by this backend")

// ErrBackendOutOfMemory is wrapped by Backend.Alloc when the device (or the
// user's allocator) has no memory left for the request.
var ErrBackendOutOfMemory = errors.New("backend out of memory")
