package picklescan

import (
	"bytes"
	"errors"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// testdata/snapshot-p*.pickle: a torch-like snapshot (shared stack frames,
// nested tuples, sets, bytes, a big int) pickled by CPython with protocols 0-5.
func snapshots(t testing.TB) map[string][]byte {
	paths, err := filepath.Glob("testdata/*.pickle")
	require.NoError(t, err)
	require.Len(t, paths, 6)
	out := map[string][]byte{}
	for _, p := range paths {
		data, err := os.ReadFile(p)
		require.NoError(t, err)
		out[filepath.Base(p)] = data
	}
	return out
}

func scanErr(t *testing.T, data []byte) *Error {
	t.Helper()
	err := Scan(data, 100)
	require.Error(t, err)
	var e *Error
	require.True(t, errors.As(err, &e), "%T", err)
	return e
}

func TestRealPicklesPass(t *testing.T) {
	for name, data := range snapshots(t) {
		assert.NoError(t, Scan(data, 100), name)
		// Anything after STOP is not read.
		assert.NoError(t, Scan(append(bytes.Clone(data), 0xff, 0x00), 100), name)
	}
}

func TestEveryCutOfARealPickleIsTruncated(t *testing.T) {
	data := snapshots(t)["snapshot-p4.pickle"]
	for n := 0; n < len(data); n++ {
		e := scanErr(t, data[:n])
		assert.True(t, e.Truncated, "cut at %d: %v", n, e)
		assert.LessOrEqual(t, e.Pos, int64(n), "cut at %d", n)
		assert.Contains(t, e.Error(), "not a readable pickle: truncated")
	}
}

func TestTruncatedPositions(t *testing.T) {
	// Ends before an opcode: the data's length, opcodes read so far.
	e := scanErr(t, []byte("\x80\x04N"))
	assert.Equal(t, Error{Truncated: true, Ops: 2, Pos: 3}, *e)
	// A length beyond the data: just after the opcode's byte.
	e = scanErr(t, []byte("\x80\x04\x8c\xff"))
	assert.Equal(t, Error{Truncated: true, Ops: 2, Pos: 3}, *e)
	assert.Equal(t, "not a readable pickle: truncated (opcode 2 at byte 3)", e.Error())
	// An 8-byte length near 2^64 does not wrap around.
	e = scanErr(t, []byte("\x8d\xf8\xff\xff\xff\xff\xff\xff\xffabc."))
	assert.True(t, e.Truncated)
	assert.Equal(t, int64(1), e.Pos)
	// A text argument without its newline.
	assert.True(t, scanErr(t, []byte("I12")).Truncated)
	assert.True(t, scanErr(t, []byte("g12")).Truncated)
	assert.True(t, scanErr(t, []byte("p12")).Truncated)
}

func TestMemoIndexBombsAreRefused(t *testing.T) {
	for _, tc := range []struct{ data, why string }{
		{"\x80\x04}r\x40\x42\x0f\x00.", "memo index 1000000 with only 3 opcodes before it"},
		{"\x80\x04}p1000000\n.", "memo index 1000000 with only 3 opcodes before it"},
		{"}p000099999999999999999999\n.", "a PUT index that is not a small decimal number"},
		{"}p99999999999999999999\n.", "memo index 99999999999999999999 with only 2 opcodes before it"},
		{"}p00000000000000000009\n.", "memo index 9 with only 2 opcodes before it"},
		{"}p-1\n.", "a PUT index that is not a small decimal number"},
		{"}p\n.", "a PUT index that is not a small decimal number"},
		{"}q\x05.", "memo index 5 with only 2 opcodes before it"},
		// A LONG_BINPUT cut short reads the bytes there are, as Python does.
		{"}r\x09", "memo index 9 with only 2 opcodes before it"},
	} {
		e := scanErr(t, []byte(tc.data))
		assert.False(t, e.Truncated, "%q", tc.data)
		assert.Equal(t, tc.why, e.Why, "%q", tc.data)
	}
	// Indexes up to the opcode count are fine, however sparse.
	assert.NoError(t, Scan([]byte("}N]q\x03h\x03j\x03\x00\x00\x00p2\ng2\n0000."), 100))
}

func TestDeepTuplesAreRefused(t *testing.T) {
	deep := "\x80\x02}" + ")" + strings.Repeat("\x85", 1000) + "Ns."
	e := scanErr(t, []byte(deep))
	assert.Equal(t, "tuples nested deeper than 100", e.Why)
	assert.Equal(t, int64(3+100), e.Ops) // PROTO, EMPTY_DICT, EMPTY_TUPLE, then TUPLE1 number 100 nests 101 deep
	assert.NoError(t, Scan([]byte("\x80\x02)"+strings.Repeat("\x85", 99)+"."), 100))
	// Through the memo: each TUPLE1 wraps the newest memo entry.
	var viaMemo strings.Builder
	viaMemo.WriteString(")\x94")
	for i := 0; i < 60; i++ {
		viaMemo.WriteString("h" + string(rune(i)) + "\x85\x94")
	}
	viaMemo.WriteString(".")
	assert.NoError(t, Scan([]byte(viaMemo.String()), 100))
	err := Scan([]byte(viaMemo.String()), 50)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "tuples nested deeper than 50")
	// DUP copies the nesting too.
	assert.Contains(t, scanErr(t, []byte(")"+strings.Repeat("2\x85", 100)+".")).Why, "tuples nested deeper than 100")
	marked := strings.Repeat("(", 101) + ")" + strings.Repeat("t", 101) + "."
	assert.Contains(t, scanErr(t, []byte(marked)).Why, "tuples nested deeper than 100")
	// Lists do not count: only tuples are hashed recursively.
	assert.NoError(t, Scan([]byte(strings.Repeat("]", 500)+strings.Repeat("a", 499)+"."), 100))
}

