// Package bindings is the Python-facing API of gpumempool, wrapped by gopy
// into the extension module gpumempool._core. Its functions take and return
// only plain values (integer handles, sizes, JSON strings) because gopy maps
// those reliably; the typed Python API is built on top in gpumempool/.
//
// Every function recovers Go panics into errors: a panic must never abort
// the Python process. Error messages start with the name of the Python
// exception the package raises for them ("ValueError: ..."), see errorKind.
package bindings

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"

	// The C ABI lives in the same .so: importing it links its //export
	// functions into the extension.
	"github.com/gpumempool/gpumempool/bindings/cabi"
	"github.com/gpumempool/gpumempool/bindings/registry"
	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/callback"
	"github.com/gpumempool/gpumempool/gocore/graphpool"
	"github.com/gpumempool/gpumempool/gocore/nvmldev"
	"github.com/gpumempool/gpumempool/gocore/sim"
)

// Version returns the engine version.
func Version() string { return "0.1.0" }

// NumSlots returns how many pools can expose C entry points at once.
func NumSlots() int64 { return registry.NumSlots }

// poolOptions is the JSON accepted by NewPool.
type poolOptions struct {
	Backend          string   `json:"backend"`
	Name             string   `json:"name"`
	Limit            uint64   `json:"limit"`
	MaxSplitSize     uint64   `json:"max_split_size"`
	RoundupDivisions uint64   `json:"roundup_power2_divisions"`
	RoundupBySize    []uint64 `json:"roundup_power2_divisions_by_size"`
	GCThreshold      float64  `json:"garbage_collection_threshold"`
	MaxNonSplitRound uint64   `json:"max_non_split_rounding_size"`
	ReleaseThreshold uint64   `json:"release_threshold"`
	TorchVersion     string   `json:"torch_version"`
	// Options are the backend's own, decoded by its registry entry
	// (backends.go).
	Options json.RawMessage `json:"options"`
	// The callback backend's functions, which Python passes besides its
	// options.
	AllocFn         uint64 `json:"alloc_fn"`
	FreeFn          uint64 `json:"free_fn"`
	PythonCallbacks bool   `json:"python_callbacks"`
}

// decodeOptions parses NewPool's JSON strictly: unknown keys and trailing
// values are errors.
func decodeOptions(optionsJSON string) (poolOptions, error) {
	dec := json.NewDecoder(strings.NewReader(optionsJSON))
	dec.DisallowUnknownFields()
	var o poolOptions
	if err := dec.Decode(&o); err != nil {
		return o, fmt.Errorf("pool options: %v: %w", err, gocore.ErrInvalidArgument)
	}
	if dec.More() {
		return o, fmt.Errorf("pool options: more than one JSON value: %w", gocore.ErrInvalidArgument)
	}
	return o, nil
}

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
	p, err := gocore.NewPool(gocore.Config{Name: o.Name, Backend: be, Limit: o.Limit,
		MaxSplitSize: o.MaxSplitSize, ReleaseThreshold: o.ReleaseThreshold,
		RoundupPower2Divisions: o.RoundupDivisions, RoundupPower2DivisionsBySize: o.RoundupBySize,
		GarbageCollectionThreshold: o.GCThreshold, MaxNonSplitRoundingSize: o.MaxNonSplitRound,
		TorchVersion: o.TorchVersion})
	if err != nil {
		return 0, err
	}
	return registry.Add(p, sim, be).ID, nil
}

func entry(id int64) (*registry.Entry, error) { return registry.Get(id) }

// PoolAlloc allocates size bytes on device for stream; it returns the address.
func PoolAlloc(id, size, device int64, stream uint64) (addr uint64, err error) {
	defer guard(&err)
	return poolAlloc(id, size, device, stream, (*graphpool.Pools).Alloc)
}

// PoolAllocSegment is PoolAlloc for a caller that sizes its segments itself
// and caches inside them (gocore.Pool.AllocSegment), as torch's caching
// allocator does above a torch.cuda.MemPool; replays of such a pool's
// history call it.
func PoolAllocSegment(id, size, device int64, stream uint64) (addr uint64, err error) {
	defer guard(&err)
	return poolAlloc(id, size, device, stream, (*graphpool.Pools).AllocSegment)
}

func poolAlloc(id, size, device int64, stream uint64,
	alloc func(*graphpool.Pools, int, uint64, gocore.Stream) (uint64, error)) (uint64, error) {
	e, err := entry(id)
	if err != nil {
		return 0, err
	}
	if size <= 0 {
		return 0, fmt.Errorf("alloc of %d bytes: size must be positive: %w", size, gocore.ErrInvalidSize)
	}
	if device < 0 || device >= gocore.MaxDevices {
		return 0, fmt.Errorf("alloc on device %d: %w", device, gocore.ErrInvalidDevice)
	}
	if err := cabi.Reentered(e); err != nil {
		return 0, err
	}
	return alloc(e.Graphs, int(device), uint64(size), gocore.Stream(stream))
}

