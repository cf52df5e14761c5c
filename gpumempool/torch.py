"""PyTorch integration: tensors from a gpumempool pool.

Importing this module does not import torch; every function imports it when
called (``pip install 'gpumempool[torch]'``). Four pieces:

``mempool(pool, device=None, stream=None)``
    A context manager routing the CUDA allocations of the calling thread to
    ``pool``, leaving torch's own allocator in charge everywhere else::

        pool = gmp.MemPool(backend="nccl")
        with gmp.mempool(pool, device="cuda:0"):
            x = torch.randn(2**20, device="cuda")   # segments from `pool`
        y = torch.randn(10, device="cuda")          # torch's default allocator

    It is built on torch's pluggable-allocator hooks: a ``torch.cuda.MemPool``
    whose allocator is ``CUDAPluggableAllocator(*pool.pluggable_symbols(segments=True))``
    (exported C functions of our engine, no Python on the allocation path).
    There is **one torch pool per (gpumempool pool, device)**, created on first
    use and reused by every later entry, so what torch cached stays cached.

    Two layers of caching: torch keeps its own caching *inside* the torch pool
    (it splits the segments it got from us into tensors and keeps freed blocks
    for the next allocation routed to that pool), and our engine caches the
    *segments* beneath it. ``release(pool)`` hands torch's cached segments
    back to the engine, which keeps them: entering ``mempool`` again then
    costs no raw backend allocation (cudaMalloc, ncclMemAlloc, cuMemCreate...).
    Note that ``torch.cuda.empty_cache()`` does not touch a live torch pool
    (torch only empties private pools nobody references); ``release`` does.

    Semantics: contexts nest (an inner pool takes over, the outer one resumes
    on exit); tensors outlive the block and stay valid; the optional
    ``stream`` (a ``torch.cuda.Stream``) is entered with the pool. Routing is
    per thread on torch >= 2.8, see the table, which leaves the allocations
    autograd makes on its backward threads to torch's allocator;
    ``all_threads=True`` routes every thread's while inside. Two threads may be inside
    ``mempool(pool)`` at the same time: torch refuses to route two threads to
    one torch pool at once ("beginAllocateToPool: already recording to
    mempool_id"), so a second concurrent thread gets a second torch pool over
    the same gpumempool pool (also cached and reused).

``release(pool, device=None)`` (alias ``pool_release``)
    Empties torch's cache of the pool's torch pools and returns their
    segments to the engine. Raises :class:`PoolInUseError` (a RuntimeError,
    not a crash) while tensors allocated from them are alive or a thread is
    inside ``mempool(pool)``.

``set_torch_allocator(pool)``
    Full replacement: every CUDA allocation of the process goes to ``pool``
    (``torch.cuda.memory.change_current_allocator``). Must run before torch
    initialises CUDA; :class:`AllocatorInitializedError` says so otherwise.
    ``torch.cuda.empty_cache()`` then empties the pool, ``record_stream`` and
    ``set_per_process_memory_fraction`` reach it; torch's own
    ``memory_stats()`` stops working and ``torch_memory_stats()`` gives the
    same keys from our engine. Torch does not cache on top of a pluggable
    allocator: each tensor is one engine allocation. Torch's
    CUDAPluggableAllocator::allocate (every version we read, up to torch's
    main branch of 2026) does not check for NULL and would hand out a tensor
    at address 0, so this mode installs ``gmp_alloc_or_throw_<i>``, a C++
    entry point that throws ``std::runtime_error`` instead: out of memory is
    a ``RuntimeError`` naming the pool's reason, or with
    ``oom_error="torch"`` a ``torch.OutOfMemoryError``, through a shim
    compiled at run time against torch's headers (the C++ type lives in
    libc10; see ``_torch_oom``). Inside
    ``mempool`` torch >= 2.8 checks (allocPrimitive) and raises its
    OutOfMemoryError, so the plain C entry points are used there.

``register(pool, process_group=None)`` / ``deregister(...)``
    NCCL user-buffer registration of the pool's segments with a process
    group's communicator, kept up to date as the pool grows (see below).

Which torch versions do what (checked against PyTorch's sources and pull
requests; the version of a pull request is the first release cut after it
was merged). Features are detected, not inferred from the version string,
except where noted:

=====================  ====================================================
torch < 2.5            no ``torch.cuda.MemPool``: :class:`TorchVersionError`
2.5                    ``torch.cuda.MemPool(allocator)`` and ``use_mem_pool``
                       (pytorch#133599). Routing uses ``MemPoolContext`` and
                       ``_cuda_beginAllocateToPool`` with an always-true
                       filter: while any thread is inside, **every thread's**
                       allocations on that device go to the pool
                       (pytorch#152861); a :class:`ProcessWideRoutingWarning`
                       says so once.
2.6, 2.7               + ``ProcessGroupNCCL.register_mem_pool`` (pytorch#133603),
                       which registers the segments present at the call only
                       and refuses to register one twice: the registration is
                       lifted while a thread is inside ``mempool(pool)`` (the
                       pool may grow) and renewed on exit, as NVIDIA apex's
                       ``nccl_mem`` does. ``MemPool.use_count()`` and
                       ``snapshot()`` (by 2.7; we fall back to
                       ``torch.cuda.memory._snapshot()`` without them).
2.8 and later          routing is thread-local (``_cuda_beginAllocateCurrent
                       ThreadToPool``, pytorch#153356), ``MemPoolContext`` is
                       gone (pytorch#154042), ``register_mem_pool`` also
                       registers future segments (pytorch#150684, by version);
                       ``MemPool(use_on_oom=, no_split=)`` where the signature
                       has them.
2.10 / 2.11            nested ``use_mem_pool`` is LIFO (pytorch#168382); we do
                       not depend on it: entering a pool suspends the
                       thread's active one (end + release, re-begun on exit),
                       so nesting is correct on every version.
=====================  ====================================================

Target of the GPU validation: torch 2.11 with CUDA 13 (tests/test_torch_gpu.py,
benchmarks/gpt2_train.py). The version-dispatch logic is tested on CPU
against fakes of the 2.5-2.7 and 2.8+ behaviours (tests/test_torch_logic.py).
:func:`capabilities` reports what the running torch offers.

NVLS. NCCL's NVLink SHARP reductions need NVSwitch hardware (HGX H100/H200
8-GPU boards, NVL72 racks) with multicast support (CUDA >= 12.1, NCCL >=
2.17, a driver and fabric manager that enable it), and registered buffers
must be cuMem (VMM) allocations, which the ``nccl`` (ncclMemAlloc) and ``vmm``
backends give and ``cuda`` (cuMemAlloc) does not. Without NVSwitch (one GPU,
PCIe, NVLink bridges) NCCL simply never selects NVLS: registration still
succeeds, collectives stay correct, and NCCL may use the registration for
other zero-copy paths (peer-to-peer, IB SHARP/CollNet) or ignore it. On a
single-GPU machine only the API path is exercised.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import inspect
import re
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

from . import _lifecycle, _native, _torch_oom
from ._errors import GpuMemPoolError, InvalidArgumentError, PoolClosedError
from ._pool import MemPool, has_python_functions

__all__ = [
    "AllocatorInitializedError",
    "MempoolContext",
    "OOMErrorFallbackWarning",
    "PoolInUseError",
    "ProcessWideRoutingWarning",
    "PythonCallbackWarning",
    "RoutingConflictWarning",
    "TorchCapabilities",
    "TorchIntegrationError",
    "TorchVersionError",
    "capabilities",
    "deregister",
    "hook_errors",
    "mempool",
    "pool_release",
    "register",
    "release",
    "set_torch_allocator",
    "torch_allocator_pool",
    "torch_memory_stats",
    "torch_memory_summary",
    "torch_pools",
]


class OOMErrorFallbackWarning(RuntimeWarning):
    """``set_torch_allocator(pool, oom_error="torch")`` could not build its
    shim (the message says why) and installed the pool with
    ``oom_error="runtime"``: out of memory is a ``RuntimeError`` worded like
    torch's."""


