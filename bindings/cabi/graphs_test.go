package cabi

import (
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/bindings/registry"
	"github.com/gpumempool/gpumempool/gocore"
)

const mib = 1 << 20

// goFilter accepts one stream, like torch.cuda.graph's filter accepts the
// stream it captures; it counts its releases.
type goFilter struct {
	stream   uintptr
	released *atomic.Int32
}

func (f goFilter) accepts(s uintptr) bool { return s == f.stream }
func (f goFilter) release()               { f.released.Add(1) }

func newEntry(t *testing.T, cfg gocore.Config) (*registry.Entry, *gocore.SimBackend) {
	t.Helper()
	return newSimEntry(t, gocore.SimConfig{Capacity: 1 << 30}, cfg)
}

func newSimEntry(t *testing.T, sim gocore.SimConfig, cfg gocore.Config) (*registry.Entry, *gocore.SimBackend) {
	t.Helper()
	be, err := gocore.NewSimBackend(sim)
	require.NoError(t, err)
	cfg.Backend = be
	p, err := gocore.NewPool(cfg)
	require.NoError(t, err)
	e := registry.Add(p, be, nil)
	t.Cleanup(func() { registry.Remove(e.ID) })
	return e, be
}

// Threads allocate and free on captured and uncaptured streams while
// captures begin and end: no block is ever live twice, blocks allocated on
// a captured stream come from its private pool, and once every graph is
// released all memory is back (run with -race).
func TestGraphRoutingUnderConcurrency(t *testing.T) {
	e, be := newEntry(t, gocore.Config{Name: "torch"})
	var released atomic.Int32
	const workers, rounds = 8, 300
	var live sync.Map // addr -> worker
	var wg sync.WaitGroup
	var violations atomic.Int32
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			stream := uintptr(0x100 + w%2) // streams 0x100 (captured) and 0x101
			for i := range rounds {
				size := uint64(512 * (1 + (i*7+w)%64))
				addr, err := AllocFor(e, size, 0, stream)
				if !assert.NoError(t, err) {
					return
				}
				if _, dup := live.LoadOrStore(addr, w); dup {
					violations.Add(1)
				}
				live.Delete(addr)
				if !assert.NoError(t, FreeFor(e, addr)) {
					return
				}
			}
		}()
	}
	wg.Add(1)
	go func() { // graphs come and go
		defer wg.Done()
		for i := range 50 {
			id := graphPoolID{uint64(i + 1), 0}
			assert.NoError(t, beginCapture(e, 0, id, goFilter{stream: 0x100, released: &released}))
			assert.NoError(t, endCapture(e, 0, id))
			assert.NoError(t, releaseGraphPool(e, 0, id))
		}
	}()
	wg.Wait()
	assert.Zero(t, violations.Load(), "a block was handed out while live")
	assert.EqualValues(t, 50, released.Load(), "every filter released")
	pools, err := GraphPools(e)
	require.NoError(t, err)
	assert.Empty(t, pools, "released pools close once their blocks are freed")
	assert.Zero(t, privateBlocks.Load())
	assert.Zero(t, gocore.ProcessCaptures())
	require.NoError(t, e.Pool.CheckInvariants())
	st, err := e.Pool.Stats(-1)
	require.NoError(t, err)
	assert.EqualValues(t, st.ReservedBytes[0].Current, be.UsedBytes(0), "the backend holds only the pool's own segments")
	_, err = e.Pool.Close()
	require.NoError(t, err)
	rep, err := CloseGraphPools(e)
	require.NoError(t, err)
	assert.Empty(t, rep.LiveBlocks)
	assert.Zero(t, be.UsedBytes(0))
}

