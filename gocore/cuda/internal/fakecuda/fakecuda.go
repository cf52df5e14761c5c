// Package fakecuda builds the fake driver tests/csrc/fake_cuda.c with the
// system C compiler and drives its fake_cuda_* test controls, for tests of
// package cuda on machines without a GPU. (cgo is not allowed in _test.go
// files, hence a package.)
//
// The fake keeps process-wide state, shared by every Driver that loads it,
// so tests that use it must not run in parallel; Open resets it.
package fakecuda

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static uintptr_t fc_open(const char *path) { return (uintptr_t)dlopen(path, RTLD_NOW | RTLD_LOCAL); }
static uintptr_t fc_sym(uintptr_t h, const char *name) { return (uintptr_t)dlsym((void *)h, name); }

static void fc_v(uintptr_t f) { ((void (*)(void))f)(); }
static void fc_v_i(uintptr_t f, int a) { ((void (*)(int))f)(a); }
static void fc_v_p(uintptr_t f, uintptr_t p) { ((void (*)(uintptr_t))f)(p); }
static int fc_i(uintptr_t f) { return ((int (*)(void))f)(); }
static int fc_i_i(uintptr_t f, int a) { return ((int (*)(int))f)(a); }
static int fc_i_p(uintptr_t f, uintptr_t p) { return ((int (*)(uintptr_t))f)(p); }
static int fc_i_pi(uintptr_t f, uintptr_t p, int a) { return ((int (*)(uintptr_t, int))f)(p, a); }
static void fc_v_pi(uintptr_t f, uintptr_t p, int a) { ((void (*)(uintptr_t, int))f)(p, a); }
static int fc_i_iii(uintptr_t f, int a, int b, int c) { return ((int (*)(int, int, int))f)(a, b, c); }
static long fc_l(uintptr_t f) { return ((long (*)(void))f)(); }
static long fc_l_i(uintptr_t f, int a) { return ((long (*)(int))f)(a); }
static long fc_l_s(uintptr_t f, const char *s) { return ((long (*)(const char *))f)(s); }
static int fc_i_s(uintptr_t f, const char *s) { return ((int (*)(const char *))f)(s); }
static long long fc_ll(uintptr_t f) { return ((long long (*)(void))f)(); }
static unsigned long long fc_ull_i(uintptr_t f, int a) { return ((unsigned long long (*)(int))f)(a); }
static unsigned long long fc_ull_s(uintptr_t f, const char *s) {
	return ((unsigned long long (*)(const char *))f)(s);
}
static void fc_v_3pi(uintptr_t f, int *a, int *b, int *c) { ((void (*)(int *, int *, int *))f)(a, b, c); }
static void fc_v_3pi_pull(uintptr_t f, int *a, int *b, int *c, unsigned long long *d) {
	((void (*)(int *, int *, int *, unsigned long long *))f)(a, b, c, d);
}
static int fc_i_ullull(uintptr_t f, unsigned long long a, unsigned long long b) {
	return ((int (*)(unsigned long long, unsigned long long))f)(a, b);
}
static int fc_fail(uintptr_t f, const char *s, int code, int after) {
	return ((int (*)(const char *, int, int))f)(s, code, after);
}

// Calls push(ctx), asks the fake which device is current, calls pop: how
// C code in another package would use Driver.ContextFuncs. One C call, so
// all on one thread.
static int fc_use_ctx(uintptr_t push, uintptr_t pop, uintptr_t current, uintptr_t ctx, int *dev) {
	int rc = ((int (*)(void *))push)((void *)ctx);
	if (rc != 0) return rc;
	*dev = ((int (*)(void))current)();
	void *popped = NULL;
	return ((int (*)(void **))pop)(&popped);
}

// Memory access for tests: the addresses are C memory the fake allocated.
static void fc_write(uint64_t dst, const void *src, size_t n) { memcpy((void *)(uintptr_t)dst, src, n); }
static void fc_read(void *dst, uint64_t src, size_t n) { memcpy(dst, (const void *)(uintptr_t)src, n); }
*/
import "C"

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"unsafe"
)

