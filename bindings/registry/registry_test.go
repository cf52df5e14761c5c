package registry

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/gocore"
)

func newEntry(t *testing.T) *Entry {
	t.Helper()
	be, err := gocore.NewSimBackend(gocore.SimConfig{})
	require.NoError(t, err)
	p, err := gocore.NewPool(gocore.Config{Name: t.Name(), Backend: be})
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = p.Close() })
	return Add(p, be, nil)
}

// resetSlots puts the slot table back as a fresh process has it.
func resetSlots(t *testing.T) {
	t.Helper()
	mu.Lock()
	defer mu.Unlock()
	for i := range slots {
		slots[i].Store(nil)
	}
	freeSlots = freeSlots[:0]
	for i := range NumSlots {
		freeSlots = append(freeSlots, i)
	}
	retiredSlots = 0
}

// A closed pool's slot goes to the back of the queue: the next pools get
// slots nobody used recently, so a late call through an old slot finds no
// pool rather than another pool.
func TestSlotsReusedLeastRecentlyFreedFirst(t *testing.T) {
	resetSlots(t)
	a, b := newEntry(t), newEntry(t)
	sa, err := AssignSlot(a)
	require.NoError(t, err)
	again, err := AssignSlot(a)
	require.NoError(t, err)
	assert.Equal(t, sa, again, "the same slot on every call")
	sb, err := AssignSlot(b)
	require.NoError(t, err)
	assert.Equal(t, []int{0, 1}, []int{sa, sb})
	Remove(a.ID)
	assert.Nil(t, BySlot(sa))
	assert.Equal(t, -1, a.Slot())
	c := newEntry(t)
	sc, err := AssignSlot(c)
	require.NoError(t, err)
	assert.Equal(t, 2, sc, "slot 0 waits behind the never-used ones")
	Remove(b.ID)
	Remove(c.ID)
}

// A slot whose pool closed with live blocks, or that was pinned for full
// replacement, never serves another pool; when every slot is gone the
// error says why.
func TestSlotsRetired(t *testing.T) {
	resetSlots(t)
	leaky, pinned := newEntry(t), newEntry(t)
	sl, err := AssignSlot(leaky)
	require.NoError(t, err)
	sp, err := AssignSlot(pinned)
	require.NoError(t, err)
	again, err := AssignPinnedSlot(pinned) // pinning a slot it holds already
	require.NoError(t, err)
	require.Equal(t, sp, again)

	require.Same(t, leaky, Unregister(leaky.ID))
	assert.Nil(t, Unregister(leaky.ID), "a second close finds nothing")
	assert.Nil(t, BySlot(sl), "calls through the slot find no pool")
	_, err = AssignSlot(leaky)
	require.ErrorIs(t, err, ErrNoSuchPool)
	FreeSlot(leaky, false)
	FreeSlot(leaky, true) // idempotent: the first word counts
	Remove(pinned.ID)

	var got []int
	var held []*Entry
	for {
		e := newEntry(t)
		s, err := AssignSlot(e)
		if err != nil {
			require.ErrorIs(t, err, ErrNoFreeSlot)
			assert.ErrorContains(t, err, "2 are retired")
			break
		}
		got = append(got, s)
		held = append(held, e)
	}
	assert.Len(t, got, NumSlots-2)
	assert.NotContains(t, got, sl)
	assert.NotContains(t, got, sp)
	for _, e := range held {
		Remove(e.ID)
	}
}

// FreeSlot on a registered entry (a caller mixing up the order) changes
// nothing: the slot is still the entry's.
func TestFreeSlotNeedsUnregister(t *testing.T) {
	resetSlots(t)
	e := newEntry(t)
	s, err := AssignSlot(e)
	require.NoError(t, err)
	FreeSlot(e, true)
	assert.Same(t, e, BySlot(s))
	assert.Equal(t, s, e.Slot())
	Remove(e.ID)
}