// A capture's blocks stay private until release, across frees, and a
// capture of one stream leaves other streams and devices alone.
func TestGraphPrivatePoolLifecycle(t *testing.T) {
	e, be := newEntry(t, gocore.Config{Name: "torch", ReleaseThreshold: 1})
	var released atomic.Int32
	s1, s2 := uintptr(0x1), uintptr(0x2) // cudaStreamLegacy and cudaStreamPerThread
	id := graphPoolID{7, 1}
	require.NoError(t, beginCapture(e, 0, id, goFilter{stream: 0x1, released: &released}))
	a, err := AllocFor(e, mib, 0, s1)
	require.NoError(t, err)
	b, err := AllocFor(e, mib, 0, s2)
	require.NoError(t, err)
	_, err = e.Pool.Lookup(a)
	require.ErrorIs(t, err, gocore.ErrUnknownPointer, "a is the private pool's")
	_, err = e.Pool.Lookup(b)
	require.NoError(t, err, "b, on another stream, is the pool's")
	info, ok, err := privateBlock(e, a)
	require.NoError(t, err)
	require.True(t, ok)
	assert.Equal(t, a, info.Addr)

	require.NoError(t, endCapture(e, 0, id))
	assert.EqualValues(t, 1, released.Load())
	require.ErrorContains(t, endCapture(e, 0, id), "no allocation to this pool was begun")
	require.NoError(t, FreeFor(e, a))
	pools, err := GraphPools(e)
	require.NoError(t, err)
	require.Len(t, pools, 1)
	assert.EqualValues(t, 2*mib, pools[0].ReservedBytes, "kept despite the release threshold: a replay writes it")
	c, err := AllocFor(e, mib, 0, s1)
	require.NoError(t, err)
	assert.NotEqual(t, a, c, "after the capture, stream 1 is served by the pool, never with the graph's block")

	var st gocore.Stats
	require.NoError(t, AddGraphStats(e, 0, &st))
	assert.EqualValues(t, 2*mib, st.ReservedBytes[0].Current)
	require.NoError(t, releaseGraphPool(e, 0, id))
	pools, err = GraphPools(e)
	require.NoError(t, err)
	assert.Empty(t, pools)
	st = gocore.Stats{}
	require.NoError(t, AddGraphStats(e, -1, &st))
	assert.Zero(t, st.ReservedBytes[0].Current)
	assert.EqualValues(t, 2*mib, st.ReservedBytes[0].Peak, "the retired pool's history stays")
	assert.EqualValues(t, 1, st.NumDeviceFree)

	require.NoError(t, FreeFor(e, b))
	require.NoError(t, FreeFor(e, c))
	_, err = e.Pool.Close()
	require.NoError(t, err)
	_, err = CloseGraphPools(e)
	require.NoError(t, err)
	assert.Zero(t, be.UsedBytes(0))
}

// One torch pool id used on two devices is two private pools, begun, ended
// and released per device.
func TestGraphPoolsArePerDevice(t *testing.T) {
	be, err := gocore.NewSimBackend(gocore.SimConfig{Devices: 2, Capacity: 1 << 30})
	require.NoError(t, err)
	p, err := gocore.NewPool(gocore.Config{Name: "torch", Backend: be})
	require.NoError(t, err)
	e := registry.Add(p, be, nil)
	t.Cleanup(func() { registry.Remove(e.ID) })
	var released atomic.Int32
	id := graphPoolID{3, 0}
	require.NoError(t, beginCapture(e, 0, id, goFilter{stream: 0x5, released: &released}))
	require.NoError(t, beginCapture(e, 1, id, goFilter{stream: 0x5, released: &released}))
	a0, err := AllocFor(e, mib, 0, 0x5)
	require.NoError(t, err)
	a1, err := AllocFor(e, 3*mib, 1, 0x5)
	require.NoError(t, err)
	require.NoError(t, endCapture(e, 1, id))
	pools, err := GraphPools(e)
	require.NoError(t, err)
	require.Len(t, pools, 2)
	assert.Equal(t, 0, pools[0].Device)
	assert.True(t, pools[0].Capturing)
	assert.Equal(t, 1, pools[1].Device)
	assert.False(t, pools[1].Capturing, "device 1's capture ended")
	assert.EqualValues(t, 20*mib, pools[1].ReservedBytes) // a 1-10 MiB request gets a 20 MiB segment, as in torch
	require.NoError(t, FreeFor(e, a1))
	require.NoError(t, releaseGraphPool(e, 1, id))
	pools, err = GraphPools(e)
	require.NoError(t, err)
	require.Len(t, pools, 2, "device 1's pool waits: device 0 still captures, and freeing memory would break that")
	assert.True(t, pools[1].Released)
	require.NoError(t, endCapture(e, 0, id))
	pools, err = GraphPools(e)
	require.NoError(t, err)
	require.Len(t, pools, 1, "device 0's pool stays")
	assert.Zero(t, be.UsedBytes(1))
	require.NoError(t, FreeFor(e, a0))
	require.NoError(t, releaseGraphPool(e, 0, id))
	assert.EqualValues(t, 2, released.Load())
	_, err = p.Close()
	require.NoError(t, err)
	_, err = CloseGraphPools(e)
	require.NoError(t, err)
	assert.Zero(t, be.UsedBytes(0)+be.UsedBytes(1))
}

