"""``pool.release()`` / ``gmp.torch.release`` on the fake torch of
tests/faketorch.py: giving back the segments torch cached for a pool once
its tensors are gone, refusals while routes are under way, kept torch
pools, and the warnings about Python allocator functions under torch."""

from __future__ import annotations

import gc
import pickle
import threading
import warnings
from typing import Any

import pytest

import gpumempool as gmp
from gpumempool import torch as gtorch

from faketorch import clean_state, sim  # noqa: F401 - fixtures
from faketorch import MiB, VARIANTS, allocated, inside_in_another_thread, install


# ---------------------------------------------------------------------------
# release
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_release(monkeypatch, sim, variant):
    torch = install(monkeypatch, variant)
    warnings.simplefilter("ignore", gtorch.ProcessWideRoutingWarning)
    with gmp.mempool(sim) as tp:
        x = torch.empty(3 * MiB)
        y = torch.empty(1000)
    del tp
    if variant == "2.5":
        # torch 2.5 never frees a MemPool's pool, and forcing it would use
        # cudaFree: refused, whatever is alive, touching nothing
        for _ in range(2):
            with pytest.raises(gtorch.TorchVersionError, match=r"torch 2\.5\.0\+fake cannot .*needs torch >= 2\.6"):
                gtorch.release(sim)
            assert allocated(sim) == 22 * MiB and len(gtorch.torch_pools(sim)) == 1
            del x, y
            x = y = None
        return
    allocs_before = sim.stats()["num_device_alloc"]
    with pytest.raises(gtorch.PoolInUseError, match=r"2 tensor block\(s\).*still alive") as err:
        gtorch.release(sim)
    assert isinstance(err.value, RuntimeError)
    assert allocated(sim) == 22 * MiB and len(gtorch.torch_pools(sim)) == 1  # untouched
    del x, y
    assert gtorch.release(sim) == 22 * MiB
    assert allocated(sim) == 0 and gtorch.torch_pools(sim) == []
    assert sim.stats()["reserved_bytes.all.current"] > 0  # the engine keeps the segments
    with gmp.mempool(sim) as tp2:  # a new torch pool, fed from the engine's cache
        z = torch.empty(3 * MiB)
    assert z.pid == tp2.id
    assert sim.stats()["num_device_alloc"] == allocs_before
    del z, tp2
    assert gmp.torch.pool_release(sim, to_backend=True) == 20 * MiB
    assert sim.stats()["reserved_bytes.all.current"] == 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_snapshot_holds_torchs_view_of_each_torch_pool(monkeypatch, sim, variant):
    torch = install(monkeypatch, variant)
    warnings.simplefilter("ignore", gtorch.ProcessWideRoutingWarning)
    other = gmp.MemPool("sim", name="untouched", capacity=1 << 26)
    assert "gpumempool_torch_pools" not in gmp.snapshot()  # nothing routed through gmp.mempool yet
    with gmp.mempool(sim) as tp:
        x = torch.empty(3 * MiB)
        y = torch.empty(1000)
    del y  # torch keeps the freed block cached in the torch pool
    snap = gmp.snapshot()
    views = snap["gpumempool_torch_pools"]
    assert [(v["pool"], v["pool_handle"], v["device"], v["torch_pool_id"], v["options"], v["broken"])
            for v in views] == [("torchpool", sim.handle, 0, tuple(tp.id), {}, False)]
    segs = views[0]["segments"]
    assert sorted((s["total_size"], s["allocated_size"], s["segment_pool_id"]) for s in segs) == [
        (2 * MiB, 0, tp.id), (20 * MiB, 20 * MiB, tp.id)]
    # torch's segments are blocks of the gmp pool's segments: beside them, not among them
    ours = [(s["address"], s["address"] + s["total_size"]) for s in snap["segments"]
            if s["gpumempool_pool"] == "torchpool"]
    assert all(any(a <= t["address"] and t["address"] + t["total_size"] <= b for a, b in ours) for t in segs)
    assert {k for k in snap if not k.startswith("gpumempool_")} == {"segments", "device_traces", "allocator_settings"}
    assert pickle.loads(pickle.dumps(snap))["gpumempool_torch_pools"] == views
    del x, tp
    if not gtorch.capabilities().pool_release:  # torch 2.5 keeps its pools: release refuses
        with pytest.raises(gtorch.TorchVersionError, match="release needs torch >= 2.6"):
            gtorch.release(sim)
        other.close()
        return
    gtorch.release(sim)
    assert "gpumempool_torch_pools" not in gmp.snapshot()  # no torch pool left
    other.close()


