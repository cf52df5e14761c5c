"""Exceptions raised by gpumempool. Each subclasses the builtin a user would
catch for it (``MemoryError``, ``ValueError``, ``RuntimeError``) and the
common base :class:`GpuMemPoolError`."""

from __future__ import annotations

import re

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
    :class:`BackendError` chained to it (unless the function caught it)."""


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
        return _KINDS[m.group(1)](msg[m.end():])
    return BackendError(msg)
