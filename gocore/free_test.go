package gocore_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	. "github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/sim"
)

func TestRecordStreamWaitsForEvents(t *testing.T) {
	p, be := newTestPool(t, sim.Config{ManualEvents: true}, Config{})
	a := mustAlloc(t, p, 0, 4096, 1)
	require.NoError(t, p.RecordStream(a, 2))
	require.NoError(t, p.RecordStream(a, 3))
	require.NoError(t, p.RecordStream(a, 2)) // duplicate: no second event
	require.NoError(t, p.RecordStream(a, 1)) // own stream: ignored
	require.NoError(t, p.Free(a))
	s := stats(t, p)
	assert.Zero(t, s.AllocatedBytes[0].Current)
	assert.EqualValues(t, 4096, s.ActiveBytes[0].Current, "pending block stays active")
	assert.EqualValues(t, 2, s.NumRecordStream)
	assert.EqualValues(t, 2, be.Stats().EventsCreated)

	b := mustAlloc(t, p, 0, 4096, 1)
	assert.NotEqual(t, a, b, "reused before streams 2 and 3 finished")
	be.CompleteStream(2)
	waiting, err := p.ProcessEvents()
	require.NoError(t, err)
	assert.Equal(t, 1, waiting)
	be.CompleteStream(3)
	c := mustAlloc(t, p, 0, 4096, 1)
	assert.Equal(t, a, c)
	s = stats(t, p)
	assert.EqualValues(t, 8192, s.ActiveBytes[0].Current)

	// Events are pooled: the next deferred free reuses them.
	require.NoError(t, p.RecordStream(c, 2))
	require.NoError(t, p.Free(c))
	assert.EqualValues(t, 2, be.Stats().EventsCreated)
	be.CompleteAll()
	_, err = p.ProcessEvents()
	require.NoError(t, err)
	require.NoError(t, p.Free(b))
	_, err = p.Close()
	require.NoError(t, err)
	assert.Zero(t, be.Stats().LiveEvents)
}

// The threshold holds whichever free pushes the unused bytes over it, not
// only one that leaves its own segment wholly free.
func TestReleaseThresholdAfterAFreeThatLeavesItsSegmentSplit(t *testing.T) {
	p, be := newTestPool(t, sim.Config{}, Config{ReleaseThreshold: 16 * MiB})
	require.NoError(t, p.Free(mustAlloc(t, p, 0, 12*MiB, 0))) // 12 MiB unused <= 16: kept
	z1 := mustAlloc(t, p, 0, 9*MiB, 1)                        // a 20 MiB segment: 9 + 11 free
	mustAlloc(t, p, 0, 9*MiB, 1)                              // 9 + 9 + 2 free
	require.EqualValues(t, 14*MiB, unusedBytes(t, p))
	require.NoError(t, p.Free(z1)) // 23 MiB unused: the free 12 MiB segment goes back
	assert.EqualValues(t, 11*MiB, unusedBytes(t, p))
	assert.Equal(t, 1, be.Stats().LiveSegments)
	require.NoError(t, p.CheckInvariants())
}

func TestReleaseThresholdShrinksAnExpandableTail(t *testing.T) {
	p, be := newTestPool(t, sim.Config{Expandable: true, Capacity: 256 * MiB}, Config{ReleaseThreshold: 8 * MiB})
	mustAlloc(t, p, 0, 20*MiB, 0)       // one 20 MiB page, in use
	b := mustAlloc(t, p, 0, 100*MiB, 0) // grows the segment by five pages to 120 MiB
	require.NoError(t, p.Free(b))       // a 100 MiB free tail
	assert.LessOrEqual(t, unusedBytes(t, p), uint64(8*MiB))
	assert.LessOrEqual(t, be.UsedBytes(0), uint64(20*MiB))
	require.NoError(t, p.CheckInvariants())
}

func TestReleaseThresholdAppliesWhenACaptureEnds(t *testing.T) {
	p, be := newTestPool(t, sim.Config{}, Config{ReleaseThreshold: MiB})
	a := mustAlloc(t, p, 0, 12*MiB, 0)
	p.EnterCapture()
	require.NoError(t, p.Free(a))
	assert.Equal(t, 1, be.Stats().LiveSegments, "nothing goes back during a capture")
	require.NoError(t, p.ExitCapture())
	assert.Zero(t, unusedBytes(t, p))
	assert.Equal(t, 0, be.Stats().LiveSegments)
}

