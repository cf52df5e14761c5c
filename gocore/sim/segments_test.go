package sim

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sync/errgroup"

	"github.com/gpumempool/gpumempool/gocore"
)

// TestSimRandomAllocFreeInvariants runs a long random sequence of allocs and
// frees over two devices and checks after every operation that live segments
// are aligned, in range, non-overlapping and correctly accounted.
func TestSimRandomAllocFreeInvariants(t *testing.T) {
	for _, align := range []uint64{1, 512, 1 << 16} {
		t.Run(fmt.Sprintf("align%d", align), func(t *testing.T) {
			const capacity = 8 << 20
			b := newSim(t, Config{Devices: 2, Capacity: capacity, Alignment: align})
			rng := rand.New(rand.NewPCG(42, uint64(align)))
			live := map[Segment]bool{}
			var order []Segment // live segments in a random-access slice
			ooms := 0
			for op := range 3000 {
				if len(order) > 0 && rng.IntN(100) < 45 {
					i := rng.IntN(len(order))
					s := order[i]
					require.NoError(t, b.Free(s.Device, s.Addr, s.Size, 0), "op %d", op)
					delete(live, s)
					order[i] = order[len(order)-1]
					order = order[:len(order)-1]
				} else {
					d := rng.IntN(2)
					var size uint64
					switch rng.IntN(3) {
					case 0:
						size = 1 + rng.Uint64N(1024)
					case 1:
						size = 1 + rng.Uint64N(64<<10)
					default:
						size = 1 + rng.Uint64N(1<<20)
					}
					before := b.UsedBytes(d)
					addr, err := b.Alloc(d, size, gocore.Stream(rng.IntN(4)))
					if err != nil {
						require.ErrorIs(t, err, gocore.ErrBackendOutOfMemory, "op %d", op)
						require.Greater(t, before+size, uint64(capacity), "op %d: OOM with room left", op)
						ooms++
					} else {
						s := Segment{Device: d, Addr: addr, Size: size}
						require.False(t, live[s], "op %d: address %#x handed out twice", op, addr)
						live[s] = true
						order = append(order, s)
					}
				}
				checkSimInvariants(t, b, live)
			}
			assert.Positive(t, ooms, "the sequence should reach the capacity limit")
			for _, s := range order {
				require.NoError(t, b.Free(s.Device, s.Addr, s.Size, 0))
			}
			checkSimInvariants(t, b, map[Segment]bool{})
			b.mu.Lock()
			for d := range b.devices {
				lo, hi := simDeviceRange(b, d)
				assert.Equal(t, []freeRange{{lo, hi}}, b.devices[d].free, "device %d free list fully coalesced", d)
			}
			b.mu.Unlock()
			st := b.Stats()
			assert.Equal(t, st.Allocs, st.Frees)
			assert.Equal(t, uint64(ooms), st.FailedAllocs)
		})
	}
}

func TestSimCapacityOOM(t *testing.T) {
	b := newSim(t, Config{Devices: 2, Capacity: 4096})
	a, err := b.Alloc(1, 3000, 0)
	require.NoError(t, err)
	_, err = b.Alloc(1, 2000, 0)
	require.Error(t, err)
	require.ErrorIs(t, err, gocore.ErrBackendOutOfMemory)
	for _, want := range []string{"device 1", "2000", "3000", "4096"} {
		assert.Contains(t, err.Error(), want)
	}
	// The failure changed nothing; device 0 is independent.
	checkSimInvariants(t, b, map[Segment]bool{{Device: 1, Addr: a, Size: 3000}: true})
	_, err = b.Alloc(0, 4096, 0)
	require.NoError(t, err, "device 0 has its own capacity")
	_, err = b.Alloc(1, 1096, 0)
	require.NoError(t, err, "exactly filling the capacity is allowed")
	_, err = b.Alloc(1, 1, 0)
	require.ErrorIs(t, err, gocore.ErrBackendOutOfMemory)
	_, err = b.Alloc(1, math.MaxUint64, 0)
	require.ErrorIs(t, err, gocore.ErrBackendOutOfMemory, "huge sizes do not overflow the accounting")
	_, free, err := b.Capacity(1)
	require.NoError(t, err)
	assert.Zero(t, free)
	st := b.Stats()
	assert.Equal(t, uint64(3), st.Allocs)
	assert.Equal(t, uint64(3), st.FailedAllocs)

	require.NoError(t, b.Free(1, a, 3000, 0))
	_, err = b.Alloc(1, 2000, 0)
	require.NoError(t, err, "capacity is returned on free")
}

