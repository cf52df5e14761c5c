"""Routing torch's allocations to a gpumempool pool: :func:`mempool` and
its context, over one torch.cuda.MemPool per (pool, device) ("lane"), with
the version differences of torch's routing calls."""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from typing import Any, Optional

from .. import _native
from .._errors import PoolClosedError
from .._pool import MemPool
from . import _lanes, _replace
from ._capabilities import (
    TorchCapabilities,
    capabilities,
    cuda_index,
    import_torch,
    mem_pool_class,
    require_mem_pool,
    use_mem_pool_fn,
)
from ._errors import ProcessWideRoutingWarning, RoutingConflictWarning, TorchIntegrationError, TorchVersionError, \
    warn_python_callbacks
from ._lanes import Lane, PoolState, orphan_lanes, pool_state, thread_frames, torch_segments
from ._nccl import deregister_lane, lane_freed, lane_taken, register_lane

__all__ = ["MempoolContext", "active_routes", "mempool", "new_lane", "reset", "routes_lock", "torch_pool_views",
           "torch_pools"]

_warned_process_wide = False


def _allocator(torch: Any, st: PoolState) -> Any:
    if st.allocator is None:
        st.allocator = torch.cuda.memory.CUDAPluggableAllocator(*st.pool.pluggable_symbols(segments=True))
    return st.allocator


#: The first torch release whose torch.cuda.MemPool takes each option of
#: gmp.mempool (checked against the official wheels: 2.8 added use_on_oom,
#: 2.10 no_split). Used only to word the error: whether an option is there
#: is read from MemPool's signature (TorchCapabilities.mem_pool_options).
MEM_POOL_OPTION_SINCE = {"use_on_oom": "2.8", "no_split": "2.10"}


def new_lane(torch: Any, caps: TorchCapabilities, st: PoolState, device: int, tag: Any, options: dict[str, bool]) -> Lane:
    """A new torch pool over ``st``'s pool on ``device`` (call under
    _lanes.lock), registered with the pool's NCCL registrations on that
    device; nothing is left behind when one of them fails."""
    kwargs: dict[str, bool] = {}
    for name, value in options.items():
        if value and name not in caps.mem_pool_options:
            first = MEM_POOL_OPTION_SINCE.get(name)
            needed = f"torch >= {first}" if first else f"a torch whose MemPool takes {name}"
            raise TorchVersionError(
                f"gmp.mempool({st.pool.name!r}, {name}=True) needs torch.cuda.MemPool's {name} option "
                f"({needed}); torch {caps.version}'s MemPool has none", version=caps.version, needed=needed)
        if name in caps.mem_pool_options:
            kwargs[name] = value
    raw = _allocator(torch, st).allocator()
    # torch binds a MemPool to the current device when it is created
    with torch.cuda.device(device):
        tp = mem_pool_class(torch)(raw, **kwargs)
    lane = Lane(tp, device, tag, dict(options))
    st.lanes.append(lane)
    regs = [reg for reg in st.registrations if reg.device == device]
    try:
        for reg in regs:
            register_lane(torch, caps, reg, lane)
    except BaseException:
        # Undo the registrations made (and what a failed one recorded): the
        # torch pool is dropped, it must not stay registered with NCCL.
        for reg in regs:
            with contextlib.suppress(Exception):
                deregister_lane(reg, lane)
            reg.lanes.pop(lane, None)
        st.lanes.remove(lane)
        orphan_lanes.append(lane)
        raise
    return lane


def _acquire_lane(
    torch: Any, caps: TorchCapabilities, pool: MemPool, device: int, tag: Any, options: dict[str, bool], tid: int
) -> tuple[Lane, bool]:
    """The lane the thread routes to, and whether it just took it."""
    st = pool_state(pool)
    assert st is not None
    free: Optional[Lane] = None
    for lane in st.lanes:
        # torch fixes a MemPool's options when it is made: other options
        # get (or reuse) another torch pool over the same gpumempool pool
        if lane.device != device or lane.tag != tag or lane.options != options or lane.broken:
            continue
        if lane.holder == tid:
            lane.holds += 1
            return lane, False
        if lane.holder is None and free is None:
            free = lane
    lane = free if free is not None else new_lane(torch, caps, st, device, tag, options)
    lane.holder, lane.holds = tid, 1
    return lane, True


