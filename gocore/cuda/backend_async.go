package cuda

import (
	"errors"
	"fmt"
	"io"
	"sort"
	"sync"
	"time"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/cuda/driver"
	"github.com/gpumempool/gpumempool/gocore/internal/segtrack"
)

// ErrBackendClosed is wrapped by the methods of AsyncBackend and VMMBackend
// that need a live backend, once Close was called.
var ErrBackendClosed = errors.New("backend is closed")

// AsyncOptions configures an AsyncBackend. The zero value is a pool per
// device with the driver's defaults, not exportable.
type AsyncOptions struct {
	// ReleaseThreshold is CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: how many unused
	// bytes each CUDA pool keeps when the device synchronizes. 0 (the
	// driver's default too) gives memory freed to the CUDA pool back to the
	// device at the next synchronization, where other users can have it.
	ReleaseThreshold uint64 `option:"pool_release_threshold" doc:"unused bytes each CUDA pool keeps when the device synchronizes"`
	// ReuseFollowEventDependencies, ReuseAllowOpportunistic and
	// ReuseAllowInternalDependencies set the CU_MEMPOOL_ATTR_REUSE_*
	// policies of each pool; nil keeps the driver's default (all enabled).
	ReuseFollowEventDependencies   *bool `option:"reuse_follow_event_dependencies" doc:"CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES (default: the driver's, on)"`
	ReuseAllowOpportunistic        *bool `option:"reuse_allow_opportunistic" doc:"CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC (default: the driver's, on)"`
	ReuseAllowInternalDependencies *bool `option:"reuse_allow_internal_dependencies" doc:"CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES (default: the driver's, on)"`
	// IPC creates the pools exportable as POSIX file descriptors, for
	// ExportPool, ExportPointer and ImportAsyncPool in another process.
	IPC bool `option:"ipc" doc:"pools exportable to other processes (POSIX file descriptors)"`
	// MaxSize caps the bytes each pool reserves from its device (the
	// pool's maxSize); 0 lets the driver choose. It needs a CUDA 12.2
	// driver or newer.
	MaxSize uint64 `option:"max_size" doc:"bytes each CUDA pool may reserve; 0: the driver's choice (CUDA 12.2+)"`
}

// AsyncBackend is a gocore.Backend named "async" whose segments come from
// CUDA's stream-ordered allocator: one memory pool (cuMemPoolCreate) per
// device, created on first use, from which Alloc takes memory with
// cuMemAllocFromPoolAsync and to which Free returns it with
// cuMemFreeAsync, both ordered on the segment's stream. The engine's cache
// sits in front of the CUDA pool's own; the CUDA pool makes what the engine
// gives back reusable without a device synchronization and shareable
// between processes (IPC).
//
// During a CUDA graph capture, a segment is never allocated on the
// capturing stream: there cuMemAllocFromPoolAsync would add an allocation
// node to the graph, memory the graph owns and frees, not the pool. Alloc
// asks the driver (cuStreamIsCapturing) and, when the stream captures, or
// is the legacy default stream while a blocking stream captures, allocates
// on a private non-blocking stream of the device instead and waits for that
// stream before returning; see Alloc. Nor is a segment freed there: Free
// fails with ErrCaptureUnderway on such a stream, the segment's, which it
// would have to use, and the engine keeps the segment for a later release.
//
// Events, devices and capacity are those of the cuda backend (Backend). It
// is safe for concurrent use; driver calls run without the backend's lock
// except the creation of a pool or of a private stream. Close waits for the
// calls that use a pool or a private stream to finish before destroying
// them.
type AsyncBackend struct {
	*Events // the cu backend's
	cu      *Backend
	drv     *driver.Driver
	opts    AsyncOptions

	live *segtrack.Table // the segments allocated and not freed

	// sideMu is held shared by the calls that use a pool or a private
	// stream (Alloc, Trim, Attribute, ExportPool), from reading the handle
	// until the driver is done with it, and exclusively by Close, which
	// destroys them: a call never reaches a destroyed pool or stream, and
	// one that starts after Close sees b.closed.
	sideMu sync.RWMutex

	mu      sync.Mutex
	pools   []uint64 // by device; 0 until created
	streams []uint64 // private streams, by device; 0 until created
	closed  bool
	// allocated holds, for segments of an IPC pool not exported yet, an
	// event recorded on the allocating stream right after
	// cuMemAllocFromPoolAsync. ExportPointer waits for it: "the imported
	// memory must not be accessed before the allocation operation
	// completes in the exporting process" (cuMemPoolImportPointer).
	allocated map[segKey]*allocEvent
}

