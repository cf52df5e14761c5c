//go:build cgo

package cuda

import (
	"bytes"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/cuda/driver"
	"github.com/gpumempool/gpumempool/gocore/cuda/internal/fakecuda"
)

func TestVMMBackendPoolCycle(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{})
	checkGPUBackend(t, be, "vmm", drv)
	assert.False(t, be.Expandable())
	assert.EqualValues(t, 2*mib, be.Granularity())
	opts := be.Options()
	assert.Equal(t, VMMLocationDevice, opts.Location, "defaults filled in")
	assert.Equal(t, VMMGranularityRecommended, opts.Granularity)
	p := newPool(t, be)

	const stream = 0x11
	a, err := p.Alloc(1, 1000, stream)
	require.NoError(t, err)
	assert.EqualValues(t, gocore.SmallBuffer, f.LiveBytes(1), "cuMemCreate on device 1")
	assert.Zero(t, f.LiveBytes(0))
	assert.Equal(t, 3, f.VMMObjects(), "a handle, a reservation, a mapping")
	assert.Zero(t, a%(2*mib), "reservations start on the granularity")
	assert.Equal(t, driver.MemAccessProtReadWrite, f.Access(a, 1), "the owning device may read and write")
	assert.Equal(t, driver.MemAccessProtNone, f.Access(a, 0), "no peer was asked for")
	locType, locID, handles := f.LastMemCreate()
	assert.Equal(t, [3]int{driver.MemLocationTypeDevice, 1, driver.MemHandleTypeNone}, [3]int{locType, locID, handles})
	pattern := bytes.Repeat([]byte{0x5A, 0xA5}, 500)
	fakecuda.Write(a, pattern)
	assert.Equal(t, pattern, fakecuda.Read(a, len(pattern)))

	checkCarveAndReuse(t, f, p, a, 1, stream, "cuMemCreate")
	assert.Equal(t, 1, be.LiveSegments())

	released, err := p.EmptyCache()
	require.NoError(t, err)
	assert.EqualValues(t, gocore.SmallBuffer, released)
	assert.Zero(t, f.VMMObjects(), "unmapped, released, address range freed")
	assert.Zero(t, f.LiveBytes(1))
	assert.EqualValues(t, stream, f.LastStream("cuStreamSynchronize"), "waited for the segment's stream before unmapping")
	assert.Zero(t, be.LiveSegments())

	// A block used on another stream is not unmapped before that stream's
	// work is done: EmptyCache waits for the engine's event (as torch's
	// empty_cache synchronizes its pending frees), then for its own stream.
	f.SetManualEvents(true)
	d, err := p.Alloc(0, 4*mib, 0x12)
	require.NoError(t, err)
	require.NoError(t, p.RecordStream(d, 0x13))
	require.NoError(t, p.Free(d))
	assert.Equal(t, 3, f.VMMObjects(), "still in use on stream 0x13")
	assert.Equal(t, 1, be.LiveEvents())
	waits := f.Calls("cuEventSynchronize")
	_, err = p.EmptyCache()
	require.NoError(t, err)
	assert.Equal(t, waits+1, f.Calls("cuEventSynchronize"), "waited for stream 0x13's event")
	assert.Zero(t, f.VMMObjects())
	assert.EqualValues(t, 0x12, f.LastStream("cuStreamSynchronize"))

	closePool(t, p)
	assert.Zero(t, be.LiveEvents())
	require.NoError(t, be.Close())
	assert.Zero(t, f.VMMObjects())
}

