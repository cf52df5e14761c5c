"""gmp.mempool, release/close and cache scopes at their edges: routes under
way when torch pools would be destroyed (torch's MemPool destructor aborts
the process then), failures while entering, threads sharing a scope."""

from __future__ import annotations

import gc
import sys
import threading
import warnings
from typing import Any

import pytest

import gpumempool as gmp
from gpumempool import scope as gscope
from gpumempool import torch as gtorch

from faketorch import (  # noqa: F401 - fixtures
    FakeBackend, FakeGroup, clean_state, inside_in_another_thread, install, sim)


def _abort_recorder(torch: Any, device: int = 0) -> list[Any]:
    """torch's MemPool destructor empties the pool; synchronize_and_free_events
    asserts captures_underway.empty() -> abort. Record when that would happen."""
    world, aborts = torch._world, []
    real_empty = world.empty_pool

    def empty_pool(pid: Any) -> None:
        if world.captures.get(device):
            aborts.append(tuple(pid))
        real_empty(pid)

    world.empty_pool = empty_pool
    return aborts


def test_close_never_destroys_a_torch_pool_while_a_route_is_under_way(monkeypatch, sim):
    torch = install(monkeypatch, "2.11")
    other = gmp.MemPool("sim", name="other", capacity=1 << 26)
    with gmp.mempool(sim):
        pass  # sim has an idle torch pool
    aborts = _abort_recorder(torch)
    try:
        with gmp.mempool(other):  # any route on cuda:0, this thread or another
            with pytest.warns(gmp.LeakWarning):
                sim.close()
            gc.collect()
            assert aborts == [], "MemPool destructor ran under a route: abort"
    finally:
        other.close()


@pytest.mark.parametrize("variant", ["2.5", "2.7"])
def test_legacy_release_refuses_while_another_pool_routes_the_device(monkeypatch, sim, variant):
    torch = install(monkeypatch, variant)
    warnings.simplefilter("ignore", gtorch.ProcessWideRoutingWarning)
    other = gmp.MemPool("sim", name="other", capacity=1 << 26)
    with gmp.mempool(sim):
        pass
    aborts = _abort_recorder(torch)
    try:
        with gmp.mempool(other):
            if variant == "2.5":  # torch 2.5 cannot release a torch pool at all: refused first
                with pytest.raises(gtorch.TorchVersionError, match="needs torch >= 2.6"):
                    gtorch.release(sim)
            else:
                with pytest.raises(gtorch.PoolInUseError, match="active on cuda:0"):
                    gtorch.release(sim)
        assert aborts == []
    finally:
        other.close()


def test_failed_registration_of_a_new_lane_does_not_drop_a_torch_pool_under_a_route(monkeypatch, sim):
    torch = install(monkeypatch, "2.11")
    other = gmp.MemPool("sim", name="other", capacity=1 << 26)
    b = FakeBackend(torch._world, "mem_pool")
    gtorch.register(sim, FakeGroup(b))
    gc.collect()
    gtorch.release(sim)  # no lane left; the registration stays
    b.comm_error = True
    aborts = _abort_recorder(torch)
    try:
        with gmp.mempool(other):
            try:
                with gmp.mempool(sim):
                    pass
            except gtorch.TorchIntegrationError:
                pass
            gc.collect()
            assert aborts == [], "MemPool destructor ran under a route: abort"
    finally:
        other.close()


def test_cache_scope_torch_enter_error_is_not_replaced(monkeypatch, sim):
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(gtorch.TorchVersionError):  # gets AssertionError
        with gmp.cache_scope(sim, "s", torch=True):
            pass


def test_cache_scope_torch_enter_failure_does_not_free_the_outer_lane(monkeypatch, sim):
    torch = install(monkeypatch, "2.11")

    def bad_stream(s: Any) -> Any:
        raise RuntimeError("bad stream")

    with gmp.cache_scope(sim, "s", torch=True):
        real_stream = torch.cuda.stream
        torch.cuda.stream = bad_stream
        inner_error: list[BaseException] = []
        try:
            with gmp.cache_scope(sim, "s", torch=True, stream=object()):
                pass
        except BaseException as exc:  # noqa: BLE001
            inner_error.append(exc)
        finally:
            torch.cuda.stream = real_stream
        errors: list[BaseException] = []

        def other_thread() -> None:
            try:
                with gmp.cache_scope(sim, "s", torch=True):
                    pass
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        th = threading.Thread(target=other_thread)
        th.start()
        th.join(10)
        assert errors == [], f"outer entry's torch pool given to another thread: {errors!r} <- {errors[0].__context__!r}"
    assert "bad stream" in str(inner_error[0]), inner_error


