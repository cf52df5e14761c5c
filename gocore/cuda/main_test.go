//go:build cgo

package cuda

import (
	"os"
	"testing"

	"github.com/gpumempool/gpumempool/gocore/cuda/driver"
	"github.com/gpumempool/gpumempool/gocore/cuda/internal/fakecuda"
	"github.com/stretchr/testify/require"
)

func TestMain(m *testing.M) { os.Exit(fakecuda.Main(m)) }

// setup loads the fake driver with env set (see fakecuda.Setup).
func setup(t *testing.T, env ...string) (*fakecuda.Fake, *driver.Driver) {
	t.Helper()
	return fakecuda.Setup(t, driver.Load, driver.ErrDriverClosed, env...)
}

// setupHiding loads a build of the fake that lacks the named entry points.
func setupHiding(t *testing.T, symbols ...string) (*fakecuda.Fake, *driver.Driver) {
	t.Helper()
	return fakecuda.SetupHiding(t, driver.Load, symbols...)
}

// newGPUBackend returns the backend newBackend makes over drv with opts
// (NewAsyncBackend, NewVMMBackend), failing the test if it cannot.
func newGPUBackend[B, O any](t *testing.T, newBackend func(*driver.Driver, O) (B, error), drv *driver.Driver, opts O) B {
	t.Helper()
	be, err := newBackend(drv, opts)
	require.NoError(t, err)
	return be
}

// onThread runs fn locked to its OS thread (see fakecuda.OnThread).
func onThread(t *testing.T, fn func()) {
	t.Helper()
	fakecuda.OnThread(fn)
}
