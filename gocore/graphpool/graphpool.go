// Package graphpool owns the private pools that CUDA graphs and
// torch.cuda.MemPool allocate into, over a *gocore.Pool: which allocations a
// capture routes to which private pool (BeginCapture, EndCapture and their
// stream filters), when a private pool's segments go back to the backend
// (Release, and the sweeps that close pools no graph uses any more, also
// on out-of-memory), and the statistics and listing of those pools. It is
// pure Go; the C ABI (bindings/cabi) adapts torch's hooks to it.
//
// While torch captures a CUDA graph (or runs `with torch.cuda.use_mem_pool`)
// it calls beginAllocateToPool(device, id, filter): until the matching
// endAllocateToPool, allocations on device whose stream passes filter must
// come from private pool id, and memory freed there must stay in that pool
// until releasePool(device, id). A graph replays with the addresses it was
// captured with, so if the blocks it freed during capture went back to the
// shared cache, tensors allocated later would be overwritten by every
// replay. Torch's own caching allocator keeps such pools; a pluggable
// allocator must do it itself.
//
// Each private pool is a gocore.Pool of its own over the main pool's
// backend and configuration: its segments are never shared with the main
// pool. Like torch's PrivatePool it counts its users: every BeginCapture
// adds one and every Release takes one away (graphs that share a pool, and
// each `use_mem_pool` block, which releases at exit). Once no user is left
// and its last block is freed and idle, its segments go back to the backend
// - but never while a capture is under way anywhere in the process, when
// freeing memory is forbidden: the sweeps retry when the last capture ends,
// at EmptyCache and on out-of-memory, as torch frees its freeable graph
// pools.
//
// Captures are counted process-wide (gocore.AddProcessCaptures): in CUDA's
// global capture mode, torch's default, a capture through one pool forbids
// every pool of the process to free memory or query events. The package
// therefore keeps two process-wide things besides: the gate that orders the
// start of any capture after the close of a private pool, and the closed
// private pools whose segments the backend refused (SweepAll and
// RetryLingering offer them again).
package graphpool

import (
	"errors"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"

	"github.com/gpumempool/gpumempool/gocore"
)

// ID names a private pool as torch does (c10::MempoolId_t).
type ID [2]uint64

// Filter says which streams of a capture's device allocate into its pool.
type Filter struct {
	// Accepts reports whether an allocation on stream goes to the
	// capture's private pool (torch's std::function<bool(cudaStream_t)>).
	// It is called with the Pools' lock held, so it must not call back
	// into them.
	Accepts func(stream gocore.Stream) bool
	// Release, when set, is called exactly once when the capture ends, is
	// dropped (ClosePrivate) or could not begin: the filter's owner frees
	// what Accepts uses then.
	Release func()
}

func (f Filter) release() {
	if f.Release != nil {
		f.Release()
	}
}

// key names a private pool: torch begins, ends and releases a pool id per
// device (one torch.cuda.MemPool may be used on several).
type key struct {
	device int
	id     ID
}

// capture is one BeginCapture not yet ended.
type capture struct {
	key
	filter Filter
}

// privatePool is a pool torch allocated into.
type privatePool struct {
	key
	pool     *gocore.Pool
	live     int  // blocks allocated and not freed
	released bool // no user is left (uses): close once it is idle
}

func (pp *privatePool) errorf(format string, args ...any) error {
	return fmt.Errorf("private pool (%d, %d): "+format, append([]any{pp.id[0], pp.id[1]}, args...)...)
}

