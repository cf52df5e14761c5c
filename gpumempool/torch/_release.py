"""Giving back what torch holds of a pool: :func:`release` (torch's
cached segments back to the engine), :func:`forget_pool` (what
MemPool.close does with torch first) and :func:`exit_leaks` (the blocks
torch keeps cached are no leaks at exit)."""

from __future__ import annotations

import contextlib
import gc
import threading
import warnings
from typing import Any, Optional

from .._errors import PoolClosedError
from .._pool import MemPool
from . import _lanes, _routing
from ._capabilities import TorchCapabilities, capabilities, cuda_index, import_torch, require_pool_release
from ._errors import PoolInUseError, RetainedTorchPoolWarning, TorchIntegrationError
from ._lanes import (
    Lane,
    Spans,
    closing_pools,
    foreign_segments,
    orphan_lanes,
    pool_state,
    pool_states,
    retain,
    torch_segments,
    torch_segments_of,
)
from ._nccl import deregister_lane
from ._routing import active_routes

__all__ = ["exit_leaks", "forget_pool", "pool_release", "release"]

_ALL = object()

def _scan_lanes(torch: Any, caps: "TorchCapabilities", lanes: list["Lane"]) -> tuple[
        list[tuple["Lane", list[dict[str, Any]]]], int, int]:
    """Each lane's torch segments, and the blocks and bytes still allocated
    in them."""
    live_blocks = live_bytes = 0
    per_lane: list[tuple[Lane, list[dict[str, Any]]]] = []
    for ln in lanes:
        segs = torch_segments(torch, caps, ln.torch_pool)
        per_lane.append((ln, segs))
        for s in segs:
            used = int(s.get("allocated_size", 0) or 0)
            if used:
                live_bytes += used
                live_blocks += sum(1 for b in s.get("blocks", []) if str(b.get("state", "")).startswith("active_allocated")) or 1
    return per_lane, live_blocks, live_bytes


def _engine_addresses(pool: MemPool) -> dict[int, Spans]:
    """The address ranges of the pool's segments in the engine, by device
    (``addr in out[device]``: the address lies in one); none when the pool
    is closed (then every torch segment counts as foreign, and its torch
    pool is kept rather than destroyed)."""
    out: dict[int, Spans] = {}
    with contextlib.suppress(PoolClosedError):
        for seg in pool.segments():
            out.setdefault(int(seg["device"]), Spans()).add(int(seg["address"]), int(seg["size"]))
    return out


def _retain_warning(torch: Any, pool: MemPool, ln: Lane, segs: list[dict[str, Any]],
                    foreign: list[dict[str, Any]]) -> str:
    ours = sum(int(s.get("total_size", 0) or 0) for s in segs) - sum(int(s.get("total_size", 0) or 0) for s in foreign)
    return (
        f"torch {torch.__version__}'s pool over {pool.name!r} on cuda:{ln.device} holds {len(foreign)} segment(s), "
        f"{sum(int(s.get('total_size', 0) or 0) for s in foreign)} bytes, that another thread (autograd's backward) "
        "allocated with cudaMalloc: torch 2.5-2.7 take the allocator from a thread-local MemPoolContext, and "
        "torch's MemPool destructor would free them through the pool's free function and abort the process. "
        f"That torch pool is kept for the life of the process, with {ours} bytes of {pool.name!r} (the next "
        "gmp.mempool(pool) gets a new one); run backward outside gmp.mempool on this torch, or use torch >= 2.8"
    )


