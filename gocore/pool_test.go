package gocore_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sync/errgroup"

	. "github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/sim"
)

func TestCloseReportsLiveBlocksAndReturnsEverything(t *testing.T) {
	p, be := newTestPool(t, sim.Config{Devices: 2}, Config{})
	a := mustAlloc(t, p, 0, 100, 0)
	mustAlloc(t, p, 1, 30*MiB, 7)
	c := mustAlloc(t, p, 0, 5000, 0)
	require.NoError(t, p.Free(c))
	rep, err := p.Close()
	require.NoError(t, err)
	require.Len(t, rep.LiveBlocks, 2)
	assert.Equal(t, LiveBlock{Device: 0, Addr: a, Size: 512, Requested: 100}, rep.LiveBlocks[0])
	assert.EqualValues(t, 30*MiB+512, rep.LiveBytes)
	assert.Equal(t, 2, rep.SegmentsFreed)
	assert.Zero(t, be.Stats().LiveSegments)
	assert.Zero(t, be.Stats().LiveBytes)

	_, err = p.Alloc(0, 1, 0)
	assert.ErrorIs(t, err, ErrClosed)
	assert.ErrorIs(t, p.Free(a), ErrClosed)
	assert.ErrorIs(t, p.RecordStream(a, 1), ErrClosed)
	_, err = p.EmptyCache()
	assert.ErrorIs(t, err, ErrClosed)
	_, err = p.Close()
	assert.ErrorIs(t, err, ErrClosed)
	assert.True(t, p.Closed())
}

// callLog is a sim backend that logs its event waits and segment frees.
type callLog struct {
	*sim.Backend
	calls []string
}

func (b *callLog) SynchronizeEvent(ev Event) error {
	b.calls = append(b.calls, "wait")
	return b.Backend.SynchronizeEvent(ev)
}

func (b *callLog) Free(device int, addr, size uint64, stream Stream) error {
	b.calls = append(b.calls, "free")
	return b.Backend.Free(device, addr, size, stream)
}

// A block whose free waits for another stream may still be in use there
// when the pool closes: Close waits for that work before the segment goes.
func TestCloseWaitsForBlocksStillUsedOnOtherStreams(t *testing.T) {
	for _, capturing := range []bool{false, true} {
		device, err := sim.New(sim.Config{ManualEvents: true})
		require.NoError(t, err)
		be := &callLog{Backend: device}
		p, err := NewPool(Config{Backend: be})
		require.NoError(t, err)
		a := mustAlloc(t, p, 0, 4096, 0)
		require.NoError(t, p.RecordStream(a, 3))
		require.NoError(t, p.RecordStream(a, 4))
		require.NoError(t, p.Free(a))
		if capturing {
			p.EnterCapture() // no wait is allowed then
		}
		rep, err := p.Close()
		require.NoError(t, err)
		assert.Empty(t, rep.LiveBlocks, "a was freed")
		if capturing {
			assert.Equal(t, []string{"free"}, be.calls)
			assert.Zero(t, device.Stats().EventWaits)
		} else {
			assert.Equal(t, []string{"wait", "wait", "free"}, be.calls, "both streams' work, then the segment")
			assert.EqualValues(t, 2, device.Stats().EventWaits)
		}
		assert.Zero(t, device.Stats().LiveSegments)
		assert.Zero(t, device.Stats().LiveEvents)
	}
}

// TestRandomWorkloadKeepsInvariants drives random allocs, frees, stream uses
// and event completions across devices and streams, checking every invariant
// after each step and that nothing leaks at the end.
func TestRandomWorkloadKeepsInvariants(t *testing.T) {
	for _, expandable := range []bool{false, true} {
		t.Run(map[bool]string{false: "segments", true: "expandable"}[expandable], func(t *testing.T) {
			randomWorkload(t, expandable)
		})
	}
}

