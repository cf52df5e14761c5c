package main

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/sim"
)

// TestMeasuresRawAndCached (moved from bindings' BenchBackend test): each
// raw pair pays two backend calls of 20 µs, the cache none.
func TestMeasuresRawAndCached(t *testing.T) {
	js, err := run(`{"backend":"sim","options":{"latency_ns":20000}}`, "4096,1048576", 20, 0, 0)
	require.NoError(t, err)
	var rows []row
	require.NoError(t, json.Unmarshal([]byte(js), &rows))
	require.Len(t, rows, 2)
	for _, r := range rows {
		assert.GreaterOrEqual(t, r.RawNS, 40000.0)
		assert.Less(t, r.CachedNS, r.RawNS)
		assert.Greater(t, r.Speedup, 1.0)
	}
}

// TestColdPairsDrainBeforeEachPair: a backend with a driver-side cache
// (async) has it emptied before every cold pair, outside the timing, and
// every size leaves nothing allocated behind (the real driver calls, on the
// fake libcuda: tests/test_gpu_backends_fake.py).
func TestColdPairsDrainBeforeEachPair(t *testing.T) {
	be, err := sim.New(sim.Config{Capacity: 1 << 30})
	require.NoError(t, err)
	const iters = 5
	drains := 0
	drain := func(dev int, s gocore.Stream) error {
		assert.Equal(t, 0, dev)
		assert.Equal(t, gocore.Stream(7), s)
		drains++
		return nil
	}
	rows, err := measure(be, drain, []uint64{4096, 1 << 20}, iters, 0, 7)
	require.NoError(t, err)
	require.Len(t, rows, 2)
	assert.Equal(t, []uint64{4096, 1 << 20}, []uint64{rows[0].Size, rows[1].Size})
	for _, r := range rows {
		assert.Positive(t, r.RawNS)
		assert.Positive(t, r.RawColdNS)
		assert.Positive(t, r.CachedNS)
		assert.InDelta(t, r.RawColdNS/r.CachedNS, r.SpeedupVsCold, 1e-9)
		assert.InDelta(t, r.RawNS/r.CachedNS, r.Speedup, 1e-9)
	}
	assert.Equal(t, 2*iters, drains)
	st := be.Stats()
	assert.Zero(t, st.LiveSegments)
	assert.Zero(t, st.LiveBytes)
}

// TestNoColdNumbersWithoutADriverCache: backends without one (cuda, sim)
// report no cold figures at all.
func TestNoColdNumbersWithoutADriverCache(t *testing.T) {
	js, err := run(`{"backend": "sim"}`, "4096", 3, 0, 0)
	require.NoError(t, err)
	var rows []map[string]any
	require.NoError(t, json.Unmarshal([]byte(js), &rows))
	require.Len(t, rows, 1)
	assert.EqualValues(t, 4096, rows[0]["size"])
	assert.NotContains(t, rows[0], "raw_cold_ns")
	assert.NotContains(t, rows[0], "speedup_vs_cold")
	be, err := sim.New(sim.Config{Capacity: 1 << 20})
	require.NoError(t, err)
	assert.Nil(t, drainOf(be))
}

// TestBadArguments: sizes and iteration counts are checked before a backend
// is built.
func TestBadArguments(t *testing.T) {
	_, err := run(`{"backend": "sim"}`, "4096,x", 3, 0, 0)
	require.ErrorIs(t, err, gocore.ErrInvalidSize)
	_, err = run(`{"backend": "sim"}`, "0", 3, 0, 0)
	require.ErrorIs(t, err, gocore.ErrInvalidSize)
	_, err = run(`{"backend": "sim"}`, "4096", 0, 0, 0)
	require.ErrorIs(t, err, gocore.ErrInvalidArgument)
	_, err = run(`{"backend": "nonesuch"}`, "4096", 3, 0, 0)
	require.Error(t, err)
}
