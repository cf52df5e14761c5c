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
from ._policy import SETTINGS, TORCH_SIZES, torch_settings
from ._units import format_bytes
from .replay import DEFAULT_CAPACITY, ReplayResult, replay
from .trace import Alloc, Free, PathLike, Trace, TraceFile, TraceFormatError, from_torch_snapshot, is_trace_file

__all__ = ["Candidate", "TuneResult", "alloc_conf", "tune", "TORCH_SPACE", "EXTRA_SPACE", "OPTION_NAMES", "TORCH_NAMES"]

MiB = 1 << 20

#: The values tried for each setting torch's allocator accepts (replay
#: policy keys; ``None`` is torch's default): expandable segments, then the
#: pool settings torch has, with the values the engine's schema says are
#: worth trying (``search``). torch refuses ``max_split_size_mb`` of 20 or
#: less and ``roundup_power2_divisions`` that are not powers of two;
#: ``garbage_collection_threshold`` is a fraction of the memory torch may
#: use, so it is tried only with a limit.
TORCH_SPACE: dict[str, list[Any]] = {
    "expandable": [False, True],
    **{key: [None, *SETTINGS[key].get("search", [])] for key in torch_settings()},
}

#: Values only gpumempool's pools accept (the settings torch has not),
#: tried from the best torch setting.
EXTRA_SPACE: dict[str, list[Any]] = {
    f["name"]: list(f["search"]) for f in SETTINGS.values() if f.get("search") and not f.get("torch")
}

#: The coarse grid the search starts from.
_COARSE: dict[str, list[Any]] = {
    "expandable": [False, True],
    "roundup_power2_divisions": [None, 2, 8],
    "max_split_size": [None, 64 * MiB, 512 * MiB],
}

#: A replay stops once it reserves this much more than the best so far.
_STOP_MARGIN = 1.25

#: torch's PYTORCH_CUDA_ALLOC_CONF names of the replay policy keys, in
#: torch's documented order: expandable segments (a backend's option, not a
#: pool setting), then the pool settings torch has too (the engine's schema).
TORCH_NAMES = {"expandable": "expandable_segments", **torch_settings()}
_SETTING_KEYS = tuple(dict.fromkeys([*TORCH_SPACE, *EXTRA_SPACE]))

#: The names ``exclude`` accepts: torch's option names and the replay
#: policy keys, each to the policy key it drops from the search.
OPTION_NAMES: dict[str, str] = {**{name: key for key, name in TORCH_NAMES.items()},
                                **{key: key for key in _SETTING_KEYS}}

#: Where the 2.9.1 pitfall applies, what to do about it (pytorch/pytorch#183387).
_PITFALL_2_9 = ("torch 2.9.1 reads PYTORCH_ALLOC_CONF too, but silently ignores expandable_segments there "
                "(pytorch/pytorch#183387, fixed by 2.11): keep PYTORCH_CUDA_ALLOC_CONF")

ProgressFn = Callable[[int, int], None]


