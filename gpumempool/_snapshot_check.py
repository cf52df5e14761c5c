"""The checks a snapshot's history passes before it is imported as a trace
(:func:`gpumempool.trace.from_torch_snapshot`, and, without the demand for
a replayable history, :func:`~gpumempool.trace.from_history` and
:class:`~gpumempool.trace.TraceRecorder`): the one pass over a snapshot
on every path to a trace.

A snapshot without history (``device_traces`` empty, one event, or events
none of which allocates) is refused: a replay of it would only re-allocate
the blocks live at the dump and report a saving that means nothing. Every
entry that is not what torch writes (a field missing or of the wrong type,
an unknown action, an alloc at an address whose block is still live, a
second free of a block, a size no device has) is refused naming the file,
the device and the index of the entry, or, ``lenient``, left out and
counted; so is a segment that is not what torch writes.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional

from ._args import MAX_DEVICE
from ._snapshot import CACHE_CALLS_KEY, RECORD_STREAM_INDEX, RECORD_STREAM_KEY
from ._trace_errors import MalformedEventError, MalformedSegmentError, NoHistoryError, TraceFormatError

__all__ = ["CheckedSnapshot", "check_history"]

#: 1 PiB: no device holds as much, so a larger size in an entry or a
#: segment is a corrupt or crafted file (replays would fail on it later,
#: without naming the entry).
MAX_BYTES = 1 << 50

_U64 = 1 << 64
#: The actions that say what the allocator did (torch's TraceEntry, and
#: gpumempool's record_stream).
MEMORY_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
                  "segment_unmap", "oom", "record_stream")
#: Torch's other actions, which say nothing about memory: a snapshot was
#: taken, a user's annotation (torch >= 2.5).
OTHER_ACTIONS = ("snapshot", "user_defined")
#: The fields the importer needs from each action (torch writes addr, size
#: and stream on all but oom, which has device_free instead of addr).
_REQUIRED = {
    "alloc": ("addr", "size"),
    "free_requested": ("addr", "size"),  # the size of a block allocated before the trace
    "free_completed": ("addr",),
    "segment_alloc": ("addr", "size"),
    "segment_free": ("addr", "size"),
    "segment_map": ("addr", "size"),
    "segment_unmap": ("addr", "size"),
    "record_stream": ("addr",),
    "oom": (),
}


@dataclass
class CheckedSnapshot:
    """What :func:`check_history` passed: ``snapshot`` (the one given, or
    with what ``lenient`` left out removed from a shallow copy), the number
    of events and segments left out, and the first reason."""

    snapshot: dict[str, Any]
    #: The name errors give (a file's, ``<dict>``...).
    file: str = ""
    skipped_events: int = 0
    skipped_segments: int = 0
    first_skipped: Optional[str] = None

    def describe(self, meta: dict[str, Any]) -> None:
        """Record what was left out in a trace's metadata."""
        if self.skipped_events:
            meta["skipped_events"] = self.skipped_events
        if self.skipped_segments:
            meta["skipped_segments"] = self.skipped_segments
        if self.first_skipped:
            meta["first_skipped"] = self.first_skipped


def show_value(v: Any) -> str:
    """A value of untrusted data for an error message: a short int as is,
    anything else by its type (never its repr, which can be huge)."""
    if type(v) is int and -(10**20) < v < 10**20:
        return str(v)
    if type(v) is int:
        return f"an int of {v.bit_length()} bits"
    return type(v).__name__


def _int_problem(name: str, v: Any, hi: int) -> Optional[str]:
    """Why ``v`` is not an int in [0, hi], or None."""
    if type(v) is not int:
        return f"{name} must be an int, got {show_value(v)}"
    if v < 0:
        return f"{name} must not be negative, got {show_value(v)}"
    if v > hi:
        if hi == MAX_BYTES:
            return f"{name} must be at most 2**50 bytes (1 PiB, more than any device holds), got {show_value(v)}"
        return f"{name} must be below 2**64, got {show_value(v)}"
    return None


def _entry_problem(e: dict[str, Any], a: str) -> Optional[str]:
    """Why entry ``e`` of action ``a`` (a memory action) is malformed in
    itself, or None."""
    for k in _REQUIRED[a]:
        if k not in e:
            return f"missing {k!r}"
    for k, hi in (("addr", _U64 - 1), ("size", _U64 - 1 if a == "oom" else MAX_BYTES), ("stream", _U64 - 1)):
        if k in e:
            why = _int_problem(k, e[k], hi)
            if why:
                return why
    return None


_LIVE, _FREED = 0, 1


