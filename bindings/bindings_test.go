package bindings

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/bindings/pyerr"
)

func TestPoolLifecycleThroughHandles(t *testing.T) {
	id, err := NewPool(`{"backend":"sim","name":"t","options":{"devices":2,"capacity":67108864}}`)
	require.NoError(t, err)
	a, err := PoolAlloc(id, 1000, 1, 5)
	require.NoError(t, err)
	js, err := PoolStats(id, 1)
	require.NoError(t, err)
	var m map[string]int64
	require.NoError(t, json.Unmarshal([]byte(js), &m))
	assert.EqualValues(t, 1024, m["allocated_bytes.all.current"])
	assert.EqualValues(t, 1000, m["requested_bytes.all.current"])
	names, err := PoolSymbols(id, "plain")
	require.NoError(t, err)
	again, err := PoolSymbols(id, "plain")
	require.NoError(t, err)
	assert.Equal(t, names, again)
	assert.Regexp(t, `^gmp_alloc_\d+,gmp_free_\d+$`, names)
	segments, err := PoolSymbols(id, "segments")
	require.NoError(t, err)
	assert.Equal(t, strings.Replace(names, "gmp_alloc_", "gmp_segment_alloc_", 1), segments)
	throwing, err := PoolSymbols(id, "throwing")
	require.NoError(t, err)
	assert.Equal(t, strings.Replace(names, "gmp_alloc_", "gmp_alloc_or_throw_", 1), throwing)
	_, err = PoolSymbols(id, "other")
	assertKind(t, err, pyerr.InvalidArgument, "")
	ok, err := PoolFree(id, a)
	require.NoError(t, err)
	require.True(t, ok)
	_, err = PoolFree(id, a)
	require.Error(t, err)
	assertKind(t, err, pyerr.DoubleFree, "")
	rep, err := PoolClose(id)
	require.NoError(t, err)
	assert.Contains(t, rep, `"live_bytes":0`)
	_, err = PoolAlloc(id, 1, 0, 0)
	assertKind(t, err, pyerr.PoolClosed, "")
}

func TestErrorKinds(t *testing.T) {
	cases := map[string]string{ // the message starts so; every kind is InvalidArgument
		`{"backend":"cuda9"}`:                         "unknown backend",
		`{"backend":"sim","bogus":1}`:                 "pool options",
		`{"backend":"sim","options":{"fail_rate":2}}`: "",
		`{"backend":"callback"}`:                      "callback backend",
		`{"backend":"sim","max_split_size":5}`:        "new pool",
		`not json`:                                    "pool options",
		`{"backend":"sim"} {"limit":5}`:               "pool options: more than one",
	}
	for in, want := range cases {
		_, err := NewPool(in)
		require.Error(t, err, in)
		assertKind(t, err, pyerr.InvalidArgument, want)
	}
	id, err := NewPool(`{"options":{"capacity":4194304},"limit":2097152}`)
	require.NoError(t, err)
	_, err = PoolAlloc(id, 3<<20, 0, 0)
	assertKind(t, err, pyerr.OutOfMemory, "")
	_, err = PoolAlloc(id, 0, 0, 0)
	assertKind(t, err, pyerr.InvalidArgument, "")
	_, err = PoolAlloc(id, 1, 3, 0)
	assertKind(t, err, pyerr.InvalidArgument, "")
	_, err = PoolFree(id, 42)
	assertKind(t, err, pyerr.InvalidPointer, "")
	_, err = PoolClose(id)
	require.NoError(t, err)
}

func TestGuardRecoversPanics(t *testing.T) {
	f := func() (err error) {
		defer guard(&err)
		var m map[string]int
		m["x"] = 1 // nil map write panics
		return nil
	}
	err := f()
	require.Error(t, err)
	assertKind(t, err, pyerr.Backend, "gpumempool internal error (Go panic recovered)")
}

func TestDevicesWithoutDriverIsNotAnError(t *testing.T) {
	js, err := Devices()
	require.NoError(t, err)
	var out struct {
		Devices []map[string]any `json:"devices"`
		Reason  string           `json:"reason"`
	}
	require.NoError(t, json.Unmarshal([]byte(js), &out))
	if len(out.Devices) == 0 {
		assert.Contains(t, out.Reason, "NVML")
	}
}

