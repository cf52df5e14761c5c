package libnccl

/*
#cgo LDFLAGS: -ldl
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "nccl_api.h"

static void gmp_copy(char* dst, size_t len, const char* src) {
	strncpy(dst, src, len - 1);
	dst[len - 1] = 0;
}

// dlerror's text is per thread, so it is read in the same C call as the
// failing dlopen: a goroutine may change OS threads between cgo calls.
static uintptr_t gmp_dlopen(const char* name, int noload, char* err, size_t errlen) {
	dlerror();
	void* h = dlopen(name, RTLD_NOW | RTLD_LOCAL | (noload ? RTLD_NOLOAD : 0));
	if (h == NULL) {
		const char* e = dlerror();
		gmp_copy(err, errlen, e ? e : "not loaded");
	}
	return (uintptr_t)h;
}

static uintptr_t gmp_dlsym(uintptr_t h, const char* sym) { return (uintptr_t)dlsym((void*)h, sym); }

static void gmp_dlclose(uintptr_t h) { dlclose((void*)h); }

// The file an address belongs to: how a library found by soname gets a path.
static int gmp_dladdr_path(uintptr_t addr, char* buf, size_t len) {
	Dl_info info;
	if (dladdr((void*)addr, &info) == 0 || info.dli_fname == NULL) return 0;
	gmp_copy(buf, len, info.dli_fname);
	return 1;
}

static int gmp_nccl_version(uintptr_t fn, int* v) { return ((gmp_nccl_version_fn)fn)(v); }

static const char* gmp_nccl_errstr(uintptr_t fn, int r) { return ((gmp_nccl_errstr_fn)fn)(r); }

typedef struct {
	int nccl; // ncclResult_t of the NCCL call (0 when it was not made)
	int push; // CUresult of cuCtxPushCurrent (0 when not called)
	int pop;  // CUresult of cuCtxPopCurrent (0 when not called)
	uintptr_t ptr;
	char last[256]; // after a failure: ncclGetLastError's text ("" when none)
	int last_new;   // whether the call changed that text
} gmp_nccl_result;

// gmp_result_reset makes r say "no call made" before a call fills it in.
static void gmp_result_reset(gmp_nccl_result* r) { memset(r, 0, sizeof *r); }

// NCCL keeps the text of its last WARN in one process-wide buffer
// (ncclGetLastError), never cleared: copy it before the call, and after a
// failure report it with whether the call changed it.
static void gmp_last_before(uintptr_t last_error, char* prev, size_t len) {
	const char* s = last_error ? ((gmp_nccl_last_error_fn)last_error)(NULL) : NULL;
	gmp_copy(prev, len, s ? s : "");
}

static void gmp_last_after(uintptr_t last_error, const char* prev, gmp_nccl_result* r) {
	const char* s = last_error ? ((gmp_nccl_last_error_fn)last_error)(NULL) : NULL;
	if (r->nccl == 0 || s == NULL || s[0] == 0) return;
	gmp_copy(r->last, sizeof r->last, s);
	r->last_new = strncmp(s, prev, sizeof r->last - 1) != 0;
}

// Push ctx, ncclMemAlloc, pop, in one C call so that all three run on one OS
// thread (CUDA contexts are per thread). push == 0: call NCCL on whatever is
// current.
//
// exchange, when not 0, is cuThreadExchangeStreamCaptureMode: the NCCL calls
// then run in the relaxed capture mode (and the thread's mode is restored
// after them), so that they are not refused while another thread records a
// CUDA graph in the global mode (see GMP_IN_CTX in package driver's shim.h).
// The mode is per thread, not per context, so it may span the pop.
static int gmp_relax(uintptr_t exchange, int* mode) {
	*mode = 2; // CU_STREAM_CAPTURE_MODE_RELAXED
	return exchange && ((gmp_cu_exchange_capture_mode_fn)exchange)(mode) == 0;
}

static void gmp_unrelax(uintptr_t exchange, int relaxed, int* mode) {
	if (relaxed) ((gmp_cu_exchange_capture_mode_fn)exchange)(mode);
}

static void gmp_nccl_mem_alloc(uintptr_t alloc, uintptr_t free_fn, uintptr_t push, uintptr_t pop,
		uintptr_t exchange, uintptr_t last_error, uintptr_t ctx, size_t size, gmp_nccl_result* r) {
	gmp_result_reset(r);
	if (push && (r->push = ((gmp_cu_push_fn)push)((void*)ctx)) != 0) return;
	void* p = NULL;
	int mode;
	char prev[sizeof r->last];
	gmp_last_before(last_error, prev, sizeof prev);
	int relaxed = gmp_relax(exchange, &mode);
	r->nccl = ((gmp_nccl_alloc_fn)alloc)(&p, size);
	gmp_last_after(last_error, prev, r);
	if (r->nccl == 0) r->ptr = (uintptr_t)p;
	if (push) {
		void* old = NULL;
		r->pop = ((gmp_cu_pop_fn)pop)(&old);
		if (r->pop != 0 && r->ptr != 0) {
			// The call is reported as failed, so nobody would ever free
			// the memory: hand it back while our context is (still)
			// current, in the relaxed mode like the alloc.
			((gmp_nccl_free_fn)free_fn)((void*)r->ptr);
			r->ptr = 0;
		}
	}
	gmp_unrelax(exchange, relaxed, &mode);
}

// ncclCommRegister(comm, buf, size, &handle) and ncclCommDeregister(comm,
// handle), with the warning NCCL logged for a failure. No context is pushed:
// NCCL makes the communicator's device current itself.
static void gmp_nccl_comm_register(uintptr_t reg, uintptr_t last_error, uintptr_t comm, uintptr_t buf,
		size_t size, gmp_nccl_result* r) {
	gmp_result_reset(r);
	char prev[sizeof r->last];
	gmp_last_before(last_error, prev, sizeof prev);
	void* handle = NULL;
	r->nccl = ((gmp_nccl_comm_register_fn)reg)((void*)comm, (void*)buf, size, &handle);
	gmp_last_after(last_error, prev, r);
	if (r->nccl == 0) r->ptr = (uintptr_t)handle;
}

static void gmp_nccl_comm_deregister(uintptr_t dereg, uintptr_t last_error, uintptr_t comm, uintptr_t handle,
		gmp_nccl_result* r) {
	gmp_result_reset(r);
	char prev[sizeof r->last];
	gmp_last_before(last_error, prev, sizeof prev);
	r->nccl = ((gmp_nccl_comm_deregister_fn)dereg)((void*)comm, (void*)handle);
	gmp_last_after(last_error, prev, r);
}

// Push ctx, ncclMemFree, pop (see gmp_nccl_mem_alloc), in the relaxed
// capture mode too: like cuMemFree in package cuda.
static void gmp_nccl_mem_free(uintptr_t free_fn, uintptr_t push, uintptr_t pop, uintptr_t exchange,
		uintptr_t last_error, uintptr_t ctx, uintptr_t ptr, gmp_nccl_result* r) {
	gmp_result_reset(r);
	if (push && (r->push = ((gmp_cu_push_fn)push)((void*)ctx)) != 0) return;
	int mode;
	char prev[sizeof r->last];
	gmp_last_before(last_error, prev, sizeof prev);
	int relaxed = gmp_relax(exchange, &mode);
	r->nccl = ((gmp_nccl_free_fn)free_fn)((void*)ptr);
	gmp_last_after(last_error, prev, r);
	gmp_unrelax(exchange, relaxed, &mode);
	if (!push) return;
	void* old = NULL;
	r->pop = ((gmp_cu_pop_fn)pop)(&old);
}
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"unsafe"
)

// sonames are what an NCCL loaded by someone else (torch) is known as; the
// first is also the name dlopen searches the loader path for.
var sonames = []string{"libnccl.so.2", "libnccl.so"}

// Lib is a loaded libnccl with the functions the backend calls. It is never
// unloaded: memory it handed out may outlive any one backend.
type Lib struct {
	path                string
	code                int
	major, minor, patch int
	memAlloc, memFree   uintptr
	errorString         uintptr
	lastError           uintptr // ncclGetLastError (NCCL 2.13+); 0 when missing
	// ncclCommRegister and ncclCommDeregister (NCCL 2.19+); 0 when missing:
	// only CommRegister and CommDeregister need them.
	commRegister, commDeregister uintptr

	detailMu   sync.Mutex
	lastDetail string // the warning last credited to a failed call of ours
}

var libs struct {
	sync.Mutex
	byPath map[string]*Lib // by resolved path
}

// Load opens libnccl and checks that it has ncclMemAlloc (NCCL >= 2.19).
//
// An NCCL already loaded in the process (a libnccl.so.2 or libnccl.so that
// torch loaded, found with RTLD_NOLOAD) comes first: the backend shares that
// copy, and no second NCCL is loaded next to it. Then:
//   - path, else $GMP_LIBNCCL, names the library wanted. With an NCCL
//     already loaded it must be that very file (by name or inode): anything
//     else is an error wrapping ErrConflict, not a silent choice of one of
//     the two. With none loaded, that file is opened (an error if it cannot
//     be: the user asked for it).
//   - with neither, the loaded NCCL, else libnccl.so.2 on the dynamic
//     loader's search path.
//
// A library that cannot be found or is not NCCL gives an error wrapping
// ErrNoNCCL; an NCCL without ncclMemAlloc one wrapping ErrTooOld. Libraries
// are cached by resolved path: loading the same file twice returns the same
// *Lib. Load is safe for concurrent use.
func Load(path string) (*Lib, error) {
	libs.Lock()
	defer libs.Unlock()
	h, name, preloaded, err := open(path)
	if err != nil {
		return nil, err
	}
	lib, err := fromHandle(h, name, preloaded)
	if err != nil {
		// Drop our reference; a copy someone else loaded stays loaded.
		C.gmp_dlclose(h)
		return nil, err
	}
	return lib, nil
}

const hint = "point " + EnvLibrary + ` (or the "path" option) at libnccl.so.2 (NCCL >= 2.19)`

// hintLoaded is the advice for an NCCL that was in the process before us:
// neither GMP_LIBNCCL nor a path can replace it.
const hintLoaded = "it was loaded before gpumempool (by torch?), and " + EnvLibrary + ` or the "path" option cannot ` +
	"replace an NCCL already in the process (two NCCLs do not mix): make the process load NCCL >= 2.19 " +
	"first (a newer NCCL for torch, e.g. its nvidia-nccl package, or LD_PRELOAD of a newer libnccl.so.2)"

// open finds the library as Load documents and returns its handle, the name
// it was opened by and whether it was in the process already.
func open(path string) (C.uintptr_t, string, bool, error) {
	want, what, undo := path, "the path "+path, "leave the path (libnccl=) out"
	if want == "" {
		if env := os.Getenv(EnvLibrary); env != "" {
			want, what, undo = env, EnvLibrary+"="+env, "unset "+EnvLibrary
		}
	}
	for _, name := range sonames {
		loaded, err := dlopen(name, true)
		if err != nil {
			continue
		}
		if want == "" {
			return loaded, name, true, nil
		}
		// The file wanted, if the process has it loaded: the same handle
		// when it is the loaded NCCL.
		if h, err := dlopen(want, true); err == nil {
			C.gmp_dlclose(h)
			if h == loaded {
				return loaded, name, true, nil
			}
		}
		desc := describe(loaded, name)
		C.gmp_dlclose(loaded)
		return 0, "", false, fmt.Errorf("nccl: %s names another library than the NCCL this process has already loaded, %s: %w; "+
			"it was loaded first (by torch?), and a second NCCL is not loaded next to it (two NCCLs do not mix): "+
			"%s to use the loaded one, or make the process load the one you want "+
			"before anything loads NCCL (LD_PRELOAD)", what, desc, ErrConflict, undo)
	}
	if want != "" {
		h, err := dlopen(want, false)
		if err != nil {
			return 0, "", false, fmt.Errorf("nccl: load %s: %w: %s; %s", strings.TrimPrefix(what, "the path "), ErrNoNCCL, err, hint)
		}
		return h, want, false, nil
	}
	h, err := dlopen(sonames[0], false)
	if err != nil {
		return 0, "", false, fmt.Errorf("nccl: %w: none loaded in this process, %s is unset, and %s; %s",
			ErrNoNCCL, EnvLibrary, err, hint)
	}
	return h, sonames[0], false, nil
}

// describe names a loaded library for a message: "path (NCCL x.y.z)".
func describe(h C.uintptr_t, name string) string {
	getVersion := dlsym(h, "ncclGetVersion")
	if getVersion == 0 {
		return name
	}
	var code C.int
	if C.gmp_nccl_version(C.uintptr_t(getVersion), &code) != 0 {
		return resolve(getVersion, name)
	}
	major, minor, patch := DecodeVersion(int(code))
	return fmt.Sprintf("%s (NCCL %d.%d.%d)", resolve(getVersion, name), major, minor, patch)
}

func dlopen(name string, noload bool) (C.uintptr_t, error) {
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	var buf [1024]C.char
	nl := C.int(0)
	if noload {
		nl = 1
	}
	h := C.gmp_dlopen(cname, nl, &buf[0], C.size_t(len(buf)))
	if h == 0 {
		return 0, errors.New(C.GoString(&buf[0]))
	}
	return h, nil
}

func dlsym(h C.uintptr_t, sym string) uintptr {
	csym := C.CString(sym)
	defer C.free(unsafe.Pointer(csym))
	return uintptr(C.gmp_dlsym(h, csym))
}

// fromHandle checks an opened library and returns its (cached) Lib;
// preloaded: it was in the process before Load (which changes the advice).
// Called with libs locked.
func fromHandle(h C.uintptr_t, name string, preloaded bool) (*Lib, error) {
	advice := hint
	if preloaded {
		advice = hintLoaded
	}
	getVersion := dlsym(h, "ncclGetVersion")
	if getVersion == 0 {
		return nil, fmt.Errorf("nccl: %s has no ncclGetVersion, so it is not libnccl: %w; %s", name, ErrNoNCCL, advice)
	}
	path := resolve(getVersion, name)
	if lib := libs.byPath[path]; lib != nil {
		// dlopen counted another reference to the same copy; the cached
		// Lib holds one already.
		C.gmp_dlclose(h)
		return lib, nil
	}
	var code C.int
	if r := C.gmp_nccl_version(C.uintptr_t(getVersion), &code); r != 0 {
		return nil, fmt.Errorf("nccl: %s: ncclGetVersion failed with ncclResult_t %d", path, int(r))
	}
	lib := &Lib{path: path, code: int(code)}
	lib.major, lib.minor, lib.patch = DecodeVersion(lib.code)
	if lib.major < 2 || (lib.major == 2 && lib.minor < 19) {
		return nil, fmt.Errorf("nccl: %s is NCCL %d.%d.%d (version code %d); ncclMemAlloc needs NCCL >= 2.19: %w; %s",
			path, lib.major, lib.minor, lib.patch, lib.code, ErrTooOld, advice)
	}
	lib.memAlloc, lib.memFree = dlsym(h, "ncclMemAlloc"), dlsym(h, "ncclMemFree")
	if lib.memAlloc == 0 || lib.memFree == 0 {
		return nil, fmt.Errorf("nccl: %s (NCCL %d.%d.%d) does not export ncclMemAlloc/ncclMemFree; ncclMemAlloc needs NCCL >= 2.19: %w; %s",
			path, lib.major, lib.minor, lib.patch, ErrTooOld, advice)
	}
	if lib.errorString = dlsym(h, "ncclGetErrorString"); lib.errorString == 0 {
		return nil, fmt.Errorf("nccl: %s has no ncclGetErrorString, so it is not libnccl: %w", path, ErrNoNCCL)
	}
	lib.lastError = dlsym(h, "ncclGetLastError")
	lib.commRegister, lib.commDeregister = dlsym(h, "ncclCommRegister"), dlsym(h, "ncclCommDeregister")
	if libs.byPath == nil {
		libs.byPath = make(map[string]*Lib)
	}
	libs.byPath[path] = lib
	return lib, nil
}

// resolve names the file that defines sym (a library found by soname only
// has its soname), symlinks resolved so that every name of one file shares
// a cache entry.
func resolve(sym uintptr, name string) string {
	var buf [4096]C.char
	path := name
	if C.gmp_dladdr_path(C.uintptr_t(sym), &buf[0], C.size_t(len(buf))) != 0 {
		path = C.GoString(&buf[0])
	}
	if real, err := filepath.EvalSymlinks(path); err == nil {
		path = real
	}
	return path
}

// Path is the file the library was loaded from.
func (l *Lib) Path() string { return l.path }

// Version is the NCCL version the library reports.
func (l *Lib) Version() (major, minor, patch int) { return l.major, l.minor, l.patch }

// String describes the library for logs, e.g. "NCCL 2.23.4 (/usr/lib/libnccl.so.2)".
func (l *Lib) String() string {
	return fmt.Sprintf("NCCL %d.%d.%d (%s)", l.major, l.minor, l.patch, l.path)
}

// ErrorString is NCCL's text for a result code.
func (l *Lib) ErrorString(r Result) string {
	s := C.gmp_nccl_errstr(C.uintptr_t(l.errorString), C.int(r))
	if s == nil {
		return "unknown NCCL result"
	}
	return C.GoString(s)
}

// MemAlloc calls ncclMemAlloc(size) with c current, in one C call (CUDA
// contexts are per OS thread).
func (l *Lib) MemAlloc(c DeviceContext, size uint64) CallResult {
	var r C.gmp_nccl_result
	C.gmp_nccl_mem_alloc(C.uintptr_t(l.memAlloc), C.uintptr_t(l.memFree), C.uintptr_t(c.Push),
		C.uintptr_t(c.Pop), C.uintptr_t(c.Exchange), C.uintptr_t(l.lastError), C.uintptr_t(c.Ctx), C.size_t(size), &r)
	return CallResult{NCCL: Result(r.nccl), Push: int(r.push), Pop: int(r.pop), Ptr: uint64(r.ptr),
		Last: l.detail(&r)}
}

// MemFree calls ncclMemFree(addr) with c current, in one C call.
func (l *Lib) MemFree(c DeviceContext, addr uint64) CallResult {
	var r C.gmp_nccl_result
	C.gmp_nccl_mem_free(C.uintptr_t(l.memFree), C.uintptr_t(c.Push), C.uintptr_t(c.Pop),
		C.uintptr_t(c.Exchange), C.uintptr_t(l.lastError), C.uintptr_t(c.Ctx), C.uintptr_t(addr), &r)
	return CallResult{NCCL: Result(r.nccl), Push: int(r.push), Pop: int(r.pop), Last: l.detail(&r)}
}

// CheckCommRegister reports whether the library has ncclCommRegister and
// ncclCommDeregister (NCCL >= 2.19): nil, or an error wrapping ErrTooOld.
func (l *Lib) CheckCommRegister() error {
	if l.commRegister != 0 && l.commDeregister != 0 {
		return nil
	}
	return fmt.Errorf("nccl: %s does not export ncclCommRegister/ncclCommDeregister; user-buffer registration "+
		"needs NCCL >= 2.19: %w", l, ErrTooOld)
}

// CommRegister calls ncclCommRegister(comm, buf, size): it registers
// [buf, buf+size) with the communicator comm (an ncclComm_t of this very
// library, e.g. the one torch's ProcessGroupNCCL made) and returns the
// handle for CommDeregister. A failed call returns an *Error (with the
// ncclResult_t); a library without the function, an error wrapping
// ErrTooOld.
func (l *Lib) CommRegister(comm, buf uintptr, size uint64) (uintptr, error) {
	if err := l.CheckCommRegister(); err != nil {
		return 0, err
	}
	var r C.gmp_nccl_result
	C.gmp_nccl_comm_register(C.uintptr_t(l.commRegister), C.uintptr_t(l.lastError), C.uintptr_t(comm),
		C.uintptr_t(buf), C.size_t(size), &r)
	if r.nccl != 0 {
		return 0, l.callError("ncclCommRegister", &r)
	}
	return uintptr(r.ptr), nil
}

// CommDeregister calls ncclCommDeregister(comm, handle) for a handle
// CommRegister returned. Errors as CommRegister's.
func (l *Lib) CommDeregister(comm, handle uintptr) error {
	if err := l.CheckCommRegister(); err != nil {
		return err
	}
	var r C.gmp_nccl_result
	C.gmp_nccl_comm_deregister(C.uintptr_t(l.commDeregister), C.uintptr_t(l.lastError), C.uintptr_t(comm),
		C.uintptr_t(handle), &r)
	if r.nccl != 0 {
		return l.callError("ncclCommDeregister", &r)
	}
	return nil
}

// callError is the *Error of the failed call fn that r reports.
func (l *Lib) callError(fn string, r *C.gmp_nccl_result) *Error {
	code := Result(r.nccl)
	return &Error{Func: fn, Code: code, Text: l.ErrorString(code), Detail: l.detail(r)}
}

// detail is the warning NCCL logged for the failed call r, or "". NCCL's
// buffer is process-wide and never cleared, so a text the call did not
// change is stale, unless it is the one credited to our previous failure:
// then the call logged it again (a sticky CUDA error, or an out-of-memory
// retried), which is the likely case, since every failure path of
// ncclMemAlloc/ncclMemFree warns.
func (l *Lib) detail(r *C.gmp_nccl_result) string {
	text := C.GoString(&r.last[0])
	if text == "" {
		return ""
	}
	l.detailMu.Lock()
	defer l.detailMu.Unlock()
	if r.last_new != 0 {
		l.lastDetail = text
		return text
	}
	if text == l.lastDetail {
		return text
	}
	return ""
}
