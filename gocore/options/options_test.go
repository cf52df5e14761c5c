package options

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

type inner struct {
	Path string `option:"path" type:"path" doc:"a file"`
}

type other struct {
	Path string `option:"other_path" type:"path" doc:"another file"`
}

type sample struct {
	inner
	More    other         `option:",inline"`
	Count   int           `option:"count" zero:"default" doc:"how many"`
	Size    uint64        `option:"size" doc:"bytes"`
	Flags   uint32        `option:"flags" max:"255" doc:"bits"`
	Node    int           `option:"node" min:"0" doc:"a node"`
	Wait    time.Duration `option:"wait_ns" doc:"nanoseconds"`
	Rate    float64       `option:"rate" type:"probability" doc:"a probability"`
	On      bool          `option:"on" doc:"a switch"`
	Maybe   *bool         `option:"maybe" doc:"unset: the default"`
	Devices []int         `option:"devices" type:"device" doc:"devices"`
	Device  int           `option:"device" type:"device" doc:"a device"`
	Hidden  int
	Skipped int `option:"-"`
}

func (sample) OptionDefaults() map[string]string { return map[string]string{"count": "3"} }

func num(s string) *json.Number { n := json.Number(s); return &n }

// The schema lists every tagged field, embedded and inline ones flattened,
// with the type, bounds and default users see.
func TestSchema(t *testing.T) {
	fields := Schema[sample]()
	byName := map[string]Field{}
	var names []string
	for _, f := range fields {
		names = append(names, f.Name)
		byName[f.Name] = f
	}
	assert.Equal(t, []string{"path", "other_path", "count", "size", "flags", "node", "wait_ns", "rate", "on", "maybe",
		"devices", "device"}, names)
	assert.Equal(t, "path", byName["path"].Type)
	assert.Equal(t, "3", byName["count"].Default)
	assert.True(t, byName["count"].ZeroIsDefault)
	assert.Equal(t, "int", byName["size"].Type)
	assert.Equal(t, num("0"), byName["size"].Min)
	assert.Equal(t, num("18446744073709551615"), byName["size"].Max)
	assert.Equal(t, num("255"), byName["flags"].Max, "a max tag narrows the type's")
	assert.Equal(t, num("0"), byName["node"].Min)
	assert.Equal(t, num("9223372036854775807"), byName["node"].Max)
	assert.Equal(t, num("-9223372036854775808"), byName["wait_ns"].Min)
	assert.Equal(t, "probability", byName["rate"].Type)
	assert.Equal(t, "bool", byName["maybe"].Type)
	assert.Equal(t, "devices", byName["devices"].Type)
	assert.Equal(t, "device", byName["device"].Type)
	name, ok := NameOf(fields, "Wait")
	assert.True(t, ok)
	assert.Equal(t, "wait_ns", name)
	_, ok = NameOf(fields, "Hidden")
	assert.False(t, ok)

	js, err := json.Marshal(byName["flags"])
	require.NoError(t, err)
	assert.JSONEq(t, `{"name":"flags","type":"int","min":0,"max":255,"doc":"bits"}`, string(js))
}

// Malformed declarations are programming errors, caught at init.
func TestSchemaPanicsOnMalformedDeclarations(t *testing.T) {
	type twice struct {
		A int `option:"a" doc:"x"`
		B int `option:"a" doc:"y"`
	}
	type undocumented struct {
		A int `option:"a"`
	}
	type badType struct {
		A bool `option:"a" type:"path" doc:"x"`
	}
	type badMin struct {
		A string `option:"a" min:"0" doc:"x"`
	}
	assert.Panics(t, func() { Schema[twice]() })
	assert.Panics(t, func() { Schema[undocumented]() })
	assert.Panics(t, func() { Schema[badType]() })
	assert.Panics(t, func() { Schema[badMin]() })
	assert.Panics(t, func() { Schema[int]() })
}

func TestDecode(t *testing.T) {
	fields := Schema[sample]()
	s := sample{Count: 7}
	require.NoError(t, Decode([]byte(`{"path":"/x","other_path":"/y","size":18446744073709551615,"wait_ns":5,
		"rate":0.5,"maybe":false,"devices":[1,2],"flags":255,"node":0}`), fields, &s))
	assert.Equal(t, "/x", s.Path)
	assert.Equal(t, "/y", s.More.Path)
	assert.Equal(t, 7, s.Count, "left out: unchanged")
	assert.Equal(t, uint64(18446744073709551615), s.Size)
	assert.Equal(t, 5*time.Nanosecond, s.Wait)
	assert.Equal(t, 0.5, s.Rate)
	require.NotNil(t, s.Maybe)
	assert.False(t, *s.Maybe)
	assert.Equal(t, []int{1, 2}, s.Devices)

	for _, empty := range []string{"", "null", " "} {
		var z sample
		require.NoError(t, Decode([]byte(empty), fields, &z))
		assert.Equal(t, sample{}, z)
	}
}

// Every refusal names the option and its value as given.
func TestDecodeErrors(t *testing.T) {
	fields := Schema[sample]()
	for in, want := range map[string]string{
		`{"bogus":1}`:       "option bogus=1 is unknown (valid: path, other_path, count,",
		`{"count":0}`:       "option count=0 must be positive (leave the option out for the default, 3)",
		`{"size":-1}`:       "option size=-1 does not fit type int",
		`{"on":"yes"}`:      `option on="yes" does not fit type bool`,
		`{"flags":256}`:     "option flags=256 is not in [0, 255]",
		`{"node":-1}`:       "option node=-1 is not in [0, 9223372036854775807]",
		`[1]`:               "options are not a JSON object",
		`{"path":1}`:        "option path=1 does not fit type path",
		`{"count":1.5}`:     "option count=1.5 does not fit type int",
		`{"devices":"all"}`: `option devices="all" does not fit type devices`,
	} {
		var s sample
		err := Decode([]byte(in), fields, &s)
		var oe *Error
		require.ErrorAs(t, err, &oe, in)
		assert.Contains(t, err.Error(), want, in)
	}
}
