package cuda

import (
	"errors"
	"os"
	"runtime"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/gocore/cuda/internal/fakecuda"
)

func TestMain(m *testing.M) { os.Exit(fakecuda.Main(m)) }

// setup sets the given environment (name, value pairs, e.g. the fake's
// FAKE_CUDA_DEVICES), resets the fake and loads it. At the end of the test
// it checks that no context was left current on any thread, closes the
// driver (unless the test did) and checks that its primary contexts were
// released.
func setup(t *testing.T, env ...string) (*fakecuda.Fake, *Driver) {
	t.Helper()
	require.Zero(t, len(env)%2, "env takes name, value pairs")
	for i := 0; i < len(env); i += 2 {
		t.Setenv(env[i], env[i+1])
	}
	f := fakecuda.Open(t)
	drv, err := Load(f.Path())
	require.NoError(t, err)
	t.Cleanup(func() {
		assert.Zero(t, f.CtxBalance(), "pushes and pops must balance: a context was left current")
		if err := drv.Close(); err != nil && !errors.Is(err, ErrDriverClosed) {
			t.Errorf("close driver: %v", err)
		}
		for dev := 0; dev < 4; dev++ {
			assert.Zero(t, f.Retained(dev), "primary context of device %d still retained", dev)
		}
	})
	return f, drv
}

// setupHiding loads a build of the fake that lacks the named entry points
// (an older driver) and closes it at the end of the test.
func setupHiding(t *testing.T, symbols ...string) (*fakecuda.Fake, *Driver) {
	t.Helper()
	lib := fakecuda.BuildHiding(t, symbols...)
	f := fakecuda.OpenPath(t, lib)
	drv, err := Load(lib)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, drv.Close()) })
	return f, drv
}

// onThread runs fn on a goroutine locked to its OS thread, the thread its
// driver calls run on, so the fake's per-thread context stack can be read.
func onThread(t *testing.T, fn func()) {
	t.Helper()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	fn()
}
