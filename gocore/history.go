package gocore

import "time"

// Trace actions, named as in torch's device_traces.
const (
	ActionAlloc         = "alloc"
	ActionFreeRequested = "free_requested"
	ActionFreeCompleted = "free_completed"
	ActionSegmentAlloc  = "segment_alloc"
	ActionSegmentFree   = "segment_free"
	ActionSegmentMap    = "segment_map"   // an expandable segment grew
	ActionSegmentUnmap  = "segment_unmap" // an expandable segment gave its free tail back
	ActionOOM           = "oom"
	ActionRecordStream  = "record_stream" // ours: a block used on another stream
	// ActionEmptyCache and ActionTrim are ours too: a call of EmptyCache or
	// Trim, from Go, Python or torch's C hook alike, recorded once the call
	// has released what it could (after the entries of its releases), so
	// that a trace imported from the history replays the call where it was
	// made. Device is the device trimmed, or AllDevices; a trim's Size is
	// its keep bytes. Torch records neither: it shows its empty_cache only
	// as the segment_free entries it caused.
	ActionEmptyCache = "empty_cache"
	ActionTrim       = "trim"
)

// AllDevices is the Device of an entry about every device of the pool (an
// EmptyCache, a Trim of every device).
const AllDevices = -1

// TraceEntry is one recorded allocator event.
type TraceEntry struct {
	Action string `json:"action"`
	Device int    `json:"device"`
	Addr   uint64 `json:"addr"`
	Size   uint64 `json:"size"`
	Stream uint64 `json:"stream"`
	TimeUS int64  `json:"time_us"`
	// DeviceFree is the backend's free memory, on "oom" entries.
	DeviceFree uint64 `json:"device_free,omitempty"`
	// CallerSized marks "alloc" entries of AllocSegment: a replay must
	// size their segments as the recording did.
	CallerSized bool `json:"caller_sized,omitempty"`
	// Thread is the OS thread that made the call which recorded the entry,
	// with RecordThreads on (else 0, as where the platform does not say):
	// the Python API notes the stack
	// of each of its calls by thread and time, and gives every entry of a
	// call that call's stack, as torch gives each trace entry the context
	// of the call that made it.
	Thread int `json:"thread,omitempty"`
}

// history is a ring buffer of trace entries; nil when recording is off, so
// the hot path pays one nil check.
type history struct {
	entries []TraceEntry
	next    int
	full    bool
}

// RecordHistory turns event recording on (keeping at most maxEntries, the
// oldest dropped first) or off (dropping what was recorded). Turning it on
// while it is on keeps what was recorded (the newest maxEntries of it), as
// torch's _record_memory_history does.
func (p *Pool) RecordHistory(enabled bool, maxEntries int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !enabled || maxEntries <= 0 {
		p.hist = nil
		return
	}
	var kept []TraceEntry
	if p.hist != nil {
		kept = p.historyLocked()
		kept = kept[max(0, len(kept)-maxEntries):]
	}
	h := &history{entries: make([]TraceEntry, 0, min(maxEntries, max(1<<16, len(kept))))}
	h.entries = append(h.entries, kept...)
	p.hist = h
	p.histMax = maxEntries
}

// RecordThreads makes the history's entries name the OS thread of the call
// that made each (TraceEntry.Thread), or stops it: a system call per entry,
// paid only by those who match entries to their calls (the Python API's
// stacks).
func (p *Pool) RecordThreads(on bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.histThreads = on
}

// History returns the recorded events, oldest first.
func (p *Pool) History() []TraceEntry {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.historyLocked()
}

func (p *Pool) historyLocked() []TraceEntry {
	h := p.hist
	if h == nil {
		return nil
	}
	if !h.full {
		return append([]TraceEntry(nil), h.entries...)
	}
	out := make([]TraceEntry, 0, len(h.entries))
	out = append(out, h.entries[h.next:]...)
	return append(out, h.entries[:h.next]...)
}

// trace records an event if recording is on and returns the stored entry
// (for extra fields), else nil; the pool's lock is held. Small enough to be
// inlined: with recording off the hot path pays one nil check per event.
func (p *Pool) trace(action string, dev int, addr, size uint64, stream Stream) *TraceEntry {
	if p.hist == nil {
		return nil
	}
	return p.record(action, dev, addr, size, stream)
}

// record is trace with recording on.
func (p *Pool) record(action string, dev int, addr, size uint64, stream Stream) *TraceEntry {
	h := p.hist
	e := TraceEntry{Action: action, Device: dev, Addr: addr, Size: size, Stream: uint64(stream), TimeUS: time.Now().UnixMicro()}
	if p.histThreads {
		e.Thread = callerThread()
	}
	if len(h.entries) < p.histMax {
		h.entries = append(h.entries, e)
		return &h.entries[len(h.entries)-1]
	}
	i := h.next
	h.entries[i] = e
	h.next = (h.next + 1) % len(h.entries)
	h.full = true
	return &h.entries[i]
}