// PoolFree frees the block at addr.
//
// ok is true when err is nil (see okOf).
func PoolFree(id int64, addr uint64) (ok bool, err error) {
	return okOf(poolFree(id, addr))
}

func poolFree(id int64, addr uint64) (err error) {
	defer guard(&err)
	e, err := entry(id)
	if err != nil {
		return err
	}
	if err := cabi.Reentered(e); err != nil {
		return err
	}
	return e.Graphs.Free(addr)
}

// PoolRecordStream marks the block at addr as used on stream.
//
// ok is true when err is nil (see okOf).
func PoolRecordStream(id int64, addr, stream uint64) (ok bool, err error) {
	return okOf(poolRecordStream(id, addr, stream))
}

func poolRecordStream(id int64, addr, stream uint64) (err error) {
	defer guard(&err)
	e, err := entry(id)
	if err != nil {
		return err
	}
	return e.Graphs.RecordStream(addr, gocore.Stream(stream))
}

// PoolSeedSegment makes a segment of the blocks in blocksJSON (a JSON list
// of [size, requested, live] in address order) on device for stream, with
// the live blocks allocated and the others cached (gocore.Pool.SeedSegment);
// it returns the live blocks' addresses as a JSON list. Replay seeds a pool
// with the segments the recording allocator had at a trace's first event.
func PoolSeedSegment(id, device int64, stream uint64, small bool, blocksJSON string) (js string, err error) {
	defer guard(&err)
	e, err := entry(id)
	if err != nil {
		return "", err
	}
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
	return okOf(poolResetStats(id, peaks, accumulated))
}

func poolResetStats(id int64, peaks, accumulated bool) (err error) {
	defer guard(&err)
	e, err := entry(id)
	if err != nil {
		return err
	}
	if peaks {
		e.Pool.ResetPeakStats()
	}
	if accumulated {
		e.Pool.ResetAccumulatedStats()
	}
	return nil
}

// PoolProcessEvents frees blocks whose events completed; it returns how many
// frees still wait.
func PoolProcessEvents(id int64) (waiting int64, err error) {
	defer guard(&err)
	e, err := entry(id)
	if err != nil {
		return 0, err
	}
	n, err := e.Pool.ProcessEvents()
	return int64(n), err
}

// PoolStats returns the stats of device (all devices when < 0) as JSON with
// torch's key names.
func PoolStats(id, device int64) (js string, err error) {
	defer guard(&err)
	e, err := entry(id)
	if err != nil {
		return "", err
	}
	s, err := e.Pool.Stats(int(device))
	if err != nil {
		return "", err
	}
	// Torch's CUDA graphs' private pools (full-replacement mode) count too.
	if err := e.Graphs.AddStats(int(device), &s); err != nil {
		return "", err
	}
	return marshal(s.ToMap())
}

// PoolEmptyCache releases every wholly free segment, and closes the private
// pools no CUDA graph uses any more; it returns the bytes the pool released.
func PoolEmptyCache(id int64) (released uint64, err error) {
	defer guard(&err)
	e, err := entry(id)
	if err != nil {
		return 0, err
	}
	return e.Graphs.EmptyCache()
}

// PoolTrim keeps at most keep unused bytes cached on device (all when < 0).
func PoolTrim(id, device int64, keep uint64) (released uint64, err error) {
	defer guard(&err)
	e, err := entry(id)
	if err != nil {
		return 0, err
	}
	return e.Pool.Trim(int(device), keep)
}

// PoolSetLimit sets the byte limit (0: none) of device, or of every device
// when device is -1.
//
// ok is true when err is nil (see okOf).
func PoolSetLimit(id int64, limit uint64, device int64) (ok bool, err error) {
	return okOf(poolSetLimit(id, limit, device))
}

func poolSetLimit(id int64, limit uint64, device int64) (err error) {
	defer guard(&err)
	e, err := entry(id)
	if err != nil {
		return err
	}
	if device == -1 {
		return e.Pool.SetLimit(limit)
	}
	return e.Pool.SetDeviceLimit(int(device), limit)
}

// PoolLimit returns the byte limit in force on device (0: none).
func PoolLimit(id int64, device int64) (limit uint64, err error) {
	defer guard(&err)
	e, err := entry(id)
	if err != nil {
		return 0, err
	}
	if device < 0 || device >= int64(e.Pool.Backend().Devices()) {
		return 0, fmt.Errorf("limit: device %d out of range [0, %d): %w",
			device, e.Pool.Backend().Devices(), gocore.ErrInvalidDevice)
	}
	return e.Pool.Limit(int(device)), nil
}

