//go:build cgo

package cuda

import (
	"bytes"
	"errors"
	"fmt"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/cuda/driver"
	"github.com/gpumempool/gpumempool/gocore/cuda/internal/fakecuda"
)

func TestAsyncBackendPoolCycle(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewAsyncBackend, drv, AsyncOptions{})
	checkGPUBackend(t, be, "async", drv)
	assert.Zero(t, f.LivePools(), "pools are created on first use")
	p := newPool(t, be)

	const stream = 0x10
	a, err := p.Alloc(1, 1000, stream)
	require.NoError(t, err)
	assert.Equal(t, 1, f.LivePools())
	assert.Equal(t, 1, f.PtrDevice(a), "allocated from device 1's pool")
	assert.EqualValues(t, gocore.SmallBuffer, f.LiveBytes(1))
	assert.EqualValues(t, stream, f.LastStream("cuMemAllocFromPoolAsync"), "ordered on the caller's stream")
	pattern := bytes.Repeat([]byte{0x3C, 0xC3}, 500)
	fakecuda.Write(a, pattern)
	assert.Equal(t, pattern, fakecuda.Read(a, len(pattern)))

	checkCarveAndReuse(t, f, p, a, 1, stream, "cuMemAllocFromPoolAsync")

	released, err := p.EmptyCache()
	require.NoError(t, err)
	assert.EqualValues(t, gocore.SmallBuffer, released)
	assert.Zero(t, f.LiveBytes(1))
	assert.Equal(t, 1, f.Calls("cuMemFreeAsync"))
	assert.EqualValues(t, stream, f.LastStream("cuMemFreeAsync"))

	// The CUDA pool keeps what the engine gave back until trimmed.
	reserved, err := be.Attribute(1, driver.MemPoolAttrReservedMemCurrent)
	require.NoError(t, err)
	assert.EqualValues(t, gocore.SmallBuffer, reserved)
	require.NoError(t, be.Trim(1, 0))
	reserved, err = be.Attribute(1, driver.MemPoolAttrReservedMemCurrent)
	require.NoError(t, err)
	assert.Zero(t, reserved)
	require.NoError(t, be.Trim(0, 0), "no pool on device 0 yet: nothing to do")
	assert.Equal(t, 1, f.LivePools())

	rep := closePool(t, p)
	assert.Empty(t, rep.LiveBlocks)
	assert.Zero(t, be.LiveEvents())
	require.NoError(t, be.Close())
	assert.Zero(t, f.LivePools())
	assert.Zero(t, f.LiveAllocs(1))
	free, total, err := drv.MemGetInfo(1)
	require.NoError(t, err)
	assert.Equal(t, total, free, "everything went back to the device")
}

func TestAsyncBackendAttributes(t *testing.T) {
	f, drv := setup(t)
	no, yes := false, true
	opts := AsyncOptions{ReleaseThreshold: 64 * mib, ReuseAllowOpportunistic: &no, ReuseFollowEventDependencies: &yes,
		MaxSize: 32 * mib}
	be := newGPUBackend(t, NewAsyncBackend, drv, opts)
	assert.Equal(t, opts, be.Options())
	attr := func(dev, a int) uint64 {
		t.Helper()
		v, err := be.Attribute(dev, a)
		require.NoError(t, err)
		return v
	}
	assert.EqualValues(t, 64*mib, attr(1, driver.MemPoolAttrReleaseThreshold))
	assert.Zero(t, attr(1, driver.MemPoolAttrReuseAllowOpportunistic))
	assert.EqualValues(t, 1, attr(1, driver.MemPoolAttrReuseFollowEventDependencies))
	assert.EqualValues(t, 1, attr(1, driver.MemPoolAttrReuseAllowInternalDependencies), "nil keeps the driver default")
	assert.Equal(t, 3, f.Calls("cuMemPoolSetAttribute"), "the threshold and the two reuse policies given")
	locType, locID, handles, maxSize := f.LastPoolCreate()
	assert.Equal(t, driver.MemLocationTypeDevice, locType)
	assert.Equal(t, 1, locID)
	assert.Equal(t, driver.MemHandleTypeNone, handles, "not exportable without IPC")
	assert.EqualValues(t, 32*mib, maxSize)
	assert.Equal(t, 1, f.LivePools())

	// A pool per device, each configured.
	assert.EqualValues(t, 64*mib, attr(0, driver.MemPoolAttrReleaseThreshold))
	assert.Equal(t, 2, f.LivePools())
	assert.Equal(t, 2, f.Calls("cuMemPoolCreate"), "device 1's pool was reused")

	// MaxSize reaches the driver: a pool of 32 MiB cannot give 40.
	p := newPool(t, be)
	_, err := p.Alloc(0, 40*mib, 0)
	var oom *gocore.OutOfMemoryError
	require.ErrorAs(t, err, &oom)
	require.ErrorIs(t, oom.Cause, gocore.ErrBackendOutOfMemory)
	closePool(t, p)
	require.NoError(t, be.Close())
	assert.Zero(t, f.LivePools())

	// IPC pools are created exportable as file descriptors.
	ipc := newGPUBackend(t, NewAsyncBackend, drv, AsyncOptions{IPC: true})
	_, err = ipc.Attribute(0, driver.MemPoolAttrReleaseThreshold)
	require.NoError(t, err)
	_, _, handles, _ = f.LastPoolCreate()
	assert.Equal(t, driver.MemHandleTypePosixFD, handles)
	require.NoError(t, ipc.Close())
}

