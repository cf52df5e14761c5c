// Package options turns a backend's Options struct into the one
// declaration of its options: the schema that the Python layer validates
// and documents them from (Schema), and the strict decoding of a JSON
// object of options into the struct (Decode). A backend package declares
// each option once, as a field with tags:
//
//		Capacity uint64 `option:"capacity" doc:"bytes each device can hand out"`
//
//	  - option: the name users give (a JSON key, a keyword argument); "-" or
//	    no tag leaves the field out. Embedded structs contribute their fields.
//	  - doc: one line for users.
//	  - type: what the Python layer checks beyond the Go type: "path" (a str
//	    or os.PathLike), "device" (0, 1, "cuda:1", a torch.device),
//	    "probability" (a finite number).
//	  - min: a lower bound narrower than the Go type's, e.g. "0" for an int.
//	  - zero: "default" when 0 selects the default, so that an explicit 0 is
//	    refused (leave the option out for the default) rather than silently
//	    meaning something else.
//	  - unit: what a number counts, for the layers that parse, show and
//	    convert it: "bytes", "count", "fraction" (in [0, 1)) or "version"
//	    (a string naming a release).
//	  - torch: the name of the PYTORCH_CUDA_ALLOC_CONF option the setting is
//	    (a pool setting torch also has), with torch_unit ("MiB") the unit
//	    torch gives it in and torch_min the smallest value torch accepts, in
//	    that unit.
//	  - given_as: the option users give this one through (another option's
//	    name): e.g. per-size divisions are given as a list for the option
//	    of one count.
//	  - search: the values worth trying when searching for the best
//	    setting (gpumempool.tune), comma-separated; sizes may end in KiB,
//	    MiB or GiB.
//
// Defaults are described by the struct's OptionDefaults method, when it has
// one (see Defaulter), so that they are computed from the constants that
// define them; or, where words are enough, by a default tag.
package options

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"reflect"
	"sort"
	"strconv"
	"strings"
)

// Field is one option in a schema.
type Field struct {
	Name string `json:"name"`
	// Type is "bool", "int", "float", "string", "path", "device",
	// "devices" (a list of devices), "ints" (a list of unsigned ints) or
	// "probability".
	Type string `json:"type"`
	// Min and Max bound an "int", or each of "ints" (inclusive); JSON
	// numbers, exact.
	Min *json.Number `json:"min,omitempty"`
	Max *json.Number `json:"max,omitempty"`
	// Default says what leaving the option out gives, in words ("" when the
	// zero value is the default and needs no words).
	Default string `json:"default,omitempty"`
	// ZeroIsDefault: an explicit 0 is refused (0 would mean the default).
	ZeroIsDefault bool   `json:"zero_is_default,omitempty"`
	Doc           string `json:"doc"`
	// Unit is what a number counts: "bytes", "count", "fraction",
	// "version" ("" for none).
	Unit string `json:"unit,omitempty"`
	// Torch is the PYTORCH_CUDA_ALLOC_CONF option of the same setting ("":
	// torch has none); TorchUnit is the unit torch reads it in ("MiB"),
	// TorchScale that unit in bytes, TorchMin the least value torch
	// accepts, in that unit.
	Torch      string       `json:"torch,omitempty"`
	TorchUnit  string       `json:"torch_unit,omitempty"`
	TorchScale uint64       `json:"torch_scale,omitempty"`
	TorchMin   *json.Number `json:"torch_min,omitempty"`
	// GivenAs names the option this one is given through ("": itself).
	GivenAs string `json:"given_as,omitempty"`
	// Search lists the values worth trying in a search for the best
	// setting, besides the default.
	Search []json.Number `json:"search,omitempty"`

	index  []int  // the struct field, for Decode
	goName string // its name in Go, for NameOf
	// The bounds of the min and max tags, which Decode checks (JSON
	// decoding checks the Go type's).
	tagMin, tagMax *int64
}

// Defaulter is implemented by Options structs whose defaults need words:
// option name -> what leaving it out gives.
type Defaulter interface {
	OptionDefaults() map[string]string
}