func TestVMMBackendGranularityRounding(t *testing.T) {
	f, drv := setup(t)
	f.SetGranularity(2*mib, 8*mib)

	rec := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{})
	assert.EqualValues(t, DefaultVMMGranularity, rec.Granularity(), "no device asked yet")
	a, err := rec.Alloc(0, 2*mib, 0)
	require.NoError(t, err)
	assert.EqualValues(t, 8*mib, rec.Granularity(), "device 0's, once used")
	assert.EqualValues(t, 8*mib, f.LiveBytes(0), "mapped in the recommended granularity")
	assert.Zero(t, a%(8*mib), "the reservation is aligned to the granularity we use, not the driver's default")
	fakecuda.Write(a+8*mib-4, []byte("tail"))
	assert.Equal(t, []byte("tail"), fakecuda.Read(a+8*mib-4, 4), "the rounded size is mapped")
	require.ErrorIs(t, rec.Free(0, a, 8*mib, 0), gocore.ErrInvalidArgument, "the segment keeps the engine's size")
	require.NoError(t, rec.Free(0, a, 2*mib, 0))
	assert.Zero(t, f.VMMObjects())

	// Through a pool: the engine reserves 2 MiB, the device maps 8.
	p := newPool(t, rec)
	_, err = p.Alloc(0, 1000, 0)
	require.NoError(t, err)
	assert.EqualValues(t, gocore.SmallBuffer, poolStats(t, p, 0).ReservedBytes[0].Current)
	assert.EqualValues(t, 8*mib, f.LiveBytes(0))
	closePool(t, p)
	assert.Zero(t, f.VMMObjects())
	require.NoError(t, rec.Close())

	minimum := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{Granularity: VMMGranularityMinimum})
	assert.EqualValues(t, 2*mib, minimum.Granularity())
	a, err = minimum.Alloc(0, 3*mib, 0)
	require.NoError(t, err)
	assert.EqualValues(t, 4*mib, f.LiveBytes(0), "3 MiB rounded up to the minimum granularity")
	require.NoError(t, minimum.Free(0, a, 3*mib, 0))
	require.NoError(t, minimum.Close())
	assert.Zero(t, f.VMMObjects())
}

func TestVMMBackendAccess(t *testing.T) {
	f, drv := setup(t, "FAKE_CUDA_DEVICES", "3")
	be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{AccessDevices: []int{2, 2, 0}})
	assert.Equal(t, []int{2, 0}, be.Options().AccessDevices, "deduplicated")

	a, err := be.Alloc(0, 2*mib, 0)
	require.NoError(t, err)
	assert.Equal(t, driver.MemAccessProtReadWrite, f.Access(a, 0))
	assert.Equal(t, driver.MemAccessProtReadWrite, f.Access(a, 2))
	assert.Equal(t, driver.MemAccessProtNone, f.Access(a, 1))

	b, err := be.Alloc(2, 2*mib, 0)
	require.NoError(t, err)
	assert.Equal(t, -2, f.PtrDevice(b), "VMM ranges are no cuMemAlloc allocations")
	assert.EqualValues(t, 2*mib, f.LiveBytes(2))
	assert.Equal(t, driver.MemAccessProtReadWrite, f.Access(b, 2))
	assert.Equal(t, driver.MemAccessProtReadWrite, f.Access(b, 0))
	assert.Equal(t, driver.MemAccessProtNone, f.Access(b, 1))

	require.NoError(t, be.Free(0, a, 2*mib, 0))
	require.NoError(t, be.Free(2, b, 2*mib, 0))
	require.NoError(t, be.Close())
	assert.Zero(t, f.VMMObjects())
}

func TestVMMBackendHostNUMA(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{Location: VMMLocationHostNUMA, NUMANode: 1, AccessDevices: []int{1}, IPC: true})
	p := newPool(t, be)
	a, err := p.Alloc(0, 1000, 0) // device 0, NUMA node 1: the two ids differ
	require.NoError(t, err)
	locType, locID, handles := f.LastMemCreate()
	assert.Equal(t, driver.MemLocationTypeHostNUMA, locType, "the location reached cuMemCreate")
	assert.Equal(t, 1, locID, "the NUMA node, not the device")
	assert.Equal(t, driver.MemHandleTypePosixFD, handles)
	assert.Zero(t, f.LiveBytes(0)+f.LiveBytes(1), "host memory is charged to no device")
	assert.Equal(t, 3, f.VMMObjects())
	assert.Equal(t, driver.MemAccessProtReadWrite, f.Access(a, 0), "the device the engine asked for")
	assert.Equal(t, driver.MemAccessProtReadWrite, f.Access(a, 1), "and the peers")
	fakecuda.Write(a, []byte("egm"))
	assert.Equal(t, []byte("egm"), fakecuda.Read(a, 3))
	_, _, err = be.Capacity(0)
	require.ErrorIs(t, err, gocore.ErrUnsupported)

	require.NoError(t, p.Free(a))
	closePool(t, p)
	assert.Zero(t, f.VMMObjects())
	require.NoError(t, be.Close())
}