func TestAsyncBackendFreesOnTheSegmentsStream(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewAsyncBackend, drv, AsyncOptions{})
	p := newPool(t, be)
	for _, stream := range []gocore.Stream{0x20, 0, 0x30} {
		a, err := p.Alloc(0, 4*mib, stream)
		require.NoError(t, err)
		assert.EqualValues(t, stream, f.LastStream("cuMemAllocFromPoolAsync"))
		require.NoError(t, p.Free(a))
		_, err = p.EmptyCache()
		require.NoError(t, err)
		assert.EqualValues(t, stream, f.LastStream("cuMemFreeAsync"), "freed on the stream it was allocated on")
	}

	// A block used on another stream: EmptyCache waits for that stream's
	// event (as torch's empty_cache synchronizes its pending frees), and
	// the segment is still freed on its own stream.
	f.SetManualEvents(true)
	a, err := p.Alloc(0, 4*mib, 0x40)
	require.NoError(t, err)
	require.NoError(t, p.RecordStream(a, 0x50))
	require.NoError(t, p.Free(a))
	waits := f.Calls("cuEventSynchronize")
	_, err = p.EmptyCache()
	require.NoError(t, err)
	assert.Equal(t, waits+1, f.Calls("cuEventSynchronize"), "waited for stream 0x50's event")
	assert.EqualValues(t, 0x40, f.LastStream("cuMemFreeAsync"))

	closePool(t, p)
	require.NoError(t, be.Close())
}

func TestAsyncBackendOutOfMemory(t *testing.T) {
	f, drv := setup(t, "FAKE_CUDA_CAPACITY", fmt.Sprint(64*mib))
	be := newGPUBackend(t, NewAsyncBackend, drv, AsyncOptions{})
	p := newPool(t, be)

	a, err := p.Alloc(0, 40*mib, 0)
	require.NoError(t, err)
	require.NoError(t, p.Free(a)) // cached by the engine, still allocated in the driver
	b, err := p.Alloc(0, 50*mib, 0)
	require.NoError(t, err, "the engine released its cache and retried")
	st := poolStats(t, p, 0)
	assert.EqualValues(t, 1, st.NumAllocRetries)
	assert.Zero(t, st.NumOOMs)
	assert.EqualValues(t, 50*mib, f.LiveBytes(0))

	_, err = p.Alloc(0, 100*mib, 0)
	var oom *gocore.OutOfMemoryError
	require.ErrorAs(t, err, &oom)
	assert.Equal(t, "async", oom.Backend)
	assert.EqualValues(t, 64*mib, oom.DeviceTotal, "capacity comes from the cuda backend")
	var cerr *driver.Error
	require.ErrorAs(t, err, &cerr)
	assert.Equal(t, driver.CodeOutOfMemory, cerr.Code)
	assert.Equal(t, "cuMemAllocFromPoolAsync", cerr.Op)
	st = poolStats(t, p, 0)
	assert.EqualValues(t, 1, st.NumOOMs)

	require.NoError(t, p.Free(b))
	closePool(t, p)
	require.NoError(t, be.Close())
	assert.Zero(t, f.LiveBytes(0))
}