class TorchIntegrationError(GpuMemPoolError, RuntimeError):
    """The PyTorch integration cannot do what was asked."""


class TorchVersionError(TorchIntegrationError):
    """torch is missing, or too old for the feature."""


class AllocatorInitializedError(TorchIntegrationError):
    """torch's CUDA allocator was initialised (or replaced) already."""


class PoolInUseError(TorchIntegrationError):
    """Tensors from the pool are alive, or a thread is inside ``mempool``."""


class ProcessWideRoutingWarning(UserWarning):
    """This torch routes every thread's allocations to an entered pool."""


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


def _warn_python_callbacks(pool: MemPool, where: str) -> None:
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


# ---------------------------------------------------------------------------
# torch, and what it offers
# ---------------------------------------------------------------------------


def _import_torch() -> Any:
    try:
        return importlib.import_module("torch")
    except ImportError as exc:
        raise TorchVersionError(
            "gpumempool's PyTorch integration needs torch >= 2.5 (pip install 'gpumempool[torch]')"
        ) from exc


def _version_tuple(version: str) -> tuple[int, int]:
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


def _mem_pool_class(torch: Any) -> Any:
    cuda = getattr(torch, "cuda", None)
    cls = getattr(cuda, "MemPool", None)
    if cls is None:
        cls = getattr(getattr(cuda, "memory", None), "MemPool", None)
    return cls


def _use_mem_pool_fn(torch: Any) -> Any:
    cuda = getattr(torch, "cuda", None)
    fn = getattr(cuda, "use_mem_pool", None)
    if fn is None:
        fn = getattr(getattr(cuda, "memory", None), "use_mem_pool", None)
    return fn


_caps_cache: dict[int, tuple[Any, TorchCapabilities]] = {}


def capabilities(torch: Any = None) -> TorchCapabilities:
    """Feature-detect the running torch (or the module passed)."""
    if torch is None:
        torch = _import_torch()
    hit = _caps_cache.get(id(torch))
    if hit is not None and hit[0] is torch:
        return hit[1]
    caps = _detect(torch)
    _caps_cache[id(torch)] = (torch, caps)  # keeps the module, so its id is not reused
    return caps


def _detect(torch: Any) -> TorchCapabilities:
    C = getattr(torch, "_C", None)
    cuda = getattr(torch, "cuda", None)
    memory = getattr(cuda, "memory", None)
    version = str(getattr(torch, "__version__", "0.0"))
    cls = _mem_pool_class(torch)
    begin = next((n for n in ("_cuda_beginAllocateCurrentThreadToPool", "_cuda_beginAllocateToPool") if hasattr(C, n)), None)
    end = next((n for n in ("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool") if hasattr(C, n)), None)
    pool_context = hasattr(memory, "MemPoolContext") or hasattr(cuda, "MemPoolContext")
    use = _use_mem_pool_fn(torch) is not None
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
        nccl_registers_new_segments=_version_tuple(version) >= (2, 8),
        pluggable_hooks=tuple(
            sorted(n[len("set_"):].removesuffix("_fn") for n in dir(getattr(C, "_CUDAPluggableAllocator", None))
                   if n.startswith("set_"))
        ) if hasattr(C, "_CUDAPluggableAllocator") else (),
    )


def _require_mem_pool(caps: TorchCapabilities) -> None:
    if not caps.mem_pool or not caps.pluggable:
        raise TorchVersionError(
            f"gpumempool.mempool needs torch >= 2.5 (torch.cuda.MemPool and CUDAPluggableAllocator); "
            f"this is torch {caps.version}"
        )
    if not caps.use_mem_pool and (caps.begin_fn is None or caps.end_fn is None):
        raise TorchVersionError(
            f"torch {caps.version} has neither torch.cuda.use_mem_pool nor torch._C._cuda_beginAllocate*ToPool"
        )


def _cuda_index(torch: Any, device: Any) -> int:
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


# ---------------------------------------------------------------------------
# bookkeeping: torch pools ("lanes") per gpumempool pool, per-thread frames
# ---------------------------------------------------------------------------


@dataclass(eq=False)
class _Lane:
    """One torch.cuda.MemPool over a gpumempool pool, for one device and tag.
    At most one thread routes to it at a time (torch refuses two)."""

    torch_pool: Any
    device: int
    tag: Any
    options: dict[str, bool]
    holder: Optional[int] = None  # thread ident of the thread inside
    holds: int = 0  # frames of that thread using the lane
    #: ending a route to it failed: torch may still route to it, so no thread
    #: is given it again (release() still gives back its segments)
    broken: bool = False


@dataclass(eq=False)
class _Registration:
    """A pool registered with one process group's NCCL communicator on one device."""

    group: Any
    device: int
    backend: Any
    mode: str  # "mem_pool" (backend.register_mem_pool) or "comm_register" (ncclCommRegister)
    comm: int = 0
    # per lane (the object: an id could be reused by a later lane):
    # "registered"/"suspended" (mem_pool), {address: (handle, size)} (comm_register)
    lanes: dict[_Lane, Any] = field(default_factory=dict)


@dataclass(eq=False)
class _PoolState:
    pool: MemPool
    allocator: Any = None  # torch.cuda.memory.CUDAPluggableAllocator over the pool's C symbols
    lanes: list[_Lane] = field(default_factory=list)
    registrations: list[_Registration] = field(default_factory=list)


_lock = threading.RLock()
_states: dict[int, _PoolState] = {}  # id(pool) -> state; the state keeps the pool alive
#: pools whose close() has begun (forget_pool): no new state, lane or registration
_closing: "weakref.WeakSet[MemPool]" = weakref.WeakSet()
_tls = threading.local()
_warned_process_wide = False
# Lanes whose torch pools could not be released when they had to go (a
# failed registration of a new lane, a pool closed while torch still used
# it): dropping the last reference would run torch's MemPool destructor, which
# aborts the process when a route is under way on the device. They are kept
# here and dropped once no route is (_route_stopped).
_orphans: list["_Lane"] = []


