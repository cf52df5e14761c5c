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

The library is opened with ``RTLD_LAZY``: it holds cgo references to NVML
functions that only resolve after the engine dlopens libnvidia-ml, so the
``RTLD_NOW`` that CPython uses for extensions would refuse to load it (on
machines without a GPU, too). The flags are otherwise left as CPython's
default (``RTLD_LOCAL``) and restored right after the import.
"""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["bindings", "fastcall", "library_path"]

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))


def _not_built_message() -> str:
    return (
        "gpumempool's native extension is not built: there is no "
        f"gpumempool._core package in {_PKG_DIR}. Build and install it with "
        "`pip install .` (or `pip install -e .` for development) from the "
        "gpumempool source tree; building needs Go >= 1.23 and a C compiler. "
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
    return bindings, os.path.abspath(_gmpcore.__file__)


bindings, _LIBRARY_PATH = _load()


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
