//go:build cgo

package driver

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/cuda/internal/fakecuda"
)

func TestLoadMissingLibraryIsNoDriver(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "nothing", "libcuda.so.1")
	_, err := Load(missing)
	require.ErrorIs(t, err, ErrNoDriver)
	assert.Contains(t, err.Error(), "libcuda.so.1 not found (no NVIDIA driver?)")
	assert.Contains(t, err.Error(), missing, "the path tried is named")

	t.Setenv(EnvLibrary, missing)
	_, err = Load("")
	require.ErrorIs(t, err, ErrNoDriver, "$GMP_LIBCUDA is used when no path is given")
	assert.Contains(t, err.Error(), missing)
}

func TestLoadBrokenLibraryIsNotNoDriver(t *testing.T) {
	path := filepath.Join(t.TempDir(), "libcuda.so.1")
	require.NoError(t, os.WriteFile(path, []byte("not an ELF file"), 0o644))
	_, err := Load(path)
	require.Error(t, err)
	assert.NotErrorIs(t, err, ErrNoDriver, "the library is there; it just does not load")
	assert.Contains(t, err.Error(), path)
}

func TestLoadNamesMissingRequiredSymbol(t *testing.T) {
	// A library with cuInit and nothing else: not a usable driver.
	lib := fakecuda.CompileC(t, "libtiny.so", "int cuInit(unsigned int flags) { return 0; }\n")
	_, err := Load(lib)
	require.ErrorIs(t, err, ErrDriverTooOld)
	assert.Contains(t, err.Error(), "cuDeviceGet,", "the first missing entry point is named")
	assert.Contains(t, err.Error(), "cuStreamSynchronize")
	assert.NotContains(t, err.Error(), "cuInit,", "present entry points are not listed")
	assert.NotContains(t, err.Error(), "cuMemPoolCreate", "optional entry points are not required")

	// The full fake with only cuEventQuery hidden.
	lib = fakecuda.BuildHiding(t, "cuEventQuery")
	_, err = Load(lib)
	require.ErrorIs(t, err, ErrDriverTooOld)
	assert.Contains(t, err.Error(), "lacks required driver entry point cuEventQuery (")
}

func TestOldDriverLoadsWithoutOptionalSymbols(t *testing.T) {
	_, drv := setupHiding(t, fakecuda.OptionalSymbols...) // the stream-ordered allocator and VMM are optional
	assert.True(t, drv.HasSymbol("cuMemAlloc_v2"))
	assert.False(t, drv.HasSymbol("cuMemPoolCreate"))
	assert.False(t, drv.HasSymbol("noSuchFunction"))

	_, err := drv.MemPoolCreate(0, PoolProps{LocationType: MemLocationTypeDevice})
	require.ErrorIs(t, err, ErrDriverTooOld)
	require.ErrorIs(t, err, gocore.ErrUnsupported, "callers can fall back with one check")
	assert.Contains(t, err.Error(), "driver too old: cuMemPoolCreate missing")
	_, err = drv.MemCreate(0, 2<<20, AllocProp{LocationType: MemLocationTypeDevice})
	assert.Contains(t, err.Error(), "driver too old: cuMemCreate missing")
	assert.ErrorIs(t, drv.MemSetAccess(0, 0, 2<<20, []int{0}), ErrDriverTooOld)
	_, err = drv.StreamIsCapturing(0, 0)
	assert.ErrorIs(t, err, ErrDriverTooOld)
	_, err = drv.DeviceAttribute(0, DeviceAttrGPUDirectRDMAWithCUDAVMMSupported)
	assert.ErrorIs(t, err, ErrDriverTooOld)
	_, err = drv.DeviceUUID(0)
	assert.ErrorIs(t, err, ErrDriverTooOld)

}

func TestLoadReturnsOneDriverPerLibrary(t *testing.T) {
	f, drv := setup(t)
	again, err := Load(f.Path())
	require.NoError(t, err)
	assert.Same(t, drv, again)

	t.Setenv(EnvLibrary, f.Path())
	viaEnv, err := Load("")
	require.NoError(t, err)
	assert.Same(t, drv, viaEnv)

	link := filepath.Join(t.TempDir(), "libcuda.so.1")
	require.NoError(t, os.Symlink(f.Path(), link))
	viaLink, err := Load(link)
	require.NoError(t, err)
	assert.Same(t, drv, viaLink, "another path to the same library is the same driver")
	assert.Equal(t, 1, f.Calls("cuInit"), "cuInit runs once per loaded driver")

	require.NoError(t, drv.Close())
	fresh, err := Load(f.Path())
	require.NoError(t, err)
	assert.NotSame(t, drv, fresh, "a closed driver leaves the cache")
	defer func() { require.NoError(t, fresh.Close()) }()
	n, err := fresh.DeviceCount()
	require.NoError(t, err)
	assert.Equal(t, 2, n)
}