func TestUnknownOpcode(t *testing.T) {
	e := scanErr(t, []byte("\x80\x04\x00"))
	assert.Equal(t, Error{Why: "unknown opcode 0x00", Ops: 2, Pos: 3}, *e)
	assert.Equal(t, "refused a crafted or corrupt pickle: unknown opcode 0x00 (opcode 2 at byte 3)", e.Error())
	assert.Equal(t, "unknown opcode 0xff", scanErr(t, []byte{0xff}).Why)
}

func TestCodeOpcodesEndTheScan(t *testing.T) {
	// GLOBAL's lines are not read: the unpickler refuses it first.
	for _, op := range []byte("PQci\x93") {
		assert.NoError(t, Scan([]byte{op}, 100), "%q", op)
	}
}

func TestOpcodesThatCallCodeAreRefused(t *testing.T) {
	for op, name := range map[byte]string{'o': "OBJ", 0x81: "NEWOBJ", 0x92: "NEWOBJ_EX", 'R': "REDUCE", 'b': "BUILD",
		0x82: "EXT1", 0x83: "EXT2", 0x84: "EXT4"} {
		e := scanErr(t, []byte{'N', op})
		assert.Equal(t, name+", an opcode that calls code or builds an object, which plain data never has", e.Why)
		assert.Equal(t, int64(2), e.Pos)
	}
	// Found by review: a BUILD with a None state is a no-op on any object,
	// so what came after it went unscanned: here a tuple 200k deep as a
	// dict key (a crash in CPython), a 2^31 memo index, a cycle.
	for _, tail := range []string{"})" + strings.Repeat("\x85", 200000) + "Ns.", "NJ\x00\x00\x00\x00r\xff\xff\xff\x7f.",
		"]\x94h\x00a."} {
		e := scanErr(t, []byte("\x80\x04]Nb0"+tail))
		assert.True(t, strings.HasPrefix(e.Why, "BUILD, "), e.Why)
	}
}

func TestEveryOpcodeByteIsClassified(t *testing.T) {
	// 68 opcodes in protocols 0-5 (Lib/pickletools.py).
	n := 0
	for _, o := range opcodes {
		if o.act != actUnknown {
			n++
		}
	}
	assert.Equal(t, 68, n)
}

