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
"""

from __future__ import annotations

import ctypes
import inspect
import threading
from typing import Any, Callable, Union

__all__ = ["ALLOC_FN", "FREE_FN", "AllocatorFunction", "CallbackErrors", "function_address"]

#: ctypes prototype of an alloc function.
ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
#: ctypes prototype of a free function.
FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)

#: What MemPool(alloc=..., free=...) takes: an address, a ctypes function
#: (ctypes' function pointer base class is private, hence Any), or a callable.
AllocatorFunction = Union[int, Callable[..., Any], Any]


class CallbackErrors:
    """Exceptions raised inside Python callbacks, kept until the pool
    method that triggered them can re-raise them in the caller's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._errors: list[BaseException] = []

    def add(self, exc: BaseException) -> None:
        with self._lock:
            self._errors.append(exc)

    def take(self) -> list[BaseException]:
        with self._lock:
            errs, self._errors = self._errors, []
        return errs


def _positional_arity(fn: Callable[..., Any], full: int) -> int:
    """How many of the torch arguments fn takes: seed-001 style callables
    take just ``size`` (alloc) or ``ptr`` (free)."""
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


def _as_int_pointer(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, ctypes.c_void_p):
        return value.value or 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"allocator callback must return an int address, got {type(value).__name__}")
    if not 0 <= value < 1 << 64:
        raise ValueError(f"allocator callback returned {value}, not a 64-bit address")
    return value


def function_address(fn: AllocatorFunction, kind: str, errors: CallbackErrors) -> tuple[int, Any, bool]:
    """Return (C address, object to keep alive, whether it runs Python code
    whose exceptions land in ``errors``) for an alloc or free function."""
    if isinstance(fn, bool):
        raise TypeError(f"{kind} must be a function or a C function address, not bool")
    if isinstance(fn, int):
        if not 0 < fn < 1 << 64:
            raise ValueError(f"{kind} address {fn:#x} is not a valid C function pointer")
        return fn, None, False
    if isinstance(fn, ctypes._CFuncPtr):  # type: ignore[attr-defined]
        addr = ctypes.cast(fn, ctypes.c_void_p).value
        if not addr:
            raise ValueError(f"{kind} is a NULL ctypes function pointer")
        return addr, fn, False
    if not callable(fn):
        raise TypeError(f"{kind} must be callable or a C function address, got {type(fn).__name__}")
    if kind == "alloc":
        arity = _positional_arity(fn, 3)

        def alloc_trampoline(size: int, device: int, stream: int | None) -> int | None:
            try:
                return _as_int_pointer(fn(*(size, device, stream or 0)[:arity])) or None
            except BaseException as exc:  # must not unwind into Go
                errors.add(exc)
                return None

        cfn = ALLOC_FN(alloc_trampoline)
    else:
        arity = _positional_arity(fn, 4)

        def free_trampoline(ptr: int | None, size: int, device: int, stream: int | None) -> None:
            try:
                fn(*(ptr or 0, size, device, stream or 0)[:arity])
            except BaseException as exc:
                errors.add(exc)

        cfn = FREE_FN(free_trampoline)
    return ctypes.cast(cfn, ctypes.c_void_p).value or 0, cfn, True
