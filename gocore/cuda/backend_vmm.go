package cuda

import (
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"sort"
	"sync"
	"syscall"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/cuda/driver"
)

// Values of VMMOptions.Location and VMMOptions.Granularity.
const (
	VMMLocationDevice         = "device"      // device memory of the segment's device
	VMMLocationHostNUMA       = "host_numa"   // host memory of one NUMA node (EGM)
	VMMGranularityRecommended = "recommended" // CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
	VMMGranularityMinimum     = "minimum"     // CU_MEM_ALLOC_GRANULARITY_MINIMUM
)

// VMMOptions configures a VMMBackend. The zero value maps device memory of
// the segment's device, accessible by that device only, in the recommended
// granularity, not expandable and not exportable.
type VMMOptions struct {
	// Location is where the physical memory lives: VMMLocationDevice
	// (default; the device the engine asks for) or VMMLocationHostNUMA (host
	// memory of NUMANode, mapped for the device: EGM on Grace systems;
	// needs a CUDA 12.2 driver or newer).
	Location string `option:"location" doc:"where the memory lives: device (default) or host_numa"`
	// NUMANode is the host NUMA node of VMMLocationHostNUMA memory (the
	// device's closest one is CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID). It must be
	// 0 with VMMLocationDevice.
	NUMANode int `option:"numa_node" min:"0" max:"2147483647" doc:"the NUMA node of host_numa memory"`
	// AccessDevices are peers granted read/write access to every segment,
	// besides the device it belongs to.
	AccessDevices []int `option:"access_devices" type:"device" doc:"devices that may read and write every segment, besides its own"`
	// Expandable makes the backend a gocore.Expander: each segment reserves
	// ReserveBytes of address space and the engine grows it in place, like
	// torch's expandable_segments, and (gocore.Shrinker) gives the chunks
	// at its free end back when it releases cached memory.
	Expandable bool `option:"expandable" doc:"segments grow in place and give their free end back"`
	// ReserveBytes is the address space reserved per expandable segment (at
	// least the segment's size, rounded up to the granularity); 0 means the
	// device's total memory. Unused unless Expandable. One too close to 2^64
	// to be rounded up makes Alloc fail with gocore.ErrInvalidArgument.
	ReserveBytes uint64 `option:"reserve_bytes" doc:"address space an expandable segment reserves (default: the device's memory)"`
	// Granularity picks the allocation granularity sizes are rounded to:
	// VMMGranularityRecommended (default) or VMMGranularityMinimum.
	Granularity string `option:"granularity" doc:"recommended (default) or minimum allocation granularity"`
	// IPC requests physical memory exportable as POSIX file descriptors, for
	// ExportSegment and ImportVMM in another process.
	IPC bool `option:"ipc" doc:"memory exportable to other processes (POSIX file descriptors)"`
}

// VMMBackend is a gocore.Backend named "vmm" whose segments are built with
// CUDA's virtual memory management API: physical memory from cuMemCreate
// (pinned, in the configured location), mapped with cuMemMap into an
// address range from cuMemAddressReserve, and made readable and writable
// with cuMemSetAccess for the segment's device and VMMOptions.AccessDevices.
// That gives control the other backends lack: peer access per allocation,
// host NUMA (EGM) memory, exportable memory, and segments that grow in place
// and give their free end back (gocore.Expander and gocore.Shrinker, when
// VMMOptions.Expandable).
//
// Sizes are rounded up to the device's granularity (2 MiB on current GPUs).
// The engine's segment sizes are multiples of 2 MiB (gocore.SmallBuffer,
// LargeBuffer, RoundLarge, and the Granularity of expandable segments), so
// the rounding is normally a no-op; when it is not, the backend maps the
// rounded size but the segment keeps the engine's size, and Free unmaps
// what was mapped.
//
// Events, devices and capacity are those of the cuda backend (Backend). It
// is safe for concurrent use; driver calls run without the backend's lock.
type VMMBackend struct {
	*Events    // the cu backend's
	cu         *Backend
	drv        *driver.Driver
	opts       VMMOptions // normalized: defaults filled in, AccessDevices deduplicated
	granOption int
	handleType int

	mu        sync.Mutex
	devs      []vmmDevice            // by device; filled in on first use
	gran      uint64                 // Granularity(): the coarsest of devs, DefaultVMMGranularity before any
	granKnown bool                   // some device's granularity is in gran
	totals    []uint64               // by device: total memory, for the default ReserveBytes
	segs      map[uint64]*vmmSegment // by base address (UVA: unique across devices)
	lost      []error                // teardown failures after the point of no return, for Close
	closed    bool
}

// vmmDevice is what VMMBackend learns about a device on first use.
type vmmDevice struct {
	gran uint64 // 0 until queried
	rdma bool   // allocFlags.gpuDirectRDMACapable is set
}

// DefaultVMMGranularity is what VMMBackend.Granularity reports before any
// device was used: 2 MiB, what current GPUs report for both options, and
// the unit of the engine's segment sizes.
const DefaultVMMGranularity = 2 << 20

