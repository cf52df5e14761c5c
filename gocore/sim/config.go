package sim

import (
	"fmt"
	"math"
	"math/bits"
	"math/rand/v2"
	"time"

	"github.com/gpumempool/gpumempool/gocore"
)

// Defaults applied by New to zero-valued Config fields.
const (
	// DefaultCapacity is the per-device capacity used when
	// Config.Capacity is 0 (80 GiB, an H100's worth).
	DefaultCapacity uint64 = 80 << 30
	// DefaultAlignment is the address alignment used when
	// Config.Alignment is 0.
	DefaultAlignment uint64 = 512
	// DefaultBase is the start of the simulated address space used when
	// Config.Base is 0.
	DefaultBase uint64 = 0x7f0000000000
)

// Config configures a Backend. The zero value is a usable single-device
// backend with 80 GiB of memory, 512-byte alignment, no latency, no injected
// failures and events that complete immediately.
type Config struct {
	// Devices is the number of simulated devices (1 when 0; negative is an
	// error).
	Devices int `option:"devices" zero:"default" doc:"number of simulated devices"`
	// Capacity is the number of bytes each device can hand out
	// (DefaultCapacity when 0).
	Capacity uint64 `option:"capacity" zero:"default" doc:"bytes each device can hand out"`
	// Alignment is the alignment of every returned address and the unit to
	// which sizes are rounded in the address space (DefaultAlignment when
	// 0). It must be a power of two.
	Alignment uint64 `option:"alignment" zero:"default" doc:"alignment of every address, a power of two"`
	// Base is the first address of device 0's range (DefaultBase when 0).
	// It must be a multiple of Alignment. Device d's range starts at
	// Base + d*stride, where the stride is at least 1 TiB and at least twice
	// the rounded capacity (with Expandable, at least ExpandableSegments
	// reservations), so device ranges never overlap.
	Base uint64
	// Latency is added to every Alloc and Free call (time.Sleep above 50µs,
	// a busy-wait below). It is never spent while holding the backend's lock.
	Latency time.Duration `option:"latency_ns" doc:"nanoseconds added to every Alloc and Free"`
	// FailOnNthAlloc makes the Nth call to Alloc (1-based, counting every
	// call) fail with an error wrapping gocore.ErrBackendOutOfMemory; 0
	// disables it.
	FailOnNthAlloc int `option:"fail_on_nth_alloc" doc:"the Nth Alloc (1-based) runs out of memory; 0: none"`
	// FailRate is the probability in [0, 1] with which an otherwise valid
	// Alloc fails with an error wrapping gocore.ErrBackendOutOfMemory.
	FailRate float64 `option:"fail_rate" type:"probability" doc:"probability that an Alloc runs out of memory"`
	// Seed seeds the random source behind FailRate and FreeFailRate, so that
	// equal seeds give equal failure sequences for equal call sequences.
	Seed int64 `option:"seed" doc:"seed of the failures drawn by fail_rate and free_fail_rate"`
	// FreeFailRate is the probability in [0, 1] with which an otherwise valid
	// Free fails with a plain error (not gocore.ErrBackendOutOfMemory); the
	// segment then stays live.
	FreeFailRate float64 `option:"free_fail_rate" type:"probability" doc:"probability that a Free fails"`
	// ManualEvents makes recorded events complete only when the test calls
	// CompleteStream or CompleteAll. When false, every event is complete as
	// soon as it is recorded.
	ManualEvents bool `option:"manual_events" doc:"events complete only when the test completes their stream"`
	// Expandable makes the backend a gocore.Expander, gocore.Shrinker and
	// gocore.PageMapper: every segment reserves address space for 1 1/8 times the device's
	// capacity (in whole 20 MiB pages), as torch reserves for an
	// expandable segment, so that the engine can map pages into it (at its
	// end or into holes it unmapped) up to anything the device can back. A
	// device's range holds ExpandableSegments such reservations.
	Expandable bool `option:"expandable" doc:"segments grow in place (like CUDA expandable segments)"`
	// Granularity is the mapping unit of expandable segments
	// (DefaultGranularity, or Alignment if larger, when 0; a multiple of
	// Alignment). The engine maps torch's pages (2 MiB in the small pool,
	// 20 MiB in the large one), rounded up to whole granules.
	Granularity uint64 `option:"granularity" zero:"default" doc:"mapping unit of expandable segments"`
}