func TestAsyncBackendErrors(t *testing.T) {
	_, err := NewAsyncBackend(nil, AsyncOptions{})
	require.ErrorIs(t, err, gocore.ErrInvalidArgument)

	f, drv := setup(t)
	be := newGPUBackend(t, NewAsyncBackend, drv, AsyncOptions{})
	_, err = be.Alloc(2, mib, 0)
	require.ErrorIs(t, err, gocore.ErrInvalidDevice)
	require.ErrorIs(t, be.Trim(-1, 0), gocore.ErrInvalidDevice)
	require.ErrorIs(t, be.Free(0, 0x1000, mib, 0), gocore.ErrInvalidArgument)
	_, err = be.ExportPool(0)
	require.ErrorIs(t, err, gocore.ErrUnsupported, "created without IPC")
	_, err = be.ExportPointer(0, 0x1000)
	require.ErrorIs(t, err, gocore.ErrUnsupported)

	// A pool whose options cannot be applied is destroyed again.
	f.Fail("cuMemPoolSetAttribute", driver.CodeInvalidValue, 0)
	_, err = be.Alloc(0, mib, 0)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "cuMemPoolSetAttribute")
	assert.Zero(t, f.LivePools())
	f.Fail("cuMemPoolSetAttribute", 0, 0)

	a, err := be.Alloc(0, 2*mib, 7)
	require.NoError(t, err)
	require.ErrorIs(t, be.Free(0, a, mib, 7), gocore.ErrInvalidArgument, "wrong size")
	require.ErrorIs(t, be.Free(1, a, 2*mib, 7), gocore.ErrInvalidArgument, "wrong device")
	f.Fail("cuMemFreeAsync", driver.CodeUnknown, 0)
	require.Error(t, be.Free(0, a, 2*mib, 7))
	f.Fail("cuMemFreeAsync", 0, 0)

	// Closing with a segment still allocated reports it; Free still works.
	err = be.Close()
	require.Error(t, err)
	assert.Contains(t, err.Error(), "1 segments never freed")
	assert.Zero(t, f.LivePools())
	require.NoError(t, be.Free(0, a, 2*mib, 7), "a destroyed pool's allocations stay valid until freed")
	assert.Zero(t, f.LiveBytes(0))
	require.ErrorIs(t, be.Close(), ErrBackendClosed)
	_, err = be.Alloc(0, mib, 0)
	require.ErrorIs(t, err, ErrBackendClosed)
	_, err = be.Attribute(0, driver.MemPoolAttrReleaseThreshold)
	require.ErrorIs(t, err, ErrBackendClosed)
	require.ErrorIs(t, be.Trim(0, 0), ErrBackendClosed)
}

func TestGPUBackendsNeedTheirEntryPoints(t *testing.T) {
	_, drv := setupHiding(t, "cuMemFreeAsync", "cuMemMap")
	_, err := NewAsyncBackend(drv, AsyncOptions{})
	require.ErrorIs(t, err, driver.ErrDriverTooOld)
	require.ErrorIs(t, err, gocore.ErrUnsupported, "callers can fall back with one check")
	assert.Contains(t, err.Error(), "cuMemFreeAsync missing")
	_, err = NewVMMBackend(drv, VMMOptions{})
	require.ErrorIs(t, err, driver.ErrDriverTooOld)
	assert.Contains(t, err.Error(), "cuMemMap missing")
}

// Without cuStreamIsCapturing a capture could not be told from ordinary
// use: allocations would silently become graph-owned, and frees (async) or
// the waits before unmapping (vmm) would break captures. Refused.
func TestGPUBackendsNeedCaptureStatus(t *testing.T) {
	_, drv := setupHiding(t, "cuStreamIsCapturing")
	_, err := NewAsyncBackend(drv, AsyncOptions{})
	require.ErrorIs(t, err, driver.ErrDriverTooOld)
	assert.Contains(t, err.Error(), "cuStreamIsCapturing missing")
	_, err = NewVMMBackend(drv, VMMOptions{})
	require.ErrorIs(t, err, driver.ErrDriverTooOld)
	assert.Contains(t, err.Error(), "cuStreamIsCapturing missing")
}

