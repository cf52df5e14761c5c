//go:build linux

package gocore

import "syscall"

// callerThread is the OS thread running the caller. A call from C (the
// Python bindings, the C ABI) runs on the thread that made it, so this is
// the caller's threading.get_native_id().
func callerThread() int { return syscall.Gettid() }
