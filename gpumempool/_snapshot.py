"""Snapshots in the format of ``torch.cuda.memory._snapshot()``, so that
pytorch.org/memory_viz and ``torch.cuda._memory_viz`` can render them, plus
fragmentation figures of our own.

``pool.snapshot()`` covers one pool, :func:`snapshot` every open pool;
:func:`dump_snapshot` writes the pickle torch's tools read;
:func:`record_history` turns on event recording (alloc, free_requested,
free_completed, segment_alloc, segment_free, segment_map, segment_unmap,
oom, as torch names them, and record_stream, empty_cache and trim, which
torch does not record: kept under ``gpumempool_record_stream`` and
``gpumempool_cache_calls``), optionally with the Python stack
of each call of the Python API, given to every event the call made (events
of calls torch makes through the C ABI carry no Python frames; their frees
get the frames of the block's allocation, as in torch).
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import errno
import os
import pickle
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Optional, Sequence

from . import _lifecycle, _native
from ._errors import CallbackReentryError, PoolClosedError

__all__ = ["dump_snapshot", "record_history", "snapshot"]

_settings_lock = threading.Lock()


def _new_lock_after_fork() -> None:
    global _settings_lock
    _settings_lock = threading.Lock()


_native.after_fork_in_child(_new_lock_after_fork)
#: Applied to every pool created while it is set: (max_entries, stacks) or None.
_history_settings: Optional[tuple[int, bool]] = None


#: A Python stack as recorded: (filename, line, function) per frame,
#: innermost first.
Stack = tuple[tuple[str, int, str], ...]
#: A recorded call of the pool's Python API: its start and end (µs, the
#: clock of the engine's history), the OS thread that made it, its stack.
Call = tuple[int, int, int, Stack]

#: Where our snapshots keep the record_stream calls: torch's trace has no
#: such action (memory_viz shows one as "..._undefined"), so they sit beside
#: device_traces, a list per device, each entry with the index in its
#: device's trace before which it was recorded (RECORD_STREAM_INDEX).
RECORD_STREAM_KEY = "gpumempool_record_stream"
RECORD_STREAM_INDEX = "gpumempool_index"
#: Where they keep the empty_cache and trim calls the engine recorded (torch
#: records neither), as the record_stream calls: a list per device, each
#: entry with its place in that device's trace (RECORD_STREAM_INDEX), a
#: trim's ``keep`` bytes and ``every_device`` (a call about every device,
#: kept in device 0's list).
CACHE_CALLS_KEY = "gpumempool_cache_calls"
#: The engine's history actions kept aside, by the key they are kept under.
_ASIDE = {"record_stream": RECORD_STREAM_KEY, "empty_cache": CACHE_CALLS_KEY, "trim": CACHE_CALLS_KEY}
#: Where gmp.snapshot() keeps torch's own view of the torch pools that
#: gmp.mempool made over the pools it covers (gpumempool.torch provides
#: "torch_pool_views"): torch's segments of a torch pool are blocks inside
#: our segments, so among torch's top-level segments they would count the
#: same memory twice.
TORCH_POOLS_KEY = "gpumempool_torch_pools"

# The modules whose frames are left off the top of every stack (the pool's
# methods: torch's stacks start at the Python code that asked for memory).
_OWN_MODULES = frozenset((__name__, __name__.rsplit(".", 1)[0] + "._pool"))
# Stacks repeat (the same loop allocates again and again): each is kept
# once, so that a long history holds references, not copies. Cleared when
# it grows past _STACKS_MAX distinct stacks.
_stacks: dict[Stack, Stack] = {}
_STACKS_MAX = 1 << 16


def capture_frames() -> Stack:
    """The caller's whole Python stack (as torch records it: every frame),
    innermost first, without the pool's own frames."""
    f: Any = sys._getframe(1)
    while f is not None and f.f_globals.get("__name__") in _OWN_MODULES:
        f = f.f_back
    out = []
    while f is not None:
        code = f.f_code
        out.append((code.co_filename, f.f_lineno or 0, code.co_name))
        f = f.f_back
    stack = tuple(out)
    if len(_stacks) >= _STACKS_MAX:
        _stacks.clear()
    return _stacks.setdefault(stack, stack)


def now_us() -> int:
    """Wall-clock microseconds, the clock of the engine's history."""
    return time.time_ns() // 1000


