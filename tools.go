//go:build tools

// Package tools pins the build-time commands (gopy, goimports) in go.mod, so
// that setup.py builds them from this module at these versions. The build
// tag keeps the file out of every real build.
package tools

import (
	_ "github.com/go-python/gopy"
	_ "golang.org/x/tools/cmd/goimports"
)