// closeEntry closes e's pool and private pools and checks the backend holds
// nothing any more.
func closeEntry(t *testing.T, e *registry.Entry, be *gocore.SimBackend) {
	t.Helper()
	_, err := e.Pool.Close()
	require.NoError(t, err)
	_, err = CloseGraphPools(e)
	require.NoError(t, err)
	for d := range be.Devices() {
		assert.Zero(t, be.UsedBytes(d))
	}
}

// Two graphs captured into one pool (torch.cuda.graph(pool=g1.pool()),
// graph_pool_handle()) get one releasePool each: the pool lives until the
// second, and the temporaries the second graph's replay writes are never
// handed out before.
func TestGraphSharedPoolLivesUntilLastRelease(t *testing.T) {
	e, be := newEntry(t, gocore.Config{Name: "torch"})
	var released atomic.Int32
	id := graphPoolID{0, 42}
	capture := func() (out, tmp uint64) {
		require.NoError(t, beginCapture(e, 0, id, goFilter{stream: 0x10, released: &released}))
		out, err := AllocFor(e, mib, 0, 0x10)
		require.NoError(t, err)
		tmp, err = AllocFor(e, mib, 0, 0x10)
		require.NoError(t, err)
		require.NoError(t, FreeFor(e, tmp)) // a temporary of the graph
		require.NoError(t, endCapture(e, 0, id))
		return out, tmp
	}
	out1, _ := capture()
	out2, tmp2 := capture()
	require.NoError(t, releaseGraphPool(e, 0, id)) // g1 reset; g2 lives
	require.NoError(t, FreeFor(e, out1))
	require.NoError(t, FreeFor(e, out2))
	pools, err := GraphPools(e)
	require.NoError(t, err)
	require.Len(t, pools, 1, "g2 still uses the pool")
	assert.False(t, pools[0].Released)
	x, err := AllocFor(e, mib, 0, 0x99)
	require.NoError(t, err)
	assert.NotEqual(t, tmp2, x)
	require.NoError(t, releaseGraphPool(e, 0, id)) // g2 reset
	pools, err = GraphPools(e)
	require.NoError(t, err)
	assert.Empty(t, pools, "no user and no block left: closed")
	require.NoError(t, releaseGraphPool(e, 0, id), "a release with no user left (MemPool's destructor) is harmless")
	require.NoError(t, FreeFor(e, x))
	closeEntry(t, e, be)
}

// torch.cuda.use_mem_pool begins and, at exit, releases: a MemPool entered
// twice keeps its blocks private in between and takes them back on reentry.
func TestGraphPoolReenteredAfterRelease(t *testing.T) {
	e, be := newEntry(t, gocore.Config{Name: "torch"})
	var released atomic.Int32
	id := graphPoolID{1, 7}
	enter := func() uint64 {
		require.NoError(t, beginCapture(e, 0, id, goFilter{stream: 0x10, released: &released}))
		a, err := AllocFor(e, mib, 0, 0x10)
		require.NoError(t, err)
		require.NoError(t, endCapture(e, 0, id))
		require.NoError(t, releaseGraphPool(e, 0, id))
		return a
	}
	a := enter()
	pools, err := GraphPools(e)
	require.NoError(t, err)
	require.Len(t, pools, 1)
	assert.True(t, pools[0].Released, "no user, but a live block")
	b := enter()
	require.NoError(t, FreeFor(e, a))
	pools, err = GraphPools(e)
	require.NoError(t, err)
	require.Len(t, pools, 1, "b lives")
	require.NoError(t, FreeFor(e, b))
	pools, err = GraphPools(e)
	require.NoError(t, err)
	assert.Empty(t, pools)
	closeEntry(t, e, be)
}

