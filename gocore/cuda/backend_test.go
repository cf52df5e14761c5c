//go:build cgo

package cuda

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/cuda/driver"
	"github.com/gpumempool/gpumempool/gocore/cuda/internal/fakecuda"
)

func newPool(t *testing.T, be gocore.Backend) *gocore.Pool {
	t.Helper()
	p, err := gocore.NewPool(gocore.Config{Backend: be, Name: t.Name()})
	require.NoError(t, err)
	return p
}

func newBackend(t *testing.T, drv *driver.Driver) *Backend {
	t.Helper()
	be, err := NewBackend(drv)
	require.NoError(t, err)
	return be
}

func poolStats(t *testing.T, p *gocore.Pool, dev int) gocore.Stats {
	t.Helper()
	st, err := p.Stats(dev)
	require.NoError(t, err)
	return st
}

// checkGPUBackend checks what a GPU backend over drv (from the fake, two
// devices) says about itself.
func checkGPUBackend(t *testing.T, be interface {
	gocore.Backend
	Driver() *driver.Driver
}, name string, drv *driver.Driver) {
	t.Helper()
	assert.Equal(t, name, be.Name())
	assert.Equal(t, 2, be.Devices())
	assert.EqualValues(t, Alignment, be.Alignment())
	assert.Same(t, drv, be.Driver())
}

// checkCarveAndReuse takes a, a 1000-byte block on dev and stream, through
// the engine's side of a pool cycle: a second such block is carved from
// a's segment (1000 rounds up to 1024), and once both are freed a third is
// served from the engine's cache, the driver's entry point alloc having
// been called only once, for a's segment.
func checkCarveAndReuse(t *testing.T, f *fakecuda.Fake, p *gocore.Pool, a uint64, dev int, stream gocore.Stream,
	alloc string) {
	t.Helper()
	b, err := p.Alloc(dev, 1000, stream)
	require.NoError(t, err)
	assert.Equal(t, a+1024, b, "carved from the same segment")
	require.NoError(t, p.Free(a))
	require.NoError(t, p.Free(b))
	c, err := p.Alloc(dev, 1000, stream)
	require.NoError(t, err)
	assert.Equal(t, a, c, "served from the engine's cache")
	assert.Equal(t, 1, f.Calls(alloc))
	require.NoError(t, p.Free(c))
}

func closePool(t *testing.T, p *gocore.Pool) gocore.CloseReport {
	t.Helper()
	rep, err := p.Close()
	require.NoError(t, err)
	return rep
}

func TestNewBackendErrors(t *testing.T) {
	_, err := NewBackend(nil)
	require.ErrorIs(t, err, gocore.ErrInvalidArgument)
	_, err = NewHostBackend(nil, 0)
	require.ErrorIs(t, err, gocore.ErrInvalidArgument)

	_, drv := setup(t)
	_, err = NewHostBackend(drv, 0x10)
	require.ErrorIs(t, err, gocore.ErrInvalidArgument)
	be := newBackend(t, drv)
	assert.Equal(t, "cuda", be.Name())
	assert.Equal(t, 2, be.Devices())
	assert.EqualValues(t, 512, be.Alignment())
	assert.Same(t, drv, be.Driver())
	_, err = be.Alloc(2, 512, 0)
	require.ErrorIs(t, err, gocore.ErrInvalidDevice)
	_, _, err = be.Capacity(-1)
	require.ErrorIs(t, err, gocore.ErrInvalidDevice)
	_, err = be.NewEvent(2)
	require.ErrorIs(t, err, gocore.ErrInvalidDevice)
	_, err = be.QueryEvent(12345)
	require.ErrorIs(t, err, gocore.ErrInvalidArgument)
	require.ErrorIs(t, be.RecordEvent(12345, 0), gocore.ErrInvalidArgument)
	require.ErrorIs(t, be.DestroyEvent(12345), gocore.ErrInvalidArgument)
}