// A device whose driver says it cannot put VMM memory on a host NUMA node
// (CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0)
// gets a clear ErrUnsupported before any cuMemCreate; one that says it can,
// or a driver older than the attribute, goes ahead.
func TestVMMBackendHostNUMAUnsupportedDevice(t *testing.T) {
	f, drv := setup(t)
	f.SetDeviceAttribute(0, driver.DeviceAttrHostNUMAVMMSupported, 0)
	f.SetDeviceAttribute(1, driver.DeviceAttrHostNUMAVMMSupported, 1)
	be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{Location: VMMLocationHostNUMA})
	creates := f.Calls("cuMemCreate")
	_, err := be.Alloc(0, 2*mib, 0)
	require.ErrorIs(t, err, gocore.ErrUnsupported)
	assert.Contains(t, err.Error(), "does not support host NUMA memory")
	assert.Equal(t, creates, f.Calls("cuMemCreate"), "refused before cuMemCreate")
	a, err := be.Alloc(1, 2*mib, 0)
	require.NoError(t, err, "device 1 supports it")
	require.NoError(t, be.Free(1, a, 2*mib, 0))
	require.NoError(t, be.Close())

	// Device memory does not ask.
	dev := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{})
	a, err = dev.Alloc(0, 2*mib, 0)
	require.NoError(t, err)
	require.NoError(t, dev.Free(0, a, 2*mib, 0))
	require.NoError(t, dev.Close())
}

func TestVMMBackendExpandable(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{Expandable: true, AccessDevices: []int{1}})
	assert.True(t, be.Expandable())
	p := newPool(t, be)
	const stream = 0x21

	a, err := p.Alloc(0, 30*mib, stream) // two 20 MiB pages
	require.NoError(t, err)
	head := bytes.Repeat([]byte("before growth "), 100)
	fakecuda.Write(a, head)
	fakecuda.Write(a+30*mib-4, []byte("edge"))

	b, err := p.Alloc(0, 30*mib, stream)
	require.NoError(t, err)
	assert.Equal(t, a+30*mib, b, "the second block follows the first in the grown segment")
	st := poolStats(t, p, 0)
	assert.EqualValues(t, 1, st.NumExpansions)
	assert.Zero(t, st.Segment[0].Current, "torch does not count expandable segments")
	assert.EqualValues(t, 60*mib, st.ReservedBytes[0].Current)
	assert.Equal(t, 2, f.Calls("cuMemCreate"), "the first chunk and the growth")
	assert.Equal(t, 1, f.Calls("cuMemAddressReserve"), "one reservation")
	assert.EqualValues(t, 60*mib, f.LiveBytes(0))
	assert.Equal(t, head, fakecuda.Read(a, len(head)), "what was written before the growth is still there")
	assert.Equal(t, []byte("edge"), fakecuda.Read(a+30*mib-4, 4))
	// b spans the boundary between the two chunks at a+40 MiB.
	across := []byte("across the chunk boundary")
	fakecuda.Write(a+40*mib-10, across)
	assert.Equal(t, across, fakecuda.Read(a+40*mib-10, len(across)))
	assert.Equal(t, driver.MemAccessProtReadWrite, f.Access(a+40*mib, 0), "the new chunk got the owner's access")
	assert.Equal(t, driver.MemAccessProtReadWrite, f.Access(a+40*mib, 1), "and the peers'")

	require.NoError(t, p.Free(a))
	require.NoError(t, p.Free(b))
	_, err = p.EmptyCache()
	require.NoError(t, err)
	assert.Equal(t, 2, f.Calls("cuMemUnmap"), "one unmap per chunk")
	assert.Equal(t, 2, f.Calls("cuMemRelease"), "every chunk released")
	assert.Equal(t, 1, f.Calls("cuMemAddressFree"))
	assert.Zero(t, f.VMMObjects())
	assert.Zero(t, f.LiveBytes(0))
	closePool(t, p)
	require.NoError(t, be.Close())
}

