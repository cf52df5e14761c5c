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

// Every device has its own UUID, and DeviceByUUID finds the ordinal under
// which this process sees it: another visible order (the fake's stand-in
// for CUDA_VISIBLE_DEVICES) moves the UUIDs, not the ordinals' meaning.
func TestDeviceUUID(t *testing.T) {
	f, drv := setup(t)
	u0, err := drv.DeviceUUID(0)
	require.NoError(t, err)
	u1, err := drv.DeviceUUID(1)
	require.NoError(t, err)
	assert.NotEqual(t, u0, u1)
	assert.Equal(t, "GPU-fa4ec0da-0000-4000-8000-000000000001", u1.String())
	assert.Equal(t, 2, f.Calls("cuDeviceGetUuid_v2"))
	assert.Zero(t, f.Retained(0), "no context is needed")

	dev, ok, err := drv.DeviceByUUID(u1)
	require.NoError(t, err)
	assert.True(t, ok)
	assert.Equal(t, 1, dev)

	// A process that sees GPU 1 first and GPU 0 second.
	require.Equal(t, 2, f.SetVisibleOrder("1,0"))
	got, err := drv.DeviceUUID(0)
	require.NoError(t, err)
	assert.Equal(t, u1, got)
	dev, ok, err = drv.DeviceByUUID(u1)
	require.NoError(t, err)
	assert.True(t, ok)
	assert.Equal(t, 0, dev, "GPU 1 is this process's device 0")

	// One that sees GPU 0 only.
	require.Equal(t, 1, f.SetVisibleOrder("0"))
	_, ok, err = drv.DeviceByUUID(u1)
	require.NoError(t, err)
	assert.False(t, ok)
	_, err = drv.DeviceUUID(1)
	require.ErrorIs(t, err, gocore.ErrInvalidDevice)
	assert.Contains(t, err.Error(), "CUDA_ERROR_INVALID_DEVICE")
	_, err = drv.DeviceUUID(-1)
	require.ErrorIs(t, err, gocore.ErrInvalidDevice)

	f.SetVisibleOrder("")
	require.NoError(t, drv.Close())
	_, err = drv.DeviceUUID(0)
	require.ErrorIs(t, err, driver.ErrDriverClosed)
}

// FAKE_CUDA_VISIBLE_ORDER sets the visible order when the fake starts (the
// way another process would see the GPUs).
func TestDeviceUUIDVisibleOrderFromEnvironment(t *testing.T) {
	f, drv := setup(t, "FAKE_CUDA_VISIBLE_ORDER", "3,1")
	n, err := drv.DeviceCount()
	require.NoError(t, err)
	assert.Equal(t, 2, n)
	u, err := drv.DeviceUUID(0)
	require.NoError(t, err)
	assert.Equal(t, "GPU-fa4ec0da-0000-4000-8000-000000000003", u.String())
	assert.Equal(t, 1, f.SetVisibleOrder("2,2,0"), "the list ends at a repeated GPU")
	assert.Equal(t, 2, f.SetVisibleOrder(""), "back to the environment's")
}

func TestDeviceUUIDNeedsCUDA114(t *testing.T) {
	_, drv := setupHiding(t, "cuDeviceGetUuid_v2") // optional: the driver loads
	_, err := drv.DeviceUUID(0)
	require.ErrorIs(t, err, driver.ErrDriverTooOld)
	_, _, err = drv.DeviceByUUID(driver.UUID{})
	require.ErrorIs(t, err, driver.ErrDriverTooOld)
}