// Schema returns the options of T, a struct type, in field order. It panics
// on a malformed tag: schemas are built from package-level declarations at
// init, where a panic is a programming error caught by any test.
func Schema[T any]() []Field {
	var zero T
	t := reflect.TypeOf(zero)
	if t.Kind() != reflect.Struct {
		panic(fmt.Sprintf("options: %v is not a struct", t))
	}
	var defaults map[string]string
	if d, ok := any(zero).(Defaulter); ok {
		defaults = d.OptionDefaults()
	}
	fields := collect(t, nil, defaults)
	seen := map[string]bool{}
	for _, f := range fields {
		if seen[f.Name] {
			panic(fmt.Sprintf("options: %v declares option %q twice", t, f.Name))
		}
		seen[f.Name] = true
	}
	for name := range defaults {
		if !seen[name] {
			panic(fmt.Sprintf("options: %v: OptionDefaults names %q, which is no option", t, name))
		}
	}
	for _, f := range fields {
		if f.GivenAs != "" && (!seen[f.GivenAs] || f.GivenAs == f.Name) {
			panic(fmt.Sprintf("options: %v: option %q is given as %q, which is no other option", t, f.Name, f.GivenAs))
		}
	}
	return fields
}

func collect(t reflect.Type, index []int, defaults map[string]string) []Field {
	var out []Field
	for i := 0; i < t.NumField(); i++ {
		sf := t.Field(i)
		idx := append(append([]int(nil), index...), i)
		tag := sf.Tag.Get("option")
		if sf.Type.Kind() == reflect.Struct && (sf.Anonymous && tag == "" || tag == ",inline") {
			out = append(out, collect(sf.Type, idx, defaults)...)
			continue
		}
		name := tag
		if name == "" || name == "-" {
			continue
		}
		f := Field{Name: name, Doc: sf.Tag.Get("doc"), Default: defaults[name], index: idx, goName: sf.Name,
			ZeroIsDefault: sf.Tag.Get("zero") == "default"}
		if d := sf.Tag.Get("default"); d != "" {
			if f.Default != "" {
				panic(fmt.Sprintf("options: %v.%s: option %q has a default tag and an OptionDefaults entry", t, sf.Name, name))
			}
			f.Default = d
		}
		if f.Doc == "" {
			panic(fmt.Sprintf("options: %v.%s: option %q has no doc", t, sf.Name, name))
		}
		f.Type, f.Min, f.Max = kind(sf)
		describe(t, sf, &f)
		for _, bound := range []struct {
			tag string
			dst **json.Number
			val **int64
		}{{"min", &f.Min, &f.tagMin}, {"max", &f.Max, &f.tagMax}} {
			if m := sf.Tag.Get(bound.tag); m != "" {
				v, err := strconv.ParseInt(m, 10, 64)
				if err != nil || f.Type != "int" {
					panic(fmt.Sprintf("options: %v.%s: %s %q on a %s", t, sf.Name, bound.tag, m, f.Type))
				}
				n := json.Number(m)
				*bound.dst, *bound.val = &n, &v
			}
		}
		out = append(out, f)
	}
	return out
}

// torchUnits are the units torch reads sizes in, in bytes.
var torchUnits = map[string]uint64{"MiB": 1 << 20}

// units are the values of the unit tag.
var units = map[string]bool{"bytes": true, "count": true, "fraction": true, "version": true}