// PoolSetReleaseThreshold sets the release threshold (0: unlimited).
//
// ok is true when err is nil (see okOf).
func PoolSetReleaseThreshold(id int64, bytes uint64) (ok bool, err error) {
	return okOf(poolSetReleaseThreshold(id, bytes))
}

func poolSetReleaseThreshold(id int64, bytes uint64) (err error) {
	defer guard(&err)
	e, err := entry(id)
	if err != nil {
		return err
	}
	return e.Pool.SetReleaseThreshold(bytes)
}

// PoolConfig returns the pool's name, backend and options as JSON.
func PoolConfig(id int64) (js string, err error) {
	defer guard(&err)
	e, err := entry(id)
	if err != nil {
		return "", err
	}
	c := e.Pool.Config()
	return marshal(map[string]any{"name": c.Name, "backend": c.Backend.Name(), "limit": c.Limit,
		"max_split_size": c.MaxSplitSize, "release_threshold": c.ReleaseThreshold,
		"roundup_power2_divisions": c.RoundupPower2Divisions, "roundup_power2_divisions_by_size": c.RoundupPower2DivisionsBySize,
		"garbage_collection_threshold": c.GarbageCollectionThreshold,
		"max_non_split_rounding_size":  c.MaxNonSplitRoundingSize,
		"torch_version":                c.TorchVersion,
		"devices":                      c.Backend.Devices(), "alignment": c.Backend.Alignment(), "slot": e.Slot()})
}

// PoolCheck verifies the pool's invariants (see gocore.Pool.CheckInvariants).
//
// ok is true when err is nil (see okOf).
func PoolCheck(id int64) (ok bool, err error) {
	return okOf(poolCheck(id))
}

func poolCheck(id int64) (err error) {
	defer guard(&err)
	e, err := entry(id)
	if err != nil {
		return err
	}
	return e.Pool.CheckInvariants()
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
	defer guard(&err)
	e, err := entry(id)
	if err != nil {
		return false, err
	}
	registry.KeepSlotRetired(e)
	return true, nil
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
		_, err := entry(id)
		return "", err
	}
	rep, err := e.Pool.Close()
	// A block that outlived the pool may still be freed by torch through
	// the slot: then the slot must never serve another pool.
	defer func() { registry.FreeSlot(e, len(rep.LiveBlocks) == 0) }()
	// Torch's private pools (CUDA graphs, torch.cuda.MemPool) share the
	// backend: closed before it.
	prep, perr := e.Graphs.ClosePrivate()
	err = errors.Join(err, perr)
	rep.LiveBlocks = append(rep.LiveBlocks, prep.LiveBlocks...)
	rep.LiveBytes += prep.LiveBytes
	rep.SegmentsFreed += prep.SegmentsFreed
	rep.BytesFreed += prep.BytesFreed
	if c, ok := e.Keep.(io.Closer); ok {
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
	defer guard(&err)
	e, err := entry(id)
	if err != nil {
		return "", err
	}
	pools, err := e.Graphs.List()
	if err != nil {
		return "", err
	}
	return marshal(pools)
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
		e, err := entry(id)
		if err != nil {
			return "", err
		}
		slot, err := registry.AssignPinnedSlot(e)
		if err != nil {
			return "", err
		}
		return fmt.Sprintf("gmp_alloc_or_throw_%d,gmp_free_%d", slot, slot), nil
	case "plain", "segments":
		slot, err := slotOf(id)
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
	defer guard(&err)
	slot, err := slotOf(id)
	if err != nil {
		return "", err
	}
	return marshal(cabi.HookSymbols(slot))
}

// slotOf returns the pool's C slot, assigning one on first use.
func slotOf(id int64) (int, error) {
	e, err := entry(id)
	if err != nil {
		return 0, err
	}
	return registry.AssignSlot(e)
}

// PoolTakeError returns and clears the last error a C call on this pool
// recorded ("" when none). Handle 0 reads errors of calls no pool owned.
func PoolTakeError(id int64) (msg string, err error) {
	defer guard(&err)
	if id == 0 {
		return registry.TakeOrphanError(), nil
	}
	e, err := entry(id)
	if err != nil {
		return "", err
	}
	return e.TakeError(), nil
}

// DebugPanicNext makes the pool's next C-ABI call panic inside Go (fault
// injection for tests: the call must return NULL and record the panic).
//
// ok is true when err is nil (see okOf).
func DebugPanicNext(id int64) (ok bool, err error) {
	return okOf(debugPanicNext(id))
}