def _torch_expressible(settings: Mapping[str, Any]) -> bool:
    """Whether torch's allocator accepts ``settings``."""
    for key, value in settings.items():
        if key not in TORCH_NAMES:
            return False
        field = SETTINGS.get(key, {})
        scale, least = field.get("torch_scale"), int(field.get("torch_min", 0))
        if scale and (value % scale or value // scale < least):  # torch reads whole MiB, from its minimum
            return False
        if key == "roundup_power2_divisions" and not _divisions_ok(value):
            return False
    return True


def _divisions_ok(value: Any) -> bool:
    """A count torch accepts for roundup_power2_divisions (a power of two),
    or one per size interval (a power of two or 0 each, as torch's
    ``[1:n,2:n,...]`` form takes them)."""
    if isinstance(value, (list, tuple)):
        return len(value) == TORCH_SIZES["roundup_intervals"] and all(_divisions_ok(v) or v == 0 for v in value)
    return isinstance(value, int) and not isinstance(value, bool) and value > 0 and not value & (value - 1)


def alloc_conf(settings: Mapping[str, Any]) -> str:
    """Replay policy keys torch accepts as torch's ``key:value,...`` setting
    ("" for its defaults), in torch's documented order."""
    parts = []
    for key, value in sorted(settings.items(), key=lambda kv: list(TORCH_NAMES).index(kv[0])):
        name = TORCH_NAMES[key]
        if key == "expandable":
            parts.append(f"{name}:True")
        elif SETTINGS.get(key, {}).get("torch_scale"):
            parts.append(f"{name}:{value // SETTINGS[key]['torch_scale']}")
        elif isinstance(value, (list, tuple)):
            # per size interval, keyed by its first size in MiB as torch reads them
            parts.append(f"{name}:[" + ",".join(f"{1 << i}:{v}" for i, v in enumerate(value)) + "]")
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
    #: these are the settings the recorded run had (trace.meta["recorded_policy"])
    recorded: bool = False
    #: the smallest device (bytes, per device) on which the run fits under
    #: these settings, with ``tune(min_capacity=True)``; None: not measured
    min_capacity: Optional[int] = None
    #: the stack frames the snapshot recorded for the first allocation
    #: these settings cannot serve (innermost first; empty without OOM or
    #: without recorded stacks)
    first_oom_frames: list[dict[str, Any]] = field(default_factory=list)

    @property
    def peak_reserved(self) -> int:
        return self.result.peak_reserved

    @property
    def fragmentation_ratio(self) -> float:
        """GMLake's fragmentation ratio: 1 - peak allocated / peak reserved
        (0: every reserved byte was allocated at the peak)."""
        r = self.result
        return 1 - r.peak_allocated / r.peak_reserved if r.peak_reserved else 0.0

    @property
    def first_oom_event(self) -> Optional[int]:
        """The index of the first trace event these settings cannot serve."""
        return self.result.first_oom_event

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
            "fragmentation_ratio": self.fragmentation_ratio,
            "backend_calls": r.backend_calls, "alloc_retries": r.alloc_retries, "ooms": r.ooms,
            "recorded": self.recorded, "min_capacity": self.min_capacity,
            "first_oom_event": r.first_oom_event, "first_oom_frames": list(self.first_oom_frames),
        }


def _show(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int) and SETTINGS.get(key, {}).get("unit", "bytes") == "bytes":
        return format_bytes(value, 0) if value % MiB == 0 else format_bytes(value)
    return str(value)