// Source is the path of tests/csrc/fake_cuda.c, found from this file's
// location in the repository.
func Source() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "..", "..", "tests", "csrc", "fake_cuda.c")
}

var (
	buildOnce sync.Once
	buildDir  string
	buildPath string
	buildErr  error
)

// Build compiles the fake driver once per process and returns the path of
// the library (named libcuda.so.1). It fails the test when there is no C
// compiler ($CC or cc) or the build fails: the cuda tests are worthless
// without it.
//
// The library lives in a directory of its own rather than in the first
// test's t.TempDir(), which is removed when that test ends: later tests load
// the same path again (after Driver.Close), and the library must still be
// there. Main removes the directory when the tests are done.
func Build(t testing.TB) string {
	t.Helper()
	buildOnce.Do(func() {
		buildDir, buildErr = os.MkdirTemp("", "gmp-fakecuda-")
		if buildErr != nil {
			return
		}
		buildPath = filepath.Join(buildDir, "libcuda.so.1")
		buildErr = compile(buildPath, []string{Source()})
	})
	if buildErr != nil {
		t.Fatalf("fakecuda: %v", buildErr)
	}
	return buildPath
}

// Main runs the tests and removes what Build made. Use it from TestMain:
//
//	func TestMain(m *testing.M) { os.Exit(fakecuda.Main(m)) }
func Main(m *testing.M) int {
	code := m.Run()
	if buildDir != "" {
		_ = os.RemoveAll(buildDir)
	}
	return code
}

// BuildHiding compiles the fake into t.TempDir() with the named entry
// points hidden (a linker version script makes them local), to test how a
// caller copes with an older or partial driver. Each call builds a new,
// separate library with its own state.
func BuildHiding(t testing.TB, hidden ...string) string {
	t.Helper()
	dir := t.TempDir()
	script := filepath.Join(dir, "hide.map")
	body := "{ global: *; local: " + strings.Join(hidden, "; ") + "; };\n"
	if err := os.WriteFile(script, []byte(body), 0o644); err != nil {
		t.Fatalf("fakecuda: %v", err)
	}
	out := filepath.Join(dir, "libcuda.so.1")
	if err := compile(out, []string{Source(), "-Wl,--version-script=" + script}); err != nil {
		t.Fatalf("fakecuda: %v", err)
	}
	return out
}

// CompileC compiles the C source src into a shared library named name in
// t.TempDir() and returns its path.
func CompileC(t testing.TB, name, src string) string {
	t.Helper()
	dir := t.TempDir()
	file := filepath.Join(dir, strings.TrimSuffix(name, filepath.Ext(name))+".c")
	if err := os.WriteFile(file, []byte(src), 0o644); err != nil {
		t.Fatalf("fakecuda: %v", err)
	}
	out := filepath.Join(dir, name)
	if err := compile(out, []string{file}); err != nil {
		t.Fatalf("fakecuda: %v", err)
	}
	return out
}

// compile builds a shared library with $CC (default cc).
func compile(out string, args []string) error {
	cc := strings.Fields(os.Getenv("CC"))
	if len(cc) == 0 {
		cc = []string{"cc"}
	}
	if _, err := exec.LookPath(cc[0]); err != nil {
		return fmt.Errorf("no C compiler to build the fake CUDA driver (set CC or install cc): %w", err)
	}
	argv := append(cc[1:], "-shared", "-fPIC", "-O1", "-g", "-Wall", "-o", out)
	argv = append(argv, args...)
	cmd := exec.Command(cc[0], argv...)
	if msg, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%s %s: %w\n%s", cc[0], strings.Join(argv, " "), err, msg)
	}
	return nil
}

// Fake drives one loaded copy of the fake driver through its controls.
type Fake struct {
	path string
	h    C.uintptr_t
	fns  map[string]C.uintptr_t
}

