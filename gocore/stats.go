package gocore

// Stat is one counter in torch's memory_stats() shape.
type Stat struct {
	Current, Peak, Allocated, Freed int64
}

func (s *Stat) add(n int64) {
	if n >= 0 {
		s.up(n)
	} else {
		s.down(-n)
	}
}

// up counts n >= 0 more: with no branch, as the allocation path calls it
// about ten times per request.
func (s *Stat) up(n int64) {
	c := s.Current + n
	s.Current = c
	s.Allocated += n
	if c > s.Peak {
		s.Peak = c
	}
}

// down counts n >= 0 fewer.
func (s *Stat) down(n int64) {
	s.Current -= n
	s.Freed += n
}

// swap counts out fewer and then in more (both >= 0) in one pass: the same
// counts, peak included, as down(out) followed by up(in).
func (s *Stat) swap(out, in int64) {
	c := s.Current - out + in
	s.Current = c
	s.Allocated += in
	s.Freed += out
	if c > s.Peak {
		s.Peak = c
	}
}

// StatArray holds a Stat for all blocks, the small pool and the large pool,
// in that order (torch's StatType: AGGREGATE, SMALL_POOL, LARGE_POOL).
type StatArray [3]Stat

func (a *StatArray) add(k poolKind, n int64) {
	a[0].add(n)
	a[k].add(n)
}

func (a *StatArray) up(k poolKind, n int64) {
	a[0].up(n)
	a[k].up(n)
}

func (a *StatArray) down(k poolKind, n int64) {
	a[0].down(n)
	a[k].down(n)
}

func (a *StatArray) swap(k poolKind, out, in int64) {
	a[0].swap(out, in)
	a[k].swap(out, in)
}

// Stats are a pool's statistics on one device (or summed over devices), with
// the meanings of torch.cuda.memory_stats().
type Stats struct {
	Allocation          StatArray // blocks handed to callers
	Segment             StatArray // segments obtained from the backend
	Active              StatArray // allocated blocks plus freed ones awaiting events
	InactiveSplit       StatArray // free blocks inside partly used segments (not expandable ones, as torch)
	AllocatedBytes      StatArray
	ReservedBytes       StatArray
	ActiveBytes         StatArray
	InactiveSplitBytes  StatArray
	RequestedBytes      StatArray // callers' sizes before rounding, of active blocks (as ActiveBytes)
	OversizeAllocations Stat      // allocations of blocks >= MaxSplitSize
	OversizeSegments    Stat      // segments >= MaxSplitSize

	NumAllocRetries int64 // allocations that released the cache and retried
	NumOOMs         int64 // allocations that failed with OutOfMemoryError
	NumDeviceAlloc  int64 // Backend.Alloc and Expander.Expand calls that succeeded
	NumDeviceFree   int64 // Backend.Free calls that succeeded, and Shrinker.Shrink calls that gave memory back
	NumCacheHits    int64 // allocations served without a Backend.Alloc
	NumRecordStream int64 // RecordStream calls that added a stream use
	NumExpansions   int64 // segments grown in place (Expander backends)
	NumGCReleases   int64 // segments released by garbage collection
	// NumSyncAllStreams counts the waits for every free pending on other
	// streams (EmptyCache and the out-of-memory retry), as torch counts
	// its synchronize_and_free_events.
	NumSyncAllStreams int64
	MaxSplitSize      int64 // the pool's option, -1 when unlimited
}

// statArrays lists the StatArrays of s, in a fixed order.
func (s *Stats) statArrays() [9]*StatArray {
	return [...]*StatArray{&s.Allocation, &s.Segment, &s.Active, &s.InactiveSplit,
		&s.AllocatedBytes, &s.ReservedBytes, &s.ActiveBytes, &s.InactiveSplitBytes, &s.RequestedBytes}
}

