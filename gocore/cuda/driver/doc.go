// Package driver is gpumempool's only door to the NVIDIA driver
// (libcuda.so.1): it loads the library at run time with dlopen, so that
// gpumempool builds and runs on machines without CUDA, resolves the entry
// points it uses and wraps each as a Go method of Driver. It owns the cgo
// of the CUDA side: shim.h (the C helpers) and the files that include it.
// The backends over it (package cuda) are plain Go.
//
// Every driver call that needs a context is made by one C helper that pushes
// the device's primary context, calls the driver and pops the context again.
// CUDA's current context is per OS thread and a goroutine may change threads
// between two cgo calls, so pushing in one call and operating in the next
// could run the operation under another thread's context; and callers such
// as torch call us from their own threads, whose current context we must
// leave as we found it.
//
// Built without cgo (CGO_ENABLED=0), the package still compiles: its cgo
// files are replaced by zz_nocgo.go, generated from them, whose Load fails
// with an error wrapping gocore.ErrUnsupported, so that the engine and the
// backends build and the caller falls back to another backend.
//
// Tests run against a fake driver (tests/csrc/fake_cuda.c) that checks all
// of this; see ../internal/fakecuda.
package driver

//go:generate env GMP_UPDATE_NOCGO=1 go test -run ^TestNoCgoStub$ .
