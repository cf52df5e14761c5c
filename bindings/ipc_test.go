package bindings

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/bindings/pyerr"
)

// buildFake compiles the fake libcuda (tests/csrc/fake_cuda.c) into a
// library of its own: each copy has its own state, so two copies play two
// processes (their VMM memory is memfds, which both can map). A copy reads
// FAKE_CUDA_* when it is first loaded.
func buildFake(t *testing.T) string {
	t.Helper()
	return buildCLib(t, "fake_cuda.c", "libcuda.so.1")
}

// buildCLib compiles tests/csrc/<src> with $CC (default cc) into a shared
// library named name in a directory of the test's own, and returns its path.
func buildCLib(t *testing.T, src, name string, flags ...string) string {
	t.Helper()
	cc := strings.Fields(os.Getenv("CC"))
	if len(cc) == 0 {
		cc = []string{"cc"}
	}
	out := filepath.Join(t.TempDir(), name)
	args := append(cc[1:], "-shared", "-fPIC", "-O1", "-o", out, filepath.Join("..", "tests", "csrc", src))
	args = append(args, flags...)
	if msg, err := exec.Command(cc[0], args...).CombinedOutput(); err != nil {
		t.Fatalf("build %s from tests/csrc/%s: %v\n%s", name, src, err, msg)
	}
	return out
}

func newGPUPool(t *testing.T, backend, lib string) int64 {
	t.Helper()
	id, err := NewPool(fmt.Sprintf(`{"backend":%q,"options":{"libcuda":%q,"ipc":true}}`, backend, lib))
	require.NoError(t, err)
	return id
}

// exportNewBlock makes a vmm pool over the fake driver lib, allocates a
// 1 MiB block on device dev and exports it.
func exportNewBlock(t *testing.T, lib string, dev int64) (id int64, addr uint64, h map[string]any) {
	t.Helper()
	id = newGPUPool(t, "vmm", lib)
	addr, err := PoolAlloc(id, 1<<20, dev, 0)
	require.NoError(t, err)
	return id, addr, export(t, id, addr)
}

// export returns the handle of the block at addr, decoded, and closes its
// descriptors at the end of the test.
func export(t *testing.T, id int64, addr uint64) map[string]any {
	t.Helper()
	js, err := PoolExport(id, addr)
	require.NoError(t, err)
	var h map[string]any
	require.NoError(t, json.Unmarshal([]byte(js), &h))
	t.Cleanup(func() {
		for _, fd := range h["fds"].([]any) {
			_ = syscall.Close(int(fd.(float64)))
		}
	})
	return h
}

// importHandle imports h (with changes) and returns the result, decoded.
func importHandle(h map[string]any, lib string, change map[string]any) (map[string]any, error) {
	return importHandleFrom(h, lib, change, "")
}

// importHandleFrom is importHandle for a handle sent by peer.
func importHandleFrom(h map[string]any, lib string, change map[string]any, peer string) (map[string]any, error) {
	m := map[string]any{}
	for k, v := range h {
		m[k] = v
	}
	for k, v := range change {
		if v == nil {
			delete(m, k)
		} else {
			m[k] = v
		}
	}
	fds, err := json.Marshal(m["fds"])
	if err != nil {
		return nil, err
	}
	delete(m, "fds")
	js, err := json.Marshal(m)
	if err != nil {
		return nil, err
	}
	out, err := ImportMemory(string(js), string(fds), lib, peer)
	if err != nil {
		return nil, err
	}
	var r map[string]any
	return r, json.Unmarshal([]byte(out), &r)
}

func closeImport(t *testing.T, r map[string]any) {
	t.Helper()
	ok, err := CloseImport(int64(r["id"].(float64)))
	require.NoError(t, err)
	require.True(t, ok)
}