class PoolStacks:
    """A pool's Python stacks while it records history with
    ``stacks=True``: the stack of each live block allocated through the
    pool's API (address -> stack, dropped at free), and of each call of that
    API that may record events (time window, thread, stack). The history's
    entries are matched to the call that made them by the thread and time
    the engine recorded (:func:`pool_snapshot`). A pool holds one while
    stacks are on, and drops it when they go off."""

    def __init__(self, max_entries: int) -> None:
        self.blocks: dict[int, Stack] = {}
        self.calls: "collections.deque[Call]" = collections.deque()
        self.max_entries = max_entries
        # reentrant: a finalizer freeing a block may run (GC) while alloc holds it
        self._lock = threading.RLock()

    def note_call(self, t0: int, block: Optional[int] = None, freed: Optional[int] = None) -> None:
        """Keep the caller's stack for the events of the call that began at
        ``t0`` (µs), and for the block ``block`` it allocated; forget the
        stack of the block ``freed``."""
        captured = capture_frames()
        t1 = now_us()
        thread = threading.get_native_id()
        with self._lock:
            if block is not None:
                self.blocks[block] = captured
                while len(self.blocks) > self.max_entries:  # blocks never freed through this API
                    del self.blocks[next(iter(self.blocks))]
            elif freed is not None:
                self.blocks.pop(freed, None)
            self.calls.append((t0, t1, thread, captured))
            # a call records an event or more, but some none (an empty_cache
            # with nothing cached): room for twice the history's entries
            while len(self.calls) > 2 * self.max_entries:
                self.calls.popleft()

    def traced(self, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)``, a pool call that may record events (releases,
        completed frees): they get its stack."""
        t0 = now_us()
        try:
            return call(*args)
        finally:
            self.note_call(t0)

    def forget(self, ptr: int) -> None:
        """The block at ``ptr`` is gone without a call worth a stack."""
        with self._lock:
            self.blocks.pop(ptr, None)

    def copy(self) -> tuple[dict[int, Stack], list[Call]]:
        """The blocks' stacks and the calls, as they are now."""
        with self._lock:
            return dict(self.blocks), list(self.calls)

    def renew_lock_after_fork(self) -> None:
        """In a forked child: a new lock, as another thread may have held
        this one at the fork."""
        self._lock = threading.RLock()


class _Frames:
    """Stacks as torch's frame lists, each distinct frame and stack made
    once per snapshot (torch shares them too: its pickles stay small)."""

    def __init__(self) -> None:
        self._frames: dict[tuple[str, int, str], dict[str, Any]] = {}
        self._lists: dict[int, tuple[Stack, list[dict[str, Any]]]] = {}

    def __call__(self, stack: Optional[Stack]) -> list[dict[str, Any]]:
        if not stack:
            return []
        hit = self._lists.get(id(stack))
        if hit is not None and hit[0] is stack:
            return hit[1]
        out = []
        for f in stack:
            d = self._frames.get(f)
            if d is None:
                d = self._frames[f] = {"name": f[2], "filename": f[0], "line": f[1]}
            out.append(d)
        self._lists[id(stack)] = (stack, out)
        return out


class _Calls:
    """Finds the recorded call an engine entry was made in: the one of the
    entry's thread whose time window holds the entry's time (the engine's
    events of one call are recorded on the calling thread, inside its
    window; calls of one thread follow each other)."""

    def __init__(self, calls: Sequence[Call]) -> None:
        by_thread: dict[int, list[tuple[int, int, Stack]]] = {}
        for t0, t1, tid, stack in calls:
            if tid:
                by_thread.setdefault(tid, []).append((t0, t1, stack))
            by_thread.setdefault(0, []).append((t0, t1, stack))  # for entries of no known thread
        self._starts: dict[int, list[int]] = {}
        self._calls: dict[int, list[tuple[int, int, Stack]]] = {}
        for tid, cs in by_thread.items():
            cs.sort(key=lambda c: c[0])
            self._starts[tid] = [c[0] for c in cs]
            self._calls[tid] = cs

    def stack(self, time_us: int, thread: int) -> Optional[Stack]:
        """The stack of the call made on ``thread`` (0: any) at ``time_us``,
        or None when no recorded call was running then (a call through the
        C ABI, as torch's, or one whose record was dropped)."""
        starts = self._starts.get(thread)
        if starts is None:
            return None
        # Of two calls that touch in one microsecond, the later: the earlier
        # one's events come before the stack capture that ends its window.
        i = bisect.bisect_right(starts, time_us) - 1
        if i >= 0:
            t0, t1, stack = self._calls[thread][i]
            if t0 <= time_us <= t1:
                return stack
        return None


