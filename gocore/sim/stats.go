package sim

import (
	"slices"
)

// Stats is a snapshot of a Backend's counters.
type Stats struct {
	// Allocs counts Alloc calls that succeeded.
	Allocs uint64
	// Frees counts Free calls that succeeded.
	Frees uint64
	// FailedAllocs counts Alloc calls that returned an error, injected or not.
	FailedAllocs uint64
	// FailedFrees counts Free calls that returned an error, injected or not.
	FailedFrees uint64
	// LiveSegments is the number of allocated, not yet freed segments over
	// all devices.
	LiveSegments int
	// LiveBytes is the sum of the requested sizes of the live segments over
	// all devices.
	LiveBytes uint64
	// EventsCreated counts successful NewEvent calls.
	EventsCreated uint64
	// EventsDestroyed counts successful DestroyEvent calls.
	EventsDestroyed uint64
	// EventWaits counts SynchronizeEvent calls that found the event's work
	// not yet completed (and completed it).
	EventWaits uint64
	// LiveEvents is the number of events created and not yet destroyed.
	LiveEvents int
	// Expansions counts successful Expand calls.
	Expansions uint64
	// Shrinks counts successful Shrink calls.
	Shrinks uint64
	// Unmaps and Maps count successful Unmap and Map calls.
	Unmaps, Maps uint64
	// Placed counts Allocs that returned the address PlaceNext asked for.
	Placed uint64
}

// Segment describes one live segment of a Backend.
type Segment struct {
	// Device is the device the segment lives on.
	Device int
	// Addr is the segment's start address as returned by Alloc.
	Addr uint64
	// Size is the size requested from Alloc (not rounded).
	Size uint64
}

// Stats returns a snapshot of the backend's counters.
func (b *Backend) Stats() Stats {
	b.mu.Lock()
	defer b.mu.Unlock()
	st := b.stats
	for d := range b.devices {
		st.LiveSegments += len(b.devices[d].live)
		st.LiveBytes += b.devices[d].used
	}
	st.LiveEvents = len(b.events)
	return st
}

// LiveSegmentsList returns every live segment sorted by device, then
// address; it is empty when nothing leaks.
func (b *Backend) LiveSegmentsList() []Segment {
	b.mu.Lock()
	defer b.mu.Unlock()
	var segs []Segment
	for d := range b.devices {
		for addr, size := range b.devices[d].live {
			segs = append(segs, Segment{Device: d, Addr: addr, Size: size})
		}
	}
	slices.SortFunc(segs, func(x, y Segment) int {
		if x.Device != y.Device {
			return x.Device - y.Device
		}
		switch {
		case x.Addr < y.Addr:
			return -1
		case x.Addr > y.Addr:
			return 1
		}
		return 0
	})
	return segs
}