func TestPoolOverCUDABackend(t *testing.T) {
	f, drv := setup(t)
	be := newBackend(t, drv)
	p := newPool(t, be)

	a, err := p.Alloc(1, 1000, 0x10)
	require.NoError(t, err)
	assert.Equal(t, 1, f.PtrDevice(a), "device 1's context was current for cuMemAlloc")
	assert.EqualValues(t, gocore.SmallBuffer, f.LiveBytes(1))
	assert.Equal(t, 1, f.LiveAllocs(1))
	assert.Zero(t, f.LiveBytes(0))
	assert.Zero(t, a%512)

	// The memory is real: what is written is read back.
	pattern := bytes.Repeat([]byte{0xA5, 0x5A}, 500)
	fakecuda.Write(a, pattern)
	assert.Equal(t, pattern, fakecuda.Read(a, len(pattern)))

	b, err := p.Alloc(1, 1000, 0x10)
	require.NoError(t, err)
	assert.Equal(t, a+1024, b, "carved from the same segment")
	assert.Equal(t, 1, f.Calls("cuMemAlloc_v2"))
	require.NoError(t, p.Free(a))
	c, err := p.Alloc(1, 900, 0x10)
	require.NoError(t, err)
	assert.Equal(t, a, c, "the freed block is reused")
	assert.Equal(t, 1, f.Calls("cuMemAlloc_v2"), "without asking the driver")

	big, err := p.Alloc(0, 30<<20, 0)
	require.NoError(t, err)
	assert.Equal(t, 0, f.PtrDevice(big))
	assert.EqualValues(t, 30<<20, f.LiveBytes(0))
	total, free, err := be.Capacity(0)
	require.NoError(t, err)
	assert.Equal(t, uint64(1<<30), total)
	assert.Equal(t, uint64(1<<30-30<<20), free)

	require.NoError(t, p.Free(b))
	require.NoError(t, p.Free(c))
	require.NoError(t, p.Free(big))
	released, err := p.EmptyCache()
	require.NoError(t, err)
	assert.EqualValues(t, gocore.SmallBuffer+30<<20, released)
	assert.Zero(t, f.LiveBytes(0))
	assert.Zero(t, f.LiveBytes(1))
	assert.Equal(t, 2, f.Calls("cuMemFree_v2"))
	rep := closePool(t, p)
	assert.Empty(t, rep.LiveBlocks)
	assert.Zero(t, f.LiveEvents(0)+f.LiveEvents(1))
}

// A CUDA out-of-memory makes the engine release its cached segments and
// retry; only when that fails too does the caller get an OutOfMemoryError,
// which names the driver's error.
func TestOutOfMemoryReleasesCacheAndRetries(t *testing.T) {
	f, drv := setup(t, "FAKE_CUDA_CAPACITY", strconv.Itoa(64<<20))
	be := newBackend(t, drv)
	p := newPool(t, be)

	a, err := p.Alloc(0, 40<<20, 1)
	require.NoError(t, err)
	require.NoError(t, p.Free(a)) // cached for stream 1

	b, err := p.Alloc(0, 40<<20, 2) // stream 2 cannot reuse it: 80 MiB > 64 MiB
	require.NoError(t, err, "the cached segment was released and the allocation retried")
	st := poolStats(t, p, 0)
	assert.EqualValues(t, 1, st.NumAllocRetries)
	assert.Zero(t, st.NumOOMs)
	assert.Equal(t, 3, f.Calls("cuMemAlloc_v2"), "first, failed, retried")
	assert.Equal(t, 1, f.Calls("cuMemFree_v2"))

	_, err = p.Alloc(0, 40<<20, 3)
	require.ErrorIs(t, err, gocore.ErrOutOfMemory)
	var oom *gocore.OutOfMemoryError
	require.ErrorAs(t, err, &oom)
	assert.Contains(t, err.Error(), "CUDA_ERROR_OUT_OF_MEMORY")
	assert.Contains(t, err.Error(), "cuMemAlloc_v2")
	assert.Equal(t, "cuda", oom.Backend)
	assert.Equal(t, uint64(64<<20), oom.DeviceTotal, "capacity from cuMemGetInfo_v2")
	assert.Equal(t, uint64(24<<20), oom.DeviceFree)
	var cerr *driver.Error
	require.ErrorAs(t, err, &cerr)
	assert.Equal(t, driver.CodeOutOfMemory, cerr.Code)
	st = poolStats(t, p, 0)
	assert.EqualValues(t, 1, st.NumOOMs)
	assert.EqualValues(t, 2, st.NumAllocRetries)

	require.NoError(t, p.Free(b))
	closePool(t, p)
	assert.Zero(t, f.LiveBytes(0))
}

