//go:build cgo

package cuda

import (
	"errors"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/cuda/driver"
	"github.com/gpumempool/gpumempool/gocore/cuda/internal/fakecuda"
)

// newGrown makes an expandable segment of three chunks on device 0:
// 2 MiB from Alloc, then 2 and 2 more from Expand.
func newGrown(t *testing.T, be *VMMBackend) uint64 {
	t.Helper()
	a, err := be.Alloc(0, 2*mib, 0)
	require.NoError(t, err)
	require.NoError(t, be.Expand(0, a, 2*mib, 2*mib, 0))
	require.NoError(t, be.Expand(0, a, 4*mib, 2*mib, 0))
	return a
}

// The engine gives the free end of a grown segment back, chunk by chunk,
// keeping the reservation: the segment grows there again.
func TestVMMBackendShrinkThroughPool(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{Expandable: true, AccessDevices: []int{1}})
	p := newPool(t, be)
	const stream = 0x31

	// The engine maps torch's 20 MiB pages, each growth one chunk.
	a, err := p.Alloc(0, 40*mib, stream)
	require.NoError(t, err)
	fakecuda.Write(a, []byte("head"))
	b, err := p.Alloc(0, 40*mib, stream)
	require.NoError(t, err)
	c, err := p.Alloc(0, 60*mib, stream)
	require.NoError(t, err)
	require.Equal(t, []uint64{a + 40*mib, a + 80*mib}, []uint64{b, c}, "one segment, grown twice")
	require.EqualValues(t, 140*mib, f.LiveBytes(0))
	require.Equal(t, 7, f.VMMObjects(), "3 handles, 3 mappings, 1 reservation")

	require.NoError(t, p.Free(c))
	released, err := p.EmptyCache()
	require.NoError(t, err)
	assert.EqualValues(t, 60*mib, released, "the last chunk")
	assert.EqualValues(t, 80*mib, f.LiveBytes(0), "its physical memory went")
	assert.Equal(t, 5, f.VMMObjects(), "its handle and mapping went, the reservation stayed")
	assert.Equal(t, 1, f.Calls("cuMemUnmap"))
	assert.Equal(t, 1, f.Calls("cuMemRelease"))
	assert.Zero(t, f.Calls("cuMemAddressFree"))
	assert.EqualValues(t, stream, f.LastStream("cuStreamSynchronize"), "waited for the segment's stream before unmapping")
	assert.Equal(t, -1, f.Access(a+80*mib, 0), "no longer mapped")
	st := poolStats(t, p, 0)
	assert.EqualValues(t, 80*mib, st.ReservedBytes[0].Current)
	assert.Zero(t, st.Segment[0].Current, "torch does not count expandable segments")
	assert.Equal(t, []byte("head"), fakecuda.Read(a, 4))
	base, err := be.SegmentBase(0, b)
	require.NoError(t, err)
	assert.Equal(t, a, base)
	_, err = be.SegmentBase(0, a+80*mib)
	require.ErrorIs(t, err, gocore.ErrInvalidArgument, "beyond the shrunk segment")

	require.NoError(t, p.Free(b))
	released, err = p.EmptyCache()
	require.NoError(t, err)
	assert.EqualValues(t, 40*mib, released)
	assert.EqualValues(t, 40*mib, f.LiveBytes(0))
	assert.Equal(t, 3, f.VMMObjects(), "down to the first chunk")

	// Growing again maps right after it, in the same reservation.
	d, err := p.Alloc(0, 60*mib, stream)
	require.NoError(t, err)
	assert.Equal(t, a+40*mib, d)
	assert.Equal(t, 1, f.Calls("cuMemAddressReserve"), "the reservation was kept")
	assert.EqualValues(t, 100*mib, f.LiveBytes(0))
	assert.Equal(t, driver.MemAccessProtReadWrite, f.Access(a+40*mib, 1), "the peer got the regrown chunk too")
	fakecuda.Write(d+60*mib-4, []byte("tail"))
	assert.Equal(t, []byte("tail"), fakecuda.Read(d+60*mib-4, 4))

	// A free tail that ends inside a chunk: only whole chunks go, so
	// nothing here (the block at a+40 MiB holds the regrown chunk).
	require.NoError(t, p.Free(d))
	e, err := p.Alloc(0, 20*mib, stream)
	require.NoError(t, err)
	require.Equal(t, a+40*mib, e)
	unmaps := f.Calls("cuMemUnmap")
	released, err = p.EmptyCache()
	require.NoError(t, err)
	assert.Zero(t, released)
	assert.Equal(t, unmaps, f.Calls("cuMemUnmap"))
	assert.EqualValues(t, 100*mib, poolStats(t, p, 0).ReservedBytes[0].Current)

	require.NoError(t, p.Free(e))
	require.NoError(t, p.Free(a))
	released, err = p.EmptyCache()
	require.NoError(t, err)
	assert.EqualValues(t, 100*mib, released, "wholly free: the segment goes")
	assert.Zero(t, f.VMMObjects())
	closePool(t, p)
	require.NoError(t, be.Close())
}

