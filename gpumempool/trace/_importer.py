"""Importing torch-format ``device_traces`` (torch's snapshots, and
gpumempool's, whose history has the same shape) as a :class:`Trace`: the
rules are in the doc of :mod:`gpumempool.trace`, the steps in
:func:`convert`.

A snapshot is checked once, by :func:`gpumempool._snapshot_check.check_history`
(whatever path it came by); the steps here take what it passed.
"""

from __future__ import annotations

import heapq
import os
from typing import Any, Optional, TypeGuard, Union

from .._safepickle import MAX_PICKLE_BYTES, load_pickle
from .._snapshot import RECORD_STREAM_KEY, with_entries_aside
from .._snapshot_check import CheckedSnapshot, check_history
from .._trace_errors import TraceFormatError
from ._format import U64, VIRTUAL_STREAM_BASE, Alloc, EmptyCache, Free, PathLike, RecordStream, Sync, Trim
from ._policy import describe_pool, torch_allocator_policy
from ._pressure import MAX_OOM_REQUEST, Pressure, most_reserved
from ._trace import Trace

__all__ = ["convert", "entry_key", "from_history", "from_torch_snapshot"]

#: The actions the importer turns into events or reference data (torch's,
#: and gpumempool's record_stream, empty_cache and trim, kept aside in its
#: snapshots and put back here).
IMPORTED = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
            "segment_unmap", "oom", "record_stream", "empty_cache", "trim")
_GROW = ("segment_alloc", "segment_map")
_SHRINK = ("segment_free", "segment_unmap")

#: (device, index of the entry in its device's trace, entry)
Entry = tuple[int, int, dict[str, Any]]


def _akey(addr: Any, handle: Any) -> Any:
    """The key of an address in a snapshot that may merge several pools
    (``gmp.snapshot()``): ours carry their pool's handle (entries:
    ``gpumempool_pool_handle``, ``pool_handle`` before; segments:
    ``segment_pool_id``), torch's none."""
    if type(handle) is int and 0 < handle < 1 << 31:
        return (handle << 64) + addr
    return addr


def entry_key(e: dict[str, Any]) -> Any:
    """The key of the block an entry is about (see :func:`_akey`)."""
    return _akey(e.get("addr", 0), e.get("gpumempool_pool_handle", e.get("pool_handle")))


def _segment_handle(s: dict[str, Any]) -> Any:
    pid = s.get("segment_pool_id")
    ours = s.get("gpumempool_pool", s.get("pool"))
    return pid[1] if isinstance(pid, (tuple, list)) and len(pid) == 2 and ours is not None else None


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


# -- the steps of convert -------------------------------------------------------


def _joined_traces(checked: CheckedSnapshot) -> tuple[list[list[dict[str, Any]]], Optional[list[dict[int, int]]]]:
    """The checked ``device_traces`` with the entries our snapshots keep
    aside put back, and for each device the index of each entry in the
    snapshot's own device_traces (None when nothing was put back), where
    :meth:`Trace.frames` reads the stacks."""
    recorded = checked.snapshot["device_traces"]
    try:
        traces = with_entries_aside(checked.snapshot, recorded)
    except ValueError as exc:
        raise TraceFormatError(f"{checked.file}: {exc}" if checked.file else str(exc)) from None
    if traces is recorded:
        return traces, None
    return traces, [{id(e): k for k, e in enumerate(t)} for t in recorded]


def _completed_at_once(traces: list[list[dict[str, Any]]]) -> list[list[bool]]:
    """Per device: which free_requested entries completed at once (their
    free_completed follows them)."""
    immediate: list[list[bool]] = []
    for tr in traces:
        imm = [False] * len(tr)
        for i, e in enumerate(tr):
            if e["action"] == "free_requested" and i + 1 < len(tr):
                nxt = tr[i + 1]
                imm[i] = nxt["action"] == "free_completed" and entry_key(nxt) == entry_key(e)
        immediate.append(imm)
    return immediate


