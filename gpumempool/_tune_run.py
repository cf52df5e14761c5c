"""Running the candidates of :func:`gpumempool.tune.tune`: replays of a trace
under settings, in this process or in worker processes
(``python -m gpumempool._tune_worker``), and the bisection for the smallest
device each setting fits on."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import subprocess
import sys
import time
from typing import Any, Callable, Iterable, Mapping, Optional, Union

from ._errors import InvalidArgumentError
from ._tune_result import Candidate
from ._tune_space import MiB, clean_settings, settings_key, torch_expressible
from .replay import ReplayResult, replay
from .trace import PathLike, Trace, TraceFile, TraceFormatError, from_torch_snapshot, is_trace_file

__all__ = ["ProgressFn", "Runner", "candidate", "load_trace", "min_capacities", "worker_main"]

ProgressFn = Callable[[int, int], None]


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


class Runner:
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
            c = clean_settings(s)
            if settings_key(c) not in self.done:
                todo.setdefault(settings_key(c), c)
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


def candidate(settings: Mapping[str, Any], result: ReplayResult, limit: Optional[int],
               proven: Optional[frozenset[str]] = None, recorded: Optional[Mapping[str, Any]] = None) -> Candidate:
    s = clean_settings(settings)
    return Candidate(s, result, torch_expressible(s), limit, proven is None or set(s) <= proven,
                     recorded=recorded is not None and settings_key(s) == settings_key(clean_settings(recorded)))


def load_trace(trace: Union[Trace, TraceFile, PathLike]) -> tuple[Union[Trace, TraceFile], Optional[str]]:
    """The trace and a gmptrace path worker processes can load it from."""
    if isinstance(trace, (Trace, TraceFile)):
        return trace, getattr(trace, "path", None)
    path = os.fspath(trace)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    if is_trace_file(path):
        return TraceFile(path), path
    return from_torch_snapshot(path), None  # a snapshot pickle (its loader says what else is wrong)


#: Precision of tune(min_capacity=True): 2 MiB, or 1 % of the capacity.
_MIN_CAPACITY_STEP = 2 * MiB


_MIN_CAPACITY_PART = 0.01


def min_capacities(runner: Runner, rows: list[Candidate], lower: int) -> dict[tuple[tuple[str, Any], ...], int]:
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
                runner.done.pop(settings_key(clean_settings(job)), None)
            raise OutOfTime
        out = []
        for job in jobs:
            k = settings_key(clean_settings(job))
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
    """The bisection of :func:`min_capacities`: each row's min_capacity
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
