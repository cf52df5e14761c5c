"""Cache scopes (after GPUArrays.jl's ``@cached`` / cache scopes).

A loop body that allocates the same temporaries every iteration can keep
them for the next iteration instead of handing them back::

    for step in range(1000):
        with gmp.cache_scope(pool, "body") as scope:
            a = scope.alloc(n_bytes)          # 2nd iteration on: the same block
            ...
            scope.free(a)                     # kept for the next iteration
    gmp.invalidate("body")                    # now everything goes back to the pool

Design. A scope is named; ``cache_scope(pool, name)`` finds (or makes) the
scope of that name for that pool and makes it the thread's active scope for
the pool. Its allocations go through a free list keyed by (size rounded to
512 bytes, device, stream): a block freed by the body goes onto that list
(not back to the pool) and the next allocation of the same key takes it, in
the same order as the previous entry allocated (the k-th allocation of a key
gets the block the k-th allocation got last time, so iteration 2 reuses
iteration 1's blocks exactly). Blocks stay allocated in the pool while
cached, reserved for this scope; ``invalidate(name)`` (or leaving a scope
entered with ``keep=False``) frees every cached block to the pool, and blocks
still live then go straight to the pool when freed.

Peak memory. A free inside the body is reusable by the body's next
allocation of that size at once, so a scope holds the body's peak *live*
set, one iteration's worth, not everything the body allocated. (GPUArrays'
cache gives an array back to the cache only when the block ends, so an
iteration that allocates k temporaries holds all k at once.)

Who allocates through a scope: ``scope.alloc``/``scope.free``; the module
functions :func:`alloc`/:func:`free`, which use the thread's active scope of
the pool when there is one (``gpumempool.cupy`` allocates through them, so
CuPy arrays made in the body are cached too); and torch with
``cache_scope(pool, name, torch=True, device=...)``, which also enters
``gmp.mempool`` with a torch pool of the scope's own (one per pool, device
and scope name). Torch keeps the blocks its tensors free inside that torch
pool, where only allocations routed to it, i.e. the next entry of the same
scope, can take them: torch's caching allocator is the scope's free list.
``invalidate(name)`` then releases that torch pool (:func:`gpumempool.torch.
release`), returning its segments to the engine; it raises
``PoolInUseError`` while tensors allocated in the scope are alive.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Any, Callable, Iterator, Optional

from . import torch as _gmp_torch
from ._errors import GpuMemPoolError, InvalidArgumentError, InvalidPointerError
from . import _lifecycle, _native
from ._args import as_stream, device_index
from ._callbacks import runs_python_function
from ._pool import MemPool

__all__ = ["CacheScope", "ScopeError", "active_scope", "alloc", "cache_scope", "free", "invalidate"]

_ROUND = 512

Key = tuple[int, int, int]  # (rounded size, device, stream)


class ScopeError(GpuMemPoolError, RuntimeError):
    """A cache scope was used after invalidation, or invalidated while entered."""


# A finalizer (gpumempool.cupy's block owner) frees through this module, and
# the cyclic GC can run it on any allocation: also on a thread inside one of
# this module's locked regions. It must neither wait for a lock that thread
# holds nor change the dicts that thread is in the middle of: such frees
# are deferred to the end of the thread's outermost locked region.
_held = threading.local()  # .depth: this module's locks the thread holds
_deferred: "collections.deque[tuple[MemPool, int, Optional[Callable[[BaseException], None]]]]" = collections.deque()


class _Lock:
    """A reentrant lock that counts, per thread, the regions of this module
    being run (see :func:`free_from_finalizer`)."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def __enter__(self) -> None:
        _held.depth = getattr(_held, "depth", 0) + 1  # before: a finalizer meanwhile defers
        try:
            self._lock.acquire()
        except BaseException:
            _held.depth -= 1
            raise

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()
        _held.depth -= 1  # after: likewise
        if not _held.depth and _deferred:
            _run_deferred()


def _run_deferred() -> None:
    if getattr(_held, "draining", False):
        return
    _held.draining = True
    later = []
    try:
        while True:
            try:
                entry = _deferred.popleft()
            except IndexError:
                return
            pool, ptr, on_error = entry
            if runs_python_function(pool):
                later.append(entry)  # freed once that function has returned
                continue
            try:
                free(pool, ptr)
            except Exception as exc:  # noqa: BLE001 - a finalizer's free: reported to it
                if on_error is not None:
                    with contextlib.suppress(Exception):
                        on_error(exc)
    finally:
        _deferred.extend(later)
        _held.draining = False


