package graphpool

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/sim"
	"github.com/gpumempool/gpumempool/gocore/simtest"
)

const mib = 1 << 20

// goFilter accepts one stream, like torch.cuda.graph's filter accepts the
// stream it captures; it counts its releases.
func goFilter(stream gocore.Stream, released *atomic.Int32) Filter {
	return Filter{
		Accepts: func(s gocore.Stream) bool { return s == stream },
		Release: func() { released.Add(1) },
	}
}

// newPools is a Pools over a pool with cfg on a 1 GiB simulated device.
func newPools(t *testing.T, cfg gocore.Config) (*Pools, *sim.Backend) {
	t.Helper()
	return newSimPools(t, sim.Config{Capacity: 1 << 30}, cfg)
}

// newSimPools is a Pools over a pool with cfg on a simulated device.
func newSimPools(t *testing.T, device sim.Config, cfg gocore.Config) (*Pools, *sim.Backend) {
	t.Helper()
	be, err := sim.New(device)
	require.NoError(t, err)
	cfg.Backend = be
	p, err := gocore.NewPool(cfg)
	require.NoError(t, err)
	return register(t, p), be
}

// register is New(p), out of the process's active set after the test
// (a test that closes nothing leaves nothing for the next one's sweeps).
func register(t *testing.T, p *gocore.Pool) *Pools {
	t.Helper()
	g := New(p)
	t.Cleanup(func() {
		activeMu.Lock()
		delete(active, g)
		activeMu.Unlock()
	})
	return g
}

// Threads allocate and free on captured and uncaptured streams while
// captures begin and end: no block is ever live twice, blocks allocated on
// a captured stream come from its private pool, and once every graph is
// released all memory is back (run with -race).
func TestGraphRoutingUnderConcurrency(t *testing.T) {
	g, be := newPools(t, gocore.Config{Name: "torch"})
	var released atomic.Int32
	const workers, rounds = 8, 300
	var live sync.Map // addr -> worker
	var wg sync.WaitGroup
	var violations atomic.Int32
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			stream := gocore.Stream(0x100 + w%2) // streams 0x100 (captured) and 0x101
			for i := range rounds {
				size := uint64(512 * (1 + (i*7+w)%64))
				addr, err := g.Alloc(0, size, stream)
				if !assert.NoError(t, err) {
					return
				}
				if _, dup := live.LoadOrStore(addr, w); dup {
					violations.Add(1)
				}
				live.Delete(addr)
				if !assert.NoError(t, g.Free(addr)) {
					return
				}
			}
		}()
	}
	wg.Add(1)
	go func() { // graphs come and go
		defer wg.Done()
		for i := range 50 {
			id := ID{uint64(i + 1), 0}
			assert.NoError(t, g.BeginCapture(0, id, goFilter(0x100, &released)))
			assert.NoError(t, g.EndCapture(0, id))
			assert.NoError(t, g.Release(0, id))
		}
	}()
	wg.Wait()
	assert.Zero(t, violations.Load(), "a block was handed out while live")
	assert.EqualValues(t, 50, released.Load(), "every filter released")
	pools, err := g.List()
	require.NoError(t, err)
	assert.Empty(t, pools, "released pools close once their blocks are freed")
	assert.Zero(t, g.privateLive.Load())
	assert.Zero(t, gocore.ProcessCaptures())
	require.NoError(t, g.main.CheckInvariants())
	st, err := g.main.Stats(-1)
	require.NoError(t, err)
	assert.EqualValues(t, st.ReservedBytes[0].Current, be.UsedBytes(0), "the backend holds only the pool's own segments")
	_, err = g.main.Close()
	require.NoError(t, err)
	rep, err := g.ClosePrivate()
	require.NoError(t, err)
	assert.Empty(t, rep.LiveBlocks)
	assert.Zero(t, be.UsedBytes(0))
}