// Pools on many goroutines share one backend, as the Backend contract
// allows; run with -race.
func testConcurrentPools(t *testing.T, be gocore.Backend, sizes []uint64) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p, err := gocore.NewPool(gocore.Config{Backend: be, Name: fmt.Sprint("pool", g)})
			if err != nil {
				errs <- err
				return
			}
			defer func() {
				if _, err := p.Close(); err != nil {
					errs <- err
				}
			}()
			for i := range 20 {
				dev := (g + i) % be.Devices()
				stream := gocore.Stream(g + 1)
				var addrs []uint64
				for _, size := range sizes {
					a, err := p.Alloc(dev, size, stream)
					if err != nil {
						errs <- err
						return
					}
					fakecuda.Write(a, []byte{byte(g), byte(i)})
					addrs = append(addrs, a)
				}
				for _, a := range addrs {
					if got := fakecuda.Read(a, 2); got[0] != byte(g) || got[1] != byte(i) {
						errs <- fmt.Errorf("pool %d: memory at %#x overwritten: %v", g, a, got)
					}
					if err := p.Free(a); err != nil {
						errs <- err
					}
				}
				if i%5 == 4 {
					if _, err := p.EmptyCache(); err != nil {
						errs <- err
					}
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	var all []error
	for err := range errs {
		all = append(all, err)
	}
	require.NoError(t, errors.Join(all...))
}

func TestAsyncBackendConcurrentPools(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewAsyncBackend, drv, AsyncOptions{})
	testConcurrentPools(t, be, []uint64{1000, 3 * mib, 12 * mib})
	require.NoError(t, be.Close())
	assert.Zero(t, f.LiveAllocs(0)+f.LiveAllocs(1))
	assert.Zero(t, f.LivePools())
}

// A segment wanted during a CUDA graph capture is never allocated on the
// capturing stream (the driver would make it a graph-owned allocation
// node): Alloc takes it on a private non-blocking stream of the device and
// waits for that stream. The fake refuses stream-ordered calls on a
// capturing stream, so succeeding proves the private stream was used.
func TestAsyncBackendAllocDuringCaptureUsesPrivateStream(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewAsyncBackend, drv, AsyncOptions{})
	const captured, other = 0x41, 0x40

	// No capture: the caller's stream, no private stream.
	a, err := be.Alloc(1, 4*mib, other)
	require.NoError(t, err)
	assert.EqualValues(t, other, f.LastStream("cuMemAllocFromPoolAsync"))
	assert.Zero(t, f.Calls("cuStreamCreate"))
	assert.Zero(t, f.Calls("cuStreamSynchronize"), "nothing to wait for outside a capture")

	f.SetStreamCapturing(captured, true)
	b, err := be.Alloc(1, 8*mib, captured)
	require.NoError(t, err)
	side := f.LastStream("cuMemAllocFromPoolAsync")
	assert.NotEqualValues(t, captured, side, "not on the capturing stream")
	dev, flags, ok := f.StreamInfo(side)
	require.True(t, ok, "a stream the backend created")
	assert.Equal(t, 1, dev, "of the segment's device")
	assert.Equal(t, driver.StreamNonBlocking, flags, "no implicit synchronization with the legacy stream")
	assert.Equal(t, side, f.LastStream("cuStreamSynchronize"), "waited for the private stream")
	assert.Equal(t, 1, f.PtrDevice(b))
	assert.Zero(t, f.CaptureViolations())
	assert.Zero(t, f.CaptureMode(), "the thread's capture mode is restored")

	// The legacy default stream while a blocking stream captures: using it
	// would join the capture (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT).
	c, err := be.Alloc(1, 2*mib, 0)
	require.NoError(t, err)
	assert.Equal(t, side, f.LastStream("cuMemAllocFromPoolAsync"), "the same private stream, made once")
	assert.Equal(t, 1, f.Calls("cuStreamCreate"))
	// Another stream that does not capture is used as it is.
	d, err := be.Alloc(1, 2*mib, other)
	require.NoError(t, err)
	assert.EqualValues(t, other, f.LastStream("cuMemAllocFromPoolAsync"))
	// Device 0 gets its own private stream.
	e, err := be.Alloc(0, 2*mib, captured)
	require.NoError(t, err)
	side0 := f.LastStream("cuMemAllocFromPoolAsync")
	dev, _, ok = f.StreamInfo(side0)
	require.True(t, ok)
	assert.Equal(t, 0, dev)
	assert.Equal(t, 2, f.LiveStreams())
	assert.Zero(t, f.CaptureViolations())

	f.SetStreamCapturing(captured, false)
	// Segments are freed on their stream once the capture is over.
	require.NoError(t, be.Free(1, b, 8*mib, captured))
	assert.EqualValues(t, captured, f.LastStream("cuMemFreeAsync"))
	for _, s := range []struct {
		dev  int
		addr uint64
		size uint64
	}{{1, a, 4 * mib}, {1, c, 2 * mib}, {1, d, 2 * mib}, {0, e, 2 * mib}} {
		require.NoError(t, be.Free(s.dev, s.addr, s.size, other))
	}
	require.NoError(t, be.Close())
	assert.Zero(t, f.LiveStreams(), "Close destroys the private streams")
	assert.Zero(t, f.LivePools())

	_, err = be.Alloc(1, 2*mib, captured)
	require.ErrorIs(t, err, ErrBackendClosed)
}

