package sim

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/gocore"
)

func TestSimAutoEvents(t *testing.T) {
	b := newSim(t, Config{Devices: 2})
	assert.False(t, b.ManualEvents())
	ev, err := b.NewEvent(1)
	require.NoError(t, err)
	done, err := b.QueryEvent(ev)
	require.NoError(t, err)
	assert.True(t, done, "an unrecorded event is done")
	for _, s := range []gocore.Stream{0, 7, 7, 1 << 40} {
		require.NoError(t, b.RecordEvent(ev, s))
		done, err = b.QueryEvent(ev)
		require.NoError(t, err)
		assert.True(t, done, "auto events complete at once (stream %d)", s)
	}
}

func TestSimManualEvents(t *testing.T) {
	b := newSim(t, Config{Devices: 2, ManualEvents: true})
	assert.True(t, b.ManualEvents())
	query := func(ev gocore.Event) bool {
		t.Helper()
		done, err := b.QueryEvent(ev)
		require.NoError(t, err)
		return done
	}
	newEv := func(d int) gocore.Event {
		t.Helper()
		ev, err := b.NewEvent(d)
		require.NoError(t, err)
		return ev
	}
	e1, e2, e3, e4 := newEv(0), newEv(0), newEv(0), newEv(1)
	assert.True(t, query(e1), "an unrecorded event is done")
	require.NoError(t, b.RecordEvent(e1, 1))
	require.NoError(t, b.RecordEvent(e2, 2))
	require.NoError(t, b.RecordEvent(e4, 1)) // stream 1 on device 1
	assert.False(t, query(e1))
	assert.False(t, query(e2))
	assert.False(t, query(e4))

	b.CompleteStream(1)
	assert.True(t, query(e1), "completed stream's event is done")
	assert.True(t, query(e4), "CompleteStream covers every device")
	assert.False(t, query(e2), "other streams are unaffected")

	// Work recorded after the completion is pending again; re-recording an
	// event replaces its capture.
	require.NoError(t, b.RecordEvent(e3, 1))
	assert.False(t, query(e3))
	require.NoError(t, b.RecordEvent(e1, 1))
	assert.False(t, query(e1), "re-recorded event captures new work")
	b.CompleteStream(2)
	assert.True(t, query(e2))
	assert.False(t, query(e3))

	b.CompleteAll()
	for _, ev := range []gocore.Event{e1, e2, e3, e4} {
		assert.True(t, query(ev), "event %d after CompleteAll", ev)
	}

	// Switching to automatic completes pending work and later records.
	require.NoError(t, b.RecordEvent(e1, 5))
	assert.False(t, query(e1))
	b.SetManualEvents(false)
	assert.False(t, b.ManualEvents())
	assert.True(t, query(e1), "switching to auto completes pending work")
	require.NoError(t, b.RecordEvent(e2, 5))
	assert.True(t, query(e2))

	// And back to manual: earlier work stays done, new work waits.
	b.SetManualEvents(true)
	assert.True(t, query(e2))
	require.NoError(t, b.RecordEvent(e2, 5))
	assert.False(t, query(e2))
	b.CompleteStream(5)
	assert.True(t, query(e2))
}

func TestSimEventLifecycleErrors(t *testing.T) {
	b := newSim(t, Config{})
	ev, err := b.NewEvent(0)
	require.NoError(t, err)
	other, err := b.NewEvent(0)
	require.NoError(t, err)
	assert.NotEqual(t, ev, other, "event handles are unique")
	assert.NotZero(t, ev, "0 is never a valid event")
	require.NoError(t, b.RecordEvent(ev, 0))
	require.NoError(t, b.DestroyEvent(ev))

	_, err = b.QueryEvent(ev)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "destroyed")
	err = b.RecordEvent(ev, 0)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "destroyed")
	require.Error(t, b.DestroyEvent(ev), "double destroy")

	for _, bogus := range []gocore.Event{0, 999} {
		_, err = b.QueryEvent(bogus)
		require.Error(t, err)
		assert.Contains(t, err.Error(), "unknown")
		require.Error(t, b.RecordEvent(bogus, 0))
		require.Error(t, b.DestroyEvent(bogus))
	}

	// The other event is unaffected.
	done, err := b.QueryEvent(other)
	require.NoError(t, err)
	assert.True(t, done)
	st := b.Stats()
	assert.Equal(t, uint64(2), st.EventsCreated)
	assert.Equal(t, uint64(1), st.EventsDestroyed)
	assert.Equal(t, 1, st.LiveEvents)
	require.NoError(t, b.DestroyEvent(other))
	assert.Zero(t, b.Stats().LiveEvents)
}