// Out of memory, the engine gives back free tails before it retries.
func TestVMMBackendShrinkOnOutOfMemory(t *testing.T) {
	f, drv := setup(t, "FAKE_CUDA_CAPACITY", "167772160") // 160 MiB
	be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{Expandable: true})
	p := newPool(t, be)
	a, _ := withFreeTail(t, p, 1)
	c, err := p.Alloc(0, 100*mib, 2) // another stream: a new segment
	require.NoError(t, err)
	st := poolStats(t, p, 0)
	assert.EqualValues(t, 1, st.NumAllocRetries)
	assert.EqualValues(t, 140*mib, st.ReservedBytes[0].Current)
	assert.EqualValues(t, 140*mib, f.LiveBytes(0))
	freeAndClose(t, f, be, p, a, c)
}

// So does setting a release threshold.
func TestVMMBackendShrinkOnReleaseThreshold(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{Expandable: true})
	p := newPool(t, be)
	a, _ := withFreeTail(t, p, 0)
	require.NoError(t, p.SetReleaseThreshold(20*mib))
	assert.EqualValues(t, 40*mib, f.LiveBytes(0), "the tail went")
	assert.EqualValues(t, 40*mib, poolStats(t, p, 0).ReservedBytes[0].Current)
	freeAndClose(t, f, be, p, a)
}

// The Shrinker contract, directly.
func TestVMMBackendShrinkContract(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{Expandable: true})
	a := newGrown(t, be)
	for _, less := range []uint64{0, mib, 6 * mib, 8 * mib} {
		_, err := be.Shrink(0, a, 6*mib, less, 0)
		require.ErrorIs(t, err, gocore.ErrInvalidArgument, "less %d", less)
	}
	_, err := be.Shrink(0, a, 4*mib, 2*mib, 0)
	require.ErrorIs(t, err, gocore.ErrInvalidArgument, "not the segment's size")
	_, err = be.Shrink(1, a, 6*mib, 2*mib, 0)
	require.ErrorIs(t, err, gocore.ErrInvalidArgument, "another device's")
	_, err = be.Shrink(2, a, 6*mib, 2*mib, 0)
	require.ErrorIs(t, err, gocore.ErrInvalidDevice)
	assert.Equal(t, 7, f.VMMObjects())

	n, err := be.Shrink(0, a, 6*mib, 4*mib, 0x5)
	require.NoError(t, err)
	assert.EqualValues(t, 4*mib, n, "two chunks")
	assert.EqualValues(t, 0x5, f.LastStream("cuStreamSynchronize"))
	assert.Equal(t, 3, f.VMMObjects())
	require.ErrorIs(t, be.Free(0, a, 6*mib, 0), gocore.ErrInvalidArgument, "the segment is 2 MiB now")

	// One chunk of 4 MiB cannot go in 2 MiB steps.
	require.NoError(t, be.Expand(0, a, 2*mib, 4*mib, 0))
	syncs := f.Calls("cuStreamSynchronize")
	n, err = be.Shrink(0, a, 6*mib, 2*mib, 0)
	require.NoError(t, err)
	assert.Zero(t, n)
	assert.Equal(t, syncs, f.Calls("cuStreamSynchronize"), "nothing to unmap: no wait")
	n, err = be.Shrink(0, a, 6*mib, 4*mib, 0)
	require.NoError(t, err)
	assert.EqualValues(t, 4*mib, n)
	require.NoError(t, be.Free(0, a, 2*mib, 0))

	// An engine size off the device's granularity (like Alloc's rounding):
	// 3 MiB mapped as 4, grown to 5 with a chunk at 4 MiB; giving that
	// chunk back leaves 3 MiB, still mapped as 4.
	b, err := be.Alloc(0, 3*mib, 0)
	require.NoError(t, err)
	require.NoError(t, be.Expand(0, b, 3*mib, 2*mib, 0))
	assert.EqualValues(t, 6*mib, f.LiveBytes(0))
	n, err = be.Shrink(0, b, 5*mib, 2*mib, 0)
	require.NoError(t, err)
	assert.EqualValues(t, 2*mib, n)
	assert.EqualValues(t, 4*mib, f.LiveBytes(0))
	require.NoError(t, be.Expand(0, b, 3*mib, 2*mib, 0), "grows into the surplus and a new chunk")
	assert.EqualValues(t, 6*mib, f.LiveBytes(0))
	require.NoError(t, be.Free(0, b, 5*mib, 0))
	require.NoError(t, be.Close())
	assert.Zero(t, f.VMMObjects())

	// Without Expandable the backend is no Shrinker for the engine.
	plain := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{})
	c, err := plain.Alloc(0, 4*mib, 0)
	require.NoError(t, err)
	_, err = plain.Shrink(0, c, 4*mib, 2*mib, 0)
	require.ErrorIs(t, err, gocore.ErrUnsupported)
	require.NoError(t, plain.Free(0, c, 4*mib, 0))
	require.NoError(t, plain.Close())
}