def test_cache_scope_keep_false_does_not_mask_the_bodys_exception(monkeypatch, sim):
    torch = install(monkeypatch, "2.11")
    with pytest.raises(ValueError, match="boom"):  # gets PoolInUseError
        with gmp.cache_scope(sim, "k", keep=False, torch=True):
            t = torch.empty(1000)  # noqa: F841 - alive in the traceback's frame
            raise ValueError("boom")


def test_invalidate_never_invalidates_a_scope_entered_meanwhile(monkeypatch, sim):
    install(monkeypatch, "2.11")
    with gmp.cache_scope(sim, "w", torch=True):
        pass
    entered, leave = threading.Event(), threading.Event()
    got: dict[str, Any] = {}

    def worker() -> None:
        try:
            with gmp.cache_scope(sim, "w") as sc:
                entered.set()
                leave.wait(10)
                try:
                    sc.free(sc.alloc(4096))
                except BaseException as exc:  # noqa: BLE001
                    got["err"] = exc
        except gscope.ScopeError as exc:  # also fine: entering refused meanwhile
            got["refused"] = exc
        finally:
            entered.set()

    real_release = gtorch.release

    def release_while_another_thread_enters(*a: Any, **k: Any) -> int:
        n = real_release(*a, **k)
        got["th"] = th = threading.Thread(target=worker)
        th.start()
        assert entered.wait(10)
        return n

    monkeypatch.setattr(gtorch, "release", release_while_another_thread_enters)
    try:
        try:
            gmp.invalidate("w", sim)
        except gscope.ScopeError:
            pass  # the right answer: the scope is entered
    finally:
        leave.set()
        got["th"].join(10)
    assert "err" not in got, f"entered scope invalidated under its thread: {got.get('err')!r}"


def test_keep_false_exit_while_another_thread_is_inside_does_not_raise(sim):
    errors: list[BaseException] = []
    with inside_in_another_thread(enter=lambda: gmp.cache_scope(sim, "loop", keep=False),
                                  body=lambda sc: sc.free(sc.alloc(4096))):
        try:
            with gmp.cache_scope(sim, "loop", keep=False) as sc:
                sc.free(sc.alloc(4096))
        except gscope.ScopeError as exc:
            errors.append(exc)
    assert errors == [], errors
    assert sc.invalidated and sim.stats()["allocated_bytes.all.current"] == 0


def test_routing_conflict_warning_as_error_leaves_no_phantom_route(monkeypatch, sim):
    install(monkeypatch, "2.11")
    other = gmp.MemPool("sim", name="theirs", capacity=1 << 26)
    with inside_in_another_thread(other):
        with warnings.catch_warnings():
            warnings.simplefilter("error", gtorch.RoutingConflictWarning)
            with pytest.raises(gtorch.RoutingConflictWarning):
                with gmp.mempool(sim, all_threads=True):
                    pass
    try:
        assert gtorch._routing.active_routes.get(0) == [], gtorch._routing.active_routes
        gtorch.release(sim)  # nobody routes cuda:0 any more
    finally:
        other.close()


def test_keep_false_exit_while_another_thread_enters_meanwhile(monkeypatch: pytest.MonkeyPatch) -> None:
    """A keep=False entry leaving while another thread enters the same scope
    (after the exit's check that nobody is inside, before invalidate's locked
    re-check) leaves the invalidation to the last thread out: no ScopeError
    from a body that succeeded."""
    pool = gmp.MemPool("sim", name="rv")
    entered, leave = threading.Event(), threading.Event()

    def other():
        with gmp.cache_scope(pool, "x"):  # keep=True
            entered.set()
            leave.wait(5)

    real = gscope.invalidate

    raced = []

    def racing(name, p=None):
        if raced:
            return real(name, p)
        raced.append(1)
        t = threading.Thread(target=other)
        t.start()
        entered.wait(5)  # the other thread is inside now
        try:
            return real(name, p)
        finally:
            leave.set()
            t.join()

    monkeypatch.setattr(gscope, "invalidate", racing)
    try:
        with gmp.cache_scope(pool, "x", keep=False) as s:
            s.free(s.alloc(4096))
        assert s.invalidated and raced
    finally:
        monkeypatch.setattr(gscope, "invalidate", real)
        pool.close()


