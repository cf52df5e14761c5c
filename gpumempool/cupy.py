"""CuPy integration: CuPy arrays from a gpumempool pool.

Importing this module does not import CuPy; the functions do. ::

    import gpumempool as gmp
    pool = gmp.MemPool(backend="cuda")
    with gmp.cupy.using(pool):              # this thread, this block
        a = cupy.arange(10**6)
    gmp.cupy.set_allocator(pool)            # the whole process, until reset_allocator()

Each allocation is ``pool.alloc(size, device, stream)`` on CuPy's current
device and stream, wrapped as ``cupy.cuda.MemoryPointer(cupy.cuda.
UnownedMemory(ptr, size, owner))``; the owner frees the block to the pool
when CuPy lets go of the memory (garbage collection of the last array using
it). Inside a ``gmp.cache_scope`` of the pool the allocation goes through
the scope. A process using torch (``gmp.mempool``) and CuPy on one pool sees
one set of statistics and one reserve.

CuPy APIs used: ``cupy.cuda.set_allocator`` / ``get_allocator`` (process
wide) and ``cupy.cuda.using_allocator`` (thread-local, CuPy >= 8),
``cupy.cuda.MemoryPointer``, ``cupy.cuda.UnownedMemory(ptr, size, owner,
device_id)``, ``cupy.cuda.get_current_stream().ptr``,
``cupy.cuda.runtime.getDevice()``.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import weakref
from typing import Any, Callable, Iterator, Optional

from . import _lifecycle, _native
from . import scope as _scope
from ._errors import GpuMemPoolError, PoolClosedError
from ._args import device_index
from ._pool import MemPool

__all__ = ["CupyIntegrationError", "allocator", "reset_allocator", "set_allocator", "using"]


class CupyIntegrationError(GpuMemPoolError, RuntimeError):
    """CuPy is missing, or the allocator state is not what was expected."""


def _import_cupy() -> Any:
    try:
        return importlib.import_module("cupy")
    except ImportError as exc:
        raise CupyIntegrationError("gpumempool.cupy needs CuPy (pip install cupy-cuda12x or cupy-cuda13x)") from exc


class _Block:
    """Owner of one pool block: frees it when CuPy drops the last reference."""

    __slots__ = ("pool", "ptr", "__weakref__")

    def __init__(self, pool: MemPool, ptr: int) -> None:
        self.pool = pool
        self.ptr = ptr

    def __del__(self) -> None:
        ptr, self.ptr = self.ptr, 0
        if not ptr:
            return
        try:
            # The cyclic GC may run this inside a locked region of
            # gpumempool.scope on this very thread: the free then waits for
            # the end of that region instead of deadlocking.
            _scope.free_from_finalizer(self.pool, ptr, _count_dropped)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            _dropped[0] += 1


def _count_dropped(exc: BaseException) -> None:
    _dropped[0] += 1


_dropped = [0]  # frees that failed inside __del__ (closed pool, shutdown)


def _current_stream(cuda: Any, device: Optional[int]) -> int:
    """CuPy's current stream of ``device`` (None: of the current device). A
    fixed device's own: the current device's stream belongs to another
    context, where the pool's events could not be recorded."""
    if device is None:
        return int(cuda.get_current_stream().ptr or 0)
    try:
        return int(cuda.get_current_stream(device).ptr or 0)
    except TypeError:  # a CuPy without the device_id argument: the legacy stream
        return 0


def allocator(pool: MemPool, device: Any = None) -> Callable[[int], Any]:
    """A CuPy allocator function over ``pool`` (for cupy.cuda.set_allocator
    or using_allocator). ``device``: allocate on this device instead of
    CuPy's current one."""
    if not isinstance(pool, MemPool):
        raise TypeError(f"pool must be a gpumempool.MemPool, got {type(pool).__name__}")
    cp = _import_cupy()
    fixed = None if device is None else device_index(device)
    cuda = cp.cuda

    def gmp_cupy_alloc(size: int) -> Any:
        dev = fixed if fixed is not None else int(cuda.runtime.getDevice())
        if size <= 0:
            return cuda.MemoryPointer(cuda.UnownedMemory(0, 0, None, dev), 0)
        stream = _current_stream(cuda, fixed)
        ptr = _scope.alloc(pool, int(size), dev, stream)
        owner = _Block(pool, ptr)
        try:
            mem = cuda.UnownedMemory(ptr, int(size), owner, dev)
        except BaseException:
            # freed here, so the owner (alive in the traceback) must not
            # free it again later, maybe someone else's block by then
            owner.ptr = 0
            _scope.free(pool, ptr)
            raise
        return cuda.MemoryPointer(mem, 0)

    gmp_cupy_alloc.pool = pool  # type: ignore[attr-defined]
    return gmp_cupy_alloc


