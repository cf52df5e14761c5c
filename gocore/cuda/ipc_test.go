//go:build cgo

package cuda

import (
	"math"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/cuda/driver"
	"github.com/gpumempool/gpumempool/gocore/cuda/internal/fakecuda"
)

func closeChunks(t *testing.T, chunks []Chunk) {
	t.Helper()
	for _, c := range chunks {
		require.NoError(t, syscall.Close(c.FD), "the caller owns the descriptors")
	}
}

func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(ents)
}

// A grown (two-chunk) segment exported through its file descriptors and
// imported in the same process, for another device: both mappings see the
// same memory, across the chunk boundary too.
func TestVMMExportImportSegment(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{Expandable: true, IPC: true})
	p := newPool(t, be)
	a, err := p.Alloc(0, 30*mib, 0) // two 20 MiB pages
	require.NoError(t, err)
	b, err := p.Alloc(0, 30*mib, 0) // and one more
	require.NoError(t, err)
	require.Equal(t, a+30*mib, b, "one grown segment")
	_, _, handles := f.LastMemCreate()
	assert.Equal(t, driver.MemHandleTypePosixFD, handles, "exportable memory was asked for")
	fakecuda.Write(a, []byte("written by the exporter"))
	fakecuda.Write(a+40*mib-6, []byte("across chunks"))

	chunks, err := be.ExportSegment(0, b+mib) // any address inside the segment
	require.NoError(t, err)
	require.Len(t, chunks, 2, "one per physical chunk")
	assert.Equal(t, Chunk{FD: chunks[0].FD, Size: 40 * mib, Offset: 0}, chunks[0])
	assert.Equal(t, Chunk{FD: chunks[1].FD, Size: 20 * mib, Offset: 40 * mib}, chunks[1])
	for _, c := range chunks {
		requireFD(t, c.FD)
	}
	base, err := be.SegmentBase(0, b+mib)
	require.NoError(t, err)
	assert.Equal(t, a, base)
	exporterObjects := f.VMMObjects()

	// The order of the chunks does not matter; their offsets do.
	r, err := ImportVMM(drv, 1, []Chunk{chunks[1], chunks[0]}, []int{0})
	require.NoError(t, err)
	closeChunks(t, chunks)
	assert.EqualValues(t, 60*mib, r.Size())
	assert.NotEqual(t, a, r.Addr(), "a mapping of its own")
	assert.Equal(t, exporterObjects+5, f.VMMObjects(), "two imported handles, a reservation, two mappings")
	assert.Equal(t, driver.MemAccessProtReadWrite, f.Access(r.Addr(), 1))
	assert.Equal(t, driver.MemAccessProtReadWrite, f.Access(r.Addr()+40*mib, 0), "peers on every chunk")

	assert.Equal(t, []byte("written by the exporter"), fakecuda.Read(r.Addr()+(a-base), 23))
	assert.Equal(t, []byte("across chunks"), fakecuda.Read(r.Addr()+40*mib-6, 13))
	fakecuda.Write(r.Addr()+(b-base)+mib, []byte("written by the importer"))
	assert.Equal(t, []byte("written by the importer"), fakecuda.Read(b+mib, 23))

	require.NoError(t, r.Close())
	assert.Equal(t, exporterObjects, f.VMMObjects())
	require.ErrorIs(t, r.Close(), gocore.ErrInvalidArgument, "closed twice")
	assert.Equal(t, []byte("written by the exporter"), fakecuda.Read(a, 23), "the exporter's memory is untouched")

	require.NoError(t, p.Free(a))
	require.NoError(t, p.Free(b))
	closePool(t, p)
	require.NoError(t, be.Close())
	assert.Zero(t, f.VMMObjects())
	assert.Zero(t, f.LiveBytes(0))
}

func TestVMMExportSegmentErrors(t *testing.T) {
	f, drv := setup(t)
	plain := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{})
	a, err := plain.Alloc(0, 2*mib, 0)
	require.NoError(t, err)
	_, err = plain.ExportSegment(0, a)
	require.ErrorIs(t, err, gocore.ErrUnsupported, "created without IPC")
	require.NoError(t, plain.Free(0, a, 2*mib, 0))

	be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{Expandable: true, IPC: true})
	a, err = be.Alloc(0, 2*mib, 0)
	require.NoError(t, err)
	require.NoError(t, be.Expand(0, a, 2*mib, 2*mib, 0))
	_, err = be.ExportSegment(0, a+4*mib)
	require.ErrorIs(t, err, gocore.ErrInvalidArgument, "past the segment's end")
	_, err = be.ExportSegment(1, a)
	require.ErrorIs(t, err, gocore.ErrInvalidArgument, "another device's")
	_, err = be.SegmentBase(0, a+4*mib)
	require.ErrorIs(t, err, gocore.ErrInvalidArgument)

	// A failure on the second chunk closes the descriptor of the first.
	before := openFDs(t)
	f.Fail("cuMemExportToShareableHandle", driver.CodeUnknown, 1)
	_, err = be.ExportSegment(0, a)
	require.Error(t, err)
	f.Fail("cuMemExportToShareableHandle", 0, 0)
	assert.Equal(t, before, openFDs(t), "no descriptor leaked")

	require.NoError(t, be.Free(0, a, 4*mib, 0))
	require.NoError(t, be.Close())
	require.NoError(t, plain.Close())
	assert.Zero(t, f.VMMObjects())
}