def retain_foreign(torch: Any, caps: TorchCapabilities, pool: MemPool, lanes: list[Lane]) -> list[str]:
    """Keep for good (:func:`_lanes.retain`) the lanes whose torch pools hold
    segments gpumempool did not allocate; return a warning for each (call
    under _lanes.lock, with no route under way)."""
    ours = _engine_addresses(pool)
    said = []
    for ln in lanes:
        if ln.torch_pool is None:
            continue
        segs = torch_segments(torch, caps, ln.torch_pool)
        foreign = foreign_segments(segs, ours.get(ln.device, set()))
        if foreign:
            retain(ln, pool)
            said.append(_retain_warning(torch, pool, ln, segs, foreign))
    return said


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
    Raises :class:`TorchVersionError` where torch cannot give a torch pool
    back (torch 2.5, ``capabilities().pool_release``: it never frees a
    MemPool's pool, and forcing it frees our segments with cudaFree). A
    torch pool holding segments gpumempool did not allocate (torch 2.5-2.7
    make those of autograd's thread with cudaMalloc) is not destroyed,
    since its destructor would free them through the pool's free function
    and abort the process: it is kept for the life of the process, with a
    :class:`RetainedTorchPoolWarning`, and its bytes are not counted.
    NCCL registrations stay: they apply to the next torch pool too. When
    torch's MemPool destructor did not free the segments (older versions),
    this calls ``torch.cuda.empty_cache()``, which also empties torch's own
    cache.
    """
    with _lanes.lock:
        st = pool_state(pool, create=False)
        if st is None or not st.lanes:
            if to_backend and not pool.closed:
                pool.empty_cache()
            return 0
        torch = import_torch()
        caps = capabilities(torch)
        dev = None if device is None else cuda_index(torch, device)
        lanes = [ln for ln in st.lanes if (dev is None or ln.device == dev) and (tag is _ALL or ln.tag == tag)]
        if not lanes:
            if to_backend and not pool.closed:
                pool.empty_cache()
            return 0
        require_pool_release(caps)
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
        with _routing.routes_lock:
            routing = sorted({ln.device for ln in lanes if active_routes.get(ln.device)})
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
            ours = _engine_addresses(pool)
            retained: list[str] = []
            for ln, segs in per_lane:
                for reg in st.registrations:
                    if reg.device == ln.device:
                        deregister_lane(reg, ln)
                st.lanes.remove(ln)
                foreign = foreign_segments(segs, ours.get(ln.device, set()))
                if foreign:
                    retain(ln, pool)
                    retained.append(_retain_warning(torch, pool, ln, segs, foreign))
                    continue
                ids.add(tuple(ln.torch_pool.id))
                total += sum(int(s.get("total_size", 0) or 0) for s in segs)
                ln.torch_pool = None  # the MemPool's destructor releases it in torch
            del per_lane, lanes
            gc.collect()
            left = torch_segments_of(torch, ids) if ids else []
            if left:
                # Versions whose MemPool destructor does not empty the pool: torch
                # frees the segments of pools nobody uses on empty_cache().
                torch.cuda.empty_cache()
                left = torch_segments_of(torch, ids)
        if not st.lanes and not st.registrations and not left:
            pool_states.pop(id(pool), None)
    for message in retained:
        warnings.warn(message, RetainedTorchPoolWarning, stacklevel=2)
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


def forget_pool(pool: MemPool) -> Optional[str]:
    """Called by MemPool.close: mark the pool closing (no thread can make a
    torch pool or registration over it from now on), drop every NCCL
    registration of every torch pool over it with every process group, give
    back torch's segments and drop the pool's state. Touches torch only
    when the pool was used with it; never raises. Returns what could not be
    done (tensors from the pool still alive, a failed deregistration), or
    None."""
    problems: list[str] = []
    with _lanes.lock:
        closing_pools.add(pool)
        st = pool_state(pool, create=False)
        if st is None:
            return None
        # First, and whatever release() says: registrations left behind would
        # make NCCL use memory the engine is about to give back.
        for reg in list(st.registrations):
            for ln in list(reg.lanes):
                try:
                    deregister_lane(reg, ln)
                except Exception as exc:  # noqa: BLE001 - closing must go on
                    problems.append(f"deregistering a torch pool on cuda:{reg.device} from NCCL failed: {exc}")
            st.registrations.remove(reg)
        if st.lanes:
            torch = import_torch()
            caps = capabilities(torch)
            if not caps.pool_release:
                return _forget_unreleasable(torch, caps, pool, st.lanes, problems)
    try:
        release(pool)
    except TorchIntegrationError as exc:  # PoolInUseError, segments torch still holds
        problems.append(str(exc))
        with _lanes.lock:
            st2 = pool_states.get(id(pool))
            if st2 is not None:
                # kept for good where their destructor would abort, dropped once no route is under way otherwise
                with contextlib.suppress(Exception):
                    problems += retain_foreign(import_torch(), capabilities(), pool, st2.lanes)
                orphan_lanes.extend(st2.lanes)
    except Exception as exc:  # noqa: BLE001 - closing must not raise
        problems.append(f"releasing torch's pools failed: {exc!r}")
    finally:
        with _lanes.lock:
            pool_states.pop(id(pool), None)
    return "; ".join(problems) or None


def _forget_unreleasable(torch: Any, caps: TorchCapabilities, pool: MemPool, lanes: list[Lane],
                         problems: list[str]) -> Optional[str]:
    """forget_pool on a torch that cannot release a torch pool (torch 2.5,
    ``TorchCapabilities.pool_release``): torch keeps each of the pool's torch
    pools, and the blocks cached in them, for the life of the process, but
    routes nothing to them once their MemPool objects are gone (their ids
    are never handed out again) and never frees them, so the engine may
    return their segments to the backend. Tensors still alive in them lose
    their memory: said, as on every torch. (Call under _lanes.lock.)"""
    try:
        _, live_blocks, live_bytes = _scan_lanes(torch, caps, lanes)
    except Exception as exc:  # noqa: BLE001 - closing must go on: assume the worst
        live_blocks, live_bytes = 0, 0
        problems.append(f"reading torch's segments of the pool failed ({exc!r}); tensors from it may still be alive")
    if live_bytes:
        problems.append(
            f"{live_blocks} tensor block(s), {live_bytes} bytes, allocated inside gmp.mempool(...) are still alive "
            "and lose their memory"
        )
    # The segments torch keeps cached there go back to the engine (each is one
    # engine segment, pluggable_symbols(segments=True)), so that closing it
    # counts no live block for them.
    # Only the engine's own: segments autograd's thread cudaMalloc'd into a
    # torch pool (backward inside gmp.mempool) are none of the engine's, and
    # one failed free must not keep the engine's others from going back.
    ours: dict[int, Spans] = {}
    with contextlib.suppress(Exception):
        ours = _engine_addresses(pool)
    for ln in lanes:
        segs: list[dict[str, Any]] = []
        with contextlib.suppress(Exception):
            segs = torch_segments(torch, caps, ln.torch_pool)
        for seg in segs:
            with contextlib.suppress(Exception):
                addr = int(seg["address"])
                if not int(seg.get("allocated_size", 0) or 0) and addr in ours.get(ln.device, set()):
                    pool.free(addr)
    # torch 2.5's MemPool has no destructor: dropping it does nothing in torch
    orphan_lanes.extend(lanes)
    pool_states.pop(id(pool), None)
    return "; ".join(problems) or None


def exit_leaks(pool: MemPool, blocks: int, nbytes: int) -> tuple[int, int, str]:
    """For the leak report at interpreter exit (gpumempool._pool): the
    engine's ``blocks`` and ``nbytes`` still allocated, less the segments
    torch keeps cached in the pool's torch pools (``gmp.mempool``) with no
    tensor in them, which are not leaks; plus a note for the message. Pools
    torch never used are returned as they are without touching torch.
    Reads torch's snapshot of those torch pools only; never raises."""
    try:
        if not _lanes.lock.acquire(timeout=5):  # a thread stuck holding it must not hang the exit
            return blocks, nbytes, ""
        try:
            st = pool_states.get(id(pool))
            lanes = [ln for ln in st.lanes if ln.torch_pool is not None] if st is not None else []
            kept = [ln for ln in _lanes.retained_lanes if ln.retained_for is not None and ln.retained_for() is pool]
        finally:
            _lanes.lock.release()
        if not lanes and not kept:
            return blocks, nbytes, ""
        hint = "gmp.torch.release(pool) gives them back to the pool (torch >= 2.6)"
        try:
            torch = import_torch()
            caps = capabilities(torch)
            segs = [s for ln in lanes for s in torch_segments(torch, caps, ln.torch_pool)]
            ours = _engine_addresses(pool) if kept else {}
            kept_segs = [s for ln in kept for s in torch_segments(torch, caps, ln.torch_pool)
                         if int(s.get("address", 0) or 0) in ours.get(ln.device, set())]
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
        if kept_segs:
            note += (f"; torch pools over it kept for good (RetainedTorchPoolWarning) hold {len(kept_segs)} "
                     f"segment(s) of it, {sum(int(s.get('total_size', 0) or 0) for s in kept_segs)} bytes")
        return blocks, nbytes, note
    except Exception:  # noqa: BLE001 - an exit report must not fail
        return blocks, nbytes, ""
