package cabi

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/bindings/registry"
	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/sim"
)

// slotEntry registers a pool over be with a C slot.
func slotEntry(tb testing.TB, be gocore.Backend) (*registry.Entry, int) {
	tb.Helper()
	p, err := gocore.NewPool(gocore.Config{Name: "entry", Backend: be})
	require.NoError(tb, err)
	e := registry.Add(p, nil)
	tb.Cleanup(func() { registry.Remove(e.ID) })
	slot, err := registry.AssignSlot(e)
	require.NoError(tb, err)
	return e, slot
}

func simSlotEntry(tb testing.TB) (*registry.Entry, int) {
	tb.Helper()
	be, err := sim.New(sim.Config{Capacity: 1 << 30})
	require.NoError(tb, err)
	return slotEntry(tb, be)
}

// panickingAlloc is a sim backend whose Alloc panics.
type panickingAlloc struct{ *sim.Backend }

func (panickingAlloc) Alloc(int, uint64, gocore.Stream) (uint64, error) { panic("backend bug") }

// gmp_alloc_<i> and gmp_free_<i> stop a Go panic, injected or real, at the
// C boundary: NULL (free: nothing) and the panic as the pool's last error;
// the next call is served.
func TestSlotPairRecoversPanics(t *testing.T) {
	e, slot := simSlotEntry(t)
	e.PanicNext.Store(true)
	addr, err := slotAlloc(slot, 4096, 0, 0)
	require.ErrorContains(t, err, "gmp_alloc: Go panic recovered: injected by PanicNext")
	assert.Zero(t, addr)
	assert.EqualError(t, e.TakeError(), err.Error())

	addr, err = slotAlloc(slot, 4096, 0, 0)
	require.NoError(t, err, "PanicNext injects one panic")
	require.NotZero(t, addr)
	e.PanicNext.Store(true)
	slotFree(slot, addr)
	assert.EqualError(t, e.TakeError(), "gmp_free: Go panic recovered: injected by PanicNext")
	_, err = e.Pool.Lookup(uint64(addr))
	require.NoError(t, err, "the panic came before the free")
	slotFree(slot, addr)
	assert.NoError(t, e.TakeError())
	_, err = e.Pool.Lookup(uint64(addr))
	require.ErrorIs(t, err, gocore.ErrDoubleFree, "freed")

	sim, err := sim.New(sim.Config{Capacity: 1 << 30})
	require.NoError(t, err)
	bad, badSlot := slotEntry(t, panickingAlloc{sim})
	addr, err = slotAllocSegment(badSlot, 4096, 0, 0)
	require.ErrorContains(t, err, "gmp_segment_alloc: Go panic recovered: backend bug")
	assert.Zero(t, addr)
	assert.EqualError(t, bad.TakeError(), err.Error())
}

// A slot no pool holds fails cleanly, with the error kept for pool 0.
func TestSlotPairWithoutPool(t *testing.T) {
	e, slot := simSlotEntry(t)
	registry.Remove(e.ID)
	_, err := slotAlloc(slot, 4096, 0, 0)
	require.ErrorContains(t, err, "no pool holds this slot")
	assert.EqualError(t, registry.TakeOrphanError(), err.Error())
	slotFree(slot, 0x1000)
	assert.ErrorContains(t, registry.TakeOrphanError(), "gmp_free_")
}

// The engine's cache-hit pair alone: the floor of what the slot pair adds to.
func BenchmarkEnginePair(b *testing.B) {
	e, _ := simSlotEntry(b)
	for range b.N {
		addr, err := e.Pool.Alloc(0, 4096, 0)
		if err != nil {
			b.Fatal(err)
		}
		if err := e.Pool.Free(addr); err != nil {
			b.Fatal(err)
		}
	}
}

// The Go side of gmp_alloc_<i> / gmp_free_<i> (without the cgo crossing):
// what the C ABI layer adds to the engine is this minus BenchmarkEnginePair.
func BenchmarkSlotPair(b *testing.B) {
	_, slot := simSlotEntry(b)
	for range b.N {
		addr, err := slotAlloc(slot, 4096, 0, 0)
		if err != nil || addr == 0 {
			b.Fatal(err)
		}
		slotFree(slot, addr)
	}
}