func randomWorkload(t *testing.T, expandable bool) {
	rng := rand.New(rand.NewPCG(1, 2))
	p, be := newTestPool(t, sim.Config{Devices: 2, ManualEvents: true, Capacity: 512 * MiB, Expandable: expandable},
		Config{MaxSplitSize: 40 * MiB, ReleaseThreshold: 200 * MiB})
	sizes := []uint64{1, 512, 700, 4096, 100000, MiB, MiB + 1, 3 * MiB, 12 * MiB, 50 * MiB}
	var live []uint64
	for step := range 3000 {
		switch op := rng.IntN(10); {
		case op < 5:
			sz := sizes[rng.IntN(len(sizes))] + uint64(rng.IntN(3000))
			a, err := p.Alloc(rng.IntN(2), sz, Stream(rng.IntN(3)))
			if err != nil {
				require.ErrorIs(t, err, ErrOutOfMemory, "step %d", step)
				continue
			}
			live = append(live, a)
		case op < 8 && len(live) > 0:
			i := rng.IntN(len(live))
			if rng.IntN(4) == 0 {
				require.NoError(t, p.RecordStream(live[i], Stream(rng.IntN(4))))
			}
			require.NoError(t, p.Free(live[i]))
			live[i] = live[len(live)-1]
			live = live[:len(live)-1]
		case op == 8:
			be.CompleteStream(Stream(rng.IntN(4)))
		default:
			if rng.IntN(20) == 0 {
				_, err := p.EmptyCache()
				require.NoError(t, err)
			}
		}
		require.NoError(t, p.CheckInvariants(), "step %d", step)
	}
	for _, a := range live {
		require.NoError(t, p.Free(a))
	}
	be.CompleteAll()
	_, err := p.EmptyCache()
	require.NoError(t, err)
	s := stats(t, p)
	assert.Zero(t, s.ActiveBytes[0].Current)
	assert.Zero(t, s.ReservedBytes[0].Current)
	assert.Zero(t, be.Stats().LiveSegments)
	if expandable {
		assert.Positive(t, s.NumExpansions, "the workload must exercise growing")
	}
	rep, err := p.Close()
	require.NoError(t, err)
	assert.Empty(t, rep.LiveBlocks)
	assert.Zero(t, be.Stats().LiveEvents)
}

// Pools working side by side on one backend, each with its own pool and
// one they share: the invariants of both hold while they work, each Close
// gives the backend exactly the segments its pool held (live blocks
// included), and in the end the backend holds nothing.
func TestConcurrentPoolsShareBackend(t *testing.T) {
	be, err := sim.New(sim.Config{Capacity: 8 << 30})
	require.NoError(t, err)
	shared, err := NewPool(Config{Name: "shared", Backend: be})
	require.NoError(t, err)
	const workers, rounds, keepEvery = 16, 2000, 500
	var ownFreed atomic.Uint64
	var g errgroup.Group
	for w := range workers {
		g.Go(func() error {
			own, err := NewPool(Config{Name: "own", Backend: be})
			if err != nil {
				return err
			}
			rng := rand.New(rand.NewPCG(uint64(w), 9))
			kept := 0
			for i := range rounds {
				for _, p := range []*Pool{shared, own} {
					a, err := p.Alloc(0, uint64(1+rng.IntN(3*MiB)), Stream(w%3))
					if err != nil {
						return err
					}
					if p == own && i%keepEvery == 0 {
						kept++ // left for Close
						continue
					}
					if err := p.Free(a); err != nil {
						return err
					}
				}
				if i%100 == 0 {
					if err := errors.Join(own.CheckInvariants(), shared.CheckInvariants()); err != nil {
						return fmt.Errorf("worker %d round %d: %w", w, i, err)
					}
				}
			}
			if err := own.CheckInvariants(); err != nil {
				return err
			}
			held, err := own.Stats(-1)
			if err != nil {
				return err
			}
			rep, err := own.Close()
			if err != nil {
				return err
			}
			if rep.BytesFreed != uint64(held.ReservedBytes[0].Current) || rep.SegmentsFreed != int(held.Segment[0].Current) ||
				len(rep.LiveBlocks) != kept || held.Segment[0].Current == 0 {
				return fmt.Errorf("worker %d: close gave back %d segments (%d bytes) with %d live blocks; the pool held %d (%d bytes) and %d live blocks",
					w, rep.SegmentsFreed, rep.BytesFreed, len(rep.LiveBlocks), held.Segment[0].Current, held.ReservedBytes[0].Current, kept)
			}
			if s, err := own.Stats(-1); err != nil || s.ReservedBytes[0].Current != 0 {
				return fmt.Errorf("worker %d: a closed pool still counts %d reserved bytes (%v)", w, s.ReservedBytes[0].Current, err)
			}
			ownFreed.Add(rep.BytesFreed)
			return nil
		})
	}
	require.NoError(t, g.Wait())
	s := stats(t, shared)
	assert.Zero(t, s.AllocatedBytes[0].Current)
	assert.EqualValues(t, workers*rounds, s.Allocation[0].Allocated)
	assert.EqualValues(t, workers*rounds, s.Allocation[0].Freed)
	// The backend holds the shared pool's segments and nothing else.
	bs := be.Stats()
	assert.EqualValues(t, s.Segment[0].Current, bs.LiveSegments)
	assert.EqualValues(t, s.ReservedBytes[0].Current, bs.LiveBytes)
	assert.Positive(t, ownFreed.Load())
	rep, err := shared.Close()
	require.NoError(t, err)
	assert.Empty(t, rep.LiveBlocks)
	assert.EqualValues(t, s.ReservedBytes[0].Current, rep.BytesFreed)
	assert.Zero(t, be.Stats().LiveSegments)
	assert.Zero(t, be.Stats().LiveBytes)
}

