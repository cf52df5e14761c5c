// Package picklescan checks a pickle's opcodes before Python unpickles it.
//
// gpumempool loads memory snapshots that may come from anyone (issue 5: "such
// a pickle may come from anyone"). Python's restricted unpickler refuses every
// global, so no code runs; what it cannot refuse is a pickle that makes the
// unpickler itself use far more memory or stack than the pickle's size:
//
//   - a memo index far beyond the number of opcodes: the C unpickler sizes its
//     memo by the largest index, so 9 bytes can ask for gigabytes;
//   - a counted length beyond the data;
//   - tuples nested deeper than a limit: hashing a dict key or set element
//     recurses in C through nested tuples, and a deep enough one crashes the
//     interpreter;
//   - containers whose empty shells alone would take more memory than
//     UnpickledBytesPerByte times the data (MinUnpickledBytes at least): an
//     EMPTY_SET is one byte of pickle and 216 bytes of set;
//   - an argument that starts inside a FRAME and ends past it. The loader
//     unpickles from a file object, and there the C unpickler keeps a frame in
//     a buffer: a read that does not fit in what is left of it drops the rest
//     and reads on from the file (_Unpickler_Read, _Unpickler_Readline), so
//     the unpickler would run other opcodes than the ones scanned. Pickle
//     never writes such frames.
//
// Scan walks the opcodes without running them and refuses those. It models the
// unpickler's stack only as far as the nesting of tuples goes. Opcodes that
// import or call code end the scan: the unpickler refuses them when it gets
// there, before anything after them.
//
// It is gpumempool's only pickle scanner (gpumempool/_safepickle.py calls it
// through the C ABI, bindings/cabi/pickle.go): a Python twin scanned about
// 20x slower and could not bound the shape, so it was dropped.
//
// ScanShape also bounds the shape of what the pickle builds (see Shape), so
// that the loader can skip its walk over the unpickled objects.
package picklescan

import (
	"fmt"
	"math"
	"strings"
)

// Error says why Scan refused a pickle.
type Error struct {
	// Truncated is true when the data ends inside an opcode or its argument,
	// or before a STOP; Why is then empty.
	Truncated bool
	// Why the pickle was refused, when it is not truncated.
	Why string
	// Ops is the number of opcodes read, the offending one included.
	Ops int64
	// Pos is the offset just after the offending opcode's byte (the data's
	// length when it ended before an opcode).
	Pos int64
}

// Error formats e as gpumempool's loader words it, without the file name.
func (e *Error) Error() string {
	if e.Truncated {
		return fmt.Sprintf("not a readable pickle: truncated (opcode %d at byte %d)", e.Ops, e.Pos)
	}
	return fmt.Sprintf("refused a crafted or corrupt pickle: %s (opcode %d at byte %d)", e.Why, e.Ops, e.Pos)
}

// argKind is how an opcode's argument is laid out.
type argKind int8

const (
	argNone     argKind = iota // no argument (also: not an opcode, see action)
	argFixed                   // argN[op] bytes
	argLen1                    // a 1-byte length, then that many bytes
	argLen4                    // a 4-byte little-endian length, then the data
	argLen8                    // an 8-byte little-endian length, then the data
	argLine                    // text up to and including a newline
	argTwoLines                // two such lines (GLOBAL, INST)
)

// action is what Scan does for an opcode.
type action int8

const (
	actUnknown    action = iota // not an opcode of protocols 0-5
	actStop                     // STOP: the scan is done
	actCode                     // imports code: the unpickler refuses it, the scan ends here
	actCall                     // calls code or builds an object: refused
	actSkip                     // no effect on the modelled stack
	actScalar                   // pushes a scalar or an empty container
	actMemoize                  // MEMOIZE
	actBinGet                   // BINGET
	actLongBinGet               // LONG_BINGET
	actGet                      // GET (text index)
	actBinPut                   // BINPUT
	actLongBinPut               // LONG_BINPUT
	actPut                      // PUT (text index)
	actAppend                   // APPEND: pops one
	actSetItem                  // SETITEM: pops two
	actToMark                   // APPENDS, SETITEMS, ADDITEMS: pop to the mark
	actMark                     // MARK
	actPop                      // POP
	actPopMark                  // POP_MARK
	actFromMark                 // LIST, DICT, FROZENSET: items from the mark, one pushed
	actEmptyTuple               // EMPTY_TUPLE
	actTuple                    // TUPLE: a tuple of the items since the mark
	actTupleN                   // TUPLE1..3
	actDup                      // DUP
)

