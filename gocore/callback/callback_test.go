//go:build cgo

package callback

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/callback/internal/testalloc"
)

func TestPoolOverCFunctions(t *testing.T) {
	testalloc.Reset(-1)
	be, err := New(Config{Alloc: testalloc.Alloc(), Free: testalloc.Free(), Name: "malloc", Devices: 2, Alignment: 512})
	require.NoError(t, err)
	p, err := gocore.NewPool(gocore.Config{Backend: be, Name: "cb"})
	require.NoError(t, err)
	a, err := p.Alloc(1, 1000, 0xabc)
	require.NoError(t, err)
	stream, dev := testalloc.Last()
	assert.EqualValues(t, 0xabc, stream)
	assert.Equal(t, 1, dev)
	b, err := p.Alloc(1, 1000, 0xabc)
	require.NoError(t, err)
	assert.Equal(t, a+1024, b)
	allocs, _, live := testalloc.Counters()
	assert.EqualValues(t, 1, allocs, "second block comes from the cached segment")
	assert.EqualValues(t, gocore.SmallBuffer, live)
	require.NoError(t, p.Free(a))
	require.NoError(t, p.Free(b))
	_, err = p.EmptyCache()
	require.NoError(t, err)
	allocs, frees, live := testalloc.Counters()
	assert.EqualValues(t, 1, allocs)
	assert.EqualValues(t, 1, frees)
	assert.Zero(t, live)
	assert.Zero(t, be.LiveSegments())
	_, err = p.Alloc(2, 1, 0)
	assert.ErrorIs(t, err, gocore.ErrInvalidDevice)
}

func TestNullIsOutOfMemoryAfterRetry(t *testing.T) {
	testalloc.Reset(1)
	be, err := New(Config{Alloc: testalloc.Alloc(), Free: testalloc.Free()})
	require.NoError(t, err)
	p, err := gocore.NewPool(gocore.Config{Backend: be})
	require.NoError(t, err)
	a, err := p.Alloc(0, 30<<20, 0)
	require.NoError(t, err)
	_, err = p.Alloc(0, 1, 0)
	require.ErrorIs(t, err, gocore.ErrOutOfMemory)
	assert.Contains(t, err.Error(), "returned NULL")
	s, err := p.Stats(0)
	require.NoError(t, err)
	assert.EqualValues(t, 1, s.NumOOMs)
	assert.EqualValues(t, 1, s.NumAllocRetries)
	rep, err := p.Close()
	require.NoError(t, err)
	require.Len(t, rep.LiveBlocks, 1)
	assert.Equal(t, a, rep.LiveBlocks[0].Addr)
	_, frees, live := testalloc.Counters()
	assert.EqualValues(t, 1, frees)
	assert.Zero(t, live)
}

func TestBrokenAllocatorIsReported(t *testing.T) {
	be, err := New(Config{Alloc: testalloc.AllocSame(), Free: testalloc.FreeNothing()})
	require.NoError(t, err)
	p, err := gocore.NewPool(gocore.Config{Backend: be})
	require.NoError(t, err)
	_, err = p.Alloc(0, 12<<20, 0)
	require.NoError(t, err)
	_, err = p.Alloc(0, 12<<20, 0)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "overlaps the segment")
	require.NoError(t, p.CheckInvariants())
}

func TestConfigErrors(t *testing.T) {
	_, err := New(Config{})
	assert.ErrorIs(t, err, gocore.ErrInvalidArgument)
	_, err = New(Config{Alloc: 1, Free: 1, Alignment: 3})
	assert.ErrorIs(t, err, gocore.ErrInvalidArgument)
	_, err = New(Config{Alloc: 1, Free: 1, Devices: -1})
	assert.ErrorIs(t, err, gocore.ErrInvalidArgument)
	be, err := New(Config{Alloc: 1, Free: 1})
	require.NoError(t, err)
	_, err = be.QueryEvent(99)
	assert.ErrorIs(t, err, gocore.ErrInvalidArgument)
	assert.ErrorIs(t, be.Free(0, 4096, 1, 0), gocore.ErrInvalidArgument)
}

// TestMisalignedAddressIsFreedWithoutTheBackendLock: the user's free runs
// without b.mu on the misaligned path too (it was called with b.mu held, so
// a free function that asked the backend anything would deadlock).
func TestMisalignedAddressIsFreedWithoutTheBackendLock(t *testing.T) {
	be, err := New(Config{Alloc: testalloc.MisalignedAlloc(), Free: testalloc.HookFree(), Alignment: 512})
	require.NoError(t, err)
	var freed uintptr
	unlocked := false
	testalloc.SetFreeHook(func(ptr uintptr) {
		freed = ptr
		if be.mu.TryLock() {
			unlocked = true
			be.mu.Unlock()
		}
	})
	defer testalloc.SetFreeHook(nil)
	_, err = be.Alloc(0, 4096, 0)
	require.ErrorContains(t, err, "not aligned to 512 bytes")
	assert.NotZero(t, freed, "the misaligned memory is handed back")
	assert.Equal(t, uintptr(8), freed%512)
	assert.True(t, unlocked, "free called with the backend's lock held")
	assert.Zero(t, be.LiveSegments())
}

// TestDefaultAlignmentIs512: without an Alignment, an address off torch's
// 512-byte block alignment is refused too (the pool would hand out blocks
// at 0x201), and given back.
func TestDefaultAlignmentIs512(t *testing.T) {
	be, err := New(Config{Alloc: testalloc.MisalignedAlloc(), Free: testalloc.HookFree()})
	require.NoError(t, err)
	assert.Equal(t, uint64(512), be.Alignment())
	var freed uintptr
	testalloc.SetFreeHook(func(ptr uintptr) { freed = ptr })
	defer testalloc.SetFreeHook(nil)
	_, err = be.Alloc(0, 4096, 0)
	require.ErrorContains(t, err, "not aligned to 512 bytes")
	assert.Equal(t, uintptr(8), freed%512, "the misaligned memory is handed back")
	assert.Zero(t, be.LiveSegments())
}

// Once the interpreter is exiting, functions that run Python are not
// called: an allocation fails as out of memory, a free is skipped.
func TestPythonFunctionsAreNotCalledOnceItExits(t *testing.T) {
	testalloc.Reset(-1)
	be, err := New(Config{Alloc: testalloc.Alloc(), Free: testalloc.Free(), Python: true})
	require.NoError(t, err)
	plain, err := New(Config{Alloc: testalloc.Alloc(), Free: testalloc.Free()})
	require.NoError(t, err)
	a, err := be.Alloc(0, 4096, 0)
	require.NoError(t, err)
	PythonExiting()
	t.Cleanup(func() { pythonExiting.Store(false) })
	_, err = be.Alloc(0, 4096, 0)
	require.ErrorIs(t, err, gocore.ErrBackendOutOfMemory)
	assert.ErrorContains(t, err, "interpreter is exiting")
	require.NoError(t, be.Free(0, a, 4096, 0))
	allocs, frees, _ := testalloc.Counters()
	assert.EqualValues(t, 1, allocs)
	assert.Zero(t, frees, "skipped")
	b, err := plain.Alloc(0, 4096, 0) // C functions are still called
	require.NoError(t, err)
	require.NoError(t, plain.Free(0, b, 4096, 0))
}
