//go:build cgo

package nccl_test

import (
	"errors"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/gocore/nccl/internal/fakenccl"
	"github.com/gpumempool/gpumempool/gocore/nccl/libnccl"
)

const testComm = uintptr(0xC0FFEE)

// CommRegister hands NCCL the range and communicator given, and
// CommDeregister takes back exactly the registration its handle names.
func TestCommRegisterAndDeregister(t *testing.T) {
	lib, fake := freshLib(t)
	require.NoError(t, lib.CheckCommRegister())

	first, err := lib.CommRegister(testComm, 0x10000, 4096)
	require.NoError(t, err)
	assert.NotZero(t, first)
	second, err := lib.CommRegister(testComm, 0x40000, 2<<20)
	require.NoError(t, err)
	assert.NotEqual(t, first, second)
	assert.Equal(t, []fakenccl.Registration{
		{Comm: testComm, Buf: 0x10000, Size: 4096},
		{Comm: testComm, Buf: 0x40000, Size: 2 << 20},
	}, fake.Registered())
	assert.Equal(t, 2, fake.Registrations())

	require.NoError(t, lib.CommDeregister(testComm, first))
	assert.Equal(t, []fakenccl.Registration{{Comm: testComm, Buf: 0x40000, Size: 2 << 20}}, fake.Registered())
	require.NoError(t, lib.CommDeregister(testComm, second))
	assert.Empty(t, fake.Registered())
}

// A failed call is an *Error with NCCL's result code and text, and changes
// nothing.
func TestCommRegisterFailuresAreNCCLErrors(t *testing.T) {
	lib, fake := freshLib(t)
	handle, err := lib.CommRegister(testComm, 0x10000, 4096)
	require.NoError(t, err)

	for name, call := range map[string]func() error{
		"a handle deregistered twice": func() error {
			other, err := lib.CommRegister(testComm, 0x20000, 4096)
			require.NoError(t, err)
			require.NoError(t, lib.CommDeregister(testComm, other))
			return lib.CommDeregister(testComm, other)
		},
		"another communicator's handle": func() error { return lib.CommDeregister(testComm+1, handle) },
	} {
		err := call()
		var nerr *libnccl.Error
		require.True(t, errors.As(err, &nerr), "%s: %v", name, err)
		assert.Equal(t, "ncclCommDeregister", nerr.Func, name)
		assert.Equal(t, libnccl.InvalidUsage, nerr.Code, name)
		assert.Contains(t, err.Error(), "[ncclInvalidUsage = 5]", name)
		assert.Contains(t, nerr.Text, "invalid usage", name)
	}

	_, err = lib.CommRegister(0, 0x30000, 4096)
	var nerr *libnccl.Error
	require.ErrorAs(t, err, &nerr)
	assert.Equal(t, libnccl.Error{Func: "ncclCommRegister", Code: libnccl.InvalidArgument,
		Text: lib.ErrorString(libnccl.InvalidArgument)}, *nerr)

	assert.Equal(t, []fakenccl.Registration{{Comm: testComm, Buf: 0x10000, Size: 4096}}, fake.Registered(),
		"only the first registration is left")
}

// ncclCommRegister is optional: a library without it loads (the backend
// needs only ncclMemAlloc), and registering with it says what is missing.
func TestCommRegisterNeedsTheSymbols(t *testing.T) {
	path := copyLib(t, builtLibs(t).NoRegister)
	lib, err := libnccl.Load(path)
	require.NoError(t, err, "ncclCommRegister is not required to load")

	err = lib.CheckCommRegister()
	require.ErrorIs(t, err, libnccl.ErrTooOld)
	assert.Contains(t, err.Error(), "ncclCommRegister")
	assert.Contains(t, err.Error(), "NCCL >= 2.19")
	assert.Contains(t, err.Error(), path)

	_, err = lib.CommRegister(testComm, 0x10000, 4096)
	require.ErrorIs(t, err, libnccl.ErrTooOld)
	require.ErrorIs(t, lib.CommDeregister(testComm, 1), libnccl.ErrTooOld)
}

// Registrations from many goroutines at once all arrive, and all leave.
func TestConcurrentCommRegister(t *testing.T) {
	lib, fake := freshLib(t)
	const workers, rounds = 8, 50
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range rounds {
				buf := uintptr(w+1)<<32 | uintptr(i)<<16
				h, err := lib.CommRegister(testComm, buf, 4096)
				if err == nil {
					err = lib.CommDeregister(testComm, h)
				}
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	assert.Equal(t, workers*rounds, fake.Registrations())
	assert.Empty(t, fake.Registered())
}