// A capture's blocks stay private until release, across frees, and a
// capture of one stream leaves other streams and devices alone.
func TestGraphPrivatePoolLifecycle(t *testing.T) {
	g, be := newPools(t, gocore.Config{Name: "torch", ReleaseThreshold: 1})
	var released atomic.Int32
	s1, s2 := gocore.Stream(0x1), gocore.Stream(0x2) // cudaStreamLegacy and cudaStreamPerThread
	id := ID{7, 1}
	require.NoError(t, g.BeginCapture(0, id, goFilter(0x1, &released)))
	a, err := g.Alloc(0, mib, s1)
	require.NoError(t, err)
	b, err := g.Alloc(0, mib, s2)
	require.NoError(t, err)
	_, err = g.main.Lookup(a)
	require.ErrorIs(t, err, gocore.ErrUnknownPointer, "a is the private pool's")
	_, err = g.main.Lookup(b)
	require.NoError(t, err, "b, on another stream, is the pool's")
	require.NotNil(t, g.owning(a), "a private pool holds a")
	info, err := g.Lookup(a)
	require.NoError(t, err)
	assert.Equal(t, a, info.Addr)

	require.NoError(t, g.EndCapture(0, id))
	assert.EqualValues(t, 1, released.Load())
	require.ErrorContains(t, g.EndCapture(0, id), "no allocation to this pool was begun")
	require.NoError(t, g.Free(a))
	pools, err := g.List()
	require.NoError(t, err)
	require.Len(t, pools, 1)
	assert.EqualValues(t, 2*mib, pools[0].ReservedBytes, "kept despite the release threshold: a replay writes it")
	c, err := g.Alloc(0, mib, s1)
	require.NoError(t, err)
	assert.NotEqual(t, a, c, "after the capture, stream 1 is served by the pool, never with the graph's block")

	var st gocore.Stats
	require.NoError(t, g.AddStats(0, &st))
	assert.EqualValues(t, 2*mib, st.ReservedBytes[0].Current)
	require.NoError(t, g.Release(0, id))
	pools, err = g.List()
	require.NoError(t, err)
	assert.Empty(t, pools)
	st = gocore.Stats{}
	require.NoError(t, g.AddStats(-1, &st))
	assert.Zero(t, st.ReservedBytes[0].Current)
	assert.EqualValues(t, 2*mib, st.ReservedBytes[0].Peak, "the retired pool's history stays")
	assert.EqualValues(t, 1, st.NumDeviceFree)

	require.NoError(t, g.Free(b))
	require.NoError(t, g.Free(c))
	_, err = g.main.Close()
	require.NoError(t, err)
	_, err = g.ClosePrivate()
	require.NoError(t, err)
	assert.Zero(t, be.UsedBytes(0))
}

// One torch pool id used on two devices is two private pools, begun, ended
// and released per device.
func TestGraphPoolsArePerDevice(t *testing.T) {
	be, err := sim.New(sim.Config{Devices: 2, Capacity: 1 << 30})
	require.NoError(t, err)
	p, err := gocore.NewPool(gocore.Config{Name: "torch", Backend: be})
	require.NoError(t, err)
	g := register(t, p)
	var released atomic.Int32
	id := ID{3, 0}
	require.NoError(t, g.BeginCapture(0, id, goFilter(0x5, &released)))
	require.NoError(t, g.BeginCapture(1, id, goFilter(0x5, &released)))
	a0, err := g.Alloc(0, mib, 0x5)
	require.NoError(t, err)
	a1, err := g.Alloc(1, 3*mib, 0x5)
	require.NoError(t, err)
	require.NoError(t, g.EndCapture(1, id))
	pools, err := g.List()
	require.NoError(t, err)
	require.Len(t, pools, 2)
	assert.Equal(t, 0, pools[0].Device)
	assert.True(t, pools[0].Capturing)
	assert.Equal(t, 1, pools[1].Device)
	assert.False(t, pools[1].Capturing, "device 1's capture ended")
	assert.EqualValues(t, 20*mib, pools[1].ReservedBytes) // a 1-10 MiB request gets a 20 MiB segment, as in torch
	require.NoError(t, g.Free(a1))
	require.NoError(t, g.Release(1, id))
	pools, err = g.List()
	require.NoError(t, err)
	require.Len(t, pools, 2, "device 1's pool waits: device 0 still captures, and freeing memory would break that")
	assert.True(t, pools[1].Released)
	require.NoError(t, g.EndCapture(0, id))
	pools, err = g.List()
	require.NoError(t, err)
	require.Len(t, pools, 1, "device 0's pool stays")
	assert.Zero(t, be.UsedBytes(1))
	require.NoError(t, g.Free(a0))
	require.NoError(t, g.Release(0, id))
	assert.EqualValues(t, 2, released.Load())
	_, err = p.Close()
	require.NoError(t, err)
	_, err = g.ClosePrivate()
	require.NoError(t, err)
	assert.Zero(t, be.UsedBytes(0)+be.UsedBytes(1))
}

