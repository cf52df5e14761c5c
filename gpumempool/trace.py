"""Allocation traces: a compact file format, importers from gpumempool's and
torch's recorded history, and a recorder.

A trace is the sequence of allocator *requests* a program made (allocate,
free, record_stream, stream completion, empty_cache), with stable block ids
instead of addresses, so that :func:`gpumempool.replay.replay` can feed the
same requests to a pool with another policy and compare.

File format ``gmptrace`` version 2
----------------------------------
UTF-8 text, one record per line, fields separated by one space; gzip
compressed when the file name ends in ``.gz``. The first line is the header
``gmptrace 2``, or ``gmptrace 1`` for a file without ``S`` records (version 1
is version 2 without them, so that a trace without segment addresses stays
readable by older readers, and is saved as version 1). Integers are decimal;
streams may also be written in hex (``0x...``), and are when saved. Then, in
any order:

``# text``
    a comment, ignored.
``@ {json}``
    metadata: one JSON object on one line (several are merged). Keys used:
    ``source`` (``gpumempool``, ``torch``, ``synthetic``...),
    ``recorded_by`` (the allocator whose reserved bytes the ``R`` records
    hold), ``devices``, ``notes``, and counts from the importer.
``a ID SIZE STREAM [DEVICE]``
    allocate SIZE bytes for work on STREAM (DEVICE defaults to 0); the block
    is called ID (a positive integer) until its free. An ID names one block
    at a time: it may name a new block after its free (the importers never
    reuse one; a reader that checked that ids never repeat would need
    memory for every id of the file).
``A ID SIZE STREAM [DEVICE]``
    as ``a``, made by a caller that sizes its segments itself (torch's
    caching allocator above a ``torch.cuda.MemPool`` the pool serves:
    :meth:`~gpumempool.MemPool.alloc_segment`); replayed with that call.
``f ID``
    free block ID.
``r ID STREAM``
    block ID is used on STREAM too (``Tensor.record_stream``): after its free
    it may be reused only once the work queued on STREAM up to the free has
    completed (see ``s``).
``s [STREAM]``
    the work queued so far on STREAM (every stream when omitted) has
    completed; blocks waiting on it become reusable the next time the pool
    processes its events (at its next allocation).
``e``
    ``empty_cache()``: release every wholly free cached segment.
``t KEEP [DEVICE]``
    ``trim(KEEP)``: release free segments until at most KEEP unused bytes
    stay cached (on DEVICE, every device when omitted).
``R INDEX BYTES [DEVICE]``
    reference series, not replayed: the recording allocator's reserved bytes
    on DEVICE became BYTES while it served event INDEX (0-based: the number
    of events before it; a point at INDEX 0 before any change is the start).
    Written just before that event; several may share an INDEX. Replay
    reports the peak of this series next to its own.
``S INDEX ADDR SIZE [DEVICE]``
    reference data, not replayed (version 2): while it served event INDEX the
    recording allocator obtained the segment [ADDR, ADDR+SIZE) on DEVICE
    (its ``segment_alloc``). Best fit breaks ties between free blocks of
    equal size by address, so which block a request reuses depends on where
    the device put each segment, and CUDA's addresses do not grow with each
    allocation: replay puts a segment of the same size obtained while serving
    the same event at the same place in the address order (see
    :func:`gpumempool.replay.replay`). Written just before that event, after
    its ``R`` records.

Importers
---------
:func:`from_history` converts a pool's recorded history (``pool.snapshot()``
with :meth:`~gpumempool.MemPool.record_history` on) and
:func:`from_torch_snapshot` a pickle written by
``torch.cuda.memory._record_memory_history()`` + ``_dump_snapshot()`` (or
its dict). Both read the same torch-format ``device_traces``:

* ``alloc`` / ``free_requested`` become ``a`` / ``f`` (``A`` for
  gpumempool's caller-sized allocations), with the requested size, as both
  record it. gpumempool's entries carry their pool's handle, so that a
  snapshot of several pools (``gmp.snapshot()``), whose addresses may
  repeat, keeps their blocks apart.
* A free that waited for other streams (gpumempool: its block had
  ``record_stream`` entries, which our snapshots keep beside
  ``device_traces`` under ``gpumempool_record_stream``, each with its
  place in the trace; torch, which records none: its
  ``free_completed`` did not follow at once) gets a *virtual stream*
  (``1 << 63`` plus a small number, reused once synced): ``r ID VSTREAM``
  before the free and ``s VSTREAM`` where the recording shows the free
  completed. Replays thus see each block come back exactly when the
  recording did, whatever the policy. (The real streams of gpumempool's
  ``record_stream`` entries are counted in the metadata, not kept.)
* Blocks freed in the trace but allocated before it started, and blocks
  still allocated in the snapshot's segments that the trace never mentions,
  are allocated at the start (as torch's memory_viz assumes too).
* ``segment_alloc`` / ``segment_map`` add to and ``segment_free`` /
  ``segment_unmap`` subtract from the recorded reserved bytes (``R``),
  starting from the snapshot's segments minus what the trace changed.
  ``segment_alloc`` entries also keep their address and size (``S``): the
  address order of the segments decides which of several equal free blocks
  best fit reuses. (Growths of expandable segments, ``segment_map``, are not
  kept: a replay grows its own segment in place. The segments of blocks
  allocated before the trace started have none.)
* Neither allocator records ``empty_cache`` calls. For torch traces a run of
  segment releases that is not followed by a new segment (or an OOM) inside
  the same allocation is taken for an ``empty_cache()``; for gpumempool,
  :class:`TraceRecorder` records ``empty_cache`` and ``trim`` calls made
  through the Python API.

Torch pickles may come from anyone: :func:`load_pickle` reads them with an
unpickler that refuses every global (so only plain dict/list/tuple/str/int/
float/bool/None/bytes survive), with size limits, and after a scan of the
opcodes and a walk of the result that refuse what is crafted to cost far
more than its size (huge memo indexes, deep nesting, cycles, shared
references that multiply the work). What they hold is checked before it is
imported: a snapshot without history is refused ("record history first"),
and so is every malformed entry or segment, named by device and index, or
with ``lenient=True`` left out and counted (``gpumempool._snapshot_check``).
"""

from __future__ import annotations

import contextlib
import gzip
import heapq
import io
import json
import os
import re
import secrets
import stat
import time
import warnings
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional, TypeGuard, Union

from ._args import MAX_DEVICE
from ._policy import TORCH_SIZES
from ._safepickle import MAX_PICKLE_BYTES, UnsafePickleError, load_pickle
from ._snapshot import RECORD_STREAM_KEY, with_record_streams
from ._snapshot_check import check_history, show_value
from ._trace_errors import MalformedEventError, MalformedSegmentError, NoHistoryError, TraceFormatError

if TYPE_CHECKING:
    from ._pool import MemPool

__all__ = [
    "Alloc",
    "EmptyCache",
    "Event",
    "Free",
    "MalformedEventError",
    "MalformedSegmentError",
    "NoHistoryError",
    "RecordStream",
    "Sync",
    "Trace",
    "TraceFile",
    "TraceFormatError",
    "TraceRecorder",
    "Trim",
    "UnsafePickleError",
    "VIRTUAL_STREAM_BASE",
    "from_history",
    "from_torch_snapshot",
    "is_trace_file",
    "load_pickle",
    "load_trace",
]

FORMAT = "gmptrace"
#: The newest version this module reads and writes (see the module doc).
VERSION = 2
#: The versions it reads.
VERSIONS = (1, 2)
#: Streams at or above this are virtual streams made by the importers.
VIRTUAL_STREAM_BASE = 1 << 63
_U64 = 1 << 64
PathLike = Union[str, "os.PathLike[str]"]


# -- events ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Alloc:
    """``a ID SIZE STREAM [DEVICE]``, or ``A ...`` when ``caller_sized``
    (an :meth:`~gpumempool.MemPool.alloc_segment`)."""

    id: int
    size: int
    stream: int = 0
    device: int = 0
    caller_sized: bool = False


@dataclass(frozen=True, slots=True)
class Free:
    """``f ID``"""

    id: int


@dataclass(frozen=True, slots=True)
class RecordStream:
    """``r ID STREAM``"""

    id: int
    stream: int


@dataclass(frozen=True, slots=True)
class Sync:
    """``s [STREAM]``; ``stream=None``: every stream."""

    stream: Optional[int] = None


@dataclass(frozen=True, slots=True)
class EmptyCache:
    """``e``"""


@dataclass(frozen=True, slots=True)
class Trim:
    """``t KEEP [DEVICE]``; ``device=None``: every device."""

    keep: int
    device: Optional[int] = None


