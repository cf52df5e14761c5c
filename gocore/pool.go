package gocore

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
)

// Config configures a Pool. The zero value of every option means "as torch
// does": no limit, blocks of any size may be split, everything freed is
// cached until EmptyCache.
//
// Config is the one declaration of the pool's settings (its policy): the
// fields with an option tag (see gocore/options) are the settings users
// give by name, and the bindings publish their schema (name, unit, default,
// torch's option of the same setting, doc), from which the Python layer
// builds its argument checks, replay and tune keys, and docs. Adding a
// setting is adding a tagged field here (and the engine code that reads
// it), and tune searches it over the values its search tag lists. The
// fields are in the order torch documents its options.
type Config struct {
	// Name identifies the pool in errors and stats; default "pool".
	Name string
	// Backend provides segments and events. Required. Many pools may share
	// one backend; each pool keeps its own segments.
	Backend Backend
	// Limit caps the bytes the pool reserves on each device (0: no limit).
	// It sets the limit of the pool's own budget; with Budget set it is
	// ignored (the shared budget holds the limits).
	Limit uint64 `option:"limit" unit:"bytes" doc:"bytes the pool may reserve per device (0: no limit)"`
	// Budget, when set, is a budget shared with other pools over the same
	// backend: each device's limit applies to what they reserve together.
	// Config returns the pool's budget, so a pool made from another's
	// Config shares its limits. Nil: a budget of the pool's own.
	Budget *Budget `json:"-"`
	// MaxSplitSize: blocks of at least this size are never split, and
	// requests below it never take them (torch's max_split_size_mb). 0
	// means unlimited. When set it must be at least LargeBuffer (20 MiB), as
	// torch requires: below that every LargeBuffer segment would be
	// oversize, and each small large request would cost a segment of its
	// own.
	MaxSplitSize uint64 `option:"max_split_size" unit:"bytes" torch:"max_split_size_mb" torch_unit:"MiB" torch_min:"21" search:"32MiB,64MiB,128MiB,256MiB,512MiB,1GiB,2GiB" doc:"blocks at least this large are never split (torch's max_split_size_mb, in bytes; 0: no limit, else at least 20 MiB)"`
	// RoundupPower2Divisions, when at least 2, rounds requests up to one of
	// this many equal steps between consecutive powers of two (torch's
	// roundup_power2_divisions); it must be a power of two, at most
	// MaxRoundupDivisions. 0 or 1: plain 512-byte rounding.
	RoundupPower2Divisions uint64 `option:"roundup_power2_divisions" unit:"count" torch:"roundup_power2_divisions" search:"1,2,4,8,16" doc:"round requests up to one of N steps between powers of two (torch's option; N a power of two, 0 or 1: off); or 16 counts, one per size interval (below 2 MiB, then [2^(20+i), 2^(21+i)) bytes, the last from 32 GiB): a list, or the dict {'1': n1, ..., '16': n16} of a torch snapshot's allocator_settings"`
	// RoundupPower2DivisionsBySize, when set (RoundupIntervals entries),
	// gives the divisions per size interval instead, like torch's
	// roundup_power2_divisions:[256:1,512:2,>:8] (see RoundupIntervals).
	RoundupPower2DivisionsBySize []uint64 `option:"roundup_power2_divisions_by_size" unit:"count" given_as:"roundup_power2_divisions" doc:"the divisions of each of the 16 size intervals (roundup_power2_divisions given as a list)"`
	// MaxNonSplitRoundingSize: a request of at least MaxSplitSize takes a
	// cached block (unsplit) only if the block is less than this much larger
	// (torch's max_non_split_rounding_mb). 0 means torch's default,
	// LargeBuffer (20 MiB); when set it must be at least LargeBuffer, as
	// torch requires.
	MaxNonSplitRoundingSize uint64 `option:"max_non_split_rounding_size" unit:"bytes" torch:"max_non_split_rounding_mb" torch_unit:"MiB" torch_min:"21" default:"20 MiB (LargeBuffer), as torch" search:"64MiB,256MiB,1GiB" doc:"how much larger than an oversize request a cached oversize block it takes may be (torch's max_non_split_rounding_mb, in bytes)"`
	// GarbageCollectionThreshold (torch's garbage_collection_threshold, in
	// (0, 1); 0 is off) acts on devices with a limit: when a large request
	// misses the cache while the device reserves more than this fraction of
	// its limit, whole cached large segments unused for longer than the
	// average are released (oldest first, repeatedly) until it is below,
	// before asking the backend for more. Unlike the release-and-retry of
	// the OOM path it runs before memory is exhausted, so the limit is
	// rarely reached.
	GarbageCollectionThreshold float64 `option:"garbage_collection_threshold" unit:"fraction" torch:"garbage_collection_threshold" search:"0.5,0.6,0.7,0.8,0.9" doc:"fraction of the limit above which a cache miss first releases the cached large segments unused the longest (torch's option, in [0, 1); needs limit)"`
	// ReleaseThreshold is how many unused reserved bytes a device may keep
	// cached: when a free leaves more, whole free segments (then the free
	// tails of expandable segments) go back to the backend until it is under
	// the threshold (like the release threshold of a CUDA memory pool); a
	// capture defers that to its end. 0 means unlimited.
	ReleaseThreshold uint64 `option:"release_threshold" unit:"bytes" search:"64MiB,256MiB,1GiB" doc:"unused bytes kept cached per device (0: keep all)"`
	// KeepSegments: segments go back to the backend only when the pool is
	// closed. Freed memory stays cached whatever happens: no release and
	// retry when the backend runs out (the allocation fails instead), no
	// ReleaseThreshold or garbage collection, and Trim / EmptyCache release
	// nothing. For pools whose freed blocks may still be written by work
	// recorded earlier, such as the private pool of a CUDA graph, which
	// every replay runs with the addresses it was captured with. Not a
	// setting users give: the graph pools set it.
	KeepSegments bool
	// TorchVersion selects the rules of one torch release where releases
	// differ ("2.15", "2.15.0", "2.15.0+cu130"; "" is the default, the
	// rules of torch 2.5 to 2.14). From 2.15 best fit breaks ties between
	// free blocks of the same size by the order their segments were
	// created, oldest first, instead of by address.
	TorchVersion string `option:"torch_version" unit:"version" default:"the rules of torch 2.5 to 2.14" doc:"the torch release whose rules apply where releases differ (\"2.15\", or torch.__version__; from 2.15 best fit breaks ties between free blocks of one size by segment age, oldest first, instead of by address)"`
}

