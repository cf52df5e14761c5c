// Package fakenccl builds tests/csrc/fake_nccl.c into shared libraries and
// drives its test controls, for the nccl backend's tests (cgo is not allowed
// in _test.go files, and the backend must dlopen a real file).
//
// Build compiles the fake once per process with the system C compiler ($CC,
// default cc) into a temporary directory; Cleanup removes it.
package fakenccl

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>

static uintptr_t fake_dlopen(const char* path) { return (uintptr_t)dlopen(path, RTLD_NOW | RTLD_LOCAL); }
static uintptr_t fake_dlsym(uintptr_t h, const char* sym) { return (uintptr_t)dlsym((void*)h, sym); }

static void call_vi(uintptr_t fn, int a) { ((void (*)(int))fn)(a); }
static void call_vii(uintptr_t fn, int a, int b) { ((void (*)(int, int))fn)(a, b); }
static void call_v(uintptr_t fn) { ((void (*)(void))fn)(); }
static void call_vs(uintptr_t fn, const char* s) { ((void (*)(const char*))fn)(s); }
static long call_l(uintptr_t fn) { return ((long (*)(void))fn)(); }
static int call_i(uintptr_t fn) { return ((int (*)(void))fn)(); }
static uintptr_t call_p(uintptr_t fn) { return (uintptr_t)((void* (*)(void))fn)(); }
static int call_push(uintptr_t fn, uintptr_t ctx) { return ((int (*)(void*))fn)((void*)ctx); }
static int call_registered(uintptr_t fn, long i, uintptr_t* comm, uintptr_t* buf, size_t* size) {
	void *c = NULL, *b = NULL;
	int ok = ((int (*)(long, void**, void**, size_t*))fn)(i, &c, &b, size);
	*comm = (uintptr_t)c;
	*buf = (uintptr_t)b;
	return ok;
}
static int call_pop(uintptr_t fn, uintptr_t* out) {
	void* ctx = NULL;
	int r = ((int (*)(void**))fn)(&ctx);
	*out = (uintptr_t)ctx;
	return r;
}
*/
import "C"

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"unsafe"
)

// Libs are the paths of the built fakes.
type Libs struct {
	// Fake is the full fake (no DT_SONAME, so it never passes for an
	// already-loaded libnccl.so.2).
	Fake string
	// Old is built with -DFAKE_NCCL_OLD: no ncclMemAlloc/ncclMemFree.
	Old string
	// NoRegister is built with -DFAKE_NCCL_NO_REGISTER: no
	// ncclCommRegister/ncclCommDeregister.
	NoRegister string
	// Soname is the full fake as a file named libnccl.so.2 with that
	// DT_SONAME, alone in SonameDir: what the dynamic loader finds through
	// LD_LIBRARY_PATH, or through RTLD_NOLOAD once loaded. Load it only in a
	// child process, or every later "find libnccl" in the process sees it.
	Soname    string
	SonameDir string
}

var (
	buildOnce sync.Once
	built     Libs
	buildErr  error
	tmpDir    string
)

// Build compiles the fakes on first call and returns their paths.
func Build() (Libs, error) {
	buildOnce.Do(func() { built, buildErr = build() })
	return built, buildErr
}

// Cleanup removes the build directory (call it from TestMain after m.Run).
// Libraries already loaded stay mapped.
func Cleanup() {
	if tmpDir != "" {
		os.RemoveAll(tmpDir)
	}
}

func build() (Libs, error) {
	src, err := source()
	if err != nil {
		return Libs{}, err
	}
	dir, err := os.MkdirTemp("", "gmp-fakenccl-")
	if err != nil {
		return Libs{}, fmt.Errorf("fakenccl: temp dir: %w", err)
	}
	tmpDir = dir
	libs := Libs{
		Fake:       filepath.Join(dir, "libfakenccl.so"),
		Old:        filepath.Join(dir, "libfakenccl-old.so"),
		NoRegister: filepath.Join(dir, "libfakenccl-noregister.so"),
		SonameDir:  filepath.Join(dir, "soname"),
	}
	libs.Soname = filepath.Join(libs.SonameDir, "libnccl.so.2")
	if err := os.Mkdir(libs.SonameDir, 0o755); err != nil {
		return Libs{}, fmt.Errorf("fakenccl: %w", err)
	}
	for _, b := range []struct {
		out   string
		extra []string
	}{
		{libs.Fake, nil},
		{libs.Old, []string{"-DFAKE_NCCL_OLD"}},
		{libs.NoRegister, []string{"-DFAKE_NCCL_NO_REGISTER"}},
		{libs.Soname, []string{"-Wl,-soname,libnccl.so.2"}},
	} {
		if err := compile(src, b.out, b.extra); err != nil {
			return Libs{}, err
		}
	}
	return libs, nil
}

