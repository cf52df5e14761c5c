"""The torch integration without a GPU or torch, on the fake torch of
tests/faketorch.py: which torch versions it accepts and what it makes of
each (version dispatch), routing allocations into a pool with
``gmp.mempool`` (nesting, threads, streams, devices, options), and the
fixes of reviews around close, NCCL registrations and lanes.

Release, full replacement, NCCL registration, cache scopes and CuPy have
files of their own (test_torch_release.py, test_torch_replacement.py,
test_torch_nccl.py, test_scope.py, test_cupy.py).
"""

from __future__ import annotations

import gc
import sys
import threading
import types
import warnings
from typing import Any, Optional

import pytest

import gpumempool as gmp
from gpumempool import torch as gtorch

from faketorch import clean_state, sim  # noqa: F401 - fixtures
from faketorch import FakeBackend, FakeGroup, MiB, VARIANTS, allocated, install


# ---------------------------------------------------------------------------
# version dispatch
# ---------------------------------------------------------------------------


def test_without_torch_the_error_says_what_to_install(monkeypatch, sim):
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(gtorch.TorchVersionError, match=r"needs torch >= 2\.5.*gpumempool\[torch\]"):
        with gmp.mempool(sim):
            pass
    with pytest.raises(gtorch.TorchVersionError):
        gmp.set_torch_allocator(sim)
    assert isinstance(gtorch.TorchVersionError("x"), RuntimeError)


def test_torch_without_mempool_is_too_old(monkeypatch, sim):
    install(monkeypatch, "2.4", mem_pool=False)
    with pytest.warns(gtorch.TorchVersionWarning, match=r"tested with torch 2\.5-2\.15; this is torch 2\.4"), \
            pytest.raises(gtorch.TorchVersionError, match=r"torch >= 2\.5.*this is torch 2\.4") as exc:
        with gmp.mempool(sim):
            pass
    assert exc.value.version == "2.4.0+fake" and exc.value.needed == "torch >= 2.5"


def test_a_torch_outside_the_tested_range_warns_once(monkeypatch, sim):
    import warnings

    assert gtorch.TESTED_TORCH == ((2, 5), (2, 15))
    install(monkeypatch, "2.16")
    with pytest.warns(gtorch.TorchVersionWarning, match=r"tested with torch 2\.5-2\.15; this is torch 2\.16\.0"):
        gtorch.capabilities()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gtorch.capabilities()  # once
        with gmp.mempool(sim):
            pass
    install(monkeypatch, "2.11")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gtorch.capabilities()  # a tested torch says nothing


@pytest.mark.parametrize("build, words", [("cpu", "a CPU-only build"), ("rocm", "a ROCm build")])
def test_a_torch_that_is_not_a_cuda_build_is_one_clear_error(monkeypatch, sim, build, words):
    torch = install(monkeypatch, "2.11")
    torch.version = types.SimpleNamespace(cuda=None if build == "cpu" else "12.8",  # type: ignore[attr-defined]
                                          hip="6.2" if build == "rocm" else None)
    for call in (lambda: gmp.mempool(sim).__enter__(), lambda: gtorch.set_torch_allocator(sim)):
        with pytest.raises(gtorch.TorchVersionError, match=f"torch 2.11.0\\+fake is {words}: gpumempool's torch "
                           "integration needs a CUDA build") as exc:
            call()
        assert exc.value.needed == "a CUDA build"


@pytest.mark.parametrize(
    "variant, thread_local, pool_context, options, snapshot, nccl_new",
    [
        ("2.5", False, True, (), False, False),
        ("2.7", False, True, (), True, False),
        ("2.11", True, False, ("use_on_oom", "no_split"), True, True),
    ],
)
def test_capabilities(monkeypatch, variant, thread_local, pool_context, options, snapshot, nccl_new):
    torch = install(monkeypatch, variant)
    caps = gtorch.capabilities()
    assert caps == gtorch.capabilities(torch)
    assert caps.version.startswith(variant)
    assert caps.mem_pool and caps.use_mem_pool and caps.pluggable
    assert caps.thread_local_routing is thread_local
    assert caps.pool_context is pool_context
    assert caps.mem_pool_options == options
    assert caps.pool_snapshot is snapshot
    assert caps.nccl_registers_new_segments is nccl_new