func TestInjectedOutOfMemory(t *testing.T) {
	f, drv := setup(t)
	be := newBackend(t, drv)
	p := newPool(t, be)
	f.Fail("cuMemAlloc_v2", driver.CodeOutOfMemory, 0)
	_, err := p.Alloc(1, 4096, 0)
	require.ErrorIs(t, err, gocore.ErrOutOfMemory)
	assert.Contains(t, err.Error(), "cuMemAlloc_v2: CUDA_ERROR_OUT_OF_MEMORY (2)")
	assert.Equal(t, 2, f.Calls("cuMemAlloc_v2"), "tried, released the cache, retried")
	f.Fail("cuMemAlloc_v2", 0, 0)
	a, err := p.Alloc(1, 4096, 0)
	require.NoError(t, err)
	require.NoError(t, p.Free(a))
	closePool(t, p)
}

func TestOtherDriverErrorsAreNotOutOfMemory(t *testing.T) {
	f, drv := setup(t)
	be := newBackend(t, drv)
	p := newPool(t, be)
	f.Fail("cuMemAlloc_v2", driver.CodeInvalidValue, 0)
	_, err := p.Alloc(0, 4096, 0)
	require.Error(t, err)
	assert.NotErrorIs(t, err, gocore.ErrOutOfMemory)
	assert.NotErrorIs(t, err, gocore.ErrBackendOutOfMemory)
	assert.Contains(t, err.Error(), "CUDA_ERROR_INVALID_VALUE")
	var cerr *driver.Error
	require.ErrorAs(t, err, &cerr)
	assert.Equal(t, &driver.Error{Op: "cuMemAlloc_v2", Code: 1, Name: "CUDA_ERROR_INVALID_VALUE"}, cerr)
	st := poolStats(t, p, 0)
	assert.Zero(t, st.NumAllocRetries, "no release-and-retry for a non-OOM error")
	assert.Equal(t, 1, f.Calls("cuMemAlloc_v2"))

	// A failing free is reported and the segment stays the pool's.
	f.Fail("cuMemAlloc_v2", 0, 0)
	a, err := p.Alloc(0, 4096, 0)
	require.NoError(t, err)
	require.NoError(t, p.Free(a))
	f.Fail("cuMemFree_v2", driver.CodeIllegalAddress, 0)
	_, err = p.EmptyCache()
	require.Error(t, err)
	assert.Contains(t, err.Error(), "cuMemFree_v2: CUDA_ERROR_ILLEGAL_ADDRESS (700)")
	f.Fail("cuMemFree_v2", 0, 0)
	closePool(t, p)
	assert.Zero(t, f.LiveBytes(0))
}

// A block used on another stream (record_stream) is not reused on its own
// stream until the work queued on the other stream at free time is done.
func TestCrossStreamReuseWaitsForEvents(t *testing.T) {
	f, drv := setup(t)
	f.SetManualEvents(true)
	be := newBackend(t, drv)
	p := newPool(t, be)
	const own, other = gocore.Stream(0x11), gocore.Stream(0x22)

	a, err := p.Alloc(1, 1000, own)
	require.NoError(t, err)
	require.NoError(t, p.RecordStream(a, other))
	require.NoError(t, p.Free(a))
	assert.Equal(t, 1, f.LiveEvents(1), "an event on device 1, recorded on the other stream")
	assert.Zero(t, f.LiveEvents(0))
	assert.Equal(t, 1, f.Calls("cuEventRecord"))

	b, err := p.Alloc(1, 1000, own)
	require.NoError(t, err)
	assert.NotEqual(t, a, b, "the other stream may still be using a")
	f.CompleteStream(uint64(own))
	waiting, err := p.ProcessEvents()
	require.NoError(t, err)
	assert.Equal(t, 1, waiting, "its own stream's progress does not matter")

	f.CompleteStream(uint64(other))
	c, err := p.Alloc(1, 1000, own)
	require.NoError(t, err)
	assert.Equal(t, a, c, "reused once the other stream got past the free")
	waiting, err = p.ProcessEvents()
	require.NoError(t, err)
	assert.Zero(t, waiting)

	require.NoError(t, p.Free(b))
	require.NoError(t, p.Free(c))
	// A block still in use on the other stream when the pool closes: Close
	// waits for that work before the memory goes.
	d, err := p.Alloc(1, 1000, own)
	require.NoError(t, err)
	require.NoError(t, p.RecordStream(d, other))
	require.NoError(t, p.Free(d))
	assert.Zero(t, f.Calls("cuEventSynchronize"))
	closePool(t, p)
	assert.Equal(t, 1, f.Calls("cuEventSynchronize"))
	assert.Zero(t, f.LiveEvents(1), "Close destroys the pool's events")
	assert.Zero(t, f.LiveBytes(1))
	assert.Zero(t, be.LiveEvents())
}