// singleStats lists the Stats of s that are not in a StatArray.
func (s *Stats) singleStats() [2]*Stat {
	return [...]*Stat{&s.OversizeAllocations, &s.OversizeSegments}
}

// Merge adds o into s. Peaks are summed, which bounds the peak of the sum:
// per-device peaks need not have happened at the same moment.
func (s *Stats) Merge(o *Stats) {
	others := o.statArrays()
	for i, a := range s.statArrays() {
		for k := range a {
			mergeStat(&a[k], &others[i][k])
		}
	}
	otherSingles := o.singleStats()
	for i, st := range s.singleStats() {
		mergeStat(st, otherSingles[i])
	}
	s.NumAllocRetries += o.NumAllocRetries
	s.NumOOMs += o.NumOOMs
	s.NumGCReleases += o.NumGCReleases
	s.NumDeviceAlloc += o.NumDeviceAlloc
	s.NumDeviceFree += o.NumDeviceFree
	s.NumCacheHits += o.NumCacheHits
	s.NumRecordStream += o.NumRecordStream
	s.NumExpansions += o.NumExpansions
	s.NumSyncAllStreams += o.NumSyncAllStreams
	s.MaxSplitSize = o.MaxSplitSize
}

// Retired returns s as it reads once the pool has given every segment back
// (with no block allocated): each current count becomes freed, peaks and
// totals stay, and the segments count as device frees. Pools that are
// closed but whose history still counts (a CUDA graph's private pool) keep
// their counters monotonic this way.
func (s Stats) Retired() Stats {
	s.NumDeviceFree += s.Segment[0].Current
	retire := func(st *Stat) {
		st.Freed += st.Current
		st.Current = 0
	}
	for _, a := range s.statArrays() {
		for k := range a {
			retire(&a[k])
		}
	}
	for _, st := range s.singleStats() {
		retire(st)
	}
	return s
}

func mergeStat(a, b *Stat) {
	a.Current += b.Current
	a.Peak += b.Peak
	a.Allocated += b.Allocated
	a.Freed += b.Freed
}

// ToMap flattens the stats with torch's key names, e.g.
// "allocated_bytes.all.current" or "num_alloc_retries".
func (s *Stats) ToMap() map[string]int64 {
	m := make(map[string]int64, 128)
	named := []struct {
		name string
		arr  *StatArray
	}{
		{"allocation", &s.Allocation}, {"segment", &s.Segment}, {"active", &s.Active},
		{"inactive_split", &s.InactiveSplit}, {"allocated_bytes", &s.AllocatedBytes},
		{"reserved_bytes", &s.ReservedBytes}, {"active_bytes", &s.ActiveBytes},
		{"inactive_split_bytes", &s.InactiveSplitBytes}, {"requested_bytes", &s.RequestedBytes},
	}
	for _, n := range named {
		for k, pool := range [...]string{"all", "small_pool", "large_pool"} {
			putStat(m, n.name+"."+pool, &n.arr[k])
		}
	}
	putStat(m, "oversize_allocations", &s.OversizeAllocations)
	putStat(m, "oversize_segments", &s.OversizeSegments)
	m["num_alloc_retries"] = s.NumAllocRetries
	m["num_ooms"] = s.NumOOMs
	m["num_device_alloc"] = s.NumDeviceAlloc
	m["num_device_free"] = s.NumDeviceFree
	m["num_cache_hits"] = s.NumCacheHits
	m["num_record_stream"] = s.NumRecordStream
	m["num_expansions"] = s.NumExpansions
	m["num_gc_releases"] = s.NumGCReleases
	m["max_split_size"] = s.MaxSplitSize
	m["num_sync_all_streams"] = s.NumSyncAllStreams
	return m
}

func putStat(m map[string]int64, prefix string, s *Stat) {
	m[prefix+".current"] = s.Current
	m[prefix+".peak"] = s.Peak
	m[prefix+".allocated"] = s.Allocated
	m[prefix+".freed"] = s.Freed
}