// segKey names a segment.
type segKey struct {
	dev  int
	addr uint64
}

// allocEvent is the allocation event of one segment; mu serialises the
// exports waiting for it and its destruction.
type allocEvent struct {
	mu   sync.Mutex
	ev   uint64
	done bool // completed and destroyed
}

var (
	_ gocore.Backend = (*AsyncBackend)(nil)
	_ io.Closer      = (*AsyncBackend)(nil)
)

// asyncSymbols are the entry points every AsyncBackend needs; checking them
// up front turns an old driver into one clear error at construction
// (matching ErrDriverTooOld and gocore.ErrUnsupported) instead of one on
// the first allocation.
//
// The stream entry points (CUDA 10.0 and older) are in every driver that
// has the stream-ordered allocator; requiring them means that a capture is
// always detected, never silently turned into graph-owned allocations.
var asyncSymbols = []string{
	"cuMemPoolCreate", "cuMemPoolDestroy", "cuMemAllocFromPoolAsync", "cuMemFreeAsync",
	"cuMemPoolSetAttribute", "cuMemPoolGetAttribute", "cuMemPoolTrimTo",
	"cuStreamIsCapturing", "cuStreamCreate", "cuStreamDestroy_v2",
}

// NewAsyncBackend returns an AsyncBackend over drv's devices. It fails when
// drv is nil, sees no device or lacks the stream-ordered allocator (CUDA
// 11.2+) or cuStreamIsCapturing. No pool is created until a device is used.
func NewAsyncBackend(drv *driver.Driver, opts AsyncOptions) (*AsyncBackend, error) {
	cu, err := NewBackend(drv)
	if err != nil {
		return nil, fmt.Errorf("async backend: %w", err)
	}
	if err := requireSymbols(drv, "async backend", asyncSymbols); err != nil {
		return nil, err
	}
	if opts.MaxSize > 0 {
		// Older drivers read CUmemPoolProps.maxSize as reserved bytes and
		// would refuse every pool with CUDA_ERROR_INVALID_VALUE.
		if err := drv.RequireVersion("async backend", "MaxSize (CUmemPoolProps.maxSize)", 12020); err != nil {
			return nil, err
		}
	}
	return &AsyncBackend{
		Events: cu.Events, cu: cu, drv: drv, opts: opts,
		pools:     make([]uint64, cu.Devices()),
		streams:   make([]uint64, cu.Devices()),
		live:      segtrack.New("async backend"),
		allocated: map[segKey]*allocEvent{},
	}, nil
}

// requireSymbols fails with ErrDriverTooOld naming the first missing entry
// point.
func requireSymbols(drv *driver.Driver, who string, names []string) error {
	for _, name := range names {
		if !drv.HasSymbol(name) {
			return fmt.Errorf("%s: %s: %w: %s missing", who, drv.Path(), driver.ErrDriverTooOld, name)
		}
	}
	return nil
}

// Name returns "async".
func (b *AsyncBackend) Name() string { return "async" }

// Devices returns the number of devices the driver saw when b was made.
func (b *AsyncBackend) Devices() int { return b.cu.Devices() }

// Alignment returns Alignment (512), checked on every allocation.
func (b *AsyncBackend) Alignment() uint64 { return Alignment }

// Driver returns the driver b allocates through.
func (b *AsyncBackend) Driver() *driver.Driver { return b.drv }

// Options returns the options b was made with.
func (b *AsyncBackend) Options() AsyncOptions { return b.opts }

// Capacity reports the device's total and free memory (cuMemGetInfo_v2).
// Memory cached by the CUDA pool counts as used.
func (b *AsyncBackend) Capacity(dev int) (total, free uint64, err error) { return b.cu.Capacity(dev) }

