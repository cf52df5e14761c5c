// Command backendbench measures, for each size, a backend's own alloc+free
// latency against the engine's cached re-supply of the same size, with a
// backend built from the same JSON options as gpumempool's pools;
// backends with a driver-side cache (async) are also timed with that cache
// emptied before each pair (raw_cold_ns). It runs entirely in Go, so the
// numbers carry no Python overhead. benchmarks/gpu_backends.py builds and
// runs it; it is not part of the extension.
//
//	backendbench -options '{"backend": "async"}' -sizes 4096,1048576 -iters 2000
//
// prints a JSON list of rows (size, raw_ns, cached_ns, speedup, and for
// async raw_cold_ns, speedup_vs_cold).
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/gpumempool/gpumempool/bindings"
	"github.com/gpumempool/gpumempool/bindings/registry"
	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/cuda/driver"
)

func main() {
	options := flag.String("options", "{}", "the backend's options, as gpumempool's MemPool takes them (JSON)")
	sizesCSV := flag.String("sizes", "4096", "sizes in bytes, comma-separated")
	iters := flag.Int64("iters", 1000, "alloc+free pairs timed per size and kind")
	device := flag.Int("device", 0, "device ordinal")
	stream := flag.Uint64("stream", 0, "stream handle")
	flag.Parse()
	js, err := run(*options, *sizesCSV, *iters, *device, gocore.Stream(*stream))
	if err != nil {
		fmt.Fprintln(os.Stderr, "backendbench:", err)
		os.Exit(1)
	}
	fmt.Println(js)
}

func run(optionsJSON, sizesCSV string, iters int64, dev int, s gocore.Stream) (string, error) {
	if iters <= 0 {
		return "", fmt.Errorf("iters %d must be positive: %w", iters, gocore.ErrInvalidArgument)
	}
	sizes, err := parseSizes(sizesCSV)
	if err != nil {
		return "", err
	}
	// A pool of gpumempool's own builds the backend from the options,
	// exactly as MemPool does; closing it closes the backend.
	id, err := bindings.NewPool(optionsJSON)
	if err != nil {
		return "", fmt.Errorf("backend from %s: %w", optionsJSON, err)
	}
	defer func() { _, _ = bindings.PoolClose(id) }()
	e, err := registry.Get(id)
	if err != nil {
		return "", fmt.Errorf("backend from %s: %w", optionsJSON, err)
	}
	be := e.Pool.Backend()
	rows, err := measure(be, drainOf(be), sizes, iters, dev, s)
	if err != nil {
		return "", err
	}
	b, err := json.Marshal(rows)
	return string(b), err
}

func parseSizes(csv string) ([]uint64, error) {
	var sizes []uint64
	for _, f := range strings.Split(csv, ",") {
		n, err := strconv.ParseUint(strings.TrimSpace(f), 10, 64)
		if err != nil || n == 0 {
			return nil, fmt.Errorf("size %q: %w", f, gocore.ErrInvalidSize)
		}
		sizes = append(sizes, n)
	}
	return sizes, nil
}

// drainable is a backend with a driver-side cache that can be emptied:
// cuda.AsyncBackend (cuMemPoolTrimTo, after the stream has run the frees).
type drainable interface {
	Trim(dev int, keep uint64) error
	Driver() *driver.Driver
}

// drainOf returns how to empty be's driver-side cache, or nil.
func drainOf(be gocore.Backend) drainFunc {
	d, ok := be.(drainable)
	if !ok {
		return nil
	}
	return func(dev int, s gocore.Stream) error {
		if err := d.Driver().StreamSynchronize(dev, uint64(s)); err != nil {
			return fmt.Errorf("synchronize stream %#x: %w", uint64(s), err)
		}
		if err := d.Trim(dev, 0); err != nil {
			return fmt.Errorf("trim the driver's pool: %w", err)
		}
		return nil
	}
}