def test_private_calls_replace_a_missing_use_mem_pool(monkeypatch, sim):
    torch = install(monkeypatch, "2.11", use_mem_pool=False)
    caps = gtorch.capabilities()
    assert not caps.use_mem_pool and caps.thread_local_routing
    assert (caps.begin_fn, caps.end_fn) == ("_cuda_beginAllocateCurrentThreadToPool", "_cuda_endAllocateToPool")
    with gmp.mempool(sim) as tp:
        t = torch.empty(1000)
    assert t.pid == tp.id and allocated(sim) == 2 * MiB
    kinds = [c[0] for c in torch._world.calls]
    assert kinds == ["begin", "end", "release"]
    assert torch._world.pools[tp.id].use_count == 1


def test_legacy_private_calls_use_the_pool_context(monkeypatch, sim):
    torch = install(monkeypatch, "2.5", use_mem_pool=False)
    caps = gtorch.capabilities()
    assert (caps.begin_fn, caps.end_fn) == ("_cuda_beginAllocateToPool", "_cuda_endAllocateCurrentStreamToPool")
    with pytest.warns(gtorch.ProcessWideRoutingWarning):
        with gmp.mempool(sim) as tp:
            t = torch.empty(1000)
    assert t.pid == tp.id and not torch._world.misroutes


# ---------------------------------------------------------------------------
# the mempool context
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_routes_inside_and_reuses_one_torch_pool(monkeypatch, sim, variant):
    torch = install(monkeypatch, variant)
    warnings.simplefilter("ignore", gtorch.ProcessWideRoutingWarning)
    outside = torch.empty(1000)
    assert outside.kind == "native"
    with gmp.mempool(sim, device="cuda:0") as tp:
        x = torch.empty(3 * MiB)
    y = torch.empty(10)
    assert x.kind == "private" and x.pid == tp.id and y.kind == "native"
    assert allocated(sim) == 20 * MiB  # torch's segment, from our engine
    with gmp.mempool(sim) as tp2:
        z = torch.empty(3 * MiB)
    assert tp2 is tp and gtorch.torch_pools(sim) == [tp]
    assert z.pid == tp.id and allocated(sim) == 40 * MiB
    del z
    with gmp.mempool(sim):
        w = torch.empty(2 * MiB)  # torch's cache inside the torch pool: no new segment
    assert allocated(sim) == 40 * MiB and w.pid == tp.id
    assert x.alive and x.ptr in torch._world.pools[tp.id].segs  # outlives the block
    if variant == "2.5":  # its use_mem_pool never releases: each entry adds a use
        assert torch._world.pools[tp.id].use_count == 4
    else:
        assert torch._world.pools[tp.id].use_count == 1  # every begin has its release
    assert not torch._world.misroutes


@pytest.mark.parametrize("variant", VARIANTS)
def test_nesting_routes_to_the_innermost_pool(monkeypatch, sim, variant):
    torch = install(monkeypatch, variant)
    warnings.simplefilter("ignore", gtorch.ProcessWideRoutingWarning)
    other = gmp.MemPool("sim", name="inner", capacity=1 << 30)
    try:
        with gmp.mempool(sim) as ta:
            a1 = torch.empty(1000)
            with gmp.mempool(other) as tb:
                b = torch.empty(1000)
                with gmp.mempool(sim) as ta2:  # the outer pool again, inside the inner one
                    a2 = torch.empty(3 * MiB)
                b2 = torch.empty(3 * MiB)
            a3 = torch.empty(12 * MiB)
        n = torch.empty(1000)
        assert ta2 is ta
        assert [t.pid for t in (a1, a2, a3)] == [ta.id] * 3
        assert [t.pid for t in (b, b2)] == [tb.id] * 2
        assert n.kind == "native"
        assert allocated(other) == 2 * MiB + 20 * MiB
        assert allocated(sim) == 2 * MiB + 20 * MiB + 12 * MiB
        assert not torch._world.misroutes  # 2.5-2.7: MemPoolContext stayed consistent
        assert torch._world.captures[0] == []
        if variant != "2.5":  # (2.5's use_mem_pool never releases: each entry adds a use)
            assert torch._world.pools[ta.id].use_count == 1 and torch._world.pools[tb.id].use_count == 1
    finally:
        other.close()


