// Package bindings is the Python-facing API of gpumempool, wrapped by gopy
// into the extension module gpumempool._core. Its functions take and return
// only plain values (integer handles, sizes, JSON strings) because gopy maps
// those reliably; the typed Python API is built on top in gpumempool/.
//
// Every function recovers Go panics into errors: a panic must never abort
// the Python process. Every error crosses as a structured value (package
// pyerr: kind, message, fields), see guard; every function that serves a
// pool reaches it through withEntry.
package bindings

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"

	// The C ABI lives in the same .so: importing it links its //export
	// functions into the extension.
	"github.com/gpumempool/gpumempool/bindings/cabi"
	"github.com/gpumempool/gpumempool/bindings/registry"
	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/callback"
	"github.com/gpumempool/gpumempool/gocore/graphpool"
	"github.com/gpumempool/gpumempool/gocore/nvmldev"
	"github.com/gpumempool/gpumempool/gocore/options"
	"github.com/gpumempool/gpumempool/gocore/sim"
)

// Version returns the engine version.
func Version() string { return "0.1.0" }

// NumSlots returns how many pools can expose C entry points at once.
func NumSlots() int64 { return registry.NumSlots }

// NewPool creates a pool from a JSON object of options and returns its
// handle.
func NewPool(optionsJSON string) (id int64, err error) {
	defer guard(&err)
	o, err := decodeOptions(optionsJSON)
	if err != nil {
		return 0, err
	}
	be, sim, err := buildBackend(o)
	if err != nil {
		return 0, err
	}
	cfg := o.Policy
	cfg.Name, cfg.Backend = o.Name, be
	p, err := gocore.NewPool(cfg)
	if err != nil {
		return 0, err
	}
	return registry.Add(p, sim).ID, nil
}

// PoolAlloc allocates size bytes on device for stream; it returns the address.
func PoolAlloc(id, size, device int64, stream uint64) (addr uint64, err error) {
	return poolAlloc(id, size, device, stream, (*graphpool.Pools).Alloc)
}

// PoolAllocSegment is PoolAlloc for a caller that sizes its segments itself
// and caches inside them (gocore.Pool.AllocSegment), as torch's caching
// allocator does above a torch.cuda.MemPool; replays of such a pool's
// history call it.
func PoolAllocSegment(id, size, device int64, stream uint64) (addr uint64, err error) {
	return poolAlloc(id, size, device, stream, (*graphpool.Pools).AllocSegment)
}

func poolAlloc(id, size, device int64, stream uint64,
	alloc func(*graphpool.Pools, int, uint64, gocore.Stream) (uint64, error)) (uint64, error) {
	return withEntry(id, func(e *registry.Entry) (uint64, error) {
		if size <= 0 {
			return 0, fmt.Errorf("alloc of %d bytes: size must be positive: %w", size, gocore.ErrInvalidSize)
		}
		if device < 0 || device >= gocore.MaxDevices {
			return 0, fmt.Errorf("alloc on device %d: %w", device, gocore.ErrInvalidDevice)
		}
		if err := cabi.Reentered(e); err != nil {
			return 0, err
		}
		return alloc(e.Pool, int(device), uint64(size), gocore.Stream(stream))
	})
}

// PoolFree frees the block at addr.
//
// ok is true when err is nil (see okOf).
func PoolFree(id int64, addr uint64) (ok bool, err error) {
	return withEntryOK(id, func(e *registry.Entry) error {
		if err := cabi.Reentered(e); err != nil {
			return err
		}
		return e.Pool.Free(addr)
	})
}

// PoolRecordStream marks the block at addr as used on stream.
//
// ok is true when err is nil (see okOf).
func PoolRecordStream(id int64, addr, stream uint64) (ok bool, err error) {
	return withEntryOK(id, func(e *registry.Entry) error { return e.Pool.RecordStream(addr, gocore.Stream(stream)) })
}