def _in_time_order(traces: list[list[dict[str, Any]]]) -> tuple[list[Entry], dict[str, int]]:
    """The imported entries of every device in one list in time order (each
    device's own order kept), and the count of the others by action."""
    if len(traces) == 1:
        merged = [(0, i, e) for i, e in enumerate(traces[0])]
    else:
        merged = [(d, i, e) for _, d, i, e in heapq.merge(
            *[[(e.get("time_us", 0), d, i, e) for i, e in enumerate(tr)] for d, tr in enumerate(traces)],
            key=lambda x: x[0])]
    imported = [(d, i, e) for d, i, e in merged if e["action"] in IMPORTED]
    unknown: dict[str, int] = {}
    for _, _, e in merged:
        if e["action"] not in IMPORTED:
            unknown[e["action"]] = unknown.get(e["action"], 0) + 1
    return imported, unknown


def _preexisting(imported: list[Entry], segments: list[dict[str, Any]]) -> list[tuple[int, Any, int, int]]:
    """The blocks allocated before the trace started, ``(device, key, size,
    stream)``: freed in the trace without being allocated in it, or live in
    the snapshot's segments and never mentioned by the trace."""
    live: dict[tuple[int, Any], tuple[int, int]] = {}
    seen: set[tuple[int, Any]] = set()
    pre: list[tuple[int, Any, int, int]] = []
    for d, _, e in imported:
        a = e["action"]
        k = (d, entry_key(e))
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
        if not _in_range(stream, 0, U64):
            stream = 0
        for b in s.get("blocks", []) if isinstance(s.get("blocks"), list) else []:
            if not isinstance(b, dict) or b.get("state") != "active_allocated":
                continue
            addr = b.get("address")
            size = b.get("requested_size") or b.get("size")
            if not _in_range(addr, 0, U64) or not _in_range(size, 1, 1 << 63):
                continue
            k = (d, _akey(addr, _segment_handle(s)))
            if k not in live and k not in seen:
                pre.append((d, k[1], size, stream))
                seen.add(k)
    return pre


def _reserved_at_start(imported: list[Entry], segments: list[dict[str, Any]]) -> tuple[dict[int, int], bool]:
    """The recorded reserved bytes per device at the start (the segments at
    the end minus the trace's changes), and whether the trace has segment
    entries."""
    delta: dict[int, int] = {}
    for d, _, e in imported:
        a = e["action"]
        if a in _GROW:
            delta[d] = delta.get(d, 0) + e["size"]
        elif a in _SHRINK:
            delta[d] = delta.get(d, 0) - e["size"]
    reserved_now: dict[int, int] = {}
    for s in segments:
        d = s.get("device", 0)
        reserved_now[d] = reserved_now.get(d, 0) + s["total_size"]
    has_segment_events = bool(delta) or any(e["action"].startswith("segment_") for _, _, e in imported)
    reserved: dict[int, int] = {}
    for d in set(delta) | set(reserved_now):
        reserved[d] = max(0, reserved_now.get(d, 0) - delta.get(d, 0)) if segments else max(0, -min(0, delta.get(d, 0)))
    return reserved, has_segment_events