def test_same_pool_nested_in_itself(monkeypatch, sim):
    torch = install(monkeypatch)
    with gmp.mempool(sim) as t1:
        with gmp.mempool(sim) as t2:
            x = torch.empty(100)
        y = torch.empty(100)
    assert t1 is t2 and x.pid == y.pid == t1.id
    assert len(gtorch.torch_pools(sim)) == 1


def test_other_threads_are_not_routed(monkeypatch, sim):
    torch = install(monkeypatch, "2.11")
    got: dict[str, Any] = {}
    with gmp.mempool(sim):
        th = threading.Thread(target=lambda: got.update(t=torch.empty(1000)))
        th.start()
        th.join()
        mine = torch.empty(1000)
    assert got["t"].kind == "native" and mine.kind == "private"


def test_all_threads_routes_other_threads_too(monkeypatch, sim):
    torch = install(monkeypatch, "2.11")
    got: dict[str, Any] = {}
    with gmp.mempool(sim, all_threads=True) as tp:
        th = threading.Thread(target=lambda: got.update(t=torch.empty(1000)))
        th.start()
        th.join()
    assert got["t"].pid == tp.id  # e.g. autograd's backward thread
    assert torch._world.pools[tp.id].use_count == 1 and torch._world.captures[0] == []
    del torch._C._cuda_beginAllocateToPool
    gtorch._capabilities.caps_cache.clear()
    with pytest.raises(gtorch.TorchVersionError, match="all_threads"):
        with gmp.mempool(sim, all_threads=True):
            pass


def test_all_threads_and_another_threads_route_conflict_is_warned(monkeypatch, sim):
    # torch checks the newest route first (2.10+): an all_threads route
    # entered after another thread's own route takes that thread's
    # allocations too - the conflict the warning names.
    torch = install(monkeypatch, "2.11")
    other = gmp.MemPool("sim", name="theirs")
    entered, leave, got = threading.Event(), threading.Event(), {}

    def worker() -> None:
        with gmp.mempool(other) as tp:
            got["tp"] = tp
            entered.set()
            leave.wait(10)
            got["t"] = torch.empty(1000)

    th = threading.Thread(target=worker)
    th.start()
    try:
        assert entered.wait(10)
        with pytest.warns(gtorch.RoutingConflictWarning, match="'theirs'"):
            with gmp.mempool(sim, all_threads=True) as mine:
                leave.set()
                th.join(10)
    finally:
        leave.set()
        th.join(10)
        other.close()
    assert got["t"].pid == mine.id != got["tp"].id  # what the warning was about
    assert gtorch._routing.active_routes.get(0) == []
    with warnings.catch_warnings():  # one thread alone: no conflict
        warnings.simplefilter("error", gtorch.RoutingConflictWarning)
        with gmp.mempool(sim, all_threads=True), gmp.mempool(sim):
            pass


def test_process_wide_routing_is_warned_once(monkeypatch, sim):
    torch = install(monkeypatch, "2.5")
    got: dict[str, Any] = {}
    with pytest.warns(gtorch.ProcessWideRoutingWarning, match="every thread"):
        with gmp.mempool(sim):
            th = threading.Thread(target=lambda: got.update(t=torch.empty(1000)))
            th.start()
            th.join()
    assert got["t"].kind == "private"  # what torch 2.5-2.7 does
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with gmp.mempool(sim):
            pass


def test_concurrent_threads_get_their_own_torch_pools(monkeypatch, sim):
    torch = install(monkeypatch, "2.11")
    inside = threading.Barrier(2)
    results: dict[str, Any] = {}

    def worker(name: str) -> None:
        try:
            with gmp.mempool(sim) as tp:
                inside.wait(timeout=10)
                results[name] = (tp, torch.empty(1000))
                inside.wait(timeout=10)
        except BaseException as exc:  # noqa: BLE001
            results[name] = exc

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("a", "b")]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    (ta, xa), (tb, xb) = results["a"], results["b"]
    assert ta is not tb  # torch would refuse one pool for two threads at once
    assert xa.pid == ta.id and xb.pid == tb.id
    pools = gtorch.torch_pools(sim)
    assert len(pools) == 2
    with gmp.mempool(sim) as again:
        pass
    assert again is pools[0]  # the first one is reused