var controls = []string{
	"fake_cuda_reset", "fake_cuda_fail", "fake_cuda_calls", "fake_cuda_live_bytes", "fake_cuda_live_allocs",
	"fake_cuda_live_events", "fake_cuda_ctx_depth", "fake_cuda_ctx_balance", "fake_cuda_current_device",
	"fake_cuda_push_device", "fake_cuda_pop_device", "fake_cuda_retained", "fake_cuda_ptr_device",
	"fake_cuda_access", "fake_cuda_vmm_objects", "fake_cuda_live_pools", "fake_cuda_set_manual_events",
	"fake_cuda_complete_stream", "fake_cuda_complete_all", "fake_cuda_last_stream", "fake_cuda_last_mem_create",
	"fake_cuda_last_pool_create", "fake_cuda_set_granularity", "fake_cuda_imported_ptrs",
	"fake_cuda_set_global_capture", "fake_cuda_capture_violations", "fake_cuda_capture_mode",
	"fake_cuda_set_stream_capturing", "fake_cuda_live_streams", "fake_cuda_stream_info", "fake_cuda_pool_access",
	"fake_cuda_set_device_attribute", "fake_cuda_last_mem_create_rdma", "fake_cuda_set_visible_order",
	"fake_cuda_hold",
}

// Open builds the fake (once per process), loads it and resets it.
// dlopen returns the same library a cuda.Driver loads from that path, so
// the controls act on the driver the code under test uses.
func Open(t testing.TB) *Fake {
	t.Helper()
	return OpenPath(t, Build(t))
}

// OpenPath loads the fake at path (e.g. from BuildHiding) and resets it.
func OpenPath(t testing.TB, path string) *Fake {
	t.Helper()
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	h := C.fc_open(cpath)
	if h == 0 {
		t.Fatalf("fakecuda: dlopen %s failed", path)
	}
	f := &Fake{path: path, h: h, fns: make(map[string]C.uintptr_t, len(controls))}
	for _, name := range controls {
		cname := C.CString(name)
		fn := C.fc_sym(h, cname)
		C.free(unsafe.Pointer(cname))
		if fn == 0 {
			t.Fatalf("fakecuda: %s has no %s", path, name)
		}
		f.fns[name] = fn
	}
	f.Reset()
	return f
}

// Path returns the library's path, for cuda.Load.
func (f *Fake) Path() string { return f.path }

// Hold parks every driver entry point on entry (on) until Hold(false)
// lets them go on: a test makes calls of the code under test wait in the
// driver, to check what waits for them.
func (f *Fake) Hold(on bool) {
	v := C.int(0)
	if on {
		v = 1
	}
	C.fc_v_i(f.fns["fake_cuda_hold"], v)
}

// Reset frees everything the fake holds, clears counters, injected
// failures, manual events, recorded and created streams, captures, device
// attributes and properties, the VMM granularities (back to 2 MiB) and
// SetVisibleOrder, drops every thread's context stack and re-reads
// FAKE_CUDA_DEVICES, FAKE_CUDA_CAPACITY and FAKE_CUDA_VISIBLE_ORDER. Retained primary
// contexts survive (a loaded Driver keeps its own).
func (f *Fake) Reset() { C.fc_v(f.fns["fake_cuda_reset"]) }

// Fail makes the named entry point return code once afterCalls more calls
// have gone through, and keep returning it until Fail(fn, 0, 0) clears it.
func (f *Fake) Fail(fn string, code, afterCalls int) {
	cfn := C.CString(fn)
	defer C.free(unsafe.Pointer(cfn))
	if C.fc_fail(f.fns["fake_cuda_fail"], cfn, C.int(code), C.int(afterCalls)) != 0 {
		panic("fakecuda: Fail: unknown entry point " + fn)
	}
}

// Calls returns how many times the named entry point was called since the
// last reset.
func (f *Fake) Calls(fn string) int {
	cfn := C.CString(fn)
	defer C.free(unsafe.Pointer(cfn))
	n := C.fc_l_s(f.fns["fake_cuda_calls"], cfn)
	if n < 0 {
		panic("fakecuda: Calls: unknown entry point " + fn)
	}
	return int(n)
}