// vmmSegment is one live segment: a reservation with physical chunks mapped
// back to back from its base.
type vmmSegment struct {
	dev      int
	base     uint64
	size     uint64 // the engine's size
	mapped   uint64 // bytes mapped from base: the chunks' sizes summed
	reserved uint64 // the reservation's size
	chunks   []vmmChunk
	// What is in flight on the segment. A Free or a Shrink excludes
	// everything else (both unmap and release chunks, whose handles exports
	// read and whose tail an Expand extends); an Expand excludes another
	// Expand; exports may overlap an Expand, which only appends a chunk once
	// it is mapped, and each other.
	freeing   bool
	shrinking bool
	expanding bool
	exporting int
}

// vmmChunk is one cuMemCreate allocation mapped at base+offset.
type vmmChunk struct {
	handle, offset, size uint64
}

var (
	_ gocore.Backend  = (*VMMBackend)(nil)
	_ gocore.Expander = (*VMMBackend)(nil)
	_ gocore.Shrinker = (*VMMBackend)(nil)
	_ io.Closer       = (*VMMBackend)(nil)
)

// vmmSymbols are the entry points every VMMBackend needs (see asyncSymbols
// for why they are checked up front).
// cuStreamIsCapturing (CUDA 10.0, older than the VMM API) lets Free and
// Shrink tell when a capture forbids waiting for the segment's stream.
var vmmSymbols = []string{
	"cuMemGetAllocationGranularity", "cuMemCreate", "cuMemRelease", "cuMemAddressReserve",
	"cuMemAddressFree", "cuMemMap", "cuMemUnmap", "cuMemSetAccess", "cuStreamIsCapturing",
}

// NewVMMBackend validates opts and returns a VMMBackend over drv's devices.
// Invalid options (an unknown location or granularity name, a negative
// NUMA node, an access device out of range) yield an error wrapping
// gocore.ErrInvalidArgument; a driver without the VMM API one matching
// ErrDriverTooOld.
//
// No device is touched here: each device's granularity (and whether it
// takes GPUDirect RDMA memory) is queried on its first use, so that a
// process using one GPU never creates a context on another (torchrun
// ranks on cuda:LOCAL_RANK would otherwise all retain GPU 0). A failure of
// that query (e.g. host NUMA memory on a system without it) is reported
// by the first allocation.
//
// On devices whose CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
// is 1, device memory is created with allocFlags.gpuDirectRDMACapable, as
// torch's expandable segments do, so that NICs can read and write it
// (GPUDirect RDMA, e.g. NCCL over InfiniBand). Host NUMA memory is created
// without it.
func NewVMMBackend(drv *driver.Driver, opts VMMOptions) (*VMMBackend, error) {
	cu, err := NewBackend(drv)
	if err != nil {
		return nil, fmt.Errorf("vmm backend: %w", err)
	}
	opts, granOption, err := normalizeVMMOptions(opts, cu.Devices())
	if err != nil {
		return nil, err
	}
	syms := vmmSymbols
	if opts.IPC {
		syms = append(slices.Clip(syms), "cuMemExportToShareableHandle")
	}
	if err := requireSymbols(drv, "vmm backend", syms); err != nil {
		return nil, err
	}
	if opts.Location == VMMLocationHostNUMA {
		// CU_MEM_LOCATION_TYPE_HOST_NUMA is new in CUDA 12.2; an older
		// driver rejects it as an invalid value, which says nothing useful.
		if err := drv.RequireVersion("vmm backend", "host NUMA memory (CU_MEM_LOCATION_TYPE_HOST_NUMA)", 12020); err != nil {
			return nil, err
		}
	}
	b := &VMMBackend{
		Events: cu.Events, cu: cu, drv: drv, opts: opts, granOption: granOption, handleType: driver.MemHandleTypeNone,
		devs:   make([]vmmDevice, cu.Devices()),
		gran:   DefaultVMMGranularity,
		totals: make([]uint64, cu.Devices()),
		segs:   make(map[uint64]*vmmSegment),
	}
	if opts.IPC {
		b.handleType = driver.MemHandleTypePosixFD
	}
	return b, nil
}

// normalizeVMMOptions checks opts and fills in the defaults.
func normalizeVMMOptions(opts VMMOptions, devices int) (VMMOptions, int, error) {
	bad := func(format string, args ...any) (VMMOptions, int, error) {
		return VMMOptions{}, 0, fmt.Errorf("vmm backend: %s: %w", fmt.Sprintf(format, args...), gocore.ErrInvalidArgument)
	}
	switch opts.Location {
	case "":
		opts.Location = VMMLocationDevice
		fallthrough
	case VMMLocationDevice:
		if opts.NUMANode != 0 {
			return bad("NUMANode %d given with location %q (use %q for host NUMA memory)",
				opts.NUMANode, VMMLocationDevice, VMMLocationHostNUMA)
		}
	case VMMLocationHostNUMA:
		if opts.NUMANode < 0 {
			return bad("negative NUMA node %d", opts.NUMANode)
		}
	default:
		return bad("unknown location %q (want %q or %q)", opts.Location, VMMLocationDevice, VMMLocationHostNUMA)
	}
	var granOption int
	switch opts.Granularity {
	case "", VMMGranularityRecommended:
		opts.Granularity, granOption = VMMGranularityRecommended, driver.MemAllocGranularityRecommended
	case VMMGranularityMinimum:
		granOption = driver.MemAllocGranularityMinimum
	default:
		return bad("unknown granularity %q (want %q or %q)", opts.Granularity, VMMGranularityRecommended, VMMGranularityMinimum)
	}
	var access []int
	for _, d := range opts.AccessDevices {
		if d < 0 || d >= devices {
			return bad("access device %d out of range [0, %d)", d, devices)
		}
		if !slices.Contains(access, d) {
			access = append(access, d)
		}
	}
	if len(access) >= driver.MaxAccessDevices {
		return bad("%d access devices, at most %d", len(access), driver.MaxAccessDevices-1)
	}
	opts.AccessDevices = access
	return opts, granOption, nil
}