def test_stream_is_entered_with_the_pool(monkeypatch, sim):
    torch = install(monkeypatch)
    s = torch.cuda.Stream(0x5000)
    with gmp.mempool(sim, stream=s):
        assert torch.cuda.current_stream() is s
        x = torch.empty(1000)
    assert torch.cuda.current_stream().cuda_stream == 0
    assert torch._world.pools[x.pid].allocator.meta[x.ptr][2] == 0x5000  # the segment was asked for on s


def test_devices(monkeypatch, sim):
    torch = install(monkeypatch)
    with gmp.mempool(sim, device="cuda:1") as t1:
        pass
    with gmp.mempool(sim, device=torch.device("cuda", 1)) as t1b:
        x = torch.empty(1000, device=1)
    with gmp.mempool(sim, device=0) as t0:
        pass
    assert t1 is t1b and t1.device == 1 and t0.device == 0 and t0 is not t1
    assert x.pid == t1.id and allocated(sim, 1) == 2 * MiB and allocated(sim, 0) == 0
    assert gtorch.torch_pools(sim, device=1) == [t1]
    with pytest.raises(gmp.InvalidArgumentError, match="cuda"):
        gmp.mempool(sim, device="cpu").__enter__()
    with pytest.raises(TypeError):
        gmp.mempool(sim, device=True).__enter__()
    with pytest.raises(gmp.InvalidArgumentError):
        gmp.mempool(sim, device=torch.device("cpu")).__enter__()
    with pytest.raises(TypeError, match="gpumempool.MemPool"):
        gmp.mempool("not a pool")


def test_closed_pool_and_single_use_context(monkeypatch):
    install(monkeypatch)
    p = gmp.MemPool("sim", capacity=1 << 26)
    cm = gmp.mempool(p)
    with cm:
        pass
    with pytest.raises(gtorch.TorchIntegrationError, match="entered once"):
        cm.__enter__()
    p.close()
    with pytest.raises(gmp.PoolClosedError):
        with gmp.mempool(p):
            pass


def test_exiting_out_of_order_is_an_error(monkeypatch, sim):
    install(monkeypatch)
    other = gmp.MemPool("sim", capacity=1 << 26)
    outer, inner = gmp.mempool(sim), gmp.mempool(other)
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(gtorch.TorchIntegrationError, match="out of order"):
        outer.__exit__(None, None, None)
    inner.__exit__(None, None, None)
    other.close()


def test_mempool_options_are_fixed_per_torch_pool(monkeypatch, sim):
    torch = install(monkeypatch, "2.11")
    with gmp.mempool(sim, use_on_oom=True, no_split=True) as tp:
        a = torch.empty(1000)
    assert tp.options == {"use_on_oom": True, "no_split": True} and a.pid == tp.id
    # other options: another torch pool over the same gmp pool, torch's defaults
    with gmp.mempool(sim) as plain:
        b = torch.empty(1000)
    assert plain is not tp and plain.options == {"use_on_oom": False, "no_split": False} and b.pid == plain.id
    with gmp.mempool(sim, no_split=True) as split_only:
        pass
    assert split_only.options == {"use_on_oom": False, "no_split": True}
    # the same options again: the same torch pool
    with gmp.mempool(sim, use_on_oom=True, no_split=True) as again, gmp.mempool(sim) as plain_again:
        pass
    assert again is tp and plain_again is plain
    assert gtorch.torch_pools(sim) == [tp, plain, split_only]
    assert allocated(sim) == 2 * 2 * MiB  # both tensors in the gmp pool
    del a, b


@pytest.mark.filterwarnings("ignore::gpumempool.torch.ProcessWideRoutingWarning")
@pytest.mark.parametrize("variant, option, since", [
    ("2.7", "use_on_oom", "2.8"), ("2.7", "no_split", "2.10"), ("2.9", "no_split", "2.10")])