// PoolSeedSegment makes a segment of the blocks in blocksJSON (a JSON list
// of [size, requested, live] in address order) on device for stream, with
// the live blocks allocated and the others cached (gocore.Pool.SeedSegment);
// it returns the live blocks' addresses as a JSON list. Replay seeds a pool
// with the segments the recording allocator had at a trace's first event.
func PoolSeedSegment(id, device int64, stream uint64, small bool, blocksJSON string) (js string, err error) {
	return withEntry(id, func(e *registry.Entry) (string, error) { return seedSegment(e, device, stream, small, blocksJSON) })
}

func seedSegment(e *registry.Entry, device int64, stream uint64, small bool, blocksJSON string) (string, error) {
	var raw [][3]json.RawMessage
	if err := json.Unmarshal([]byte(blocksJSON), &raw); err != nil {
		return "", fmt.Errorf("seed segment: blocks must be a JSON list of [size, requested, live]: %v: %w",
			err, gocore.ErrInvalidArgument)
	}
	blocks := make([]gocore.SeedBlock, len(raw))
	for i, r := range raw {
		if err := errors.Join(json.Unmarshal(r[0], &blocks[i].Size), json.Unmarshal(r[1], &blocks[i].Requested),
			json.Unmarshal(r[2], &blocks[i].Live)); err != nil {
			return "", fmt.Errorf("seed segment: block %d must be [size, requested, live]: %v: %w",
				i, err, gocore.ErrInvalidArgument)
		}
	}
	if device < 0 || device >= gocore.MaxDevices {
		return "", fmt.Errorf("seed segment on device %d: %w", device, gocore.ErrInvalidDevice)
	}
	addrs, err := e.Pool.SeedSegment(int(device), gocore.Stream(stream), small, blocks)
	if err != nil {
		return "", err
	}
	return marshal(addrs)
}

// PoolResetStats resets the pool's peaks to their current values (peaks)
// or its running totals to zero (accumulated), as torch's
// reset_peak_memory_stats and reset_accumulated_memory_stats do.
//
// ok is true when err is nil (see okOf).
func PoolResetStats(id int64, peaks, accumulated bool) (ok bool, err error) {
	return withEntryOK(id, func(e *registry.Entry) error {
		if peaks {
			e.Pool.ResetPeakStats()
		}
		if accumulated {
			e.Pool.ResetAccumulatedStats()
		}
		return nil
	})
}

// PoolProcessEvents frees blocks whose events completed; it returns how many
// frees still wait.
func PoolProcessEvents(id int64) (waiting int64, err error) {
	return withEntry(id, func(e *registry.Entry) (int64, error) {
		n, err := e.Pool.ProcessEvents()
		return int64(n), err
	})
}

// PoolStats returns the stats of device (all devices when < 0) as JSON with
// torch's key names.
func PoolStats(id, device int64) (js string, err error) {
	return withEntry(id, func(e *registry.Entry) (string, error) {
		s, err := e.Pool.Stats(int(device)) // torch's CUDA graphs' private pools count too
		if err != nil {
			return "", err
		}
		return marshal(s.ToMap())
	})
}

// PoolEmptyCache releases every wholly free segment, and closes the private
// pools no CUDA graph uses any more; it returns the bytes the pool released.
func PoolEmptyCache(id int64) (released uint64, err error) {
	return withEntry(id, func(e *registry.Entry) (uint64, error) { return e.Pool.EmptyCache() })
}

// PoolTrim keeps at most keep unused bytes cached on device (all when < 0).
func PoolTrim(id, device int64, keep uint64) (released uint64, err error) {
	return withEntry(id, func(e *registry.Entry) (uint64, error) { return e.Pool.Trim(int(device), keep) })
}

// PoolSetLimit sets the byte limit (0: none) of device, or of every device
// when device is -1.
//
// ok is true when err is nil (see okOf).
func PoolSetLimit(id int64, limit uint64, device int64) (ok bool, err error) {
	return withEntryOK(id, func(e *registry.Entry) error {
		if device == -1 {
			return e.Pool.SetLimit(limit)
		}
		return e.Pool.SetDeviceLimit(int(device), limit)
	})
}

