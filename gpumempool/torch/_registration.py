"""Registering a pool with a process group's NCCL communicator:
:func:`register` / :func:`deregister` (per lane: gpumempool.torch._nccl)."""

from __future__ import annotations

import contextlib
from typing import Any

from .._pool import MemPool
from . import _lanes, _nccl, _replace
from ._capabilities import capabilities, cuda_index, import_torch, require_mem_pool
from ._errors import TorchIntegrationError, TorchVersionError
from ._lanes import Lane, Registration, pool_state
from ._nccl import deregister_lane, register_lane
from ._routing import new_lane

__all__ = ["deregister", "register"]


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
    (communicator from ``backend._comm_ptr()``; the function of the NCCL
    torch loaded, which the engine calls, as the nccl backend does) and new
    segments are registered when a ``mempool(pool)`` context exits. The
    communicator must exist: pass ``device_id`` to ``init_process_group`` or
    run a collective first.
    """
    if not isinstance(pool, MemPool):
        raise TypeError(f"pool must be a gpumempool.MemPool, got {type(pool).__name__}")
    torch = import_torch()
    caps = capabilities(torch)
    require_mem_pool(caps)
    dev = cuda_index(torch, device)
    group, backend = _group_and_backend(torch, process_group, dev)
    if hasattr(backend, "register_mem_pool"):
        reg = Registration(group, dev, backend, "mem_pool")
    elif hasattr(backend, "_comm_ptr"):
        comm = backend._comm_ptr()
        comm = int(comm() if callable(comm) else comm)
        if not comm:
            raise TorchIntegrationError(
                "the process group's NCCL communicator is not created yet: pass device_id to "
                "init_process_group, or run one collective, before registering"
            )
        reg = Registration(group, dev, backend, "comm_register", comm=comm)
        _nccl.nccl_lib()
    else:
        raise TorchVersionError(
            f"{type(backend).__name__} offers neither register_mem_pool (torch >= 2.6) nor _comm_ptr; "
            "cannot register with NCCL"
        )
    with _lanes.lock:
        st = pool_state(pool)
        assert st is not None
        if any(r.group is group and r.device == dev for r in st.registrations):
            return
        lanes = [ln for ln in st.lanes if ln.device == dev]
        if not lanes:
            try:
                lanes = [new_lane(torch, caps, st, dev, None, {})]
            except RuntimeError as exc:
                installed = _replace.torch_allocator_pool()
                if installed is not None and "createOrIncrefPool" in str(exc):
                    raise TorchIntegrationError(
                        f"gmp.register needs a torch.cuda.MemPool (torch's register_mem_pool takes one), which "
                        f"torch {caps.version} refuses to make while gmp.set_torch_allocator("
                        f"{installed.name!r}) replaces its allocator ({exc}): NCCL registration is not "
                        "available in full-replacement mode on this torch"
                    ) from exc
                raise
        done: list[Lane] = []
        try:
            for ln in lanes:
                register_lane(torch, caps, reg, ln)
                done.append(ln)
        except BaseException:
            for ln in done:
                with contextlib.suppress(Exception):
                    deregister_lane(reg, ln)
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
    torch = import_torch()
    dev = None if device is None else cuda_index(torch, device)
    with _lanes.lock:
        st = pool_state(pool, create=False)
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
                        deregister_lane(reg, ln)
                    except RuntimeError as exc:
                        errors.append(exc)
                        failed = True
            if not failed:
                st.registrations.remove(reg)
        if errors:
            raise errors[0]
