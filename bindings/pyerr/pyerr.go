// Package pyerr is the one error channel from the engine to Python. Every
// error a binding hands to Python - gopy's exception text, the C fast path's
// buffer (bindings/cabi), the C ABI's refusal of a forked child
// (bindings/cabi/exports.c) - crosses as one JSON object
//
//	{"kind": "OutOfMemoryError", "message": "...", "fields": {"device": 0, ...}}
//
// whose kind is one of Kinds, and whose fields are the numbers the Go error
// value held (an out-of-memory error's device, request, limit, pool, ...).
// gpumempool/_errors.py turns it into the exception named by kind, with the
// fields as attributes: nothing on the Python side reads the message.
package pyerr

import (
	"encoding/json"
	"errors"
	"strings"
	"unicode/utf8"

	"github.com/gpumempool/gpumempool/bindings/registry"
	"github.com/gpumempool/gpumempool/gocore"
)

// Kind names the Python exception class gpumempool raises for an error
// (gpumempool/_errors.py has one class per kind).
type Kind string

// The kinds of error that cross to Python.
const (
	// OutOfMemory: an allocation failed after the pool released its cache
	// and retried (*gocore.OutOfMemoryError; fields: OutOfMemoryFields).
	OutOfMemory Kind = "OutOfMemoryError"
	// DoubleFree: the address is in the pool but not an allocated block.
	DoubleFree Kind = "DoubleFreeError"
	// InvalidPointer: the address is not the start of a block of the pool.
	InvalidPointer Kind = "InvalidPointerError"
	// PoolClosed: the pool was closed, or its handle never issued.
	PoolClosed Kind = "PoolClosedError"
	// InvalidArgument: a bad size, device, option or configuration.
	InvalidArgument Kind = "InvalidArgumentError"
	// ForkedProcess: a call in a process forked from one that loaded the
	// engine. Only the C side makes it (exports.c, GMP_ERROR_KIND_FORKED),
	// as no Go runs in such a child.
	ForkedProcess Kind = "ForkedProcessError"
	// Backend: anything else (the backend, a user's allocator function, a
	// recovered Go panic).
	Backend Kind = "BackendError"
)

// Kinds lists every kind, for the Python side's check that it has a class
// for each.
func Kinds() []Kind {
	return []Kind{OutOfMemory, DoubleFree, InvalidPointer, PoolClosed, InvalidArgument, ForkedProcess, Backend}
}

// KindOf names the kind of err.
func KindOf(err error) Kind {
	switch {
	case errors.Is(err, gocore.ErrOutOfMemory):
		return OutOfMemory
	case errors.Is(err, gocore.ErrDoubleFree):
		return DoubleFree
	case errors.Is(err, gocore.ErrUnknownPointer), errors.Is(err, gocore.ErrInteriorPointer):
		return InvalidPointer
	case errors.Is(err, gocore.ErrClosed), errors.Is(err, registry.ErrNoSuchPool):
		return PoolClosed
	case errors.Is(err, gocore.ErrInvalidSize), errors.Is(err, gocore.ErrInvalidDevice),
		errors.Is(err, gocore.ErrInvalidArgument):
		return InvalidArgument
	default:
		return Backend
	}
}

// Value is an error as it crosses to Python.
type Value struct {
	Kind    Kind   `json:"kind"`
	Message string `json:"message"`
	// Fields are the error's own values, by the names the Python exception
	// gives its attributes; absent when the error has none.
	Fields map[string]any `json:"fields,omitempty"`
}

// Of is err as it crosses to Python: its kind, its text and its fields.
func Of(err error) Value {
	var v *Error
	if errors.As(err, &v) {
		return v.Value
	}
	return Value{Kind: KindOf(err), Message: err.Error(), Fields: fieldsOf(err)}
}

// fieldsOf returns the values err carries, or nil.
func fieldsOf(err error) map[string]any {
	var oom *gocore.OutOfMemoryError
	if errors.As(err, &oom) {
		return OutOfMemoryFields(oom)
	}
	return nil
}

// OutOfMemoryFields are the fields of an out-of-memory error: every number
// its message names (limit and shared_reserved are 0 when there is none,
// device_free and device_total when the backend cannot tell), and the
// backend's error as cause ("" when the pool's limit was hit).
func OutOfMemoryFields(e *gocore.OutOfMemoryError) map[string]any {
	cause := ""
	if e.Cause != nil {
		cause = e.Cause.Error()
	}
	return map[string]any{"pool": e.Pool, "backend": e.Backend, "device": e.Device, "requested": e.Requested,
		"segment": e.Segment, "allocated": e.Allocated, "reserved": e.Reserved, "limit": e.Limit,
		"shared_reserved": e.SharedReserved, "device_free": e.DeviceFree, "device_total": e.DeviceTotal,
		"cause": cause}
}

// JSON is v as it crosses: "<", ">" and "&" as they are (the text is read
// as JSON, never put in HTML), so that the message reads as written.
func (v Value) JSON() string {
	var b strings.Builder
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil { // fields of types JSON cannot hold: the error still crosses
		b.Reset()
		_ = enc.Encode(Value{Kind: v.Kind, Message: v.Message})
	}
	return strings.TrimSuffix(b.String(), "\n")
}

// JSONWithin is v as it crosses through a buffer of n bytes (NUL included):
// the message is shortened, never the JSON cut, so that it still decodes.
func (v Value) JSONWithin(n int) string {
	s := v.fit(n)
	if len(s) > n-1 && v.Fields != nil { // the fields alone do not fit: the kind and message must
		v.Fields = nil
		s = v.fit(n)
	}
	return s // longer only for a buffer too small for the kind: the reader then sees no value
}

// fit shortens v's message until v's JSON fits n bytes, or is empty.
func (v Value) fit(n int) string {
	s := v.JSON()
	for len(s) > n-1 && v.Message != "" {
		keep := max(len(v.Message)-(len(s)-(n-1))-len("..."), 0)
		for keep > 0 && !utf8.RuneStart(v.Message[keep]) {
			keep--
		}
		if keep == 0 {
			v.Message = ""
		} else {
			v.Message = v.Message[:keep] + "..."
		}
		s = v.JSON()
	}
	return s
}

// Decode reads a value made by JSON; ok is false for any other text.
func Decode(text string) (v Value, ok bool) {
	if err := json.Unmarshal([]byte(text), &v); err != nil || v.Kind == "" {
		return Value{}, false
	}
	return v, true
}

// Error is an error whose text is its Value's JSON: what a binding returns,
// so that gopy, which raises every error as RuntimeError(err.Error()),
// carries the structured value. Go code still reaches the error it wraps
// (errors.Is, errors.As).
type Error struct {
	Value
	err error
}

// Error returns the value's JSON.
func (e *Error) Error() string { return e.Value.JSON() }

// Unwrap returns the engine's error.
func (e *Error) Unwrap() error { return e.err }

// Wrap makes err cross as its Value; nil stays nil, and an error wrapped
// already is returned as it is.
func Wrap(err error) error {
	if err == nil {
		return nil
	}
	var e *Error
	if errors.As(err, &e) {
		return err
	}
	return &Error{Value: Of(err), err: err}
}
