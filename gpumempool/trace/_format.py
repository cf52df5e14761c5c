"""The gmptrace file format (see :mod:`gpumempool.trace`): the events a
trace holds, the text of each record, the syntax of its fields, the limits
a reader enforces, and the rule of block ids (:class:`Checker`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional, Union

from .._args import MAX_DEVICE

FORMAT = "gmptrace"
#: The newest version this module reads and writes (see the module doc).
VERSION = 2
#: The versions it reads.
VERSIONS = (1, 2)
#: Streams at or above this are virtual streams made by the importers.
VIRTUAL_STREAM_BASE = 1 << 63
U64 = 1 << 64
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


def event_line(e: Event) -> str:
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


# -- limits of a reader -----------------------------------------------------

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
PROGRESS_LINES = 1 << 16


@dataclass
class Meta:
    """An ``@`` record, as the reader yields it."""

    meta: dict[str, Any]


# -- the records a reader yields ----------------------------------------------


class Checker:
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
Record = Union[Event, tuple[int, int, int], tuple[int, int, int, int], Meta]


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


def parse_meta(text: str) -> dict[str, Any]:
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


def ref_line(r: tuple[int, int, int]) -> str:
    idx, dev, b = r
    return f"R {idx} {b}" if not dev else f"R {idx} {b} {dev}"


def segment_line(g: tuple[int, int, int, int]) -> str:
    idx, dev, addr, size = g
    return f"S {idx} {addr:#x} {size}" if not dev else f"S {idx} {addr:#x} {size} {dev}"


def parse_int(text: str) -> int:
    if text.startswith(("0x", "0X")):
        return int(text, 16)
    if not text.isdigit():
        raise ValueError(f"{text!r} is not a non-negative integer")
    return int(text)


def parse_u64(text: str) -> int:
    v = parse_int(text)
    if v >= U64:
        raise ValueError(f"{text} does not fit in 64 bits")
    return v


def parse_id(text: str) -> int:
    v = parse_u64(text)
    if v == 0:
        raise ValueError("block ids are positive")
    return v


def parse_size(text: str) -> int:
    v = parse_int(text)
    if not 0 < v < 1 << 63:
        raise ValueError(f"size {text} out of range")
    return v


def parse_device(text: str) -> int:
    v = parse_int(text)
    if v >= MAX_DEVICE:
        raise ValueError(f"device {text} out of range (devices are 0..{MAX_DEVICE - 1})")
    return v

