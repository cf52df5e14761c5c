package gocore_test

import (
	"fmt"
	"testing"

	. "github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/sim"
)

// fragmentedPool returns a pool holding n free blocks of mixed small sizes,
// kept apart by live blocks so they cannot merge: the state a long training
// run leaves behind.
func fragmentedPool(b *testing.B, n int) *Pool {
	p, _ := newTestPool(b, sim.Config{Capacity: 1 << 40}, Config{})
	addrs := make([]uint64, 0, 2*n)
	for i := range 2 * n {
		addrs = append(addrs, mustAlloc(b, p, 0, uint64(512*(1+i%128)), 0))
	}
	for i := 0; i < len(addrs); i += 2 {
		if err := p.Free(addrs[i]); err != nil {
			b.Fatal(err)
		}
	}
	return p
}

// BenchmarkCacheHit measures one alloc+free pair served from the cache with
// 10 to 100000 other free blocks in the pool. Besides wall time per pair it
// reports the process's CPU time per pair (cpu-ns/op), which time spent
// waiting for a CPU does not inflate: on a machine shared with other work,
// compare that one (with -cpu 1, so that the benchmark is all that runs).
func BenchmarkCacheHit(b *testing.B) {
	for _, n := range []int{10, 1000, 100000} {
		b.Run(fmt.Sprintf("free=%d", n), func(b *testing.B) {
			p := fragmentedPool(b, n)
			b.ReportAllocs()
			b.ResetTimer()
			cpu0, ok := processCPUTime()
			for range b.N {
				allocFree(b, p)
			}
			if cpu1, ok1 := processCPUTime(); ok && ok1 {
				b.ReportMetric(float64(cpu1-cpu0)/float64(b.N), "cpu-ns/op")
			}
		})
	}
}

// BenchmarkCacheHitParallel runs the same pair from GOMAXPROCS goroutines,
// on one shared pool (contended lock) and on a pool per goroutine.
func BenchmarkCacheHitParallel(b *testing.B) {
	b.Run("shared", func(b *testing.B) {
		p := fragmentedPool(b, 1000)
		b.ResetTimer()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				allocFree(b, p)
			}
		})
	})
	b.Run("per-goroutine", func(b *testing.B) {
		be, err := sim.New(sim.Config{Capacity: 1 << 40})
		if err != nil {
			b.Fatal(err)
		}
		b.ResetTimer()
		b.RunParallel(func(pb *testing.PB) {
			p, err := NewPool(Config{Backend: be})
			if err != nil {
				b.Fatal(err)
			}
			for pb.Next() {
				allocFree(b, p)
			}
		})
	})
}

// allocFree is one cache-hit pair: the unit every benchmark here measures.
func allocFree(b *testing.B, p *Pool) {
	a, err := p.Alloc(0, 4096, 0)
	if err != nil {
		b.Fatal(err)
	}
	if err := p.Free(a); err != nil {
		b.Fatal(err)
	}
}