// pool returns dev's CUDA pool, creating it on first use. Creation holds
// b.mu: it happens once per device, and holding the lock keeps two first
// users from creating two pools. The caller holds b.sideMu shared while it
// uses the pool.
func (b *AsyncBackend) pool(op string, dev int) (uint64, error) {
	if err := b.cu.checkDevice(op, dev); err != nil {
		return 0, fmt.Errorf("async backend: %w", err)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return 0, fmt.Errorf("async backend: %s on device %d: %w", op, dev, ErrBackendClosed)
	}
	if p := b.pools[dev]; p != 0 {
		return p, nil
	}
	p, err := b.createPool(dev)
	if err != nil {
		return 0, fmt.Errorf("async backend: %s on device %d: %w", op, dev, err)
	}
	b.pools[dev] = p
	return p, nil
}

// createPool creates dev's pool and applies the options; on any failure
// the pool is destroyed again so that nothing half-configured is used.
func (b *AsyncBackend) createPool(dev int) (uint64, error) {
	props := driver.PoolProps{HandleType: driver.MemHandleTypeNone, LocationType: driver.MemLocationTypeDevice, LocationID: dev,
		MaxSize: b.opts.MaxSize}
	if b.opts.IPC {
		props.HandleType = driver.MemHandleTypePosixFD
	}
	p, err := b.drv.MemPoolCreate(dev, props)
	if err != nil {
		return 0, err
	}
	// The threshold is always set, even to 0 (the driver's default), so
	// that the option is what decides it; nil reuse policies are left alone.
	type setting struct {
		attr  int
		value uint64
	}
	settings := []setting{{driver.MemPoolAttrReleaseThreshold, b.opts.ReleaseThreshold}}
	for _, r := range []struct {
		attr int
		on   *bool
	}{
		{driver.MemPoolAttrReuseFollowEventDependencies, b.opts.ReuseFollowEventDependencies},
		{driver.MemPoolAttrReuseAllowOpportunistic, b.opts.ReuseAllowOpportunistic},
		{driver.MemPoolAttrReuseAllowInternalDependencies, b.opts.ReuseAllowInternalDependencies},
	} {
		if r.on != nil {
			settings = append(settings, setting{r.attr, boolValue(*r.on)})
		}
	}
	for _, a := range settings {
		if err := b.drv.MemPoolSetAttribute(dev, p, a.attr, a.value); err != nil {
			_ = b.drv.MemPoolDestroy(dev, p) // the error that matters is the one above
			return 0, err
		}
	}
	return p, nil
}

func boolValue(on bool) uint64 {
	if on {
		return 1
	}
	return 0
}

// Alloc takes size bytes from dev's pool, ordered on stream: the memory is
// usable by work queued on stream after this call (other streams must wait
// for it, which the engine's events take care of). Running out of memory
// (CUDA_ERROR_OUT_OF_MEMORY, also when MaxSize is reached) matches
// gocore.ErrBackendOutOfMemory.
//
// When stream is capturing a CUDA graph (cuStreamIsCapturing: active or
// invalidated), or is the legacy default stream while a blocking stream of
// the device captures (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT: using it would
// break that capture), the memory is taken on a private non-blocking stream
// of dev instead, created on first need, and Alloc waits for that stream
// (cuStreamSynchronize, allowed during a capture in the relaxed mode every
// driver call of the package runs in): the segment is then the pool's, as
// outside a capture, and usable on every stream, the captured one included.
// A stream that does not capture, the default streams included when no
// blocking stream captures, is used as it is.
func (b *AsyncBackend) Alloc(dev int, size uint64, stream gocore.Stream) (uint64, error) {
	b.sideMu.RLock() // Close destroys the pool and the private stream
	defer b.sideMu.RUnlock()
	p, err := b.pool("alloc", dev)
	if err != nil {
		return 0, err
	}
	capturing, err := b.capturing(dev, uint64(stream))
	if err != nil {
		return 0, err
	}
	if !capturing {
		return b.allocOn(dev, size, p, uint64(stream), false)
	}
	side, err := b.privateStream(dev)
	if err != nil {
		return 0, err
	}
	return b.allocOn(dev, size, p, side, true)
}

// capturing reports whether allocating on stream would be captured into a
// CUDA graph, or break a capture.
func (b *AsyncBackend) capturing(dev int, stream uint64) (bool, error) {
	why, err := streamCapture(b.drv, dev, stream)
	if err != nil {
		return false, fmt.Errorf("async backend: alloc on device %d: %w", dev, err)
	}
	return why != "", nil
}