@dataclass
class TuneResult:
    """What :func:`tune` found. ``candidates`` are sorted best first (those
    that fit first, then those replayed to the end, then by peak reserved
    bytes, fewer settings and backend calls). A candidate whose replay
    stopped early (``complete`` False) reserved more than the best known
    then, and its figures cover the events up to there. Of settings that do
    not fit, those failing fewer allocations come first.

    ``recorded`` is the recorded run's own settings (those of its
    ``recorded_policy`` torch can express; torch's defaults when it names
    none), always replayed in full: the baseline the table's ratios are
    set against, and the floor of :attr:`best`."""

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
    #: the recorded run's settings, replayed (None only for results made by hand)
    recorded: Optional[Candidate] = None
    #: where :attr:`limit` came from: "", "given", "fraction 0.9 of 80.00 GiB
    #: (...)", "inferred from the recording"
    limit_source: str = ""
    #: the policy keys left out of the search (``exclude``)
    excluded: list[str] = field(default_factory=list)
    #: the torch version (major.minor) the settings are written for: the one
    #: asked for or installed (the modelled one when neither is known); it
    #: may be newer than :attr:`torch_version` when that one was not judged
    torch_target: str = ""

    @property
    def baseline(self) -> Candidate:
        """What ratios are set against: the recorded settings, else the default."""
        return self.recorded if self.recorded is not None else self.default

    @property
    def baseline_name(self) -> str:
        """``recorded`` when the trace says what its run had, else ``default``."""
        return "recorded" if self.recorded is not None else "default"
    #: the search stopped at ``deadline_s`` before it was done: the best of
    #: the settings replayed by then
    partial: bool = False

    @property
    def env_var(self) -> str:
        """The variable the torch the settings are for reads them from."""
        from .oracle import env_var

        return env_var(self.torch_target or self.torch_version)

    @property
    def pitfall(self) -> Optional[str]:
        """A known way that torch version misreads the variable, if any."""
        return _PITFALL_2_9 if (self.torch_target or self.torch_version) == "2.9" else None

    def _eligible(self, c: Candidate) -> bool:
        """Whether :attr:`best` may be ``c``: a torch setting proven for the
        modelled version (or the recorded run's own), using no excluded option."""
        return c.torch and (c.verified or c.recorded) and not set(c.settings) & set(self.excluded)

    @property
    def best(self) -> Candidate:
        """The best setting torch accepts that the fidelity matrix proved
        for the modelled torch version, or the recorded settings where
        nothing beats them (never worse than those, nor than the default)."""
        best = next(c for c in self.candidates if self._eligible(c))
        rec = self.recorded
        if rec is not None and rec is not best and self._eligible(rec) and _outcome(rec) == _outcome(best):
            return rec  # as good: nothing to change
        return best

    @property
    def best_extra(self) -> Optional[Candidate]:
        """The best setting only gpumempool's pools accept, if it beats :attr:`best`."""
        best = self.best
        for c in self.candidates:
            if not c.torch and not set(c.settings) & set(self.excluded) and _rank(c) < _rank(best):
                return c
        return None

    def top(self, n: int = 5, torch: Optional[bool] = True) -> list[Candidate]:
        """The best ``n`` distinct outcomes (torch's settings only,
        gpumempool's only, or all for ``torch=None``): of the settings that
        replay to the same figures, only the simplest is listed (the rest
        are in :attr:`candidates`). Settings using an excluded option (only
        the recorded ones can) are not listed."""
        out: list[Candidate] = []
        seen: set[tuple[Any, ...]] = set()
        for c in self.candidates:
            if (torch is not None and c.torch != torch) or not c.complete or set(c.settings) & set(self.excluded):
                continue
            r = c.result
            outcome = (r.peak_reserved, r.peak_allocated, r.backend_calls, r.alloc_retries, r.ooms)
            if outcome not in seen:
                seen.add(outcome)
                out.append(c)
                if len(out) == n:
                    break
        return out

    def rows(self, n: int = 5) -> list[tuple[str, Candidate]]:
        """The table's rows: the best ``n`` torch settings, the recorded
        settings and the default where they are not among them, and the
        best of the extra settings, each with its tag."""
        top, best = self.top(n), self.best
        if best not in top:  # the recorded settings, listed in place of a simpler one as good
            same = [i for i, c in enumerate(top) if _outcome(c) == _outcome(best)]
            if same:
                top[same[0]] = best
            else:
                top = ([best] + top)[:n]
        out = [(str(i) + (" (recorded)" if c.recorded else ""), c) for i, c in enumerate(top, 1)]
        if self.recorded is not None and self.recorded not in top:
            out.append(("recorded", self.recorded))
        if self.default not in top and self.default is not self.recorded:
            out.append(("default", self.default))
        extra = self.best_extra
        if extra is not None:
            out.append(("gmp only", extra))
        return out

    def table(self, n: int = 5) -> str:
        """The best ``n`` torch settings, the recorded settings, the default
        and the best of the extra settings, as a text table."""
        with_min = any(c.min_capacity is not None for _, c in self.rows(n))
        header: tuple[str, ...] = ("#", "settings", "peak reserved", f"vs {self.baseline_name}", "frag ratio",
                                   "reserved/alloc", "backend calls", "retries", "OOMs")
        rows = [header + (("fits on",) if with_min else ())]
        base = self.baseline.peak_reserved or 1

        def row(tag: str, c: Candidate) -> tuple[str, ...]:
            r = c.result
            out: tuple[str, ...] = (tag, c.describe(), format_bytes(r.peak_reserved), f"{r.peak_reserved / base:.3f}",
                   f"{c.fragmentation_ratio:.3f}", f"{r.fragmentation:.3f}", f"{r.backend_calls:,}",
                   f"{r.alloc_retries:,}", f"{r.ooms:,}" + ("" if c.fits else " (does not fit)"))
            if with_min:
                out += (format_bytes(c.min_capacity) if c.min_capacity is not None else "-",)
            return out

        for tag, c in self.rows(n):
            rows.append(row(tag, c))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [" | ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths)))
                 for r in rows]
        lines.insert(1, "-+-".join("-" * w for w in widths))
        return "\n".join(lines)

    def as_dict(self, n: int = 10) -> dict[str, Any]:
        best, extra, base = self.best, self.best_extra, self.baseline
        return {
            "source": self.source, "events": self.events, "lower_bound": self.lower_bound, "limit": self.limit,
            "limit_source": self.limit_source, "excluded": list(self.excluded),
            "recorded_by": self.recorded_by, "recorded_peak_reserved": self.recorded_peak_reserved,
            "best": best.as_dict(), "default": self.default.as_dict(),
            "recorded": self.recorded.as_dict() if self.recorded is not None else None,
            "baseline": self.baseline_name, "best_is_recorded": best.recorded,
            "best_extra": extra.as_dict() if extra is not None else None,
            "saving": 1 - best.peak_reserved / self.default.peak_reserved if self.default.peak_reserved else 0.0,
            "saving_vs_baseline": 1 - best.peak_reserved / base.peak_reserved if base.peak_reserved else 0.0,
            "candidates": [c.as_dict() for c in self.candidates[:n]],
            "replays": self.replays, "seconds": self.seconds, "notes": list(self.notes),
            "torch_version": self.torch_version, "torch_target": self.torch_target, "env_var": self.env_var,
            "pitfall": self.pitfall, "partial": self.partial,
        }


