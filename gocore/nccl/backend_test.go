//go:build cgo

package nccl_test

import (
	"errors"
	"fmt"
	"math/rand"
	"runtime"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/nccl"
	"github.com/gpumempool/gpumempool/gocore/nccl/libnccl"
)

const mib = 1 << 20

func TestNewBackendArgs(t *testing.T) {
	lib, fake := freshLib(t)
	ev := newStubEvents(4)

	_, err := nccl.NewBackend(nil, nil, ev)
	assert.ErrorIs(t, err, gocore.ErrInvalidArgument)
	_, err = nccl.NewBackend(lib, nil, nil)
	assert.ErrorIs(t, err, gocore.ErrInvalidArgument)
	_, err = nccl.NewBackend(lib, nil, newStubEvents(0))
	assert.ErrorIs(t, err, gocore.ErrInvalidArgument)

	b, err := nccl.NewBackend(lib, &fakeCtx{fake: fake}, ev)
	require.NoError(t, err)
	assert.Equal(t, "nccl", b.Name())
	assert.Equal(t, 4, b.Devices(), "from the event source")
	assert.Equal(t, uint64(512), b.Alignment())
	assert.Same(t, lib, b.Lib())
}

func TestDelegatesEventsAndCapacity(t *testing.T) {
	s := newSetup(t)
	_, _, err := s.backend.Capacity(0)
	assert.ErrorIs(t, err, gocore.ErrUnsupported)
	s.events.total, s.events.free = 80<<30, 60<<30
	total, free, err := s.backend.Capacity(1)
	require.NoError(t, err)
	assert.Equal(t, [2]uint64{80 << 30, 60 << 30}, [2]uint64{total, free})

	s.events.busyQueries = 1
	ev, err := s.backend.NewEvent(1)
	require.NoError(t, err)
	require.NoError(t, s.backend.RecordEvent(ev, 9))
	done, err := s.backend.QueryEvent(ev)
	require.NoError(t, err)
	assert.False(t, done)
	done, err = s.backend.QueryEvent(ev)
	require.NoError(t, err)
	assert.True(t, done)
	require.NoError(t, s.backend.DestroyEvent(ev))
	created, destroyed, queries, streams := s.events.counts()
	assert.Equal(t, []int{1, 1, 2}, []int{created, destroyed, queries})
	assert.Equal(t, []gocore.Stream{9}, streams)
}

func TestPoolAllocCachesAndFrees(t *testing.T) {
	s := newSetup(t)
	p := s.pool(t)

	a, err := p.Alloc(0, mib, 0)
	require.NoError(t, err)
	assert.Equal(t, 1, s.fake.Calls())
	assert.Zero(t, a%512)
	assert.Equal(t, int64(2*mib), s.fake.LiveBytes(), "small requests share a 2 MiB segment")
	assert.Equal(t, []nccl.Segment{{Device: 0, Addr: a, Size: 2 * mib}}, s.backend.Segments())

	require.NoError(t, p.Free(a))
	b, err := p.Alloc(0, mib, 0)
	require.NoError(t, err)
	assert.Equal(t, a, b, "served from the cache")
	assert.Equal(t, 1, s.fake.Calls(), "no second ncclMemAlloc")
	require.NoError(t, p.Free(b))

	released, err := p.EmptyCache()
	require.NoError(t, err)
	assert.Equal(t, uint64(2*mib), released)
	assert.Equal(t, 1, s.fake.Frees())
	assert.Zero(t, s.fake.LiveBytes())
	assert.Empty(t, s.backend.Segments())

	// A block still live at Close is freed too.
	_, err = p.Alloc(1, 30*mib, 0)
	require.NoError(t, err)
	assert.Equal(t, 2, s.fake.Calls())
	report, err := p.Close()
	require.NoError(t, err)
	assert.Len(t, report.LiveBlocks, 1)
	assert.Zero(t, s.fake.LiveBytes())
	assert.Empty(t, s.backend.Segments())
	assert.Zero(t, s.fake.Balance(), "every push was popped")
}