func TestVMMBackendExpandBeyondReservation(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{Expandable: true, ReserveBytes: 40 * mib})
	p := newPool(t, be)
	a, err := p.Alloc(0, 30*mib, 0) // two 20 MiB pages of the 40 MiB reservation
	require.NoError(t, err)
	b, err := p.Alloc(0, 30*mib, 0)
	require.NoError(t, err, "a new segment when the growing one is full")
	assert.NotEqual(t, a+30*mib, b)
	st := poolStats(t, p, 0)
	assert.Zero(t, st.NumExpansions)
	assert.EqualValues(t, 80*mib, st.ReservedBytes[0].Current)
	assert.Equal(t, 6, f.VMMObjects(), "two segments of one chunk each; nothing left over from the refused growth")
	assert.Equal(t, 2, f.Calls("cuMemCreate"))

	// Directly: beyond the reservation is an out-of-memory condition and
	// changes nothing.
	err = be.Expand(0, a, 40*mib, 2*mib, 0)
	require.ErrorIs(t, err, gocore.ErrBackendOutOfMemory)
	assert.Contains(t, err.Error(), "beyond the 41943040 bytes reserved")
	require.NoError(t, p.Free(a))
	require.NoError(t, p.Free(b))
	closePool(t, p)
	assert.Zero(t, f.VMMObjects())
	require.NoError(t, be.Close())
}

// Sizes within a granule of 2^64 wrap to 0 when rounded up to the
// granularity. Expand checked its sum for wrapping but not the rounding: a
// growth to 16 EiB needed "0 bytes", fit the 64 MiB reservation and
// "succeeded" with nothing mapped, recording a 16 EiB segment. It is out of
// memory, and changes nothing.
func TestVMMBackendExpandRoundingOverflow(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{Expandable: true, ReserveBytes: 64 * mib})
	a, err := be.Alloc(0, 2*mib, 0)
	require.NoError(t, err)
	for _, extra := range []uint64{math.MaxUint64 - 2*mib, math.MaxUint64 - 3*mib, math.MaxUint64 - 2*mib + 1} {
		err = be.Expand(0, a, 2*mib, extra, 0)
		assert.ErrorIs(t, err, gocore.ErrBackendOutOfMemory, "16 EiB cannot fit a 64 MiB reservation (extra %#x)", extra)
		assert.EqualValues(t, 2*mib, f.LiveBytes(0), "nothing was mapped")
	}
	if err == nil {
		require.NoError(t, be.Free(0, a, math.MaxUint64, 0))
	} else {
		require.NoError(t, be.Free(0, a, 2*mib, 0), "the segment kept its size")
	}
	require.NoError(t, be.Close())
	assert.Zero(t, f.VMMObjects())
}

// The same wrap in Alloc: a size or a ReserveBytes within a granule of 2^64
// rounded up to 0 bytes to map or reserve. Such a size is out of memory; such
// a ReserveBytes is an invalid option. Nothing is created either way.
func TestVMMBackendAllocRoundingOverflow(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{Expandable: true})
	_, err := be.Alloc(0, math.MaxUint64-mib, 0)
	require.ErrorIs(t, err, gocore.ErrBackendOutOfMemory)
	require.NoError(t, be.Close())

	huge := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{Expandable: true, ReserveBytes: math.MaxUint64 - mib})
	_, err = huge.Alloc(0, 2*mib, 0)
	require.ErrorIs(t, err, gocore.ErrInvalidArgument)
	require.NotErrorIs(t, err, gocore.ErrBackendOutOfMemory)
	assert.ErrorContains(t, err, "ReserveBytes")
	require.NoError(t, huge.Close())
	assert.Zero(t, f.VMMObjects())
	assert.Zero(t, f.Calls("cuMemCreate"))
}

