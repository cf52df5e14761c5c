"""What the running torch offers: feature detection (:func:`capabilities`),
torch imported on demand, and CUDA device arguments as torch takes them."""

from __future__ import annotations

import importlib
import inspect
import re
import warnings
from dataclasses import dataclass
from typing import Any, Optional

from .._errors import InvalidArgumentError
from ._errors import TorchVersionError, TorchVersionWarning

__all__ = [
    "TorchCapabilities",
    "capabilities",
    "caps_cache",
    "cuda_index",
    "import_torch",
    "mem_pool_class",
    "require_cuda",
    "require_mem_pool",
    "require_pool_release",
    "tested_range",
    "TESTED_TORCH",
    "use_mem_pool_fn",
    "version_tuple",
]


def import_torch() -> Any:
    """The torch module; TorchVersionError saying what to install when there is none."""
    try:
        return importlib.import_module("torch")
    except ImportError as exc:
        raise TorchVersionError(
            "gpumempool's PyTorch integration needs torch >= 2.5 (pip install 'gpumempool[torch]')"
        ) from exc


#: The torch releases (major, minor) gpumempool's integration was tested
#: with, oldest and newest (benchmarks/results/torch_versions.md; the
#: ``torch`` extra of pyproject.toml says the same).
TESTED_TORCH: tuple[tuple[int, int], tuple[int, int]] = ((2, 5), (2, 15))


def tested_range() -> str:
    """``"2.5-2.15"``: :data:`TESTED_TORCH` in words."""
    (a, b), (c, d) = TESTED_TORCH
    return f"{a}.{b}-{c}.{d}"