// LiveBytes returns the bytes of live allocations on dev (cuMemAlloc, pool
// allocations, cuMemCreate handles); dev -1: pinned host memory.
func (f *Fake) LiveBytes(dev int) uint64 {
	return uint64(C.fc_ull_i(f.fns["fake_cuda_live_bytes"], C.int(dev)))
}

// LiveAllocs counts the allocations LiveBytes sums.
func (f *Fake) LiveAllocs(dev int) int {
	return int(C.fc_l_i(f.fns["fake_cuda_live_allocs"], C.int(dev)))
}

// LiveEvents counts the live events created on dev.
func (f *Fake) LiveEvents(dev int) int {
	return int(C.fc_l_i(f.fns["fake_cuda_live_events"], C.int(dev)))
}

// CtxDepth returns the depth of the calling OS thread's context stack. It
// means something only on a goroutine locked to its thread
// (runtime.LockOSThread), the thread its driver calls ran on.
func (f *Fake) CtxDepth() int { return int(C.fc_i(f.fns["fake_cuda_ctx_depth"])) }

// CtxBalance returns pushes minus pops over all threads since the last
// reset: anything but 0 after a call means a context was left current
// somewhere.
func (f *Fake) CtxBalance() int64 { return int64(C.fc_ll(f.fns["fake_cuda_ctx_balance"])) }

// CurrentDevice returns the device of the calling thread's current
// context, or -1 (see CtxDepth about threads).
func (f *Fake) CurrentDevice() int { return int(C.fc_i(f.fns["fake_cuda_current_device"])) }

// PushDevice makes dev's primary context current on the calling thread, as
// an application would, so a test can check that calls leave it current.
func (f *Fake) PushDevice(dev int) error {
	if rc := C.fc_i_i(f.fns["fake_cuda_push_device"], C.int(dev)); rc != 0 {
		return fmt.Errorf("fakecuda: push device %d: CUresult %d", dev, int(rc))
	}
	return nil
}

// PopDevice undoes PushDevice (or any push) on the calling thread.
func (f *Fake) PopDevice() error {
	if rc := C.fc_i(f.fns["fake_cuda_pop_device"]); rc != 0 {
		return fmt.Errorf("fakecuda: pop: CUresult %d", int(rc))
	}
	return nil
}

// Retained returns how many times dev's primary context is retained.
func (f *Fake) Retained(dev int) int { return int(C.fc_l_i(f.fns["fake_cuda_retained"], C.int(dev))) }

// PtrDevice returns the device of the allocation containing ptr, -1 for
// pinned host memory, -2 when ptr is in no allocation.
func (f *Fake) PtrDevice(ptr uint64) int {
	return int(C.fc_i_p(f.fns["fake_cuda_ptr_device"], C.uintptr_t(ptr)))
}

// Access returns the access flags cuMemSetAccess gave dev on the mapping
// holding ptr, or -1 when ptr is not mapped.
func (f *Fake) Access(ptr uint64, dev int) int {
	return int(C.fc_i_pi(f.fns["fake_cuda_access"], C.uintptr_t(ptr), C.int(dev)))
}

// VMMObjects counts live VMM handles, reservations and mappings.
func (f *Fake) VMMObjects() int { return int(C.fc_l(f.fns["fake_cuda_vmm_objects"])) }

// LivePools counts memory pools not destroyed.
func (f *Fake) LivePools() int { return int(C.fc_l(f.fns["fake_cuda_live_pools"])) }

// SetManualEvents switches between automatic mode (every event complete)
// and manual mode (an event completes when its stream does).
func (f *Fake) SetManualEvents(on bool) {
	v := 0
	if on {
		v = 1
	}
	C.fc_v_i(f.fns["fake_cuda_set_manual_events"], C.int(v))
}

// SetGlobalCapture plays (true) or ends (false) a CUDA graph capture by
// another thread in the default, global mode: allocations are refused
// unless the calling thread is in the relaxed capture mode, and frees,
// event record/query and stream syncs are refused.
func (f *Fake) SetGlobalCapture(on bool) {
	v := 0
	if on {
		v = 1
	}
	C.fc_v_i(f.fns["fake_cuda_set_global_capture"], C.int(v))
}

