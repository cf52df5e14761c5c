"""User allocator functions for the ``callback`` backend.

A pool's segments can come from functions with torch's pluggable-allocator
signatures::

    void* alloc(size_t size, int device, void* stream);
    void  free(void* ptr, size_t size, int device, void* stream);

given as a C function address (``int``), a ctypes function (from a CDLL or a
CFUNCTYPE), or a Python callable. Python callables are the slow path: the
engine calls them through a ctypes trampoline, which takes the GIL on every
call. Inside torch's allocator (``mempool()`` or ``set_torch_allocator``)
that can deadlock: torch holds its allocator lock while calling us, and a
Python thread that holds the GIL and waits for that lock never lets the
callback run. Prefer native functions there.

A Python function must not call into its own pool (``pool.stats()``,
``pool.free()``, ...): the engine holds the pool's lock while it calls the
function. Such a call raises :class:`CallbackReentryError` instead of
waiting forever.

A ctypes function that wraps a Python function (``ALLOC_FN(pyfunc)``) is
treated as that Python function: called through ctypes itself, an exception
it raised would only be printed, and the pool would get whatever value
ctypes made up as the result.

This module also holds the rules of a pool call while such functions may
run (:func:`call_collecting`, :func:`settle_alloc`): which of their
exceptions belong to the call, how they are raised or reported, and the
refusal of a call from inside one of them.
"""

from __future__ import annotations

import ctypes
import gc
import inspect
import sys
import threading
import warnings
from typing import Any, Callable, NoReturn, Optional, TypeVar, Union

from . import _lifecycle
from ._errors import BackendError, CallbackReentryError, translate

__all__ = ["ALLOC_FN", "FREE_FN", "AllocatorFunction", "CallbackErrors", "call_collecting", "callback_failure",
           "describe_exc", "drop_refs", "function_address", "has_python_functions", "keep_refs", "raise_failure",
           "raise_interrupt", "refuse_reentry", "runs_python_function", "settle_alloc", "with_orphans"]

T = TypeVar("T")
#: The exceptions a pool's Python functions raised during one call, as
#: ``(kind, exception)`` pairs, kind ``"alloc"`` or ``"free"``.
Errors = list[tuple[str, BaseException]]

#: ctypes prototype of an alloc function.
ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
#: ctypes prototype of a free function.
FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)

#: What MemPool(alloc=..., free=...) takes: an address, a ctypes function
#: (ctypes' function pointer base class is private, hence Any), or a callable.
AllocatorFunction = Union[int, Callable[..., Any], Any]


class CallbackErrors:
    """Exceptions raised inside Python callbacks, attributed to the pool
    method that triggered them.

    The engine calls a callback on the thread that called into it (it starts
    no threads of its own), so a pool method brackets its native call with
    :meth:`begin` / :meth:`end`, and the exceptions raised in between, on
    that thread, are that call's. Exceptions raised while no pool method is
    running on the thread (torch calling the C ABI) are *orphans*: kept (at
    most :attr:`MAX_ORPHANS`) for :meth:`take_orphans`, never raised from
    another call."""

    MAX_ORPHANS = 16

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: Per thread: ``calls`` (see :meth:`begin`) and ``depth``, how many
        #: of the pool's Python functions are running on the thread (the
        #: engine holds the pool's lock meanwhile: see :meth:`inside`).
        self._tls = _CallbackState()
        self._orphans: list[BaseException] = []
        self.dropped = 0

    def begin(self) -> list[tuple[str, BaseException]]:
        """Start collecting this thread's callback exceptions as ``(kind,
        exception)`` pairs, kind ``"alloc"`` or ``"free"`` (nests)."""
        calls = self._tls.__dict__.setdefault("calls", [])
        errs: list[tuple[str, BaseException]] = []
        calls.append(errs)
        return errs

    def end(self, errs: list[tuple[str, BaseException]]) -> None:
        """Stop collecting into ``errs`` (from :meth:`begin`)."""
        calls = self._tls.__dict__.get("calls")
        if calls and calls[-1] is errs:
            calls.pop()
        elif calls and errs in calls:
            calls.remove(errs)

    def add(self, exc: BaseException, kind: str = "alloc") -> None:
        calls = self._tls.__dict__.get("calls")
        if calls:
            calls[-1].append((kind, exc))
            return
        with self._lock:
            if len(self._orphans) < self.MAX_ORPHANS:
                self._orphans.append(exc)
            else:
                self.dropped += 1

    def take_orphans(self) -> list[BaseException]:
        """The exceptions raised outside any pool method (cleared)."""
        with self._lock:
            errs, self._orphans = self._orphans, []
        return errs

    take = take_orphans

    def inside(self) -> bool:
        """Whether one of the pool's Python functions is running on this
        thread (the pool must not be called: its lock is held)."""
        return self._tls.depth > 0

    def renew_lock_after_fork(self) -> None:
        """In a forked child: a new lock, as another thread may have held
        this one at the fork."""
        self._lock = threading.Lock()


