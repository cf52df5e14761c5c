"""A snapshot of a rank at the moment it runs out of memory
(:func:`gpumempool.distributed.snapshot_on_oom`).

Out of memory happens on one rank, not on all of them together, so nothing
here is a collective: the rank that fails writes its own file. Three
triggers, because an out-of-memory error reaches the user by three paths:

- a pool call of gpumempool raises :class:`~gpumempool.OutOfMemoryError`
  (``pool.alloc``, CuPy through a pool, IPC imports): told by
  ``_errors.on_out_of_memory``, before the error is raised, caught or not;
- torch's caching allocator fails (torch's own pools, and a gpumempool pool
  routed with ``gmp.mempool``): torch calls its out-of-memory observers
  after releasing its lock, caught or not. Torch cannot forget an
  observer, so one observer per process forwards to the active snapshotter;
- any other out-of-memory error that ends the process or a thread, such
  as torch's under full replacement (``gmp.set_torch_allocator``), where
  torch has no observers: ``sys.excepthook`` and ``threading.excepthook``.

An error seen by the first two is not written again by the third.

Where history was recorded, the out-of-memory doctor (:mod:`._oom_doctor`)
then tunes it under the memory the run failed in and prints one line: which
setting would have fit.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import warnings
from types import TracebackType
from typing import Any, Callable, Optional

from . import _errors, _native
from ._errors import OutOfMemoryError

__all__ = ["OomSnapshots", "snapshot_on_oom"]

#: The attribute set on a gpumempool OutOfMemoryError that was seen: the
#: path of its snapshot, or None when none was written (the limit was reached).
SNAPSHOT_ATTR = "gmp_oom_snapshot"

_lock = threading.Lock()
_active: Optional["OomSnapshots"] = None
#: Whether torch's out-of-memory observer is attached in this process (once:
#: torch has no way to detach one).
_torch_observer = False


def _new_locks_after_fork() -> None:
    """In a forked child: new locks, as another thread may have held them
    at the fork (a snapshotter made or closed in the child takes both)."""
    global _lock
    _lock = threading.Lock()
    _errors.renew_oom_lock()


_native.after_fork_in_child(_new_locks_after_fork)


class OomSnapshots:
    """The snapshots written by :func:`snapshot_on_oom` (use it as a context
    manager, or call :meth:`close`, to stop)."""

    def __init__(self, directory: str, max_snapshots: int, doctor_time_limit_s: Optional[float] = None,
                 doctor_hint: bool = False) -> None:
        self.directory = directory
        self.max_snapshots = max_snapshots
        #: Seconds the out-of-memory doctor may tune each snapshot's history
        #: for (None: no doctor).
        self.doctor_time_limit_s = doctor_time_limit_s
        #: Whether the doctor says so when no history was recorded
        #: (``gmp.torch.oom_doctor``; ``snapshot_on_oom`` says nothing then).
        self.doctor_hint = doctor_hint
        #: What the doctor found, one per snapshot it looked at
        #: (:class:`gpumempool._oom_doctor.Diagnosis`).
        self.diagnoses: list[Any] = []
        #: The files written so far, in order (torch's own snapshot files,
        #: ``...-torch.pickle``, are listed after the one they go with).
        self.written: list[str] = []
        self.torch_observer = False
        self._count = 0
        self._closed = False
        self._write_lock = threading.Lock()
        self._unsubscribe: Callable[[], None] = lambda: None
        # Hooks of this snapshotter's own, chained to the ones they replaced:
        # user code may wrap them (and a later call wrap that), so each
        # goes on to its own predecessor, and after close only does that.
        prev_sys: Any = sys.excepthook  # None where user code set it so
        prev_thread: Any = threading.excepthook

        def excepthook(exc_type: type[BaseException], exc: BaseException, tb: Optional[TracebackType]) -> None:
            try:
                self._uncaught(exc)
            finally:
                (prev_sys or sys.__excepthook__)(exc_type, exc, tb)

        def thread_excepthook(args: Any) -> None:
            try:
                self._uncaught(args.exc_value)
            finally:
                (prev_thread or threading.__excepthook__)(args)

        self._prev_hooks: tuple[Any, Any] = (prev_sys, prev_thread)
        self._sys_hook = excepthook
        self._thread_hook = thread_excepthook

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop writing snapshots and put back the exception hooks (where
        nobody replaced them since)."""
        with _lock:
            self._close_locked()

    def _close_locked(self) -> None:
        global _active
        if self._closed:
            return
        self._closed = True
        if _active is self:
            _active = None
        self._unsubscribe()
        prev_sys, prev_thread = self._prev_hooks
        if sys.excepthook is self._sys_hook:
            sys.excepthook = prev_sys
        if threading.excepthook is self._thread_hook:
            threading.excepthook = prev_thread

    def __enter__(self) -> "OomSnapshots":
        return self

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        try:
            if exc is not None and _is_oom(exc) and not self._seen(exc):
                self.write("uncaught (leaving the with block)", str(exc))
        finally:
            self.close()

    def _seen(self, exc: Optional[BaseException]) -> bool:
        """Whether a snapshot trigger already saw this error (or its cause): a
        gpumempool error it was told of, or torch's while its observer works."""
        torch = sys.modules.get("torch")
        torch_oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
        for _ in range(16):
            if exc is None:
                return False
            if hasattr(exc, SNAPSHOT_ATTR):
                return True
            if torch_oom is not None and isinstance(exc, torch_oom) and self.torch_observer \
                    and not _torch_replaced():
                return True
            exc = exc.__cause__ or exc.__context__
        return False

    def _uncaught(self, exc: Optional[BaseException]) -> None:
        if not self._closed and _is_oom(exc) and not self._seen(exc):
            self.write("uncaught", f"{type(exc).__name__}: {exc}", torch_native=True)

    def write(self, trigger: str, message: str, torch_native: bool = False,
              capacity: Optional[int] = None) -> Optional[str]:
        """Write this rank's snapshot now, as if it had run out of memory
        (``trigger`` and ``message`` are recorded in it, under ``"oom"``);
        returns the path, or None once ``max_snapshots`` are written or when
        closed. A failure is a warning, never an exception (not even with
        warnings turned into errors): this runs while an out-of-memory error
        is on its way to the caller, inside torch's allocator too.
        ``capacity``: the memory (bytes) the run failed in, where the caller
        knows it, for the doctor (else it is read from the snapshot).

        In a forked child nothing is written: no pool can be read there, and
        the child is not the rank whose file name it would take."""
        if _native.forked():
            return None
        # The number is taken under the lock, the snapshot outside it: the
        # snapshot waits for every pool's lock, and the engine holds one
        # while a Python allocator function runs, which can itself run out
        # of memory in another pool and come here.
        with self._write_lock:
            if self._closed or self._count >= self.max_snapshots:
                return None
            self._count += 1
            number = self._count
        rank = _rank()
        stem = os.path.join(self.directory, f"rank{rank:05d}-oom{number}")
        try:
            from ._snapshot import dump_snapshot, snapshot

            not_read: list[str] = []  # the pools this thread is inside of
            snap = snapshot(not_read)
            snap["rank"], snap["host"], snap["pid"] = rank, socket.gethostname(), os.getpid()
            snap["oom"] = {"trigger": trigger, "message": message, "time": time.time(), "pools_not_read": not_read}
            dump_snapshot(stem + ".pickle", snap)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            _warn(f"gpumempool: rank {rank} ran out of memory, but its snapshot could not be "
                  f"written to {stem}.pickle: {type(exc).__name__}: {exc}")
            return None
        native = torch_native and _dump_torch_native(stem + "-torch.pickle")
        with self._write_lock:
            self.written.append(stem + ".pickle")
            if native:
                self.written.append(stem + "-torch.pickle")
        extra = f" (torch's own allocator: {stem}-torch.pickle)" if native else ""
        _warn(f"gpumempool: rank {rank} ran out of memory ({trigger}); its snapshot is in {stem}.pickle{extra}")
        if self.doctor_time_limit_s is not None:
            self._doctor(stem + ("-torch.pickle" if native else ".pickle"), capacity)
        return stem + ".pickle"

    def _doctor(self, path: str, capacity: Optional[int]) -> None:
        """Tune the history of the snapshot at ``path`` and say which setting
        would have fit (never raises: see write())."""
        try:
            from ._oom_doctor import diagnose

            assert self.doctor_time_limit_s is not None
            diag = diagnose(path, capacity=capacity, time_limit_s=self.doctor_time_limit_s, quiet=True)
            with self._write_lock:
                self.diagnoses.append(diag)
            if diag.error != "no history" or self.doctor_hint:
                sys.stderr.write(diag.line + "\n")
                sys.stderr.flush()
        except BaseException as exc:  # noqa: BLE001 - the out-of-memory error on its way matters more
            _warn(f"gpumempool: the out-of-memory doctor failed: {type(exc).__name__}: {exc}")


