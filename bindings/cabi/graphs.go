package cabi

/*
// Unwind tables for C: a C++ exception thrown by gmp_alloc_or_throw unwinds
// through the C frames of torch_glue.c on its way to torch.
#cgo CFLAGS: -fexceptions
#cgo CXXFLAGS: -fexceptions
#cgo LDFLAGS: -ldl
#include <stdint.h>

// torch_glue.c: call and delete torch's std::function<bool(cudaStream_t)>.
int gmp_filter_accepts(void *filter, uintptr_t stream);
void gmp_filter_delete(void *filter);
*/
import "C"

import (
	"errors"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/gpumempool/gpumempool/bindings/registry"
	"github.com/gpumempool/gpumempool/gocore"
)

// Private pools, for CUDA graphs and torch.cuda.MemPool in full-replacement
// mode.
//
// While torch captures a CUDA graph (or runs `with torch.cuda.use_mem_pool`)
// it calls beginAllocateToPool(device, id, filter): until the matching
// endAllocateToPool, allocations on device whose stream passes filter must
// come from private pool id, and memory freed there must stay in that pool
// until releasePool(device, id). A graph replays with the addresses it was
// captured with, so if the blocks it freed during capture went back to the
// shared cache, tensors allocated later would be overwritten by every
// replay. Torch's own caching allocator keeps such pools; a pluggable
// allocator must do it itself, through the three hooks below (C wrappers
// in zz_slots.c and torch_glue.c, because torch passes the filter as a
// std::function).
//
// Each private pool is a gocore.Pool of its own over the slot pool's backend
// and configuration: its segments are never shared with the slot pool. Like
// torch's PrivatePool it counts its users: every beginAllocateToPool adds
// one and every releasePool takes one away (graphs that share a pool, and
// each `use_mem_pool` block, which releases at exit). Once no user is left
// and its last block is freed and idle, its segments go back to the backend
// (closeIfDoneLocked) - but never while a capture is under way, when freeing
// memory is forbidden: sweepFreeable retries when the last capture ends, at
// empty_cache and on out-of-memory, as torch frees its freeable graph pools.

// graphPoolID is torch's MempoolId_t.
type graphPoolID [2]uint64

// poolKey names a private pool: torch begins, ends and releases a pool id
// per device (one torch.cuda.MemPool may be used on several).
type poolKey struct {
	device int
	id     graphPoolID
}

// streamFilter says which streams allocate into a capture's pool.
type streamFilter interface {
	accepts(stream uintptr) bool
	release()
}

// cppFilter is torch's filter: a heap copy of its std::function, owned
// (torch_glue.c).
type cppFilter struct{ p unsafe.Pointer }

func (f cppFilter) accepts(stream uintptr) bool {
	return C.gmp_filter_accepts(f.p, C.uintptr_t(stream)) != 0
}
func (f cppFilter) release() { C.gmp_filter_delete(f.p) }

// capture is one beginAllocateToPool not yet ended.
type capture struct {
	device int
	id     graphPoolID
	filter streamFilter
}

// privatePool is a pool torch allocated into.
type privatePool struct {
	id       graphPoolID
	device   int
	pool     *gocore.Pool
	live     int  // blocks allocated and not freed
	released bool // no user is left (uses): close once it is idle
}

// graphState is the private pools of one registered pool.
type graphState struct {
	mu       sync.Mutex
	closed   bool // CloseGraphPools ran: the pool is closing, begin nothing
	captures []capture
	pools    map[poolKey]*privatePool
	// uses counts, per private pool id, beginAllocateToPool calls not yet
	// matched by a releasePool (torch's PrivatePool::use_count).
	uses map[poolKey]int
	// owner maps the address of a live private block to its *privatePool.
	// Every free of the pool looks here while a graph holds blocks, so
	// reads take no lock; writes happen under mu.
	owner   sync.Map
	retired map[int]gocore.Stats // by device: what closed private pools counted
	// unreleased holds closed private pools some of whose segments the
	// backend refused to take back: each sweep retries them, as the pool's
	// own close does last (gocore.Pool.Close retries exactly those).
	unreleased []*gocore.Pool
}

