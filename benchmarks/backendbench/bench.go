package main

import (
	"fmt"
	"time"

	"github.com/gpumempool/gpumempool/gocore"
)

// row is one size of the result.
type row struct {
	Size     uint64  `json:"size"`
	RawNS    float64 `json:"raw_ns"`    // backend Alloc + Free, per pair
	CachedNS float64 `json:"cached_ns"` // pool Alloc + Free served from the cache, per pair
	Speedup  float64 `json:"speedup"`   // RawNS / CachedNS
	// For backends whose driver keeps a cache of its own (async: the CUDA
	// pool reuses what cuMemFreeAsync gave back, so RawNS is a cache hit
	// too): alloc+free with that cache emptied before each pair, i.e. what a
	// miss in both caches costs. Zero for the other backends.
	RawColdNS     float64 `json:"raw_cold_ns,omitempty"`
	SpeedupVsCold float64 `json:"speedup_vs_cold,omitempty"` // RawColdNS / CachedNS
}

// drainFunc empties a backend's driver-side cache after the work queued on
// the stream has run (nil: the backend keeps no such cache).
type drainFunc func(dev int, s gocore.Stream) error

// measure times, for each size, iters raw alloc+free pairs of be against iters
// cache-hit pairs of a pool over be, on device dev and stream s; with drain,
// also iters raw pairs with the driver's cache emptied before each.
func measure(be gocore.Backend, drain drainFunc, sizes []uint64, iters int64, dev int, s gocore.Stream) ([]row, error) {
	rows := make([]row, 0, len(sizes))
	for _, size := range sizes {
		r := row{Size: size}
		start := time.Now()
		for range iters {
			addr, err := be.Alloc(dev, size, s)
			if err != nil {
				return nil, fmt.Errorf("raw %s alloc of %d bytes: %w", be.Name(), size, err)
			}
			if err := be.Free(dev, addr, size, s); err != nil {
				return nil, fmt.Errorf("raw %s free of %d bytes: %w", be.Name(), size, err)
			}
		}
		r.RawNS = float64(time.Since(start).Nanoseconds()) / float64(iters)
		if drain != nil {
			cold, err := timeCold(be, drain, dev, size, s, iters)
			if err != nil {
				return nil, err
			}
			r.RawColdNS = cold
		}
		p, err := gocore.NewPool(gocore.Config{Name: "bench", Backend: be})
		if err != nil {
			return nil, fmt.Errorf("pool over %s: %w", be.Name(), err)
		}
		cached, err := timeCached(p, size, dev, s, iters)
		if _, cerr := p.Close(); err == nil && cerr != nil {
			err = fmt.Errorf("close the pool over %s: %w", be.Name(), cerr)
		}
		if err != nil {
			return nil, err
		}
		r.CachedNS = cached
		if cached > 0 {
			r.Speedup = r.RawNS / cached
			r.SpeedupVsCold = r.RawColdNS / cached
		}
		rows = append(rows, r)
	}
	return rows, nil
}

// timeCold times iters alloc+free pairs of be, emptying its driver-side
// cache between pairs (outside the timed part).
func timeCold(be gocore.Backend, drain drainFunc, dev int, size uint64, s gocore.Stream, iters int64) (float64, error) {
	var total time.Duration
	for range iters {
		if err := drain(dev, s); err != nil {
			return 0, fmt.Errorf("cold %s: %w", be.Name(), err)
		}
		start := time.Now()
		addr, err := be.Alloc(dev, size, s)
		if err != nil {
			return 0, fmt.Errorf("cold %s alloc of %d bytes: %w", be.Name(), size, err)
		}
		if err := be.Free(dev, addr, size, s); err != nil {
			return 0, fmt.Errorf("cold %s free of %d bytes: %w", be.Name(), size, err)
		}
		total += time.Since(start)
	}
	return float64(total.Nanoseconds()) / float64(iters), nil
}

// timeCached warms the pool with one allocation of size, then times iters
// cache-hit alloc+free pairs.
func timeCached(p *gocore.Pool, size uint64, dev int, s gocore.Stream, iters int64) (float64, error) {
	warm, err := p.Alloc(dev, size, s)
	if err != nil {
		return 0, fmt.Errorf("cached alloc of %d bytes: %w", size, err)
	}
	if err := p.Free(warm); err != nil {
		return 0, fmt.Errorf("cached free of %d bytes: %w", size, err)
	}
	start := time.Now()
	for range iters {
		addr, err := p.Alloc(dev, size, s)
		if err != nil {
			return 0, fmt.Errorf("cached alloc of %d bytes: %w", size, err)
		}
		if err := p.Free(addr); err != nil {
			return 0, fmt.Errorf("cached free of %d bytes: %w", size, err)
		}
	}
	return float64(time.Since(start).Nanoseconds()) / float64(iters), nil
}