// The handle names the exporting GPU by UUID, and the importer maps it to
// its own ordinal: torchrun ranks each see their GPU as device 0.
func TestImportMemoryFindsTheExportersGPUByUUID(t *testing.T) {
	id, a, h := exportNewBlock(t, buildFake(t), 1)
	assert.EqualValues(t, 1, h["device"])
	assert.Equal(t, "fa4ec0da000040008000000000000001", h["uuid"])

	// A process that sees GPU 1 only, as its device 0.
	t.Setenv("FAKE_CUDA_VISIBLE_ORDER", "1")
	r, err := importHandle(h, buildFake(t), nil)
	require.NoError(t, err)
	assert.EqualValues(t, 0, r["device"])
	assert.EqualValues(t, 1<<20, r["size"])
	closeImport(t, r)

	// One that sees GPU 1 second.
	t.Setenv("FAKE_CUDA_VISIBLE_ORDER", "0,1")
	r, err = importHandle(h, buildFake(t), nil)
	require.NoError(t, err)
	assert.EqualValues(t, 1, r["device"])
	closeImport(t, r)

	// One that does not see it.
	t.Setenv("FAKE_CUDA_VISIBLE_ORDER", "0")
	blind := buildFake(t)
	_, err = importHandle(h, blind, nil)
	require.Error(t, err)
	assertKind(t, err, pyerr.InvalidArgument, "")
	assert.Contains(t, err.Error(),
		"the exporting GPU GPU-fa4ec0da-0000-4000-8000-000000000001 is not visible in this process (CUDA_VISIBLE_DEVICES?)")

	// Without a UUID (an exporter without cuDeviceGetUuid_v2) the ordinal
	// is used as is: device 1 does not exist there.
	_, err = importHandle(h, blind, map[string]any{"uuid": nil})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "device 1")
	_, err = importHandle(h, blind, map[string]any{"uuid": "fa4e"})
	require.Error(t, err)
	assertKind(t, err, pyerr.InvalidArgument, "IPC handle uuid")

	ok, err := PoolFree(id, a)
	require.NoError(t, err)
	require.True(t, ok)
	_, err = PoolClose(id)
	require.NoError(t, err)
}

// A crafted vmm handle whose offset + size wraps around is refused.
func TestImportMemoryVMMBlockBoundsDoNotOverflow(t *testing.T) {
	lib := buildFake(t)
	id := newGPUPool(t, "vmm", lib)
	_, err := PoolAlloc(id, 5000, 0, 0)
	require.NoError(t, err)
	a, err := PoolAlloc(id, 1<<20, 0, 0)
	require.NoError(t, err)
	h := export(t, id, a)
	require.NotZero(t, h["offset"], "the block is not at the segment's start")

	r, err := importHandle(h, lib, nil)
	require.NoError(t, err)
	closeImport(t, r)
	for _, c := range []map[string]any{
		{"offset": uint64(math.MaxUint64 - 100), "size": 200},
		{"offset": 0, "size": uint64(math.MaxUint64)},
		{"offset": 2 << 20, "size": 1},
	} {
		_, err = importHandle(h, lib, c)
		require.Error(t, err, "%v", c)
		assertKind(t, err, pyerr.InvalidArgument, "IPC handle block")
		assert.Contains(t, err.Error(), "outside the 2097152 imported bytes")
	}
	_, err = PoolClose(id)
	require.NoError(t, err)
}

// An async handle carries its segment's size; the block must lie in it.
// Blocks of one segment share one import of it.
func TestImportMemoryAsync(t *testing.T) {
	lib := buildFake(t)
	id := newGPUPool(t, "async", lib)
	a, err := PoolAlloc(id, 4096, 0, 0)
	require.NoError(t, err)
	b, err := PoolAlloc(id, 4096, 0, 0)
	require.NoError(t, err)
	ha, hb := export(t, id, a), export(t, id, b)
	require.Equal(t, ha["data"], hb["data"], "one segment")
	require.Equal(t, ha["pool"], hb["pool"])
	assert.NotZero(t, ha["segment_size"])
	assert.Equal(t, "fa4ec0da000040008000000000000000", ha["uuid"])

	ra, err := importHandle(ha, lib, nil)
	require.NoError(t, err)
	rb, err := importHandle(hb, lib, nil)
	require.NoError(t, err, "the segment is imported once for both blocks")
	// In one process the fake maps the import at the exporter's address.
	assert.EqualValues(t, a, ra["ptr"])
	assert.EqualValues(t, b, rb["ptr"])
	closeImport(t, ra)
	closeImport(t, rb)

	seg := ha["segment_size"].(float64)
	for _, c := range []map[string]any{
		{"offset": seg, "size": 1},
		{"offset": uint64(math.MaxUint64 - 100), "size": 4096},
		{"size": seg + 1, "offset": 0},
	} {
		_, err = importHandle(ha, lib, c)
		require.Error(t, err, "%v", c)
		assertKind(t, err, pyerr.InvalidArgument, "IPC handle block")
	}
	// The peer's segment_size is not believed (found by review: a block
	// past the real segment was mapped onto this process's own memory):
	// the driver's size of the imported allocation decides, and nothing
	// stays imported.
	for _, c := range []map[string]any{
		{"segment_size": uint64(1) << 32, "offset": uint64(3) << 30, "size": 4096},
		{"segment_size": seg * 2, "offset": seg, "size": 4096},
		{"segment_size": seg / 2},
	} {
		_, err = importHandle(ha, lib, c)
		require.Error(t, err, "%v", c)
		assert.Contains(t, err.Error(), fmt.Sprintf("the imported segment has %d bytes", uint64(seg)))
	}
	r, err := importHandle(ha, lib, nil) // nothing was left imported by the refusals
	require.NoError(t, err)
	closeImport(t, r)
	for _, missing := range []string{"segment_size", "pool"} {
		_, err = importHandle(ha, lib, map[string]any{missing: nil})
		require.Error(t, err)
		assert.Contains(t, err.Error(), "needs pool and segment_size")
	}

	for _, addr := range []uint64{a, b} {
		ok, err := PoolFree(id, addr)
		require.NoError(t, err)
		require.True(t, ok)
	}
	_, err = PoolClose(id)
	require.NoError(t, err)
}

