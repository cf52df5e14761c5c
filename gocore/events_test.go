package gocore_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	. "github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/sim"
)

func TestProcessEventsCountsWaitingFrees(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{ManualEvents: true}, Config{})
	a := mustAlloc(t, p, 0, 4096, 0)
	require.NoError(t, p.RecordStream(a, 1))
	require.NoError(t, p.RecordStream(a, 2))
	require.NoError(t, p.Free(a)) // one free, two events
	n, err := p.ProcessEvents()
	require.NoError(t, err)
	assert.Equal(t, 1, n)

	b := mustAlloc(t, p, 0, 4096, 0)
	require.NoError(t, p.RecordStream(b, 1))
	p.EnterCapture()
	require.NoError(t, p.Free(b)) // parked until the capture ends
	n, err = p.ProcessEvents()
	require.NoError(t, err)
	assert.Equal(t, 2, n)
	require.NoError(t, p.ExitCapture())
	n, err = p.ProcessEvents()
	require.NoError(t, err)
	assert.Equal(t, 2, n)
}

// queryCounter is a sim backend that counts its event queries.
type queryCounter struct {
	*sim.Backend
	queries int
}

func (b *queryCounter) QueryEvent(ev Event) (bool, error) {
	b.queries++
	return b.Backend.QueryEvent(ev)
}

// Frees waiting on a busy stream cost an allocation one query for the
// stream, not one per waiting free; they come back in order once it is done.
func TestPendingFreesAreQueriedPerStream(t *testing.T) {
	device, err := sim.New(sim.Config{ManualEvents: true, Capacity: 1 << 30})
	require.NoError(t, err)
	be := &queryCounter{Backend: device}
	p, err := NewPool(Config{Backend: be})
	require.NoError(t, err)
	for i := range 1000 {
		a := mustAlloc(t, p, 0, 4096, 0)
		require.NoError(t, p.RecordStream(a, Stream(1+i%2))) // two busy streams
		require.NoError(t, p.Free(a))
	}
	be.queries = 0
	mustAlloc(t, p, 0, 4096, 0)
	assert.Equal(t, 2, be.queries, "the oldest event of each stream")
	device.CompleteStream(1)
	n, err := p.ProcessEvents()
	require.NoError(t, err)
	assert.Equal(t, 500, n, "stream 1's frees are done, stream 2's wait")
	device.CompleteStream(2)
	n, err = p.ProcessEvents()
	require.NoError(t, err)
	assert.Zero(t, n)
	require.NoError(t, p.CheckInvariants())
}

// failingQuery is a sim backend whose query of one event fails.
type failingQuery struct {
	*sim.Backend
	bad Event
}

func (b *failingQuery) QueryEvent(ev Event) (bool, error) {
	if ev == b.bad {
		return false, errors.New("query failed")
	}
	return b.Backend.QueryEvent(ev)
}

// An event whose query fails keeps its own block out of use, not the
// stream's later ones.
func TestAFailingEventQueryHoldsOnlyItsBlock(t *testing.T) {
	device, err := sim.New(sim.Config{})
	require.NoError(t, err)
	be := &failingQuery{Backend: device, bad: 1} // the first event made
	p, err := NewPool(Config{Backend: be})
	require.NoError(t, err)
	var addrs []uint64
	for range 10 {
		a := mustAlloc(t, p, 0, 4096, 0)
		require.NoError(t, p.RecordStream(a, 7))
		addrs = append(addrs, a)
	}
	for _, a := range addrs {
		require.NoError(t, p.Free(a))
	}
	n, err := p.ProcessEvents()
	require.NoError(t, err)
	assert.Equal(t, 1, n)
	require.NoError(t, p.CheckInvariants())
}