def test_keep_false_exit_does_not_swallow_a_failing_free() -> None:
    """Only the ScopeError of another thread entering meanwhile is left to
    that thread; an error freeing the scope's blocks is raised."""
    import ctypes

    bufs: dict[int, Any] = {}

    def alloc(size: int, dev: int, st: int) -> int:
        b = ctypes.create_string_buffer(size + 512)
        a = (ctypes.addressof(b) + 511) // 512 * 512
        bufs[a] = b
        return a

    def free(p: int, *a: Any) -> None:
        raise ValueError("free failed")

    pool = gmp.MemPool(alloc=alloc, free=free, release_threshold=1)
    try:
        with pytest.raises(gmp.BackendError):
            with gmp.cache_scope(pool, "s", keep=False) as sc:
                sc.free(sc.alloc(4096))
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pool.close()


MiB = 1 << 20


@pytest.mark.parametrize("via", ["release", "close"])
def test_a_torch_pool_holding_cudamalloc_segments_is_kept_not_destroyed(monkeypatch, sim, via):
    """torch 2.6/2.7: autograd's thread (no MemPoolContext) adds segments to
    the torch pool with cudaMalloc, and torch's MemPool destructor frees them
    through the pluggable allocator, which throws from the destructor: the
    process aborts. release() (and close) keep such a torch pool for good,
    with a warning, and never run its destructor."""
    torch = install(monkeypatch, "2.7")
    warnings.simplefilter("ignore", gtorch.ProcessWideRoutingWarning)
    world = torch._world
    with gmp.mempool(sim) as tp:
        x = torch.empty(1000)
    pid = tuple(tp.id)
    world.native_next += 2 * MiB  # a segment autograd's thread cudaMalloc'd into the pool, freed since
    world.pools[pid].segs[world.native_next] = [2 * MiB, False]
    destroyed: list[Any] = []
    real_empty = world.empty_pool
    world.empty_pool = lambda p: (destroyed.append(tuple(p)), real_empty(p))
    del x, tp
    if via == "release":
        with pytest.warns(gtorch.RetainedTorchPoolWarning, match=r"holds 1 segment\(s\), 2097152 bytes.*cudaMalloc"):
            assert gtorch.release(sim) == 0
        assert gtorch.torch_pools(sim) == []
        # the exit's leak report says where the pool's blocks are (x's segment, not the cudaMalloc'd one)
        ours = [s for s in world.snapshot(pid) if s["address"] in {g["address"] for g in sim.segments()}]
        _, _, note = gtorch.exit_leaks(sim, 1, ours[0]["total_size"])
        assert len(ours) == 1 and note.endswith(
            f"kept for good (RetainedTorchPoolWarning) hold 1 segment(s) of it, {ours[0]['total_size']} bytes")
        with gmp.mempool(sim) as tp2:  # the next entry gets a new torch pool
            z = torch.empty(1000)
        assert tuple(tp2.id) != pid
        del tp2, z
        assert gtorch.release(sim) > 0 and gtorch.torch_pools(sim) == []  # that one holds only ours: it goes
    else:
        with pytest.warns(gtorch.RetainedTorchPoolWarning):
            sim.close()
    gc.collect()
    assert pid not in destroyed and world.pools[pid].segs, "the MemPool destructor ran: abort"
    assert any(tuple(ln.torch_pool.id) == pid for ln in gtorch._lanes.retained_lanes)


def test_close_on_torch_25_returns_torchs_cached_segments(monkeypatch, sim):
    """torch 2.5 never frees a MemPool's pool (release refuses): closing the
    pool gives the engine back the segments torch keeps cached there, and
    says nothing of leaks; a tensor still alive is reported."""
    torch = install(monkeypatch, "2.5")
    warnings.simplefilter("ignore", gtorch.ProcessWideRoutingWarning)
    with gmp.mempool(sim):
        x = torch.empty(3 * MiB)
    with pytest.raises(gtorch.TorchVersionError):
        gtorch.release(sim)
    del x
    with warnings.catch_warnings():
        warnings.simplefilter("error", gmp.LeakWarning)
        report = sim.close()
    assert report.live_blocks == [] and report.bytes_freed >= 3 * MiB

    other = gmp.MemPool("sim", name="other", capacity=1 << 30)
    with gmp.mempool(other):
        y = torch.empty(3 * MiB)
    with pytest.warns(gmp.LeakWarning, match=r"1 tensor block\(s\).*still alive and lose their memory"):
        other.close()
    del y
