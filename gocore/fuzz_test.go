package gocore_test

import (
	"errors"
	"math/rand/v2"
	"os"
	"strconv"
	"testing"

	. "github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/sim"
)

// FuzzPoolOps drives random sequences of alloc (and AllocSegment), free, record_stream, event
// completion, empty_cache, trim, limit changes and close across two pools
// sharing one simulated backend (two devices, four streams, manual events,
// optionally expandable and failure-injecting), and checks every invariant
// after every step. When both pools are closed the backend must hold
// nothing.
func FuzzPoolOps(f *testing.F) {
	f.Add([]byte{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15})
	f.Add([]byte("alloc free alloc record complete free empty trim limit close"))
	f.Add([]byte{1, 0, 0, 0, 0, 0, 0, 0, 200, 3, 1, 40, 255, 7, 0, 0, 9, 9, 9, 9})
	f.Fuzz(func(t *testing.T, data []byte) {
		fuzzPoolOps(t, data)
	})
}

// TestFuzzLongRun replays random inputs through the fuzz body until
// GMP_FUZZ_OPS operations have run (skipped when unset): the long run whose
// counts go into the reliability report.
func TestFuzzLongRun(t *testing.T) {
	want, _ := strconv.Atoi(os.Getenv("GMP_FUZZ_OPS"))
	if want <= 0 {
		t.Skip("set GMP_FUZZ_OPS=1000000 for the long run")
	}
	rng := rand.New(rand.NewPCG(uint64(want), 1))
	ops, inputs := 0, 0
	for ops < want {
		data := make([]byte, 2+2*rng.IntN(maxFuzzSteps))
		for i := range data {
			data[i] = byte(rng.Uint32())
		}
		ops += fuzzPoolOps(t, data)
		inputs++
	}
	t.Logf("%d operations in %d inputs, invariants checked after every operation: 0 violations, 0 leaks", ops, inputs)
}

// fuzzSizes covers both pools, the split thresholds and oversize blocks.
var fuzzSizes = [...]uint64{1, 511, 512, 513, 4096, 65536, MiB - 1, MiB, MiB + 1, 3 * MiB, 9 * MiB, 10 * MiB, 25 * MiB, 60 * MiB}

const maxFuzzSteps = 1500

type fuzzReader struct {
	data []byte
	pos  int
}

func (r *fuzzReader) next() int {
	if r.pos >= len(r.data) {
		return -1
	}
	b := int(r.data[r.pos])
	r.pos++
	return b
}