// A second free of a block is a double free, not an interior pointer, both
// while the block waits for its events and when it ends where an allocated
// neighbour begins.
func TestFreeingTwiceIsADoubleFreeAtBlockBoundaries(t *testing.T) {
	p, be := newTestPool(t, sim.Config{ManualEvents: true}, Config{})
	a := mustAlloc(t, p, 0, 4096, 0)
	b := mustAlloc(t, p, 0, 4096, 0)
	c := mustAlloc(t, p, 0, 4096, 0)
	require.Equal(t, a+4096, b, "b starts where a ends")
	require.Equal(t, b+4096, c, "c starts where b ends")

	require.NoError(t, p.Free(b)) // a and c, its neighbours, stay allocated
	err := p.Free(b)
	require.ErrorIs(t, err, ErrDoubleFree)
	assert.NotErrorIs(t, err, ErrInteriorPointer)

	require.NoError(t, p.RecordStream(c, 7))
	require.NoError(t, p.Free(c)) // parked until stream 7's event completes
	err = p.Free(c)
	require.ErrorIs(t, err, ErrDoubleFree, "c waits for its event")
	assert.NotErrorIs(t, err, ErrInteriorPointer)
	assert.ErrorIs(t, p.Free(c+512), ErrInteriorPointer, "inside the parked block")
	be.CompleteAll()
	require.NoError(t, p.Free(a))
	stats(t, p)
}

// The first address past a segment belongs to no segment of the pool: an
// unknown pointer, not a double free.
func TestFreeingTheAddressPastASegmentIsAnUnknownPointer(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{}, Config{})
	a := mustAlloc(t, p, 0, 4096, 0)
	info, err := p.Lookup(a)
	require.NoError(t, err)
	end := info.SegmentAddr + info.SegmentSize
	err = p.Free(end)
	require.ErrorIs(t, err, ErrUnknownPointer)
	assert.NotErrorIs(t, err, ErrDoubleFree)
	assert.ErrorIs(t, p.Free(end-512), ErrDoubleFree, "the segment's last free bytes")
}

// The end of a capture applies the release threshold it held back to free
// tails of expandable segments too, when no segment is wholly free.
func TestReleaseThresholdShrinksAnExpandableTailWhenACaptureEnds(t *testing.T) {
	p, be := newTestPool(t, sim.Config{Expandable: true, Capacity: 256 * MiB}, Config{ReleaseThreshold: 8 * MiB})
	mustAlloc(t, p, 0, 20*MiB, 0) // one page, in use
	p.EnterCapture()
	b := mustAlloc(t, p, 0, 100*MiB, 0) // grows the segment to 120 MiB
	require.NoError(t, p.Free(b))       // a 100 MiB free tail, kept during the capture
	assert.EqualValues(t, 100*MiB, unusedBytes(t, p))
	require.NoError(t, p.ExitCapture())
	assert.LessOrEqual(t, unusedBytes(t, p), uint64(8*MiB))
	assert.LessOrEqual(t, be.UsedBytes(0), uint64(20*MiB))
}

// The release threshold held back while another pool's capture ran
// (AddProcessCaptures: nothing may be released then) applies once it ends,
// at the pool's next event processing, though this pool parked no block
// during it (the mutation pass found it skipped: 20 MiB stayed reserved).
func TestReleaseThresholdHeldByAProcessCaptureAppliesWhenItEnds(t *testing.T) {
	p, be := newTestPool(t, sim.Config{Capacity: 256 * MiB}, Config{ReleaseThreshold: MiB})
	b := mustAlloc(t, p, 0, 4*MiB, 0) // a 20 MiB segment
	AddProcessCaptures(1)
	require.NoError(t, p.Free(b))
	assert.EqualValues(t, 20*MiB, be.UsedBytes(0), "held during the capture")
	AddProcessCaptures(-1)
	_, err := p.ProcessEvents()
	require.NoError(t, err)
	assert.Zero(t, be.UsedBytes(0), "the threshold applies once the capture is over")
	require.NoError(t, p.CheckInvariants())
}

// The same, found by the next free: its own segment has nothing to give
// back, but the expandable tail freed during the capture goes.
func TestReleaseThresholdHeldByAProcessCaptureAppliesAtTheNextFree(t *testing.T) {
	p, be := newTestPool(t, sim.Config{Expandable: true, Capacity: 256 * MiB}, Config{ReleaseThreshold: 8 * MiB})
	mustAlloc(t, p, 0, 20*MiB, 0) // one page, in use
	AddProcessCaptures(1)
	big := mustAlloc(t, p, 0, 100*MiB, 0)
	require.NoError(t, p.Free(big)) // a 100 MiB free tail, held
	AddProcessCaptures(-1)
	small := mustAlloc(t, p, 0, 4096, 0)
	mustAlloc(t, p, 0, 4096, 0)
	require.NoError(t, p.Free(small))
	assert.LessOrEqual(t, unusedBytes(t, p), uint64(8*MiB))
	assert.Less(t, be.UsedBytes(0), uint64(100*MiB))
	require.NoError(t, p.CheckInvariants())
}
