"""Full replacement: :func:`set_torch_allocator` makes a pool torch's CUDA
allocator for the whole process, with its hooks, the out-of-memory shim
(gpumempool.torch._oom) and torch's statistics from the pool."""

from __future__ import annotations

import ctypes
import warnings
from dataclasses import dataclass
from typing import Any, Optional

from .. import _native
from .._errors import InvalidArgumentError, PoolClosedError
from .._pool import MemPool
from . import _lanes, _oom
from ._capabilities import capabilities, cuda_index, import_torch, require_cuda
from ._errors import AllocatorInitializedError, OOMErrorFallbackWarning, TorchIntegrationError, TorchVersionError, \
    warn_python_callbacks
from ._lanes import check_open

__all__ = [
    "hook_errors",
    "reset",
    "set_torch_allocator",
    "torch_allocator_pool",
    "torch_memory_stats",
    "torch_memory_summary",
]


def hook_errors() -> list[str]:
    """The last error recorded by a call torch made into the installed pool
    (alloc, free or one of the hooks: their C signatures return nothing, so
    errors cannot propagate through torch's C++), and the last of a call
    torch made on the C functions of a pool already closed (frees of
    tensors that outlived it); returned and cleared."""
    out: list[str] = []
    if _installed is not None and not _installed.pool.closed:
        try:
            msg = _installed.pool.last_error()
        except PoolClosedError:  # closed meanwhile
            msg = None
        if msg:
            out.append(msg)
    orphan = _native.bindings.PoolTakeError(0)
    if orphan:
        out.append(orphan)
    return out


@dataclass
class _Installed:
    pool: MemPool
    allocator: Any
    hooks: tuple[str, ...]
    oom_error: str  # what torch has: "runtime" where "torch" fell back
    fell_back: bool = False  # oom_error="torch" was asked for and fell back


_installed: Optional[_Installed] = None


_OOM_ERRORS = ("runtime", "torch")