// closePools closes g's pool and private pools and checks the backend holds
// nothing any more.
func closePools(t *testing.T, g *Pools, be *sim.Backend) {
	t.Helper()
	_, err := g.main.Close()
	require.NoError(t, err)
	_, err = g.ClosePrivate()
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
	g, be := newPools(t, gocore.Config{Name: "torch"})
	var released atomic.Int32
	id := ID{0, 42}
	capture := func() (out, tmp uint64) {
		require.NoError(t, g.BeginCapture(0, id, goFilter(0x10, &released)))
		out, err := g.Alloc(0, mib, 0x10)
		require.NoError(t, err)
		tmp, err = g.Alloc(0, mib, 0x10)
		require.NoError(t, err)
		require.NoError(t, g.Free(tmp)) // a temporary of the graph
		require.NoError(t, g.EndCapture(0, id))
		return out, tmp
	}
	out1, _ := capture()
	out2, tmp2 := capture()
	require.NoError(t, g.Release(0, id)) // g1 reset; g2 lives
	require.NoError(t, g.Free(out1))
	require.NoError(t, g.Free(out2))
	pools, err := g.List()
	require.NoError(t, err)
	require.Len(t, pools, 1, "g2 still uses the pool")
	assert.False(t, pools[0].Released)
	x, err := g.Alloc(0, mib, 0x99)
	require.NoError(t, err)
	assert.NotEqual(t, tmp2, x)
	require.NoError(t, g.Release(0, id)) // g2 reset
	pools, err = g.List()
	require.NoError(t, err)
	assert.Empty(t, pools, "no user and no block left: closed")
	require.NoError(t, g.Release(0, id), "a release with no user left (MemPool's destructor) is harmless")
	require.NoError(t, g.Free(x))
	closePools(t, g, be)
}

// torch.cuda.use_mem_pool begins and, at exit, releases: a MemPool entered
// twice keeps its blocks private in between and takes them back on reentry.
func TestGraphPoolReenteredAfterRelease(t *testing.T) {
	g, be := newPools(t, gocore.Config{Name: "torch"})
	var released atomic.Int32
	id := ID{1, 7}
	enter := func() uint64 {
		require.NoError(t, g.BeginCapture(0, id, goFilter(0x10, &released)))
		a, err := g.Alloc(0, mib, 0x10)
		require.NoError(t, err)
		require.NoError(t, g.EndCapture(0, id))
		require.NoError(t, g.Release(0, id))
		return a
	}
	a := enter()
	pools, err := g.List()
	require.NoError(t, err)
	require.Len(t, pools, 1)
	assert.True(t, pools[0].Released, "no user, but a live block")
	b := enter()
	require.NoError(t, g.Free(a))
	pools, err = g.List()
	require.NoError(t, err)
	require.Len(t, pools, 1, "b lives")
	require.NoError(t, g.Free(b))
	pools, err = g.List()
	require.NoError(t, err)
	assert.Empty(t, pools)
	closePools(t, g, be)
}

