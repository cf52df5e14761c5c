package driver

import (
	"testing"

	"github.com/gpumempool/gpumempool/gocore/internal/nocgo"
)

// The stand-in built without cgo declares what the cgo files do.
func TestNoCgoStub(t *testing.T) { nocgo.Check(t, ".") }
