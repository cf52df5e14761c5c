package libnccl_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/gpumempool/gpumempool/gocore/nccl/libnccl"
)

func TestDecodeVersion(t *testing.T) {
	for _, c := range []struct {
		code                int
		major, minor, patch int
	}{
		{22304, 2, 23, 4},  // current encoding
		{21805, 2, 18, 5},  // the last release without ncclMemAlloc
		{21903, 2, 19, 3},  // the first with it
		{20900, 2, 9, 0},   // first release with the new encoding
		{22710, 2, 27, 10}, // two-digit patch
		{30001, 3, 0, 1},
		{2804, 2, 8, 4}, // old encoding: major*1000 + minor*100 + patch
		{2708, 2, 7, 8},
		{2000, 2, 0, 0},
	} {
		t.Run(fmt.Sprint(c.code), func(t *testing.T) {
			major, minor, patch := libnccl.DecodeVersion(c.code)
			assert.Equal(t, [3]int{c.major, c.minor, c.patch}, [3]int{major, minor, patch})
		})
	}
}

func TestResultString(t *testing.T) {
	assert.Equal(t, "ncclUnhandledCudaError", libnccl.UnhandledCudaError.String())
	assert.Equal(t, "ncclInProgress", libnccl.InProgress.String())
	assert.Equal(t, "ncclResult_t(42)", libnccl.Result(42).String())
}