// privateStream returns dev's private stream, creating it on first use;
// the caller holds b.sideMu shared.
func (b *AsyncBackend) privateStream(dev int) (uint64, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return 0, fmt.Errorf("async backend: alloc on device %d: %w", dev, ErrBackendClosed)
	}
	if s := b.streams[dev]; s != 0 {
		return s, nil
	}
	s, err := b.drv.StreamCreate(dev, driver.StreamNonBlocking)
	if err != nil {
		return 0, fmt.Errorf("async backend: private stream for allocations during a graph capture: %w", err)
	}
	b.streams[dev] = s
	return s, nil
}

// allocOn allocates on stream on; private says it is dev's private stream,
// which is waited for.
func (b *AsyncBackend) allocOn(dev int, size, pool, on uint64, private bool) (uint64, error) {
	addr, err := b.drv.MemAllocFromPoolAsync(dev, size, pool, on)
	if err != nil {
		return 0, fmt.Errorf("async backend: %w", err)
	}
	if private {
		if err := b.drv.StreamSynchronize(dev, on); err != nil {
			return 0, errors.Join(fmt.Errorf("async backend: %w", err), b.drv.MemFreeAsync(dev, addr, on))
		}
	}
	if addr%Alignment != 0 {
		// Not ours to keep: hand it back rather than break the promise.
		_ = b.drv.MemFreeAsync(dev, addr, on)
		return 0, fmt.Errorf("async backend: cuMemAllocFromPoolAsync returned %#x, not aligned to %d bytes", addr, Alignment)
	}
	// An address whose Free is in flight may come back at once; only a live
	// one is a driver bug. That allocation is not freed: the driver frees by
	// address, and the address is a live segment's, which the engine still
	// uses (the nccl backend leaves such an allocation alone too). It leaks.
	if !b.live.Add(segtrack.Segment{Device: dev, Addr: addr, Size: size}) {
		return 0, fmt.Errorf("async backend: cuMemAllocFromPoolAsync returned %#x, which is still allocated", addr)
	}
	if b.opts.IPC && !private { // a private stream's allocation was waited for
		if err := b.recordAllocated(dev, addr, on); err != nil {
			return 0, errors.Join(err, b.Free(dev, addr, size, gocore.Stream(on)))
		}
	}
	return addr, nil
}

// recordAllocated records the allocation event of segment addr (see
// AsyncBackend.allocated).
func (b *AsyncBackend) recordAllocated(dev int, addr, stream uint64) error {
	ev, err := b.drv.EventCreate(dev)
	if err != nil {
		return fmt.Errorf("async backend: allocation event for IPC: %w", err)
	}
	if err := b.drv.EventRecord(dev, ev, stream); err != nil {
		return errors.Join(fmt.Errorf("async backend: allocation event for IPC: %w", err), b.drv.EventDestroy(dev, ev))
	}
	b.mu.Lock()
	b.allocated[segKey{dev, addr}] = &allocEvent{ev: ev}
	b.mu.Unlock()
	return nil
}

// waitAllocated waits until the allocation of segment addr has completed
// on its stream (a no-op once one export waited).
func (b *AsyncBackend) waitAllocated(dev int, addr uint64) error {
	k := segKey{dev, addr}
	a := b.allocatedOf(k, false)
	if err := b.finishAllocated(dev, a, addr, true); err != nil {
		return err
	}
	b.mu.Lock()
	if a != nil && b.allocated[k] == a { // not a newer segment's at a reused address
		delete(b.allocated, k)
	}
	b.mu.Unlock()
	return nil
}

// dropAllocated destroys the allocation event of segment addr, if any is
// left (the segment was never exported).
func (b *AsyncBackend) dropAllocated(dev int, addr uint64) error {
	return b.finishAllocated(dev, b.allocatedOf(segKey{dev, addr}, true), addr, false)
}

// allocatedOf returns segment k's allocation event (nil when there is none),
// taken out of the table when remove is set.
func (b *AsyncBackend) allocatedOf(k segKey, remove bool) *allocEvent {
	b.mu.Lock()
	defer b.mu.Unlock()
	a := b.allocated[k]
	if remove {
		delete(b.allocated, k)
	}
	return a
}