type opcode struct {
	act  action
	arg  argKind
	size int8 // bytes of an argFixed argument
}

// opcodes is the table of pickle's opcodes (Lib/pickletools.py), by byte.
var opcodes = func() (t [256]opcode) {
	set := func(codes string, act action, arg argKind, size int8) {
		for i := 0; i < len(codes); i++ {
			t[codes[i]] = opcode{act, arg, size}
		}
	}
	set("N\x88\x89\x97]}\x8f", actScalar, argNone, 0) // NONE, NEWTRUE, NEWFALSE, NEXT_BUFFER, EMPTY_LIST/DICT/SET
	set("K", actScalar, argFixed, 1)                  // BININT1
	set("M", actScalar, argFixed, 2)                  // BININT2
	set("J", actScalar, argFixed, 4)                  // BININT
	set("G", actScalar, argFixed, 8)                  // BINFLOAT
	set("UC\x8a\x8c", actScalar, argLen1, 0)          // SHORT_BINSTRING, SHORT_BINBYTES, LONG1, SHORT_BINUNICODE
	set("TBX\x8b", actScalar, argLen4, 0)             // BINSTRING, BINBYTES, BINUNICODE, LONG4
	set("\x8d\x8e\x96", actScalar, argLen8, 0)        // BINUNICODE8, BINBYTES8, BYTEARRAY8
	set("ILSVF", actScalar, argLine, 0)               // INT, LONG, STRING, UNICODE, FLOAT
	set("\x94", actMemoize, argNone, 0)
	set("h", actBinGet, argFixed, 1)
	set("j", actLongBinGet, argFixed, 4)
	set("g", actGet, argLine, 0)
	set("q", actBinPut, argFixed, 1)
	set("r", actLongBinPut, argFixed, 4)
	set("p", actPut, argLine, 0)
	set("\x80", actSkip, argFixed, 1) // PROTO
	set("\x95", actSkip, argFixed, 8) // FRAME
	set("\x98", actSkip, argNone, 0)  // READONLY_BUFFER
	set("a", actAppend, argNone, 0)
	set("s", actSetItem, argNone, 0)
	set("eu\x90", actToMark, argNone, 0)
	set("(", actMark, argNone, 0)
	set("0", actPop, argNone, 0)
	set("1", actPopMark, argNone, 0)
	set("ld\x91", actFromMark, argNone, 0)
	set(")", actEmptyTuple, argNone, 0)
	set("t", actTuple, argNone, 0)
	set("\x85\x86\x87", actTupleN, argNone, 0)
	set("2", actDup, argNone, 0)
	set(".", actStop, argNone, 0)
	// PERSID, BINPERSID, GLOBAL, INST, STACK_GLOBAL: the loader's unpickler
	// refuses them (persistent_load, find_class) when it gets there, before
	// anything after them. Their arguments are never read.
	set("PQci\x93", actCode, argNone, 0)
	// OBJ, NEWOBJ, NEWOBJ_EX, REDUCE, BUILD, EXT1/2/4 do not all fail: BUILD
	// with a None state is a no-op on any object, and EXT pushes what
	// copyreg's extension cache holds without find_class. Plain data never
	// has them.
	set("o\x81\x92Rb\x82\x83\x84", actCall, argNone, 0)
	return t
}()

// The memory budget of the containers a pickle builds: real snapshots build
// a container per 20-50 bytes of pickle (a few bytes of containers per byte),
// a crafted one a set per byte (216).
const (
	MinUnpickledBytes     = 256 << 20
	UnpickledBytesPerByte = 64
)