// torchRules are the version-dependent choices Config.TorchVersion makes.
type torchRules struct {
	// bestFitBySegment: equal-size free blocks go to the oldest segment
	// first (torch 2.15's BlockComparatorSizeCounterAddress).
	bestFitBySegment bool
}

// parseTorchVersion reads Config.TorchVersion: MAJOR.MINOR, optionally
// followed by .PATCH and a local part (+cu130) or pre-release tag, as
// torch.__version__ spells it.
func parseTorchVersion(v string) (torchRules, error) {
	if v == "" {
		return torchRules{}, nil
	}
	var major, minor int
	rest := v
	if i := strings.IndexByte(rest, '+'); i >= 0 {
		rest = rest[:i]
	}
	parts := strings.SplitN(rest, ".", 3)
	bad := len(parts) < 2
	if !bad {
		var err1, err2 error
		major, err1 = strconv.Atoi(parts[0])
		minor, err2 = strconv.Atoi(parts[1])
		bad = err1 != nil || err2 != nil || major < 0 || minor < 0
	}
	if bad {
		return torchRules{}, fmt.Errorf("torch version %q is not MAJOR.MINOR[.PATCH]: %w", v, ErrInvalidArgument)
	}
	return torchRules{bestFitBySegment: major > 2 || (major == 2 && minor >= 15)}, nil
}

// MaxRoundupDivisions bounds Config.RoundupPower2Divisions.
const MaxRoundupDivisions = 1 << 16