// Freeing memory during a capture invalidates it: a pool no graph uses any
// more whose last block is freed while another graph is captured is closed
// only when that capture ends.
func TestGraphPoolNotClosedDuringCapture(t *testing.T) {
	g, be := newPools(t, gocore.Config{Name: "torch"})
	var released atomic.Int32
	p1, p2 := ID{1, 0}, ID{2, 0}
	require.NoError(t, g.BeginCapture(0, p1, goFilter(0x10, &released)))
	x, err := g.Alloc(0, mib, 0x10)
	require.NoError(t, err)
	require.NoError(t, g.EndCapture(0, p1))
	require.NoError(t, g.Release(0, p1)) // g1 gone, its output x lives
	require.NoError(t, g.BeginCapture(0, p2, goFilter(0x20, &released)))
	frees := be.Stats().Frees
	require.NoError(t, g.Free(x))
	assert.Equal(t, frees, be.Stats().Frees, "no backend free during a capture")
	require.NoError(t, g.EndCapture(0, p2))
	assert.Equal(t, frees+1, be.Stats().Frees, "freed when the capture ended")
	pools, err := g.List()
	require.NoError(t, err)
	assert.Empty(t, pools)
	require.NoError(t, g.Release(0, p2))
	closePools(t, g, be)
}

// A private block used on another stream and freed keeps its segment until
// that stream's work is done; then empty_cache, or an allocation that would
// otherwise run out of memory, gives it back.
func TestGraphPoolWaitsForEvents(t *testing.T) {
	g, be := newSimPools(t, sim.Config{Capacity: 20 * mib, ManualEvents: true}, gocore.Config{Name: "torch"})
	var released atomic.Int32
	id := ID{5, 0}
	require.NoError(t, g.BeginCapture(0, id, goFilter(0x10, &released)))
	x, err := g.Alloc(0, 12*mib, 0x10)
	require.NoError(t, err)
	require.NoError(t, g.EndCapture(0, id))
	require.NotNil(t, g.owning(x), "x is the private pool's")
	require.NoError(t, g.RecordStream(x, 0x30))
	require.NoError(t, g.Release(0, id))
	require.NoError(t, g.Free(x))
	assert.EqualValues(t, 12*mib, be.UsedBytes(0), "stream 0x30 may still use x")
	_, err = g.EmptyCache()
	require.NoError(t, err)
	assert.EqualValues(t, 12*mib, be.UsedBytes(0), "still: its event has not completed")
	_, err = g.Alloc(0, 12*mib, 0)
	require.ErrorIs(t, err, gocore.ErrOutOfMemory, "the private segment is still busy")
	be.CompleteStream(0x30)
	y, err := g.Alloc(0, 12*mib, 0)
	require.NoError(t, err, "the out-of-memory path closes the idle private pool first")
	pools, err := g.List()
	require.NoError(t, err)
	assert.Empty(t, pools)
	require.NoError(t, g.Free(y))
	closePools(t, g, be)
}

// A beginAllocateToPool that reaches a pool closed from another thread (torch
// read the slot just before) is refused: no private pool revives, the
// filter is released, no capture stays counted.
func TestGraphBeginAfterClose(t *testing.T) {
	g, be := newPools(t, gocore.Config{Name: "torch"})
	closePools(t, g, be)
	var released atomic.Int32
	before := gocore.ProcessCaptures()
	err := g.BeginCapture(0, ID{9, 0}, goFilter(0x10, &released))
	require.ErrorIs(t, err, gocore.ErrClosed)
	assert.EqualValues(t, 1, released.Load())
	assert.Equal(t, before, gocore.ProcessCaptures())
	activeMu.Lock()
	_, joined := active[g]
	activeMu.Unlock()
	assert.False(t, joined, "a closed Pools is not swept")
	_, err = g.Alloc(0, mib, 0x10)
	require.ErrorIs(t, err, gocore.ErrClosed)

	// The same race, with the private pools closed between BeginCapture's
	// join and its lock.
	g2, _ := newPools(t, gocore.Config{Name: "torch2"})
	_, err = g2.ClosePrivate()
	require.NoError(t, err)
	activeMu.Lock()
	g2.left = false // as if torch's thread had joined before the close
	activeMu.Unlock()
	err = g2.BeginCapture(0, ID{9, 0}, goFilter(0x10, &released))
	require.ErrorIs(t, err, gocore.ErrClosed)
	assert.EqualValues(t, 2, released.Load())
	assert.Equal(t, before, gocore.ProcessCaptures())

	// And with the main pool closed, its private pools not yet.
	g3, _ := newPools(t, gocore.Config{Name: "torch3"})
	_, err = g3.main.Close()
	require.NoError(t, err)
	err = g3.BeginCapture(0, ID{9, 0}, goFilter(0x10, &released))
	require.ErrorIs(t, err, gocore.ErrClosed)
	assert.EqualValues(t, 3, released.Load())
	assert.Equal(t, before, gocore.ProcessCaptures())
}