// OptionDefaults says what leaving out each option whose 0 means "the
// default" gives (options.Defaulter: the schema of the sim backend).
func (Config) OptionDefaults() map[string]string {
	return map[string]string{
		"devices":     "1",
		"capacity":    gocore.FormatBytes(DefaultCapacity),
		"alignment":   fmt.Sprint(DefaultAlignment),
		"granularity": gocore.FormatBytes(DefaultGranularity) + ", or the alignment if larger",
	}
}

// DefaultGranularity is the growth unit of expandable sim segments, the
// usual CUDA VMM granularity.
const DefaultGranularity uint64 = 2 << 20

// ExpandableSegments is how many segments an expandable Backend can
// at least hold on one device at once: its address range is sized for that
// many reservations of the device's capacity (rounded up to a whole number
// of TiB). Beyond what fits, Alloc fails with an error wrapping
// gocore.ErrBackendOutOfMemory, like an exhausted address space.
const ExpandableSegments = 4096

// ConfigError is the error New returns for a Config it
// refuses: Field names the Config field, Value is its value as given and
// Reason says what is wrong with it. It matches gocore.ErrInvalidArgument
// (errors.Is). Every check of a Config lives in New, so a caller
// that maps its own option names onto Config fields (the bindings) can
// name the offending option from Field.
type ConfigError struct {
	Field  string
	Value  any
	Reason string
}

// Error says which field is wrong and why.
func (e *ConfigError) Error() string {
	return fmt.Sprintf("sim: invalid config: %s %v %s", e.Field, e.Value, e.Reason)
}

// Unwrap makes errors.Is(err, gocore.ErrInvalidArgument) hold.
func (e *ConfigError) Unwrap() error { return gocore.ErrInvalidArgument }

func configErr(field string, value any, reason string) error {
	return &ConfigError{Field: field, Value: value, Reason: reason}
}

// validRate reports whether r is a probability.
func validRate(r float64) bool {
	return !math.IsNaN(r) && r >= 0 && r <= 1
}