func TestVMMBackendExpandFailures(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{Expandable: true, AccessDevices: []int{1}})
	p := newPool(t, be)
	a, err := p.Alloc(0, 30*mib, 0) // two 20 MiB pages: a 10 MiB free tail
	require.NoError(t, err)
	fakecuda.Write(a, []byte("kept"))
	require.Equal(t, 3, f.VMMObjects())

	// Out of device memory: the growth and the new segment both fail, the
	// engine reports an OutOfMemoryError, the segment is as it was.
	f.Fail("cuMemCreate", driver.CodeOutOfMemory, 0)
	_, err = p.Alloc(0, 30*mib, 0)
	var oom *gocore.OutOfMemoryError
	require.ErrorAs(t, err, &oom)
	assert.Equal(t, "vmm", oom.Backend)
	assert.Equal(t, 3, f.VMMObjects())
	assert.Zero(t, poolStats(t, p, 0).NumExpansions)
	f.Fail("cuMemCreate", 0, 0)

	// Failures after the memory was created release it again.
	for _, fn := range []string{"cuMemMap", "cuMemSetAccess"} {
		releases := f.Calls("cuMemRelease")
		f.Fail(fn, driver.CodeInvalidValue, 0)
		_, err = p.Alloc(0, 30*mib, 0)
		require.Error(t, err, fn)
		assert.Contains(t, err.Error(), fn)
		assert.Equal(t, releases+1, f.Calls("cuMemRelease"), "%s: the new chunk was released", fn)
		assert.Equal(t, 3, f.VMMObjects(), "%s: nothing left over", fn)
		f.Fail(fn, 0, 0)
	}
	assert.Equal(t, []byte("kept"), fakecuda.Read(a, 4))
	assert.Equal(t, driver.MemAccessProtReadWrite, f.Access(a, 1))

	b, err := p.Alloc(0, 30*mib, 0)
	require.NoError(t, err)
	assert.Equal(t, a+30*mib, b, "grows once the driver cooperates")
	assert.EqualValues(t, 1, poolStats(t, p, 0).NumExpansions)

	// The Expander contract, directly.
	require.ErrorIs(t, be.Expand(0, a, 40*mib, 2*mib, 0), gocore.ErrInvalidArgument, "not the segment's size (60 MiB)")
	require.ErrorIs(t, be.Expand(0, a+mib, 60*mib, 2*mib, 0), gocore.ErrInvalidArgument, "not a segment's base")
	require.ErrorIs(t, be.Expand(1, a, 60*mib, 2*mib, 0), gocore.ErrInvalidArgument, "another device's")
	require.ErrorIs(t, be.Free(0, a, 40*mib, 0), gocore.ErrInvalidArgument, "a grown segment is freed with its grown size")

	require.NoError(t, p.Free(a))
	require.NoError(t, p.Free(b))
	closePool(t, p)
	assert.Zero(t, f.VMMObjects())
	require.NoError(t, be.Close())

	plain := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{})
	c, err := plain.Alloc(0, 2*mib, 0)
	require.NoError(t, err)
	require.ErrorIs(t, plain.Expand(0, c, 2*mib, 2*mib, 0), gocore.ErrUnsupported)
	require.NoError(t, plain.Free(0, c, 2*mib, 0))
	require.NoError(t, plain.Close())
}

func TestVMMBackendAllocAndFreeFailures(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{})
	_, err := be.Alloc(2, 2*mib, 0)
	require.ErrorIs(t, err, gocore.ErrInvalidDevice)
	_, err = be.Alloc(0, 0, 0)
	require.ErrorIs(t, err, gocore.ErrInvalidArgument)

	f.Fail("cuMemCreate", driver.CodeOutOfMemory, 0)
	_, err = be.Alloc(0, 2*mib, 0)
	require.ErrorIs(t, err, gocore.ErrBackendOutOfMemory, "the engine's release-and-retry path")
	f.Fail("cuMemCreate", 0, 0)
	for _, fn := range []string{"cuMemAddressReserve", "cuMemMap", "cuMemSetAccess"} {
		f.Fail(fn, driver.CodeInvalidValue, 0)
		_, err = be.Alloc(0, 2*mib, 0)
		require.Error(t, err, fn)
		assert.Contains(t, err.Error(), fn)
		assert.Zero(t, f.VMMObjects(), "%s: everything created was released", fn)
		f.Fail(fn, 0, 0)
	}

	a, err := be.Alloc(0, 2*mib, 0x9)
	require.NoError(t, err)
	// A failed wait changes nothing: the segment stays and can be freed later.
	f.Fail("cuStreamSynchronize", driver.CodeIllegalAddress, 0)
	require.Error(t, be.Free(0, a, 2*mib, 0x9))
	assert.Equal(t, 3, f.VMMObjects())
	f.Fail("cuStreamSynchronize", 0, 0)
	f.Fail("cuMemUnmap", driver.CodeInvalidValue, 0)
	require.Error(t, be.Free(0, a, 2*mib, 0x9))
	assert.Equal(t, 3, f.VMMObjects())
	f.Fail("cuMemUnmap", 0, 0)
	fakecuda.Write(a, []byte("still mapped"))

	// Close reports the leak and leaves it mapped; Free still works.
	err = be.Close()
	require.Error(t, err)
	assert.Contains(t, err.Error(), "1 segments never freed")
	assert.Equal(t, []byte("still mapped"), fakecuda.Read(a, 12))
	require.NoError(t, be.Free(0, a, 2*mib, 0x9))
	assert.Zero(t, f.VMMObjects())
	require.ErrorIs(t, be.Close(), ErrBackendClosed)
	_, err = be.Alloc(0, 2*mib, 0)
	require.ErrorIs(t, err, ErrBackendClosed)
}