// A Shrink excludes Free, Expand, exports and another Shrink of the same
// segment, and gives nothing back (no error: it is opportunistic) while an
// export is in flight.
func TestVMMBackendShrinkClaims(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{Expandable: true, IPC: true})
	a := newGrown(t, be)
	s, err := be.claim(opExport, 0, a, 0)
	require.NoError(t, err)
	n, err := be.Shrink(0, a, 6*mib, 2*mib, 0)
	require.NoError(t, err, "exporting: nothing now, the next release tries again")
	assert.Zero(t, n)
	assert.Equal(t, 7, f.VMMObjects(), "the skipped Shrink changed nothing")
	be.release(s, opExport)

	s, err = be.claim(opShrink, 0, a, 6*mib)
	require.NoError(t, err)
	require.ErrorIs(t, be.Free(0, a, 6*mib, 0), gocore.ErrInvalidArgument, "shrinking")
	require.ErrorIs(t, be.Expand(0, a, 6*mib, 2*mib, 0), gocore.ErrInvalidArgument, "shrinking")
	_, err = be.ExportSegment(0, a)
	require.ErrorIs(t, err, gocore.ErrInvalidArgument, "shrinking")
	n, err = be.Shrink(0, a, 6*mib, 2*mib, 0)
	require.NoError(t, err, "shrinking already: skipped")
	assert.Zero(t, n)
	be.release(s, opShrink)

	s, err = be.claim(opExpand, 0, a, 6*mib)
	require.NoError(t, err)
	n, err = be.Shrink(0, a, 6*mib, 2*mib, 0)
	require.NoError(t, err, "expanding: skipped")
	assert.Zero(t, n)
	be.release(s, opExpand)
	assert.Equal(t, 7, f.VMMObjects())

	n, err = be.Shrink(0, a, 6*mib, 2*mib, 0)
	require.NoError(t, err)
	assert.EqualValues(t, 2*mib, n)
	chunks, err := be.ExportSegment(0, a)
	require.NoError(t, err)
	assert.Len(t, chunks, 2, "the released chunk is no longer exported")
	for _, c := range chunks {
		require.NoError(t, syscall.Close(c.FD))
	}
	require.NoError(t, be.Free(0, a, 4*mib, 0))
	require.NoError(t, be.Close())
	assert.Zero(t, f.VMMObjects())
}

