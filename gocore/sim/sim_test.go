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
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sync/errgroup"

	"github.com/gpumempool/gpumempool/gocore"
)

const MiB = 1 << 20

func newSim(t *testing.T, cfg Config) *Backend {
	t.Helper()
	b, err := New(cfg)
	require.NoError(t, err)
	return b
}

// simDeviceRange returns the half-open address range [lo, hi) of device d.
func simDeviceRange(b *Backend, d int) (lo, hi uint64) {
	lo = b.cfg.Base + uint64(d)*b.stride
	return lo, lo + b.stride
}

// checkSimInvariants verifies that the live segments of b are exactly want,
// aligned, inside their device's range and pairwise non-overlapping (rounded
// to the alignment), that the free list is sorted, coalesced and disjoint
// from the segments, and that the byte accounting matches.
func checkSimInvariants(t *testing.T, b *Backend, want map[Segment]bool) {
	t.Helper()
	segs := b.LiveSegmentsList()
	if len(segs) != len(want) {
		t.Fatalf("%d live segments, want %d", len(segs), len(want))
	}
	align := b.Alignment()
	used := make([]uint64, b.Devices())
	var total uint64
	for i, s := range segs {
		if !want[s] {
			t.Fatalf("unexpected live segment %+v", s)
		}
		if s.Addr%align != 0 {
			t.Fatalf("segment %+v not aligned to %d", s, align)
		}
		lo, hi := simDeviceRange(b, s.Device)
		rounded, _ := alignUp(s.Size, align)
		if s.Addr < lo || s.Addr+rounded > hi {
			t.Fatalf("segment %+v outside device range [%#x, %#x)", s, lo, hi)
		}
		if i > 0 {
			prev := segs[i-1]
			if prev.Device > s.Device || (prev.Device == s.Device && prev.Addr >= s.Addr) {
				t.Fatalf("LiveSegmentsList not sorted: %+v before %+v", prev, s)
			}
			// Sorted by address, so no overlap between neighbours means
			// no overlap between any pair.
			prevRounded, _ := alignUp(prev.Size, align)
			if prev.Device == s.Device && prev.Addr+prevRounded > s.Addr {
				t.Fatalf("segments %+v and %+v overlap", prev, s)
			}
		}
		used[s.Device] += s.Size
		total += s.Size
	}
	b.mu.Lock()
	for d := range b.devices {
		free := b.devices[d].free
		for i, r := range free {
			if r.start >= r.end {
				b.mu.Unlock()
				t.Fatalf("empty free range %v on device %d", r, d)
			}
			if i > 0 && free[i-1].end >= r.start {
				b.mu.Unlock()
				t.Fatalf("free ranges %v and %v on device %d not sorted or not coalesced", free[i-1], r, d)
			}
		}
	}
	b.mu.Unlock()
	for d := range used {
		if got := b.UsedBytes(d); got != used[d] {
			t.Fatalf("UsedBytes(%d) = %d, want %d", d, got, used[d])
		}
		capTotal, capFree, err := b.Capacity(d)
		require.NoError(t, err)
		if capTotal != b.cfg.Capacity || capFree != capTotal-used[d] {
			t.Fatalf("Capacity(%d) = (%d, %d), want (%d, %d)", d, capTotal, capFree, b.cfg.Capacity, b.cfg.Capacity-used[d])
		}
	}
	st := b.Stats()
	if st.LiveSegments != len(want) || st.LiveBytes != total {
		t.Fatalf("Stats live = (%d segments, %d bytes), want (%d, %d)", st.LiveSegments, st.LiveBytes, len(want), total)
	}
}

