"""The out-of-memory doctor: on an out-of-memory error with allocator
history recorded, replay that history under the memory the run failed in
and say which setting would have fit (``gmp.torch.oom_doctor()``,
``gmp.distributed.snapshot_on_oom()``), and the same for a snapshot file
that records an out-of-memory (``python -m gpumempool tune OOM_SNAPSHOT``).

The capacity a run failed in is what its allocator could have had at that
moment: the bytes it had reserved then (after releasing its cache and
retrying, which both torch and gpumempool do before giving up) plus the
device's free bytes, which torch and gpumempool record on their ``oom``
history entries (``device_free``). When the device had room for the request
and it still failed, a limit (torch's memory fraction, a pool's ``limit``)
stopped it; the snapshot does not record it, and the bytes reserved then
are the most that is known to be allowed.

The failed request itself is not an allocation of the history (it never
happened): the importer puts it back where the ``oom`` entry is, allocated
and freed at once, so that a replay meets the same pressure the run did.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from ._units import format_bytes

__all__ = ["Diagnosis", "capacity_at_oom", "diagnose", "held_at_once", "last_oom"]



def _snapshot_dict(trace_or_snapshot: Any) -> Optional[dict[str, Any]]:
    """The snapshot dict of a path, bytes or dict (None for anything else)."""
    if isinstance(trace_or_snapshot, dict):
        return trace_or_snapshot
    if isinstance(trace_or_snapshot, (str, bytes, os.PathLike)):
        from ._safepickle import load_pickle

        snap = load_pickle(trace_or_snapshot)
        return snap if isinstance(snap, dict) else None
    return None


def last_oom(snapshot: dict[str, Any]) -> Optional[tuple[int, int, dict[str, Any]]]:
    """The latest ``oom`` entry of a snapshot's history: (device, index in
    that device's trace, entry), or None when it records none."""
    traces = snapshot.get("device_traces")
    found: Optional[tuple[int, int, dict[str, Any]]] = None
    if not isinstance(traces, list):
        return None
    for d, tr in enumerate(traces):
        if not isinstance(tr, list):
            continue
        for i, e in enumerate(tr):
            if isinstance(e, dict) and e.get("action") == "oom":
                t = e.get("time_us", 0)
                if found is None or (isinstance(t, (int, float)) and t >= found[2].get("time_us", 0)):
                    found = (d, i, e)
    return found


def capacity_at_oom(trace_or_snapshot: Any) -> Optional[int]:
    """The memory, in bytes, the run of a snapshot had on the device where it
    ran out of memory, or None when the snapshot records no out-of-memory
    (or nothing to tell it by): the replay's device as the importer infers
    it (``meta["recorded_conditions"]["capacity"]``: the bytes reserved at
    the ``oom`` entry plus its ``device_free``; see
    :func:`gpumempool.trace.from_torch_snapshot`).

    ``trace_or_snapshot``: a snapshot (torch's or gpumempool's, as a path,
    bytes or dict), or a :class:`~gpumempool.trace.Trace` of one."""
    meta = getattr(trace_or_snapshot, "meta", None)
    if not isinstance(meta, dict):
        from .trace import from_torch_snapshot

        snap = _snapshot_dict(trace_or_snapshot)
        if snap is None:
            return None
        meta = from_torch_snapshot(snap).meta
    cond = meta.get("recorded_conditions")
    cap = cond.get("capacity") if isinstance(cond, dict) and meta.get("recorded_ooms") else None
    return cap if type(cap) is int and cap > 0 else None


@dataclass
class Diagnosis:
    """What the doctor found for one snapshot."""

    snapshot: str  # the snapshot file the history came from
    capacity: Optional[int]  # the memory the run failed in (bytes)
    line: str  # the line printed to stderr
    json_path: Optional[str] = None  # the full answer, beside the snapshot
    text_path: Optional[str] = None
    #: the setting the line names (torch's ``key:value,...``; "" for its
    #: defaults), None when none was found
    alloc_conf: Optional[str] = None
    peak_reserved: Optional[int] = None
    fits: Optional[bool] = None
    partial: bool = False  # the search stopped at the time limit
    error: Optional[str] = None  # why there is no answer
    settings: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("snapshot", "capacity", "line", "json_path", "text_path",
                                               "alloc_conf", "peak_reserved", "fits", "partial", "error",
                                               "settings")}


def _say(line: str) -> None:
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001,S110 - no stderr: the Diagnosis keeps the line
        pass


def summary_line(result: Any, capacity: int, snapshot: str) -> tuple[str, Any]:
    """The doctor's one line for a :class:`~gpumempool.tune.TuneResult`
    tuned under ``capacity``, and the candidate it names."""
    best, default = result.best, result.default
    cap = format_bytes(capacity, 1)
    details = f"python -m gpumempool tune {snapshot} for details"
    late = f" (search stopped at its time limit after {result.replays} settings)" if result.partial else ""
    if not best.fits:
        fewest = min((c for c in result.candidates if c.complete), key=lambda c: c.result.ooms, default=best)
        return (f"gpumempool: no setting searched fits {cap}; the closest, {_setting(result, fewest)}, still fails "
                f"{fewest.result.ooms:,} allocation(s) (the run holds {format_bytes(result.lower_bound, 1)} at once)"
                f"{late}: {details}"), fewest
    if not best.settings:
        return (f"gpumempool: the replay of this run with torch's defaults peaks at "
                f"{format_bytes(best.peak_reserved, 1)} < {cap} and no setting searched does better: memory outside "
                f"the allocator's history (other processes, tensors from before it was recorded) filled the device"
                f"{late}: {details}"), best
    worse = "" if default.fits else f" (the defaults fail {default.result.ooms:,} allocation(s))"
    return (f"gpumempool: with {result.env_var}={best.alloc_conf} this run peaks at "
            f"{format_bytes(best.peak_reserved, 1)} < {cap}{worse}{late}: {details}"), best


