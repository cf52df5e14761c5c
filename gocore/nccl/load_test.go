//go:build cgo

package nccl_test

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/gocore/nccl/internal/fakenccl"
	"github.com/gpumempool/gpumempool/gocore/nccl/libnccl"
)

func realPath(t *testing.T, p string) string {
	t.Helper()
	r, err := filepath.EvalSymlinks(p)
	require.NoError(t, err)
	return r
}

func TestLoadPath(t *testing.T) {
	path := copyLib(t, builtLibs(t).Fake)
	lib, err := libnccl.Load(path)
	require.NoError(t, err)
	major, minor, patch := lib.Version()
	assert.Equal(t, [3]int{2, 23, 4}, [3]int{major, minor, patch}, "FAKE_NCCL_VERSION defaults to 22304")
	assert.Equal(t, realPath(t, path), lib.Path())
	assert.Contains(t, lib.String(), "NCCL 2.23.4")
	assert.Contains(t, lib.ErrorString(libnccl.UnhandledCudaError), "unhandled cuda error")

	again, err := libnccl.Load(path)
	require.NoError(t, err)
	assert.Same(t, lib, again, "cached by path")

	link := filepath.Join(t.TempDir(), "libnccl.so.2")
	require.NoError(t, os.Symlink(path, link))
	viaLink, err := libnccl.Load(link)
	require.NoError(t, err)
	assert.Same(t, lib, viaLink, "cached by resolved path")
}

func TestLoadFromEnv(t *testing.T) {
	path := copyLib(t, builtLibs(t).Fake)
	t.Setenv(libnccl.EnvLibrary, path)
	lib, err := libnccl.Load("")
	require.NoError(t, err)
	assert.Equal(t, realPath(t, path), lib.Path())
}

func TestLoadMissing(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "libnccl.so.2")

	_, err := libnccl.Load(missing)
	require.ErrorIs(t, err, libnccl.ErrNoNCCL)
	assert.Contains(t, err.Error(), missing)
	assert.Contains(t, err.Error(), "GMP_LIBNCCL", "says how to point at the library")
	assert.Contains(t, err.Error(), `"path" option`)

	t.Setenv(libnccl.EnvLibrary, missing)
	_, err = libnccl.Load("")
	require.ErrorIs(t, err, libnccl.ErrNoNCCL, "a GMP_LIBNCCL that does not load is an error, not a fallback")
	assert.Contains(t, err.Error(), "GMP_LIBNCCL="+missing)
}

func TestLoadNotNCCL(t *testing.T) {
	_, err := libnccl.Load("libm.so.6")
	require.ErrorIs(t, err, libnccl.ErrNoNCCL)
	assert.Contains(t, err.Error(), "ncclGetVersion")
}

func TestLoadTooOld(t *testing.T) {
	for _, c := range []struct{ code, want string }{
		{"21805", "NCCL 2.18.5"},
		{"2804", "NCCL 2.8.4"}, // old encoding
	} {
		t.Run(c.code, func(t *testing.T) {
			path := copyLib(t, builtLibs(t).Fake)
			t.Setenv("FAKE_NCCL_VERSION", c.code)
			_, err := libnccl.Load(path)
			require.ErrorIs(t, err, libnccl.ErrTooOld)
			assert.Contains(t, err.Error(), c.want)
			assert.Contains(t, err.Error(), "ncclMemAlloc needs NCCL >= 2.19")

			// Failures are not cached: the same file, now new enough, loads.
			require.NoError(t, os.Unsetenv("FAKE_NCCL_VERSION"))
			lib, err := libnccl.Load(path)
			require.NoError(t, err)
			major, minor, _ := lib.Version()
			assert.Equal(t, [2]int{2, 23}, [2]int{major, minor})
		})
	}
}

func TestLoadMissingMemAlloc(t *testing.T) {
	_, err := libnccl.Load(builtLibs(t).Old)
	require.ErrorIs(t, err, libnccl.ErrTooOld)
	assert.Contains(t, err.Error(), "NCCL 2.23.4", "names the version found")
	assert.Contains(t, err.Error(), "does not export ncclMemAlloc")
	assert.Contains(t, err.Error(), "ncclMemAlloc needs NCCL >= 2.19")
}

// Finding a libnccl already in the process, or on the loader's path, makes a
// libnccl.so.2 visible to every later Load(""): those cases run in child
// processes (this test binary, running TestChildProcess).
const childEnv = "GMP_NCCL_TEST_CHILD"

