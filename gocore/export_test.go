package gocore

// The tests that run on the simulated device live in package gocore_test:
// gocore/sim imports gocore, so a test of package gocore cannot import it.
// This file, compiled only into gocore's tests, lends those tests the few
// internals they assert on, as the standard library's export_test.go files
// do. The tests that corrupt or walk the pool's internals stay in package
// gocore, on fakeDevice (fakedevice_test.go).

// KindSmall and KindLarge index a StatArray by pool (small, large).
const (
	KindSmall = kindSmall
	KindLarge = kindLarge
)

var (
	RoundPower2Divisions = roundPower2Divisions
	RoundupInterval      = roundupInterval
	CallerThread         = callerThread
)

// Up and Down move a StatArray as an allocation and a free in pool k do.
func (a *StatArray) Up(k poolKind, n int64)   { a.up(k, n) }
func (a *StatArray) Down(k poolKind, n int64) { a.down(k, n) }

// BestFitBySegment reports whether the pool's torch version breaks best-fit
// ties by segment (rules.bestFitBySegment).
func (p *Pool) BestFitBySegment() bool { return p.rules.bestFitBySegment }

// MustAlloc and MustStats lend the in-package tests' mustAlloc and stats
// (fakedevice_test.go) to package gocore_test, which names them as before
// (helpers_test.go): one definition for both test packages.
var (
	MustAlloc = mustAlloc
	MustStats = stats
)
