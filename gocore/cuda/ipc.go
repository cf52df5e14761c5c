package cuda

import (
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"

	"github.com/gpumempool/gpumempool/gocore"
)

// Chunk is one physical allocation of an exported VMM segment
// (VMMBackend.ExportSegment): a POSIX file descriptor for it, its size, and
// where it is mapped, as an offset from the segment's base.
type Chunk struct {
	FD     int    `json:"fd"`
	Size   uint64 `json:"size"`
	Offset uint64 `json:"offset"`
}

// ImportedRange is another process's VMM segment mapped into this one
// (ImportVMM). It is safe for concurrent use.
type ImportedRange struct {
	drv    *Driver
	dev    int
	addr   uint64
	size   uint64
	chunks []importedChunk

	mu     sync.Mutex
	closed bool
}

type importedChunk struct {
	handle, offset, size uint64
}

// ImportVMM maps the chunks of a segment exported by
// VMMBackend.ExportSegment into this process for device dev: it reserves
// an address range for all of them, imports each file descriptor
// (cuMemImportFromShareableHandle), maps the chunks back to back at their
// offsets and grants read/write access to dev and accessDevices. The
// descriptors stay the caller's to close (the driver holds its own
// reference once imported). The chunks must tile [0, total) in order of
// offset, each a multiple of dev's minimum granularity, which cuMemMap
// requires of sizes and addresses. On failure nothing stays mapped.
func ImportVMM(drv *Driver, dev int, chunks []Chunk, accessDevices []int) (*ImportedRange, error) {
	if drv == nil {
		return nil, fmt.Errorf("cuda: import VMM segment: nil driver: %w", gocore.ErrInvalidArgument)
	}
	if len(chunks) == 0 {
		return nil, fmt.Errorf("cuda: import VMM segment: no chunks: %w", gocore.ErrInvalidArgument)
	}
	if err := requireSymbols(drv, "cuda: import VMM segment", append(slices.Clip(vmmSymbols), "cuMemImportFromShareableHandle")); err != nil {
		return nil, err
	}
	chunks = slices.Clone(chunks)
	sort.Slice(chunks, func(i, j int) bool { return chunks[i].Offset < chunks[j].Offset })
	gran, err := drv.MemGetAllocationGranularity(dev,
		AllocProp{LocationType: MemLocationTypeDevice, LocationID: dev, HandleType: MemHandleTypePosixFD},
		MemAllocGranularityMinimum)
	if err != nil {
		return nil, fmt.Errorf("cuda: import VMM segment: %w", err)
	}
	var total uint64
	for _, c := range chunks {
		if c.FD < 0 || c.Size == 0 || c.Size%gran != 0 || c.Offset != total {
			return nil, fmt.Errorf("cuda: import VMM segment: chunk %+v: want a descriptor and a positive multiple of %d bytes at offset %d: %w",
				c, gran, total, gocore.ErrInvalidArgument)
		}
		total += c.Size
	}
	access := []int{dev}
	for _, d := range accessDevices {
		if !slices.Contains(access, d) {
			access = append(access, d)
		}
	}

	addr, err := drv.MemAddressReserve(dev, total, gran, 0)
	if err != nil {
		return nil, fmt.Errorf("cuda: import VMM segment: %w", err)
	}
	r := &ImportedRange{drv: drv, dev: dev, addr: addr, size: total}
	fail := func(err error) (*ImportedRange, error) {
		return nil, errors.Join(fmt.Errorf("cuda: import VMM segment: %w", err), r.teardown())
	}
	for _, c := range chunks {
		h, err := drv.MemImportFromShareableHandle(dev, c.FD, MemHandleTypePosixFD)
		if err != nil {
			return fail(err)
		}
		if err := drv.MemMap(dev, addr+c.Offset, c.Size, 0, h); err != nil {
			return fail(errors.Join(err, drv.MemRelease(dev, h)))
		}
		r.chunks = append(r.chunks, importedChunk{handle: h, offset: c.Offset, size: c.Size})
		// Per chunk, like the exporter: each is one mapping.
		if err := drv.MemSetAccess(dev, addr+c.Offset, c.Size, access); err != nil {
			return fail(err)
		}
	}
	return r, nil
}

// Addr is where the segment is mapped in this process.
func (r *ImportedRange) Addr() uint64 { return r.addr }

// Size is the bytes mapped: the chunks' sizes summed.
func (r *ImportedRange) Size() uint64 { return r.size }

// Close unmaps the range, releases the imported handles and frees the
// address range; the exporter's memory goes once it, too, let go of it.
// Like cuMemUnmap it does not wait for work still using the range: the
// caller makes sure none is left. Closing twice is an error.
func (r *ImportedRange) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return fmt.Errorf("cuda: close imported VMM range %#x: already closed: %w", r.addr, gocore.ErrInvalidArgument)
	}
	r.closed = true
	if err := r.teardown(); err != nil {
		return fmt.Errorf("cuda: close imported VMM range %#x: %w", r.addr, err)
	}
	return nil
}