def _frames() -> list["MempoolContext"]:
    frames = getattr(_tls, "frames", None)
    if frames is None:
        frames = _tls.frames = []
    return frames


def _check_open(pool: MemPool) -> None:
    """PoolClosedError for a pool closed or being closed (call under _lock)."""
    if pool.closed or pool in _closing:
        raise PoolClosedError(f"pool {pool!r} is closed" if pool.closed else f"pool {pool.name!r} is being closed")


def _state(pool: MemPool, create: bool = True) -> Optional[_PoolState]:
    st = _states.get(id(pool))
    if create:
        _check_open(pool)  # (under _lock) never a new lane over a closing pool
        if st is None:
            st = _states[id(pool)] = _PoolState(pool)
    return st


def _allocator(torch: Any, st: _PoolState) -> Any:
    if st.allocator is None:
        st.allocator = torch.cuda.memory.CUDAPluggableAllocator(*st.pool.pluggable_symbols(segments=True))
    return st.allocator


def _new_lane(torch: Any, caps: TorchCapabilities, st: _PoolState, device: int, tag: Any, options: dict[str, bool]) -> _Lane:
    kwargs: dict[str, bool] = {}
    for name, value in options.items():
        if value and name not in caps.mem_pool_options:
            raise TorchVersionError(f"torch {caps.version}'s torch.cuda.MemPool has no {name!r} option")
        if name in caps.mem_pool_options:
            kwargs[name] = value
    raw = _allocator(torch, st).allocator()
    # torch binds a MemPool to the current device when it is created
    with torch.cuda.device(device):
        tp = _mem_pool_class(torch)(raw, **kwargs)
    lane = _Lane(tp, device, tag, dict(options))
    st.lanes.append(lane)
    regs = [reg for reg in st.registrations if reg.device == device]
    try:
        for reg in regs:
            _register_lane(torch, caps, reg, lane)
    except BaseException:
        # Undo the registrations made (and what a failed one recorded): the
        # torch pool is dropped, it must not stay registered with NCCL.
        for reg in regs:
            with contextlib.suppress(Exception):
                _deregister_lane(reg, lane)
            reg.lanes.pop(lane, None)
        st.lanes.remove(lane)
        _orphans.append(lane)
        raise
    return lane


def _acquire_lane(
    torch: Any, caps: TorchCapabilities, pool: MemPool, device: int, tag: Any, options: dict[str, bool], tid: int
) -> tuple[_Lane, bool]:
    """The lane the thread routes to, and whether it just took it."""
    st = _state(pool)
    assert st is not None
    free: Optional[_Lane] = None
    for lane in st.lanes:
        if lane.device != device or lane.tag != tag or lane.broken:
            continue
        if lane.options != options:
            raise InvalidArgumentError(
                f"pool {pool.name!r} already has a torch pool on cuda:{device} with options {lane.options}; "
                f"release(pool) before entering it with {options}"
            )
        if lane.holder == tid:
            lane.holds += 1
            return lane, False
        if lane.holder is None and free is None:
            free = lane
    lane = free if free is not None else _new_lane(torch, caps, st, device, tag, options)
    lane.holder, lane.holds = tid, 1
    return lane, True


def _release_lane(lane: _Lane) -> bool:
    """Drop one hold; whether the lane is free now."""
    lane.holds -= 1
    if lane.holds <= 0:
        lane.holder, lane.holds = None, 0
        return True
    return False


@contextlib.contextmanager
def _private_route(torch: Any, caps: TorchCapabilities, tp: Any, device: int, begin_fn: str) -> Any:
    """use_mem_pool rebuilt from torch._C's private calls (for builds
    without it, and for all-thread routing)."""
    C = torch._C
    ctx = None
    if caps.pool_context:
        ctx_cls = getattr(torch.cuda.memory, "MemPoolContext", None) or torch.cuda.MemPoolContext
        ctx = ctx_cls(tp)
    assert caps.end_fn is not None
    getattr(C, begin_fn)(device, tp.id)
    try:
        yield
    finally:
        getattr(C, caps.end_fn)(device, tp.id)
        if hasattr(C, "_cuda_releasePool"):
            C._cuda_releasePool(device, tp.id)
        del ctx


_ALL_THREADS_FN = "_cuda_beginAllocateToPool"


def _route(torch: Any, caps: TorchCapabilities, tp: Any, device: int, all_threads: bool = False) -> Any:
    if all_threads and caps.thread_local_routing:
        return _private_route(torch, caps, tp, device, _ALL_THREADS_FN)
    if caps.use_mem_pool:
        return _use_mem_pool_fn(torch)(tp, device)
    assert caps.begin_fn is not None
    return _private_route(torch, caps, tp, device, caps.begin_fn)