func TestDriverWithoutDevices(t *testing.T) {
	f, drv := setup(t, "FAKE_CUDA_DEVICES", "0")
	assert.Equal(t, 1, f.Calls("cuInit"))
	n, err := drv.DeviceCount()
	require.NoError(t, err)
	assert.Zero(t, n)
	_, err = drv.MemAlloc(0, 512)
	require.ErrorIs(t, err, gocore.ErrInvalidDevice)
	assert.Contains(t, err.Error(), "CUDA_ERROR_NO_DEVICE")
}

func TestDeviceCountAndRange(t *testing.T) {
	_, drv := setup(t, "FAKE_CUDA_DEVICES", "3")
	n, err := drv.DeviceCount()
	require.NoError(t, err)
	assert.Equal(t, 3, n)
	_, err = drv.MemAlloc(3, 512)
	require.ErrorIs(t, err, gocore.ErrInvalidDevice, "CUDA_ERROR_INVALID_DEVICE from cuDeviceGet")
	var cerr *Error
	require.ErrorAs(t, err, &cerr)
	assert.Equal(t, "cuDeviceGet", cerr.Op)
	_, err = drv.MemAlloc(-1, 512)
	require.ErrorIs(t, err, gocore.ErrInvalidDevice)
	_, _, err = drv.MemGetInfo(7)
	require.ErrorIs(t, err, gocore.ErrInvalidDevice)
}

func TestErrorFormatAndMatching(t *testing.T) {
	e := &Error{Op: "cuMemAlloc_v2", Code: 2, Name: "CUDA_ERROR_OUT_OF_MEMORY"}
	assert.Equal(t, "cuMemAlloc_v2: CUDA_ERROR_OUT_OF_MEMORY (2)", e.Error())
	assert.ErrorIs(t, e, gocore.ErrBackendOutOfMemory)
	assert.NotErrorIs(t, e, gocore.ErrInvalidDevice)
	assert.NotErrorIs(t, &Error{Op: "x", Code: CodeInvalidValue}, gocore.ErrBackendOutOfMemory)
	assert.ErrorIs(t, &Error{Op: "x", Code: CodeInvalidDevice}, gocore.ErrInvalidDevice)
	assert.ErrorIs(t, &Error{Op: "x", Code: CodeNotSupported}, gocore.ErrUnsupported)
	assert.Equal(t, "cuFoo: CUDA error (12345)", (&Error{Op: "cuFoo", Code: 12345}).Error())
	assert.ErrorIs(t, ErrDriverTooOld, gocore.ErrUnsupported)

	// Names come from cuGetErrorName; unknown codes keep their number.
	f, drv := setup(t)
	f.Fail("cuMemGetInfo_v2", 12345, 0)
	_, _, err := drv.MemGetInfo(0)
	var cerr *Error
	require.ErrorAs(t, err, &cerr)
	assert.Equal(t, &Error{Op: "cuMemGetInfo_v2", Code: 12345}, cerr)
	f.Fail("cuMemGetInfo_v2", CodeIllegalAddress, 0)
	_, _, err = drv.MemGetInfo(0)
	assert.EqualError(t, err, "cuda: memory info of device 0: cuMemGetInfo_v2: CUDA_ERROR_ILLEGAL_ADDRESS (700)")
}

