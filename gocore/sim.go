package gocore

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
	"math/rand/v2"
	"slices"
	"sort"
	"sync"
	"time"
)

// Defaults applied by NewSimBackend to zero-valued SimConfig fields.
const (
	// DefaultSimCapacity is the per-device capacity used when
	// SimConfig.Capacity is 0 (80 GiB, an H100's worth).
	DefaultSimCapacity uint64 = 80 << 30
	// DefaultSimAlignment is the address alignment used when
	// SimConfig.Alignment is 0.
	DefaultSimAlignment uint64 = 512
	// DefaultSimBase is the start of the simulated address space used when
	// SimConfig.Base is 0.
	DefaultSimBase uint64 = 0x7f0000000000
)

// simDeviceStride is the minimum distance between the address ranges of two
// consecutive simulated devices (1 TiB).
const simDeviceStride uint64 = 1 << 40

// simSpinThreshold is the latency below which the simulator busy-waits
// instead of sleeping, because time.Sleep is too coarse for short delays.
const simSpinThreshold = 50 * time.Microsecond

// SimConfig configures a SimBackend. The zero value is a usable single-device
// backend with 80 GiB of memory, 512-byte alignment, no latency, no injected
// failures and events that complete immediately.
type SimConfig struct {
	// Devices is the number of simulated devices (1 when 0; negative is an
	// error).
	Devices int `option:"devices" zero:"default" doc:"number of simulated devices"`
	// Capacity is the number of bytes each device can hand out
	// (DefaultSimCapacity when 0).
	Capacity uint64 `option:"capacity" zero:"default" doc:"bytes each device can hand out"`
	// Alignment is the alignment of every returned address and the unit to
	// which sizes are rounded in the address space (DefaultSimAlignment when
	// 0). It must be a power of two.
	Alignment uint64 `option:"alignment" zero:"default" doc:"alignment of every address, a power of two"`
	// Base is the first address of device 0's range (DefaultSimBase when 0).
	// It must be a multiple of Alignment. Device d's range starts at
	// Base + d*stride, where the stride is at least 1 TiB and at least twice
	// the rounded capacity (with Expandable, at least SimExpandableSegments
	// reservations), so device ranges never overlap.
	Base uint64
	// Latency is added to every Alloc and Free call (time.Sleep above 50µs,
	// a busy-wait below). It is never spent while holding the backend's lock.
	Latency time.Duration `option:"latency_ns" doc:"nanoseconds added to every Alloc and Free"`
	// FailOnNthAlloc makes the Nth call to Alloc (1-based, counting every
	// call) fail with an error wrapping ErrBackendOutOfMemory; 0 disables it.
	FailOnNthAlloc int `option:"fail_on_nth_alloc" doc:"the Nth Alloc (1-based) runs out of memory; 0: none"`
	// FailRate is the probability in [0, 1] with which an otherwise valid
	// Alloc fails with an error wrapping ErrBackendOutOfMemory.
	FailRate float64 `option:"fail_rate" type:"probability" doc:"probability that an Alloc runs out of memory"`
	// Seed seeds the random source behind FailRate and FreeFailRate, so that
	// equal seeds give equal failure sequences for equal call sequences.
	Seed int64 `option:"seed" doc:"seed of the failures drawn by fail_rate and free_fail_rate"`
	// FreeFailRate is the probability in [0, 1] with which an otherwise valid
	// Free fails with a plain error (not ErrBackendOutOfMemory); the segment
	// then stays live.
	FreeFailRate float64 `option:"free_fail_rate" type:"probability" doc:"probability that a Free fails"`
	// ManualEvents makes recorded events complete only when the test calls
	// CompleteStream or CompleteAll. When false, every event is complete as
	// soon as it is recorded.
	ManualEvents bool `option:"manual_events" doc:"events complete only when the test completes their stream"`
	// Expandable makes the backend an Expander, Shrinker and PageMapper:
	// every segment reserves address space for 1 1/8 times the device's
	// capacity (in whole 20 MiB pages), as torch reserves for an
	// expandable segment, so that the engine can map pages into it (at its
	// end or into holes it unmapped) up to anything the device can back. A
	// device's range holds SimExpandableSegments such reservations.
	Expandable bool `option:"expandable" doc:"segments grow in place (like CUDA expandable segments)"`
	// Granularity is the mapping unit of expandable segments
	// (DefaultSimGranularity, or Alignment if larger, when 0; a multiple of
	// Alignment). The engine maps torch's pages (2 MiB in the small pool,
	// 20 MiB in the large one), rounded up to whole granules.
	Granularity uint64 `option:"granularity" zero:"default" doc:"mapping unit of expandable segments"`
}

