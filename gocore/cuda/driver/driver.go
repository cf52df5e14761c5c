package driver

/*
#cgo LDFLAGS: -ldl
#include <stdlib.h>
#include "shim.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/gpumempool/gpumempool/gocore"
)

// Driver is a loaded driver library: its resolved entry points and the
// primary context of each device it has used. It is safe for concurrent use.
type Driver struct {
	path     string
	handle   C.uintptr_t
	fns      *C.gmp_drv // Go memory holding only C function pointers
	noDevice error      // set when cuInit found no device: every device is invalid

	// closeMu is held shared by every call into the driver and exclusively
	// by Close, so that Close never releases a context under a running call.
	closeMu sync.RWMutex
	closed  bool // guarded by closeMu
	// ctxs maps a device ordinal to its retained primary context. It is
	// copied on write (under retainMu) so that the hot path reads it without
	// a lock, and a first use of a device never waits for other calls.
	retainMu sync.Mutex
	ctxs     atomic.Pointer[map[int]C.uintptr_t]
}

var (
	loadMu sync.Mutex
	// loaded maps a dlopen handle to its Driver: dlopen returns the same
	// handle for every path naming one file (symlinks and relative paths
	// included), so this is the cache "per resolved path".
	loaded = map[C.uintptr_t]*Driver{}
)

// Load opens the driver library at path (when empty: $GMP_LIBCUDA, else
// DefaultLibrary) with RTLD_NOW|RTLD_LOCAL, resolves its entry points and
// calls cuInit(0).
//
// Loading a library that is already loaded returns the same *Driver, so its
// primary contexts are retained once per process however many callers load
// it; the cache is keyed by the library dlopen resolved the path to, and
// guarded by a mutex. After Close, Load returns a new Driver.
//
// A library that cannot be found yields an error wrapping ErrNoDriver. One
// that lacks a required entry point yields an error naming it (wrapping
// ErrDriverTooOld); optional ones (the stream-ordered allocator and virtual
// memory management) are only needed by their methods, see HasSymbol. A
// driver whose cuInit reports CUDA_ERROR_NO_DEVICE loads, with no devices.
func Load(path string) (*Driver, error) {
	if path == "" {
		path = os.Getenv(EnvLibrary)
	}
	if path == "" {
		path = DefaultLibrary
	}
	loadMu.Lock()
	defer loadMu.Unlock()

	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var errbuf [1024]C.char
	h := C.gmp_dlopen(cpath, &errbuf[0], C.size_t(len(errbuf)))
	if h == 0 {
		msg := C.GoString(&errbuf[0])
		if libraryMissing(path) {
			return nil, fmt.Errorf("cuda: %w: dlopen %s: %s", ErrNoDriver, path, msg)
		}
		return nil, fmt.Errorf("cuda: dlopen %s: %s", path, msg)
	}
	if d := loaded[h]; d != nil {
		C.gmp_dlclose(h) // drop the reference this dlopen added
		return d, nil
	}

	fns := new(C.gmp_drv)
	C.gmp_resolve(fns, h)
	var missing []string
	for i := 0; i < int(C.GMP_NFUNCS); i++ {
		if C.gmp_has(fns, C.int(i)) == 0 && C.gmp_required(C.int(i)) != 0 {
			missing = append(missing, C.GoString(C.gmp_name(C.int(i))))
		}
	}
	if len(missing) > 0 {
		C.gmp_dlclose(h)
		return nil, fmt.Errorf("cuda: %s lacks required driver entry point %s (not libcuda, or a driver older than CUDA 11): %w",
			path, strings.Join(missing, ", "), ErrDriverTooOld)
	}

	d := &Driver{path: path, handle: h, fns: fns}
	d.ctxs.Store(&map[int]C.uintptr_t{})
	if res := C.gmp_init(fns); res.code != 0 {
		err := d.errorOf(res)
		if res.code != CodeNoDevice {
			C.gmp_dlclose(h)
			return nil, fmt.Errorf("cuda: initialize %s: %w", path, err)
		}
		// A driver without GPUs (or with CUDA_VISIBLE_DEVICES empty) is a
		// valid driver with zero devices; backends report that.
		d.noDevice = err
	}
	// The library is never dlclosed from here on: the real driver does not
	// support being unloaded once initialized.
	loaded[h] = d
	return d, nil
}

// libraryMissing tells "no such library" from "a library that failed to
// load" after dlopen failed: a bare name was searched for and not found; a
// path can be checked.
func libraryMissing(path string) bool {
	if !strings.Contains(path, "/") {
		return true
	}
	_, err := os.Stat(path)
	return errors.Is(err, os.ErrNotExist)
}

// Path returns the path the library was loaded from, as given to dlopen.
func (d *Driver) Path() string { return d.path }

// HasSymbol reports whether the driver exports the named entry point among
// those the package resolves (e.g. "cuMemPoolCreate").
func (d *Driver) HasSymbol(name string) bool {
	for i := 0; i < int(C.GMP_NFUNCS); i++ {
		if C.GoString(C.gmp_name(C.int(i))) == name {
			return C.gmp_has(d.fns, C.int(i)) != 0
		}
	}
	return false
}

// Close releases the primary contexts the driver retained and removes it
// from Load's cache. It exists for tests and orderly shutdown: every later
// call on d fails with ErrDriverClosed, and anything allocated through d
// must have been freed before. The library itself stays loaded.
func (d *Driver) Close() error {
	d.closeMu.Lock()
	if d.closed {
		d.closeMu.Unlock()
		return fmt.Errorf("cuda: close %s: %w", d.path, ErrDriverClosed)
	}
	d.closed = true
	ctxs := *d.ctxs.Load()
	devs := make([]int, 0, len(ctxs))
	for dev := range ctxs {
		devs = append(devs, dev)
	}
	sort.Ints(devs)
	var errs []error
	for _, dev := range devs {
		if res := C.gmp_release(d.fns, C.int(dev)); res.code != 0 {
			errs = append(errs, fmt.Errorf("cuda: release primary context of device %d: %w", dev, d.errorOf(res)))
		}
	}
	d.ctxs.Store(&map[int]C.uintptr_t{})
	d.closeMu.Unlock()

	loadMu.Lock()
	if loaded[d.handle] == d {
		delete(loaded, d.handle)
	}
	loadMu.Unlock()
	return errors.Join(errs...)
}

// errorOf turns a failed gmp_res into an *Error named by the entry point
// that produced it.
func (d *Driver) errorOf(res C.gmp_res) error {
	if res.code == 0 {
		return nil
	}
	e := &Error{Op: C.GoString(C.gmp_name(res.fn)), Code: int(res.code)}
	if s := C.gmp_error_name(d.fns, res.code); s != nil {
		e.Name = C.GoString(s)
	}
	return e
}

// require fails when an optional entry point is missing.
func (d *Driver) require(fn C.int) error {
	if C.gmp_has(d.fns, fn) == 0 {
		return fmt.Errorf("cuda: %s: %w: %s missing", d.path, ErrDriverTooOld, C.GoString(C.gmp_name(fn)))
	}
	return nil
}

// withCtx runs call, a C helper that pushes ctx, operates and pops, with
// dev's primary context (retained on first use). The shared close lock keeps
// Close from releasing the context during the call.
func (d *Driver) withCtx(dev int, call func(ctx C.uintptr_t) C.gmp_res) error {
	if dev < 0 {
		return fmt.Errorf("device %d: %w", dev, gocore.ErrInvalidDevice)
	}
	d.closeMu.RLock()
	defer d.closeMu.RUnlock()
	if d.closed {
		return ErrDriverClosed
	}
	ctx, ok := (*d.ctxs.Load())[dev]
	if !ok {
		var err error
		if ctx, err = d.retain(dev); err != nil {
			return err
		}
	}
	return d.errorOf(call(ctx))
}

// retain retains dev's primary context, once for the driver's lifetime.
// The caller holds closeMu shared.
func (d *Driver) retain(dev int) (C.uintptr_t, error) {
	d.retainMu.Lock()
	defer d.retainMu.Unlock()
	old := *d.ctxs.Load()
	if ctx, ok := old[dev]; ok {
		return ctx, nil // retained by a concurrent first use
	}
	if d.noDevice != nil {
		return 0, fmt.Errorf("device %d: %w: the driver found no device (%v)", dev, gocore.ErrInvalidDevice, d.noDevice)
	}
	var ctx C.uintptr_t
	if res := C.gmp_retain(d.fns, C.int(dev), &ctx); res.code != 0 {
		return 0, fmt.Errorf("device %d: %w", dev, d.errorOf(res))
	}
	ctxs := maps.Clone(old)
	ctxs[dev] = ctx
	d.ctxs.Store(&ctxs)
	return ctx, nil
}

// context returns dev's primary context, retaining it if needed.
func (d *Driver) context(dev int) (C.uintptr_t, error) {
	var ctx C.uintptr_t
	err := d.withCtx(dev, func(c C.uintptr_t) C.gmp_res {
		ctx = c
		return C.gmp_res{}
	})
	return ctx, err
}

// ContextFuncs returns dev's primary context and the addresses of
// cuCtxPushCurrent_v2 and cuCtxPopCurrent_v2, for C code in other packages
// (NCCL) that must make its own driver calls under that context with the
// same push, operate, pop discipline. The context stays retained until
// Close.
func (d *Driver) ContextFuncs(dev int) (ctx, push, pop uintptr, err error) {
	c, err := d.context(dev)
	if err != nil {
		return 0, 0, 0, fmt.Errorf("cuda: context of device %d: %w", dev, err)
	}
	return uintptr(c), uintptr(C.gmp_addr(d.fns, C.GMP_cuCtxPushCurrent_v2)),
		uintptr(C.gmp_addr(d.fns, C.GMP_cuCtxPopCurrent_v2)), nil
}

// Version returns the latest CUDA version the driver supports, as
// cuDriverGetVersion reports it: 1000*major + 10*minor (12020 is CUDA 12.2).
// It is what decides which newer struct fields and enum values the driver
// understands (see VersionString).
func (d *Driver) Version() (int, error) {
	d.closeMu.RLock()
	defer d.closeMu.RUnlock()
	if d.closed {
		return 0, fmt.Errorf("cuda: driver version: %w", ErrDriverClosed)
	}
	var v C.int
	if err := d.errorOf(C.gmp_driver_version(d.fns, &v)); err != nil {
		return 0, fmt.Errorf("cuda: driver version: %w", err)
	}
	return int(v), nil
}

// CaptureModeFunc returns the address of cuThreadExchangeStreamCaptureMode,
// or 0 when the driver lacks it (nccl.CaptureModeSource: code outside this
// package that calls allocating functions with a context pushed, such as
// ncclMemAlloc, runs them in the relaxed capture mode too).
func (d *Driver) CaptureModeFunc() uintptr {
	return uintptr(C.gmp_addr(d.fns, C.GMP_cuThreadExchangeStreamCaptureMode))
}

// DeviceCount returns the number of devices the driver sees (0 when cuInit
// found none).
func (d *Driver) DeviceCount() (int, error) {
	d.closeMu.RLock()
	defer d.closeMu.RUnlock()
	if d.closed {
		return 0, fmt.Errorf("cuda: device count: %w", ErrDriverClosed)
	}
	if d.noDevice != nil {
		return 0, nil
	}
	var n C.int
	if err := d.errorOf(C.gmp_device_count(d.fns, &n)); err != nil {
		return 0, fmt.Errorf("cuda: device count: %w", err)
	}
	return int(n), nil
}

// MemGetInfo returns the free and total bytes of device memory on dev.
func (d *Driver) MemGetInfo(dev int) (free, total uint64, err error) {
	var f, t C.uint64_t
	err = d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res { return C.gmp_mem_get_info(d.fns, ctx, &f, &t) })
	if err != nil {
		return 0, 0, fmt.Errorf("cuda: memory info of device %d: %w", dev, err)
	}
	return uint64(f), uint64(t), nil
}

// MemAlloc allocates size bytes of device memory on dev (cuMemAlloc_v2).
// Running out of memory yields an error matching gocore.ErrBackendOutOfMemory.
func (d *Driver) MemAlloc(dev int, size uint64) (uint64, error) {
	var p C.uint64_t
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res { return C.gmp_mem_alloc(d.fns, ctx, C.size_t(size), &p) })
	if err != nil {
		return 0, fmt.Errorf("cuda: alloc %d bytes on device %d: %w", size, dev, err)
	}
	return uint64(p), nil
}

// MemFree frees device memory that MemAlloc returned for dev.
func (d *Driver) MemFree(dev int, ptr uint64) error {
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res { return C.gmp_mem_free(d.fns, ctx, C.uint64_t(ptr)) })
	if err != nil {
		return fmt.Errorf("cuda: free %#x on device %d: %w", ptr, dev, err)
	}
	return nil
}

// EventCreate creates an event on dev with CU_EVENT_DISABLE_TIMING (the
// engine only orders work with events; timing would slow them down).
func (d *Driver) EventCreate(dev int) (uint64, error) {
	var ev C.uint64_t
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res {
		return C.gmp_event_create(d.fns, ctx, EventDisableTiming, &ev)
	})
	if err != nil {
		return 0, fmt.Errorf("cuda: create event on device %d: %w", dev, err)
	}
	return uint64(ev), nil
}

// EventRecord captures the work queued so far on stream in ev; both belong
// to dev.
func (d *Driver) EventRecord(dev int, ev, stream uint64) error {
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res {
		return C.gmp_event_record(d.fns, ctx, C.uint64_t(ev), C.uint64_t(stream))
	})
	if err != nil {
		return fmt.Errorf("cuda: record event %#x on stream %#x of device %d: %w", ev, stream, dev, err)
	}
	return nil
}

// EventQuery reports whether the work captured by ev (created on dev) has
// completed: CUDA_ERROR_NOT_READY is (false, nil).
func (d *Driver) EventQuery(dev int, ev uint64) (bool, error) {
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res { return C.gmp_event_query(d.fns, ctx, C.uint64_t(ev)) })
	var cerr *Error
	if errors.As(err, &cerr) && cerr.Code == CodeNotReady && cerr.Op == "cuEventQuery" {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("cuda: query event %#x on device %d: %w", ev, dev, err)
	}
	return true, nil
}

// EventSynchronize waits for the work captured by ev (created on dev).
func (d *Driver) EventSynchronize(dev int, ev uint64) error {
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res { return C.gmp_event_sync(d.fns, ctx, C.uint64_t(ev)) })
	if err != nil {
		return fmt.Errorf("cuda: synchronize event %#x on device %d: %w", ev, dev, err)
	}
	return nil
}

// EventDestroy destroys ev, created on dev.
func (d *Driver) EventDestroy(dev int, ev uint64) error {
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res { return C.gmp_event_destroy(d.fns, ctx, C.uint64_t(ev)) })
	if err != nil {
		return fmt.Errorf("cuda: destroy event %#x on device %d: %w", ev, dev, err)
	}
	return nil
}

// StreamSynchronize waits for the work queued on stream, a stream of dev.
func (d *Driver) StreamSynchronize(dev int, stream uint64) error {
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res { return C.gmp_stream_sync(d.fns, ctx, C.uint64_t(stream)) })
	if err != nil {
		return fmt.Errorf("cuda: synchronize stream %#x of device %d: %w", stream, dev, err)
	}
	return nil
}

// StreamCreate creates a stream on dev (cuStreamCreate) with flags
// (StreamDefault or StreamNonBlocking).
func (d *Driver) StreamCreate(dev int, flags uint32) (uint64, error) {
	if err := d.require(C.GMP_cuStreamCreate); err != nil {
		return 0, err
	}
	var s C.uint64_t
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res { return C.gmp_stream_create(d.fns, ctx, C.uint(flags), &s) })
	if err != nil {
		return 0, fmt.Errorf("cuda: create stream (flags %#x) on device %d: %w", flags, dev, err)
	}
	return uint64(s), nil
}

// StreamDestroy destroys a stream from StreamCreate (cuStreamDestroy_v2);
// work still queued on it completes first, without blocking the caller.
func (d *Driver) StreamDestroy(dev int, stream uint64) error {
	if err := d.require(C.GMP_cuStreamDestroy_v2); err != nil {
		return err
	}
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res { return C.gmp_stream_destroy(d.fns, ctx, C.uint64_t(stream)) })
	if err != nil {
		return fmt.Errorf("cuda: destroy stream %#x of device %d: %w", stream, dev, err)
	}
	return nil
}

// StreamIsCapturing returns the capture status (StreamCaptureStatus*) of
// stream, a stream of dev (cuStreamIsCapturing). For the legacy default
// stream while a blocking stream of the context captures, the driver
// answers CUDA_ERROR_STREAM_CAPTURE_IMPLICIT: the error is an *Error with
// Code CodeStreamCaptureImplicit.
func (d *Driver) StreamIsCapturing(dev int, stream uint64) (int, error) {
	if err := d.require(C.GMP_cuStreamIsCapturing); err != nil {
		return 0, err
	}
	var st C.int
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res {
		return C.gmp_stream_is_capturing(d.fns, ctx, C.uint64_t(stream), &st)
	})
	if err != nil {
		return 0, fmt.Errorf("cuda: capture status of stream %#x of device %d: %w", stream, dev, err)
	}
	return int(st), nil
}

// DeviceAttribute returns an attribute of dev (cuDeviceGetAttribute, one
// of the DeviceAttr* constants). It needs no context, so it retains none.
func (d *Driver) DeviceAttribute(dev, attr int) (int, error) {
	if err := d.require(C.GMP_cuDeviceGetAttribute); err != nil {
		return 0, err
	}
	if dev < 0 {
		return 0, fmt.Errorf("cuda: attribute %d of device %d: %w", attr, dev, gocore.ErrInvalidDevice)
	}
	d.closeMu.RLock()
	defer d.closeMu.RUnlock()
	if d.closed {
		return 0, fmt.Errorf("cuda: attribute %d of device %d: %w", attr, dev, ErrDriverClosed)
	}
	if d.noDevice != nil {
		return 0, fmt.Errorf("cuda: attribute %d of device %d: %w: the driver found no device (%v)",
			attr, dev, gocore.ErrInvalidDevice, d.noDevice)
	}
	var v C.int
	if err := d.errorOf(C.gmp_device_attribute(d.fns, C.int(dev), C.int(attr), &v)); err != nil {
		return 0, fmt.Errorf("cuda: attribute %d of device %d: %w", attr, dev, err)
	}
	return int(v), nil
}

// DeviceUUID returns dev's UUID (cuDeviceGetUuid_v2). It needs no context,
// so it retains none. A driver older than CUDA 11.4 lacks the entry point:
// the error wraps ErrDriverTooOld.
func (d *Driver) DeviceUUID(dev int) (UUID, error) {
	if err := d.require(C.GMP_cuDeviceGetUuid_v2); err != nil {
		return UUID{}, err
	}
	if dev < 0 {
		return UUID{}, fmt.Errorf("cuda: UUID of device %d: %w", dev, gocore.ErrInvalidDevice)
	}
	d.closeMu.RLock()
	defer d.closeMu.RUnlock()
	if d.closed {
		return UUID{}, fmt.Errorf("cuda: UUID of device %d: %w", dev, ErrDriverClosed)
	}
	if d.noDevice != nil {
		return UUID{}, fmt.Errorf("cuda: UUID of device %d: %w: the driver found no device (%v)",
			dev, gocore.ErrInvalidDevice, d.noDevice)
	}
	var u UUID
	if err := d.errorOf(C.gmp_device_uuid(d.fns, C.int(dev), (*C.uchar)(unsafe.Pointer(&u[0])))); err != nil {
		return UUID{}, fmt.Errorf("cuda: UUID of device %d: %w", dev, err)
	}
	return u, nil
}

// MemHostAlloc allocates size bytes of page-locked host memory
// (cuMemHostAlloc) with flags (HostAllocPortable, ...), under dev's
// context: cuMemHostAlloc needs a context, any one will do, and with
// HostAllocPortable the memory is pinned for all of them.
func (d *Driver) MemHostAlloc(dev int, size uint64, flags uint32) (uint64, error) {
	var p C.uint64_t
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res {
		return C.gmp_host_alloc(d.fns, ctx, C.size_t(size), C.uint(flags), &p)
	})
	if err != nil {
		return 0, fmt.Errorf("cuda: alloc %d bytes of pinned host memory (flags %#x): %w", size, flags, err)
	}
	return uint64(p), nil
}

// MemFreeHost frees memory from MemHostAlloc, under dev's context.
func (d *Driver) MemFreeHost(dev int, ptr uint64) error {
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res { return C.gmp_host_free(d.fns, ctx, C.uint64_t(ptr)) })
	if err != nil {
		return fmt.Errorf("cuda: free pinned host memory %#x: %w", ptr, err)
	}
	return nil
}

// MemHostGetFlags returns the flags ptr's pinned allocation was made with
// (cuMemHostGetFlags, under dev's context); it fails for memory that is not
// from MemHostAlloc.
func (d *Driver) MemHostGetFlags(dev int, ptr uint64) (uint32, error) {
	var f C.uint
	err := d.withCtx(dev, func(ctx C.uintptr_t) C.gmp_res {
		return C.gmp_host_get_flags(d.fns, ctx, C.uint64_t(ptr), &f)
	})
	if err != nil {
		return 0, fmt.Errorf("cuda: flags of pinned host memory %#x: %w", ptr, err)
	}
	return uint32(f), nil
}