// Freeing memory during a capture invalidates it: a pool no graph uses any
// more whose last block is freed while another graph is captured is closed
// only when that capture ends.
func TestGraphPoolNotClosedDuringCapture(t *testing.T) {
	e, be := newEntry(t, gocore.Config{Name: "torch"})
	var released atomic.Int32
	p1, p2 := graphPoolID{1, 0}, graphPoolID{2, 0}
	require.NoError(t, beginCapture(e, 0, p1, goFilter{stream: 0x10, released: &released}))
	x, err := AllocFor(e, mib, 0, 0x10)
	require.NoError(t, err)
	require.NoError(t, endCapture(e, 0, p1))
	require.NoError(t, releaseGraphPool(e, 0, p1)) // g1 gone, its output x lives
	require.NoError(t, beginCapture(e, 0, p2, goFilter{stream: 0x20, released: &released}))
	frees := be.Stats().Frees
	require.NoError(t, FreeFor(e, x))
	assert.Equal(t, frees, be.Stats().Frees, "no backend free during a capture")
	require.NoError(t, endCapture(e, 0, p2))
	assert.Equal(t, frees+1, be.Stats().Frees, "freed when the capture ended")
	pools, err := GraphPools(e)
	require.NoError(t, err)
	assert.Empty(t, pools)
	require.NoError(t, releaseGraphPool(e, 0, p2))
	closeEntry(t, e, be)
}

// A private block used on another stream and freed keeps its segment until
// that stream's work is done; then empty_cache, or an allocation that would
// otherwise run out of memory, gives it back.
func TestGraphPoolWaitsForEvents(t *testing.T) {
	e, be := newSimEntry(t, gocore.SimConfig{Capacity: 20 * mib, ManualEvents: true}, gocore.Config{Name: "torch"})
	var released atomic.Int32
	id := graphPoolID{5, 0}
	require.NoError(t, beginCapture(e, 0, id, goFilter{stream: 0x10, released: &released}))
	x, err := AllocFor(e, 12*mib, 0, 0x10)
	require.NoError(t, err)
	require.NoError(t, endCapture(e, 0, id))
	ok, err := privateRecordStream(e, x, 0x30)
	require.True(t, ok)
	require.NoError(t, err)
	require.NoError(t, releaseGraphPool(e, 0, id))
	require.NoError(t, FreeFor(e, x))
	assert.EqualValues(t, 12*mib, be.UsedBytes(0), "stream 0x30 may still use x")
	_, err = EmptyCache(e)
	require.NoError(t, err)
	assert.EqualValues(t, 12*mib, be.UsedBytes(0), "still: its event has not completed")
	_, err = AllocFor(e, 12*mib, 0, 0)
	require.ErrorIs(t, err, gocore.ErrOutOfMemory, "the private segment is still busy")
	be.CompleteStream(0x30)
	y, err := AllocFor(e, 12*mib, 0, 0)
	require.NoError(t, err, "the out-of-memory path closes the idle private pool first")
	pools, err := GraphPools(e)
	require.NoError(t, err)
	assert.Empty(t, pools)
	require.NoError(t, FreeFor(e, y))
	closeEntry(t, e, be)
}

// A beginAllocateToPool that reaches a pool closed from another thread (torch
// read the slot just before) is refused: no private pool revives, the
// filter is released, no capture stays counted.
func TestGraphBeginAfterClose(t *testing.T) {
	e, be := newEntry(t, gocore.Config{Name: "torch"})
	closeEntry(t, e, be)
	var released atomic.Int32
	before := gocore.ProcessCaptures()
	err := beginCapture(e, 0, graphPoolID{9, 0}, goFilter{stream: 0x10, released: &released})
	require.ErrorIs(t, err, gocore.ErrClosed)
	assert.EqualValues(t, 1, released.Load())
	assert.Equal(t, before, gocore.ProcessCaptures())
	assert.Nil(t, graphStateOf(e, false), "no state appears for a closed pool")
	_, err = AllocFor(e, mib, 0, 0x10)
	require.ErrorIs(t, err, gocore.ErrClosed)

	// The same race, with the pool state existing but closed in between.
	e2, be2 := newEntry(t, gocore.Config{Name: "torch2"})
	g := graphStateOf(e2, true)
	closeEntry(t, e2, be2)
	graphMu.Lock()
	graphs[e2] = g // as if torch's thread had looked it up before the close
	graphMu.Unlock()
	t.Cleanup(func() { graphMu.Lock(); delete(graphs, e2); graphMu.Unlock() })
	err = beginCapture(e2, 0, graphPoolID{9, 0}, goFilter{stream: 0x10, released: &released})
	require.ErrorIs(t, err, gocore.ErrClosed)
	assert.EqualValues(t, 2, released.Load())
}

