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

// setting is declared as gocore.Config declares a pool's settings: with a
// unit, torch's option of the same setting, a list form, a default in words.
type setting struct {
	Split    uint64   `option:"split" unit:"bytes" torch:"split_mb" torch_unit:"MiB" torch_min:"21" search:"64, 32MiB,2GiB" doc:"never split above"`
	Steps    uint64   `option:"steps" unit:"count" torch:"steps" doc:"steps"`
	BySize   []uint64 `option:"steps_by_size" unit:"count" given_as:"steps" doc:"steps per size"`
	Fraction float64  `option:"fraction" unit:"fraction" search:"0.5,0.75" doc:"of the limit"`
	Version  string   `option:"version" unit:"version" default:"the oldest rules" doc:"rules"`
	Internal bool
}

// The tags that say what a setting means reach the schema, and the layers
// above read them from there (units, torch's name, unit and minimum, the
// option a list form is given as).
func TestSchemaDescribesSettings(t *testing.T) {
	fields := Schema[setting]()
	require.Len(t, fields, 5, "an untagged field is no option")
	js, err := json.Marshal(fields)
	require.NoError(t, err)
	assert.JSONEq(t, `[
		{"name":"split","type":"int","min":0,"max":18446744073709551615,"doc":"never split above","unit":"bytes",
		 "torch":"split_mb","torch_unit":"MiB","torch_scale":1048576,"torch_min":21,"search":[64,33554432,2147483648]},
		{"name":"steps","type":"int","min":0,"max":18446744073709551615,"doc":"steps","unit":"count","torch":"steps"},
		{"name":"steps_by_size","type":"ints","min":0,"max":18446744073709551615,"doc":"steps per size","unit":"count",
		 "given_as":"steps"},
		{"name":"fraction","type":"float","doc":"of the limit","unit":"fraction","search":[0.5,0.75]},
		{"name":"version","type":"string","default":"the oldest rules","doc":"rules","unit":"version"}]`, string(js))
}

// Values reads back what Decode wrote, by option name, for every option.
func TestValuesReadsBackDecoded(t *testing.T) {
	fields := Schema[setting]()
	var s setting
	require.NoError(t, Decode([]byte(`{"split":5,"steps_by_size":[1,2],"fraction":0.5,"version":"2.15"}`), fields, &s))
	assert.Equal(t, map[string]any{"split": uint64(5), "steps": uint64(0), "steps_by_size": []uint64{1, 2},
		"fraction": 0.5, "version": "2.15"}, Values(fields, &s))
	err := Decode([]byte(`{"steps_by_size":[-1]}`), fields, &s)
	assert.ErrorContains(t, err, "option steps_by_size=[-1] does not fit type ints")
}

// A meaning tag that does not fit its field is a programming error too.
func TestSchemaPanicsOnMalformedMeanings(t *testing.T) {
	type unknownUnit struct {
		A uint64 `option:"a" unit:"pages" doc:"x"`
	}
	type fractionInt struct {
		A uint64 `option:"a" unit:"fraction" doc:"x"`
	}
	type torchUnitAlone struct {
		A uint64 `option:"a" unit:"bytes" torch_unit:"MiB" doc:"x"`
	}
	type torchUnitUnknown struct {
		A uint64 `option:"a" unit:"bytes" torch:"a_gb" torch_unit:"GiB" doc:"x"`
	}
	type torchMinAlone struct {
		A uint64 `option:"a" torch_min:"3" doc:"x"`
	}
	type givenAsNothing struct {
		A []uint64 `option:"a" given_as:"b" doc:"x"`
	}
	type givenAsItself struct {
		A []uint64 `option:"a" given_as:"a" doc:"x"`
	}
	type searchSuffixOnCount struct {
		A uint64 `option:"a" unit:"count" search:"2MiB" doc:"x"`
	}
	type searchNotANumber struct {
		A float64 `option:"a" search:"half" doc:"x"`
	}
	type searchOverflows struct {
		A uint64 `option:"a" unit:"bytes" search:"17179869184GiB" doc:"x"`
	}
	type searchOnString struct {
		A string `option:"a" search:"x" doc:"x"`
	}
	type twoDefaults struct {
		Count int `option:"count" default:"4" doc:"x"`
	}
	for name, f := range map[string]func(){
		"unknownUnit": func() { Schema[unknownUnit]() }, "fractionInt": func() { Schema[fractionInt]() },
		"torchUnitAlone": func() { Schema[torchUnitAlone]() }, "torchUnitUnknown": func() { Schema[torchUnitUnknown]() },
		"torchMinAlone": func() { Schema[torchMinAlone]() }, "givenAsNothing": func() { Schema[givenAsNothing]() },
		"givenAsItself":       func() { Schema[givenAsItself]() },
		"searchSuffixOnCount": func() { Schema[searchSuffixOnCount]() }, "searchNotANumber": func() { Schema[searchNotANumber]() },
		"searchOverflows": func() { Schema[searchOverflows]() }, "searchOnString": func() { Schema[searchOnString]() },
	} {
		assert.Panics(t, f, name)
	}
	assert.Panics(t, func() { Schema[twoDefaultsSample]() }, "a default tag and an OptionDefaults entry")
	assert.NotPanics(t, func() { Schema[twoDefaults]() })
}

type twoDefaultsSample struct {
	Count int `option:"count" default:"4" doc:"how many"`
}

func (twoDefaultsSample) OptionDefaults() map[string]string { return map[string]string{"count": "3"} }