def _after_native_call() -> None:
    """Run by MemPool after a native call of a pool with Python allocator
    functions: frees deferred while one of them ran can go now."""
    if _deferred and not getattr(_held, "depth", 0):
        _run_deferred()


_lifecycle.after_native_call(_after_native_call)


def free_from_finalizer(
    pool: MemPool, ptr: int, on_error: Optional[Callable[[BaseException], None]] = None
) -> None:
    """:func:`free` for a ``__del__``: done now, or, when the calling thread
    is inside this module's locks (the cyclic GC ran the finalizer there), as
    soon as it leaves them. Never raises: a failed free calls ``on_error``."""
    if getattr(_held, "depth", 0) or runs_python_function(pool):
        # inside this module's locks, or inside one of the pool's own
        # allocator functions (the GC ran the finalizer there)
        _deferred.append((pool, ptr, on_error))
        return
    try:
        free(pool, ptr)
    except Exception as exc:  # noqa: BLE001
        if on_error is not None:
            with contextlib.suppress(Exception):
                on_error(exc)
    if _deferred:
        _run_deferred()


class CacheScope:
    """A named cache of freed blocks over one pool (see the module docstring).
    Made by :func:`cache_scope`; thread-safe."""

    def __init__(self, pool: MemPool, name: str) -> None:
        self.pool = pool
        self.name = name
        self._lock = _Lock()
        self._free: dict[Key, dict[int, None]] = {}  # insertion-ordered sets of cached blocks
        self._live: dict[int, Key] = {}
        self._order: dict[Key, list[int]] = {}  # blocks in allocation order, this entry
        self._prev: dict[Key, list[int]] = {}  # the same, previous entry
        self._count: dict[Key, int] = {}
        self._active = 0
        # An entry with keep=False left while another thread was inside: the
        # last entry to leave invalidates the scope.
        self._pending = False
        self._torch_tag: Optional[tuple[str, str]] = None
        self.invalidated = False
        self.entries = 0
        self.hits = 0
        self.misses = 0

    def _key(self, size: int, device: Any, stream: Any) -> Key:
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"size must be an int, got {type(size).__name__}")
        if size <= 0:
            raise InvalidArgumentError(f"size must be > 0, got {size}")
        dev = self.pool.device if device is None else device_index(device)
        return ((size + _ROUND - 1) // _ROUND * _ROUND, dev, as_stream(stream))

    def alloc(self, size: int, device: Any = None, stream: Any = 0) -> int:
        """Allocate ``size`` bytes, from the scope's cache when it holds a
        block of the same rounded size, device and stream."""
        key = self._key(size, device, stream)
        ptr: Optional[int] = None
        with self._lock:
            if self.invalidated:
                raise ScopeError(f"cache scope {self.name!r} was invalidated; enter cache_scope again for a new one")
            k = self._count.get(key, 0)
            self._count[key] = k + 1
            cached = self._free.get(key)
            if cached:
                prev = self._prev.get(key)
                ptr = prev[k] if prev and k < len(prev) and prev[k] in cached else next(iter(cached))
                del cached[ptr]
                self.hits += 1
        if ptr is None:
            ptr = self.pool.alloc(size, key[1], key[2])
            with self._lock:
                self.misses += 1
        owners = _owners_of(self.pool)
        with self._lock:
            self._live[ptr] = key
            self._order.setdefault(key, []).append(ptr)
            owners[ptr] = self
        return ptr

    def free(self, ptr: int) -> None:
        """Give back a block of this scope: it is cached for the scope's next
        allocation of that size (freed to the pool once invalidated)."""
        with _lock:
            ps = _registry.get(id(self.pool))
        with self._lock:
            key = self._live.pop(ptr, None)
            if key is None:
                raise InvalidPointerError(f"{ptr:#x} is not a live block of cache scope {self.name!r}")
            # Drop the owner entry before the block can be handed out again
            # (by another thread's alloc, which records itself as owner).
            if ps is not None and ps.owners.get(ptr) is self:
                del ps.owners[ptr]
            to_pool = self.invalidated
            if not to_pool:
                self._free.setdefault(key, {})[ptr] = None
        if to_pool:
            self.pool.free(ptr)

    @property
    def cached_bytes(self) -> int:
        """Bytes of the blocks cached (freed by the body, kept for the next entry)."""
        with self._lock:
            return sum(key[0] * len(ptrs) for key, ptrs in self._free.items())

    @property
    def live_bytes(self) -> int:
        """Bytes of the scope's blocks in use."""
        with self._lock:
            return sum(key[0] for key in self._live.values())

    def stats(self) -> dict[str, int]:
        """Entries, cache hits and misses, cached and live bytes."""
        return {
            "entries": self.entries,
            "hits": self.hits,
            "misses": self.misses,
            "cached_bytes": self.cached_bytes,
            "live_bytes": self.live_bytes,
        }

    def invalidate(self, *, _closing: bool = False) -> int:
        """Free every cached block to the pool (and release the scope's torch
        pool); return the bytes freed. The scope cannot be used afterwards;
        its blocks still live go to the pool when freed."""
        with self._lock:
            if self._active and not _closing:
                raise ScopeError(f"cache scope {self.name!r} is entered; invalidate it after the with block")
        if not _closing and self._torch_tag is not None:
            # raises PoolInUseError, touching nothing, while its tensors are
            # alive (when the pool closes, torch's pools were released
            # already: gpumempool.torch.forget_pool)
            _gmp_torch.release(self.pool, tag=self._torch_tag)
        with self._lock:
            if self._active and not _closing:
                raise ScopeError(f"cache scope {self.name!r} is entered; invalidate it after the with block")
            blocks = [(ptr, key[0]) for key, ptrs in self._free.items() for ptr in ptrs]
            self._free.clear()
            self._order.clear()
            self._prev.clear()
            self.invalidated = True
        for ptr, _ in blocks:
            try:
                self.pool.free(ptr)
            except Exception:  # noqa: BLE001
                if not _closing:
                    raise
                # the pool is closing; its close reports the rest
        return sum(size for _, size in blocks)

    def _enter(self) -> None:
        with self._lock:
            if self.invalidated:
                raise ScopeError(f"cache scope {self.name!r} was invalidated")
            self._active += 1
            self.entries += 1
            if self._order:
                self._prev, self._order = self._order, {}
            self._count = {}

    def _exit(self) -> None:
        with self._lock:
            self._active -= 1

    def __repr__(self) -> str:
        return f"<gpumempool.CacheScope {self.name!r} entries={self.entries} hits={self.hits} misses={self.misses}>"


class _PoolScopes:
    def __init__(self, pool: MemPool) -> None:
        self.pool = pool
        self.scopes: dict[str, CacheScope] = {}
        self.owners: dict[int, CacheScope] = {}  # live block -> its scope


_lock = _Lock()
_registry: dict[int, _PoolScopes] = {}  # id(pool) -> its scopes (keeps the pool alive)
_tls = threading.local()


def _new_locks_after_fork() -> None:
    """In a forked child: locks another thread may have held, made anew."""
    global _lock
    _lock = _Lock()
    for ps in _registry.values():
        for scope in ps.scopes.values():
            scope._lock = _Lock()


_native.after_fork_in_child(_new_locks_after_fork)


def _stack() -> list[CacheScope]:
    stack = getattr(_tls, "stack", None)
    if stack is None:
        stack = _tls.stack = []
    return stack


def _pool_scopes(pool: MemPool) -> _PoolScopes:
    with _lock:
        ps = _registry.get(id(pool))
        if ps is None:
            ps = _registry[id(pool)] = _PoolScopes(pool)
        return ps


def _owners_of(pool: MemPool) -> dict[int, CacheScope]:
    return _pool_scopes(pool).owners


def active_scope(pool: MemPool) -> Optional[CacheScope]:
    """The innermost cache scope of ``pool`` the calling thread is in, or None."""
    for scope in reversed(_stack()):
        if scope.pool is pool:
            return scope
    return None


def alloc(pool: MemPool, size: int, device: Any = None, stream: Any = 0) -> int:
    """``pool.alloc``, through the thread's active cache scope of ``pool``
    when there is one."""
    scope = active_scope(pool)
    if scope is not None:
        return scope.alloc(size, device, stream)
    return pool.alloc(size, device, stream)


def free(pool: MemPool, ptr: int) -> None:
    """``pool.free``, or the owning scope's free for a block a scope handed out."""
    with _lock:
        ps = _registry.get(id(pool))
        scope = ps.owners.get(ptr) if ps is not None else None
    if scope is not None:
        scope.free(ptr)
    else:
        pool.free(ptr)


@contextlib.contextmanager
def cache_scope(
    pool: MemPool,
    name: str,
    *,
    keep: bool = True,
    torch: bool = False,
    device: Any = None,
    stream: Any = None,
) -> Iterator[CacheScope]:
    """Enter the cache scope ``name`` of ``pool`` (made on first use).

    ``keep=True`` (the default): what the body frees stays cached for the
    next entry until :func:`invalidate`. ``keep=False``: invalidate when
    this entry exits (for a scope around a whole loop). ``torch=True``: also
    route the thread's torch allocations on ``device`` (and ``stream``) to
    a torch pool of this scope (see the module docstring).
    """
    if not isinstance(pool, MemPool):
        raise TypeError(f"pool must be a gpumempool.MemPool, got {type(pool).__name__}")
    if not isinstance(name, str) or not name:
        raise TypeError("name must be a non-empty str")
    pool.handle  # PoolClosedError for a closed pool, before it is registered (and kept alive) here
    ps = _pool_scopes(pool)
    with _lock:
        scope = ps.scopes.get(name)
        if scope is None or scope.invalidated:
            scope = ps.scopes[name] = CacheScope(pool, name)
    scope._enter()
    stack = _stack()
    stack.append(scope)
    torch_cm: Optional[_gmp_torch.MempoolContext] = None
    failed = False
    try:
        if torch:
            tag = ("cache_scope", name)
            cm = _gmp_torch.MempoolContext(pool, device, stream, tag=tag)
            cm.__enter__()
            torch_cm = cm
            scope._torch_tag = tag
        yield scope
    except BaseException:
        failed = True
        raise
    finally:
        try:
            if torch_cm is not None:
                torch_cm.__exit__(None, None, None)
        finally:
            if stack and stack[-1] is scope:
                stack.pop()
            elif scope in stack:
                stack.remove(scope)
            scope._exit()
            if not keep:
                scope._pending = True
            if scope._pending and not scope._active:
                try:
                    invalidate(name, pool)
                except ScopeError:
                    # Another thread entered meanwhile: it invalidates the
                    # scope when it leaves (_pending), or has by now.
                    if not failed and not scope._active and not scope.invalidated:
                        raise
                except Exception:
                    if not failed:  # never hide the body's exception behind this one
                        raise


def invalidate(name: str, pool: Optional[MemPool] = None) -> int:
    """Free everything the cache scope ``name`` holds (of ``pool``, or of
    every pool when None) back to the pool; return the bytes freed. The next
    ``cache_scope`` with that name starts empty."""
    # checked: a wrong argument would match no scope and return 0 silently
    if not isinstance(name, str):
        raise TypeError(f"name must be a cache scope's name (a str), got {type(name).__name__}")
    if pool is not None and not isinstance(pool, MemPool):
        raise TypeError(f"pool must be a gpumempool.MemPool or None, got {type(pool).__name__}")
    with _lock:
        targets = [
            (ps, ps.scopes[name]) for ps in _registry.values() if name in ps.scopes and (pool is None or ps.pool is pool)
        ]
    total = 0
    for ps, scope in targets:
        total += scope.invalidate()
        with _lock:
            if ps.scopes.get(name) is scope:
                del ps.scopes[name]
    return total


def _reset_for_tests() -> None:
    with _lock:
        _registry.clear()
    _deferred.clear()
    _tls.stack = []


def forget_pool(pool: MemPool) -> Optional[str]:
    """Invalidate every cache scope of ``pool``, entered ones too, and drop
    the pool from the registry: run by MemPool.close in the last stage
    (:data:`gpumempool._lifecycle.LAST`), once torch and CuPy let go of the
    pool. Never raises; returns what the caller should warn about (scopes
    still entered), or None."""
    with _lock:
        ps = _registry.pop(id(pool), None)
    if ps is None or ps.pool is not pool:
        return None
    entered = []
    for scope in list(ps.scopes.values()):
        with scope._lock:
            if scope._active:
                entered.append(scope.name)
        scope.invalidate(_closing=True)
    if entered:
        return f"cache scope(s) {', '.join(repr(n[:80]) for n in entered)} of the pool are entered"
    return None


_lifecycle.on_close(forget_pool, _lifecycle.LAST)
