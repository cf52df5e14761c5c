// Package simtest holds test doubles over the engine's simulated device that
// the tests of several packages share (as net/http/httptest does for HTTP).
// Nothing shipped imports it.
package simtest

import (
	"errors"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/sim"
)

// ErrRefused is the error of a Free that RefusingFree refuses.
var ErrRefused = errors.New("refused")

// RefusingFree is a simulated device whose Free fails while Refuse is set:
// a device that will not take memory back, as a CUDA backend during a
// stream capture, or a driver error.
type RefusingFree struct {
	*sim.Backend
	Refuse atomic.Bool
}

// Free gives the segment back to the simulator, or fails with ErrRefused
// while Refuse is set.
func (b *RefusingFree) Free(device int, addr, size uint64, stream gocore.Stream) error {
	if b.Refuse.Load() {
		return ErrRefused
	}
	return b.Backend.Free(device, addr, size, stream)
}

// NewRefusingPool returns a pool named name over a fresh 1 GiB simulated
// device whose frees the test can refuse, with that device and the
// simulator under it.
func NewRefusingPool(t testing.TB, name string) (*gocore.Pool, *RefusingFree, *sim.Backend) {
	t.Helper()
	sim, err := sim.New(sim.Config{Capacity: 1 << 30})
	require.NoError(t, err)
	be := &RefusingFree{Backend: sim}
	p, err := gocore.NewPool(gocore.Config{Name: name, Backend: be})
	require.NoError(t, err)
	return p, be, sim
}
