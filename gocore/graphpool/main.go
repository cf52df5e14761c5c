package graphpool

import (
	"errors"

	"github.com/gpumempool/gpumempool/gocore"
)

// The main pool's own verbs, so that a *Pools is the one face of a pool its
// users (the bindings, the C ABI) see: whether a call concerns the private
// pools too is decided here, once (Stats and Close do; the others are the
// main pool's alone, as in torch, whose settings and history are the
// caching allocator's).

// Name returns the main pool's name.
func (p *Pools) Name() string { return p.main.Name() }

// Backend returns the backend the main pool (and every private pool) draws
// from.
func (p *Pools) Backend() gocore.Backend { return p.main.Backend() }

// Config returns the main pool's configuration as it is now.
func (p *Pools) Config() gocore.Config { return p.main.Config() }

// Trim keeps at most keep unused bytes cached by the main pool on dev (all
// devices when dev < 0); see gocore.Pool.Trim.
func (p *Pools) Trim(dev int, keep uint64) (uint64, error) { return p.main.Trim(dev, keep) }

// SetLimit sets the byte limit of every device; the private pools share the
// main pool's budget.
func (p *Pools) SetLimit(limit uint64) error { return p.main.SetLimit(limit) }

// SetDeviceLimit sets the byte limit of one device.
func (p *Pools) SetDeviceLimit(device int, limit uint64) error {
	return p.main.SetDeviceLimit(device, limit)
}

// Limit returns the byte limit in force on device (0: none).
func (p *Pools) Limit(device int) uint64 { return p.main.Limit(device) }

// SetReleaseThreshold sets the main pool's release threshold.
func (p *Pools) SetReleaseThreshold(bytes uint64) error { return p.main.SetReleaseThreshold(bytes) }

// ResetPeakStats resets the main pool's peaks to their current values.
func (p *Pools) ResetPeakStats() { p.main.ResetPeakStats() }

// ResetAccumulatedStats resets the main pool's running totals.
func (p *Pools) ResetAccumulatedStats() { p.main.ResetAccumulatedStats() }

// ProcessEvents frees the main pool's blocks whose events completed; it
// returns how many frees still wait.
func (p *Pools) ProcessEvents() (int, error) { return p.main.ProcessEvents() }

// SeedSegment makes a segment of blocks in the main pool (replays seed the
// segments a recording allocator had; see gocore.Pool.SeedSegment).
func (p *Pools) SeedSegment(dev int, stream gocore.Stream, small bool, blocks []gocore.SeedBlock) ([]uint64, error) {
	return p.main.SeedSegment(dev, stream, small, blocks)
}

// CheckInvariants verifies the main pool's invariants.
func (p *Pools) CheckInvariants() error { return p.main.CheckInvariants() }

// Snapshot returns the main pool's segments and blocks.
func (p *Pools) Snapshot() []gocore.SnapshotSegment { return p.main.Snapshot() }

// RecordHistory turns the main pool's event recording on or off.
func (p *Pools) RecordHistory(enabled bool, maxEntries int) {
	p.main.RecordHistory(enabled, maxEntries)
}

// RecordThreads makes the main pool's history name the OS thread of each
// call, or stops it.
func (p *Pools) RecordThreads(on bool) { p.main.RecordThreads(on) }

// History returns the main pool's recorded events, oldest first.
func (p *Pools) History() []gocore.TraceEntry { return p.main.History() }

// Stats returns the statistics of device dev (all devices when dev < 0),
// the private pools' included, as torch's memory_stats counts its graphs'
// private pools.
func (p *Pools) Stats(dev int) (gocore.Stats, error) {
	s, err := p.main.Stats(dev)
	if err != nil {
		return s, err
	}
	return s, p.AddStats(dev, &s)
}

// Close closes the main pool, then its private pools (which share its
// backend), and reports what both held. Every step runs whatever failed
// before it; the errors are joined.
func (p *Pools) Close() (gocore.CloseReport, error) {
	rep, err := p.main.Close()
	prep, perr := p.ClosePrivate()
	rep.LiveBlocks = append(rep.LiveBlocks, prep.LiveBlocks...)
	rep.LiveBytes += prep.LiveBytes
	rep.SegmentsFreed += prep.SegmentsFreed
	rep.BytesFreed += prep.BytesFreed
	return rep, errors.Join(err, perr)
}