// OptionDefaults says what leaving out each option whose 0 means "the
// default" gives (options.Defaulter: the schema of the sim backend).
func (SimConfig) OptionDefaults() map[string]string {
	return map[string]string{
		"devices":     "1",
		"capacity":    FormatBytes(DefaultSimCapacity),
		"alignment":   fmt.Sprint(DefaultSimAlignment),
		"granularity": FormatBytes(DefaultSimGranularity) + ", or the alignment if larger",
	}
}

// DefaultSimGranularity is the growth unit of expandable sim segments, the
// usual CUDA VMM granularity.
const DefaultSimGranularity uint64 = 2 << 20

// SimExpandableSegments is how many segments an expandable SimBackend can
// at least hold on one device at once: its address range is sized for that
// many reservations of the device's capacity (rounded up to a whole number
// of TiB). Beyond what fits, Alloc fails with an error wrapping
// ErrBackendOutOfMemory, like an exhausted address space.
const SimExpandableSegments = 4096

// SimStats is a snapshot of a SimBackend's counters.
type SimStats struct {
	// Allocs counts Alloc calls that succeeded.
	Allocs uint64
	// Frees counts Free calls that succeeded.
	Frees uint64
	// FailedAllocs counts Alloc calls that returned an error, injected or not.
	FailedAllocs uint64
	// FailedFrees counts Free calls that returned an error, injected or not.
	FailedFrees uint64
	// LiveSegments is the number of allocated, not yet freed segments over
	// all devices.
	LiveSegments int
	// LiveBytes is the sum of the requested sizes of the live segments over
	// all devices.
	LiveBytes uint64
	// EventsCreated counts successful NewEvent calls.
	EventsCreated uint64
	// EventsDestroyed counts successful DestroyEvent calls.
	EventsDestroyed uint64
	// EventWaits counts SynchronizeEvent calls that found the event's work
	// not yet completed (and completed it).
	EventWaits uint64
	// LiveEvents is the number of events created and not yet destroyed.
	LiveEvents int
	// Expansions counts successful Expand calls.
	Expansions uint64
	// Shrinks counts successful Shrink calls.
	Shrinks uint64
	// Unmaps and Maps count successful Unmap and Map calls.
	Unmaps, Maps uint64
	// Placed counts Allocs that returned the address PlaceNext asked for.
	Placed uint64
}

// SimSegment describes one live segment of a SimBackend.
type SimSegment struct {
	// Device is the device the segment lives on.
	Device int
	// Addr is the segment's start address as returned by Alloc.
	Addr uint64
	// Size is the size requested from Alloc (not rounded).
	Size uint64
}

// simRange is a half-open free address range [start, end).
type simRange struct {
	start, end uint64
}

// simDevice is the per-device state of a SimBackend.
type simDevice struct {
	used uint64            // sum of requested sizes of live segments
	free []simRange        // sorted, coalesced free address ranges
	live map[uint64]uint64 // segment start -> requested size
	// reserved maps a segment start to the address space it holds when the
	// backend is expandable (at least the rounded size).
	reserved map[uint64]uint64
	// holes maps a segment start to the bytes inside it that Unmap gave
	// back (and Map has not mapped again); they are not in used.
	holes map[uint64]uint64
	// place is the address PlaceNext asked for the next segment of
	// placeSize bytes (placeSize 0: none).
	place, placeSize uint64
}

// simStreamKey identifies a stream on a device.
type simStreamKey struct {
	device int
	stream Stream
}

// simStream holds a stream's submitted and completed work counters.
type simStream struct {
	submitted, completed uint64
}

// simEvent is the state behind an Event handle.
type simEvent struct {
	device   int
	recorded bool
	stream   Stream
	seq      uint64
}

// SimBackend is a simulated device Backend for tests and demos. It hands out
// aligned, non-overlapping addresses from a per-device address range,
// enforces a per-device capacity, can inject allocation and free failures,
// and lets tests control when stream work (and so events) completes. It is
// safe for concurrent use.
type SimBackend struct {
	cfg    SimConfig // normalized
	stride uint64
	// reserve is the address space each expandable segment reserves:
	// torch's, 1 1/8 times the capacity in whole pages.
	reserve uint64

	mu        sync.Mutex
	rng       *rand.Rand
	allocSeen uint64 // number of Alloc calls so far
	devices   []simDevice
	streams   map[simStreamKey]*simStream
	events    map[Event]*simEvent
	nextEvent Event
	manual    bool
	stats     SimStats // counters only; live fields are computed
}

var (
	_ Backend    = (*SimBackend)(nil)
	_ Expander   = (*SimBackend)(nil)
	_ Shrinker   = (*SimBackend)(nil)
	_ PageMapper = (*SimBackend)(nil)
)

// SimConfigError is the error NewSimBackend returns for a SimConfig it
// refuses: Field names the SimConfig field, Value is its value as given and
// Reason says what is wrong with it. It matches ErrInvalidArgument
// (errors.Is). Every check of a SimConfig lives in NewSimBackend, so a caller
// that maps its own option names onto SimConfig fields (the bindings) can
// name the offending option from Field.
type SimConfigError struct {
	Field  string
	Value  any
	Reason string
}

