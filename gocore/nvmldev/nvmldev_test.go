//go:build cgo

package nvmldev

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// fakeLib is a mock library with two devices; exported lists the NVML
// functions beyond the R525 baseline that the library has.
func fakeLib(initRet nvml.Return, exported ...string) *mock.Interface {
	dev := &mock.Device{
		GetNameFunc: func() (string, nvml.Return) { return "NVIDIA H100 80GB HBM3", nvml.SUCCESS },
		GetUUIDFunc: func() (string, nvml.Return) { return "GPU-1234", nvml.SUCCESS },
		GetMemoryInfoFunc: func() (nvml.Memory, nvml.Return) {
			return nvml.Memory{Total: 80 << 30, Free: 70 << 30, Used: 10 << 30}, nvml.SUCCESS
		},
		GetNumaNodeIdFunc:            func() (int, nvml.Return) { return 0, nvml.ERROR_NOT_SUPPORTED },
		GetCudaComputeCapabilityFunc: func() (int, int, nvml.Return) { return 9, 0, nvml.SUCCESS },
	}
	ext := &mock.ExtendedInterface{LookupSymbolFunc: func(name string) error {
		for _, s := range exported {
			if s == name {
				return nil
			}
		}
		return fmt.Errorf("%s: undefined symbol", name)
	}}
	return &mock.Interface{
		InitFunc:                   func() nvml.Return { return initRet },
		ShutdownFunc:               func() nvml.Return { return nvml.SUCCESS },
		ErrorStringFunc:            func(r nvml.Return) string { return nvml.ErrorString(r) },
		DeviceGetCountFunc:         func() (int, nvml.Return) { return 2, nvml.SUCCESS },
		DeviceGetHandleByIndexFunc: func(i int) (nvml.Device, nvml.Return) { return dev, nvml.SUCCESS },
		ExtensionsFunc:             func() nvml.ExtendedInterface { return ext },
	}
}

func TestListWithMock(t *testing.T) {
	lib := fakeLib(nvml.SUCCESS, symGetNumaNodeId)
	infos, err := List(lib)
	require.NoError(t, err)
	require.Len(t, infos, 2)
	assert.Equal(t, Info{Index: 1, Name: "NVIDIA H100 80GB HBM3", UUID: "GPU-1234", TotalBytes: 80 << 30,
		FreeBytes: 70 << 30, UsedBytes: 10 << 30, NUMANode: -1, ComputeCapability: "9.0"}, infos[1])
	assert.Len(t, lib.ShutdownCalls(), 1)
}

func TestListReportsTheGPUsNumaNode(t *testing.T) {
	lib := fakeLib(nvml.SUCCESS, symGetNumaNodeId)
	dev, _ := lib.DeviceGetHandleByIndex(0)
	dev.(*mock.Device).GetNumaNodeIdFunc = func() (int, nvml.Return) { return 4, nvml.SUCCESS } // a GH200's HBM
	infos, err := List(lib)
	require.NoError(t, err)
	assert.Equal(t, 4, infos[0].NUMANode)
}

// TestListNeverCallsFunctionsTheDriverLacks: nvmlDeviceGetNumaNodeId is newer
// than R525; with a library without it, calling it would kill the process.
func TestListNeverCallsFunctionsTheDriverLacks(t *testing.T) {
	lib := fakeLib(nvml.SUCCESS) // exports nothing beyond the baseline
	dev, _ := lib.DeviceGetHandleByIndex(0)
	called := false
	dev.(*mock.Device).GetNumaNodeIdFunc = func() (int, nvml.Return) { called = true; return 0, nvml.SUCCESS }
	infos, err := List(lib)
	require.NoError(t, err)
	assert.False(t, called, "GetNumaNodeId called without looking the symbol up")
	assert.Equal(t, -1, infos[0].NUMANode)
	assert.Equal(t, "9.0", infos[0].ComputeCapability)
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

// TestConcurrentList: List and ListSystem from many goroutines (run with
// -race). With a real library each Init rewrote go-nvml's package
// variables concurrently; TestFakeLibrary repeats this against a loadable
// fake.
func TestConcurrentList(t *testing.T) {
	var wg sync.WaitGroup
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			lib := fakeLib(nvml.SUCCESS, symGetNumaNodeId)
			for j := 0; j < 20; j++ {
				if _, err := List(lib); err != nil {
					t.Error(err)
				}
				if _, err := ListSystem(); err != nil && !errors.Is(err, ErrUnavailable) {
					t.Error(err)
				}
			}
		}()
	}
	wg.Wait()
}

