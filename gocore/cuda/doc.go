// Package cuda provides gocore backends over the NVIDIA driver, in plain Go
// over package driver (which alone uses cgo): Backend (device memory from
// cuMemAlloc), AsyncBackend (CUDA's stream-ordered allocator), VMMBackend
// (virtual memory management, with expandable segments) and HostBackend
// (pinned host memory from cuMemHostAlloc); and the importing side of CUDA
// IPC (ImportVMM, ImportAsyncPool, ImportAsyncSegment).
//
// Every backend's events are CUDA events kept by one Events table, which
// the backend embeds (see Events). Built without cgo the package compiles,
// and driver.Load fails, so no backend can be made.
package cuda