// Error says which field is wrong and why.
func (e *SimConfigError) Error() string {
	return fmt.Sprintf("sim: invalid config: %s %v %s", e.Field, e.Value, e.Reason)
}

// Unwrap makes errors.Is(err, ErrInvalidArgument) hold.
func (e *SimConfigError) Unwrap() error { return ErrInvalidArgument }

func simConfigErr(field string, value any, reason string) error {
	return &SimConfigError{Field: field, Value: value, Reason: reason}
}

// simValidRate reports whether r is a probability.
func simValidRate(r float64) bool {
	return !math.IsNaN(r) && r >= 0 && r <= 1
}

// simAlignUp rounds v up to a multiple of the power of two a, reporting false
// on overflow.
func simAlignUp(v, a uint64) (uint64, bool) {
	r, carry := bits.Add64(v, a-1, 0)
	if carry != 0 {
		return 0, false
	}
	return r &^ (a - 1), true
}

// NewSimBackend validates cfg, applies its defaults and returns a backend
// with every device empty.
func NewSimBackend(cfg SimConfig) (*SimBackend, error) {
	if cfg.Devices < 0 || cfg.Devices > MaxDevices {
		return nil, simConfigErr("Devices", cfg.Devices, fmt.Sprintf("is not in [0, %d]", MaxDevices))
	}
	if cfg.Devices == 0 {
		cfg.Devices = 1
	}
	if cfg.Capacity == 0 {
		cfg.Capacity = DefaultSimCapacity
	}
	if cfg.Alignment == 0 {
		cfg.Alignment = DefaultSimAlignment
	}
	if cfg.Alignment&(cfg.Alignment-1) != 0 {
		return nil, simConfigErr("Alignment", cfg.Alignment, "is not a power of two")
	}
	if cfg.Base == 0 {
		// The default base is 1 TiB-aligned; round it up for larger
		// alignments.
		base, ok := simAlignUp(DefaultSimBase, cfg.Alignment)
		if !ok {
			return nil, simConfigErr("Alignment", cfg.Alignment, "is too large for the address space")
		}
		cfg.Base = base
	}
	if cfg.Base%cfg.Alignment != 0 {
		return nil, simConfigErr("Base", fmt.Sprintf("%#x", cfg.Base), fmt.Sprintf("is not a multiple of Alignment %d", cfg.Alignment))
	}
	if cfg.Granularity == 0 {
		cfg.Granularity = max(DefaultSimGranularity, cfg.Alignment)
	}
	if cfg.Granularity%cfg.Alignment != 0 {
		return nil, simConfigErr("Granularity", cfg.Granularity, fmt.Sprintf("is not a multiple of Alignment %d", cfg.Alignment))
	}
	if cfg.Latency < 0 {
		return nil, simConfigErr("Latency", cfg.Latency, "is negative")
	}
	if cfg.FailOnNthAlloc < 0 {
		return nil, simConfigErr("FailOnNthAlloc", cfg.FailOnNthAlloc, "is negative")
	}
	if !simValidRate(cfg.FailRate) {
		return nil, simConfigErr("FailRate", cfg.FailRate, "is not a probability in [0, 1]")
	}
	if !simValidRate(cfg.FreeFailRate) {
		return nil, simConfigErr("FreeFailRate", cfg.FreeFailRate, "is not a probability in [0, 1]")
	}

	// Each device gets a range of stride bytes: at least 1 TiB and at least
	// twice the rounded capacity (slack against fragmentation), rounded to a
	// multiple of 1 TiB and of the alignment.
	if hi, _ := bits.Mul64(cfg.Capacity, 2); hi != 0 {
		return nil, simConfigErr("Capacity", cfg.Capacity, "is too large for the address space")
	}
	capRounded, ok := simAlignUp(cfg.Capacity, cfg.Alignment)
	hi, twice := bits.Mul64(capRounded, 2)
	if !ok || hi != 0 { // the capacity fits: rounded up to the alignment it does not
		return nil, simConfigErr("Alignment", cfg.Alignment,
			fmt.Sprintf("is too large for the address space (Capacity %d rounded up to it)", cfg.Capacity))
	}
	minStride := max(twice, simDeviceStride)
	var reserve uint64
	if cfg.Expandable {
		// Every segment reserves what torch reserves for an expandable
		// segment, 1 1/8 times the capacity (room to map pages again
		// after holes were unmapped earlier in it), rounded up to whole
		// 20 MiB pages of whole granules (a multiple of the alignment, not
		// necessarily a power of two), and the range holds
		// SimExpandableSegments of them.
		unit := (LargeBuffer + cfg.Granularity - 1) / cfg.Granularity * cfg.Granularity
		want := capRounded + capRounded/8
		units := want / unit
		if want%unit != 0 {
			units++
		}
		hi, r := bits.Mul64(units, unit)
		hi2, all := bits.Mul64(r, SimExpandableSegments)
		if hi != 0 || hi2 != 0 {
			return nil, simConfigErr("Capacity", cfg.Capacity,
				fmt.Sprintf("is too large for the address space of %d expandable segments", SimExpandableSegments))
		}
		reserve = r
		minStride = max(minStride, all)
	}
	stride, ok := simAlignUp(minStride, max(simDeviceStride, cfg.Alignment))
	if !ok {
		return nil, simConfigErr("Capacity", cfg.Capacity, "is too large for the address space")
	}
	hi, span := bits.Mul64(stride, uint64(cfg.Devices))
	_, carry := bits.Add64(cfg.Base, span, 0)
	if hi != 0 || carry != 0 {
		return nil, simConfigErr("Devices", cfg.Devices,
			fmt.Sprintf("overflow the address space (ranges of %d bytes from Base %#x)", stride, cfg.Base))
	}

	b := &SimBackend{
		cfg:       cfg,
		stride:    stride,
		reserve:   reserve,
		rng:       rand.New(rand.NewPCG(uint64(cfg.Seed), uint64(cfg.Seed)^0x9e3779b97f4a7c15)),
		devices:   make([]simDevice, cfg.Devices),
		streams:   make(map[simStreamKey]*simStream),
		events:    make(map[Event]*simEvent),
		nextEvent: 1,
		manual:    cfg.ManualEvents,
	}
	for d := range b.devices {
		start := cfg.Base + uint64(d)*stride
		b.devices[d] = simDevice{
			free:     []simRange{{start: start, end: start + stride}},
			live:     make(map[uint64]uint64),
			reserved: make(map[uint64]uint64),
			holes:    make(map[uint64]uint64),
		}
	}
	return b, nil
}