// PoolLimit returns the byte limit in force on device (0: none).
func PoolLimit(id int64, device int64) (limit uint64, err error) {
	return withEntry(id, func(e *registry.Entry) (uint64, error) {
		if device < 0 || device >= int64(e.Pool.Backend().Devices()) {
			return 0, fmt.Errorf("limit: device %d out of range [0, %d): %w",
				device, e.Pool.Backend().Devices(), gocore.ErrInvalidDevice)
		}
		return e.Pool.Limit(int(device)), nil
	})
}

// PoolSetReleaseThreshold sets the release threshold (0: unlimited).
//
// ok is true when err is nil (see okOf).
func PoolSetReleaseThreshold(id int64, bytes uint64) (ok bool, err error) {
	return withEntryOK(id, func(e *registry.Entry) error { return e.Pool.SetReleaseThreshold(bytes) })
}

// PoolConfig returns the pool's name, backend, settings (every option of
// PoolSchema) and devices, alignment and slot as JSON.
func PoolConfig(id int64) (js string, err error) {
	return withEntry(id, func(e *registry.Entry) (string, error) {
		c := e.Pool.Config()
		out := options.Values(poolFields, &c)
		out["name"], out["backend"] = c.Name, c.Backend.Name()
		out["devices"], out["alignment"], out["slot"] = c.Backend.Devices(), c.Backend.Alignment(), e.Slot()
		return marshal(out)
	})
}

// PoolCheck verifies the pool's invariants (see gocore.Pool.CheckInvariants).
//
// ok is true when err is nil (see okOf).
func PoolCheck(id int64) (ok bool, err error) {
	return withEntryOK(id, func(e *registry.Entry) error { return e.Pool.CheckInvariants() })
}

// PythonExiting stops pools whose allocator functions are Python callables
// from calling them (callback.PythonExiting): Python's atexit calls it,
// before the interpreter tears those functions down.
func PythonExiting() (ok bool, err error) {
	defer guard(&err)
	callback.PythonExiting()
	return true, nil
}

// PoolRetireSlot keeps the pool's C slot from ever serving another pool
// after this one closes: for a pool whose torch objects (torch.cuda.MemPool
// over its functions) could not be released and may still call them.
func PoolRetireSlot(id int64) (ok bool, err error) {
	return withEntryOK(id, func(e *registry.Entry) error {
		registry.KeepSlotRetired(e)
		return nil
	})
}

// PoolClose closes the pool and forgets its handle; it returns the close
// report as JSON (live blocks, bytes freed, and the errors met on the way:
// the pool is closed even then). Only an unknown handle is an error.
func PoolClose(id int64) (js string, err error) {
	defer guard(&err)
	// Only the caller that unregisters the handle closes the pool (two
	// threads may close it at once).
	e := registry.Unregister(id)
	if e == nil {
		_, err := registry.Get(id)
		return "", err
	}
	// The pool and torch's private pools over it (CUDA graphs,
	// torch.cuda.MemPool), which share the backend: closed before it.
	rep, err := e.Pool.Close()
	// A block that outlived the pool may still be freed by torch through
	// the slot: then the slot must never serve another pool.
	defer func() { registry.FreeSlot(e, len(rep.LiveBlocks) == 0) }()
	if c, ok := e.Pool.Backend().(io.Closer); ok {
		// Backend resources beyond segments (CUDA memory pools, ...).
		err = errors.Join(err, c.Close())
	}
	if rep.LiveBlocks == nil {
		rep.LiveBlocks = []gocore.LiveBlock{}
	}
	// The pool is closed whatever failed: the failures go in the report
	// ("errors"), which an error return would lose (gopy raises instead of
	// returning both).
	problems := []string{}
	if err != nil {
		problems = append(problems, err.Error())
	}
	return marshal(map[string]any{"live_blocks": rep.LiveBlocks, "live_bytes": rep.LiveBytes,
		"segments_freed": rep.SegmentsFreed, "bytes_freed": rep.BytesFreed, "errors": problems})
}

// PoolGraphPools lists, as JSON, the private pools torch allocated into
// through the pool's C hooks (CUDA graphs and torch.cuda.MemPool in
// full-replacement mode; see graphpool.Pools.List).
func PoolGraphPools(id int64) (js string, err error) {
	return withEntry(id, func(e *registry.Entry) (string, error) {
		pools, err := e.Pool.List()
		if err != nil {
			return "", err
		}
		return marshal(pools)
	})
}