// Through a pool: a new segment for an allocation on the capturing stream
// comes from the private stream, and nothing the capture forbids is done.
func TestAsyncBackendPoolDuringCapture(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewAsyncBackend, drv, AsyncOptions{})
	p := newPool(t, be)
	const captured = 0x51
	f.SetStreamCapturing(captured, true)
	p.EnterCapture()
	a, err := p.Alloc(0, 3*mib, captured)
	require.NoError(t, err)
	assert.NotEqualValues(t, captured, f.LastStream("cuMemAllocFromPoolAsync"))
	require.NoError(t, p.Free(a))
	assert.Zero(t, f.CaptureViolations())
	f.SetStreamCapturing(captured, false)
	require.NoError(t, p.ExitCapture())
	_, err = p.EmptyCache()
	require.NoError(t, err)
	assert.EqualValues(t, captured, f.LastStream("cuMemFreeAsync"), "freed on the segment's stream")
	closePool(t, p)
	require.NoError(t, be.Close())
	assert.Zero(t, f.LiveAllocs(0))
	assert.Zero(t, f.LiveStreams())
}

// captureTestBackends makes a VMM and an async backend over drv, each
// closed (and checked to close cleanly) at the end of the test.
func captureTestBackends(t *testing.T, drv *driver.Driver) map[string]gocore.Backend {
	t.Helper()
	vmm, async := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{}), newGPUBackend(t, NewAsyncBackend, drv, AsyncOptions{})
	t.Cleanup(func() {
		assert.NoError(t, vmm.Close())
		assert.NoError(t, async.Close())
	})
	return map[string]gocore.Backend{"vmm": vmm, "async": async}
}

// Pools share a backend, and a pool holds its segments only during its own
// capture. While another thread captures on a blocking stream, a pool that
// releases a cached segment of the legacy default stream (EmptyCache, an
// out-of-memory retry, the release threshold) must not touch that stream:
// cuStreamSynchronize(0) (vmm) or cuMemFreeAsync(p, 0) (async) would fail
// with CUDA_ERROR_STREAM_CAPTURE_IMPLICIT and, on a GPU, invalidate the
// other thread's capture. The release fails instead, saying why, the
// segment stays cached, and it goes back once the capture is over.
func TestReleaseOnTheLegacyStreamDuringAnotherCapture(t *testing.T) {
	f, drv := setup(t)
	for name, be := range captureTestBackends(t, drv) {
		t.Run(name, func(t *testing.T) {
			p := newPool(t, be)
			a, err := p.Alloc(0, 4*mib, 0) // a segment of the legacy default stream
			require.NoError(t, err)
			require.NoError(t, p.Free(a))

			const otherThreadsCapture = 0x81 // not created non-blocking: a blocking stream
			f.SetStreamCapturing(otherThreadsCapture, true)
			released, err := p.EmptyCache()
			assert.Zero(t, f.CaptureViolations(), "a release broke another thread's capture: %v", err)
			require.ErrorIs(t, err, ErrCaptureUnderway)
			require.NotErrorIs(t, err, gocore.ErrBackendOutOfMemory)
			require.ErrorContains(t, err, "legacy default stream")
			assert.Zero(t, released)
			assert.EqualValues(t, 20*mib, poolStats(t, p, 0).ReservedBytes[0].Current, "still cached")

			f.SetStreamCapturing(otherThreadsCapture, false)
			released, err = p.EmptyCache()
			require.NoError(t, err)
			assert.EqualValues(t, 20*mib, released, "given back once the capture is over")
			closePool(t, p)
			assert.Zero(t, f.LiveBytes(0))
			assert.Zero(t, f.CaptureViolations())
		})
	}
}

