package cuda

import (
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"syscall"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/cuda/driver"
)

// IPCHandle is a block of an async or vmm pool as another process imports
// it: everything but the file descriptors, which travel separately
// (SCM_RIGHTS over a UNIX socket) and arrive as new numbers in the other
// process. Handles are made (ExportBlock) and read (ParseIPCHandle) by the
// same gpumempool version.
type IPCHandle struct {
	Kind string `json:"kind"` // "async" or "vmm"
	// Device is the exporter's device ordinal, UUID its UUID (hex,
	// cuDeviceGetUuid_v2): the importer maps the UUID to its own ordinal,
	// which differs when the processes see different CUDA_VISIBLE_DEVICES.
	// An exporter whose driver lacks cuDeviceGetUuid_v2 (older than CUDA
	// 11.4) sends no UUID, and the importer then uses the ordinal as is.
	Device int            `json:"device"`
	UUID   string         `json:"uuid,omitempty"`
	FDs    []int          `json:"fds"`
	Chunks []IPCChunkSpan `json:"chunks,omitempty"` // vmm: one per fd
	Data   string         `json:"data,omitempty"`   // async: cuMemPoolExportPointer data, hex
	// async: the exporter's CUDA pool, unique among processes (the
	// importer imports it once however many blocks come from it), and the
	// size of the exported segment, which holds the block.
	Pool        string `json:"pool,omitempty"`
	SegmentSize uint64 `json:"segment_size,omitempty"`
	Offset      uint64 `json:"offset"` // of the block within what is imported
	Size        uint64 `json:"size"`   // of the block
}

// IPCChunkSpan is where one chunk of a vmm handle lies in its segment.
type IPCChunkSpan struct {
	Size   uint64 `json:"size"`
	Offset uint64 `json:"offset"`
}

// ExportBlock makes the block at addr (described by info, from the pool's
// Lookup) of a pool over be shareable with another process: for an async
// backend the CUDA pool's file descriptor and the pointer's export data, for
// a vmm backend a file descriptor per physical chunk of its segment; any
// other backend is refused (gocore.ErrUnsupported). exporter names the
// exporting pool uniquely among processes; the handle's pool is exporter
// and the device. The caller owns (and must close) the descriptors in
// FDs; on error none is left open.
func ExportBlock(be gocore.Backend, info gocore.BlockInfo, addr uint64, exporter string) (h IPCHandle, err error) {
	h = IPCHandle{Device: info.Device, Size: info.Size}
	defer func() {
		if err != nil {
			closeFDs(h.FDs)
		}
	}()
	var drv *driver.Driver
	switch be := be.(type) {
	case *AsyncBackend:
		drv = be.Driver()
		fd, err := be.ExportPool(info.Device)
		if err != nil {
			return h, err
		}
		h.FDs = []int{fd}
		data, err := be.ExportPointer(info.Device, info.SegmentAddr)
		if err != nil {
			return h, err
		}
		h.Kind, h.Data, h.Offset, h.SegmentSize = "async", hex.EncodeToString(data[:]), addr-info.SegmentAddr, info.SegmentSize
		h.Pool = fmt.Sprintf("%s:%d", exporter, info.Device)
	case *VMMBackend:
		drv = be.Driver()
		if err := exportVMM(be, info.Device, addr, &h); err != nil {
			return h, err
		}
	default:
		return h, fmt.Errorf("export from the %s backend: only async and vmm pools can be shared: %w",
			be.Name(), gocore.ErrUnsupported)
	}
	uuid, err := drv.DeviceUUID(info.Device)
	switch {
	case err == nil:
		h.UUID = hex.EncodeToString(uuid[:])
	case errors.Is(err, driver.ErrDriverTooOld): // no cuDeviceGetUuid_v2: the importer uses the ordinal
	default:
		return h, err
	}
	return h, nil
}

// segmentExporter is what exportVMM needs of a *VMMBackend.
type segmentExporter interface {
	ExportSegment(dev int, addr uint64) ([]Chunk, error)
	SegmentBase(dev int, addr uint64) (uint64, error)
}

// exportVMM fills in h for the block at addr of a vmm pool: the chunks of
// its segment, their descriptors and the block's offset. On error it closes
// the descriptors it exported and leaves h as it was.
func exportVMM(be segmentExporter, dev int, addr uint64, h *IPCHandle) error {
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
		h.Chunks = append(h.Chunks, IPCChunkSpan{Size: c.Size, Offset: c.Offset})
	}
	return nil
}

// closeFDs closes descriptors on an error path.
func closeFDs(fds []int) {
	for _, fd := range fds {
		_ = syscall.Close(fd)
	}
}

// ipcHandleKeys are the keys of an IPCHandle's JSON that ParseIPCHandle
// takes, exactly as spelled there.
var ipcHandleKeys = map[string]bool{"kind": true, "device": true, "uuid": true, "chunks": true, "data": true,
	"pool": true, "segment_size": true, "offset": true, "size": true}