func compile(src, out string, extra []string) error {
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "cc"
	}
	args := append([]string{"-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", out, src}, extra...)
	args = append(args, "-lpthread")
	cmd := exec.Command(cc, args...)
	var outBuf bytes.Buffer
	cmd.Stdout, cmd.Stderr = &outBuf, &outBuf
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("fakenccl: %s %v: %w\n%s", cc, args, err, outBuf.String())
	}
	return nil
}

// source finds tests/csrc/fake_nccl.c: next to this file's source when the
// path is known, else above the working directory (go test runs in the
// package directory), which also works under -trimpath.
func source() (string, error) {
	const rel = "tests/csrc/fake_nccl.c"
	var tried []string
	if _, file, _, ok := runtime.Caller(0); ok {
		p := filepath.Join(filepath.Dir(file), "..", "..", "..", "..", rel)
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
		tried = append(tried, p)
	}
	if wd, err := os.Getwd(); err == nil {
		for d := wd; ; d = filepath.Dir(d) {
			p := filepath.Join(d, rel)
			if _, err := os.Stat(p); err == nil {
				return p, nil
			}
			tried = append(tried, p)
			if filepath.Dir(d) == d {
				break
			}
		}
	}
	return "", fmt.Errorf("fakenccl: %s not found (tried %v)", rel, tried)
}

// Fake drives the controls of one loaded copy of the fake. dlopen of the
// same path returns the same copy the backend loaded, so the counters are
// the backend's.
type Fake struct {
	Path string
	fns  map[string]uintptr
}

var controls = []string{
	"fake_nccl_fail", "fake_nccl_fail_text", "fake_nccl_log_warning", "fake_nccl_fail_free", "fake_nccl_calls", "fake_nccl_frees", "fake_nccl_live_bytes",
	"fake_nccl_last_ctx", "fake_nccl_last_free_ctx", "fake_nccl_reset",
	"fake_ctx_push", "fake_ctx_pop", "fake_ctx_current", "fake_ctx_depth",
	"fake_ctx_balance", "fake_ctx_fail", "fake_ctx_exchange_capture_mode", "fake_ctx_capture_mode",
	"fake_nccl_last_capture_mode", "fake_nccl_last_free_capture_mode",
	"fake_nccl_registered", "fake_nccl_registrations",
}

// Open loads the fake at path (RTLD_LOCAL, like a library torch pulled in)
// and looks up its controls.
func Open(path string) (*Fake, error) {
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	h := C.fake_dlopen(cpath)
	if h == 0 {
		return nil, fmt.Errorf("fakenccl: dlopen %s failed", path)
	}
	f := &Fake{Path: path, fns: make(map[string]uintptr, len(controls))}
	var missing []error
	for _, name := range controls {
		cname := C.CString(name)
		fn := uintptr(C.fake_dlsym(h, cname))
		C.free(unsafe.Pointer(cname))
		if fn == 0 {
			missing = append(missing, fmt.Errorf("fakenccl: %s has no %s", path, name))
		}
		f.fns[name] = fn
	}
	return f, errors.Join(missing...)
}

func (f *Fake) fn(name string) C.uintptr_t { return C.uintptr_t(f.fns[name]) }

// Fail makes every ncclMemAlloc after the next afterCalls return code (0:
// stop failing).
func (f *Fake) Fail(code, afterCalls int) {
	C.call_vii(f.fn("fake_nccl_fail"), C.int(code), C.int(afterCalls))
}

// FailText sets the warning (ncclGetLastError) an injected failure logs;
// "" logs none.
func (f *Fake) FailText(text string) {
	ctext := C.CString(text)
	defer C.free(unsafe.Pointer(ctext))
	C.call_vs(f.fn("fake_nccl_fail_text"), ctext)
}

// LogWarning sets NCCL's last-warning text as some other NCCL activity of
// the process would.
func (f *Fake) LogWarning(text string) {
	ctext := C.CString(text)
	defer C.free(unsafe.Pointer(ctext))
	C.call_vs(f.fn("fake_nccl_log_warning"), ctext)
}

// FailFree makes every ncclMemFree return code and free nothing (0: stop).
func (f *Fake) FailFree(code int) { C.call_vi(f.fn("fake_nccl_fail_free"), C.int(code)) }