func TestSimConfigDefaults(t *testing.T) {
	b := newSim(t, Config{})
	assert.Equal(t, "sim", b.Name())
	assert.Equal(t, 1, b.Devices())
	assert.Equal(t, uint64(512), b.Alignment())
	cfg := b.Config()
	assert.Equal(t, uint64(80<<30), cfg.Capacity)
	assert.Equal(t, uint64(0x7f0000000000), cfg.Base)
	total, free, err := b.Capacity(0)
	require.NoError(t, err)
	assert.Equal(t, uint64(80<<30), total)
	assert.Equal(t, total, free)

	addr, err := b.Alloc(0, 1, 0)
	require.NoError(t, err)
	assert.Equal(t, uint64(0x7f0000000000), addr, "first allocation starts at the base")

	b = newSim(t, Config{Devices: 3, Capacity: 1 << 20, Alignment: 4096, Base: 1 << 44})
	assert.Equal(t, 3, b.Devices())
	assert.Equal(t, uint64(4096), b.Alignment())
	for d := range 3 {
		addr, err := b.Alloc(d, 10, 0)
		require.NoError(t, err)
		lo, _ := simDeviceRange(b, d)
		assert.Equal(t, lo, addr)
		assert.Equal(t, uint64(1<<44)+uint64(d)<<40, addr, "device %d starts at base + d TiB", d)
	}

	// A large alignment moves the default base up rather than failing.
	b = newSim(t, Config{Alignment: 1 << 50})
	assert.Zero(t, b.Config().Base%(1<<50))
	addr, err = b.Alloc(0, 1, 0)
	require.NoError(t, err)
	assert.Zero(t, addr%(1<<50))
}

func TestSimConfigValidation(t *testing.T) {
	cases := []struct {
		name string
		cfg  Config
		msg  string
	}{
		{"negative devices", Config{Devices: -1}, "Devices"},
		{"alignment not power of two", Config{Alignment: 384}, "Alignment"},
		{"alignment 3", Config{Alignment: 3}, "Alignment"},
		{"misaligned base", Config{Base: 0x1000 + 8, Alignment: 512}, "Base"},
		{"negative latency", Config{Latency: -time.Millisecond}, "Latency"},
		{"negative nth", Config{FailOnNthAlloc: -2}, "FailOnNthAlloc"},
		{"negative fail rate", Config{FailRate: -0.1}, "FailRate"},
		{"fail rate above one", Config{FailRate: 1.5}, "FailRate"},
		{"NaN fail rate", Config{FailRate: math.NaN()}, "FailRate"},
		{"infinite fail rate", Config{FailRate: math.Inf(1)}, "FailRate"},
		{"negative free fail rate", Config{FreeFailRate: -1}, "FreeFailRate"},
		{"free fail rate above one", Config{FreeFailRate: 1.0001}, "FreeFailRate"},
		{"NaN free fail rate", Config{FreeFailRate: math.NaN()}, "FreeFailRate"},
		{"capacity overflows", Config{Capacity: math.MaxUint64}, "Capacity"},
		{"devices overflow address space", Config{Devices: gocore.MaxDevices, Capacity: 1 << 56}, "Devices"},
		{"too many devices", Config{Devices: gocore.MaxDevices + 1}, "Devices"},
		// The default capacity fits; rounded up to this alignment it does
		// not: the alignment is at fault, not a capacity left out.
		{"alignment too large for the capacity", Config{Alignment: 1 << 63}, "Alignment"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b, err := New(tc.cfg)
			require.Error(t, err)
			assert.Nil(t, b)
			assert.Contains(t, err.Error(), tc.msg)
			// Every refusal names its field, for the bindings to name the
			// option, and is a gocore.ErrInvalidArgument.
			var ce *ConfigError
			require.ErrorAs(t, err, &ce)
			assert.Equal(t, tc.msg, ce.Field)
			assert.ErrorIs(t, err, gocore.ErrInvalidArgument)
		})
	}
	// Boundary values are accepted.
	for _, cfg := range []Config{
		{FailRate: 1, FreeFailRate: 1},
		{Alignment: 1, Base: 12345},
		{Devices: 64},
	} {
		_, err := New(cfg)
		assert.NoError(t, err, "config %+v", cfg)
	}
}

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