class MempoolContext:
    """What :func:`mempool` returns; entering it yields the torch.cuda.MemPool."""

    def __init__(
        self,
        pool: MemPool,
        device: Any = None,
        stream: Any = None,
        *,
        tag: Any = None,
        options: Optional[dict[str, bool]] = None,
        all_threads: bool = False,
    ) -> None:
        if not isinstance(pool, MemPool):
            raise TypeError(f"pool must be a gpumempool.MemPool, got {type(pool).__name__}")
        self._pool = pool
        self._all_threads = bool(all_threads)
        self._device_arg = device
        self._stream = stream
        self._tag = tag
        self._options = dict(options or {})
        self._entered = False
        self._lane: Optional[_Lane] = None
        self._route: Any = None
        self._stream_cm: Any = None
        self._suspended: list[MempoolContext] = []
        self._torch: Any = None
        self._caps: Optional[TorchCapabilities] = None
        self.device: Optional[int] = None

    # routing of this frame, stopped while an inner context suspends it
    def _start(self) -> None:
        assert self._lane is not None and self._caps is not None and self.device is not None
        cm = _route(self._torch, self._caps, self._lane.torch_pool, self.device, self._all_threads)
        # Recorded before torch begins the route and dropped after it ends, so
        # that release() never misses a route torch has under way.
        try:
            _route_started(self)
            cm.__enter__()
        except BaseException:
            _route_stopped(self)
            raise
        self._route = cm

    def _stop(self) -> None:
        cm, self._route = self._route, None
        if cm is not None:
            try:
                cm.__exit__(None, None, None)
            finally:
                _route_stopped(self)

    @property
    def active(self) -> bool:
        """Whether allocations of the entering thread are being routed here now."""
        return self._route is not None

    @property
    def torch_pool(self) -> Any:
        """The torch.cuda.MemPool this context routes to (None before entry)."""
        return None if self._lane is None else self._lane.torch_pool

    def __enter__(self) -> Any:
        global _warned_process_wide
        if self._entered:
            raise TorchIntegrationError("a gmp.mempool(...) context can be entered once; make a new one")
        torch = _import_torch()
        caps = capabilities(torch)
        _require_mem_pool(caps)
        if self._pool.closed:
            raise PoolClosedError(f"pool {self._pool!r} is closed")
        if _installed is not None:
            # Torch's pluggable allocator serves a torch.cuda.MemPool from a
            # private pool of its own (beginAllocateToPool), whatever the
            # MemPool's allocator: routing to self._pool is impossible.
            raise TorchIntegrationError(
                f"gmp.mempool({self._pool.name!r}) cannot route allocations while gmp.set_torch_allocator"
                f"({_installed.pool.name!r}) replaces torch's allocator: torch would ignore the MemPool's "
                f"allocator and serve it from a private pool of {_installed.pool.name!r}. Every CUDA "
                f"allocation of the process already comes from {_installed.pool.name!r}."
            )
        if not torch.cuda.is_available():
            raise TorchIntegrationError("torch sees no CUDA device (torch.cuda.is_available() is False)")
        self._torch, self._caps = torch, caps
        self.device = _cuda_index(torch, self._device_arg)
        if self._all_threads and caps.thread_local_routing and (
            not hasattr(torch._C, _ALL_THREADS_FN) or caps.end_fn is None
        ):
            raise TorchVersionError(f"torch {caps.version} has no torch._C.{_ALL_THREADS_FN} for all_threads=True")
        if not caps.thread_local_routing and not _warned_process_wide:
            _warned_process_wide = True
            warnings.warn(
                f"torch {caps.version} routes the allocations of every thread on the device to a pool "
                "entered with gmp.mempool (torch >= 2.8 routes only the entering thread's): while a thread "
                "is inside, a segment another thread's allocation adds to that torch pool is made with the "
                "other thread's allocator (cudaMalloc, or the pool of the gmp.mempool it is in: torch 2.5-2.7 "
                "take the allocator from a thread-local MemPoolContext) and later freed through this pool's "
                "free function, a cross-pool free; keep other threads from allocating on the device meanwhile",
                ProcessWideRoutingWarning,
                stacklevel=2,
            )
        _warn_python_callbacks(self._pool, "gmp.mempool")
        tid = threading.get_ident()
        with _lock:
            self._lane, first = _acquire_lane(torch, caps, self._pool, self.device, self._tag, self._options, tid)
            if first:
                try:
                    _lane_taken(torch, caps, self._pool, self._lane)
                except BaseException:
                    _release_lane(self._lane)
                    raise
        frames = _frames()
        # One active route per thread and device (per thread on 2.5-2.7, whose
        # MemPoolContext is not per device): suspend the current one.
        self._suspended = [f for f in frames if f.active and (caps.pool_context or f.device == self.device)]
        stopped: list[MempoolContext] = []
        try:
            for f in reversed(self._suspended):
                f._stop()
                stopped.append(f)
            self._start()
            if self._stream is not None:
                self._stream_cm = torch.cuda.stream(self._stream)
                self._stream_cm.__enter__()
        except BaseException:
            try:
                self._stop()
            except Exception:  # noqa: BLE001 - torch may still route to it: never hand it out again
                self._lane.broken = True
            for f in reversed(stopped):
                with contextlib.suppress(Exception):
                    f._start()
            with _lock:
                if _release_lane(self._lane) and not self._lane.broken:
                    with contextlib.suppress(Exception):
                        _lane_freed(torch, caps, self._pool, self._lane)
            raise
        self._entered = True
        frames.append(self)
        return self._lane.torch_pool

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        assert self._lane is not None
        problems: list[str] = []
        if self._stream_cm is not None:
            cm, self._stream_cm = self._stream_cm, None
            try:
                cm.__exit__(exc_type, exc, tb)
            except Exception as e:  # noqa: BLE001 - reported below
                problems.append(f"leaving the stream context failed: {e!r}")
        frames = _frames()
        if frames and frames[-1] is self:
            frames.pop()
        else:
            if self in frames:
                frames.remove(self)
            problems.append("gmp.mempool contexts were exited out of order (exit the innermost first)")
        try:
            self._stop()
        except Exception as e:  # noqa: BLE001
            # Torch may still route to that torch pool (or hold it in a bad
            # state): it is never handed to a thread again; release() still
            # gives back its segments.
            self._lane.broken = True
            problems.append(f"ending the routing to the torch pool failed (it will not be used again): {e!r}")
        for f in self._suspended:
            if f in frames and not f.active:
                try:
                    f._start()
                except Exception as e:  # noqa: BLE001
                    problems.append(f"resuming the enclosing gmp.mempool context failed: {e!r}")
        self._suspended = []
        with _lock:
            if _release_lane(self._lane) and not self._lane.broken:
                try:
                    _lane_freed(self._torch, self._caps, self._pool, self._lane)
                except Exception as e:  # noqa: BLE001
                    problems.append(f"registering the pool's new segments with NCCL failed: {e!r}")
        if problems and exc_type is None:
            raise TorchIntegrationError("; ".join(problems))


# Routes started on torch >= 2.8 (thread-local routing), by device: the
# context, its thread and whether it takes all threads. Torch keeps every
# route in one list per device and gives an allocation to the first route
# whose filter accepts it (the newest first since torch 2.10, the oldest
# before). An all_threads route accepts every thread, so it and another
# thread's own route conflict: which one gets that thread's allocations
# depends on the order, and no order is right for both versions.
_routes_lock = threading.RLock()  # release() holds it across destructors that may run finalizers
_active_routes: dict[int, list[tuple["MempoolContext", int, bool]]] = {}


def _new_locks_after_fork() -> None:
    global _lock, _routes_lock
    _lock, _routes_lock = threading.RLock(), threading.RLock()


_native.after_fork_in_child(_new_locks_after_fork)


def _route_started(ctx: "MempoolContext") -> None:
    assert ctx.device is not None
    tid = threading.get_ident()
    with _routes_lock:
        routes = _active_routes.setdefault(ctx.device, [])
        conflicts = [(c, t) for c, t, every in routes
                     if t != tid and (every or ctx._all_threads) and every != ctx._all_threads]
        routes.append((ctx, tid, ctx._all_threads))
    if ctx._caps is None or not ctx._caps.thread_local_routing:
        return  # routing is process-wide anyway (torch < 2.8): nothing to warn of
    for other, t in conflicts:
        wide, own = (ctx, other) if ctx._all_threads else (other, ctx)
        warnings.warn(
            f"gmp.mempool({wide._pool.name!r}, all_threads=True) and a gmp.mempool({own._pool.name!r}) of "
            f"another thread route cuda:{ctx.device} at once (threads {tid} and {t}): torch gives that "
            f"thread's allocations to the route it checks first, so they may land in {wide._pool.name!r}. "
            "Do not combine all_threads=True with other threads' gmp.mempool contexts on one device.",
            RoutingConflictWarning,
            stacklevel=4,
        )