func debugPanicNext(id int64) (err error) {
	defer guard(&err)
	e, err := entry(id)
	if err != nil {
		return err
	}
	e.PanicNext.Store(true)
	return nil
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

func simOf(id int64) (*sim.Backend, error) {
	e, err := entry(id)
	if err != nil {
		return nil, err
	}
	if e.Sim == nil {
		return nil, fmt.Errorf("pool %q uses the %s backend, not sim: %w", e.Pool.Name(), e.Pool.Backend().Name(), gocore.ErrInvalidArgument)
	}
	return e.Sim, nil
}

// SimCompleteStream completes the work queued so far on stream (all streams
// when all is true) of the pool's simulated device.
//
// ok is true when err is nil (see okOf).
func SimCompleteStream(id int64, stream uint64, all bool) (ok bool, err error) {
	return okOf(simCompleteStream(id, stream, all))
}

func simCompleteStream(id int64, stream uint64, all bool) (err error) {
	defer guard(&err)
	s, err := simOf(id)
	if err != nil {
		return err
	}
	if all {
		s.CompleteAll()
	} else {
		s.CompleteStream(gocore.Stream(stream))
	}
	return nil
}

// SimSetManualEvents switches the simulated device between events that
// complete at once (false) and on SimCompleteStream only (true).
//
// ok is true when err is nil (see okOf).
func SimSetManualEvents(id int64, manual bool) (ok bool, err error) {
	return okOf(simSetManualEvents(id, manual))
}

func simSetManualEvents(id int64, manual bool) (err error) {
	defer guard(&err)
	s, err := simOf(id)
	if err != nil {
		return err
	}
	s.SetManualEvents(manual)
	return nil
}

// SimPlaceNext asks the pool's simulated device to put the next segment of
// exactly size bytes on device offset bytes into its placement window
// (size 0 withdraws the request; see sim.Backend.PlaceNext). Replay
// uses it to give segments the address order the recording allocator's
// device gave them.
//
// ok is true when err is nil (see okOf).
func SimPlaceNext(id, device int64, offset, size uint64) (ok bool, err error) {
	return okOf(simPlaceNext(id, device, offset, size))
}

func simPlaceNext(id, device int64, offset, size uint64) (err error) {
	defer guard(&err)
	s, err := simOf(id)
	if err != nil {
		return err
	}
	return s.PlaceNext(int(device), offset, size)
}

// SimStats returns the simulated device's counters as JSON.
func SimStats(id int64) (js string, err error) {
	defer guard(&err)
	s, err := simOf(id)
	if err != nil {
		return "", err
	}
	st := s.Stats()
	return marshal(map[string]any{"allocs": st.Allocs, "frees": st.Frees, "failed_allocs": st.FailedAllocs,
		"failed_frees": st.FailedFrees, "live_segments": st.LiveSegments, "live_bytes": st.LiveBytes,
		"events_created": st.EventsCreated, "live_events": st.LiveEvents, "expansions": st.Expansions,
		"shrinks": st.Shrinks, "placed": st.Placed})
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
	defer guard(&err)
	e, err := entry(id)
	if err != nil {
		return "", err
	}
	segs := e.Pool.Snapshot()
	if segs == nil {
		segs = []gocore.SnapshotSegment{}
	}
	return marshal(map[string]any{"segments": segs, "fragmentation": gocore.FragmentationOf(segs)})
}

// PoolRecordHistory turns event recording on (keeping maxEntries) or off.
//
// ok is true when err is nil (see okOf).
func PoolRecordHistory(id int64, enabled bool, maxEntries int64) (ok bool, err error) {
	return okOf(poolRecordHistory(id, enabled, maxEntries))
}

func poolRecordHistory(id int64, enabled bool, maxEntries int64) (err error) {
	defer guard(&err)
	e, err := entry(id)
	if err != nil {
		return err
	}
	if enabled && maxEntries <= 0 {
		return fmt.Errorf("max_entries %d must be positive: %w", maxEntries, gocore.ErrInvalidArgument)
	}
	e.Pool.RecordHistory(enabled, int(min(maxEntries, 1<<30)))
	return nil
}

// PoolRecordThreads makes history entries name the OS thread of the call
// that made each, or stops it (see gocore.Pool.RecordThreads).
//
// ok is true when err is nil (see okOf).
func PoolRecordThreads(id int64, on bool) (ok bool, err error) {
	return okOf(poolRecordThreads(id, on))
}

func poolRecordThreads(id int64, on bool) (err error) {
	defer guard(&err)
	e, err := entry(id)
	if err != nil {
		return err
	}
	e.Pool.RecordThreads(on)
	return nil
}

// PoolHistory returns the recorded events, oldest first, as JSON.
func PoolHistory(id int64) (js string, err error) {
	defer guard(&err)
	e, err := entry(id)
	if err != nil {
		return "", err
	}
	h := e.Pool.History()
	if h == nil {
		h = []gocore.TraceEntry{}
	}
	return marshal(h)
}