def _outcome(c: Candidate) -> tuple[Any, ...]:
    """What ranks ``c`` apart from how simple its settings are."""
    return (c.complete, c.fits, c.result.ooms, c.result.peak_reserved)


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
    # per-interval divisions as a tuple: settings are keys of the replays done
    out = {k: tuple(v) if isinstance(v, list) else v for k, v in settings.items() if v is not None and v is not False}
    if "max_non_split_rounding_size" in out and "max_split_size" not in out:
        del out["max_non_split_rounding_size"]
    return out


# ---- replays, in this process or in worker processes ----


def _replay_settings(trace: Union[Trace, TraceFile], settings: Mapping[str, Any], limit: Optional[int],
                     capacity: Optional[int], stop_above: Optional[int] = None,
                     torch_version: Optional[str] = None) -> ReplayResult:
    policy = dict(settings)
    # The limit is torch's memory fraction (allowed_memory_maximum). Torch
    # collects garbage only under one (its malloc checks set_fraction), so
    # a threshold without --limit does nothing, there as here (replay warns).
    if limit:
        if "capacity" in policy:
            # a probe of tune(min_capacity=True) is a device of that size: the limit stays within it
            policy["limit"] = min(limit, policy["capacity"])
        else:
            # A device that has the limit, whatever the recording had: --limit
            # asks about another size (a larger card than the one it ran out on).
            policy["limit"] = limit
            policy["capacity"] = max(limit, capacity or 0)
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
               proven: Optional[frozenset[str]] = None, recorded: Optional[Mapping[str, Any]] = None) -> Candidate:
    s = _clean(settings)
    return Candidate(s, result, _torch_expressible(s), limit, proven is None or set(s) <= proven,
                     recorded=recorded is not None and _key(s) == _key(_clean(recorded)))


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


def _excluded_keys(exclude: Union[str, Iterable[str], None]) -> list[str]:
    """The policy keys of ``exclude`` (torch's option names or policy keys;
    a string may list several, comma-separated)."""
    if exclude is None:
        return []
    names = [exclude] if isinstance(exclude, str) else list(exclude)
    keys: list[str] = []
    for item in names:
        if not isinstance(item, str):
            raise InvalidArgumentError(f"exclude takes option names, got {item!r}")
        for name in (n.strip() for n in item.split(",")):
            if not name:
                continue
            if name not in OPTION_NAMES:
                raise InvalidArgumentError(f"exclude: unknown option {name!r}; valid: {', '.join(OPTION_NAMES)}")
            keys.append(OPTION_NAMES[name])
    return list(dict.fromkeys(keys))


def _recorded_capacity(meta: Mapping[str, Any]) -> Optional[int]:
    """The device size the recording ran on, where the trace says it
    (``recorded_conditions.capacity``, inferred from the snapshot)."""
    cond = meta.get("recorded_conditions")
    cap = cond.get("capacity") if isinstance(cond, Mapping) else None
    return cap if isinstance(cap, int) and not isinstance(cap, bool) and cap > 0 else None