def _route_stopped(ctx: "MempoolContext") -> None:
    with _routes_lock:
        routes = _active_routes.get(ctx.device if ctx.device is not None else -1, [])
        routes[:] = [r for r in routes if r[0] is not ctx]
        if _orphans and not any(_active_routes.values()):
            # No route is under way, and none starts while the lock is held
            # (as in release()): the torch pools' destructors may run now.
            _orphans.clear()


def mempool(
    pool: MemPool,
    device: Any = None,
    stream: Any = None,
    *,
    all_threads: bool = False,
    use_on_oom: bool = False,
    no_split: bool = False,
) -> MempoolContext:
    """Route the calling thread's CUDA allocations on ``device`` to ``pool``.

    ``device``: None or "cuda" (the current device), "cuda:N", N or a
    torch.device. ``stream``: a torch.cuda.Stream entered with the pool.
    ``all_threads``: route every thread's allocations on the device while
    inside (``torch._C._cuda_beginAllocateToPool``), e.g. to catch those of
    autograd's backward threads, which thread-local routing (torch >= 2.8)
    leaves to torch's allocator; torch 2.5-2.7 route every thread anyway.
    Torch checks an all_threads route and the routes other threads entered
    on the device in an order that depends on its version, so combining
    them is unreliable: a :class:`RoutingConflictWarning` says when it
    happens.
    ``use_on_oom`` / ``no_split``: torch.cuda.MemPool's options (torch
    versions whose MemPool has them); fixed when the torch pool is created.
    Entering yields the torch.cuda.MemPool. See the module docstring.
    """
    options: dict[str, bool] = {}
    if use_on_oom:
        options["use_on_oom"] = True
    if no_split:
        options["no_split"] = True
    return MempoolContext(pool, device, stream, options=options, all_threads=all_threads)


def torch_pools(pool: MemPool, device: Any = None) -> list[Any]:
    """The torch.cuda.MemPool objects gpumempool made over ``pool`` (all
    devices, or one), oldest first."""
    with _lock:
        st = _state(pool, create=False)
        lanes = list(st.lanes) if st is not None else []
    if device is not None:
        dev = device if isinstance(device, int) and not isinstance(device, bool) else _cuda_index(_import_torch(), device)
        lanes = [lane for lane in lanes if lane.device == dev]
    return [lane.torch_pool for lane in lanes]


# ---------------------------------------------------------------------------
# release
# ---------------------------------------------------------------------------

_ALL = object()


def _segments(torch: Any, caps: Optional[TorchCapabilities], tp: Any) -> list[dict[str, Any]]:
    """torch's segments of one torch pool (snapshot dicts)."""
    snap = getattr(tp, "snapshot", None)
    if callable(snap):
        try:
            return list(snap())
        except Exception:  # noqa: BLE001 - fall back to the global snapshot
            pass
    return _segments_of(torch, {tuple(tp.id)})


def _segments_of(torch: Any, pool_ids: set[tuple[int, ...]]) -> list[dict[str, Any]]:
    raw = torch.cuda.memory._snapshot()
    segs = raw.get("segments", []) if isinstance(raw, dict) else list(raw)
    return [s for s in segs if tuple(s.get("segment_pool_id", ()) or ()) in pool_ids]


def _scan_lanes(torch: Any, caps: "TorchCapabilities", lanes: list["_Lane"]) -> tuple[
        list[tuple["_Lane", list[dict[str, Any]]]], int, int]:
    """Each lane's torch segments, and the blocks and bytes still allocated
    in them."""
    live_blocks = live_bytes = 0
    per_lane: list[tuple[_Lane, list[dict[str, Any]]]] = []
    for ln in lanes:
        segs = _segments(torch, caps, ln.torch_pool)
        per_lane.append((ln, segs))
        for s in segs:
            used = int(s.get("allocated_size", 0) or 0)
            if used:
                live_bytes += used
                live_blocks += sum(1 for b in s.get("blocks", []) if str(b.get("state", "")).startswith("active_allocated")) or 1
    return per_lane, live_blocks, live_bytes


def release(pool: MemPool, device: Any = None, *, to_backend: bool = False, tag: Any = _ALL) -> int:
    """Empty torch's cache of the torch pools made over ``pool`` (every
    device, or ``device``) and give their segments back to the pool; return
    the bytes given back. The next ``mempool(pool)`` makes a new torch pool,
    served from the engine's cache. ``to_backend=True`` also empties the
    engine's cache (``pool.empty_cache()``).

    Raises :class:`PoolInUseError`, touching nothing, while a thread is
    inside ``mempool(pool)`` or tensors allocated from the pool are alive,
    and while any ``gmp.mempool`` context is active on the device (torch
    asserts in the MemPool destructor that no allocation to a pool is under
    way there, which would abort the process). Do not call it while another
    thread is inside ``torch.cuda.use_mem_pool`` or captures a CUDA graph on
    that device, which gpumempool cannot see.
    Torch's cuBLAS workspaces (made by the first matmul of a thread and
    stream, and kept) are not counted as alive: when blocks remain, this
    clears them (``torch._C._cuda_clearCublasWorkspaces``; torch makes new
    ones on the next matmul) before deciding.
    NCCL registrations stay: they apply to the next torch pool too. When
    torch's MemPool destructor did not free the segments (older versions),
    this calls ``torch.cuda.empty_cache()``, which also empties torch's own
    cache.
    """
    with _lock:
        st = _state(pool, create=False)
        if st is None or not st.lanes:
            if to_backend and not pool.closed:
                pool.empty_cache()
            return 0
        torch = _import_torch()
        caps = capabilities(torch)
        dev = None if device is None else _cuda_index(torch, device)
        lanes = [ln for ln in st.lanes if (dev is None or ln.device == dev) and (tag is _ALL or ln.tag == tag)]
        if not lanes:
            if to_backend and not pool.closed:
                pool.empty_cache()
            return 0
        busy = [ln for ln in lanes if ln.holder is not None]
        if busy:
            names = {t.ident: t.name for t in threading.enumerate()}
            where = ", ".join(f"cuda:{ln.device} in thread {names.get(ln.holder, ln.holder)!r}" for ln in busy)
            raise PoolInUseError(f"cannot release pool {pool.name!r}: still inside gmp.mempool(...) ({where})")
        # Dropping a torch.cuda.MemPool runs its destructor, which empties the
        # pool and so syncs its events: torch asserts there that no
        # allocation to any pool is under way on the device
        # (synchronize_and_free_events), and an assert thrown from a
        # destructor aborts the process. Routes of gmp.mempool are known
        # here (torch >= 2.8; torch.cuda.use_mem_pool blocks and graph
        # captures of other threads are not, see the docstring), and the
        # lock, held until the destructors below have run, keeps new ones
        # from beginning meanwhile (MempoolContext records a route before
        # torch begins it).
        with _routes_lock:
            routing = sorted({ln.device for ln in lanes if _active_routes.get(ln.device)})
            if routing:
                raise PoolInUseError(
                    f"cannot release pool {pool.name!r} while a gmp.mempool(...) context (of any pool, in any "
                    f"thread) is active on {', '.join(f'cuda:{d}' for d in routing)}: torch's MemPool destructor "
                    "asserts that no allocation to a pool is under way on the device, and would abort the process"
                )
            per_lane, live_blocks, live_bytes = _scan_lanes(torch, caps, lanes)
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if live_bytes and clear is not None:
                # torch keeps a cuBLAS workspace per (handle, stream) from the first
                # matmul on, allocated wherever that matmul ran: one made inside
                # mempool(pool) would pin the pool forever. Workspaces are
                # re-made on the next matmul.
                clear()
                per_lane, live_blocks, live_bytes = _scan_lanes(torch, caps, lanes)
            if live_bytes:
                devs = sorted({ln.device for ln in lanes})
                raise PoolInUseError(
                    f"cannot release pool {pool.name!r}: {live_blocks} tensor block(s), {live_bytes} bytes, allocated "
                    f"inside gmp.mempool(...) on {', '.join(f'cuda:{d}' for d in devs)} are still alive; "
                    "delete them (and the objects holding them) first"
                )
            total = 0
            ids: set[tuple[int, ...]] = set()
            for ln, segs in per_lane:
                for reg in st.registrations:
                    if reg.device == ln.device:
                        _deregister_lane(reg, ln)
                st.lanes.remove(ln)
                ids.add(tuple(ln.torch_pool.id))
                total += sum(int(s.get("total_size", 0) or 0) for s in segs)
                ln.torch_pool = None  # the MemPool's destructor releases it in torch
            del per_lane, lanes
            gc.collect()
            left = _segments_of(torch, ids)
            if left:
                # Versions whose MemPool destructor does not empty the pool: torch
                # frees the segments of pools nobody uses on empty_cache().
                torch.cuda.empty_cache()
                left = _segments_of(torch, ids)
        if not st.lanes and not st.registrations and not left:
            _states.pop(id(pool), None)
    if left:
        raise TorchIntegrationError(
            f"torch still holds {len(left)} segment(s), {sum(int(s.get('total_size', 0) or 0) for s in left)} bytes, "
            f"of pool {pool.name!r} after release: a torch.cuda.MemPool object gmp.mempool yielded is still "
            "referenced somewhere, or a CUDA graph retains it; they are freed when it goes"
        )
    if to_backend and not pool.closed:
        with contextlib.suppress(PoolClosedError):  # closed meanwhile by another thread
            pool.empty_cache()
    return total