// Pools is a pool (the main pool) with the private pools captures of it
// allocate into. Its methods are the main pool's allocation calls, routed
// to a private pool where a capture or a private block says so; they are
// safe for concurrent use.
type Pools struct {
	main *gocore.Pool
	// capturing counts the captures begun and not ended, so that Alloc goes
	// straight to the main pool with one atomic load while there is none,
	// and privateLive the live blocks of the private pools, so that Free,
	// Lookup and RecordStream do while none lives. Both change under mu.
	capturing   atomic.Int64
	privateLive atomic.Int64
	// owner maps the address of a live private block to its *privatePool.
	// Every free looks here while a private block lives, so reads take no
	// lock; writes happen under mu.
	owner sync.Map

	// left is set, under activeMu, when ClosePrivate takes p out of
	// active: p never joins it again.
	left bool

	mu       sync.Mutex
	closed   bool // ClosePrivate ran: the main pool is closing, begin nothing
	captures []capture
	pools    map[key]*privatePool
	// uses counts, per private pool, BeginCapture calls not yet matched by
	// a Release (torch's PrivatePool::use_count).
	uses    map[key]int
	retired map[int]gocore.Stats // by device: what closed private pools counted
	// unreleased holds closed private pools some of whose segments the
	// backend refused to take back: each sweep retries them, as
	// ClosePrivate does last (gocore.Pool.Close retries exactly those).
	unreleased []*gocore.Pool
}

// New returns main with no private pool yet.
func New(main *gocore.Pool) *Pools {
	return &Pools{main: main, pools: map[key]*privatePool{}, uses: map[key]int{}, retired: map[int]gocore.Stats{}}
}

var (
	// active holds the Pools that began a capture and are not closed, for
	// SweepAll (the last capture of the process ended: private pools left
	// open because of it, through any pool, may close now).
	active   = map[*Pools]struct{}{}
	activeMu sync.Mutex

	// captureGate orders a capture's start (the captures going up, in
	// BeginCapture, before torch begins capturing) against the close of a
	// private pool that found no capture under way: that close finishes
	// before any capture of the process, through any pool, can begin.
	// Otherwise its segment frees could run during another pool's capture.
	captureGate sync.RWMutex

	// lingering holds closed private pools of pools that closed themselves
	// while the backend still refused some of their segments (a release
	// refused during a capture, say): every sweep offers them again.
	lingering   []*gocore.Pool
	lingeringMu sync.Mutex

	// testHookBeforePrivateClose, when set (tests only), runs in
	// closeIfDoneLocked after the checks and before the close.
	testHookBeforePrivateClose func()
)

// join enters p into active, unless its private pools are closed (or its
// main pool is: ClosePrivate follows): no private pool may appear then.
func (p *Pools) join() bool {
	activeMu.Lock()
	defer activeMu.Unlock()
	if p.left || p.main.Closed() {
		return false
	}
	active[p] = struct{}{}
	return true
}

// Alloc serves an allocation of size bytes on device for stream: from a
// private pool while a capture on device accepts the stream (the newest
// such capture), else from the main pool. When the main pool is out of
// memory, private pools no graph uses any more are closed (Sweep) and the
// allocation is tried once more, as torch frees its freeable graph pools
// before it gives up.
func (p *Pools) Alloc(device int, size uint64, stream gocore.Stream) (uint64, error) {
	if p.capturing.Load() != 0 {
		return p.allocCapturing(device, size, stream, false)
	}
	addr, err := p.main.Alloc(device, size, stream)
	if err != nil {
		return p.retryOutOfMemory(device, size, stream, false, err)
	}
	return addr, nil
}

// AllocSegment is Alloc for torch's caching allocator asking for a segment
// of a torch.cuda.MemPool (gocore.Pool.AllocSegment).
func (p *Pools) AllocSegment(device int, size uint64, stream gocore.Stream) (uint64, error) {
	if p.capturing.Load() != 0 {
		return p.allocCapturing(device, size, stream, true)
	}
	addr, err := p.main.AllocSegment(device, size, stream)
	if err != nil {
		return p.retryOutOfMemory(device, size, stream, true, err)
	}
	return addr, nil
}

// allocCapturing is Alloc (AllocSegment with segment) while a capture may
// route the allocation to a private pool.
func (p *Pools) allocCapturing(device int, size uint64, stream gocore.Stream, segment bool) (uint64, error) {
	if addr, private, err := p.privateAlloc(device, size, stream); private {
		return addr, err
	}
	addr, err := p.mainAlloc(device, size, stream, segment)
	if err != nil {
		return p.retryOutOfMemory(device, size, stream, segment, err)
	}
	return addr, nil
}

