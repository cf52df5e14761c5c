package cabi

import (
	"errors"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/bindings/registry"
	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/graphpool"
)

// The private pools themselves are tested in package graphpool; here, the
// glue of torch's hooks to them.

// refusingFree is a sim backend whose Free fails while refuse is set.
type refusingFree struct {
	*gocore.SimBackend
	refuse atomic.Bool
}

func (b *refusingFree) Free(device int, addr, size uint64, stream gocore.Stream) error {
	if b.refuse.Load() {
		return errors.New("refused")
	}
	return b.SimBackend.Free(device, addr, size, stream)
}

// A pool closed during its own capture: the backend refuses its private
// pools' segments while the stream still captures (the CUDA backends'
// ErrCaptureUnderway). When torch then ends the allocation to the pool, on
// a slot no pool holds any more, they go back; before, they waited for
// another pool's sweep.
func TestGraphPoolSegmentsOfAPoolClosedDuringItsCaptureGoBackAtItsEnd(t *testing.T) {
	sim, err := gocore.NewSimBackend(gocore.SimConfig{Capacity: 1 << 30})
	require.NoError(t, err)
	be := &refusingFree{SimBackend: sim}
	p, err := gocore.NewPool(gocore.Config{Name: "torch", Backend: be})
	require.NoError(t, err)
	e := registry.Add(p, sim, nil)
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
	require.NoError(t, e.Graphs.BeginCapture(0, id, graphpool.Filter{
		Accepts: func(s gocore.Stream) bool { return s == 0x10 },
		Release: func() { released.Add(1) },
	}))
	_, err = e.Graphs.Alloc(1<<20, 0, 0x10)
	require.NoError(t, err)
	be.refuse.Store(true)
	_, err = e.Pool.Close()
	require.NoError(t, err)
	_, err = e.Graphs.ClosePrivate()
	require.ErrorContains(t, err, "refused") // refused: the capture still runs
	assert.EqualValues(t, 1, released.Load(), "the close dropped the capture and its filter")
	registry.Remove(e.ID) // the slot goes with the pool
	removed = true
	require.NotZero(t, sim.UsedBytes(0))
	be.refuse.Store(false) // the capture ended; torch ends the allocation to the pool
	graphEnd(slot, 0, id)
	assert.Zero(t, sim.UsedBytes(0), "the refused segments went back")
	assert.Equal(t, fmt.Sprintf("gmp_end_allocate_to_pool_%d: no pool holds this slot (closed?)", slot), registry.TakeOrphanError())
}