def snapshot_on_oom(directory: Any, *, max_snapshots: int = 1,
                    doctor_time_limit_s: Optional[float] = 30.0) -> OomSnapshots:
    """Write a snapshot of this rank when it runs out of memory, to
    ``directory/rankNNNNN-oomK.pickle`` (every open gpumempool pool, in the
    format of :func:`gpumempool.dump_snapshot`, with ``"oom"``, ``"rank"``,
    ``"host"`` and ``"pid"`` added), at most ``max_snapshots`` times in
    this process. Where torch's own CUDA allocator is in use, its snapshot
    goes beside it as ``rankNNNNN-oomK-torch.pickle`` (for
    pytorch.org/memory_viz). Files of an earlier run in ``directory`` are
    overwritten.

    Every rank calls it for itself; it is not a collective, and works
    without ``torch.distributed`` too (rank 0, or ``$RANK``). Call it after
    ``import torch`` so that torch's out-of-memory observer can be attached.
    A new call replaces the previous one. The directory is made now, so a
    path that cannot be used fails here (``OSError``), not at the moment
    of the failure.

    Where allocator history was recorded (torch's
    ``torch.cuda.memory._record_memory_history()``, or
    :func:`gpumempool.record_history` for pools), the out-of-memory doctor
    then replays it under each allocator setting, for at most
    ``doctor_time_limit_s`` seconds (None: no doctor), in the memory the
    run failed in, prints one line to stderr (which setting would have fit,
    and its peak) and writes the full answer beside the snapshot
    (``...-tune.json``, ``...-tune.txt``); see :func:`gpumempool.torch.oom_doctor`."""
    snapper, _ = install(directory, max_snapshots, doctor_time_limit_s, doctor_hint=False)
    return snapper