// A private pool that is done closes before any capture can begin anywhere
// in the process: a capture of another pool that starts while the close
// runs waits for it (captureGate), so no segment is freed during it.
func TestPrivatePoolCloseHoldsOffOtherCaptures(t *testing.T) {
	a, _ := newPools(t, gocore.Config{Name: "a"})
	b, _ := newPools(t, gocore.Config{Name: "b"})
	var released atomic.Int32
	idA, idB := ID{1, 1}, ID{2, 1}
	require.NoError(t, a.BeginCapture(0, idA, goFilter(0x100, &released)))
	addr, err := a.Alloc(0, mib, 0x100)
	require.NoError(t, err)
	require.NoError(t, a.EndCapture(0, idA))
	require.NoError(t, a.Release(0, idA)) // done but for addr

	begun := make(chan error, 1)
	var beganDuringClose atomic.Bool
	testHookBeforePrivateClose = func() {
		go func() { begun <- b.BeginCapture(0, idB, goFilter(0x200, &released)) }()
		select {
		case err := <-begun:
			beganDuringClose.Store(true)
			begun <- err
		case <-time.After(100 * time.Millisecond):
		}
	}
	t.Cleanup(func() { testHookBeforePrivateClose = nil })
	require.NoError(t, a.Free(addr)) // the last block: a's private pool closes
	testHookBeforePrivateClose = nil
	assert.False(t, beganDuringClose.Load(), "a capture began while a private pool was being closed")
	require.NoError(t, <-begun)
	pools, err := a.List()
	require.NoError(t, err)
	assert.Empty(t, pools, "a's private pool closed")
	require.NoError(t, b.EndCapture(0, idB))
	require.NoError(t, b.Release(0, idB))
	assert.Zero(t, gocore.ProcessCaptures())
}

// A private pool whose segments the backend refuses when it closes keeps
// them for later: the next sweep gives them back, or else the pool's close.
func TestGraphPoolSegmentsRefusedAtCloseAreRetried(t *testing.T) {
	for _, retryBy := range []string{"sweep", "close"} {
		t.Run(retryBy, func(t *testing.T) {
			p, be, sim := simtest.NewRefusingPool(t, "torch")
			g := register(t, p)
			var released atomic.Int32
			id := ID{0, 9}
			require.NoError(t, g.BeginCapture(0, id, goFilter(0x10, &released)))
			a, err := g.Alloc(0, mib, 0x10)
			require.NoError(t, err)
			require.NoError(t, g.EndCapture(0, id))
			require.NoError(t, g.Release(0, id))
			be.Refuse.Store(true)
			require.ErrorContains(t, g.Free(a), "refused", "the private pool closes; its segment stays")
			pools, err := g.List()
			require.NoError(t, err)
			assert.Empty(t, pools)
			require.NotZero(t, sim.UsedBytes(0))
			be.Refuse.Store(false)
			if retryBy == "sweep" {
				n, err := g.Sweep()
				require.NoError(t, err)
				assert.Equal(t, 1, n)
				assert.Zero(t, sim.UsedBytes(0))
			}
			_, err = g.main.Close()
			require.NoError(t, err)
			_, err = g.ClosePrivate()
			require.NoError(t, err)
			assert.Zero(t, sim.UsedBytes(0))
		})
	}
}