def version_tuple(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string; (0, 0) when it has none."""
    m = re.match(r"\s*(\d+)\.(\d+)", str(version))
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


@dataclass(frozen=True)
class TorchCapabilities:
    """What the running torch offers to this module (see :func:`capabilities`)."""

    version: str
    #: torch.cuda.MemPool exists (torch >= 2.5)
    mem_pool: bool
    #: torch.cuda.use_mem_pool exists (we enter pools with it)
    use_mem_pool: bool
    #: names of the private torch._C calls used when use_mem_pool is missing
    begin_fn: Optional[str]
    end_fn: Optional[str]
    #: routing affects only the entering thread (torch >= 2.8)
    thread_local_routing: bool
    #: MemPoolContext picks the allocator (torch 2.5-2.7)
    pool_context: bool
    #: keyword options of torch.cuda.MemPool besides ``allocator``
    mem_pool_options: tuple[str, ...]
    #: torch.cuda.MemPool.snapshot() exists
    pool_snapshot: bool
    #: torch.cuda.memory.CUDAPluggableAllocator and change_current_allocator
    pluggable: bool
    #: ProcessGroupNCCL.register_mem_pool registers segments added later (>= 2.8, by version)
    nccl_registers_new_segments: bool
    #: hooks the pluggable allocator takes besides alloc/free (its set_* methods, "set_" and "_fn" cut)
    pluggable_hooks: tuple[str, ...] = ()
    #: the build: "cuda", "cpu" (torch.version.cuda is None) or "rocm" (torch.version.hip)
    build: str = "cuda"
    #: torch gives a torch.cuda.MemPool's segments back through the pool's own
    #: free function when the MemPool goes (torch >= 2.6, whose MemPool counts
    #: its uses: ``use_count()``, a destructor that releases the pool, and a
    #: use_mem_pool that drops its use on exit). torch 2.5 never releases such
    #: a pool, and forcing it frees the segments with cudaFree: release()
    #: refuses there (:func:`require_pool_release`).
    pool_release: bool = True


def mem_pool_class(torch: Any) -> Any:
    """torch.cuda.MemPool (or torch.cuda.memory.MemPool), or None."""
    cuda = getattr(torch, "cuda", None)
    cls = getattr(cuda, "MemPool", None)
    if cls is None:
        cls = getattr(getattr(cuda, "memory", None), "MemPool", None)
    return cls


def use_mem_pool_fn(torch: Any) -> Any:
    """torch.cuda.use_mem_pool (or torch.cuda.memory.use_mem_pool), or None."""
    cuda = getattr(torch, "cuda", None)
    fn = getattr(cuda, "use_mem_pool", None)
    if fn is None:
        fn = getattr(getattr(cuda, "memory", None), "use_mem_pool", None)
    return fn


caps_cache: dict[int, tuple[Any, TorchCapabilities]] = {}


def capabilities(torch: Any = None) -> TorchCapabilities:
    """Feature-detect the running torch (or the module passed)."""
    if torch is None:
        torch = import_torch()
    hit = caps_cache.get(id(torch))
    if hit is not None and hit[0] is torch:
        return hit[1]
    caps = _detect(torch)
    _warn_untested(caps)
    caps_cache[id(torch)] = (torch, caps)  # keeps the module, so its id is not reused
    return caps


def _detect(torch: Any) -> TorchCapabilities:
    C = getattr(torch, "_C", None)
    cuda = getattr(torch, "cuda", None)
    memory = getattr(cuda, "memory", None)
    version = str(getattr(torch, "__version__", "0.0"))
    cls = mem_pool_class(torch)
    begin = next((n for n in ("_cuda_beginAllocateCurrentThreadToPool", "_cuda_beginAllocateToPool") if hasattr(C, n)), None)
    end = next((n for n in ("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool") if hasattr(C, n)), None)
    pool_context = hasattr(memory, "MemPoolContext") or hasattr(cuda, "MemPoolContext")
    use = use_mem_pool_fn(torch) is not None
    if use:
        thread_local = not pool_context and hasattr(C, "_cuda_beginAllocateCurrentThreadToPool")
    else:
        thread_local = begin == "_cuda_beginAllocateCurrentThreadToPool"
    options: tuple[str, ...] = ()
    if cls is not None:
        try:
            params = inspect.signature(cls.__init__).parameters
            options = tuple(n for n in params if n not in ("self", "allocator") and not n.startswith("_"))
        except (TypeError, ValueError):
            options = ()
    return TorchCapabilities(
        version=version,
        mem_pool=cls is not None,
        use_mem_pool=use,
        begin_fn=begin,
        end_fn=end,
        thread_local_routing=bool(thread_local),
        pool_context=bool(pool_context),
        mem_pool_options=options,
        pool_snapshot=cls is not None and hasattr(cls, "snapshot"),
        pluggable=hasattr(memory, "CUDAPluggableAllocator") and hasattr(memory, "change_current_allocator"),
        nccl_registers_new_segments=version_tuple(version) >= (2, 8),
        pluggable_hooks=tuple(
            sorted(n[len("set_"):].removesuffix("_fn") for n in dir(getattr(C, "_CUDAPluggableAllocator", None))
                   if n.startswith("set_"))
        ) if hasattr(C, "_CUDAPluggableAllocator") else (),
        build=_build(torch),
        pool_release=cls is not None and hasattr(cls, "use_count"),
    )


def _build(torch: Any) -> str:
    tv = getattr(torch, "version", None)
    if getattr(tv, "hip", None):
        return "rocm"
    return "cpu" if tv is not None and getattr(tv, "cuda", "") is None else "cuda"


def _warn_untested(caps: TorchCapabilities) -> None:
    """Once per torch module (capabilities caches): a torch outside the
    tested range works or fails untested, and the user should know."""
    v = version_tuple(caps.version)
    if v != (0, 0) and not TESTED_TORCH[0] <= v <= TESTED_TORCH[1]:
        warnings.warn(TorchVersionWarning(
            f"gpumempool's torch integration was tested with torch {tested_range()}; this is torch {caps.version}"),
            stacklevel=3)


def require_cuda(caps: TorchCapabilities) -> None:
    """TorchVersionError unless torch is a CUDA build (not CPU-only, not ROCm)."""
    if caps.build == "cpu":
        raise TorchVersionError(
            f"torch {caps.version} is a CPU-only build: gpumempool's torch integration needs a CUDA build of torch "
            f"{tested_range()} (pip install torch --index-url https://download.pytorch.org/whl/cu128, or PyPI's "
            "default torch on Linux)", version=caps.version, needed="a CUDA build")
    if caps.build == "rocm":
        raise TorchVersionError(
            f"torch {caps.version} is a ROCm build: gpumempool's torch integration needs a CUDA build of torch "
            f"{tested_range()}", version=caps.version, needed="a CUDA build")


def require_pool_release(caps: TorchCapabilities) -> None:
    """TorchVersionError unless torch can give a torch pool's segments back
    to gpumempool (see ``TorchCapabilities.pool_release``)."""
    if not caps.pool_release:
        raise TorchVersionError(
            f"torch {caps.version} cannot give a torch pool's segments back to gpumempool (its "
            "torch.cuda.MemPool keeps its pool for the life of the process, and forcing it would free our "
            "segments with cudaFree): release needs torch >= 2.6; torch keeps them cached for the next "
            "gmp.mempool(pool), and closing the pool returns them to the backend",
            version=caps.version, needed="torch >= 2.6")


def require_mem_pool(caps: TorchCapabilities) -> None:
    """TorchVersionError unless torch can route allocations to a MemPool."""
    require_cuda(caps)
    if not caps.mem_pool or not caps.pluggable:
        raise TorchVersionError(
            f"gpumempool.mempool needs torch >= 2.5 (torch.cuda.MemPool and CUDAPluggableAllocator); "
            f"this is torch {caps.version}", version=caps.version, needed="torch >= 2.5"
        )
    if not caps.use_mem_pool and (caps.begin_fn is None or caps.end_fn is None):
        raise TorchVersionError(
            f"torch {caps.version} has neither torch.cuda.use_mem_pool nor torch._C._cuda_beginAllocate*ToPool"
        )


def cuda_index(torch: Any, device: Any) -> int:
    """A CUDA device index from None/"cuda" (the current device), "cuda:N",
    an int or a torch.device."""
    if device is None:
        return int(torch.cuda.current_device())
    if isinstance(device, bool):
        raise TypeError("device must be an int, 'cuda[:N]' or a torch.device, got bool")
    if isinstance(device, int):
        if device < 0:
            raise InvalidArgumentError(f"device must be >= 0, got {device}")
        return device
    if isinstance(device, str):
        head, _, idx = device.partition(":")
        if head != "cuda" or (idx and not idx.isdigit()):
            raise InvalidArgumentError(f"device must be 'cuda' or 'cuda:N', got {device!r}")
        return int(idx) if idx else int(torch.cuda.current_device())
    dtype = getattr(device, "type", None)
    if dtype is not None:
        if dtype != "cuda":
            raise InvalidArgumentError(f"device must be a CUDA device, got {device!r}")
        index = getattr(device, "index", None)
        return int(torch.cuda.current_device()) if index is None else int(index)
    raise TypeError(f"device must be an int, 'cuda[:N]' or a torch.device, got {type(device).__name__}")
