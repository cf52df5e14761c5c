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
from typing import Any, Callable, Iterator, Optional

from . import scope as _scope
from ._errors import GpuMemPoolError
from ._pool import MemPool, _device_index

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
            _scope.free(self.pool, ptr)
        except Exception:  # noqa: BLE001 - pool closed, or interpreter shutdown
            _dropped[0] += 1


_dropped = [0]  # frees that failed inside __del__ (closed pool, shutdown)


def allocator(pool: MemPool, device: Any = None) -> Callable[[int], Any]:
    """A CuPy allocator function over ``pool`` (for cupy.cuda.set_allocator
    or using_allocator). ``device``: allocate on this device instead of
    CuPy's current one."""
    if not isinstance(pool, MemPool):
        raise TypeError(f"pool must be a gpumempool.MemPool, got {type(pool).__name__}")
    cp = _import_cupy()
    fixed = None if device is None else _device_index(device)
    cuda = cp.cuda

    def gmp_cupy_alloc(size: int) -> Any:
        dev = fixed if fixed is not None else int(cuda.runtime.getDevice())
        if size <= 0:
            return cuda.MemoryPointer(cuda.UnownedMemory(0, 0, None, dev), 0)
        stream = int(cuda.get_current_stream().ptr or 0)
        ptr = _scope.alloc(pool, int(size), dev, stream)
        try:
            mem = cuda.UnownedMemory(ptr, int(size), _Block(pool, ptr), dev)
        except BaseException:
            _scope.free(pool, ptr)
            raise
        return cuda.MemoryPointer(mem, 0)

    gmp_cupy_alloc.pool = pool  # type: ignore[attr-defined]
    return gmp_cupy_alloc


_lock = threading.Lock()
_saved: list[Any] = []  # allocators replaced by set_allocator, innermost last


def set_allocator(pool: MemPool, device: Any = None) -> Any:
    """Make CuPy allocate from ``pool`` in every thread (that has no
    thread-local allocator); return the allocator it replaced, which
    :func:`reset_allocator` restores."""
    cp = _import_cupy()
    fn = allocator(pool, device)
    with _lock:
        previous = cp.cuda.get_allocator()
        cp.cuda.set_allocator(fn)
        _saved.append(previous)
    return previous


def reset_allocator() -> None:
    """Restore the CuPy allocator the last :func:`set_allocator` replaced."""
    cp = _import_cupy()
    with _lock:
        if not _saved:
            raise CupyIntegrationError("gmp.cupy.set_allocator was not called (nothing to restore)")
        cp.cuda.set_allocator(_saved.pop())


@contextlib.contextmanager
def using(pool: MemPool, device: Any = None, *, process_wide: bool = False) -> Iterator[Callable[[int], Any]]:
    """CuPy allocates from ``pool`` inside the block: in this thread
    (``cupy.cuda.using_allocator``), or in every thread with
    ``process_wide=True`` (set_allocator, then the previous one is restored).
    Arrays made inside keep their memory after the block."""
    cp = _import_cupy()
    fn = allocator(pool, device)
    if not process_wide:
        using_allocator: Optional[Callable[..., Any]] = getattr(cp.cuda, "using_allocator", None)
        if using_allocator is None:
            raise CupyIntegrationError("this CuPy has no cupy.cuda.using_allocator (CuPy >= 8); use process_wide=True")
        with using_allocator(fn):
            yield fn
        return
    with _lock:
        previous = cp.cuda.get_allocator()
        cp.cuda.set_allocator(fn)
    try:
        yield fn
    finally:
        with _lock:
            cp.cuda.set_allocator(previous)