Event = Union[Alloc, Free, RecordStream, Sync, EmptyCache, Trim]


def _stream_text(s: int) -> str:
    return hex(s) if s else "0"


def _event_line(e: Event) -> str:
    t = type(e)
    if t is Alloc:
        line = f"{'A' if e.caller_sized else 'a'} {e.id} {e.size} {_stream_text(e.stream)}"  # type: ignore[union-attr,arg-type]
        return line if not e.device else f"{line} {e.device}"  # type: ignore[union-attr]
    if t is Free:
        return f"f {e.id}"  # type: ignore[union-attr]
    if t is RecordStream:
        return f"r {e.id} {_stream_text(e.stream)}"  # type: ignore[union-attr,arg-type]
    if t is Sync:
        return "s" if e.stream is None else f"s {_stream_text(e.stream)}"  # type: ignore[union-attr]
    if t is EmptyCache:
        return "e"
    if t is Trim:
        return f"t {e.keep}" if e.device is None else f"t {e.keep} {e.device}"  # type: ignore[union-attr]
    raise TypeError(f"not a trace event: {e!r}")


# -- the trace ------------------------------------------------------------


class _Provenance:
    """Where a trace came from, as its ``meta`` says (for :class:`Trace` and
    :class:`TraceFile`, which both keep the file's metadata there)."""

    meta: dict[str, Any]

    @property
    def source(self) -> str:
        return str(self.meta.get("source", "unknown"))

    @property
    def recorded_by(self) -> Optional[str]:
        """The allocator whose reserved bytes the ``R`` records hold."""
        rb = self.meta.get("recorded_by")
        return str(rb) if rb else None


@dataclass
class Trace(_Provenance):
    """A list of allocator :data:`Event` objects plus metadata.

    ``reserved`` is the recording allocator's reserved-bytes series (for
    torch traces, torch's own): ``(index, device, bytes)`` points in order,
    meaning that reserved bytes on ``device`` became ``bytes`` while event
    ``index`` was served (the first point of a device is its start).

    ``segments`` are the segments the recording allocator obtained, as
    ``(index, device, addr, size)`` in order: while serving event ``index``
    it got ``size`` bytes at ``addr`` on ``device`` (``S`` records).
    """

    events: list[Event] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    reserved: list[tuple[int, int, int]] = field(default_factory=list)
    segments: list[tuple[int, int, int, int]] = field(default_factory=list)
    #: For a trace imported from a torch snapshot: event index -> (device,
    #: index of its entry in the snapshot's ``device_traces[device]``), and
    #: the snapshot (its path, bytes or dict), so that :meth:`frames` can
    #: read the stacks torch recorded without the trace holding them all.
    snapshot_entries: dict[int, tuple[int, int]] = field(default_factory=dict, compare=False, repr=False)
    snapshot: Any = field(default=None, compare=False, repr=False)

    def __len__(self) -> int:
        return len(self.events)

    def frames(self, indices: Iterable[int]) -> dict[int, list[dict[str, Any]]]:
        """The stack frames the snapshot recorded for each event of
        ``indices`` that came from one (``{"name", "filename", "line"}``,
        innermost first), reading the snapshot again (once) only now; an
        event without a recorded stack, or a snapshot no longer readable,
        is left out."""
        wanted = {i: self.snapshot_entries[i] for i in indices if i in self.snapshot_entries}
        if not wanted or self.snapshot is None:
            return {}
        try:
            snap = self.snapshot if isinstance(self.snapshot, dict) else load_pickle(self.snapshot)
            traces = snap["device_traces"]
        except (OSError, ValueError, KeyError, TypeError, EOFError, MemoryError):
            return {}
        out: dict[int, list[dict[str, Any]]] = {}
        for i, (dev, pos) in wanted.items():
            if pos < 0:
                continue
            try:
                raw = traces[dev][pos].get("frames")
            except (IndexError, KeyError, TypeError, AttributeError):
                continue
            frames = [{"name": f["name"], "filename": f["filename"], "line": f["line"]}
                      for f in (raw if isinstance(raw, list) else [])
                      if isinstance(f, dict) and isinstance(f.get("name"), str)
                      and isinstance(f.get("filename"), str) and isinstance(f.get("line"), int)]
            if frames:
                out[i] = frames
        return out

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events)

    def recorded_peak_reserved(self) -> Optional[int]:
        """Peak of :attr:`reserved` from the first event of the run on
        (summed over devices of each device's peak, as
        ``reserved_bytes.all.peak`` is); None without a series. The run's
        first event is the first after the blocks allocated before it
        (``meta["preexisting_blocks"]``): what the recording allocator held
        before it, and released at once (an ``empty_cache()`` first), is
        not a peak of the run."""
        if not self.reserved:
            return None
        peaks = _RecordedPeaks(self.meta)
        for r in self.reserved:
            peaks.add(r)
        return peaks.total()

    def peak_requested(self) -> int:
        """Peak of the bytes the trace holds allocated (sizes as written)."""
        live: dict[int, int] = {}
        cur = peak = 0
        for e in self.events:
            t = type(e)
            if t is Alloc:
                live[e.id] = e.size  # type: ignore[union-attr]
                cur += e.size  # type: ignore[union-attr]
                peak = max(peak, cur)
            elif t is Free:
                cur -= live.pop(e.id, 0)  # type: ignore[union-attr]
        return peak

    def counts(self) -> dict[str, int]:
        """Number of events of each kind."""
        names = {Alloc: "alloc", Free: "free", RecordStream: "record_stream", Sync: "sync",
                 EmptyCache: "empty_cache", Trim: "trim"}
        out = dict.fromkeys(names.values(), 0)
        for e in self.events:
            out[names[type(e)]] += 1
        return out

    def validate(self) -> None:
        """Check that a block is allocated only while its id is free, and
        freed or recorded only while allocated (the rule the reader checks
        line by line); raises :class:`TraceFormatError`."""
        check = _Checker()
        for i, e in enumerate(self.events):
            why = check(e)
            if why:
                raise TraceFormatError(f"event {i}: {why}")

    # -- files ------------------------------------------------------------

    def save(self, path: PathLike) -> None:
        """Write the trace (gzip when ``path`` ends in ``.gz``), atomically:
        into a new file beside ``path`` that then replaces it, so that a
        failure on the way (a full disk, an exception) leaves an existing
        ``path`` as it was."""
        _save_atomically(path, self._write)

    def dumps(self) -> str:
        """The trace as text."""
        buf = io.StringIO()
        self._write(buf)
        return buf.getvalue()

    def _write(self, f: Any) -> None:
        f.write(f"{FORMAT} {VERSION if self.segments else 1}\n")
        if self.meta:
            f.write("@ " + json.dumps(self.meta, sort_keys=True, separators=(",", ":")) + "\n")
        # R then S records of each index, each in their own order.
        ref = sorted([(r[0], 0, i, _ref_line(r)) for i, r in enumerate(self.reserved)]
                     + [(g[0], 1, i, _segment_line(g)) for i, g in enumerate(self.segments)])
        j = 0
        buf: list[str] = []
        for i, e in enumerate(self.events):
            while j < len(ref) and ref[j][0] <= i:
                buf.append(ref[j][3])
                j += 1
            buf.append(_event_line(e))
            if len(buf) >= 8192:
                f.write("\n".join(buf) + "\n")
                buf.clear()
        while j < len(ref):
            buf.append(ref[j][3])
            j += 1
        if buf:
            f.write("\n".join(buf) + "\n")

    @classmethod
    def load(cls, path: PathLike, *, max_events: int = 100_000_000,
             progress: Optional[Callable[[int, int], None]] = None) -> "Trace":
        """Read a trace file (gzip-compressed or not, detected by content)
        into memory, checking each line as it is read (an error names its
        line). More than ``max_events`` events, or ``R`` or ``S`` records of
        either kind, is refused (a gzip bomb of one repeated line).
        ``progress(bytes_read, file_size)`` is called as it reads. For a
        trace too large to hold, see :class:`TraceFile`."""
        return cls._collect(_file_records(os.fspath(path), max_events, progress))

    @classmethod
    def loads(cls, text: str, *, max_events: int = 100_000_000) -> "Trace":
        """Parse a trace from text."""
        return cls._collect(_records(io.StringIO(text), "<string>", max_events))

    @classmethod
    def _collect(cls, records: Iterator[Any]) -> "Trace":
        tr = cls()
        events, reserved, segments = tr.events, tr.reserved, tr.segments
        for r in records:
            if type(r) is _Meta:
                tr.meta.update(r.meta)
            elif type(r) is not tuple:
                events.append(r)
            elif len(r) == 3:
                reserved.append(r)
            else:
                segments.append(r)
        return tr