// Config returns the backend's configuration with defaults applied.
func (b *SimBackend) Config() SimConfig { return b.cfg }

// Name returns "sim".
func (b *SimBackend) Name() string { return "sim" }

// Devices returns the configured number of devices.
func (b *SimBackend) Devices() int { return b.cfg.Devices }

// Alignment returns the configured alignment of returned addresses.
func (b *SimBackend) Alignment() uint64 { return b.cfg.Alignment }

// checkDevice returns an error if device is not a valid ordinal.
func (b *SimBackend) checkDevice(op string, device int) error {
	if device < 0 || device >= b.cfg.Devices {
		return fmt.Errorf("sim: %s: invalid device %d (backend has %d devices)", op, device, b.cfg.Devices)
	}
	return nil
}

// Capacity returns the device's capacity and the bytes not in live segments.
func (b *SimBackend) Capacity(device int) (total, free uint64, err error) {
	if err := b.checkDevice("capacity", device); err != nil {
		return 0, 0, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.cfg.Capacity, b.cfg.Capacity - b.devices[device].used, nil
}

// UsedBytes returns the sum of the requested sizes of device's live
// segments, or 0 for an invalid device.
func (b *SimBackend) UsedBytes(device int) uint64 {
	if device < 0 || device >= b.cfg.Devices {
		return 0
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.devices[device].used
}

// delay spends the configured latency without holding the lock.
func (b *SimBackend) delay() {
	d := b.cfg.Latency
	if d <= 0 {
		return
	}
	if d > simSpinThreshold {
		time.Sleep(d)
		return
	}
	start := time.Now()
	for time.Since(start) < d {
	}
}

// Alloc returns the start of a new segment of size bytes on device. The
// address is aligned to Alignment and the segment, rounded up to Alignment,
// overlaps no other live segment. Errors caused by exhausted capacity or by
// injected failures (FailOnNthAlloc, FailRate) wrap ErrBackendOutOfMemory.
// The stream is ignored: the simulator's allocations are synchronous.
func (b *SimBackend) Alloc(device int, size uint64, stream Stream) (addr uint64, err error) {
	b.delay()
	b.mu.Lock()
	defer b.mu.Unlock()
	b.allocSeen++
	addr, err = b.allocLocked(device, size)
	if err != nil {
		b.stats.FailedAllocs++
		return 0, err
	}
	b.stats.Allocs++
	return addr, nil
}

// allocLocked does Alloc's work; b.mu must be held.
func (b *SimBackend) allocLocked(device int, size uint64) (uint64, error) {
	if err := b.checkDevice("alloc", device); err != nil {
		return 0, err
	}
	if size == 0 {
		return 0, fmt.Errorf("sim: alloc on device %d: size is 0", device)
	}
	if n := b.cfg.FailOnNthAlloc; n > 0 && b.allocSeen == uint64(n) {
		return 0, fmt.Errorf("sim: alloc of %d bytes on device %d: injected failure on alloc call %d: %w",
			size, device, n, ErrBackendOutOfMemory)
	}
	if b.cfg.FailRate > 0 && b.rng.Float64() < b.cfg.FailRate {
		return 0, fmt.Errorf("sim: alloc of %d bytes on device %d: injected failure (FailRate %v): %w",
			size, device, b.cfg.FailRate, ErrBackendOutOfMemory)
	}
	dev := &b.devices[device]
	if size > b.cfg.Capacity-dev.used {
		return 0, fmt.Errorf("sim: alloc of %d bytes on device %d: %d of %d bytes in use: %w",
			size, device, dev.used, b.cfg.Capacity, ErrBackendOutOfMemory)
	}
	// size <= Capacity, whose rounding was checked not to overflow.
	rounded, _ := simAlignUp(size, b.cfg.Alignment)
	span := rounded
	if b.cfg.Expandable {
		span = max(rounded, b.reserve)
	}
	addr, ok := uint64(0), false
	if dev.placeSize == size {
		// One try: a placement that cannot be honoured (its range is taken)
		// is dropped, and this segment goes where first fit puts it.
		addr, ok = dev.takeAt(dev.place, span)
		dev.place, dev.placeSize = 0, 0
		if ok {
			b.stats.Placed++
		}
	}
	if !ok {
		addr, ok = dev.takeFirstFit(span)
	}
	if !ok {
		return 0, fmt.Errorf("sim: alloc of %d bytes on device %d: no contiguous free address range (%d of %d bytes in use): %w",
			size, device, dev.used, b.cfg.Capacity, ErrBackendOutOfMemory)
	}
	if b.cfg.Expandable {
		dev.reserved[addr] = span
	}
	dev.live[addr] = size
	dev.used += size
	return addr, nil
}

// takeFirstFit removes span bytes from the lowest free range that holds
// them and returns their start.
func (dev *simDevice) takeFirstFit(span uint64) (uint64, bool) {
	for i := range dev.free {
		r := &dev.free[i]
		if r.end-r.start < span {
			continue
		}
		addr := r.start
		r.start += span
		if r.start == r.end {
			dev.free = slices.Delete(dev.free, i, i+1)
		}
		return addr, true
	}
	return 0, false
}

// takeAt removes [addr, addr+span) from the free ranges if one free range
// holds all of it.
func (dev *simDevice) takeAt(addr, span uint64) (uint64, bool) {
	end, carry := bits.Add64(addr, span, 0)
	if carry != 0 {
		return 0, false
	}
	// i is the last free range that starts at or before addr.
	i := sort.Search(len(dev.free), func(i int) bool { return dev.free[i].start > addr }) - 1
	if i < 0 || dev.free[i].end < end {
		return 0, false
	}
	r := dev.free[i]
	switch {
	case r.start == addr && r.end == end:
		dev.free = slices.Delete(dev.free, i, i+1)
	case r.start == addr:
		dev.free[i].start = end
	case r.end == end:
		dev.free[i].end = addr
	default:
		dev.free[i].end = addr
		dev.free = slices.Insert(dev.free, i+1, simRange{start: end, end: r.end})
	}
	return addr, true
}

// PlaceNext asks that the next segment of exactly size bytes that Alloc
// hands out on device start offset bytes into the device's placement
// window: the upper half of its address range. First fit allocates from the
// bottom of the range, so it leaves the window to placed segments, whose
// addresses keep the order their offsets have. Replay uses it to give
// segments the relative addresses the recording allocator's device gave
// them: best fit breaks ties between free blocks of equal size by address,
// so the order of segments decides which block is reused.
//
// The placement holds for one Alloc of that size on device (Allocs of other
// sizes leave it); if its range is not free then, or lies beyond the window,
// that segment is placed by first fit instead. size 0 withdraws the
// placement. offset must be a multiple of Alignment.
func (b *SimBackend) PlaceNext(device int, offset, size uint64) error {
	if err := b.checkDevice("place next segment", device); err != nil {
		return err
	}
	if offset%b.cfg.Alignment != 0 {
		return fmt.Errorf("sim: place next segment on device %d at offset %#x: not a multiple of the alignment %d: %w",
			device, offset, b.cfg.Alignment, ErrInvalidArgument)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	dev := &b.devices[device]
	if size == 0 {
		dev.place, dev.placeSize = 0, 0
		return nil
	}
	start, half := b.placementWindow(device)
	if offset >= half {
		// Beyond the window: nothing can go there; first fit will serve it.
		dev.place, dev.placeSize = 0, 0
		return nil
	}
	dev.place, dev.placeSize = start+offset, size
	return nil
}

// placementWindow returns the start and size of device's placement window,
// the upper half of its range (stride is a multiple of 1 TiB and of the
// alignment, so the middle is aligned unless the alignment is the whole
// stride; then the window is empty).
func (b *SimBackend) placementWindow(device int) (start, size uint64) {
	lo := b.cfg.Base + uint64(device)*b.stride
	mid, _ := simAlignUp(lo+b.stride/2, b.cfg.Alignment) // below the range's end, which is aligned
	return mid, lo + b.stride - mid
}

// Free releases the segment at addr on device, which must be the start of a
// live segment allocated with exactly size bytes; otherwise Free returns an
// error and changes nothing. With FreeFailRate, a valid Free may fail with a
// plain error, leaving the segment live.
func (b *SimBackend) Free(device int, addr, size uint64, stream Stream) error {
	b.delay()
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.freeLocked(device, addr, size); err != nil {
		b.stats.FailedFrees++
		return err
	}
	b.stats.Frees++
	return nil
}

// errSimInjectedFreeFailure is wrapped by injected Free failures.
var errSimInjectedFreeFailure = errors.New("injected free failure")

// freeLocked does Free's work; b.mu must be held.
func (b *SimBackend) freeLocked(device int, addr, size uint64) error {
	if err := b.checkDevice("free", device); err != nil {
		return err
	}
	dev := &b.devices[device]
	liveSize, ok := dev.live[addr]
	if !ok {
		return fmt.Errorf("sim: free of %#x on device %d: not the start of a live segment", addr, device)
	}
	if liveSize != size {
		return fmt.Errorf("sim: free of %#x on device %d: size %d does not match allocated size %d",
			addr, device, size, liveSize)
	}
	if b.cfg.FreeFailRate > 0 && b.rng.Float64() < b.cfg.FreeFailRate {
		return fmt.Errorf("sim: free of %#x (%d bytes) on device %d: %w (FreeFailRate %v)",
			addr, size, device, errSimInjectedFreeFailure, b.cfg.FreeFailRate)
	}
	span, _ := simAlignUp(size, b.cfg.Alignment)
	if r, ok := dev.reserved[addr]; ok {
		span = r
		delete(dev.reserved, addr)
	}
	delete(dev.live, addr)
	dev.used -= size - dev.holes[addr]
	delete(dev.holes, addr)
	dev.release(addr, addr+span)
	return nil
}

// Expandable reports whether the backend grows segments in place
// (SimConfig.Expandable).
func (b *SimBackend) Expandable() bool { return b.cfg.Expandable }

// Granularity is the unit segments grow by.
func (b *SimBackend) Granularity() uint64 { return b.cfg.Granularity }

// Expand grows the live segment [addr, addr+size) by extra bytes within the
// address space it reserved. Running out of capacity or of reserved space
// wraps ErrBackendOutOfMemory; the segment is then unchanged.
func (b *SimBackend) Expand(device int, addr, size, extra uint64, stream Stream) error {
	b.delay()
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.checkDevice("expand", device); err != nil {
		return err
	}
	dev := &b.devices[device]
	if !b.cfg.Expandable {
		return fmt.Errorf("sim: expand %#x on device %d: backend is not expandable: %w", addr, device, ErrUnsupported)
	}
	if got, ok := dev.live[addr]; !ok || got != size {
		return fmt.Errorf("sim: expand %#x on device %d: not a live segment of %d bytes", addr, device, size)
	}
	if extra == 0 || extra%b.cfg.Granularity != 0 {
		return fmt.Errorf("sim: expand %#x on device %d by %d bytes: not a positive multiple of the granularity %d",
			addr, device, extra, b.cfg.Granularity)
	}
	if extra > b.cfg.Capacity-dev.used {
		b.stats.FailedAllocs++
		return fmt.Errorf("sim: expand %#x on device %d by %d bytes: %d of %d bytes in use: %w",
			addr, device, extra, dev.used, b.cfg.Capacity, ErrBackendOutOfMemory)
	}
	if grown, _ := simAlignUp(size+extra, b.cfg.Alignment); grown > dev.reserved[addr] {
		b.stats.FailedAllocs++
		return fmt.Errorf("sim: expand %#x on device %d to %d bytes: beyond its %d reserved bytes: %w",
			addr, device, size+extra, dev.reserved[addr], ErrBackendOutOfMemory)
	}
	dev.live[addr] = size + extra
	dev.used += extra
	b.stats.Expansions++
	return nil
}

// Shrink gives back the last less bytes of the live segment
// [addr, addr+size) (a Shrinker): the segment keeps its reserved address
// space and may grow again. less must be a positive multiple of the
// granularity smaller than size; the sim always gives back all of it.
func (b *SimBackend) Shrink(device int, addr, size, less uint64, stream Stream) (uint64, error) {
	b.delay()
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.checkDevice("shrink", device); err != nil {
		return 0, err
	}
	dev := &b.devices[device]
	if !b.cfg.Expandable {
		return 0, fmt.Errorf("sim: shrink %#x on device %d: backend is not expandable: %w", addr, device, ErrUnsupported)
	}
	if got, ok := dev.live[addr]; !ok || got != size {
		return 0, fmt.Errorf("sim: shrink %#x on device %d: not a live segment of %d bytes", addr, device, size)
	}
	if less == 0 || less%b.cfg.Granularity != 0 || less >= size {
		return 0, fmt.Errorf("sim: shrink %#x (%d bytes) on device %d by %d bytes: not a positive multiple of the granularity %d below the size",
			addr, size, device, less, b.cfg.Granularity)
	}
	dev.live[addr] = size - less
	dev.used -= less
	b.stats.Shrinks++
	return less, nil
}

// Unmap gives back the n bytes at offset off of the live segment
// [addr, addr+size) (a PageMapper), keeping its address range: a hole the
// segment may map again with Map. off and n must be multiples of the
// granularity, the range inside the segment; the sim counts a segment's
// unmapped bytes, not where they lie.
func (b *SimBackend) Unmap(device int, addr, size, off, n uint64, stream Stream) error {
	b.delay()
	b.mu.Lock()
	defer b.mu.Unlock()
	dev, err := b.pageRangeLocked("unmap", device, addr, size, off, n)
	if err != nil {
		return err
	}
	if n > size-dev.holes[addr] {
		return fmt.Errorf("sim: unmap %d bytes of %#x on device %d: only %d of its %d bytes are mapped",
			n, addr, device, size-dev.holes[addr], size)
	}
	dev.holes[addr] += n
	dev.used -= n
	b.stats.Unmaps++
	return nil
}

// Map maps the n bytes at offset off of the live segment [addr, addr+size)
// again, after Unmap gave them back (a PageMapper). Running out of
// capacity wraps ErrBackendOutOfMemory; the segment is then unchanged.
func (b *SimBackend) Map(device int, addr, size, off, n uint64, stream Stream) error {
	b.delay()
	b.mu.Lock()
	defer b.mu.Unlock()
	dev, err := b.pageRangeLocked("map", device, addr, size, off, n)
	if err != nil {
		return err
	}
	if n > dev.holes[addr] {
		return fmt.Errorf("sim: map %d bytes of %#x on device %d: only %d of its bytes are unmapped",
			n, addr, device, dev.holes[addr])
	}
	if n > b.cfg.Capacity-dev.used {
		b.stats.FailedAllocs++
		return fmt.Errorf("sim: map %d bytes of %#x on device %d: %d of %d bytes in use: %w",
			n, addr, device, dev.used, b.cfg.Capacity, ErrBackendOutOfMemory)
	}
	dev.holes[addr] -= n
	dev.used += n
	b.stats.Maps++
	return nil
}

// pageRangeLocked checks the arguments of Unmap and Map: an expandable
// backend, a live segment of size bytes at addr, and a positive range of
// whole granules inside it.
func (b *SimBackend) pageRangeLocked(op string, device int, addr, size, off, n uint64) (*simDevice, error) {
	if err := b.checkDevice(op, device); err != nil {
		return nil, err
	}
	if !b.cfg.Expandable {
		return nil, fmt.Errorf("sim: %s in %#x on device %d: backend is not expandable: %w", op, addr, device, ErrUnsupported)
	}
	dev := &b.devices[device]
	if got, ok := dev.live[addr]; !ok || got != size {
		return nil, fmt.Errorf("sim: %s in %#x on device %d: not a live segment of %d bytes", op, addr, device, size)
	}
	g := b.cfg.Granularity
	if n == 0 || off%g != 0 || n%g != 0 || off > size || n > size-off {
		return nil, fmt.Errorf("sim: %s %d bytes at offset %d of %#x (%d bytes) on device %d: not a range of whole granules of %d inside it",
			op, n, off, addr, size, device, g)
	}
	return dev, nil
}

// release returns [start, end) to the device's free list, coalescing it with
// adjacent free ranges.
func (dev *simDevice) release(start, end uint64) {
	// i is the first free range that starts at or after end.
	i := sort.Search(len(dev.free), func(i int) bool { return dev.free[i].start >= end })
	mergePrev := i > 0 && dev.free[i-1].end == start
	mergeNext := i < len(dev.free) && dev.free[i].start == end
	switch {
	case mergePrev && mergeNext:
		dev.free[i-1].end = dev.free[i].end
		dev.free = slices.Delete(dev.free, i, i+1)
	case mergePrev:
		dev.free[i-1].end = end
	case mergeNext:
		dev.free[i].start = start
	default:
		dev.free = slices.Insert(dev.free, i, simRange{start: start, end: end})
	}
}

// NewEvent creates an unrecorded event on device. Querying an unrecorded
// event reports it done, as CUDA does.
func (b *SimBackend) NewEvent(device int) (Event, error) {
	if err := b.checkDevice("new event", device); err != nil {
		return 0, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	ev := b.nextEvent
	b.nextEvent++
	b.events[ev] = &simEvent{device: device}
	b.stats.EventsCreated++
	return ev, nil
}

// lookupEventLocked returns ev's state or an error naming op; b.mu must be
// held.
func (b *SimBackend) lookupEventLocked(op string, ev Event) (*simEvent, error) {
	e, ok := b.events[ev]
	if ok {
		return e, nil
	}
	if ev != 0 && ev < b.nextEvent {
		return nil, fmt.Errorf("sim: %s: event %d was destroyed", op, ev)
	}
	return nil, fmt.Errorf("sim: %s: unknown event %d", op, ev)
}

// streamLocked returns the state of stream on device, creating it; b.mu
// must be held.
func (b *SimBackend) streamLocked(device int, stream Stream) *simStream {
	k := simStreamKey{device: device, stream: stream}
	s, ok := b.streams[k]
	if !ok {
		s = &simStream{}
		b.streams[k] = s
	}
	return s
}

// RecordEvent captures the work submitted so far to stream (on ev's device)
// into ev: it counts one more submission on the stream and remembers it. In
// manual mode the event stays pending until CompleteStream or CompleteAll;
// otherwise it completes at once. Recording again replaces the capture.
func (b *SimBackend) RecordEvent(ev Event, stream Stream) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	e, err := b.lookupEventLocked("record event", ev)
	if err != nil {
		return err
	}
	s := b.streamLocked(e.device, stream)
	s.submitted++
	if !b.manual {
		s.completed = s.submitted
	}
	e.recorded = true
	e.stream = stream
	e.seq = s.submitted
	return nil
}

// QueryEvent reports whether the work captured by ev has completed.
func (b *SimBackend) QueryEvent(ev Event) (done bool, err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	e, err := b.lookupEventLocked("query event", ev)
	if err != nil {
		return false, err
	}
	if !e.recorded {
		return true, nil
	}
	return b.streamLocked(e.device, e.stream).completed >= e.seq, nil
}

// SynchronizeEvent waits for the work captured by ev: the simulated device
// completes the work submitted to ev's stream up to ev (in manual mode that
// is how a wait ends; otherwise it had completed already).
func (b *SimBackend) SynchronizeEvent(ev Event) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	e, err := b.lookupEventLocked("synchronize event", ev)
	if err != nil {
		return err
	}
	if !e.recorded {
		return nil
	}
	if s := b.streamLocked(e.device, e.stream); s.completed < e.seq {
		s.completed = e.seq
		b.stats.EventWaits++
	}
	return nil
}

// DestroyEvent releases ev; destroying an unknown or already destroyed
// event is an error.
func (b *SimBackend) DestroyEvent(ev Event) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, err := b.lookupEventLocked("destroy event", ev); err != nil {
		return err
	}
	delete(b.events, ev)
	b.stats.EventsDestroyed++
	return nil
}

// CompleteStream marks all work submitted so far to stream s, on every
// device, as completed, so events recorded on it report done.
func (b *SimBackend) CompleteStream(s Stream) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for k, st := range b.streams {
		if k.stream == s {
			st.completed = st.submitted
		}
	}
}

