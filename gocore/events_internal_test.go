package gocore

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Once every parked free is done, the pool keeps no per-stream queue of
// them: a program that records frees on many short-lived streams does not
// leave a queue behind for each (nor makes every later allocation walk
// them).
func TestProcessedEventQueuesAreDropped(t *testing.T) {
	p, be := newTestPool(t, fakeConfig{ManualEvents: true}, Config{})
	for s := range Stream(100) {
		a := mustAlloc(t, p, 0, 4096, 0)
		require.NoError(t, p.RecordStream(a, 1000+s))
		require.NoError(t, p.Free(a))
	}
	d := p.devices[0]
	assert.Len(t, d.pending, 100, "one queue per stream with a free waiting")
	be.CompleteStream(1000)
	n, err := p.ProcessEvents()
	require.NoError(t, err)
	assert.Equal(t, 99, n)
	assert.Len(t, d.pending, 99, "the done stream's queue goes")
	be.CompleteAll()
	n, err = p.ProcessEvents()
	require.NoError(t, err)
	assert.Zero(t, n)
	assert.Empty(t, d.pending)
}