// Name returns "vmm".
func (b *VMMBackend) Name() string { return "vmm" }

// Devices returns the number of devices the driver saw when b was made.
func (b *VMMBackend) Devices() int { return b.cu.Devices() }

// Alignment returns Alignment (512). Segments start on a granularity
// boundary, far coarser; 512 is what the engine needs and what the other
// CUDA backends promise.
func (b *VMMBackend) Alignment() uint64 { return Alignment }

// Driver returns the driver b allocates through.
func (b *VMMBackend) Driver() *driver.Driver { return b.drv }

// Options returns the options b uses, defaults filled in.
func (b *VMMBackend) Options() VMMOptions {
	o := b.opts
	o.AccessDevices = slices.Clone(o.AccessDevices)
	return o
}

// Capacity reports the device's total and free memory (cuMemGetInfo_v2).
// With host NUMA memory it fails with gocore.ErrUnsupported: the segments
// do not use the device's memory, and its numbers would mislead an
// out-of-memory report.
func (b *VMMBackend) Capacity(dev int) (total, free uint64, err error) {
	if b.opts.Location == VMMLocationHostNUMA {
		return 0, 0, fmt.Errorf("vmm backend: capacity of host NUMA node %d: %w", b.opts.NUMANode, gocore.ErrUnsupported)
	}
	return b.cu.Capacity(dev)
}

// Expandable reports VMMOptions.Expandable.
func (b *VMMBackend) Expandable() bool { return b.opts.Expandable }

// Granularity is the unit the engine creates and grows expandable segments
// in: the coarsest granularity (of the option's kind, for the configured
// memory) among the devices used so far, and DefaultVMMGranularity (2 MiB)
// before any was, since asking a device would create a context on it. It
// is the same on every device of a kind in practice; a device whose
// granularity is coarser than the unit the engine used maps its segments
// in its own, rounded up, and the surplus is used by the next growth.
func (b *VMMBackend) Granularity() uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.gran
}

// prop describes the physical memory of a segment of dev; rdma sets
// GPUDirectRDMACapable (device memory only).
func (b *VMMBackend) prop(dev int, rdma bool) driver.AllocProp {
	if b.opts.Location == VMMLocationHostNUMA {
		return driver.AllocProp{LocationType: driver.MemLocationTypeHostNUMA, LocationID: b.opts.NUMANode, HandleType: b.handleType}
	}
	return driver.AllocProp{LocationType: driver.MemLocationTypeDevice, LocationID: dev, HandleType: b.handleType,
		GPUDirectRDMACapable: rdma}
}

// access lists the devices that get read/write access to dev's segments:
// dev itself, then the peers. For host NUMA memory these are device
// locations too: the driver's cuMemSetAccess documentation allows a
// CU_MEM_LOCATION_TYPE_HOST_NUMA descriptor (for CPU access) only on
// HOST_NUMA allocations, and devices reach that memory through
// CU_MEM_LOCATION_TYPE_DEVICE descriptors, as NVIDIA's EGM examples do. The
// CPU gets no access here: MemSetAccess takes devices only.
func (b *VMMBackend) access(dev int) []int {
	out := make([]int, 1, 1+len(b.opts.AccessDevices))
	out[0] = dev
	for _, d := range b.opts.AccessDevices {
		if d != dev {
			out = append(out, d)
		}
	}
	return out
}

