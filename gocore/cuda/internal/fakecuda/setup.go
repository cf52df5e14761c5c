//go:build cgo

package fakecuda

import (
	"errors"
	"runtime"
	"testing"
)

// Driver is what Setup needs of a loaded driver: a *driver.Driver, which
// this package cannot name (the driver's own tests import it).
type Driver interface{ Close() error }

// Setup sets the given environment (name, value pairs, e.g. the fake's
// FAKE_CUDA_DEVICES), resets the fake and loads it with load (driver.Load).
// At the end of the test it checks that no context was left current on any
// thread, closes the driver (unless the test did: closing again fails with
// an error wrapping closed) and checks that its primary contexts were
// released.
func Setup[D Driver](t *testing.T, load func(string) (D, error), closed error, env ...string) (*Fake, D) {
	t.Helper()
	if len(env)%2 != 0 {
		t.Fatal("fakecuda: env takes name, value pairs")
	}
	for i := 0; i < len(env); i += 2 {
		t.Setenv(env[i], env[i+1])
	}
	f := Open(t)
	drv, err := load(f.Path())
	if err != nil {
		t.Fatalf("fakecuda: load %s: %v", f.Path(), err)
	}
	t.Cleanup(func() {
		if n := f.CtxBalance(); n != 0 {
			t.Errorf("pushes and pops must balance: a context was left current (balance %d)", n)
		}
		if err := drv.Close(); err != nil && !errors.Is(err, closed) {
			t.Errorf("close driver: %v", err)
		}
		for dev := 0; dev < 4; dev++ {
			if n := f.Retained(dev); n != 0 {
				t.Errorf("primary context of device %d still retained (%d)", dev, n)
			}
		}
	})
	return f, drv
}

// SetupHiding loads a build of the fake that lacks the named entry points
// (an older driver) with load and closes it at the end of the test.
func SetupHiding[D Driver](t *testing.T, load func(string) (D, error), symbols ...string) (*Fake, D) {
	t.Helper()
	lib := BuildHiding(t, symbols...)
	f := OpenPath(t, lib)
	drv, err := load(lib)
	if err != nil {
		t.Fatalf("fakecuda: load %s: %v", lib, err)
	}
	t.Cleanup(func() {
		if err := drv.Close(); err != nil {
			t.Errorf("close driver: %v", err)
		}
	})
	return f, drv
}

// OnThread runs fn locked to the calling goroutine's OS thread, the thread
// its driver calls run on, so the fake's per-thread context stack can be
// read.
func OnThread(fn func()) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	fn()
}

// OptionalSymbols are the entry points a driver older than the
// stream-ordered allocator and VMM lacks, and which Load does not require.
var OptionalSymbols = []string{
	"cuMemPoolCreate", "cuMemPoolDestroy", "cuMemAllocFromPoolAsync", "cuMemFreeAsync", "cuMemPoolSetAttribute",
	"cuMemPoolGetAttribute", "cuMemPoolTrimTo", "cuMemPoolExportToShareableHandle",
	"cuMemPoolImportFromShareableHandle", "cuMemPoolExportPointer", "cuMemPoolImportPointer",
	"cuMemGetAllocationGranularity", "cuMemCreate", "cuMemRelease", "cuMemAddressReserve", "cuMemAddressFree",
	"cuMemMap", "cuMemUnmap", "cuMemSetAccess", "cuMemExportToShareableHandle", "cuMemImportFromShareableHandle",
	"cuStreamCreate", "cuStreamDestroy_v2", "cuStreamIsCapturing", "cuDeviceGetAttribute", "cuMemPoolSetAccess",
	"cuMemPoolGetAccess", "cuDeviceGetUuid_v2", "cuMemGetAddressRange_v2",
}