def pool_snapshot(name: str, handle: int, backend: str, raw: dict[str, Any], history: list[dict[str, Any]],
                  frames: dict[int, Stack], calls: Sequence[Call] = ()) -> dict[str, Any]:
    """Build torch's snapshot dict of the pool ``name`` (engine handle
    ``handle``, backend ``backend``) from the engine's JSON. ``frames``: the
    Python stacks of live blocks by address; ``calls``: the pool's recorded
    Python API calls, whose stacks go to the history entries they made.

    As torch does: every entry has frames, those of the call that made it
    (a free with none, through the C ABI, those of its block's allocation);
    a segment has those of the call that made it, an active block those of
    its allocation. What torch has no key for is under a ``gpumempool_``
    key: the pool of an entry or segment (a merged snapshot of several
    pools repeats addresses), allocations sized by their caller
    (``alloc_segment``: a replay repeats them), record_stream calls."""
    to_frames = _Frames()
    windows = _Calls(calls)
    devices = 1 + max([s["device"] for s in raw["segments"]] + [e["device"] for e in history] + [-1])
    traces: list[list[dict[str, Any]]] = [[] for _ in range(max(devices, 1))]
    streams: list[list[dict[str, Any]]] = [[] for _ in traces]
    cache_calls: list[list[dict[str, Any]]] = [[] for _ in traces]
    block_stack: dict[tuple[int, int], Stack] = {}  # (device, addr) -> its allocation's stack
    segment_stack: dict[tuple[int, int], Stack] = {}  # (device, address) -> the stack that made it
    for e in history:
        action, d = e["action"], e["device"]
        if action in ("empty_cache", "trim"):
            every = d < 0
            d = max(d, 0)
            call = {"action": action, "time_us": e["time_us"], "every_device": every,
                    RECORD_STREAM_INDEX: len(traces[d]), "gpumempool_pool_handle": handle}
            if action == "trim":
                call["keep"] = e["size"]
            cache_calls[d].append(call)
            continue
        key = (d, e["addr"])
        stack = windows.stack(e["time_us"], e.get("thread", 0))
        if action == "alloc":
            block_stack[key] = stack or ()
        elif action in ("free_requested", "free_completed", "record_stream") and stack is None:
            stack = block_stack.get(key)  # torch: the block's context_when_allocated
        if action == "free_completed":
            block_stack.pop(key, None)
        elif action == "segment_alloc" or (action == "segment_map" and key not in segment_stack):
            segment_stack[key] = stack or ()
        elif action in ("segment_free", "segment_unmap"):
            segment_stack.pop(key, None)
        entry: dict[str, Any] = {"action": action}
        if action == "oom":
            entry["device_free"] = e.get("device_free", 0)  # torch's oom has no addr
        else:
            entry["addr"] = e["addr"]
        entry.update(size=e["size"], stream=e["stream"], time_us=e["time_us"], frames=to_frames(stack),
                     gpumempool_pool_handle=handle)
        if e.get("caller_sized"):
            entry["gpumempool_caller_sized"] = True
        if action == "record_stream":
            entry[RECORD_STREAM_INDEX] = len(traces[d])
            streams[d].append(entry)
        else:
            traces[d].append(entry)
    segments = []
    for s in raw["segments"]:
        d = s["device"]
        blocks = [
            {
                "address": b["address"],
                "size": b["size"],
                "requested_size": b["requested_size"],
                "state": b["state"],
                "frames": to_frames(frames.get(b["address"]) or block_stack.get((d, b["address"])))
                if b["state"] != "inactive" else [],
            }
            for b in s["blocks"]
        ]
        segments.append(
            {
                "device": d,
                "address": s["address"],
                "total_size": s["total_size"],
                "allocated_size": s["allocated_size"],
                "active_size": s["active_size"],
                "requested_size": s["requested_size"],
                "stream": s["stream"],
                "segment_type": s["segment_type"],
                "segment_pool_id": (0, handle),
                "is_expandable": s["is_expandable"],
                "frames": to_frames(segment_stack.get((d, s["address"]))),
                "blocks": blocks,
                "gpumempool_pool": name,
            }
        )
    snap = {
        "segments": segments,
        "device_traces": traces,
        "allocator_settings": {"pool": name, "backend": backend},
        "fragmentation": raw["fragmentation"],
    }
    if any(streams):
        snap[RECORD_STREAM_KEY] = streams
    if any(cache_calls):
        snap[CACHE_CALLS_KEY] = cache_calls
    return snap