#: Alias of :func:`release` (the issue's name).
pool_release = release


# ---------------------------------------------------------------------------
# NCCL registration
# ---------------------------------------------------------------------------


class _NcclLib:
    """ncclCommRegister / ncclCommDeregister from the libnccl torch loaded."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        for name in ("ncclCommRegister", "ncclCommDeregister"):
            if not hasattr(lib, name):
                raise TorchVersionError(f"this libnccl has no {name} (needs NCCL >= 2.19)")
        lib.ncclCommRegister.restype = ctypes.c_int
        lib.ncclCommRegister.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)]
        lib.ncclCommDeregister.restype = ctypes.c_int
        lib.ncclCommDeregister.argtypes = [ctypes.c_void_p, ctypes.c_void_p]

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = ""
            fn = getattr(self._lib, "ncclGetErrorString", None)
            if fn is not None:
                fn.restype = ctypes.c_char_p
                fn.argtypes = [ctypes.c_int]
                msg = ": " + (fn(rc) or b"").decode(errors="replace")
            raise TorchIntegrationError(f"{what} failed with NCCL error {rc}{msg}")

    def register(self, comm: int, ptr: int, size: int) -> int:
        handle = ctypes.c_void_p()
        self._check(self._lib.ncclCommRegister(comm, ptr, size, ctypes.byref(handle)), "ncclCommRegister")
        return int(handle.value or 0)

    def deregister(self, comm: int, handle: int) -> None:
        self._check(self._lib.ncclCommDeregister(comm, handle), "ncclCommDeregister")


_nccl: Optional[_NcclLib] = None


def _nccl_lib() -> _NcclLib:
    global _nccl
    if _nccl is None:
        errors = []
        for name in ("libnccl.so.2", "libnccl.so"):
            try:  # by soname: the copy torch already loaded, if any
                _nccl = _NcclLib(ctypes.CDLL(name))
                break
            except OSError as exc:
                errors.append(str(exc))
        if _nccl is None:
            raise TorchVersionError("cannot load libnccl for ncclCommRegister: " + "; ".join(errors))
    return _nccl


def _legacy_registration(caps: Optional[TorchCapabilities]) -> bool:
    """register_mem_pool registers only the segments present (torch < 2.8)."""
    return caps is None or not caps.nccl_registers_new_segments


def _register_lane(torch: Any, caps: Optional[TorchCapabilities], reg: _Registration, lane: _Lane) -> None:
    """Register a lane's torch pool. State kept in reg.lanes[lane]:
    "registered" / "suspended" (register_mem_pool), or {address: (handle,
    size)} (ncclCommRegister)."""
    tp = lane.torch_pool
    if reg.mode == "mem_pool":
        if lane.holder is not None and _legacy_registration(caps):
            reg.lanes[lane] = "suspended"  # registered when its thread leaves mempool
            return
        try:
            reg.backend.register_mem_pool(tp)
        except RuntimeError as exc:
            hint = ""
            if "initialized" in str(exc):
                hint = (
                    " (the NCCL communicator is created lazily: pass device_id=torch.device('cuda', N) to "
                    "init_process_group, or run one collective, before registering)"
                )
            raise TorchIntegrationError(f"register_mem_pool failed: {exc}{hint}") from exc
        reg.lanes[lane] = "registered"
    else:
        _sync_handles(torch, caps, reg, lane)


def _sync_handles(torch: Any, caps: Optional[TorchCapabilities], reg: _Registration, lane: _Lane) -> None:
    """ncclCommRegister the lane's new segments, deregister vanished ones."""
    nccl = _nccl_lib()
    handles: dict[int, tuple[int, int]] = reg.lanes.setdefault(lane, {})
    present = {int(s["address"]): int(s["total_size"]) for s in _segments(torch, caps, lane.torch_pool)}
    for addr in [a for a in handles if a not in present]:
        nccl.deregister(reg.comm, handles.pop(addr)[0])
    for addr, size in present.items():
        if addr not in handles:
            handles[addr] = (nccl.register(reg.comm, addr, size), size)


#: What torch says when the communicator of a process group is gone
#: (``destroy_process_group``, an abort): ncclCommDestroy has already dropped
#: every registration it held, so there is nothing left to undo.
_COMM_GONE = ("communicator was aborted", "has not been initialized", "communicator is aborted")