// Every operation pushes its device's context and pops it again in one C
// call: the caller's own current context (torch's, on torch's thread) is
// the same after the call, and the operation ran under the device asked for.
func TestCallsRestoreCallersContext(t *testing.T) {
	f, drv := setup(t)
	onThread(t, func() {
		require.NoError(t, f.PushDevice(1), "the caller has device 1 current")
		p, err := drv.MemAlloc(0, 4096)
		require.NoError(t, err)
		assert.Equal(t, 0, f.PtrDevice(p), "allocated under device 0's context")
		assert.Equal(t, 1, f.CurrentDevice(), "the caller's context is current again")
		assert.Equal(t, 1, f.CtxDepth())

		ev, err := drv.EventCreate(0)
		require.NoError(t, err)
		assert.Equal(t, 1, f.LiveEvents(0))
		require.NoError(t, drv.EventRecord(0, ev, 0x5))
		done, err := drv.EventQuery(0, ev)
		require.NoError(t, err)
		assert.True(t, done)
		require.NoError(t, drv.StreamSynchronize(0, 0x5))
		require.NoError(t, drv.EventDestroy(0, ev))
		free, total, err := drv.MemGetInfo(0)
		require.NoError(t, err)
		assert.Equal(t, uint64(1<<30), total)
		assert.Equal(t, uint64(1<<30)-4096, free)
		require.NoError(t, drv.MemFree(0, p))
		h, err := drv.MemHostAlloc(0, 100, HostAllocPortable)
		require.NoError(t, err)
		require.NoError(t, drv.MemFreeHost(0, h))

		assert.Equal(t, 1, f.CurrentDevice())
		assert.Equal(t, 1, f.CtxDepth())
		require.NoError(t, f.PopDevice())
		assert.Equal(t, -1, f.CurrentDevice())
	})
}

func TestEveryCallLeavesThreadWithoutContext(t *testing.T) {
	f, drv := setup(t)
	onThread(t, func() {
		check := func(what string) {
			t.Helper()
			assert.Zero(t, f.CtxDepth(), "after %s", what)
		}
		p, err := drv.MemAlloc(1, 1<<20)
		require.NoError(t, err)
		check("MemAlloc")
		assert.Equal(t, 1, f.PtrDevice(p))
		_, _, err = drv.MemGetInfo(1)
		require.NoError(t, err)
		check("MemGetInfo")
		require.NoError(t, drv.MemFree(1, p))
		check("MemFree")
		_, err = drv.MemAlloc(1, 0)
		require.Error(t, err)
		check("a failed MemAlloc")
	})
	assert.Zero(t, f.CtxBalance())
}

func TestPushFailureSkipsOperation(t *testing.T) {
	f, drv := setup(t)
	f.Fail("cuCtxPushCurrent_v2", CodeInvalidContext, 0)
	_, err := drv.MemAlloc(0, 512)
	var cerr *Error
	require.ErrorAs(t, err, &cerr)
	assert.Equal(t, &Error{Op: "cuCtxPushCurrent_v2", Code: 201, Name: "CUDA_ERROR_INVALID_CONTEXT"}, cerr)
	assert.NotErrorIs(t, err, gocore.ErrBackendOutOfMemory)
	assert.Zero(t, f.Calls("cuMemAlloc_v2"), "nothing runs without the context")
	assert.Zero(t, f.Calls("cuCtxPopCurrent_v2"), "nothing to pop")
	f.Fail("cuCtxPushCurrent_v2", 0, 0)
	_, err = drv.EventCreate(0)
	require.NoError(t, err)
}

func TestPopFailureIsReported(t *testing.T) {
	f, drv := setup(t)
	ev, err := drv.EventCreate(1)
	require.NoError(t, err)
	onThread(t, func() {
		f.Fail("cuCtxPopCurrent_v2", CodeInvalidContext, 0)
		_, err := drv.EventQuery(1, ev)
		var cerr *Error
		require.ErrorAs(t, err, &cerr)
		assert.Equal(t, "cuCtxPopCurrent_v2", cerr.Op)
		assert.Equal(t, 1, f.CtxDepth(), "the failed pop left device 1's context current")
		assert.Equal(t, 1, f.CurrentDevice())
		f.Fail("cuCtxPopCurrent_v2", 0, 0)
		require.NoError(t, f.PopDevice())
	})
	require.NoError(t, drv.EventDestroy(1, ev))
}