def with_entries_aside(snap: dict[str, Any], traces: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    """``traces`` (the ``device_traces`` of ``snap``) with every kind of
    entry our snapshots keep aside put back where it was recorded:
    record_stream calls (RECORD_STREAM_KEY, as entries of action
    ``record_stream``), then the empty_cache and trim calls
    (CACHE_CALLS_KEY, entries of their own action, ``keep`` and
    ``every_device``); ``traces`` itself when there are none. Raises
    ValueError, naming the entry, on a malformed one."""
    return _join(snap, _join(snap, traces, RECORD_STREAM_KEY), CACHE_CALLS_KEY, traces)


def _join(snap: dict[str, Any], traces: list[list[dict[str, Any]]], key: str,
          places: Optional[list[list[dict[str, Any]]]] = None) -> list[list[dict[str, Any]]]:
    """``traces`` with the entries ``snap`` keeps aside under ``key`` put
    back at their places, each an index in ``places`` (default ``traces``:
    the device's trace as recorded, before other entries were put back)."""
    extra = snap.get(key)
    if extra is None:
        return traces
    if not isinstance(extra, list) or len(extra) > len(traces) or not all(isinstance(x, list) for x in extra):
        raise ValueError(f"{key} must be a list per device of device_traces")
    cache_calls = key == CACHE_CALLS_KEY
    out = []
    for d, trace in enumerate(traces):
        adds = extra[d] if d < len(extra) else []
        if not adds:
            out.append(trace)
            continue
        recorded = (places or traces)[d]
        # An index names a place in the trace as recorded: the entries put back before are stepped over.
        joined: list[dict[str, Any]] = []
        at = 0  # in recorded
        pos = 0  # in trace
        for i, e in enumerate(adds):
            where = e.get(RECORD_STREAM_INDEX) if isinstance(e, dict) else None
            if type(where) is not int or not at <= where <= len(recorded):
                raise ValueError(f"{key}[{d}][{i}]: {RECORD_STREAM_INDEX} must be an int from {at} "
                                 f"to {len(recorded)} (its place in device_traces[{d}])")
            why = _aside_problem(e, cache_calls)
            if why:
                raise ValueError(f"{key}[{d}][{i}]: {why}")
            while at < where or (pos < len(trace) and (at == len(recorded) or trace[pos] is not recorded[at])
                                 and trace[pos].get("time_us", 0) <= e.get("time_us", 0)):
                # (at one place, the entries put back before go first while they are not later)
                if at < len(recorded) and trace[pos] is recorded[at]:
                    at += 1
                joined.append(trace[pos])
                pos += 1
            joined.append(dict(e) if cache_calls else dict(e, action="record_stream"))
        joined += trace[pos:]
        out.append(joined)
    return out


def _aside_problem(e: dict[str, Any], cache_call: bool) -> Optional[str]:
    """Why an entry kept aside cannot be put back, or None."""
    if cache_call:
        if e.get("action") not in ("empty_cache", "trim"):
            return "action must be 'empty_cache' or 'trim'"
        if type(e.get("every_device", False)) is not bool:
            return "every_device must be a bool"
        fields: tuple[tuple[str, int], ...] = (("keep", 64),)
    else:
        fields = (("addr", 64), ("size", 63), ("stream", 64))
    for k, bits in fields:
        v = e.get(k, 0)
        if type(v) is not int or not 0 <= v < 1 << bits:
            return (f"{k} must be a non-negative int below 2**{bits}, "
                    f"got {v if type(v) is int and abs(v) < 1 << 64 else type(v).__name__}")
    if type(e.get("time_us", 0)) not in (int, float):
        return f"time_us must be a number, got {type(e.get('time_us')).__name__}"
    return None


def _set_record_streams_aside(snap: dict[str, Any]) -> dict[str, Any]:
    """The inverse of with_entries_aside: move the record_stream, empty_cache
    and trim entries of ``snap``'s device_traces aside (in place)."""
    traces: list[list[dict[str, Any]]] = []
    aside: dict[str, list[list[dict[str, Any]]]] = {RECORD_STREAM_KEY: [], CACHE_CALLS_KEY: []}
    for trace in snap["device_traces"]:
        kept: list[dict[str, Any]] = []
        for lists in aside.values():
            lists.append([])
        for e in trace:
            key = _ASIDE.get(e["action"])
            if key is not None:
                aside[key][-1].append(dict(e, **{RECORD_STREAM_INDEX: len(kept)}))
            else:
                kept.append(e)
        traces.append(kept)
    snap["device_traces"] = traces
    for key, lists in aside.items():
        snap.pop(key, None)
        if any(lists):
            snap[key] = lists
    return snap


def merge(snaps: list[dict[str, Any]]) -> dict[str, Any]:
    """One snapshot of several pools: segments side by side, traces merged by time."""
    segments: list[dict[str, Any]] = []
    traces: list[list[dict[str, Any]]] = []
    for s in snaps:
        segments += s["segments"]
        for d, t in enumerate(with_entries_aside(s, s["device_traces"])):
            while len(traces) <= d:
                traces.append([])
            traces[d] += t
    for t in traces:
        t.sort(key=lambda e: e["time_us"])
    segments.sort(key=lambda s: (s["device"], s["address"]))
    return _set_record_streams_aside({"segments": segments, "device_traces": traces or [[]],
                                      "allocator_settings": {"pools": [s["allocator_settings"]["pool"] for s in snaps]}})


def snapshot(not_read: Optional[list[str]] = None) -> dict[str, Any]:
    """A snapshot of every open pool of this process, in torch's format.
    With ``not_read``, a pool this thread is inside of (running its Python
    allocator function: it cannot be read until that returns) is left out
    and named there, instead of raising CallbackReentryError."""
    snaps = []
    read = []
    for p in _lifecycle.open_pools():
        try:
            snaps.append(p.snapshot())
        except PoolClosedError:  # closed by another thread meanwhile
            continue
        except CallbackReentryError as exc:
            if not_read is None:
                raise
            not_read.append(exc.pool)
            continue
        read.append(p)
    snap = merge(snaps)
    views = _torch_pool_views(read)
    if views:
        snap[TORCH_POOLS_KEY] = views
    return snap


def _torch_pool_views(pools: list[Any]) -> list[dict[str, Any]]:
    """What gpumempool.torch reads of the torch pools over ``pools`` (none
    when it is not loaded, or no pool was routed through gmp.mempool)."""
    try:
        views = _lifecycle.provided("torch_pool_views")
    except LookupError:
        return []
    out: list[dict[str, Any]] = []
    for p in pools:
        with contextlib.suppress(PoolClosedError):  # closed by another thread meanwhile
            out += views(p)
    return out


def dump_snapshot(path: str, snap: Optional[dict[str, Any]] = None) -> None:
    """Write ``snap`` (default: :func:`snapshot`) as the pickle that
    pytorch.org/memory_viz and ``python -m torch.cuda._memory_viz`` read."""
    path = os.fspath(path)
    if os.path.isdir(path):
        # refused up front: the temporary file would go to its parent
        raise IsADirectoryError(errno.EISDIR, "is a directory; dump_snapshot needs a file name", path)
    data = snapshot() if snap is None else snap
    # written aside and renamed over path: a failure (an unpicklable value,
    # a full disk, an interrupt) leaves the previous file as it was
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".gmp-snapshot-", dir=folder)
    except OSError as exc:
        raise _about(exc, path) from None
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        try:  # mkstemp makes it private; keep the mode a plain open() would give
            mode = os.stat(path).st_mode & 0o777
        except FileNotFoundError:
            mode = 0o644
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise _about(exc, path) from None
        raise


def _about(exc: OSError, path: str) -> OSError:
    """``exc`` naming the user's ``path``, not the temporary file the
    snapshot was written to first."""
    if exc.errno is None:
        return exc
    return type(exc)(exc.errno, exc.strerror, path)


def record_history(enabled: bool = True, max_entries: int = 100_000, stacks: bool = False) -> None:
    """Record allocator events in every open pool and every pool created
    from now on (``stacks``: with the whole Python stack of each call of the
    Python API that records events, as torch's ``stacks="python"``). Off by
    default; when off it costs one check."""
    global _history_settings

    if isinstance(max_entries, bool) or not isinstance(max_entries, int) or not 0 < max_entries < 1 << 31:
        # checked before the setting is kept: every pool made later applies it
        raise ValueError(f"max_entries must be an int in [1, 2**31), got {max_entries!r}")
    with _settings_lock:
        _history_settings = (max_entries, bool(stacks)) if enabled else None
    for p in _lifecycle.open_pools():
        try:
            p.record_history(enabled, max_entries=max_entries, stacks=stacks)
        except PoolClosedError:  # closed by another thread meanwhile
            continue


def history_settings() -> Optional[tuple[int, bool]]:
    with _settings_lock:
        return _history_settings