func TestContextPushedForDevice(t *testing.T) {
	s := newSetup(t)
	p := s.pool(t)

	// On one locked thread, with the caller's own context current, the
	// calls must see the device's context and leave the caller's in place.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	depth := s.fake.Depth()
	require.Zero(t, s.fake.Push(0xcafe))
	defer s.fake.Pop()

	for _, dev := range []int{1, 0} {
		addr, err := p.Alloc(dev, 4*mib, 0)
		require.NoError(t, err)
		assert.Equal(t, ctxOf(dev), s.fake.LastCtx(), "device %d's context current during ncclMemAlloc", dev)
		assert.Equal(t, uintptr(0xcafe), s.fake.Current(), "popped after ncclMemAlloc")
		assert.Equal(t, depth+1, s.fake.Depth())

		require.NoError(t, p.Free(addr))
		_, err = p.EmptyCache()
		require.NoError(t, err)
		assert.Equal(t, ctxOf(dev), s.fake.LastFreeCtx(), "device %d's context current during ncclMemFree", dev)
		assert.Equal(t, uintptr(0xcafe), s.fake.Current(), "popped after ncclMemFree")
	}
	assert.Equal(t, 1, s.fake.Balance(), "only our own push is left")
}

func TestNilContextSource(t *testing.T) {
	lib, fake := freshLib(t)
	b, err := nccl.NewBackend(lib, nil, newStubEvents(4))
	require.NoError(t, err)
	assert.Equal(t, 1, b.Devices(), "without contexts only device 0")

	addr, err := b.Alloc(0, 2*mib, 0)
	require.NoError(t, err)
	assert.Zero(t, fake.LastCtx(), "nothing pushed")
	assert.Zero(t, fake.Balance())

	_, err = b.Alloc(1, 2*mib, 0)
	require.ErrorIs(t, err, gocore.ErrInvalidDevice)
	assert.Contains(t, err.Error(), "only device 0")
	assert.Equal(t, 1, fake.Calls())

	require.NoError(t, b.Free(0, addr, 2*mib, 0))
	assert.Zero(t, fake.LiveBytes())
}

func TestContextSourceErrors(t *testing.T) {
	s := newSetup(t)
	boom := errors.New("no context for you")
	s.ctx.err = boom
	_, err := s.backend.Alloc(1, 2*mib, 0)
	require.ErrorIs(t, err, boom)
	assert.NotErrorIs(t, err, gocore.ErrBackendOutOfMemory)
	assert.Contains(t, err.Error(), "device 1")

	s.ctx.err, s.ctx.zero = nil, true
	_, err = s.backend.Alloc(0, 2*mib, 0)
	require.ErrorIs(t, err, gocore.ErrInvalidArgument)
	assert.Zero(t, s.fake.Calls(), "NCCL never called")

	_, err = s.backend.Alloc(2, 2*mib, 0)
	require.ErrorIs(t, err, gocore.ErrInvalidDevice)
}

func TestOOMReleasesCacheRetriesThenFails(t *testing.T) {
	s := newSetup(t)
	p := s.pool(t)

	a, err := p.Alloc(0, 5*mib, 0) // a 20 MiB segment
	require.NoError(t, err)
	require.NoError(t, p.Free(a)) // cached

	s.fake.Fail(int(libnccl.UnhandledCudaError), 0)
	calls := s.fake.Calls()
	_, err = p.Alloc(0, 30*mib, 0)
	require.Error(t, err)

	var oom *gocore.OutOfMemoryError
	require.ErrorAs(t, err, &oom)
	assert.Equal(t, "nccl", oom.Backend)
	assert.Contains(t, err.Error(), "unhandled cuda error", "NCCL's text")
	assert.Contains(t, err.Error(), "ncclUnhandledCudaError = 1", "and code")
	var nerr *libnccl.Error
	require.ErrorAs(t, err, &nerr)
	assert.Equal(t, libnccl.Error{Func: "ncclMemAlloc", Code: libnccl.UnhandledCudaError,
		Text: "unhandled cuda error (run with NCCL_DEBUG=INFO for details)"}, *nerr)

	assert.Equal(t, calls+2, s.fake.Calls(), "one try and one retry")
	assert.Equal(t, 1, s.fake.Frees(), "the cache was released before the retry")
	assert.Zero(t, s.fake.LiveBytes())
	st, err := p.Stats(0)
	require.NoError(t, err)
	assert.Equal(t, int64(1), st.NumAllocRetries)
	assert.Equal(t, int64(1), st.NumOOMs)
}