// retryOutOfMemory follows the main pool's failure err to allocate: when
// it is out of memory, private pools no graph uses any more may still hold
// segments (they waited for their events, or for a capture to end), so
// those are closed and the allocation is tried once more.
func (p *Pools) retryOutOfMemory(device int, size uint64, stream gocore.Stream, segment bool, err error) (uint64, error) {
	if !errors.Is(err, gocore.ErrOutOfMemory) {
		return 0, err
	}
	if n, serr := p.Sweep(); n == 0 || serr != nil {
		return 0, err
	}
	return p.mainAlloc(device, size, stream, segment)
}

func (p *Pools) mainAlloc(device int, size uint64, stream gocore.Stream, segment bool) (uint64, error) {
	if segment {
		return p.main.AllocSegment(device, size, stream)
	}
	return p.main.Alloc(device, size, stream)
}

// privateAlloc serves an allocation from a private pool when a capture on
// device accepts stream; private is false when none does (the main pool
// serves it then).
func (p *Pools) privateAlloc(device int, size uint64, stream gocore.Stream) (addr uint64, private bool, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	// Newest first, as torch's own allocator routes since 2.10
	// (pytorch#168382): a graph captured inside use_mem_pool, or nested
	// use_mem_pool blocks, allocate into the innermost pool whose filter
	// accepts the stream.
	for i := len(p.captures) - 1; i >= 0; i-- {
		c := p.captures[i]
		if c.device != device || !c.filter.Accepts(stream) {
			continue
		}
		pp, err := p.poolLocked(c.key)
		if err != nil {
			return 0, true, err
		}
		addr, err = pp.pool.Alloc(device, size, stream)
		if err != nil {
			return 0, true, pp.errorf("%w", err)
		}
		p.owner.Store(addr, pp)
		pp.live++
		p.privateLive.Add(1)
		return addr, true, nil
	}
	return 0, false, nil
}

// poolLocked returns private pool k, made on first use.
func (p *Pools) poolLocked(k key) (*privatePool, error) {
	if pp := p.pools[k]; pp != nil {
		return pp, nil
	}
	cfg := p.main.Config()
	cfg.Name = fmt.Sprintf("%s/private(%d,%d)", cfg.Name, k.id[0], k.id[1])
	// A replay writes the blocks the capture freed: they must stay mapped,
	// whatever the main pool's release policy.
	cfg.KeepSegments = true
	pool, err := gocore.NewPool(cfg)
	if err != nil {
		return nil, fmt.Errorf("private pool (%d, %d): %w", k.id[0], k.id[1], err)
	}
	for range p.captures { // in as many captures as the pools made before it
		pool.EnterCapture()
	}
	pp := &privatePool{key: k, pool: pool}
	p.pools[k] = pp
	return pp, nil
}

// owning returns the private pool holding the live block at addr, or nil.
func (p *Pools) owning(addr uint64) *privatePool {
	if p.privateLive.Load() == 0 {
		return nil
	}
	if pp, ok := p.owner.Load(addr); ok {
		return pp.(*privatePool)
	}
	return nil
}

// Free frees a block Alloc gave, in the pool that holds it. A private pool
// with no user left closes once its last block is freed and idle.
func (p *Pools) Free(addr uint64) error {
	if p.privateLive.Load() != 0 {
		return p.freeRouted(addr)
	}
	return p.main.Free(addr)
}

// freeRouted is Free while a private block lives.
func (p *Pools) freeRouted(addr uint64) error {
	if pp := p.owning(addr); pp != nil {
		if done, err := p.privateFree(pp, addr); done {
			return err
		}
	}
	return p.main.Free(addr)
}

