package cuda

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"sort"
	"sync"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/cuda/driver"
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
	drv    *driver.Driver
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
func ImportVMM(drv *driver.Driver, dev int, chunks []Chunk, accessDevices []int) (*ImportedRange, error) {
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
		driver.AllocProp{LocationType: driver.MemLocationTypeDevice, LocationID: dev, HandleType: driver.MemHandleTypePosixFD},
		driver.MemAllocGranularityMinimum)
	if err != nil {
		return nil, fmt.Errorf("cuda: import VMM segment: %w", err)
	}
	var total uint64
	for _, c := range chunks {
		if c.FD < 0 || c.Size == 0 || c.Size%gran != 0 || c.Offset != total || c.Size > math.MaxUint64-total {
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
		h, err := drv.MemImportFromShareableHandle(dev, c.FD, driver.MemHandleTypePosixFD)
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
//
// Several blocks of one exported segment, or one block exported twice,
// import the same allocation: ImportPointer imports each allocation once
// and counts references, since the driver must not import it twice (see
// ImportPointer). Across ImportedPools, ImportAsyncSegment shares them.
type ImportedPool struct {
	drv  *driver.Driver
	dev  int
	pool uint64

	mu     sync.Mutex
	byData map[[64]byte]uint64 // export data -> pointer imported with it
	refs   map[uint64]int      // imported pointer -> ImportPointer calls not yet freed
	data   map[uint64][64]byte // imported pointer -> its export data
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
func ImportAsyncPool(drv *driver.Driver, dev int, fd int) (*ImportedPool, error) {
	if drv == nil {
		return nil, fmt.Errorf("cuda: import memory pool: nil driver: %w", gocore.ErrInvalidArgument)
	}
	if err := requireSymbols(drv, "cuda: import memory pool", []string{
		"cuMemPoolImportFromShareableHandle", "cuMemPoolImportPointer", "cuMemPoolDestroy",
		"cuMemPoolGetAccess", "cuMemPoolSetAccess", "cuMemGetAddressRange_v2",
	}); err != nil {
		return nil, err
	}
	p, err := drv.MemPoolImportFromShareableHandle(dev, fd, driver.MemHandleTypePosixFD)
	if err != nil {
		return nil, err
	}
	access, err := drv.MemPoolGetAccess(dev, p, dev)
	if err == nil && access != driver.MemAccessProtReadWrite {
		err = drv.MemPoolSetAccess(dev, p, []int{dev}) // dev is not the pool's resident device
	}
	if err != nil {
		return nil, errors.Join(fmt.Errorf("cuda: import memory pool for device %d: %w", dev, err), drv.MemPoolDestroy(dev, p))
	}
	return &ImportedPool{drv: drv, dev: dev, pool: p,
		byData: make(map[[64]byte]uint64), refs: make(map[uint64]int), data: make(map[uint64][64]byte)}, nil
}

// grant gives dev read/write access to the imported pool, unless it has.
func (p *ImportedPool) grant(dev int) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return fmt.Errorf("cuda: imported pool %#x is closed: %w", p.pool, gocore.ErrInvalidArgument)
	}
	access, err := p.drv.MemPoolGetAccess(p.dev, p.pool, dev)
	if err == nil && access != driver.MemAccessProtReadWrite {
		err = p.drv.MemPoolSetAccess(p.dev, p.pool, []int{dev})
	}
	if err != nil {
		return fmt.Errorf("cuda: give device %d access to imported pool %#x: %w", dev, p.pool, err)
	}
	return nil
}

// ImportPointer maps the allocation described by data (from
// AsyncBackend.ExportPointer) and returns its address in this process
// (cuMemPoolImportPointer). The driver's rules: the memory must not be
// accessed before the exporter's allocation completed on its stream, and
// it must be freed here (FreePointer) before the exporter frees it.
//
// Data imported already (and not freed) is not imported again: its address
// is returned and one more reference counted, each to be dropped with
// FreePointer. A second cuMemPoolImportPointer of one allocation in a
// process fails with CUDA_ERROR_ALREADY_MAPPED for some memory, and for
// device pools returns the same address, which the first cuMemFree then
// unmaps for both (NVIDIA's cuda-python works around it the same way).
func (p *ImportedPool) ImportPointer(data [64]byte) (uint64, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return 0, fmt.Errorf("cuda: import pointer: imported pool %#x is closed: %w", p.pool, gocore.ErrInvalidArgument)
	}
	if ptr, ok := p.byData[data]; ok {
		p.refs[ptr]++
		return ptr, nil
	}
	ptr, err := p.drv.MemPoolImportPointer(p.dev, p.pool, data)
	if err != nil {
		return 0, err
	}
	p.byData[data] = ptr
	p.refs[ptr] = 1
	p.data[ptr] = data
	return ptr, nil
}

// FreePointer drops a reference to an imported pointer; the last one frees
// it with cuMemFree (cuMemFree_v2). CUDA's cuMemPoolImportPointer
// documentation allows cuMemFree or cuMemFreeAsync and requires the
// importer's free to have completed before the exporter frees; cuMemFree
// is complete when it returns, so the exporter may free as soon as it is
// told, with no stream or event shared between the processes. It does not
// wait for this process's work on the memory (cuMemFree synchronizes
// nothing for stream-ordered allocations): the caller makes sure that is
// done.
func (p *ImportedPool) FreePointer(ptr uint64) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.refs[ptr] == 0 {
		return fmt.Errorf("cuda: free imported pointer %#x: not imported from pool %#x: %w", ptr, p.pool, gocore.ErrInvalidArgument)
	}
	if p.refs[ptr] > 1 {
		p.refs[ptr]--
		return nil
	}
	return p.freeLocked(ptr)
}

