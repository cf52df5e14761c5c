package gocore

import (
	"sync"
	"sync/atomic"
)

// Budget holds the byte limits of one or more pools over one backend and
// counts what they reserve together, per device. Every pool has one: its
// own, made by NewPool from Config.Limit, unless Config.Budget names a
// budget to share. Torch's CUDA graphs get private pools of their own
// (bindings/cabi) that share the budget of the pool torch allocates from,
// so that the pool's limit (and torch's set_per_process_memory_fraction)
// holds for the pool and its graphs together, as torch's limit holds for
// its whole allocator.
//
// Reserved bytes are counted with atomics and limits kept under a mutex of
// their own: a pool reads them while holding its lock, and pools sharing a
// budget are locked independently, so the budget must never wait on one.
type Budget struct {
	reserved []atomic.Int64 // by device

	mu          sync.Mutex
	limit       uint64
	deviceLimit map[int]uint64 // overrides limit for single devices; 0 means none
}

// NewBudget returns a budget for devices devices with limit bytes each (0:
// none).
func NewBudget(devices int, limit uint64) *Budget {
	return &Budget{reserved: make([]atomic.Int64, devices), limit: limit}
}

// Limit reports the byte limit of device (0: none).
func (b *Budget) Limit(device int) uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	if l, ok := b.deviceLimit[device]; ok {
		return l
	}
	return b.limit
}

// defaultLimit is the limit of devices without one of their own.
func (b *Budget) defaultLimit() uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.limit
}

// setLimit sets every device's limit, dropping per-device ones.
func (b *Budget) setLimit(limit uint64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.limit = limit
	b.deviceLimit = nil
}

// setDeviceLimit sets one device's limit.
func (b *Budget) setDeviceLimit(device int, limit uint64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.deviceLimit == nil {
		b.deviceLimit = make(map[int]uint64)
	}
	b.deviceLimit[device] = limit
}

// Reserved reports the bytes the budget's pools reserve on device.
func (b *Budget) Reserved(device int) uint64 {
	if device < 0 || device >= len(b.reserved) {
		return 0
	}
	return uint64(b.reserved[device].Load())
}

// add counts delta more reserved bytes on device.
func (b *Budget) add(device int, delta int64) {
	if device >= 0 && device < len(b.reserved) {
		b.reserved[device].Add(delta)
	}
}

// reserve counts n more reserved bytes on device if that keeps it within
// its limit, checking and counting in one step: pools sharing the budget
// allocate at once, each under its own lock. It reports false, counting
// nothing, when the limit would be passed. A pool reserves before it asks
// the backend and gives the bytes back (add) if the backend fails.
func (b *Budget) reserve(device int, n uint64) bool {
	if device < 0 || device >= len(b.reserved) {
		return false
	}
	l := b.Limit(device)
	r := &b.reserved[device]
	for {
		cur := r.Load()
		if l != 0 && uint64(cur)+n > l {
			return false
		}
		if r.CompareAndSwap(cur, cur+int64(n)) {
			return true
		}
	}
}
