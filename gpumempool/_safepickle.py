"""Loading pickles that may come from anyone: plain data only, and nothing
crafted to cost far more than its size.

Torch's memory snapshots are pickles (``torch.cuda.memory._dump_snapshot``),
and users load the ones others send them. :func:`load_pickle` reads them

1. after a scan of the opcodes that runs none of them
   (:func:`_scan_pickle`), refusing huge memo indexes, lengths beyond the
   data and tuples nested deeper than :data:`MAX_PICKLE_DEPTH`;
2. with an unpickler that refuses every global, so that only dict, list,
   tuple, set, str, bytes, int, float, bool and None are built and no
   constructor, function or reducer runs;
3. then walks the result, refusing cycles, deep nesting and shared
   references that multiply the work of whoever walks it.

The unpickler reads from a file object (it takes no bytes directly), and
there the C unpickler keeps each FRAME in a buffer: a read that starts in
the frame but does not fit in what is left of it drops the rest and reads
on from the file (``_Unpickler_Read``, ``_Unpickler_Readline``). A scan
that reads in order would then check other opcodes than the ones that run,
so the scan refuses any argument that straddles a frame's end (and frames
that overrun the frame they are in). Pickle never writes such frames.

The scan runs in Go (``bindings/picklescan``, through
``gpumempool._fastcall``), without the GIL, at several hundred MB/s. The
Python scanner here is its reference: it runs when the C fast path is not
built, and a test checks that the two agree on every input. The Go scan
also bounds the result's size and nesting from the opcodes (an upper bound,
exact for what ``pickle.dumps`` writes); when the bound is within the
limits, step 3 has nothing to find and is skipped, which more than halves
the load time of a snapshot. Tests check the bound against the walk on
tens of thousands of programs.
"""

from __future__ import annotations

import gzip
import io
import itertools
import os
import pickle
import pickletools
import zlib
from typing import Any, Callable, Iterator, Optional, Union

from . import _native

__all__ = ["MAX_PICKLE_BYTES", "MAX_PICKLE_DEPTH", "UnsafePickleError", "load_pickle"]

PathLike = Union[str, "os.PathLike[str]"]


class UnsafePickleError(pickle.UnpicklingError, ValueError):
    """A pickle that holds more than plain data (or is too large, or crafted
    to be costly to load) was refused. A ValueError too, as every bad input
    of :mod:`gpumempool.trace` is."""


#: Default limit on a pickle's size (compressed and uncompressed).
MAX_PICKLE_BYTES = 4 << 30
#: Deepest nesting of containers a loaded pickle may have (torch's snapshots
#: nest 7 deep).
MAX_PICKLE_DEPTH = 100
#: Size budget of a loaded pickle, counting every container once per
#: reference (1 + its length): at least this many, else
#: :data:`PICKLE_NODES_PER_BYTE` per byte of (decompressed) pickle. Shared
#: references make a small pickle decode to a structure that is huge when
#: walked (``[[e] * 1000] * 1000``, or exponentially so); torch's snapshots
#: share their stack frames, which stays far below this.
MIN_PICKLE_NODES = 1 << 20
PICKLE_NODES_PER_BYTE = 64


