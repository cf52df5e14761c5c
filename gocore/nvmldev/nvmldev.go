// Package nvmldev lists NVIDIA devices through NVML (github.com/NVIDIA/go-nvml,
// which dlopens libnvidia-ml at run time). On a machine without a driver it
// returns an error that says so; it never fails to load.
package nvmldev

import (
	"errors"
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// Info describes one device.
type Info struct {
	Index             int    `json:"index"`
	Name              string `json:"name"`
	UUID              string `json:"uuid"`
	TotalBytes        uint64 `json:"total_bytes"`
	FreeBytes         uint64 `json:"free_bytes"`
	UsedBytes         uint64 `json:"used_bytes"`
	NUMANode          int    `json:"numa_node"`          // -1 when NVML cannot tell
	ComputeCapability string `json:"compute_capability"` // "9.0"; "" when unknown
}

// ErrUnavailable is wrapped when NVML cannot be initialised (no driver).
var ErrUnavailable = errors.New("NVML is not available")

// List queries every device through lib (nvml.New() for the real library,
// a go-nvml mock in tests).
func List(lib nvml.Interface) ([]Info, error) {
	if ret := lib.Init(); ret != nvml.SUCCESS {
		return nil, fmt.Errorf("%w: nvmlInit: %s (no NVIDIA driver on this machine?)", ErrUnavailable, lib.ErrorString(ret))
	}
	defer lib.Shutdown()
	n, ret := lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("nvmlDeviceGetCount: %s", lib.ErrorString(ret))
	}
	out := make([]Info, 0, n)
	for i := range n {
		dev, ret := lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("nvmlDeviceGetHandleByIndex(%d): %s", i, lib.ErrorString(ret))
		}
		info := Info{Index: i, NUMANode: -1}
		if s, ret := dev.GetName(); ret == nvml.SUCCESS {
			info.Name = s
		}
		if s, ret := dev.GetUUID(); ret == nvml.SUCCESS {
			info.UUID = s
		}
		if m, ret := dev.GetMemoryInfo(); ret == nvml.SUCCESS {
			info.TotalBytes, info.FreeBytes, info.UsedBytes = m.Total, m.Free, m.Used
		}
		if node, ret := dev.GetNumaNodeId(); ret == nvml.SUCCESS {
			info.NUMANode = node
		}
		if major, minor, ret := dev.GetCudaComputeCapability(); ret == nvml.SUCCESS {
			info.ComputeCapability = fmt.Sprintf("%d.%d", major, minor)
		}
		out = append(out, info)
	}
	return out, nil
}

// ListSystem lists the devices of this machine.
func ListSystem() ([]Info, error) { return List(nvml.New()) }