func TestEventsFollowTheirStream(t *testing.T) {
	f, drv := setup(t)
	f.SetManualEvents(true)
	ev, err := drv.EventCreate(1)
	require.NoError(t, err)
	done, err := drv.EventQuery(1, ev)
	require.NoError(t, err)
	assert.True(t, done, "an event with nothing recorded is complete")

	require.NoError(t, drv.EventRecord(1, ev, 0x7))
	done, err = drv.EventQuery(1, ev)
	require.NoError(t, err)
	assert.False(t, done, "CUDA_ERROR_NOT_READY is not an error")
	f.CompleteStream(0x8)
	done, _ = drv.EventQuery(1, ev)
	assert.False(t, done, "another stream's progress does not help")
	f.CompleteStream(0x7)
	done, _ = drv.EventQuery(1, ev)
	assert.True(t, done)

	require.NoError(t, drv.EventRecord(1, ev, 0x7))
	done, _ = drv.EventQuery(1, ev)
	assert.False(t, done)
	require.NoError(t, drv.StreamSynchronize(1, 0x7))
	done, _ = drv.EventQuery(1, ev)
	assert.True(t, done, "cuStreamSynchronize completes the stream")

	// The fake refuses an event used under another device's context, so
	// this proves the event's device is what gets pushed.
	err = drv.EventRecord(0, ev, 0x7)
	var cerr *Error
	require.ErrorAs(t, err, &cerr)
	assert.Equal(t, CodeInvalidHandle, cerr.Code)
	require.NoError(t, drv.EventDestroy(1, ev))
	assert.Zero(t, f.LiveEvents(1))
}

func TestCloseReleasesContexts(t *testing.T) {
	f, drv := setup(t)
	assert.Zero(t, f.Retained(0))
	_, _, err := drv.MemGetInfo(0)
	require.NoError(t, err)
	_, _, err = drv.MemGetInfo(0)
	require.NoError(t, err)
	_, _, err = drv.MemGetInfo(1)
	require.NoError(t, err)
	assert.Equal(t, 1, f.Retained(0), "retained once, however often used")
	assert.Equal(t, 1, f.Retained(1))

	require.NoError(t, drv.Close())
	assert.Zero(t, f.Retained(0))
	assert.Zero(t, f.Retained(1))
	_, err = drv.MemAlloc(0, 512)
	require.ErrorIs(t, err, ErrDriverClosed)
	_, err = drv.DeviceCount()
	require.ErrorIs(t, err, ErrDriverClosed)
	_, _, _, err = drv.ContextFuncs(0)
	require.ErrorIs(t, err, ErrDriverClosed)
	require.ErrorIs(t, drv.Close(), ErrDriverClosed)
}

func TestContextFuncsWorkFromOtherCCode(t *testing.T) {
	f, drv := setup(t)
	ctx, push, pop, err := drv.ContextFuncs(1)
	require.NoError(t, err)
	require.NotZero(t, ctx)
	require.NotZero(t, push)
	require.NotZero(t, pop)
	assert.NotEqual(t, push, pop)
	assert.Equal(t, 1, f.Retained(1), "the context stays retained for the caller")
	onThread(t, func() {
		dev, err := f.UseContext(push, pop, ctx)
		require.NoError(t, err)
		assert.Equal(t, 1, dev, "pushing the returned context makes device 1 current")
		assert.Zero(t, f.CtxDepth())
	})
	ctx0, _, _, err := drv.ContextFuncs(0)
	require.NoError(t, err)
	assert.NotEqual(t, ctx, ctx0, "one primary context per device")
	_, _, _, err = drv.ContextFuncs(5)
	require.ErrorIs(t, err, gocore.ErrInvalidDevice)
}

func TestPinnedHostMemoryDriver(t *testing.T) {
	f, drv := setup(t)
	h, err := drv.MemHostAlloc(0, 10000, HostAllocPortable|HostAllocDeviceMap)
	require.NoError(t, err)
	assert.Equal(t, -1, f.PtrDevice(h), "host memory, not a device's")
	assert.EqualValues(t, 10000, f.LiveBytes(-1))
	flags, err := drv.MemHostGetFlags(0, h)
	require.NoError(t, err)
	assert.EqualValues(t, HostAllocPortable|HostAllocDeviceMap, flags)
	flags, err = drv.MemHostGetFlags(0, h+100)
	require.NoError(t, err, "any address inside the allocation")
	assert.EqualValues(t, HostAllocPortable|HostAllocDeviceMap, flags)

	dev, err := drv.MemAlloc(0, 512)
	require.NoError(t, err)
	_, err = drv.MemHostGetFlags(0, dev)
	require.Error(t, err, "device memory is not pinned host memory")
	assert.Contains(t, err.Error(), "cuMemHostGetFlags: CUDA_ERROR_INVALID_VALUE (1)")
	require.NoError(t, drv.MemFree(0, dev))

	fakecuda.Write(h, []byte("pinned"))
	assert.Equal(t, []byte("pinned"), fakecuda.Read(h, 6))
	require.NoError(t, drv.MemFreeHost(0, h))
	assert.Zero(t, f.LiveBytes(-1))
	err = drv.MemFreeHost(0, h)
	require.Error(t, err, "double free is the driver's error")
	assert.True(t, strings.Contains(err.Error(), "cuMemFreeHost"), err.Error())
}