func checkDivisions(cfg Config) error {
	bad := func(d uint64) bool { return d > MaxRoundupDivisions || d&(d-1) != 0 }
	if bad(cfg.RoundupPower2Divisions) {
		return fmt.Errorf("roundup power-2 divisions %d must be a power of two <= %d (or 0): %w",
			cfg.RoundupPower2Divisions, MaxRoundupDivisions, ErrInvalidArgument)
	}
	if by := cfg.RoundupPower2DivisionsBySize; by != nil {
		if len(by) != RoundupIntervals {
			return fmt.Errorf("roundup power-2 divisions by size: %d entries, want %d: %w",
				len(by), RoundupIntervals, ErrInvalidArgument)
		}
		for i, d := range by {
			if bad(d) {
				return fmt.Errorf("roundup power-2 divisions of interval %d: %d must be a power of two <= %d (or 0): %w",
					i, d, MaxRoundupDivisions, ErrInvalidArgument)
			}
		}
	}
	return nil
}

// Pool is a caching allocator over one Backend. It is safe for concurrent
// use by many goroutines and OS threads.
type Pool struct {
	mu       sync.Mutex
	cfg      Config
	name     string
	backend  Backend
	closed   bool
	devices  []*deviceState // indexed by ordinal, created lazily
	live     liveIndex      // allocated blocks by address
	spare    []*block       // block structs kept for reuse
	expander Expander       // non-nil when the backend grows segments in place
	shrinker Shrinker       // non-nil when it can also give their free tails back
	mapper   PageMapper     // non-nil when it can also unmap and map pages inside them
	hist     *history       // recorded events; nil when recording is off
	histMax  int
	// histThreads: history entries name their caller's OS thread
	// (RecordThreads).
	histThreads bool
	// budget holds the limits (cfg.Limit, and per device: torch's
	// set_per_process_memory_fraction is per device) and counts reserved
	// bytes against them, with pools sharing it (cfg.Budget).
	budget *Budget
	// captures counts EnterCapture calls not yet exited.
	captures int
	// rules are the torch version's choices (Config.TorchVersion).
	rules torchRules
	// segments counts the segments the pool has created: segment.seq.
	segments uint64
	// unreleased holds, once the pool is closed, the segments whose backend
	// Free failed: still reserved, retried by the next Close.
	unreleased []*segment
}

// deviceState is everything the pool keeps for one device.
type deviceState struct {
	id         int
	streams    map[Stream]*streamFree
	lastStream Stream
	lastFree   *streamFree
	segments   map[uint64]*segment // by base address
	// wholeFree lists the segments that are one free block, each knowing
	// its place (segment.wholeFreeAt): a cache hit that takes or frees a
	// whole segment updates it without hashing.
	wholeFree []*segment
	// bySegment: the device's free lists break ties by segment age
	// (torchRules.bestFitBySegment).
	bySegment bool
	// largeLookups counts searches of the large free lists: the clock that
	// ages cached segments for garbage collection (torch's gc_count).
	largeLookups uint64
	pending      []eventQueue // frees waiting for events, a queue per stream
	unrecorded   []*block     // frees whose events wait for ExitCapture
	// releaseHeld: a capture held back a release the threshold asked for
	// (nothing may be released while one runs); applied when it is over.
	releaseHeld bool
	events      []Event // idle events kept for reuse
	// growing is the expandable segment each stream grows in each pool
	// kind, as torch keeps one per stream in its small and large pools.
	growing map[growKey]*segment
	// expScratch is growLocked's list of a stream's expandable segments,
	// kept to spare an allocation per miss.
	expScratch []*segment
	// reserve is the address space torch reserves for an expandable
	// segment of each pool kind on this device (0 until first needed).
	reserve [3]uint64
	stats   Stats
}

// growKey names a growing segment: its stream and pool kind.
type growKey struct {
	stream Stream
	kind   poolKind
}

// MaxDevices bounds the devices of a pool's backend: a pool keeps state
// per device, and a GPU node has a handful.
const MaxDevices = 1024