// privateFree frees addr in pp; done is false when another thread freed it
// first (the main pool answers then).
func (p *Pools) privateFree(pp *privatePool, addr uint64) (done bool, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if cur, ok := p.owner.Load(addr); !ok || cur != pp {
		return false, nil
	}
	if err := pp.pool.Free(addr); err != nil {
		return true, err
	}
	p.owner.Delete(addr)
	pp.live--
	p.privateLive.Add(-1)
	_, err = p.closeIfDoneLocked(pp)
	return true, err
}

// RecordStream marks a block Alloc gave as used on stream, in the pool
// that holds it.
func (p *Pools) RecordStream(addr uint64, stream gocore.Stream) error {
	if pp := p.owning(addr); pp != nil {
		return pp.pool.RecordStream(addr, stream)
	}
	return p.main.RecordStream(addr, stream)
}

// Lookup describes a live block Alloc gave, wherever it lives.
func (p *Pools) Lookup(addr uint64) (gocore.BlockInfo, error) {
	if pp := p.owning(addr); pp != nil {
		return pp.pool.Lookup(addr)
	}
	return p.main.Lookup(addr)
}

// EmptyCache gives back the cached segments of the main pool and those of
// the private pools no graph uses any more (torch's empty_cache frees
// freeable graph pools too), and returns the bytes the main pool released.
func (p *Pools) EmptyCache() (uint64, error) {
	_, serr := p.Sweep()
	n, err := p.main.EmptyCache()
	return n, errors.Join(err, serr)
}

// BeginCapture routes allocations on device whose stream f accepts to
// private pool id until EndCapture, and counts a user of that pool. It
// enters the main pool and its private pools into a capture
// (gocore.Pool.EnterCapture), and counts a capture of the process. f is
// owned from the call on: kept with the capture, or released on failure.
func (p *Pools) BeginCapture(device int, id ID, f Filter) error {
	stored := false
	defer func() {
		if !stored {
			f.release()
		}
	}()
	if !p.join() {
		return fmt.Errorf("device %d, pool (%d, %d): %w", device, id[0], id[1], gocore.ErrClosed)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed { // ClosePrivate ran since join
		return fmt.Errorf("device %d, pool (%d, %d): %w", device, id[0], id[1], gocore.ErrClosed)
	}
	k := key{device, id}
	p.uses[k]++
	if pp := p.pools[k]; pp != nil {
		pp.released = false // a released pool used again (a torch.cuda.MemPool re-entered)
	}
	p.captures = append(p.captures, capture{key: k, filter: f})
	p.capturing.Add(1)
	stored = true
	captureGate.Lock()
	gocore.AddProcessCaptures(1)
	captureGate.Unlock()
	return p.captureLocked(true)
}

// EndCapture ends the oldest capture begun for (device, id) and releases
// its filter. When it was the last capture of the process, private pools
// kept open because of it are closed (SweepAll).
func (p *Pools) EndCapture(device int, id ID) error {
	err := p.endCapture(key{device, id})
	if gocore.ProcessCaptures() == 0 {
		_, serr := SweepAll()
		err = errors.Join(err, serr)
	}
	return err
}

func (p *Pools) endCapture(k key) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, c := range p.captures {
		if c.key == k {
			c.filter.release()
			p.captures = append(p.captures[:i], p.captures[i+1:]...)
			p.capturing.Add(-1)
			gocore.AddProcessCaptures(-1)
			return p.captureLocked(false)
		}
	}
	return fmt.Errorf("device %d, pool (%d, %d): no allocation to this pool was begun", k.device, k.id[0], k.id[1])
}

// captureLocked enters (or exits) a capture on the main pool and on every
// private pool (gocore.Pool.EnterCapture): while torch records a graph, no
// event may be recorded or queried and no memory freed, in any pool torch
// allocates from.
func (p *Pools) captureLocked(enter bool) error {
	pools := []*gocore.Pool{p.main}
	for _, pp := range p.pools {
		pools = append(pools, pp.pool)
	}
	var errs []error
	for _, pool := range pools {
		if enter {
			pool.EnterCapture()
		} else {
			errs = append(errs, pool.ExitCapture())
		}
	}
	return errors.Join(errs...)
}

