package bindings

import (
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sync"
	"syscall"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/cuda"
)

// ipcHandle is what PoolExport returns and ImportMemory takes: everything but
// the file descriptors, which travel separately (SCM_RIGHTS over a UNIX
// socket) and arrive as new numbers in the other process.
type ipcHandle struct {
	Kind   string     `json:"kind"` // "async" or "vmm"
	Device int        `json:"device"`
	FDs    []int      `json:"fds"`
	Chunks []ipcChunk `json:"chunks,omitempty"` // vmm: one per fd
	Data   string     `json:"data,omitempty"`   // async: cuMemPoolExportPointer data, hex
	Offset uint64     `json:"offset"`           // of the block within what is imported
	Size   uint64     `json:"size"`             // of the block
}

type ipcChunk struct {
	Size   uint64 `json:"size"`
	Offset uint64 `json:"offset"`
}

// PoolExport makes the block at addr shareable with another process: for an
// async pool the CUDA pool's file descriptor and the pointer's export data,
// for a vmm pool a file descriptor per physical chunk of its segment. The
// pool must have been created with ipc=True. Returns the handle as JSON; the
// caller owns (and must close) the descriptors listed in "fds".
func PoolExport(id int64, addr uint64) (js string, err error) {
	defer guard(&err)
	e, err := entry(id)
	if err != nil {
		return "", err
	}
	info, err := e.Pool.Lookup(addr)
	if err != nil {
		return "", err
	}
	h := ipcHandle{Device: info.Device, Size: info.Size}
	switch be := e.Keep.(type) {
	case *cuda.AsyncBackend:
		fd, err := be.ExportPool(info.Device)
		if err != nil {
			return "", err
		}
		data, err := be.ExportPointer(info.Device, info.SegmentAddr)
		if err != nil {
			closeFDs([]int{fd})
			return "", err
		}
		h.Kind, h.FDs, h.Data, h.Offset = "async", []int{fd}, hex.EncodeToString(data[:]), addr-info.SegmentAddr
	case *cuda.VMMBackend:
		chunks, err := be.ExportSegment(info.Device, addr)
		if err != nil {
			return "", err
		}
		base, err := be.SegmentBase(info.Device, addr)
		if err != nil {
			return "", err
		}
		h.Kind, h.Offset = "vmm", addr-base
		for _, c := range chunks {
			h.FDs = append(h.FDs, c.FD)
			h.Chunks = append(h.Chunks, ipcChunk{Size: c.Size, Offset: c.Offset})
		}
	default:
		return "", fmt.Errorf("export from the %s backend: only async and vmm pools can be shared: %w",
			e.Pool.Backend().Name(), gocore.ErrUnsupported)
	}
	return marshal(h)
}

var (
	importsMu  sync.Mutex
	importNext int64
	imports    = map[int64]io.Closer{}
)

// importedAsync keeps an imported async pool and the pointer taken from it.
type importedAsync struct {
	pool *cuda.ImportedPool
	ptr  uint64
}

func (i *importedAsync) Close() error {
	return errors.Join(i.pool.FreePointer(i.ptr), i.pool.Close())
}

// ImportMemory maps a block exported by another process. handleJSON is
// PoolExport's JSON with "fds" replaced by this process's descriptors (the
// caller closes them afterwards); libcuda is the driver path ("" for the
// default). Returns JSON {"id": import handle, "ptr": address of the block}.
func ImportMemory(handleJSON, libcuda string) (js string, err error) {
	defer guard(&err)
	var h ipcHandle
	if err := json.Unmarshal([]byte(handleJSON), &h); err != nil {
		return "", fmt.Errorf("IPC handle: %v: %w", err, gocore.ErrInvalidArgument)
	}
	drv, err := cuda.Load(libcuda)
	if err != nil {
		return "", err
	}
	var closer io.Closer
	var ptr uint64
	switch h.Kind {
	case "async":
		if len(h.FDs) != 1 || len(h.Data) != 128 {
			return "", fmt.Errorf("async IPC handle needs one fd and 64 bytes of data: %w", gocore.ErrInvalidArgument)
		}
		var data [64]byte
		if _, err := hex.Decode(data[:], []byte(h.Data)); err != nil {
			return "", fmt.Errorf("async IPC handle data: %v: %w", err, gocore.ErrInvalidArgument)
		}
		pool, err := cuda.ImportAsyncPool(drv, h.Device, h.FDs[0])
		if err != nil {
			return "", err
		}
		seg, err := pool.ImportPointer(data)
		if err != nil {
			return "", errors.Join(err, pool.Close())
		}
		closer, ptr = &importedAsync{pool: pool, ptr: seg}, seg+h.Offset
	case "vmm":
		if len(h.FDs) == 0 || len(h.FDs) != len(h.Chunks) {
			return "", fmt.Errorf("vmm IPC handle needs one fd per chunk: %w", gocore.ErrInvalidArgument)
		}
		chunks := make([]cuda.Chunk, len(h.FDs))
		for i, fd := range h.FDs {
			chunks[i] = cuda.Chunk{FD: fd, Size: h.Chunks[i].Size, Offset: h.Chunks[i].Offset}
		}
		r, err := cuda.ImportVMM(drv, h.Device, chunks, nil)
		if err != nil {
			return "", err
		}
		if h.Offset+h.Size > r.Size() {
			return "", errors.Join(fmt.Errorf("IPC handle block [%d, +%d) is outside the %d imported bytes: %w",
				h.Offset, h.Size, r.Size(), gocore.ErrInvalidArgument), r.Close())
		}
		closer, ptr = r, r.Addr()+h.Offset
	default:
		return "", fmt.Errorf("IPC handle kind %q (want async or vmm): %w", h.Kind, gocore.ErrInvalidArgument)
	}
	importsMu.Lock()
	importNext++
	id := importNext
	imports[id] = closer
	importsMu.Unlock()
	return marshal(map[string]any{"id": id, "ptr": ptr, "size": h.Size})
}

// CloseImport unmaps what ImportMemory mapped.
func CloseImport(id int64) (err error) {
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