func TestImportVMMValidation(t *testing.T) {
	f, drv := setup(t)
	_, err := ImportVMM(nil, 0, []Chunk{{FD: 0, Size: 2 * mib}}, nil)
	require.ErrorIs(t, err, gocore.ErrInvalidArgument)
	_, err = ImportVMM(drv, 0, nil, nil)
	require.ErrorIs(t, err, gocore.ErrInvalidArgument)

	be := newGPUBackend(t, NewVMMBackend, drv, VMMOptions{Expandable: true, IPC: true})
	a, err := be.Alloc(0, 2*mib, 0)
	require.NoError(t, err)
	require.NoError(t, be.Expand(0, a, 2*mib, 2*mib, 0))
	chunks, err := be.ExportSegment(0, a)
	require.NoError(t, err)
	defer closeChunks(t, chunks)
	objects := f.VMMObjects()

	for name, bad := range map[string][]Chunk{
		"a gap":              {chunks[0], {FD: chunks[1].FD, Size: 2 * mib, Offset: 4 * mib}},
		"not from offset 0":  {{FD: chunks[1].FD, Size: 2 * mib, Offset: 2 * mib}},
		"a partial granule":  {{FD: chunks[0].FD, Size: mib, Offset: 0}},
		"no descriptor":      {{FD: -1, Size: 2 * mib}},
		"overlapping chunks": {chunks[0], {FD: chunks[1].FD, Size: 2 * mib, Offset: mib}},
		// Sizes whose sum wraps around to a small total (found by review).
		"a wrapping total": {{FD: chunks[0].FD, Size: math.MaxUint64 - 2*mib + 1, Offset: 0},
			{FD: chunks[1].FD, Size: 4 * mib, Offset: math.MaxUint64 - 2*mib + 1}},
	} {
		_, err := ImportVMM(drv, 0, bad, nil)
		require.ErrorIs(t, err, gocore.ErrInvalidArgument, name)
	}
	assert.Equal(t, objects, f.VMMObjects())

	// Failures in the driver leave nothing mapped.
	null, err := os.Open(os.DevNull)
	require.NoError(t, err)
	defer null.Close()
	_, err = ImportVMM(drv, 0, []Chunk{chunks[0], {FD: int(null.Fd()), Size: 2 * mib, Offset: 2 * mib}}, nil)
	require.Error(t, err, "not a shareable handle")
	assert.Contains(t, err.Error(), "cuMemImportFromShareableHandle")
	assert.Equal(t, objects, f.VMMObjects())
	_, err = ImportVMM(drv, 0, chunks, []int{7})
	require.ErrorIs(t, err, gocore.ErrInvalidDevice, "access for a device that does not exist")
	assert.Equal(t, objects, f.VMMObjects())
	f.Fail("cuMemMap", driver.CodeInvalidValue, 1)
	_, err = ImportVMM(drv, 0, chunks, nil)
	require.Error(t, err)
	f.Fail("cuMemMap", 0, 0)
	assert.Equal(t, objects, f.VMMObjects())

	require.NoError(t, be.Free(0, a, 4*mib, 0))
	require.NoError(t, be.Close())
	assert.Zero(t, f.VMMObjects())
}