// Calls counts ncclMemAlloc calls, failed ones included.
func (f *Fake) Calls() int { return int(C.call_l(f.fn("fake_nccl_calls"))) }

// Frees counts successful ncclMemFree calls.
func (f *Fake) Frees() int { return int(C.call_l(f.fn("fake_nccl_frees"))) }

// LiveBytes is what ncclMemAlloc handed out and ncclMemFree has not taken back.
func (f *Fake) LiveBytes() int64 { return int64(C.call_l(f.fn("fake_nccl_live_bytes"))) }

// LastCtx is the context current during the last ncclMemAlloc (0: none).
func (f *Fake) LastCtx() uintptr { return uintptr(C.call_p(f.fn("fake_nccl_last_ctx"))) }

// LastFreeCtx is the context current during the last ncclMemFree (0: none).
func (f *Fake) LastFreeCtx() uintptr { return uintptr(C.call_p(f.fn("fake_nccl_last_free_ctx"))) }

// Reset zeroes counters and recorded contexts, stops injected failures and
// re-reads FAKE_NCCL_CAPACITY. Live allocations stay.
func (f *Fake) Reset() { C.call_v(f.fn("fake_nccl_reset")) }

// Registration is a range registered with ncclCommRegister.
type Registration struct {
	Comm, Buf uintptr
	Size      uint64
}

// Registered lists the ranges registered now, oldest first.
func (f *Fake) Registered() []Registration {
	var out []Registration
	for i := 0; ; i++ {
		var comm, buf C.uintptr_t
		var size C.size_t
		if C.call_registered(f.fn("fake_nccl_registered"), C.long(i), &comm, &buf, &size) == 0 {
			return out
		}
		out = append(out, Registration{Comm: uintptr(comm), Buf: uintptr(buf), Size: uint64(size)})
	}
}

// Registrations counts the ncclCommRegister calls that succeeded.
func (f *Fake) Registrations() int { return int(C.call_l(f.fn("fake_nccl_registrations"))) }

// PushFunc and PopFunc are the addresses of the fake cuCtxPushCurrent and
// cuCtxPopCurrent, for a test ContextSource.
func (f *Fake) PushFunc() uintptr { return f.fns["fake_ctx_push"] }

// PopFunc: see PushFunc.
func (f *Fake) PopFunc() uintptr { return f.fns["fake_ctx_pop"] }

// ExchangeCaptureModeFunc is the address of the fake
// cuThreadExchangeStreamCaptureMode (nccl.CaptureModeSource).
func (f *Fake) ExchangeCaptureModeFunc() uintptr { return f.fns["fake_ctx_exchange_capture_mode"] }

// CaptureMode is the calling OS thread's mode under that fake.
func (f *Fake) CaptureMode() int { return int(C.call_i(f.fn("fake_ctx_capture_mode"))) }

// LastCaptureMode is the mode the last ncclMemAlloc ran in (-1: none ran).
func (f *Fake) LastCaptureMode() int { return int(C.call_i(f.fn("fake_nccl_last_capture_mode"))) }

// LastFreeCaptureMode is the mode the last ncclMemFree ran in (-1: none ran).
func (f *Fake) LastFreeCaptureMode() int {
	return int(C.call_i(f.fn("fake_nccl_last_free_capture_mode")))
}

// Push pushes ctx on the calling OS thread's fake context stack (lock the
// goroutine to its thread around Push, the code under test and Pop).
func (f *Fake) Push(ctx uintptr) int {
	return int(C.call_push(f.fn("fake_ctx_push"), C.uintptr_t(ctx)))
}

// Pop pops the calling thread's fake context stack.
func (f *Fake) Pop() (uintptr, int) {
	var out C.uintptr_t
	r := C.call_pop(f.fn("fake_ctx_pop"), &out)
	return uintptr(out), int(r)
}

// Current is the top of the calling thread's stack (0: empty).
func (f *Fake) Current() uintptr { return uintptr(C.call_p(f.fn("fake_ctx_current"))) }

// Depth is the calling thread's stack depth.
func (f *Fake) Depth() int { return int(C.call_i(f.fn("fake_ctx_depth"))) }

// Balance is pushes minus pops over all threads since the last Reset.
func (f *Fake) Balance() int { return int(C.call_l(f.fn("fake_ctx_balance"))) }

// CtxFail makes every push and pop return these CUresults (0: succeed)
// until Reset.
func (f *Fake) CtxFail(pushCode, popCode int) {
	C.call_vii(f.fn("fake_ctx_fail"), C.int(pushCode), C.int(popCode))
}
