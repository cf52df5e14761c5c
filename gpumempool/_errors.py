"""Exceptions raised by gpumempool. Each subclasses the builtin a user would
catch for it (``MemoryError``, ``ValueError``, ``RuntimeError``) and the
common base :class:`GpuMemPoolError`.

The engine's errors reach Python as one structured value by every route
(gopy's wrappers, the C fast path, the C side's refusal of a forked child):
a JSON object ``{"kind", "message", "fields"}`` (bindings/pyerr).
:func:`translate` raises the class named by ``kind`` with the message and the
fields; the exceptions' attributes (``OutOfMemoryError.device``, ...) come
from the fields, never from the message."""

from __future__ import annotations

import json
import threading
from typing import Any, Callable, Mapping, Optional

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
    """Base class of every gpumempool error.

    ``kind`` names the class as the engine names it (bindings/pyerr's kinds);
    ``fields`` are the values the engine's error carried (empty for errors
    raised in Python, or that carry none)."""

    kind = "GpuMemPoolError"

    def __init__(self, *args: Any, fields: Optional[Mapping[str, Any]] = None) -> None:
        super().__init__(*args)
        self.fields: dict[str, Any] = dict(fields or {})


class OutOfMemoryError(GpuMemPoolError, MemoryError):
    """An allocation failed after the pool released its cache and retried.

    The message names the pool, device, requested, allocated, reserved and
    limit bytes (like torch's OutOfMemoryError). An error from the engine
    carries them as attributes too: ``pool``, ``backend``, ``device``,
    ``requested``, ``segment``, ``allocated``, ``reserved``, ``limit`` (0:
    none), ``shared_reserved``, ``device_free`` and ``device_total`` (0 when
    the backend cannot tell) and ``cause`` (the backend's error, "" when the
    pool's limit was hit); each is None on an error made in Python."""

    kind = "OutOfMemoryError"

    @property
    def pool(self) -> Optional[str]:
        return self.fields.get("pool")

    @property
    def backend(self) -> Optional[str]:
        return self.fields.get("backend")

    @property
    def device(self) -> Optional[int]:
        return self.fields.get("device")

    @property
    def requested(self) -> Optional[int]:
        return self.fields.get("requested")

    @property
    def segment(self) -> Optional[int]:
        return self.fields.get("segment")

    @property
    def allocated(self) -> Optional[int]:
        return self.fields.get("allocated")

    @property
    def reserved(self) -> Optional[int]:
        return self.fields.get("reserved")

    @property
    def limit(self) -> Optional[int]:
        return self.fields.get("limit")

    @property
    def shared_reserved(self) -> Optional[int]:
        return self.fields.get("shared_reserved")

    @property
    def device_free(self) -> Optional[int]:
        return self.fields.get("device_free")

    @property
    def device_total(self) -> Optional[int]:
        return self.fields.get("device_total")

    @property
    def cause(self) -> Optional[str]:
        return self.fields.get("cause")


class InvalidArgumentError(GpuMemPoolError, ValueError):
    """A bad size, device, option or configuration."""

    kind = "InvalidArgumentError"


class InvalidPointerError(GpuMemPoolError, ValueError):
    """The address does not belong to the pool."""

    kind = "InvalidPointerError"


class DoubleFreeError(InvalidPointerError):
    """The address is inside the pool but not an allocated block: freed
    already, or an interior pointer."""

    kind = "DoubleFreeError"


class PoolClosedError(GpuMemPoolError, RuntimeError):
    """The pool was closed (possibly by another thread)."""

    kind = "PoolClosedError"


class ForkedProcessError(GpuMemPoolError, RuntimeError):
    """This process was forked from one that had loaded gpumempool: the Go
    runtime behind its pools does not survive fork(), so nothing inherited
    (pools, the engine) can be used here. The message says what to do: the
    'spawn' or 'forkserver' start method, or importing gpumempool only in
    the processes that use it."""

    kind = "ForkedProcessError"


class BackendError(GpuMemPoolError, RuntimeError):
    """The backend (or a user allocator callback) failed."""

    kind = "BackendError"


class CallbackReentryError(GpuMemPoolError, RuntimeError):
    """A pool's own Python ``alloc`` / ``free`` function called back into
    that pool (``pool.stats()``, ``pool.free()``, ...). The engine holds the
    pool's lock while it calls the function, so the call would wait for
    itself forever; it is refused instead. The function sees this exception;
    the pool call that ran the function then fails with a
    :class:`BackendError` chained to it (unless the function caught it).
    ``pool`` is the pool's name (or ``#handle``), as the message gives it."""

    kind = "CallbackReentryError"

    def __init__(self, message: str, pool: str = "", *, fields: Optional[Mapping[str, Any]] = None) -> None:
        super().__init__(message, fields=fields)
        self.pool = pool


class LeakWarning(UserWarning):
    """A pool was closed while blocks were still allocated."""


#: The class of each kind of error the engine sends (bindings/pyerr.Kinds;
#: a test checks that the two lists agree).
KINDS: dict[str, type[GpuMemPoolError]] = {
    cls.kind: cls
    for cls in (OutOfMemoryError, DoubleFreeError, InvalidPointerError, PoolClosedError, InvalidArgumentError,
                ForkedProcessError, BackendError)
}


def error_from_value(text: str) -> GpuMemPoolError:
    """The exception for an error value the engine sent as ``text`` (JSON
    ``{"kind", "message", "fields"}``). Text that is no such value (an
    error gopy itself raised, a fallback of the C fast path) is a
    :class:`BackendError` with that text."""
    try:
        value = json.loads(text)
    except ValueError:
        return BackendError(text)
    if not isinstance(value, dict) or not isinstance(value.get("kind"), str):
        return BackendError(text)
    fields = value.get("fields")
    cls = KINDS.get(value["kind"], BackendError)
    return cls(str(value.get("message", "")), fields=fields if isinstance(fields, dict) else None)


def translate(exc: BaseException) -> BaseException:
    """Turn the RuntimeError an engine call raised (gopy's wrappers, the C
    fast path: its text is the error's value) into our exception type."""
    if isinstance(exc, GpuMemPoolError):  # ours already (ForkedProcessError in a forked child)
        return exc
    err = error_from_value(str(exc))
    if isinstance(err, OutOfMemoryError) and _oom_listeners and not getattr(_expected, "on", False):
        _tell_out_of_memory(err)
    return err


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