// Release takes a user away from private pool id on device; with none
// left it is closed as soon as it is done. A release with no user left
// (torch.cuda.MemPool's destructor after its use_mem_pool blocks released
// theirs), or of a pool never begun, changes nothing.
func (p *Pools) Release(device int, id ID) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	k := key{device, id}
	if p.uses[k] > 1 {
		p.uses[k]--
		return nil // another graph (or use_mem_pool block) still uses it
	}
	delete(p.uses, k)
	pp := p.pools[k]
	if pp == nil {
		return nil
	}
	pp.released = true
	_, err := p.closeIfDoneLocked(pp)
	return err
}

// closeIfDoneLocked closes pp if it is done: no user is left, it holds no
// block, no freed block waits for its events (the memory may still be in
// use on another stream), and no capture is under way anywhere in the
// process (freeing memory would invalidate it). Otherwise a later sweep
// tries again. It reports whether pp was closed.
func (p *Pools) closeIfDoneLocked(pp *privatePool) (bool, error) {
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
		return false, pp.errorf("%w", err)
	}
	if waiting > 0 {
		return false, nil
	}
	if testHookBeforePrivateClose != nil {
		testHookBeforePrivateClose()
	}
	return true, p.closeLocked(pp)
}

// closeLocked returns the segments of a private pool that is done to the
// backend, keeping its counters.
func (p *Pools) closeLocked(pp *privatePool) error {
	delete(p.pools, pp.key)
	if st, err := pp.pool.Stats(pp.device); err == nil {
		r := p.retired[pp.device]
		rs := st.Retired()
		r.Merge(&rs)
		p.retired[pp.device] = r
	}
	if _, err := pp.pool.Close(); err != nil {
		p.unreleased = append(p.unreleased, pp.pool)
		return fmt.Errorf("close private pool (%d, %d): %w", pp.id[0], pp.id[1], err)
	}
	return nil
}

// Sweep closes the private pools of p that are done, offers the backend
// again the segments it refused when private pools closed (p's and the
// process's lingering ones), and returns how many pools it closed or
// wholly gave back.
func (p *Pools) Sweep() (int, error) {
	n, err := p.sweep()
	done, lerr := RetryLingering()
	return n + done, errors.Join(err, lerr)
}

func (p *Pools) sweep() (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	var errs []error
	for _, pp := range p.pools {
		closed, err := p.closeIfDoneLocked(pp)
		if closed {
			n++
		}
		errs = append(errs, err)
	}
	var done int
	var err error
	p.unreleased, done, err = retryUnreleased(p.unreleased)
	return n + done, errors.Join(append(errs, err)...)
}

// SweepAll is Sweep for every Pools of the process that began a capture
// and is not closed: the last capture of the process ended, so private
// pools kept open because of it, through any pool, may close now.
func SweepAll() (int, error) {
	activeMu.Lock()
	all := make([]*Pools, 0, len(active))
	for p := range active {
		all = append(all, p)
	}
	activeMu.Unlock()
	n := 0
	var errs []error
	for _, p := range all {
		done, err := p.sweep()
		n += done
		errs = append(errs, err)
	}
	done, err := RetryLingering()
	return n + done, errors.Join(append(errs, err)...)
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
	for _, pool := range pools {
		if _, err := pool.Close(); err != nil && !errors.Is(err, gocore.ErrClosed) {
			kept = append(kept, pool)
			errs = append(errs, err)
			continue
		}
		done++
	}
	clear(pools[len(kept):])
	return kept, done, errors.Join(errs...)
}

