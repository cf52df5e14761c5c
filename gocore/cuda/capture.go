package cuda

import (
	"errors"
	"fmt"

	"github.com/gpumempool/gpumempool/gocore/cuda/driver"
)

// ErrCaptureUnderway is wrapped by the errors of the calls that give memory
// back (AsyncBackend.Free, VMMBackend.Free and VMMBackend.Shrink) when using
// the segment's stream would join or break a CUDA graph capture: the stream
// is capturing, or it is the legacy default stream while a blocking stream
// of the device captures. Those calls order the release on the stream
// (cuMemFreeAsync) or wait for it first (cuStreamSynchronize before
// cuMemUnmap), which during a capture would record a free node into the
// graph, or fail and invalidate the capture. Nothing was done: the engine
// keeps the segment (a pool's Close keeps it for a later Close) and gives it
// back on a later release, once the capture is over. It does not match
// gocore.ErrBackendOutOfMemory.
var ErrCaptureUnderway = errors.New("a CUDA graph capture is under way")

// streamCapture asks the driver (cuStreamIsCapturing) whether work queued
// on stream of dev would be captured into a CUDA graph or break a capture:
// the stream captures (actively, or its capture was invalidated and not yet
// ended), or it is the legacy default stream while a blocking stream of the
// device captures (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT). It returns "" when
// neither holds, else why, for an error message; err is the driver's error
// when the question itself failed.
func streamCapture(drv *driver.Driver, dev int, stream uint64) (why string, err error) {
	status, err := drv.StreamIsCapturing(dev, stream)
	var cerr *driver.Error
	if errors.As(err, &cerr) && cerr.Code == driver.CodeStreamCaptureImplicit && cerr.Op == "cuStreamIsCapturing" {
		return fmt.Sprintf("stream %#x is the legacy default stream and a blocking stream of device %d is capturing a CUDA graph",
			stream, dev), nil
	}
	if err != nil {
		return "", err
	}
	switch status {
	case driver.StreamCaptureStatusNone:
		return "", nil
	case driver.StreamCaptureStatusInvalidated:
		return fmt.Sprintf("stream %#x is capturing a CUDA graph (an invalidated capture, not ended yet)", stream), nil
	default:
		return fmt.Sprintf("stream %#x is capturing a CUDA graph", stream), nil
	}
}

// refuseDuringCapture returns nil when stream of dev can be used to give a
// segment back, an error wrapping ErrCaptureUnderway that says why it
// cannot, or the driver's error when asking failed; format and args name
// the operation at the start of the error ("vmm backend: free %#x on device
// %d").
func refuseDuringCapture(drv *driver.Driver, dev int, stream uint64, format string, args ...any) error {
	why, err := streamCapture(drv, dev, stream)
	if err != nil {
		return fmt.Errorf("%s: %w", fmt.Sprintf(format, args...), err)
	}
	if why != "" {
		return fmt.Errorf("%s: %s, so the memory is kept for a release after the capture: %w",
			fmt.Sprintf(format, args...), why, ErrCaptureUnderway)
	}
	return nil
}