// The driver reuses a destroyed event's handle (a CUevent points to freed
// heap memory, in the fake as in libcuda), so a NewEvent on another thread
// may get it back while DestroyEvent is still in cuEventDestroy. Its fresh
// entry in the backend's event table must survive the DestroyEvent: were it
// dropped, RecordEvent, QueryEvent and DestroyEvent would call the event
// unknown (the engine's free fails) and it would leak in the driver.
func TestDestroyEventKeepsAReusedHandlesNewEntry(t *testing.T) {
	f, drv := setup(t)
	host, err := NewHostBackend(drv, 0)
	require.NoError(t, err)
	for _, be := range []gocore.Backend{newBackend(t, drv), host} {
		var lost atomic.Int64
		for round := 0; round < 5 && lost.Load() == 0; round++ {
			var wg sync.WaitGroup
			for g := 0; g < 16; g++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := 0; i < 3000; i++ {
						ev, err := be.NewEvent(0)
						if err != nil {
							t.Error(err)
							return
						}
						if err := be.RecordEvent(ev, 0); err != nil {
							lost.Add(1) // its entry is gone: it can never be destroyed
							continue
						}
						if err := be.DestroyEvent(ev); err != nil {
							lost.Add(1)
						}
					}
				}()
			}
			wg.Wait()
		}
		assert.Zero(t, lost.Load(), "%s backend: live events dropped from its table", be.Name())
		assert.Zero(t, f.LiveEvents(0), "%s backend: events leaked in the driver", be.Name())
		f.Reset()
	}
}

// An event whose cuEventDestroy fails is still the backend's: it can be used
// and destroyed again.
func TestDestroyEventFailureKeepsTheEvent(t *testing.T) {
	f, drv := setup(t)
	host, err := NewHostBackend(drv, 0)
	require.NoError(t, err)
	for _, be := range []gocore.Backend{newBackend(t, drv), host} {
		ev, err := be.NewEvent(0)
		require.NoError(t, err)
		f.Fail("cuEventDestroy_v2", driver.CodeUnknown, 0)
		require.Error(t, be.DestroyEvent(ev), "%s backend", be.Name())
		f.Fail("cuEventDestroy_v2", 0, 0)
		require.NoError(t, be.RecordEvent(ev, 0), "%s backend: the event is still known", be.Name())
		require.NoError(t, be.DestroyEvent(ev), "%s backend", be.Name())
		require.ErrorIs(t, be.DestroyEvent(ev), gocore.ErrInvalidArgument, "%s backend: destroyed once", be.Name())
		assert.Zero(t, f.LiveEvents(0), "%s backend", be.Name())
	}
}