// device returns dev's granularity and the properties of its physical
// memory, queried on first use. The queries run without the lock; two
// first users may both ask, which is harmless.
func (b *VMMBackend) device(dev int) (uint64, driver.AllocProp, error) {
	b.mu.Lock()
	d := b.devs[dev]
	b.mu.Unlock()
	if d.gran != 0 {
		return d.gran, b.prop(dev, d.rdma), nil
	}
	if b.opts.Location == VMMLocationDevice {
		v, known, err := b.attribute(dev, driver.DeviceAttrGPUDirectRDMAWithCUDAVMMSupported)
		if err != nil {
			return 0, driver.AllocProp{}, err
		}
		d.rdma = known && v == 1 // a driver older than the attribute: no RDMA flag
	}
	if b.opts.Location == VMMLocationHostNUMA {
		// Without this check the first cuMemCreate fails with a bare
		// CUDA_ERROR_INVALID_VALUE (or NOT_SUPPORTED) on such a device.
		v, known, err := b.attribute(dev, driver.DeviceAttrHostNUMAVMMSupported)
		if err != nil {
			return 0, driver.AllocProp{}, err
		}
		if known && v != 1 {
			return 0, driver.AllocProp{}, fmt.Errorf("vmm backend: device %d does not support host NUMA memory with cuMemCreate "+
				"(CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0; a container may need "+
				"NUMA support, e.g. Docker's --cap-add SYS_NICE): %w", dev, gocore.ErrUnsupported)
		}
	}
	prop := b.prop(dev, d.rdma)
	g, err := b.drv.MemGetAllocationGranularity(dev, prop, b.granOption)
	if err != nil {
		return 0, driver.AllocProp{}, fmt.Errorf("vmm backend: %w", err)
	}
	if g == 0 || g&(g-1) != 0 || g%Alignment != 0 {
		return 0, driver.AllocProp{}, fmt.Errorf("vmm backend: device %d reports granularity %d, not a power of two multiple of %d",
			dev, g, Alignment)
	}
	d.gran = g
	b.mu.Lock()
	b.devs[dev] = d
	if b.gran < g || !b.granKnown {
		b.gran = g
		b.granKnown = true
	}
	b.mu.Unlock()
	return g, prop, nil
}

// attribute reads a device attribute; known is false when the driver is
// older than the attribute (or lacks cuDeviceGetAttribute).
func (b *VMMBackend) attribute(dev, attr int) (v int, known bool, err error) {
	if !b.drv.HasSymbol("cuDeviceGetAttribute") {
		return 0, false, nil
	}
	v, err = b.drv.DeviceAttribute(dev, attr)
	var cerr *driver.Error
	switch {
	case errors.As(err, &cerr) && cerr.Code == driver.CodeInvalidValue && cerr.Op == "cuDeviceGetAttribute":
		return 0, false, nil
	case err != nil:
		return 0, false, fmt.Errorf("vmm backend: %w", err)
	}
	return v, true, nil
}

// reserveSize is how much address space a new segment of mapped bytes on
// dev reserves. A ReserveBytes too close to 2^64 to be rounded up to the
// granularity (the rounding would wrap, to a reservation of just the
// mapped bytes) is an invalid option.
func (b *VMMBackend) reserveSize(dev int, mapped, gran uint64) (uint64, error) {
	if !b.opts.Expandable {
		return mapped, nil
	}
	want := b.opts.ReserveBytes
	if want == 0 {
		b.mu.Lock()
		want = b.totals[dev]
		b.mu.Unlock()
		if want == 0 {
			_, total, err := b.drv.MemGetInfo(dev)
			if err != nil {
				return 0, fmt.Errorf("vmm backend: default reservation: %w", err)
			}
			b.mu.Lock()
			b.totals[dev] = total
			b.mu.Unlock()
			want = total
		}
	}
	if !fitsRoundUp(want, gran) {
		return 0, fmt.Errorf("vmm backend: VMMOptions.ReserveBytes %d cannot be rounded up to the granularity %d: %w",
			want, gran, gocore.ErrInvalidArgument)
	}
	return max(roundUpTo(want, gran), mapped), nil
}

// roundUpTo rounds n up to a multiple of unit; it wraps (to 0) when the
// result does not fit in 64 bits, which fitsRoundUp tells beforehand.
func roundUpTo(n, unit uint64) uint64 { return (n + unit - 1) / unit * unit }

// fitsRoundUp reports whether roundUpTo(n, unit) does not wrap.
func fitsRoundUp(n, unit uint64) bool { return n <= math.MaxUint64-(unit-1) }