func TestSimAddressReuse(t *testing.T) {
	b := newSim(t, Config{Capacity: 1 << 20, Alignment: 512})
	a1, err := b.Alloc(0, 1000, 0) // 1024 rounded
	require.NoError(t, err)
	a2, err := b.Alloc(0, 512, 0)
	require.NoError(t, err)
	a3, err := b.Alloc(0, 4096, 0)
	require.NoError(t, err)
	assert.Equal(t, a1+1024, a2, "sizes are rounded to the alignment")
	assert.Equal(t, a2+512, a3)

	// A freed hole is reused by an allocation that fits it.
	require.NoError(t, b.Free(0, a2, 512, 0))
	got, err := b.Alloc(0, 100, 0)
	require.NoError(t, err)
	assert.Equal(t, a2, got, "freed range reused")
	require.NoError(t, b.Free(0, got, 100, 0))

	// Freeing neighbours coalesces them into one range that fits a larger
	// allocation at the lowest address.
	require.NoError(t, b.Free(0, a1, 1000, 0))
	got, err = b.Alloc(0, 1536, 0)
	require.NoError(t, err)
	assert.Equal(t, a1, got, "a1 and a2 coalesced")
	require.NoError(t, b.Free(0, got, 1536, 0))
	require.NoError(t, b.Free(0, a3, 4096, 0))
	got, err = b.Alloc(0, 1024+512+4096, 0)
	require.NoError(t, err)
	assert.Equal(t, a1, got, "everything coalesced")
	require.NoError(t, b.Free(0, got, 1024+512+4096, 0))
	checkSimInvariants(t, b, map[Segment]bool{})
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

func TestSimAutoEvents(t *testing.T) {
	b := newSim(t, Config{Devices: 2})
	assert.False(t, b.ManualEvents())
	ev, err := b.NewEvent(1)
	require.NoError(t, err)
	done, err := b.QueryEvent(ev)
	require.NoError(t, err)
	assert.True(t, done, "an unrecorded event is done")
	for _, s := range []gocore.Stream{0, 7, 7, 1 << 40} {
		require.NoError(t, b.RecordEvent(ev, s))
		done, err = b.QueryEvent(ev)
		require.NoError(t, err)
		assert.True(t, done, "auto events complete at once (stream %d)", s)
	}
}

func TestSimManualEvents(t *testing.T) {
	b := newSim(t, Config{Devices: 2, ManualEvents: true})
	assert.True(t, b.ManualEvents())
	query := func(ev gocore.Event) bool {
		t.Helper()
		done, err := b.QueryEvent(ev)
		require.NoError(t, err)
		return done
	}
	newEv := func(d int) gocore.Event {
		t.Helper()
		ev, err := b.NewEvent(d)
		require.NoError(t, err)
		return ev
	}
	e1, e2, e3, e4 := newEv(0), newEv(0), newEv(0), newEv(1)
	assert.True(t, query(e1), "an unrecorded event is done")
	require.NoError(t, b.RecordEvent(e1, 1))
	require.NoError(t, b.RecordEvent(e2, 2))
	require.NoError(t, b.RecordEvent(e4, 1)) // stream 1 on device 1
	assert.False(t, query(e1))
	assert.False(t, query(e2))
	assert.False(t, query(e4))

	b.CompleteStream(1)
	assert.True(t, query(e1), "completed stream's event is done")
	assert.True(t, query(e4), "CompleteStream covers every device")
	assert.False(t, query(e2), "other streams are unaffected")

	// Work recorded after the completion is pending again; re-recording an
	// event replaces its capture.
	require.NoError(t, b.RecordEvent(e3, 1))
	assert.False(t, query(e3))
	require.NoError(t, b.RecordEvent(e1, 1))
	assert.False(t, query(e1), "re-recorded event captures new work")
	b.CompleteStream(2)
	assert.True(t, query(e2))
	assert.False(t, query(e3))

	b.CompleteAll()
	for _, ev := range []gocore.Event{e1, e2, e3, e4} {
		assert.True(t, query(ev), "event %d after CompleteAll", ev)
	}

	// Switching to automatic completes pending work and later records.
	require.NoError(t, b.RecordEvent(e1, 5))
	assert.False(t, query(e1))
	b.SetManualEvents(false)
	assert.False(t, b.ManualEvents())
	assert.True(t, query(e1), "switching to auto completes pending work")
	require.NoError(t, b.RecordEvent(e2, 5))
	assert.True(t, query(e2))

	// And back to manual: earlier work stays done, new work waits.
	b.SetManualEvents(true)
	assert.True(t, query(e2))
	require.NoError(t, b.RecordEvent(e2, 5))
	assert.False(t, query(e2))
	b.CompleteStream(5)
	assert.True(t, query(e2))
}

func TestSimEventLifecycleErrors(t *testing.T) {
	b := newSim(t, Config{})
	ev, err := b.NewEvent(0)
	require.NoError(t, err)
	other, err := b.NewEvent(0)
	require.NoError(t, err)
	assert.NotEqual(t, ev, other, "event handles are unique")
	assert.NotZero(t, ev, "0 is never a valid event")
	require.NoError(t, b.RecordEvent(ev, 0))
	require.NoError(t, b.DestroyEvent(ev))

	_, err = b.QueryEvent(ev)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "destroyed")
	err = b.RecordEvent(ev, 0)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "destroyed")
	require.Error(t, b.DestroyEvent(ev), "double destroy")

	for _, bogus := range []gocore.Event{0, 999} {
		_, err = b.QueryEvent(bogus)
		require.Error(t, err)
		assert.Contains(t, err.Error(), "unknown")
		require.Error(t, b.RecordEvent(bogus, 0))
		require.Error(t, b.DestroyEvent(bogus))
	}

	// The other event is unaffected.
	done, err := b.QueryEvent(other)
	require.NoError(t, err)
	assert.True(t, done)
	st := b.Stats()
	assert.Equal(t, uint64(2), st.EventsCreated)
	assert.Equal(t, uint64(1), st.EventsDestroyed)
	assert.Equal(t, 1, st.LiveEvents)
	require.NoError(t, b.DestroyEvent(other))
	assert.Zero(t, b.Stats().LiveEvents)
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