// torch rejects max_split_size_mb and max_non_split_rounding_mb below
// LargeBuffer (20 MiB): with a smaller MaxSplitSize every LargeBuffer
// segment would be oversize and each 2 MiB request would cost 20 MiB.
func TestMaxSplitAndNonSplitRoundingMinimum(t *testing.T) {
	be, err := sim.New(sim.Config{})
	require.NoError(t, err)
	for _, c := range []struct {
		cfg  Config
		what string
	}{
		{Config{MaxSplitSize: 4 * MiB}, "max split size"},
		{Config{MaxSplitSize: LargeBuffer - 512}, "max split size"},
		{Config{MaxSplitSize: 32 * MiB, MaxNonSplitRoundingSize: MiB}, "max non-split rounding size"},
		{Config{MaxSplitSize: 32 * MiB, MaxNonSplitRoundingSize: LargeBuffer - 1}, "max non-split rounding size"},
	} {
		c.cfg.Backend = be
		_, err := NewPool(c.cfg)
		require.ErrorIs(t, err, ErrInvalidArgument, "%+v", c.cfg)
		assert.Contains(t, err.Error(), c.what)
		assert.Contains(t, err.Error(), "20971520 bytes")
	}
	p, err := NewPool(Config{Backend: be, MaxSplitSize: LargeBuffer, MaxNonSplitRoundingSize: LargeBuffer})
	require.NoError(t, err, "exactly 20 MiB is allowed, as in torch")
	assert.EqualValues(t, LargeBuffer, p.Config().MaxSplitSize)
	// At the minimum, LargeBuffer segments are oversize but each serves one
	// request below 10 MiB only if nothing smaller is cached: 10 blocks of
	// 2 MiB share one segment when MaxSplitSize is above LargeBuffer.
	q, _ := newTestPool(t, sim.Config{}, Config{MaxSplitSize: 24 * MiB})
	for range 10 {
		mustAlloc(t, q, 0, 2*MiB, 0)
	}
	s := stats(t, q)
	assert.EqualValues(t, 1, s.Segment[0].Current)
	assert.Zero(t, s.OversizeSegments.Current)
}

// Close gives every segment back, oversize ones included, and counts them
// out of oversize_segments.
func TestCloseTakesBackOversizeSegments(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{}, Config{MaxSplitSize: 24 * MiB})
	a := mustAlloc(t, p, 0, 40*MiB, 0)
	mustAlloc(t, p, 0, 30*MiB, 0) // still live at Close
	require.NoError(t, p.Free(a))
	assert.EqualValues(t, 2, stats(t, p).OversizeSegments.Current)
	_, err := p.Close()
	require.NoError(t, err)
	s, err := p.Stats(-1)
	require.NoError(t, err)
	assert.Zero(t, s.Segment[0].Current)
	assert.Zero(t, s.ReservedBytes[0].Current)
	assert.Zero(t, s.OversizeSegments.Current)
	assert.EqualValues(t, 2, s.OversizeSegments.Freed)
}