def _deregister_lane(reg: _Registration, lane: _Lane) -> None:
    """Undo reg for lane. The lane is forgotten only once that worked (or
    the communicator is gone): a failure leaves it for a retry."""
    state = reg.lanes.get(lane)
    if state is None:
        return
    if reg.mode == "mem_pool":
        if state == "registered":
            try:
                reg.backend.deregister_mem_pool(lane.torch_pool)
            except RuntimeError as exc:  # torch's DistBackendError is one
                if not any(gone in str(exc) for gone in _COMM_GONE):
                    raise
    else:
        nccl = _nccl_lib()
        for key, (handle, _) in list(state.items()):
            nccl.deregister(reg.comm, handle)
            del state[key]
    reg.lanes.pop(lane, None)


def _registrations_of(pool: MemPool, lane: _Lane) -> list[_Registration]:
    st = _state(pool, create=False)
    return [r for r in st.registrations if r.device == lane.device and lane in r.lanes] if st is not None else []


def _lane_taken(torch: Any, caps: Optional[TorchCapabilities], pool: MemPool, lane: _Lane) -> None:
    """A thread starts routing to the lane. torch < 2.8 registers a pool's
    segments once and refuses to register one twice or deregister one it did
    not register, so a registration that cannot follow growth by itself is
    lifted while the pool may grow and renewed on leaving (as NVIDIA apex's
    nccl_mem does): collectives inside stay correct, without zero-copy."""
    for reg in _registrations_of(pool, lane):
        if reg.mode == "mem_pool" and _legacy_registration(caps) and reg.lanes[lane] == "registered":
            reg.backend.deregister_mem_pool(lane.torch_pool)
            reg.lanes[lane] = "suspended"


def _lane_freed(torch: Any, caps: Optional[TorchCapabilities], pool: MemPool, lane: _Lane) -> None:
    """No thread routes to the lane any more: bring registrations up to date."""
    for reg in _registrations_of(pool, lane):
        if reg.mode == "mem_pool":
            if reg.lanes[lane] == "suspended":
                reg.backend.register_mem_pool(lane.torch_pool)
                reg.lanes[lane] = "registered"
        else:
            _sync_handles(torch, caps, reg, lane)


def _group_and_backend(torch: Any, process_group: Any, dev: int) -> tuple[Any, Any]:
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        raise TorchIntegrationError(
            "NCCL registration needs torch.distributed initialised: "
            "torch.distributed.init_process_group('nccl', device_id=torch.device('cuda', N))"
        )
    group = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
    try:
        backend = group._get_backend(torch.device("cuda", dev))
    except RuntimeError as exc:
        raise TorchIntegrationError(f"the process group has no NCCL backend for cuda:{dev}: {exc}") from exc
    return group, backend


def register(pool: MemPool, process_group: Any = None, *, device: Any = None) -> None:
    """Register ``pool``'s segments on ``device`` (default: the current one)
    with the NCCL communicator of ``process_group`` (default group if None),
    and keep them registered as the pool grows, until :func:`deregister`.

    Uses ``ProcessGroupNCCL.register_mem_pool`` (torch >= 2.6) on the torch
    pools behind ``mempool(pool)`` (made now if needed); torch >= 2.8 then
    registers new segments itself. On torch 2.6/2.7, which registers only the
    segments present and refuses to register one twice, the registration is
    lifted while a thread is inside ``mempool(pool)`` and renewed when it
    leaves (collectives inside stay correct, without zero-copy). Without
    register_mem_pool, ``ncclCommRegister`` is called on each segment
    (communicator from ``backend._comm_ptr()``) and new segments are
    registered when a ``mempool(pool)`` context exits. The communicator must
    exist: pass ``device_id`` to ``init_process_group`` or run a collective
    first.
    """
    if not isinstance(pool, MemPool):
        raise TypeError(f"pool must be a gpumempool.MemPool, got {type(pool).__name__}")
    torch = _import_torch()
    caps = capabilities(torch)
    _require_mem_pool(caps)
    dev = _cuda_index(torch, device)
    group, backend = _group_and_backend(torch, process_group, dev)
    if hasattr(backend, "register_mem_pool"):
        reg = _Registration(group, dev, backend, "mem_pool")
    elif hasattr(backend, "_comm_ptr"):
        comm = backend._comm_ptr()
        comm = int(comm() if callable(comm) else comm)
        if not comm:
            raise TorchIntegrationError(
                "the process group's NCCL communicator is not created yet: pass device_id to "
                "init_process_group, or run one collective, before registering"
            )
        reg = _Registration(group, dev, backend, "comm_register", comm=comm)
        _nccl_lib()
    else:
        raise TorchVersionError(
            f"{type(backend).__name__} offers neither register_mem_pool (torch >= 2.6) nor _comm_ptr; "
            "cannot register with NCCL"
        )
    with _lock:
        st = _state(pool)
        assert st is not None
        if any(r.group is group and r.device == dev for r in st.registrations):
            return
        lanes = [ln for ln in st.lanes if ln.device == dev]
        if not lanes:
            try:
                lanes = [_new_lane(torch, caps, st, dev, None, {})]
            except RuntimeError as exc:
                if _installed is not None and "createOrIncrefPool" in str(exc):
                    raise TorchIntegrationError(
                        f"gmp.register needs a torch.cuda.MemPool (torch's register_mem_pool takes one), which "
                        f"torch {caps.version} refuses to make while gmp.set_torch_allocator("
                        f"{_installed.pool.name!r}) replaces its allocator ({exc}): NCCL registration is not "
                        "available in full-replacement mode on this torch"
                    ) from exc
                raise
        done: list[_Lane] = []
        try:
            for ln in lanes:
                _register_lane(torch, caps, reg, ln)
                done.append(ln)
        except BaseException:
            for ln in done:
                with contextlib.suppress(Exception):
                    _deregister_lane(reg, ln)
            raise
        st.registrations.append(reg)


def deregister(pool: MemPool, process_group: Any = None, *, device: Any = None) -> None:
    """Undo :func:`register` for ``process_group`` (default group if None) on
    ``device`` (every device when None). Call it (or close the pool) before
    ``torch.distributed.destroy_process_group()``; after it, the
    communicator is gone along with its registrations, and this only
    forgets them (with no group left, ``process_group=None`` means all)."""
    if not isinstance(pool, MemPool):
        raise TypeError(f"pool must be a gpumempool.MemPool, got {type(pool).__name__}")
    torch = _import_torch()
    dev = None if device is None else _cuda_index(torch, device)
    with _lock:
        st = _state(pool, create=False)
        if st is None:
            return
        if process_group is None:
            dist = getattr(torch, "distributed", None)
            group = dist.distributed_c10d._get_default_group() if dist is not None and dist.is_initialized() else None
        else:
            group = process_group
        regs = [r for r in st.registrations if (group is None or r.group is group) and (dev is None or r.device == dev)]
        errors: list[BaseException] = []
        for reg in regs:
            # Every lane is tried. A registration is forgotten once all its
            # lanes are undone; the lanes that failed stay, for a retry, and
            # the first error is raised after the others were tried.
            failed = False
            for ln in st.lanes:
                if ln.device == reg.device:
                    try:
                        _deregister_lane(reg, ln)
                    except RuntimeError as exc:
                        errors.append(exc)
                        failed = True
            if not failed:
                st.registrations.remove(reg)
        if errors:
            raise errors[0]