func TestOOMRetrySucceedsAfterRelease(t *testing.T) {
	t.Setenv("FAKE_NCCL_CAPACITY", fmt.Sprint(48*mib))
	s := newSetup(t) // reads the capacity

	p := s.pool(t)
	a, err := p.Alloc(0, 5*mib, 0) // 20 MiB segment
	require.NoError(t, err)
	require.NoError(t, p.Free(a))
	b, err := p.Alloc(0, 30*mib, 0) // 20 + 30 > 48: fails until the cache goes
	require.NoError(t, err)
	assert.Equal(t, 3, s.fake.Calls())
	assert.Equal(t, 1, s.fake.Frees())
	assert.Equal(t, int64(30*mib), s.fake.LiveBytes())
	require.NoError(t, p.Free(b))
	_, err = p.Close()
	require.NoError(t, err)
	assert.Zero(t, s.fake.LiveBytes())
}

// NCCL reports every CUDA failure of ncclMemAlloc as ncclUnhandledCudaError;
// the warning it logs (ncclGetLastError) tells an out-of-memory apart from,
// say, a sticky error after a kernel fault, which no cache release can
// cure. Without a new warning the code decides, as before.
func TestLoggedWarningDecidesWhetherACudaFailureIsOOM(t *testing.T) {
	t.Setenv("FAKE_NCCL_CAPACITY", fmt.Sprint(16*mib))
	s := newSetup(t)
	t.Cleanup(func() { s.fake.FailText("") })
	p := s.pool(t)

	s.fake.FailText("Cuda failure 700 'an illegal memory access was encountered'")
	s.fake.Fail(int(libnccl.UnhandledCudaError), 0)
	calls := s.fake.Calls()
	_, err := p.Alloc(0, mib, 0)
	require.Error(t, err)
	assert.NotErrorIs(t, err, gocore.ErrOutOfMemory)
	assert.NotErrorIs(t, err, gocore.ErrBackendOutOfMemory)
	assert.Contains(t, err.Error(), "[ncclUnhandledCudaError = 1]: Cuda failure 700 'an illegal memory access was encountered'")
	assert.Equal(t, calls+1, s.fake.Calls(), "not retried")

	s.fake.Fail(0, 0)
	_, err = s.backend.Alloc(0, 30*mib, 0) // beyond the capacity: CUDA's OOM warning
	require.ErrorIs(t, err, gocore.ErrBackendOutOfMemory)
	var nerr *libnccl.Error
	require.ErrorAs(t, err, &nerr)
	assert.Equal(t, "Cuda failure 2 'out of memory'", nerr.Detail)

	// The same warning again (an out-of-memory retried, a sticky error) is
	// credited again: it is the one our last failure logged.
	_, err = s.backend.Alloc(0, 30*mib, 0)
	require.ErrorIs(t, err, gocore.ErrBackendOutOfMemory)
	require.ErrorAs(t, err, &nerr)
	assert.Equal(t, "Cuda failure 2 'out of memory'", nerr.Detail)
	s.fake.FailText("Cuda failure 700 'an illegal memory access was encountered'")
	s.fake.Fail(int(libnccl.UnhandledCudaError), 0)
	for i := range 3 { // a sticky error: never taken for out of memory, never retried
		calls := s.fake.Calls()
		_, err = p.Alloc(0, mib, 0)
		require.Error(t, err)
		assert.NotErrorIs(t, err, gocore.ErrOutOfMemory, "failure %d", i)
		assert.Contains(t, err.Error(), "illegal memory access", "failure %d", i)
		assert.Equal(t, calls+1, s.fake.Calls(), "failure %d: not retried", i)
	}

	// A warning logged elsewhere in the process, then a failure of ours
	// that logs nothing: the stale text is not shown, and the code decides.
	s.fake.Fail(0, 0)
	s.fake.LogWarning("NET/IB : some other communicator's trouble")
	_, err = s.backend.Alloc(0, 0, 0) // ncclInvalidArgument, which logs nothing in the fake
	require.ErrorAs(t, err, &nerr)
	assert.Equal(t, libnccl.InvalidArgument, nerr.Code)
	assert.Empty(t, nerr.Detail)
}

func TestSystemErrorIsOOM(t *testing.T) {
	s := newSetup(t)
	s.fake.Fail(int(libnccl.SystemError), 0)
	_, err := s.pool(t).Alloc(0, mib, 0)
	require.ErrorIs(t, err, gocore.ErrOutOfMemory)
	assert.Contains(t, err.Error(), "ncclSystemError = 2")
	assert.Equal(t, 2, s.fake.Calls())
}