func TestAsyncPoolExportImport(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewAsyncBackend, drv, AsyncOptions{IPC: true})
	a, err := be.Alloc(0, 4*mib, 0x7)
	require.NoError(t, err)
	fakecuda.Write(a, []byte("from the exporter"))

	fd, err := be.ExportPool(0)
	require.NoError(t, err)
	requireFD(t, fd)
	ip, err := ImportAsyncPool(drv, 0, fd)
	require.NoError(t, err)
	require.NoError(t, syscall.Close(fd), "the caller owns the descriptor")
	assert.Equal(t, 2, f.LivePools(), "the exporter's and the imported one")

	data, err := be.ExportPointer(0, a)
	require.NoError(t, err)
	ptr, err := ip.ImportPointer(data)
	require.NoError(t, err)
	assert.Equal(t, 1, f.ImportedPointers())
	// In one process the fake maps the import at the exporter's address; in
	// another process it would be that process's own mapping of the memory.
	assert.Equal(t, []byte("from the exporter"), fakecuda.Read(ptr, 17))
	fakecuda.Write(ptr+mib, []byte("from the importer"))
	assert.Equal(t, []byte("from the importer"), fakecuda.Read(a+mib, 17))

	frees := f.Calls("cuMemFree_v2")
	require.NoError(t, ip.FreePointer(ptr))
	assert.Equal(t, frees+1, f.Calls("cuMemFree_v2"), "the importer frees with cuMemFree")
	assert.Zero(t, f.ImportedPointers())
	require.ErrorIs(t, ip.FreePointer(ptr), gocore.ErrInvalidArgument, "freed already")
	assert.EqualValues(t, 4*mib, f.LiveBytes(0), "the exporter's allocation stays")

	// The same data again is the same import, counted: the driver imports
	// it once, and the last FreePointer frees it. Close frees what is still
	// imported before destroying the pool.
	imports := f.Calls("cuMemPoolImportPointer")
	p1, err := ip.ImportPointer(data)
	require.NoError(t, err)
	p2, err := ip.ImportPointer(data)
	require.NoError(t, err)
	assert.Equal(t, p1, p2)
	assert.Equal(t, imports+1, f.Calls("cuMemPoolImportPointer"), "imported once")
	assert.Equal(t, 1, f.ImportedPointers())
	frees = f.Calls("cuMemFree_v2")
	require.NoError(t, ip.FreePointer(p1))
	assert.Equal(t, frees, f.Calls("cuMemFree_v2"), "one reference is left")
	assert.Equal(t, 1, f.ImportedPointers())
	_, err = ip.ImportPointer(data)
	require.NoError(t, err)
	require.NoError(t, ip.Close())
	assert.Equal(t, frees+1, f.Calls("cuMemFree_v2"), "freed once for its two references")
	assert.Zero(t, f.ImportedPointers())
	assert.Equal(t, 1, f.LivePools())
	require.ErrorIs(t, ip.Close(), gocore.ErrInvalidArgument, "closed twice")
	_, err = ip.ImportPointer(data)
	require.ErrorIs(t, err, gocore.ErrInvalidArgument)

	_, err = be.ExportPointer(0, a+512)
	require.ErrorIs(t, err, gocore.ErrInvalidArgument, "not the start of a segment")
	_, err = be.ExportPointer(1, a)
	require.ErrorIs(t, err, gocore.ErrInvalidArgument, "another device's")
	_, err = ImportAsyncPool(drv, 0, -1)
	require.Error(t, err)
	_, err = ImportAsyncPool(nil, 0, 3)
	require.ErrorIs(t, err, gocore.ErrInvalidArgument)

	require.NoError(t, be.Free(0, a, 4*mib, 0x7))
	require.NoError(t, be.Close())
	assert.Zero(t, f.LivePools())
	assert.Zero(t, f.LiveBytes(0))
}

// An imported pool is accessible from its resident device only: importing
// it for another device grants that device access (cuMemPoolSetAccess);
// for the resident device nothing is changed. The fake refuses to import a
// pointer for a device without access.
func TestAsyncPoolImportOnAnotherDevice(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewAsyncBackend, drv, AsyncOptions{IPC: true})
	a, err := be.Alloc(0, 4*mib, 0x7)
	require.NoError(t, err)
	data, err := be.ExportPointer(0, a)
	require.NoError(t, err)
	fd, err := be.ExportPool(0)
	require.NoError(t, err)
	defer func() { require.NoError(t, syscall.Close(fd)) }()

	same, err := ImportAsyncPool(drv, 0, fd)
	require.NoError(t, err)
	assert.Zero(t, f.Calls("cuMemPoolSetAccess"), "the resident device has access")
	assert.Equal(t, driver.MemAccessProtNone, f.PoolAccess(same.pool, 1))

	other, err := ImportAsyncPool(drv, 1, fd)
	require.NoError(t, err)
	assert.Equal(t, 1, f.Calls("cuMemPoolSetAccess"))
	assert.Equal(t, driver.MemAccessProtReadWrite, f.PoolAccess(other.pool, 1), "device 1 was given access")
	assert.Equal(t, driver.MemAccessProtNone, f.PoolAccess(same.pool, 1), "per imported pool")
	ptr, err := other.ImportPointer(data)
	require.NoError(t, err)
	_, err = drv.MemPoolImportPointer(1, same.pool, data)
	require.ErrorContains(t, err, "CUDA_ERROR_INVALID_DEVICE", "the fake checks the access")
	require.NoError(t, other.FreePointer(ptr))
	require.NoError(t, other.Close())
	require.NoError(t, same.Close())

	// Failing to grant access (no peer access) fails the import and
	// destroys the imported pool.
	pools := f.LivePools()
	f.Fail("cuMemPoolSetAccess", driver.CodeNotSupported, 0)
	_, err = ImportAsyncPool(drv, 1, fd)
	require.ErrorIs(t, err, gocore.ErrUnsupported)
	assert.Contains(t, err.Error(), "import memory pool for device 1")
	assert.Equal(t, pools, f.LivePools(), "nothing left imported")
	f.Fail("cuMemPoolSetAccess", 0, 0)

	require.NoError(t, be.Free(0, a, 4*mib, 0x7))
	require.NoError(t, be.Close())
}