def set_torch_allocator(pool: MemPool, *, oom_error: str = "runtime") -> tuple[str, ...]:
    """Make ``pool`` torch's CUDA allocator for the whole process.

    Must be called before torch initialises CUDA (right after ``import
    torch``; torch refuses to swap an initialised allocator). Wires torch's
    hooks that its Python API exposes on the pluggable allocator
    (``empty_cache`` -> ``pool.empty_cache()``, ``record_stream`` ->
    ``pool.record_stream``, ``set_per_process_memory_fraction(f, device)``
    -> ``pool.set_limit(f * device total, device)``, init, ``base_alloc``
    (the segment holding a tensor's block), and the CUDA
    graph ones, ``begin_allocate_to_pool`` / ``end_allocate_to_pool`` /
    ``release_pool``, which give each captured graph a private pool: see
    ``pool.graph_pools()``) and returns the names of the hooks wired. Like alloc and free, the hooks are C functions
    exported by the extension (``pool.pluggable_hooks()``): torch calls
    them without the GIL. Their errors: :func:`hook_errors`. Calling it
    again with the same pool does nothing.

    Out of memory: torch's pluggable allocator does not check the pointer it
    gets, so the alloc function installed is the C++ entry point that throws
    when the pool cannot serve a request (after releasing its cache and
    retrying). Its message is worded like torch's own ("CUDA out of memory.
    Tried to allocate 64.00 MiB on device 0. gpumempool: <the pool's
    reason>", which is what Lightning's and Accelerate's batch-size finders
    look for). ``oom_error`` says which exception that is:

    ``"runtime"`` (the default)
        ``std::runtime_error``: Python gets a ``RuntimeError``. Needs nothing.
    ``"torch"``
        ``c10::OutOfMemoryError``: Python gets ``torch.OutOfMemoryError``
        (a ``RuntimeError`` too), and torch's C++ code that retries with less
        memory when it catches that type (cuDNN's workspace fallbacks) gets
        its chance. The type lives in libc10's C++ ABI, so this compiles a
        small shim (``gpumempool/csrc/torch_oom.cpp``) against the running torch's
        headers with the C++ compiler (``$CXX``, else c++/g++/clang++), about
        a second, once per torch and compiler: the library is cached in
        ``$GMP_CACHE_DIR`` (default ``~/.cache/gpumempool``) when nobody but
        the user or root can write there, else in ``<tmp>/gpumempool-<uid>``.
        Where the shim cannot be built (no C++ compiler, as on a machine
        with only Python and pip, or a torch without its headers), one
        :class:`OOMErrorFallbackWarning` says why and the pool is installed
        as with ``"runtime"``.

    Other failures read "gpumempool: cannot allocate N bytes on device D:
    ..." (a ``RuntimeError`` either way).
    """
    global _installed
    if not isinstance(pool, MemPool):
        raise TypeError(f"pool must be a gpumempool.MemPool, got {type(pool).__name__}")
    if oom_error not in _OOM_ERRORS:
        raise InvalidArgumentError(f"oom_error must be one of {', '.join(map(repr, _OOM_ERRORS))}, got {oom_error!r}")
    torch = import_torch()
    caps = capabilities(torch)
    require_cuda(caps)
    if not caps.pluggable:
        raise TorchVersionError(f"torch {caps.version} has no CUDAPluggableAllocator/change_current_allocator")
    with _lanes.lock:
        if _installed is not None:
            if _installed.pool is pool and (
                _installed.oom_error == oom_error or (oom_error == "torch" and _installed.fell_back)
            ):
                check_open(pool)
                return _installed.hooks
            if _installed.pool is pool:
                raise AllocatorInitializedError(
                    f"pool {pool.name!r} is torch's allocator already, installed with oom_error="
                    f"{_installed.oom_error!r}; torch cannot swap its allocator twice in one process"
                )
            raise AllocatorInitializedError(
                f"torch's CUDA allocator was already replaced by pool {_installed.pool.name!r}; "
                "torch cannot swap its allocator twice in one process"
            )
        check_open(pool)
        warn_python_callbacks(pool, "gmp.set_torch_allocator")
        if torch.cuda.is_initialized():
            raise AllocatorInitializedError(
                "gmp.set_torch_allocator(pool) must be called before torch initialises CUDA, and "
                "torch.cuda.is_initialized() is already True (a CUDA tensor, stream, torch.cuda.init() or "
                "similar came first). Call it right after `import torch`, or in a fresh process."
            )
        # Torch's pluggable allocator uses the pointer without a NULL check:
        # the C++ alloc entry point throws instead (a RuntimeError in Python).
        path, alloc_sym, free_sym = pool.pluggable_symbols(throw_on_oom=True)
        alloc_path = path
        installed_as, fell_back = oom_error, False
        if oom_error == "torch":
            try:
                alloc_path, alloc_sym, free_sym = _oom.install(torch, path, alloc_sym, free_sym)
            except _oom.ShimBuildError as exc:
                # No compiler, no headers, no usable cache: what "runtime"
                # gives is the next best thing, and the job can still run.
                warnings.warn(
                    f"gmp.set_torch_allocator(oom_error='torch'): {exc}. Falling back to oom_error='runtime': "
                    "out of memory raises a RuntimeError worded like torch's ('CUDA out of memory. Tried to "
                    "allocate ...'), not torch.OutOfMemoryError",
                    OOMErrorFallbackWarning,
                    stacklevel=2,
                )
                installed_as, fell_back = "runtime", True
        cpa = torch.cuda.memory.CUDAPluggableAllocator(alloc_path, alloc_sym, free_sym)
        raw = cpa.allocator()
        lib = ctypes.CDLL(path)  # the library already loaded: same handle
        wired: list[str] = []
        for setter, sym in sorted(pool.pluggable_hooks().items()):
            if hasattr(raw, setter):
                getattr(raw, setter)(ctypes.cast(getattr(lib, sym), ctypes.c_void_p).value)
                wired.append(setter[len("set_"):].removesuffix("_fn"))
        try:
            torch.cuda.memory.change_current_allocator(cpa)
        except RuntimeError as exc:
            if "initialized" in str(exc):
                raise AllocatorInitializedError(
                    f"torch refused to swap its CUDA allocator ({exc}): call gmp.set_torch_allocator(pool) "
                    "before anything initialises CUDA, in a fresh process"
                ) from exc
            raise
        _installed = _Installed(pool, cpa, tuple(wired), installed_as, fell_back)
        return _installed.hooks


def torch_allocator_pool() -> Optional[MemPool]:
    """The pool installed with :func:`set_torch_allocator`, or None."""
    return None if _installed is None else _installed.pool


_ALL_DEVICES = "all"


def _stats_device(device: Any) -> Optional[int]:
    """torch.cuda.memory_stats()'s device argument: None, "cuda" and
    torch.device("cuda") are the current device; ``"all"`` sums the devices."""
    if isinstance(device, str) and device == _ALL_DEVICES:
        return None
    return cuda_index(import_torch(), device)


def torch_memory_stats(device: Any = None) -> dict[str, int]:
    """``torch.cuda.memory_stats(device)`` for the pool installed with
    :func:`set_torch_allocator` (torch's own stops working in that mode):
    its key names, from ``pool.stats``. ``device`` as torch takes it: None,
    "cuda" or ``torch.device("cuda")`` mean the current device, "cuda:N",
    N or ``torch.device("cuda", N)`` device N; ``"all"`` sums over every
    device (peaks are then summed per-device peaks)."""
    if _installed is None:
        raise TorchIntegrationError(
            "no pool is torch's allocator (gmp.set_torch_allocator was not called); use torch.cuda.memory_stats()"
        )
    return _installed.pool.stats(_stats_device(device))


def torch_memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    """``torch.cuda.memory_summary(device)`` for the pool installed with
    :func:`set_torch_allocator` (torch's own stops working in that mode);
    ``device`` as in :func:`torch_memory_stats` (the current device by
    default, ``"all"`` for every device)."""
    if _installed is None:
        raise TorchIntegrationError(
            "no pool is torch's allocator (gmp.set_torch_allocator was not called); use torch.cuda.memory_summary()"
        )
    return _installed.pool.memory_summary(_stats_device(device), abbreviated=abbreviated)



def reset() -> None:
    """Forget the installed allocator (tests)."""
    global _installed
    _installed = None
