//go:build cgo

package cuda

import (
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/cuda/driver"
	"github.com/gpumempool/gpumempool/gocore/cuda/internal/fakecuda"
)

const mib = 1 << 20

func requireFD(t *testing.T, fd int) {
	t.Helper()
	require.GreaterOrEqual(t, fd, 0)
	var st syscall.Stat_t
	require.NoError(t, syscall.Fstat(fd, &st), "a real, open file descriptor")
}

func TestMemPoolSmoke(t *testing.T) {
	f, drv := setup(t, "FAKE_CUDA_DEVICES", "3")
	// Created under device 0's context for device 2: the location in the
	// CUmemPoolProps the driver reads decides where the memory lives (and
	// type 1 != id 2 catches the two being swapped).
	pool, err := drv.MemPoolCreate(0, driver.PoolProps{HandleType: driver.MemHandleTypePosixFD,
		LocationType: driver.MemLocationTypeDevice, LocationID: 2})
	require.NoError(t, err)
	assert.Equal(t, 1, f.LivePools())

	const stream = 0x5
	p, err := drv.MemAllocFromPoolAsync(2, 4*mib, pool, stream)
	require.NoError(t, err)
	assert.Equal(t, 2, f.PtrDevice(p))
	assert.EqualValues(t, 4*mib, f.LiveBytes(2))
	fakecuda.Write(p, []byte("stream ordered"))
	assert.Equal(t, []byte("stream ordered"), fakecuda.Read(p, 14))

	attr := func(a int) uint64 {
		t.Helper()
		v, err := drv.MemPoolGetAttribute(2, pool, a)
		require.NoError(t, err)
		return v
	}
	assert.EqualValues(t, 4*mib, attr(driver.MemPoolAttrUsedMemCurrent))
	assert.EqualValues(t, 4*mib, attr(driver.MemPoolAttrReservedMemCurrent))
	assert.Zero(t, attr(driver.MemPoolAttrReleaseThreshold))
	require.NoError(t, drv.MemPoolSetAttribute(2, pool, driver.MemPoolAttrReleaseThreshold, 1*mib))
	assert.EqualValues(t, 1*mib, attr(driver.MemPoolAttrReleaseThreshold))
	assert.EqualValues(t, 1, attr(driver.MemPoolAttrReuseAllowOpportunistic))
	require.NoError(t, drv.MemPoolSetAttribute(2, pool, driver.MemPoolAttrReuseAllowOpportunistic, 0))
	assert.Zero(t, attr(driver.MemPoolAttrReuseAllowOpportunistic), "int-typed attributes round-trip")
	err = drv.MemPoolSetAttribute(2, pool, driver.MemPoolAttrUsedMemCurrent, 7)
	assert.Contains(t, err.Error(), "CUDA_ERROR_INVALID_VALUE", "read-only attribute")

	require.NoError(t, drv.MemFreeAsync(2, p, stream))
	assert.Zero(t, attr(driver.MemPoolAttrUsedMemCurrent))
	assert.EqualValues(t, 4*mib, attr(driver.MemPoolAttrReservedMemCurrent), "freed memory stays cached")
	require.NoError(t, drv.StreamSynchronize(2, stream))
	assert.EqualValues(t, 1*mib, attr(driver.MemPoolAttrReservedMemCurrent), "synchronizing trims to the threshold")
	require.NoError(t, drv.MemPoolTrimTo(2, pool, 0))
	assert.Zero(t, attr(driver.MemPoolAttrReservedMemCurrent))
	assert.EqualValues(t, 4*mib, attr(driver.MemPoolAttrUsedMemHigh))
	require.NoError(t, drv.MemPoolSetAttribute(2, pool, driver.MemPoolAttrUsedMemHigh, 0))
	assert.Zero(t, attr(driver.MemPoolAttrUsedMemHigh))

	// Export the pool and an allocation, import them back.
	fd, err := drv.MemPoolExportToShareableHandle(2, pool, driver.MemHandleTypePosixFD)
	require.NoError(t, err)
	requireFD(t, fd)
	defer syscall.Close(fd)
	imported, err := drv.MemPoolImportFromShareableHandle(2, fd, driver.MemHandleTypePosixFD)
	require.NoError(t, err)
	assert.NotEqual(t, pool, imported)
	q, err := drv.MemAllocFromPoolAsync(2, 2*mib, pool, stream)
	require.NoError(t, err)
	data, err := drv.MemPoolExportPointer(2, q)
	require.NoError(t, err)
	assert.NotEqual(t, [64]byte{}, data)
	got, err := drv.MemPoolImportPointer(2, imported, data)
	require.NoError(t, err)
	assert.Equal(t, q, got, "one process: the same mapping")
	_, err = drv.MemAllocFromPoolAsync(2, 2*mib, imported, stream)
	require.Error(t, err, "imported pools cannot allocate")

	require.NoError(t, drv.MemFreeAsync(2, q, stream))
	require.NoError(t, drv.MemPoolDestroy(2, imported))
	require.NoError(t, drv.MemPoolDestroy(2, pool))
	assert.Zero(t, f.LivePools())
	assert.Zero(t, f.LiveBytes(2))
	free, total, err := drv.MemGetInfo(2)
	require.NoError(t, err)
	assert.Equal(t, total, free, "destroying the pool returned its memory")

	_, err = drv.MemPoolExportToShareableHandle(2, pool, driver.MemHandleTypeFabric)
	require.ErrorIs(t, err, gocore.ErrUnsupported, "only file descriptors fit in an int")
}