// A private pool that is done closes before any capture can begin anywhere
// in the process: a capture of another pool that starts while the close
// runs waits for it (captureGate), so no segment is freed during it.
func TestPrivatePoolCloseHoldsOffOtherCaptures(t *testing.T) {
	a, _ := newEntry(t, gocore.Config{Name: "a"})
	b, _ := newEntry(t, gocore.Config{Name: "b"})
	var released atomic.Int32
	idA, idB := graphPoolID{1, 1}, graphPoolID{2, 1}
	require.NoError(t, beginCapture(a, 0, idA, goFilter{stream: 0x100, released: &released}))
	addr, err := AllocFor(a, mib, 0, 0x100)
	require.NoError(t, err)
	require.NoError(t, endCapture(a, 0, idA))
	require.NoError(t, releaseGraphPool(a, 0, idA)) // done but for addr

	begun := make(chan error, 1)
	var beganDuringClose atomic.Bool
	testHookBeforePrivateClose = func() {
		go func() { begun <- beginCapture(b, 0, idB, goFilter{stream: 0x200, released: &released}) }()
		select {
		case err := <-begun:
			beganDuringClose.Store(true)
			begun <- err
		case <-time.After(100 * time.Millisecond):
		}
	}
	t.Cleanup(func() { testHookBeforePrivateClose = nil })
	require.NoError(t, FreeFor(a, addr)) // the last block: a's private pool closes
	testHookBeforePrivateClose = nil
	assert.False(t, beganDuringClose.Load(), "a capture began while a private pool was being closed")
	require.NoError(t, <-begun)
	pools, err := GraphPools(a)
	require.NoError(t, err)
	assert.Empty(t, pools, "a's private pool closed")
	require.NoError(t, endCapture(b, 0, idB))
	require.NoError(t, releaseGraphPool(b, 0, idB))
	assert.Zero(t, gocore.ProcessCaptures())
}

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

// A private pool whose segments the backend refuses when it closes keeps
// them for later: the next sweep gives them back, or else the pool's close.
func TestGraphPoolSegmentsRefusedAtCloseAreRetried(t *testing.T) {
	for _, retryBy := range []string{"sweep", "close"} {
		t.Run(retryBy, func(t *testing.T) {
			sim, err := gocore.NewSimBackend(gocore.SimConfig{Capacity: 1 << 30})
			require.NoError(t, err)
			be := &refusingFree{SimBackend: sim}
			p, err := gocore.NewPool(gocore.Config{Name: "torch", Backend: be})
			require.NoError(t, err)
			e := registry.Add(p, sim, nil)
			t.Cleanup(func() { registry.Remove(e.ID) })
			var released atomic.Int32
			id := graphPoolID{0, 9}
			require.NoError(t, beginCapture(e, 0, id, goFilter{stream: 0x10, released: &released}))
			a, err := AllocFor(e, mib, 0, 0x10)
			require.NoError(t, err)
			require.NoError(t, endCapture(e, 0, id))
			require.NoError(t, releaseGraphPool(e, 0, id))
			be.refuse.Store(true)
			require.ErrorContains(t, FreeFor(e, a), "refused", "the private pool closes; its segment stays")
			pools, err := GraphPools(e)
			require.NoError(t, err)
			assert.Empty(t, pools)
			require.NotZero(t, sim.UsedBytes(0))
			be.refuse.Store(false)
			if retryBy == "sweep" {
				n, err := sweepFreeable(e)
				require.NoError(t, err)
				assert.Equal(t, 1, n)
				assert.Zero(t, sim.UsedBytes(0))
			}
			_, err = e.Pool.Close()
			require.NoError(t, err)
			_, err = CloseGraphPools(e)
			require.NoError(t, err)
			assert.Zero(t, sim.UsedBytes(0))
		})
	}
}

// allFilter accepts every stream, like the filter of torch.cuda.use_mem_pool
// on torch 2.5-2.7 (_cuda_beginAllocateToPool).
type allFilter struct{ released *atomic.Int32 }

func (allFilter) accepts(uintptr) bool { return true }
func (f allFilter) release()           { f.released.Add(1) }