class _RecordedPeaks:
    """The peak of an ``R`` series per device from the run's first event
    (see :meth:`Trace.recorded_peak_reserved`), fed one record at a time."""

    def __init__(self, meta: dict[str, Any]) -> None:
        first = meta.get("preexisting_blocks", 0)
        self.first = first if type(first) is int and first >= 0 else 0
        self.base: dict[int, int] = {}  # device -> bytes after the first event
        self.later: dict[int, int] = {}  # device -> peak after it

    def add(self, r: tuple[int, int, int]) -> None:
        idx, dev, b = r
        if idx <= self.first:
            self.base[dev] = b
        elif b > self.later.get(dev, -1):
            self.later[dev] = b

    def total(self) -> Optional[int]:
        devs = set(self.base) | set(self.later)
        if not devs:
            return None
        return sum(max(self.base.get(d, 0), self.later.get(d, 0)) for d in devs)


def _save_atomically(path: PathLike, write: Callable[[Any], None]) -> None:
    """Call ``write(text_file)`` on a new file in the directory of ``path``
    (gzip when it ends in ``.gz``), then put that file in place of ``path``
    with ``os.replace``: readers see the old file or the whole new one, and
    a failure on the way leaves the old one and removes the new one."""
    p = os.path.realpath(os.fspath(path))  # through a symlink: replace its target, not the link
    d, base = os.path.split(p)
    while True:
        tmp = os.path.join(d, f".{base}.{secrets.token_hex(4)}.tmp")
        try:
            # mode 0o666 as open() uses, so that the umask decides as it did
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
            break
        except FileExistsError:
            continue
        except OSError as exc:  # the name the caller gave, not the temporary one
            raise OSError(exc.errno, exc.strerror, os.fspath(path)) from None
    try:
        with contextlib.suppress(OSError):
            os.chmod(tmp, stat.S_IMODE(os.stat(p).st_mode))  # an existing file keeps its mode
        with open(fd, "wb") as raw:
            if p.endswith(".gz"):
                with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz, \
                        io.TextIOWrapper(gz, encoding="utf-8", newline="\n") as f:
                    write(f)
            else:
                text = io.TextIOWrapper(raw, encoding="utf-8", newline="\n")
                write(text)
                text.flush()
                text.detach()
            raw.flush()
            os.fsync(raw.fileno())  # the data is on disk before the name points at it
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class TraceFile(_Provenance):
    """A gmptrace file read as a stream, for traces of any length: holds
    what a replay needs besides the events, never the events themselves.

    Opening it reads the file once, checking every line as it comes (an
    error names its line and is raised when that line is read) and keeping
    the metadata, the ``S`` records (:attr:`segments`, which a replay needs
    before its first event), the peak of the ``R`` series per device, the
    counts of each kind of event and the blocks allocated at each moment
    (to check that frees match allocations). Iterating over it reads the
    file again and yields its events. Memory thus grows with the blocks
    alive at once and the ``S`` records (at most one per event plus
    :data:`SEGMENT_SLACK`), not with the number of events; see
    docs/traces.md for the figures. :func:`gpumempool.replay.replay` takes
    one, or a path, as it takes a :class:`Trace`.

    The file must not change while the object is used: a later pass that
    finds other content raises :class:`TraceFormatError`.
    """

    def __init__(self, path: PathLike, *, max_events: int = 100_000_000,
                 progress: Optional[Callable[[int, int], None]] = None) -> None:
        self.path = os.fspath(path)
        self.max_events = max_events
        self.meta: dict[str, Any] = {}
        self.segments: list[tuple[int, int, int, int]] = []
        self._peaks: Optional[_RecordedPeaks] = None  # the R series' peaks, once the first R record is read
        names = {"a": "alloc", "A": "alloc", "f": "free", "r": "record_stream", "s": "sync", "e": "empty_cache",
                 "t": "trim"}
        by_op = dict.fromkeys(names, 0)
        check = _Checker()
        for r in _file_records(self.path, max_events, progress, check, events=False):
            t = type(r)
            if t is str:
                by_op[r] += 1  # type: ignore[index]
            elif t is tuple:
                if len(r) == 3:  # type: ignore[arg-type]
                    if self._peaks is None:  # the metadata (which names the first event) comes first
                        self._peaks = _RecordedPeaks(self.meta)
                    self._peaks.add(r)  # type: ignore[arg-type]
                else:
                    self.segments.append(r)  # type: ignore[arg-type]
            else:
                self.meta.update(r.meta)  # type: ignore[union-attr]
        counts = dict.fromkeys(names.values(), 0)
        for op, k in by_op.items():
            counts[names[op]] += k
        self._len = sum(by_op.values())
        self._counts = counts
        self._peak_requested = check.peak
        #: 1 + the highest device an allocation names.
        self.devices_used = check.devices

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Event]:
        n = 0
        for r in _file_records(self.path, self.max_events):
            if type(r) is not tuple and type(r) is not _Meta:
                n += 1
                yield r  # type: ignore[misc]
        if n != self._len:
            raise TraceFormatError(f"{self.path}: changed while in use ({n} events now, {self._len} before)")

    def recorded_peak_reserved(self) -> Optional[int]:
        """As :meth:`Trace.recorded_peak_reserved`."""
        return self._peaks.total() if self._peaks is not None else None

    def peak_requested(self) -> int:
        """As :meth:`Trace.peak_requested`."""
        return self._peak_requested

    def counts(self) -> dict[str, int]:
        """Number of events of each kind."""
        return dict(self._counts)

    def save(self, path: PathLike) -> None:
        """Write the trace to ``path`` as :meth:`Trace.save` does (atomically;
        the metadata merged into one line at the top, the records in the
        order of this file), one line at a time."""
        if os.path.realpath(os.fspath(path)) == os.path.realpath(self.path):
            return  # the same file: it is already this trace

        def write(f: Any) -> None:
            f.write(f"{FORMAT} {VERSION if self.segments else 1}\n")
            if self.meta:
                f.write("@ " + json.dumps(self.meta, sort_keys=True, separators=(",", ":")) + "\n")
            buf: list[str] = []
            for r in _file_records(self.path, self.max_events):
                t = type(r)
                if t is _Meta:
                    continue
                buf.append((_ref_line(r) if len(r) == 3 else _segment_line(r)) if t is tuple  # type: ignore[arg-type]
                           else _event_line(r))  # type: ignore[arg-type]
                if len(buf) >= 8192:
                    f.write("\n".join(buf) + "\n")
                    buf.clear()
            if buf:
                f.write("\n".join(buf) + "\n")

        _save_atomically(path, write)


#: Longest line a trace file may have.
MAX_LINE = 1 << 20
#: Deepest nesting of the JSON of an ``@`` metadata line.
MAX_META_DEPTH = 32
#: Bytes of ``@`` metadata lines a file may carry in all. Every one is merged
#: into the metadata a reader keeps: without a cap, a small gzip of many
#: long metadata lines with distinct keys would grow it without bound.
MAX_META_BYTES = 4 * MAX_LINE
#: ``S`` records a reader takes beyond one per event read so far. The
#: importers write at most one per event (a segment obtained while serving
#: it, just before it); the slack is for hand-written files. Without a cap,
#: a small gzip of one repeated ``S`` line would grow the kept list without
#: bound.
SEGMENT_SLACK = 1 << 16
#: Lines between two calls of a reader's progress function.
_PROGRESS_LINES = 1 << 16


@dataclass
class _Meta:
    """An ``@`` record, as the reader yields it."""

    meta: dict[str, Any]


class _Checker:
    """The rule of block ids, checked one event at a time: a block is
    allocated only while its id names no allocated block, and freed or
    recorded only while allocated. It keeps the sizes of the blocks
    allocated at the moment, nothing per event, so that checking a file
    takes memory that grows with the blocks alive in it, not with its
    length. (An id may name a new block after its free; the importers never
    reuse one, and a replay serves a reused id as a new block.)"""

    __slots__ = ("live", "cur", "peak", "devices")

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.cur = self.peak = 0
        self.devices = 1  # 1 + the highest device an allocation names

    def __call__(self, e: Event) -> Optional[str]:
        if isinstance(e, Alloc):
            if e.id in self.live:
                return f"block {e.id} allocated twice (no free in between)"
            if e.size <= 0:
                return f"block {e.id} has size {e.size}"
            self.live[e.id] = e.size
            self.cur += e.size
            if self.cur > self.peak:
                self.peak = self.cur
            if e.device >= self.devices:
                self.devices = e.device + 1
        elif isinstance(e, Free):
            size = self.live.pop(e.id, -1)
            if size < 0:
                return f"free of block {e.id}, which is not allocated"
            self.cur -= size
        elif isinstance(e, RecordStream) and e.id not in self.live:
            return f"record_stream of block {e.id}, which is not allocated"
        return None


