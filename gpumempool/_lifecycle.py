"""The life of a pool, as the modules above MemPool hear of it.

MemPool (gpumempool._pool) tells this module when a pool opens, when it
closes, when a native call of a pool with Python allocator functions ends,
and asks it how many of a pool's blocks are leaks at exit. The integrations
above MemPool (gpumempool.torch, gpumempool.scope, gpumempool.cupy)
subscribe here when they are imported; MemPool imports none of them. This
module imports nothing above itself: it knows pools only as objects with a
``closed`` property (any other pool method is the subscribers' business).

What a subscriber can hear:

- :func:`on_close`: a pool is closing, before its segments go back. Hooks
  run in ascending ``stage``, then in the order they subscribed; each
  returns a problem to warn about, or None.
- :func:`after_native_call`: a pool call that may have run Python allocator
  functions has returned on this thread (work those functions had to defer
  can run now).
- :func:`on_exit_leaks`: at interpreter exit, how many of a pool's
  allocated blocks and bytes are not leaks.
- :func:`provide` / :func:`provided`: pool methods whose work lives in a
  module above MemPool (``MemPool.register`` is gpumempool.torch's).
"""

from __future__ import annotations

import itertools
import threading
import warnings
import weakref
from typing import Any, Callable, Optional

from . import _native
from ._errors import LeakWarning

__all__ = [
    "FIRST",
    "LAST",
    "NORMAL",
    "after_native_call",
    "close_hooks",
    "exit_leaks",
    "native_call_done",
    "on_close",
    "on_exit_leaks",
    "open_pools",
    "opened",
    "pools",
    "provide",
    "provided",
    "python_exiting",
    "report_leaks_at_exit",
]

#: Close stages, in the order they run. FIRST: integrations whose C callers
#: may still hold the pool's functions (torch: its pools over the pool's C
#: symbols must go before anything else). NORMAL: the others (CuPy's
#: allocator). LAST: caches of blocks inside the pool (cache scopes), freed
#: once no integration hands blocks out any more.
FIRST, NORMAL, LAST = 0, 10, 20

#: A close hook: ``hook(pool)`` returns a problem to warn about, or None.
CloseHook = Callable[[Any], Optional[str]]
#: An exit leak filter: ``(pool, blocks, nbytes)`` -> the blocks and bytes
#: that are leaks, and a note for the warning.
ExitLeakFilter = Callable[[Any, int, int], "tuple[int, int, str]"]

_lock = threading.Lock()
#: Every pool object alive, open or closed, with its native handle (the
#: order pools were opened in).
_pools: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
_close_hooks: list[tuple[int, int, CloseHook]] = []  # (stage, subscription number, hook)
_subscriptions = itertools.count()
_after_call_hooks: list[Callable[[], None]] = []
_exit_leak_filters: list[ExitLeakFilter] = []
_provided: dict[str, Callable[..., Any]] = {}


def _new_lock_after_fork() -> None:
    global _lock
    _lock = threading.Lock()


_native.after_fork_in_child(_new_lock_after_fork)


# -- open pools ---------------------------------------------------------------


def opened(pool: Any, handle: int) -> None:
    """Called by MemPool once ``pool`` is open in the engine as ``handle``."""
    with _lock:
        _pools[pool] = handle


def pools() -> list[Any]:
    """Every pool object alive, closed ones too (for renewing their locks
    in a forked child)."""
    with _lock:
        return list(_pools)


def open_pools() -> list[Any]:
    """The pools of this process that are not closed, oldest first."""
    with _lock:
        found = [(handle, pool) for pool, handle in _pools.items()]
    found.sort(key=lambda entry: entry[0])
    return [pool for _, pool in found if not pool.closed]


# -- closing ------------------------------------------------------------------


def on_close(hook: CloseHook, stage: int = NORMAL) -> Callable[[], None]:
    """Run ``hook(pool)`` whenever a pool closes, before its segments go back,
    in ``stage`` (:data:`FIRST`, :data:`NORMAL`, :data:`LAST`). The hook may
    return a problem to warn about; an exception it raises is reported the
    same way. Subscribing a hook again does nothing. Returns a function
    that unsubscribes it."""
    with _lock:
        if not any(h is hook for _, _, h in _close_hooks):
            _close_hooks.append((stage, next(_subscriptions), hook))
            _close_hooks.sort(key=lambda entry: entry[:2])

    def unsubscribe() -> None:
        with _lock:
            _close_hooks[:] = [entry for entry in _close_hooks if entry[2] is not hook]

    return unsubscribe