// containerBytes is what CPython (3.11, 3.12; 64-bit) allocates for the empty
// container an opcode builds (sys.getsizeof); 0 for other opcodes and the
// empty tuple, a singleton.
func containerBytes(op byte) uint64 {
	switch op {
	case ']', 'l': // EMPTY_LIST, LIST
		return 56
	case '}', 'd': // EMPTY_DICT, DICT
		return 64
	case 0x8f, 0x91: // EMPTY_SET, FROZENSET
		return 216
	case 't', 0x85, 0x86, 0x87: // TUPLE, TUPLE1..3
		return 40
	}
	return 0
}

// callNames names the actCall opcodes (Lib/pickletools.py).
var callNames = map[byte]string{'o': "OBJ", 0x81: "NEWOBJ", 0x92: "NEWOBJ_EX", 'R': "REDUCE", 'b': "BUILD",
	0x82: "EXT1", 0x83: "EXT2", 0x84: "EXT4"}

// scanner holds the state of one Scan.
type scanner struct {
	data      []byte
	stack     []item  // what the scan knows of each stack item (see item)
	nodes     []int32 // the container of each stack item (noNode: not one)
	marks     []int
	memo      []item  // 1 + the item of each memo entry; 0: no entry
	memoNodes []int32 // the container of each memo entry
	nmemo     int     // number of memo entries (len of Python's memo dict)
	ops       int64
	pos       int    // just after the current opcode's byte
	depth     int32  // the nesting limit
	hashWork  uint64 // the most work hashing one tuple may take
	frameEnd  uint64 // the end of the last frame (the C unpickler's buffer)
	built     uint64 // bytes of the containers built so far (containerBytes)
	budget    uint64 // the most they may take
	g         graph
	shape     Shape // set at STOP
}

// Scan walks data's opcodes and returns nil when unpickling it costs memory
// and stack in proportion to its size, else an *Error. Tuples may nest at most
// maxDepth deep; a maxDepth outside [0, 2^30] is taken as the nearest bound
// (gpumempool._fastcall refuses such values before they get here).
func Scan(data []byte, maxDepth int) error {
	_, err := ScanShape(data, maxDepth)
	return err
}

// ScanShape is Scan that also returns a bound on the shape of what the pickle
// builds, for a pickle it accepts (an unknown Shape otherwise).
func ScanShape(data []byte, maxDepth int) (Shape, error) {
	if maxDepth < 0 {
		maxDepth = 0
	}
	if maxDepth > 1<<30 {
		maxDepth = 1 << 30
	}
	s := scanner{data: data, depth: int32(maxDepth), budget: max(MinUnpickledBytes, UnpickledBytesPerByte*uint64(len(data))),
		hashWork: max(MinHashWork, uint64(len(data)))}
	s.g.limit = len(data)/4 + 1024
	if err := s.run(); err != nil {
		return Shape{}, err
	}
	return s.shape, nil
}

func (s *scanner) truncated() error {
	return &Error{Truncated: true, Ops: s.ops, Pos: int64(s.pos)}
}

func (s *scanner) refuse(format string, args ...any) error {
	return &Error{Why: fmt.Sprintf(format, args...), Ops: s.ops, Pos: int64(s.pos)}
}

// item packs what the scan knows of a stack item: for a tuple its nesting
// (low 31 bits; 0: not a tuple) and the work of hashing it (high 32 bits,
// saturating): 1 + the work of each element, where an element that is not a
// tuple costs 1. A tuple made of references to one tuple, n times over, is
// 2^n work at nesting n: CPython does not cache a tuple's hash, and hashing
// one as a dict key or set element walks every reference. Bit 31 is
// fixedHash, for any item.
type item uint64

func tupleItem(nesting int32, work uint64) item {
	return item(min(work, math.MaxUint32))<<32 | fixedHash | item(uint32(nesting))
}