#: What a reader yields: an event, an ``R`` record ``(index, device,
#: bytes)``, an ``S`` record ``(index, device, addr, size)`` or metadata.
Record = Union[Event, tuple[int, int, int], tuple[int, int, int, int], _Meta]


def _records(f: Any, name: str, max_events: int, tick: Optional[Callable[[], None]] = None,
             checker: Optional[_Checker] = None, events: bool = True) -> Iterator[Record]:
    """The records of a gmptrace text stream, each checked as its line is
    read: the syntax, the block-id rule of :class:`_Checker` and the limits
    (``max_events`` events, and as many ``R`` records; ``S`` records at most
    one per event so far plus :data:`SEGMENT_SLACK`). An error is raised at
    the line that makes it, naming the line. Holds one line at a time; the
    caller decides what to keep. Without ``events``, an event is yielded as
    its record letter (a pass that only counts them skips building objects,
    most of the time a line takes). ``tick()`` is called every
    :data:`_PROGRESS_LINES` lines. ``checker`` is left with the blocks
    allocated at the end, the peak of their bytes and the devices used."""
    readline = f.readline
    header = readline(MAX_LINE + 1).rstrip("\n").split()
    if len(header) != 2 or header[0] != FORMAT:
        raise TraceFormatError(f"{name}: not a {FORMAT} file (first line must be '{FORMAT} {VERSION}')")
    if header[1] not in [str(v) for v in VERSIONS]:
        raise TraceFormatError(f"{name}: {FORMAT} version {header[1][:20]} is not supported "
                               f"(this reader: {VERSION})")
    v1 = header[1] == "1"
    check = checker if checker is not None else _Checker()
    # The checker's rule, inlined: a call per line would cost a fifth of the time.
    live = check.live
    cur, peak, devices = check.cur, check.peak, check.devices
    nev = nref = nseg = meta_bytes = 0
    lineno = 1
    ev: Any
    while True:
        line = readline(MAX_LINE + 1)
        if not line:
            break
        lineno += 1
        if len(line) > MAX_LINE:
            raise TraceFormatError(f"{name}:{lineno}: line longer than {MAX_LINE >> 20} MiB")
        if tick is not None and lineno % _PROGRESS_LINES == 0:
            tick()
        parts = line.split()
        if not parts:
            continue
        op = parts[0]
        why = None
        try:
            n = len(parts)
            if (op == "a" or op == "A") and 4 <= n <= 5:
                bid, size, stream, dev = _id(parts[1]), _size(parts[2]), _u64(parts[3]), _dev(parts[4]) if n == 5 else 0
                if bid in live:
                    why = f"block {bid} allocated twice (no free in between)"
                else:
                    live[bid] = size
                    cur += size
                    if cur > peak:
                        peak = cur
                    if dev >= devices:
                        devices = dev + 1
                ev = Alloc(bid, size, stream, dev, op == "A") if events else op
            elif op == "f" and n == 2:
                bid = _id(parts[1])
                size = live.pop(bid, -1)
                if size < 0:
                    why = f"free of block {bid}, which is not allocated"
                else:
                    cur -= size
                ev = Free(bid) if events else op
            elif op == "r" and n == 3:
                bid, stream = _id(parts[1]), _u64(parts[2])
                if bid not in live:
                    why = f"record_stream of block {bid}, which is not allocated"
                ev = RecordStream(bid, stream) if events else op
            elif op == "s" and n <= 2:
                ev = Sync(_u64(parts[1]) if n == 2 else None) if events else op
            elif op == "e" and n == 1:
                ev = EmptyCache() if events else op
            elif op == "t" and 2 <= n <= 3:
                ev = Trim(_u64(parts[1]), _dev(parts[2]) if n == 3 else None) if events else op
            elif op == "R" and 3 <= n <= 4:
                nref += 1
                if nref > max_events:
                    raise TraceFormatError(f"{name}:{lineno}: more than {max_events} R records (raise max_events)")
                yield (_u64(parts[1]), _dev(parts[3]) if n == 4 else 0, _u64(parts[2]))
                continue
            elif op == "S" and 4 <= n <= 5 and not v1:
                nseg += 1
                if nseg > max_events:
                    raise TraceFormatError(f"{name}:{lineno}: more than {max_events} S records (raise max_events)")
                if nseg > nev + SEGMENT_SLACK:
                    raise TraceFormatError(f"{name}:{lineno}: {nseg} S records before event {nev}: more than one "
                                           f"per event plus {SEGMENT_SLACK} (each comes just before its event)")
                yield (_u64(parts[1]), _dev(parts[4]) if n == 5 else 0, _u64(parts[2]), _size(parts[3]))
                continue
            elif op == "@":
                meta_bytes += len(line)
                if meta_bytes > MAX_META_BYTES:
                    raise TraceFormatError(f"{name}:{lineno}: metadata lines total more than "
                                           f"{MAX_META_BYTES >> 20} MiB")
                yield _Meta(_parse_meta(line[1:]))
                continue
            elif op.startswith("#"):
                continue
            elif op == "S" and v1:
                raise ValueError(f"S records need {FORMAT} 2 (this file says version 1)")
            else:
                raise ValueError(f"unknown record {op!r} with {n - 1} field(s)")
        except ValueError as exc:
            if isinstance(exc, TraceFormatError):
                raise
            raise TraceFormatError(f"{name}:{lineno}: {exc}: {line.strip()[:80]!r}") from None
        if why is not None:
            raise TraceFormatError(f"{name}:{lineno}: event {nev}: {why}")
        nev += 1
        if nev > max_events:
            raise TraceFormatError(f"{name}:{lineno}: more than {max_events} events (raise max_events)")
        yield ev
    check.cur, check.peak, check.devices = cur, peak, devices
    if tick is not None:
        tick()


def _file_records(p: str, max_events: int, progress: Optional[Callable[[int, int], None]] = None,
                  checker: Optional[_Checker] = None, events: bool = True) -> Iterator[Record]:
    """:func:`_records` of the file ``p`` (gzip or not, detected by
    content), with unreadable data reported as :class:`TraceFormatError`
    naming the file. ``progress(bytes_read, file_size)`` follows the
    (compressed) bytes read."""
    with open(p, "rb") as raw:
        size = os.fstat(raw.fileno()).st_size
        magic = raw.read(2)
        raw.seek(0)
        stream: Any = gzip.GzipFile(fileobj=raw, mode="rb") if magic == b"\x1f\x8b" else raw
        tick = None if progress is None else (lambda: progress(min(raw.tell(), size), size))
        try:
            if stream.peek(1)[:1] == b"\x80":  # PROTO: a pickle (plain or gzip), not text
                raise TraceFormatError(
                    f"{p}: a pickle (a memory snapshot?), not a {FORMAT} file: import a snapshot with "
                    "gpumempool.from_torch_snapshot(path), which loads it safely")
            with io.TextIOWrapper(stream, encoding="utf-8", newline="\n") as f:
                yield from _records(f, p, max_events, tick, checker, events)
        except (OSError, EOFError, UnicodeDecodeError, zlib.error) as exc:  # corrupt gzip or text
            what = "corrupt gzip data: " if isinstance(exc, (zlib.error, EOFError, gzip.BadGzipFile)) else ""
            raise TraceFormatError(f"{p}: not a readable {FORMAT} file: {what}"
                                   f"{str(exc)[:200] or type(exc).__name__}") from None


def _finite_float(text: str) -> float:
    v = float(text)
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError(f"metadata number {text[:30]} is out of range")
    return v


def _no_constant(text: str) -> Any:
    raise ValueError(f"metadata must be standard JSON ({text} is not)")


def _depth_within(obj: Any, limit: int) -> bool:
    """Whether lists and dicts in ``obj`` nest at most ``limit`` deep."""
    todo = [(obj, 1)]
    while todo:
        o, d = todo.pop()
        if isinstance(o, (dict, list)):
            if d > limit:
                return False
            todo.extend((c, d + 1) for c in (o.values() if isinstance(o, dict) else o))
    return True


def _parse_meta(text: str) -> dict[str, Any]:
    """An ``@`` line's JSON object: standard JSON (no NaN or infinities,
    which JSON writers refuse), nested at most :data:`MAX_META_DEPTH` deep."""
    try:
        meta = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValueError(f"metadata nested deeper than {MAX_META_DEPTH}") from None
    if not isinstance(meta, dict):
        raise ValueError("metadata must be a JSON object")
    if not _depth_within(meta, MAX_META_DEPTH):
        raise ValueError(f"metadata nested deeper than {MAX_META_DEPTH}")
    return meta