// A graph captured inside use_mem_pool (or nested use_mem_pool blocks):
// the innermost capture accepting the stream gets the allocation, as in
// torch since 2.10, or the graph's temporaries would live in the enclosing
// MemPool's pool and be handed to later tensors while replays write them.
func TestGraphInnermostCaptureWins(t *testing.T) {
	e, be := newEntry(t, gocore.Config{Name: "torch"})
	var released atomic.Int32
	outer, inner := graphPoolID{0, 1}, graphPoolID{21, 0}
	require.NoError(t, beginCapture(e, 0, outer, allFilter{&released}))
	require.NoError(t, beginCapture(e, 0, inner, goFilter{stream: 0x10, released: &released}))
	x, err := AllocFor(e, mib, 0, 0x10) // the graph's stream: inner
	require.NoError(t, err)
	y, err := AllocFor(e, mib, 0, 0x11) // another stream: only outer accepts it
	require.NoError(t, err)
	pools, err := GraphPools(e)
	require.NoError(t, err)
	live := map[graphPoolID]int{}
	for _, p := range pools {
		live[graphPoolID(p.ID)] = p.LiveBlocks
	}
	assert.Equal(t, map[graphPoolID]int{inner: 1, outer: 1}, live)

	// Blocks a capture put in a private pool are found there by every
	// call, not only by free.
	require.NoError(t, RecordStreamFor(e, x, 0x20))
	info, err := LookupFor(e, x)
	require.NoError(t, err)
	assert.Equal(t, x, info.Addr)
	for _, a := range []uint64{x, y} {
		require.NoError(t, FreeFor(e, a))
	}
	require.NoError(t, endCapture(e, 0, inner))
	require.NoError(t, endCapture(e, 0, outer))
	require.NoError(t, releaseGraphPool(e, 0, inner))
	require.NoError(t, releaseGraphPool(e, 0, outer))
	closeEntry(t, e, be)
}

// A pool closed during its capture ends that capture: private pools of
// other pools that were kept only because a capture was under way go then,
// as after an endCapture.
func TestGraphPoolsOfOthersCloseWhenAClosingPoolEndsTheLastCapture(t *testing.T) {
	a, beA := newEntry(t, gocore.Config{Name: "a"})
	b, _ := newEntry(t, gocore.Config{Name: "b"})
	var released atomic.Int32
	idA, idB := graphPoolID{31, 0}, graphPoolID{32, 0}
	require.NoError(t, beginCapture(a, 0, idA, goFilter{stream: 0x10, released: &released}))
	x, err := AllocFor(a, mib, 0, 0x10)
	require.NoError(t, err)
	require.NoError(t, endCapture(a, 0, idA))
	require.NoError(t, releaseGraphPool(a, 0, idA))
	require.NoError(t, beginCapture(b, 0, idB, goFilter{stream: 0x20, released: &released}))
	require.NoError(t, FreeFor(a, x)) // a's private pool is done, but b captures
	pools, err := GraphPools(a)
	require.NoError(t, err)
	require.Len(t, pools, 1, "kept while a capture is under way")
	_, err = b.Pool.Close()
	require.NoError(t, err)
	_, err = CloseGraphPools(b)
	require.NoError(t, err)
	require.Zero(t, gocore.ProcessCaptures())
	pools, err = GraphPools(a)
	require.NoError(t, err)
	assert.Empty(t, pools)
	assert.Zero(t, beA.UsedBytes(0))
}