// fixedHash (bit 31 of an item) marks a value whose hash CPython does not
// randomize, so that a pickle can choose it: anything but str, bytes, None
// and the two bools (ints, floats, tuples, frozensets). As dict keys or set
// elements such values can be made to share one hash (ints and floats
// modulo 2^61-1; tuples and frozensets through their elements'), or, small
// ints hashing to themselves, to walk one long probe chain of the dict's
// table: each insertion then costs as many steps as there are keys (60,000
// keys took 43 s; 85,000 small ints, 6 s). Strings and bytes hash with a
// random key. Snapshots key by str.
const fixedHash item = 1 << 31

func (v item) nesting() int32 { return int32(uint32(v &^ fixedHash)) }

// work is the work of hashing v as an element: 1 unless it is a tuple.
func (v item) work() uint64 { return max(1, uint64(v>>32)) }

// MinHashWork is the least work hashing a tuple may take before the scan
// refuses it; past that, one step per byte of pickle. The loader's walk
// would refuse such a tuple too, but only after the unpickler hashed it.
const MinHashWork = 1 << 20

// push pushes an item v that is the container node. Once
// the shape model is given up, nodes and memoNodes are not kept.
func (s *scanner) push(v item, node int32) {
	s.stack = append(s.stack, v)
	if !s.g.broken {
		s.nodes = append(s.nodes, node)
	}
}

func (s *scanner) top() item {
	if n := len(s.stack); n > 0 {
		return s.stack[n-1]
	}
	return 0
}

// topNode is the container of the top item; an empty stack, which the
// unpickler refuses, breaks the shape model.
func (s *scanner) topNode() int32 {
	if s.g.broken {
		return noNode
	}
	if n := len(s.nodes); n > 0 {
		return s.nodes[n-1]
	}
	s.g.drop()
	return noNode
}

// cut drops the stack items from index lo on (none when lo is past the top).
func (s *scanner) cut(lo int) {
	if lo < len(s.stack) {
		s.stack = s.stack[:lo]
	}
	if lo < len(s.nodes) {
		s.nodes = s.nodes[:lo]
	}
}

func (s *scanner) popMark() (int, bool) {
	n := len(s.marks)
	if n == 0 {
		return 0, false
	}
	m := s.marks[n-1]
	s.marks = s.marks[:n-1]
	return m, true
}

// memoPush pushes memo entry k (a missing one, which the unpickler refuses,
// breaks the shape model).
func (s *scanner) memoPush(k uint64) {
	if k < uint64(len(s.memo)) {
		if v := s.memo[k]; v > 0 {
			node := noNode
			if !s.g.broken {
				node = s.memoNodes[k]
			}
			s.push(v-1, node)
			return
		}
	}
	s.g.drop()
	s.push(0, noNode)
}

// memoSet stores v at k; k is at most the number of opcodes read (checked by
// the callers), so the memo stays within the data's size.
func (s *scanner) memoSet(k int, v item, node int32) {
	s.memo = grow(s.memo, k)
	if s.memo[k] == 0 {
		s.nmemo++
	}
	s.memo[k] = v + 1
	if !s.g.broken {
		s.memoNodes = grow(s.memoNodes, k)
		s.memoNodes[k] = node
	}
}

// grow returns a with an index k.
func grow[T any](a []T, k int) []T {
	if k < len(a) {
		return a
	}
	if k < cap(a) {
		return a[:k+1]
	}
	grown := make([]T, k+1, 2*k+16)
	copy(grown, a)
	return grown
}

// le reads up to n little-endian bytes at p, as many as there are (Python's
// int.from_bytes of a slice that the end of the data may cut short).
func (s *scanner) le(p, n int) uint64 {
	var v uint64
	for i := n - 1; i >= 0; i-- {
		if p+i < len(s.data) {
			v = v<<8 | uint64(s.data[p+i])
		} else {
			v <<= 8
		}
	}
	return v
}

// line returns the bytes from p up to the next newline and the offset just
// past it, or ok=false when there is no newline.
func (s *scanner) line(p int) (text []byte, next int, ok bool) {
	for i := p; i < len(s.data); i++ {
		if s.data[i] == '\n' {
			return s.data[p:i], i + 1, true
		}
	}
	return nil, 0, false
}

