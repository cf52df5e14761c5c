package sim

import (
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/gocore"
)

func TestSimConfigDefaults(t *testing.T) {
	b := newSim(t, Config{})
	assert.Equal(t, "sim", b.Name())
	assert.Equal(t, 1, b.Devices())
	assert.Equal(t, uint64(512), b.Alignment())
	cfg := b.Config()
	assert.Equal(t, uint64(80<<30), cfg.Capacity)
	assert.Equal(t, uint64(0x7f0000000000), cfg.Base)
	total, free, err := b.Capacity(0)
	require.NoError(t, err)
	assert.Equal(t, uint64(80<<30), total)
	assert.Equal(t, total, free)

	addr, err := b.Alloc(0, 1, 0)
	require.NoError(t, err)
	assert.Equal(t, uint64(0x7f0000000000), addr, "first allocation starts at the base")

	b = newSim(t, Config{Devices: 3, Capacity: 1 << 20, Alignment: 4096, Base: 1 << 44})
	assert.Equal(t, 3, b.Devices())
	assert.Equal(t, uint64(4096), b.Alignment())
	for d := range 3 {
		addr, err := b.Alloc(d, 10, 0)
		require.NoError(t, err)
		lo, _ := simDeviceRange(b, d)
		assert.Equal(t, lo, addr)
		assert.Equal(t, uint64(1<<44)+uint64(d)<<40, addr, "device %d starts at base + d TiB", d)
	}

	// A large alignment moves the default base up rather than failing.
	b = newSim(t, Config{Alignment: 1 << 50})
	assert.Zero(t, b.Config().Base%(1<<50))
	addr, err = b.Alloc(0, 1, 0)
	require.NoError(t, err)
	assert.Zero(t, addr%(1<<50))
}

func TestSimConfigValidation(t *testing.T) {
	cases := []struct {
		name string
		cfg  Config
		msg  string
	}{
		{"negative devices", Config{Devices: -1}, "Devices"},
		{"alignment not power of two", Config{Alignment: 384}, "Alignment"},
		{"alignment 3", Config{Alignment: 3}, "Alignment"},
		{"misaligned base", Config{Base: 0x1000 + 8, Alignment: 512}, "Base"},
		{"negative latency", Config{Latency: -time.Millisecond}, "Latency"},
		{"negative nth", Config{FailOnNthAlloc: -2}, "FailOnNthAlloc"},
		{"negative fail rate", Config{FailRate: -0.1}, "FailRate"},
		{"fail rate above one", Config{FailRate: 1.5}, "FailRate"},
		{"NaN fail rate", Config{FailRate: math.NaN()}, "FailRate"},
		{"infinite fail rate", Config{FailRate: math.Inf(1)}, "FailRate"},
		{"negative free fail rate", Config{FreeFailRate: -1}, "FreeFailRate"},
		{"free fail rate above one", Config{FreeFailRate: 1.0001}, "FreeFailRate"},
		{"NaN free fail rate", Config{FreeFailRate: math.NaN()}, "FreeFailRate"},
		{"capacity overflows", Config{Capacity: math.MaxUint64}, "Capacity"},
		{"devices overflow address space", Config{Devices: gocore.MaxDevices, Capacity: 1 << 56}, "Devices"},
		{"too many devices", Config{Devices: gocore.MaxDevices + 1}, "Devices"},
		// The default capacity fits; rounded up to this alignment it does
		// not: the alignment is at fault, not a capacity left out.
		{"alignment too large for the capacity", Config{Alignment: 1 << 63}, "Alignment"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b, err := New(tc.cfg)
			require.Error(t, err)
			assert.Nil(t, b)
			assert.Contains(t, err.Error(), tc.msg)
			// Every refusal names its field, for the bindings to name the
			// option, and is a gocore.ErrInvalidArgument.
			var ce *ConfigError
			require.ErrorAs(t, err, &ce)
			assert.Equal(t, tc.msg, ce.Field)
			assert.ErrorIs(t, err, gocore.ErrInvalidArgument)
		})
	}
	// Boundary values are accepted.
	for _, cfg := range []Config{
		{FailRate: 1, FreeFailRate: 1},
		{Alignment: 1, Base: 12345},
		{Devices: 64},
	} {
		_, err := New(cfg)
		assert.NoError(t, err, "config %+v", cfg)
	}
}
