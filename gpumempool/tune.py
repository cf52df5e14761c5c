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

import inspect
import os
import re
import sys
import tempfile
import time
import types
from typing import Any, Iterable, Mapping, Optional, Union

from ._errors import InvalidArgumentError
from ._tune_result import Candidate, TuneResult, rank
from ._tune_run import ProgressFn, Runner, candidate, load_trace, min_capacities
from ._tune_space import (
    COARSE,
    EXTRA_SPACE,
    OPTION_NAMES,
    TORCH_NAMES,
    TORCH_SPACE,
    alloc_conf,
    clean_settings,
    excluded_keys,
    settings_key,
    torch_expressible,
)
from ._units import format_bytes
from .replay import DEFAULT_CAPACITY
from .trace import Alloc, Free, PathLike, Trace, TraceFile, TraceFormatError

__all__ = ["Candidate", "TuneResult", "alloc_conf", "tune", "TORCH_SPACE", "EXTRA_SPACE", "OPTION_NAMES", "TORCH_NAMES"]

#: A replay stops once it reserves this much more than the best so far.
_STOP_MARGIN = 1.25


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
    excluded = excluded_keys(exclude)
    if isinstance(min_capacity_rows, bool) or not isinstance(min_capacity_rows, int) or min_capacity_rows < 0:
        raise InvalidArgumentError(f"min_capacity_rows must be an int >= 0, got {min_capacity_rows!r}")
    tr, path = load_trace(trace)
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
        recorded_settings = clean_settings({k: v for k, v in policy.items() if k in TORCH_NAMES})
        if not torch_expressible(recorded_settings):
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
        return not set(clean_settings(settings)) & set(excluded)

    with tempfile.TemporaryDirectory(prefix="gmp-tune-") as tmp:
        if jobs > 1 and path is None:
            # a Trace in memory (from a snapshot): the workers read it from a file
            path = os.path.join(tmp, "trace.gz")
            assert isinstance(tr, Trace)
            tr.save(path)
        runner = Runner(tr, path, jobs, limit_bytes, capacity, progress, modelled or None, deadline)
        probes: dict[tuple[tuple[str, Any], ...], int] = {}
        try:
            space = {k: v for k, v in TORCH_SPACE.items() if k not in excluded}
            if limit_bytes is None and "garbage_collection_threshold" in space:
                space["garbage_collection_threshold"] = [None]
            coarse = {k: v for k, v in COARSE.items() if k not in excluded}
            # The default, the recorded settings and the usual winner first,
            # in full: from then on a replay stops once it reserves more than
            # the best so far.
            first = [{}, recorded_settings] + ([{"expandable": True}] if allowed({"expandable": True}) else [])
            runner.run(first, expect=20)
            if settings_key({}) not in runner.done:
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
                before = settings_key(best.settings)
                for key, values in space.items():
                    tries = [dict(best.settings, **{key: v}) for v in values]
                    runner.run([t for t in tries if allowed(t)], stop_above=_stop(best))
                    best = _best_of(runner, limit_bytes, proven, recorded, excluded)
                if settings_key(best.settings) == before:
                    break
            if extra:
                tries = [dict(best.settings, **{key: v}) for key, values in EXTRA_SPACE.items() if key not in excluded
                         for v in values]
                runner.run([t for t in tries if allowed(t)], stop_above=_stop(best))
            cands = sorted((candidate(dict(k), r, limit_bytes, proven, recorded) for k, r in runner.done.items()),
                           key=rank)
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
                probes = min_capacities(runner, rows, device_lower)
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


def _best_of(runner: Runner, limit: Optional[int], proven: Optional[frozenset[str]] = None,
             recorded: Optional[Mapping[str, Any]] = None, excluded: Iterable[str] = ()) -> Candidate:
    """The best verified torch setting (or the recorded ones) replayed so
    far, using no excluded option."""
    cands = [candidate(dict(k), r, limit, proven, recorded) for k, r in runner.done.items()]
    return min((c for c in cands if c.torch and (c.verified or c.recorded) and not set(c.settings) & set(excluded)),
               key=rank)


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