// New validates cfg, applies its defaults and returns a backend
// with every device empty.
func New(cfg Config) (*Backend, error) {
	if cfg.Devices < 0 || cfg.Devices > gocore.MaxDevices {
		return nil, configErr("Devices", cfg.Devices, fmt.Sprintf("is not in [0, %d]", gocore.MaxDevices))
	}
	if cfg.Devices == 0 {
		cfg.Devices = 1
	}
	if cfg.Capacity == 0 {
		cfg.Capacity = DefaultCapacity
	}
	if cfg.Alignment == 0 {
		cfg.Alignment = DefaultAlignment
	}
	if cfg.Alignment&(cfg.Alignment-1) != 0 {
		return nil, configErr("Alignment", cfg.Alignment, "is not a power of two")
	}
	if cfg.Base == 0 {
		// The default base is 1 TiB-aligned; round it up for larger
		// alignments.
		base, ok := alignUp(DefaultBase, cfg.Alignment)
		if !ok {
			return nil, configErr("Alignment", cfg.Alignment, "is too large for the address space")
		}
		cfg.Base = base
	}
	if cfg.Base%cfg.Alignment != 0 {
		return nil, configErr("Base", fmt.Sprintf("%#x", cfg.Base), fmt.Sprintf("is not a multiple of Alignment %d", cfg.Alignment))
	}
	if cfg.Granularity == 0 {
		cfg.Granularity = max(DefaultGranularity, cfg.Alignment)
	}
	if cfg.Granularity%cfg.Alignment != 0 {
		return nil, configErr("Granularity", cfg.Granularity, fmt.Sprintf("is not a multiple of Alignment %d", cfg.Alignment))
	}
	if cfg.Latency < 0 {
		return nil, configErr("Latency", cfg.Latency, "is negative")
	}
	if cfg.FailOnNthAlloc < 0 {
		return nil, configErr("FailOnNthAlloc", cfg.FailOnNthAlloc, "is negative")
	}
	if !validRate(cfg.FailRate) {
		return nil, configErr("FailRate", cfg.FailRate, "is not a probability in [0, 1]")
	}
	if !validRate(cfg.FreeFailRate) {
		return nil, configErr("FreeFailRate", cfg.FreeFailRate, "is not a probability in [0, 1]")
	}

	// Each device gets a range of stride bytes: at least 1 TiB and at least
	// twice the rounded capacity (slack against fragmentation), rounded to a
	// multiple of 1 TiB and of the alignment.
	if hi, _ := bits.Mul64(cfg.Capacity, 2); hi != 0 {
		return nil, configErr("Capacity", cfg.Capacity, "is too large for the address space")
	}
	capRounded, ok := alignUp(cfg.Capacity, cfg.Alignment)
	hi, twice := bits.Mul64(capRounded, 2)
	if !ok || hi != 0 { // the capacity fits: rounded up to the alignment it does not
		return nil, configErr("Alignment", cfg.Alignment,
			fmt.Sprintf("is too large for the address space (Capacity %d rounded up to it)", cfg.Capacity))
	}
	minStride := max(twice, deviceStride)
	var reserve uint64
	if cfg.Expandable {
		// Every segment reserves what torch reserves for an expandable
		// segment, 1 1/8 times the capacity (room to map pages again
		// after holes were unmapped earlier in it), rounded up to whole
		// 20 MiB pages of whole granules (a multiple of the alignment, not
		// necessarily a power of two), and the range holds
		// ExpandableSegments of them.
		unit := (gocore.LargeBuffer + cfg.Granularity - 1) / cfg.Granularity * cfg.Granularity
		want := capRounded + capRounded/8
		units := want / unit
		if want%unit != 0 {
			units++
		}
		hi, r := bits.Mul64(units, unit)
		hi2, all := bits.Mul64(r, ExpandableSegments)
		if hi != 0 || hi2 != 0 {
			return nil, configErr("Capacity", cfg.Capacity,
				fmt.Sprintf("is too large for the address space of %d expandable segments", ExpandableSegments))
		}
		reserve = r
		minStride = max(minStride, all)
	}
	stride, ok := alignUp(minStride, max(deviceStride, cfg.Alignment))
	if !ok {
		return nil, configErr("Capacity", cfg.Capacity, "is too large for the address space")
	}
	hi, span := bits.Mul64(stride, uint64(cfg.Devices))
	_, carry := bits.Add64(cfg.Base, span, 0)
	if hi != 0 || carry != 0 {
		return nil, configErr("Devices", cfg.Devices,
			fmt.Sprintf("overflow the address space (ranges of %d bytes from Base %#x)", stride, cfg.Base))
	}

	b := &Backend{
		cfg:       cfg,
		stride:    stride,
		reserve:   reserve,
		rng:       rand.New(rand.NewPCG(uint64(cfg.Seed), uint64(cfg.Seed)^0x9e3779b97f4a7c15)),
		devices:   make([]deviceState, cfg.Devices),
		streams:   make(map[streamKey]*streamState),
		events:    make(map[gocore.Event]*eventState),
		nextEvent: 1,
		manual:    cfg.ManualEvents,
	}
	for d := range b.devices {
		start := cfg.Base + uint64(d)*stride
		b.devices[d] = deviceState{
			free:     []freeRange{{start: start, end: start + stride}},
			live:     make(map[uint64]uint64),
			reserved: make(map[uint64]uint64),
			holes:    make(map[uint64]uint64),
		}
	}
	return b, nil
}