// Alloc creates a segment of size bytes (rounded up to the granularity) on
// dev: cuMemCreate, cuMemAddressReserve (ReserveBytes when expandable),
// cuMemMap, cuMemSetAccess. The memory is usable by any stream once it
// returns, so stream is not used. CUDA_ERROR_OUT_OF_MEMORY matches
// gocore.ErrBackendOutOfMemory, as does a size too close to 2^64 to be
// rounded up. On any failure everything created is released.
func (b *VMMBackend) Alloc(dev int, size uint64, stream gocore.Stream) (uint64, error) {
	if err := b.usable("alloc", dev); err != nil {
		return 0, err
	}
	if size == 0 {
		return 0, fmt.Errorf("vmm backend: alloc 0 bytes on device %d: %w", dev, gocore.ErrInvalidArgument)
	}
	gran, prop, err := b.device(dev)
	if err != nil {
		return 0, err
	}
	if !fitsRoundUp(size, gran) { // no device has 16 EiB; rounding would wrap to 0
		return 0, fmt.Errorf("vmm backend: alloc %d bytes on device %d: more than can be mapped: %w",
			size, dev, gocore.ErrBackendOutOfMemory)
	}
	mapped := roundUpTo(size, gran)
	reserved, err := b.reserveSize(dev, mapped, gran)
	if err != nil {
		return 0, err
	}
	// Physical memory first: running out of it, the common failure, then
	// leaves nothing to undo.
	h, err := b.drv.MemCreate(dev, mapped, prop)
	if err != nil {
		return 0, fmt.Errorf("vmm backend: alloc %d bytes on device %d: %w", size, dev, err)
	}
	// The alignment is passed explicitly: cuMemAddressReserve documents 0
	// as "default alignment" without saying which, and cuMemMap needs
	// addresses on the granularity.
	base, err := b.drv.MemAddressReserve(dev, reserved, gran, 0)
	if err != nil {
		return 0, errors.Join(fmt.Errorf("vmm backend: alloc %d bytes on device %d: %w", size, dev, err),
			b.drv.MemRelease(dev, h))
	}
	if err := b.mapChunk(dev, base, mapped, h); err != nil {
		return 0, errors.Join(fmt.Errorf("vmm backend: alloc %d bytes on device %d: %w", size, dev, err),
			b.drv.MemRelease(dev, h), b.drv.MemAddressFree(dev, base, reserved))
	}
	b.mu.Lock()
	// A range whose Free is in flight may come back as soon as that Free
	// returned it to the driver (the Free then leaves this entry alone);
	// only a live one is a driver bug.
	if old, dup := b.segs[base]; dup && !old.freeing {
		b.mu.Unlock()
		return 0, errors.Join(fmt.Errorf("vmm backend: cuMemAddressReserve returned %#x, which is still in use", base),
			b.drv.MemUnmap(dev, base, mapped), b.drv.MemRelease(dev, h), b.drv.MemAddressFree(dev, base, reserved))
	}
	b.segs[base] = &vmmSegment{dev: dev, base: base, size: size, mapped: mapped, reserved: reserved,
		chunks: []vmmChunk{{handle: h, offset: 0, size: mapped}}}
	b.mu.Unlock()
	return base, nil
}

// mapChunk maps handle h (size bytes) at va and grants access; on failure
// it unmaps again, leaving h and the reservation to the caller.
func (b *VMMBackend) mapChunk(dev int, va, size, h uint64) error {
	if err := b.drv.MemMap(dev, va, size, 0, h); err != nil {
		return err
	}
	if err := b.drv.MemSetAccess(dev, va, size, b.access(dev)); err != nil {
		return errors.Join(err, b.drv.MemUnmap(dev, va, size))
	}
	return nil
}

// usable checks dev and that b is open.
func (b *VMMBackend) usable(op string, dev int) error {
	if err := b.cu.checkDevice(op, dev); err != nil {
		return fmt.Errorf("vmm backend: %w", err)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return fmt.Errorf("vmm backend: %s on device %d: %w", op, dev, ErrBackendClosed)
	}
	return nil
}

// The operations that claim a segment. A claim that conflicts with one in
// flight fails rather than waits: the engine never frees or grows a segment
// twice at once, so a conflict is a concurrent export, and a Free refused
// for it leaves the segment cached for a later try.
const (
	opFree   = "free"
	opShrink = "shrink"
	opExpand = "expand"
	opExport = "export segment"
)

// claim marks the live segment at base (of dev, with the engine's size
// unless size is 0) as being worked on by op.
// errSegmentBusy: another operation on the segment is in flight.
var errSegmentBusy = fmt.Errorf("a conflicting operation on the segment is in flight: %w", gocore.ErrInvalidArgument)

func (b *VMMBackend) claim(op string, dev int, base, size uint64) (*vmmSegment, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	s, ok := b.segs[base]
	if !ok || s.dev != dev || (size != 0 && s.size != size) {
		return nil, fmt.Errorf("vmm backend: %s %#x (%d bytes) on device %d: not a live segment of that size and device: %w",
			op, base, size, dev, gocore.ErrInvalidArgument)
	}
	exclusive := op == opFree || op == opShrink
	busy := s.freeing || s.shrinking || (exclusive && (s.expanding || s.exporting > 0)) || (op == opExpand && s.expanding)
	if busy {
		return nil, fmt.Errorf("vmm backend: %s %#x: %w", op, base, errSegmentBusy)
	}
	switch op {
	case opFree:
		s.freeing = true
	case opShrink:
		s.shrinking = true
	case opExpand:
		s.expanding = true
	default:
		s.exporting++
	}
	return s, nil
}

// release ends op's claim on s.
func (b *VMMBackend) release(s *vmmSegment, op string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch op {
	case opFree:
		s.freeing = false
	case opShrink:
		s.shrinking = false
	case opExpand:
		s.expanding = false
	default:
		s.exporting--
	}
}