// decimal parses text of at most 20 ASCII digits; small reports whether it is
// such a text, fits reports whether its value fits in a uint64.
func decimal(text []byte) (v uint64, small, fits bool) {
	if len(text) == 0 || len(text) > 20 {
		return 0, false, false
	}
	fits = true
	for _, c := range text {
		if c < '0' || c > '9' {
			return 0, false, false
		}
		d := uint64(c - '0')
		if v > (^uint64(0)-d)/10 {
			fits = false
		}
		v = v*10 + d
	}
	return v, true, fits
}

// end returns the offset after the argument of op, which starts at s.pos, or
// ok=false when it runs past the data.
func (s *scanner) end(o opcode) (int, bool) {
	p, n := s.pos, len(s.data)
	switch o.arg {
	case argFixed:
		return p + int(o.size), p+int(o.size) <= n
	case argLen1:
		if p >= n {
			return 0, false
		}
		e := p + 1 + int(s.data[p])
		return e, e <= n
	case argLen4, argLen8:
		w := 4
		if o.arg == argLen8 {
			w = 8
		}
		if p+w > n {
			return 0, false
		}
		l := s.le(p, w)
		if l > uint64(n-p-w) {
			return 0, false
		}
		return p + w + int(l), true
	case argLine:
		_, e, ok := s.line(p)
		return e, ok
	case argTwoLines:
		if _, e, ok := s.line(p); ok {
			_, e, ok = s.line(e)
			return e, ok
		}
		return 0, false
	}
	return p, true
}

