package gocore_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	. "github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/sim"
)

func TestSnapshotDescribesSegmentsAndBlocks(t *testing.T) {
	p, be := newTestPool(t, sim.Config{ManualEvents: true}, Config{})
	a := mustAlloc(t, p, 0, 1000, 3)
	b := mustAlloc(t, p, 0, 5000, 3)
	c := mustAlloc(t, p, 0, 12*MiB, 3)
	require.NoError(t, p.RecordStream(b, 4))
	require.NoError(t, p.Free(b))
	snap := p.Snapshot()
	require.Len(t, snap, 2)
	small, large := snap[0], snap[1]
	if small.SegmentType != "small" {
		small, large = large, small
	}
	assert.Equal(t, "small", small.SegmentType)
	assert.EqualValues(t, 2*MiB, small.TotalSize)
	assert.EqualValues(t, 3, small.Stream)
	require.Len(t, small.Blocks, 3)
	assert.Equal(t, SnapshotBlock{Address: a, Size: 1024, RequestedSize: 1000, State: StateAllocated}, small.Blocks[0])
	assert.Equal(t, StatePendingFree, small.Blocks[1].State)
	assert.Equal(t, StateInactive, small.Blocks[2].State)
	assert.EqualValues(t, 1024, small.AllocatedSize)
	assert.EqualValues(t, 1024+5120, small.ActiveSize)
	assert.EqualValues(t, 1000+5000, small.RequestedSize, "a pending block still counts, as in torch")
	assert.EqualValues(t, 5000, small.Blocks[1].RequestedSize)
	assert.Equal(t, c, large.Address)
	assert.EqualValues(t, 12*MiB, large.AllocatedSize)

	be.CompleteAll()
	_, err := p.ProcessEvents()
	require.NoError(t, err)
	require.NoError(t, p.Free(a))
	f := FragmentationOf(p.Snapshot())
	assert.EqualValues(t, 14*MiB, f.Reserved)
	assert.EqualValues(t, 12*MiB, f.Allocated)
	assert.EqualValues(t, 2*MiB, f.FreeBytes)
	assert.Equal(t, 1, f.FreeBlocks) // the freed blocks merged back
	assert.Zero(t, f.External)
}

func TestHistoryRecordsEventsInOrder(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{Capacity: 8 * MiB}, Config{})
	assert.Nil(t, p.History())
	p.RecordHistory(true, 100)
	a := mustAlloc(t, p, 0, 100, 0)
	require.NoError(t, p.RecordStream(a, 5))
	require.NoError(t, p.Free(a))
	_, err := p.Alloc(0, 100*MiB, 0)
	require.ErrorIs(t, err, ErrOutOfMemory)
	_, err = p.EmptyCache()
	require.NoError(t, err)
	var actions []string
	for _, e := range p.History() {
		actions = append(actions, e.Action)
	}
	// The OOM path released the cached segment before retrying, so the
	// device was all free when the OOM was recorded; the EmptyCache call
	// (which found nothing to release) is recorded too.
	assert.Equal(t, []string{ActionSegmentAlloc, ActionAlloc, ActionRecordStream, ActionFreeRequested,
		ActionFreeCompleted, ActionSegmentFree, ActionOOM, ActionEmptyCache}, actions)
	oom := p.History()[6]
	assert.EqualValues(t, 8*MiB, oom.DeviceFree)
	assert.EqualValues(t, 100*MiB, oom.Size)

	// Turning recording on again keeps what was recorded, the newest first
	// to go when the new bound is smaller.
	p.RecordHistory(true, 100)
	require.Len(t, p.History(), 8)
	p.RecordHistory(true, 2)
	kept := p.History()
	require.Len(t, kept, 2)
	assert.Equal(t, ActionOOM, kept[0].Action)
	assert.Equal(t, ActionEmptyCache, kept[1].Action)

	// A ring: only the newest entries are kept, oldest first.
	p.RecordHistory(true, 3)
	for range 5 {
		require.NoError(t, p.Free(mustAlloc(t, p, 0, 100, 0)))
	}
	h := p.History()
	require.Len(t, h, 3)
	assert.LessOrEqual(t, h[0].TimeUS, h[2].TimeUS)
	assert.Equal(t, ActionFreeCompleted, h[2].Action)
	p.RecordHistory(false, 0)
	assert.Nil(t, p.History())
}