class _PlainDataUnpickler(pickle.Unpickler):
    """Builds only what pickle's own opcodes build (dict, list, tuple, set,
    frozenset, str, bytes, bytearray, a read-only memoryview of one, int,
    float, bool, None); every global is refused, so no constructor,
    function or reducer can run."""

    def find_class(self, module: str, name: str) -> Any:
        raise UnsafePickleError(
            f"refused to load {module[:100]}.{name[:100]}: a memory snapshot may only contain plain data "
            "(dict, list, tuple, str, int, float, bool, None); this pickle tries to import or call "
            "code, so it is not one (it may be malicious)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError("refused a persistent id: a memory snapshot holds plain data only")


# What the scanner does per opcode (see _scan_pickle). It models the
# unpickler's stack only as far as hashing goes: each item's tuple nesting
# (hashing a dict key or set element recurses in C through nested tuples, and
# a deep enough one crashes the interpreter), the work of hashing it, and
# whether a pickle can choose its hash (_FIXED_HASH).
(_PUSH_FIXED, _PUSH_COUNT1, _MEMOIZE, _BINGET, _SKIP_FIXED, _POP1, _SETITEM, _TO_MARK, _MARK, _SLOW, _FRAME,
 _PUSH_CONTAINER) = range(12)

#: The memory budget of the containers a pickle builds (as bindings/picklescan):
#: real snapshots build a container per 20-50 bytes of pickle, a crafted one
#: a set (216 bytes) per byte.
MIN_UNPICKLED_BYTES = 256 << 20
UNPICKLED_BYTES_PER_BYTE = 64
#: The most work hashing one tuple may take (1 + each element's, a tuple
#: element its own): at least this, else one step per byte of pickle. CPython
#: does not cache a tuple's hash, so a tuple of references to one tuple, n
#: times over, takes 2**n steps to hash as a dict key (as bindings/picklescan).
MIN_HASH_WORK = 1 << 20
#: Bit 31 of a stack item: a value whose hash CPython does not randomize, so
#: that a pickle can choose it (anything but str, bytes, None and the bools):
#: refused as a dict key or set element, where crafted ones collide or walk
#: one probe chain and loading takes quadratic time (see scan.go).
_FIXED_HASH = 1 << 31
_FIXED_HASH_KEY = ("a dict key or set element that is not a str or bytes (an int, float, tuple or frozenset: their "
                   "hashes are not randomized, so crafted ones make loading take quadratic time)")
#: The stack item each scalar-pushing opcode pushes (as scan.go's scalar).
_SCALAR_ITEM = [_FIXED_HASH] * 256
for _c in b"STUVX\x8c\x8dBC\x8e\x96N\x88\x89\x97]}\x8f":
    _SCALAR_ITEM[_c] = 0
#: What CPython allocates for the empty container an opcode builds (3.11,
#: 3.12, 64-bit; sys.getsizeof): lists, dicts, sets and frozensets, tuples.
_CONTAINER_BYTES = [0] * 256
for _ops, _size in ((b"]l", 56), (b"}d", 64), (b"\x8f\x91", 216), (b"t\x85\x86\x87", 40)):
    for _c in _ops:
        _CONTAINER_BYTES[_c] = _size


#: Opcodes that push a scalar or an empty container (no tuple nesting).
_SCALAR_PUSHES = b"IJKMLSTUBCVXFGN\x88\x89\x8a\x8b\x8c\x8d\x8e\x96\x97]}\x8f"


def _opcode_tables() -> tuple[list[int], list[int]]:
    """(action, argument) per opcode byte. Argument: n >= 0 fixed bytes; -1,
    -4, -8: a length of that many bytes, then the data; -10: up to a
    newline; -20: two lines (GLOBAL, INST); -99: not an opcode."""
    arg = [-99] * 256
    for op in pickletools.opcodes:
        code, a = ord(op.code), op.arg
        if a is None:
            arg[code] = 0
        elif a.n >= 0:
            arg[code] = a.n
        elif a.n == pickletools.UP_TO_NEWLINE:
            arg[code] = -10
        elif a.n == pickletools.TAKEN_FROM_ARGUMENT1:
            arg[code] = -1
        elif a.n in (pickletools.TAKEN_FROM_ARGUMENT4, pickletools.TAKEN_FROM_ARGUMENT4U):
            arg[code] = -4
        elif a.n == pickletools.TAKEN_FROM_ARGUMENT8U:
            arg[code] = -8
        else:  # GLOBAL and INST: two lines
            arg[code] = -20
    arg[ord("c")] = arg[ord("i")] = -20
    act = [_SLOW] * 256
    for c in _SCALAR_PUSHES:
        act[c] = _PUSH_FIXED if arg[c] >= 0 else _PUSH_COUNT1 if arg[c] == -1 else _SLOW
    for c in b"]}\x8f":  # EMPTY_LIST, EMPTY_DICT, EMPTY_SET
        act[c] = _PUSH_CONTAINER
    act[0x94] = _MEMOIZE
    act[0x68] = _BINGET
    for c in b"\x80\x98":  # PROTO, READONLY_BUFFER
        act[c] = _SKIP_FIXED
    act[0x95] = _FRAME
    act[ord("a")] = _POP1  # APPEND
    act[ord("s")] = _SETITEM
    for c in b"eu\x90":  # APPENDS, SETITEMS, ADDITEMS
        act[c] = _TO_MARK
    act[ord("(")] = _MARK
    return act, arg


_OPCODE_ACTION, _OPCODE_ARG = _opcode_tables()
_CODE_OPS = frozenset(b"PQci\x93")  # persistent ids and globals: the unpickler refuses them
#: Opcodes that call code or build objects, refused: BUILD with a None state
#: is a no-op on any object, and EXT pushes copyreg's cached objects without
#: find_class, so the unpickler does not refuse them all (see scan.go).
_CALL_OPS = {0x6F: "OBJ", 0x81: "NEWOBJ", 0x92: "NEWOBJ_EX", 0x52: "REDUCE", 0x62: "BUILD", 0x82: "EXT1",
             0x83: "EXT2", 0x84: "EXT4"}


def _scan_pickle(data: Union[bytes, bytearray], name: str) -> Optional[tuple[int, int]]:
    """Walk the opcodes of ``data`` without running them and refuse what
    would make the unpickler itself use much more memory or stack than the
    data's size: memo indexes beyond the number of opcodes (the C unpickler
    sizes its memo by the largest index: 9 bytes could ask for GBs), counted
    lengths beyond the data, and tuples nested deeper than
    :data:`MAX_PICKLE_DEPTH` (hashed recursively in C). Opcodes that import
    or call code end the scan: the unpickler refuses them when it gets
    there, before anything after them.

    Runs the Go scanner when the C fast path is built, else (and in a
    forked child, which must not enter Go) :func:`_scan_pickle_py`; both raise the same errors. The Go scanner
    also bounds what the pickle builds: ``(nodes, depth)`` as
    :func:`_check_structure` counts them, each at least the real figure
    (``bindings/picklescan/shape.go``), or None when it cannot."""
    fast = _native.fastcall
    if fast is None or _native.forked():  # a forked child must not enter Go: this needs no pool
        _scan_pickle_py(data, name)
        return None
    res = fast.scan_pickle(data, MAX_PICKLE_DEPTH)
    if len(res) == 4:
        raise _scan_error(name, *res)
    nodes, depth = res
    return None if nodes is None else (nodes, depth)


def _scan_error(name: str, truncated: bool, why: str, ops: int, pos: int) -> UnsafePickleError:
    """The error of a scan that stopped at opcode number ``ops``, whose
    byte ends at ``pos``."""
    if truncated:
        return UnsafePickleError(f"{name}: not a readable pickle: truncated (opcode {ops} at byte {pos})")
    return UnsafePickleError(f"{name}: refused a crafted or corrupt pickle: {why} (opcode {ops} at byte {pos})")


def _scan_pickle_py(data: Union[bytes, bytearray], name: str, max_depth: int = MAX_PICKLE_DEPTH) -> None:
    """:func:`_scan_pickle` in Python (about 8 MB/s): the reference that
    ``bindings/picklescan`` matches, and the fallback without the C fast
    path."""
    if not 0 <= max_depth <= 1 << 30:  # as the Go scanner (and its C wrapper)
        raise ValueError(f"max_depth {max_depth} is not in [0, 2**30]")
    action, args, scalar_item = _OPCODE_ACTION, _OPCODE_ARG, _SCALAR_ITEM
    stack: list[int] = []  # each item: hash work << 32 | _FIXED_HASH | tuple nesting (0: a str, None...)
    push = stack.append
    marks: list[int] = []
    memo: dict[int, int] = {}
    pos = ops = 0  # pos: just after the current opcode's byte
    frame_end = 0  # the end of the last frame: the C unpickler's buffer (see the module's notes)
    built, budget = 0, max(MIN_UNPICKLED_BYTES, UNPICKLED_BYTES_PER_BYTE * len(data))

    def over_budget() -> UnsafePickleError:
        return bad(f"containers that would take over {budget} bytes to unpickle ({UNPICKLED_BYTES_PER_BYTE} per "
                   f"byte of pickle, {MIN_UNPICKLED_BYTES >> 20} MiB at least)")

    def bad(why: str) -> UnsafePickleError:
        return _scan_error(name, False, why, ops, pos)

    try:
        while True:
            op = data[pos]
            pos += 1
            ops += 1
            a = action[op]
            if a == 0:  # _PUSH_FIXED
                push(scalar_item[op])
                end = pos + args[op]
            elif a == 1:  # _PUSH_COUNT1
                push(scalar_item[op])
                end = pos + 1 + data[pos]
            elif a == 2:  # _MEMOIZE
                memo[len(memo)] = stack[-1] if stack else 0
                continue
            elif a == 3:  # _BINGET
                push(memo.get(data[pos], 0))
                end = pos + 1
            elif a == 4:  # _SKIP_FIXED
                end = pos + args[op]
            elif a == 5:  # _POP1
                if stack:
                    stack.pop()
                continue
            elif a == 6:  # _SETITEM
                if len(stack) >= 2 and stack[-2] & _FIXED_HASH:
                    raise bad(_FIXED_HASH_KEY)
                del stack[-2:]
                continue
            elif a == 7:  # _TO_MARK
                if marks:
                    m = marks.pop()
                    if op != 0x65 and any(v & _FIXED_HASH for v in stack[m::2 if op == 0x75 else 1]):
                        raise bad(_FIXED_HASH_KEY)  # SETITEMS' keys, ADDITEMS' elements
                    del stack[m:]
                continue
            elif a == 8:  # _MARK
                marks.append(len(stack))
                continue
            elif a == 11:  # _PUSH_CONTAINER
                push(0)
                built += _CONTAINER_BYTES[op]
                if built > budget:
                    raise over_budget()
                continue
            elif a == 10:  # _FRAME
                end = pos + 8
                _ = data[end - 1]
                if end > frame_end > pos:
                    raise bad("an argument that runs past the end of its frame")
                frame = min(end + int.from_bytes(data[pos:end], "little"), (1 << 64) - 1)  # as Go's uint64
                if end >= frame_end:
                    frame_end = frame
                elif frame > frame_end:
                    raise bad("a frame that runs past the end of the frame it is in")
                pos = end
                continue
            else:
                end = _scan_slow(data, pos, op, ops, stack, marks, memo, bad, max_depth)
                if end < 0:
                    return
                if _CONTAINER_BYTES[op]:
                    built += _CONTAINER_BYTES[op]
                    if built > budget:
                        raise over_budget()
            _ = data[end - 1]  # IndexError when the argument runs past the end
            if end > frame_end > pos:  # a read cut by the frame's end (a length, then its data: two reads)
                k = args[op]
                if not (k in (-1, -4, -8) and frame_end == pos - k):
                    raise bad("an argument that runs past the end of its frame")
            pos = end
    except (IndexError, ValueError) as exc:  # ran off the end; no newline
        if isinstance(exc, UnsafePickleError):
            raise
        raise _scan_error(name, True, "", ops, pos) from None


def _scan_slow(data: Union[bytes, bytearray], pos: int, op: int, ops: int, stack: list[int], marks: list[int],
               memo: dict[int, int], bad: Callable[[str], UnsafePickleError], max_depth: int) -> int:
    """The rarer opcodes of :func:`_scan_pickle`; returns the next position,
    or -1 at the end of what is to be scanned."""
    frombytes = int.from_bytes
    k = _OPCODE_ARG[op]
    put = -1
    if op == 0x2E:  # STOP
        return -1
    if op in _CODE_OPS:
        return -1  # refused by find_class or persistent_load when the unpickler gets there
    if op in _CALL_OPS:
        raise bad(f"{_CALL_OPS[op]}, an opcode that calls code or builds an object, which plain data never has")
    if k == -99:
        raise bad(f"unknown opcode {op:#04x}")
    if op in _SCALAR_PUSHES:
        stack.append(_SCALAR_ITEM[op])  # a push with a 4-, 8-byte or text argument
    elif op == 0x30:  # POP
        if marks and marks[-1] == len(stack):
            marks.pop()
        elif stack:
            stack.pop()
    elif op == 0x31:  # POP_MARK
        if marks:
            del stack[marks.pop():]
    elif op in b"ld\x91":  # LIST, DICT, FROZENSET
        if marks:
            m = marks.pop()
            if op != 0x6C and any(v & _FIXED_HASH for v in stack[m::2 if op == 0x64 else 1]):
                raise bad(_FIXED_HASH_KEY)  # DICT's keys, FROZENSET's elements
            del stack[m:]
        stack.append(_FIXED_HASH if op == 0x91 else 0)
    elif op == 0x29:  # EMPTY_TUPLE
        stack.append(1 << 32 | _FIXED_HASH | 1)
    elif op == 0x74 or 0x85 <= op <= 0x87:  # TUPLE, TUPLE1..3
        if op == 0x74:
            lo = marks.pop() if marks else len(stack)
        else:
            lo = max(0, len(stack) - (op - 0x84))
        items = stack[lo:]
        depth = 1 + max((v & 0x7FFFFFFF for v in items), default=0)
        work = min(1 + sum((v >> 32) or 1 for v in items), 0xFFFFFFFF)
        if depth > max_depth:
            raise bad(f"tuples nested deeper than {max_depth}")
        hash_work = max(MIN_HASH_WORK, len(data))
        if work > hash_work:
            raise bad(f"a tuple that would take over {hash_work} steps to hash (shared references inside it)")
        del stack[lo:]
        stack.append(work << 32 | _FIXED_HASH | depth)
    elif op == 0x32:  # DUP
        stack.append(stack[-1] if stack else 0)
    elif op == 0x6A:  # LONG_BINGET
        stack.append(memo.get(frombytes(data[pos:pos + 4], "little"), 0))
    elif op == 0x67:  # GET (text): the C unpickler also takes " 5", "+5", "0_5" (see scan.go)
        text = data[pos:data.index(b"\n", pos)]
        if len(text) > 20 or not text.isdigit():
            raise bad("a GET index that is not a small decimal number")
        stack.append(memo.get(int(text), 0))
    elif op == 0x71:  # BINPUT
        put = data[pos]
    elif op == 0x72:  # LONG_BINPUT
        put = frombytes(data[pos:pos + 4], "little")
    elif op == 0x70:  # PUT (text)
        text = data[pos:data.index(b"\n", pos)]
        if len(text) > 20 or not text.isdigit():
            raise bad("a PUT index that is not a small decimal number")
        put = int(text)
    if put >= 0:
        if put > ops:
            raise bad(f"memo index {put} with only {ops} opcodes before it")
        memo[put] = stack[-1] if stack else 0
    if k >= 0:
        return pos + k
    if k == -1:
        return pos + 1 + data[pos]
    if k == -4:
        return pos + 4 + frombytes(data[pos:pos + 4], "little")
    if k == -8:
        return pos + 8 + frombytes(data[pos:pos + 8], "little")
    if k == -10:
        return data.index(b"\n", pos) + 1
    return data.index(b"\n", data.index(b"\n", pos) + 1) + 1


_CONTAINERS = frozenset((dict, list, tuple, set, frozenset))


def _check_structure(root: Any, name: str, max_nodes: int) -> None:
    """Refuse a loaded pickle whose structure is cyclic, nested deeper than
    :data:`MAX_PICKLE_DEPTH` or, counted with every shared reference
    expanded, larger than ``max_nodes`` (each container 1 + its length).
    Linear in the number of distinct containers."""
    containers = _CONTAINERS
    if type(root) not in containers:
        return
    # id -> (expanded size, height) of a finished container; its height (the
    # containers on its longest chain down) counts again wherever it is
    # shared, else a deep container reached first on a short path would be
    # let through at the bottom of a long one.
    done: dict[int, tuple[int, int]] = {}
    open_ids: set[int] = set()
    path: list[tuple[Any, Iterator[Any]]] = []
    sizes: list[int] = []
    heights: list[int] = []  # of the open containers' finished children, +1
    max_depth = MAX_PICKLE_DEPTH

    def children(obj: Any) -> Iterator[Any]:
        if type(obj) is dict:
            return itertools.chain(obj.keys(), obj.values())
        return iter(obj)

    def refuse(why: str) -> UnsafePickleError:
        return UnsafePickleError(f"{name}: refused a crafted pickle: {why}")

    path.append((root, children(root)))
    sizes.append(1 + len(root))
    heights.append(1)
    open_ids.add(id(root))
    while path:
        obj, it = path[-1]
        for child in it:
            if type(child) not in containers:
                continue
            cid = id(child)
            known = done.get(cid)
            if known is not None:
                size, height = known
                if len(path) + height > max_depth:
                    raise refuse(f"containers nested deeper than {max_depth}")
                sizes[-1] += size
                heights[-1] = max(heights[-1], 1 + height)
                if sizes[-1] > max_nodes:
                    raise refuse(f"shared references expand it to more than {max_nodes} nodes "
                                 "(raise max_bytes if it is genuine)")
                continue
            if cid in open_ids:
                raise refuse("it contains itself (a cycle), which plain snapshot data never does")
            if len(path) >= max_depth:
                raise refuse(f"containers nested deeper than {max_depth}")
            open_ids.add(cid)
            path.append((child, children(child)))
            sizes.append(1 + len(child))
            heights.append(1)
            break
        else:
            path.pop()
            size, height = sizes.pop(), heights.pop()
            open_ids.discard(id(obj))
            done[id(obj)] = (size, height)
            if sizes:
                sizes[-1] += size
                heights[-1] = max(heights[-1], 1 + height)
                if sizes[-1] > max_nodes:
                    raise refuse(f"shared references expand it to more than {max_nodes} nodes "
                                 "(raise max_bytes if it is genuine)")


def _gunzip(data: bytes, name: str, max_bytes: int) -> bytearray:
    """Decompress in chunks, refusing more than ``max_bytes`` of output.
    The bytearray itself is returned (the scanners and the unpickler take
    any buffer): a copy to bytes would double the peak memory."""
    out = bytearray()
    chunk = 1 << 20
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data), mode="rb") as gz:
            while True:
                part = gz.read(chunk)
                if not part:
                    break
                out += part
                if len(out) > max_bytes:
                    raise UnsafePickleError(f"{name}: decompresses to more than {max_bytes} bytes (raise max_bytes)")
    except (OSError, EOFError, zlib.error) as exc:
        raise UnsafePickleError(f"{name}: bad gzip data: {str(exc)[:200] or type(exc).__name__}") from None
    return out