// CaptureViolations counts the calls refused because of a capture.
func (f *Fake) CaptureViolations() int { return int(C.fc_l(f.fns["fake_cuda_capture_violations"])) }

// CaptureMode is the calling OS thread's stream-capture mode
// (CU_STREAM_CAPTURE_MODE_*; 0, global, unless changed).
func (f *Fake) CaptureMode() int { return int(C.fc_i(f.fns["fake_cuda_capture_mode"])) }

// SetStreamCapturing marks stream as capturing a CUDA graph (or no longer).
// A capturing stream counts as a capture for the rules of SetGlobalCapture;
// cuStreamIsCapturing reports it; cuMemAllocFromPoolAsync, cuMemFreeAsync
// and cuStreamSynchronize refuse it (and the legacy stream, 0 or 1, while a
// stream not created non-blocking captures) and count a violation.
func (f *Fake) SetStreamCapturing(stream uint64, on bool) {
	v := 0
	if on {
		v = 1
	}
	C.fc_v_pi(f.fns["fake_cuda_set_stream_capturing"], C.uintptr_t(stream), C.int(v))
}

// LiveStreams counts the streams made with cuStreamCreate and not destroyed.
func (f *Fake) LiveStreams() int { return int(C.fc_l(f.fns["fake_cuda_live_streams"])) }

// StreamInfo returns the device and the flags of a live stream made with
// cuStreamCreate; ok is false for any other handle.
func (f *Fake) StreamInfo(stream uint64) (dev int, flags int, ok bool) {
	v := int(C.fc_i_p(f.fns["fake_cuda_stream_info"], C.uintptr_t(stream)))
	if v < 0 {
		return 0, 0, false
	}
	return v >> 8, v & 0xff, true
}

// PoolAccess returns the access flags (CUmemAccess_flags) dev has to pool,
// or -1 for an unknown pool.
func (f *Fake) PoolAccess(pool uint64, dev int) int {
	return int(C.fc_i_pi(f.fns["fake_cuda_pool_access"], C.uintptr_t(pool), C.int(dev)))
}

// SetDeviceAttribute sets what cuDeviceGetAttribute reports for attr on
// dev; only CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
// (110) is known, 0 until set. cuMemCreate accepts
// allocFlags.gpuDirectRDMACapable only on devices where it is 1.
func (f *Fake) SetDeviceAttribute(dev, attr, value int) {
	if C.fc_i_iii(f.fns["fake_cuda_set_device_attribute"], C.int(dev), C.int(attr), C.int(value)) != 0 {
		panic(fmt.Sprintf("fakecuda: SetDeviceAttribute(%d, %d): unknown device or attribute", dev, attr))
	}
}

// SetVisibleOrder makes this process see the fake GPUs listed in order
// (GPU indices separated by commas, like CUDA_VISIBLE_DEVICES: "1,0" makes
// ordinal 0 GPU 1) and returns the new device count. Only the device count
// and each ordinal's UUID (cuDeviceGetUuid_v2) change; GPU g's UUID is
// fa4ec0da-0000-4000-8000-0000000000gg. "" goes back to
// $FAKE_CUDA_VISIBLE_ORDER (unset: ordinal i is GPU i); Reset does too.
func (f *Fake) SetVisibleOrder(order string) int {
	if order == "" {
		return int(C.fc_i_s(f.fns["fake_cuda_set_visible_order"], nil))
	}
	corder := C.CString(order)
	defer C.free(unsafe.Pointer(corder))
	return int(C.fc_i_s(f.fns["fake_cuda_set_visible_order"], corder))
}

// LastMemCreateRDMA returns allocFlags.gpuDirectRDMACapable of the last
// cuMemCreate call (0 before any).
func (f *Fake) LastMemCreateRDMA() int { return int(C.fc_i(f.fns["fake_cuda_last_mem_create_rdma"])) }