// describe reads the tags that say what an option means (unit, torch,
// given_as) into f, refusing malformed ones.
func describe(t reflect.Type, sf reflect.StructField, f *Field) {
	bad := func(what string) {
		panic(fmt.Sprintf("options: %v.%s: option %q: %s", t, sf.Name, f.Name, what))
	}
	f.Unit, f.Torch, f.TorchUnit, f.GivenAs = sf.Tag.Get("unit"), sf.Tag.Get("torch"), sf.Tag.Get("torch_unit"), sf.Tag.Get("given_as")
	if f.Unit != "" && !units[f.Unit] {
		bad(fmt.Sprintf("unknown unit %q", f.Unit))
	}
	if f.Unit == "fraction" && f.Type != "float" || f.Unit == "version" && f.Type != "string" {
		bad(fmt.Sprintf("unit %s on a %s", f.Unit, f.Type))
	}
	if f.TorchUnit != "" {
		scale, ok := torchUnits[f.TorchUnit]
		if !ok || f.Torch == "" || f.Unit != "bytes" {
			bad(fmt.Sprintf("torch_unit %q needs a torch name, unit bytes and one of MiB", f.TorchUnit))
		}
		f.TorchScale = scale
	}
	if list := sf.Tag.Get("search"); list != "" {
		for _, item := range strings.Split(list, ",") {
			v, ok := searchValue(strings.TrimSpace(item), f.Type, f.Unit)
			if !ok {
				bad(fmt.Sprintf("search value %q is no %s in %s", item, f.Type, f.Unit))
			}
			f.Search = append(f.Search, v)
		}
	}
	if m := sf.Tag.Get("torch_min"); m != "" {
		if _, err := strconv.ParseUint(m, 10, 64); err != nil || f.Torch == "" {
			bad(fmt.Sprintf("torch_min %q needs a torch name and a whole number", m))
		}
		n := json.Number(m)
		f.TorchMin = &n
	}
}

