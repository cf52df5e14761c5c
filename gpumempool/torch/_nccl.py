"""NCCL user-buffer registration of one lane (a torch pool) with one
process group: ``ProcessGroupNCCL.register_mem_pool`` where torch has it,
else ``ncclCommRegister`` per segment on the communicator torch made, through
the engine's libnccl (gocore/nccl/libnccl: the copy torch loaded), so that
the process opens NCCL in one place."""

from __future__ import annotations

from typing import Any, Optional

from .. import _native
from .._errors import ForkedProcessError, translate
from .._pool import MemPool
from ._capabilities import TorchCapabilities
from ._errors import TorchIntegrationError, TorchVersionError
from ._lanes import Lane, Registration, pool_state, torch_segments

__all__ = ["NcclLib", "deregister_lane", "lane_freed", "lane_taken", "nccl_lib", "register_lane", "reset"]


def _message(exc: RuntimeError) -> str:
    """The engine's message, without the exception kind it starts with."""
    return str(translate(exc))


class NcclLib:
    """ncclCommRegister / ncclCommDeregister of the libnccl the engine loads
    for the nccl backend (``bindings.NcclCommRegister``): the NCCL already
    in the process (torch's), else ``$GMP_LIBNCCL``, else the loader's
    ``libnccl.so.2``. Made only where that library has both functions."""

    def __init__(self) -> None:
        try:
            #: The library, e.g. "NCCL 2.23.4 (/path/libnccl.so.2)".
            self.description: str = _native.bindings.NcclRegistrationLibrary()
        except ForkedProcessError:
            raise
        except RuntimeError as exc:
            raise TorchVersionError(f"cannot load libnccl for ncclCommRegister: {_message(exc)}") from None

    def register(self, comm: int, ptr: int, size: int) -> int:
        """ncclCommRegister(comm, ptr, size): the registration's handle."""
        try:
            return int(_native.bindings.NcclCommRegister(comm, ptr, size))
        except ForkedProcessError:
            raise
        except RuntimeError as exc:
            raise TorchIntegrationError(f"ncclCommRegister failed: {_message(exc)}") from None

    def deregister(self, comm: int, handle: int) -> None:
        """ncclCommDeregister(comm, handle)."""
        try:
            _native.bindings.NcclCommDeregister(comm, handle)
        except ForkedProcessError:
            raise
        except RuntimeError as exc:
            raise TorchIntegrationError(f"ncclCommDeregister failed: {_message(exc)}") from None


_loaded: Optional[NcclLib] = None


def nccl_lib() -> NcclLib:
    """The engine's libnccl, checked for ncclCommRegister on first use."""
    global _loaded
    if _loaded is None:
        _loaded = NcclLib()
    return _loaded


def _legacy_registration(caps: Optional[TorchCapabilities]) -> bool:
    """register_mem_pool registers only the segments present (torch < 2.8)."""
    return caps is None or not caps.nccl_registers_new_segments


def register_lane(torch: Any, caps: Optional[TorchCapabilities], reg: Registration, lane: Lane) -> None:
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


def _sync_handles(torch: Any, caps: Optional[TorchCapabilities], reg: Registration, lane: Lane) -> None:
    """ncclCommRegister the lane's new segments, deregister vanished ones."""
    nccl = nccl_lib()
    handles: dict[int, tuple[int, int]] = reg.lanes.setdefault(lane, {})
    present = {int(s["address"]): int(s["total_size"]) for s in torch_segments(torch, caps, lane.torch_pool)}
    for addr in [a for a in handles if a not in present]:
        nccl.deregister(reg.comm, handles.pop(addr)[0])
    for addr, size in present.items():
        if addr not in handles:
            handles[addr] = (nccl.register(reg.comm, addr, size), size)


#: What torch says when the communicator of a process group is gone
#: (``destroy_process_group``, an abort): ncclCommDestroy has already dropped
#: every registration it held, so there is nothing left to undo.
_COMM_GONE = ("communicator was aborted", "has not been initialized", "communicator is aborted")


def deregister_lane(reg: Registration, lane: Lane) -> None:
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
        nccl = nccl_lib()
        for key, (handle, _) in list(state.items()):
            nccl.deregister(reg.comm, handle)
            del state[key]
    reg.lanes.pop(lane, None)


def _registrations_of(pool: MemPool, lane: Lane) -> list[Registration]:
    st = pool_state(pool, create=False)
    return [r for r in st.registrations if r.device == lane.device and lane in r.lanes] if st is not None else []


def lane_taken(torch: Any, caps: Optional[TorchCapabilities], pool: MemPool, lane: Lane) -> None:
    """A thread starts routing to the lane. torch < 2.8 registers a pool's
    segments once and refuses to register one twice or deregister one it did
    not register, so a registration that cannot follow growth by itself is
    lifted while the pool may grow and renewed on leaving (as NVIDIA apex's
    nccl_mem does): collectives inside stay correct, without zero-copy."""
    for reg in _registrations_of(pool, lane):
        if reg.mode == "mem_pool" and _legacy_registration(caps) and reg.lanes[lane] == "registered":
            reg.backend.deregister_mem_pool(lane.torch_pool)
            reg.lanes[lane] = "suspended"


def lane_freed(torch: Any, caps: Optional[TorchCapabilities], pool: MemPool, lane: Lane) -> None:
    """No thread routes to the lane any more: bring registrations up to date."""
    for reg in _registrations_of(pool, lane):
        if reg.mode == "mem_pool":
            if reg.lanes[lane] == "suspended":
                reg.backend.register_mem_pool(lane.torch_pool)
                reg.lanes[lane] = "registered"
        else:
            _sync_handles(torch, caps, reg, lane)


def reset() -> None:
    """Forget the libnccl checked (tests)."""
    global _loaded
    _loaded = None
