package libnccl

// Options says which libnccl Load opens (see Load for the order).
type Options struct {
	// Library is the path Load is given.
	Library string `option:"libnccl" type:"path" doc:"path of libnccl.so.2 (default: the one loaded, $GMP_LIBNCCL, the loader's)"`
}

// CallResult is what one push/NCCL/pop round trip reports.
type CallResult struct {
	NCCL      Result // the NCCL call's result (Success when it was not made)
	Push, Pop int    // CUresults of cuCtxPushCurrent and cuCtxPopCurrent; 0 on success or when not called
	Ptr       uint64 // what ncclMemAlloc returned
	// Last is ncclGetLastError's text for a failed call, when it set one.
	Last string
}

// DeviceContext is what makes a device current around an NCCL call: the
// device's primary context, the addresses of cuCtxPushCurrent_v2 and
// cuCtxPopCurrent_v2, and of cuThreadExchangeStreamCaptureMode (0: leave
// the capture mode alone). The zero value leaves the thread's current
// context alone.
type DeviceContext struct{ Ctx, Push, Pop, Exchange uintptr }