// A peer that sends its own pool's descriptor under another exporter's pool
// name ("squatting") gets its pool imported in its own namespace only: the
// exporter's blocks, sent by the exporter, still import (and share one
// pool import between them). Handles without a peer share one namespace:
// there the squat makes the exporter's import fail (the driver refuses
// pointer data of another pool), which is what the peer scoping prevents.
func TestImportMemoryPoolNamesAreScopedByPeer(t *testing.T) {
	lib := buildFake(t)
	victim, squatter := newGPUPool(t, "async", lib), newGPUPool(t, "async", lib)
	var blocks []uint64
	alloc := func(id int64) uint64 {
		addr, err := PoolAlloc(id, 4096, 0, 0)
		require.NoError(t, err)
		blocks = append(blocks, addr)
		return addr
	}
	v1, v2, s1 := alloc(victim), alloc(victim), alloc(squatter)
	hv1, hv2, hs := export(t, victim, v1), export(t, victim, v2), export(t, squatter, s1)
	require.NotEqual(t, hv1["pool"], hs["pool"])
	squat := map[string]any{"pool": hv1["pool"]}

	rs, err := importHandleFrom(hs, lib, squat, "pid 2 uid 1000")
	require.NoError(t, err, "the squatter's own block imports (in its namespace)")
	assert.EqualValues(t, s1, rs["ptr"])
	r1, err := importHandleFrom(hv1, lib, nil, "pid 1 uid 1000")
	require.NoError(t, err, "the exporter's block is not looked for in the squatter's pool")
	r2, err := importHandleFrom(hv2, lib, nil, "pid 1 uid 1000")
	require.NoError(t, err, "a second block of the exporter's segment shares its import")
	assert.EqualValues(t, v1, r1["ptr"])
	assert.EqualValues(t, v2, r2["ptr"])
	for _, r := range []map[string]any{rs, r1, r2} {
		closeImport(t, r)
	}

	// The same squat among handles nobody vouched a peer for.
	rs, err = importHandleFrom(hs, lib, squat, "")
	require.NoError(t, err)
	_, err = importHandleFrom(hv1, lib, nil, "")
	require.Error(t, err, "unscoped handles share pool names")
	closeImport(t, rs)

	for i, id := range []int64{victim, victim, squatter} {
		ok, err := PoolFree(id, blocks[i])
		require.NoError(t, err)
		require.True(t, ok)
	}
	for _, id := range []int64{victim, squatter} {
		_, err = PoolClose(id)
		require.NoError(t, err)
	}
}

// A handle comes from a process that may not be trusted (found by review):
// its keys must be exactly PoolExport's (a case variant such as "Fds" once
// named a descriptor of the importer), a uuid of the wrong length is an
// error rather than a recovered panic, and a device this process does not
// have is refused rather than wrapped into range.
func TestImportMemoryRefusesCraftedHandles(t *testing.T) {
	lib := buildFake(t)
	id, _, h := exportNewBlock(t, lib, 0)
	for _, c := range []struct {
		change map[string]any
		want   string
	}{
		{map[string]any{"Fds": []int{0}}, `IPC handle: unexpected key "Fds"`},
		{map[string]any{"extra": 1}, `IPC handle: unexpected key "extra"`},
		{map[string]any{"uuid": strings.Repeat("ab", 17)}, "IPC handle uuid of 34 characters"},
		{map[string]any{"uuid": strings.Repeat("ab", 40)}, "IPC handle uuid of 80 characters"},
		{map[string]any{"uuid": nil, "device": 1 << 32}, "IPC handle device 4294967296"},
		{map[string]any{"uuid": nil, "device": -1}, "IPC handle device -1"},
	} {
		_, err := importHandle(h, lib, c.change)
		require.Error(t, err, "%v", c.change)
		assertKind(t, err, pyerr.InvalidArgument, "") // a bad device too
		assert.True(t, strings.HasPrefix(pyerr.Of(err).Message, c.want), err.Error())
		assert.NotContains(t, err.Error(), "panic")
	}
	r, err := importHandle(h, lib, map[string]any{"uuid": nil, "device": 0}) // a valid ordinal without uuid
	require.NoError(t, err)
	closeImport(t, r)
	_, err = PoolClose(id)
	require.NoError(t, err)
}
