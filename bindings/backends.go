package bindings

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/callback"
	"github.com/gpumempool/gpumempool/gocore/cuda"
	"github.com/gpumempool/gpumempool/gocore/cuda/driver"
	"github.com/gpumempool/gpumempool/gocore/nccl"
	"github.com/gpumempool/gpumempool/gocore/nccl/libnccl"
	"github.com/gpumempool/gpumempool/gocore/options"
	"github.com/gpumempool/gpumempool/gocore/sim"
)

// backendKind is one entry of the registry of backends: its name, what it
// is, the schema of its options (from its package's Options struct, see
// gocore/options) and how NewPool builds it. The registry is the one place
// that names the backends; Backends and BackendSchema publish it, and the
// Python layer validates and documents the options from the schema.
type backendKind struct {
	Name    string          `json:"name"`
	Doc     string          `json:"doc"`
	Options []options.Field `json:"options"`
	// build decodes the options (a JSON object, empty when none were given)
	// and makes the backend; sim is set for a simulator (test controls).
	build func(opts json.RawMessage, o poolOptions) (be gocore.Backend, sim *sim.Backend, err error)
}

// kind registers a backend whose options are a T.
func kind[T any](name, doc string,
	build func(opts T, given bool, o poolOptions) (gocore.Backend, *sim.Backend, error)) backendKind {
	fields := options.Schema[T]()
	return backendKind{Name: name, Doc: doc, Options: fields,
		build: func(raw json.RawMessage, o poolOptions) (gocore.Backend, *sim.Backend, error) {
			var opts T
			if err := options.Decode(raw, fields, &opts); err != nil {
				return nil, nil, fmt.Errorf("%s %v: %w", name, err, gocore.ErrInvalidArgument)
			}
			given := len(raw) > 0 && string(raw) != "null"
			return build(opts, given, o)
		}}
}

// The options of the GPU backends: the library each loads, and its own.
type (
	cudaOptions struct{ driver.Options }
	hostOptions struct {
		driver.Options
		cuda.HostOptions
	}
	ncclOptions struct {
		driver.Options
		NCCL libnccl.Options `option:",inline"`
	}
	asyncOptions struct {
		driver.Options
		cuda.AsyncOptions
	}
	vmmOptions struct {
		driver.Options
		cuda.VMMOptions
	}
)

// backendKinds is the registry, in the order Backends lists it.
var backendKinds = []backendKind{
	kind("sim", "a simulated device: no GPU needed; pools without options share one", buildSim),
	kind("callback", "segments from your own alloc and free functions (PyTorch's pluggable-allocator signatures)",
		func(c callback.Config, _ bool, o poolOptions) (gocore.Backend, *sim.Backend, error) {
			c.Alloc, c.Free, c.Name, c.Python = uintptr(o.AllocFn), uintptr(o.FreeFn), o.Name, o.PythonCallbacks
			be, err := callback.New(c)
			return be, nil, err
		}),
	kind("cuda", "device memory from cuMemAlloc",
		gpu(func(drv *driver.Driver, _ cudaOptions) (gocore.Backend, error) { return cuda.NewBackend(drv) })),
	kind("async", "CUDA's stream-ordered allocator (cuMemAllocFromPoolAsync), shareable between processes",
		gpu(func(drv *driver.Driver, o asyncOptions) (gocore.Backend, error) {
			return cuda.NewAsyncBackend(drv, o.AsyncOptions)
		})),
	kind("vmm", "CUDA virtual memory management: expandable segments, host NUMA memory, peer access, IPC",
		gpu(func(drv *driver.Driver, o vmmOptions) (gocore.Backend, error) {
			return cuda.NewVMMBackend(drv, o.VMMOptions)
		})),
	kind("nccl", "ncclMemAlloc (NCCL >= 2.19): memory for NVLS and registered NCCL buffers",
		gpu(func(drv *driver.Driver, o ncclOptions) (gocore.Backend, error) {
			lib, err := libnccl.Load(o.NCCL.Library)
			if err != nil {
				return nil, fmt.Errorf("nccl backend: %w", err)
			}
			events, err := cuda.NewBackend(drv)
			if err != nil {
				return nil, fmt.Errorf("nccl backend: %w", err)
			}
			return nccl.NewBackend(lib, drv, events)
		})),
	kind("host", "pinned host memory (cuMemHostAlloc)",
		gpu(func(drv *driver.Driver, o hostOptions) (gocore.Backend, error) {
			return cuda.NewHostBackendWith(drv, o.HostOptions)
		})),
}

