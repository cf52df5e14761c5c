package bindings

import (
	"fmt"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/cuda"
	"github.com/gpumempool/gpumempool/gocore/cuda/driver"
	"github.com/gpumempool/gpumempool/gocore/nccl"
	"github.com/gpumempool/gpumempool/gocore/nccl/libnccl"
)

// gpuOptions are the options of the backends that load libcuda (and
// libnccl) at run time. Each backend reads the fields that concern it; the
// Python layer rejects the others by name before they get here.
type gpuOptions struct {
	Libcuda   string `json:"libcuda"`    // path of libcuda.so.1 (default: the loader's, or $GMP_LIBCUDA)
	Libnccl   string `json:"libnccl"`    // path of libnccl.so.2 (default: the one loaded, $GMP_LIBNCCL, the loader's)
	HostFlags uint32 `json:"host_flags"` // cuMemHostAlloc flags (0: portable)
	// HostDevice is the CUDA device whose context the host backend works
	// under and whose streams record its events (default 0).
	HostDevice int `json:"host_device"`

	// async
	PoolReleaseThreshold           uint64 `json:"pool_release_threshold"`
	ReuseFollowEventDependencies   *bool  `json:"reuse_follow_event_dependencies"`
	ReuseAllowOpportunistic        *bool  `json:"reuse_allow_opportunistic"`
	ReuseAllowInternalDependencies *bool  `json:"reuse_allow_internal_dependencies"`
	MaxSize                        uint64 `json:"max_size"`

	// vmm
	Location      string `json:"location"`
	NUMANode      int    `json:"numa_node"`
	AccessDevices []int  `json:"access_devices"`
	Expandable    bool   `json:"expandable"`
	ReserveBytes  uint64 `json:"reserve_bytes"`
	Granularity   string `json:"granularity"`

	// async and vmm
	IPC bool `json:"ipc"`
}

// gpuBackend builds a backend over the CUDA driver.
func gpuBackend(name string, o gpuOptions) (gocore.Backend, error) {
	drv, err := driver.Load(o.Libcuda)
	if err != nil {
		return nil, fmt.Errorf("%s backend: %w", name, err)
	}
	switch name {
	case "cuda":
		return cuda.NewBackend(drv)
	case "host":
		return cuda.NewHostBackendOn(drv, o.HostFlags, o.HostDevice)
	case "nccl":
		lib, err := libnccl.Load(o.Libnccl)
		if err != nil {
			return nil, fmt.Errorf("nccl backend: %w", err)
		}
		events, err := cuda.NewBackend(drv)
		if err != nil {
			return nil, fmt.Errorf("nccl backend: %w", err)
		}
		return nccl.NewBackend(lib, drv, events)
	case "async":
		return cuda.NewAsyncBackend(drv, cuda.AsyncOptions{
			ReleaseThreshold:               o.PoolReleaseThreshold,
			ReuseFollowEventDependencies:   o.ReuseFollowEventDependencies,
			ReuseAllowOpportunistic:        o.ReuseAllowOpportunistic,
			ReuseAllowInternalDependencies: o.ReuseAllowInternalDependencies,
			IPC:                            o.IPC,
			MaxSize:                        o.MaxSize,
		})
	case "vmm":
		return cuda.NewVMMBackend(drv, cuda.VMMOptions{
			Location: o.Location, NUMANode: o.NUMANode, AccessDevices: o.AccessDevices,
			Expandable: o.Expandable, ReserveBytes: o.ReserveBytes, Granularity: o.Granularity, IPC: o.IPC,
		})
	}
	return nil, fmt.Errorf("unknown GPU backend %q: %w", name, gocore.ErrInvalidArgument)
}
