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

The scan runs in Go (``internal/picklescan``, through
``gpumempool._fastcall``), without the GIL, at about 180 MB/s; it is the
only scanner (a Python twin, 20x slower and without the bound below, was
dropped). In a forked child, which must not enter Go, it runs in a new
process. The scan also bounds the result's size and nesting from the
opcodes (an upper bound, exact for what ``pickle.dumps`` writes); when the
bound is within the limits, step 3 has nothing to find and is skipped, which
more than halves the load time of a snapshot. Tests check the bound against
the walk on tens of thousands of programs.
"""

from __future__ import annotations

import ctypes
import functools
import gzip
import io
import itertools
import json
import os
import pickle
import subprocess
import sys
import zlib
from typing import Any, Iterator, Optional, Union

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


def _scan_pickle(data: Union[bytes, bytearray], name: str) -> Optional[tuple[int, int]]:
    """Walk the opcodes of ``data`` without running them and refuse what
    would make the unpickler itself use much more memory, stack or time than
    the data's size: memo indexes beyond the number of opcodes (the C
    unpickler sizes its memo by the largest index: 9 bytes could ask for
    GBs), counted lengths beyond the data, tuples nested deeper than
    :data:`MAX_PICKLE_DEPTH` or too costly to hash (hashed recursively in
    C), dict keys whose hash a pickle can choose, containers whose shells
    alone would take too much memory, and arguments that straddle a frame's
    end. Opcodes that import or call code end the scan: the unpickler refuses
    them when it gets there, before anything after them.

    The scan is ``internal/picklescan`` (Go, without the GIL), reached
    through :func:`_scan`. It also bounds what the pickle builds:
    ``(nodes, depth)`` as :func:`_check_structure` counts them, each at least
    the real figure (``internal/picklescan/shape.go``), or None when it
    cannot."""
    res = _scan_in_new_process(data) if _native.forked() else _scan(data, MAX_PICKLE_DEPTH)
    if len(res) == 4:
        raise _scan_error(name, *res)
    nodes, depth = res
    return None if nodes is None else (nodes, depth)


_ScanResult = Union[tuple[Optional[int], int], tuple[bool, str, int, int]]


def _scan(data: Union[bytes, bytearray], max_depth: int) -> _ScanResult:
    """The Go scan of ``data``, as ``gpumempool._fastcall.scan_pickle``
    returns it: ``(nodes, depth)`` (nodes None: no bound) when accepted,
    ``(truncated, why, ops, pos)`` when not. Through the C fast path, or in a
    build without it through ctypes (which copies a bytearray)."""
    fast = _native.fastcall
    if fast is not None:
        res: _ScanResult = fast.scan_pickle(data, max_depth)
        return res
    if not 0 <= max_depth <= 1 << 30:
        raise ValueError(f"max_depth {max_depth} is not in [0, 2**30]")
    scan = _ctypes_scan()
    ops, pos, depth, nodes = ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int64(-1), ctypes.c_uint64()
    why = ctypes.create_string_buffer(512)
    rc = scan(bytes(data), len(data), max_depth, ctypes.byref(ops), ctypes.byref(pos), why, len(why),
              ctypes.byref(nodes), ctypes.byref(depth))
    text = why.value.decode("utf-8", "replace")
    if rc == 0:
        return (None, -1) if depth.value < 0 else (nodes.value, depth.value)
    if rc in (1, 2):
        return (rc == 2, text, ops.value, pos.value)
    raise RuntimeError(text or "the pickle scan failed")


@functools.lru_cache(maxsize=None)
def _ctypes_scan() -> Any:
    """gmp_pickle_scan of the extension library (bindings/cabi/pickle.go)."""
    scan = ctypes.CDLL(_native.library_path()).gmp_pickle_scan
    p64 = ctypes.POINTER(ctypes.c_int64)
    scan.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int64, p64, p64, ctypes.c_char_p, ctypes.c_size_t,
                     ctypes.POINTER(ctypes.c_uint64), p64]
    scan.restype = ctypes.c_int
    return scan


def _scan_in_new_process(data: Union[bytes, bytearray]) -> _ScanResult:
    """The scan in a new Python process: a forked child must not enter Go,
    but it can start a process that may (as fork + exec). Loading a pickle
    needs no pool, and worker processes that analyse snapshots are forks."""
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (f"import sys; sys.path.insert(0, {package_parent!r}); "
            "from gpumempool._safepickle import _scan_stdin; _scan_stdin()")
    res = subprocess.run([sys.executable, "-c", code], input=bytes(data), capture_output=True)
    if res.returncode != 0:
        tail = res.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit status {res.returncode}"]
        raise RuntimeError(f"the pickle scan in a new process (this one is a fork, which cannot run it) failed: {tail[0]}")
    out = json.loads(res.stdout)
    return (out[0], out[1]) if len(out) == 2 else (out[0], out[1], out[2], out[3])


def _scan_stdin() -> None:
    """The child of :func:`_scan_in_new_process`: scan stdin, print the
    result as JSON."""
    print(json.dumps(_scan(sys.stdin.buffer.read(), MAX_PICKLE_DEPTH)))


def _scan_error(name: str, truncated: bool, why: str, ops: int, pos: int) -> UnsafePickleError:
    """The error of a scan that stopped at opcode number ``ops``, whose
    byte ends at ``pos``."""
    if truncated:
        return UnsafePickleError(f"{name}: not a readable pickle: truncated (opcode {ops} at byte {pos})")
    return UnsafePickleError(f"{name}: refused a crafted or corrupt pickle: {why} (opcode {ops} at byte {pos})")


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