def close_hooks() -> list[CloseHook]:
    """The close hooks, in the order they run."""
    with _lock:
        return [hook for _, _, hook in _close_hooks]


# -- native calls -------------------------------------------------------------


def after_native_call(hook: Callable[[], None]) -> Callable[[], None]:
    """Run ``hook()`` after each native call of a pool with Python allocator
    functions, once no such function runs on the thread any more. It must
    be cheap when it has nothing to do, and must not raise. Returns a
    function that unsubscribes it."""
    if hook not in _after_call_hooks:
        _after_call_hooks.append(hook)

    def unsubscribe() -> None:
        if hook in _after_call_hooks:
            _after_call_hooks.remove(hook)

    return unsubscribe


def native_call_done() -> None:
    """Called by MemPool after such a call (see :func:`after_native_call`)."""
    for hook in _after_call_hooks:
        hook()


# -- interpreter exit ---------------------------------------------------------


def on_exit_leaks(leak_filter: ExitLeakFilter) -> None:
    """Let ``leak_filter(pool, blocks, nbytes)`` say how many of the blocks
    and bytes a pool still holds at exit are leaks (torch keeps freed
    blocks cached in its pools over a pool: those are none), with a note
    for the warning. It must not raise."""
    if leak_filter not in _exit_leak_filters:
        _exit_leak_filters.append(leak_filter)


def exit_leaks(pool: Any, blocks: int, nbytes: int) -> tuple[int, int, str]:
    """The blocks and bytes of ``pool`` that are leaks at exit, after every
    filter (:func:`on_exit_leaks`), and their notes."""
    notes = ""
    for leak_filter in _exit_leak_filters:
        blocks, nbytes, note = leak_filter(pool, blocks, nbytes)
        notes += note
    return blocks, nbytes, notes


def report_leaks_at_exit() -> None:
    """At interpreter exit, warn about pools that still hold allocated
    blocks. The pools are not closed: torch may still free into them while
    it shuts down, and the process is about to give everything back anyway.
    A forked child inherits this handler and the parent's pools, whose
    blocks are the parent's to report: nothing to do (nor may it enter Go).
    MemPool's module registers it with atexit."""
    if _native.forked():
        return
    for pool in open_pools():
        try:
            s = pool.stats()
        except Exception:  # a pool closed concurrently: nothing to report
            continue
        live, nbytes = s["allocation.all.current"], s["allocated_bytes.all.current"]
        # Segments torch keeps cached in gmp.mempool's torch pools are
        # allocated blocks to the engine but hold no tensor: no leak.
        live, nbytes, note = exit_leaks(pool, live, nbytes)
        if live:
            warnings.warn(
                f"gpumempool: pool {pool.name!r} ({pool.backend}) still holds {live} allocated block(s), "
                f"{nbytes} bytes, at exit{note}",
                LeakWarning,
                stacklevel=1,
            )


def python_exiting() -> None:
    """At exit, once every atexit handler registered after MemPool's
    module was imported has run (they may still close pools, whose Python
    allocator functions then run as usual), the engine stops calling Python
    allocator functions: C code such as torch may still allocate or free
    through a pool while the interpreter tears down, when their ctypes
    thunks are gone (an allocation then fails, a free is skipped).
    Registered before the leak report, so that it runs after it."""
    if not _native.forked():  # a forked child must not enter Go
        _native.bindings.PythonExiting()


# -- pool methods implemented above MemPool -----------------------------------


def provide(name: str, fn: Callable[..., Any]) -> None:
    """Make ``fn(pool, *args, **kwargs)`` the implementation of the pool
    method ``name`` (MemPool looks it up with :func:`provided`)."""
    _provided[name] = fn


def provided(name: str) -> Callable[..., Any]:
    """The implementation of the pool method ``name``. The package's
    ``__init__`` imports every module that provides one, so a missing one
    is a bug (a LookupError)."""
    try:
        return _provided[name]
    except KeyError:
        raise LookupError(f"gpumempool: no module provides MemPool.{name} (is gpumempool.torch imported?)") from None