// allFilter accepts every stream, like the filter of torch.cuda.use_mem_pool
// on torch 2.5-2.7 (_cuda_beginAllocateToPool).
func allFilter(released *atomic.Int32) Filter {
	return Filter{Accepts: func(gocore.Stream) bool { return true }, Release: func() { released.Add(1) }}
}

// A graph captured inside use_mem_pool (or nested use_mem_pool blocks):
// the innermost capture accepting the stream gets the allocation, as in
// torch since 2.10, or the graph's temporaries would live in the enclosing
// MemPool's pool and be handed to later tensors while replays write them.
func TestGraphInnermostCaptureWins(t *testing.T) {
	g, be := newPools(t, gocore.Config{Name: "torch"})
	var released atomic.Int32
	outer, inner := ID{0, 1}, ID{21, 0}
	require.NoError(t, g.BeginCapture(0, outer, allFilter(&released)))
	require.NoError(t, g.BeginCapture(0, inner, goFilter(0x10, &released)))
	x, err := g.Alloc(0, mib, 0x10) // the graph's stream: inner
	require.NoError(t, err)
	y, err := g.Alloc(0, mib, 0x11) // another stream: only outer accepts it
	require.NoError(t, err)
	pools, err := g.List()
	require.NoError(t, err)
	live := map[ID]int{}
	for _, p := range pools {
		live[ID(p.ID)] = p.LiveBlocks
	}
	assert.Equal(t, map[ID]int{inner: 1, outer: 1}, live)

	// Blocks a capture put in a private pool are found there by every
	// call, not only by free.
	require.NoError(t, g.RecordStream(x, 0x20))
	info, err := g.Lookup(x)
	require.NoError(t, err)
	assert.Equal(t, x, info.Addr)
	for _, a := range []uint64{x, y} {
		require.NoError(t, g.Free(a))
	}
	require.NoError(t, g.EndCapture(0, inner))
	require.NoError(t, g.EndCapture(0, outer))
	require.NoError(t, g.Release(0, inner))
	require.NoError(t, g.Release(0, outer))
	closePools(t, g, be)
}

// A pool closed during its capture ends that capture: private pools of
// other pools that were kept only because a capture was under way go then,
// as after an endCapture.
func TestGraphPoolsOfOthersCloseWhenAClosingPoolEndsTheLastCapture(t *testing.T) {
	a, beA := newPools(t, gocore.Config{Name: "a"})
	b, _ := newPools(t, gocore.Config{Name: "b"})
	var released atomic.Int32
	idA, idB := ID{31, 0}, ID{32, 0}
	require.NoError(t, a.BeginCapture(0, idA, goFilter(0x10, &released)))
	x, err := a.Alloc(0, mib, 0x10)
	require.NoError(t, err)
	require.NoError(t, a.EndCapture(0, idA))
	require.NoError(t, a.Release(0, idA))
	require.NoError(t, b.BeginCapture(0, idB, goFilter(0x20, &released)))
	require.NoError(t, a.Free(x)) // a's private pool is done, but b captures
	pools, err := a.List()
	require.NoError(t, err)
	require.Len(t, pools, 1, "kept while a capture is under way")
	_, err = b.main.Close()
	require.NoError(t, err)
	_, err = b.ClosePrivate()
	require.NoError(t, err)
	require.Zero(t, gocore.ProcessCaptures())
	pools, err = a.List()
	require.NoError(t, err)
	assert.Empty(t, pools)
	assert.Zero(t, beA.UsedBytes(0))
}