// CompleteStream completes the work recorded so far on stream.
func (f *Fake) CompleteStream(stream uint64) {
	C.fc_v_p(f.fns["fake_cuda_complete_stream"], C.uintptr_t(stream))
}

// LastStream returns the stream handle the last call of the named entry
// point was given: cuMemAllocFromPoolAsync, cuMemFreeAsync, cuEventRecord
// and cuStreamSynchronize record it (0 before any call, and for others).
func (f *Fake) LastStream(fn string) uint64 {
	cfn := C.CString(fn)
	defer C.free(unsafe.Pointer(cfn))
	s := uint64(C.fc_ull_s(f.fns["fake_cuda_last_stream"], cfn))
	if s == ^uint64(0) {
		panic("fakecuda: LastStream: unknown entry point " + fn)
	}
	return s
}

// LastMemCreate returns the location type and id and the requested handle
// types of the CUmemAllocationProp the last cuMemCreate call was given (all
// 0 before any call).
func (f *Fake) LastMemCreate() (locType, locID, handleTypes int) {
	var t, id, h C.int
	C.fc_v_3pi(f.fns["fake_cuda_last_mem_create"], &t, &id, &h)
	return int(t), int(id), int(h)
}

// LastPoolCreate returns the location type and id, the handle types and the
// maxSize of the CUmemPoolProps the last cuMemPoolCreate call was given.
func (f *Fake) LastPoolCreate() (locType, locID, handleTypes int, maxSize uint64) {
	var t, id, h C.int
	var m C.ulonglong
	C.fc_v_3pi_pull(f.fns["fake_cuda_last_pool_create"], &t, &id, &h, &m)
	return int(t), int(id), int(h), uint64(m)
}

// SetGranularity sets the minimum and recommended granularities the fake
// reports (powers of two, recommended >= minimum); VMM calls check sizes,
// offsets and addresses against the minimum. Call it right after Open,
// before any VMM object exists. Reset restores 2 MiB for both.
func (f *Fake) SetGranularity(minimum, recommended uint64) {
	if C.fc_i_ullull(f.fns["fake_cuda_set_granularity"], C.ulonglong(minimum), C.ulonglong(recommended)) != 0 {
		panic(fmt.Sprintf("fakecuda: SetGranularity(%d, %d): invalid granularities", minimum, recommended))
	}
}

// ImportedPointers counts pointers imported with cuMemPoolImportPointer and
// not yet freed with cuMemFree_v2.
func (f *Fake) ImportedPointers() int { return int(C.fc_l(f.fns["fake_cuda_imported_ptrs"])) }

// CompleteAll completes the work recorded so far on every stream.
func (f *Fake) CompleteAll() { C.fc_v(f.fns["fake_cuda_complete_all"]) }

// UseContext pushes ctx with the function at push, reads the current
// device, and pops with the function at pop, all in one C call, as C code
// given Driver.ContextFuncs would. It returns the device that was current.
func (f *Fake) UseContext(push, pop, ctx uintptr) (int, error) {
	var dev C.int = -1
	if rc := C.fc_use_ctx(C.uintptr_t(push), C.uintptr_t(pop), f.fns["fake_cuda_current_device"],
		C.uintptr_t(ctx), &dev); rc != 0 {
		return -1, fmt.Errorf("fakecuda: push/pop through ContextFuncs: CUresult %d", int(rc))
	}
	return int(dev), nil
}

// Write copies b to the fake's memory at addr (device memory of the fake
// is host memory).
func Write(addr uint64, b []byte) {
	if len(b) > 0 {
		C.fc_write(C.uint64_t(addr), unsafe.Pointer(&b[0]), C.size_t(len(b)))
	}
}

// Read copies n bytes of the fake's memory at addr.
func Read(addr uint64, n int) []byte {
	b := make([]byte, n)
	if n > 0 {
		C.fc_read(unsafe.Pointer(&b[0]), C.uint64_t(addr), C.size_t(n))
	}
	return b
}
