// Package libnccl is gpumempool's door to libnccl: it finds and loads the
// library at run time with dlopen (sharing the copy torch loaded, if any),
// checks that it has ncclMemAlloc (NCCL >= 2.19), and calls ncclMemAlloc
// and ncclMemFree with a device's CUDA context pushed around them, in one C
// call. It owns the cgo of the NCCL side (lib.go, nccl_api.h); the backend
// over it, package nccl, is plain Go.
//
// Built without cgo, zz_nocgo.go (generated from lib.go) stands in for
// lib.go, and Load fails with an error wrapping gocore.ErrUnsupported.
package libnccl

//go:generate env GMP_UPDATE_NOCGO=1 go test -run ^TestNoCgoStub$ .

// EnvLibrary names the environment variable Load reads when given no path.
const EnvLibrary = "GMP_LIBNCCL"

// DecodeVersion splits an NCCL_VERSION_CODE as ncclGetVersion reports it.
// NCCL >= 2.9 encodes major*10000 + minor*100 + patch (2.23.4 is 22304);
// older releases encoded major*1000 + minor*100 + patch (2.8.4 is 2804). The
// old encoding stays below 10000 for any major version below 10, and the new
// one starts at 20900, so the size of the code tells them apart.
func DecodeVersion(code int) (major, minor, patch int) {
	if code >= 10000 {
		return code / 10000, code % 10000 / 100, code % 100
	}
	return code / 1000, code % 1000 / 100, code % 100
}