func TestLoadSearchOrder(t *testing.T) {
	libs := builtLibs(t)
	for _, c := range []struct {
		mode string
		env  []string
	}{
		// torch loaded libnccl.so.2: Load("") shares it.
		{"preloaded", nil},
		// ... and GMP_LIBNCCL naming that very file (through a symlink) is fine.
		{"preloaded-env-same", nil},
		// GMP_LIBNCCL or a path naming another file: no second NCCL, an
		// error saying which was loaded first (it used to be ignored).
		{"preloaded-env-other", []string{libnccl.EnvLibrary + "=" + libs.Old}},
		{"preloaded-path-other", nil},
		// The loaded NCCL is too old: the advice is not "set GMP_LIBNCCL".
		{"preloaded-too-old", []string{"FAKE_NCCL_VERSION=21805"}},
		// Nothing loaded, no GMP_LIBNCCL: dlopen("libnccl.so.2").
		{"loaderpath", []string{"LD_LIBRARY_PATH=" + libs.SonameDir}},
		// Nothing anywhere.
		{"nothing", []string{"LD_LIBRARY_PATH=" + t.TempDir()}},
	} {
		t.Run(c.mode, func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run=^TestChildProcess$", "-test.v", "-test.count=1")
			for _, kv := range os.Environ() {
				if !strings.HasPrefix(kv, libnccl.EnvLibrary+"=") && !strings.HasPrefix(kv, "LD_LIBRARY_PATH=") {
					cmd.Env = append(cmd.Env, kv)
				}
			}
			cmd.Env = append(cmd.Env, childEnv+"="+c.mode, "GMP_NCCL_TEST_SONAME="+libs.Soname,
				"GMP_NCCL_TEST_OTHER="+libs.Fake)
			cmd.Env = append(cmd.Env, c.env...)
			out, err := cmd.CombinedOutput()
			require.NoError(t, err, "child output:\n%s", out)
			if strings.Contains(string(out), "--- SKIP: TestChildProcess") {
				t.Skipf("child skipped:\n%s", out)
			}
			require.Contains(t, string(out), "--- PASS: TestChildProcess", "child output:\n%s", out)
		})
	}
}

func TestChildProcess(t *testing.T) {
	mode := os.Getenv(childEnv)
	if mode == "" {
		t.Skip("runs only as TestLoadSearchOrder's child process")
	}
	soname := os.Getenv("GMP_NCCL_TEST_SONAME")
	switch mode {
	case "preloaded":
		_, err := fakenccl.Open(soname) // as torch would have
		require.NoError(t, err)
		lib, err := libnccl.Load("")
		require.NoError(t, err)
		assert.Equal(t, realPath(t, soname), lib.Path())
	case "preloaded-env-same":
		_, err := fakenccl.Open(soname)
		require.NoError(t, err)
		link := filepath.Join(t.TempDir(), "mynccl.so")
		require.NoError(t, os.Symlink(soname, link))
		t.Setenv(libnccl.EnvLibrary, link)
		lib, err := libnccl.Load("")
		require.NoError(t, err)
		assert.Equal(t, realPath(t, soname), lib.Path())
		again, err := libnccl.Load(soname) // the path option naming it
		require.NoError(t, err)
		assert.Same(t, lib, again)
	case "preloaded-env-other", "preloaded-path-other":
		_, err := fakenccl.Open(soname)
		require.NoError(t, err)
		var want, what, undo string
		if mode == "preloaded-env-other" {
			want, what, undo = os.Getenv(libnccl.EnvLibrary), libnccl.EnvLibrary+"=", "unset "+libnccl.EnvLibrary
			_, err = libnccl.Load("")
		} else {
			want, what, undo = os.Getenv("GMP_NCCL_TEST_OTHER"), "the path ", "leave the path (libnccl=) out"
			_, err = libnccl.Load(want)
		}
		require.ErrorIs(t, err, libnccl.ErrConflict)
		msg := err.Error()
		t.Log(msg)
		assert.Contains(t, msg, what+want)
		assert.Contains(t, msg, realPath(t, soname)+" (NCCL 2.23.4)", "names the loaded NCCL")
		assert.Contains(t, msg, "loaded first")
		assert.Contains(t, msg, undo+" to use the loaded one")
		// Nothing was loaded next to it.
		maps, err := os.ReadFile("/proc/self/maps")
		require.NoError(t, err)
		assert.NotContains(t, string(maps), want)
	case "preloaded-too-old":
		_, err := fakenccl.Open(soname)
		require.NoError(t, err)
		_, err = libnccl.Load("")
		require.ErrorIs(t, err, libnccl.ErrTooOld)
		msg := err.Error()
		t.Log(msg)
		assert.Contains(t, msg, "NCCL 2.18.5")
		assert.Contains(t, msg, "loaded before gpumempool")
		assert.Contains(t, msg, "cannot replace an NCCL already in the process")
		assert.NotContains(t, msg, "point "+libnccl.EnvLibrary, "setting GMP_LIBNCCL would not help")
	case "loaderpath":
		lib, err := libnccl.Load("")
		require.NoError(t, err)
		assert.Equal(t, realPath(t, soname), lib.Path())
	case "nothing":
		lib, err := libnccl.Load("")
		if err == nil || !errors.Is(err, libnccl.ErrNoNCCL) && errors.Is(err, libnccl.ErrTooOld) {
			t.Skipf("this machine has a libnccl on the loader path (%v, %v)", lib, err)
		}
		require.ErrorIs(t, err, libnccl.ErrNoNCCL)
		assert.Contains(t, err.Error(), "GMP_LIBNCCL is unset")
		assert.Contains(t, err.Error(), "libnccl.so.2")
	default:
		t.Fatalf("unknown child mode %q", mode)
	}
}