func TestVMMBackendFreeFailureAfterUnmapIsReportedAtClose(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{})
	a, err := be.Alloc(0, 2*mib, 0)
	require.NoError(t, err)
	f.Fail("cuMemAddressFree", driver.CodeInvalidValue, 0)
	require.NoError(t, be.Free(0, a, 2*mib, 0), "unmapped: the segment is gone for the engine")
	f.Fail("cuMemAddressFree", 0, 0)
	assert.Zero(t, be.LiveSegments())
	err = be.Close()
	require.Error(t, err)
	assert.Contains(t, err.Error(), "cuMemAddressFree")
}

// An export in flight keeps Free from releasing the handles it exports but
// lets the segment grow; a Free in flight excludes everything.
func TestVMMBackendClaims(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{Expandable: true, IPC: true})
	a, err := be.Alloc(0, 2*mib, 0)
	require.NoError(t, err)
	s, err := be.claim(opExport, 0, a, 0)
	require.NoError(t, err)
	require.ErrorIs(t, be.Free(0, a, 2*mib, 0), gocore.ErrInvalidArgument, "exporting")
	assert.Equal(t, 3, f.VMMObjects(), "the refused Free changed nothing")
	require.NoError(t, be.Expand(0, a, 2*mib, 2*mib, 0), "growing only appends a chunk")
	be.release(s, opExport)
	s, err = be.claim(opFree, 0, a, 4*mib)
	require.NoError(t, err)
	require.ErrorIs(t, be.Expand(0, a, 4*mib, 2*mib, 0), gocore.ErrInvalidArgument, "being freed")
	_, err = be.ExportSegment(0, a)
	require.ErrorIs(t, err, gocore.ErrInvalidArgument, "being freed")
	be.release(s, opFree)
	require.NoError(t, be.Free(0, a, 4*mib, 0))
	require.NoError(t, be.Close())
	assert.Zero(t, f.VMMObjects())
}

func TestVMMOptionsValidation(t *testing.T) {
	_, err := NewVMMBackend(nil, VMMOptions{})
	require.ErrorIs(t, err, gocore.ErrInvalidArgument)

	_, drv := setup(t)
	for _, tc := range []struct {
		opts VMMOptions
		want string
	}{
		{VMMOptions{Location: "hbm"}, `unknown location "hbm"`},
		{VMMOptions{Location: VMMLocationHostNUMA, NUMANode: -1}, "negative NUMA node -1"},
		{VMMOptions{NUMANode: 1}, "NUMANode 1 given with location \"device\""},
		{VMMOptions{AccessDevices: []int{2}}, "access device 2 out of range [0, 2)"},
		{VMMOptions{AccessDevices: []int{0, -1}}, "access device -1 out of range"},
		{VMMOptions{Granularity: "huge"}, `unknown granularity "huge"`},
	} {
		_, err := NewVMMBackend(drv, tc.opts)
		require.ErrorIs(t, err, gocore.ErrInvalidArgument, "%+v", tc.opts)
		assert.Contains(t, err.Error(), tc.want)
	}
	be, err := NewVMMBackend(drv, VMMOptions{Location: VMMLocationHostNUMA, NUMANode: 3, Granularity: VMMGranularityMinimum})
	require.NoError(t, err)
	require.NoError(t, be.Close())
}

func TestVMMBackendConcurrentPools(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{Expandable: true, AccessDevices: []int{0, 1}})
	testConcurrentPools(t, be, []uint64{1000, 3 * mib, 12 * mib})
	require.NoError(t, be.Close())
	assert.Zero(t, f.VMMObjects())
}