func TestConcurrentDriverCalls(t *testing.T) {
	f, drv := setup(t)
	const workers, rounds = 8, 200
	errs := make(chan error, workers)
	for w := 0; w < workers; w++ {
		go func(w int) {
			dev := w % 2
			for i := 0; i < rounds; i++ {
				p, err := drv.MemAlloc(dev, uint64(512*(1+i%7)))
				if err != nil {
					errs <- err
					return
				}
				ev, err := drv.EventCreate(dev)
				if err == nil {
					err = drv.EventRecord(dev, ev, uint64(w))
				}
				if err == nil {
					_, err = drv.EventQuery(dev, ev)
				}
				if err == nil {
					err = drv.EventDestroy(dev, ev)
				}
				if err == nil {
					err = drv.MemFree(dev, p)
				}
				if err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		}(w)
	}
	for w := 0; w < workers; w++ {
		require.NoError(t, <-errs)
	}
	assert.Zero(t, f.LiveBytes(0))
	assert.Zero(t, f.LiveBytes(1))
	assert.Zero(t, f.LiveEvents(0)+f.LiveEvents(1))
	assert.Equal(t, 1, f.Retained(0))
	assert.Equal(t, 1, f.Retained(1))
	require.NoError(t, drv.Close())
}

func TestLibraryMissing(t *testing.T) {
	assert.True(t, libraryMissing(DefaultLibrary), "a bare name the dynamic linker could not find")
	assert.True(t, libraryMissing(filepath.Join(t.TempDir(), "libcuda.so.1")))
	existing := filepath.Join(t.TempDir(), "libcuda.so.1")
	require.NoError(t, os.WriteFile(existing, nil, 0o644))
	assert.False(t, libraryMissing(existing), "there, but not loadable")
}

// The driver's CUDA version, and RequireVersion, the gate of the options
// that older drivers misread.
func TestDriverVersion(t *testing.T) {
	_, drv := setup(t, "FAKE_CUDA_DRIVER_VERSION", "12010")
	v, err := drv.Version()
	require.NoError(t, err)
	assert.Equal(t, 12010, v)
	assert.Equal(t, "12.1", VersionString(v))
	assert.Equal(t, "13.0", VersionString(13000))

	// What the gate prevents: this driver rejects maxSize as reserved bytes
	// with an error that says nothing about why.
	_, err = drv.MemPoolCreate(0, PoolProps{LocationType: MemLocationTypeDevice, MaxSize: 32 << 20})
	require.ErrorContains(t, err, "CUDA_ERROR_INVALID_VALUE")
	err = drv.RequireVersion("pool", "MaxSize", 12020)
	require.ErrorIs(t, err, ErrDriverTooOld)
	assert.EqualError(t, err, "pool: MaxSize needs a driver for CUDA 12.2 or newer; "+drv.Path()+" supports CUDA 12.1: driver too old")
	require.NoError(t, drv.RequireVersion("pool", "MaxSize", 12010))

	require.NoError(t, drv.Close())
	_, err = drv.Version()
	require.ErrorIs(t, err, ErrDriverClosed)
}

// While another thread records a CUDA graph in the global capture mode, the
// driver refuses allocations unless the calling thread is relaxed: every
// driver call of ours runs relaxed, and the thread's mode is restored.
// Frees stay refused (the engine makes none during a capture).
func TestDriverCallsRunInRelaxedCaptureMode(t *testing.T) {
	f, drv := setup(t)
	f.SetGlobalCapture(true)
	defer f.SetGlobalCapture(false)
	onThread(t, func() {
		p, err := drv.MemAlloc(0, 4096)
		require.NoError(t, err, "cuMemAlloc during a global capture")
		assert.Zero(t, f.CaptureMode(), "the thread's capture mode is restored")
		h, err := drv.MemHostAlloc(0, 4096, HostAllocPortable)
		require.NoError(t, err)
		assert.Zero(t, f.CaptureViolations())
		err = drv.MemFree(0, p)
		require.ErrorContains(t, err, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "the fake refuses frees during a capture")
		f.SetGlobalCapture(false)
		require.NoError(t, drv.MemFree(0, p))
		require.NoError(t, drv.MemFreeHost(0, h))
	})
}