def _release_lane(lane: Lane) -> bool:
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
        return use_mem_pool_fn(torch)(tp, device)
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
        self._lane: Optional[Lane] = None
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
        torch = import_torch()
        caps = capabilities(torch)
        require_mem_pool(caps)
        if self._pool.closed:
            raise PoolClosedError(f"pool {self._pool!r} is closed")
        installed = _replace.torch_allocator_pool()
        if installed is not None:
            # Torch's pluggable allocator serves a torch.cuda.MemPool from a
            # private pool of its own (beginAllocateToPool), whatever the
            # MemPool's allocator: routing to self._pool is impossible.
            raise TorchIntegrationError(
                f"gmp.mempool({self._pool.name!r}) cannot route allocations while gmp.set_torch_allocator"
                f"({installed.name!r}) replaces torch's allocator: torch would ignore the MemPool's "
                f"allocator and serve it from a private pool of {installed.name!r}. Every CUDA "
                f"allocation of the process already comes from {installed.name!r}."
            )
        if not torch.cuda.is_available():
            raise TorchIntegrationError("torch sees no CUDA device (torch.cuda.is_available() is False)")
        self._torch, self._caps = torch, caps
        self.device = cuda_index(torch, self._device_arg)
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
        warn_python_callbacks(self._pool, "gmp.mempool")
        tid = threading.get_ident()
        with _lanes.lock:
            self._lane, first = _acquire_lane(torch, caps, self._pool, self.device, self._tag, self._options, tid)
            if first:
                try:
                    lane_taken(torch, caps, self._pool, self._lane)
                except BaseException:
                    _release_lane(self._lane)
                    raise
        frames = thread_frames()
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
            with _lanes.lock:
                if _release_lane(self._lane) and not self._lane.broken:
                    with contextlib.suppress(Exception):
                        lane_freed(torch, caps, self._pool, self._lane)
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
        frames = thread_frames()
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
        with _lanes.lock:
            if _release_lane(self._lane) and not self._lane.broken:
                try:
                    lane_freed(self._torch, self._caps, self._pool, self._lane)
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
#: Guards active_routes; release() holds it across destructors that may run
#: finalizers (renewed in a forked child: read it as ``_routing.routes_lock``).
routes_lock = threading.RLock()
active_routes: dict[int, list[tuple["MempoolContext", int, bool]]] = {}


def _route_started(ctx: "MempoolContext") -> None:
    assert ctx.device is not None
    tid = threading.get_ident()
    with routes_lock:
        routes = active_routes.setdefault(ctx.device, [])
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
    with routes_lock:
        routes = active_routes.get(ctx.device if ctx.device is not None else -1, [])
        routes[:] = [r for r in routes if r[0] is not ctx]
        if orphan_lanes and not any(active_routes.values()):
            # No route is under way, and none starts while the lock is held
            # (as in release()): the torch pools' destructors may run now.
            orphan_lanes.clear()


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
    ``use_on_oom``: torch may serve an allocation outside every pool that
    would otherwise run out of memory from the free blocks it caches in
    this torch pool (never from new segments of ``pool``); such a block
    stays in the torch pool until freed. ``no_split``: torch hands out each
    of this torch pool's segments whole, unsplit (one segment of ``pool``
    per block, however small the tensor). Both are torch.cuda.MemPool's
    options (use_on_oom from torch 2.8, no_split from 2.10; an older torch
    is a :class:`TorchVersionError` naming the option); a torch pool keeps
    the options it was made with, so entering ``pool`` with other options
    routes to another torch pool over it. Torch's limit: while a thread is
    inside a use_on_oom torch pool, another thread's allocation that would
    run out of memory gets torch's RuntimeError "beginAllocateToPool:
    already recording to mempool_id" (checked on torch 2.9 and 2.15).
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
    with _lanes.lock:
        st = pool_state(pool, create=False)
        lanes = list(st.lanes) if st is not None else []
    if device is not None:
        dev = device if isinstance(device, int) and not isinstance(device, bool) else cuda_index(import_torch(), device)
        lanes = [lane for lane in lanes if lane.device == dev]
    return [lane.torch_pool for lane in lanes]


def torch_pool_views(pool: MemPool) -> list[dict[str, Any]]:
    """torch's own view of the torch pools gmp.mempool made over ``pool``,
    oldest first: per torch pool its device, id, options and torch's
    segments of it (``MemPool.snapshot()``, or torch's process-wide snapshot
    where MemPool has none: torch 2.5), which show torch's caching inside
    the pool's segments. Never raises and never imports torch: a torch pool
    torch cannot read gets ``segments`` [] and ``error``."""
    torch = sys.modules.get("torch")
    views: list[dict[str, Any]] = []
    # Read under the lock, as release() reads them: a torch pool this thread
    # still referenced after release() dropped its lane would run its
    # destructor here, outside release()'s guard against routes under way.
    with _lanes.lock:
        st = pool_state(pool, create=False)
        for lane in list(st.lanes) if st is not None else []:
            tp = lane.torch_pool
            view: dict[str, Any] = {"pool": pool.name, "pool_handle": pool.handle, "device": lane.device,
                                    "torch_pool_id": tuple(tp.id), "options": dict(lane.options),
                                    "broken": lane.broken}
            try:
                segments = torch_segments(torch, None, tp)
                view["segments"] = [s for s in segments if s.get("device", lane.device) == lane.device]
            except Exception as exc:  # noqa: BLE001 - a snapshot never fails for torch's sake
                view["segments"], view["error"] = [], f"{type(exc).__name__}: {exc}"
            views.append(view)
            del tp
    return views


def _new_lock_after_fork() -> None:
    global routes_lock
    routes_lock = threading.RLock()


_native.after_fork_in_child(_new_lock_after_fork)


def reset() -> None:
    """Forget the routes under way and the warning given (tests)."""
    global _warned_process_wide
    _warned_process_wide = False
    with routes_lock:
        active_routes.clear()
        orphan_lanes.clear()