// The pool's limit, and a device limit (torch's memory fraction), hold for
// the pool and its graphs' private pools together.
func TestGraphPrivatePoolsCountAgainstThePoolsLimit(t *testing.T) {
	e, be := newEntry(t, gocore.Config{Name: "torch", Limit: 2 * mib})
	a, err := AllocFor(e, mib, 0, 0)
	require.NoError(t, err) // a 2 MiB small segment: the whole limit
	var released atomic.Int32
	id := graphPoolID{11, 0}
	require.NoError(t, beginCapture(e, 0, id, goFilter{stream: 0x10, released: &released}))
	_, err = AllocFor(e, mib, 0, 0x10)
	require.ErrorIs(t, err, gocore.ErrOutOfMemory, "the graph's pool would pass the limit")
	require.NoError(t, endCapture(e, 0, id))
	require.NoError(t, FreeFor(e, a))
	_, err = e.Pool.EmptyCache() // not during a capture: nothing is freed then
	require.NoError(t, err)
	require.NoError(t, beginCapture(e, 0, id, goFilter{stream: 0x10, released: &released}))
	b, err := AllocFor(e, mib, 0, 0x10)
	require.NoError(t, err)
	st, err := e.Pool.Stats(0)
	require.NoError(t, err)
	require.NoError(t, AddGraphStats(e, 0, &st))
	assert.LessOrEqual(t, st.ReservedBytes[0].Current, int64(2*mib))

	require.NoError(t, e.Pool.SetDeviceLimit(0, 4*mib)) // set_per_process_memory_fraction
	_, err = AllocFor(e, 64*mib, 0, 0x10)
	require.ErrorIs(t, err, gocore.ErrOutOfMemory)
	require.NoError(t, FreeFor(e, b))
	require.NoError(t, endCapture(e, 0, id))
	require.NoError(t, releaseGraphPool(e, 0, id))
	require.NoError(t, releaseGraphPool(e, 0, id))
	closeEntry(t, e, be)
}

// While torch captures a graph through one pool, no other pool of the
// process frees memory or queries events either: in CUDA's global capture
// mode (torch's default) either would invalidate the capture.
func TestOtherPoolsHoldTheirMemoryDuringACapture(t *testing.T) {
	a, _ := newEntry(t, gocore.Config{Name: "a"})
	b, beB := newSimEntry(t, gocore.SimConfig{Capacity: 1 << 30, ManualEvents: true},
		gocore.Config{Name: "b", ReleaseThreshold: 1})
	x, err := AllocFor(b, mib, 0, 0)
	require.NoError(t, err)
	y, err := AllocFor(b, 30*mib, 0, 0)
	require.NoError(t, err)
	require.NoError(t, b.Pool.RecordStream(y, 7))
	var released atomic.Int32
	id := graphPoolID{51, 0}
	require.NoError(t, beginCapture(a, 0, id, goFilter{stream: 0x10, released: &released}))
	frees := beB.Stats().Frees
	require.NoError(t, FreeFor(b, x)) // over b's release threshold
	require.NoError(t, FreeFor(b, y)) // waits for stream 7
	beB.CompleteAll()
	_, err = b.Pool.EmptyCache()
	require.NoError(t, err)
	waiting, err := b.Pool.ProcessEvents()
	require.NoError(t, err)
	assert.Equal(t, 1, waiting, "y's event is not even queried")
	assert.Equal(t, frees, beB.Stats().Frees, "pool b gave memory back while pool a captures")
	assert.EqualValues(t, 0, beB.Stats().EventsCreated, "no event recorded during the capture either")
	require.NoError(t, endCapture(a, 0, id))
	waiting, err = b.Pool.ProcessEvents() // y's event is recorded now
	require.NoError(t, err)
	assert.Equal(t, 1, waiting)
	assert.EqualValues(t, 1, beB.Stats().EventsCreated)
	beB.CompleteAll()
	_, err = b.Pool.EmptyCache() // (the release threshold may take them first)
	require.NoError(t, err)
	assert.Zero(t, beB.UsedBytes(0), "after the capture everything goes")
	require.NoError(t, releaseGraphPool(a, 0, id))
}

// refusingPool is a pool named name over a simulated device whose frees a
// test can refuse (refusingFree.refuse).
func refusingPool(t *testing.T, name string) (*gocore.Pool, *refusingFree, *gocore.SimBackend) {
	t.Helper()
	sim, err := gocore.NewSimBackend(gocore.SimConfig{Capacity: 1 << 30})
	require.NoError(t, err)
	be := &refusingFree{SimBackend: sim}
	p, err := gocore.NewPool(gocore.Config{Name: name, Backend: be})
	require.NoError(t, err)
	return p, be, sim
}

// closeRefusingGraphPool allocates in graph pool id of e (a capture on
// stream 0x10) and closes e's pool while the backend refuses frees: the
// graph pool's segment lingers.
func closeRefusingGraphPool(t *testing.T, e *registry.Entry, be *refusingFree, id graphPoolID) {
	t.Helper()
	var released atomic.Int32
	require.NoError(t, beginCapture(e, 0, id, goFilter{stream: 0x10, released: &released}))
	_, err := AllocFor(e, mib, 0, 0x10)
	require.NoError(t, err)
	be.refuse.Store(true)
	_, err = e.Pool.Close()
	require.NoError(t, err)
	_, err = CloseGraphPools(e)
	require.ErrorContains(t, err, "refused")
}