func TestNonOOMErrorIsNotRetried(t *testing.T) {
	s := newSetup(t)
	p := s.pool(t)
	s.fake.Fail(int(libnccl.InvalidUsage), 1) // the first call still succeeds
	_, err := p.Alloc(0, mib, 0)
	require.NoError(t, err)

	_, err = p.Alloc(0, 30*mib, 0)
	require.Error(t, err)
	assert.NotErrorIs(t, err, gocore.ErrOutOfMemory)
	assert.NotErrorIs(t, err, gocore.ErrBackendOutOfMemory)
	var nerr *libnccl.Error
	require.ErrorAs(t, err, &nerr)
	assert.Equal(t, libnccl.InvalidUsage, nerr.Code)
	assert.Contains(t, err.Error(), "invalid usage")
	assert.Contains(t, err.Error(), "ncclInvalidUsage = 5")
	assert.Equal(t, 2, s.fake.Calls(), "no retry")
	st, err := p.Stats(0)
	require.NoError(t, err)
	assert.Zero(t, st.NumAllocRetries)
}

func TestFreeErrors(t *testing.T) {
	s := newSetup(t)
	addr, err := s.backend.Alloc(1, 2*mib, 0)
	require.NoError(t, err)

	err = s.backend.Free(1, addr+512, 2*mib, 0)
	assert.ErrorIs(t, err, gocore.ErrInvalidArgument, "not a segment")
	err = s.backend.Free(1, addr, mib, 0)
	assert.ErrorIs(t, err, gocore.ErrInvalidArgument, "wrong size")
	err = s.backend.Free(0, addr, 2*mib, 0)
	assert.ErrorIs(t, err, gocore.ErrInvalidArgument, "wrong device")

	// NCCL's failure carries its text and code; the segment stays live.
	s.fake.FailFree(int(libnccl.InternalError))
	err = s.backend.Free(1, addr, 2*mib, 0)
	var nerr *libnccl.Error
	require.ErrorAs(t, err, &nerr)
	assert.Equal(t, "ncclMemFree", nerr.Func)
	assert.Contains(t, err.Error(), "internal error")
	assert.Contains(t, err.Error(), "ncclInternalError = 3")
	assert.Len(t, s.backend.Segments(), 1)
	s.fake.FailFree(0)

	// A failed push: NCCL is not called, the segment stays.
	s.fake.CtxFail(201, 0)
	err = s.backend.Free(1, addr, 2*mib, 0)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "cuCtxPushCurrent failed with CUresult 201")
	assert.Equal(t, int64(2*mib), s.fake.LiveBytes())
	s.fake.CtxFail(0, 0)

	// An event that cannot be recorded: no wait possible, no free.
	s.events.recordErr = errors.New("stream is gone")
	err = s.backend.Free(1, addr, 2*mib, 7)
	require.ErrorIs(t, err, s.events.recordErr)
	assert.Equal(t, int64(2*mib), s.fake.LiveBytes())
	s.events.recordErr = nil

	require.NoError(t, s.backend.Free(1, addr, 2*mib, 7))
	assert.Zero(t, s.fake.LiveBytes())
	assert.Empty(t, s.backend.Segments())
	err = s.backend.Free(1, addr, 2*mib, 7)
	assert.ErrorIs(t, err, gocore.ErrInvalidArgument, "twice")
	created, destroyed, _, _ := s.events.counts()
	assert.Equal(t, created, destroyed, "wait events are destroyed, also on failure")
}

func TestFreeWaitsForStream(t *testing.T) {
	s := newSetup(t)
	s.events.busyQueries = 3
	freesAtDone := -1
	s.events.onDone = func() { freesAtDone = s.fake.Frees() }

	addr, err := s.backend.Alloc(0, 2*mib, 5)
	require.NoError(t, err)
	require.NoError(t, s.backend.Free(0, addr, 2*mib, 5))

	created, destroyed, queries, streams := s.events.counts()
	assert.Equal(t, []gocore.Stream{5}, streams, "recorded on the segment's stream")
	assert.Equal(t, 4, queries, "polled until done")
	assert.Equal(t, 1, created)
	assert.Equal(t, 1, destroyed)
	assert.Equal(t, 0, freesAtDone, "ncclMemFree only after the stream's work completed")
	assert.Equal(t, 1, s.fake.Frees())
}