class _Entry:
    """An allocator installed process-wide by set_allocator or using(...,
    process_wide=True), and the one it replaced."""

    __slots__ = ("fn", "previous", "pool")

    def __init__(self, fn: Any, previous: Any, pool: MemPool) -> None:
        self.fn, self.previous, self.pool = fn, previous, pool


_lock = threading.RLock()


def _new_lock_after_fork() -> None:
    global _lock
    _lock = threading.RLock()


_native.after_fork_in_child(_new_lock_after_fork)
#: The process-wide allocators installed, oldest first; each one's previous
#: is the allocator below it (or CuPy's, for the first).
_stack: list[_Entry] = []
_set_calls: list[_Entry] = []  # set_allocator's entries, for reset_allocator (innermost last)
#: Pools whose close has run _forget_pool: the engine marks them closed only
#: after it, and nothing may be installed on them in between.
_closing: "weakref.WeakSet[MemPool]" = weakref.WeakSet()


def _install(cp: Any, fn: Any, pool: MemPool) -> _Entry:
    with _lock:
        if pool.closed or pool in _closing:
            raise PoolClosedError(f"pool {pool!r} is closed")
        entry = _Entry(fn, cp.cuda.get_allocator(), pool)
        cp.cuda.set_allocator(fn)
        _stack.append(entry)
    return entry


def _uninstall(cp: Any, entry: _Entry) -> None:
    """Take ``entry`` out, in any order: the allocator installed after it
    now restores what it replaced; the newest one puts back its previous
    allocator, but only if CuPy's is still its own (code that set another
    allocator meanwhile keeps it). Again, or after close: nothing."""
    with _lock:
        if entry not in _stack:
            return
        i = _stack.index(entry)
        del _stack[i]
        if i < len(_stack):
            _stack[i].previous = entry.previous
        elif cp.cuda.get_allocator() is entry.fn:
            cp.cuda.set_allocator(entry.previous)


def _forget_pool(pool: MemPool) -> Optional[str]:
    """MemPool.close (a close hook, gpumempool._lifecycle.on_close): no CuPy allocator
    installed process-wide stays on the closed pool, nor is installed
    later."""
    with _lock:
        _closing.add(pool)
        entries = [e for e in _stack if e.pool is pool]
        if not entries:
            return None
        try:
            cp = _import_cupy()
        except CupyIntegrationError:  # CuPy gone (shutdown): nothing to restore there
            _stack[:] = [e for e in _stack if e.pool is not pool]
            return None
        for entry in reversed(entries):
            _uninstall(cp, entry)
    return None


_lifecycle.on_close(_forget_pool)


def set_allocator(pool: MemPool, device: Any = None) -> Any:
    """Make CuPy allocate from ``pool`` in every thread (that has no
    thread-local allocator); return the allocator it replaced, which
    :func:`reset_allocator` restores. Closing the pool undoes it (CuPy then
    gets the allocator it had before)."""
    cp = _import_cupy()
    if pool.closed:
        raise PoolClosedError(f"pool {pool!r} is closed")
    fn = allocator(pool, device)
    with _lock:
        entry = _install(cp, fn, pool)  # checks again, under the lock a close takes
        _set_calls.append(entry)
    return entry.previous


def reset_allocator() -> None:
    """Undo the last :func:`set_allocator`: CuPy gets back the allocator it
    replaced, unless another one was installed since (then that one, when
    it goes, restores the allocator from before this set_allocator). Nothing
    to do when the pool was closed meanwhile (closing undid it)."""
    cp = _import_cupy()
    with _lock:
        if not _set_calls:
            raise CupyIntegrationError("gmp.cupy.set_allocator was not called (nothing to restore)")
        _uninstall(cp, _set_calls.pop())


@contextlib.contextmanager
def using(pool: MemPool, device: Any = None, *, process_wide: bool = False) -> Iterator[Callable[[int], Any]]:
    """CuPy allocates from ``pool`` inside the block: in this thread
    (``cupy.cuda.using_allocator``), or in every thread with
    ``process_wide=True`` (set_allocator, then the previous one is restored
    at exit, in any order of the blocks of several threads; closing the pool
    restores it too). Arrays made inside keep their memory after the block."""
    cp = _import_cupy()
    fn = allocator(pool, device)
    if not process_wide:
        using_allocator: Optional[Callable[..., Any]] = getattr(cp.cuda, "using_allocator", None)
        if using_allocator is None:
            raise CupyIntegrationError("this CuPy has no cupy.cuda.using_allocator (CuPy >= 8); use process_wide=True")
        with using_allocator(fn):
            yield fn
        return
    if pool.closed:
        raise PoolClosedError(f"pool {pool!r} is closed")
    entry = _install(cp, fn, pool)
    try:
        yield fn
    finally:
        _uninstall(cp, entry)
