package gocore

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The free lists of a stream are dropped when its last cached segment goes
// back, and EmptyCache drops those of streams that never got one, so many
// short-lived streams do not leave a free list each behind.
func TestEmptyStreamFreeListsAreDropped(t *testing.T) {
	p, _ := newTestPool(t, fakeConfig{Capacity: 64 * MiB}, Config{})
	var addrs []uint64
	for s := range 20 {
		addrs = append(addrs, mustAlloc(t, p, 0, 4096, Stream(s)))
	}
	for _, a := range addrs {
		require.NoError(t, p.Free(a))
	}
	d := p.devices[0]
	assert.Len(t, d.streams, 20)
	_, err := p.Alloc(0, 100*MiB, 99) // fails, but the stream got (empty) lists
	require.ErrorIs(t, err, ErrOutOfMemory)
	assert.Len(t, d.streams, 1, "the OOM path released the 20 cached segments and their lists")
	_, err = p.EmptyCache()
	require.NoError(t, err)
	assert.Empty(t, d.streams)
	// A stream whose lists were dropped works as before (and the cached
	// lookup of the last stream was reset).
	a := mustAlloc(t, p, 0, 4096, 99)
	require.NoError(t, p.Free(a))
	assert.Equal(t, a, mustAlloc(t, p, 0, 4096, 99))
	stats(t, p)
	// Segments with live blocks keep their stream's lists.
	_, err = p.EmptyCache()
	require.NoError(t, err)
	assert.Len(t, d.streams, 1)
}