// FuzzScan: never panics, is deterministic, and refuses with a position
// inside the data.
func FuzzScan(f *testing.F) {
	for _, data := range snapshots(f) {
		f.Add(data)
	}
	f.Add([]byte("\x80\x04}r\x40\x42\x0f\x00."))
	f.Add([]byte("(((()ttt."))
	f.Add([]byte("\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00\x8e\x08\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00]2aN."))
	f.Add([]byte("\x80\x04]q\x00N0\x95\x02\x00\x00\x00\x00\x00\x00\x00g10\na."))
	f.Fuzz(func(t *testing.T, data []byte) {
		err := Scan(data, 8)
		again := Scan(data, 8)
		assert.Equal(t, err, again)
		if err == nil {
			return
		}
		var e *Error
		require.True(t, errors.As(err, &e))
		assert.LessOrEqual(t, e.Pos, int64(len(data)))
		assert.LessOrEqual(t, e.Ops, e.Pos)
		assert.Equal(t, e.Truncated, e.Why == "")
		// What was accepted up to the offending opcode (every earlier one
		// ended before its byte) stays accepted when a STOP replaces it.
		if !e.Truncated {
			prefix := append(bytes.Clone(data[:e.Pos-1]), '.')
			assert.NoError(t, Scan(prefix, 8), "prefix %q of %q", prefix, data)
		}
	})
}

func TestShapeOfHandwrittenPickles(t *testing.T) {
	for _, c := range []struct {
		name, data string
		want       Shape
	}{
		{"scalar root", "K\x01.", Shape{Known: true}},
		{"empty list", "].", Shape{Known: true, Nodes: 1, Depth: 1}},
		{"list of 2 ints", "](K\x01K\x02e.", Shape{Known: true, Nodes: 3, Depth: 1}},
		// (x, x) where x = [1, 2, 3]: 1+2 for the tuple, 4 per reference to x.
		{"shared list", "](K\x01K\x02K\x03eq\x00h\x00\x86.", Shape{Known: true, Nodes: 3 + 4 + 4, Depth: 2}},
		{"dup shares too", "](K\x01e2\x86.", Shape{Known: true, Nodes: 3 + 2 + 2, Depth: 2}},
		// {"k": (1, [])}: dict 1+1, tuple 1+2, list 1.
		{"dict, tuple, list", "}(\x8c\x01kK\x01]\x86u.", Shape{Known: true, Nodes: 2 + 3 + 1, Depth: 3}},
		// A key set twice counts twice: an upper bound.
		{"key set twice", "}(\x8c\x01kN\x8c\x01kNu.", Shape{Known: true, Nodes: 3, Depth: 1}},
		{"set and frozenset", "](\x8f(C\x01a\x90(C\x01b\x91e.", Shape{Known: true, Nodes: 3 + 2 + 2, Depth: 2}},
		{"DICT from the mark", "(\x8c\x01k]d.", Shape{Known: true, Nodes: 2 + 1, Depth: 2}},
		{"a list that holds itself", "]q\x00h\x00a.", Shape{}},
		{"calls code", "cbuiltins\nlist\n)R.", Shape{}},
		{"empty stack at STOP", ".", Shape{}},
		{"a missing memo entry", "h\x05.", Shape{}},
		{"odd SETITEMS", "}(\x8c\x01ku.", Shape{}},
		{"APPEND to a scalar", "NK\x01a.", Shape{}},
	} {
		got, err := ScanShape([]byte(c.data), 100)
		require.NoError(t, err, c.name)
		assert.Equal(t, c.want, got, c.name)
	}
}

func TestShapeOfRealPicklesIsKnownFromProtocol4(t *testing.T) {
	for name, data := range snapshots(t) {
		shape, err := ScanShape(data, 100)
		require.NoError(t, err, name)
		// Below protocol 4, sets are rebuilt by calling set(): no bound.
		proto4 := strings.Contains(name, "p4") || strings.Contains(name, "p5")
		assert.Equal(t, proto4, shape.Known, name)
		if proto4 {
			assert.Greater(t, shape.Nodes, uint64(100), name)
			assert.Greater(t, shape.Depth, int64(3), name)
		}
	}
}

func TestShapeSaturates(t *testing.T) {
	// Each level is a list of 64 references to the one below: 64^20 nodes.
	var b strings.Builder
	b.WriteString("]q\x00")
	for i := 0; i < 20; i++ {
		b.WriteString("(" + strings.Repeat("h\x00", 64) + "lq\x00")
	}
	b.WriteString(".")
	shape, err := ScanShape([]byte(b.String()), 100)
	require.NoError(t, err)
	assert.Equal(t, Shape{Known: true, Nodes: math.MaxUint64, Depth: 21}, shape)
}

