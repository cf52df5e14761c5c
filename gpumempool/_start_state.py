"""Where torch's allocator was at a snapshot's first traced event.

Most real snapshots start in the middle of a run: history is switched on
after the model is loaded, so torch already held segments, some of their
blocks allocated and the rest cached, when the first event was recorded. A
replay that starts from an empty device obtains other segments, and best
fit then chooses other blocks. This module rebuilds torch's segments at the
first event from the dump-time ``segments`` walked back through the trace
(segments the trace obtained are taken out, those it released put back),
lays the blocks that were live then at torch's addresses, and leaves the
rest of each segment cached, as one free block between two live ones:
torch merges free neighbours, so no two free blocks touch.

The size of a live block whose only record is a ``free_requested`` (its
request, not its block) is its request rounded as torch rounds it (to 512
bytes, or by the recorded ``roundup_power2_divisions``), grown to the
next block when the rest could not have been split off (1 MiB or less in
the large pool; torch keeps such a rest in the block) or when it is
oversize (torch never splits those). Were the rest a separate free block
instead, nothing but the allocated-bytes figure would differ: a large-pool
block of 1 MiB or less serves no large request.

Segments of expandable segments (``segment_map``) and of private pools
(CUDA graphs, ``torch.cuda.MemPool``) are not rebuilt: replay does not seed
those, and their blocks are allocated at the start as before (before
the seeded segments are made: they do not take torch's default pool's cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ._policy import TORCH_SIZES

__all__ = ["StartSegment", "StartState", "rebuild"]

# torch's sizes, as the engine follows them (gocore/round.go).
#: torch's kSmallSize: the largest request of the small pool, and the
#: largest rest of a large block that is not split off.
SMALL_SIZE: int = TORCH_SIZES["small_size"]
#: torch's kSmallBuffer: the size of a small-pool segment.
SMALL_BUFFER: int = TORCH_SIZES["small_buffer"]
#: torch's kMinBlockSize: every block size is a multiple of it.
MIN_BLOCK: int = TORCH_SIZES["min_block_size"]
#: torch's default max_non_split_rounding_size (kLargeBuffer): how much
#: larger than an oversize request the cached block that serves it may be.
DEFAULT_NON_SPLIT_ROUNDING: int = TORCH_SIZES["large_buffer"]


@dataclass
class StartSegment:
    """One segment torch held at the first event: ``blocks`` are
    ``(size, id)`` in address order, ``id`` the trace's block allocated at
    the start (its ``Alloc`` comes first in the trace), 0 for a cached one."""

    device: int
    addr: int
    stream: int
    small: bool
    blocks: list[tuple[int, int]] = field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(s for s, _ in self.blocks)

    def as_row(self) -> list[Any]:
        return [self.device, self.addr, self.stream, int(self.small), [x for b in self.blocks for x in b]]

    @classmethod
    def from_row(cls, row: Any) -> "StartSegment":
        """A segment from its :meth:`as_row` form (trace metadata); raises
        ValueError when the row is not one."""
        if not isinstance(row, list) or len(row) != 5 or not all(type(v) is int and v >= 0 for v in row[:4]) \
                or not isinstance(row[4], list) or len(row[4]) % 2 or not row[4] \
                or not all(type(v) is int and v >= 0 for v in row[4]):
            raise ValueError("a start segment is [device, addr, stream, small, [size, id, ...]]")
        flat = row[4]
        return cls(row[0], row[1], row[2], bool(row[3]), [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)])


@dataclass
class StartState:
    """What :func:`rebuild` found: the segments, or why there are none."""

    segments: list[StartSegment]
    #: why the state was not rebuilt (None: it was, or nothing was there)
    skipped: Optional[str] = None

    @property
    def reserved(self) -> int:
        return sum(s.size for s in self.segments)


def _round(requested: int, divisions: Any = 0) -> int:
    """torch's round_size: ``requested`` up to 512 bytes, or, with
    ``roundup_power2_divisions`` (one count, or one per size interval as
    :func:`gpumempool.trace.torch_allocator_policy` gives them), up to the
    next of that many steps between the powers of two around it."""
    if isinstance(divisions, (list, tuple)):
        log = max(requested, 1).bit_length() - 1
        divisions = divisions[0 if log <= 20 else min(log - 20, len(divisions) - 1)] if divisions else 0
    div = divisions if type(divisions) is int else 0
    if div < 2 or requested <= MIN_BLOCK * div or requested & (requested - 1) == 0:
        return max(MIN_BLOCK, -(-requested // MIN_BLOCK) * MIN_BLOCK)
    step = (1 << (requested.bit_length() - 1)) // div
    return -(-requested // step) * step


def rebuild(segments: list[dict[str, Any]], imported: list[tuple[int, int, dict[str, Any]]],
            pre: list[tuple[int, Any, int, int]], ids: dict[tuple[int, Any], int],
            settings: Optional[dict[str, Any]] = None) -> StartState:
    """The segments of torch's default pools at the first of the
    ``imported`` events ``(device, index, entry)``, from the dump-time
    ``segments``; ``pre`` are the blocks live then ``(device, addr, size,
    stream)`` with their trace ids in ``ids[(device, addr)]``. ``settings``
    is the recorded policy (its ``max_split_size`` and
    ``max_non_split_rounding_size`` decide which blocks were not split)."""
    settings = settings or {}
    live_at_dump: dict[tuple[int, int], int] = {}  # (device, addr) -> block size
    start: dict[tuple[int, int], dict[str, Any]] = {}
    for s in segments:
        addr, size, dev = s.get("address"), s.get("total_size"), s.get("device", 0)
        if type(addr) is not int or type(size) is not int or size <= 0:
            continue
        if s.get("is_expandable") is True:
            return StartState([], "expandable segments")
        pid = s.get("segment_pool_id")
        private = isinstance(pid, (tuple, list)) and any(v != 0 for v in pid)
        stream = s.get("stream", 0)
        start[(dev, addr)] = {"size": size, "stream": stream if type(stream) is int and stream >= 0 else 0,
                              "small": s.get("segment_type") == "small" and size <= SMALL_BUFFER,
                              "private": private}
        for b in s.get("blocks") or []:
            if isinstance(b, dict) and b.get("state") == "active_allocated" and type(b.get("address")) is int \
                    and type(b.get("size")) is int:
                live_at_dump[(dev, b["address"])] = b["size"]
    for d, _, e in imported:
        if e["action"] in ("alloc", "free_requested"):
            # A block the trace touched may have been another one at the start.
            live_at_dump.pop((d, e.get("addr", 0)), None)
    for d, _, e in reversed(imported):
        a = e["action"]
        if a in ("segment_map", "segment_unmap"):
            return StartState([], "expandable segments")
        if a == "segment_alloc":
            start.pop((d, e.get("addr", 0)), None)
        elif a == "segment_free":
            size = e.get("size", 0)
            stream = e.get("stream", 0)
            start[(d, e.get("addr", 0))] = {"size": size, "stream": stream, "small": size == SMALL_BUFFER,
                                            "private": False}
    if not start:
        return StartState([])
    mss = settings.get("max_split_size") or 0
    nsr = settings.get("max_non_split_rounding_size") or DEFAULT_NON_SPLIT_ROUNDING
    divisions = settings.get("roundup_power2_divisions") or 0
    by_dev: dict[int, list[tuple[int, int, int]]] = {}  # device -> [(addr, requested, id)]
    for d, addr, size, _ in pre:
        if type(addr) is int:
            by_dev.setdefault(d, []).append((addr, size, ids[(d, addr)]))
    out: list[StartSegment] = []
    for (d, base), s in sorted(start.items()):
        if s["private"]:
            continue
        end = base + s["size"]
        lives = sorted(x for x in by_dev.get(d, []) if base <= x[0] < end)
        seg = StartSegment(d, base, s["stream"], s["small"])
        cursor = base
        for k, (addr, requested, bid) in enumerate(lives):
            nxt = lives[k + 1][0] if k + 1 < len(lives) else end
            if addr < cursor or addr % MIN_BLOCK or (addr - base) % MIN_BLOCK:
                return StartState([], f"blocks overlap or are misaligned in the segment at {base:#x}")
            if addr > cursor:
                seg.blocks.append((addr - cursor, 0))
            size = live_at_dump.get((d, addr)) or _round(requested, divisions)
            rest = nxt - addr - size
            if rest < 0:
                return StartState([], f"the block at {addr:#x} overlaps the next one")
            oversize = bool(mss) and size >= mss
            if rest and not s["small"] and (rest <= SMALL_SIZE or (oversize and rest <= nsr)):
                size += rest  # torch kept the rest in the block
            seg.blocks.append((size, bid))
            cursor = addr + size
        if cursor < end:
            seg.blocks.append((end - cursor, 0))
        out.append(seg)
    return StartState(out)