def test_mempool_options_need_a_torch_that_has_them(monkeypatch, sim, variant, option, since):
    install(monkeypatch, variant)
    with pytest.raises(gtorch.TorchVersionError) as exc:
        with gmp.mempool(sim, **{option: True}):
            pass
    assert str(exc.value) == (f"gmp.mempool('torchpool', {option}=True) needs torch.cuda.MemPool's {option} option "
                              f"(torch >= {since}); torch {variant}.0+fake's MemPool has none")
    assert exc.value.version == f"{variant}.0+fake" and exc.value.needed == f"torch >= {since}"
    assert gtorch.torch_pools(sim) == []  # no torch pool left behind
    with gmp.mempool(sim) as tp:  # without the option: fine
        pass
    assert gtorch.torch_pools(sim) == [tp]


def test_mempool_passes_the_options_this_torch_has(monkeypatch, sim):
    install(monkeypatch, "2.9")
    assert gtorch.capabilities().mem_pool_options == ("use_on_oom",)
    with gmp.mempool(sim, use_on_oom=True) as tp:
        pass
    assert tp.options == {"use_on_oom": True}


def test_begin_failure_leaves_nothing_half_done(monkeypatch, sim):
    torch = install(monkeypatch)
    other = gmp.MemPool("sim", capacity=1 << 26)
    real = torch._C._cuda_beginAllocateCurrentThreadToPool
    with gmp.mempool(sim) as ta:
        def fail(d, pid):
            if pid != ta.id:
                raise RuntimeError("boom")
            real(d, pid)

        torch._C._cuda_beginAllocateCurrentThreadToPool = fail
        with pytest.raises(RuntimeError, match="boom"):
            with gmp.mempool(other):
                pass
        x = torch.empty(100)  # the outer pool was resumed
    torch._C._cuda_beginAllocateCurrentThreadToPool = real
    assert x.pid == ta.id
    with gmp.mempool(other):
        pass  # its lane was handed back
    other.close()


# ---------------------------------------------------------------------------
# close, NCCL registrations and lanes (review fixes)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["2.7", "2.11"])
def test_close_with_live_tensors_deregisters_every_group(monkeypatch, variant):
    torch = install(monkeypatch, variant)
    warnings.simplefilter("ignore", gtorch.ProcessWideRoutingWarning)
    pool = gmp.MemPool("sim", name="regs", capacity=1 << 30)
    other = FakeBackend(torch._world, "mem_pool")
    gtorch.register(pool)  # the default group
    gtorch.register(pool, FakeGroup(other))  # a second group (tensor parallel, say)
    with gmp.mempool(pool):
        x = torch.empty(3 * MiB)  # alive at close: release() refuses
    with pytest.warns(gmp.LeakWarning, match="cannot release"):
        pool.close()
    assert torch._backend.pools == set() and torch._backend.segments == set()
    assert other.pools == set() and other.segments == set()  # not only the default group's
    assert id(pool) not in gtorch._lanes.pool_states
    del x


def test_entering_or_registering_while_close_runs_is_refused(monkeypatch):
    torch = install(monkeypatch, "2.11")
    pool = gmp.MemPool("sim", name="closing", capacity=1 << 30)
    with gmp.mempool(pool):
        pass
    seen: list[BaseException] = []
    real = gtorch.forget_pool

    def forget_then_another_thread_comes(p: gmp.MemPool) -> Optional[str]:
        problem = real(p)
        assert not p.closed  # the window: forgotten, not closed yet in the engine
        for attempt in (lambda: gmp.mempool(p).__enter__(), lambda: gtorch.register(p)):
            try:
                attempt()
            except BaseException as exc:  # noqa: BLE001
                seen.append(exc)
        return problem

    monkeypatch.setattr(gtorch, "forget_pool", forget_then_another_thread_comes)
    pool.close()
    assert [type(e) for e in seen] == [gmp.PoolClosedError, gmp.PoolClosedError]
    assert id(pool) not in gtorch._lanes.pool_states and torch._world.captures.get(0) == []