// BenchmarkScan: a synthetic torch snapshot from GMP_BENCH_PICKLE (e.g. one
// benchmarks/cpu_bench.py's synthetic_snapshot wrote), else the test data.
func BenchmarkScan(b *testing.B) {
	data := snapshots(b)["snapshot-p4.pickle"]
	if p := os.Getenv("GMP_BENCH_PICKLE"); p != "" {
		var err error
		data, err = os.ReadFile(p)
		require.NoError(b, err)
	}
	b.SetBytes(int64(len(data)))
	for i := 0; i < b.N; i++ {
		if _, err := ScanShape(data, 100); err != nil {
			b.Fatal(err)
		}
	}
}

func TestReadsAcrossAFramesEndAreRefused(t *testing.T) {
	frame := func(n byte) string { return "\x95" + string([]byte{n, 0, 0, 0, 0, 0, 0, 0}) }
	for _, c := range []struct{ name, data, why string }{
		{"a 4-byte argument cut", "\x80\x04" + frame(4) + "J\x01\x02\x03\x04N.", "an argument that runs past the end of its frame"},
		{"a length cut", "\x80\x04" + frame(3) + "B\x02\x00\x00\x00abN.", "an argument that runs past the end of its frame"},
		{"data cut", "\x80\x04" + frame(6) + "B\x02\x00\x00\x00abN.", "an argument that runs past the end of its frame"},
		{"a line cut", "\x80\x04N" + frame(2) + "g10\n.", "an argument that runs past the end of its frame"},
		{"FRAME's own length cut", "\x80\x04" + frame(4) + frame(0) + ".", "an argument that runs past the end of its frame"},
		{"a frame past its frame", "\x80\x04" + frame(10) + frame(9) + "N.", "a frame that runs past the end of the frame it is in"},
	} {
		e := scanErr(t, []byte(c.data))
		assert.Equal(t, c.why, e.Why, c.name)
	}
	for _, ok := range []string{
		"\x80\x04" + frame(5) + "J\x01\x02\x03\x04N.",  // ends at the frame's end
		"\x80\x04" + frame(1) + "C\x02ab.",             // a length in the frame, its data after it
		"\x80\x04" + frame(5) + "B\x02\x00\x00\x00ab.", // the same, 4-byte length
		"\x80\x04" + frame(20) + frame(3) + "NNN.",     // a frame inside a frame: C reads on
		"\x80\x04" + frame(9) + frame(2) + "NN" + "N.", // a frame right after one
	} {
		assert.NoError(t, Scan([]byte(ok), 100), "%q", ok)
	}
}

func TestAGetIndexInAnotherFormIsRefused(t *testing.T) {
	// PyLong_FromString, which the C unpickler parses it with, takes these.
	for _, form := range []string{" 0", "+0", "0_0", "0 ", "-1", ""} {
		e := scanErr(t, []byte("Np0\ng"+form+"\n."))
		assert.Equal(t, "a GET index that is not a small decimal number", e.Why, "%q", form)
	}
	assert.NoError(t, Scan([]byte("Np0\ng00\n."), 100))
}

func TestContainersOverTheMemoryBudgetAreRefused(t *testing.T) {
	// 216 bytes a set: set number 1,242,757 takes the total over 256 MiB.
	fits := MinUnpickledBytes / 216
	data := []byte("\x80\x04(" + strings.Repeat("\x8f", fits) + "l.")
	require.NoError(t, Scan(data, 100))
	data = []byte("\x80\x04(" + strings.Repeat("\x8f", fits+1) + "l.")
	e := scanErr(t, data)
	assert.Equal(t, "containers that would take over 268435456 bytes to unpickle (64 per byte of pickle, 256 MiB at least)", e.Why)
	assert.Equal(t, int64(fits+1+2), e.Ops)
	// Past 4 MiB of pickle the budget is 64 bytes per byte: 2M sets (432 MB)
	// fit in 8 MiB of pickle (512 MiB).
	big := []byte("\x80\x04(" + strings.Repeat("\x8f", 2_000_000) + "l")
	for len(big) < 8<<20 {
		big = append(big, "K\x010"...) // a small int, popped
	}
	big = append(big, '.')
	require.NoError(t, Scan(big, 100))
}