func TestSimFailOnNthAlloc(t *testing.T) {
	b := newSim(t, Config{FailOnNthAlloc: 3})
	for call := 1; call <= 6; call++ {
		addr, err := b.Alloc(0, 4096, 0)
		if call == 3 {
			require.Error(t, err, "call %d", call)
			require.ErrorIs(t, err, gocore.ErrBackendOutOfMemory)
			assert.Contains(t, err.Error(), "3")
			continue
		}
		require.NoError(t, err, "call %d", call)
		require.NoError(t, b.Free(0, addr, 4096, 0))
	}
	st := b.Stats()
	assert.Equal(t, uint64(5), st.Allocs)
	assert.Equal(t, uint64(1), st.FailedAllocs)
	assert.Zero(t, st.LiveSegments)

	// The first call can be the failing one.
	b = newSim(t, Config{FailOnNthAlloc: 1})
	_, err := b.Alloc(0, 1, 0)
	require.ErrorIs(t, err, gocore.ErrBackendOutOfMemory)
	_, err = b.Alloc(0, 1, 0)
	require.NoError(t, err)
}

// simFailurePattern returns, for n allocations on a fresh backend built from
// cfg, which ones failed.
func simFailurePattern(t *testing.T, cfg Config, n int) []bool {
	t.Helper()
	b := newSim(t, cfg)
	pattern := make([]bool, n)
	for i := range n {
		addr, err := b.Alloc(0, 512, 0)
		if err != nil {
			require.ErrorIs(t, err, gocore.ErrBackendOutOfMemory)
			pattern[i] = true
			continue
		}
		require.NoError(t, b.Free(0, addr, 512, 0))
	}
	st := b.Stats()
	failed := 0
	for _, f := range pattern {
		if f {
			failed++
		}
	}
	require.Equal(t, uint64(failed), st.FailedAllocs)
	return pattern
}

func TestSimFailRate(t *testing.T) {
	const n = 4000
	p1 := simFailurePattern(t, Config{FailRate: 0.3, Seed: 7}, n)
	p2 := simFailurePattern(t, Config{FailRate: 0.3, Seed: 7}, n)
	p3 := simFailurePattern(t, Config{FailRate: 0.3, Seed: 8}, n)
	assert.Equal(t, p1, p2, "equal seeds give equal failure sequences")
	assert.NotEqual(t, p1, p3, "different seeds give different failure sequences")

	failed := 0
	for _, f := range p1 {
		if f {
			failed++
		}
	}
	rate := float64(failed) / n
	assert.InDelta(t, 0.3, rate, 0.04, "observed failure rate")

	assert.NotContains(t, simFailurePattern(t, Config{FailRate: 0, Seed: 7}, 500), true)
	assert.NotContains(t, simFailurePattern(t, Config{FailRate: 1, Seed: 7}, 500), false)
}

func TestSimFreeFailRate(t *testing.T) {
	b := newSim(t, Config{FreeFailRate: 1})
	addr, err := b.Alloc(0, 1000, 0)
	require.NoError(t, err)
	err = b.Free(0, addr, 1000, 0)
	require.Error(t, err)
	assert.NotErrorIs(t, err, gocore.ErrBackendOutOfMemory)
	seg := Segment{Device: 0, Addr: addr, Size: 1000}
	checkSimInvariants(t, b, map[Segment]bool{seg: true})
	st := b.Stats()
	assert.Equal(t, uint64(1), st.FailedFrees)
	assert.Zero(t, st.Frees)

	// With a partial rate, failed frees leave the segment live and a retry
	// eventually succeeds; the pattern is deterministic for a seed.
	run := func() []bool {
		b := newSim(t, Config{FreeFailRate: 0.5, Seed: 3})
		var outcomes []bool
		for range 50 {
			addr, err := b.Alloc(0, 512, 0)
			require.NoError(t, err)
			for {
				err := b.Free(0, addr, 512, 0)
				outcomes = append(outcomes, err == nil)
				if err == nil {
					break
				}
				require.Equal(t, []Segment{{Device: 0, Addr: addr, Size: 512}}, b.LiveSegmentsList())
				require.Equal(t, uint64(512), b.UsedBytes(0))
			}
		}
		require.Empty(t, b.LiveSegmentsList())
		st := b.Stats()
		require.Equal(t, uint64(50), st.Frees)
		require.Equal(t, uint64(len(outcomes)-50), st.FailedFrees)
		require.Positive(t, st.FailedFrees, "some frees should fail at rate 0.5")
		return outcomes
	}
	assert.Equal(t, run(), run())
}