// NewPool validates cfg and returns an empty pool.
func NewPool(cfg Config) (*Pool, error) {
	if cfg.Backend == nil {
		return nil, fmt.Errorf("new pool: no backend: %w", ErrInvalidArgument)
	}
	if cfg.MaxSplitSize != 0 && cfg.MaxSplitSize < LargeBuffer {
		return nil, fmt.Errorf("new pool: max split size %d must be at least %d bytes (20 MiB, torch's minimum max_split_size_mb), or 0 for none: %w",
			cfg.MaxSplitSize, uint64(LargeBuffer), ErrInvalidArgument)
	}
	if cfg.MaxNonSplitRoundingSize != 0 && cfg.MaxNonSplitRoundingSize < LargeBuffer {
		return nil, fmt.Errorf("new pool: max non-split rounding size %d must be at least %d bytes (20 MiB, torch's minimum max_non_split_rounding_mb), or 0 for the default: %w",
			cfg.MaxNonSplitRoundingSize, uint64(LargeBuffer), ErrInvalidArgument)
	}
	if err := checkDivisions(cfg); err != nil {
		return nil, fmt.Errorf("new pool: %w", err)
	}
	if g := cfg.GarbageCollectionThreshold; !(g >= 0 && g < 1) {
		return nil, fmt.Errorf("new pool: garbage collection threshold %v must be in [0, 1): %w", g, ErrInvalidArgument)
	}
	rules, err := parseTorchVersion(cfg.TorchVersion)
	if err != nil {
		return nil, fmt.Errorf("new pool: %w", err)
	}
	cfg.RoundupPower2DivisionsBySize = slices.Clone(cfg.RoundupPower2DivisionsBySize)
	if cfg.MaxNonSplitRoundingSize == 0 {
		cfg.MaxNonSplitRoundingSize = LargeBuffer
	}
	if cfg.Name == "" {
		cfg.Name = "pool"
	}
	n := cfg.Backend.Devices()
	if n <= 0 || n > MaxDevices {
		return nil, fmt.Errorf("new pool %q: backend %s reports %d devices (at most %d): %w",
			cfg.Name, cfg.Backend.Name(), n, MaxDevices, ErrInvalidArgument)
	}
	var ex Expander
	if e, ok := cfg.Backend.(Expander); ok && e.Expandable() {
		if g := e.Granularity(); g == 0 || g%MinBlockSize != 0 {
			return nil, fmt.Errorf("new pool %q: backend %s granularity %d is not a positive multiple of %d: %w",
				cfg.Name, cfg.Backend.Name(), g, MinBlockSize, ErrInvalidArgument)
		}
		ex = e
	}
	var sh Shrinker
	if s, ok := cfg.Backend.(Shrinker); ok && ex != nil {
		sh = s
	}
	var pm PageMapper
	if m, ok := cfg.Backend.(PageMapper); ok && sh != nil {
		pm = m
	}
	budget := cfg.Budget
	if budget == nil {
		budget = NewBudget(n, cfg.Limit)
	} else if len(budget.reserved) != n {
		return nil, fmt.Errorf("new pool %q: shared budget counts %d devices, backend %s has %d: %w",
			cfg.Name, len(budget.reserved), cfg.Backend.Name(), n, ErrInvalidArgument)
	}
	cfg.Budget = budget
	return &Pool{
		rules:    rules,
		budget:   budget,
		expander: ex,
		shrinker: sh,
		mapper:   pm,
		cfg:      cfg,
		name:     cfg.Name,
		backend:  cfg.Backend,
		devices:  make([]*deviceState, n),
	}, nil
}

// Name returns the pool's name.
func (p *Pool) Name() string { return p.name }

// Backend returns the backend the pool draws from.
func (p *Pool) Backend() Backend { return p.backend }

// Config returns the pool's configuration as it is now.
func (p *Pool) Config() Config {
	p.mu.Lock()
	defer p.mu.Unlock()
	c := p.cfg
	c.Limit = p.budget.defaultLimit()
	c.RoundupPower2DivisionsBySize = slices.Clone(c.RoundupPower2DivisionsBySize)
	return c
}