// RetryLingering offers the backend again the segments of private pools
// whose main pool closed while the backend refused them (a pool closed
// during its own capture, say), unless a capture is under way, and
// returns how many pools are now wholly given back. Every sweep calls it;
// the C ABI calls it too when torch ends a capture of a pool that is gone.
//
// It takes the pools out of the list under the lock and frees outside it
// (a backend's free may wait for a device), then puts back those still
// refused: a pool closing meanwhile adds its own without waiting, and
// concurrent retries offer disjoint pools.
func RetryLingering() (int, error) {
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

// Info describes one private pool (List).
type Info struct {
	ID             ID     `json:"id"`
	Device         int    `json:"device"`
	LiveBlocks     int    `json:"live_blocks"`
	AllocatedBytes uint64 `json:"allocated_bytes"`
	ReservedBytes  uint64 `json:"reserved_bytes"`
	Released       bool   `json:"released"`
	Capturing      bool   `json:"capturing"` // an allocation to it is begun and not ended
}

// List describes the open private pools, ordered by id and device.
func (p *Pools) List() ([]Info, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := []Info{}
	var errs []error
	for _, pp := range p.pools {
		s, err := pp.pool.Stats(pp.device)
		errs = append(errs, err)
		info := Info{ID: pp.id, Device: pp.device, LiveBlocks: pp.live, Released: pp.released,
			AllocatedBytes: uint64(s.AllocatedBytes[0].Current), ReservedBytes: uint64(s.ReservedBytes[0].Current)}
		for _, c := range p.captures {
			info.Capturing = info.Capturing || c.key == pp.key
		}
		out = append(out, info)
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

// AddStats adds the statistics of the private pools on device dev (all
// devices when dev < 0), open and closed, to s: their memory is the main
// pool's too, as torch's memory_stats counts its graphs' private pools.
func (p *Pools) AddStats(dev int, s *gocore.Stats) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	var errs []error
	for _, pp := range p.pools {
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
	for d, r := range p.retired {
		if dev < 0 || d == dev {
			s.Merge(&r)
		}
	}
	return errors.Join(errs...)
}

// ClosePrivate closes the private pools and drops the captures, releasing
// their filters, because the main pool is closing (its owner closes it,
// before), and reports the blocks they still held. No capture can begin
// afterwards. When those were the last captures of the process, the
// private pools of other pools that waited for them to end are closed too,
// as at an EndCapture.
func (p *Pools) ClosePrivate() (gocore.CloseReport, error) {
	rep, captured, err := p.closePrivate()
	if captured && gocore.ProcessCaptures() == 0 {
		_, serr := SweepAll()
		err = errors.Join(err, serr)
	}
	return rep, err
}

func (p *Pools) closePrivate() (total gocore.CloseReport, captured bool, err error) {
	activeMu.Lock()
	delete(active, p)
	p.left = true
	activeMu.Unlock()
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	captured = len(p.captures) > 0
	for _, c := range p.captures {
		c.filter.release()
		gocore.AddProcessCaptures(-1)
	}
	p.captures = nil
	p.capturing.Store(0)
	p.uses = map[key]int{}
	var errs []error
	for k, pp := range p.pools {
		rep, err := pp.pool.Close()
		delete(p.pools, k)
		if err != nil {
			p.unreleased = append(p.unreleased, pp.pool) // segments the backend refused
		}
		errs = append(errs, err)
		total.LiveBlocks = append(total.LiveBlocks, rep.LiveBlocks...)
		total.LiveBytes += rep.LiveBytes
		total.SegmentsFreed += rep.SegmentsFreed
		total.BytesFreed += rep.BytesFreed
	}
	p.owner.Range(func(addr, _ any) bool {
		p.owner.Delete(addr)
		p.privateLive.Add(-1)
		return true
	})
	// What the backend refused, now and earlier: offered again now unless a
	// capture forbids it, and what is still refused then goes to the
	// process's lingering pools, retried by every sweep.
	var err2 error
	p.unreleased, _, err2 = retryUnreleased(p.unreleased)
	errs = append(errs, err2)
	if len(p.unreleased) > 0 {
		lingeringMu.Lock()
		lingering = append(lingering, p.unreleased...)
		lingeringMu.Unlock()
		p.unreleased = nil
	}
	return total, captured, errors.Join(errs...)
}