// The pool's limit, and a device limit (torch's memory fraction), hold for
// the pool and its graphs' private pools together.
func TestGraphPrivatePoolsCountAgainstThePoolsLimit(t *testing.T) {
	g, be := newPools(t, gocore.Config{Name: "torch", Limit: 2 * mib})
	a, err := g.Alloc(0, mib, 0)
	require.NoError(t, err) // a 2 MiB small segment: the whole limit
	var released atomic.Int32
	id := ID{11, 0}
	require.NoError(t, g.BeginCapture(0, id, goFilter(0x10, &released)))
	_, err = g.Alloc(0, mib, 0x10)
	require.ErrorIs(t, err, gocore.ErrOutOfMemory, "the graph's pool would pass the limit")
	require.NoError(t, g.EndCapture(0, id))
	require.NoError(t, g.Free(a))
	_, err = g.main.EmptyCache() // not during a capture: nothing is freed then
	require.NoError(t, err)
	require.NoError(t, g.BeginCapture(0, id, goFilter(0x10, &released)))
	b, err := g.Alloc(0, mib, 0x10)
	require.NoError(t, err)
	st, err := g.main.Stats(0)
	require.NoError(t, err)
	require.NoError(t, g.AddStats(0, &st))
	assert.LessOrEqual(t, st.ReservedBytes[0].Current, int64(2*mib))

	require.NoError(t, g.main.SetDeviceLimit(0, 4*mib)) // set_per_process_memory_fraction
	_, err = g.Alloc(0, 64*mib, 0x10)
	require.ErrorIs(t, err, gocore.ErrOutOfMemory)
	require.NoError(t, g.Free(b))
	require.NoError(t, g.EndCapture(0, id))
	require.NoError(t, g.Release(0, id))
	require.NoError(t, g.Release(0, id))
	closePools(t, g, be)
}

// While torch captures a graph through one pool, no other pool of the
// process frees memory or queries events either: in CUDA's global capture
// mode (torch's default) either would invalidate the capture.
func TestOtherPoolsHoldTheirMemoryDuringACapture(t *testing.T) {
	a, _ := newPools(t, gocore.Config{Name: "a"})
	b, beB := newSimPools(t, sim.Config{Capacity: 1 << 30, ManualEvents: true},
		gocore.Config{Name: "b", ReleaseThreshold: 1})
	x, err := b.Alloc(0, mib, 0)
	require.NoError(t, err)
	y, err := b.Alloc(0, 30*mib, 0)
	require.NoError(t, err)
	require.NoError(t, b.main.RecordStream(y, 7))
	var released atomic.Int32
	id := ID{51, 0}
	require.NoError(t, a.BeginCapture(0, id, goFilter(0x10, &released)))
	frees := beB.Stats().Frees
	require.NoError(t, b.Free(x)) // over b's release threshold
	require.NoError(t, b.Free(y)) // waits for stream 7
	beB.CompleteAll()
	_, err = b.main.EmptyCache()
	require.NoError(t, err)
	waiting, err := b.main.ProcessEvents()
	require.NoError(t, err)
	assert.Equal(t, 1, waiting, "y's event is not even queried")
	assert.Equal(t, frees, beB.Stats().Frees, "pool b gave memory back while pool a captures")
	assert.EqualValues(t, 0, beB.Stats().EventsCreated, "no event recorded during the capture either")
	require.NoError(t, a.EndCapture(0, id))
	waiting, err = b.main.ProcessEvents() // y's event is recorded now
	require.NoError(t, err)
	assert.Equal(t, 1, waiting)
	assert.EqualValues(t, 1, beB.Stats().EventsCreated)
	beB.CompleteAll()
	_, err = b.main.EmptyCache() // (the release threshold may take them first)
	require.NoError(t, err)
	assert.Zero(t, beB.UsedBytes(0), "after the capture everything goes")
	require.NoError(t, a.Release(0, id))
}

// closeRefusingGraphPool allocates in graph pool id of g (a capture on
// stream 0x10) and closes g's pool while the backend refuses frees: the
// graph pool's segment lingers.
func closeRefusingGraphPool(t *testing.T, g *Pools, be *simtest.RefusingFree, id ID) {
	t.Helper()
	var released atomic.Int32
	require.NoError(t, g.BeginCapture(0, id, goFilter(0x10, &released)))
	_, err := g.Alloc(0, mib, 0x10)
	require.NoError(t, err)
	be.Refuse.Store(true)
	_, err = g.main.Close()
	require.NoError(t, err)
	_, err = g.ClosePrivate()
	require.ErrorContains(t, err, "refused")
}

