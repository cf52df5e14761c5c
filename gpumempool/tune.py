"""Find the allocator settings that would have used the least memory for a
recorded run: replay its trace on the simulated device under each candidate
setting and keep the one with the lowest peak reserved bytes.

::

    import gpumempool as gmp

    result = gmp.tune("run.trace.gz")          # or a torch snapshot pickle with history
    print(result.best.alloc_conf)              # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,...
    print(result.best.mempool_call)            # gmp.MemPool("vmm", expandable=True, ...)
    print(result.table())

The search covers the settings torch's caching allocator accepts
(``expandable_segments``, ``max_split_size_mb``, ``roundup_power2_divisions``,
``max_non_split_rounding_mb`` and, with a limit, ``garbage_collection_threshold``),
on the value ranges torch documents: a coarse grid first, then one setting
at a time around the best until no change helps. The settings only
gpumempool's pools accept (a release threshold: unused bytes kept cached
per device, the rest returned to the device) are tried from the best torch setting and listed separately.

Each figure is a replay (:func:`gpumempool.replay.replay`), so a prediction
is exactly what replaying the trace under that setting gives; how close a
replay comes to torch's own reserved bytes is checked on the shipped torch
traces (``benchmarks/results/replay_policies.md``,
``benchmarks/tune_proof.py``). Replays run in parallel in fresh ``spawn``
processes (``python -m gpumempool._tune_worker``: a forked child cannot use
gpumempool, and multiprocessing's spawn would run the caller's script again).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Union

from ._errors import InvalidArgumentError
from ._units import format_bytes
from .replay import ReplayResult, replay
from .trace import Alloc, Free, PathLike, Trace, TraceFile, TraceFormatError, from_torch_snapshot, is_trace_file

__all__ = ["Candidate", "TuneResult", "alloc_conf", "tune", "TORCH_SPACE", "EXTRA_SPACE"]

MiB = 1 << 20

#: The values tried for each setting torch's allocator accepts (replay
#: policy keys; ``None`` is torch's default). torch refuses
#: ``max_split_size_mb`` of 20 or less and ``roundup_power2_divisions`` that
#: are not powers of two; ``garbage_collection_threshold`` is a fraction of
#: the memory torch may use, so it is tried only with a limit.
TORCH_SPACE: dict[str, list[Any]] = {
    "expandable": [False, True],
    "max_split_size": [None, 32 * MiB, 64 * MiB, 128 * MiB, 256 * MiB, 512 * MiB, 1024 * MiB, 2048 * MiB],
    "roundup_power2_divisions": [None, 1, 2, 4, 8, 16],
    "max_non_split_rounding_size": [None, 64 * MiB, 256 * MiB, 1024 * MiB],
    "garbage_collection_threshold": [None, 0.5, 0.6, 0.7, 0.8, 0.9],
}

#: Values only gpumempool's pools accept, tried from the best torch setting.
EXTRA_SPACE: dict[str, list[Any]] = {
    "release_threshold": [64 * MiB, 256 * MiB, 1024 * MiB],
}

#: The coarse grid the search starts from.
_COARSE: dict[str, list[Any]] = {
    "expandable": [False, True],
    "roundup_power2_divisions": [None, 2, 8],
    "max_split_size": [None, 64 * MiB, 512 * MiB],
}

#: A replay stops once it reserves this much more than the best so far.
_STOP_MARGIN = 1.25

#: torch's PYTORCH_CUDA_ALLOC_CONF names of the replay policy keys.
_TORCH_NAMES = {
    "expandable": "expandable_segments",
    "max_split_size": "max_split_size_mb",
    "roundup_power2_divisions": "roundup_power2_divisions",
    "max_non_split_rounding_size": "max_non_split_rounding_mb",
    "garbage_collection_threshold": "garbage_collection_threshold",
}
_SETTING_KEYS = tuple(dict.fromkeys([*TORCH_SPACE, *EXTRA_SPACE]))

ProgressFn = Callable[[int, int], None]


def _torch_expressible(settings: Mapping[str, Any]) -> bool:
    """Whether torch's allocator accepts ``settings``."""
    for key, value in settings.items():
        if key not in _TORCH_NAMES:
            return False
        if key in ("max_split_size", "max_non_split_rounding_size") and (value % MiB or value <= 20 * MiB):
            return False
        if key == "roundup_power2_divisions" and (not isinstance(value, int) or value & (value - 1)):
            return False
    return True


