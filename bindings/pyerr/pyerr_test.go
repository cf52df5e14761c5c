package pyerr

import (
	"errors"
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/bindings/registry"
	"github.com/gpumempool/gpumempool/gocore"
)

func TestKindOfNamesEachEngineError(t *testing.T) {
	for err, want := range map[error]Kind{
		&gocore.OutOfMemoryError{}:  OutOfMemory,
		gocore.ErrDoubleFree:        DoubleFree,
		gocore.ErrUnknownPointer:    InvalidPointer,
		gocore.ErrInteriorPointer:   InvalidPointer,
		gocore.ErrClosed:            PoolClosed,
		registry.ErrNoSuchPool:      PoolClosed,
		gocore.ErrInvalidSize:       InvalidArgument,
		gocore.ErrInvalidDevice:     InvalidArgument,
		gocore.ErrInvalidArgument:   InvalidArgument,
		errors.New("backend broke"): Backend,
	} {
		assert.Equal(t, want, KindOf(fmt.Errorf("context: %w", err)), "%v", err)
	}
}

// An out-of-memory error crosses with the numbers of its struct, wrapped
// or not, and Wrap keeps errors.Is / errors.As working in Go.
func TestOutOfMemoryCrossesWithItsFields(t *testing.T) {
	oom := &gocore.OutOfMemoryError{Pool: "p", Backend: "sim", Device: 1, Requested: 3 << 20, Segment: 20 << 20,
		Allocated: 1 << 20, Reserved: 2 << 20, Limit: 4 << 20, Cause: errors.New("device full")}
	err := Wrap(fmt.Errorf("gmp_alloc: %w", oom))
	assert.ErrorIs(t, err, gocore.ErrOutOfMemory)
	var back *gocore.OutOfMemoryError
	require.ErrorAs(t, err, &back)
	v, ok := Decode(err.Error())
	require.True(t, ok, err.Error())
	assert.Equal(t, OutOfMemory, v.Kind)
	assert.Equal(t, "gmp_alloc: "+oom.Error(), v.Message)
	assert.Equal(t, map[string]any{"pool": "p", "backend": "sim", "device": 1.0, "requested": float64(3 << 20),
		"segment": float64(20 << 20), "allocated": float64(1 << 20), "reserved": float64(2 << 20),
		"limit": float64(4 << 20), "shared_reserved": 0.0, "device_free": 0.0, "device_total": 0.0,
		"cause": "device full"}, v.Fields)
	assert.Same(t, err, Wrap(err), "wrapped once")
	assert.NoError(t, Wrap(nil))
}

// Through a buffer the message is cut, never the JSON, so that the value
// still decodes; without room for the fields they go first.
func TestJSONWithinCutsTheMessageNotTheValue(t *testing.T) {
	v := Value{Kind: OutOfMemory, Message: strings.Repeat("é", 600), Fields: map[string]any{"device": 3}}
	for _, n := range []int{2048, 1024, 200, 60, 45} {
		s := v.JSONWithin(n)
		require.LessOrEqual(t, len(s), n-1, "n=%d", n)
		got, ok := Decode(s)
		require.True(t, ok, "n=%d: %s", n, s)
		assert.Equal(t, OutOfMemory, got.Kind)
		assert.True(t, strings.HasPrefix(v.Message, strings.TrimSuffix(got.Message, "...")), "n=%d", n)
	}
	assert.Equal(t, v.JSON(), v.JSONWithin(4096), "a value that fits is whole")
	_, ok := Decode("OutOfMemoryError: the old form")
	assert.False(t, ok)
}

// The C side makes one error itself (a forked child cannot run Go): its
// kind is this package's.
func TestTheCSideNamesTheForkKindAsGoDoes(t *testing.T) {
	h, err := os.ReadFile("../cabi/exports.h")
	require.NoError(t, err)
	m := regexp.MustCompile(`#define GMP_ERROR_KIND_FORKED "(\w+)"`).FindSubmatch(h)
	require.NotNil(t, m)
	assert.Equal(t, string(ForkedProcess), string(m[1]))
	assert.Contains(t, Kinds(), ForkedProcess)
}