// A pool closed during its own capture must not use the capturing stream
// either (vmm: a synchronization the capture forbids, which invalidates it;
// async: a free node recorded into the graph while the segment leaves the
// backend's table): its segments' Frees fail, and the pool keeps them for a
// later Close, which gives them back once the capture is over.
func TestPoolCloseDuringItsCaptureKeepsSegments(t *testing.T) {
	f, drv := setup(t)
	for name, be := range captureTestBackends(t, drv) {
		t.Run(name, func(t *testing.T) {
			p := newPool(t, be)
			const captured = 0x91
			a, err := p.Alloc(0, 4*mib, captured)
			require.NoError(t, err)
			require.NoError(t, p.Free(a))
			f.SetStreamCapturing(captured, true)
			p.EnterCapture()
			_, err = p.Close()
			assert.Zero(t, f.CaptureViolations(), "Close during a capture used the capturing stream: %v", err)
			require.ErrorIs(t, err, ErrCaptureUnderway)
			require.ErrorContains(t, err, "stream 0x91 is capturing a CUDA graph")
			assert.EqualValues(t, 20*mib, f.LiveBytes(0), "the segment stays")

			f.SetStreamCapturing(captured, false)
			rep, err := p.Close()
			require.NoError(t, err, "the retry gives the segment back")
			assert.Equal(t, 1, rep.SegmentsFreed)
			assert.Zero(t, f.LiveBytes(0))
			uses := map[string]string{"vmm": "cuStreamSynchronize", "async": "cuMemFreeAsync"}[name]
			assert.EqualValues(t, captured, f.LastStream(uses), "the segment's stream, once it no longer captures")
		})
	}
}

// The fake refuses stream-ordered calls on a capturing stream (and on the
// legacy one while a blocking stream captures), and the capture path's
// failures are reported without leaving anything allocated.
func TestAsyncBackendCaptureFailures(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewAsyncBackend, drv, AsyncOptions{})
	const captured = 0x61
	f.SetStreamCapturing(captured, true)

	// The fake refuses what the real driver would turn into graph nodes.
	pool, err := be.pool("test", 0)
	require.NoError(t, err)
	_, err = drv.MemAllocFromPoolAsync(0, 2*mib, pool, captured)
	require.ErrorContains(t, err, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")
	_, err = drv.MemAllocFromPoolAsync(0, 2*mib, pool, 0)
	require.ErrorContains(t, err, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT")
	assert.Equal(t, 2, f.CaptureViolations())

	// Failures on the way are reported, and leave nothing behind.
	f.Fail("cuStreamIsCapturing", driver.CodeInvalidValue, 0)
	_, err = be.Alloc(0, 2*mib, captured)
	require.ErrorContains(t, err, "cuStreamIsCapturing: CUDA_ERROR_INVALID_VALUE")
	f.Fail("cuStreamIsCapturing", 0, 0)
	f.Fail("cuStreamCreate", driver.CodeOutOfMemory, 0)
	_, err = be.Alloc(0, 2*mib, captured)
	require.ErrorContains(t, err, "private stream")
	require.ErrorIs(t, err, gocore.ErrBackendOutOfMemory)
	f.Fail("cuStreamCreate", 0, 0)
	f.Fail("cuStreamSynchronize", driver.CodeIllegalAddress, 0)
	_, err = be.Alloc(0, 2*mib, captured)
	require.ErrorContains(t, err, "cuStreamSynchronize: CUDA_ERROR_ILLEGAL_ADDRESS")
	f.Fail("cuStreamSynchronize", 0, 0)
	assert.Zero(t, f.LiveAllocs(0), "the allocation was given back")
	assert.Equal(t, 2, f.CaptureViolations(), "no refused call by the backend")
	f.SetStreamCapturing(captured, false)

	f.Fail("cuStreamDestroy_v2", driver.CodeInvalidContext, 0)
	require.ErrorContains(t, be.Close(), "cuStreamDestroy_v2")
}

// Close waits for allocations using a private stream before destroying it
// (the fake fails a use of a destroyed stream); run with -race.
func TestAsyncBackendCloseDuringCaptureAllocs(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewAsyncBackend, drv, AsyncOptions{})
	const captured = 0x71
	f.SetStreamCapturing(captured, true)
	type seg struct {
		dev  int
		addr uint64
	}
	var (
		mu   sync.Mutex
		segs []seg
		errs []error
		wg   sync.WaitGroup
	)
	started := make(chan struct{}, 4)
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 100 { // within the fake's 1 GiB per device
				a, err := be.Alloc(g%2, 2*mib, captured)
				if i == 0 {
					started <- struct{}{}
				}
				mu.Lock()
				if err != nil {
					if !errors.Is(err, ErrBackendClosed) {
						errs = append(errs, err)
					}
					mu.Unlock()
					return
				}
				segs = append(segs, seg{g % 2, a})
				mu.Unlock()
			}
		}()
	}
	for range 4 {
		<-started
	}
	closeErr := be.Close()
	wg.Wait()
	require.NoError(t, errors.Join(errs...))
	require.ErrorContains(t, closeErr, "segments never freed", "the loops' segments")
	assert.Zero(t, f.LiveStreams())
	assert.Zero(t, f.CaptureViolations())
	f.SetStreamCapturing(captured, false)
	for _, s := range segs {
		require.NoError(t, be.Free(s.dev, s.addr, 2*mib, 0x72), "Free works after Close")
	}
	assert.Zero(t, f.LiveAllocs(0)+f.LiveAllocs(1))
}

