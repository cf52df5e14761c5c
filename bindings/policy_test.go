package bindings

import (
	"encoding/json"
	"fmt"
	"reflect"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/bindings/pyerr"
	"github.com/gpumempool/gpumempool/gocore"
)

// settingValue is a value of f other than its default that the engine
// accepts, chosen from the schema alone: a setting added to gocore.Config
// is tested here without an edit, unless it is of a kind never seen.
func settingValue(t *testing.T, f map[string]any) any {
	switch kind := fmt.Sprint(f["type"], "/", f["unit"]); kind {
	case "int/bytes":
		if least, ok := f["torch_min"].(float64); ok { // torch's least, in its unit, and then some
			return uint64(least+1) * uint64(f["torch_scale"].(float64))
		}
		return uint64(3 << 20)
	case "int/count":
		return uint64(4)
	case "ints/count":
		counts := make([]uint64, gocore.RoundupIntervals)
		for i := range counts {
			counts[i] = uint64(1) << (i % 4)
		}
		return counts
	case "float/fraction":
		return 0.5
	case "string/version":
		return "2.15"
	default:
		t.Fatalf("setting %v is of a kind (%s) this test has no value for: add one", f["name"], kind)
		return nil
	}
}

func poolSchema(t *testing.T) []map[string]any {
	js, err := PoolSchema()
	require.NoError(t, err)
	var fields []map[string]any
	require.NoError(t, json.Unmarshal([]byte(js), &fields))
	require.NotEmpty(t, fields)
	return fields
}

// Every setting the schema publishes is decoded by NewPool and reported
// back by PoolConfig under its name: the bindings name no setting
// themselves, so a field added to gocore.Config crosses both ways.
func TestEverySettingCrossesBothWays(t *testing.T) {
	given := map[string]any{"backend": "sim", "name": "all-settings"}
	for _, f := range poolSchema(t) {
		assert.NotEmpty(t, f["doc"], f["name"])
		given[f["name"].(string)] = settingValue(t, f)
	}
	in, err := json.Marshal(given)
	require.NoError(t, err)
	id, err := NewPool(string(in))
	require.NoError(t, err, string(in))
	defer PoolClose(id) //nolint:errcheck // cleanup
	js, err := PoolConfig(id)
	require.NoError(t, err)
	var got map[string]any
	require.NoError(t, json.Unmarshal([]byte(js), &got))
	var want map[string]any
	require.NoError(t, json.Unmarshal(in, &want))
	for name, value := range want {
		assert.Equal(t, value, got[name], name)
	}
	for _, extra := range []string{"devices", "alignment", "slot"} {
		assert.Contains(t, got, extra)
		delete(got, extra)
	}
	assert.Len(t, got, len(want), "PoolConfig: the settings, name and backend, and devices, alignment, slot")
}

// The names of the pool's settings are theirs alone: not a key of NewPool's
// own JSON, nor an option of any backend (Python takes a setting without a
// parameter of its own among a backend's options).
func TestSettingNamesAreTheirsAlone(t *testing.T) {
	taken := map[string]string{}
	ty := reflect.TypeOf(poolOptions{})
	for i := 0; i < ty.NumField(); i++ {
		if name := strings.Split(ty.Field(i).Tag.Get("json"), ",")[0]; name != "-" {
			taken[name] = "NewPool's own key"
		}
	}
	for _, k := range backendKinds {
		for _, o := range k.Options {
			taken[o.Name] = "an option of backend " + k.Name
		}
	}
	for _, f := range poolFields {
		_, clash := taken[f.Name]
		assert.False(t, clash, "setting %s is also %s", f.Name, taken[f.Name])
	}
}

// A setting of the wrong type is refused naming it, as given.
func TestSettingsRefusedByName(t *testing.T) {
	for in, want := range map[string]string{
		`{"limit":"x"}`: `pool options: option limit="x" does not fit type int`,
		`{"limit":-1}`:  `pool options: option limit=-1 does not fit type int`,
		`{"roundup_power2_divisions_by_size":[-1]}`:  "pool options: option roundup_power2_divisions_by_size=[-1]",
		`{"garbage_collection_threshold":"half"}`:    `pool options: option garbage_collection_threshold="half" does not fit type float`,
		`{"torch_version":2.15}`:                     "pool options: option torch_version=2.15 does not fit type string",
		`{"backend":"sim","limit":1,"alloc_fn":"x"}`: "pool options: json: cannot unmarshal string",
	} {
		_, err := NewPool(in)
		assertKind(t, err, pyerr.InvalidArgument, want)
	}
}

// TorchSizes publishes the engine's copies of torch's sizes, which Python
// reads instead of keeping its own.
func TestTorchSizes(t *testing.T) {
	js, err := TorchSizes()
	require.NoError(t, err)
	var sizes map[string]uint64
	require.NoError(t, json.Unmarshal([]byte(js), &sizes))
	assert.Equal(t, map[string]uint64{"min_block_size": 512, "small_size": 1 << 20, "small_buffer": 2 << 20,
		"large_buffer": 20 << 20, "min_large_alloc": 10 << 20, "round_large": 2 << 20, "roundup_intervals": 16}, sizes)
}