def _ref_line(r: tuple[int, int, int]) -> str:
    idx, dev, b = r
    return f"R {idx} {b}" if not dev else f"R {idx} {b} {dev}"


def _segment_line(g: tuple[int, int, int, int]) -> str:
    idx, dev, addr, size = g
    return f"S {idx} {addr:#x} {size}" if not dev else f"S {idx} {addr:#x} {size} {dev}"


def _int(text: str) -> int:
    if text.startswith(("0x", "0X")):
        return int(text, 16)
    if not text.isdigit():
        raise ValueError(f"{text!r} is not a non-negative integer")
    return int(text)


def _u64(text: str) -> int:
    v = _int(text)
    if v >= _U64:
        raise ValueError(f"{text} does not fit in 64 bits")
    return v


def _id(text: str) -> int:
    v = _u64(text)
    if v == 0:
        raise ValueError("block ids are positive")
    return v


def _size(text: str) -> int:
    v = _int(text)
    if not 0 < v < 1 << 63:
        raise ValueError(f"size {text} out of range")
    return v


def _dev(text: str) -> int:
    v = _int(text)
    if v >= MAX_DEVICE:
        raise ValueError(f"device {text} out of range (devices are 0..{MAX_DEVICE - 1})")
    return v


def load_trace(path: PathLike, **kwargs: Any) -> Trace:
    """:meth:`Trace.load`."""
    return Trace.load(path, **kwargs)


def is_trace_file(path: PathLike) -> bool:
    """Whether ``path`` starts like a gmptrace file (plain or gzip)."""
    try:
        with open(os.fspath(path), "rb") as raw:
            head = raw.read(2)
            raw.seek(0)
            if head == b"\x1f\x8b":
                with gzip.GzipFile(fileobj=raw, mode="rb") as gz:
                    head = gz.read(len(FORMAT))
            else:
                head = raw.read(len(FORMAT))
    except (OSError, EOFError, zlib.error):  # unreadable, or a corrupt gzip stream
        return False
    return head == FORMAT.encode()


# -- importing torch-format device_traces ---------------------------------

_ENTRY_INTS = {"addr": _U64, "size": 1 << 63, "stream": _U64}  # key -> bound (as _u64, _size)
_IMPORTED = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
             "segment_unmap", "oom", "record_stream")


def _akey(addr: Any, handle: Any) -> Any:
    """The key of an address in a snapshot that may merge several pools
    (``gmp.snapshot()``): ours carry their pool's handle (entries:
    ``gpumempool_pool_handle``, ``pool_handle`` before; segments:
    ``segment_pool_id``), torch's none."""
    if type(handle) is int and 0 < handle < 1 << 31:
        return (handle << 64) + addr
    return addr


def _entry_key(e: dict[str, Any]) -> Any:
    return _akey(e.get("addr", 0), e.get("gpumempool_pool_handle", e.get("pool_handle")))


def _segment_handle(s: dict[str, Any]) -> Any:
    pid = s.get("segment_pool_id")
    ours = s.get("gpumempool_pool", s.get("pool"))
    return pid[1] if isinstance(pid, (tuple, list)) and len(pid) == 2 and ours is not None else None


@dataclass
class _Marker:
    t0: int
    t1: int
    event: Event


def _check_snapshot(snap: Any) -> tuple[list[list[dict[str, Any]]], list[dict[str, Any]]]:
    if not isinstance(snap, dict):
        raise TraceFormatError(f"a snapshot is a dict, got {type(snap).__name__}")
    traces = snap.get("device_traces")
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise TraceFormatError("snapshot has no device_traces (a list per device): record history first "
                               "(torch.cuda.memory._record_memory_history() / pool.record_history())")
    if len(traces) > MAX_DEVICE:
        raise TraceFormatError(f"snapshot has {len(traces)} device_traces, more than devices can be ({MAX_DEVICE})")
    seen: set[int] = set()  # a crafted pickle repeats one entry object to multiply the work
    for d, tr in enumerate(traces):
        if id(tr) in seen:
            raise TraceFormatError(f"device_traces[{d}] is the same list as an earlier device's")
        seen.add(id(tr))
        for i, e in enumerate(tr):
            if not isinstance(e, dict) or not isinstance(e.get("action"), str):
                raise TraceFormatError(f"device_traces[{d}][{i}] is not an entry with an 'action'")
            if id(e) in seen:
                raise TraceFormatError(f"device_traces[{d}][{i}] is the same object as an earlier entry")
            seen.add(id(e))
            if e["action"] in _IMPORTED:
                for k, hi in _ENTRY_INTS.items():
                    if k == "size" and e["action"] == "oom":
                        hi = _U64  # the rounded size of any failed request; not used
                    v = e.get(k, 0)
                    if type(v) is not int or not 0 <= v < hi:
                        raise TraceFormatError(f"device_traces[{d}][{i}] ({e['action']}): {k} must be a non-negative "
                                               f"int below 2**{hi.bit_length() - 1}, got {show_value(v)}")
            tu = e.get("time_us", 0)
            if type(tu) not in (int, float):
                raise TraceFormatError(f"device_traces[{d}][{i}]: time_us must be a number, got {show_value(tu)}")
    segments = snap.get("segments", [])
    if not isinstance(segments, list):
        raise TraceFormatError("snapshot segments must be a list")
    good = []
    for s in segments:
        # Segments we cannot use (wrong types, out of range) are left out, as
        # before; an imported trace must stay readable (see _dev, _size, _u64).
        if isinstance(s, dict) and _in_range(s.get("total_size", None), 0, 1 << 63) \
                and _in_range(s.get("device", 0), 0, MAX_DEVICE):
            good.append(s)
    return traces, good


def _in_range(v: Any, lo: int, hi: int) -> TypeGuard[int]:
    return type(v) is int and lo <= v < hi


def _flavor(snap: dict[str, Any], traces: list[list[dict[str, Any]]]) -> str:
    settings = snap.get("allocator_settings")
    # Ours: {"pool": name, "backend": ...} (pool.snapshot) or {"pools": [...]} (gmp.snapshot).
    if isinstance(settings, dict) and (("pool" in settings and "backend" in settings) or "pools" in settings):
        return "gpumempool"
    if RECORD_STREAM_KEY in snap or any(e.get("action") == "record_stream" for t in traces for e in t):
        return "gpumempool"
    return "torch"