// Close destroys the CUDA pools; an Alloc, Trim, Attribute or ExportPool
// that already took a pool's handle from the backend must not use it after
// that. Here the driver's close lock is held to park the operation at its
// first driver call (after it read the pool's handle) while Close runs: the
// operation either completes on the live pool, Close waiting for it, or
// fails with ErrBackendClosed; it never reaches a destroyed pool (the fake
// fails that with CUDA_ERROR_INVALID_VALUE). Afterwards they all fail with
// ErrBackendClosed.
func TestAsyncBackendCloseWaitsForOperationsOnItsPools(t *testing.T) {
	ops := []struct {
		name string
		do   func(be *AsyncBackend) error
	}{
		{"alloc", func(be *AsyncBackend) error {
			a, err := be.Alloc(0, 512, 0x10)
			if err == nil {
				err = be.Free(0, a, 512, 0x10) // Free works after Close
			}
			return err
		}},
		{"trim", func(be *AsyncBackend) error { return be.Trim(0, 0) }},
		{"attribute", func(be *AsyncBackend) error {
			_, err := be.Attribute(0, driver.MemPoolAttrReleaseThreshold)
			return err
		}},
		{"export pool", func(be *AsyncBackend) error {
			fd, err := be.ExportPool(0)
			if err == nil {
				err = syscall.Close(fd)
			}
			return err
		}},
	}
	for _, op := range ops {
		t.Run(op.name, func(t *testing.T) {
			for round := 0; round < 12; round++ {
				f, drv := setup(t)
				be := newGPUBackend(t, NewAsyncBackend, drv, AsyncOptions{IPC: true})
				_, err := be.Attribute(0, driver.MemPoolAttrReleaseThreshold) // the pool exists
				require.NoError(t, err)

				f.Hold(true) // park every driver call
				opErr := make(chan error, 1)
				go func() { opErr <- op.do(be) }()
				time.Sleep(20 * time.Millisecond) // the operation holds the pool's handle, waits in the driver
				closeErr := make(chan error, 1)
				go func() { closeErr <- be.Close() }()
				time.Sleep(20 * time.Millisecond) // Close runs meanwhile
				f.Hold(false)
				err = <-opErr
				if err != nil && !errors.Is(err, ErrBackendClosed) {
					t.Fatalf("round %d: the operation used a pool Close destroyed: %v", round, err)
				}
				if err := <-closeErr; err != nil {
					// Only an Alloc that Close waited for, freed after it.
					require.ErrorContains(t, err, "1 segments never freed")
					require.NotContains(t, err.Error(), "CUDA_ERROR")
				}
				assert.Zero(t, f.LivePools())
				assert.Zero(t, f.LiveAllocs(0))
				require.ErrorIs(t, op.do(be), ErrBackendClosed, "after Close")
			}
		})
	}
}