func TestMemPoolLimits(t *testing.T) {
	_, drv := setup(t)
	pool, err := drv.MemPoolCreate(0, driver.PoolProps{LocationType: driver.MemLocationTypeDevice, LocationID: 0, MaxSize: 4 * mib})
	require.NoError(t, err)
	_, err = drv.MemAllocFromPoolAsync(0, 8*mib, pool, 0)
	require.ErrorIs(t, err, gocore.ErrBackendOutOfMemory, "maxSize reached the driver")
	_, err = drv.MemPoolExportToShareableHandle(0, pool, driver.MemHandleTypePosixFD)
	require.Error(t, err, "not created exportable")
	require.NoError(t, drv.MemPoolDestroy(0, pool))

	_, err = drv.MemPoolCreate(0, driver.PoolProps{LocationType: driver.MemLocationTypeDevice, LocationID: 9})
	require.ErrorIs(t, err, gocore.ErrInvalidDevice)
	_, err = drv.MemPoolCreate(0, driver.PoolProps{LocationType: driver.MemLocationTypeHost})
	require.ErrorIs(t, err, gocore.ErrUnsupported, "the fake only has device pools")
}

func TestVMMSmoke(t *testing.T) {
	f, drv := setup(t, "FAKE_CUDA_DEVICES", "3")
	prop := driver.AllocProp{LocationType: driver.MemLocationTypeDevice, LocationID: 2, HandleType: driver.MemHandleTypePosixFD}
	gran, err := drv.MemGetAllocationGranularity(0, prop, driver.MemAllocGranularityMinimum)
	require.NoError(t, err)
	assert.EqualValues(t, 2*mib, gran)
	rec, err := drv.MemGetAllocationGranularity(0, prop, driver.MemAllocGranularityRecommended)
	require.NoError(t, err)
	assert.GreaterOrEqual(t, rec, gran)

	h, err := drv.MemCreate(0, 2*gran, prop)
	require.NoError(t, err)
	assert.EqualValues(t, 2*gran, f.LiveBytes(2), "the location in CUmemAllocationProp decides the device")
	_, err = drv.MemCreate(0, gran+1, prop)
	require.Error(t, err, "sizes are multiples of the granularity")

	va, err := drv.MemAddressReserve(0, 4*gran, 0, 0)
	require.NoError(t, err)
	assert.Zero(t, va%gran)
	require.NoError(t, drv.MemMap(0, va, 2*gran, 0, h))
	assert.Equal(t, driver.MemAccessProtNone, f.Access(va, 2), "no access before MemSetAccess")
	require.NoError(t, drv.MemSetAccess(0, va, 2*gran, []int{2, 0}))
	assert.Equal(t, driver.MemAccessProtReadWrite, f.Access(va, 2))
	assert.Equal(t, driver.MemAccessProtReadWrite, f.Access(va, 0))
	assert.Equal(t, driver.MemAccessProtNone, f.Access(va, 1), "only the devices listed")
	fakecuda.Write(va, []byte("mapped"))
	fakecuda.Write(va+2*gran-3, []byte("end"))

	// A second mapping of the last granule of the same memory aliases it.
	require.NoError(t, drv.MemMap(0, va+2*gran, gran, gran, h))
	require.NoError(t, drv.MemSetAccess(0, va+2*gran, gran, []int{1}))
	assert.Equal(t, []byte("end"), fakecuda.Read(va+3*gran-3, 3))

	err = drv.MemMap(0, va, gran, 0, h)
	var cerr *driver.Error
	require.ErrorAs(t, err, &cerr)
	assert.Equal(t, driver.CodeAlreadyMapped, cerr.Code)
	err = drv.MemAddressFree(0, va, 4*gran)
	require.Error(t, err, "still mapped")
	require.ErrorIs(t, drv.MemSetAccess(0, va, gran, nil), gocore.ErrInvalidArgument)

	// Export as a file descriptor and import: the imported handle maps the
	// same memory.
	fd, err := drv.MemExportToShareableHandle(0, h, driver.MemHandleTypePosixFD)
	require.NoError(t, err)
	requireFD(t, fd)
	h2, err := drv.MemImportFromShareableHandle(1, fd, driver.MemHandleTypePosixFD)
	require.NoError(t, err)
	require.NoError(t, syscall.Close(fd), "the caller owns the descriptor")
	va2, err := drv.MemAddressReserve(1, 2*gran, 0, 0)
	require.NoError(t, err)
	require.NoError(t, drv.MemMap(1, va2, 2*gran, 0, h2))
	require.NoError(t, drv.MemSetAccess(1, va2, 2*gran, []int{1}))
	assert.Equal(t, []byte("mapped"), fakecuda.Read(va2, 6))

	// Tear down in the driver's order: unmap, release, free the range.
	require.NoError(t, drv.MemUnmap(1, va2, 2*gran))
	require.NoError(t, drv.MemRelease(1, h2))
	require.NoError(t, drv.MemAddressFree(1, va2, 2*gran))
	require.NoError(t, drv.MemRelease(0, h))
	assert.EqualValues(t, 2*gran, f.LiveBytes(2), "still mapped: the memory stays")
	require.NoError(t, drv.MemUnmap(0, va, 3*gran))
	assert.Zero(t, f.LiveBytes(2), "released and unmapped: gone")
	require.NoError(t, drv.MemAddressFree(0, va, 4*gran))
	assert.Zero(t, f.VMMObjects())

	_, err = drv.MemExportToShareableHandle(0, h, driver.MemHandleTypeWin32)
	require.ErrorIs(t, err, gocore.ErrUnsupported)
	_, err = drv.MemImportFromShareableHandle(0, 0, driver.MemHandleTypeFabric)
	require.ErrorIs(t, err, gocore.ErrUnsupported)
}

func TestVMMReserveAtFixedAddress(t *testing.T) {
	_, drv := setup(t)
	const gran = 2 * mib
	va, err := drv.MemAddressReserve(0, 4*gran, 0, 0)
	require.NoError(t, err)
	require.NoError(t, drv.MemAddressFree(0, va, 4*gran))
	again, err := drv.MemAddressReserve(0, 2*gran, 0, va+gran)
	require.NoError(t, err)
	assert.Equal(t, va+gran, again, "the hint is honoured when the range is free")
	require.NoError(t, drv.MemAddressFree(0, again, 2*gran))
}

func TestHostNUMAAllocProp(t *testing.T) {
	f, drv := setup(t)
	h, err := drv.MemCreate(0, 2*mib, driver.AllocProp{LocationType: driver.MemLocationTypeHostNUMA, LocationID: 0})
	require.NoError(t, err)
	assert.Zero(t, f.LiveBytes(0)+f.LiveBytes(1), "host memory is charged to no device")
	require.NoError(t, drv.MemRelease(0, h))
	assert.Zero(t, f.VMMObjects())
}