func (s *scanner) run() error {
	data := s.data
	for {
		if s.pos >= len(data) {
			return s.truncated()
		}
		op := data[s.pos]
		s.pos++
		s.ops++
		o := opcodes[op]
		switch o.act {
		case actUnknown:
			return s.refuse("unknown opcode 0x%02x", op)
		case actStop:
			s.shape = s.g.shape(s.topNode())
			return nil
		case actCode:
			return nil // Shape unknown
		case actCall:
			return s.refuse("%s, an opcode that calls code or builds an object, which plain data never has", callNames[op])
		case actScalar:
			node := noNode
			if op == ']' || op == '}' || op == 0x8f { // EMPTY_LIST, EMPTY_DICT, EMPTY_SET
				node = s.g.container(0)
			}
			s.push(scalar(op), node)
		case actMemoize:
			s.memoSet(s.nmemo, s.top(), s.topNode())
		case actBinGet:
			if s.pos >= len(data) {
				return s.truncated()
			}
			s.memoPush(uint64(data[s.pos]))
		case actLongBinGet:
			s.memoPush(s.le(s.pos, 4))
		case actGet:
			text, _, ok := s.line(s.pos)
			if !ok {
				return s.truncated()
			}
			// The C unpickler parses the index with PyLong_FromString, which
			// also takes " 5", "+5" and "0_5": a GET in such a form would
			// fetch a tuple whose nesting the scan did not see. Pickle writes
			// plain decimals.
			v, small, fits := decimal(text)
			if !small {
				return s.refuse("a GET index that is not a small decimal number")
			}
			if fits {
				s.memoPush(v)
			} else { // a miss in the C unpickler's memo: it fails
				s.g.drop()
				s.push(0, noNode)
			}
		case actBinPut, actLongBinPut, actPut:
			if err := s.put(o.act); err != nil {
				return err
			}
		case actAppend:
			s.insertTop(1) // the item, into the container below it
		case actSetItem:
			if n := len(s.stack); n >= 2 && s.stack[n-2]&fixedHash != 0 {
				return s.refuse(fixedHashKey)
			}
			s.insertTop(2) // a key and a value
		case actToMark:
			if m, ok := s.popMark(); ok {
				if err := s.checkKeys(op, m); err != nil {
					return err
				}
				s.insertToMark(op, m)
				s.cut(m)
			} else {
				s.g.drop()
			}
		case actMark:
			s.marks = append(s.marks, len(s.stack))
		case actPop:
			if n := len(s.marks); n > 0 && s.marks[n-1] == len(s.stack) {
				s.marks = s.marks[:n-1]
			} else if n := len(s.stack); n > 0 {
				s.cut(n - 1)
			} else {
				s.g.drop()
			}
		case actPopMark:
			if m, ok := s.popMark(); ok {
				s.cut(m)
			} else {
				s.g.drop()
			}
		case actFromMark:
			node := noNode
			if m, ok := s.popMark(); ok {
				if err := s.checkKeys(op, m); err != nil {
					return err
				}
				node = s.fromMark(op, m)
				s.cut(m)
			} else {
				s.g.drop()
			}
			var v item
			if op == 0x91 { // FROZENSET: its hash comes from its elements'
				v = fixedHash
			}
			s.push(v, node)
		case actEmptyTuple:
			s.push(tupleItem(1, 1), s.g.empty())
		case actTuple, actTupleN:
			var lo int
			if o.act == actTuple {
				m, ok := s.popMark()
				if !ok {
					m = len(s.stack)
					s.g.drop()
				}
				lo = m
			} else {
				want := int(op - 0x84)
				if len(s.stack) < want {
					s.g.drop()
				}
				lo = max(0, len(s.stack)-want)
			}
			var depth int32
			work := uint64(1)
			for i := lo; i < len(s.stack); i++ {
				depth = max(depth, s.stack[i].nesting())
				work = min(work+s.stack[i].work(), math.MaxUint32)
			}
			depth++
			if depth > s.depth {
				return s.refuse("tuples nested deeper than %d", s.depth)
			}
			if work > s.hashWork {
				return s.refuse("a tuple that would take over %d steps to hash (shared references inside it)", s.hashWork)
			}
			if lo > len(s.stack) { // a mark above the stack: the unpickler refuses it
				s.g.drop()
			}
			node := noNode
			if !s.g.broken {
				items := s.nodes[min(lo, len(s.nodes)):]
				node = s.g.container(uint64(len(items)))
				s.g.refer(node, items)
			}
			s.cut(lo)
			s.push(tupleItem(depth, work), node)
		case actDup:
			s.push(s.top(), s.topNode())
		}
		if c := containerBytes(op); c != 0 {
			if s.built += c; s.built > s.budget {
				return s.refuse("containers that would take over %d bytes to unpickle (%d per byte of pickle, %d MiB at least)",
					s.budget, UnpickledBytesPerByte, MinUnpickledBytes>>20)
			}
		}
		next, ok := s.end(o)
		if !ok {
			return s.truncated()
		}
		if err := s.framing(op, o, next); err != nil {
			return err
		}
		if s.g.broken && s.nodes != nil { // no bound now: free the model's stacks
			s.nodes, s.memoNodes = nil, nil
		}
		s.pos = next
	}
}

// framing refuses an argument (from s.pos to next) that starts inside the
// current frame and ends past it, and a FRAME that would make a frame end
// past the one it is in; a FRAME read after the last frame starts the next.
// A length-prefixed argument is two reads: the frame may end between them.
func (s *scanner) framing(op byte, o opcode, next int) error {
	p, q, end := uint64(s.pos), uint64(next), s.frameEnd
	if !(p < end && end < q) { // the argument is not cut by the frame's end
		if op != 0x95 { // FRAME
			return nil
		}
		size := s.le(s.pos, 8)
		frame := q + size
		if frame < q { // beyond any data: the unpickler fails to read it
			frame = ^uint64(0)
		}
		if q >= end {
			s.frameEnd = frame
			return nil
		}
		if frame <= end { // inside the frame: the C unpickler reads on
			return nil
		}
		return s.refuse("a frame that runs past the end of the frame it is in")
	}
	split := p
	switch o.arg {
	case argLen1:
		split = p + 1
	case argLen4:
		split = p + 4
	case argLen8:
		split = p + 8
	}
	if split != p && end == split {
		return nil
	}
	return s.refuse("an argument that runs past the end of its frame")
}