var (
	graphMu sync.RWMutex
	graphs  = map[*registry.Entry]*graphState{}

	// privateBlocks and gocore.ProcessCaptures (the captures under way,
	// which every pool of the process holds back for) let the allocation
	// hot path skip all of this with one atomic load while no capture runs
	// and no private block lives.
	privateBlocks atomic.Int64

	// captureGate orders a capture's start (the captures going up, in
	// beginCapture, before torch begins capturing) against the close of a
	// private pool that found no capture under way: that close finishes
	// before any capture of the process, through any pool, can begin.
	// Otherwise its segment frees could run during another pool's capture.
	captureGate sync.RWMutex
	// testHookBeforePrivateClose, when set (tests only), runs in
	// closeIfDoneLocked after the checks and before the close.
	testHookBeforePrivateClose func()
)

// graphStateOf returns e's graph state, made on first use with create;
// nil when there is none, or (with create) when e's pool is closed.
func graphStateOf(e *registry.Entry, create bool) *graphState {
	graphMu.RLock()
	g := graphs[e]
	graphMu.RUnlock()
	if g != nil || !create {
		return g
	}
	graphMu.Lock()
	defer graphMu.Unlock()
	if g = graphs[e]; g == nil {
		if e.Pool.Closed() {
			// PoolClose closes the pool before CloseGraphPools, which
			// removes the state under graphMu: no state may appear after.
			return nil
		}
		g = &graphState{pools: map[poolKey]*privatePool{}, uses: map[poolKey]int{}, retired: map[int]gocore.Stats{}}
		graphs[e] = g
	}
	return g
}

