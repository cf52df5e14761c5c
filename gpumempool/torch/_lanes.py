"""The bookkeeping of the PyTorch integration: the torch pools ("lanes")
made over each gpumempool pool, their NCCL registrations, the pools being
closed, the gmp.mempool contexts each thread is in, and reading a torch
pool's segments from torch. Everything here is guarded by :data:`lock`."""

from __future__ import annotations

import bisect
import ctypes
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

from .. import _native
from .._errors import PoolClosedError
from .._pool import MemPool
from ._capabilities import TorchCapabilities

__all__ = [
    "Lane",
    "PoolState",
    "Registration",
    "Spans",
    "check_open",
    "closing_pools",
    "foreign_segments",
    "lock",
    "orphan_lanes",
    "retain",
    "retained_lanes",
    "pool_state",
    "pool_states",
    "reset",
    "thread_frames",
    "torch_segments",
    "torch_segments_of",
]


@dataclass(eq=False)
class Lane:
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
    #: kept for good (:func:`retain`): a weak reference to its gpumempool pool
    retained_for: Any = None


@dataclass(eq=False)
class Registration:
    """A pool registered with one process group's NCCL communicator on one device."""

    group: Any
    device: int
    backend: Any
    mode: str  # "mem_pool" (backend.register_mem_pool) or "comm_register" (ncclCommRegister)
    comm: int = 0
    # per lane (the object: an id could be reused by a later lane):
    # "registered"/"suspended" (mem_pool), {address: (handle, size)} (comm_register)
    lanes: dict[Lane, Any] = field(default_factory=dict)


@dataclass(eq=False)
class PoolState:
    """What the integration keeps of one gpumempool pool: the pluggable
    allocator over its C symbols, its lanes and its NCCL registrations."""

    pool: MemPool
    allocator: Any = None  # torch.cuda.memory.CUDAPluggableAllocator over the pool's C symbols
    lanes: list[Lane] = field(default_factory=list)
    registrations: list[Registration] = field(default_factory=list)


#: Guards the bookkeeping below (renewed in a forked child: read it as
#: ``_lanes.lock``, never bind it by name).
lock = threading.RLock()
pool_states: dict[int, PoolState] = {}  # id(pool) -> state; the state keeps the pool alive
#: pools whose close() has begun (forget_pool): no new state, lane or registration
closing_pools: "weakref.WeakSet[MemPool]" = weakref.WeakSet()
_tls = threading.local()
# Lanes whose torch pools could not be released when they had to go (a
# failed registration of a new lane, a pool closed while torch still used
# it): dropping the last reference would run torch's MemPool destructor, which
# aborts the process when a route is under way on the device. They are kept
# here and dropped once no route is (_route_stopped).
orphan_lanes: list["Lane"] = []
#: Lanes whose torch pools must never be destroyed (see :func:`retain`).
retained_lanes: list["Lane"] = []


def retain(lane: "Lane", pool: MemPool) -> None:
    """Keep the lane's torch pool (over ``pool``) for the life of the
    process, through the interpreter's teardown too (one reference no one
    drops): its destructor would abort the process
    (RetainedTorchPoolWarning)."""
    if lane in retained_lanes:
        return
    lane.retained_for = weakref.ref(pool)
    retained_lanes.append(lane)
    if lane.torch_pool is not None:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(lane.torch_pool))


class Spans:
    """The address ranges of a gpumempool pool's segments on one device;
    ``addr in spans`` when an address lies in one of them. A torch segment
    is a block of the engine, carved from an engine segment (one cached
    from an earlier torch pool may hold several): its address is the
    pool's when it lies in a segment, whether or not it starts one."""

    def __init__(self, ranges: Any = ()) -> None:
        self._ranges = sorted((int(a), int(a) + int(n)) for a, n in ranges)
        self._starts = [a for a, _ in self._ranges]

    def add(self, address: int, size: int) -> None:
        self._ranges.append((int(address), int(address) + int(size)))
        self._ranges.sort()
        self._starts = [a for a, _ in self._ranges]

    def __contains__(self, addr: object) -> bool:
        if not isinstance(addr, int):
            return False
        i = bisect.bisect_right(self._starts, addr) - 1
        return i >= 0 and addr < self._ranges[i][1]

    def __len__(self) -> int:
        return len(self._ranges)


def foreign_segments(segs: list[dict[str, Any]], ours: Any) -> list[dict[str, Any]]:
    """The torch segments (snapshot dicts) whose address lies in none of the
    gpumempool pool's segments ``ours`` (:class:`Spans`): torch allocated
    them with another allocator (cudaMalloc) into the torch pool."""
    return [s for s in segs if int(s.get("address", 0) or 0) not in ours]


def thread_frames() -> list[Any]:
    """The calling thread's gmp.mempool contexts entered, outermost first."""
    frames = getattr(_tls, "frames", None)
    if frames is None:
        frames = _tls.frames = []
    return frames


def check_open(pool: MemPool) -> None:
    """PoolClosedError for a pool closed or being closed (call under lock)."""
    if pool.closed or pool in closing_pools:
        raise PoolClosedError(f"pool {pool!r} is closed" if pool.closed else f"pool {pool.name!r} is being closed")


def pool_state(pool: MemPool, create: bool = True) -> Optional[PoolState]:
    """The pool's state (call under lock); made when missing if ``create``,
    which refuses a pool closed or being closed."""
    st = pool_states.get(id(pool))
    if create:
        check_open(pool)  # (under lock) never a new lane over a closing pool
        if st is None:
            st = pool_states[id(pool)] = PoolState(pool)
    return st


def torch_segments(torch: Any, caps: Optional[TorchCapabilities], tp: Any) -> list[dict[str, Any]]:
    """torch's segments of one torch pool (snapshot dicts)."""
    snap = getattr(tp, "snapshot", None)
    if callable(snap):
        try:
            return list(snap())
        except Exception:  # noqa: BLE001 - fall back to the global snapshot
            pass
    return torch_segments_of(torch, {tuple(tp.id)})


def torch_segments_of(torch: Any, pool_ids: set[tuple[int, ...]]) -> list[dict[str, Any]]:
    """torch's segments of the torch pools ``pool_ids``, from its process-wide snapshot."""
    raw = torch.cuda.memory._snapshot()
    segs = raw.get("segments", []) if isinstance(raw, dict) else list(raw)
    return [s for s in segs if tuple(s.get("segment_pool_id", ()) or ()) in pool_ids]


def _new_lock_after_fork() -> None:
    global lock
    lock = threading.RLock()


_native.after_fork_in_child(_new_lock_after_fork)


def reset() -> None:
    """Forget every pool's lanes and registrations, and this thread's
    contexts (tests)."""
    with lock:
        pool_states.clear()
        closing_pools.clear()
    _tls.frames = []
