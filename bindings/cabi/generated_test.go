package cabi

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The checked-in zz_slots.c is what gen_slots.go writes
// now (cgo needs them at build time, so they cannot be generated there).
func TestGeneratedFilesAreCurrent(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the generator with go run")
	}
	out := t.TempDir()
	cmd := exec.Command("go", "run", "gen_slots.go", "-out", out)
	msg, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", msg)
	for _, name := range []string{"zz_slots.c"} {
		want, err := os.ReadFile(filepath.Join(out, name))
		require.NoError(t, err)
		have, err := os.ReadFile(name)
		require.NoError(t, err)
		assert.True(t, string(want) == string(have), "%s is stale: run `go generate ./bindings/cabi`", name)
	}
}
