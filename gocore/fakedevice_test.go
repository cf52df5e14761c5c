package gocore

import (
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// MiB is a mebibyte. It is declared in the in-package tests, so that the
// external tests (package gocore_test, which dot-import gocore) share it.
const MiB = 1 << 20

// fakeDevice is the device of the in-package tests, the few that inspect or
// corrupt the pool's internals. The simulated device (gocore/sim) imports
// gocore, so a test in package gocore cannot use it (an import cycle); the
// tests that need only the pool's public face run on it from package
// gocore_test. These need no more than a capacity, aligned addresses that do
// not overlap, and events that complete at once or, with ManualEvents, when
// the test completes their stream.
type fakeDevice struct {
	cfg       fakeConfig
	mu        sync.Mutex
	next      uint64            // next address handed out
	used      uint64            // bytes in live segments
	live      map[uint64]uint64 // segment start -> size
	events    map[Event]*fakeEvent
	lastEvent Event
}

// fakeConfig configures a fakeDevice; its field names follow sim.Config's.
type fakeConfig struct {
	Capacity     uint64 // bytes the device can hand out; 80 GiB when 0
	ManualEvents bool   // events complete only on CompleteStream or CompleteAll
}

// fakeEvent is what an Event of a fakeDevice captured.
type fakeEvent struct {
	recorded, done bool
	stream         Stream
}

const fakeAlignment = 512

func (d *fakeDevice) Name() string      { return "fake" }
func (d *fakeDevice) Devices() int      { return 1 }
func (d *fakeDevice) Alignment() uint64 { return fakeAlignment }

func (d *fakeDevice) Capacity(device int) (total, free uint64, err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.cfg.Capacity, d.cfg.Capacity - d.used, nil
}

func (d *fakeDevice) Alloc(device int, size uint64, stream Stream) (uint64, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if size > d.cfg.Capacity-d.used {
		return 0, fmt.Errorf("fake: alloc of %d bytes: %d of %d in use: %w", size, d.used, d.cfg.Capacity, ErrBackendOutOfMemory)
	}
	addr := d.next
	d.next += (size + fakeAlignment - 1) / fakeAlignment * fakeAlignment
	d.live[addr] = size
	d.used += size
	return addr, nil
}

func (d *fakeDevice) Free(device int, addr, size uint64, stream Stream) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.live[addr] != size {
		return fmt.Errorf("fake: free of %#x (%d bytes): not a live segment of that size", addr, size)
	}
	delete(d.live, addr)
	d.used -= size
	return nil
}

func (d *fakeDevice) NewEvent(device int) (Event, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.lastEvent++
	d.events[d.lastEvent] = &fakeEvent{}
	return d.lastEvent, nil
}

func (d *fakeDevice) RecordEvent(ev Event, stream Stream) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	e, ok := d.events[ev]
	if !ok {
		return fmt.Errorf("fake: record of unknown event %d", ev)
	}
	*e = fakeEvent{recorded: true, done: !d.cfg.ManualEvents, stream: stream}
	return nil
}

func (d *fakeDevice) QueryEvent(ev Event) (bool, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	e, ok := d.events[ev]
	if !ok {
		return false, fmt.Errorf("fake: query of unknown event %d", ev)
	}
	return !e.recorded || e.done, nil
}

func (d *fakeDevice) DestroyEvent(ev Event) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.events[ev]; !ok {
		return fmt.Errorf("fake: destroy of unknown event %d", ev)
	}
	delete(d.events, ev)
	return nil
}

// CompleteStream completes the work recorded so far on stream s.
func (d *fakeDevice) CompleteStream(s Stream) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, e := range d.events {
		if e.stream == s {
			e.done = true
		}
	}
}

// CompleteAll completes the work recorded so far on every stream.
func (d *fakeDevice) CompleteAll() {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, e := range d.events {
		e.done = true
	}
}

// newTestPool returns a pool with cfg over a fresh fakeDevice configured as
// dev, and that device.
func newTestPool(t testing.TB, dev fakeConfig, cfg Config) (*Pool, *fakeDevice) {
	t.Helper()
	if dev.Capacity == 0 {
		dev.Capacity = 80 << 30
	}
	be := &fakeDevice{cfg: dev, next: 0x7f0000000000, live: map[uint64]uint64{}, events: map[Event]*fakeEvent{}}
	cfg.Backend = be
	p, err := NewPool(cfg)
	require.NoError(t, err)
	return p, be
}

func mustAlloc(t testing.TB, p *Pool, dev int, size uint64, s Stream) uint64 {
	t.Helper()
	addr, err := p.Alloc(dev, size, s)
	require.NoError(t, err)
	return addr
}

func stats(t testing.TB, p *Pool) Stats {
	t.Helper()
	s, err := p.Stats(-1)
	require.NoError(t, err)
	require.NoError(t, p.CheckInvariants())
	return s
}