// Driver failures leave the backend's bookkeeping truthful.
func TestVMMBackendShrinkFailures(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{Expandable: true})
	a := newGrown(t, be)
	fakecuda.Write(a+6*mib-4, []byte("last"))

	// A failed wait or first unmap changes nothing.
	for _, fn := range []string{"cuStreamSynchronize", "cuMemUnmap"} {
		f.Fail(fn, driver.CodeIllegalAddress, 0)
		n, err := be.Shrink(0, a, 6*mib, 4*mib, 0)
		require.ErrorContains(t, err, fn)
		assert.Zero(t, n)
		f.Fail(fn, 0, 0)
		assert.Equal(t, 7, f.VMMObjects(), fn)
		assert.EqualValues(t, 6*mib, f.LiveBytes(0), fn)
	}
	assert.Equal(t, []byte("last"), fakecuda.Read(a+6*mib-4, 4))

	// The second unmap fails: the last chunk went, the middle one stays.
	f.Fail("cuMemUnmap", driver.CodeIllegalAddress, 1)
	n, err := be.Shrink(0, a, 6*mib, 4*mib, 0)
	f.Fail("cuMemUnmap", 0, 0)
	require.NoError(t, err, "memory went: the engine must learn it")
	assert.EqualValues(t, 2*mib, n)
	assert.Equal(t, 5, f.VMMObjects())
	assert.EqualValues(t, 4*mib, f.LiveBytes(0))

	// A failed release leaks that chunk's memory; the segment shrinks.
	f.Fail("cuMemRelease", driver.CodeIllegalAddress, 0)
	n, err = be.Shrink(0, a, 4*mib, 2*mib, 0)
	f.Fail("cuMemRelease", 0, 0)
	require.NoError(t, err)
	assert.EqualValues(t, 2*mib, n)
	assert.EqualValues(t, 4*mib, f.LiveBytes(0), "the leaked handle")
	assert.Equal(t, 4, f.VMMObjects(), "the leaked handle, the first chunk's handle and mapping, the reservation")

	require.NoError(t, be.Free(0, a, 2*mib, 0))
	assert.Zero(t, be.LiveSegments())
	err = be.Close()
	require.Error(t, err)
	assert.ErrorContains(t, err, "kept mapped")
	assert.ErrorContains(t, err, "leaked")
	assert.ErrorContains(t, err, "cuMemRelease")
}

// Through the pool, a failed unmap is an error of EmptyCache and leaves the
// pool as it was; the next EmptyCache gives the tail back.
func TestVMMBackendShrinkFailureThroughPool(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{Expandable: true})
	p := newPool(t, be)
	a, b := withFreeTail(t, p, 0)

	f.Fail("cuMemUnmap", driver.CodeIllegalAddress, 0)
	released, err := p.EmptyCache()
	f.Fail("cuMemUnmap", 0, 0)
	require.ErrorContains(t, err, "cuMemUnmap")
	assert.Zero(t, released)
	assert.EqualValues(t, 120*mib, poolStats(t, p, 0).ReservedBytes[0].Current)
	assert.EqualValues(t, 120*mib, f.LiveBytes(0))
	require.NoError(t, p.CheckInvariants())

	released, err = p.EmptyCache()
	require.NoError(t, err)
	assert.EqualValues(t, 80*mib, released)
	assert.EqualValues(t, 40*mib, f.LiveBytes(0))
	c, err := p.Alloc(0, 80*mib, 0)
	require.NoError(t, err)
	assert.Equal(t, b, c, "grown again where it was")
	freeAndClose(t, f, be, p, a, c)
}

// Giving a free tail back waits for the segment's stream, which a capture
// forbids: while the segment's stream captures, or it is the legacy default
// stream and another thread captures on a blocking stream, Shrink fails
// saying so without touching the stream or the segment, and the tail goes
// back once the capture is over.
func TestVMMBackendShrinkDuringCapture(t *testing.T) {
	for _, c := range []struct {
		name              string
		stream, capturing uint64
	}{{"its stream captures", 0x35, 0x35}, {"legacy stream, another capture", 0, 0x36}} {
		t.Run(c.name, func(t *testing.T) {
			f, drv := setup(t)
			be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{Expandable: true})
			p := newPool(t, be)
			a, _ := withFreeTail(t, p, gocore.Stream(c.stream))
			f.SetStreamCapturing(c.capturing, true)
			released, err := p.EmptyCache()
			assert.Zero(t, f.CaptureViolations(), "the shrink used the stream during a capture: %v", err)
			require.ErrorIs(t, err, ErrCaptureUnderway)
			require.ErrorContains(t, err, "capturing a CUDA graph")
			assert.Zero(t, released)
			assert.Zero(t, f.Calls("cuMemUnmap"))
			assert.EqualValues(t, 120*mib, poolStats(t, p, 0).ReservedBytes[0].Current)
			require.NoError(t, p.CheckInvariants())

			f.SetStreamCapturing(c.capturing, false)
			released, err = p.EmptyCache()
			require.NoError(t, err)
			assert.EqualValues(t, 80*mib, released)
			freeAndClose(t, f, be, p, a)
		})
	}
}