// Blocks freed while another pool's capture runs get no event until it
// ends (one on the legacy stream would break a blocking stream's capture),
// then get them at the next processing of events.
func TestFreesDuringAnotherPoolsCaptureRecordTheirEventsAfterIt(t *testing.T) {
	p, be := newTestPool(t, sim.Config{ManualEvents: true}, Config{})
	a := mustAlloc(t, p, 0, 4096, 0)
	require.NoError(t, p.RecordStream(a, 7))
	AddProcessCaptures(1)
	require.NoError(t, p.Free(a))
	assert.Zero(t, be.Stats().EventsCreated)
	n, err := p.ProcessEvents()
	require.NoError(t, err)
	assert.Equal(t, 1, n, "waiting, without an event")
	AddProcessCaptures(-1)
	n, err = p.ProcessEvents()
	require.NoError(t, err)
	assert.Equal(t, 1, n, "now waiting on its event")
	assert.EqualValues(t, 1, be.Stats().EventsCreated)
	be.CompleteAll()
	n, err = p.ProcessEvents()
	require.NoError(t, err)
	assert.Zero(t, n)
	assert.Equal(t, a, mustAlloc(t, p, 0, 4096, 0))
}

// During a stream capture (a CUDA graph being recorded) the pool records
// and queries no event and releases no segment: a block freed after use on
// another stream waits, unusable, and gets its events at the last
// ExitCapture; cached segments stay until then.
func TestCaptureDefersEventsAndReleases(t *testing.T) {
	p, be := newTestPool(t, sim.Config{ManualEvents: true}, Config{})
	parked := mustAlloc(t, p, 0, 4096, 1)
	require.NoError(t, p.RecordStream(parked, 2))
	require.NoError(t, p.Free(parked)) // an event recorded before the pause
	assert.EqualValues(t, 1, be.Stats().EventsCreated)

	p.EnterCapture()
	p.EnterCapture() // nested: two captures
	a := mustAlloc(t, p, 0, 4096, 1)
	require.NoError(t, p.RecordStream(a, 3))
	require.NoError(t, p.Free(a))
	assert.EqualValues(t, 1, be.Stats().EventsCreated, "no event while paused")
	s := stats(t, p)
	assert.EqualValues(t, 2*4096, s.ActiveBytes[0].Current, "both freed blocks wait")
	require.NoError(t, p.CheckInvariants())
	be.CompleteAll()
	assert.NotContains(t, []uint64{parked, a}, mustAlloc(t, p, 0, 4096, 1), "nothing queried, nothing reused")
	waiting, err := p.ProcessEvents()
	require.NoError(t, err)
	assert.Equal(t, 2, waiting, "the parked event is not even queried, and a waits for the capture's end")

	cached := mustAlloc(t, p, 0, 8*MiB, 1)
	require.NoError(t, p.Free(cached))
	released, err := p.EmptyCache()
	require.NoError(t, err)
	assert.Zero(t, released, "no segment is freed during a capture")
	assert.NotZero(t, stats(t, p).ReservedBytes[KindLarge].Current)

	require.NoError(t, p.ExitCapture())
	assert.EqualValues(t, 1, be.Stats().EventsCreated, "still paused once")
	require.NoError(t, p.ExitCapture())
	assert.EqualValues(t, 2, be.Stats().EventsCreated, "a's event recorded at the last resume")
	require.ErrorIs(t, p.ExitCapture(), ErrInvalidArgument, "no capture entered")
	released, err = p.EmptyCache()
	require.NoError(t, err)
	assert.EqualValues(t, 20*MiB, released, "after the capture the cached segment goes")
	waiting, err = p.ProcessEvents()
	require.NoError(t, err)
	// a's event was recorded after the streams completed, but EmptyCache
	// waited for it, as torch's empty_cache synchronizes pending frees.
	assert.Zero(t, waiting, "EmptyCache waited for a's event")
	be.CompleteAll()
	waiting, err = p.ProcessEvents()
	require.NoError(t, err)
	assert.Zero(t, waiting)
	require.NoError(t, p.CheckInvariants())
	s = stats(t, p)
	assert.EqualValues(t, 4096, s.ActiveBytes[0].Current, "only the block allocated while paused")
	_, err = p.Close()
	require.NoError(t, err)
	assert.Zero(t, be.Stats().LiveEvents)
}

