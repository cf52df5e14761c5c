package sim

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sync/errgroup"
)

func TestSimLatency(t *testing.T) {
	for _, lat := range []time.Duration{20 * time.Microsecond, 3 * time.Millisecond} {
		t.Run(lat.String(), func(t *testing.T) {
			b := newSim(t, Config{Latency: lat})
			start := time.Now()
			addr, err := b.Alloc(0, 512, 0)
			require.NoError(t, err)
			assert.GreaterOrEqual(t, time.Since(start), lat, "Alloc")
			start = time.Now()
			require.NoError(t, b.Free(0, addr, 512, 0))
			assert.GreaterOrEqual(t, time.Since(start), lat, "Free")
			start = time.Now()
			_, err = b.Alloc(0, 0, 0)
			require.Error(t, err)
			assert.GreaterOrEqual(t, time.Since(start), lat, "failing Alloc")
		})
	}
}

// TestSimLatencyNotUnderLock checks that concurrent calls overlap their
// latency instead of queueing behind the lock: eight 100ms calls finish far
// sooner than the 800ms they would take serialized.
func TestSimLatencyNotUnderLock(t *testing.T) {
	const lat = 100 * time.Millisecond
	b := newSim(t, Config{Latency: lat})
	var g errgroup.Group
	start := time.Now()
	for range 8 {
		g.Go(func() error {
			_, err := b.Alloc(0, 512, 0)
			return err
		})
	}
	require.NoError(t, g.Wait())
	elapsed := time.Since(start)
	assert.GreaterOrEqual(t, elapsed, lat)
	assert.Less(t, elapsed, 6*lat, "latency appears to be spent under the lock")
	assert.Equal(t, 8, b.Stats().LiveSegments)
}