// "The imported memory must not be accessed before the allocation
// operation completes in the exporting process" (cuMemPoolImportPointer):
// ExportPointer returns only once the allocating stream has reached the
// allocation, and the allocation events of IPC pools are all destroyed, by
// the export, the free or Close.
func TestAsyncExportWaitsForTheAllocation(t *testing.T) {
	f, drv := setup(t)
	f.SetManualEvents(true)
	t.Cleanup(func() { f.SetManualEvents(false) })
	be := newGPUBackend(t, NewAsyncBackend, drv, AsyncOptions{IPC: true})
	a, err := be.Alloc(0, 4*mib, 0x7)
	require.NoError(t, err)
	assert.Equal(t, 1, f.LiveEvents(0), "an allocation event")

	exported := make(chan error, 1)
	go func() {
		_, err := be.ExportPointer(0, a)
		exported <- err
	}()
	select {
	case err := <-exported:
		t.Fatalf("exported before the allocation completed (err %v)", err)
	case <-time.After(50 * time.Millisecond):
	}
	f.CompleteStream(0x7)
	select {
	case err := <-exported:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("the export did not return once the stream completed")
	}
	assert.Zero(t, f.LiveEvents(0), "destroyed by the export")
	_, err = be.ExportPointer(0, a) // exported again: nothing to wait for
	require.NoError(t, err)

	b, err := be.Alloc(0, 2*mib, 0x8) // freed without an export
	require.NoError(t, err)
	c, err := be.Alloc(0, 2*mib, 0x8) // left for Close
	require.NoError(t, err)
	assert.Equal(t, 2, f.LiveEvents(0))
	require.NoError(t, be.Free(0, b, 2*mib, 0x8))
	assert.Equal(t, 1, f.LiveEvents(0))
	require.NoError(t, be.Free(0, a, 4*mib, 0x7))
	require.NoError(t, be.Free(0, c, 2*mib, 0x8))
	assert.Zero(t, f.LiveEvents(0))

	// Pools without IPC record nothing.
	plain := newGPUBackend(t, NewAsyncBackend, drv, AsyncOptions{})
	d, err := plain.Alloc(0, 2*mib, 0x7)
	require.NoError(t, err)
	assert.Zero(t, f.LiveEvents(0))
	require.NoError(t, plain.Free(0, d, 2*mib, 0x7))
	require.NoError(t, be.Close())
	require.NoError(t, plain.Close())
}

func TestAsyncCloseDestroysAllocationEvents(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewAsyncBackend, drv, AsyncOptions{IPC: true})
	a, err := be.Alloc(0, 2*mib, 0x7)
	require.NoError(t, err)
	assert.Equal(t, 1, f.LiveEvents(0))
	require.Error(t, be.Close(), "a segment was never freed")
	assert.Zero(t, f.LiveEvents(0))
	require.NoError(t, be.Free(0, a, 2*mib, 0x7), "frees still work after Close")
}

// Alloc and Free of IPC segments from many goroutines: the driver hands a
// freed address out again at once, and each live segment must keep its own
// allocation event (an export would otherwise not wait), and no event may
// leak (run with -race).
func TestAsyncAllocationEventsUnderConcurrency(t *testing.T) {
	f, drv := setup(t)
	be := newGPUBackend(t, NewAsyncBackend, drv, AsyncOptions{IPC: true})
	var wg sync.WaitGroup
	var missing atomic.Int64
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 1500 {
				a, err := be.Alloc(0, 4*mib, 0x7)
				if !assert.NoError(t, err) {
					return
				}
				be.mu.Lock()
				_, ok := be.allocated[segKey{0, a}]
				be.mu.Unlock()
				if !ok {
					missing.Add(1)
				}
				if !assert.NoError(t, be.Free(0, a, 4*mib, 0x7)) {
					return
				}
			}
		}()
	}
	wg.Wait()
	assert.Zero(t, missing.Load(), "live IPC segments without their allocation event")
	assert.Zero(t, f.LiveEvents(0), "allocation events leaked")
	require.NoError(t, be.Close())
}