// teardown unmaps and releases every chunk mapped so far and frees the
// reservation.
func (r *ImportedRange) teardown() error {
	var errs []error
	for _, c := range r.chunks {
		errs = append(errs, r.drv.MemUnmap(r.dev, r.addr+c.offset, c.size))
	}
	for _, c := range r.chunks {
		errs = append(errs, r.drv.MemRelease(r.dev, c.handle))
	}
	r.chunks = nil
	errs = append(errs, r.drv.MemAddressFree(r.dev, r.addr, r.size))
	return errors.Join(errs...)
}

// ImportedPool is another process's CUDA memory pool (exported by
// AsyncBackend.ExportPool), from which that process's allocations are
// imported. It is safe for concurrent use.
type ImportedPool struct {
	drv  *Driver
	dev  int
	pool uint64

	mu     sync.Mutex
	ptrs   map[uint64]int // imported pointer -> imports not yet freed
	closed bool
}

// ImportAsyncPool imports the pool exported as file descriptor fd, for use
// on device dev (cuMemPoolImportFromShareableHandle). fd stays the caller's
// to close. An imported pool cannot allocate; it maps what the exporter
// exports (ImportPointer).
//
// An imported pool's memory is accessible from its resident device (the
// exporter's pool's device) only, whatever the exporter granted. When dev
// is another device, ImportAsyncPool gives dev read/write access
// (cuMemPoolSetAccess), which needs peer access between the two devices;
// failing that, the import fails.
func ImportAsyncPool(drv *Driver, dev int, fd int) (*ImportedPool, error) {
	if drv == nil {
		return nil, fmt.Errorf("cuda: import memory pool: nil driver: %w", gocore.ErrInvalidArgument)
	}
	if err := requireSymbols(drv, "cuda: import memory pool", []string{
		"cuMemPoolImportFromShareableHandle", "cuMemPoolImportPointer", "cuMemPoolDestroy",
		"cuMemPoolGetAccess", "cuMemPoolSetAccess",
	}); err != nil {
		return nil, err
	}
	p, err := drv.MemPoolImportFromShareableHandle(dev, fd, MemHandleTypePosixFD)
	if err != nil {
		return nil, err
	}
	access, err := drv.MemPoolGetAccess(dev, p, dev)
	if err == nil && access != MemAccessProtReadWrite {
		err = drv.MemPoolSetAccess(dev, p, []int{dev}) // dev is not the pool's resident device
	}
	if err != nil {
		return nil, errors.Join(fmt.Errorf("cuda: import memory pool for device %d: %w", dev, err), drv.MemPoolDestroy(dev, p))
	}
	return &ImportedPool{drv: drv, dev: dev, pool: p, ptrs: make(map[uint64]int)}, nil
}

// ImportPointer maps the allocation described by data (from
// AsyncBackend.ExportPointer) and returns its address in this process
// (cuMemPoolImportPointer). The driver's rules: the memory must not be
// accessed before the exporter's allocation completed on its stream, and
// it must be freed here (FreePointer) before the exporter frees it.
func (p *ImportedPool) ImportPointer(data [64]byte) (uint64, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return 0, fmt.Errorf("cuda: import pointer: imported pool %#x is closed: %w", p.pool, gocore.ErrInvalidArgument)
	}
	ptr, err := p.drv.MemPoolImportPointer(p.dev, p.pool, data)
	if err != nil {
		return 0, err
	}
	p.ptrs[ptr]++
	return ptr, nil
}

// FreePointer frees an imported pointer with cuMemFree (cuMemFree_v2).
// CUDA's cuMemPoolImportPointer documentation allows cuMemFree or
// cuMemFreeAsync and requires the importer's free to have completed before
// the exporter frees; cuMemFree is complete when it returns, so the
// exporter may free as soon as it is told, with no stream or event shared
// between the processes. It does not wait for this process's work on the
// memory (cuMemFree synchronizes nothing for stream-ordered allocations):
// the caller makes sure that is done.
func (p *ImportedPool) FreePointer(ptr uint64) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.freeLocked(ptr)
}

func (p *ImportedPool) freeLocked(ptr uint64) error {
	if p.ptrs[ptr] == 0 {
		return fmt.Errorf("cuda: free imported pointer %#x: not imported from pool %#x: %w", ptr, p.pool, gocore.ErrInvalidArgument)
	}
	if err := p.drv.MemFree(p.dev, ptr); err != nil {
		return fmt.Errorf("cuda: free imported pointer: %w", err)
	}
	if p.ptrs[ptr]--; p.ptrs[ptr] == 0 {
		delete(p.ptrs, ptr)
	}
	return nil
}

// Close frees the pointers still imported, then destroys the imported pool
// (cuMemPoolDestroy). Closing twice is an error.
func (p *ImportedPool) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return fmt.Errorf("cuda: close imported pool %#x: already closed: %w", p.pool, gocore.ErrInvalidArgument)
	}
	p.closed = true
	ptrs := make([]uint64, 0, len(p.ptrs))
	for ptr := range p.ptrs {
		ptrs = append(ptrs, ptr)
	}
	slices.Sort(ptrs)
	var errs []error
	for _, ptr := range ptrs {
		for p.ptrs[ptr] > 0 {
			if err := p.freeLocked(ptr); err != nil {
				errs = append(errs, err)
				break
			}
		}
	}
	if err := p.drv.MemPoolDestroy(p.dev, p.pool); err != nil {
		errs = append(errs, fmt.Errorf("cuda: close imported pool: %w", err))
	}
	return errors.Join(errs...)
}