// privateAlloc serves an allocation from a private pool when a capture on
// device accepts stream; ok is false when none does (the slot pool serves
// it then).
func privateAlloc(e *registry.Entry, size uint64, device int, stream uintptr) (addr uint64, ok bool, err error) {
	if gocore.ProcessCaptures() == 0 {
		return 0, false, nil
	}
	g := graphStateOf(e, false)
	if g == nil {
		return 0, false, nil
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	// Newest first, as torch's own allocator routes since 2.10
	// (pytorch#168382): a graph captured inside use_mem_pool, or nested
	// use_mem_pool blocks, allocate into the innermost pool whose filter
	// accepts the stream.
	for i := len(g.captures) - 1; i >= 0; i-- {
		c := g.captures[i]
		if c.device != device || !c.filter.accepts(stream) {
			continue
		}
		pp, err := g.poolLocked(e, c.id, device)
		if err != nil {
			return 0, true, err
		}
		addr, err = pp.pool.Alloc(size, device, gocore.Stream(stream))
		if err != nil {
			return 0, true, fmt.Errorf("private pool (%d, %d): %w", c.id[0], c.id[1], err)
		}
		g.owner.Store(addr, pp)
		pp.live++
		privateBlocks.Add(1)
		return addr, true, nil
	}
	return 0, false, nil
}

// poolLocked returns private pool id, made on first use.
func (g *graphState) poolLocked(e *registry.Entry, id graphPoolID, device int) (*privatePool, error) {
	if pp := g.pools[poolKey{device, id}]; pp != nil {
		return pp, nil
	}
	cfg := e.Pool.Config()
	cfg.Name = fmt.Sprintf("%s/private(%d,%d)", cfg.Name, id[0], id[1])
	// A replay writes the blocks the capture freed: they must stay mapped,
	// whatever the slot pool's release policy.
	cfg.KeepSegments = true
	p, err := gocore.NewPool(cfg)
	if err != nil {
		return nil, fmt.Errorf("private pool (%d, %d): %w", id[0], id[1], err)
	}
	for range g.captures { // in as many captures as the pools made before it
		p.EnterCapture()
	}
	pp := &privatePool{id: id, device: device, pool: p}
	g.pools[poolKey{device, id}] = pp
	return pp, nil
}

// captureLocked enters (or exits) a capture on e's pool and on every
// private pool (gocore.Pool.EnterCapture): while torch records a graph, no
// event may be recorded or queried and no memory freed, in any pool torch
// allocates from.
func (g *graphState) captureLocked(e *registry.Entry, enter bool) error {
	pools := []*gocore.Pool{e.Pool}
	for _, pp := range g.pools {
		pools = append(pools, pp.pool)
	}
	var errs []error
	for _, p := range pools {
		if enter {
			p.EnterCapture()
		} else {
			errs = append(errs, p.ExitCapture())
		}
	}
	return errors.Join(errs...)
}

// ownerOf returns the private pool holding the live block at addr, if any.
func ownerOf(e *registry.Entry, addr uint64) (*graphState, *privatePool) {
	if privateBlocks.Load() == 0 {
		return nil, nil
	}
	g := graphStateOf(e, false)
	if g == nil {
		return nil, nil
	}
	if pp, ok := g.owner.Load(addr); ok {
		return g, pp.(*privatePool)
	}
	return g, nil
}

// privateFree frees addr if a private pool holds it; ok is false otherwise.
func privateFree(e *registry.Entry, addr uint64) (ok bool, err error) {
	g, pp := ownerOf(e, addr)
	if pp == nil {
		return false, nil
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if cur, ok := g.owner.Load(addr); !ok || cur != pp { // freed by another thread in between
		return false, nil
	}
	if err := pp.pool.Free(addr); err != nil {
		return true, err
	}
	g.owner.Delete(addr)
	pp.live--
	privateBlocks.Add(-1)
	_, err = g.closeIfDoneLocked(pp)
	return true, err
}

// closeIfDoneLocked closes pp if it is done: no user is left, it holds no
// block, no freed block waits for its events (the memory may still be in
// use on another stream), and no capture is under way anywhere in the
// process (freeing memory would invalidate it). Otherwise a later
// sweepFreeable tries again. It reports whether pp was closed.
func (g *graphState) closeIfDoneLocked(pp *privatePool) (bool, error) {
	if !pp.released || pp.live > 0 {
		return false, nil
	}
	captureGate.RLock()
	defer captureGate.RUnlock()
	if gocore.ProcessCaptures() > 0 {
		return false, nil
	}
	waiting, err := pp.pool.ProcessEvents()
	if err != nil {
		return false, fmt.Errorf("private pool (%d, %d): %w", pp.id[0], pp.id[1], err)
	}
	if waiting > 0 {
		return false, nil
	}
	if testHookBeforePrivateClose != nil {
		testHookBeforePrivateClose()
	}
	return true, g.closeLocked(pp)
}

// sweepFreeable closes the private pools of e that are done, or of every
// pool when e is nil (the last capture of the process ended: pools left
// open because of it may go now), and returns how many it closed.
func sweepFreeable(e *registry.Entry) (int, error) {
	var states []*graphState
	graphMu.RLock()
	if e != nil {
		if g := graphs[e]; g != nil {
			states = append(states, g)
		}
	} else {
		for _, g := range graphs {
			states = append(states, g)
		}
	}
	graphMu.RUnlock()
	n := 0
	var errs []error
	for _, g := range states {
		g.mu.Lock()
		for _, pp := range g.pools {
			closed, err := g.closeIfDoneLocked(pp)
			if closed {
				n++
			}
			errs = append(errs, err)
		}
		done, err := g.retryUnreleasedLocked()
		n += done
		errs = append(errs, err)
		g.mu.Unlock()
	}
	done, err := retryLingering()
	n += done
	errs = append(errs, err)
	return n, errors.Join(errs...)
}

// closeLocked returns the segments of a private pool that is done to the
// backend, keeping its counters.
func (g *graphState) closeLocked(pp *privatePool) error {
	delete(g.pools, poolKey{pp.device, pp.id})
	if st, err := pp.pool.Stats(pp.device); err == nil {
		r := g.retired[pp.device]
		rs := st.Retired()
		r.Merge(&rs)
		g.retired[pp.device] = r
	}
	if _, err := pp.pool.Close(); err != nil {
		g.unreleased = append(g.unreleased, pp.pool)
		return fmt.Errorf("close private pool (%d, %d): %w", pp.id[0], pp.id[1], err)
	}
	return nil
}

// retryUnreleasedLocked offers the backend again the segments it refused
// when private pools closed, and returns how many pools are now wholly
// given back.
func (g *graphState) retryUnreleasedLocked() (int, error) {
	var done int
	var err error
	g.unreleased, done, err = retryUnreleased(g.unreleased)
	return done, err
}

// retryUnreleased closes again (gocore.Pool.Close retries exactly the
// segments the backend refused) the pools whose segments the backend
// refused, unless a capture is under way, when that must not happen. It
// returns those still holding some, and how many are now wholly given back.
func retryUnreleased(pools []*gocore.Pool) (kept []*gocore.Pool, done int, err error) {
	if len(pools) == 0 {
		return pools, 0, nil
	}
	captureGate.RLock()
	defer captureGate.RUnlock()
	if gocore.ProcessCaptures() > 0 {
		return pools, 0, nil
	}
	var errs []error
	kept = pools[:0]
	for _, p := range pools {
		if _, err := p.Close(); err != nil && !errors.Is(err, gocore.ErrClosed) {
			kept = append(kept, p)
			errs = append(errs, err)
			continue
		}
		done++
	}
	clear(pools[len(kept):])
	return kept, done, errors.Join(errs...)
}

// privateBlock describes the live block at addr in a private pool.
func privateBlock(e *registry.Entry, addr uint64) (gocore.BlockInfo, bool, error) {
	_, pp := ownerOf(e, addr)
	if pp == nil {
		return gocore.BlockInfo{}, false, nil
	}
	info, err := pp.pool.Lookup(addr)
	return info, true, err
}

// privateRecordStream records stream on a private pool's block at addr.
func privateRecordStream(e *registry.Entry, addr uint64, stream gocore.Stream) (bool, error) {
	_, pp := ownerOf(e, addr)
	if pp == nil {
		return false, nil
	}
	return true, pp.pool.RecordStream(addr, stream)
}

// gmpgo_graph_begin (in C gmp_graph_begin, exports.c, which first refuses a forked child) is beginAllocateToPool: the C wrapper hands over a heap
// copy of torch's filter, which is owned from here on.
//
//export gmpgo_graph_begin
func gmpgo_graph_begin(slot, device C.int, id0, id1 C.uint64_t, filter unsafe.Pointer) {
	f := cppFilter{filter}
	e := registry.BySlot(int(slot))
	if e == nil {
		f.release()
		registry.SetOrphanError(fmt.Sprintf("gmp_begin_allocate_to_pool_%d: no pool holds this slot (closed?)", int(slot)))
		return
	}
	passed := false
	guarded(e, "gmp_begin_allocate_to_pool", func() error {
		passed = true // beginCapture owns f from here, whatever happens
		return beginCapture(e, int(device), graphPoolID{uint64(id0), uint64(id1)}, f)
	})
	if !passed { // a panic came first (PanicNext): nobody owns the filter
		f.release()
	}
}

// gmpgo_graph_end (in C gmp_graph_end, exports.c, which first refuses a forked child) is endAllocateToPool: the capture (or use_mem_pool) begun
// for (device, id) stops routing allocations.
//
//export gmpgo_graph_end
func gmpgo_graph_end(slot, device C.int, id0, id1 C.uint64_t) {
	graphEnd(int(slot), int(device), graphPoolID{uint64(id0), uint64(id1)})
}

// graphEnd is gmpgo_graph_end. When no pool holds the slot any more, its
// pool closed during its own capture: the backend may then have refused
// the private pools' segments (the stream still captured: the CUDA
// backends' ErrCaptureUnderway), which linger. Torch ends the allocation
// to the pool after the capture ended, so they are offered again now;
// otherwise they would wait for another pool's sweep, maybe forever.
func graphEnd(slot, device int, id graphPoolID) {
	if registry.BySlot(slot) == nil {
		if _, err := retryLingering(); err != nil {
			registry.SetOrphanError(fmt.Sprintf("gmp_end_allocate_to_pool_%d: give back the segments of a pool closed during its capture: %v", slot, err))
		}
	}
	slotHook(slot, "gmp_end_allocate_to_pool", func(e *registry.Entry) error {
		return endCapture(e, device, id)
	})
}

// gmpgo_graph_release (in C gmp_graph_release, exports.c, which first refuses a forked child) is releasePool: the graph (or torch.cuda.MemPool) is
// gone, so the pool's segments go back once its last block is freed.
//
//export gmpgo_graph_release
func gmpgo_graph_release(slot, device C.int, id0, id1 C.uint64_t) {
	slotHook(int(slot), "gmp_release_pool", func(e *registry.Entry) error {
		return releaseGraphPool(e, int(device), graphPoolID{uint64(id0), uint64(id1)})
	})
}

// beginCapture routes e's allocations on device whose stream f accepts to
// private pool id until endCapture, and counts a user of that pool. f is
// owned from the call on: kept with the capture, or released on failure.
func beginCapture(e *registry.Entry, device int, id graphPoolID, f streamFilter) error {
	stored := false
	defer func() {
		if !stored {
			f.release()
		}
	}()
	g := graphStateOf(e, true)
	if g == nil {
		return fmt.Errorf("device %d, pool (%d, %d): %w", device, id[0], id[1], gocore.ErrClosed)
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed { // CloseGraphPools ran between the two checks
		return fmt.Errorf("device %d, pool (%d, %d): %w", device, id[0], id[1], gocore.ErrClosed)
	}
	key := poolKey{device, id}
	g.uses[key]++
	if pp := g.pools[key]; pp != nil {
		pp.released = false // a released pool used again (a torch.cuda.MemPool re-entered)
	}
	g.captures = append(g.captures, capture{device: device, id: id, filter: f})
	stored = true
	captureGate.Lock()
	gocore.AddProcessCaptures(1)
	captureGate.Unlock()
	return g.captureLocked(e, true)
}

// endCapture ends the oldest capture begun for (device, id). When it was
// the last capture of the process, private pools kept open because of it
// are closed (sweepFreeable).
func endCapture(e *registry.Entry, device int, id graphPoolID) error {
	err := endCaptureLocking(e, device, id)
	if gocore.ProcessCaptures() == 0 {
		_, serr := sweepFreeable(nil)
		err = errors.Join(err, serr)
	}
	return err
}

func endCaptureLocking(e *registry.Entry, device int, id graphPoolID) error {
	g := graphStateOf(e, false)
	if g != nil {
		g.mu.Lock()
		defer g.mu.Unlock()
		for i, c := range g.captures {
			if c.device == device && c.id == id {
				c.filter.release()
				g.captures = append(g.captures[:i], g.captures[i+1:]...)
				gocore.AddProcessCaptures(-1)
				return g.captureLocked(e, false)
			}
		}
	}
	return fmt.Errorf("device %d, pool (%d, %d): no allocation to this pool was begun", device, id[0], id[1])
}

// releaseGraphPool takes a user away from private pool id; with none left
// it is closed as soon as it is done (closeIfDoneLocked). A release with no
// user left (torch.cuda.MemPool's destructor after its use_mem_pool blocks
// released theirs) changes nothing.
func releaseGraphPool(e *registry.Entry, device int, id graphPoolID) error {
	g := graphStateOf(e, false)
	if g == nil {
		return nil // nothing was ever begun for it
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	key := poolKey{device, id}
	if g.uses[key] > 1 {
		g.uses[key]--
		return nil // another graph (or use_mem_pool block) still uses it
	}
	delete(g.uses, key)
	pp := g.pools[key]
	if pp == nil {
		return nil
	}
	pp.released = true
	_, err := g.closeIfDoneLocked(pp)
	return err
}

// GraphPool describes one private pool (GraphPools).
type GraphPool struct {
	ID             [2]uint64 `json:"id"`
	Device         int       `json:"device"`
	LiveBlocks     int       `json:"live_blocks"`
	AllocatedBytes uint64    `json:"allocated_bytes"`
	ReservedBytes  uint64    `json:"reserved_bytes"`
	Released       bool      `json:"released"`
	Capturing      bool      `json:"capturing"` // an allocation to it is begun and not ended
}

// GraphPools lists the private pools of e, ordered by id and device.
func GraphPools(e *registry.Entry) ([]GraphPool, error) {
	out := []GraphPool{}
	g := graphStateOf(e, false)
	if g == nil {
		return out, nil
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	var errs []error
	for _, pp := range g.pools {
		s, err := pp.pool.Stats(pp.device)
		errs = append(errs, err)
		gp := GraphPool{ID: pp.id, Device: pp.device, LiveBlocks: pp.live, Released: pp.released,
			AllocatedBytes: uint64(s.AllocatedBytes[0].Current), ReservedBytes: uint64(s.ReservedBytes[0].Current)}
		for _, c := range g.captures {
			gp.Capturing = gp.Capturing || c.id == pp.id && c.device == pp.device
		}
		out = append(out, gp)
	}
	sort.Slice(out, func(i, j int) bool {
		a, b := out[i], out[j]
		if a.ID != b.ID {
			return a.ID[0] < b.ID[0] || a.ID[0] == b.ID[0] && a.ID[1] < b.ID[1]
		}
		return a.Device < b.Device
	})
	return out, errors.Join(errs...)
}

// AddGraphStats adds the statistics of e's private pools on device dev (all
// devices when dev < 0) to s: their memory is the pool's too, as torch's
// memory_stats counts its graphs' private pools.
func AddGraphStats(e *registry.Entry, dev int, s *gocore.Stats) error {
	g := graphStateOf(e, false)
	if g == nil {
		return nil
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	var errs []error
	for _, pp := range g.pools {
		if dev >= 0 && pp.device != dev {
			continue
		}
		ps, err := pp.pool.Stats(pp.device)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		s.Merge(&ps)
	}
	for d, r := range g.retired {
		if dev < 0 || d == dev {
			s.Merge(&r)
		}
	}
	return errors.Join(errs...)
}

// CloseGraphPools closes e's private pools and drops its captures (the pool
// itself is closing), and reports the blocks they still held. When those
// were the last captures of the process, the private pools of other pools
// that waited for them to end are closed too, as at an endCapture.
func CloseGraphPools(e *registry.Entry) (gocore.CloseReport, error) {
	rep, captured, err := closeGraphPools(e)
	if captured && gocore.ProcessCaptures() == 0 {
		_, serr := sweepFreeable(nil)
		err = errors.Join(err, serr)
	}
	return rep, err
}

func closeGraphPools(e *registry.Entry) (total gocore.CloseReport, captured bool, err error) {
	graphMu.Lock()
	g := graphs[e]
	delete(graphs, e)
	graphMu.Unlock()
	if g == nil {
		return total, false, nil
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	g.closed = true
	captured = len(g.captures) > 0
	for _, c := range g.captures {
		c.filter.release()
		gocore.AddProcessCaptures(-1)
	}
	g.captures = nil
	g.uses = map[poolKey]int{}
	var errs []error
	for _, pp := range g.pools {
		rep, err := pp.pool.Close()
		delete(g.pools, poolKey{pp.device, pp.id})
		if err != nil {
			g.unreleased = append(g.unreleased, pp.pool) // segments the backend refused
		}
		errs = append(errs, err)
		total.LiveBlocks = append(total.LiveBlocks, rep.LiveBlocks...)
		total.LiveBytes += rep.LiveBytes
		total.SegmentsFreed += rep.SegmentsFreed
		total.BytesFreed += rep.BytesFreed
	}
	g.owner.Range(func(addr, _ any) bool {
		g.owner.Delete(addr)
		privateBlocks.Add(-1)
		return true
	})
	// What the backend refused, now and earlier: offered again now unless a
	// capture forbids it, and what is still refused then goes to the
	// process's lingering pools, retried by every sweep.
	_, err = g.retryUnreleasedLocked()
	errs = append(errs, err)
	if len(g.unreleased) > 0 {
		lingeringMu.Lock()
		lingering = append(lingering, g.unreleased...)
		lingeringMu.Unlock()
		g.unreleased = nil
	}
	return total, captured, errors.Join(errs...)
}

var (
	// lingering holds closed private pools of pools that closed themselves
	// while the backend still refused some of their segments (a release
	// refused during a capture, say): sweepFreeable offers them again.
	lingering   []*gocore.Pool
	lingeringMu sync.Mutex
)

// retryLingering offers the backend the segments of lingering pools again,
// unless a capture is under way, and returns how many pools are now wholly
// given back. It takes the pools out of the list under the lock and frees
// outside it (a backend's free may wait for a device), then puts back those
// still refused: a pool closing meanwhile adds its own without waiting, and
// concurrent retries offer disjoint pools.
func retryLingering() (int, error) {
	lingeringMu.Lock()
	pools := lingering
	lingering = nil
	lingeringMu.Unlock()
	kept, done, err := retryUnreleased(pools)
	if len(kept) > 0 {
		lingeringMu.Lock()
		lingering = append(lingering, kept...)
		lingeringMu.Unlock()
	}
	return done, err
}
