"""PyTorch integration: tensors from a gpumempool pool.

Importing this package does not import torch; every function imports it when
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
    libc10; see ``gpumempool.torch._oom``). Inside
    ``mempool`` torch >= 2.8 checks (allocPrimitive) and raises its
    OutOfMemoryError, so the plain C entry points are used there.

``register(pool, process_group=None)`` / ``deregister(...)``
    NCCL user-buffer registration of the pool's segments with a process
    group's communicator, kept up to date as the pool grows (see below).

Which torch versions do what: the tested truth, tests/test_torch_gpu.py
under each minor release from 2.5.1 to 2.15.0 on gpumempool.oracle's fake
CUDA stack (tools/torch_matrix.py, benchmarks/results/torch_versions.md;
CI runs 2.5.1, 2.11.0 and 2.15.0), with the pull requests that made each
difference. Features are detected, not inferred from the version string,
except where noted:

=====================  ====================================================
torch < 2.5            no ``torch.cuda.MemPool``: :class:`TorchVersionError`
2.5                    ``torch.cuda.MemPool(allocator)`` and ``use_mem_pool``
                       (pytorch#133599). Routing uses ``MemPoolContext`` and
                       ``_cuda_beginAllocateToPool`` with an always-true
                       filter: while any thread is inside, **every thread's**
                       allocations on that device go to the pool
                       (pytorch#152861); a :class:`ProcessWideRoutingWarning`
                       says so once. Passes: routing, full replacement with
                       its stats, OOM errors and CUDA graphs, snapshots.
                       Limitations: its MemPool has no ``use_count`` (our
                       ``capabilities().pool_release`` is False): torch never
                       frees its pool, and forcing it frees our segments with
                       cudaFree, so ``release`` (and invalidating a torch
                       cache scope) raises :class:`TorchVersionError`; torch
                       keeps the segments cached for the next entry and
                       ``pool.close()`` returns them to the backend. Under
                       ``set_torch_allocator`` a ``torch.cuda.MemPool``'s
                       private pool outlives it until
                       ``torch._C._cuda_releasePool(device, mp.id)`` (once
                       per ``use_mem_pool`` entry).
2.6, 2.7               + ``MemPool.use_count()``, a destructor that frees the
                       pool through its allocator, ``release`` works;
                       ``ProcessGroupNCCL.register_mem_pool`` (pytorch#133603),
                       which registers the segments present at the call only
                       and refuses to register one twice: the registration is
                       lifted while a thread is inside ``mempool(pool)`` (the
                       pool may grow) and renewed on exit, as NVIDIA apex's
                       ``nccl_mem`` does. ``MemPool.snapshot()`` (we fall
                       back to ``torch.cuda.memory._snapshot()`` without it).
                       Limitation (2.5-2.7): a ``backward()`` inside
                       ``mempool`` puts autograd's segments in the torch pool
                       with cudaMalloc (the allocator comes from a
                       thread-local MemPoolContext); torch's destructor would
                       free them through our free function and abort, so
                       ``release`` keeps that torch pool for good with a
                       :class:`RetainedTorchPoolWarning`. torch refuses a
                       ``torch.cuda.MemPool`` under a pluggable allocator
                       (``ensureExistsAndIncrefPool``).
2.8 and later          routing is thread-local (``_cuda_beginAllocateCurrent
                       ThreadToPool``, pytorch#153356), ``MemPoolContext`` is
                       gone (pytorch#154042), the pool's own allocator makes
                       every segment of it (backward included, with
                       ``all_threads=True``), ``register_mem_pool`` also
                       registers future segments (pytorch#150684, by version);
                       ``MemPool(use_on_oom=)`` (``no_split=`` from 2.10),
                       passed by ``mempool`` where the signature has them.
                       Everything the fake stack checks passes through 2.15;
                       torch refuses a ``torch.cuda.MemPool`` under a
                       pluggable allocator (``createOrIncrefPool``).
2.10 / 2.11            nested ``use_mem_pool`` is LIFO (pytorch#168382); we do
                       not depend on it: entering a pool suspends the
                       thread's active one (end + release, re-begun on exit),
                       so nesting is correct on every version.
every version          sharing a tensor of a pluggable allocator with another
                       process: torch refuses (``shareIpcHandle``).
=====================  ====================================================

Target of the GPU validation: torch 2.11 with CUDA 13 (tests/test_torch_gpu.py,
benchmarks/gpt2_train.py). The version-dispatch logic is tested on CPU
against fakes of the 2.5-2.7 and 2.8+ behaviours (tests/faketorch.py).
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

The package, by concern (every public name is importable from
``gpumempool.torch``): ``_capabilities`` (what the running torch offers),
``_lanes`` (the torch pools made over each pool, and their bookkeeping),
``_routing`` (:func:`mempool`), ``_release`` (:func:`release`, and what
closing a pool does with torch), ``_nccl`` and ``_registration`` (NCCL
registration), ``_replace`` (:func:`set_torch_allocator`) and ``_oom`` (the
out-of-memory shim compiled from ``gpumempool/csrc/torch_oom.cpp``;
:func:`oom_shim_readiness` says whether ``oom_error="torch"`` can have it).
It hears of pools closing through gpumempool._lifecycle, which MemPool calls.
"""