// CompleteAll marks all work submitted so far to every stream as completed.
func (b *SimBackend) CompleteAll() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.completeAllLocked()
}

// completeAllLocked does CompleteAll's work; b.mu must be held.
func (b *SimBackend) completeAllLocked() {
	for _, st := range b.streams {
		st.completed = st.submitted
	}
}

// SetManualEvents switches between manual event completion (true) and
// immediate completion (false). Switching to false completes all pending
// work.
func (b *SimBackend) SetManualEvents(manual bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.manual = manual
	if !manual {
		b.completeAllLocked()
	}
}

// ManualEvents reports whether events currently complete only on
// CompleteStream or CompleteAll.
func (b *SimBackend) ManualEvents() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.manual
}

// Stats returns a snapshot of the backend's counters.
func (b *SimBackend) Stats() SimStats {
	b.mu.Lock()
	defer b.mu.Unlock()
	st := b.stats
	for d := range b.devices {
		st.LiveSegments += len(b.devices[d].live)
		st.LiveBytes += b.devices[d].used
	}
	st.LiveEvents = len(b.events)
	return st
}

// LiveSegmentsList returns every live segment sorted by device, then
// address; it is empty when nothing leaks.
func (b *SimBackend) LiveSegmentsList() []SimSegment {
	b.mu.Lock()
	defer b.mu.Unlock()
	var segs []SimSegment
	for d := range b.devices {
		for addr, size := range b.devices[d].live {
			segs = append(segs, SimSegment{Device: d, Addr: addr, Size: size})
		}
	}
	slices.SortFunc(segs, func(x, y SimSegment) int {
		if x.Device != y.Device {
			return x.Device - y.Device
		}
		switch {
		case x.Addr < y.Addr:
			return -1
		case x.Addr > y.Addr:
			return 1
		}
		return 0
	})
	return segs
}