// PoolSymbols gives the pool a C slot and returns the names of its torch
// pluggable-allocator functions as "alloc_name,free_name". kind picks the
// alloc function: "plain" returns NULL on failure; "throwing" is the C++ one
// that throws instead (for torch's full replacement, which does not check
// for NULL); "segments" returns NULL too and serves torch's caching
// allocator getting the segments of a torch.cuda.MemPool, which it sizes
// itself (gocore.Pool.AllocSegment).
func PoolSymbols(id int64, kind string) (names string, err error) {
	defer guard(&err)
	switch kind {
	case "throwing":
		// For full replacement: torch calls these for the rest of the
		// process, so the slot is never handed to another pool.
		slot, err := withEntry(id, registry.AssignPinnedSlot)
		if err != nil {
			return "", err
		}
		return fmt.Sprintf("gmp_alloc_or_throw_%d,gmp_free_%d", slot, slot), nil
	case "plain", "segments":
		slot, err := withEntry(id, registry.AssignSlot)
		if err != nil {
			return "", err
		}
		if kind == "segments" {
			return fmt.Sprintf("gmp_segment_alloc_%d,gmp_free_%d", slot, slot), nil
		}
		return fmt.Sprintf("gmp_alloc_%d,gmp_free_%d", slot, slot), nil
	}
	return "", fmt.Errorf("pool symbols: kind %q is not plain, throwing or segments: %w", kind, gocore.ErrInvalidArgument)
}

// PoolHookSymbols gives the pool a C slot and returns, as JSON, torch's
// CUDAPluggableAllocator hook setters mapped to the pool's exported hook
// functions (init, empty cache, memory fraction, record stream).
func PoolHookSymbols(id int64) (js string, err error) {
	return withEntry(id, func(e *registry.Entry) (string, error) {
		slot, err := registry.AssignSlot(e)
		if err != nil {
			return "", err
		}
		return marshal(cabi.HookSymbols(slot))
	})
}

// PoolTakeError returns and clears the last error a C call on this pool
// recorded ("" when none). Handle 0 reads errors of calls no pool owned.
func PoolTakeError(id int64) (msg string, err error) {
	defer guard(&err)
	if id == 0 {
		return errorText(registry.TakeOrphanError()), nil
	}
	return withEntry(id, func(e *registry.Entry) (string, error) { return errorText(e.TakeError()), nil })
}

// errorText is err's text, "" for nil.
func errorText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// DebugPanicNext makes the pool's next C-ABI call panic inside Go (fault
// injection for tests: the call must return NULL and record the panic).
//
// ok is true when err is nil (see okOf).
func DebugPanicNext(id int64) (ok bool, err error) {
	return withEntryOK(id, func(e *registry.Entry) error {
		e.PanicNext.Store(true)
		return nil
	})
}

// ListPools returns the open pools' handles and names as JSON.
func ListPools() (js string, err error) {
	defer guard(&err)
	var out []map[string]any
	for _, e := range registry.All() {
		out = append(out, map[string]any{"id": e.ID, "name": e.Pool.Name(), "backend": e.Pool.Backend().Name()})
	}
	if out == nil {
		out = []map[string]any{}
	}
	return marshal(out)
}

// withSim runs work on the simulated device of the pool behind id, under
// guard; a pool of another backend is an error.
func withSim[T any](id int64, work func(s *sim.Backend) (T, error)) (T, error) {
	return withEntry(id, func(e *registry.Entry) (T, error) {
		if e.Sim == nil {
			var none T
			return none, fmt.Errorf("pool %q uses the %s backend, not sim: %w", e.Pool.Name(), e.Pool.Backend().Name(), gocore.ErrInvalidArgument)
		}
		return work(e.Sim)
	})
}

// SimCompleteStream completes the work queued so far on stream (all streams
// when all is true) of the pool's simulated device.
//
// ok is true when err is nil (see okOf).
func SimCompleteStream(id int64, stream uint64, all bool) (ok bool, err error) {
	return withSim(id, func(s *sim.Backend) (bool, error) {
		if all {
			s.CompleteAll()
		} else {
			s.CompleteStream(gocore.Stream(stream))
		}
		return true, nil
	})
}