// SetLimit changes the byte limit of every device (0: none), replacing
// limits set for single devices with SetDeviceLimit. Memory already
// reserved above a lowered limit stays until freed and released. The limit
// is the pool's budget's: pools sharing it (Config.Budget) share the change.
func (p *Pool) SetLimit(limit uint64) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return fmt.Errorf("set limit on pool %q: %w", p.name, ErrClosed)
	}
	p.budget.setLimit(limit) // Config reads it back from there
	return nil
}

// SetDeviceLimit changes the byte limit of one device (0: none), leaving the
// other devices' limits as they are.
func (p *Pool) SetDeviceLimit(device int, limit uint64) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return fmt.Errorf("set limit on pool %q: %w", p.name, ErrClosed)
	}
	if _, err := p.device(device); err != nil {
		return fmt.Errorf("set limit: %w", err)
	}
	p.budget.setDeviceLimit(device, limit)
	return nil
}

// Budget returns the budget that holds the pool's limits (see Config.Budget).
func (p *Pool) Budget() *Budget { return p.budget }

// Limit reports the byte limit in force on device (0: none).
func (p *Pool) Limit(device int) uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.limitLocked(device)
}

func (p *Pool) limitLocked(device int) uint64 { return p.budget.Limit(device) }

// addReserved counts delta more reserved bytes of kind on d, in the stats
// and in the budget (segments obtained are counted in the budget before the
// backend call: backendAlloc).
func (p *Pool) addReserved(d *deviceState, k poolKind, delta int64) {
	d.stats.ReservedBytes.add(k, delta)
	p.budget.add(d.id, delta)
}