def install(directory: Any, max_snapshots: int, doctor_time_limit_s: Optional[float], *, doctor_hint: bool,
            keep_same: bool = False, on_close: Optional[Callable[[], None]] = None) -> tuple[OomSnapshots, bool]:
    """Install a snapshotter (:func:`snapshot_on_oom`, ``gmp.torch.oom_doctor``)
    in place of the active one, and whether it is new: with ``keep_same``,
    an active one with the same settings is kept. ``on_close`` runs when the
    new one is closed."""
    global _active, _torch_observer
    if isinstance(max_snapshots, bool) or not isinstance(max_snapshots, int) or max_snapshots < 1:
        raise ValueError(f"max_snapshots must be a positive int, not {max_snapshots!r}")
    if doctor_time_limit_s is not None and (isinstance(doctor_time_limit_s, bool)
                                            or not isinstance(doctor_time_limit_s, (int, float))
                                            or not doctor_time_limit_s > 0):
        raise ValueError(f"the doctor's time limit must be a positive number of seconds or None, "
                         f"not {doctor_time_limit_s!r}")
    path = os.fspath(directory)
    os.makedirs(path, exist_ok=True)
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"snapshot_on_oom: cannot write in {path}")
    with _lock:  # one lock throughout: two threads calling at once each close the other's in turn
        if keep_same and _active is not None and _active.directory == os.path.abspath(path) and \
                _active.max_snapshots == max_snapshots and _active.doctor_time_limit_s == doctor_time_limit_s and \
                _active.doctor_hint == doctor_hint:
            return _active, False
        if _active is not None:
            _active._close_locked()
        if not _torch_observer:
            _torch_observer = _attach_torch_observer()
        snapper = OomSnapshots(os.path.abspath(path), max_snapshots, doctor_time_limit_s,
                               doctor_hint)  # takes the hooks it replaces
        snapper.torch_observer = _torch_observer
        unsubscribe = _errors.on_out_of_memory(_on_pool_oom)

        def stop() -> None:
            unsubscribe()
            if on_close is not None:
                on_close()

        snapper._unsubscribe = stop
        sys.excepthook = snapper._sys_hook
        threading.excepthook = snapper._thread_hook
        _active = snapper
    return snapper, True