class _Importer:
    """The events of the imported entries, one entry at a time (:meth:`run`),
    with the state that carries from one to the next: block ids, virtual
    streams, the reserved bytes, what the recording shows of pressure."""

    def __init__(self, imported: list[Entry], flavor: str, infer_empty_cache: bool,
                 immediate: list[list[bool]], where: Optional[list[dict[int, int]]],
                 reserved: dict[int, int], pre: list[tuple[int, Any, int, int]]) -> None:
        self.imported = imported
        self.flavor = flavor
        self.infer_empty_cache = infer_empty_cache
        self.immediate = immediate
        self.where = where
        self.reserved = reserved
        self.pre = pre
        self.tr = Trace()
        self.out = self.tr.events
        self.next_id = 0
        self.ids: dict[tuple[int, Any], int] = {}
        self.vstreams = _VirtualStreams()
        self.vstream_of: dict[int, int] = {}
        self.pending: dict[tuple[int, Any], int] = {}  # (device, addr) -> id waiting for free_completed
        self.counts = {"allocs": 0, "frees": 0, "deferred_frees": 0, "unmatched_frees": 0, "repaired_allocs": 0,
                       "recorded_ooms": 0, "record_stream_entries": 0, "inferred_empty_cache": 0,
                       "preexisting_blocks": len(pre), "recorder_calls": 0, "failed_requests": 0}
        # device -> the index of the EmptyCache a run of releases on it was taken for
        self.release_at: dict[int, int] = {}
        # Each device's entries by position in imported: a release and the
        # allocation it was for are on one device (another's entries may
        # come between them in time).
        self.same_dev: dict[int, list[int]] = {}
        self.rank: list[int] = []
        for pos, (d, _, _) in enumerate(imported):
            self.rank.append(len(self.same_dev.setdefault(d, [])))
            self.same_dev[d].append(pos)
        # What the recording shows of memory pressure, per device: the
        # reserved bytes before a run of releases, the peak, the failing
        # attempts' needs and what an OOM entry says the device had.
        self.pressure = Pressure(reserved)
        self.most_reserved = most_reserved(reserved, imported)

    def allocate_preexisting(self) -> dict[tuple[int, Any], int]:
        """Allocate the blocks live before the trace started, first."""
        for d, addr, size, stream in self.pre:
            self.next_id += 1
            self.ids[(d, addr)] = self.next_id
            self.out.append(Alloc(self.next_id, size, stream, d))
        return self.ids

    def run(self) -> Trace:
        for pos, (d, i, e) in enumerate(self.imported):
            a = e["action"]
            if a not in _SHRINK:
                self.release_at.pop(d, None)
            k = (d, entry_key(e))
            if a == "alloc":
                self.alloc(d, i, e, k)
            elif a == "record_stream":
                self.record_stream(k)
            elif a == "free_requested":
                self.free_requested(d, i, k)
            elif a == "free_completed":
                if k in self.pending:
                    self.sync_completion(k)
                    self.pending.pop(k)
            elif a in _GROW or a in _SHRINK:
                self.segment(pos, d, e)
            elif a == "oom":
                self.oom(d, i, e)
            else:  # empty_cache, trim: recorded by the engine after the releases they made
                self.out.append(EmptyCache() if a == "empty_cache" else
                                Trim(e.get("keep", 0), None if e.get("every_device") else d))
                self.counts["recorder_calls"] += 1
        return self.tr

    def _entry_at(self, d: int, i: int, e: dict[str, Any]) -> None:
        """Note where the event about to be appended came from (its stack)."""
        self.tr.snapshot_entries[len(self.out)] = (d, i if self.where is None else self.where[d].get(id(e), -1))

    def alloc(self, d: int, i: int, e: dict[str, Any], k: tuple[int, Any]) -> None:
        if e["size"] <= 0:
            return
        if k in self.ids:  # the trace lost a free
            self.out.append(Free(self.ids.pop(k)))
            self.counts["repaired_allocs"] += 1
        self.next_id += 1
        self.ids[k] = self.next_id
        self._entry_at(d, i, e)
        self.out.append(Alloc(self.next_id, e["size"], e.get("stream", 0), d,
                              e.get("gpumempool_caller_sized", e.get("caller_sized")) is True))
        self.counts["allocs"] += 1

    def record_stream(self, k: tuple[int, Any]) -> None:
        self.counts["record_stream_entries"] += 1
        bid = self.ids.get(k)
        if bid is not None and bid not in self.vstream_of:
            self.vstream_of[bid] = self.vstreams.take()
            self.out.append(RecordStream(bid, self.vstream_of[bid]))

    def free_requested(self, d: int, i: int, k: tuple[int, Any]) -> None:
        bid = self.ids.pop(k, None)
        if bid is None:
            self.counts["unmatched_frees"] += 1
            return
        self.counts["frees"] += 1
        if self.flavor == "gpumempool" and bid > len(self.pre):
            # The engine defers a free exactly when record_stream added a stream.
            deferred = bid in self.vstream_of
        else:
            # Torch records no record_stream: a free that did not complete at
            # once waited for streams. (One that completed at the very next
            # allocation looks the same as an immediate one, and replays the same.)
            deferred = not self.immediate[d][i]
        if deferred:
            self.counts["deferred_frees"] += 1
            if bid not in self.vstream_of:
                self.vstream_of[bid] = self.vstreams.take()
                self.out.append(RecordStream(bid, self.vstream_of[bid]))
            self.pending[k] = bid
        elif bid in self.vstream_of:  # recorded on a stream but freed at once: that stream was done
            vs = self.vstream_of.pop(bid)
            self.out.append(Free(bid))
            self.out.append(Sync(vs))
            self.vstreams.give(vs)
            return
        self.out.append(Free(bid))

    def sync_completion(self, k: tuple[int, Any]) -> None:
        bid = self.pending.get(k)
        if bid is None:
            return
        vs = self.vstream_of.pop(bid, None)
        if vs is not None:
            self.out.append(Sync(vs))
            self.vstreams.give(vs)

    def segment(self, pos: int, d: int, e: dict[str, Any]) -> None:
        a = e["action"]
        grow = a in _GROW
        imported, reserved = self.imported, self.reserved
        mine, r = self.same_dev[d], self.rank[pos]
        prev = imported[mine[r - 1]][2]["action"] if r > 0 else ""
        after = ""
        if not grow and prev not in _SHRINK:
            j = r
            while j < len(mine) and imported[mine[j]][2]["action"] in _SHRINK:
                j += 1
            after = imported[mine[j]][2]["action"] if j < len(mine) else ""
            if after in _GROW and reserved.get(d, 0) + imported[mine[j]][2]["size"] <= self.most_reserved.get(d, 0):
                # The device held that much at another time of the run: the
                # segment cannot have failed for lack of memory, so the
                # release was an empty_cache() (whose next request wanted
                # a new segment), not a retry.
                after = "empty_cache"
            if after in ("segment_alloc", "segment_map", "oom"):
                # torch released its cache to retry an allocation that failed
                self.pressure.retry(d, reserved.get(d, 0), imported[mine[j]][2] if after != "oom" else None)
            if self.infer_empty_cache and after not in ("segment_alloc", "segment_map", "oom"):
                # Inside one allocation a release is followed by a new
                # segment (or an OOM); anything else, a cache hit
                # included, means empty_cache() ran.
                self.out.append(EmptyCache())
                self.counts["inferred_empty_cache"] += 1
                self.release_at[d] = len(self.out) - 1
        reserved[d] = reserved.get(d, 0) + (e["size"] if grow else -e["size"])
        self.pressure.seen(d)
        # The release of an empty_cache() happened while serving that event.
        at = self.release_at[d] if d in self.release_at and not grow else len(self.out)
        self.tr.reserved.append((at, d, min(max(0, reserved[d]), U64 - 1)))
        if a == "segment_alloc" and e["size"] > 0:
            # Where the device put it: replay keeps the segments' address order.
            self.tr.segments.append((len(self.out), d, e.get("addr", 0), e["size"]))

    def oom(self, d: int, i: int, e: dict[str, Any]) -> None:
        self.counts["recorded_ooms"] += 1
        self.pressure.oom(d, e)
        size = e.get("size", 0)
        if type(size) is int and 0 < size <= MAX_OOM_REQUEST:
            # Torch records no alloc for the request it could not serve:
            # replay asks for it (and gives it back at once, as the
            # program went on without it), so that a replay under the
            # recording's conditions runs out of memory where torch did,
            # and a setting fits only if it serves that request too.
            self.next_id += 1
            self._entry_at(d, i, e)  # its stack is the OOM entry's
            self.out.append(Alloc(self.next_id, size, e.get("stream", 0), d))
            self.out.append(Free(self.next_id))
            self.counts["failed_requests"] += 1