// EmptyCache and Trim are recorded once each call has released what it
// could (after its segment_free entries), with the device trimmed (or
// AllDevices) and a trim's keep bytes; a refused call (a device out of
// range, a closed pool) is not recorded.
func TestHistoryRecordsEmptyCacheAndTrimAfterTheirReleases(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{Capacity: 64 * MiB}, Config{})
	p.RecordHistory(true, 100)
	require.NoError(t, p.Free(mustAlloc(t, p, 0, 4*MiB, 0)))
	released, err := p.Trim(0, MiB)
	require.NoError(t, err)
	require.NotZero(t, released)
	require.NoError(t, p.Free(mustAlloc(t, p, 0, 4*MiB, 0)))
	_, err = p.Trim(-1, 3*MiB)
	require.NoError(t, err)
	_, err = p.EmptyCache()
	require.NoError(t, err)
	_, err = p.Trim(7, 0)
	require.ErrorIs(t, err, ErrInvalidDevice)
	var got []TraceEntry
	for _, e := range p.History() {
		if e.Action != ActionAlloc && e.Action != ActionFreeRequested && e.Action != ActionFreeCompleted {
			got = append(got, e)
		}
	}
	var actions []string
	for _, e := range got {
		actions = append(actions, e.Action)
	}
	require.Equal(t, []string{ActionSegmentAlloc, ActionSegmentFree, ActionTrim, ActionSegmentAlloc, ActionSegmentFree,
		ActionTrim, ActionEmptyCache}, actions)
	assert.Equal(t, TraceEntry{Action: ActionTrim, Device: 0, Size: MiB, TimeUS: got[2].TimeUS}, got[2])
	assert.Equal(t, TraceEntry{Action: ActionTrim, Device: AllDevices, Size: 3 * MiB, TimeUS: got[5].TimeUS}, got[5])
	assert.Equal(t, TraceEntry{Action: ActionEmptyCache, Device: AllDevices, TimeUS: got[6].TimeUS}, got[6])
	assert.LessOrEqual(t, got[1].TimeUS, got[2].TimeUS)

	_, err = p.Close()
	require.NoError(t, err)
	n := len(p.History())
	_, err = p.EmptyCache()
	require.ErrorIs(t, err, ErrClosed)
	assert.Len(t, p.History(), n, "a refused call is not recorded")
}

func TestHistoryMarksCallerSizedAllocs(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{Capacity: 64 * MiB}, Config{})
	p.RecordHistory(true, 100)
	a := mustAlloc(t, p, 0, 2*MiB, 0)
	b, err := p.AllocSegment(0, 2*MiB, 0)
	require.NoError(t, err)
	var allocs []TraceEntry
	for _, e := range p.History() {
		if e.Action == ActionAlloc {
			allocs = append(allocs, e)
		}
	}
	require.Len(t, allocs, 2)
	assert.Equal(t, a, allocs[0].Addr)
	assert.False(t, allocs[0].CallerSized)
	assert.Equal(t, b, allocs[1].Addr)
	assert.True(t, allocs[1].CallerSized)
}

// An expandable segment is traced as torch traces one: mappings only, no
// segment_alloc or segment_free, and what EmptyCache releases is unmapped
// range by range. Each entry names the thread of the call that made it.
func TestExpandableSegmentsAreTracedByTheirMappings(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{Expandable: true, Capacity: 256 * MiB}, Config{})
	p.RecordHistory(true, 100)
	p.RecordThreads(true)
	a := mustAlloc(t, p, 0, 40*MiB, 0)
	b := mustAlloc(t, p, 0, 6*MiB, 0) // grows the segment by a 20 MiB page
	require.NoError(t, p.Free(a))
	require.NoError(t, p.Free(b))
	released, err := p.EmptyCache()
	require.NoError(t, err)
	require.EqualValues(t, 60*MiB, released)
	var actions []string
	var mapped, unmapped uint64
	for _, e := range p.History() {
		actions = append(actions, e.Action)
		switch e.Action {
		case ActionSegmentMap:
			mapped += e.Size
		case ActionSegmentUnmap:
			unmapped += e.Size
		}
		assert.Equal(t, CallerThread(), e.Thread, "entry %s", e.Action)
	}
	assert.NotContains(t, actions, ActionSegmentAlloc)
	assert.NotContains(t, actions, ActionSegmentFree)
	assert.Equal(t, ActionSegmentMap, actions[0])
	assert.EqualValues(t, 60*MiB, mapped)
	assert.Equal(t, mapped, unmapped, "every mapped byte is unmapped once")
	assert.Empty(t, p.Snapshot())
}

// A segment of a plain backend keeps its segment_alloc and segment_free.
func TestPlainSegmentsAreTracedAsAllocAndFree(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{Capacity: 64 * MiB}, Config{})
	p.RecordHistory(true, 100)
	require.NoError(t, p.Free(mustAlloc(t, p, 0, 30*MiB, 0)))
	_, err := p.EmptyCache()
	require.NoError(t, err)
	var actions []string
	for _, e := range p.History() {
		actions = append(actions, e.Action)
	}
	assert.Equal(t, []string{ActionSegmentAlloc, ActionAlloc, ActionFreeRequested, ActionFreeCompleted,
		ActionSegmentFree, ActionEmptyCache}, actions)
	for _, e := range p.History() {
		assert.Zero(t, e.Thread, "threads are recorded only when asked for")
	}
}
