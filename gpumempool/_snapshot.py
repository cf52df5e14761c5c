"""Snapshots in the format of ``torch.cuda.memory._snapshot()``, so that
pytorch.org/memory_viz and ``torch.cuda._memory_viz`` can render them, plus
fragmentation figures of our own.

``pool.snapshot()`` covers one pool, :func:`snapshot` every open pool;
:func:`dump_snapshot` writes the pickle torch's tools read;
:func:`record_history` turns on event recording (alloc, free_requested,
free_completed, segment_alloc, segment_free, segment_map, oom), optionally
with the Python stack of each allocation made through the Python API
(allocations torch makes through the C ABI carry no Python frames).
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import tempfile
import threading
import traceback
from typing import Any, Optional, Sequence

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


def capture_frames(skip: int = 2, limit: int = 32) -> list[dict[str, Any]]:
    """The caller's Python stack, innermost first, as torch writes frames."""
    stack = traceback.extract_stack(limit=limit + skip)[:-skip]
    return [{"filename": f.filename, "line": f.lineno or 0, "name": f.name} for f in reversed(stack)]


def pool_snapshot(name: str, handle: int, backend: str, raw: dict[str, Any], history: list[dict[str, Any]],
                  frames: dict[int, list[dict[str, Any]]],
                  alloc_frames: Sequence[tuple[int, int, int, list[dict[str, Any]]]] = ()) -> dict[str, Any]:
    """Build torch's snapshot dict of the pool ``name`` (engine handle
    ``handle``, backend ``backend``) from the engine's JSON. ``frames``: the
    Python stacks of live blocks by address; ``alloc_frames``: (address,
    start and end of the call in µs, stack) per allocation, matched to the
    history's alloc entries by address and time (an address is reused)."""
    segments = []
    for s in raw["segments"]:
        blocks = [
            {
                "address": b["address"],
                "size": b["size"],
                "requested_size": b["requested_size"],
                "state": b["state"],
                "frames": frames.get(b["address"], []) if b["state"] != "inactive" else [],
            }
            for b in s["blocks"]
        ]
        segments.append(
            {
                "device": s["device"],
                "address": s["address"],
                "total_size": s["total_size"],
                "allocated_size": s["allocated_size"],
                "active_size": s["active_size"],
                "requested_size": s["requested_size"],
                "stream": s["stream"],
                "segment_type": s["segment_type"],
                "segment_pool_id": (0, handle),
                "is_expandable": s["is_expandable"],
                "frames": [],
                "blocks": blocks,
                "pool": name,
            }
        )
    devices = 1 + max([s["device"] for s in segments] + [e["device"] for e in history] + [-1])
    traces: list[list[dict[str, Any]]] = [[] for _ in range(max(devices, 1))]
    by_addr: dict[int, list[tuple[int, int, list[dict[str, Any]]]]] = {}
    for addr, t0, t1, stack in alloc_frames:
        by_addr.setdefault(addr, []).append((t0, t1, stack))
    for e in history:
        entry = {
            "action": e["action"],
            "addr": e["addr"],
            # Pools hand out the same addresses (sim pools, or pools over
            # one cached allocator): a merged snapshot keeps them apart.
            "pool_handle": handle,
            "size": e["size"],
            "stream": e["stream"],
            "time_us": e["time_us"],
            "frames": _alloc_stack(by_addr, e) if e["action"] == "alloc" else [],
        }
        if e["action"] == "oom":
            entry["device_free"] = e.get("device_free", 0)
        elif e.get("caller_sized"):
            entry["caller_sized"] = True  # an alloc_segment: replays repeat it
        traces[e["device"]].append(entry)
    return {
        "segments": segments,
        "device_traces": traces,
        "allocator_settings": {"pool": name, "backend": backend},
        "fragmentation": raw["fragmentation"],
    }


def _alloc_stack(by_addr: dict[int, list[tuple[int, int, list[dict[str, Any]]]]],
                 e: dict[str, Any]) -> list[dict[str, Any]]:
    """The stack of the Python call that made alloc entry ``e`` (taken from
    by_addr), or [] when none did (torch through the C ABI, or not kept)."""
    calls = by_addr.get(e["addr"])
    if calls:
        t = e["time_us"]
        for i, (t0, t1, stack) in enumerate(calls):
            if t0 <= t <= t1:
                del calls[i]
                return stack
    return []


def merge(snaps: list[dict[str, Any]]) -> dict[str, Any]:
    """One snapshot of several pools: segments side by side, traces merged by time."""
    segments: list[dict[str, Any]] = []
    traces: list[list[dict[str, Any]]] = []
    for s in snaps:
        segments += s["segments"]
        for d, t in enumerate(s["device_traces"]):
            while len(traces) <= d:
                traces.append([])
            traces[d] += t
    for t in traces:
        t.sort(key=lambda e: e["time_us"])
    segments.sort(key=lambda s: (s["device"], s["address"]))
    return {"segments": segments, "device_traces": traces or [[]], "allocator_settings": {"pools": [s["allocator_settings"]["pool"] for s in snaps]}}


def snapshot(not_read: Optional[list[str]] = None) -> dict[str, Any]:
    """A snapshot of every open pool of this process, in torch's format.
    With ``not_read``, a pool this thread is inside of (running its Python
    allocator function: it cannot be read until that returns) is left out
    and named there, instead of raising CallbackReentryError."""
    snaps = []
    for p in _lifecycle.open_pools():
        try:
            snaps.append(p.snapshot())
        except PoolClosedError:  # closed by another thread meanwhile
            continue
        except CallbackReentryError as exc:
            if not_read is None:
                raise
            not_read.append(exc.pool)
    return merge(snaps)


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
    from now on (``stacks``: with the Python stack of allocations made
    through the Python API). Off by default; when off it costs one check."""
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