// TestScanMemoryIsASmallMultipleOfTheData: found by review, the container
// graph made the scan take ~60 bytes per byte of pickle on these (RSS, 128
// allocated; the scan without a graph took ~18, the unpickler ~8 on the
// first). Now ~22 (RSS). Allocated bytes count every slice the stacks grew
// out of (Go grows big slices by 1.25x, so about 5x what they end with), and
// they do not depend on when the GC runs.
func TestScanMemoryIsASmallMultipleOfTheData(t *testing.T) {
	const n = 4 << 20
	for name, data := range map[string][]byte{
		"empty tuples":   []byte("\x80\x04" + strings.Repeat(")", n) + "."),
		"empty lists":    []byte("\x80\x04" + strings.Repeat("]", n) + "."),
		"one list, dups": []byte("\x80\x04](" + strings.Repeat("2", n) + "e."),
		"tuples in list": []byte("\x80\x04(" + strings.Repeat(")", n) + "l."),
	} {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		_, err := ScanShape(data, 100)
		runtime.ReadMemStats(&after)
		require.NoError(t, err, name)
		perByte := float64(after.TotalAlloc-before.TotalAlloc) / float64(len(data))
		t.Logf("%s: %.1f bytes allocated per byte", name, perByte)
		assert.Less(t, perByte, 80.0, name)
	}
}

func TestTuplesTooCostlyToHashAreRefused(t *testing.T) {
	// Found by review: t = (t, t) forty times over () is an 87-byte dict key
	// that CPython hashes in 2^41 steps (hours). Level k takes 2^(k+1)-1.
	deep := func(levels int) []byte {
		return []byte("\x80\x04})" + strings.Repeat("2\x86", levels) + "Ns.")
	}
	// (As a dict key any tuple is refused now, see TestKeysWhoseHashAPickleCanChoose;
	// the work is counted where the tuple is built, before it is used.)
	require.NoError(t, Scan([]byte("\x80\x04])"+strings.Repeat("2\x86", 19)+"a."), 100))
	e := scanErr(t, deep(20))
	assert.Equal(t, "a tuple that would take over 1048576 steps to hash (shared references inside it)", e.Why)
	assert.Equal(t, int64(3+2*20), e.Ops)
	e = scanErr(t, deep(40))
	assert.Equal(t, int64(3+2*20), e.Ops) // refused at the same tuple, long before the key is hashed
	// Through the memo as through DUP, and the saturated count stays refused.
	viaMemo := "\x80\x04})q\x00" + strings.Repeat("h\x00h\x00\x86q\x00", 70) + "Ns."
	assert.Equal(t, e.Why, scanErr(t, []byte(viaMemo)).Why)
}

func TestKeysThatAreNotStrOrBytesAreRefused(t *testing.T) {
	why := "a dict key or set element that is not a str or bytes (an int, float, tuple or frozenset: their " +
		"hashes are not randomized, so crafted ones make loading take quadratic time)"
	for _, p := range []string{
		"}(\x8a\x08\xff\xff\xff\xff\xff\xff\xff\x1fNu.", // 2^61-1 (hash 0), by SETITEMS
		"}K\x05Ns.",                          // a small int hashes to itself: crafted ones share a probe chain
		"\x8f(J\x01\x02\x03\x04\x90.",        // in a set
		"}I01\nNs.",                          // even a bool given as text
		"}G?\xf8\x00\x00\x00\x00\x00\x00Ns.", // a float
		"}F1.5\nNs.",
		"}K\x01K\x02\x86Ns.",           // a tuple
		"}(C\x01a\x91Ns.",              // a frozenset
		"((C\x01aC\x01b\x86\x91.",      // a tuple in a frozenset
		"((K\x01K\x02\x86Nd.",          // a tuple key by DICT
		"}K\x01K\x02\x86q\x00h\x00Ns.", // through the memo
	} {
		assert.Equal(t, why, scanErr(t, []byte(p)).Why, "%q", p)
	}
	for _, p := range []string{
		"}(\x8c\x01kNX\x01\x00\x00\x00jNC\x01bNN\x88\x88Nu.", // str, bytes, None, True
		"}(\x8c\x01kK\x05\x8c\x01lI123\nu.",                  // ints as values
		"](K\x01K\x02\x86G?\xf8\x00\x00\x00\x00\x00\x00e.",   // tuples and floats as values
		"\x8f(\x8c\x01aC\x01bN\x88\x90.",                     // str, bytes, None, True in a set
	} {
		assert.NoError(t, Scan([]byte(p), 100), "%q", p)
	}
}