// -- against a fake libnvidia-ml.so.1, in a child process ------------------

const childEnv = "GMP_NVMLDEV_CHILD"

// TestFakeLibraryChild is the child's side: concurrent ListSystem calls
// through the fake the parent put on LD_LIBRARY_PATH, then the result as
// JSON. A missing symbol would kill it; a data race fails it under -race.
func TestFakeLibraryChild(t *testing.T) {
	if os.Getenv(childEnv) == "" {
		t.Skip("run by TestFakeLibrary")
	}
	var wg sync.WaitGroup
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := 0; j < 25; j++ {
				if _, err := ListSystem(); err != nil {
					t.Error(err)
				}
			}
		}()
	}
	wg.Wait()
	infos, err := ListSystem()
	require.NoError(t, err)
	b, err := json.Marshal(infos)
	require.NoError(t, err)
	fmt.Printf("INFOS %s\n", b)
}

func buildFake(t *testing.T, dir string, defines ...string) {
	t.Helper()
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "cc"
	}
	if _, err := exec.LookPath(cc); err != nil {
		t.Skipf("no C compiler (%s) to build the fake libnvidia-ml", cc)
	}
	require.NoError(t, os.MkdirAll(dir, 0o755))
	args := append([]string{"-shared", "-fPIC", "-O1", "-o", filepath.Join(dir, "libnvidia-ml.so.1")}, defines...)
	out, err := exec.Command(cc, append(args, filepath.Join("testdata", "fake_nvml.c"))...).CombinedOutput()
	require.NoError(t, err, "%s", out)
}

func TestFakeLibrary(t *testing.T) {
	if os.Getenv(childEnv) != "" {
		t.Skip("in the child")
	}
	for _, tc := range []struct {
		name    string
		defines []string
		numa    int
	}{
		{"new driver", nil, 3},
		{"driver without nvmlDeviceGetNumaNodeId", []string{"-DFAKE_NVML_OLD"}, -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			buildFake(t, dir, tc.defines...)
			cmd := exec.Command(os.Args[0], "-test.run=^TestFakeLibraryChild$", "-test.count=1", "-test.v")
			cmd.Env = append(os.Environ(), childEnv+"=1", "LD_LIBRARY_PATH="+dir)
			out, err := cmd.CombinedOutput()
			require.NoError(t, err, "child failed:\n%s", out)
			_, js, ok := strings.Cut(string(out), "INFOS ")
			require.True(t, ok, "%s", out)
			js, _, _ = strings.Cut(js, "\n")
			var infos []Info
			require.NoError(t, json.Unmarshal([]byte(js), &infos))
			assert.Equal(t, []Info{{Index: 0, Name: "FakeGPU", UUID: "GPU-fake", TotalBytes: 100, FreeBytes: 60,
				UsedBytes: 40, NUMANode: tc.numa, ComputeCapability: "9.0"}}, infos)
		})
	}
}

// A GPU that cannot be opened (hidden by cgroup device limits, or lost)
// is left out; the others are listed, with the reason.
func TestListSkipsAnInaccessibleDevice(t *testing.T) {
	for _, ret := range []nvml.Return{nvml.ERROR_NO_PERMISSION, nvml.ERROR_GPU_IS_LOST} {
		lib := fakeLib(nvml.SUCCESS, symGetNumaNodeId)
		good, _ := lib.DeviceGetHandleByIndex(0)
		lib.DeviceGetHandleByIndexFunc = func(i int) (nvml.Device, nvml.Return) {
			if i == 0 {
				return nil, ret
			}
			return good, nvml.SUCCESS
		}
		infos, err := List(lib)
		require.ErrorIs(t, err, ErrDeviceSkipped)
		assert.Contains(t, err.Error(), "nvmlDeviceGetHandleByIndex(0)")
		require.Len(t, infos, 1)
		assert.Equal(t, 1, infos[0].Index)
	}
}
