package gocore_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	. "github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/sim"
)

func newTestPool(t testing.TB, device sim.Config, cfg Config) (*Pool, *sim.Backend) {
	t.Helper()
	be, err := sim.New(device)
	require.NoError(t, err)
	cfg.Backend = be
	p, err := NewPool(cfg)
	require.NoError(t, err)
	return p, be
}

// mustOOM allocates expecting an *OutOfMemoryError, and returns it.
func mustOOM(t testing.TB, p *Pool, dev int, size uint64) *OutOfMemoryError {
	t.Helper()
	_, err := p.Alloc(dev, size, 0)
	var oom *OutOfMemoryError
	require.ErrorAs(t, err, &oom)
	return oom
}

// mustAlloc and stats are the in-package tests' helpers (fakedevice_test.go),
// lent through export_test.go so that both test packages share one of each.
var (
	mustAlloc = MustAlloc
	stats     = MustStats
)
