package bindings

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sync"
	"syscall"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/cuda"
	"github.com/gpumempool/gpumempool/gocore/cuda/driver"
)

// ipcHandle is what PoolExport returns and ImportMemory takes: everything but
// the file descriptors, which travel separately (SCM_RIGHTS over a UNIX
// socket) and arrive as new numbers in the other process. Handles are made
// and read by the same gpumempool version.
type ipcHandle struct {
	Kind string `json:"kind"` // "async" or "vmm"
	// Device is the exporter's device ordinal, UUID its UUID (hex,
	// cuDeviceGetUuid_v2): the importer maps the UUID to its own ordinal,
	// which differs when the processes see different CUDA_VISIBLE_DEVICES.
	// An exporter whose driver lacks cuDeviceGetUuid_v2 (older than CUDA
	// 11.4) sends no UUID, and the importer then uses the ordinal as is.
	Device int        `json:"device"`
	UUID   string     `json:"uuid,omitempty"`
	FDs    []int      `json:"fds"`
	Chunks []ipcChunk `json:"chunks,omitempty"` // vmm: one per fd
	Data   string     `json:"data,omitempty"`   // async: cuMemPoolExportPointer data, hex
	// async: the exporter's CUDA pool, unique among processes (the
	// importer imports it once however many blocks come from it), and the
	// size of the exported segment, which holds the block.
	Pool        string `json:"pool,omitempty"`
	SegmentSize uint64 `json:"segment_size,omitempty"`
	Offset      uint64 `json:"offset"` // of the block within what is imported
	Size        uint64 `json:"size"`   // of the block
}

type ipcChunk struct {
	Size   uint64 `json:"size"`
	Offset uint64 `json:"offset"`
}

// processTag tells this process's exported pools from every other
// process's (a pid can be reused; 128 random bits are not).
var processTag = sync.OnceValue(func() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(fmt.Sprintf("gpumempool: no randomness for the IPC process tag: %v", err))
	}
	return hex.EncodeToString(b[:])
})

// PoolExport makes the block at addr shareable with another process: for an
// async pool the CUDA pool's file descriptor and the pointer's export data,
// for a vmm pool a file descriptor per physical chunk of its segment. The
// pool must have been created with ipc=True. Returns the handle as JSON; the
// caller owns (and must close) the descriptors listed in "fds". On error no
// descriptor is left open.
func PoolExport(id int64, addr uint64) (js string, err error) {
	defer guard(&err)
	e, err := entry(id)
	if err != nil {
		return "", err
	}
	info, err := e.Graphs.Lookup(addr) // a capture may have put it in a private pool
	if err != nil {
		return "", err
	}
	h := ipcHandle{Device: info.Device, Size: info.Size}
	defer func() {
		if err != nil {
			closeFDs(h.FDs)
		}
	}()
	var drv *driver.Driver
	switch be := e.Keep.(type) {
	case *cuda.AsyncBackend:
		drv = be.Driver()
		fd, err := be.ExportPool(info.Device)
		if err != nil {
			return "", err
		}
		h.FDs = []int{fd}
		data, err := be.ExportPointer(info.Device, info.SegmentAddr)
		if err != nil {
			return "", err
		}
		h.Kind, h.Data, h.Offset, h.SegmentSize = "async", hex.EncodeToString(data[:]), addr-info.SegmentAddr, info.SegmentSize
		h.Pool = fmt.Sprintf("%s:%d:%d", processTag(), id, info.Device)
	case *cuda.VMMBackend:
		drv = be.Driver()
		if err := exportVMM(be, info.Device, addr, &h); err != nil {
			return "", err
		}
	default:
		return "", fmt.Errorf("export from the %s backend: only async and vmm pools can be shared: %w",
			e.Pool.Backend().Name(), gocore.ErrUnsupported)
	}
	uuid, err := drv.DeviceUUID(info.Device)
	switch {
	case err == nil:
		h.UUID = hex.EncodeToString(uuid[:])
	case errors.Is(err, driver.ErrDriverTooOld): // no cuDeviceGetUuid_v2: the importer uses the ordinal
	default:
		return "", err
	}
	return marshal(h)
}

// segmentExporter is what exportVMM needs of a *cuda.VMMBackend.
type segmentExporter interface {
	ExportSegment(dev int, addr uint64) ([]cuda.Chunk, error)
	SegmentBase(dev int, addr uint64) (uint64, error)
}