def _warn(message: str) -> None:
    """A RuntimeWarning that never raises: where warnings are errors, the
    message goes to stderr instead."""
    try:
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    except Exception:  # noqa: BLE001 - see write()
        try:
            sys.stderr.write(message + "\n")
        except Exception:  # noqa: BLE001,S110 - no stderr: nothing more to do
            pass


def _rank() -> int:
    """This process's rank: torch.distributed's when it is initialized, else
    ``$RANK``, else 0 (torch is not imported for it)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # noqa: BLE001,S110 - a rank number is all that is wanted
        pass
    try:
        return max(0, int(os.environ.get("RANK", "0")))
    except ValueError:
        return 0


def _torch_replaced() -> bool:
    """Whether gpumempool replaced torch's CUDA allocator (it did not when
    gpumempool.torch was never imported), which leaves torch without
    out-of-memory observers or snapshots of its own."""
    mod = sys.modules.get("gpumempool.torch")
    return mod is not None and mod.torch_allocator_pool() is not None


def _attach_torch_observer() -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        if not torch.cuda.is_available():
            return False
        torch._C._cuda_attach_out_of_memory_observer(_torch_oom_observer)
    except Exception:  # noqa: BLE001 - e.g. a pluggable allocator, which has no observers
        return False
    return True


def _torch_oom_observer(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
    """torch's out-of-memory observer, called with torch's lock released."""
    snapper = _active
    if snapper is not None:
        snapper.write("torch's CUDA caching allocator",
                      f"tried to allocate {alloc} bytes on device {device} "
                      f"({device_allocated} allocated, {device_free} free on the device)", torch_native=True,
                      capacity=_torch_capacity(device, device_free) if snapper.doctor_time_limit_s else None)


def _torch_capacity(device: int, device_free: int) -> Optional[int]:
    """The memory torch's allocator had on ``device`` when it failed: what it
    had reserved (its cache released, as it does before failing) plus the
    device's free bytes, within its memory fraction where one is set."""
    torch = sys.modules.get("torch")
    try:
        assert torch is not None
        have = int(torch.cuda.memory_reserved(device)) + int(device_free)
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if fraction is not None and float(fraction(device)) < 1.0:
            total = int(torch.cuda.get_device_properties(device).total_memory)
            have = min(have, int(total * float(fraction(device))))
        return have
    except Exception:  # noqa: BLE001 - the doctor then reads it from the snapshot
        return None


def _pool_capacity(err: OutOfMemoryError) -> Optional[int]:
    """The memory the pool that raised ``err`` may use on a device: its limit
    or its backend's capacity (the smaller), where it names one."""
    from . import _lifecycle

    if err.pool is None:  # not the engine's error: no pool named
        return None
    for p in _lifecycle.open_pools():
        try:
            cfg = p.config()
        except Exception:  # noqa: BLE001 - closed meanwhile
            continue
        if cfg.get("name") != err.pool:
            continue
        caps = [c for c in (cfg.get("limit"), (cfg.get("backend_options") or {}).get("capacity"))
                if isinstance(c, int) and c > 0]
        return min(caps) if caps else None
    return None


def _on_pool_oom(err: OutOfMemoryError) -> None:
    snapper = _active
    path = None
    if snapper is not None:
        cap = _pool_capacity(err) if snapper.doctor_time_limit_s else None
        path = snapper.write("a gpumempool pool call", str(err), capacity=cap)
    setattr(err, SNAPSHOT_ATTR, path)


def _is_oom(exc: Optional[BaseException]) -> bool:
    """Whether exc, or an exception it was raised from, is out of memory."""
    torch = sys.modules.get("torch")
    torch_oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    for _ in range(16):
        if exc is None:
            return False
        if isinstance(exc, MemoryError) or (torch_oom is not None and isinstance(exc, torch_oom)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _dump_torch_native(path: str) -> bool:
    """Write torch's own allocator's snapshot, where torch's CUDA allocator is
    initialized and not replaced by a pool; whether it was written."""
    torch = sys.modules.get("torch")
    if torch is None or _torch_replaced():
        return False
    try:
        if not torch.cuda.is_initialized():
            return False
        torch.cuda.memory._dump_snapshot(path)
    except Exception:  # noqa: BLE001 - the pool snapshot is written; this one is extra
        return False
    return True