def _describe(tr: Trace, imp: _Importer, snap: dict[str, Any], devices: int, flavor: str,
              has_segment_events: bool, segments: list[dict[str, Any]], start_state: Any,
              unknown: dict[str, int]) -> None:
    """The imported trace's metadata: where it came from, the counts, the
    recorded conditions, policy and start state."""
    if not has_segment_events and not segments:
        tr.reserved.clear()
    tr.meta = {
        "source": flavor,
        "recorded_by": flavor if tr.reserved else None,
        "devices": max(devices, 1 + max([ev.device for ev in tr.events if type(ev) is Alloc] + [0])),
        **{k: v for k, v in imp.counts.items() if v},
    }
    conditions = imp.pressure.conditions()
    if conditions:
        tr.meta["recorded_conditions"] = conditions
    if start_state is not None and start_state.segments:
        tr.meta["start_segments"] = [g.as_row() for g in start_state.segments]
    elif start_state is not None and start_state.skipped and any(b for i, _, b in tr.reserved if i == 0):
        # (only where torch held memory at the start: otherwise nothing was lost)
        tr.meta["start_state_skipped"] = start_state.skipped
    if unknown:
        tr.meta["ignored_actions"] = unknown
    if flavor == "torch":
        settings = torch_allocator_policy(snap.get("allocator_settings"))
        if settings:
            tr.meta["recorded_policy"] = settings