// put handles BINPUT, LONG_BINPUT and PUT: an index beyond the number of
// opcodes read is refused.
func (s *scanner) put(act action) error {
	var k uint64
	switch act {
	case actBinPut:
		if s.pos >= len(s.data) {
			return s.truncated()
		}
		k = uint64(s.data[s.pos])
	case actLongBinPut:
		k = s.le(s.pos, 4)
	default:
		text, _, ok := s.line(s.pos)
		if !ok {
			return s.truncated()
		}
		v, small, fits := decimal(text)
		if !small {
			return s.refuse("a PUT index that is not a small decimal number")
		}
		if !fits {
			return s.refuse("memo index %s with only %d opcodes before it", strings.TrimLeft(string(text), "0"), s.ops)
		}
		k = v
	}
	if k > uint64(s.ops) {
		return s.refuse("memo index %d with only %d opcodes before it", k, s.ops)
	}
	s.memoSet(int(k), s.top(), s.topNode())
	return nil
}

const fixedHashKey = "a dict key or set element that is not a str or bytes (an int, float, tuple or frozenset: " +
	"their hashes are not randomized, so crafted ones make loading take quadratic time)"

// scalar is the item a scalar-pushing opcode pushes: 0 for str, bytes,
// None, the bools and the empty containers, fixedHash for the rest.
func scalar(op byte) item {
	switch op {
	case 'S', 'T', 'U', 'V', 'X', 0x8c, 0x8d, // str
		'B', 'C', 0x8e, 0x96, // bytes, bytearray
		'N', 0x88, 0x89, 0x97, // None, True, False, a buffer
		']', '}', 0x8f: // empty list, dict, set (unhashable)
		return 0
	}
	return fixedHash
}

// checkKeys refuses a fixedHash key among the items from the mark at m on:
// the keys of SETITEMS and DICT, every element of ADDITEMS and FROZENSET.
func (s *scanner) checkKeys(op byte, m int) error {
	step := 0
	switch op {
	case 'u', 'd': // SETITEMS, DICT: key, value pairs
		step = 2
	case 0x90, 0x91: // ADDITEMS, FROZENSET
		step = 1
	}
	for i := m; step > 0 && i < len(s.stack); i += step {
		if s.stack[i]&fixedHash != 0 {
			return s.refuse(fixedHashKey)
		}
	}
	return nil
}

// insertTop models APPEND (k = 1) and SETITEM (k = 2): the top k items go
// into the container below them, as one entry.
func (s *scanner) insertTop(k int) {
	n := len(s.stack)
	switch {
	case n <= k:
		s.g.drop()
	case !s.g.broken:
		s.g.insert(s.nodes[n-k-1], s.nodes[n-k:], 1)
	}
	s.cut(max(0, n-k))
}

// insertToMark models APPENDS, SETITEMS and ADDITEMS: the items from the
// mark at m on go into the container below it.
func (s *scanner) insertToMark(op byte, m int) {
	if s.g.broken {
		return
	}
	if m == 0 || m > len(s.stack) {
		s.g.drop()
		return
	}
	items := s.nodes[m:]
	n := uint64(len(items))
	if op == 'u' { // SETITEMS: key, value pairs
		if n%2 != 0 {
			s.g.drop()
			return
		}
		n /= 2
	}
	s.g.insert(s.nodes[m-1], items, n)
}

// fromMark models LIST, DICT and FROZENSET: a new container of the items
// from the mark at m on; returns its node.
func (s *scanner) fromMark(op byte, m int) int32 {
	if s.g.broken {
		return noNode
	}
	items := s.nodes[min(m, len(s.nodes)):]
	n := uint64(len(items))
	if op == 'd' { // DICT: key, value pairs
		if n%2 != 0 {
			s.g.drop()
			return noNode
		}
		n /= 2
	}
	node := s.g.container(n)
	s.g.refer(node, items)
	return node
}