// An expandable sim segment reserves what torch reserves for one, 1 1/8
// times the device's capacity in whole 20 MiB pages, so it can grow to
// anything the device can back, with room for holes; a device's range
// holds ExpandableSegments of them.
func TestSimExpandableReservations(t *testing.T) {
	b := newSim(t, Config{Expandable: true, Capacity: 3*MiB + 512})
	assert.EqualValues(t, 20*MiB, b.reserve, "3.375 MiB rounded up to a 20 MiB page")
	x, err := b.Alloc(0, 512, 0)
	require.NoError(t, err)
	y, err := b.Alloc(0, 512, 0)
	require.NoError(t, err)
	assert.Equal(t, x+20*MiB, y)

	// 10 GiB: a reservation of 11,520 MiB (576 pages), and 4096 of them
	// fill a whole number of TiB.
	const capacity, reservation = 10 << 30, 11520 * MiB
	b = newSim(t, Config{Expandable: true, Capacity: capacity})
	assert.EqualValues(t, reservation, b.reserve)
	lo, hi := simDeviceRange(b, 0)
	assert.EqualValues(t, ExpandableSegments*reservation, hi-lo)
	want := map[Segment]bool{}
	var prev uint64
	for i := range ExpandableSegments {
		addr, err := b.Alloc(0, 512, 0)
		require.NoError(t, err, "segment %d", i+1)
		if i > 0 {
			require.Equal(t, prev+reservation, addr)
		}
		prev = addr
		want[Segment{Addr: addr, Size: 512}] = true
	}
	_, err = b.Alloc(0, 512, 0)
	require.ErrorIs(t, err, gocore.ErrBackendOutOfMemory, "the address range is full")
	assert.Contains(t, err.Error(), "no contiguous free address range")
	checkSimInvariants(t, b, want)
	for s := range want {
		require.NoError(t, b.Free(0, s.Addr, s.Size, 0))
	}
	checkSimInvariants(t, b, nil)

	// One segment grows to the whole capacity.
	b = newSim(t, Config{Expandable: true, Capacity: 64 * MiB})
	addr, err := b.Alloc(0, 2*MiB, 0)
	require.NoError(t, err)
	require.NoError(t, b.Expand(0, addr, 2*MiB, 62*MiB, 0))
	require.ErrorIs(t, b.Expand(0, addr, 64*MiB, 2*MiB, 0), gocore.ErrBackendOutOfMemory, "beyond the capacity")
	checkSimInvariants(t, b, map[Segment]bool{{Addr: addr, Size: 64 * MiB}: true})

	// Shrink gives the end back, keeping the reservation: it grows again.
	for _, bad := range []struct{ size, less uint64 }{{64 * MiB, 0}, {64 * MiB, MiB}, {64 * MiB, 64 * MiB}, {62 * MiB, 2 * MiB}} {
		_, err := b.Shrink(0, addr, bad.size, bad.less, 0)
		require.Error(t, err, "%+v", bad)
	}
	n, err := b.Shrink(0, addr, 64*MiB, 60*MiB, 0)
	require.NoError(t, err)
	assert.EqualValues(t, 60*MiB, n)
	checkSimInvariants(t, b, map[Segment]bool{{Addr: addr, Size: 4 * MiB}: true})
	assert.EqualValues(t, 1, b.Stats().Shrinks)
	require.NoError(t, b.Expand(0, addr, 4*MiB, 60*MiB, 0))
	require.NoError(t, b.Free(0, addr, 64*MiB, 0))
	checkSimInvariants(t, b, nil)
	_, err = newSim(t, Config{}).Shrink(0, addr, 4*MiB, 2*MiB, 0)
	require.ErrorIs(t, err, gocore.ErrUnsupported)
}