from __future__ import annotations

from typing import Optional

from .. import _lifecycle, _native
from .._pool import MemPool
from . import _capabilities, _lanes, _nccl, _replace, _routing
from ._capabilities import TESTED_TORCH, TorchCapabilities, capabilities
from ._doctor import oom_doctor
from ._errors import (
    AllocatorInitializedError,
    OOMErrorFallbackWarning,
    PoolInUseError,
    ProcessWideRoutingWarning,
    PythonCallbackWarning,
    RetainedTorchPoolWarning,
    RoutingConflictWarning,
    TorchIntegrationError,
    TorchVersionError,
    TorchVersionWarning,
)
from ._oom import readiness as oom_shim_readiness
from ._registration import deregister, register
from ._release import exit_leaks, forget_pool, pool_release, release
from ._replace import hook_errors, set_torch_allocator, torch_allocator_pool, torch_memory_stats, torch_memory_summary
from ._routing import MempoolContext, mempool, torch_pools

__all__ = [
    "AllocatorInitializedError",
    "MempoolContext",
    "OOMErrorFallbackWarning",
    "PoolInUseError",
    "ProcessWideRoutingWarning",
    "PythonCallbackWarning",
    "RetainedTorchPoolWarning",
    "RoutingConflictWarning",
    "TorchCapabilities",
    "TorchIntegrationError",
    "TorchVersionError",
    "TorchVersionWarning",
    "TESTED_TORCH",
    "capabilities",
    "deregister",
    "hook_errors",
    "mempool",
    "oom_doctor",
    "oom_shim_readiness",
    "pool_release",
    "register",
    "release",
    "set_torch_allocator",
    "torch_allocator_pool",
    "torch_memory_stats",
    "torch_memory_summary",
    "torch_pools",
]

# The classes are gpumempool.torch's in reprs, tracebacks and pickles,
# wherever in the package they are defined.
for _cls in (AllocatorInitializedError, MempoolContext, OOMErrorFallbackWarning, PoolInUseError,
             ProcessWideRoutingWarning, PythonCallbackWarning, RetainedTorchPoolWarning, RoutingConflictWarning,
             TorchCapabilities, TorchIntegrationError, TorchVersionError, TorchVersionWarning):
    _cls.__module__ = __name__
del _cls


def _reset_for_tests() -> None:
    """Forget every torch pool, registration and installed allocator (tests)."""
    with _lanes.lock:
        _capabilities.caps_cache.clear()
        _replace.reset()
        _nccl.reset()
        _lanes.reset()
    _routing.reset()
    _native.bindings.PoolTakeError(0)  # errors of calls on closed pools' slots, process-wide


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
_lifecycle.provide("torch_pool_views", _routing.torch_pool_views)