// A process that uses one GPU creates no context on another: the backend
// asks each device for its granularity (and RDMA support) on first use,
// once.
func TestVMMBackendTouchesOnlyDevicesItUses(t *testing.T) {
	f, drv := setup(t)
	f.SetGranularity(2*mib, 4*mib)
	be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{Expandable: true, ReserveBytes: 64 * mib})
	assert.Zero(t, f.Retained(0)+f.Retained(1), "no context made by the constructor")
	assert.EqualValues(t, DefaultVMMGranularity, be.Granularity())
	p := newPool(t, be)
	a, err := p.Alloc(1, 3*mib, 0x7)
	require.NoError(t, err)
	b, err := p.Alloc(1, 30*mib, 0x7)
	require.NoError(t, err)
	require.NoError(t, p.Free(a))
	require.NoError(t, p.Free(b))
	closePool(t, p)
	assert.Zero(t, f.Retained(0), "device 0 was never touched")
	assert.Equal(t, 1, f.Retained(1))
	assert.EqualValues(t, 4*mib, be.Granularity(), "device 1's")
	assert.Equal(t, 1, f.Calls("cuMemGetAllocationGranularity"), "asked once")
	assert.Equal(t, 1, f.Calls("cuDeviceGetAttribute"), "asked once")
	require.NoError(t, be.Close())
	assert.Zero(t, f.VMMObjects())
}

// Device memory is created GPUDirect-RDMA capable on devices that support
// it (CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED), as
// torch's expandable segments do; the fake refuses the flag elsewhere.
func TestVMMBackendGPUDirectRDMA(t *testing.T) {
	f, drv := setup(t)
	f.SetDeviceAttribute(1, driver.DeviceAttrGPUDirectRDMAWithCUDAVMMSupported, 1)
	be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{Expandable: true, ReserveBytes: 8 * mib})
	a, err := be.Alloc(1, 2*mib, 0)
	require.NoError(t, err)
	assert.Equal(t, 1, f.LastMemCreateRDMA(), "device 1 supports it")
	require.NoError(t, be.Expand(1, a, 2*mib, 2*mib, 0))
	assert.Equal(t, 1, f.LastMemCreateRDMA(), "growth too")
	b, err := be.Alloc(0, 2*mib, 0)
	require.NoError(t, err)
	assert.Zero(t, f.LastMemCreateRDMA(), "device 0 does not")
	require.NoError(t, be.Free(1, a, 4*mib, 0))
	require.NoError(t, be.Free(0, b, 2*mib, 0))
	require.NoError(t, be.Close())

	// A driver that does not know the attribute: no flag.
	f.Reset()
	f.SetDeviceAttribute(0, driver.DeviceAttrGPUDirectRDMAWithCUDAVMMSupported, 1)
	f.Fail("cuDeviceGetAttribute", driver.CodeInvalidValue, 0)
	be = newGPUBackend(t, NewVMMBackend, drv, VMMOptions{})
	a, err = be.Alloc(0, 2*mib, 0)
	require.NoError(t, err)
	assert.Zero(t, f.LastMemCreateRDMA())
	require.NoError(t, be.Free(0, a, 2*mib, 0))
	require.NoError(t, be.Close())

	// Another failure of the query fails the allocation.
	f.Reset()
	f.Fail("cuDeviceGetAttribute", driver.CodeUnknown, 0)
	be = newGPUBackend(t, NewVMMBackend, drv, VMMOptions{})
	_, err = be.Alloc(0, 2*mib, 0)
	require.ErrorContains(t, err, "cuDeviceGetAttribute: CUDA_ERROR_UNKNOWN")
	f.Fail("cuDeviceGetAttribute", 0, 0)
	require.NoError(t, be.Close())

	// Host NUMA memory is not flagged; the one attribute asked (once) is
	// whether the device supports host NUMA memory.
	f.Reset()
	f.SetDeviceAttribute(0, driver.DeviceAttrGPUDirectRDMAWithCUDAVMMSupported, 1)
	be = newGPUBackend(t, NewVMMBackend, drv, VMMOptions{Location: VMMLocationHostNUMA})
	a, err = be.Alloc(0, 2*mib, 0)
	require.NoError(t, err)
	b, err = be.Alloc(0, 2*mib, 0)
	require.NoError(t, err)
	require.NoError(t, be.Free(0, b, 2*mib, 0))
	assert.Zero(t, f.LastMemCreateRDMA())
	assert.Equal(t, 1, f.Calls("cuDeviceGetAttribute"))
	require.NoError(t, be.Free(0, a, 2*mib, 0))
	require.NoError(t, be.Close())
	assert.Zero(t, f.VMMObjects())
}