class _Checker:
    """The entries of a snapshot, one at a time; raises the first error, or
    with ``lenient`` counts it."""

    def __init__(self, file: str, lenient: bool, block_key: Callable[[dict[str, Any]], Hashable]) -> None:
        self.file = file
        self.lenient = lenient
        self.block_key = block_key
        self.skipped = 0
        self.first: Optional[str] = None
        # (device, block key) -> (_LIVE or _FREED, index of that event)
        self.blocks: dict[tuple[int, Hashable], tuple[int, int]] = {}
        self.memory_events = 0
        self.allocs = 0
        self.last_action: Optional[str] = None

    def bad(self, d: int, i: int, action: Optional[str], reason: str) -> None:
        err = MalformedEventError(self.file, d, i, action, reason)
        if not self.lenient:
            raise err
        self.skipped += 1
        if self.first is None:
            self.first = str(err)[len(self.file) + 2:]

    def entry(self, d: int, i: int, e: Any) -> bool:
        """Whether entry ``i`` of device ``d`` is kept."""
        if not isinstance(e, dict) or not isinstance(e.get("action"), str):
            self.bad(d, i, None, "not an entry with an 'action'")
            return False
        a = e["action"]
        tu = e.get("time_us", 0)
        if type(tu) not in (int, float):
            self.bad(d, i, a, f"time_us must be a number, got {show_value(tu)}")
            return False
        if a in OTHER_ACTIONS:
            return True
        if a not in MEMORY_ACTIONS:
            self.bad(d, i, a, f"unknown action (torch writes {', '.join(MEMORY_ACTIONS[:-1] + OTHER_ACTIONS)})")
            return False
        why = _entry_problem(e, a)
        if why:
            self.bad(d, i, a, why)
            return False
        if a in ("alloc", "free_requested", "free_completed"):
            k = (d, self.block_key(e))
            state = self.blocks.get(k)
            if a == "alloc" and e["size"] > 0:
                if state is not None and state[0] == _LIVE:
                    self.bad(d, i, a, f"alloc at {e['addr']:#x}, where the block allocated at event {state[1]} "
                                      "is still live (no free between them)")
                    return False
                self.blocks[k] = (_LIVE, i)
                self.allocs += 1
            elif a == "free_requested":
                # A free of an address the trace has not seen is a block
                # allocated before history was on; a second one is not.
                if state is not None and state[0] == _FREED:
                    self.bad(d, i, a, f"free of the block at {e['addr']:#x}, already freed at event {state[1]} "
                                      "(a double free)")
                    return False
                self.blocks[k] = (_FREED, i)
            elif a == "free_completed" and state is not None and state[0] == _LIVE:
                self.bad(d, i, a, f"free_completed of the block at {e['addr']:#x} allocated at event {state[1]}, "
                                  "which was never freed")
                return False
        self.memory_events += 1
        self.last_action = a
        return True


def _segment_problem(s: Any) -> Optional[str]:
    """Why segment ``s`` is not one torch writes, or None."""
    if not isinstance(s, dict):
        return f"not a dict, got {show_value(s)}"
    for k in ("device", "total_size", "blocks"):
        if k not in s:
            return f"missing {k!r}"
    why = _int_problem("total_size", s["total_size"], MAX_BYTES)
    if why:
        return why
    d = s["device"]
    if type(d) is not int or not 0 <= d < MAX_DEVICE:
        return f"device must be an int in 0..{MAX_DEVICE - 1}, got {show_value(d)}"
    for k in ("address", "stream"):
        if k in s:
            why = _int_problem(k, s[k], _U64 - 1)
            if why:
                return why
    blocks = s["blocks"]
    if not isinstance(blocks, list):
        return f"blocks must be a list, got {show_value(blocks)}"
    for j, b in enumerate(blocks):
        if not isinstance(b, dict):
            return f"block {j} is not a dict, got {show_value(b)}"
        for k, hi in (("address", _U64 - 1), ("size", MAX_BYTES), ("requested_size", MAX_BYTES)):
            if k in b:
                why = _int_problem(k, b[k], hi)
                if why:
                    return f"block {j}: {why}"
        if not isinstance(b.get("state", ""), str):
            return f"block {j}: state must be a str, got {show_value(b['state'])}"
    return None


