package segtrack

import (
	"errors"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/gocore"
)

func TestAddLookupFree(t *testing.T) {
	tab := New("test backend")
	assert.Equal(t, []Segment{}, tab.Segments(), "empty, not nil")
	require.True(t, tab.Add(Segment{Device: 1, Addr: 0x3000, Size: 512}))
	require.True(t, tab.Add(Segment{Device: 0, Addr: 0x2000, Size: 1024}))
	require.True(t, tab.Add(Segment{Device: 1, Addr: 0x1000, Size: 512}))
	assert.False(t, tab.Add(Segment{Device: 0, Addr: 0x2000, Size: 64}), "still allocated")
	assert.Equal(t, []Segment{{0, 0x2000, 1024}, {1, 0x1000, 512}, {1, 0x3000, 512}}, tab.Segments(),
		"by device, then address; the refused Add changed nothing")
	s, ok := tab.Lookup(0x2000)
	assert.True(t, ok)
	assert.Equal(t, Segment{0, 0x2000, 1024}, s)
	_, ok = tab.Lookup(0x2001)
	assert.False(t, ok)

	called := 0
	free := func() error { called++; return nil }
	for _, bad := range []struct {
		dev        int
		addr, size uint64
	}{{0, 0x4000, 512}, {1, 0x2000, 1024}, {0, 0x2000, 512}} {
		err := tab.Free(bad.dev, bad.addr, bad.size, free)
		require.ErrorIs(t, err, gocore.ErrInvalidArgument)
		assert.Contains(t, err.Error(), "test backend: free(")
		assert.Contains(t, err.Error(), "not a live segment of that size and device")
	}
	assert.Zero(t, called, "free is not called for a segment that is not live")

	// A failed free leaves the segment live.
	boom := errors.New("boom")
	require.ErrorIs(t, tab.Free(0, 0x2000, 1024, func() error { return boom }), boom)
	assert.Len(t, tab.Segments(), 3)
	require.NoError(t, tab.Free(0, 0x2000, 1024, free))
	assert.Equal(t, 1, called)
	_, ok = tab.Lookup(0x2000)
	assert.False(t, ok)
	require.ErrorIs(t, tab.Free(0, 0x2000, 1024, free), gocore.ErrInvalidArgument, "freed twice")
}

// While a Free is in flight a second one is refused, and the driver may
// hand the address out again: the Free leaves the new segment alone.
func TestFreeInFlight(t *testing.T) {
	tab := New("test backend")
	require.True(t, tab.Add(Segment{Device: 0, Addr: 0x1000, Size: 512}))
	err := tab.Free(0, 0x1000, 512, func() error {
		err := tab.Free(0, 0x1000, 512, func() error { return nil })
		require.ErrorIs(t, err, gocore.ErrInvalidArgument)
		assert.Contains(t, err.Error(), "test backend: free(0x1000): already being freed")
		s, ok := tab.Lookup(0x1000)
		assert.True(t, ok, "still live while being freed")
		assert.Equal(t, Segment{0, 0x1000, 512}, s)
		assert.True(t, tab.Add(Segment{Device: 0, Addr: 0x1000, Size: 2048}), "the driver reused the address")
		return nil
	})
	require.NoError(t, err)
	assert.Equal(t, []Segment{{0, 0x1000, 2048}}, tab.Segments(), "the new segment stays")

	// A failed Free that raced with nothing leaves its segment free-able.
	require.Error(t, tab.Free(0, 0x1000, 2048, func() error { return errors.New("busy") }))
	require.NoError(t, tab.Free(0, 0x1000, 2048, func() error { return nil }))
	assert.Empty(t, tab.Segments())
}

func TestConcurrent(t *testing.T) {
	tab := New("test backend")
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 200 {
				addr := uint64(g)<<32 | uint64(i)<<9
				if !tab.Add(Segment{Device: g % 2, Addr: addr, Size: 512}) {
					t.Errorf("add %#x refused", addr)
					return
				}
				_ = tab.Segments()
				if err := tab.Free(g%2, addr, 512, func() error { return nil }); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	assert.Empty(t, tab.Segments())
}
