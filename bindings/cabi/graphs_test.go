package cabi

import (
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/bindings/registry"
	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/graphpool"
	"github.com/gpumempool/gpumempool/gocore/simtest"
)

// The private pools themselves are tested in package graphpool; here, the
// glue of torch's hooks to them.

// A pool closed during its own capture: the backend refuses its private
// pools' segments while the stream still captures (the CUDA backends'
// ErrCaptureUnderway). When torch then ends the allocation to the pool, on
// a slot no pool holds any more, they go back; before, they waited for
// another pool's sweep.
func TestGraphPoolSegmentsOfAPoolClosedDuringItsCaptureGoBackAtItsEnd(t *testing.T) {
	p, be, sim := simtest.NewRefusingPool(t, "torch")
	e := registry.Add(p, sim)
	slot, err := registry.AssignSlot(e)
	require.NoError(t, err)
	removed := false
	t.Cleanup(func() {
		if !removed {
			registry.Remove(e.ID)
		}
	})
	id := graphpool.ID{0, 78}
	var released atomic.Int32
	require.NoError(t, e.Pool.BeginCapture(0, id, graphpool.Filter{
		Accepts: func(s gocore.Stream) bool { return s == 0x10 },
		Release: func() { released.Add(1) },
	}))
	_, err = e.Pool.Alloc(0, 1<<20, 0x10)
	require.NoError(t, err)
	be.Refuse.Store(true)
	_, err = e.Pool.Close()                  // the main pool, then its private pools
	require.ErrorContains(t, err, "refused") // the private pools' segments: the capture still runs
	assert.EqualValues(t, 1, released.Load(), "the close dropped the capture and its filter")
	registry.Remove(e.ID) // the slot goes with the pool
	removed = true
	require.NotZero(t, sim.UsedBytes(0))
	be.Refuse.Store(false) // the capture ended; torch ends the allocation to the pool
	graphEnd(slot, 0, id)
	assert.Zero(t, sim.UsedBytes(0), "the refused segments went back")
	assert.EqualError(t, registry.TakeOrphanError(), fmt.Sprintf("gmp_end_allocate_to_pool_%d: no pool holds this slot (closed?)", slot))
}