# ---------------------------------------------------------------------------
# full replacement
# ---------------------------------------------------------------------------

def hook_errors() -> list[str]:
    """The last error recorded by a call torch made into the installed pool
    (alloc, free or one of the hooks: their C signatures return nothing, so
    errors cannot propagate through torch's C++), and the last of a call
    torch made on the C functions of a pool already closed (frees of
    tensors that outlived it); returned and cleared."""
    from ._native import bindings as _b

    out: list[str] = []
    if _installed is not None and not _installed.pool.closed:
        try:
            msg = _installed.pool.last_error()
        except PoolClosedError:  # closed meanwhile
            msg = None
        if msg:
            out.append(msg)
    orphan = _b.PoolTakeError(0)
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
        small shim (``gpumempool/torch_oom.cpp``) against the running torch's
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
    torch = _import_torch()
    caps = capabilities(torch)
    if not caps.pluggable:
        raise TorchVersionError(f"torch {caps.version} has no CUDAPluggableAllocator/change_current_allocator")
    with _lock:
        if _installed is not None:
            if _installed.pool is pool and (
                _installed.oom_error == oom_error or (oom_error == "torch" and _installed.fell_back)
            ):
                _check_open(pool)
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
        _check_open(pool)
        _warn_python_callbacks(pool, "gmp.set_torch_allocator")
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
                alloc_path, alloc_sym, free_sym = _torch_oom.install(torch, path, alloc_sym, free_sym)
            except _torch_oom.ShimBuildError as exc:
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
    return _cuda_index(_import_torch(), device)


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


def _reset_for_tests() -> None:
    """Forget every torch pool, registration and installed allocator (tests)."""
    global _installed, _warned_process_wide, _nccl
    with _lock:
        _states.clear()
        _closing.clear()
        _caps_cache.clear()
        _installed = None
        _warned_process_wide = False
        _nccl = None
    _tls.frames = []
    with _routes_lock:
        _active_routes.clear()
        _orphans.clear()
    from ._native import bindings as _b

    _b.PoolTakeError(0)  # errors of calls on closed pools' slots, process-wide


def forget_pool(pool: MemPool) -> Optional[str]:
    """Called by MemPool.close: mark the pool closing (no thread can make a
    torch pool or registration over it from now on), drop every NCCL
    registration of every torch pool over it with every process group, give
    back torch's segments and drop the pool's state. Touches torch only
    when the pool was used with it; never raises. Returns what could not be
    done (tensors from the pool still alive, a failed deregistration), or
    None."""
    problems: list[str] = []
    with _lock:
        _closing.add(pool)
        st = _state(pool, create=False)
        if st is None:
            return None
        # First, and whatever release() says: registrations left behind would
        # make NCCL use memory the engine is about to give back.
        for reg in list(st.registrations):
            for ln in list(reg.lanes):
                try:
                    _deregister_lane(reg, ln)
                except Exception as exc:  # noqa: BLE001 - closing must go on
                    problems.append(f"deregistering a torch pool on cuda:{reg.device} from NCCL failed: {exc}")
            st.registrations.remove(reg)
    try:
        release(pool)
    except TorchIntegrationError as exc:  # PoolInUseError, segments torch still holds
        problems.append(str(exc))
        with _lock:
            st2 = _states.get(id(pool))
            if st2 is not None:
                _orphans.extend(st2.lanes)
    except Exception as exc:  # noqa: BLE001 - closing must not raise
        problems.append(f"releasing torch's pools failed: {exc!r}")
    finally:
        with _lock:
            _states.pop(id(pool), None)
    return "; ".join(problems) or None


def exit_leaks(pool: MemPool, blocks: int, nbytes: int) -> tuple[int, int, str]:
    """For the leak report at interpreter exit (gpumempool._pool): the
    engine's ``blocks`` and ``nbytes`` still allocated, less the segments
    torch keeps cached in the pool's torch pools (``gmp.mempool``) with no
    tensor in them, which are not leaks; plus a note for the message. Pools
    torch never used are returned as they are without touching torch.
    Reads torch's snapshot of those torch pools only; never raises."""
    try:
        if not _lock.acquire(timeout=5):  # a thread stuck holding it must not hang the exit
            return blocks, nbytes, ""
        try:
            st = _states.get(id(pool))
            lanes = [ln for ln in st.lanes if ln.torch_pool is not None] if st is not None else []
        finally:
            _lock.release()
        if not lanes:
            return blocks, nbytes, ""
        hint = "gmp.torch.release(pool) gives them back to the pool"
        try:
            torch = _import_torch()
            caps = capabilities(torch)
            segs = [s for ln in lanes for s in _segments(torch, caps, ln.torch_pool)]
        except Exception:  # noqa: BLE001 - torch half torn down: say what it may be
            return blocks, nbytes, (
                f"; torch's pools over it (gmp.mempool) keep freed blocks cached and count here: {hint}")
        cached = [s for s in segs if not int(s.get("allocated_size", 0) or 0)]
        blocks = max(0, blocks - len(cached))
        nbytes = max(0, nbytes - sum(int(s.get("total_size", 0) or 0) for s in cached))
        used = [s for s in segs if int(s.get("allocated_size", 0) or 0)]
        note = ""
        if used:
            note = (f"; {len(used)} of them, {sum(int(s.get('total_size', 0) or 0) for s in used)} bytes, are "
                    "segments of torch pools over it (gmp.mempool) holding tensors still alive")
        return blocks, nbytes, note
    except Exception:  # noqa: BLE001 - an exit report must not fail
        return blocks, nbytes, ""


def _close_hook(pool: MemPool) -> Optional[str]:
    """MemPool.close's first stage (:func:`forget_pool`). When torch could
    not let go of everything, torch pools over the pool's C functions live
    on and may still call them: the functions' slot must never serve
    another pool."""
    try:
        problem = forget_pool(pool)
    except Exception as exc:  # noqa: BLE001 - closing must not raise
        problem = f"gpumempool.torch.forget_pool raised {type(exc).__name__}: {exc}"
    if problem:
        try:
            _native.bindings.PoolRetireSlot(pool.handle)
        except Exception:  # noqa: BLE001 - closed meanwhile
            pass
    return problem


_lifecycle.on_close(_close_hook, _lifecycle.FIRST)
_lifecycle.on_exit_leaks(exit_leaks)
_lifecycle.provide("register", register)
_lifecycle.provide("deregister", deregister)
_lifecycle.provide("release", release)
