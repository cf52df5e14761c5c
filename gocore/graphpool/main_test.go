package graphpool

import (
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/gocore"
)

// A Pools is its pool's one face: Stats counts the private pools' memory
// with the main pool's, Close closes both and reports the blocks both still
// held, and the main pool's own verbs (limits, trim, names) reach it.
func TestPoolsIsThePoolsOneFace(t *testing.T) {
	const mib = 1 << 20
	g, be := newPools(t, gocore.Config{Name: "face"})
	assert.Equal(t, "face", g.Name())
	assert.Same(t, be, g.Backend())
	assert.Equal(t, "face", g.Config().Name)
	require.NoError(t, g.SetDeviceLimit(0, 512*mib))
	assert.EqualValues(t, 512*mib, g.Limit(0))

	main, err := g.Alloc(0, mib, 0)
	require.NoError(t, err)
	var released atomic.Int32
	id := ID{0, 7}
	require.NoError(t, g.BeginCapture(0, id, goFilter(0x10, &released)))
	private, err := g.Alloc(0, mib, 0x10)
	require.NoError(t, err)
	require.NoError(t, g.EndCapture(0, id))

	st, err := g.Stats(0)
	require.NoError(t, err)
	mainOnly, err := g.main.Stats(0)
	require.NoError(t, err)
	assert.Greater(t, st.ReservedBytes[0].Current, mainOnly.ReservedBytes[0].Current, "the private pool counts")
	assert.EqualValues(t, 2, st.Allocation[0].Current)

	require.NoError(t, g.Free(main))
	released0, err := g.Trim(0, 0)
	require.NoError(t, err)
	assert.Positive(t, released0, "trim gives back the main pool's free segment")

	rep, err := g.Close()
	require.NoError(t, err)
	require.Len(t, rep.LiveBlocks, 1, "the private pool's block, reported by the one close")
	assert.Equal(t, private, rep.LiveBlocks[0].Addr)
	assert.EqualValues(t, 1, released.Load(), "the filter, released once when its capture ended")
	assert.Zero(t, be.UsedBytes(0))
}
