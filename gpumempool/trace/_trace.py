"""A trace in memory (:class:`Trace`) or read as a stream from its file
(:class:`TraceFile`), and writing one atomically."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import secrets
import stat
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

from .._safepickle import load_pickle
from .._trace_errors import TraceFormatError
from ._format import (FORMAT, VERSION, Alloc, Checker, EmptyCache, Event, Free, Meta, PathLike, RecordStream, Sync, Trim,
                      event_line, ref_line, segment_line)
from ._reader import file_records, records

__all__ = ["Trace", "TraceFile", "load_trace", "save_atomically"]


class Provenance:
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
class Trace(Provenance):
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
        check = Checker()
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
        save_atomically(path, self._write)

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
        ref = sorted([(r[0], 0, i, ref_line(r)) for i, r in enumerate(self.reserved)]
                     + [(g[0], 1, i, segment_line(g)) for i, g in enumerate(self.segments)])
        j = 0
        buf: list[str] = []
        for i, e in enumerate(self.events):
            while j < len(ref) and ref[j][0] <= i:
                buf.append(ref[j][3])
                j += 1
            buf.append(event_line(e))
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
        return cls._collect(file_records(os.fspath(path), max_events, progress))

    @classmethod
    def loads(cls, text: str, *, max_events: int = 100_000_000) -> "Trace":
        """Parse a trace from text."""
        return cls._collect(records(io.StringIO(text), "<string>", max_events))

    @classmethod
    def _collect(cls, recs: Iterator[Any]) -> "Trace":
        tr = cls()
        events, reserved, segments = tr.events, tr.reserved, tr.segments
        for r in recs:
            if type(r) is Meta:
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


def save_atomically(path: PathLike, write: Callable[[Any], None]) -> None:
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


class TraceFile(Provenance):
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
        check = Checker()
        for r in file_records(self.path, max_events, progress, check, events=False):
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
        for r in file_records(self.path, self.max_events):
            if type(r) is not tuple and type(r) is not Meta:
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
            for r in file_records(self.path, self.max_events):
                t = type(r)
                if t is Meta:
                    continue
                buf.append((ref_line(r) if len(r) == 3 else segment_line(r)) if t is tuple  # type: ignore[arg-type]
                           else event_line(r))  # type: ignore[arg-type]
                if len(buf) >= 8192:
                    f.write("\n".join(buf) + "\n")
                    buf.clear()
            if buf:
                f.write("\n".join(buf) + "\n")

        save_atomically(path, write)


def load_trace(path: PathLike, **kwargs: Any) -> Trace:
    """:meth:`Trace.load`."""
    return Trace.load(path, **kwargs)