// gpuOptions is what every GPU backend's options have: the driver's.
type gpuOptions interface{ driverOptions() driver.Options }

func (o cudaOptions) driverOptions() driver.Options  { return o.Options }
func (o hostOptions) driverOptions() driver.Options  { return o.Options }
func (o ncclOptions) driverOptions() driver.Options  { return o.Options }
func (o asyncOptions) driverOptions() driver.Options { return o.Options }
func (o vmmOptions) driverOptions() driver.Options   { return o.Options }

// gpu builds a backend over the CUDA driver its options name.
func gpu[T gpuOptions](newBackend func(*driver.Driver, T) (gocore.Backend, error)) func(T, bool, poolOptions) (gocore.Backend, *sim.Backend, error) {
	return func(opts T, _ bool, o poolOptions) (gocore.Backend, *sim.Backend, error) {
		drv, err := driver.Load(opts.driverOptions().Library)
		if err != nil {
			return nil, nil, fmt.Errorf("%s backend: %w", o.Backend, err)
		}
		be, err := newBackend(drv, opts)
		return be, nil, err
	}
}

var (
	defaultSimOnce sync.Once
	defaultSim     *sim.Backend
	defaultSimErr  error
)

// buildSim makes a simulator with the options given, or returns the
// process-wide one that pools created without options share, as pools
// share a real GPU.
func buildSim(cfg sim.Config, given bool, _ poolOptions) (gocore.Backend, *sim.Backend, error) {
	if !given {
		defaultSimOnce.Do(func() { defaultSim, defaultSimErr = sim.New(sim.Config{}) })
		return defaultSim, defaultSim, defaultSimErr
	}
	sim, err := sim.New(cfg)
	if err != nil {
		return nil, nil, simOptionError(err)
	}
	return sim, sim, nil
}

// simFields is the sim backend's schema, for simOptionError.
var simFields = options.Schema[sim.Config]()

// simOptionError names the option behind a *sim.ConfigError.
func simOptionError(err error) error {
	var ce *sim.ConfigError
	if !errors.As(err, &ce) {
		return fmt.Errorf("%v: %w", err, gocore.ErrInvalidArgument)
	}
	name, ok := options.NameOf(simFields, ce.Field)
	if !ok {
		name = ce.Field
	}
	value := ce.Value
	if d, isDur := value.(time.Duration); isDur {
		value = int64(d) // latency_ns is given in nanoseconds
	}
	return fmt.Errorf("sim option %s=%v %s: %w", name, value, ce.Reason, gocore.ErrInvalidArgument)
}

// lookupKind returns the registry entry of name ("" is "sim").
func lookupKind(name string) (backendKind, error) {
	if name == "" {
		name = "sim"
	}
	for _, k := range backendKinds {
		if k.Name == name {
			return k, nil
		}
	}
	return backendKind{}, fmt.Errorf("unknown backend %q (valid: %s): %w", name, Backends(), gocore.ErrInvalidArgument)
}

// buildBackend makes the backend the options name. sim is returned too when
// the backend is a simulator (for the test controls).
func buildBackend(o poolOptions) (be gocore.Backend, sim *sim.Backend, err error) {
	k, err := lookupKind(o.Backend)
	if err != nil {
		return nil, nil, err
	}
	return k.build(o.Options, o)
}

// Backends lists the backend names NewPool accepts, comma-separated.
func Backends() string {
	names := make([]string, len(backendKinds))
	for i, k := range backendKinds {
		names[i] = k.Name
	}
	return strings.Join(names, ",")
}

// BackendSchema returns the registry as JSON: for each backend its name,
// doc and options (name, type, bounds, default, doc), which the Python
// layer validates and documents options from.
func BackendSchema() (js string, err error) {
	defer guard(&err)
	return marshal(backendKinds)
}

// MaxDevices is the bound on device ordinals and counts (gocore.MaxDevices):
// a device index is in [0, MaxDevices).
func MaxDevices() int64 { return gocore.MaxDevices }