// Expand grows the segment [addr, addr+size) on dev to size+extra bytes in
// place: it creates the missing physical memory (rounded up to the
// granularity) as a new chunk, maps it right after what is mapped, inside
// the segment's reservation, and grants it the same access. Going beyond
// the reservation, or CUDA_ERROR_OUT_OF_MEMORY, wraps
// gocore.ErrBackendOutOfMemory (the engine then falls back to a new
// segment); on any failure the segment is unchanged and whatever was
// created is released. Mapping is not stream ordered: the new memory is
// usable by every stream once Expand returns, so stream is not used.
func (b *VMMBackend) Expand(dev int, addr, size, extra uint64, stream gocore.Stream) error {
	if !b.opts.Expandable {
		return fmt.Errorf("vmm backend: expand %#x on device %d: not expandable (VMMOptions.Expandable): %w",
			addr, dev, gocore.ErrUnsupported)
	}
	if err := b.usable("expand", dev); err != nil {
		return err
	}
	if extra == 0 {
		return fmt.Errorf("vmm backend: expand %#x on device %d by 0 bytes: %w", addr, dev, gocore.ErrInvalidArgument)
	}
	gran, prop, err := b.device(dev)
	if err != nil {
		return err
	}
	s, err := b.claim(opExpand, dev, addr, size)
	if err != nil {
		return err
	}
	defer b.release(s, opExpand)
	grown := size + extra
	// Both checks come before the rounding, which wraps (to 0) within a
	// granule of 2^64; s.reserved is a multiple of gran, so once grown fits
	// in it, so does need.
	if grown < size || grown > s.reserved {
		return fmt.Errorf("vmm backend: expand %#x on device %d to %d bytes: beyond the %d bytes reserved (VMMOptions.ReserveBytes): %w",
			addr, dev, grown, s.reserved, gocore.ErrBackendOutOfMemory)
	}
	need := roundUpTo(grown, gran)
	var chunk *vmmChunk
	if need > s.mapped { // else a coarser granularity already mapped enough
		n := need - s.mapped
		h, err := b.drv.MemCreate(dev, n, prop)
		if err != nil {
			return fmt.Errorf("vmm backend: expand %#x on device %d by %d bytes: %w", addr, dev, extra, err)
		}
		if err := b.mapChunk(dev, s.base+s.mapped, n, h); err != nil {
			return errors.Join(fmt.Errorf("vmm backend: expand %#x on device %d by %d bytes: %w", addr, dev, extra, err),
				b.drv.MemRelease(dev, h))
		}
		chunk = &vmmChunk{handle: h, offset: s.mapped, size: n}
	}
	b.mu.Lock()
	s.size = grown
	if chunk != nil {
		s.chunks = append(s.chunks, *chunk)
		s.mapped = need
	}
	b.mu.Unlock()
	return nil
}

