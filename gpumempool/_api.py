"""The public API, re-exported by gpumempool/__init__.py."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

from . import _native
from ._callbacks import ALLOC_FN, FREE_FN
from ._errors import (
    BackendError,
    CallbackReentryError,
    DoubleFreeError,
    ForkedProcessError,
    GpuMemPoolError,
    InvalidArgumentError,
    InvalidPointerError,
    LeakWarning,
    OutOfMemoryError,
    PoolClosedError,
)
from ._backends import BACKENDS
from ._pool import CloseReport, LiveBlock, MemPool
from . import cupy as cupy  # noqa: F401  (gmp.cupy: CuPy from a pool; imports CuPy lazily)
from . import distributed as distributed  # noqa: F401  (gmp.distributed: ranks' memory; imports torch lazily)
from .scope import cache_scope, invalidate
from .torch import mempool, set_torch_allocator, torch_memory_stats, torch_memory_summary  # imports torch lazily
from ._snapshot import dump_snapshot, record_history, snapshot
from .ipc import ImportedMemory, IpcHandle, import_pool
from .replay import ReplayResult
if TYPE_CHECKING:
    from .replay import replay
else:
    # The submodule itself, which is callable as the function: the package
    # attribute gpumempool.replay must be the module for
    # `import gpumempool.replay as r` to give the module.
    replay = sys.modules[f"{__package__}.replay"]
from .trace import Trace, TraceRecorder, from_history, from_torch_snapshot, load_trace
from .tune import Candidate, TuneResult
if TYPE_CHECKING:
    from .tune import tune
else:
    tune = sys.modules[f"{__package__}.tune"]  # callable as the function, as replay is

__all__ = [
    "ALLOC_FN",
    "FREE_FN",
    "BackendError",
    "CallbackReentryError",
    "CloseReport",
    "DoubleFreeError",
    "ForkedProcessError",
    "GpuMemPoolError",
    "ImportedMemory",
    "IpcHandle",
    "InvalidArgumentError",
    "InvalidPointerError",
    "LeakWarning",
    "LiveBlock",
    "MemPool",
    "OutOfMemoryError",
    "PoolClosedError",
    "__version__",
    "backend_options",
    "backends",
    "cache_scope",
    "device_info",
    "devices",
    "dump_snapshot",
    "import_pool",
    "invalidate",
    "library_path",
    "mempool",
    "pools",
    "record_history",
    "set_torch_allocator",
    "snapshot",
    "torch_memory_stats",
    "torch_memory_summary",
    "ReplayResult",
    "Trace",
    "TraceRecorder",
    "from_history",
    "from_torch_snapshot",
    "load_trace",
    "replay",
    "Candidate",
    "TuneResult",
    "tune",
]

__version__: str = _native.bindings.Version()


def library_path() -> str:
    """Path of the shared library holding the engine and its C ABI."""
    return _native.library_path()


def backends() -> list[str]:
    """Names of the backends this build provides."""
    return _native.bindings.Backends().split(",")


def backend_options(backend: str) -> list[dict[str, Any]]:
    """The options ``MemPool(backend, ...)`` takes, from the engine's
    registry, which declares each once: for each its ``name``, ``type``
    (``bool``, ``int``, ``path``, ``string``, ``device``, ``devices``,
    ``probability``), ``min``/``max`` for an int, the ``default`` where it
    needs words, and ``doc``."""
    if backend not in BACKENDS:
        raise InvalidArgumentError(f"unknown backend {backend!r}; valid backends: {', '.join(sorted(BACKENDS))}")
    return [dict(f) for f in BACKENDS[backend]["options"]]


def device_info() -> dict[str, Any]:
    """NVIDIA devices seen by NVML: ``{"devices": [...], "reason": str}``.
    Without a driver the list is empty and ``reason`` says why; a device
    NVML cannot open (hidden by cgroup device limits, or lost) is left out
    of the list and named in ``reason`` (``index`` keeps NVML's numbering)."""
    return json.loads(_native.bindings.Devices())


def devices() -> list[dict[str, Any]]:
    """NVIDIA devices (name, uuid, total/free/used bytes, numa_node, compute
    capability); an empty list on a machine without a driver.

    ``numa_node`` is the GPU's own NUMA node (NVML's
    ``nvmlDeviceGetNumaNodeId``): on systems whose GPU memory is a NUMA node
    of the host (Grace Hopper / Grace Blackwell), that node. It is not the
    host NUMA node nearest to a PCIe GPU: there, and with drivers older than
    that NVML function, it is -1."""
    return device_info()["devices"]


def pools() -> list[dict[str, Any]]:
    """The open pools of this process: handle, name and backend."""
    return json.loads(_native.bindings.ListPools())