// SimSetManualEvents switches the simulated device between events that
// complete at once (false) and on SimCompleteStream only (true).
//
// ok is true when err is nil (see okOf).
func SimSetManualEvents(id int64, manual bool) (ok bool, err error) {
	return withSim(id, func(s *sim.Backend) (bool, error) {
		s.SetManualEvents(manual)
		return true, nil
	})
}

// SimPlaceNext asks the pool's simulated device to put the next segment of
// exactly size bytes on device offset bytes into its placement window
// (size 0 withdraws the request; see sim.Backend.PlaceNext). Replay
// uses it to give segments the address order the recording allocator's
// device gave them.
//
// ok is true when err is nil (see okOf).
func SimPlaceNext(id, device int64, offset, size uint64) (ok bool, err error) {
	return withSim(id, func(s *sim.Backend) (bool, error) {
		return okOf(s.PlaceNext(int(device), offset, size))
	})
}

// SimStats returns the simulated device's counters as JSON.
func SimStats(id int64) (js string, err error) {
	return withSim(id, func(s *sim.Backend) (string, error) {
		st := s.Stats()
		return marshal(map[string]any{"allocs": st.Allocs, "frees": st.Frees, "failed_allocs": st.FailedAllocs,
			"failed_frees": st.FailedFrees, "live_segments": st.LiveSegments, "live_bytes": st.LiveBytes,
			"events_created": st.EventsCreated, "live_events": st.LiveEvents, "expansions": st.Expansions,
			"shrinks": st.Shrinks, "placed": st.Placed})
	})
}

// Devices lists the machine's NVIDIA devices as JSON
// {"devices": [...], "reason": ""}; without a driver the list is empty and
// reason says why.
func Devices() (js string, err error) {
	defer guard(&err)
	infos, lerr := nvmldev.ListSystem()
	reason := ""
	if lerr != nil {
		reason = lerr.Error()
	}
	if infos == nil {
		infos = []nvmldev.Info{}
	}
	return marshal(map[string]any{"devices": infos, "reason": reason})
}

func marshal(v any) (string, error) {
	b, err := json.Marshal(v)
	return string(b), err
}

// PoolSnapshot returns the pool's segments and blocks as JSON (a list in
// torch's snapshot vocabulary).
func PoolSnapshot(id int64) (js string, err error) {
	return withEntry(id, func(e *registry.Entry) (string, error) {
		segs := e.Pool.Snapshot()
		if segs == nil {
			segs = []gocore.SnapshotSegment{}
		}
		return marshal(map[string]any{"segments": segs, "fragmentation": gocore.FragmentationOf(segs)})
	})
}

// PoolRecordHistory turns event recording on (keeping maxEntries) or off.
//
// ok is true when err is nil (see okOf).
func PoolRecordHistory(id int64, enabled bool, maxEntries int64) (ok bool, err error) {
	return withEntryOK(id, func(e *registry.Entry) error {
		if enabled && maxEntries <= 0 {
			return fmt.Errorf("max_entries %d must be positive: %w", maxEntries, gocore.ErrInvalidArgument)
		}
		e.Pool.RecordHistory(enabled, int(min(maxEntries, 1<<30)))
		return nil
	})
}

// PoolRecordThreads makes history entries name the OS thread of the call
// that made each, or stops it (see gocore.Pool.RecordThreads).
//
// ok is true when err is nil (see okOf).
func PoolRecordThreads(id int64, on bool) (ok bool, err error) {
	return withEntryOK(id, func(e *registry.Entry) error {
		e.Pool.RecordThreads(on)
		return nil
	})
}

// PoolHistory returns the recorded events, oldest first, as JSON.
func PoolHistory(id int64) (js string, err error) {
	return withEntry(id, func(e *registry.Entry) (string, error) {
		h := e.Pool.History()
		if h == nil {
			h = []gocore.TraceEntry{}
		}
		return marshal(h)
	})
}
