package sim

import (
	"fmt"

	"github.com/gpumempool/gpumempool/gocore"
)

// streamKey identifies a stream on a device.
type streamKey struct {
	device int
	stream gocore.Stream
}

// streamState holds a stream's submitted and completed work counters.
type streamState struct {
	submitted, completed uint64
}

// eventState is the state behind a gocore.Event handle.
type eventState struct {
	device   int
	recorded bool
	stream   gocore.Stream
	seq      uint64
}

// NewEvent creates an unrecorded event on device. Querying an unrecorded
// event reports it done, as CUDA does.
func (b *Backend) NewEvent(device int) (gocore.Event, error) {
	if err := b.checkDevice("new event", device); err != nil {
		return 0, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	ev := b.nextEvent
	b.nextEvent++
	b.events[ev] = &eventState{device: device}
	b.stats.EventsCreated++
	return ev, nil
}

// lookupEventLocked returns ev's state or an error naming op; b.mu must be
// held.
func (b *Backend) lookupEventLocked(op string, ev gocore.Event) (*eventState, error) {
	e, ok := b.events[ev]
	if ok {
		return e, nil
	}
	if ev != 0 && ev < b.nextEvent {
		return nil, fmt.Errorf("sim: %s: event %d was destroyed", op, ev)
	}
	return nil, fmt.Errorf("sim: %s: unknown event %d", op, ev)
}

// streamLocked returns the state of stream on device, creating it; b.mu
// must be held.
func (b *Backend) streamLocked(device int, stream gocore.Stream) *streamState {
	k := streamKey{device: device, stream: stream}
	s, ok := b.streams[k]
	if !ok {
		s = &streamState{}
		b.streams[k] = s
	}
	return s
}

// RecordEvent captures the work submitted so far to stream (on ev's device)
// into ev: it counts one more submission on the stream and remembers it. In
// manual mode the event stays pending until CompleteStream or CompleteAll;
// otherwise it completes at once. Recording again replaces the capture.
func (b *Backend) RecordEvent(ev gocore.Event, stream gocore.Stream) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	e, err := b.lookupEventLocked("record event", ev)
	if err != nil {
		return err
	}
	s := b.streamLocked(e.device, stream)
	s.submitted++
	if !b.manual {
		s.completed = s.submitted
	}
	e.recorded = true
	e.stream = stream
	e.seq = s.submitted
	return nil
}

// QueryEvent reports whether the work captured by ev has completed.
func (b *Backend) QueryEvent(ev gocore.Event) (done bool, err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	e, err := b.lookupEventLocked("query event", ev)
	if err != nil {
		return false, err
	}
	if !e.recorded {
		return true, nil
	}
	return b.streamLocked(e.device, e.stream).completed >= e.seq, nil
}

// SynchronizeEvent waits for the work captured by ev: the simulated device
// completes the work submitted to ev's stream up to ev (in manual mode that
// is how a wait ends; otherwise it had completed already).
func (b *Backend) SynchronizeEvent(ev gocore.Event) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	e, err := b.lookupEventLocked("synchronize event", ev)
	if err != nil {
		return err
	}
	if !e.recorded {
		return nil
	}
	if s := b.streamLocked(e.device, e.stream); s.completed < e.seq {
		s.completed = e.seq
		b.stats.EventWaits++
	}
	return nil
}

// DestroyEvent releases ev; destroying an unknown or already destroyed
// event is an error.
func (b *Backend) DestroyEvent(ev gocore.Event) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, err := b.lookupEventLocked("destroy event", ev); err != nil {
		return err
	}
	delete(b.events, ev)
	b.stats.EventsDestroyed++
	return nil
}

// CompleteStream marks all work submitted so far to stream s, on every
// device, as completed, so events recorded on it report done.
func (b *Backend) CompleteStream(s gocore.Stream) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for k, st := range b.streams {
		if k.stream == s {
			st.completed = st.submitted
		}
	}
}

// CompleteAll marks all work submitted so far to every stream as completed.
func (b *Backend) CompleteAll() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.completeAllLocked()
}

// completeAllLocked does CompleteAll's work; b.mu must be held.
func (b *Backend) completeAllLocked() {
	for _, st := range b.streams {
		st.completed = st.submitted
	}
}

// SetManualEvents switches between manual event completion (true) and
// immediate completion (false). Switching to false completes all pending
// work.
func (b *Backend) SetManualEvents(manual bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.manual = manual
	if !manual {
		b.completeAllLocked()
	}
}

// ManualEvents reports whether events currently complete only on
// CompleteStream or CompleteAll.
func (b *Backend) ManualEvents() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.manual
}
