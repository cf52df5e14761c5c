package gocore

import (
	"errors"
	"fmt"
	"sync/atomic"
)

// processCaptures counts the stream captures under way anywhere in the
// process (AddProcessCaptures). CUDA's global capture mode, torch's default
// for CUDA graphs, forbids every thread to free memory or query events while
// any thread captures, and a call that breaks the rule invalidates the
// capture: so every pool holds its segments and queries no event meanwhile,
// not only the pools the capture allocates from (EnterCapture).
var processCaptures atomic.Int64

// AddProcessCaptures counts n more (or, negative, fewer) stream captures
// under way in the process; see processCaptures. bindings/cabi calls it as
// torch begins and ends allocating to a graph's pool.
func AddProcessCaptures(n int64) { processCaptures.Add(n) }

// ProcessCaptures reports the captures under way in the process.
func ProcessCaptures() int64 { return processCaptures.Load() }

// pendingFree is one event a freed block waits for.
type pendingFree struct {
	event Event
	block *block
}

// eventQueue holds the pending frees whose events were recorded on one
// stream, oldest first. A stream's work completes in order, so its events
// do too: processing a queue stops at the first event not yet done, as
// torch's allocator does, and an allocation costs one query per stream with
// frees waiting, not one per waiting free.
type eventQueue struct {
	stream Stream
	items  []pendingFree
}

// enqueuePending adds pf, whose event was recorded on stream s.
func (d *deviceState) enqueuePending(s Stream, pf pendingFree) {
	for i := range d.pending {
		if d.pending[i].stream == s {
			d.pending[i].items = append(d.pending[i].items, pf)
			return
		}
	}
	d.pending = append(d.pending, eventQueue{stream: s, items: []pendingFree{pf}})
}

// allPending calls fn for every pending free, queue by queue.
func (d *deviceState) allPending(fn func(pendingFree)) {
	for _, q := range d.pending {
		for _, pf := range q.items {
			fn(pf)
		}
	}
}

// deferFreeLocked records an event on every stream the block was used on and
// parks the block until they all complete. Events are pooled per device, as
// creating them costs a driver call.
func (p *Pool) deferFreeLocked(d *deviceState, b *block) error {
	for i, s := range b.streamUses {
		ev, err := p.eventLocked(d)
		if err == nil {
			err = p.backend.RecordEvent(ev, s)
			if err != nil {
				d.events = append(d.events, ev)
			}
		}
		if err != nil {
			// Without an event we cannot know when the other streams are
			// done with the block; keep it out of the free lists for good
			// rather than risk handing it out early. The earlier events
			// still resolve normally and only release it if all succeed.
			b.pending += len(b.streamUses) - i + 1 // never reaches 0
			b.streamUses = b.streamUses[:0]
			return fmt.Errorf("free %#x in pool %q: record event on stream %#x: %w", b.addr, p.name, uint64(s), err)
		}
		d.enqueuePending(s, pendingFree{event: ev, block: b})
		b.pending++
	}
	b.streamUses = b.streamUses[:0]
	return nil
}

func (p *Pool) eventLocked(d *deviceState) (Event, error) {
	if n := len(d.events); n > 0 {
		ev := d.events[n-1]
		d.events = d.events[:n-1]
		return ev, nil
	}
	return p.backend.NewEvent(d.id)
}

// capturingLocked reports whether a capture is under way, the pool's own
// or any in the process: no event may be recorded or queried, no memory
// freed.
func (p *Pool) capturingLocked() bool { return p.captures > 0 || processCaptures.Load() > 0 }

// processEventsLocked frees the parked blocks whose events have completed.
// Nothing is recorded or queried during a capture; after one ended
// elsewhere in the process, the blocks freed meanwhile get their events and
// the release threshold is applied (the pool's own captures do that in
// ExitCapture). An event whose query fails is treated as not completed;
// the stream's later events are still queried, as the failure may be the
// event's own.
func (p *Pool) processEventsLocked(d *deviceState) {
	if p.capturingLocked() {
		return
	}
	if len(d.unrecorded) > 0 {
		_ = p.recordDeferredLocked(d) // a block whose event fails stays out of use (as in Free)
	} else if d.releaseHeld {
		p.applyReleaseThresholdLocked(d, nil)
	}
	kept := d.pending[:0]
	for _, q := range d.pending {
		items := q.items[:0]
		for i, pf := range q.items {
			done, err := p.backend.QueryEvent(pf.event)
			if err == nil && !done {
				items = append(items, q.items[i:]...) // later events of the stream cannot be done either
				break
			}
			if err != nil {
				items = append(items, pf)
				continue
			}
			d.events = append(d.events, pf.event)
			pf.block.pending--
			if pf.block.pending == 0 {
				p.freeBlockLocked(d, pf.block)
			}
		}
		clear(q.items[len(items):])
		if q.items = items; len(q.items) > 0 {
			kept = append(kept, q)
		}
	}
	clear(d.pending[len(kept):])
	d.pending = kept
}