// exportVMM fills in h for the block at addr of a vmm pool: the chunks of
// its segment, their descriptors and the block's offset. On error it closes
// the descriptors it exported and leaves h as it was.
func exportVMM(be segmentExporter, dev int, addr uint64, h *ipcHandle) error {
	chunks, err := be.ExportSegment(dev, addr)
	if err != nil {
		return err
	}
	base, err := be.SegmentBase(dev, addr)
	if err != nil {
		for _, c := range chunks {
			_ = syscall.Close(c.FD)
		}
		return err
	}
	h.Kind, h.Offset = "vmm", addr-base
	for _, c := range chunks {
		h.FDs = append(h.FDs, c.FD)
		h.Chunks = append(h.Chunks, ipcChunk{Size: c.Size, Offset: c.Offset})
	}
	return nil
}

var (
	importsMu  sync.Mutex
	importNext int64
	imports    = map[int64]io.Closer{}
)

// within reports whether [off, off+size) lies in [0, total), without
// overflowing.
func within(off, size, total uint64) bool { return size <= total && off <= total-size }

// importDevice returns this process's ordinal of the exporter's device: the
// one with the handle's UUID, or the exporter's ordinal for a handle
// without one (or a driver here without cuDeviceGetUuid_v2).
func importDevice(drv *driver.Driver, h *ipcHandle) (int, error) {
	if h.UUID == "" {
		return checkedDevice(drv, h.Device)
	}
	var u driver.UUID
	if len(h.UUID) != 2*len(u) {
		return 0, fmt.Errorf("IPC handle uuid of %d characters: want %d hex digits: %w", len(h.UUID), 2*len(u),
			gocore.ErrInvalidArgument)
	}
	if n, err := hex.Decode(u[:], []byte(h.UUID)); err != nil || n != len(u) {
		return 0, fmt.Errorf("IPC handle uuid %q: want %d hex digits: %w", h.UUID, 2*len(u), gocore.ErrInvalidArgument)
	}
	dev, ok, err := drv.DeviceByUUID(u)
	switch {
	case errors.Is(err, driver.ErrDriverTooOld):
		return checkedDevice(drv, h.Device)
	case err != nil:
		return 0, fmt.Errorf("IPC handle: find the exporting GPU %s: %w", u, err)
	case !ok:
		return 0, fmt.Errorf("IPC handle: the exporting GPU %s is not visible in this process (CUDA_VISIBLE_DEVICES?): %w",
			u, gocore.ErrInvalidDevice)
	}
	return dev, nil
}

// checkedDevice refuses an ordinal this process has no device for (a handle
// may carry any number; C.int would wrap 2^32 to device 0).
func checkedDevice(drv *driver.Driver, dev int) (int, error) {
	n, err := drv.DeviceCount()
	if err != nil {
		return 0, fmt.Errorf("IPC handle: %w", err)
	}
	if dev < 0 || dev >= n {
		return 0, fmt.Errorf("IPC handle device %d: this process has devices 0..%d: %w", dev, n-1, gocore.ErrInvalidDevice)
	}
	return dev, nil
}