func TestHostBackendPinsMemory(t *testing.T) {
	f, drv := setup(t)
	hb, err := NewHostBackend(drv, 0)
	require.NoError(t, err)
	assert.Equal(t, "host", hb.Name())
	assert.Equal(t, 1, hb.Devices())
	assert.EqualValues(t, 512, hb.Alignment())
	p := newPool(t, hb)

	a, err := p.Alloc(0, 1000, 0)
	require.NoError(t, err)
	flags, err := hb.Flags(a)
	require.NoError(t, err, "the pool's block is pinned host memory")
	assert.EqualValues(t, driver.HostAllocPortable, flags, "portable by default")
	assert.Equal(t, -1, f.PtrDevice(a))
	assert.EqualValues(t, gocore.SmallBuffer, f.LiveBytes(-1))
	assert.Zero(t, f.LiveBytes(0))
	fakecuda.Write(a, []byte("staging"))
	assert.Equal(t, []byte("staging"), fakecuda.Read(a, 7))

	_, err = p.Alloc(1, 1, 0)
	require.ErrorIs(t, err, gocore.ErrInvalidDevice, "the host is the only device")
	_, err = hb.Alloc(1, 512, 0)
	require.ErrorIs(t, err, gocore.ErrInvalidDevice)

	// Events live on CUDA device 0 and follow its streams.
	f.SetManualEvents(true)
	require.NoError(t, p.RecordStream(a, 0x33))
	require.NoError(t, p.Free(a))
	assert.Equal(t, 1, f.LiveEvents(0))
	b, err := p.Alloc(0, 1000, 0)
	require.NoError(t, err)
	assert.NotEqual(t, a, b)
	f.CompleteStream(0x33)
	c, err := p.Alloc(0, 1000, 0)
	require.NoError(t, err)
	assert.Equal(t, a, c)

	total, avail, err := hb.Capacity(0)
	require.NoError(t, err)
	assert.Positive(t, total)
	assert.LessOrEqual(t, avail, total)
	_, _, err = hb.Capacity(1)
	require.ErrorIs(t, err, gocore.ErrInvalidDevice)

	require.NoError(t, p.Free(b))
	require.NoError(t, p.Free(c))
	closePool(t, p)
	assert.Zero(t, f.LiveBytes(-1))
	assert.Zero(t, f.LiveEvents(0))

	wc, err := NewHostBackend(drv, driver.HostAllocPortable|driver.HostAllocWriteCombined)
	require.NoError(t, err)
	h, err := wc.Alloc(0, 4096, 0)
	require.NoError(t, err)
	flags, err = wc.Flags(h)
	require.NoError(t, err)
	assert.EqualValues(t, driver.HostAllocPortable|driver.HostAllocWriteCombined, flags)
	require.NoError(t, wc.Free(0, h, 4096, 0))
	_, err = wc.Flags(h)
	require.Error(t, err, "freed memory is no longer pinned")
}

// A host backend on device 1 (a process using only that GPU) does
// everything under device 1's context and never creates one on device 0.
func TestHostBackendOnAnotherDevice(t *testing.T) {
	f, drv := setup(t)
	hb, err := NewHostBackendOn(drv, 0, 1)
	require.NoError(t, err)
	assert.Equal(t, 1, hb.CUDADevice())
	assert.Equal(t, 1, hb.Devices(), "still one device: the host")
	p := newPool(t, hb)
	f.SetManualEvents(true)
	a, err := p.Alloc(0, 1000, 0x21)
	require.NoError(t, err)
	flags, err := hb.Flags(a)
	require.NoError(t, err)
	assert.EqualValues(t, driver.HostAllocPortable, flags)
	require.NoError(t, p.RecordStream(a, 0x22))
	require.NoError(t, p.Free(a))
	assert.Equal(t, 1, f.LiveEvents(1), "device 1's event")
	f.CompleteAll()
	_, err = p.EmptyCache()
	require.NoError(t, err)
	closePool(t, p)
	assert.Zero(t, f.LiveBytes(-1))
	assert.Zero(t, f.LiveEvents(1))
	assert.Zero(t, f.Retained(0), "device 0's context was never created")
	assert.Equal(t, 1, f.Retained(1))

	// Its events cannot be recorded on another device's stream.
	s0, err := drv.StreamCreate(0, driver.StreamDefault)
	require.NoError(t, err)
	ev, err := hb.NewEvent(0)
	require.NoError(t, err)
	require.ErrorContains(t, hb.RecordEvent(ev, gocore.Stream(s0)), "CUDA_ERROR_INVALID_HANDLE")
	require.NoError(t, hb.DestroyEvent(ev))
	require.NoError(t, drv.StreamDestroy(0, s0))

	for _, dev := range []int{-1, 2} {
		_, err = NewHostBackendOn(drv, 0, dev)
		require.ErrorIs(t, err, gocore.ErrInvalidDevice)
	}
}

