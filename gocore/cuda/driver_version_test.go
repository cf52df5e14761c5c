//go:build cgo

package cuda

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/cuda/driver"
	"github.com/gpumempool/gpumempool/gocore/cuda/internal/fakecuda"
)

// A driver older than the stream-ordered allocator and VMM serves the
// cuda backend.
func TestBackendOnOldDriverWithoutOptionalSymbols(t *testing.T) {
	f, drv := setupHiding(t, fakecuda.OptionalSymbols...)
	be := newBackend(t, drv)
	addr, err := be.Alloc(0, 4096, 0)
	require.NoError(t, err)
	assert.EqualValues(t, 4096, f.LiveBytes(0))
	require.NoError(t, be.Free(0, addr, 4096, 0))
}

// A driver without devices makes no backend.
func TestBackendsWithoutDevices(t *testing.T) {
	_, drv := setup(t, "FAKE_CUDA_DEVICES", "0")
	_, err := NewBackend(drv)
	require.ErrorIs(t, err, gocore.ErrInvalidDevice)
	assert.Contains(t, err.Error(), "sees no CUDA device")
	_, err = NewHostBackend(drv, 0)
	require.ErrorIs(t, err, gocore.ErrInvalidDevice)
}

// Options that older drivers misread are refused up front, naming the CUDA
// version they need; the same options work with a new enough driver.
func TestDriverVersionGatesNewOptions(t *testing.T) {
	f, drv := setup(t, "FAKE_CUDA_DRIVER_VERSION", "12010")
	_, err := NewAsyncBackend(drv, AsyncOptions{MaxSize: 32 << 20})
	require.ErrorIs(t, err, driver.ErrDriverTooOld)
	require.ErrorIs(t, err, gocore.ErrUnsupported, "callers can fall back")
	assert.Contains(t, err.Error(), "MaxSize (CUmemPoolProps.maxSize) needs a driver for CUDA 12.2 or newer")
	assert.Contains(t, err.Error(), "supports CUDA 12.1")
	be, err := NewAsyncBackend(drv, AsyncOptions{})
	require.NoError(t, err, "without MaxSize an old driver is fine")
	require.NoError(t, be.Close())

	_, err = NewVMMBackend(drv, VMMOptions{Location: VMMLocationHostNUMA})
	require.ErrorIs(t, err, driver.ErrDriverTooOld)
	assert.Contains(t, err.Error(), "host NUMA memory (CU_MEM_LOCATION_TYPE_HOST_NUMA) needs a driver for CUDA 12.2")
	vb, err := NewVMMBackend(drv, VMMOptions{})
	require.NoError(t, err)
	require.NoError(t, vb.Close())

	t.Setenv("FAKE_CUDA_DRIVER_VERSION", "12020")
	f.Reset()
	be, err = NewAsyncBackend(drv, AsyncOptions{MaxSize: 32 << 20})
	require.NoError(t, err)
	p := newPool(t, be)
	a, err := p.Alloc(0, 1<<20, 0)
	require.NoError(t, err, "a 12.2 driver takes maxSize")
	require.NoError(t, p.Free(a))
	closePool(t, p)
	require.NoError(t, be.Close())
	vb, err = NewVMMBackend(drv, VMMOptions{Location: VMMLocationHostNUMA})
	require.NoError(t, err)
	require.NoError(t, vb.Close())

}