def check_history(snap: Any, file: str, *, block_key: Callable[[dict[str, Any]], Hashable],
                  lenient: bool = False, replayable: bool = True) -> CheckedSnapshot:
    """Check the history of the snapshot ``snap`` (read from ``file``, the
    name errors give) before it is imported. ``block_key(entry)`` tells the
    blocks of a device apart as the importer does (by address, and by pool
    in a snapshot of several of gpumempool's pools).

    Raises :class:`NoHistoryError` when there is nothing to replay,
    :class:`MalformedEventError` for the first malformed entry and
    :class:`MalformedSegmentError` for the first malformed segment (or no
    ``segments``), all :class:`~gpumempool.trace.TraceFormatError`. With
    ``lenient``, malformed entries and segments are left out of the returned
    snapshot and counted instead (a snapshot without ``segments`` is taken
    to have none); a snapshot without history is refused all the same.
    Without ``replayable`` (a snapshot of our own pools, whose history may
    be short or empty), a short history is not refused and missing
    ``segments`` are none.

    This is the one check of a snapshot on every path to a trace: the
    importer (:mod:`gpumempool.trace`) takes the returned snapshot, whose
    ``segments`` is a list, as it is."""
    if not isinstance(snap, dict):
        raise TraceFormatError(f"{file}: a snapshot is a dict, got {type(snap).__name__}")
    traces = snap.get("device_traces")
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise NoHistoryError(file, "no device_traces, a list per device")
    if len(traces) > MAX_DEVICE:
        raise TraceFormatError(f"{file}: snapshot has {len(traces)} device_traces, more than devices can be "
                               f"({MAX_DEVICE})")
    check = _Checker(file, lenient, block_key)
    seen: set[int] = set()  # a crafted snapshot repeats one entry object to multiply the work
    bad: list[set[int]] = []
    for d, tr in enumerate(traces):
        if id(tr) in seen:
            raise TraceFormatError(f"{file}: device_traces[{d}] is the same list as an earlier device's")
        seen.add(id(tr))
        left_out: set[int] = set()
        for i, e in enumerate(tr):
            if id(e) in seen:
                raise TraceFormatError(f"{file}: device_traces[{d}][{i}] is the same object as an earlier entry")
            seen.add(id(e))
            if not check.entry(d, i, e):
                left_out.add(i)
        bad.append(left_out)

    out = CheckedSnapshot(snap, file, check.skipped, 0, check.first)
    segments = snap.get("segments")
    kept_segments = segments
    if segments is None and not replayable:
        kept_segments = []
    elif segments is None:
        missing = ("no 'segments' (torch writes them with the history: the file was edited, or is not a "
                   "torch snapshot)")
        if not lenient:
            raise MalformedSegmentError(file, None, missing)
        out.first_skipped = out.first_skipped or missing
        kept_segments = []
    elif not isinstance(segments, list):
        raise MalformedSegmentError(file, None, f"segments must be a list, got {show_value(segments)}")
    else:
        kept_segments = []
        for j, s in enumerate(segments):
            why = _segment_problem(s)
            if why is None:
                kept_segments.append(s)
                continue
            err = MalformedSegmentError(file, j, why)
            if not lenient:
                raise err
            out.skipped_segments += 1
            out.first_skipped = out.first_skipped or str(err)[len(file) + 2:]

    if replayable:
        _require_history(check, traces, file)

    if out.skipped_events or out.skipped_segments or segments is None:
        copy = dict(snap)
        copy["device_traces"] = [[e for i, e in enumerate(tr) if i not in left] if left else tr
                                 for tr, left in zip(traces, bad)]
        copy["segments"] = kept_segments
        for key in (RECORD_STREAM_KEY, CACHE_CALLS_KEY):
            aside = snap.get(key)
            if out.skipped_events and isinstance(aside, list):
                # Our record_stream and cache calls kept aside name their place in
                # device_traces: the same entry's place once others are left out.
                copy[key] = [_moved_back(x, bad[d]) if d < len(bad) and bad[d] and isinstance(x, list)
                             else x for d, x in enumerate(aside)]
        out.snapshot = copy
    return out


def _require_history(check: _Checker, traces: list[Any], file: str) -> None:
    """Refuse a history with nothing to replay (see the module doc)."""
    if check.memory_events == 0:
        n = sum(len(t) for t in traces)
        left = f", {check.skipped:,} of them malformed" if check.skipped else ""
        raise NoHistoryError(file, "device_traces has no events" if n == 0 else
                             f"device_traces has {n:,} events{left}, none about memory")
    if check.memory_events == 1:
        raise NoHistoryError(file, f"a history of one event, {check.last_action}")
    if check.allocs == 0:
        raise NoHistoryError(file, f"none of its {check.memory_events:,} events allocates")


def _moved_back(aside: list[Any], left_out: set[int]) -> list[Any]:
    """The record_stream entries ``aside`` of one device with their index
    in device_traces lowered by the entries left out before it (an entry
    that is not one is kept as it is, for the importer to refuse)."""
    gone = sorted(left_out)
    out = []
    for e in aside:
        where = e.get(RECORD_STREAM_INDEX) if isinstance(e, dict) else None
        if type(where) is int:
            e = dict(e, **{RECORD_STREAM_INDEX: where - bisect.bisect_left(gone, where)})
        out.append(e)
    return out
