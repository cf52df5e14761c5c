"""Where a replay starts on its simulated device: the address order of the
recorded segments, packed into the device's placement window
(``pool.sim.place_next``), and the segments the recording allocator held at
the trace's first event (``meta["start_segments"]``, see
:mod:`gpumempool._start_state`), seeded into the pool before the first
event."""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Optional, Sequence, Union

from ._errors import InvalidArgumentError, OutOfMemoryError
from ._start_state import StartSegment
from .trace import Alloc, Trace, TraceFile

if TYPE_CHECKING:
    from ._pool import MemPool

__all__ = ["placements", "seed", "start_segments"]

#: Boundary at which each run of recorded segments starts when they are
#: packed into the simulated device's placement window (CUDA aligns
#: segments of 2 MiB and more to it).
_PLACEMENT_RUN_ALIGN = 2 << 20
#: The simulated device's address alignment (its default, which replay keeps):
#: placements must be multiples of it.
_SIM_ALIGNMENT = 512


def placements(trace: Union[Trace, TraceFile], devices: int, start: Sequence[StartSegment] = ()
                ) -> tuple[dict[int, list[tuple[int, int, int]]], list[Optional[int]]]:
    """The recorded segments (``trace.segments``) by the index of the event
    that obtained them, as ``(device, offset, size)`` with offsets into the
    simulated device's placement window (``pool.sim.place_next``)
    that keep their address order. The ranges of a device are packed: each
    run of overlapping or touching ranges keeps its layout, the runs follow
    each other in address order from 2 MiB boundaries, and the gaps between
    them, which order nothing, go (CUDA's address space is sparse; the
    window holds at least the device's capacity). The segments held at the
    start (``start``) take part in the address order; their offsets are
    returned too, in their order (None: placed first fit)."""
    ranges: dict[int, list[tuple[int, int]]] = {}
    for _, dev, addr, size in trace.segments:
        if dev < devices:
            ranges.setdefault(dev, []).append((addr, addr + size))
    for g in start:
        if g.device < devices:
            ranges.setdefault(g.device, []).append((g.addr, g.addr + g.size))
    runs: dict[int, tuple[list[int], list[int]]] = {}  # device -> (run starts, their offsets)
    for dev, rs in ranges.items():
        merged: list[list[int]] = []
        for lo, hi in sorted(rs):
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        starts, offsets, cursor = [], [], 0
        for lo, hi in merged:
            off = -(-cursor // _PLACEMENT_RUN_ALIGN) * _PLACEMENT_RUN_ALIGN
            starts.append(lo)
            offsets.append(off)
            cursor = off + hi - lo
        runs[dev] = (starts, offsets)
    def offset(dev: int, addr: int) -> Optional[int]:
        starts, offsets = runs[dev]
        k = bisect.bisect_right(starts, addr) - 1
        off = offsets[k] + addr - starts[k]
        # Recorded addresses are aligned; a hand-written trace's may not be. An
        # offset past 64 bits (runs of a hostile trace, each near 2**63 bytes)
        # is beyond any placement window: such a segment goes first fit.
        return off if off % _SIM_ALIGNMENT == 0 and off < 1 << 64 else None

    out: dict[int, list[tuple[int, int, int]]] = {}
    for idx, dev, addr, size in trace.segments:
        if dev >= devices:
            continue
        at = offset(dev, addr)
        if at is not None:
            out.setdefault(idx, []).append((dev, at, size))
    return out, [offset(g.device, g.addr) if g.device < devices else None for g in start]


def start_segments(trace: Union[Trace, TraceFile]) -> list[StartSegment]:
    """The segments the recording allocator held at the first event
    (``meta["start_segments"]``, see :mod:`gpumempool._start_state`)."""
    rows = trace.meta.get("start_segments")
    if not rows:
        return []
    if not isinstance(rows, list):
        raise InvalidArgumentError("trace metadata 'start_segments' must be a list")
    try:
        segs = sorted((StartSegment.from_row(r) for r in rows), key=lambda g: (g.device, g.addr))
    except ValueError as exc:
        raise InvalidArgumentError(f"trace metadata 'start_segments': {exc}") from None
    seen: set[int] = set()
    for k, g in enumerate(segs):
        if g.addr + g.size > 1 << 64:
            raise InvalidArgumentError(f"trace metadata 'start_segments': the segment at {g.addr:#x} ends past 2**64")
        if k and segs[k - 1].device == g.device and segs[k - 1].addr + segs[k - 1].size > g.addr:
            raise InvalidArgumentError(f"trace metadata 'start_segments': the segments at {segs[k - 1].addr:#x} "
                                       f"and {g.addr:#x} overlap")
        for _, bid in g.blocks:
            if bid and bid in seen:
                raise InvalidArgumentError(f"trace metadata 'start_segments': block {bid} is in more than one place")
            seen.add(bid)
    return segs


def _start_sizes(trace: Union[Trace, TraceFile], ids: set[int], first: int) -> dict[int, int]:
    """The requested sizes of the blocks ``ids`` allocated at the start
    (their ``Alloc`` events are the trace's first ``first`` events); raises
    InvalidArgumentError for an id that is not one of them (a seeded block
    nobody would free, or an allocation of the trace served twice)."""
    sizes: dict[int, int] = {}
    for i, e in enumerate(trace):
        if i >= first or type(e) is not Alloc or len(sizes) == len(ids):
            break
        if e.id in ids:
            sizes[e.id] = e.size
    for bid in sorted(ids - set(sizes)):
        raise InvalidArgumentError(f"trace metadata 'start_segments': block {bid} is not allocated at the start "
                                   f"(one of the first {first} events)")
    return sizes


def seed(pool: MemPool, trace: Union[Trace, TraceFile], start: Sequence[StartSegment],
          offsets: Sequence[Optional[int]], devices: int, seeded: dict[int, int]) -> Optional[str]:
    """Give ``pool`` the segments ``start`` (at their ``offsets`` in the
    placement window), filling ``seeded`` with the addresses of their live
    blocks by id; returns why it could not (nothing is then seeded), or
    None."""
    ids = {bid for g in start for _, bid in g.blocks if bid}
    first = trace.meta.get("preexisting_blocks", 0)
    requested = _start_sizes(trace, ids, first if type(first) is int and first >= 0 else 0)
    made: list[int] = []
    for g, off in zip(start, offsets):
        if g.device >= devices:
            continue
        blocks = [(size, min(requested.get(bid, size), size) if bid else 0, bool(bid)) for size, bid in g.blocks]
        if off is not None:
            pool.sim.place_next(off, g.size, g.device)
        try:
            addrs = pool.seed_segment(blocks, device=g.device, stream=g.stream, small=g.small)
        except OutOfMemoryError:
            for a in made:
                pool.free(a)
            pool.empty_cache()
            seeded.clear()
            return (f"the {sum(x.size for x in start)} bytes held at the start do not fit the replay's device or "
                    "limit")
        finally:
            if off is not None:
                pool.sim.place_next(None, device=g.device)
        made += addrs
        seeded.update(zip([bid for _, bid in g.blocks if bid], addrs))
    return None