def test_a_failed_registration_of_a_new_torch_pool_undoes_the_others(monkeypatch, sim):
    torch = install(monkeypatch, "2.11")
    a = torch._backend
    b = FakeBackend(torch._world, "mem_pool")
    gtorch.register(sim)
    gtorch.register(sim, FakeGroup(b))
    gc.collect()
    gtorch.release(sim)  # the torch pools go, the registrations stay
    assert a.pools == set() == b.pools
    b.comm_error = True
    for _ in range(3):
        with pytest.raises(gtorch.TorchIntegrationError):
            with gmp.mempool(sim):
                pass
    st = gtorch._lanes.pool_states[id(sim)]
    assert st.lanes == [] and a.pools == set()  # the torch pools dropped are not left registered with a
    assert all(r.lanes == {} for r in st.registrations)
    b.comm_error = False
    with gmp.mempool(sim) as tp:
        x = torch.empty(1000)
    assert a.pools == {tp.id} == b.pools and a.registered(tp.id) == {x.ptr} == b.registered(tp.id)


def test_a_torch_pool_whose_route_did_not_end_is_not_reused(monkeypatch, sim):
    torch = install(monkeypatch, "2.11")
    real = torch._C._cuda_endAllocateToPool
    calls = {"n": 0}

    def end_fails_once(d: int, pid: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("endAllocatePool: boom")
        real(d, pid)

    torch._C._cuda_endAllocateToPool = end_fails_once
    with pytest.raises(gtorch.TorchIntegrationError, match="ending the routing"):
        with gmp.mempool(sim) as bad:
            pass
    with gmp.mempool(sim) as good:  # torch still records to `bad`: a new torch pool
        x = torch.empty(1000)
    assert good is not bad and x.pid == good.id
    assert len(gtorch.torch_pools(sim)) == 2
    del x, good, bad
    gc.collect()
    gtorch.release(sim)  # the unusable one's segments go back too
    assert gtorch.torch_pools(sim) == []


def test_set_torch_allocator_again_on_the_closed_installed_pool(monkeypatch):
    install(monkeypatch)
    p = gmp.MemPool("sim", capacity=1 << 26)
    gmp.set_torch_allocator(p)
    p.close()
    with pytest.raises(gmp.PoolClosedError):
        gmp.set_torch_allocator(p)


def test_release_to_backend_of_a_pool_closed_meanwhile(monkeypatch):
    torch = install(monkeypatch)
    p = gmp.MemPool("sim", capacity=1 << 30)
    with gmp.mempool(p):
        torch.empty(1000)
    real_gc = gtorch._release.gc

    def collect_and_close() -> int:  # another thread closes the pool at this point
        n = real_gc.collect()
        p.close()
        return n

    monkeypatch.setattr(gtorch._release, "gc", types.SimpleNamespace(collect=collect_and_close))
    assert gtorch.release(p, to_backend=True) == 2 * MiB
    assert p.closed


def test_torch_memory_stats_take_torchs_device_argument(monkeypatch):
    torch = install(monkeypatch)
    p = gmp.MemPool("sim", name="devs", devices=2, capacity=1 << 30)
    gmp.set_torch_allocator(p)
    key = "allocated_bytes.all.current"
    with torch.cuda.device(1):
        x = torch.empty(MiB)  # this rank works on cuda:1
        for dev in (None, "cuda", torch.device("cuda"), 1, "cuda:1", torch.device("cuda", 1)):
            assert gmp.torch_memory_stats(dev)[key] == MiB, dev  # torch: the current device
        assert gmp.torch_memory_stats(0)[key] == 0
        y = torch.empty(MiB, device=0)
        assert gmp.torch_memory_stats()[key] == MiB and gmp.torch_memory_stats("all")[key] == 2 * MiB
        assert "device 1" in gmp.torch_memory_summary() and "all devices" in gmp.torch_memory_summary("all")
    with pytest.raises(gmp.InvalidArgumentError):
        gmp.torch_memory_stats("cpu")
    del x, y


def test_exit_report_leaves_out_what_torch_caches(monkeypatch):
    torch = install(monkeypatch)
    p = gmp.MemPool("sim", name="exit-report", capacity=1 << 30)
    plain = gmp.MemPool("sim", name="exit-plain", capacity=1 << 30)
    try:
        with gmp.mempool(p):
            x = torch.empty(1000)
            y = torch.empty(3 * MiB)
        del x
        s = p.stats()
        assert s["allocation.all.current"] == 2  # two torch segments, one of them free in torch's cache
        assert gtorch.exit_leaks(p, 2, s["allocated_bytes.all.current"]) == (
            1, 20 * MiB, "; 1 of them, 20971520 bytes, are segments of torch pools over it (gmp.mempool) "
            "holding tensors still alive")
        assert gtorch.exit_leaks(plain, 3, 100) == (3, 100, "")  # torch never used it
        del y
        assert gtorch.exit_leaks(p, 2, 22 * MiB) == (0, 0, "")
        # what the interpreter's exit does (gpumempool._lifecycle.report_leaks_at_exit)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            gmp._lifecycle.report_leaks_at_exit()
        assert not [w for w in rec if "exit-report" in str(w.message)]
    finally:
        gc.collect()
        gtorch.release(p)
        p.close()
        plain.close()


def test_process_wide_routing_warning_names_the_cross_pool_free(monkeypatch, sim):
    torch = install(monkeypatch, "2.5")
    other = gmp.MemPool("sim", name="theirs", capacity=1 << 30)
    entered, done = threading.Event(), threading.Event()
    got: dict[str, Any] = {}

    def worker() -> None:  # another thread, inside a gmp.mempool of its own
        with gmp.mempool(other):
            entered.set()
            done.wait(10)
            got["t"] = torch.empty(1000)

    try:
        with pytest.warns(gtorch.ProcessWideRoutingWarning, match=r"freed through this pool's free function, a cross-pool"):
            with gmp.mempool(sim) as mine:
                th = threading.Thread(target=worker)
                th.start()
                entered.wait(10)
                done.set()
                th.join(10)
        # what the warning says: the segment lands in sim's torch pool, made by another pool's allocator
        assert got["t"].pid == mine.id and torch._world.misroutes
    finally:
        done.set()
        got.clear()
        gc.collect()
        other.close()


def _slot(p: gmp.MemPool) -> int:
    return int(p.pluggable_symbols(segments=True)[1].rsplit("_", 1)[1])


def test_slot_of_a_pool_closed_inside_mempool_serves_no_other_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Closing a pool whose torch pool could not be released (a thread is
    still inside gmp.mempool(pool)) retires its C slot: torch may still call
    those functions, which must never reach another pool."""
    torch = install(monkeypatch, "2.11")
    a = gmp.MemPool("sim", name="A", capacity=1 << 30)
    others: list[gmp.MemPool] = []
    try:
        with gmp.mempool(a):
            s = _slot(a)
            with pytest.warns(gmp.LeakWarning, match="closing pool anyway"):
                a.close()
            for _ in range(64):  # until every free slot is taken
                p = gmp.MemPool("sim", name="B", capacity=1 << 30)
                others.append(p)
                try:
                    got = _slot(p)
                except gmp.GpuMemPoolError as exc:
                    assert "C entry points are in use" in str(exc)
                    break
                assert got != s, "the slot of a pool torch may still call went to another pool"
            with pytest.raises(Exception):  # noqa: B017 - the fake raises what torch would
                torch.empty(MiB)  # A's functions refuse: no pool holds the slot
            assert all(p.stats()["allocated_bytes.all.current"] == 0 for p in others)
    finally:
        for p in others:
            p.close()


def test_errors_of_calls_after_close_reach_hook_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """In full replacement torch frees tensors that outlived the pool through
    its C functions; what they record reaches gmp.torch.hook_errors()."""
    from gpumempool import torch as gtorch

    torch = install(monkeypatch, "2.11")
    p = gmp.MemPool("sim", name="full", capacity=1 << 30)
    gmp.set_torch_allocator(p)
    t = torch.empty(MiB)
    with pytest.warns(gmp.LeakWarning):
        p.close()
    del t  # torch frees through gmp_free_<slot>: no pool holds the slot
    errs = gtorch.hook_errors()
    assert any("no pool holds this slot" in e for e in errs), errs
    assert gtorch.hook_errors() == [], "returned and cleared"
