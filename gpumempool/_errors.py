"""Exceptions raised by gpumempool. Each subclasses the builtin a user would
catch for it (``MemoryError``, ``ValueError``, ``RuntimeError``) and the
common base :class:`GpuMemPoolError`."""

from __future__ import annotations

import re
import threading
from typing import Callable

__all__ = [
    "BackendError",
    "CallbackReentryError",
    "DoubleFreeError",
    "ForkedProcessError",
    "GpuMemPoolError",
    "InvalidArgumentError",
    "InvalidPointerError",
    "LeakWarning",
    "OutOfMemoryError",
    "PoolClosedError",
    "expect_out_of_memory",
    "on_out_of_memory",
    "renew_oom_lock",
]


class GpuMemPoolError(Exception):
    """Base class of every gpumempool error."""


class OutOfMemoryError(GpuMemPoolError, MemoryError):
    """An allocation failed after the pool released its cache and retried.

    The message names the pool, device, requested, allocated, reserved and
    limit bytes (like torch's OutOfMemoryError)."""


class InvalidArgumentError(GpuMemPoolError, ValueError):
    """A bad size, device, option or configuration."""


class InvalidPointerError(GpuMemPoolError, ValueError):
    """The address does not belong to the pool."""


class DoubleFreeError(InvalidPointerError):
    """The address is inside the pool but not an allocated block: freed
    already, or an interior pointer."""


class PoolClosedError(GpuMemPoolError, RuntimeError):
    """The pool was closed (possibly by another thread)."""


class ForkedProcessError(GpuMemPoolError, RuntimeError):
    """This process was forked from one that had loaded gpumempool: the Go
    runtime behind its pools does not survive fork(), so nothing inherited
    (pools, the engine) can be used here. The message says what to do: the
    'spawn' or 'forkserver' start method, or importing gpumempool only in
    the processes that use it."""


class BackendError(GpuMemPoolError, RuntimeError):
    """The backend (or a user allocator callback) failed."""


class CallbackReentryError(GpuMemPoolError, RuntimeError):
    """A pool's own Python ``alloc`` / ``free`` function called back into
    that pool (``pool.stats()``, ``pool.free()``, ...). The engine holds the
    pool's lock while it calls the function, so the call would wait for
    itself forever; it is refused instead. The function sees this exception;
    the pool call that ran the function then fails with a
    :class:`BackendError` chained to it (unless the function caught it).
    ``pool`` is the pool's name (or ``#handle``), as the message gives it."""

    def __init__(self, message: str, pool: str = "") -> None:
        super().__init__(message)
        self.pool = pool


class LeakWarning(UserWarning):
    """A pool was closed while blocks were still allocated."""


_KINDS: dict[str, type[GpuMemPoolError]] = {
    "OutOfMemoryError": OutOfMemoryError,
    "ValueError": InvalidArgumentError,
    "InvalidPointerError": InvalidPointerError,
    "DoubleFreeError": DoubleFreeError,
    "PoolClosedError": PoolClosedError,
    "ForkedProcessError": ForkedProcessError,
    "RuntimeError": BackendError,
}

_PREFIX = re.compile(r"^(\w+): ")


def translate(exc: BaseException) -> BaseException:
    """Turn gopy's RuntimeError("Kind: message") into our exception type."""
    if isinstance(exc, GpuMemPoolError):  # ours already (ForkedProcessError in a forked child)
        return exc
    msg = str(exc)
    m = _PREFIX.match(msg)
    if m and m.group(1) in _KINDS:
        err = _KINDS[m.group(1)](msg[m.end():])
        if isinstance(err, OutOfMemoryError) and _oom_listeners and not getattr(_expected, "on", False):
            _tell_out_of_memory(err)
        return err
    return BackendError(msg)


#: Told of every OutOfMemoryError a pool call raises (translate makes them
#: all), on the calling thread, after the engine returned: no pool's lock is
#: held. gpumempool.distributed.snapshot_on_oom listens here.
_oom_listeners: list[Callable[[OutOfMemoryError], None]] = []
_oom_lock = threading.Lock()
#: Per thread: whether the OutOfMemoryErrors raised on it are outcomes the
#: caller counts (a replay of a trace that does not fit), not this process
#: running out of memory: listeners are not told of them.
_expected = threading.local()


def expect_out_of_memory(expected: bool) -> bool:
    """Set whether this thread's OutOfMemoryErrors are expected outcomes
    (see ``_expected``); returns the previous setting, to put back."""
    previous = bool(getattr(_expected, "on", False))
    _expected.on = expected
    return previous


def renew_oom_lock() -> None:
    """In a forked child: a new lock for the out-of-memory listeners, as
    another thread may have held the old one at the fork (this module sits
    below gpumempool._native, whose fork hooks call this)."""
    global _oom_lock
    _oom_lock = threading.Lock()


def on_out_of_memory(listener: Callable[[OutOfMemoryError], None]) -> Callable[[], None]:
    """Call ``listener(err)`` for every :class:`OutOfMemoryError` a pool call
    raises, before it is raised (an exception the listener raises is
    ignored: the caller gets its out-of-memory error). Returns a function
    that unsubscribes it."""
    with _oom_lock:
        _oom_listeners.append(listener)

    def unsubscribe() -> None:
        with _oom_lock:
            if listener in _oom_listeners:
                _oom_listeners.remove(listener)

    return unsubscribe


def _tell_out_of_memory(err: OutOfMemoryError) -> None:
    with _oom_lock:
        listeners = list(_oom_listeners)
    for listener in listeners:
        try:
            listener(err)
        except Exception:  # noqa: BLE001,S110 - the caller's error is the out-of-memory one
            pass
