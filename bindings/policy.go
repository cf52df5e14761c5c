package bindings

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/options"
)

// poolOptions is the JSON accepted by NewPool: the pool's settings, as the
// options of gocore.Config declare them (Policy, see poolFields), and what
// the bindings need besides to build the pool and its backend.
type poolOptions struct {
	Backend string `json:"backend"`
	Name    string `json:"name"`
	// Options are the backend's own, decoded by its registry entry
	// (backends.go).
	Options json.RawMessage `json:"options"`
	// The callback backend's functions, which Python passes besides its
	// options.
	AllocFn         uint64 `json:"alloc_fn"`
	FreeFn          uint64 `json:"free_fn"`
	PythonCallbacks bool   `json:"python_callbacks"`
	// Policy holds the settings, decoded by the schema (the keys of
	// poolFields), not by the JSON tags above.
	Policy gocore.Config `json:"-"`
}

// poolFields is the schema of the pool's settings: the option-tagged fields
// of gocore.Config, their one declaration.
var poolFields = options.Schema[gocore.Config]()

// decodeOptions parses NewPool's JSON strictly: unknown keys and trailing
// values are errors. The pool's settings are decoded by their schema, the
// rest into poolOptions' own fields.
func decodeOptions(optionsJSON string) (poolOptions, error) {
	var o poolOptions
	dec := json.NewDecoder(strings.NewReader(optionsJSON))
	var raw map[string]json.RawMessage
	if err := dec.Decode(&raw); err != nil {
		return o, fmt.Errorf("pool options: %v: %w", err, gocore.ErrInvalidArgument)
	}
	if dec.More() {
		return o, fmt.Errorf("pool options: more than one JSON value: %w", gocore.ErrInvalidArgument)
	}
	policy, rest := map[string]json.RawMessage{}, map[string]json.RawMessage{}
	for key, value := range raw {
		if isPoolSetting(key) {
			policy[key] = value
		} else {
			rest[key] = value
		}
	}
	if err := decodeStrict(rest, &o); err != nil {
		return o, fmt.Errorf("pool options: %v: %w", err, gocore.ErrInvalidArgument)
	}
	settings, err := json.Marshal(policy)
	if err != nil {
		return o, fmt.Errorf("pool options: %v: %w", err, gocore.ErrInvalidArgument)
	}
	if err := options.Decode(settings, poolFields, &o.Policy); err != nil {
		return o, fmt.Errorf("pool options: %v: %w", err, gocore.ErrInvalidArgument)
	}
	return o, nil
}

// isPoolSetting reports whether key names one of the pool's settings.
func isPoolSetting(key string) bool {
	for _, f := range poolFields {
		if f.Name == key {
			return true
		}
	}
	return false
}

// decodeStrict decodes the JSON object fields into *dst, refusing keys dst
// has no field for.
func decodeStrict(fields map[string]json.RawMessage, dst any) error {
	data, err := json.Marshal(fields)
	if err != nil {
		return err
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	return dec.Decode(dst)
}

// PoolSchema returns the schema of the pool's settings as JSON: for each
// its name, type, unit, bounds, default, doc and torch's option of the
// same setting (see gocore.Config), which the Python layer checks the
// settings and builds its replay and tune keys and docs from.
func PoolSchema() (js string, err error) {
	defer guard(&err)
	return marshal(poolFields)
}

// torchSizes are the sizes of torch's caching allocator that the engine
// follows (gocore/round.go), by the names the Python layer reads them by.
var torchSizes = map[string]uint64{
	"min_block_size":    gocore.MinBlockSize,
	"small_size":        gocore.SmallSize,
	"small_buffer":      gocore.SmallBuffer,
	"large_buffer":      gocore.LargeBuffer,
	"min_large_alloc":   gocore.MinLargeAlloc,
	"round_large":       gocore.RoundLarge,
	"roundup_intervals": gocore.RoundupIntervals,
}

// TorchSizes returns torch's allocator sizes the engine follows (block
// rounding, the small and large pools' segment sizes, the divisions'
// intervals) as a JSON object, so that Python reads them instead of
// keeping copies.
func TorchSizes() (js string, err error) {
	defer guard(&err)
	return marshal(torchSizes)
}