def load_pickle(source: Union[PathLike, bytes], *, max_bytes: int = MAX_PICKLE_BYTES) -> Any:
    """Load a pickle of plain data from a path or bytes, refusing anything
    else with :class:`UnsafePickleError` before any of it runs. Files ending
    in ``.gz`` (or starting with gzip's magic) are decompressed, at most
    ``max_bytes`` of them.

    Pickles that would make loading or walking the result cost far more
    than their size are refused too (before unpickling where possible):
    memo indexes beyond the opcodes, containers nested deeper than
    :data:`MAX_PICKLE_DEPTH`, cycles, and shared references that expand the
    structure beyond :data:`PICKLE_NODES_PER_BYTE` nodes per byte."""
    data: Union[bytes, bytearray]
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        name = "<bytes>"
    else:
        name = os.fspath(source)
        size = os.path.getsize(name)
        if size > max_bytes:
            raise UnsafePickleError(f"{name}: {size} bytes is over the limit of {max_bytes} (raise max_bytes)")
        with open(name, "rb") as f:
            data = f.read()  # sized by the file (read(n) would allocate n bytes first)
    if len(data) > max_bytes:
        raise UnsafePickleError(f"{name}: {len(data)} bytes is over the limit of {max_bytes} (raise max_bytes)")
    if data[:2] == b"\x1f\x8b":
        data = _gunzip(data, name, max_bytes)
    if bytes(data[:8]) == b"gmptrace":
        raise UnsafePickleError(f"{name}: a gmptrace file, not a snapshot pickle: read it with "
                                "gpumempool.trace.Trace.load (or python -m gpumempool replay)")
    try:
        bound = _scan_pickle(data, name)
    except UnsafePickleError as exc:
        if data[:1] == b"\x80":
            raise
        # Not protocol 2 or later (which every snapshot writer uses): most
        # likely no pickle at all, which "a crafted pickle" would misname.
        why = str(exc)[len(name) + 2:] if str(exc).startswith(f"{name}: ") else str(exc)
        raise UnsafePickleError(f"{name}: not a snapshot pickle (those start with byte 0x80; this data starts with "
                                f"{bytes(data[:12])!r}); as a pickle: {why}") from None
    try:
        obj = _PlainDataUnpickler(io.BytesIO(data)).load()
    except UnsafePickleError as exc:
        # find_class and persistent_load do not know the file: name it
        if str(exc).startswith(f"{name}: "):
            raise
        raise UnsafePickleError(f"{name}: {exc}") from None
    except Exception as exc:  # truncated or corrupt data raise all sorts
        raise UnsafePickleError(f"{name}: not a readable pickle: {type(exc).__name__}: {str(exc)[:200]}") from None
    max_nodes = max(MIN_PICKLE_NODES, PICKLE_NODES_PER_BYTE * len(data))
    # The walk can find nothing when the scan's upper bounds are within the
    # limits: no cycle (the bound exists), no more nodes, no deeper nesting.
    if bound is None or bound[0] > max_nodes or bound[1] > MAX_PICKLE_DEPTH:
        _check_structure(obj, name, max_nodes)
    return obj