def tune(
    trace: Union[Trace, TraceFile, PathLike],
    *,
    limit: Union[int, float, None] = None,
    extra: bool = True,
    jobs: Optional[int] = None,
    progress: Optional[ProgressFn] = None,
    torch_version: Optional[str] = None,
    exclude: Union[str, Iterable[str], None] = None,
    min_capacity: bool = False,
    min_capacity_rows: int = 3,
    deadline_s: Optional[float] = None,
) -> TuneResult:
    """Search the allocator settings for the lowest peak reserved bytes of
    ``trace`` (a :class:`~gpumempool.trace.Trace`, a
    :class:`~gpumempool.trace.TraceFile`, or the path of a gmptrace file or
    of a torch snapshot pickle with history).

    The recorded run's own settings (``trace.meta["recorded_policy"]``,
    from a torch snapshot's ``allocator_settings``; torch's defaults where
    it names none) are always replayed: they are :attr:`TuneResult.recorded`,
    the baseline of the table, and the best is never worse than them.

    ``limit`` (bytes) replays every candidate with that much memory, as
    ``torch.cuda.set_per_process_memory_fraction`` would give torch:
    settings that cannot serve the run within it are marked (``fits`` is
    False) and ranked last. A float in (0, 1] is a fraction of the device:
    the trace's ``capacity``, else the recorded one
    (``meta["recorded_conditions"]["capacity"]``), else the replay's default
    80 GiB. Without ``limit``, a recorded capacity is the limit.
    ``exclude`` (names of torch's options, such as ``expandable_segments``,
    or policy keys; a string may list several, comma-separated) leaves
    options out of the search, for programs that cannot use them (CUDA IPC,
    NIXL and vLLM's sleep mode with expandable segments).
    ``extra`` also tries settings only gpumempool's pools accept. ``jobs``
    worker processes replay in parallel (default: the machine's cores, at
    most 8; 1 replays in this process). ``progress(done, total)`` follows
    the replays. ``torch_version`` (major.minor) is the torch whose
    allocator the result is for (default: the installed torch's, else the
    newest the fidelity matrix judged): the replays follow its rules
    (``MemPool(torch_version=...)``), and only settings the matrix proved
    exact for it are recommended (:attr:`Candidate.verified`).
    ``min_capacity`` finds, by bisection to 2 MiB or 1 %, the smallest
    device the run fits on (:attr:`Candidate.min_capacity`) for the best
    ``min_capacity_rows`` settings, the recorded ones and the default
    (a row whose bisection the deadline cut short has none).
    ``deadline_s`` bounds the search: once that many seconds have passed,
    the replays under way are stopped (in worker processes; with ``jobs=1``
    the one replay under way finishes) and the best setting replayed by
    then is returned, with :attr:`TuneResult.partial` set; TimeoutError
    when not even torch's defaults were replayed by then.

    Raises ValueError (:class:`~gpumempool.trace.TraceFormatError` for a bad
    file) for a trace without events, and
    :class:`~gpumempool.InvalidArgumentError` for a limit below the trace's
    lower bound on a device (the peak of the bytes it holds at once there:
    the limit holds for each device) or an unknown option to exclude."""
    start = time.perf_counter()
    from .oracle.proven import MODELLED, installed_torch_version, minor_version, modelled_version, proven_settings

    if torch_version is not None and not re.match(r"^\d+\.\d+(\.|\+|$)", str(torch_version)):
        raise InvalidArgumentError(f"torch_version must be MAJOR.MINOR (e.g. 2.15), got {torch_version!r}")
    target = torch_version or installed_torch_version()
    modelled = modelled_version(target)
    proven = proven_settings(modelled) if modelled in MODELLED else None
    fraction: Optional[float] = None
    if isinstance(limit, float):
        if not 0 < limit <= 1:
            raise InvalidArgumentError(f"limit as a fraction of the device must be in (0, 1], got {limit!r}")
        fraction = limit
    elif limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0):
        raise InvalidArgumentError(f"limit must be a positive number of bytes or a fraction, got {limit!r}")
    excluded = _excluded_keys(exclude)
    if isinstance(min_capacity_rows, bool) or not isinstance(min_capacity_rows, int) or min_capacity_rows < 0:
        raise InvalidArgumentError(f"min_capacity_rows must be an int >= 0, got {min_capacity_rows!r}")
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
    notes: list[str] = []
    capacity = tr.meta.get("capacity") if isinstance(tr.meta.get("capacity"), int) else None
    recorded_capacity = _recorded_capacity(tr.meta)
    limit_bytes = limit if isinstance(limit, int) else None
    limit_source = "given" if limit is not None else ""
    if fraction is not None:
        device, whose = ((capacity, "the trace's device") if capacity else
                         (recorded_capacity, "the recorded device") if recorded_capacity else
                         (DEFAULT_CAPACITY, "the replay's default device: the trace records none"))
        from .oracle.fidelity import fraction_limit

        # torch's own rule for the modelled version (truncated, or rounded from 2.15)
        limit_bytes = fraction_limit(device, fraction, modelled or None) or device
        limit_source = f"fraction {fraction:g} of {format_bytes(device)} ({whose})"
    if tr.meta.get("start_segments"):
        notes.append(f"the run started mid-run: settings without expandable segments start from the "
                     f"{len(tr.meta['start_segments']):,} segments torch held at the first event, expandable ones "
                     "from an empty device (torch's layout has no counterpart there)")
    # The limit holds for each device (replay's, as torch's memory fraction):
    # below the total, it may still be above what each device holds.
    device_lower = _device_peak_requested(tr)
    if limit_bytes is None and recorded_capacity is not None:
        if recorded_capacity >= device_lower:
            limit_bytes, limit_source = recorded_capacity, "inferred from the recording"
        else:
            # The request torch could not serve is in the trace (replay asks
            # for it again): no setting serves it on the device the run had.
            notes.append(f"the run holds {format_bytes(device_lower)} at once on one device (counting the request "
                         f"torch could not serve), more than the {format_bytes(recorded_capacity)} it had there "
                         "(inferred from the recording): no setting fits that device; settings are ranked by "
                         "their peak on it")
    if limit_bytes is not None and limit_bytes < device_lower:
        how = f" ({limit_source})" if limit_source != "given" else ""
        raise InvalidArgumentError(
            f"limit {format_bytes(limit_bytes)}{how} is below the trace's lower bound {format_bytes(device_lower)} "
            "on one device (the most bytes the program holds allocated at once on a device; the limit applies to each): "
            "no setting can run it in that much memory")
    if proven is None:
        notes.append(f"torch {modelled or '(none installed)'} was not judged by the fidelity matrix: every "
                     "setting is shown as the engine predicts it, none verified against torch")
    policy = tr.meta.get("recorded_policy")
    recorded_settings: dict[str, Any] = {}
    if isinstance(policy, dict):
        recorded_settings = _clean({k: v for k, v in policy.items() if k in TORCH_NAMES})
        if not _torch_expressible(recorded_settings):
            notes.append(f"the recorded settings {recorded_settings} are not torch's to say: 'recorded' below is "
                         "torch's defaults")
            recorded_settings = {}
        odd = {k: v for k, v in policy.items() if k not in TORCH_NAMES and k not in ("backend", "capacity")}
        if odd:
            notes.append("the recording used settings torch has no equivalent for ("
                         + ", ".join(f"{k}={v}" for k, v in odd.items()) + "): 'recorded' below is "
                         + ("its torch settings without them" if recorded_settings else "torch's defaults"))
    # the baseline is "recorded" where the trace comes from a recording (a
    # torch snapshot names its settings, or says nothing of torch's defaults)
    recorded: Optional[dict[str, Any]] = recorded_settings if isinstance(policy, dict) or tr.recorded_by else None
    if set(recorded_settings) & set(excluded):
        notes.append("the recorded settings use an excluded option: they are the baseline, not a recommendation")
    if deadline_s is not None and (isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float))
                                   or not deadline_s > 0):
        raise InvalidArgumentError(f"deadline_s must be a positive number of seconds, got {deadline_s!r}")
    deadline = None if deadline_s is None else start + deadline_s
    if jobs is None:
        jobs = min(os.cpu_count() or 1, 8)
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise InvalidArgumentError(f"jobs must be a positive int, got {jobs!r}")

    def allowed(settings: Mapping[str, Any]) -> bool:
        return not set(_clean(settings)) & set(excluded)

    with tempfile.TemporaryDirectory(prefix="gmp-tune-") as tmp:
        if jobs > 1 and path is None:
            # a Trace in memory (from a snapshot): the workers read it from a file
            path = os.path.join(tmp, "trace.gz")
            assert isinstance(tr, Trace)
            tr.save(path)
        runner = _Runner(tr, path, jobs, limit_bytes, capacity, progress, modelled or None, deadline)
        probes: dict[tuple[tuple[str, Any], ...], int] = {}
        try:
            space = {k: v for k, v in TORCH_SPACE.items() if k not in excluded}
            if limit_bytes is None and "garbage_collection_threshold" in space:
                space["garbage_collection_threshold"] = [None]
            coarse = {k: v for k, v in _COARSE.items() if k not in excluded}
            # The default, the recorded settings and the usual winner first,
            # in full: from then on a replay stops once it reserves more than
            # the best so far.
            first = [{}, recorded_settings] + ([{"expandable": True}] if allowed({"expandable": True}) else [])
            runner.run(first, expect=20)
            if _key({}) not in runner.done:
                raise TimeoutError(f"tune: {source}: not even torch's defaults were replayed in {deadline_s} s "
                                   "(deadline_s)")
            best = _best_of(runner, limit_bytes, proven, recorded, excluded)
            grid: list[dict[str, Any]] = [{}]
            for key, values in coarse.items():
                grid = [dict(g, **{key: v}) for g in grid for v in values]
            if limit_bytes is not None and "garbage_collection_threshold" not in excluded:
                grid += [dict(g, garbage_collection_threshold=0.8) for g in grid]
            runner.run(grid, expect=12, stop_above=_stop(best))
            best = _best_of(runner, limit_bytes, proven, recorded, excluded)
            # one setting at a time around the best, until nothing helps
            for _ in range(4):
                before = _key(best.settings)
                for key, values in space.items():
                    tries = [dict(best.settings, **{key: v}) for v in values]
                    runner.run([t for t in tries if allowed(t)], stop_above=_stop(best))
                    best = _best_of(runner, limit_bytes, proven, recorded, excluded)
                if _key(best.settings) == before:
                    break
            if extra:
                tries = [dict(best.settings, **{key: v}) for key, values in EXTRA_SPACE.items() if key not in excluded
                         for v in values]
                runner.run([t for t in tries if allowed(t)], stop_above=_stop(best))
            cands = sorted((_candidate(dict(k), r, limit_bytes, proven, recorded) for k, r in runner.done.items()),
                           key=_rank)
            replays = len(runner.done)
            result = TuneResult(
                source=source, events=len(tr), lower_bound=lower, limit=limit_bytes,
                default=next(c for c in cands if not c.settings), candidates=cands,
                recorded_peak_reserved=cands[0].result.recorded_peak_reserved,
                recorded_by=cands[0].result.recorded_by, replays=replays, notes=notes, torch_version=modelled,
                recorded=next((c for c in cands if c.recorded), None), limit_source=limit_source, excluded=excluded,
                torch_target=minor_version(target) if target else modelled)
            if min_capacity and not runner.out_of_time:  # probes after the deadline would not run
                rows = [c for _, c in result.rows(min_capacity_rows) if c.torch]
                for c in [result.recorded, result.default]:
                    if c is not None and c not in rows:
                        rows.append(c)
                probes = _min_capacities(runner, rows, device_lower)
        except BaseException:
            runner.close(kill=True)
            raise
        finally:
            runner.close()

    result.replays = replays + len(probes)
    result.partial = runner.out_of_time
    if isinstance(tr, Trace):
        failing = [c for c in cands if c.first_oom_event is not None and c.complete]
        stacks = tr.frames({c.first_oom_event for c in failing if c.first_oom_event is not None})
        for c in failing:
            c.first_oom_frames = stacks.get(c.first_oom_event, []) if c.first_oom_event is not None else []
    result.seconds = time.perf_counter() - start
    return result