// ParseIPCHandle reads a handle sent by another process: handleJSON is
// ExportBlock's handle as JSON without "fds", fdsJSON lists this process's
// descriptors for it (a JSON array). The handle may come from a process
// that is not trusted: only an IPCHandle's keys, spelled exactly, are
// accepted (encoding/json would match "Fds" to "fds", which let a peer name
// any descriptor of this process), the descriptors never come from it, and
// what it says is checked before anything is imported.
func ParseIPCHandle(handleJSON, fdsJSON string) (IPCHandle, error) {
	var h IPCHandle
	var keys map[string]json.RawMessage
	if err := json.Unmarshal([]byte(handleJSON), &keys); err != nil {
		return h, fmt.Errorf("IPC handle: %v: %w", err, gocore.ErrInvalidArgument)
	}
	for k := range keys {
		if !ipcHandleKeys[k] {
			return h, fmt.Errorf("IPC handle: unexpected key %q: %w", k, gocore.ErrInvalidArgument)
		}
	}
	if err := json.Unmarshal([]byte(handleJSON), &h); err != nil {
		return h, fmt.Errorf("IPC handle: %v: %w", err, gocore.ErrInvalidArgument)
	}
	h.FDs = nil
	if err := json.Unmarshal([]byte(fdsJSON), &h.FDs); err != nil {
		return h, fmt.Errorf("IPC handle descriptors: %v: %w", err, gocore.ErrInvalidArgument)
	}
	switch h.Kind {
	case "async":
		if len(h.FDs) != 1 || len(h.Data) != 2*64 {
			return h, fmt.Errorf("async IPC handle needs one fd and 64 bytes of data: %w", gocore.ErrInvalidArgument)
		}
		if _, err := hex.DecodeString(h.Data); err != nil {
			return h, fmt.Errorf("async IPC handle data: %v: %w", err, gocore.ErrInvalidArgument)
		}
		if h.Pool == "" || h.SegmentSize == 0 {
			return h, fmt.Errorf("async IPC handle needs pool and segment_size (from another gpumempool version?): %w",
				gocore.ErrInvalidArgument)
		}
		if !within(h.Offset, h.Size, h.SegmentSize) {
			return h, fmt.Errorf("IPC handle block [%d, +%d) is outside the %d-byte segment: %w",
				h.Offset, h.Size, h.SegmentSize, gocore.ErrInvalidArgument)
		}
		// (checked again by ImportBlock against the size the driver maps)
	case "vmm":
		if len(h.FDs) == 0 || len(h.FDs) != len(h.Chunks) {
			return h, fmt.Errorf("vmm IPC handle needs one fd per chunk: %w", gocore.ErrInvalidArgument)
		}
	default:
		return h, fmt.Errorf("IPC handle kind %q (want async or vmm): %w", h.Kind, gocore.ErrInvalidArgument)
	}
	return h, nil
}

// ImportBlock maps the block of a handle ParseIPCHandle read, for this
// process's ordinal of the exporter's device (found by its UUID), and
// returns what unmaps it, the block's address and that ordinal.
//
// Async blocks share their imports: the exporter's pool is imported once
// and each of its segments once, however many blocks of it are imported
// (ImportAsyncSegment). The pool a handle names is looked up among the pools
// imported from the same peer only: peer says who sent the handle (the
// socket's SO_PEERCRED, which the kernel vouches for), or is "" for handles
// the caller vouches for. Without it a peer could send its own pool's
// descriptor under another exporter's pool name, and every later block of
// that exporter would be looked for in the wrong pool ("squatting").
func ImportBlock(drv *driver.Driver, h IPCHandle, peer string) (mapping io.Closer, ptr uint64, dev int, err error) {
	dev, err = importDevice(drv, &h)
	if err != nil {
		return nil, 0, 0, err
	}
	switch h.Kind {
	case "async":
		var data [64]byte
		if _, err := hex.Decode(data[:], []byte(h.Data)); err != nil {
			return nil, 0, 0, fmt.Errorf("async IPC handle data: %v: %w", err, gocore.ErrInvalidArgument)
		}
		seg, err := ImportAsyncSegment(drv, dev, sharedPoolName(peer, h.Pool), h.FDs[0], data)
		if err != nil {
			return nil, 0, 0, err
		}
		if seg.Size() != h.SegmentSize || !within(h.Offset, h.Size, seg.Size()) {
			return nil, 0, 0, errors.Join(fmt.Errorf("IPC handle block [%d, +%d) of a %d-byte segment: the imported segment "+
				"has %d bytes: %w", h.Offset, h.Size, h.SegmentSize, seg.Size(), gocore.ErrInvalidArgument), seg.Close())
		}
		return seg, seg.Addr() + h.Offset, dev, nil
	case "vmm":
		chunks := make([]Chunk, len(h.FDs))
		for i, fd := range h.FDs {
			chunks[i] = Chunk{FD: fd, Size: h.Chunks[i].Size, Offset: h.Chunks[i].Offset}
		}
		r, err := ImportVMM(drv, dev, chunks, nil)
		if err != nil {
			return nil, 0, 0, err
		}
		if !within(h.Offset, h.Size, r.Size()) {
			return nil, 0, 0, errors.Join(fmt.Errorf("IPC handle block [%d, +%d) is outside the %d imported bytes: %w",
				h.Offset, h.Size, r.Size(), gocore.ErrInvalidArgument), r.Close())
		}
		return r, r.Addr() + h.Offset, dev, nil
	}
	return nil, 0, 0, fmt.Errorf("IPC handle kind %q (want async or vmm): %w", h.Kind, gocore.ErrInvalidArgument)
}

// within reports whether [off, off+size) lies in [0, total), without
// overflowing.
func within(off, size, total uint64) bool { return size <= total && off <= total-size }

// importDevice returns this process's ordinal of the exporter's device: the
// one with the handle's UUID, or the exporter's ordinal for a handle
// without one (or a driver here without cuDeviceGetUuid_v2).
func importDevice(drv *driver.Driver, h *IPCHandle) (int, error) {
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

// sharedPoolName is the name an exporter's pool is imported under: the
// handle's pool name within the sender's namespace.
func sharedPoolName(peer, pool string) string {
	if peer == "" {
		return pool
	}
	return fmt.Sprintf("%q/%s", peer, pool)
}