// sizeUnits are the suffixes a size in a search tag may have.
var sizeUnits = map[string]uint64{"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}

// searchValue reads one value of a search tag as a JSON number of the
// option's type: a float, or an int (with a size suffix for bytes).
func searchValue(item, typ, unit string) (json.Number, bool) {
	switch typ {
	case "float":
		_, err := strconv.ParseFloat(item, 64)
		return json.Number(item), err == nil
	case "int":
		scale := uint64(1)
		for suffix, s := range sizeUnits {
			if unit == "bytes" && strings.HasSuffix(item, suffix) {
				item, scale = strings.TrimSuffix(item, suffix), s
			}
		}
		n, err := strconv.ParseUint(item, 10, 64)
		if err != nil || n > math.MaxUint64/scale {
			return "", false
		}
		return json.Number(strconv.FormatUint(n*scale, 10)), true
	}
	return "", false
}

// kind maps a field's Go type (and type tag) to a schema type and bounds.
func kind(sf reflect.StructField) (string, *json.Number, *json.Number) {
	num := func(s string) *json.Number { n := json.Number(s); return &n }
	tag := sf.Tag.Get("type")
	switch k := sf.Type.Kind(); {
	case tag == "device" && k == reflect.Int:
		return "device", nil, nil
	case tag == "device" && k == reflect.Slice && sf.Type.Elem().Kind() == reflect.Int:
		return "devices", nil, nil
	case tag == "path" && k == reflect.String:
		return "path", nil, nil
	case tag == "probability" && k == reflect.Float64:
		return "probability", nil, nil
	case tag != "":
		panic(fmt.Sprintf("options: field %s: type %q does not fit %v", sf.Name, tag, sf.Type))
	case k == reflect.Bool:
		return "bool", nil, nil
	case k == reflect.String:
		return "string", nil, nil
	case k == reflect.Float64:
		return "float", nil, nil
	case k >= reflect.Int && k <= reflect.Int64:
		bits := sf.Type.Bits()
		return "int", num(strconv.FormatInt(-1<<(bits-1), 10)), num(strconv.FormatInt(1<<(bits-1)-1, 10))
	case k >= reflect.Uint && k <= reflect.Uint64:
		return "int", num("0"), num(strconv.FormatUint(math.MaxUint64>>(64-sf.Type.Bits()), 10))
	case k == reflect.Slice && sf.Type.Elem().Kind() >= reflect.Uint && sf.Type.Elem().Kind() <= reflect.Uint64:
		return "ints", num("0"), num(strconv.FormatUint(math.MaxUint64>>(64-sf.Type.Elem().Bits()), 10))
	case k == reflect.Pointer && sf.Type.Elem().Kind() == reflect.Bool:
		return "bool", nil, nil // nil: left out
	}
	panic(fmt.Sprintf("options: field %s: no option type for %v", sf.Name, sf.Type))
}

// Error is a refused option; it names the option as users give it.
type Error struct {
	Option string // "" when the JSON itself is malformed
	Value  string // as given, in JSON
	Reason string
}

// Error reads "option capacity=0 must be positive ...".
func (e *Error) Error() string {
	if e.Option == "" {
		return e.Reason
	}
	return fmt.Sprintf("option %s=%s %s", e.Option, e.Value, e.Reason)
}

// Decode parses data, a JSON object of options (empty or "null": none),
// into *dst, which holds the defaults of the options left out. An unknown
// option, a value of the wrong type, or a 0 for a ZeroIsDefault option is
// an *Error naming it.
func Decode[T any](data []byte, fields []Field, dst *T) error {
	data = bytes.TrimSpace(data)
	if len(data) == 0 || string(data) == "null" {
		return nil
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(data, &raw); err != nil {
		return &Error{Reason: fmt.Sprintf("options are not a JSON object: %v", err)}
	}
	byName := make(map[string]Field, len(fields))
	for _, f := range fields {
		byName[f.Name] = f
	}
	names := make([]string, 0, len(raw))
	for name := range raw {
		names = append(names, name)
	}
	sort.Strings(names)
	v := reflect.ValueOf(dst).Elem()
	for _, name := range names {
		f, ok := byName[name]
		if !ok {
			valid := make([]string, len(fields))
			for i, f := range fields {
				valid[i] = f.Name
			}
			return &Error{Option: name, Value: string(raw[name]), Reason: "is unknown (valid: " + strings.Join(valid, ", ") + ")"}
		}
		fv := v.FieldByIndex(f.index)
		target := fv
		if fv.Kind() == reflect.Pointer {
			fv.Set(reflect.New(fv.Type().Elem()))
			target = fv.Elem()
		}
		dec := json.NewDecoder(bytes.NewReader(raw[name]))
		dec.UseNumber()
		if err := dec.Decode(target.Addr().Interface()); err != nil {
			var te *json.UnmarshalTypeError
			if errors.As(err, &te) {
				return &Error{Option: name, Value: string(raw[name]), Reason: "does not fit type " + f.Type}
			}
			return &Error{Option: name, Value: string(raw[name]), Reason: err.Error()}
		}
		if f.ZeroIsDefault && target.IsZero() {
			reason := "must be positive (leave the option out for the default"
			if f.Default != "" {
				reason += ", " + f.Default
			}
			return &Error{Option: name, Value: string(raw[name]), Reason: reason + ")"}
		}
		if err := f.inRange(target); err != "" {
			return &Error{Option: name, Value: string(raw[name]), Reason: err}
		}
	}
	return nil
}

// inRange checks an "int" option against the bounds of its tags (the Go
// type's own are JSON decoding's); it returns why not, or "".
func (f Field) inRange(v reflect.Value) string {
	if f.tagMin == nil && f.tagMax == nil {
		return ""
	}
	lo, hi := int64(math.MinInt64), int64(math.MaxInt64)
	if f.tagMin != nil {
		lo = *f.tagMin
	}
	if f.tagMax != nil {
		hi = *f.tagMax
	}
	why := fmt.Sprintf("is not in [%s, %s]", f.Min, f.Max)
	switch {
	case v.CanInt() && (v.Int() < lo || v.Int() > hi):
		return why
	case v.CanUint() && (hi < 0 || v.Uint() > uint64(hi)):
		return why
	}
	return ""
}

// NameOf returns the option name of the struct field called goName (e.g.
// "Capacity" -> "capacity"), for errors that name Go fields.
func NameOf(fields []Field, goName string) (string, bool) {
	for _, f := range fields {
		if f.goName == goName {
			return f.Name, true
		}
	}
	return "", false
}

// Values returns the options of *src by name, in the Go types of their
// fields: what a struct decoded by Decode holds, to publish it back.
func Values[T any](fields []Field, src *T) map[string]any {
	v := reflect.ValueOf(src).Elem()
	out := make(map[string]any, len(fields))
	for _, f := range fields {
		out[f.Name] = v.FieldByIndex(f.index).Interface()
	}
	return out
}