func TestParseMeminfo(t *testing.T) {
	total, avail, ok := parseMeminfo([]byte("MemTotal:       16384 kB\nMemFree:  1 kB\nMemAvailable:    8192 kB\n"))
	require.True(t, ok)
	assert.Equal(t, uint64(16384*1024), total)
	assert.Equal(t, uint64(8192*1024), avail)
	_, _, ok = parseMeminfo([]byte("MemTotal: 1 kB\n"))
	assert.False(t, ok)
}

// Many goroutines share one backend through their own pools and a shared
// one, on two devices: no races (run with -race), every block holds what
// was written to it, and nothing leaks.
func TestConcurrentPoolsOnTwoDevices(t *testing.T) {
	f, drv := setup(t)
	be := newBackend(t, drv)
	shared := newPool(t, be)
	const workers, rounds = 8, 150
	var wg sync.WaitGroup
	errs := make(chan error, 2*workers) // each worker sends at most twice
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			own, err := gocore.NewPool(gocore.Config{Backend: be, Name: fmt.Sprintf("worker%d", w)})
			if err != nil {
				errs <- err
				return
			}
			errs <- churn(own, shared, w, rounds)
			if _, err := own.Close(); err != nil {
				errs <- err
			}
		}(w)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	rep := closePool(t, shared)
	assert.Empty(t, rep.LiveBlocks)
	assert.Zero(t, f.LiveBytes(0))
	assert.Zero(t, f.LiveBytes(1))
	assert.Zero(t, f.LiveEvents(0)+f.LiveEvents(1))
	assert.Zero(t, be.LiveEvents())
	assert.Positive(t, f.Calls("cuEventRecord"), "record_stream paths were exercised")
}

type liveBlock struct {
	pool *gocore.Pool
	addr uint64
	size int
	tag  byte
}

func churn(own, shared *gocore.Pool, w, rounds int) error {
	rng := rand.New(rand.NewPCG(uint64(w), 42))
	var live []liveBlock
	for i := 0; i < rounds; i++ {
		p := own
		if i%3 == 0 {
			p = shared
		}
		dev := (w + i) % 2
		size := 1 + rng.IntN(64<<10)
		if i%17 == 0 {
			size = 2<<20 + rng.IntN(8<<20) // large pool
		}
		stream := gocore.Stream(1 + rng.IntN(3))
		addr, err := p.Alloc(dev, uint64(size), stream)
		if err != nil {
			return fmt.Errorf("worker %d: %w", w, err)
		}
		tag := byte(w*31 + i)
		n := min(size, 256)
		fakecuda.Write(addr, bytes.Repeat([]byte{tag}, n))
		fakecuda.Write(addr+uint64(size-n), bytes.Repeat([]byte{tag}, n))
		if rng.IntN(4) == 0 {
			if err := p.RecordStream(addr, stream+10); err != nil {
				return err
			}
		}
		live = append(live, liveBlock{p, addr, size, tag})
		for len(live) > 6 || (len(live) > 0 && rng.IntN(3) == 0) {
			j := rng.IntN(len(live))
			b := live[j]
			n := min(b.size, 256)
			want := bytes.Repeat([]byte{b.tag}, n)
			if got := fakecuda.Read(b.addr, n); !bytes.Equal(got, want) {
				return fmt.Errorf("worker %d: block %#x head overwritten", w, b.addr)
			}
			if got := fakecuda.Read(b.addr+uint64(b.size-n), n); !bytes.Equal(got, want) {
				return fmt.Errorf("worker %d: block %#x tail overwritten", w, b.addr)
			}
			if err := b.pool.Free(b.addr); err != nil {
				return err
			}
			live[j] = live[len(live)-1]
			live = live[:len(live)-1]
		}
	}
	for _, b := range live {
		if err := b.pool.Free(b.addr); err != nil {
			return err
		}
	}
	return nil
}
