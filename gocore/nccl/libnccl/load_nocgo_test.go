//go:build !cgo

package libnccl

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/gocore"
)

// Without cgo, Load fails with an error a caller can fall back from.
func TestLoadWithoutCgo(t *testing.T) {
	lib, err := Load("")
	require.ErrorIs(t, err, gocore.ErrUnsupported)
	assert.Nil(t, lib)
	assert.Contains(t, err.Error(), "built without cgo (CGO_ENABLED=0)")
}