// Blocks of one exported segment share one import: the pool is imported
// once per exporter pool identity and the allocation once, and what the
// last ImportedSegment lets go of is freed and destroyed. Importing an
// allocation twice is what the fake (like real drivers, see
// ImportedPool.ImportPointer) refuses.
func TestImportAsyncSegmentShares(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewAsyncBackend, drv, AsyncOptions{IPC: true})
	a, err := be.Alloc(0, 4*mib, 0x7)
	require.NoError(t, err)
	b, err := be.Alloc(0, 2*mib, 0x7)
	require.NoError(t, err)
	dataA, err := be.ExportPointer(0, a)
	require.NoError(t, err)
	dataB, err := be.ExportPointer(0, b)
	require.NoError(t, err)
	fd1, err := be.ExportPool(0)
	require.NoError(t, err)
	defer func() { require.NoError(t, syscall.Close(fd1)) }()
	fd2, err := be.ExportPool(0)
	require.NoError(t, err)
	defer func() { require.NoError(t, syscall.Close(fd2)) }()

	// The driver refuses a second import of one allocation, even from a
	// second imported pool.
	p1, err := ImportAsyncPool(drv, 0, fd1)
	require.NoError(t, err)
	p2, err := ImportAsyncPool(drv, 0, fd2)
	require.NoError(t, err)
	ptr, err := p1.ImportPointer(dataA)
	require.NoError(t, err)
	_, err = drv.MemPoolImportPointer(0, p2.pool, dataA)
	require.ErrorContains(t, err, "CUDA_ERROR_ALREADY_MAPPED")
	require.NoError(t, p1.FreePointer(ptr))
	require.NoError(t, p1.Close())
	require.NoError(t, p2.Close())

	pools, imports := f.Calls("cuMemPoolImportFromShareableHandle"), f.Calls("cuMemPoolImportPointer")
	s1, err := ImportAsyncSegment(drv, 0, "exporter:1:0", fd1, dataA)
	require.NoError(t, err)
	s2, err := ImportAsyncSegment(drv, 0, "exporter:1:0", fd2, dataA) // another block of segment a
	require.NoError(t, err)
	s3, err := ImportAsyncSegment(drv, 0, "exporter:1:0", fd2, dataB)
	require.NoError(t, err)
	assert.Equal(t, s1.Addr(), s2.Addr())
	assert.Equal(t, a, s1.Addr(), "in one process the fake maps the exporter's address")
	assert.Equal(t, b, s3.Addr())
	assert.Equal(t, pools+1, f.Calls("cuMemPoolImportFromShareableHandle"), "the pool is imported once")
	assert.Equal(t, imports+2, f.Calls("cuMemPoolImportPointer"), "each allocation once")
	assert.Equal(t, 2, f.ImportedPointers())
	assert.Equal(t, 2, f.LivePools(), "the exporter's and one imported")

	// For another device: the same import (one address per process), with
	// access given to that device.
	s4, err := ImportAsyncSegment(drv, 1, "exporter:1:0", fd1, dataB)
	require.NoError(t, err)
	assert.Equal(t, b, s4.Addr())
	assert.Equal(t, 1, f.Calls("cuMemPoolSetAccess"))
	assert.Equal(t, driver.MemAccessProtReadWrite, f.PoolAccess(s4.shared.pool.pool, 1))
	assert.Equal(t, 2, f.LivePools())
	s5, err := ImportAsyncSegment(drv, 1, "exporter:1:0", fd1, dataB)
	require.NoError(t, err)
	assert.Equal(t, 1, f.Calls("cuMemPoolSetAccess"), "granted once")
	require.NoError(t, s5.Close())
	require.NoError(t, s4.Close())
	assert.Equal(t, 2, f.ImportedPointers())

	// Failing to give access (no peer access) fails that import only.
	f.Fail("cuMemPoolSetAccess", driver.CodeNotSupported, 0)
	f.SetVisibleOrder("0,1,2")
	_, err = ImportAsyncSegment(drv, 2, "exporter:1:0", fd1, dataB)
	require.ErrorIs(t, err, gocore.ErrUnsupported)
	f.Fail("cuMemPoolSetAccess", 0, 0)
	f.SetVisibleOrder("")
	assert.Equal(t, 2, f.ImportedPointers())

	require.NoError(t, s1.Close())
	assert.Equal(t, 2, f.ImportedPointers(), "s2 still uses a")
	fakecuda.Write(s2.Addr(), []byte("still mapped"))
	require.NoError(t, s2.Close())
	assert.Equal(t, 1, f.ImportedPointers(), "a is freed with its last user")
	require.ErrorIs(t, s2.Close(), gocore.ErrInvalidArgument, "closed twice")
	assert.Equal(t, 2, f.LivePools())
	require.NoError(t, s3.Close())
	assert.Zero(t, f.ImportedPointers())
	assert.Equal(t, 1, f.LivePools(), "the imported pool is destroyed with its last user")

	// Imported again later: a fresh import.
	s6, err := ImportAsyncSegment(drv, 0, "exporter:1:0", fd1, dataA)
	require.NoError(t, err)
	assert.Equal(t, pools+2, f.Calls("cuMemPoolImportFromShareableHandle"))
	require.NoError(t, s6.Close())

	_, err = ImportAsyncSegment(drv, 0, "", fd1, dataA)
	require.ErrorIs(t, err, gocore.ErrInvalidArgument, "a pool identity is needed")
	f.Fail("cuMemPoolImportPointer", driver.CodeInvalidValue, 0)
	_, err = ImportAsyncSegment(drv, 0, "exporter:1:0", fd1, dataA)
	require.Error(t, err)
	f.Fail("cuMemPoolImportPointer", 0, 0)
	assert.Equal(t, 1, f.LivePools(), "a failed first import destroys its pool")

	require.NoError(t, be.Free(0, a, 4*mib, 0x7))
	require.NoError(t, be.Free(0, b, 2*mib, 0x7))
	require.NoError(t, be.Close())
}