// ImportMemory maps a block exported by another process. handleJSON is
// PoolExport's JSON without "fds"; fdsJSON lists this process's descriptors
// for the handle's (a JSON array; the caller closes them afterwards);
// libcuda is the driver path ("" for the default). The handle may come from
// a process that is not trusted: only PoolExport's keys, spelled exactly,
// are accepted (encoding/json would match "Fds" to "fds", which let a peer
// name any descriptor of this process), and the descriptors never come
// from it. The block is mapped for this process's ordinal of the
// exporter's device (found by its UUID). Returns JSON {"id": import handle,
// "ptr": address of the block, "size": its size, "device": that ordinal}.
//
// Async blocks share their imports: the exporter's pool is imported once
// and each of its segments once, however many blocks of it are imported
// (cuda.ImportAsyncSegment). The pool a handle names is looked up among
// the pools imported from the same peer only: peer says who sent the
// handle (gpumempool.IpcHandle.recv takes it from the socket's SO_PEERCRED,
// which the kernel vouches for), or is "" for handles the caller vouches
// for. Without it a peer could send its own pool's descriptor under
// another exporter's pool name, and every later block of that exporter
// would be looked for in the wrong pool ("squatting").
func ImportMemory(handleJSON, fdsJSON, libcuda, peer string) (js string, err error) {
	defer guard(&err)
	var keys map[string]json.RawMessage
	if err := json.Unmarshal([]byte(handleJSON), &keys); err != nil {
		return "", fmt.Errorf("IPC handle: %v: %w", err, gocore.ErrInvalidArgument)
	}
	for k := range keys {
		if !importKeys[k] {
			return "", fmt.Errorf("IPC handle: unexpected key %q: %w", k, gocore.ErrInvalidArgument)
		}
	}
	var h ipcHandle
	if err := json.Unmarshal([]byte(handleJSON), &h); err != nil {
		return "", fmt.Errorf("IPC handle: %v: %w", err, gocore.ErrInvalidArgument)
	}
	h.FDs = nil
	if err := json.Unmarshal([]byte(fdsJSON), &h.FDs); err != nil {
		return "", fmt.Errorf("IPC handle descriptors: %v: %w", err, gocore.ErrInvalidArgument)
	}
	var data [64]byte
	switch h.Kind {
	case "async":
		if len(h.FDs) != 1 || len(h.Data) != 2*len(data) {
			return "", fmt.Errorf("async IPC handle needs one fd and 64 bytes of data: %w", gocore.ErrInvalidArgument)
		}
		if _, err := hex.Decode(data[:], []byte(h.Data)); err != nil {
			return "", fmt.Errorf("async IPC handle data: %v: %w", err, gocore.ErrInvalidArgument)
		}
		if h.Pool == "" || h.SegmentSize == 0 {
			return "", fmt.Errorf("async IPC handle needs pool and segment_size (from another gpumempool version?): %w",
				gocore.ErrInvalidArgument)
		}
		if !within(h.Offset, h.Size, h.SegmentSize) {
			return "", fmt.Errorf("IPC handle block [%d, +%d) is outside the %d-byte segment: %w",
				h.Offset, h.Size, h.SegmentSize, gocore.ErrInvalidArgument)
		}
		// (checked again below against the size the driver maps)
	case "vmm":
		if len(h.FDs) == 0 || len(h.FDs) != len(h.Chunks) {
			return "", fmt.Errorf("vmm IPC handle needs one fd per chunk: %w", gocore.ErrInvalidArgument)
		}
	default:
		return "", fmt.Errorf("IPC handle kind %q (want async or vmm): %w", h.Kind, gocore.ErrInvalidArgument)
	}
	drv, err := driver.Load(libcuda)
	if err != nil {
		return "", err
	}
	dev, err := importDevice(drv, &h)
	if err != nil {
		return "", err
	}
	var closer io.Closer
	var ptr uint64
	switch h.Kind {
	case "async":
		seg, err := cuda.ImportAsyncSegment(drv, dev, sharedPoolName(peer, h.Pool), h.FDs[0], data)
		if err != nil {
			return "", err
		}
		if seg.Size() != h.SegmentSize || !within(h.Offset, h.Size, seg.Size()) {
			return "", errors.Join(fmt.Errorf("IPC handle block [%d, +%d) of a %d-byte segment: the imported segment "+
				"has %d bytes: %w", h.Offset, h.Size, h.SegmentSize, seg.Size(), gocore.ErrInvalidArgument), seg.Close())
		}
		closer, ptr = seg, seg.Addr()+h.Offset
	case "vmm":
		chunks := make([]cuda.Chunk, len(h.FDs))
		for i, fd := range h.FDs {
			chunks[i] = cuda.Chunk{FD: fd, Size: h.Chunks[i].Size, Offset: h.Chunks[i].Offset}
		}
		r, err := cuda.ImportVMM(drv, dev, chunks, nil)
		if err != nil {
			return "", err
		}
		if !within(h.Offset, h.Size, r.Size()) {
			return "", errors.Join(fmt.Errorf("IPC handle block [%d, +%d) is outside the %d imported bytes: %w",
				h.Offset, h.Size, r.Size(), gocore.ErrInvalidArgument), r.Close())
		}
		closer, ptr = r, r.Addr()+h.Offset
	}
	importsMu.Lock()
	importNext++
	id := importNext
	imports[id] = closer
	importsMu.Unlock()
	return marshal(map[string]any{"id": id, "ptr": ptr, "size": h.Size, "device": dev})
}

// sharedPoolName is the name an exporter's pool is imported under: the
// handle's pool name within the sender's namespace.
func sharedPoolName(peer, pool string) string {
	if peer == "" {
		return pool
	}
	return fmt.Sprintf("%q/%s", peer, pool)
}

// importKeys are the keys of PoolExport's JSON that ImportMemory takes,
// exactly as spelled there.
var importKeys = map[string]bool{"kind": true, "device": true, "uuid": true, "chunks": true, "data": true,
	"pool": true, "segment_size": true, "offset": true, "size": true}

// CloseImport unmaps what ImportMemory mapped.
//
// ok is true when err is nil (see okOf).
func CloseImport(id int64) (ok bool, err error) {
	return okOf(closeImportHandle(id))
}

func closeImportHandle(id int64) (err error) {
	defer guard(&err)
	importsMu.Lock()
	c := imports[id]
	delete(imports, id)
	importsMu.Unlock()
	if c == nil {
		return fmt.Errorf("import handle %d: %w", id, errNoImport)
	}
	return c.Close()
}

var errNoImport = fmt.Errorf("no such import (closed already?): %w", gocore.ErrInvalidArgument)

// closeFDs closes descriptors on an error path.
func closeFDs(fds []int) {
	for _, fd := range fds {
		_ = syscall.Close(fd)
	}
}
