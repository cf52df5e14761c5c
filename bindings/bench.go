package bindings

import (
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/cuda/driver"
)

// benchRow is one size of BenchBackend's result.
type benchRow struct {
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

// drainable is a backend with a driver-side cache that can be emptied:
// cuda.AsyncBackend (cuMemPoolTrimTo, after the stream has run the frees).
type drainable interface {
	Trim(dev int, keep uint64) error
	Driver() *driver.Driver
}

// timeCold times iters alloc+free pairs of be, emptying its driver-side
// cache between pairs (outside the timed part).
func timeCold(be gocore.Backend, d drainable, dev int, size uint64, s gocore.Stream, iters int64) (float64, error) {
	var total time.Duration
	for range iters {
		if err := d.Driver().StreamSynchronize(dev, uint64(s)); err != nil {
			return 0, fmt.Errorf("cold %s: %w", be.Name(), err)
		}
		if err := d.Trim(dev, 0); err != nil {
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

// BenchBackend measures, for each size in sizesCSV (bytes), the backend's own
// alloc+free latency against the engine's cached re-supply of the same size,
// iters pairs each, on device and stream, with a backend built from the same
// options as NewPool; backends with a driver-side cache (async) are also
// timed with that cache emptied (raw_cold_ns). It runs entirely in Go, so
// the numbers carry no Python overhead. Returns a JSON list of rows.
func BenchBackend(optionsJSON, sizesCSV string, iters, device int64, stream uint64) (js string, err error) {
	defer guard(&err)
	if iters <= 0 {
		return "", fmt.Errorf("iters %d must be positive: %w", iters, gocore.ErrInvalidArgument)
	}
	var sizes []uint64
	for _, f := range strings.Split(sizesCSV, ",") {
		n, perr := strconv.ParseUint(strings.TrimSpace(f), 10, 64)
		if perr != nil || n == 0 {
			return "", fmt.Errorf("size %q: %w", f, gocore.ErrInvalidSize)
		}
		sizes = append(sizes, n)
	}
	o, err := decodeOptions(optionsJSON)
	if err != nil {
		return "", err
	}
	be, _, err := buildBackend(o)
	if err != nil {
		return "", err
	}
	if c, ok := be.(io.Closer); ok {
		defer c.Close()
	}
	dev, s := int(device), gocore.Stream(stream)
	rows := make([]benchRow, 0, len(sizes))
	for _, size := range sizes {
		row := benchRow{Size: size}
		start := time.Now()
		for range iters {
			addr, err := be.Alloc(dev, size, s)
			if err != nil {
				return "", fmt.Errorf("raw %s alloc of %d bytes: %w", be.Name(), size, err)
			}
			if err := be.Free(dev, addr, size, s); err != nil {
				return "", fmt.Errorf("raw %s free of %d bytes: %w", be.Name(), size, err)
			}
		}
		row.RawNS = float64(time.Since(start).Nanoseconds()) / float64(iters)
		if d, ok := be.(drainable); ok {
			if row.RawColdNS, err = timeCold(be, d, dev, size, s, iters); err != nil {
				return "", err
			}
		}
		p, err := gocore.NewPool(gocore.Config{Name: "bench", Backend: be})
		if err != nil {
			return "", err
		}
		cached, err := timeCached(p, size, dev, s, iters)
		if _, cerr := p.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return "", err
		}
		row.CachedNS = cached
		if cached > 0 {
			row.Speedup = row.RawNS / cached
			row.SpeedupVsCold = row.RawColdNS / cached
		}
		rows = append(rows, row)
	}
	return marshal(rows)
}

// timeCached warms the pool with one allocation of size, then times iters
// cache-hit alloc+free pairs.
func timeCached(p *gocore.Pool, size uint64, dev int, s gocore.Stream, iters int64) (float64, error) {
	warm, err := p.Alloc(size, dev, s)
	if err != nil {
		return 0, fmt.Errorf("cached alloc of %d bytes: %w", size, err)
	}
	if err := p.Free(warm); err != nil {
		return 0, err
	}
	start := time.Now()
	for range iters {
		addr, err := p.Alloc(size, dev, s)
		if err != nil {
			return 0, fmt.Errorf("cached alloc of %d bytes: %w", size, err)
		}
		if err := p.Free(addr); err != nil {
			return 0, err
		}
	}
	return float64(time.Since(start).Nanoseconds()) / float64(iters), nil
}