// A pool that closes while the backend refuses its graph pools' segments
// leaves them lingering: a later sweep gives them back.
func TestGraphPoolSegmentsRefusedWhenThePoolClosesLinger(t *testing.T) {
	p, be, sim := refusingPool(t, "torch")
	e := registry.Add(p, sim, nil)
	t.Cleanup(func() { registry.Remove(e.ID) })
	closeRefusingGraphPool(t, e, be, graphPoolID{0, 77})
	require.NotZero(t, sim.UsedBytes(0))
	be.refuse.Store(false)
	n, err := sweepFreeable(nil)
	require.NoError(t, err)
	assert.Equal(t, 1, n)
	assert.Zero(t, sim.UsedBytes(0))
}

// A pool closed during its own capture: the backend refuses its private
// pools' segments while the stream still captures (the CUDA backends'
// ErrCaptureUnderway). When torch then ends the allocation to the pool, on
// a slot no pool holds any more, they go back; before, they waited for
// another pool's sweep.
func TestGraphPoolSegmentsOfAPoolClosedDuringItsCaptureGoBackAtItsEnd(t *testing.T) {
	p, be, sim := refusingPool(t, "torch")
	e := registry.Add(p, sim, nil)
	slot, err := registry.AssignSlot(e)
	require.NoError(t, err)
	removed := false
	t.Cleanup(func() {
		if !removed {
			registry.Remove(e.ID)
		}
	})
	id := graphPoolID{0, 78}
	closeRefusingGraphPool(t, e, be, id) // refused: the capture still runs
	registry.Remove(e.ID)                // the slot goes with the pool
	removed = true
	require.NotZero(t, sim.UsedBytes(0))
	be.refuse.Store(false) // the capture ended; torch ends the allocation to the pool
	graphEnd(slot, 0, id)
	assert.Zero(t, sim.UsedBytes(0), "the refused segments went back")
}

// blockingFree is a sim backend whose frees wait until they are let go.
type blockingFree struct {
	*gocore.SimBackend
	entered chan struct{}
	letGo   chan struct{}
}

func (b *blockingFree) Free(device int, addr, size uint64, stream gocore.Stream) error {
	b.entered <- struct{}{}
	<-b.letGo
	return b.SimBackend.Free(device, addr, size, stream)
}

// retryLingering frees outside its lock: while a backend free waits (for a
// device, say), other pools can still add their lingering pools.
func TestRetryLingeringFreesOutsideItsLock(t *testing.T) {
	p, be, sim := refusingPool(t, "lingering")
	_, err := p.Alloc(mib, 0, 0)
	require.NoError(t, err)
	be.refuse.Store(true)
	_, err = p.Close()
	require.Error(t, err)
	// p lingers later; p2, on a backend whose free waits, lingers now.
	blocking := &blockingFree{SimBackend: sim, entered: make(chan struct{}), letGo: make(chan struct{})}
	be.refuse.Store(false)
	p2, err := gocore.NewPool(gocore.Config{Name: "blocking", Backend: blocking})
	require.NoError(t, err)
	_, err = p2.Alloc(mib, 0, 0)
	require.NoError(t, err)
	lingeringMu.Lock()
	lingering = append(lingering, p2)
	lingeringMu.Unlock()
	p2closing := make(chan struct{})
	go func() { // retryUnreleased closes p2, which frees its segment
		defer close(p2closing)
		_, _ = retryLingering()
	}()
	<-blocking.entered // the retry is inside the backend's free
	free := lingeringMu.TryLock()
	if free {
		lingering = append(lingering, p) // another pool adds its refused segments meanwhile
		lingeringMu.Unlock()
	}
	close(blocking.letGo)
	<-p2closing
	require.True(t, free, "retryLingering held its lock while the backend freed")
	n, err := retryLingering()
	require.NoError(t, err)
	assert.Equal(t, 1, n)
	assert.Zero(t, sim.UsedBytes(0))
	lingeringMu.Lock()
	assert.Empty(t, lingering)
	lingeringMu.Unlock()
}