def convert(checked: CheckedSnapshot, *, source: Optional[str] = None,
            infer_empty_cache: Optional[bool] = None) -> Trace:
    """The trace of a snapshot :func:`check_history` passed: the entries
    kept aside put back, the frees that completed at once found, every
    device's entries in time order, the blocks and reserved bytes from
    before the trace, then each entry's events. ``infer_empty_cache``
    (default: for torch's snapshots) takes a run of releases for an
    ``empty_cache()``; never where the history records those calls."""
    snap, segments = checked.snapshot, checked.snapshot["segments"]
    traces, where = _joined_traces(checked)
    flavor = source or _flavor(snap, traces)
    if infer_empty_cache is None:
        infer_empty_cache = flavor == "torch"
    imported, unknown = _in_time_order(traces)
    if any(e["action"] in ("empty_cache", "trim") for _, _, e in imported):
        infer_empty_cache = False  # the engine recorded them: nothing to guess
    pre = _preexisting(imported, segments)
    reserved, has_segment_events = _reserved_at_start(imported, segments)
    imp = _Importer(imported, flavor, infer_empty_cache, _completed_at_once(traces), where, reserved, pre)
    if has_segment_events or segments:
        imp.tr.reserved.extend((0, d, min(reserved[d], U64 - 1)) for d in sorted(reserved))
    ids = imp.allocate_preexisting()
    start_state = None
    if flavor == "torch":
        from .._start_state import rebuild

        start_state = rebuild(segments, imported, pre, ids, torch_allocator_policy(snap.get("allocator_settings")))
    tr = imp.run()
    _describe(tr, imp, snap, len(traces), flavor, has_segment_events, segments, start_state, unknown)
    return tr


# -- the entry points -----------------------------------------------------------


def from_history(pool_or_snapshot: Any, *, infer_empty_cache: bool = False) -> Trace:
    """The trace of a pool's recorded history: ``pool`` (a
    :class:`~gpumempool.MemPool` with history on) or a snapshot dict of ours
    (``pool.snapshot()``, ``gmp.snapshot()``) with ``device_traces``. The
    ``empty_cache`` and ``trim`` calls the engine recorded become ``e`` and
    ``t`` events where they were made."""
    pool = pool_or_snapshot if hasattr(pool_or_snapshot, "snapshot") and callable(pool_or_snapshot.snapshot) else None
    snap = pool.snapshot() if pool is not None else pool_or_snapshot
    tr = convert(check_pool_history(snap), source="gpumempool", infer_empty_cache=infer_empty_cache)
    if pool is not None:
        describe_pool(tr, pool)
    return tr


def check_pool_history(snap: Any) -> CheckedSnapshot:
    """:func:`check_history` of a snapshot of ours: one of a pool whose
    history is short or empty is a trace too, and one without ``segments``
    has none."""
    return check_history(snap, "<snapshot>", block_key=entry_key, replayable=False)


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
    checked = check_history(snap, name, block_key=entry_key, lenient=lenient)
    trimmed = checked.snapshot is not snap  # lenient left entries out: indices are the copy's
    flavor = _flavor(checked.snapshot, checked.snapshot["device_traces"])
    tr = convert(checked, source=flavor, infer_empty_cache=infer_empty_cache and flavor == "torch")
    if name not in ("<dict>", "<bytes>"):
        tr.meta["file"] = os.path.basename(name)
    # read again for Trace.frames (the file is not held here)
    tr.snapshot = checked.snapshot if trimmed else path_or_dict
    checked.describe(tr.meta)
    return tr