// SetFreeFailRate changes the rate for the frees that follow: a device that
// refuses to take a segment back and then takes it; a rate that is not a
// probability is refused and changes nothing.
func TestSimSetFreeFailRate(t *testing.T) {
	b := newSim(t, Config{})
	addr, err := b.Alloc(0, 1000, 0)
	require.NoError(t, err)
	require.NoError(t, b.SetFreeFailRate(1))
	assert.Equal(t, 1.0, b.Config().FreeFailRate)
	require.Error(t, b.Free(0, addr, 1000, 0))
	assert.Equal(t, []Segment{{Device: 0, Addr: addr, Size: 1000}}, b.LiveSegmentsList())

	var ce *ConfigError
	require.ErrorAs(t, b.SetFreeFailRate(1.5), &ce)
	assert.Equal(t, "FreeFailRate", ce.Field)
	assert.ErrorIs(t, b.SetFreeFailRate(-0.1), gocore.ErrInvalidArgument)
	assert.Equal(t, 1.0, b.Config().FreeFailRate, "a refused rate changes nothing")

	require.NoError(t, b.SetFreeFailRate(0))
	require.NoError(t, b.Free(0, addr, 1000, 0))
	assert.Empty(t, b.LiveSegmentsList())
}

func TestSimBadArguments(t *testing.T) {
	b := newSim(t, Config{Devices: 2, Capacity: 1 << 20})
	addr, err := b.Alloc(0, 1000, 0)
	require.NoError(t, err)
	seg := map[Segment]bool{{Device: 0, Addr: addr, Size: 1000}: true}

	for _, d := range []int{-1, 2, 100} {
		_, err := b.Alloc(d, 512, 0)
		require.Error(t, err, "alloc on device %d", d)
		assert.NotErrorIs(t, err, gocore.ErrBackendOutOfMemory)
		assert.Contains(t, err.Error(), strconv.Itoa(d))
		require.Error(t, b.Free(d, addr, 1000, 0), "free on device %d", d)
		_, _, err = b.Capacity(d)
		require.Error(t, err, "capacity of device %d", d)
		assert.Zero(t, b.UsedBytes(d))
		_, err = b.NewEvent(d)
		require.Error(t, err, "event on device %d", d)
	}
	_, err = b.Alloc(0, 0, 0)
	require.Error(t, err)
	assert.NotErrorIs(t, err, gocore.ErrBackendOutOfMemory)
	assert.Contains(t, err.Error(), "size")

	require.Error(t, b.Free(0, addr+512, 488, 0), "free of an address inside a segment")
	require.Error(t, b.Free(0, addr, 1024, 0), "free with the rounded size")
	require.Error(t, b.Free(0, addr, 999, 0), "free with a smaller size")
	require.Error(t, b.Free(1, addr, 1000, 0), "free on the wrong device")
	require.Error(t, b.Free(0, 12345, 1000, 0), "free of an unknown address")
	checkSimInvariants(t, b, seg)

	require.NoError(t, b.Free(0, addr, 1000, 0))
	err = b.Free(0, addr, 1000, 0)
	require.Error(t, err, "double free")
	assert.Contains(t, err.Error(), "not the start of a live segment")
	checkSimInvariants(t, b, map[Segment]bool{})

	st := b.Stats()
	assert.Equal(t, uint64(1), st.Allocs)
	assert.Equal(t, uint64(1), st.Frees)
	assert.Equal(t, uint64(4), st.FailedAllocs) // three bad devices, one zero size
	assert.Equal(t, uint64(9), st.FailedFrees)  // three bad devices, five bad frees, one double free
	assert.Zero(t, st.EventsCreated)
}