// freeLocked frees ptr with the driver, whatever its references.
func (p *ImportedPool) freeLocked(ptr uint64) error {
	if err := p.drv.MemFree(p.dev, ptr); err != nil {
		return fmt.Errorf("cuda: free imported pointer: %w", err)
	}
	delete(p.byData, p.data[ptr])
	delete(p.data, ptr)
	delete(p.refs, ptr)
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
	ptrs := make([]uint64, 0, len(p.refs))
	for ptr := range p.refs {
		ptrs = append(ptrs, ptr)
	}
	slices.Sort(ptrs)
	var errs []error
	for _, ptr := range ptrs {
		if err := p.freeLocked(ptr); err != nil {
			errs = append(errs, err)
		}
	}
	if err := p.drv.MemPoolDestroy(p.dev, p.pool); err != nil {
		errs = append(errs, fmt.Errorf("cuda: close imported pool: %w", err))
	}
	return errors.Join(errs...)
}

// ImportedSegment is one reference to an allocation of another process's
// pool, imported by ImportAsyncSegment. It is safe for concurrent use.
type ImportedSegment struct {
	key    sharedKey
	shared *sharedPool
	addr   uint64
	size   uint64 // of the allocation, as the driver maps it here
	closed bool   // guarded by sharedMu
}

// sharedKey names an imported pool in this process: the driver it was
// imported with and the exporter's pool identity.
type sharedKey struct {
	drv  *driver.Driver
	pool string
}

// sharedPool is an imported pool, the ImportedSegments using it and the
// devices it was made accessible to.
type sharedPool struct {
	pool *ImportedPool
	refs int
	devs map[int]bool
}

var (
	// sharedMu guards sharedPools and is held across the driver calls that
	// import and free, so that no import races the last Close of its pool.
	sharedMu    sync.Mutex
	sharedPools = map[sharedKey]*sharedPool{}
)

// ImportAsyncSegment imports, for device dev, the allocation described by
// data (AsyncBackend.ExportPointer) of the exporter's pool named poolID,
// exported as file descriptor fd (AsyncBackend.ExportPool; fd stays the
// caller's to close). poolID must name that exporter pool uniquely among
// all processes (the exporter's choice; gpumempool's bindings use a random
// per-process prefix).
//
// Imports share: the pool is imported once per (driver, poolID) and each
// allocation once per pool (ImportedPool.ImportPointer), both counted, until
// the last ImportedSegment using them is closed. Importing one pool twice
// is allowed by the driver but costly, and one allocation must not be
// imported twice in a process (see ImportPointer), while each exported
// block of a segment imports the whole segment. An allocation has one
// address in a process, whatever the device: importing it for another
// device gives that device access to the imported pool
// (cuMemPoolSetAccess, which needs peer access), as ImportAsyncPool does.
func ImportAsyncSegment(drv *driver.Driver, dev int, poolID string, fd int, data [64]byte) (*ImportedSegment, error) {
	if poolID == "" {
		return nil, fmt.Errorf("cuda: import pool allocation: no pool identity: %w", gocore.ErrInvalidArgument)
	}
	sharedMu.Lock()
	defer sharedMu.Unlock()
	k := sharedKey{drv: drv, pool: poolID}
	sp := sharedPools[k]
	if sp == nil {
		p, err := ImportAsyncPool(drv, dev, fd)
		if err != nil {
			return nil, err
		}
		sp = &sharedPool{pool: p, devs: map[int]bool{dev: true}}
		sharedPools[k] = sp
	} else if !sp.devs[dev] {
		if err := sp.pool.grant(dev); err != nil {
			return nil, err
		}
		sp.devs[dev] = true
	}
	ptr, err := sp.pool.ImportPointer(data)
	if err != nil {
		if sp.refs == 0 {
			delete(sharedPools, k)
			return nil, errors.Join(err, sp.pool.Close())
		}
		return nil, err
	}
	sp.refs++
	seg := &ImportedSegment{key: k, shared: sp, addr: ptr}
	// The exporter's word for the allocation's size is not to be trusted:
	// the driver says what was mapped.
	base, size, err := drv.MemGetAddressRange(dev, ptr)
	if err == nil && base != ptr {
		err = fmt.Errorf("cuda: imported pointer %#x is inside an allocation at %#x: %w", ptr, base, gocore.ErrInvalidArgument)
	}
	if err != nil {
		return nil, errors.Join(err, seg.closeLocked())
	}
	seg.size = size
	return seg, nil
}

// Size is the size of the imported allocation, as the driver maps it.
func (s *ImportedSegment) Size() uint64 { return s.size }

// Addr is where the allocation is mapped in this process.
func (s *ImportedSegment) Addr() uint64 { return s.addr }

// Close drops this reference: the last one to the allocation frees it here
// (ImportedPool.FreePointer), the last one to the pool destroys the
// imported pool. Closing twice is an error.
func (s *ImportedSegment) Close() error {
	sharedMu.Lock()
	defer sharedMu.Unlock()
	return s.closeLocked()
}

func (s *ImportedSegment) closeLocked() error {
	if s.closed {
		return fmt.Errorf("cuda: close imported allocation %#x: already closed: %w", s.addr, gocore.ErrInvalidArgument)
	}
	s.closed = true
	err := s.shared.pool.FreePointer(s.addr)
	if s.shared.refs--; s.shared.refs == 0 {
		delete(sharedPools, s.key)
		err = errors.Join(err, s.shared.pool.Close()) // frees it if FreePointer could not
	}
	return err
}
