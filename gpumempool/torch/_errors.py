"""The PyTorch integration's exceptions and warnings (all importable from
gpumempool.torch), and the one warning every entry point gives about pools
whose allocator functions are Python code."""

from __future__ import annotations

import warnings
import weakref

from .._errors import GpuMemPoolError
from .._callbacks import has_python_functions
from .._pool import MemPool

__all__ = [
    "AllocatorInitializedError",
    "OOMErrorFallbackWarning",
    "PoolInUseError",
    "ProcessWideRoutingWarning",
    "PythonCallbackWarning",
    "RetainedTorchPoolWarning",
    "RoutingConflictWarning",
    "TorchIntegrationError",
    "TorchVersionError",
    "TorchVersionWarning",
    "warn_python_callbacks",
]


class OOMErrorFallbackWarning(RuntimeWarning):
    """``set_torch_allocator(pool, oom_error="torch")`` could not build its
    shim (the message says why) and installed the pool with
    ``oom_error="runtime"``: out of memory is a ``RuntimeError`` worded like
    torch's."""


class TorchIntegrationError(GpuMemPoolError, RuntimeError):
    """The PyTorch integration cannot do what was asked."""


class TorchVersionError(TorchIntegrationError):
    """torch is missing, too old for the feature, or not a CUDA build:
    ``version`` is the torch found (None when there is none), ``needed``
    what the feature needs."""

    def __init__(self, message: str, *, version: "str | None" = None, needed: "str | None" = None) -> None:
        super().__init__(message)
        self.version = version
        self.needed = needed


class TorchVersionWarning(UserWarning):
    """The installed torch is outside the versions gpumempool was tested
    with (:data:`gpumempool.torch.TESTED_TORCH`): given once, at its first
    use."""


class AllocatorInitializedError(TorchIntegrationError):
    """torch's CUDA allocator was initialised (or replaced) already."""


class PoolInUseError(TorchIntegrationError):
    """Tensors from the pool are alive, or a thread is inside ``mempool``."""


class ProcessWideRoutingWarning(UserWarning):
    """This torch routes every thread's allocations to an entered pool."""


class RetainedTorchPoolWarning(UserWarning):
    """A torch pool holds segments another thread allocated with cudaMalloc
    (autograd's backward, on torch 2.5-2.7, whose allocator comes from a
    thread-local MemPoolContext): torch's MemPool destructor would free them
    through the pool's free function, which throws from the destructor and
    aborts the process. So that torch pool is never destroyed: it is kept
    for the life of the process with its segments, and the next
    ``mempool(pool)`` gets a new one."""


class RoutingConflictWarning(UserWarning):
    """A ``mempool(..., all_threads=True)`` context and another thread's own
    ``mempool`` context route the same device at once: torch sends that
    thread's allocations to whichever of the two routes it checks first."""


class PythonCallbackWarning(RuntimeWarning):
    """A pool whose alloc/free are Python functions is used by torch: under
    ``gmp.mempool`` torch's caching allocator calls them holding its lock,
    and they need the GIL, which a thread freeing a tensor holds while it
    waits for that lock. (In full-replacement mode torch calls them outside
    its lock, but from threads that hold no GIL, such as autograd's.)"""


_warned_py_callbacks: "weakref.WeakSet[MemPool]" = weakref.WeakSet()


def warn_python_callbacks(pool: MemPool, where: str) -> None:
    """Once per pool: torch + Python allocator functions can deadlock."""
    if not has_python_functions(pool) or pool in _warned_py_callbacks:
        return
    _warned_py_callbacks.add(pool)
    warnings.warn(
        f"pool {pool.name!r} allocates with Python functions and {where} makes torch call them while it "
        "holds its allocator lock; they need the GIL, and a thread that holds the GIL while freeing a "
        "tensor waits for that lock: a deadlock. Pass C functions (ctypes, or an address) as alloc/free "
        "for pools torch uses.",
        PythonCallbackWarning,
        stacklevel=3,
    )
