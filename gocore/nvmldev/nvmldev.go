//go:build cgo

// Package nvmldev lists NVIDIA devices through NVML (github.com/NVIDIA/go-nvml,
// which dlopens libnvidia-ml at run time). On a machine without a driver it
// returns an error that says so; it never fails to load.
//
// go-nvml binds every NVML function lazily: calling one the installed
// libnvidia-ml lacks kills the process ("symbol lookup error"), so functions
// newer than the oldest driver supported (R525, the CUDA 12.0 era) are looked
// up first (see optional). And go-nvml keeps the library's state in package
// variables that each instance's Init rewrites, so every List is serialised.
//
// It is a driver layer, like gocore/cuda/driver: go-nvml calls NVML through
// cgo, so the package builds with cgo only (its files say so), and only the
// bindings, which need cgo anyway, import it.
package nvmldev

import (
	"errors"
	"fmt"
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// Info describes one device.
type Info struct {
	Index      int    `json:"index"`
	Name       string `json:"name"`
	UUID       string `json:"uuid"`
	TotalBytes uint64 `json:"total_bytes"`
	FreeBytes  uint64 `json:"free_bytes"`
	UsedBytes  uint64 `json:"used_bytes"`
	// NUMANode is the NUMA node of the GPU itself (nvmlDeviceGetNumaNodeId):
	// on systems whose GPU memory is a NUMA node of the host (Grace Hopper /
	// Grace Blackwell, coherent memory), that node. It is not the host
	// (CPU) NUMA node closest to a PCIe GPU: there, and with drivers older
	// than the function, it is -1.
	NUMANode          int    `json:"numa_node"`
	ComputeCapability string `json:"compute_capability"` // "9.0"; "" when unknown
}

// ErrUnavailable is wrapped when NVML cannot be initialised (no driver).
var ErrUnavailable = errors.New("NVML is not available")

// ErrDeviceSkipped is wrapped, next to the list of the other devices, when
// some device could not be opened (a GPU hidden by cgroup device limits
// answers NO_PERMISSION, a lost one GPU_IS_LOST): nvidia-smi lists the
// rest, and so does List.
var ErrDeviceSkipped = errors.New("device skipped")

// symGetNumaNodeId is newer than R525: looked up before it is called.
const symGetNumaNodeId = "nvmlDeviceGetNumaNodeId"

var (
	// mu serialises List: go-nvml's Init (load) and Shutdown rewrite package
	// variables shared by every nvml.Interface, whichever instance runs them.
	mu sync.Mutex
	// system is the one instance for this machine's library.
	system = nvml.New()
)

// optional reports whether the loaded library exports the NVML function
// name (lib must be initialised).
func optional(lib nvml.Interface, name string) bool {
	return lib.Extensions().LookupSymbol(name) == nil
}

// List queries every device through lib (the real library for ListSystem,
// a go-nvml mock in tests, which must set ExtensionsFunc). Calls are
// serialised with every other List and ListSystem of the process. A device
// that cannot be opened is left out (Index keeps NVML's numbering), and the
// error, wrapping ErrDeviceSkipped, comes with the list of the others.
func List(lib nvml.Interface) ([]Info, error) {
	mu.Lock()
	defer mu.Unlock()
	if ret := lib.Init(); ret != nvml.SUCCESS {
		return nil, fmt.Errorf("%w: nvmlInit: %s (no NVIDIA driver on this machine?)", ErrUnavailable, lib.ErrorString(ret))
	}
	defer lib.Shutdown()
	n, ret := lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("nvmlDeviceGetCount: %s", lib.ErrorString(ret))
	}
	hasNuma := optional(lib, symGetNumaNodeId)
	out := make([]Info, 0, n)
	var skipped []error
	for i := range n {
		dev, ret := lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			skipped = append(skipped, fmt.Errorf("%w: nvmlDeviceGetHandleByIndex(%d): %s", ErrDeviceSkipped, i, lib.ErrorString(ret)))
			continue
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
		if hasNuma {
			if node, ret := dev.GetNumaNodeId(); ret == nvml.SUCCESS {
				info.NUMANode = node
			}
		}
		if major, minor, ret := dev.GetCudaComputeCapability(); ret == nvml.SUCCESS {
			info.ComputeCapability = fmt.Sprintf("%d.%d", major, minor)
		}
		out = append(out, info)
	}
	return out, errors.Join(skipped...)
}

// ListSystem lists the devices of this machine.
func ListSystem() ([]Info, error) { return List(system) }