// torch keeps requested_bytes, and a segment's requested_size in snapshots,
// for a freed block until it becomes inactive (free_block), like
// active_bytes.
func TestRequestedBytesOfPendingFree(t *testing.T) {
	p, be := newTestPool(t, sim.Config{ManualEvents: true}, Config{})
	a := mustAlloc(t, p, 0, 1000, 1)
	require.NoError(t, p.RecordStream(a, 2))
	require.NoError(t, p.Free(a))
	s := stats(t, p) // CheckInvariants recounts requested_bytes over active blocks
	assert.Zero(t, s.AllocatedBytes[0].Current)
	assert.EqualValues(t, 1024, s.ActiveBytes[0].Current)
	assert.EqualValues(t, 1000, s.RequestedBytes[0].Current)
	assert.EqualValues(t, 1000, s.RequestedBytes[KindSmall].Current)
	seg := p.Snapshot()[0]
	assert.Equal(t, StatePendingFree, seg.Blocks[0].State)
	assert.EqualValues(t, 1000, seg.Blocks[0].RequestedSize)
	assert.EqualValues(t, 1000, seg.RequestedSize)

	be.CompleteAll()
	waiting, err := p.ProcessEvents()
	require.NoError(t, err)
	assert.Zero(t, waiting)
	s = stats(t, p)
	assert.Zero(t, s.ActiveBytes[0].Current)
	assert.Zero(t, s.RequestedBytes[0].Current)
	assert.EqualValues(t, 1000, s.RequestedBytes[0].Freed)
	assert.Zero(t, p.Snapshot()[0].RequestedSize)
}

// failingRecord is a sim backend whose RecordEvent fails on one stream.
type failingRecord struct {
	*sim.Backend
	bad Stream
}

func (b *failingRecord) RecordEvent(ev Event, s Stream) error {
	if s == b.bad {
		return errors.New("record failed")
	}
	return b.Backend.RecordEvent(ev, s)
}

// A block used on several streams whose event cannot be recorded on one of
// them stays out of use for good, even once the events recorded on the
// other streams complete: nothing says when the failed stream is done with
// it.
func TestAFailedEventRecordKeepsTheBlockOutOfUse(t *testing.T) {
	for _, bad := range []Stream{7, 8} { // the first stream used, the last
		device, err := sim.New(sim.Config{ManualEvents: true})
		require.NoError(t, err)
		p, err := NewPool(Config{Backend: &failingRecord{Backend: device, bad: bad}})
		require.NoError(t, err)
		a := mustAlloc(t, p, 0, 4096, 0)
		require.NoError(t, p.RecordStream(a, 7))
		require.NoError(t, p.RecordStream(a, 8))
		err = p.Free(a)
		require.Error(t, err, "stream %d", bad)
		assert.Contains(t, err.Error(), "record event on stream")
		device.CompleteAll()
		_, err = p.ProcessEvents()
		require.NoError(t, err)
		assert.NotEqual(t, a, mustAlloc(t, p, 0, 4096, 0), "failing stream %d: the block was handed out again", bad)
		s := stats(t, p)
		assert.EqualValues(t, 2, s.Active[0].Current, "failing stream %d", bad)
	}
}

// A block freed during another pool's capture gets its event when an
// allocation after the capture processes events, and serves it once done.
func TestAllocAfterAnotherPoolsCaptureReusesTheBlocksFreedDuringIt(t *testing.T) {
	p, be := newTestPool(t, sim.Config{}, Config{})
	a := mustAlloc(t, p, 0, 4096, 0)
	require.NoError(t, p.RecordStream(a, 7))
	AddProcessCaptures(1)
	require.NoError(t, p.Free(a))
	AddProcessCaptures(-1)
	assert.Equal(t, a, mustAlloc(t, p, 0, 4096, 0))
	assert.EqualValues(t, 1, be.Stats().EventsCreated)
}