def test_snapshot_survives_a_torch_pool_torch_cannot_read(monkeypatch, sim):
    torch = install(monkeypatch, "2.11")
    with gmp.mempool(sim, use_on_oom=True) as tp:
        pass

    def broken(*a: Any, **k: Any) -> Any:
        raise RuntimeError("torch says no")

    monkeypatch.setattr(type(tp), "snapshot", broken)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", broken)
    (view,) = gmp.snapshot()["gpumempool_torch_pools"]
    assert view["segments"] == [] and view["error"] == "RuntimeError: torch says no"
    assert view["options"] == {"use_on_oom": True}


def test_release_clears_cublas_workspaces_made_inside(monkeypatch, sim):
    torch = install(monkeypatch)
    workspaces: list[Any] = []  # what torch's cuBLAS handle pool keeps

    def clear() -> None:
        workspaces.clear()

    with gmp.mempool(sim):
        workspaces.append(torch.empty(4 * MiB))  # the first matmul's workspace, made inside
        x = torch.empty(1000)
    with pytest.raises(gtorch.PoolInUseError, match=r"2 tensor block"):
        gtorch.release(sim)  # this torch cannot clear them: both count
    torch._C._cuda_clearCublasWorkspaces = clear
    with pytest.raises(gtorch.PoolInUseError, match=r"1 tensor block"):
        gtorch.release(sim)  # the workspace went, the user's tensor still counts
    assert workspaces == []
    del x
    assert gtorch.release(sim) == 22 * MiB and allocated(sim) == 0


def test_python_callbacks_under_torch_warn_once(monkeypatch, sim):
    torch = install(monkeypatch)
    del torch
    pyfn = gmp.MemPool(alloc=lambda size, dev, stream: None, free=lambda ptr, size, dev, stream: None)
    try:
        with pytest.warns(gtorch.PythonCallbackWarning, match="deadlock") as rec:
            with gmp.mempool(pyfn):
                pass
        assert rec[0].filename == __file__  # points at the user's line
        with warnings.catch_warnings():
            warnings.simplefilter("error", gtorch.PythonCallbackWarning)
            with gmp.mempool(pyfn):  # once per pool
                pass
            with gmp.mempool(sim):  # native allocator: no warning
                pass
    finally:
        gtorch.release(pyfn)
        pyfn.close()


def test_python_callbacks_as_torchs_allocator_warn(monkeypatch):
    install(monkeypatch)
    pyfn = gmp.MemPool(alloc=lambda size, dev, stream: None, free=lambda ptr, size, dev, stream: None)
    try:
        with pytest.warns(gtorch.PythonCallbackWarning, match="set_torch_allocator"):
            gmp.set_torch_allocator(pyfn)
    finally:
        pyfn.close()


def test_release_while_inside_is_refused(monkeypatch, sim):
    install(monkeypatch)
    with inside_in_another_thread(sim):
        with pytest.raises(gtorch.PoolInUseError, match="still inside.*'holder'"):
            gtorch.release(sim)
    assert gtorch.release(sim) == 0


def test_release_while_another_pool_routes_the_device_is_refused(monkeypatch, sim):
    """torch's MemPool destructor (run by release) asserts that no pool
    route is under way on its device, and the assert aborts the process:
    release refuses while any gmp.mempool context is active there, in this
    thread or another, and works once it ended."""
    install(monkeypatch, "2.11")
    other = gmp.MemPool("sim", name="other", capacity=1 << 26)
    with gmp.mempool(sim):
        pass  # sim now has a torch pool to release
    with gmp.mempool(other):
        with pytest.raises(gtorch.PoolInUseError, match="active on cuda:0.*abort"):
            gtorch.release(sim)
    assert gtorch.torch_pools(sim), "nothing was touched"

    with inside_in_another_thread(other):
        with pytest.raises(gtorch.PoolInUseError, match="in any thread"):
            gtorch.release(sim)
    gtorch.release(sim)
    assert gtorch.torch_pools(sim) == []
    other.close()