#: Precision of tune(min_capacity=True): 2 MiB, or 1 % of the capacity.
_MIN_CAPACITY_STEP = 2 * MiB
_MIN_CAPACITY_PART = 0.01


def _min_capacities(runner: _Runner, rows: list[Candidate], lower: int) -> dict[tuple[tuple[str, Any], ...], int]:
    """Set each row's :attr:`Candidate.min_capacity`: the smallest device
    (per device, a multiple of 2 MiB) on which its settings serve every
    allocation, by bisection between the bytes the run holds at once on a
    device (nothing fits below) and a size where it fits, all rows a step
    at a time (the steps of the rows run in parallel). Returns the probes
    replayed, by their settings."""
    probes: dict[tuple[tuple[str, Any], ...], int] = {}

    class OutOfTime(Exception):
        """The deadline passed before these probes were replayed."""

    def fits(pairs: list[tuple[Candidate, int]]) -> list[bool]:
        jobs = [dict(c.settings, capacity=cap) for c, cap in pairs]
        runner.run(jobs)
        if runner.out_of_time:  # some were not replayed: the bisection stops here
            for job in jobs:
                runner.done.pop(_key(_clean(job)), None)
            raise OutOfTime
        out = []
        for job in jobs:
            k = _key(_clean(job))
            probes[k] = job["capacity"]
            out.append(runner.done.pop(k).ooms == 0)
        return out

    try:
        _bisect(rows, lower, fits)
    except OutOfTime:
        # rows whose bisection did not end have no measure (the bounds so far are not one)
        pass
    return probes