// finishAllocated destroys a's event (a may be nil), once, after waiting
// for it to complete when wait is set. The wait polls: the driver interface
// has no blocking event wait, and exports are rare.
func (b *AsyncBackend) finishAllocated(dev int, a *allocEvent, addr uint64, wait bool) error {
	if a == nil {
		return nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.done {
		return nil
	}
	for pause := time.Microsecond; wait; pause = min(2*pause, time.Millisecond) {
		ok, err := b.drv.EventQuery(dev, a.ev)
		if err != nil {
			return fmt.Errorf("async backend: export pointer %#x: waiting for its allocation: %w", addr, err)
		}
		if ok {
			break
		}
		time.Sleep(pause)
	}
	a.done = true
	return b.drv.EventDestroy(dev, a.ev)
}

// Free returns a segment to dev's pool with cuMemFreeAsync on stream, which
// the engine passes as the segment's stream: the free is ordered after the
// work queued there, so it neither waits nor races with kernels still using
// the memory (work on other streams was waited for by the engine's
// events). It works after Close too: a destroyed pool's allocations stay
// valid until freed. On error the segment stays allocated.
//
// Free asks the driver first (cuStreamIsCapturing) whether stream captures
// a CUDA graph, or is the legacy default stream while a blocking stream of
// the device captures: cuMemFreeAsync would then become a free node of the
// graph (the segment would leave the backend without being freed) or break
// that capture. Such a Free does nothing and fails with an error wrapping
// ErrCaptureUnderway; the engine keeps the segment and frees it later. A
// pool releases nothing during its own capture unless it is closed then,
// but another thread's capture (pools share a backend) may be under way at
// any release.
func (b *AsyncBackend) Free(dev int, addr, size uint64, stream gocore.Stream) error {
	if err := refuseDuringCapture(b.drv, dev, uint64(stream), "async backend: free %#x on device %d", addr, dev); err != nil {
		return err
	}
	k := segKey{dev, addr}
	var a *allocEvent
	err := b.live.Free(dev, addr, size, func() error {
		// Take the allocation event before the driver can hand addr out
		// again (to an Alloc that records its own event there).
		a = b.allocatedOf(k, true)
		if err := b.drv.MemFreeAsync(dev, addr, uint64(stream)); err != nil {
			if a != nil { // still allocated: it keeps its event
				b.mu.Lock()
				b.allocated[k] = a
				b.mu.Unlock()
			}
			return fmt.Errorf("async backend: %w", err)
		}
		return nil
	})
	if err == nil {
		// The segment is freed: an error here (the event stays, a few
		// bytes of driver state) must not make the engine free it again.
		_ = b.finishAllocated(dev, a, addr, false)
	}
	return err
}

// Trim releases memory cached by dev's CUDA pool (memory the engine gave
// back) until at most keep unused bytes remain (cuMemPoolTrimTo). Nothing
// happens when the device's pool was never created.
func (b *AsyncBackend) Trim(dev int, keep uint64) error {
	if err := b.cu.checkDevice("trim", dev); err != nil {
		return fmt.Errorf("async backend: %w", err)
	}
	b.sideMu.RLock() // Close destroys the pool
	defer b.sideMu.RUnlock()
	b.mu.Lock()
	p, closed := b.pools[dev], b.closed
	b.mu.Unlock()
	if closed {
		return fmt.Errorf("async backend: trim device %d: %w", dev, ErrBackendClosed)
	}
	if p == 0 {
		return nil
	}
	if err := b.drv.MemPoolTrimTo(dev, p, keep); err != nil {
		return fmt.Errorf("async backend: %w", err)
	}
	return nil
}

// Attribute reads an attribute (MemPoolAttr*) of dev's pool, creating the
// pool if needed: the options applied, and the pool's usage.
func (b *AsyncBackend) Attribute(dev, attr int) (uint64, error) {
	b.sideMu.RLock() // Close destroys the pool
	defer b.sideMu.RUnlock()
	p, err := b.pool("read pool attribute", dev)
	if err != nil {
		return 0, err
	}
	v, err := b.drv.MemPoolGetAttribute(dev, p, attr)
	if err != nil {
		return 0, fmt.Errorf("async backend: %w", err)
	}
	return v, nil
}

// ExportPool exports dev's pool (created if needed) as a POSIX file
// descriptor for ImportAsyncPool in another process; the caller owns and
// closes it. It needs AsyncOptions.IPC (else the error wraps
// gocore.ErrUnsupported).
func (b *AsyncBackend) ExportPool(dev int) (int, error) {
	if !b.opts.IPC {
		return -1, fmt.Errorf("async backend: export pool of device %d: created without IPC: %w", dev, gocore.ErrUnsupported)
	}
	b.sideMu.RLock() // Close destroys the pool
	defer b.sideMu.RUnlock()
	p, err := b.pool("export pool", dev)
	if err != nil {
		return -1, err
	}
	fd, err := b.drv.MemPoolExportToShareableHandle(dev, p, driver.MemHandleTypePosixFD)
	if err != nil {
		return -1, fmt.Errorf("async backend: %w", err)
	}
	return fd, nil
}

// ExportPointer returns the data with which a process that imported dev's
// pool (ImportedPool.ImportPointer) maps the segment starting at ptr. ptr
// must be the start of a live segment on dev: the driver exports whole
// allocations, so a block inside a segment is shared by exporting the
// segment and passing the block's offset along. It needs AsyncOptions.IPC.
// The exporter must not free the segment before every importer freed its
// import (the driver's rule).
func (b *AsyncBackend) ExportPointer(dev int, ptr uint64) ([64]byte, error) {
	if !b.opts.IPC {
		return [64]byte{}, fmt.Errorf("async backend: export pointer %#x: created without IPC: %w", ptr, gocore.ErrUnsupported)
	}
	s, ok := b.live.Lookup(ptr)
	if !ok || s.Device != dev {
		return [64]byte{}, fmt.Errorf("async backend: export pointer %#x: not the start of a live segment on device %d: %w",
			ptr, dev, gocore.ErrInvalidArgument)
	}
	if err := b.waitAllocated(dev, ptr); err != nil {
		return [64]byte{}, err
	}
	data, err := b.drv.MemPoolExportPointer(dev, ptr)
	if err != nil {
		return [64]byte{}, fmt.Errorf("async backend: %w", err)
	}
	return data, nil
}

// Close destroys the CUDA pools (cuMemPoolDestroy, which gives their
// cached memory back) and the private streams, after waiting for the Alloc,
// Trim, Attribute and ExportPool calls in flight, which use them. Segments
// still allocated are reported as an error; the driver keeps them valid
// until they are freed, and Free still works (ExportPointer and the event
// methods, which use no pool handle, are not refused either). Alloc, Trim,
// Attribute and ExportPool fail with an error wrapping ErrBackendClosed
// afterwards; closing twice is such an error too.
func (b *AsyncBackend) Close() error {
	b.sideMu.Lock() // until the pools and streams are gone
	defer b.sideMu.Unlock()
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return fmt.Errorf("async backend: close: %w", ErrBackendClosed)
	}
	b.closed = true
	pools := append([]uint64(nil), b.pools...)
	streams := append([]uint64(nil), b.streams...)
	var events []segKey
	for k := range b.allocated {
		events = append(events, k)
	}
	b.mu.Unlock()
	var leaked []string
	for _, s := range b.live.Segments() {
		leaked = append(leaked, fmt.Sprintf("%#x (%d bytes, device %d)", s.Addr, s.Size, s.Device))
	}

	var errs []error
	for _, k := range events { // of segments still allocated, never exported
		if err := b.dropAllocated(k.dev, k.addr); err != nil {
			errs = append(errs, fmt.Errorf("async backend: close: %w", err))
		}
	}
	for dev, s := range streams {
		if s != 0 {
			if err := b.drv.StreamDestroy(dev, s); err != nil {
				errs = append(errs, fmt.Errorf("async backend: close: %w", err))
			}
		}
	}
	for dev, p := range pools {
		if p == 0 {
			continue
		}
		if err := b.drv.MemPoolDestroy(dev, p); err != nil {
			errs = append(errs, fmt.Errorf("async backend: close: %w", err))
		}
	}
	if len(leaked) > 0 {
		sort.Strings(leaked)
		errs = append(errs, fmt.Errorf("async backend: close: %d segments never freed: %v", len(leaked), leaked))
	}
	return errors.Join(errs...)
}