@pytest.mark.parametrize("phase", ["enter", "exit"])
def test_release_never_runs_a_destructor_under_another_threads_route(monkeypatch, sim, phase):
    """The window around torch's begin/end of another thread's route: a
    route is recorded before torch begins it and dropped after torch ends
    it, and release() keeps new routes out until its MemPool destructors
    have run. The fake's destructor notes when torch would have aborted."""
    torch = install(monkeypatch, "2.11")
    world = torch._world
    other = gmp.MemPool("sim", name="other", capacity=1 << 26)
    with gmp.mempool(sim):
        pass  # sim has a torch pool to release
    aborts: list[Any] = []
    real_empty = world.empty_pool

    def empty_pool(pid: Any) -> None:  # torch's synchronize_and_free_events asserts here
        if world.captures.get(0):
            aborts.append(list(world.captures[0]))
        real_empty(pid)

    world.empty_pool = empty_pool
    in_window, go_on = threading.Event(), threading.Event()
    C = torch._C
    if phase == "enter":
        real = C._cuda_beginAllocateCurrentThreadToPool

        def begin(d: int, pid: Any) -> None:
            real(d, pid)  # torch's route is under way from here
            if threading.current_thread().name == "B":
                in_window.set()
                go_on.wait(10)
        C._cuda_beginAllocateCurrentThreadToPool = begin
    else:
        real = C._cuda_endAllocateToPool

        def end(d: int, pid: Any) -> None:
            if threading.current_thread().name == "B":
                in_window.set()  # torch's route is under way until here
                go_on.wait(10)
            real(d, pid)
        C._cuda_endAllocateToPool = end

    def worker() -> None:
        with gmp.mempool(other):
            pass

    th = threading.Thread(target=worker, name="B")
    th.start()
    assert in_window.wait(10)
    try:
        with pytest.raises(gtorch.PoolInUseError, match="active on cuda:0"):
            gtorch.release(sim)
    finally:
        go_on.set()
        th.join()
    assert aborts == []
    gtorch.release(sim)  # no route now
    assert aborts == [] and gtorch.torch_pools(sim) == []
    other.close()


def test_failed_deregister_tries_every_lane_and_keeps_the_failed_ones(monkeypatch, sim):
    """Two lanes (two threads were inside at once); deregistering the first
    fails: the second is still deregistered, the error is raised, and a
    retry deregisters what failed."""
    torch = install(monkeypatch, "2.11")
    backend = torch._backend
    with inside_in_another_thread(sim):
        with gmp.mempool(sim):
            pass
    tps = gtorch.torch_pools(sim, 0)
    assert len(tps) == 2
    gtorch.register(sim)
    ids = {tuple(tp.id) for tp in tps}
    assert ids <= backend.pools
    working, calls = backend.deregister_mem_pool, []

    def flaky(pool: Any) -> None:
        calls.append(tuple(pool.id))
        if len(calls) == 1:
            raise RuntimeError("NCCL error: transient")
        working(pool)

    backend.deregister_mem_pool = flaky
    with pytest.raises(RuntimeError, match="transient"):
        gtorch.deregister(sim)
    assert len(calls) == 2, "both lanes were tried"
    assert backend.pools & ids == {calls[0]}, "only the failed one is still registered"
    gtorch.deregister(sim)  # the retry
    assert calls[2:] == [calls[0]] and not backend.pools & ids
    gtorch.deregister(sim)  # nothing left
    assert len(calls) == 3


def test_release_of_one_device_and_of_nothing(monkeypatch, sim):
    torch = install(monkeypatch)
    assert gtorch.release(sim) == 0
    with gmp.mempool(sim, device=1):
        torch.empty(100, device=1)
    with gmp.mempool(sim, device=0):
        torch.empty(100)
    gc.collect()
    assert gtorch.release(sim, device=1) == 2 * MiB
    assert [tp.device for tp in gtorch.torch_pools(sim)] == [0]


def test_release_reports_a_torch_pool_kept_alive(monkeypatch, sim):
    torch = install(monkeypatch)
    with gmp.mempool(sim) as kept:
        torch.empty(100)
    gc.collect()
    with pytest.raises(gtorch.TorchIntegrationError, match="still referenced"):
        gtorch.release(sim)
    del kept
    torch.cuda.empty_cache()
    assert allocated(sim) == 0
