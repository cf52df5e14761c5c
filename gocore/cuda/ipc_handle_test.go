package cuda

import (
	"errors"
	"math"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

type failingBase struct{ chunks []Chunk }

func (f failingBase) ExportSegment(int, uint64) ([]Chunk, error) { return f.chunks, nil }
func (f failingBase) SegmentBase(int, uint64) (uint64, error) {
	return 0, errors.New("segment gone")
}

// The descriptors ExportSegment made are closed when SegmentBase fails.
func TestExportVMMClosesDescriptorsOnError(t *testing.T) {
	var p [2]int
	require.NoError(t, syscall.Pipe(p[:]))
	be := failingBase{chunks: []Chunk{{FD: p[0], Size: 2 << 20}, {FD: p[1], Size: 2 << 20, Offset: 2 << 20}}}
	var h IPCHandle
	err := exportVMM(be, 0, 0x1000, &h)
	require.ErrorContains(t, err, "segment gone")
	assert.Empty(t, h.FDs)
	for _, fd := range p {
		_, err := fcntl(fd, syscall.F_GETFD)
		assert.ErrorIs(t, err, syscall.EBADF, "fd %d was closed", fd)
	}
}

func fcntl(fd, cmd int) (int, error) {
	r, _, e := syscall.Syscall(syscall.SYS_FCNTL, uintptr(fd), uintptr(cmd), 0)
	if e != 0 {
		return -1, e
	}
	return int(r), nil
}

func TestWithin(t *testing.T) {
	assert.True(t, within(0, 10, 10))
	assert.True(t, within(10, 0, 10))
	assert.False(t, within(1, 10, 10))
	assert.False(t, within(math.MaxUint64, 2, 10))
	assert.False(t, within(2, math.MaxUint64, 10))
	assert.True(t, within(math.MaxUint64-1, 1, math.MaxUint64))
}
