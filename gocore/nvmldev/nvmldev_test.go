package nvmldev

import (
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func fakeLib(initRet nvml.Return) *mock.Interface {
	dev := &mock.Device{
		GetNameFunc: func() (string, nvml.Return) { return "NVIDIA H100 80GB HBM3", nvml.SUCCESS },
		GetUUIDFunc: func() (string, nvml.Return) { return "GPU-1234", nvml.SUCCESS },
		GetMemoryInfoFunc: func() (nvml.Memory, nvml.Return) {
			return nvml.Memory{Total: 80 << 30, Free: 70 << 30, Used: 10 << 30}, nvml.SUCCESS
		},
		GetNumaNodeIdFunc:            func() (int, nvml.Return) { return 0, nvml.ERROR_NOT_SUPPORTED },
		GetCudaComputeCapabilityFunc: func() (int, int, nvml.Return) { return 9, 0, nvml.SUCCESS },
	}
	return &mock.Interface{
		InitFunc:                   func() nvml.Return { return initRet },
		ShutdownFunc:               func() nvml.Return { return nvml.SUCCESS },
		ErrorStringFunc:            func(r nvml.Return) string { return nvml.ErrorString(r) },
		DeviceGetCountFunc:         func() (int, nvml.Return) { return 2, nvml.SUCCESS },
		DeviceGetHandleByIndexFunc: func(i int) (nvml.Device, nvml.Return) { return dev, nvml.SUCCESS },
	}
}

func TestListWithMock(t *testing.T) {
	lib := fakeLib(nvml.SUCCESS)
	infos, err := List(lib)
	require.NoError(t, err)
	require.Len(t, infos, 2)
	assert.Equal(t, Info{Index: 1, Name: "NVIDIA H100 80GB HBM3", UUID: "GPU-1234", TotalBytes: 80 << 30,
		FreeBytes: 70 << 30, UsedBytes: 10 << 30, NUMANode: -1, ComputeCapability: "9.0"}, infos[1])
	assert.Len(t, lib.ShutdownCalls(), 1)
}

func TestListWithoutDriver(t *testing.T) {
	_, err := List(fakeLib(nvml.ERROR_LIBRARY_NOT_FOUND))
	require.ErrorIs(t, err, ErrUnavailable)
	assert.Contains(t, err.Error(), "no NVIDIA driver")
}

// TestListSystem runs the real library: without a driver it must fail
// cleanly, with one it must list at least one device.
func TestListSystem(t *testing.T) {
	infos, err := ListSystem()
	if err != nil {
		assert.ErrorIs(t, err, ErrUnavailable)
		return
	}
	assert.NotEmpty(t, infos)
}
