package libnccl

import (
	"testing"

	"github.com/gpumempool/gpumempool/gocore/internal/nocgo"
)

// The stand-in built without cgo declares what lib.go does.
func TestNoCgoStub(t *testing.T) { nocgo.Check(t, ".") }