// A segment whose backend Free fails during Close is kept, still counted as
// reserved, and a later Close retries it.
func TestCloseRetriesSegmentsTheBackendKept(t *testing.T) {
	p, be := newTestPool(t, sim.Config{}, Config{MaxSplitSize: 24 * MiB})
	a := mustAlloc(t, p, 0, 4096, 0)
	mustAlloc(t, p, 0, 30*MiB, 1)
	require.NoError(t, be.SetFreeFailRate(1)) // every Free fails
	rep, err := p.Close()
	require.Error(t, err)
	assert.NotErrorIs(t, err, ErrClosed)
	assert.Len(t, rep.LiveBlocks, 2)
	assert.Zero(t, rep.SegmentsFreed)
	assert.True(t, p.Closed())
	assert.ErrorIs(t, p.Free(a), ErrClosed, "the pool is closed all the same")
	s, err := p.Stats(-1)
	require.NoError(t, err)
	assert.EqualValues(t, 2, s.Segment[0].Current, "what the backend kept is still reserved")
	assert.EqualValues(t, 2*MiB+30*MiB, s.ReservedBytes[0].Current)
	assert.EqualValues(t, 1, s.OversizeSegments.Current)
	assert.Empty(t, p.Snapshot())
	assert.Equal(t, 2, be.Stats().LiveSegments)

	rep, err = p.Close() // still failing: the same segments, the same error
	require.Error(t, err)
	assert.NotErrorIs(t, err, ErrClosed)
	assert.Empty(t, rep.LiveBlocks, "reported by the first Close")

	require.NoError(t, be.SetFreeFailRate(0))
	rep, err = p.Close()
	require.NoError(t, err)
	assert.Equal(t, 2, rep.SegmentsFreed)
	assert.EqualValues(t, 2*MiB+30*MiB, rep.BytesFreed)
	assert.Empty(t, rep.LiveBlocks)
	assert.Zero(t, be.Stats().LiveSegments)
	s, err = p.Stats(-1)
	require.NoError(t, err)
	assert.Zero(t, s.Segment[0].Current)
	assert.Zero(t, s.ReservedBytes[0].Current)
	assert.Zero(t, s.OversizeSegments.Current)
	assert.EqualValues(t, 2, s.NumDeviceFree)

	_, err = p.Close() // nothing left: closing again is an error
	assert.ErrorIs(t, err, ErrClosed)
}

// deviceCount is a sim backend that reports n devices.
type deviceCount struct {
	*sim.Backend
	n int
}

func (b *deviceCount) Devices() int { return b.n }

// A backend may have from 1 to MaxDevices devices.
func TestNewPoolTakesOneToMaxDevices(t *testing.T) {
	device, err := sim.New(sim.Config{})
	require.NoError(t, err)
	for _, c := range []struct {
		n  int
		ok bool
	}{{-1, false}, {0, false}, {1, true}, {MaxDevices, true}, {MaxDevices + 1, false}} {
		p, err := NewPool(Config{Backend: &deviceCount{Backend: device, n: c.n}})
		if !c.ok {
			assert.ErrorIs(t, err, ErrInvalidArgument, "%d devices", c.n)
			continue
		}
		require.NoError(t, err, "%d devices", c.n)
		_, err = p.Stats(c.n - 1)
		assert.NoError(t, err, "the last of %d devices", c.n)
	}
}

// reversedDevices is a two-device sim backend whose device 1 hands out
// lower addresses than device 0 (real devices' ranges come in any order).
type reversedDevices struct{ *sim.Backend }

func (b *reversedDevices) Alloc(device int, size uint64, s Stream) (uint64, error) {
	return b.Backend.Alloc(1-device, size, s)
}

func (b *reversedDevices) Free(device int, addr, size uint64, s Stream) error {
	return b.Backend.Free(1-device, addr, size, s)
}

func (b *reversedDevices) NewEvent(device int) (Event, error) {
	return b.Backend.NewEvent(1 - device)
}

func (b *reversedDevices) Capacity(device int) (uint64, uint64, error) {
	return b.Backend.Capacity(1 - device)
}

// Close lists the live blocks by device, then address, whatever the order
// of the devices' address ranges.
func TestCloseListsLiveBlocksByDeviceThenAddress(t *testing.T) {
	device, err := sim.New(sim.Config{Devices: 2})
	require.NoError(t, err)
	p, err := NewPool(Config{Backend: &reversedDevices{Backend: device}})
	require.NoError(t, err)
	var dev0 []uint64
	for range 20 {
		dev0 = append(dev0, mustAlloc(t, p, 0, 4096, 0))
	}
	dev1 := mustAlloc(t, p, 1, 4096, 0)
	require.Less(t, dev1, slices.Min(dev0), "device 1's addresses are the lower")
	rep, err := p.Close()
	require.NoError(t, err)
	var got []LiveBlock
	for _, a := range dev0 {
		got = append(got, LiveBlock{Device: 0, Addr: a, Size: 4096, Requested: 4096})
	}
	got = append(got, LiveBlock{Device: 1, Addr: dev1, Size: 4096, Requested: 4096})
	assert.Equal(t, got, rep.LiveBlocks)
}
