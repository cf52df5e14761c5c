"""NCCL user-buffer registration of one lane (a torch pool) with one
process group: ``ProcessGroupNCCL.register_mem_pool`` where torch has it,
else ``ncclCommRegister`` per segment on the communicator torch made, through
the libnccl torch loaded."""

from __future__ import annotations

import ctypes
from typing import Any, Optional

from .._pool import MemPool
from ._capabilities import TorchCapabilities
from ._errors import TorchIntegrationError, TorchVersionError
from ._lanes import Lane, Registration, pool_state, torch_segments

__all__ = ["NcclLib", "deregister_lane", "lane_freed", "lane_taken", "nccl_lib", "register_lane", "reset"]


class NcclLib:
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


_loaded: Optional[NcclLib] = None


def nccl_lib() -> NcclLib:
    """The libnccl torch loaded (by soname), loaded on first use."""
    global _loaded
    if _loaded is None:
        errors = []
        for name in ("libnccl.so.2", "libnccl.so"):
            try:  # by soname: the copy torch already loaded, if any
                _loaded = NcclLib(ctypes.CDLL(name))
                break
            except OSError as exc:
                errors.append(str(exc))
        if _loaded is None:
            raise TorchVersionError("cannot load libnccl for ncclCommRegister: " + "; ".join(errors))
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
    """Forget the libnccl loaded (tests)."""
    global _loaded
    _loaded = None
