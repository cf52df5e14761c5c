package bindings

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"sync"

	"github.com/gpumempool/gpumempool/bindings/registry"
	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/cuda"
	"github.com/gpumempool/gpumempool/gocore/cuda/driver"
)

// The IPC handle format, and which backends can export, are gocore/cuda's
// (cuda.IPCHandle, cuda.ExportBlock, cuda.ParseIPCHandle, cuda.ImportBlock);
// the bindings keep the handles of this process's imports.

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
	return withEntry(id, func(e *registry.Entry) (string, error) {
		info, err := e.Pool.Lookup(addr) // a capture may have put it in a private pool
		if err != nil {
			return "", err
		}
		h, err := cuda.ExportBlock(e.Pool.Backend(), info, addr, fmt.Sprintf("%s:%d", processTag(), id))
		if err != nil {
			return "", err
		}
		return marshal(h)
	})
}

var (
	importsMu  sync.Mutex
	importNext int64
	imports    = map[int64]io.Closer{}
)

// ImportMemory maps a block exported by another process. handleJSON is
// PoolExport's JSON without "fds"; fdsJSON lists this process's descriptors
// for the handle's (a JSON array; the caller closes them afterwards);
// libcuda is the driver path ("" for the default); peer says who sent the
// handle (gpumempool.IpcHandle.recv takes it from the socket's
// SO_PEERCRED), or is "" for handles the caller vouches for. The handle may
// come from a process that is not trusted: see cuda.ParseIPCHandle and
// cuda.ImportBlock. Returns JSON {"id": import handle, "ptr": address of
// the block, "size": its size, "device": this process's ordinal of the
// exporter's device}.
func ImportMemory(handleJSON, fdsJSON, libcuda, peer string) (js string, err error) {
	defer guard(&err)
	h, err := cuda.ParseIPCHandle(handleJSON, fdsJSON)
	if err != nil {
		return "", err
	}
	drv, err := driver.Load(libcuda)
	if err != nil {
		return "", err
	}
	mapping, ptr, dev, err := cuda.ImportBlock(drv, h, peer)
	if err != nil {
		return "", err
	}
	importsMu.Lock()
	importNext++
	id := importNext
	imports[id] = mapping
	importsMu.Unlock()
	return marshal(map[string]any{"id": id, "ptr": ptr, "size": h.Size, "device": dev})
}

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