// Shrink gives back the end of the expandable segment [addr, addr+size) on
// dev (a gocore.Shrinker), as torch unmaps the free pages of its expandable
// segments: it waits for the work queued on stream (the segment's stream,
// as the engine passes it; cuMemUnmap does not wait for kernels, see Free),
// then unmaps and releases the segment's trailing chunks that lie wholly in
// the last less bytes, last first, and keeps the address reservation so
// that Expand can grow the segment there again. less must be a positive
// multiple of the segment's device's granularity below size (the engine
// asks in multiples of Granularity, which is never finer).
//
// It returns the bytes the segment shrank by: what the released chunks held
// of it, rounded up to a unit, at most less, and 0 when no whole chunk
// fits, which is common: a chunk is what one Alloc or Expand mapped, so a
// tail that ends inside a growth gives back nothing of it. The engine needs
// the answer in the granules it asked in, those of the Granularity it read;
// but Granularity is the coarsest among the devices used so far, and
// another device's first use may have raised it since. The unit is
// therefore Granularity where it divides less, and else the largest power
// of two that does: granularities are powers of two, so either is a
// multiple of what the caller read. The rounding reports more than the
// released chunks held of the segment only where the device's granularity
// is finer than the unit or the segment's size is off it (like Alloc's
// rounding): the difference stays mapped past the segment's new end, and
// the next Expand uses it.
//
// The wait is not possible during a CUDA graph capture on stream, or on the
// legacy default stream while a blocking stream of the device captures: it
// would fail and invalidate the capture. Shrink asks first
// (cuStreamIsCapturing) and then gives nothing back, failing with an error
// wrapping ErrCaptureUnderway; the engine keeps the tail for a later release.
//
// If the wait or the first unmap fails, nothing has changed and the error
// is returned. If a later unmap fails, the chunks unmapped so far are gone
// and the failing one and those before it stay mapped in the segment: the
// segment shrinks by what went, Shrink returns that with no error (the
// engine must not keep using unmapped memory) and Close reports the
// failure; a failed cuMemRelease likewise leaks the chunk's memory, reported
// by Close. (Should what went round to 0 bytes of the segment, the error is
// returned instead.) An importer of the segment (ExportSegment) keeps its
// own reference to the memory, which the driver frees once both let go.
// Shrink works after Close, like Free. Without VMMOptions.Expandable it
// fails with gocore.ErrUnsupported (the engine then never calls it).
func (b *VMMBackend) Shrink(dev int, addr, size, less uint64, stream gocore.Stream) (uint64, error) {
	if !b.opts.Expandable {
		return 0, fmt.Errorf("vmm backend: shrink %#x on device %d: not expandable (VMMOptions.Expandable): %w",
			addr, dev, gocore.ErrUnsupported)
	}
	if err := b.cu.checkDevice("shrink", dev); err != nil {
		return 0, fmt.Errorf("vmm backend: %w", err)
	}
	if less == 0 || less >= size {
		return 0, fmt.Errorf("vmm backend: shrink %#x (%d bytes) on device %d by %d bytes: not a positive size below the segment's: %w",
			addr, size, dev, less, gocore.ErrInvalidArgument)
	}
	// Judged by the device's own granularity (known once it has a segment;
	// the claim below refuses a device without one), not by Granularity,
	// which may have grown since the caller read it. The answer's unit: see
	// above.
	b.mu.Lock()
	gran, unit := b.devs[dev].gran, min(b.gran, less&-less)
	b.mu.Unlock()
	if gran != 0 && less%gran != 0 {
		return 0, fmt.Errorf("vmm backend: shrink %#x (%d bytes) on device %d by %d bytes: not a multiple of the device's granularity %d: %w",
			addr, size, dev, less, gran, gocore.ErrInvalidArgument)
	}
	s, err := b.claim(opShrink, dev, addr, size)
	if errors.Is(err, errSegmentBusy) {
		// Giving a tail back is opportunistic: with an export (or another
		// shrink) of the segment under way, the next release tries again,
		// and EmptyCache does not fail because of it.
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	defer b.release(s, opShrink)
	// The claim excludes every other writer of s.chunks and s.mapped.
	keep := size - less // the chunks from here on may go
	first := len(s.chunks)
	for first > 0 && s.chunks[first-1].offset >= keep {
		first--
	}
	if first == len(s.chunks) {
		return 0, nil
	}
	if err := refuseDuringCapture(b.drv, dev, uint64(stream), "vmm backend: shrink %#x on device %d", addr, dev); err != nil {
		return 0, err
	}
	if err := b.drv.StreamSynchronize(dev, uint64(stream)); err != nil {
		return 0, fmt.Errorf("vmm backend: shrink %#x on device %d: %w", addr, dev, err)
	}
	// Last chunk first, so that what stays mapped is always a prefix.
	gone := len(s.chunks)
	var unmapErr error
	for gone > first {
		c := s.chunks[gone-1]
		// cuMemUnmap takes whole mappings only, so one call per chunk.
		if err := b.drv.MemUnmap(dev, s.base+c.offset, c.size); err != nil {
			unmapErr = fmt.Errorf("vmm backend: shrink %#x on device %d by %d bytes: chunk at +%#x kept mapped: %w",
				addr, dev, less, c.offset, err)
			break
		}
		gone--
	}
	if gone == len(s.chunks) {
		return 0, unmapErr // nothing changed
	}
	var lost []error
	if unmapErr != nil {
		lost = append(lost, unmapErr)
	}
	for _, c := range s.chunks[gone:] {
		if err := b.drv.MemRelease(dev, c.handle); err != nil {
			lost = append(lost, fmt.Errorf("vmm backend: shrink %#x on device %d: chunk at +%#x (%d bytes) leaked: %w",
				addr, dev, c.offset, c.size, err))
		}
	}
	mapped := s.chunks[gone].offset
	var released uint64
	if mapped < size {
		released = roundUpTo(size-mapped, unit) // <= less, as mapped >= keep and unit divides less
	}
	b.mu.Lock()
	s.chunks = slices.Clip(s.chunks[:gone])
	s.mapped = mapped
	s.size = size - released
	if released == 0 && unmapErr != nil {
		// The segment is as the engine knows it: say so now.
		lost = lost[1:]
	} else {
		unmapErr = nil
	}
	if len(lost) > 0 {
		b.lost = append(b.lost, errors.Join(lost...))
	}
	b.mu.Unlock()
	return released, unmapErr
}

// Free destroys a segment: it waits for the work queued on stream (the
// segment's stream, as the engine passes it), unmaps and releases every
// chunk and frees the address range. The wait is there because cuMemUnmap,
// unlike cuMemFree, does not wait for kernels still using the memory
// (torch synchronizes before unmapping its expandable segments for the same
// reason); work on other streams was waited for by the engine's events.
// Free works after Close.
//
// During a CUDA graph capture on stream, or on the legacy default stream
// while a blocking stream of the device captures, the wait would fail and
// invalidate the capture: Free asks first (cuStreamIsCapturing), and then
// does nothing and fails with an error wrapping ErrCaptureUnderway. The
// engine keeps such a segment and frees it later (a pool closed during its
// own capture keeps it for a later Close).
//
// If the wait or the first unmap fails, nothing has changed: the error is
// returned and the segment stays. A failure after that cannot be undone;
// the segment is gone for the engine, Free returns nil (an error would make
// the engine keep using the unmapped memory), and Close reports what leaked.
func (b *VMMBackend) Free(dev int, addr, size uint64, stream gocore.Stream) error {
	if err := b.cu.checkDevice("free", dev); err != nil {
		return fmt.Errorf("vmm backend: %w", err)
	}
	if err := refuseDuringCapture(b.drv, dev, uint64(stream), "vmm backend: free %#x on device %d", addr, dev); err != nil {
		return err
	}
	s, err := b.claim(opFree, dev, addr, size)
	if err != nil {
		return err
	}
	if err := b.drv.StreamSynchronize(dev, uint64(stream)); err != nil {
		b.release(s, opFree)
		return fmt.Errorf("vmm backend: free %#x on device %d: %w", addr, dev, err)
	}
	var lost []error
	for i, c := range s.chunks {
		// cuMemUnmap takes whole mappings only, so one call per chunk.
		if err := b.drv.MemUnmap(dev, s.base+c.offset, c.size); err != nil {
			if i == 0 {
				b.release(s, opFree)
				return fmt.Errorf("vmm backend: free %#x on device %d: %w", addr, dev, err)
			}
			lost = append(lost, err)
		}
	}
	for _, c := range s.chunks {
		if err := b.drv.MemRelease(dev, c.handle); err != nil {
			lost = append(lost, err)
		}
	}
	if err := b.drv.MemAddressFree(dev, s.base, s.reserved); err != nil {
		lost = append(lost, err)
	}
	b.mu.Lock()
	if b.segs[addr] == s { // once the range was freed, an Alloc may already own addr
		delete(b.segs, addr)
	}
	if len(lost) > 0 {
		b.lost = append(b.lost, fmt.Errorf("vmm backend: free segment %#x (%d bytes) on device %d: %w",
			addr, size, dev, errors.Join(lost...)))
	}
	b.mu.Unlock()
	return nil
}

// SegmentBase returns the base address of the live segment of dev that
// contains addr: an importer of ExportSegment's chunks finds addr at
// ImportedRange.Addr() + (addr - base).
func (b *VMMBackend) SegmentBase(dev int, addr uint64) (uint64, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if s := b.containing(dev, addr); s != nil {
		return s.base, nil
	}
	return 0, fmt.Errorf("vmm backend: %#x is in no live segment of device %d: %w", addr, dev, gocore.ErrInvalidArgument)
}

// containing finds the segment of dev holding addr; b.mu is held. A linear
// scan: segments are few and large, and this serves IPC, not the hot path.
func (b *VMMBackend) containing(dev int, addr uint64) *vmmSegment {
	for _, s := range b.segs {
		if s.dev == dev && addr >= s.base && addr < s.base+s.size {
			return s
		}
	}
	return nil
}

// ExportSegment exports the physical memory of the live segment of dev that
// contains addr, one Chunk per cuMemCreate allocation (an expandable segment
// that grew has several), each as a POSIX file descriptor the caller owns
// and closes once it was passed on (e.g. over a Unix socket with
// SCM_RIGHTS). ImportVMM maps them back to back in another process. It
// needs VMMOptions.IPC (else the error wraps gocore.ErrUnsupported).
func (b *VMMBackend) ExportSegment(dev int, addr uint64) ([]Chunk, error) {
	if !b.opts.IPC {
		return nil, fmt.Errorf("vmm backend: export segment at %#x: created without IPC: %w", addr, gocore.ErrUnsupported)
	}
	if err := b.usable("export segment", dev); err != nil {
		return nil, err
	}
	b.mu.Lock()
	s := b.containing(dev, addr)
	if s == nil {
		b.mu.Unlock()
		return nil, fmt.Errorf("vmm backend: export segment at %#x: in no live segment of device %d: %w", addr, dev, gocore.ErrInvalidArgument)
	}
	base := s.base
	b.mu.Unlock()
	s, err := b.claim(opExport, dev, base, 0) // no Free releases a handle under us
	if err != nil {
		return nil, err
	}
	defer b.release(s, opExport)
	b.mu.Lock()
	chunks := slices.Clone(s.chunks) // an Expand may append meanwhile
	b.mu.Unlock()
	out := make([]Chunk, 0, len(chunks))
	for _, c := range chunks {
		fd, err := b.drv.MemExportToShareableHandle(dev, c.handle, driver.MemHandleTypePosixFD)
		if err != nil {
			for _, done := range out {
				_ = syscall.Close(done.FD) // ours until returned
			}
			return nil, fmt.Errorf("vmm backend: export segment %#x: %w", base, err)
		}
		out = append(out, Chunk{FD: fd, Size: c.size, Offset: c.offset})
	}
	return out, nil
}

// LiveSegments reports how many segments b holds.
func (b *VMMBackend) LiveSegments() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.segs)
}

// Close ends the backend. There is nothing to release when every segment
// was freed (the engine's pool frees them all when it closes); segments
// still live are reported as leaks, and left mapped since someone may still
// use them, as are failures of earlier Frees. Free still works afterwards;
// everything else fails. Closing twice is an error.
func (b *VMMBackend) Close() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return fmt.Errorf("vmm backend: close: %w", ErrBackendClosed)
	}
	b.closed = true
	errs := slices.Clone(b.lost)
	if len(b.segs) > 0 {
		leaked := make([]string, 0, len(b.segs))
		for _, s := range b.segs {
			leaked = append(leaked, fmt.Sprintf("%#x (%d bytes in %d chunks, device %d)", s.base, s.size, len(s.chunks), s.dev))
		}
		sort.Strings(leaked)
		errs = append(errs, fmt.Errorf("vmm backend: close: %d segments never freed: %v", len(leaked), leaked))
	}
	return errors.Join(errs...)
}