// A Shrink racing a Free and exports of its segment: each either goes
// through or is refused, and nothing leaks.
func TestVMMBackendShrinkRacesFreeAndExport(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{Expandable: true, IPC: true})
	var shrunk, refused atomic.Int32
	for round := 0; round < 50; round++ {
		a := newGrown(t, be)
		var wg sync.WaitGroup
		wg.Add(3)
		go func() {
			defer wg.Done()
			n, err := be.Shrink(0, a, 6*mib, 2*mib, 0)
			switch {
			case err != nil: // the segment was freed first
				assert.ErrorIs(t, err, gocore.ErrInvalidArgument)
				assert.Zero(t, n)
				refused.Add(1)
			case n == 0: // an export was under way: skipped
				refused.Add(1)
			default:
				assert.EqualValues(t, 2*mib, n)
				shrunk.Add(1)
			}
		}()
		go func() {
			defer wg.Done()
			for i := 0; i < 5; i++ {
				chunks, err := be.ExportSegment(0, a)
				if err != nil {
					assert.ErrorIs(t, err, gocore.ErrInvalidArgument)
					continue
				}
				assert.NotEmpty(t, chunks)
				for _, c := range chunks {
					assert.NoError(t, syscall.Close(c.FD))
				}
			}
		}()
		go func() {
			defer wg.Done()
			for { // the engine's size: 6 MiB, or 4 once shrunk
				if be.Free(0, a, 6*mib, 0) == nil || be.Free(0, a, 4*mib, 0) == nil {
					return
				}
				runtime.Gosched()
			}
		}()
		wg.Wait()
		require.Zero(t, be.LiveSegments())
		require.Zero(t, f.VMMObjects(), "round %d", round)
	}
	t.Logf("%d shrinks went through, %d were refused or skipped", shrunk.Load(), refused.Load())
	require.NoError(t, be.Close())
}

// Pools over one backend churn while another goroutine exports their
// segments: EmptyCache may be refused for a segment being exported, and
// nothing is lost.
func TestVMMBackendShrinkRacesExportsThroughPool(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{Expandable: true, IPC: true})
	p := newPool(t, be)
	head, err := p.Alloc(0, 20*mib, 0) // one 20 MiB page
	require.NoError(t, err)
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-done:
				return
			default:
			}
			chunks, err := be.ExportSegment(0, head)
			if err != nil {
				assert.ErrorIs(t, err, gocore.ErrInvalidArgument)
				continue
			}
			for _, c := range chunks {
				assert.NoError(t, syscall.Close(c.FD))
			}
		}
	}()
	for i := 0; i < 200; i++ {
		b, err := p.Alloc(0, uint64(2+i%5)*10*mib, 0)
		require.NoError(t, err)
		require.NoError(t, p.Free(b))
		if _, err := p.EmptyCache(); err != nil && !errors.Is(err, gocore.ErrInvalidArgument) {
			t.Fatalf("EmptyCache: %v", err)
		}
	}
	close(done)
	wg.Wait()
	_, err = p.EmptyCache()
	require.NoError(t, err)
	assert.EqualValues(t, 20*mib, f.LiveBytes(0), "only the head's chunk is left")
	assert.EqualValues(t, 20*mib, poolStats(t, p, 0).ReservedBytes[0].Current)
	freeAndClose(t, f, be, p, head)
}

// A device whose granularity (4 MiB) is coarser than the 2 MiB the engine
// sized its first segment with before the device was known: releasing the
// cache works (the tail is measured in whole 4 MiB granules), and the
// segment grows and goes back cleanly.
func TestVMMBackendShrinkWithCoarserDeviceGranularity(t *testing.T) {
	f, drv := setup(t)
	f.SetGranularity(2*mib, 4*mib)
	be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{Expandable: true})
	p := newPool(t, be)
	a, err := p.Alloc(0, 5*mib, 0) // the engine's segment is 6 MiB; the backend maps 8
	require.NoError(t, err)
	_, err = p.EmptyCache()
	require.NoError(t, err, "a live block and a free tail smaller than a granule")
	b, err := p.Alloc(0, 6*mib, 0)
	require.NoError(t, err)
	require.NoError(t, p.Free(b))
	_, err = p.EmptyCache()
	require.NoError(t, err)
	require.NoError(t, p.CheckInvariants())
	freeAndClose(t, f, be, p, a)
}

// shrinkRacer plays another pool (another thread) that uses device 1 for
// the first time between the engine's reading of Granularity() and its
// Shrink call: the backend learns a coarser granularity in between.
type shrinkRacer struct {
	*VMMBackend
	raced bool
	t     *testing.T
}

func (r *shrinkRacer) Shrink(dev int, addr, size, less uint64, stream gocore.Stream) (uint64, error) {
	if !r.raced {
		r.raced = true
		a, err := r.VMMBackend.Alloc(1, 8*mib, 0) // first use of device 1: its coarser granularity
		require.NoError(r.t, err)
		require.NoError(r.t, r.VMMBackend.Free(1, a, 8*mib, 0))
	}
	return r.VMMBackend.Shrink(dev, addr, size, less, stream)
}