def _setting(result: Any, c: Any) -> str:
    if c.alloc_conf is None:
        return c.describe()
    return f"{result.env_var}={c.alloc_conf}" if c.alloc_conf else "torch's defaults"


def diagnose(snapshot: Union[str, os.PathLike[str]], *, capacity: Optional[int] = None,
             time_limit_s: float = 30.0, jobs: Optional[int] = None, torch_version: Optional[str] = None,
             quiet: bool = False) -> Diagnosis:
    """Tune the history of ``snapshot`` (a pickle file) under ``capacity``
    bytes (default: :func:`capacity_at_oom`), within ``time_limit_s``
    seconds; print the one line to stderr (unless ``quiet``) and write the
    full answer beside the snapshot (``STEM-tune.json``, ``STEM-tune.txt``).
    Never raises: a failure is the line, and :attr:`Diagnosis.error`."""
    path = os.fspath(snapshot)
    diag = Diagnosis(path, capacity, "")
    try:
        _diagnose(diag, time_limit_s, jobs, torch_version)
    except BaseException as exc:  # noqa: BLE001 - the out-of-memory error on its way matters more
        why = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"{type(exc).__name__}: {exc}"
        diag.error = why
        diag.line = f"gpumempool: the out-of-memory doctor could not tune {path}: {why}"
    if not quiet:
        _say(diag.line)
    return diag


def _diagnose(diag: Diagnosis, time_limit_s: float, jobs: Optional[int], torch_version: Optional[str]) -> None:
    from .trace import from_torch_snapshot
    from .tune import tune

    start = time.perf_counter()
    snap = _snapshot_dict(diag.snapshot)
    if snap is None:
        raise ValueError("not a snapshot")
    traces = snap.get("device_traces")
    # Blocks live at the dump make a trace too: history is what was recorded.
    if not isinstance(traces, list) or not any(isinstance(e, dict) and e.get("action") == "alloc"
                                               for t in traces if isinstance(t, list) for e in t):
        diag.error = "no history"
        diag.line = ("gpumempool: out of memory, and no allocator history was recorded to tune: "
                     "torch.cuda.memory._record_memory_history() (or gmp.record_history()) before it")
        return
    trace = from_torch_snapshot(snap)  # with the request that failed (the importer puts it back)
    if diag.capacity is None:
        diag.capacity = capacity_at_oom(trace)
    if jobs is None:
        # Never in this process: it has just run out of memory, and its
        # pools may be in the middle of a call.
        jobs = min(max(os.cpu_count() or 1, 2), 8)
    stem = diag.snapshot[:-len(".pickle")] if diag.snapshot.endswith(".pickle") else diag.snapshot
    found = last_oom(snap)
    held = held_at_once(trace, found[0] if found else 0)
    if diag.capacity is not None and held > diag.capacity:
        # No setting can help: tune would refuse the limit.
        diag.fits = False
        diag.line = (f"gpumempool: no setting searched fits {format_bytes(diag.capacity, 1)}; the run holds "
                     f"{format_bytes(held, 1)} allocated at once on the device (the failed request included), "
                     "more than it has: no allocator setting can help")
        diag.json_path = stem + "-tune.json"
        with open(diag.json_path, "w") as f:
            json.dump({"snapshot": diag.snapshot, "capacity": diag.capacity, "lower_bound": held,
                       "line": diag.line}, f, indent=1)
            f.write("\n")
        return
    left = max(0.5, time_limit_s - (time.perf_counter() - start))
    result = tune(trace, limit=diag.capacity, jobs=jobs, deadline_s=left, torch_version=torch_version)
    if diag.capacity is not None:
        diag.line, named = summary_line(result, diag.capacity, diag.snapshot)
    else:
        named = result.best
        diag.line = (f"gpumempool: the device's size at the failure is unknown; with {_setting(result, named)} this "
                     f"run peaks at {format_bytes(named.peak_reserved, 1)}: python -m gpumempool tune "
                     f"{diag.snapshot} for details")
    diag.alloc_conf, diag.settings = named.alloc_conf, dict(named.settings)
    diag.peak_reserved, diag.fits, diag.partial = named.peak_reserved, named.fits, result.partial
    out = result.as_dict()
    out.update(snapshot=diag.snapshot, capacity=diag.capacity, line=diag.line)
    diag.json_path, diag.text_path = stem + "-tune.json", stem + "-tune.txt"
    with open(diag.json_path, "w") as f:
        json.dump(out, f, indent=1, default=str)
        f.write("\n")
    head = [diag.line, "",
            f"device: {format_bytes(diag.capacity) if diag.capacity else 'unknown'} "
            f"(the memory the run failed in); {result.replays} settings replayed in {result.seconds:.1f} s"
            + (" (stopped at the time limit)" if result.partial else ""),
            f"best: {_setting(result, result.best)}: {format_bytes(result.best.peak_reserved)} peak reserved, "
            + ("fits" if result.best.fits else "does not fit"), ""]
    with open(diag.text_path, "w") as f:
        f.write("\n".join(head) + result.table(10) + "\n")


def held_at_once(trace: Any, device: int) -> int:
    """The most bytes ``trace`` holds allocated at once on ``device``: no
    setting serves the run in less."""
    from .trace import Alloc, Free

    live: dict[int, int] = {}
    held = peak = 0
    for e in trace:
        if type(e) is Alloc and e.device == device:
            live[e.id] = e.size
            held += e.size
            peak = max(peak, held)
        elif type(e) is Free and e.id in live:
            held -= live.pop(e.id)
    return peak