// ncclMemFree does not wait for other streams: a pool closing with a block
// still in use on one waits for that work (cuEventSynchronize) first.
func TestCloseWaitsForOtherStreams(t *testing.T) {
	s := newSetup(t)
	p := s.pool(t)
	a, err := p.Alloc(0, mib, 0)
	require.NoError(t, err)
	require.NoError(t, p.RecordStream(a, 7))
	s.events.busyQueries = 1 << 20 // stream 7 is far from done
	require.NoError(t, p.Free(a))
	s.events.busyQueries = 0
	report, err := p.Close()
	require.NoError(t, err)
	assert.Empty(t, report.LiveBlocks)
	s.events.mu.Lock()
	syncs := s.events.syncs
	s.events.mu.Unlock()
	assert.Equal(t, 1, syncs, "waited for stream 7")
	assert.Equal(t, 1, s.fake.Frees())
	assert.Zero(t, s.fake.LiveBytes())
}

func TestAllocPushPopFailures(t *testing.T) {
	s := newSetup(t)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()

	s.fake.CtxFail(201, 0)
	_, err := s.backend.Alloc(0, 2*mib, 0)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "cuCtxPushCurrent failed with CUresult 201")
	assert.NotErrorIs(t, err, gocore.ErrBackendOutOfMemory)
	assert.Zero(t, s.fake.Calls(), "NCCL not called without the context")

	depth := s.fake.Depth()
	s.fake.CtxFail(0, 201)
	_, err = s.backend.Alloc(0, 2*mib, 0)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "cuCtxPopCurrent failed with CUresult 201")
	assert.Equal(t, 1, s.fake.Calls())
	assert.Zero(t, s.fake.LiveBytes(), "memory from a failed call is handed back")
	assert.Empty(t, s.backend.Segments())
	s.popLeftover(t, depth)
}

func TestFreePopFailureStillFrees(t *testing.T) {
	s := newSetup(t)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	addr, err := s.backend.Alloc(0, 2*mib, 0)
	require.NoError(t, err)

	depth := s.fake.Depth()
	s.fake.CtxFail(0, 201)
	// The memory is gone once ncclMemFree succeeded: an error would make
	// the engine keep a segment that no longer exists.
	require.NoError(t, s.backend.Free(0, addr, 2*mib, 0))
	assert.Zero(t, s.fake.LiveBytes())
	assert.Empty(t, s.backend.Segments())
	s.popLeftover(t, depth)
}

func TestSegmentsSorted(t *testing.T) {
	s := newSetup(t)
	var want []nccl.Segment
	for _, c := range []struct {
		dev  int
		size uint64
	}{{1, 4 * mib}, {0, 2 * mib}, {1, 2 * mib}, {0, 6 * mib}} {
		addr, err := s.backend.Alloc(c.dev, c.size, 0)
		require.NoError(t, err)
		want = append(want, nccl.Segment{Device: c.dev, Addr: addr, Size: c.size})
	}
	got := s.backend.Segments()
	assert.ElementsMatch(t, want, got)
	for i := 1; i < len(got); i++ {
		a, b := got[i-1], got[i]
		assert.True(t, a.Device < b.Device || a.Device == b.Device && a.Addr < b.Addr, "sorted: %v", got)
	}
	for _, sg := range got {
		require.NoError(t, s.backend.Free(sg.Device, sg.Addr, sg.Size, 0))
	}
	assert.Zero(t, s.fake.LiveBytes())
}

func TestConcurrentBackend(t *testing.T) {
	s := newSetup(t)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewSource(int64(g)))
			dev := g % 2
			var mine []nccl.Segment
			for i := range 60 {
				size := uint64(1+rng.Intn(8)) * mib
				addr, err := s.backend.Alloc(dev, size, gocore.Stream(g))
				if !assert.NoError(t, err) {
					return
				}
				mine = append(mine, nccl.Segment{Device: dev, Addr: addr, Size: size})
				if i%3 == 2 || len(mine) > 4 {
					sg := mine[0]
					mine = mine[1:]
					assert.NoError(t, s.backend.Free(sg.Device, sg.Addr, sg.Size, gocore.Stream(g)))
				}
				_ = s.backend.Segments()
			}
			for _, sg := range mine {
				assert.NoError(t, s.backend.Free(sg.Device, sg.Addr, sg.Size, gocore.Stream(g)))
			}
		}()
	}
	wg.Wait()
	assert.Empty(t, s.backend.Segments())
	assert.Zero(t, s.fake.LiveBytes())
	assert.Zero(t, s.fake.Balance())
	assert.Equal(t, 8*60, s.fake.Calls())
}