// The engine reads the granularity once for a shrink request and judges the
// answer by it. Should another device's first use raise the backend's
// Granularity in between, the request is still a whole number of the
// caller's granules and of the segment's device's: Shrink must neither
// refuse it nor answer in the new, coarser unit (more than asked for).
func TestVMMBackendShrinkAfterAnotherDeviceRaisedGranularity(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{Expandable: true})
	r := &shrinkRacer{VMMBackend: be, t: t}
	p, err := gocore.NewPool(gocore.Config{Backend: r, Name: t.Name()})
	require.NoError(t, err)
	head, err := p.Alloc(0, 20*mib, 0x31) // device 0 learns 2 MiB; one 20 MiB page
	require.NoError(t, err)
	tail, err := p.Alloc(0, 20*mib, 0x31) // grows the segment by one 20 MiB chunk
	require.NoError(t, err)
	require.NoError(t, p.Free(tail))
	f.SetGranularity(2*mib, 8*mib) // device 1 will report 8 MiB

	released, err := p.EmptyCache()
	assert.NoError(t, err, "a 20 MiB tail asked for in the caller's 2 MiB granules")
	assert.EqualValues(t, 20*mib, released, "not a whole number of 8 MiB granules")
	require.True(t, r.raced)
	assert.EqualValues(t, 8*mib, be.Granularity())
	assert.EqualValues(t, 20*mib, f.LiveBytes(0))
	require.NoError(t, p.CheckInvariants())
	freeAndClose(t, f, be, p, head)
}

// The same, directly: once device 1 raised Granularity to 4 MiB, device 0's
// segment still shrinks in its 2 MiB granules, answering in whole granules
// of what was asked (at most less, a multiple of the granularity the caller
// read), and a less off device 0's granularity is still refused.
func TestVMMBackendShrinkInTheDevicesGranularity(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{Expandable: true})
	a := newGrown(t, be) // 2+2+2 MiB on device 0
	require.NoError(t, be.Expand(0, a, 6*mib, 2*mib, 0))
	require.NoError(t, be.Expand(0, a, 8*mib, 2*mib, 0)) // five 2 MiB chunks
	f.SetGranularity(2*mib, 4*mib)
	b, err := be.Alloc(1, 4*mib, 0)
	require.NoError(t, err)
	require.EqualValues(t, 4*mib, be.Granularity())

	_, err = be.Shrink(0, a, 10*mib, mib, 0)
	require.ErrorIs(t, err, gocore.ErrInvalidArgument, "not a whole number of device 0's granules")
	n, err := be.Shrink(0, a, 10*mib, 6*mib, 0) // 2 MiB granules: not a multiple of 4
	require.NoError(t, err)
	assert.EqualValues(t, 6*mib, n, "three chunks")
	n, err = be.Shrink(0, a, 4*mib, 2*mib, 0)
	require.NoError(t, err)
	assert.EqualValues(t, 2*mib, n)
	assert.EqualValues(t, 2*mib, f.LiveBytes(0))
	require.NoError(t, be.Free(0, a, 2*mib, 0))
	require.NoError(t, be.Free(1, b, 4*mib, 0))
	require.NoError(t, be.Close())
	assert.Zero(t, f.VMMObjects())
}

// freeAndClose frees blocks, closes the pool and the backend, and checks
// that the driver holds no VMM object any more.
func freeAndClose(t *testing.T, f *fakecuda.Fake, be *VMMBackend, p *gocore.Pool, blocks ...uint64) {
	t.Helper()
	for _, b := range blocks {
		require.NoError(t, p.Free(b))
	}
	closePool(t, p)
	require.NoError(t, be.Close())
	assert.Zero(t, f.VMMObjects())
}

// withFreeTail allocates a 40 MiB block on stream (two of torch's 20 MiB
// pages), grows its expandable segment by an 80 MiB block and frees that
// one: a segment whose free tail can go back. It returns the 40 MiB block
// and where the tail starts.
func withFreeTail(t *testing.T, p *gocore.Pool, stream gocore.Stream) (head, tail uint64) {
	t.Helper()
	head, err := p.Alloc(0, 40*mib, stream)
	require.NoError(t, err)
	tail, err = p.Alloc(0, 80*mib, stream)
	require.NoError(t, err)
	require.NoError(t, p.Free(tail))
	return head, tail
}