// SetReleaseThreshold changes the release threshold (0: unlimited) and
// applies it at once.
func (p *Pool) SetReleaseThreshold(bytes uint64) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return fmt.Errorf("set release threshold on pool %q: %w", p.name, ErrClosed)
	}
	p.cfg.ReleaseThreshold = bytes
	if bytes == 0 {
		return nil
	}
	var errs []error
	for _, d := range p.devices {
		if d != nil {
			_, err := p.trimLocked(d, bytes)
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Closed reports whether Close has been called.
func (p *Pool) Closed() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.closed
}

// device returns the state for ordinal dev, creating it on first use.
func (p *Pool) device(dev int) (*deviceState, error) {
	if dev < 0 || dev >= len(p.devices) {
		return nil, fmt.Errorf("pool %q: device %d out of range [0, %d) of backend %s: %w",
			p.name, dev, len(p.devices), p.backend.Name(), ErrInvalidDevice)
	}
	d := p.devices[dev]
	if d == nil {
		d = &deviceState{
			id:        dev,
			streams:   make(map[Stream]*streamFree),
			segments:  make(map[uint64]*segment),
			growing:   make(map[growKey]*segment),
			bySegment: p.rules.bestFitBySegment,
		}
		d.stats.MaxSplitSize = maxSplitStat(p.cfg.MaxSplitSize)
		p.devices[dev] = d
	}
	return d, nil
}

func maxSplitStat(v uint64) int64 {
	if v == 0 {
		return -1
	}
	return int64(v)
}

// LiveBlock describes a block still allocated, as Close reports it.
type LiveBlock struct {
	Device    int    `json:"device"`
	Addr      uint64 `json:"addr"`
	Size      uint64 `json:"size"`
	Requested uint64 `json:"requested"`
	Stream    Stream `json:"stream"`
}

// CloseReport is what Close found and did.
type CloseReport struct {
	LiveBlocks    []LiveBlock // blocks callers never freed
	LiveBytes     uint64      // their rounded sizes, summed
	SegmentsFreed int
	BytesFreed    uint64
}

// Close returns every segment to the backend, including segments that still
// hold live blocks (their addresses become invalid), destroys the pool's
// events, and reports the blocks callers never freed. Every later call on
// the pool fails with ErrClosed. Freed blocks still waiting for the work of
// other streams (RecordStream) are waited for first when the backend is an
// EventSynchronizer, outside a capture.
//
// The pool is closed even when Close fails. A segment the backend refuses to
// free is not forgotten: the pool keeps it (Stats still counts it as
// reserved) and Close returns the backend's error. Calling Close again
// retries exactly those segments, reporting only what it frees this time
// (the live blocks were reported by the first Close), and returns nil once
// the backend took them all back. When nothing is left to give back, Close
// fails with ErrClosed, so closing a cleanly closed pool twice is an error.
// Events whose destruction fails are reported but not retried.
func (p *Pool) Close() (CloseReport, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var rep CloseReport
	if p.closed {
		if len(p.unreleased) == 0 {
			return rep, fmt.Errorf("close pool %q: %w", p.name, ErrClosed)
		}
		return rep, p.freeUnreleasedLocked(&rep)
	}
	p.closed = true
	p.live.all(func(b *block) {
		rep.LiveBlocks = append(rep.LiveBlocks, LiveBlock{
			Device: b.seg.device, Addr: b.addr, Size: b.size, Requested: b.requested, Stream: b.seg.stream})
		rep.LiveBytes += b.size
	})
	sortLiveBlocks(rep.LiveBlocks)
	var errs []error
	for _, d := range p.devices {
		if d == nil {
			continue
		}
		// Blocks whose frees wait for other streams may still be in use
		// there: wait for that work before their segments go. (Not during a
		// capture, which forbids it; a pool closed then frees at once.)
		waiter, wait := p.backend.(EventSynchronizer)
		wait = wait && !p.capturingLocked()
		d.allPending(func(pf pendingFree) {
			if wait {
				if err := waiter.SynchronizeEvent(pf.event); err != nil {
					errs = append(errs, fmt.Errorf("close pool %q: wait for the streams of the block at %#x: %w",
						p.name, pf.block.addr, err))
				}
			}
			d.events = append(d.events, pf.event)
		})
		d.pending = nil
		d.unrecorded = nil
		for _, ev := range d.events {
			if err := p.backend.DestroyEvent(ev); err != nil {
				errs = append(errs, fmt.Errorf("close pool %q: destroy event: %w", p.name, err))
			}
		}
		d.events = nil
		first := len(p.unreleased)
		for _, s := range d.segments {
			s.first, s.last = nil, nil // the blocks die with the pool
			p.unreleased = append(p.unreleased, s)
		}
		slices.SortFunc(p.unreleased[first:], func(a, b *segment) int { return cmp.Compare(a.addr, b.addr) })
		d.segments = nil
		d.streams = nil
		d.wholeFree = nil
		d.growing = nil
		d.lastFree = nil
	}
	p.live = liveIndex{}
	p.spare = nil
	errs = append(errs, p.freeUnreleasedLocked(&rep))
	return rep, errors.Join(errs...)
}

// freeUnreleasedLocked gives the segments of a closed pool back to the
// backend, keeping those whose Free fails for a later Close.
func (p *Pool) freeUnreleasedLocked(rep *CloseReport) error {
	var errs []error
	kept := p.unreleased[:0]
	for _, s := range p.unreleased {
		d := p.devices[s.device]
		if err := p.backend.Free(d.id, s.addr, s.size, s.stream); err != nil {
			errs = append(errs, fmt.Errorf("close pool %q: free segment %#x (%d bytes) on device %d: %w",
				p.name, s.addr, s.size, d.id, err))
			kept = append(kept, s)
			continue
		}
		rep.SegmentsFreed++
		rep.BytesFreed += s.size
		d.stats.NumDeviceFree++
		d.countSegment(s, -1)
		p.addReserved(d, s.kind, -int64(s.mapped()))
		p.uncountOversize(d, s)
	}
	clear(p.unreleased[len(kept):])
	p.unreleased = kept
	if len(kept) == 0 {
		p.unreleased = nil
	}
	return errors.Join(errs...)
}

func sortLiveBlocks(bs []LiveBlock) {
	sort.Slice(bs, func(i, j int) bool {
		if bs[i].Device != bs[j].Device {
			return bs[i].Device < bs[j].Device
		}
		return bs[i].Addr < bs[j].Addr
	})
}
