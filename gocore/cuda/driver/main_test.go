//go:build cgo

package driver

import (
	"os"
	"testing"

	"github.com/gpumempool/gpumempool/gocore/cuda/internal/fakecuda"
)

func TestMain(m *testing.M) { os.Exit(fakecuda.Main(m)) }

// setup loads the fake driver with env set (see fakecuda.Setup).
func setup(t *testing.T, env ...string) (*fakecuda.Fake, *Driver) {
	t.Helper()
	return fakecuda.Setup(t, Load, ErrDriverClosed, env...)
}

// setupHiding loads a build of the fake that lacks the named entry points.
func setupHiding(t *testing.T, symbols ...string) (*fakecuda.Fake, *Driver) {
	t.Helper()
	return fakecuda.SetupHiding(t, Load, symbols...)
}

// onThread runs fn locked to its OS thread (see fakecuda.OnThread).
func onThread(t *testing.T, fn func()) {
	t.Helper()
	fakecuda.OnThread(fn)
}
