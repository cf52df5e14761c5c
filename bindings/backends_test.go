package bindings

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/bindings/pyerr"
	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/sim"
)

// The registry publishes every backend NewPool builds, with the options its
// package declares.
func TestBackendSchema(t *testing.T) {
	js, err := BackendSchema()
	require.NoError(t, err)
	var kinds []struct {
		Name    string `json:"name"`
		Doc     string `json:"doc"`
		Options []struct {
			Name, Type, Default, Doc string
			Min, Max                 *json.Number
			ZeroIsDefault            bool `json:"zero_is_default"`
		} `json:"options"`
	}
	require.NoError(t, json.Unmarshal([]byte(js), &kinds))
	var names []string
	opts := map[string]map[string]string{} // backend -> option -> type
	for _, k := range kinds {
		names = append(names, k.Name)
		assert.NotEmpty(t, k.Doc, k.Name)
		opts[k.Name] = map[string]string{}
		for _, o := range k.Options {
			assert.NotEmpty(t, o.Doc, "%s %s", k.Name, o.Name)
			opts[k.Name][o.Name] = o.Type
			if o.Name == "capacity" {
				assert.Equal(t, gocore.FormatBytes(sim.DefaultCapacity), o.Default)
				assert.True(t, o.ZeroIsDefault)
			}
		}
	}
	assert.Equal(t, strings.Split(Backends(), ","), names)
	assert.Equal(t, []string{"sim", "callback", "cuda", "async", "vmm", "nccl", "host"}, names)
	assert.Equal(t, map[string]string{"libcuda": "path"}, opts["cuda"])
	assert.Equal(t, map[string]string{"libcuda": "path", "libnccl": "path"}, opts["nccl"])
	assert.Equal(t, map[string]string{"libcuda": "path", "host_flags": "int", "host_device": "device"}, opts["host"])
	assert.Equal(t, map[string]string{"devices": "int", "alignment": "int"}, opts["callback"])
	assert.Equal(t, "devices", opts["vmm"]["access_devices"])
	assert.Equal(t, "bool", opts["async"]["reuse_allow_opportunistic"])
	assert.Equal(t, "probability", opts["sim"]["fail_rate"])
	assert.Equal(t, "int", opts["sim"]["latency_ns"])
	assert.NotContains(t, opts["sim"], "base", "Go-only fields are no options")
}

// Options the backend does not declare, or of the wrong type, are refused
// naming the backend and the option.
func TestBackendOptionsAreDecodedStrictly(t *testing.T) {
	for in, want := range map[string]string{
		`{"backend":"cuda","options":{"ipc":true}}`:        "cuda option ipc=true is unknown (valid: libcuda)",
		`{"backend":"sim","options":{"capacity":"big"}}`:   `sim option capacity="big" does not fit type int`,
		`{"backend":"vmm","options":{"numa_node":-1}}`:     "vmm option numa_node=-1 is not in [0, 2147483647]",
		`{"backend":"sim","options":{"devices":0}}`:        "sim option devices=0 must be positive (leave the option out for the default, 1)",
		`{"backend":"callback","options":{"devices":-1}}`:  "callback option devices=-1 is not in [0, ",
		`{"backend":"host","options":{"host_flags":1e10}}`: "host option host_flags=1e10 does not fit type int",
	} {
		_, err := NewPool(in)
		require.Error(t, err, in)
		assertKind(t, err, pyerr.InvalidArgument, want)
	}
}

// One device bound: the engine's.
func TestMaxDevices(t *testing.T) {
	assert.EqualValues(t, gocore.MaxDevices, MaxDevices())
	id, err := NewPool(`{"backend":"sim"}`)
	require.NoError(t, err)
	defer func() { _, _ = PoolClose(id) }()
	_, err = PoolAlloc(id, 512, MaxDevices(), 0)
	require.ErrorContains(t, err, "alloc on device 1024: invalid device")
	_, err = PoolAlloc(id, 512, MaxDevices()-1, 0)
	require.ErrorContains(t, err, "device 1023", "in the bound, but not the sim's: the engine says so")
}