def alloc_conf(settings: Mapping[str, Any]) -> str:
    """Replay policy keys torch accepts as torch's ``key:value,...`` setting
    ("" for its defaults), in torch's documented order."""
    parts = []
    for key, value in sorted(settings.items(), key=lambda kv: list(_TORCH_NAMES).index(kv[0])):
        name = _TORCH_NAMES[key]
        if key == "expandable":
            parts.append(f"{name}:True")
        elif key in ("max_split_size", "max_non_split_rounding_size"):
            parts.append(f"{name}:{value // MiB}")
        else:
            parts.append(f"{name}:{value}")
    return ",".join(parts)


@dataclass
class Candidate:
    """One setting and what its replay measured. ``settings`` holds the
    replay policy keys that differ from torch's defaults."""

    settings: dict[str, Any]
    result: ReplayResult
    torch: bool  # torch's allocator accepts these settings
    limit: Optional[int] = None
    #: every setting was proven exact against the modelled torch version by
    #: the fidelity matrix (gpumempool/oracle/proven.json); tune recommends
    #: only verified ones
    verified: bool = True

    @property
    def peak_reserved(self) -> int:
        return self.result.peak_reserved

    @property
    def fits(self) -> bool:
        """Every allocation was served (under the limit, if one was given)."""
        return self.result.ooms == 0

    @property
    def complete(self) -> bool:
        """The replay ran to the end; False when it stopped early, once it
        had reserved more than the best setting known then (its figures
        are those of the events up to there)."""
        return self.result.stopped_at is None

    @property
    def alloc_conf(self) -> Optional[str]:
        """The ``PYTORCH_CUDA_ALLOC_CONF`` value for these settings ("" for
        torch's defaults), or None when torch has no way to say them."""
        return alloc_conf(self.settings) if self.torch else None

    @property
    def mempool_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :class:`gpumempool.MemPool` with the same
        policy (``backend``: ``vmm`` for expandable segments, else ``cuda``)."""
        out: dict[str, Any] = {"backend": "vmm" if self.settings.get("expandable") else "cuda"}
        for key in _SETTING_KEYS:
            if key in self.settings:
                out[key] = self.settings[key]
        if self.limit:
            out["limit"] = self.limit
        return out

    @property
    def mempool_call(self) -> str:
        """:attr:`mempool_kwargs` as Python source."""
        kw = dict(self.mempool_kwargs)
        args = [repr(kw.pop("backend"))]
        for key, value in kw.items():
            if isinstance(value, int) and not isinstance(value, bool) and value >= MiB and value % MiB == 0:
                args.append(f"{key}={value // MiB} << 20")
            else:
                args.append(f"{key}={value!r}")
        return f"gmp.MemPool({', '.join(args)})"

    def describe(self) -> str:
        """The settings in words, ``defaults`` for none."""
        if not self.settings:
            return "defaults"
        return ", ".join(f"{k}={_show(k, v)}" for k, v in self.settings.items()) + \
            ("" if self.verified else " (unverified)")

    def as_dict(self) -> dict[str, Any]:
        r = self.result
        return {
            "settings": dict(self.settings), "torch": self.torch, "verified": self.verified,
            "alloc_conf": self.alloc_conf,
            # a replay stopped early does not say whether the rest would fit
            "mempool": self.mempool_kwargs, "fits": self.fits if self.complete else None, "complete": self.complete,
            "stopped_at": r.stopped_at, "peak_reserved": r.peak_reserved,
            "peak_allocated": r.peak_allocated, "fragmentation": r.fragmentation,
            "backend_calls": r.backend_calls, "alloc_retries": r.alloc_retries, "ooms": r.ooms,
        }


def _show(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int) and key not in ("roundup_power2_divisions",):
        return format_bytes(value, 0) if value % MiB == 0 else format_bytes(value)
    return str(value)


@dataclass
class TuneResult:
    """What :func:`tune` found. ``candidates`` are sorted best first (those
    that fit first, then those replayed to the end, then by peak reserved
    bytes, fewer settings and backend calls). A candidate whose replay
    stopped early (``complete`` False) reserved more than the best known
    then, and its figures cover the events up to there. Of settings that do
    not fit, those failing fewer allocations come first."""

    source: str
    events: int
    lower_bound: int  # peak of the bytes the trace holds at once: no setting reserves less
    limit: Optional[int]
    default: Candidate
    candidates: list[Candidate]
    recorded_peak_reserved: Optional[int] = None  # what the recording allocator reserved
    recorded_by: Optional[str] = None
    replays: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    #: the torch version (major.minor) whose allocator the engine modelled
    torch_version: str = ""
    #: the search stopped at ``deadline_s`` before it was done: the best of
    #: the settings replayed by then
    partial: bool = False

    @property
    def env_var(self) -> str:
        """The variable that torch version reads the settings from."""
        from .oracle import env_var

        return env_var(self.torch_version)

    @property
    def best(self) -> Candidate:
        """The best setting torch accepts that the fidelity matrix proved
        for the modelled torch version (never worse than the default)."""
        return next(c for c in self.candidates if c.torch and c.verified)

    @property
    def best_extra(self) -> Optional[Candidate]:
        """The best setting only gpumempool's pools accept, if it beats :attr:`best`."""
        best = self.best
        for c in self.candidates:
            if not c.torch and _rank(c) < _rank(best):
                return c
        return None

    def top(self, n: int = 5, torch: Optional[bool] = True) -> list[Candidate]:
        """The best ``n`` distinct outcomes (torch's settings only,
        gpumempool's only, or all for ``torch=None``): of the settings that
        replay to the same figures, only the simplest is listed (the rest
        are in :attr:`candidates`)."""
        out: list[Candidate] = []
        seen: set[tuple[Any, ...]] = set()
        for c in self.candidates:
            if (torch is not None and c.torch != torch) or not c.complete:
                continue
            r = c.result
            outcome = (r.peak_reserved, r.peak_allocated, r.backend_calls, r.alloc_retries, r.ooms)
            if outcome not in seen:
                seen.add(outcome)
                out.append(c)
                if len(out) == n:
                    break
        return out

    def table(self, n: int = 5) -> str:
        """The best ``n`` torch settings, the default and the best of the
        extra settings, as a text table."""
        rows: list[tuple[str, ...]] = [("#", "settings", "peak reserved", "vs default", "fragmentation",
                                        "backend calls", "retries", "OOMs")]
        base = self.default.peak_reserved or 1

        def row(tag: str, c: Candidate) -> tuple[str, ...]:
            r = c.result
            return (tag, c.describe(), format_bytes(r.peak_reserved), f"{r.peak_reserved / base:.3f}",
                    f"{r.fragmentation:.3f}", f"{r.backend_calls:,}", f"{r.alloc_retries:,}",
                    f"{r.ooms:,}" + ("" if c.fits else " (does not fit)"))

        for i, c in enumerate(self.top(n), 1):
            rows.append(row(str(i), c))
        if self.default not in self.top(n):
            rows.append(row("default", self.default))
        extra = self.best_extra
        if extra is not None:
            rows.append(row("gmp only", extra))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [" | ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths)))
                 for r in rows]
        lines.insert(1, "-+-".join("-" * w for w in widths))
        return "\n".join(lines)

    def as_dict(self, n: int = 10) -> dict[str, Any]:
        best, extra = self.best, self.best_extra
        return {
            "source": self.source, "events": self.events, "lower_bound": self.lower_bound, "limit": self.limit,
            "recorded_by": self.recorded_by, "recorded_peak_reserved": self.recorded_peak_reserved,
            "best": best.as_dict(), "default": self.default.as_dict(),
            "best_extra": extra.as_dict() if extra is not None else None,
            "saving": 1 - best.peak_reserved / self.default.peak_reserved if self.default.peak_reserved else 0.0,
            "candidates": [c.as_dict() for c in self.candidates[:n]],
            "replays": self.replays, "seconds": self.seconds, "notes": list(self.notes),
            "torch_version": self.torch_version, "env_var": self.env_var, "partial": self.partial,
        }