func TestSimPlaceNext(t *testing.T) {
	b := newSim(t, Config{Devices: 2, Capacity: 1 << 30})
	lo, hi := simDeviceRange(b, 1)
	win := lo + (hi-lo)/2
	live := map[Segment]bool{}
	alloc := func(size uint64) uint64 {
		t.Helper()
		a, err := b.Alloc(1, size, 0)
		require.NoError(t, err)
		live[Segment{Device: 1, Addr: a, Size: size}] = true
		return a
	}

	// Placed segments go into the upper half, in the order of their
	// offsets, whatever order they are allocated in.
	require.NoError(t, b.PlaceNext(1, 4*MiB, 2*MiB))
	first := alloc(2 * MiB)
	require.NoError(t, b.PlaceNext(1, 0, 2*MiB))
	second := alloc(2 * MiB)
	assert.Equal(t, win+4*MiB, first)
	assert.Equal(t, win, second, "the second segment sits below the first, as asked")
	assert.Equal(t, uint64(2), b.Stats().Placed)

	// An Alloc of another size leaves the placement for the one it names;
	// unplaced segments go first fit, from the bottom of the range.
	require.NoError(t, b.PlaceNext(1, 2*MiB, 20*MiB))
	assert.Equal(t, lo, alloc(2*MiB))
	// 20 MiB at win+2 MiB would overlap first: first fit instead, and the
	// placement is spent.
	got := alloc(20 * MiB)
	assert.Equal(t, lo+2*MiB, got)
	assert.Equal(t, lo+22*MiB, alloc(20*MiB), "a spent placement does not apply again")

	// A gap between placed segments is used exactly; freeing them coalesces.
	require.NoError(t, b.PlaceNext(1, 2*MiB, 2*MiB))
	mid := alloc(2 * MiB)
	assert.Equal(t, win+2*MiB, mid)
	checkSimInvariants(t, b, live)
	for s := range live {
		require.NoError(t, b.Free(s.Device, s.Addr, s.Size, 0))
		delete(live, s)
	}
	checkSimInvariants(t, b, live)

	// Size 0 withdraws; an offset beyond the window is never honoured.
	require.NoError(t, b.PlaceNext(1, 8*MiB, 2*MiB))
	require.NoError(t, b.PlaceNext(1, 0, 0))
	assert.Equal(t, lo, alloc(2*MiB))
	require.NoError(t, b.PlaceNext(1, hi-win, 2*MiB))
	assert.Equal(t, lo+2*MiB, alloc(2*MiB))
	assert.Equal(t, uint64(3), b.Stats().Placed)
	checkSimInvariants(t, b, live)

	assert.ErrorIs(t, b.PlaceNext(1, 100, 2*MiB), gocore.ErrInvalidArgument, "offsets are aligned")
	assert.Error(t, b.PlaceNext(2, 0, 2*MiB), "no device 2")
}
