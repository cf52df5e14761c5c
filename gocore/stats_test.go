package gocore_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	. "github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/sim"
)

func TestStatsMapHasTorchKeys(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{}, Config{})
	mustAlloc(t, p, 0, 3000, 0)
	m := stats(t, p)
	km := m.ToMap()
	for _, k := range []string{"allocated_bytes.all.current", "reserved_bytes.small_pool.peak",
		"active.large_pool.freed", "inactive_split_bytes.all.allocated", "requested_bytes.all.current",
		"allocation.all.current", "segment.all.current", "num_alloc_retries", "num_ooms"} {
		assert.Contains(t, km, k)
	}
	assert.EqualValues(t, 3072, km["allocated_bytes.all.current"])
	assert.EqualValues(t, 3000, km["requested_bytes.small_pool.current"])
	assert.EqualValues(t, 2*MiB, km["reserved_bytes.all.peak"])
	assert.EqualValues(t, -1, km["max_split_size"])
}

// Retired reads like the stats of a pool that gave every segment back: no
// current counts, the same totals and peaks.
func TestStatsRetired(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{}, Config{})
	a := mustAlloc(t, p, 0, 3*MiB, 0)
	b := mustAlloc(t, p, 0, 1000, 0)
	require.NoError(t, p.Free(a))
	require.NoError(t, p.Free(b))
	s := stats(t, p)
	r := s.Retired()
	assert.EqualValues(t, 2, s.Segment[0].Current)
	for _, st := range []Stat{r.Segment[0], r.ReservedBytes[0], r.ReservedBytes[KindSmall], r.Allocation[0], r.InactiveSplit[0]} {
		assert.Zero(t, st.Current)
		assert.Equal(t, st.Allocated, st.Freed, "everything counted in is counted out")
	}
	assert.Equal(t, s.ReservedBytes[0].Peak, r.ReservedBytes[0].Peak)
	assert.Equal(t, s.NumDeviceFree+2, r.NumDeviceFree)
	assert.Equal(t, s.NumDeviceAlloc, r.NumDeviceAlloc)
	assert.EqualValues(t, 2, s.Segment[0].Current, "s itself is unchanged")
	_, err := p.Close()
	require.NoError(t, err)
}