def _with_record_streams(snap: dict[str, Any], traces: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    """Our snapshots keep record_stream calls beside device_traces (torch
    has no such action): put them back in place, checked as other entries."""
    try:
        joined = with_record_streams(snap, traces)
    except ValueError as exc:
        raise TraceFormatError(str(exc)) from None
    if joined is not traces:
        _check_snapshot(dict(snap, device_traces=joined))
    return joined


class _VirtualStreams:
    def __init__(self) -> None:
        self.free: list[int] = []
        self.next = 0

    def take(self) -> int:
        if self.free:
            return heapq.heappop(self.free)
        self.next += 1
        return VIRTUAL_STREAM_BASE + self.next

    def give(self, s: int) -> None:
        heapq.heappush(self.free, s)


def _convert(snap: Any, *, source: Optional[str] = None, markers: Optional[list[_Marker]] = None,
             infer_empty_cache: Optional[bool] = None) -> Trace:
    traces, segments = _check_snapshot(snap)
    recorded = traces
    traces = _with_record_streams(snap, traces)
    # The index of each entry in the snapshot's own device_traces (the
    # record_stream calls put back among them have none): Trace.frames
    # reads the stacks there.
    if traces is recorded:
        where: Optional[list[dict[int, int]]] = None
    else:
        where = [{id(e): k for k, e in enumerate(t)} for t in recorded]
    flavor = source or _flavor(snap, traces)
    if infer_empty_cache is None:
        infer_empty_cache = flavor == "torch"

    # Per device: which free_requested entries completed at once.
    immediate: list[list[bool]] = []
    for tr in traces:
        imm = [False] * len(tr)
        for i, e in enumerate(tr):
            if e["action"] == "free_requested" and i + 1 < len(tr):
                nxt = tr[i + 1]
                imm[i] = nxt["action"] == "free_completed" and _entry_key(nxt) == _entry_key(e)
        immediate.append(imm)

    # One list in time order (each device's own order kept).
    if len(traces) == 1:
        merged = [(0, i, e) for i, e in enumerate(traces[0])]
    else:
        merged = [(d, i, e) for _, d, i, e in heapq.merge(
            *[[(e.get("time_us", 0), d, i, e) for i, e in enumerate(tr)] for d, tr in enumerate(traces)],
            key=lambda x: x[0])]
    imported = [(d, i, e) for d, i, e in merged if e["action"] in _IMPORTED]
    unknown: dict[str, int] = {}
    for _, _, e in merged:
        if e["action"] not in _IMPORTED:
            unknown[e["action"]] = unknown.get(e["action"], 0) + 1

    # Pass 1: blocks that were allocated before the trace started.
    live: dict[tuple[int, int], tuple[int, int]] = {}
    seen: set[tuple[int, int]] = set()
    pre: list[tuple[int, int, int, int]] = []  # (device, addr, size, stream)
    for d, _, e in imported:
        a = e["action"]
        k = (d, _entry_key(e))
        if a == "alloc":
            live[k] = (e["size"], e.get("stream", 0))
            seen.add(k)
        elif a == "free_requested":
            if k not in live and k not in seen and e["size"] > 0:
                pre.append((d, k[1], e["size"], e.get("stream", 0)))
                seen.add(k)
            live.pop(k, None)
    for s in segments:
        d = s.get("device", 0)
        stream = s.get("stream", 0)
        if not _in_range(stream, 0, _U64):
            stream = 0
        for b in s.get("blocks", []) if isinstance(s.get("blocks"), list) else []:
            if not isinstance(b, dict) or b.get("state") != "active_allocated":
                continue
            addr = b.get("address")
            size = b.get("requested_size") or b.get("size")
            if not _in_range(addr, 0, _U64) or not _in_range(size, 1, 1 << 63):
                continue
            k = (d, _akey(addr, _segment_handle(s)))
            if k not in live and k not in seen:
                pre.append((d, k[1], size, stream))
                seen.add(k)

    # Reserved bytes at the start: the segments at the end minus the trace's changes.
    delta: dict[int, int] = {}
    for d, _, e in imported:
        a = e["action"]
        if a in ("segment_alloc", "segment_map"):
            delta[d] = delta.get(d, 0) + e["size"]
        elif a in ("segment_free", "segment_unmap"):
            delta[d] = delta.get(d, 0) - e["size"]
    reserved_now: dict[int, int] = {}
    for s in segments:
        d = s.get("device", 0)
        reserved_now[d] = reserved_now.get(d, 0) + s["total_size"]
    has_segment_events = bool(delta) or any(e["action"].startswith("segment_") for _, _, e in imported)
    reserved: dict[int, int] = {}
    for d in set(delta) | set(reserved_now):
        reserved[d] = max(0, reserved_now.get(d, 0) - delta.get(d, 0)) if segments else max(0, -min(0, delta.get(d, 0)))

    tr_out = Trace()
    out = tr_out.events
    series = tr_out.reserved
    for d in sorted(reserved):
        if has_segment_events or segments:
            series.append((0, d, min(reserved[d], _U64 - 1)))

    next_id = 0
    ids: dict[tuple[int, int], int] = {}
    for d, addr, size, stream in pre:
        next_id += 1
        ids[(d, addr)] = next_id
        out.append(Alloc(next_id, size, stream, d))

    start_state = None
    if flavor == "torch":
        from ._start_state import rebuild

        start_state = rebuild(segments, imported, pre, ids, torch_allocator_policy(snap.get("allocator_settings")))

    vstreams = _VirtualStreams()
    vstream_of: dict[int, int] = {}
    pending: dict[tuple[int, int], int] = {}  # (device, addr) -> id waiting for free_completed
    synced: set[int] = set()  # ids whose completion was synced early (before a marker)
    counts = {"allocs": 0, "frees": 0, "deferred_frees": 0, "unmatched_frees": 0, "repaired_allocs": 0,
              "recorded_ooms": 0, "record_stream_entries": 0, "inferred_empty_cache": 0,
              "preexisting_blocks": len(pre), "recorder_calls": 0, "failed_requests": 0}
    marks = sorted(markers or [], key=lambda m: m.t0)
    mi = 0
    n = len(imported)
    # device -> the index of the EmptyCache a run of releases on it was taken for
    release_at: dict[int, int] = {}
    # Each device's entries by position in imported: a release and the
    # allocation it was for are on one device (another's entries may come
    # between them in time).
    same_dev: dict[int, list[int]] = {}
    rank: list[int] = []
    for pos, (d, _, _) in enumerate(imported):
        rank.append(len(same_dev.setdefault(d, [])))
        same_dev[d].append(pos)
    # What the recording shows of memory pressure, per device: the reserved
    # bytes before a run of releases, the peak, the failing attempts' needs
    # and what an OOM entry says the device had (see _recorded_conditions).
    pressure = _Pressure(reserved)
    most_reserved = _most_reserved(reserved, imported)

    def sync_completion(k: tuple[int, int]) -> None:
        bid = pending.get(k)
        if bid is None or bid in synced:
            return
        vs = vstream_of.pop(bid, None)
        if vs is not None:
            out.append(Sync(vs))
            vstreams.give(vs)
        synced.add(bid)

    for pos, (d, i, e) in enumerate(imported):
        a = e["action"]
        tu = e.get("time_us", 0)
        while mi < len(marks) and tu >= marks[mi].t0:
            # Frees that completed inside the call: their streams finished before it.
            m = marks[mi]
            j = pos
            while j < n and imported[j][2].get("time_us", 0) < m.t1:
                d2, _, e2 = imported[j]
                if e2["action"] == "free_completed":
                    sync_completion((d2, _entry_key(e2)))
                j += 1
            out.append(m.event)
            counts["recorder_calls"] += 1
            mi += 1
        k = (d, _entry_key(e))
        if a not in ("segment_free", "segment_unmap"):
            release_at.pop(d, None)
        if a == "alloc":
            if e["size"] <= 0:
                continue
            if k in ids:  # the trace lost a free
                out.append(Free(ids.pop(k)))
                counts["repaired_allocs"] += 1
            next_id += 1
            ids[k] = next_id
            tr_out.snapshot_entries[len(out)] = (d, i if where is None else where[d].get(id(e), -1))
            out.append(Alloc(next_id, e["size"], e.get("stream", 0), d,
                             e.get("gpumempool_caller_sized", e.get("caller_sized")) is True))
            counts["allocs"] += 1
        elif a == "record_stream":
            counts["record_stream_entries"] += 1
            bid = ids.get(k)
            if bid is not None and bid not in vstream_of:
                vstream_of[bid] = vstreams.take()
                out.append(RecordStream(bid, vstream_of[bid]))
        elif a == "free_requested":
            bid = ids.pop(k, None)
            if bid is None:
                counts["unmatched_frees"] += 1
                continue
            counts["frees"] += 1
            if flavor == "gpumempool" and bid > len(pre):
                # The engine defers a free exactly when record_stream added a stream.
                deferred = bid in vstream_of
            else:
                # Torch records no record_stream: a free that did not complete at
                # once waited for streams. (One that completed at the very next
                # allocation looks the same as an immediate one, and replays the same.)
                deferred = not immediate[d][i]
            if deferred:
                counts["deferred_frees"] += 1
                if bid not in vstream_of:
                    vstream_of[bid] = vstreams.take()
                    out.append(RecordStream(bid, vstream_of[bid]))
                pending[k] = bid
            elif bid in vstream_of:  # recorded on a stream but freed at once: that stream was done
                vs = vstream_of.pop(bid)
                out.append(Free(bid))
                out.append(Sync(vs))
                vstreams.give(vs)
                continue
            out.append(Free(bid))
        elif a == "free_completed":
            if k in pending:
                sync_completion(k)
                synced.discard(pending.pop(k))
        elif a in ("segment_alloc", "segment_map", "segment_free", "segment_unmap"):
            grow = a in ("segment_alloc", "segment_map")
            mine, r = same_dev[d], rank[pos]
            prev = imported[mine[r - 1]][2]["action"] if r > 0 else ""
            if not grow and prev not in ("segment_free", "segment_unmap"):
                j = r
                while j < len(mine) and imported[mine[j]][2]["action"] in ("segment_free", "segment_unmap"):
                    j += 1
                after = imported[mine[j]][2]["action"] if j < len(mine) else ""
                if after in ("segment_alloc", "segment_map") and \
                        reserved.get(d, 0) + imported[mine[j]][2]["size"] <= most_reserved.get(d, 0):
                    # The device held that much at another time of the run: the
                    # segment cannot have failed for lack of memory, so the
                    # release was an empty_cache() (whose next request wanted
                    # a new segment), not a retry.
                    after = "empty_cache"
                if after in ("segment_alloc", "segment_map", "oom"):
                    # torch released its cache to retry an allocation that failed
                    pressure.retry(d, reserved.get(d, 0), imported[mine[j]][2] if after != "oom" else None)
            if not grow and infer_empty_cache:
                if prev not in ("segment_free", "segment_unmap"):
                    # Inside one allocation a release is followed by a new
                    # segment (or an OOM); anything else, a cache hit
                    # included, means empty_cache() ran.
                    if after not in ("segment_alloc", "segment_map", "oom"):
                        out.append(EmptyCache())
                        counts["inferred_empty_cache"] += 1
                        release_at[d] = len(out) - 1
            reserved[d] = reserved.get(d, 0) + (e["size"] if grow else -e["size"])
            pressure.seen(d)
            # The release of an empty_cache() happened while serving that event.
            at = release_at[d] if d in release_at and not grow else len(out)
            series.append((at, d, min(max(0, reserved[d]), _U64 - 1)))
            if a == "segment_alloc" and e["size"] > 0:
                # Where the device put it: replay keeps the segments' address order.
                tr_out.segments.append((len(out), d, e.get("addr", 0), e["size"]))
        elif a == "oom":
            counts["recorded_ooms"] += 1
            pressure.oom(d, e)
            size = e.get("size", 0)
            if type(size) is int and 0 < size <= _MAX_OOM_REQUEST:
                # Torch records no alloc for the request it could not serve:
                # replay asks for it (and gives it back at once, as the
                # program went on without it), so that a replay under the
                # recording's conditions runs out of memory where torch did,
                # and a setting fits only if it serves that request too.
                next_id += 1
                # its stack is the OOM entry's
                tr_out.snapshot_entries[len(out)] = (d, i if where is None else where[d].get(id(e), -1))
                out.append(Alloc(next_id, size, e.get("stream", 0), d))
                out.append(Free(next_id))
                counts["failed_requests"] += 1
    while mi < len(marks):
        out.append(marks[mi].event)
        counts["recorder_calls"] += 1
        mi += 1

    if not has_segment_events and not segments:
        series.clear()
    tr_out.meta = {
        "source": flavor,
        "recorded_by": flavor if tr_out.reserved else None,
        "devices": max(len(traces), 1 + max([ev.device for ev in out if type(ev) is Alloc] + [0])),
        **{k: v for k, v in counts.items() if v},
    }
    conditions = pressure.conditions()
    if conditions:
        tr_out.meta["recorded_conditions"] = conditions
    if start_state is not None and start_state.segments:
        tr_out.meta["start_segments"] = [g.as_row() for g in start_state.segments]
    elif start_state is not None and start_state.skipped and any(b for i, _, b in series if i == 0):
        # (only where torch held memory at the start: otherwise nothing was lost)
        tr_out.meta["start_state_skipped"] = start_state.skipped
    if unknown:
        tr_out.meta["ignored_actions"] = unknown
    if flavor == "torch":
        settings = torch_allocator_policy(snap.get("allocator_settings"))
        if settings:
            tr_out.meta["recorded_policy"] = settings
    return tr_out


def _most_reserved(start: dict[int, int], imported: list[tuple[int, int, dict[str, Any]]]) -> dict[int, int]:
    """The most bytes the recording reserved on each device at any time,
    from ``start`` (the bytes at the start) through the segment entries."""
    now, most = dict(start), dict(start)
    for d, _, e in imported:
        a = e["action"]
        if a in ("segment_alloc", "segment_map", "segment_free", "segment_unmap"):
            now[d] = now.get(d, 0) + (e["size"] if a in ("segment_alloc", "segment_map") else -e["size"])
            most[d] = max(most.get(d, 0), now[d])
    return most


#: The largest failed request (an ``oom`` entry's size) a replay asks for:
#: the engine's largest request (1 PiB).
_MAX_OOM_REQUEST = 1 << 50


def _torch_segment_size(size: int) -> int:
    """The segment torch's allocator asks the device for to serve ``size``
    bytes (its small pool's 2 MiB, 20 MiB up to 10 MiB, else 2 MiB steps:
    the engine's sizes, gocore/round.go)."""
    if size <= TORCH_SIZES["small_size"]:
        return TORCH_SIZES["small_buffer"]
    if size < TORCH_SIZES["min_large_alloc"]:
        return TORCH_SIZES["large_buffer"]
    step = TORCH_SIZES["round_large"]
    return -(-size // step) * step


class _Pressure:
    """What a recording shows of the memory its allocator could get.

    Torch releases its cache and retries when the device (or its memory
    fraction) refuses a segment, and records an ``oom`` entry, with the
    device's free bytes, when the retry fails too. So the memory torch
    could get on a device was at least the most it ever reserved there,
    less than the reserved bytes plus the segment of every failing attempt,
    and, at an OOM, about the reserved bytes plus the free ones."""

    def __init__(self, reserved: dict[int, int]) -> None:
        self.reserved = reserved
        self.peak: dict[int, int] = dict(reserved)
        self.retries: dict[int, int] = {}
        self.below: dict[int, int] = {}  # device -> least reserved + segment that failed
        self.at_oom: dict[int, int] = {}  # device -> reserved + device_free at its last OOM
        self.ooms: dict[int, int] = {}

    def seen(self, d: int) -> None:
        r = self.reserved.get(d, 0)
        if r > self.peak.get(d, -1):
            self.peak[d] = r

    def retry(self, d: int, before: int, segment: Optional[dict[str, Any]]) -> None:
        self.retries[d] = self.retries.get(d, 0) + 1
        if segment is not None and segment["action"] == "segment_alloc":
            need = before + segment["size"]
            self.below[d] = min(self.below.get(d, need), need)

    def oom(self, d: int, e: dict[str, Any]) -> None:
        self.ooms[d] = self.ooms.get(d, 0) + 1
        free, size = e.get("device_free"), e.get("size")
        if type(free) is int and 0 <= free < _U64:
            reserved = self.reserved.get(d, 0)
            if type(size) is int and 0 < size and free >= _torch_segment_size(size) and reserved:
                # The device had room for the segment: a limit (torch's memory
                # fraction) refused it, and what was reserved is what it allowed.
                self.at_oom[d] = reserved
            else:
                self.at_oom[d] = reserved + free

    def conditions(self) -> dict[str, Any]:
        """``retries``, ``ooms`` and ``capacity`` (the bytes per device a
        replay needs to meet the recording's pressure; None when it cannot
        be told), with ``how`` it was found. Empty without pressure."""
        if not self.retries and not self.ooms:
            return {}
        devs = set(self.retries) | set(self.ooms)
        caps = {}
        for d in devs:
            cap = self.at_oom.get(d)
            if cap is None or cap < self.peak.get(d, 0):
                cap = self.peak.get(d, 0)
            caps[d] = cap
        capacity: Optional[int] = max(caps.values())
        how = ("reserved + free device memory at the OOM" if self.at_oom and capacity in
               [self.at_oom.get(d) for d in devs] else "the most torch reserved before it released its cache to retry")
        # One capacity for every device: it must hold the others' peaks, and
        # stay below what failed on the devices under pressure.
        others = max([p for d, p in self.peak.items() if d not in devs] + [0])
        if others > (capacity or 0) or any(capacity >= self.below[d] for d in self.below):  # type: ignore[operator]
            capacity, how = None, "the devices' pressures differ: no one capacity meets them all"
        return {"retries": sum(self.retries.values()), "ooms": sum(self.ooms.values()), "capacity": capacity,
                "how": how}


def torch_allocator_policy(settings: Any) -> dict[str, Any]:
    """The replay policy (keys of :data:`gpumempool.replay.POLICY_KEYS`)
    equivalent to a torch snapshot's ``allocator_settings`` (torch >= 2.1):
    max_split_size (torch writes -1 for unlimited), expandable_segments,
    garbage_collection_threshold (it acts only under a limit, which the
    snapshot does not record: pass the memory fraction as ``limit``) and
    roundup_power2_divisions (per size interval, "1".."16"). Settings we do
    not model are left out; defaults are not listed."""
    if not isinstance(settings, dict):
        return {}
    out: dict[str, Any] = {}
    mss = settings.get("max_split_size")
    if isinstance(mss, int) and not isinstance(mss, bool) and 0 < mss < (1 << 62):
        out["max_split_size"] = mss
    if settings.get("expandable_segments") is True:
        out["expandable"] = True
    gc = settings.get("garbage_collection_threshold")
    if isinstance(gc, (int, float)) and not isinstance(gc, bool) and 0 < gc < 1:
        out["garbage_collection_threshold"] = float(gc)
    div = settings.get("roundup_power2_divisions")
    if isinstance(div, dict):
        from ._args import ROUNDUP_INTERVALS, roundup_option

        starts = [str(1 << i) for i in range(ROUNDUP_INTERVALS)]
        if set(map(str, div)) == set(starts):
            # torch writes the intervals by their first size in MiB ("1", "2", "4", ... "32768")
            div = [div[k] if k in div else div[int(k)] for k in starts]
        try:
            vals = roundup_option(div)["roundup_power2_divisions_by_size"]
        except (ValueError, TypeError):  # not torch's 16 intervals of counts
            vals = []
        if any(v > 1 for v in vals):
            out["roundup_power2_divisions"] = vals[0] if len(set(vals)) == 1 else vals
    # max_non_split_rounding_mb has no field of its own: only the setting string says it
    for key, conf in settings.items():
        if isinstance(key, str) and key.endswith("ALLOC_CONF") and isinstance(conf, str):
            m = re.search(r"(?:^|,)\s*max_non_split_rounding_mb\s*:\s*(\d{1,9})\s*(?:,|$)", conf)
            if m and int(m.group(1)) > 20:
                out["max_non_split_rounding_size"] = int(m.group(1)) << 20
    return out


def from_history(pool_or_snapshot: Any, *, infer_empty_cache: bool = False) -> Trace:
    """The trace of a pool's recorded history: ``pool`` (a
    :class:`~gpumempool.MemPool` with history on) or a snapshot dict of ours
    (``pool.snapshot()``, ``gmp.snapshot()``) with ``device_traces``."""
    if hasattr(pool_or_snapshot, "snapshot") and callable(pool_or_snapshot.snapshot):
        snap = pool_or_snapshot.snapshot()
        tr = _convert(snap, source="gpumempool", infer_empty_cache=infer_empty_cache)
        _describe_pool(tr, pool_or_snapshot)
        return tr
    return _convert(pool_or_snapshot, source="gpumempool", infer_empty_cache=infer_empty_cache)


#: The engine's default max_non_split_rounding_size (torch's 20 MiB), left
#: out of recorded policies like the other defaults.
_DEFAULT_MAX_NON_SPLIT_ROUNDING = TORCH_SIZES["large_buffer"]


def _describe_pool(tr: Trace, pool: Any) -> None:
    """Name and policy of the recording pool, for the reader of the trace."""
    try:
        cfg = pool.config()
    except Exception:  # a closed pool, or a stand-in without config()
        return
    tr.meta["pool"] = cfg.get("name")
    pol = {k: cfg[k] for k in ("backend", "limit", "max_split_size", "release_threshold", "roundup_power2_divisions",
                               "garbage_collection_threshold") if cfg.get(k)}
    if cfg.get("max_non_split_rounding_size") not in (None, 0, _DEFAULT_MAX_NON_SPLIT_ROUNDING):
        pol["max_non_split_rounding_size"] = cfg["max_non_split_rounding_size"]
    if cfg.get("roundup_power2_divisions_by_size"):
        pol["roundup_power2_divisions"] = cfg["roundup_power2_divisions_by_size"]
    tr.meta["recorded_policy"] = pol


def from_torch_snapshot(path_or_dict: Union[PathLike, bytes, dict[str, Any]], *,
                        infer_empty_cache: bool = True, max_bytes: int = MAX_PICKLE_BYTES,
                        lenient: bool = False) -> Trace:
    """Import a torch memory snapshot with history: the pickle written by
    ``torch.cuda.memory._record_memory_history()`` then
    ``torch.cuda.memory._dump_snapshot(path)`` (loaded with
    :func:`load_pickle`, which runs none of its content), or its dict
    (``torch.cuda.memory._snapshot()``). gpumempool's own snapshots are
    recognised and imported as :func:`from_history` does.

    A snapshot without history (no events, one, or none that allocates) is
    refused, and so is the first malformed entry or segment (a missing or
    mistyped field, an unknown action, an alloc at a live block's address,
    a double free, more than 1 PiB), naming the file, device and entry:
    :class:`TraceFormatError`. With ``lenient``, malformed entries and
    segments are left out instead, and counted in the trace's ``meta``
    (``skipped_events``, ``skipped_segments``, ``first_skipped``)."""
    if isinstance(path_or_dict, dict):
        snap = path_or_dict
        name = "<dict>"
    else:
        snap = load_pickle(path_or_dict, max_bytes=max_bytes)
        name = "<bytes>" if isinstance(path_or_dict, (bytes, bytearray)) else os.fspath(path_or_dict)
    checked = check_history(snap, name, block_key=_entry_key, lenient=lenient)
    trimmed = checked.snapshot is not snap  # lenient left entries out: indices are the copy's
    snap = checked.snapshot
    try:
        traces, _ = _check_snapshot(snap)
    except TraceFormatError as exc:
        raise TraceFormatError(f"{name}: {exc}") from None
    flavor = _flavor(snap, traces)
    tr = _convert(snap, source=flavor, infer_empty_cache=infer_empty_cache and flavor == "torch")
    if name not in ("<dict>", "<bytes>"):
        tr.meta["file"] = os.path.basename(name)
    # read again for Trace.frames (the file is not held here)
    tr.snapshot = snap if trimmed else path_or_dict
    checked.describe(tr.meta)
    return tr


# -- recording --------------------------------------------------------------


def _next_tick_us() -> int:
    """Wait for the microsecond clock (the one history entries use) to tick;
    the returned time is later than every event recorded before the call."""
    t = time.time_ns() // 1000
    while True:
        u = time.time_ns() // 1000
        if u != t:
            return u


class TraceRecorder:
    """Record a pool's allocator requests as a :class:`Trace`::

        with TraceRecorder(pool) as rec:
            ... # allocate and free
        rec.trace.save("run.trace.gz")

    Turns the pool's history on (dropping what it recorded before) and back
    off on exit (or to the settings of :func:`gpumempool.record_history`),
    and records ``empty_cache`` and ``trim`` calls made on ``pool`` through
    Python, which the engine's history does not show. ``max_entries`` bounds
    the engine's history ring; a warning says when it overflowed.
    """

    def __init__(self, pool: "MemPool", max_entries: int = 10_000_000) -> None:
        self.pool = pool
        self.max_entries = max_entries
        self.trace: Optional[Trace] = None
        self._markers: list[_Marker] = []

    def __enter__(self) -> "TraceRecorder":
        pool = self.pool
        pool.record_history(True, max_entries=self.max_entries)
        markers = self._markers
        empty_cache, trim = pool.empty_cache, pool.trim

        def recorded(call: Callable[[], int], event: Callable[[], Event]) -> int:
            """Run call and record event: a call the pool refused (bad
            arguments) did nothing and is not recorded; one that failed on
            the way (a backend error) may have released some, and is."""
            t0 = _next_tick_us()
            try:
                released = call()
            except (ValueError, TypeError):
                raise
            except BaseException:
                markers.append(_Marker(t0, _next_tick_us(), event()))
                raise
            markers.append(_Marker(t0, _next_tick_us(), event()))
            return released

        def recorded_empty_cache() -> int:
            return recorded(empty_cache, EmptyCache)

        def recorded_trim(keep_bytes: int = 0, device: Optional[Any] = None) -> int:
            from ._args import device_index

            return recorded(lambda: trim(keep_bytes, device),
                            lambda: Trim(int(keep_bytes), None if device is None else device_index(device)))

        recorded_empty_cache.__doc__ = empty_cache.__doc__
        recorded_trim.__doc__ = trim.__doc__
        pool.empty_cache = recorded_empty_cache  # type: ignore[method-assign]
        pool.trim = recorded_trim  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        from ._snapshot import history_settings

        pool = self.pool
        for name in ("empty_cache", "trim"):
            pool.__dict__.pop(name, None)
        if pool.closed:
            if exc and exc[0] is not None:
                return  # don't hide the exception that closed it
            raise RuntimeError("TraceRecorder: the pool was closed inside the block; its history is gone")
        snap = pool.snapshot()
        n = sum(len(t) for t in snap["device_traces"])
        if n >= self.max_entries:
            warnings.warn(f"TraceRecorder: the history ring ({self.max_entries} entries) overflowed; "
                          "the trace lacks the first events (raise max_entries)", RuntimeWarning, stacklevel=2)
        self.trace = _convert(snap, source="gpumempool", markers=self._markers, infer_empty_cache=False)
        _describe_pool(self.trace, pool)
        settings = history_settings()
        if settings is None:
            pool.record_history(False)
        else:
            pool.record_history(True, max_entries=settings[0], stacks=settings[1])