// synchronizeEventsLocked is torch's synchronize_and_free_events, which its
// empty_cache and out-of-memory retry run before they release cached
// segments: it waits for the events of every free pending on other streams
// (an EventSynchronizer backend; for CUDA, cuEventSynchronize) and frees
// those blocks, so that their segments can go back too. Outside a capture
// only (waiting is forbidden then). Blocks freed during a capture that ended
// get their events first. A backend that cannot wait, or a wait that
// fails, leaves the frees whose events are not done pending.
func (p *Pool) synchronizeEventsLocked(d *deviceState) {
	if p.capturingLocked() {
		return
	}
	d.stats.NumSyncAllStreams++
	p.processEventsLocked(d) // records the events of frees made during a capture
	if waiter, ok := p.backend.(EventSynchronizer); ok && len(d.pending) > 0 {
		d.allPending(func(pf pendingFree) {
			_ = waiter.SynchronizeEvent(pf.event) // a failed wait leaves the free pending
		})
		p.processEventsLocked(d)
	}
}

// ProcessEvents frees every parked block whose events have completed, on all
// devices, and returns how many frees are still waiting: blocks parked on
// events (one however many streams used them) and blocks freed during a
// capture, whose events are recorded when it ends.
func (p *Pool) ProcessEvents() (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return 0, fmt.Errorf("process events of pool %q: %w", p.name, ErrClosed)
	}
	waiting := 0
	for _, d := range p.devices {
		if d == nil {
			continue
		}
		p.processEventsLocked(d)
		waiting += len(d.unrecorded)
		if len(d.pending) > 0 {
			blocks := make(map[*block]struct{})
			d.allPending(func(pf pendingFree) { blocks[pf.block] = struct{}{} })
			waiting += len(blocks)
		}
	}
	return waiting, nil
}

// EnterCapture tells the pool that a stream capture (a CUDA graph being
// recorded) is under way in the process, until the matching ExitCapture
// (calls nest). Until then the pool makes none of the driver calls a capture
// forbids or would swallow: it records and queries no event (a recorded
// event would become part of the graph, a query is an error that
// invalidates the capture) and gives no segment back (freeing memory
// synchronizes the device). Torch's allocator holds back the same way. A
// block freed meanwhile after use on other streams waits, unusable, for its
// events; blocks parked earlier stay parked; allocations that need new
// segments still get them.
func (p *Pool) EnterCapture() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.captures++
}

// ExitCapture ends one EnterCapture; the last one records the events of the
// blocks freed in between (see Free). It fails when no capture was entered,
// and reports blocks whose events could not be recorded (they stay out of
// use, as in Free).
func (p *Pool) ExitCapture() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.captures == 0 {
		return fmt.Errorf("exit capture of pool %q: no capture entered: %w", p.name, ErrInvalidArgument)
	}
	p.captures--
	if p.captures > 0 || p.closed {
		return nil
	}
	if processCaptures.Load() > 0 {
		return nil // another capture is under way: processEventsLocked records them after it
	}
	var errs []error
	for _, d := range p.devices {
		if d == nil {
			continue
		}
		errs = append(errs, p.recordDeferredLocked(d))
	}
	return errors.Join(errs...)
}

// recordDeferredLocked records the events of the blocks freed on d during a
// capture, now over (see Free), and applies the release threshold the
// capture held back.
func (p *Pool) recordDeferredLocked(d *deviceState) error {
	var errs []error
	for _, b := range d.unrecorded {
		b.pending = 0
		errs = append(errs, p.deferFreeLocked(d, b))
	}
	clear(d.unrecorded)
	d.unrecorded = d.unrecorded[:0]
	p.applyReleaseThresholdLocked(d, nil)
	return errors.Join(errs...)
}
