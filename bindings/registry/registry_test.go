package registry

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/sim"
)

func newEntry(t *testing.T) *Entry {
	t.Helper()
	be, err := sim.New(sim.Config{})
	require.NoError(t, err)
	p, err := gocore.NewPool(gocore.Config{Name: t.Name(), Backend: be})
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = p.Close() })
	return Add(p, be)
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
	retiredSlots, pinnedSlots = 0, 0
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

	require.Same(t, leaky, BySlot(sl), "a C caller used the leaky pool's slot")
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
			assert.ErrorContains(t, err, "all 64 are taken: 62 held by open pools, "+
				"1 retired because their pools were closed while blocks allocated through their C functions "+
				"were still live")
			assert.ErrorContains(t, err, "1 kept for torch, which may call them for the rest of the process")
			assert.ErrorContains(t, err, "close a pool that called pluggable_symbols()")
			assert.ErrorContains(t, err, "retired slots come back only in a new process")
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

// Issue 18: a pool that handed out its slot's names but whose C functions
// were never called holds no block of anybody's: closing it with live
// blocks gives the slot back, however many such pools come and go. Only a
// pool whose slot was called, or that was pinned for torch, retires it.
func TestSlotOfUncalledPoolClosedWithLiveBlocksIsReused(t *testing.T) {
	resetSlots(t)
	for range 3 * NumSlots {
		e := newEntry(t)
		_, err := AssignSlot(e)
		require.NoError(t, err)
		require.Same(t, e, Unregister(e.ID))
		FreeSlot(e, false) // closed with live blocks
	}
	called := newEntry(t)
	s, err := AssignSlot(called)
	require.NoError(t, err)
	BySlot(s) // a C call
	require.Same(t, called, Unregister(called.ID))
	FreeSlot(called, false)
	var held []*Entry
	for {
		e := newEntry(t)
		if _, err := AssignSlot(e); err != nil {
			require.ErrorIs(t, err, ErrNoFreeSlot)
			// Nothing blames torch, which had no part here.
			assert.Equal(t, fmt.Sprintf("pool %q needs C entry points but all 64 are taken: 63 held by open pools, "+
				"1 retired because their pools were closed while blocks allocated through their C functions were "+
				"still live (a caller may still free those through them); close a pool that called "+
				"pluggable_symbols() or was given to torch (its slot is reused once nothing outside holds a block of "+
				"it); free every block a C caller got from a pool (drop its torch tensors) before closing the pool, so "+
				"its slot is reused; retired slots come back only in a new process: %v", e.Pool.Name(), ErrNoFreeSlot),
				err.Error())
			break
		}
		held = append(held, e)
	}
	assert.Len(t, held, NumSlots-1)
	for _, e := range held {
		Remove(e.ID)
	}
	// With every slot retired and none held, the error says so and does
	// not ask to close a pool.
	resetSlots(t)
	for range NumSlots {
		e := newEntry(t)
		s, err := AssignSlot(e)
		require.NoError(t, err)
		BySlot(s)
		Unregister(e.ID)
		FreeSlot(e, false)
	}
	_, err = AssignSlot(newEntry(t))
	require.ErrorIs(t, err, ErrNoFreeSlot)
	assert.NotContains(t, err.Error(), "close a pool")
	assert.NotContains(t, err.Error(), "torch, which")
	assert.Contains(t, err.Error(), "all 64 are taken: 64 retired because")
	resetSlots(t)
}

// Get does not wait for the registry's lock: a pool being added, removed
// or given a slot on one thread must not stall every other pool's calls
// (gmp_pool_alloc, the Python API) on the others.
func TestGetDoesNotTakeTheRegistryLock(t *testing.T) {
	e := newEntry(t)
	t.Cleanup(func() { Remove(e.ID) })
	mu.Lock()
	defer mu.Unlock()
	got := make(chan *Entry, 1)
	go func() {
		g, err := Get(e.ID)
		assert.NoError(t, err)
		got <- g
	}()
	select {
	case g := <-got:
		assert.Same(t, e, g)
	case <-time.After(5 * time.Second):
		t.Fatal("Get waited for the registry lock")
	}
}

// All lists the open entries in handle order, and Get refuses a removed one.
func TestAllInHandleOrderAndGetAfterRemove(t *testing.T) {
	a, b, c := newEntry(t), newEntry(t), newEntry(t)
	t.Cleanup(func() { Remove(a.ID); Remove(c.ID) })
	Remove(b.ID)
	var ids []int64
	for _, e := range All() {
		if e == a || e == b || e == c {
			ids = append(ids, e.ID)
		}
	}
	assert.Equal(t, []int64{a.ID, c.ID}, ids)
	_, err := Get(b.ID)
	require.ErrorIs(t, err, ErrNoSuchPool)
	assert.Nil(t, Unregister(b.ID))
}