func TestSimConcurrentAllocFree(t *testing.T) {
	b := newSim(t, Config{Devices: 2, Capacity: 256 << 20, FailRate: 0.05, Seed: 1, ManualEvents: true})
	const workers = 16
	var g errgroup.Group
	var mu sync.Mutex
	seen := map[Segment]bool{} // every (device, addr) live at some point, checked for double hand-out
	for w := range workers {
		g.Go(func() error {
			rng := rand.New(rand.NewPCG(uint64(w), 99))
			var mine []Segment
			ev, err := b.NewEvent(w % 2)
			if err != nil {
				return err
			}
			for i := range 300 {
				if len(mine) > 0 && rng.IntN(2) == 0 {
					j := rng.IntN(len(mine))
					s := mine[j]
					mine = slices.Delete(mine, j, j+1)
					key := Segment{Device: s.Device, Addr: s.Addr}
					mu.Lock()
					delete(seen, key)
					mu.Unlock()
					if err := b.Free(s.Device, s.Addr, s.Size, gocore.Stream(w)); err != nil {
						return fmt.Errorf("worker %d op %d: %w", w, i, err)
					}
					continue
				}
				d := rng.IntN(2)
				size := 1 + rng.Uint64N(256<<10)
				addr, err := b.Alloc(d, size, gocore.Stream(w))
				if errors.Is(err, gocore.ErrBackendOutOfMemory) {
					continue
				}
				if err != nil {
					return fmt.Errorf("worker %d op %d: %w", w, i, err)
				}
				if addr%b.Alignment() != 0 {
					return fmt.Errorf("worker %d: misaligned %#x", w, addr)
				}
				key := Segment{Device: d, Addr: addr}
				mu.Lock()
				dup := seen[key]
				seen[key] = true
				mu.Unlock()
				if dup {
					return fmt.Errorf("worker %d: address %#x on device %d handed out twice", w, addr, d)
				}
				mine = append(mine, Segment{Device: d, Addr: addr, Size: size})
				if err := b.RecordEvent(ev, gocore.Stream(w)); err != nil {
					return err
				}
				if _, err := b.QueryEvent(ev); err != nil {
					return err
				}
				if i%50 == 0 {
					b.CompleteStream(gocore.Stream(w))
				}
			}
			for _, s := range mine {
				mu.Lock()
				delete(seen, Segment{Device: s.Device, Addr: s.Addr})
				mu.Unlock()
				if err := b.Free(s.Device, s.Addr, s.Size, gocore.Stream(w)); err != nil {
					return fmt.Errorf("worker %d final free: %w", w, err)
				}
			}
			return b.DestroyEvent(ev)
		})
	}
	// A reader polls the introspection methods while the workers run, so
	// that the race detector sees them race with Alloc and Free.
	stop := make(chan struct{})
	readerDone := make(chan struct{})
	go func() {
		defer close(readerDone)
		for {
			select {
			case <-stop:
				return
			default:
			}
			_ = b.Stats()
			_ = b.LiveSegmentsList()
			_ = b.UsedBytes(1)
			_, _, _ = b.Capacity(0)
		}
	}()
	err := g.Wait()
	close(stop)
	<-readerDone
	require.NoError(t, err)
	st := b.Stats()
	assert.Zero(t, st.LiveBytes)
	assert.Zero(t, st.LiveSegments)
	assert.Zero(t, st.LiveEvents)
	assert.Equal(t, st.Allocs, st.Frees)
	assert.Positive(t, st.Allocs)
	assert.Positive(t, st.FailedAllocs, "FailRate 0.05 should inject some failures")
	assert.Equal(t, uint64(workers), st.EventsCreated)
	assert.Empty(t, b.LiveSegmentsList())
	checkSimInvariants(t, b, map[Segment]bool{})
}
