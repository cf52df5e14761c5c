package nocgo

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func writeFiles(t *testing.T, files map[string]string) string {
	t.Helper()
	dir := t.TempDir()
	for name, src := range files {
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), []byte(src), 0o644))
	}
	return dir
}

const cgoFile = `package lib

/*
#include <stdint.h>
*/
import "C"

import "time"

// Handle is opaque.
type Handle struct{ h C.uintptr_t }

func Open(path string) (*Handle, error) { return nil, nil }

func (h *Handle) Wait(d time.Duration) (done bool, err error) { return false, nil }

func (h *Handle) Name() string { return "" }

func (h *Handle) private() {}

func helper() int { return 0 }
`

// The stand-in declares the exported API of the cgo files only, failing
// with errNoCgo wherever an error is returned.
func TestGenerate(t *testing.T) {
	dir := writeFiles(t, map[string]string{
		"lib.go":      cgoFile,
		"pure.go":     "package lib\n\nfunc Pure() {}\n",
		"lib_test.go": "package lib\n\nimport \"C\"\n\nfunc TestX() {}\n",
	})
	got, err := Generate(dir)
	require.NoError(t, err)
	src := string(got)
	assert.Contains(t, src, "//go:build !cgo\n\npackage lib\n")
	assert.Contains(t, src, "import (\n\t\"time\"\n)")
	assert.Contains(t, src, "type Handle struct{}")
	assert.Contains(t, src, "func Open(path string) (r0 *Handle, r1 error) {\n\tr1 = errNoCgo\n\treturn\n}")
	assert.Contains(t, src, "func (h *Handle) Wait(d time.Duration) (r0 bool, r1 error) {")
	assert.Contains(t, src, "func (h *Handle) Name() (r0 string) {\n\treturn\n}")
	for _, absent := range []string{"private", "helper", "Pure", "TestX"} {
		assert.NotContains(t, src, absent)
	}
}

// Exported constants, variables and non-struct types of cgo files are
// refused: both builds need them, so they belong in a file without cgo.
func TestGenerateRefusesSharedDeclarations(t *testing.T) {
	for name, decl := range map[string]string{
		"const": "const Max = 1\n",
		"var":   "var Default = 1\n",
		"type":  "type Code int\n",
	} {
		dir := writeFiles(t, map[string]string{"lib.go": "package lib\n\nimport \"C\"\n\n" + decl})
		_, err := Generate(dir)
		assert.ErrorContains(t, err, "declare it in a file without cgo", name)
	}
	_, err := Generate(writeFiles(t, map[string]string{"pure.go": "package lib\n"}))
	assert.ErrorContains(t, err, "no cgo files")
}