// TestSimOptionsRefusedByName: every nonsensical sim option is refused as a
// ValueError naming the option as the user gave it; an option given as 0
// whose 0 would mean "the default" is refused, not silently defaulted.
func TestSimOptionsRefusedByName(t *testing.T) {
	cases := []struct{ sim, msg string }{
		{`{"capacity":0}`, "sim option capacity=0 must be positive (leave the option out for the default, 80.00 GiB)"},
		{`{"alignment":0}`, "sim option alignment=0 must be positive"},
		{`{"devices":0}`, "sim option devices=0 must be positive"},
		{`{"granularity":0}`, "sim option granularity=0 must be positive"},
		{`{"alignment":384}`, "sim option alignment=384 is not a power of two"},
		{`{"alignment":1024,"granularity":1536}`, "sim option granularity=1536 is not a multiple of Alignment 1024"},
		{`{"latency_ns":-5}`, "sim option latency_ns=-5 is negative"},
		{`{"fail_on_nth_alloc":-1}`, "sim option fail_on_nth_alloc=-1 is negative"},
		{`{"fail_rate":1.5}`, "sim option fail_rate=1.5 is not a probability in [0, 1]"},
		{`{"free_fail_rate":-0.25}`, "sim option free_fail_rate=-0.25 is not a probability in [0, 1]"},
		{`{"devices":-1}`, "sim option devices=-1 is not in [0, "},
		{`{"devices":100000}`, "sim option devices=100000 is not in [0, "},
		{`{"capacity":18446744073709551615}`, "sim option capacity=18446744073709551615 is too large"},
	}
	for _, tc := range cases {
		t.Run(tc.sim, func(t *testing.T) {
			_, err := NewPool(`{"backend":"sim","options":` + tc.sim + `}`)
			require.Error(t, err)
			assertKind(t, err, pyerr.InvalidArgument, "")
			assert.Contains(t, pyerr.Of(err).Message, tc.msg)
		})
	}
	// Leaving the options out, or giving them in range, still works.
	for _, sim := range []string{`{}`, `{"capacity":1048576,"alignment":1,"devices":1,"granularity":4096}`} {
		id, err := NewPool(`{"backend":"sim","options":` + sim + `}`)
		require.NoError(t, err, sim)
		_, err = PoolClose(id)
		require.NoError(t, err)
	}
}

// assertKind checks that err crosses to Python as a value of kind whose
// message starts with prefix.
func assertKind(t *testing.T, err error, kind pyerr.Kind, prefix string) {
	t.Helper()
	require.Error(t, err)
	v, ok := pyerr.Decode(err.Error())
	require.True(t, ok, "not a pyerr value: %s", err)
	assert.Equal(t, kind, v.Kind, err.Error())
	assert.True(t, strings.HasPrefix(v.Message, prefix), "%q does not start with %q", v.Message, prefix)
}

// FailedRequest names the pool and the size as the engine's out-of-memory
// message does, whatever Unicode version added the name's characters.
func TestFailedRequestIsTheEnginesWording(t *testing.T) {
	for _, name := range []string{"plain", "c\x01b\u00a0\"\\", "w\U0001F6DCk\u0CF3u\u0378"} {
		text, err := FailedRequest(name, 2<<20, 0)
		require.NoError(t, err)
		quoted := strings.TrimSuffix(strings.TrimPrefix(text, "pool "), " could not allocate 2.00 MiB on device 0")
		require.NotEqual(t, text, quoted, text)
		js, err := json.Marshal(map[string]any{"backend": "sim", "name": name, "limit": 1 << 20})
		require.NoError(t, err)
		id, err := NewPool(string(js))
		require.NoError(t, err)
		_, err = PoolAlloc(id, 2<<20, 0, 0)
		require.Error(t, err)
		v := pyerr.Of(err)
		assert.True(t, strings.HasPrefix(v.Message, "pool "+quoted+" (sim backend) out of memory on device 0: tried to allocate 2.00 MiB"), v.Message)
		_, err = PoolClose(id)
		require.NoError(t, err)
	}
	text, err := FailedRequest("p", 1<<50, 3)
	require.NoError(t, err)
	assert.Equal(t, `pool "p" could not allocate 1.00 PiB on device 3`, text)
}