class _CallbackState(threading.local):
    depth = 0  # class default: a thread that never ran a callback reads 0


def _positional_arity(fn: Callable[..., Any], full: int) -> int:
    """How many of the torch arguments fn takes: callables written for a
    one-argument allocator API (like ncclMemAlloc / ncclMemFree) take just
    ``size`` (alloc) or ``ptr`` (free)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return full
    n = 0
    for p in params:
        if p.kind is p.VAR_POSITIONAL:
            return full
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            n += 1
    return min(max(n, 1), full)


def _bad_result(exc: Exception) -> Exception:
    """Mark ``exc`` as the alloc function's bad return value, not something
    it raised (the pool's error says "returned", not "raised")."""
    exc.gmp_bad_result = True  # type: ignore[attr-defined]
    return exc


def _as_int_pointer(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, ctypes.c_void_p):
        return value.value or 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad_result(TypeError(f"alloc function returned a {type(value).__name__}, not an int address"))
    if not 0 <= value < 1 << 64:
        shown = str(value) if value.bit_length() <= 128 else f"an int of {value.bit_length()} bits"
        raise _bad_result(ValueError(f"alloc function returned {shown}, not a 64-bit address"))
    return value


def _in_executable_mapping(addr: int) -> Optional[bool]:
    """Whether ``addr`` lies in an executable mapping of this process, read
    from Linux's /proc/self/maps (afresh: libraries come and go); None
    where that cannot be told (another OS, no /proc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
            for line in f:
                span, perms = line.split(None, 2)[:2]
                lo, _, hi = span.partition("-")
                if int(lo, 16) <= addr < int(hi, 16):
                    return "x" in perms
    except (OSError, ValueError):
        return None
    return False


def _check_code_address(addr: int, kind: str) -> None:
    """Refuse an address that cannot be a C function: the engine would call
    it on the first allocation and the process would die (SIGSEGV)."""
    if _in_executable_mapping(addr) is False:
        raise ValueError(f"{kind} address {addr:#x} is not a C function: it lies in no executable mapping "
                         "of this process (pass a ctypes function, or its address from a loaded library)")


def function_address(fn: AllocatorFunction, kind: str, errors: CallbackErrors) -> tuple[int, Any, bool]:
    """Return (C address, object to keep alive, whether it runs Python code
    whose exceptions land in ``errors``) for an alloc or free function."""
    if isinstance(fn, bool):
        raise TypeError(f"{kind} must be a function or a C function address, not bool")
    if isinstance(fn, int):
        if not 0 < fn < 1 << 64:
            raise ValueError(f"{kind} address {fn:#x} is not a valid C function pointer")
        _check_code_address(fn, kind)
        return fn, None, False
    if isinstance(fn, ctypes._CFuncPtr):  # type: ignore[attr-defined]
        wrapped = _python_callable_of(fn, kind)
        if wrapped is None:  # a C function: from a library, or made from an address
            addr = ctypes.cast(fn, ctypes.c_void_p).value
            if not addr:
                raise ValueError(f"{kind} is a NULL ctypes function pointer")
            _check_code_address(addr, kind)
            return addr, fn, False
        fn = wrapped  # ALLOC_FN(pyfunc): the Python function, through our trampoline
    if not callable(fn):
        raise TypeError(f"{kind} must be callable or a C function address, got {type(fn).__name__}")
    state = errors._tls
    if kind == "alloc":
        arity = _positional_arity(fn, 3)

        def alloc_trampoline(size: int, device: int, stream: int | None) -> int | None:
            state.depth += 1
            try:
                return _as_int_pointer(fn(*(size, device, stream or 0)[:arity])) or None
            except BaseException as exc:  # must not unwind into Go
                errors.add(exc, "alloc")
                return None
            finally:
                state.depth -= 1

        cfn = ALLOC_FN(alloc_trampoline)
    else:
        arity = _positional_arity(fn, 4)

        def free_trampoline(ptr: int | None, size: int, device: int, stream: int | None) -> None:
            state.depth += 1
            try:
                fn(*(ptr or 0, size, device, stream or 0)[:arity])
            except BaseException as exc:
                errors.add(exc, "free")
            finally:
                state.depth -= 1

        cfn = FREE_FN(free_trampoline)
    return ctypes.cast(cfn, ctypes.c_void_p).value or 0, cfn, True


def _is_thunk(obj: Any) -> bool:
    """Whether obj is ctypes' CThunkObject: the C entry point ctypes made for
    a Python function (``CFUNCTYPE(...)(pyfunc)``). Functions from a library
    or made from an address keep none."""
    t = type(obj)
    return t.__name__ == "CThunkObject" and t.__module__ == "_ctypes"


def _python_callable_of(fn: Any, kind: str) -> Optional[Callable[..., Any]]:
    """The Python function a ctypes function object runs, or None when it
    runs C code.

    ctypes keeps the CThunkObject of ``PROTO(pyfunc)`` in the function's
    ``_objects`` (under ``"0"``; a ``ctypes.cast`` of it shares that dict),
    and the thunk references the Python callable (CPython 3.6-3.13: the
    thunk's GC referents are its argument converters, the callable, the
    result type and, from 3.12, its own type). Raises TypeError when a thunk
    is found but its callable cannot be told apart."""
    thunks: list[Any] = []
    seen: set[int] = set()
    stack: list[Any] = [fn]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if _is_thunk(obj):
            thunks.append(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, ctypes._CFuncPtr):  # type: ignore[attr-defined]
            if obj._objects is not None:
                stack.append(obj._objects)
    if not thunks:
        return None
    found = {id(c): c for t in thunks for c in gc.get_referents(t) if callable(c) and not isinstance(c, type)}
    if len(found) != 1:
        raise TypeError(
            f"{kind} is a ctypes function that wraps Python code whose Python function cannot be "
            "recovered; pass the Python function itself"
        )
    return next(iter(found.values()))


#: Native handle -> the objects a callback pool's C function pointers need
#: (ctypes trampolines of Python callables, ctypes function objects). They
#: live as long as the native pool, not as the MemPool object: a pool that
#: is dropped without close() stays open in the engine (its C symbols may
#: still be called, e.g. by torch), so its callbacks must stay callable.
#: close() drops the entry.
_callback_refs: dict[int, tuple[Any, ...]] = {}


def keep_refs(handle: int, objs: tuple[Any, ...]) -> None:
    """Keep ``objs`` alive as long as the native pool ``handle``."""
    _callback_refs[handle] = objs


def drop_refs(handle: int) -> None:
    """The native pool ``handle`` is closed: its functions may go."""
    _callback_refs.pop(handle, None)


def runs_python_function(pool: Any) -> bool:
    """Whether one of ``pool``'s (a MemPool's) Python allocator functions is running on
    this thread: the engine holds the pool's lock meanwhile, so the pool
    must not be called (gpumempool.scope defers a finalizer's free then)."""
    errors: Optional[CallbackErrors] = getattr(pool, "_callback_errors", None)  # None: __init__ failed early
    return errors is not None and errors.inside()


def has_python_functions(pool: Any) -> bool:
    """Whether ``pool``'s alloc/free functions are Python code (they need
    the GIL: gpumempool.torch warns before torch calls them)."""
    return bool(getattr(pool, "_py_callbacks", False))


def describe_exc(exc: BaseException, limit: int = 200) -> str:
    """``TypeName: message`` of a callback's exception, bounded."""
    try:
        text = str(exc)
    except Exception:  # a broken __str__
        text = "<unprintable>"
    if len(text) > limit:
        text = text[:limit] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def with_orphans(msg: Optional[str], errors: CallbackErrors) -> Optional[str]:
    """A pool's last C-ABI error ``msg`` (None when none) with the
    exceptions its Python functions raised outside any pool method
    (:meth:`CallbackErrors.take_orphans`) appended."""
    orphans = errors.take_orphans()
    if orphans:
        raised = "; ".join(describe_exc(e) for e in orphans)
        msg = f"{msg} (a Python allocator function raised {raised})" if msg else \
            f"a Python allocator function raised {raised}"
    return msg


def callback_failure(kind: str, exc: BaseException) -> str:
    """What a pool's Python ``kind`` function did wrong: raised ``exc``, or
    returned a value that is no address (the trampoline's error)."""
    if getattr(exc, "gmp_bad_result", False):
        return f"the Python {exc}"  # "alloc function returned ..., not a 64-bit address"
    return f"the Python {kind} function raised {describe_exc(exc)}"


def raise_interrupt(errs: Errors) -> None:
    """Raise the first KeyboardInterrupt, SystemExit (any exception that is
    no Exception) a Python allocator function raised during a call: the
    engine took it for a failure of the function, but the program must
    still be interrupted, not get a BackendError or a warning."""
    for _, exc in errs:
        if not isinstance(exc, Exception):
            raise exc


def raise_failure(errs: Errors) -> NoReturn:
    """Raise the failure of a call that succeeded in the engine while a
    Python function failed (``errs`` not empty): an interrupt as itself,
    else a BackendError chained to the first exception."""
    raise_interrupt(errs)
    kind, first = errs[0]
    raise BackendError(callback_failure(kind, first)) from first


def refuse_reentry(label: str) -> NoReturn:
    """Refuse a call of pool ``label`` from inside one of its own Python
    allocator functions."""
    raise CallbackReentryError(
        f"pool {label!r} was called from inside its own Python allocator function; the engine holds the "
        "pool's lock while it runs the function, so allocator functions must not call into their own pool",
        pool=label,
    )


def call_collecting(errors: CallbackErrors, label: Callable[[], str],
                    explain: Callable[[str, BaseException, BaseException], str],
                    fn: Callable[..., T], *args: Any) -> tuple[T, Errors]:
    """Call ``fn`` and return its result with the exceptions the pool's
    Python callbacks raised during the call, on this thread (see
    :class:`CallbackErrors`); a native error is raised, chained to the
    first of them, its message from ``explain(kind, exception, error)``.
    Every call of a pool with Python callbacks comes here: called from one
    of those callbacks (the engine holds the pool's lock), it raises
    CallbackReentryError (naming the pool ``label()``) instead of
    deadlocking."""
    if errors.inside():
        refuse_reentry(label())
    errs = errors.begin()
    try:
        result = fn(*args)
    except RuntimeError as exc:
        err = translate(exc)
        if errs:
            raise_interrupt(errs)
            kind, first = errs[0]
            raise BackendError(explain(kind, first, err)) from first
        raise err from None
    finally:
        errors.end(errs)
        if not errors.inside():
            _lifecycle.native_call_done()
    return result, errs


def settle_alloc(errs: Errors, ptr: int, name: Callable[[], str], free_quietly: Callable[[int], None]) -> None:
    """After an allocation that succeeded while Python functions failed
    (``errs``), on a pool called ``name()``: the engine dealt with the
    failures (an alloc function's error reads as out of memory: the pool
    released its cache and retried; a free function's error cannot be
    undone), so the block at ``ptr`` stays the caller's and the exceptions
    are reported as warnings, not raised, which would leak the block. An
    interrupt is raised, and so is a warning turned into an error, once
    the block is given back (``free_quietly``)."""
    if any(not isinstance(e, Exception) for _, e in errs):
        free_quietly(ptr)  # the caller is being interrupted: it will never free the block
        raise_interrupt(errs)
    try:
        for kind, exc in errs:
            warnings.warn(
                f"pool {name()}: {callback_failure(kind, exc)}"
                + ("; the pool released its cache and retried, and the allocation succeeded"
                   if kind == "alloc" else "while the pool released cached segments"),
                RuntimeWarning,
                stacklevel=4,  # settle_alloc, the pool's alloc helper, MemPool.alloc, its caller
            )
    except BaseException:  # warnings turned into errors: give the block back first
        free_quietly(ptr)
        raise