func TestConcurrentPool(t *testing.T) {
	s := newSetup(t)
	p := s.pool(t)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewSource(int64(100 + g)))
			var live []uint64
			for i := range 200 {
				size := uint64(1 + rng.Intn(12*mib))
				addr, err := p.Alloc(g%2, size, gocore.Stream(g%3))
				if !assert.NoError(t, err) {
					return
				}
				live = append(live, addr)
				if len(live) > 6 || i%4 == 0 {
					k := rng.Intn(len(live))
					assert.NoError(t, p.Free(live[k]))
					live = append(live[:k], live[k+1:]...)
				}
				if i%50 == 49 {
					_, err := p.EmptyCache()
					assert.NoError(t, err)
				}
			}
			for _, a := range live {
				assert.NoError(t, p.Free(a))
			}
		}()
	}
	wg.Wait()
	require.NoError(t, p.CheckInvariants())
	_, err := p.EmptyCache()
	require.NoError(t, err)
	assert.Zero(t, s.fake.LiveBytes())
	_, err = p.Close()
	require.NoError(t, err)
	assert.Zero(t, s.fake.Balance())
	assert.Greater(t, s.fake.Calls(), 8, "segments came from ncclMemAlloc")
}

// relaxedCtx is a fakeCtx that also gives the fake's
// cuThreadExchangeStreamCaptureMode (nccl.CaptureModeSource).
type relaxedCtx struct{ *fakeCtx }

func (c relaxedCtx) CaptureModeFunc() uintptr { return c.fake.ExchangeCaptureModeFunc() }

// ncclMemAlloc runs in the relaxed stream-capture mode when the context
// source can switch it (the cuda Driver can), so that it is not refused
// while another thread records a CUDA graph; the thread's mode is restored.
func TestNCCLAllocRunsInRelaxedCaptureMode(t *testing.T) {
	lib, fake := freshLib(t)
	be, err := nccl.NewBackend(lib, relaxedCtx{&fakeCtx{fake: fake}}, newStubEvents(2))
	require.NoError(t, err)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	addr, err := be.Alloc(1, 4096, 0)
	require.NoError(t, err)
	assert.Equal(t, 2, fake.LastCaptureMode(), "CU_STREAM_CAPTURE_MODE_RELAXED during ncclMemAlloc")
	assert.Zero(t, fake.CaptureMode(), "and the thread's mode restored")
	require.NoError(t, be.Free(1, addr, 4096, 0))
	assert.Equal(t, 2, fake.LastFreeCaptureMode(), "ncclMemFree relaxed too, like cuMemFree in package cuda")
	assert.Zero(t, fake.CaptureMode())

	// The free that hands back the memory of an alloc whose pop failed.
	depth, frees := fake.Depth(), fake.Frees()
	fake.CtxFail(0, 201)
	_, err = be.Alloc(0, 4096, 0)
	require.ErrorContains(t, err, "cuCtxPopCurrent failed")
	assert.Equal(t, frees+1, fake.Frees())
	assert.Zero(t, fake.LiveBytes())
	assert.Equal(t, 2, fake.LastFreeCaptureMode(), "the fallback ncclMemFree runs relaxed")
	assert.Zero(t, fake.CaptureMode())
	fake.CtxFail(0, 0)
	require.Equal(t, depth+1, fake.Depth())
	_, r := fake.Pop()
	require.Zero(t, r)

	// Without the optional interface the mode is left alone.
	plain, err := nccl.NewBackend(lib, &fakeCtx{fake: fake}, newStubEvents(2))
	require.NoError(t, err)
	addr, err = plain.Alloc(0, 4096, 0)
	require.NoError(t, err)
	assert.Zero(t, fake.LastCaptureMode())
	require.NoError(t, plain.Free(0, addr, 4096, 0))
	assert.Zero(t, fake.LastFreeCaptureMode())
}
