package bindings

import (
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/bindings/pyerr"
	"github.com/gpumempool/gpumempool/gocore/nccl/libnccl"
)

// buildFakeNCCL compiles the fake libnccl (tests/csrc/fake_nccl.c) into a
// file of its own and points $GMP_LIBNCCL at it: a new path is a new entry
// in libnccl.Load's cache, so no test sees another's copy.
func buildFakeNCCL(t *testing.T, flags ...string) string {
	t.Helper()
	out := buildCLib(t, "fake_nccl.c", "libfakenccl.so", append(flags, "-lpthread")...)
	t.Setenv(libnccl.EnvLibrary, out)
	return out
}

// Registration goes through the libnccl the nccl backend would load
// ($GMP_LIBNCCL here): a handle comes back, deregistering it works once,
// and the fake's refusal of a second time comes back as NCCL's result code.
func TestNcclCommRegister(t *testing.T) {
	path := buildFakeNCCL(t)
	desc, err := NcclRegistrationLibrary()
	require.NoError(t, err)
	assert.Contains(t, desc, "NCCL 2.23.4")
	assert.Contains(t, desc, filepath.Base(path))

	const comm = 0xC0FFEE
	handle, err := NcclCommRegister(comm, 0x10000, 4096)
	require.NoError(t, err)
	assert.NotZero(t, handle)

	_, err = NcclCommDeregister(comm+1, handle)
	require.Error(t, err, "another communicator's handle")
	assert.Contains(t, err.Error(), "ncclCommDeregister")

	ok, err := NcclCommDeregister(comm, handle)
	require.NoError(t, err)
	assert.True(t, ok)

	_, err = NcclCommDeregister(comm, handle)
	require.Error(t, err)
	assertKind(t, err, pyerr.Backend, "")
	assert.Regexp(t, `^deregister handle 0x[0-9a-f]+ from NCCL communicator 0xc0ffee: `+
		`ncclCommDeregister: .* \[ncclInvalidUsage = 5\]`, pyerr.Of(err).Message)

	_, err = NcclCommRegister(0, 0x10000, 4096)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "register [0x10000, +4096) with NCCL communicator 0x0: ncclCommRegister:")
	assert.Contains(t, err.Error(), "[ncclInvalidArgument = 4]")
}

// A libnccl without ncclCommRegister, or none at all, is refused before
// any call, saying why.
func TestNcclCommRegisterWithoutTheLibrary(t *testing.T) {
	buildFakeNCCL(t, "-DFAKE_NCCL_NO_REGISTER")
	_, err := NcclRegistrationLibrary()
	require.ErrorIs(t, err, libnccl.ErrTooOld)
	assert.Contains(t, err.Error(), "NCCL >= 2.19")
	_, err = NcclCommRegister(1, 0x10000, 4096)
	require.ErrorIs(t, err, libnccl.ErrTooOld)
	_, err = NcclCommDeregister(1, 1)
	require.ErrorIs(t, err, libnccl.ErrTooOld)

	t.Setenv(libnccl.EnvLibrary, filepath.Join(t.TempDir(), "libnccl.so.2"))
	_, err = NcclRegistrationLibrary()
	require.ErrorIs(t, err, libnccl.ErrNoNCCL)
	assertKind(t, err, pyerr.Backend, "")
}