def _bisect(rows: list[Candidate], lower: int, fits: Callable[[list[tuple[Candidate, int]]], list[bool]]) -> None:
    """The bisection of :func:`_min_capacities`: each row's min_capacity
    is set once its bisection ends."""

    def up(n: int) -> int:
        return -(-n // _MIN_CAPACITY_STEP) * _MIN_CAPACITY_STEP

    # (low: does not fit, high: fits) per row
    bounds = {id(c): [up(lower) - _MIN_CAPACITY_STEP, up(max(lower, c.peak_reserved))] for c in rows}
    todo = list(rows)
    # a high bound that fits: the peak the settings reserved (doubled until it fits)
    while todo:
        ok = fits([(c, bounds[id(c)][1]) for c in todo])
        nxt = []
        for c, good in zip(todo, ok):
            if good:
                continue
            bounds[id(c)][0] = bounds[id(c)][1]
            if bounds[id(c)][1] >= 1 << 50:
                bounds[id(c)][1] = -1  # never fits (an allocation larger than any device)
                continue
            bounds[id(c)][1] *= 2
            nxt.append(c)
        todo = nxt
    todo = [c for c in rows if bounds[id(c)][1] > 0]

    def done(c: Candidate) -> bool:
        lo, hi = bounds[id(c)]
        return hi - lo <= max(_MIN_CAPACITY_STEP, int(hi * _MIN_CAPACITY_PART))

    def finish(c: Candidate) -> None:
        hi = bounds[id(c)][1]
        c.min_capacity = hi if hi > 0 else None

    for c in todo:
        if done(c):
            finish(c)
    todo = [c for c in todo if not done(c)]
    while todo:
        mids = [up((bounds[id(c)][0] + bounds[id(c)][1]) // 2) for c in todo]
        for c, mid, good in zip(todo, mids, fits(list(zip(todo, mids)))):
            bounds[id(c)][1 if good else 0] = mid
            if done(c):
                finish(c)
        todo = [c for c in todo if not done(c)]
    for c in rows:
        finish(c)


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


def _best_of(runner: _Runner, limit: Optional[int], proven: Optional[frozenset[str]] = None,
             recorded: Optional[Mapping[str, Any]] = None, excluded: Iterable[str] = ()) -> Candidate:
    """The best verified torch setting (or the recorded ones) replayed so
    far, using no excluded option."""
    cands = [_candidate(dict(k), r, limit, proven, recorded) for k, r in runner.done.items()]
    return min((c for c in cands if c.torch and (c.verified or c.recorded) and not set(c.settings) & set(excluded)),
               key=_rank)


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