// fuzzPoolOps runs one input and returns how many operations it performed.
func fuzzPoolOps(t *testing.T, data []byte) (ops int) {
	if len(data) == 0 {
		return 0
	}
	r := &fuzzReader{data: data}
	flags := r.next()
	be, err := sim.New(sim.Config{
		Devices: 2, Capacity: 256 * MiB, ManualEvents: true,
		Expandable: flags&1 != 0, FailRate: float64(flags>>1&3) / 10, Seed: int64(flags),
	})
	if err != nil {
		t.Fatal(err)
	}
	// Every third input, the pools share one budget, as a pool and its CUDA
	// graphs' private pools do.
	shared := len(data)%3 == 0
	var pools [2]*Pool
	for i := range pools {
		cfg := Config{Backend: be}
		if shared && i == 1 {
			cfg.Budget = pools[0].Budget()
		}
		if flags&8 != 0 {
			cfg.MaxSplitSize = 24 * MiB
		}
		if flags&16 != 0 {
			cfg.ReleaseThreshold = 32 * MiB
		}
		if flags&32 != 0 && i == 1 { // one pool rounds like torch's roundup_power2_divisions
			cfg.RoundupPower2Divisions = 4
		}
		if flags&64 != 0 && i == 0 { // and one collects garbage against its limit
			cfg.GarbageCollectionThreshold = 0.5
		}
		if flags&128 != 0 && i == 1 { // or keeps its segments, like a CUDA graph's private pool
			cfg.KeepSegments = true
		}
		if pools[i], err = NewPool(cfg); err != nil {
			t.Fatal(err)
		}
	}
	type liveBlock struct {
		pool int
		addr uint64
	}
	var paused [2]int   // EnterCapture not yet resumed, per pool
	var elsewhere int64 // captures of other pools of the process (AddProcessCaptures)
	defer func() { AddProcessCaptures(-elsewhere) }()
	var live []liveBlock
	// Invariant checks are O(blocks) after every step: cap the steps so that
	// a long input costs time linear in the cap, not quadratic in its length.
	for step := 0; step < maxFuzzSteps; step++ {
		op := r.next()
		if op < 0 {
			break
		}
		ops++
		arg := max(r.next(), 0)
		pi := op >> 7 & 1
		p := pools[pi]
		switch op % 10 {
		case 0, 1, 2, 3:
			size := fuzzSizes[arg%len(fuzzSizes)] + uint64(arg>>4)*512
			alloc := p.Alloc
			if op>>6&1 == 1 { // as torch's caching allocator asks for a MemPool's segments
				alloc = p.AllocSegment
			}
			addr, err := alloc(arg>>2&1, size, Stream(arg&3))
			switch {
			case err == nil:
				live = append(live, liveBlock{pi, addr})
			case errors.Is(err, ErrOutOfMemory), errors.Is(err, ErrClosed):
			default:
				t.Fatalf("step %d: alloc %d: unexpected error %v", step, size, err)
			}
		case 4, 5:
			if len(live) == 0 {
				continue
			}
			i := arg % len(live)
			lb := live[i]
			if op%10 == 5 {
				if err := pools[lb.pool].RecordStream(lb.addr, Stream(arg&3)); err != nil && !errors.Is(err, ErrClosed) {
					t.Fatalf("step %d: record stream: %v", step, err)
				}
			}
			if err := pools[lb.pool].Free(lb.addr); err != nil && !errors.Is(err, ErrClosed) {
				t.Fatalf("step %d: free %#x: %v", step, lb.addr, err)
			}
			live[i] = live[len(live)-1]
			live = live[:len(live)-1]
		case 6:
			switch {
			case arg&7 == 5: // a CUDA graph capture begins: no events until it ends
				p.EnterCapture()
				paused[pi]++
			case arg&7 == 6 && paused[pi] > 0:
				paused[pi]--
				if err := p.ExitCapture(); err != nil && !errors.Is(err, ErrClosed) {
					t.Fatalf("step %d: resume events: %v", step, err)
				}
			case arg&7 == 7: // another pool of the process begins or ends a capture
				if elsewhere == 0 {
					AddProcessCaptures(1)
					elsewhere = 1
				} else {
					AddProcessCaptures(-1)
					elsewhere = 0
				}
			default:
				be.CompleteStream(Stream(arg & 3))
				if _, err := p.ProcessEvents(); err != nil && !errors.Is(err, ErrClosed) {
					t.Fatalf("step %d: process events: %v", step, err)
				}
			}
		case 7:
			var err error
			if arg&1 == 0 {
				_, err = p.EmptyCache()
			} else {
				_, err = p.Trim(arg>>1&1, uint64(arg)*MiB/4)
			}
			if err != nil && !errors.Is(err, ErrClosed) {
				t.Fatalf("step %d: empty/trim: %v", step, err)
			}
		case 8:
			var err error
			if arg&1 == 0 {
				err = p.SetLimit(uint64(arg) * MiB)
			} else {
				err = p.SetDeviceLimit(arg>>1&1, uint64(arg)*MiB)
			}
			if err != nil && !errors.Is(err, ErrClosed) {
				t.Fatalf("step %d: set limit: %v", step, err)
			}
		case 9:
			if arg%8 == 0 { // closing is rare, so that the pools do some work first
				if _, err := p.Close(); err != nil && !errors.Is(err, ErrClosed) {
					t.Fatalf("step %d: close: %v", step, err)
				}
			}
		}
		for i, q := range pools {
			if err := q.CheckInvariants(); err != nil {
				t.Fatalf("step %d: pool %d: %v", step, i, err)
			}
			if q.Config().KeepSegments && !q.Closed() {
				if s, err := q.Stats(-1); err == nil && s.NumDeviceFree != 0 {
					t.Fatalf("step %d: pool %d keeps its segments but gave %d back", step, i, s.NumDeviceFree)
				}
			}
		}
	}
	if shared && !pools[0].Closed() && !pools[1].Closed() {
		for dev := range 2 {
			var sum uint64
			for _, q := range pools {
				if s, err := q.Stats(dev); err == nil {
					sum += uint64(s.ReservedBytes[0].Current)
				}
			}
			if got := pools[0].Budget().Reserved(dev); got != sum {
				t.Fatalf("device %d: the shared budget counts %d reserved bytes, the pools hold %d", dev, got, sum)
			}
		}
	}
	for _, p := range pools {
		if _, err := p.Close(); err != nil && !errors.Is(err, ErrClosed) {
			t.Fatalf("final close: %v", err)
		}
	}
	for dev := range 2 {
		if got := pools[0].Budget().Reserved(dev) + pools[1].Budget().Reserved(dev)*uint64(boolInt(!shared)); got != 0 {
			t.Fatalf("device %d: budgets still count %d reserved bytes after both pools closed", dev, got)
		}
	}
	if st := be.Stats(); st.LiveSegments != 0 || st.LiveBytes != 0 || st.LiveEvents != 0 {
		t.Fatalf("backend still holds %d segments, %d bytes, %d events after both pools closed: %v",
			st.LiveSegments, st.LiveBytes, st.LiveEvents, be.LiveSegmentsList())
	}
	return ops
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}