def _rank(c: Candidate) -> tuple[Any, ...]:
    r = c.result
    # Of settings that do not fit, the one failing the fewest allocations
    # comes closest (their peaks are capped by the limit and say nothing).
    # A replay stopped early (it reserved far more than the best then) says
    # nothing of fitting: after every complete one.
    return (not c.complete, not c.fits, r.ooms, r.peak_reserved, len(c.settings), r.backend_calls, r.alloc_retries)


def _key(settings: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, v) for k, v in settings.items() if v is not None and v is not False))


def _clean(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` without the defaults, and without the settings that do
    nothing in that company (torch ignores max_non_split_rounding_mb
    without max_split_size_mb)."""
    out = {k: v for k, v in settings.items() if v is not None and v is not False}
    if "max_non_split_rounding_size" in out and "max_split_size" not in out:
        del out["max_non_split_rounding_size"]
    return out


# ---- replays, in this process or in worker processes ----


def _replay_settings(trace: Union[Trace, TraceFile], settings: Mapping[str, Any], limit: Optional[int],
                     capacity: Optional[int], stop_above: Optional[int] = None,
                     torch_version: Optional[str] = None) -> ReplayResult:
    policy = dict(settings)
    if limit:
        policy["limit"] = limit
    elif "garbage_collection_threshold" in policy and capacity:
        policy["limit"] = capacity  # torch's threshold is a fraction of the device's memory
    return replay(trace, policy, recorded_policy=False, stop_above=stop_above, torch_version=torch_version)


def _result_from_json(d: dict[str, Any]) -> ReplayResult:
    names = {f.name for f in dataclasses.fields(ReplayResult)}
    return ReplayResult(**{k: v for k, v in d.items() if k in names})


class _Worker:
    """A fresh Python process (``python -m gpumempool._tune_worker``) that
    loads the trace once and replays the settings it is sent, one JSON line
    each way. Not multiprocessing: its spawn would run the caller's
    ``__main__`` again in each worker, and fork cannot carry the Go runtime."""

    def __init__(self, path: str, limit: Optional[int], capacity: Optional[int],
                 torch_version: Optional[str] = None) -> None:
        # The same gpumempool as this process's, wherever it came from: its
        # folder goes on the worker's path unless this interpreter finds it
        # there anyway (site-packages must not go before the standard library).
        self.path = path
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONSAFEPATH="1")
        if here not in (os.path.abspath(p) for p in sys.path if p):
            env["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpumempool._tune_worker", path, json.dumps([limit, capacity, torch_version])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    def replay(self, settings: Mapping[str, Any], stop_above: Optional[int]) -> ReplayResult:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps({"settings": dict(settings), "stop_above": stop_above}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr is not None else ""
            raise RuntimeError(f"tune: a replay worker died (exit status {self.proc.wait()}): "
                               f"{err.strip()[-2000:] or 'no message'}")
        out = json.loads(line)
        if out.get("unreadable"):
            raise TraceFormatError(f"the replay workers cannot read the trace from {self.path}: {out['error']}")
        if "error" in out:
            raise InvalidArgumentError(f"replay of {dict(settings)}: {out['error']}")
        return _result_from_json(out)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


def worker_main(path: str, args: str) -> int:
    """The worker's loop: a replay per line of settings on stdin."""
    limit, capacity, torch_version = (json.loads(args) + [None])[:3]
    try:
        trace: Optional[Trace] = Trace.load(path)
        unreadable = None
    except (ValueError, OSError, MemoryError) as exc:
        # Said in answer to each job (a traceback on stderr would be a
        # RuntimeError of the caller's).
        trace, unreadable = None, f"{type(exc).__name__}: {exc}"
    for line in sys.stdin:
        if trace is None:
            out = {"error": unreadable, "unreadable": True}
            sys.stdout.write(json.dumps(out) + "\n")
            sys.stdout.flush()
            continue
        try:
            job = json.loads(line)
            r = _replay_settings(trace, job["settings"], limit, capacity, job["stop_above"], torch_version)
            out = r.as_dict()
        except (ValueError, TypeError, MemoryError) as exc:
            out = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
    return 0


class _Runner:
    """Runs each setting's replay once (results are kept by setting), in
    ``jobs`` worker processes or, for ``jobs == 1``, here."""

    def __init__(self, trace: Union[Trace, TraceFile], path: Optional[str], jobs: int, limit: Optional[int],
                 capacity: Optional[int], progress: Optional[ProgressFn], torch_version: Optional[str] = None,
                 deadline: Optional[float] = None) -> None:
        self.trace, self.limit, self.capacity, self.progress = trace, limit, capacity, progress
        self.torch_version = torch_version
        #: time.perf_counter() at which replays stop (None: never)
        self.deadline = deadline
        self.out_of_time = False
        self.done: dict[tuple[tuple[str, Any], ...], ReplayResult] = {}
        self.planned = 0
        self.workers: list[_Worker] = []
        if jobs > 1 and path is not None:
            try:
                for _ in range(jobs):
                    self.workers.append(_Worker(path, limit, capacity, torch_version))
            except BaseException:  # those started would wait for jobs as long as this process lives
                for w in self.workers:
                    w.proc.kill()
                    w.close()
                raise
            import concurrent.futures  # only for parallel replays: not on every `import gpumempool`

            self.threads = concurrent.futures.ThreadPoolExecutor(max_workers=jobs)
            self.idle: "queue.SimpleQueue[_Worker]" = queue.SimpleQueue()
            for w in self.workers:
                self.idle.put(w)
        elif isinstance(trace, TraceFile):
            # Replays here: read the file once, as a worker does, rather than
            # once per replay (a TraceFile streams it each time).
            self.trace = Trace.load(trace.path, max_events=trace.max_events)

    def close(self, kill: bool = False) -> None:
        """Stop the workers once they are idle; with ``kill`` (the caller
        was interrupted, or a replay failed), now: the threads waiting for
        the replays under way then see their workers die."""
        if self.workers:
            if kill:
                for w in self.workers:
                    w.proc.kill()
            self.threads.shutdown(cancel_futures=True)
            for w in self.workers:
                w.close()
            self.workers = []

    def _on_worker(self, settings: Mapping[str, Any], stop_above: Optional[int]) -> ReplayResult:
        w = self.idle.get()
        try:
            return w.replay(settings, stop_above)
        finally:
            self.idle.put(w)

    def run(self, settings_list: Iterable[Mapping[str, Any]], expect: int = 0,
            stop_above: Optional[int] = None) -> None:
        """Replay each setting not replayed yet; with ``stop_above``, a
        replay stops once it reserves more (it cannot be the best)."""
        todo: dict[tuple[tuple[str, Any], ...], dict[str, Any]] = {}
        for s in settings_list:
            c = _clean(s)
            if _key(c) not in self.done:
                todo.setdefault(_key(c), c)
        self.planned = max(self.planned, len(self.done) + len(todo) + expect)
        if self.out_of_time or not todo:
            return
        if not self.workers:
            for k, s in todo.items():
                if self._past_deadline():  # checked between replays: one replay here is not interrupted
                    return
                self.done[k] = _replay_settings(self.trace, s, self.limit, self.capacity, stop_above,
                                                self.torch_version)
                self._tick()
            return
        import concurrent.futures

        futures = {self.threads.submit(self._on_worker, s, stop_above): k for k, s in todo.items()}
        left = None if self.deadline is None else max(0.0, self.deadline - time.perf_counter())
        try:
            for fut in concurrent.futures.as_completed(futures, timeout=left):
                self.done[futures[fut]] = fut.result()
                self._tick()
        except concurrent.futures.TimeoutError:
            # The replays under way are killed with their workers (the
            # threads waiting for them see them die and are not listened to).
            self.out_of_time = True
            self.close(kill=True)

    def _past_deadline(self) -> bool:
        if self.deadline is not None and time.perf_counter() >= self.deadline:
            self.out_of_time = True
        return self.out_of_time

    def _tick(self) -> None:
        if self.progress is not None:
            self.progress(len(self.done), max(self.planned, len(self.done)))


def _candidate(settings: Mapping[str, Any], result: ReplayResult, limit: Optional[int],
               proven: Optional[frozenset[str]] = None) -> Candidate:
    s = _clean(settings)
    return Candidate(s, result, _torch_expressible(s), limit, proven is None or set(s) <= proven)


def _load(trace: Union[Trace, TraceFile, PathLike]) -> tuple[Union[Trace, TraceFile], Optional[str]]:
    """The trace and a gmptrace path worker processes can load it from."""
    if isinstance(trace, (Trace, TraceFile)):
        return trace, getattr(trace, "path", None)
    path = os.fspath(trace)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    if is_trace_file(path):
        return TraceFile(path), path
    return from_torch_snapshot(path), None  # a snapshot pickle (its loader says what else is wrong)


def tune(
    trace: Union[Trace, TraceFile, PathLike],
    *,
    limit: Optional[int] = None,
    extra: bool = True,
    jobs: Optional[int] = None,
    progress: Optional[ProgressFn] = None,
    torch_version: Optional[str] = None,
    deadline_s: Optional[float] = None,
) -> TuneResult:
    """Search the allocator settings for the lowest peak reserved bytes of
    ``trace`` (a :class:`~gpumempool.trace.Trace`, a
    :class:`~gpumempool.trace.TraceFile`, or the path of a gmptrace file or
    of a torch snapshot pickle with history).

    ``limit`` (bytes) replays every candidate with that much memory, as
    ``torch.cuda.set_per_process_memory_fraction`` would give torch:
    settings that cannot serve the run within it are marked (``fits`` is
    False) and ranked last. ``extra`` also tries settings only gpumempool's
    pools accept. ``jobs`` worker processes replay in parallel (default: the
    machine's cores, at most 8; 1 replays in this process).
    ``progress(done, total)`` follows the replays. ``torch_version``
    (major.minor) is the torch whose allocator the result is for (default:
    the installed torch's, else the newest the fidelity matrix judged): the
    replays follow its rules (``MemPool(torch_version=...)``), and only
    settings the matrix proved exact for it are recommended
    (:attr:`Candidate.verified`). ``deadline_s`` bounds the search: once
    that many seconds have passed, the replays under way are stopped (in
    worker processes; with ``jobs=1`` the one replay under way finishes)
    and the best setting replayed by then is returned, with
    :attr:`TuneResult.partial` set; TimeoutError when not even torch's
    defaults were replayed by then.

    Raises ValueError (:class:`~gpumempool.trace.TraceFormatError` for a bad
    file) for a trace without events, and
    :class:`~gpumempool.InvalidArgumentError` for a limit below the trace's
    lower bound on a device (the peak of the bytes it holds at once there:
    the limit holds for each device)."""
    start = time.perf_counter()
    from .oracle.proven import MODELLED, installed_torch_version, modelled_version, proven_settings

    if torch_version is not None and not re.match(r"^\d+\.\d+(\.|\+|$)", str(torch_version)):
        raise InvalidArgumentError(f"torch_version must be MAJOR.MINOR (e.g. 2.15), got {torch_version!r}")
    modelled = modelled_version(torch_version or installed_torch_version())
    proven = proven_settings(modelled) if modelled in MODELLED else None
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0):
        raise InvalidArgumentError(f"limit must be a positive number of bytes, got {limit!r}")
    tr, path = _load(trace)
    source = os.fspath(trace) if isinstance(trace, (str, os.PathLike)) else (path or tr.source or "trace")
    counts = tr.counts()
    if counts.get("alloc", 0) == 0:
        raise TraceFormatError(f"{source}: the trace has no allocations ({len(tr):,} events): nothing to tune "
                               "(was history recorded while the program ran?)")
    if isinstance(tr, Trace):
        # As replay checks it, and before worker processes read it from a
        # file: they would refuse it as they load it.
        tr.validate()
    lower = tr.peak_requested()
    # The limit holds for each device (replay's, as torch's memory fraction):
    # below the total, it may still be above what each device holds.
    if limit is not None and limit < lower and limit < (device_lower := _device_peak_requested(tr)):
        raise InvalidArgumentError(
            f"limit {format_bytes(limit)} is below the trace's lower bound {format_bytes(device_lower)} on one "
            "device (the most bytes the program holds allocated at once on a device; the limit applies to each): "
            "no setting can run it in that much memory")
    notes: list[str] = []
    if proven is None:
        notes.append(f"torch {modelled or '(none installed)'} was not judged by the fidelity matrix: every "
                     "setting is shown as the engine predicts it, none verified against torch")
    recorded = tr.meta.get("recorded_policy")
    if isinstance(recorded, dict):
        odd = {k: v for k, v in recorded.items() if k not in _TORCH_NAMES and k not in ("backend", "capacity")}
        if odd:
            notes.append("the recording used settings torch has no equivalent for ("
                         + ", ".join(f"{k}={v}" for k, v in odd.items())
                         + "): 'default' below is torch's defaults, not the recording's settings")
    capacity = tr.meta.get("capacity") if isinstance(tr.meta.get("capacity"), int) else None
    if deadline_s is not None and (isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float))
                                   or not deadline_s > 0):
        raise InvalidArgumentError(f"deadline_s must be a positive number of seconds, got {deadline_s!r}")
    deadline = None if deadline_s is None else start + deadline_s
    if jobs is None:
        jobs = min(os.cpu_count() or 1, 8)
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise InvalidArgumentError(f"jobs must be a positive int, got {jobs!r}")

    with tempfile.TemporaryDirectory(prefix="gmp-tune-") as tmp:
        if jobs > 1 and path is None:
            # a Trace in memory (from a snapshot): the workers read it from a file
            path = os.path.join(tmp, "trace.gz")
            assert isinstance(tr, Trace)
            tr.save(path)
        runner = _Runner(tr, path, jobs, limit, capacity, progress, modelled or None, deadline)
        try:
            space = dict(TORCH_SPACE)
            if limit is None:
                space["garbage_collection_threshold"] = [None]
            # The default and the usual winner first, in full: from then on a
            # replay stops once it reserves more than the best so far.
            runner.run([{}, {"expandable": True}], expect=20)
            if _key({}) not in runner.done:
                raise TimeoutError(f"tune: {source}: not even torch's defaults were replayed in {deadline_s} s "
                                   "(deadline_s)")
            best = _best_of(runner, limit, proven)
            grid: list[dict[str, Any]] = [{}]
            for key, values in _COARSE.items():
                grid = [dict(g, **{key: v}) for g in grid for v in values]
            if limit is not None:
                grid += [dict(g, garbage_collection_threshold=0.8) for g in grid]
            runner.run(grid, expect=12, stop_above=_stop(best))
            best = _best_of(runner, limit, proven)
            # one setting at a time around the best, until nothing helps
            for _ in range(4):
                before = _key(best.settings)
                for key, values in space.items():
                    runner.run([dict(best.settings, **{key: v}) for v in values], stop_above=_stop(best))
                    best = _best_of(runner, limit, proven)
                if _key(best.settings) == before:
                    break
            if extra:
                runner.run([dict(best.settings, **{key: v}) for key, values in EXTRA_SPACE.items() for v in values],
                           stop_above=_stop(best))
        except BaseException:
            runner.close(kill=True)
            raise
        finally:
            runner.close()

    cands = sorted((_candidate(dict(k), r, limit, proven) for k, r in runner.done.items()), key=_rank)
    default = next(c for c in cands if not c.settings)
    first = cands[0].result
    return TuneResult(
        source=source, events=len(tr), lower_bound=lower, limit=limit, default=default, candidates=cands,
        recorded_peak_reserved=first.recorded_peak_reserved, recorded_by=first.recorded_by,
        replays=len(runner.done), seconds=time.perf_counter() - start, notes=notes, torch_version=modelled,
        partial=runner.out_of_time)


def _device_peak_requested(tr: Union[Trace, TraceFile]) -> int:
    """The most bytes ``tr`` holds allocated at once on one device."""
    live: dict[int, tuple[int, int]] = {}  # id -> (device, size)
    held: dict[int, int] = {}
    peak = 0
    for e in tr:
        if isinstance(e, Alloc):
            live[e.id] = (e.device, e.size)
            held[e.device] = now = held.get(e.device, 0) + e.size
            peak = max(peak, now)
        elif isinstance(e, Free) and e.id in live:
            dev, size = live.pop(e.id)
            held[dev] -= size
    return peak


def _best_of(runner: _Runner, limit: Optional[int], proven: Optional[frozenset[str]] = None) -> Candidate:
    """The best verified torch setting replayed so far."""
    cands = [_candidate(dict(k), r, limit, proven) for k, r in runner.done.items()]
    return min((c for c in cands if c.torch and c.verified), key=_rank)


def _stop(best: Candidate) -> Optional[int]:
    """Where a replay can stop: once it reserves a quarter more than the
    best (only a best that fits beats what reserves more; the margin keeps
    the runners-up for the table)."""
    return int(best.peak_reserved * _STOP_MARGIN) if best.fits and best.complete else None


class _CallableModule(types.ModuleType):
    """This module, callable as :func:`tune` (``gmp.tune(trace)``), as
    :mod:`gpumempool.replay` is callable as its function."""

    def __call__(self, trace: Union[Trace, TraceFile, PathLike], **kwargs: Any) -> TuneResult:
        return tune(trace, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
__signature__ = inspect.signature(tune)