// A pool that closes while the backend refuses its graph pools' segments
// leaves them lingering: a later sweep gives them back.
func TestGraphPoolSegmentsRefusedWhenThePoolClosesLinger(t *testing.T) {
	p, be, sim := simtest.NewRefusingPool(t, "torch")
	g := register(t, p)
	closeRefusingGraphPool(t, g, be, ID{0, 77})
	require.NotZero(t, sim.UsedBytes(0))
	be.Refuse.Store(false)
	n, err := SweepAll()
	require.NoError(t, err)
	assert.Equal(t, 1, n)
	assert.Zero(t, sim.UsedBytes(0))
}

// A pool closed during its own capture: the backend refuses its private
// pools' segments while the stream still captures (the CUDA backends'
// ErrCaptureUnderway). Once the capture ended, RetryLingering gives them
// back (the C ABI calls it when torch ends the allocation to a pool that is
// gone); before, they waited for another pool's sweep.
func TestGraphPoolSegmentsOfAPoolClosedDuringItsCaptureGoBackAtItsEnd(t *testing.T) {
	p, be, sim := simtest.NewRefusingPool(t, "torch")
	g := register(t, p)
	closeRefusingGraphPool(t, g, be, ID{0, 78}) // refused: the capture still runs
	require.NotZero(t, sim.UsedBytes(0))
	be.Refuse.Store(false) // the capture ended
	n, err := RetryLingering()
	require.NoError(t, err)
	assert.Equal(t, 1, n)
	assert.Zero(t, sim.UsedBytes(0), "the refused segments went back")
}

// blockingFree is a sim backend whose frees wait until they are let go.
type blockingFree struct {
	*sim.Backend
	entered chan struct{}
	letGo   chan struct{}
}

func (b *blockingFree) Free(device int, addr, size uint64, stream gocore.Stream) error {
	b.entered <- struct{}{}
	<-b.letGo
	return b.Backend.Free(device, addr, size, stream)
}

// RetryLingering frees outside its lock: while a backend free waits (for a
// device, say), other pools can still add their lingering pools.
func TestRetryLingeringFreesOutsideItsLock(t *testing.T) {
	p, be, sim := simtest.NewRefusingPool(t, "lingering")
	_, err := p.Alloc(0, mib, 0)
	require.NoError(t, err)
	be.Refuse.Store(true)
	_, err = p.Close()
	require.Error(t, err)
	// p lingers later; p2, on a backend whose free waits, lingers now.
	blocking := &blockingFree{Backend: sim, entered: make(chan struct{}), letGo: make(chan struct{})}
	be.Refuse.Store(false)
	p2, err := gocore.NewPool(gocore.Config{Name: "blocking", Backend: blocking})
	require.NoError(t, err)
	_, err = p2.Alloc(0, mib, 0)
	require.NoError(t, err)
	lingeringMu.Lock()
	lingering = append(lingering, p2)
	lingeringMu.Unlock()
	p2closing := make(chan struct{})
	go func() { // retryUnreleased closes p2, which frees its segment
		defer close(p2closing)
		_, _ = RetryLingering()
	}()
	<-blocking.entered // the retry is inside the backend's free
	free := lingeringMu.TryLock()
	if free {
		lingering = append(lingering, p) // another pool adds its refused segments meanwhile
		lingeringMu.Unlock()
	}
	close(blocking.letGo)
	<-p2closing
	require.True(t, free, "RetryLingering held its lock while the backend freed")
	n, err := RetryLingering()
	require.NoError(t, err)
	assert.Equal(t, 1, n)
	assert.Zero(t, sim.UsedBytes(0))
	lingeringMu.Lock()
	assert.Empty(t, lingering)
	lingeringMu.Unlock()
}
